//! The forward pass's activation buffers, handed out again once dropped.
//!
//! A buffer from [`Backend::alloc`] is zero-filled. On the cpu backend that fill, with
//! the page faults of a fresh allocation, took about a tenth of a prefill step of the
//! tiny model. Every activation of the forward pass is the output of an op that writes
//! all of it before anything reads it (the ops' contracts: `indexer_logits` writes
//! `-inf` outside each row's range, `topk` pads with `-1`, a [`Matmul`] with
//! [`Accumulate::Overwrite`] does not read its output), so a buffer can be handed out
//! again holding whatever it last held. Only the residual stream is accumulated into,
//! and it is written whole by the embedding first.
//!
//! A step's lengths depend on its rows, which change from step to step; a buffer that
//! neither the last step nor the current one gave back is freed when the next step
//! starts ([`ActivationPool::start_step`]), so the pool holds about two steps' buffers,
//! and never more than its bound.
//!
//! [`Matmul`]: sparsekit_host::model_ops::Matmul
//! [`Accumulate::Overwrite`]: sparsekit_host::model_ops::Accumulate

use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

use sparsekit_host::Backend;

/// Bytes of idle buffers a model keeps at most by default (beyond it the oldest idle
/// buffers are freed).
pub const DEFAULT_POOL_BYTES: usize = 256 << 20;

/// Idle activation buffers of one model, by exact length in bytes (the ops check exact
/// sizes), at most `max_bytes` of them in all.
pub(crate) struct ActivationPool<Buf> {
    idle: Mutex<Idle<Buf>>,
    max_bytes: usize,
}

struct Idle<Buf> {
    /// `(bytes, step given back, buffer)`, oldest first.
    bufs: Vec<(usize, u64, Buf)>,
    /// Sum of the lengths in `bufs`.
    bytes: usize,
    /// The current step ([`ActivationPool::start_step`]).
    step: u64,
}

impl<Buf> std::fmt::Debug for ActivationPool<Buf> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle = self.idle();
        f.debug_struct("ActivationPool")
            .field("idle_buffers", &idle.bufs.len())
            .field("idle_bytes", &idle.bytes)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

impl<Buf> ActivationPool<Buf> {
    /// A pool keeping at most `max_bytes` of idle buffers (0: none, every buffer is new).
    pub(crate) fn new(max_bytes: usize) -> Self {
        ActivationPool {
            idle: Mutex::new(Idle {
                bufs: Vec::new(),
                bytes: 0,
                step: 0,
            }),
            max_bytes,
        }
    }

    /// Starts a step: frees the idle buffers given back before the previous step
    /// (outside the lock).
    pub(crate) fn start_step(&self) {
        let freed: Vec<(usize, u64, Buf)> = {
            let mut idle = self.idle();
            idle.step += 1;
            let keep_from = idle.step - 1;
            let (keep, freed): (Vec<_>, Vec<_>) = std::mem::take(&mut idle.bufs)
                .into_iter()
                .partition(|(_, given, _)| *given >= keep_from);
            idle.bufs = keep;
            idle.bytes -= freed.iter().map(|(n, _, _)| n).sum::<usize>();
            freed
        };
        drop(freed);
    }

    /// The idle list. A panic while it was held cannot leave it inconsistent (each
    /// change is one push or remove with its byte count), so a poisoned lock is taken over.
    fn idle(&self) -> MutexGuard<'_, Idle<Buf>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of `bytes` bytes whose contents are unspecified: the most recently idle
    /// one of that length, else a new one from `backend` (zero-filled). The caller must
    /// write all of it before reading any of it.
    pub(crate) fn take<B: Backend<Buffer = Buf>>(
        &self,
        backend: &B,
        bytes: usize,
    ) -> sparsekit_host::Result<Act<'_, Buf>> {
        let reused = {
            let mut idle = self.idle();
            match idle.bufs.iter().rposition(|(n, _, _)| *n == bytes) {
                Some(i) => {
                    idle.bytes -= bytes;
                    Some(idle.bufs.remove(i).2)
                }
                None => None,
            }
        };
        let buf = match reused {
            Some(buf) => buf,
            None => backend.alloc(bytes)?,
        };
        Ok(Act {
            buf: Some(buf),
            bytes,
            pool: self,
        })
    }

    /// Keeps `buf` (`bytes` long) for a later [`Self::take`], freeing the oldest idle
    /// buffers beyond `max_bytes` (outside the lock).
    fn give(&self, bytes: usize, buf: Buf) {
        if bytes > self.max_bytes {
            return;
        }
        let freed: Vec<(usize, u64, Buf)> = {
            let mut idle = self.idle();
            let step = idle.step;
            idle.bufs.push((bytes, step, buf));
            idle.bytes += bytes;
            let mut n = 0;
            let mut over = idle.bytes.saturating_sub(self.max_bytes);
            while over > 0 {
                over = over.saturating_sub(idle.bufs[n].0);
                n += 1;
            }
            let freed: Vec<_> = idle.bufs.drain(..n).collect();
            idle.bytes -= freed.iter().map(|(n, _, _)| n).sum::<usize>();
            freed
        };
        drop(freed);
    }

    /// Replaces every idle buffer by one of the same length holding only `0xFF` bytes
    /// (NaN as f32 and bf16, `-1` as i32): a read of a byte that the op before did not
    /// write then shows in the results.
    #[cfg(test)]
    pub(crate) fn poison<B: Backend<Buffer = Buf>>(
        &self,
        backend: &B,
    ) -> sparsekit_host::Result<()> {
        let mut idle = self.idle();
        for (n, _, buf) in idle.bufs.iter_mut() {
            *buf = backend.upload(&vec![0xFF; *n])?;
        }
        Ok(())
    }

    /// Idle buffers and their bytes.
    #[cfg(test)]
    pub(crate) fn idle_counts(&self) -> (usize, usize) {
        let idle = self.idle();
        (idle.bufs.len(), idle.bytes)
    }
}

/// An activation buffer taken from an [`ActivationPool`], given back when dropped. It
/// dereferences to the backend's buffer.
pub(crate) struct Act<'p, Buf> {
    /// `Some` until dropped or [`Act::into_inner`].
    buf: Option<Buf>,
    bytes: usize,
    pool: &'p ActivationPool<Buf>,
}

impl<Buf> Act<'_, Buf> {
    /// The buffer, kept by the caller (never given back).
    pub(crate) fn into_inner(mut self) -> Buf {
        // `buf` is `Some` until this call or the drop, each of which happens once.
        match self.buf.take() {
            Some(buf) => buf,
            None => unreachable!("an Act's buffer is taken once"),
        }
    }
}

impl<Buf> Deref for Act<'_, Buf> {
    type Target = Buf;
    fn deref(&self) -> &Buf {
        match &self.buf {
            Some(buf) => buf,
            None => unreachable!("an Act's buffer is taken once"),
        }
    }
}

impl<Buf> DerefMut for Act<'_, Buf> {
    fn deref_mut(&mut self) -> &mut Buf {
        match &mut self.buf {
            Some(buf) => buf,
            None => unreachable!("an Act's buffer is taken once"),
        }
    }
}

impl<Buf> Drop for Act<'_, Buf> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give(self.bytes, buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparsekit_host::CpuBackend;

    #[test]
    fn a_dropped_buffer_is_handed_out_again_for_its_length_only() {
        let b = CpuBackend::new();
        let pool = ActivationPool::new(1 << 20);
        let mut a = pool.take(&b, 4096).unwrap();
        a.bytes_mut()[0] = 7;
        drop(a);
        assert_eq!(pool.idle_counts(), (1, 4096));
        // Another length: a new buffer, the idle one stays.
        let c = pool.take(&b, 2048).unwrap();
        assert_eq!(c.len(), 2048);
        assert_eq!(pool.idle_counts(), (1, 4096));
        // The same length: the idle one, with what it held.
        let d = pool.take(&b, 4096).unwrap();
        assert_eq!(d.bytes()[0], 7);
        assert_eq!(pool.idle_counts(), (0, 0));
        drop((c, d));
        assert_eq!(pool.idle_counts(), (2, 6144));
    }

    #[test]
    fn idle_bytes_stay_within_the_bound_oldest_freed_first() {
        let b = CpuBackend::new();
        let pool = ActivationPool::new(10_000);
        let bufs: Vec<_> = [3000, 4000, 5000]
            .iter()
            .map(|&n| pool.take(&b, n).unwrap())
            .collect();
        drop(bufs);
        // 12,000 bytes given back: the oldest (3000) is freed.
        assert_eq!(pool.idle_counts(), (2, 9000));
        assert_eq!(pool.take(&b, 4000).unwrap().len(), 4000);
        // A buffer longer than the bound is never kept.
        drop(pool.take(&b, 20_000).unwrap());
        assert_eq!(pool.idle_counts().1, 9000);
        let off = ActivationPool::new(0);
        drop(off.take(&b, 64).unwrap());
        assert_eq!(off.idle_counts(), (0, 0));
    }

    #[test]
    fn a_step_frees_what_neither_it_nor_the_last_step_gave_back() {
        let b = CpuBackend::new();
        let pool = ActivationPool::new(1 << 20);
        pool.start_step();
        drop(pool.take(&b, 100).unwrap());
        pool.start_step();
        drop(pool.take(&b, 200).unwrap());
        // The last step's buffer and this one's stay.
        assert_eq!(pool.idle_counts(), (2, 300));
        pool.start_step();
        // The 100 was given back two steps ago: freed.
        assert_eq!(pool.idle_counts(), (1, 200));
        // Taken and given back again this step: it stays one more step.
        drop(pool.take(&b, 200).unwrap());
        pool.start_step();
        assert_eq!(pool.idle_counts(), (1, 200));
        pool.start_step();
        assert_eq!(pool.idle_counts(), (0, 0));
    }

    #[test]
    fn a_kept_buffer_is_not_given_back() {
        let b = CpuBackend::new();
        let pool = ActivationPool::new(1 << 20);
        let kept = pool.take(&b, 64).unwrap().into_inner();
        assert_eq!(kept.len(), 64);
        assert_eq!(pool.idle_counts(), (0, 0));
    }
}
