//! The `emu` backend: the GPU kernels of `sparsekit-kernels`, unchanged, run on the host
//! by the SIMT emulator, over host buffers. Slow, and meant for validation: it catches
//! index-arithmetic bugs and barrier/warp misuse of the real kernels without a GPU.
//!
//! Its ops are the shared GPU-backend ops of [`crate::launcher`] (the same validation,
//! parameters and launch geometry as the CUDA backend); this module only provides the
//! primitives: host buffers, metadata read in place, and a synchronous typed launch. Both
//! streams run synchronously (every op has completed when its call returns).
//!
//! Every launch checks the kernel's global accesses against the buffers of the op (the
//! launcher's [`Span`]s): an access out of bounds, misaligned, storing to an input or
//! reading an output byte not yet written fails the op with the emulator's report
//! (kernel, block, thread, buffer, byte offset). A *profiling* backend
//! ([`EmuBackend::profiling`]) also traces the accesses of a sample of each launch's
//! blocks for the performance model and keeps the [`Profile`]s.

use std::sync::{Arc, Mutex};

pub use sparsekit_kernels::emu::EmuTarget;
use sparsekit_kernels::emu::{launch_kernel, profile_kernel, GlobalBuffers, Profile};
use sparsekit_kernels::launch::KernelParams;

use crate::backend::{Backend, StreamKind};
use crate::cpu::{buffer::host_memory_methods, CpuBuffer};
use crate::error::{Error, Result};
use crate::launcher::{KernelDevice, Span};

/// The emulator backend.
#[derive(Clone, Debug, Default)]
pub struct EmuBackend {
    stream: StreamKind,
    profiler: Option<Arc<Profiler>>,
    target: EmuTarget,
}

/// The profiles a profiling [`EmuBackend`] collected.
#[derive(Debug)]
struct Profiler {
    /// Blocks traced per launch (the first ones of the grid).
    sample_blocks: u32,
    profiles: Mutex<Vec<Profile>>,
}

impl EmuBackend {
    /// A new emulator backend (on its compute stream).
    pub fn new() -> Self {
        EmuBackend::default()
    }

    /// A backend that traces every launch for the performance model: it runs only the
    /// first `sample_blocks` blocks of each grid (the grid keeps its real size, so
    /// grid-stride loops behave as on the GPU) and keeps each launch's [`Profile`]. Blocks
    /// not sampled do not run: outputs are incomplete, so use it for profiling only.
    pub fn profiling(sample_blocks: u32) -> Self {
        EmuBackend {
            stream: StreamKind::default(),
            profiler: Some(Arc::new(Profiler {
                sample_blocks: sample_blocks.max(1),
                profiles: Mutex::new(Vec::new()),
            })),
            target: EmuTarget::Generic,
        }
    }

    /// This backend emulating `target`: [`EmuTarget::Sm120a`] runs the kernels as the
    /// `sm_120a` PTX does (the block-scaled MXFP8 mma paths); the default,
    /// [`EmuTarget::Generic`], as every other arch.
    pub fn with_target(mut self, target: EmuTarget) -> Self {
        self.target = target;
        self
    }

    /// The GPU this backend emulates.
    pub fn target(&self) -> EmuTarget {
        self.target
    }

    /// The profiles of the launches so far (oldest first), emptied; empty unless the
    /// backend is [`EmuBackend::profiling`].
    pub fn take_profiles(&self) -> Vec<Profile> {
        self.profiler.as_ref().map_or_else(Vec::new, |p| {
            std::mem::take(&mut *p.profiles.lock().unwrap_or_else(|e| e.into_inner()))
        })
    }
}

/// The emulator's view of a launch's spans.
fn global_buffers<P: KernelParams>(spans: &[Span]) -> Result<GlobalBuffers> {
    let mut b = GlobalBuffers::new(P::ENTRY);
    for s in spans {
        b.add(s.name, s.addr as usize, s.bytes, s.access)
            .map_err(|e| Error::backend("emu", format!("kernel {}", P::ENTRY), e))?;
    }
    Ok(b)
}

impl Backend for EmuBackend {
    type Buffer = CpuBuffer;

    fn name(&self) -> &str {
        "emu"
    }

    host_memory_methods!();
    crate::kernel_backend_ops!();
}

// SAFETY: host buffers and borrowed metadata are addressed directly and stay borrowed for
// the whole call; `enqueue` runs the kernel synchronously (with its own geometry) before
// any borrow ends, so every use is ordered by the call itself.
unsafe impl KernelDevice for EmuBackend {
    type Staged<'a> = &'a [u8];

    /// Host metadata is read in place: the launch is synchronous, so the borrow outlives it.
    fn stage<'a>(&self, bytes: &'a [u8]) -> Result<&'a [u8]> {
        Ok(bytes)
    }

    fn staged_addr(&self, staged: &&[u8]) -> u64 {
        staged.as_ptr() as u64
    }

    fn with_addrs<R>(
        &self,
        reads: &[&CpuBuffer],
        writes: &mut [&mut CpuBuffer],
        f: impl FnOnce(&[u64], &[u64]) -> R,
    ) -> Result<R> {
        let read: Vec<u64> = reads.iter().map(|b| b.bytes().as_ptr() as u64).collect();
        let write: Vec<u64> = writes
            .iter_mut()
            .map(|b| b.bytes_mut().as_mut_ptr() as u64)
            .collect();
        Ok(f(&read, &write))
    }

    unsafe fn enqueue<P: KernelParams>(&self, params: P, spans: &[Span]) -> Result<()> {
        let buffers = global_buffers::<P>(spans)?;
        let fail = |e| Error::backend("emu", format!("kernel {}", P::ENTRY), e);
        match &self.profiler {
            None => {
                // SAFETY: the caller's contract: the addresses in `params` are those of
                // buffers and staged metadata borrowed for this call (`spans`), and the
                // launch is synchronous.
                unsafe { launch_kernel(self.target, params, &buffers) }.map_err(fail)
            }
            Some(prof) => {
                let grid = params.launch().grid;
                let blocks: Vec<u32> = (0..prof.sample_blocks.min(grid)).collect();
                // SAFETY: as above.
                let profile =
                    unsafe { profile_kernel(self.target, params, &buffers, Some(&blocks)) }
                        .map_err(fail)?;
                prof.profiles
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(profile);
                Ok(())
            }
        }
    }
}

/// The dense model ops run as the GPU's dense kernels in the emulator
/// ([`crate::launcher::dense`]).
impl crate::model_ops::ModelOps for EmuBackend {
    crate::kernel_model_ops!();
}
