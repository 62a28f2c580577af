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

use crate::error::{Error, Result};

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

/// Free list over `capacity` pages.
#[derive(Clone, Debug)]
pub(crate) struct PageAllocator {
    what: &'static str,
    generation: Vec<u32>,
    slot: Vec<Slot>,
    pins: Vec<u32>,
    free: Vec<u32>,
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
        }
    }

    pub fn capacity(&self) -> usize {
        self.generation.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
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

    /// `n` pages, all or nothing.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageRef>> {
        if n > self.free.len() {
            return Err(Error::OutOfPages {
                what: self.what,
                wanted: n,
                free: self.free.len(),
            });
        }
        let at = self.free.len() - n;
        let ids = self.free.split_off(at);
        Ok(ids
            .into_iter()
            .rev()
            .map(|id| {
                self.slot[id as usize] = Slot::Held;
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
}
