//! Concurrent randomized model test of the hierarchical cache. Several threads run
//! request lifecycles (begin / alloc / step / commit / finish, aborts at random points,
//! evictions) over shared prefixes, another thread aborts random live requests at any
//! time, and the io worker's copies are slowed, failed and made to panic at random. After
//! every operation of every thread:
//! - no request ever reads bytes other than what was computed for its tokens (every
//!   prefix page is checked against the first computation, every recomputation too);
//! - `leak_check` passes (pages, pins, quarantine, node locks, live paths);
//! - the operation returned within its bound (the cache's `wait_timeout` plus slack).
//!
//! The seed is printed; `SPARSEKIT_SEED=<seed>` replays the same random choices (thread
//! interleavings still vary). `SPARSEKIT_MODEL_STEPS` sets the lifecycles per thread.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{prompt, seed, spec, Expect, Flaky, PAGE};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparsekit_host::cache::{CacheConfig, HiCache, HostLayout};
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_host::Error;

const WORKERS: usize = 3;
const WAIT: Duration = Duration::from_millis(1500);
/// An operation may take its bound plus this much (scheduling on a loaded 2-core box).
const SLACK: Duration = Duration::from_secs(4);

struct World {
    cache: HiCache<Flaky>,
    expect: Expect,
    live: Mutex<Vec<u64>>,
    next_req: AtomicU64,
    ops: AtomicU64,
    done: AtomicBool,
}

impl World {
    /// Runs one cache operation: checks its duration and the whole bookkeeping after it.
    fn op<T>(&self, what: &str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        let took = t.elapsed();
        assert!(took <= WAIT + SLACK, "{what} blocked for {took:?}");
        if let Err(e) = self.cache.leak_check() {
            panic!("after {what}: {e}");
        }
        self.ops.fetch_add(1, Ordering::Relaxed);
        r
    }
}

/// Errors a correct cache may return under this workload (aborted from elsewhere, device
/// full of locked pages, an injected io failure or panic, a bound hit).
fn acceptable(e: &Error) -> bool {
    match e {
        Error::InvalidArgument { detail, .. } => detail.contains("not live"),
        Error::OutOfPages { .. } | Error::Timeout { .. } => true,
        Error::RequestFailed { cause, .. } => matches!(
            **cause,
            Error::Cancelled(_)
                | Error::Device(_)
                | Error::Timeout { .. }
                | Error::Integrity {
                    what: "host→device",
                    ..
                }
        ),
        _ => false,
    }
}

fn tokens(rng: &mut ChaCha8Rng) -> Vec<u32> {
    let family = rng.gen_range(0..5u32);
    let mut t = prompt(family + 1, 2 * PAGE + rng.gen_range(0..PAGE));
    if rng.gen_bool(0.5) {
        t.extend(prompt(
            10 + rng.gen_range(0..4u32),
            rng.gen_range(1..2 * PAGE),
        ));
    }
    t
}

fn lifecycle(w: &World, rng: &mut ChaCha8Rng) {
    let c = &w.cache;
    let req = w.next_req.fetch_add(1, Ordering::Relaxed);
    let toks = tokens(rng);
    let prefix = match w.op("begin", || c.begin(req, &toks)) {
        Ok(p) => p,
        Err(e) => {
            assert!(acceptable(&e), "begin: {e:?}");
            return;
        }
    };
    w.live.lock().unwrap().push(req);
    let end = |abort: bool| {
        let r = w.op("finish/abort", || {
            if abort {
                c.abort(req)
            } else {
                c.finish(req)
            }
        });
        if let Err(e) = r {
            assert!(acceptable(&e), "end: {e:?}");
        }
        w.live.lock().unwrap().retain(|&r| r != req);
    };
    if rng.gen_bool(0.08) {
        return end(true);
    }
    let need = toks.len().div_ceil(PAGE) - prefix.pages.len();
    let fresh = match w.op("alloc", || c.alloc(req, need)) {
        Ok(p) => p,
        Err(e) => {
            assert!(acceptable(&e), "alloc: {e:?}");
            return end(true);
        }
    };
    let mut pages = prefix.pages.clone();
    pages.extend(&fresh);
    let computed = w.op("step", || {
        let mut step = match c.step(&[req]) {
            Ok(s) => s,
            Err(e) => return Err(e),
        };
        let r = w.expect.forward(c, &mut step, &toks, &prefix, &pages);
        match r {
            // An aborted member's results are dropped (as the engine would): its reads
            // skipped the fences it no longer waits for.
            Err(_) if step.is_aborted(req) => Err(Error::InvalidArgument {
                what: "request",
                detail: format!("{req} is not live (aborted mid-step)"),
            }),
            other => other,
        }
    });
    if let Err(e) = computed {
        assert!(acceptable(&e), "request {req} step: {e:?}");
        return end(true);
    }
    if rng.gen_bool(0.1) {
        return end(true);
    }
    if let Err(e) = w.op("commit", || c.commit(req, &toks, &pages)) {
        assert!(acceptable(&e), "commit: {e:?}");
        return end(true);
    }
    if rng.gen_bool(0.15) {
        let n = rng.gen_range(1..4);
        if let Err(e) = w.op("evict", || c.evict_device(n)) {
            assert!(
                matches!(
                    e,
                    Error::Device(_) | Error::Cancelled(_) | Error::Timeout { .. }
                ),
                "evict: {e:?}"
            );
        }
    }
    end(rng.gen_bool(0.05));
}

#[test]
fn concurrent_requests_aborts_and_io_faults_never_serve_wrong_bytes() {
    let seed = seed("cache_model");
    let steps: usize = std::env::var("SPARSEKIT_MODEL_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(800);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (backend, ctl) = Flaky::new();
    ctl.seed(seed);
    ctl.fail_per_mille.store(15, Ordering::Relaxed);
    ctl.panic_per_mille.store(5, Ordering::Relaxed);
    ctl.max_delay_us.store(300, Ordering::Relaxed);
    ctl.random.store(true, Ordering::Relaxed);
    let mut cfg = CacheConfig::new(16, 48);
    cfg.wait_timeout = WAIT;
    cfg.write_through = rng.gen_bool(0.5);
    cfg.host_layout = if rng.gen_bool(0.5) {
        HostLayout::LayerFirst
    } else {
        HostLayout::PageFirst
    };
    cfg.max_backup_batch = rng.gen_range(1..8);
    let (kv, ik) = [
        (KvDtype::Bf16, IndexKDtype::Bf16),
        (KvDtype::Fp8DsMla, IndexKDtype::FP8),
    ][rng.gen_range(0..2)];
    eprintln!(
        "cache_model: {cfg:?} kv {kv:?} index-K {ik:?}, {steps} lifecycles x {WORKERS} threads"
    );
    let w = Arc::new(World {
        cache: HiCache::new(Arc::new(backend), spec(kv, ik), cfg).unwrap(),
        expect: Expect::default(),
        live: Mutex::new(Vec::new()),
        next_req: AtomicU64::new(1),
        ops: AtomicU64::new(0),
        done: AtomicBool::new(false),
    });
    let t0 = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|i| {
            let w = w.clone();
            let mut rng = ChaCha8Rng::seed_from_u64(
                seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            std::thread::spawn(move || {
                for _ in 0..steps {
                    lifecycle(&w, &mut rng);
                }
            })
        })
        .collect();
    let aborter = {
        let w = w.clone();
        let mut rng = ChaCha8Rng::seed_from_u64(seed.rotate_left(17));
        std::thread::spawn(move || {
            let mut aborts = 0u64;
            // One abort every 5..40 operations of the others (paced by their progress).
            let mut at = rng.gen_range(5..40u64);
            while !w.done.load(Ordering::Acquire) {
                if w.ops.load(Ordering::Relaxed) < at {
                    std::thread::yield_now();
                    continue;
                }
                at = w.ops.load(Ordering::Relaxed) + rng.gen_range(5..40u64);
                let victim = {
                    let live = w.live.lock().unwrap();
                    (!live.is_empty()).then(|| live[rng.gen_range(0..live.len())])
                };
                if let Some(r) = victim {
                    if w.op("abort (other thread)", || w.cache.abort(r)).is_ok() {
                        aborts += 1;
                    }
                }
                std::thread::yield_now();
            }
            aborts
        })
    };
    let mut failed = None;
    for h in workers {
        if let Err(p) = h.join() {
            failed.get_or_insert(p);
        }
    }
    w.done.store(true, Ordering::Release);
    let aborts = aborter.join().unwrap();
    if let Some(p) = failed {
        eprintln!("cache_model: FAILED with seed {seed} (replay with SPARSEKIT_SEED={seed})");
        std::panic::resume_unwind(p);
    }
    ctl.random.store(false, Ordering::Relaxed);
    for r in w.live.lock().unwrap().drain(..) {
        let _ = w.cache.abort(r);
    }
    w.cache.wait_idle().unwrap();
    let s = w.cache.leak_check().unwrap();
    eprintln!(
        "cache_model: {} ops in {:.1?}, {aborts} aborts from another thread, {} copies\n{s:#?}",
        w.ops.load(Ordering::Relaxed),
        t0.elapsed(),
        ctl.copies.load(Ordering::Relaxed)
    );
    assert_eq!(
        (s.device_in_use, s.device_quarantined, s.live_requests),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.device_free + s.device_cached, s.device_pages);
    assert_eq!(s.host_free + s.host_cached, s.host_pages);
    assert!(
        s.loads > 0 && s.backups > 0,
        "the workload reached the host tier: {s:?}"
    );
    assert!(w.expect.hits_checked.load(Ordering::Relaxed) > 0);
}
