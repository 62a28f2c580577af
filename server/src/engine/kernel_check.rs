//! The engine's independent kernel checks ([`KernelCheck`]: a sample of its own
//! indexer, top-k and sparse-attention calls re-checked by a [`KernelAudit`]) and the
//! harness's kernel fault ([`KernelFault`]: a top-k that returns the k−1 best and one
//! wrong slot — the kind of bug that an uncached reference run on the same backend shares
//! and so never sees).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use sparsekit_host::ops::{QueryRange, Topk, TopkOutput};
use sparsekit_host::KernelAudit;

/// The audited ops, in counter order.
pub const OPS: [&str; 4] = ["indexer_logits", "topk", "sparse_mla", "sparse_mla_v4"];

/// Which op a call is (an index into [`OPS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuditedOp {
    IndexerLogits = 0,
    Topk = 1,
    SparseMla = 2,
    SparseMlaV4 = 3,
}

/// What an engine's kernel checks use: the auditor and the sampling (one call in `every`
/// of each op). Each engine started with it counts its own checks.
#[derive(Clone, Debug)]
pub struct KernelCheckConfig {
    pub audit: Arc<dyn KernelAudit>,
    pub every: u64,
}

/// Checks one call of every op in `every` (the first call of each op included) with
/// `audit`, and counts the outcomes.
#[derive(Debug)]
pub struct KernelCheck {
    audit: Arc<dyn KernelAudit>,
    every: u64,
    calls: [AtomicU64; OPS.len()],
    ok: [AtomicU64; OPS.len()],
    mismatch: [AtomicU64; OPS.len()],
    first_mismatch: parking_lot::Mutex<Option<String>>,
}

/// Counts of one op's checked calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckCounts {
    pub ok: u64,
    pub mismatch: u64,
}

impl KernelCheck {
    /// Checks one call in `every` (at least 1: every call).
    pub fn new(audit: Arc<dyn KernelAudit>, every: u64) -> Self {
        KernelCheck {
            audit,
            every: every.max(1),
            calls: Default::default(),
            ok: Default::default(),
            mismatch: Default::default(),
            first_mismatch: parking_lot::Mutex::new(None),
        }
    }

    /// The auditor.
    pub fn audit(&self) -> &dyn KernelAudit {
        &*self.audit
    }

    /// Whether this call of `op` is one of the sample (counts the call).
    pub fn due(&self, op: AuditedOp) -> bool {
        self.calls[op as usize].fetch_add(1, Ordering::Relaxed) % self.every == 0
    }

    /// Records a check's outcome.
    pub fn record(&self, op: AuditedOp, outcome: Result<(), String>) {
        let i = op as usize;
        match outcome {
            Ok(()) => {
                self.ok[i].fetch_add(1, Ordering::Relaxed);
            }
            Err(why) => {
                self.mismatch[i].fetch_add(1, Ordering::Relaxed);
                tracing::error!(op = OPS[i], "kernel check: {why}");
                self.first_mismatch
                    .lock()
                    .get_or_insert_with(|| format!("{}: {why}", OPS[i]));
            }
        }
    }

    /// Counts so far, per op in [`OPS`] order.
    pub fn counts(&self) -> [CheckCounts; OPS.len()] {
        std::array::from_fn(|i| CheckCounts {
            ok: self.ok[i].load(Ordering::Relaxed),
            mismatch: self.mismatch[i].load(Ordering::Relaxed),
        })
    }

    /// The first mismatch seen, if any.
    pub fn first_mismatch(&self) -> Option<String> {
        self.first_mismatch.lock().clone()
    }
}

/// An injected kernel bug (harness only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFault {
    /// Top-k keeps the k−1 best of a row and replaces the k-th with the slot of a position
    /// it did not select (in the first row that has one).
    TopkWrongSlot,
}

impl KernelFault {
    /// Corrupts a top-k output `out` (i32 `[rows, k]`) of `op` in place.
    pub fn apply_topk(&self, op: &Topk<'_>, out: &mut [i32]) {
        let k = op.k;
        if k == 0 {
            return;
        }
        for (r, range) in op.rows.iter().enumerate() {
            let Some(row) = out.get_mut(r * k..(r + 1) * k) else {
                return;
            };
            if let Some(wrong) = unselected(op, range, row) {
                row[k - 1] = wrong;
                return;
            }
        }
    }
}

/// The output entry of a position of `range` that `row` did not select.
fn unselected(op: &Topk<'_>, range: &QueryRange, row: &[i32]) -> Option<i32> {
    (range.start..range.end)
        .map(|pos| match &op.output {
            TopkOutput::Positions => pos as i32,
            TopkOutput::Slots {
                page_table,
                page_size,
            } => page_table.slot(range.request as usize, pos as usize, *page_size) as i32,
        })
        .find(|e| !row.contains(e))
}
