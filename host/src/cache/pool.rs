//! Device and host page pools, built from layout descriptors only.
//!
//! A page id names the same token slots in every layer and in both buffer kinds (KV and
//! index-K), so one allocator serves a whole pool. The [`HostPool`] mirror is constructed
//! *from the device pool* ([`HostPool::mirror`]): it takes the device's descriptors and
//! has no dtype or size arguments of its own, so a host tier whose rows differ from the
//! device's cannot be expressed (outside the `host-pool-fp8-layout` fault injection).

use std::time::Instant;

use serde::Serialize;

use super::faults::{Fault, Faults};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::layout::{IndexKDtype, IndexKLayout, KvLayout, PageLayout};
use crate::ops::PagedRegion;
use crate::sync::{AtomicU32, Mutex, MutexGuard, Ordering};

/// The two buffers every layer has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferKind {
    Kv,
    IndexK,
}

impl BufferKind {
    pub const ALL: [BufferKind; 2] = [BufferKind::Kv, BufferKind::IndexK];

    pub fn name(&self) -> &'static str {
        match self {
            BufferKind::Kv => "kv",
            BufferKind::IndexK => "index_k",
        }
    }
}

/// What every layer of a cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSpec {
    pub kv: KvLayout,
    pub index_k: IndexKLayout,
    pub num_layers: usize,
}

impl CacheSpec {
    /// Checks that both layouts share one page size and there is at least one layer.
    pub fn new(kv: KvLayout, index_k: IndexKLayout, num_layers: usize) -> Result<Self> {
        if kv.page_size() != index_k.page_size() {
            return Err(Error::InvalidLayout(format!(
                "KV page size {} differs from index-K page size {}",
                kv.page_size(),
                index_k.page_size()
            )));
        }
        if num_layers == 0 {
            return Err(Error::InvalidLayout(
                "a cache needs at least one layer".into(),
            ));
        }
        Ok(CacheSpec {
            kv,
            index_k,
            num_layers,
        })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.kv.page_size()
    }

    /// The descriptor of one buffer kind.
    pub fn layout(&self, kind: BufferKind) -> PageLayout {
        match kind {
            BufferKind::Kv => self.kv.into(),
            BufferKind::IndexK => self.index_k.into(),
        }
    }

    /// Bytes of one page of every layer and both kinds.
    pub fn bytes_per_page_all_layers(&self) -> usize {
        (self.kv.bytes_per_page() + self.index_k.bytes_per_page()) * self.num_layers
    }
}

/// The buffers of one layer. Reachable only inside the cache: readers get them through a
/// [`super::LayerGuard`], writers are the io worker and inbound transfers.
#[derive(Debug)]
pub(crate) struct LayerBuffers<B: Backend> {
    pub(crate) kv: B::Buffer,
    pub(crate) index_k: B::Buffer,
}

impl<B: Backend> LayerBuffers<B> {
    pub(crate) fn get(&self, kind: BufferKind) -> &B::Buffer {
        match kind {
            BufferKind::Kv => &self.kv,
            BufferKind::IndexK => &self.index_k,
        }
    }
    pub(crate) fn get_mut(&mut self, kind: BufferKind) -> &mut B::Buffer {
        match kind {
            BufferKind::Kv => &mut self.kv,
            BufferKind::IndexK => &mut self.index_k,
        }
    }
}

/// The device tier: per layer, a KV and an index-K buffer of `num_pages` pages each, behind
/// **one** mutex per layer (a guard over both kinds: no second lock of the same layer is
/// ever needed, so there is no lock-order hazard between a reader and the io worker), plus
/// a landed stamp per (layer, page): the generation (+1) of the page allocation whose bytes
/// were last written into that layer (0: none).
#[derive(Debug)]
pub(crate) struct DevicePool<B: Backend> {
    spec: CacheSpec,
    num_pages: usize,
    layers: Vec<Mutex<LayerBuffers<B>>>,
    stamps: Vec<AtomicU32>,
}

impl<B: Backend> DevicePool<B> {
    /// Allocates the pool on `backend`.
    pub fn new(backend: &B, spec: CacheSpec, num_pages: usize) -> Result<Self> {
        let layers = (0..spec.num_layers)
            .map(|_| {
                Ok(Mutex::new(LayerBuffers {
                    kv: backend.alloc(spec.kv.buffer_bytes(num_pages))?,
                    index_k: backend.alloc(spec.index_k.buffer_bytes(num_pages))?,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DevicePool {
            spec,
            num_pages,
            layers,
            stamps: (0..spec.num_layers * num_pages)
                .map(|_| AtomicU32::new(0))
                .collect(),
        })
    }

    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Where pages of `kind` sit in a layer's buffer (contiguous).
    pub fn region(&self, kind: BufferKind) -> PagedRegion {
        PagedRegion::contiguous(self.spec.layout(kind), self.num_pages)
    }

    /// Exclusive access to layer `l`, waiting at most until `deadline`.
    pub fn lock(&self, l: usize, deadline: Instant) -> Result<MutexGuard<'_, LayerBuffers<B>>> {
        let m = self.layers.get(l).ok_or_else(|| Error::InvalidArgument {
            what: "layer",
            detail: format!("{l} of {}", self.layers.len()),
        })?;
        let start = Instant::now();
        m.try_lock_until(deadline).ok_or(Error::Timeout {
            what: "a device layer lock",
            after: start.elapsed(),
        })
    }

    fn stamp_slot(&self, layer: usize, page: u32) -> Option<&AtomicU32> {
        if (page as usize) < self.num_pages {
            self.stamps.get(layer * self.num_pages + page as usize)
        } else {
            None
        }
    }

    /// Records that `page`'s bytes of `layer` were written for `generation`. Call with the
    /// layer's lock held, after the bytes.
    pub fn set_stamp(&self, layer: usize, page: u32, generation: u32) {
        if let Some(s) = self.stamp_slot(layer, page) {
            s.store(generation.wrapping_add(1).max(1), Ordering::Release);
        }
    }

    /// Marks `page` of every layer as written for `generation` (a fresh page its owner
    /// will fill by its own stores) or, with `None`, as not landed (a copy will fill it).
    pub fn stamp_all_layers(&self, page: u32, generation: Option<u32>) {
        for l in 0..self.spec.num_layers {
            match generation {
                Some(g) => self.set_stamp(l, page, g),
                None => {
                    if let Some(s) = self.stamp_slot(l, page) {
                        s.store(0, Ordering::Release);
                    }
                }
            }
        }
    }

    /// The generation `page`'s bytes of `layer` were last written for.
    pub fn stamp(&self, layer: usize, page: u32) -> Option<u32> {
        match self.stamp_slot(layer, page)?.load(Ordering::Acquire) {
            0 => None,
            v => Some(v.wrapping_sub(1)),
        }
    }
}

/// Order of the host tier's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostLayout {
    /// Per layer: all KV pages, then all index-K pages (like the device).
    LayerFirst,
    /// Per page: every layer's KV page then its index-K page, contiguous (one transfer
    /// per page moves all layers).
    PageFirst,
}

/// The host tier: one host buffer (page-locked on cuda) holding `num_pages` pages of every
/// layer and kind, in [`HostLayout`] order. Only the io worker touches its bytes.
#[derive(Debug)]
pub(crate) struct HostPool<B: Backend> {
    spec: CacheSpec,
    layout: HostLayout,
    num_pages: usize,
    buffer: Mutex<B::Buffer>,
}

impl<B: Backend> HostPool<B> {
    /// A host mirror of `device` with `num_pages` pages, laid out as `layout`. Its
    /// descriptors are the device pool's (under the `host-pool-fp8-layout` fault, index-K
    /// rows are sized with the fp8 layout whatever the device dtype: the historical bug).
    pub fn mirror(
        backend: &B,
        device: &DevicePool<B>,
        num_pages: usize,
        layout: HostLayout,
        faults: &Faults,
    ) -> Result<Self> {
        let mut spec = *device.spec();
        if faults.active(Fault::HostPoolFp8Layout) {
            spec.index_k = IndexKLayout::new(
                IndexKDtype::FP8,
                spec.index_k.head_dim(),
                spec.index_k.page_size(),
            )?;
        }
        let buffer = backend.alloc_host(spec.bytes_per_page_all_layers() * num_pages)?;
        Ok(HostPool {
            spec,
            layout,
            num_pages,
            buffer: Mutex::new(buffer),
        })
    }

    #[cfg(test)]
    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }

    /// Where pages of layer `layer`, kind `kind` sit in the host buffer.
    pub fn region(&self, layer: usize, kind: BufferKind) -> PagedRegion {
        let (kv, ik) = (
            self.spec.kv.bytes_per_page(),
            self.spec.index_k.bytes_per_page(),
        );
        let page_layout = self.spec.layout(kind);
        match self.layout {
            HostLayout::LayerFirst => {
                let per_layer = (kv + ik) * self.num_pages;
                let kind_off = match kind {
                    BufferKind::Kv => 0,
                    BufferKind::IndexK => kv * self.num_pages,
                };
                PagedRegion {
                    layout: page_layout,
                    offset: layer * per_layer + kind_off,
                    stride: page_layout.bytes_per_page(),
                    num_pages: self.num_pages,
                }
            }
            HostLayout::PageFirst => {
                let kind_off = match kind {
                    BufferKind::Kv => 0,
                    BufferKind::IndexK => kv,
                };
                PagedRegion {
                    layout: page_layout,
                    offset: layer * (kv + ik) + kind_off,
                    stride: (kv + ik) * self.spec.num_layers,
                    num_pages: self.num_pages,
                }
            }
        }
    }

    /// The host buffer (the io worker's copies).
    pub fn buffer(&self) -> MutexGuard<'_, B::Buffer> {
        self.buffer.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBackend;
    use crate::layout::KvDtype;

    fn spec(dt: IndexKDtype) -> CacheSpec {
        CacheSpec::new(
            KvLayout::new(KvDtype::Fp8DsMla, 128, 32, 16).unwrap(),
            IndexKLayout::new(dt, 64, 16).unwrap(),
            3,
        )
        .unwrap()
    }

    #[test]
    fn host_regions_tile_the_buffer_without_overlap() {
        let b = CpuBackend::new();
        let dev = DevicePool::new(&b, spec(IndexKDtype::Bf16), 5).unwrap();
        for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
            let host = HostPool::mirror(&b, &dev, 7, layout, &Faults::none()).unwrap();
            assert_eq!(
                host.spec(),
                dev.spec(),
                "the mirror takes the device's descriptors"
            );
            let len = b.buffer_len(&host.buffer());
            let mut owner = vec![None; len];
            for l in 0..3 {
                for k in BufferKind::ALL {
                    let r = host.region(l, k);
                    r.check("host", len).unwrap();
                    assert_eq!(r.layout, dev.spec().layout(k));
                    for p in 0..7 {
                        for byte in r.page_range(p) {
                            assert!(owner[byte].is_none(), "{layout:?}: overlap at {byte}");
                            owner[byte] = Some((l, k, p));
                        }
                    }
                }
            }
            assert!(
                owner.iter().all(|o| o.is_some()),
                "{layout:?}: every byte used once"
            );
        }
    }

    #[test]
    fn fp8_layout_fault_mismatches_the_device() {
        let b = CpuBackend::new();
        let dev = DevicePool::new(&b, spec(IndexKDtype::Bf16), 2).unwrap();
        let f = Faults::with(&[Fault::HostPoolFp8Layout]);
        let host = HostPool::mirror(&b, &dev, 2, HostLayout::LayerFirst, &f).unwrap();
        assert_ne!(
            host.region(0, BufferKind::IndexK).layout.fingerprint(),
            dev.region(BufferKind::IndexK).layout.fingerprint()
        );
        assert_eq!(host.spec().index_k.bytes_per_token(), 68);
        assert!(CacheSpec::new(
            KvLayout::new(KvDtype::Bf16, 128, 32, 16).unwrap(),
            IndexKLayout::new(IndexKDtype::Bf16, 64, 32).unwrap(),
            1
        )
        .is_err());
    }
}
