//! Host byte buffers aligned to 64 bytes, so typed views (`&[f32]`, `&[bf16]`, …) of whole
//! buffers are always aligned.

use bytemuck::{Pod, Zeroable};

use crate::error::{Error, Result};

#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([u8; 64]);

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
    /// A zero-filled buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        CpuBuffer {
            lines: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
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
