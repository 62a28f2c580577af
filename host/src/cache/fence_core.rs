//! The ready-token protocol's synchronisation core: per-layer "landed" flags behind one
//! mutex and condvar. The io worker publishes layer `i` after its bytes are written; a
//! reader's `wait(i)` returns only after that publish (mutex release/acquire orders the
//! bytes before it), or with the failure the worker reported. Never hangs on a failed
//! load: `fail` wakes every waiter.
//!
//! This file names its primitives through `super::sync` so the loom model
//! (`host/tests/fence_loom.rs`) can include it with loom's `Mutex`/`Condvar`.

use super::sync::{Condvar, Mutex};

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
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = s.ready.get_mut(layer) {
            *r = true;
        }
        drop(s);
        self.cv.notify_all();
    }

    /// Records a failure (first one wins) and wakes waiters.
    pub fn fail(&self, e: E) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.failed.is_none() {
            s.failed = Some(e);
        }
        drop(s);
        self.cv.notify_all();
    }

    /// Blocks until `layer` landed (`Ok`) or the load failed (`Err`). A failure wins over
    /// a landed flag: once a load failed, none of its layers may be read.
    pub fn wait(&self, layer: usize) -> Result<(), E> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(e) = &s.failed {
                return Err(e.clone());
            }
            if s.ready.get(layer).copied().unwrap_or(false) {
                return Ok(());
            }
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether every layer landed (and nothing failed), without blocking.
    pub fn is_complete(&self) -> bool {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.failed.is_none() && s.ready.iter().all(|&r| r)
    }
}
