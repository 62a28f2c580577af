//! The checks behind the fences, per buffer kind and per token slot: what catches, with
//! no reference run to compare against, a layer whose index-K lands after the layer was
//! published, a radix match that claims one token more than it matched, a read or commit
//! of slots nobody wrote. Each fault shows the check catching it (and the request still
//! served where the check can wait for the bytes), and, with the checks off, the
//! corruption being real.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use crate::common;

use std::sync::{mpsc, Arc};

use common::{cache, kv_row, prompt, read_pages, spec, store_layer, Expect, BOUND, LAYERS, PAGE};
use sparsekit_host::cache::{BufferKind, CacheConfig, Fault, Faults, HiCache, ReadExtent, SlotRef};
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_host::{Backend, CpuBackend, Error};

const BF: (KvDtype, IndexKDtype) = (KvDtype::Bf16, IndexKDtype::Bf16);

fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(BOUND).expect("blocked past its bound")
}

/// A cache whose prefix `a` (2 pages) is only in the host tier, its freed device pages
/// holding another request's bytes.
fn host_only(faults: &[Fault]) -> (Arc<HiCache<CpuBackend>>, Arc<Expect>, Vec<u32>) {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.faults = Faults::with(faults);
    let c = Arc::new(cache(spec(BF.0, BF.1), cfg));
    let e = Arc::new(Expect::default());
    let a = prompt(1, 2 * PAGE);
    assert_eq!(e.request(&*c, 1, &a, false).unwrap(), 0);
    assert_eq!(c.evict_device(2).unwrap(), 2);
    e.request(&*c, 9, &prompt(9, 2 * PAGE), true).unwrap();
    (c, e, a)
}

/// `index-k-after-publish`: every layer is published with its index-K not copied yet.
/// The per-kind stamps see it; the guard waits for the late copy and serves the committed
/// bytes (one landing wait per layer). With the stamps off the reader reads the undefined
/// index-K every time.
#[test]
fn index_k_after_publish_is_caught_by_per_kind_stamps_and_served() {
    for checks in [true, false] {
        let mut faults = vec![Fault::IndexKAfterPublish];
        if !checks {
            faults.push(Fault::NoLandedCheck);
        }
        let (c, e, a) = host_only(&faults);
        let c2 = c.clone();
        let wrong = bounded(move || {
            let p = c2.begin(2, &a).unwrap();
            assert_eq!(p.loaded_pages, 2);
            let mut step = c2.step(&[2]).unwrap();
            let mut wrong = Vec::new();
            for l in 0..LAYERS {
                let g = step.wait_layer(l).unwrap();
                let got = read_pages(&*c2, &g, &p.pages).unwrap();
                for (i, page) in got.iter().enumerate() {
                    if let Err(err) = e.check(&a, i, l, page) {
                        wrong.push(format!("{err}"));
                    }
                }
            }
            drop(step);
            c2.abort(2).unwrap();
            wrong
        });
        if checks {
            assert!(wrong.is_empty(), "{wrong:?}");
            assert_eq!(c.stats().landing_waits, LAYERS as u64);
        } else {
            assert_eq!(
                wrong.len(),
                2 * LAYERS,
                "every index-K page read early: {wrong:?}"
            );
            assert!(wrong.iter().all(|w| w.contains("index_k")), "{wrong:?}");
            assert_eq!(c.stats().landing_waits, 0);
        }
        c.wait_idle().unwrap();
        c.leak_check().unwrap();
    }
}

/// Without the fault the same load publishes each layer once both kinds landed: no
/// reader ever waits behind a published fence.
#[test]
fn a_correct_load_never_makes_a_reader_wait_behind_its_fence() {
    let (c, e, a) = host_only(&[]);
    let p = c.begin(2, &a).unwrap();
    let mut pages = p.pages.clone();
    pages.extend(c.alloc(2, 1).unwrap());
    let mut toks = a.clone();
    toks.extend(prompt(5, 3));
    let mut step = c.step(&[2]).unwrap();
    e.forward(&c, &mut step, &toks, &p, &pages).unwrap();
    drop(step);
    c.finish(2).unwrap();
    assert_eq!(c.stats().landing_waits, 0);
    c.leak_check().unwrap();
}

/// `radix-overreach`: the match claims one token more than its pages hold. The
/// request's first store leaves slot 0 of its first own page a gap: refused
/// (`Unwritten`), and the request is the one that fails. With the checks off the store
/// passes and the unwritten slot is read: not the bytes the token's computation gives.
#[test]
fn radix_overreach_is_caught_by_the_written_slots() {
    for checks in [true, false] {
        let mut cfg = CacheConfig::new(8, 8);
        let mut faults = vec![Fault::RadixOverreach];
        if !checks {
            faults.push(Fault::NoLandedCheck);
        }
        cfg.faults = Faults::with(&faults);
        let c = cache(spec(BF.0, BF.1), cfg);
        let e = Expect::default();
        let a = prompt(1, 2 * PAGE);
        e.request(&c, 1, &a, false).unwrap();
        // A previous owner's bytes in every free page.
        e.request(&c, 8, &prompt(8, 6 * PAGE), true).unwrap();
        let mut toks = a.clone();
        toks.extend(prompt(2, PAGE + 2));
        let p = c.begin(2, &toks).unwrap();
        assert_eq!(p.pages.len(), 2);
        assert_eq!(p.tokens, 2 * PAGE + 1, "the fault overreaches by one token");
        let own = c.alloc(2, 2).unwrap();
        let mut pages = p.pages.clone();
        pages.extend(&own);
        let spec = *c.spec();
        let mut step = c.step(&[2]).unwrap();
        let mut g = step.wait_layer(0).unwrap();
        let stored = store_layer(&mut g, c.backend(), &spec, &toks, &pages, p.tokens);
        if checks {
            match stored {
                Err(Error::RequestFailed { request: 2, cause }) => assert!(
                    matches!(
                        *cause,
                        Error::Unwritten {
                            slot: 0,
                            filled: 0,
                            ..
                        }
                    ),
                    "{cause:?}"
                ),
                other => panic!("the gap must be refused: {other:?}"),
            }
        } else {
            stored.unwrap();
            let read = ReadExtent {
                request: 2,
                pages: &pages,
                tokens: toks.len(),
            };
            let (kv, _) = g.views_for(&[read]).unwrap();
            let kv = c.backend().download(kv).unwrap();
            let region = c.device_region(BufferKind::Kv);
            let slot0 = &kv[region.page_range(own[0].id as usize)][..spec.kv.bytes_per_token()];
            assert_ne!(
                slot0,
                &kv_row(&spec, &toks, 2 * PAGE, 0)[..],
                "the slot read was never written: the corruption is real"
            );
        }
        drop(g);
        drop(step);
        c.abort(2).unwrap();
        c.leak_check().unwrap();
    }
}

/// A reader declares what it reads: slots past what the request's stores filled are
/// refused in either kind, slots within are served.
#[test]
fn a_read_of_unwritten_slots_is_refused() {
    let c = cache(spec(BF.0, BF.1), CacheConfig::new(4, 4));
    c.begin(1, &[]).unwrap();
    let own = c.alloc(1, 2).unwrap();
    let spec = *c.spec();
    let toks = prompt(3, PAGE + 1);
    let mut step = c.step(&[1]).unwrap();
    let mut g = step.wait_layer(0).unwrap();
    // KV of every token, index-K of the first page only.
    let slots: Vec<SlotRef> = (0..toks.len())
        .map(|p| SlotRef {
            page: own[p / PAGE],
            offset: (p % PAGE) as u32,
        })
        .collect();
    let kv = c
        .backend()
        .upload(&vec![0x11; slots.len() * spec.kv.d_qk() * 2])
        .unwrap();
    let ik = c
        .backend()
        .upload(&vec![0x22; PAGE * spec.index_k.head_dim() * 2])
        .unwrap();
    g.kv_store(&slots, &kv).unwrap();
    g.index_k_store(&slots[..PAGE], &ik).unwrap();
    let read = |tokens| ReadExtent {
        request: 1,
        pages: &own,
        tokens,
    };
    assert!(g.views_for(&[read(PAGE)]).is_ok());
    match g.views_for(&[read(PAGE + 1)]) {
        Err(Error::RequestFailed { request: 1, cause }) => assert!(
            matches!(
                *cause,
                Error::Unwritten {
                    kind: "index_k",
                    slot: 0,
                    ..
                }
            ),
            "{cause:?}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        g.views_for(&[read(3 * PAGE)]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        g.views_for(&[ReadExtent {
            request: 7,
            pages: &own,
            tokens: 1
        }]),
        Err(Error::InvalidArgument { .. })
    ));
    drop(g);
    drop(step);
    c.abort(1).unwrap();
    c.leak_check().unwrap();
}

/// `commit` takes only full pages: every slot of both kinds written in every layer. A
/// page whose index-K was never written in one layer is refused (`NotLanded`, index_k),
/// and so is a page one slot short (`Unwritten`); nothing changes, and the complete page
/// then commits.
#[test]
fn commit_refuses_a_page_missing_a_kind_or_a_slot() {
    let c = cache(spec(BF.0, BF.1), CacheConfig::new(4, 4));
    let spec = *c.spec();
    let toks = prompt(4, PAGE);
    c.begin(1, &[]).unwrap();
    let own = c.alloc(1, 1).unwrap();
    let kv = c
        .backend()
        .upload(&vec![0x11; PAGE * spec.kv.d_qk() * 2])
        .unwrap();
    let ik_rows = |n: usize| {
        c.backend()
            .upload(&vec![0x22; n * spec.index_k.head_dim() * 2])
            .unwrap()
    };
    let ik = ik_rows(PAGE);
    let slots: Vec<SlotRef> = (0..PAGE)
        .map(|o| SlotRef {
            page: own[0],
            offset: o as u32,
        })
        .collect();
    {
        let mut step = c.step(&[1]).unwrap();
        for l in 0..LAYERS {
            let mut g = step.wait_layer(l).unwrap();
            g.kv_store(&slots, &kv).unwrap();
            if l + 1 < LAYERS {
                g.index_k_store(&slots, &ik).unwrap();
            } else {
                g.index_k_store(&slots[..PAGE - 1], &ik_rows(PAGE - 1))
                    .unwrap();
            }
        }
    }
    match c.commit(1, &toks, &own) {
        Err(Error::Unwritten {
            kind: "index_k",
            slot,
            layer,
            ..
        }) => assert_eq!((slot, layer), (PAGE as u32 - 1, LAYERS - 1)),
        other => panic!("{other:?}"),
    }
    // A fresh page whose index-K was never written in the last layer.
    c.begin(2, &[]).unwrap();
    let own2 = c.alloc(2, 1).unwrap();
    let slots2: Vec<SlotRef> = slots
        .iter()
        .map(|s| SlotRef {
            page: own2[0],
            ..*s
        })
        .collect();
    {
        let mut step = c.step(&[2]).unwrap();
        for l in 0..LAYERS {
            let mut g = step.wait_layer(l).unwrap();
            g.kv_store(&slots2, &kv).unwrap();
            if l + 1 < LAYERS {
                g.index_k_store(&slots2, &ik).unwrap();
            }
        }
    }
    match c.commit(2, &toks, &own2) {
        Err(Error::NotLanded {
            kind: "index_k",
            layer,
            stamp: None,
            ..
        }) => assert_eq!(layer, LAYERS - 1),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        c.leak_check().unwrap().device_cached,
        0,
        "nothing committed"
    );
    // Completed, the first page commits.
    {
        let mut step = c.step(&[1]).unwrap();
        let mut g = step.wait_layer(LAYERS - 1).unwrap();
        g.index_k_store(&slots[PAGE - 1..], &ik_rows(1)).unwrap();
    }
    c.commit(1, &toks, &own).unwrap();
    c.finish(1).unwrap();
    c.abort(2).unwrap();
    assert_eq!(c.leak_check().unwrap().device_cached, 1);
}

/// A commit over a node whose host → device load is still in flight: the committing
/// request keeps its own written copy of that page (its path stops before the loading
/// node), so its next step reads without waiting for a load it never joined, and when
/// that load is cancelled nothing of the request is lost.
#[test]
fn a_commit_over_a_loading_node_keeps_its_own_copy() {
    let (b, ctl) = common::Flaky::new();
    let mut cfg = CacheConfig::new(8, 16);
    cfg.wait_timeout = std::time::Duration::from_secs(2);
    let c = Arc::new(common::cache_on(b, spec(BF.0, BF.1), cfg));
    let e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&*c, 1, &a, false).unwrap();
    assert_eq!(c.evict_device(2).unwrap(), 2);
    // Request 3 computes `a` itself into pages of its own.
    c.begin(3, &[]).unwrap();
    let own = c.alloc(3, 2).unwrap();
    let spec = *c.spec();
    {
        let mut step = c.step(&[3]).unwrap();
        for l in 0..LAYERS {
            let mut g = step.wait_layer(l).unwrap();
            store_layer(&mut g, c.backend(), &spec, &a, &own, 0).unwrap();
        }
    }
    // Request 2 matches `a` in the host tier: its load is held at the gate.
    ctl.close_gate();
    let p2 = c.begin(2, &a).unwrap();
    assert_eq!(p2.loaded_pages, 2);
    ctl.wait_held(1);
    c.commit(3, &a, &own).unwrap();
    // Request 3 kept its own pages (they did not join the loading nodes).
    assert_eq!(c.stats().device_in_use, 2);
    // The load is cancelled: request 3 still has everything it wrote.
    c.abort(2).unwrap();
    ctl.open_gate();
    c.wait_idle().unwrap();
    c.leak_check().unwrap();
    let mut step = c.step(&[3]).unwrap();
    let g = step.wait_layer(0).unwrap();
    e.check(&a, 0, 0, &read_pages(&*c, &g, &own).unwrap()[0])
        .unwrap();
    drop(g);
    drop(step);
    c.finish(3).unwrap();
    c.leak_check().unwrap();
}

/// The io worker dies once outside a job's containment (`worker-dies`): the backup it
/// was running fails with a typed error at once, and the worker goes on — the same
/// eviction then backs the pages up, a later request loads them back, bit-exact.
#[test]
fn the_io_worker_survives_a_panic_and_the_cache_goes_on() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.faults = Faults::with(&[Fault::WorkerDies]);
    let c = Arc::new(cache(spec(BF.0, BF.1), cfg));
    let e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&*c, 1, &a, false).unwrap();
    let c2 = c.clone();
    let first = bounded(move || c2.evict_device(2));
    assert!(
        matches!(&first, Err(Error::Cancelled(m)) if m.contains("worker")),
        "{first:?}"
    );
    assert_eq!(c.stats().worker_restarts, 1);
    c.leak_check().unwrap();
    // The failed eviction could not wait for its backup: the pages left the cache. The
    // worker goes on: the prefix computed again is backed up and evicted this time.
    assert_eq!(e.request(&*c, 3, &a, false).unwrap(), 0);
    let c2 = c.clone();
    assert_eq!(bounded(move || c2.evict_device(2)).unwrap(), 2);
    let s = c.leak_check().unwrap();
    assert_eq!((s.host_cached, s.device_cached), (2, 0), "{s:?}");
    assert_eq!(e.request(&*c, 2, &a, false).unwrap(), 2 * PAGE);
    assert_eq!(c.stats().hits_host_pages, 2);
    c.leak_check().unwrap();
}

/// A wait bound too large to add to an instant (`Duration::MAX`) saturates instead of
/// panicking.
#[test]
fn a_wait_bound_of_duration_max_saturates() {
    let mut cfg = CacheConfig::new(4, 4);
    cfg.wait_timeout = std::time::Duration::MAX;
    let c = cache(spec(BF.0, BF.1), cfg);
    let e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    assert_eq!(c.evict_device(2).unwrap(), 2);
    assert_eq!(e.request(&c, 2, &a, false).unwrap(), 2 * PAGE);
    c.leak_check().unwrap();
}
