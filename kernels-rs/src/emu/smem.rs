//! A block's dynamic shared memory, bounds-checked and race-checked.
//!
//! Race model: the block's barrier epoch (the number of completed `sync_threads` in the
//! block) orders shared memory; nothing else does. For each byte the emulator remembers the
//! thread that last stored it in the current epoch and up to two threads that loaded it.
//! Within one epoch it is a race when thread B
//! - stores to a byte that another thread stored ([`RaceKind::WriteAfterWrite`]),
//! - loads a byte that another thread stored ([`RaceKind::ReadAfterWrite`]),
//! - stores to a byte that another thread loaded ([`RaceKind::WriteAfterRead`]).
//!
//! Atomics (`smem_atomic_add_u32`) may hit the same bytes from any number of threads in
//! one epoch, but mixing them with plain loads or stores of those bytes in the same epoch
//! is a race ([`RaceKind::PlainAndAtomic`]): the values read would depend on timing.
//!
//! Warp collectives (`shfl_*`, `ballot`, `mma_*`) do **not** order shared memory in this
//! model: lanes of one warp that communicate through shared memory need a `sync_threads`
//! between the store and the load, exactly like threads of different warps. (The trait
//! has no `__syncwarp`, and since Volta lanes of a warp are not guaranteed to run in
//! lockstep.) Data races are thus reported independently of how the OS happened to
//! schedule the threads.
//!
//! Every block starts with its shared memory filled with [`SMEM_POISON`], so a kernel that
//! loads before storing reads garbage rather than a convenient zero.

use std::mem::MaybeUninit;

use super::error::{EmuError, RaceKind};

/// The byte every block's dynamic shared memory holds before the kernel stores to it.
pub const SMEM_POISON: u8 = 0xA5;

/// No thread (a `u16` thread index; threads are < 1024).
const NOBODY: u16 = u16::MAX;

/// Who touched one shared byte during which epoch (epoch 0 = never).
#[derive(Clone, Copy)]
struct ByteTrack {
    /// Epoch of the last store.
    write_epoch: u32,
    /// Epoch of the loads recorded in `reader0`/`reader1`.
    read_epoch: u32,
    /// Thread of the last store.
    writer: u16,
    /// Epoch of the last atomic.
    atomic_epoch: u32,
    /// First thread that loaded the byte in `read_epoch`.
    reader0: u16,
    /// Another thread that loaded the byte in `read_epoch`, or [`NOBODY`].
    reader1: u16,
}

/// Tracking of a byte nobody has touched.
const UNTOUCHED: ByteTrack = ByteTrack {
    write_epoch: 0,
    read_epoch: 0,
    writer: NOBODY,
    atomic_epoch: 0,
    reader0: NOBODY,
    reader1: NOBODY,
};

/// One block's shared memory: the bytes and who touched them.
pub(crate) struct Smem {
    /// The contents (`MaybeUninit` because a stored `T` may have padding bytes).
    bytes: Vec<MaybeUninit<u8>>,
    /// One entry per byte.
    track: Vec<ByteTrack>,
}

impl std::fmt::Debug for Smem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Smem")
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

/// Where in the launch an access happens (for error reports).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Accessor {
    /// `blockIdx.x`.
    pub block: u32,
    /// `threadIdx.x`.
    pub thread: u32,
    /// The block's barrier epoch (starts at 1).
    pub epoch: u32,
}

impl Smem {
    /// `len` bytes of poisoned, untouched shared memory.
    pub(crate) fn new(len: usize) -> Self {
        Self {
            bytes: vec![MaybeUninit::new(SMEM_POISON); len],
            track: vec![UNTOUCHED; len],
        }
    }

    /// Poisons the contents and forgets all accesses (a new block starts).
    pub(crate) fn reset(&mut self) {
        self.bytes.fill(MaybeUninit::new(SMEM_POISON));
        self.track.fill(UNTOUCHED);
    }

    /// The byte range of an access of `size` bytes at `offset` aligned to `align`, or the
    /// out-of-bounds error.
    fn range(
        &self,
        who: Accessor,
        offset: usize,
        size: usize,
        align: usize,
    ) -> Result<std::ops::Range<usize>, EmuError> {
        match offset.checked_add(size) {
            Some(end) if end <= self.bytes.len() && offset % align == 0 => Ok(offset..end),
            _ => Err(EmuError::SharedOutOfBounds {
                block: who.block,
                thread: who.thread,
                offset,
                size,
                smem_bytes: self.bytes.len(),
            }),
        }
    }

    /// Copies `out.len()` bytes at `offset` into `out`, after checking bounds, `align` and
    /// races, and records the load.
    pub(crate) fn load(
        &mut self,
        who: Accessor,
        offset: usize,
        align: usize,
        out: &mut [MaybeUninit<u8>],
    ) -> Result<(), EmuError> {
        let range = self.range(who, offset, out.len(), align)?;
        let me = who.thread as u16;
        for (i, t) in self.track[range.clone()].iter().enumerate() {
            if t.write_epoch == who.epoch && t.writer != me {
                return Err(race(who, offset + i, t.writer, RaceKind::ReadAfterWrite));
            }
            if t.atomic_epoch == who.epoch {
                return Err(race(who, offset + i, NOBODY, RaceKind::PlainAndAtomic));
            }
        }
        for t in &mut self.track[range.clone()] {
            if t.read_epoch != who.epoch {
                t.read_epoch = who.epoch;
                t.reader0 = me;
                t.reader1 = NOBODY;
            } else if t.reader0 != me && t.reader1 == NOBODY {
                t.reader1 = me;
            }
        }
        out.copy_from_slice(&self.bytes[range]);
        Ok(())
    }

    /// Stores `data` at `offset`, after checking bounds, `align` and races, and records the
    /// store.
    pub(crate) fn store(
        &mut self,
        who: Accessor,
        offset: usize,
        align: usize,
        data: &[MaybeUninit<u8>],
    ) -> Result<(), EmuError> {
        let range = self.range(who, offset, data.len(), align)?;
        let me = who.thread as u16;
        for (i, t) in self.track[range.clone()].iter().enumerate() {
            if t.write_epoch == who.epoch && t.writer != me {
                return Err(race(who, offset + i, t.writer, RaceKind::WriteAfterWrite));
            }
            if t.atomic_epoch == who.epoch {
                return Err(race(who, offset + i, NOBODY, RaceKind::PlainAndAtomic));
            }
            if t.read_epoch == who.epoch {
                let other = if t.reader0 != me {
                    t.reader0
                } else {
                    t.reader1
                };
                if other != NOBODY {
                    return Err(race(who, offset + i, other, RaceKind::WriteAfterRead));
                }
            }
        }
        for t in &mut self.track[range.clone()] {
            t.write_epoch = who.epoch;
            t.writer = me;
        }
        self.bytes[range].copy_from_slice(data);
        Ok(())
    }
}

impl Smem {
    /// Atomically adds `value` to the u32 at `offset` (4-byte aligned) and returns the old
    /// value, after checking bounds and mixing with plain accesses.
    pub(crate) fn atomic_add_u32(
        &mut self,
        who: Accessor,
        offset: usize,
        value: u32,
    ) -> Result<u32, EmuError> {
        let range = self.range(who, offset, 4, 4)?;
        for (i, t) in self.track[range.clone()].iter().enumerate() {
            if t.write_epoch == who.epoch {
                return Err(race(who, offset + i, t.writer, RaceKind::PlainAndAtomic));
            }
            if t.read_epoch == who.epoch {
                return Err(race(who, offset + i, t.reader0, RaceKind::PlainAndAtomic));
            }
        }
        let mut old = [0u8; 4];
        for (o, b) in old.iter_mut().zip(&self.bytes[range.clone()]) {
            // SAFETY: shared bytes are always initialised (poison at block start, or a
            // stored value); padding of a stored `T` is only reachable by a type-punned
            // access, which the caller's contract excludes.
            *o = unsafe { b.assume_init() };
        }
        let old = u32::from_le_bytes(old);
        let new = old.wrapping_add(value).to_le_bytes();
        for ((b, t), n) in self.bytes[range.clone()]
            .iter_mut()
            .zip(&mut self.track[range])
            .zip(new)
        {
            *b = MaybeUninit::new(n);
            t.atomic_epoch = who.epoch;
        }
        Ok(old)
    }
}

/// The race error for `who` completing a race with `first` at byte `offset`.
fn race(who: Accessor, offset: usize, first: u16, kind: RaceKind) -> EmuError {
    EmuError::SharedRace {
        block: who.block,
        offset,
        first_thread: u32::from(first),
        second_thread: who.thread,
        kind,
    }
}
