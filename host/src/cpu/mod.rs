//! The CPU backend: multi-threaded (rayon), batch-invariant Rust implementations of every
//! op, over 64-byte-aligned host buffers, compiled for the vector path the backend carries
//! ([`isa`]).
//!
//! One file per op family, lining up with `ops/` and `sparsekit_kernels::kernels`:
//! `store`, `indexer_logits`, `topk`, `sparse_mla` and `sparse_mla_v4` (over the attention
//! core `attend`), `pages`, `dense` (the model's layers); `gemm` is the register-blocked f32
//! matrix core, `dot` the bf16 dot product (the `vdpbf16ps` kernel and the arithmetic every
//! path shares with it), `buffer` the host buffers, `scratch` the per-thread working
//! buffers of the ops' tasks, `tasks` how an op's tasks are run (the calling thread works
//! alongside rayon's pool), `raw` the inner loops' reads and writes through raw pointers,
//! and copies.

mod along;
pub mod amx;
pub mod attend;
pub mod buffer;
mod claims;
pub mod dense;
pub mod dot;
mod gate;
pub mod gemm;
pub mod indexer_logits;
pub mod isa;
pub mod pages;
pub mod peak;
mod raw;
mod scratch;
pub mod sparse_mla;
pub mod sparse_mla_v4;
pub mod store;
mod tasks;
mod tile_out;
pub mod topk;
pub mod transpose;
pub mod widen;

use std::sync::Arc;

use half::bf16;

pub use buffer::CpuBuffer;
pub use isa::{CpuIsa, Isa};

use crate::backend::{Backend, KvInput, StreamKind};
use crate::error::{Error, Result};
use crate::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, SparseMla, SparseMlaV4, Topk,
};

/// The CPU backend. Runs on rayon's global pool unless built with [`CpuBackend::with_threads`],
/// on the vector path [`CpuIsa::get`] unless built with [`CpuBackend::with_isa`]. Every op
/// runs synchronously, on either stream (see [`crate::backend`]).
#[derive(Clone, Debug)]
pub struct CpuBackend {
    pool: Option<Arc<rayon::ThreadPool>>,
    isa: CpuIsa,
    stream: StreamKind,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend {
            pool: None,
            isa: CpuIsa::get(),
            stream: StreamKind::Compute,
        }
    }
}

impl CpuBackend {
    /// A backend on rayon's global thread pool and the process's default vector path
    /// ([`CpuIsa::detected`]: the fastest this CPU has, or the one `SPARSEKIT_CPU_ISA`
    /// forces).
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend on rayon's global thread pool and the vector path `isa`; an error when
    /// this CPU cannot run it.
    pub fn with_isa(isa: Isa) -> Result<Self> {
        Ok(CpuBackend {
            isa: CpuIsa::new(isa)?,
            ..Self::default()
        })
    }

    /// A backend on the vector path of `SPARSEKIT_CPU_ISA` (or [`CpuIsa::detected`] when unset);
    /// an unknown name or a path this CPU lacks is an error (the CLI's `--backend cpu`).
    pub fn from_env() -> Result<Self> {
        Ok(CpuBackend {
            isa: CpuIsa::from_env()?,
            ..Self::default()
        })
    }

    /// A backend with its own pool of `threads` worker threads.
    pub fn with_threads(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| Error::backend("cpu", "starting the thread pool", e))?;
        Ok(CpuBackend {
            pool: Some(Arc::new(pool)),
            ..Self::default()
        })
    }

    /// A backend with its own pool of `threads` worker threads, on the vector path `isa`;
    /// an error when this CPU cannot run it.
    pub fn with_threads_and_isa(threads: usize, isa: Isa) -> Result<Self> {
        Ok(CpuBackend {
            isa: CpuIsa::new(isa)?,
            ..Self::with_threads(threads)?
        })
    }

    /// The vector path this backend's kernels run.
    pub fn isa(&self) -> Isa {
        self.isa.isa()
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

    fn arithmetic(&self) -> crate::backend::Arithmetic {
        if self.isa.isa().same_bits() {
            crate::backend::Arithmetic::Shared
        } else {
            crate::backend::Arithmetic::AmxTiles
        }
    }

    buffer::host_memory_methods!();

    fn index_k_store(
        &self,
        op: &IndexKStore<'_>,
        keys: &CpuBuffer,
        cache: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(keys.len(), cache.len())?;
        let keys: &[bf16] = keys.typed("keys")?;
        let isa = self.isa;
        // SAFETY: `op` validated above with these buffers.
        self.run(|| unsafe { store::index_k_store_validated(isa, op, keys, cache.bytes_mut()) });
        Ok(())
    }

    fn kv_store(&self, op: &KvStore<'_>, kv: &CpuBuffer, cache: &mut CpuBuffer) -> Result<()> {
        op.validate(kv.len(), cache.len())?;
        let kv: &[bf16] = kv.typed("kv")?;
        let isa = self.isa;
        // SAFETY: `op` validated above with these buffers.
        self.run(|| unsafe { store::kv_store_validated(isa, op, kv, cache.bytes_mut()) });
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
        let isa = self.isa;
        self.run(|| indexer_logits::indexer_logits(isa, op, q, w, cache.bytes(), out));
        Ok(())
    }

    fn topk(&self, op: &Topk<'_>, logits: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        op.validate(logits.len(), out.len())?;
        let logits = logits.typed::<f32>("logits")?;
        let out = out.typed_mut::<i32>("topk")?;
        let isa = self.isa;
        self.run(|| topk::topk(isa, op, logits, out));
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
        let isa = self.isa;
        self.run(|| sparse_mla::sparse_mla(isa, op, q, cache.bytes(), indices, out, lse));
        Ok(())
    }

    fn sparse_mla_v4(
        &self,
        op: &SparseMlaV4<'_>,
        q: &CpuBuffer,
        main: KvInput<'_, CpuBuffer>,
        extra: Option<KvInput<'_, CpuBuffer>>,
        out: &mut CpuBuffer,
        lse: &mut CpuBuffer,
    ) -> Result<()> {
        let sizes = |k: KvInput<'_, CpuBuffer>| [k.cache.len(), k.indices.len()];
        let pages = op.validate(q.len(), sizes(main), extra.map(sizes), out.len(), lse.len())?;
        let main_idx = main.indices.typed::<i32>("indices")?;
        op.check_indices("main indices", &op.main, main_idx, pages.main)?;
        let extra_in = match (&op.extra, extra) {
            (Some(c), Some(k)) => {
                let idx = k.indices.typed::<i32>("indices")?;
                op.check_indices("extra indices", c, idx, pages.extra)?;
                Some((k.cache.bytes(), idx))
            }
            _ => None,
        };
        let call = sparse_mla_v4::V4Call {
            q: q.typed::<bf16>("q")?,
            main: (main.cache.bytes(), main_idx),
            extra: extra_in,
        };
        let out = out.typed_mut::<bf16>("out")?;
        let lse = lse.typed_mut::<f32>("lse")?;
        let isa = self.isa;
        self.run(|| sparse_mla_v4::sparse_mla_v4(isa, op, call, out, lse));
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
        let isa = self.isa;
        self.run(|| pages::page_checksums(isa, op, pool.bytes(), out));
        Ok(())
    }
}
