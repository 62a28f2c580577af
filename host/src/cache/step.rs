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
use super::hicache::{invalid, HiCache, RequestId};
use super::pool::{BufferKind, LayerBuffers};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ops::{CopyPages, IndexKStore, KvStore, PagedRegion};
use crate::sync::{AtomicBool, MutexGuard, Ordering};

/// One token slot: `offset` (tokens, `< page_size`) inside `page`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotRef {
    pub page: PageRef,
    pub offset: u32,
}

#[derive(Debug)]
struct Member {
    req: RequestId,
    fences: Vec<Arc<Fence>>,
    /// Pages whose bytes must have landed for their generation: the prefix and the pages
    /// inbound transfers write.
    landed: Vec<PageRef>,
    /// Its other own pages: written by its own stores, so they may not be written yet in a
    /// layer, but never for another generation.
    own: Vec<PageRef>,
    aborted: Arc<AtomicBool>,
}

/// A forward step over a batch of requests (see the module docs).
#[derive(Debug)]
pub struct Step<'c, B: Backend + 'static> {
    cache: &'c HiCache<B>,
    id: u64,
    members: Vec<Member>,
    /// Own pages of the members: the only store targets.
    writable: HashMap<u32, PageRef>,
}

/// Under the `loads-trail-readers` fault: counts a step reaching `layer` and wakes the
/// loads waiting for one.
fn note_read<B: Backend>(sh: &super::hicache::Shared<B>, layer: usize) {
    if sh.fault(Fault::LoadsTrailReaders) {
        if let Some(r) = sh.reads.lock().get_mut(layer) {
            *r += 1;
        }
        sh.reads_cv.notify_all();
    }
}

fn failed(req: RequestId, cause: Error) -> Error {
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
            note_read(sh, layer);
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
    pub fn layer(&mut self, token: ReadyToken) -> Result<LayerGuard<'_, B>> {
        let sh = &*self.cache.shared;
        if token.cache != sh.id || token.step != self.id {
            return Err(invalid("ready token", "minted by another step or cache"));
        }
        // A thread already holding a layer (of another step) only tries: waiting for a
        // second layer could close a cycle with another thread doing the reverse.
        let deadline = if crate::sync::held_layers() > 0 {
            Instant::now()
        } else {
            sh.deadline()
        };
        let mut bufs = sh.device.lock(token.layer, deadline)?;
        crate::sync::add_held_layers(1);
        if sh.fault(Fault::SkipIndexWait) {
            if let Err(e) = self.poison_unlanded(&mut bufs, token.layer) {
                crate::sync::add_held_layers(-1);
                return Err(e);
            }
        }
        // Holding the layer: a load trailing readers may go now (it will wait for the lock).
        note_read(sh, token.layer);
        let g = LayerGuard {
            step: self,
            bufs,
            layer: token.layer,
        };
        g.verify_landed()?;
        Ok(g)
    }

    /// Under the `skip-index-wait` fault: the bytes of a page whose load has not landed are
    /// undefined; this makes them so (a fixed pattern, finite in every dtype) instead of
    /// leaving what the page's previous owner wrote, which may by chance be the same
    /// bytes — so a read that skipped the wait reads wrong bytes every time.
    fn poison_unlanded(&self, bufs: &mut LayerBuffers<B>, layer: usize) -> Result<()> {
        let sh = &*self.cache.shared;
        let ids: Vec<i32> = self
            .live_members()
            .flat_map(|m| m.landed.iter())
            .filter(|p| sh.device.stamp(layer, p.id) != Some(p.generation))
            .map(|p| p.id as i32)
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        for kind in BufferKind::ALL {
            let region = sh.device.region(kind);
            let page = region.layout.bytes_per_page();
            let src = sh.backend.upload(&vec![0x3c; page])?;
            let op = CopyPages {
                src: PagedRegion::contiguous(region.layout, 1),
                dst: region,
                src_ids: &vec![0; ids.len()],
                dst_ids: &ids,
            };
            sh.backend.copy_pages(&op, &src, bufs.get_mut(kind))?;
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
    step: &'s Step<'s, B>,
    bufs: MutexGuard<'s, LayerBuffers<B>>,
    layer: usize,
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

    /// Request `req` fails: page `p` of this layer is stamped `stamp`, not its generation.
    fn not_landed(&self, req: RequestId, p: &PageRef, stamp: Option<u32>) -> Error {
        failed(
            req,
            Error::NotLanded {
                page: p.id,
                layer: self.layer,
                generation: p.generation,
                stamp,
            },
        )
    }

    /// The landed-stamp check, for every (non-aborted) member: its prefix and received
    /// pages were last written for their current generation in this layer; its other own
    /// pages were not written yet or written for their generation.
    fn verify_landed(&self) -> Result<()> {
        let sh = &*self.step.cache.shared;
        if sh.fault(Fault::NoLandedCheck) {
            return Ok(());
        }
        for m in self.step.live_members() {
            let strict = m.landed.iter().map(|p| (p, false));
            for (p, may_be_empty) in strict.chain(m.own.iter().map(|p| (p, true))) {
                let stamp = sh.device.stamp(self.layer, p.id);
                if stamp != Some(p.generation) && !(may_be_empty && stamp.is_none()) {
                    return Err(self.not_landed(m.req, p, stamp));
                }
            }
        }
        Ok(())
    }

    /// Checks that `pages` may be read out of this layer: each is a page of a live member
    /// of the step (its prefix, received or own pages, at their current generation) whose
    /// bytes were written for that generation in this layer (the landed stamp; not checked
    /// under the `no-landed-check` fault). What a caller copying pages out of
    /// [`LayerGuard::views`] by id (a PD sender) must check first.
    pub fn check_pages(&self, pages: &[PageRef]) -> Result<()> {
        let sh = &*self.step.cache.shared;
        for p in pages {
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
            let stamp = sh.device.stamp(self.layer, p.id);
            if stamp != Some(p.generation) && !sh.fault(Fault::NoLandedCheck) {
                return Err(self.not_landed(m.req, p, stamp));
            }
        }
        Ok(())
    }

    /// Both views of the layer: `(kv, index_k)`, whole buffers in the device regions'
    /// geometry ([`HiCache::device_region`]). Re-checks the landed stamps.
    pub fn views(&self) -> Result<(&B::Buffer, &B::Buffer)> {
        self.verify_landed()?;
        Ok((&self.bufs.kv, &self.bufs.index_k))
    }

    /// The KV view (see [`LayerGuard::views`]).
    pub fn kv(&self) -> Result<&B::Buffer> {
        self.views().map(|v| v.0)
    }

    /// The index-K view (see [`LayerGuard::views`]).
    pub fn index_k(&self) -> Result<&B::Buffer> {
        self.views().map(|v| v.1)
    }

    /// Slot numbers of `slots` after checking each names a page a member owns, at its
    /// current generation (unless the `no-generation-check` fault is on).
    fn slots(&self, slots: &[SlotRef]) -> Result<Vec<i64>> {
        let sh = &*self.step.cache.shared;
        let ps = sh.device.spec().page_size();
        let mut out = Vec::with_capacity(slots.len());
        for (i, s) in slots.iter().enumerate() {
            if s.offset as usize >= ps {
                return Err(invalid(
                    "slots",
                    format!("slots[{i}]: offset {} of a {ps}-token page", s.offset),
                ));
            }
            let Some(own) = self.step.writable.get(&s.page.id) else {
                return Err(invalid(
                    "slots",
                    format!(
                        "slots[{i}]: page {} is not owned by a request of this step",
                        s.page.id
                    ),
                ));
            };
            if own.generation != s.page.generation && !sh.fault(Fault::NoGenerationCheck) {
                sh.state.lock().stats.stale_writes_refused += 1;
                return Err(Error::StalePage {
                    what: "device",
                    page: s.page.id,
                    generation: s.page.generation,
                    current: Some(own.generation),
                });
            }
            out.push((s.page.id as usize * ps + s.offset as usize) as i64);
        }
        Ok(out)
    }

    fn stamp(&self, slots: &[SlotRef]) {
        let sh = &*self.step.cache.shared;
        for s in slots {
            sh.device
                .set_stamp(self.layer, s.page.id, s.page.generation);
        }
    }

    /// Runs the store op of `kind` for slot numbers `ids` (checked by [`Self::slots`]).
    fn run_store(&mut self, kind: BufferKind, ids: &[i64], rows: &B::Buffer) -> Result<()> {
        let sh = &*self.step.cache.shared;
        let spec = sh.device.spec();
        match kind {
            BufferKind::Kv => sh.backend.kv_store(
                &KvStore {
                    layout: spec.kv,
                    slots: ids,
                },
                rows,
                &mut self.bufs.kv,
            ),
            BufferKind::IndexK => sh.backend.index_k_store(
                &IndexKStore {
                    layout: spec.index_k,
                    slots: ids,
                },
                rows,
                &mut self.bufs.index_k,
            ),
        }
    }

    fn store(&mut self, kind: BufferKind, slots: &[SlotRef], rows: &B::Buffer) -> Result<()> {
        let ids = self.slots(slots)?;
        self.run_store(kind, &ids, rows)?;
        self.stamp(slots);
        if self.step.cache.shared.fault(Fault::LateWrite) && !slots.is_empty() {
            self.late_writes(kind, slots, rows)?;
        }
        Ok(())
    }

    /// The `late-write` fault: remembers this store's rows, then writes the late rows due
    /// on these slots through their old references, by the same checked path as any store
    /// (a refused one is counted by [`Self::slots`] and dropped).
    fn late_writes(&mut self, kind: BufferKind, slots: &[SlotRef], rows: &B::Buffer) -> Result<()> {
        let sh = &*self.step.cache.shared;
        let bytes = sh.backend.download(rows)?;
        let row_bytes = bytes.len() / slots.len();
        if row_bytes == 0 {
            return Ok(());
        }
        let due = {
            let mut late = sh.late.lock();
            late.record(self.layer, kind, slots, &bytes, row_bytes);
            late.due(self.layer, kind, slots)
        };
        for (slot, row) in due {
            let Ok(ids) = self.slots(&[slot]) else {
                continue;
            };
            let buf = sh.backend.upload(&row)?;
            self.run_store(kind, &ids, &buf)?;
            self.stamp(&[slot]);
        }
        Ok(())
    }

    /// Stores `kv` (bf16 `[slots.len(), d_qk]`) into `slots` of this layer's KV buffer.
    pub fn kv_store(&mut self, slots: &[SlotRef], kv: &B::Buffer) -> Result<()> {
        self.store(BufferKind::Kv, slots, kv)
    }

    /// Stores index keys (bf16 `[slots.len(), head_dim]`) into `slots` of this layer's
    /// index-K buffer (quantized as the layout says).
    pub fn index_k_store(&mut self, slots: &[SlotRef], keys: &B::Buffer) -> Result<()> {
        self.store(BufferKind::IndexK, slots, keys)
    }
}
