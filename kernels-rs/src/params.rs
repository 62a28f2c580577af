//! `#[repr(C)]` kernel parameter structs, passed by value as the kernel's single
//! parameter. Defined once here; device entry points, the emulator and the CUDA launcher
//! all use them. Byte sizes and offsets in them come from the host's layout descriptors
//! (`sparsekit_host::layout`): the kernels compute none of their own.
//!
//! Global memory is named by typed addresses ([`GlobalPtr`] read, [`GlobalMut`] written),
//! which kernels can only access through [`Simt::gld`](crate::Simt::gld) and
//! [`Simt::gst`](crate::Simt::gst).
//!
//! Units: fields named `*_bytes`/`*_offset`/`*_stride` are bytes; `n_*`, `*_dim` and
//! `page_size` are elements or tokens.

use crate::global::{GlobalMut, GlobalPtr};

mod dense;
pub use dense::*;

/// Index-K element format for [`IndexKStoreParams::format`].
pub mod index_k_format {
    /// bf16 values, no scale.
    pub const BF16: u32 = 0;
    /// e4m3 values + f32 scale `max(amax, 1e-4) / 448`.
    pub const FP8_FP32_SCALE: u32 = 1;
    /// e4m3 values + f32 scale rounded up to a power of two.
    pub const FP8_UE8M0_SCALE: u32 = 2;
    /// Packed e2m1 values (two per byte, low nibble = even element) + one ue8m0 byte per
    /// [`FP4_GROUP`] values (`crate::mx`).
    pub const FP4_E2M1: u32 = 3;
    /// Values per fp4 index-K scale (one ue8m0 byte each).
    pub const FP4_GROUP: u32 = 32;
}

/// KV element format for [`KvStoreParams::format`].
pub mod kv_format {
    /// bf16 latent + bf16 rope.
    pub const BF16: u32 = 0;
    /// e4m3 latent in tiles of [`FP8_DS_MLA_TILE`] with f32 pow2 scales, bf16 rope.
    pub const FP8_DS_MLA: u32 = 1;
    /// Latent values per fp8_ds_mla quantization tile (one f32 scale each). The kernels
    /// that read or write fp8_ds_mla tokens and the host layout descriptor
    /// (`sparsekit_host::layout::KvLayout`) both take the tile width from here.
    pub const FP8_DS_MLA_TILE: u32 = 128;
    /// DeepSeek-V4's "MODEL1" fp8 KV: per page, rows of [`MODEL1_ROW_BYTES`] (e4m3 NoPE in
    /// tiles of [`MODEL1_TILE`], then bf16 rope), then [`MODEL1_SCALE_BYTES`] per token
    /// (one ue8m0 byte per tile, then padding); the page stride is a multiple of the row.
    pub const MODEL1_FP8: u32 = 2;
    /// Values per MODEL1 tile (one ue8m0 scale byte each).
    pub const MODEL1_TILE: u32 = 64;
    /// MODEL1 NoPE values per token (7 tiles).
    pub const MODEL1_NOPE: u32 = 448;
    /// MODEL1 rope values per token (bf16).
    pub const MODEL1_ROPE: u32 = 64;
    /// Bytes of a MODEL1 row: 448 e4m3 + 64 bf16.
    pub const MODEL1_ROW_BYTES: u32 = MODEL1_NOPE + 2 * MODEL1_ROPE;
    /// Bytes of a MODEL1 token's scales in the page's scale section: 7 ue8m0 + 1 pad.
    pub const MODEL1_SCALE_BYTES: u32 = 8;
}

/// One row of a ragged query batch: which request it belongs to and the half-open range
/// of that request's token positions it may see. The kernels read `[n_rows]` of these
/// (`#[repr(C)]`: three little-endian u32, 12 bytes, no padding).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QueryRange {
    /// Index into the page table.
    pub request: u32,
    /// First visible position.
    pub start: u32,
    /// One past the last visible position.
    pub end: u32,
}

impl QueryRange {
    /// Loads row `i` of `rows` (three 4-byte loads).
    ///
    /// # Safety
    /// `rows` holds at least `i + 1` ranges (4-byte aligned).
    #[inline(always)]
    pub unsafe fn load<S: crate::Simt>(rows: GlobalPtr<QueryRange>, i: u32) -> Self {
        let w = rows.add(i as usize).cast::<u32>();
        // SAFETY: the three words of row i (caller's contract).
        unsafe {
            QueryRange {
                request: S::gld(w),
                start: S::gld(w.add(1)),
                end: S::gld(w.add(2)),
            }
        }
    }

    /// The bytes of a slice of rows, as the kernels read them (for uploads).
    pub fn as_bytes(rows: &[QueryRange]) -> &[u8] {
        // SAFETY: `QueryRange` is `#[repr(C)]` of three u32: size 12, alignment 4, no
        // padding, so its bytes are initialised; u8 has alignment 1 and the length is
        // exactly the slice's size in bytes; the returned slice borrows `rows`.
        unsafe {
            core::slice::from_raw_parts(rows.as_ptr().cast::<u8>(), core::mem::size_of_val(rows))
        }
    }
}

/// `index_k_store`: token `t`'s bf16 key goes to cache slot `slots[t]` (`-1` skips).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IndexKStoreParams {
    /// bf16 bits `[n_tokens, head_dim]`.
    pub keys: GlobalPtr<u16>,
    /// `[n_tokens]` slots (`page * page_size + offset`) or `-1`; unique.
    pub slots: GlobalPtr<i64>,
    /// The paged index-K buffer.
    pub cache: GlobalMut<u8>,
    pub n_tokens: u32,
    pub head_dim: u32,
    pub page_size: u32,
    /// One of [`index_k_format`].
    pub format: u32,
    /// Bytes per page.
    pub page_bytes: u64,
    /// Value bytes per token (`head_dim` for fp8, `2·head_dim` for bf16, `head_dim / 2`
    /// for fp4).
    pub value_bytes: u32,
    /// Offset of the scale section inside a page (fp8, fp4).
    pub scale_offset: u32,
    /// Scale bytes per token in the scale section (fp8 4, fp4 `head_dim / 32`, bf16 0).
    pub scale_bytes: u32,
    pub _pad: u32,
}

/// `kv_store`: token `t`'s bf16 `[latent | rope]` goes to slot `slots[t]` (`-1` skips).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvStoreParams {
    /// bf16 bits `[n_tokens, nope_dim + rope_dim]`.
    pub kv: GlobalPtr<u16>,
    /// `[n_tokens]` slots or `-1`; unique.
    pub slots: GlobalPtr<i64>,
    /// The paged KV buffer.
    pub cache: GlobalMut<u8>,
    pub n_tokens: u32,
    pub nope_dim: u32,
    pub rope_dim: u32,
    pub page_size: u32,
    /// One of [`kv_format`].
    pub format: u32,
    /// Bytes per token row (the row stride inside a page).
    pub token_bytes: u32,
    /// Bytes per page (the page stride).
    pub page_bytes: u64,
    /// Offset of the f32 tile scales inside a row (fp8_ds_mla only).
    pub scales_offset: u32,
    /// Offset of the bf16 rope inside a row.
    pub rope_offset: u32,
    /// Offset of the scale section inside a page (model1_fp8 only: 8 bytes per token, 7
    /// ue8m0 tile scales and a zero pad byte).
    pub scale_section: u32,
    pub _pad: u32,
}

/// `copy_pages`: copies `bytes` bytes of page `src_ids[i]` of the source pool to page
/// `dst_ids[i]` of the destination pool, for `i < n_pages`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CopyPagesParams {
    /// Address of page 0 of the source pool.
    pub src: GlobalPtr<u8>,
    /// Address of page 0 of the destination pool.
    pub dst: GlobalMut<u8>,
    pub src_ids: GlobalPtr<i32>,
    /// Unique (no two copies write the same page).
    pub dst_ids: GlobalPtr<i32>,
    /// Bytes between consecutive source pages.
    pub src_stride: u64,
    /// Bytes between consecutive destination pages.
    pub dst_stride: u64,
    /// Bytes copied per page.
    pub bytes: u64,
    pub n_pages: u32,
    pub _pad: u32,
}

/// `page_checksums`: `out[i]` = checksum of the `bytes` bytes of page `ids[i]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PageChecksumsParams {
    /// Address of page 0 of the pool.
    pub pool: GlobalPtr<u8>,
    pub ids: GlobalPtr<i32>,
    /// `[n_pages]` checksums.
    pub out: GlobalMut<u64>,
    /// Bytes between consecutive pages.
    pub stride: u64,
    /// Bytes checksummed per page.
    pub bytes: u64,
    pub n_pages: u32,
    pub _pad: u32,
}

/// `indexer_logits` (see `sparsekit_host::ops::IndexerLogits`): for every row `r` and
/// column `c < row_stride`, `out[r, c] = Σ_h w[r,h] · ReLU(q[r,h] · k[c]) · scale[c]` when
/// `c` is in the row's `[start, end)`, else `-inf`. Keys are read through the page table.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IndexerLogitsParams {
    /// bf16 bits `[n_rows, n_heads, head_dim]`.
    pub q: GlobalPtr<u16>,
    /// `[n_rows, n_heads]`.
    pub weights: GlobalPtr<f32>,
    /// The paged index-K buffer.
    pub cache: GlobalPtr<u8>,
    /// `[n_requests, max_pages]` page ids (`-1` unmapped; never reached by a valid row).
    pub page_table: GlobalPtr<i32>,
    /// `[n_rows]` (validated: end ≤ row_stride, every position mapped).
    pub rows: GlobalPtr<QueryRange>,
    /// `[n_rows, row_stride]`.
    pub out: GlobalMut<f32>,
    /// Bytes per page.
    pub page_bytes: u64,
    pub n_rows: u32,
    pub n_heads: u32,
    pub head_dim: u32,
    pub page_size: u32,
    pub max_pages: u32,
    pub row_stride: u32,
    /// One of [`index_k_format`].
    pub format: u32,
    /// Value bytes per token.
    pub value_bytes: u32,
    /// Offset of the scale section inside a page (fp8, fp4).
    pub scale_offset: u32,
    /// Scale bytes per token in the scale section (fp8 4, fp4 `head_dim / 32`, bf16 0).
    pub scale_bytes: u32,
}

/// `indexer_logits` over fp4 index keys: the same parameters (`format` = `FP4_E2M1`), its
/// own entry point so that the fp4 dequantisation does not raise the register count (and
/// lower the occupancy) of the fp8 and bf16 kernel.
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub struct IndexerLogitsFp4Params(pub IndexerLogitsParams);

/// `topk` (see `sparsekit_host::ops::Topk`): per row, the positions (or slots, through the
/// page table) of the `k` largest valid logits of `[start, end)` (not `-inf`, not NaN;
/// ties to the lower position), ascending, then `-1` padding.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TopkParams {
    /// `[n_rows, row_stride]`.
    pub logits: GlobalPtr<f32>,
    /// `[n_rows]` (validated: start ≤ end ≤ row_stride).
    pub rows: GlobalPtr<QueryRange>,
    /// `[n_requests, max_pages]`, or null to output positions.
    pub page_table: GlobalPtr<i32>,
    /// `[n_rows, k]`.
    pub out: GlobalMut<i32>,
    pub n_rows: u32,
    pub k: u32,
    pub row_stride: u32,
    pub page_size: u32,
    pub max_pages: u32,
    /// Positions per chunk: a row longer than this is cut into chunks whose top-k are
    /// found by separate blocks and merged by the last one (`kernels::topk_chunk`).
    pub chunk: u32,
    /// Per (row, chunk) candidates, when rows are split (`kernels::topk_workspace` bytes;
    /// contents need no initialisation).
    pub workspace: GlobalMut<u32>,
    /// Per row counts of finished chunks, when rows are split: zero before the launch,
    /// zero again after it.
    pub counters: GlobalMut<u32>,
    /// 1: a row whose range holds at most `k` positions writes all of them in order
    /// (DeepSeek-V4's transform); 0: its valid entries.
    pub take_all_short: u32,
    pub _pad: u32,
}

/// `sparse_mla` (see `sparsekit_host::ops::SparseMla`): per token and head, softmax
/// attention over the token's `topk` slots (`-1` skipped); `out` bf16, `lse` natural log;
/// a token without valid slots gets `out = 0`, `lse = -inf`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SparseMlaParams {
    /// bf16 bits `[n_tokens, n_heads, nope_dim + rope_dim]`.
    pub q: GlobalPtr<u16>,
    /// The paged KV buffer.
    pub cache: GlobalPtr<u8>,
    /// `[n_tokens, topk]` slots or `-1` (validated in range).
    pub indices: GlobalPtr<i32>,
    /// bf16 bits `[n_tokens, n_heads, nope_dim]`.
    pub out: GlobalMut<u16>,
    /// `[n_tokens, n_heads]`.
    pub lse: GlobalMut<f32>,
    /// Bytes per page.
    pub page_bytes: u64,
    pub n_tokens: u32,
    pub n_heads: u32,
    pub topk: u32,
    pub nope_dim: u32,
    pub rope_dim: u32,
    pub page_size: u32,
    /// One of [`kv_format`].
    pub format: u32,
    /// Bytes per token row.
    pub token_bytes: u32,
    /// Offset of the f32 tile scales inside a token (fp8_ds_mla only).
    pub scales_offset: u32,
    /// Offset of the bf16 rope inside a token.
    pub rope_offset: u32,
    pub softmax_scale: f32,
    /// Indices per split: a token's `topk` indices are cut into `ceil(topk / split)`
    /// consecutive ranges attended by separate blocks and merged in range order (see
    /// `kernels::sparse_mla_split`); `split ≥ topk`: no split.
    pub split: u32,
    /// Per (token, head group, split) partial results, when split
    /// (`kernels::sparse_mla_workspace` bytes; contents need no initialisation).
    pub workspace: GlobalMut<f32>,
    /// Per (token, head group) counts of finished splits, when split: zero before the
    /// launch, zero again after it.
    pub counters: GlobalMut<u32>,
}

/// One KV cache of `sparse_mla_v4` as the kernel reads it (filled from a `KvLayout` of
/// `model1_fp8` or `bf16_512`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct V4CacheParams {
    /// The paged KV buffer.
    pub cache: GlobalPtr<u8>,
    /// `[n_tokens, topk]` slots; inside a token's length `-1` or a slot of the cache.
    pub indices: GlobalPtr<i32>,
    /// `[n_tokens]` used indices per token (each `≤ topk`), or null: all `topk`.
    pub lengths: GlobalPtr<u32>,
    /// Bytes per page (the page stride).
    pub page_bytes: u64,
    pub page_size: u32,
    /// Indices per token (0: the call has no such cache).
    pub topk: u32,
    /// [`kv_format::MODEL1_FP8`] or [`kv_format::BF16`] (`bf16_512`).
    pub format: u32,
    /// Bytes per token row (576 or 1024).
    pub row_bytes: u32,
    /// Offset of the scale section inside a page (model1_fp8).
    pub scale_section: u32,
    pub _pad: u32,
}

/// `sparse_mla_v4` (see `sparsekit_host::ops::SparseMlaV4`): per token and head, attention
/// over the used slots of `main`, then `extra`, K = V = the 512-d row; `lse` natural log
/// without the sink, `out` times `1 / (1 + exp(sink − lse))`; a token without a valid slot
/// gets `out = 0`, `lse = +inf`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SparseMlaV4Params {
    /// bf16 bits `[n_tokens, n_heads, 512]`.
    pub q: GlobalPtr<u16>,
    /// bf16 bits `[n_tokens, n_heads, 512]`.
    pub out: GlobalMut<u16>,
    /// `[n_tokens, n_heads]`.
    pub lse: GlobalMut<f32>,
    /// `[n_heads]` sink logits, or null: no sink.
    pub sink: GlobalPtr<f32>,
    pub main: V4CacheParams,
    /// `topk = 0`: no extra cache.
    pub extra: V4CacheParams,
    pub n_tokens: u32,
    pub n_heads: u32,
    pub softmax_scale: f32,
    /// Index positions per split of the main ‖ extra list (`kernels::sparse_mla_v4_split`);
    /// `≥ main.topk + extra.topk`: no split.
    pub split: u32,
    /// Per (token, head group, split) partial results, when split
    /// (`kernels::sparse_mla_v4_workspace` bytes; contents need no initialisation).
    pub workspace: GlobalMut<f32>,
    /// Per (token, head group) counts of finished splits, when split: zero before the
    /// launch, zero again after it.
    pub counters: GlobalMut<u32>,
}
