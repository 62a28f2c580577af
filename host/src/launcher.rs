//! The ops of every backend that runs the GPU kernels of `sparsekit-kernels` (`emu` here,
//! `cuda` in the root package), written once.
//!
//! Such a backend implements [`KernelDevice`]: its buffers, where per-call metadata goes
//! (slots, page ids, page tables, query ranges), the addresses of its buffers and the typed
//! launch of one kernel. Every [`Backend`] op is then the same on all of them (blanket
//! implementation below): validate the descriptor against the buffers (a rejected call
//! writes nothing), check the shapes the kernels support, stage the metadata, fill the
//! kernel's parameter struct from the layout descriptor ([`crate::kernel_params`]) and
//! launch it with its own geometry. So the emulator runs exactly the launches the GPU
//! runs.

use std::fmt::Debug;

use sparsekit_kernels::kernels::INDEXER_MAX_HEAD_DIM;
use sparsekit_kernels::launch::{KernelParams, MAX_DYN_SMEM};
use sparsekit_kernels::params::QueryRange;

use crate::backend::{Backend, Event, StreamKind};
use crate::error::{Error, Result};
use crate::kernel_params;
use crate::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, SparseMla, Topk, TopkOutput,
};

/// What a backend that runs the kernels of `sparsekit-kernels` provides; every op is built
/// on it (see the [module docs](self)).
pub trait KernelDevice: Send + Sync + Debug {
    /// An untyped byte buffer owned by this backend (see [`Backend::Buffer`]).
    type Buffer: Send + Sync + Debug;
    /// Per-call metadata placed where the kernels can read it; kept alive until the launch
    /// that reads it has completed.
    type Staged<'a>;

    /// Short name (`emu`, `cuda`).
    fn name(&self) -> &str;
    /// See [`Backend::upload`].
    fn upload(&self, bytes: &[u8]) -> Result<Self::Buffer>;
    /// See [`Backend::alloc`].
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;
    /// See [`Backend::alloc_host`].
    fn alloc_host(&self, bytes: usize) -> Result<Self::Buffer>;
    /// See [`Backend::download`].
    fn download(&self, buf: &Self::Buffer) -> Result<Vec<u8>>;
    /// See [`Backend::buffer_len`].
    fn buffer_len(&self, buf: &Self::Buffer) -> usize;

    /// See [`Backend::on_stream`].
    fn on_stream(&self, stream: StreamKind) -> Result<Self>
    where
        Self: Sized + Clone;
    /// See [`Backend::stream`].
    fn stream(&self) -> StreamKind;
    /// See [`Backend::record_event`].
    fn record_event(&self) -> Result<Event>;
    /// See [`Backend::wait_event`].
    fn wait_event(&self, event: &Event) -> Result<()>;
    /// See [`Backend::synchronize`].
    fn synchronize(&self) -> Result<()>;

    /// Copies `bytes` (host metadata of one call) where the kernels can read them.
    fn stage<'a>(&self, bytes: &'a [u8]) -> Result<Self::Staged<'a>>;
    /// The kernel-visible address of staged metadata.
    fn staged_addr(&self, staged: &Self::Staged<'_>) -> u64;

    /// Calls `f` with the kernel-visible addresses of `reads` and `writes` (in order),
    /// valid for work enqueued before `f` returns; the backend orders that work after
    /// earlier writes to those buffers, and later work after it.
    fn with_addrs<R>(
        &self,
        reads: &[&Self::Buffer],
        writes: &mut [&mut Self::Buffer],
        f: impl FnOnce(&[u64], &[u64]) -> R,
    ) -> Result<R>;

    /// Enqueues (or runs) the kernel of `params` with its geometry (`params.launch()`,
    /// already checked against the GPU limits).
    ///
    /// # Safety
    /// The kernel's contract ([`KernelParams::run`]): every address in `params` comes from
    /// [`Self::with_addrs`] (inside its call) or [`Self::staged_addr`] of metadata alive
    /// until the launch completes, and describes buffers validated for this launch.
    unsafe fn enqueue<P: KernelParams>(&self, params: P) -> Result<()>;

    /// Builds the parameters from the addresses of `reads` and `writes` and launches their
    /// kernel.
    ///
    /// # Safety
    /// `build` fills the parameters from the given addresses, staged metadata that outlives
    /// the launch and descriptors validated against these buffers, so that the kernel's
    /// contract holds.
    unsafe fn launch<P: KernelParams>(
        &self,
        reads: &[&Self::Buffer],
        writes: &mut [&mut Self::Buffer],
        build: impl FnOnce(&[u64], &[u64]) -> P,
    ) -> Result<()> {
        self.with_addrs(reads, writes, |r, w| {
            let params = build(r, w);
            check_launch(&params)?;
            // SAFETY: the caller's contract (see above).
            unsafe { self.enqueue(params) }
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
    let max = INDEXER_MAX_HEAD_DIM as usize;
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

impl<D: KernelDevice> Backend for D {
    type Buffer = D::Buffer;

    fn name(&self) -> &str {
        KernelDevice::name(self)
    }

    fn upload(&self, bytes: &[u8]) -> Result<D::Buffer> {
        KernelDevice::upload(self, bytes)
    }

    fn alloc(&self, bytes: usize) -> Result<D::Buffer> {
        KernelDevice::alloc(self, bytes)
    }

    fn alloc_host(&self, bytes: usize) -> Result<D::Buffer> {
        KernelDevice::alloc_host(self, bytes)
    }

    fn download(&self, buf: &D::Buffer) -> Result<Vec<u8>> {
        KernelDevice::download(self, buf)
    }

    fn buffer_len(&self, buf: &D::Buffer) -> usize {
        KernelDevice::buffer_len(self, buf)
    }

    fn on_stream(&self, stream: StreamKind) -> Result<Self>
    where
        Self: Sized + Clone,
    {
        KernelDevice::on_stream(self, stream)
    }

    fn stream(&self) -> StreamKind {
        KernelDevice::stream(self)
    }

    fn record_event(&self) -> Result<Event> {
        KernelDevice::record_event(self)
    }

    fn wait_event(&self, event: &Event) -> Result<()> {
        KernelDevice::wait_event(self, event)
    }

    fn synchronize(&self) -> Result<()> {
        KernelDevice::synchronize(self)
    }

    fn index_k_store(
        &self,
        op: &IndexKStore<'_>,
        keys: &D::Buffer,
        cache: &mut D::Buffer,
    ) -> Result<()> {
        op.validate(self.buffer_len(keys), self.buffer_len(cache))?;
        if op.slots.is_empty() {
            return Ok(());
        }
        let slots = self.stage(bytemuck::cast_slice(op.slots))?;
        let s = self.staged_addr(&slots);
        // SAFETY: the descriptor was validated against both buffers (slots unique and
        // inside the cache, keys of the right size); the slots stay staged until the
        // launch completes.
        unsafe {
            self.launch(&[keys], &mut [cache], |r, w| {
                kernel_params::index_k_store(&op.layout, r[0], s, w[0], op.slots.len())
            })
        }
    }

    fn kv_store(&self, op: &KvStore<'_>, kv: &D::Buffer, cache: &mut D::Buffer) -> Result<()> {
        op.validate(self.buffer_len(kv), self.buffer_len(cache))?;
        if op.slots.is_empty() {
            return Ok(());
        }
        let slots = self.stage(bytemuck::cast_slice(op.slots))?;
        let s = self.staged_addr(&slots);
        // SAFETY: as in `index_k_store`.
        unsafe {
            self.launch(&[kv], &mut [cache], |r, w| {
                kernel_params::kv_store(&op.layout, r[0], s, w[0], op.slots.len())
            })
        }
    }

    fn indexer_logits(
        &self,
        op: &IndexerLogits<'_>,
        q: &D::Buffer,
        weights: &D::Buffer,
        cache: &D::Buffer,
        out: &mut D::Buffer,
    ) -> Result<()> {
        op.validate(
            self.buffer_len(q),
            self.buffer_len(weights),
            self.buffer_len(cache),
            self.buffer_len(out),
        )?;
        check_indexer(op)?;
        if op.rows.is_empty() || op.row_stride == 0 {
            return Ok(());
        }
        let table = self.stage(bytemuck::cast_slice(op.page_table.as_slice()))?;
        let rows = self.stage(QueryRange::as_bytes(&op.rows))?;
        let (t, rs) = (self.staged_addr(&table), self.staged_addr(&rows));
        // SAFETY: the descriptor was validated against the buffers (every position of
        // every row mapped to a page of the cache, ranges inside the row stride); the
        // page table and rows stay staged until the launch completes.
        unsafe {
            self.launch(&[q, weights, cache], &mut [out], |r, w| {
                kernel_params::indexer_logits(op, r[0], r[1], r[2], t, rs, w[0])
            })
        }
    }

    fn topk(&self, op: &Topk<'_>, logits: &D::Buffer, out: &mut D::Buffer) -> Result<()> {
        op.validate(self.buffer_len(logits), self.buffer_len(out))?;
        if op.rows.is_empty() {
            return Ok(());
        }
        let table = match op.output {
            TopkOutput::Slots { page_table, .. } => {
                Some(self.stage(bytemuck::cast_slice(page_table.as_slice()))?)
            }
            TopkOutput::Positions => None,
        };
        let rows = self.stage(QueryRange::as_bytes(op.rows))?;
        let t = table.as_ref().map_or(0, |t| self.staged_addr(t));
        let rs = self.staged_addr(&rows);
        // SAFETY: as in `indexer_logits` (the page table, when slots are written, maps
        // every position of every row).
        unsafe {
            self.launch(&[logits], &mut [out], |r, w| {
                kernel_params::topk(op, r[0], rs, t, w[0])
            })
        }
    }

    /// The indices are backend data: they are read back and checked against the cache
    /// before the launch (an out-of-range slot is an error, never a wild read).
    fn sparse_mla(
        &self,
        op: &SparseMla,
        q: &D::Buffer,
        cache: &D::Buffer,
        indices: &D::Buffer,
        out: &mut D::Buffer,
        lse: &mut D::Buffer,
    ) -> Result<()> {
        let pages = op.validate(
            self.buffer_len(q),
            self.buffer_len(cache),
            self.buffer_len(indices),
            self.buffer_len(out),
            self.buffer_len(lse),
        )?;
        let idx: Vec<i32> = bytemuck::pod_collect_to_vec(&self.download(indices)?);
        op.check_indices(&idx, pages)?;
        if op.n_tokens == 0 {
            return Ok(());
        }
        // SAFETY: the descriptor was validated against the buffers and every index is
        // `-1` or a slot of the cache.
        unsafe {
            self.launch(&[q, cache, indices], &mut [out, lse], |r, w| {
                kernel_params::sparse_mla(op, r[0], r[1], r[2], w[0], w[1])
            })
        }
    }

    fn copy_pages(&self, op: &CopyPages<'_>, src: &D::Buffer, dst: &mut D::Buffer) -> Result<()> {
        op.validate(self.buffer_len(src), self.buffer_len(dst))?;
        if op.src_ids.is_empty() {
            return Ok(());
        }
        let src_ids = self.stage(bytemuck::cast_slice(op.src_ids))?;
        let dst_ids = self.stage(bytemuck::cast_slice(op.dst_ids))?;
        let (si, di) = (self.staged_addr(&src_ids), self.staged_addr(&dst_ids));
        // SAFETY: ids validated against both regions, destination pages unique; `src` and
        // `dst` are distinct buffers (one shared and one exclusive borrow).
        unsafe {
            self.launch(&[src], &mut [dst], |r, w| {
                kernel_params::copy_pages(op, r[0], w[0], si, di)
            })
        }
    }

    fn page_checksums(
        &self,
        op: &PageChecksums<'_>,
        pool: &D::Buffer,
        out: &mut D::Buffer,
    ) -> Result<()> {
        op.validate(self.buffer_len(pool), self.buffer_len(out))?;
        if op.ids.is_empty() {
            return Ok(());
        }
        let ids = self.stage(bytemuck::cast_slice(op.ids))?;
        let i = self.staged_addr(&ids);
        // SAFETY: ids validated against the region; `out` holds one u64 per id.
        unsafe {
            self.launch(&[pool], &mut [out], |r, w| {
                kernel_params::page_checksums(op, r[0], i, w[0])
            })
        }
    }
}
