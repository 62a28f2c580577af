//! Device and host page pools, built from layout descriptors only.
//!
//! A page id names the same token slots in every layer and in both buffer kinds (KV and
//! index-K), so one allocator serves a whole pool. The [`HostPool`] mirror is constructed
//! *from the device pool* ([`HostPool::mirror`]): it takes the device's descriptors and
//! has no dtype or size arguments of its own, so a host tier whose rows differ from the
//! device's cannot be expressed (outside the `host-pool-fp8-layout` fault injection).

use std::time::Instant;

use serde::Serialize;

use super::alloc::PageRef;
use super::faults::{Fault, Faults};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::layout::{IndexKDtype, IndexKLayout, KvLayout, PageLayout};
use crate::ops::PagedRegion;
use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};

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

/// What the device pool knows about one (layer, kind, page): the generation of the page
/// allocation its bytes were last written for, and how many leading token slots of the
/// page hold bytes written for that generation (a page is filled in token order: by its
/// owner's stores, or whole by a load or a transfer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Landed {
    pub generation: u32,
    /// Leading slots written (`0..=page_size`).
    pub filled: u32,
}

/// `Landed` packed into one atomic word: `(generation + 1) << 32 | filled` (0: nothing).
fn pack(l: Landed) -> u64 {
    ((l.generation as u64 + 1) << 32) | l.filled as u64
}

fn unpack(v: u64) -> Option<Landed> {
    (v != 0).then(|| Landed {
        generation: ((v >> 32) - 1) as u32,
        filled: v as u32,
    })
}

/// The device tier: per layer, a KV and an index-K buffer of `num_pages` pages each, behind
/// **one** mutex per layer (a guard over both kinds: no second lock of the same layer is
/// ever needed, so there is no lock-order hazard between a reader and the io worker), plus
/// the landed state of every (layer, kind, page) ([`Landed`]): what a reader checks behind
/// the fences, per kind, so that one kind having landed says nothing about the other.
#[derive(Debug)]
pub(crate) struct DevicePool<B: Backend> {
    spec: CacheSpec,
    num_pages: usize,
    layers: Vec<Mutex<LayerBuffers<B>>>,
    /// `[(layer * 2 + kind) * num_pages + page]`, packed by [`pack`].
    landed: Vec<AtomicU64>,
}

fn kind_index(kind: BufferKind) -> usize {
    match kind {
        BufferKind::Kv => 0,
        BufferKind::IndexK => 1,
    }
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
            landed: (0..spec.num_layers * BufferKind::ALL.len() * num_pages)
                .map(|_| AtomicU64::new(0))
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

    fn slot(&self, layer: usize, kind: BufferKind, page: u32) -> Option<&AtomicU64> {
        if (page as usize) < self.num_pages {
            self.landed
                .get((layer * 2 + kind_index(kind)) * self.num_pages + page as usize)
        } else {
            None
        }
    }

    /// Records that the first `filled` slots of `page` (kind `kind`, layer `layer`) hold
    /// bytes written for `generation`. Call with the layer's lock held, after the bytes.
    pub fn set_landed(
        &self,
        layer: usize,
        kind: BufferKind,
        page: u32,
        generation: u32,
        filled: u32,
    ) {
        if let Some(s) = self.slot(layer, kind, page) {
            s.store(pack(Landed { generation, filled }), Ordering::Release);
        }
    }

    /// Records a whole page (every slot) landed for `generation`: a load or transfer.
    pub fn set_page_landed(&self, layer: usize, kind: BufferKind, page: u32, generation: u32) {
        self.set_landed(layer, kind, page, generation, self.spec.page_size() as u32);
    }

    /// Marks `page` as holding nothing, in every layer and kind: a fresh allocation (its
    /// owner's stores or a copy will fill it).
    pub fn clear_landed(&self, page: u32) {
        for l in 0..self.spec.num_layers {
            for kind in BufferKind::ALL {
                if let Some(s) = self.slot(l, kind, page) {
                    s.store(0, Ordering::Release);
                }
            }
        }
    }

    /// The landed state of `page`'s bytes of `kind` in `layer`.
    pub fn landed(&self, layer: usize, kind: BufferKind, page: u32) -> Option<Landed> {
        unpack(self.slot(layer, kind, page)?.load(Ordering::Acquire))
    }

    /// Leading slots of `page` (kind, layer) written for `generation` (0 when its bytes
    /// are of another generation or none).
    pub fn filled(&self, layer: usize, kind: BufferKind, page: PageRef) -> u32 {
        match self.landed(layer, kind, page.id) {
            Some(l) if l.generation == page.generation => l.filled,
            _ => 0,
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
