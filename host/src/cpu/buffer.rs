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
