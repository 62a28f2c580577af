//! CPU sparse MLA attention (decode/prefill alike: one query token at a time).
//!
//! Per (token, head chunk) task: the token's valid slots are processed in blocks of
//! [`BLOCK`] in the order given. A block is dequantised once into `V[BLOCK, d_v]` and the
//! transposed key tile `Kt[d_qk, BLOCK]`; `S = Q·Kt` and `O += P·V` run on [`gemm_acc`]; the
//! softmax is online (running max and sum per head). The operation sequence of a head
//! depends only on its token's slots, never on the batch or head chunking.

use half::bf16;
use rayon::prelude::*;

use super::gemm::{gemm_acc, Dims};
use crate::dtype::E4M3_TABLE;
use crate::layout::{KvDtype, KvLayout, FP8_DS_MLA_TILE};
use crate::ops::SparseMla;

/// Slots per block.
const BLOCK: usize = 64;
/// Heads per task at most.
const MAX_HEAD_CHUNK: usize = 64;

/// Computes attention. Inputs (including every index) are validated by the caller.
pub fn sparse_mla(
    op: &SparseMla,
    q: &[bf16],
    cache: &[u8],
    indices: &[i32],
    out: &mut [bf16],
    lse: &mut [f32],
) {
    let h = op.n_heads;
    let hc = (1..=MAX_HEAD_CHUNK.min(h))
        .rev()
        .find(|c| h % c == 0)
        .unwrap_or(1);
    let (dqk, dv) = (op.layout.d_qk(), op.layout.nope_dim());
    let chunks_per_token = h / hc;
    out.par_chunks_mut(hc * dv)
        .zip(lse.par_chunks_mut(hc))
        .enumerate()
        .for_each(|(task, (out, lse))| {
            let t = task / chunks_per_token;
            let h0 = (task % chunks_per_token) * hc;
            let qrow = &q[(t * h + h0) * dqk..(t * h + h0 + hc) * dqk];
            let idx = &indices[t * op.topk..(t + 1) * op.topk];
            attend(op, qrow, hc, idx, cache, out, lse);
        });
}

fn attend(
    op: &SparseMla,
    q: &[bf16],
    hc: usize,
    indices: &[i32],
    cache: &[u8],
    out: &mut [bf16],
    lse: &mut [f32],
) {
    let l = &op.layout;
    let (dqk, dv) = (l.d_qk(), l.nope_dim());
    let qf: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
    let mut kt = vec![0f32; dqk * BLOCK];
    let mut v = vec![0f32; BLOCK * dv];
    let mut s = vec![0f32; hc * BLOCK];
    let mut o = vec![0f32; hc * dv];
    let mut m = vec![f32::NEG_INFINITY; hc];
    let mut sum = vec![0f32; hc];
    let valid: Vec<usize> = indices
        .iter()
        .filter(|&&i| i >= 0)
        .map(|&i| i as usize)
        .collect();
    for block in valid.chunks(BLOCK) {
        let n = block.len();
        for (j, &slot) in block.iter().enumerate() {
            load_token(l, cache, slot, j, &mut kt, &mut v);
        }
        s.fill(0.0);
        gemm_acc(
            Dims {
                m: hc,
                n,
                k: dqk,
                lda: dqk,
                ldb: BLOCK,
                ldc: BLOCK,
            },
            &qf,
            &kt,
            &mut s,
        );
        for i in 0..hc {
            let row = &mut s[i * BLOCK..i * BLOCK + n];
            let mut mx = m[i];
            for x in row.iter_mut() {
                *x *= op.softmax_scale;
                mx = mx.max(*x);
            }
            let corr = (m[i] - mx).exp();
            let mut bsum = 0f32;
            for x in row.iter_mut() {
                *x = (*x - mx).exp();
                bsum += *x;
            }
            sum[i] = sum[i] * corr + bsum;
            m[i] = mx;
            for x in &mut o[i * dv..(i + 1) * dv] {
                *x *= corr;
            }
        }
        gemm_acc(
            Dims {
                m: hc,
                n: dv,
                k: n,
                lda: BLOCK,
                ldb: dv,
                ldc: dv,
            },
            &s,
            &v,
            &mut o,
        );
    }
    for i in 0..hc {
        let dst = &mut out[i * dv..(i + 1) * dv];
        if sum[i] > 0.0 {
            let inv = 1.0 / sum[i];
            for (d, &x) in dst.iter_mut().zip(&o[i * dv..(i + 1) * dv]) {
                *d = bf16::from_f32(x * inv);
            }
            lse[i] = m[i] + sum[i].ln();
        } else {
            dst.fill(bf16::ZERO);
            lse[i] = f32::NEG_INFINITY;
        }
    }
}

/// Dequantises the token at `slot` into column `j` of `kt[d_qk][BLOCK]` and row `j` of
/// `v[BLOCK][d_v]`.
fn load_token(l: &KvLayout, cache: &[u8], slot: usize, j: usize, kt: &mut [f32], v: &mut [f32]) {
    let ps = l.page_size();
    let base = (slot / ps) * l.bytes_per_page() + l.token_range(slot % ps).start;
    let tok = &cache[base..base + l.bytes_per_token()];
    let dv = l.nope_dim();
    let vrow = &mut v[j * dv..(j + 1) * dv];
    match l.dtype() {
        KvDtype::Bf16 => {
            for (x, b) in vrow.iter_mut().zip(tok[l.nope_range()].chunks_exact(2)) {
                *x = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        KvDtype::Fp8DsMla => {
            let sc = &tok[l.scales_range()];
            for (t, (xs, codes)) in vrow
                .chunks_exact_mut(FP8_DS_MLA_TILE)
                .zip(tok[l.nope_range()].chunks_exact(FP8_DS_MLA_TILE))
                .enumerate()
            {
                let s =
                    f32::from_le_bytes([sc[4 * t], sc[4 * t + 1], sc[4 * t + 2], sc[4 * t + 3]]);
                for (x, &c) in xs.iter_mut().zip(codes) {
                    *x = E4M3_TABLE[c as usize] * s;
                }
            }
        }
    }
    for (d, &x) in vrow.iter().enumerate() {
        kt[d * BLOCK + j] = x;
    }
    for (d, b) in tok[l.rope_range()].chunks_exact(2).enumerate() {
        kt[(dv + d) * BLOCK + j] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}
