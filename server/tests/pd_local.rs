//! PD over the in-process transport: transfers land bit-exact and are published layer by
//! layer; stale, mis-sized, truncated, tampered, foreign and duplicate writes are refused
//! (counted by reason) without wedging anything; quarantine holds the destination pages
//! until prefill confirms; a late write after an abort never lands in reused pages; aborts
//! from either side release pages on both sides; a panicking task fails only its request.
//! Threads and bounded waits, no sleeps.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::pd_common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use pd_common::*;
use sparsekit_host::cache::{BufferKind, PageRef};
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, PageLayout};
use sparsekit_host::Backend;
use sparsekit_server::pd::stage::stage;
use sparsekit_server::pd::wire::{Bootstrap, Message, Written};
use sparsekit_server::pd::{
    LandingGeometry, Outcome, PdError, Receiver, ReceiverConfig, SenderConfig,
};
use sparsekit_server::transfer::{Segment, Transport};

fn send(end: &dyn Transport, m: &Message) {
    end.send(&m.encode().unwrap()).unwrap();
}

/// Every dtype pair: a ragged batch of transfers lands bit-exact (every token of both
/// kinds in every layer), each ends `Ready`, nothing leaks on either side.
#[test]
fn transfers_land_bit_exact_for_every_dtype_pair() {
    for (kv, ik) in [
        (KvDtype::Bf16, IndexKDtype::Bf16),
        (KvDtype::Bf16, IndexKDtype::FP8),
        (KvDtype::Fp8DsMla, IndexKDtype::Bf16),
        (KvDtype::Fp8DsMla, IndexKDtype::FP8),
    ] {
        let s = spec(kv, ik);
        let pd = pd(
            cache(s, 24, &[]),
            cache(s, 24, &[]),
            ReceiverConfig::default(),
            SenderConfig::default(),
        );
        let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), go());
        let lens = [1usize, 7, 4, 13, 9];
        let mut reqs = Vec::new();
        for (i, &n) in lens.iter().enumerate() {
            let req = 100 + i as u64;
            let p = prompt(req, n);
            reqs.push((req, p.clone(), start(&pd, req, &p).unwrap()));
        }
        for (req, p, pages) in &reqs {
            assert_eq!(
                pd.rx.wait(*req, BOUND).unwrap(),
                Outcome::Ready,
                "{kv:?}/{ik:?}"
            );
            assert!(pd.rx.is_ready(*req));
            for l in 0..LAYERS {
                let got = received(&pd.d, *req, pages, l).unwrap();
                assert!(
                    same_tokens(&s, p.len(), &got, &expected(&s, p, l)),
                    "{kv:?}/{ik:?} request {req} layer {l} differs"
                );
            }
            pd.d.finish(*req).unwrap();
        }
        let st = pd.rx.stats();
        assert_eq!(
            (st.finished, st.refused_total()),
            (lens.len() as u64, 0),
            "{st:?}"
        );
        let bytes: usize = lens.iter().map(|n| n.div_ceil(PAGE)).sum::<usize>() * LAYERS;
        assert_eq!(st.kv_bytes as usize, bytes * s.kv.bytes_per_page());
        assert_eq!(
            st.index_k_bytes as usize,
            bytes * s.index_k.bytes_per_page()
        );
        until("prefill requests ended", || pd.p.stats().live_requests == 0);
        let (d, p) = (pd.d.leak_check().unwrap(), pd.p.leak_check().unwrap());
        assert_eq!((d.device_free, p.device_free), (24, 24));
    }
}

/// Readiness is per layer: with prefill held after layer 0, decode's step sees layer 0
/// ready and layer 1 not; then everything lands.
#[test]
fn layers_are_published_one_by_one() {
    let s = spec(KvDtype::Bf16, IndexKDtype::Bf16);
    let pd = pd(
        cache(s, 8, &[]),
        cache(s, 8, &[]),
        ReceiverConfig::default(),
        SenderConfig::default(),
    );
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = Arc::new(parking_lot::Mutex::new(go_rx));
    let gate: Gate = Arc::new(move |_, l| {
        if l == 1 {
            go_rx.lock().recv_timeout(BOUND).unwrap();
        }
        Act::Go
    });
    let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), gate);
    let p = prompt(1, 10);
    let pages = start(&pd, 1, &p).unwrap();
    {
        let step = pd.d.step(&[1]).unwrap();
        step.wait(0).unwrap();
        assert!(step.ready(0).unwrap());
        assert!(!step.ready(1).unwrap() && !step.ready(2).unwrap());
    }
    go_tx.send(()).unwrap();
    assert_eq!(pd.rx.wait(1, BOUND).unwrap(), Outcome::Ready);
    let got = received(&pd.d, 1, &pages, 2).unwrap();
    assert!(same_tokens(&s, p.len(), &got, &expected(&s, &p, 2)));
    pd.d.finish(1).unwrap();
    pd.d.leak_check().unwrap();
}

/// A hand-driven prefill end: what the real sender would do, with knobs to misbehave.
struct Manual<'a> {
    end: &'a dyn Transport,
    geometry: LandingGeometry,
    spec: sparsekit_host::cache::CacheSpec,
    /// Prompt tokens of each bootstrapped request.
    tokens: parking_lot::Mutex<std::collections::HashMap<u64, usize>>,
}

impl Manual<'_> {
    /// The next frame decode sent, decoded.
    fn recv(&self) -> Message {
        let f = self.end.recv(BOUND).unwrap().expect("nothing from decode");
        sparsekit_server::pd::wire::decode_frame(&f).unwrap()
    }

    fn bootstrap(&self) -> Bootstrap {
        match self.recv() {
            Message::Bootstrap(b) => {
                self.tokens.lock().insert(b.req, b.prompt.len());
                b
            }
            m => panic!("expected a bootstrap, got {m:?}"),
        }
    }

    /// Writes `bytes` (packed pages of `layout`) for `pages` of `layer`/`kind` into the
    /// landing zone; returns the honest notification (checksums of the bytes).
    fn land(
        &self,
        req: u64,
        layer: usize,
        kind: BufferKind,
        pages: &[PageRef],
        bytes: &[u8],
    ) -> Written {
        let region = self.geometry.region(layer, kind);
        let per = region.layout.bytes_per_page();
        let segs: Vec<Segment<'_>> = pages
            .iter()
            .enumerate()
            .map(|(i, p)| Segment {
                offset: region.page_range(p.id as usize).start,
                bytes: &bytes[i * per..(i + 1) * per],
            })
            .collect();
        self.end.write(&segs, None).unwrap();
        let b = sparsekit_host::CpuBackend::new();
        let buf = b.upload(bytes).unwrap();
        let ids: Vec<i32> = (0..pages.len() as i32).collect();
        // As the real sender: a partly filled last page is checksummed over its entries.
        let tokens = self.tokens.lock().get(&req).copied().unwrap_or(0);
        let tail = self
            .spec
            .tail_spans(kind, tokens)
            .filter(|_| region.layout == self.spec.layout(kind));
        let staged = stage(
            &b,
            sparsekit_host::ops::PagedRegion::contiguous(region.layout, pages.len()),
            &buf,
            &ids,
            tail.as_deref(),
        )
        .unwrap();
        Written {
            req,
            layer: layer as u32,
            kind,
            fingerprint: region.layout.fingerprint(),
            pages: pages.to_vec(),
            checksums: staged.checksums,
        }
    }

    fn notify(&self, w: &Written) {
        send(self.end, &Message::Written(w.clone()));
    }
}

/// Truncated frames, stale generations, foreign pages, duplicates, notifications for
/// unknown requests, messages in the wrong direction, a second handshake: each refused and
/// counted by reason while the transfer goes on and completes bit-exact. Then a tampered
/// page (checksum) and a mis-sized one (fingerprint): refused, the transfer fails, decode
/// asks prefill to stop and keeps its pages until prefill confirms.
#[test]
fn bad_writes_are_refused_counted_and_survived() {
    let s = spec(KvDtype::Bf16, IndexKDtype::Bf16);
    let d = cache(s, 8, &[]);
    let (d_end, p_end) = local_ends(&d, &d);
    let rx = Receiver::new(d.clone(), d_end, ReceiverConfig::default()).unwrap();
    let m = Manual {
        end: &*p_end,
        geometry: LandingGeometry::new(s, 8).unwrap(),
        spec: s,
        tokens: Default::default(),
    };
    let p = prompt(5, 9);
    let pages = start_on(&d, &rx, 5, &p).unwrap();
    let b = m.bootstrap();
    assert_eq!(
        (b.req, b.pages.clone(), b.prompt.clone()),
        (5, pages.clone(), p.clone())
    );
    let (kv0, ik0) = expected(&s, &p, 0);
    let w = m.land(5, 0, BufferKind::Kv, &pages, &kv0);
    let frame = Message::Written(w.clone()).encode().unwrap();
    // Truncated, then garbage, then an empty-looking frame.
    m.end.send(&frame[..frame.len() - 3]).unwrap();
    m.end.send(&[0xde; 24]).unwrap();
    // Stale generation, foreign page, wrong request, duplicate pages in one message.
    let mut stale = w.clone();
    stale.pages[1].generation += 1;
    m.notify(&stale);
    let mut foreign = w.clone();
    foreign.pages[0].id = 7;
    m.notify(&foreign);
    let mut other = w.clone();
    other.req = 999;
    m.notify(&other);
    let mut twice = w.clone();
    twice.pages[1] = twice.pages[0];
    m.notify(&twice);
    // Wrong direction and a second handshake.
    send(m.end, &Message::Bootstrap(b.clone()));
    send(
        m.end,
        &Message::Hello(sparsekit_server::pd::hello(
            sparsekit_server::pd::Role::Prefill,
            &s,
            sparsekit_host::Arithmetic::Shared,
            0,
            Vec::new(),
        )),
    );
    // The real one, then a duplicate of it.
    m.notify(&w);
    m.notify(&w);
    m.notify(&m.land(5, 0, BufferKind::IndexK, &pages, &ik0));
    for l in 1..LAYERS {
        let (kv, ik) = expected(&s, &p, l);
        m.notify(&m.land(5, l, BufferKind::Kv, &pages, &kv));
        m.notify(&m.land(5, l, BufferKind::IndexK, &pages, &ik));
    }
    send(
        m.end,
        &Message::Finished {
            req: 5,
            tokens: p.len() as u32,
        },
    );
    assert_eq!(rx.wait(5, BOUND).unwrap(), Outcome::Ready);
    for l in 0..LAYERS {
        let got = received(&d, 5, &pages, l).unwrap();
        assert!(
            same_tokens(&s, p.len(), &got, &expected(&s, &p, l)),
            "layer {l}"
        );
    }
    let st = rx.stats();
    for (reason, n) in [
        ("truncated", 1),
        ("bad_magic", 1),
        ("stale_generation", 1),
        ("not_target", 1),
        ("unknown_request", 1),
        ("duplicate", 2),
        ("wrong_direction", 1),
        ("unexpected_hello", 1),
    ] {
        assert_eq!(st.refused(reason), n, "{reason}: {st:?}");
    }
    // A late notification for the finished transfer.
    m.notify(&w);
    until("late notification counted", || {
        rx.stats().refused("ended") == 1
    });
    d.finish(5).unwrap();

    // Tampered: the bytes that landed are not the ones the checksums describe.
    let p2 = prompt(6, 8);
    let pages2 = start_on(&d, &rx, 6, &p2).unwrap();
    let _ = m.bootstrap();
    let (kv, _) = expected(&s, &p2, 0);
    let mut w2 = m.land(6, 0, BufferKind::Kv, &pages2, &kv);
    w2.checksums[1] ^= 1 << 17;
    m.notify(&w2);
    match m.recv() {
        Message::Abort { req: 6, .. } => {}
        x => panic!("expected decode's abort, got {x:?}"),
    }
    assert_eq!(rx.stats().refused("checksum"), 1);
    assert!(!d.is_live(6), "the request was aborted in the cache");
    // Quarantined until prefill confirms: no page of it can be handed out.
    assert_eq!(rx.quarantined_pages(), 2);
    assert_eq!(d.leak_check().unwrap().device_quarantined, 2);
    // Writes after the abort are refused as late.
    m.notify(&m.land(6, 1, BufferKind::Kv, &pages2, &kv));
    send(
        m.end,
        &Message::Cancelled {
            req: 6,
            reason: "ok".into(),
        },
    );
    assert!(matches!(rx.wait(6, BOUND).unwrap(), Outcome::Failed(_)));
    assert_eq!(rx.stats().refused("after_abort"), 1);
    assert_eq!(d.leak_check().unwrap().device_free, 8);

    // Mis-sized: index-K framed with the fp8 layout under our bf16 one.
    let p3 = prompt(7, 5);
    let pages3 = start_on(&d, &rx, 7, &p3).unwrap();
    let _ = m.bootstrap();
    let fp8 = IndexKLayout::new(IndexKDtype::FP8, 32, PAGE).unwrap();
    let (_, ik) = expected(&s, &p3, 0);
    let mut w3 = m.land(7, 0, BufferKind::IndexK, &pages3, &ik);
    w3.fingerprint = PageLayout::from(fp8).fingerprint();
    m.notify(&w3);
    assert!(matches!(m.recv(), Message::Abort { req: 7, .. }));
    send(
        m.end,
        &Message::Abort {
            req: 7,
            reason: "prefill saw yours".into(),
        },
    );
    assert!(matches!(rx.wait(7, BOUND).unwrap(), Outcome::Failed(_)));
    assert_eq!(rx.stats().refused("layout_mismatch"), 1);
    assert_eq!(d.leak_check().unwrap().device_free, 8);
    assert_eq!(rx.in_flight(), 0);
}

/// The late-write rule: after an abort the destination pages stay quarantined (never
/// reused) until prefill confirms; once reused by another request, a replayed stale write
/// of the aborted transfer is refused and the other request's bytes stay intact — also when
/// the replay lands between the other request's bytes and its notification (then its
/// checksums refuse it: detected, never served).
#[test]
fn late_writes_after_abort_never_land_in_reused_pages() {
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    let d = cache_t(s, 3, &[], Duration::from_millis(200));
    let (d_end, p_end) = local_ends(&d, &d);
    let rx = Receiver::new(d.clone(), d_end, ReceiverConfig::default()).unwrap();
    let end: &dyn Transport = &*p_end;
    let m = Manual {
        end,
        geometry: LandingGeometry::new(s, 3).unwrap(),
        spec: s,
        tokens: Default::default(),
    };
    let start = |req: u64, p: &[u32]| {
        d.begin(req, &[]).unwrap();
        let pages = d.alloc(req, p.len().div_ceil(PAGE)).unwrap();
        rx.start(req, p, &pages).unwrap();
        pages
    };
    let p1 = prompt(1, 12);
    let pages1 = start(1, &p1);
    let _ = m.bootstrap();
    let (kv, _) = expected(&s, &p1, 0);
    m.notify(&m.land(1, 0, BufferKind::Kv, &pages1, &kv));
    until("layer 0 KV landed", || rx.stats().kv_bytes > 0);
    assert!(rx.abort(1, "client went away"));
    assert!(!d.is_live(1));
    assert!(matches!(m.recv(), Message::Abort { req: 1, .. }));
    // Quarantined: another request cannot get them.
    d.begin(2, &[]).unwrap();
    assert!(matches!(
        d.alloc(2, 1),
        Err(sparsekit_host::Error::OutOfPages { .. })
    ));
    assert_eq!(rx.quarantined_pages(), 3);
    // The stale write that was still in flight lands now: refused, counted.
    let late = m.land(1, 1, BufferKind::Kv, &pages1, &expected(&s, &p1, 1).0);
    m.notify(&late);
    until("late write refused", || {
        rx.stats().refused("after_abort") == 1
    });
    // Prefill confirms; the pages are reused by request 2 with new generations.
    send(
        m.end,
        &Message::Cancelled {
            req: 1,
            reason: String::new(),
        },
    );
    assert!(matches!(rx.wait(1, BOUND).unwrap(), Outcome::Cancelled(_)));
    d.abort(2).unwrap();
    let p2 = prompt(2, 11);
    let pages2 = start(2, &p2);
    let ids = |v: &[PageRef]| {
        let mut x: Vec<u32> = v.iter().map(|p| p.id).collect();
        x.sort_unstable();
        x
    };
    assert_eq!(ids(&pages2), ids(&pages1), "the same pages are reused");
    assert!(
        pages2.iter().all(|p| !pages1.contains(p)),
        "with new generations"
    );
    let _ = m.bootstrap();
    for l in 0..LAYERS {
        let (kv, ik) = expected(&s, &p2, l);
        m.notify(&m.land(2, l, BufferKind::Kv, &pages2, &kv));
        m.notify(&m.land(2, l, BufferKind::IndexK, &pages2, &ik));
    }
    until("request 2 landed", || rx.is_ready(2));
    // Replays of the stale write (its bytes land again): as the dead request, and as the
    // live one with the old generations. Both refused; request 2's bytes intact.
    let stale_bytes = expected(&s, &p1, 2);
    let replay = m.land(1, 2, BufferKind::Kv, &pages1, &stale_bytes.0);
    m.notify(&replay);
    let mut as_live = replay.clone();
    as_live.req = 2;
    m.notify(&as_live);
    until("replays refused", || {
        let st = rx.stats();
        st.refused("ended") == 1 && st.refused("stale_generation") == 1
    });
    send(
        m.end,
        &Message::Finished {
            req: 2,
            tokens: p2.len() as u32,
        },
    );
    assert_eq!(rx.wait(2, BOUND).unwrap(), Outcome::Ready);
    for l in 0..LAYERS {
        let got = received(&d, 2, &pages2, l).unwrap();
        assert!(
            same_tokens(&s, p2.len(), &got, &expected(&s, &p2, l)),
            "layer {l}"
        );
    }
    d.finish(2).unwrap();

    // The replay lands between request 3's bytes and its notification: the landed bytes
    // no longer match request 3's checksums, so it is refused (never served).
    let p3 = prompt(3, 12);
    let pages3 = start(3, &p3);
    let _ = m.bootstrap();
    let (kv3, _) = expected(&s, &p3, 2);
    let honest = m.land(3, 2, BufferKind::Kv, &pages3, &kv3);
    let _ = m.land(1, 2, BufferKind::Kv, &pages1, &stale_bytes.0);
    m.notify(&honest);
    assert!(matches!(m.recv(), Message::Abort { req: 3, .. }));
    assert_eq!(rx.stats().refused("checksum"), 1);
    send(
        m.end,
        &Message::Cancelled {
            req: 3,
            reason: String::new(),
        },
    );
    assert!(matches!(rx.wait(3, BOUND).unwrap(), Outcome::Failed(_)));
    assert_eq!(d.leak_check().unwrap().device_free, 3);
}

/// Aborts from either side, at any layer, release pages on both sides; a prefill worker
/// that panics mid-transfer aborts only its request.
#[test]
fn aborts_from_either_side_release_both_sides() {
    let s = spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16);
    let pd = pd(
        cache(s, 16, &[]),
        cache(s, 16, &[]),
        ReceiverConfig::default(),
        SenderConfig::default(),
    );
    // Request 1: decode aborts while prefill waits before layer 1.
    // Request 2: prefill gives up before layer 2.  Request 3: prefill worker panics at 1.
    // Request 4: untouched.
    let (held_tx, held_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let held_tx = parking_lot::Mutex::new(held_tx);
    let go_rx = parking_lot::Mutex::new(go_rx);
    let gate: Gate = Arc::new(move |req, l| match (req, l) {
        (1, 1) => {
            held_tx.lock().send(()).unwrap();
            go_rx.lock().recv_timeout(BOUND).unwrap();
            Act::Go
        }
        (2, 2) => Act::Cancel,
        (3, 1) => Act::Panic,
        _ => Act::Go,
    });
    let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), gate);
    let mut pages = Vec::new();
    for req in 1..=4u64 {
        pages.push(start(&pd, req, &prompt(req, 10)).unwrap());
    }
    held_rx.recv_timeout(BOUND).unwrap();
    assert!(pd.rx.abort(1, "client disconnected"));
    assert!(!pd.rx.abort(1, "twice"), "a second abort is a no-op");
    // Prefill confirms while its worker is still held: nothing of request 1 is in flight.
    until("prefill confirmed", || pd.tx.stats().cancelled == 1);
    go_tx.send(()).unwrap();
    assert!(
        matches!(pd.rx.wait(1, BOUND).unwrap(), Outcome::Cancelled(r) if r == "client disconnected")
    );
    assert!(
        matches!(pd.rx.wait(2, BOUND).unwrap(), Outcome::Cancelled(r) if r.contains("prefill gave up"))
    );
    assert!(
        matches!(pd.rx.wait(3, BOUND).unwrap(), Outcome::Cancelled(r) if r.contains("worker failed"))
    );
    assert_eq!(pd.rx.wait(4, BOUND).unwrap(), Outcome::Ready);
    for req in 1..=3 {
        assert!(
            !pd.d.is_live(req),
            "request {req} aborted in the decode cache"
        );
        assert!(pd.d.step(&[req]).is_err());
    }
    pd.d.finish(4).unwrap();
    until("prefill side released", || {
        pd.p.stats().live_requests == 0 && pd.tx.in_flight() == 0
    });
    assert_eq!(pd.d.leak_check().unwrap().device_free, 16);
    assert_eq!(pd.p.leak_check().unwrap().device_free, 16);
    let (rs, ts) = (pd.rx.stats(), pd.tx.stats());
    assert_eq!((rs.finished, rs.cancelled), (1, 3), "{rs:?}");
    assert_eq!((ts.finished, ts.cancelled, ts.failed), (1, 1, 2), "{ts:?}");
    // Only writes already in flight when a transfer ended were refused: a notification
    // read after decode's abort (`after_abort`), or one accepted just before it whose
    // landing then found the pages quarantined (`stale_generation`) — at most the two
    // kinds of one layer for each of the three transfers that ended early.
    let in_flight = rs.refused("after_abort") + rs.refused("stale_generation");
    assert_eq!(rs.refused_total(), in_flight, "{rs:?}");
    assert!(in_flight <= 6, "{rs:?}");
}

/// A reader that panics handling a message fails only that message's request, restarts,
/// and serves everything else — on both sides.
#[test]
fn a_panicking_reader_fails_only_its_request() {
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    let rc = ReceiverConfig {
        hook: Some(Arc::new(|m: &Message| {
            if let Message::Written(w) = m {
                if w.req == 2 && w.layer == 1 && w.kind == BufferKind::Kv {
                    panic!("injected decode reader panic");
                }
            }
        })),
        ..ReceiverConfig::default()
    };
    let sc = SenderConfig {
        hook: Some(Arc::new(|m: &Message| {
            if matches!(m, Message::Bootstrap(b) if b.req == 4) {
                panic!("injected prefill reader panic");
            }
        })),
        ..SenderConfig::default()
    };
    let pd = pd(cache(s, 24, &[]), cache(s, 24, &[]), rc, sc);
    let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), go());
    for req in 1..=5u64 {
        start(&pd, req, &prompt(req, 9)).unwrap();
    }
    for req in [1u64, 3, 5] {
        assert_eq!(
            pd.rx.wait(req, BOUND).unwrap(),
            Outcome::Ready,
            "request {req}"
        );
        pd.d.finish(req).unwrap();
    }
    assert!(matches!(pd.rx.wait(2, BOUND).unwrap(), Outcome::Failed(r) if r.contains("panicked")));
    assert!(
        matches!(pd.rx.wait(4, BOUND).unwrap(), Outcome::Cancelled(r) if r.contains("panicked"))
    );
    let (rs, ts) = (pd.rx.stats(), pd.tx.stats());
    assert_eq!((rs.panics, rs.restarts), (1, 1), "{rs:?}");
    assert_eq!((ts.panics, ts.restarts), (1, 1), "{ts:?}");
    // Both readers still serve.
    start(&pd, 6, &prompt(6, 3)).unwrap();
    assert_eq!(pd.rx.wait(6, BOUND).unwrap(), Outcome::Ready);
    pd.d.finish(6).unwrap();
    until("prefill side released", || pd.p.stats().live_requests == 0);
    assert_eq!(pd.d.leak_check().unwrap().device_free, 24);
    assert_eq!(pd.p.leak_check().unwrap().device_free, 24);
}

/// A confirmation that never comes tears the connection down after the bound (the only
/// safe way to release quarantined pages); a torn-down connection fails every transfer,
/// releases every page, and refuses new transfers with a typed error.
#[test]
fn lost_confirmation_and_teardown_release_everything() {
    let s = spec(KvDtype::Bf16, IndexKDtype::Bf16);
    let d = cache(s, 6, &[]);
    let (d_end, p_end) = local_ends(&d, &d);
    let rc = ReceiverConfig {
        confirm_timeout: Duration::from_millis(300),
        ..ReceiverConfig::default()
    };
    let rx = Receiver::new(d.clone(), d_end, rc).unwrap();
    let m = Manual {
        end: &*p_end,
        geometry: LandingGeometry::new(s, 6).unwrap(),
        spec: s,
        tokens: Default::default(),
    };
    for req in [1u64, 2] {
        d.begin(req, &[]).unwrap();
        let pages = d.alloc(req, 2).unwrap();
        rx.start(req, &prompt(req, 8), &pages).unwrap();
        let _ = m.bootstrap();
    }
    rx.abort(1, "gone");
    assert_eq!(d.leak_check().unwrap().device_quarantined, 2);
    // Prefill never answers: the receiver closes the connection itself.
    assert!(matches!(rx.wait(1, BOUND).unwrap(), Outcome::Cancelled(_)));
    assert!(matches!(rx.wait(2, BOUND).unwrap(), Outcome::Failed(r) if r.contains("closed")));
    assert!(rx.is_closed() && p_end.is_closed());
    assert!(!d.is_live(2));
    assert_eq!(d.leak_check().unwrap().device_free, 6);
    d.begin(3, &[]).unwrap();
    let pages = d.alloc(3, 1).unwrap();
    assert!(matches!(
        rx.start(3, &[1, 2], &pages),
        Err(PdError::Transfer(_))
    ));
    d.abort(3).unwrap();
    d.leak_check().unwrap();
}

/// A peer whose kernels compute with another arithmetic (the CPU's opt-in `amx` path on
/// one node only) is refused at connection: its pages would not hold our bits.
#[test]
fn a_peer_of_another_arithmetic_is_refused() {
    use sparsekit_server::pd::{check_peer, hello, Arithmetic, Role};
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    let mut peer = hello(Role::Decode, &s, Arithmetic::Shared, 4, Vec::new());
    assert!(check_peer(&s, Arithmetic::Shared, &peer, Role::Decode).is_ok());
    assert!(matches!(
        check_peer(&s, Arithmetic::AmxTiles, &peer, Role::Decode),
        Err(PdError::Incompatible(why)) if why.contains("arithmetic")
    ));
    peer.arithmetic = Arithmetic::AmxTiles;
    assert!(check_peer(&s, Arithmetic::AmxTiles, &peer, Role::Decode).is_ok());
    assert!(matches!(
        check_peer(&s, Arithmetic::Shared, &peer, Role::Decode),
        Err(PdError::Incompatible(why)) if why.contains("arithmetic")
    ));
    // The CPU backend reports its path's arithmetic.
    use sparsekit_host::cpu::Isa;
    use sparsekit_host::CpuBackend;
    let scalar = CpuBackend::with_isa(Isa::Scalar).unwrap();
    assert_eq!(scalar.arithmetic(), Arithmetic::Shared);
    if let Ok(amx) = CpuBackend::with_isa(Isa::Amx) {
        assert_eq!(amx.arithmetic(), Arithmetic::AmxTiles);
    }
}

/// Layouts are never adapted: a peer with another index-K layout is refused at
/// connection, and a bootstrap naming other layouts is refused with an abort.
#[test]
fn layout_mismatch_is_refused_not_adapted() {
    let bf = spec(KvDtype::Bf16, IndexKDtype::Bf16);
    let fp = spec(KvDtype::Bf16, IndexKDtype::FP8);
    let (d, p) = (cache(bf, 4, &[]), cache(fp, 4, &[]));
    let (d_end, p_end) = local_ends(&d, &p);
    assert!(matches!(
        Receiver::new(d.clone(), d_end, ReceiverConfig::default()),
        Err(PdError::Incompatible(_))
    ));
    assert!(matches!(
        sparsekit_server::pd::Sender::new(p.clone(), p_end, SenderConfig::default()),
        Err(PdError::Incompatible(_))
    ));
    // Same layouts at connection, but a bootstrap that claims fp8 index keys.
    let pd = pd(
        cache(bf, 4, &[]),
        cache(bf, 4, &[]),
        ReceiverConfig::default(),
        SenderConfig::default(),
    );
    let fp8 = IndexKLayout::new(IndexKDtype::FP8, 32, PAGE).unwrap();
    send(
        &*pd.d_end,
        &Message::Bootstrap(Bootstrap {
            req: 9,
            kv_fingerprint: bf.kv.fingerprint(),
            index_k_fingerprint: fp8.fingerprint(),
            prompt: vec![1, 2, 3],
            pages: vec![PageRef {
                id: 0,
                generation: 0,
            }],
        }),
    );
    until("bootstrap refused", || {
        pd.tx.stats().refused("layout_mismatch") == 1
    });
    assert_eq!(pd.tx.in_flight(), 0);
    assert!(pd.tx.next_job(Duration::from_millis(1)).is_none());
    // Decode hears the refusal (an abort for a request it does not know: counted).
    until("abort counted", || {
        pd.rx.stats().refused("unknown_request") == 1
    });
}

/// Every message is survivable: garbage, mutated frames and valid-but-unexpected messages
/// (aborts and confirmations for unknown requests, duplicate bootstraps, finishes for
/// nothing) thrown at both sides while transfers run and get aborted from both sides; every
/// transfer still ends within its bound and nothing leaks.
#[test]
fn random_messages_and_mass_aborts_wedge_nothing() {
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    let pd = pd(
        cache(s, 192, &[]),
        cache(s, 64, &[]),
        ReceiverConfig::default(),
        SenderConfig::default(),
    );
    let counter = Arc::new(AtomicUsize::new(0));
    let c2 = counter.clone();
    // Prefill gives up on every 7th request at a layer that varies.
    let gate: Gate = Arc::new(move |req, l| {
        c2.fetch_add(1, Ordering::Relaxed);
        if req % 7 == 0 && l == (req as usize / 7) % LAYERS {
            Act::Cancel
        } else {
            Act::Go
        }
    });
    let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), gate);
    let mut rng = 0x5eed_u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let valid_junk = |r: u64| -> Message {
        match r % 6 {
            0 => Message::Abort {
                req: r % 50,
                reason: "random".into(),
            },
            1 => Message::Cancelled {
                req: r % 50,
                reason: String::new(),
            },
            2 => Message::Finished {
                req: r % 50,
                tokens: (r % 9) as u32,
            },
            3 => Message::Bootstrap(Bootstrap {
                req: 1000 + r % 50,
                kv_fingerprint: s.kv.fingerprint(),
                index_k_fingerprint: s.index_k.fingerprint(),
                prompt: vec![1; 5],
                pages: vec![
                    PageRef {
                        id: 191,
                        generation: 0,
                    },
                    PageRef {
                        id: 190,
                        generation: 0,
                    },
                ],
            }),
            4 => Message::Written(Written {
                req: r % 50,
                layer: (r % 5) as u32,
                kind: BufferKind::IndexK,
                fingerprint: s.index_k.fingerprint(),
                pages: vec![PageRef {
                    id: (r % 64) as u32,
                    generation: (r % 3) as u32,
                }],
                checksums: vec![r],
            }),
            _ => Message::Hello(sparsekit_server::pd::hello(
                sparsekit_server::pd::Role::Decode,
                &s,
                sparsekit_host::Arithmetic::Shared,
                1,
                vec![1, 2, 3],
            )),
        }
    };
    let mut live = Vec::new();
    for req in 1..=40u64 {
        // Junk both ways between starts.
        for _ in 0..3 {
            let r = next();
            let mut f = valid_junk(r).encode().unwrap();
            if r % 3 == 0 {
                let i = (r as usize >> 8) % f.len();
                f[i] ^= 0x20;
            }
            if r % 5 == 0 {
                f.truncate((r as usize >> 16) % f.len());
            }
            let _ = if r % 2 == 0 {
                pd.p_end.send(&f)
            } else {
                pd.d_end.send(&f)
            };
        }
        let p = prompt(req, 1 + (next() % 15) as usize);
        if let Ok(pages) = start(&pd, req, &p) {
            live.push((req, p, pages));
        }
        if req % 5 == 0 {
            let victim = live[(next() as usize) % live.len()].0;
            pd.rx.abort(victim, "mass abort");
        }
    }
    assert_eq!(live.len(), 40, "every start accepted");
    let mut ready = 0;
    for (req, p, pages) in &live {
        match pd.rx.wait(*req, BOUND).unwrap() {
            Outcome::Ready => {
                ready += 1;
                let l = (*req as usize) % LAYERS;
                let got = received(&pd.d, *req, pages, l).unwrap();
                assert!(
                    same_tokens(&s, p.len(), &got, &expected(&s, p, l)),
                    "request {req}"
                );
                pd.d.finish(*req).unwrap();
            }
            Outcome::Cancelled(_) | Outcome::Failed(_) => {
                assert!(!pd.d.is_live(*req));
            }
        }
    }
    assert!(ready >= 10, "{ready} of 40 ready");
    until("both sides idle", || {
        pd.rx.in_flight() == 0 && pd.tx.in_flight() == 0 && pd.p.stats().live_requests == 0
    });
    assert_eq!(pd.d.leak_check().unwrap().device_free, 192);
    assert_eq!(pd.p.leak_check().unwrap().device_free, 64);
    let (rs, ts) = (pd.rx.stats(), pd.tx.stats());
    assert!(
        rs.refused_total() > 0 && ts.refused_total() > 0,
        "{rs:?} {ts:?}"
    );
    assert_eq!((rs.panics, ts.panics), (0, 0));
    assert!(counter.load(Ordering::Relaxed) > 0);
}

/// What a [`Tracking`] transport saw, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    /// A write of `req`'s pages landed (logged after it landed).
    Landed(u64),
    /// `req`'s end was confirmed to decode (logged before the confirmation is sent).
    Confirmed(u64),
}

/// A prefill end that logs every landed write and every confirmation.
#[derive(Debug)]
struct Tracking {
    inner: Arc<sparsekit_server::transfer::local::LocalEnd>,
    log: parking_lot::Mutex<Vec<Seen>>,
}

impl Transport for Tracking {
    fn name(&self) -> &'static str {
        "tracking"
    }
    fn peer(&self) -> &sparsekit_server::pd::Hello {
        self.inner.peer()
    }
    fn send(&self, frame: &[u8]) -> Result<(), sparsekit_server::transfer::TransferError> {
        if let Ok(
            Message::Finished { req, .. }
            | Message::Cancelled { req, .. }
            | Message::Abort { req, .. },
        ) = sparsekit_server::pd::wire::decode_frame(frame)
        {
            self.log.lock().push(Seen::Confirmed(req));
        }
        self.inner.send(frame)
    }
    fn recv(
        &self,
        t: Duration,
    ) -> Result<Option<Vec<u8>>, sparsekit_server::transfer::TransferError> {
        self.inner.recv(t)
    }
    fn write(
        &self,
        segments: &[Segment<'_>],
        notification: Option<&[u8]>,
    ) -> Result<(), sparsekit_server::transfer::TransferError> {
        self.inner.write(segments, notification)?;
        if let Some(Ok(Message::Written(w))) =
            notification.map(sparsekit_server::pd::wire::decode_frame)
        {
            self.log.lock().push(Seen::Landed(w.req));
        }
        Ok(())
    }
    fn landing(&self) -> Option<Arc<sparsekit_server::pd::LandingZone>> {
        self.inner.landing()
    }
    fn close(&self, why: &str) {
        self.inner.close(why)
    }
    fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }
}

/// Writes of each request after its confirmation, in a run of `n` requests over a small
/// pool (`in_flight` transfers at a time) with aborts from both sides: decode aborts every
/// third request while prefill is in the middle of it (at a random moment before its
/// second layer), prefill gives up every 11th.
fn late_landings(faults: &[sparsekit_server::pd::PdFault], n: u64, in_flight: u64) -> usize {
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    // Prompts need 3 pages at most.
    let pool = 3 * in_flight as usize;
    let (d, p) = (cache(s, pool, &[]), cache(s, 12, &[]));
    let (d_end, p_end) = local_ends(&d, &p);
    let tracking = Arc::new(Tracking {
        inner: p_end,
        log: parking_lot::Mutex::new(Vec::new()),
    });
    let rx = Arc::new(Receiver::new(d.clone(), d_end, ReceiverConfig::default()).unwrap());
    let sc = SenderConfig {
        faults: sparsekit_server::pd::PdFaults::with(faults),
        ..SenderConfig::default()
    };
    let tx = Arc::new(sparsekit_server::pd::Sender::new(p.clone(), tracking.clone(), sc).unwrap());
    let rx_gate = rx.clone();
    let gate: Gate = Arc::new(move |req, l| {
        // Jitter (not synchronisation): some layers take longer.
        for _ in 0..((req * 7919 + l as u64 * 104_729) % 3000) {
            std::hint::spin_loop();
        }
        if req % 3 == 0 && l == 1 {
            // Requests decode aborts: the abort hits this transfer in flight (prefill
            // goes on only once decode considers it ended).
            until("decode ended the aborted transfer", || {
                rx_gate.outcome(req).is_some()
            });
        }
        if req % 11 == 0 && l == 1 {
            Act::Cancel
        } else {
            Act::Go
        }
    });
    let _w = Worker::spawn(tx.clone(), p.clone(), gate);
    let (abort_tx, abort_rx) = mpsc::channel::<u64>();
    let rx2 = rx.clone();
    let aborter = std::thread::spawn(move || {
        while let Ok(req) = abort_rx.recv_timeout(BOUND) {
            for _ in 0..(req * 2654435761 % 20_000) {
                std::hint::spin_loop();
            }
            rx2.abort(req, "random abort");
        }
    });
    for req in 1..=n {
        let pr = prompt(req, 5 + (req as usize * 7) % 8);
        if req > in_flight {
            let old = req - in_flight;
            rx.wait(old, BOUND).unwrap();
            if d.is_live(old) {
                d.finish(old).unwrap();
            }
        }
        start_on(&d, &rx, req, &pr).unwrap();
        if req % 3 == 0 {
            abort_tx.send(req).unwrap();
        }
    }
    drop(abort_tx);
    aborter.join().unwrap();
    for req in n.saturating_sub(in_flight).max(1)..=n {
        rx.wait(req, BOUND).unwrap();
        if d.is_live(req) {
            d.finish(req).unwrap();
        }
    }
    until("prefill idle", || {
        tx.in_flight() == 0 && p.stats().live_requests == 0
    });
    assert_eq!(d.leak_check().unwrap().device_free, pool);
    let log = tracking.log.lock().clone();
    let mut confirmed = std::collections::HashSet::new();
    let mut late = 0;
    for e in log {
        match e {
            Seen::Confirmed(r) => {
                confirmed.insert(r);
            }
            Seen::Landed(r) if confirmed.contains(&r) => late += 1,
            Seen::Landed(_) => {}
        }
    }
    late
}

/// The quarantine's premise, on the real sender under random aborts from both sides:
/// once prefill confirms a transfer's end, nothing more of it lands. The same check sees
/// the `stale-transfer-write` fault break it (one transfer at a time there, so the next
/// request reuses the aborted one's pages and its writes release the late ones).
#[test]
fn nothing_lands_after_a_confirmation() {
    assert_eq!(late_landings(&[], 60, 4), 0);
    let fault = [sparsekit_server::pd::PdFault::StaleTransferWrite];
    assert!(late_landings(&fault, 30, 1) > 0);
}

/// A decode request that ends while its transfer is in flight (failed by the engine, or
/// served without waiting) gets its transfer aborted — by the reader's next tick or at
/// prefill's next write, whichever comes first — not left active until the stall
/// timeout; its pages are held until prefill confirms, then released; nothing leaks.
#[test]
fn a_transfer_whose_decode_request_ended_is_aborted_and_released() {
    let s = spec(KvDtype::Bf16, IndexKDtype::Bf16);
    let pd = pd(
        cache(s, 16, &[]),
        cache(s, 16, &[]),
        ReceiverConfig::default(),
        SenderConfig::default(),
    );
    let (held_tx, held_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let held_tx = parking_lot::Mutex::new(held_tx);
    let go_rx = parking_lot::Mutex::new(go_rx);
    let gate: Gate = Arc::new(move |_, l| {
        if l == 0 {
            held_tx.lock().send(()).unwrap();
            go_rx.lock().recv_timeout(BOUND).unwrap();
        }
        Act::Go
    });
    let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), gate);
    let p = prompt(5, 20);
    start(&pd, 1, &p).unwrap();
    held_rx.recv_timeout(BOUND).unwrap();
    // The decode side ends the request on its own (as the engine does when a step fails).
    pd.d.abort(1).unwrap();
    go_tx.send(()).unwrap();
    match pd.rx.wait(1, BOUND).unwrap() {
        Outcome::Cancelled(why) => assert!(why.contains("decode request ended"), "{why}"),
        o => panic!("{o:?}"),
    }
    until("the transfer is forgotten", || pd.rx.in_flight() == 0);
    assert_eq!(pd.rx.quarantined_pages(), 0);
    until("decode pages are free", || {
        pd.d.leak_check().is_ok_and(|s| s.device_in_use == 0)
    });
}

/// The mechanism behind `pd-read-before-landed`'s long quarantine: the decode request
/// ends (its early read failed) while prefill is still computing the prompt and has sent
/// nothing. The receiver aborts the transfer on its own — prefill hears `Abort` without
/// having written a byte —; the pages stay quarantined (pinned, never handed out) until
/// prefill confirms, and are free right after.
#[test]
fn a_transfer_whose_decode_request_ended_is_aborted_before_any_write() {
    let s = spec(KvDtype::Bf16, IndexKDtype::Bf16);
    let d = cache(s, 6, &[]);
    let (d_end, p_end) = local_ends(&d, &d);
    let rx = Receiver::new(d.clone(), d_end, ReceiverConfig::default()).unwrap();
    let m = Manual {
        end: &*p_end,
        geometry: LandingGeometry::new(s, 6).unwrap(),
        spec: s,
        tokens: Default::default(),
    };
    let p = prompt(7, 3 * PAGE);
    let pages = start_on(&d, &rx, 7, &p).unwrap();
    assert_eq!(m.bootstrap().req, 7);
    // The engine ends the request (as it does when a step finds its pages not landed).
    d.abort(7).unwrap();
    assert_eq!(d.leak_check().unwrap().device_quarantined, pages.len());
    match m.recv() {
        Message::Abort { req, reason } => {
            assert_eq!(req, 7);
            assert!(reason.contains("decode request ended"), "{reason}");
        }
        other => panic!("expected decode's abort, got {other:?}"),
    }
    // Until prefill confirms, a write may still land: the pages stay held.
    assert_eq!(rx.outcome(7), None);
    assert_eq!(rx.quarantined_pages(), pages.len());
    let st = d.leak_check().unwrap();
    assert_eq!(
        (st.device_quarantined, st.device_free),
        (pages.len(), 6 - pages.len())
    );
    d.begin(8, &[]).unwrap();
    assert!(d.try_alloc(8, 6 - pages.len() + 1).is_err());
    d.abort(8).unwrap();
    send(
        m.end,
        &Message::Cancelled {
            req: 7,
            reason: "decode asked".into(),
        },
    );
    match rx.wait(7, BOUND).unwrap() {
        Outcome::Cancelled(why) => assert!(why.contains("decode request ended"), "{why}"),
        o => panic!("{o:?}"),
    }
    assert_eq!((rx.in_flight(), rx.quarantined_pages()), (0, 0));
    assert_eq!(d.leak_check().unwrap().device_free, 6);
    assert_eq!(rx.stats().refused_total(), 0, "{:?}", rx.stats());
}

/// A decode end whose peer's one-sided writes may land `bound` after the connection
/// closed (as NIXL's can): the local end, with that bound declared.
#[derive(Debug)]
struct LateWrites {
    inner: Arc<sparsekit_server::transfer::local::LocalEnd>,
    bound: Duration,
}

impl Transport for LateWrites {
    fn name(&self) -> &'static str {
        "late-writes"
    }
    fn peer(&self) -> &sparsekit_server::pd::wire::Hello {
        self.inner.peer()
    }
    fn send(&self, frame: &[u8]) -> Result<(), sparsekit_server::transfer::TransferError> {
        self.inner.send(frame)
    }
    fn recv(
        &self,
        timeout: Duration,
    ) -> Result<Option<Vec<u8>>, sparsekit_server::transfer::TransferError> {
        self.inner.recv(timeout)
    }
    fn write(
        &self,
        segments: &[Segment<'_>],
        notification: Option<&[u8]>,
    ) -> Result<(), sparsekit_server::transfer::TransferError> {
        self.inner.write(segments, notification)
    }
    fn landing(&self) -> Option<Arc<sparsekit_server::pd::LandingZone>> {
        self.inner.landing()
    }
    fn close(&self, why: &str) {
        self.inner.close(why)
    }
    fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }
    fn late_write_bound(&self) -> Duration {
        self.bound
    }
}

/// After a teardown, the pages of the transfers in flight stay quarantined for the
/// transport's late-write bound (a write prefill posted may still land in their landing
/// slots), then are free; the requests fail at once.
#[test]
fn a_torn_down_transfer_keeps_its_pages_quarantined_for_the_late_write_bound() {
    let d = cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), 16, &[]);
    let p = cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), 16, &[]);
    let (d_end, _p_end) = local_ends(&d, &p);
    let bound = Duration::from_millis(400);
    let end: Arc<dyn Transport> = Arc::new(LateWrites {
        inner: d_end,
        bound,
    });
    let rx = Receiver::new(d.clone(), end.clone(), ReceiverConfig::default()).unwrap();
    start_on(&d, &rx, 1, &prompt(1, 2 * PAGE)).unwrap();
    let closed_at = std::time::Instant::now();
    end.close("the test tears the connection down");
    match rx.wait(1, BOUND) {
        Ok(Outcome::Failed(_)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(d.stats().device_quarantined, 2, "held past the teardown");
    until("the pins go after the bound", || {
        d.stats().device_quarantined == 0
    });
    assert!(closed_at.elapsed() >= bound, "{:?}", closed_at.elapsed());
    d.leak_check().unwrap();
}

/// Decode's stall bound measures prefill's silence, not its queue: a transfer that waits in
/// prefill's queue for five stall bounds stays alive while prefill's engine advances (its
/// `Pending` heartbeats) and lands bit-exact once a worker takes it; when prefill stops
/// advancing its heartbeats stop, and the bound ends the next transfer (pages released on
/// both sides).
#[test]
fn the_stall_bound_counts_silence_not_queueing() {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    let stall = Duration::from_millis(500);
    let rc = ReceiverConfig {
        stall_timeout: stall,
        ..ReceiverConfig::default()
    };
    let (steps, advancing) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(true)));
    let (st, adv) = (steps.clone(), advancing.clone());
    let sc = SenderConfig {
        heartbeat: Duration::from_millis(20),
        quiet_limit: Duration::from_millis(100),
        // The engine steps whenever it is asked, until it wedges.
        liveness: Some(Arc::new(move || {
            if adv.load(Ordering::Acquire) {
                st.fetch_add(1, Ordering::AcqRel) + 1
            } else {
                st.load(Ordering::Acquire)
            }
        })),
        ..SenderConfig::default()
    };
    let pd = pd(cache(s, 8, &[]), cache(s, 8, &[]), rc, sc);
    let p = prompt(1, 10);
    let pages = start(&pd, 1, &p).unwrap();
    // No worker yet: the job stays queued; a wait of five bounds runs out, the transfer
    // is still active.
    assert!(matches!(pd.rx.wait(1, stall * 5), Err(PdError::Timeout(_))));
    assert_eq!(pd.rx.outcome(1), None);
    let w = Worker::spawn(pd.tx.clone(), pd.p.clone(), go());
    assert_eq!(pd.rx.wait(1, BOUND).unwrap(), Outcome::Ready);
    for l in 0..LAYERS {
        let got = received(&pd.d, 1, &pages, l).unwrap();
        assert!(same_tokens(&s, p.len(), &got, &expected(&s, &p, l)));
    }
    pd.d.finish(1).unwrap();
    drop(w);
    // Prefill's engine wedges: no more heartbeats, the bound ends the queued transfer.
    advancing.store(false, Ordering::Release);
    start(&pd, 2, &prompt(2, 5)).unwrap();
    match pd.rx.wait(2, BOUND).unwrap() {
        Outcome::Failed(r) => assert!(r.contains("no progress"), "{r}"),
        o => panic!("request 2 ended {o:?}"),
    }
    assert!(steps.load(Ordering::Acquire) > 0);
    until("prefill side released", || pd.tx.in_flight() == 0);
    until("decode side released", || {
        pd.d.leak_check().is_ok_and(|c| c.device_free == 8)
    });
    assert_eq!(pd.p.leak_check().unwrap().device_free, 8);
}

/// Heartbeats extend a queued transfer's stall bound, not its total bound: a prefill that
/// names a transfer in `Pending` for ever (its engine advancing, the job never taken)
/// cannot keep decode's pages held past `transfer_timeout`.
#[test]
fn heartbeats_cannot_hold_a_transfer_for_ever() {
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    let (stall, total) = (Duration::from_millis(200), Duration::from_millis(1500));
    let rc = ReceiverConfig {
        stall_timeout: stall,
        transfer_timeout: total,
        ..ReceiverConfig::default()
    };
    let steps = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let st = steps.clone();
    let sc = SenderConfig {
        heartbeat: Duration::from_millis(20),
        quiet_limit: Duration::from_millis(100),
        liveness: Some(Arc::new(move || st.fetch_add(1, Ordering::AcqRel) + 1)),
        ..SenderConfig::default()
    };
    let pd = pd(cache(s, 8, &[]), cache(s, 8, &[]), rc, sc);
    let started = Instant::now();
    start(&pd, 1, &prompt(1, 10)).unwrap();
    // No worker ever takes the job: alive past several stall bounds, ended by the total.
    match pd.rx.wait(1, BOUND).unwrap() {
        Outcome::Failed(r) => assert!(r.contains("not done within"), "{r}"),
        o => panic!("request 1 ended {o:?}"),
    }
    assert!(
        started.elapsed() >= total,
        "ended after {:?}",
        started.elapsed()
    );
    until("prefill side released", || pd.tx.in_flight() == 0);
    until("decode side released", || {
        pd.d.leak_check().is_ok_and(|c| c.device_free == 8)
    });
}

/// A partly filled last page travels as its entries' bytes only: for model1_fp8 KV and
/// fp8 / fp4 index keys (rows, then the scale section at the page's end: two ranges a
/// page) and for token-major layouts, every prompt length around the page size lands
/// bit-exact, with exactly the bytes of the entries on the wire for the last page.
#[test]
fn a_partial_last_page_moves_only_its_entries() {
    let specs = [
        model1_spec(IndexKDtype::FP8),
        model1_spec(IndexKDtype::Fp4E2m1),
        spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16),
    ];
    for s in specs {
        let pd = pd(
            cache(s, 16, &[]),
            cache(s, 16, &[]),
            ReceiverConfig::default(),
            SenderConfig::default(),
        );
        let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), go());
        let mut want_kv = 0usize;
        let mut want_ik = 0usize;
        for (i, n) in [1usize, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE - 2]
            .into_iter()
            .enumerate()
        {
            let req = 10 + i as u64;
            let p = prompt(req, n);
            let pages = start(&pd, req, &p).unwrap();
            assert_eq!(
                pd.rx.wait(req, BOUND).unwrap(),
                Outcome::Ready,
                "{n} tokens"
            );
            for l in 0..LAYERS {
                let got = received(&pd.d, req, &pages, l).unwrap();
                assert!(
                    same_tokens(&s, n, &got, &expected(&s, &p, l)),
                    "{n} tokens layer {l}"
                );
            }
            pd.d.finish(req).unwrap();
            let (full, rest) = (n / PAGE, n % PAGE);
            want_kv += LAYERS * (full * s.kv.bytes_per_page() + rest * s.kv.bytes_per_token());
            want_ik +=
                LAYERS * (full * s.index_k.bytes_per_page() + rest * s.index_k.bytes_per_token());
        }
        until("prefill idle", || pd.tx.in_flight() == 0);
        let st = pd.tx.stats();
        assert_eq!(
            (st.kv_bytes as usize, st.index_k_bytes as usize),
            (want_kv, want_ik),
            "bytes on the wire ({:?} / {:?})",
            s.kv.dtype(),
            s.index_k.dtype()
        );
    }
}
