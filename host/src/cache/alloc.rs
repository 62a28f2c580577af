//! Page allocator with generations, pins and quarantine.
//!
//! A page's generation changes every time it is released, so a [`PageRef`] taken before a
//! release is recognised as stale afterwards: a late write (an aborted request's transfer
//! or load) is refused instead of landing in a page that now belongs to someone else.
//!
//! A page that an in-flight copy (a load, a backup, an inbound transfer) or a forward step
//! still touches is *pinned*. Releasing a pinned page bumps its generation at once (every
//! reference to it is stale from then on) but puts it in *quarantine* instead of the free
//! list; it becomes free only when the last pin is dropped. So a page is never handed out
//! again while anything may still write or read its bytes.
//!
//! A cache with a sliding-window pool (DeepSeek-V4's raw KV) also hands out **frames**:
//! the window pool's physical pages, fewer than the pages. Every fresh page gets a frame;
//! [`PageAllocator::release_frame`] gives one back early (its page's tokens left every
//! window that reads them) and a page's frame returns with the page otherwise. The page →
//! frame map is shared ([`FrameMap`]) so that copies and stores address the window pool
//! without the state mutex; it changes only under the allocator's owner (the state mutex)
//! and never for a pinned page.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sync::{AtomicU32, Ordering};

/// A page id together with the generation it had when it was handed out. Plain data: a
/// reference can come from anywhere (a peer's message), so every use checks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageRef {
    pub id: u32,
    pub generation: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    Held,
    Quarantined,
}

/// Per page, the window-pool frame it holds (see the module docs): read anywhere, written
/// by the [`PageAllocator`] only.
#[derive(Debug)]
pub(crate) struct FrameMap {
    frame: Vec<AtomicU32>,
}

const NO_FRAME: u32 = u32::MAX;

impl FrameMap {
    fn new(pages: usize) -> Self {
        FrameMap {
            frame: (0..pages).map(|_| AtomicU32::new(NO_FRAME)).collect(),
        }
    }

    /// The frame page `page` holds (`None`: none, or a page outside the pool).
    pub fn get(&self, page: u32) -> Option<u32> {
        let f = self.frame.get(page as usize)?.load(Ordering::Acquire);
        (f != NO_FRAME).then_some(f)
    }

    fn set(&self, page: u32, frame: Option<u32>) {
        if let Some(a) = self.frame.get(page as usize) {
            a.store(frame.unwrap_or(NO_FRAME), Ordering::Release);
        }
    }
}

/// The frames of a windowed pool: their free list, the shared page → frame map, and per
/// page whether its current allocation gave its frame back (it never gets one again).
#[derive(Clone, Debug)]
struct Frames {
    capacity: usize,
    free: Vec<u32>,
    map: Arc<FrameMap>,
    given_back: Vec<bool>,
}

/// Free list over `capacity` pages (and, for a cache with a window pool, its frames).
#[derive(Clone, Debug)]
pub(crate) struct PageAllocator {
    what: &'static str,
    generation: Vec<u32>,
    slot: Vec<Slot>,
    pins: Vec<u32>,
    free: Vec<u32>,
    frames: Option<Frames>,
}

impl PageAllocator {
    /// All `capacity` pages free; `what` names the pool in errors.
    pub fn new(what: &'static str, capacity: usize) -> Self {
        PageAllocator {
            what,
            generation: vec![0; capacity],
            slot: vec![Slot::Free; capacity],
            pins: vec![0; capacity],
            // Pop from the end: hand out low ids first.
            free: (0..capacity as u32).rev().collect(),
            frames: None,
        }
    }

    /// [`PageAllocator::new`] with `frames` window-pool frames (at most `capacity`): every
    /// allocated page also takes a frame.
    pub fn with_frames(what: &'static str, capacity: usize, frames: usize) -> Self {
        let mut a = Self::new(what, capacity);
        let frames = frames.min(capacity);
        a.frames = Some(Frames {
            capacity: frames,
            free: (0..frames as u32).rev().collect(),
            map: Arc::new(FrameMap::new(capacity)),
            given_back: vec![false; capacity],
        });
        a
    }

    pub fn capacity(&self) -> usize {
        self.generation.len()
    }

    /// Pages that can be allocated now (free pages with a free frame each).
    pub fn num_free(&self) -> usize {
        match &self.frames {
            Some(f) => self.free.len().min(f.free.len()),
            None => self.free.len(),
        }
    }

    /// Free pages, whether or not a frame is free for them.
    pub fn num_free_pages(&self) -> usize {
        self.free.len()
    }

    /// What an allocation of `n` pages that cannot be made now runs short of: `"window
    /// frames"` when the pages are free but not their frames, else the pool's name.
    pub fn scarce(&self, n: usize) -> &'static str {
        if self.frames.is_some() && n <= self.free.len() {
            "window frames"
        } else {
            self.what
        }
    }

    /// `(free, capacity)` of the window frames (`None` without a window pool).
    pub fn frames(&self) -> Option<(usize, usize)> {
        self.frames.as_ref().map(|f| (f.free.len(), f.capacity))
    }

    /// How many frames there are and the shared page → frame map (`None` without a
    /// window pool): what the device pool addresses the window pool through.
    pub fn frame_map(&self) -> Option<(usize, Arc<FrameMap>)> {
        self.frames.as_ref().map(|f| (f.capacity, f.map.clone()))
    }

    /// The frame page `id` holds now.
    pub fn frame(&self, id: u32) -> Option<u32> {
        self.frames.as_ref().and_then(|f| f.map.get(id))
    }

    /// Gives back the frame of current page `r` before the page itself: `Ok(true)` when it
    /// was freed, `Ok(false)` when the page holds none or is pinned (something may still
    /// copy its window bytes: it keeps the frame). A stale reference is an error.
    pub fn release_frame(&mut self, r: PageRef) -> Result<bool> {
        if !self.is_current(r) {
            return Err(self.stale(r));
        }
        if self.pins[r.id as usize] > 0 {
            return Ok(false);
        }
        let freed = self.free_frame(r.id);
        if let Some(g) = self
            .frames
            .as_mut()
            .and_then(|f| f.given_back.get_mut(r.id as usize))
        {
            *g |= freed;
        }
        Ok(freed)
    }

    /// Gives current page `r`, which holds no frame and never gave one back, a free one:
    /// whether it got one.
    pub fn attach_frame(&mut self, r: PageRef) -> bool {
        if !self.is_current(r) || self.frame(r.id).is_some() {
            return false;
        }
        let Some(f) = self.frames.as_mut() else {
            return false;
        };
        if f.given_back.get(r.id as usize).copied().unwrap_or(true) {
            return false;
        }
        let Some(frame) = f.free.pop() else {
            return false;
        };
        f.map.set(r.id, Some(frame));
        true
    }

    /// Whether page `id`'s current allocation gave its frame back.
    pub fn gave_back(&self, id: u32) -> bool {
        self.frames
            .as_ref()
            .and_then(|f| f.given_back.get(id as usize).copied())
            .unwrap_or(false)
    }

    /// Returns page `id`'s frame (if any) to the free list.
    fn free_frame(&mut self, id: u32) -> bool {
        let Some(f) = self.frames.as_mut() else {
            return false;
        };
        let Some(frame) = f.map.get(id) else {
            return false;
        };
        f.map.set(id, None);
        f.free.push(frame);
        true
    }

    pub fn num_quarantined(&self) -> usize {
        self.slot
            .iter()
            .filter(|&&s| s == Slot::Quarantined)
            .count()
    }

    pub fn num_held(&self) -> usize {
        self.slot.iter().filter(|&&s| s == Slot::Held).count()
    }

    /// `n` pages, all or nothing (each with a frame, where the pool has frames).
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageRef>> {
        self.alloc_framed(n, n)
    }

    /// Whether `n` pages, `framed` of them with a frame, are free now.
    pub fn can_alloc(&self, n: usize, framed: usize) -> bool {
        n <= self.free.len()
            && self
                .frames
                .as_ref()
                .is_none_or(|f| framed.min(n) <= f.free.len())
    }

    /// `n` pages, all or nothing, the first `framed` of them with a frame (where the pool
    /// has frames; the others get one by [`PageAllocator::attach_frame`]).
    pub fn alloc_framed(&mut self, n: usize, framed: usize) -> Result<Vec<PageRef>> {
        let framed = framed.min(n);
        if !self.can_alloc(n, framed) {
            return Err(Error::OutOfPages {
                what: self.scarce(n),
                wanted: n,
                free: self.num_free(),
            });
        }
        let at = self.free.len() - n;
        let ids = self.free.split_off(at);
        Ok(ids
            .into_iter()
            .rev()
            .enumerate()
            .map(|(k, id)| {
                self.slot[id as usize] = Slot::Held;
                if let Some(g) = self
                    .frames
                    .as_mut()
                    .and_then(|f| f.given_back.get_mut(id as usize))
                {
                    *g = false;
                }
                if let Some(f) = self.frames.as_mut().filter(|_| k < framed) {
                    // Checked above: a free frame for each page.
                    if let Some(frame) = f.free.pop() {
                        f.map.set(id, Some(frame));
                    }
                }
                PageRef {
                    id,
                    generation: self.generation[id as usize],
                }
            })
            .collect())
    }

    /// Whether `r` still names the live allocation it was handed out as.
    pub fn is_current(&self, r: PageRef) -> bool {
        (r.id as usize) < self.capacity()
            && self.slot[r.id as usize] == Slot::Held
            && self.generation[r.id as usize] == r.generation
    }

    /// The current generation of page `id` (`None` outside the pool).
    pub fn generation(&self, id: u32) -> Option<u32> {
        self.generation.get(id as usize).copied()
    }

    fn stale(&self, r: PageRef) -> Error {
        Error::StalePage {
            what: self.what,
            page: r.id,
            generation: r.generation,
            current: self.generation(r.id),
        }
    }

    /// Returns a page: free at once, or quarantined while pinned. A stale or double release
    /// is an error and changes nothing.
    pub fn release(&mut self, r: PageRef) -> Result<()> {
        if !self.is_current(r) {
            return Err(self.stale(r));
        }
        let i = r.id as usize;
        self.generation[i] = self.generation[i].wrapping_add(1);
        if self.pins[i] > 0 {
            self.slot[i] = Slot::Quarantined;
        } else {
            self.slot[i] = Slot::Free;
            self.free.push(r.id);
            self.free_frame(r.id);
        }
        Ok(())
    }

    /// Pins a current page: it will not be reused until [`PageAllocator::unpin`].
    pub fn pin(&mut self, r: PageRef) -> Result<()> {
        if !self.is_current(r) {
            return Err(self.stale(r));
        }
        self.pins[r.id as usize] += 1;
        Ok(())
    }

    /// Drops one pin of page `id`; a quarantined page whose last pin goes becomes free.
    pub fn unpin(&mut self, id: u32) {
        let i = id as usize;
        let Some(p) = self.pins.get_mut(i) else {
            return;
        };
        *p = p.saturating_sub(1);
        if *p == 0 && self.slot[i] == Slot::Quarantined {
            self.slot[i] = Slot::Free;
            self.free.push(id);
            self.free_frame(id);
        }
    }

    /// Pins on page `id`.
    pub fn pins(&self, id: u32) -> u32 {
        self.pins.get(id as usize).copied().unwrap_or(0)
    }

    /// Internal consistency: the free list holds exactly the free pages, once each; a
    /// quarantined page is pinned. Returns the problems found.
    pub fn check(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut on_list = vec![false; self.capacity()];
        for &id in &self.free {
            let i = id as usize;
            if on_list[i] {
                problems.push(format!("{} page {id} is on the free list twice", self.what));
            }
            on_list[i] = true;
            if self.slot[i] != Slot::Free {
                problems.push(format!(
                    "{} page {id} is on the free list but {:?}",
                    self.what, self.slot[i]
                ));
            }
        }
        for (i, s) in self.slot.iter().enumerate() {
            if *s == Slot::Free && !on_list[i] {
                problems.push(format!(
                    "{} page {i} is free but not on the free list",
                    self.what
                ));
            }
            if *s == Slot::Quarantined && self.pins[i] == 0 {
                problems.push(format!(
                    "{} page {i} is quarantined without a pin",
                    self.what
                ));
            }
        }
        if let Some(f) = &self.frames {
            let mut owner: Vec<Option<usize>> = vec![None; f.capacity];
            for &fr in &f.free {
                match owner.get_mut(fr as usize) {
                    Some(o @ None) => *o = Some(usize::MAX),
                    _ => {
                        problems.push(format!("{} frame {fr} is free twice or unknown", self.what))
                    }
                }
            }
            for (i, s) in self.slot.iter().enumerate() {
                let Some(fr) = f.map.get(i as u32) else {
                    continue;
                };
                if *s == Slot::Free {
                    problems.push(format!(
                        "{} page {i} is free but holds frame {fr}",
                        self.what
                    ));
                }
                match owner.get_mut(fr as usize) {
                    Some(o @ None) => *o = Some(i),
                    _ => problems.push(format!(
                        "{} frame {fr} of page {i} is also free or another page's",
                        self.what
                    )),
                }
            }
            if let Some(fr) = owner.iter().position(|o| o.is_none()) {
                problems.push(format!("{} frame {fr} is neither free nor held", self.what));
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_change_on_reuse() {
        let mut a = PageAllocator::new("device", 3);
        let p = a.alloc(2).unwrap();
        assert_eq!(p.iter().map(|r| r.id).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(a.num_free(), 1);
        assert!(matches!(
            a.alloc(2),
            Err(Error::OutOfPages {
                wanted: 2,
                free: 1,
                ..
            })
        ));
        assert_eq!(a.num_free(), 1, "a failed alloc takes nothing");
        a.release(p[0]).unwrap();
        assert!(!a.is_current(p[0]));
        assert!(
            matches!(a.release(p[0]), Err(Error::StalePage { .. })),
            "double release"
        );
        let q = a.alloc(2).unwrap();
        let reused = q.iter().find(|r| r.id == p[0].id).unwrap();
        assert_ne!(reused.generation, p[0].generation);
        assert!(a.is_current(*reused) && !a.is_current(p[0]));
        assert!(matches!(
            a.release(PageRef {
                id: 9,
                generation: 0
            }),
            Err(Error::StalePage { current: None, .. })
        ));
        assert!(a.check().is_empty());
    }

    #[test]
    fn a_pinned_page_is_quarantined_until_unpinned() {
        let mut a = PageAllocator::new("device", 2);
        let p = a.alloc(2).unwrap();
        a.pin(p[0]).unwrap();
        a.pin(p[0]).unwrap();
        a.release(p[0]).unwrap();
        assert!(!a.is_current(p[0]), "references are stale at once");
        assert_eq!((a.num_free(), a.num_quarantined()), (0, 1));
        assert!(a.alloc(1).is_err(), "never handed out while pinned");
        assert!(a.pin(p[0]).is_err(), "a stale reference cannot pin");
        a.unpin(p[0].id);
        assert_eq!(a.num_quarantined(), 1);
        a.unpin(p[0].id);
        assert_eq!((a.num_free(), a.num_quarantined()), (1, 0));
        let q = a.alloc(1).unwrap()[0];
        assert_eq!(q.id, p[0].id);
        assert_ne!(q.generation, p[0].generation);
        assert!(a.check().is_empty());
    }

    #[test]
    fn frames_follow_pages_and_can_leave_first() {
        let mut a = PageAllocator::with_frames("device", 4, 2);
        assert_eq!((a.num_free(), a.num_free_pages()), (2, 4));
        let p = a.alloc(2).unwrap();
        assert!(matches!(
            a.alloc(1),
            Err(Error::OutOfPages {
                what: "window frames",
                ..
            })
        ));
        let f0 = a.frame(p[0].id).unwrap();
        assert_ne!(Some(f0), a.frame(p[1].id));
        // A pinned page keeps its frame; an unpinned one gives it back.
        a.pin(p[0]).unwrap();
        assert!(!a.release_frame(p[0]).unwrap());
        a.unpin(p[0].id);
        assert!(a.release_frame(p[0]).unwrap());
        assert_eq!(a.frame(p[0].id), None);
        assert!(!a.release_frame(p[0]).unwrap(), "nothing left to give");
        assert!(
            !a.attach_frame(p[0]),
            "a page that gave its frame back gets none"
        );
        let q = a.alloc(1).unwrap()[0];
        assert_eq!(a.frame(q.id), Some(f0), "the frame serves another page");
        assert!(a.check().is_empty(), "{:?}", a.check());
        // Releasing a page frees the frame it still holds (after its last pin).
        a.pin(p[1]).unwrap();
        a.release(p[1]).unwrap();
        assert_eq!(a.frames(), Some((0, 2)), "quarantined: the frame stays");
        a.unpin(p[1].id);
        assert_eq!(a.frames(), Some((1, 2)));
        a.release(p[0]).unwrap();
        a.release(q).unwrap();
        assert_eq!((a.num_free(), a.frames()), (2, Some((2, 2))));
        assert!(a.release_frame(q).is_err(), "stale");
        // A page reserved without a frame takes one when one is free.
        let r = a.alloc_framed(2, 1).unwrap();
        assert!(a.frame(r[0].id).is_some() && a.frame(r[1].id).is_none());
        assert!(a.attach_frame(r[1]) && !a.attach_frame(r[1]));
        assert_eq!(a.frames(), Some((0, 2)));
        assert!(a.check().is_empty(), "{:?}", a.check());
    }
}
