//! Forward steps: the only way to a layer's bytes.
//!
//! A [`Step`] covers a batch of live requests. Opening it pins every device page they
//! read or write (their prefix and their own pages) until it is dropped, so an abort from
//! another thread mid-step only quarantines them. Per layer, [`Step::wait`] waits
//! (bounded) for every member's loads and inbound transfers of that layer and mints a
//! [`ReadyToken`]; [`Step::layer`] exchanges it for a [`LayerGuard`]: the layer's one lock,
//! both views (KV and index-K) together, and stores into the members' own pages by
//! generation-checked [`SlotRef`]s. The guard borrows the step mutably, so a step holds at
//! most one layer at a time and cannot wait for a fence while holding one.
//!
//! Behind the fences, the guard checks each member page's landed stamp for the layer: the
//! page's bytes must have been written for the page's current generation (by the load or
//! transfer that filled it, or by its owner). A read that got past a fence it should have
//! waited for, or a stale write that landed anyway, is refused with
//! [`Error::NotLanded`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::alloc::PageRef;
use super::faults::Fault;
use super::fence::{Fence, ReadyToken};
use super::hicache::HiCache;
use super::pool::{BufferKind, LayerBuffers};
use super::state::invalid;
use super::types::RequestId;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::sync::{AtomicBool, MutexGuard, Ordering};

/// One token slot: `offset` (tokens, `< page_size`) inside `page`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotRef {
    pub page: PageRef,
    pub offset: u32,
}

/// What a reader reads of one request: the first `tokens` token slots of its `pages`
/// (in token order: `pages[i]` holds tokens `i * page_size..`).
#[derive(Clone, Copy, Debug)]
pub struct ReadExtent<'a> {
    pub request: RequestId,
    pub pages: &'a [PageRef],
    pub tokens: usize,
}

#[derive(Debug)]
pub(super) struct Member {
    pub(super) req: RequestId,
    fences: Vec<Arc<Fence>>,
    /// Pages whose bytes must have landed for their generation: the prefix and the pages
    /// inbound transfers write.
    pub(super) landed: Vec<PageRef>,
    /// Its other own pages: written by its own stores, so they may not be written yet in a
    /// layer, but never for another generation.
    pub(super) own: Vec<PageRef>,
    aborted: Arc<AtomicBool>,
}

/// A forward step over a batch of requests (see the module docs).
#[derive(Debug)]
pub struct Step<'c, B: Backend + 'static> {
    pub(super) cache: &'c HiCache<B>,
    id: u64,
    pub(super) members: Vec<Member>,
    /// Own pages of the members: the only store targets.
    pub(super) writable: HashMap<u32, PageRef>,
}

/// Under the `loads-trail-readers` and `index-k-after-publish` faults: counts a step
/// reaching `layer` (`guard`: holding the layer's lock) and wakes the loads waiting for
/// one. Counts per layer: `[layer * 2]` every reach, `[layer * 2 + 1]` guards only.
fn note_read<B: Backend>(sh: &super::state::Shared<B>, layer: usize, guard: bool) {
    if sh.fault(Fault::LoadsTrailReaders) || sh.fault(Fault::IndexKAfterPublish) {
        let mut reads = sh.reads.lock();
        if let Some(r) = reads.get_mut(layer * 2) {
            *r += 1;
        }
        if guard {
            if let Some(r) = reads.get_mut(layer * 2 + 1) {
                *r += 1;
            }
        }
        sh.reads_cv.notify_all();
    }
}

pub(super) fn failed(req: RequestId, cause: Error) -> Error {
    Error::RequestFailed {
        request: req,
        cause: Box::new(cause),
    }
}

impl<'c, B: Backend + 'static> Step<'c, B> {
    pub(crate) fn open(cache: &'c HiCache<B>, reqs: &[RequestId]) -> Result<Self> {
        let sh = &*cache.shared;
        for (i, r) in reqs.iter().enumerate() {
            if reqs[..i].contains(r) {
                return Err(invalid("step", format!("request {r} listed twice")));
            }
        }
        let mut st = sh.state.lock();
        let st = &mut *st;
        let mut members = Vec::with_capacity(reqs.len());
        let mut writable = HashMap::new();
        for &req in reqs {
            let r = st
                .requests
                .get(&req)
                .ok_or_else(|| invalid("step", format!("request {req} is not live")))?;
            if let Some(e) = r.fences.iter().find_map(|f| f.failure()) {
                return Err(failed(req, e));
            }
            let mut landed = Vec::with_capacity(r.path.len() + r.received.len());
            for (i, &n) in r.path.iter().enumerate() {
                match st.tree.get(n).and_then(|n| n.device) {
                    Some(d) => landed.push(d.page),
                    None => {
                        return Err(failed(
                            req,
                            Error::Cancelled(format!("prefix page {i} left the device tier")),
                        ))
                    }
                }
            }
            landed.extend(r.own.iter().filter(|p| r.received.contains(p)));
            let own: Vec<PageRef> = r
                .own
                .iter()
                .filter(|p| !r.received.contains(p))
                .copied()
                .collect();
            for p in &r.own {
                writable.insert(p.id, *p);
            }
            members.push(Member {
                req,
                fences: r.fences.clone(),
                landed,
                own,
                aborted: r.aborted.clone(),
            });
        }
        // Pin everything (all current: checked above under the same lock).
        let mut pinned = Vec::new();
        for m in &members {
            for &p in m.landed.iter().chain(&m.own) {
                if let Err(e) = st.device.pin(p) {
                    for &id in &pinned {
                        st.device.unpin(id);
                    }
                    return Err(failed(m.req, e));
                }
                pinned.push(p.id);
            }
        }
        for m in &members {
            if let Some(r) = st.requests.get_mut(&m.req) {
                r.users += 1;
            }
        }
        let id = sh.next_id();
        st.steps.insert(id, pinned);
        Ok(Step {
            cache,
            id,
            members,
            writable,
        })
    }

    /// The requests of the step, in order.
    pub fn requests(&self) -> Vec<RequestId> {
        self.members.iter().map(|m| m.req).collect()
    }

    /// Whether `req` was aborted since the step opened (its pages stay pinned, readable
    /// and writable but quarantined until the step ends; its results are to be dropped).
    pub fn is_aborted(&self, req: RequestId) -> bool {
        self.members
            .iter()
            .any(|m| m.req == req && m.aborted.load(Ordering::Acquire))
    }

    fn live_members(&self) -> impl Iterator<Item = &Member> {
        self.members
            .iter()
            .filter(|m| !m.aborted.load(Ordering::Acquire))
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        let n = self.cache.shared.num_layers();
        if layer >= n {
            return Err(invalid("layer", format!("{layer} of {n}")));
        }
        Ok(())
    }

    /// Whether `layer` has landed for every member, without blocking; a member whose load
    /// failed gives `Err(RequestFailed)`.
    pub fn ready(&self, layer: usize) -> Result<bool> {
        self.check_layer(layer)?;
        let mut all = true;
        for m in self.live_members() {
            for f in &m.fences {
                match f.poll(layer) {
                    Some(Ok(())) => {}
                    Some(Err(e)) => return Err(failed(m.req, e)),
                    None => all = false,
                }
            }
        }
        Ok(all)
    }

    /// Waits (bounded by the cache's `wait_timeout`) until `layer` landed for every
    /// member and mints the token for it. A member whose load or transfer failed, or
    /// timed out, gives `Err(RequestFailed { request, cause })`: drop it and open a new
    /// step. (Members aborted meanwhile are skipped.)
    pub fn wait(&self, layer: usize) -> Result<ReadyToken> {
        self.check_layer(layer)?;
        let sh = &*self.cache.shared;
        if !sh.fault(Fault::SkipIndexWait) {
            // About to wait for the layer: a load trailing readers may go now.
            note_read(sh, layer, false);
            let started = Instant::now();
            let deadline = sh.deadline();
            for m in self.live_members() {
                for f in &m.fences {
                    if f.poll(layer).is_none() && crate::sync::held_layers() > 0 {
                        return Err(invalid(
                            "step wait",
                            "this thread holds a layer guard: drop it before waiting for a load",
                        ));
                    }
                    f.wait(layer, deadline, started)
                        .map_err(|e| failed(m.req, e))?;
                }
            }
        }
        Ok(ReadyToken {
            cache: sh.id,
            step: self.id,
            layer,
        })
    }

    /// The guard of the token's layer (waits, bounded, for the layer's lock). The token
    /// must come from this step.
    ///
    /// Behind the fences, the guard checks every member page's landed stamps, per kind. A
    /// page whose bytes of a kind have not landed yet although its fence let the reader
    /// through (a copy that published its layer too early, a skipped wait) is waited for:
    /// the guard releases the layer, waits (bounded by the cache's wait bound) until the
    /// copy stamps it or fails, and takes the layer again — counted in
    /// [`CacheStats::landing_waits`](super::CacheStats). A page holding bytes of another
    /// generation (a stale write that landed) fails its request at once
    /// ([`Error::NotLanded`] inside `RequestFailed`), as does a wait that runs out.
    pub fn layer(&mut self, token: ReadyToken) -> Result<LayerGuard<'_, B>> {
        let sh = &*self.cache.shared;
        if token.cache != sh.id || token.step != self.id {
            return Err(invalid("ready token", "minted by another step or cache"));
        }
        let layer = token.layer;
        // A thread already holding a layer (of another step) only tries: waiting for a
        // second layer could close a cycle with another thread doing the reverse.
        let deadline = if crate::sync::held_layers() > 0 {
            Instant::now()
        } else {
            sh.deadline()
        };
        let mut waited = false;
        loop {
            let mut bufs = sh.device.lock(layer, deadline)?;
            crate::sync::add_held_layers(1);
            if sh.fault(Fault::SkipIndexWait) {
                if let Err(e) = self.poison_unlanded(&mut bufs, layer) {
                    crate::sync::add_held_layers(-1);
                    return Err(e);
                }
            }
            // Holding the layer: a load trailing readers may go now (it will wait for the
            // lock).
            note_read(sh, layer, true);
            let pending = match self.landed_state(layer) {
                Ok(p) => p,
                Err(e) => {
                    crate::sync::add_held_layers(-1);
                    return Err(e);
                }
            };
            let Some(pending) = pending else {
                return Ok(LayerGuard {
                    step: self,
                    bufs,
                    layer,
                });
            };
            drop(bufs);
            crate::sync::add_held_layers(-1);
            if !waited {
                waited = true;
                sh.state.lock().stats.landing_waits += 1;
            }
            self.wait_landed(layer, deadline, pending)?;
        }
    }

    /// Whether every live member's pages of `layer` can be read, per kind (see
    /// [`Step::layer`]): `Ok(None)` yes; `Ok(Some(e))` a prefix or received page has
    /// nothing landed for its generation yet (a copy may still land it; `e` is the
    /// request's `NotLanded`); `Err(e)` a page holds bytes of another generation. Always
    /// `Ok(None)` under the `no-landed-check` fault.
    fn landed_state(&self, layer: usize) -> Result<Option<Error>> {
        let sh = &*self.cache.shared;
        if sh.fault(Fault::NoLandedCheck) {
            return Ok(None);
        }
        let mut pending = None;
        for m in self.live_members() {
            let strict = m.landed.iter().map(|p| (p, false));
            for (p, may_be_empty) in strict.chain(m.own.iter().map(|p| (p, true))) {
                for kind in sh.device.spec().kinds(layer) {
                    if sh.device.index(kind, p.id).is_none() {
                        // Window rows given back: nothing reads them (the reads' checks
                        // require the window's pages present).
                        continue;
                    }
                    let stamp = sh.device.landed(layer, kind, p.id).map(|l| l.generation);
                    if stamp == Some(p.generation) || (may_be_empty && stamp.is_none()) {
                        continue;
                    }
                    let e = failed(
                        m.req,
                        Error::NotLanded {
                            page: p.id,
                            layer,
                            kind: kind.name(),
                            generation: p.generation,
                            stamp,
                        },
                    );
                    if stamp.is_some() {
                        return Err(e);
                    }
                    pending.get_or_insert(e);
                }
            }
        }
        Ok(pending)
    }

    /// Waits (until `deadline`, never while this thread holds a layer) for every member
    /// page of `layer` to land, or for a member's load or transfer to fail (its error).
    /// Runs out with `pending`.
    fn wait_landed(&self, layer: usize, deadline: Instant, pending: Error) -> Result<()> {
        let sh = &*self.cache.shared;
        if crate::sync::held_layers() > 0 {
            return Err(pending);
        }
        let mut g = sh.landed.lock();
        loop {
            for m in self.live_members() {
                for f in &m.fences {
                    if let Some(Err(e)) = f.poll(layer) {
                        return Err(failed(m.req, e));
                    }
                }
            }
            if self.landed_state(layer)?.is_none() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(pending);
            }
            // Stamping wakes this; the slice bounds how late a failure is seen.
            let slice = now + std::time::Duration::from_millis(20);
            sh.landed_cv.wait_until(&mut g, slice.min(deadline));
        }
    }

    /// Under the `skip-index-wait` fault: the bytes of a page whose load has not landed are
    /// undefined; this makes them so (a fixed pattern, finite in every dtype) instead of
    /// leaving what the page's previous owner wrote, which may by chance be the same
    /// bytes — so a read that skipped the wait reads wrong bytes every time.
    fn poison_unlanded(&self, bufs: &mut LayerBuffers<B>, layer: usize) -> Result<()> {
        let sh = &*self.cache.shared;
        for kind in sh.device.spec().kinds(layer).collect::<Vec<_>>() {
            let mut ids: Vec<i32> = self
                .live_members()
                .flat_map(|m| m.landed.iter())
                .filter(|p| {
                    sh.device.landed(layer, kind, p.id).map(|l| l.generation) != Some(p.generation)
                })
                .map(|p| p.id as i32)
                .collect();
            // Members sharing a prefix share its pages: each page once.
            ids.sort_unstable();
            ids.dedup();
            let mut ids = sh.device.indices(kind, &ids);
            ids.retain(|&i| i >= 0);
            let region = sh.device.region(kind);
            super::io::poison_pages(&*sh.backend, region, bufs.get_mut(kind)?, &ids)?;
        }
        Ok(())
    }

    /// [`Step::wait`] then [`Step::layer`].
    pub fn wait_layer(&mut self, layer: usize) -> Result<LayerGuard<'_, B>> {
        let t = self.wait(layer)?;
        self.layer(t)
    }
}

impl<B: Backend + 'static> Drop for Step<'_, B> {
    fn drop(&mut self) {
        let sh = &*self.cache.shared;
        let mut st = sh.state.lock();
        if let Some(ids) = st.steps.remove(&self.id) {
            for id in ids {
                st.device.unpin(id);
            }
        }
        for m in &self.members {
            if let Some(r) = st.requests.get_mut(&m.req) {
                if Arc::ptr_eq(&r.aborted, &m.aborted) {
                    r.users = r.users.saturating_sub(1);
                }
            }
        }
        drop(st);
        sh.space_cv.notify_all();
    }
}

/// One layer of a step: its lock (both buffer kinds), its views, and stores into the
/// members' own pages. While a thread holds one, the cache does not let it block on
/// anything the io worker may need the layer for: waiting for a load or for device room
/// returns an error at once instead.
#[derive(Debug)]
pub struct LayerGuard<'s, B: Backend + 'static> {
    pub(super) step: &'s Step<'s, B>,
    pub(super) bufs: MutexGuard<'s, LayerBuffers<B>>,
    pub(super) layer: usize,
}

impl<B: Backend + 'static> Drop for LayerGuard<'_, B> {
    fn drop(&mut self) {
        crate::sync::add_held_layers(-1);
    }
}

impl<B: Backend + 'static> LayerGuard<'_, B> {
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// See [`Step::is_aborted`].
    pub fn is_aborted(&self, req: RequestId) -> bool {
        self.step.is_aborted(req)
    }

    /// Request `req` fails: page `p`'s `kind` bytes of this layer are stamped `stamp`, not
    /// its generation.
    fn not_landed(
        &self,
        req: RequestId,
        p: &PageRef,
        kind: BufferKind,
        stamp: Option<u32>,
    ) -> Error {
        failed(
            req,
            Error::NotLanded {
                page: p.id,
                layer: self.layer,
                kind: kind.name(),
                generation: p.generation,
                stamp,
            },
        )
    }

    /// The generation `p`'s `kind` bytes of this layer were last written for.
    fn stamp(&self, p: &PageRef, kind: BufferKind) -> Option<u32> {
        let sh = &*self.step.cache.shared;
        sh.device
            .landed(self.layer, kind, p.id)
            .map(|l| l.generation)
    }

    /// The landed-stamp check, per buffer kind, for every (non-aborted) member: its prefix
    /// and received pages were last written for their current generation in this layer;
    /// its other own pages were not written yet or written for their generation.
    fn verify_landed(&self) -> Result<()> {
        match self.step.landed_state(self.layer)? {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// Checks that `pages`, holding the raw tokens `0..tokens` in order (`pages[i]` holds
    /// tokens `i * page_size..`), may be read out of this layer: each is a page of a live
    /// member of the step (its prefix, received or own pages, at their current
    /// generation); in every pool of the layer, each page holding at least one complete
    /// entry of those tokens was written for its generation (the landed stamp) with at
    /// least those entries (a partly filled last page of a coarse pool may hold none; not
    /// checked under the `no-landed-check` fault). What a caller copying pages out of
    /// [`LayerGuard::views`] by id (a PD sender) must check first.
    pub fn check_pages(&self, pages: &[PageRef], tokens: usize) -> Result<()> {
        let sh = &*self.step.cache.shared;
        let spec = sh.device.spec();
        let ps = spec.page_size();
        if tokens.div_ceil(ps) != pages.len() {
            return Err(invalid(
                "pages",
                format!("{} pages do not hold exactly {tokens} tokens", pages.len()),
            ));
        }
        for (i, p) in pages.iter().enumerate() {
            let member = self
                .step
                .live_members()
                .find(|m| m.landed.contains(p) || m.own.contains(p));
            let Some(m) = member else {
                return Err(invalid(
                    "pages",
                    format!("{p:?} is not a page of this step's live requests"),
                ));
            };
            if sh.fault(Fault::NoLandedCheck) {
                continue;
            }
            let in_page = (tokens - i * ps).min(ps);
            for kind in spec.kinds(self.layer) {
                let need = (in_page / spec.tokens_per_entry(kind)) as u32;
                if need == 0 || self.window_gone(m.req, p, kind, i, tokens)? {
                    continue;
                }
                let stamp = self.stamp(p, kind);
                if stamp != Some(p.generation) {
                    return Err(self.not_landed(m.req, p, kind, stamp));
                }
                self.check_filled(m.req, p, kind, need)?;
            }
        }
        Ok(())
    }

    /// Whether page `p` (page `i` of a sequence of `tokens` raw tokens) gave its rows of
    /// `kind` back: then nothing of them is read or checked. `Unwritten` (as
    /// `RequestFailed` of `req`) when they are gone from a page a query after those
    /// tokens still reads ([`super::CacheSpec::window_pages`]).
    fn window_gone(
        &self,
        req: RequestId,
        p: &PageRef,
        kind: BufferKind,
        i: usize,
        tokens: usize,
    ) -> Result<bool> {
        let sh = &*self.step.cache.shared;
        if sh.device.index(kind, p.id).is_some() {
            return Ok(false);
        }
        if sh.device.spec().window_pages(tokens).contains(&i) {
            return Err(self.unwritten(req, p, kind, 0));
        }
        Ok(true)
    }

    /// `Unwritten` (as `RequestFailed` of `req`): page `p` holds only `filled` entries of
    /// `kind` in this layer.
    fn unwritten(&self, req: RequestId, p: &PageRef, kind: BufferKind, filled: u32) -> Error {
        failed(
            req,
            Error::Unwritten {
                page: p.id,
                layer: self.layer,
                kind: kind.name(),
                slot: filled,
                filled,
            },
        )
    }

    /// `Unwritten` (as `RequestFailed` of `req`) unless page `p` holds at least `need`
    /// written entries of `kind` in this layer.
    fn check_filled(&self, req: RequestId, p: &PageRef, kind: BufferKind, need: u32) -> Result<()> {
        let filled = self.step.cache.shared.device.filled(self.layer, kind, *p);
        if filled < need {
            return Err(self.unwritten(req, p, kind, filled));
        }
        Ok(())
    }

    /// Checks that each read extent covers only written slots: the first `tokens` slots of
    /// the request's `pages` (in token order: `pages[i]` holds tokens `i * page_size..`)
    /// hold bytes written for each page's generation in this layer, in both kinds (not
    /// checked under the `no-landed-check` fault). Every page must be one of the
    /// request's (prefix, received or own) and the request a live member of the step.
    /// Checks that every slot `reads` names was written in this layer, in the pools of
    /// `only` (every pool of the layer when `None`).
    fn verify_extents(&self, reads: &[ReadExtent<'_>], only: Option<BufferKind>) -> Result<()> {
        let sh = &*self.step.cache.shared;
        let ps = sh.device.spec().page_size();
        for r in reads {
            let Some(m) = self.step.members.iter().find(|m| m.req == r.request) else {
                return Err(invalid(
                    "read extents",
                    format!("request {} is not in this step", r.request),
                ));
            };
            if m.aborted.load(Ordering::Acquire) {
                continue;
            }
            let need_pages = r.tokens.div_ceil(ps);
            if need_pages > r.pages.len() {
                return Err(invalid(
                    "read extents",
                    format!(
                        "request {}: {} pages cannot hold {} tokens",
                        r.request,
                        r.pages.len(),
                        r.tokens
                    ),
                ));
            }
            for (i, p) in r.pages[..need_pages].iter().enumerate() {
                if !m.landed.contains(p) && !m.own.contains(p) {
                    return Err(invalid(
                        "read extents",
                        format!("{p:?} is not a page of request {}", r.request),
                    ));
                }
                if sh.fault(Fault::NoLandedCheck) {
                    continue;
                }
                // Raw tokens of this page read; of a pool of coarser entries, the
                // complete entries among them.
                let in_page = (r.tokens - i * ps).min(ps);
                let spec = sh.device.spec();
                for kind in spec
                    .kinds(self.layer)
                    .filter(|k| only.is_none_or(|o| o == *k))
                {
                    if self.window_gone(m.req, p, kind, i, r.tokens)? {
                        continue;
                    }
                    let need = (in_page / spec.tokens_per_entry(kind)) as u32;
                    self.check_filled(m.req, p, kind, need)?;
                }
            }
        }
        Ok(())
    }

    /// Both views of the layer: `(kv, index_k)`, whole buffers in the device regions'
    /// geometry ([`HiCache::device_region`]). Re-checks the landed stamps (every member
    /// page of both kinds written for its generation, or an own page not written yet);
    /// says nothing about which slots were written: readers of token slots use
    /// [`LayerGuard::views_for`].
    pub fn views(&self) -> Result<(&B::Buffer, &B::Buffer)> {
        self.verify_landed()?;
        Ok((
            self.bufs.get(BufferKind::Kv)?,
            self.bufs.get(BufferKind::IndexK)?,
        ))
    }

    /// The view of one pool of the layer (`InvalidArgument` for a kind the layer does not
    /// hold), the landed stamps and, when `reads` names any, the written entries of this
    /// pool re-checked (as [`LayerGuard::views_for`]; the layer's other pools may still be
    /// being written by the step, e.g. a V4 compressor reading its state rows before it
    /// stores the entries they make).
    pub fn view(&self, kind: BufferKind, reads: &[ReadExtent<'_>]) -> Result<&B::Buffer> {
        self.verify_landed()?;
        self.verify_extents(reads, Some(kind))?;
        self.bufs.get(kind)
    }

    /// [`LayerGuard::views`] for a reader of the token slots `reads` names: also refuses
    /// ([`Error::Unwritten`], as `RequestFailed` of that request) a read of a slot that was
    /// never written for its page's generation in this layer, in either kind.
    pub fn views_for(&self, reads: &[ReadExtent<'_>]) -> Result<(&B::Buffer, &B::Buffer)> {
        self.verify_landed()?;
        self.verify_extents(reads, None)?;
        Ok((
            self.bufs.get(BufferKind::Kv)?,
            self.bufs.get(BufferKind::IndexK)?,
        ))
    }

    /// Where pages `pages` (page ids; `-1` stays `-1`) sit in this layer's buffer of
    /// `kind` ([`HiCache::device_region`]'s page indices): the ids themselves, but for a
    /// window pool the frames (`-1` for a page whose window rows were given back). What a
    /// reader builds the slot indices of a window pool's view from.
    pub fn buffer_pages(&self, kind: BufferKind, pages: &[i32]) -> Vec<i32> {
        self.step.cache.shared.device.indices(kind, pages)
    }

    /// The KV view (see [`LayerGuard::views`]).
    pub fn kv(&self) -> Result<&B::Buffer> {
        self.views().map(|v| v.0)
    }

    /// The index-K view (see [`LayerGuard::views`]).
    pub fn index_k(&self) -> Result<&B::Buffer> {
        self.views().map(|v| v.1)
    }
}
