//! The arithmetic rates of this CPU's vector paths: the timing kernels behind the bench's
//! roofline, the measurement that decides whether the default path uses the bf16
//! dot-product instruction ([`CpuIsa::detected`]), and the one that tells whether 512-bit
//! FMAs do twice the work of 256-bit ones ([`wide_fma`]).
//!
//! `vdpbf16ps` does two multiply-adds per 32-bit lane, an f32 FMA one; whether it is the
//! faster of the two depends on the core. On AMD Zen 4 and Zen 5 it issues as often as an
//! FMA, so it multiplies twice as fast; on the Intel Xeon (AVX-512 BF16, AMX) these lines
//! were measured on it issues once every other cycle, at **half** the f32 FMA's FLOP rate
//! (`vdpbf16ps` 123 vs f32 FMA 247 GFLOP/s per core, throughput-bound: 8 and 24 chains
//! measure the same). So the default path is chosen by measuring both on the core at hand.

use std::hint::black_box;
use std::sync::OnceLock;
use std::time::Instant;

use super::isa::{CpuIsa, Isa};

/// The bf16 dot product must multiply at least this many times as fast as the f32 FMA
/// for the default path to use it: with both at the same rate the f32 path is the better
/// tuned one, and 1.25 sits far from either kind of core measured (2.0 and 0.5).
pub const BF16_DOT_MIN_SPEEDUP: f64 = 1.25;

/// The `avx512` path's f32 FMAs must do at least this many times the FLOPs per second of
/// the `avx2` path's for [`wide_fma`]: cores with two full-width 512-bit FMA units measure
/// 2.0, cores that split a 512-bit FMA into two 256-bit halves (AMD Zen 4) 1.0.
pub const WIDE_FMA_MIN_SPEEDUP: f64 = 1.5;

/// Independent FMA chains per round of [`fma_rounds`] on a path: 16 zmm registers of 16
/// lanes for AVX-512, 12 ymm (of 16 registers) for AVX2, 32 for portable code. `N / lanes`
/// chains cover FMA latency × issue width (4 cycles × 2 pipes on current x86 cores) and
/// leave registers for the operands.
pub const fn fmas_per_round(isa: Isa) -> usize {
    match isa {
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => 16 * 16,
        Isa::Avx2 => 12 * 8,
        Isa::Scalar => 32,
    }
}

/// FLOPs of one round of [`fma_rounds`] on `isa` (an FMA is 2).
pub const fn fma_flops_per_round(isa: Isa) -> f64 {
    2.0 * fmas_per_round(isa) as f64
}

/// `iters` rounds of [`fmas_per_round`] independent FMAs (`a = a·x + y`, every chain from
/// 1); returns the sum of the chains. A flat array and one simple loop: LLVM vectorises it
/// at the enabled width and keeps every accumulator in a register (checked with objdump:
/// 16 register-only `vfmadd…ps zmm` per round for AVX-512, 12 `ymm` for AVX2).
#[inline(always)]
fn fma_chains<const N: usize>(iters: u64, x: f32, y: f32) -> f32 {
    let mut acc = [1.0f32; N];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = a.mul_add(x, y);
        }
    }
    acc.iter().sum()
}

crate::isa_dispatch! {
    /// `iters` rounds of the path's independent FMA chains (`a = a·x + y` from 1), compiled
    /// for the path; the sum of the chains. Time it for the path's f32 FMA rate
    /// ([`fma_flops_per_round`] per round); `0 < x < 1`, `y > 0` keep every chain finite.
    pub fn fma_rounds(iters: u64, x: f32, y: f32) -> f32 =
        |ISA| fma_chains::<{ fmas_per_round(ISA.isa()) }>(iters, x, y);
}

/// FLOPs of one round of [`dot_rounds`]: 16 instructions × 16 lanes × 2 pairs × 2.
pub const DOT_FLOPS_PER_ROUND: f64 = 16.0 * 16.0 * 2.0 * 2.0;

/// `iters` rounds of 16 independent `vdpbf16ps` chains; a value that depends on them all
/// (every chain from 1, each step adding `2·2^-40`). `None` on a path without the
/// instruction.
pub fn dot_rounds(isa: CpuIsa, iters: u64) -> Option<f32> {
    if !isa.isa().bf16_dot() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `isa` is the avx512bf16 path, which a `CpuIsa` names only on a CPU with
        // AVX-512F and AVX512_BF16.
        Some(unsafe { x86::dot_chains(iters) })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = iters;
        None
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 intrinsics need Rust 1.89, as the AVX-512 target features already do"
)]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::dot_rounds`]'s kernel.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dot_chains(iters: u64) -> f32 {
        // Pairs of 2^-20: each step adds 2^-39 to chains that start at 1: no overflow, no
        // subnormals.
        let pair = _mm512_set1_epi32(0x3580_3580);
        // SAFETY: both are 512-bit vectors; every bit pattern is a valid `__m512bh`.
        let x: __m512bh = unsafe { std::mem::transmute::<__m512i, __m512bh>(pair) };
        let mut acc = [_mm512_set1_ps(1.0); 16];
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_dpbf16_ps(*a, x, x);
            }
        }
        let mut s = _mm512_setzero_ps();
        for a in acc {
            s = _mm512_add_ps(s, a);
        }
        _mm512_reduce_add_ps(s)
    }
}

/// FLOPs of one round of [`tile_rounds`]: 4 `tdpbf16ps` × 16 × 16 × 32 multiply-adds × 2.
pub const TILE_FLOPS_PER_ROUND: f64 = 4.0 * 16.0 * 16.0 * 32.0 * 2.0;

/// `iters` rounds of four independent `tdpbf16ps` on AMX tiles (operands in tiles, no
/// loads); a value that depends on them all. `None` on a path without tiles (all but
/// `amx`).
pub fn tile_rounds(isa: CpuIsa, iters: u64) -> Option<f32> {
    if isa.isa() != Isa::Amx {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: a `CpuIsa` of the amx path exists only where AMX tiles are available.
        Some(unsafe { super::amx::peak_rounds(iters) })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = iters;
        None
    }
}

/// The bf16 dot product's FLOP rate over the f32 FMA's, on one core of this CPU; `None`
/// where the CPU has no `vdpbf16ps` (or AVX-512). Measured once per process on the calling
/// thread (both kernels alternated, best of 9 runs of about 10 µs each, under 1 ms in all),
/// then cached.
pub fn bf16_dot_speedup() -> Option<f64> {
    static SPEEDUP: OnceLock<Option<f64>> = OnceLock::new();
    *SPEEDUP.get_or_init(|| {
        let isa = CpuIsa::new(Isa::Avx512Bf16).ok()?;
        Some(measure_speedup(isa))
    })
}

/// Whether this core's 512-bit f32 FMAs do about twice the work per second of its 256-bit
/// ones ([`WIDE_FMA_MIN_SPEEDUP`]); false without AVX-512. Kernels use it to choose between
/// routes that give the same bits (so it never changes a result): on such a core a tile
/// one 256-bit vector wide runs at half the path's peak. Measured once per process on the
/// calling thread (both paths' [`fma_rounds`] alternated, best of 9 runs of about 40 µs
/// each after one that wakes the 512-bit units; under 1 ms in all), then cached. Runs of
/// 1024 rounds (3 µs) were too short on an Intel Xeon: while the upper halves of its FMA
/// units power up, 512-bit FMAs run at the 256-bit rate (92–118 against 107–110 GFLOP/s a
/// core; 213–222 against 115–119 in runs of 65536 rounds).
pub fn wide_fma() -> bool {
    static WIDE: OnceLock<bool> = OnceLock::new();
    *WIDE.get_or_init(|| {
        let (Ok(zmm), Ok(ymm)) = (CpuIsa::new(Isa::Avx512), CpuIsa::new(Isa::Avx2)) else {
            return false;
        };
        const ITERS: u64 = 16384;
        let rate = |isa: CpuIsa| {
            let t = Instant::now();
            black_box(fma_rounds(
                isa,
                black_box(ITERS),
                black_box(0.999_9),
                black_box(1e-4),
            ));
            fma_flops_per_round(isa.isa()) * ITERS as f64 / t.elapsed().as_secs_f64().max(1e-9)
        };
        rate(zmm);
        let (mut wide, mut narrow) = (0f64, 0f64);
        for _ in 0..9 {
            wide = wide.max(rate(zmm));
            narrow = narrow.max(rate(ymm));
        }
        wide >= WIDE_FMA_MIN_SPEEDUP * narrow
    })
}

/// Whether the path `isa` runs its tiles one 256-bit vector wide at half its peak: an f32
/// AVX-512 path (`avx512`, or `amx` outside its tiles; not `avx512bf16`) on a
/// [`wide_fma`] core. The kernels' choice of equivalent routes (same bits either way).
pub fn wide_tiles(isa: CpuIsa) -> bool {
    isa.vector() == Isa::Avx512 && wide_fma()
}

/// [`bf16_dot_speedup`] measured now on `isa` (a path with the instruction).
fn measure_speedup(isa: CpuIsa) -> f64 {
    const ITERS: u64 = 1024;
    let time = |f: &dyn Fn() -> f32| {
        let t = Instant::now();
        black_box(f());
        t.elapsed().as_secs_f64().max(1e-9)
    };
    let (mut fma, mut dot) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..9 {
        fma = fma.min(time(&|| {
            fma_rounds(isa, black_box(ITERS), black_box(0.999_9), black_box(1e-4))
        }));
        dot = dot.min(time(&|| {
            dot_rounds(isa, black_box(ITERS)).unwrap_or_default()
        }));
    }
    (DOT_FLOPS_PER_ROUND / dot) / (fma_flops_per_round(isa.isa()) / fma)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_compute_their_recurrences() {
        // 3 rounds of a = a·0.5 + 1 from 1: 1.5, 1.75, 1.875 in every lane, on every path.
        for isa in CpuIsa::available() {
            let per_round = fmas_per_round(isa.isa());
            assert_eq!(fma_rounds(isa, 3, 0.5, 1.0), 1.875 * per_round as f32);
            // 16 chains × 16 lanes, each 1 + 3 steps × 2 pairs × 2^-40: in f32, 1 (the
            // steps are below half an ulp of 1) — but the value exists only with the
            // instruction.
            match dot_rounds(isa, 3) {
                Some(v) => assert_eq!(v, 256.0, "{}", isa.isa()),
                None => assert!(!isa.isa().bf16_dot()),
            }
            // One accumulator row of 16, each 1 + 3 rounds × 32 products of 2^-40: 16 in
            // f32, on the amx path only.
            match tile_rounds(isa, 3) {
                Some(v) => assert_eq!(v, 16.0, "{}", isa.isa()),
                None => assert_ne!(isa.isa(), Isa::Amx),
            }
        }
    }

    #[test]
    fn the_speedup_is_measured_exactly_where_the_instruction_is() {
        // Never true on a CPU without AVX-512 (where the wide route's kernels are absent).
        assert!(!wide_fma() || Isa::Avx512.supported());
        let s = bf16_dot_speedup();
        assert_eq!(s.is_some(), Isa::Avx512Bf16.supported());
        if let Some(s) = s {
            // Between a quarter and four times the FMA rate on any real core.
            assert!(s.is_finite() && (0.25..4.0).contains(&s), "{s}");
        }
    }
}
