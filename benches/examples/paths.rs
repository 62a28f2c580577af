//! `cargo run --release -p sparsekit-benches --example paths -- [OPS] [ISAS] [ROUNDS]
//! [SAMPLES]`: the cpu backend's vector paths side by side (the library behind `sparsekit
//! bench --isa`), without building the CLI: e.g. `-- indexer_logits,topk all 3 5`.

#![allow(
    clippy::expect_used,
    reason = "example: a failed run aborts with its message"
)]

use sparsekit_benches::paths::run_paths;
use sparsekit_benches::roofline::Effort;
use sparsekit_benches::runner::RunOptions;
use sparsekit_benches::{Scale, Suite};
use sparsekit_host::cpu::{CpuIsa, Isa};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ops: Vec<&str> = args
        .first()
        .map_or(vec![], |a| a.split(',').filter(|s| !s.is_empty()).collect());
    let isas: Vec<CpuIsa> = match args.get(1).map(String::as_str) {
        None | Some("all") => CpuIsa::available(),
        Some(list) => list
            .split(',')
            .map(|n| CpuIsa::new(Isa::parse(n).expect("a vector path")).expect("supported"))
            .collect(),
    };
    let rounds = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let samples = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(5);
    let mut suite = Suite::new(Scale::Full).expect("suite");
    suite.retain_ops(&ops);
    // SPARSEKIT_CASE=SUBSTR: only the cases whose config names contain it.
    if let Ok(case) = std::env::var("SPARSEKIT_CASE") {
        use sparsekit_benches::{indexer_logits_id, sparse_mla_id, topk_id};
        suite
            .indexer_logits
            .retain(|s| indexer_logits_id(s).contains(&case));
        suite.topk.retain(|s| topk_id(s).contains(&case));
        suite
            .sparse_mla
            .retain(|s| sparse_mla_id(s).contains(&case));
        suite.sparse_mla_v4.retain(|s| s.id().contains(&case));
        suite.stores.retain(|s| s.id().1.contains(&case));
        suite.copies.retain(|s| s.id().contains(&case));
        suite.checksums.retain(|s| s.id().contains(&case));
        suite.matmuls.retain(|s| s.id().contains(&case));
    }
    let opts = RunOptions { warmup: 1, samples };
    // SPARSEKIT_QUICK_ROOF=1: a short roofline (for profiling the ops).
    let effort = if std::env::var_os("SPARSEKIT_QUICK_ROOF").is_some() {
        Effort::Quick
    } else {
        Effort::Full
    };
    let rep =
        run_paths(&isas, &suite, effort, opts, rounds, |n| eprintln!("{n}")).expect("bench run");
    println!("{}", rep.table());
}
