//! CPU sparse MLA attention (decode/prefill alike: one query token at a time).
//!
//! Per (token, head chunk) task: the token's valid slots are processed in blocks of
//! `BLOCK` in the order given (each block's scattered cache rows prefetched before it is
//! gathered). Each token of a block is dequantised once into a row `[latent | rope]` (V is
//! the latent columns of the same rows); `Sᵀ = K · Qᵀ` and `O += P · V` run on
//! [`gemm_acc`] (whose tall narrow tiles keep `Sᵀ` fast when heads are few); the softmax
//! is online (running max and sum per head, in slot order). The tasks of a rayon job share
//! one set of working buffers. The operation sequence of a head depends only on its
//! token's slots, never on the batch or head chunking; a head of a token with no valid
//! slot gets `out = 0`, `lse = -inf`, decided by the slots (a NaN score gives NaN).

use half::bf16;
use rayon::prelude::*;

use super::gemm::{gemm_acc, Dims};
use super::isa::{prefetch, CpuIsa};
use crate::layout::{KvDtype, KvLayout, FP8_DS_MLA_TILE, MODEL1_TILE};
use crate::ops::SparseMla;
use sparsekit_kernels::fp8::{bf16_to_f32, e4m3_to_f32};
use sparsekit_kernels::mx::ue8m0_to_f32;

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
        .for_each_init(Scratch::default, |scratch, (task, (out, lse))| {
            let t = task / chunks_per_token;
            let h0 = (task % chunks_per_token) * hc;
            let qrow = &q[(t * h + h0) * dqk..(t * h + h0 + hc) * dqk];
            let idx = &indices[t * op.topk..(t + 1) * op.topk];
            scratch.size(dqk, dv, hc);
            scratch.valid.clear();
            scratch
                .valid
                .extend(idx.iter().filter(|&&i| i >= 0).map(|&i| (0, i as usize)));
            let sources = [Source {
                layout: &op.layout,
                cache,
            }];
            let dims = AttnDims {
                dqk,
                dv,
                hc,
                scale: op.softmax_scale,
            };
            attend_task(isa, dims, qrow, &sources, scratch);
            finish_v32(dims, &scratch.valid, scratch, out, lse);
        });
}

/// One cache the keys of a task come from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Source<'a> {
    pub layout: &'a KvLayout,
    pub cache: &'a [u8],
}

/// The shape of a task: key and value dims, heads, softmax scale.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnDims {
    pub dqk: usize,
    pub dv: usize,
    pub hc: usize,
    pub scale: f32,
}

/// DeepSeek-V3.2's output of a task: `out = O / sum` (bf16), `lse = m + ln sum`; a token
/// without a valid slot gets `out = 0`, `lse = -inf`.
fn finish_v32(d: AttnDims, valid: &[(u8, usize)], s: &Scratch, out: &mut [bf16], lse: &mut [f32]) {
    // "No valid slot" is decided by the slots, never by the sum: a NaN or infinite score
    // makes the sum NaN, and that NaN must reach out and lse (as in the reference), not
    // pass for the empty-attention values.
    let dv = d.dv;
    for i in 0..d.hc {
        let dst = &mut out[i * dv..(i + 1) * dv];
        if !valid.is_empty() {
            let inv = 1.0 / s.sum[i];
            for (x, &o) in dst.iter_mut().zip(&s.o[i * dv..(i + 1) * dv]) {
                *x = bf16::from_f32(o * inv);
            }
            lse[i] = s.m[i] + s.sum[i].ln();
        } else {
            dst.fill(bf16::ZERO);
            lse[i] = f32::NEG_INFINITY;
        }
    }
}

/// The working buffers of one task, reused by the tasks a rayon job runs (no allocation
/// per task once sized).
#[derive(Default)]
pub(crate) struct Scratch {
    /// Qᵀ `[d_qk × hc]`.
    qt: Vec<f32>,
    /// Dequantised key block `[BLOCK × d_qk]` (V = its first d_v columns).
    k: Vec<f32>,
    /// Scores `Sᵀ [BLOCK × hc]`.
    st: Vec<f32>,
    /// Probabilities `[hc × BLOCK]`.
    p: Vec<f32>,
    /// Output accumulators `[hc × d_v]`.
    pub(crate) o: Vec<f32>,
    /// Per head: running max, running sum, block max, block sum, correction.
    pub(crate) m: Vec<f32>,
    pub(crate) sum: Vec<f32>,
    mx: Vec<f32>,
    bsum: Vec<f32>,
    corr: Vec<f32>,
    /// The token's valid keys: (source, slot), in attention order.
    pub(crate) valid: Vec<(u8, usize)>,
}

impl Scratch {
    /// Sizes every buffer for `d_qk`, `d_v` and `hc` heads (contents are reset by
    /// [`attend`]).
    pub(crate) fn size(&mut self, dqk: usize, dv: usize, hc: usize) {
        self.qt.resize(dqk * hc, 0.0);
        self.k.resize(BLOCK * dqk, 0.0);
        self.st.resize(BLOCK * hc, 0.0);
        self.p.resize(hc * BLOCK, 0.0);
        self.o.resize(hc * dv, 0.0);
        for v in [
            &mut self.m,
            &mut self.sum,
            &mut self.mx,
            &mut self.bsum,
            &mut self.corr,
        ] {
            v.resize(hc, 0.0);
        }
    }
}

crate::isa_dispatch! {
    /// [`attend`] compiled for the task's vector path; same operations, same order,
    /// identical results on every path.
    pub(crate) fn attend_task(
        d: AttnDims,
        q: &[bf16],
        sources: &[Source<'_>],
        scratch: &mut Scratch,
    ) = |ISA| attend(ISA, d, q, sources, scratch);
}

/// Attends the `hc` query rows `q` (`[hc, d_qk]`) over `scratch.valid` (keys from
/// `sources`, in order): leaves the unnormalised output `O` (`[hc, d_v]`), the running
/// max `m` and the sum of `exp(s − m)` in `scratch` (the callers finish them).
#[inline(always)]
fn attend(isa: CpuIsa, d: AttnDims, q: &[bf16], sources: &[Source<'_>], scratch: &mut Scratch) {
    let AttnDims { dqk, dv, hc, scale } = d;
    let Scratch {
        qt,
        k,
        st,
        p,
        o,
        m,
        sum,
        mx,
        bsum,
        corr,
        valid,
    } = scratch;
    // The keys are scattered cache rows: ask for a block before it is gathered (the
    // first one now, each next one while the current one is computed).
    let fetch = |block: &[(u8, usize)]| {
        for &(src, slot) in block {
            let s = &sources[src as usize];
            prefetch(&s.cache[s.layout.slot_token_bytes(slot)]);
        }
    };
    fetch(&valid[..valid.len().min(BLOCK)]);
    // Qᵀ [d_qk × hc], once per task (rows of Qᵀ written whole).
    for (pp, row) in qt.chunks_exact_mut(hc).enumerate() {
        for (i, x) in row.iter_mut().enumerate() {
            *x = bf16_to_f32(q[i * dqk + pp].to_bits());
        }
    }
    o.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    for (b, block) in valid.chunks(BLOCK).enumerate() {
        let n = block.len();
        if let Some(next) = valid.get((b + 1) * BLOCK..) {
            fetch(&next[..next.len().min(BLOCK)]);
        }
        for (j, &(src, slot)) in block.iter().enumerate() {
            let s = &sources[src as usize];
            load_row(s.layout, s.cache, slot, &mut k[j * dqk..(j + 1) * dqk]);
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
            k,
            qt,
            st,
        );
        mx.copy_from_slice(m);
        for row in st[..n * hc].chunks_exact_mut(hc) {
            for (x, mxi) in row.iter_mut().zip(mx.iter_mut()) {
                *x *= scale;
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
            p,
            k,
            o,
        );
    }
}

/// Dequantises the token at `slot` into one row `[latent | rope]` (every KV layout).
#[inline(always)]
pub(crate) fn load_row(l: &KvLayout, cache: &[u8], slot: usize, row: &mut [f32]) {
    let tok = &cache[l.slot_token_bytes(slot)];
    let dv = l.nope_dim();
    let (vrow, rope) = row.split_at_mut(dv);
    let bf16_of = |b: &[u8]| f32::from_bits(((b[1] as u32) << 24) | ((b[0] as u32) << 16));
    match l.dtype() {
        KvDtype::Bf16 | KvDtype::Bf16x512 => {
            for (x, b) in vrow.iter_mut().zip(tok[l.nope_range()].chunks_exact(2)) {
                *x = bf16_of(b);
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
        KvDtype::Model1Fp8 => {
            let sc = &cache[l.slot_tile_scale_bytes(slot)];
            for ((xs, codes), &b) in vrow
                .chunks_exact_mut(MODEL1_TILE)
                .zip(tok[l.nope_range()].chunks_exact(MODEL1_TILE))
                .zip(sc)
            {
                let s = ue8m0_to_f32(b);
                for (x, &c) in xs.iter_mut().zip(codes) {
                    *x = e4m3_to_f32(c) * s;
                }
            }
        }
    }
    for (x, b) in rope.iter_mut().zip(tok[l.rope_range()].chunks_exact(2)) {
        *x = bf16_of(b);
    }
}
