//! A loom model of the ready-token protocol (`host/src/cache/fence_core.rs`, included
//! here with loom's primitives): in every interleaving, a reader whose `wait(layer)`
//! returns `Ok` sees the bytes the io worker wrote before `publish(layer)`, a failure
//! wakes every waiter, and nothing deadlocks.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

mod sync {
    pub use loom::sync::{Condvar, Mutex};
}

#[allow(dead_code)]
#[path = "../src/cache/fence_core.rs"]
mod fence_core;

use fence_core::FenceCore;
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

/// Two layers' "buffers", written by the io worker, read after the fence.
struct Buffers {
    layers: [UnsafeCell<u32>; 2],
}

// SAFETY: access is ordered by the fence (what the model checks: loom reports any
// unsynchronised access to the cells as a data race).
unsafe impl Sync for Buffers {}

#[test]
fn a_published_layer_is_visible_to_its_reader() {
    loom::model(|| {
        let fence = Arc::new(FenceCore::<()>::new(2));
        let bufs = Arc::new(Buffers {
            layers: [UnsafeCell::new(0), UnsafeCell::new(0)],
        });
        let (f, b) = (fence.clone(), bufs.clone());
        let io = thread::spawn(move || {
            for l in 0..2 {
                // SAFETY: nobody reads layer l before publish(l).
                b.layers[l].with_mut(|p| unsafe { *p = 10 + l as u32 });
                f.publish(l);
            }
        });
        for l in 0..2 {
            fence.wait(l).unwrap();
            // SAFETY: wait(l) returned after publish(l).
            let v = bufs.layers[l].with(|p| unsafe { *p });
            assert_eq!(v, 10 + l as u32);
        }
        io.join().unwrap();
    });
}

#[test]
fn a_failed_load_wakes_every_waiter() {
    loom::model(|| {
        let fence = Arc::new(FenceCore::<&'static str>::new(2));
        let f = fence.clone();
        let io = thread::spawn(move || {
            f.publish(0);
            f.fail("integrity");
        });
        let f2 = fence.clone();
        let other = thread::spawn(move || f2.wait(1));
        // Layer 1 never lands: both waiters must come back with the failure.
        assert_eq!(fence.wait(1), Err("integrity"));
        assert_eq!(other.join().unwrap(), Err("integrity"));
        io.join().unwrap();
        assert!(!fence.is_complete());
    });
}
