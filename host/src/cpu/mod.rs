//! The CPU backend: multi-threaded (rayon), batch-invariant Rust implementations of every
//! op, over 64-byte-aligned host buffers.

pub mod buffer;
pub mod dense;
pub mod gemm;
pub mod indexer;
pub mod isa;
pub mod pages;
pub mod sparse_mla;
pub mod store;
pub mod topk;

use std::sync::Arc;

use half::bf16;

use buffer::host_buffer_methods;
pub use buffer::CpuBuffer;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, SparseMla, Topk,
};

/// The CPU backend. Runs on rayon's global pool unless built with [`CpuBackend::with_threads`].
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl CpuBackend {
    /// A backend on rayon's global thread pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend with its own pool of `threads` worker threads.
    pub fn with_threads(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| Error::Device(format!("cannot start CPU thread pool: {e}")))?;
        Ok(CpuBackend {
            pool: Some(Arc::new(pool)),
        })
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn name(&self) -> &str {
        "cpu"
    }

    fn supports(&self, _op: Op) -> bool {
        true
    }

    host_buffer_methods!();

    fn index_k_store(
        &self,
        op: &IndexKStore<'_>,
        keys: &CpuBuffer,
        cache: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(keys.len(), cache.len())?;
        let keys: &[bf16] = keys.typed("keys")?;
        let l = op.layout;
        let d = l.head_dim();
        self.run(|| {
            store::scatter_by_page(
                cache.bytes_mut(),
                l.bytes_per_page(),
                l.page_size(),
                op.slots,
                |page, off, t| store::write_index_k_token(&l, page, off, &keys[t * d..(t + 1) * d]),
            )
        });
        Ok(())
    }

    fn kv_store(&self, op: &KvStore<'_>, kv: &CpuBuffer, cache: &mut CpuBuffer) -> Result<()> {
        op.validate(kv.len(), cache.len())?;
        let kv: &[bf16] = kv.typed("kv")?;
        let l = op.layout;
        let (d, tb) = (l.d_qk(), l.bytes_per_token());
        self.run(|| {
            store::scatter_by_page(
                cache.bytes_mut(),
                l.bytes_per_page(),
                l.page_size(),
                op.slots,
                |page, off, t| {
                    store::write_kv_token(
                        &l,
                        &mut page[off * tb..(off + 1) * tb],
                        &kv[t * d..(t + 1) * d],
                    )
                },
            )
        });
        Ok(())
    }

    fn indexer_logits(
        &self,
        op: &IndexerLogits<'_>,
        q: &CpuBuffer,
        weights: &CpuBuffer,
        cache: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(q.len(), weights.len(), cache.len(), out.len())?;
        let (q, w) = (q.typed::<bf16>("q")?, weights.typed::<f32>("weights")?);
        let out = out.typed_mut::<f32>("logits")?;
        self.run(|| indexer::indexer_logits(op, q, w, cache.bytes(), out));
        Ok(())
    }

    fn topk(&self, op: &Topk<'_>, logits: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        op.validate(logits.len(), out.len())?;
        let logits = logits.typed::<f32>("logits")?;
        let out = out.typed_mut::<i32>("topk")?;
        self.run(|| topk::topk(op, logits, out));
        Ok(())
    }

    fn sparse_mla(
        &self,
        op: &SparseMla,
        q: &CpuBuffer,
        cache: &CpuBuffer,
        indices: &CpuBuffer,
        out: &mut CpuBuffer,
        lse: &mut CpuBuffer,
    ) -> Result<()> {
        let pages = op.validate(q.len(), cache.len(), indices.len(), out.len(), lse.len())?;
        let indices = indices.typed::<i32>("indices")?;
        op.check_indices(indices, pages)?;
        let q = q.typed::<bf16>("q")?;
        let out = out.typed_mut::<bf16>("out")?;
        let lse = lse.typed_mut::<f32>("lse")?;
        self.run(|| sparse_mla::sparse_mla(op, q, cache.bytes(), indices, out, lse));
        Ok(())
    }

    fn copy_pages(&self, op: &CopyPages<'_>, src: &CpuBuffer, dst: &mut CpuBuffer) -> Result<()> {
        op.validate(src.len(), dst.len())?;
        self.run(|| pages::copy_pages(op, src.bytes(), dst.bytes_mut()));
        Ok(())
    }

    fn page_checksums(
        &self,
        op: &PageChecksums<'_>,
        pool: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(pool.len(), out.len())?;
        let out = out.typed_mut::<u64>("checksums")?;
        self.run(|| pages::page_checksums(op, pool.bytes(), out));
        Ok(())
    }
}
