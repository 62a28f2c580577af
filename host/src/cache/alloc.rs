//! Page allocator with generations. A page's generation changes every time it is freed, so
//! a [`PageRef`] taken before a free can be recognised as stale afterwards: a late write
//! (an aborted request's transfer or load) is refused instead of landing in a page that
//! now belongs to someone else.

use crate::error::{Error, Result};

/// A page id together with the generation it had when it was handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageRef {
    pub id: u32,
    pub generation: u32,
}

/// Free list over `capacity` pages.
#[derive(Clone, Debug)]
pub struct PageAllocator {
    what: &'static str,
    generation: Vec<u32>,
    in_use: Vec<bool>,
    free: Vec<u32>,
}

impl PageAllocator {
    /// All `capacity` pages free; `what` names the pool in errors.
    pub fn new(what: &'static str, capacity: usize) -> Self {
        PageAllocator {
            what,
            generation: vec![0; capacity],
            in_use: vec![false; capacity],
            // Pop from the end: hand out low ids first.
            free: (0..capacity as u32).rev().collect(),
        }
    }

    /// Pages in the pool.
    pub fn capacity(&self) -> usize {
        self.generation.len()
    }

    /// Pages free now.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Pages handed out and not yet freed.
    pub fn num_in_use(&self) -> usize {
        self.capacity() - self.num_free()
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
                self.in_use[id as usize] = true;
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
            && self.in_use[r.id as usize]
            && self.generation[r.id as usize] == r.generation
    }

    /// Returns a page; a stale or double free is an error and changes nothing.
    pub fn free(&mut self, r: PageRef) -> Result<()> {
        if !self.is_current(r) {
            return Err(Error::StalePage {
                what: self.what,
                page: r.id,
                generation: r.generation,
                current: self.generation.get(r.id as usize).copied(),
            });
        }
        let i = r.id as usize;
        self.in_use[i] = false;
        self.generation[i] = self.generation[i].wrapping_add(1);
        self.free.push(r.id);
        Ok(())
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
        a.free(p[0]).unwrap();
        assert!(!a.is_current(p[0]));
        assert!(
            matches!(a.free(p[0]), Err(Error::StalePage { .. })),
            "double free"
        );
        let q = a.alloc(2).unwrap();
        let reused = q.iter().find(|r| r.id == p[0].id).unwrap();
        assert_ne!(reused.generation, p[0].generation);
        assert!(a.is_current(*reused) && !a.is_current(p[0]));
        assert!(matches!(
            a.free(PageRef {
                id: 9,
                generation: 0
            }),
            Err(Error::StalePage { current: None, .. })
        ));
    }
}
