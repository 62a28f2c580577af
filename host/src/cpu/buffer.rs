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
    /// allows: see `HugeRange`).
    pub fn zeroed(len: usize) -> Self {
        Self::zeroed_collapsing_from(len, COLLAPSE_MIN)
    }

    /// [`CpuBuffer::zeroed`], its huge pages collapsed from `collapse_min` bytes on.
    fn zeroed_collapsing_from(len: usize, collapse_min: usize) -> Self {
        let n = len.div_ceil(64);
        let mut lines = Vec::<Line>::with_capacity(n);
        // The advice first, then the zeros: the allocator's own zeroing of an over-aligned
        // allocation (Rust's `alloc_zeroed` at 64 bytes is `alloc` and a fill) would fault
        // every page in before the advice, on 4 KiB pages, and Linux applies
        // `MADV_HUGEPAGE` only to pages faulted in after it.
        #[cfg(target_os = "linux")]
        let huge = HugeRange::of(lines.as_ptr().cast(), n * 64);
        #[cfg(target_os = "linux")]
        huge.advise();
        // SAFETY: the capacity holds `n` lines; every byte is written before `set_len`
        // makes them readable, and an all-zero `Line` is valid (`Pod`).
        unsafe {
            std::ptr::write_bytes(lines.as_mut_ptr(), 0, n);
            lines.set_len(n);
        }
        #[cfg(target_os = "linux")]
        if n * 64 >= collapse_min {
            huge.collapse();
        }
        #[cfg(not(target_os = "linux"))]
        let _ = collapse_min;
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

/// The 2 MiB-aligned interior of a fresh buffer, to be backed with transparent huge pages
/// where the kernel allows: advised (`MADV_HUGEPAGE`) before the buffer's first write, so
/// that its pages fault in huge, and from [`COLLAPSE_MIN`] bytes on (cache pools) also
/// collapsed once written (`MADV_COLLAPSE`, Linux 6.1+: some kernels never fault huge pages
/// in, and a collapse does not depend on the fault path). A pool's scattered rows then
/// miss no TLB entry each (the tiny model's attention over a 38 MB pool: 5% of its time).
/// Only advice: a refusal (no THP, an older kernel, no huge page free) changes nothing
/// else.
#[cfg(target_os = "linux")]
struct HugeRange {
    start: usize,
    end: usize,
}

#[cfg(target_os = "linux")]
impl HugeRange {
    /// The whole 2 MiB pages inside the `len` bytes at `at`.
    fn of(at: *const u8, len: usize) -> Self {
        const HUGE: usize = 2 << 20;
        HugeRange {
            start: (at as usize).next_multiple_of(HUGE),
            end: (at as usize + len) / HUGE * HUGE,
        }
    }

    fn advise(&self) {
        self.madvise(libc::MADV_HUGEPAGE);
    }

    fn collapse(&self) {
        // Linux's value on every architecture (`libc` names it only for glibc targets).
        const MADV_COLLAPSE: libc::c_int = 25;
        self.madvise(MADV_COLLAPSE);
    }

    fn madvise(&self, advice: libc::c_int) {
        if self.end > self.start {
            // SAFETY: `start..end` lies inside an allocation this process owns (a fresh
            // buffer's); these advices change how its pages are backed, never their
            // contents or the mapping, and their results are ignored (advice only).
            unsafe {
                libc::madvise(
                    self.start as *mut libc::c_void,
                    self.end - self.start,
                    advice,
                );
            }
        }
    }
}

/// Bytes from which a fresh buffer's huge pages are collapsed at allocation: cache pools.
/// Smaller buffers (the engine's activations, a few MB allocated per forward call: the
/// eager zeroing cost its prefill 8%) keep the advice alone.
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

    /// KiB of `/proc/self/smaps`' `AnonHugePages` in the mappings that overlap `range`.
    #[cfg(target_os = "linux")]
    fn huge_kib(range: std::ops::Range<usize>) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let mut overlaps = false;
        let mut kib = 0;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = head.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    overlaps = a < range.end && range.start < b;
                    continue;
                }
            }
            if let Some(v) = line.strip_prefix("AnonHugePages:") {
                if overlaps {
                    kib += v
                        .trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .unwrap_or(0);
                }
            }
        }
        kib
    }

    /// A fresh buffer's pages fault in huge wherever Linux faults huge pages in for memory
    /// advised before its first write (a fresh mapping, advised and then written, is the
    /// control): the advice must come before the zeroing. Collapsing is off here, and the
    /// buffer is larger than glibc's largest mmap threshold (32 MiB), so it is a fresh
    /// mapping and not recycled heap memory.
    #[cfg(target_os = "linux")]
    #[test]
    fn fresh_buffers_fault_in_on_huge_pages_where_linux_does() {
        const LEN: usize = 36 << 20;
        // SAFETY: a new private anonymous mapping, written only inside its bounds, and
        // unmapped at the end.
        let control = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED, "mmap");
            let range = HugeRange::of(p.cast(), LEN);
            range.advise();
            std::ptr::write_bytes(p.cast::<u8>(), 1, LEN);
            let kib = huge_kib(range.start..range.end);
            libc::munmap(p, LEN);
            kib
        };
        let b = CpuBuffer::zeroed_collapsing_from(LEN, usize::MAX);
        let range = HugeRange::of(b.bytes().as_ptr(), LEN);
        let kib = huge_kib(range.start..range.end);
        if control == 0 {
            eprintln!("this kernel faults no huge page in for advised memory; checked: {kib} KiB");
            return;
        }
        // Most of the interior (the control's share, less a few pages Linux may refuse).
        assert!(
            kib * 2 >= control,
            "{kib} KiB of huge pages in a fresh buffer, {control} KiB in the control"
        );
    }
}
