//! `sync_threads`: a real barrier over the block's threads.
//!
//! The barrier completes when every thread of the block has arrived; it then advances the
//! block's shared-memory epoch (see [`super::smem`]) and releases the waiting threads
//! (their workers are woken in turn, see [`super::block`]). If threads wait at the barrier
//! while others have returned from the kernel, the block can never proceed: the block's
//! deadlock detection reports
//! [`EmuError::BarrierDivergence`](super::EmuError::BarrierDivergence) (or a warp
//! collective error when a collective is also stuck) as soon as the last running thread
//! stops, instead of hanging.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::block::{BlockSync, Status, Stop, Wakes};

impl BlockSync {
    /// Thread `thread` arrives at the barrier; returns once all threads of the block have.
    pub(crate) fn sync_threads(self: &Arc<Self>, thread: u32) -> Result<(), Stop> {
        {
            // (Declared first: the wake-ups happen after the state lock is released.)
            let mut wakes = Wakes::new(self);
            let mut st = self.lock();
            BlockSync::check(&st)?;
            st.barrier_waiting += 1;
            if st.barrier_waiting == st.block_dim {
                self.epoch.fetch_add(1, Ordering::AcqRel);
                if let Some(t) = &self.tracer {
                    t.barriers.fetch_add(1, Ordering::Relaxed);
                }
                st.barrier_waiting = 0;
                for t in 0..st.block_dim {
                    if t != thread {
                        self.release(&mut st, t, None);
                    }
                }
                self.schedule(&mut st, &mut wakes);
                return Ok(());
            }
            self.block_thread(&mut st, thread, Status::AtBarrier, &mut wakes);
        }
        self.wait_released(thread, false).map(|_| ())
    }
}
