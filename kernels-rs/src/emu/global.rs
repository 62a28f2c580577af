//! Global memory checks: every [`Simt::gld`](crate::Simt::gld) /
//! [`gst`](crate::Simt::gst) / [`atomic_add_u32`](crate::Simt::atomic_add_u32) of a
//! launch is checked against the buffers the launcher registered ([`GlobalBuffers`]),
//! as compute-sanitizer's memcheck and initcheck would:
//!
//! - **out of bounds**: the accessed bytes are not all inside one registered buffer;
//! - **misaligned**: the address is not a multiple of the access size (the GPU faults with
//!   "misaligned address"; checked in every launch, registered buffers or not);
//! - **store to a read-only buffer**: a store or atomic into a buffer registered
//!   [`BufferAccess::Read`];
//! - **uninitialised read**: a load of bytes of a [`BufferAccess::Write`] buffer (an
//!   output: its contents before the launch are not the kernel's input) that no thread of
//!   the launch has stored yet.
//!
//! The report names the kernel, block, thread, the buffer and the byte offset in it (or
//! the nearest buffer for an address outside all of them).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::EmuError;

/// How a launch uses one of its buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferAccess {
    /// Read only (inputs, metadata): a store is reported.
    Read,
    /// Written by the launch (outputs): a load of a byte the launch has not stored yet is
    /// an uninitialised read.
    Write,
    /// Read and written (in-place data, counters): every byte counts as initialised.
    ReadWrite,
}

/// One registered buffer.
#[derive(Debug, Clone)]
struct Region {
    name: String,
    start: usize,
    len: usize,
    access: BufferAccess,
}

/// The global buffers of one launch, by name, as the launcher knows them.
#[derive(Debug, Clone)]
pub struct GlobalBuffers {
    kernel: String,
    regions: Vec<Region>,
}

impl GlobalBuffers {
    /// No buffers yet, for a launch of `kernel` (the name used in reports).
    pub fn new(kernel: impl Into<String>) -> Self {
        GlobalBuffers {
            kernel: kernel.into(),
            regions: Vec::new(),
        }
    }

    /// The kernel's name.
    pub fn kernel(&self) -> &str {
        &self.kernel
    }

    /// Registers `len` bytes at address `start` as buffer `name`. Empty buffers are
    /// accepted (no access can hit them); two non-empty buffers may not overlap.
    pub fn add(
        &mut self,
        name: impl Into<String>,
        start: usize,
        len: usize,
        access: BufferAccess,
    ) -> Result<&mut Self, EmuError> {
        let name = name.into();
        let Some(end) = start.checked_add(len) else {
            return Err(EmuError::InvalidConfig {
                detail: format!("buffer `{name}` of {len} bytes at {start:#x} wraps around"),
            });
        };
        if len > 0 {
            if let Some(other) = self
                .regions
                .iter()
                .find(|r| r.len > 0 && r.start < end && start < r.start + r.len)
            {
                return Err(EmuError::InvalidConfig {
                    detail: format!(
                        "buffers `{name}` ({len} bytes at {start:#x}) and `{}` ({} bytes at \
                         {:#x}) overlap",
                        other.name, other.len, other.start
                    ),
                });
            }
        }
        self.regions.push(Region {
            name,
            start,
            len,
            access,
        });
        Ok(self)
    }

    /// Registers a host slice (the emulator's buffers are host memory).
    pub fn add_slice<T>(
        &mut self,
        name: impl Into<String>,
        slice: &[T],
        access: BufferAccess,
    ) -> Result<&mut Self, EmuError> {
        self.add(
            name,
            slice.as_ptr() as usize,
            std::mem::size_of_val(slice),
            access,
        )
    }
}

/// What a global access does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalOp {
    Load,
    Store,
    Atomic,
}

impl fmt::Display for GlobalOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GlobalOp::Load => "load",
            GlobalOp::Store => "store",
            GlobalOp::Atomic => "atomic",
        })
    }
}

/// Which check a global access failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalFault {
    /// Not inside one registered buffer.
    OutOfBounds,
    /// Address not a multiple of the access size.
    Misaligned,
    /// A store or atomic into a read-only buffer.
    ReadOnly,
    /// A load of output bytes the launch has not stored yet.
    Uninitialised,
}

impl fmt::Display for GlobalFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GlobalFault::OutOfBounds => "out-of-bounds",
            GlobalFault::Misaligned => "misaligned",
            GlobalFault::ReadOnly => "read-only-buffer",
            GlobalFault::Uninitialised => "uninitialised",
        })
    }
}

/// A failed global access: which kernel, thread, access and buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalAccessError {
    /// The kernel's name.
    pub kernel: String,
    /// `blockIdx.x`.
    pub block: u32,
    /// `threadIdx.x`.
    pub thread: u32,
    /// The check that failed.
    pub fault: GlobalFault,
    /// Load, store or atomic.
    pub op: GlobalOp,
    /// Address of the access.
    pub addr: usize,
    /// Bytes accessed.
    pub size: usize,
    /// The buffer hit (or the nearest one, for an address outside every buffer), with its
    /// length in bytes; `None` when the launch registered no buffers.
    pub buffer: Option<(String, usize)>,
    /// Byte offset of the access from that buffer's start (negative: before it).
    pub offset: i128,
}

impl fmt::Display for GlobalAccessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "kernel {}, block {}, thread {}: {} {}-byte global {} at {:#x}",
            self.kernel, self.block, self.thread, self.fault, self.size, self.op, self.addr
        )?;
        let Some((name, len)) = &self.buffer else {
            return write!(f, " (the launch registered no buffers)");
        };
        let off = self.offset;
        let end = off + self.size as i128;
        match self.fault {
            GlobalFault::OutOfBounds if off < 0 => {
                write!(f, ": {} byte(s) before buffer `{name}` ({len} bytes)", -off)
            }
            GlobalFault::OutOfBounds if off >= *len as i128 => write!(
                f,
                ": byte offset {off} of buffer `{name}` ({len} bytes), {} byte(s) past its end",
                off - *len as i128
            ),
            GlobalFault::OutOfBounds => write!(
                f,
                ": byte offset {off} of buffer `{name}` ({len} bytes), reaching {} byte(s) past \
                 its end",
                end - *len as i128
            ),
            GlobalFault::Misaligned => write!(
                f,
                ": byte offset {off} of buffer `{name}` ({len} bytes) is not a multiple of {} \
                 (\"misaligned address\" on a GPU)",
                self.size
            ),
            GlobalFault::ReadOnly => write!(
                f,
                ": byte offset {off} of buffer `{name}` ({len} bytes), which the launch only \
                 reads"
            ),
            GlobalFault::Uninitialised => write!(
                f,
                ": byte offset {off} of output buffer `{name}` ({len} bytes), not yet written \
                 by this launch"
            ),
        }
    }
}

/// The registered buffers of a running launch, with the written-bytes maps of its outputs.
#[derive(Debug)]
pub(crate) struct GlobalCheck {
    kernel: String,
    /// Sorted by start; non-empty only.
    regions: Vec<Region>,
    /// Per region: one bit per byte, set once stored (only for [`BufferAccess::Write`]).
    written: Vec<Option<Box<[AtomicU64]>>>,
}

/// A fault before the thread and block are filled in.
#[derive(Debug)]
pub(crate) struct Fault {
    fault: GlobalFault,
    region: Option<usize>,
}

impl GlobalCheck {
    /// The check of a launch of `buffers`.
    pub(crate) fn new(buffers: &GlobalBuffers) -> Self {
        let mut regions: Vec<Region> = buffers
            .regions
            .iter()
            .filter(|r| r.len > 0)
            .cloned()
            .collect();
        regions.sort_by_key(|r| r.start);
        let written = regions
            .iter()
            .map(|r| {
                (r.access == BufferAccess::Write)
                    .then(|| (0..r.len.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
            })
            .collect();
        GlobalCheck {
            kernel: buffers.kernel.clone(),
            regions,
            written,
        }
    }

    /// An unchecked launch (no registered buffers; only alignment is checked).
    pub(crate) fn unregistered() -> Self {
        GlobalCheck {
            kernel: "kernel".to_string(),
            regions: Vec::new(),
            written: Vec::new(),
        }
    }

    /// Whether buffers were registered (bounds and init are checked).
    fn checks_bounds(&self) -> bool {
        !self.regions.is_empty()
    }

    /// The region whose start is the largest `<= addr`, if any.
    fn region_at(&self, addr: usize) -> Option<usize> {
        let i = self.regions.partition_point(|r| r.start <= addr);
        i.checked_sub(1)
    }

    /// The region nearest to `addr` (for reporting an access outside every buffer).
    fn nearest(&self, addr: usize) -> Option<usize> {
        let dist = |r: &Region| {
            if addr < r.start {
                r.start - addr
            } else {
                addr.saturating_sub(r.start + r.len)
            }
        };
        (0..self.regions.len()).min_by_key(|&i| dist(&self.regions[i]))
    }

    /// Checks an access of `size` bytes at `addr`; records the written bytes of a store.
    pub(crate) fn access(&self, op: GlobalOp, addr: usize, size: usize) -> Result<(), Fault> {
        let misaligned = addr % size != 0;
        if !self.checks_bounds() {
            return if misaligned {
                Err(Fault {
                    fault: GlobalFault::Misaligned,
                    region: None,
                })
            } else {
                Ok(())
            };
        }
        let inside = self
            .region_at(addr)
            .filter(|&i| {
                let r = &self.regions[i];
                addr.checked_add(size)
                    .is_some_and(|end| end <= r.start + r.len)
            })
            .ok_or_else(|| Fault {
                fault: GlobalFault::OutOfBounds,
                region: self
                    .region_at(addr)
                    .filter(|&i| addr < self.regions[i].start + self.regions[i].len)
                    .or_else(|| self.nearest(addr)),
            })?;
        let fault = |fault| Fault {
            fault,
            region: Some(inside),
        };
        if misaligned {
            return Err(fault(GlobalFault::Misaligned));
        }
        let r = &self.regions[inside];
        if op != GlobalOp::Load && r.access == BufferAccess::Read {
            return Err(fault(GlobalFault::ReadOnly));
        }
        if let Some(bits) = &self.written[inside] {
            let off = addr - r.start;
            if op == GlobalOp::Store {
                set_bits(bits, off, size);
            } else if !all_set(bits, off, size) {
                return Err(fault(GlobalFault::Uninitialised));
            }
        }
        Ok(())
    }

    /// The report of `fault` for an access by `thread` of `block`.
    pub(crate) fn error(
        &self,
        f: Fault,
        (block, thread): (u32, u32),
        op: GlobalOp,
        addr: usize,
        size: usize,
    ) -> EmuError {
        let (buffer, offset) = match f.region {
            Some(i) => {
                let r = &self.regions[i];
                (
                    Some((r.name.clone(), r.len)),
                    addr as i128 - r.start as i128,
                )
            }
            None => (None, 0),
        };
        EmuError::GlobalMemory(Box::new(GlobalAccessError {
            kernel: self.kernel.clone(),
            block,
            thread,
            fault: f.fault,
            op,
            addr,
            size,
            buffer,
            offset,
        }))
    }
}

/// Sets bits `off .. off + size` (`size <= 64`).
fn set_bits(bits: &[AtomicU64], off: usize, size: usize) {
    for (w, m) in masks(off, size) {
        bits[w].fetch_or(m, Ordering::Relaxed);
    }
}

/// Whether bits `off .. off + size` are all set.
fn all_set(bits: &[AtomicU64], off: usize, size: usize) -> bool {
    masks(off, size).all(|(w, m)| bits[w].load(Ordering::Relaxed) & m == m)
}

/// The (word, mask) pairs covering bits `off .. off + size` (at most two words for
/// `size <= 64`).
fn masks(off: usize, size: usize) -> impl Iterator<Item = (usize, u64)> {
    let end = off + size;
    let (w0, w1) = (off / 64, (end - 1) / 64);
    (w0..=w1).map(move |w| {
        let lo = if w == w0 { off % 64 } else { 0 };
        let hi = if w == w1 { (end - 1) % 64 } else { 63 };
        let m = if hi - lo == 63 {
            u64::MAX
        } else {
            ((1u64 << (hi - lo + 1)) - 1) << lo
        };
        (w, m)
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic
mod tests {
    use super::*;

    #[test]
    fn masks_cover_exactly() {
        for off in 0..130 {
            for size in 1..=16 {
                let bits: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
                set_bits(&bits, off, size);
                let total: u32 = bits
                    .iter()
                    .map(|b| b.load(Ordering::Relaxed).count_ones())
                    .sum();
                assert_eq!(total as usize, size);
                assert!(all_set(&bits, off, size));
                assert!(!all_set(&bits, off + size, 1), "the byte after is unset");
                if off > 0 {
                    assert!(!all_set(&bits, off - 1, 1), "the byte before is unset");
                }
            }
        }
    }

    #[test]
    fn regions_are_found_and_reported() {
        let mut b = GlobalBuffers::new("k");
        b.add("a", 1000, 100, BufferAccess::Read).unwrap();
        b.add("b", 2000, 64, BufferAccess::Write).unwrap();
        b.add("empty", 1000, 0, BufferAccess::Read).unwrap();
        assert!(b.add("c", 1050, 10, BufferAccess::Read).is_err(), "overlap");
        let c = GlobalCheck::new(&b);
        assert!(c.access(GlobalOp::Load, 1000, 4).is_ok());
        assert!(c.access(GlobalOp::Load, 1096, 4).is_ok());
        let f = c.access(GlobalOp::Load, 1098, 4).err().unwrap();
        assert_eq!((f.fault, f.region), (GlobalFault::OutOfBounds, Some(0)));
        let f = c.access(GlobalOp::Load, 1500, 4).err().unwrap();
        assert_eq!(f.fault, GlobalFault::OutOfBounds);
        let f = c.access(GlobalOp::Load, 1002, 4).err().unwrap();
        assert_eq!(f.fault, GlobalFault::Misaligned);
        let f = c.access(GlobalOp::Store, 1000, 4).err().unwrap();
        assert_eq!(f.fault, GlobalFault::ReadOnly);
        let f = c.access(GlobalOp::Load, 2000, 8).err().unwrap();
        assert_eq!(f.fault, GlobalFault::Uninitialised);
        c.access(GlobalOp::Store, 2000, 4).unwrap();
        assert!(c.access(GlobalOp::Load, 2000, 4).is_ok());
        assert!(c.access(GlobalOp::Load, 2000, 8).is_err());
        let e = c.error(
            c.access(GlobalOp::Load, 2064, 4).err().unwrap(),
            (1, 2),
            GlobalOp::Load,
            2064,
            4,
        );
        let msg = e.to_string();
        assert!(msg.contains("kernel k, block 1, thread 2"), "{msg}");
        assert!(
            msg.contains("`b` (64 bytes), 0 byte(s) past its end"),
            "{msg}"
        );
    }
}
