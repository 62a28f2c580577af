//! The attention core shared by [`super::sparse_mla`] (DeepSeek-V3.2) and
//! [`super::sparse_mla_v4`] (DeepSeek-V4): `hc` query heads of one token over its valid
//! keys, in blocks of `BLOCK` (128) in the order given (each block's scattered cache rows
//! prefetched before it is gathered).
//!
//! Per block, each key is dequantised once into a row `[latent | rope]` (V is the latent
//! columns of the same row; on the `avx512bf16` path a bf16 cache's rows are read where
//! they lie, through [`super::dot::gemm_bf16_gathered_into`], instead of being copied
//! together); `Sᵀ = K · Qᵀ` and `O += P · V` are bf16 dot products in the
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

use std::cell::RefCell;

use half::bf16;

use super::along;
use super::dot::{
    bf16_bits_daz, bf16_daz, e4m3_f32, f32_daz, gemm_bf16_gathered_into, gemm_bf16_pair_major,
    gemm_bf16_pair_major_into, padded_cols, round_bf16_daz, scaled_bf16_row, PairDims,
};
use super::gemm::{gemm_acc_pairs, gemm_pairs_into, Dims};
use super::isa::{prefetch, CpuIsa};
use super::scratch::Aligned;
use super::transpose::{pair_rows_daz, transpose};
use super::widen;
use crate::layout::{KvDtype, KvLayout, FP8_DS_MLA_TILE, MODEL1_TILE};
use sparsekit_kernels::mx::ue8m0_to_f32;

/// Keys per block.
pub(crate) const BLOCK: usize = 128;

/// Keys per call of the score GEMM (`Sᵀ`): before each, its share of the next block's
/// keys is prefetched. Asked for all at once during the gather, they queued up: on AMD
/// Zen 4, one thread, `sparse_mla` at 256 tokens × 64 keys of 16 heads took 3.08–3.31 ms
/// this way against 3.46–3.87 ms (`avx512bf16`), 4.49–4.60 against 4.80–5.01 (`avx512`);
/// 32 tokens and the 2048-key shapes unchanged. 32, not 16: the f32 GEMM's tiles of 12
/// rows stay whole.
const SUB: usize = 32;

/// Most heads a task may have for the keys-along route ([`along`]): as many as `Sᵀ`'s
/// tiles of one 256-bit vector of heads hold.
const ALONG_MAX_HEADS: usize = 8;

/// Whether a task of `hc` heads over keys of `dqk` dims (`dv` of them V) takes the
/// keys-along route ([`along`]: `S = Q · Kᵀ` on the keys' bf16 pairs, `P · V` on their
/// bf16 rows): where `wide` ([`super::peak::wide_tiles`]: the f32 AVX-512 paths on cores
/// whose 512-bit FMAs do twice the work of 256-bit ones), for at most 8 heads (whose `Sᵀ`
/// tiles are one 256-bit vector wide), even `dqk` and whole tiles of V's columns.
/// Elsewhere `Sᵀ = K · Qᵀ` on keys widened to f32 (or `vdpbf16ps`). At 16 heads, where
/// `Sᵀ`'s tiles are whole 512-bit vectors, the route measured no faster (an Intel Xeon,
/// two threads, 256 tokens of 16 heads over 64 bf16 keys of 288 dims: 1.88–2.05 against
/// 1.95–2.10 ms): the transpose of the keys into pairs costs what the widening did.
const fn takes_along(wide: bool, dqk: usize, dv: usize, hc: usize) -> bool {
    wide && hc <= ALONG_MAX_HEADS && dqk % 2 == 0 && dv % 32 == 0
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
    /// [`super::peak::wide_tiles`] of the call's path (for the keys-along route).
    pub wide: bool,
}

/// The working buffers of one task, reused by the tasks a rayon job runs (no allocation
/// per task once sized).
#[derive(Default)]
pub(crate) struct Scratch {
    /// Qᵀ `[d_qk × hc]`.
    qt: Aligned<f32>,
    /// Dequantised key block `[BLOCK × d_qk]` (V = its first d_v columns).
    k: Aligned<f32>,
    /// Scores `Sᵀ [BLOCK × padded hc]` (a key's heads adjacent; the pad columns zeroed
    /// before each block's softmax), then the probabilities in place.
    st: Aligned<f32>,
    /// The rounded probabilities `P [hc × BLOCK]` (the f32 paths).
    p: Aligned<f32>,
    /// Per head (padded hc): the factor `O` is rescaled by after a block's softmax.
    corr: Vec<f32>,
    /// Qᵀ as bf16 pairs `[d_qk/2 × padded hc]` (`avx512bf16`).
    qp: Aligned<u32>,
    /// Key block as bf16 `[BLOCK × d_qk]` (`avx512bf16`; the keys not read in place).
    kb: Aligned<u16>,
    /// V as bf16 pairs of keys `[BLOCK/2 × padded d_v]` (`avx512bf16`).
    vp: Aligned<u32>,
    /// Probabilities as bf16 pairs of keys, pair-major `[BLOCK/2 × padded hc]`
    /// (`avx512bf16`).
    pb: Aligned<u32>,
    /// Kᵀ as bf16 pairs `[d_qk/2 × BLOCK]`, subnormals flushed (the keys-along route).
    kt: Aligned<u32>,
    /// A block's V rows with subnormals flushed `[BLOCK × d_v]` (the keys-along route,
    /// for blocks that have one).
    vd: Aligned<u16>,
    /// Output accumulators `[hc × d_v]`.
    pub(crate) o: Aligned<f32>,
    /// Per head: running max, running sum (padded hc entries; the pad's are unused).
    pub(crate) m: Vec<f32>,
    pub(crate) sum: Vec<f32>,
    /// The token's valid keys: (source, slot), in attention order.
    pub(crate) valid: Vec<(u8, usize)>,
    /// The first keys (at most [`BLOCK`]) of the task this rayon worker most likely runs
    /// next, prefetched while the last block of this one is gathered; empty when that
    /// task reads the same keys.
    ahead: Vec<(u8, usize)>,
    /// How many of `valid`'s first keys the previous task of this thread prefetched (its
    /// `ahead`): those are not asked for again.
    fetched: usize,
}

thread_local! {
    /// This thread's working buffers for both attention ops ([`super::scratch`]).
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's attention buffers ([`super::scratch::with`]).
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    super::scratch::with(&SCRATCH, f)
}

impl Scratch {
    /// Before a task of token `t`: `valid` = `keys(t)`, and `ahead` = the first keys of
    /// token `next` (the one this worker most likely runs next), or none.
    pub(crate) fn plan<I: Iterator<Item = (u8, usize)>>(
        &mut self,
        t: usize,
        next: Option<usize>,
        keys: impl Fn(usize) -> I,
    ) {
        self.valid.clear();
        self.valid.extend(keys(t));
        // The previous task's look-ahead is this task's first keys when it planned for
        // this token (same keys: a stale list from another call simply does not match).
        self.fetched = if self.valid.starts_with(&self.ahead) {
            self.ahead.len()
        } else {
            0
        };
        self.ahead.clear();
        if let Some(n) = next {
            self.ahead.extend(keys(n).take(BLOCK));
        }
    }

    /// Sizes every buffer for `d_qk`, `d_v` and `hc` heads on the path `isa` (contents
    /// are reset by [`attend`]).
    pub(crate) fn size(&mut self, isa: CpuIsa, d: AttnDims) {
        let AttnDims { dqk, dv, hc, .. } = d;
        let hcp = padded_cols(hc);
        self.qt.resize(dqk * hc, 0.0);
        self.k.resize(BLOCK * dqk, 0.0);
        self.st.resize(BLOCK * hcp, 0.0);
        self.p.resize(hc.max(1) * BLOCK, 0.0);
        self.corr.resize(hcp, 0.0);
        if takes_along(d.wide, dqk, dv, hc) {
            self.kb.resize(BLOCK * dqk, 0);
            self.kt.resize(dqk / 2 * BLOCK, 0);
            self.vd.resize(BLOCK * dv, 0);
        }
        if isa.isa().bf16_dot() {
            self.qp.resize(dqk / 2 * hcp, 0);
            self.kb.resize(BLOCK * dqk, 0);
            self.vp.resize(BLOCK / 2 * padded_cols(dv), 0);
            self.pb.resize(BLOCK / 2 * hcp, 0);
        }
        self.o.resize(hc * dv, 0.0);
        self.m.resize(hcp, 0.0);
        self.sum.resize(hcp, 0.0);
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
    let along = takes_along(d.wide, dqk, dv, hc);
    let (hcp, ldv) = (padded_cols(hc), padded_cols(dv));
    let Scratch {
        qt,
        k,
        st,
        p,
        corr,
        qp,
        kb,
        vp,
        pb,
        kt,
        vd,
        o,
        m,
        sum,
        valid,
        ahead,
        fetched,
    } = scratch;
    // The keys are scattered cache rows: ask for each one a block before it is gathered
    // (the first block now, then the next block's keys in shares, one before each chunk of
    // this block's score GEMM).
    let fetch = |&(src, slot): &(u8, usize)| {
        let s = &sources[src as usize];
        prefetch(&s.cache[s.layout.slot_token_bytes(slot)]);
    };
    valid[(*fetched).min(BLOCK)..valid.len().min(BLOCK)]
        .iter()
        .for_each(fetch);
    // Qᵀ once per task: as bf16 pairs on the avx512bf16 path, as f32 otherwise (there too
    // when a block needs it), through `k` as a staging area (hc ≤ BLOCK rows) where Q's
    // rows cannot be read in place.
    let mut have_qt = false;
    let build_qt = |k: &mut [f32], qt: &mut [f32]| {
        widen::bf16s_f32_row(isa, &q[..hc * dqk], &mut k[..hc * dqk]);
        transpose(isa, hc, dqk, k, dqk, qt, hc);
    };
    if bf16_dot {
        // A row's pairs of bf16 are its bytes read as 32-bit words (element 0 low), and a
        // transpose moves bits only: the pairs arrive intact.
        let half = dqk / 2;
        let qp_bits: &mut [f32] = bytemuck::cast_slice_mut(&mut qp[..]);
        // Q's rows read as pairs where they lie (4-byte aligned), else copied first: the
        // copy waited on Q's lines (AMD Zen 4, two threads, serving decode `t32` 141.1 →
        // 132.6 µs, `t256` 1.15 → 1.13 ms).
        match bytemuck::try_cast_slice::<bf16, f32>(&q[..hc * dqk]) {
            Ok(pairs) => transpose(isa, hc, half, pairs, half, qp_bits, hcp),
            Err(_) => {
                bytemuck::cast_slice_mut::<f32, bf16>(&mut k[..hc * half])
                    .copy_from_slice(&q[..hc * dqk]);
                transpose(isa, hc, half, k, half, qp_bits, hcp);
            }
        }
    } else {
        build_qt(k, qt);
        have_qt = true;
    }
    m.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    for (b, block) in valid.chunks(BLOCK).enumerate() {
        let n = block.len();
        // The next block's keys, or after the last block the next task's.
        let next = match valid.get((b + 1) * BLOCK..) {
            Some(rest) if !rest.is_empty() => rest,
            _ => &ahead[..],
        };
        // Before chunk `c` of `chunks` of this block's score GEMM: that chunk's share of the
        // next keys asked for (the requests spread over the GEMM instead of queueing up at
        // once).
        let fetch_share = |c: usize, chunks: usize| {
            let n_next = next.len().min(BLOCK);
            next[c * n_next / chunks..(c + 1) * n_next / chunks]
                .iter()
                .for_each(fetch);
        };
        let mut exact = bf16_dot || along;
        // The block's key rows as bf16 (`avx512bf16`, keys along): a bf16 cache's rows
        // where they lie, the others dequantised into `kb`.
        let mut krows: [&[u16]; BLOCK] = [&[]; BLOCK];
        if exact {
            for ((r, &(src, slot)), row) in
                krows.iter_mut().zip(block).zip(kb.chunks_exact_mut(dqk))
            {
                let s = &sources[src as usize];
                *r = match cache_row_bf16(s.layout, s.cache, slot, dqk) {
                    Some(r) => r,
                    None => {
                        exact &= load_row_bf16(isa, s.layout, s.cache, slot, row);
                        row
                    }
                };
            }
        }
        if along && exact {
            let first = b == 0;
            let bufs = AlongBufs {
                qt,
                kt,
                s: p,
                vd,
                o,
            };
            along_block(
                isa,
                d,
                &krows[..n],
                bufs,
                (m, sum, corr),
                first,
                fetch_share,
            );
            continue;
        }
        if !exact {
            if !have_qt {
                build_qt(k, qt);
                have_qt = true;
            }
            for (j, &(src, slot)) in block.iter().enumerate() {
                let s = &sources[src as usize];
                load_row(isa, s.layout, s.cache, slot, &mut k[j * dqk..(j + 1) * dqk]);
            }
        }
        // Sᵀ[keys × hc] = K[keys × d_qk] · Qᵀ, in chunks of SUB keys, each after the
        // prefetch of its share of the next block's keys (the rows of a chunk change no bit).
        let chunks = n.div_ceil(SUB);
        for c in 0..chunks {
            fetch_share(c, chunks);
            let (s0, rows) = (c * SUB, SUB.min(n - c * SUB));
            if exact {
                let dims = PairDims {
                    m: rows,
                    n: hc,
                    k2: dqk / 2,
                    lda: dqk,
                    ldb: hcp,
                    ldc: hcp,
                };
                let rows = &krows[s0..s0 + rows];
                gemm_bf16_gathered_into(isa, dims, rows, qp, &mut st[s0 * hcp..]);
            } else {
                let dims = Dims {
                    m: rows,
                    n: hc,
                    k: dqk,
                    lda: dqk,
                    ldb: hc,
                    ldc: hcp,
                };
                gemm_pairs_into(isa, dims, &k[s0 * dqk..], qt, &mut st[s0 * hcp..]);
            }
        }
        // The online softmax over the block's keys, on Sᵀ as it is (a key's heads side by
        // side, whole vectors of heads). The pad heads, never written by the GEMMs, are
        // zeroed first: the softmax runs on them too, on values that stay in range.
        let st = &mut st[..n * hcp];
        if hc < hcp {
            for row in st.chunks_exact_mut(hcp) {
                row[hc..].fill(0.0);
            }
        }
        softmax_block(st, hcp, d.scale, (m, sum, corr));
        // The first block writes O (its GEMM's chains start from +0: the bits of a zeroed O
        // rescaled by `exp(-inf) = 0`); later ones rescale it where the max moved (`x · 1 =
        // x` otherwise) and add to it.
        let first = b == 0;
        if !first {
            rescale(o, dv, &corr[..hc]);
        }
        // O += P · V, V = the first d_v columns of K.
        if exact {
            // P as bf16 pairs of keys, pair-major (a pair's heads adjacent); for an odd
            // block the pad key's probability is zero, as is V's pad row.
            for (pr, keys) in pb.chunks_exact_mut(hcp).zip(st.chunks(2 * hcp)) {
                let (lo, hi) = keys.split_at(hcp);
                bf16_pairs(lo, hi, pr);
            }
            for (jp, row) in vp.chunks_exact_mut(ldv).take(n.div_ceil(2)).enumerate() {
                let lo = &krows[2 * jp][..dv];
                if 2 * jp + 1 < n {
                    let hi = &krows[2 * jp + 1][..dv];
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
                lda: hcp,
                ldb: ldv,
                ldc: dv,
            };
            if first {
                gemm_bf16_pair_major_into(isa, dims, pb, vp, o);
            } else {
                gemm_bf16_pair_major(isa, dims, pb, vp, o);
            }
        } else {
            // P rounded to bf16 values, then as rows of heads for the f32 GEMM.
            for x in st.iter_mut() {
                *x = bf16_daz(round_bf16_daz(*x));
            }
            transpose(isa, n, hc, st, hcp, p, BLOCK);
            let dims = Dims {
                m: hc,
                n: dv,
                k: n,
                lda: BLOCK,
                ldb: dqk,
                ldc: dv,
            };
            if first {
                gemm_pairs_into(isa, dims, p, k, o);
            } else {
                gemm_acc_pairs(isa, dims, p, k, o);
            }
        }
    }
}

/// The working buffers of [`along_block`].
struct AlongBufs<'a> {
    qt: &'a [f32],
    kt: &'a mut [u32],
    s: &'a mut [f32],
    vd: &'a mut [u16],
    o: &'a mut [f32],
}

/// One block of the keys-along route: `Kᵀ` as bf16 pairs from the key rows `krows` (bf16
/// values), `S = Q · Kᵀ` in chunks of [`SUB`] keys (each after `ahead(chunk, chunks)`, the
/// prefetch of its share of the next keys), the online softmax on `S`'s rows, `P` rounded
/// to bf16 in place, then `O (+)= P · V` on V's bf16 rows (where they lie, or flushed copies
/// when the block holds a subnormal). The same operations per element as the f32 route.
#[inline(always)]
fn along_block(
    isa: CpuIsa,
    d: AttnDims,
    krows: &[&[u16]],
    bufs: AlongBufs<'_>,
    (m, sum, corr): (&mut [f32], &mut [f32], &mut [f32]),
    first: bool,
    ahead: impl Fn(usize, usize),
) {
    let AttnDims { dqk, dv, hc, .. } = d;
    let AlongBufs { qt, kt, s, vd, o } = bufs;
    let n = krows.len();
    let k2 = dqk / 2;
    let cols = n.div_ceil(16) * 16;
    let subnormal = pair_rows_daz(isa, krows, k2, kt, BLOCK);
    let chunks = cols.div_ceil(SUB);
    for c in 0..chunks {
        ahead(c, chunks);
        let j0 = c * SUB;
        along::scores_into(
            isa,
            (qt, hc, hc),
            (kt, BLOCK, k2),
            (j0, SUB.min(cols - j0)),
            s,
        );
    }
    softmax_rows(s, hc, n, d.scale, (m, sum, corr));
    for row in s.chunks_exact_mut(BLOCK).take(hc) {
        for x in &mut row[..n] {
            *x = bf16_daz(round_bf16_daz(*x));
        }
    }
    if !first {
        rescale(o, dv, &corr[..hc]);
    }
    let mut flushed: [&[u16]; BLOCK] = [&[]; BLOCK];
    let vrows: &[&[u16]] = if subnormal {
        for ((f, row), r) in flushed.iter_mut().zip(vd.chunks_exact_mut(dv)).zip(krows) {
            for (x, &b) in row.iter_mut().zip(&r[..dv]) {
                *x = bf16_bits_daz(b).0;
            }
            *f = row;
        }
        &flushed[..n]
    } else {
        krows
    };
    along::pv(isa, (s, hc), vrows, dv, &mut o[..hc * dv], first);
}

/// [`softmax_block`] on `S` with the keys along its rows (`hc` rows of [`BLOCK`], keys
/// `0..n`): per head the same operations (key `j` into lane `j % 16`, in key order, then
/// the pairwise tree), so the same bits.
#[inline(always)]
fn softmax_rows(
    s: &mut [f32],
    hc: usize,
    n: usize,
    scale: f32,
    (m, sum, corr): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let full = n / LANES * LANES;
    for (h, row) in s.chunks_exact_mut(BLOCK).take(hc).enumerate() {
        let row = &mut row[..n];
        let mut acc = [f32::NEG_INFINITY; LANES];
        for g in row[..full].chunks_exact_mut(LANES) {
            for (x, a) in g.iter_mut().zip(&mut acc) {
                *x *= scale;
                *a = a.max(*x);
            }
        }
        for (x, a) in row[full..].iter_mut().zip(&mut acc) {
            *x *= scale;
            *a = a.max(*x);
        }
        let mx = new_max(tree(acc, f32::max), m[h]);
        let mut acc = [0f32; LANES];
        for g in row[..full].chunks_exact_mut(LANES) {
            for (x, a) in g.iter_mut().zip(&mut acc) {
                *x = exp_lanes(*x - mx);
                *a += *x;
            }
        }
        for (x, a) in row[full..].iter_mut().zip(&mut acc) {
            *x = exp_lanes(*x - mx);
            *a += *x;
        }
        let bsum = tree(acc, |a, b| a + b);
        (m[h], sum[h], corr[h]) = fold_block(m[h], sum[h], mx, bsum);
    }
}

/// `O *= c` row by row (`O`'s rows `dv` apart, one factor a head), where the running max
/// moved (`x · 1 = x` otherwise).
#[inline(always)]
fn rescale(o: &mut [f32], dv: usize, corr: &[f32]) {
    for (orow, &c) in o.chunks_exact_mut(dv).zip(corr) {
        if c != 1.0 {
            for x in orow {
                *x *= c;
            }
        }
    }
}

/// A head's new running max from its block's max `block` and the old one `m` (±0 read as
/// +0).
#[inline(always)]
fn new_max(block: f32, m: f32) -> f32 {
    block.max(m) + 0.0
}

/// A head's running state after a block: from the old max `m` and sum `sum`, the new max
/// `mx` and the block's sum of `exp(s − mx)`: `(mx, sum · c + bsum, c)` with `c = exp(m −
/// mx)`, the factor `O` is rescaled by.
#[inline(always)]
fn fold_block(m: f32, sum: f32, mx: f32, bsum: f32) -> (f32, f32, f32) {
    let c = exp_lanes(m - mx);
    (mx, sum * c + bsum, c)
}

/// `dst[i] = bf16(o[i] · inv · factor)`: two f32 products in that order, then
/// [`super::dot::round_bf16`] (as `half::bf16::from_f32`), by [`scaled_bf16_row`].
pub(crate) fn scaled_to_bf16(isa: CpuIsa, o: &[f32], inv: f32, factor: f32, dst: &mut [bf16]) {
    scaled_bf16_row(isa, o, inv, factor, bytemuck::cast_slice_mut(dst));
}

/// Lanes of the softmax's reductions: a fixed structure, so every path (whatever its vector
/// width) does the same operations.
const LANES: usize = 16;

/// The online softmax of one block, in place on its scores `st` (`Sᵀ`: the block's keys,
/// each a row of `hcp` heads, a multiple of 16). Per head `h`: `x·scale`, the new running
/// max `m' = max(m, max x)` (±0 read as +0), then `exp(x − m')`; the block's sum of the
/// exponentials in [`LANES`] lanes (key `j` into lane `j % 16`, in key order) then a fixed
/// pairwise tree (16 → 8 → 4 → 2 → 1); `sum ← sum · c + block sum` and `m ← m'`, where
/// `c = exp(m − m')` is left in `corr[h]` (the caller rescales `O` by it). Each head's
/// operations are those of a scalar loop over its keys, whatever the vector width.
///
/// Written for the compiler's vectoriser: 16 heads at a time, the lanes' partials in a
/// local array (a slice there could alias `st`, and the per-head loop would stay scalar).
#[inline(always)]
fn softmax_block(
    st: &mut [f32],
    hcp: usize,
    scale: f32,
    (m, sum, corr): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let n = st.len() / hcp;
    // Key `j`'s lane is `j % 16`: a group of 16 keys feeds every lane once, and the lane
    // index of a full group is a constant once the loop is unrolled (the partials stay in
    // registers); the last, partial group indexes them at run time.
    let full = n / LANES * LANES;
    for h0 in (0..hcp).step_by(H) {
        let mut acc = [[f32::NEG_INFINITY; H]; LANES];
        for g in (0..full).step_by(LANES) {
            for (l, a) in acc.iter_mut().enumerate() {
                scale_max(&mut st[(g + l) * hcp + h0..][..H], scale, a);
            }
        }
        for j in full..n {
            scale_max(&mut st[j * hcp + h0..][..H], scale, &mut acc[j - full]);
        }
        let mut mx = tree16(acc, f32::max);
        for (x, &mo) in mx.iter_mut().zip(&m[h0..h0 + H]) {
            *x = new_max(*x, mo);
        }
        let mut acc = [[0f32; H]; LANES];
        for g in (0..full).step_by(LANES) {
            for (l, a) in acc.iter_mut().enumerate() {
                exp_sum(&mut st[(g + l) * hcp + h0..][..H], &mx, a);
            }
        }
        for j in full..n {
            exp_sum(&mut st[j * hcp + h0..][..H], &mx, &mut acc[j - full]);
        }
        let bsum = tree16(acc, |a, b| a + b);
        for h in 0..H {
            let i = h0 + h;
            (m[i], sum[i], corr[i]) = fold_block(m[i], sum[i], mx[h], bsum[h]);
        }
    }
}

/// Heads a step of [`softmax_block`] covers.
const H: usize = 16;

/// One key's 16 heads: `x·scale` in place, and the running max of its lane.
#[inline(always)]
fn scale_max(row: &mut [f32], scale: f32, acc: &mut [f32; H]) {
    let mut x = [0f32; H];
    x.copy_from_slice(row);
    for (x, a) in x.iter_mut().zip(acc) {
        *x *= scale;
        *a = a.max(*x);
    }
    row.copy_from_slice(&x);
}

/// One key's 16 heads: `exp(x − m)` in place, added to its lane's sums.
#[inline(always)]
fn exp_sum(row: &mut [f32], m: &[f32; H], acc: &mut [f32; H]) {
    let mut x = [0f32; H];
    x.copy_from_slice(row);
    for ((x, a), &mm) in x.iter_mut().zip(acc).zip(m) {
        *x = exp_lanes(*x - mm);
        *a += *x;
    }
    row.copy_from_slice(&x);
}

/// `f` over [`LANES`] values as a pairwise tree (value `i` takes `f(value i, value i +
/// half)`, half = 8, 4, 2, 1): the softmax's fixed reduction order.
#[inline(always)]
fn tree<T: Copy>(mut a: [T; LANES], f: impl Fn(T, T) -> T) -> T {
    let mut half = LANES;
    while half > 1 {
        half /= 2;
        for i in 0..half {
            a[i] = f(a[i], a[i + half]);
        }
    }
    a[0]
}

/// [`tree`] per column of [`LANES`] rows of [`H`] columns (the same pairs, written on the
/// rows in place: through [`tree`]'s by-value arrays the V3.2 shapes measured 3–5% slower):
/// each column's result.
#[inline(always)]
fn tree16(mut a: [[f32; H]; LANES], f: impl Fn(f32, f32) -> f32) -> [f32; H] {
    let mut half = LANES;
    while half > 1 {
        half /= 2;
        for i in 0..half {
            let hi = a[i + half];
            for (x, &y) in a[i].iter_mut().zip(&hi) {
                *x = f(*x, y);
            }
        }
    }
    a[0]
}

/// `out[h] = bf16(lo[h]) | bf16(hi[h]) << 16` (each rounded, subnormals flushed); `hi`
/// empty: the pad key, zero. Whole vectors of 16 heads (`out.len()` a multiple of 16).
#[inline(always)]
fn bf16_pairs(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    const ZEROS: [f32; 16] = [0.0; 16];
    for (v, o) in out.chunks_exact_mut(16).enumerate() {
        // Fixed-size copies in and out: the loop below then has a constant trip count and
        // no operand the compiler must suspect of aliasing `out` (with a chain of slices
        // it kept a runtime-length loop, whose scalar stores the vector copy then waited
        // on).
        let mut l = [0f32; 16];
        l.copy_from_slice(&lo[16 * v..][..16]);
        let h = match hi.get(16 * v..16 * v + 16) {
            Some(h) => {
                let mut a = [0f32; 16];
                a.copy_from_slice(h);
                a
            }
            None => ZEROS,
        };
        let mut x = [0u32; 16];
        for i in 0..16 {
            x[i] = round_bf16_daz(l[i]) as u32 | (round_bf16_daz(h[i]) as u32) << 16;
        }
        o.copy_from_slice(&x);
    }
}

/// `exp(x)`: the bits of [`sparsekit_kernels::math::exp_portable`] (correctly rounded f32
/// operations only, so the same on every path and backend), written with selects instead
/// of branches so that it vectorises.
#[inline(always)]
pub(crate) fn exp_lanes(x: f32) -> f32 {
    use sparsekit_kernels::math::LOG2_E;
    const SHIFTER: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // The arithmetic below always sees a number in range: NaN and everything whose result
    // is 0 (below -103.98: the first block's `exp(-inf - m)`, a `-inf` score) as 0, so that
    // no lane's product turns subnormal (on Intel cores a subnormal result costs a
    // microcode assist of about a hundred cycles); the selects at the end decide those
    // lanes.
    let xc = if x >= -103.98 { x.min(89.0) } else { 0.0 };
    let t = xc * LOG2_E + SHIFTER;
    let n = t - SHIFTER;
    let r = (-n).mul_add(LN2_HI, xc);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p: f32 = 1.0 / 5040.0;
    p = p.mul_add(r, 1.0 / 720.0);
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // `n` as an integer: |n| ≤ 150 sits in the low mantissa bits of `t` (an integer-valued
    // float of exponent 23): `n as i32` without a float-to-int conversion. The integer
    // operations cannot overflow at these magnitudes; written as wrapping ones so that
    // builds with overflow checks (the tests') still vectorise the loop.
    let n = (t.to_bits() as i32).wrapping_sub(SHIFTER.to_bits() as i32);
    let half = n / 2;
    let pow2 = |e: i32| f32::from_bits((e.wrapping_add(127) as u32) << 23);
    let v = p * pow2(half) * pow2(n.wrapping_sub(half));
    let v = if x < -103.98 { 0.0 } else { v };
    let v = if x > 88.73 { f32::INFINITY } else { v };
    if x.is_nan() {
        x
    } else {
        v
    }
}

/// Dequantises the token at `slot` into one f32 row `[latent | rope]` (every KV layout),
/// subnormals flushed as the bf16 dot product reads them.
#[inline(always)]
pub(crate) fn load_row(isa: CpuIsa, l: &KvLayout, cache: &[u8], slot: usize, row: &mut [f32]) {
    let tok = &cache[l.slot_token_bytes(slot)];
    let dv = l.nope_dim();
    let (vrow, rope) = row.split_at_mut(dv);
    match l.dtype() {
        KvDtype::Bf16 | KvDtype::Bf16x512 => widen::bf16_f32_row(isa, &tok[l.nope_range()], vrow),
        KvDtype::Fp8DsMla => {
            let sc = &tok[l.scales_range()];
            for (t, (xs, codes)) in vrow
                .chunks_exact_mut(FP8_DS_MLA_TILE)
                .zip(tok[l.nope_range()].chunks_exact(FP8_DS_MLA_TILE))
                .enumerate()
            {
                let s =
                    f32::from_le_bytes([sc[4 * t], sc[4 * t + 1], sc[4 * t + 2], sc[4 * t + 3]]);
                scale_tile(isa, codes, s, xs);
            }
        }
        KvDtype::Model1Fp8 => {
            let sc = &cache[l.slot_tile_scale_bytes(slot)];
            for ((xs, codes), &b) in vrow
                .chunks_exact_mut(MODEL1_TILE)
                .zip(tok[l.nope_range()].chunks_exact(MODEL1_TILE))
                .zip(sc)
            {
                scale_tile(isa, codes, ue8m0_to_f32(b), xs);
            }
        }
    }
    widen::bf16_f32_row(isa, &tok[l.rope_range()], rope);
}

/// One e4m3 tile times its scale `s` into `xs`: `f32_daz(e4m3_f32(c) · s)` per code (the
/// codes widened by [`widen::e4m3_f32_row`], then scaled and flushed in place).
#[inline(always)]
fn scale_tile(isa: CpuIsa, codes: &[u8], s: f32, xs: &mut [f32]) {
    widen::e4m3_f32_row(isa, codes, xs);
    for x in xs.iter_mut() {
        *x = f32_daz(*x * s);
    }
}

/// `k` when `s = 2^k` is a normal power of two (the tile scales our stores write), so
/// that a tile widens by [`widen::e4m3_row_pow2`] (every product is then a bf16 value).
#[inline(always)]
fn pow2_exponent(s: f32) -> Option<i32> {
    let b = s.to_bits();
    let e = (b >> 23) as i32;
    (b & 0x807f_ffff == 0 && (1..=254).contains(&e)).then_some(e - 127)
}

/// One e4m3 tile times its scale `s` as bf16 bits into `xs`, subnormals flushed; returns
/// the or of the products' low 16 bits (nonzero: some product is not a bf16 value). A
/// power-of-two scale widens by [`widen::e4m3_row_pow2`] (always exact).
#[inline(always)]
fn tile_bf16(isa: CpuIsa, codes: &[u8], s: f32, xs: &mut [u16]) -> u32 {
    if let Some(k) = pow2_exponent(s) {
        widen::e4m3_row_pow2(isa, codes, k, xs);
        return 0;
    }
    let mut low = 0u32;
    for (x, &c) in xs.iter_mut().zip(codes) {
        let v = f32_daz(e4m3_f32(c) * s);
        low |= v.to_bits() & 0xffff;
        *x = (v.to_bits() >> 16) as u16;
    }
    low
}

/// The token at `slot` as the bf16 row `[latent | rope]` of `dqk` values where it lies in
/// the cache: a bf16 layout's row, if its bytes are 2-byte aligned; `None` otherwise
/// (copy it with [`load_row_bf16`]).
#[inline(always)]
fn cache_row_bf16<'c>(l: &KvLayout, cache: &'c [u8], slot: usize, dqk: usize) -> Option<&'c [u16]> {
    match l.dtype() {
        KvDtype::Bf16 | KvDtype::Bf16x512 => {
            let tok = &cache[l.slot_token_bytes(slot)];
            bytemuck::try_cast_slice(&tok[..2 * dqk]).ok()
        }
        KvDtype::Fp8DsMla | KvDtype::Model1Fp8 => None,
    }
}

/// [`load_row`] as bf16 bits; whether every value is exactly a bf16 value (else the row
/// is unusable and the block runs [`load_row`]'s f32 rows).
#[inline(always)]
fn load_row_bf16(isa: CpuIsa, l: &KvLayout, cache: &[u8], slot: usize, row: &mut [u16]) -> bool {
    let tok = &cache[l.slot_token_bytes(slot)];
    let dv = l.nope_dim();
    let (vrow, rope) = row.split_at_mut(dv);
    let mut low = 0u32;
    match l.dtype() {
        KvDtype::Bf16 | KvDtype::Bf16x512 => {
            // The latent and rope values are adjacent: one copy of the row's bytes.
            let row: &mut [u8] = bytemuck::cast_slice_mut(row);
            let n = row.len();
            row.copy_from_slice(&tok[..n]);
            return true;
        }
        KvDtype::Fp8DsMla => {
            let sc = &tok[l.scales_range()];
            let scale = |t: usize| {
                f32::from_le_bytes([sc[4 * t], sc[4 * t + 1], sc[4 * t + 2], sc[4 * t + 3]])
            };
            let exponent = |t| pow2_exponent(scale(t));
            if pow2_tiles(isa, &tok[l.nope_range()], FP8_DS_MLA_TILE, exponent, vrow) {
                rope_row(tok, l, rope);
                return true;
            }
            for (t, (xs, codes)) in vrow
                .chunks_exact_mut(FP8_DS_MLA_TILE)
                .zip(tok[l.nope_range()].chunks_exact(FP8_DS_MLA_TILE))
                .enumerate()
            {
                low |= tile_bf16(isa, codes, scale(t), xs);
            }
        }
        KvDtype::Model1Fp8 => {
            // e4m3 × a power of two (or NaN): always a bf16 value.
            let sc = &cache[l.slot_tile_scale_bytes(slot)];
            let exponent = |t: usize| pow2_exponent(ue8m0_to_f32(sc[t]));
            if pow2_tiles(isa, &tok[l.nope_range()], MODEL1_TILE, exponent, vrow) {
                rope_row(tok, l, rope);
                return true;
            }
            for ((xs, codes), &b) in vrow
                .chunks_exact_mut(MODEL1_TILE)
                .zip(tok[l.nope_range()].chunks_exact(MODEL1_TILE))
                .zip(sc)
            {
                let s = ue8m0_to_f32(b);
                low |= tile_bf16(isa, codes, s, xs);
            }
        }
    }
    rope_row(tok, l, rope);
    low == 0
}

/// The rope part of a cache row `tok` (bf16 in every layout) into `rope`.
#[inline(always)]
fn rope_row(tok: &[u8], l: &KvLayout, rope: &mut [u16]) {
    for (x, b) in rope.iter_mut().zip(tok[l.rope_range()].chunks_exact(2)) {
        *x = u16::from_le_bytes([b[0], b[1]]);
    }
}

/// Most tiles in a cache row's latent part ([`pow2_tiles`]' exponents on the stack).
const MAX_TILES: usize = 16;

/// A row's latent tiles of `tile` codes in one [`widen::e4m3_tiles_pow2`] call when every
/// tile's scale is a normal power of two `2^exponent(t)`, widening into `out`; false
/// (nothing written) otherwise, for the caller's tile-by-tile route.
#[inline(always)]
fn pow2_tiles(
    isa: CpuIsa,
    codes: &[u8],
    tile: usize,
    exponent: impl Fn(usize) -> Option<i32>,
    out: &mut [u16],
) -> bool {
    let nt = out.len() / tile;
    let mut ks = [0i32; MAX_TILES];
    if nt > MAX_TILES || nt * tile != out.len() {
        return false;
    }
    for (t, k) in ks[..nt].iter_mut().enumerate() {
        match exponent(t) {
            Some(e) => *k = e,
            None => return false,
        }
    }
    widen::e4m3_tiles_pow2(isa, codes, tile, &ks[..nt], out);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp_lanes` gives `exp_portable`'s bits everywhere, edges included.
    #[test]
    fn exp_lanes_is_exp_portable() {
        use sparsekit_kernels::math::exp_portable;
        let mut x = -120.0f32;
        while x < 100.0 {
            for y in [x, -x, x + 1e-3] {
                assert_eq!(exp_lanes(y).to_bits(), exp_portable(y).to_bits(), "{y}");
            }
            x += 0.0137;
        }
        for y in [
            0.0,
            -0.0,
            88.73,
            88.7301,
            -103.98,
            -103.9801,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            1e-30,
        ] {
            assert_eq!(exp_lanes(y).to_bits(), exp_portable(y).to_bits(), "{y}");
        }
        assert!(exp_lanes(f32::NAN).is_nan());
    }
}
