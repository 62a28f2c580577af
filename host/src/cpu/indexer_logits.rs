//! CPU lightning-indexer logits.
//!
//! Rows are grouped (consecutive rows of one request, up to `GROUP_ROWS_X_HEADS` query
//! heads in all) so a block of keys is decoded once for the group; each (group, column
//! chunk) is one parallel task, and the tasks of a rayon job share one set of working
//! buffers. Per block, the keys are dequantised to rows (the next block's pages are
//! prefetched meanwhile) and `Cᵀ[keys × heads] = K · Qᵀ` runs as the bf16 dot product of
//! [`super::dot`]: `vdpbf16ps` on bf16 rows on the `avx512bf16` path, f32 FMAs in the same
//! order on f32 rows ([`gemm_acc_pairs`]) on the others, for the same bits (every key and
//! q value is a bf16 value: bf16 keys, e4m3 codes and e2m1 × a power-of-two scale are
//! exact in bf16; the fp8 key's scale multiplies the head sum; without the bf16 dot
//! product, fp8 keys of few-head groups go as f16, exactly 2^-8 times their values, see
//! `f16_keys`). On the `avx512bf16` path fp8 keys are read where they lie, a page run at
//! a time, and widened by the GEMM itself ([`gemm_e4m3_into`]). Qᵀ is built once per
//! task, head-major (a head's rows are adjacent). The weighted ReLU head sum then runs in
//! head order, vectorised over 16 keys (groups of few rows: decode) or over 16 rows (long
//! prefill groups), compiled for the CPU's vector ISA; for one query row of at most 8
//! heads on the AVX-512 paths (fp8 keys on `avx512bf16`) it is the GEMM's own epilogue,
//! on its register tiles transposed ([`gemm_e4m3_relu_sums`], [`gemm_pairs_relu_sums`]).
//! Every logit is computed with the same operations in the same order whatever the
//! grouping or the vectorisation: batch-invariant, and identical on every path but one.
//! That one, `amx`, runs the bf16 route's `Cᵀ = K · Qᵀ` for every group on AMX tiles
//! ([`super::amx`]: fp8 keys widened to bf16 rows first, bf16 keys read in place) and
//! the `avx512` code for the rest: its scores are batch-invariant and within tolerance,
//! not bit-identical to the other paths'.

use std::cell::RefCell;
use std::ops::Range;

use half::bf16;

use super::amx::TILE_PAIRS;
use super::dot::{gemm_bf16_into, gemm_e4m3_into, gemm_e4m3_relu_sums, padded_cols, PairDims};
#[cfg(doc)]
use super::gemm::gemm_acc_pairs;
use super::gemm::{
    gemm_pairs_into, gemm_pairs_into_f16b, gemm_pairs_relu_sums, splat, Dims, SPLAT,
};
use super::isa::{prefetch, CpuIsa, Isa};
use super::scratch::{self, Aligned};
use super::tasks::run_tasks;
use super::transpose::{transpose, transpose_bytes};
use super::widen;
use crate::layout::{IndexKDtype, IndexKLayout, SlotAddr};
use crate::ops::{IndexerLogits, PageTable, QueryRange};

/// Keys per block (columns of one GEMM).
const BLOCK: usize = 64;
/// Output columns per parallel task.
const CHUNK: usize = 32 * BLOCK;
/// Upper bound on `rows × n_heads` in one group (GEMM `m`).
const GROUP_ROWS_X_HEADS: usize = 256;
/// Keys of one GEMM call inside a block on the f32 routes (the next block's keys are
/// prefetched in steps of this many, one step before each call; the bf16 `Cᵀ` route, the
/// few-head f32 `Cᵀ` route on `avx512` and the f16 route ask for them all, then run the
/// block in one call).
const SUB: usize = 16;
/// Groups of at least this many rows vectorise the head sums over rows, smaller ones over
/// keys.
const ROW_VECTOR: usize = 16;
/// Whether a group of `m` query heads (`rows × heads`) computes `C = Q · Kᵀ` (keys along
/// the vectors) instead of `Cᵀ = K · Qᵀ`: fewer heads than `Cᵀ`'s register tile needs to
/// fill its vectors without waiting on loads — two vectors of 16 on AVX-512, one of 8 on
/// AVX2 (whose 8-column tile of 12 rows already runs at the FMA rate). On the AVX-512
/// paths a group of at most 8 heads takes `Cᵀ` again: its tile of 16 keys × one 256-bit
/// vector of heads needs no transpose of K (AMD Zen 4, one thread, 32 decode rows of 8
/// heads over 2048 fp8 keys: `avx512bf16` 729–737 µs against 750–790 µs keys along;
/// `avx512` 1010 µs against 1140 µs for keys along as f16, the block's GEMM in one call)
/// — except over fp8 keys on cores with full-width 512-bit FMAs (see [`f16_keys`]).
const fn keys_along(isa: Isa, m: usize) -> bool {
    match isa {
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => m > 8 && m < 32,
        Isa::Avx2 | Isa::Scalar => m < 8,
    }
}

/// Whether a group of `m` query heads over fp8 keys of `d` dims, with query values `q`,
/// takes the f16 route on the vector path `isa`: on `avx2`, and on `avx512` (no bf16 dot
/// product) for more than 8 heads (fewer take `Cᵀ`, see [`keys_along`]) or, where `wide`
/// ([`super::peak::wide_fma`]: 512-bit FMAs do twice the work of the 256-bit ones that
/// `Cᵀ`'s tiles of 8 heads use), for exactly 8 (an Intel Xeon, two threads, 32 decode rows
/// of 8 heads over 2048 fp8 keys: 574–591 → 506–518 µs; on AMD Zen 4, whose 512-bit FMAs
/// are two 256-bit halves, `Cᵀ` stays the faster, above), key columns as
/// f16 bits `2^-8` times their values ([`widen::e4m3_f16_row`]:
/// a third of the f32 widening's instructions) that the score GEMM widens as it loads
/// them ([`gemm_pairs_into_f16b`]), against Q times `2^8`. Each product is the same real
/// number, so the same bits — unless `2^8 · q` overflows: a finite `|q| ≥ 2^119` keeps the
/// f32 route (as does a block holding a NaN code, which the f16 form cannot carry).
fn f16_keys(isa: Isa, m: usize, d: usize, q: &[bf16], wide: bool) -> bool {
    (isa == Isa::Avx2 || (isa == Isa::Avx512 && (m > 8 || (wide && m == 8))))
        && m % 8 == 0
        && m * d <= F16_KEYS_MAX_QT
        && d % 2 == 0
        && q.iter().all(|v| {
            let x = v.to_f32().abs();
            !(x.is_finite() && x >= 2f32.powi(119))
        })
}

/// Widens the codes `ktb[d][BLOCK]` (columns `0..n`) into `out[d][BLOCK]` by `row`
/// (codes, outputs; full rows, which are adjacent, in one call) and ORs what it returns
/// (the f16 form's NaN flag).
#[inline(always)]
fn widen_cols<T>(
    d: usize,
    n: usize,
    ktb: &[u8],
    out: &mut [T],
    mut row: impl FnMut(&[u8], &mut [T]) -> bool,
) -> bool {
    if n == BLOCK {
        return row(&ktb[..d * BLOCK], &mut out[..d * BLOCK]);
    }
    let mut any = false;
    for (o, codes) in out
        .chunks_exact_mut(BLOCK)
        .zip(ktb.chunks_exact(BLOCK))
        .take(d)
    {
        any |= row(&codes[..n], &mut o[..n]);
    }
    any
}

/// Largest Qᵀ (elements, `m × d`) of the f16 route: splatted, 16 KiB, which stay in L1 with
/// a block's keys (a larger one is read from L2 by every FMA: 64 heads × 128 took 1.6×
/// the f32 route's time).
const F16_KEYS_MAX_QT: usize = 512;

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
        // Measured once per process, here rather than inside a task.
        wide: super::peak::wide_tiles(isa),
        layout: op.layout,
        page_table: op.page_table,
        h,
        d,
        rows: &op.rows,
        q,
        weights,
        cache,
    };
    run_tasks(tasks, |(g, col0, mut cells)| {
        scratch::with(&SCRATCH, |scratch| {
            run_task(isa, &ctx, g, col0, &mut cells, scratch)
        })
    });
}

thread_local! {
    /// This thread's working buffers ([`scratch`]).
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The working buffers of one task, reused by every task its thread runs (no allocation
/// once sized).
#[derive(Default)]
struct Scratch {
    /// Qᵀ `[d × m]` of the group's `m = rows × heads` query heads (f32 paths).
    qt: Aligned<f32>,
    /// Dequantised keys `[BLOCK × d]` (f32 paths).
    krows: Aligned<f32>,
    /// Qᵀ packed as bf16 pairs `[d/2 × padded m]` (the bf16 route: `avx512bf16`, `amx`).
    qp: Aligned<u32>,
    /// Keys as bf16 `[BLOCK × d]` (the bf16 route), held as pairs so that their
    /// rows can be moved as 32-bit words (the few-heads transpose).
    kb: Aligned<u32>,
    /// `Cᵀ [BLOCK × m]`.
    c: Aligned<f32>,
    /// `C [m × BLOCK]` (few-row groups: their head sums run along keys).
    ct: Aligned<f32>,
    /// Weights head-major `[heads × rows]` (row-vectorised head sums).
    wt: Aligned<f32>,
    /// A block's head sums `[BLOCK × rows]` (row-vectorised head sums).
    hsum: Aligned<f32>,
    /// Q `[m × d]` in Qᵀ's column order (few query heads, f32 paths).
    qrows: Aligned<f32>,
    /// Q as bf16 `[m × d]` in Qᵀ's column order (few query heads, `avx512bf16`).
    qb: Aligned<u16>,
    /// Kᵀ `[d × BLOCK]` (few query heads): f32, or bf16 pairs `[d/2 × BLOCK]` on
    /// `avx512bf16` (the bits of the pairs, moved by the transpose).
    kt: Aligned<f32>,
    /// Kᵀ as fp8 codes `[d × BLOCK]` (few query heads, fp8 keys, f32 paths): the codes
    /// are transposed before they are widened.
    ktb: Aligned<u8>,
    /// Kᵀ as f16 bits `[d × BLOCK]`, each `2^-8` times its key value (the f16 keys of
    /// the `avx2` and `avx512` paths, [`f16_keys`]).
    kh: Aligned<u16>,
}

/// A run of consecutive rows of one request whose key ranges form one span `lo..hi`.
#[derive(Clone, Copy, Debug)]
struct Group {
    first: usize,
    len: usize,
    request: usize,
    lo: usize,
    hi: usize,
}

/// The keys of the block `b0 .. b0 + n` inside `row`'s range, as one run of positions
/// from the block's start (empty where they do not meet).
#[inline(always)]
fn keys_in_block(row: &QueryRange, b0: usize, n: usize) -> Range<usize> {
    let lo = (row.start as usize).clamp(b0, b0 + n) - b0;
    let hi = (row.end as usize).clamp(b0 + lo, b0 + n) - b0;
    lo..hi
}

fn group_rows(rows: &[QueryRange], max_rows: usize) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let (lo, hi) = (r.start as usize, r.end as usize);
        match groups.last_mut() {
            // Only rows whose ranges overlap or touch the group's span join it: the span
            // stays covered by the rows' ranges, so no key outside every row's range
            // (whose page may be unmapped) is ever read.
            Some(g)
                if g.request == r.request as usize
                    && g.len < max_rows
                    && (lo >= hi || g.lo >= g.hi || (lo <= g.hi && hi >= g.lo)) =>
            {
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
    /// [`super::peak::wide_tiles`] (for [`f16_keys`]).
    wide: bool,
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
    fn run_task(
        ctx: &Ctx<'_>,
        g: &Group,
        col0: usize,
        cells: &mut [&mut [f32]],
        scratch: &mut Scratch,
    ) = |ISA| ctx.run(g, col0, cells, scratch);
}

impl Ctx<'_> {
    #[inline(always)]
    fn run(&self, g: &Group, col0: usize, cells: &mut [&mut [f32]], scratch: &mut Scratch) {
        let width = cells.first().map_or(0, |c| c.len());
        let col_end = col0 + width;
        for cell in cells.iter_mut() {
            cell.fill(f32::NEG_INFINITY);
        }
        let (lo, hi) = (g.lo.max(col0), g.hi.min(col_end));
        if lo >= hi {
            return;
        }
        let (h, d, rr) = (self.h, self.d, g.len);
        let m = rr * h;
        // Qᵀ [d × m], once per task; column `hh·rr + r` is head `hh` of the group's row `r`
        // (head-major: one head's rows are adjacent in a row of Cᵀ).
        let qs = &self.q[g.first * h * d..(g.first + rr) * h * d];
        let Scratch {
            qt,
            krows,
            qp,
            kb,
            c,
            ct,
            wt,
            hsum,
            qrows,
            qb,
            kt,
            ktb,
            kh,
        } = scratch;
        // The `amx` path's tiles take the bf16 route's `Cᵀ = K · Qᵀ` (any number of heads)
        // for whole tiles of pairs; elsewhere it runs the `avx512` routes.
        let tiles = self.isa.isa() == Isa::Amx && d % (2 * TILE_PAIRS) == 0;
        // The bf16 route: keys as bf16 rows, Q as pairs (`vdpbf16ps`, or AMX tiles).
        let bf16_dot = self.isa.isa().bf16_dot() || tiles;
        let visa = self.isa.vector();
        let ldq = padded_cols(m);
        let by_rows = rr >= ROW_VECTOR;
        let fp8_keys = matches!(self.layout.dtype(), IndexKDtype::Fp8E4m3 { .. });
        let f16_keys = !by_rows && !tiles && fp8_keys && f16_keys(visa, m, d, qs, self.wide);
        // Few query heads: C [m × keys] = Q · Kᵀ directly (the same chains, element by
        // element, as through Cᵀ: the same bits).
        let keys_along = !by_rows && !tiles && (keys_along(visa, m) || f16_keys);
        c.resize(BLOCK * m, 0.0);
        // `krows` stages Q in Qᵀ's column order (`hh·rr + r`) before the transpose.
        krows.resize(BLOCK.max(m) * d, 0.0);
        let staged = |r: usize, hh: usize| &qs[(r * h + hh) * d..][..d];
        if keys_along {
            kt.resize(d * BLOCK, 0.0);
            if fp8_keys && !bf16_dot {
                ktb.resize(d * BLOCK, 0);
            }
            if f16_keys {
                kh.resize(d * BLOCK, 0);
            }
            if bf16_dot {
                qb.resize(m * d, 0);
                kb.resize(BLOCK * d / 2, 0);
                for r in 0..rr {
                    for hh in 0..h {
                        let row = &mut qb[(hh * rr + r) * d..][..d];
                        for (x, v) in row.iter_mut().zip(staged(r, hh)) {
                            *x = v.to_bits();
                        }
                    }
                }
            } else {
                qrows.resize(m * d, 0.0);
                for r in 0..rr {
                    for hh in 0..h {
                        let row = &mut qrows[(hh * rr + r) * d..][..d];
                        widen::bf16s_f32_row(self.isa, staged(r, hh), row);
                    }
                }
                if f16_keys {
                    // Qᵀ times 2^8 for the keys' f16 form (2^-8 times their values): the
                    // same products (`f16_keys` excluded an overflow); splatted.
                    transpose(self.isa, m, d, qrows, d, krows, m);
                    for x in krows[..d * m].iter_mut() {
                        *x *= 256.0;
                    }
                    qt.resize(d * m * SPLAT, 0.0);
                    splat(&krows[..d * m], qt);
                }
            }
        } else if bf16_dot {
            qp.resize(d / 2 * ldq, 0);
            kb.resize(BLOCK * d / 2, 0);
            let half = d / 2;
            for r in 0..rr {
                for hh in 0..h {
                    let row = &mut krows[(hh * rr + r) * half..][..half];
                    for (x, v) in row.iter_mut().zip(staged(r, hh).chunks_exact(2)) {
                        *x = f32::from_bits(v[0].to_bits() as u32 | (v[1].to_bits() as u32) << 16);
                    }
                }
            }
            // A transpose moves bits only: the pairs arrive intact.
            let bits: &mut [f32] = bytemuck::cast_slice_mut(&mut qp[..]);
            transpose(self.isa, m, half, krows, half, bits, ldq);
        } else {
            qt.resize(d * m, 0.0);
            for r in 0..rr {
                for hh in 0..h {
                    let row = &mut krows[(hh * rr + r) * d..][..d];
                    widen::bf16s_f32_row(self.isa, staged(r, hh), row);
                }
            }
            transpose(self.isa, m, d, krows, d, qt, m);
        }
        if by_rows {
            // Weights head-major too: `wt[hh·rr + r]`.
            wt.resize(m, 0.0);
            hsum.resize(BLOCK * rr, 0.0);
            let w = &self.weights[g.first * h..(g.first + rr) * h];
            for r in 0..rr {
                for hh in 0..h {
                    wt[hh * rr + r] = w[r * h + hh];
                }
            }
        }
        if !by_rows {
            ct.resize(m * BLOCK, 0.0);
        }
        let mut scale = [1f32; BLOCK];
        let mut acc = [0f32; BLOCK];
        // The block's logits from a GEMM that sums the heads itself (not `acc`: a buffer
        // whose address a call takes stays in memory, and the head sums below keep `acc`
        // in registers: AMD Zen 4, 64 heads over fp8 keys, 23.2 against 24.1 ms).
        let mut sums = [0f32; BLOCK];
        // A few heads' `Cᵀ` in one call per block (fp8 keys on the bf16 dot product; on
        // `avx512`, AVX-512's 8-column tiles; see below).
        let whole_f32 = !bf16_dot && m <= 8 && visa == Isa::Avx512;
        // Those routes for one query row: the head sums are the GEMM's epilogue (the same
        // operations in the same order).
        let sums_in_gemm =
            !keys_along && !tiles && m <= 8 && rr == 1 && ((bf16_dot && fp8_keys) || whole_f32);
        // The task's tile configuration, held across its blocks' GEMMs.
        let _tiles = if tiles {
            super::amx::TileSession::begin()
        } else {
            None
        };
        // A block's page runs of fp8 codes (the `avx512bf16` route without `keys_along`).
        let mut runs: Vec<&[u8]> = Vec::new();
        let mut b0 = lo;
        self.prefetch_keys(g.request, lo, hi.min(lo + BLOCK));
        while b0 < hi {
            let n = BLOCK.min(hi - b0);
            // The next block's keys (scattered pages) come in while this one is computed.
            let next = (b0 + n)..hi.min(b0 + n + BLOCK);
            // The next block's keys of the chunk of SUB keys from `s0`, asked for before
            // that chunk's GEMM (requests spread over the block's compute instead of
            // queueing up at once).
            let ahead = |s0: usize| {
                let from = (next.start + s0).min(next.end);
                self.prefetch_keys(g.request, from, (from + SUB).min(next.end));
            };
            if keys_along {
                // Kᵀ, then C = Q · Kᵀ in column chunks of 2·SUB keys (each after the
                // prefetch of the next block's keys of the same chunk).
                let cols = (0..n)
                    .step_by(2 * SUB)
                    .map(|c0| (c0, (2 * SUB).min(n - c0)));
                if bf16_dot {
                    let a: &[u16] = match self.keys_in_place(g.request, b0, n) {
                        Some(a) if a.as_ptr().align_offset(4) == 0 => {
                            scale[..n].fill(1.0);
                            a
                        }
                        _ => {
                            let kb: &mut [u16] = bytemuck::cast_slice_mut(&mut kb[..]);
                            self.load_rows_bf16(g.request, b0, n, kb, &mut scale);
                            kb
                        }
                    };
                    // A transpose moves bits only: Kᵀ's pairs arrive intact.
                    let half = d / 2;
                    let pairs: &[f32] = bytemuck::cast_slice(&a[..n * d]);
                    transpose(self.isa, n, half, pairs, half, kt, BLOCK);
                    let ktp: &[u32] = bytemuck::cast_slice(&kt[..]);
                    for (c0, w) in cols {
                        ahead(c0);
                        ahead(c0 + SUB);
                        let dims = PairDims {
                            m,
                            n: w,
                            k2: half,
                            lda: d,
                            ldb: BLOCK,
                            ldc: BLOCK,
                        };
                        gemm_bf16_into(self.isa, dims, qb, &ktp[c0..], &mut ct[c0..]);
                    }
                } else {
                    // Kᵀ as the keys' f16 form (no NaN code in the block) or as f32.
                    let f16 = if fp8_keys {
                        self.transpose_fp8(g.request, b0, n, ktb, &mut scale);
                        let f16 = f16_keys
                            && !widen_cols(d, n, ktb, kh, |c, o| {
                                widen::e4m3_f16_row(self.isa, c, o)
                            });
                        if !f16 {
                            widen_cols(d, n, ktb, kt, |c, o| {
                                widen::e4m3_f32_row(self.isa, c, o);
                                false
                            });
                        }
                        f16
                    } else {
                        self.load_rows(g.request, b0, n, krows, &mut scale);
                        transpose(self.isa, n, d, krows, d, kt, BLOCK);
                        false
                    };
                    // The f16 form: the next block's keys asked for first, then the block
                    // in one call (AMD Zen 4, forced `avx2`, the tiny decode on one thread:
                    // 1080 against 1120 µs in calls of 2·SUB keys after each `ahead`).
                    let chunk = if f16 {
                        self.prefetch_keys(g.request, next.start, next.end);
                        BLOCK
                    } else {
                        2 * SUB
                    };
                    for c0 in (0..n).step_by(chunk) {
                        let w = chunk.min(n - c0);
                        if !f16 {
                            ahead(c0);
                            ahead(c0 + SUB);
                        }
                        if f16 {
                            // Whole vectors of keys (lanes past `n`: stale finite scores,
                            // never written out).
                            let dims = Dims {
                                m,
                                n: w.next_multiple_of(16),
                                k: d,
                                lda: m,
                                ldb: BLOCK,
                                ldc: BLOCK,
                            };
                            gemm_pairs_into_f16b(self.isa, dims, qt, &kh[c0..], &mut ct[c0..]);
                        } else {
                            let dims = Dims {
                                m,
                                n: w,
                                k: d,
                                lda: d,
                                ldb: BLOCK,
                                ldc: BLOCK,
                            };
                            gemm_pairs_into(self.isa, dims, qrows, &kt[c0..], &mut ct[c0..]);
                        }
                    }
                }
            } else if bf16_dot {
                // The next block's keys asked for first, then the whole block in one GEMM
                // call: with few heads a call of 16 keys is short enough for its fixed
                // cost to show (AMD Zen 4, one thread, 32 decode rows of 8 heads over 2048
                // fp8 keys: 675–680 µs against 750–757 µs in calls of 16 keys; 64 heads
                // unchanged).
                self.prefetch_keys(g.request, next.start, next.end);
                let dims = PairDims {
                    m: n,
                    n: m,
                    k2: d / 2,
                    lda: d,
                    ldb: ldq,
                    ldc: m,
                };
                let kb: &mut [u16] = bytemuck::cast_slice_mut(&mut kb[..]);
                if fp8_keys {
                    // The codes where they lie (a page's rows are adjacent), widened by the
                    // GEMM itself.
                    runs.clear();
                    for (j, slot, count) in self.segments(g.request, b0, b0 + n) {
                        runs.push(&self.cache[self.layout.slot_run_value_bytes(slot, count)]);
                        self.fp8_scales(slot, count, &mut scale[j..j + count]);
                    }
                    if sums_in_gemm {
                        // One query row: `C`'s columns are its heads, and the GEMM leaves
                        // each key's weighted head sum (times its scale) in `sums`.
                        let w = &self.weights[g.first * h..(g.first + 1) * h];
                        gemm_e4m3_relu_sums(self.isa, dims, &runs, kb, qp, w, &scale, c, &mut sums);
                    } else {
                        gemm_e4m3_into(self.isa, dims, &runs, kb, qp, c);
                    }
                } else {
                    // bf16 keys of one page are read where they are.
                    let a: &[u16] = match self.keys_in_place(g.request, b0, n) {
                        Some(a) => {
                            scale[..n].fill(1.0);
                            a
                        }
                        None => {
                            self.load_rows_bf16(g.request, b0, n, kb, &mut scale);
                            kb
                        }
                    };
                    gemm_bf16_into(self.isa, dims, a, qp, c);
                }
            } else {
                self.load_rows(g.request, b0, n, krows, &mut scale);
                // Cᵀ[keys × m] = K[keys × d] · Qᵀ[d × m], in chunks of SUB keys, each after
                // `ahead`. A few heads on AVX-512's 8-column tiles instead ask for the next
                // block's keys first, then run the block in one call (in calls of 16 keys
                // the fixed cost showed: AMD Zen 4, one thread, the tiny decode 1080
                // against 1010 µs; as on the bf16 route); for one query row the call leaves
                // the head sums in `sums`.
                if whole_f32 {
                    self.prefetch_keys(g.request, next.start, next.end);
                }
                let sub = if whole_f32 { n } else { SUB };
                for s0 in (0..n).step_by(sub) {
                    if !whole_f32 {
                        ahead(s0);
                    }
                    let dims = Dims {
                        m: sub.min(n - s0),
                        n: m,
                        k: d,
                        lda: d,
                        ldb: m,
                        ldc: m,
                    };
                    let (a, c) = (&krows[s0 * d..], &mut c[s0 * m..]);
                    if sums_in_gemm {
                        let w = &self.weights[g.first * h..(g.first + 1) * h];
                        gemm_pairs_relu_sums(self.isa, dims, a, qt, w, &scale, c, &mut sums);
                    } else {
                        gemm_pairs_into(self.isa, dims, a, qt, c);
                    }
                }
            }
            // The weighted ReLU head sum of every (row, key): `Σ_hh w·max(c, 0)` with one
            // FMA per head in head order, vectorised over the group's rows (many rows) or
            // over 16 keys (few rows): the same operations either way.
            if by_rows {
                // hs[j·rr + r]: head sums of this block, 16 rows at a time in registers.
                for (crow, hs) in c[..n * m].chunks_exact(m).zip(hsum.chunks_exact_mut(rr)) {
                    let mut r0 = 0;
                    while r0 < rr {
                        let cnt = 16.min(rr - r0);
                        let mut a16 = [0f32; 16];
                        let heads = wt.chunks_exact(rr).zip(crow.chunks_exact(rr));
                        if cnt == 16 {
                            for (wv, cv) in heads {
                                let (wv, cv) = (&wv[r0..r0 + 16], &cv[r0..r0 + 16]);
                                for ((a, &w), &cx) in a16.iter_mut().zip(wv).zip(cv) {
                                    *a = w.mul_add(cx.max(0.0), *a);
                                }
                            }
                        } else {
                            for (wv, cv) in heads {
                                let (wv, cv) = (&wv[r0..r0 + cnt], &cv[r0..r0 + cnt]);
                                for ((a, &w), &cx) in a16.iter_mut().zip(wv).zip(cv) {
                                    *a = w.mul_add(cx.max(0.0), *a);
                                }
                            }
                        }
                        // Not `copy_from_slice`: its overlap check (debug assertions)
                        // would keep `a16` in memory through the loops above.
                        super::raw::copy(&mut hs[r0..r0 + cnt], &a16[..cnt]);
                        r0 += cnt;
                    }
                }
                // The scratch's slice taken once, not through its `Deref` per key.
                let hsum: &[f32] = &hsum[..n * rr];
                for (r, (cell, row)) in cells
                    .iter_mut()
                    .zip(&self.rows[g.first..g.first + rr])
                    .enumerate()
                {
                    let Range { start: lo, end: hi } = keys_in_block(row, b0, n);
                    if lo == hi {
                        continue;
                    }
                    let dst = &mut cell[b0 + lo - col0..b0 + hi - col0];
                    let sums = hsum[lo * rr + r..].iter().step_by(rr);
                    for ((o, &x), &sc) in dst.iter_mut().zip(sums).zip(&scale[lo..hi]) {
                        *o = x * sc;
                    }
                }
            } else if sums_in_gemm {
                let row = &self.rows[g.first];
                let Range { start: lo, end: hi } = keys_in_block(row, b0, n);
                if let Some(cell) = cells.first_mut() {
                    cell[b0 + lo - col0..b0 + hi - col0].copy_from_slice(&sums[lo..hi]);
                }
            } else {
                // C = (Cᵀ)ᵀ: a (head, row)'s scores contiguous over the block's keys.
                if !keys_along {
                    transpose(self.isa, n, m, c, m, ct, BLOCK);
                }
                for (r, cell) in cells.iter_mut().enumerate() {
                    let row = &self.rows[g.first + r];
                    let w = &self.weights[(g.first + r) * h..(g.first + r + 1) * h];
                    // Every key of the block at once (independent chains); lanes past `n`
                    // hold stale finite values and are never written out.
                    acc.fill(0.0);
                    for (hh, &wh) in w.iter().enumerate() {
                        let cr = &ct[(hh * rr + r) * BLOCK..][..BLOCK];
                        for (a, &x) in acc.iter_mut().zip(cr) {
                            *a = wh.mul_add(x.max(0.0), *a);
                        }
                    }
                    let Range { start: lo, end: hi } = keys_in_block(row, b0, n);
                    let dst = &mut cell[b0 + lo - col0..b0 + hi - col0];
                    for ((o, &a), &sc) in dst.iter_mut().zip(&acc[lo..hi]).zip(&scale[lo..hi]) {
                        *o = a * sc;
                    }
                }
            }
            b0 += n;
        }
    }

    /// The positions `from..to` of `request` split at page boundaries: `(j, slot, count)`
    /// for positions `from + j .. from + j + count`, consecutive slots from `slot` in one
    /// page (one page-table lookup and division per page, not per key).
    #[inline(always)]
    fn segments(
        &self,
        request: usize,
        from: usize,
        to: usize,
    ) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let ps = self.layout.page_size();
        let mut pos = from;
        std::iter::from_fn(move || {
            (pos < to).then(|| {
                let end = to.min(pos - SlotAddr::of(pos, ps).offset + ps);
                let seg = (
                    pos - from,
                    self.page_table.slot(request, pos, ps),
                    end - pos,
                );
                pos = end;
                seg
            })
        })
    }

    /// Prefetches the key bytes (values and scales) of positions `from..to` of `request`.
    #[inline(always)]
    fn prefetch_keys(&self, request: usize, from: usize, to: usize) {
        let l = &self.layout;
        let ps = l.page_size();
        let mut pos = from;
        while pos < to {
            let end = to.min(pos - SlotAddr::of(pos, ps).offset + ps);
            let (first, last) = (
                self.page_table.slot(request, pos, ps),
                self.page_table.slot(request, end - 1, ps),
            );
            let values = l.slot_value_bytes(first).start..l.slot_value_bytes(last).end;
            prefetch(&self.cache[values]);
            if let (Some(a), Some(b)) = (l.slot_scale_bytes(first), l.slot_scale_bytes(last)) {
                prefetch(&self.cache[a.start..b.end]);
            }
            pos = end;
        }
    }

    /// The bf16 keys at positions `b0..b0+n` as rows of `d` in the cache itself, when the
    /// layout is bf16 and they lie in one page (their value rows are then contiguous).
    #[inline(always)]
    fn keys_in_place(&self, request: usize, b0: usize, n: usize) -> Option<&[u16]> {
        let l = &self.layout;
        if l.dtype() != IndexKDtype::Bf16 || n == 0 {
            return None;
        }
        let ps = l.page_size();
        let (first, last) = (
            self.page_table.slot(request, b0, ps),
            self.page_table.slot(request, b0 + n - 1, ps),
        );
        if SlotAddr::of(first, ps).page != SlotAddr::of(last, ps).page || last - first != n - 1 {
            return None;
        }
        let bytes = &self.cache[l.slot_value_bytes(first).start..l.slot_value_bytes(last).end];
        bytemuck::try_cast_slice(bytes).ok()
    }

    /// Writes the f32 scales of the fp8 keys in slots `slot..slot + count` (one page) to
    /// `out` (1 for a layout without scales).
    #[inline(always)]
    fn fp8_scales(&self, slot: usize, count: usize, out: &mut [f32]) {
        match self.layout.slot_run_scale_bytes(slot, count) {
            Some(r) => {
                for (x, b) in out.iter_mut().zip(self.cache[r].chunks_exact(4)) {
                    *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            None => out[..count].fill(1.0),
        }
    }

    /// The fp8 codes of positions `b0..b0+n` as Kᵀ `ktb[d][BLOCK]` (columns `0..n`: each
    /// page's codes transposed as bytes, a quarter of the bits an f32 transpose's shuffles
    /// move) and their scales.
    #[inline(always)]
    fn transpose_fp8(
        &self,
        request: usize,
        b0: usize,
        n: usize,
        ktb: &mut [u8],
        scale: &mut [f32],
    ) {
        let (l, d) = (&self.layout, self.d);
        for (j, slot, count) in self.segments(request, b0, b0 + n) {
            let codes = &self.cache[l.slot_run_value_bytes(slot, count)];
            transpose_bytes(self.isa, count, d, codes, d, &mut ktb[j..], BLOCK);
            self.fp8_scales(slot, count, &mut scale[j..j + count]);
        }
    }

    /// Dequantises keys at positions `b0..b0+n` into rows of `krows[BLOCK][d]`.
    #[inline(always)]
    fn load_rows(&self, request: usize, b0: usize, n: usize, krows: &mut [f32], scale: &mut [f32]) {
        let l = &self.layout;
        let d = self.d;
        for (j, slot, count) in self.segments(request, b0, b0 + n) {
            let vals = &self.cache[l.slot_run_value_bytes(slot, count)];
            let dst = &mut krows[j * d..(j + count) * d];
            let scale = &mut scale[j..j + count];
            match l.dtype() {
                IndexKDtype::Bf16 => {
                    widen::bf16_f32_row(self.isa, vals, dst);
                    scale.fill(1.0);
                }
                IndexKDtype::Fp8E4m3 { .. } => {
                    widen::e4m3_f32_row(self.isa, vals, dst);
                    self.fp8_scales(slot, count, scale);
                }
                IndexKDtype::Fp4E2m1 => {
                    // e2m1 × its group's power-of-two scale: exact in f32 (a NaN scale
                    // byte makes the group NaN).
                    let scales = l
                        .slot_run_scale_bytes(slot, count)
                        .map_or(&[][..], |r| &self.cache[r]);
                    widen::fp4_f32_groups(self.isa, vals, scales, dst);
                    scale.fill(1.0);
                }
            }
        }
    }

    /// [`Ctx::load_rows`] as bf16 rows `kb[BLOCK][d]` (every key value is a bf16 value;
    /// `vdpbf16ps` reads a subnormal as zero, as the f32 rows flush it). A page's keys are
    /// widened by one call (their value rows are adjacent).
    #[inline(always)]
    fn load_rows_bf16(
        &self,
        request: usize,
        b0: usize,
        n: usize,
        kb: &mut [u16],
        scale: &mut [f32],
    ) {
        let l = &self.layout;
        let d = self.d;
        for (j, slot, count) in self.segments(request, b0, b0 + n) {
            let vals = &self.cache[l.slot_run_value_bytes(slot, count)];
            let dst = &mut kb[j * d..(j + count) * d];
            let scale = &mut scale[j..j + count];
            match l.dtype() {
                IndexKDtype::Bf16 => {
                    for (x, b) in dst.iter_mut().zip(vals.chunks_exact(2)) {
                        *x = u16::from_le_bytes([b[0], b[1]]);
                    }
                    scale.fill(1.0);
                }
                IndexKDtype::Fp8E4m3 { .. } => {
                    widen::e4m3_row_pow2(self.isa, vals, 0, dst);
                    self.fp8_scales(slot, count, scale);
                }
                IndexKDtype::Fp4E2m1 => {
                    let scales = l
                        .slot_run_scale_bytes(slot, count)
                        .map_or(&[][..], |r| &self.cache[r]);
                    widen::fp4_groups(self.isa, vals, scales, dst);
                    scale.fill(1.0);
                }
            }
        }
    }
}
