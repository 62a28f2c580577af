//! Host byte buffers aligned to 64 bytes, so typed views (`&[f32]`, `&[bf16]`, …) of whole
//! buffers are always aligned.

use bytemuck::{Pod, Zeroable};

use crate::error::{Error, Result};

/// One cache line of storage (64 bytes, 64-byte aligned): the unit of every aligned
/// buffer of the backend (these host buffers, and the ops' working buffers,
/// [`super::scratch::Aligned`]).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
pub(crate) struct Line([u8; 64]);

/// A byte buffer in host memory, 64-byte aligned.
#[derive(Clone)]
pub struct CpuBuffer {
    lines: Vec<Line>,
    len: usize,
}

impl std::fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuBuffer({} bytes)", self.len)
    }
}

impl CpuBuffer {
    /// A zero-filled buffer of `len` bytes (from 2 MiB on, on huge pages where Linux
    /// allows: see `huge_pages`).
    pub fn zeroed(len: usize) -> Self {
        // Zero-filled by the allocator: a large one as fresh pages, untouched, so that the
        // huge-page advice still applies to all of them.
        let lines = bytemuck::allocation::zeroed_vec::<Line>(len.div_ceil(64));
        #[cfg(target_os = "linux")]
        huge_pages(bytemuck::cast_slice(&lines));
        CpuBuffer { lines, len }
    }
    /// A buffer holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut b = Self::zeroed(bytes.len());
        b.bytes_mut().copy_from_slice(bytes);
        b
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
    /// The bytes, mutable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..len]
    }
    /// A typed view; the length must be a multiple of `size_of::<T>()`.
    pub fn typed<T: Pod>(&self, what: &'static str) -> Result<&[T]> {
        bytemuck::try_cast_slice(self.bytes()).map_err(|_| misfit::<T>(what, self.len))
    }
    /// A typed mutable view; the length must be a multiple of `size_of::<T>()`.
    pub fn typed_mut<T: Pod>(&mut self, what: &'static str) -> Result<&mut [T]> {
        let len = self.len;
        bytemuck::try_cast_slice_mut(self.bytes_mut()).map_err(|_| misfit::<T>(what, len))
    }
}

/// Backs the 2 MiB-aligned interior of a fresh buffer with transparent huge pages where
/// the kernel allows: advised (`MADV_HUGEPAGE`, for the pages faulted in later) and, from
/// [`COLLAPSE_MIN`] bytes on (cache pools), collapsed at once (`MADV_COLLAPSE`, Linux 6.1+:
/// some kernels never fault huge pages in, and a collapse does not depend on the fault
/// path). A pool's scattered rows then miss no TLB entry each (the tiny model's attention
/// over a 38 MB pool: 5% of its time). Collapsing commits the interior's memory now
/// instead of at first write. Only advice: a refusal (no THP, an older kernel, no huge
/// page free) changes nothing else.
#[cfg(target_os = "linux")]
fn huge_pages(bytes: &[u8]) {
    const HUGE: usize = 2 << 20;
    // Linux's value on every architecture (`libc` names it only for glibc targets).
    const MADV_COLLAPSE: libc::c_int = 25;
    let start = (bytes.as_ptr() as usize).next_multiple_of(HUGE);
    let end = (bytes.as_ptr() as usize + bytes.len()) / HUGE * HUGE;
    if end > start {
        let (at, len) = (start as *mut libc::c_void, end - start);
        // SAFETY: `start..end` lies inside `bytes`, memory this process owns (a Vec's
        // allocation, zero-filled); both advices change how its pages are backed, never
        // their contents or the mapping, and their results are ignored (advice only).
        unsafe {
            libc::madvise(at, len, libc::MADV_HUGEPAGE);
            if bytes.len() >= COLLAPSE_MIN {
                libc::madvise(at, len, MADV_COLLAPSE);
            }
        }
    }
}

/// Bytes from which a fresh buffer's huge pages are collapsed at allocation: cache pools.
/// Smaller buffers (the engine's activations, a few MB allocated per forward call: the
/// eager zeroing cost its prefill 8%) keep the advice alone.
#[cfg(target_os = "linux")]
const COLLAPSE_MIN: usize = 16 << 20;

fn misfit<T>(what: &'static str, len: usize) -> Error {
    let size = std::mem::size_of::<T>();
    Error::BufferSize {
        what,
        expected: len.div_ceil(size) * size,
        actual: len,
    }
}

/// The buffer and stream methods of a [`crate::Backend`] that computes synchronously over
/// [`CpuBuffer`]s in host memory (`cpu`, `emu`; the type has a `stream: StreamKind`
/// field): device and host tiers are both plain host memory, both streams run in call
/// order, events are complete when recorded (the trait's defaults).
macro_rules! host_memory_methods {
    () => {
        fn upload(&self, bytes: &[u8]) -> $crate::Result<$crate::cpu::CpuBuffer> {
            Ok($crate::cpu::CpuBuffer::from_bytes(bytes))
        }

        fn alloc(&self, bytes: usize) -> $crate::Result<$crate::cpu::CpuBuffer> {
            Ok($crate::cpu::CpuBuffer::zeroed(bytes))
        }

        fn alloc_host(&self, bytes: usize) -> $crate::Result<$crate::cpu::CpuBuffer> {
            Ok($crate::cpu::CpuBuffer::zeroed(bytes))
        }

        fn download(&self, buf: &$crate::cpu::CpuBuffer) -> $crate::Result<Vec<u8>> {
            Ok(buf.bytes().to_vec())
        }

        fn buffer_len(&self, buf: &$crate::cpu::CpuBuffer) -> usize {
            buf.len()
        }

        fn on_stream(&self, stream: $crate::StreamKind) -> $crate::Result<Self> {
            let mut handle = self.clone();
            handle.stream = stream;
            Ok(handle)
        }

        fn stream(&self) -> $crate::StreamKind {
            self.stream
        }
    };
}
pub(crate) use host_memory_methods;

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers on either side of the huge-page sizes (none, advised, collapsed) are zero
    /// from their first byte to their last, 64-byte aligned, and keep what is written.
    #[test]
    fn fresh_buffers_of_every_size_are_zero_and_keep_writes() {
        for len in [0, 1, 63, 65, 3 << 20, (16 << 20) + 4097, 40 << 20] {
            let mut b = CpuBuffer::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.bytes().iter().all(|&x| x == 0), "{len}");
            assert_eq!(b.bytes().as_ptr() as usize % 64, 0);
            for (i, x) in b.bytes_mut().iter_mut().enumerate().step_by(4093) {
                *x = (i % 251) as u8 + 1;
            }
            let copy = CpuBuffer::from_bytes(b.bytes());
            assert_eq!(copy.bytes(), b.bytes());
        }
    }
}
