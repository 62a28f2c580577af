//! A loom model of the CPU backend's task claims (`host/src/cpu/claims.rs`, included here
//! with loom's atomics behind the same facade as `host/src/sync.rs`): in every
//! interleaving of concurrent claimants, every index `0..n` is handed out exactly once,
//! each run is consecutive and at least `min_run` long (but the last), and every claimant
//! ends with `None`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

/// `crate::sync` for the claims, on loom.
mod sync {
    pub use loom::sync::atomic::{AtomicUsize, Ordering};
}

#[path = "../src/cpu/claims.rs"]
#[allow(dead_code)]
mod claims;

use claims::Claims;
use loom::sync::Arc;

/// Every claimant drains; the runs they got, put together, are `0..n` once each. With
/// three claimants the interleavings are bounded to three preemptions (loom's own
/// recommendation for larger models: the exhaustive search does not finish).
fn check(n: usize, claimants: usize, min_run: usize) {
    let mut model = loom::model::Builder::new();
    if claimants > 2 {
        model.preemption_bound = Some(3);
    }
    model.check(move || {
        let c = Arc::new(Claims::new(n, claimants, min_run));
        let drain = |c: &Claims| {
            let mut got = Vec::new();
            while let Some(r) = c.claim() {
                got.push(r);
            }
            got
        };
        let others: Vec<_> = (1..claimants)
            .map(|_| {
                let c = c.clone();
                loom::thread::spawn(move || drain(&c))
            })
            .collect();
        let mut runs = drain(&c);
        for t in others {
            runs.extend(t.join().unwrap());
        }
        let mut seen = vec![0u8; n];
        for r in &runs {
            assert!(r.start < r.end && r.end <= n, "run {r:?} of {n}");
            assert!(r.len() >= min_run || r.end == n, "short run {r:?}");
            for i in r.clone() {
                seen[i] += 1;
            }
        }
        assert!(seen.iter().all(|&s| s == 1), "indices handed out {seen:?}");
        assert!(c.claim().is_none());
    });
}

#[test]
fn two_claimants_get_every_index_once() {
    check(5, 2, 1);
}

#[test]
fn three_claimants_get_every_index_once() {
    check(4, 3, 1);
}

#[test]
fn runs_keep_their_minimum_length() {
    check(7, 2, 3);
}
