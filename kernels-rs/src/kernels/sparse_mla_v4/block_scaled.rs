//! The sm_120a form of `sparse_mla_v4`'s score product: the 448 MODEL1 NoPE dims of
//! `S = Q·Kᵀ` on the block-scaled MXFP8 mma (`mma.sync…kind::mxf8f6f4.block_scale`,
//! `m16n8k32`, one ue8m0 scale per row of Q and per key for each 32 dims), which takes the
//! keys' e4m3 codes and their tile scales as the cache stores them; the 64 RoPE dims stay
//! on the bf16 mma, and so does `O += P·V` (a key's scale varies along the keys, which a
//! block scale of the V operand cannot express).
//!
//! # The queries' split
//!
//! q is bf16: each row's dims are cut into groups of 32 (the dims one k-step of the mma
//! reads, see below), and each group becomes two e4m3 parts with their own scale:
//! `q ≈ 2^a · hi + 2^b · lo`, `hi = e4m3(q / 2^a)`, `lo = e4m3((q − 2^a·hi) / 2^b)`, `2^a`
//! and `2^b` the smallest powers of two that keep the part inside ±448
//! ([`e4m3_scale_byte`]). A bf16 value has 8 significant bits, `hi` keeps the top 4
//! (rounded) and the remainder needs at most 4 more, so the split is **exact** for every
//! value within `2^12` of its group's largest magnitude; smaller values lose their low
//! bits (an error below `2^-22` of the group's largest magnitude). The score therefore
//! differs from the bf16 path's by the mma's accumulation order and those tiny values —
//! within the suite's tolerance, not bit for bit. A group holding NaN or ±inf gets a NaN
//! scale (its rows' scores are NaN, as on the bf16 path for NaN; ±inf there gives ±inf or
//! NaN).
//!
//! # Fragments
//!
//! As on the bf16 path, lane `(g, t)` reads 16-byte chunk `t` of a 64-dim tile: dims
//! `64T + 16t .. +16` of query rows `g`, `g + 8` (hi and lo codes) and of key `8j + g`
//! (codes). Bytes 0..8 of the chunk feed k-step 0 of the tile, bytes 8..16 k-step 1, so a
//! k-step reads dims `{64T + 16t + 8h + e : t < 4, e < 8}` (`h` the k-step): that set is
//! the group of the queries' scales, and the key's scale of the k-step is its tile's.
//! Scale registers (byte 0): lane `4g` gives A row `g` and key `8j + g`, lane `4g + 1`
//! A row `g + 8`.
//!
//! # Shared memory (see the module docs of `sparse_mla_v4`)
//!
//! - Q area: chunks `4T + t` (0..28) of row `h` hold its hi codes, chunks `28 + 4T + t`
//!   (28..56) its lo codes, in dim order; chunks 56..64 the RoPE dims as bf16.
//! - `KC_OFF`: the block's key codes, a 512-byte row per key (its MODEL1 NoPE bytes as
//!   stored, unit-swizzled by `code_addr`).
//! - `KS_OFF`: the keys' 8 scale bytes as stored (`0x7f`, scale 1, for a missing key).
//! - `QS_OFF`: per query row and tile a word of scale bytes `[hi₀, lo₀, hi₁, lo₁]`
//!   (k-steps 0 and 1).

use super::{chunk_addr, code_addr, pair_bf16, store_partial, NT, Q_OFF, THREADS, V4_HEADS};
use super::{KS_OFF, NOPE_TILES, QS_OFF};
use crate::fp8::e4m3_encode;
use crate::global::{V2, V4};
use crate::mx::{bf16_abs_bits_max, e4m3_hi_part, e4m3_scale_byte, ue8m0_inverse, ue8m0_to_f32};
use crate::params::{kv_format, SparseMlaV4Params, V4CacheParams};
use crate::simt::Simt;

/// Whether a launch takes the block-scaled score product: on a target with the MXFP8 mma,
/// when every cache the launch reads is `model1_fp8` (a block may mix main and extra keys).
#[inline(always)]
pub(super) fn enabled<S: Simt>(p: &SparseMlaV4Params) -> bool {
    let model1 = |c: &V4CacheParams| c.topk == 0 || c.format == kv_format::MODEL1_FP8;
    S::HAS_MXF8_MMA && model1(&p.main) && model1(&p.extra)
}

/// Stages the group's queries for the block-scaled product: the RoPE chunks as bf16, the
/// NoPE dims split into hi and lo e4m3 codes with their scales (one group of 32 dims per
/// task; rows past `n_heads` are zero).
///
/// # Safety
/// `token < n_tokens`; no one reads the Q or query-scale areas until the next barrier, nor
/// has since the last one.
#[inline(always)]
pub(super) unsafe fn stage_q<S: Simt>(p: &SparseMlaV4Params, token: u32, h0: u32) {
    // SAFETY: forwarded; chunks 56..64 (the RoPE dims) only.
    unsafe { super::gather::stage_q::<S>(p, token, h0, 56) };
    let aligned = p.q.addr() % 16 == 0;
    // One group (k-step `half` of tile `tile` of row `h`) per task.
    let mut i = S::thread_idx();
    while i < V4_HEADS * NOPE_TILES * 2 {
        let (h, tile, half) = (i / (2 * NOPE_TILES), (i / 2) % NOPE_TILES, i % 2);
        // The group's 32 bf16 (two per word): dims 64·tile + 16t + 8·half .. + 8 in
        // x[4t .. 4t + 4].
        let mut x = [0u32; 16];
        if h0 + h < p.n_heads {
            unroll!(4, t, {
                let at = super::gather::q_row(p, token, h0, h)
                    .byte_add((128 * tile + 32 * t as u32 + 16 * half) as usize);
                // SAFETY: 8 bf16 of the tile, inside head h0 + h's row.
                let v = unsafe { super::gather::load16::<S>(at, aligned) };
                unroll!(4, k, {
                    x[4 * t + k] = v[k];
                });
            });
        }
        let val = |w: usize, e: usize| f32::from_bits((x[w] >> (16 * e)) << 16);
        let mut amax_bits = 0;
        unroll!(16, w, {
            amax_bits = bf16_abs_bits_max(amax_bits, x[w] as u16);
            amax_bits = bf16_abs_bits_max(amax_bits, (x[w] >> 16) as u16);
        });
        let sa = e4m3_scale_byte(f32::from_bits(amax_bits << 16));
        let (s, inv) = (ue8m0_to_f32(sa), ue8m0_inverse(sa));
        // hi codes (bytes in dim order, four per word) and the remainders.
        let mut hi = [0u32; 8];
        let mut r = [0f32; 32];
        let mut ramax = 0f32;
        unroll!(16, w, {
            unroll!(2, e, {
                let (c, rem) = e4m3_hi_part(val(w, e), s, inv);
                hi[w / 2] |= (c as u32) << (8 * (2 * (w % 2) + e));
                r[2 * w + e] = rem;
                ramax = ramax.max(crate::fp8::abs(rem));
            });
        });
        let sb = e4m3_scale_byte(ramax);
        let inv_b = ue8m0_inverse(sb);
        let mut lo = [0u32; 8];
        unroll!(16, w, {
            unroll!(2, e, {
                let c = e4m3_encode(r[2 * w + e] * inv_b);
                lo[w / 2] |= (c as u32) << (8 * (2 * (w % 2) + e));
            });
        });
        unroll!(4, t, {
            let c = 4 * tile + t as u32;
            let off = 8 * half as usize;
            // SAFETY: row h < 16, chunks c and 28 + c < 56: the NoPE part of the Q area.
            unsafe {
                S::smem_store(
                    Q_OFF as usize + chunk_addr(h, c) + off,
                    V2([hi[2 * t], hi[2 * t + 1]]),
                );
                S::smem_store(
                    Q_OFF as usize + chunk_addr(h, 28 + c) + off,
                    V2([lo[2 * t], lo[2 * t + 1]]),
                );
            }
        });
        let at = QS_OFF + 4 * (NOPE_TILES * h + tile) + 2 * half;
        // SAFETY: half `half` of word (h, tile) of the query-scale area.
        unsafe { S::smem_store(at as usize, (sa as u16) | (sb as u16) << 8) };
        i += THREADS;
    }
}

/// Warp `warp`'s partial scores of the block (dims `128·warp ..+128`): NoPE tiles on the
/// block-scaled mma, the RoPE dims (warp 3's second tile) on the bf16 one.
///
/// # Safety
/// Queries staged by [`stage_q`] and the block's key codes, scales and rows gathered; only
/// this warp writes its partial entries.
#[inline(always)]
pub(super) unsafe fn scores<S: Simt>(warp: u32, lane: u32, g: u32, t: u32) {
    let mut acc = [[0f32; 4]; NT];
    let a_row = g + 8 * (t & 1);
    unroll!(2, tt, {
        let tile = 2 * warp + tt as u32;
        if tile < NOPE_TILES {
            let c = 4 * tile + t;
            // SAFETY: word (a_row, tile) of the query-scale area.
            let sa =
                unsafe { S::smem_load::<u32>((QS_OFF + 4 * (NOPE_TILES * a_row + tile)) as usize) };
            // The hi part, then the lo part (chunks 28 + c): one part's fragments live at
            // a time (the output accumulators already hold most of the registers).
            unroll!(2, part, {
                let qc = c + 28 * part as u32;
                // SAFETY: rows g, g + 8 < 16, chunk qc < 56.
                let (qa, qb) = unsafe {
                    (
                        S::smem_load::<V4>(Q_OFF as usize + chunk_addr(g, qc)).0,
                        S::smem_load::<V4>(Q_OFF as usize + chunk_addr(g + 8, qc)).0,
                    )
                };
                unroll!(2, j, {
                    let key = 8 * j as u32 + g;
                    // SAFETY: key < 16: its code chunk c < 28 and its scale word.
                    let (kb, sw) = unsafe {
                        (
                            S::smem_load::<V4>(code_addr(key, c)).0,
                            S::smem_load::<u32>((KS_OFF + 8 * key + 4 * (tile / 4)) as usize),
                        )
                    };
                    let sb = (sw >> (8 * (tile % 4))) & 0xff;
                    unroll!(2, h, {
                        let w = 2 * h;
                        let a = [qa[w], qb[w], qa[w + 1], qb[w + 1]];
                        let s = (sa >> (16 * h + 8 * part)) & 0xff;
                        acc[j] = S::mma_mxf8_e4m3_m16n8k32(a, [kb[w], kb[w + 1]], acc[j], s, sb);
                    });
                });
            });
        } else {
            // The RoPE dims 448..512: chunks 56..64, the bf16 path's pairs 14 and 15.
            // SAFETY: the RoPE chunks of the Q area and the key rows are staged.
            unsafe {
                pair_bf16::<S>(14, g, t, &mut acc);
                pair_bf16::<S>(15, g, t, &mut acc);
            }
        }
    });
    // SAFETY: this warp's partial entries.
    unsafe { store_partial::<S>(warp, lane, &acc) };
}
