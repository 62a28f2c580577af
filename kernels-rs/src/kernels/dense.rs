//! The dense ops of the synthetic model: matmul, RMSNorm, rope, SwiGLU, row gathers
//! (embedding lookups), residual add, casts, argmax, and DeepSeek-V4's compressor pooling
//! (`dense_gated_pool`).
//!
//! **Batch invariance and CPU equality are the contract.** Every output element is
//! computed by the same sequence of correctly rounded f32 operations as the CPU backend's
//! dense kernels (`sparsekit_host::cpu::dense`), independent of the row count, the row's
//! position in the batch and the launch geometry: the matmul is one FMA chain per element
//! in `k` order (never split-K), the RMSNorm sum uses the CPU's 16 lanes and pairwise tree,
//! SwiGLU's and the gated pooling's `exp` is [`exp_portable`]. Plain Rust `*`, `+`, `/` compile to `mul.rn`,
//! `add.rn`, `div.rn` (never contracted into FMAs), so the GPU, the emulator and the CPU
//! give the same bits.
//!
//! Geometry: element-wise kernels (the gated pooling among them: one thread per output
//! element) run grid-stride over elements ([`ELEMENTWISE_BLOCK`] threads per block); RMSNorm one warp per row, argmax one block per row; the matmul one
//! block per tile of [`MATMUL_TILE_ROWS`] rows × [`MATMUL_TILE_COLS`] columns of one group.

use crate::fp8::{bf16_to_f32, f32_to_bf16};
use crate::launch::{Launch, MAX_GRID};
use crate::math::{exp_portable, fma, sqrt};
use crate::params::{
    dense_dtype, DenseAddParams, DenseArgmaxParams, DenseCastParams, DenseGatedPoolParams,
    DenseGatherRowsParams, DenseMatmulParams, DenseRmsNormParams, DenseRopeParams,
    DenseSwiGluParams, GATED_POOL_EMPTY,
};
use crate::simt::Simt;

use super::FULL;

/// Threads per block of the element-wise kernels.
pub const ELEMENTWISE_BLOCK: u32 = 256;
/// Output rows per matmul tile (each thread keeps one accumulator per row).
pub const MATMUL_TILE_ROWS: u32 = 8;
/// Output columns per matmul tile (one per thread; one warp per block). Narrow tiles
/// spread a decode-sized matmul over many SMs: without split-K (which would change each
/// element's FMA chain) columns × row tiles are all the parallelism there is.
pub const MATMUL_TILE_COLS: u32 = 32;
/// `k` values of the `x` rows staged in shared memory at a time.
const MATMUL_K_CHUNK: u32 = 128;
/// Warps (rows) per block of the row-wise kernels.
pub const ROW_WARPS: u32 = 4;

/// Grid-stride launch over `elements` elements.
pub fn elementwise_launch(elements: u64) -> Launch {
    Launch {
        grid: elements
            .div_ceil(ELEMENTWISE_BLOCK as u64)
            .clamp(1, MAX_GRID as u64) as u32,
        block: ELEMENTWISE_BLOCK,
        smem_bytes: 0,
    }
}

/// One warp per row, [`ROW_WARPS`] rows per block.
pub fn row_launch(rows: u32) -> Launch {
    Launch {
        grid: rows.div_ceil(ROW_WARPS).clamp(1, MAX_GRID),
        block: 32 * ROW_WARPS,
        smem_bytes: 0,
    }
}

/// Tiles of a matmul: `(row tiles, column tiles)`.
fn matmul_tiles(p: &DenseMatmulParams) -> (u64, u64) {
    (
        p.rows.div_ceil(MATMUL_TILE_ROWS) as u64,
        p.n.div_ceil(MATMUL_TILE_COLS) as u64,
    )
}

/// `dense_matmul`: one block per (group, row tile, column tile), grid-stride; the tile's
/// `x` rows are staged in shared memory `MATMUL_K_CHUNK` values at a time.
pub fn matmul_launch(p: &DenseMatmulParams) -> Launch {
    let (rt, ct) = matmul_tiles(p);
    Launch {
        grid: (p.groups as u64 * rt * ct).clamp(1, MAX_GRID as u64) as u32,
        block: MATMUL_TILE_COLS,
        smem_bytes: MATMUL_TILE_ROWS * MATMUL_K_CHUNK * 4,
    }
}

/// The linear index of this thread and the grid's thread count.
#[inline(always)]
fn grid_stride<S: Simt>() -> (u64, u64) {
    (
        S::block_idx() as u64 * S::block_dim() as u64 + S::thread_idx() as u64,
        S::grid_dim() as u64 * S::block_dim() as u64,
    )
}

/// Matmul (see [`DenseMatmulParams`]).
///
/// # Safety
/// Launch with [`matmul_launch`]. `x` and `out` hold every element their views address for
/// `rows × groups × (k | n)`; `w` holds `groups·k·n` f32; output views of distinct
/// `(row, group)` pairs do not overlap and `out` does not overlap `x` or `w`.
pub unsafe fn dense_matmul<S: Simt>(p: DenseMatmulParams) {
    let (row_tiles, col_tiles) = matmul_tiles(&p);
    let tiles = p.groups as u64 * row_tiles * col_tiles;
    let t = S::thread_idx();
    let mut tile = S::block_idx() as u64;
    while tile < tiles {
        let ct = (tile % col_tiles) as u32;
        let rt = ((tile / col_tiles) % row_tiles) as u32;
        let g = (tile / (col_tiles * row_tiles)) as u32;
        let r0 = rt * MATMUL_TILE_ROWS;
        let m = MATMUL_TILE_ROWS.min(p.rows - r0);
        let j = ct * MATMUL_TILE_COLS + t;
        let live = j < p.n;
        let mut acc = [0f32; MATMUL_TILE_ROWS as usize];
        // Loops over the tile's rows run to the constant MATMUL_TILE_ROWS with `i < m` as a
        // predicate, so they unroll and `acc` stays in registers.
        if p.accumulate != 0 && live {
            let mut i = 0;
            while i < MATMUL_TILE_ROWS {
                if i < m {
                    // SAFETY: r0 + i < rows, g < groups, j < n: inside the output view.
                    acc[i as usize] =
                        unsafe { S::gld(p.out.as_const().add(p.out_view.at(r0 + i, g, j))) };
                }
                i += 1;
            }
        }
        let w =
            p.w.add(g as usize * p.k as usize * p.n as usize + j as usize);
        let mut p0 = 0;
        while p0 < p.k {
            let kc = MATMUL_K_CHUNK.min(p.k - p0);
            // Stage x[r0 .. r0+m, g, p0 .. p0+kc] (row i at smem word i·K_CHUNK).
            let mut i = 0;
            while i < m {
                let mut c = t;
                while c < kc {
                    // SAFETY: r0 + i < rows, p0 + c < k: inside the x view; the smem word
                    // i·K_CHUNK + c < TILE_ROWS·K_CHUNK (the launch's shared memory).
                    unsafe {
                        let v = S::gld(p.x.add(p.x_view.at(r0 + i, g, p0 + c)));
                        S::smem_store::<f32>(4 * (i * MATMUL_K_CHUNK + c) as usize, v);
                    }
                    c += MATMUL_TILE_COLS;
                }
                i += 1;
            }
            S::sync_threads();
            if live {
                let mut q = 0;
                while q < kc {
                    // SAFETY: p0 + q < k, j < n: inside w[g].
                    let wv = unsafe { S::gld(w.add((p0 + q) as usize * p.n as usize)) };
                    let mut i = 0;
                    while i < MATMUL_TILE_ROWS {
                        if i < m {
                            // SAFETY: staged above (i < m, q < kc).
                            let xv = unsafe {
                                S::smem_load::<f32>(4 * (i * MATMUL_K_CHUNK + q) as usize)
                            };
                            acc[i as usize] = fma(xv, wv, acc[i as usize]);
                        }
                        i += 1;
                    }
                    q += 1;
                }
            }
            // The stage is rewritten for the next chunk only after every thread used it.
            S::sync_threads();
            p0 += kc;
        }
        if live {
            let mut i = 0;
            while i < MATMUL_TILE_ROWS {
                if i < m {
                    // SAFETY: as for the accumulator load.
                    unsafe { S::gst(p.out.add(p.out_view.at(r0 + i, g, j)), acc[i as usize]) };
                }
                i += 1;
            }
        }
        tile += S::grid_dim() as u64;
    }
}

/// RMSNorm (see [`DenseRmsNormParams`]): one warp per row; lanes 0–15 hold the CPU's 16
/// partial sums (lane `l`: columns `c ≡ l mod 16` in increasing order, one FMA each).
///
/// # Safety
/// Launch with [`row_launch`]. `x`/`out` hold `rows × width` elements through their views,
/// `gamma` `width` f32; rows of `out` do not overlap each other or `x`.
pub unsafe fn dense_rms_norm<S: Simt>(p: DenseRmsNormParams) {
    let lane = S::lane_id();
    let mut r = S::block_idx() * ROW_WARPS + S::warp_id();
    while r < p.rows {
        let mut acc = 0f32;
        if lane < 16 {
            let mut c = lane;
            while c < p.width {
                // SAFETY: c < width: inside row r of the x view.
                let v = unsafe { S::gld(p.x.add(p.x_view.at(r, 0, c))) };
                acc = fma(v, v, acc);
                c += 16;
            }
        }
        // Pairwise tree 16 → 8 → 4 → 2 → 1: lane i adds lane i + w.
        let mut w = 8;
        while w > 0 {
            let other = f32::from_bits(S::shfl_down(FULL, acc.to_bits(), w));
            acc += other;
            w /= 2;
        }
        let sum = f32::from_bits(S::shfl_idx(FULL, acc.to_bits(), 0));
        let inv = 1.0 / sqrt(sum / p.width as f32 + p.eps);
        let mut c = lane;
        while c < p.width {
            // SAFETY: c < width: inside row r of both views and of gamma.
            unsafe {
                let v = S::gld(p.x.add(p.x_view.at(r, 0, c)));
                let g = S::gld(p.gamma.add(c as usize));
                S::gst(p.out.add(p.out_view.at(r, 0, c)), (v * inv) * g);
            }
            c += 32;
        }
        r += S::grid_dim() * ROW_WARPS;
    }
}

/// Rope (see [`DenseRopeParams`]): one thread per (row, head, pair `i < rope_dim/2`).
///
/// # Safety
/// Launch with [`elementwise_launch`] of `rows·heads·rope_dim/2`. `positions` holds `rows`
/// entries inside the table; `x`/`out` hold `rows × heads × rope_dim` through their views;
/// `out` overlaps neither `x` nor itself across (row, head).
pub unsafe fn dense_rope<S: Simt>(p: DenseRopeParams) {
    let h = p.rope_dim / 2;
    let total = p.rows as u64 * p.heads as u64 * h as u64;
    let (mut e, step) = grid_stride::<S>();
    while e < total {
        let i = (e % h as u64) as u32;
        let rh = e / h as u64;
        let g = (rh % p.heads as u64) as u32;
        let r = (rh / p.heads as u64) as u32;
        // SAFETY: r < rows; the position is inside the table and i < h (contract), so
        // both table entries and both x/out elements are inside their buffers.
        unsafe {
            let pos = S::gld(p.positions.add(r as usize)) as usize;
            let cs = p.table.add((pos * h as usize + i as usize) * 2);
            let (c, s) = (S::gld(cs), S::gld(cs.add(1)));
            let a = S::gld(p.x.add(p.x_view.at(r, g, i)));
            let b = S::gld(p.x.add(p.x_view.at(r, g, i + h)));
            S::gst(p.out.add(p.out_view.at(r, g, i)), a * c - b * s);
            S::gst(p.out.add(p.out_view.at(r, g, i + h)), a * s + b * c);
        }
        e += step;
    }
}

/// SwiGLU (see [`DenseSwiGluParams`]): one thread per output element.
///
/// # Safety
/// Launch with [`elementwise_launch`] of `rows·width`. `gate_up` holds `rows·2·width` f32,
/// `out` `rows·width`; they do not overlap.
pub unsafe fn dense_swiglu<S: Simt>(p: DenseSwiGluParams) {
    let w = p.width as u64;
    let total = p.rows as u64 * w;
    let (mut e, step) = grid_stride::<S>();
    while e < total {
        let (r, c) = (e / w, e % w);
        // SAFETY: r < rows, c < width (contract sizes).
        unsafe {
            let g = S::gld(p.gate_up.add((r * 2 * w + c) as usize));
            let u = S::gld(p.gate_up.add((r * 2 * w + w + c) as usize));
            S::gst(p.out.add(e as usize), g / (1.0 + exp_portable(-g)) * u);
        }
        e += step;
    }
}

/// DeepSeek-V4's compressor pooling (see [`DenseGatedPoolParams`]): one thread per output
/// element `(entry, channel)`, channels fastest, so a warp reads 32 consecutive f32 of a
/// source row (coalesced) and one source id (a broadcast). Two passes over the entry's
/// slots: the largest biased gate logit, then each weight, the running sum of weights and
/// the running weighted sum of values; nothing is kept per slot, no shared memory, no
/// barrier. Each element's result depends on its entry's slots only (batch-invariant:
/// the same bits whatever `entries`, the entry's place in the batch or the grid).
///
/// Per element: `m` starts at `−inf` and takes `z` when `z > m` (a NaN `z` is never
/// taken; its own weight is NaN); `sum` and `acc` start at `+0.0`; then
/// `w = exp_portable(z − m)`, `sum = sum + w`, `acc = acc + w · v` per valid slot (each
/// product and sum rounded, no FMA), and `out = acc / sum`: the CPU backend's sequence.
///
/// # Safety
/// Launch with [`elementwise_launch`] of `entries·width`. `sources` holds `entries·span`
/// ids, each a row of `x` or [`GATED_POOL_EMPTY`]; `x` holds `2·width` f32 for each such
/// row, `bias` `span·width` f32, `out` `entries·width` f32 and overlaps no input.
pub unsafe fn dense_gated_pool<S: Simt>(p: DenseGatedPoolParams) {
    let w = p.width as u64;
    let total = p.entries as u64 * w;
    let (mut e, step) = grid_stride::<S>();
    while e < total {
        let (n, c) = (e / w, e % w);
        let ids = p.sources.add((n * p.span as u64) as usize);
        let bias = p.bias.add(c as usize);
        // Pass 1: the largest biased gate logit of the valid slots.
        let mut m = f32::NEG_INFINITY;
        let mut i = 0;
        while i < p.span {
            // SAFETY: i < span: inside entry n's ids.
            let s = unsafe { S::gld(ids.add(i as usize)) };
            if s != GATED_POOL_EMPTY {
                // SAFETY: s is a row of x (contract) and c < width, so the gate logit
                // (column width + c of row s) is inside x; i < span, so bias[i, c] is
                // inside bias.
                let z = unsafe {
                    S::gld(p.x.add((s as u64 * 2 * w + w + c) as usize))
                        + S::gld(bias.add((i as u64 * w) as usize))
                };
                if z > m {
                    m = z;
                }
            }
            i += 1;
        }
        // Pass 2: weights, their sum and the weighted sum of values, in slot order.
        let (mut sum, mut acc) = (0f32, 0f32);
        let mut i = 0;
        while i < p.span {
            // SAFETY: as in pass 1.
            let s = unsafe { S::gld(ids.add(i as usize)) };
            if s != GATED_POOL_EMPTY {
                let row = s as u64 * 2 * w;
                // SAFETY: as in pass 1; the value (column c of row s) is inside x too.
                let (z, v) = unsafe {
                    (
                        S::gld(p.x.add((row + w + c) as usize))
                            + S::gld(bias.add((i as u64 * w) as usize)),
                        S::gld(p.x.add((row + c) as usize)),
                    )
                };
                let wt = exp_portable(z - m);
                sum += wt;
                acc += wt * v;
            }
            i += 1;
        }
        // SAFETY: e < entries·width: inside out.
        unsafe { S::gst(p.out.add(e as usize), acc / sum) };
        e += step;
    }
}

/// Row gather (see [`DenseGatherRowsParams`]): one thread per output element.
///
/// # Safety
/// Launch with [`elementwise_launch`] of `n_rows·width`. Every `src[i]` is a row of the
/// source view; `out` holds `n_rows × width` through its view, rows not overlapping each
/// other or `x`.
pub unsafe fn dense_gather_rows<S: Simt>(p: DenseGatherRowsParams) {
    let w = p.width as u64;
    let total = p.n_rows as u64 * w;
    let (mut e, step) = grid_stride::<S>();
    while e < total {
        let (i, c) = ((e / w) as u32, (e % w) as u32);
        // SAFETY: i < n_rows, c < width, src[i] a source row (contract).
        unsafe {
            let s = S::gld(p.src.add(i as usize));
            let v = S::gld(p.x.add(p.x_view.at(s, 0, c)));
            S::gst(p.out.add(p.out_view.at(i, 0, c)), v);
        }
        e += step;
    }
}

/// Residual add (see [`DenseAddParams`]): one thread per element.
///
/// # Safety
/// Launch with [`elementwise_launch`] of `rows·width`. Both views hold `rows × width`;
/// `acc` rows do not overlap each other or `x`.
pub unsafe fn dense_add<S: Simt>(p: DenseAddParams) {
    let w = p.width as u64;
    let total = p.rows as u64 * w;
    let (mut e, step) = grid_stride::<S>();
    while e < total {
        let (r, c) = ((e / w) as u32, (e % w) as u32);
        // SAFETY: r < rows, c < width: inside both views.
        unsafe {
            let a = p.acc.add(p.acc_view.at(r, 0, c));
            let v = S::gld(a.as_const()) + S::gld(p.x.add(p.x_view.at(r, 0, c)));
            S::gst(a, v);
        }
        e += step;
    }
}

/// Cast (see [`DenseCastParams`]): one thread per element.
///
/// # Safety
/// Launch with [`elementwise_launch`] of `rows·groups·width`. `from`/`to` are
/// [`dense_dtype`] codes; both views (in elements of their own dtype) hold
/// `rows × groups × width`; output elements of distinct (row, group) do not overlap and
/// `out` does not overlap `x`.
pub unsafe fn dense_cast<S: Simt>(p: DenseCastParams) {
    let w = p.width as u64;
    let total = p.rows as u64 * p.groups as u64 * w;
    let (mut e, step) = grid_stride::<S>();
    while e < total {
        let c = (e % w) as u32;
        let rg = e / w;
        let g = (rg % p.groups as u64) as u32;
        let r = (rg / p.groups as u64) as u32;
        let (src, dst) = (p.x_view.at(r, g, c), p.out_view.at(r, g, c));
        // SAFETY: (r, g, c) inside both views, each in elements of its own dtype (4 or 2
        // bytes, aligned: the buffers are).
        unsafe {
            if p.from == dense_dtype::F32 {
                let v = S::gld(p.x.cast::<f32>().add(src));
                if p.to == dense_dtype::F32 {
                    S::gst(p.out.cast::<f32>().add(dst), v);
                } else {
                    S::gst(p.out.cast::<u16>().add(dst), f32_to_bf16(v));
                }
            } else {
                let v = S::gld(p.x.cast::<u16>().add(src));
                if p.to == dense_dtype::F32 {
                    S::gst(p.out.cast::<f32>().add(dst), bf16_to_f32(v));
                } else {
                    S::gst(p.out.cast::<u16>().add(dst), v);
                }
            }
        }
        e += step;
    }
}

/// The better of two argmax candidates `(value, column)`: a NaN beats every number (the
/// lower column among NaNs), else the larger value, the lower column on ties (`±0` tie).
/// Commutative and associative, so any combining order gives the CPU's first-maximum (or
/// first-NaN) column.
#[inline(always)]
fn better(a: (f32, u32), b: (f32, u32)) -> (f32, u32) {
    match (a.0.is_nan(), b.0.is_nan()) {
        (true, false) => a,
        (false, true) => b,
        (true, true) => {
            if a.1 < b.1 {
                a
            } else {
                b
            }
        }
        (false, false) => {
            if a.0 > b.0 || (a.0 == b.0 && a.1 < b.1) {
                a
            } else {
                b
            }
        }
    }
}

/// Threads per block of `dense_argmax` (one block per row).
pub const ARGMAX_BLOCK: u32 = 512;

/// `dense_argmax`: one block of [`ARGMAX_BLOCK`] threads per row (a vocabulary-wide row
/// is too long for one warp), grid-stride over rows; one candidate per warp in shared
/// memory.
pub fn argmax_launch(rows: u32) -> Launch {
    Launch {
        grid: rows.clamp(1, MAX_GRID),
        block: ARGMAX_BLOCK,
        smem_bytes: ARGMAX_BLOCK / 32 * 8,
    }
}

/// Butterfly of [`better`] over the 32 lanes: every lane ends with the warp's best.
#[inline(always)]
fn warp_best<S: Simt>(mut best: (f32, u32)) -> (f32, u32) {
    let mut m = 16;
    while m > 0 {
        let v = f32::from_bits(S::shfl_xor(FULL, best.0.to_bits(), m));
        let i = S::shfl_xor(FULL, best.1, m);
        best = better(best, (v, i));
        m /= 2;
    }
    best
}

/// Argmax (see [`DenseArgmaxParams`]): thread `t` of a row's block scans columns
/// `t, t + block, …`; candidates are combined by `better` across lanes (butterfly), then
/// across warps (through shared memory). `better` is a selection by a total order, so the
/// result does not depend on how the row is split.
///
/// # Safety
/// Launch with [`argmax_launch`]; `width ≥ 1`; `logits` holds `rows·width` f32, `out` `rows`
/// u32.
pub unsafe fn dense_argmax<S: Simt>(p: DenseArgmaxParams) {
    let (t, lane, warp) = (S::thread_idx(), S::lane_id(), S::warp_id());
    let warps = S::block_dim() / 32;
    let mut r = S::block_idx();
    while r < p.rows {
        let row = p.logits.add(r as usize * p.width as usize);
        let mut best = (f32::NEG_INFINITY, u32::MAX);
        let mut c = t;
        while c < p.width {
            // SAFETY: c < width: inside row r.
            let v = unsafe { S::gld(row.add(c as usize)) };
            best = better(best, (v, c));
            c += S::block_dim();
        }
        let best = warp_best::<S>(best);
        if lane == 0 {
            // SAFETY: warp < warps; the launch gives 8 bytes per warp.
            unsafe {
                S::smem_store::<u32>(8 * warp as usize, best.0.to_bits());
                S::smem_store::<u32>(8 * warp as usize + 4, best.1);
            }
        }
        S::sync_threads();
        if warp == 0 {
            let mut b = (f32::NEG_INFINITY, u32::MAX);
            if lane < warps {
                // SAFETY: written by warp `lane`'s lane 0 before the barrier.
                b = unsafe {
                    (
                        f32::from_bits(S::smem_load::<u32>(8 * lane as usize)),
                        S::smem_load::<u32>(8 * lane as usize + 4),
                    )
                };
            }
            let b = warp_best::<S>(b);
            if lane == 0 {
                // SAFETY: r < rows.
                unsafe { S::gst(p.out.add(r as usize), b.1) };
            }
        }
        // The candidates are rewritten for the next row only after warp 0 read them.
        S::sync_threads();
        r += S::grid_dim();
    }
}
