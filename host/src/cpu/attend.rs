//! The attention core shared by [`super::sparse_mla`] (DeepSeek-V3.2) and
//! [`super::sparse_mla_v4`] (DeepSeek-V4): `hc` query heads of one token over its valid
//! keys, in blocks of [`BLOCK`] in the order given (each block's scattered cache rows
//! prefetched before it is gathered).
//!
//! Per block, each key is dequantised once into a row `[latent | rope]` (V is the latent
//! columns of the same row); `Sᵀ = K · Qᵀ` and `O += P · V` are bf16 dot products in the
//! order of [`super::dot`]: `vdpbf16ps` on bf16 rows on the `avx512bf16` path, f32 FMAs in
//! the same order ([`gemm_acc_pairs`], whose tall narrow tiles keep `Sᵀ` fast when heads
//! are few) on the others, for the same bits. The probabilities are rounded to bf16
//! before `P · V` on every path (as the GPU kernels and FlashMLA do; the normalising sum
//! stays the f32 sum of the unrounded ones: the tolerance table's derived bound). Every
//! q, key and value is a bf16 value (bf16 caches; e4m3 codes times power-of-two tile
//! scales); a block whose dequantised keys are not (a non-power-of-two fp8_ds_mla scale
//! read from a foreign dump) runs the f32 FMAs on the `avx512bf16` path too, with the same
//! result. The softmax is online (running max and sum per head, in slot order). The
//! operation sequence of a head depends only on its token's keys, never on the batch or
//! the head chunking.

use half::bf16;

use super::dot::{bf16_daz, f32_daz, gemm_bf16, padded_cols, round_bf16_daz, PairDims};
use super::gemm::{gemm_acc_pairs, Dims};
use super::isa::{prefetch, CpuIsa};
use crate::layout::{KvDtype, KvLayout, FP8_DS_MLA_TILE, MODEL1_TILE};
use sparsekit_kernels::fp8::e4m3_to_f32;
use sparsekit_kernels::mx::ue8m0_to_f32;

/// Keys per block.
pub(crate) const BLOCK: usize = 64;

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
    /// Probabilities `[hc × BLOCK]`, rounded to bf16 (f32 paths).
    p: Vec<f32>,
    /// Qᵀ as bf16 pairs `[d_qk/2 × padded hc]` (`avx512bf16`).
    qp: Vec<u32>,
    /// Key block as bf16 `[BLOCK × d_qk]` (`avx512bf16`).
    kb: Vec<u16>,
    /// V as bf16 pairs of keys `[BLOCK/2 × padded d_v]` (`avx512bf16`).
    vp: Vec<u32>,
    /// Probabilities as bf16 `[hc × BLOCK]` (`avx512bf16`).
    pb: Vec<u16>,
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
    /// Sizes every buffer for `d_qk`, `d_v` and `hc` heads on the path `isa` (contents
    /// are reset by [`attend`]).
    pub(crate) fn size(&mut self, isa: CpuIsa, dqk: usize, dv: usize, hc: usize) {
        self.qt.resize(dqk * hc, 0.0);
        self.k.resize(BLOCK * dqk, 0.0);
        self.st.resize(BLOCK * hc, 0.0);
        self.p.resize(hc * BLOCK, 0.0);
        if isa.isa().bf16_dot() {
            self.qp.resize(dqk / 2 * padded_cols(hc), 0);
            self.kb.resize(BLOCK * dqk, 0);
            self.vp.resize(BLOCK / 2 * padded_cols(dv), 0);
            self.pb.resize(hc * BLOCK, 0);
        }
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
    let AttnDims { dqk, dv, hc, .. } = d;
    let bf16_dot = isa.isa().bf16_dot() && dqk % 2 == 0;
    let (ldq, ldv) = (padded_cols(hc), padded_cols(dv));
    let Scratch {
        qt,
        k,
        st,
        p,
        qp,
        kb,
        vp,
        pb,
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
            *x = bf16_daz(q[i * dqk + pp].to_bits());
        }
    }
    if bf16_dot {
        for (pp, row) in qp.chunks_exact_mut(ldq).enumerate() {
            for (i, x) in row[..hc].iter_mut().enumerate() {
                let pair = &q[i * dqk + 2 * pp..][..2];
                *x = pair[0].to_bits() as u32 | (pair[1].to_bits() as u32) << 16;
            }
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
        let mut exact = bf16_dot;
        if bf16_dot {
            for (j, &(src, slot)) in block.iter().enumerate() {
                let s = &sources[src as usize];
                exact &= load_row_bf16(s.layout, s.cache, slot, &mut kb[j * dqk..(j + 1) * dqk]);
            }
        }
        if !exact {
            for (j, &(src, slot)) in block.iter().enumerate() {
                let s = &sources[src as usize];
                load_row(s.layout, s.cache, slot, &mut k[j * dqk..(j + 1) * dqk]);
            }
        }
        st[..n * hc].fill(0.0);
        // Sᵀ[keys × hc] = K[keys × d_qk] · Qᵀ
        if exact {
            let dims = PairDims {
                m: n,
                n: hc,
                k2: dqk / 2,
                lda: dqk,
                ldb: ldq,
                ldc: hc,
            };
            gemm_bf16(isa, dims, kb, qp, st);
        } else {
            let dims = Dims {
                m: n,
                n: hc,
                k: dqk,
                lda: dqk,
                ldb: hc,
                ldc: hc,
            };
            gemm_acc_pairs(isa, dims, k, qt, st);
        }
        // Online softmax over the block: p = exp(s·scale − max), per head in slot order.
        mx.copy_from_slice(m);
        for row in st[..n * hc].chunks_exact_mut(hc) {
            for (x, mxi) in row.iter_mut().zip(mx.iter_mut()) {
                *x *= d.scale;
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
        if exact {
            // P's pad pair and V's pad row for an odd block: zeros.
            for i in 0..hc {
                for j in 0..n {
                    pb[i * BLOCK + j] = round_bf16_daz(p[i * BLOCK + j]);
                }
                if n % 2 == 1 {
                    pb[i * BLOCK + n] = 0;
                }
            }
            for (jp, row) in vp.chunks_exact_mut(ldv).take(n.div_ceil(2)).enumerate() {
                let lo = &kb[2 * jp * dqk..][..dv];
                if 2 * jp + 1 < n {
                    let hi = &kb[(2 * jp + 1) * dqk..][..dv];
                    for ((x, &l), &h) in row.iter_mut().zip(lo).zip(hi) {
                        *x = l as u32 | (h as u32) << 16;
                    }
                } else {
                    for (x, &l) in row.iter_mut().zip(lo) {
                        *x = l as u32;
                    }
                }
            }
            let dims = PairDims {
                m: hc,
                n: dv,
                k2: n.div_ceil(2),
                lda: BLOCK,
                ldb: ldv,
                ldc: dv,
            };
            gemm_bf16(isa, dims, pb, vp, o);
        } else {
            for row in p.chunks_exact_mut(BLOCK) {
                for x in &mut row[..n] {
                    *x = bf16_daz(round_bf16_daz(*x));
                }
            }
            let dims = Dims {
                m: hc,
                n: dv,
                k: n,
                lda: BLOCK,
                ldb: dqk,
                ldc: dv,
            };
            gemm_acc_pairs(isa, dims, p, k, o);
        }
    }
}

/// Dequantises the token at `slot` into one f32 row `[latent | rope]` (every KV layout),
/// subnormals flushed as the bf16 dot product reads them.
#[inline(always)]
pub(crate) fn load_row(l: &KvLayout, cache: &[u8], slot: usize, row: &mut [f32]) {
    let tok = &cache[l.slot_token_bytes(slot)];
    let dv = l.nope_dim();
    let (vrow, rope) = row.split_at_mut(dv);
    let bf16_of = |b: &[u8]| bf16_daz(u16::from_le_bytes([b[0], b[1]]));
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
                    *x = f32_daz(e4m3_to_f32(c) * s);
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
                    *x = f32_daz(e4m3_to_f32(c) * s);
                }
            }
        }
    }
    for (x, b) in rope.iter_mut().zip(tok[l.rope_range()].chunks_exact(2)) {
        *x = bf16_of(b);
    }
}

/// [`load_row`] as bf16 bits; whether every value is exactly a bf16 value (else the row
/// is unusable and the block runs [`load_row`]'s f32 rows).
#[inline(always)]
fn load_row_bf16(l: &KvLayout, cache: &[u8], slot: usize, row: &mut [u16]) -> bool {
    let tok = &cache[l.slot_token_bytes(slot)];
    let dv = l.nope_dim();
    let (vrow, rope) = row.split_at_mut(dv);
    let bits = |x: f32| (x.to_bits() >> 16) as u16;
    let mut low = 0u32;
    match l.dtype() {
        KvDtype::Bf16 | KvDtype::Bf16x512 => {
            for (x, b) in vrow.iter_mut().zip(tok[l.nope_range()].chunks_exact(2)) {
                *x = u16::from_le_bytes([b[0], b[1]]);
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
                    let v = f32_daz(e4m3_to_f32(c) * s);
                    low |= v.to_bits() & 0xffff;
                    *x = bits(v);
                }
            }
        }
        KvDtype::Model1Fp8 => {
            // e4m3 × a power of two (or NaN): always a bf16 value.
            let sc = &cache[l.slot_tile_scale_bytes(slot)];
            for ((xs, codes), &b) in vrow
                .chunks_exact_mut(MODEL1_TILE)
                .zip(tok[l.nope_range()].chunks_exact(MODEL1_TILE))
                .zip(sc)
            {
                let s = ue8m0_to_f32(b);
                for (x, &c) in xs.iter_mut().zip(codes) {
                    let v = f32_daz(e4m3_to_f32(c) * s);
                    low |= v.to_bits() & 0xffff;
                    *x = bits(v);
                }
            }
        }
    }
    for (x, b) in rope.iter_mut().zip(tok[l.rope_range()].chunks_exact(2)) {
        *x = u16::from_le_bytes([b[0], b[1]]);
    }
    low == 0
}
