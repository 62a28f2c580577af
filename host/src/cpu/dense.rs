//! CPU kernels of the dense model ops ([`crate::model_ops`]) and the `cpu` backend's
//! [`ModelOps`]. The GPU backends run the same arithmetic as kernels
//! (`crate::launcher::dense`): the bits agree.
//!
//! Parallelism never changes a result: rows (or column blocks) are split across the
//! calling thread and rayon's workers (the `tasks` module), but every output element is
//! computed by the same sequence of f32 operations wherever it lands. The matmul core is
//! [`super::gemm::gemm_acc`] (one FMA per term, in order, on every ISA).

use half::bf16;
use sparsekit_kernels::math::exp_portable;

use super::buffer::CpuBuffer;
use super::dot::round_bf16;
use super::gemm::{few_rows_tile, gemm_acc, gemm_into, Dims};
use super::scratch;
use super::tasks::for_each_indexed;
use super::{CpuBackend, CpuIsa};
use crate::error::Result;
use crate::model_ops::{
    Accumulate, Add, Argmax, Cast, DenseDtype, Embed, GatedPool, GatherRows, Matmul, ModelOps,
    RmsNorm, Rope, SwiGlu, View,
};

/// Rows per parallel task for the cheap row-wise ops.
const ROW_CHUNK: usize = 32;

/// Rows per worker from which a matmul splits its rows across workers (each worker then
/// streams every weight once for its rows); below, it splits its columns (the weights are
/// streamed once in all, and every row of a column block reuses them from cache), unless
/// its weights are small ([`splits_rows`]).
const MATMUL_ROWS_PER_WORKER: usize = 128;

/// Rows below which the column split uses its narrowest blocks (decode: many tasks).
const MATMUL_FEW_ROWS: usize = 48;

/// Narrowest and widest column block of the column split (multiples of every vector tile
/// width): wide blocks when rows are many (each block re-reads every row of `x`).
const MATMUL_COL_BLOCK: usize = 64;
const MATMUL_COL_BLOCK_MAX: usize = 256;

/// Most bytes of weights (f32, every group) for which a matmul of few rows per worker
/// still splits its rows: below it the weights stay in cache for the second worker's
/// read, and a column split's tasks (each packing its block of the weights, filling and
/// copying a tile) cost more than they save.
const MATMUL_ROW_SPLIT_MAX_WEIGHTS: usize = 2 << 20;

/// Rows per worker from which small weights (above) are split by rows.
const MATMUL_ROW_SPLIT_MIN_ROWS: usize = 8;

/// Most passes over the weights of a row-split task on the few-rows GEMM path (its tile's
/// height each): beyond it, each pass costing another read of the weights from L2, the
/// column split is faster.
const MATMUL_ROW_SPLIT_MAX_PASSES: usize = 3;

/// Whether a matmul of `rows × k · k × n` in `groups` on `threads` workers splits its
/// rows (one task per worker) rather than its columns.
///
/// Zen 4, two threads (µs, column split → row split): on `avx512bf16`, 16 × 64 · 64 × 4096
/// 115 → 51, 32 × 128 · 128 × 1024 66 → 41, 32 × 128 · 128 × 512 (accumulating) 45 → 21,
/// 48 × 256 · 256 × 2048 349 → 233; on forced `avx2`, where 16 rows a worker take 8
/// passes of the few-rows tile, 32 × 64 · 64 × 4096 132–176 → 245–257 (kept on columns),
/// 32 × 128 · 128 × 512 38–58 → 21–23.
fn splits_rows(isa: CpuIsa, op: &Matmul, threads: usize) -> bool {
    let (rows, k, n) = (op.rows, op.k, op.n);
    if rows >= MATMUL_ROWS_PER_WORKER * threads || n < 2 * MATMUL_COL_BLOCK {
        return true;
    }
    let weights = op
        .groups
        .saturating_mul(k)
        .saturating_mul(n)
        .saturating_mul(4);
    if weights > MATMUL_ROW_SPLIT_MAX_WEIGHTS || rows < MATMUL_ROW_SPLIT_MIN_ROWS * threads {
        return false;
    }
    let chunk = row_chunk(rows, threads);
    few_rows_tile(isa, chunk).is_none_or(|tile| chunk <= MATMUL_ROW_SPLIT_MAX_PASSES * tile)
}

/// Rows per task of a row-split matmul: one task per worker, at least 6 rows.
fn row_chunk(rows: usize, threads: usize) -> usize {
    rows.div_ceil(threads).max(6)
}

/// The column block of a column-split matmul of `rows × n` on `threads` workers: the
/// narrowest for few rows, else about two blocks per worker, within the bounds above.
fn col_block(rows: usize, n: usize, threads: usize) -> usize {
    if rows < MATMUL_FEW_ROWS {
        return MATMUL_COL_BLOCK;
    }
    let per_task = n / (2 * threads);
    per_task.clamp(MATMUL_COL_BLOCK, MATMUL_COL_BLOCK_MAX) / MATMUL_COL_BLOCK * MATMUL_COL_BLOCK
}

/// The output rows of `view` as disjoint mutable slices, row `r` starting at element
/// `(r, 0, 0)`. The view must have passed `check_out` for `rows` rows of `span` elements.
fn rows_mut<'a>(
    data: &'a mut [f32],
    view: &View,
    rows: usize,
) -> impl Iterator<Item = &'a mut [f32]> {
    let start = view.offset.min(data.len());
    let tail = &mut data[start..];
    let stride = if rows <= 1 {
        tail.len().max(1)
    } else {
        view.row_stride
    };
    tail.chunks_mut(stride).take(rows)
}

/// [`Matmul`] on f32 slices (validated).
pub fn matmul(isa: CpuIsa, op: &Matmul, x: &[f32], w: &[f32], out: &mut [f32]) {
    if op.rows == 0 {
        return;
    }
    let (k, n) = (op.k, op.n);
    let threads = rayon::current_num_threads().max(1);
    if splits_rows(isa, op, threads) {
        // Row split: each task owns whole output rows and runs every group on them; one
        // task per worker, so that each streams the weights once for as many rows as it
        // can (the rows of a task change no bit).
        let chunk = row_chunk(op.rows, threads);
        let out_tail = &mut out[op.out.offset..];
        let stride = op.out.row_stride.max(1);
        let chunk_elems = if op.rows == 1 {
            out_tail.len().max(1)
        } else {
            chunk * stride
        };
        let chunks = out_tail
            .chunks_mut(chunk_elems)
            .take(op.rows.div_ceil(chunk));
        for_each_indexed(chunks, 1, |ci, c| {
            let r0 = ci * chunk;
            let m = chunk.min(op.rows - r0);
            for g in 0..op.groups {
                let c = &mut c[g * op.out.group_stride..];
                let a = &x[op.x.offset + r0 * op.x.row_stride + g * op.x.group_stride..];
                let d = Dims {
                    m,
                    n,
                    k,
                    lda: op.x.row_stride.max(k),
                    ldb: n,
                    ldc: op.out.row_stride.max(n),
                };
                // Overwrite: the chains start from +0 (C is not read: no zeroing pass).
                match op.accumulate {
                    Accumulate::Overwrite => gemm_into(isa, d, a, &w[g * k * n..], c),
                    Accumulate::Add => gemm_acc(isa, d, a, &w[g * k * n..], c),
                }
            }
        });
    } else {
        // Column split for few rows per worker: each task computes one column block of
        // one group into a private tile, copied into place afterwards.
        let cb = col_block(op.rows, n, threads);
        let blocks = n.div_ceil(cb);
        // Tile `t` is column block `t % blocks` of group `t / blocks`.
        let mut tiles: Vec<Vec<f32>> = vec![Vec::new(); op.groups * blocks];
        let out_ro: &[f32] = out;
        for_each_indexed(tiles.iter_mut(), 1, |t, slot| {
            let (g, b) = (t / blocks, t % blocks);
            let j0 = b * cb;
            let nb = cb.min(n - j0);
            let mut tile = vec![0f32; op.rows * nb];
            if op.accumulate == Accumulate::Add {
                for r in 0..op.rows {
                    let o = op.out.offset + r * op.out.row_stride + g * op.out.group_stride;
                    tile[r * nb..][..nb].copy_from_slice(&out_ro[o + j0..][..nb]);
                }
            }
            let d = Dims {
                m: op.rows,
                n: nb,
                k,
                lda: op.x.row_stride.max(k),
                ldb: n,
                ldc: nb,
            };
            let a = &x[op.x.offset + g * op.x.group_stride..];
            gemm_acc(isa, d, a, &w[g * k * n + j0..], &mut tile);
            *slot = tile;
        });
        for (t, tile) in tiles.iter().enumerate() {
            let (g, j0) = (t / blocks, t % blocks * cb);
            let nb = tile.len() / op.rows;
            for r in 0..op.rows {
                let o = op.out.offset + r * op.out.row_stride + g * op.out.group_stride + j0;
                out[o..o + nb].copy_from_slice(&tile[r * nb..][..nb]);
            }
        }
    }
}

/// Sum of squares in the fixed lane order documented on [`RmsNorm`].
#[inline(always)]
fn sum_squares(x: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let mut chunks = x.chunks_exact(L);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = v.mul_add(v, *a);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a = v.mul_add(v, *a);
    }
    // Fixed pairwise tree: 16 → 8 → 4 → 2 → 1.
    let mut w = L;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            acc[i] += acc[i + w];
        }
    }
    acc[0]
}

/// [`RmsNorm`] on f32 slices (validated), on the vector path `isa`.
pub fn rms_norm(isa: CpuIsa, op: &RmsNorm, x: &[f32], gamma: &[f32], out: &mut [f32]) {
    let width = op.width;
    for_each_indexed(rows_mut(out, &op.out, op.rows), ROW_CHUNK, |r, o| {
        let xr = &x[op.x.offset + r * op.x.row_stride..][..width];
        rms_norm_row(isa, &mut o[..width], xr, gamma, op.eps);
    });
}

// The row bodies of the element-wise ops, compiled for each vector path (the baseline
// x86-64 build has no FMA: `mul_add` there is a call of the C library's `fmaf`, and its
// loops are 128-bit at most). The same operations in the same order on every path, so
// the same bits (`tests/model_ops.rs` compares every path with the GPU kernels).

crate::isa_dispatch! {
    /// One row of [`RmsNorm`]: `o[i] = (x[i] · inv) · gamma[i]`, `inv = 1 / sqrt(Σ x² /
    /// width + eps)` with the sum in [`sum_squares`]' order; `width = x.len()`.
    fn rms_norm_row(o: &mut [f32], x: &[f32], gamma: &[f32], eps: f32) = |ISA| {
        let inv = 1.0 / (sum_squares(x) / x.len() as f32 + eps).sqrt();
        for ((o, &v), &g) in o.iter_mut().zip(x).zip(gamma) {
            *o = (v * inv) * g;
        }
    };
}

crate::isa_dispatch! {
    /// One head of [`Rope`]: the pairs `(x[i], x[i + h])` rotated by `(cs[2i], cs[2i + 1])`
    /// (cosine, sine), `h = x.len() / 2`.
    fn rope_head(o: &mut [f32], x: &[f32], cs: &[f32]) = |ISA| {
        let h = x.len() / 2;
        let (xa, xb) = x.split_at(h);
        let (oa, ob) = o[..2 * h].split_at_mut(h);
        for (((oa, ob), (&a, &b)), cs) in oa
            .iter_mut()
            .zip(ob.iter_mut())
            .zip(xa.iter().zip(xb))
            .zip(cs.chunks_exact(2))
        {
            let (c, s) = (cs[0], cs[1]);
            *oa = a * c - b * s;
            *ob = a * s + b * c;
        }
    };
}

crate::isa_dispatch! {
    /// One row of [`SwiGlu`]: `o[i] = g[i] / (1 + exp(−g[i])) · u[i]` ([`exp_portable`]).
    fn swiglu_row(o: &mut [f32], g: &[f32], u: &[f32]) = |ISA| {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + exp_portable(-g)) * u;
        }
    };
}

crate::isa_dispatch! {
    /// One row of [`Add`]: `a[i] += x[i]`.
    fn add_row(a: &mut [f32], x: &[f32]) = |ISA| {
        for (a, &v) in a.iter_mut().zip(x) {
            *a += v;
        }
    };
}

crate::isa_dispatch! {
    /// One row of an f32 → bf16 [`Cast`]: `bf16::from_f32`'s bits by [`round_bf16`],
    /// whose rows vectorise (`half`'s branches do not).
    fn f32_bf16_row(o: &mut [bf16], x: &[f32]) = |ISA| {
        for (o, &v) in o.iter_mut().zip(x) {
            *o = bf16::from_bits(round_bf16(v));
        }
    };
}

crate::isa_dispatch! {
    /// One row of a bf16 → f32 [`Cast`] (exact).
    fn bf16_f32_row(o: &mut [f32], x: &[bf16]) = |ISA| {
        for (o, &v) in o.iter_mut().zip(x) {
            *o = v.to_f32();
        }
    };
}

/// [`Rope`] on f32 slices (validated), on the vector path `isa`.
pub fn rope(isa: CpuIsa, op: &Rope<'_>, table: &[f32], x: &[f32], out: &mut [f32]) {
    let d = op.rope_dim / 2 * 2;
    for_each_indexed(
        rows_mut(out, &op.out, op.positions.len()),
        ROW_CHUNK,
        |r, o| {
            let cs = &table[op.positions[r] as usize * op.rope_dim..][..op.rope_dim];
            for g in 0..op.heads {
                let xi = &x[op.x.offset + r * op.x.row_stride + g * op.x.group_stride..][..d];
                rope_head(isa, &mut o[g * op.out.group_stride..][..d], xi, cs);
            }
        },
    );
}

/// [`SwiGlu`] on f32 slices (validated), on the vector path `isa`.
pub fn swiglu(isa: CpuIsa, op: &SwiGlu, gate_up: &[f32], out: &mut [f32]) {
    let w = op.width;
    if w == 0 {
        return;
    }
    for_each_indexed(out.chunks_mut(w), ROW_CHUNK, |r, o| {
        let (g, u) = gate_up[r * 2 * w..(r + 1) * 2 * w].split_at(w);
        swiglu_row(isa, o, g, u);
    });
}

/// [`GatedPool`] on f32 slices (validated). Entries are split across workers; within an
/// entry the channels advance together slot by slot, each channel by exactly the GPU
/// kernel's sequence (`dense_gated_pool`): the max pass (`m` from `−inf`, taking `z` when
/// `z > m`), then per valid slot in order `w = exp_portable(z − m)`, `sum += w`,
/// `acc += w · v` (from `+0.0`, each operation rounded, no FMA), then `acc / sum`.
pub fn gated_pool(isa: CpuIsa, op: &GatedPool<'_>, x: &[f32], bias: &[f32], out: &mut [f32]) {
    let (w, span) = (op.width, op.span);
    if w == 0 || span == 0 {
        return;
    }
    for_each_indexed(out.chunks_mut(w), (ROW_CHUNK / span).max(1), |e, o| {
        let slots = &op.sources[e * span..(e + 1) * span];
        scratch::with(&POOL_SCRATCH, |scratch| {
            scratch.resize(2 * w, 0.0);
            pool_entry(isa, o, scratch, slots, x, bias);
        })
    });
}

thread_local! {
    /// This thread's maxima and sums of [`pool_entry`] (`2w`, [`scratch`]).
    static POOL_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

crate::isa_dispatch! {
    /// One entry of [`GatedPool`] into `o` (`w = o.len()` channels) over its `slots`,
    /// with `scratch` (`2w`) for the maxima and the sums.
    fn pool_entry(
        o: &mut [f32],
        scratch: &mut [f32],
        slots: &[u32],
        x: &[f32],
        bias: &[f32],
    ) = |ISA| {
        let w = o.len();
        let (m, sum) = scratch.split_at_mut(w);
        m.fill(f32::NEG_INFINITY);
        for (i, &s) in slots.iter().enumerate() {
            if s == GatedPool::EMPTY {
                continue;
            }
            let g = &x[s as usize * 2 * w + w..][..w];
            let b = &bias[i * w..][..w];
            for ((m, &g), &b) in m.iter_mut().zip(g).zip(b) {
                let z = g + b;
                if z > *m {
                    *m = z;
                }
            }
        }
        sum.fill(0.0);
        o.fill(0.0);
        for (i, &s) in slots.iter().enumerate() {
            if s == GatedPool::EMPTY {
                continue;
            }
            let (v, g) = x[s as usize * 2 * w..][..2 * w].split_at(w);
            let b = &bias[i * w..][..w];
            for c in 0..w {
                let wt = exp_portable((g[c] + b[c]) - m[c]);
                sum[c] += wt;
                o[c] += wt * v[c];
            }
        }
        for (o, &s) in o.iter_mut().zip(sum.iter()) {
            *o /= s;
        }
    };
}

/// [`Embed`] on f32 slices (validated).
pub fn embed(op: &Embed<'_>, table: &[f32], out: &mut [f32]) {
    let d = op.dim;
    if d == 0 {
        return;
    }
    for_each_indexed(out.chunks_mut(d).zip(op.tokens), ROW_CHUNK, |_, (o, &t)| {
        o.copy_from_slice(&table[t as usize * d..][..d])
    });
}

/// [`GatherRows`] on f32 slices (validated).
pub fn gather_rows(op: &GatherRows<'_>, x: &[f32], out: &mut [f32]) {
    let w = op.width;
    for_each_indexed(
        rows_mut(out, &op.out, op.rows.len()).zip(op.rows),
        ROW_CHUNK,
        |_, (o, &r)| o[..w].copy_from_slice(&x[op.x.offset + r as usize * op.x.row_stride..][..w]),
    );
}

/// [`Add`] on f32 slices (validated), on the vector path `isa`.
pub fn add(isa: CpuIsa, op: &Add, x: &[f32], acc: &mut [f32]) {
    let w = op.width;
    for_each_indexed(rows_mut(acc, &op.acc, op.rows), ROW_CHUNK, |r, a| {
        let xr = &x[op.x.offset + r * op.x.row_stride..][..w];
        add_row(isa, &mut a[..w], xr);
    });
}

/// Runs `convert(dst, src)` for the `width` elements of every `(row, group)` of a cast.
fn cast_rows<S: Copy + Sync, D: Copy + Send>(
    op: &Cast,
    x: &[S],
    out: &mut [D],
    convert: impl Fn(&mut [D], &[S]) + Sync,
) {
    if op.rows == 0 {
        return;
    }
    let tail = &mut out[op.out.offset..];
    let stride = if op.rows == 1 {
        tail.len().max(1)
    } else {
        op.out.row_stride
    };
    for_each_indexed(tail.chunks_mut(stride).take(op.rows), ROW_CHUNK, |r, o| {
        for g in 0..op.groups {
            let src = &x[op.x.offset + r * op.x.row_stride + g * op.x.group_stride..][..op.width];
            convert(&mut o[g * op.out.group_stride..][..op.width], src);
        }
    });
}

/// [`Argmax`] on f32 slices (validated).
pub fn argmax(op: &Argmax, logits: &[f32], out: &mut [u32]) {
    for_each_indexed(out.iter_mut(), ROW_CHUNK, |r, o| {
        *o = argmax_row(&logits[r * op.width..(r + 1) * op.width])
    });
}

/// Column of the largest value, lowest on ties, NaN above every number.
pub fn argmax_row(row: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in row.iter().enumerate().skip(1) {
        let b = row[best];
        if b.is_nan() {
            break;
        }
        if v.is_nan() || v > b {
            best = i;
        }
    }
    best as u32
}

impl ModelOps for CpuBackend {
    fn matmul(&self, op: &Matmul, x: &CpuBuffer, w: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        op.validate(x.len(), w.len(), out.len())?;
        let (x, w) = (x.typed::<f32>("x")?, w.typed::<f32>("w")?);
        let out = out.typed_mut::<f32>("out")?;
        self.run(|| matmul(self.isa, op, x, w, out));
        Ok(())
    }

    fn rms_norm(
        &self,
        op: &RmsNorm,
        x: &CpuBuffer,
        gamma: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(x.len(), gamma.len(), out.len())?;
        let (x, gamma) = (x.typed::<f32>("x")?, gamma.typed::<f32>("gamma")?);
        let out = out.typed_mut::<f32>("out")?;
        self.run(|| rms_norm(self.isa, op, x, gamma, out));
        Ok(())
    }

    fn rope(
        &self,
        op: &Rope<'_>,
        table: &CpuBuffer,
        x: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(table.len(), x.len(), out.len())?;
        let (table, x) = (table.typed::<f32>("table")?, x.typed::<f32>("x")?);
        let out = out.typed_mut::<f32>("out")?;
        self.run(|| rope(self.isa, op, table, x, out));
        Ok(())
    }

    fn swiglu(&self, op: &SwiGlu, gate_up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        op.validate(gate_up.len(), out.len())?;
        let gate_up = gate_up.typed::<f32>("gate_up")?;
        let out = out.typed_mut::<f32>("out")?;
        self.run(|| swiglu(self.isa, op, gate_up, out));
        Ok(())
    }

    fn embed(&self, op: &Embed<'_>, table: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        op.validate(table.len(), out.len())?;
        let table = table.typed::<f32>("table")?;
        let out = out.typed_mut::<f32>("out")?;
        self.run(|| embed(op, table, out));
        Ok(())
    }

    fn gather_rows(&self, op: &GatherRows<'_>, x: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        op.validate(x.len(), out.len())?;
        let x = x.typed::<f32>("x")?;
        let out = out.typed_mut::<f32>("out")?;
        self.run(|| gather_rows(op, x, out));
        Ok(())
    }

    fn add(&self, op: &Add, x: &CpuBuffer, acc: &mut CpuBuffer) -> Result<()> {
        op.validate(x.len(), acc.len())?;
        let x = x.typed::<f32>("x")?;
        let acc = acc.typed_mut::<f32>("acc")?;
        self.run(|| add(self.isa, op, x, acc));
        Ok(())
    }

    fn cast(&self, op: &Cast, x: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        op.validate(x.len(), out.len())?;
        match (op.from, op.to) {
            (DenseDtype::F32, DenseDtype::Bf16) => {
                let x = x.typed::<f32>("x")?;
                let out = out.typed_mut::<bf16>("out")?;
                self.run(|| cast_rows(op, x, out, |o, x| f32_bf16_row(self.isa, o, x)));
            }
            (DenseDtype::Bf16, DenseDtype::F32) => {
                let x = x.typed::<bf16>("x")?;
                let out = out.typed_mut::<f32>("out")?;
                self.run(|| cast_rows(op, x, out, |o, x| bf16_f32_row(self.isa, o, x)));
            }
            (DenseDtype::F32, DenseDtype::F32) => {
                let x = x.typed::<f32>("x")?;
                let out = out.typed_mut::<f32>("out")?;
                self.run(|| cast_rows(op, x, out, <[f32]>::copy_from_slice));
            }
            (DenseDtype::Bf16, DenseDtype::Bf16) => {
                let x = x.typed::<bf16>("x")?;
                let out = out.typed_mut::<bf16>("out")?;
                self.run(|| cast_rows(op, x, out, <[bf16]>::copy_from_slice));
            }
        }
        Ok(())
    }

    fn argmax(&self, op: &Argmax, logits: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        op.validate(logits.len(), out.len())?;
        let logits = logits.typed::<f32>("logits")?;
        let out = out.typed_mut::<u32>("out")?;
        self.run(|| argmax(op, logits, out));
        Ok(())
    }

    fn gated_pool(
        &self,
        op: &GatedPool<'_>,
        x: &CpuBuffer,
        bias: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(x.len(), bias.len(), out.len())?;
        let (x, bias) = (x.typed::<f32>("x")?, bias.typed::<f32>("bias")?);
        let out = out.typed_mut::<f32>("out")?;
        self.run(|| gated_pool(self.isa, op, x, bias, out));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The f32 → bf16 row gives `bf16::from_f32`'s bits on every vector path, for every
    /// top half with the low halves where the rounding decides (0, the tie, either side
    /// of it, all ones) and a random one: NaNs of every payload and sign included.
    #[test]
    fn f32_bf16_row_is_half_from_f32() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let x: Vec<f32> = (0..=u16::MAX as u32)
            .flat_map(|hi| {
                let r = rng.gen_range(0..0x1_0000u32);
                [0, 0x7fff, 0x8000, 0x8001, 0xffff, r].map(move |lo| f32::from_bits(hi << 16 | lo))
            })
            .collect();
        let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        for isa in CpuIsa::available() {
            let mut o = vec![bf16::from_bits(0xdead); x.len()];
            f32_bf16_row(isa, &mut o, &x);
            let got: Vec<u16> = o.iter().map(|v| v.to_bits()).collect();
            assert!(got == want, "{}", isa.isa().name());
        }
    }
}
