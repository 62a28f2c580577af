//! The `emu` backend: the GPU kernels of `sparsekit-kernels`, unchanged, run on the host
//! by the SIMT emulator, over host buffers. Slow, and meant for validation: it catches
//! index-arithmetic bugs and barrier/warp misuse of the real kernels without a GPU.
//!
//! Its ops are the shared GPU-backend ops of [`crate::launcher`] (the same validation,
//! parameters and launch geometry as the CUDA backend); this module only provides the
//! primitives: host buffers, metadata read in place, and a synchronous typed launch. Both
//! streams run synchronously (every op has completed when its call returns).

use sparsekit_kernels::emu::launch_kernel;
use sparsekit_kernels::launch::KernelParams;

use crate::backend::{Backend, StreamKind};
use crate::cpu::{buffer::host_memory_methods, CpuBuffer};
use crate::error::{Error, Result};
use crate::launcher::KernelDevice;

/// The emulator backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct EmuBackend {
    stream: StreamKind,
}

impl EmuBackend {
    /// A new emulator backend (on its compute stream).
    pub fn new() -> Self {
        EmuBackend::default()
    }
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

    unsafe fn enqueue<P: KernelParams>(&self, params: P) -> Result<()> {
        // SAFETY: the caller's contract: the addresses in `params` are those of buffers
        // and staged metadata borrowed for this call, and the launch is synchronous.
        unsafe { launch_kernel(params) }
            .map_err(|e| Error::backend("emu", format!("kernel {}", P::ENTRY), e))
    }
}
