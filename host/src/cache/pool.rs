//! Device and host page pools, built from layout descriptors only.
//!
//! A page id names the same token slots in every layer and in both buffer kinds (KV and
//! index-K), so one allocator serves a whole pool. The [`HostPool`] mirror is constructed
//! *from the device pool* ([`HostPool::mirror`]): it takes the device's descriptors and
//! has no dtype or size arguments of its own, so a host tier whose rows differ from the
//! device's cannot be expressed (outside the `host-pool-fp8-layout` fault injection).

use std::ops::Range;
use std::time::Instant;

use serde::Serialize;

use std::sync::Arc;

use super::alloc::{FrameMap, PageRef};
use super::faults::{Fault, Faults};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::layout::{IndexKDtype, IndexKLayout, KvLayout, PageLayout};
use crate::ops::{IndexKStore, KvStore, PagedRegion};
use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};

/// What a pool's rows are. DeepSeek-V3.2 caches hold `Kv` (the MLA latent KV) and
/// `IndexK` (the indexer's keys) in every layer. DeepSeek-V4 caches hold `Kv` (the
/// sliding window's raw KV rows) in every layer, and in some layers `IndexK` (the CSA
/// layers' compressed index keys), `CsaKv` (their compressed KV), `HcaKv` (the HCA
/// layers' compressed KV) and `State` (the compressor's input rows in the compressed
/// layers, so a prefix hit that ends inside a compression window resumes it exactly).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferKind {
    Kv,
    IndexK,
    CsaKv,
    HcaKv,
    State,
}

/// How many buffer kinds there are ([`BufferKind::ALL`]).
pub const KINDS: usize = 5;

impl BufferKind {
    pub const ALL: [BufferKind; KINDS] = [
        BufferKind::Kv,
        BufferKind::IndexK,
        BufferKind::CsaKv,
        BufferKind::HcaKv,
        BufferKind::State,
    ];

    pub fn name(&self) -> &'static str {
        match self {
            BufferKind::Kv => "kv",
            BufferKind::IndexK => "index_k",
            BufferKind::CsaKv => "csa_kv",
            BufferKind::HcaKv => "hca_kv",
            BufferKind::State => "state",
        }
    }

    /// Position in [`BufferKind::ALL`] (the wire code of the PD protocol).
    pub fn index(&self) -> usize {
        *self as usize
    }

    /// The kind at `index` of [`BufferKind::ALL`].
    pub fn from_index(index: usize) -> Option<BufferKind> {
        BufferKind::ALL.get(index).copied()
    }
}

/// One pool beyond the V3.2 pair (a DeepSeek-V4 cache's compressed KV and compressor
/// state): its rows' layout (`page_size` entries a page) and how many raw tokens one entry
/// stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtraPool {
    pub layout: KvLayout,
    pub tokens_per_entry: usize,
}

/// What every layer of a cache holds: one pool per buffer kind, each described by its own
/// layout descriptor, each present in a set of layers. A page id names the same span of
/// `tokens_per_page` raw tokens in every pool and layer (one page table): a pool of
/// `tokens_per_entry` raw tokens an entry has `tokens_per_page / tokens_per_entry` entries
/// a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSpec {
    /// The KV rows of every layer (V3.2: the latent KV; V4: the window's raw KV).
    pub kv: KvLayout,
    /// The index keys (V3.2: every layer; V4: the CSA layers, compressed).
    pub index_k: IndexKLayout,
    pub num_layers: usize,
    tokens_per_page: usize,
    index_k_tokens_per_entry: usize,
    /// `CsaKv`, `HcaKv`, `State`, where present.
    extra: [Option<ExtraPool>; 3],
    /// Per kind, the layers holding it (bit `l`).
    layers: [u128; KINDS],
    /// The sliding window in raw tokens whose `Kv` rows are all a query reads (0: the KV
    /// pool is not a window; see [`CacheSpec::with_window`]).
    window: usize,
}

impl CacheSpec {
    /// Layers a cache can have (the layer sets are bit masks).
    pub const MAX_LAYERS: usize = 128;

    /// A DeepSeek-V3.2 cache: KV and index-K in every layer, one entry per token, both
    /// layouts sharing one page size; at least one layer.
    pub fn new(kv: KvLayout, index_k: IndexKLayout, num_layers: usize) -> Result<Self> {
        if kv.page_size() != index_k.page_size() {
            return Err(Error::InvalidLayout(format!(
                "KV page size {} differs from index-K page size {}",
                kv.page_size(),
                index_k.page_size()
            )));
        }
        let all = Self::mask(num_layers, |_| true)?;
        Ok(CacheSpec {
            kv,
            index_k,
            num_layers,
            tokens_per_page: kv.page_size(),
            index_k_tokens_per_entry: 1,
            extra: [None; 3],
            layers: [all, all, 0, 0, 0],
            window: 0,
        })
    }

    /// A DeepSeek-V4 cache over `layer_ratios` (per layer: 0 window only, 4 CSA, and one
    /// HCA ratio above 4 — V4's 128; a second HCA ratio or any other value is refused):
    /// the window's raw KV (`kv`, one entry a token) in every layer; CSA layers also hold
    /// the compressed index keys (`index_k`) and the compressed KV (`csa_kv`); HCA layers
    /// the compressed KV (`hca_kv`); both compressed kinds the compressor's state
    /// (`state`: `tpp / state.page_size()` raw tokens an entry). Each layout's
    /// page size times its tokens per entry must be `kv`'s page size (one page table).
    pub fn v4(
        kv: KvLayout,
        index_k: IndexKLayout,
        csa_kv: KvLayout,
        hca_kv: KvLayout,
        state: KvLayout,
        layer_ratios: &[usize],
    ) -> Result<Self> {
        let tpp = kv.page_size();
        let csa_ratio = 4;
        let hca_ratio = layer_ratios
            .iter()
            .copied()
            .find(|&r| r > csa_ratio)
            .unwrap_or(128);
        if let Some(r) = layer_ratios
            .iter()
            .find(|&&r| r != 0 && r != csa_ratio && r != hca_ratio)
        {
            return Err(Error::InvalidLayout(format!(
                "layer ratio {r}: a V4 cache has window layers (0), CSA layers ({csa_ratio}) \
                 and HCA layers of one ratio ({hca_ratio})"
            )));
        }
        let per = |name: &str, page_size: usize, ratio: usize| -> Result<()> {
            if page_size.checked_mul(ratio) != Some(tpp) {
                return Err(Error::InvalidLayout(format!(
                    "{name}: {page_size} entries of {ratio} tokens do not make a page of \
                     {tpp} tokens"
                )));
            }
            Ok(())
        };
        per("index-K", index_k.page_size(), csa_ratio)?;
        per("CSA KV", csa_kv.page_size(), csa_ratio)?;
        if layer_ratios.contains(&hca_ratio) {
            per("HCA KV", hca_kv.page_size(), hca_ratio)?;
        }
        per(
            "compressor state",
            state.page_size(),
            tpp / state.page_size().max(1),
        )?;
        let n = layer_ratios.len();
        let csa = Self::mask(n, |l| layer_ratios[l] == csa_ratio)?;
        let hca = Self::mask(n, |l| layer_ratios[l] == hca_ratio)?;
        Ok(CacheSpec {
            kv,
            index_k,
            num_layers: n,
            tokens_per_page: tpp,
            index_k_tokens_per_entry: csa_ratio,
            extra: [
                Some(ExtraPool {
                    layout: csa_kv,
                    tokens_per_entry: csa_ratio,
                }),
                Some(ExtraPool {
                    layout: hca_kv,
                    tokens_per_entry: hca_ratio,
                }),
                Some(ExtraPool {
                    layout: state,
                    tokens_per_entry: tpp / state.page_size().max(1),
                }),
            ],
            layers: [Self::mask(n, |_| true)?, csa, csa, hca, csa | hca],
            window: 0,
        })
    }

    /// This V4 spec with its KV pool a sliding window of `window` raw tokens (V4: 128): a
    /// query at position `p` reads the `Kv` rows of `p + 1 - window..=p` only, so a page
    /// whose tokens left every window can give its `Kv` part back early (its compressed
    /// pools stay): the cache backs the KV pool with fewer *frames* than pages
    /// ([`super::CacheConfig::window_pages`]). Refused for a V3.2 spec (its KV is every
    /// token's) and for a window of 0.
    pub fn with_window(mut self, window: usize) -> Result<Self> {
        if self.extra.iter().all(Option::is_none) {
            return Err(Error::InvalidLayout(
                "a sliding window needs a V4 cache (V3.2's KV is read for every token)".into(),
            ));
        }
        if window == 0 {
            return Err(Error::InvalidLayout("a window of 0 tokens".into()));
        }
        self.window = window;
        Ok(self)
    }

    /// The KV pool's sliding window in raw tokens (`None`: every token's KV is read).
    pub fn window(&self) -> Option<usize> {
        (self.window > 0).then_some(self.window)
    }

    /// Whether pool `kind` is the sliding window's (its pages may give their bytes back
    /// before the page: addressed through frames).
    pub fn windowed(&self, kind: BufferKind) -> bool {
        self.window > 0 && kind == BufferKind::Kv
    }

    /// The pages (indices into a sequence's pages) whose window rows a query after the
    /// first `tokens` raw tokens may read: those holding a token of the last `window`
    /// (every page without a window).
    pub fn window_pages(&self, tokens: usize) -> Range<usize> {
        let ps = self.tokens_per_page.max(1);
        let end = tokens.div_ceil(ps);
        match self.window() {
            Some(w) => (tokens.saturating_sub(w) / ps).min(end)..end,
            None => 0..end,
        }
    }

    /// The pages (indices into a sequence's pages) of the first `tokens` raw tokens whose
    /// rows of `kind` a transfer of those tokens moves: every page, but of the window pool
    /// only the [`CacheSpec::window_pages`] a query after them reads.
    pub fn carried_pages(&self, kind: BufferKind, tokens: usize) -> Range<usize> {
        if self.windowed(kind) {
            self.window_pages(tokens)
        } else {
            0..tokens.div_ceil(self.tokens_per_page.max(1))
        }
    }

    /// Frames a request of `total` raw tokens whose first `prompt` are its prompt holds at
    /// most when it gives back the window rows of its pages past the prompt as they leave
    /// the window ([`CacheSpec::window_passed`]): its prompt's pages, the pages of one
    /// window, the last full page and the page being filled (its pages without a window).
    pub fn frames_needed(&self, prompt: usize, total: usize) -> usize {
        let ps = self.tokens_per_page.max(1);
        let pages = total.max(prompt).div_ceil(ps);
        match self.window() {
            Some(w) => pages.min(prompt.div_ceil(ps) + w.div_ceil(ps) + 2),
            None => pages,
        }
    }

    /// How many leading pages of a sequence of `tokens` raw tokens hold no token any later
    /// query's window reads, less the last full page (kept so that the prefix the sequence
    /// commits still ends on a page whose window rows are present): the pages that may
    /// give their window rows back. 0 without a window.
    pub fn window_passed(&self, tokens: usize) -> usize {
        let ps = self.tokens_per_page.max(1);
        match self.window() {
            Some(w) => ((tokens + 1).saturating_sub(w) / ps).min((tokens / ps).saturating_sub(1)),
            None => 0,
        }
    }

    fn mask(n: usize, has: impl Fn(usize) -> bool) -> Result<u128> {
        if n == 0 || n > Self::MAX_LAYERS {
            return Err(Error::InvalidLayout(format!(
                "a cache needs 1 to {} layers, not {n}",
                Self::MAX_LAYERS
            )));
        }
        Ok((0..n).filter(|&l| has(l)).fold(0, |m, l| m | (1u128 << l)))
    }

    /// Raw tokens per page (the radix tree's and the page table's unit).
    pub fn page_size(&self) -> usize {
        self.tokens_per_page
    }

    /// Whether layer `layer` holds a pool of `kind`.
    pub fn has(&self, layer: usize, kind: BufferKind) -> bool {
        layer < self.num_layers && self.layers[kind.index()] & (1u128 << layer) != 0
    }

    /// The kinds layer `layer` holds, in [`BufferKind::ALL`] order.
    pub fn kinds(&self, layer: usize) -> impl Iterator<Item = BufferKind> + '_ {
        BufferKind::ALL
            .into_iter()
            .filter(move |k| self.has(layer, *k))
    }

    /// Whether any layer holds `kind`.
    pub fn holds(&self, kind: BufferKind) -> bool {
        self.layers[kind.index()] != 0
    }

    /// The descriptor of one buffer kind (of a kind no layer holds: its descriptor all
    /// the same where the cache has one, the KV's for the V3.2 pair's absent extras).
    pub fn layout(&self, kind: BufferKind) -> PageLayout {
        match kind {
            BufferKind::Kv => self.kv.into(),
            BufferKind::IndexK => self.index_k.into(),
            k => self
                .extra_pool(k)
                .map_or(self.kv.into(), |e| e.layout.into()),
        }
    }

    fn extra_pool(&self, kind: BufferKind) -> Option<ExtraPool> {
        match kind {
            BufferKind::CsaKv => self.extra[0],
            BufferKind::HcaKv => self.extra[1],
            BufferKind::State => self.extra[2],
            _ => None,
        }
    }

    /// Raw tokens one entry of `kind` stands for.
    pub fn tokens_per_entry(&self, kind: BufferKind) -> usize {
        match kind {
            BufferKind::Kv => 1,
            BufferKind::IndexK => self.index_k_tokens_per_entry,
            k => self.extra_pool(k).map_or(1, |e| e.tokens_per_entry),
        }
    }

    /// Entries of `kind` in a page.
    pub fn entries_per_page(&self, kind: BufferKind) -> usize {
        self.layout(kind).page_size()
    }

    /// The entries of `kind` on the last page of a `tokens`-token sequence
    /// (`ceil(raw tokens on the page / tokens per entry)`), or `None` when that page is
    /// full (or `tokens` is 0).
    pub fn tail_entries(&self, kind: BufferKind, tokens: usize) -> Option<usize> {
        let raw = tokens % self.tokens_per_page.max(1);
        let entries = raw.div_ceil(self.tokens_per_entry(kind).max(1));
        (raw > 0 && entries < self.entries_per_page(kind)).then_some(entries)
    }

    /// The byte ranges of that last page holding those entries
    /// ([`PageLayout::entry_spans`] of [`Self::tail_entries`]).
    pub fn tail_spans(&self, kind: BufferKind, tokens: usize) -> Option<Vec<Range<usize>>> {
        let entries = self.tail_entries(kind, tokens)?;
        Some(self.layout(kind).entry_spans(entries))
    }

    /// Stores `rows` into slot numbers `slots` (`page · entries_per_page(kind) + offset`,
    /// `-1` skips) of `pool`, a pool of `kind` in this spec's layout: index keys (bf16
    /// `[slots.len(), head_dim]`) through `index_k_store`, quantized as the layout says;
    /// every row-shaped pool (KV, compressed KV, compressor state: bf16
    /// `[slots.len(), d_qk]`) through `kv_store`.
    pub fn store<B: Backend>(
        &self,
        backend: &B,
        kind: BufferKind,
        slots: &[i64],
        rows: &B::Buffer,
        pool: &mut B::Buffer,
    ) -> Result<()> {
        match (kind, self.layout(kind)) {
            (BufferKind::IndexK, _) => backend.index_k_store(
                &IndexKStore {
                    layout: self.index_k,
                    slots,
                },
                rows,
                pool,
            ),
            (_, PageLayout::Kv(layout)) => backend.kv_store(&KvStore { layout, slots }, rows, pool),
            (_, PageLayout::IndexK(_)) => Err(Error::InvalidArgument {
                what: "kind",
                detail: format!("{} rows are not index keys", kind.name()),
            }),
        }
    }

    /// Bytes of one page of every layer and every kind each holds.
    pub fn bytes_per_page_all_layers(&self) -> usize {
        (0..self.num_layers)
            .flat_map(|l| self.kinds(l))
            .map(|k| self.layout(k).bytes_per_page())
            .sum()
    }

    /// One fingerprint of the whole spec: every pool's descriptor, its layers and tokens
    /// per entry, the page span (what two ends of a transfer must agree on).
    pub fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut mix = |x: u64| {
            for b in x.to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
            }
        };
        mix(self.num_layers as u64);
        mix(self.tokens_per_page as u64);
        if self.window > 0 {
            mix(0x7769_6e64_6f77);
            mix(self.window as u64);
        }
        for k in BufferKind::ALL {
            if self.holds(k) {
                mix(k.index() as u64);
                mix(self.layout(k).fingerprint());
                mix(self.tokens_per_entry(k) as u64);
                mix(self.layers[k.index()] as u64);
                mix((self.layers[k.index()] >> 64) as u64);
            }
        }
        h
    }
}

/// The buffers of one layer, one per kind the layer holds. Reachable only inside the
/// cache: readers get them through a [`super::LayerGuard`], writers are the io worker and
/// inbound transfers.
#[derive(Debug)]
pub(crate) struct LayerBuffers<B: Backend> {
    bufs: [Option<B::Buffer>; KINDS],
}

impl<B: Backend> LayerBuffers<B> {
    /// The buffer of `kind` (`InvalidArgument` for a kind this layer does not hold).
    pub(crate) fn get(&self, kind: BufferKind) -> Result<&B::Buffer> {
        self.bufs[kind.index()].as_ref().ok_or_else(|| absent(kind))
    }
    pub(crate) fn get_mut(&mut self, kind: BufferKind) -> Result<&mut B::Buffer> {
        self.bufs[kind.index()].as_mut().ok_or_else(|| absent(kind))
    }
}

fn absent(kind: BufferKind) -> Error {
    Error::InvalidArgument {
        what: "buffer kind",
        detail: format!("this layer holds no {} pool", kind.name()),
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
    /// The window pool's frames and the page → frame map (a spec with a window only).
    frames: Option<(usize, Arc<FrameMap>)>,
    layers: Vec<Mutex<LayerBuffers<B>>>,
    /// `[(layer * KINDS + kind) * num_pages + page]`, packed by [`pack`].
    landed: Vec<AtomicU64>,
}

impl<B: Backend> DevicePool<B> {
    /// Allocates the pool on `backend`: `num_pages` pages of every pool, but for a spec
    /// with a window, `frames.0` frames of the window pool, addressed through `frames.1`
    /// (the allocator's map; required then, refused otherwise).
    pub fn new(
        backend: &B,
        spec: CacheSpec,
        num_pages: usize,
        frames: Option<(usize, Arc<FrameMap>)>,
    ) -> Result<Self> {
        if spec.window().is_some() != frames.is_some() {
            return Err(Error::InvalidLayout(
                "a window pool needs frames, and only a window pool has them".into(),
            ));
        }
        let pages_of = |k| buffer_pages(&spec, num_pages, &frames, k);
        let layers = (0..spec.num_layers)
            .map(|l| {
                let mut bufs: [Option<B::Buffer>; KINDS] = Default::default();
                for k in spec.kinds(l) {
                    let bytes = spec
                        .layout(k)
                        .bytes_per_page()
                        .checked_mul(pages_of(k))
                        .ok_or_else(|| Error::InvalidLayout("pool size overflows".into()))?;
                    bufs[k.index()] = Some(backend.alloc(bytes)?);
                }
                Ok(Mutex::new(LayerBuffers { bufs }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DevicePool {
            spec,
            num_pages,
            frames,
            layers,
            landed: (0..spec.num_layers * KINDS * num_pages)
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

    /// Frames of the window pool (`None` without one).
    pub fn window_frames(&self) -> Option<usize> {
        self.frames.as_ref().map(|(n, _)| *n)
    }

    /// Where pages of `kind` sit in a layer's buffer (contiguous; the window pool's are
    /// its frames: address them with [`DevicePool::indices`]).
    pub fn region(&self, kind: BufferKind) -> PagedRegion {
        let pages = buffer_pages(&self.spec, self.num_pages, &self.frames, kind);
        PagedRegion::contiguous(self.spec.layout(kind), pages)
    }

    /// Where page `page`'s bytes of `kind` sit in the kind's buffer (its page index in
    /// [`DevicePool::region`]): the page itself, or for the window pool the frame it
    /// holds (`None`: its window rows were given back).
    pub fn index(&self, kind: BufferKind, page: u32) -> Option<u32> {
        match &self.frames {
            Some((_, map)) if self.spec.windowed(kind) => map.get(page),
            _ => Some(page),
        }
    }

    /// [`DevicePool::index`] of each page id of `ids` (`-1` for none, or a negative id).
    pub fn indices(&self, kind: BufferKind, ids: &[i32]) -> Vec<i32> {
        ids.iter()
            .map(|&id| {
                u32::try_from(id)
                    .ok()
                    .and_then(|p| self.index(kind, p))
                    .map_or(-1, |i| i as i32)
            })
            .collect()
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
                .get((layer * KINDS + kind.index()) * self.num_pages + page as usize)
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

    /// Records a whole page (every entry) landed for `generation`: a load or transfer.
    pub fn set_page_landed(&self, layer: usize, kind: BufferKind, page: u32, generation: u32) {
        let entries = self.spec.entries_per_page(kind) as u32;
        self.set_landed(layer, kind, page, generation, entries);
    }

    /// Marks `page` as holding nothing, in every layer and kind: a fresh allocation (its
    /// owner's stores or a copy will fill it).
    pub fn clear_landed(&self, page: u32) {
        for l in 0..self.spec.num_layers {
            for kind in self.spec.kinds(l) {
                if let Some(s) = self.slot(l, kind, page) {
                    s.store(0, Ordering::Release);
                }
            }
        }
    }

    /// Marks `page`'s bytes of `kind` as holding nothing in every layer (its window rows
    /// given back: nothing may certify them any more).
    pub fn clear_kind_landed(&self, page: u32, kind: BufferKind) {
        for l in 0..self.spec.num_layers {
            if let Some(s) = self.slot(l, kind, page) {
                s.store(0, Ordering::Release);
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

/// Pages in a layer's buffer of `kind`: the window pool's frames, else `num_pages`.
fn buffer_pages(
    spec: &CacheSpec,
    num_pages: usize,
    frames: &Option<(usize, Arc<FrameMap>)>,
    kind: BufferKind,
) -> usize {
    match frames {
        Some((n, _)) if spec.windowed(kind) => *n,
        _ => num_pages,
    }
}

/// Order of the host tier's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostLayout {
    /// Per layer: all pages of each kind it holds, kind after kind (like the device).
    LayerFirst,
    /// Per page: every layer's page of each kind it holds, contiguous (one transfer per
    /// page moves all layers and pools).
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

    /// Where pages of layer `layer`, kind `kind` sit in the host buffer (a kind the
    /// layer does not hold: an empty region).
    pub fn region(&self, layer: usize, kind: BufferKind) -> PagedRegion {
        let spec = &self.spec;
        let page_layout = spec.layout(kind);
        let bytes = |k: BufferKind| spec.layout(k).bytes_per_page();
        let layer_bytes = |l: usize| spec.kinds(l).map(bytes).sum::<usize>();
        let before_layer: usize = (0..layer.min(spec.num_layers)).map(layer_bytes).sum();
        let before_kind: usize = spec
            .kinds(layer)
            .take_while(|k| *k != kind)
            .map(bytes)
            .sum();
        let num_pages = if spec.has(layer, kind) {
            self.num_pages
        } else {
            0
        };
        match self.layout {
            HostLayout::LayerFirst => PagedRegion {
                layout: page_layout,
                offset: (before_layer + before_kind) * self.num_pages,
                stride: page_layout.bytes_per_page(),
                num_pages,
            },
            HostLayout::PageFirst => PagedRegion {
                layout: page_layout,
                offset: before_layer + before_kind,
                stride: spec.bytes_per_page_all_layers(),
                num_pages,
            },
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
        let dev = DevicePool::new(&b, spec(IndexKDtype::Bf16), 5, None).unwrap();
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
                for k in dev.spec().kinds(l).collect::<Vec<_>>() {
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
        let dev = DevicePool::new(&b, spec(IndexKDtype::Bf16), 2, None).unwrap();
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
