//! Layout descriptors: the **only** place in sparsekit that computes byte sizes and offsets
//! of paged cache buffers. Pools, copy kernels, transfer frames and checksums take a
//! descriptor; none computes a size of its own.
//!
//! All sizes and ranges here are in **bytes** unless a name says `_elems`/`_tokens`.
//!
//! - Index-K pages ([`IndexKLayout`]): fp8 pages hold all `page_size × head_dim` e4m3 value
//!   bytes first, then `page_size` little-endian f32 scales; bf16 pages hold
//!   `page_size × head_dim` bf16 values and no scale section.
//! - KV pages ([`KvLayout`]): token-major. bf16 tokens are `[nope | rope]` bf16 values;
//!   `fp8_ds_mla` tokens are `nope` e4m3 bytes (tiles of 128), then one f32 scale per tile,
//!   then `rope` bf16 values, all contiguous per token.

use std::ops::Range;

use serde::Serialize;

use crate::dtype::ScaleFormat;
use crate::error::{Error, Result};

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

/// Values per fp8_ds_mla quantization tile (one f32 scale each), as the kernels define it.
pub const FP8_DS_MLA_TILE: usize = sparsekit_kernels::params::kv_format::FP8_DS_MLA_TILE as usize;

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
    /// its page-table entry and offset).
    #[inline]
    pub fn of(slot: usize, page_size: usize) -> Self {
        SlotAddr {
            page: slot / page_size,
            offset: slot % page_size,
        }
    }

    /// The slot of this address for pages of `page_size` tokens.
    #[inline]
    pub fn slot(self, page_size: usize) -> usize {
        self.page * page_size + self.offset
    }
}

/// Element type of the index keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IndexKDtype {
    /// e4m3 values plus one f32 scale per token.
    Fp8E4m3 { scale: ScaleFormat },
    /// bf16 values, no scale.
    Bf16,
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
        }
    }
}

/// Descriptor of a paged index-K buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IndexKLayout {
    dtype: IndexKDtype,
    head_dim: usize,
    page_size: usize,
}

impl IndexKLayout {
    /// Builds a descriptor. `head_dim` must be a positive multiple of 16 (vector loads on
    /// the GPU), `page_size` in `1..=4096`, and a page at most [`MAX_PAGE_BYTES`].
    pub fn new(dtype: IndexKDtype, head_dim: usize, page_size: usize) -> Result<Self> {
        if head_dim == 0 || head_dim % 16 != 0 {
            return Err(Error::InvalidLayout(format!(
                "index-K head_dim {head_dim} must be a positive multiple of 16"
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
    /// Whether the page has a per-token f32 scale section.
    pub fn has_scales(&self) -> bool {
        matches!(self.dtype, IndexKDtype::Fp8E4m3 { .. })
    }
    /// Scale format of an fp8 layout, `None` for bf16.
    pub fn scale_format(&self) -> Option<ScaleFormat> {
        match self.dtype {
            IndexKDtype::Fp8E4m3 { scale } => Some(scale),
            IndexKDtype::Bf16 => None,
        }
    }
    /// Value bytes of one token.
    pub fn value_bytes_per_token(&self) -> usize {
        match self.dtype {
            IndexKDtype::Fp8E4m3 { .. } => self.head_dim,
            IndexKDtype::Bf16 => self.head_dim * 2,
        }
    }
    /// Scale bytes of one token (4 for fp8, 0 for bf16).
    pub fn scale_bytes_per_token(&self) -> usize {
        if self.has_scales() {
            4
        } else {
            0
        }
    }
    /// All bytes of one token (values + scale).
    pub fn bytes_per_token(&self) -> usize {
        self.value_bytes_per_token() + self.scale_bytes_per_token()
    }
    /// Bytes of one page.
    pub fn bytes_per_page(&self) -> usize {
        self.bytes_per_token() * self.page_size
    }
    /// Byte offset of the scale section inside a page (fp8 only).
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
    /// Bytes of the f32 scale of the token at `offset` inside its page (fp8 only).
    pub fn scale_range(&self, offset: usize) -> Option<Range<usize>> {
        debug_assert!(offset < self.page_size);
        self.scale_section_offset()
            .map(|base| base + offset * 4..base + offset * 4 + 4)
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
    /// Bytes of the f32 scale of the token at `slot` in a pool of pages packed from byte 0
    /// (fp8 only).
    #[inline]
    pub fn slot_scale_bytes(&self, slot: usize) -> Option<Range<usize>> {
        let a = self.slot_addr(slot);
        let base = self.page_bytes(a.page).start;
        self.scale_range(a.offset)
            .map(|r| base + r.start..base + r.end)
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
            fingerprint: format!("{:#018x}", self.fingerprint()),
        }
    }
}

/// Element format of the MLA KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// bf16 latent + bf16 rope.
    Bf16,
    /// FlashMLA's fp8 format: e4m3 latent in tiles of 128 with f32 power-of-two scales,
    /// bf16 rope.
    Fp8DsMla,
}

impl KvDtype {
    /// Name used in JSON and tables.
    pub fn name(&self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8DsMla => "fp8_ds_mla",
        }
    }
}

/// Descriptor of a paged MLA KV buffer (one latent head per token).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    dtype: KvDtype,
    nope_dim: usize,
    rope_dim: usize,
    page_size: usize,
}

impl KvLayout {
    /// Builds a descriptor. `nope_dim` (the latent, = d_v) must be a positive multiple of
    /// 128 for fp8_ds_mla and of 16 for bf16; `rope_dim` a positive multiple of 16;
    /// `page_size` in `1..=4096`; a page at most [`MAX_PAGE_BYTES`].
    pub fn new(dtype: KvDtype, nope_dim: usize, rope_dim: usize, page_size: usize) -> Result<Self> {
        let nope_multiple = match dtype {
            KvDtype::Bf16 => 16,
            KvDtype::Fp8DsMla => FP8_DS_MLA_TILE,
        };
        if nope_dim == 0 || nope_dim % nope_multiple != 0 {
            return Err(Error::InvalidLayout(format!(
                "KV nope_dim {nope_dim} must be a positive multiple of {nope_multiple} for {}",
                dtype.name()
            )));
        }
        if rope_dim == 0 || rope_dim % 16 != 0 {
            return Err(Error::InvalidLayout(format!(
                "KV rope_dim {rope_dim} must be a positive multiple of 16"
            )));
        }
        if page_size == 0 || page_size > 4096 {
            return Err(Error::InvalidLayout(format!(
                "page_size {page_size} must be in 1..=4096"
            )));
        }
        let rope_bytes = rope_dim.checked_mul(2);
        let per_token = match dtype {
            KvDtype::Bf16 => nope_dim.checked_mul(2),
            // e4m3 values, then one f32 scale per tile.
            KvDtype::Fp8DsMla => nope_dim.checked_add(nope_dim / FP8_DS_MLA_TILE * 4),
        }
        .zip(rope_bytes)
        .and_then(|(a, b)| a.checked_add(b))
        .unwrap_or(usize::MAX);
        check_page_bytes("KV", &[per_token, page_size])?;
        Ok(KvLayout {
            dtype,
            nope_dim,
            rope_dim,
            page_size,
        })
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
    /// Latent (NoPE) elements per token; equals d_v.
    pub fn nope_dim(&self) -> usize {
        self.nope_dim
    }
    /// Rope elements per token.
    pub fn rope_dim(&self) -> usize {
        self.rope_dim
    }
    /// `nope_dim + rope_dim`: the attention key dim.
    pub fn d_qk(&self) -> usize {
        self.nope_dim + self.rope_dim
    }
    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// fp8 tiles (= f32 scales) per token; 0 for bf16.
    pub fn tiles_per_token(&self) -> usize {
        match self.dtype {
            KvDtype::Bf16 => 0,
            KvDtype::Fp8DsMla => self.nope_dim / FP8_DS_MLA_TILE,
        }
    }
    /// Bytes of one token.
    pub fn bytes_per_token(&self) -> usize {
        let rope = self.rope_dim * 2;
        match self.dtype {
            KvDtype::Bf16 => self.nope_dim * 2 + rope,
            KvDtype::Fp8DsMla => self.nope_dim + 4 * self.tiles_per_token() + rope,
        }
    }
    /// Bytes of one page.
    pub fn bytes_per_page(&self) -> usize {
        self.bytes_per_token() * self.page_size
    }
    /// Bytes of the token at `offset` (< page_size) inside its page.
    pub fn token_range(&self, offset: usize) -> Range<usize> {
        debug_assert!(offset < self.page_size);
        let t = self.bytes_per_token();
        offset * t..(offset + 1) * t
    }
    /// Bytes of the latent values inside a token (bf16 or e4m3, per the dtype).
    pub fn nope_range(&self) -> Range<usize> {
        match self.dtype {
            KvDtype::Bf16 => 0..self.nope_dim * 2,
            KvDtype::Fp8DsMla => 0..self.nope_dim,
        }
    }
    /// Bytes of the per-tile f32 scales inside a token (empty for bf16).
    pub fn scales_range(&self) -> Range<usize> {
        let start = self.nope_range().end;
        start..start + 4 * self.tiles_per_token()
    }
    /// Bytes of the bf16 rope values inside a token.
    pub fn rope_range(&self) -> Range<usize> {
        let start = self.scales_range().end;
        start..start + self.rope_dim * 2
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
    /// Bytes of the token at `slot` in a pool of pages packed from byte 0.
    #[inline]
    pub fn slot_token_bytes(&self, slot: usize) -> Range<usize> {
        let a = self.slot_addr(slot);
        let r = self.token_range(a.offset);
        let base = self.page_bytes(a.page).start;
        base + r.start..base + r.end
    }
    /// Bytes of a buffer holding `num_pages` pages.
    pub fn buffer_bytes(&self, num_pages: usize) -> usize {
        self.bytes_per_page() * num_pages
    }
    /// Pages in a buffer of `bytes` bytes, or an error if it is not a whole number of pages.
    pub fn pages_in(&self, what: &'static str, bytes: usize) -> Result<usize> {
        pages_in(what, bytes, self.bytes_per_page())
    }
    /// Stable 64-bit fingerprint of this descriptor.
    pub fn fingerprint(&self) -> u64 {
        let tag = match self.dtype {
            KvDtype::Bf16 => 1u64,
            KvDtype::Fp8DsMla => 2u64,
        };
        fingerprint(
            b"sparsekit/kv/v1",
            &[
                tag,
                self.nope_dim as u64,
                self.rope_dim as u64,
                self.page_size as u64,
            ],
        )
    }
    /// Serializable summary (for `sparsekit layouts`).
    pub fn info(&self) -> LayoutInfo {
        LayoutInfo {
            kind: "kv",
            dtype: self.dtype.name(),
            scale: None,
            head_dim: None,
            nope_dim: Some(self.nope_dim),
            rope_dim: Some(self.rope_dim),
            page_size: self.page_size,
            bytes_per_token: self.bytes_per_token(),
            bytes_per_page: self.bytes_per_page(),
            fingerprint: format!("{:#018x}", self.fingerprint()),
        }
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
    pub bytes_per_page: usize,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dims::ModelDims;

    fn dsv32_index(dtype: IndexKDtype) -> IndexKLayout {
        let d = ModelDims::DSV32;
        IndexKLayout::new(dtype, d.index_head_dim, d.page_size).unwrap()
    }

    #[test]
    fn dsv32_index_k_sizes() {
        let fp8 = dsv32_index(IndexKDtype::FP8);
        assert_eq!(fp8.bytes_per_token(), 132);
        assert_eq!(fp8.bytes_per_page(), 8448);
        assert_eq!(fp8.value_range(1), 128..256);
        assert_eq!(fp8.scale_range(0), Some(8192..8196));
        assert_eq!(fp8.scale_range(63), Some(8444..8448));
        let bf16 = dsv32_index(IndexKDtype::Bf16);
        assert_eq!(bf16.bytes_per_token(), 256);
        assert_eq!(bf16.bytes_per_page(), 16384);
        assert_eq!(bf16.scale_range(5), None);
        assert_eq!(bf16.value_range(63), 16128..16384);
    }

    #[test]
    fn slot_addresses_come_from_the_layout() {
        let fp8 = dsv32_index(IndexKDtype::FP8);
        // Slot 130 = page 2, offset 2.
        assert_eq!(fp8.slot_addr(130), SlotAddr { page: 2, offset: 2 });
        assert_eq!(SlotAddr { page: 2, offset: 2 }.slot(64), 130);
        assert_eq!(fp8.slot_value_bytes(130), 2 * 8448 + 256..2 * 8448 + 384);
        assert_eq!(
            fp8.slot_scale_bytes(130),
            Some(2 * 8448 + 8192 + 8..2 * 8448 + 8192 + 12)
        );
        let bf16 = dsv32_index(IndexKDtype::Bf16);
        assert_eq!(bf16.slot_value_bytes(65), 16384 + 256..16384 + 512);
        assert_eq!(bf16.slot_scale_bytes(65), None);
        let kv = KvLayout::new(KvDtype::Fp8DsMla, 512, 64, 64).unwrap();
        assert_eq!(kv.slot_token_bytes(65), 41984 + 656..41984 + 1312);
        assert_eq!(kv.page_bytes(3), 3 * 41984..4 * 41984);
        let pl: PageLayout = kv.into();
        assert_eq!(
            pl.slot_addr(127),
            SlotAddr {
                page: 1,
                offset: 63
            }
        );
    }

    #[test]
    fn dsv32_kv_sizes() {
        let bf16 = KvLayout::new(KvDtype::Bf16, 512, 64, 64).unwrap();
        assert_eq!(bf16.bytes_per_token(), 1152);
        assert_eq!(bf16.bytes_per_page(), 73728);
        assert_eq!(bf16.rope_range(), 1024..1152);
        let fp8 = KvLayout::new(KvDtype::Fp8DsMla, 512, 64, 64).unwrap();
        assert_eq!(fp8.bytes_per_token(), 656);
        assert_eq!(fp8.bytes_per_page(), 41984);
        assert_eq!(fp8.nope_range(), 0..512);
        assert_eq!(fp8.scales_range(), 512..528);
        assert_eq!(fp8.rope_range(), 528..656);
        assert_eq!(fp8.token_range(2), 1312..1968);
    }

    #[test]
    fn fingerprints_distinguish_descriptors_and_are_stable() {
        let a = dsv32_index(IndexKDtype::FP8);
        let b = dsv32_index(IndexKDtype::Bf16);
        let c = dsv32_index(IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Ue8m0,
        });
        let d = IndexKLayout::new(IndexKDtype::FP8, 128, 32).unwrap();
        let all = [
            a.fingerprint(),
            b.fingerprint(),
            c.fingerprint(),
            d.fingerprint(),
        ];
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert_ne!(all[i], all[j]);
            }
        }
        assert_eq!(a.fingerprint(), dsv32_index(IndexKDtype::FP8).fingerprint());
        let kv1 = KvLayout::new(KvDtype::Bf16, 512, 64, 64).unwrap();
        let kv2 = KvLayout::new(KvDtype::Fp8DsMla, 512, 64, 64).unwrap();
        assert_ne!(kv1.fingerprint(), kv2.fingerprint());
        // Pinned value: a change here breaks every stored frame and cache; bump the domain
        // string's version instead of editing this constant.
        assert_eq!(a.fingerprint(), 0xb9d7_14fa_e865_25da);
        assert_eq!(kv2.fingerprint(), 0xba53_50e3_c68d_7f4b);
    }

    #[test]
    fn invalid_layouts_are_errors() {
        assert!(matches!(
            IndexKLayout::new(IndexKDtype::Bf16, 100, 64),
            Err(Error::InvalidLayout(_))
        ));
        assert!(matches!(
            IndexKLayout::new(IndexKDtype::Bf16, 128, 0),
            Err(Error::InvalidLayout(_))
        ));
        assert!(matches!(
            KvLayout::new(KvDtype::Fp8DsMla, 320, 64, 64),
            Err(Error::InvalidLayout(_))
        ));
        assert!(matches!(
            KvLayout::new(KvDtype::Bf16, 512, 0, 64),
            Err(Error::InvalidLayout(_))
        ));
        // Pages above 4 GiB (the kernels' u32 in-page offsets) are refused, never
        // truncated; the product itself never overflows.
        for (head_dim, page_size) in [(1 << 20, 4096), (usize::MAX / 16 * 16, 64)] {
            for dt in [IndexKDtype::FP8, IndexKDtype::Bf16] {
                assert!(
                    matches!(
                        IndexKLayout::new(dt, head_dim, page_size),
                        Err(Error::InvalidLayout(_))
                    ),
                    "{head_dim} × {page_size}"
                );
            }
        }
        assert!(IndexKLayout::new(IndexKDtype::Bf16, (1 << 19) - 16, 4096).is_ok());
        assert!(IndexKLayout::new(IndexKDtype::Bf16, 1 << 19, 4096).is_err());
        assert!(IndexKLayout::new(IndexKDtype::FP8, 1 << 19, 4096).is_ok());
        assert!(matches!(
            KvLayout::new(KvDtype::Bf16, 1 << 20, 16, 4096),
            Err(Error::InvalidLayout(_))
        ));
        assert!(matches!(
            KvLayout::new(KvDtype::Fp8DsMla, usize::MAX / 128 * 128, 16, 1),
            Err(Error::InvalidLayout(_))
        ));
        let l = IndexKLayout::new(IndexKDtype::FP8, 128, 64).unwrap();
        assert_eq!(l.pages_in("x", 8448 * 3).unwrap(), 3);
        assert!(matches!(
            l.pages_in("x", 8448 * 3 + 1),
            Err(Error::BufferSize { .. })
        ));
    }
}
