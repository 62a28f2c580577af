//! This machine's roofline: multi-threaded memory copy bandwidth, the f32 FMA peak of a
//! vector path and, on a path with the bf16 dot-product instruction (`vdpbf16ps`,
//! `avx512bf16`), its peak too.
//!
//! All are measured on rayon's global pool (the pool the CPU backend runs on), one piece
//! of work per worker thread, best of several runs.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use sparsekit_host::cpu::{peak, CpuIsa, Isa};

use crate::cost::Cost;

/// The two ceilings every bench result is read against.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Roofline {
    /// Memory copy bandwidth, bytes read + bytes written per second.
    pub copy_bytes_per_s: f64,
    /// Bytes of the copy's source (the destination is as large).
    pub copy_buffer_bytes: usize,
    /// f32 FMA peak in FLOP/s (one FMA = 2 FLOP), all threads.
    pub fma_flops_per_s: f64,
    /// The vector path the FMA loop ran with (`avx512bf16`, `avx512`, `avx2`, `scalar`).
    pub fma_isa: &'static str,
    /// The bf16 dot-product peak in FLOP/s (one multiply-add of a bf16 pair = 2 FLOP,
    /// `vdpbf16ps` does 32 per 512-bit vector), all threads; 0 on a path without the
    /// instruction.
    pub bf16_dot_flops_per_s: f64,
    /// The AMX-BF16 tile peak in FLOP/s (`tdpbf16ps`: 16 × 16 × 32 multiply-adds), all
    /// threads; 0 on a path without tiles (every path but `amx`).
    pub tile_flops_per_s: f64,
    /// Worker threads used for all.
    pub threads: usize,
}

impl Roofline {
    /// The compute ceiling `cost` is read against, and its name: the tile peak for the
    /// GEMM the `amx` path runs on tiles, the bf16 dot-product peak for bf16 dot products
    /// on a path that has the instruction, else the f32 FMA peak.
    pub fn compute_peak(&self, cost: &Cost) -> (f64, &'static str) {
        if cost.tiles && self.tile_flops_per_s > 0.0 {
            (self.tile_flops_per_s, "AMX tiles")
        } else if cost.bf16_dot && self.bf16_dot_flops_per_s > 0.0 {
            (self.bf16_dot_flops_per_s, "bf16 dot")
        } else {
            (self.fma_flops_per_s, "f32 FMA")
        }
    }

    /// Each ceiling at its best of `self` and `other`: on a shared machine a measurement
    /// can only come out low, so the higher one is the closer to the truth.
    pub fn best_of(&self, other: &Roofline) -> Roofline {
        let (fma_flops_per_s, fma_isa) = if other.fma_flops_per_s > self.fma_flops_per_s {
            (other.fma_flops_per_s, other.fma_isa)
        } else {
            (self.fma_flops_per_s, self.fma_isa)
        };
        let (copy_bytes_per_s, copy_buffer_bytes) =
            if other.copy_bytes_per_s > self.copy_bytes_per_s {
                (other.copy_bytes_per_s, other.copy_buffer_bytes)
            } else {
                (self.copy_bytes_per_s, self.copy_buffer_bytes)
            };
        Roofline {
            copy_bytes_per_s,
            copy_buffer_bytes,
            fma_flops_per_s,
            fma_isa,
            bf16_dot_flops_per_s: self.bf16_dot_flops_per_s.max(other.bf16_dot_flops_per_s),
            tile_flops_per_s: self.tile_flops_per_s.max(other.tile_flops_per_s),
            threads: self.threads.max(other.threads),
        }
    }
}

/// How long the measurements may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effort {
    /// Full-size buffers, several runs (about 3-5 s).
    Full,
    /// Small buffers, one or two runs (test mode; numbers are indicative only).
    Quick,
}

/// Measures every ceiling of the process's default vector path ([`CpuIsa::get`]).
pub fn measure(effort: Effort) -> Roofline {
    measure_path(CpuIsa::get(), effort)
}

/// Measures every ceiling of the vector path `isa`.
pub fn measure_path(isa: CpuIsa, effort: Effort) -> Roofline {
    let (copy_bytes, copy_runs, fma_target_s, fma_runs) = match effort {
        Effort::Full => (256 << 20, 5, 0.25, 5),
        Effort::Quick => (8 << 20, 2, 0.01, 2),
    };
    let (fma_flops_per_s, fma_isa) = fma_peak_of(isa, fma_target_s, fma_runs);
    Roofline {
        copy_bytes_per_s: copy_bandwidth(copy_bytes, copy_runs),
        copy_buffer_bytes: copy_bytes,
        fma_flops_per_s,
        fma_isa,
        bf16_dot_flops_per_s: bf16_dot_peak(isa, fma_target_s, fma_runs),
        tile_flops_per_s: tile_peak(isa, fma_target_s, fma_runs),
        threads: rayon::current_num_threads(),
    }
}

/// Copies a `bytes`-byte buffer into another (parallel over 1 MiB chunks) `runs` times and
/// returns the best rate in bytes read + written per second.
pub fn copy_bandwidth(bytes: usize, runs: usize) -> f64 {
    let words = (bytes / 8).max(1);
    let src: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
        .collect();
    let mut dst = vec![0u64; words];
    const CHUNK: usize = (1 << 20) / 8;
    let copy = |dst: &mut [u64]| {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
    };
    // Untimed first pass: faults every destination page in.
    copy(&mut dst);
    let mut best = f64::INFINITY;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        copy(black_box(&mut dst));
        best = best.min(t.elapsed().as_secs_f64());
        black_box(&dst);
    }
    (2 * words * 8) as f64 / best
}

/// f32 FMA peak of all rayon threads together, in FLOP/s, and the vector path used (the
/// CPU backend's default: the widest, or the one `SPARSEKIT_CPU_ISA` forces). Each run
/// lasts about `target_s`; the best of `runs` is returned.
pub fn fma_peak(target_s: f64, runs: usize) -> (f64, &'static str) {
    fma_peak_of(CpuIsa::get(), target_s, runs)
}

/// [`fma_peak`] of the vector path `isa`.
pub fn fma_peak_of(isa: CpuIsa, target_s: f64, runs: usize) -> (f64, &'static str) {
    // x < 1 and y > 0: every chain converges to y / (1 - x), far from overflow and denormals.
    let best = best_rate(target_s, runs, |iters| {
        peak::fma_rounds(isa, black_box(iters), black_box(0.999_9), black_box(1e-4))
    });
    (
        peak::fma_flops_per_round(isa.isa()) * best,
        isa.isa().name(),
    )
}

/// The bf16 dot-product peak of all rayon threads, in FLOP/s, on a path with `vdpbf16ps`
/// (0 on the others): 16 independent chains of the instruction per thread (each 16 lanes ×
/// 2 multiply-adds, [`peak::dot_rounds`]), best of `runs` of about `target_s`.
pub fn bf16_dot_peak(isa: CpuIsa, target_s: f64, runs: usize) -> f64 {
    if !isa.isa().bf16_dot() {
        return 0.0;
    }
    let best = best_rate(target_s, runs, |iters| {
        peak::dot_rounds(isa, black_box(iters)).unwrap_or_default()
    });
    peak::DOT_FLOPS_PER_ROUND * best
}

/// The AMX tile peak of all rayon threads, in FLOP/s, on the `amx` path (0 on the
/// others): four independent accumulator tiles per thread ([`peak::tile_rounds`]), best of
/// `runs` of about `target_s`.
pub fn tile_peak(isa: CpuIsa, target_s: f64, runs: usize) -> f64 {
    if isa.isa() != Isa::Amx {
        return 0.0;
    }
    let best = best_rate(target_s, runs, |iters| {
        peak::tile_rounds(isa, black_box(iters)).unwrap_or_default()
    });
    peak::TILE_FLOPS_PER_ROUND * best
}

/// Rounds per second of `kernel(iters)` on every rayon thread at once (rounds done by all
/// threads over the wall time): about `target_s` per run, the best of `runs`.
fn best_rate(target_s: f64, runs: usize, kernel: impl Fn(u64) -> f32 + Sync) -> f64 {
    let run = |iters: u64| -> f64 {
        let t = Instant::now();
        let sums = rayon::broadcast(|_| kernel(iters));
        let dt = t.elapsed().as_secs_f64();
        black_box(sums);
        dt
    };
    let mut iters = 1u64 << 12;
    loop {
        let dt = run(iters);
        if dt >= target_s / 4.0 || iters >= 1 << 40 {
            iters = ((iters as f64) * (target_s / dt.max(1e-9))).max(1.0) as u64;
            break;
        }
        iters *= 4;
    }
    let threads = rayon::current_num_threads() as f64;
    let mut best = f64::INFINITY;
    for _ in 0..runs.max(1) {
        best = best.min(run(iters));
    }
    iters as f64 * threads / best
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    reason = "tests: a failure panics with its message"
)]
mod tests {
    use super::*;

    #[test]
    fn quick_measurements_are_positive_and_finite() {
        let r = measure(Effort::Quick);
        assert!(
            r.copy_bytes_per_s.is_finite() && r.copy_bytes_per_s > 1e8,
            "{r:?}"
        );
        assert!(
            r.fma_flops_per_s.is_finite() && r.fma_flops_per_s > 1e8,
            "{r:?}"
        );
        assert!(r.threads >= 1);
        let mut low = r;
        low.fma_flops_per_s /= 2.0;
        low.bf16_dot_flops_per_s /= 2.0;
        low.copy_bytes_per_s *= 2.0;
        let b = low.best_of(&r);
        assert_eq!(b.fma_flops_per_s, r.fma_flops_per_s);
        assert_eq!(b.copy_bytes_per_s, low.copy_bytes_per_s);
        assert_eq!(b.bf16_dot_flops_per_s, r.bf16_dot_flops_per_s);
        // Only a path with the instruction has a bf16 dot-product peak, only `amx` a tile
        // peak.
        for isa in CpuIsa::available() {
            let peak = bf16_dot_peak(isa, 0.002, 1);
            assert_eq!(peak > 0.0, isa.isa().bf16_dot(), "{}", isa.isa());
            let tiles = tile_peak(isa, 0.002, 1);
            assert_eq!(tiles > 0.0, isa.isa() == Isa::Amx, "{}", isa.isa());
        }
    }
}
