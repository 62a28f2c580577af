//! The bf16 dot product: the arithmetic every CPU path uses for the dot products of the
//! indexer and of sparse attention, and its `vdpbf16ps` kernel (the `avx512bf16` path).
//!
//! # What `vdpbf16ps` computes (checked on this hardware by this module's tests)
//!
//! `VDPBF16PS acc, a, b` treats each 32-bit lane of `a` and `b` as a pair of bf16 values
//! (element 0 in the low half) and computes, per lane, as Intel's SDM states:
//!
//! ```text
//! acc = acc + a[1]·b[1]     // the odd element first
//! acc = acc + a[0]·b[0]
//! ```
//!
//! each step one fused multiply-add **rounded once to nearest-even** (a product of two
//! bf16 values has at most 16 significant bits, so it is exact in f32 and the step is
//! `round(acc + a·b)`), with **denormals-are-zero** on every input (bf16 subnormals and a
//! subnormal `acc` read as signed zero) and **flush-to-zero** on each step's result; the
//! MXCSR is neither read nor written. So the instruction is two ordinary f32 FMAs in a
//! fixed order, not a wider or more precise dot product, and its error is that of the
//! f32 FMA chain it replaces (the tolerance table's f32 accumulation term): using it
//! changes no tolerance.
//!
//! # One arithmetic on every path
//!
//! The indexer's and attention's dot products are defined as that sequence: over the
//! contraction index `p`, pairs `(0, 1), (2, 3), …`, odd member first, and for an odd
//! length the last index after a `+0` (its missing partner, which the kernels store as a
//! zero). The f32 paths (AVX-512, AVX2, scalar) run it as f32 FMAs in that order
//! ([`super::gemm::gemm_acc_pairs`]) on operands that are bf16 values with subnormals
//! flushed ([`bf16_daz`], [`round_bf16_daz`]): every path then gives the **same bits**,
//! except where a partial sum is itself an f32 subnormal (|s| < 2^-126, nonzero), which
//! `vdpbf16ps` flushes to zero and an f32 FMA keeps (an absolute difference below 2^-126
//! per step, far inside every tolerance; ordinary data never comes near it).
//!
//! The operands of the kernel: `A` row-major bf16 (`[m × 2·k2]`, a pair is two adjacent
//! elements of a row; or pair-major, `[k2][lda]` of u32, for [`gemm_bf16_pair_major`]; or
//! one slice per row, for [`gemm_bf16_gathered_into`]), `B` packed as pairs (`[k2][ldb]`
//! of u32: pair `p` of column `j` holds `B[2p][j]` in its low half and `B[2p+1][j]` in its
//! high half), `C` row-major f32.

use super::isa::{CpuIsa, Isa};

/// bf16 bits as f32, a subnormal read as signed zero (what `vdpbf16ps` reads).
#[inline(always)]
pub fn bf16_daz(bits: u16) -> f32 {
    let b = bits as u32;
    let b = if b & 0x7f80 == 0 { b & 0x8000 } else { b };
    f32::from_bits(b << 16)
}

/// bf16 bits with a subnormal flushed to signed zero (as [`bf16_daz`] reads it), and
/// whether it was one.
#[inline(always)]
pub fn bf16_bits_daz(b: u16) -> (u16, bool) {
    if b & 0x7f80 == 0 {
        (b & 0x8000, b & 0x7f != 0)
    } else {
        (b, false)
    }
}

/// An f32 that holds a bf16 value, a subnormal flushed to signed zero.
#[inline(always)]
pub fn f32_daz(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(if b & 0x7f80_0000 == 0 {
        b & 0x8000_0000
    } else {
        b
    })
}

/// f32 rounded to bf16 bits: nearest, ties to even, NaN stays NaN (quietened) — the bits
/// of `half::bf16::from_f32`, without its early return so that a row of these vectorises.
#[inline(always)]
pub fn round_bf16(x: f32) -> u16 {
    // Round to nearest even by adding 0x7fff plus the kept part's lowest bit (the carry
    // rounds up exactly when the dropped half exceeds one half, or equals it with an odd
    // kept part); NaN keeps its top half, quietened.
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let r = if b & 0x7fff_ffff > 0x7f80_0000 {
        (b >> 16) | 0x0040
    } else {
        rounded
    };
    r as u16
}

/// `out[i] = round_bf16(x[i] · a · b)` (two f32 products in that order, then [`round_bf16`]:
/// `half::bf16::from_f32`'s bits) for `i < min(x.len(), out.len())`. On the `avx512bf16`
/// path by `vcvtne2ps2bf16` (32 values per instruction; it rounds as [`round_bf16`] does,
/// NaN quietened the same way, but reads a subnormal as zero: a vector holding a subnormal
/// product is converted value by value instead); elsewhere value by value, for the
/// compiler to vectorise. The same bits on every path.
pub fn scaled_bf16_row(isa: CpuIsa, x: &[f32], a: f32, b: f32, out: &mut [u16]) {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.isa().bf16_dot() {
        // SAFETY: the avx512bf16 path exists only on a CPU with AVX-512F, AVX-512BW and
        // AVX512_BF16 (checked when its `CpuIsa` was made); `x` and `out` have one length.
        done = unsafe { x86::scaled_bf16_row(x, a, b, out) };
    }
    scaled_bf16_values(isa, &x[done..], a, b, &mut out[done..]);
}

crate::isa_dispatch! {
    /// [`scaled_bf16_row`] value by value, compiled for the path so that it vectorises at
    /// the path's width (the portable build has only SSE2: 4 lanes and no blend).
    fn scaled_bf16_values(x: &[f32], a: f32, b: f32, out: &mut [u16]) = |ISA| {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = round_bf16(v * a * b);
        }
    };
}

/// [`round_bf16`] with a subnormal result flushed to signed zero: the bf16 bits a dot
/// product of every path reads.
#[inline(always)]
pub fn round_bf16_daz(x: f32) -> u16 {
    let r = round_bf16(x);
    if r & 0x7f80 == 0 {
        r & 0x8000
    } else {
        r
    }
}

/// An fp8 e4m3fn code's value (exact; the same bits as
/// [`sparsekit_kernels::fp8::e4m3_to_f32`] for every code), with selects instead of
/// branches so that a row of codes vectorises: a code's fields placed in an f32 with the
/// exponent re-biased (an integer add; a subnormal code then needs one subtraction). No
/// operation sees an f32 subnormal (on Intel cores a multiply with a subnormal operand
/// takes a microcode assist of about a hundred cycles: the earlier form, the fields as a
/// subnormal f32 times 2^120, made random fp8 keys 2.8× slower there). Its top 16 bits are
/// its bf16 bits (at most 4 significant bits).
#[inline(always)]
pub fn e4m3_f32(code: u8) -> f32 {
    let c = code as u32;
    let x = c & 0x7f;
    let normal = (x << 20) + (120 << 23);
    // A subnormal code (x < 8) read with exponent field 1 is (1 + m/8)·2^-6; minus 2^-6
    // that is exactly m·2^-9 (Sterbenz), and nothing was subnormal.
    let sub = (f32::from_bits(normal + (1 << 23)) - 1.0 / 64.0).to_bits();
    let bits = if x < 8 { sub } else { normal };
    let bits = if x == 0x7f { 0x7fc0_0000 } else { bits };
    f32::from_bits(bits | (c & 0x80) << 24)
}

/// Whether an f32 is exactly a bf16 value (its low 16 bits are zero).
#[inline(always)]
pub fn is_bf16(x: f32) -> bool {
    x.to_bits() & 0xffff == 0
}

/// Shape of `C[m×n] += A[m×2·k2] · B[2·k2×n]` (module docs): `lda` in bf16 elements
/// (at least `2·k2`), `ldb` in pairs (at least `n` rounded up to 16: the kernel reads
/// whole vectors of 16 columns), `ldc` in f32.
#[derive(Clone, Copy, Debug)]
pub struct PairDims {
    pub m: usize,
    pub n: usize,
    pub k2: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

/// Columns of packed `B` a call reads: `n` rounded up to whole vectors of 16.
pub const fn padded_cols(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// `C += A · B` in the pair order of the module docs. On the `avx512bf16` path it runs the
/// `vdpbf16ps` kernel; on any other path an emulation of it with f32 FMAs (exact, with
/// its flushes: for tests, not speed). Panics if a slice is too short for `d`.
pub fn gemm_bf16(isa: CpuIsa, d: PairDims, a: &[u16], b: &[u32], c: &mut [f32]) {
    run(isa, d, A::strided(AStep::rows(&d), a), b, c, false)
}

/// [`gemm_bf16`] into `C = A · B`: each element's chain starts from `+0` (C is not read).
pub fn gemm_bf16_into(isa: CpuIsa, d: PairDims, a: &[u16], b: &[u32], c: &mut [f32]) {
    run(isa, d, A::strided(AStep::rows(&d), a), b, c, true)
}

/// [`gemm_bf16`] with `A` stored pair-major: `a[p · lda + i]` holds row `i`'s pair `p`
/// (`A[i][2p]` in its low half; `lda` in pairs, at least `m`). The same arithmetic and
/// bits as [`gemm_bf16`] on the row-major `A`; a register tile's pairs of one step are
/// then adjacent (attention's probabilities: a key pair's heads side by side).
pub fn gemm_bf16_pair_major(isa: CpuIsa, d: PairDims, a: &[u32], b: &[u32], c: &mut [f32]) {
    let a = A::strided(AStep::pair_major(&d), bytemuck::cast_slice(a));
    run(isa, d, a, b, c, false)
}

/// [`gemm_bf16_pair_major`] into `C = A · B` (as [`gemm_bf16_into`]).
pub fn gemm_bf16_pair_major_into(isa: CpuIsa, d: PairDims, a: &[u32], b: &[u32], c: &mut [f32]) {
    let a = A::strided(AStep::pair_major(&d), bytemuck::cast_slice(a));
    run(isa, d, a, b, c, true)
}

/// [`gemm_bf16_into`] with each row of `A` its own slice (`rows[i]` is row `i`, pair `p`
/// at `rows[i][2p..2p + 2]`): scattered rows, such as a cache's bf16 key rows, read where
/// they lie instead of being copied together first. `d.m` is `rows.len()`; `d.lda` is not
/// read. The same arithmetic and bits as [`gemm_bf16_into`] on the rows copied together.
/// Panics if a row is shorter than `2 · d.k2` or a slice is too short for `d`.
pub fn gemm_bf16_gathered_into(
    isa: CpuIsa,
    d: PairDims,
    rows: &[&[u16]],
    b: &[u32],
    c: &mut [f32],
) {
    assert_eq!(rows.len(), d.m, "one slice per row of A");
    run(isa, d, A::Rows(rows), b, c, true)
}

/// [`gemm_bf16_into`] for keys stored as fp8 e4m3 codes: `A`'s rows are the codes of
/// `runs` in order (each run whole rows of `2·k2` codes, such as a cache page's adjacent
/// key rows; `d.m` rows in all), each code widened to its bf16 value (exact) into `kb`
/// (row `i` at `kb[i · 2·k2 ..]`, left there on return) and multiplied in the module's
/// pair order. The same bits as widening the rows with [`super::widen::e4m3_row_pow2`]
/// (`k = 0`) and calling [`gemm_bf16_into`] on `kb` with `lda = 2·k2`; `d.lda` is not
/// read.
///
/// On the `avx512bf16` path of a CPU with AVX-512 VBMI, for at most 8 columns (a few
/// query heads' scores) and rows of whole vectors of 64 codes, each register tile of 16
/// rows widens the next tile's rows between its dot products, with the rows' pairs at
/// constant offsets for rows of 64 and 128 codes. On AMD Zen 4 (one thread, the tiny
/// indexer decode) the op went from 601 to 574 µs against widening a block's rows first,
/// although the permutes and the dot products share the vector pipes there. Anything
/// else widens every row first.
///
/// With `k2 = 0` C is zeroed and the runs are not read. Panics if a run is not whole
/// rows, the runs do not hold `d.m` rows, `kb` is shorter than `d.m · 2·k2`, or `b` or
/// `c` is too short for `d`.
pub fn gemm_e4m3_into(
    isa: CpuIsa,
    d: PairDims,
    runs: &[&[u8]],
    kb: &mut [u16],
    b: &[u32],
    c: &mut [f32],
) {
    let ldk = 2 * d.k2;
    let d = PairDims { lda: ldk, ..d };
    if d.m == 0 || d.n == 0 {
        return;
    }
    if ldk == 0 {
        // Empty sums: C is zeroed, as by `gemm_bf16_into` (the runs are not read).
        return gemm_bf16_into(isa, d, &[], b, c);
    }
    #[cfg(target_arch = "x86_64")]
    {
        assert!(d.ldc >= d.n && c.len() >= (d.m - 1) * d.ldc + d.n);
        let out = x86::StoreC {
            c: c.as_mut_ptr(),
            ldc: d.ldc,
            last: x86::mask8(d.n),
        };
        if e4m3_rows8_route(isa, &d, runs, kb, b, out) {
            return;
        }
    }
    check_runs(&d, runs, kb);
    widen_runs(isa, runs, kb);
    gemm_bf16_into(isa, d, kb, b, c);
}

/// Runs the interleaved route of [`gemm_e4m3_into`] into `out` where the path and the
/// shape allow it (the `avx512bf16` path on a CPU with AVX-512 VBMI, 1 to 8 columns, rows
/// of whole vectors of 64 codes: `d.lda` is the rows' length), and says whether it did.
/// Panics if the runs, `kb` or B do not hold `d` (the caller has checked what `out`
/// writes).
#[cfg(target_arch = "x86_64")]
fn e4m3_rows8_route(
    isa: CpuIsa,
    d: &PairDims,
    runs: &[&[u8]],
    kb: &mut [u16],
    b: &[u32],
    out: impl x86::Out8,
) -> bool {
    let ldk = d.lda;
    let fits = d.m > 0 && (1..=8).contains(&d.n) && ldk > 0 && ldk % 64 == 0;
    if !(fits && isa.isa().bf16_dot() && super::widen::x86::has_vbmi()) {
        return false;
    }
    check_runs(d, runs, kb);
    assert!(d.ldb >= padded_cols(d.n));
    assert!(b.len() >= (d.k2 - 1) * d.ldb + padded_cols(d.n));
    // SAFETY: the avx512bf16 path exists only on a CPU with AVX-512F, AVX-512BW, AVX-512VL
    // and AVX512_BF16, and VBMI was checked; the runs hold `m` rows of `ldk` codes, `kb`
    // holds `m` rows of `ldk` words, B holds `d` (all asserted above), and `out` takes `m`
    // rows (the caller's contract).
    unsafe { x86::gemm_e4m3_rows8(d, runs, kb.as_mut_ptr(), b.as_ptr(), out) };
    true
}

/// Widens `runs` into `kb` (a run's rows are adjacent there too: one call each).
fn widen_runs(isa: CpuIsa, runs: &[&[u8]], kb: &mut [u16]) {
    let mut at = 0;
    for run in runs {
        super::widen::e4m3_row_pow2(isa, run, 0, &mut kb[at..at + run.len()]);
        at += run.len();
    }
}

/// The weighted ReLU sum of each row of [`gemm_e4m3_into`]'s `C`, times the row's scale:
///
/// ```text
/// s = +0;  for j in 0..n: s = fma(w[j], max(C[i][j], 0), s)   // in column order
/// out[i] = s · scale[i]
/// ```
///
/// (`max` gives 0 for a NaN score; each step rounds once.) The same bits as
/// [`gemm_e4m3_into`] into `c` followed by that loop, which is what every route but one
/// runs. That one (the `avx512bf16` path on a CPU with AVX-512 VBMI, at most 8 columns,
/// rows of whole vectors of 64 codes) never stores `C`: each register tile's 16 rows are
/// transposed in registers and summed there. For the indexer's few-head decode (one
/// query row: `C`'s columns are its heads) that costs less than storing `C`, transposing
/// it and reading it back (AMD Zen 4, one thread, 8 heads over 2048 fp8 keys of 32
/// requests: 538 against 578 µs).
///
/// Meant for a few columns: the other routes sum each row as one chain of FMAs, at one
/// FMA's latency per column (64 columns made the indexer's 64-head decode 3 times slower
/// than its own head sums, vectorised over keys).
///
/// `c` is working space on the other routes (`d.ldc` as in [`gemm_e4m3_into`]; its
/// contents are unspecified on return). Panics as [`gemm_e4m3_into`] does, or if `w` has
/// fewer than `d.n` weights, or `scale` or `out` fewer than `d.m` values.
#[allow(
    clippy::too_many_arguments,
    reason = "a GEMM's operands plus its epilogue's"
)]
pub fn gemm_e4m3_relu_sums(
    isa: CpuIsa,
    d: PairDims,
    runs: &[&[u8]],
    kb: &mut [u16],
    b: &[u32],
    w: &[f32],
    scale: &[f32],
    c: &mut [f32],
    out: &mut [f32],
) {
    super::gemm::check_relu_sums((d.m, d.n), w, scale, out);
    #[cfg(target_arch = "x86_64")]
    {
        // The sums read `n` weights and `m` scales and write `m` outputs (checked above).
        let sums = x86::ReluSums {
            w: w.as_ptr(),
            n: d.n,
            scale: scale.as_ptr(),
            out: out.as_mut_ptr(),
        };
        let dk = PairDims { lda: 2 * d.k2, ..d };
        if e4m3_rows8_route(isa, &dk, runs, kb, b, sums) {
            return;
        }
    }
    gemm_e4m3_into(isa, d, runs, kb, b, c);
    super::gemm::relu_sums(c, (d.m, d.n, d.ldc), w, scale, out);
}

/// Panics unless `runs` hold `d.m` whole rows of `d.lda` codes and `kb` as many rows of
/// widened words.
fn check_runs(d: &PairDims, runs: &[&[u8]], kb: &[u16]) {
    let ldk = d.lda;
    // A run's rows (`None` unless whole), without a division for rows of a power of two
    // (a call covers a few keys: the divisions showed in the tiny indexer decode).
    let rows = |len: usize| match ldk.is_power_of_two() {
        true => (len & (ldk - 1) == 0).then_some(len >> ldk.trailing_zeros()),
        false => (len % ldk == 0).then_some(len / ldk),
    };
    assert!(
        runs.iter().try_fold(0, |m, r| Some(m + rows(r.len())?)) == Some(d.m),
        "the runs hold {} rows of {ldk} codes",
        d.m
    );
    assert!(
        kb.len() >= d.m * ldk,
        "the widened rows' buffer is shorter than the shape"
    );
}

/// Where `A`'s pairs lie, in bf16 elements: row `i`'s pair `p` starts at
/// `i · row + p · pair`.
#[derive(Clone, Copy, Debug)]
struct AStep {
    row: usize,
    pair: usize,
}

impl AStep {
    /// Row-major `A` (the module's layout): rows `lda` elements apart, a row's pairs
    /// adjacent.
    fn rows(d: &PairDims) -> Self {
        AStep {
            row: d.lda,
            pair: 2,
        }
    }

    /// Pair-major `A`: the rows' pairs of one step adjacent, steps `lda` pairs apart.
    fn pair_major(d: &PairDims) -> Self {
        AStep {
            row: 2,
            pair: 2 * d.lda,
        }
    }

    /// Whether no two of `A`'s pairs overlap: a row's `k2` pairs fit before the next row
    /// (row-major), or a step's `m` pairs before the next step (pair-major).
    fn disjoint(&self, d: &PairDims) -> bool {
        (self.pair == 2 && self.row >= 2 * d.k2) || (self.row == 2 && self.pair >= 2 * d.m)
    }
}

/// `A` as a caller passes it: one buffer with its pairs placed by an [`AStep`], or one
/// slice per row.
#[derive(Clone, Copy)]
enum A<'a> {
    Strided { a: &'a [u16], s: AStep },
    Rows(&'a [&'a [u16]]),
}

impl<'a> A<'a> {
    fn strided(s: AStep, a: &'a [u16]) -> Self {
        A::Strided { a, s }
    }

    /// Panics unless `A` holds `d.m` rows of `d.k2` pairs (`d.m`, `d.k2` positive) and,
    /// in one buffer, no two pairs overlap.
    fn check(&self, d: &PairDims) {
        match *self {
            A::Strided { a, s } => {
                assert!(s.disjoint(d), "A's pairs overlap: {d:?}");
                assert!(a.len() >= (d.m - 1) * s.row + (d.k2 - 1) * s.pair + 2);
            }
            A::Rows(rows) => assert!(
                rows.len() >= d.m && rows.iter().all(|r| r.len() >= 2 * d.k2),
                "a row of A is shorter than 2·k2"
            ),
        }
    }

    /// Row `i`'s pair `p` (low, high); panics outside `A`.
    fn pair(&self, i: usize, p: usize) -> (u16, u16) {
        match *self {
            A::Strided { a, s } => (a[i * s.row + p * s.pair], a[i * s.row + p * s.pair + 1]),
            A::Rows(rows) => (rows[i][2 * p], rows[i][2 * p + 1]),
        }
    }
}

fn run(isa: CpuIsa, d: PairDims, a: A<'_>, b: &[u32], c: &mut [f32], zero: bool) {
    if d.m == 0 || d.n == 0 {
        return;
    }
    if zero {
        assert!(d.ldc >= d.n && c.len() >= (d.m - 1) * d.ldc + d.n);
        if d.k2 == 0 {
            for i in 0..d.m {
                c[i * d.ldc..][..d.n].fill(0.0);
            }
            return;
        }
    }
    if d.k2 == 0 {
        return;
    }
    a.check(&d);
    assert!(d.ldb >= padded_cols(d.n) && d.ldc >= d.n);
    assert!(b.len() >= (d.k2 - 1) * d.ldb + padded_cols(d.n));
    assert!(c.len() >= (d.m - 1) * d.ldc + d.n);
    #[cfg(target_arch = "x86_64")]
    if isa.isa().bf16_dot() {
        // SAFETY: a `CpuIsa` of the avx512bf16 path exists only on a CPU with AVX-512F,
        // AVX-512BW, AVX-512VL and AVX512_BF16 (checked when it was made); A's buffer (or
        // each of its `m` rows), B and C hold `d` (asserted above), which is all the
        // kernel reads and writes.
        unsafe {
            let (b, c) = (b.as_ptr(), c.as_mut_ptr());
            match a {
                A::Strided { a, s } => x86::gemm(d, x86::Strided { a: a.as_ptr(), s }, b, c, zero),
                A::Rows(rows) => x86::gemm(d, x86::Gathered(rows.as_ptr()), b, c, zero),
            }
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let (Isa::Amx, A::Strided { a, s }) = (isa.isa(), a) {
        if s.pair == 2 && super::amx::takes(&d) {
            // SAFETY: a `CpuIsa` of the amx path exists only where `amx::available`; `k2`
            // is a positive multiple of 16 (`takes`), `m` and `n` are positive, and A
            // (row-major: `s.row` is `lda`), B and C hold `d` (asserted above).
            unsafe { super::amx::gemm(PairDims { lda: s.row, ..d }, a, b, c, zero) };
            return;
        }
    }
    emulate(d, a, b, c, zero);
}

/// The kernel's arithmetic in f32 FMAs with its flushes (module docs).
fn emulate(d: PairDims, a: A<'_>, b: &[u32], c: &mut [f32], zero: bool) {
    let ftz = |x: f32| {
        if x.is_subnormal() {
            0f32.copysign(x)
        } else {
            x
        }
    };
    for i in 0..d.m {
        for j in 0..d.n {
            let mut x = if zero { 0.0 } else { ftz(c[i * d.ldc + j]) };
            for p in 0..d.k2 {
                let pb = b[p * d.ldb + j];
                let (b0, b1) = (bf16_daz(pb as u16), bf16_daz((pb >> 16) as u16));
                let (a0, a1) = a.pair(i, p);
                let (a0, a1) = (bf16_daz(a0), bf16_daz(a1));
                x = ftz(a1.mul_add(b1, x));
                x = ftz(a0.mul_add(b0, x));
            }
            c[i * d.ldc + j] = x;
        }
    }
}

// The AVX-512 intrinsics and `__mmask16` are stable since Rust 1.89, as are the AVX-512
// target features every `isa_dispatch!` function already enables: the workspace's declared
// MSRV (1.85) predates both; raising it would turn on newer lints across the workspace, so
// it is left to a separate change.
#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{AStep, PairDims};
    pub(super) use crate::cpu::tile_out::{mask8, Out8, ReluSums, StoreC};

    /// Where a kernel reads `A`'s pairs.
    pub(super) trait APairs: Copy {
        /// The same rows from row `i` on.
        ///
        /// # Safety
        /// Row `i` exists.
        unsafe fn at_row(self, i: usize) -> Self;
        /// Row `r`'s pair `p` (two bf16 values, read as one unaligned 32-bit word).
        ///
        /// # Safety
        /// Row `r` and its pair `p` exist.
        unsafe fn pair(self, r: usize, p: usize) -> *const i32;
    }

    /// `A` in one buffer, its pairs placed by an [`AStep`].
    #[derive(Clone, Copy)]
    pub(super) struct Strided {
        pub(super) a: *const u16,
        pub(super) s: AStep,
    }

    impl APairs for Strided {
        #[inline(always)]
        unsafe fn at_row(self, i: usize) -> Self {
            Strided {
                // SAFETY: the caller's contract (row `i` is inside the buffer).
                a: unsafe { self.a.add(i * self.s.row) },
                s: self.s,
            }
        }
        #[inline(always)]
        unsafe fn pair(self, r: usize, p: usize) -> *const i32 {
            // SAFETY: the caller's contract.
            unsafe { self.a.add(r * self.s.row + p * self.s.pair).cast() }
        }
    }

    /// Row-major `A` with rows of `ROW` bf16 elements: each pair's address is a constant
    /// offset from the step's, so a tile spends no instruction on it (a runtime row length
    /// costs an add per row and step, which the tiles of 8 columns cannot spare).
    #[derive(Clone, Copy)]
    pub(super) struct Rows<const ROW: usize>(pub(super) *const u16);

    impl<const ROW: usize> APairs for Rows<ROW> {
        #[inline(always)]
        unsafe fn at_row(self, i: usize) -> Self {
            // SAFETY: the caller's contract (row `i` is inside the buffer).
            Rows(unsafe { self.0.add(i * ROW) })
        }
        #[inline(always)]
        unsafe fn pair(self, r: usize, p: usize) -> *const i32 {
            // SAFETY: the caller's contract.
            unsafe { self.0.add(r * ROW + 2 * p).cast() }
        }
    }

    /// `A` as one slice per row ([`super::gemm_bf16_gathered_into`]).
    #[derive(Clone, Copy)]
    pub(super) struct Gathered<'a>(pub(super) *const &'a [u16]);

    impl APairs for Gathered<'_> {
        #[inline(always)]
        unsafe fn at_row(self, i: usize) -> Self {
            // SAFETY: the caller's contract (row `i`'s slice exists).
            Gathered(unsafe { self.0.add(i) })
        }
        #[inline(always)]
        unsafe fn pair(self, r: usize, p: usize) -> *const i32 {
            // SAFETY: the caller's contract: the slice of row `r` exists and holds pair `p`.
            unsafe { (*self.0.add(r)).as_ptr().add(2 * p).cast() }
        }
    }

    /// [`super::scaled_bf16_row`] over whole vectors of 32 values; returns how many values
    /// it converted (the caller converts the rest).
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX-512BW and AVX512_BF16; `x.len() == out.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn scaled_bf16_row(x: &[f32], a: f32, b: f32, out: &mut [u16]) -> usize {
        debug_assert_eq!(x.len(), out.len());
        let (va, vb) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
        let (abs, one, top) = (
            _mm512_set1_epi32(0x7fff_ffff),
            _mm512_set1_epi32(1),
            _mm512_set1_epi32(0x7f_ffff),
        );
        let whole = x.len() / 32 * 32;
        for (xs, os) in x[..whole]
            .chunks_exact(32)
            .zip(out[..whole].chunks_exact_mut(32))
        {
            // SAFETY: 32 readable f32 at `xs` and 32 writable u16 at `os` (whole chunks);
            // the features are the caller's.
            unsafe {
                let lo = crate::cpu::raw::read::<__m512>(xs.as_ptr().cast());
                let hi = crate::cpu::raw::read::<__m512>(xs.as_ptr().add(16).cast());
                let (lo, hi) = (
                    _mm512_mul_ps(_mm512_mul_ps(lo, va), vb),
                    _mm512_mul_ps(_mm512_mul_ps(hi, va), vb),
                );
                // A subnormal has |bits| in 1 ..= 0x7fffff: `|bits| - 1 < 0x7fffff`.
                let sub = |v: __m512| {
                    let m = _mm512_and_si512(_mm512_castps_si512(v), abs);
                    _mm512_cmplt_epu32_mask(_mm512_sub_epi32(m, one), top)
                };
                if sub(lo) | sub(hi) != 0 {
                    for (o, &v) in os.iter_mut().zip(xs) {
                        *o = super::round_bf16(v * a * b);
                    }
                    continue;
                }
                let r: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                crate::cpu::raw::write::<__m512i>(os.as_mut_ptr().cast(), r);
            }
        }
        whole
    }

    /// Columns of a tile: four vectors of 16.
    const TILE_COLS: usize = 64;

    /// The whole product, column blocks of up to 64 (the last one masked), each over every
    /// row in register tiles.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX-512BW, AVX-512VL and AVX512_BF16; the pointers hold `d` as
    /// [`super::gemm_bf16`] checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn gemm(d: PairDims, a: impl APairs, b: *const u32, c: *mut f32, zero: bool) {
        if d.n <= 8 {
            // SAFETY: this function's contract, with 8 columns or fewer.
            unsafe {
                if zero {
                    rows8::<true>(&d, a, b, c)
                } else {
                    rows8::<false>(&d, a, b, c)
                }
            };
            return;
        }
        let mut j = 0;
        while j < d.n {
            let cols = (d.n - j).min(TILE_COLS);
            let nv = cols.div_ceil(16);
            let rest = cols - 16 * (nv - 1);
            let last: __mmask16 = if rest == 16 {
                0xffff
            } else {
                (1u16 << rest) - 1
            };
            // SAFETY: columns `j .. j + cols` of B (whole vectors: `ldb` is padded) and C
            // are inside the slices; the features are the caller's.
            unsafe {
                let (bj, cj) = (b.add(j), c.add(j));
                match (nv, zero) {
                    (4, false) => rows::<6, 4, false>(&d, a, bj, cj, last),
                    (3, false) => rows::<8, 3, false>(&d, a, bj, cj, last),
                    (2, false) => rows::<12, 2, false>(&d, a, bj, cj, last),
                    (_, false) => rows::<16, 1, false>(&d, a, bj, cj, last),
                    (4, true) => rows::<6, 4, true>(&d, a, bj, cj, last),
                    (3, true) => rows::<8, 3, true>(&d, a, bj, cj, last),
                    (2, true) => rows::<12, 2, true>(&d, a, bj, cj, last),
                    (_, true) => rows::<16, 1, true>(&d, a, bj, cj, last),
                }
            }
            j += TILE_COLS;
        }
    }

    /// Every row of one column block: tiles of `R` rows, then 8, 4, 2, 1.
    ///
    /// # Safety
    /// As [`gemm`], for the block's columns.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn rows<const R: usize, const NV: usize, const ZERO: bool>(
        d: &PairDims,
        a: impl APairs,
        b: *const u32,
        c: *mut f32,
        last: __mmask16,
    ) {
        let mut i = 0;
        // SAFETY: every call below covers rows `i .. i + rows <= m` of A and C only (the
        // caller's precondition), on a CPU with the features.
        unsafe {
            while d.m - i >= R {
                tile::<R, NV, ZERO>(d, a.at_row(i), b, c.add(i * d.ldc), last);
                i += R;
            }
            if NV <= 2 && d.m - i >= 8 {
                tile::<8, NV, ZERO>(d, a.at_row(i), b, c.add(i * d.ldc), last);
                i += 8;
            }
            for step in [4, 2, 1] {
                if d.m - i >= step {
                    let (ai, ci) = (a.at_row(i), c.add(i * d.ldc));
                    match step {
                        4 => tile::<4, NV, ZERO>(d, ai, b, ci, last),
                        2 => tile::<2, NV, ZERO>(d, ai, b, ci, last),
                        _ => tile::<1, NV, ZERO>(d, ai, b, ci, last),
                    }
                    i += step;
                }
            }
        }
        debug_assert_eq!(i, d.m);
    }

    /// Every row of a product of at most 8 columns, in tiles of one 256-bit vector: 16
    /// rows, then 8, 4, 2, 1. A 512-bit tile would leave half of its lanes idle; on AMD
    /// Zen 4 the 256-bit instruction issues twice as often (the same FLOP rate), and in the
    /// indexer's tiny decode this tile's share of the profile puts it at about 0.84 of
    /// that rate (a few heads' scores, `Sᵀ = K · Qᵀ`, keys along the rows: no transpose
    /// of K).
    ///
    /// # Safety
    /// As [`gemm`], with `d.n <= 8`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vl")]
    #[inline]
    unsafe fn rows8<const ZERO: bool>(d: &PairDims, a: impl APairs, b: *const u32, c: *mut f32) {
        debug_assert!(d.n <= 8);
        let last = mask8(d.n);
        let mut out = StoreC {
            c,
            ldc: d.ldc,
            last,
        };
        let mut i = 0;
        // SAFETY: every call covers rows `i .. i + rows <= m` of A and C only, 8 columns
        // of B (whole vectors: `ldb` is padded to 16) and the `n` columns of C.
        unsafe {
            while d.m - i >= 16 {
                let init = c.add(i * d.ldc);
                let acc = tile8::<16, ZERO>(d, a.at_row(i), b, init, last, |_| {});
                out.rows(i, &acc);
                i += 16;
            }
            i = tail8::<ZERO>(d, a, b, c, last, i, &mut out);
        }
        debug_assert_eq!(i, d.m);
    }

    /// The rows `i..` of [`rows8`] after its tiles of 16 (fewer than 16): tiles of 8, 4, 2
    /// and 1; returns `d.m`.
    ///
    /// # Safety
    /// As [`rows8`], with `d.m - i < 16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vl")]
    #[inline]
    #[allow(
        clippy::too_many_arguments,
        reason = "a tile's operands and its output"
    )]
    unsafe fn tail8<const ZERO: bool>(
        d: &PairDims,
        a: impl APairs,
        b: *const u32,
        c: *const f32,
        last: __mmask8,
        mut i: usize,
        out: &mut impl Out8,
    ) -> usize {
        // SAFETY: every call covers rows `i .. i + step <= m` only (the caller's contract;
        // `c` is read only when accumulating, and then holds C).
        unsafe {
            for step in [8, 4, 2, 1] {
                if d.m - i >= step {
                    let (ai, ci) = (a.at_row(i), c.wrapping_add(i * d.ldc));
                    match step {
                        8 => out.rows(i, &tile8::<8, ZERO>(d, ai, b, ci, last, |_| {})),
                        4 => out.rows(i, &tile8::<4, ZERO>(d, ai, b, ci, last, |_| {})),
                        2 => out.rows(i, &tile8::<2, ZERO>(d, ai, b, ci, last, |_| {})),
                        _ => out.rows(i, &tile8::<1, ZERO>(d, ai, b, ci, last, |_| {})),
                    }
                    i += step;
                }
            }
        }
        i
    }

    /// [`super::gemm_e4m3_into`]'s interleaved route: the first 16 rows widened, then each
    /// tile of 16 rows ([`tile8`]) widens the next 16 rows' codes (64 at a time, one
    /// lookup every second pair step: `16 · 2·k2 / 64 = k2 / 2` lookups), the rows after
    /// the last whole tile included; the tail tiles find their rows widened. Each tile's
    /// rows of C go to `out` (stored, or summed: [`super::gemm_e4m3_relu_sums`]).
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX-512BW, AVX-512VL, AVX512_BF16 and AVX-512 VBMI;
    /// `2 · d.k2` is a positive multiple of 64 and `d.lda` equals it; `runs` holds `d.m`
    /// rows of `d.lda` codes, each run whole rows; `kb` holds `d.m` rows of `d.lda` words;
    /// `1 <= d.n <= 8`, `b` holds `d` as [`super::gemm_bf16_into`] checks, and `out`
    /// takes `d.m` rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")]
    pub(super) unsafe fn gemm_e4m3_rows8(
        d: &PairDims,
        runs: &[&[u8]],
        kb: *mut u16,
        b: *const u32,
        mut out: impl Out8,
    ) {
        // SAFETY: the caller's contract; `a` reads `kb`'s rows of `d.lda` words.
        unsafe {
            match d.lda {
                64 => e4m3_rows8(d, runs, kb, Rows::<64>(kb), b, &mut out),
                128 => e4m3_rows8(d, runs, kb, Rows::<128>(kb), b, &mut out),
                _ => {
                    let s = AStep {
                        row: d.lda,
                        pair: 2,
                    };
                    e4m3_rows8(d, runs, kb, Strided { a: kb, s }, b, &mut out)
                }
            }
        }
    }

    /// [`gemm_e4m3_rows8`] with `a` reading `kb`'s rows.
    ///
    /// # Safety
    /// As [`gemm_e4m3_rows8`]; `a` reads row `i`'s pair `p` at `kb[i · d.lda + 2p]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")]
    #[inline]
    unsafe fn e4m3_rows8(
        d: &PairDims,
        runs: &[&[u8]],
        kb: *mut u16,
        a: impl APairs,
        b: *const u32,
        out: &mut impl Out8,
    ) {
        debug_assert!(d.n <= 8 && d.lda == 2 * d.k2 && d.lda % 64 == 0);
        let (ldk, per_row) = (d.lda, d.lda / 64);
        let last = mask8(d.n);
        // The rows' codes, in order: the run and the next row's offset in it.
        let (mut run, mut at) = (0, 0);
        let mut codes: *const u8 = std::ptr::null();
        // SAFETY: rows are widened in order, one part of 64 codes at a time (the first part
        // of a row finds its codes: the next run's first row once a run is used up), each
        // part read from its row's codes and written to the same row of `kb`; the tiles
        // read rows of `kb` that are already written, which no lookup of theirs writes (a
        // tile at rows `i .. i + R` widens rows from `i + 16` on); the features and the
        // shapes are the caller's.
        unsafe {
            let lookup = crate::cpu::widen::x86::E4m3Words::load();
            let mut widen = |r: usize, part: usize| {
                if part == 0 {
                    while at == runs.get_unchecked(run).len() {
                        (run, at) = (run + 1, 0);
                    }
                    codes = runs.get_unchecked(run).as_ptr().add(at);
                    at += ldk;
                }
                lookup.widen64(codes.add(64 * part), kb.add(r * ldk + 64 * part));
            };
            let mut done = d.m.min(16);
            for r in 0..done {
                for part in 0..per_row {
                    widen(r, part);
                }
            }
            let mut i = 0;
            while d.m - i >= 16 {
                let end = (done + 16).min(d.m);
                let (mut r, mut part) = (done, 0);
                let ahead = |p: usize| {
                    if p % 2 == 0 && r < end {
                        widen(r, part);
                        part += 1;
                        if part == per_row {
                            (r, part) = (r + 1, 0);
                        }
                    }
                };
                let acc = tile8::<16, true>(d, a.at_row(i), b, std::ptr::null(), last, ahead);
                debug_assert!(r == end, "a tile widens the next tile's rows");
                out.rows(i, &acc);
                done = end;
                i += 16;
            }
            tail8::<true>(d, a, b, std::ptr::null(), last, i, out);
        }
    }

    /// One register tile of `R` rows × one 256-bit vector of 8 columns, over the whole
    /// contraction: the arithmetic of [`tile`] per element; returns the rows of C (lanes
    /// past `last` unspecified). Unless `ZERO`, each row's chain starts from C's row at
    /// `c` (the lanes of `last`). `step(p)` runs before the products of pair step `p`
    /// (work of the caller's to interleave with them; it must not write the tile's rows of
    /// A).
    ///
    /// # Safety
    /// As [`rows8`], for rows `0 .. R` from the pointers (`c` is read only unless `ZERO`).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vl")]
    #[inline]
    unsafe fn tile8<const R: usize, const ZERO: bool>(
        d: &PairDims,
        a: impl APairs,
        b: *const u32,
        c: *const f32,
        last: __mmask8,
        mut step: impl FnMut(usize),
    ) -> [__m256; R] {
        // SAFETY: every access below is inside the tile's rows of A and C and the first 8
        // columns of B's rows (the caller's precondition); the reads of A are unaligned
        // 4-byte loads.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); R];
            if !ZERO {
                for (r, x) in acc.iter_mut().enumerate() {
                    *x = _mm256_maskz_loadu_ps(last, c.add(r * d.ldc));
                }
            }
            for p in 0..d.k2 {
                step(p);
                let bv = crate::cpu::raw::read::<__m256i>(b.add(p * d.ldb).cast());
                let bv: __m256bh = std::mem::transmute::<__m256i, __m256bh>(bv);
                for (r, x) in acc.iter_mut().enumerate() {
                    let pair = crate::cpu::raw::read(a.pair(r, p));
                    let av: __m256bh = std::mem::transmute(_mm256_set1_epi32(pair));
                    // A's pair second: its broadcast folds into the memory operand.
                    *x = _mm256_dpbf16_ps(*x, bv, av);
                }
            }
            acc
        }
    }

    /// One register tile: `R` rows × `NV` vectors of 16 columns (the last one masked by
    /// `last`), over the whole contraction.
    ///
    /// # Safety
    /// As [`gemm`], for rows `0 .. R` and `NV` vectors of columns from the pointers.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn tile<const R: usize, const NV: usize, const ZERO: bool>(
        d: &PairDims,
        a: impl APairs,
        b: *const u32,
        c: *mut f32,
        last: __mmask16,
    ) {
        // SAFETY: every access below is inside the tile's rows and columns of A, B and C
        // (the caller's precondition); the reads of A are unaligned 4-byte loads.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); NV]; R];
            for (r, row) in acc.iter_mut().enumerate().filter(|_| !ZERO) {
                for (v, x) in row.iter_mut().enumerate() {
                    let p = c.add(r * d.ldc + 16 * v);
                    *x = if v + 1 == NV {
                        _mm512_maskz_loadu_ps(last, p)
                    } else {
                        crate::cpu::raw::read::<__m512>(p.cast())
                    };
                }
            }
            for p in 0..d.k2 {
                let bp = b.add(p * d.ldb);
                let mut bv = [_mm512_setzero_si512(); NV];
                for (v, x) in bv.iter_mut().enumerate() {
                    // Not `_mm512_loadu_si512` nor `read_unaligned`: with debug assertions
                    // their checked copies run through the stack ([`crate::cpu::raw`]).
                    *x = crate::cpu::raw::read(bp.add(16 * v).cast::<__m512i>());
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let pair = crate::cpu::raw::read(a.pair(r, p));
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                    for (x, &bx) in row.iter_mut().zip(&bv) {
                        // A's pair as the second source: LLVM folds its broadcast into
                        // the instruction's memory operand (`{1to16}`), which it cannot
                        // for the first. Each lane's two products are the same either
                        // way (`a·b = b·a`, the odd element still first): the same bits.
                        // On AMD Zen 4 a broadcast of its own shares the pipes of
                        // `vdpbf16ps`: a 16 × 16 tile of one vector ran at 0.75 of the
                        // instruction's rate that way and at 0.96–1.0 folded.
                        *x = _mm512_dpbf16_ps(*x, std::mem::transmute::<__m512i, __m512bh>(bx), av);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    let p = c.add(r * d.ldc + 16 * v);
                    if v + 1 == NV {
                        _mm512_mask_storeu_ps(p, last, x);
                    } else {
                        crate::cpu::raw::write::<__m512>(p.cast(), x);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::Isa;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    /// Random bf16 bits: mostly normal values over a wide exponent range (cancellations and
    /// absorptions), some zeros and subnormals.
    fn bits(rng: &mut impl Rng) -> u16 {
        match rng.gen_range(0..20) {
            0 => rng.gen::<u16>() & 0x807f,
            1 => 0,
            _ => {
                let e = rng.gen_range(112u16..142);
                (rng.gen::<u16>() & 0x8000) | (e << 7) | (rng.gen::<u16>() & 0x7f)
            }
        }
    }

    /// The branch-free rounding is `f32_to_bf16` with subnormals flushed, on every f32
    /// class: all sign/exponent combinations with the mantissas around every rounding
    /// boundary, and random patterns.
    /// Every sign and exponent at each rounding boundary (and subnormal / NaN patterns),
    /// then a million random patterns: `round_bf16` gives `half`'s `from_f32` bits, and
    /// `round_bf16_daz` the kernels' `f32_to_bf16` with a subnormal result flushed.
    #[test]
    fn rounding_to_bf16_matches_the_references() {
        use sparsekit_kernels::fp8::f32_to_bf16;
        let check = |x: f32| {
            let b = f32_to_bf16(x);
            let flushed = if b & 0x7f80 == 0 { b & 0x8000 } else { b };
            assert_eq!(round_bf16_daz(x), flushed, "daz {:#010x}", x.to_bits());
            let half = half::bf16::from_f32(x).to_bits();
            assert_eq!(round_bf16(x), half, "{:#010x}", x.to_bits());
        };
        let mantissas = [
            0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1_0000, 0x1_7fff, 0x1_8000, 0x1_8001,
            0x40_0000, 0x7f_7fff, 0x7f_8000, 0x7f_8001, 0x7f_ffff,
        ];
        for top in 0..=0x1ffu32 {
            for &m in &mantissas {
                check(f32::from_bits(top << 23 | m));
            }
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for _ in 0..1_000_000 {
            check(f32::from_bits(rng.gen()));
        }
    }

    /// `scaled_bf16_row` gives `round_bf16(x · a · b)` on every path, for every class of
    /// product: normal, subnormal (alone in its vector or not), zero, infinite, NaN, and
    /// rounding ties; lengths not a multiple of 32.
    #[test]
    fn scaled_rows_round_as_round_bf16() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for round in 0..200 {
            let n = rng.gen_range(0..300);
            let x: Vec<f32> = (0..n)
                .map(|_| match rng.gen_range(0..40) {
                    0 => f32::from_bits(rng.gen::<u32>() & 0x807f_ffff), // subnormal or 0
                    1 => f32::from_bits(rng.gen::<u32>() | 0x7f80_0000), // inf or NaN
                    2 => f32::from_bits((rng.gen::<u32>() & 0xffff_0000) | 0x8000), // tie
                    _ if round % 2 == 0 => f32::from_bits(rng.gen()),
                    _ => rng.gen_range(-8.0f32..8.0),
                })
                .collect();
            let (a, b) = match round % 4 {
                0 => (1.0, 1.0),
                1 => (rng.gen_range(0.01f32..100.0), 1.0),
                2 => (rng.gen_range(0.01f32..100.0), rng.gen_range(-2.0f32..2.0)),
                _ => (2f32.powi(-120), 0.5), // many products subnormal
            };
            for isa in CpuIsa::available() {
                let mut got = vec![0xdead_u16; n + 3];
                scaled_bf16_row(isa, &x, a, b, &mut got);
                for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
                    let want = round_bf16(v * a * b);
                    assert_eq!(
                        g,
                        want,
                        "{} x[{i}] = {:#010x}, a={a} b={b}",
                        isa.isa(),
                        v.to_bits()
                    );
                }
                assert!(
                    got[n..].iter().all(|&g| g == 0xdead),
                    "wrote past the input"
                );
            }
        }
    }

    /// The kernel agrees bit for bit with its emulation (two FMAs per pair, odd element
    /// first, DAZ/FTZ) on every shape class: the instruction's semantics as documented.
    #[test]
    fn kernel_matches_the_documented_arithmetic() {
        let Ok(isa) = CpuIsa::new(Isa::Avx512Bf16) else {
            eprintln!("SKIPPED kernel_matches_the_documented_arithmetic: no AVX512_BF16 here");
            return;
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &(m, n, k2) in &[
            (1, 1, 1),
            (6, 64, 64),
            (64, 64, 64),
            (13, 70, 33),
            (17, 16, 5),
            (29, 40, 9),
            (7, 130, 3),
            (64, 8, 32),
            (3, 200, 100),
            // One 256-bit vector of columns: every tile height, masked widths.
            (16, 8, 32),
            (31, 8, 7),
            (23, 5, 32),
            (9, 1, 3),
            (64, 3, 1),
        ] {
            let d = PairDims {
                m,
                n,
                k2,
                lda: 2 * k2 + 2,
                ldb: padded_cols(n) + 16,
                ldc: n + 3,
            };
            let a: Vec<u16> = (0..m * d.lda).map(|_| bits(&mut rng)).collect();
            let b: Vec<u32> = (0..k2 * d.ldb)
                .map(|_| bits(&mut rng) as u32 | (bits(&mut rng) as u32) << 16)
                .collect();
            let c0: Vec<f32> = (0..m * d.ldc)
                .map(|_| f32::from_bits((bits(&mut rng) as u32) << 16 | rng.gen::<u16>() as u32))
                .collect();
            let (mut got, mut want) = (c0.clone(), c0.clone());
            gemm_bf16(isa, d, &a, &b, &mut got);
            emulate(d, A::strided(AStep::rows(&d), &a), &b, &mut want, false);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "m={m} n={n} k2={k2} element {i}");
            }
            // The same A stored pair-major (pairs `m + 3` apart): the same bits.
            let lda = m + 3;
            let mut at = vec![0u32; k2 * lda];
            for i in 0..m {
                for p in 0..k2 {
                    let (lo, hi) = (a[i * d.lda + 2 * p], a[i * d.lda + 2 * p + 1]);
                    at[p * lda + i] = lo as u32 | (hi as u32) << 16;
                }
            }
            let dt = PairDims { lda, ..d };
            let mut got_t = c0.clone();
            gemm_bf16_pair_major(isa, dt, &at, &b, &mut got_t);
            assert!(
                got_t
                    .iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()),
                "pair-major m={m} n={n} k2={k2}"
            );
            let (mut got, mut want) = (vec![f32::NAN; c0.len()], c0.clone());
            gemm_bf16_into(isa, d, &a, &b, &mut got);
            emulate(d, A::strided(AStep::rows(&d), &a), &b, &mut want, true);
            let what = format!("into m={m} n={n} k2={k2}");
            crate::cpu::gemm::assert_view_bits(&got, &want, (m, n, d.ldc), &what);
            let mut got_t = vec![f32::NAN; c0.len()];
            gemm_bf16_pair_major_into(isa, dt, &at, &b, &mut got_t);
            let what = format!("pair-major into m={m} n={n} k2={k2}");
            crate::cpu::gemm::assert_view_bits(&got_t, &want, (m, n, d.ldc), &what);
            // The rows scattered in shuffled order at odd element offsets (unaligned
            // words), each its own slice, some longer than the row: the same bits.
            let span = 2 * k2 + 5;
            let mut place: Vec<usize> = (0..m).collect();
            place.shuffle(&mut rng);
            let mut store: Vec<u16> = (0..m * span + 1).map(|_| bits(&mut rng)).collect();
            for (i, &at) in place.iter().enumerate() {
                store[1 + at * span..][..2 * k2].copy_from_slice(&a[i * d.lda..][..2 * k2]);
            }
            let rows: Vec<&[u16]> = place
                .iter()
                .map(|&at| &store[1 + at * span..][..2 * k2 + rng.gen_range(0..4)])
                .collect();
            let mut got_g = vec![f32::NAN; c0.len()];
            gemm_bf16_gathered_into(isa, d, &rows, &b, &mut got_g);
            let what = format!("gathered into m={m} n={n} k2={k2}");
            crate::cpu::gemm::assert_view_bits(&got_g, &want, (m, n, d.ldc), &what);
        }
    }

    /// `codes`' rows of `ldk` split into runs of 1 to 20 rows, in order; with `empty`, an
    /// empty run before about one run in three (several in a row too).
    fn random_runs<'a>(
        rng: &mut impl Rng,
        codes: &'a [u8],
        ldk: usize,
        empty: Option<&'a [u8]>,
    ) -> Vec<&'a [u8]> {
        let m = codes.len() / ldk;
        let mut runs = Vec::new();
        let mut at = 0;
        while at < m {
            if let Some(e) = empty.filter(|_| rng.gen_range(0..3) == 0) {
                runs.push(e);
                continue;
            }
            let rows = rng.gen_range(1..=(m - at).min(20));
            runs.push(&codes[at * ldk..(at + rows) * ldk]);
            at += rows;
        }
        runs
    }

    /// `gemm_e4m3_into` gives, on every path, the bits of its definition: each code
    /// widened to its bf16 value (the scalar formula), then `gemm_bf16_into` on those rows
    /// (`kb` holds them on return). Every code (NaN and subnormal ones included), rows of
    /// 64, 128, 192 and 10 codes (constant-offset, strided and element-wise routes), every
    /// tail after the tiles of 16, up to 8 columns (the interleaved route) and more, rows
    /// split into runs of random lengths (empty ones too), C and `kb` poisoned.
    #[test]
    fn e4m3_keys_give_the_widened_rows_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &k2 in &[32, 64, 96, 5] {
            for &m in &[1, 7, 15, 16, 17, 31, 33, 48, 64] {
                for &n in &[1, 3, 8, 9, 16] {
                    let ldk = 2 * k2;
                    let d = PairDims {
                        m,
                        n,
                        k2,
                        lda: 0,
                        ldb: padded_cols(n) + 16,
                        ldc: n + 3,
                    };
                    let codes: Vec<u8> = (0..m * ldk).map(|_| rng.gen()).collect();
                    let b: Vec<u32> = (0..k2 * d.ldb)
                        .map(|_| bits(&mut rng) as u32 | (bits(&mut rng) as u32) << 16)
                        .collect();
                    // Empty runs (often several in a row) point into other codes: a
                    // route that read one would widen those.
                    let other: Vec<u8> = (0..ldk * 2).map(|_| rng.gen()).collect();
                    let runs = random_runs(&mut rng, &codes, ldk, Some(&other[ldk..ldk]));
                    let want_kb: Vec<u16> = codes
                        .iter()
                        .map(|&c| (f32_daz(e4m3_f32(c)).to_bits() >> 16) as u16)
                        .collect();
                    for isa in CpuIsa::available() {
                        let what = format!("{} m={m} n={n} k2={k2}", isa.isa());
                        let mut want = vec![f32::NAN; m * d.ldc];
                        let dk = PairDims { lda: ldk, ..d };
                        gemm_bf16_into(isa, dk, &want_kb, &b, &mut want);
                        let mut kb = vec![0xffff_u16; m * ldk + 5];
                        let mut got = vec![f32::NAN; m * d.ldc];
                        gemm_e4m3_into(isa, d, &runs, &mut kb, &b, &mut got);
                        assert!(kb[..m * ldk] == want_kb[..], "{what}: the widened rows");
                        crate::cpu::gemm::assert_view_bits(&got, &want, (m, n, d.ldc), &what);
                    }
                }
            }
        }
    }

    /// `gemm_e4m3_relu_sums` gives, on every path, the bits of its definition:
    /// `gemm_e4m3_into`'s C, then each row's sum of `w[j]·max(c, 0)` by scalar FMAs in
    /// column order from `+0`, times the row's scale. Random codes (NaN ones too: a NaN
    /// score counts as 0), weights and scales of both signs, rows of 64, 128 and 10 codes,
    /// every tail after the tiles of 16 and 8, 1 to 9 columns; the outputs poisoned, and
    /// nothing written past `m`.
    #[test]
    fn e4m3_relu_sums_give_the_definitions_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &k2 in &[32, 64, 5] {
            for &m in &[1, 3, 7, 8, 9, 15, 16, 17, 24, 31, 33, 64] {
                for &n in &[1, 2, 5, 7, 8, 9] {
                    let ldk = 2 * k2;
                    let d = PairDims {
                        m,
                        n,
                        k2,
                        lda: 0,
                        ldb: padded_cols(n) + 16,
                        ldc: n + 1,
                    };
                    // NaN codes (`0x7f`, `0xff`) in about one row of 6, not in 40%.
                    let codes: Vec<u8> = (0..m * ldk)
                        .map(|_| match rng.gen::<u8>() {
                            c if c & 0x7f == 0x7f && rng.gen_range(0..64) != 0 => c ^ 1,
                            c => c,
                        })
                        .collect();
                    let b: Vec<u32> = (0..k2 * d.ldb)
                        .map(|_| {
                            let mut q = || round_bf16(rng.gen_range(-2.0f32..2.0));
                            q() as u32 | (q() as u32) << 16
                        })
                        .collect();
                    let runs = random_runs(&mut rng, &codes, ldk, None);
                    let w: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                    let scale: Vec<f32> = (0..m).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
                    for isa in CpuIsa::available() {
                        let what = format!("{} m={m} n={n} k2={k2}", isa.isa());
                        let mut kb = vec![0xffff_u16; m * ldk];
                        let mut c = vec![f32::NAN; m * d.ldc];
                        gemm_e4m3_into(isa, d, &runs, &mut kb, &b, &mut c);
                        let mut out = vec![f32::NAN; m + 3];
                        out[m..].fill(-7.0);
                        let mut work = vec![f32::NAN; m * d.ldc];
                        kb.fill(0xffff);
                        gemm_e4m3_relu_sums(
                            isa, d, &runs, &mut kb, &b, &w, &scale, &mut work, &mut out,
                        );
                        let shape = (m, n, d.ldc);
                        crate::cpu::gemm::assert_relu_sums(&out, &c, shape, &w, &scale, &what);
                    }
                }
            }
        }
    }

    /// With no pairs (`k2 = 0`) C is zeroed, whatever the runs.
    #[test]
    fn e4m3_keys_of_no_pairs_zero_c() {
        let d = PairDims {
            m: 3,
            n: 5,
            k2: 0,
            lda: 0,
            ldb: 16,
            ldc: 6,
        };
        for isa in CpuIsa::available() {
            let mut c = vec![f32::NAN; 3 * 6];
            gemm_e4m3_into(isa, d, &[&[1, 2, 3]], &mut [], &[], &mut c);
            crate::cpu::gemm::assert_view_bits(&c, &[0.0; 18], (3, 5, 6), "k2 = 0");
        }
    }

    /// Runs that are not whole rows, or hold another number of rows than the shape, are
    /// refused before anything is read.
    #[test]
    fn e4m3_keys_refuse_runs_that_do_not_hold_the_rows() {
        let codes = [0x38u8; 3 * 64 + 1];
        let b = vec![0u32; 32 * 16];
        let d = PairDims {
            m: 3,
            n: 8,
            k2: 32,
            lda: 0,
            ldb: 16,
            ldc: 8,
        };
        for runs in [
            vec![&codes[..64], &codes[64..3 * 64 + 1]],
            vec![&codes[..2 * 64]],
            vec![&codes[..4 * 64 - 64], &codes[..64]],
        ] {
            let (mut kb, mut c) = (vec![0u16; 4 * 64], vec![0f32; 3 * 8]);
            let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                gemm_e4m3_into(CpuIsa::detected(), d, &runs, &mut kb, &b, &mut c)
            }));
            assert!(
                refused.is_err(),
                "runs of {:?} bytes",
                runs.iter().map(|r| r.len()).collect::<Vec<_>>()
            );
        }
    }

    /// On bf16 values away from subnormals, the f32 pair-order GEMM of every path gives the
    /// kernel's bits.
    #[test]
    fn f32_pair_order_gives_the_kernel_bits() {
        use crate::cpu::gemm::{gemm_acc_pairs, Dims};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let normal = |rng: &mut rand_chacha::ChaCha8Rng| {
            round_bf16_daz(rng.gen_range(-4.0f32..4.0) * 2f32.powi(rng.gen_range(-8..8)))
        };
        for &(m, n, k) in &[
            (64usize, 64usize, 128usize),
            (13, 70, 33),
            (6, 16, 577),
            (64, 512, 63),
        ] {
            let k2 = k.div_ceil(2);
            let a16: Vec<u16> = (0..m * 2 * k2)
                .map(|i| {
                    if i % (2 * k2) < k {
                        normal(&mut rng)
                    } else {
                        0
                    }
                })
                .collect();
            let bk: Vec<u16> = (0..k * n).map(|_| normal(&mut rng)).collect();
            let ldb = padded_cols(n);
            let mut bp = vec![0u32; k2 * ldb];
            for p in 0..k {
                for j in 0..n {
                    bp[p / 2 * ldb + j] |= (bk[p * n + j] as u32) << (16 * (p % 2));
                }
            }
            let c0: Vec<f32> = (0..m * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut want = c0.clone();
            let d = PairDims {
                m,
                n,
                k2,
                lda: 2 * k2,
                ldb,
                ldc: n,
            };
            emulate(d, A::strided(AStep::rows(&d), &a16), &bp, &mut want, false);
            let a32: Vec<f32> = a16.iter().map(|&x| bf16_daz(x)).collect();
            let b32: Vec<f32> = bk.iter().map(|&x| bf16_daz(x)).collect();
            for isa in CpuIsa::available() {
                let mut got = c0.clone();
                let fd = Dims {
                    m,
                    n,
                    k,
                    lda: 2 * k2,
                    ldb: n,
                    ldc: n,
                };
                gemm_acc_pairs(isa, fd, &a32, &b32, &mut got);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{} m={m} n={n} k={k}",
                    isa.isa()
                );
                if !isa.isa().same_bits() {
                    // `amx`'s tiles accumulate their own way (`super::amx`'s tests).
                    continue;
                }
                let mut got = c0.clone();
                gemm_bf16(isa, d, &a16, &bp, &mut got);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{} kernel m={m} n={n} k={k}",
                    isa.isa()
                );
            }
        }
    }

    #[test]
    fn e4m3_f32_is_the_codec() {
        for c in 0..=255u8 {
            let (a, b) = (e4m3_f32(c), sparsekit_kernels::fp8::e4m3_to_f32(c));
            assert_eq!(a.to_bits(), b.to_bits(), "code {c:#x}");
            assert!(is_bf16(a));
        }
    }

    #[test]
    fn flushes_and_rounding() {
        assert_eq!(bf16_daz(0x0001).to_bits(), 0);
        assert_eq!(bf16_daz(0x8001).to_bits(), 0x8000_0000);
        assert_eq!(bf16_daz(0x3f80), 1.0);
        assert_eq!(round_bf16_daz(1.0 + 1.0 / 256.0), 0x3f80); // tie to even
        assert_eq!(round_bf16_daz(1e-39), 0);
        assert_eq!(f32_daz(1e-39), 0.0);
        assert!(is_bf16(1.5) && !is_bf16(1.0 + f32::EPSILON));
    }
}
