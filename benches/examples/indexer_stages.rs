//! `cargo run --release -p sparsekit-benches --example indexer_stages -- [ROUNDS]`: the
//! three stages of the few-head indexer decode's f16 route (the route of the `avx2` and
//! `avx512` paths for fp8 keys and groups of 8 query heads), each timed alone on one
//! thread over one block of 64 keys of 64 dims held in L1: the byte transpose of the codes
//! (`Kᵀ`), their widening to the f16 form, and the score GEMM `C[8 × 64] = Q · Kᵀ` that
//! widens the f16 as it loads it. Prints ns per key for each stage (the least of
//! `ROUNDS`, default 5) and what the key's 1024 FLOP (8 heads × 64 dims) would take at the
//! path's f32 FMA rate measured on the same thread: the stages' sum against the op's time per
//! key shows what the op spends outside them (prefetch, epilogue, memory).

use std::hint::black_box;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use sparsekit_host::cpu::gemm::{gemm_pairs_into_f16b, splat, Dims, SPLAT};
use sparsekit_host::cpu::peak::{fma_flops_per_round, fma_rounds};
use sparsekit_host::cpu::transpose::transpose_bytes;
use sparsekit_host::cpu::widen::e4m3_f16_row;
use sparsekit_host::cpu::{CpuIsa, Isa};

/// Keys per block and dims per key (the tiny model's index head: 64).
const KEYS: usize = 64;
const DIM: usize = 64;
/// Query heads of the group (GEMM rows).
const HEADS: usize = 8;
/// Calls per timed round.
const CALLS: usize = 20_000;

/// Nanoseconds per key of `f` (one block per call), the least of `rounds` rounds.
fn ns_per_key(rounds: usize, mut f: impl FnMut()) -> f64 {
    (0..rounds)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..CALLS {
                f();
            }
            start.elapsed().as_secs_f64() * 1e9 / (CALLS * KEYS) as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let rounds = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5usize)
        .max(1);
    let mut rng = rand_chacha::ChaCha8Rng::from_entropy();
    // Random e4m3 codes, never the NaN codes (0x7f, 0xff): the f16 route's domain.
    let codes: Vec<u8> = (0..KEYS * DIM)
        .map(|_| loop {
            let c: u8 = rng.gen();
            if c & 0x7f != 0x7f {
                break c;
            }
        })
        .collect();
    let qt: Vec<f32> = (0..DIM * HEADS)
        .map(|_| rng.gen_range(-2.0f32..2.0) * 256.0)
        .collect();
    let mut at8 = vec![0f32; DIM * HEADS * SPLAT];
    splat(&qt, &mut at8);
    println!("ns per key, one thread, the least of {rounds} rounds:");
    println!("| path | transpose | widen | GEMM | sum | FMA bound | GEMM at |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for isa in CpuIsa::available() {
        if !matches!(isa.isa(), Isa::Avx2 | Isa::Avx512) {
            continue;
        }
        let mut ktb = vec![0u8; KEYS * DIM];
        let mut kh = vec![0u16; KEYS * DIM];
        let mut c = vec![f32::NAN; HEADS * KEYS];
        let transpose = ns_per_key(rounds, || {
            transpose_bytes(isa, KEYS, DIM, black_box(&codes), DIM, &mut ktb, KEYS);
        });
        let widen = ns_per_key(rounds, || {
            black_box(e4m3_f16_row(isa, black_box(&ktb), &mut kh));
        });
        // As the op calls it: column chunks of 32 keys.
        let gemm = ns_per_key(rounds, || {
            for c0 in [0, 32] {
                let dims = Dims {
                    m: HEADS,
                    n: 32,
                    k: DIM,
                    lda: HEADS,
                    ldb: KEYS,
                    ldc: KEYS,
                };
                gemm_pairs_into_f16b(isa, dims, black_box(&at8), &kh[c0..], &mut c[c0..]);
            }
            black_box(&mut c);
        });
        assert!(
            c.iter().all(|x| x.is_finite()),
            "the GEMM left a score unset"
        );
        // FLOP per key (an FMA is 2) over the path's FMA rate on this thread, in ns.
        let ideal = (2 * HEADS * DIM) as f64 / fma_rate(isa, rounds) * 1e9;
        println!(
            "| {} | {transpose:.2} | {widen:.2} | {gemm:.2} | {:.2} | {ideal:.2} | {:.2} |",
            isa.isa().name(),
            transpose + widen + gemm,
            ideal / gemm,
        );
    }
}

/// The f32 FMA rate of `isa` on this thread (FLOP/s), the best of `rounds` runs of about
/// 20 ms.
fn fma_rate(isa: CpuIsa, rounds: usize) -> f64 {
    const ITERS: u64 = 10_000_000;
    (0..rounds)
        .map(|_| {
            let start = Instant::now();
            black_box(fma_rounds(
                isa,
                black_box(ITERS),
                black_box(0.999_9),
                black_box(1e-4),
            ));
            ITERS as f64 * fma_flops_per_round(isa.isa()) / start.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}
