//! Ragged-batch metadata shared by the ops: per-request page tables and query ranges.

use crate::error::{Error, Index, Result};
use crate::layout::SlotAddr;

/// Per-request page ids, `[num_requests, max_pages]` row-major; `-1` marks an unmapped
/// entry. Entry `p` of a request holds its tokens `p*page_size .. (p+1)*page_size`.
#[derive(Clone, Copy, Debug)]
pub struct PageTable<'a> {
    pages: &'a [i32],
    max_pages: usize,
}

impl<'a> PageTable<'a> {
    /// Wraps a row-major table whose rows are `max_pages` long.
    pub fn new(pages: &'a [i32], max_pages: usize) -> Result<Self> {
        if max_pages == 0 || pages.len() % max_pages != 0 {
            return Err(Error::invalid(
                "page_table",
                format!(
                    "{} entries is not a whole number of rows of {max_pages}",
                    pages.len()
                ),
            ));
        }
        Ok(PageTable { pages, max_pages })
    }
    /// Requests (rows) in the table.
    pub fn num_requests(&self) -> usize {
        self.pages.len() / self.max_pages
    }
    /// Entries per request.
    pub fn max_pages(&self) -> usize {
        self.max_pages
    }
    /// The raw row-major entries.
    pub fn as_slice(&self) -> &'a [i32] {
        self.pages
    }
    /// The page ids of request `r` (`None` past the last request).
    pub fn row(&self, r: usize) -> Option<&'a [i32]> {
        let start = r.checked_mul(self.max_pages)?;
        self.pages.get(start..start.checked_add(self.max_pages)?)
    }
    /// Slot of token position `pos` of request `r`, for positions an op has validated
    /// (panics on a position outside the table).
    #[inline]
    pub fn slot(&self, r: usize, pos: usize, page_size: usize) -> usize {
        let at = SlotAddr::of(pos, page_size);
        SlotAddr {
            page: self.pages[r * self.max_pages + at.page] as usize,
            ..at
        }
        .slot(page_size)
    }
    /// Replaces each token position `base + d` (for `d` in `positions`) of request `r` with
    /// its slot, for positions an op has validated (panics on a position outside the table
    /// and, in debug builds, on a slot past `i32::MAX`). The same map as [`PageTable::slot`],
    /// with shifts for a power-of-two page size (every deployment's: 1, 2, 64, 256) instead
    /// of a division per position.
    pub fn slots_in_place(&self, r: usize, base: usize, positions: &mut [i32], page_size: usize) {
        let row = &self.pages[r * self.max_pages..][..self.max_pages];
        if page_size.is_power_of_two() {
            let (shift, mask) = (page_size.trailing_zeros(), page_size - 1);
            for p in positions {
                let pos = *p as usize + base;
                let slot = ((row[pos >> shift] as usize) << shift) | (pos & mask);
                debug_assert!(slot <= i32::MAX as usize);
                *p = slot as i32;
            }
        } else {
            for p in positions {
                let slot = self.slot(r, *p as usize + base, page_size);
                debug_assert!(slot <= i32::MAX as usize);
                *p = slot as i32;
            }
        }
    }
    /// Checks that positions `start..end` of request `r` map to pages inside a pool of
    /// `num_pages` pages. Entries outside that range are never read and may be anything
    /// (`-1` for pages evicted before a window, say).
    pub fn check_covers(
        &self,
        r: usize,
        start: usize,
        end: usize,
        page_size: usize,
        num_pages: usize,
    ) -> Result<()> {
        for (p, page) in self.entries(r, start, end, page_size)? {
            if page < 0 || page as usize >= num_pages {
                return Err(Error::PageOutOfRange {
                    what: "page_table",
                    index: Index::Cell { row: r, col: p },
                    page: page as i64,
                    num_pages,
                });
            }
        }
        Ok(())
    }

    /// The entries `(column, page id)` of request `r` that hold its positions
    /// `start..end` (none when the range is empty); an error when the row is too short.
    pub fn entries(
        &self,
        r: usize,
        start: usize,
        end: usize,
        page_size: usize,
    ) -> Result<impl Iterator<Item = (usize, i32)> + 'a> {
        if page_size == 0 {
            return Err(Error::invalid("page_size", "must be positive"));
        }
        let row = self.row(r).ok_or_else(|| {
            Error::invalid(
                "page_table",
                format!("request {r} is not in a table of {}", self.num_requests()),
            )
        })?;
        let cols = if start < end {
            start / page_size..(end - 1) / page_size + 1
        } else {
            0..0
        };
        if cols.end > self.max_pages {
            return Err(Error::invalid(
                "page_table",
                format!(
                    "request {r} needs {} entries for positions up to {end}, rows hold {}",
                    cols.end, self.max_pages
                ),
            ));
        }
        Ok(cols.map(move |c| (c, row[c])))
    }
}

/// One row of a ragged query batch (defined with the kernels that read it).
pub use sparsekit_kernels::params::QueryRange;

/// The rows of decode-form queries: request `r` with context length `L` (including its
/// `next_n` new tokens) contributes rows `j = 0..next_n`, row `j` seeing
/// `[0, L - next_n + j + 1)`; rows are ordered by request, then `j`. Every context must
/// hold at least `next_n` tokens, and the batch at most [`MAX_COUNT`](super::MAX_COUNT)
/// rows.
pub fn decode_rows(context_lens: &[u32], next_n: usize) -> Result<Vec<QueryRange>> {
    if next_n == 0 {
        return Err(Error::invalid("next_n", "must be at least 1"));
    }
    for (r, &len) in context_lens.iter().enumerate() {
        if (len as usize) < next_n {
            return Err(Error::invalid(
                "context_lens",
                format!("request {r} has context {len} < next_n {next_n}"),
            ));
        }
    }
    let n = super::checked_size("decode rows", &[context_lens.len(), next_n])?;
    super::check_count("decode rows", n)?;
    let mut rows = Vec::new();
    rows.try_reserve_exact(n)
        .map_err(|e| Error::invalid("decode rows", format!("{n} rows cannot be allocated: {e}")))?;
    for (r, &len) in context_lens.iter().enumerate() {
        for j in 0..next_n {
            rows.push(QueryRange {
                request: r as u32,
                start: 0,
                // len >= next_n > next_n - 1 - j, checked above.
                end: len - (next_n - 1 - j) as u32,
            });
        }
    }
    Ok(rows)
}

/// Checks query rows against the page table and the output rows: `start <= end <=
/// row_stride`, the request in the table, and every position of `[start, end)` mapped to
/// a page of a pool of `num_pages` pages.
pub(super) fn check_rows(
    rows: &[QueryRange],
    page_table: &PageTable<'_>,
    page_size: usize,
    num_pages: usize,
    row_stride: usize,
) -> Result<()> {
    for (i, q) in rows.iter().enumerate() {
        check_row(i, q, page_table.num_requests(), row_stride)?;
        page_table.check_covers(
            q.request as usize,
            q.start as usize,
            q.end as usize,
            page_size,
            num_pages,
        )?;
    }
    Ok(())
}

/// Checks one query row: `start <= end <= row_stride`, `request < n_requests`.
pub(super) fn check_row(
    i: usize,
    q: &QueryRange,
    n_requests: usize,
    row_stride: usize,
) -> Result<()> {
    let bad = |reason: String| Error::InvalidRange {
        row: i,
        start: q.start as i64,
        end: q.end as i64,
        reason,
    };
    if q.start > q.end {
        return Err(bad("start after end".into()));
    }
    if q.end as usize > row_stride {
        return Err(bad(format!("end beyond row_stride {row_stride}")));
    }
    if q.request as usize >= n_requests {
        return Err(bad(format!(
            "request {} not in the page table of {n_requests} requests",
            q.request
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_rows_are_causal() {
        let rows = decode_rows(&[5, 1], 1).unwrap();
        assert_eq!(rows[0].end, 5);
        assert_eq!(rows[1].end, 1);
        let rows = decode_rows(&[5], 2).unwrap();
        assert_eq!((rows[0].end, rows[1].end), (4, 5));
        // Ordered by request, then j.
        let rows = decode_rows(&[3, 6], 2).unwrap();
        let got: Vec<(u32, u32)> = rows.iter().map(|q| (q.request, q.end)).collect();
        assert_eq!(got, [(0, 2), (0, 3), (1, 5), (1, 6)]);
        // Every context must hold next_n tokens: the error names the request.
        let e = decode_rows(&[4, 1], 2).unwrap_err().to_string();
        assert!(e.contains("request 1 has context 1 < next_n 2"), "{e}");
        assert!(decode_rows(&[1], 0).is_err());
        // Hostile sizes: a typed error, never an overflow or an allocation abort.
        assert!(decode_rows(&[u32::MAX; 2], usize::MAX).is_err());
        assert!(decode_rows(&[u32::MAX; 3], u32::MAX as usize).is_err());
        assert!(decode_rows(&[], usize::MAX).unwrap().is_empty());
    }

    #[test]
    fn only_the_range_must_be_mapped() {
        // Request 0: pages [-1, 3, 4]: positions 4..12 are mapped, 0..4 are not.
        let pages = [-1, 3, 4];
        let pt = PageTable::new(&pages, 3).unwrap();
        assert!(pt.check_covers(0, 4, 12, 4, 5).is_ok());
        assert!(pt.check_covers(0, 5, 5, 4, 5).is_ok());
        assert!(matches!(
            pt.check_covers(0, 3, 12, 4, 5),
            Err(Error::PageOutOfRange {
                index: Index::Cell { row: 0, col: 0 },
                page: -1,
                ..
            })
        ));
        // Past the row's entries, and a page past the pool.
        assert!(pt.check_covers(0, 4, 13, 4, 5).is_err());
        assert!(matches!(
            pt.check_covers(0, 8, 12, 4, 4),
            Err(Error::PageOutOfRange {
                index: Index::Cell { row: 0, col: 2 },
                page: 4,
                ..
            })
        ));
        let e = pt.check_covers(0, 0, 1, 4, 5).unwrap_err();
        assert!(e.to_string().contains("page_table[0][0]"), "{e}");
    }
}
