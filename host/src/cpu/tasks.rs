//! Running an op's tasks: rayon's work stealing when the caller is a pool worker; from
//! any other thread (the serving engine's, a user's), the caller works through the tasks
//! itself alongside helper jobs on rayon's pool instead of handing the whole op over and
//! sleeping until it ends.
//!
//! Handing an op to the pool from outside costs two cross-thread wake-ups per call (the
//! workers', then the caller's), each a futex wake of an idle core: on the 2-vCPU guests
//! of `benches/RESULTS.md` they added 40–80 µs to the median of a 250 µs attention call.
//! Here the caller starts on the first task at once (the helpers join when they wake),
//! and after its last task waits only for the helpers that joined ([`super::gate`]: one
//! that wakes after the caller's last claim finds the gate closed and leaves without
//! touching the op), spinning for at most [`SPIN_LIMIT`] before it parks. Which thread
//! runs a task never changes its result (every op's tasks are independent and
//! batch-invariant).

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rayon::prelude::*;

use super::claims::Claims;
use super::gate::Gate;

/// The longest the calling thread spins (then yields) for the helpers' last tasks before
/// it parks.
const SPIN_LIMIT: Duration = Duration::from_micros(500);

/// Runs `f` once on every task. On a rayon worker: `into_par_iter` on its pool. From any
/// other thread: the caller and up to `rayon::current_num_threads() − 1` helper jobs on
/// the global pool claim runs of consecutive tasks until none is left. A panic in `f`
/// reaches the caller once no thread runs a task of the call any more (the other
/// threads' tasks still run; the rest of the panicking thread's run does not).
pub(crate) fn run_tasks<T: Send>(tasks: Vec<T>, f: impl Fn(T) + Sync + Send) {
    run_runs(tasks, 1, f)
}

/// `f(i, item)` for the `i`-th item of `items`, as [`run_tasks`] with runs of at least
/// `min_run` items (1 for an op's tasks; more for cheap row-wise ops, where a task per row
/// would cost more than the row).
pub(crate) fn for_each_indexed<T: Send>(
    items: impl IntoIterator<Item = T>,
    min_run: usize,
    f: impl Fn(usize, T) + Sync + Send,
) {
    let items: Vec<(usize, T)> = items.into_iter().enumerate().collect();
    run_runs(items, min_run, |(i, t)| f(i, t))
}

/// The tasks, each taken once by whichever thread claims its index.
struct Slots<T>(Vec<UnsafeCell<Option<T>>>);

// SAFETY: a slot is only touched through `take`, whose contract gives each index to one
// thread; the tasks themselves move between threads (`T: Send`).
unsafe impl<T: Send> Sync for Slots<T> {}

impl<T> Slots<T> {
    /// The task at `i`.
    ///
    /// # Safety
    /// No other thread takes (or is taking) index `i`.
    unsafe fn take(&self, i: usize) -> Option<T> {
        // SAFETY: exclusive access to slot `i` (the caller's contract).
        self.0.get(i).and_then(|c| unsafe { (*c.get()).take() })
    }
}

/// [`run_tasks`] with claims of at least `min_run` tasks (but the last).
fn run_runs<T: Send>(tasks: Vec<T>, min_run: usize, f: impl Fn(T) + Sync + Send) {
    let n = tasks.len();
    let min_run = min_run.max(1);
    if n <= min_run {
        tasks.into_iter().for_each(f);
        return;
    }
    if rayon::current_thread_index().is_some() {
        tasks.into_par_iter().with_min_len(min_run).for_each(f);
        return;
    }
    let slots = Slots(
        tasks
            .into_iter()
            .map(|t| UnsafeCell::new(Some(t)))
            .collect(),
    );
    let threads = rayon::current_num_threads().min(n.div_ceil(min_run)).max(1);
    let claims = Claims::new(n, threads, min_run);
    // The first panic of a task, for the caller to resume once every thread is out.
    let panicked: Mutex<Option<Box<dyn Any + Send>>> = Mutex::new(None);
    let drain = || {
        let run_all = || {
            while let Some(run) = claims.claim() {
                for i in run {
                    // SAFETY: `i` is in this thread's claimed run; runs are disjoint.
                    if let Some(t) = unsafe { slots.take(i) } {
                        f(t);
                    }
                }
            }
        };
        if let Err(p) = panic::catch_unwind(AssertUnwindSafe(run_all)) {
            panicked.lock().get_or_insert(p);
        }
    };
    let op: &(dyn Fn() + Sync) = &drain;
    let op: *const (dyn Fn() + Sync + '_) = op;
    // SAFETY: only the lifetime is erased. Helpers call `op` only between a successful
    // `Gate::enter` and their `Gate::leave`, and `Admission`'s drop (which runs before
    // `drain` and what it borrows go away, unwinding or not) closes the gate and waits
    // until every helper that entered has left.
    let op: *const (dyn Fn() + Sync + 'static) = unsafe { std::mem::transmute(op) };
    let admission = Admission(Arc::new(Shared {
        gate: Gate::new(),
        op,
        caller: std::thread::current(),
    }));
    for _ in 1..threads {
        let shared = Arc::clone(&admission.0);
        rayon::spawn(move || shared.help());
    }
    drain();
    drop(admission);
    if let Some(p) = panicked.into_inner() {
        panic::resume_unwind(p);
    }
}

/// What a caller's helper jobs share with it: the gate, the op (its drain, valid while a
/// helper is inside the gate) and the caller's thread (to unpark it).
struct Shared {
    gate: Gate,
    op: *const (dyn Fn() + Sync + 'static),
    caller: std::thread::Thread,
}

// SAFETY: `op` points to a `Sync` closure, called (by shared reference) only by helpers
// inside the gate, while the caller keeps it alive (see `run_runs`); the rest is `Send`
// and `Sync`.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// A helper job: runs the op if the caller has not closed the gate yet; wakes the
    /// caller if it is the last one out after the close. Never unwinds (the op catches
    /// its tasks' panics).
    fn help(&self) {
        if self.gate.enter() {
            // SAFETY: inside the gate, `op` is alive (see `run_runs`).
            unsafe { (*self.op)() };
            if self.gate.leave() {
                self.caller.unpark();
            }
        }
    }
}

/// Closes the gate when dropped and waits until the helpers inside have left: spinning
/// (they are in their last task, which the caller's own drain just missed), then
/// yielding, for at most [`SPIN_LIMIT`], then parked until the last one out unparks it
/// (each park bounded, so a lost wake-up costs at most [`PARK_SLICE`]).
struct Admission(Arc<Shared>);

/// The longest one park of the caller waiting for its helpers lasts.
const PARK_SLICE: Duration = Duration::from_millis(1);

impl Drop for Admission {
    fn drop(&mut self) {
        let gate = &self.0.gate;
        gate.close();
        let start = Instant::now();
        let mut spins = 0u32;
        while !gate.is_empty() {
            if spins < 64 {
                spins += 1;
                std::hint::spin_loop();
            } else if start.elapsed() < SPIN_LIMIT {
                // The helper may be waiting for this core (more runnable threads than
                // cores: several callers at once).
                std::thread::yield_now();
            } else {
                std::thread::park_timeout(PARK_SLICE);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Every task runs exactly once, from an outside thread and from inside a pool, with
    /// fewer, as many and more tasks than threads.
    #[test]
    fn every_task_runs_once() {
        for n in [0, 1, 2, 3, 17, 200, 5000] {
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            run_tasks((0..n).collect(), |i: usize| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "outside, n {n}"
            );
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(3)
                .build()
                .unwrap_or_else(|e| panic!("{e}"));
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.install(|| {
                run_tasks((0..n).collect(), |i: usize| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                })
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "inside, n {n}"
            );
        }
    }

    /// Indexed items in runs: every index once, with its own item, for run lengths below,
    /// at and above the item count.
    #[test]
    fn indexed_items_keep_their_index() {
        for (n, min_run) in [(0, 4), (3, 4), (4, 4), (100, 1), (100, 32), (1000, 32)] {
            let mut out = vec![usize::MAX; n];
            for_each_indexed(out.iter_mut(), min_run, |i, x| *x = i);
            assert!(
                out.iter().enumerate().all(|(i, &x)| x == i),
                "n {n} runs {min_run}"
            );
        }
    }

    /// Tasks that own disjoint mutable slices write them all.
    #[test]
    fn tasks_own_their_outputs() {
        let mut out = vec![0u32; 1000];
        let tasks: Vec<(usize, &mut [u32])> = out.chunks_mut(7).enumerate().collect();
        run_tasks(tasks, |(t, chunk)| {
            for (j, x) in chunk.iter_mut().enumerate() {
                *x = (t * 7 + j) as u32;
            }
        });
        assert!(out.iter().enumerate().all(|(i, &x)| x == i as u32));
    }

    /// Several outside threads at once (the serving engine's and a user's, say): every
    /// call runs each of its tasks once and returns within a bounded time.
    #[test]
    fn concurrent_callers_each_finish() {
        let (tx, rx) = std::sync::mpsc::channel();
        for c in 0..4u64 {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for round in 0..50u64 {
                    let n = 1 + (c * 13 + round * 7) as usize % 97;
                    let sum = AtomicU64::new(0);
                    run_tasks((0..n as u64).collect(), |i| {
                        sum.fetch_add(i + 1, Ordering::Relaxed);
                    });
                    let want = (n * (n + 1) / 2) as u64;
                    if sum.load(Ordering::Relaxed) != want {
                        let _ = tx.send(Err(format!("caller {c} round {round}")));
                        return;
                    }
                }
                let _ = tx.send(Ok(c));
            });
        }
        drop(tx);
        for _ in 0..4 {
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("{e}: a task ran twice or not at all"),
                Err(e) => panic!("a caller did not finish: {e}"),
            }
        }
    }

    /// With every worker of the pool busy, an outside caller runs all its tasks itself
    /// and returns: it does not wait for helper jobs that have not started (they find the
    /// gate closed when they do).
    #[test]
    fn the_caller_does_not_wait_for_helpers_that_have_not_started() {
        let workers = rayon::current_num_threads();
        let (started_tx, started) = std::sync::mpsc::channel();
        let mut releases = Vec::new();
        let (timed_out_tx, timed_out) = std::sync::mpsc::channel();
        for _ in 0..workers {
            let (release_tx, release) = std::sync::mpsc::channel::<()>();
            releases.push(release_tx);
            let (started_tx, timed_out_tx) = (started_tx.clone(), timed_out_tx.clone());
            rayon::spawn(move || {
                let _ = started_tx.send(());
                let waited = release.recv_timeout(Duration::from_secs(20));
                let _ = timed_out_tx.send(waited.is_err());
            });
        }
        for _ in 0..workers {
            started
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|e| panic!("a worker did not start: {e}"));
        }
        let count = AtomicU64::new(0);
        run_tasks((0..100).collect(), |_: usize| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 100);
        for r in releases {
            let _ = r.send(());
        }
        for _ in 0..workers {
            let late = timed_out
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("a worker did not end: {e}"));
            assert!(!late, "the caller waited for the busy pool");
        }
    }

    /// A panicking task reaches the caller (from whichever thread it ran on), and the
    /// call returns instead of hanging.
    #[test]
    fn a_panicking_task_reaches_the_caller() {
        for bad in [0, 5, 39] {
            let r = std::panic::catch_unwind(|| {
                run_tasks((0..40).collect(), |i: usize| {
                    if i == bad {
                        panic!("task {i}");
                    }
                })
            });
            assert!(r.is_err(), "task {bad}'s panic was lost");
        }
        // The pool still works afterwards.
        let count = AtomicU64::new(0);
        run_tasks((0..40).collect(), |_: usize| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 40);
    }
}
