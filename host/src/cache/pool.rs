//! Device and host page pools, built from layout descriptors only.
//!
//! A page id names the same token slots in every layer and in both buffer kinds (KV and
//! index-K), so one allocator serves a whole pool. The [`HostPool`] mirror is constructed
//! *from the device pool* ([`HostPool::mirror`]): it takes the device's descriptors and
//! has no dtype or size arguments of its own, so a host tier whose rows differ from the
//! device's cannot be expressed (outside the `host-pool-fp8-layout` fault injection).

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use serde::Serialize;

use super::faults::{Fault, Faults};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::layout::{IndexKDtype, IndexKLayout, KvLayout, PageLayout};
use crate::ops::PagedRegion;

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

/// The buffers of one layer.
#[derive(Debug)]
pub struct LayerBuffers<B: Backend> {
    pub kv: B::Buffer,
    pub index_k: B::Buffer,
}

impl<B: Backend> LayerBuffers<B> {
    pub fn get(&self, kind: BufferKind) -> &B::Buffer {
        match kind {
            BufferKind::Kv => &self.kv,
            BufferKind::IndexK => &self.index_k,
        }
    }
    pub fn get_mut(&mut self, kind: BufferKind) -> &mut B::Buffer {
        match kind {
            BufferKind::Kv => &mut self.kv,
            BufferKind::IndexK => &mut self.index_k,
        }
    }
}

/// The device tier: per layer, a KV and an index-K buffer of `num_pages` pages each.
/// Layers are individually locked so the io worker can fill one layer while the forward
/// pass reads another; reading goes through [`super::fence`] tokens.
#[derive(Debug)]
pub struct DevicePool<B: Backend> {
    spec: CacheSpec,
    num_pages: usize,
    layers: Vec<RwLock<LayerBuffers<B>>>,
}

impl<B: Backend> DevicePool<B> {
    /// Allocates the pool on `backend`.
    pub fn new(backend: &B, spec: CacheSpec, num_pages: usize) -> Result<Self> {
        let layers = (0..spec.num_layers)
            .map(|_| {
                Ok(RwLock::new(LayerBuffers {
                    kv: backend.alloc(spec.kv.buffer_bytes(num_pages))?,
                    index_k: backend.alloc(spec.index_k.buffer_bytes(num_pages))?,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DevicePool {
            spec,
            num_pages,
            layers,
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

    /// Read access to layer `l`, for the fence module and tests; the forward pass goes
    /// through `Fence` tokens.
    pub(crate) fn read(&self, l: usize) -> Result<RwLockReadGuard<'_, LayerBuffers<B>>> {
        self.layers
            .get(l)
            .ok_or_else(|| Error::invalid("layer", format!("{l} of {}", self.layers.len())))?
            .read()
            .map_err(|_| Error::Device("device pool layer lock poisoned".into()))
    }

    /// Write access to layer `l` (stores, loads).
    pub(crate) fn write(&self, l: usize) -> Result<RwLockWriteGuard<'_, LayerBuffers<B>>> {
        self.layers
            .get(l)
            .ok_or_else(|| Error::invalid("layer", format!("{l} of {}", self.layers.len())))?
            .write()
            .map_err(|_| Error::Device("device pool layer lock poisoned".into()))
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
/// layer and kind, in [`HostLayout`] order.
#[derive(Debug)]
pub struct HostPool<B: Backend> {
    spec: CacheSpec,
    layout: HostLayout,
    num_pages: usize,
    buffer: RwLock<B::Buffer>,
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
            buffer: RwLock::new(buffer),
        })
    }

    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }

    pub fn layout(&self) -> HostLayout {
        self.layout
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
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

    /// Read access to the whole host buffer (tools and tests).
    pub fn read(&self) -> Result<RwLockReadGuard<'_, B::Buffer>> {
        self.buffer
            .read()
            .map_err(|_| Error::Device("host pool lock poisoned".into()))
    }

    /// Write access to the whole host buffer. Bypasses the cache's bookkeeping and
    /// checksums: for tools and corruption tests only.
    pub fn write(&self) -> Result<RwLockWriteGuard<'_, B::Buffer>> {
        self.buffer
            .write()
            .map_err(|_| Error::Device("host pool lock poisoned".into()))
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
            let len = b.buffer_len(&host.read().unwrap());
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
