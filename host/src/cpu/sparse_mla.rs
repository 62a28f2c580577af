//! CPU sparse MLA attention (decode/prefill alike: one query token at a time).
//!
//! Per (token, head chunk) task: the token's valid slots are processed in blocks of
//! `BLOCK` in the order given. Each token of a block is dequantised once into a row
//! `[latent | rope]` (V is the latent columns of the same rows); `Sᵀ = K · Qᵀ` and
//! `O += P · V` run on [`gemm_acc`]; the softmax is online (running max and sum per head,
//! in slot order). The operation sequence of a head depends only on its token's slots,
//! never on the batch or head chunking.

use half::bf16;
use rayon::prelude::*;

use super::gemm::{gemm_acc, Dims};
use super::isa::CpuIsa;
use crate::layout::{KvDtype, KvLayout, FP8_DS_MLA_TILE};
use crate::ops::SparseMla;
use sparsekit_kernels::fp8::{bf16_to_f32, e4m3_to_f32};

/// Slots per block.
const BLOCK: usize = 64;
/// Heads per task at most.
const MAX_HEAD_CHUNK: usize = 64;

/// Computes attention on the vector path `isa`. Inputs (including every index) are
/// validated by the caller.
pub fn sparse_mla(
    isa: CpuIsa,
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
            attend_task(isa, op, qrow, hc, idx, cache, out, lse);
        });
}

crate::isa_dispatch! {
    /// [`attend`] compiled for the task's vector path; same operations, same order,
    /// identical results on every path.
    #[allow(clippy::too_many_arguments)]
    fn attend_task(
        op: &SparseMla,
        q: &[bf16],
        hc: usize,
        indices: &[i32],
        cache: &[u8],
        out: &mut [bf16],
        lse: &mut [f32],
    ) = |ISA| attend(ISA, op, q, hc, indices, cache, out, lse);
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend(
    isa: CpuIsa,
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
    // Qᵀ [d_qk × hc], once per task.
    let mut qt = vec![0f32; dqk * hc];
    for i in 0..hc {
        for p in 0..dqk {
            qt[p * hc + i] = bf16_to_f32(q[i * dqk + p].to_bits());
        }
    }
    let mut k = vec![0f32; BLOCK * dqk];
    let mut st = vec![0f32; BLOCK * hc];
    let mut p = vec![0f32; hc * BLOCK];
    let mut o = vec![0f32; hc * dv];
    let mut m = vec![f32::NEG_INFINITY; hc];
    let mut sum = vec![0f32; hc];
    let mut mx = vec![0f32; hc];
    let mut bsum = vec![0f32; hc];
    let mut corr = vec![0f32; hc];
    let valid: Vec<usize> = indices
        .iter()
        .filter(|&&i| i >= 0)
        .map(|&i| i as usize)
        .collect();
    for block in valid.chunks(BLOCK) {
        let n = block.len();
        for (j, &slot) in block.iter().enumerate() {
            load_row(l, cache, slot, &mut k[j * dqk..(j + 1) * dqk]);
        }
        st[..n * hc].fill(0.0);
        // Sᵀ[keys × hc] = K[keys × d_qk] · Qᵀ
        gemm_acc(
            isa,
            Dims {
                m: n,
                n: hc,
                k: dqk,
                lda: dqk,
                ldb: hc,
                ldc: hc,
            },
            &k,
            &qt,
            &mut st,
        );
        mx.copy_from_slice(&m);
        for row in st[..n * hc].chunks_exact_mut(hc) {
            for (x, mxi) in row.iter_mut().zip(mx.iter_mut()) {
                *x *= op.softmax_scale;
                *mxi = mxi.max(*x);
            }
        }
        for i in 0..hc {
            corr[i] = (m[i] - mx[i]).exp();
        }
        bsum.fill(0.0);
        for (j, row) in st[..n * hc].chunks_exact(hc).enumerate() {
            for (i, &x) in row.iter().enumerate() {
                let e = (x - mx[i]).exp();
                p[i * BLOCK + j] = e;
                bsum[i] += e;
            }
        }
        for i in 0..hc {
            sum[i] = sum[i] * corr[i] + bsum[i];
            m[i] = mx[i];
            let c = corr[i];
            for x in &mut o[i * dv..(i + 1) * dv] {
                *x *= c;
            }
        }
        // O += P · V, V = the first d_v columns of K.
        gemm_acc(
            isa,
            Dims {
                m: hc,
                n: dv,
                k: n,
                lda: BLOCK,
                ldb: dqk,
                ldc: dv,
            },
            &p,
            &k,
            &mut o,
        );
    }
    // "No valid slot" is decided by the slots, never by the sum: a NaN or infinite score
    // makes the sum NaN, and that NaN must reach out and lse (as in the reference), not
    // pass for the empty-attention values.
    for i in 0..hc {
        let dst = &mut out[i * dv..(i + 1) * dv];
        if !valid.is_empty() {
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

/// Dequantises the token at `slot` into one row `[latent | rope]`.
#[inline(always)]
fn load_row(l: &KvLayout, cache: &[u8], slot: usize, row: &mut [f32]) {
    let tok = &cache[l.slot_token_bytes(slot)];
    let dv = l.nope_dim();
    let (vrow, rope) = row.split_at_mut(dv);
    match l.dtype() {
        KvDtype::Bf16 => {
            for (x, b) in vrow.iter_mut().zip(tok[l.nope_range()].chunks_exact(2)) {
                *x = f32::from_bits(((b[1] as u32) << 24) | ((b[0] as u32) << 16));
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
                    *x = e4m3_to_f32(c) * s;
                }
            }
        }
    }
    for (x, b) in rope.iter_mut().zip(tok[l.rope_range()].chunks_exact(2)) {
        *x = f32::from_bits(((b[1] as u32) << 24) | ((b[0] as u32) << 16));
    }
}
