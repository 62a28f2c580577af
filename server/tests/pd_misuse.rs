//! The PD endpoints' public API used wrongly on purpose (found by a hostile-caller
//! review): prefill cannot stage pages its step does not hold, and an abort with a reason
//! too long for the wire still reaches prefill (cut to fit).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use crate::pd_common;

use std::time::Duration;

use pd_common::*;
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_server::pd::{ReceiverConfig, SenderConfig};

/// A PD pair over two 16-page bf16 caches, the receiver's defaults, sender `sc`.
fn pair(sc: SenderConfig) -> Pd {
    let s = spec(KvDtype::Bf16, IndexKDtype::Bf16);
    pd(
        cache(s, 16, &[]),
        cache(s, 16, &[]),
        ReceiverConfig::default(),
        sc,
    )
}

/// `Job::stage` copies pages by id out of whole-buffer views: pages the guard's step does
/// not hold (here a released request's) are refused.
#[test]
fn a_job_stages_only_pages_its_step_holds() {
    let pd = pair(SenderConfig::default());
    let prompt = prompt(3, 2 * PAGE);
    start(&pd, 1, &prompt).unwrap();
    let job = pd
        .tx
        .next_job(Duration::from_secs(10))
        .expect("bootstrap reached prefill");
    // Prefill: request 10 holds the real pages; request 11's pages are released (stale).
    let real = fill(&pd.p, 10, &prompt);
    let stale = fill(&pd.p, 11, &prompt);
    pd.p.abort(11).unwrap();
    let mut step = pd.p.step(&[10]).unwrap();
    let g = step.wait_layer(0).unwrap();
    assert!(job.stage(&g, &real).is_ok(), "the step's own pages stage");
    let r = job.stage(&g, &stale);
    assert!(r.is_err(), "stale pages of an aborted request were staged");
}

/// A reason longer than `wire::MAX_REASON` is cut to fit: the `Abort` still reaches
/// prefill (else prefill would go on writing into quarantined pages).
#[test]
fn an_abort_with_a_long_reason_reaches_prefill() {
    let pd = pair(SenderConfig::default());
    let prompt = prompt(4, 2 * PAGE);
    start(&pd, 1, &prompt).unwrap();
    let job = pd
        .tx
        .next_job(Duration::from_secs(10))
        .expect("bootstrap reached prefill");
    assert!(pd.rx.abort(1, &"x".repeat(2000)), "the transfer was active");
    let t = std::time::Instant::now();
    while !job.is_cancelled() && t.elapsed() < Duration::from_secs(3) {
        std::thread::yield_now();
    }
    assert!(
        job.is_cancelled(),
        "decode aborted the transfer but prefill was never told"
    );
}

/// A peer cannot queue transfers without bound: past `max_jobs` a bootstrap is refused
/// (`overloaded`) and decode's transfer fails with that reason; the jobs already taken
/// are untouched.
#[test]
fn bootstraps_beyond_max_jobs_are_refused() {
    let pd = pair(SenderConfig {
        max_jobs: 1,
        ..Default::default()
    });
    start(&pd, 1, &prompt(5, 2 * PAGE)).unwrap();
    start(&pd, 2, &prompt(6, 2 * PAGE)).unwrap();
    let out = pd.rx.wait(2, Duration::from_secs(10)).unwrap();
    match out {
        sparsekit_server::pd::Outcome::Failed(why)
        | sparsekit_server::pd::Outcome::Cancelled(why) => {
            assert!(
                why.contains("overloaded") || why.contains("in flight"),
                "{why}"
            )
        }
        o => panic!("the second transfer was not refused: {o:?}"),
    }
    assert_eq!(pd.tx.stats().refused("overloaded"), 1);
    assert!(
        pd.rx.outcome(1).is_none(),
        "the first transfer is still live"
    );
    let job = pd
        .tx
        .next_job(Duration::from_secs(10))
        .expect("the first job");
    assert_eq!(job.request(), 1);
}
