//! The state one block's threads share: who is running, waiting or done, the barrier,
//! the warps' exchanges, shared memory, and the first error of the launch.
//!
//! All scheduling state sits behind one mutex so that a deadlock is detected exactly: a
//! block is stuck when none of its threads is running (every thread has either returned
//! from the kernel or waits at a barrier or warp collective) and not all have returned.
//! Barrier and collective completions happen eagerly, when the last participant arrives,
//! so "nobody running" means nobody ever will. The emulator then reports what each thread
//! waits for instead of hanging.
//!
//! The threads of a launch play the blocks of the grid one after another; at the end of a
//! block they meet at an internal rendezvous, and the last thread to finish resets the
//! state (and poisons shared memory) for the next block.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use super::error::EmuError;
use super::smem::Smem;
use super::warp::{describe_lanes, WarpState};

/// Unwind payload (and error marker) that stops a GPU thread once the launch has failed.
/// It is not a panic of the kernel: the thread's driver recognises it and does not report
/// it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stop;

/// What a GPU thread is doing, as the scheduler sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Executing kernel code.
    Running,
    /// Waiting at `sync_threads`.
    AtBarrier,
    /// Waiting in the warp collective with this round id.
    InCollective(u64),
    /// Returned from the kernel (for the current block).
    Exited,
}

/// Whether the launch's threads may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// Threads are still being spawned.
    Closed,
    /// All threads exist; run.
    Open,
    /// Spawning failed; return without running anything.
    Aborted,
}

/// The scheduling state of the block being run (behind [`BlockSync`]'s mutex).
#[derive(Debug)]
pub(crate) struct State {
    /// `blockIdx.x` of the block being run.
    pub block: u32,
    /// `blockDim.x`.
    pub block_dim: u32,
    /// `gridDim.x`.
    grid_dim: u32,
    /// One entry per thread of the block.
    pub status: Vec<Status>,
    /// Threads with [`Status::Running`].
    pub running: u32,
    /// Threads with [`Status::Exited`].
    pub exited: u32,
    /// Threads waiting at the barrier.
    pub barrier_waiting: u32,
    /// Number of completed barriers (wakes the waiters when it changes).
    pub barrier_generation: u64,
    /// One per warp of the block.
    pub warps: Vec<WarpState>,
    /// Id for the next warp collective round.
    pub next_round: u64,
    /// The launch's first error.
    error: Option<EmuError>,
    /// Number of finished blocks (wakes the end-of-block rendezvous when it changes).
    blocks_done: u32,
    /// Start gate.
    gate: Gate,
}

/// Synchronisation and shared state of the block being run.
#[derive(Debug)]
pub(crate) struct BlockSync {
    /// Scheduling state.
    state: Mutex<State>,
    /// Barrier waiters.
    pub barrier_cv: Condvar,
    /// Warp collective waiters, one per warp.
    pub warp_cvs: Vec<Condvar>,
    /// End-of-block rendezvous and start gate.
    lifecycle_cv: Condvar,
    /// Mirror of `state.error.is_some()` for cheap checks.
    poisoned: AtomicBool,
    /// Barrier epoch of the block (1 + completed barriers), read by shared memory checks.
    pub epoch: AtomicU32,
    /// Dynamic shared memory.
    pub smem: Mutex<Smem>,
}

impl BlockSync {
    /// State for a launch of `grid_dim` blocks of `block_dim` threads with `smem_bytes`
    /// of dynamic shared memory; the first block is 0.
    pub(crate) fn new(grid_dim: u32, block_dim: u32, smem_bytes: usize) -> Self {
        let warps = block_dim.div_ceil(32);
        Self {
            state: Mutex::new(State {
                block: 0,
                block_dim,
                grid_dim,
                status: vec![Status::Running; block_dim as usize],
                running: block_dim,
                exited: 0,
                barrier_waiting: 0,
                barrier_generation: 0,
                warps: (0..warps)
                    .map(|w| WarpState::new(crate::simt::warp_mask(block_dim, w)))
                    .collect(),
                next_round: 0,
                error: None,
                blocks_done: 0,
                gate: Gate::Closed,
            }),
            barrier_cv: Condvar::new(),
            warp_cvs: (0..warps).map(|_| Condvar::new()).collect(),
            lifecycle_cv: Condvar::new(),
            poisoned: AtomicBool::new(false),
            epoch: AtomicU32::new(1),
            smem: Mutex::new(Smem::new(smem_bytes)),
        }
    }

    /// Locks the scheduling state. A poisoned mutex (a panic while it was held, which the
    /// emulator's own code does not do) is entered anyway: the launch is failing by then.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks shared memory (see [`BlockSync::lock`] on poisoning).
    pub(crate) fn lock_smem(&self) -> MutexGuard<'_, Smem> {
        self.smem.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits on `cv`, tolerating poisoning like [`BlockSync::lock`].
    pub(crate) fn wait<'a>(cv: &Condvar, guard: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        cv.wait(guard).unwrap_or_else(PoisonError::into_inner)
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
        self.barrier_cv.notify_all();
        for cv in &self.warp_cvs {
            cv.notify_all();
        }
        self.lifecycle_cv.notify_all();
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

    /// Marks `thread` as blocked with `status`, and fails the launch if that leaves the
    /// block with no running thread (a deadlock).
    pub(crate) fn block_thread(&self, st: &mut State, thread: u32, status: Status) {
        st.status[thread as usize] = status;
        st.running -= 1;
        self.fail_if_stuck(st);
    }

    /// Marks blocked `thread` as running again (called by whoever completes its wait).
    pub(crate) fn unblock_thread(st: &mut State, thread: u32) {
        st.status[thread as usize] = Status::Running;
        st.running += 1;
    }

    /// Fails the launch when no thread runs but not all have returned.
    fn fail_if_stuck(&self, st: &mut State) {
        if st.running == 0 && st.exited < st.block_dim && st.error.is_none() {
            let err = diagnose(st);
            self.fail(st, err);
        }
    }

    /// Sets the start gate (`true`: run; `false`: spawning failed, return).
    pub(crate) fn open_gate(&self, run: bool) {
        let mut st = self.lock();
        st.gate = if run { Gate::Open } else { Gate::Aborted };
        self.lifecycle_cv.notify_all();
    }

    /// Waits for the start gate; `false` when the threads must not run.
    pub(crate) fn wait_gate(&self) -> bool {
        let mut st = self.lock();
        while st.gate == Gate::Closed {
            st = Self::wait(&self.lifecycle_cv, st);
        }
        st.gate == Gate::Open
    }

    /// `thread` has finished the current block: it returned from the kernel
    /// (`returned`) or was stopped. Checks that no collective waits for it, then meets
    /// the other threads at the end-of-block rendezvous. Returns `true` when the thread
    /// should run the next block (there is one and the launch has not failed).
    pub(crate) fn finish_block(&self, thread: u32, returned: bool) -> bool {
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
        }
        st.status[thread as usize] = Status::Exited;
        st.exited += 1;
        st.warps[(thread / 32) as usize].exited |= 1 << (thread % 32);
        self.fail_if_stuck(&mut st);
        if st.error.is_some() {
            return false;
        }
        let done = st.blocks_done;
        if st.exited == st.block_dim {
            st.blocks_done += 1;
            if st.blocks_done < st.grid_dim {
                self.next_block(&mut st);
            }
            self.lifecycle_cv.notify_all();
        } else {
            while st.blocks_done == done && st.error.is_none() {
                st = Self::wait(&self.lifecycle_cv, st);
            }
        }
        st.error.is_none() && st.blocks_done < st.grid_dim
    }

    /// Resets everything for the next block (all threads have returned).
    fn next_block(&self, st: &mut State) {
        st.block += 1;
        st.status.fill(Status::Running);
        st.running = st.block_dim;
        st.exited = 0;
        st.barrier_waiting = 0;
        for w in &mut st.warps {
            w.reset();
        }
        self.epoch.store(1, Ordering::Release);
        self.lock_smem().reset();
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
