//! A small simulated model on top of `HiCache` for the cache tests: every token's KV and
//! index key are a deterministic function of the token prefix up to it and the layer, so
//! a cache hit must reproduce exactly the bytes the first computation stored. Plus
//! [`Flaky`], a backend wrapper whose page copies can be held at a gate, failed, made to
//! panic or slowed at random (the io worker's copies go through it).

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use half::bf16;
use sparsekit_host::cache::{
    BufferKind, CacheConfig, CacheSpec, HiCache, LayerGuard, PageRef, Prefix, SlotRef, Step,
};
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, PagedRegion, SparseMla, Topk,
};
use sparsekit_host::{Backend, CpuBackend, Error, Result};

pub const PAGE: usize = 4;
pub const LAYERS: usize = 2;
/// Every bounded wait of a test: far above anything a healthy run needs.
pub const BOUND: Duration = Duration::from_secs(20);

pub fn spec(kv: KvDtype, ik: IndexKDtype) -> CacheSpec {
    CacheSpec::new(
        KvLayout::new(kv, 128, 16, PAGE).unwrap(),
        IndexKLayout::new(ik, 32, PAGE).unwrap(),
        LAYERS,
    )
    .unwrap()
}

pub fn cache(spec: CacheSpec, config: CacheConfig) -> HiCache<CpuBackend> {
    cache_on(CpuBackend::new(), spec, config)
}

pub fn cache_on<B: Backend + 'static>(
    backend: B,
    spec: CacheSpec,
    config: CacheConfig,
) -> HiCache<B> {
    HiCache::new(Arc::new(backend), spec, config).unwrap()
}

pub fn prompt(base: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| base * 1000 + i).collect()
}

/// Hash of a token prefix (FNV-1a), the seed of its content.
pub fn prefix_hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        (h ^ t as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// `n` bf16 values from a seed (xorshift), never all zero.
fn values(seed: u64, n: usize) -> Vec<bf16> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0)
        })
        .collect()
}

/// The bf16 KV row `store_layer` writes for position `pos` of `tokens` in `layer` (its
/// bytes, as a bf16 KV page holds them).
pub fn kv_row(spec: &CacheSpec, tokens: &[u32], pos: usize, layer: usize) -> Vec<u8> {
    let h = prefix_hash(&tokens[..=pos]) ^ (layer as u64).wrapping_mul(0x9e37_79b9);
    bytemuck::cast_slice(&values(h, spec.kv.d_qk())).to_vec()
}

/// Stores positions `from..tokens.len()` of `tokens` (held in `pages`) into the guard's
/// layer: the simulated forward pass of one layer.
pub fn store_layer<B: Backend + 'static>(
    g: &mut LayerGuard<'_, B>,
    backend: &B,
    spec: &CacheSpec,
    tokens: &[u32],
    pages: &[PageRef],
    from: usize,
) -> Result<()> {
    if from >= tokens.len() {
        return Ok(());
    }
    let l = g.layer();
    let slots: Vec<SlotRef> = (from..tokens.len())
        .map(|p| SlotRef {
            page: pages[p / PAGE],
            offset: (p % PAGE) as u32,
        })
        .collect();
    let mut kv = Vec::new();
    let mut ik = Vec::new();
    for p in from..tokens.len() {
        let h = prefix_hash(&tokens[..=p]) ^ (l as u64).wrapping_mul(0x9e37_79b9);
        kv.extend(values(h, spec.kv.d_qk()));
        ik.extend(values(h ^ 0xabcd, spec.index_k.head_dim()));
    }
    g.kv_store(&slots, &backend.upload(bytemuck::cast_slice(&kv))?)?;
    g.index_k_store(&slots, &backend.upload(bytemuck::cast_slice(&ik))?)?;
    Ok(())
}

/// The bytes of `pages` of the guard's layer, `[page][kind]`.
pub fn read_pages<B: Backend + 'static>(
    cache: &HiCache<B>,
    g: &LayerGuard<'_, B>,
    pages: &[PageRef],
) -> Result<Vec<[Vec<u8>; 2]>> {
    let (kv, ik) = g.views()?;
    let kv = cache.backend().download(kv)?;
    let ik = cache.backend().download(ik)?;
    let rk = cache.device_region(BufferKind::Kv);
    let ri = cache.device_region(BufferKind::IndexK);
    Ok(pages
        .iter()
        .map(|p| {
            [
                kv[rk.page_range(p.id as usize)].to_vec(),
                ik[ri.page_range(p.id as usize)].to_vec(),
            ]
        })
        .collect())
}

/// Bytes of one page, `[kv, index_k]`, by (token prefix hash, layer).
type PageBytes = HashMap<(u64, usize), [Vec<u8>; 2]>;

/// What every page of every prefix must contain, learned when it is first computed
/// (shareable between threads).
#[derive(Default)]
pub struct Expect {
    pages: Mutex<PageBytes>,
    pub hits_checked: AtomicU64,
}

impl Expect {
    /// Checks `got` (page `i` of `tokens`, layer `l`) against what was computed for it.
    pub fn check(&self, tokens: &[u32], i: usize, l: usize, got: &[Vec<u8>; 2]) -> Result<()> {
        let key = (prefix_hash(&tokens[..(i + 1) * PAGE]), l);
        let map = self.pages.lock().unwrap();
        let want = map
            .get(&key)
            .ok_or_else(|| Error::Leak(format!("cache served a page never computed (page {i})")))?;
        if got != want {
            return Err(Error::Integrity {
                what: "served page",
                page: i as u32,
                layer: l,
                kind: if got[0] != want[0] { "kv" } else { "index_k" },
                expected: 0,
                actual: 1,
            });
        }
        self.hits_checked.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Learns page `i` of `tokens` at layer `l` (or checks it equals what was learned).
    pub fn learn(&self, tokens: &[u32], i: usize, l: usize, got: [Vec<u8>; 2]) -> Result<()> {
        let key = (prefix_hash(&tokens[..(i + 1) * PAGE]), l);
        let mut map = self.pages.lock().unwrap();
        match map.get(&key) {
            Some(w) if *w != got => Err(Error::Integrity {
                what: "recomputed page differs",
                page: i as u32,
                layer: l,
                kind: "kv",
                expected: 0,
                actual: 1,
            }),
            Some(_) => Ok(()),
            None => {
                map.insert(key, got);
                Ok(())
            }
        }
    }

    /// The forward pass of one request inside `step` (whose only member is `req`... or
    /// one of several): per layer, wait, check every prefix page, store the rest, learn
    /// the new full pages.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<B: Backend + 'static>(
        &self,
        cache: &HiCache<B>,
        step: &mut Step<'_, B>,
        tokens: &[u32],
        prefix: &Prefix,
        pages: &[PageRef],
    ) -> Result<()> {
        let spec = *cache.spec();
        let n_prefix = prefix.pages.len();
        for l in 0..LAYERS {
            let mut g = step.wait_layer(l)?;
            let got = read_pages(cache, &g, &pages[..n_prefix])?;
            for (i, got) in got.iter().enumerate() {
                self.check(tokens, i, l, got)?;
            }
            store_layer(&mut g, cache.backend(), &spec, tokens, pages, prefix.tokens)?;
            let full = tokens.len() / PAGE;
            let fresh = read_pages(cache, &g, &pages[n_prefix..full])?;
            for (k, got) in fresh.into_iter().enumerate() {
                self.learn(tokens, n_prefix + k, l, got)?;
            }
        }
        Ok(())
    }

    /// Runs one request: begin, one step (verify every cached page, compute the rest),
    /// commit, and finish (or abort before committing when `abort`). Returns the matched
    /// tokens.
    pub fn request<B: Backend + 'static>(
        &self,
        cache: &HiCache<B>,
        req: u64,
        tokens: &[u32],
        abort: bool,
    ) -> Result<usize> {
        let prefix = cache.begin(req, tokens)?;
        let outcome = self.body(cache, req, tokens, &prefix, abort);
        if outcome.is_err() || abort {
            cache.abort(req)?;
        } else {
            cache.finish(req)?;
        }
        outcome.map(|()| prefix.tokens)
    }

    fn body<B: Backend + 'static>(
        &self,
        cache: &HiCache<B>,
        req: u64,
        tokens: &[u32],
        prefix: &Prefix,
        abort: bool,
    ) -> Result<()> {
        let need = tokens.len().div_ceil(PAGE) - prefix.pages.len();
        let fresh = cache.alloc(req, need)?;
        let mut pages = prefix.pages.clone();
        pages.extend(&fresh);
        {
            let mut step = cache.step(&[req])?;
            self.forward(cache, &mut step, tokens, prefix, &pages)?;
        }
        if abort {
            return Ok(());
        }
        cache.commit(req, tokens, &pages)
    }
}

/// A gate calls can be held at while it is closed (each wait bounded by [`BOUND`]).
#[derive(Debug, Default)]
pub struct Gate {
    closed: Mutex<bool>,
    cv: Condvar,
    /// Calls currently held.
    waiting: AtomicU32,
}

impl Gate {
    pub fn close(&self) {
        *self.closed.lock().unwrap() = true;
    }
    pub fn open(&self) {
        *self.closed.lock().unwrap() = false;
        self.cv.notify_all();
    }
    /// Waits (bounded) until `n` calls are held.
    pub fn wait_held(&self, n: u32) {
        let t = Instant::now();
        while self.waiting.load(Ordering::SeqCst) < n {
            assert!(t.elapsed() < BOUND, "no call reached the gate");
            std::thread::yield_now();
        }
    }
    /// Waits (bounded) while the gate is closed, counted as held.
    fn hold(&self) {
        let mut closed = self.closed.lock().unwrap();
        if *closed {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            let t = Instant::now();
            while *closed && t.elapsed() < BOUND {
                closed = self.cv.wait_timeout(closed, BOUND).unwrap().0;
            }
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Controls of a [`Flaky`] backend.
#[derive(Debug, Default)]
pub struct FlakyCtl {
    /// Where page copies are held ([`FlakyCtl::close_gate`]).
    gate: Gate,
    /// Fail the next N copies with `Error::Device`.
    pub fail_next: AtomicU32,
    /// Panic in the next N copies.
    pub panic_next: AtomicU32,
    /// Random mode: per copy, fail with probability `fail_per_mille`/1000, panic with
    /// `panic_per_mille`, and spin up to `max_delay_us`.
    pub random: AtomicBool,
    pub fail_per_mille: AtomicU32,
    pub panic_per_mille: AtomicU32,
    pub max_delay_us: AtomicU32,
    rng: AtomicU64,
    /// Copies done (attempted).
    pub copies: AtomicU64,
    /// Hold only the cache io worker's copies at the closed gate (a reader's own copies
    /// — the `skip-index-wait` poison — pass).
    pub gate_io_only: AtomicBool,
    /// Page checksum calls made by the cache io worker (its verification after copies).
    pub io_checksums: AtomicU64,
    /// When non-zero: the io worker's checksum call that counts this down to zero waits
    /// at `checksum_gate` (while closed) — holds a load between its last copy and the
    /// publication of its layer.
    pub hold_checksum_nth: AtomicU64,
    pub checksum_gate: Gate,
}

impl FlakyCtl {
    pub fn close_gate(&self) {
        self.gate.close();
    }
    pub fn open_gate(&self) {
        self.gate.open();
    }
    /// Waits (bounded) until `n` copies are held at the gate.
    pub fn wait_held(&self, n: u32) {
        self.gate.wait_held(n);
    }
    pub fn seed(&self, s: u64) {
        self.rng.store(s | 1, Ordering::Relaxed);
    }
    fn roll(&self) -> u32 {
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        (x >> 33) as u32
    }

    fn on_io_thread() -> bool {
        std::thread::current().name() == Some("sparsekit-cache-io")
    }

    fn before_checksums(&self) {
        if !Self::on_io_thread() {
            return;
        }
        self.io_checksums.fetch_add(1, Ordering::SeqCst);
        let last = self
            .hold_checksum_nth
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            == Ok(1);
        if last {
            self.checksum_gate.hold();
        }
    }

    fn before_copy(&self) -> Result<()> {
        self.copies.fetch_add(1, Ordering::SeqCst);
        // Under `gate_io_only`, a reader's own copies pass.
        let exempt = self.gate_io_only.load(Ordering::SeqCst) && !Self::on_io_thread();
        if !exempt {
            self.gate.hold();
        }
        if self
            .panic_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            panic!("injected io panic");
        }
        if self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(Error::Device("injected copy failure".into()));
        }
        if self.random.load(Ordering::Relaxed) {
            let r = self.roll() % 1000;
            if r < self.panic_per_mille.load(Ordering::Relaxed) {
                panic!("injected random io panic");
            }
            if r < self.panic_per_mille.load(Ordering::Relaxed)
                + self.fail_per_mille.load(Ordering::Relaxed)
            {
                return Err(Error::Device("injected random copy failure".into()));
            }
            let us = self.roll() % (self.max_delay_us.load(Ordering::Relaxed) + 1);
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(us as u64) {
                std::hint::spin_loop();
            }
        }
        Ok(())
    }
}

/// A CPU backend whose `copy_pages` (the io worker's copies) obeys a [`FlakyCtl`].
#[derive(Debug, Default)]
pub struct Flaky {
    inner: CpuBackend,
    pub ctl: Arc<FlakyCtl>,
}

impl Flaky {
    pub fn new() -> (Self, Arc<FlakyCtl>) {
        let ctl = Arc::new(FlakyCtl::default());
        (
            Flaky {
                inner: CpuBackend::new(),
                ctl: ctl.clone(),
            },
            ctl,
        )
    }
}

impl Backend for Flaky {
    type Buffer = <CpuBackend as Backend>::Buffer;
    fn name(&self) -> &str {
        "flaky-cpu"
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
        self.ctl.before_copy()?;
        self.inner.copy_pages(op, s, d)
    }
    fn page_checksums(
        &self,
        op: &PageChecksums<'_>,
        p: &Self::Buffer,
        o: &mut Self::Buffer,
    ) -> Result<()> {
        self.ctl.before_checksums();
        self.inner.page_checksums(op, p, o)
    }
}

/// The random seed of a test: `SPARSEKIT_SEED` if set, else from the clock; printed.
pub fn seed(test: &str) -> u64 {
    let s = std::env::var("SPARSEKIT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        });
    eprintln!("{test}: seed {s} (replay with SPARSEKIT_SEED={s})");
    s
}

/// Source pages for an inbound transfer: `n` pages of `layout` with seeded bytes, and
/// their checksums.
pub fn source<B: Backend>(
    b: &B,
    layout: impl Into<sparsekit_host::layout::PageLayout>,
    n: usize,
    seed: u8,
) -> (B::Buffer, PagedRegion, Vec<u64>) {
    let region = PagedRegion::contiguous(layout, n);
    let bytes: Vec<u8> = (0..region.layout.bytes_per_page() * n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let buf = b.upload(&bytes).unwrap();
    let ids: Vec<i32> = (0..n as i32).collect();
    let mut out = b.alloc(n * 8).unwrap();
    b.page_checksums(&PageChecksums { region, ids: &ids }, &buf, &mut out)
        .unwrap();
    let sums = b
        .download(&out)
        .unwrap()
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (buf, region, sums)
}
