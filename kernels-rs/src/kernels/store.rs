//! `index_k_store` and `kv_store`: one warp per token, grid-stride over tokens.
//!
//! Quantization matches the CPU backend bit for bit: the token (or tile) `amax` is a
//! butterfly max (exact), the scale and each code come from [`crate::fp8`].
//!
//! Each lane moves four consecutive elements at a time: one 8-byte load of four bf16,
//! then one 4-byte store of four e4m3 codes or one 8-byte store of four bf16 (no
//! byte-wide global access; a warp covers 128 elements per step, fully coalesced). Every
//! dimension is a multiple of 16 (layout contract), so these accesses are aligned.

use super::{warp_max_f32, FULL};
use crate::fp8::{abs, bf16_to_f32, e4m3_encode, index_k_scale, kv_tile_scale};
use crate::global::{GlobalMut, GlobalPtr, V2, V4};
use crate::mx;
use crate::params::kv_format::{
    self, FP8_DS_MLA_TILE as TILE, MODEL1_NOPE, MODEL1_SCALE_BYTES, MODEL1_TILE,
};
use crate::params::{index_k_format, IndexKStoreParams, KvStoreParams};
use crate::simt::Simt;

/// Elements a lane moves per access.
const VEC: u32 = 4;

/// Loads the four bf16 at `src` (8-byte aligned) as f32.
///
/// # Safety
/// `src .. src + 4` are elements of a buffer the launch reads, `src` 8-byte aligned.
#[inline(always)]
unsafe fn load4<S: Simt>(src: GlobalPtr<u16>) -> [f32; 4] {
    // SAFETY: caller.
    let V2([a, b]) = unsafe { S::gld(src.cast::<V2>()) };
    [
        bf16_to_f32(a as u16),
        bf16_to_f32((a >> 16) as u16),
        bf16_to_f32(b as u16),
        bf16_to_f32((b >> 16) as u16),
    ]
}

/// Largest magnitude of four values.
#[inline(always)]
fn amax4(x: [f32; 4]) -> f32 {
    abs(x[0]).max(abs(x[1])).max(abs(x[2]).max(abs(x[3])))
}

/// Quantizes four values by `s` and stores their e4m3 codes (in order) at `dst`.
///
/// # Safety
/// `dst .. dst + 4` are bytes of a buffer the launch writes, `dst` 4-byte aligned.
#[inline(always)]
unsafe fn store_e4m3x4<S: Simt>(dst: GlobalMut<u8>, x: [f32; 4], s: f32) {
    let word = e4m3_encode(x[0] / s) as u32
        | (e4m3_encode(x[1] / s) as u32) << 8
        | (e4m3_encode(x[2] / s) as u32) << 16
        | (e4m3_encode(x[3] / s) as u32) << 24;
    // SAFETY: caller.
    unsafe { S::gst(dst.cast::<u32>(), word) };
}

/// Copies `n` bf16 (a multiple of 4) from `src` to `dst` with the lanes of a warp: four
/// elements (8 bytes) per lane and access where both ends are 8-byte aligned, else two
/// (4 bytes; an fp8_ds_mla token with an odd number of tiles puts its rope at 4 mod 8).
///
/// # Safety
/// `src .. src + n` readable, `dst .. dst + n` written only by this warp, both 4-byte
/// aligned, `n % 4 == 0`.
#[inline(always)]
unsafe fn copy_bf16<S: Simt>(src: GlobalPtr<u16>, dst: GlobalMut<u16>, n: u32) {
    if (src.addr() | dst.addr()) % 8 == 0 {
        let mut i = VEC * S::lane_id();
        while i < n {
            // SAFETY: i + 4 ≤ n (n and i multiples of 4); 8-byte aligned (checked).
            unsafe {
                S::gst(
                    dst.add(i as usize).cast::<V2>(),
                    S::gld(src.add(i as usize).cast::<V2>()),
                )
            };
            i += 32 * VEC;
        }
    } else {
        let mut i = 2 * S::lane_id();
        while i < n {
            // SAFETY: i + 2 ≤ n (n and i even); 4-byte aligned (caller).
            unsafe {
                S::gst(
                    dst.add(i as usize).cast::<u32>(),
                    S::gld(src.add(i as usize).cast::<u32>()),
                )
            };
            i += 64;
        }
    }
}

/// Quantizes one fp4 index key: each lane takes 8 values (one 16-byte load), a group of
/// 32 is 4 lanes (its abs-bits max by two xor shuffles), each lane stores its 8 codes as
/// one u32; lanes at multiples of 8 store their two groups' scale bytes as one u16 (a
/// non-finite group: scale `0xff`, codes 0; see [`crate::mx`]).
///
/// # Safety
/// `key` holds `head_dim` bf16 (16-byte aligned), `values` `head_dim / 2` bytes and
/// `scales` `head_dim / 32` bytes written only by this warp (4-byte aligned: the layout
/// takes `head_dim % 128 == 0`).
#[inline(always)]
unsafe fn store_fp4_key<S: Simt>(
    key: GlobalPtr<u16>,
    values: GlobalMut<u8>,
    scales: GlobalMut<u8>,
    head_dim: u32,
) {
    let lane = S::lane_id();
    let mut base = 0;
    while base < head_dim {
        let i = base + 8 * lane;
        let valid = i < head_dim;
        let V4([w0, w1, w2, w3]) = if valid {
            // SAFETY: i + 8 ≤ head_dim, 16-byte aligned (caller).
            unsafe { S::gld(key.add(i as usize).cast::<V4>()) }
        } else {
            V4([0; 4])
        };
        let pair_max = |m: u32, x: u32| {
            mx::bf16_abs_bits_max(mx::bf16_abs_bits_max(m, x as u16), (x >> 16) as u16)
        };
        let mut m = pair_max(pair_max(pair_max(pair_max(0, w0), w1), w2), w3);
        m = m.max(S::shfl_xor(FULL, m, 1));
        m = m.max(S::shfl_xor(FULL, m, 2));
        let non_finite = mx::abs_bits_non_finite(m);
        let s = mx::fp4_group_scale(bf16_to_f32(m as u16));
        // Two bf16 (one u32) to one byte of two codes, the even element low.
        let code2 = |x: u32| {
            mx::e2m1_encode(bf16_to_f32(x as u16) / s) as u32
                | (mx::e2m1_encode(bf16_to_f32((x >> 16) as u16) / s) as u32) << 4
        };
        let word = code2(w0) | code2(w1) << 8 | code2(w2) << 16 | code2(w3) << 24;
        let word = if non_finite { 0 } else { word };
        let byte = if non_finite {
            mx::UE8M0_NAN
        } else {
            mx::ue8m0_encode(s)
        } as u32;
        let next = S::shfl_down(FULL, byte, 4);
        if valid {
            // SAFETY: bytes i/2 .. i/2 + 4 of the token's values, 4-byte aligned.
            unsafe { S::gst(values.add(i as usize / 2).cast::<u32>(), word) };
            if lane % 8 == 0 {
                // SAFETY: scale bytes i/32 and i/32 + 1 (i % 64 == 0 here, head_dim % 128
                // == 0), 2-byte aligned.
                unsafe {
                    S::gst(
                        scales.add(i as usize / 32).cast::<u16>(),
                        (byte | next << 8) as u16,
                    )
                };
            }
        }
        base += 256;
    }
}

/// Quantizes the 448 NoPE values of a MODEL1 token: per step, each half-warp takes one
/// tile of 64 (4 values a lane), its amax by a 16-lane butterfly; lane 0 gathers the 7
/// ue8m0 scale bytes and stores them with the zero pad byte as one 8-byte word.
///
/// # Safety
/// `src` holds 448 bf16 (8-byte aligned), `row` 448 bytes and `scales` 8 bytes written
/// only by this warp (4- and 8-byte aligned).
#[inline(always)]
unsafe fn store_model1_nope<S: Simt>(
    src: GlobalPtr<u16>,
    row: GlobalMut<u8>,
    scales: GlobalMut<u8>,
) {
    let lane = S::lane_id();
    // Scale bytes of tiles 0..4 and 4..7 (+ the zero pad), in lane 0.
    let (mut lo, mut hi) = (0u32, 0u32);
    let mut base = 0;
    while base < MODEL1_NOPE {
        let i = base + VEC * lane;
        let valid = i < MODEL1_NOPE;
        let x = if valid {
            // SAFETY: i + 4 ≤ 448, 8-byte aligned.
            unsafe { load4::<S>(src.add(i as usize)) }
        } else {
            [0.0; 4]
        };
        let mut amax = amax4(x);
        let mut m = 8;
        while m > 0 {
            amax = amax.max(S::shfl_xor_f32(FULL, amax, m));
            m >>= 1;
        }
        let s = kv_tile_scale(amax);
        if valid {
            // SAFETY: codes i .. i + 4 of the row, 4-byte aligned.
            unsafe { store_e4m3x4::<S>(row.add(i as usize), x, s) };
        }
        let b = mx::ue8m0_encode(s) as u32;
        let upper = S::shfl_idx(FULL, b, 16);
        // Tiles 2k (lanes 0..16) and 2k + 1 (lanes 16..32) of this step; tile 7 does not
        // exist (its byte is the pad, 0).
        let t = base / MODEL1_TILE;
        let pair = if t + 1 < MODEL1_NOPE / MODEL1_TILE {
            b | upper << 8
        } else {
            b
        };
        if t < 4 {
            lo |= pair << (8 * t);
        } else {
            hi |= pair << (8 * (t - 4));
        }
        base += 2 * MODEL1_TILE;
    }
    if lane == 0 {
        // SAFETY: the token's 8 scale bytes, 8-byte aligned (caller).
        unsafe { S::gst(scales.cast::<V2>(), V2([lo, hi])) };
    }
}

/// Stores index keys.
///
/// # Safety
/// Launch with `block_dim` a multiple of 32. `keys` (16-byte aligned, as every allocation
/// is) holds `n_tokens × head_dim` bf16, `slots` `n_tokens` entries that are `-1` or
/// unique slots inside `cache`; `head_dim` is a multiple of 16 and the layout fields
/// describe `cache` exactly (from an `IndexKLayout`).
pub unsafe fn index_k_store<S: Simt>(p: IndexKStoreParams) {
    let warps = S::block_dim() / 32;
    let lane = S::lane_id();
    let mut t = S::block_idx() * warps + S::warp_id();
    while t < p.n_tokens {
        // SAFETY: t < n_tokens and `slots` holds n_tokens entries (contract).
        let slot = unsafe { S::gld(p.slots.add(t as usize)) };
        if slot >= 0 {
            let (page, off) = (
                slot as u64 / p.page_size as u64,
                slot as u64 % p.page_size as u64,
            );
            let page_ptr = p.cache.byte_add((page * p.page_bytes) as usize);
            let values = page_ptr.byte_add((off * p.value_bytes as u64) as usize);
            let key = p.keys.add(t as usize * p.head_dim as usize);
            if p.format == index_k_format::BF16 {
                // SAFETY: head_dim bf16 of the key and of the token's value bytes, both
                // 4-byte aligned (head_dim % 16 == 0; layout contract).
                unsafe { copy_bf16::<S>(key, values.cast::<u16>(), p.head_dim) };
            } else if p.format == index_k_format::FP4_E2M1 {
                let scales = page_ptr
                    .byte_add(p.scale_offset as usize + (off * p.scale_bytes as u64) as usize);
                // SAFETY: the token's key, value bytes and scale bytes (layout contract:
                // head_dim % 128 == 0, scale_bytes = head_dim / 32).
                unsafe { store_fp4_key::<S>(key, values, scales, p.head_dim) };
            } else {
                let mut amax = 0f32;
                let mut i = VEC * lane;
                while i < p.head_dim {
                    // SAFETY: i + 4 ≤ head_dim (multiples of 4), 8-byte aligned.
                    amax = amax.max(amax4(unsafe { load4::<S>(key.add(i as usize)) }));
                    i += 32 * VEC;
                }
                let amax = warp_max_f32::<S>(amax);
                let s = index_k_scale(amax, p.format == index_k_format::FP8_UE8M0_SCALE);
                let mut i = VEC * lane;
                while i < p.head_dim {
                    // SAFETY: i + 4 ≤ head_dim = value bytes of an fp8 token (4-byte
                    // aligned: value_bytes and page_bytes are multiples of 16).
                    unsafe {
                        store_e4m3x4::<S>(
                            values.add(i as usize),
                            load4::<S>(key.add(i as usize)),
                            s,
                        )
                    };
                    i += 32 * VEC;
                }
                if lane == 0 {
                    let at = page_ptr.byte_add(p.scale_offset as usize + 4 * off as usize);
                    // SAFETY: the scale of token `off` lies inside its page, 4-byte aligned
                    // (layout contract).
                    unsafe { S::gst(at.cast::<u32>(), s.to_bits()) };
                }
            }
        }
        t += S::grid_dim() * warps;
    }
}

/// Stores KV tokens.
///
/// # Safety
/// Launch with `block_dim` a multiple of 32. `kv` (8-byte aligned) holds `n_tokens ×
/// (nope_dim + rope_dim)` bf16, `slots` unique slots or `-1`; `nope_dim` and `rope_dim`
/// are multiples of 16 (`nope_dim` of [`kv_format::FP8_DS_MLA_TILE`] for fp8_ds_mla), and
/// the layout fields describe `cache` exactly (from a `KvLayout`).
pub unsafe fn kv_store<S: Simt>(p: KvStoreParams) {
    let warps = S::block_dim() / 32;
    let lane = S::lane_id();
    let dqk = p.nope_dim + p.rope_dim;
    let mut t = S::block_idx() * warps + S::warp_id();
    while t < p.n_tokens {
        // SAFETY: t < n_tokens (contract).
        let slot = unsafe { S::gld(p.slots.add(t as usize)) };
        if slot >= 0 {
            let (page, off) = (
                slot as u64 / p.page_size as u64,
                slot as u64 % p.page_size as u64,
            );
            let tok = p
                .cache
                .byte_add((page * p.page_bytes + off * p.token_bytes as u64) as usize);
            let src = p.kv.add(t as usize * dqk as usize);
            if p.format == kv_format::MODEL1_FP8 {
                let scales = p.cache.byte_add(
                    (page * p.page_bytes + p.scale_section as u64 + off * MODEL1_SCALE_BYTES as u64)
                        as usize,
                );
                // SAFETY: the token's row (448 e4m3 codes first) and its 8 scale bytes
                // (layout contract: a model1_fp8 KvLayout).
                unsafe { store_model1_nope::<S>(src, tok, scales) };
            } else if p.format == kv_format::FP8_DS_MLA {
                let mut tile = 0;
                while tile < p.nope_dim / TILE {
                    let base = tile * TILE;
                    let mut amax = 0f32;
                    let mut i = VEC * lane;
                    while i < TILE {
                        // SAFETY: base + i + 4 ≤ nope_dim, 8-byte aligned.
                        amax = amax.max(amax4(unsafe { load4::<S>(src.add((base + i) as usize)) }));
                        i += 32 * VEC;
                    }
                    let s = kv_tile_scale(warp_max_f32::<S>(amax));
                    let mut i = VEC * lane;
                    while i < TILE {
                        // SAFETY: base + i + 4 ≤ nope_dim = the token's e4m3 bytes
                        // (4-byte aligned: token_bytes is a multiple of 16).
                        unsafe {
                            store_e4m3x4::<S>(
                                tok.add((base + i) as usize),
                                load4::<S>(src.add((base + i) as usize)),
                                s,
                            )
                        };
                        i += 32 * VEC;
                    }
                    if lane == 0 {
                        let at = tok.byte_add((p.scales_offset + 4 * tile) as usize);
                        // SAFETY: tile scales lie inside the token, 4-byte aligned (layout
                        // contract).
                        unsafe { S::gst(at.cast::<u32>(), s.to_bits()) };
                    }
                    tile += 1;
                }
            } else {
                // SAFETY: the token's bf16 latent (nope_dim elements), 4-byte aligned.
                unsafe { copy_bf16::<S>(src, tok.cast::<u16>(), p.nope_dim) };
            }
            // SAFETY: the token's bf16 rope (rope_dim elements at rope_offset), 4-byte
            // aligned (token_bytes and rope_offset are multiples of 4).
            unsafe {
                copy_bf16::<S>(
                    src.add(p.nope_dim as usize),
                    tok.byte_add(p.rope_offset as usize).cast::<u16>(),
                    p.rope_dim,
                )
            };
        }
        t += S::grid_dim() * warps;
    }
}
