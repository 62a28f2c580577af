//! Ragged-batch metadata shared by the ops: per-request page tables and query ranges.

use crate::error::{Error, Result};
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
    /// The page ids of request `r`.
    pub fn row(&self, r: usize) -> &'a [i32] {
        &self.pages[r * self.max_pages..(r + 1) * self.max_pages]
    }
    /// Slot of token position `pos` of request `r` (assumes a validated table).
    #[inline]
    pub fn slot(&self, r: usize, pos: usize, page_size: usize) -> usize {
        let at = SlotAddr::of(pos, page_size);
        SlotAddr {
            page: self.pages[r * self.max_pages + at.page] as usize,
            ..at
        }
        .slot(page_size)
    }
    /// Checks that positions `0..end` of request `r` map to pages inside a pool of
    /// `num_pages` pages.
    pub fn check_covers(
        &self,
        r: usize,
        end: usize,
        page_size: usize,
        num_pages: usize,
    ) -> Result<()> {
        let needed = end.div_ceil(page_size);
        if needed > self.max_pages {
            return Err(Error::invalid(
                "page_table",
                format!(
                    "request {r} needs {needed} pages for {end} tokens, rows hold {}",
                    self.max_pages
                ),
            ));
        }
        for (p, &page) in self.row(r)[..needed].iter().enumerate() {
            if page < 0 || page as usize >= num_pages {
                return Err(Error::PageOutOfRange {
                    what: "page_table",
                    index: r * self.max_pages + p,
                    page: page as i64,
                    num_pages,
                });
            }
        }
        Ok(())
    }
}

/// One row of a ragged query batch (defined with the kernels that read it).
pub use sparsekit_kernels::params::QueryRange;

/// The rows of decode-form queries: request `r` with context length `L` (including its
/// `next_n` new tokens) contributes rows `j = 0..next_n`, row `j` seeing `[0, L - next_n + j + 1)`.
pub fn decode_rows(context_lens: &[u32], next_n: usize) -> Result<Vec<QueryRange>> {
    if next_n == 0 {
        return Err(Error::invalid("next_n", "must be at least 1"));
    }
    let mut rows = Vec::with_capacity(context_lens.len() * next_n);
    for (r, &len) in context_lens.iter().enumerate() {
        if (len as usize) < next_n {
            return Err(Error::invalid(
                "context_lens",
                format!("request {r} has context {len} < next_n {next_n}"),
            ));
        }
        for j in 0..next_n {
            rows.push(QueryRange {
                request: r as u32,
                start: 0,
                end: len - (next_n - 1 - j) as u32,
            });
        }
    }
    Ok(rows)
}

pub(super) fn check_rows(
    rows: &[QueryRange],
    page_table: &PageTable<'_>,
    page_size: usize,
    num_pages: usize,
    row_stride: usize,
) -> Result<()> {
    for (i, q) in rows.iter().enumerate() {
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
        if q.request as usize >= page_table.num_requests() {
            return Err(bad(format!(
                "request {} not in page table of {} requests",
                q.request,
                page_table.num_requests()
            )));
        }
        page_table.check_covers(q.request as usize, q.end as usize, page_size, num_pages)?;
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
        assert!(decode_rows(&[1], 2).is_err());
        assert!(decode_rows(&[1], 0).is_err());
    }
}
