//! `cargo run --release -p sparsekit-benches --example indexer_stages -- [ROUNDS]`: the
//! stages of the few-head indexer decode (fp8 keys, a group of 8 query heads) on the
//! `avx2` and `avx512` paths, each timed alone on one thread over one block of 64 keys of
//! 64 dims held in L1, in ns per key (the least of `ROUNDS`, default 5):
//!
//! - the f16 route, which the op takes: the byte transpose of the codes (`Kᵀ`), their
//!   widening to the f16 form, and the score GEMM `C[8 × 64] = Q · Kᵀ` that widens the
//!   f16 as it loads it (column chunks of 32 keys, as the op calls it);
//! - the Cᵀ route, its alternative: the codes widened to f32 rows, `Cᵀ[64 × 8] = K · Qᵀ`
//!   (row chunks of 16 keys, register tiles of 12 rows × 8 heads on AVX2) and `C = (Cᵀ)ᵀ`
//!   for the head sums;
//! - where the CPU has AVX512_BF16, the `avx512bf16` path's route (the op's there): the
//!   codes widened to bf16 rows, Kᵀ as their pairs transposed in 32-bit units, and the
//!   `vdpbf16ps` score GEMM, against the bf16 dot product's rate on one thread.
//!
//! "FMA bound" is the key's 1024 FLOP (8 heads × 64 dims) at the path's f32 FMA rate on
//! one thread (the roofline's measurement, in a pool of one thread). The stages' sum
//! against the op's time per key shows what the op spends outside them (prefetch,
//! epilogue, memory). Both routes do the same
//! products in the same order: their scores must be the same bits, or the run fails.

use std::hint::black_box;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use sparsekit_benches::roofline::{bf16_dot_peak, fma_peak_of};
use sparsekit_host::cpu::dot::{gemm_bf16_into, round_bf16, PairDims};
use sparsekit_host::cpu::gemm::{gemm_pairs_into, gemm_pairs_into_f16b, splat, Dims, SPLAT};
use sparsekit_host::cpu::transpose::{transpose, transpose_bytes};
use sparsekit_host::cpu::widen::{e4m3_f16_row, e4m3_f32_row, e4m3_row_pow2};
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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5usize)
        .max(1);
    // The stages run on this thread: the FMA rate they are held to is one thread's too.
    let one_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
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
    let paths: Vec<CpuIsa> = CpuIsa::available()
        .into_iter()
        .filter(|isa| matches!(isa.isa(), Isa::Avx2 | Isa::Avx512))
        .collect();
    // Qᵀ unscaled for the Cᵀ route: its f32 rows hold the keys' values.
    let qt1: Vec<f32> = qt.iter().map(|x| x / 256.0).collect();
    let (mut f16_rows, mut ct_rows) = (Vec::new(), Vec::new());
    for &isa in &paths {
        let bound = fma_bound(isa, rounds, &one_thread);
        // The f16 route.
        let mut ktb = vec![0u8; KEYS * DIM];
        let mut kh = vec![0u16; KEYS * DIM];
        let mut c = vec![f32::NAN; HEADS * KEYS];
        let t = ns_per_key(rounds, || {
            transpose_bytes(isa, KEYS, DIM, black_box(&codes), DIM, &mut ktb, KEYS);
        });
        let w = ns_per_key(rounds, || {
            black_box(e4m3_f16_row(isa, black_box(&ktb), &mut kh));
        });
        let g = ns_per_key(rounds, || {
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
        f16_rows.push(row(isa, [t, w, g], g, bound));
        // The Cᵀ route.
        let mut kf = vec![0f32; KEYS * DIM];
        let mut ct = vec![f32::NAN; KEYS * HEADS];
        let mut c2 = vec![f32::NAN; HEADS * KEYS];
        let w = ns_per_key(rounds, || {
            e4m3_f32_row(isa, black_box(&codes), &mut kf);
        });
        let g = ns_per_key(rounds, || {
            for s0 in (0..KEYS).step_by(16) {
                let dims = Dims {
                    m: 16,
                    n: HEADS,
                    k: DIM,
                    lda: DIM,
                    ldb: HEADS,
                    ldc: HEADS,
                };
                let (a, out) = (&kf[s0 * DIM..], &mut ct[s0 * HEADS..]);
                gemm_pairs_into(isa, dims, black_box(a), &qt1, out);
            }
            black_box(&mut ct);
        });
        let t = ns_per_key(rounds, || {
            transpose(isa, KEYS, HEADS, black_box(&ct), HEADS, &mut c2, KEYS);
        });
        ct_rows.push(row(isa, [w, g, t], g, bound));
        // The same products in the same order: the same bits (and none left unset).
        assert!(
            c.iter()
                .zip(&c2)
                .all(|(x, y)| x.is_finite() && x.to_bits() == y.to_bits()),
            "{}: the two routes' scores differ",
            isa.isa().name()
        );
    }
    let dot_row = bf16_dot_route(&codes, &qt1, rounds, &one_thread);
    println!("ns per key, one thread, the least of {rounds} rounds.");
    println!("\nThe f16 route (the op's):\n");
    println!("| path | byte transpose | e4m3 → f16 | score GEMM | sum | FMA bound | GEMM at |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    f16_rows.iter().for_each(|r| println!("{r}"));
    println!("\nThe Cᵀ route:\n");
    println!(
        "| path | e4m3 → f32 rows | score GEMM | transpose of C | sum | FMA bound | GEMM at |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    ct_rows.iter().for_each(|r| println!("{r}"));
    if let Some(r) = dot_row {
        println!("\nThe bf16 rows on `vdpbf16ps` (bound: the bf16 dot product's rate):\n");
        println!(
            "| path | e4m3 → bf16 rows | 32-bit transpose | score GEMM | sum | bf16 bound | GEMM at |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|");
        println!("{r}");
    }
    Ok(())
}

/// The `avx512bf16` path's route for fp8 keys, where the CPU has it: the codes widened to
/// bf16 rows, their pairs transposed as 32-bit units (`Kᵀ`), the score GEMM on the pairs.
fn bf16_dot_route(
    codes: &[u8],
    qt1: &[f32],
    rounds: usize,
    pool: &rayon::ThreadPool,
) -> Option<String> {
    let isa = CpuIsa::available()
        .into_iter()
        .find(|isa| isa.isa().bf16_dot())?;
    let rate = pool.install(|| bf16_dot_peak(isa, 0.02, rounds));
    let bound = (2 * HEADS * DIM) as f64 / rate * 1e9;
    // Q as bf16 rows [heads × dims] (the op's `qb`): Qᵀ's columns.
    let qb: Vec<u16> = (0..HEADS * DIM)
        .map(|i| round_bf16(qt1[(i % DIM) * HEADS + i / DIM]))
        .collect();
    let half = DIM / 2;
    // The op's calls: column chunks of 32 keys.
    let dims = PairDims {
        m: HEADS,
        n: 32,
        k2: half,
        lda: DIM,
        ldb: KEYS,
        ldc: KEYS,
    };
    let mut kb = vec![0u16; KEYS * DIM];
    let mut kt = vec![0f32; half * KEYS];
    let mut c = vec![f32::NAN; HEADS * KEYS];
    let w = ns_per_key(rounds, || e4m3_row_pow2(isa, black_box(codes), 0, &mut kb));
    let t = ns_per_key(rounds, || {
        let pairs: &[f32] = bytemuck::cast_slice(&kb);
        transpose(isa, KEYS, half, black_box(pairs), half, &mut kt, KEYS);
    });
    let g = ns_per_key(rounds, || {
        let ktp: &[u32] = bytemuck::cast_slice(&kt);
        for c0 in [0, 32] {
            gemm_bf16_into(isa, dims, black_box(&qb), &ktp[c0..], &mut c[c0..]);
        }
        black_box(&mut c);
    });
    Some(row(isa, [w, t, g], g, bound))
}

/// A table row: the path, its three stages (ns per key), their sum, the FMA bound and the
/// GEMM's fraction of it.
fn row(isa: CpuIsa, stages: [f64; 3], gemm: f64, bound: f64) -> String {
    let [a, b, c] = stages;
    let name = isa.isa().name();
    format!(
        "| {name} | {a:.2} | {b:.2} | {c:.2} | {:.2} | {bound:.2} | {:.2} |",
        a + b + c,
        bound / gemm
    )
}

/// A key's FLOP (an FMA is 2) at the f32 FMA rate of `isa` on the one thread of `pool`
/// (the roofline's measurement, best of `rounds` runs of about 20 ms), in ns.
fn fma_bound(isa: CpuIsa, rounds: usize, pool: &rayon::ThreadPool) -> f64 {
    let (rate, _) = pool.install(|| fma_peak_of(isa, 0.02, rounds));
    (2 * HEADS * DIM) as f64 / rate * 1e9
}
