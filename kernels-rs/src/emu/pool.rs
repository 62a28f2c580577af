//! The persistent pool of OS threads that serve [`Carrier::Threads`](super::Carrier)
//! launches, and the [`Worker`]/[`Job`] vocabulary shared with fibers (`fiber.rs`).
//!
//! Spawning an OS thread costs tens of microseconds, far more than most emulated GPU
//! threads run, so launches borrow *workers* from a process-wide pool instead. A worker is
//! an OS thread that serves one launch at a time: it runs one GPU thread after another
//! for it (see [`super::block`] for who runs what and when), and when the launch has no
//! more work for it, it returns to the pool and parks. The pool grows on demand (a launch
//! needs at most one worker per GPU thread of a block); a worker that stays idle for
//! [`IDLE_EXPIRY`] exits, so a burst of large launches does not pin thousands of threads
//! for the rest of the process.
//!
//! Handing out work is a message to one worker: its job slot is filled and the worker
//! woken ([`Waker`]). Lock order: the pool's idle list, then a worker's job slot (a
//! launch's state may also be held around the job slot; the job slot is always the last
//! lock taken).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use super::block::BlockSync;

/// How long an idle worker waits for work before its thread exits.
const IDLE_EXPIRY: Duration = Duration::from_secs(5);

/// What a worker is told to do next.
#[derive(Debug)]
pub(crate) enum Job {
    /// Play GPU thread `thread` of block `block` of `launch`, then keep serving `launch`.
    Run {
        /// The launch.
        launch: Arc<BlockSync>,
        /// `blockIdx.x`.
        block: u32,
        /// `threadIdx.x`.
        thread: u32,
    },
    /// Play GPU thread `thread` of block `block` of the launch the worker serves.
    Item {
        /// `blockIdx.x`.
        block: u32,
        /// `threadIdx.x`.
        thread: u32,
    },
    /// Stop serving the current launch (it is over).
    Leave,
}

/// How to wake a worker (or the worker playing a GPU thread) that parked.
#[derive(Debug, Clone)]
pub(crate) enum Waker {
    /// A pool OS thread ([`super::Carrier::Threads`]).
    Thread(Thread),
    /// A fiber of the launch running on the current OS thread, by index
    /// ([`super::Carrier::Fibers`]).
    Fiber(u32),
}

impl Waker {
    /// Wakes the worker, or makes its next park return at once (`std::thread::park`
    /// token semantics).
    pub(crate) fn wake(&self) {
        match self {
            Self::Thread(t) => t.unpark(),
            Self::Fiber(id) => super::fiber::unpark(*id),
        }
    }
}

/// One worker (a pool thread, or a fiber), as others see it.
#[derive(Debug)]
pub(crate) struct Worker {
    /// The next job, filled by whoever hands the worker work.
    job: Mutex<Option<Job>>,
    /// How to wake it.
    waker: Waker,
}

/// Locks `m`, entering it even if poisoned (the emulator's own code does not panic while
/// holding these locks; a poisoned lock only means some launch is failing).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Worker {
    /// A worker woken through `waker`, with no job yet.
    pub(crate) fn new(waker: Waker) -> Self {
        Self {
            job: Mutex::new(None),
            waker,
        }
    }

    /// Hands the worker `job` (it must be waiting for one: idle in the pool or in a
    /// launch). Does not wake it; wake [`Worker::waker`] afterwards.
    pub(crate) fn give(&self, job: Job) {
        *lock(&self.job) = Some(job);
    }

    /// How to wake the worker.
    pub(crate) fn waker(&self) -> &Waker {
        &self.waker
    }

    /// Waits (parked) until a job arrives, serving `launch`. Only the worker itself calls
    /// this.
    pub(crate) fn wait(&self, launch: &BlockSync) -> Job {
        loop {
            if let Some(job) = lock(&self.job).take() {
                return job;
            }
            launch.park();
        }
    }
}

/// Workers parked in the pool, waiting for a launch.
static IDLE: Mutex<Vec<Arc<Worker>>> = Mutex::new(Vec::new());

/// Hands `job` to an idle worker, or to a new worker thread when none is idle. Fails with
/// the OS error when a thread cannot be spawned.
pub(crate) fn dispatch(job: Job) -> Result<(), String> {
    let mut idle = lock(&IDLE);
    if let Some(worker) = idle.pop() {
        // The job slot is filled under the pool lock: an expiring worker checks it under
        // the same lock before it leaves the idle list (see `wait_in_pool`).
        worker.give(job);
        drop(idle);
        worker.waker.wake();
        return Ok(());
    }
    drop(idle);
    let spawned = thread::Builder::new()
        .name("emu-worker".to_string())
        .spawn(move || worker_main(job));
    match spawned {
        Ok(_) => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

/// Body of a worker thread: serve the first job, then whatever the pool hands it, until
/// it idles for too long.
fn worker_main(first: Job) {
    let me = Arc::new(Worker::new(Waker::Thread(thread::current())));
    let mut next = Some(first);
    loop {
        if let Some(Job::Run {
            launch,
            block,
            thread,
        }) = next.take()
        {
            super::serve(&launch, &me, block, thread);
        }
        lock(&IDLE).push(Arc::clone(&me));
        match wait_in_pool(&me) {
            Some(job) => next = Some(job),
            None => return,
        }
    }
}

/// Waits in the pool for a job; `None` when the worker has expired (it has then left the
/// idle list, so nobody can hand it work any more).
fn wait_in_pool(me: &Arc<Worker>) -> Option<Job> {
    let deadline = Instant::now() + IDLE_EXPIRY;
    loop {
        if let Some(job) = lock(&me.job).take() {
            return Some(job);
        }
        let now = Instant::now();
        if now >= deadline {
            let mut idle = lock(&IDLE);
            // A dispatcher fills the slot under the pool lock, so this check is final.
            if let Some(job) = lock(&me.job).take() {
                return Some(job);
            }
            idle.retain(|w| !Arc::ptr_eq(w, me));
            return None;
        }
        thread::park_timeout(deadline - now);
    }
}
