//! What becomes of a register tile's rows of a product of at most 8 columns (one 256-bit
//! vector per row, as the few-head score GEMMs of [`crate::cpu::dot`] and
//! [`crate::cpu::gemm`] hold them on AVX-512): stored as rows of C, or reduced to each
//! row's weighted ReLU sum without being stored ([`ReluSums`]).

#![cfg(target_arch = "x86_64")]
#![allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]

use std::arch::x86_64::*;

/// The lanes of `n <= 8` columns.
#[inline(always)]
pub(in crate::cpu) fn mask8(n: usize) -> __mmask8 {
    if n >= 8 {
        0xff
    } else {
        (1u8 << n) - 1
    }
}

/// What becomes of a register tile's rows of a product of at most 8 columns (one
/// 256-bit vector per row, lanes past the columns unspecified).
pub(in crate::cpu) trait Out8 {
    /// Takes rows `i .. i + acc.len()` of C, `acc[r]` holding row `i + r`.
    ///
    /// # Safety
    /// The CPU has AVX-512F (so FMA) and AVX-512VL; the rows exist in the output's shape.
    unsafe fn rows(&mut self, i: usize, acc: &[__m256]);
}

/// C stored: row `i` at `c[i · ldc ..]`, the lanes of `last`.
pub(in crate::cpu) struct StoreC {
    pub(in crate::cpu) c: *mut f32,
    pub(in crate::cpu) ldc: usize,
    pub(in crate::cpu) last: __mmask8,
}

impl Out8 for StoreC {
    #[inline(always)]
    unsafe fn rows(&mut self, i: usize, acc: &[__m256]) {
        for (r, &x) in acc.iter().enumerate() {
            // SAFETY: the caller's contract: row `i + r`'s columns of `last` exist.
            unsafe { _mm256_mask_storeu_ps(self.c.add((i + r) * self.ldc), self.last, x) };
        }
    }
}

/// Each row's weighted ReLU sum times its scale, `out[i] = scale[i] · Σ_j w[j]·max(C[i][j],
/// 0)` over the first `n` columns, one FMA per column in column order from `+0`
/// ([`crate::cpu::dot::gemm_e4m3_relu_sums`], [`crate::cpu::gemm::gemm_pairs_relu_sums`]):
/// 8 rows at a time, transposed in registers (a vector per column).
pub(in crate::cpu) struct ReluSums {
    pub(in crate::cpu) w: *const f32,
    pub(in crate::cpu) n: usize,
    pub(in crate::cpu) scale: *const f32,
    pub(in crate::cpu) out: *mut f32,
}

impl Out8 for ReluSums {
    #[inline(always)]
    unsafe fn rows(&mut self, i: usize, acc: &[__m256]) {
        for (g, rows) in acc.chunks(8).enumerate() {
            let at = i + 8 * g;
            let count = rows.len();
            // SAFETY: register operations, then `n <= 8` weights, and rows
            // `at .. at + count` of the scales and outputs (the caller's contract).
            unsafe {
                let zero = _mm256_setzero_ps();
                let mut x = [zero; 8];
                x[..count].copy_from_slice(rows);
                let cols = transpose8(x);
                let mut sum = zero;
                for (j, &col) in cols.iter().enumerate().take(self.n) {
                    let wj = _mm256_set1_ps(*self.w.add(j));
                    // `x` where `x > 0`, else +0 (NaN too), as `f32::max(x, 0.0)` gives.
                    sum = _mm256_fmadd_ps(wj, _mm256_max_ps(col, zero), sum);
                }
                if count == 8 {
                    let sc = crate::cpu::raw::read::<__m256>(self.scale.add(at).cast());
                    crate::cpu::raw::write(self.out.add(at).cast(), _mm256_mul_ps(sum, sc));
                } else {
                    let m = mask8(count);
                    let sc = _mm256_maskz_loadu_ps(m, self.scale.add(at));
                    _mm256_mask_storeu_ps(self.out.add(at), m, _mm256_mul_ps(sum, sc));
                }
            }
        }
    }
}

/// The 8 × 8 transpose: `out[j]`'s lane `r` is `rows[r]`'s lane `j`.
///
/// # Safety
/// The CPU has AVX.
#[inline(always)]
unsafe fn transpose8(rows: [__m256; 8]) -> [__m256; 8] {
    // SAFETY: register operations; the feature is the caller's.
    unsafe {
        let [r0, r1, r2, r3, r4, r5, r6, r7] = rows;
        // Pairs of rows interleaved: (r0 r1) columns 0 1 | 4 5, and 2 3 | 6 7.
        let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
        let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
        let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
        let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
        // Four rows of one column per 128-bit half: columns 0 | 4, 1 | 5, 2 | 6, 3 | 7.
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xee>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xee>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xee>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xee>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ]
    }
}
