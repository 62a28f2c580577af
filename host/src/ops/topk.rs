//! `topk`: exact top-k per query row.

use super::{check_bytes, PageTable, QueryRange};
use crate::error::{Error, Result};

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

/// `topk`: exact top-`k` per row over the columns in the row's range, ignoring `-inf` and
/// NaN entries; ties broken by lower position. The selected entries are written in
/// ascending position order, followed by `-1` padding when fewer than `k` are valid.
#[derive(Clone, Copy, Debug)]
pub struct Topk<'a> {
    pub k: usize,
    pub row_stride: usize,
    pub rows: &'a [QueryRange],
    pub output: TopkOutput<'a>,
}

impl Topk<'_> {
    /// Validates the call against the buffer sizes (bytes).
    pub fn validate(&self, logits_bytes: usize, out_bytes: usize) -> Result<()> {
        if self.k == 0 {
            return Err(Error::invalid("k", "must be positive"));
        }
        if self.row_stride > i32::MAX as usize {
            return Err(Error::invalid("row_stride", "positions must fit in i32"));
        }
        let n = self.rows.len();
        check_bytes("logits", n * self.row_stride * 4, logits_bytes)?;
        check_bytes("topk", n * self.k * 4, out_bytes)?;
        for (i, q) in self.rows.iter().enumerate() {
            if q.start > q.end || q.end as usize > self.row_stride {
                return Err(Error::InvalidRange {
                    row: i,
                    start: q.start as i64,
                    end: q.end as i64,
                    reason: format!(
                        "must satisfy start <= end <= row_stride {}",
                        self.row_stride
                    ),
                });
            }
        }
        if let TopkOutput::Slots {
            page_table,
            page_size,
        } = self.output
        {
            if page_size == 0 {
                return Err(Error::invalid("page_size", "must be positive"));
            }
            for (i, q) in self.rows.iter().enumerate() {
                if q.request as usize >= page_table.num_requests() {
                    return Err(Error::InvalidRange {
                        row: i,
                        start: q.start as i64,
                        end: q.end as i64,
                        reason: format!("request {} not in page table", q.request),
                    });
                }
                // Slots must fit in i32; pages beyond the pool are the consumer's check.
                page_table.check_covers(
                    q.request as usize,
                    q.end as usize,
                    page_size,
                    i32::MAX as usize / page_size,
                )?;
            }
        }
        Ok(())
    }
}
