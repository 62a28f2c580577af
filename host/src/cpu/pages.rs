//! CPU page copies and page checksums (parallel over pages).

use rayon::prelude::*;
use sparsekit_kernels::checksum::page_checksum;

use crate::ops::{CopyPages, PageChecksums};

/// Copies the pages. Inputs are validated by the caller (ids in range, unique
/// destinations, equal layouts).
pub fn copy_pages(op: &CopyPages<'_>, src: &[u8], dst: &mut [u8]) {
    let bytes = op.src.layout.bytes_per_page();
    // One &mut slice per destination page, taken by the copy that writes it.
    let mut slots: Vec<Option<&mut [u8]>> = dst[op.dst.offset..]
        .chunks_mut(op.dst.stride)
        .take(op.dst.num_pages)
        .map(|c| Some(&mut c[..bytes]))
        .collect();
    let work: Vec<(&mut [u8], usize)> = op
        .dst_ids
        .iter()
        .zip(op.src_ids)
        .filter_map(|(&d, &s)| slots[d as usize].take().map(|page| (page, s as usize)))
        .collect();
    work.into_par_iter()
        .for_each(|(page, s)| page.copy_from_slice(&src[op.src.page_range(s)]));
}

/// Checksums the pages. Inputs are validated by the caller.
pub fn page_checksums(op: &PageChecksums<'_>, pool: &[u8], out: &mut [u64]) {
    out.par_iter_mut()
        .zip(op.ids.par_iter())
        .for_each(|(o, &id)| *o = page_checksum(&pool[op.region.page_range(id as usize)]));
}
