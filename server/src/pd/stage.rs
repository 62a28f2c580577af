//! Page staging: copies of whole pages out of a cache buffer, with their checksums, computed
//! by the backend over the pages' layout descriptor (the same `page_checksums` the cache
//! verifies with).

use sparsekit_host::ops::{CopyPages, PageChecksums, PagedRegion};
use sparsekit_host::Backend;

use crate::pd::error::PdError;

/// Pages of one layer and kind, copied out back to back, with one checksum per page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedPages {
    /// `ids.len() · bytes_per_page` bytes.
    pub bytes: Vec<u8>,
    pub checksums: Vec<u64>,
}

/// Checksums of pages `ids` of `region` in `buf`.
pub fn checksums<B: Backend>(
    b: &B,
    region: PagedRegion,
    buf: &B::Buffer,
    ids: &[i32],
) -> Result<Vec<u64>, PdError> {
    let mut out = b.alloc(ids.len() * 8)?;
    b.page_checksums(&PageChecksums { region, ids }, buf, &mut out)?;
    Ok(b.download(&out)?
        .chunks_exact(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect())
}

/// Copies pages `ids` of `region` in `buf` out, back to back, with their checksums.
pub fn stage<B: Backend>(
    b: &B,
    region: PagedRegion,
    buf: &B::Buffer,
    ids: &[i32],
) -> Result<StagedPages, PdError> {
    let dst = PagedRegion::contiguous(region.layout, ids.len());
    let mut staging = b.alloc(dst.layout.bytes_per_page() * ids.len())?;
    let dst_ids: Vec<i32> = (0..ids.len() as i32).collect();
    b.copy_pages(
        &CopyPages {
            src: region,
            dst,
            src_ids: ids,
            dst_ids: &dst_ids,
        },
        buf,
        &mut staging,
    )?;
    let checksums = checksums(b, dst, &staging, &dst_ids)?;
    Ok(StagedPages {
        bytes: b.download(&staging)?,
        checksums,
    })
}
