//! `indexer_logits` on the GPU, on tensor cores (`mma.sync` bf16 m16n8k16).
//!
//! A block of 4 warps computes [`KEYS_PER_BLOCK`] consecutive columns of one row; the grid
//! strides over `n_rows × ceil(row_stride / KEYS_PER_BLOCK)` (row, chunk) pairs.
//!
//! Per (row, chunk):
//! 1. The row's queries (`n_heads × head_dim` bf16, heads padded with zeros to a multiple
//!    of 16) and weights (zero for padded heads) are staged in dynamic shared memory.
//! 2. Columns of the chunk outside the row's `[start, end)` are written `-inf`.
//! 3. Each warp takes 8-key tiles of the chunk's in-range columns (tile `i` goes to warp
//!    `i % 4`). Lane `(g, t)` (g = lane / 4, t = lane % 4) loads the B fragments of key
//!    `g` for every k-step straight from the paged cache — bf16 pairs, or two e4m3 codes
//!    widened exactly to bf16 (every e4m3 value is a bf16 value) — and keeps them in
//!    registers. For each 16-head m-tile the warp runs `head_dim / 16` mma steps
//!    (A fragments from shared memory), then folds `w_h · ReLU(c)` of its two heads into
//!    per-lane partial sums for keys `2t, 2t + 1`. A butterfly over `g` finishes the head
//!    sum, lanes `0..4` multiply by the keys' fp8 scales and write the logits.
//!
//! Every logit of a row is computed by the same operations in the same order whatever the
//! other rows (batch invariance). Keys outside the row's range are never read (their pages
//! may be unmapped).
//!
//! Shared memory (bytes): `Q[hp][head_dim]` bf16 with a row stride of `2·head_dim + 16`
//! (the padding staggers banks for the A-fragment loads), then `w[hp]` f32; `hp` = heads
//! rounded up to 16.

use crate::fp8::e4m3_to_f32;
use crate::global::{GlobalMut, GlobalPtr};
use crate::launch::{Launch, MAX_GRID};
use crate::math::fma;
use crate::params::{index_k_format, IndexerLogitsParams, QueryRange};
use crate::simt::Simt;

/// Columns per (row, chunk) work item.
pub const KEYS_PER_BLOCK: u32 = 256;
/// Warps per block.
const WARPS: u32 = 4;
/// Largest head_dim whose B fragments fit the per-thread register budget.
pub const MAX_HEAD_DIM: u32 = 256;

/// Heads rounded up to whole 16-row m-tiles.
fn padded_heads(p: &IndexerLogitsParams) -> u32 {
    p.n_heads.div_ceil(16) * 16
}

/// k-steps of 16 the kernel runs: 4 for head dims up to 64, 8 up to 128, 16 up to 256
/// (the queries are zero-padded, keys read as zeros past `head_dim`).
fn k_steps(head_dim: u32) -> u32 {
    match head_dim.div_ceil(16) {
        0..=4 => 4,
        5..=8 => 8,
        _ => MAX_HEAD_DIM / 16,
    }
}

/// Bytes per staged (zero-padded) query row.
fn q_row_bytes(p: &IndexerLogitsParams) -> u32 {
    2 * 16 * k_steps(p.head_dim) + 16
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

/// Bits of the bf16 equal to an e4m3 code (exact).
#[inline(always)]
fn e4m3_to_bf16_bits(code: u8) -> u32 {
    e4m3_to_f32(code).to_bits() >> 16
}

/// Indexer logits.
///
/// # Safety
/// Launch with [`indexer_logits_launch`]; every pointer and size in `p` describes validated
/// buffers (see [`IndexerLogitsParams`]): rows within `row_stride`, every position of every
/// row's range mapped by the page table to a page of `cache`; `head_dim` a multiple of 16
/// and at most [`MAX_HEAD_DIM`].
#[inline(always)]
pub unsafe fn indexer_logits<S: Simt>(p: IndexerLogitsParams) {
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
        // 1. Stage the row's queries (zero-padded to hp heads and the kernel's k-steps) and
        //    weights. Row offsets in 64 bits: n_rows · n_heads · head_dim may pass 2^32.
        let q_row =
            p.q.add(r as usize * p.n_heads as usize * p.head_dim as usize);
        let w_row = p.weights.add(r as usize * p.n_heads as usize);
        let dims = 16 * k_steps(p.head_dim);
        let mut i = tid;
        while i < hp * dims {
            let (h, d) = (i / dims, i % dims);
            let v = if h < p.n_heads && d < p.head_dim {
                // SAFETY: r < n_rows, h < n_heads, d < head_dim.
                unsafe { S::gld(q_row.add(h as usize * p.head_dim as usize + d as usize)) }
            } else {
                0
            };
            // SAFETY: h < hp, d < dims: inside the Q section.
            unsafe { S::smem_store::<u16>(h as usize * qrow + 2 * d as usize, v) };
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
        // 3. In-range columns, 8-key tiles per warp.
        let (lo, hi) = (c0.max(start), c1.min(end));
        if lo < hi {
            let mut tile = S::warp_id();
            while lo + 8 * tile < hi {
                let args = (req, lo + 8 * tile, hi, out_row, hp, qrow, w_base);
                // SAFETY: forwarded contract; the tile starts inside [lo, hi). The k-step
                // count is a constant, so the key's fragments stay in registers.
                unsafe {
                    match k_steps(p.head_dim) {
                        4 => key_tile::<S, 4, true>(&p, args),
                        8 => key_tile::<S, 8, true>(&p, args),
                        _ => key_tile::<S, 16, false>(&p, args),
                    }
                }
                tile += WARPS;
            }
        }
        // The next item restages shared memory.
        S::sync_threads();
        item += S::grid_dim() as u64;
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

/// Where a warp's 8-key tile is: `(request, first position, end of in-range columns,
/// output row, padded heads, staged query row bytes, weights offset)`.
type TileArgs = (u32, u32, u32, GlobalMut<f32>, u32, usize, usize);

/// The B fragment of k-step `ks` for lane column `t` of a key whose values start at
/// `vals` (`None`: a position past the tile's end, zeros). Dims past `head_dim` are zero.
///
/// # Safety
/// `vals` points at a valid token's value bytes.
#[inline(always)]
unsafe fn b_frag<S: Simt>(
    p: &IndexerLogitsParams,
    vals: Option<GlobalPtr<u8>>,
    ks: usize,
    t: u32,
) -> [u32; 2] {
    let Some(vals) = vals else {
        return [0; 2];
    };
    let mut b = [0u32; 2];
    for (half, reg) in b.iter_mut().enumerate() {
        let d = ks * 16 + 8 * half + 2 * t as usize;
        *reg = if d >= p.head_dim as usize {
            0
        } else if p.format != index_k_format::BF16 {
            // SAFETY: d + 1 < head_dim = the token's value bytes.
            let (lo, hi) = unsafe { (S::gld(vals.add(d)), S::gld(vals.add(d + 1))) };
            e4m3_to_bf16_bits(lo) | (e4m3_to_bf16_bits(hi) << 16)
        } else {
            // SAFETY: 2d + 3 < 2·head_dim = the token's value bytes (4-byte aligned: d is
            // even, value rows and pages are multiples of 4 bytes).
            unsafe { S::gld(vals.add(2 * d).cast::<u32>()) }
        };
    }
    b
}

/// The A fragment of m-tile `mt`, k-step `ks` from the staged queries.
///
/// # Safety
/// The queries are staged with rows of `qrow` bytes covering `ks`; `mt < hp / 16`.
#[inline(always)]
unsafe fn a_frag<S: Simt>(qrow: usize, mt: u32, ks: usize, g: u32, t: u32) -> [u32; 4] {
    let row0 = (mt * 16 + g) as usize * qrow;
    let row1 = row0 + 8 * qrow;
    let col = (ks * 16 + 2 * t as usize) * 2;
    // SAFETY: rows < hp and columns inside the staged row (caller's contract).
    unsafe {
        [
            S::smem_load::<u32>(row0 + col),
            S::smem_load::<u32>(row1 + col),
            S::smem_load::<u32>(row0 + col + 16),
            S::smem_load::<u32>(row1 + col + 16),
        ]
    }
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

/// One warp computes the logits of positions `p0..min(p0 + 8, hi)` over `KS` k-steps.
/// `CACHED`: the key's B fragments are loaded once into registers (for `KS ≤ 8`);
/// otherwise they are reloaded for every m-tile (larger head dims, no register arrays).
///
/// # Safety
/// As [`indexer_logits`]; `p0 < hi ≤ end` of row `req`; the row's queries and weights are
/// staged in shared memory with `KS` k-steps.
#[inline(always)]
unsafe fn key_tile<S: Simt, const KS: usize, const CACHED: bool>(
    p: &IndexerLogitsParams,
    args: TileArgs,
) {
    const FULL: u32 = u32::MAX;
    let (req, p0, hi, out_row, hp, qrow, w_base) = args;
    let lane = S::lane_id();
    let (g, t) = (lane / 4, lane % 4);
    let key = p0 + g;
    // SAFETY: key in [p0, hi) ⊆ the row's range.
    let vals = (key < hi).then(|| unsafe { key_address::<S>(p, req, key).0 });
    let mut cached = [[0u32; 2]; KS];
    if CACHED {
        unroll!(16, ks, {
            if ks < KS {
                // SAFETY: `vals` is a valid token's values (or None).
                cached[ks] = unsafe { b_frag::<S>(p, vals, ks, t) };
            }
        });
    }
    let mut part = [0f32; 2];
    let mut mt = 0;
    while mt < hp / 16 {
        let mut acc = [0f32; 4];
        unroll!(16, ks, {
            if ks < KS {
                // SAFETY: as above; queries staged with KS k-steps.
                let (a, b) = unsafe {
                    let b = if CACHED {
                        cached[ks]
                    } else {
                        b_frag::<S>(p, vals, ks, t)
                    };
                    (a_frag::<S>(qrow, mt, ks, g, t), b)
                };
                acc = S::mma_bf16_m16n8k16(a, b, acc);
            }
        });
        // SAFETY: weights staged; mt < hp / 16.
        unsafe { fold_heads::<S>(w_base, mt, g, acc, &mut part) };
        mt += 1;
    }
    // Sum over the 8 groups (lanes with equal t).
    let mut m = 4;
    while m < 32 {
        part[0] += S::shfl_xor_f32(FULL, part[0], m);
        part[1] += S::shfl_xor_f32(FULL, part[1], m);
        m <<= 1;
    }
    if g == 0 {
        for j in 0..2 {
            let pos = p0 + 2 * t + j;
            if pos < hi {
                let scale = if p.format != index_k_format::BF16 {
                    // SAFETY: pos in the row's range; the scale of its token.
                    unsafe {
                        let (_, page, off) = key_address::<S>(p, req, pos);
                        S::gld(page.add((p.scale_offset + 4 * off) as usize).cast::<f32>())
                    }
                } else {
                    1.0
                };
                // SAFETY: pos < hi ≤ end ≤ row_stride.
                unsafe { S::gst(out_row.add(pos as usize), part[j as usize] * scale) };
            }
        }
    }
}
