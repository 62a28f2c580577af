//! The kernel on the emulator against an f64 reference, over the shapes and edge cases
//! the validation suite does not reach: several column passes and rows wider than the
//! prefetch, fp8 latents of 3 and 9 tiles, tiny bf16 dims (n-tiles per warp not a
//! multiple of 8), partial head groups, misaligned buffers, non-power-of-two tile scales,
//! peaked softmax, odd page sizes, `-1` everywhere.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{sparse_mla_split, sparse_mla_workspace};
use crate::emu::{launch_kernel, BufferAccess, EmuTarget, GlobalBuffers};
use crate::fp8::{bf16_to_f32, e4m3_decode, e4m3_encode, kv_tile_scale};
use crate::global::{GlobalMut, GlobalPtr};
use crate::params::{kv_format, SparseMlaParams};

/// Values per fp8_ds_mla tile.
const TILE: usize = kv_format::FP8_DS_MLA_TILE as usize;

#[derive(Clone, Copy, Debug)]
struct Case {
    nope: usize,
    rope: usize,
    fp8: bool,
    page_size: usize,
    n_heads: usize,
    n_tokens: usize,
    topk: usize,
    /// Multiplies q (large = peaked softmax).
    q_scale: f32,
    /// fp8 tile scales multiplied by a non-power-of-two factor.
    odd_scales: bool,
    /// Bytes by which the cache, q and out pointers are misaligned.
    misalign: usize,
    /// Fraction of `-1` indices.
    invalid: f64,
}

impl Case {
    fn new(nope: usize, rope: usize, fp8: bool) -> Self {
        Case {
            nope,
            rope,
            fp8,
            page_size: 64,
            n_heads: 16,
            n_tokens: 3,
            topk: 100,
            q_scale: 1.0,
            odd_scales: false,
            misalign: 0,
            invalid: 0.1,
        }
    }
}

fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn normal(rng: &mut StdRng) -> f32 {
    // Sum of uniforms: cheap, roughly normal, σ ≈ 1.
    (0..4).map(|_| rng.gen::<f32>()).sum::<f32>() * 1.732 - 3.464
}

/// Runs one case; returns the worst error/tolerance ratios (out, lse).
fn run(c: Case, seed: u64) -> (f64, f64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let d_qk = c.nope + c.rope;
    let tiles = c.nope / TILE;
    let (token_bytes, scales_offset, rope_offset) = if c.fp8 {
        (c.nope + 4 * tiles + 2 * c.rope, c.nope, c.nope + 4 * tiles)
    } else {
        (2 * d_qk, 0, 2 * c.nope)
    };
    let page_bytes = token_bytes * c.page_size;
    let n_pages = 5;
    let capacity = n_pages * c.page_size;
    // Cache: every slot holds a key; `keys` keeps the dequantised values.
    let mut cache = vec![0u8; page_bytes * n_pages + c.misalign];
    let mut keys = vec![0f64; capacity * d_qk];
    for slot in 0..capacity {
        let base =
            c.misalign + (slot / c.page_size) * page_bytes + (slot % c.page_size) * token_bytes;
        let row: Vec<f32> = (0..d_qk)
            .map(|_| bf16_to_f32(bf16_bits(normal(&mut rng) * 2.0)))
            .collect();
        if c.fp8 {
            for t in 0..tiles {
                let tile = &row[TILE * t..TILE * (t + 1)];
                let amax = tile.iter().fold(0f32, |m, x| m.max(x.abs()));
                let s = kv_tile_scale(amax) * if c.odd_scales { 1.37 } else { 1.0 };
                for (i, &x) in tile.iter().enumerate() {
                    let code = e4m3_encode(x / s);
                    cache[base + TILE * t + i] = code;
                    keys[slot * d_qk + TILE * t + i] = e4m3_decode(code) as f64 * s as f64;
                }
                cache[base + scales_offset + 4 * t..][..4].copy_from_slice(&s.to_le_bytes());
            }
        } else {
            for (i, &x) in row[..c.nope].iter().enumerate() {
                cache[base + 2 * i..][..2].copy_from_slice(&bf16_bits(x).to_le_bytes());
                keys[slot * d_qk + i] = x as f64;
            }
        }
        for (i, &x) in row[c.nope..].iter().enumerate() {
            cache[base + rope_offset + 2 * i..][..2].copy_from_slice(&bf16_bits(x).to_le_bytes());
            keys[slot * d_qk + c.nope + i] = x as f64;
        }
    }
    // Indices: random slots, some -1; token 1 has none when there are 3+ tokens.
    let mut indices = vec![-1i32; c.n_tokens * c.topk];
    for t in 0..c.n_tokens {
        if t == 1 && c.n_tokens >= 3 {
            continue;
        }
        for i in 0..c.topk {
            if !rng.gen_bool(c.invalid) {
                indices[t * c.topk + i] = rng.gen_range(0..capacity) as i32;
            }
        }
    }
    let qlen = c.n_tokens * c.n_heads * d_qk;
    let qm = c.misalign / 2;
    let mut q = vec![0u16; qlen + qm];
    for x in &mut q[qm..] {
        *x = bf16_bits(normal(&mut rng) * c.q_scale);
    }
    let olen = c.n_tokens * c.n_heads * c.nope;
    let mut out = vec![0x7fc0u16; olen + qm];
    let mut lse = vec![f32::NAN; c.n_tokens * c.n_heads];
    let scale = 1.0 / (d_qk as f32).sqrt();
    let split = sparse_mla_split(c.topk as u32);
    let (ws_bytes, cnt_bytes) = sparse_mla_workspace(
        c.n_tokens as u32,
        c.n_heads as u32,
        c.topk as u32,
        c.nope as u32,
    );
    // 16-byte aligned workspace (its partial records are stored 16 bytes at a time).
    let mut ws = vec![crate::global::V4::default(); (ws_bytes as usize).div_ceil(16)];
    let mut counters = vec![0u32; cnt_bytes as usize / 4];
    let mut bufs = GlobalBuffers::new("sparse_mla");
    bufs.add(
        "workspace",
        ws.as_ptr() as usize,
        ws_bytes as usize,
        BufferAccess::Write,
    )
    .unwrap();
    bufs.add_slice("counters", &counters, BufferAccess::ReadWrite)
        .unwrap();
    bufs.add_slice("q", &q[qm..], BufferAccess::Read).unwrap();
    bufs.add_slice("cache", &cache[c.misalign..], BufferAccess::Read)
        .unwrap();
    bufs.add_slice("indices", &indices, BufferAccess::Read)
        .unwrap();
    bufs.add_slice("out", &out[qm..], BufferAccess::Write)
        .unwrap();
    bufs.add_slice("lse", &lse, BufferAccess::Write).unwrap();
    let p = SparseMlaParams {
        q: GlobalPtr::from_raw(q[qm..].as_ptr()),
        cache: GlobalPtr::from_raw(cache[c.misalign..].as_ptr()),
        indices: GlobalPtr::from_raw(indices.as_ptr()),
        out: GlobalMut::from_raw(out[qm..].as_mut_ptr()),
        lse: GlobalMut::from_raw(lse.as_mut_ptr()),
        page_bytes: page_bytes as u64,
        n_tokens: c.n_tokens as u32,
        n_heads: c.n_heads as u32,
        topk: c.topk as u32,
        nope_dim: c.nope as u32,
        rope_dim: c.rope as u32,
        page_size: c.page_size as u32,
        format: if c.fp8 {
            kv_format::FP8_DS_MLA
        } else {
            kv_format::BF16
        },
        token_bytes: token_bytes as u32,
        scales_offset: scales_offset as u32,
        rope_offset: rope_offset as u32,
        softmax_scale: scale,
        split,
        workspace: GlobalMut::from_raw(ws.as_mut_ptr().cast::<f32>()),
        counters: GlobalMut::from_raw(counters.as_mut_ptr()),
    };
    // SAFETY: every address is a live buffer of the sizes in `p` (registered in `bufs`),
    // borrowed for the (synchronous) launch; the geometry is the kernel's.
    if let Err(e) = unsafe { launch_kernel(EmuTarget::Generic, p, &bufs) } {
        panic!("{c:?}: {e}");
    }
    assert!(
        counters.iter().all(|&x| x == 0),
        "{c:?}: the split counters are back to zero"
    );

    let (mut worst_out, mut worst_lse) = (0f64, 0f64);
    for t in 0..c.n_tokens {
        let slots: Vec<usize> = indices[t * c.topk..(t + 1) * c.topk]
            .iter()
            .filter(|&&s| s >= 0)
            .map(|&s| s as usize)
            .collect();
        let vmax = slots
            .iter()
            .flat_map(|&s| keys[s * d_qk..s * d_qk + c.nope].iter())
            .fold(0f64, |m, x| m.max(x.abs()));
        for h in 0..c.n_heads {
            let qrow: Vec<f64> = q[qm + (t * c.n_heads + h) * d_qk..][..d_qk]
                .iter()
                .map(|&b| bf16_to_f32(b) as f64)
                .collect();
            let got_lse = lse[t * c.n_heads + h] as f64;
            let got = &out[qm + (t * c.n_heads + h) * c.nope..][..c.nope];
            if slots.is_empty() {
                assert_eq!(got_lse, f64::NEG_INFINITY, "{c:?} token {t}");
                assert!(got.iter().all(|&b| b == 0), "{c:?} token {t}");
                continue;
            }
            let mut s = Vec::new();
            let mut mag = 0f64;
            for &slot in &slots {
                let k = &keys[slot * d_qk..(slot + 1) * d_qk];
                let dot: f64 = qrow.iter().zip(k).map(|(a, b)| a * b).sum();
                let abs: f64 = qrow.iter().zip(k).map(|(a, b)| (a * b).abs()).sum();
                s.push(dot * scale as f64);
                mag = mag.max(abs * scale as f64);
            }
            let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            let want_lse = m + sum.ln();
            let tol = 2e-5 * mag + 1e-6 * want_lse.abs();
            worst_lse = worst_lse.max((got_lse - want_lse).abs() / tol);
            for d in 0..c.nope {
                let want: f64 = slots
                    .iter()
                    .zip(&w)
                    .map(|(&slot, &wj)| wj * keys[slot * d_qk + d])
                    .sum::<f64>()
                    / sum;
                let g = bf16_to_f32(got[d]) as f64;
                let tol = 1e-3 * vmax + want.abs() / 256.0;
                worst_out = worst_out.max((g - want).abs() / tol);
            }
        }
    }
    assert!(
        worst_out <= 1.0 && worst_lse <= 1.0,
        "{c:?}: out {worst_out}, lse {worst_lse}"
    );
    (worst_out, worst_lse)
}

#[test]
fn dsv32_dims_both_dtypes() {
    for fp8 in [false, true] {
        run(Case::new(512, 64, fp8), 1);
    }
}

#[test]
fn peaked_softmax() {
    for fp8 in [false, true] {
        for (q_scale, seed) in [(3.0, 2), (6.0, 13), (12.0, 14)] {
            let (o, l) = run(
                Case {
                    q_scale,
                    topk: 70,
                    ..Case::new(512, 64, fp8)
                },
                seed,
            );
            eprintln!("peaked q×{q_scale} fp8={fp8}: out {o:.3}, lse {l:.3} of tolerance");
        }
    }
}

#[test]
fn non_power_of_two_tile_scales_are_exact() {
    run(
        Case {
            odd_scales: true,
            ..Case::new(512, 64, true)
        },
        3,
    );
}

#[test]
fn wide_latents_several_passes() {
    // 1152 = 9 tiles: 144 n-tiles (3 column passes), 152 chunks per key row (more than
    // the prefetch), 9 tile scales (more than 8 per key).
    for fp8 in [false, true] {
        run(
            Case {
                topk: 40,
                n_tokens: 2,
                ..Case::new(1152, 32, fp8)
            },
            4,
        );
    }
}

#[test]
fn three_fp8_tiles() {
    run(Case::new(384, 64, true), 5);
}

#[test]
fn tiny_and_odd_dims() {
    // n-tiles per warp 1 and 2 (generic V path), one k-step per quarter.
    run(
        Case {
            page_size: 7,
            ..Case::new(48, 16, false)
        },
        6,
    );
    run(
        Case {
            page_size: 16,
            ..Case::new(256, 32, true)
        },
        7,
    );
    run(Case::new(128, 16, true), 8);
}

#[test]
fn partial_head_groups_and_many_tokens() {
    run(
        Case {
            n_heads: 20,
            n_tokens: 5,
            topk: 33,
            invalid: 0.5,
            ..Case::new(256, 32, false)
        },
        9,
    );
}

#[test]
fn misaligned_buffers() {
    for fp8 in [false, true] {
        run(
            Case {
                misalign: 2,
                ..Case::new(512, 64, fp8)
            },
            10,
        );
        run(
            Case {
                misalign: 6,
                page_size: 3,
                ..Case::new(256, 32, fp8)
            },
            11,
        );
    }
}

#[test]
fn few_and_no_valid_slots() {
    for (topk, invalid) in [(1, 0.0), (1, 1.0), (31, 0.9), (64, 1.0), (65, 0.97)] {
        run(
            Case {
                topk,
                invalid,
                n_tokens: 4,
                ..Case::new(512, 64, true)
            },
            12,
        );
    }
}

/// Top-k past one split: several blocks per (token, head group), merged in index order by
/// the last one to finish (a partial last split, several head groups, two column passes,
/// 16 splits, and splits with no valid slot at all).
#[test]
fn split_top_k_merges_in_order() {
    for fp8 in [false, true] {
        // 3 splits (512, 512, 76), two head groups.
        run(
            Case {
                topk: 1100,
                n_heads: 32,
                invalid: 0.3,
                ..Case::new(512, 64, fp8)
            },
            15,
        );
        // Two column passes with 2 splits.
        run(
            Case {
                topk: 600,
                n_tokens: 2,
                ..Case::new(1152, 32, fp8)
            },
            16,
        );
    }
    // 16 splits of 576 (9000 indices); most splits empty of valid slots.
    run(
        Case {
            topk: 9000,
            n_tokens: 2,
            invalid: 0.995,
            ..Case::new(128, 16, true)
        },
        17,
    );
    // Every slot invalid: out 0, lse -inf through the merge.
    run(
        Case {
            topk: 1030,
            invalid: 1.0,
            ..Case::new(256, 32, false)
        },
        18,
    );
    assert_eq!(super::sparse_mla_split(512), 512);
    assert_eq!(super::sparse_mla_split(513), 512);
    assert_eq!(super::sparse_mla_split(2048), 512);
    assert_eq!(super::sparse_mla_split(9000), 576);
    assert_eq!(super::sparse_mla_workspace(4, 128, 512, 512), (0, 0));
}
