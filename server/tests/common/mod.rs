//! Shared pieces of the server tests: a backend wrapper whose io copies can be held at a
//! gate or failed (by source region) and that counts attention calls, and engine builders
//! over the cache-backed KV space.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sparsekit_host::cache::{CacheConfig, HiCache};
use sparsekit_host::model_ops::{
    Add, Argmax, Cast, Embed, GatedPool, GatherRows, Matmul, ModelOps, RmsNorm, Rope, SwiGlu,
};
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, PagedRegion, SparseMla, Topk,
};
use sparsekit_host::{Backend, Error, IndexKDtype, KvDtype, Result};
use sparsekit_server::engine::{
    CacheHandle, CacheKvSpace, CacheSpaceOptions, Completion, Engine, EngineOptions,
    GenerateRequest, Model, ModelConfig,
};
use sparsekit_server::metrics::Metrics;

/// Every bounded wait of a test: far above anything a healthy run needs.
pub const BOUND: Duration = Duration::from_secs(120);

/// Controls of a [`Gated`] backend.
#[derive(Debug, Default)]
pub struct GateCtl {
    /// Copies whose source region is this one are held while the gate is closed.
    pub hold_src: Mutex<Option<PagedRegion>>,
    closed: Mutex<bool>,
    cv: Condvar,
    /// Copies held at the gate now.
    pub held: AtomicU32,
    /// Copies whose source region is this one fail (`fail_count` times).
    pub fail_src: Mutex<Option<PagedRegion>>,
    pub fail_count: AtomicU32,
    /// `sparse_mla` calls (one per layer of every step).
    pub attention_calls: AtomicU64,
    /// Whether the gate was open at each `sparse_mla` call, in order.
    pub attention_log: Mutex<Vec<bool>>,
    pub copies: AtomicU64,
    pub poisoned: AtomicBool,
}

impl GateCtl {
    pub fn close(&self) {
        *self.closed.lock().unwrap() = true;
    }
    pub fn open(&self) {
        *self.closed.lock().unwrap() = false;
        self.cv.notify_all();
    }
    pub fn is_closed(&self) -> bool {
        *self.closed.lock().unwrap()
    }
    /// Waits (bounded) until `cond` holds.
    pub fn wait_for(&self, what: &str, cond: impl Fn(&GateCtl) -> bool) {
        let t = Instant::now();
        while !cond(self) {
            assert!(t.elapsed() < BOUND, "never happened: {what}");
            std::thread::yield_now();
        }
    }
    fn before_copy(&self, op: &CopyPages<'_>) -> Result<()> {
        self.copies.fetch_add(1, Ordering::SeqCst);
        if *self.fail_src.lock().unwrap() == Some(op.src)
            && self
                .fail_count
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(Error::Device("injected copy failure".into()));
        }
        if *self.hold_src.lock().unwrap() == Some(op.src) {
            let mut closed = self.closed.lock().unwrap();
            if *closed {
                self.held.fetch_add(1, Ordering::SeqCst);
                let t = Instant::now();
                while *closed && t.elapsed() < BOUND {
                    closed = self.cv.wait_timeout(closed, BOUND).unwrap().0;
                }
                self.held.fetch_sub(1, Ordering::SeqCst);
            }
        }
        Ok(())
    }
}

/// A backend whose `copy_pages` obeys a [`GateCtl`] and whose `sparse_mla` is counted.
#[derive(Debug)]
pub struct Gated<B> {
    pub inner: B,
    pub ctl: Arc<GateCtl>,
}

impl<B> Gated<B> {
    pub fn new(inner: B) -> (Self, Arc<GateCtl>) {
        let ctl = Arc::new(GateCtl::default());
        (
            Gated {
                inner,
                ctl: ctl.clone(),
            },
            ctl,
        )
    }
}

impl<B: Backend> Backend for Gated<B> {
    type Buffer = B::Buffer;
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn upload(&self, b: &[u8]) -> Result<Self::Buffer> {
        self.inner.upload(b)
    }
    fn alloc(&self, n: usize) -> Result<Self::Buffer> {
        self.inner.alloc(n)
    }
    fn alloc_host(&self, n: usize) -> Result<Self::Buffer> {
        self.inner.alloc_host(n)
    }
    fn download(&self, b: &Self::Buffer) -> Result<Vec<u8>> {
        self.inner.download(b)
    }
    fn buffer_len(&self, b: &Self::Buffer) -> usize {
        self.inner.buffer_len(b)
    }
    fn index_k_store(
        &self,
        op: &IndexKStore<'_>,
        k: &Self::Buffer,
        c: &mut Self::Buffer,
    ) -> Result<()> {
        self.inner.index_k_store(op, k, c)
    }
    fn kv_store(&self, op: &KvStore<'_>, k: &Self::Buffer, c: &mut Self::Buffer) -> Result<()> {
        self.inner.kv_store(op, k, c)
    }
    fn indexer_logits(
        &self,
        op: &IndexerLogits<'_>,
        q: &Self::Buffer,
        w: &Self::Buffer,
        c: &Self::Buffer,
        o: &mut Self::Buffer,
    ) -> Result<()> {
        self.inner.indexer_logits(op, q, w, c, o)
    }
    fn topk(&self, op: &Topk<'_>, l: &Self::Buffer, o: &mut Self::Buffer) -> Result<()> {
        self.inner.topk(op, l, o)
    }
    fn sparse_mla(
        &self,
        op: &SparseMla,
        q: &Self::Buffer,
        c: &Self::Buffer,
        i: &Self::Buffer,
        o: &mut Self::Buffer,
        l: &mut Self::Buffer,
    ) -> Result<()> {
        let open = !self.ctl.is_closed();
        self.ctl.attention_log.lock().unwrap().push(open);
        self.ctl.attention_calls.fetch_add(1, Ordering::SeqCst);
        self.inner.sparse_mla(op, q, c, i, o, l)
    }
    fn sparse_mla_v4(
        &self,
        op: &sparsekit_host::ops::SparseMlaV4<'_>,
        q: &Self::Buffer,
        main: sparsekit_host::KvInput<'_, Self::Buffer>,
        extra: Option<sparsekit_host::KvInput<'_, Self::Buffer>>,
        out: &mut Self::Buffer,
        lse: &mut Self::Buffer,
    ) -> Result<()> {
        self.inner.sparse_mla_v4(op, q, main, extra, out, lse)
    }
    fn copy_pages(&self, op: &CopyPages<'_>, s: &Self::Buffer, d: &mut Self::Buffer) -> Result<()> {
        self.ctl.before_copy(op)?;
        self.inner.copy_pages(op, s, d)
    }
    fn page_checksums(
        &self,
        op: &PageChecksums<'_>,
        p: &Self::Buffer,
        o: &mut Self::Buffer,
    ) -> Result<()> {
        self.inner.page_checksums(op, p, o)
    }
}

impl<B: ModelOps> ModelOps for Gated<B> {
    fn matmul(
        &self,
        op: &Matmul,
        x: &Self::Buffer,
        w: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        self.inner.matmul(op, x, w, out)
    }
    fn rms_norm(
        &self,
        op: &RmsNorm,
        x: &Self::Buffer,
        g: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        self.inner.rms_norm(op, x, g, out)
    }
    fn rope(
        &self,
        op: &Rope<'_>,
        t: &Self::Buffer,
        x: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        self.inner.rope(op, t, x, out)
    }
    fn swiglu(&self, op: &SwiGlu, g: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> {
        self.inner.swiglu(op, g, out)
    }
    fn embed(&self, op: &Embed<'_>, t: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> {
        self.inner.embed(op, t, out)
    }
    fn gather_rows(
        &self,
        op: &GatherRows<'_>,
        x: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        self.inner.gather_rows(op, x, out)
    }
    fn add(&self, op: &Add, x: &Self::Buffer, acc: &mut Self::Buffer) -> Result<()> {
        self.inner.add(op, x, acc)
    }
    fn cast(&self, op: &Cast, x: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> {
        self.inner.cast(op, x, out)
    }
    fn argmax(&self, op: &Argmax, l: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> {
        self.inner.argmax(op, l, out)
    }
    fn gated_pool(
        &self,
        op: &GatedPool<'_>,
        x: &Self::Buffer,
        bias: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        self.inner.gated_pool(op, x, bias, out)
    }
}

/// An engine over a cache-backed space built here (so the test keeps its handle).
pub fn cached_engine<B: Backend + ModelOps + 'static>(
    backend: Arc<B>,
    cfg: ModelConfig,
    opts: EngineOptions,
    config: CacheConfig,
) -> (Engine, CacheHandle<B>) {
    let model = Model::new(backend.clone(), cfg, opts.seed).unwrap();
    let spec = model.cache_spec(opts.kv_dtype, opts.index_k_dtype).unwrap();
    let cache = Arc::new(HiCache::new(backend, spec, config).unwrap());
    let space = CacheKvSpace::new(cache, CacheSpaceOptions::default());
    let handle = space.handle();
    let e = Engine::start_with(model, space, opts, Arc::new(Metrics::new("both"))).unwrap();
    (e, handle)
}

/// Runs `req` to completion (bounded).
pub fn run(
    e: &Engine,
    req: &GenerateRequest,
) -> std::result::Result<Completion, sparsekit_server::EngineError> {
    e.submit(req.clone())?.wait(BOUND)
}

/// Waits (bounded) until the engine is idle and has run its accounting check since; then
/// asserts it passed and nothing leaked.
pub fn assert_idle_and_clean(e: &Engine) {
    let m = e.metrics();
    let checks = || {
        m.encode()
            .lines()
            .find(|l| l.starts_with("sparsekit_idle_checks_total "))
            .and_then(|l| l.split(' ').nth(1)?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let t = Instant::now();
    let start = checks();
    loop {
        let st = e.stats();
        if st.running == 0 && st.waiting == 0 && checks() >= start + 2 {
            assert_eq!(st.leak_check, Some(Ok(())), "accounting check");
            assert_eq!(st.leaked_pages, 0, "leaked pages");
            return;
        }
        assert!(t.elapsed() < BOUND, "the engine never went idle: {st:?}");
        std::thread::yield_now();
    }
}

/// Options for tests: small steps so chunking and batching show.
pub fn opts(kv_pages: usize) -> EngineOptions {
    EngineOptions {
        kv_pages,
        prefill_chunk: 64,
        max_batch_tokens: 96,
        min_prefill_tokens: 16,
        kv_dtype: KvDtype::Bf16,
        index_k_dtype: IndexKDtype::Bf16,
        ..Default::default()
    }
}
