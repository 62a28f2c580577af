//! The tensor-core part of `sparse_mla`: Q fragments, partial scores, the online
//! softmax, O += P·V, and the final merge of the two key halves.
//!
//! Dim permutation inside a k-step (applied to Q and K alike, so the dot products are
//! unchanged): lane `t` of an mma group supplies dims `4t, 4t+1` as k `2t, 2t+1` and dims
//! `4t+2, 4t+3` as k `2t+8, 2t+9`, so each operand register pair is one 8-byte load.

use super::gather::load16;
use super::{pass_cols, Geometry, Role, BN, MAX_NT, PLAIN};
use crate::global::{GlobalMut, GlobalPtr, V2, V4};
use crate::kernels::FULL;
use crate::math::{exp2, fma, log2, LN_2, LOG2_E};
use crate::params::kv_format::FP8_DS_MLA_TILE;
use crate::params::SparseMlaParams;
use crate::simt::Simt;

/// Round P to bf16 twice (`p ≈ hi + lo`) and multiply both into V: ~2^-17 relative
/// probabilities instead of 2^-9, for one more mma per V fragment.
const SPLIT_P: bool = false;

/// The k-steps (of 16 dims) of the scores a warp owns.
pub(super) struct KRange {
    pub lo: u32,
    pub hi: u32,
}

/// The output n-tiles of a warp in the current column pass.
pub(super) struct Cols {
    /// First n-tile, counted from the pass's first.
    pub first: u32,
    /// Number of n-tiles (≤ [`MAX_NT`]).
    pub ntw: u32,
    /// First column.
    pub base: u32,
}

impl Cols {
    /// See `Role::opaque`.
    #[inline(always)]
    pub(super) fn opaque(&self, z: u32) -> Self {
        Cols {
            first: self.first + z,
            ntw: self.ntw + z,
            base: self.base + z,
        }
    }
}

/// Running softmax statistics of rows `g` (index 0) and `g + 8` (index 1) of this warp's
/// key half, base 2.
pub(super) struct Softmax {
    m: [f32; 2],
    /// Σ of the f32 probabilities (→ lse).
    l: [f32; 2],
    /// Σ of the bf16 probabilities that multiply V (→ normalisation).
    lt: [f32; 2],
}

impl Softmax {
    pub(super) fn new() -> Self {
        Softmax {
            m: [f32::NEG_INFINITY; 2],
            l: [0.0; 2],
            lt: [0.0; 2],
        }
    }
}

/// bf16 bits of `x`, rounded to nearest even (NaN stays NaN).
#[inline(always)]
fn bf16_rne(x: f32) -> u32 {
    let b = x.to_bits();
    if x.is_nan() {
        (b >> 16) | 0x40
    } else {
        (b + 0x7fff + ((b >> 16) & 1)) >> 16
    }
}

/// `x` rounded to bf16 (bits, and the value as f32).
#[inline(always)]
fn round_bf16(x: f32) -> (u32, f32) {
    let b = bf16_rne(x);
    (b, f32::from_bits(b << 16))
}

/// Stages the group's queries (16 rows × d_qk bf16, rows past `n_heads` zero) in the Q
/// area, chunk-swizzled like the key rows.
///
/// # Safety
/// `token < n_tokens`; no one reads the Q area until the next barrier, and no one has
/// read it since the last one.
#[inline(always)]
pub(super) unsafe fn stage_q<S: Simt>(p: &SparseMlaParams, g: &Geometry, token: u32, h0: u32) {
    let aligned = p.q.addr() % 16 == 0;
    let total = 16 * g.chunks;
    let mut i = S::thread_idx();
    while i < total {
        let (row, c) = (i / g.chunks, i % g.chunks);
        let head = h0 + row;
        let v = if head < p.n_heads {
            let at = (token as usize * p.n_heads as usize + head as usize) * g.d_qk as usize
                + 8 * c as usize;
            // SAFETY: head < n_heads, 8c + 8 ≤ d_qk: 8 bf16 of the token's query; 16-byte
            // aligned when `aligned` (d_qk is a multiple of 16).
            unsafe { load16::<S>(p.q.add(at).cast::<u8>(), aligned) }
        } else {
            [0; 4]
        };
        // SAFETY: row < 16, c < chunks: inside the Q area; 16-byte aligned; one owner.
        unsafe { S::smem_store(g.q_off as usize + g.chunk_addr(row, c), V4(v)) };
        i += S::block_dim();
    }
}

/// Adds one chain's scores `acc` (columns = keys `key0 + 2t`, `key0 + 2t + 1`) of segment
/// `seg` to `tot`, times the keys' tile scale for a tile segment.
///
/// # Safety
/// Scales stored before the last barrier; `key0 + 2t + 1 < 32`.
#[inline(always)]
unsafe fn fold<S: Simt>(g: &Geometry, tot: &mut [f32; 4], acc: [f32; 4], seg: u32, key: u32) {
    if seg == PLAIN {
        unroll!(4, i, {
            tot[i] += acc[i];
        });
    } else {
        // SAFETY: seg < tiles, key + 1 < 32: two scales of the table, 8-byte aligned
        // (key even).
        let s = unsafe { S::smem_load::<[f32; 2]>((g.scale_off + 4 * (seg * BN + key)) as usize) };
        tot[0] = fma(s[0], acc[0], tot[0]);
        tot[1] = fma(s[1], acc[1], tot[1]);
        tot[2] = fma(s[0], acc[2], tot[2]);
        tot[3] = fma(s[1], acc[3], tot[3]);
    }
}

/// Partial scores of this warp (its k-steps × its key half) into the partial area.
///
/// Per tile segment, even and odd k-steps accumulate in separate chains (4 independent
/// mma chains per warp instead of 2), added (even + odd) when the segment ends.
///
/// # Safety
/// Q area, key block and scales stored before the last barrier; no one reads the partial
/// area until the next barrier.
#[inline(always)]
pub(super) unsafe fn scores<S: Simt>(g: &Geometry, r: &Role, q: &KRange) {
    let mut tot = [[0f32; 4]; 2];
    let key0 = 16 * r.kh + 2 * r.t;
    let half = 8 * (r.t & 1) as usize;
    // One k-step into the chains `acc[·][par]`.
    let step = |ks: u32, par: usize, acc: &mut [[[f32; 4]; 2]; 2]| {
        let chunk = 2 * ks + (r.t >> 1);
        let qa = g.q_off as usize + half;
        // SAFETY: rows g, g + 8 < 16, chunk < chunks: inside the Q area; 8-byte aligned;
        // stored before the barrier.
        let (lo, hi) = unsafe {
            (
                S::smem_load::<V2>(qa + g.chunk_addr(r.g, chunk)).0,
                S::smem_load::<V2>(qa + g.chunk_addr(r.g + 8, chunk)).0,
            )
        };
        let a = [lo[0], hi[0], lo[1], hi[1]];
        unroll!(2, nt, {
            let row = 16 * r.kh + 8 * nt as u32 + r.g;
            // SAFETY: row < 32, chunk < chunks: inside the key block; 8-byte aligned;
            // stored before the barrier.
            let b = unsafe { S::smem_load::<V2>(g.chunk_addr(row, chunk) + half) }.0;
            acc[nt][par] = S::mma_bf16_m16n8k16(a, b, acc[nt][par]);
        });
    };
    let nope_ks = g.nope / 16;
    let mut ks = q.lo;
    while ks < q.hi {
        let seg = g.segment(ks);
        let end = if seg == PLAIN {
            q.hi
        } else {
            q.hi.min(nope_ks).min(8 * (seg + 1))
        };
        let mut acc = [[[0f32; 4]; 2]; 2];
        while ks + 1 < end {
            step(ks, 0, &mut acc);
            step(ks + 1, 1, &mut acc);
            ks += 2;
        }
        if ks < end {
            step(ks, 0, &mut acc);
            ks += 1;
        }
        unroll!(2, nt, {
            let mut sum = acc[nt][0];
            unroll!(4, i, {
                sum[i] += acc[nt][1][i];
            });
            // SAFETY: see `fold`.
            unsafe { fold::<S>(g, &mut tot[nt], sum, seg, key0 + 8 * nt as u32) };
        });
    }
    unroll!(2, nt, {
        let at = g.part_off as usize + part_index(r.q4, r.kh, nt as u32, r.lane) * 16;
        // SAFETY: inside the partial area, 16-byte aligned, this lane's own entry.
        unsafe { S::smem_store(at, V4(tot[nt].map(f32::to_bits))) };
    });
}

/// Entry of the partial-score area.
#[inline(always)]
fn part_index(q4: u32, kh: u32, nt: u32, lane: u32) -> usize {
    (((q4 * 2 + kh) * 2 + nt) * 32 + lane) as usize
}

/// bf16 bits of `v` at position `j` (const after unrolling) of packed words.
#[inline(always)]
fn half(words: &[u32; 4], j: usize) -> u32 {
    (words[j / 2] >> (16 * (j & 1))) & 0xffff
}

/// Softmax of this block's scores (this warp's key half, `n` keys in the block) and
/// `O += P·V` for this warp's columns.
///
/// # Safety
/// Partial scores and key block stored before the last barrier; nothing is stored to
/// them until the next.
#[inline(always)]
pub(super) unsafe fn softmax_pv<S: Simt>(
    p: &SparseMlaParams,
    g: &Geometry,
    r: &Role,
    cols: &Cols,
    n: u32,
    st: &mut Softmax,
    o: &mut [[f32; 4]; MAX_NT],
) {
    let sl2 = p.softmax_scale * LOG2_E;
    // Scores: the four quarters in order, scaled, keys past the block masked.
    let mut x = [[0f32; 4]; 2];
    unroll!(2, nt, {
        unroll!(4, w, {
            let at = g.part_off as usize + part_index(w as u32, r.kh, nt as u32, r.lane) * 16;
            // SAFETY: inside the partial area, 16-byte aligned, stored before the barrier.
            let v = unsafe { S::smem_load::<V4>(at) }.0;
            unroll!(4, i, {
                let f = f32::from_bits(v[i]);
                x[nt][i] = if w == 0 { f } else { x[nt][i] + f };
            });
        });
        unroll!(4, i, {
            let key = 16 * r.kh + 8 * nt as u32 + 2 * r.t + (i as u32 & 1);
            x[nt][i] = if key < n {
                x[nt][i] * sl2
            } else {
                f32::NEG_INFINITY
            };
        });
    });
    // Row maxima (rows g: elements 0, 1; g + 8: 2, 3) over the 4 lanes of a group.
    let mut mx = [
        x[0][0].max(x[0][1]).max(x[1][0].max(x[1][1])),
        x[0][2].max(x[0][3]).max(x[1][2].max(x[1][3])),
    ];
    let mut corr = [0f32; 2];
    let mut mu = [0f32; 2];
    unroll!(2, h, {
        mx[h] = mx[h].max(S::shfl_xor_f32(FULL, mx[h], 1));
        mx[h] = mx[h].max(S::shfl_xor_f32(FULL, mx[h], 2));
        let m_new = st.m[h].max(mx[h]);
        // An all-masked row keeps a finite reference (every exp2 below is then 0).
        mu[h] = if m_new == f32::NEG_INFINITY {
            0.0
        } else {
            m_new
        };
        corr[h] = exp2(st.m[h] - mu[h]);
        st.m[h] = m_new;
    });
    // fp8: the keys' scales of the tile that holds this warp's columns multiply P.
    let mut vs = [[1f32; 2]; 2];
    if g.fp8 && cols.ntw > 0 {
        let tile = cols.base / FP8_DS_MLA_TILE;
        unroll!(2, nt, {
            let key = 16 * r.kh + 8 * nt as u32 + 2 * r.t;
            // SAFETY: tile < tiles, key + 1 < 32: two scales of the table, 8-byte aligned
            // (key even); stored before the barrier.
            vs[nt] =
                unsafe { S::smem_load::<[f32; 2]>((g.scale_off + 4 * (tile * BN + key)) as usize) };
        });
    }
    // Probabilities, their bf16 roundings, and both row sums.
    let mut pb = [[0u32; 4]; 2];
    let mut plo = [[0u32; 4]; 2];
    let mut sum = [[0f32; 2]; 2];
    let mut sumt = [[0f32; 2]; 2];
    unroll!(2, nt, {
        unroll!(4, i, {
            let e = exp2(x[nt][i] - mu[i / 2]);
            let (b, bv) = round_bf16(e);
            let (ab, abv, pa) = if g.fp8 {
                let pa = e * vs[nt][i & 1];
                let (ab, abv) = round_bf16(pa);
                (ab, abv, pa)
            } else {
                (b, bv, e)
            };
            pb[nt][i] = ab;
            if SPLIT_P {
                plo[nt][i] = bf16_rne(pa - abv);
            }
            sum[nt][i / 2] += e;
            sumt[nt][i / 2] += if SPLIT_P { e } else { bv };
        });
    });
    unroll!(2, h, {
        let mut s = sum[0][h] + sum[1][h];
        let mut s_t = sumt[0][h] + sumt[1][h];
        s += S::shfl_xor_f32(FULL, s, 1);
        s += S::shfl_xor_f32(FULL, s, 2);
        s_t += S::shfl_xor_f32(FULL, s_t, 1);
        s_t += S::shfl_xor_f32(FULL, s_t, 2);
        st.l[h] = fma(st.l[h], corr[h], s);
        st.lt[h] = fma(st.lt[h], corr[h], s_t);
    });
    unroll!(16, j, {
        if (j as u32) < cols.ntw {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }
    });
    // A = P (rows g, g+8; k = the half's 16 keys): n-tile 0 → k 0..8, n-tile 1 → k 8..16.
    let pack = |f: &[[u32; 4]; 2]| {
        [
            f[0][0] | (f[0][1] << 16),
            f[0][2] | (f[0][3] << 16),
            f[1][0] | (f[1][1] << 16),
            f[1][2] | (f[1][3] << 16),
        ]
    };
    let a = pack(&pb);
    let a_lo = pack(&plo);
    // B = V: keys 2t, 2t+1 (b[0]) and 2t+8, 2t+9 (b[1]) of the half; column g of n-tile
    // j = base + g·ntw + j.
    let row0 = 16 * r.kh + 2 * r.t;
    let rows = [row0, row0 + 1, row0 + 8, row0 + 9];
    let mut mma = |j: usize, v: [u32; 4]| {
        let b = [v[0] | (v[1] << 16), v[2] | (v[3] << 16)];
        o[j] = S::mma_bf16_m16n8k16(a, b, o[j]);
        if SPLIT_P {
            o[j] = S::mma_bf16_m16n8k16(a_lo, b, o[j]);
        }
    };
    if cols.ntw % 8 == 0 {
        // 8 n-tiles per 16-byte chunk of each key row.
        unroll!(2, c, {
            if (8 * c as u32) < cols.ntw {
                let chunk = cols.base / 8 + (cols.ntw / 8) * r.g + c as u32;
                let mut v = [[0u32; 4]; 4];
                unroll!(4, k, {
                    // SAFETY: row < 32, chunk < chunks; stored before the barrier.
                    v[k] = unsafe { S::smem_load::<V4>(g.chunk_addr(rows[k], chunk)) }.0;
                });
                unroll!(8, j, {
                    mma(
                        8 * c + j,
                        [
                            half(&v[0], j),
                            half(&v[1], j),
                            half(&v[2], j),
                            half(&v[3], j),
                        ],
                    );
                });
            }
        });
    } else {
        unroll!(16, j, {
            if (j as u32) < cols.ntw {
                let col = cols.base + r.g * cols.ntw + j as u32;
                let mut v = [0u32; 4];
                unroll!(4, k, {
                    let at = g.chunk_addr(rows[k], col / 8) + 2 * (col % 8) as usize;
                    // SAFETY: one bf16 of a key row (col < nope); stored before the barrier.
                    v[k] = unsafe { S::smem_load::<u16>(at) } as u32;
                });
                mma(j, v);
            }
        });
    }
}

/// Unnormalised values of this warp's output columns (`o[j][i]`: rows g (i < 2) and g + 8,
/// as the mma accumulators) and the row statistics (base 2) they go with.
pub(super) struct Merged {
    pub o: [[f32; 4]; MAX_NT],
    pub m: [f32; 2],
    pub l: [f32; 2],
    pub lt: [f32; 2],
}

/// Merges the two key halves of every quarter (fixed order: `m = max(m₀, m₁)`, weights
/// `2^(mᵢ - m)`) through shared memory; `Some` for the key-half-0 warps, which hold the
/// merged values, `None` for the others.
///
/// # Safety
/// Every thread calls it after a barrier that follows the last read of the key block and
/// partial areas.
#[inline(always)]
unsafe fn merge_halves<S: Simt>(
    g: &Geometry,
    r: &Role,
    cols: &Cols,
    st: &Softmax,
    o: &[[f32; 4]; MAX_NT],
) -> Option<Merged> {
    let acc_at = |j: usize| ((cols.first as usize + j) * 32 + r.lane as usize) * 16;
    let stat_at = |row: u32, k: u32| (g.part_off + 4 * (4 * row + k)) as usize;
    if r.kh == 1 {
        unroll!(16, j, {
            if (j as u32) < cols.ntw {
                // SAFETY: (first + j) < 64 n-tiles of the pass: 16·32·(first + j + 1) ≤
                // 64·(columns of the pass) ≤ 32·row_bytes, inside the key block area.
                unsafe { S::smem_store(acc_at(j), V4(o[j].map(f32::to_bits))) };
            }
        });
        if r.q4 == 0 && r.t == 0 {
            unroll!(2, h, {
                let row = r.g + 8 * h as u32;
                // SAFETY: 16 rows × 3 f32 inside the partial area, stored once.
                unsafe {
                    S::smem_store(stat_at(row, 0), st.m[h]);
                    S::smem_store(stat_at(row, 1), st.l[h]);
                    S::smem_store(stat_at(row, 2), st.lt[h]);
                }
            });
        }
    }
    S::sync_threads();
    if r.kh == 1 {
        return None;
    }
    let mut c0 = [0f32; 2];
    let mut c1 = [0f32; 2];
    let mut out = Merged {
        o: [[0f32; 4]; MAX_NT],
        m: [0f32; 2],
        l: [0f32; 2],
        lt: [0f32; 2],
    };
    unroll!(2, h, {
        let row = r.g + 8 * h as u32;
        // SAFETY: stored by warp (0, 1) before the barrier.
        let (m1, l1, lt1) = unsafe {
            (
                S::smem_load::<f32>(stat_at(row, 0)),
                S::smem_load::<f32>(stat_at(row, 1)),
                S::smem_load::<f32>(stat_at(row, 2)),
            )
        };
        let m0 = st.m[h];
        let m = m0.max(m1);
        let mu = if m == f32::NEG_INFINITY { 0.0 } else { m };
        c0[h] = exp2(m0 - mu);
        c1[h] = exp2(m1 - mu);
        out.m[h] = m;
        out.l[h] = fma(l1, c1[h], st.l[h] * c0[h]);
        out.lt[h] = fma(lt1, c1[h], st.lt[h] * c0[h]);
    });
    unroll!(16, j, {
        if (j as u32) < cols.ntw {
            // SAFETY: stored by warp (q4, 1) before the barrier.
            let o1 = unsafe { S::smem_load::<V4>(acc_at(j)) }.0;
            unroll!(4, i, {
                let h = i / 2;
                out.o[j][i] = fma(f32::from_bits(o1[i]), c1[h], o[j][i] * c0[h]);
            });
        }
    });
    Some(out)
}

/// `1 / l̃` (0 for an empty row) and the natural-log lse (`-inf` for an empty row) of row
/// statistics (base 2).
#[inline(always)]
fn finish(m: f32, l: f32, lt: f32) -> (f32, f32) {
    let inv = if lt > 0.0 { 1.0 / lt } else { 0.0 };
    let lse = if m == f32::NEG_INFINITY {
        f32::NEG_INFINITY
    } else {
        (m + log2(l)) * LN_2
    };
    (inv, lse)
}

/// Merges the two key halves, writes `out` (bf16) and, in pass 0, `lse`.
///
/// # Safety
/// Every thread calls it after a barrier that follows the last read of the key block and
/// partial areas; `token < n_tokens`, `h0 < n_heads`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn merge_and_write<S: Simt>(
    p: &SparseMlaParams,
    g: &Geometry,
    r: &Role,
    cols: &Cols,
    token: u32,
    h0: u32,
    pass: u32,
    st: &Softmax,
    o: &[[f32; 4]; MAX_NT],
) {
    // SAFETY: forwarded.
    let Some(mg) = (unsafe { merge_halves::<S>(g, r, cols, st, o) }) else {
        return;
    };
    let mut inv = [0f32; 2];
    let mut lse = [0f32; 2];
    unroll!(2, h, {
        (inv[h], lse[h]) = finish(mg.m[h], mg.l[h], mg.lt[h]);
    });
    // SAFETY: forwarded.
    unsafe { write_out::<S>(p, g, r, cols, token, h0, pass, &mg.o, inv, lse) };
}

/// Floats of one pass of a split's partial record: 4 quarters × [`MAX_NT`] n-tiles × 32
/// lanes × 4 accumulators, in lane order (so that each warp's stores and loads are 512
/// contiguous bytes).
pub(super) const PASS_FLOATS: u32 = 4 * MAX_NT as u32 * 32 * 4;

/// Float offset of the accumulators of quarter `q4`, n-tile `j`, lane `lane` in a pass.
#[inline(always)]
fn lane_slot(q4: u32, j: usize, lane: u32) -> usize {
    ((q4 as usize * MAX_NT + j) * 32 + lane as usize) * 4
}

/// Merges the two key halves and stores this split's unnormalised output columns of pass
/// `pass` and (in pass 0) the row statistics into its workspace record `rec`.
///
/// # Safety
/// As [`merge_and_write`]; `rec` is this (token, group, split)'s record of
/// [`Geometry::record_floats`] floats, written by no other block.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn merge_and_store_partial<S: Simt>(
    g: &Geometry,
    r: &Role,
    cols: &Cols,
    pass: u32,
    st: &Softmax,
    o: &[[f32; 4]; MAX_NT],
    rec: GlobalMut<f32>,
) {
    // SAFETY: forwarded.
    let Some(mg) = (unsafe { merge_halves::<S>(g, r, cols, st, o) }) else {
        return;
    };
    let base = rec.add((pass * PASS_FLOATS) as usize);
    unroll!(16, j, {
        if (j as u32) < cols.ntw {
            let at = base.add(lane_slot(r.q4, j, r.lane)).cast::<V4>();
            // SAFETY: inside this record's pass block, 16-byte aligned (records and
            // slots are multiples of 4 floats, the workspace 16-byte aligned).
            unsafe { S::gst(at, V4(mg.o[j].map(f32::to_bits))) };
        }
    });
    if pass == 0 && r.q4 == 0 && r.t == 0 {
        let stats = rec.add((g.passes * PASS_FLOATS) as usize);
        unroll!(2, h, {
            let row = (r.g + 8 * h as u32) as usize;
            // SAFETY: the record's 16 rows × 4 stats floats; stored once per row.
            unsafe {
                S::gst(stats.add(4 * row), mg.m[h]);
                S::gst(stats.add(4 * row + 1), mg.l[h]);
                S::gst(stats.add(4 * row + 2), mg.lt[h]);
            }
        });
    }
}

/// The last split of a (token, head group) to finish merges all splits' records (fixed
/// order: split 0, 1, ...; `m = max mₛ`, weights `2^(mₛ - m)`) and writes `out` and `lse`,
/// pass by pass. Key-half-0 warps do the work, with the same lanes and columns as
/// [`merge_and_write`].
///
/// # Safety
/// Every split's record of this (token, group) is complete and visible (the caller's
/// counter and fences); `recs` is split 0's record, the others follow at
/// [`Geometry::record_floats`] strides; `token < n_tokens`, `h0 < n_heads`.
#[inline(always)]
pub(super) unsafe fn merge_splits<S: Simt>(
    p: &SparseMlaParams,
    g: &Geometry,
    r: &Role,
    token: u32,
    h0: u32,
    recs: GlobalPtr<f32>,
) {
    if r.kh == 1 {
        return;
    }
    let stride = g.record_floats() as usize;
    let stats = (g.passes * PASS_FLOATS) as usize;
    let stat = |s: usize, row: u32, k: usize| {
        let at = recs.add(s * stride + stats + 4 * row as usize + k);
        // SAFETY: the stats of split s (s < splits), written before the count.
        unsafe { S::gld(at) }
    };
    let rows = [r.g, r.g + 8];
    // Row statistics over the splits (runtime loops over the splits: each split's
    // weight is recomputed where it is used, identically, rather than kept).
    let mut mu = [0f32; 2];
    let mut inv = [0f32; 2];
    let mut lse = [0f32; 2];
    unroll!(2, h, {
        let mut m = f32::NEG_INFINITY;
        let mut s = 0;
        while s < g.splits as usize {
            m = m.max(stat(s, rows[h], 0));
            s += 1;
        }
        mu[h] = if m == f32::NEG_INFINITY { 0.0 } else { m };
        let (mut l, mut lt) = (0f32, 0f32);
        let mut s = 0;
        while s < g.splits as usize {
            let w = exp2(stat(s, rows[h], 0) - mu[h]);
            l = fma(stat(s, rows[h], 1), w, l);
            lt = fma(stat(s, rows[h], 2), w, lt);
            s += 1;
        }
        (inv[h], lse[h]) = finish(m, l, lt);
    });
    let mut pass = 0;
    while pass < g.passes {
        let cols = pass_cols(g, r, pass);
        let mut acc = [[0f32; 4]; MAX_NT];
        let mut s = 0;
        while s < g.splits as usize {
            let w = [
                exp2(stat(s, rows[0], 0) - mu[0]),
                exp2(stat(s, rows[1], 0) - mu[1]),
            ];
            let base = recs.add(s * stride + (pass * PASS_FLOATS) as usize);
            unroll!(16, j, {
                if (j as u32) < cols.ntw {
                    let at = base.add(lane_slot(r.q4, j, r.lane)).cast::<V4>();
                    // SAFETY: the slot stored by this lane's counterpart in split s.
                    let v = unsafe { S::gld(at) }.0;
                    unroll!(4, i, {
                        acc[j][i] = fma(f32::from_bits(v[i]), w[i / 2], acc[j][i]);
                    });
                }
            });
            s += 1;
        }
        // SAFETY: forwarded (token, h0 in range).
        unsafe { write_out::<S>(p, g, r, &cols, token, h0, pass, &acc, inv, lse) };
        pass += 1;
    }
}

/// Writes this lane's output columns (values `o`, scaled by `inv` and rounded to bf16,
/// nearest even) and, in pass 0, `lse`.
///
/// # Safety
/// `token < n_tokens`, `h0 < n_heads`; `cols` are this warp's columns of `pass`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn write_out<S: Simt>(
    p: &SparseMlaParams,
    g: &Geometry,
    r: &Role,
    cols: &Cols,
    token: u32,
    h0: u32,
    pass: u32,
    o: &[[f32; 4]; MAX_NT],
    inv: [f32; 2],
    lse: [f32; 2],
) {
    // Final values as packed bf16: half-word j % 2 of ob[h][e][j / 2] = row g + 8h,
    // column base + (2t + e)·ntw + j.
    let mut ob = [[[0u32; MAX_NT / 2]; 2]; 2];
    unroll!(16, j, {
        if (j as u32) < cols.ntw {
            unroll!(4, i, {
                let h = i / 2;
                ob[h][i & 1][j / 2] |= bf16_rne(o[j][i] * inv[h]) << (16 * (j & 1));
            });
        }
    });
    let vector = p.out.addr() % 16 == 0;
    unroll!(2, h, {
        let head = h0 + r.g + 8 * h as u32;
        if head < p.n_heads {
            let row = (token as usize * p.n_heads as usize + head as usize) * g.nope as usize;
            let first = row + (cols.base + 2 * r.t * cols.ntw) as usize;
            let dst = p.out.add(first);
            if vector && cols.ntw == MAX_NT as u32 {
                unroll!(4, k, {
                    // Words 4k..4k+4: values 8k..8k+8 of (e = k / 2, j = 8(k % 2)..).
                    let e = k / 2;
                    let j0 = 8 * (k % 2);
                    let w = &ob[h][e][j0 / 2..j0 / 2 + 4];
                    // SAFETY: 8 bf16 of the row's columns (< nope), 16-byte aligned
                    // (`out`, nope and the column are).
                    unsafe { S::gst(dst.add(8 * k).cast::<V4>(), V4([w[0], w[1], w[2], w[3]])) };
                });
            } else if vector && cols.ntw == 8 {
                unroll!(2, e, {
                    let w = &ob[h][e];
                    // SAFETY: 8 bf16 of the row's columns (< nope), 16-byte aligned.
                    unsafe { S::gst(dst.add(8 * e).cast::<V4>(), V4([w[0], w[1], w[2], w[3]])) };
                });
            } else {
                unroll!(2, e, {
                    unroll!(16, j, {
                        if (j as u32) < cols.ntw {
                            let at = e as u32 * cols.ntw + j as u32;
                            // SAFETY: column base + (2t + e)·ntw + j < nope.
                            unsafe {
                                S::gst(
                                    dst.add(at as usize),
                                    (ob[h][e][j / 2] >> (16 * (j & 1))) as u16,
                                )
                            };
                        }
                    });
                });
            }
            if pass == 0 && r.q4 == 0 && r.t == 0 {
                // SAFETY: head < n_heads, token < n_tokens.
                unsafe {
                    S::gst(
                        p.lse
                            .add(token as usize * p.n_heads as usize + head as usize),
                        lse[h],
                    )
                };
            }
        }
    });
}
