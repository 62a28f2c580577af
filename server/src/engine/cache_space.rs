//! The cache-backed KV space: [`KvSpace`] over a [`HiCache`] (radix prefix reuse on the
//! device pool, the host tier, pages received by PD transfers).
//!
//! - **Admission** ([`KvSpace::admit`]) first asks [`HiCache::room`] whether the device
//!   pages the request needs (its budget less its prefix already on the device) could be
//!   had now; only then it matches the prompt (all but its last token, whose logits must
//!   be computed) with [`HiCache::try_begin`] — device hits are mapped at once, host hits
//!   start a layer-wise load — and allocates the rest of the budget with
//!   [`HiCache::try_alloc`]. Nothing waits: without room the scheduler tries again after
//!   its next step (so the match is made with whatever the requests ahead committed
//!   meanwhile); a request whose room is only waiting for evictions' backups keeps its
//!   prefix (locked, loading) for that next try. A request with [`ReceivedPages`] adopts
//!   the cache request its pages were received under instead.
//! - **Steps** are `HiCache` steps: layer `l` is handed to the forward pass only through
//!   [`Step::wait_layer`] (bounded wait for every member's loads of that layer, then the
//!   layer's lock), stores go through generation-checked [`SlotRef`]s and every read
//!   through [`LayerGuard::views`] (landed stamps re-checked). The model takes layer `l`
//!   when it starts computing it, so layer `l + 1` keeps loading meanwhile.
//! - **Failures** are per request: a member whose load or transfer failed, timed out or
//!   whose pages did not land gives [`EngineError::SeqFailed`] naming it; the scheduler
//!   fails that request alone and reruns the step for the others (the forward pass is
//!   deterministic, so rewriting their rows is harmless). Nothing that did not land is
//!   ever read: the request is failed cleanly, not recomputed.
//! - **The end** of a request commits its full pages into the prefix tree (backed up to
//!   the host tier at once when write-through is on) and finishes it; an aborted or
//!   failed request is aborted in the cache (its pages quarantined while anything still
//!   pins them).
//!
//! Request ids: the space numbers its cache requests from a counter it shares with
//! [`CacheHandle`], so a PD receiver can open cache requests of its own (for
//! [`HiCache::inbound`]) that never collide with the engine's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use sparsekit_host::cache::{
    BufferKind, CacheSpec, CacheStats, HiCache, LayerGuard, PageRef, ReadExtent, RequestId,
    SlotRef, Step,
};
use sparsekit_host::{Backend, Error as HostError, IndexKLayout, KvLayout};

use crate::engine::kv::{KvSpace, KvStep, LayerCache, ReceivedPages, SeqId};
use crate::error::EngineError;
use crate::metrics::Metrics;

/// What a PD receiver (or a test) needs of a [`CacheKvSpace`] from outside the engine
/// thread: the cache itself (thread-safe: `begin`/`alloc`/`inbound`/`abort` from any
/// thread) and fresh request ids that never collide with the engine's.
#[derive(Debug)]
pub struct CacheHandle<B: Backend + 'static> {
    cache: Arc<HiCache<B>>,
    ids: Arc<AtomicU64>,
}

impl<B: Backend + 'static> Clone for CacheHandle<B> {
    fn clone(&self) -> Self {
        CacheHandle {
            cache: self.cache.clone(),
            ids: self.ids.clone(),
        }
    }
}

impl<B: Backend + 'static> CacheHandle<B> {
    /// The cache.
    pub fn cache(&self) -> &Arc<HiCache<B>> {
        &self.cache
    }

    /// A cache request id no other user of this space has or will have.
    pub fn next_request_id(&self) -> RequestId {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }
}

/// Switches of a [`CacheKvSpace`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSpaceOptions {
    /// Match prompts against the prefix tree and commit finished requests into it (off on
    /// a PD decode side, whose pages all arrive by transfer).
    pub prefix_reuse: bool,
}

impl Default for CacheSpaceOptions {
    fn default() -> Self {
        CacheSpaceOptions { prefix_reuse: true }
    }
}

/// One sequence's pages.
#[derive(Debug)]
struct SeqPages {
    req: RequestId,
    /// Every page in token order: the matched prefix (tree pages), then its own.
    refs: Vec<PageRef>,
    ids: Vec<i32>,
    /// `refs[own_from..]` are the sequence's own pages (writable).
    own_from: usize,
    /// Leading prompt tokens whose KV is in the pages at admission.
    cached_tokens: usize,
    /// The budget's pages are allocated (false: prefix matched, waiting for room).
    admitted: bool,
}

/// Counters of the space (atomics: the step and its layers count while borrowing it).
#[derive(Debug, Default)]
struct Counts {
    lookups: AtomicU64,
    device_hits: AtomicU64,
    host_hits: AtomicU64,
    /// Requests failed because a page they were about to read had not landed.
    not_landed: AtomicU64,
    /// Requests failed because a slot they read or wrote past was never written.
    unwritten: AtomicU64,
    /// Requests failed because their load or transfer failed or timed out.
    load_failed: AtomicU64,
    /// Commits the cache refused (the pages were released instead).
    commit_refused: AtomicU64,
}

/// What [`CacheKvSpace::publish`] last published (counters go out as deltas).
#[derive(Debug, Default)]
struct Published {
    stats: CacheStats,
    counts: [u64; 7],
}

/// The cache-backed KV space (see the module docs).
#[derive(Debug)]
pub struct CacheKvSpace<B: Backend + 'static> {
    cache: Arc<HiCache<B>>,
    ids: Arc<AtomicU64>,
    opts: CacheSpaceOptions,
    spec: CacheSpec,
    num_layers: usize,
    page_size: usize,
    seqs: HashMap<SeqId, SeqPages>,
    req_seq: HashMap<RequestId, SeqId>,
    /// Device page id → the reference of the sequence that owns it (own pages only: the
    /// only store targets).
    owner: Vec<Option<PageRef>>,
    counts: Counts,
    published: Published,
    // Scratch reused by every step.
    reqs: Vec<RequestId>,
    slots: Vec<SlotRef>,
}

impl<B: Backend + 'static> CacheKvSpace<B> {
    /// A space over `cache` (whose spec gives the layouts and layers).
    pub fn new(cache: Arc<HiCache<B>>, opts: CacheSpaceOptions) -> Self {
        let spec = *cache.spec();
        let pages = cache.device_pages();
        CacheKvSpace {
            ids: Arc::new(AtomicU64::new(1)),
            opts,
            spec,
            num_layers: spec.num_layers,
            page_size: spec.page_size(),
            seqs: HashMap::new(),
            req_seq: HashMap::new(),
            owner: vec![None; pages],
            counts: Counts::default(),
            published: Published::default(),
            reqs: Vec::new(),
            slots: Vec::new(),
            cache,
        }
    }

    /// The handle a PD receiver uses from other threads.
    pub fn handle(&self) -> CacheHandle<B> {
        CacheHandle {
            cache: self.cache.clone(),
            ids: self.ids.clone(),
        }
    }

    /// The cache.
    pub fn cache(&self) -> &Arc<HiCache<B>> {
        &self.cache
    }

    /// The cache request id of `seq` (admitted or waiting for room).
    pub fn request_of(&self, seq: SeqId) -> Option<RequestId> {
        self.seqs.get(&seq).map(|s| s.req)
    }

    fn set_owner(&mut self, pages: &[PageRef], on: bool) {
        for p in pages {
            if let Some(o) = self.owner.get_mut(p.id as usize) {
                *o = on.then_some(*p);
            }
        }
    }

    /// Matches `prompt` and locks the prefix for a new cache request of `want` pages in
    /// all — only when the device pages it needs could be had now (else `OutOfPages` and
    /// nothing begun: a request that waits must not freeze a prefix match made before the
    /// requests ahead of it committed theirs).
    fn begin(
        &mut self,
        prompt: &[u32],
        want: usize,
        frames: usize,
        reuse: bool,
    ) -> Result<SeqPages, EngineError> {
        let key: &[u32] = if self.opts.prefix_reuse && reuse {
            &prompt[..prompt.len().saturating_sub(1)]
        } else {
            &[]
        };
        let room = self.cache.room(key);
        let need = want.saturating_sub(room.device_pages);
        if need > room.available {
            return Err(EngineError::OutOfPages {
                wanted: need,
                free: room.available,
            });
        }
        // Window frames: the request's own (see `admit`) and one a page its loads bring.
        let frames = frames.saturating_sub(room.device_pages + room.host_pages) + room.host_pages;
        if let Some(free) = room.frames_available.filter(|&f| f < frames.min(need)) {
            return Err(EngineError::OutOfPages {
                wanted: frames.min(need),
                free,
            });
        }
        let req = self.ids.fetch_add(1, Ordering::Relaxed);
        let prefix = self.cache.try_begin(req, key).map_err(out_of_pages)?;
        let host = (prefix.loaded_pages + prefix.shared_in_flight_pages) as u64;
        let c = &self.counts;
        c.lookups
            .fetch_add((key.len() / self.page_size) as u64, Ordering::Relaxed);
        c.host_hits.fetch_add(host, Ordering::Relaxed);
        c.device_hits.fetch_add(
            (prefix.pages.len() as u64).saturating_sub(host),
            Ordering::Relaxed,
        );
        Ok(SeqPages {
            req,
            ids: prefix.pages.iter().map(|p| p.id as i32).collect(),
            own_from: prefix.pages.len(),
            refs: prefix.pages,
            cached_tokens: prefix.tokens,
            admitted: false,
        })
    }

    /// Takes over received pages (see [`ReceivedPages`]).
    fn adopt(&mut self, prompt: &[u32], r: &ReceivedPages) -> Result<SeqPages, EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if !self.cache.is_live(r.cache_request) {
            return bad(format!(
                "received pages of cache request {} that is not live",
                r.cache_request
            ));
        }
        if self.req_seq.contains_key(&r.cache_request) {
            return bad(format!(
                "cache request {} is already adopted",
                r.cache_request
            ));
        }
        if r.tokens > prompt.len() || r.pages.len() * self.page_size < r.tokens {
            return bad(format!(
                "{} received pages cannot hold {} of a {}-token prompt",
                r.pages.len(),
                r.tokens,
                prompt.len()
            ));
        }
        if let Err(e) = self.cache.check_received(r.cache_request, &r.pages) {
            return bad(format!("cannot adopt: {e}"));
        }
        if let Err(e) = self.cache.check_owned(r.cache_request, &r.extra) {
            return bad(format!("cannot adopt: {e}"));
        }
        let refs: Vec<PageRef> = r.pages.iter().chain(&r.extra).copied().collect();
        self.set_owner(&refs, true);
        Ok(SeqPages {
            req: r.cache_request,
            ids: refs.iter().map(|p| p.id as i32).collect(),
            refs,
            own_from: 0,
            cached_tokens: r.tokens,
            admitted: false,
        })
    }

    fn forget(&mut self, seq: SeqId) -> Option<SeqPages> {
        let s = self.seqs.remove(&seq)?;
        self.req_seq.remove(&s.req);
        let own = s.refs[s.own_from..].to_vec();
        self.set_owner(&own, false);
        Some(s)
    }
}

/// `OutOfPages` of the cache as the engine's (the scheduler retries those).
fn out_of_pages(e: HostError) -> EngineError {
    match e {
        HostError::OutOfPages { wanted, free, .. } => EngineError::OutOfPages { wanted, free },
        e => EngineError::Backend(e),
    }
}

/// A cache error of a step: a member's failure names its sequence (and is counted).
fn step_error(e: HostError, req_seq: &HashMap<RequestId, SeqId>, counts: &Counts) -> EngineError {
    match e {
        HostError::RequestFailed { request, cause } => {
            let counter = match *cause {
                HostError::NotLanded { .. } => &counts.not_landed,
                HostError::Unwritten { .. } => &counts.unwritten,
                _ => &counts.load_failed,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            EngineError::SeqFailed {
                seq: req_seq.get(&request).copied().unwrap_or(request),
                cause: *cause,
            }
        }
        e => EngineError::Backend(e),
    }
}

/// A forward step of a [`CacheKvSpace`]: a `HiCache` step over the sequences' requests.
#[derive(Debug)]
pub struct CacheStep<'a, B: Backend + 'static> {
    step: Step<'a, B>,
    spec: CacheSpec,
    owner: &'a [Option<PageRef>],
    page_size: usize,
    seqs: &'a HashMap<SeqId, SeqPages>,
    req_seq: &'a HashMap<RequestId, SeqId>,
    counts: &'a Counts,
    slots: &'a mut Vec<SlotRef>,
}

impl<B: Backend + 'static> KvStep<B> for CacheStep<'_, B> {
    type Layer<'a>
        = CacheLayer<'a, B>
    where
        Self: 'a;

    fn layer(&mut self, l: usize) -> Result<Self::Layer<'_>, EngineError> {
        let (req_seq, counts) = (self.req_seq, self.counts);
        let guard = self
            .step
            .wait_layer(l)
            .map_err(|e| step_error(e, req_seq, counts))?;
        Ok(CacheLayer {
            guard,
            spec: self.spec,
            owner: self.owner,
            page_size: self.page_size,
            seqs: self.seqs,
            req_seq,
            counts,
            slots: &mut *self.slots,
        })
    }
}

/// One layer of a [`CacheStep`]: the cache's [`LayerGuard`].
#[derive(Debug)]
pub struct CacheLayer<'a, B: Backend + 'static> {
    guard: LayerGuard<'a, B>,
    spec: CacheSpec,
    owner: &'a [Option<PageRef>],
    page_size: usize,
    seqs: &'a HashMap<SeqId, SeqPages>,
    req_seq: &'a HashMap<RequestId, SeqId>,
    counts: &'a Counts,
    slots: &'a mut Vec<SlotRef>,
}

impl<B: Backend + 'static> LayerCache<B> for CacheLayer<'_, B> {
    fn kv_layout(&self) -> KvLayout {
        self.spec.kv
    }

    fn index_k_layout(&self) -> IndexKLayout {
        self.spec.index_k
    }

    fn store(
        &mut self,
        _backend: &B,
        slots: &[i64],
        kv: &B::Buffer,
        index_k: &B::Buffer,
    ) -> Result<(), EngineError> {
        self.slot_refs(self.page_size, slots)?;
        let (req_seq, counts) = (self.req_seq, self.counts);
        self.guard
            .kv_store(self.slots, kv)
            .map_err(|e| step_error(e, req_seq, counts))?;
        self.guard
            .index_k_store(self.slots, index_k)
            .map_err(|e| step_error(e, req_seq, counts))
    }

    fn views(&self, reads: &[(SeqId, usize)]) -> Result<(&B::Buffer, &B::Buffer), EngineError> {
        let extents = self.extents(reads)?;
        self.guard
            .views_for(&extents)
            .map_err(|e| step_error(e, self.req_seq, self.counts))
    }

    fn spec(&self) -> CacheSpec {
        self.spec
    }

    fn store_kind(
        &mut self,
        _backend: &B,
        kind: BufferKind,
        slots: &[i64],
        rows: &B::Buffer,
    ) -> Result<(), EngineError> {
        self.slot_refs(self.spec.entries_per_page(kind), slots)?;
        let (req_seq, counts) = (self.req_seq, self.counts);
        self.guard
            .store_kind(kind, self.slots, rows)
            .map_err(|e| step_error(e, req_seq, counts))
    }

    fn view(&self, kind: BufferKind, reads: &[(SeqId, usize)]) -> Result<&B::Buffer, EngineError> {
        let extents = self.extents(reads)?;
        self.guard
            .view(kind, &extents)
            .map_err(|e| step_error(e, self.req_seq, self.counts))
    }

    fn buffer_pages(&self, kind: BufferKind, pages: &[i32]) -> Vec<i32> {
        self.guard.buffer_pages(kind, pages)
    }
}

impl<B: Backend + 'static> CacheLayer<'_, B> {
    /// `slots` (`page · per_page + offset` in a pool of `per_page` entries a page) as
    /// references to the owning sequences' pages, into `self.slots`.
    fn slot_refs(&mut self, per_page: usize, slots: &[i64]) -> Result<(), EngineError> {
        let ps = per_page.max(1) as i64;
        self.slots.clear();
        for &s in slots {
            let page = s.div_euclid(ps);
            let r = usize::try_from(page)
                .ok()
                .and_then(|p| self.owner.get(p).copied().flatten())
                .ok_or_else(|| {
                    EngineError::InvalidRequest(format!(
                        "slot {s} is in page {page}, which no sequence owns"
                    ))
                })?;
            self.slots.push(SlotRef {
                page: r,
                offset: s.rem_euclid(ps) as u32,
            });
        }
        Ok(())
    }

    /// The read extents of `(seq, tokens)` pairs.
    fn extents(&self, reads: &[(SeqId, usize)]) -> Result<Vec<ReadExtent<'_>>, EngineError> {
        let mut extents = Vec::with_capacity(reads.len());
        for &(seq, tokens) in reads {
            let s = self
                .seqs
                .get(&seq)
                .ok_or(EngineError::UnknownSequence(seq))?;
            extents.push(ReadExtent {
                request: s.req,
                pages: &s.refs,
                tokens,
            });
        }
        Ok(extents)
    }
}

impl<B: Backend + 'static> KvSpace<B> for CacheKvSpace<B> {
    type Step<'a>
        = CacheStep<'a, B>
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
        self.num_layers
    }

    fn capacity_pages(&self) -> usize {
        self.cache.device_pages()
    }

    fn free_pages(&self) -> usize {
        self.cache.stats().device_free
    }

    fn admit(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        total: usize,
        received: Option<&ReceivedPages>,
        reuse: bool,
    ) -> Result<usize, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        let want = total.div_ceil(self.page_size);
        if want > self.capacity_pages() {
            return Err(EngineError::TooLarge {
                wanted: want,
                capacity: self.capacity_pages(),
            });
        }
        // With a window pool: the frames it holds at most (its pages past the prompt give
        // theirs back as its tokens leave the window, to its later pages).
        let frames = self.spec.frames_needed(prompt.len(), total);
        if !self.seqs.contains_key(&seq) {
            let s = match received {
                Some(r) => self.adopt(prompt, r)?,
                None => self.begin(prompt, want, frames, reuse)?,
            };
            self.req_seq.insert(s.req, seq);
            self.seqs.insert(seq, s);
        }
        let Some(s) = self.seqs.get(&seq) else {
            return Err(EngineError::UnknownSequence(seq));
        };
        // Its own pages' frames (a cached prefix's pages hold theirs) never fit: refused.
        let own_frames = frames.saturating_sub(s.refs.len());
        if let Some(capacity) = self.cache.window_frames().filter(|&c| own_frames > c) {
            self.release(seq);
            return Err(EngineError::TooLarge {
                wanted: own_frames,
                capacity,
            });
        }
        if !s.admitted {
            let (req, need) = (s.req, want.saturating_sub(s.refs.len()));
            let framed = own_frames.min(need);
            match self.cache.try_alloc_framed(req, need, framed) {
                Ok(pages) => {
                    self.set_owner(&pages, true);
                    if let Some(s) = self.seqs.get_mut(&seq) {
                        s.ids.extend(pages.iter().map(|p| p.id as i32));
                        s.refs.extend(pages);
                        s.admitted = true;
                    }
                }
                Err(HostError::OutOfPages { free, .. }) => {
                    return Err(EngineError::OutOfPages { wanted: need, free })
                }
                Err(e) => {
                    self.release(seq);
                    return Err(EngineError::Backend(e));
                }
            }
        }
        Ok(self.seqs.get(&seq).map_or(0, |s| s.cached_tokens))
    }

    fn pages(&self, seq: SeqId) -> Result<&[i32], EngineError> {
        self.seqs
            .get(&seq)
            .filter(|s| s.admitted)
            .map(|s| s.ids.as_slice())
            .ok_or(EngineError::UnknownSequence(seq))
    }

    fn step(&mut self, seqs: &[SeqId]) -> Result<Self::Step<'_>, EngineError> {
        let CacheKvSpace {
            cache,
            seqs: all,
            req_seq,
            owner,
            counts,
            reqs,
            slots,
            page_size,
            spec,
            ..
        } = self;
        reqs.clear();
        for s in seqs {
            match all.get(s) {
                Some(p) if p.admitted => reqs.push(p.req),
                _ => return Err(EngineError::UnknownSequence(*s)),
            }
        }
        let step = cache
            .step(reqs)
            .map_err(|e| step_error(e, req_seq, counts))?;
        Ok(CacheStep {
            step,
            spec: *spec,
            owner,
            page_size: *page_size,
            seqs: all,
            req_seq,
            counts,
            slots,
        })
    }

    fn discard_prefix(&mut self, seq: SeqId) -> usize {
        let Some(s) = self.seqs.get(&seq) else {
            return 0;
        };
        match self.cache.discard_prefix(s.req) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(seq, error = %e, "cannot discard a prefix");
                0
            }
        }
    }

    fn commit(&mut self, seq: SeqId, tokens: &[u32], computed: usize) -> usize {
        let Some(s) = self.forget(seq) else {
            return 0;
        };
        let before = self.cache.stats().device_free;
        if self.opts.prefix_reuse && s.admitted {
            let computed = computed.min(tokens.len());
            if let Err(e) = self.cache.commit(s.req, &tokens[..computed], &s.refs) {
                self.counts.commit_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(seq, error = %e, "the cache refused a commit; pages released");
            }
        }
        if self.cache.finish(s.req).is_err() {
            let _ = self.cache.abort(s.req);
        }
        self.cache.stats().device_free.saturating_sub(before)
    }

    fn commit_held(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        computed: usize,
    ) -> Option<ReceivedPages> {
        let s = self.seqs.get(&seq)?;
        if !(self.opts.prefix_reuse && s.admitted) {
            self.commit(seq, tokens, computed);
            return None;
        }
        let req = s.req;
        let computed = computed.min(tokens.len());
        let s = self.forget(seq)?;
        match self.cache.commit(req, &tokens[..computed], &s.refs) {
            Ok(()) => {
                // The request itself is what it holds: it locks the committed path (its
                // full pages, which the tree now owns) and still owns a partly filled
                // last page, which the tree does not take. Its pages past the computed
                // tokens are freed when the holder ends it.
                let n = computed.div_ceil(self.page_size);
                Some(ReceivedPages {
                    cache_request: req,
                    pages: s.refs[..n.min(s.refs.len())].to_vec(),
                    extra: Vec::new(),
                    tokens: computed,
                })
            }
            Err(e) => {
                self.counts.commit_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(seq, error = %e, "the cache refused a commit; pages released");
                if self.cache.finish(req).is_err() {
                    let _ = self.cache.abort(req);
                }
                None
            }
        }
    }

    fn release(&mut self, seq: SeqId) -> usize {
        let Some(s) = self.forget(seq) else {
            return 0;
        };
        let own = s.refs.len() - s.own_from;
        let _ = self.cache.abort(s.req);
        own
    }

    fn release_window(&mut self, seq: SeqId, from: usize, tokens: usize) -> usize {
        let Some(s) = self.seqs.get(&seq) else {
            return 0;
        };
        let from = from.div_ceil(self.page_size);
        match self.cache.release_window(s.req, &s.refs, from, tokens) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(seq, error = %e, "cannot release window pages");
                0
            }
        }
    }

    fn release_received(&mut self, received: &ReceivedPages) {
        if !self.req_seq.contains_key(&received.cache_request) {
            let _ = self.cache.abort(received.cache_request);
        }
    }

    fn leak_check(&self) -> Result<(), EngineError> {
        let s = self.cache.leak_check()?;
        let own: usize = self.seqs.values().map(|s| s.refs.len() - s.own_from).sum();
        if s.device_in_use > own {
            return Err(EngineError::Backend(HostError::Leak(format!(
                "{} device pages owned by cache requests, {own} by the engine's sequences",
                s.device_in_use
            ))));
        }
        Ok(())
    }

    fn leaked_pages(&self) -> usize {
        let s = self.cache.stats();
        let own: usize = self.seqs.values().map(|s| s.refs.len() - s.own_from).sum();
        s.device_in_use.saturating_sub(own)
    }

    fn publish(&mut self, m: &Metrics) {
        let s = self.cache.stats();
        for (pool, free, in_use, cached, quarantined) in [
            (
                "device",
                s.device_free,
                s.device_in_use,
                s.device_cached,
                s.device_quarantined,
            ),
            ("host", s.host_free, 0, s.host_cached, s.host_quarantined),
        ] {
            if pool == "host" && s.host_pages == 0 {
                continue;
            }
            m.pages(pool, "free", free);
            m.pages(pool, "in_use", in_use);
            m.pages(pool, "cached", cached);
            m.pages(pool, "quarantined", quarantined);
            m.quarantined(pool, quarantined);
        }
        let p = &self.published.stats;
        let d = |now: u64, then: u64| now.saturating_sub(then);
        if s.host_pages > 0 {
            m.loads("ok", d(s.loads, p.loads));
            m.loads("failed", d(s.load_failures, p.load_failures));
            m.loads("cancelled", d(s.cancelled_loads, p.cancelled_loads));
            m.backups("ok", d(s.backups, p.backups));
            m.backups("failed", d(s.backup_failures, p.backup_failures));
            m.checksum_failures(
                "host_load",
                d(s.host_integrity_failures, p.host_integrity_failures),
            );
        }
        m.refused(
            "stale_write",
            d(s.stale_writes_refused, p.stale_writes_refused),
        );
        let c = &self.counts;
        let now = [
            c.lookups.load(Ordering::Relaxed),
            c.device_hits.load(Ordering::Relaxed),
            c.host_hits.load(Ordering::Relaxed),
            c.not_landed.load(Ordering::Relaxed),
            c.load_failed.load(Ordering::Relaxed),
            c.commit_refused.load(Ordering::Relaxed),
            c.unwritten.load(Ordering::Relaxed),
        ];
        let was = self.published.counts;
        if self.opts.prefix_reuse {
            m.cache_lookups(d(now[0], was[0]));
            m.cache_hits("device", d(now[1], was[1]));
            if s.host_pages > 0 {
                m.cache_hits("host", d(now[2], was[2]));
            }
        }
        m.refused("not_landed", d(now[3], was[3]));
        m.refused("load_failed", d(now[4], was[4]));
        m.refused("commit", d(now[5], was[5]));
        m.refused("unwritten", d(now[6], was[6]));
        m.detection("landing_wait", d(s.landing_waits, p.landing_waits));
        self.published = Published {
            stats: s,
            counts: now,
        };
    }
}
