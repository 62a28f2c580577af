//! The hierarchical cache on the CPU backend: round trips through the host tier, integrity
//! checks, fences, generations, accounting, one regression test per defect of issue 7, and
//! one test per fault injection showing the check that catches it (and that, without the
//! check, the corruption is real). Concurrency is driven by threads, a copy gate and
//! bounded waits, never by sleeps.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use common::{
    cache, cache_on, prompt, read_pages, source, spec, store_layer, Expect, Flaky, BOUND, LAYERS,
    PAGE,
};
use sparsekit_host::cache::{BufferKind, CacheConfig, Fault, Faults, HiCache, HostLayout, SlotRef};
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_host::{Backend, EmuBackend, Error};

const BF: (KvDtype, IndexKDtype) = (KvDtype::Bf16, IndexKDtype::Bf16);

/// Runs `f` on a thread and waits for it at most `BOUND` (a deadlock fails the test
/// instead of hanging it).
fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(BOUND).expect("blocked past its bound")
}

/// A flaky-backend cache whose prefix `a` (2 pages) is cached only in the host tier.
fn host_only_prefix(
    cfg: CacheConfig,
) -> (
    Arc<HiCache<Flaky>>,
    Arc<common::FlakyCtl>,
    Arc<Expect>,
    Vec<u32>,
) {
    let (b, ctl) = Flaky::new();
    let c = Arc::new(cache_on(b, spec(BF.0, BF.1), cfg));
    let e = Arc::new(Expect::default());
    let a = prompt(1, 2 * PAGE);
    assert_eq!(e.request(&*c, 1, &a, false).unwrap(), 0);
    assert_eq!(c.evict_device(2).unwrap(), 2);
    // Another request leaves its own bytes in the freed device pages.
    e.request(&*c, 9, &prompt(9, 2 * PAGE), true).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.host_cached, s.device_cached), (2, 0), "{s:?}");
    (c, ctl, e, a)
}

#[test]
fn prefix_reuse_through_the_host_tier_is_bit_exact() {
    for kv in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
        for ik in [IndexKDtype::FP8, IndexKDtype::Bf16] {
            for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
                let mut cfg = CacheConfig::new(6, 16);
                cfg.host_layout = layout;
                let c = cache(spec(kv, ik), cfg);
                let e = Expect::default();
                let a = prompt(1, 4 * PAGE + 2);
                assert_eq!(e.request(&c, 1, &a, false).unwrap(), 0);
                // A different prompt fills the device and pushes `a` to the host tier
                // (the allocation waits for the backups: backpressure).
                assert_eq!(e.request(&c, 2, &prompt(2, 5 * PAGE), false).unwrap(), 0);
                let s = c.leak_check().unwrap();
                assert!(s.backups > 0 && s.host_cached > 0, "{s:?}");
                // `a` again: its 4 full pages come back from the host, verified.
                assert_eq!(e.request(&c, 3, &a, false).unwrap(), 4 * PAGE);
                let s = c.leak_check().unwrap();
                assert_eq!(s.hits_host_pages + s.hits_device_pages, 4, "{s:?}");
                assert!(s.hits_host_pages >= 3, "{s:?}");
                assert!(e.hits_checked.load(Ordering::Relaxed) >= 4 * LAYERS as u64);
                assert_eq!((s.device_in_use, s.device_quarantined), (0, 0));
            }
        }
    }
}

#[test]
fn verification_can_be_turned_off_for_benchmarks() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.verify = false;
    let c = cache(spec(BF.0, BF.1), cfg);
    let e = Expect::default();
    let a = prompt(1, 3 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    c.evict_device(3).unwrap();
    assert_eq!(e.request(&c, 2, &a, false).unwrap(), 3 * PAGE);
    c.leak_check().unwrap();
}

/// Defect 1: a request matching a prefix whose load is in flight shares that load's
/// fence: it cannot read before the bytes landed, and then reads the committed bytes.
#[test]
fn d1_a_second_request_on_an_in_flight_load_waits_for_it() {
    let (c, ctl, e, a) = host_only_prefix(CacheConfig::new(4, 8));
    ctl.close_gate();
    let p2 = c.begin(2, &a).unwrap();
    assert_eq!(p2.loaded_pages, 2);
    ctl.wait_held(1);
    let p3 = c.begin(3, &a).unwrap();
    assert_eq!(
        (p3.loaded_pages, p3.shared_in_flight_pages, &p3.pages),
        (0, 2, &p2.pages),
        "request 3 shares request 2's load"
    );
    let step = c.step(&[3]).unwrap();
    assert!(!step.ready(0).unwrap() && !step.ready(LAYERS - 1).unwrap());
    drop(step);
    let (c2, e2, a2, p3c) = (c.clone(), e.clone(), a.clone(), p3.clone());
    let reader = std::thread::spawn(move || {
        let mut step = c2.step(&[3]).unwrap();
        let pages = p3c.pages.clone();
        e2.forward(&c2, &mut step, &a2, &p3c, &pages)
    });
    ctl.open_gate();
    reader
        .join()
        .unwrap()
        .expect("request 3 read the committed bytes");
    c.finish(3).unwrap();
    c.finish(2).unwrap();
    c.wait_idle().unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.hits_in_flight_pages, s.loads), (2, 1), "{s:?}");
    assert_eq!(s.device_cached, 2, "the landed pages stay cached: {s:?}");
}

/// Defect 2: a failed load never frees pages a live request still holds. Two live
/// requests share a load that fails its integrity check; one of them has its own pages
/// and an open step. Their waits fail with a typed error, their paths stay (leak_check),
/// the step's pages stay quarantined until it ends, and no other request gets any of them.
#[test]
fn d2_a_failed_load_frees_nothing_a_live_request_holds() {
    let mut cfg = CacheConfig::new(8, 8);
    cfg.faults = Faults::with(&[Fault::HostBitFlip]);
    let (c, ctl, _e, a) = host_only_prefix(cfg);
    ctl.close_gate();
    let p2 = c.begin(2, &a).unwrap();
    let mut long = a.clone();
    long.extend(prompt(3, PAGE + 1));
    let p3 = c.begin(3, &long).unwrap();
    assert_eq!(p3.shared_in_flight_pages, 2);
    let own3 = c.alloc(3, 2).unwrap();
    let step3 = c.step(&[3]).unwrap();
    ctl.open_gate();
    let err = step3.wait(LAYERS - 1).unwrap_err();
    assert!(
        matches!(&err, Error::RequestFailed { request: 3, cause } if matches!(**cause, Error::Integrity { .. })),
        "{err:?}"
    );
    let s = c.leak_check().unwrap();
    assert_eq!(s.integrity_failures, 1);
    assert_eq!(
        s.host_cached, 0,
        "failed host copies are dropped, never served"
    );
    assert_eq!(
        s.device_quarantined, 2,
        "the step still pins the failed pages: {s:?}"
    );
    // Request 4 takes every free page: none is request 3's or pinned by its step.
    c.begin(4, &[]).unwrap();
    let got = c.alloc(4, s.device_free).unwrap();
    for p in &got {
        assert!(
            !own3.contains(p) && !p2.pages.iter().any(|q| q.id == p.id),
            "{p:?}"
        );
    }
    c.leak_check().unwrap();
    assert!(matches!(
        c.commit(3, &long, &[p3.pages.clone(), own3].concat()),
        Err(Error::InvalidArgument { .. } | Error::RequestFailed { .. })
    ));
    drop(step3);
    assert_eq!(c.stats().device_quarantined, 0);
    for r in [2, 3, 4] {
        c.abort(r).unwrap();
        c.leak_check().unwrap();
    }
    let s = c.leak_check().unwrap();
    assert_eq!(s.device_free + s.device_cached, 8, "{s:?}");
    // Nothing of the failed prefix is served again.
    assert_eq!(c.begin(5, &a).unwrap().tokens, 0);
}

/// Defect 3: a panic in the io worker fails the load's waiters within the bound (typed),
/// leaves no node serving unloaded pages, poisons nothing; the next load works.
#[test]
fn d3_a_panicking_io_job_fails_its_waiters_and_the_cache_goes_on() {
    let (c, ctl, e, a) = host_only_prefix(CacheConfig::new(4, 8));
    ctl.panic_next.store(1, Ordering::SeqCst);
    c.begin(2, &a).unwrap();
    let c2 = c.clone();
    let err = bounded(move || c2.step(&[2]).and_then(|s| s.wait(0).map(|_| ())));
    let err = err.unwrap_err();
    assert!(
        matches!(&err, Error::RequestFailed { cause, .. } if matches!(&**cause, Error::Cancelled(m) if m.contains("panicked"))),
        "{err:?}"
    );
    // A later request does not get the unloaded pages as ready: it loads them again.
    let p = c.begin(3, &a).unwrap();
    assert_eq!((p.loaded_pages, p.shared_in_flight_pages), (2, 0));
    c.abort(3).unwrap();
    c.abort(2).unwrap();
    assert_eq!(e.request(&*c, 4, &a, false).unwrap(), 2 * PAGE);
    c.wait_idle().unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.load_failures, s.loads), (1, 1), "{s:?}");
}

/// A load cancelled after its last copy but before its last layer is published (its
/// only request aborted in that window) is a cancelled load: counted as one, its pages
/// not served, and the next request loads the prefix again, bit-exact.
#[test]
fn a_load_cancelled_after_its_last_copy_is_counted_cancelled_and_not_served() {
    let (c, ctl, e, a) = host_only_prefix(CacheConfig::new(4, 8));
    c.wait_idle().unwrap();
    // How many checksum calls one load's verification makes (the last one is the last
    // layer's).
    let before = ctl.io_checksums.load(Ordering::SeqCst);
    assert_eq!(c.begin(2, &a).unwrap().loaded_pages, 2);
    c.wait_idle().unwrap();
    let per_load = ctl.io_checksums.load(Ordering::SeqCst) - before;
    assert!(per_load >= LAYERS as u64, "{per_load}");
    c.abort(2).unwrap();
    assert_eq!(c.evict_device(2).unwrap(), 2);
    let s0 = c.leak_check().unwrap();
    assert_eq!((s0.loads, s0.cancelled_loads), (1, 0), "{s0:?}");

    // Hold the next load at its last verification: every copy done, last layer unpublished.
    ctl.checksum_gate.close();
    ctl.hold_checksum_nth.store(per_load, Ordering::SeqCst);
    let p = c.begin(3, &a).unwrap();
    assert_eq!(p.loaded_pages, 2);
    ctl.checksum_gate.wait_held(1);
    c.abort(3).unwrap();
    ctl.checksum_gate.open();
    c.wait_idle().unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.loads, s.cancelled_loads), (1, 1), "{s:?}");
    // Nothing of the cancelled load is served: the next request loads again, bit-exact.
    let p = c.begin(4, &a).unwrap();
    assert_eq!((p.loaded_pages, p.shared_in_flight_pages), (2, 0));
    c.abort(4).unwrap();
    assert_eq!(e.request(&*c, 5, &a, false).unwrap(), 2 * PAGE);
    c.wait_idle().unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!(s.load_failures, 0, "{s:?}");
}

/// Defect 4: holding a layer's guard (both views) while the io worker wants to write that
/// layer cannot deadlock: one lock per layer, never a second one.
#[test]
fn d4_both_views_of_a_layer_do_not_deadlock_against_the_io_worker() {
    let (c, _ctl, e, a) = host_only_prefix(CacheConfig::new(8, 8));
    let b = prompt(5, 2 * PAGE);
    e.request(&*c, 5, &b, false).unwrap();
    let (c2, e2) = (c.clone(), e.clone());
    bounded(move || {
        let p = c2.begin(6, &b).unwrap();
        assert_eq!(p.loaded_pages, 0);
        let mut step = c2.step(&[6]).unwrap();
        let g = step.wait_layer(0).unwrap();
        let (kv, ik) = g.views().unwrap();
        // The io worker now loads `a` and needs layer 0 for writing.
        let p7 = c2.begin(7, &a).unwrap();
        assert_eq!(p7.loaded_pages, 2);
        let (kv2, ik2) = g.views().unwrap();
        assert!(std::ptr::eq(kv, kv2) && std::ptr::eq(ik, ik2));
        drop(g);
        drop(step);
        c2.finish(6).unwrap();
        let mut step = c2.step(&[7]).unwrap();
        e2.forward(&c2, &mut step, &a, &p7, &p7.pages.clone())
            .unwrap();
        drop(step);
        c2.finish(7).unwrap();
    });
    c.leak_check().unwrap();
}

/// A thread holding a layer guard is never left blocked on the io worker (which may need
/// that layer): waiting for a load, for device room or for backups returns at once.
#[test]
fn a_guard_holder_never_blocks_on_the_io_worker() {
    let (c, _ctl, e, a) = host_only_prefix(CacheConfig::new(6, 8));
    let b = prompt(5, 2 * PAGE);
    e.request(&*c, 5, &b, false).unwrap();
    let (c2, e2) = (c.clone(), e.clone());
    bounded(move || {
        c2.begin(6, &b).unwrap();
        let mut s6 = c2.step(&[6]).unwrap();
        let g = s6.wait_layer(0).unwrap();
        let p7 = c2.begin(7, &a).unwrap();
        let s7 = c2.step(&[7]).unwrap();
        let t = std::time::Instant::now();
        let r = s7.wait(0);
        assert!(r.is_err_and(|e| matches!(e, Error::InvalidArgument { .. })));
        let r = c2.alloc(6, 6);
        assert!(matches!(r, Err(Error::OutOfPages { .. })), "{r:?}");
        assert!(matches!(
            c2.evict_device(1),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(c2.wait_idle(), Err(Error::InvalidArgument { .. })));
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "nothing waited for its bound"
        );
        drop(g);
        drop(s6);
        drop(s7);
        let mut s7 = c2.step(&[7]).unwrap();
        e2.forward(&c2, &mut s7, &a, &p7, &p7.pages.clone())
            .unwrap();
        drop(s7);
        c2.finish(6).unwrap();
        c2.finish(7).unwrap();
    });
    c.leak_check().unwrap();
}

/// Defect 5: readiness is a type. Tokens come only from a step's wait and only work on
/// that step; there is no unfenced read path without the cache being built with the
/// fault; stores need a current page reference the batch owns.
#[test]
fn d5_tokens_are_bound_to_their_step_and_stores_to_owned_current_pages() {
    let (c, ctl, _e, a) = host_only_prefix(CacheConfig::new(8, 8));
    c.begin(2, &prompt(2, 3)).unwrap();
    let own = c.alloc(2, 1).unwrap();
    c.begin(3, &prompt(3, 3)).unwrap();
    let other = c.alloc(3, 1).unwrap();
    let mut s2 = c.step(&[2]).unwrap();
    let s3 = c.step(&[3]).unwrap();
    let t3 = s3.wait(0).unwrap();
    assert!(
        matches!(s2.layer(t3), Err(Error::InvalidArgument { .. })),
        "foreign token"
    );
    let mut g = s2.wait_layer(0).unwrap();
    let kv = c
        .backend()
        .upload(&vec![0u8; c.spec().kv.d_qk() * 2])
        .unwrap();
    let slot = |page| [SlotRef { page, offset: 0 }];
    assert!(
        matches!(
            g.kv_store(&slot(other[0]), &kv),
            Err(Error::InvalidArgument { .. })
        ),
        "a page of a request outside the step"
    );
    let stale = sparsekit_host::cache::PageRef {
        generation: own[0].generation + 1,
        ..own[0]
    };
    assert!(matches!(
        g.kv_store(&slot(stale), &kv),
        Err(Error::StalePage { .. })
    ));
    assert!(matches!(
        g.kv_store(
            &[SlotRef {
                page: own[0],
                offset: PAGE as u32
            }],
            &kv
        ),
        Err(Error::InvalidArgument { .. })
    ));
    g.kv_store(&slot(own[0]), &kv).unwrap();
    // A page fills in token order: slot 2 before slot 1 would leave a gap nobody fills.
    let gap = [SlotRef {
        page: own[0],
        offset: 2,
    }];
    match g.kv_store(&gap, &kv) {
        Err(Error::RequestFailed { request: 2, cause }) => assert!(
            matches!(
                *cause,
                Error::Unwritten {
                    slot: 1,
                    filled: 1,
                    ..
                }
            ),
            "{cause:?}"
        ),
        other => panic!("a gap must be refused: {other:?}"),
    }
    drop(g);
    drop((s2, s3));
    assert_eq!(c.stats().stale_writes_refused, 1);
    // A load in flight: the step's layer is not ready and the bounded wait says so.
    ctl.close_gate();
    c.begin(4, &a).unwrap();
    let s4 = c.step(&[4]).unwrap();
    assert!(!s4.ready(0).unwrap());
    ctl.open_gate();
    s4.wait(LAYERS - 1).unwrap();
    drop(s4);
    for r in [2, 3, 4] {
        c.finish(r).unwrap();
    }
    c.leak_check().unwrap();
}

/// Every wait is bounded: a load held past `wait_timeout` gives `Timeout`, not a hang.
#[test]
fn waits_are_bounded() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.wait_timeout = std::time::Duration::from_millis(100);
    let (c, ctl, _e, a) = host_only_prefix(cfg);
    ctl.close_gate();
    c.begin(2, &a).unwrap();
    let c2 = c.clone();
    let r = bounded(move || c2.step(&[2]).and_then(|s| s.wait(0).map(|_| ())));
    assert!(
        matches!(&r, Err(Error::RequestFailed { cause, .. }) if matches!(**cause, Error::Timeout { .. })),
        "{r:?}"
    );
    // Device room that never comes: OutOfPages after the bound.
    c.begin(3, &[]).unwrap();
    let c3 = c.clone();
    let r = bounded(move || c3.alloc(3, 5));
    assert!(matches!(r, Err(Error::OutOfPages { .. })), "{r:?}");
    ctl.open_gate();
    c.abort(2).unwrap();
    c.abort(3).unwrap();
    c.leak_check().unwrap();
}

/// Defect 6: commit rejects the same page twice, a prefix page at another position, and
/// pages the request does not own, with typed errors and no change.
#[test]
fn d6_commit_checks_its_pages() {
    let c = cache(spec(BF.0, BF.1), CacheConfig::new(8, 0));
    let e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    let mut long = a.clone();
    long.extend(prompt(2, 2 * PAGE));
    let p = c.begin(2, &long).unwrap();
    assert_eq!(p.pages.len(), 2);
    let own = c.alloc(2, 2).unwrap();
    let before = c.leak_check().unwrap();
    let dup = [p.pages[0], p.pages[1], own[0], own[0]];
    assert!(matches!(
        c.commit(2, &long, &dup),
        Err(Error::DuplicatePage { .. })
    ));
    let swapped = [p.pages[1], p.pages[0], own[0], own[1]];
    assert!(matches!(
        c.commit(2, &long, &swapped),
        Err(Error::InvalidArgument { .. })
    ));
    let foreign = [p.pages[0], p.pages[1], own[0], p.pages[0]];
    assert!(c.commit(2, &long, &foreign).is_err());
    let bogus = sparsekit_host::cache::PageRef {
        generation: 77,
        ..own[1]
    };
    assert!(c
        .commit(2, &long, &[p.pages[0], p.pages[1], own[0], bogus])
        .is_err());
    let mut other = long.clone();
    other[0] += 1;
    assert!(
        matches!(
            c.commit(2, &other, &[p.pages[0], p.pages[1], own[0], own[1]]),
            Err(Error::InvalidArgument { .. })
        ),
        "tokens that are not the matched prefix"
    );
    assert_eq!(
        c.leak_check().unwrap(),
        before,
        "rejected commits change nothing"
    );
    c.abort(2).unwrap();
    c.leak_check().unwrap();
    assert_eq!(e.request(&c, 3, &long, false).unwrap(), 2 * PAGE);
    assert_eq!(e.request(&c, 4, &long, false).unwrap(), 4 * PAGE);
    c.leak_check().unwrap();
}

/// Defect 7: a backup whose copy fails frees the host pages it allocated.
#[test]
fn d7_a_failed_backup_frees_its_host_pages() {
    let (b, ctl) = Flaky::new();
    let c = cache_on(b, spec(BF.0, BF.1), CacheConfig::new(4, 8));
    let e = Expect::default();
    e.request(&c, 1, &prompt(1, 3 * PAGE), false).unwrap();
    ctl.fail_next.store(1, Ordering::SeqCst);
    let err = c.evict_device(3).unwrap_err();
    assert!(matches!(err, Error::Device(_)), "{err:?}");
    let s = c.leak_check().unwrap();
    assert_eq!((s.host_free, s.backup_failures), (8, 1), "{s:?}");
    // The eviction went ahead without a host copy; the device pages are free again.
    assert_eq!(s.device_free, 4, "{s:?}");
}

/// `host-pool-fp8-layout`: the mirror's index-K rows are sized fp8 under a bf16 device;
/// the descriptor check of every copy refuses it (and the backup frees its host pages).
#[test]
fn fault_host_pool_fp8_layout_is_refused_by_the_descriptor_check() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.faults = Faults::with(&[Fault::HostPoolFp8Layout]);
    let c = cache(spec(BF.0, BF.1), cfg);
    let host_page = c
        .host_region(0, BufferKind::IndexK)
        .unwrap()
        .layout
        .bytes_per_page();
    let dev_page = c.device_region(BufferKind::IndexK).layout.bytes_per_page();
    assert!(
        host_page < dev_page,
        "the fault really shrinks the host rows"
    );
    let e = Expect::default();
    e.request(&c, 1, &prompt(1, 3 * PAGE), false).unwrap();
    let err = c.evict_device(3).unwrap_err();
    assert!(matches!(err, Error::LayoutMismatch { .. }), "{err:?}");
    let s = c.leak_check().unwrap();
    assert_eq!(s.host_free, 8);
    // Without the fault the same sequence works.
    let c = cache(spec(BF.0, BF.1), CacheConfig::new(4, 8));
    Expect::default()
        .request(&c, 1, &prompt(1, 3 * PAGE), false)
        .unwrap();
    assert_eq!(c.evict_device(3).unwrap(), 3);
}

/// Polls `cond` until it holds or the test's bound passes (a bounded wait for another
/// thread to reach a state that only counters show).
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + BOUND;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {BOUND:?}"
        );
        std::thread::yield_now();
    }
}

/// `skip-index-wait`: the step hands out the layer without waiting for the load. The
/// guard's landed stamps see the pages have not landed: it releases the layer, waits
/// (bounded) for the load and serves the committed bytes (counted as a landing wait); a
/// load that does not land within the bound fails the request with `NotLanded`. With the
/// stamps also off (`no-landed-check`) the bytes read are not the committed ones (the
/// corruption is real); without the fault the same read waits at the fence and is right.
#[test]
fn fault_skip_index_wait_is_caught_by_the_landed_stamps() {
    for faults in [
        vec![Fault::SkipIndexWait],
        vec![Fault::SkipIndexWait, Fault::NoLandedCheck],
        vec![Fault::NoLandedCheck],
        vec![],
    ] {
        let mut cfg = CacheConfig::new(4, 8);
        cfg.faults = Faults::with(&faults);
        let (c, ctl, e, a) = host_only_prefix(cfg);
        ctl.gate_io_only
            .store(true, std::sync::atomic::Ordering::SeqCst);
        ctl.close_gate();
        let p = c.begin(2, &a).unwrap();
        ctl.wait_held(1);
        let skip = faults.contains(&Fault::SkipIndexWait);
        let stamps = !faults.contains(&Fault::NoLandedCheck);
        let (c2, e2, a2, p2) = (c.clone(), e.clone(), a.clone(), p.clone());
        let reader = std::thread::spawn(move || {
            let mut step = c2.step(&[2]).unwrap();
            let t = step.wait(LAYERS - 1)?;
            let g = step.layer(t)?;
            let got = read_pages(&*c2, &g, &p2.pages)?;
            Ok::<bool, Error>(e2.check(&a2, 0, LAYERS - 1, &got[0]).is_ok())
        });
        if skip && !stamps {
            let right = reader.join().unwrap().unwrap();
            assert!(
                !right,
                "without both checks the bytes read are not the committed ones"
            );
            ctl.open_gate();
        } else {
            if skip {
                eventually("the guard waits for the load", || {
                    c.stats().landing_waits == 1
                });
            }
            ctl.open_gate();
            assert!(
                reader.join().unwrap().unwrap(),
                "{faults:?}: the committed bytes"
            );
        }
        assert_eq!(
            c.stats().landing_waits,
            u64::from(skip && stamps),
            "{faults:?}"
        );
        c.abort(2).unwrap();
        c.wait_idle().unwrap();
        c.leak_check().unwrap();
    }
    // A load that never lands within the bound: the guard's wait runs out, NotLanded.
    let mut cfg = CacheConfig::new(4, 8);
    cfg.faults = Faults::with(&[Fault::SkipIndexWait]);
    cfg.wait_timeout = std::time::Duration::from_millis(200);
    let (c, ctl, _e, a) = host_only_prefix(cfg);
    ctl.gate_io_only
        .store(true, std::sync::atomic::Ordering::SeqCst);
    ctl.close_gate();
    c.begin(2, &a).unwrap();
    ctl.wait_held(1);
    let mut step = c.step(&[2]).unwrap();
    let t = step.wait(LAYERS - 1).unwrap();
    match step.layer(t) {
        Err(Error::RequestFailed { cause, .. }) => {
            assert!(
                matches!(*cause, Error::NotLanded { stamp: None, .. }),
                "{cause:?}"
            )
        }
        other => panic!("expected NotLanded, got {other:?}"),
    }
    drop(step);
    ctl.open_gate();
    c.abort(2).unwrap();
    c.wait_idle().unwrap();
    c.leak_check().unwrap();
}

/// `shared-item-size` (the KV page size used for index-K host copies) corrupts the host
/// tier in both layouts; load verification catches it, and with verification off the
/// corrupted bytes would be served.
#[test]
fn fault_shared_item_size_is_caught_by_checksums_in_every_layout() {
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        for verify in [true, false] {
            let mut cfg = CacheConfig::new(4, 8);
            cfg.host_layout = layout;
            cfg.verify = verify;
            cfg.faults = Faults::with(&[Fault::SharedItemSize]);
            let c = cache(spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16), cfg);
            let e = Expect::default();
            let a = prompt(1, 3 * PAGE);
            e.request(&c, 1, &a, false).unwrap();
            c.evict_device(3).unwrap();
            let err = e.request(&c, 2, &a, false).unwrap_err();
            let what = match &err {
                Error::RequestFailed { cause, .. } => match **cause {
                    Error::Integrity { what, .. } => what,
                    _ => panic!("{err:?}"),
                },
                Error::Integrity { what, .. } => what,
                _ => panic!("{layout:?} verify {verify}: {err:?}"),
            };
            assert_eq!(
                what,
                if verify {
                    "host→device"
                } else {
                    "served page"
                },
                "{layout:?}"
            );
            c.leak_check().unwrap();
        }
    }
}

/// `host-bit-flip`: host memory corruption after the backup; load checksums catch it (and
/// the failed pages are dropped and recomputed), without verification it is served.
#[test]
fn fault_host_bit_flip_is_caught_by_checksums() {
    for verify in [true, false] {
        let mut cfg = CacheConfig::new(4, 8);
        cfg.verify = verify;
        cfg.faults = Faults::with(&[Fault::HostBitFlip]);
        let c = cache(spec(KvDtype::Fp8DsMla, IndexKDtype::FP8), cfg);
        let e = Expect::default();
        let a = prompt(1, 3 * PAGE);
        e.request(&c, 1, &a, false).unwrap();
        c.evict_device(3).unwrap();
        let err = e.request(&c, 2, &a, false).unwrap_err();
        let cause = match err {
            Error::RequestFailed { cause, .. } => *cause,
            e => e,
        };
        if verify {
            assert!(
                matches!(cause, Error::Integrity { what: "host→device", layer, .. } if layer == LAYERS - 1),
                "{cause:?}"
            );
            let s = c.leak_check().unwrap();
            assert_eq!(
                (
                    s.integrity_failures,
                    s.host_integrity_failures,
                    s.host_cached
                ),
                (1, 1, 0)
            );
            assert_eq!(e.request(&c, 3, &a, false).unwrap(), 0, "recomputed");
        } else {
            assert!(
                matches!(
                    cause,
                    Error::Integrity {
                        what: "served page",
                        ..
                    }
                ),
                "{cause:?}"
            );
        }
        c.leak_check().unwrap();
    }
}

/// `no-generation-check`: a store through a stale reference to a page now owned by
/// another request of the batch. Refused by the generation check; with the fault, by the
/// written-slot check (the page's bytes are of the new generation); with both off the
/// other request reads corrupted bytes.
#[test]
fn fault_no_generation_check_is_caught_by_the_landed_stamps() {
    for faults in [
        vec![],
        vec![Fault::NoGenerationCheck],
        vec![Fault::NoGenerationCheck, Fault::NoLandedCheck],
    ] {
        let mut cfg = CacheConfig::new(4, 0);
        cfg.faults = Faults::with(&faults);
        let c = cache(spec(BF.0, BF.1), cfg);
        let spec = *c.spec();
        c.begin(1, &[]).unwrap();
        let stale = c.alloc(1, 1).unwrap()[0];
        c.abort(1).unwrap();
        let toks = prompt(2, PAGE);
        c.begin(2, &toks).unwrap();
        let fresh = c.alloc(2, 1).unwrap()[0];
        assert_eq!(fresh.id, stale.id);
        assert_ne!(fresh.generation, stale.generation);
        let mut step = c.step(&[2]).unwrap();
        let mut g = step.wait_layer(0).unwrap();
        store_layer(&mut g, c.backend(), &spec, &toks, &[fresh], 0).unwrap();
        let want = read_pages(&c, &g, &[fresh]).unwrap();
        // The late write for request 1.
        let junk = c
            .backend()
            .upload(&vec![0x3Cu8; PAGE * spec.kv.d_qk() * 2])
            .unwrap();
        let slots: Vec<SlotRef> = (0..PAGE as u32)
            .map(|offset| SlotRef {
                page: stale,
                offset,
            })
            .collect();
        let res = g.kv_store(&slots, &junk);
        match faults.len() {
            0 => {
                assert!(matches!(res, Err(Error::StalePage { .. })), "{res:?}");
                assert_eq!(
                    read_pages(&c, &g, &[fresh]).unwrap(),
                    want,
                    "request 2's page is intact"
                );
            }
            1 => {
                // The page holds request 2's bytes: a write for another generation is
                // refused by the written-slot check, whatever the allocator said.
                assert!(
                    matches!(
                        res,
                        Err(Error::StalePage {
                            what: "device (written slots)",
                            ..
                        })
                    ),
                    "{res:?}"
                );
                assert_eq!(
                    read_pages(&c, &g, &[fresh]).unwrap(),
                    want,
                    "request 2's page is intact"
                );
            }
            _ => {
                res.unwrap();
                assert_ne!(
                    read_pages(&c, &g, &[fresh]).unwrap(),
                    want,
                    "the stale write corrupted request 2's page"
                );
            }
        }
        drop(g);
        drop(step);
        c.finish(2).unwrap();
        c.leak_check().unwrap();
    }
}

/// Defect 9: aborting a request cancels its queued load (it never runs, its pages are
/// free at once) and stops a running one at the next layer (its pages quarantined until
/// then), while a load another request still waits for goes on.
#[test]
fn d9_abort_cancels_loads() {
    let (c, ctl, e, a) = host_only_prefix(CacheConfig::new(8, 8));
    let b = prompt(4, 2 * PAGE);
    e.request(&*c, 4, &b, false).unwrap();
    assert_eq!(c.evict_device(2).unwrap(), 2);
    ctl.close_gate();
    // Load of `b` for request 5 runs (held at the gate); `a` for request 2 queues behind.
    c.begin(5, &b).unwrap();
    ctl.wait_held(1);
    c.begin(2, &a).unwrap();
    c.begin(3, &a).unwrap(); // shares request 2's load
    c.abort(2).unwrap();
    assert_eq!(c.stats().cancelled_loads, 0, "request 3 still waits for it");
    let free_before = c.stats().device_free;
    c.abort(3).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!(s.cancelled_loads, 1, "{s:?}");
    assert_eq!(
        s.device_free,
        free_before + 2,
        "a queued load's pages are free at once"
    );
    // The running load: abort quarantines its pages until the worker stops.
    c.abort(5).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!(s.device_quarantined, 2, "{s:?}");
    let copies = ctl.copies.load(Ordering::SeqCst);
    ctl.open_gate();
    let t = std::time::Instant::now();
    while c.stats().device_quarantined > 0 {
        assert!(t.elapsed() < BOUND, "quarantine never lifted");
        std::thread::yield_now();
    }
    let s = c.leak_check().unwrap();
    assert_eq!((s.cancelled_loads, s.loads), (2, 0), "{s:?}");
    assert_eq!(s.device_free, 8, "{s:?}");
    assert_eq!(
        ctl.copies.load(Ordering::SeqCst),
        copies,
        "no load ran a layer after its abort"
    );
    // Host copies of cancelled loads stay valid.
    assert_eq!(e.request(&*c, 6, &a, false).unwrap(), 2 * PAGE);
    c.leak_check().unwrap();
}

/// Defect 9: backups run on the io worker, off the state mutex: while one is held in its
/// copy (of layer 0), begin / alloc / commit / finish / stats / leak_check all go on, and
/// so does a step on another layer (one lock per layer).
#[test]
fn d9_backups_do_not_block_the_hot_path() {
    let (b, ctl) = Flaky::new();
    let c = Arc::new(cache_on(b, spec(BF.0, BF.1), CacheConfig::new(8, 8)));
    let e = Arc::new(Expect::default());
    e.request(&*c, 1, &prompt(1, 3 * PAGE), false).unwrap();
    ctl.close_gate();
    let c2 = c.clone();
    let evictor = std::thread::spawn(move || c2.evict_device(3));
    ctl.wait_held(1);
    let c3 = c.clone();
    bounded(move || {
        let toks = prompt(2, 2 * PAGE + 1);
        assert_eq!(c3.begin(2, &toks).unwrap().tokens, 0);
        let pages = c3.alloc(2, 3).unwrap();
        {
            let mut step = c3.step(&[2]).unwrap();
            let spec = *c3.spec();
            let mut g = step.wait_layer(LAYERS - 1).unwrap();
            store_layer(&mut g, c3.backend(), &spec, &toks, &pages, 0).unwrap();
        }
        // Layer 0 is held by the backup, so the pages are not complete: commit says so.
        let r = c3.commit(2, &toks, &pages);
        assert!(matches!(r, Err(Error::NotLanded { layer: 0, .. })), "{r:?}");
        c3.finish(2).unwrap();
        c3.stats();
        c3.leak_check().unwrap();
    });
    ctl.open_gate();
    assert_eq!(evictor.join().unwrap().unwrap(), 3);
    let s = c.leak_check().unwrap();
    assert_eq!(s.backups, 3);
}

/// Write-through: committed pages are backed up without an eviction asking, so a later
/// eviction is immediate.
#[test]
fn write_through_backs_up_on_commit() {
    let mut cfg = CacheConfig::new(8, 8);
    cfg.write_through = true;
    let c = cache(spec(BF.0, BF.1), cfg);
    let e = Expect::default();
    e.request(&c, 1, &prompt(1, 3 * PAGE), false).unwrap();
    let t = std::time::Instant::now();
    while c.stats().backups < 3 {
        assert!(t.elapsed() < BOUND, "write-through backups never ran");
        std::thread::yield_now();
    }
    let s = c.leak_check().unwrap();
    assert_eq!((s.host_cached, s.device_cached), (3, 3));
    assert_eq!(c.evict_device(3).unwrap(), 3);
    assert_eq!(c.stats().backups, 3, "nothing copied twice");
    assert_eq!(
        e.request(&c, 2, &prompt(1, 3 * PAGE), false).unwrap(),
        3 * PAGE
    );
}

/// PD receive: layer readiness is published only when every page of the layer landed in
/// both kinds with matching checksums; reads then see exactly the sent bytes.
#[test]
fn inbound_publishes_a_layer_only_when_all_its_pages_landed() {
    let c = cache(
        spec(KvDtype::Fp8DsMla, IndexKDtype::FP8),
        CacheConfig::new(6, 0),
    );
    let b = c.backend();
    c.begin(1, &[]).unwrap();
    let pages = c.alloc(1, 3).unwrap();
    let mut rx = c.inbound(1, &pages).unwrap();
    let step = c.step(&[1]).unwrap();
    let ids: Vec<i32> = (0..3).collect();
    let mut sent = Vec::new();
    for l in 0..LAYERS {
        let (kv, kr, ks) = source(b, c.spec().kv, 3, 10 + l as u8);
        let (ik, ir, is) = source(b, c.spec().index_k, 3, 50 + l as u8);
        // KV first, index-K in two parts: not ready until the last part.
        rx.write(l, BufferKind::Kv, &pages, &kv, kr, &ids, &ks)
            .unwrap();
        assert!(!step.ready(l).unwrap() && !rx.is_layer_ready(l));
        rx.write(
            l,
            BufferKind::IndexK,
            &pages[..2],
            &ik,
            ir,
            &ids[..2],
            &is[..2],
        )
        .unwrap();
        assert!(!step.ready(l).unwrap());
        rx.write(
            l,
            BufferKind::IndexK,
            &pages[2..],
            &ik,
            ir,
            &ids[2..],
            &is[2..],
        )
        .unwrap();
        assert!(step.ready(l).unwrap() && rx.is_layer_ready(l));
        sent.push((b.download(&kv).unwrap(), b.download(&ik).unwrap()));
    }
    rx.complete().unwrap();
    let mut step = step;
    for (l, (kv, ik)) in sent.iter().enumerate() {
        let g = step.wait_layer(l).unwrap();
        let got = read_pages(&c, &g, &pages).unwrap();
        for (i, got) in got.iter().enumerate() {
            let pk = c.spec().kv.bytes_per_page();
            let pi = c.spec().index_k.bytes_per_page();
            assert_eq!(got[0], kv[i * pk..(i + 1) * pk]);
            assert_eq!(got[1], ik[i * pi..(i + 1) * pi]);
        }
    }
    drop(step);
    c.finish(1).unwrap();
    c.leak_check().unwrap();
}

/// PD receive failures: a checksum mismatch fails the transfer; a page that is not a
/// target is refused; a dropped handle fails the request's readers; nothing leaks.
#[test]
fn inbound_failures_are_typed_and_contained() {
    let c = cache(spec(BF.0, BF.1), CacheConfig::new(6, 0));
    let b = c.backend();
    let ids: Vec<i32> = (0..2).collect();
    let (kv, kr, mut ks) = source(b, c.spec().kv, 2, 1);
    c.begin(1, &[]).unwrap();
    let pages = c.alloc(1, 2).unwrap();
    let other = c.alloc(1, 1).unwrap();
    let mut rx = c.inbound(1, &pages).unwrap();
    assert!(
        matches!(c.inbound(1, &pages), Err(Error::InvalidArgument { .. })),
        "one transfer at a time"
    );
    assert!(matches!(
        rx.write(0, BufferKind::Kv, &other, &kv, kr, &ids[..1], &ks[..1]),
        Err(Error::InvalidArgument { .. })
    ));
    ks[1] ^= 1;
    let err = rx
        .write(0, BufferKind::Kv, &pages, &kv, kr, &ids, &ks)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "inbound",
                ..
            }
        ),
        "{err:?}"
    );
    let r = c.step(&[1]).map(|_| ());
    assert!(
        matches!(r, Err(Error::RequestFailed { request: 1, .. })),
        "{r:?}"
    );
    drop(rx);
    c.abort(1).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.integrity_failures, s.host_integrity_failures), (1, 0));
    // A dropped (never completed) handle fails a waiting reader.
    c.begin(2, &[]).unwrap();
    let pages = c.alloc(2, 2).unwrap();
    let rx = c.inbound(2, &pages).unwrap();
    let step = c.step(&[2]).unwrap();
    drop(rx);
    let err = step.wait(0).unwrap_err();
    assert!(
        matches!(&err, Error::RequestFailed { cause, .. } if matches!(**cause, Error::Cancelled(_))),
        "{err:?}"
    );
    drop(step);
    c.abort(2).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!(s.device_free, 6);
}

/// PD late writes: after an abort, the transfer's pages stay quarantined until the handle
/// ends and every late write is refused as stale; after it ends the pages are reused with
/// a new generation and an old reference can never land in them.
#[test]
fn inbound_late_writes_after_abort_are_refused_and_pages_quarantined() {
    let mut cfg = CacheConfig::new(2, 0);
    cfg.wait_timeout = std::time::Duration::from_millis(200);
    let c = cache(spec(BF.0, BF.1), cfg);
    let b = c.backend();
    let ids: Vec<i32> = (0..2).collect();
    let (kv, kr, ks) = source(b, c.spec().kv, 2, 7);
    c.begin(1, &[]).unwrap();
    let pages = c.alloc(1, 2).unwrap();
    let mut rx = c.inbound(1, &pages).unwrap();
    rx.write(0, BufferKind::Kv, &pages, &kv, kr, &ids, &ks)
        .unwrap();
    c.abort(1).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.device_quarantined, s.device_free), (2, 0), "{s:?}");
    let err = rx
        .write(0, BufferKind::IndexK, &pages, &kv, kr, &ids, &ks)
        .unwrap_err();
    assert!(matches!(err, Error::StalePage { .. }), "{err:?}");
    c.begin(2, &[]).unwrap();
    assert!(
        matches!(c.alloc(2, 1), Err(Error::OutOfPages { .. })),
        "quarantined pages are never reused"
    );
    drop(rx);
    let fresh = c.alloc(2, 2).unwrap();
    assert!(fresh.iter().all(|p| !pages.contains(p)));
    let mut rx2 = c.inbound(2, &fresh).unwrap();
    let old = pages.iter().find(|p| p.id == fresh[0].id).unwrap();
    let err = rx2
        .write(0, BufferKind::Kv, &[*old], &kv, kr, &ids[..1], &ks[..1])
        .unwrap_err();
    assert!(matches!(err, Error::StalePage { .. }), "{err:?}");
    assert_eq!(c.stats().stale_writes_refused, 2);
    rx2.fail(Error::Cancelled("test".into()));
    c.abort(2).unwrap();
    c.leak_check().unwrap();
}

#[test]
fn accounting_and_errors() {
    let c = cache(spec(BF.0, BF.1), CacheConfig::new(4, 0));
    c.begin(1, &[]).unwrap();
    assert!(
        matches!(c.begin(1, &[]), Err(Error::InvalidArgument { .. })),
        "request already live"
    );
    assert!(
        matches!(c.alloc(9, 1), Err(Error::InvalidArgument { .. })),
        "unknown request"
    );
    assert!(matches!(c.alloc(1, 5), Err(Error::OutOfPages { .. })));
    assert!(matches!(
        c.step(&[1, 1]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(c.step(&[9]), Err(Error::InvalidArgument { .. })));
    let p = c.alloc(1, 4).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.device_free, s.device_in_use), (0, 4));
    let step = c.step(&[1]).unwrap();
    assert!(
        matches!(
            c.commit(1, &prompt(1, PAGE), &p),
            Err(Error::InvalidArgument { .. })
        ),
        "in a live step"
    );
    assert!(
        matches!(c.finish(1), Err(Error::InvalidArgument { .. })),
        "in a live step"
    );
    assert!(matches!(
        step.wait(LAYERS),
        Err(Error::InvalidArgument { .. })
    ));
    drop(step);
    let toks = prompt(1, 2 * PAGE + 1);
    let r = c.commit(1, &toks, &p[..3]);
    assert!(
        matches!(r, Err(Error::NotLanded { .. })),
        "pages never written: {r:?}"
    );
    {
        let spec = *c.spec();
        let mut step = c.step(&[1]).unwrap();
        for l in 0..LAYERS {
            let mut g = step.wait_layer(l).unwrap();
            store_layer(&mut g, c.backend(), &spec, &toks, &p, 0).unwrap();
        }
    }
    c.commit(1, &toks, &p[..3]).unwrap();
    let s = c.leak_check().unwrap();
    // p[0], p[1] adopted by the tree; p[2] (partial page) and p[3] still the request's.
    assert_eq!((s.device_in_use, s.device_cached), (2, 2));
    c.finish(1).unwrap();
    assert!(c.finish(1).is_err());
    // No host tier: evicted pages leave the cache.
    assert_eq!(c.evict_device(2).unwrap(), 2);
    let s = c.leak_check().unwrap();
    assert_eq!((s.device_free, s.device_cached, s.host_cached), (4, 0, 0));
}

/// Abort from another thread while a step holds the request: the step goes on (the
/// request is marked aborted, its pages stay pinned and quarantined) and everything is
/// released when the step ends.
#[test]
fn abort_during_a_step_quarantines_until_the_step_ends() {
    let c = Arc::new(cache(spec(BF.0, BF.1), CacheConfig::new(4, 0)));
    let toks = prompt(1, PAGE + 1);
    c.begin(1, &toks).unwrap();
    let pages = c.alloc(1, 2).unwrap();
    let mut step = c.step(&[1]).unwrap();
    let c2 = c.clone();
    bounded(move || c2.abort(1).unwrap());
    assert!(step.is_aborted(1));
    assert_eq!(c.stats().device_quarantined, 2);
    let spec = *c.spec();
    let mut g = step.wait_layer(0).unwrap();
    store_layer(&mut g, c.backend(), &spec, &toks, &pages, 0).unwrap();
    drop(g);
    drop(step);
    let s = c.leak_check().unwrap();
    assert_eq!((s.device_quarantined, s.device_free), (0, 4));
}

/// The same round trip on the emulator backend: every copy and checksum of the cache runs
/// the GPU kernels (`copy_pages`, `page_checksums`) under the SIMT emulator.
#[test]
fn prefix_reuse_on_the_emulator_backend() {
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let mut cfg = CacheConfig::new(6, 16);
        cfg.host_layout = layout;
        let c = cache_on(
            EmuBackend::new(),
            spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16),
            cfg,
        );
        let e = Expect::default();
        let a = prompt(1, 4 * PAGE + 2);
        e.request(&c, 1, &a, false).unwrap();
        e.request(&c, 2, &prompt(2, 5 * PAGE), false).unwrap();
        assert_eq!(e.request(&c, 3, &a, false).unwrap(), 4 * PAGE);
        let s = c.leak_check().unwrap();
        assert!(s.backups > 0 && s.hits_host_pages >= 3, "{s:?}");
    }
}

/// `no-layout-check` with `host-pool-fp8-layout`: the host copies skip the descriptor
/// comparison (device-sized index-K pages at fp8-sized host addresses, overlapping their
/// neighbours: the historical bug in full). The load checksums catch it; with them off the
/// corrupted bytes are served. `no-layout-check` alone (one descriptor) changes nothing.
#[test]
fn fault_no_layout_check_lets_the_fp8_host_pool_corrupt_and_checksums_catch_it() {
    for (faults, verify) in [
        (vec![Fault::HostPoolFp8Layout, Fault::NoLayoutCheck], true),
        (vec![Fault::HostPoolFp8Layout, Fault::NoLayoutCheck], false),
        (vec![Fault::NoLayoutCheck], true),
    ] {
        for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
            let mut cfg = CacheConfig::new(4, 8);
            cfg.faults = Faults::with(&faults);
            cfg.verify = verify;
            cfg.host_layout = layout;
            let c = cache(spec(BF.0, BF.1), cfg);
            let e = Expect::default();
            let a = prompt(1, 3 * PAGE);
            e.request(&c, 1, &a, false).unwrap();
            assert_eq!(
                c.evict_device(3).unwrap(),
                3,
                "{faults:?}: backups went through"
            );
            let got = e.request(&c, 2, &a, false);
            let what = |err: &Error| match err {
                Error::RequestFailed { cause, .. } => match **cause {
                    Error::Integrity { what, .. } => what,
                    _ => "other",
                },
                Error::Integrity { what, .. } => what,
                _ => "other",
            };
            match (faults.len(), verify) {
                (1, _) => assert_eq!(got.unwrap(), 3 * PAGE, "{layout:?}: a clean host hit"),
                (_, true) => {
                    let err = got.unwrap_err();
                    assert_eq!(what(&err), "host→device", "{layout:?}: {err:?}");
                    assert_eq!(c.stats().integrity_failures, 1);
                }
                (_, false) => {
                    let err = got.unwrap_err();
                    assert_eq!(what(&err), "served page", "{layout:?}: {err:?}");
                }
            }
            c.leak_check().unwrap();
        }
    }
}

/// `loads-trail-readers` makes `skip-index-wait`'s race deterministic: the reader holds
/// the layer before the load's bytes land, every time. The landed stamps see it: the
/// guard waits for the load (which goes once the reader reached the layer) and reads the
/// committed bytes; with the stamps off the bytes read are not the committed ones.
/// Without `skip-index-wait` the reader waits at the fence and reads the right bytes.
#[test]
fn fault_loads_trail_readers_makes_the_early_read_certain() {
    for faults in [
        vec![Fault::SkipIndexWait, Fault::LoadsTrailReaders],
        vec![
            Fault::SkipIndexWait,
            Fault::LoadsTrailReaders,
            Fault::NoLandedCheck,
        ],
        vec![Fault::LoadsTrailReaders],
    ] {
        let mut cfg = CacheConfig::new(4, 8);
        cfg.faults = Faults::with(&faults);
        let (c, _ctl, e, a) = host_only_prefix(cfg);
        let c2 = c.clone();
        let faults2 = faults.clone();
        bounded(move || {
            let c = c2;
            let p = c.begin(2, &a).unwrap();
            assert_eq!(p.loaded_pages, 2);
            let mut step = c.step(&[2]).unwrap();
            let skip = faults2.contains(&Fault::SkipIndexWait);
            let stamps = !faults2.contains(&Fault::NoLandedCheck);
            if skip {
                for l in 0..LAYERS {
                    let t = step.wait(l).unwrap();
                    let g = step.layer(t).unwrap();
                    let got = read_pages(&*c, &g, &p.pages).unwrap();
                    assert_eq!(
                        e.check(&a, 0, l, &got[0]).is_ok(),
                        stamps,
                        "layer {l}: read early every time; right only when the stamps waited"
                    );
                }
                assert_eq!(
                    c.stats().landing_waits,
                    if stamps { LAYERS as u64 } else { 0 }
                );
                drop(step);
                c.abort(2).unwrap();
            } else {
                e.forward(&c, &mut step, &a, &p, &p.pages.clone()).unwrap();
                drop(step);
                c.finish(2).unwrap();
                assert_eq!(c.stats().landing_waits, 0);
            }
            c.wait_idle().unwrap();
            c.leak_check().unwrap();
        });
    }
}

/// `late-write`: the rows a request stored into a page it released are written again
/// through their old references when the page's next owner stores the same slots. The
/// generation check refuses every one (counted); with `no-generation-check` the written-
/// slot check refuses them (the page's bytes are of the new owner's generation); with
/// the landed checks off too the owner's page is corrupted.
#[test]
fn fault_late_write_is_refused_by_generations_then_caught_by_landed_stamps() {
    let truth = Expect::default();
    let b = prompt(2, 2 * PAGE);
    truth
        .request(
            &cache(spec(BF.0, BF.1), CacheConfig::new(4, 0)),
            1,
            &b,
            false,
        )
        .unwrap();
    for faults in [
        vec![Fault::LateWrite],
        vec![Fault::LateWrite, Fault::NoGenerationCheck],
        vec![
            Fault::LateWrite,
            Fault::NoGenerationCheck,
            Fault::NoLandedCheck,
        ],
    ] {
        let mut cfg = CacheConfig::new(2, 0);
        cfg.faults = Faults::with(&faults);
        let c = cache(spec(BF.0, BF.1), cfg);
        // Request 1 fills both pages, then is aborted: its rows become late writes.
        truth.request(&c, 1, &prompt(1, 2 * PAGE), true).unwrap();
        let got = truth.request(&c, 2, &b, false);
        match faults.len() {
            1 => {
                got.unwrap();
                assert_eq!(
                    c.stats().stale_writes_refused,
                    (2 * PAGE * 2 * LAYERS) as u64,
                    "every late row refused by its generation"
                );
            }
            2 => {
                // The written-slot check refuses each late row at its write (the page's
                // bytes are of another generation): the owner is served.
                got.unwrap();
                assert_eq!(
                    c.stats().stale_writes_refused,
                    (2 * PAGE * 2 * LAYERS) as u64,
                    "every late row refused by the written slots"
                );
            }
            _ => {
                let err = got.unwrap_err();
                assert!(
                    matches!(
                        &err,
                        Error::Integrity {
                            what: "recomputed page differs",
                            ..
                        }
                    ),
                    "{err:?}"
                );
            }
        }
        c.leak_check().unwrap();
    }
}

/// `try_alloc` / `try_begin` never wait: with a step in flight (what makes `alloc` wait
/// for room) they answer `OutOfPages` at once, after starting the evictions that make
/// room, and a later try gets it.
#[test]
fn try_alloc_and_try_begin_answer_at_once_and_make_room_for_later() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.wait_timeout = std::time::Duration::from_secs(600);
    let c = Arc::new(cache(spec(BF.0, BF.1), cfg));
    let e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&*c, 1, &a, false).unwrap(); // 2 cached device pages, no host copy yet
    c.begin(3, &[]).unwrap();
    c.alloc(3, 2).unwrap();
    let c2 = c.clone();
    bounded(move || {
        let c = c2;
        let _step = c.step(&[3]).unwrap(); // in flight: a blocking alloc would wait
        c.begin(4, &[]).unwrap();
        assert!(matches!(
            c.try_alloc(4, 2),
            Err(Error::OutOfPages { wanted: 2, .. })
        ));
        assert_eq!(c.stats().device_in_use, 2, "nothing allocated");
        c.leak_check().unwrap();
    });
    c.wait_idle().unwrap();
    // The evictions it started (backups, then release) made the room.
    assert_eq!(c.try_alloc(4, 2).unwrap().len(), 2);
    c.abort(4).unwrap();
    // try_begin: the prefix is host-only now and its load needs 2 pages; none free.
    c.alloc(3, 2).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.device_free, s.host_cached), (0, 2), "{s:?}");
    let c2 = c.clone();
    bounded(move || {
        let _step = c2.step(&[3]).unwrap();
        assert!(matches!(c2.try_begin(5, &a), Err(Error::OutOfPages { .. })));
        assert!(!c2.is_live(5));
        c2.leak_check().unwrap();
    });
    c.abort(3).unwrap();
    let p = c.try_begin(5, &prompt(1, 2 * PAGE)).unwrap();
    assert_eq!(p.loaded_pages, 2);
    c.abort(5).unwrap();
    c.wait_idle().unwrap();
    c.leak_check().unwrap();
}

/// A try that cannot succeed even after evicting every unlocked cached page evicts
/// nothing: a request that cannot start must not empty the cache (with no host tier the
/// evicted pages would be lost for nothing).
#[test]
fn an_impossible_try_evicts_nothing() {
    let c = cache(spec(BF.0, BF.1), CacheConfig::new(4, 0));
    let e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&c, 1, &a, false).unwrap(); // 2 cached pages
    c.begin(2, &[]).unwrap();
    assert!(matches!(c.try_alloc(2, 5), Err(Error::OutOfPages { .. })));
    let s = c.leak_check().unwrap();
    assert_eq!((s.device_cached, s.device_free), (2, 2), "nothing evicted");
    // A possible one evicts what it needs (no host tier: at once).
    assert_eq!(c.try_alloc(2, 3).unwrap().len(), 3);
    assert_eq!(c.leak_check().unwrap().device_cached, 1);
    c.abort(2).unwrap();
    c.leak_check().unwrap();
}

/// Regression: `commit` ticked each new node on its own, so a committed path's parents
/// looked older than their children and LRU eviction took the parent first, cutting the
/// path (with no host tier, the children's pages stayed on the device, unreachable). A
/// path now empties from its leaf.
#[test]
fn eviction_empties_a_committed_path_from_its_leaf() {
    let c = cache(spec(BF.0, BF.1), CacheConfig::new(6, 0));
    let e = Expect::default();
    let a = prompt(1, 3 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    assert_eq!(c.evict_device(1).unwrap(), 1);
    assert_eq!(
        e.request(&c, 2, &a, false).unwrap(),
        2 * PAGE,
        "the two leading pages are still reachable"
    );
    c.leak_check().unwrap();
}

/// `room` answers what a request would find without changing anything: its prefix by
/// tier and the device pages it could get (its own prefix's pages excluded).
#[test]
fn room_reports_without_touching() {
    let c = cache(spec(BF.0, BF.1), CacheConfig::new(6, 8));
    let e = Expect::default();
    let a = prompt(1, 3 * PAGE);
    e.request(&c, 1, &a, false).unwrap(); // 3 cached device pages
    c.wait_idle().unwrap();
    let r = c.room(&a);
    assert_eq!((r.device_pages, r.host_pages, r.available), (3, 0, 3));
    let b = prompt(2, 2 * PAGE);
    assert_eq!(
        c.room(&b).available,
        6,
        "another prompt could evict all three"
    );
    assert_eq!(c.evict_device(3).unwrap(), 3);
    let r = c.room(&a);
    assert_eq!((r.device_pages, r.host_pages, r.available), (0, 3, 6));
    let before = c.leak_check().unwrap();
    c.room(&a);
    assert_eq!(c.leak_check().unwrap(), before, "asking changed nothing");
    c.begin(2, &[]).unwrap();
    c.alloc(2, 4).unwrap();
    assert_eq!(c.room(&a).available, 2);
    c.abort(2).unwrap();
    c.leak_check().unwrap();
}
