//! Shared fixture of the PD tests: a decode and a prefill cache on the CPU backend joined
//! by the in-process transport, seeded page contents (never zeros), a prefill worker whose
//! every layer can be gated by the test, and readers of what decode received.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use half::bf16;
use sparsekit_host::cache::{
    BufferKind, CacheConfig, CacheSpec, Fault, Faults, HiCache, PageRef, SlotRef,
};
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{IndexKStore, KvStore};
use sparsekit_host::{Backend, CpuBackend};
use sparsekit_server::pd::{
    hello, Job, PdError, Receiver, ReceiverConfig, Role, Sender, SenderConfig,
};
use sparsekit_server::pd::{LandingGeometry, LandingZone};
use sparsekit_server::transfer::local::{self, LocalEnd};

pub type B = CpuBackend;
pub const PAGE: usize = 4;
pub const LAYERS: usize = 3;
/// Bound of every wait in these tests (a wedge fails the test instead of hanging it).
pub const BOUND: Duration = Duration::from_secs(20);

pub fn spec(kv: KvDtype, ik: IndexKDtype) -> CacheSpec {
    CacheSpec::new(
        KvLayout::new(kv, 128, 16, PAGE).unwrap(),
        IndexKLayout::new(ik, 32, PAGE).unwrap(),
        LAYERS,
    )
    .unwrap()
}

pub fn cache(spec: CacheSpec, pages: usize, faults: &[Fault]) -> Arc<HiCache<B>> {
    cache_t(spec, pages, faults, Duration::from_secs(5))
}

/// A cache whose waits are bounded by `timeout`.
pub fn cache_t(
    spec: CacheSpec,
    pages: usize,
    faults: &[Fault],
    timeout: Duration,
) -> Arc<HiCache<B>> {
    let mut cfg = CacheConfig::new(pages, 0);
    cfg.wait_timeout = timeout;
    cfg.faults = Faults::with(faults);
    Arc::new(HiCache::new(Arc::new(CpuBackend::new()), spec, cfg).unwrap())
}

/// A PD pair over the local transport.
pub struct Pd {
    pub d: Arc<HiCache<B>>,
    pub p: Arc<HiCache<B>>,
    pub rx: Receiver<B>,
    pub tx: Arc<Sender<B>>,
    /// The decode end (to inject frames towards prefill).
    pub d_end: Arc<LocalEnd>,
    /// The prefill end (to inject frames and writes towards decode).
    pub p_end: Arc<LocalEnd>,
}

pub fn local_ends(d: &Arc<HiCache<B>>, p: &Arc<HiCache<B>>) -> (Arc<LocalEnd>, Arc<LocalEnd>) {
    let g = LandingGeometry::new(*d.spec(), d.device_pages()).unwrap();
    let zone = Arc::new(LandingZone::new(g).unwrap());
    local::pair(
        zone,
        hello(
            Role::Decode,
            d.spec(),
            d.backend().arithmetic(),
            d.device_pages(),
            Vec::new(),
        ),
        hello(
            Role::Prefill,
            p.spec(),
            p.backend().arithmetic(),
            0,
            Vec::new(),
        ),
    )
    .unwrap()
}

pub fn pd(d: Arc<HiCache<B>>, p: Arc<HiCache<B>>, rc: ReceiverConfig, sc: SenderConfig) -> Pd {
    let (d_end, p_end) = local_ends(&d, &p);
    let rx = Receiver::new(d.clone(), d_end.clone(), rc).unwrap();
    let tx = Arc::new(Sender::new(p.clone(), p_end.clone(), sc).unwrap());
    Pd {
        d,
        p,
        rx,
        tx,
        d_end,
        p_end,
    }
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Seeded bf16 rows in [-2, 2) (never all zeros), `[tokens, dim]`, as bytes: the content of
/// token `t` depends on the prompt (its seed), the layer and `t`.
pub fn rows(seed: u64, layer: usize, tokens: usize, dim: usize, salt: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(tokens * dim * 2);
    for t in 0..tokens {
        for e in 0..dim {
            let h = mix(seed ^ mix((layer as u64) << 40 ^ (t as u64) << 20 ^ e as u64 ^ salt));
            let v = (h >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
            out.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
        }
    }
    out
}

pub fn prompt_seed(prompt: &[u32]) -> u64 {
    prompt
        .iter()
        .fold(0x1234_5678u64, |a, &t| mix(a ^ t as u64))
}

pub fn prompt(seed: u64, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (mix(seed * 1000 + i as u64) % 250) as u32 + 3)
        .collect()
}

/// Prefill side: computes `prompt` into fresh pages of request `req` (one step, every
/// layer, both kinds). Returns the pages.
pub fn fill(cache: &HiCache<B>, req: u64, prompt: &[u32]) -> Vec<PageRef> {
    cache.begin(req, &[]).unwrap();
    let spec = *cache.spec();
    let pages = cache.alloc(req, prompt.len().div_ceil(PAGE)).unwrap();
    let b = cache.backend();
    let seed = prompt_seed(prompt);
    let slots: Vec<SlotRef> = (0..prompt.len())
        .map(|t| SlotRef {
            page: pages[t / PAGE],
            offset: (t % PAGE) as u32,
        })
        .collect();
    let mut step = cache.step(&[req]).unwrap();
    for l in 0..LAYERS {
        let mut g = step.wait_layer(l).unwrap();
        let kv = b
            .upload(&rows(seed, l, prompt.len(), spec.kv.d_qk(), 1))
            .unwrap();
        g.kv_store(&slots, &kv).unwrap();
        let ik = b
            .upload(&rows(seed, l, prompt.len(), spec.index_k.head_dim(), 2))
            .unwrap();
        g.index_k_store(&slots, &ik).unwrap();
    }
    pages
}

/// What prefill computed for `prompt` in `layer`: `(kv, index_k)` pages packed from byte 0.
pub fn expected(spec: &CacheSpec, prompt: &[u32], layer: usize) -> (Vec<u8>, Vec<u8>) {
    let b = CpuBackend::new();
    let n = prompt.len().div_ceil(PAGE);
    let seed = prompt_seed(prompt);
    let slots: Vec<i64> = (0..prompt.len() as i64).collect();
    let mut kv = b.alloc(spec.kv.buffer_bytes(n)).unwrap();
    let rows_kv = b
        .upload(&rows(seed, layer, prompt.len(), spec.kv.d_qk(), 1))
        .unwrap();
    b.kv_store(
        &KvStore {
            layout: spec.kv,
            slots: &slots,
        },
        &rows_kv,
        &mut kv,
    )
    .unwrap();
    let mut ik = b.alloc(spec.index_k.buffer_bytes(n)).unwrap();
    let rows_ik = b
        .upload(&rows(seed, layer, prompt.len(), spec.index_k.head_dim(), 2))
        .unwrap();
    b.index_k_store(
        &IndexKStore {
            layout: spec.index_k,
            slots: &slots,
        },
        &rows_ik,
        &mut ik,
    )
    .unwrap();
    (b.download(&kv).unwrap(), b.download(&ik).unwrap())
}

/// Decode side: `pages` of `layer` as the request's step sees them, packed from byte 0.
pub fn received(
    cache: &HiCache<B>,
    req: u64,
    pages: &[PageRef],
    layer: usize,
) -> sparsekit_host::Result<(Vec<u8>, Vec<u8>)> {
    let mut step = cache.step(&[req])?;
    let g = step.wait_layer(layer)?;
    let (kv, ik) = g.views()?;
    let b = cache.backend();
    let mut out = (Vec::new(), Vec::new());
    for (kind, buf, dst) in [
        (BufferKind::Kv, kv, &mut out.0),
        (BufferKind::IndexK, ik, &mut out.1),
    ] {
        let all = b.download(buf)?;
        let region = cache.device_region(kind);
        for p in pages {
            dst.extend_from_slice(&all[region.page_range(p.id as usize)]);
        }
    }
    Ok(out)
}

/// Whether the token bytes of `got` equal `want` (both packed from byte 0) for the first
/// `tokens` tokens — rows, values and scales wherever the layout keeps them (the rest of
/// the last page is not part of the prompt).
pub fn same_tokens(
    spec: &CacheSpec,
    tokens: usize,
    got: &(Vec<u8>, Vec<u8>),
    want: &(Vec<u8>, Vec<u8>),
) -> bool {
    (0..tokens).all(|t| {
        let kv = spec.kv.slot_token_bytes(t);
        // model1_fp8 keeps the tile scales at the page's end (inside the row otherwise).
        let ts = spec.kv.slot_tile_scale_bytes(t);
        let v = spec.index_k.slot_value_bytes(t);
        let s = spec.index_k.slot_scale_bytes(t);
        got.0[kv.clone()] == want.0[kv]
            && got.0[ts.clone()] == want.0[ts]
            && got.1[v.clone()] == want.1[v]
            && s.is_none_or(|s| got.1[s.clone()] == want.1[s])
    })
}

/// Decode side: registers request `req`, allocates its prompt pages and starts the transfer.
pub fn start(pd: &Pd, req: u64, prompt: &[u32]) -> Result<Vec<PageRef>, PdError> {
    start_on(&pd.d, &pd.rx, req, prompt)
}

/// [`start`] on any decode cache and receiver.
pub fn start_on(
    d: &HiCache<B>,
    rx: &Receiver<B>,
    req: u64,
    prompt: &[u32],
) -> Result<Vec<PageRef>, PdError> {
    d.begin(req, &[])?;
    let started = d
        .alloc(req, prompt.len().div_ceil(PAGE))
        .map_err(PdError::from)
        .and_then(|pages| rx.start(req, prompt, &pages).map(|()| pages));
    if started.is_err() {
        let _ = d.abort(req);
    }
    started
}

/// What the prefill worker does before pushing a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    Go,
    /// Prefill gives the request up (its own abort).
    Cancel,
    /// The worker panics (the job unwinds).
    Panic,
}

pub type Gate = Arc<dyn Fn(u64, usize) -> Act + Send + Sync>;

/// A prefill worker: takes jobs, computes them into the prefill cache, pushes every layer
/// (asking `gate` before each), finishes, and ends its prefill request. Stops when `stop`
/// is set. A panic (by the gate) fails only that job; the worker goes on.
pub struct Worker {
    pub stop: Arc<AtomicBool>,
    pub handle: Option<JoinHandle<()>>,
}

impl Worker {
    pub fn spawn(tx: Arc<Sender<B>>, p: Arc<HiCache<B>>, gate: Gate) -> Worker {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                let Some(job) = tx.next_job(Duration::from_millis(20)) else {
                    continue;
                };
                let req = job.request();
                let p2 = p.clone();
                let gate = gate.clone();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                    serve(job, &p2, &*gate)
                }));
                // The prefill request ends whatever happened.
                if p.is_live(req) {
                    let _ = p.abort(req);
                }
                let _ = r;
            }
        });
        Worker {
            stop,
            handle: Some(handle),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn serve(job: Job<B>, p: &HiCache<B>, gate: &dyn Fn(u64, usize) -> Act) {
    let req = job.request();
    let src = fill(p, req, job.prompt());
    let mut step = p.step(&[req]).unwrap();
    for l in 0..LAYERS {
        match gate(req, l) {
            Act::Go => {}
            Act::Cancel => {
                drop(step);
                job.cancel("prefill gave up");
                return;
            }
            Act::Panic => panic!("injected prefill worker panic (request {req})"),
        }
        let staged = {
            let g = step.wait_layer(l).unwrap();
            job.stage(&g, &src).unwrap()
        };
        if job.write(staged).is_err() {
            // Cancelled by decode: dropping the job confirms.
            return;
        }
    }
    drop(step);
    let _ = job.finish();
    let _ = p.finish(req);
}

pub fn go() -> Gate {
    Arc::new(|_, _| Act::Go)
}

/// Waits (bounded by `BOUND`) until `f` holds.
pub fn until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < BOUND, "{what}: not reached within {BOUND:?}");
        std::thread::yield_now();
    }
}

/// A V3.2-shaped cache spec with model1_fp8 KV (448 + 64 dims, scales at the page's end)
/// and 128-dim index keys of `ik` (values, then scales at the page's end for fp8/fp4).
pub fn model1_spec(ik: IndexKDtype) -> CacheSpec {
    CacheSpec::new(
        KvLayout::model1_fp8(PAGE).unwrap(),
        IndexKLayout::new(ik, 128, PAGE).unwrap(),
        LAYERS,
    )
    .unwrap()
}
