//! Kernel parameter structs filled from validated op descriptors: the one place where a
//! layout descriptor becomes the sizes and offsets a GPU kernel uses (called by the shared
//! op bodies of [`crate::launcher`], for the emulator and CUDA alike).
//!
//! Addresses are the backend's kernel-visible addresses (host addresses for the emulator,
//! device or mapped addresses for CUDA), only stored here, never dereferenced.

use sparsekit_kernels::params::{
    index_k_format, kv_format, CopyPagesParams, IndexKStoreParams, IndexerLogitsParams,
    KvStoreParams, PageChecksumsParams, SparseMlaParams, TopkParams,
};

use sparsekit_kernels::params::QueryRange;

use crate::dtype::ScaleFormat;
use crate::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use crate::ops::{CopyPages, IndexerLogits, PageChecksums, SparseMla, Topk, TopkOutput};

/// A kernel-visible address as the pointer type a parameter struct stores.
fn ptr<T>(addr: u64) -> *const T {
    addr as usize as *const T
}

/// A kernel-visible address as a mutable pointer.
fn ptr_mut<T>(addr: u64) -> *mut T {
    addr as usize as *mut T
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
pub(crate) fn index_k_store(
    layout: &IndexKLayout,
    keys: u64,
    slots: u64,
    cache: u64,
    n_tokens: usize,
) -> IndexKStoreParams {
    IndexKStoreParams {
        keys: ptr(keys),
        slots: ptr(slots),
        cache: ptr_mut(cache),
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
pub(crate) fn kv_store(
    layout: &KvLayout,
    kv: u64,
    slots: u64,
    cache: u64,
    n_tokens: usize,
) -> KvStoreParams {
    KvStoreParams {
        kv: ptr(kv),
        slots: ptr(slots),
        cache: ptr_mut(cache),
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
pub(crate) fn copy_pages(
    op: &CopyPages<'_>,
    src: u64,
    dst: u64,
    src_ids: u64,
    dst_ids: u64,
) -> CopyPagesParams {
    CopyPagesParams {
        src: ptr(src.wrapping_add(op.src.offset as u64)),
        dst: ptr_mut(dst.wrapping_add(op.dst.offset as u64)),
        src_ids: ptr(src_ids),
        dst_ids: ptr(dst_ids),
        src_stride: op.src.stride as u64,
        dst_stride: op.dst.stride as u64,
        bytes: op.src.layout.bytes_per_page() as u64,
        n_pages: op.src_ids.len() as u32,
        _pad: 0,
    }
}

/// `page_checksums` of the buffer at `pool` (buffer start), ids at `ids`, results to `out`.
pub(crate) fn page_checksums(
    op: &PageChecksums<'_>,
    pool: u64,
    ids: u64,
    out: u64,
) -> PageChecksumsParams {
    PageChecksumsParams {
        pool: ptr(pool.wrapping_add(op.region.offset as u64)),
        ids: ptr(ids),
        out: ptr_mut(out),
        stride: op.region.stride as u64,
        bytes: op.region.layout.bytes_per_page() as u64,
        n_pages: op.ids.len() as u32,
        _pad: 0,
    }
}

/// `indexer_logits` of `op`; `page_table` and `rows` point at `op`'s page table and rows
/// (as uploaded for the kernel).
pub(crate) fn indexer_logits(
    op: &IndexerLogits<'_>,
    q: u64,
    weights: u64,
    cache: u64,
    page_table: u64,
    rows: u64,
    out: u64,
) -> IndexerLogitsParams {
    let l = &op.layout;
    IndexerLogitsParams {
        q: ptr(q),
        weights: ptr(weights),
        cache: ptr(cache),
        page_table: ptr(page_table),
        rows: ptr::<QueryRange>(rows),
        out: ptr_mut(out),
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
pub(crate) fn topk(op: &Topk<'_>, logits: u64, rows: u64, page_table: u64, out: u64) -> TopkParams {
    let (page_table, page_size, max_pages) = match op.output {
        TopkOutput::Positions => (std::ptr::null(), 0, 0),
        TopkOutput::Slots {
            page_table: pt,
            page_size,
        } => (ptr(page_table), page_size as u32, pt.max_pages() as u32),
    };
    TopkParams {
        logits: ptr(logits),
        rows: ptr(rows),
        page_table,
        out: ptr_mut(out),
        n_rows: op.rows.len() as u32,
        k: op.k as u32,
        row_stride: op.row_stride as u32,
        page_size,
        max_pages,
        _pad: 0,
    }
}

/// `sparse_mla` of `op`.
pub(crate) fn sparse_mla(
    op: &SparseMla,
    q: u64,
    cache: u64,
    indices: u64,
    out: u64,
    lse: u64,
) -> SparseMlaParams {
    let l = &op.layout;
    SparseMlaParams {
        q: ptr(q),
        cache: ptr(cache),
        indices: ptr(indices),
        out: ptr_mut(out),
        lse: ptr_mut(lse),
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
