//! The state a launch's workers share: who is running, waiting or done in the block being
//! run, the barrier, the warps' exchanges, shared memory, the first error of the launch,
//! and the scheduler that decides which OS thread runs which GPU thread.
//!
//! All scheduling state sits behind one mutex so that a deadlock is detected exactly: a
//! block is stuck when none of its threads is running (every thread has either returned
//! from the kernel or waits at a barrier or warp collective) and not all have returned.
//! Barrier and collective completions happen eagerly, when the last participant arrives,
//! so "nobody running" means nobody ever will. The emulator then reports what each thread
//! waits for instead of hanging.
//!
//! # Scheduling
//!
//! Every GPU thread gets a worker of its own while it exists (so barriers and
//! collectives really block): a pool thread (`pool.rs`) or a fiber (`fiber.rs`). The GPU
//! threads of a block are started lazily and resumed in a controlled order:
//! - A GPU thread that has not started yet, or that a barrier or collective has released
//!   but whose worker has not been woken yet, counts as *running* for deadlock detection
//!   (it will run), exactly as if it had its own runnable OS thread.
//! - At most `limit` workers of a launch execute kernel code at once (the host's
//!   parallelism with threads, 1 with fibers, which all run on the launching thread).
//!   When one blocks or finishes, it hands its turn to the next released
//!   GPU thread (waking exactly that worker), or starts the next unstarted GPU thread
//!   (itself, when it has finished its own, or an idle worker). A kernel whose threads
//!   never wait (say a copy) thus runs on `limit` OS threads without a single context
//!   switch, and a barrier wakes the block's workers one by one instead of all at once.
//! - With threads, if no GPU thread starts, resumes, blocks or finishes for
//!   [`WATCHDOG_TICK`] while work is pending (say threads spin on a flag that an
//!   unstarted thread would set), the launch's supervisor doubles `limit`; this keeps the
//!   forward-progress guarantee of one OS thread per GPU thread. With fibers, a thread
//!   that spins on an atomic yields its turn ([`BlockSync::yield_now`]).
//!
//! The blocks of the grid run one after another: the worker whose GPU thread is the
//! last of a block to return resets the state (and poisons shared memory) for the next
//! block, and starts its first thread.
//!
//! Lock order: the launch's state, then a GPU thread's [`Slot`], then a worker's job slot;
//! shared memory is only locked alone or under the state lock.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread;
use std::time::Duration;

use super::error::EmuError;
use super::fiber;
use super::global::GlobalCheck;
use super::pool::{self, lock, Job, Waker, Worker};
use super::profile::Tracer;
use super::smem::Smem;
use super::warp::{describe_lanes, Output, WarpState};
use super::LaunchConfig;

/// How long a launch may make no scheduling progress, with work pending, before its
/// supervisor lets more workers run at once.
const WATCHDOG_TICK: Duration = Duration::from_millis(20);

/// Unwind payload (and error marker) that stops a GPU thread once the launch has failed.
/// It is not a panic of the kernel: the thread's driver recognises it and does not report
/// it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stop;

/// What a GPU thread is doing, as the scheduler sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Executing kernel code, or about to (not started yet, or released from a wait).
    Running,
    /// Waiting at `sync_threads`.
    AtBarrier,
    /// Waiting in the warp collective with this round id.
    InCollective(u64),
    /// Returned from the kernel (for the current block).
    Exited,
}

/// The kernel closure of a launch, with its lifetime erased so that pool workers (which
/// outlive the launch) can call it.
#[derive(Clone, Copy)]
pub(crate) struct KernelRef(*const (dyn Fn() + Sync + 'static));

// SAFETY: the pointee is `Sync`, so calling it from any thread is sound; that it is still
// alive when called is the contract of `KernelRef::new` and `KernelRef::call`.
unsafe impl Send for KernelRef {}
// SAFETY: as for `Send`.
unsafe impl Sync for KernelRef {}

impl std::fmt::Debug for KernelRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KernelRef")
    }
}

impl KernelRef {
    /// Erases the lifetime of `kernel`.
    ///
    /// # Safety
    /// `kernel` must stay alive as long as any worker may call [`KernelRef::call`] on the
    /// result: [`super::launch`] keeps it until every worker has detached from the launch.
    pub(crate) unsafe fn new<'a>(kernel: &'a (dyn Fn() + Sync + 'a)) -> Self {
        // SAFETY: only the lifetime changes (a fat reference to the same trait object
        // type, same layout); the caller keeps the pointee alive for as long as it is
        // used.
        let kernel: &'static (dyn Fn() + Sync + 'static) = unsafe { std::mem::transmute(kernel) };
        Self(kernel)
    }

    /// Calls the kernel.
    ///
    /// # Safety
    /// The calling worker must be attached to the launch (counted in `State::attached`),
    /// which keeps the closure alive (see [`KernelRef::new`]).
    pub(crate) unsafe fn call(self) {
        // SAFETY: the launch that owns the closure has not returned (caller's contract).
        unsafe { (*self.0)() }
    }
}

/// One GPU thread's mailbox: how to wake it and what a completed wait hands it.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    /// The worker playing the thread in the current block.
    runner: Option<Waker>,
    /// Set when the thread may continue after a barrier or collective; cleared by it.
    released: bool,
    /// Its result of the collective it waits in.
    output: Output,
}

/// What a worker does after its GPU thread has finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Play GPU thread `.1` of block `.0`.
    Run(u32, u32),
    /// Wait (idle in the launch) for a job.
    Idle,
    /// Detach from the launch.
    Leave,
}

/// The scheduling state of the block being run (behind [`BlockSync`]'s mutex).
#[derive(Debug)]
pub(crate) struct State {
    /// `blockIdx.x` of the block being run.
    pub block: u32,
    /// `blockDim.x`.
    pub block_dim: u32,
    /// One entry per thread of the block.
    pub status: Vec<Status>,
    /// Threads with [`Status::Running`] (started or not).
    pub running: u32,
    /// Threads with [`Status::Exited`].
    pub exited: u32,
    /// Threads waiting at the barrier.
    pub barrier_waiting: u32,
    /// One per warp of the block.
    pub warps: Vec<WarpState>,
    /// Id for the next warp collective round.
    pub next_round: u64,
    /// The launch's first error.
    error: Option<EmuError>,
    /// Number of finished blocks.
    blocks_done: u32,
    /// Blocks to run: the whole grid, or the sample of `order`.
    to_run: u32,
    /// The blocks to run, in order (a sample of the grid), or `None` for `0..grid_dim`.
    order: Option<Vec<u32>>,
    /// Threads `next_claim..block_dim` of the block have not started.
    next_claim: u32,
    /// Threads released from a wait whose workers have not been woken yet, in order.
    ready: VecDeque<u32>,
    /// Workers executing (or woken or dispatched to execute) kernel code.
    active: u32,
    /// Most workers that may be active at once.
    limit: u32,
    /// Workers of this launch waiting for work.
    idle: Vec<Arc<Worker>>,
    /// Workers serving this launch (dispatched, running, waiting or idle in it).
    attached: u32,
    /// Counts scheduling events, for the watchdog.
    progress: u64,
}

/// Synchronisation and shared state of a launch and the block being run.
#[derive(Debug)]
pub(crate) struct BlockSync {
    /// Scheduling state.
    state: Mutex<State>,
    /// One per thread of the block.
    slots: Box<[Mutex<Slot>]>,
    /// Wakes the launch's supervisor (launch over, last worker detached).
    done_cv: Condvar,
    /// Mirror of `state.error.is_some()` for cheap checks.
    poisoned: AtomicBool,
    /// Barrier epoch of the block (1 + completed barriers), read by shared memory checks.
    pub epoch: AtomicU32,
    /// Dynamic shared memory.
    pub smem: Mutex<Smem>,
    /// The kernel.
    kernel: KernelRef,
    /// `blockDim.x`.
    pub block_dim: u32,
    /// `gridDim.x`.
    pub grid_dim: u32,
    /// Whether the workers are fibers on the launching thread (else pool threads).
    fibers: bool,
    /// The launch's global buffers (bounds, alignment and init checks).
    pub global: GlobalCheck,
    /// Access tracing, when the launch is profiled.
    pub tracer: Option<Tracer>,
}

/// What a launch runs besides its kernel: the global-memory check, tracing, and which
/// blocks of the grid (all, or a sample).
#[derive(Debug)]
pub(crate) struct LaunchSetup {
    pub global: GlobalCheck,
    pub tracer: Option<Tracer>,
    /// Sorted, unique block indices below the grid size; `None`: every block.
    pub blocks: Option<Vec<u32>>,
}

/// Wake-ups and worker dispatches decided under the state lock, performed when this value
/// is dropped. Declare it *before* the state guard so that it drops after the guard (and
/// so also on early returns).
pub(crate) struct Wakes<'a> {
    /// The launch.
    sync: &'a Arc<BlockSync>,
    /// Workers to wake.
    unpark: Vec<Waker>,
    /// `(block, thread)` pairs to hand to pool workers (already counted as attached).
    spawn: Vec<(u32, u32)>,
}

impl<'a> Wakes<'a> {
    /// Nothing to do yet.
    pub(crate) fn new(sync: &'a Arc<BlockSync>) -> Self {
        Self {
            sync,
            unpark: Vec::new(),
            spawn: Vec::new(),
        }
    }
}

impl Drop for Wakes<'_> {
    fn drop(&mut self) {
        for waker in self.unpark.drain(..) {
            waker.wake();
        }
        let mut failed: Option<String> = None;
        let mut not_sent = 0u32;
        for (block, thread) in self.spawn.drain(..) {
            if failed.is_some() {
                not_sent += 1;
                continue;
            }
            let job = Job::Run {
                launch: Arc::clone(self.sync),
                block,
                thread,
            };
            let sent = if self.sync.fibers {
                fiber::spawn(job)
            } else {
                pool::dispatch(job)
            };
            if let Err(message) = sent {
                failed = Some(message);
                not_sent += 1;
            }
        }
        if let Some(message) = failed {
            let mut st = self.sync.lock();
            st.attached -= not_sent;
            self.sync.fail(&mut st, EmuError::ThreadSpawn { message });
        }
    }
}

/// How many workers of a launch execute kernel code at once, normally.
fn parallelism() -> u32 {
    static P: OnceLock<u32> = OnceLock::new();
    *P.get_or_init(|| {
        thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(1))
    })
}

impl BlockSync {
    /// State for a launch of `cfg` running `kernel` on fibers of the launching thread
    /// (`fibers`) or on pool threads; the first block is 0 and no thread has started.
    pub(crate) fn new(
        cfg: LaunchConfig,
        kernel: KernelRef,
        fibers: bool,
        setup: LaunchSetup,
    ) -> Self {
        let warps = cfg.block.div_ceil(32);
        let to_run = setup.blocks.as_ref().map_or(cfg.grid, |b| b.len() as u32);
        let first = setup.blocks.as_ref().and_then(|b| b.first().copied());
        Self {
            state: Mutex::new(State {
                block: first.unwrap_or(0),
                block_dim: cfg.block,
                status: vec![Status::Running; cfg.block as usize],
                running: cfg.block,
                exited: 0,
                barrier_waiting: 0,
                warps: (0..warps)
                    .map(|w| WarpState::new(crate::simt::warp_mask(cfg.block, w)))
                    .collect(),
                next_round: 0,
                error: None,
                blocks_done: 0,
                to_run,
                order: setup.blocks,
                next_claim: 0,
                ready: VecDeque::new(),
                active: 0,
                limit: if fibers { 1 } else { parallelism() },
                idle: Vec::new(),
                attached: 0,
                progress: 0,
            }),
            slots: (0..cfg.block).map(|_| Mutex::default()).collect(),
            done_cv: Condvar::new(),
            poisoned: AtomicBool::new(false),
            epoch: AtomicU32::new(1),
            smem: Mutex::new(Smem::new(cfg.dyn_smem_bytes)),
            kernel,
            block_dim: cfg.block,
            grid_dim: cfg.grid,
            fibers,
            global: setup.global,
            tracer: setup.tracer,
        }
    }

    /// Parks the calling worker until it is woken (or spuriously).
    pub(crate) fn park(&self) {
        if self.fibers {
            fiber::park();
        } else {
            thread::park();
        }
    }

    /// Locks the scheduling state. A poisoned mutex (a panic while it was held, which the
    /// emulator's own code does not do) is entered anyway: the launch is failing by then.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Locks shared memory (see [`BlockSync::lock`] on poisoning).
    pub(crate) fn lock_smem(&self) -> MutexGuard<'_, Smem> {
        lock(&self.smem)
    }

    /// The kernel.
    pub(crate) fn kernel(&self) -> KernelRef {
        self.kernel
    }

    /// Whether the launch has failed (cheap; no lock).
    pub(crate) fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// Records `err` as the launch's error unless one is already recorded, and wakes every
    /// waiting thread so that it stops. Returns [`Stop`] for the caller to propagate.
    pub(crate) fn fail(&self, st: &mut State, err: EmuError) -> Stop {
        if st.error.is_none() {
            st.error = Some(err);
        }
        self.poisoned.store(true, Ordering::Release);
        let claimed = st.next_claim as usize;
        for (slot, status) in self.slots[..claimed].iter().zip(&st.status) {
            if *status != Status::Exited {
                if let Some(runner) = &lock(slot).runner {
                    runner.wake();
                }
            }
        }
        self.end_launch(st);
        Stop
    }

    /// [`BlockSync::fail`] for a caller that does not hold the lock.
    pub(crate) fn fail_unlocked(&self, err: EmuError) -> Stop {
        let mut st = self.lock();
        self.fail(&mut st, err)
    }

    /// `Err(Stop)` when the launch has failed.
    pub(crate) fn check(st: &State) -> Result<(), Stop> {
        if st.error.is_some() {
            Err(Stop)
        } else {
            Ok(())
        }
    }

    /// Whether the launch is over: failed, or every block done.
    fn over(st: &State) -> bool {
        st.error.is_some() || st.blocks_done == st.to_run
    }

    /// Marks `thread` as blocked with `status`, fails the launch if that leaves the block
    /// with no running thread (a deadlock), and otherwise hands its turn on.
    pub(crate) fn block_thread(
        &self,
        st: &mut State,
        thread: u32,
        status: Status,
        w: &mut Wakes<'_>,
    ) {
        st.status[thread as usize] = status;
        st.running -= 1;
        st.active = st.active.saturating_sub(1);
        st.progress += 1;
        self.fail_if_stuck(st);
        self.schedule(st, w);
    }

    /// Marks blocked `thread` as running again (called by whoever completes its wait),
    /// with `output` as its collective result; its worker is woken when its turn comes.
    pub(crate) fn release(&self, st: &mut State, thread: u32, output: Option<Output>) {
        st.status[thread as usize] = Status::Running;
        st.running += 1;
        if let Some(output) = output {
            lock(&self.slots[thread as usize]).output = output;
        }
        st.ready.push_back(thread);
    }

    /// Fails the launch when no thread runs but not all have returned.
    fn fail_if_stuck(&self, st: &mut State) {
        if st.running == 0 && st.exited < st.block_dim && st.error.is_none() {
            let err = diagnose(st);
            self.fail(st, err);
        }
    }

    /// Wakes released threads and starts unstarted ones while fewer than `limit` workers
    /// are active.
    pub(crate) fn schedule(&self, st: &mut State, w: &mut Wakes<'_>) {
        if Self::over(st) {
            return;
        }
        while st.active < st.limit {
            if let Some(t) = st.ready.pop_front() {
                self.resume(st, t, w);
            } else if st.next_claim < st.block_dim {
                Self::start_next(st, w);
            } else {
                break;
            }
        }
    }

    /// Starts the next unstarted thread on an idle worker, or a new one.
    fn start_next(st: &mut State, w: &mut Wakes<'_>) {
        let t = Self::claim(st);
        match st.idle.pop() {
            Some(worker) => {
                worker.give(Job::Item {
                    block: st.block,
                    thread: t,
                });
                w.unpark.push(worker.waker().clone());
            }
            None => {
                st.attached += 1;
                w.spawn.push((st.block, t));
            }
        }
    }

    /// Takes the next unstarted thread for an active worker.
    fn claim(st: &mut State) -> u32 {
        let t = st.next_claim;
        st.next_claim += 1;
        st.active += 1;
        st.progress += 1;
        t
    }

    /// Lets released thread `t` continue: wakes its worker.
    fn resume(&self, st: &mut State, t: u32, w: &mut Wakes<'_>) {
        let mut slot = lock(&self.slots[t as usize]);
        slot.released = true;
        if let Some(runner) = &slot.runner {
            w.unpark.push(runner.clone());
        }
        st.active += 1;
        st.progress += 1;
    }

    /// Waits until `thread`, blocked at a barrier or collective, is released; returns its
    /// collective result. `poison_first`: stop on a failed launch even when released.
    pub(crate) fn wait_released(&self, thread: u32, poison_first: bool) -> Result<Output, Stop> {
        let slot = &self.slots[thread as usize];
        loop {
            if poison_first && self.is_poisoned() {
                return Err(Stop);
            }
            {
                let mut s = lock(slot);
                if s.released {
                    s.released = false;
                    return Ok(s.output);
                }
            }
            if self.is_poisoned() {
                return Err(Stop);
            }
            self.park();
        }
    }

    /// Running `thread` gives its turn to a released or unstarted thread, if there is
    /// one, and waits for the next turn (it stays running for deadlock detection). With
    /// fibers, where only one GPU thread runs at a time, this lets a thread that spins
    /// (on an atomic) wait for another.
    pub(crate) fn yield_now(self: &Arc<Self>, thread: u32) -> Result<(), Stop> {
        {
            // (Declared first: the wake-ups happen after the state lock is released.)
            let mut wakes = Wakes::new(self);
            let mut st = self.lock();
            BlockSync::check(&st)?;
            if st.ready.is_empty() && st.next_claim >= st.block_dim {
                return Ok(());
            }
            st.active = st.active.saturating_sub(1);
            st.progress += 1;
            // Someone else takes the turn: an unstarted thread if any is left (so that
            // spinning threads cannot pass the turn only among themselves), else the
            // released threads in order, this one last.
            if st.next_claim < st.block_dim {
                Self::start_next(&mut st, &mut wakes);
            }
            st.ready.push_back(thread);
            self.schedule(&mut st, &mut wakes);
        }
        self.wait_released(thread, false).map(|_| ())
    }

    /// Whether the carrier is fibers.
    pub(crate) fn on_fibers(&self) -> bool {
        self.fibers
    }

    /// Whether the launch is over and no worker serves it any more.
    pub(crate) fn finished(&self) -> bool {
        let st = self.lock();
        Self::over(&st) && st.attached == 0
    }

    /// Fails the launch because the scheduler found nothing to run although the launch is
    /// not finished (an emulator bug, reported rather than hanging).
    pub(crate) fn fail_internal(&self, what: &str) {
        let mut st = self.lock();
        let err = EmuError::KernelPanic {
            block: st.block,
            thread: 0,
            message: format!("sparsekit emu internal error: {what}"),
        };
        self.fail(&mut st, err);
    }

    /// The worker `runner` starts playing `thread`.
    pub(crate) fn start_item(&self, thread: u32, runner: &Waker) {
        let mut slot = lock(&self.slots[thread as usize]);
        slot.runner = Some(runner.clone());
        slot.released = false;
    }

    /// `thread` has finished the current block: it returned from the kernel
    /// (`returned`) or was stopped. Checks that no collective waits for it, and decides
    /// what its worker `me` does next.
    pub(crate) fn finish_item(
        self: &Arc<Self>,
        thread: u32,
        returned: bool,
        me: &Arc<Worker>,
    ) -> Next {
        let mut w = Wakes::new(self);
        let mut st = self.lock();
        if returned && st.error.is_none() {
            let (warp, lane) = (thread / 32, thread % 32);
            let ws = &st.warps[warp as usize];
            if let Some(round) = ws.waiting_for(lane) {
                let detail = format!(
                    "lane {lane} returned from the kernel while lanes {} wait for it in {} \
                     with mask {:#010x}",
                    describe_lanes(round.arrived),
                    round.kind,
                    round.mask
                );
                let err = EmuError::WarpCollective {
                    block: st.block,
                    warp,
                    detail,
                };
                self.fail(&mut st, err);
            }
        }
        if st.status[thread as usize] == Status::Running {
            st.running -= 1;
            st.active = st.active.saturating_sub(1);
        }
        st.status[thread as usize] = Status::Exited;
        st.exited += 1;
        st.warps[(thread / 32) as usize].exited |= 1 << (thread % 32);
        st.progress += 1;
        self.fail_if_stuck(&mut st);
        if st.error.is_some() {
            return Next::Leave;
        }
        if st.exited == st.block_dim {
            st.blocks_done += 1;
            if let Some(t) = &self.tracer {
                t.finish_block();
            }
            if st.blocks_done == st.to_run {
                self.end_launch(&mut st);
                return Next::Leave;
            }
            self.next_block(&mut st);
        }
        // This worker is free: hand the turn to a released thread, or start a new one.
        let next = if let Some(t) = st.ready.pop_front() {
            self.resume(&mut st, t, &mut w);
            None
        } else if st.next_claim < st.block_dim && st.active < st.limit {
            let t = Self::claim(&mut st);
            Some(Next::Run(st.block, t))
        } else {
            None
        };
        self.schedule(&mut st, &mut w);
        next.unwrap_or_else(|| {
            st.idle.push(Arc::clone(me));
            Next::Idle
        })
    }

    /// Resets everything for the next block (all threads have returned).
    fn next_block(&self, st: &mut State) {
        st.block = match &st.order {
            Some(order) => order[st.blocks_done as usize],
            None => st.block + 1,
        };
        st.status.fill(Status::Running);
        st.running = st.block_dim;
        st.exited = 0;
        st.barrier_waiting = 0;
        st.next_claim = 0;
        st.ready.clear();
        for w in &mut st.warps {
            w.reset();
        }
        self.epoch.store(1, Ordering::Release);
        self.lock_smem().reset();
    }

    /// The launch is over: idle workers leave, and the supervisor is told.
    fn end_launch(&self, st: &mut State) {
        for worker in st.idle.drain(..) {
            worker.give(Job::Leave);
            worker.waker().wake();
        }
        self.done_cv.notify_all();
    }

    /// A worker stops serving the launch; after this it never calls the kernel again.
    pub(crate) fn detach(&self) {
        let mut st = self.lock();
        st.attached -= 1;
        if st.attached == 0 {
            self.done_cv.notify_all();
        }
    }

    /// Starts the launch's first threads.
    pub(crate) fn start(self: &Arc<Self>) {
        let mut w = Wakes::new(self);
        let mut st = self.lock();
        self.schedule(&mut st, &mut w);
    }

    /// Waits until the launch is over and every worker has detached, letting more
    /// workers run at once whenever it makes no progress for [`WATCHDOG_TICK`].
    pub(crate) fn supervise(self: &Arc<Self>) {
        let mut st = self.lock();
        let mut seen = st.progress;
        loop {
            if Self::over(&st) && st.attached == 0 {
                return;
            }
            let (guard, wait) = self
                .done_cv
                .wait_timeout(st, WATCHDOG_TICK)
                .unwrap_or_else(PoisonError::into_inner);
            st = guard;
            let pending = !st.ready.is_empty() || st.next_claim < st.block_dim;
            if wait.timed_out()
                && st.progress == seen
                && pending
                && st.active >= st.limit
                && !Self::over(&st)
            {
                st.limit = st.limit.saturating_mul(2);
                drop(st);
                let mut w = Wakes::new(self);
                let mut boosted = self.lock();
                self.schedule(&mut boosted, &mut w);
                drop(boosted);
                drop(w);
                st = self.lock();
            }
            seen = st.progress;
        }
    }

    /// Fails the launch (if it is still going) and waits until every worker has detached;
    /// for a supervisor that is unwinding.
    pub(crate) fn abandon(&self) {
        let mut st = self.lock();
        if !Self::over(&st) {
            let err = EmuError::KernelPanic {
                block: st.block,
                thread: 0,
                message: "the emulator's launch driver panicked".to_string(),
            };
            self.fail(&mut st, err);
        }
        while st.attached != 0 {
            st = self
                .done_cv
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The launch's error, if any.
    pub(crate) fn take_error(&self) -> Option<EmuError> {
        self.lock().error.take()
    }
}

/// Explains why a block with no running thread is stuck.
fn diagnose(st: &State) -> EmuError {
    for (w, ws) in st.warps.iter().enumerate() {
        let Some(round) = ws.open.first() else {
            continue;
        };
        let base = w as u32 * 32;
        let mut groups: Vec<(String, u32)> = Vec::new();
        for lane in 0..32u32 {
            if round.mask & !round.arrived & (1 << lane) == 0 {
                continue;
            }
            let what = match st.status[(base + lane) as usize] {
                Status::Exited => "returned from the kernel".to_string(),
                Status::AtBarrier => "wait at sync_threads".to_string(),
                Status::InCollective(id) => match ws.open.iter().find(|r| r.id == id) {
                    Some(r) => format!("wait in {} with mask {:#010x}", r.kind, r.mask),
                    None => "wait in another collective".to_string(),
                },
                Status::Running => "are still running".to_string(),
            };
            match groups.iter_mut().find(|(g, _)| *g == what) {
                Some((_, m)) => *m |= 1 << lane,
                None => groups.push((what, 1 << lane)),
            }
        }
        let pending: Vec<String> = groups
            .iter()
            .map(|(what, m)| format!("lanes {} {what}", describe_lanes(*m)))
            .collect();
        let detail = format!(
            "lanes {} wait in {} with mask {:#010x}, but {}",
            describe_lanes(round.arrived),
            round.kind,
            round.mask,
            pending.join("; ")
        );
        return EmuError::WarpCollective {
            block: st.block,
            warp: w as u32,
            detail,
        };
    }
    EmuError::BarrierDivergence {
        block: st.block,
        waiting: st.barrier_waiting,
        exited: st.exited,
    }
}
