//! The engine's KV space: where each sequence's latent KV and index keys live, page by
//! page, for every layer.
//!
//! [`KvSpace`] is what the scheduler and the forward pass need from a cache: admission
//! (pages for a request, and how much of its prompt is already cached), page ids per
//! sequence in token order, the end of a sequence (commit or release), and per forward
//! step a [`KvStep`] over the step's sequences that hands out each layer's caches as a
//! [`LayerCache`]. [`PagedKvSpace`] is the plain implementation: one device pool per layer
//! and kind, no prefix reuse, no host tier — the harness's reference configuration.
//! [`crate::engine::CacheKvSpace`] is the cache-backed one (radix prefix reuse, host
//! tier, pages received by PD transfers): its step is a `HiCache` step, its layer a
//! `LayerGuard`, so a layer is reachable only after it landed.

use std::collections::HashMap;

use sparsekit_host::cache::{BufferKind, CacheSpec, PageRef, KINDS};
use sparsekit_host::{Backend, IndexKLayout, KvLayout};

use crate::error::EngineError;
use crate::metrics::Metrics;

/// A sequence in a KV space (the scheduler uses its request number).
pub type SeqId = u64;

/// One layer's KV and index-K caches, as the forward pass of one step uses them: first
/// [`LayerCache::store`] of the step's new tokens, then reads through
/// [`LayerCache::views`].
pub trait LayerCache<B: Backend> {
    /// Layout of the KV buffer.
    fn kv_layout(&self) -> KvLayout;
    /// Layout of the index-K buffer.
    fn index_k_layout(&self) -> IndexKLayout;
    /// Stores the step's new tokens at `slots` (`page · page_size + offset`; every slot a
    /// page of a sequence in the step, reserved beforehand): `kv` bf16
    /// `[slots.len(), d_qk]`, `index_k` bf16 `[slots.len(), index_head_dim]`.
    fn store(
        &mut self,
        backend: &B,
        slots: &[i64],
        kv: &B::Buffer,
        index_k: &B::Buffer,
    ) -> Result<(), EngineError>;
    /// This layer's pages (whole pools): `(kv, index_k)`, for a forward pass that reads
    /// the first `tokens` tokens of each `(seq, tokens)` in `reads`. A cache re-checks here
    /// that every page the step's sequences read holds the bytes it should (landed
    /// stamps) and that no slot read was left unwritten.
    fn views(&self, reads: &[(SeqId, usize)]) -> Result<(&B::Buffer, &B::Buffer), EngineError>;
    /// The pools of the whole cache (which kinds this layer holds: [`CacheSpec::has`]).
    fn spec(&self) -> CacheSpec;
    /// Stores rows into `slots` of this layer's pool of `kind`, slots counted in that
    /// pool's entries (`page · entries_per_page(kind) + offset`): index keys bf16
    /// `[slots.len(), index_head_dim]`, every other kind bf16 rows `[slots.len(), d_qk]`
    /// of its layout. A typed error for a kind the layer does not hold.
    fn store_kind(
        &mut self,
        backend: &B,
        kind: BufferKind,
        slots: &[i64],
        rows: &B::Buffer,
    ) -> Result<(), EngineError>;
    /// This layer's pool of `kind` (the whole pool), re-checked as [`LayerCache::views`]
    /// for reads of the first `tokens` raw tokens of each `(seq, tokens)` in `reads`.
    fn view(&self, kind: BufferKind, reads: &[(SeqId, usize)]) -> Result<&B::Buffer, EngineError>;
    /// Where pages `pages` (page ids, `-1` kept) sit in this layer's pool of `kind`, the
    /// page indices its slot indices are built from: the ids themselves, except in a
    /// cache whose window pool has frames ([`CacheSpec::with_window`]): there the frames,
    /// `-1` for a page whose window rows were given back.
    fn buffer_pages(&self, kind: BufferKind, pages: &[i32]) -> Vec<i32> {
        let _ = kind;
        pages.to_vec()
    }
}

/// One forward step over a set of sequences: layer by layer access to their caches.
pub trait KvStep<B: Backend> {
    /// The per-layer view handed to the forward pass.
    type Layer<'a>: LayerCache<B>
    where
        Self: 'a;
    /// Layer `l`'s caches for this step (a cache waits, bounded, until layer `l` of every
    /// sequence of the step landed). Layers are taken in order, one at a time.
    fn layer(&mut self, l: usize) -> Result<Self::Layer<'_>, EngineError>;
}

/// Pages a request brings along instead of computing its prompt (the decode side of a PD
/// pair): live in the space's cache as request `cache_request` — begun and allocated by
/// the receiver, written through `HiCache::inbound`, the transfer completed — holding the
/// KV and index keys of the prompt's first `tokens` tokens. The engine adopts them: the
/// request's pages are `pages` (in token order), then `extra` (pages the same cache
/// request owns for the rest of its budget, so that admitting it needs no new page), then
/// what the budget still needs; it computes from `tokens` on (at least the last prompt
/// token, for its logits).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReceivedPages {
    pub cache_request: u64,
    pub pages: Vec<PageRef>,
    /// Owned, not received: written by the request's own stores.
    pub extra: Vec<PageRef>,
    pub tokens: usize,
}

/// Where a request's prompt KV can come from instead of being computed by the engine
/// (the decode side of PD: [`crate::pd::decode::DecodeSource`]). Set with
/// [`crate::engine::Engine::set_prompt_source`]; the engine then calls
/// [`PromptSource::fetch`] for every submitted request on a thread of its own (never the
/// engine thread) and queues the request once it returns.
pub trait PromptSource: Send + Sync {
    /// Brings the KV and index keys of a leading part of `prompt` into the engine's cache
    /// and returns the pages to adopt — with the pages of the request's whole budget of
    /// `total_tokens` (prompt plus generation) taken at once, all or nothing, so that a
    /// fetch never holds some pages while it waits for more and the engine never waits
    /// to admit a fetched request — or `None` to compute the whole prompt here (a prompt
    /// too short to transfer). Every wait inside is bounded. When `aborted` turns true (the
    /// client went away) it gives up, releases what it holds (or leaves it quarantined
    /// until nothing can land in it) and returns [`EngineError::Aborted`].
    fn fetch(
        &self,
        prompt: &[u32],
        total_tokens: usize,
        aborted: &std::sync::atomic::AtomicBool,
    ) -> Result<Option<ReceivedPages>, EngineError>;

    /// Gives back pages a successful `fetch` returned for a request the engine could not
    /// take after all (it stopped).
    fn release(&self, received: &ReceivedPages);
}

/// Pages per sequence plus per-step layer access; see the module docs.
pub trait KvSpace<B: Backend> {
    /// A forward step's access to the layers.
    type Step<'a>: KvStep<B>
    where
        Self: 'a;

    /// Layout of every layer's KV buffer.
    fn kv_layout(&self) -> KvLayout;
    /// Layout of every layer's index-K buffer.
    fn index_k_layout(&self) -> IndexKLayout;
    /// Every pool of the space: kinds, layouts, the layers holding each.
    fn spec(&self) -> CacheSpec;
    /// Decoder layers held.
    fn num_layers(&self) -> usize;
    /// Pages in the pool (each page holds `page_size` tokens of every layer and kind).
    fn capacity_pages(&self) -> usize;
    /// Pages free now.
    fn free_pages(&self) -> usize;
    /// Pages `seq` would need in all to hold `tokens` tokens beyond what it holds.
    fn pages_needed(&self, seq: SeqId, tokens: usize) -> usize {
        let have = self.pages(seq).map_or(0, <[i32]>::len);
        tokens
            .div_ceil(self.kv_layout().page_size())
            .saturating_sub(have)
    }
    /// Admits a request: pages for `seq` to hold `total` tokens (prompt plus generation
    /// budget), and how many leading tokens of `prompt` already have their KV and index
    /// keys in the pages now mapped to `seq` — the scheduler computes from there (it
    /// always recomputes at least the last prompt token, for its logits). A prefix cache
    /// matches `prompt` here; `received` adopts pages a transfer filled. Never blocks: on
    /// [`EngineError::OutOfPages`] the scheduler tries again later (a space may keep what
    /// it started, e.g. a prefix load, for that next try; [`KvSpace::release`] ends it).
    /// With `reuse` false nothing is matched: the request computes its whole prompt (a
    /// request recomputing a prefix that failed an integrity check).
    fn admit(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        total: usize,
        received: Option<&ReceivedPages>,
        reuse: bool,
    ) -> Result<usize, EngineError>;
    /// Page ids of `seq` in token order (entry `p` holds tokens `p·page_size ..`).
    fn pages(&self, seq: SeqId) -> Result<&[i32], EngineError>;
    /// Opens a forward step over `seqs` (admitted, distinct).
    fn step(&mut self, seqs: &[SeqId]) -> Result<Self::Step<'_>, EngineError>;
    /// Ends `seq` normally: `tokens[..computed]` have valid KV and index keys in its pages,
    /// which a caching space may keep for reuse. Returns the pages given back to the free
    /// pool. The default releases everything.
    fn commit(&mut self, seq: SeqId, tokens: &[u32], computed: usize) -> usize {
        let _ = (tokens, computed);
        self.release(seq)
    }
    /// [`KvSpace::commit`] for a PD prefill: the pages of `tokens[..computed]` (the full
    /// ones committed, a partly filled last one still the request's own) stay locked for
    /// the caller as a live cache request (returned as [`ReceivedPages`]; the caller ends
    /// it, or gives it back with [`KvSpace::release_received`]). `None` where the space
    /// cannot hold pages (it then committed as `commit`).
    fn commit_held(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        computed: usize,
    ) -> Option<ReceivedPages> {
        self.commit(seq, tokens, computed);
        None
    }
    /// Drops the prefix `seq` matched from the space's cache after it failed an integrity
    /// check, so no request reuses it (the default: nothing cached, nothing to drop).
    /// Returns the pages dropped.
    fn discard_prefix(&mut self, seq: SeqId) -> usize {
        let _ = seq;
        0
    }
    /// Frees every page of `seq` without keeping anything (aborted or failed requests,
    /// admitted or still waiting); returns how many (0 for an unknown sequence).
    fn release(&mut self, seq: SeqId) -> usize;
    /// Gives back the window rows of `seq`'s pages from the one holding token `from` on
    /// that no query after its first `tokens` tokens reads (a space whose KV pool is not a
    /// window, or that has no frames: nothing). Call between steps; returns the frames
    /// that went back to the pool (those handed to the sequence's later pages not
    /// counted).
    fn release_window(&mut self, seq: SeqId, from: usize, tokens: usize) -> usize {
        let _ = (seq, from, tokens);
        0
    }
    /// Gives back pages received for a request that ended before it was admitted.
    fn release_received(&mut self, received: &ReceivedPages) {
        let _ = received;
    }
    /// Accounting: every page is free or held by exactly one sequence (or the cache).
    fn leak_check(&self) -> Result<(), EngineError>;
    /// Pages held for requests the engine does not know (read when the engine is idle:
    /// nothing should be held then but what a cache keeps for reuse).
    fn leaked_pages(&self) -> usize {
        0
    }
    /// Publishes the space's gauges and counters (`sparsekit_pages`, cache hits, loads…).
    fn publish(&mut self, metrics: &Metrics) {
        let (free, cap) = (self.free_pages(), self.capacity_pages());
        metrics.pages("device", "free", free);
        metrics.pages("device", "in_use", cap - free);
    }
}

/// The reference KV space: per layer one pool of `capacity` pages for every kind the
/// layer holds (the V3.2 pair, or V4's window, compressed and state pools), a free list,
/// and each sequence's pages. No prefix reuse, no host tier.
#[derive(Debug)]
pub struct PagedKvSpace<B: Backend> {
    spec: CacheSpec,
    layers: Vec<[Option<B::Buffer>; KINDS]>,
    capacity: usize,
    free: Vec<i32>,
    seqs: HashMap<SeqId, Vec<i32>>,
}

impl<B: Backend> PagedKvSpace<B> {
    /// Allocates `capacity` pages per layer and kind on `backend` (DeepSeek-V3.2's pair).
    pub fn new(
        backend: &B,
        kv_layout: KvLayout,
        index_k_layout: IndexKLayout,
        num_layers: usize,
        capacity: usize,
    ) -> Result<Self, EngineError> {
        if kv_layout.page_size() != index_k_layout.page_size() {
            return Err(EngineError::InvalidConfig(format!(
                "KV pages hold {} tokens but index-K pages {}",
                kv_layout.page_size(),
                index_k_layout.page_size()
            )));
        }
        let spec = CacheSpec::new(kv_layout, index_k_layout, num_layers)?;
        Self::with_spec(backend, spec, capacity)
    }

    /// Allocates `capacity` pages of every pool `spec` puts in each layer.
    pub fn with_spec(backend: &B, spec: CacheSpec, capacity: usize) -> Result<Self, EngineError> {
        if capacity == 0 || capacity > i32::MAX as usize / spec.page_size() {
            return Err(EngineError::InvalidConfig(format!(
                "capacity of {capacity} pages is out of range"
            )));
        }
        let mut layers = Vec::with_capacity(spec.num_layers);
        for l in 0..spec.num_layers {
            let mut pools: [Option<B::Buffer>; KINDS] = Default::default();
            for kind in spec.kinds(l) {
                let bytes = spec
                    .layout(kind)
                    .bytes_per_page()
                    .checked_mul(capacity)
                    .ok_or_else(|| {
                        EngineError::InvalidConfig(format!("{capacity} pages overflow"))
                    })?;
                pools[kind.index()] = Some(backend.alloc(bytes)?);
            }
            layers.push(pools);
        }
        Ok(PagedKvSpace {
            spec,
            layers,
            capacity,
            // Popped from the back: page 0 first.
            free: (0..capacity as i32).rev().collect(),
            seqs: HashMap::new(),
        })
    }

    /// Sequences holding pages.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Grows `seq` (created on first use) to hold `tokens` tokens. All-or-nothing: on
    /// [`EngineError::OutOfPages`] nothing was allocated.
    pub fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<(), EngineError> {
        let wanted = tokens.div_ceil(self.spec.page_size());
        if wanted > self.capacity {
            return Err(EngineError::TooLarge {
                wanted,
                capacity: self.capacity,
            });
        }
        let have = self.seqs.get(&seq).map_or(0, Vec::len);
        let more = wanted.saturating_sub(have);
        if more > self.free.len() {
            return Err(EngineError::OutOfPages {
                wanted: more,
                free: self.free.len(),
            });
        }
        let pages = self.seqs.entry(seq).or_default();
        for _ in 0..more {
            match self.free.pop() {
                Some(p) => pages.push(p),
                None => unreachable!("free count checked above"),
            }
        }
        Ok(())
    }

    /// Layer `l`'s pools (outside a step: tests and benches).
    pub fn layer(&mut self, l: usize) -> Result<PagedLayer<'_, B::Buffer>, EngineError> {
        let n = self.layers.len();
        let pools = self.layers.get_mut(l).ok_or_else(|| {
            EngineError::InvalidRequest(format!("layer {l} out of range ({n} layers)"))
        })?;
        Ok(PagedLayer {
            spec: self.spec,
            pools,
        })
    }
}

/// A step of a [`PagedKvSpace`]: its layers, no waiting.
#[derive(Debug)]
pub struct PagedStep<'a, B: Backend> {
    space: &'a mut PagedKvSpace<B>,
}

impl<B: Backend> KvStep<B> for PagedStep<'_, B> {
    type Layer<'a>
        = PagedLayer<'a, B::Buffer>
    where
        Self: 'a;

    fn layer(&mut self, l: usize) -> Result<Self::Layer<'_>, EngineError> {
        self.space.layer(l)
    }
}

/// A layer of a [`PagedKvSpace`].
#[derive(Debug)]
pub struct PagedLayer<'a, Buf> {
    spec: CacheSpec,
    pools: &'a mut [Option<Buf>; KINDS],
}

impl<Buf> PagedLayer<'_, Buf> {
    fn pool(&self, kind: BufferKind) -> Result<&Buf, EngineError> {
        self.pools[kind.index()]
            .as_ref()
            .ok_or_else(|| missing_pool(kind))
    }
}

fn missing_pool(kind: BufferKind) -> EngineError {
    EngineError::InvalidRequest(format!("this layer holds no {} pool", kind.name()))
}

impl<B: Backend> LayerCache<B> for PagedLayer<'_, B::Buffer> {
    fn kv_layout(&self) -> KvLayout {
        self.spec.kv
    }

    fn index_k_layout(&self) -> IndexKLayout {
        self.spec.index_k
    }

    fn store(
        &mut self,
        backend: &B,
        slots: &[i64],
        kv: &B::Buffer,
        index_k: &B::Buffer,
    ) -> Result<(), EngineError> {
        self.store_kind(backend, BufferKind::Kv, slots, kv)?;
        self.store_kind(backend, BufferKind::IndexK, slots, index_k)
    }

    fn views(&self, _reads: &[(SeqId, usize)]) -> Result<(&B::Buffer, &B::Buffer), EngineError> {
        Ok((self.pool(BufferKind::Kv)?, self.pool(BufferKind::IndexK)?))
    }

    fn spec(&self) -> CacheSpec {
        self.spec
    }

    fn store_kind(
        &mut self,
        backend: &B,
        kind: BufferKind,
        slots: &[i64],
        rows: &B::Buffer,
    ) -> Result<(), EngineError> {
        let spec = self.spec;
        let pool = self.pools[kind.index()]
            .as_mut()
            .ok_or_else(|| missing_pool(kind))?;
        Ok(spec.store(backend, kind, slots, rows, pool)?)
    }

    fn view(&self, kind: BufferKind, _reads: &[(SeqId, usize)]) -> Result<&B::Buffer, EngineError> {
        self.pool(kind)
    }
}

impl<B: Backend> KvSpace<B> for PagedKvSpace<B> {
    type Step<'a>
        = PagedStep<'a, B>
    where
        Self: 'a;

    fn kv_layout(&self) -> KvLayout {
        self.spec.kv
    }

    fn index_k_layout(&self) -> IndexKLayout {
        self.spec.index_k
    }

    fn spec(&self) -> CacheSpec {
        self.spec
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn capacity_pages(&self) -> usize {
        self.capacity
    }

    fn free_pages(&self) -> usize {
        self.free.len()
    }

    fn admit(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        total: usize,
        received: Option<&ReceivedPages>,
        _reuse: bool,
    ) -> Result<usize, EngineError> {
        let _ = prompt;
        if received.is_some() {
            return Err(EngineError::InvalidRequest(
                "this KV space cannot adopt received pages (it has no cache)".into(),
            ));
        }
        self.reserve(seq, total)?;
        Ok(0)
    }

    fn pages(&self, seq: SeqId) -> Result<&[i32], EngineError> {
        self.seqs
            .get(&seq)
            .map(Vec::as_slice)
            .ok_or(EngineError::UnknownSequence(seq))
    }

    fn release(&mut self, seq: SeqId) -> usize {
        match self.seqs.remove(&seq) {
            Some(pages) => {
                let n = pages.len();
                self.free.extend(pages.into_iter().rev());
                n
            }
            None => 0,
        }
    }

    fn step(&mut self, seqs: &[SeqId]) -> Result<Self::Step<'_>, EngineError> {
        for s in seqs {
            if !self.seqs.contains_key(s) {
                return Err(EngineError::UnknownSequence(*s));
            }
        }
        Ok(PagedStep { space: self })
    }

    fn leak_check(&self) -> Result<(), EngineError> {
        let mut owner = vec![0u8; self.capacity];
        for &p in self
            .free
            .iter()
            .chain(self.seqs.values().flat_map(|v| v.iter()))
        {
            let slot = owner.get_mut(p as usize).ok_or_else(|| {
                EngineError::Backend(sparsekit_host::Error::Leak(format!(
                    "page {p} out of range"
                )))
            })?;
            *slot += 1;
        }
        let lost = owner.iter().filter(|&&c| c == 0).count();
        let twice = owner.iter().filter(|&&c| c > 1).count();
        if lost + twice > 0 {
            return Err(EngineError::Backend(sparsekit_host::Error::Leak(format!(
                "{lost} pages lost, {twice} held twice"
            ))));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparsekit_host::{CpuBackend, IndexKDtype, KvDtype};

    fn space(cap: usize) -> PagedKvSpace<CpuBackend> {
        let kv = KvLayout::new(KvDtype::Bf16, 256, 32, 16).unwrap_or_else(|e| panic!("{e}"));
        let ik = IndexKLayout::new(IndexKDtype::FP8, 64, 16).unwrap_or_else(|e| panic!("{e}"));
        PagedKvSpace::new(&CpuBackend::new(), kv, ik, 2, cap).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn reserve_release_account() {
        let mut s = space(5);
        assert_eq!(s.pages_needed(1, 33), 3);
        s.reserve(1, 33).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.pages(1).map(<[i32]>::len), Ok(3));
        s.reserve(1, 40).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.free_pages(), 2);
        // All-or-nothing.
        assert_eq!(
            s.reserve(2, 48),
            Err(EngineError::OutOfPages { wanted: 3, free: 2 })
        );
        assert_eq!(s.free_pages(), 2);
        assert!(matches!(
            s.reserve(3, 97),
            Err(EngineError::TooLarge { .. })
        ));
        s.leak_check().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.release(1), 3);
        assert_eq!(s.release(1), 0);
        assert_eq!(s.free_pages(), 5);
        assert!(s.pages(1).is_err());
        s.leak_check().unwrap_or_else(|e| panic!("{e}"));
        // A corrupted free list is reported.
        s.free.push(0);
        assert!(s.leak_check().is_err());
    }
}
