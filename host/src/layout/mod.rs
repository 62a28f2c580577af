//! Layout descriptors: the **only** place in sparsekit that computes byte sizes and offsets
//! of paged cache buffers. Pools, copy kernels, transfer frames and checksums take a
//! descriptor; none computes a size of its own.
//!
//! All sizes and ranges here are in **bytes** unless a name says `_elems`/`_tokens`.
//!
//! - Index-K pages ([`IndexKLayout`], `index_k.rs`): every token's values first, then the
//!   scale section: fp8 `page_size` little-endian f32 scales; fp4 (packed e2m1) one ue8m0
//!   byte per 32 values of each token; bf16 no scale section.
//! - KV pages ([`KvLayout`], `kv.rs`): one row per token. bf16 rows are `[nope | rope]` bf16
//!   values; `fp8_ds_mla` rows are `nope` e4m3 bytes (tiles of 128), one f32 scale per tile,
//!   then `rope` bf16 values; DeepSeek-V4's `model1_fp8` rows are 448 e4m3 (tiles of 64)
//!   then 64 bf16, followed after the page's rows by 8 B of ue8m0 tile scales per token,
//!   the page padded to a multiple of the 576-B row; `bf16_512` rows are 512 bf16.
//!
//! Every layout takes any page size from 1 to 4096 tokens; the page stride (padding
//! included) is the descriptor's `bytes_per_page`.

use serde::Serialize;

use crate::dtype::ScaleFormat;
use crate::error::{Error, Result};

mod index_k;
mod kv;
#[cfg(test)]
mod tests;

pub use index_k::{IndexKDtype, IndexKLayout, FP4_GROUP};
pub use kv::{
    KvDtype, KvLayout, FP8_DS_MLA_TILE, MODEL1_SCALE_BYTES, MODEL1_TILE, V4_NOPE, V4_ROPE,
};

/// Largest page a layout may describe, in bytes: the GPU kernels take in-page offsets
/// (the scale section, a token's rope, ...) as u32, so a larger page is refused when the
/// descriptor is built rather than truncated at a launch.
pub const MAX_PAGE_BYTES: usize = u32::MAX as usize;

/// Checks a page size computed as `Π factors` bytes against [`MAX_PAGE_BYTES`] (checked
/// arithmetic).
fn check_page_bytes(kind: &str, factors: &[usize]) -> Result<()> {
    match factors.iter().try_fold(1usize, |a, &f| a.checked_mul(f)) {
        Some(b) if b <= MAX_PAGE_BYTES => Ok(()),
        _ => Err(Error::InvalidLayout(format!(
            "{kind} page of {} bytes is above the limit of {MAX_PAGE_BYTES} bytes",
            factors
                .iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join(" × ")
        ))),
    }
}

/// Where a token slot lives: its page and its offset inside the page. A slot is
/// `page * page_size + offset` (the form slot mappings, page tables and top-k outputs use).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotAddr {
    pub page: usize,
    /// Token offset inside the page (`< page_size`).
    pub offset: usize,
}

impl SlotAddr {
    /// Splits `slot` for pages of `page_size` tokens (also splits a token position into
    /// its page-table entry and offset). A power-of-two page size (every deployment's)
    /// takes a shift and a mask instead of a division (tens of cycles on x86, once per
    /// key of a gather).
    #[inline]
    pub fn of(slot: usize, page_size: usize) -> Self {
        if page_size.is_power_of_two() {
            SlotAddr {
                page: slot >> page_size.trailing_zeros(),
                offset: slot & (page_size - 1),
            }
        } else {
            SlotAddr {
                page: slot / page_size,
                offset: slot % page_size,
            }
        }
    }

    /// The slot of this address for pages of `page_size` tokens.
    #[inline]
    pub fn slot(self, page_size: usize) -> usize {
        self.page * page_size + self.offset
    }
}

/// Either page format, for ops that move or digest whole pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageLayout {
    IndexK(IndexKLayout),
    Kv(KvLayout),
}

impl PageLayout {
    /// Bytes of one page.
    pub fn bytes_per_page(&self) -> usize {
        match self {
            PageLayout::IndexK(l) => l.bytes_per_page(),
            PageLayout::Kv(l) => l.bytes_per_page(),
        }
    }
    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        match self {
            PageLayout::IndexK(l) => l.page_size(),
            PageLayout::Kv(l) => l.page_size(),
        }
    }
    /// Page and offset of `slot`.
    pub fn slot_addr(&self, slot: usize) -> SlotAddr {
        SlotAddr::of(slot, self.page_size())
    }
    /// The bytes of a page that hold its first `n` entries (`n` is clamped to the page
    /// size), as byte ranges inside the page in ascending order: the rows, then — for the
    /// layouts that keep scales in a section at the page's end (model1_fp8, fp8 and fp4
    /// index keys) — those entries' scales. The rest of the page belongs to no entry below
    /// `n`: a copy of a partly filled page moves exactly these ranges.
    pub fn entry_spans(&self, n: usize) -> Vec<std::ops::Range<usize>> {
        let n = n.min(self.page_size());
        if n == 0 {
            return Vec::new();
        }
        let (rows, scales) = match self {
            PageLayout::Kv(l) => (
                0..l.token_range(n - 1).end,
                // The scale section: 8 bytes a token (7 tile scales and the pad byte).
                l.scale_entry_range(0)
                    .zip(l.scale_entry_range(n - 1))
                    .map(|(a, b)| a.start..b.end),
            ),
            PageLayout::IndexK(l) => (
                0..l.value_range(n - 1).end,
                l.scale_range(0)
                    .zip(l.scale_range(n - 1))
                    .map(|(a, b)| a.start..b.end),
            ),
        };
        std::iter::once(rows).chain(scales).collect()
    }
    /// The descriptor's fingerprint.
    pub fn fingerprint(&self) -> u64 {
        match self {
            PageLayout::IndexK(l) => l.fingerprint(),
            PageLayout::Kv(l) => l.fingerprint(),
        }
    }
    /// Summary for printing.
    pub fn info(&self) -> LayoutInfo {
        match self {
            PageLayout::IndexK(l) => l.info(),
            PageLayout::Kv(l) => l.info(),
        }
    }
}

impl From<IndexKLayout> for PageLayout {
    fn from(l: IndexKLayout) -> Self {
        PageLayout::IndexK(l)
    }
}

impl From<KvLayout> for PageLayout {
    fn from(l: KvLayout) -> Self {
        PageLayout::Kv(l)
    }
}

/// A descriptor summarised for printing and JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LayoutInfo {
    pub kind: &'static str,
    pub dtype: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale: Option<ScaleFormat>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nope_dim: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_dim: Option<usize>,
    pub page_size: usize,
    pub bytes_per_token: usize,
    /// The page stride (padding included).
    pub bytes_per_page: usize,
    /// Offset of the scale section inside a page, for layouts that have one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_section: Option<usize>,
    /// Hex string (`0x…`, 16 digits) of the 64-bit fingerprint.
    pub fingerprint: String,
}

fn pages_in(what: &'static str, bytes: usize, per_page: usize) -> Result<usize> {
    if bytes % per_page != 0 {
        return Err(Error::BufferSize {
            what,
            expected: bytes.div_ceil(per_page) * per_page,
            actual: bytes,
        });
    }
    Ok(bytes / per_page)
}

fn scale_tag(s: ScaleFormat) -> u64 {
    match s {
        ScaleFormat::Fp32 => 1,
        ScaleFormat::Ue8m0 => 2,
    }
}

/// FNV-1a 64 over a domain string and little-endian u64 fields.
fn fingerprint(domain: &[u8], fields: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |b: u8| {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    domain.iter().copied().for_each(&mut feed);
    for f in fields {
        f.to_le_bytes().into_iter().for_each(&mut feed);
    }
    h
}
