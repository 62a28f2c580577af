//! `topk`: exact top-k per query row.

use super::batch::check_row;
use super::{check_count, check_size, PageTable, QueryRange};
use crate::error::{Error, Index, Result};

/// What top-k writes for each selected position.
#[derive(Clone, Copy, Debug)]
pub enum TopkOutput<'a> {
    /// The token position within the request (the logits column).
    Positions,
    /// The cache slot `page * page_size + offset` of that position.
    Slots {
        page_table: PageTable<'a>,
        page_size: usize,
    },
}

/// What a row whose range holds at most `k` positions gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ShortRows {
    /// Its valid entries (not `-inf`, not NaN), like any row.
    #[default]
    SelectValid,
    /// Every position of its range, in order, whatever the logits (DeepSeek-V4's top-k
    /// transform: a request whose compressed context fits in `k` attends all of it).
    TakeAll,
}

/// `topk`: exact top-`k` per row over the columns in the row's range `[start, end)` (the
/// other columns are not read), ignoring `-inf` and NaN entries (`+inf` is a value like
/// any other; `-0.0` and `+0.0` are equal, a tie); ties broken by lower position. The
/// selected entries are written in ascending position order, followed by `-1` padding
/// when fewer than `k` are valid. With [`ShortRows::TakeAll`], a row whose range holds at
/// most `k` positions writes all of them in order, then `-1`.
#[derive(Clone, Copy, Debug)]
pub struct Topk<'a> {
    /// What a row no longer than `k` gets.
    pub short_rows: ShortRows,
    pub k: usize,
    pub row_stride: usize,
    pub rows: &'a [QueryRange],
    pub output: TopkOutput<'a>,
}

impl Topk<'_> {
    /// Validates the call against the buffer sizes (bytes). With slot output, every
    /// position of every row's `[start, end)` must map to a page (entries outside those
    /// ranges are not read) whose slots fit in the i32 output; top-k reads no pool, so
    /// page ids are not checked against one (the consumer of the slots does that).
    pub fn validate(&self, logits_bytes: usize, out_bytes: usize) -> Result<()> {
        if self.k == 0 {
            return Err(Error::invalid("k", "must be positive"));
        }
        check_count("k", self.k)?;
        check_count("rows", self.rows.len())?;
        if self.row_stride > i32::MAX as usize {
            return Err(Error::invalid(
                "row_stride",
                format!(
                    "{} is above {}: positions must fit in i32",
                    self.row_stride,
                    i32::MAX
                ),
            ));
        }
        let n = self.rows.len();
        check_size("logits", &[n, self.row_stride, 4], logits_bytes)?;
        check_size("topk", &[n, self.k, 4], out_bytes)?;
        let n_requests = match self.output {
            TopkOutput::Positions => usize::MAX,
            TopkOutput::Slots { page_table, .. } => page_table.num_requests(),
        };
        for (i, q) in self.rows.iter().enumerate() {
            check_row(i, q, n_requests, self.row_stride)?;
        }
        if let TopkOutput::Slots {
            page_table,
            page_size,
        } = self.output
        {
            if page_size == 0 {
                return Err(Error::invalid("page_size", "must be positive"));
            }
            check_count("page_size", page_size)?;
            check_count("page_table columns", page_table.max_pages())?;
            // The largest page id whose last slot fits the i32 output.
            let last_whole_page = (i32::MAX as usize)
                .checked_sub(page_size - 1)
                .map(|s| (s / page_size) as u32);
            for (i, q) in self.rows.iter().enumerate() {
                let (r, start, end) = (q.request as usize, q.start as usize, q.end as usize);
                // Fast accept: every entry in `0..=last_page`, the pages whose every slot
                // fits an i32 (a negative entry is above it as a u32): one unsigned
                // compare an entry, vectorised.
                if let Some(last_page) = last_whole_page {
                    let outside = page_table
                        .entries(r, start, end, page_size)?
                        .fold(false, |out, (_, p)| out | (p as u32 > last_page));
                    if !outside {
                        continue;
                    }
                }
                for (c, page) in page_table.entries(r, start, end, page_size)? {
                    let at = Index::Cell { row: r, col: c };
                    if page < 0 {
                        return Err(Error::invalid(
                            "page_table",
                            format!(
                                "page_table{at} = {page}: row {i} sees positions [{start}, {end}) of request {r}, and the slot output needs a page for each"
                            ),
                        ));
                    }
                    // The largest slot this entry gives a position of the row.
                    let last = end.min((c + 1) * page_size) - 1 - c * page_size;
                    let slot = (page as usize)
                        .checked_mul(page_size)
                        .and_then(|s| s.checked_add(last));
                    if slot.is_none_or(|s| s > i32::MAX as usize) {
                        return Err(Error::invalid(
                            "page_table",
                            format!(
                                "page_table{at} = {page}: slot {page}·{page_size} + {last} does not fit in the i32 top-k output"
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot past i32 is reported as such, at `[request][column]` of the page table, and
    /// never as a page "out of range of a pool" (top-k has no pool).
    #[test]
    fn slot_output_errors_name_the_cell_and_the_i32_limit() {
        let rows = [QueryRange {
            request: 1,
            start: 3,
            end: 9,
        }];
        // Request 1, column 1 holds positions 4..8: page 2^29 gives slot 2^31 + 1.
        let pages = [0, 1, 2, 3, 1 << 29, 5];
        let op = Topk {
            short_rows: crate::ops::ShortRows::SelectValid,
            k: 2,
            row_stride: 16,
            rows: &rows,
            output: TopkOutput::Slots {
                page_table: PageTable::new(&pages, 3).unwrap(),
                page_size: 4,
            },
        };
        let e = op.validate(16 * 4, 2 * 4).unwrap_err().to_string();
        assert!(e.contains("page_table[1][1] = 536870912"), "{e}");
        assert!(e.contains("does not fit in the i32 top-k output"), "{e}");
        assert!(!e.contains("pool"), "{e}");
        // The last page whose every slot fits: slot 2^29·4 − 1 = i32::MAX is accepted.
        let pages = [0, 1, 2, 3, (1 << 29) - 1, 5];
        let last = Topk {
            output: TopkOutput::Slots {
                page_table: PageTable::new(&pages, 3).unwrap(),
                page_size: 4,
            },
            ..op
        };
        last.validate(16 * 4, 2 * 4).unwrap();
        // An unmapped page inside the range: named by its cell and the row it serves.
        let pages = [0, 1, 2, 3, -1, 5];
        let op = Topk {
            short_rows: crate::ops::ShortRows::SelectValid,
            output: TopkOutput::Slots {
                page_table: PageTable::new(&pages, 3).unwrap(),
                page_size: 4,
            },
            ..op
        };
        let e = op.validate(16 * 4, 2 * 4).unwrap_err().to_string();
        assert!(
            e.contains("page_table[1][1] = -1: row 0 sees positions [3, 9)"),
            "{e}"
        );
        assert!(!e.contains("pool"), "{e}");
    }
}
