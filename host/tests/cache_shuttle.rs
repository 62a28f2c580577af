//! A shuttle model of the cache's begin / load / share / fail / abort protocol: the whole
//! `cache` module tree is compiled here against shuttle's mutexes, condvars and threads
//! (see `host/src/sync.rs`), so shuttle explores the interleavings of the requests' threads
//! and the real io worker. Shuttle's timed waits never time out: every wait in the cache
//! must be ended by a notification, or shuttle reports the deadlock. In every explored
//! schedule: a request's reads see exactly the committed bytes or fail with a typed error,
//! the bookkeeping passes `leak_check` at the end, and everything shuts down.
//!
//! `SPARSEKIT_SEED` replays a run's schedules; `SPARSEKIT_SHUTTLE_ITERS` sets their number.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

mod common;

// The crate paths the cache module tree names, mapped onto the real crate...
mod backend {
    pub use sparsekit_host::backend::*;
}
mod error {
    pub use sparsekit_host::error::*;
}
mod ops {
    pub use sparsekit_host::ops::*;
}
mod layout {
    pub use sparsekit_host::layout::*;
}
mod cpu {
    pub use sparsekit_host::cpu::*;
}

/// ...and `crate::sync` onto shuttle (std outside a shuttle execution, for the module
/// tree's own unit tests that get compiled in here too).
mod sync {
    use std::fmt;
    use std::ops::{Deref, DerefMut};
    use std::time::{Duration, Instant};

    pub use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

    fn in_shuttle() -> bool {
        shuttle::current::try_get_current_task().is_some()
    }

    pub enum Mutex<T> {
        Shuttle(shuttle::sync::Mutex<T>),
        Std(std::sync::Mutex<T>),
    }

    pub enum Inner<'a, T> {
        Shuttle(shuttle::sync::MutexGuard<'a, T>),
        Std(std::sync::MutexGuard<'a, T>),
    }

    pub struct MutexGuard<'a, T>(Option<Inner<'a, T>>);

    impl<T> Mutex<T> {
        pub fn new(t: T) -> Self {
            if in_shuttle() {
                Mutex::Shuttle(shuttle::sync::Mutex::new(t))
            } else {
                Mutex::Std(std::sync::Mutex::new(t))
            }
        }
        pub fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard(Some(match self {
                Mutex::Shuttle(m) => Inner::Shuttle(m.lock().unwrap_or_else(|p| p.into_inner())),
                Mutex::Std(m) => Inner::Std(m.lock().unwrap_or_else(|p| p.into_inner())),
            }))
        }
        /// Shuttle has no timed lock; a lock that would only end by its timeout is a
        /// deadlock shuttle reports.
        pub fn try_lock_until(&self, _deadline: Instant) -> Option<MutexGuard<'_, T>> {
            Some(self.lock())
        }
    }

    impl<T: fmt::Debug> fmt::Debug for Mutex<T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Mutex")
        }
    }

    impl<T> Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            match self.0.as_ref() {
                Some(Inner::Shuttle(g)) => g,
                Some(Inner::Std(g)) => g,
                None => unreachable!("guard taken"),
            }
        }
    }
    impl<T> DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            match self.0.as_mut() {
                Some(Inner::Shuttle(g)) => g,
                Some(Inner::Std(g)) => g,
                None => unreachable!("guard taken"),
            }
        }
    }
    impl<T: fmt::Debug> fmt::Debug for MutexGuard<'_, T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("MutexGuard")
        }
    }

    pub enum Condvar {
        Shuttle(shuttle::sync::Condvar),
        Std(std::sync::Condvar),
    }

    pub struct WaitTimeoutResult(bool);
    impl WaitTimeoutResult {
        pub fn timed_out(&self) -> bool {
            self.0
        }
    }

    impl fmt::Debug for Condvar {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Condvar")
        }
    }

    impl Condvar {
        pub fn new() -> Self {
            if in_shuttle() {
                Condvar::Shuttle(shuttle::sync::Condvar::new())
            } else {
                Condvar::Std(std::sync::Condvar::new())
            }
        }
        pub fn wait_until<T>(
            &self,
            g: &mut MutexGuard<'_, T>,
            deadline: Instant,
        ) -> WaitTimeoutResult {
            let inner = g.0.take().expect("guard");
            let (back, timed_out) = match (self, inner) {
                (Condvar::Shuttle(cv), Inner::Shuttle(guard)) => (
                    Inner::Shuttle(cv.wait(guard).unwrap_or_else(|p| p.into_inner())),
                    false,
                ),
                (Condvar::Std(cv), Inner::Std(guard)) => {
                    let d = deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_micros(1));
                    let (guard, r) = cv.wait_timeout(guard, d).unwrap_or_else(|p| p.into_inner());
                    (Inner::Std(guard), r.timed_out())
                }
                _ => panic!("condvar and mutex from different worlds"),
            };
            g.0 = Some(back);
            WaitTimeoutResult(timed_out)
        }
        pub fn notify_all(&self) {
            match self {
                Condvar::Shuttle(cv) => cv.notify_all(),
                Condvar::Std(cv) => cv.notify_all(),
            }
        }
    }

    shuttle::thread_local! {
        static HELD_LAYERS: std::cell::Cell<u32> = std::cell::Cell::new(0);
    }
    thread_local! {
        static STD_HELD_LAYERS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    pub fn held_layers() -> u32 {
        if in_shuttle() {
            HELD_LAYERS.with(|h| h.get())
        } else {
            STD_HELD_LAYERS.with(|h| h.get())
        }
    }
    pub fn add_held_layers(delta: i32) {
        if in_shuttle() {
            HELD_LAYERS.with(|h| h.set(h.get().saturating_add_signed(delta)))
        } else {
            STD_HELD_LAYERS.with(|h| h.set(h.get().saturating_add_signed(delta)))
        }
    }

    pub enum JoinHandle {
        Shuttle(shuttle::thread::JoinHandle<()>),
        Std(std::thread::JoinHandle<()>),
    }
    impl JoinHandle {
        pub fn join(self) -> std::thread::Result<()> {
            match self {
                JoinHandle::Shuttle(h) => h.join(),
                JoinHandle::Std(h) => h.join(),
            }
        }
    }

    pub fn spawn<F: FnOnce() + Send + 'static>(name: &str, f: F) -> std::io::Result<JoinHandle> {
        if in_shuttle() {
            Ok(JoinHandle::Shuttle(shuttle::thread::spawn(f)))
        } else {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map(JoinHandle::Std)
        }
    }
}

#[allow(dead_code, unused_imports)]
#[path = "../src/cache/mod.rs"]
mod cache;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cache::{CacheConfig, CacheSpec, HiCache};
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, SparseMla, Topk,
};
use sparsekit_host::{Backend, CpuBackend, Error, Result};

const PAGE: usize = 2;
const LAYERS: usize = 2;

/// CPU backend whose next `fail` copies fail (no blocking: shuttle-safe).
#[derive(Debug)]
struct Failing {
    inner: CpuBackend,
    fail: AtomicU32,
}

macro_rules! delegate {
    ($($name:ident($($a:ident: $t:ty),*) -> $r:ty;)*) => {
        $(fn $name(&self, $($a: $t),*) -> $r { self.inner.$name($($a),*) })*
    };
}

impl Backend for Failing {
    type Buffer = <CpuBackend as Backend>::Buffer;
    fn name(&self) -> &str {
        "failing-cpu"
    }
    delegate! {
        upload(b: &[u8]) -> Result<Self::Buffer>;
        alloc(n: usize) -> Result<Self::Buffer>;
        alloc_host(n: usize) -> Result<Self::Buffer>;
        download(b: &Self::Buffer) -> Result<Vec<u8>>;
        buffer_len(b: &Self::Buffer) -> usize;
        index_k_store(op: &IndexKStore<'_>, k: &Self::Buffer, c: &mut Self::Buffer) -> Result<()>;
        kv_store(op: &KvStore<'_>, k: &Self::Buffer, c: &mut Self::Buffer) -> Result<()>;
        indexer_logits(op: &IndexerLogits<'_>, q: &Self::Buffer, w: &Self::Buffer, c: &Self::Buffer, o: &mut Self::Buffer) -> Result<()>;
        topk(op: &Topk<'_>, l: &Self::Buffer, o: &mut Self::Buffer) -> Result<()>;
        sparse_mla(op: &SparseMla, q: &Self::Buffer, c: &Self::Buffer, i: &Self::Buffer, o: &mut Self::Buffer, l: &mut Self::Buffer) -> Result<()>;
        page_checksums(op: &PageChecksums<'_>, p: &Self::Buffer, o: &mut Self::Buffer) -> Result<()>;
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
        if self
            .fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(Error::Device("injected copy failure".into()));
        }
        self.inner.copy_pages(op, s, d)
    }
}

fn spec() -> CacheSpec {
    CacheSpec::new(
        KvLayout::new(KvDtype::Bf16, 32, 16, PAGE).unwrap(),
        IndexKLayout::new(IndexKDtype::FP8, 32, PAGE).unwrap(),
        LAYERS,
    )
    .unwrap()
}

/// Each token's bytes: a function of the token prefix and the layer.
fn content(tokens: &[u32], layer: usize, n: usize) -> Vec<u8> {
    let h = tokens.iter().fold(layer as u64 + 7, |h, &t| {
        h.wrapping_mul(31).wrapping_add(t as u64)
    });
    (0..n)
        .map(|i| half::bf16::from_f32(((h as usize + i) % 17) as f32 - 8.0))
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// One request: begin, read and check the prefix, compute the rest, commit (or abort).
/// Returns whether it read the cached prefix; errors must be typed ones.
#[allow(clippy::needless_range_loop)] // `l` is the layer of the guard and of `want`
fn request(c: &HiCache<Failing>, req: u64, toks: &[u32], want: &[Vec<Vec<u8>>], may_fail: bool) {
    let prefix = match c.begin(req, toks) {
        Ok(p) => p,
        Err(e) => panic!("begin: {e:?}"),
    };
    let end = |ok: bool| {
        let r = if ok { c.finish(req) } else { c.abort(req) };
        if let Err(e) = r {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
        }
    };
    let need = toks.len().div_ceil(PAGE) - prefix.pages.len();
    let own = match c.alloc(req, need) {
        Ok(p) => p,
        Err(e) => {
            assert!(
                matches!(e, Error::InvalidArgument { .. } | Error::OutOfPages { .. }),
                "{e:?}"
            );
            return end(false);
        }
    };
    let mut pages = prefix.pages.clone();
    pages.extend(&own);
    let spec = *c.spec();
    let res = (|| -> Result<()> {
        let mut step = c.step(&[req])?;
        for l in 0..LAYERS {
            let mut g = step.wait_layer(l)?;
            let (kv, _) = g.views()?;
            let bytes = c.backend().download(kv)?;
            let region = c.device_region(cache::BufferKind::Kv);
            for (i, p) in prefix.pages.iter().enumerate() {
                let got = &bytes[region.page_range(p.id as usize)];
                // An aborted member's reads are no longer fenced: its results are dropped.
                assert!(
                    g.is_aborted(req) || want[l][i] == got,
                    "request {req} read unlanded bytes at layer {l} page {i} ({p:?}, {prefix:?})"
                );
            }
            let from = prefix.tokens;
            if from < toks.len() {
                let slots: Vec<cache::SlotRef> = (from..toks.len())
                    .map(|p| cache::SlotRef {
                        page: pages[p / PAGE],
                        offset: (p % PAGE) as u32,
                    })
                    .collect();
                let kv: Vec<u8> = (from..toks.len())
                    .flat_map(|p| content(&toks[..=p], l, spec.kv.d_qk()))
                    .collect();
                g.kv_store(&slots, &c.backend().upload(&kv)?)?;
                let ik: Vec<u8> = (from..toks.len())
                    .flat_map(|p| content(&toks[..=p], l + 100, spec.index_k.head_dim()))
                    .collect();
                g.index_k_store(&slots, &c.backend().upload(&ik)?)?;
            }
        }
        Ok(())
    })();
    match res {
        Ok(()) => {
            let r = c.commit(req, toks, &pages);
            if let Err(e) = &r {
                assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
            }
            end(r.is_ok());
        }
        Err(e) => {
            // Only this request's own abort cancels its work (a load it shares with
            // another request goes on); a copy failure only where one was injected.
            let aborted = !c.is_live(req);
            match &e {
                Error::InvalidArgument { .. } => assert!(aborted, "{e:?}"),
                Error::RequestFailed { cause, .. } => match **cause {
                    Error::Cancelled(_) => {
                        assert!(aborted, "request {req} cancelled by another request: {e:?}")
                    }
                    Error::Device(_) => assert!(may_fail, "{e:?}"),
                    _ => panic!("{e:?}"),
                },
                _ => panic!("{e:?}"),
            }
            end(false);
        }
    }
}

fn scenario(fail_copies: u32, abort_first: bool) {
    let backend = Arc::new(Failing {
        inner: CpuBackend::new(),
        fail: AtomicU32::new(0),
    });
    let mut cfg = CacheConfig::new(6, 6);
    cfg.max_backup_batch = 2;
    let c = Arc::new(HiCache::new(backend.clone(), spec(), cfg).unwrap());
    let a: Vec<u32> = (0..(2 * PAGE) as u32).map(|t| t + 1).collect();
    // Setup: compute `a`, remember its KV pages per layer, move it to the host tier.
    request(&c, 1, &a, &[vec![], vec![]], false);
    let want: Vec<Vec<Vec<u8>>> = {
        let p = c.begin(100, &a).unwrap();
        assert_eq!(p.pages.len(), 2);
        let mut step = c.step(&[100]).unwrap();
        let region = c.device_region(cache::BufferKind::Kv);
        let w = (0..LAYERS)
            .map(|l| {
                let g = step.wait_layer(l).unwrap();
                let bytes = c.backend().download(g.views().unwrap().0).unwrap();
                p.pages
                    .iter()
                    .map(|q| bytes[region.page_range(q.id as usize)].to_vec())
                    .collect()
            })
            .collect();
        drop(step);
        c.finish(100).unwrap();
        w
    };
    assert_eq!(c.evict_device(2).unwrap(), 2);
    backend.fail.store(fail_copies, Ordering::SeqCst);
    // Concurrently: two requests on the host-only prefix (the second shares the first's
    // load), and an abort of the first from a third thread.
    let mut b = a.clone();
    b.push(99);
    let threads: Vec<_> = [(2u64, a.clone()), (3, b)]
        .into_iter()
        .map(|(req, toks)| {
            let (c, want) = (c.clone(), want.clone());
            shuttle::thread::spawn(move || request(&c, req, &toks, &want, fail_copies > 0))
        })
        .collect();
    let c2 = c.clone();
    let aborter = shuttle::thread::spawn(move || {
        let _ = c2.abort(2);
        if abort_first {
            let _ = c2.abort(3);
        }
    });
    for t in threads {
        t.join().unwrap();
    }
    aborter.join().unwrap();
    c.wait_idle().unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!(
        (s.device_in_use, s.device_quarantined, s.live_requests),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.device_free + s.device_cached, 6, "{s:?}");
}

#[test]
fn begin_load_share_fail_abort_protocol() {
    let seed = common::seed("cache_shuttle");
    let iters: usize = std::env::var("SPARSEKIT_SHUTTLE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    shuttle::check_random_with_seed(
        move || {
            scenario(0, false);
        },
        seed,
        iters,
    );
    shuttle::check_random_with_seed(|| scenario(1, false), seed ^ 1, iters);
    shuttle::check_random_with_seed(|| scenario(0, true), seed ^ 2, iters);
}
