//! The store side of a [`LayerGuard`]: stores into the step members' own pages, each
//! slot checked for its page's owner and generation, each page filled in entry order (a
//! gap refused), the landed stamps advanced after the bytes, and the `late-write` fault's
//! replay through the same checks.

use super::alloc::PageRef;
use super::faults::Fault;
use super::pool::BufferKind;
use super::state::invalid;
use super::step::{failed, LayerGuard, SlotRef};
use crate::backend::Backend;
use crate::error::{Error, Result};

impl<B: Backend + 'static> LayerGuard<'_, B> {
    /// Counts a refused stale write and says why: a store through `page` where the page
    /// (or its bytes) is of generation `current`.
    fn refuse_stale(&self, what: &'static str, page: PageRef, current: u32) -> Error {
        self.step
            .cache
            .shared
            .state
            .lock()
            .stats
            .stale_writes_refused += 1;
        Error::StalePage {
            what,
            page: page.id,
            generation: page.generation,
            current: Some(current),
        }
    }

    /// Slot numbers of `slots` after checking each names a page a member owns, at its
    /// current generation (unless the `no-generation-check` fault is on).
    fn slots(&self, kind: BufferKind, slots: &[SlotRef]) -> Result<Vec<i64>> {
        let sh = &*self.step.cache.shared;
        if !sh.device.spec().has(self.layer, kind) {
            return Err(invalid(
                "kind",
                format!("layer {} holds no {} pool", self.layer, kind.name()),
            ));
        }
        let ps = sh.device.spec().entries_per_page(kind);
        let mut out = Vec::with_capacity(slots.len());
        for (i, s) in slots.iter().enumerate() {
            if s.offset as usize >= ps {
                return Err(invalid(
                    "slots",
                    format!(
                        "slots[{i}]: offset {} of a {ps}-entry {} page",
                        s.offset,
                        kind.name()
                    ),
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
                return Err(self.refuse_stale("device", s.page, own.generation));
            }
            let at = self.frame_for_store(kind, s.page, i)?;
            out.push((at as usize * ps + s.offset as usize) as i64);
        }
        Ok(out)
    }

    /// Where a store (`slots[i]`) into `page`'s rows of `kind` goes in the kind's buffer:
    /// for a window pool, its frame; a page reserved without one takes a free one now.
    /// `InvalidArgument` for a page that gave its rows back (its tokens left the window),
    /// `OutOfPages` when no frame is free.
    fn frame_for_store(&self, kind: BufferKind, page: PageRef, i: usize) -> Result<u32> {
        let sh = &*self.step.cache.shared;
        if let Some(at) = sh.device.index(kind, page.id) {
            return Ok(at);
        }
        // Layer lock, then the state mutex: the cache's lock order.
        let mut st = sh.state.lock();
        if st.device.attach_frame(page) {
            drop(st);
            sh.device.clear_kind_landed(page.id, kind);
            if let Some(at) = sh.device.index(kind, page.id) {
                return Ok(at);
            }
        } else if st.device.frames().is_some_and(|(free, _)| free == 0)
            && !st.device.gave_back(page.id)
        {
            return Err(Error::OutOfPages {
                what: "window frames",
                wanted: 1,
                free: 0,
            });
        }
        Err(invalid(
            "slots",
            format!(
                "slots[{i}]: page {} gave its {} rows back (its tokens left the window)",
                page.id,
                kind.name()
            ),
        ))
    }

    /// The fill each store target page reaches after writing `slots` in order: a slot
    /// may rewrite a written one or extend the page by one; one past the written slots
    /// would leave a gap that nothing fills, and is refused ([`Error::Unwritten`], as
    /// `RequestFailed` of the page's owner); a write for a generation other than the one
    /// the page's bytes are of is refused too ([`Error::StalePage`], counted). Neither is
    /// checked under `no-landed-check`.
    fn fills(&self, kind: BufferKind, slots: &[SlotRef]) -> Result<Vec<(PageRef, u32)>> {
        let sh = &*self.step.cache.shared;
        let mut fills: Vec<(PageRef, u32)> = Vec::new();
        let unchecked = sh.fault(Fault::NoLandedCheck);
        for s in slots {
            let i = match fills.iter().position(|(p, _)| *p == s.page) {
                Some(i) => i,
                None => {
                    // Bytes of another allocation of this page (a fresh allocation holds
                    // none): a writer for a generation that is not the page's — refused
                    // whatever the allocator's generation check said.
                    match sh.device.landed(self.layer, kind, s.page.id) {
                        Some(l)
                            if l.generation != s.page.generation && l.filled > 0 && !unchecked =>
                        {
                            return Err(self.refuse_stale(
                                "device (written slots)",
                                s.page,
                                l.generation,
                            ));
                        }
                        _ => {}
                    }
                    fills.push((s.page, sh.device.filled(self.layer, kind, s.page)));
                    fills.len() - 1
                }
            };
            let f = &mut fills[i].1;
            if s.offset > *f && !unchecked {
                let owner = self
                    .step
                    .members
                    .iter()
                    .find(|m| m.own.contains(&s.page) || m.landed.contains(&s.page))
                    .map_or(0, |m| m.req);
                return Err(failed(
                    owner,
                    Error::Unwritten {
                        page: s.page.id,
                        layer: self.layer,
                        kind: kind.name(),
                        slot: *f,
                        filled: *f,
                    },
                ));
            }
            *f = (*f).max(s.offset + 1);
        }
        Ok(fills)
    }

    fn stamp_fills(&self, kind: BufferKind, fills: &[(PageRef, u32)]) {
        let sh = &*self.step.cache.shared;
        for (p, f) in fills {
            sh.device
                .set_landed(self.layer, kind, p.id, p.generation, *f);
        }
    }

    /// Runs the store op of `kind` for slot numbers `ids` (checked by [`Self::slots`]):
    /// [`super::CacheSpec::store`].
    fn run_store(&mut self, kind: BufferKind, ids: &[i64], rows: &B::Buffer) -> Result<()> {
        let sh = &*self.step.cache.shared;
        let dst = self.bufs.get_mut(kind)?;
        sh.device.spec().store(&*sh.backend, kind, ids, rows, dst)
    }

    fn store(&mut self, kind: BufferKind, slots: &[SlotRef], rows: &B::Buffer) -> Result<()> {
        let ids = self.slots(kind, slots)?;
        let fills = self.fills(kind, slots)?;
        self.run_store(kind, &ids, rows)?;
        self.stamp_fills(kind, &fills);
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
            // Refused late writes (stale, or one that would leave a gap) are counted and
            // dropped: they belong to no live request.
            let Ok(ids) = self.slots(kind, &[slot]) else {
                continue;
            };
            let fills = match self.fills(kind, &[slot]) {
                Ok(f) => f,
                // Counted where it was refused.
                Err(Error::StalePage { .. }) => continue,
                Err(_) => {
                    sh.state.lock().stats.stale_writes_refused += 1;
                    continue;
                }
            };
            let buf = sh.backend.upload(&row)?;
            self.run_store(kind, &ids, &buf)?;
            self.stamp_fills(kind, &fills);
        }
        Ok(())
    }

    /// Stores `rows` into `slots` of this layer's pool of `kind` (offsets in that pool's
    /// entries): index keys as bf16 `[slots.len(), head_dim]` (quantized as the layout
    /// says), every other kind as bf16 KV rows `[slots.len(), d_qk]` of its layout. A
    /// page fills in entry order (a gap is refused), only pages a member of the step owns
    /// at their current generation.
    pub fn store_kind(
        &mut self,
        kind: BufferKind,
        slots: &[SlotRef],
        rows: &B::Buffer,
    ) -> Result<()> {
        self.store(kind, slots, rows)
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
