//! Page staging: copies of whole pages out of a cache buffer, with their checksums, computed
//! by the backend over the pages' layout descriptor (the same `page_checksums` the cache
//! verifies with). A transfer's partly filled last page travels as the bytes of its
//! entries only ([`sparsekit_host::cache::CacheSpec::tail_spans`]): both sides zero the
//! rest of that page before checksumming it, so the digests agree.

use std::ops::Range;

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

/// Zeroes the bytes of `page` outside `spans`.
pub fn zero_outside(page: &mut [u8], spans: &[Range<usize>]) {
    let mut at = 0;
    for r in spans {
        let start = r.start.min(page.len());
        page[at.min(start)..start].fill(0);
        at = at.max(r.end.min(page.len()));
    }
    let n = page.len();
    page[at.min(n)..].fill(0);
}

/// Copies pages `ids` of `region` in `buf` out, back to back, with their checksums; with
/// `tail`, the last page keeps only those byte ranges (the rest zeroed) and is checksummed
/// so.
pub fn stage<B: Backend>(
    b: &B,
    region: PagedRegion,
    buf: &B::Buffer,
    ids: &[i32],
    tail: Option<&[Range<usize>]>,
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
    let mut bytes = b.download(&staging)?;
    let tail = tail.zip(ids.len().checked_sub(1));
    // Whole pages are checksummed as staged; a partial last page after its zeroing.
    let whole = tail.map_or(ids.len(), |(_, last)| last);
    let mut sums = if whole > 0 {
        checksums(b, dst, &staging, &dst_ids[..whole])?
    } else {
        Vec::new()
    };
    if let Some((spans, last)) = tail {
        let page = dst.layout.bytes_per_page();
        let one = &mut bytes[last * page..(last + 1) * page];
        zero_outside(one, spans);
        let up = b.upload(one)?;
        sums.extend(checksums(
            b,
            PagedRegion::contiguous(dst.layout, 1),
            &up,
            &[0],
        )?);
    }
    Ok(StagedPages {
        bytes,
        checksums: sums,
    })
}
