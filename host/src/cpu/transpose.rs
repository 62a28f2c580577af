//! f32 matrix transposes (exact: values are moved, never computed), for the epilogues that
//! read a GEMM's `Cᵀ` along its other dimension: 16 × 16 register tiles on AVX-512 (8 × 8
//! ones on the strips a dimension that is not a multiple of 16 leaves), 8 × 8 on AVX2,
//! element by element elsewhere and at the edges.

use super::isa::{CpuIsa, Isa};

/// `dst[j·ldd + i] = src[i·lds + j]` for `i < m`, `j < n`. Panics if a slice is too short.
pub fn transpose(
    isa: CpuIsa,
    m: usize,
    n: usize,
    src: &[f32],
    lds: usize,
    dst: &mut [f32],
    ldd: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(lds >= n && ldd >= m);
    assert!(src.len() >= (m - 1) * lds + n && dst.len() >= (n - 1) * ldd + m);
    #[cfg(target_arch = "x86_64")]
    match isa.isa() {
        Isa::Avx512Bf16 | Isa::Avx512 => {
            let (m16, n16, m8, n8) = (m / 16 * 16, n / 16 * 16, m / 8 * 8, n / 8 * 8);
            // SAFETY: the path's CpuIsa exists only on a CPU with AVX-512F and AVX2
            // (`Isa::supported`); the slices hold the matrices (asserted above). The three
            // calls cover rows `0..m16` × columns `0..n16`, rows `0..m16` × columns
            // `n16..n8` and rows `m16..m8` × columns `0..n8`: every pointer offset below is
            // the first element of that sub-matrix (called only when it is not empty), inside both
            // slices.
            unsafe {
                let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
                x86::tiles16(m16, n16, s, lds, d, ldd);
                if n8 > n16 && m16 > 0 {
                    x86::tiles8(m16, n8 - n16, s.add(n16), lds, d.add(n16 * ldd), ldd);
                }
                if m8 > m16 && n8 > 0 {
                    x86::tiles8(m8 - m16, n8, s.add(m16 * lds), lds, d.add(m16), ldd);
                }
            }
            edges(m, n, m8, n8, src, lds, dst, ldd);
            return;
        }
        Isa::Avx2 => {
            // SAFETY: as above, with AVX2.
            unsafe { x86::tiles8(m, n, src.as_ptr(), lds, dst.as_mut_ptr(), ldd) };
            edges(m, n, m / 8 * 8, n / 8 * 8, src, lds, dst, ldd);
            return;
        }
        Isa::Scalar => {}
    }
    let _ = isa;
    edges(m, n, 0, 0, src, lds, dst, ldd);
}

/// The elements outside the tiled `mt × nt` corner.
#[allow(clippy::too_many_arguments)]
fn edges(
    m: usize,
    n: usize,
    mt: usize,
    nt: usize,
    src: &[f32],
    lds: usize,
    dst: &mut [f32],
    ldd: usize,
) {
    for i in 0..m {
        let from = if i < mt { nt } else { 0 };
        for j in from..n {
            dst[j * ldd + i] = src[i * lds + j];
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

    /// Every whole 16 × 16 tile.
    ///
    /// # Safety
    /// AVX-512F; `src` holds `m` rows of `lds`, `dst` `n` rows of `ldd`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tiles16(
        m: usize,
        n: usize,
        src: *const f32,
        lds: usize,
        dst: *mut f32,
        ldd: usize,
    ) {
        for i0 in (0..m / 16 * 16).step_by(16) {
            for j0 in (0..n / 16 * 16).step_by(16) {
                // SAFETY: rows i0..i0+16 ≤ m, columns j0..j0+16 ≤ n of src; the transposed
                // tile in dst likewise.
                unsafe {
                    let mut r = [_mm512_setzero_ps(); 16];
                    for (k, x) in r.iter_mut().enumerate() {
                        *x = _mm512_loadu_ps(src.add((i0 + k) * lds + j0));
                    }
                    let t = transpose16(r);
                    for (k, x) in t.iter().enumerate() {
                        _mm512_storeu_ps(dst.add((j0 + k) * ldd + i0), *x);
                    }
                }
            }
        }
    }

    /// A 16 × 16 transpose in registers.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
        let mut t = [_mm512_setzero_ps(); 16];
        for k in 0..8 {
            t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
            t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for k in 0..4 {
            let (a, b, c, d) = (t[4 * k], t[4 * k + 1], t[4 * k + 2], t[4 * k + 3]);
            u[4 * k] = _mm512_shuffle_ps::<0x44>(a, c);
            u[4 * k + 1] = _mm512_shuffle_ps::<0xee>(a, c);
            u[4 * k + 2] = _mm512_shuffle_ps::<0x44>(b, d);
            u[4 * k + 3] = _mm512_shuffle_ps::<0xee>(b, d);
        }
        // u[4k + c] holds rows 4k..4k+4, column c (mod 4) of every 128-bit lane.
        let mut v = [_mm512_setzero_ps(); 16];
        for c in 0..4 {
            v[c] = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
            v[4 + c] = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
            v[8 + c] = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
            v[12 + c] = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
        }
        let mut o = [_mm512_setzero_ps(); 16];
        for c in 0..4 {
            o[c] = _mm512_shuffle_f32x4::<0x88>(v[c], v[8 + c]);
            o[8 + c] = _mm512_shuffle_f32x4::<0xdd>(v[c], v[8 + c]);
            o[4 + c] = _mm512_shuffle_f32x4::<0x88>(v[4 + c], v[12 + c]);
            o[12 + c] = _mm512_shuffle_f32x4::<0xdd>(v[4 + c], v[12 + c]);
        }
        o
    }

    /// Every whole 8 × 8 tile.
    ///
    /// # Safety
    /// AVX2; as [`tiles16`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn tiles8(
        m: usize,
        n: usize,
        src: *const f32,
        lds: usize,
        dst: *mut f32,
        ldd: usize,
    ) {
        for i0 in (0..m / 8 * 8).step_by(8) {
            for j0 in (0..n / 8 * 8).step_by(8) {
                // SAFETY: as in `tiles16`, for 8 × 8 tiles.
                unsafe {
                    let mut r = [_mm256_setzero_ps(); 8];
                    for (k, x) in r.iter_mut().enumerate() {
                        *x = _mm256_loadu_ps(src.add((i0 + k) * lds + j0));
                    }
                    let mut t = [_mm256_setzero_ps(); 8];
                    for k in 0..4 {
                        t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
                        t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
                    }
                    let mut u = [_mm256_setzero_ps(); 8];
                    for k in 0..2 {
                        let (a, b, c, d) = (t[4 * k], t[4 * k + 1], t[4 * k + 2], t[4 * k + 3]);
                        u[4 * k] = _mm256_shuffle_ps::<0x44>(a, c);
                        u[4 * k + 1] = _mm256_shuffle_ps::<0xee>(a, c);
                        u[4 * k + 2] = _mm256_shuffle_ps::<0x44>(b, d);
                        u[4 * k + 3] = _mm256_shuffle_ps::<0xee>(b, d);
                    }
                    for c in 0..4 {
                        let lo = _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c]);
                        let hi = _mm256_permute2f128_ps::<0x31>(u[c], u[4 + c]);
                        _mm256_storeu_ps(dst.add((j0 + c) * ldd + i0), lo);
                        _mm256_storeu_ps(dst.add((j0 + 4 + c) * ldd + i0), hi);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_transposes_every_shape() {
        for (m, n) in [
            (1, 1),
            (16, 16),
            (64, 64),
            (37, 70),
            (8, 24),
            (17, 9),
            (64, 8),
            (8, 64),
            (40, 56),
            (5, 128),
        ] {
            let (lds, ldd) = (n + 3, m + 5);
            let src: Vec<f32> = (0..m * lds).map(|i| i as f32).collect();
            for isa in CpuIsa::available() {
                let mut dst = vec![-1.0; n * ldd];
                transpose(isa, m, n, &src, lds, &mut dst, ldd);
                for i in 0..m {
                    for j in 0..n {
                        assert_eq!(dst[j * ldd + i], src[i * lds + j], "{} {m}×{n}", isa.isa());
                    }
                }
                for j in 0..n {
                    assert!(dst[j * ldd + m..(j + 1) * ldd].iter().all(|&x| x == -1.0));
                }
            }
        }
    }
}
