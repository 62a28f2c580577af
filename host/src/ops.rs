//! Op descriptors: the host-side half of every op.
//!
//! An op call is a descriptor (shapes, layout, and host metadata such as slot mappings,
//! page tables and key ranges) plus backend buffers for the bulk tensors. Descriptors
//! validate their metadata and the byte sizes of the buffers here, once, for every backend,
//! before anything is written: a rejected call leaves every buffer untouched.
//!
//! Tensor conventions (all little-endian, row-major, sizes in elements unless stated):
//! - `keys` (index_k_store): bf16 `[n_tokens, head_dim]`.
//! - `kv` (kv_store): bf16 `[n_tokens, nope_dim + rope_dim]`, latent first.
//! - `q` (indexer): bf16 `[n_rows, n_heads, head_dim]`; `weights`: f32 `[n_rows, n_heads]`.
//! - `logits`: f32 `[n_rows, row_stride]`, column = token position in the row's request.
//! - top-k output: i32 `[n_rows, k]`.
//! - `q` (sparse_mla): bf16 `[n_tokens, n_heads, d_qk]`; `indices`: i32 `[n_tokens, topk]`;
//!   `out`: bf16 `[n_tokens, n_heads, d_v]`; `lse`: f32 `[n_tokens, n_heads]`.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::layout::{IndexKLayout, KvLayout, PageLayout};

/// The ops every backend implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    IndexKStore,
    KvStore,
    IndexerLogits,
    Topk,
    SparseMla,
    CopyPages,
    PageChecksums,
}

impl Op {
    /// Every op, in suite order.
    pub const ALL: [Op; 7] = [
        Op::IndexKStore,
        Op::KvStore,
        Op::IndexerLogits,
        Op::Topk,
        Op::SparseMla,
        Op::CopyPages,
        Op::PageChecksums,
    ];

    /// snake_case name.
    pub fn name(&self) -> &'static str {
        match self {
            Op::IndexKStore => "index_k_store",
            Op::KvStore => "kv_store",
            Op::IndexerLogits => "indexer_logits",
            Op::Topk => "topk",
            Op::SparseMla => "sparse_mla",
            Op::CopyPages => "copy_pages",
            Op::PageChecksums => "page_checksums",
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Checks that a buffer holds exactly `expected` bytes.
pub fn check_bytes(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::BufferSize {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Checks that a host array holds exactly `expected` elements.
pub fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::Shape {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Checks a slot mapping: each slot is `-1` (skip) or below `capacity`, and no slot is
/// written twice.
pub fn check_slots(what: &'static str, slots: &[i64], capacity: usize) -> Result<()> {
    let mut seen = std::collections::HashMap::with_capacity(slots.len());
    for (i, &s) in slots.iter().enumerate() {
        if s == -1 {
            continue;
        }
        if s < 0 || s as u64 >= capacity as u64 {
            return Err(Error::SlotOutOfRange {
                what,
                index: i,
                slot: s,
                capacity,
            });
        }
        if let Some(first) = seen.insert(s, i) {
            return Err(Error::DuplicateSlot {
                what,
                slot: s,
                first,
                second: i,
            });
        }
    }
    Ok(())
}

/// Per-request page ids, `[num_requests, max_pages]` row-major; `-1` marks an unmapped
/// entry. Entry `p` of a request holds its tokens `p*page_size .. (p+1)*page_size`.
#[derive(Clone, Copy, Debug)]
pub struct PageTable<'a> {
    pages: &'a [i32],
    max_pages: usize,
}

impl<'a> PageTable<'a> {
    /// Wraps a row-major table whose rows are `max_pages` long.
    pub fn new(pages: &'a [i32], max_pages: usize) -> Result<Self> {
        if max_pages == 0 || pages.len() % max_pages != 0 {
            return Err(Error::invalid(
                "page_table",
                format!(
                    "{} entries is not a whole number of rows of {max_pages}",
                    pages.len()
                ),
            ));
        }
        Ok(PageTable { pages, max_pages })
    }
    /// Requests (rows) in the table.
    pub fn num_requests(&self) -> usize {
        self.pages.len() / self.max_pages
    }
    /// Entries per request.
    pub fn max_pages(&self) -> usize {
        self.max_pages
    }
    /// The raw row-major entries.
    pub fn as_slice(&self) -> &'a [i32] {
        self.pages
    }
    /// The page ids of request `r`.
    pub fn row(&self, r: usize) -> &'a [i32] {
        &self.pages[r * self.max_pages..(r + 1) * self.max_pages]
    }
    /// Slot of token position `pos` of request `r` (assumes a validated table).
    #[inline]
    pub fn slot(&self, r: usize, pos: usize, page_size: usize) -> usize {
        self.pages[r * self.max_pages + pos / page_size] as usize * page_size + pos % page_size
    }
    /// Checks that positions `0..end` of request `r` map to pages inside a pool of
    /// `num_pages` pages.
    pub fn check_covers(
        &self,
        r: usize,
        end: usize,
        page_size: usize,
        num_pages: usize,
    ) -> Result<()> {
        let needed = end.div_ceil(page_size);
        if needed > self.max_pages {
            return Err(Error::invalid(
                "page_table",
                format!(
                    "request {r} needs {needed} pages for {end} tokens, rows hold {}",
                    self.max_pages
                ),
            ));
        }
        for (p, &page) in self.row(r)[..needed].iter().enumerate() {
            if page < 0 || page as usize >= num_pages {
                return Err(Error::PageOutOfRange {
                    what: "page_table",
                    index: r * self.max_pages + p,
                    page: page as i64,
                    num_pages,
                });
            }
        }
        Ok(())
    }
}

/// One row of a ragged query batch (defined with the kernels that read it).
pub use sparsekit_kernels::params::QueryRange;

/// The rows of decode-form queries: request `r` with context length `L` (including its
/// `next_n` new tokens) contributes rows `j = 0..next_n`, row `j` seeing `[0, L - next_n + j + 1)`.
pub fn decode_rows(context_lens: &[u32], next_n: usize) -> Result<Vec<QueryRange>> {
    if next_n == 0 {
        return Err(Error::invalid("next_n", "must be at least 1"));
    }
    let mut rows = Vec::with_capacity(context_lens.len() * next_n);
    for (r, &len) in context_lens.iter().enumerate() {
        if (len as usize) < next_n {
            return Err(Error::invalid(
                "context_lens",
                format!("request {r} has context {len} < next_n {next_n}"),
            ));
        }
        for j in 0..next_n {
            rows.push(QueryRange {
                request: r as u32,
                start: 0,
                end: len - (next_n - 1 - j) as u32,
            });
        }
    }
    Ok(rows)
}

fn check_rows(
    rows: &[QueryRange],
    page_table: &PageTable<'_>,
    page_size: usize,
    num_pages: usize,
    row_stride: usize,
) -> Result<()> {
    for (i, q) in rows.iter().enumerate() {
        let bad = |reason: String| Error::InvalidRange {
            row: i,
            start: q.start as i64,
            end: q.end as i64,
            reason,
        };
        if q.start > q.end {
            return Err(bad("start after end".into()));
        }
        if q.end as usize > row_stride {
            return Err(bad(format!("end beyond row_stride {row_stride}")));
        }
        if q.request as usize >= page_table.num_requests() {
            return Err(bad(format!(
                "request {} not in page table of {} requests",
                q.request,
                page_table.num_requests()
            )));
        }
        page_table.check_covers(q.request as usize, q.end as usize, page_size, num_pages)?;
    }
    Ok(())
}

/// `index_k_store`: quantize (fp8) or copy (bf16) `slots.len()` bf16 keys into a paged
/// index-K buffer at the given slots (`-1` = skip).
#[derive(Clone, Copy, Debug)]
pub struct IndexKStore<'a> {
    pub layout: IndexKLayout,
    pub slots: &'a [i64],
}

impl IndexKStore<'_> {
    /// Validates the call; returns the number of pages in the cache.
    pub fn validate(&self, keys_bytes: usize, cache_bytes: usize) -> Result<usize> {
        check_bytes(
            "keys",
            self.slots.len() * self.layout.head_dim() * 2,
            keys_bytes,
        )?;
        let pages = self.layout.pages_in("index-K cache", cache_bytes)?;
        check_slots("slots", self.slots, pages * self.layout.page_size())?;
        Ok(pages)
    }
}

/// `kv_store`: store `slots.len()` bf16 tokens (`[latent | rope]`) into a paged KV buffer.
#[derive(Clone, Copy, Debug)]
pub struct KvStore<'a> {
    pub layout: KvLayout,
    pub slots: &'a [i64],
}

impl KvStore<'_> {
    /// Validates the call; returns the number of pages in the cache.
    pub fn validate(&self, kv_bytes: usize, cache_bytes: usize) -> Result<usize> {
        check_bytes("kv", self.slots.len() * self.layout.d_qk() * 2, kv_bytes)?;
        let pages = self.layout.pages_in("KV cache", cache_bytes)?;
        check_slots("slots", self.slots, pages * self.layout.page_size())?;
        Ok(pages)
    }
}

/// `indexer_logits`: `I[t, s] = Σ_h w[t,h] · ReLU(q[t,h] · k[s]) · k_scale[s]` for every row
/// `t` and every position `s` in the row's range; every other column of the row up to
/// `row_stride` is `-inf`. Keys are read from the paged index-K buffer through the page
/// table (bf16 keys have scale 1).
#[derive(Clone, Debug)]
pub struct IndexerLogits<'a> {
    pub layout: IndexKLayout,
    pub n_heads: usize,
    pub page_table: PageTable<'a>,
    pub rows: Vec<QueryRange>,
    pub row_stride: usize,
}

impl<'a> IndexerLogits<'a> {
    /// Decode form: per request, `next_n` queries over its `context_lens[r]` tokens (causal).
    pub fn decode(
        layout: IndexKLayout,
        n_heads: usize,
        page_table: PageTable<'a>,
        context_lens: &[u32],
        next_n: usize,
        row_stride: usize,
    ) -> Result<Self> {
        check_len(
            "context_lens",
            page_table.num_requests(),
            context_lens.len(),
        )?;
        Ok(IndexerLogits {
            layout,
            n_heads,
            page_table,
            rows: decode_rows(context_lens, next_n)?,
            row_stride,
        })
    }

    /// Validates the call against the buffer sizes (bytes); returns the pages in the cache.
    pub fn validate(
        &self,
        q_bytes: usize,
        weights_bytes: usize,
        cache_bytes: usize,
        out_bytes: usize,
    ) -> Result<usize> {
        if self.n_heads == 0 {
            return Err(Error::invalid("n_heads", "must be positive"));
        }
        let n = self.rows.len();
        check_bytes("q", n * self.n_heads * self.layout.head_dim() * 2, q_bytes)?;
        check_bytes("weights", n * self.n_heads * 4, weights_bytes)?;
        check_bytes("logits", n * self.row_stride * 4, out_bytes)?;
        let pages = self.layout.pages_in("index-K cache", cache_bytes)?;
        check_rows(
            &self.rows,
            &self.page_table,
            self.layout.page_size(),
            pages,
            self.row_stride,
        )?;
        Ok(pages)
    }
}

/// What top-k writes for each selected position.
#[derive(Clone, Copy, Debug)]
pub enum TopkOutput<'a> {
    /// The token position within the request (the logits column).
    Positions,
    /// The cache slot `page * page_size + offset` of that position.
    Slots {
        page_table: PageTable<'a>,
        page_size: usize,
    },
}

/// `topk`: exact top-`k` per row over the columns in the row's range, ignoring `-inf` and
/// NaN entries; ties broken by lower position. The selected entries are written in
/// ascending position order, followed by `-1` padding when fewer than `k` are valid.
#[derive(Clone, Copy, Debug)]
pub struct Topk<'a> {
    pub k: usize,
    pub row_stride: usize,
    pub rows: &'a [QueryRange],
    pub output: TopkOutput<'a>,
}

impl Topk<'_> {
    /// Validates the call against the buffer sizes (bytes).
    pub fn validate(&self, logits_bytes: usize, out_bytes: usize) -> Result<()> {
        if self.k == 0 {
            return Err(Error::invalid("k", "must be positive"));
        }
        if self.row_stride > i32::MAX as usize {
            return Err(Error::invalid("row_stride", "positions must fit in i32"));
        }
        let n = self.rows.len();
        check_bytes("logits", n * self.row_stride * 4, logits_bytes)?;
        check_bytes("topk", n * self.k * 4, out_bytes)?;
        for (i, q) in self.rows.iter().enumerate() {
            if q.start > q.end || q.end as usize > self.row_stride {
                return Err(Error::InvalidRange {
                    row: i,
                    start: q.start as i64,
                    end: q.end as i64,
                    reason: format!(
                        "must satisfy start <= end <= row_stride {}",
                        self.row_stride
                    ),
                });
            }
        }
        if let TopkOutput::Slots {
            page_table,
            page_size,
        } = self.output
        {
            if page_size == 0 {
                return Err(Error::invalid("page_size", "must be positive"));
            }
            for (i, q) in self.rows.iter().enumerate() {
                if q.request as usize >= page_table.num_requests() {
                    return Err(Error::InvalidRange {
                        row: i,
                        start: q.start as i64,
                        end: q.end as i64,
                        reason: format!("request {} not in page table", q.request),
                    });
                }
                // Slots must fit in i32; pages beyond the pool are the consumer's check.
                page_table.check_covers(
                    q.request as usize,
                    q.end as usize,
                    page_size,
                    i32::MAX as usize / page_size,
                )?;
            }
        }
        Ok(())
    }
}

/// `sparse_mla`: per token and head, softmax attention over the token's `topk` cache slots
/// (`-1` skipped): `out = Σ_j softmax(scale · q·k_j) v_j`, `lse = ln Σ_j exp(scale · q·k_j)`
/// (natural log). `k_j` is the token's dequantised `[latent | rope]`, `v_j` its latent. A
/// token with no valid slot gets `out = 0` and `lse = -inf`.
#[derive(Clone, Copy, Debug)]
pub struct SparseMla {
    pub layout: KvLayout,
    pub n_tokens: usize,
    pub n_heads: usize,
    pub topk: usize,
    pub softmax_scale: f32,
}

impl SparseMla {
    /// Validates the call against the buffer sizes (bytes); returns the pages in the cache.
    pub fn validate(
        &self,
        q_bytes: usize,
        cache_bytes: usize,
        indices_bytes: usize,
        out_bytes: usize,
        lse_bytes: usize,
    ) -> Result<usize> {
        if self.n_heads == 0 || self.topk == 0 {
            return Err(Error::invalid("n_heads/topk", "must be positive"));
        }
        if !self.softmax_scale.is_finite() {
            return Err(Error::invalid("softmax_scale", "must be finite"));
        }
        let (t, h) = (self.n_tokens, self.n_heads);
        check_bytes("q", t * h * self.layout.d_qk() * 2, q_bytes)?;
        check_bytes("indices", t * self.topk * 4, indices_bytes)?;
        check_bytes("out", t * h * self.layout.nope_dim() * 2, out_bytes)?;
        check_bytes("lse", t * h * 4, lse_bytes)?;
        self.layout.pages_in("KV cache", cache_bytes)
    }

    /// Checks that every index is `-1` or a slot of a cache of `pages` pages.
    pub fn check_indices(&self, indices: &[i32], pages: usize) -> Result<()> {
        let capacity = pages * self.layout.page_size();
        match indices
            .iter()
            .enumerate()
            .find(|(_, &s)| s < -1 || s >= 0 && s as usize >= capacity)
        {
            Some((i, &s)) => Err(Error::SlotOutOfRange {
                what: "indices",
                index: i,
                slot: s as i64,
                capacity,
            }),
            None => Ok(()),
        }
    }
}

/// Where the pages of one layout sit in a buffer: page `i` occupies bytes
/// `offset + i·stride .. offset + i·stride + bytes_per_page`. A plain pool is
/// [`PagedRegion::contiguous`]; a page-first host pool (all layers of a page together)
/// has `stride = Σ layers' bytes_per_page` and a per-layer `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedRegion {
    pub layout: PageLayout,
    /// Bytes before page 0.
    pub offset: usize,
    /// Bytes from one page to the next (at least `bytes_per_page`).
    pub stride: usize,
    pub num_pages: usize,
}

impl PagedRegion {
    /// Pages packed back to back from byte 0.
    pub fn contiguous(layout: impl Into<PageLayout>, num_pages: usize) -> Self {
        let layout = layout.into();
        PagedRegion {
            layout,
            offset: 0,
            stride: layout.bytes_per_page(),
            num_pages,
        }
    }

    /// Checks the region fits a buffer of `buffer_bytes` bytes.
    pub fn check(&self, what: &'static str, buffer_bytes: usize) -> Result<()> {
        let page = self.layout.bytes_per_page();
        if self.stride < page {
            return Err(Error::invalid(
                what,
                format!(
                    "stride {} is smaller than a page ({page} bytes)",
                    self.stride
                ),
            ));
        }
        let end = match self.num_pages {
            0 => self.offset,
            n => self.offset + (n - 1) * self.stride + page,
        };
        if end > buffer_bytes {
            return Err(Error::BufferSize {
                what,
                expected: end,
                actual: buffer_bytes,
            });
        }
        Ok(())
    }

    /// Byte range of page `id` (assumes a validated id).
    pub fn page_range(&self, id: usize) -> std::ops::Range<usize> {
        let start = self.offset + id * self.stride;
        start..start + self.layout.bytes_per_page()
    }

    fn check_ids(&self, what: &'static str, ids: &[i32]) -> Result<()> {
        for (i, &p) in ids.iter().enumerate() {
            if p < 0 || p as usize >= self.num_pages {
                return Err(Error::PageOutOfRange {
                    what,
                    index: i,
                    page: p as i64,
                    num_pages: self.num_pages,
                });
            }
        }
        Ok(())
    }
}

/// `copy_pages`: page `src_ids[i]` of `src` is copied to page `dst_ids[i]` of `dst`. The two
/// regions must carry the same layout descriptor (same fingerprint): a page is never
/// reinterpreted in another layout.
#[derive(Clone, Copy, Debug)]
pub struct CopyPages<'a> {
    pub src: PagedRegion,
    pub dst: PagedRegion,
    pub src_ids: &'a [i32],
    pub dst_ids: &'a [i32],
}

impl CopyPages<'_> {
    /// Validates the call against the buffer sizes (bytes).
    pub fn validate(&self, src_bytes: usize, dst_bytes: usize) -> Result<()> {
        let (fs, fd) = (self.src.layout.fingerprint(), self.dst.layout.fingerprint());
        if fs != fd {
            return Err(Error::LayoutMismatch {
                what: "copy_pages destination",
                expected: fs,
                actual: fd,
            });
        }
        check_len("dst_ids", self.src_ids.len(), self.dst_ids.len())?;
        self.src.check("copy_pages source", src_bytes)?;
        self.dst.check("copy_pages destination", dst_bytes)?;
        self.src.check_ids("src_ids", self.src_ids)?;
        self.dst.check_ids("dst_ids", self.dst_ids)?;
        let mut seen = std::collections::HashMap::with_capacity(self.dst_ids.len());
        for (i, &p) in self.dst_ids.iter().enumerate() {
            if let Some(first) = seen.insert(p, i) {
                return Err(Error::DuplicatePage {
                    what: "dst_ids",
                    page: p as i64,
                    first,
                    second: i,
                });
            }
        }
        Ok(())
    }
}

/// `page_checksums`: the 64-bit checksum (`sparsekit_kernels::checksum`) of each page
/// `ids[i]` of `region`, written as u64 `[ids.len()]`.
#[derive(Clone, Copy, Debug)]
pub struct PageChecksums<'a> {
    pub region: PagedRegion,
    pub ids: &'a [i32],
}

impl PageChecksums<'_> {
    /// Validates the call against the buffer sizes (bytes).
    pub fn validate(&self, pool_bytes: usize, out_bytes: usize) -> Result<()> {
        self.region.check("page_checksums pool", pool_bytes)?;
        self.region.check_ids("ids", self.ids)?;
        check_bytes("checksums", self.ids.len() * 8, out_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::IndexKDtype;

    #[test]
    fn slot_checks() {
        assert!(check_slots("s", &[0, 5, -1, 7, -1], 8).is_ok());
        assert!(matches!(
            check_slots("s", &[0, 8], 8),
            Err(Error::SlotOutOfRange {
                index: 1,
                slot: 8,
                ..
            })
        ));
        assert!(matches!(
            check_slots("s", &[-2], 8),
            Err(Error::SlotOutOfRange { slot: -2, .. })
        ));
        assert!(matches!(
            check_slots("s", &[3, 1, 3], 8),
            Err(Error::DuplicateSlot {
                first: 0,
                second: 2,
                ..
            })
        ));
    }

    #[test]
    fn decode_rows_are_causal() {
        let rows = decode_rows(&[5, 1], 1).unwrap();
        assert_eq!(rows[0].end, 5);
        assert_eq!(rows[1].end, 1);
        let rows = decode_rows(&[5], 2).unwrap();
        assert_eq!((rows[0].end, rows[1].end), (4, 5));
        assert!(decode_rows(&[1], 2).is_err());
        assert!(decode_rows(&[1], 0).is_err());
    }

    #[test]
    fn indexer_validation_errors() {
        let layout = IndexKLayout::new(IndexKDtype::Bf16, 16, 4).unwrap();
        let pages = [0, 1, -1, 0, 0, 0];
        let pt = PageTable::new(&pages, 3).unwrap();
        let op = IndexerLogits::decode(layout, 2, pt, &[8, 3], 1, 8).unwrap();
        let cache = layout.buffer_bytes(2);
        let (q, w, out) = (2 * 2 * 16 * 2, 2 * 2 * 4, 2 * 8 * 4);
        assert_eq!(op.validate(q, w, cache, out).unwrap(), 2);
        assert!(matches!(
            op.validate(q + 2, w, cache, out),
            Err(Error::BufferSize { what: "q", .. })
        ));
        assert!(matches!(
            op.validate(q, w, cache + 1, out),
            Err(Error::BufferSize { .. })
        ));
        // A pool of one page does not hold page 1.
        assert!(matches!(
            op.validate(q, w, layout.buffer_bytes(1), out),
            Err(Error::PageOutOfRange { page: 1, .. })
        ));
        // Context 9 reaches the unmapped third entry.
        let op = IndexerLogits::decode(layout, 2, pt, &[9, 3], 1, 9).unwrap();
        assert!(matches!(
            op.validate(q, w, cache, 2 * 9 * 4),
            Err(Error::PageOutOfRange { page: -1, .. })
        ));
        // Row stride too small for the context.
        let op = IndexerLogits::decode(layout, 2, pt, &[8, 3], 1, 7).unwrap();
        assert!(matches!(
            op.validate(q, w, cache, 2 * 7 * 4),
            Err(Error::InvalidRange { row: 0, .. })
        ));
        assert!(PageTable::new(&pages, 4).is_err());
    }
}

#[cfg(test)]
mod page_tests {
    use super::*;
    use crate::layout::{IndexKDtype, KvDtype};

    #[test]
    fn copy_validation() {
        let a = IndexKLayout::new(IndexKDtype::FP8, 128, 64).unwrap();
        let b = IndexKLayout::new(IndexKDtype::Bf16, 128, 64).unwrap();
        let src = PagedRegion::contiguous(a, 4);
        let ok = CopyPages {
            src,
            dst: PagedRegion::contiguous(a, 3),
            src_ids: &[0, 3],
            dst_ids: &[2, 0],
        };
        assert!(ok.validate(a.buffer_bytes(4), a.buffer_bytes(3)).is_ok());
        // The historical bug: a bf16 pool mirrored with an fp8 descriptor.
        let bad = CopyPages {
            dst: PagedRegion::contiguous(b, 3),
            ..ok
        };
        assert!(matches!(
            bad.validate(a.buffer_bytes(4), b.buffer_bytes(3)),
            Err(Error::LayoutMismatch { .. })
        ));
        let kv = KvLayout::new(KvDtype::Bf16, 512, 64, 64).unwrap();
        let bad = CopyPages {
            dst: PagedRegion::contiguous(kv, 3),
            ..ok
        };
        assert!(matches!(
            bad.validate(a.buffer_bytes(4), kv.buffer_bytes(3)),
            Err(Error::LayoutMismatch { .. })
        ));
        assert!(matches!(
            ok.validate(a.buffer_bytes(4), a.buffer_bytes(3) - 1),
            Err(Error::BufferSize { .. })
        ));
        let dup = CopyPages {
            dst_ids: &[1, 1],
            ..ok
        };
        assert!(matches!(
            dup.validate(a.buffer_bytes(4), a.buffer_bytes(3)),
            Err(Error::DuplicatePage { .. })
        ));
        let oob = CopyPages {
            src_ids: &[4, 0],
            ..ok
        };
        assert!(matches!(
            oob.validate(a.buffer_bytes(4), a.buffer_bytes(3)),
            Err(Error::PageOutOfRange { page: 4, .. })
        ));
        let neg = CopyPages {
            dst_ids: &[-1, 0],
            ..ok
        };
        assert!(matches!(
            neg.validate(a.buffer_bytes(4), a.buffer_bytes(3)),
            Err(Error::PageOutOfRange { page: -1, .. })
        ));
        let short = CopyPages {
            dst_ids: &[0],
            ..ok
        };
        assert!(matches!(
            short.validate(a.buffer_bytes(4), a.buffer_bytes(3)),
            Err(Error::Shape { .. })
        ));
        let narrow = CopyPages {
            src: PagedRegion { stride: 100, ..src },
            ..ok
        };
        assert!(narrow
            .validate(a.buffer_bytes(4), a.buffer_bytes(3))
            .is_err());
    }

    #[test]
    fn checksum_validation() {
        let a = IndexKLayout::new(IndexKDtype::FP8, 128, 64).unwrap();
        let op = PageChecksums {
            region: PagedRegion::contiguous(a, 2),
            ids: &[1, 0, 1],
        };
        assert!(op.validate(a.buffer_bytes(2), 24).is_ok());
        assert!(matches!(
            op.validate(a.buffer_bytes(2), 16),
            Err(Error::BufferSize { .. })
        ));
        let op = PageChecksums { ids: &[2], ..op };
        assert!(matches!(
            op.validate(a.buffer_bytes(2), 8),
            Err(Error::PageOutOfRange { .. })
        ));
    }
}
