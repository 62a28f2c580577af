//! The landing zone: the memory prefill writes a transfer's pages into on the decode side.
//!
//! It mirrors the decode cache's device pool page for page (page `i` of a layer and kind
//! here is destined for device page `i`), so the quarantine of a device page also guards
//! its landing slot. Its geometry ([`LandingGeometry`]) is derived from the cache's layout
//! descriptors only: layer-major, per layer all KV pages then all index-K pages, each
//! kind's pages back to back (`PagedRegion`s). Both sides compute it from the same
//! descriptors (their fingerprints are checked at connection and per transfer) and the
//! decode side's page count.
//!
//! Bytes that land here are not readable by anyone: the receiver copies a layer's pages
//! into the cache only through `Inbound::write`, which checks generations and the
//! sender's checksums first. A write that lands late (an aborted transfer) can at worst
//! overwrite bytes not yet verified, which the checksums then refuse.
//!
//! The memory is one allocation at a stable address so that a transport can register it
//! (NIXL writes into it from another process). It is therefore only ever accessed through
//! raw-pointer copies, never through references: remote writes may change it at any time.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use parking_lot::Mutex;
use sparsekit_host::cache::{BufferKind, CacheSpec};
use sparsekit_host::ops::PagedRegion;

use crate::pd::error::PdError;
use crate::transfer::TransferError;

/// Alignment of the landing zone's allocation (bytes).
const ALIGN: usize = 4096;

/// Where each layer's pages of each kind sit in a landing zone (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LandingGeometry {
    spec: CacheSpec,
    num_pages: usize,
}

impl LandingGeometry {
    /// The geometry of `num_pages` pages of every layer and kind of `spec`.
    pub fn new(spec: CacheSpec, num_pages: usize) -> Result<Self, PdError> {
        if num_pages == 0 || num_pages > u32::MAX as usize {
            return Err(PdError::Invalid(format!(
                "a landing zone of {num_pages} pages"
            )));
        }
        spec.bytes_per_page_all_layers()
            .checked_mul(num_pages)
            .ok_or_else(|| PdError::Invalid("landing zone size overflows".into()))?;
        Ok(LandingGeometry { spec, num_pages })
    }

    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }

    /// Pages of every layer and kind.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Bytes of `layer`'s pages of every kind it holds.
    fn layer_bytes(&self, layer: usize) -> usize {
        self.spec
            .kinds(layer)
            .map(|k| self.spec.layout(k).bytes_per_page() * self.num_pages)
            .sum()
    }

    /// Where the pages of `layer`/`kind` sit (bytes from the start of the zone): layer
    /// after layer, each layer's kinds in order (a kind the layer does not hold: an empty
    /// region).
    pub fn region(&self, layer: usize, kind: BufferKind) -> PagedRegion {
        let base: usize = (0..layer.min(self.spec.num_layers))
            .map(|l| self.layer_bytes(l))
            .sum();
        let within: usize = self
            .spec
            .kinds(layer)
            .take_while(|k| *k != kind)
            .map(|k| self.spec.layout(k).bytes_per_page() * self.num_pages)
            .sum();
        let pages = if self.spec.has(layer, kind) {
            self.num_pages
        } else {
            0
        };
        PagedRegion {
            offset: base + within,
            ..PagedRegion::contiguous(self.spec.layout(kind), pages)
        }
    }

    /// Total bytes.
    pub fn total_bytes(&self) -> usize {
        (0..self.spec.num_layers).map(|l| self.layer_bytes(l)).sum()
    }
}

/// The landing zone's memory (see the module docs).
#[derive(Debug)]
pub struct LandingZone {
    geometry: LandingGeometry,
    ptr: NonNull<u8>,
    len: usize,
    /// Serialises this process's own accesses (local writers and the receiver's reads);
    /// remote writers do not take it.
    lock: Mutex<()>,
}

// SAFETY: the zone owns its allocation; every access goes through raw-pointer copies made
// under `lock` (or by a remote writer that the transport registered), never through
// references, so sharing the handle across threads cannot create aliasing references.
unsafe impl Send for LandingZone {}
// SAFETY: as above.
unsafe impl Sync for LandingZone {}

impl LandingZone {
    /// Allocates a zeroed zone of `geometry`'s size.
    pub fn new(geometry: LandingGeometry) -> Result<Self, PdError> {
        let len = geometry.total_bytes().max(1);
        let layout = Layout::from_size_align(len, ALIGN)
            .map_err(|e| PdError::Invalid(format!("landing zone of {len} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            PdError::Invalid(format!("cannot allocate a landing zone of {len} bytes"))
        })?;
        Ok(LandingZone {
            geometry,
            ptr,
            len,
            lock: Mutex::new(()),
        })
    }

    pub fn geometry(&self) -> &LandingGeometry {
        &self.geometry
    }

    /// Bytes of the zone.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a zone holds at least one page).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Address and length of the memory, for a transport to register. Writing through it
    /// is the caller's (unsafe) business; the bytes are only ever read by copy.
    pub fn raw_parts(&self) -> (usize, usize) {
        (self.ptr.as_ptr() as usize, self.len)
    }

    /// Copies `bytes` to `offset` (the in-process transport's one-sided write). Refused
    /// when it does not fit.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), TransferError> {
        let end = offset
            .checked_add(bytes.len())
            .filter(|&e| e <= self.len)
            .ok_or(TransferError::OutOfBounds {
                offset,
                len: bytes.len(),
                zone: self.len,
            })?;
        let _g = self.lock.lock();
        debug_assert!(end <= self.len);
        // SAFETY: `offset..end` lies inside the allocation (checked above); the source is a
        // distinct Rust slice, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(offset),
                bytes.len(),
            )
        };
        Ok(())
    }

    /// The bytes of pages `ids` of `layer`/`kind`, back to back in that order.
    pub fn read_pages(
        &self,
        layer: usize,
        kind: BufferKind,
        ids: &[u32],
    ) -> Result<Vec<u8>, PdError> {
        if layer >= self.geometry.spec.num_layers {
            return Err(PdError::Invalid(format!(
                "layer {layer} of {}",
                self.geometry.spec.num_layers
            )));
        }
        let region = self.geometry.region(layer, kind);
        let page = region.layout.bytes_per_page();
        let mut out = vec![0u8; page * ids.len()];
        let _g = self.lock.lock();
        for (i, &id) in ids.iter().enumerate() {
            if id as usize >= self.geometry.num_pages {
                return Err(PdError::Invalid(format!(
                    "page {id} of a {}-page landing zone",
                    self.geometry.num_pages
                )));
            }
            let r = region.page_range(id as usize);
            debug_assert!(r.end <= self.len);
            // SAFETY: `r` lies inside the allocation (the geometry's regions tile it and
            // `id` is in range); `out` is a distinct allocation of the right length.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr.as_ptr().add(r.start),
                    out[i * page..].as_mut_ptr(),
                    page,
                )
            };
        }
        Ok(out)
    }
}

impl Drop for LandingZone {
    fn drop(&mut self) {
        if let Ok(layout) = Layout::from_size_align(self.len, ALIGN) {
            // SAFETY: allocated in `new` with this very layout; dropped once.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparsekit_host::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};

    fn spec() -> CacheSpec {
        CacheSpec::new(
            KvLayout::new(KvDtype::Bf16, 32, 16, 4).unwrap_or_else(|e| panic!("{e}")),
            IndexKLayout::new(IndexKDtype::Bf16, 16, 4).unwrap_or_else(|e| panic!("{e}")),
            3,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The regions tile the zone exactly: no gap, no overlap, every page inside.
    #[test]
    fn regions_tile_the_zone() {
        let g = LandingGeometry::new(spec(), 5).unwrap_or_else(|e| panic!("{e}"));
        let mut ranges = Vec::new();
        for l in 0..3 {
            for k in g.spec().kinds(l) {
                let r = g.region(l, k);
                for p in 0..5 {
                    ranges.push(r.page_range(p));
                }
            }
        }
        ranges.sort_by_key(|r| r.start);
        let mut at = 0;
        for r in ranges {
            assert_eq!(r.start, at);
            at = r.end;
        }
        assert_eq!(at, g.total_bytes());
        assert!(LandingGeometry::new(spec(), 0).is_err());
    }

    #[test]
    fn writes_are_bounds_checked_and_read_back() {
        let g = LandingGeometry::new(spec(), 2).unwrap_or_else(|e| panic!("{e}"));
        let z = LandingZone::new(g).unwrap_or_else(|e| panic!("{e}"));
        let r = g.region(2, BufferKind::IndexK);
        let page = r.layout.bytes_per_page();
        let bytes: Vec<u8> = (0..page).map(|i| i as u8 ^ 0x5a).collect();
        z.write(r.page_range(1).start, &bytes)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            z.read_pages(2, BufferKind::IndexK, &[1])
                .unwrap_or_else(|e| panic!("{e}")),
            bytes
        );
        assert!(z.read_pages(2, BufferKind::IndexK, &[2]).is_err());
        assert!(z.read_pages(3, BufferKind::Kv, &[0]).is_err());
        assert!(matches!(
            z.write(z.len() - 1, &[0, 0]),
            Err(TransferError::OutOfBounds { .. })
        ));
        assert!(z.write(usize::MAX, &[0]).is_err());
    }
}
