//! The `emu` backend: the GPU kernels of `sparsekit-kernels`, unchanged, run on the host
//! by the SIMT emulator, over host buffers. Slow, and meant for validation: it catches
//! index-arithmetic bugs and barrier/warp misuse of the real kernels without a GPU.
//!
//! Its ops are the shared GPU-backend ops of [`crate::launcher`] (the same validation,
//! parameters and launch geometry as the CUDA backend); this module only provides the
//! primitives: host buffers, metadata read in place, and a synchronous typed launch. Both
//! streams run synchronously (every op has completed when its call returns).

use sparsekit_kernels::emu::{launch_kernel, EmuError};
use sparsekit_kernels::launch::KernelParams;

use crate::backend::{Event, StreamKind};
use crate::cpu::CpuBuffer;
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

fn emu_err(kernel: &str, e: EmuError) -> Error {
    Error::Device(format!("emulator, kernel {kernel}: {e}"))
}

impl KernelDevice for EmuBackend {
    type Buffer = CpuBuffer;
    type Staged<'a> = &'a [u8];

    fn name(&self) -> &str {
        "emu"
    }

    fn upload(&self, bytes: &[u8]) -> Result<CpuBuffer> {
        Ok(CpuBuffer::from_bytes(bytes))
    }

    fn alloc(&self, bytes: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer::zeroed(bytes))
    }

    fn alloc_host(&self, bytes: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer::zeroed(bytes))
    }

    fn download(&self, buf: &CpuBuffer) -> Result<Vec<u8>> {
        Ok(buf.bytes().to_vec())
    }

    fn buffer_len(&self, buf: &CpuBuffer) -> usize {
        buf.len()
    }

    fn on_stream(&self, stream: StreamKind) -> Result<Self> {
        Ok(EmuBackend { stream })
    }

    fn stream(&self) -> StreamKind {
        self.stream
    }

    fn record_event(&self) -> Result<Event> {
        Ok(Event::complete())
    }

    fn wait_event(&self, event: &Event) -> Result<()> {
        event.wait(Event::DEFAULT_TIMEOUT)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

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
        let r: Vec<u64> = reads.iter().map(|b| b.bytes().as_ptr() as u64).collect();
        let w: Vec<u64> = writes
            .iter_mut()
            .map(|b| b.bytes_mut().as_mut_ptr() as u64)
            .collect();
        Ok(f(&r, &w))
    }

    unsafe fn enqueue<P: KernelParams>(&self, params: P) -> Result<()> {
        // SAFETY: the caller's contract: the addresses in `params` are those of buffers
        // and staged metadata borrowed for this call, and the launch is synchronous.
        unsafe { launch_kernel(params) }.map_err(|e| emu_err(P::ENTRY, e))
    }
}
