//! The ops of every backend that runs the GPU kernels of `sparsekit-kernels` (`emu` here,
//! `cuda` in the root package), written once.
//!
//! Such a backend implements [`Backend`]'s buffer and stream methods and [`KernelDevice`]:
//! where per-call metadata goes (slots, page ids, page tables, query ranges), the
//! addresses of its buffers and the typed launch of one kernel; its op methods are the
//! functions below, pasted into its `impl Backend` by [`kernel_backend_ops!`](crate::kernel_backend_ops). Each op
//! validates the descriptor against the buffers (a rejected call writes nothing), checks
//! the shapes the kernels support, stages the metadata, fills the kernel's parameter
//! struct from the layout descriptor (`kernel_params`, the one place layouts become
//! kernel sizes) and launches it with its own geometry. So the emulator runs exactly the
//! launches the GPU runs.
//!
//! Every launch names its buffers (inputs, outputs, staged metadata) and hands them to
//! [`KernelDevice::enqueue`] as [`Span`]s: the emulator checks every global access of the
//! kernel against them (bounds, alignment, writes to inputs, reads of outputs not yet
//! written), the GPU ignores them.

pub mod dense;
pub mod raw;

pub use sparsekit_kernels::emu::BufferAccess;
use sparsekit_kernels::kernels::{
    sparse_mla_v4_workspace, sparse_mla_workspace, topk_workspace, INDEXER_LOGITS_MAX_HEAD_DIM,
};
use sparsekit_kernels::launch::{KernelParams, MAX_DYN_SMEM};
use sparsekit_kernels::params::{IndexerLogitsFp4Params, QueryRange};

use crate::backend::{Backend, KvInput};
use crate::error::{Error, Result};
use crate::kernel_params;
use crate::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, SparseMla, SparseMlaV4, Topk,
    TopkOutput,
};

/// The kernel-visible addresses a launch's parameters are built from: the buffers read
/// and written (in the order given) and the staged metadata arrays.
#[derive(Clone, Copy, Debug)]
pub struct Addrs<'a> {
    pub read: &'a [u64],
    pub write: &'a [u64],
    pub meta: &'a [u64],
}

/// One buffer of a launch as the kernel sees it: its name (in reports), kernel-visible
/// address, length in bytes and how the kernel uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub name: &'static str,
    pub addr: u64,
    pub bytes: usize,
    pub access: BufferAccess,
}

/// What a backend that runs the kernels of `sparsekit-kernels` provides; its ops are built
/// on it (see the [module docs](self)).
///
/// # Safety
/// The safe ops of this module launch kernels through these primitives, so an
/// implementation must keep their promises: [`Self::stage`] copies the bytes where the
/// kernels can read them and [`Self::staged_addr`] is their kernel-visible address, valid
/// while the staged value lives (and, for queued work, until the work reading it has
/// completed); [`Self::with_addrs`] passes the kernel-visible addresses of exactly the
/// buffers given, each covering the buffer's [`Backend::buffer_len`] bytes, and orders the
/// work enqueued inside `f` after earlier writes to them and before later uses (their frees
/// included); [`Self::enqueue`] runs the kernel of `P` with `params.launch()`'s geometry.
pub unsafe trait KernelDevice: Backend {
    /// A launch's scratch buffer of `bytes` bytes, which its kernel writes before it reads
    /// (a `BufferAccess::Write` span: the emulator reports any read of a byte not yet
    /// written). Its initial contents are unspecified: the default zeroes it like
    /// [`Backend::alloc`]; a GPU backend skips the fill (tens of MB for a split
    /// `sparse_mla` at batch 64, a memset as long as a fifth of the kernel).
    fn alloc_scratch(&self, bytes: usize) -> Result<Self::Buffer> {
        self.alloc(bytes)
    }

    /// Per-call metadata placed where the kernels can read it; kept alive until the launch
    /// that reads it has completed.
    type Staged<'a>;

    /// Copies `bytes` (host metadata of one call) where the kernels can read them.
    fn stage<'a>(&self, bytes: &'a [u8]) -> Result<Self::Staged<'a>>;
    /// The kernel-visible address of staged metadata.
    fn staged_addr(&self, staged: &Self::Staged<'_>) -> u64;

    /// Calls `f` with the kernel-visible addresses of `reads` and `writes` (in order),
    /// valid for work enqueued before `f` returns; the backend orders that work after
    /// earlier writes to those buffers (on any stream), and later work after it.
    fn with_addrs<R>(
        &self,
        reads: &[&Self::Buffer],
        writes: &mut [&mut Self::Buffer],
        f: impl FnOnce(&[u64], &[u64]) -> R,
    ) -> Result<R>;

    /// Enqueues (or runs) the kernel of `params` with its geometry (`params.launch()`,
    /// already checked against the GPU limits). `spans` are every buffer the parameters
    /// address (the emulator checks the kernel's accesses against them).
    ///
    /// # Safety
    /// The kernel's contract ([`KernelParams::run`]): every address in `params` comes from
    /// [`Self::with_addrs`] (inside its call) or [`Self::staged_addr`] of metadata alive
    /// until the launch completes, and describes buffers validated for this launch;
    /// `spans` describe exactly those buffers.
    unsafe fn enqueue<P: KernelParams>(&self, params: P, spans: &[Span]) -> Result<()>;

    /// Stages `meta`, then builds the parameters from the addresses of `reads`, `writes`
    /// and the staged metadata and launches their kernel (`P` names it: a kernel can only
    /// be launched with its own parameter struct). Every buffer comes with its name;
    /// metadata and `reads` are read-only for the kernel, `writes` say how the kernel uses
    /// them ([`BufferAccess::Write`]: written before read, the outputs;
    /// [`BufferAccess::ReadWrite`]: scratch it updates in place). A `build` error (a size
    /// that does not fit the kernel's parameters) launches nothing.
    ///
    /// # Safety
    /// `build` fills the parameters from the given addresses and from descriptors
    /// validated against these buffers and metadata, so that the kernel's contract holds.
    unsafe fn launch<P: KernelParams>(
        &self,
        meta: &[(&'static str, &[u8])],
        reads: &[(&'static str, &Self::Buffer)],
        writes: &mut [(&'static str, BufferAccess, &mut Self::Buffer)],
        build: impl FnOnce(Addrs<'_>) -> Result<P>,
    ) -> Result<()> {
        let staged = meta
            .iter()
            .map(|(_, m)| self.stage(m))
            .collect::<Result<Vec<_>>>()?;
        let meta_addrs: Vec<u64> = staged.iter().map(|s| self.staged_addr(s)).collect();
        let mut spans: Vec<Span> = meta
            .iter()
            .zip(&meta_addrs)
            .map(|(&(name, m), &addr)| Span {
                name,
                addr,
                bytes: m.len(),
                access: BufferAccess::Read,
            })
            .collect();
        let read_named: Vec<(&'static str, usize)> = reads
            .iter()
            .map(|&(n, b)| (n, self.buffer_len(b)))
            .collect();
        let write_named: Vec<(&'static str, usize, BufferAccess)> = writes
            .iter()
            .map(|(n, a, b)| (*n, self.buffer_len(b), *a))
            .collect();
        let read_bufs: Vec<&Self::Buffer> = reads.iter().map(|&(_, b)| b).collect();
        let mut write_bufs: Vec<&mut Self::Buffer> =
            writes.iter_mut().map(|(_, _, b)| &mut **b).collect();
        self.with_addrs(&read_bufs, &mut write_bufs, |read, write| {
            let params = build(Addrs {
                read,
                write,
                meta: &meta_addrs,
            })?;
            check_launch(&params)?;
            spans.extend(
                read_named
                    .iter()
                    .zip(read)
                    .map(|(&(name, bytes), &addr)| Span {
                        name,
                        addr,
                        bytes,
                        access: BufferAccess::Read,
                    }),
            );
            spans.extend(
                write_named
                    .iter()
                    .zip(write)
                    .map(|(&(name, bytes, access), &addr)| Span {
                        name,
                        addr,
                        bytes,
                        access,
                    }),
            );
            // SAFETY: the caller's contract (see above); the staged metadata is dropped
            // only after the launch is enqueued; `spans` are the buffers of the addresses.
            unsafe { self.enqueue(params, &spans) }
        })?
    }
}

/// Checks that a kernel's launch fits the GPU limits (dynamic shared memory), so a shape
/// the kernels cannot run is a clear error on every GPU backend, never a launch failure.
fn check_launch<P: KernelParams>(params: &P) -> Result<()> {
    let l = params.launch();
    if l.smem_bytes > MAX_DYN_SMEM {
        return Err(Error::InvalidArgument {
            what: P::ENTRY,
            detail: format!(
                "this shape needs {} bytes of shared memory per block, more than the {MAX_DYN_SMEM} the GPU kernels use",
                l.smem_bytes
            ),
        });
    }
    Ok(())
}

/// Checks the shapes the GPU indexer supports (`head_dim` up to its maximum).
fn check_indexer(op: &IndexerLogits<'_>) -> Result<()> {
    let max = INDEXER_LOGITS_MAX_HEAD_DIM as usize;
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

/// `index_k_store` on a [`KernelDevice`].
pub fn index_k_store<D: KernelDevice>(
    d: &D,
    op: &IndexKStore<'_>,
    keys: &D::Buffer,
    cache: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(keys), d.buffer_len(cache))?;
    if op.slots.is_empty() {
        return Ok(());
    }
    // SAFETY: the descriptor was validated against both buffers (slots unique and inside
    // the cache, keys of the right size).
    unsafe {
        d.launch(
            &[("slots", bytemuck::cast_slice(op.slots))],
            &[("keys", keys)],
            &mut [("cache", BufferAccess::Write, cache)],
            |a| kernel_params::index_k_store(op, a),
        )
    }
}

/// `kv_store` on a [`KernelDevice`].
pub fn kv_store<D: KernelDevice>(
    d: &D,
    op: &KvStore<'_>,
    kv: &D::Buffer,
    cache: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(kv), d.buffer_len(cache))?;
    if op.slots.is_empty() {
        return Ok(());
    }
    // SAFETY: as for `index_k_store`.
    unsafe {
        d.launch(
            &[("slots", bytemuck::cast_slice(op.slots))],
            &[("kv", kv)],
            &mut [("cache", BufferAccess::Write, cache)],
            |a| kernel_params::kv_store(op, a),
        )
    }
}

/// `indexer_logits` on a [`KernelDevice`].
pub fn indexer_logits<D: KernelDevice>(
    d: &D,
    op: &IndexerLogits<'_>,
    q: &D::Buffer,
    weights: &D::Buffer,
    cache: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    let lens = [q, weights, cache].map(|b| d.buffer_len(b));
    op.validate(lens[0], lens[1], lens[2], d.buffer_len(out))?;
    check_indexer(op)?;
    if op.rows.is_empty() || op.row_stride == 0 {
        return Ok(());
    }
    let meta = [
        ("page_table", bytemuck::cast_slice(op.page_table.as_slice())),
        ("rows", QueryRange::as_bytes(&op.rows)),
    ];
    let reads = [("q", q), ("weights", weights), ("cache", cache)];
    let mut writes = [("logits", BufferAccess::Write, out)];
    // SAFETY: the descriptor was validated against the buffers (every position of every
    // row mapped to a page of the cache, ranges inside the row stride); fp4 keys go to
    // the fp4 kernel, the others to the fp8/bf16 one.
    unsafe {
        if op.layout.dtype() == crate::layout::IndexKDtype::Fp4E2m1 {
            d.launch(&meta, &reads, &mut writes, |a| {
                kernel_params::indexer_logits(op, a).map(IndexerLogitsFp4Params)
            })
        } else {
            d.launch(&meta, &reads, &mut writes, |a| {
                kernel_params::indexer_logits(op, a)
            })
        }
    }
}

/// `topk` on a [`KernelDevice`].
pub fn topk<D: KernelDevice>(
    d: &D,
    op: &Topk<'_>,
    logits: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(logits), d.buffer_len(out))?;
    if op.rows.is_empty() {
        return Ok(());
    }
    // Scratch of split rows (candidates and zeroed per-row counters; empty when no row
    // can be split).
    let (ws_bytes, counter_bytes) =
        topk_workspace(op.rows.len() as u32, op.row_stride as u32, op.k as u32);
    let mut workspace = d.alloc_scratch(ws_bytes as usize)?;
    let mut counters = d.alloc(counter_bytes as usize)?;
    let mut meta = vec![("rows", QueryRange::as_bytes(op.rows))];
    if let TopkOutput::Slots { page_table, .. } = op.output {
        meta.push(("page_table", bytemuck::cast_slice(page_table.as_slice())));
    }
    // SAFETY: as for `indexer_logits` (the page table, when slots are written, maps every
    // position of every row).
    unsafe {
        d.launch(
            &meta,
            &[("logits", logits)],
            &mut [
                ("topk", BufferAccess::Write, out),
                ("workspace", BufferAccess::Write, &mut workspace),
                ("counters", BufferAccess::ReadWrite, &mut counters),
            ],
            |a| kernel_params::topk(op, a),
        )
    }
}

/// `sparse_mla` on a [`KernelDevice`]. The indices are backend data: they are read back
/// and checked against the cache before the launch (an out-of-range slot is an error,
/// never a wild read).
pub fn sparse_mla<D: KernelDevice>(
    d: &D,
    op: &SparseMla,
    inputs: [&D::Buffer; 3],
    out: &mut D::Buffer,
    lse: &mut D::Buffer,
) -> Result<()> {
    let [q, cache, indices] = inputs;
    let lens = inputs.map(|b| d.buffer_len(b));
    let pages = op.validate(
        lens[0],
        lens[1],
        lens[2],
        d.buffer_len(out),
        d.buffer_len(lse),
    )?;
    let idx: Vec<i32> = bytemuck::pod_collect_to_vec(&d.download(indices)?);
    op.check_indices(&idx, pages)?;
    if op.n_tokens == 0 {
        return Ok(());
    }
    // Scratch of the split top-k (partial results and zeroed per-(token, head group)
    // counters; empty when the top-k fits one split).
    let (ws_bytes, counter_bytes) = sparse_mla_workspace(
        op.n_tokens as u32,
        op.n_heads as u32,
        op.topk as u32,
        op.layout.nope_dim() as u32,
    );
    let mut workspace = d.alloc_scratch(ws_bytes as usize)?;
    let mut counters = d.alloc(counter_bytes as usize)?;
    // SAFETY: the descriptor was validated against the buffers and every index is `-1`
    // or a slot of the cache.
    unsafe {
        d.launch(
            &[],
            &[("q", q), ("cache", cache), ("indices", indices)],
            &mut [
                ("out", BufferAccess::Write, out),
                ("lse", BufferAccess::Write, lse),
                ("workspace", BufferAccess::Write, &mut workspace),
                ("counters", BufferAccess::ReadWrite, &mut counters),
            ],
            |a| kernel_params::sparse_mla(op, a),
        )
    }
}

/// `sparse_mla_v4` on a [`KernelDevice`]. The used indices of each cache are read back
/// and checked against it before the launch (an out-of-range slot is an error, never a
/// wild read).
pub fn sparse_mla_v4<D: KernelDevice>(
    d: &D,
    op: &SparseMlaV4<'_>,
    q: &D::Buffer,
    main: KvInput<'_, D::Buffer>,
    extra: Option<KvInput<'_, D::Buffer>>,
    out: &mut D::Buffer,
    lse: &mut D::Buffer,
) -> Result<()> {
    let sizes = |k: KvInput<'_, D::Buffer>| [d.buffer_len(k.cache), d.buffer_len(k.indices)];
    let pages = op.validate(
        d.buffer_len(q),
        sizes(main),
        extra.map(sizes),
        d.buffer_len(out),
        d.buffer_len(lse),
    )?;
    let idx: Vec<i32> = bytemuck::pod_collect_to_vec(&d.download(main.indices)?);
    op.check_indices("main indices", &op.main, &idx, pages.main)?;
    if let (Some(c), Some(k)) = (&op.extra, extra) {
        let idx: Vec<i32> = bytemuck::pod_collect_to_vec(&d.download(k.indices)?);
        op.check_indices("extra indices", c, &idx, pages.extra)?;
    }
    if op.n_tokens == 0 {
        return Ok(());
    }
    let total: usize = op.caches().map(|c| c.topk).sum();
    let (ws_bytes, counter_bytes) =
        sparse_mla_v4_workspace(op.n_tokens as u32, op.n_heads as u32, total as u32);
    let mut workspace = d.alloc_scratch(ws_bytes as usize)?;
    let mut counters = d.alloc(counter_bytes as usize)?;
    let given: [(&'static str, Option<&[u8]>); 3] = [
        ("main lengths", op.main.lengths.map(bytemuck::cast_slice)),
        (
            "extra lengths",
            op.extra.and_then(|c| c.lengths).map(bytemuck::cast_slice),
        ),
        ("attn_sink", op.attn_sink.map(bytemuck::cast_slice)),
    ];
    let meta: Vec<(&'static str, &[u8])> = given
        .iter()
        .filter_map(|&(n, b)| b.map(|b| (n, b)))
        .collect();
    // The index of each present entry in `meta`.
    let pos = |i: usize| {
        given[i]
            .1
            .map(|_| given[..i].iter().filter(|g| g.1.is_some()).count())
    };
    let (main_lengths, extra_lengths, sink) = (pos(0), pos(1), pos(2));
    let at = kernel_params::V4Slots {
        main_lengths,
        extra_lengths,
        sink,
    };
    let mut reads = vec![
        ("q", q),
        ("main cache", main.cache),
        ("main indices", main.indices),
    ];
    if let (Some(_), Some(k)) = (&op.extra, extra) {
        reads.push(("extra cache", k.cache));
        reads.push(("extra indices", k.indices));
    }
    // SAFETY: the descriptor was validated against the buffers and every used index is
    // `-1` or a slot of its cache; unused entries are never read by the kernel.
    unsafe {
        d.launch(
            &meta,
            &reads,
            &mut [
                ("out", BufferAccess::Write, out),
                ("lse", BufferAccess::Write, lse),
                ("workspace", BufferAccess::Write, &mut workspace),
                ("counters", BufferAccess::ReadWrite, &mut counters),
            ],
            |a| kernel_params::sparse_mla_v4(op, a, at),
        )
    }
}

/// `copy_pages` on a [`KernelDevice`].
pub fn copy_pages<D: KernelDevice>(
    d: &D,
    op: &CopyPages<'_>,
    src: &D::Buffer,
    dst: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(src), d.buffer_len(dst))?;
    if op.src_ids.is_empty() {
        return Ok(());
    }
    let ids = [
        ("src_ids", bytemuck::cast_slice(op.src_ids)),
        ("dst_ids", bytemuck::cast_slice(op.dst_ids)),
    ];
    // SAFETY: ids validated against both regions, destination pages unique; `src` and
    // `dst` are distinct buffers (one shared and one exclusive borrow).
    unsafe {
        d.launch(
            &ids,
            &[("src", src)],
            &mut [("dst", BufferAccess::Write, dst)],
            |a| kernel_params::copy_pages(op, a),
        )
    }
}

/// `page_checksums` on a [`KernelDevice`].
pub fn page_checksums<D: KernelDevice>(
    d: &D,
    op: &PageChecksums<'_>,
    pool: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(pool), d.buffer_len(out))?;
    if op.ids.is_empty() {
        return Ok(());
    }
    // SAFETY: ids validated against the region; `out` holds one u64 per id.
    unsafe {
        d.launch(
            &[("ids", bytemuck::cast_slice(op.ids))],
            &[("pool", pool)],
            &mut [("checksums", BufferAccess::Write, out)],
            |a| kernel_params::page_checksums(op, a),
        )
    }
}

/// The op methods of a `Backend` that implements [`KernelDevice`]: expands inside its
/// `impl Backend` (next to the buffer and stream methods) into the seven ops of
/// [`launcher`](crate::launcher).
#[macro_export]
macro_rules! kernel_backend_ops {
    () => {
        fn index_k_store(
            &self,
            op: &$crate::ops::IndexKStore<'_>,
            keys: &Self::Buffer,
            cache: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::index_k_store(self, op, keys, cache)
        }
        fn kv_store(
            &self,
            op: &$crate::ops::KvStore<'_>,
            kv: &Self::Buffer,
            cache: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::kv_store(self, op, kv, cache)
        }
        fn indexer_logits(
            &self,
            op: &$crate::ops::IndexerLogits<'_>,
            q: &Self::Buffer,
            weights: &Self::Buffer,
            cache: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::indexer_logits(self, op, q, weights, cache, out)
        }
        fn topk(
            &self,
            op: &$crate::ops::Topk<'_>,
            logits: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::topk(self, op, logits, out)
        }
        fn sparse_mla(
            &self,
            op: &$crate::ops::SparseMla,
            q: &Self::Buffer,
            cache: &Self::Buffer,
            indices: &Self::Buffer,
            out: &mut Self::Buffer,
            lse: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::sparse_mla(self, op, [q, cache, indices], out, lse)
        }
        fn sparse_mla_v4(
            &self,
            op: &$crate::ops::SparseMlaV4<'_>,
            q: &Self::Buffer,
            main: $crate::KvInput<'_, Self::Buffer>,
            extra: Option<$crate::KvInput<'_, Self::Buffer>>,
            out: &mut Self::Buffer,
            lse: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::sparse_mla_v4(self, op, q, main, extra, out, lse)
        }
        fn copy_pages(
            &self,
            op: &$crate::ops::CopyPages<'_>,
            src: &Self::Buffer,
            dst: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::copy_pages(self, op, src, dst)
        }
        fn page_checksums(
            &self,
            op: &$crate::ops::PageChecksums<'_>,
            pool: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::page_checksums(self, op, pool, out)
        }
    };
}
