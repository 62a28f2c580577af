//! `sync_threads`: a real barrier over the block's threads.
//!
//! The barrier completes when every thread of the block has arrived; it then advances the
//! block's shared-memory epoch (see [`super::smem`]). If threads wait at the barrier while
//! others have returned from the kernel, the block can never proceed: the block's deadlock
//! detection reports [`EmuError::BarrierDivergence`](super::EmuError::BarrierDivergence)
//! (or a warp collective error when a collective is also stuck) as soon as the last
//! running thread stops, instead of hanging.

use std::sync::atomic::Ordering;

use super::block::{BlockSync, Status, Stop};

impl BlockSync {
    /// Thread `thread` arrives at the barrier; returns once all threads of the block have.
    pub(crate) fn sync_threads(&self, thread: u32) -> Result<(), Stop> {
        let mut st = self.lock();
        BlockSync::check(&st)?;
        st.barrier_waiting += 1;
        if st.barrier_waiting == st.block_dim {
            self.epoch.fetch_add(1, Ordering::AcqRel);
            st.barrier_waiting = 0;
            st.barrier_generation += 1;
            for t in 0..st.block_dim {
                if t != thread {
                    BlockSync::unblock_thread(&mut st, t);
                }
            }
            self.barrier_cv.notify_all();
            return Ok(());
        }
        let generation = st.barrier_generation;
        self.block_thread(&mut st, thread, Status::AtBarrier);
        while st.barrier_generation == generation {
            BlockSync::check(&st)?;
            st = BlockSync::wait(&self.barrier_cv, st);
        }
        Ok(())
    }
}
