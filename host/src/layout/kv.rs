//! The paged MLA KV descriptor ([`KvLayout`]): DeepSeek-V3.2's token-major formats (bf16,
//! `fp8_ds_mla`) and DeepSeek-V4's (`model1_fp8`: rows then a scale section, pages padded
//! to whole rows; `bf16_512`).

use std::ops::Range;

use sparsekit_kernels::params::kv_format;

use super::{check_page_bytes, fingerprint, pages_in, LayoutInfo, SlotAddr};
use crate::error::{Error, Result};

/// Values per fp8_ds_mla quantization tile (one f32 scale each), as the kernels define it.
pub const FP8_DS_MLA_TILE: usize = kv_format::FP8_DS_MLA_TILE as usize;
/// Values per MODEL1 tile (one ue8m0 byte each).
pub const MODEL1_TILE: usize = kv_format::MODEL1_TILE as usize;
/// MODEL1 / bf16_512 NoPE dims (448) and rope dims (64): DeepSeek-V4's 512-d K = V row.
pub const V4_NOPE: usize = kv_format::MODEL1_NOPE as usize;
pub const V4_ROPE: usize = kv_format::MODEL1_ROPE as usize;
/// Bytes of a MODEL1 token's scales in the page's scale section (7 ue8m0 + 1 pad).
pub const MODEL1_SCALE_BYTES: usize = kv_format::MODEL1_SCALE_BYTES as usize;

/// Element format of the MLA KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// bf16 latent + bf16 rope (DeepSeek-V3.2; the value is the latent).
    Bf16,
    /// FlashMLA's fp8 format: e4m3 latent in tiles of 128 with f32 power-of-two scales,
    /// bf16 rope (DeepSeek-V3.2).
    Fp8DsMla,
    /// DeepSeek-V4's "MODEL1" fp8 format (`model1_fp8`): per page, rows of 576 B (448 e4m3
    /// NoPE in 7 tiles of 64, then 64 bf16 rope), then 8 B per token (7 ue8m0 tile scales
    /// + 1 pad); the page is padded to a multiple of 576 B. The value is the whole row.
    Model1Fp8,
    /// DeepSeek-V4's bf16 KV (`bf16_512`): 512 bf16 per token (448 NoPE then 64 rope),
    /// 1024 B/token. The value is the whole row.
    Bf16x512,
}

impl KvDtype {
    /// Name used in JSON and tables.
    pub fn name(&self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8DsMla => "fp8_ds_mla",
            KvDtype::Model1Fp8 => "model1_fp8",
            KvDtype::Bf16x512 => "bf16_512",
        }
    }

    /// Whether this is a DeepSeek-V4 format: a 512-d row that is both the key and the
    /// value (`sparse_mla_v4`), rather than a V3.2 latent + rope (`sparse_mla`).
    pub fn is_v4(&self) -> bool {
        matches!(self, KvDtype::Model1Fp8 | KvDtype::Bf16x512)
    }

    /// Whether values are stored as bf16 (no tiles, no scales).
    pub fn is_bf16(&self) -> bool {
        matches!(self, KvDtype::Bf16 | KvDtype::Bf16x512)
    }
}

/// Descriptor of a paged MLA KV buffer (one latent head per token).
///
/// Every token has a **row** at `offset · row_bytes()` of its page: its NoPE values (bf16,
/// or e4m3 codes), its f32 tile scales (fp8_ds_mla only), its bf16 rope. `model1_fp8`
/// keeps its ue8m0 tile scales in a section after the `page_size` rows
/// ([`Self::scale_section_offset`]), and pads the page to a multiple of the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    dtype: KvDtype,
    nope_dim: usize,
    rope_dim: usize,
    page_size: usize,
}

impl KvLayout {
    /// Builds a descriptor. `nope_dim` must be a positive multiple of 128 for fp8_ds_mla
    /// and of 16 for bf16, and exactly 448 for the V4 formats; `rope_dim` a positive
    /// multiple of 16 (exactly 64 for V4); `page_size` in `1..=4096`; a page at most
    /// [`MAX_PAGE_BYTES`](super::MAX_PAGE_BYTES).
    pub fn new(dtype: KvDtype, nope_dim: usize, rope_dim: usize, page_size: usize) -> Result<Self> {
        if dtype.is_v4() && (nope_dim, rope_dim) != (V4_NOPE, V4_ROPE) {
            return Err(Error::InvalidLayout(format!(
                "{} rows are {V4_NOPE} NoPE + {V4_ROPE} rope, not {nope_dim} + {rope_dim}",
                dtype.name()
            )));
        }
        let nope_multiple = match dtype {
            KvDtype::Bf16 | KvDtype::Bf16x512 => 16,
            KvDtype::Fp8DsMla => FP8_DS_MLA_TILE,
            KvDtype::Model1Fp8 => MODEL1_TILE,
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
            KvDtype::Bf16 | KvDtype::Bf16x512 => nope_dim.checked_mul(2),
            // e4m3 values, then one f32 scale per tile.
            KvDtype::Fp8DsMla => nope_dim.checked_add(nope_dim / FP8_DS_MLA_TILE * 4),
            // e4m3 values; the 8 scale bytes (and the page padding, less than a row) are
            // bounded by a second row.
            KvDtype::Model1Fp8 => nope_dim.checked_mul(2),
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

    /// DeepSeek-V4's `model1_fp8` layout with pages of `page_size` tokens.
    pub fn model1_fp8(page_size: usize) -> Result<Self> {
        Self::new(KvDtype::Model1Fp8, V4_NOPE, V4_ROPE, page_size)
    }

    /// DeepSeek-V4's `bf16_512` layout with pages of `page_size` tokens.
    pub fn bf16_512(page_size: usize) -> Result<Self> {
        Self::new(KvDtype::Bf16x512, V4_NOPE, V4_ROPE, page_size)
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
    /// Latent (NoPE) elements per token.
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
    /// The attention value dim: the latent (`nope_dim`) for V3.2 formats, the whole row
    /// (`d_qk`, rope included) for V4 formats.
    pub fn d_v(&self) -> usize {
        if self.dtype.is_v4() {
            self.d_qk()
        } else {
            self.nope_dim
        }
    }
    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// Values per quantization tile (0 for bf16).
    pub fn tile_size(&self) -> usize {
        match self.dtype {
            KvDtype::Bf16 | KvDtype::Bf16x512 => 0,
            KvDtype::Fp8DsMla => FP8_DS_MLA_TILE,
            KvDtype::Model1Fp8 => MODEL1_TILE,
        }
    }
    /// fp8 tiles (= scales) per token; 0 for bf16.
    pub fn tiles_per_token(&self) -> usize {
        match self.tile_size() {
            0 => 0,
            t => self.nope_dim / t,
        }
    }
    /// Whether tile scales are ue8m0 bytes (model1_fp8) rather than f32 (fp8_ds_mla).
    pub fn ue8m0_scales(&self) -> bool {
        self.dtype == KvDtype::Model1Fp8
    }
    /// Bytes of a token's row (see the type's docs).
    pub fn row_bytes(&self) -> usize {
        let rope = self.rope_dim * 2;
        match self.dtype {
            KvDtype::Bf16 | KvDtype::Bf16x512 => self.nope_dim * 2 + rope,
            KvDtype::Fp8DsMla => self.nope_dim + 4 * self.tiles_per_token() + rope,
            KvDtype::Model1Fp8 => self.nope_dim + rope,
        }
    }
    /// Bytes of one token: its row and, for model1_fp8, its 8 bytes of the scale section
    /// (584; the page's padding is not counted).
    pub fn bytes_per_token(&self) -> usize {
        match self.dtype {
            KvDtype::Model1Fp8 => self.row_bytes() + MODEL1_SCALE_BYTES,
            _ => self.row_bytes(),
        }
    }
    /// Bytes of one page, the page stride of a pool: `page_size` tokens, for model1_fp8
    /// rounded up to a multiple of the row (`ceil(P·584 / 576) · 576`).
    pub fn bytes_per_page(&self) -> usize {
        let raw = self.bytes_per_token() * self.page_size;
        match self.dtype {
            KvDtype::Model1Fp8 => raw.div_ceil(self.row_bytes()) * self.row_bytes(),
            _ => raw,
        }
    }
    /// Byte offset of the scale section inside a page (model1_fp8 only).
    pub fn scale_section_offset(&self) -> Option<usize> {
        (self.dtype == KvDtype::Model1Fp8).then(|| self.row_bytes() * self.page_size)
    }
    /// Bytes of the row of the token at `offset` (< page_size) inside its page (all of the
    /// token for the token-major formats; model1_fp8 tile scales are elsewhere, see
    /// [`Self::tile_scale_range`]).
    pub fn token_range(&self, offset: usize) -> Range<usize> {
        debug_assert!(offset < self.page_size);
        let t = self.row_bytes();
        offset * t..(offset + 1) * t
    }
    /// Bytes of the latent values inside a row (bf16 or e4m3, per the dtype).
    pub fn nope_range(&self) -> Range<usize> {
        if self.dtype.is_bf16() {
            0..self.nope_dim * 2
        } else {
            0..self.nope_dim
        }
    }
    /// Bytes of the per-tile f32 scales inside a row (fp8_ds_mla; empty for the others).
    pub fn scales_range(&self) -> Range<usize> {
        let start = self.nope_range().end;
        match self.dtype {
            KvDtype::Fp8DsMla => start..start + 4 * self.tiles_per_token(),
            _ => start..start,
        }
    }
    /// Bytes of the bf16 rope values inside a row.
    pub fn rope_range(&self) -> Range<usize> {
        let start = self.scales_range().end;
        start..start + self.rope_dim * 2
    }
    /// Bytes of the tile scales of the token at `offset` inside its page, tile order:
    /// f32 each inside the row (fp8_ds_mla), one ue8m0 byte each in the scale section
    /// (model1_fp8, its pad byte excluded); empty for bf16.
    pub fn tile_scale_range(&self, offset: usize) -> Range<usize> {
        match self.scale_entry_range(offset) {
            Some(entry) => entry.start..entry.start + self.tiles_per_token(),
            None => {
                let row = self.token_range(offset).start;
                let s = self.scales_range();
                row + s.start..row + s.end
            }
        }
    }
    /// Bytes of the token at `offset`'s whole entry in its page's scale section (model1_fp8:
    /// the 7 ue8m0 tile scales and the pad byte); `None` for layouts without one.
    pub fn scale_entry_range(&self, offset: usize) -> Option<Range<usize>> {
        debug_assert!(offset < self.page_size);
        self.scale_section_offset().map(|base| {
            let at = base + offset * MODEL1_SCALE_BYTES;
            at..at + MODEL1_SCALE_BYTES
        })
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
    /// Bytes of the row of the token at `slot` in a pool of pages packed from byte 0.
    #[inline]
    pub fn slot_token_bytes(&self, slot: usize) -> Range<usize> {
        let a = self.slot_addr(slot);
        let r = self.token_range(a.offset);
        let base = self.page_bytes(a.page).start;
        base + r.start..base + r.end
    }
    /// Bytes of the tile scales of the token at `slot` in a pool of pages packed from
    /// byte 0 (see [`Self::tile_scale_range`]).
    #[inline]
    pub fn slot_tile_scale_bytes(&self, slot: usize) -> Range<usize> {
        let a = self.slot_addr(slot);
        let r = self.tile_scale_range(a.offset);
        let base = self.page_bytes(a.page).start;
        base + r.start..base + r.end
    }
    /// Bytes of the scale-section entry of the token at `slot` in a pool of pages packed
    /// from byte 0 (see [`Self::scale_entry_range`]).
    #[inline]
    pub fn slot_scale_entry_bytes(&self, slot: usize) -> Option<Range<usize>> {
        let a = self.slot_addr(slot);
        let base = self.page_bytes(a.page).start;
        self.scale_entry_range(a.offset)
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
    /// Stable 64-bit fingerprint of this descriptor.
    pub fn fingerprint(&self) -> u64 {
        let tag = match self.dtype {
            KvDtype::Bf16 => 1u64,
            KvDtype::Fp8DsMla => 2,
            KvDtype::Model1Fp8 => 3,
            KvDtype::Bf16x512 => 4,
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
            scale_section: self.scale_section_offset(),
            fingerprint: format!("{:#018x}", self.fingerprint()),
        }
    }
}
