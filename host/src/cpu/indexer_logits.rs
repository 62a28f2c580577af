//! CPU lightning-indexer logits.
//!
//! Rows are grouped (consecutive rows of one request, up to `GROUP_ROWS_X_HEADS` query
//! heads in all) so a block of keys is decoded once for the group; each (group, column
//! chunk) is one parallel task. Per block, the keys are dequantised to f32 rows and
//! `Cᵀ[keys × heads] = K · Qᵀ` runs on [`gemm_acc`] (Qᵀ built once per task); the
//! weighted ReLU head reduction then runs in head order, 16 keys at a time, compiled for
//! the CPU's vector ISA. Every logit is computed with the same operations whatever the
//! grouping: batch-invariant.

use half::bf16;
use rayon::prelude::*;

use super::gemm::{gemm_acc, Dims};
use super::isa::CpuIsa;
use crate::layout::{IndexKDtype, IndexKLayout};
use crate::ops::{IndexerLogits, PageTable, QueryRange};
use sparsekit_kernels::fp8::{bf16_to_f32, e4m3_to_f32};

/// Keys per block (columns of one GEMM).
const BLOCK: usize = 64;
/// Output columns per parallel task.
const CHUNK: usize = 32 * BLOCK;
/// Upper bound on `rows × n_heads` in one group (GEMM `m`).
const GROUP_ROWS_X_HEADS: usize = 256;

/// Computes the logits on the vector path `isa`. Inputs are validated by the caller.
pub fn indexer_logits(
    isa: CpuIsa,
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
        isa,
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
        .for_each(|(g, col0, mut cells)| run_task(isa, &ctx, g, col0, &mut cells));
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
    isa: CpuIsa,
    layout: IndexKLayout,
    page_table: PageTable<'a>,
    h: usize,
    d: usize,
    rows: &'a [QueryRange],
    q: &'a [bf16],
    weights: &'a [f32],
    cache: &'a [u8],
}

crate::isa_dispatch! {
    /// [`Ctx::run`] compiled for the task's vector path (the epilogue's `mul_add` is
    /// otherwise a libm `fmaf` call per element). Every path does the same correctly
    /// rounded operations in the same order: results are identical.
    fn run_task(ctx: &Ctx<'_>, g: &Group, col0: usize, cells: &mut [&mut [f32]])
        = |ISA| ctx.run(g, col0, cells);
}

impl Ctx<'_> {
    #[inline(always)]
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
        // Qᵀ [d × m], once per task.
        let qs = &self.q[g.first * h * d..(g.first + g.len) * h * d];
        let mut qt = vec![0f32; d * m];
        for i in 0..m {
            for p in 0..d {
                qt[p * m + i] = bf16_to_f32(qs[i * d + p].to_bits());
            }
        }
        let mut krows = vec![0f32; BLOCK * d];
        let mut scale = [1f32; BLOCK];
        let mut c = vec![0f32; BLOCK * m];
        let mut acc = [0f32; BLOCK];
        let mut b0 = lo;
        while b0 < hi {
            let n = BLOCK.min(hi - b0);
            self.load_rows(g.request, b0, n, &mut krows, &mut scale);
            c[..m * BLOCK].fill(0.0);
            // Cᵀ[keys × m] = K[keys × d] · Qᵀ[d × m]
            gemm_acc(
                self.isa,
                Dims {
                    m: n,
                    n: m,
                    k: d,
                    lda: d,
                    ldb: m,
                    ldc: m,
                },
                &krows,
                &qt,
                &mut c,
            );
            for (r, cell) in cells.iter_mut().enumerate() {
                let row = &self.rows[g.first + r];
                let w = &self.weights[(g.first + r) * h..(g.first + r + 1) * h];
                let mut j0 = 0;
                while j0 < n {
                    let cnt = 16.min(n - j0);
                    let mut a16 = [0f32; 16];
                    let base = &c[j0 * m + r * h..];
                    if cnt == 16 {
                        for (hh, &wh) in w.iter().enumerate() {
                            for (jj, a) in a16.iter_mut().enumerate() {
                                *a = wh.mul_add(base[jj * m + hh].max(0.0), *a);
                            }
                        }
                    } else {
                        for (hh, &wh) in w.iter().enumerate() {
                            for (jj, a) in a16[..cnt].iter_mut().enumerate() {
                                *a = wh.mul_add(base[jj * m + hh].max(0.0), *a);
                            }
                        }
                    }
                    acc[j0..j0 + cnt].copy_from_slice(&a16[..cnt]);
                    j0 += cnt;
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

    /// Dequantises keys at positions `b0..b0+n` into rows of `krows[BLOCK][d]`.
    #[inline(always)]
    fn load_rows(&self, request: usize, b0: usize, n: usize, krows: &mut [f32], scale: &mut [f32]) {
        let l = &self.layout;
        let d = self.d;
        for j in 0..n {
            let slot = self.page_table.slot(request, b0 + j, l.page_size());
            let vals = &self.cache[l.slot_value_bytes(slot)];
            let dst = &mut krows[j * d..(j + 1) * d];
            match l.dtype() {
                IndexKDtype::Bf16 => {
                    for (x, b) in dst.iter_mut().zip(vals.chunks_exact(2)) {
                        *x = f32::from_bits(((b[1] as u32) << 24) | ((b[0] as u32) << 16));
                    }
                    scale[j] = 1.0;
                }
                IndexKDtype::Fp8E4m3 { .. } => {
                    for (x, &b) in dst.iter_mut().zip(vals) {
                        *x = e4m3_to_f32(b);
                    }
                    scale[j] = match l.slot_scale_bytes(slot) {
                        Some(r) => {
                            let b = &self.cache[r];
                            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
                        }
                        None => 1.0,
                    };
                }
            }
        }
    }
}
