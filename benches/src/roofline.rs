//! This machine's roofline: multi-threaded memory copy bandwidth and f32 FMA peak.
//!
//! Both are measured on rayon's global pool (the pool the CPU backend runs on), one
//! piece of work per worker thread, best of several runs.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use sparsekit_host::cpu::{CpuIsa, Isa};

/// The two ceilings every bench result is read against.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Roofline {
    /// Memory copy bandwidth, bytes read + bytes written per second.
    pub copy_bytes_per_s: f64,
    /// Bytes of the copy's source (the destination is as large).
    pub copy_buffer_bytes: usize,
    /// f32 FMA peak in FLOP/s (one FMA = 2 FLOP), all threads.
    pub fma_flops_per_s: f64,
    /// The instruction set the FMA loop ran with (`avx512f`, `avx2+fma`, `scalar`).
    pub fma_isa: &'static str,
    /// Worker threads used for both.
    pub threads: usize,
}

impl Roofline {
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

/// Measures both ceilings.
pub fn measure(effort: Effort) -> Roofline {
    let (copy_bytes, copy_runs, fma_target_s, fma_runs) = match effort {
        Effort::Full => (256 << 20, 5, 0.25, 5),
        Effort::Quick => (8 << 20, 2, 0.01, 2),
    };
    let (fma_flops_per_s, fma_isa) = fma_peak(fma_target_s, fma_runs);
    Roofline {
        copy_bytes_per_s: copy_bandwidth(copy_bytes, copy_runs),
        copy_buffer_bytes: copy_bytes,
        fma_flops_per_s,
        fma_isa,
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

/// Runs `iters` rounds of `N` independent FMAs (`a = a·x + y`) and returns a value that
/// depends on every accumulator. A flat array and one simple loop: LLVM vectorises it at
/// the enabled width and keeps every accumulator in a register (checked with objdump: 16
/// register-only `vfmadd…ps zmm` per round for AVX-512, 12 `ymm` for AVX2). `N / lanes`
/// independent chains cover FMA latency × issue width (4 cycles × 2 pipes on current x86
/// cores) and leave registers for `x` and `y`.
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

/// FMAs per round of a path's kernel: 16 zmm chains for AVX-512, 12 ymm chains (of 16
/// registers) for AVX2, 32 for portable code.
const fn fmas_per_round(isa: Isa) -> usize {
    match isa {
        Isa::Avx512Bf16 | Isa::Avx512 => 16 * 16,
        Isa::Avx2 => 12 * 8,
        Isa::Scalar => 32,
    }
}

sparsekit_host::isa_dispatch! {
    /// [`fma_chains`] with the path's chain count, compiled for the path.
    fn fma_run(iters: u64, x: f32, y: f32) -> f32 =
        |ISA| fma_chains::<{ fmas_per_round(ISA.isa()) }>(iters, x, y);
}

/// f32 FMA peak of all rayon threads together, in FLOP/s, and the vector path used (the
/// CPU backend's default: the widest, or the one `SPARSEKIT_CPU_ISA` forces). Each run
/// lasts about `target_s`; the best of `runs` is returned.
pub fn fma_peak(target_s: f64, runs: usize) -> (f64, &'static str) {
    let isa = CpuIsa::get();
    let fmas_per_round = fmas_per_round(isa.isa());
    let kernel = |iters, x, y| fma_run(isa, iters, x, y);
    // x < 1 and y > 0: every chain converges to y / (1 - x), far from overflow and denormals.
    let run = |iters: u64| -> f64 {
        let t = Instant::now();
        let sums =
            rayon::broadcast(|_| kernel(black_box(iters), black_box(0.999_9), black_box(1e-4)));
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
    (
        2.0 * fmas_per_round as f64 * iters as f64 * threads / best,
        isa.isa().name(),
    )
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
        low.copy_bytes_per_s *= 2.0;
        let b = low.best_of(&r);
        assert_eq!(b.fma_flops_per_s, r.fma_flops_per_s);
        assert_eq!(b.copy_bytes_per_s, low.copy_bytes_per_s);
    }

    #[test]
    fn chains_compute_the_recurrence() {
        // 3 rounds of a = a·0.5 + 1 from 1: 1.5, 1.75, 1.875 in every lane, on every path.
        for isa in CpuIsa::available() {
            let per_round = fmas_per_round(isa.isa());
            assert_eq!(fma_run(isa, 3, 0.5, 1.0), 1.875 * per_round as f32);
        }
    }
}
