//! A register-blocked f32 matrix-multiply-accumulate, the compute core of the CPU indexer
//! and sparse attention.
//!
//! `C[m×n] += A[m×k] · B[k×n]`, all row-major. Every element of `C` accumulates its `k`
//! products in order `p = 0..k` with one fused multiply-add each, whatever the blocking or
//! the instruction set (AVX-512, AVX2+FMA, or scalar `mul_add`, which is also correctly
//! rounded). Results therefore never depend on `m`, `n`, the tile a row lands in, or the
//! machine's vector width: the basis of batch invariance.
use super::isa::{CpuIsa, Isa};

/// Rows of the register tile.
const MR: usize = 6;

/// Strided matrix views (elements, not bytes).
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

/// `C += A · B` (see the module docs), on the vector path `isa`. Panics if a slice is too
/// short for `dims`.
pub fn gemm_acc(isa: CpuIsa, d: Dims, a: &[f32], b: &[f32], c: &mut [f32]) {
    if d.m == 0 || d.n == 0 {
        return;
    }
    assert!(d.lda >= d.k && d.ldb >= d.n && d.ldc >= d.n);
    assert!(a.len() >= (d.m - 1) * d.lda + d.k);
    assert!(d.k == 0 || b.len() >= (d.k - 1) * d.ldb + d.n);
    assert!(c.len() >= (d.m - 1) * d.ldc + d.n);
    if d.k == 0 {
        return;
    }
    gemm_paths(isa, d, a, b, c)
}

/// Register-tile width (f32 columns) of a path: two vectors.
const fn nr(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 32,
        Isa::Avx2 | Isa::Scalar => 16,
    }
}

crate::isa_dispatch! {
    /// [`gemm_generic`] with the path's tile width, compiled for each path.
    fn gemm_paths(d: Dims, a: &[f32], b: &[f32], c: &mut [f32])
        = |ISA| gemm_generic::<{ nr(ISA.isa()) }>(d, a, b, c);
}

/// Tiles C into `MR × NR` register blocks; leftover columns (and a C narrower than one
/// tile, as in the key-score GEMMs of few heads) use tiles of 16 and 8 columns that are
/// taller than `MR` (enough independent accumulators to hide the FMA latency), then
/// scalars; every element keeps the same per-element operation order.
#[inline(always)]
fn gemm_generic<const NR: usize>(d: Dims, a: &[f32], b: &[f32], c: &mut [f32]) {
    let n_full = d.n / NR * NR;
    let mut i = 0;
    while i < d.m {
        let rows = MR.min(d.m - i);
        let mut j = 0;
        while j < n_full {
            match rows {
                MR => tile::<MR, NR>(d, a, b, c, i, j),
                5 => tile::<5, NR>(d, a, b, c, i, j),
                4 => tile::<4, NR>(d, a, b, c, i, j),
                3 => tile::<3, NR>(d, a, b, c, i, j),
                2 => tile::<2, NR>(d, a, b, c, i, j),
                _ => {
                    for r in i..i + rows {
                        tile::<1, NR>(d, a, b, c, r, j);
                    }
                }
            }
            j += NR;
        }
        i += rows;
    }
    let mut j = n_full;
    if NR > 16 && d.n - j >= 16 {
        // One vector per row: 12 rows in flight.
        narrow::<16, 12>(d, a, b, c, j);
        j += 16;
    }
    if d.n - j >= 8 {
        narrow::<8, 12>(d, a, b, c, j);
        j += 8;
    }
    if j < d.n {
        for r in 0..d.m {
            edge(d, a, b, c, r, j);
        }
    }
}

/// Columns `j .. j + W` of every row, in tiles of `R` rows (then 8, 4, 2, 1).
#[inline(always)]
fn narrow<const W: usize, const R: usize>(d: Dims, a: &[f32], b: &[f32], c: &mut [f32], j: usize) {
    let mut i = 0;
    while d.m - i >= R {
        tile::<R, W>(d, a, b, c, i, j);
        i += R;
    }
    for step in [8, 4, 2, 1] {
        if step < R && d.m - i >= step {
            match step {
                8 => tile::<8, W>(d, a, b, c, i, j),
                4 => tile::<4, W>(d, a, b, c, i, j),
                2 => tile::<2, W>(d, a, b, c, i, j),
                _ => tile::<1, W>(d, a, b, c, i, j),
            }
            i += step;
        }
    }
    debug_assert_eq!(i, d.m);
}

#[inline(always)]
fn tile<const R: usize, const NR: usize>(
    d: Dims,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    i: usize,
    j: usize,
) {
    let mut acc = [[0f32; NR]; R];
    for (r, row) in acc.iter_mut().enumerate() {
        row.copy_from_slice(&c[(i + r) * d.ldc + j..][..NR]);
    }
    for p in 0..d.k {
        // B's row segment, held in registers for the R rows.
        let bp: [f32; NR] = b[p * d.ldb + j..][..NR]
            .try_into()
            .unwrap_or_else(|_| unreachable!());
        for (r, row) in acc.iter_mut().enumerate() {
            debug_assert!((i + r) * d.lda + p < a.len());
            // SAFETY: `gemm_acc` checked `a.len() >= (m - 1)·lda + k`, and the tiles cover
            // rows `i + r < m` and `p < k` only.
            let av = unsafe { *a.get_unchecked((i + r) * d.lda + p) };
            for (x, &bv) in row.iter_mut().zip(&bp) {
                *x = av.mul_add(bv, *x);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        c[(i + r) * d.ldc + j..][..NR].copy_from_slice(row);
    }
}

#[inline(always)]
fn edge(d: Dims, a: &[f32], b: &[f32], c: &mut [f32], i: usize, j0: usize) {
    for j in j0..d.n {
        let mut x = c[i * d.ldc + j];
        for p in 0..d.k {
            x = a[i * d.lda + p].mul_add(b[p * d.ldb + j], x);
        }
        c[i * d.ldc + j] = x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn naive(d: Dims, a: &[f32], b: &[f32], c: &mut [f32]) {
        for i in 0..d.m {
            for j in 0..d.n {
                let mut x = c[i * d.ldc + j];
                for p in 0..d.k {
                    x = a[i * d.lda + p].mul_add(b[p * d.ldb + j], x);
                }
                c[i * d.ldc + j] = x;
            }
        }
    }

    #[test]
    fn matches_sequential_fma_bitwise() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &(m, n, k) in &[
            (1, 1, 1),
            (7, 33, 5),
            (13, 70, 129),
            (6, 32, 64),
            (64, 64, 128),
            // Narrow C (key scores of few heads): tall 16- and 8-column tiles.
            (64, 16, 288),
            (64, 8, 64),
            (37, 24, 10),
            (100, 56, 7),
            (29, 61, 33),
            (11, 16, 3),
        ] {
            let d = Dims {
                m,
                n,
                k,
                lda: k + 3,
                ldb: n + 1,
                ldc: n + 2,
            };
            let a: Vec<f32> = (0..m * d.lda).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..k * d.ldb).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let c0: Vec<f32> = (0..m * d.ldc).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut c1 = c0.clone();
            let mut c2 = c0.clone();
            naive(d, &a, &b, &mut c2);
            // Every path this CPU has agrees bit for bit with the sequential FMAs.
            for isa in CpuIsa::available() {
                c1.copy_from_slice(&c0);
                gemm_acc(isa, d, &a, &b, &mut c1);
                let same = c1.iter().zip(&c2).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "m={m} n={n} k={k} {:?}", isa.isa());
            }
        }
    }
}
