//! Criterion benches of the CPU backend at DeepSeek-V3.2 dims, read against this machine's
//! roofline.
//!
//! `cargo bench -p sparsekit-benches` measures the copy bandwidth and f32 FMA peak, runs
//! every group (`indexer_logits`, `topk`, `sparse_mla`, the stores, `copy_pages` between
//! the host and device tiers, `page_checksums`, the model's `dense_matmul`), measures the
//! roofline again (each ceiling is the best of the two), then prints a table of time,
//! GB/s, GFLOP/s, the bound that applies and the fraction of it reached, and writes the
//! same as JSON to `<target>/criterion/sparsekit-roofline.json`. Criterion's own
//! throughput line is FLOP/s (shown as `elem/s`) for compute-bound ops and bytes/s for
//! memory-bound ones. A criterion filter (`cargo bench -p sparsekit-benches -- topk`)
//! skips building the inputs of the other groups. In test mode (`cargo test --benches`)
//! every group runs once on small shapes.

#![allow(
    clippy::expect_used,
    reason = "bench harness: a failed setup or op call aborts the run with its message"
)]

use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput};
use sparsekit_benches::cost::Cost;
use sparsekit_benches::dense::MatmulCase;
use sparsekit_benches::inputs::{IndexerLogitsCase, SparseMlaCase, TopkCase};
use sparsekit_benches::inputs_v4::SparseMlaV4Case;
use sparsekit_benches::pages::{ChecksumCase, CopyCase, StoreCase};
use sparsekit_benches::report::{criterion_dir, Bound, Machine, Report, Row};
use sparsekit_benches::roofline::{self, Effort, Roofline};
use sparsekit_benches::{indexer_logits_id, sparse_mla_id, topk_id, Scale, Suite};
use sparsekit_host::{CpuBackend, Result};

const SAMPLES: usize = 10;

/// One configuration's measured per-call times (seconds, one per criterion sample).
struct Measured {
    group: String,
    id: String,
    cost: Cost,
    per_call_s: Vec<f64>,
}

/// Benchmarks one configuration; builds its inputs only if criterion runs it. `roof` picks
/// criterion's throughput unit (FLOP/s for compute-bound ops, bytes/s otherwise).
#[allow(clippy::too_many_arguments, reason = "one call site per op kind")]
fn bench_one<C>(
    c: &mut Criterion,
    backend: &CpuBackend,
    roof: &Roofline,
    group: &str,
    id: &str,
    cost: Cost,
    build: impl Fn(&CpuBackend) -> Result<C>,
    run: impl Fn(&mut C, &CpuBackend) -> Result<()>,
) -> Measured {
    let (bound, _) = Bound::of(cost, roof);
    let mut g = c.benchmark_group(group);
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(match bound {
        Bound::Compute => Throughput::Elements(cost.flops),
        Bound::Memory => Throughput::Bytes(cost.bytes),
    });
    let mut case: Option<C> = None;
    // Seconds per call of every routine call, warm-up included; the measured samples are
    // the last SAMPLES calls.
    let mut per_call: Vec<f64> = Vec::new();
    g.bench_function(id, |b| {
        let case = case.get_or_insert_with(|| {
            build(backend).unwrap_or_else(|e| panic!("building {group}/{id}: {e}"))
        });
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                run(case, backend).unwrap_or_else(|e| panic!("{group}/{id}: {e}"));
            }
            let elapsed = t.elapsed();
            per_call.push(elapsed.as_secs_f64() / iters.max(1) as f64);
            elapsed
        });
    });
    g.finish();
    drop(case);
    Measured {
        group: group.to_string(),
        id: id.to_string(),
        cost,
        per_call_s: per_call[per_call.len().saturating_sub(SAMPLES)..].to_vec(),
    }
}

fn measure_roofline(effort: Effort) -> Roofline {
    let roof = roofline::measure(effort);
    println!(
        "roofline: copy {:.1} GB/s, f32 FMA {:.1} GFLOP/s ({}, {} threads)",
        roof.copy_bytes_per_s / 1e9,
        roof.fma_flops_per_s / 1e9,
        roof.fma_isa,
        roof.threads
    );
    roof
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bench_mode = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test");
    let (scale, effort) = if bench_mode {
        (Scale::Full, Effort::Full)
    } else {
        (Scale::Smoke, Effort::Quick)
    };
    let roof = measure_roofline(effort);

    let mut c = Criterion::default()
        .sample_size(SAMPLES)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let backend = CpuBackend::new();
    let suite = Suite::new(scale).expect("bench configurations");
    let mut measured = Vec::new();

    for (i, shape) in suite.indexer_logits.iter().enumerate() {
        let cost = shape.cost().expect("indexer cost");
        measured.push(bench_one(
            &mut c,
            &backend,
            &roof,
            "indexer_logits",
            &indexer_logits_id(shape),
            cost,
            |be| IndexerLogitsCase::build(be, *shape, 100 + i as u64),
            |case, be| case.run(be),
        ));
    }
    for (i, shape) in suite.topk.iter().enumerate() {
        let cost = shape.cost().expect("topk cost");
        measured.push(bench_one(
            &mut c,
            &backend,
            &roof,
            "topk",
            &topk_id(shape),
            cost,
            |be| TopkCase::build(be, *shape, 200 + i as u64),
            |case, be| case.run(be),
        ));
    }
    for (i, shape) in suite.sparse_mla.iter().enumerate() {
        measured.push(bench_one(
            &mut c,
            &backend,
            &roof,
            "sparse_mla",
            &sparse_mla_id(shape),
            shape.cost(),
            |be| SparseMlaCase::build(be, *shape, 300 + i as u64),
            |case, be| case.run(be),
        ));
    }
    for (i, shape) in suite.sparse_mla_v4.iter().enumerate() {
        measured.push(bench_one(
            &mut c,
            &backend,
            &roof,
            "sparse_mla_v4",
            &shape.id(),
            shape.cost(),
            |be| SparseMlaV4Case::build(be, *shape, 350 + i as u64),
            |case, be| case.run(be),
        ));
    }
    for (i, shape) in suite.stores.iter().enumerate() {
        let (group, id) = shape.id();
        measured.push(bench_one(
            &mut c,
            &backend,
            &roof,
            &group,
            &id,
            shape.cost(),
            |be| StoreCase::build(be, *shape, 400 + i as u64),
            |case, be| case.run(be),
        ));
    }
    for (i, shape) in suite.copies.iter().enumerate() {
        measured.push(bench_one(
            &mut c,
            &backend,
            &roof,
            "copy_pages",
            &shape.id(),
            shape.cost(),
            |be| CopyCase::build(be, *shape, 500 + i as u64),
            |case, be| case.run(be),
        ));
    }
    for (i, shape) in suite.checksums.iter().enumerate() {
        measured.push(bench_one(
            &mut c,
            &backend,
            &roof,
            "page_checksums",
            &shape.id(),
            shape.cost(),
            |be| ChecksumCase::build(be, *shape, 600 + i as u64),
            |case, be| case.run(be),
        ));
    }
    for (i, shape) in suite.matmuls.iter().enumerate() {
        measured.push(bench_one(
            &mut c,
            &backend,
            &roof,
            "dense_matmul",
            &shape.id(),
            shape.cost(),
            |be| MatmulCase::build(be, *shape, 700 + i as u64),
            |case, be| case.run(be),
        ));
    }
    c.final_summary();

    // Measure again after the ops: on a shared machine either measurement may come out low.
    let roof_after = measure_roofline(effort);
    let best = roof.best_of(&roof_after);
    let results = measured
        .iter()
        .filter_map(|m| Row::new(&m.group, &m.id, m.cost, &m.per_call_s, &best))
        .collect();
    let report = Report {
        date: sparsekit_benches::report::utc_date(),
        machine: Machine::detect(),
        roofline: best,
        roofline_runs: vec![roof, roof_after],
        results,
    };
    println!();
    println!("{}", report.table());
    if bench_mode {
        let path = criterion_dir().join("sparsekit-roofline.json");
        match report.write_json(&path) {
            Ok(()) => println!("wrote {}", path.display()),
            Err(e) => eprintln!("cannot write {}: {e}", path.display()),
        }
    }
}
