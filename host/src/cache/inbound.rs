//! Inbound transfers: a request's pages written from elsewhere (the prefill side of a PD
//! pair writing a prompt's pages into the decode side's pool), by page reference, per
//! layer and buffer kind, with per-page checksums.
//!
//! [`Inbound`] is the receiving end. It checks every write: each page must be one of the
//! transfer's targets at its current generation (a late write after an abort is refused:
//! the abort made every reference stale), the bytes that landed must match the sender's
//! checksums, and only when every target page of a layer has both kinds does it publish
//! that layer's ready token into the request's fence (each kind of each page is stamped
//! landed as its bytes are verified). Its
//! target pages stay pinned (quarantined if released meanwhile) until the handle is
//! completed, failed or dropped: nothing can be reused while a write may still land.

use std::collections::HashMap;
use std::sync::Arc;

use super::alloc::PageRef;
use super::faults::Fault;
use super::fence::Fence;
use super::io::checksums;
use super::pool::BufferKind;
use super::state::{invalid, InboundRec, Shared};
use super::types::RequestId;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ops::{CopyPages, PagedRegion};

/// The receiving end of one transfer into a request's pages (see the module docs).
#[derive(Debug)]
pub struct Inbound<B: Backend + 'static> {
    sh: Arc<Shared<B>>,
    id: u64,
    req: RequestId,
    targets: Vec<PageRef>,
    index: HashMap<u32, usize>,
    /// `[layer * targets + i]`: bit `kind.index()` set when that kind landed.
    landed: Vec<u8>,
    /// `[i]`: the kinds page `i` receives (every kind, but the window pool's only on the
    /// pages a query after the transfer's tokens reads).
    expected: Vec<u8>,
    published: Vec<bool>,
    fence: Arc<Fence>,
    done: bool,
}

impl<B: Backend + 'static> Inbound<B> {
    pub(crate) fn open(
        sh: &Arc<Shared<B>>,
        req: RequestId,
        pages: &[PageRef],
        tokens: Option<usize>,
    ) -> Result<Self> {
        if pages.is_empty() {
            return Err(invalid("inbound pages", "no pages"));
        }
        let mut index = HashMap::new();
        for (i, p) in pages.iter().enumerate() {
            if let Some(first) = index.insert(p.id, i) {
                return Err(Error::DuplicatePage {
                    what: "inbound pages",
                    page: p.id as i64,
                    first,
                    second: i,
                });
            }
        }
        let layers = sh.num_layers();
        let mut st = sh.state.lock();
        let st = &mut *st;
        let r = st
            .requests
            .get(&req)
            .ok_or_else(|| invalid("request", format!("{req} is not live")))?;
        if r.inbound.is_some() {
            return Err(invalid(
                "inbound",
                format!("request {req} already has a transfer in flight"),
            ));
        }
        if r.users > 0 {
            // A live step copied the request's fences when it opened: it would not wait
            // for this transfer's, and would read (or write) pages still landing.
            return Err(invalid(
                "inbound",
                format!("request {req} is in a live step"),
            ));
        }
        if let Some(p) = pages.iter().find(|p| !r.own.contains(p)) {
            return Err(invalid(
                "inbound pages",
                format!("{p:?} is not a page request {req} owns"),
            ));
        }
        let spec = sh.device.spec();
        if let Some(t) = tokens.filter(|t| t.div_ceil(spec.page_size()) != pages.len()) {
            return Err(invalid(
                "inbound pages",
                format!("{} pages do not hold exactly {t} tokens", pages.len()),
            ));
        }
        let every: u8 = BufferKind::ALL
            .iter()
            .fold(0, |m, k| m | (1u8 << k.index()));
        let expected: Vec<u8> = (0..pages.len())
            .map(|i| match tokens {
                Some(t) => BufferKind::ALL
                    .iter()
                    .filter(|k| spec.carried_pages(**k, t).contains(&i))
                    .fold(0, |m, k| m | (1u8 << k.index())),
                None => every,
            })
            .collect();
        let id = sh.next_id();
        let fence = Arc::new(Fence::pending(layers));
        for (p, &e) in pages.iter().zip(&expected) {
            if e != every {
                // Its window rows never come (no query reads them): its frame goes now.
                let _ = st.device.release_frame(*p);
            }
            // Owned and current (checked above): the pin cannot fail.
            let _ = st.device.pin(*p);
            sh.device.clear_landed(p.id);
        }
        if let Some(r) = st.requests.get_mut(&req) {
            r.fences.push(fence.clone());
            r.inbound = Some((id, fence.clone()));
            for p in pages {
                if !r.received.contains(p) {
                    r.received.push(*p);
                }
            }
        }
        st.inbounds.insert(
            id,
            InboundRec {
                req,
                targets: pages.to_vec(),
            },
        );
        Ok(Inbound {
            sh: sh.clone(),
            id,
            req,
            targets: pages.to_vec(),
            index,
            landed: vec![0; layers * pages.len()],
            expected,
            published: vec![false; layers],
            fence,
            done: false,
        })
    }

    /// The request the pages belong to.
    pub fn request(&self) -> RequestId {
        self.req
    }

    /// The target pages, as handed to the sender.
    pub fn targets(&self) -> &[PageRef] {
        &self.targets
    }

    /// Whether every target page of `layer` landed (both kinds) and was published.
    pub fn is_layer_ready(&self, layer: usize) -> bool {
        self.published.get(layer).copied().unwrap_or(false)
    }

    /// Writes page `src_ids[i]` of `src` (laid out as `src_region`) into target page
    /// `pages[i]` of `layer`/`kind`, then checks the landed bytes against `checksums[i]`
    /// (the sender's, computed with `page_checksums` over the same layout). Refused with
    /// `StalePage` when a page's generation is not current (nothing is written); a checksum
    /// mismatch fails the whole transfer (`Integrity`).
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &mut self,
        layer: usize,
        kind: BufferKind,
        pages: &[PageRef],
        src: &B::Buffer,
        src_region: PagedRegion,
        src_ids: &[i32],
        checksums_in: &[u64],
    ) -> Result<()> {
        if self.done {
            return Err(invalid("inbound", "transfer already ended"));
        }
        let sh = &*self.sh;
        if layer >= sh.num_layers() {
            return Err(invalid("layer", format!("{layer} of {}", sh.num_layers())));
        }
        crate::ops::check_len("src_ids", pages.len(), src_ids.len())?;
        crate::ops::check_len("checksums", pages.len(), checksums_in.len())?;
        if !sh.device.spec().has(layer, kind) {
            // A kind the layer does not hold (a peer's frame): refused, nothing written.
            return Err(invalid(
                "inbound kind",
                format!("layer {layer} holds no {} pool", kind.name()),
            ));
        }
        let bit = 1u8 << kind.index();
        let n = self.targets.len();
        let mut slots = Vec::with_capacity(pages.len());
        for p in pages {
            let Some(&i) = self.index.get(&p.id) else {
                sh.state.lock().stats.stale_writes_refused += 1;
                return Err(invalid(
                    "inbound pages",
                    format!("page {} is not a target of this transfer", p.id),
                ));
            };
            if self.landed[layer * n + i] & bit != 0 || slots.contains(&i) {
                // Landed (and maybe published and read) already: never overwritten.
                sh.state.lock().stats.stale_writes_refused += 1;
                return Err(invalid(
                    "inbound pages",
                    format!("page {} layer {layer} {} landed already", p.id, kind.name()),
                ));
            }
            slots.push(i);
        }
        {
            let mut st = sh.state.lock();
            if !sh.fault(Fault::NoGenerationCheck) {
                if let Some(p) = pages.iter().zip(&slots).find_map(|(p, &i)| {
                    (self.targets[i] != *p || !st.device.is_current(*p)).then_some(*p)
                }) {
                    st.stats.stale_writes_refused += 1;
                    return Err(Error::StalePage {
                        what: "device",
                        page: p.id,
                        generation: p.generation,
                        current: st.device.generation(p.id),
                    });
                }
            }
            if let Some(e) = self.fence.failure() {
                return Err(e);
            }
        }
        let page_ids: Vec<i32> = pages.iter().map(|p| p.id as i32).collect();
        let dst_ids = sh.device.indices(kind, &page_ids);
        if let Some(p) = pages
            .iter()
            .zip(&dst_ids)
            .find(|(_, &d)| d < 0)
            .map(|(p, _)| p)
        {
            return Err(invalid(
                "inbound pages",
                format!(
                    "page {} gave its {} rows back: nothing can land in them",
                    p.id,
                    kind.name()
                ),
            ));
        }
        let dst = sh.device.region(kind);
        let mut dev = sh.device.lock(layer, sh.deadline())?;
        let op = CopyPages {
            src: src_region,
            dst,
            src_ids,
            dst_ids: &dst_ids,
        };
        sh.backend.copy_pages(&op, src, dev.get_mut(kind)?)?;
        let got = checksums(&*sh.backend, dst, dev.get(kind)?, &dst_ids)?;
        if let Some((p, (&want, g))) = pages
            .iter()
            .zip(checksums_in.iter().zip(got))
            .find(|(_, (&w, g))| w != *g)
        {
            drop(dev);
            let e = Error::Integrity {
                what: "inbound",
                page: p.id,
                layer,
                kind: kind.name(),
                expected: want,
                actual: g,
            };
            self.fence.fail(e.clone());
            sh.state.lock().stats.integrity_failures += 1;
            return Err(e);
        }
        for (p, &i) in pages.iter().zip(&slots) {
            self.landed[layer * n + i] |= bit;
            // Whole pages move: every slot of this kind landed for the page's generation.
            sh.device.set_page_landed(layer, kind, p.id, p.generation);
        }
        sh.notify_landed();
        drop(dev);
        // Published once every target page landed in every kind the layer holds.
        let all: u8 = sh
            .device
            .spec()
            .kinds(layer)
            .fold(0, |m, k| m | (1u8 << k.index()));
        if !self.published[layer]
            && self.landed[layer * n..(layer + 1) * n]
                .iter()
                .zip(&self.expected)
                .all(|(&l, &e)| l == all & e)
        {
            self.published[layer] = true;
            self.fence.publish(layer);
        }
        Ok(())
    }

    /// Ends the transfer: every layer must have landed (else the transfer fails and the
    /// error says which layers are missing). Unpins the targets.
    pub fn complete(mut self) -> Result<()> {
        let missing: Vec<usize> = (0..self.published.len())
            .filter(|&l| !self.published[l])
            .collect();
        if !missing.is_empty() {
            let e = invalid(
                "inbound",
                format!("transfer ended with layers {missing:?} missing"),
            );
            self.fence.fail(e.clone());
            self.release();
            return Err(e);
        }
        self.release();
        Ok(())
    }

    /// Ends the transfer as failed (the sender died, the connection dropped): the request's
    /// readers get `e`. Unpins the targets.
    pub fn fail(mut self, e: Error) {
        self.fence.fail(e);
        self.release();
    }

    /// Fails the transfer for its readers now (they get `e`) but keeps its targets pinned
    /// — quarantined — until this handle is dropped: for bytes that may still land after
    /// the sender is gone (a remote write in flight).
    pub fn fail_keep_pinned(&mut self, e: Error) {
        self.fence.fail(e);
    }

    fn release(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let sh = &*self.sh;
        let mut st = sh.state.lock();
        for t in &self.targets {
            st.device.unpin(t.id);
        }
        st.inbounds.remove(&self.id);
        if let Some(r) = st.requests.get_mut(&self.req) {
            if r.inbound.as_ref().is_some_and(|(id, _)| *id == self.id) {
                r.inbound = None;
            }
        }
        drop(st);
        sh.space_cv.notify_all();
    }
}

impl<B: Backend + 'static> Drop for Inbound<B> {
    fn drop(&mut self) {
        if !self.done {
            self.fence.fail(Error::Cancelled(
                "inbound transfer dropped before it completed".into(),
            ));
            self.release();
        }
    }
}
