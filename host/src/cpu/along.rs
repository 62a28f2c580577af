//! The attention's two GEMMs on the f32 paths with the keys along the vector lanes, for a
//! few query heads ([`super::attend`]'s keys-along route).
//!
//! With 8 heads or fewer, `Sᵀ = K · Qᵀ` has one 256-bit vector of heads per key: on cores
//! whose 512-bit FMAs do twice the work ([`super::peak::wide_fma`]) its tiles run at half
//! the path's peak, broadcasting every key element from a block of keys widened to f32.
//! Here the keys stay bf16 pairs and fill whole 512-bit vectors:
//! - [`scores_into`]: `S = Q · Kᵀ` (heads × keys) from `Qᵀ` in f32 and `Kᵀ` as 32-bit pairs
//!   of bf16 (keys along the columns, [`super::transpose::pair_rows_daz`]); each pair is
//!   widened in registers (a shift and a mask: bf16 bits are the high half of an f32) and
//!   feeds every head of the tile;
//! - [`pv`]: `O (+)= P · V` from the probabilities in f32 and V's bf16 rows where they lie,
//!   32 columns a load (even and odd columns as two vectors, interleaved again on the
//!   store).
//!
//! Both run the bf16 dot-product order of [`super::dot`] on values that are bf16 values
//! (subnormals flushed by the caller): over the contraction index, pairs `(0, 1), (2, 3),
//! …`, odd member first, an odd length's last index after a `+0`. Each element's
//! operations are those of [`super::gemm::gemm_pairs_into`] and
//! [`super::gemm::gemm_acc_pairs`], so every path gives the same bits whichever route it
//! takes. AVX-512 register tiles on the AVX-512 paths, element by element elsewhere.

use super::isa::CpuIsa;

/// Row stride (elements) of `S` and `P`: the attention's key block.
pub(crate) const LDS: usize = super::attend::BLOCK;

/// `S[h][j] = Σ_p Qᵀ[p][h] · K[j][p]` in pair order from `+0`, for heads `h < hc` and keys
/// `j` in `j0..j0 + n`: `qt` is `Qᵀ` (`2·k2` rows of `ldq ≥ hc` f32, bf16 values), `kt` is
/// `Kᵀ` as pairs (`k2` rows of `ldk` words: word `(p, j)` holds `K[j][2p]` low and
/// `K[j][2p + 1]` high, subnormals flushed), `s` rows [`LDS`] apart. On the AVX-512 paths
/// `j0` and `n` must be multiples of 16 (tiles of up to 16 heads × 16 keys). Panics if a
/// slice is too short.
pub(crate) fn scores_into(
    isa: CpuIsa,
    (qt, ldq, hc): (&[f32], usize, usize),
    (kt, ldk, k2): (&[u32], usize, usize),
    (j0, n): (usize, usize),
    s: &mut [f32],
) {
    if hc == 0 || n == 0 {
        return;
    }
    assert!(ldq >= hc && ldk >= j0 + n && n <= LDS && j0 + n <= LDS);
    assert!(
        k2 == 0 || (qt.len() >= (2 * k2 - 1) * ldq + hc && kt.len() >= (k2 - 1) * ldk + j0 + n)
    );
    assert!(s.len() >= (hc - 1) * LDS + j0 + n);
    #[cfg(target_arch = "x86_64")]
    if isa.isa().avx512() && j0 % 16 == 0 && n % 16 == 0 {
        // SAFETY: the path's CpuIsa exists only on a CPU with AVX-512F (`Isa::supported`);
        // the slices hold the views (asserted above), the columns are whole vectors.
        unsafe { x86::scores(qt, ldq, hc, kt, ldk, k2, j0, n, s) };
        return;
    }
    let _ = isa;
    for h in 0..hc {
        for j in j0..j0 + n {
            let mut x = 0f32;
            for p in 0..k2 {
                let w = kt[p * ldk + j];
                x = qt[(2 * p + 1) * ldq + h].mul_add(f32::from_bits(w & 0xffff_0000), x);
                x = qt[2 * p * ldq + h].mul_add(f32::from_bits(w << 16), x);
            }
            s[h * LDS + j] = x;
        }
    }
}

/// `O[h][c] = Σ_j P[h][j] · V_j[c]` (or `+=`, when `into` is false) in pair order over the
/// keys `j < vrows.len()`, for heads `h < hc` and columns `c < dv`: `p` rows [`LDS`] apart
/// (bf16 values), `vrows[j]` key `j`'s bf16 row (its first `dv` elements are V; subnormals
/// already flushed), `o` rows `dv` apart. On the AVX-512 paths with `dv` a multiple of 32,
/// tiles of 8 heads × 32 columns (then 4, 2, 1 heads). Panics if a slice is too short.
pub(crate) fn pv(
    isa: CpuIsa,
    (p, hc): (&[f32], usize),
    vrows: &[&[u16]],
    dv: usize,
    o: &mut [f32],
    into: bool,
) {
    let n = vrows.len();
    if hc == 0 || dv == 0 {
        return;
    }
    assert!(n <= LDS && (n == 0 || p.len() >= (hc - 1) * LDS + n));
    assert!(vrows.iter().all(|r| r.len() >= dv) && o.len() >= hc * dv);
    #[cfg(target_arch = "x86_64")]
    if isa.isa().avx512() && dv % 32 == 0 {
        // SAFETY: the path's CpuIsa exists only on a CPU with AVX-512F (`Isa::supported`);
        // the slices hold the views (asserted above), `dv` is whole tiles of 32.
        unsafe { x86::pv(p, hc, vrows, dv, o, into) };
        return;
    }
    let _ = isa;
    let v = |j: usize, c: usize| f32::from_bits((vrows[j][c] as u32) << 16);
    for h in 0..hc {
        let ph = &p[h * LDS..];
        for c in 0..dv {
            let mut x = if into { 0.0 } else { o[h * dv + c] };
            for t in 0..n / 2 {
                x = ph[2 * t + 1].mul_add(v(2 * t + 1, c), x);
                x = ph[2 * t].mul_add(v(2 * t, c), x);
            }
            if n % 2 == 1 {
                x = ph[n - 1].mul_add(v(n - 1, c), x + 0.0);
            }
            o[h * dv + c] = x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 intrinsics need Rust 1.89, as the AVX-512 target features already do"
)]
mod x86 {
    use std::arch::x86_64::*;

    use super::LDS;
    use crate::cpu::raw;

    /// [`super::scores_into`]'s tiles: 16 heads (then 8, 4, 2, 1) × 16 keys.
    ///
    /// # Safety
    /// AVX-512F; the views of [`super::scores_into`], `j0` and `n` multiples of 16.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores(
        qt: &[f32],
        ldq: usize,
        hc: usize,
        kt: &[u32],
        ldk: usize,
        k2: usize,
        j0: usize,
        n: usize,
        s: &mut [f32],
    ) {
        let (q, k, s) = (qt.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
        for j in (j0..j0 + n).step_by(16) {
            let mut h = 0;
            while h < hc {
                let r = hc - h;
                // SAFETY: heads `h..h + R ≤ hc`, keys `j..j + 16 ≤ j0 + n`: inside the views.
                unsafe {
                    let (q, k, s) = (q.add(h), k.add(j), s.add(h * LDS + j));
                    h += match r {
                        16.. => scores_tile::<16>(q, ldq, k, ldk, k2, s),
                        8.. => scores_tile::<8>(q, ldq, k, ldk, k2, s),
                        4.. => scores_tile::<4>(q, ldq, k, ldk, k2, s),
                        2.. => scores_tile::<2>(q, ldq, k, ldk, k2, s),
                        _ => scores_tile::<1>(q, ldq, k, ldk, k2, s),
                    };
                }
            }
        }
    }

    /// One tile of [`scores`]: `R` heads from `q` (Qᵀ's column of the first) × the 16 keys
    /// from `k` (Kᵀ's column of the first) into `s`; per pair, one load of 16 keys' words,
    /// their two halves as f32, and `2·R` FMAs broadcasting Q from memory. Returns `R`.
    ///
    /// # Safety
    /// AVX-512F; `q` holds `2·k2` rows of `ldq` with `R` heads, `k` `k2` rows of `ldk` with
    /// 16 words, `s` `R` rows of [`LDS`] with 16 values.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn scores_tile<const R: usize>(
        q: *const f32,
        ldq: usize,
        k: *const u32,
        ldk: usize,
        k2: usize,
        s: *mut f32,
    ) -> usize {
        let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
        let mut acc = [_mm512_setzero_ps(); R];
        // SAFETY: the caller's contract; reads through [`raw`] (see its docs).
        unsafe {
            for p in 0..k2 {
                let w = raw::read::<__m512i>(k.add(p * ldk).cast());
                let odd = _mm512_castsi512_ps(_mm512_and_si512(w, high));
                let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
                // The odd member of the pair first, for every head.
                let a = q.add((2 * p + 1) * ldq);
                for (r, x) in acc.iter_mut().enumerate() {
                    *x = _mm512_fmadd_ps(_mm512_set1_ps(raw::read(a.add(r))), odd, *x);
                }
                let a = q.add(2 * p * ldq);
                for (r, x) in acc.iter_mut().enumerate() {
                    *x = _mm512_fmadd_ps(_mm512_set1_ps(raw::read(a.add(r))), even, *x);
                }
            }
            for (r, x) in acc.iter().enumerate() {
                raw::write::<__m512>(s.add(r * LDS).cast(), *x);
            }
        }
        R
    }

    /// [`super::pv`]'s tiles: 8 heads (then 4, 2, 1) × 32 columns.
    ///
    /// # Safety
    /// AVX-512F; the views of [`super::pv`], `dv` a multiple of 32.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pv(
        p: &[f32],
        hc: usize,
        vrows: &[&[u16]],
        dv: usize,
        o: &mut [f32],
        into: bool,
    ) {
        let (pp, op) = (p.as_ptr(), o.as_mut_ptr());
        let mut h = 0;
        while h < hc {
            let r = hc - h;
            for c in (0..dv).step_by(32) {
                // SAFETY: heads `h..h + R ≤ hc`, columns `c..c + 32 ≤ dv`: inside the views.
                unsafe {
                    let (p, o) = (pp.add(h * LDS), op.add(h * dv + c));
                    match r {
                        8.. => pv_tile::<8>(p, vrows, c, o, dv, into),
                        4.. => pv_tile::<4>(p, vrows, c, o, dv, into),
                        2.. => pv_tile::<2>(p, vrows, c, o, dv, into),
                        _ => pv_tile::<1>(p, vrows, c, o, dv, into),
                    };
                }
            }
            h += match r {
                8.. => 8,
                4.. => 4,
                2.. => 2,
                _ => 1,
            };
        }
    }

    /// One tile of [`pv`]: `R` heads from `p` × the 32 columns from `c` of every key's V row
    /// into `o` (rows `ldo` apart). Per key one load of 32 bf16, its even and odd columns as
    /// two f32 vectors, and `2·R` FMAs broadcasting P from memory; the accumulators hold
    /// even and odd columns apart, and are interleaved (and C split, when accumulating) by
    /// permutes once per tile.
    ///
    /// # Safety
    /// AVX-512F; `p` holds `R` rows of [`LDS`] with `vrows.len()` values, each row of
    /// `vrows` columns `c..c + 32`, `o` `R` rows of `ldo` with 32 values.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pv_tile<const R: usize>(
        p: *const f32,
        vrows: &[&[u16]],
        c: usize,
        o: *mut f32,
        ldo: usize,
        into: bool,
    ) {
        // Lane `i` of the even (odd) accumulator is column `2i` (`2i + 1`) of the tile.
        const TAKE_EVEN: [i32; 16] = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30];
        const TAKE_ODD: [i32; 16] = [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31];
        const FIRST: [i32; 16] = [0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23];
        const SECOND: [i32; 16] = [8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31];
        // SAFETY: each array is 64 readable bytes.
        let (take_even, take_odd, first_half, second_half) = unsafe {
            (
                raw::read::<__m512i>(TAKE_EVEN.as_ptr().cast()),
                raw::read::<__m512i>(TAKE_ODD.as_ptr().cast()),
                raw::read::<__m512i>(FIRST.as_ptr().cast()),
                raw::read::<__m512i>(SECOND.as_ptr().cast()),
            )
        };
        let mut even = [_mm512_setzero_ps(); R];
        let mut odd = [_mm512_setzero_ps(); R];
        // SAFETY: the caller's contract; reads and writes through [`raw`] (see its docs).
        unsafe {
            if !into {
                for r in 0..R {
                    let a = raw::read::<__m512>(o.add(r * ldo).cast());
                    let b = raw::read::<__m512>(o.add(r * ldo + 16).cast());
                    even[r] = _mm512_permutex2var_ps(a, take_even, b);
                    odd[r] = _mm512_permutex2var_ps(a, take_odd, b);
                }
            }
            let n = vrows.len();
            for t in 0..n / 2 {
                pv_key(p, vrows, c, 2 * t + 1, &mut even, &mut odd);
                pv_key(p, vrows, c, 2 * t, &mut even, &mut odd);
            }
            if n % 2 == 1 {
                // The missing partner's `+0`, then the last key.
                let zero = _mm512_setzero_ps();
                for r in 0..R {
                    even[r] = _mm512_add_ps(even[r], zero);
                    odd[r] = _mm512_add_ps(odd[r], zero);
                }
                pv_key(p, vrows, c, n - 1, &mut even, &mut odd);
            }
            for r in 0..R {
                let a = _mm512_permutex2var_ps(even[r], first_half, odd[r]);
                let b = _mm512_permutex2var_ps(even[r], second_half, odd[r]);
                raw::write::<__m512>(o.add(r * ldo).cast(), a);
                raw::write::<__m512>(o.add(r * ldo + 16).cast(), b);
            }
        }
    }
    /// Key `j` of a [`pv_tile`]: its 32 columns from `c` times `P[r][j]` into the tile's
    /// even and odd accumulators.
    ///
    /// # Safety
    /// AVX-512F; `vrows[j]` holds columns `c..c + 32`, `p` `R` rows of [`LDS`] past `j`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pv_key<const R: usize>(
        p: *const f32,
        vrows: &[&[u16]],
        c: usize,
        j: usize,
        even: &mut [__m512; R],
        odd: &mut [__m512; R],
    ) {
        let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
        // SAFETY: the caller's contract; reads through [`raw`] (see its docs).
        unsafe {
            let w = raw::read::<__m512i>(vrows[j].as_ptr().add(c).cast());
            let vo = _mm512_castsi512_ps(_mm512_and_si512(w, high));
            let ve = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
            for r in 0..R {
                let a = _mm512_set1_ps(raw::read(p.add(r * LDS + j)));
                even[r] = _mm512_fmadd_ps(a, ve, even[r]);
                odd[r] = _mm512_fmadd_ps(a, vo, odd[r]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::cpu::gemm::{gemm_acc_pairs, gemm_pairs_into, Dims};
    use crate::cpu::transpose::pair_rows_daz;

    /// A random bf16 value's bits (both signs, exponents ±20, some exact zeros).
    fn bf16_bits(rng: &mut impl Rng) -> u16 {
        if rng.gen_ratio(1, 50) {
            return if rng.gen() { 0x8000 } else { 0 };
        }
        let x: f32 = rng.gen_range(0.5f32..2.0) * 2f32.powi(rng.gen_range(-20..20));
        let x = if rng.gen() { -x } else { x };
        half::bf16::from_f32(x).to_bits()
    }

    fn widen(b: u16) -> f32 {
        crate::cpu::dot::bf16_daz(b)
    }

    /// Both GEMMs give the bits of the pair-order f32 GEMM on the widened operands, on every
    /// path, for 1–16 heads, odd key counts, into and accumulating, with `S` and `O` poisoned
    /// first; keys with subnormals are flushed by the pair transpose (and reported).
    #[test]
    fn keys_along_gemms_give_the_pair_order_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for (hc, n, dqk, dv) in [
            (16, 64, 288, 256),
            (16, 128, 576, 512),
            (1, 16, 32, 32),
            (3, 17, 64, 32),
            (8, 48, 96, 64),
            (13, 33, 288, 256),
            (16, 1, 32, 32),
            (5, 127, 128, 96),
        ] {
            let k2 = dqk / 2;
            let q: Vec<u16> = (0..hc * dqk).map(|_| bf16_bits(&mut rng)).collect();
            let mut keys: Vec<Vec<u16>> = (0..n)
                .map(|_| (0..dqk + 7).map(|_| bf16_bits(&mut rng)).collect())
                .collect();
            // A few subnormals, which the pair transpose flushes.
            let subnormal = rng.gen_bool(0.5);
            if subnormal {
                keys[n / 2][1] = 0x0003;
            }
            let rows: Vec<&[u16]> = keys.iter().map(|r| &r[..]).collect();
            // V rows as the caller hands them over: subnormals flushed.
            let flushed: Vec<Vec<u16>> = keys
                .iter()
                .map(|r| {
                    r.iter()
                        .map(|&b| widen(b).to_bits().wrapping_shr(16) as u16)
                        .collect()
                })
                .collect();
            let vrows: Vec<&[u16]> = flushed.iter().map(|r| &r[..]).collect();
            let qf: Vec<f32> = q.iter().map(|&b| widen(b)).collect();
            let kf: Vec<f32> = keys
                .iter()
                .flat_map(|r| r[..dqk].iter().map(|&b| widen(b)))
                .collect();
            let mut qt = vec![0f32; dqk * hc];
            for h in 0..hc {
                for d in 0..dqk {
                    qt[d * hc + h] = qf[h * dqk + d];
                }
            }
            // The reference: Sᵀ = K · Qᵀ through the pair-order GEMM (the old route).
            let scalar = CpuIsa::new(crate::cpu::isa::Isa::Scalar).unwrap();
            let mut st = vec![f32::NAN; n * hc];
            let dims = Dims {
                m: n,
                n: hc,
                k: dqk,
                lda: dqk,
                ldb: hc,
                ldc: hc,
            };
            gemm_pairs_into(scalar, dims, &kf, &qt, &mut st);
            let p: Vec<f32> = (0..hc * LDS)
                .map(|_| widen(bf16_bits(&mut rng)).abs())
                .collect();
            let o0: Vec<f32> = (0..hc * dv).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let dims = Dims {
                m: hc,
                n: dv,
                k: n,
                lda: LDS,
                ldb: dqk,
                ldc: dv,
            };
            let mut want_into = vec![f32::NAN; hc * dv];
            gemm_pairs_into(scalar, dims, &p, &kf, &mut want_into);
            let mut want_acc = o0.clone();
            gemm_acc_pairs(scalar, dims, &p, &kf, &mut want_acc);
            for isa in CpuIsa::available() {
                let cols = n.div_ceil(16) * 16;
                let mut kt = vec![0xdead_beef; k2 * cols];
                let sub = pair_rows_daz(isa, &rows, k2, &mut kt, cols);
                assert_eq!(sub, subnormal, "{isa:?}");
                let mut s = vec![f32::NAN; hc * LDS];
                scores_into(isa, (&qt, hc, hc), (&kt, cols, k2), (0, cols), &mut s);
                for h in 0..hc {
                    for j in 0..n {
                        assert_eq!(
                            s[h * LDS + j].to_bits(),
                            st[j * hc + h].to_bits(),
                            "{isa:?} S hc {hc} n {n} ({h}, {j})"
                        );
                    }
                }
                let mut o = vec![f32::NAN; hc * dv];
                pv(isa, (&p, hc), &vrows, dv, &mut o, true);
                let mut acc = o0.clone();
                pv(isa, (&p, hc), &vrows, dv, &mut acc, false);
                for i in 0..hc * dv {
                    assert_eq!(
                        o[i].to_bits(),
                        want_into[i].to_bits(),
                        "{isa:?} O= hc {hc} n {n} {i}"
                    );
                    assert_eq!(
                        acc[i].to_bits(),
                        want_acc[i].to_bits(),
                        "{isa:?} O+= hc {hc} n {n} {i}"
                    );
                }
            }
        }
    }
}
