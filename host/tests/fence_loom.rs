//! A loom model of the ready-token protocol (`host/src/cache/fence_core.rs`, included here
//! with loom's primitives behind the same facade as `host/src/sync.rs`): in every
//! interleaving, a reader whose `wait(layer)` returns `Ok` sees the bytes the writer wrote
//! before `publish(layer)`, a failure wakes every waiter (no wait relies on its timeout:
//! loom's condvar here never times out, so a missed wake-up is a reported deadlock), and a
//! failure wins over a landed layer.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

/// `crate::sync` for the fence core, on loom.
mod sync {
    use std::fmt;
    use std::ops::{Deref, DerefMut};
    use std::time::Instant;

    pub struct Mutex<T>(loom::sync::Mutex<T>);
    pub struct MutexGuard<'a, T>(Option<loom::sync::MutexGuard<'a, T>>);
    pub struct Condvar(loom::sync::Condvar);
    pub struct WaitTimeoutResult;

    impl<T> Mutex<T> {
        pub fn new(t: T) -> Self {
            Mutex(loom::sync::Mutex::new(t))
        }
        pub fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard(Some(self.0.lock().unwrap()))
        }
    }
    impl<T> Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.0.as_ref().unwrap()
        }
    }
    impl<T> DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            self.0.as_mut().unwrap()
        }
    }
    impl WaitTimeoutResult {
        pub fn timed_out(&self) -> bool {
            false
        }
    }
    impl Condvar {
        pub fn new() -> Self {
            Condvar(loom::sync::Condvar::new())
        }
        pub fn wait_until<T>(
            &self,
            g: &mut MutexGuard<'_, T>,
            _deadline: Instant,
        ) -> WaitTimeoutResult {
            let inner = g.0.take().unwrap();
            g.0 = Some(self.0.wait(inner).unwrap());
            WaitTimeoutResult
        }
        pub fn notify_all(&self) {
            self.0.notify_all()
        }
    }
    impl<T> fmt::Debug for Mutex<T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Mutex")
        }
    }
    impl fmt::Debug for Condvar {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Condvar")
        }
    }
}

#[allow(dead_code)]
#[path = "../src/cache/fence_core.rs"]
mod fence_core;

use std::time::{Duration, Instant};

use fence_core::{FenceCore, WaitError};
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

fn far() -> Instant {
    Instant::now() + Duration::from_secs(3600)
}

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
            fence.wait(l, far()).unwrap();
            // SAFETY: wait(l) returned after publish(l).
            let v = bufs.layers[l].with(|p| unsafe { *p });
            assert_eq!(v, 10 + l as u32);
        }
        io.join().unwrap();
    });
}

#[test]
fn a_failed_load_wakes_every_waiter_and_wins() {
    loom::model(|| {
        let fence = Arc::new(FenceCore::<&'static str>::new(2));
        let f = fence.clone();
        let io = thread::spawn(move || {
            f.publish(0);
            f.fail("integrity");
        });
        let f2 = fence.clone();
        let other = thread::spawn(move || f2.wait(1, far()));
        // Layer 1 never lands: both waiters must come back with the failure.
        assert_eq!(fence.wait(1, far()), Err(WaitError::Failed("integrity")));
        assert_eq!(other.join().unwrap(), Err(WaitError::Failed("integrity")));
        io.join().unwrap();
        // Layer 0 landed before the failure, but a failed load is never read.
        assert_eq!(fence.wait(0, far()), Err(WaitError::Failed("integrity")));
        assert!(!fence.is_complete());
        assert_eq!(fence.poll(0), Some(Err("integrity")));
    });
}

#[test]
fn the_first_failure_wins_between_racing_failers() {
    loom::model(|| {
        let fence = Arc::new(FenceCore::<u8>::new(1));
        let (a, b) = (fence.clone(), fence.clone());
        let ta = thread::spawn(move || a.fail(1));
        let tb = thread::spawn(move || b.fail(2));
        let (ra, rb) = (ta.join().unwrap(), tb.join().unwrap());
        assert!(ra ^ rb, "exactly one failure is first");
        let want = if ra { 1 } else { 2 };
        assert_eq!(fence.wait(0, far()), Err(WaitError::Failed(want)));
        assert_eq!(fence.failure(), Some(want));
    });
}
