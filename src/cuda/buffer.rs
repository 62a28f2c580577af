//! CUDA buffers: device memory, or page-locked device-mapped host memory (the host cache
//! tier), with the cross-stream ordering each needs.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use sparsekit_host::{Error, Result};

use super::cuda;

/// Memory the kernels of one [`CudaBackend`](super::CudaBackend) can address, made only by
/// that backend (`upload`, `alloc`, `alloc_host`), so an op never sees memory of another
/// context or of unknown provenance.
#[derive(Debug)]
pub struct CudaBuffer(pub(super) Memory);

/// The two kinds of memory behind a [`CudaBuffer`].
#[derive(Debug)]
pub(super) enum Memory {
    /// Device memory. cudarc's per-buffer read/write events order its uses across the
    /// compute and copy streams (a stream that reads waits for the last write, a writer for
    /// every earlier use), and its free waits for them.
    Device(CudaSlice<u8>),
    /// Page-locked host memory mapped into the device's address space (unified addressing
    /// gives it the same address there), which the kernels read and write over PCIe.
    /// Ordered by [`HostBuffer`]'s own last-use event.
    Host(HostBuffer),
}

impl CudaBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            Memory::Device(s) => s.len(),
            Memory::Host(h) => h.slice.len(),
        }
    }

    /// Whether the buffer is page-locked host memory (the host tier).
    pub fn is_host(&self) -> bool {
        matches!(self.0, Memory::Host(_))
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Mapped host memory and the event recorded after the last work enqueued on it (on
/// either stream). Every use waits for the previous one on the device (uses are treated
/// as writes: the host tier is touched by page copies only, so nothing is lost), the host
/// waits for it before it reads the bytes, and the memory is not freed before it.
#[derive(Debug)]
pub(super) struct HostBuffer {
    slice: PinnedHostSlice<u8>,
    last_use: Mutex<Option<Arc<CudaEvent>>>,
}

impl HostBuffer {
    /// Wraps freshly allocated (and initialised) mapped memory.
    pub(super) fn new(slice: PinnedHostSlice<u8>) -> Self {
        HostBuffer {
            slice,
            last_use: Mutex::new(None),
        }
    }

    fn last_use(&self) -> Result<Option<Arc<CudaEvent>>> {
        self.last_use
            .lock()
            .map(|g| g.clone())
            .map_err(|_| Error::Device("host buffer lock poisoned".into()))
    }

    /// Makes `stream` wait for the previous use (device side); returns the address the
    /// kernels use.
    pub(super) fn before_use(&self, stream: &CudaStream) -> Result<u64> {
        if let Some(e) = self.last_use()? {
            stream.wait(&e).map_err(cuda("event wait"))?;
        }
        // The mapped pointer: `as_ptr` only waits for cudarc's own copies (none here).
        Ok(self.slice.as_ptr().map_err(cuda("host buffer address"))? as u64)
    }

    /// Records the use just enqueued on `stream`.
    pub(super) fn after_use(&self, stream: &CudaStream) -> Result<()> {
        let e = stream.record_event(None).map_err(cuda("event record"))?;
        let mut g = self
            .last_use
            .lock()
            .map_err(|_| Error::Device("host buffer lock poisoned".into()))?;
        *g = Some(Arc::new(e));
        Ok(())
    }

    /// The bytes, once every enqueued use has completed (host wait, bounded by
    /// `sparsekit_host::Event::DEFAULT_TIMEOUT`).
    pub(super) fn read(&self) -> Result<Vec<u8>> {
        if let Some(e) = self.last_use()? {
            super::wait_host(&e, cuda("host buffer wait"))?;
        }
        Ok(self
            .slice
            .as_slice()
            .map_err(cuda("host buffer read"))?
            .to_vec())
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // The memory must outlive every kernel that uses it: wait for the last one before
        // `PinnedHostSlice` frees it (an error is kept by the context and reported by its
        // next check, as cudarc does for its own drops).
        if let Ok(Some(e)) = self.last_use.get_mut().map(|g| g.take()) {
            e.context().record_err(e.synchronize());
        }
    }
}
