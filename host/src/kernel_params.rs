//! Kernel parameter structs filled from validated op descriptors: the one place where a
//! layout descriptor becomes the sizes and offsets a GPU kernel uses. The emulator and
//! CUDA launchers both call these, with host or device addresses.
//!
//! Addresses are passed as raw pointers and only stored, never dereferenced here; for
//! CUDA they are device addresses.

use sparsekit_kernels::params::{
    index_k_format, kv_format, CopyPagesParams, IndexKStoreParams, IndexerLogitsParams,
    KvStoreParams, PageChecksumsParams, SparseMlaParams, TopkParams,
};

use crate::dtype::ScaleFormat;
use crate::error::{Error, Result};
use crate::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use crate::ops::{CopyPages, IndexerLogits, PageChecksums, SparseMla, Topk, TopkOutput};
use sparsekit_kernels::launch::{Launch, MAX_DYN_SMEM};

/// Checks that a kernel's launch fits the GPU limits (shared memory), so a shape the
/// kernels cannot run is a clear error on every GPU backend instead of a launch failure.
pub fn check_launch(kernel: &'static str, l: Launch) -> Result<Launch> {
    if l.smem_bytes > MAX_DYN_SMEM {
        return Err(Error::InvalidArgument {
            what: kernel,
            detail: format!(
                "this shape needs {} bytes of shared memory per block, more than the {MAX_DYN_SMEM} the GPU kernels use",
                l.smem_bytes
            ),
        });
    }
    Ok(l)
}

/// Checks the shapes the GPU indexer supports (`head_dim` up to 256).
pub fn check_indexer(op: &IndexerLogits<'_>) -> Result<()> {
    let max = sparsekit_kernels::kernels::INDEXER_MAX_HEAD_DIM as usize;
    if op.layout.head_dim() > max {
        return Err(Error::InvalidArgument {
            what: "indexer_logits",
            detail: format!(
                "head_dim {} above the GPU kernel's {max}",
                op.layout.head_dim()
            ),
        });
    }
    Ok(())
}

fn index_k_format(layout: &IndexKLayout) -> u32 {
    match layout.dtype() {
        IndexKDtype::Bf16 => index_k_format::BF16,
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Fp32,
        } => index_k_format::FP8_FP32_SCALE,
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Ue8m0,
        } => index_k_format::FP8_UE8M0_SCALE,
    }
}

fn kv_format(layout: &KvLayout) -> u32 {
    match layout.dtype() {
        KvDtype::Bf16 => kv_format::BF16,
        KvDtype::Fp8DsMla => kv_format::FP8_DS_MLA,
    }
}

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
        format: index_k_format(layout),
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
        format: kv_format(layout),
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

/// `indexer_logits` of `op`; `page_table` and `rows` point at `op`'s page table and rows
/// (as uploaded for the kernel).
pub fn indexer_logits(
    op: &IndexerLogits<'_>,
    q: *const u16,
    weights: *const f32,
    cache: *const u8,
    page_table: *const i32,
    rows: *const u32,
    out: *mut f32,
) -> IndexerLogitsParams {
    let l = &op.layout;
    IndexerLogitsParams {
        q,
        weights,
        cache,
        page_table,
        rows,
        out,
        page_bytes: l.bytes_per_page() as u64,
        n_rows: op.rows.len() as u32,
        n_heads: op.n_heads as u32,
        head_dim: l.head_dim() as u32,
        page_size: l.page_size() as u32,
        max_pages: op.page_table.max_pages() as u32,
        row_stride: op.row_stride as u32,
        format: index_k_format(l),
        value_bytes: l.value_bytes_per_token() as u32,
        scale_offset: l.scale_section_offset().unwrap_or(0) as u32,
        _pad: 0,
    }
}

/// `topk` of `op`; `page_table` is ignored (null) when `op` outputs positions.
pub fn topk(
    op: &Topk<'_>,
    logits: *const f32,
    rows: *const u32,
    page_table: *const i32,
    out: *mut i32,
) -> TopkParams {
    let (page_table, page_size, max_pages) = match op.output {
        TopkOutput::Positions => (std::ptr::null(), 0, 0),
        TopkOutput::Slots {
            page_table: pt,
            page_size,
        } => (page_table, page_size as u32, pt.max_pages() as u32),
    };
    TopkParams {
        logits,
        rows,
        page_table,
        out,
        n_rows: op.rows.len() as u32,
        k: op.k as u32,
        row_stride: op.row_stride as u32,
        page_size,
        max_pages,
        _pad: 0,
    }
}

/// `sparse_mla` of `op`.
pub fn sparse_mla(
    op: &SparseMla,
    q: *const u16,
    cache: *const u8,
    indices: *const i32,
    out: *mut u16,
    lse: *mut f32,
) -> SparseMlaParams {
    let l = &op.layout;
    SparseMlaParams {
        q,
        cache,
        indices,
        out,
        lse,
        page_bytes: l.bytes_per_page() as u64,
        n_tokens: op.n_tokens as u32,
        n_heads: op.n_heads as u32,
        topk: op.topk as u32,
        nope_dim: l.nope_dim() as u32,
        rope_dim: l.rope_dim() as u32,
        page_size: l.page_size() as u32,
        format: kv_format(l),
        token_bytes: l.bytes_per_token() as u32,
        scales_offset: l.scales_range().start as u32,
        rope_offset: l.rope_range().start as u32,
        softmax_scale: op.softmax_scale,
        _pad: 0,
    }
}
