//! The paged index-K descriptor ([`IndexKLayout`]): values of every token of a page first,
//! then (fp8, fp4) the scale section.

use std::ops::Range;

use super::{check_page_bytes, fingerprint, pages_in, scale_tag, LayoutInfo, SlotAddr};
use crate::dtype::ScaleFormat;
use crate::error::{Error, Result};

/// Values per fp4 index-K scale (one ue8m0 byte each), as the kernels define it.
pub const FP4_GROUP: usize = sparsekit_kernels::params::index_k_format::FP4_GROUP as usize;

/// Element type of the index keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IndexKDtype {
    /// e4m3 values plus one f32 scale per token.
    Fp8E4m3 { scale: ScaleFormat },
    /// bf16 values, no scale.
    Bf16,
    /// DeepSeek-V4's fp4 index keys: packed e2m1 values (two per byte, the even element in
    /// the low nibble) plus one ue8m0 scale byte per 32 values
    /// (`sparsekit_kernels::mx`).
    Fp4E2m1,
}

impl IndexKDtype {
    /// fp8 with exact f32 scales (the DeepSeek-V3.2 default).
    pub const FP8: IndexKDtype = IndexKDtype::Fp8E4m3 {
        scale: ScaleFormat::Fp32,
    };

    /// Name used in JSON and tables.
    pub fn name(&self) -> &'static str {
        match self {
            IndexKDtype::Fp8E4m3 { .. } => "fp8_e4m3",
            IndexKDtype::Bf16 => "bf16",
            IndexKDtype::Fp4E2m1 => "fp4_e2m1",
        }
    }
}

/// Descriptor of a paged index-K buffer.
///
/// A page of `page_size` tokens holds every token's value bytes (token-major), then the
/// scale section: fp8 one little-endian f32 per token (132 B/token at head_dim 128), fp4
/// `head_dim / 32` ue8m0 bytes per token (64 + 4 = 68 B/token); bf16 has no scale section
/// (256 B/token).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IndexKLayout {
    dtype: IndexKDtype,
    head_dim: usize,
    page_size: usize,
}

impl IndexKLayout {
    /// Builds a descriptor. `head_dim` must be a positive multiple of 16 (vector loads on
    /// the GPU; of 128 for fp4, so that a token's values and scales are whole 4-byte words
    /// at any page size: 68 B per token at 128),
    /// `page_size` in `1..=4096`, and a page at most
    /// [`MAX_PAGE_BYTES`](super::MAX_PAGE_BYTES).
    pub fn new(dtype: IndexKDtype, head_dim: usize, page_size: usize) -> Result<Self> {
        let multiple = match dtype {
            IndexKDtype::Fp4E2m1 => 4 * FP4_GROUP,
            _ => 16,
        };
        if head_dim == 0 || head_dim % multiple != 0 {
            return Err(Error::InvalidLayout(format!(
                "index-K head_dim {head_dim} must be a positive multiple of {multiple} for {}",
                dtype.name()
            )));
        }
        if page_size == 0 || page_size > 4096 {
            return Err(Error::InvalidLayout(format!(
                "page_size {page_size} must be in 1..=4096"
            )));
        }
        let per_token = match dtype {
            IndexKDtype::Fp8E4m3 { .. } => head_dim.checked_add(4),
            IndexKDtype::Bf16 => head_dim.checked_mul(2),
            IndexKDtype::Fp4E2m1 => Some(head_dim / 2 + head_dim / FP4_GROUP),
        }
        .unwrap_or(usize::MAX);
        check_page_bytes("index-K", &[per_token, page_size])?;
        Ok(IndexKLayout {
            dtype,
            head_dim,
            page_size,
        })
    }

    pub fn dtype(&self) -> IndexKDtype {
        self.dtype
    }
    /// Elements per key.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// Whether the page has a scale section (fp8, fp4).
    pub fn has_scales(&self) -> bool {
        !matches!(self.dtype, IndexKDtype::Bf16)
    }
    /// Scale format of an fp8 layout (`None` for bf16 and fp4, whose scales are ue8m0
    /// bytes per group).
    pub fn scale_format(&self) -> Option<ScaleFormat> {
        match self.dtype {
            IndexKDtype::Fp8E4m3 { scale } => Some(scale),
            IndexKDtype::Bf16 | IndexKDtype::Fp4E2m1 => None,
        }
    }
    /// Value bytes of one token.
    pub fn value_bytes_per_token(&self) -> usize {
        match self.dtype {
            IndexKDtype::Fp8E4m3 { .. } => self.head_dim,
            IndexKDtype::Bf16 => self.head_dim * 2,
            IndexKDtype::Fp4E2m1 => self.head_dim / 2,
        }
    }
    /// Scale bytes of one token (fp8 4, fp4 `head_dim / 32`, bf16 0).
    pub fn scale_bytes_per_token(&self) -> usize {
        match self.dtype {
            IndexKDtype::Fp8E4m3 { .. } => 4,
            IndexKDtype::Bf16 => 0,
            IndexKDtype::Fp4E2m1 => self.head_dim / FP4_GROUP,
        }
    }
    /// All bytes of one token (values + scale).
    pub fn bytes_per_token(&self) -> usize {
        self.value_bytes_per_token() + self.scale_bytes_per_token()
    }
    /// Bytes of one page (the page stride of a pool).
    pub fn bytes_per_page(&self) -> usize {
        self.bytes_per_token() * self.page_size
    }
    /// Byte offset of the scale section inside a page (fp8 and fp4).
    pub fn scale_section_offset(&self) -> Option<usize> {
        self.has_scales()
            .then(|| self.value_bytes_per_token() * self.page_size)
    }
    /// Bytes of the values of the token at `offset` (< page_size) inside its page.
    pub fn value_range(&self, offset: usize) -> Range<usize> {
        debug_assert!(offset < self.page_size);
        let v = self.value_bytes_per_token();
        offset * v..(offset + 1) * v
    }
    /// Bytes of the scale(s) of the token at `offset` inside its page (fp8: one f32; fp4:
    /// one ue8m0 byte per 32 values, in value order).
    pub fn scale_range(&self, offset: usize) -> Option<Range<usize>> {
        debug_assert!(offset < self.page_size);
        let n = self.scale_bytes_per_token();
        self.scale_section_offset()
            .map(|base| base + offset * n..base + (offset + 1) * n)
    }
    /// Page and offset of `slot`.
    #[inline]
    pub fn slot_addr(&self, slot: usize) -> SlotAddr {
        SlotAddr::of(slot, self.page_size)
    }
    /// Bytes of page `page` in a pool of pages packed from byte 0.
    #[inline]
    pub fn page_bytes(&self, page: usize) -> Range<usize> {
        let p = self.bytes_per_page();
        page * p..(page + 1) * p
    }
    /// Bytes of the values of the token at `slot` in a pool of pages packed from byte 0.
    #[inline]
    pub fn slot_value_bytes(&self, slot: usize) -> Range<usize> {
        let a = self.slot_addr(slot);
        let r = self.value_range(a.offset);
        let base = self.page_bytes(a.page).start;
        base + r.start..base + r.end
    }
    /// Bytes of the scale(s) of the token at `slot` in a pool of pages packed from byte 0
    /// (fp8, fp4).
    #[inline]
    pub fn slot_scale_bytes(&self, slot: usize) -> Option<Range<usize>> {
        let a = self.slot_addr(slot);
        let base = self.page_bytes(a.page).start;
        self.scale_range(a.offset)
            .map(|r| base + r.start..base + r.end)
    }
    /// Bytes of the values of `count ≥ 1` consecutive slots from `slot`, all in one page: a
    /// page stores its tokens' values adjacent in token order, so this is one range.
    #[inline]
    pub fn slot_run_value_bytes(&self, slot: usize, count: usize) -> Range<usize> {
        let a = self.slot_addr(slot);
        debug_assert!(count >= 1);
        let base = self.page_bytes(a.page).start;
        let (first, last) = (
            self.value_range(a.offset),
            self.value_range(a.offset + count - 1),
        );
        base + first.start..base + last.end
    }
    /// Bytes of the scales of `count ≥ 1` consecutive slots from `slot`, all in one page
    /// (adjacent in token order, as the values; fp8, fp4).
    #[inline]
    pub fn slot_run_scale_bytes(&self, slot: usize, count: usize) -> Option<Range<usize>> {
        let a = self.slot_addr(slot);
        debug_assert!(count >= 1);
        let base = self.page_bytes(a.page).start;
        self.scale_range(a.offset)
            .zip(self.scale_range(a.offset + count - 1))
            .map(|(first, last)| base + first.start..base + last.end)
    }
    /// Bytes of a buffer holding `num_pages` pages.
    pub fn buffer_bytes(&self, num_pages: usize) -> usize {
        self.bytes_per_page() * num_pages
    }
    /// Pages in a buffer of `bytes` bytes, or an error if it is not a whole number of pages.
    pub fn pages_in(&self, what: &'static str, bytes: usize) -> Result<usize> {
        pages_in(what, bytes, self.bytes_per_page())
    }
    /// Stable 64-bit fingerprint of this descriptor (same on every machine and build).
    pub fn fingerprint(&self) -> u64 {
        let (tag, scale) = match self.dtype {
            IndexKDtype::Fp8E4m3 { scale } => (1u64, scale_tag(scale)),
            IndexKDtype::Bf16 => (2u64, 0),
            IndexKDtype::Fp4E2m1 => (3u64, 0),
        };
        fingerprint(
            b"sparsekit/index_k/v1",
            &[tag, scale, self.head_dim as u64, self.page_size as u64],
        )
    }
    /// Serializable summary (for `sparsekit layouts`).
    pub fn info(&self) -> LayoutInfo {
        LayoutInfo {
            kind: "index_k",
            dtype: self.dtype.name(),
            scale: self.scale_format(),
            head_dim: Some(self.head_dim),
            nope_dim: None,
            rope_dim: None,
            page_size: self.page_size,
            bytes_per_token: self.bytes_per_token(),
            bytes_per_page: self.bytes_per_page(),
            scale_section: self.scale_section_offset(),
            fingerprint: format!("{:#018x}", self.fingerprint()),
        }
    }
}
