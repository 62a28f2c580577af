//! A register-blocked f32 matrix-multiply-accumulate: the dense model's matmul and the f32
//! form of the CPU indexer's and sparse attention's dot products.
//!
//! `C[m×n] += A[m×k] · B[k×n]`, all row-major. Every element of `C` accumulates its `k`
//! products with one fused multiply-add each, in a fixed order whatever the blocking or
//! the instruction set (AVX-512, AVX2+FMA, or scalar `mul_add`, which is also correctly
//! rounded). Results therefore never depend on `m`, `n`, the tile a row lands in, or the
//! machine's vector width: the basis of batch invariance. Two orders exist:
//! - [`gemm_acc`]: `p = 0, 1, …, k-1` (the dense model's matmul, which the GPU kernels
//!   repeat bit for bit);
//! - [`gemm_acc_pairs`]: the bf16 dot-product order of [`super::dot`], `p = 1, 0, 3, 2, …`
//!   (odd index of each pair first), and for odd `k` the last index after an added `+0`
//!   (the zero its missing partner contributes). On operands that are bf16 values this is
//!   exactly what `vdpbf16ps` computes, so the `avx512bf16` path gives the same bits.
use std::cell::Cell;
use std::ops::Range;

use super::isa::{CpuIsa, Isa};
use super::scratch::Aligned;
#[cfg(target_arch = "x86_64")]
use super::tile_out::Out8;

/// Rows of a path's register tile: with two vectors of columns, 16 accumulators on
/// AVX-512 (32 registers; two FMA units of 4 cycles' latency keep 8 in flight, and each
/// step's 2 + 8 loads feed 16 FMAs), 12 on AVX2 (16 registers: 12 + 2 of B + 1 of A).
const fn mr(isa: Isa) -> usize {
    match isa {
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => 8,
        Isa::Avx2 | Isa::Scalar => 6,
    }
}

/// Steps of `k` per cache block of the register tiles (even, so a pair of the pair order
/// never straddles two blocks). Each element's chain carries on from one block to the next
/// through C in f32: blocking changes no bit.
const KC: usize = 256;

/// Columns per cache block of the register tiles: a `KC × NC` block of B (256 KiB) stays in
/// L2 while every row block of A runs over it.
const NC: usize = 256;

/// Row stride of B (elements: 4 KiB) from which a block of it is packed before its row
/// tiles run: rows that far apart cross a page each, which the hardware does not prefetch
/// across (the dense model's weights); nearer rows (the attention's key rows, resident in
/// cache) are read in place.
const PACK_MIN_LDB: usize = 1024;

/// Most rows of C that [`few_rows`] computes on a path whose tiles are `nr` columns wide:
/// 24 on AVX-512, 16 on AVX2. One thread, 7168 × 1536 weights on Zen 1 (AVX2, tiles of 8
/// columns then): 16 rows 20.7–24.5 ms against 25.4–32.1 packed; 32 rows 38.3–40.2 against
/// 35.2–38.5. Two threads, 4096 × 1024 weights on an Intel Xeon, few-row path against
/// packed (AVX2 | AVX-512, ms): 16 rows 1.29–1.30 against 1.49–1.79 | 0.68–0.75 against
/// 0.87–1.04; 24 rows 1.77–1.98 against 2.00–2.09 | 0.88–0.95 against 1.13–2.43; 32 rows
/// 2.55–2.65 against 2.37–2.74 | 1.08–1.54 against 1.25–1.79; 48 rows (AVX-512)
/// 1.63–2.46 against 1.88–2.47.
const fn few_rows_max(nr: usize) -> usize {
    if nr > 16 {
        24
    } else {
        16
    }
}

/// Whether a C of `m` rows over a B whose rows are `ldb` elements apart takes the
/// [`few_rows`] path on a path whose tiles are `nr` columns wide. In the model order
/// ([`gemm_acc`], [`gemm_into`]: the dense model's matmul, whose B is its weights, read
/// from memory once per call) whenever `m` is at most [`few_rows_max`]; in pair order (the
/// attention's and the indexer's keys, mostly in cache) only when B's rows are also a
/// page or more apart. Zen 4, two threads, a V4 decode step of 32 rows in the engine
/// (weights from memory), 16 rows a worker in place against tiles over B's rows 512
/// bytes apart: `4096 × 128` accumulating 300 → 205 µs, `128 × 512` 53 → 30 µs.
const fn takes_few_rows<const PAIRS: bool>(nr: usize, m: usize, ldb: usize) -> bool {
    m <= few_rows_max(nr) && (!PAIRS || ldb >= PACK_MIN_LDB)
}

/// Whether a C of `m` rows of [`gemm_acc`] or [`gemm_into`] on `isa` runs on the
/// [`few_rows`] path, and if so its tile's height (rows of C per pass over B: 8 on
/// AVX-512, 2 on AVX2 and the portable path).
pub(crate) fn few_rows_tile(isa: CpuIsa, m: usize) -> Option<usize> {
    let nr = nr(isa.isa());
    takes_few_rows::<false>(nr, m, 0).then_some(if nr > 16 { 8 } else { 2 })
}

/// Rows of B ahead of its current step whose lines a [`few_rows`] tile asks for. Its B rows
/// are a page apart, which the hardware does not prefetch across; a step of 8 rows takes
/// about 8 cycles, and 16–24 rows ahead measured best (one thread, m8 × 4096 × 1024, Zen 1:
/// 8 rows 5.8–6.1 ms, 16 rows 4.7–5.0, 24 rows 4.3–4.9; none 7.6–8.2).
const B_AHEAD: usize = 24;

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

/// `C += A · B` with each element's products in order `p = 0..k` (see the module docs), on
/// the vector path `isa`. Panics if a slice is too short for `dims`.
pub fn gemm_acc(isa: CpuIsa, d: Dims, a: &[f32], b: &[f32], c: &mut [f32]) {
    if check(d, a, b, c) {
        gemm_paths(isa, d, a, b, c)
    }
}

/// [`gemm_acc`] into `C = A · B`: each element's chain starts from `+0` instead of C's
/// value (the same bits as zeroing C first; C is not read, so it is not zeroed either).
pub fn gemm_into(isa: CpuIsa, d: Dims, a: &[f32], b: &[f32], c: &mut [f32]) {
    if check_into(d, a, b, c) {
        gemm_into_paths(isa, d, a, b, c)
    }
}

/// `C += A · B` with each element's products in the bf16 dot-product order (module docs),
/// on the vector path `isa` (f32 FMAs on every path: `avx512bf16` callers with bf16
/// operands use [`super::dot`] instead, for the same bits). Panics if a slice is too short.
pub fn gemm_acc_pairs(isa: CpuIsa, d: Dims, a: &[f32], b: &[f32], c: &mut [f32]) {
    if check(d, a, b, c) {
        gemm_pairs_paths(isa, d, a, b, c)
    }
}

/// [`gemm_acc_pairs`] into `C = A · B`: each element's chain starts from `+0` instead of
/// C's value (the same bits as zeroing C first; C is not read).
///
/// On the AVX-512 paths a product of at most 8 columns and even `k` (the key scores of a
/// few query heads, keys along the rows) runs in tiles of 16 rows × one 256-bit vector,
/// each FMA broadcasting its element of A from memory.
pub fn gemm_pairs_into(isa: CpuIsa, d: Dims, a: &[f32], b: &[f32], c: &mut [f32]) {
    if !check_into(d, a, b, c) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // C holds `d` (checked above).
        let out = super::tile_out::StoreC {
            c: c.as_mut_ptr(),
            ldc: d.ldc,
            last: super::tile_out::mask8(d.n),
        };
        if rows8_route(isa, d, a, b, out) {
            return;
        }
    }
    gemm_pairs_into_paths(isa, d, a, b, c)
}

/// Runs [`pairs_rows8_avx512`] into `out` where the path and the shape allow it (the
/// AVX-512 paths, 1 to 8 columns, `k` even and positive), and says whether it did. Panics
/// if A or B does not hold `d` (the caller has checked what `out` writes).
#[cfg(target_arch = "x86_64")]
fn rows8_route(isa: CpuIsa, d: Dims, a: &[f32], b: &[f32], out: impl Out8) -> bool {
    let fits = d.m > 0 && (1..=8).contains(&d.n) && d.k > 0 && d.k % 2 == 0;
    if !(fits && matches!(isa.isa(), Isa::Amx | Isa::Avx512 | Isa::Avx512Bf16)) {
        return false;
    }
    check_ab(d, a, b);
    // SAFETY: the AVX-512 paths' CPU has AVX-512F and AVX-512VL (`Isa::supported`); A and
    // B hold `d` (asserted above), `n ≤ 8`, `k` even and positive, and `out` takes `m`
    // rows (the caller's contract).
    unsafe { pairs_rows8_avx512(d, a, b, out) };
    true
}

/// The weighted ReLU sum of each row of [`gemm_pairs_into`]'s `C`, times the row's scale:
/// `s = +0; for j in 0..n: s = fma(w[j], max(C[i][j], 0), s)` in column order, then
/// `out[i] = s · scale[i]` (`max` gives 0 for a NaN score). The same bits as
/// [`gemm_pairs_into`] into `c` followed by that loop, which every other route runs; on
/// the AVX-512 paths, for at most 8 columns and even `k`, `C` is never stored: each
/// register tile's rows are transposed and summed in registers (as
/// [`super::dot::gemm_e4m3_relu_sums`] does for e4m3 keys).
///
/// Meant for a few columns: the other routes sum each row as one chain of FMAs, at one
/// FMA's latency per column (64 columns made the indexer's 64-head decode 3 times slower
/// than its own head sums, vectorised over keys).
///
/// `c` is working space on the other routes (its contents are unspecified on return).
/// Panics as [`gemm_pairs_into`] does, or if `w` has fewer than `d.n` weights, or `scale`
/// or `out` fewer than `d.m` values.
#[allow(
    clippy::too_many_arguments,
    reason = "a GEMM's operands plus its epilogue's"
)]
pub fn gemm_pairs_relu_sums(
    isa: CpuIsa,
    d: Dims,
    a: &[f32],
    b: &[f32],
    w: &[f32],
    scale: &[f32],
    c: &mut [f32],
    out: &mut [f32],
) {
    check_relu_sums((d.m, d.n), w, scale, out);
    #[cfg(target_arch = "x86_64")]
    {
        // The sums read `n` weights and `m` scales and write `m` outputs (checked above).
        let sums = super::tile_out::ReluSums {
            w: w.as_ptr(),
            n: d.n,
            scale: scale.as_ptr(),
            out: out.as_mut_ptr(),
        };
        if rows8_route(isa, d, a, b, sums) {
            return;
        }
    }
    gemm_pairs_into(isa, d, a, b, c);
    relu_sums(c, (d.m, d.n, d.ldc), w, scale, out);
}

/// Panics unless the `relu_sums` GEMMs' `w` has `n` weights, and `scale` and `out` `m`
/// values, for `(m, n)`.
pub(crate) fn check_relu_sums((m, n): (usize, usize), w: &[f32], scale: &[f32], out: &[f32]) {
    assert!(w.len() >= n, "one weight per column");
    assert!(
        scale.len() >= m && out.len() >= m,
        "one scale and one output per row"
    );
}

/// The `relu_sums` GEMMs' epilogue on a stored C of `(m, n, ldc)`: `out[i] = scale[i] ·
/// s`, `s` summed from `+0` by `s = fma(w[j], max(C[i][j], 0), s)` in column order.
pub(crate) fn relu_sums(
    c: &[f32],
    (m, n, ldc): (usize, usize, usize),
    w: &[f32],
    scale: &[f32],
    out: &mut [f32],
) {
    for (i, (o, &sc)) in out[..m].iter_mut().zip(scale).enumerate() {
        let row = if n == 0 { &[][..] } else { &c[i * ldc..][..n] };
        let mut s = 0f32;
        for (&wj, &x) in w.iter().zip(row) {
            s = wj.mul_add(x.max(0.0), s);
        }
        *o = s * sc;
    }
}

/// Checks `out` (of `m + 3` values) against the `relu_sums` definition computed here on
/// the stored C `c` of `(m, n, ldc)`: the same bits (or NaN for NaN), and the 3 values
/// past `m` still `-7`.
#[cfg(test)]
pub(crate) fn assert_relu_sums(
    out: &[f32],
    c: &[f32],
    (m, n, ldc): (usize, usize, usize),
    w: &[f32],
    scale: &[f32],
    what: &str,
) {
    for i in 0..m {
        let row = &c[i * ldc..][..n];
        let s = w.iter().zip(row).fold(0f32, |s, (&wj, &x)| {
            wj.mul_add(if x > 0.0 { x } else { 0.0 }, s)
        });
        let (got, want) = (out[i], s * scale[i]);
        let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
        assert!(same, "{what}: row {i}: {got} against {want}");
    }
    assert!(out[m..].iter().all(|&x| x == -7.0), "{what}: past the rows");
}

/// [`gemm_pairs_into`] for at most 8 columns on AVX-512: tiles of 16 rows, then of 8, 4,
/// 2 and 1, each × one 256-bit vector of columns (masked). Per pair of `k` the odd index
/// goes first, then the even one, each FMA broadcasting A's element from memory: 16
/// chains in flight, and no lane of a vector idle for C's 8 columns. The generic tiles of
/// 16 columns left half of each vector idle: on AMD Zen 4, in the tiny indexer decode on
/// the forced `avx512` path, their score GEMM took 57 cycles per key of 64 dims, against
/// 32 at the FMA rate.
///
/// Each tile's rows of C go to `out` (stored, or summed: [`gemm_pairs_relu_sums`]).
///
/// # Safety
/// The CPU has AVX-512F and AVX-512VL; `n ≤ 8`, `k` even and positive, A and B hold `d`
/// (as [`check`] asserts), and `out` takes `m` rows.
#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
#[target_feature(enable = "avx512f,avx512vl")]
unsafe fn pairs_rows8_avx512(d: Dims, a: &[f32], b: &[f32], mut out: impl Out8) {
    // SAFETY: the caller's contract; `L` is `d.lda` where it is not 0.
    unsafe {
        match d.lda {
            64 => pairs_rows8::<64>(d, a, b, &mut out),
            128 => pairs_rows8::<128>(d, a, b, &mut out),
            _ => pairs_rows8::<0>(d, a, b, &mut out),
        }
    }
}

/// [`pairs_rows8_avx512`] with A's rows `L` elements apart (`d.lda` when `L` is 0): a
/// constant row length puts every element of a step at a constant offset from the
/// step's, where a runtime one costs an add per row and step.
///
/// # Safety
/// As [`pairs_rows8_avx512`]; `L` is 0 or `d.lda`.
#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
#[target_feature(enable = "avx512f,avx512vl")]
#[inline]
unsafe fn pairs_rows8<const L: usize>(d: Dims, a: &[f32], b: &[f32], out: &mut impl Out8) {
    debug_assert!(L == 0 || L == d.lda);
    let last = super::tile_out::mask8(d.n);
    let mut i = 0;
    // SAFETY: every call covers rows `i .. i + R ≤ m` only (the caller's contract).
    unsafe {
        while d.m - i >= 16 {
            out.rows(i, &pairs_tile8::<16, L>(d, a, b, i, last));
            i += 16;
        }
        for step in [8, 4, 2, 1] {
            if d.m - i >= step {
                match step {
                    8 => out.rows(i, &pairs_tile8::<8, L>(d, a, b, i, last)),
                    4 => out.rows(i, &pairs_tile8::<4, L>(d, a, b, i, last)),
                    2 => out.rows(i, &pairs_tile8::<2, L>(d, a, b, i, last)),
                    _ => out.rows(i, &pairs_tile8::<1, L>(d, a, b, i, last)),
                }
                i += step;
            }
        }
    }
    debug_assert_eq!(i, d.m);
}

/// The tile of `R` rows from row `i0` of [`pairs_rows8`]: returns its rows of C (lanes
/// past `last` unspecified).
///
/// # Safety
/// As [`pairs_rows8`], with rows `i0 .. i0 + R` inside `m`.
#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
#[target_feature(enable = "avx512f,avx512vl")]
#[inline]
unsafe fn pairs_tile8<const R: usize, const L: usize>(
    d: Dims,
    a: &[f32],
    b: &[f32],
    i0: usize,
    last: u8,
) -> [std::arch::x86_64::__m256; R] {
    use std::arch::x86_64::*;
    // SAFETY: every read is A[i0 + r][q] or B[q][0..8] (masked to `n` columns) with
    // `q < k`: inside the slices by the caller's contract.
    unsafe {
        let lda = if L == 0 { d.lda } else { L };
        let (ap, bp) = (a.as_ptr().add(i0 * lda), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); R];
        let mut p = 0;
        while p < d.k {
            // The odd index of each pair first.
            for q in [p + 1, p] {
                let bv = _mm256_maskz_loadu_ps(last, bp.add(q * d.ldb));
                for (r, x) in acc.iter_mut().enumerate() {
                    let av = _mm256_set1_ps(super::raw::read(ap.add(r * lda + q)));
                    *x = _mm256_fmadd_ps(av, bv, *x);
                }
            }
            p += 2;
        }
        acc
    }
}

/// [`check`] for a GEMM into C: with nothing to sum (`k = 0`) C's rows are set to `+0`
/// here.
fn check_into(d: Dims, a: &[f32], b: &[f32], c: &mut [f32]) -> bool {
    let run = check(d, a, b, c);
    if !run && d.k == 0 && d.n > 0 {
        for i in 0..d.m {
            c[i * d.ldc..][..d.n].fill(0.0);
        }
    }
    run
}

/// Asserts the slices hold `d`; whether there is anything to compute.
fn check(d: Dims, a: &[f32], b: &[f32], c: &mut [f32]) -> bool {
    if d.m == 0 || d.n == 0 {
        return false;
    }
    check_ab(d, a, b);
    assert!(d.ldc >= d.n && c.len() >= (d.m - 1) * d.ldc + d.n);
    d.k > 0
}

/// Panics unless A and B hold `d` (`m > 0` and `n > 0`).
fn check_ab(d: Dims, a: &[f32], b: &[f32]) {
    assert!(d.lda >= d.k && d.ldb >= d.n);
    assert!(a.len() >= (d.m - 1) * d.lda + d.k);
    assert!(d.k == 0 || b.len() >= (d.k - 1) * d.ldb + d.n);
}

/// Register-tile width (f32 columns) of a path: two vectors.
const fn nr(isa: Isa) -> usize {
    match isa {
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => 32,
        Isa::Avx2 | Isa::Scalar => 16,
    }
}

crate::isa_dispatch! {
    /// [`gemm_generic`] with the path's tile, compiled for each path.
    fn gemm_paths(d: Dims, a: &[f32], b: &[f32], c: &mut [f32])
        = |ISA| gemm_generic::<{ mr(ISA.isa()) }, { nr(ISA.isa()) }, false, false>(d, a, b, c);
}

crate::isa_dispatch! {
    /// [`gemm_generic`] from zero with the path's tile, compiled for each path.
    fn gemm_into_paths(d: Dims, a: &[f32], b: &[f32], c: &mut [f32])
        = |ISA| gemm_generic::<{ mr(ISA.isa()) }, { nr(ISA.isa()) }, false, true>(d, a, b, c);
}

crate::isa_dispatch! {
    /// [`gemm_generic`] in pair order with the path's tile, compiled for each path.
    fn gemm_pairs_paths(d: Dims, a: &[f32], b: &[f32], c: &mut [f32])
        = |ISA| gemm_generic::<{ mr(ISA.isa()) }, { nr(ISA.isa()) }, true, false>(d, a, b, c);
}

crate::isa_dispatch! {
    /// [`gemm_generic`] in pair order from zero, with the path's tile.
    fn gemm_pairs_into_paths(d: Dims, a: &[f32], b: &[f32], c: &mut [f32])
        = |ISA| gemm_generic::<{ mr(ISA.isa()) }, { nr(ISA.isa()) }, true, true>(d, a, b, c);
}

/// The `step`-th index of the accumulation order over `k` (module docs): `step` itself,
/// or in pair order its pair partner (`step ^ 1`, for the steps of [`main_steps`]). Pair
/// order handles an odd `k`'s last index apart ([`tail`]).
#[inline(always)]
const fn order<const PAIRS: bool>(step: usize) -> usize {
    if PAIRS {
        step ^ 1
    } else {
        step
    }
}

/// Steps of the main loop: all of `k`, or in pair order its whole pairs.
#[inline(always)]
const fn main_steps<const PAIRS: bool>(k: usize) -> usize {
    if PAIRS {
        k & !1
    } else {
        k
    }
}

/// The pair-order tail: an odd `k`'s last product, after the `+0` of its missing partner.
#[inline(always)]
fn tail(x: f32, a: f32, b: f32) -> f32 {
    a.mul_add(b, x + 0.0)
}

/// Tiles C into `MR × NR` register blocks, run block by block of `KC` steps of `k` and
/// `NC` columns (cache blocking: each block of B is reused by every row of A from L2;
/// a block whose rows are a page or more apart is first packed, see [`PACK_MIN_LDB`]);
/// leftover columns (and a C narrower than one tile, as in the key-score GEMMs of few
/// heads) use tiles of 16 and 8 columns that are taller than `MR` (enough independent
/// accumulators to hide the FMA latency), then scalars; every element keeps the same
/// per-element operation order.
#[inline(always)]
fn gemm_generic<const MR: usize, const NR: usize, const PAIRS: bool, const ZERO: bool>(
    d: Dims,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) {
    if takes_few_rows::<PAIRS>(NR, d.m, d.ldb) {
        few_rows::<NR, PAIRS, ZERO>(d, a, b, c);
        return;
    }
    let n_full = d.n / NR * NR;
    // Packed blocks of B as panels of one tile's width (two zmm vectors).
    let panels = NR >= 32;
    // This thread's packing buffer, taken for the call (a nested call finds it empty).
    let mut buf = PACKED.take();
    // Rows of B a block reads: its steps', and the pair order's odd tail.
    let block_end = |ks: Steps| if PAIRS && ks.last { d.k } else { ks.end };
    // The `KC × NC` blocks in order (none when every column is left to the narrower
    // tiles), each knowing the next one.
    let mut order = Steps::blocks::<PAIRS>(d.k)
        .filter(|_| n_full > 0)
        .flat_map(|ks| (0..n_full).step_by(NC).map(move |j0| (ks, j0)))
        .peekable();
    while let Some((ks, j0)) = order.next() {
        let k0 = ks.start;
        let rows_end = block_end(ks);
        let j1 = (j0 + NC).min(n_full);
        let packed;
        let packing = d.m > MR && d.ldb >= PACK_MIN_LDB && d.ldb != j1 - j0;
        // While this block's tiles run, the rows of the next block that will be packed
        // are asked for, a share before each tile: its rows are a page or more apart,
        // so neither the hardware nor the copy would have them in flight, and the copy
        // would wait on each row in turn (AMD Zen 4, one thread, the model matmul
        // 64 × 7168 · 7168 × 1536: 14.7–15.5 ms against 16.6–17.5 on `avx512bf16`,
        // 15.6–16.9 against 18.3–18.9 on `avx2`; 256 × 4096 · 4096 × 1024 2–3% faster).
        let mut ahead = match order.peek() {
            Some(&(nks, nj0)) if packing => {
                let rows = nks.start..block_end(nks);
                let cols = nj0..(nj0 + NC).min(n_full);
                let tiles = (j1 - j0).div_ceil(NR) * d.m.div_ceil(MR);
                Some(AskAhead::new(b, d.ldb, rows, cols, tiles))
            }
            _ => None,
        };
        let mut ask = || {
            if let Some(a) = ahead.as_mut() {
                a.next_share();
            }
        };
        let b = if packing {
            // The block's rows are a page or more apart: copy them once for every row
            // tile that reuses them (each row of B read in order; after the first block,
            // its rows were asked for while the previous one ran), on AVX-512 as panels
            // of NR columns (a tile then reads one contiguous panel, which stays in L1
            // while the row tiles run over it), on AVX2 as one panel (row tiles in turn
            // over the whole block measured faster there).
            let w = if panels { NR } else { j1 - j0 };
            packed = pack_panels(&mut buf, b, d.ldb, k0..rows_end, j0..j1, w);
            BView {
                b: packed,
                ldb: w,
                k0,
                j0,
                panel: (w, rows_end - k0),
                ahead: 0,
            }
        } else {
            BView::whole(b, d.ldb)
        };
        if packing && panels {
            // Panel by panel, every row tile over each.
            for j in (j0..j1).step_by(NR) {
                column_tiles::<MR, NR, PAIRS, ZERO>(d, a, b, c, j, ks, &mut ask);
            }
        } else {
            let mut i = 0;
            while i < d.m {
                let rows = MR.min(d.m - i);
                let mut j = j0;
                while j < j1 {
                    ask();
                    row_tile::<MR, NR, PAIRS, ZERO>(d, a, b, c, (i, rows, j), ks);
                    j += NR;
                }
                i += rows;
            }
        }
    }
    PACKED.set(buf);
    rest_columns::<NR, PAIRS, ZERO>(d, a, b, c, n_full);
}

/// [`gemm_generic`] for a C of at most [`few_rows_max`] rows over a B read from memory
/// ([`takes_few_rows`]): a decode step's matmul over row-major weights
/// (`x[m × k] · w[k × n]`). B is read in place, not packed (a packed copy is read by few
/// row tiles, and its copying is not overlapped with the FMAs): for each block of [`KC`]
/// steps (A's rows stay in L1) and each strip of columns, the strip's first row tile asks for B's lines
/// [`B_AHEAD`] rows ahead of the row it reads, and the strip's other row tiles find them
/// in L1 or L2. Tiles of up to 8 rows × 32 columns on AVX-512 (16 accumulators), of 2
/// rows × 32 columns on AVX2 (8 accumulators; each row of B read a whole 128 bytes at a
/// time: two threads, 4096 × 1024 weights on an Intel Xeon, 1 to 16 rows 1.3–2.6× as fast
/// as tiles of 8 or 16 columns and up to 8 rows). The same chains as the packed path: the
/// same bits.
#[inline(always)]
fn few_rows<const NR: usize, const PAIRS: bool, const ZERO: bool>(
    d: Dims,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) {
    debug_assert!(d.m <= few_rows_max(NR) && (NR == 16 || NR == 32));
    if NR > 16 {
        few_rows_of::<8, NR, PAIRS, ZERO>(d, a, b, c);
    } else {
        few_rows_of::<2, 32, PAIRS, ZERO>(d, a, b, c);
    }
}

/// [`few_rows`] with tiles of up to `H` rows × `W` columns.
#[inline(always)]
fn few_rows_of<const H: usize, const W: usize, const PAIRS: bool, const ZERO: bool>(
    d: Dims,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) {
    let n_full = d.n / W * W;
    let bv = BView {
        ahead: B_AHEAD,
        ..BView::whole(b, d.ldb)
    };
    for ks in Steps::blocks::<PAIRS>(d.k).filter(|_| n_full > 0) {
        for j in (0..n_full).step_by(W) {
            column_tiles::<H, W, PAIRS, ZERO>(d, a, bv, c, j, ks, &mut || {});
        }
    }
    rest_columns::<W, PAIRS, ZERO>(d, a, b, c, n_full);
}

/// Every row of C at columns `j .. j + W`, in tiles of up to `H` rows from the top. Only
/// the first tile asks for B's rows ahead (`b.ahead`): the later ones find them in cache.
#[inline(always)]
fn column_tiles<const H: usize, const W: usize, const PAIRS: bool, const ZERO: bool>(
    d: Dims,
    a: &[f32],
    b: BView<'_>,
    c: &mut [f32],
    j: usize,
    ks: Steps,
    ask: &mut impl FnMut(),
) {
    let mut i = 0;
    while i < d.m {
        ask();
        let bv = if i == 0 { b } else { BView { ahead: 0, ..b } };
        let rows = (d.m - i).min(H);
        row_tile::<H, W, PAIRS, ZERO>(d, a, bv, c, (i, rows, j), ks);
        i += rows;
    }
}

/// The columns from `j` that the tiles of `NR` columns left: a tile of 16 (when `NR` is
/// wider), then of 8, then element by element.
#[inline(always)]
fn rest_columns<const NR: usize, const PAIRS: bool, const ZERO: bool>(
    d: Dims,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    mut j: usize,
) {
    if NR > 16 && d.n - j >= 16 {
        // One vector per row: 12 rows in flight.
        narrow::<16, 12, PAIRS, ZERO>(d, a, b, c, j);
        j += 16;
    }
    if d.n - j >= 8 {
        narrow::<8, 12, PAIRS, ZERO>(d, a, b, c, j);
        j += 8;
    }
    if j < d.n {
        for r in 0..d.m {
            edge::<PAIRS, ZERO>(d, a, b, c, r, j);
        }
    }
}

/// The tile of `rows ≤ MR` rows from `i` at column `j` (`at = (i, rows, j)`).
#[inline(always)]
fn row_tile<const MR: usize, const NR: usize, const PAIRS: bool, const ZERO: bool>(
    d: Dims,
    a: &[f32],
    b: BView<'_>,
    c: &mut [f32],
    (i, rows, j): (usize, usize, usize),
    ks: Steps,
) {
    match rows {
        r if r == MR => tile::<MR, NR, PAIRS, ZERO>(d, a, b, c, i, j, ks),
        7 => tile::<7, NR, PAIRS, ZERO>(d, a, b, c, i, j, ks),
        6 => tile::<6, NR, PAIRS, ZERO>(d, a, b, c, i, j, ks),
        5 => tile::<5, NR, PAIRS, ZERO>(d, a, b, c, i, j, ks),
        4 => tile::<4, NR, PAIRS, ZERO>(d, a, b, c, i, j, ks),
        3 => tile::<3, NR, PAIRS, ZERO>(d, a, b, c, i, j, ks),
        2 => tile::<2, NR, PAIRS, ZERO>(d, a, b, c, i, j, ks),
        _ => {
            for r in i..i + rows {
                tile::<1, NR, PAIRS, ZERO>(d, a, b, c, r, j, ks);
            }
        }
    }
}

/// Columns `j .. j + W` of every row, in tiles of `R` rows (then 8, 4, 2, 1). Where a
/// tile of `R` would leave 1 to 7 rows of 16 or more, tiles of 8 take them instead (16
/// rows as 8 + 8, not 12 + 4: a tile of 8 rows keeps enough FMAs in flight, one of 4
/// waits on their latency half the time).
#[inline(always)]
fn narrow<const W: usize, const R: usize, const PAIRS: bool, const ZERO: bool>(
    d: Dims,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    j: usize,
) {
    let ks = Steps::all::<PAIRS>(d.k);
    let b = BView::whole(b, d.ldb);
    let mut i = 0;
    while d.m - i >= R {
        let left = d.m - i - R;
        if R > 8 && (1..8).contains(&left) && d.m - i >= 16 {
            break;
        }
        tile::<R, W, PAIRS, ZERO>(d, a, b, c, i, j, ks);
        i += R;
    }
    if R > 8 {
        while d.m - i >= 16 {
            tile::<8, W, PAIRS, ZERO>(d, a, b, c, i, j, ks);
            i += 8;
        }
    }
    for step in [8, 4, 2, 1] {
        if step < R && d.m - i >= step {
            match step {
                8 => tile::<8, W, PAIRS, ZERO>(d, a, b, c, i, j, ks),
                4 => tile::<4, W, PAIRS, ZERO>(d, a, b, c, i, j, ks),
                2 => tile::<2, W, PAIRS, ZERO>(d, a, b, c, i, j, ks),
                _ => tile::<1, W, PAIRS, ZERO>(d, a, b, c, i, j, ks),
            }
            i += step;
        }
    }
    debug_assert_eq!(i, d.m);
}

thread_local! {
    /// The buffer [`pack_panels`] fills, kept by each thread across calls (at most `KC + 1` rows
    /// of `NC` columns).
    static PACKED: Cell<Aligned<f32>> = const { Cell::new(Aligned::new()) };
}

/// The lines of a block of B (rows `rows` × columns `cols`, rows `ldb` apart) asked for in
/// `shares` equal shares of rows, one per [`AskAhead::next_share`] (into L2: the block is
/// packed only after the current one's tiles have run).
struct AskAhead<'b> {
    b: &'b [f32],
    ldb: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    shares: usize,
    done: usize,
}

impl<'b> AskAhead<'b> {
    fn new(
        b: &'b [f32],
        ldb: usize,
        rows: Range<usize>,
        cols: Range<usize>,
        shares: usize,
    ) -> Self {
        AskAhead {
            b,
            ldb,
            rows,
            cols,
            shares: shares.max(1),
            done: 0,
        }
    }

    /// Asks for the next share's rows (nothing once every share was asked for).
    #[inline(always)]
    fn next_share(&mut self) {
        if self.done >= self.shares {
            return;
        }
        let n = self.rows.len();
        let (from, to) = (
            self.done * n / self.shares,
            (self.done + 1) * n / self.shares,
        );
        self.done += 1;
        let width = 4 * self.cols.len();
        for p in self.rows.start + from..self.rows.start + to {
            // Inside B: rows and columns of a block the call packs next.
            let row = self.b.as_ptr().wrapping_add(p * self.ldb + self.cols.start);
            super::isa::prefetch_lines::<false>(row.cast(), width);
        }
    }
}

/// Copies rows `rows` × columns `cols` of B (`ldb` apart) into `buf` as panels of `w`
/// columns (`cols.len()` a multiple of `w`): panel after panel, each row after row.
#[inline(always)]
fn pack_panels<'b>(
    buf: &'b mut Aligned<f32>,
    b: &[f32],
    ldb: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    w: usize,
) -> &'b [f32] {
    let (n, k) = (cols.len(), rows.len());
    debug_assert!(n % w == 0);
    buf.resize(k * n, 0.0);
    for (r, p) in rows.enumerate() {
        let src = &b[p * ldb + cols.start..][..n];
        for (q, seg) in src.chunks_exact(w).enumerate() {
            buf[(q * k + r) * w..][..w].copy_from_slice(seg);
        }
    }
    buf
}

/// The rows of B a tile reads: B itself (`ldb` apart), or a block of it packed as panels
/// (rows `k0..` and columns `j0..` of B; `panel = (w, k)`: panels of `w` columns and `k`
/// rows one after the other, `ldb = w`).
#[derive(Clone, Copy)]
struct BView<'a> {
    b: &'a [f32],
    ldb: usize,
    k0: usize,
    j0: usize,
    panel: (usize, usize),
    /// Rows ahead of its current step whose lines a tile asks for (0: none).
    ahead: usize,
}

impl<'a> BView<'a> {
    #[inline(always)]
    fn whole(b: &'a [f32], ldb: usize) -> Self {
        BView {
            b,
            ldb,
            k0: 0,
            j0: 0,
            panel: (usize::MAX, 0),
            ahead: 0,
        }
    }

    /// Columns `j .. j + w` of B's row `p` (indices of B, not of the block; in a packed
    /// block, inside one panel).
    #[inline(always)]
    fn row(&self, p: usize, j: usize, w: usize) -> &'a [f32] {
        let (p, j) = (p - self.k0, j - self.j0);
        let (pw, pk) = self.panel;
        let at = (j / pw) * pw * pk + p * self.ldb + j % pw;
        &self.b[at..][..w]
    }
}

/// The steps `start..end` of the accumulation order a tile runs: the first block starts
/// each chain (from zero under `ZERO`, else from C), the last one adds the pair order's
/// odd tail; in between, each chain resumes from C.
#[derive(Clone, Copy, Debug)]
struct Steps {
    start: usize,
    end: usize,
    first: bool,
    last: bool,
}

impl Steps {
    /// The blocks of [`KC`] steps that tiles run in turn over all of `k`: at least one (a
    /// pair-order `k` of 1 has no main step, only its tail, and a `k` of 0 still starts
    /// the "into" forms' chains from zero).
    #[inline(always)]
    fn blocks<const PAIRS: bool>(k: usize) -> impl Iterator<Item = Steps> {
        let steps = main_steps::<PAIRS>(k);
        (0..steps.max(1)).step_by(KC).map(move |k0| Steps {
            start: k0,
            end: (k0 + KC).min(steps),
            first: k0 == 0,
            last: k0 + KC >= steps,
        })
    }

    /// Every step in one block.
    #[inline(always)]
    fn all<const PAIRS: bool>(k: usize) -> Steps {
        Steps {
            start: 0,
            end: main_steps::<PAIRS>(k),
            first: true,
            last: true,
        }
    }
}

/// The `R × NR` tile of C at `(i, j)` over the steps `ks` of its chains.
#[inline(always)]
fn tile<const R: usize, const NR: usize, const PAIRS: bool, const ZERO: bool>(
    d: Dims,
    a: &[f32],
    b: BView<'_>,
    c: &mut [f32],
    i: usize,
    j: usize,
    ks: Steps,
) {
    let mut acc = [[0f32; NR]; R];
    if !(ZERO && ks.first) {
        // Not `copy_from_slice`: its overlap check (debug assertions) would keep `acc` in
        // memory through the loop below ([`super::raw`]).
        for (r, row) in acc.iter_mut().enumerate() {
            super::raw::copy(row, &c[(i + r) * d.ldc + j..][..NR]);
        }
    }
    if ks.end > ks.start {
        // Raw row pointers, so that each step is R broadcasts at fixed offsets from them,
        // two vector loads of B and the FMAs (index arithmetic per step, with bounds
        // checks, cost Intel cores as much as the FMAs).
        let (p0, p1) = (ks.start, ks.end - 1);
        assert!((i + R - 1) * d.lda + p1 < a.len() && p1 < d.k);
        // The first and last rows of B the steps read are inside B (or its packed block).
        let (b_first, b_last) = (b.row(p0, j, NR).as_ptr(), b.row(p1, j, NR).as_ptr());
        // Consecutive rows of the view (of a panel, in a packed block) are `ldb` apart.
        let b_step = b.ldb;
        debug_assert_eq!(b_first.wrapping_add((p1 - p0) * b_step), b_last);
        let rows: [*const f32; R] = std::array::from_fn(|r| {
            // SAFETY: row `i + r < m` starts inside `a` (asserted above for the last row).
            unsafe { a.as_ptr().add((i + r) * d.lda) }
        });
        // Up to 8 rows, each row's pointer stays in a register of its own and every
        // broadcast reads `[row + 4p]`: seeing that the rows are `lda` apart, LLVM instead
        // rebuilt them each step from one pointer with a chain of `lea`s (and on AVX2
        // spilled a register), which took issue slots on the FMA ports (without it: AVX2
        // sparse_mla 4-11% faster, AVX-512 indexer up to 5%; benches/RESULTS.md). Taller
        // tiles have too few registers for that and keep the chain.
        let rows = if R <= 8 {
            std::hint::black_box(rows)
        } else {
            rows
        };
        // B's rows asked for ahead (the few-row path): the first `ahead` now, then row
        // `p + ahead` at step `p` while it is one of the block's (steps after that run
        // without asking). A request is a hint: it reads nothing the program observes.
        let ahead = b.ahead.min(p1 + 1 - p0);
        let ask = |row: *const f32| super::isa::prefetch_lines::<true>(row.cast(), 4 * NR);
        for q in 0..ahead {
            ask(b_first.wrapping_add(q * b_step));
        }
        // Steps of k per iteration: one, or in pair order a whole pair (`start` and `end`
        // even), the odd index of each first.
        let s = if PAIRS { 2 } else { 1 };
        debug_assert!(!PAIRS || (ks.start % 2 == 0 && ks.end % 2 == 0));
        let mut p = p0;
        // Passes the last row after the last iteration: never read then.
        let mut bp = b_first;
        if ahead > 0 {
            while p + ahead + s <= ks.end {
                for q in ahead..ahead + s {
                    ask(bp.wrapping_add(q * b_step));
                }
                // SAFETY: rows `p .. p + s <= p1 + 1` of the view, at `bp` and `b_step`
                // apart, and of A: as above.
                unsafe { steps::<PAIRS, R, NR>(&mut acc, &rows, p, bp, b_step) };
                p += s;
                bp = bp.wrapping_add(s * b_step);
            }
        }
        while p < ks.end {
            // SAFETY: as in the loop above.
            unsafe { steps::<PAIRS, R, NR>(&mut acc, &rows, p, bp, b_step) };
            p += s;
            bp = bp.wrapping_add(s * b_step);
        }
    }
    if PAIRS && ks.last && d.k % 2 == 1 {
        let p = d.k - 1;
        let bp = b.row(p, j, NR);
        for (r, row) in acc.iter_mut().enumerate() {
            let av = a[(i + r) * d.lda + p];
            for (x, &bv) in row.iter_mut().zip(bp) {
                *x = tail(*x, av, bv);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        super::raw::copy(&mut c[(i + r) * d.ldc + j..][..NR], row);
    }
}

/// One iteration of a tile's loop from step `p` (B's row `p` at `bp`): [`step`] `p`, or
/// in pair order (`p` even) index `p + 1` (B's row at `bp + b_step`) then `p`, written so
/// that the compiler sees constant offsets from one index.
///
/// # Safety
/// As [`step`] for each index: `rows[r].add(p)` (and `rows[r].add(p + 1)` in pair order)
/// is an element of A, and `bp` (and `bp + b_step`) point at `NR` readable `f32`.
#[inline(always)]
unsafe fn steps<const PAIRS: bool, const R: usize, const NR: usize>(
    acc: &mut [[f32; NR]; R],
    rows: &[*const f32; R],
    p: usize,
    bp: *const f32,
    b_step: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        if PAIRS {
            step(acc, rows, p + 1, bp.add(b_step));
        }
        step(acc, rows, p, bp);
    }
}

/// One step of a tile: `C[r][..] += A[r][p] · B[p][..]`, B's segment held in registers.
/// A function, not a closure: `inline(always)` puts it into the caller's vector target
/// features in every profile (an out-of-line closure compiled `mul_add` as a call to the
/// software `fmaf`, 27x slower in the dev profile the tests build).
///
/// # Safety
/// `rows[r].add(p)` is an element of A for every `r`, and `bp` points at `NR` readable
/// `f32` (B's row `p` from the tile's column).
#[inline(always)]
unsafe fn step<const R: usize, const NR: usize>(
    acc: &mut [[f32; NR]; R],
    rows: &[*const f32; R],
    p: usize,
    bp: *const f32,
) {
    // SAFETY: `bp` points at NR readable f32 (the caller's contract).
    let bv: [f32; NR] = unsafe { super::raw::read(bp.cast()) };
    for (row, &ar) in acc.iter_mut().zip(rows) {
        // SAFETY: `ar.add(p)` is inside A (the caller's contract).
        let av = unsafe { super::raw::read(ar.add(p)) };
        for (x, &y) in row.iter_mut().zip(&bv) {
            *x = av.mul_add(y, *x);
        }
    }
}

#[inline(always)]
fn edge<const PAIRS: bool, const ZERO: bool>(
    d: Dims,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    i: usize,
    j0: usize,
) {
    for j in j0..d.n {
        let mut x = if ZERO { 0.0 } else { c[i * d.ldc + j] };
        for step in 0..main_steps::<PAIRS>(d.k) {
            let p = order::<PAIRS>(step);
            x = a[i * d.lda + p].mul_add(b[p * d.ldb + j], x);
        }
        if PAIRS && d.k % 2 == 1 {
            let p = d.k - 1;
            x = tail(x, a[i * d.lda + p], b[p * d.ldb + j]);
        }
        c[i * d.ldc + j] = x;
    }
}

/// Lanes of a splatted operand ([`splat`]): one AVX2 vector.
pub const SPLAT: usize = 8;

/// `out[i·SPLAT..(i + 1)·SPLAT] = [x[i]; SPLAT]`: the A operand of
/// [`gemm_pairs_into_f16b`] (each element as a whole vector, which an FMA then reads from
/// memory: no broadcast register per row of the tile). Writes `out[..SPLAT · x.len()]`
/// and nothing else; panics if `out` is shorter. Inlined into its caller, so that it runs
/// on the caller's vector path (a broadcast and one store per element; compiled apart it
/// was SSE2, 4% of the few-head indexer).
#[inline(always)]
pub fn splat(x: &[f32], out: &mut [f32]) {
    let out = &mut out[..x.len() * SPLAT];
    for (o, &v) in out.chunks_exact_mut(SPLAT).zip(x) {
        o.fill(v);
    }
}

/// `C[m×n] = A · B` with [`gemm_pairs_into`]'s bits (pair order from `+0`), A given
/// transposed and splatted (`at8` = [`splat`] of Aᵀ, `k × m` with rows `d.lda ≥ m` apart:
/// element `(i, p)` of A at `at8[(p·d.lda + i)·SPLAT..]`) and B as f16 bits
/// (`b[p·d.ldb + j]`), each widened exactly to f32 as it is loaded. On the `avx2` path with
/// `m` and `n` multiples of 8 and `k` even: tiles of 4 rows × 24 columns (or 8 × 8), B
/// loaded through `vcvtph2ps` (instead of widened rows stored and reloaded),
/// A read by the FMAs themselves; on the AVX-512 paths (`n` a multiple of 16) tiles of 8
/// rows × 32 columns, A broadcast from memory; elsewhere element by element. For the key
/// scores of few query heads over fp8 keys ([`super::widen::e4m3_f16_row`]). Panics if a
/// slice is too short for `d`.
pub fn gemm_pairs_into_f16b(isa: CpuIsa, d: Dims, at8: &[f32], b: &[u16], c: &mut [f32]) {
    if d.m == 0 || d.n == 0 {
        return;
    }
    assert!(d.lda >= d.m && d.ldb >= d.n && d.ldc >= d.n);
    assert!(d.k == 0 || at8.len() >= ((d.k - 1) * d.lda + d.m) * SPLAT);
    assert!(d.k == 0 || b.len() >= (d.k - 1) * d.ldb + d.n);
    assert!(c.len() >= (d.m - 1) * d.ldc + d.n);
    #[cfg(target_arch = "x86_64")]
    if d.m % 8 == 0 && d.k % 2 == 0 {
        match isa.isa() {
            Isa::Avx2 if d.n % 8 == 0 => {
                // SAFETY: the avx2 path's CPU has AVX2, FMA and F16C (`Isa::supported`);
                // the slices hold `d` (asserted above), the shape is the kernel's.
                unsafe { f16b_avx2(d, at8, b, c) };
                return;
            }
            Isa::Amx | Isa::Avx512 | Isa::Avx512Bf16 if d.n % 16 == 0 => {
                // SAFETY: the AVX-512 paths' CPU has AVX-512F (`Isa::supported`); as above.
                unsafe { f16b_avx512(d, at8, b, c) };
                return;
            }
            _ => {}
        }
    }
    let _ = isa;
    let pairs = main_steps::<true>(d.k);
    for i in 0..d.m {
        for j in 0..d.n {
            let bv = |p: usize| half::f16::from_bits(b[p * d.ldb + j]).to_f32();
            let mut x = 0f32;
            for step in 0..pairs {
                let p = order::<true>(step);
                x = at8[(p * d.lda + i) * SPLAT].mul_add(bv(p), x);
            }
            if d.k % 2 == 1 {
                x = tail(x, at8[((d.k - 1) * d.lda + i) * SPLAT], bv(d.k - 1));
            }
            c[i * d.ldc + j] = x;
        }
    }
}

/// [`gemm_pairs_into_f16b`]'s AVX-512 tiles: 8 rows × 32 columns (then 16), per step of
/// `k` two `vcvtph2ps` loads of 16 columns of B and 16 FMAs, each broadcasting its element
/// of A from memory (16 chains in flight).
///
/// # Safety
/// The CPU has AVX-512F; `m` is a multiple of 8, `n` of 16, `k` is even, and the slices
/// hold `d` (as [`gemm_pairs_into_f16b`] asserts).
#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
#[target_feature(enable = "avx512f")]
unsafe fn f16b_avx512(d: Dims, at8: &[f32], b: &[u16], c: &mut [f32]) {
    for i0 in (0..d.m).step_by(8) {
        let mut j0 = 0;
        while j0 < d.n {
            // SAFETY: the caller's contract; tiles inside `m × n`.
            unsafe {
                if d.n - j0 >= 32 {
                    f16b_tile512::<2>(d, at8, b, c, i0, j0);
                    j0 += 32;
                } else {
                    f16b_tile512::<1>(d, at8, b, c, i0, j0);
                    j0 += 16;
                }
            }
        }
    }
}

/// The `8 × 16·NV` tile of [`f16b_avx512`] at `(i0, j0)`.
///
/// # Safety
/// As [`f16b_avx512`], with the tile inside `m × n`.
#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn f16b_tile512<const NV: usize>(
    d: Dims,
    at8: &[f32],
    b: &[u16],
    c: &mut [f32],
    i0: usize,
    j0: usize,
) {
    use std::arch::x86_64::*;
    // SAFETY: every read is Aᵀ[p][i0 + r] (lane 0 of its splat) or B[p][j0..j0 + 16·NV]
    // with `p < k`, every write C[i0 + r][j0..j0 + 16·NV]: inside the slices by the
    // caller's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; 8];
        let mut p = 0;
        while p < d.k {
            // The odd index of each pair first.
            for q in [p + 1, p] {
                let bp = b.as_ptr().add(q * d.ldb + j0);
                // Reads through [`super::raw`]: the intrinsics' checked copies (debug
                // assertions) would run each load through the stack.
                let bv: [__m512; NV] = std::array::from_fn(|v| {
                    _mm512_cvtph_ps(super::raw::read(bp.add(16 * v).cast::<__m256i>()))
                });
                let ap = at8.as_ptr().add((q * d.lda + i0) * SPLAT);
                for (r, row) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(super::raw::read(ap.add(r * SPLAT)));
                    for (x, &y) in row.iter_mut().zip(&bv) {
                        *x = _mm512_fmadd_ps(av, y, *x);
                    }
                }
            }
            p += 2;
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                super::raw::write::<__m512>(
                    c.as_mut_ptr().add((i0 + r) * d.ldc + j0 + 16 * v).cast(),
                    *x,
                );
            }
        }
    }
}

/// [`gemm_pairs_into_f16b`]'s AVX2 tiles, each FMA reading its splatted element of A from
/// memory. Where `n` is a multiple of 16: 4 rows × 24 columns (per step of `k` three
/// `vcvtph2ps` loads of B and 4 of A for 12 FMAs, 12 chains in flight), the last 16 or 8
/// columns 4 × 16 or 4 × 8; else 8 rows × 8 columns (one load of B and 8 of A for 8 FMAs:
/// 8 chains, just the two FMA units' latency). The 9 loads of the 8 × 8 tile were more than
/// the load ports keep up with: AMD Zen 4 on forced `avx2`, one thread, the tiny indexer
/// decode 1180 µs with 8 × 8, 1120 µs with 4 × 16 (as with 2 × 32), and in calls of a whole
/// block 1070 µs with 4 × 16, 1020 µs with 4 × 24.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `m` and `n` are multiples of 8, `k` is even, and the
/// slices hold `d` (as [`gemm_pairs_into_f16b`] asserts).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16b_avx2(d: Dims, at8: &[f32], b: &[u16], c: &mut [f32]) {
    // SAFETY: the caller's contract; every tile is inside `m × n`.
    unsafe {
        if d.n % 16 == 0 && d.m % 4 == 0 {
            for i0 in (0..d.m).step_by(4) {
                let mut j0 = 0;
                while d.n - j0 >= 24 {
                    f16b_tile_avx2::<4, 3>(d, at8, b, c, i0, j0);
                    j0 += 24;
                }
                match d.n - j0 {
                    16 => f16b_tile_avx2::<4, 2>(d, at8, b, c, i0, j0),
                    8 => f16b_tile_avx2::<4, 1>(d, at8, b, c, i0, j0),
                    _ => {}
                }
            }
        } else {
            for i0 in (0..d.m).step_by(8) {
                for j0 in (0..d.n).step_by(8) {
                    f16b_tile_avx2::<8, 1>(d, at8, b, c, i0, j0);
                }
            }
        }
    }
}

/// One tile of [`f16b_avx2`]: `R` rows × `V` vectors of 8 columns from `(i0, j0)`.
///
/// # Safety
/// As [`f16b_avx2`], with the tile inside `m × n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16b_tile_avx2<const R: usize, const V: usize>(
    d: Dims,
    at8: &[f32],
    b: &[u16],
    c: &mut [f32],
    i0: usize,
    j0: usize,
) {
    use std::arch::x86_64::*;
    // SAFETY: every read is Aᵀ[p][i0..i0 + R] or B[p][j0..j0 + 8V] with `p < k`, every
    // write C[i0 + r][j0..j0 + 8V]: inside the slices by the caller's contract.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); V]; R];
        let mut p = 0;
        while p < d.k {
            // The odd index of each pair first.
            for q in [p + 1, p] {
                // Reads through [`super::raw`], as in the AVX-512 tile.
                let bp = b.as_ptr().add(q * d.ldb + j0);
                let bv: [__m256; V] = std::array::from_fn(|v| {
                    _mm256_cvtph_ps(super::raw::read(bp.add(8 * v).cast::<__m128i>()))
                });
                let ap = at8.as_ptr().add((q * d.lda + i0) * SPLAT);
                for (r, row) in acc.iter_mut().enumerate() {
                    let av: __m256 = super::raw::read(ap.add(r * SPLAT).cast());
                    for (x, &y) in row.iter_mut().zip(&bv) {
                        *x = _mm256_fmadd_ps(av, y, *x);
                    }
                }
            }
            p += 2;
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                super::raw::write::<__m256>(
                    c.as_mut_ptr().add((i0 + r) * d.ldc + j0 + 8 * v).cast(),
                    *x,
                );
            }
        }
    }
}

/// Asserts that the `m × n` view (rows `ldc` apart) of `got` has `want`'s bits, element by
/// element (what lies between the rows is not compared): the GEMM tests' check of an
/// "into" product, whose C is poisoned outside the view.
#[cfg(test)]
pub(crate) fn assert_view_bits(
    got: &[f32],
    want: &[f32],
    (m, n, ldc): (usize, usize, usize),
    what: &str,
) {
    for i in 0..m {
        for j in 0..n {
            let e = i * ldc + j;
            assert_eq!(
                got[e].to_bits(),
                want[e].to_bits(),
                "{what} row {i} column {j}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The f16-B GEMM gives [`gemm_pairs_into`]'s bits (B widened first, A untransposed)
    /// on every path, on the AVX2 kernel's shapes and the element-wise rest: random f16
    /// values of every class but NaN (subnormals, zeros of both signs, infinities), A
    /// with exact-cancelling signs, C poisoned.
    #[test]
    fn f16b_matches_the_pair_order_on_widened_b() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for (m, n, k) in [
            (8, 8, 64),
            (16, 32, 64),
            (8, 64, 128),
            (8, 48, 64),
            (16, 16, 6),
            (8, 24, 2),
            (5, 13, 7),
        ] {
            let (lda, ldb, ldc) = (m + 3, n + 8, n + 5);
            let bh: Vec<u16> = (0..k * ldb)
                .map(|_| loop {
                    let x: u16 = rng.gen();
                    // Not NaN (an exponent of all ones with a nonzero mantissa).
                    if x & 0x7c00 != 0x7c00 || x & 0x3ff == 0 {
                        break x;
                    }
                })
                .collect();
            let at: Vec<f32> = (0..k * lda)
                .map(|_| rng.gen_range(-2.0f32..2.0) * [1.0, 0.0, 1e-30][rng.gen_range(0..3)])
                .collect();
            // A row-major and B widened, for the reference.
            let a: Vec<f32> = (0..m * k).map(|x| at[(x % k) * lda + x / k]).collect();
            let bf: Vec<f32> = bh
                .iter()
                .map(|&x| half::f16::from_bits(x).to_f32())
                .collect();
            let mut want = vec![f32::NAN; m * ldc];
            let dr = Dims {
                m,
                n,
                k,
                lda: k,
                ldb,
                ldc,
            };
            gemm_pairs_into(CpuIsa::new(Isa::Scalar).unwrap(), dr, &a, &bf, &mut want);
            let mut at8 = vec![f32::NAN; at.len() * SPLAT];
            splat(&at, &mut at8);
            for isa in CpuIsa::available() {
                let mut got = vec![f32::NAN; m * ldc];
                let d = Dims {
                    m,
                    n,
                    k,
                    lda,
                    ldb,
                    ldc,
                };
                gemm_pairs_into_f16b(isa, d, &at8, &bh, &mut got);
                for i in 0..m {
                    for j in 0..n {
                        let (g, w) = (got[i * ldc + j], want[i * ldc + j]);
                        assert!(
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                            "{} {m}x{n}x{k} ({i}, {j}): {g} vs {w}",
                            isa.isa()
                        );
                    }
                }
            }
        }
    }

    fn naive(d: Dims, a: &[f32], b: &[f32], c: &mut [f32], pairs: bool) {
        for i in 0..d.m {
            for j in 0..d.n {
                let mut x = c[i * d.ldc + j];
                let ab = |p: usize| (a[i * d.lda + p], b[p * d.ldb + j]);
                if pairs {
                    for p in (0..d.k).step_by(2) {
                        if p + 1 < d.k {
                            let (u, v) = ab(p + 1);
                            x = u.mul_add(v, x);
                        } else {
                            x += 0.0;
                        }
                        let (u, v) = ab(p);
                        x = u.mul_add(v, x);
                    }
                } else {
                    for p in 0..d.k {
                        let (u, v) = ab(p);
                        x = u.mul_add(v, x);
                    }
                }
                c[i * d.ldc + j] = x;
            }
        }
    }

    /// A splat into a poisoned buffer (of its size or longer) writes exactly `SPLAT`
    /// copies of each value over its span and leaves the rest; a shorter one panics.
    #[test]
    fn splat_writes_exactly_its_span() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for (len, extra) in [(37, 0), (37, 5), (1, 400), (64, 3)] {
            let x: Vec<f32> = (0..len).map(|_| rng.gen_range(-9.0f32..9.0)).collect();
            let mut out = vec![f32::NAN; len * SPLAT + extra];
            splat(&x, &mut out);
            for (i, o) in out.iter().enumerate() {
                if i < len * SPLAT {
                    assert_eq!(o.to_bits(), x[i / SPLAT].to_bits(), "{len} {extra} {i}");
                } else {
                    assert!(o.is_nan(), "{len} {extra} {i}: written past the span");
                }
            }
        }
        let short = std::panic::catch_unwind(|| splat(&[1.0; 4], &mut [0.0; 4 * SPLAT - 1]));
        assert!(short.is_err());
    }

    #[test]
    fn narrow_pair_order_products_match_sequential_fma_bitwise() {
        // The AVX-512 tiles of at most 8 columns (`pairs_rows8_avx512`): rows of A 64 and
        // 128 apart (constant offsets) and not, every tail after the tiles of 16, masked
        // widths, B exactly as long as its last row's `n` columns (the masked loads must
        // not read past it), C poisoned and its gaps checked.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &k in &[64usize, 128, 10, 2] {
            for &m in &[1usize, 5, 15, 16, 17, 33, 64] {
                for n in 1..=8usize {
                    for lda in [k, k + 5] {
                        let d = Dims {
                            m,
                            n,
                            k,
                            lda,
                            ldb: n,
                            ldc: n + 2,
                        };
                        let a: Vec<f32> = (0..m * lda).map(|_| rng.gen_range(-1.0..1.0)).collect();
                        let b: Vec<f32> = (0..k * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
                        let mut want = vec![0f32; m * d.ldc];
                        naive(d, &a, &b, &mut want, true);
                        for isa in CpuIsa::available() {
                            let mut got = vec![f32::NAN; m * d.ldc];
                            gemm_pairs_into(isa, d, &a, &b, &mut got);
                            let what = format!("{} m={m} n={n} k={k} lda={lda}", isa.isa());
                            assert_view_bits(&got, &want, (m, n, d.ldc), &what);
                            let gaps = got.chunks(d.ldc).all(|r| r[n..].iter().all(|x| x.is_nan()));
                            assert!(gaps, "{what}: wrote past the columns");
                        }
                    }
                }
            }
        }
    }

    /// `gemm_pairs_relu_sums` gives, on every path, the bits of its definition:
    /// `gemm_pairs_into`'s C, then each row's sum of `w[j]·max(c, 0)` by scalar FMAs in
    /// column order from `+0`, times the row's scale. NaN scores (a NaN in a row of A) count
    /// as 0; weights and scales of both signs; rows 64 and 128 apart and not, every tail
    /// after the tiles of 16 and 8, 1 to 9 columns, odd `k` (the other route); outputs
    /// poisoned, nothing written past `m`.
    #[test]
    fn relu_sums_give_the_definitions_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &k in &[64usize, 128, 10, 7] {
            for &m in &[1usize, 5, 8, 9, 15, 16, 17, 24, 33, 64] {
                for n in 1..=9usize {
                    let lda = if m % 2 == 0 { k } else { k + 5 };
                    let d = Dims {
                        m,
                        n,
                        k,
                        lda,
                        ldb: n,
                        ldc: n + 2,
                    };
                    let mut a: Vec<f32> = (0..m * lda).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    for _ in 0..m / 6 {
                        let at = rng.gen_range(0..a.len());
                        a[at] = f32::NAN;
                    }
                    let b: Vec<f32> = (0..k * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    let w: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                    let scale: Vec<f32> = (0..m).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
                    for isa in CpuIsa::available() {
                        let what = format!("{} m={m} n={n} k={k} lda={lda}", isa.isa());
                        let mut c = vec![f32::NAN; m * d.ldc];
                        gemm_pairs_into(isa, d, &a, &b, &mut c);
                        let mut out = vec![f32::NAN; m + 3];
                        out[m..].fill(-7.0);
                        let mut work = vec![f32::NAN; m * d.ldc];
                        gemm_pairs_relu_sums(isa, d, &a, &b, &w, &scale, &mut work, &mut out);
                        assert_relu_sums(&out, &c, (m, n, d.ldc), &w, &scale, &what);
                    }
                }
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
            // Rows left as tiles of 8 (16 = 8 + 8, 19 = 8 + 8 + 2 + 1).
            (16, 8, 64),
            (19, 24, 33),
            (37, 24, 10),
            (100, 56, 7),
            (29, 61, 33),
            (11, 16, 3),
            // Several cache blocks of k (odd k: the pair tail after the last block) and
            // of columns.
            (13, 70, 600),
            (7, 300, 513),
            (20, 530, 257),
            // Packed blocks of B (more rows than `few_rows` takes, `ldb` wider than a
            // block): whole k blocks, and a block whose rows end at the pair tail.
            (40, 1030, 512),
            (31, 1100, 257),
            // Few rows over rows of B a page apart (`few_rows`: B read in place, its rows
            // asked for ahead): 8 rows over several k blocks with leftover columns;
            // leftover columns in tiles of 16 and 8; 21 rows as tiles of 8, 8 and 5 on
            // AVX-512 (packed on AVX2); several row tiles (the later ones find B in
            // cache); rows within one tile's height; a k shorter than the rows asked for
            // ahead; a single step.
            (8, 1030, 600),
            (5, 1048, 70),
            (21, 1060, 300),
            (16, 1030, 300),
            (13, 1025, 41),
            (7, 1040, 513),
            (6, 1100, 257),
            (1, 1100, 30),
            (3, 1023, 1),
            // Nothing to sum: C unchanged, or +0 from the "into" forms.
            (5, 9, 0),
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
            let mut c0: Vec<f32> = (0..m * d.ldc).map(|_| rng.gen_range(-1.0..1.0)).collect();
            // Signed zeros: the odd tail's `+0` turns -0 into +0 in pair order.
            c0[0] = -0.0;
            for pairs in [false, true] {
                let mut c1 = c0.clone();
                let mut c2 = c0.clone();
                naive(d, &a, &b, &mut c2, pairs);
                // Every path this CPU has agrees bit for bit with the sequential FMAs.
                for isa in CpuIsa::available() {
                    c1.copy_from_slice(&c0);
                    if pairs {
                        gemm_acc_pairs(isa, d, &a, &b, &mut c1);
                    } else {
                        gemm_acc(isa, d, &a, &b, &mut c1);
                    }
                    let same = c1.iter().zip(&c2).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "m={m} n={n} k={k} pairs={pairs} {:?}", isa.isa());
                    // From zero: the bits of accumulating into zeros, C never read.
                    let mut z = vec![0f32; c0.len()];
                    naive(d, &a, &b, &mut z, pairs);
                    c1.fill(f32::NAN);
                    if pairs {
                        gemm_pairs_into(isa, d, &a, &b, &mut c1);
                    } else {
                        gemm_into(isa, d, &a, &b, &mut c1);
                    }
                    let what = format!("into m={m} n={n} k={k} pairs={pairs}");
                    assert_view_bits(&c1, &z, (m, n, d.ldc), &what);
                }
            }
        }
    }
}
