//! Kernel parameter structs filled from validated op descriptors: the one place where a
//! layout descriptor becomes the sizes and offsets a GPU kernel uses (called by the shared
//! op bodies of [`crate::launcher`], for the emulator and CUDA alike).
//!
//! Each builder takes the launch's [`Addrs`] (the buffers read and written and the staged
//! metadata, in the order its doc states): kernel-visible addresses (host addresses for
//! the emulator, device or mapped addresses for CUDA), only stored here, never
//! dereferenced.
//!
//! Counts and in-page offsets are u32 in the parameter structs. The op descriptors
//! ([`crate::ops::MAX_COUNT`]) and layouts ([`crate::layout::MAX_PAGE_BYTES`]) keep them in
//! range; every conversion here is still checked, and one that does not fit is an error
//! (nothing launched), never a truncated value.

use sparsekit_kernels::global::{GlobalMut, GlobalPtr};
use sparsekit_kernels::kernels::{sparse_mla_split, sparse_mla_v4_split, topk_chunk};
use sparsekit_kernels::params::{
    index_k_format, kv_format, CopyPagesParams, IndexKStoreParams, IndexerLogitsParams,
    KvStoreParams, PageChecksumsParams, SparseMlaParams, SparseMlaV4Params, TopkParams,
    V4CacheParams,
};

use crate::dtype::ScaleFormat;
use crate::error::{Error, Result};
use crate::launcher::Addrs;
use crate::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use crate::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, PagedRegion, ShortRows,
    SparseMla, SparseMlaV4, Topk, TopkOutput, V4Cache,
};

/// A kernel-visible address as the read-only address type a parameter struct stores.
pub(crate) fn ptr<T>(addr: u64) -> GlobalPtr<T> {
    GlobalPtr::from_addr(addr)
}

/// A kernel-visible address as a writable address.
pub(crate) fn ptr_mut<T>(addr: u64) -> GlobalMut<T> {
    GlobalMut::from_addr(addr)
}

/// `x` as a u32 kernel parameter, or an error naming it.
pub(crate) fn u32_of(what: &'static str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::InvalidArgument {
        what,
        detail: format!("{x} does not fit the GPU kernels' 32-bit parameter"),
    })
}

/// The kernels' format code of an index-K layout.
fn index_k_format(l: &IndexKLayout) -> u32 {
    match l.dtype() {
        IndexKDtype::Bf16 => index_k_format::BF16,
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Fp32,
        } => index_k_format::FP8_FP32_SCALE,
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Ue8m0,
        } => index_k_format::FP8_UE8M0_SCALE,
        IndexKDtype::Fp4E2m1 => index_k_format::FP4_E2M1,
    }
}

/// The kernels' format code of a KV layout.
fn kv_format(l: &KvLayout) -> u32 {
    match l.dtype() {
        KvDtype::Bf16 | KvDtype::Bf16x512 => kv_format::BF16,
        KvDtype::Fp8DsMla => kv_format::FP8_DS_MLA,
        KvDtype::Model1Fp8 => kv_format::MODEL1_FP8,
    }
}

/// A parameter struct literal of a kernel that reads or writes index-K pages: the given
/// fields, plus the layout fields every such struct has, from the `IndexKLayout`.
macro_rules! with_index_k_layout {
    ($layout:expr, $params:ident { $($field:ident: $value:expr,)* }) => {{
        let l: &IndexKLayout = $layout;
        $params {
            $($field: $value,)*
            head_dim: u32_of("head_dim", l.head_dim())?,
            page_size: u32_of("page_size", l.page_size())?,
            format: index_k_format(l),
            page_bytes: l.bytes_per_page() as u64,
            value_bytes: u32_of("value bytes per token", l.value_bytes_per_token())?,
            scale_offset: u32_of("scale section offset", l.scale_section_offset().unwrap_or(0))?,
            scale_bytes: u32_of("scale bytes per token", l.scale_bytes_per_token())?,
        }
    }};
}

/// A parameter struct literal of a kernel that reads or writes KV pages: the given fields,
/// plus the layout fields every such struct has, from the `KvLayout`.
macro_rules! with_kv_layout {
    ($layout:expr, $params:ident { $($field:ident: $value:expr,)* }) => {{
        let l: &KvLayout = $layout;
        $params {
            $($field: $value,)*
            nope_dim: u32_of("nope_dim", l.nope_dim())?,
            rope_dim: u32_of("rope_dim", l.rope_dim())?,
            page_size: u32_of("page_size", l.page_size())?,
            format: kv_format(l),
            token_bytes: u32_of("bytes per token row", l.row_bytes())?,
            page_bytes: l.bytes_per_page() as u64,
            scales_offset: u32_of("scales offset", l.scales_range().start)?,
            rope_offset: u32_of("rope offset", l.rope_range().start)?,
        }
    }};
}

/// Page 0's address, the page stride and the bytes per page of a region of a buffer at
/// `base`.
fn region(r: &PagedRegion, base: u64) -> (u64, u64, u64) {
    (
        base.wrapping_add(r.offset as u64),
        r.stride as u64,
        r.layout.bytes_per_page() as u64,
    )
}

/// The parameters of a store kernel (both stores take `(source tokens, slots, cache,
/// n_tokens)` plus their layout's fields): reads `[source]`, writes `[cache]`, metadata
/// `[slots]`.
macro_rules! store_params {
    ($with_layout:ident, $op:expr, $a:expr, $params:ident, $source:ident, $($field:ident: $value:expr),*) => {
        $with_layout!(
            &$op.layout,
            $params {
                $source: ptr($a.read[0]),
                slots: ptr($a.meta[0]),
                cache: ptr_mut($a.write[0]),
                n_tokens: u32_of("tokens", $op.slots.len())?,
                $($field: $value,)*
            }
        )
    };
}

/// `index_k_store` of `op`: reads `[keys]`, writes `[cache]`, metadata `[slots]`.
pub(crate) fn index_k_store(op: &IndexKStore<'_>, a: Addrs<'_>) -> Result<IndexKStoreParams> {
    Ok(store_params!(
        with_index_k_layout,
        op,
        a,
        IndexKStoreParams,
        keys,
        _pad: 0
    ))
}

/// `kv_store` of `op`: reads `[kv]`, writes `[cache]`, metadata `[slots]`.
pub(crate) fn kv_store(op: &KvStore<'_>, a: Addrs<'_>) -> Result<KvStoreParams> {
    let section = op.layout.scale_section_offset().unwrap_or(0);
    Ok(store_params!(
        with_kv_layout,
        op,
        a,
        KvStoreParams,
        kv,
        scale_section: u32_of("scale section offset", section)?,
        _pad: 0
    ))
}

/// `copy_pages` of `op`: reads `[src]`, writes `[dst]` (buffer starts: the regions'
/// offsets are applied here), metadata `[src_ids, dst_ids]`.
pub(crate) fn copy_pages(op: &CopyPages<'_>, a: Addrs<'_>) -> Result<CopyPagesParams> {
    let (src, src_stride, bytes) = region(&op.src, a.read[0]);
    let (dst, dst_stride, _) = region(&op.dst, a.write[0]);
    Ok(CopyPagesParams {
        src: ptr(src),
        dst: ptr_mut(dst),
        src_ids: ptr(a.meta[0]),
        dst_ids: ptr(a.meta[1]),
        src_stride,
        dst_stride,
        bytes,
        n_pages: u32_of("pages copied", op.src_ids.len())?,
        _pad: 0,
    })
}

/// `page_checksums` of `op`: reads `[pool]` (buffer start), writes `[checksums]`, metadata
/// `[ids]`.
pub(crate) fn page_checksums(op: &PageChecksums<'_>, a: Addrs<'_>) -> Result<PageChecksumsParams> {
    let (pool, stride, bytes) = region(&op.region, a.read[0]);
    Ok(PageChecksumsParams {
        pool: ptr(pool),
        ids: ptr(a.meta[0]),
        out: ptr_mut(a.write[0]),
        stride,
        bytes,
        n_pages: u32_of("pages", op.ids.len())?,
        _pad: 0,
    })
}

/// `indexer_logits` of `op`: reads `[q, weights, cache]`, writes `[logits]`, metadata
/// `[page_table, rows]`.
pub(crate) fn indexer_logits(op: &IndexerLogits<'_>, a: Addrs<'_>) -> Result<IndexerLogitsParams> {
    Ok(with_index_k_layout!(
        &op.layout,
        IndexerLogitsParams {
            q: ptr(a.read[0]),
            weights: ptr(a.read[1]),
            cache: ptr(a.read[2]),
            page_table: ptr(a.meta[0]),
            rows: ptr(a.meta[1]),
            out: ptr_mut(a.write[0]),
            n_rows: u32_of("rows", op.rows.len())?,
            n_heads: u32_of("n_heads", op.n_heads)?,
            max_pages: u32_of("page_table columns", op.page_table.max_pages())?,
            row_stride: u32_of("row_stride", op.row_stride)?,
        }
    ))
}

/// `topk` of `op`: reads `[logits]`, writes `[topk, workspace, counters]` (the last two
/// sized by `topk_workspace`), metadata `[rows]`, plus the page table when `op` outputs
/// slots (null in the parameters for positions).
pub(crate) fn topk(op: &Topk<'_>, a: Addrs<'_>) -> Result<TopkParams> {
    let (page_table, page_size, max_pages) = match op.output {
        TopkOutput::Positions => (GlobalPtr::null(), 0, 0),
        TopkOutput::Slots {
            page_table,
            page_size,
        } => (
            ptr(a.meta[1]),
            u32_of("page_size", page_size)?,
            u32_of("page_table columns", page_table.max_pages())?,
        ),
    };
    Ok(TopkParams {
        logits: ptr(a.read[0]),
        rows: ptr(a.meta[0]),
        page_table,
        out: ptr_mut(a.write[0]),
        n_rows: u32_of("rows", op.rows.len())?,
        k: u32_of("k", op.k)?,
        row_stride: u32_of("row_stride", op.row_stride)?,
        page_size,
        max_pages,
        chunk: topk_chunk(u32_of("k", op.k)?),
        workspace: ptr_mut(a.write[1]),
        counters: ptr_mut(a.write[2]),
        take_all_short: (op.short_rows == ShortRows::TakeAll) as u32,
        _pad: 0,
    })
}

/// `sparse_mla` of `op`: reads `[q, cache, indices]`, writes `[out, lse, workspace,
/// counters]` (the last two sized by `sparse_mla_workspace`).
pub(crate) fn sparse_mla(op: &SparseMla, a: Addrs<'_>) -> Result<SparseMlaParams> {
    Ok(with_kv_layout!(
        &op.layout,
        SparseMlaParams {
            n_tokens: u32_of("n_tokens", op.n_tokens)?,
            n_heads: u32_of("n_heads", op.n_heads)?,
            topk: u32_of("topk", op.topk)?,
            softmax_scale: op.softmax_scale,
            split: sparse_mla_split(u32_of("topk", op.topk)?),
            q: ptr(a.read[0]),
            cache: ptr(a.read[1]),
            indices: ptr(a.read[2]),
            out: ptr_mut(a.write[0]),
            lse: ptr_mut(a.write[1]),
            workspace: ptr_mut(a.write[2]),
            counters: ptr_mut(a.write[3]),
        }
    ))
}

/// Where the buffers and metadata of a `sparse_mla_v4` launch are: indices into the
/// launch's reads (`q`, main cache, main indices, then the extra's) and metadata (each
/// cache's lengths and the sink, when given).
#[derive(Clone, Copy, Debug)]
pub(crate) struct V4Slots {
    pub main_lengths: Option<usize>,
    pub extra_lengths: Option<usize>,
    pub sink: Option<usize>,
}

/// One cache's kernel parameters (`bufs`: its cache and indices addresses; `lengths`: the
/// staged lengths, or null).
fn v4_cache(c: &V4Cache<'_>, bufs: [u64; 2], lengths: GlobalPtr<u32>) -> Result<V4CacheParams> {
    let l = &c.layout;
    Ok(V4CacheParams {
        cache: ptr(bufs[0]),
        indices: ptr(bufs[1]),
        lengths,
        page_bytes: l.bytes_per_page() as u64,
        page_size: u32_of("page_size", l.page_size())?,
        topk: u32_of("topk", c.topk)?,
        format: kv_format(l),
        row_bytes: u32_of("bytes per token row", l.row_bytes())?,
        scale_section: u32_of(
            "scale section offset",
            l.scale_section_offset().unwrap_or(0),
        )?,
        _pad: 0,
    })
}

/// `sparse_mla_v4` of `op`: reads `[q, main cache, main indices, (extra cache, extra
/// indices)]`, writes `[out, lse, workspace, counters]` (the last two sized by
/// `sparse_mla_v4_workspace`), metadata as `at` says.
pub(crate) fn sparse_mla_v4(
    op: &SparseMlaV4<'_>,
    a: Addrs<'_>,
    at: V4Slots,
) -> Result<SparseMlaV4Params> {
    fn meta<T>(a: &Addrs<'_>, i: Option<usize>) -> GlobalPtr<T> {
        i.map_or(GlobalPtr::null(), |i| ptr(a.meta[i]))
    }
    let main = v4_cache(&op.main, [a.read[1], a.read[2]], meta(&a, at.main_lengths))?;
    let extra = match &op.extra {
        Some(c) => v4_cache(c, [a.read[3], a.read[4]], meta(&a, at.extra_lengths))?,
        None => V4CacheParams {
            cache: GlobalPtr::null(),
            indices: GlobalPtr::null(),
            lengths: GlobalPtr::null(),
            page_bytes: 0,
            page_size: 1,
            topk: 0,
            format: 0,
            row_bytes: 0,
            scale_section: 0,
            _pad: 0,
        },
    };
    let total = u32_of("topk", op.caches().map(|c| c.topk).sum())?;
    Ok(SparseMlaV4Params {
        q: ptr(a.read[0]),
        out: ptr_mut(a.write[0]),
        lse: ptr_mut(a.write[1]),
        sink: meta(&a, at.sink),
        main,
        extra,
        n_tokens: u32_of("n_tokens", op.n_tokens)?,
        n_heads: u32_of("n_heads", op.n_heads)?,
        softmax_scale: op.softmax_scale,
        split: sparse_mla_v4_split(total),
        workspace: ptr_mut(a.write[2]),
        counters: ptr_mut(a.write[3]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_layouts_fit_the_parameters_exactly() {
        let a = Addrs {
            read: &[0x1000],
            write: &[0x2000],
            meta: &[0x3000],
        };
        // The largest fp8 index-K page the layout accepts: its scale section starts
        // above 2^31, and must arrive unchanged.
        let l = IndexKLayout::new(IndexKDtype::FP8, (1 << 20) - 16, 4095).unwrap();
        assert!(l.bytes_per_page() <= crate::layout::MAX_PAGE_BYTES);
        let p = index_k_store(
            &IndexKStore {
                layout: l,
                slots: &[0],
            },
            a,
        )
        .unwrap();
        assert_eq!(p.scale_offset as usize, l.scale_section_offset().unwrap());
        assert_eq!(p.page_bytes as usize, l.bytes_per_page());
        let kv = KvLayout::new(KvDtype::Fp8DsMla, 1 << 18, 64, 4096).unwrap();
        let p = kv_store(
            &KvStore {
                layout: kv,
                slots: &[0],
            },
            a,
        )
        .unwrap();
        assert_eq!(p.rope_offset as usize, kv.rope_range().start);
        assert_eq!(p.token_bytes as usize, kv.row_bytes());
        assert!(u32_of("x", u32::MAX as usize).is_ok());
        assert!(matches!(
            u32_of("x", u32::MAX as usize + 1),
            Err(Error::InvalidArgument { what: "x", .. })
        ));
    }
}
