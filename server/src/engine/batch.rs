//! One forward step's rows: every token computed in the step (decode tokens and prefill
//! chunks alike), with its position, cache slot, the causal key range its query sees, and
//! the page table of the step's sequences.

use sparsekit_host::ops::QueryRange;

use crate::engine::kv::SeqId;
use crate::error::EngineError;

/// Tokens of one sequence computed in a step: `tokens[i]` sits at position `start + i`.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` (tokens before it are already in the cache).
    pub start: usize,
    /// Whether the step must return logits for this chunk's last token.
    pub logits: bool,
}

/// Where a chunk's rows sit in a [`StepBatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkRows {
    pub seq: SeqId,
    /// First row of the chunk.
    pub first: usize,
    /// Rows of the chunk.
    pub len: usize,
    /// Index into [`StepBatch::logit_rows`] when the chunk asked for logits.
    pub logits: Option<usize>,
}

/// The rows of one step (see the module docs). Row `i` belongs to the chunk that covers
/// it; chunk `c` is request `c` of the page table and of the query ranges.
#[derive(Clone, Debug, Default)]
pub struct StepBatch {
    /// Token id per row.
    pub tokens: Vec<u32>,
    /// Position per row.
    pub positions: Vec<u32>,
    /// Cache slot per row (`page · page_size + offset`).
    pub slots: Vec<i64>,
    /// Causal key range per row: chunk `c`'s row at position `p` sees `[0, p + 1)`.
    pub rows: Vec<QueryRange>,
    /// Row-major `[chunks, max_pages]` page ids (`-1` past a chunk's pages).
    pub page_table: Vec<i32>,
    pub max_pages: usize,
    /// Longest key range (`max(p) + 1`): the indexer's logits row stride.
    pub row_stride: usize,
    /// Rows whose logits the step returns, in chunk order.
    pub logit_rows: Vec<u32>,
    pub chunks: Vec<ChunkRows>,
}

impl StepBatch {
    /// Builds a step from chunks (at most one per sequence) and each sequence's page ids
    /// (`pages(seq)`, in token order, covering the chunk's last position).
    pub fn build<'p>(
        chunks: &[SeqChunk<'_>],
        page_size: usize,
        mut pages: impl FnMut(SeqId) -> Result<&'p [i32], EngineError>,
    ) -> Result<StepBatch, EngineError> {
        let mut b = StepBatch::default();
        let mut tables: Vec<&'p [i32]> = Vec::with_capacity(chunks.len());
        let mut seen = std::collections::HashSet::new();
        for ch in chunks {
            if !seen.insert(ch.seq) {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence {} appears twice in one step",
                    ch.seq
                )));
            }
            if ch.tokens.is_empty() {
                return Err(EngineError::InvalidRequest(format!(
                    "empty chunk for sequence {}",
                    ch.seq
                )));
            }
            let end = ch.start + ch.tokens.len();
            let p = pages(ch.seq)?;
            if p.len() * page_size < end {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence {} holds {} pages, {end} tokens need {}",
                    ch.seq,
                    p.len(),
                    end.div_ceil(page_size)
                )));
            }
            b.max_pages = b.max_pages.max(end.div_ceil(page_size));
            b.row_stride = b.row_stride.max(end);
            tables.push(p);
        }
        b.max_pages = b.max_pages.max(1);
        for (c, (ch, p)) in chunks.iter().zip(&tables).enumerate() {
            let first = b.tokens.len();
            for (i, &t) in ch.tokens.iter().enumerate() {
                let pos = ch.start + i;
                b.tokens.push(t);
                b.positions.push(pos as u32);
                b.slots
                    .push(p[pos / page_size] as i64 * page_size as i64 + (pos % page_size) as i64);
                b.rows.push(QueryRange {
                    request: c as u32,
                    start: 0,
                    end: pos as u32 + 1,
                });
            }
            let needed = (ch.start + ch.tokens.len()).div_ceil(page_size);
            b.page_table.extend_from_slice(&p[..needed]);
            b.page_table
                .extend(std::iter::repeat_n(-1, b.max_pages - needed));
            let logits = ch.logits.then(|| {
                b.logit_rows.push((first + ch.tokens.len() - 1) as u32);
                b.logit_rows.len() - 1
            });
            b.chunks.push(ChunkRows {
                seq: ch.seq,
                first,
                len: ch.tokens.len(),
                logits,
            });
        }
        Ok(b)
    }

    /// Rows in the step.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the step has no rows.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_rows_slots_and_tables() {
        let pages_a = [7, 2];
        let pages_b = [4, 5, 6];
        let chunks = [
            SeqChunk {
                seq: 10,
                tokens: &[1],
                start: 20,
                logits: true,
            },
            SeqChunk {
                seq: 11,
                tokens: &[3, 4, 5],
                start: 15,
                logits: false,
            },
        ];
        let b = StepBatch::build(&chunks, 16, |s| {
            Ok(if s == 10 { &pages_a[..] } else { &pages_b[..] })
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.positions, [20, 15, 16, 17]);
        assert_eq!(b.slots, [2 * 16 + 4, 4 * 16 + 15, 5 * 16, 5 * 16 + 1]);
        assert_eq!(b.max_pages, 2);
        assert_eq!(b.page_table, [7, 2, 4, 5]);
        assert_eq!(b.row_stride, 21);
        assert_eq!(
            b.rows[1],
            QueryRange {
                request: 1,
                start: 0,
                end: 16
            }
        );
        assert_eq!(b.logit_rows, [0]);
        assert_eq!(b.chunks[1].logits, None);
        // Too few pages, duplicates and empty chunks are refused.
        let short = [SeqChunk {
            seq: 1,
            tokens: &[1, 2],
            start: 31,
            logits: true,
        }];
        assert!(StepBatch::build(&short, 16, |_| Ok(&pages_a[..])).is_err());
        let dup = [chunks[0], chunks[0]];
        assert!(StepBatch::build(&dup, 16, |_| Ok(&pages_a[..])).is_err());
        let empty = [SeqChunk {
            seq: 1,
            tokens: &[],
            start: 0,
            logits: true,
        }];
        assert!(StepBatch::build(&empty, 16, |_| Ok(&pages_a[..])).is_err());
    }
}
