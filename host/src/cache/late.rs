//! The `late-write` fault's writer: a shadow of the rows each request stored into its own
//! pages, and the rows of released pages waiting to be written again, late, through their
//! old references (see [`super::Fault::LateWrite`]). Nothing here exists unless the fault
//! is configured; bounded by the device pool (shadow) and [`MAX_PENDING`] rows (pending).

use std::collections::{HashMap, VecDeque};

use super::alloc::PageRef;
use super::pool::BufferKind;
use super::step::SlotRef;

/// Most late rows kept waiting; older ones are dropped.
pub(crate) const MAX_PENDING: usize = 8192;

/// Rows stored into one page by its current owner: `(layer, kind, offset)` → row bytes.
#[derive(Debug, Default)]
struct PageShadow {
    generation: u32,
    rows: HashMap<(usize, BufferKind, u32), Vec<u8>>,
}

type LateKey = (usize, BufferKind, u32, u32);

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct LateWrites {
    shadow: HashMap<u32, PageShadow>,
    /// `(layer, kind, page id, offset)` → the old reference and the row.
    pending: HashMap<LateKey, (PageRef, Vec<u8>)>,
    order: VecDeque<LateKey>,
}

impl LateWrites {
    /// Remembers the rows of a store (`rows`: `slots.len()` rows of `row_bytes` each).
    pub fn record(
        &mut self,
        layer: usize,
        kind: BufferKind,
        slots: &[SlotRef],
        rows: &[u8],
        row_bytes: usize,
    ) {
        for (s, row) in slots.iter().zip(rows.chunks_exact(row_bytes)) {
            let sh = self.shadow.entry(s.page.id).or_default();
            if sh.generation != s.page.generation {
                *sh = PageShadow {
                    generation: s.page.generation,
                    rows: HashMap::new(),
                };
            }
            sh.rows.insert((layer, kind, s.offset), row.to_vec());
        }
    }

    /// `pages` are being released by their owner: their rows become late writes.
    pub fn orphan(&mut self, pages: &[PageRef]) {
        for p in pages {
            if self.shadow.get(&p.id).map(|s| s.generation) != Some(p.generation) {
                continue;
            }
            let Some(sh) = self.shadow.remove(&p.id) else {
                continue;
            };
            for ((layer, kind, offset), row) in sh.rows {
                let key = (layer, kind, p.id, offset);
                if self.pending.insert(key, (*p, row)).is_none() {
                    self.order.push_back(key);
                }
            }
        }
        while self.pending.len() > MAX_PENDING {
            match self.order.pop_front() {
                Some(k) => {
                    self.pending.remove(&k);
                }
                None => break,
            }
        }
    }

    /// The late rows that land now: those for the slots just stored by a later owner of
    /// the page (another generation). Each is returned once, with its old reference.
    pub fn due(
        &mut self,
        layer: usize,
        kind: BufferKind,
        slots: &[SlotRef],
    ) -> Vec<(SlotRef, Vec<u8>)> {
        let mut out = Vec::new();
        if self.pending.is_empty() {
            return out;
        }
        for s in slots {
            let key = (layer, kind, s.page.id, s.offset);
            if self
                .pending
                .get(&key)
                .is_some_and(|(old, _)| old.generation != s.page.generation)
            {
                if let Some((old, row)) = self.pending.remove(&key) {
                    out.push((
                        SlotRef {
                            page: old,
                            offset: s.offset,
                        },
                        row,
                    ));
                }
            }
        }
        if !out.is_empty() {
            self.order.retain(|k| self.pending.contains_key(k));
        }
        out
    }

    /// Rows waiting.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(id: u32, generation: u32, offset: u32) -> SlotRef {
        SlotRef {
            page: PageRef { id, generation },
            offset,
        }
    }

    #[test]
    fn rows_of_released_pages_land_once_on_the_next_owner() {
        let mut l = LateWrites::default();
        l.record(
            0,
            BufferKind::Kv,
            &[slot(3, 1, 0), slot(3, 1, 1)],
            &[7, 7, 8, 8],
            2,
        );
        l.record(0, BufferKind::Kv, &[slot(4, 0, 0)], &[9, 9], 2);
        // A stale release of page 3 (wrong generation) orphans nothing.
        l.orphan(&[PageRef {
            id: 3,
            generation: 0,
        }]);
        assert_eq!(l.pending(), 0);
        l.record(0, BufferKind::Kv, &[slot(3, 1, 0)], &[6, 6], 2);
        l.orphan(&[PageRef {
            id: 3,
            generation: 1,
        }]);
        assert_eq!(l.pending(), 2);
        // The same generation (the owner itself) or another layer / kind: nothing due.
        assert!(l.due(0, BufferKind::Kv, &[slot(3, 1, 0)]).is_empty());
        assert!(l.due(1, BufferKind::Kv, &[slot(3, 2, 0)]).is_empty());
        assert!(l.due(0, BufferKind::IndexK, &[slot(3, 2, 0)]).is_empty());
        let due = l.due(0, BufferKind::Kv, &[slot(3, 2, 1), slot(3, 2, 0)]);
        assert_eq!(
            due,
            vec![(slot(3, 1, 1), vec![8, 8]), (slot(3, 1, 0), vec![6, 6])]
        );
        assert!(
            l.due(0, BufferKind::Kv, &[slot(3, 2, 0)]).is_empty(),
            "once"
        );
        assert_eq!(l.pending(), 0);
    }

    #[test]
    fn pending_rows_are_bounded() {
        let mut l = LateWrites::default();
        for id in 0..(MAX_PENDING as u32 / 16 + 10) {
            let slots: Vec<SlotRef> = (0..16).map(|o| slot(id, 0, o)).collect();
            l.record(0, BufferKind::Kv, &slots, &[1; 16], 1);
            l.orphan(&[PageRef { id, generation: 0 }]);
        }
        assert_eq!(l.pending(), MAX_PENDING);
    }
}
