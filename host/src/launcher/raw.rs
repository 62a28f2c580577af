//! Kernel parameters for callers whose tensors and metadata already live where the
//! kernels read them: a framework's device tensors (the Python package's CUDA path, which
//! launches on the caller's stream with no staging, no host copy and no allocation of
//! its own).
//!
//! The [`KernelDevice`](super::KernelDevice) ops above stage host metadata (slots, page
//! tables, query ranges) and check its *contents* before a launch; here the metadata is
//! device memory the host cannot read without a synchronisation, so only its *sizes* are
//! checked. Each builder takes the op's shapes, checks every buffer size in **bytes**
//! through the op descriptor's own `validate` (with placeholder metadata of the right
//! length, whose contents are trivially valid), then fills the kernel's parameter struct
//! through `kernel_params`, the one place layouts become kernel
//! sizes. Addresses are kernel-visible (device) addresses, stored, never dereferenced.
//!
//! # The caller's contract (what makes the launch memory-safe)
//!
//! The parameters are safe to launch only when the device metadata holds what the
//! descriptors' content checks would have accepted: every slot `-1` or inside the cache,
//! every query range inside its row and the page table, every page id of a range inside
//! the pool, every `sparse_mla` index `-1` or a slot of the cache. The Python package
//! guarantees it by sanitising the metadata on the device before the launch (masking or
//! clamping with elementwise tensor ops, which need no host synchronisation).

use sparsekit_kernels::kernels::{sparse_mla_v4_workspace, sparse_mla_workspace, topk_workspace};
use sparsekit_kernels::params::{
    CopyPagesParams, IndexKStoreParams, IndexerLogitsFp4Params, IndexerLogitsParams, KvStoreParams,
    PageChecksumsParams, QueryRange, SparseMlaParams, SparseMlaV4Params, TopkParams,
};

use super::{check_indexer, check_launch, Addrs};
use crate::error::{Error, Result};
use crate::kernel_params;
use crate::layout::{IndexKDtype, IndexKLayout, KvLayout, PageLayout};
use crate::ops::{
    checked_size, CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, PageTable,
    PagedRegion, ShortRows, SparseMla, SparseMlaV4, Topk, TopkOutput, V4Cache,
};

/// A device buffer: its kernel-visible address and its length in **bytes**.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuf {
    pub addr: u64,
    pub bytes: usize,
}

impl DeviceBuf {
    /// A buffer of `bytes` bytes at `addr`.
    pub fn new(addr: u64, bytes: usize) -> Self {
        DeviceBuf { addr, bytes }
    }
}

/// A placeholder vector of `n` copies of `value` (the descriptors' metadata slices are only
/// counted here), or an error naming `what` when it cannot be allocated.
fn placeholder<T: Clone>(what: &'static str, n: usize, value: T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|e| Error::invalid(what, format!("{n} entries cannot be allocated: {e}")))?;
    v.resize(n, value);
    Ok(v)
}

/// Checks that a device buffer holds exactly `factors` multiplied, in bytes.
fn check_buf(what: &'static str, buf: DeviceBuf, factors: &[usize]) -> Result<()> {
    crate::ops::check_size(what, factors, buf.bytes)
}

/// `index_k_store` of `n_tokens` keys: `keys` bf16 `[n_tokens, head_dim]`, `slots` i64
/// `[n_tokens]` (each `-1` or a slot of `cache`, unique: the caller's contract), `cache`
/// whole pages.
pub fn index_k_store(
    layout: IndexKLayout,
    keys: DeviceBuf,
    slots: DeviceBuf,
    cache: DeviceBuf,
) -> Result<IndexKStoreParams> {
    let n = slots.bytes / 8;
    check_buf("slots", slots, &[n, 8])?;
    let dummy = placeholder("slots", n, -1i64)?;
    let op = IndexKStore {
        layout,
        slots: &dummy,
    };
    op.validate(keys.bytes, cache.bytes)?;
    kernel_params::index_k_store(
        &op,
        Addrs {
            read: &[keys.addr],
            write: &[cache.addr],
            meta: &[slots.addr],
        },
    )
}

/// `kv_store`: `kv` bf16 `[n_tokens, d_qk]`, `slots` i64 `[n_tokens]` (each `-1` or a slot
/// of `cache`, unique: the caller's contract), `cache` whole pages.
pub fn kv_store(
    layout: KvLayout,
    kv: DeviceBuf,
    slots: DeviceBuf,
    cache: DeviceBuf,
) -> Result<KvStoreParams> {
    let n = slots.bytes / 8;
    check_buf("slots", slots, &[n, 8])?;
    let dummy = placeholder("slots", n, -1i64)?;
    let op = KvStore {
        layout,
        slots: &dummy,
    };
    op.validate(kv.bytes, cache.bytes)?;
    kernel_params::kv_store(
        &op,
        Addrs {
            read: &[kv.addr],
            write: &[cache.addr],
            meta: &[slots.addr],
        },
    )
}

/// The shapes of an `indexer_logits` call with device metadata.
#[derive(Clone, Copy, Debug)]
pub struct IndexerShape {
    pub n_heads: usize,
    /// Rows of the page table (requests).
    pub n_requests: usize,
    /// Columns of the page table.
    pub max_pages: usize,
    /// Columns of a logits row (elements between consecutive rows).
    pub row_stride: usize,
}

/// `indexer_logits` over fp8 or bf16 keys: `q` bf16 `[n_rows, n_heads, head_dim]`,
/// `weights` f32 `[n_rows, n_heads]`, `cache` whole pages, `page_table` i32 `[n_requests,
/// max_pages]`, `rows` `[n_rows]` [`QueryRange`]s (12 bytes each; every range inside
/// `row_stride`, its request in the table and its positions mapped to pages of the cache:
/// the caller's contract), `out` f32 `[n_rows, row_stride]`. fp4 keys take
/// [`indexer_logits_fp4`] (their own kernel).
pub fn indexer_logits(
    layout: IndexKLayout,
    shape: IndexerShape,
    bufs: [DeviceBuf; 5],
    out: DeviceBuf,
) -> Result<IndexerLogitsParams> {
    if layout.dtype() == IndexKDtype::Fp4E2m1 {
        return Err(Error::invalid(
            "layout",
            "fp4_e2m1 index keys run the fp4 kernel: use indexer_logits_fp4",
        ));
    }
    let p = indexer_params(layout, shape, bufs, out)?;
    check_launch(&p)?;
    Ok(p)
}

/// `indexer_logits` over fp4 keys ([`IndexKDtype::Fp4E2m1`]), for the fp4 kernel: the
/// buffers and the caller's contract of [`indexer_logits`].
pub fn indexer_logits_fp4(
    layout: IndexKLayout,
    shape: IndexerShape,
    bufs: [DeviceBuf; 5],
    out: DeviceBuf,
) -> Result<IndexerLogitsFp4Params> {
    if layout.dtype() != IndexKDtype::Fp4E2m1 {
        return Err(Error::invalid(
            "layout",
            format!(
                "{} index keys run the fp8/bf16 kernel: use indexer_logits",
                layout.dtype().name()
            ),
        ));
    }
    let p = IndexerLogitsFp4Params(indexer_params(layout, shape, bufs, out)?);
    check_launch(&p)?;
    Ok(p)
}

/// The validated parameters of an `indexer_logits` launch (either kernel).
fn indexer_params(
    layout: IndexKLayout,
    shape: IndexerShape,
    [q, weights, cache, page_table, rows]: [DeviceBuf; 5],
    out: DeviceBuf,
) -> Result<IndexerLogitsParams> {
    let row_bytes = std::mem::size_of::<QueryRange>();
    let n = rows.bytes / row_bytes;
    check_buf("rows", rows, &[n, row_bytes])?;
    check_buf(
        "page_table",
        page_table,
        &[shape.n_requests, shape.max_pages, 4],
    )?;
    if n > 0 && shape.n_requests == 0 {
        return Err(Error::invalid(
            "page_table",
            "has no rows, and the call has query rows",
        ));
    }
    let table = placeholder(
        "page_table",
        checked_size("page_table", &[shape.n_requests, shape.max_pages])?,
        0i32,
    )?;
    let op = IndexerLogits {
        layout,
        n_heads: shape.n_heads,
        page_table: PageTable::new(&table, shape.max_pages.max(1))?,
        rows: placeholder("rows", n, QueryRange::default())?,
        row_stride: shape.row_stride,
    };
    op.validate(q.bytes, weights.bytes, cache.bytes, out.bytes)?;
    check_indexer(&op)?;
    kernel_params::indexer_logits(
        &op,
        Addrs {
            read: &[q.addr, weights.addr, cache.addr],
            write: &[out.addr],
            meta: &[page_table.addr, rows.addr],
        },
    )
}

/// Bytes of the two scratch buffers of a `topk` launch (`workspace`, contents
/// uninitialised; `counters`, zero-filled; either may be 0).
pub fn topk_scratch(n_rows: usize, row_stride: usize, k: usize) -> Result<(usize, usize)> {
    let u = |what, x| kernel_params::u32_of(what, x);
    let (w, c) = topk_workspace(u("rows", n_rows)?, u("row_stride", row_stride)?, u("k", k)?);
    Ok((to_usize(w)?, to_usize(c)?))
}

/// Bytes of the two scratch buffers of a `sparse_mla` launch (`workspace`, contents
/// uninitialised; `counters`, zero-filled; either may be 0).
pub fn sparse_mla_scratch(
    layout: KvLayout,
    n_tokens: usize,
    n_heads: usize,
    topk: usize,
) -> Result<(usize, usize)> {
    let u = |what, x| kernel_params::u32_of(what, x);
    let (w, c) = sparse_mla_workspace(
        u("n_tokens", n_tokens)?,
        u("n_heads", n_heads)?,
        u("topk", topk)?,
        u("nope_dim", layout.nope_dim())?,
    );
    Ok((to_usize(w)?, to_usize(c)?))
}

fn to_usize(x: u64) -> Result<usize> {
    usize::try_from(x).map_err(|_| Error::invalid("workspace", format!("{x} bytes")))
}

/// Where `topk` writes: positions, or slots through a device page table.
#[derive(Clone, Copy, Debug)]
pub enum TopkTarget {
    Positions,
    /// `page_table` i32 `[n_requests, max_pages]` (every position of every range mapped,
    /// slots fitting i32: the caller's contract).
    Slots {
        page_table: DeviceBuf,
        n_requests: usize,
        max_pages: usize,
        page_size: usize,
    },
}

/// `topk`: `logits` f32 `[n_rows, row_stride]`, `rows` `[n_rows]` [`QueryRange`]s (each
/// range inside `row_stride`, its request in the page table when slots are written: the
/// caller's contract), `out` i32 `[n_rows, k]`, `workspace` and `counters` of
/// [`topk_scratch`]'s sizes (`counters` zero-filled; the kernel leaves it zero);
/// `short_rows` as [`Topk::short_rows`].
pub fn topk(
    short_rows: ShortRows,
    k: usize,
    row_stride: usize,
    target: TopkTarget,
    [logits, rows]: [DeviceBuf; 2],
    [out, workspace, counters]: [DeviceBuf; 3],
) -> Result<TopkParams> {
    let row_bytes = std::mem::size_of::<QueryRange>();
    let n = rows.bytes / row_bytes;
    check_buf("rows", rows, &[n, row_bytes])?;
    let placeholder_rows = placeholder("rows", n, QueryRange::default())?;
    let table;
    let (output, table_addr) = match target {
        TopkTarget::Positions => (TopkOutput::Positions, 0),
        TopkTarget::Slots {
            page_table,
            n_requests,
            max_pages,
            page_size,
        } => {
            check_buf("page_table", page_table, &[n_requests, max_pages, 4])?;
            if n > 0 && n_requests == 0 {
                return Err(Error::invalid(
                    "page_table",
                    "has no rows, and the call has query rows",
                ));
            }
            table = placeholder(
                "page_table",
                checked_size("page_table", &[n_requests, max_pages])?,
                0i32,
            )?;
            (
                TopkOutput::Slots {
                    page_table: PageTable::new(&table, max_pages.max(1))?,
                    page_size,
                },
                page_table.addr,
            )
        }
    };
    let op = Topk {
        short_rows,
        k,
        row_stride,
        rows: &placeholder_rows,
        output,
    };
    op.validate(logits.bytes, out.bytes)?;
    let (ws, cs) = topk_scratch(n, row_stride, k)?;
    crate::ops::check_bytes("workspace", ws, workspace.bytes)?;
    crate::ops::check_bytes("counters", cs, counters.bytes)?;
    let p = kernel_params::topk(
        &op,
        Addrs {
            read: &[logits.addr],
            write: &[out.addr, workspace.addr, counters.addr],
            meta: &[rows.addr, table_addr],
        },
    )?;
    check_launch(&p)?;
    Ok(p)
}

/// `sparse_mla`: `q` bf16 `[n_tokens, n_heads, d_qk]`, `cache` whole pages, `indices` i32
/// `[n_tokens, topk]` (each `-1` or a slot of `cache`: the caller's contract), `out` bf16
/// `[n_tokens, n_heads, nope_dim]`, `lse` f32 `[n_tokens, n_heads]`, `workspace` and
/// `counters` of [`sparse_mla_scratch`]'s sizes (`counters` zero-filled).
pub fn sparse_mla(
    op: &SparseMla,
    [q, cache, indices]: [DeviceBuf; 3],
    [out, lse, workspace, counters]: [DeviceBuf; 4],
) -> Result<SparseMlaParams> {
    op.validate(q.bytes, cache.bytes, indices.bytes, out.bytes, lse.bytes)?;
    let (ws, cs) = sparse_mla_scratch(op.layout, op.n_tokens, op.n_heads, op.topk)?;
    crate::ops::check_bytes("workspace", ws, workspace.bytes)?;
    crate::ops::check_bytes("counters", cs, counters.bytes)?;
    let p = kernel_params::sparse_mla(
        op,
        Addrs {
            read: &[q.addr, cache.addr, indices.addr],
            write: &[out.addr, lse.addr, workspace.addr, counters.addr],
            meta: &[],
        },
    )?;
    check_launch(&p)?;
    Ok(p)
}

/// Bytes of the two scratch buffers of a `sparse_mla_v4` launch (`workspace`, contents
/// uninitialised; `counters`, zero-filled; either may be 0): `total_topk` is the sum of
/// the caches' top-k.
pub fn sparse_mla_v4_scratch(
    n_tokens: usize,
    n_heads: usize,
    total_topk: usize,
) -> Result<(usize, usize)> {
    let u = |what, x| kernel_params::u32_of(what, x);
    let (w, c) = sparse_mla_v4_workspace(
        u("n_tokens", n_tokens)?,
        u("n_heads", n_heads)?,
        u("topk", total_topk)?,
    );
    Ok((to_usize(w)?, to_usize(c)?))
}

/// One cache of a `sparse_mla_v4` call with device metadata: its layout and top-k.
#[derive(Clone, Copy, Debug)]
pub struct V4CacheShape {
    pub layout: KvLayout,
    pub topk: usize,
}

/// The shapes of a `sparse_mla_v4` call with device metadata.
#[derive(Clone, Copy, Debug)]
pub struct V4Shape {
    pub n_tokens: usize,
    pub n_heads: usize,
    pub softmax_scale: f32,
    pub main: V4CacheShape,
    pub extra: Option<V4CacheShape>,
}

/// One cache's device buffers: whole pages, indices i32 `[n_tokens, topk]`, optionally
/// the lengths u32 `[n_tokens]`.
#[derive(Clone, Copy, Debug)]
pub struct V4CacheBufs {
    pub cache: DeviceBuf,
    pub indices: DeviceBuf,
    pub lengths: Option<DeviceBuf>,
}

/// `sparse_mla_v4` ([`SparseMlaV4`]): `q` bf16 `[n_tokens, n_heads, 512]`, each cache of
/// `shape` with its [`V4CacheBufs`] (every length at most the cache's top-k, every used
/// index `-1` or a slot of its cache: the caller's contract), `sink` f32 `[n_heads]` when
/// given, `out` bf16 `[n_tokens, n_heads, 512]`, `lse` f32 `[n_tokens, n_heads]`,
/// `workspace` and `counters` of [`sparse_mla_v4_scratch`]'s sizes (`counters`
/// zero-filled).
pub fn sparse_mla_v4(
    shape: V4Shape,
    q: DeviceBuf,
    main: V4CacheBufs,
    extra: Option<V4CacheBufs>,
    sink: Option<DeviceBuf>,
    [out, lse, workspace, counters]: [DeviceBuf; 4],
) -> Result<SparseMlaV4Params> {
    let n = shape.n_tokens;
    let lens = |what: &'static str, b: Option<DeviceBuf>| -> Result<Option<Vec<u32>>> {
        b.map(|b| {
            check_buf(what, b, &[n, 4])?;
            placeholder(what, n, 0u32)
        })
        .transpose()
    };
    let main_lens = lens("lengths", main.lengths)?;
    let extra_lens = lens("extra lengths", extra.and_then(|e| e.lengths))?;
    let sink_vals = sink
        .map(|b| {
            check_buf("attn_sink", b, &[shape.n_heads, 4])?;
            placeholder("attn_sink", shape.n_heads, 0f32)
        })
        .transpose()?;
    let op = SparseMlaV4 {
        n_tokens: n,
        n_heads: shape.n_heads,
        softmax_scale: shape.softmax_scale,
        main: V4Cache {
            layout: shape.main.layout,
            topk: shape.main.topk,
            lengths: main_lens.as_deref(),
        },
        extra: shape.extra.map(|c| V4Cache {
            layout: c.layout,
            topk: c.topk,
            lengths: extra_lens.as_deref(),
        }),
        attn_sink: sink_vals.as_deref(),
    };
    if op.extra.is_none() && extra.is_some_and(|e| e.lengths.is_some()) {
        return Err(Error::invalid(
            "extra lengths",
            "given to a call without an extra cache",
        ));
    }
    op.validate(
        q.bytes,
        [main.cache.bytes, main.indices.bytes],
        extra.map(|e| [e.cache.bytes, e.indices.bytes]),
        out.bytes,
        lse.bytes,
    )?;
    let total = op.caches().map(|c| c.topk).sum();
    let (ws, cs) = sparse_mla_v4_scratch(n, shape.n_heads, total)?;
    crate::ops::check_bytes("workspace", ws, workspace.bytes)?;
    crate::ops::check_bytes("counters", cs, counters.bytes)?;
    // Metadata in the order of `V4Slots`: the present lengths, then the sink.
    let given = [
        main.lengths.map(|b| b.addr),
        extra.and_then(|e| e.lengths).map(|b| b.addr),
        sink.map(|b| b.addr),
    ];
    let meta: Vec<u64> = given.iter().flatten().copied().collect();
    let pos = |i: usize| given[i].map(|_| given[..i].iter().filter(|g| g.is_some()).count());
    let at = kernel_params::V4Slots {
        main_lengths: pos(0),
        extra_lengths: pos(1),
        sink: pos(2),
    };
    let mut read = vec![q.addr, main.cache.addr, main.indices.addr];
    if let Some(e) = extra {
        read.extend([e.cache.addr, e.indices.addr]);
    }
    let p = kernel_params::sparse_mla_v4(
        &op,
        Addrs {
            read: &read,
            write: &[out.addr, lse.addr, workspace.addr, counters.addr],
            meta: &meta,
        },
        at,
    )?;
    check_launch(&p)?;
    Ok(p)
}

/// `copy_pages` between two contiguous pools of `layout`: `src_ids` and `dst_ids` i32
/// `[n]` (every id inside its pool, destinations unique: the caller's contract).
pub fn copy_pages(
    layout: PageLayout,
    [src, dst]: [DeviceBuf; 2],
    [src_ids, dst_ids]: [DeviceBuf; 2],
) -> Result<CopyPagesParams> {
    let n = src_ids.bytes / 4;
    check_buf("src_ids", src_ids, &[n, 4])?;
    check_buf("dst_ids", dst_ids, &[n, 4])?;
    let page = layout.bytes_per_page();
    let region = |what, bytes: usize| -> Result<PagedRegion> {
        if bytes % page != 0 {
            return Err(Error::BufferSize {
                what,
                expected: bytes.div_ceil(page) * page,
                actual: bytes,
            });
        }
        Ok(PagedRegion::contiguous(layout, bytes / page))
    };
    let (sr, dr) = (region("src", src.bytes)?, region("dst", dst.bytes)?);
    // Placeholder ids: 0 for the sources, distinct destinations (the validation's
    // uniqueness check), only when the pools are not empty.
    if n > 0 && (sr.num_pages == 0 || dr.num_pages < n) {
        return Err(Error::invalid(
            "dst_ids",
            format!(
                "{n} pages copied between pools of {} and {} pages",
                sr.num_pages, dr.num_pages
            ),
        ));
    }
    let sids = placeholder("src_ids", n, 0i32)?;
    let dids: Vec<i32> = (0..n)
        .map(|i| i32::try_from(i).map_err(|_| Error::invalid("dst_ids", "more than 2^31 pages")))
        .collect::<Result<_>>()?;
    let op = CopyPages {
        src: sr,
        dst: dr,
        src_ids: &sids,
        dst_ids: &dids,
    };
    op.validate(src.bytes, dst.bytes)?;
    kernel_params::copy_pages(
        &op,
        Addrs {
            read: &[src.addr],
            write: &[dst.addr],
            meta: &[src_ids.addr, dst_ids.addr],
        },
    )
}

/// `page_checksums` of a contiguous pool of `layout`: `ids` i32 `[n]` (each inside the
/// pool: the caller's contract), `out` u64 `[n]`.
pub fn page_checksums(
    layout: PageLayout,
    pool: DeviceBuf,
    ids: DeviceBuf,
    out: DeviceBuf,
) -> Result<PageChecksumsParams> {
    let n = ids.bytes / 4;
    check_buf("ids", ids, &[n, 4])?;
    let page = layout.bytes_per_page();
    if pool.bytes % page != 0 {
        return Err(Error::BufferSize {
            what: "pool",
            expected: pool.bytes.div_ceil(page) * page,
            actual: pool.bytes,
        });
    }
    let region = PagedRegion::contiguous(layout, pool.bytes / page);
    if n > 0 && region.num_pages == 0 {
        return Err(Error::invalid("ids", "the pool holds no page"));
    }
    let dummy = placeholder("ids", n, 0i32)?;
    let op = PageChecksums {
        region,
        ids: &dummy,
    };
    op.validate(pool.bytes, out.bytes)?;
    kernel_params::page_checksums(
        &op,
        Addrs {
            read: &[pool.addr],
            write: &[out.addr],
            meta: &[ids.addr],
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{IndexKDtype, KvDtype};

    /// Sizes are checked in bytes against the descriptors; the parameters carry the
    /// addresses given and the layout's sizes.
    #[test]
    fn builders_check_sizes_and_fill_addresses() {
        let l = IndexKLayout::new(IndexKDtype::FP8, 128, 64).unwrap();
        let b = |addr, bytes| DeviceBuf::new(addr, bytes);
        let p = index_k_store(l, b(0x100, 3 * 256), b(0x200, 24), b(0x300, 2 * 8448)).unwrap();
        assert_eq!((p.n_tokens, p.page_bytes), (3, 8448));
        assert_eq!(p.cache.addr(), 0x300);
        assert!(index_k_store(l, b(0x100, 2 * 256), b(0x200, 24), b(0x300, 8448)).is_err());
        assert!(index_k_store(l, b(0x100, 3 * 256), b(0x200, 24), b(0x300, 8447)).is_err());

        let shape = IndexerShape {
            n_heads: 4,
            n_requests: 2,
            max_pages: 3,
            row_stride: 100,
        };
        let bufs = [
            b(1, 5 * 4 * 128 * 2),
            b(2, 5 * 4 * 4),
            b(3, 4 * 8448),
            b(4, 2 * 3 * 4),
            b(5, 5 * 12),
        ];
        let p = indexer_logits(l, shape, bufs, b(6, 5 * 100 * 4)).unwrap();
        assert_eq!((p.n_rows, p.max_pages, p.row_stride), (5, 3, 100));
        assert!(indexer_logits(l, shape, bufs, b(6, 5 * 99 * 4)).is_err());

        let (ws, cs) = topk_scratch(5, 100, 8).unwrap();
        let p = topk(
            ShortRows::SelectValid,
            8,
            100,
            TopkTarget::Positions,
            [b(1, 5 * 400), b(2, 60)],
            [b(3, 160), b(4, ws), b(5, cs)],
        )
        .unwrap();
        assert_eq!((p.n_rows, p.k), (5, 8));
        assert!(topk(
            ShortRows::TakeAll,
            8,
            100,
            TopkTarget::Positions,
            [b(1, 5 * 400), b(2, 60)],
            [b(3, 156), b(4, ws), b(5, cs)]
        )
        .is_err());

        let kv = KvLayout::new(KvDtype::Fp8DsMla, 512, 64, 64).unwrap();
        let op = SparseMla {
            layout: kv,
            n_tokens: 2,
            n_heads: 16,
            topk: 2048,
            softmax_scale: 0.1,
        };
        let (ws, cs) = sparse_mla_scratch(kv, 2, 16, 2048).unwrap();
        assert!(ws > 0 && cs > 0);
        let ins = [b(1, 2 * 16 * 576 * 2), b(2, 41984), b(3, 2 * 2048 * 4)];
        let outs = [b(4, 2 * 16 * 512 * 2), b(5, 2 * 16 * 4), b(6, ws), b(7, cs)];
        assert!(sparse_mla(&op, ins, outs).is_ok());
        let outs = [
            b(4, 2 * 16 * 512 * 2),
            b(5, 2 * 16 * 4),
            b(6, ws + 1),
            b(7, cs),
        ];
        assert!(sparse_mla(&op, ins, outs).is_err());

        // fp4 keys: their own kernel's parameters, and the fp8/bf16 builder refuses them.
        let l4 = IndexKLayout::new(IndexKDtype::Fp4E2m1, 128, 64).unwrap();
        let bufs4 = [
            b(1, 5 * 4 * 128 * 2),
            b(2, 5 * 4 * 4),
            b(3, 4 * 64 * 68),
            b(4, 2 * 3 * 4),
            b(5, 5 * 12),
        ];
        let p = indexer_logits_fp4(l4, shape, bufs4, b(6, 5 * 100 * 4)).unwrap();
        assert_eq!((p.0.n_rows, p.0.row_stride), (5, 100));
        assert!(indexer_logits(l4, shape, bufs4, b(6, 5 * 100 * 4)).is_err());
        assert!(indexer_logits_fp4(l, shape, bufs, b(6, 5 * 100 * 4)).is_err());

        // sparse_mla_v4: main model1_fp8 with lengths, extra bf16_512, a sink.
        let (m, e) = (
            KvLayout::model1_fp8(64).unwrap(),
            KvLayout::bf16_512(2).unwrap(),
        );
        let shape = V4Shape {
            n_tokens: 3,
            n_heads: 4,
            softmax_scale: 0.05,
            main: V4CacheShape {
                layout: m,
                topk: 128,
            },
            extra: Some(V4CacheShape { layout: e, topk: 8 }),
        };
        let (ws, cs) = sparse_mla_v4_scratch(3, 4, 136).unwrap();
        let main = V4CacheBufs {
            cache: b(2, 2 * m.bytes_per_page()),
            indices: b(3, 3 * 128 * 4),
            lengths: Some(b(4, 3 * 4)),
        };
        let extra = V4CacheBufs {
            cache: b(5, 7 * e.bytes_per_page()),
            indices: b(6, 3 * 8 * 4),
            lengths: None,
        };
        let outs = [b(7, 3 * 4 * 512 * 2), b(8, 3 * 4 * 4), b(9, ws), b(10, cs)];
        let q = b(1, 3 * 4 * 512 * 2);
        let p = sparse_mla_v4(shape, q, main, Some(extra), Some(b(11, 16)), outs).unwrap();
        assert_eq!(
            (p.n_tokens, p.n_heads, p.main.topk, p.extra.topk),
            (3, 4, 128, 8)
        );
        assert_eq!(p.main.lengths.addr(), 4);
        assert_eq!(p.sink.addr(), 11);
        assert!(p.extra.lengths.addr() == 0);
        // A short sink, a missing extra, lengths of the wrong size: refused.
        assert!(sparse_mla_v4(shape, q, main, Some(extra), Some(b(11, 12)), outs).is_err());
        assert!(sparse_mla_v4(shape, q, main, None, None, outs).is_err());
        let bad = V4CacheBufs {
            lengths: Some(b(4, 8)),
            ..main
        };
        assert!(sparse_mla_v4(shape, q, bad, Some(extra), None, outs).is_err());

        let pl: PageLayout = l.into();
        let p = copy_pages(pl, [b(1, 4 * 8448), b(2, 2 * 8448)], [b(3, 8), b(4, 8)]).unwrap();
        assert_eq!((p.n_pages, p.bytes), (2, 8448));
        assert!(copy_pages(pl, [b(1, 4 * 8448), b(2, 8448)], [b(3, 8), b(4, 8)]).is_err());
        let p = page_checksums(pl, b(1, 3 * 8448), b(2, 12), b(3, 24)).unwrap();
        assert_eq!(p.n_pages, 3);
        assert!(page_checksums(pl, b(1, 3 * 8448), b(2, 12), b(3, 16)).is_err());
    }
}
