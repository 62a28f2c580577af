//! The synchronisation primitives the cache is built on, behind one small facade so the
//! model checkers can swap them: `host/tests/cache_shuttle.rs` compiles the whole
//! `cache` module tree against a shuttle-backed module of the same shape, and
//! `host/tests/fence_loom.rs` the fence core against loom.
//!
//! The production choice is `parking_lot`: no lock poisoning (a panicking thread cannot
//! wedge or cascade into every later caller), and timed waits on mutexes and condvars, so
//! every wait in the cache can be bounded.

pub use parking_lot::{Condvar, Mutex, MutexGuard};
pub use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// Starts a named thread.
pub fn spawn<F>(name: &str, f: F) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    std::thread::Builder::new().name(name.into()).spawn(f)
}

/// Handle of a thread started by [`spawn`].
pub type JoinHandle = std::thread::JoinHandle<()>;
