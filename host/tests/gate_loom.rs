//! A loom model of the admission gate of the CPU backend's tasks (`host/src/cpu/gate.rs`,
//! included here with loom's atomics behind the same facade as `host/src/sync.rs`): in
//! every interleaving of a caller and its helpers, a helper touches the caller's op only
//! while the caller has not finished waiting (loom's cell reports any access that races
//! with the caller's release of it), every helper that entered is waited for, and every
//! helper that starts after the close stays out.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

/// `crate::sync` for the gate, on loom.
mod sync {
    pub use loom::sync::atomic::{AtomicUsize, Ordering};
}

#[path = "../src/cpu/gate.rs"]
#[allow(dead_code)]
mod gate;

use gate::Gate;
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;

/// The caller's op: one output cell per helper, written while inside; the caller reads
/// them back and then "frees" them (writes them) after its wait.
struct Op {
    gate: Gate,
    outputs: Vec<UnsafeCell<usize>>,
    entered: AtomicUsize,
}

// SAFETY: a test model: loom's cell checks every access for races itself.
unsafe impl Sync for Op {}

fn check(helpers: usize) {
    let mut model = loom::model::Builder::new();
    if helpers > 1 {
        model.preemption_bound = Some(3);
    }
    model.check(move || {
        let op = Arc::new(Op {
            gate: Gate::new(),
            outputs: (0..helpers).map(|_| UnsafeCell::new(0)).collect(),
            entered: AtomicUsize::new(0),
        });
        let threads: Vec<_> = (0..helpers)
            .map(|h| {
                let op = op.clone();
                loom::thread::spawn(move || {
                    if op.gate.enter() {
                        op.entered.fetch_add(1, Ordering::Relaxed);
                        // SAFETY: the gate is what makes this exclusive of the caller's
                        // write below (each helper has its own cell); loom checks it.
                        op.outputs[h].with_mut(|v| unsafe { *v += 1 });
                        op.gate.leave();
                    }
                })
            })
            .collect();
        op.gate.close();
        while !op.gate.is_empty() {
            loom::thread::yield_now();
        }
        // Every helper that entered has added its one, and none is inside: the caller's
        // write cannot race with a helper's access.
        let seen: usize = op
            .outputs
            .iter()
            .map(|c| {
                // SAFETY: after the wait no helper is inside; loom checks it.
                c.with_mut(|v| unsafe {
                    let seen = *v;
                    *v = usize::MAX;
                    seen
                })
            })
            .sum();
        assert_eq!(seen, op.entered.load(Ordering::Relaxed));
        // Closed for good: a helper starting now stays out.
        assert!(!op.gate.enter());
        for t in threads {
            t.join().unwrap();
        }
    });
}

#[test]
fn one_helper() {
    check(1);
}

#[test]
fn two_helpers() {
    check(2);
}
