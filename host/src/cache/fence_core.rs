//! The ready-token protocol's synchronisation core: per-layer "landed" flags and a first
//! failure behind one mutex and condvar. The writer (io worker, inbound transfer)
//! publishes layer `i` after its bytes are written; a reader's `wait(i, deadline)` returns
//! `Ok` only after that publish (mutex release/acquire orders the bytes before it), with
//! the failure the writer reported, or with `TimedOut` at the deadline. A failure wins over
//! a landed flag: once a load failed, none of its layers may be read.
//!
//! This file names its primitives through `crate::sync`, so the model checkers can
//! compile it against loom's or shuttle's primitives (`host/tests/fence_loom.rs`,
//! `host/tests/cache_shuttle.rs`).

use std::time::Instant;

use crate::sync::{Condvar, Mutex};

/// Landed flags of `num_layers` layers plus the first failure.
#[derive(Debug)]
pub struct FenceCore<E> {
    state: Mutex<State<E>>,
    cv: Condvar,
}

#[derive(Debug)]
struct State<E> {
    ready: Vec<bool>,
    failed: Option<E>,
}

/// Why a wait returned without the layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitError<E> {
    /// The load failed (or was cancelled) with this error.
    Failed(E),
    /// The deadline passed first.
    TimedOut,
}

impl<E: Clone> FenceCore<E> {
    /// No layer landed yet.
    pub fn new(num_layers: usize) -> Self {
        FenceCore {
            state: Mutex::new(State {
                ready: vec![false; num_layers],
                failed: None,
            }),
            cv: Condvar::new(),
        }
    }

    /// Marks `layer` landed and wakes waiters. Call after its bytes are written.
    pub fn publish(&self, layer: usize) {
        let mut s = self.state.lock();
        if let Some(r) = s.ready.get_mut(layer) {
            *r = true;
        }
        drop(s);
        self.cv.notify_all();
    }

    /// Records a failure (the first one wins) and wakes waiters. Returns whether this call
    /// was the first failure.
    pub fn fail(&self, e: E) -> bool {
        let mut s = self.state.lock();
        let first = s.failed.is_none();
        if first {
            s.failed = Some(e);
        }
        drop(s);
        self.cv.notify_all();
        first
    }

    /// Blocks until `layer` landed (`Ok`), the load failed, or `deadline` passed.
    pub fn wait(&self, layer: usize, deadline: Instant) -> Result<(), WaitError<E>> {
        let mut s = self.state.lock();
        loop {
            if let Some(e) = &s.failed {
                return Err(WaitError::Failed(e.clone()));
            }
            if s.ready.get(layer).copied().unwrap_or(false) {
                return Ok(());
            }
            if self.cv.wait_until(&mut s, deadline).timed_out() {
                // One last look: a publish may have raced the timeout.
                if let Some(e) = &s.failed {
                    return Err(WaitError::Failed(e.clone()));
                }
                if s.ready.get(layer).copied().unwrap_or(false) {
                    return Ok(());
                }
                return Err(WaitError::TimedOut);
            }
        }
    }

    /// Non-blocking look at `layer`: `Some(Ok)` landed, `Some(Err)` failed, `None` pending.
    pub fn poll(&self, layer: usize) -> Option<Result<(), E>> {
        let s = self.state.lock();
        if let Some(e) = &s.failed {
            return Some(Err(e.clone()));
        }
        s.ready
            .get(layer)
            .copied()
            .unwrap_or(false)
            .then_some(Ok(()))
    }

    /// The failure, if any.
    pub fn failure(&self) -> Option<E> {
        self.state.lock().failed.clone()
    }

    /// Whether every layer landed and nothing failed, without blocking.
    pub fn is_complete(&self) -> bool {
        let s = self.state.lock();
        s.failed.is_none() && s.ready.iter().all(|&r| r)
    }
}
