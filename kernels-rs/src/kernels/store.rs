//! `index_k_store` and `kv_store`: one warp per token, grid-stride over tokens.
//!
//! Quantization matches the CPU backend bit for bit: the token (or tile) `amax` is a
//! butterfly max (exact), the scale and each code come from [`crate::fp8`].

use super::warp_max_f32;
use crate::fp8::{abs, bf16_to_f32, e4m3_encode, index_k_scale, kv_tile_scale};
use crate::params::kv_format::{self, FP8_DS_MLA_TILE as TILE};
use crate::params::{index_k_format, IndexKStoreParams, KvStoreParams};
use crate::simt::Simt;

/// Stores index keys.
///
/// # Safety
/// Launch with `block_dim` a multiple of 32. `keys` holds `n_tokens × head_dim` bf16,
/// `slots` `n_tokens` entries that are `-1` or unique slots inside `cache`, and the layout
/// fields describe `cache` exactly (from an `IndexKLayout`).
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
                let mut i = lane;
                while i < p.head_dim {
                    // SAFETY: i < head_dim: inside the token's key and its value bytes
                    // (2-byte aligned: every layout size is even).
                    unsafe {
                        S::gst(
                            values.cast::<u16>().add(i as usize),
                            S::gld(key.add(i as usize)),
                        )
                    };
                    i += 32;
                }
            } else {
                let mut amax = 0f32;
                let mut i = lane;
                while i < p.head_dim {
                    // SAFETY: i < head_dim.
                    amax = amax.max(abs(bf16_to_f32(unsafe { S::gld(key.add(i as usize)) })));
                    i += 32;
                }
                let amax = warp_max_f32::<S>(amax);
                let s = index_k_scale(amax, p.format == index_k_format::FP8_UE8M0_SCALE);
                let mut i = lane;
                while i < p.head_dim {
                    // SAFETY: i < head_dim = value bytes of an fp8 token.
                    unsafe {
                        let code = e4m3_encode(bf16_to_f32(S::gld(key.add(i as usize))) / s);
                        S::gst(values.add(i as usize), code)
                    };
                    i += 32;
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
/// Launch with `block_dim` a multiple of 32. `kv` holds `n_tokens × (nope_dim + rope_dim)`
/// bf16, `slots` unique slots or `-1`, `nope_dim` is a multiple of [`kv_format::FP8_DS_MLA_TILE`] for fp8_ds_mla, and
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
                    let mut i = lane;
                    while i < TILE {
                        // SAFETY: base + i < nope_dim.
                        amax = amax.max(abs(bf16_to_f32(unsafe {
                            S::gld(src.add((base + i) as usize))
                        })));
                        i += 32;
                    }
                    let s = kv_tile_scale(warp_max_f32::<S>(amax));
                    let mut i = lane;
                    while i < TILE {
                        // SAFETY: base + i < nope_dim = the token's e4m3 bytes.
                        unsafe {
                            let code =
                                e4m3_encode(bf16_to_f32(S::gld(src.add((base + i) as usize))) / s);
                            S::gst(tok.add((base + i) as usize), code)
                        };
                        i += 32;
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
                let mut i = lane;
                while i < p.nope_dim {
                    // SAFETY: i < nope_dim: bf16 latent of the token.
                    unsafe {
                        S::gst(
                            tok.cast::<u16>().add(i as usize),
                            S::gld(src.add(i as usize)),
                        )
                    };
                    i += 32;
                }
            }
            let rope = tok.byte_add(p.rope_offset as usize).cast::<u16>();
            let mut i = lane;
            while i < p.rope_dim {
                // SAFETY: i < rope_dim: the token's bf16 rope (2-byte aligned).
                unsafe {
                    S::gst(
                        rope.add(i as usize),
                        S::gld(src.add((p.nope_dim + i) as usize)),
                    )
                };
                i += 32;
            }
        }
        t += S::grid_dim() * warps;
    }
}
