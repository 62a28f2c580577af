//! What the emulator reports when a kernel misuses the machine.

use std::fmt;

use super::global::GlobalAccessError;

/// Which pair of shared-memory accesses raced (two threads touched the same byte between
/// the same two barriers, at least one of them writing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RaceKind {
    /// Two different threads stored to the byte.
    WriteAfterWrite,
    /// A thread loaded a byte another thread had stored.
    ReadAfterWrite,
    /// A thread stored to a byte another thread had loaded.
    WriteAfterRead,
    /// A plain load or store and an atomic touched the byte in one epoch.
    PlainAndAtomic,
}

impl fmt::Display for RaceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::WriteAfterWrite => "write after write",
            Self::PlainAndAtomic => "plain access mixed with an atomic",
            Self::ReadAfterWrite => "read after write",
            Self::WriteAfterRead => "write after read",
        })
    }
}

/// Why an emulated launch failed. The first misuse detected wins; every other thread of
/// the launch is then woken and stopped, so a launch always returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmuError {
    /// The [`LaunchConfig`](super::LaunchConfig) is outside what the hardware allows.
    InvalidConfig {
        /// What is wrong.
        detail: String,
    },
    /// The host could not start the OS threads that play the GPU threads.
    ThreadSpawn {
        /// The OS error.
        message: String,
    },
    /// Some threads of a block wait at `sync_threads` that the others, having returned from
    /// the kernel, will never reach.
    BarrierDivergence {
        /// `blockIdx.x`.
        block: u32,
        /// Threads waiting at the barrier.
        waiting: u32,
        /// Threads that had returned from the kernel.
        exited: u32,
    },
    /// A warp collective (`shfl_*`, `ballot`, `mma_*`) was misused: its mask names a lane
    /// that does not exist or has exited, lanes of one mask reached different collectives,
    /// or a `shfl_idx` read a lane outside the mask.
    WarpCollective {
        /// `blockIdx.x`.
        block: u32,
        /// Warp within the block.
        warp: u32,
        /// What happened, lane by lane.
        detail: String,
    },
    /// A `smem_load`/`smem_store` outside the launch's dynamic shared memory, or misaligned
    /// for its type.
    SharedOutOfBounds {
        /// `blockIdx.x`.
        block: u32,
        /// `threadIdx.x` of the offending thread.
        thread: u32,
        /// Byte offset of the access.
        offset: usize,
        /// Size of the accessed type in bytes.
        size: usize,
        /// The launch's dynamic shared memory size in bytes.
        smem_bytes: usize,
    },
    /// Two threads accessed the same shared byte between the same two barriers, at least
    /// one of them storing.
    SharedRace {
        /// `blockIdx.x`.
        block: u32,
        /// First byte offset found racing.
        offset: usize,
        /// The thread whose access came first.
        first_thread: u32,
        /// The thread whose access completed the race.
        second_thread: u32,
        /// Which accesses raced.
        kind: RaceKind,
    },
    /// A global memory access failed a check (out of bounds, misaligned, a store to a
    /// read-only buffer, an uninitialised read): see [`GlobalAccessError`].
    GlobalMemory(Box<GlobalAccessError>),
    /// A kernel thread panicked (for instance an index out of bounds in kernel code).
    KernelPanic {
        /// `blockIdx.x`.
        block: u32,
        /// `threadIdx.x`.
        thread: u32,
        /// The panic message.
        message: String,
    },
}

impl fmt::Display for EmuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidConfig { detail } => write!(f, "invalid launch configuration: {detail}"),
            Self::ThreadSpawn { message } => {
                write!(f, "could not start the emulator's threads: {message}")
            }
            Self::BarrierDivergence {
                block,
                waiting,
                exited,
            } => write!(
                f,
                "block {block}: {waiting} thread(s) wait at sync_threads but {exited} thread(s) \
                 returned from the kernel without reaching it"
            ),
            Self::WarpCollective {
                block,
                warp,
                detail,
            } => write!(
                f,
                "block {block}, warp {warp}: warp collective misuse: {detail}"
            ),
            Self::SharedOutOfBounds {
                block,
                thread,
                offset,
                size,
                smem_bytes,
            } => write!(
                f,
                "block {block}, thread {thread}: shared memory access of {size} byte(s) at \
                 offset {offset} is out of bounds or misaligned (dynamic shared memory is \
                 {smem_bytes} bytes)"
            ),
            Self::SharedRace {
                block,
                offset,
                first_thread,
                second_thread,
                kind,
            } => write!(
                f,
                "block {block}: shared memory race ({kind}) at byte offset {offset} between \
                 thread {first_thread} and thread {second_thread} with no sync_threads between"
            ),
            Self::GlobalMemory(e) => write!(f, "{e}"),
            Self::KernelPanic {
                block,
                thread,
                message,
            } => write!(
                f,
                "block {block}, thread {thread}: kernel panicked: {message}"
            ),
        }
    }
}

impl std::error::Error for EmuError {}
