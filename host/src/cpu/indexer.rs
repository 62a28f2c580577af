//! CPU lightning-indexer logits.
//!
//! Rows are grouped (consecutive rows of one request, up to [`GROUP_ROWS_X_HEADS`] query
//! heads in all) so a block of keys is decoded once for the group; each (group, column
//! chunk) is one parallel task. Per block, the key tile is dequantised to f32, transposed
//! (`[head_dim, keys]`) and multiplied with the group's queries by [`gemm_acc`]; the head
//! reduction then runs in head order. Every logit is therefore computed with the same
//! operations whatever the grouping: batch-invariant.

use half::bf16;
use rayon::prelude::*;

use super::gemm::{gemm_acc, Dims};
use crate::dtype::E4M3_TABLE;
use crate::layout::{IndexKDtype, IndexKLayout};
use crate::ops::{IndexerLogits, PageTable, QueryRange};

/// Keys per block (columns of one GEMM).
const BLOCK: usize = 64;
/// Output columns per parallel task.
const CHUNK: usize = 32 * BLOCK;
/// Upper bound on `rows × n_heads` in one group (GEMM `m`).
const GROUP_ROWS_X_HEADS: usize = 256;

/// Computes the logits. Inputs are validated by the caller.
pub fn indexer_logits(
    op: &IndexerLogits<'_>,
    q: &[bf16],
    weights: &[f32],
    cache: &[u8],
    out: &mut [f32],
) {
    let h = op.n_heads;
    let d = op.layout.head_dim();
    let stride = op.row_stride;
    if op.rows.is_empty() || stride == 0 {
        return;
    }
    let groups = group_rows(&op.rows, (GROUP_ROWS_X_HEADS / h).max(1));
    let n_chunks = stride.div_ceil(CHUNK);
    // One &mut slice per (row, chunk); then hand each task its group's slices.
    let mut cells: Vec<Vec<&mut [f32]>> = out
        .chunks_mut(stride)
        .map(|row| row.chunks_mut(CHUNK).collect())
        .collect();
    let mut tasks = Vec::with_capacity(groups.len() * n_chunks);
    let mut row_iter = cells.iter_mut();
    for g in &groups {
        let mut per_chunk: Vec<Vec<&mut [f32]>> = (0..n_chunks).map(|_| Vec::new()).collect();
        for row_cells in row_iter.by_ref().take(g.len) {
            for (c, cell) in row_cells.drain(..).enumerate() {
                per_chunk[c].push(cell);
            }
        }
        for (c, cells) in per_chunk.into_iter().enumerate() {
            tasks.push((g, c * CHUNK, cells));
        }
    }
    let ctx = Ctx {
        layout: op.layout,
        page_table: op.page_table,
        h,
        d,
        rows: &op.rows,
        q,
        weights,
        cache,
    };
    tasks
        .into_par_iter()
        .for_each(|(g, col0, mut cells)| ctx.run(g, col0, &mut cells));
}

/// A run of consecutive rows of one request.
#[derive(Clone, Copy, Debug)]
struct Group {
    first: usize,
    len: usize,
    request: usize,
    lo: usize,
    hi: usize,
}

fn group_rows(rows: &[QueryRange], max_rows: usize) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let (lo, hi) = (r.start as usize, r.end as usize);
        match groups.last_mut() {
            Some(g) if g.request == r.request as usize && g.len < max_rows => {
                g.len += 1;
                // Empty ranges do not widen the group's key span.
                if lo < hi {
                    if g.lo >= g.hi {
                        (g.lo, g.hi) = (lo, hi);
                    } else {
                        g.lo = g.lo.min(lo);
                        g.hi = g.hi.max(hi);
                    }
                }
            }
            _ => groups.push(Group {
                first: i,
                len: 1,
                request: r.request as usize,
                lo,
                hi,
            }),
        }
    }
    groups
}

struct Ctx<'a> {
    layout: IndexKLayout,
    page_table: PageTable<'a>,
    h: usize,
    d: usize,
    rows: &'a [QueryRange],
    q: &'a [bf16],
    weights: &'a [f32],
    cache: &'a [u8],
}

impl Ctx<'_> {
    fn run(&self, g: &Group, col0: usize, cells: &mut [&mut [f32]]) {
        let width = cells.first().map_or(0, |c| c.len());
        let col_end = col0 + width;
        for cell in cells.iter_mut() {
            cell.fill(f32::NEG_INFINITY);
        }
        let (lo, hi) = (g.lo.max(col0), g.hi.min(col_end));
        if lo >= hi {
            return;
        }
        let (h, d) = (self.h, self.d);
        let m = g.len * h;
        let qf: Vec<f32> = self.q[g.first * h * d..(g.first + g.len) * h * d]
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let mut kt = vec![0f32; d * BLOCK];
        let mut scale = [1f32; BLOCK];
        let mut c = vec![0f32; m * BLOCK];
        let mut acc = [0f32; BLOCK];
        let mut b0 = lo;
        while b0 < hi {
            let n = BLOCK.min(hi - b0);
            self.load_keys(g.request, b0, n, &mut kt, &mut scale);
            c[..m * BLOCK].fill(0.0);
            gemm_acc(
                Dims {
                    m,
                    n,
                    k: d,
                    lda: d,
                    ldb: BLOCK,
                    ldc: BLOCK,
                },
                &qf,
                &kt,
                &mut c,
            );
            for (r, cell) in cells.iter_mut().enumerate() {
                let row = &self.rows[g.first + r];
                let w = &self.weights[(g.first + r) * h..(g.first + r + 1) * h];
                acc[..n].fill(0.0);
                for (hh, &wh) in w.iter().enumerate() {
                    let crow = &c[(r * h + hh) * BLOCK..][..n];
                    for (a, &x) in acc[..n].iter_mut().zip(crow) {
                        *a = wh.mul_add(x.max(0.0), *a);
                    }
                }
                let (rs, re) = (row.start as usize, row.end as usize);
                for j in 0..n {
                    let pos = b0 + j;
                    if pos >= rs && pos < re {
                        cell[pos - col0] = acc[j] * scale[j];
                    }
                }
            }
            b0 += n;
        }
    }

    /// Dequantises keys at positions `b0..b0+n` of `request` into `kt[d][BLOCK]` (column j
    /// = position `b0 + j`) and their scales (1 for bf16).
    fn load_keys(&self, request: usize, b0: usize, n: usize, kt: &mut [f32], scale: &mut [f32]) {
        let l = &self.layout;
        let ps = l.page_size();
        let bpp = l.bytes_per_page();
        for j in 0..n {
            let slot = self.page_table.slot(request, b0 + j, ps);
            let (page, off) = (slot / ps, slot % ps);
            let page_bytes = &self.cache[page * bpp..(page + 1) * bpp];
            let vals = &page_bytes[l.value_range(off)];
            match l.dtype() {
                IndexKDtype::Bf16 => {
                    for (dd, b) in vals.chunks_exact(2).enumerate() {
                        kt[dd * BLOCK + j] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                    }
                    scale[j] = 1.0;
                }
                IndexKDtype::Fp8E4m3 { .. } => {
                    for (dd, &b) in vals.iter().enumerate() {
                        kt[dd * BLOCK + j] = E4M3_TABLE[b as usize];
                    }
                    scale[j] = l
                        .scale_range(off)
                        .map(|r| {
                            f32::from_le_bytes([
                                page_bytes[r.start],
                                page_bytes[r.start + 1],
                                page_bytes[r.start + 2],
                                page_bytes[r.start + 3],
                            ])
                        })
                        .unwrap_or(1.0);
                }
            }
        }
    }
}
