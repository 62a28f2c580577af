//! The claim counter behind [`super::tasks`]: runs of consecutive task indices handed to
//! threads that ask concurrently, every index `0..n` to exactly one of them. Guided: a
//! claim takes `1/(2·threads)` of what is left (so a thread's next task is most often the
//! next index, which the ops' look-ahead prefetches assume), never less than `min_run`
//! (cheap row-wise tasks) and never past `n`. Model-checked by `host/tests/claims_loom.rs`,
//! which compiles this file against loom's atomics.

use std::ops::Range;

use crate::sync::{AtomicUsize, Ordering};

/// Hands out the indices `0..n` in runs.
pub(crate) struct Claims {
    next: AtomicUsize,
    n: usize,
    threads: usize,
    min_run: usize,
}

impl Claims {
    /// Runs over `0..n` for about `threads` claimants, at least `min_run` long (but the
    /// last).
    pub(crate) fn new(n: usize, threads: usize, min_run: usize) -> Self {
        Claims {
            next: AtomicUsize::new(0),
            n,
            threads: threads.max(1),
            min_run: min_run.max(1),
        }
    }

    /// The next run, or `None` once every index has been handed out. Each index is in
    /// the run of exactly one successful exchange.
    pub(crate) fn claim(&self) -> Option<Range<usize>> {
        let mut first = self.next.load(Ordering::Relaxed);
        loop {
            if first >= self.n {
                return None;
            }
            let left = self.n - first;
            let len = left.div_ceil(2 * self.threads).max(self.min_run).min(left);
            match self.next.compare_exchange_weak(
                first,
                first + len,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(first..first + len),
                Err(now) => first = now,
            }
        }
    }
}
