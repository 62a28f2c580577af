//! Kernel parameter structs filled from validated op descriptors: the one place where a
//! layout descriptor becomes the sizes and offsets a GPU kernel uses. The emulator and
//! CUDA launchers both call these, with host or device addresses.
//!
//! Addresses are passed as raw pointers and only stored, never dereferenced here; for
//! CUDA they are device addresses.

use sparsekit_kernels::params::{
    index_k_format, kv_format, CopyPagesParams, IndexKStoreParams, KvStoreParams,
    PageChecksumsParams,
};

use crate::dtype::ScaleFormat;
use crate::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use crate::ops::{CopyPages, PageChecksums};

/// `index_k_store` of `n_tokens` keys into `cache` laid out as `layout`.
pub fn index_k_store(
    layout: &IndexKLayout,
    keys: *const u16,
    slots: *const i64,
    cache: *mut u8,
    n_tokens: usize,
) -> IndexKStoreParams {
    IndexKStoreParams {
        keys,
        slots,
        cache,
        n_tokens: n_tokens as u32,
        head_dim: layout.head_dim() as u32,
        page_size: layout.page_size() as u32,
        format: match layout.dtype() {
            IndexKDtype::Bf16 => index_k_format::BF16,
            IndexKDtype::Fp8E4m3 {
                scale: ScaleFormat::Fp32,
            } => index_k_format::FP8_FP32_SCALE,
            IndexKDtype::Fp8E4m3 {
                scale: ScaleFormat::Ue8m0,
            } => index_k_format::FP8_UE8M0_SCALE,
        },
        page_bytes: layout.bytes_per_page() as u64,
        value_bytes: layout.value_bytes_per_token() as u32,
        scale_offset: layout.scale_section_offset().unwrap_or(0) as u32,
    }
}

/// `kv_store` of `n_tokens` tokens into `cache` laid out as `layout`.
pub fn kv_store(
    layout: &KvLayout,
    kv: *const u16,
    slots: *const i64,
    cache: *mut u8,
    n_tokens: usize,
) -> KvStoreParams {
    KvStoreParams {
        kv,
        slots,
        cache,
        n_tokens: n_tokens as u32,
        nope_dim: layout.nope_dim() as u32,
        rope_dim: layout.rope_dim() as u32,
        page_size: layout.page_size() as u32,
        format: match layout.dtype() {
            KvDtype::Bf16 => kv_format::BF16,
            KvDtype::Fp8DsMla => kv_format::FP8_DS_MLA,
        },
        token_bytes: layout.bytes_per_token() as u32,
        page_bytes: layout.bytes_per_page() as u64,
        scales_offset: layout.scales_range().start as u32,
        rope_offset: layout.rope_range().start as u32,
    }
}

/// `copy_pages` between the buffers at `src`/`dst` (buffer starts; the regions' offsets
/// are applied here), with the id arrays at `src_ids`/`dst_ids`.
pub fn copy_pages(
    op: &CopyPages<'_>,
    src: *const u8,
    dst: *mut u8,
    src_ids: *const i32,
    dst_ids: *const i32,
) -> CopyPagesParams {
    CopyPagesParams {
        src: src.wrapping_add(op.src.offset),
        dst: dst.wrapping_add(op.dst.offset),
        src_ids,
        dst_ids,
        src_stride: op.src.stride as u64,
        dst_stride: op.dst.stride as u64,
        bytes: op.src.layout.bytes_per_page() as u64,
        n_pages: op.src_ids.len() as u32,
        _pad: 0,
    }
}

/// `page_checksums` of the buffer at `pool` (buffer start), ids at `ids`, results to `out`.
pub fn page_checksums(
    op: &PageChecksums<'_>,
    pool: *const u8,
    ids: *const i32,
    out: *mut u64,
) -> PageChecksumsParams {
    PageChecksumsParams {
        pool: pool.wrapping_add(op.region.offset),
        ids,
        out,
        stride: op.region.stride as u64,
        bytes: op.region.layout.bytes_per_page() as u64,
        n_pages: op.ids.len() as u32,
        _pad: 0,
    }
}
