//! `indexer_logits` on the GPU, on tensor cores (`mma.sync` bf16 m16n8k16).
//!
//! A block of 4 warps computes [`KEYS_PER_BLOCK`] consecutive columns of one row; the grid
//! strides over `n_rows × ceil(row_stride / KEYS_PER_BLOCK)` (row, chunk) pairs.
//!
//! Per (row, chunk):
//! 1. The row's queries (`n_heads × head_dim` bf16, heads padded with zeros to a multiple
//!    of 16, dims to the kernel's k-steps) and weights (zero for padded heads) are staged in
//!    dynamic shared memory, 16 bytes per load and store.
//! 2. Columns of the chunk outside the row's `[start, end)` are written `-inf`.
//! 3. Each warp takes pairs of 8-key tiles of the chunk's in-range columns (16 keys; pair
//!    `i` goes to warp `i % 4`). Lane `(g, t)` (g = lane / 4, t = lane % 4) loads, for key
//!    `g` of each tile, the 16-byte pieces `64·i + 16·t` of the key's value row (`i` =
//!    0, 1, ...): the four lanes of a key read 64 contiguous bytes, so every 32-byte sector
//!    a warp touches is used whole. A piece holds the B fragments of `G` consecutive
//!    k-steps (G = 2 for bf16 keys, 4 for fp8, 8 for fp4: 8 bf16, 16 e4m3 codes or 32
//!    e2m1 codes, the codes widened exactly to bf16 — fp4 codes times their group's ue8m0
//!    scale, one group per piece, its byte from one aligned word of the token's scales),
//!    which fixes a permutation of the dims inside each group of `G` k-steps; the queries are read with the same permutation, so every dot product is
//!    unchanged. For each 16-head m-tile the warp runs `head_dim / 16` k-steps of two mma
//!    (one per tile, sharing the A fragment: two 8-byte shared loads), then folds
//!    `w_h · ReLU(c)` of its two heads into per-lane partial sums for keys `2t, 2t + 1`.
//!    A butterfly over `g` finishes the head sum; lanes `0..8` each take one key's logit
//!    (a shuffle), multiply by its fp8 scale (one 32-byte load for the 8 keys) and store
//!    it (one 32-byte store for the 8 keys).
//!
//! Every logit of a row is computed by the same operations in the same order whatever the
//! other rows (batch invariance). Keys outside the row's range are never read (their pages
//! may be unmapped).
//!
//! Shared memory (bytes): `Q[hp][dims]` bf16 (`dims` = 16 · k-steps), the 8-byte unit
//! `u` (dims `4u..4u + 4`) of head row `h` at `h·2·dims + 8·(u ^ swz(h))`, then `w[hp]`
//! f32; `hp` = heads rounded up to 16. The swizzle `swz` (a permutation of 8-byte units
//! inside 128-byte groups, per layout) makes the A-fragment loads of a half-warp hit 32
//! distinct banks.

use crate::fp8::e4m3x4_to_bf16;
use crate::global::{GlobalMut, GlobalPtr, V2, V4};
use crate::launch::{Launch, MAX_GRID};
use crate::math::fma;
use crate::mx::{e2m1x4_to_bf16, ue8m0_to_f32};
use crate::params::{index_k_format, IndexerLogitsFp4Params, IndexerLogitsParams, QueryRange};
use crate::simt::Simt;

/// Columns per (row, chunk) work item.
pub const KEYS_PER_BLOCK: u32 = 256;
/// Warps per block.
const WARPS: u32 = 4;
/// Largest head_dim whose B fragments fit the per-thread register budget.
pub const MAX_HEAD_DIM: u32 = 256;
/// Keys a warp takes at once (two 8-key n-tiles sharing the A fragments).
const KEYS_PER_PAIR: u32 = 16;

/// Heads rounded up to whole 16-row m-tiles.
fn padded_heads(p: &IndexerLogitsParams) -> u32 {
    p.n_heads.div_ceil(16) * 16
}

/// k-steps of 16 the kernel runs: 4 for head dims up to 64 (8 for fp4, whose pieces hold
/// 8 k-steps), 8 up to 128, 16 up to 256 (the queries are zero-padded, keys read as zeros
/// past `head_dim`).
fn k_steps(p: &IndexerLogitsParams) -> u32 {
    match p.head_dim.div_ceil(16) {
        0..=4 if p.format != index_k_format::FP4_E2M1 => 4,
        0..=8 => 8,
        _ => MAX_HEAD_DIM / 16,
    }
}

/// Bytes per staged (zero-padded) query row.
fn q_row_bytes(p: &IndexerLogitsParams) -> u32 {
    2 * 16 * k_steps(p)
}

/// Launch geometry: 4 warps, one work item per block up to [`MAX_GRID`] blocks, the
/// queries and weights of one row in shared memory.
pub fn indexer_logits_launch(p: &IndexerLogitsParams) -> Launch {
    let items = p.n_rows as u64 * p.row_stride.div_ceil(KEYS_PER_BLOCK) as u64;
    let hp = padded_heads(p);
    Launch {
        grid: items.clamp(1, MAX_GRID as u64) as u32,
        block: 32 * WARPS,
        smem_bytes: hp * q_row_bytes(p) + 4 * hp,
    }
}

/// k-steps per 16-byte piece of a key: 2 (bf16), 4 (fp8) or 8 (fp4).
#[inline(always)]
fn group(p: &IndexerLogitsParams) -> usize {
    match p.format {
        index_k_format::BF16 => 2,
        index_k_format::FP4_E2M1 => 8,
        _ => 4,
    }
}

/// The 8-byte unit swizzle of unit `unit` of staged query row `h`: an XOR on the unit
/// index so that the A-fragment loads of a half-warp (rows `g` = 0..4, lanes `t` = 0..4)
/// cover 16 distinct 8-byte bank pairs. bf16 (lane `t` reads unit `2t + e`): rows differ in
/// unit bits 0 and 3; fp8 (unit `4t + e`): in bits 0 and 1; fp4 (unit `8t + e`, lanes `t`
/// and `t + 2` 128 bytes apart): bits 0 and 1 by row, bit 2 by the unit's bit 4. The mask
/// never touches bits above 3, nor differs inside a 16-byte pair of units but in bit 0.
#[inline(always)]
fn swz(p: &IndexerLogitsParams, h: u32, unit: usize) -> usize {
    match group(p) {
        2 => swz_g::<2>(h, unit),
        8 => swz_g::<8>(h, unit),
        _ => swz_g::<4>(h, unit),
    }
}

/// [`swz`] for the piece group `G` (a constant in the hot loop).
#[inline(always)]
fn swz_g<const G: usize>(h: u32, unit: usize) -> usize {
    let h = h as usize;
    match G {
        2 => (h & 1) | ((h & 2) << 2),
        8 => (h & 3) | ((unit >> 2) & 4),
        _ => h & 3,
    }
}

/// Indexer logits over fp8 or bf16 keys.
///
/// # Safety
/// Launch with [`indexer_logits_launch`]; every pointer and size in `p` describes validated
/// buffers (see [`IndexerLogitsParams`]): rows within `row_stride`, every position of every
/// row's range mapped by the page table to a page of `cache`; `head_dim` a multiple of 16
/// and at most [`MAX_HEAD_DIM`]; `q`, `weights` and the page rows 4-byte aligned.
/// `format` fp8 or bf16.
#[inline(always)]
pub unsafe fn indexer_logits<S: Simt>(p: IndexerLogitsParams) {
    // SAFETY: forwarded.
    unsafe { indexer_logits_body::<S, false>(p) }
}

/// Indexer logits over fp4 keys (`format` = fp4; see [`IndexerLogitsFp4Params`]).
///
/// # Safety
/// As [`indexer_logits`], `format` fp4.
#[inline(always)]
pub unsafe fn indexer_logits_fp4<S: Simt>(p: IndexerLogitsFp4Params) {
    // SAFETY: forwarded.
    unsafe { indexer_logits_body::<S, true>(p.0) }
}

/// Indexer logits (`FP4`: the fp4 instantiations only, else the fp8 and bf16 ones).
///
/// # Safety
/// As [`indexer_logits`] (any `format` of the instantiation).
#[inline(always)]
unsafe fn indexer_logits_body<S: Simt, const FP4: bool>(p: IndexerLogitsParams) {
    let chunks = p.row_stride.div_ceil(KEYS_PER_BLOCK) as u64;
    let items = p.n_rows as u64 * chunks;
    let hp = padded_heads(&p);
    let qrow = q_row_bytes(&p) as usize;
    let w_base = hp as usize * qrow;
    let tid = S::thread_idx();
    let nthreads = S::block_dim();
    let mut item = S::block_idx() as u64;
    while item < items {
        let r = (item / chunks) as u32;
        let c0 = (item % chunks) as u32 * KEYS_PER_BLOCK;
        let c1 = (c0 + KEYS_PER_BLOCK).min(p.row_stride);
        // SAFETY: r < n_rows and `rows` holds n_rows ranges.
        let QueryRange {
            request: req,
            start,
            end,
        } = unsafe { QueryRange::load::<S>(p.rows, r) };
        // 1. Stage the row's queries and weights.
        // SAFETY: r < n_rows; the launch provides the shared memory; nobody reads the Q
        // and weights areas until the barrier below, nor since the previous item's last.
        unsafe { stage_row::<S>(&p, r, qrow, w_base) };
        S::sync_threads();
        // 2. Columns outside the row's range.
        let out_row = p.out.add(r as usize * p.row_stride as usize);
        let mut c = c0 + tid;
        while c < c1 {
            if c < start || c >= end {
                // SAFETY: c < row_stride.
                unsafe { S::gst(out_row.add(c as usize), f32::NEG_INFINITY) };
            }
            c += nthreads;
        }
        // 3. In-range columns, pairs of 8-key tiles per warp.
        let (lo, hi) = (c0.max(start), c1.min(end));
        if lo < hi {
            let mut pair = S::warp_id();
            while lo + KEYS_PER_PAIR * pair < hi {
                let args = TileArgs {
                    req,
                    p0: lo + KEYS_PER_PAIR * pair,
                    hi,
                    out_row,
                    hp,
                    qrow,
                    w_base,
                };
                // SAFETY: forwarded contract; the pair starts inside [lo, hi). The k-step
                // count and the piece group are constants, so the keys' fragments stay in
                // registers.
                unsafe {
                    if FP4 {
                        match k_steps(&p) {
                            8 => key_pair::<S, 8, 8, true>(&p, args),
                            _ => key_pair::<S, 16, 8, false>(&p, args),
                        }
                    } else {
                        match (k_steps(&p), group(&p)) {
                            (4, 2) => key_pair::<S, 4, 2, true>(&p, args),
                            (8, 2) => key_pair::<S, 8, 2, true>(&p, args),
                            (_, 2) => key_pair::<S, 16, 2, false>(&p, args),
                            (4, _) => key_pair::<S, 4, 4, true>(&p, args),
                            (8, _) => key_pair::<S, 8, 4, true>(&p, args),
                            _ => key_pair::<S, 16, 4, false>(&p, args),
                        }
                    }
                }
                pair += WARPS;
            }
        }
        // The next item restages shared memory.
        S::sync_threads();
        item += S::grid_dim() as u64;
    }
}

/// Stages row `r`'s queries (zero-padded to `hp` heads and `qrow / 2` dims, swizzled) and
/// weights (zero for padded heads).
///
/// # Safety
/// `r < n_rows`; the caller owns the Q and weights areas until its next barrier.
#[inline(always)]
unsafe fn stage_row<S: Simt>(p: &IndexerLogitsParams, r: u32, qrow: usize, w_base: usize) {
    let hp = padded_heads(p);
    let (tid, nthreads) = (S::thread_idx(), S::block_dim());
    // Offsets in 64 bits: n_rows · n_heads · head_dim may pass 2^32.
    let q_row =
        p.q.add(r as usize * p.n_heads as usize * p.head_dim as usize);
    let w_row = p.weights.add(r as usize * p.n_heads as usize);
    // 16-byte chunks (8 dims) of every padded row; the row is 16-byte aligned when `q` is
    // (head_dim is a multiple of 16).
    let aligned = p.q.addr() % 16 == 0;
    let row_chunks = (qrow / 16) as u32;
    let mut i = tid;
    while i < hp * row_chunks {
        let (h, c) = (i / row_chunks, i % row_chunks);
        let v = if h < p.n_heads && 8 * c < p.head_dim {
            let at = q_row.add(h as usize * p.head_dim as usize + 8 * c as usize);
            if aligned {
                // SAFETY: 8 bf16 of head h (h < n_heads, 8c + 8 ≤ head_dim), 16-byte aligned.
                unsafe { S::gld(at.cast::<V4>()).0 }
            } else {
                let w = at.cast::<u32>();
                // SAFETY: as above, 4-byte aligned (contract).
                unsafe {
                    [
                        S::gld(w),
                        S::gld(w.add(1)),
                        S::gld(w.add(2)),
                        S::gld(w.add(3)),
                    ]
                }
            }
        } else {
            [0; 4]
        };
        // Units 2c and 2c + 1 land at (2c ^ s) and (2c + 1 ^ s): the same 16 bytes, halves
        // swapped when s is odd.
        let s = swz(p, h, 2 * c as usize);
        let v = if s & 1 == 1 {
            [v[2], v[3], v[0], v[1]]
        } else {
            v
        };
        let at = h as usize * qrow + 8 * ((2 * c as usize) ^ (s & !1));
        // SAFETY: h < hp, 16c + 16 ≤ qrow: inside the Q area, 16-byte aligned; one owner.
        unsafe { S::smem_store(at, V4(v)) };
        i += nthreads;
    }
    let mut h = tid;
    while h < hp {
        let w = if h < p.n_heads {
            // SAFETY: r < n_rows, h < n_heads.
            unsafe { S::gld(w_row.add(h as usize)) }
        } else {
            0.0
        };
        // SAFETY: h < hp: inside the weights section.
        unsafe { S::smem_store::<f32>(w_base + 4 * h as usize, w) };
        h += nthreads;
    }
}

/// Byte address of the values of position `pos` of request `req`, and its page base.
///
/// # Safety
/// `pos` is inside a validated row range of `req`.
#[inline(always)]
unsafe fn key_address<S: Simt>(
    p: &IndexerLogitsParams,
    req: u32,
    pos: u32,
) -> (GlobalPtr<u8>, GlobalPtr<u8>, u32) {
    // SAFETY: the page-table entry of a position inside a validated range exists.
    let page = unsafe {
        S::gld(
            p.page_table
                .add(req as usize * p.max_pages as usize + (pos / p.page_size) as usize),
        )
    };
    let off = pos % p.page_size;
    let page_ptr = p.cache.byte_add(page as usize * p.page_bytes as usize);
    (
        page_ptr.byte_add((off * p.value_bytes) as usize),
        page_ptr,
        off,
    )
}

/// Where a warp's pair of 8-key tiles is.
#[derive(Clone, Copy)]
struct TileArgs {
    req: u32,
    /// First position of the pair.
    p0: u32,
    /// End of the in-range columns of the chunk.
    hi: u32,
    out_row: GlobalMut<f32>,
    hp: u32,
    qrow: usize,
    w_base: usize,
}

/// Piece `i` (16 bytes at byte `64·i + 16·t` of the key's value row) of a key whose values
/// start at `vals`: zeros past the value bytes or for `None` (a position past the tile's
/// end).
///
/// # Safety
/// `vals` points at a valid token's value bytes, 4-byte aligned.
#[inline(always)]
unsafe fn piece<S: Simt>(
    p: &IndexerLogitsParams,
    vals: Option<GlobalPtr<u8>>,
    i: usize,
    t: u32,
) -> [u32; 4] {
    let Some(vals) = vals else {
        return [0; 4];
    };
    let off = 64 * i + 16 * t as usize;
    if off >= p.value_bytes as usize {
        return [0; 4];
    }
    let at = vals.byte_add(off);
    if at.addr() % 16 == 0 {
        // SAFETY: 16 bytes inside the token's values (value bytes are a multiple of 16).
        unsafe { S::gld(at.cast::<V4>()).0 }
    } else {
        let w = at.cast::<u32>();
        // SAFETY: as above, 4-byte aligned (pages of odd sizes).
        unsafe {
            [
                S::gld(w),
                S::gld(w.add(1)),
                S::gld(w.add(2)),
                S::gld(w.add(3)),
            ]
        }
    }
}

/// The B fragment of the k-step at offset `e` (< G) inside a piece: two bf16 pairs
/// (G = 2), four e4m3 codes widened to bf16 (G = 4), or four e2m1 codes times the piece's
/// group scale `scale` (G = 8).
#[inline(always)]
fn b_of_piece<const G: usize>(v: [u32; 4], e: usize, scale: f32) -> [u32; 2] {
    if G == 2 {
        [v[2 * e], v[2 * e + 1]]
    } else if G == 4 {
        e4m3x4_to_bf16(v[e])
    } else {
        e2m1x4_to_bf16(v[e / 2] >> (16 * (e % 2)), scale)
    }
}

/// The ue8m0 scale of piece `i` of lane column `t` of an fp4 key (group `4i + t`; 1.0 for
/// other formats, `None`, or a piece past the values): one aligned 4-byte (or, for
/// head_dim 64 · odd, 2-byte) load of the token's scale bytes.
///
/// # Safety
/// `key` is `(page base, offset)` of a valid token (or None).
#[inline(always)]
unsafe fn fp4_scale<S: Simt>(
    p: &IndexerLogitsParams,
    key: Option<(GlobalPtr<u8>, u32)>,
    i: usize,
    t: u32,
) -> f32 {
    let Some((page, off)) = key else {
        return 1.0;
    };
    let grp = 4 * i as u32 + t;
    if p.format != index_k_format::FP4_E2M1 || grp >= p.scale_bytes {
        return 1.0;
    }
    let base = page.byte_add((p.scale_offset + off * p.scale_bytes) as usize);
    let byte = if p.scale_bytes % 4 == 0 {
        // SAFETY: the aligned word holding byte `grp` of the token's scales (scale_offset
        // and scale_bytes multiples of 4).
        let w = unsafe { S::gld(base.byte_add((grp & !3) as usize).cast::<u32>()) };
        w >> (8 * (grp & 3))
    } else {
        // SAFETY: as above, 2-byte aligned (scale_bytes even).
        let w = unsafe { S::gld(base.byte_add((grp & !1) as usize).cast::<u16>()) } as u32;
        w >> (8 * (grp & 1))
    };
    ue8m0_to_f32(byte as u8)
}

/// The B fragment of k-step `ks` for lane column `t` of a key whose values start at `vals`
/// (`key`: its page base and offset, for fp4 scales).
///
/// # Safety
/// As [`piece`] and [`fp4_scale`].
#[inline(always)]
unsafe fn b_frag<S: Simt, const G: usize>(
    p: &IndexerLogitsParams,
    vals: Option<GlobalPtr<u8>>,
    key: Option<(GlobalPtr<u8>, u32)>,
    ks: usize,
    t: u32,
) -> [u32; 2] {
    // SAFETY: forwarded.
    let v = unsafe { piece::<S>(p, vals, ks / G, t) };
    let s = if G == 8 {
        // SAFETY: forwarded.
        unsafe { fp4_scale::<S>(p, key, ks / G, t) }
    } else {
        1.0
    };
    b_of_piece::<G>(v, ks % G, s)
}

/// The A fragment of m-tile `mt`, k-step `ks` from the staged queries: dims of lane `t`
/// under the pieces' permutation (unit `16·G/4·(ks / G) + G·t + ks % G`), two 8-byte loads.
///
/// # Safety
/// The queries are staged with rows of `qrow` bytes covering `ks`; `mt < hp / 16`.
#[inline(always)]
unsafe fn a_frag<S: Simt, const G: usize>(
    qrow: usize,
    mt: u32,
    ks: usize,
    g: u32,
    t: u32,
) -> [u32; 4] {
    let unit = 4 * G * (ks / G) + G * t as usize + ks % G;
    let (h0, h1) = (mt * 16 + g, mt * 16 + g + 8);
    let at = |h: u32| h as usize * qrow + 8 * (unit ^ swz_g::<G>(h, unit));
    // SAFETY: rows < hp and units inside the staged row (caller's contract).
    let (lo, hi) = unsafe { (S::smem_load::<V2>(at(h0)).0, S::smem_load::<V2>(at(h1)).0) };
    [lo[0], hi[0], lo[1], hi[1]]
}

/// Folds one m-tile's scores into the lane's partial head sums for keys `2t`, `2t + 1`.
///
/// # Safety
/// The weights are staged at `w_base`; `mt < hp / 16`.
#[inline(always)]
unsafe fn fold_heads<S: Simt>(w_base: usize, mt: u32, g: u32, acc: [f32; 4], part: &mut [f32; 2]) {
    // SAFETY: heads mt*16 + g and + 8 are < hp: inside the weights section.
    let (w0, w1) = unsafe {
        (
            S::smem_load::<f32>(w_base + 4 * (mt * 16 + g) as usize),
            S::smem_load::<f32>(w_base + 4 * (mt * 16 + g + 8) as usize),
        )
    };
    part[0] = fma(w1, acc[2].max(0.0), fma(w0, acc[0].max(0.0), part[0]));
    part[1] = fma(w1, acc[3].max(0.0), fma(w0, acc[1].max(0.0), part[1]));
}

/// One warp computes the logits of positions `p0..min(p0 + 16, hi)` (two 8-key tiles)
/// over `KS` k-steps, `G` k-steps per piece ([`group`]). `CACHED`: the keys' B fragments
/// are loaded once into registers (for `KS ≤ 8`); otherwise they are reloaded for every
/// m-tile (larger head dims).
///
/// # Safety
/// As [`indexer_logits`]; `p0 < hi ≤ end` of row `req`; the row's queries and weights are
/// staged in shared memory with `KS` k-steps.
#[inline(always)]
unsafe fn key_pair<S: Simt, const KS: usize, const G: usize, const CACHED: bool>(
    p: &IndexerLogitsParams,
    a: TileArgs,
) {
    const FULL: u32 = u32::MAX;
    let lane = S::lane_id();
    let (g, t) = (lane / 4, lane % 4);
    // This lane's key of each tile: its values, and (fp4 only: the other formats keep no
    // more registers) its page base and offset, for its group scales.
    let vals: [Option<GlobalPtr<u8>>; 2] = core::array::from_fn(|n| {
        let key = a.p0 + 8 * n as u32 + g;
        // SAFETY: key in [p0, hi) ⊆ the row's range.
        (key < a.hi).then(|| unsafe { key_address::<S>(p, a.req, key).0 })
    });
    let keys: [Option<(GlobalPtr<u8>, u32)>; 2] = core::array::from_fn(|n| {
        let key = a.p0 + 8 * n as u32 + g;
        (G == 8 && key < a.hi).then(|| {
            // SAFETY: as above.
            let (_, page, off) = unsafe { key_address::<S>(p, a.req, key) };
            (page, off)
        })
    });
    let mut cached = [[[0u32; 2]; KS]; 2];
    if CACHED {
        unroll!(2, n, {
            unroll!(4, i, {
                if G * i < KS {
                    // SAFETY: `vals`/`keys` are a valid token's (or None).
                    let v = unsafe { piece::<S>(p, vals[n], i, t) };
                    let s = if G == 8 {
                        // SAFETY: as above.
                        unsafe { fp4_scale::<S>(p, keys[n], i, t) }
                    } else {
                        1.0
                    };
                    unroll!(8, e, {
                        if e < G && G * i + e < KS {
                            cached[n][G * i + e] = b_of_piece::<G>(v, e, s);
                        }
                    });
                }
            });
        });
    }
    let mut part = [[0f32; 2]; 2];
    let mut mt = 0;
    while mt < a.hp / 16 {
        let mut acc = [[0f32; 4]; 2];
        unroll!(16, ks, {
            if ks < KS {
                // SAFETY: queries staged with KS k-steps; mt < hp / 16.
                let af = unsafe { a_frag::<S, G>(a.qrow, mt, ks, g, t) };
                unroll!(2, n, {
                    let b = if CACHED {
                        cached[n][ks]
                    } else {
                        // SAFETY: as above.
                        unsafe { b_frag::<S, G>(p, vals[n], keys[n], ks, t) }
                    };
                    acc[n] = S::mma_bf16_m16n8k16(af, b, acc[n]);
                });
            }
        });
        unroll!(2, n, {
            // SAFETY: weights staged; mt < hp / 16.
            unsafe { fold_heads::<S>(a.w_base, mt, g, acc[n], &mut part[n]) };
        });
        mt += 1;
    }
    // Sum over the 8 groups (lanes with equal t).
    unroll!(2, n, {
        let mut m = 4;
        while m < 32 {
            part[n][0] += S::shfl_xor_f32(FULL, part[n][0], m);
            part[n][1] += S::shfl_xor_f32(FULL, part[n][1], m);
            m <<= 1;
        }
    });
    // Lane l < 8 takes key l of tile n (held by lanes t = l / 2, as part[n][l % 2]),
    // scales it and stores it: the tile's 8 logits in one 32-byte store.
    let fp8 =
        p.format == index_k_format::FP8_FP32_SCALE || p.format == index_k_format::FP8_UE8M0_SCALE;
    unroll!(2, n, {
        let src = (lane / 2) & 3;
        let v0 = S::shfl_idx(FULL, part[n][0].to_bits(), src);
        let v1 = S::shfl_idx(FULL, part[n][1].to_bits(), src);
        let v = f32::from_bits(if lane & 1 == 0 { v0 } else { v1 });
        let pos = a.p0 + 8 * n as u32 + lane;
        if lane < 8 && pos < a.hi {
            let scale = if fp8 {
                // SAFETY: pos in the row's range; the scale of its token (4-byte aligned).
                unsafe {
                    let (_, page, off) = key_address::<S>(p, a.req, pos);
                    S::gld(
                        page.byte_add((p.scale_offset + 4 * off) as usize)
                            .cast::<f32>(),
                    )
                }
            } else {
                1.0
            };
            // SAFETY: pos < hi ≤ end ≤ row_stride.
            unsafe { S::gst(a.out_row.add(pos as usize), v * scale) };
        }
    });
}
