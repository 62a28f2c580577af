//! The synchronisation primitives the cache is built on, behind one small facade so the
//! model checkers can swap them: `host/tests/cache_shuttle.rs` compiles the whole
//! `cache` module tree against a shuttle-backed module of the same shape, and
//! `host/tests/fence_loom.rs` the fence core against loom.
//!
//! The production choice is `parking_lot`: no lock poisoning (a panicking thread cannot
//! wedge or cascade into every later caller), and timed waits on mutexes and condvars, so
//! every wait in the cache can be bounded.

pub use parking_lot::{Condvar, Mutex, MutexGuard};
pub use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Starts a named thread.
pub fn spawn<F>(name: &str, f: F) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    std::thread::Builder::new().name(name.into()).spawn(f)
}

/// Handle of a thread started by [`spawn`].
pub type JoinHandle = std::thread::JoinHandle<()>;

std::thread_local! {
    static HELD_LAYERS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Layer guards the current thread holds (a thread holding one must not block on
/// anything the io worker may need that layer for).
pub fn held_layers() -> u32 {
    HELD_LAYERS.with(|h| h.get())
}

/// Counts a layer guard taken (`+1`) or dropped (`-1`) by the current thread.
pub fn add_held_layers(delta: i32) {
    HELD_LAYERS.with(|h| h.set(h.get().saturating_add_signed(delta)));
}
