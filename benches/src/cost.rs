//! The cost model: bytes a minimal implementation of each op must move (read + write, each
//! input byte read once, each output byte written once) and the FLOPs it must do.
//!
//! - `indexer_logits`: the index-K bytes (values + scales) of every distinct key position
//!   any row of a request sees, q (bf16), weights (f32) and the logits written (f32, the
//!   whole `row_stride`); `2·H·D + 2·H` FLOP per (row, visible key): the `H` dot products
//!   of length `D` and the weighted head sum (ReLU and the key scale are not counted).
//! - `topk`: the visible logits read and the `k` indices per row written; no FLOPs (a
//!   selection is comparisons, memory-bound).
//! - `sparse_mla`: per query token, the KV bytes of each valid selected slot, the indices,
//!   q (bf16), out (bf16) and lse (f32); `2·h_q·(d_qk + d_v)` FLOP per (token, valid slot):
//!   `q·k` over `d_qk` and `p·v` over `d_v` for every head (softmax not counted).

use serde::Serialize;
use sparsekit_host::ops::QueryRange;
use sparsekit_host::{IndexKLayout, KvLayout};

/// Bytes moved and FLOPs done by one op call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Cost {
    pub bytes: u64,
    pub flops: u64,
    /// The FLOPs are products of bf16 values (the indexer's and attention's dot products):
    /// on a CPU path with the bf16 dot-product instruction they are read against its peak
    /// ([`crate::roofline::Roofline::compute_peak`]), elsewhere against the f32 FMA peak.
    pub bf16_dot: bool,
    /// The FLOPs are the GEMM the `amx` path runs on AMX tiles (the indexer's scores):
    /// there they are read against the tile peak.
    pub tiles: bool,
}

/// Merged length of the half-open ranges (any order, possibly overlapping).
fn union_len(mut ranges: Vec<(u64, u64)>) -> u64 {
    ranges.retain(|&(s, e)| s < e);
    ranges.sort_unstable();
    let mut total = 0;
    let mut cur: Option<(u64, u64)> = None;
    for (s, e) in ranges {
        cur = match cur {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    total + cur.map_or(0, |(s, e)| e - s)
}

/// See the module docs.
pub fn indexer_logits(
    layout: &IndexKLayout,
    n_heads: usize,
    rows: &[QueryRange],
    row_stride: usize,
) -> Cost {
    let (h, d) = (n_heads as u64, layout.head_dim() as u64);
    let n_rows = rows.len() as u64;
    let n_requests = rows
        .iter()
        .map(|r| r.request as usize + 1)
        .max()
        .unwrap_or(0);
    let mut per_request: Vec<Vec<(u64, u64)>> = vec![Vec::new(); n_requests];
    let mut pairs = 0u64;
    for r in rows {
        per_request[r.request as usize].push((r.start as u64, r.end as u64));
        pairs += (r.end as u64).saturating_sub(r.start as u64);
    }
    let keys: u64 = per_request.into_iter().map(union_len).sum();
    let bytes = keys * layout.bytes_per_token() as u64
        + n_rows * h * d * 2
        + n_rows * h * 4
        + n_rows * row_stride as u64 * 4;
    Cost {
        bytes,
        flops: pairs * (2 * h * d + 2 * h),
        bf16_dot: true,
        tiles: true,
    }
}

/// See the module docs.
pub fn topk(rows: &[QueryRange], k: usize) -> Cost {
    let read: u64 = rows
        .iter()
        .map(|r| (r.end as u64).saturating_sub(r.start as u64) * 4)
        .sum();
    Cost {
        bytes: read + rows.len() as u64 * k as u64 * 4,
        flops: 0,
        bf16_dot: false,
        tiles: false,
    }
}

/// See the module docs. `indices`: `[n_tokens, topk]`, `-1` = invalid.
pub fn sparse_mla(layout: &KvLayout, n_tokens: usize, n_heads: usize, indices: &[i32]) -> Cost {
    let (t, h) = (n_tokens as u64, n_heads as u64);
    let (dqk, dv) = (layout.d_qk() as u64, layout.nope_dim() as u64);
    let valid = indices.iter().filter(|&&i| i >= 0).count() as u64;
    let bytes = valid * layout.bytes_per_token() as u64
        + indices.len() as u64 * 4
        + t * h * dqk * 2
        + t * h * dv * 2
        + t * h * 4;
    Cost {
        bytes,
        flops: valid * 2 * h * (dqk + dv),
        bf16_dot: true,
        tiles: false,
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    reason = "tests: a failure panics with its message"
)]
mod tests {
    use super::*;
    use sparsekit_host::ops::decode_rows;
    use sparsekit_host::{IndexKDtype, KvDtype};

    #[test]
    fn dsv32_indexer_cost() {
        let l = IndexKLayout::new(IndexKDtype::FP8, 128, 64).unwrap();
        let rows = decode_rows(&[65536; 8], 1).unwrap();
        let c = indexer_logits(&l, 64, &rows, 65536);
        let keys = 8 * 65536 * 132;
        assert_eq!(
            c.bytes,
            keys + 8 * 64 * 128 * 2 + 8 * 64 * 4 + 8 * 65536 * 4
        );
        assert_eq!(c.flops, 8 * 65536 * (2 * 64 * 128 + 2 * 64));
        // next_n 2: the two rows of a request share their keys.
        let rows = decode_rows(&[100, 50], 2).unwrap();
        let c = indexer_logits(&l, 1, &rows, 100);
        assert_eq!(c.bytes, 150 * 132 + 4 * (128 * 2 + 4 + 400));
        assert_eq!(c.flops, (99 + 100 + 49 + 50) * (2 * 128 + 2));
    }

    #[test]
    fn union_merges_overlaps() {
        assert_eq!(union_len(vec![(0, 10), (5, 12), (20, 25), (3, 3)]), 17);
        assert_eq!(union_len(vec![]), 0);
    }

    #[test]
    fn topk_and_sparse_mla_cost() {
        let rows = decode_rows(&[65536; 64], 1).unwrap();
        assert_eq!(topk(&rows, 2048).bytes, 64 * (65536 + 2048) * 4);
        let l = KvLayout::new(KvDtype::Bf16, 512, 64, 64).unwrap();
        let idx = [0, 1, -1, 5];
        let c = sparse_mla(&l, 1, 64, &idx);
        assert_eq!(c.flops, 3 * 2 * 64 * (576 + 512));
        assert_eq!(
            c.bytes,
            3 * 1152 + 16 + 64 * 576 * 2 + 64 * 512 * 2 + 64 * 4
        );
    }
}
