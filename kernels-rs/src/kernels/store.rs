//! `index_k_store` and `kv_store`: one warp per token, grid-stride over tokens.
//!
//! Quantization matches the CPU backend bit for bit: the token (or tile) `amax` is a
//! butterfly max (exact), the scale and each code come from [`crate::fp8`].
//!
//! Each lane moves four consecutive elements at a time: one 8-byte load of four bf16,
//! then one 4-byte store of four e4m3 codes or one 8-byte store of four bf16 (no
//! byte-wide global access; a warp covers 128 elements per step, fully coalesced). Every
//! dimension is a multiple of 16 (layout contract), so these accesses are aligned.

use super::warp_max_f32;
use crate::fp8::{abs, bf16_to_f32, e4m3_encode, index_k_scale, kv_tile_scale};
use crate::global::{GlobalMut, GlobalPtr, V2};
use crate::params::kv_format::{self, FP8_DS_MLA_TILE as TILE};
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

/// Stores index keys.
///
/// # Safety
/// Launch with `block_dim` a multiple of 32. `keys` (8-byte aligned, as every allocation
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
            if p.format == kv_format::FP8_DS_MLA {
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
