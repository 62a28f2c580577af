//! `sparse_mla_v4` on the GPU: DeepSeek-V4's sparse attention (K = V = a 512-d row, a
//! main and an extra cache, the attention sink), on bf16 tensor cores (`mma.sync.m16n8k16`,
//! f32 accumulation). On `sm_120a`, when every cache is `model1_fp8`, the scores' 448 NoPE
//! dims run on the block-scaled MXFP8 mma instead (module `block_scaled`: the keys' codes
//! and tile scales as stored, the queries split into two e4m3 parts); everything else is
//! the same.
//!
//! # Launch geometry
//!
//! One block of [`THREADS`] = 128 threads (4 warps) per work item `(token, split, group of
//! 16 heads)`, token-major; grid = items clamped to [`MAX_GRID`], grid-stride beyond.
//! Shared memory [`SMEM`] bytes (45648, the block-scaled path's areas included on every
//! arch: two blocks still fit an SM120 SM's ~100 KiB).
//!
//! # Algorithm (per item)
//!
//! A token's keys are the entries of its main list that are inside its main length and not
//! `-1`, then those of its extra list; `split` consecutive positions of that main ‖ extra
//! list form a split ([`sparse_mla_v4_split`], a function of the list's size only). The
//! split's valid keys, in order, are cut into blocks of [`BN`] = 16 (`gather::Scan`: every
//! warp walks the list with ballots and finds the same blocks). Per block:
//! 1. **Gather** (thread `8·key + sub`): the key's row into shared memory as bf16 — MODEL1
//!    codes widened exactly and multiplied by their tile's ue8m0 scale (exact: at most 4
//!    significant bits), rope and bf16_512 values as they are; zeros for missing keys.
//! 2. **S = Q·Kᵀ**: warp `w` owns dims `128w .. 128w + 128` (4 pairs of k-steps) for the
//!    block's 2 n-tiles; within a pair of k-steps lane `t` loads the 16-byte chunk `t` of
//!    each row (a fixed permutation of the dims inside the pair, the same for Q and K). The
//!    4 partial scores go through shared memory and every warp sums them in warp order.
//! 3. **Online softmax** (f32, base 2), identical in every warp: running max `m`, sums `l`
//!    (of the f32 probabilities, for the lse) and `l̃` (of the bf16-rounded ones, which
//!    normalise the output); the rounded probabilities are the A operand of
//! 4. **O += P·V**: warp `w` owns output columns `128w .. 128w + 128` (16 n-tiles); lane
//!    `g` of n-tile `j` holds column `128w + 16g + j`, so a lane's V columns are two
//!    16-byte chunks of a row.
//!
//! Then `lse = ln 2 · (m + log2 l)` (without the sink), `out = O / l̃ · 1 / (1 + exp(sink −
//! lse))` rounded to bf16; a token without a valid key: `out = 0`, `lse = +inf`. With
//! splits, each item stores its `O`, `m`, `l`, `l̃` to the workspace and the last of a
//! (token, group)'s items (an atomic count) merges them in split order, so a token's
//! result depends only on its own inputs (batch invariance).
//!
//! # Shared memory (bytes)
//!
//! | offset | size | contents |
//! |---|---|---|
//! | 0 | 16 · 1024 | key rows (bf16), chunk `c` of row `r` at `1024r + 16(c ^ swz(r))` |
//! | 16384 | 16 · 1024 | query rows, the same layout |
//! | 32768 | 4096 | partial scores `[warp][n-tile][lane]` × 4 f32 |
//! | 36864 | 16 | the split-completion flag |
//! | 36880 | 16 · 512 | block-scaled path only: key codes (`code_addr`) |
//! | 45072 | 16 · 8 | block-scaled path only: key scale bytes |
//! | 45200 | 16 · 28 | block-scaled path only: query scale bytes |
//!
//! `swz` makes the 16-byte score-operand loads (rows `8j + g`, chunks `4p + t`), the V
//! loads (rows `2t + e`, chunks `16w + 2g + h`) and the gather stores conflict-free.

mod block_scaled;
mod gather;

use crate::global::{GlobalMut, V4};
use crate::kernels::FULL;
use crate::launch::{Launch, MAX_GRID};
use crate::math::{exp2, fma, log2, LN_2, LOG2_E};
use crate::params::SparseMlaV4Params;
use crate::simt::Simt;

/// Heads per block (the mma M dimension).
pub const V4_HEADS: u32 = 16;
/// Warps per block.
const WARPS: u32 = 4;
/// Threads per block.
pub const THREADS: u32 = 32 * WARPS;
/// Keys per key block.
pub const BN: u32 = 16;
/// n-tiles (of 8 keys) per key block.
const NT: usize = (BN / 8) as usize;
/// Threads per key of a block (the gather).
const TPK: u32 = THREADS / BN;
/// Dims of q, K = V and out.
pub const D: u32 = 512;
/// Shared-memory bytes per key or query row.
const ROW: u32 = 2 * D;
const Q_OFF: u32 = BN * ROW;
const PART_OFF: u32 = Q_OFF + V4_HEADS * ROW;
const PART_BYTES: u32 = WARPS * NT as u32 * 32 * 16;
const FLAG_OFF: u32 = PART_OFF + PART_BYTES;
/// Bytes of a MODEL1 row's e4m3 codes (the NoPE dims) and its 64-dim tiles.
const NOPE: u32 = 448;
const NOPE_TILES: u32 = NOPE / 64;
/// The block-scaled path's areas (`block_scaled`): key codes `[16][512]` (448 bytes of
/// codes, then padding; see [`code_addr`]), key scale bytes `[16][8]`, query scale words
/// `[16][7]`.
const KC_OFF: u32 = FLAG_OFF + 16;
const KC_ROW: u32 = 512;
const KS_OFF: u32 = KC_OFF + BN * KC_ROW;
const QS_OFF: u32 = KS_OFF + BN * 8;
/// Dynamic shared memory per block.
pub const SMEM: u32 = QS_OFF + V4_HEADS * NOPE_TILES * 4;
/// The smallest split (positions of the main ‖ extra list), and the most splits.
const MIN_SPLIT: u32 = 96;
const MAX_SPLITS: u32 = 16;
/// Floats of a split record: `O` (`[warp][n-tile][lane][4]`: a warp's stores and loads of
/// one n-tile are 512 contiguous bytes), then per row `m, l, l̃, any`.
const REC_O: u32 = V4_HEADS * D;
const REC_FLOATS: u32 = REC_O + 4 * V4_HEADS;

/// Positions of the main ‖ extra list per split, for a list of `total` (`main.topk +
/// extra.topk`): `total` itself up to 96 (no split), else 96 or, past 16 splits,
/// `⌈total / 16⌉` rounded up to 32. A function of `total` only (batch invariance); at
/// DeepSeek-V4-Flash decode (128 + 512) it gives 7 splits, so batch 8 at 64 heads runs 224
/// blocks.
pub fn sparse_mla_v4_split(total: u32) -> u32 {
    if total <= MIN_SPLIT {
        total.max(1)
    } else {
        MIN_SPLIT.max(total.div_ceil(MAX_SPLITS).div_ceil(32) * 32)
    }
}

/// Bytes of the workspace (split records) and of the counters a launch needs (both 0
/// without split).
pub fn sparse_mla_v4_workspace(n_tokens: u32, n_heads: u32, total: u32) -> (u64, u64) {
    let splits = total.div_ceil(sparse_mla_v4_split(total)).max(1) as u64;
    if splits == 1 {
        return (0, 0);
    }
    let units = n_tokens as u64 * n_heads.div_ceil(V4_HEADS) as u64;
    (4 * units * splits * REC_FLOATS as u64, 4 * units)
}

/// Splits of a launch.
#[inline(always)]
fn splits(p: &SparseMlaV4Params) -> u32 {
    let total = p.main.topk + p.extra.topk;
    total.div_ceil(p.split.max(1)).max(1)
}

/// Launch geometry (see the module docs).
pub fn sparse_mla_v4_launch(p: &SparseMlaV4Params) -> Launch {
    let items = p.n_tokens as u64 * splits(p) as u64 * p.n_heads.div_ceil(V4_HEADS) as u64;
    Launch {
        grid: items.clamp(1, MAX_GRID as u64) as u32,
        block: THREADS,
        smem_bytes: SMEM,
    }
}

/// The chunk swizzle of row `r` (bits 0..3 of the 16-byte chunk index; see the module
/// docs).
#[inline(always)]
fn swz(r: u32) -> u32 {
    ((r >> 1) & 1) | (((r & 1) ^ ((r >> 2) & 1)) << 2)
}

/// Shared-memory byte offset of chunk `c` of key row `r` (add [`Q_OFF`] for query rows).
#[inline(always)]
fn chunk_addr(r: u32, c: u32) -> usize {
    (r * ROW + ((c ^ swz(r)) << 4)) as usize
}

/// Shared-memory byte offset of the 16-byte code unit `u` (< 32) of key `key` in the
/// block-scaled path's code area: unit `u ^ 4` on odd keys, so that the score loads (keys
/// `g`, units `4T + t`, eight lanes a phase) and the gather's stores hit distinct banks.
#[inline(always)]
fn code_addr(key: u32, u: u32) -> usize {
    (KC_OFF + KC_ROW * key + 16 * (u ^ ((key & 1) << 2))) as usize
}

/// A work item: token-major, then split, then head group.
#[derive(Clone, Copy)]
struct Item {
    token: u32,
    h0: u32,
    split: u32,
    /// (token, head group): the index of its counter and first record.
    unit: usize,
}

impl Item {
    #[inline(always)]
    fn of(p: &SparseMlaV4Params, item: u64) -> Self {
        let groups = p.n_heads.div_ceil(V4_HEADS) as u64;
        let per_token = splits(p) as u64 * groups;
        let token = (item / per_token) as u32;
        let rem = item % per_token;
        let group = (rem % groups) as u32;
        Item {
            token,
            h0: group * V4_HEADS,
            split: (rem / groups) as u32,
            unit: token as usize * groups as usize + group as usize,
        }
    }
}

/// The running softmax state of this lane's rows `g`, `g + 8` (the same in every warp).
#[derive(Clone, Copy)]
struct Softmax {
    m: [f32; 2],
    l: [f32; 2],
    lt: [f32; 2],
}

/// `x` rounded to bf16, nearest even (bits; NaN stays NaN).
#[inline(always)]
fn bf16_rne(x: f32) -> u32 {
    let b = x.to_bits();
    if x.is_nan() {
        (b >> 16) | 0x40
    } else {
        (b + 0x7fff + ((b >> 16) & 1)) >> 16
    }
}

/// Sparse MLA, DeepSeek-V4 form (algorithm, shared memory and geometry in the module
/// docs).
///
/// # Safety
/// Launch with [`sparse_mla_v4_launch`]; every pointer and size in `p` describes validated
/// buffers (see [`SparseMlaV4Params`]): `q` and `out` hold `n_tokens × n_heads × 512` bf16,
/// `lse` `n_tokens × n_heads` f32, `sink` `n_heads` f32 or null; for each cache with
/// `topk > 0`, `indices` holds `n_tokens × topk` entries of which each token's first
/// `lengths[t]` are `-1` or slots of the cache, the layout fields describe the cache
/// exactly (from a `model1_fp8` or `bf16_512` `KvLayout`, rows 4-byte aligned); when
/// split, `workspace` and `counters` hold [`sparse_mla_v4_workspace`] bytes and the
/// counters are zero.
#[inline(always)]
pub unsafe fn sparse_mla_v4<S: Simt>(p: SparseMlaV4Params) {
    let items = p.n_tokens as u64 * splits(&p) as u64 * p.n_heads.div_ceil(V4_HEADS) as u64;
    let mut item = S::block_idx() as u64;
    while item < items {
        // SAFETY: item < items.
        unsafe { attend::<S>(&p, Item::of(&p, item)) };
        item += S::grid_dim() as u64;
    }
}

/// One work item.
///
/// # Safety
/// As [`sparse_mla_v4`], `it` an item of the launch; every thread of the block calls it.
#[inline(always)]
unsafe fn attend<S: Simt>(p: &SparseMlaV4Params, it: Item) {
    let (warp, lane) = (S::warp_id(), S::lane_id());
    let (g, t) = (lane / 4, lane % 4);
    let tid = S::thread_idx();
    let (key, sub) = (tid / TPK, tid % TPK);
    let total = p.main.topk + p.extra.topk;
    let split = p.split.max(1);
    let begin = it.split * split;
    let end = (begin + split).min(total);
    let mxf8 = block_scaled::enabled::<S>(p);
    // The previous item's last reads of the Q area are behind its final barrier.
    // SAFETY: token < n_tokens.
    unsafe {
        if mxf8 {
            block_scaled::stage_q::<S>(p, it.token, it.h0);
        } else {
            gather::stage_q::<S>(p, it.token, it.h0, 0);
        }
    }
    // SAFETY: token < n_tokens; begin ≤ end ≤ total.
    let lens = unsafe { gather::Lens::load::<S>(p, it.token) };
    // SAFETY: as above.
    let mut scan = unsafe { gather::Scan::start::<S>(p, it.token, begin, end, lens) };
    let sl2 = p.softmax_scale * LOG2_E;
    let mut st = Softmax {
        m: [f32::NEG_INFINITY; 2],
        l: [0.0; 2],
        lt: [0.0; 2],
    };
    let mut o = [[0f32; 4]; 16];
    let mut any = false;
    loop {
        // SAFETY: token < n_tokens.
        let (k, n) = unsafe { scan.next_block::<S>(p, it.token, key) };
        if n == 0 {
            break;
        }
        any = true;
        // Everyone is done with the previous block's rows and partial scores.
        S::sync_threads();
        // SAFETY: k.slot is -1 or a validated slot; this thread's chunks only.
        unsafe { gather::gather_key::<S>(p, k, key, sub, mxf8) };
        S::sync_threads();
        // SAFETY: Q and key rows (and codes) stored before the barrier; this warp's
        // partial entries.
        unsafe {
            if mxf8 {
                block_scaled::scores::<S>(warp, lane, g, t);
            } else {
                scores::<S>(warp, lane, g, t);
            }
        }
        S::sync_threads();
        // SAFETY: the partial scores are complete.
        let x = unsafe { summed_scores::<S>(lane, t, n, sl2) };
        // SAFETY: the key rows are complete.
        unsafe { softmax_pv::<S>(warp, g, t, x, &mut st, &mut o) };
    }
    // Row sums over the 4 lanes of a group.
    for h in 0..2 {
        st.l[h] += S::shfl_xor_f32(FULL, st.l[h], 1);
        st.l[h] += S::shfl_xor_f32(FULL, st.l[h], 2);
        st.lt[h] += S::shfl_xor_f32(FULL, st.lt[h], 1);
        st.lt[h] += S::shfl_xor_f32(FULL, st.lt[h], 2);
    }
    if splits(p) == 1 {
        // SAFETY: this lane's rows and columns of the item.
        unsafe { write_out::<S>(p, it.token, it.h0, warp, g, t, &st, &o, any) };
    } else {
        let rec = p
            .workspace
            .add((it.unit * splits(p) as usize + it.split as usize) * REC_FLOATS as usize);
        // SAFETY: this item's record; this lane's part of it.
        unsafe { store_record::<S>(rec, warp, lane, g, t, &st, &o, any) };
        // SAFETY: every thread stored its part of the record.
        unsafe { finish_split::<S>(p, it, warp, lane, g, t) };
    }
    // The next item restages Q and the key rows after everyone's last reads.
    S::sync_threads();
}

/// Warp `warp`'s partial scores of the block (dims `128·warp ..+128`, the 4 n-tiles) into
/// the partial area.
///
/// # Safety
/// Q and key rows staged; only this warp writes its partial entries.
#[inline(always)]
unsafe fn scores<S: Simt>(warp: u32, lane: u32, g: u32, t: u32) {
    let mut acc = [[0f32; 4]; NT];
    unroll!(4, pp, {
        // SAFETY: Q and key rows staged.
        unsafe { pair_bf16::<S>(4 * warp + pp as u32, g, t, &mut acc) };
    });
    // SAFETY: this warp's partial entries.
    unsafe { store_partial::<S>(warp, lane, &acc) };
}

/// Adds the k-steps `2·pair`, `2·pair + 1` (dims `16·pair .. +16`, chunks `4·pair + t`
/// per lane) of both n-tiles to `acc`, on the bf16 mma.
///
/// # Safety
/// The pair's chunks of the Q area and of the key rows are staged.
#[inline(always)]
unsafe fn pair_bf16<S: Simt>(pair: u32, g: u32, t: u32, acc: &mut [[f32; 4]; NT]) {
    let c = 4 * pair + t;
    // SAFETY: query rows g, g + 8 < 16, chunk c < 64.
    let (qa, qb) = unsafe {
        (
            S::smem_load::<V4>(Q_OFF as usize + chunk_addr(g, c)).0,
            S::smem_load::<V4>(Q_OFF as usize + chunk_addr(g + 8, c)).0,
        )
    };
    // k-step 2·pair: dims 0..4 of the chunk; 2·pair + 1: dims 4..8.
    let a0 = [qa[0], qb[0], qa[1], qb[1]];
    let a1 = [qa[2], qb[2], qa[3], qb[3]];
    unroll!(2, j, {
        // SAFETY: key row 8j + g < 16, chunk c < 64.
        let kb = unsafe { S::smem_load::<V4>(chunk_addr(8 * j as u32 + g, c)).0 };
        acc[j] = S::mma_bf16_m16n8k16(a0, [kb[0], kb[1]], acc[j]);
        acc[j] = S::mma_bf16_m16n8k16(a1, [kb[2], kb[3]], acc[j]);
    });
}

/// Stores warp `warp`'s partial scores (this lane's fragments of the 2 n-tiles).
///
/// # Safety
/// Only this warp writes its partial entries, and no one reads them until the next barrier.
#[inline(always)]
unsafe fn store_partial<S: Simt>(warp: u32, lane: u32, acc: &[[f32; 4]; NT]) {
    unroll!(2, j, {
        let at = PART_OFF as usize + (((warp * NT as u32 + j as u32) * 32 + lane) * 16) as usize;
        // SAFETY: this lane's entry of this warp's partial area.
        unsafe { S::smem_store(at, V4(acc[j].map(f32::to_bits))) };
    });
}

/// The block's scores of this lane (n-tile `j`: rows `g`, `g + 8` × keys `8j + 2t + e`),
/// the 4 warps' partials summed in order, scaled to base 2, keys past `n` masked.
///
/// # Safety
/// The partial area is complete.
#[inline(always)]
unsafe fn summed_scores<S: Simt>(lane: u32, t: u32, n: u32, sl2: f32) -> [[f32; 4]; NT] {
    let mut x = [[0f32; 4]; NT];
    unroll!(2, j, {
        unroll!(4, w, {
            let at =
                PART_OFF as usize + (((w as u32 * NT as u32 + j as u32) * 32 + lane) * 16) as usize;
            // SAFETY: inside the partial area, stored before the barrier.
            let v = unsafe { S::smem_load::<V4>(at) }.0;
            unroll!(4, i, {
                let f = f32::from_bits(v[i]);
                x[j][i] = if w == 0 { f } else { x[j][i] + f };
            });
        });
        unroll!(4, i, {
            let k = 8 * j as u32 + 2 * t + (i as u32 & 1);
            x[j][i] = if k < n {
                x[j][i] * sl2
            } else {
                f32::NEG_INFINITY
            };
        });
    });
    x
}

/// The softmax update of one block and `O += P·V` for this warp's columns.
///
/// # Safety
/// The key rows of the block are staged.
#[inline(always)]
unsafe fn softmax_pv<S: Simt>(
    warp: u32,
    g: u32,
    t: u32,
    x: [[f32; 4]; NT],
    st: &mut Softmax,
    o: &mut [[f32; 4]; 16],
) {
    let mut corr = [0f32; 2];
    let mut mu = [0f32; 2];
    unroll!(2, h, {
        let mut mx = f32::NEG_INFINITY;
        unroll!(2, j, {
            mx = mx.max(x[j][2 * h]).max(x[j][2 * h + 1]);
        });
        mx = mx.max(S::shfl_xor_f32(FULL, mx, 1));
        mx = mx.max(S::shfl_xor_f32(FULL, mx, 2));
        let m_new = st.m[h].max(mx);
        // An all-masked row keeps a finite reference (every exp2 below is then 0).
        mu[h] = if m_new == f32::NEG_INFINITY {
            0.0
        } else {
            m_new
        };
        corr[h] = exp2(st.m[h] - mu[h]);
        st.m[h] = m_new;
    });
    // Probabilities rounded to bf16 (the A operand), both row sums (lane partials).
    let mut pb = [[0u32; 4]; NT];
    let mut sum = [0f32; 2];
    let mut sumt = [0f32; 2];
    unroll!(2, j, {
        unroll!(4, i, {
            let e = exp2(x[j][i] - mu[i / 2]);
            let b = bf16_rne(e);
            pb[j][i] = b;
            sum[i / 2] += e;
            sumt[i / 2] += f32::from_bits(b << 16);
        });
    });
    unroll!(2, h, {
        st.l[h] = fma(st.l[h], corr[h], sum[h]);
        st.lt[h] = fma(st.lt[h], corr[h], sumt[h]);
    });
    unroll!(16, j, {
        o[j][0] *= corr[0];
        o[j][1] *= corr[0];
        o[j][2] *= corr[1];
        o[j][3] *= corr[1];
    });
    // One k-step of 16 keys: n-tiles 0 (a0..a3) and 1 (a4..a7).
    {
        let kk = 0;
        let (lo, hi) = (pb[2 * kk], pb[2 * kk + 1]);
        let a = [
            lo[0] | lo[1] << 16,
            lo[2] | lo[3] << 16,
            hi[0] | hi[1] << 16,
            hi[2] | hi[3] << 16,
        ];
        // V rows 16kk + 2t (+1, +8, +9), this lane's two chunks 16w + 2g, + 1.
        let r0 = 16 * kk as u32 + 2 * t;
        let c0 = 16 * warp + 2 * g;
        let row = |r: u32| {
            // SAFETY: rows < 16, chunks < 64: the key area.
            unsafe {
                let x = S::smem_load::<V4>(chunk_addr(r, c0)).0;
                let y = S::smem_load::<V4>(chunk_addr(r, c0 + 1)).0;
                [x[0], x[1], x[2], x[3], y[0], y[1], y[2], y[3]]
            }
        };
        let (v0, v1, v2, v3) = (row(r0), row(r0 + 1), row(r0 + 8), row(r0 + 9));
        // Column j of a row: half j % 2 of word j / 2.
        let pair = |a: [u32; 8], b: [u32; 8], j: usize| {
            let (wa, wb) = (a[j / 2], b[j / 2]);
            if j % 2 == 0 {
                (wa & 0xffff) | (wb << 16)
            } else {
                (wa >> 16) | (wb & 0xffff_0000)
            }
        };
        unroll!(16, j, {
            let b = [pair(v0, v1, j), pair(v2, v3, j)];
            o[j] = S::mma_bf16_m16n8k16(a, b, o[j]);
        });
    }
}

/// Writes this lane's outputs: rows `h0 + g`, `h0 + g + 8`, columns `128w + 32t ..+32`.
///
/// # Safety
/// The item's token and heads; nobody else writes these elements.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn write_out<S: Simt>(
    p: &SparseMlaV4Params,
    token: u32,
    h0: u32,
    warp: u32,
    g: u32,
    t: u32,
    st: &Softmax,
    o: &[[f32; 4]; 16],
    any: bool,
) {
    unroll!(2, r, {
        let h = h0 + g + 8 * r as u32;
        if h < p.n_heads {
            let (lse, factor) = if any {
                let sink = if p.sink.is_null() {
                    None
                } else {
                    // SAFETY: h < n_heads.
                    Some(unsafe { S::gld(p.sink.add(h as usize)) })
                };
                row_lse(st.m[r], st.l[r], sink)
            } else {
                (f32::INFINITY, 0.0)
            };
            let scale = if any { factor / st.lt[r] } else { 0.0 };
            let base = p
                .out
                .add((token as usize * p.n_heads as usize + h as usize) * D as usize)
                .add((128 * warp + 32 * t) as usize);
            // Columns 32t + j (element 2r of n-tile j) and 32t + 16 + j (element 2r + 1).
            unroll!(4, q, {
                let mut w = [0u32; 4];
                unroll!(4, i, {
                    let c = 8 * q + 2 * i;
                    let val = |c: usize| {
                        let (j, e) = (c % 16, c / 16);
                        let v = o[j][2 * r + e] * scale;
                        crate::fp8::f32_to_bf16(v) as u32
                    };
                    w[i] = val(c) | val(c + 1) << 16;
                });
                // SAFETY: 8 bf16 of this row at column 128w + 32t + 8q (16-byte aligned
                // when `out` is; 4-byte stores otherwise).
                unsafe { store16::<S>(base.add(8 * q).cast::<u32>(), w) };
            });
            if warp == 0 && t == 0 {
                // SAFETY: token < n_tokens, h < n_heads.
                unsafe {
                    S::gst(
                        p.lse.add(token as usize * p.n_heads as usize + h as usize),
                        lse,
                    )
                };
            }
        }
    });
}

/// `lse = ln 2 · (m + log2 l)` (natural log, without the sink) and the output factor
/// `1 / (1 + exp(sink − lse))` (1 without a sink).
#[inline(always)]
fn row_lse(m: f32, l: f32, sink: Option<f32>) -> (f32, f32) {
    let lse = LN_2 * (m + log2(l));
    let factor = match sink {
        Some(s) => 1.0 / (1.0 + exp2((s - lse) * LOG2_E)),
        None => 1.0,
    };
    (lse, factor)
}

/// Four words at `at` (one 16-byte store when aligned, else four 4-byte stores).
///
/// # Safety
/// 16 writable bytes, 4-byte aligned.
#[inline(always)]
unsafe fn store16<S: Simt>(at: GlobalMut<u32>, w: [u32; 4]) {
    if at.addr() % 16 == 0 {
        // SAFETY: caller's contract, aligned.
        unsafe { S::gst(at.cast::<V4>(), V4(w)) };
    } else {
        unroll!(4, i, {
            // SAFETY: caller's contract.
            unsafe { S::gst(at.add(i), w[i]) };
        });
    }
}

/// Stores this lane's part of a split record: its 64 accumulators (`[warp][j][lane][4]`)
/// and, from warp 0's lanes `t = 0`, the statistics of rows `g`, `g + 8` (`m`, `l`, `l̃`,
/// and 1 when the split had a valid key).
///
/// # Safety
/// `rec` is this item's record ([`REC_FLOATS`] floats, 16-byte aligned).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn store_record<S: Simt>(
    rec: GlobalMut<f32>,
    warp: u32,
    lane: u32,
    g: u32,
    t: u32,
    st: &Softmax,
    o: &[[f32; 4]; 16],
    any: bool,
) {
    unroll!(16, j, {
        let at = rec.add((((warp * 16 + j as u32) * 32 + lane) * 4) as usize);
        // SAFETY: this lane's 4 floats of n-tile j.
        unsafe { S::gst(at.cast::<V4>(), V4(o[j].map(f32::to_bits))) };
    });
    if warp == 0 && t == 0 {
        unroll!(2, r, {
            let row = g + 8 * r as u32;
            let at = rec.add((REC_O + 4 * row) as usize);
            let v = [st.m[r], st.l[r], st.lt[r], any as u32 as f32];
            // SAFETY: the row's statistics.
            unsafe { S::gst(at.cast::<V4>(), V4(v.map(f32::to_bits))) };
        });
    }
}

/// Counts this split as finished; the last one merges the (token, group)'s records in
/// split order and writes the outputs.
///
/// # Safety
/// Every thread calls it after storing its part of this item's record.
#[inline(always)]
unsafe fn finish_split<S: Simt>(
    p: &SparseMlaV4Params,
    it: Item,
    warp: u32,
    lane: u32,
    g: u32,
    t: u32,
) {
    let ns = splits(p);
    S::threadfence();
    S::sync_threads();
    if S::thread_idx() == 0 {
        let counter = p.counters.add(it.unit);
        // SAFETY: this unit's counter, only accessed atomically during the launch.
        let done = unsafe { S::atomic_add_u32(counter, 1) } + 1;
        let last = done == ns;
        if last {
            // SAFETY: as above (back to zero for the next launch).
            unsafe { S::atomic_add_u32(counter, 0u32.wrapping_sub(ns)) };
        }
        // SAFETY: the flag word, read by everyone after the barrier.
        unsafe { S::smem_store::<u32>(FLAG_OFF as usize, last as u32) };
    }
    S::sync_threads();
    // SAFETY: stored before the barrier.
    let last = unsafe { S::smem_load::<u32>(FLAG_OFF as usize) } != 0;
    if !last {
        return;
    }
    S::threadfence();
    let recs = p
        .workspace
        .add(it.unit * ns as usize * REC_FLOATS as usize)
        .as_const();
    let stat = |s: u32, row: u32, k: u32| {
        // SAFETY: split s's record of this unit, written before its count.
        unsafe { S::gld(recs.add((s * REC_FLOATS + REC_O + 4 * row + k) as usize)) }
    };
    // Merged statistics of rows g, g + 8 (fixed split order).
    let mut st = Softmax {
        m: [f32::NEG_INFINITY; 2],
        l: [0.0; 2],
        lt: [0.0; 2],
    };
    let rows = [g, g + 8];
    let mut any = false;
    let mut s = 0;
    while s < ns {
        unroll!(2, r, {
            st.m[r] = st.m[r].max(stat(s, rows[r], 0));
        });
        any |= stat(s, 0, 3) != 0.0;
        s += 1;
    }
    let mu = st.m.map(|m| if m == f32::NEG_INFINITY { 0.0 } else { m });
    let mut o = [[0f32; 4]; 16];
    let mut s = 0;
    while s < ns {
        let w = [
            exp2(stat(s, rows[0], 0) - mu[0]),
            exp2(stat(s, rows[1], 0) - mu[1]),
        ];
        unroll!(2, r, {
            st.l[r] = fma(stat(s, rows[r], 1), w[r], st.l[r]);
            st.lt[r] = fma(stat(s, rows[r], 2), w[r], st.lt[r]);
        });
        let rec = recs.add((s * REC_FLOATS) as usize);
        unroll!(16, j, {
            let at = rec.add((((warp * 16 + j as u32) * 32 + lane) * 4) as usize);
            // SAFETY: split s's accumulators of this lane, n-tile j.
            let v = unsafe { S::gld(at.cast::<V4>()) }.0;
            o[j][0] = fma(f32::from_bits(v[0]), w[0], o[j][0]);
            o[j][1] = fma(f32::from_bits(v[1]), w[0], o[j][1]);
            o[j][2] = fma(f32::from_bits(v[2]), w[1], o[j][2]);
            o[j][3] = fma(f32::from_bits(v[3]), w[1], o[j][3]);
        });
        s += 1;
    }
    // SAFETY: this lane's rows and columns of the item.
    unsafe { write_out::<S>(p, it.token, it.h0, warp, g, t, &st, &o, any) };
}
