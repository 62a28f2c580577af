//! The PD fault injections at the transfer level. With the checks on, each is caught by
//! the check it did not disable (refused, counted, the request never readable); with the
//! checks off (`--no-verify`) each makes decode serve bytes prefill never computed for that
//! request — so neither check is decorative. Controls: without a fault, checks off change
//! nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::pd_common;

use std::sync::{mpsc, Arc};

use pd_common::*;
use sparsekit_host::cache::Fault;
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_host::Error;
use sparsekit_server::pd::{Checks, Outcome, PdFault, PdFaults, ReceiverConfig, SenderConfig};

fn receiver(checks: Checks) -> ReceiverConfig {
    ReceiverConfig {
        checks,
        ..ReceiverConfig::default()
    }
}

fn faulty_sender(f: PdFault) -> SenderConfig {
    SenderConfig {
        faults: PdFaults::with(&[f]),
        ..SenderConfig::default()
    }
}

/// Whether every layer of `req` reads back as prefill computed `prompt`.
fn intact(pd: &Pd, req: u64, prompt: &[u32], pages: &[sparsekit_host::cache::PageRef]) -> bool {
    let s = *pd.d.spec();
    (0..LAYERS).all(|l| {
        same_tokens(
            &s,
            prompt.len(),
            &received(&pd.d, req, pages, l).unwrap(),
            &expected(&s, prompt, l),
        )
    })
}

/// `pd-fp8-frame`: prefill frames bf16 index-K pages with the fp8 layout.
/// Checks on: the frame's fingerprint refuses it. Fingerprints off: the checksums of what
/// landed refuse it. Everything off: the misplaced bytes are served.
#[test]
fn pd_fp8_frame_is_caught_by_fingerprint_then_checksums_else_corrupts() {
    let s = spec(KvDtype::Bf16, IndexKDtype::Bf16);
    let cases = [
        (Checks::all(), "layout_mismatch"),
        (
            Checks {
                fingerprints: false,
                checksums: true,
            },
            "checksum",
        ),
        (Checks::none(), ""),
    ];
    for (checks, reason) in cases {
        let pd = pd(
            cache(s, 8, &[]),
            cache(s, 8, &[]),
            receiver(checks),
            faulty_sender(PdFault::Fp8Frame),
        );
        let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), go());
        let p = prompt(3, 11);
        let pages = start(&pd, 1, &p).unwrap();
        let out = pd.rx.wait(1, BOUND).unwrap();
        let st = pd.rx.stats();
        if reason.is_empty() {
            assert_eq!(out, Outcome::Ready);
            assert!(
                !intact(&pd, 1, &p, &pages),
                "fp8-framed index-K served intact?"
            );
            // The KV pages are fine: only index-K was mis-sized.
            let got = received(&pd.d, 1, &pages, 0).unwrap();
            let want = expected(&s, &p, 0);
            assert!((0..p.len()).all(|t| {
                let r = s.kv.slot_token_bytes(t);
                got.0[r.clone()] == want.0[r]
            }));
            assert_eq!(st.refused_total(), 0, "{st:?}");
            pd.d.finish(1).unwrap();
        } else {
            assert!(matches!(out, Outcome::Failed(_)), "{checks:?}: {out:?}");
            assert_eq!(st.refused(reason), 1, "{checks:?}: {st:?}");
            assert!(!pd.d.is_live(1), "a refused transfer is never readable");
        }
        until("prefill idle", || {
            pd.tx.in_flight() == 0 && pd.p.stats().live_requests == 0
        });
        assert_eq!(pd.d.leak_check().unwrap().device_free, 8);
        pd.p.leak_check().unwrap();
    }
    // Where index-K is fp8 anyway, the fault changes nothing.
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    let pd = pd(
        cache(s, 8, &[]),
        cache(s, 8, &[]),
        receiver(Checks::all()),
        faulty_sender(PdFault::Fp8Frame),
    );
    let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), go());
    let p = prompt(3, 11);
    let pages = start(&pd, 1, &p).unwrap();
    assert_eq!(pd.rx.wait(1, BOUND).unwrap(), Outcome::Ready);
    assert!(intact(&pd, 1, &p, &pages));
}

/// `pd-read-before-landed`: decode's step hands out a layer without waiting for the
/// transfer's ready token (the cache fault `skip-index-wait`). With the landed-stamp check
/// the read is refused (`NotLanded`); without it, decode reads bytes that never arrived.
#[test]
fn pd_read_before_landed_is_caught_by_landed_stamps_else_corrupts() {
    let s = spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16);
    for verify in [true, false] {
        let mut faults = PdFault::ReadBeforeLanded.cache_faults();
        assert_eq!(faults, vec![Fault::SkipIndexWait]);
        if !verify {
            faults.push(Fault::NoLandedCheck);
        }
        let checks = if verify {
            Checks::all()
        } else {
            Checks::none()
        };
        let pd = pd(
            cache(s, 8, &faults),
            cache(s, 8, &[]),
            receiver(checks),
            SenderConfig::default(),
        );
        let (held_tx, held_rx) = mpsc::channel::<()>();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let held_tx = parking_lot::Mutex::new(held_tx);
        let go_rx = parking_lot::Mutex::new(go_rx);
        let gate: Gate = Arc::new(move |_, l| {
            if l == 1 {
                held_tx.lock().send(()).unwrap();
                go_rx.lock().recv_timeout(BOUND).unwrap();
            }
            Act::Go
        });
        let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), gate);
        let p = prompt(9, 10);
        let pages = start(&pd, 1, &p).unwrap();
        held_rx.recv_timeout(BOUND).unwrap();
        // Layer 1 has not been sent: read it anyway.
        let early = received(&pd.d, 1, &pages, 1);
        if verify {
            let e = early.unwrap_err();
            assert!(
                matches!(&e, Error::RequestFailed { cause, .. } if matches!(**cause, Error::NotLanded { .. })),
                "{e:?}"
            );
        } else {
            let got = early.unwrap();
            assert!(
                !same_tokens(&s, p.len(), &got, &expected(&s, &p, 1)),
                "read bytes that were never sent"
            );
        }
        go_tx.send(()).unwrap();
        assert_eq!(pd.rx.wait(1, BOUND).unwrap(), Outcome::Ready);
        // Once landed, the same read is correct.
        assert!(intact(&pd, 1, &p, &pages));
        pd.d.finish(1).unwrap();
        pd.d.leak_check().unwrap();
    }
}

/// `stale-transfer-write`: prefill confirms an aborted transfer as cancelled while its
/// writes are still in flight; decode (rightly) releases and reuses the pages, and the late
/// writes land in them. Checks on: the late notification is refused (its request ended)
/// and the reusing transfer's checksums refuse its overwritten pages. Checks off: the
/// reusing request is served the aborted request's bytes.
#[test]
fn stale_transfer_write_is_caught_by_checksums_else_corrupts() {
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    for verify in [true, false] {
        let checks = if verify {
            Checks::all()
        } else {
            Checks::none()
        };
        let pd = pd(
            cache(s, 3, &[]),
            cache(s, 8, &[]),
            receiver(checks),
            faulty_sender(PdFault::StaleTransferWrite),
        );
        let (held_tx, held_rx) = mpsc::channel::<()>();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let held_tx = parking_lot::Mutex::new(held_tx);
        let go_rx = parking_lot::Mutex::new(go_rx);
        let gate: Gate = Arc::new(move |req, l| {
            if (req, l) == (1, 1) {
                held_tx.lock().send(()).unwrap();
                go_rx.lock().recv_timeout(BOUND).unwrap();
            }
            Act::Go
        });
        let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), gate);
        let p1 = prompt(1, 12);
        let pages1 = start(&pd, 1, &p1).unwrap();
        held_rx.recv_timeout(BOUND).unwrap();
        assert!(pd.rx.abort(1, "client went away"));
        // The premature confirmation arrives; decode releases the pages.
        assert!(matches!(
            pd.rx.wait(1, BOUND).unwrap(),
            Outcome::Cancelled(_)
        ));
        let p2 = prompt(2, 12);
        let pages2 = start(&pd, 2, &p2).unwrap();
        let mut a: Vec<u32> = pages1.iter().map(|p| p.id).collect();
        let mut b: Vec<u32> = pages2.iter().map(|p| p.id).collect();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "request 2 reuses request 1's pages");
        go_tx.send(()).unwrap();
        let out = pd.rx.wait(2, BOUND).unwrap();
        let st = pd.rx.stats();
        assert!(
            st.refused("ended") >= 1,
            "the late notification is refused: {st:?}"
        );
        if verify {
            assert!(matches!(out, Outcome::Failed(_)), "{out:?}");
            assert_eq!(st.refused("checksum"), 1, "{st:?}");
            assert!(!pd.d.is_live(2));
        } else {
            assert_eq!(out, Outcome::Ready);
            assert!(!intact(&pd, 2, &p2, &pages2), "the late write was served");
            pd.d.finish(2).unwrap();
        }
        until("prefill idle", || {
            pd.tx.in_flight() == 0 && pd.p.stats().live_requests == 0
        });
        assert_eq!(pd.d.leak_check().unwrap().device_free, 3);
        pd.p.leak_check().unwrap();
    }
}

/// Controls: without a fault, the same scenarios with every check off stay bit-exact —
/// the corruption above comes from the faults, the refusals from the checks.
#[test]
fn without_faults_checks_off_change_nothing() {
    let s = spec(KvDtype::Bf16, IndexKDtype::Bf16);
    let pd = pd(
        cache(s, 3, &[Fault::NoLandedCheck]),
        cache(s, 8, &[]),
        receiver(Checks::none()),
        SenderConfig::default(),
    );
    let (held_tx, held_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let held_tx = parking_lot::Mutex::new(held_tx);
    let go_rx = parking_lot::Mutex::new(go_rx);
    let gate: Gate = Arc::new(move |req, l| {
        if (req, l) == (1, 1) {
            held_tx.lock().send(()).unwrap();
            go_rx.lock().recv_timeout(BOUND).unwrap();
        }
        Act::Go
    });
    let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), gate);
    let p1 = prompt(1, 12);
    start(&pd, 1, &p1).unwrap();
    held_rx.recv_timeout(BOUND).unwrap();
    assert!(pd.rx.abort(1, "client went away"));
    go_tx.send(()).unwrap();
    assert!(matches!(
        pd.rx.wait(1, BOUND).unwrap(),
        Outcome::Cancelled(_)
    ));
    let p2 = prompt(2, 12);
    let pages2 = start(&pd, 2, &p2).unwrap();
    assert_eq!(pd.rx.wait(2, BOUND).unwrap(), Outcome::Ready);
    assert!(intact(&pd, 2, &p2, &pages2));
    pd.d.finish(2).unwrap();
    assert_eq!(pd.d.leak_check().unwrap().device_free, 3);
}

/// `model1-scales-as-interleaved`: prefill's copy of a partly filled last page takes a
/// model1_fp8 page for token-interleaved — the rows land, the tile scales at the page's
/// end do not. Checks on: the per-page checksum refuses the page (the transfer fails,
/// nothing is readable). Checks off: decode serves the prompt's last tokens with the
/// landing zone's stale scale bytes. A page-aligned prompt moves whole pages and is
/// untouched by the fault.
#[test]
fn model1_scales_as_interleaved_is_caught_by_checksums_else_corrupts() {
    let s = model1_spec(IndexKDtype::FP8);
    for checks in [Checks::all(), Checks::none()] {
        let pd = pd(
            cache(s, 8, &[]),
            cache(s, 8, &[]),
            receiver(checks),
            faulty_sender(PdFault::Model1ScalesAsInterleaved),
        );
        let _w = Worker::spawn(pd.tx.clone(), pd.p.clone(), go());
        let p = prompt(4, 2 * PAGE + 3);
        let pages = start(&pd, 1, &p).unwrap();
        let out = pd.rx.wait(1, BOUND).unwrap();
        let st = pd.rx.stats();
        if checks == Checks::all() {
            assert!(matches!(out, Outcome::Failed(_)), "{out:?}");
            assert_eq!(st.refused("checksum"), 1, "{st:?}");
            assert!(!pd.d.is_live(1), "a refused transfer is never readable");
        } else {
            assert_eq!(out, Outcome::Ready);
            assert!(!intact(&pd, 1, &p, &pages), "the scales landed?");
            // The full pages came whole: only the last page's scales are missing.
            let got = received(&pd.d, 1, &pages, 0).unwrap();
            let want = expected(&s, &p, 0);
            assert!((0..2 * PAGE).all(|t| {
                let r = s.kv.slot_tile_scale_bytes(t);
                got.0[r.clone()] == want.0[r]
            }));
            assert_eq!(st.refused_total(), 0, "{st:?}");
            pd.d.finish(1).unwrap();
        }
        // A page-aligned prompt is untouched.
        let p2 = prompt(5, 2 * PAGE);
        let pages2 = start(&pd, 2, &p2).unwrap();
        assert_eq!(pd.rx.wait(2, BOUND).unwrap(), Outcome::Ready);
        assert!(intact(&pd, 2, &p2, &pages2));
        pd.d.finish(2).unwrap();
        until("prefill idle", || {
            pd.tx.in_flight() == 0 && pd.p.stats().live_requests == 0
        });
        assert_eq!(pd.d.leak_check().unwrap().device_free, 8);
        pd.p.leak_check().unwrap();
    }
}
