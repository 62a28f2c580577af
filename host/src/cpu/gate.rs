//! The admission gate behind [`super::tasks`]: helper jobs may join a caller's op only
//! while the gate is open, and the caller closes it and waits for the helpers inside to
//! leave before it returns. A helper that starts after the close never touches the op
//! (which lives on the caller's stack), so the caller never waits for a helper that has
//! not started — the wake-up of an idle core it would otherwise sit out. Model-checked by
//! `host/tests/gate_loom.rs`, which compiles this file against loom's atomics.

use crate::sync::{AtomicUsize, Ordering};

/// Set once the caller has closed the gate; the bits below count the helpers inside.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// Open until [`Gate::close`]; counts the helpers inside.
pub(crate) struct Gate {
    state: AtomicUsize,
}

impl Gate {
    /// An open gate, nobody inside.
    pub(crate) fn new() -> Self {
        Gate {
            state: AtomicUsize::new(0),
        }
    }

    /// Enters if the gate is still open (`true`): the caller then waits for this helper's
    /// [`Gate::leave`] before it returns. `false` once closed: the helper must not touch
    /// the op.
    pub(crate) fn enter(&self) -> bool {
        let mut now = self.state.load(Ordering::Relaxed);
        loop {
            if now & CLOSED != 0 {
                return false;
            }
            // Acquire: a helper inside sees everything the caller did before it opened
            // the gate (the spawn gives that too; this keeps the gate self-contained).
            match self.state.compare_exchange_weak(
                now,
                now + 1,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(seen) => now = seen,
            }
        }
    }

    /// Leaves after a successful [`Gate::enter`]. Release: the helper's writes (its tasks'
    /// outputs) happen before the caller sees it gone. `true` when this was the last
    /// helper inside a closed gate: the caller may be parked, waiting for it.
    pub(crate) fn leave(&self) -> bool {
        self.state.fetch_sub(1, Ordering::Release) == CLOSED | 1
    }

    /// Closes the gate: no helper enters after this.
    pub(crate) fn close(&self) {
        self.state.fetch_or(CLOSED, Ordering::Relaxed);
    }

    /// Whether every helper that entered has left. Acquire: once `true` (after
    /// [`Gate::close`]), every helper's work happened before, and none comes again.
    pub(crate) fn is_empty(&self) -> bool {
        self.state.load(Ordering::Acquire) & !CLOSED == 0
    }
}
