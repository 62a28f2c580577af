//! `sparsekit validate`: the validation suite on a backend, with progress and a table.

use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use sparsekit::host::ops::Op;
use sparsekit::host::Backend;
use sparsekit::table::Table;
use sparsekit::validation::{plan, run_case, Record, Size, Status, SuiteConfig};

use super::{on_backend, CliError, OnBackend};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Backend to validate: cpu, emu, emu-sm120a (the emulator as sm_120a: the block-scaled
    /// MXFP8 paths) or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Print JSON records instead of a table.
    #[arg(long)]
    json: bool,
    /// Seed (random when omitted; printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// Run the quick sizes (as `cargo test` does) instead of the full ones.
    #[arg(long)]
    quick: bool,
    /// Only these ops (index_k_store, kv_store, indexer_logits, topk, sparse_mla,
    /// copy_pages, page_checksums).
    #[arg(long, value_delimiter = ',')]
    op: Vec<String>,
    /// Only the checks whose config name contains this text (e.g. `tiny`, `h_q=16`):
    /// small runs for tools that slow every launch down (compute-sanitizer).
    #[arg(long)]
    config: Option<String>,
}

fn parse_ops(names: &[String]) -> Result<Vec<Op>, CliError> {
    names
        .iter()
        .map(|n| {
            Op::ALL
                .into_iter()
                .find(|o| o.name() == n)
                .ok_or_else(|| format!("unknown op {n:?}").into())
        })
        .collect()
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    let cfg = SuiteConfig {
        size: if args.quick { Size::Quick } else { Size::Full },
        seed: args.seed.unwrap_or_else(rand::random),
        ops: parse_ops(&args.op)?,
    };
    struct Suite<'a>(&'a SuiteConfig, bool, Option<&'a str>);
    impl OnBackend for Suite<'_> {
        type Output = ExitCode;
        fn run<B: Backend>(self, b: &B) -> Result<ExitCode, CliError> {
            suite(b, self.0, self.1, self.2)
        }
    }
    on_backend(
        &args.backend,
        Suite(&cfg, args.json, args.config.as_deref()),
    )
}

fn suite<B: Backend>(
    backend: &B,
    cfg: &SuiteConfig,
    json: bool,
    config: Option<&str>,
) -> Result<ExitCode, CliError> {
    let cases: Vec<_> = plan(cfg)
        .into_iter()
        .filter(|c| config.is_none_or(|want| c.config.contains(want)))
        .collect();
    if cases.is_empty() {
        return Err(format!(
            "no check matches --op {:?} --config {:?}",
            cfg.ops.iter().map(|o| o.name()).collect::<Vec<_>>(),
            config.unwrap_or("")
        )
        .into());
    }
    let bar = ProgressBar::new(cases.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
            .map_err(|e| e.to_string())?,
    );
    let mut records: Vec<Record> = Vec::new();
    for case in &cases {
        bar.set_message(format!(
            "{} {} [{}]",
            case.op.name(),
            case.config,
            case.dtype
        ));
        records.extend(run_case(backend, case, cfg.seed));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let failed = records
        .iter()
        .filter(|r| matches!(r.status, Status::Fail | Status::Error))
        .count();
    if json {
        println!("{}", serde_json::to_string_pretty(&records)?);
    } else {
        let mut t = Table::new([
            "op",
            "check",
            "config",
            "dtype",
            "qty",
            "batch",
            "max_abs_err",
            "max_rel_err",
            "err/tol",
            "tolerance",
            "status",
            "ms",
        ]);
        for r in &records {
            t.row([
                r.op.to_string(),
                format!("{:?}", r.check).to_lowercase(),
                r.config.clone(),
                r.dtype.to_string(),
                r.quantity.to_string(),
                r.batch.to_string(),
                format!("{:.2e}", r.max_abs_err),
                format!("{:.2e}", r.max_rel_err),
                format!("{:.3}", r.worst_ratio),
                r.tolerance.clone(),
                format!("{:?}", r.status).to_lowercase(),
                r.millis.to_string(),
            ]);
        }
        print!("{}", t.render());
        for r in records.iter().filter(|r| r.status != Status::Pass) {
            println!("{} {} [{}]: {}", r.op, r.config, r.dtype, r.detail);
        }
        let pass = records.iter().filter(|r| r.status == Status::Pass).count();
        println!(
            "backend {}: {pass} passed, {failed} failed; seed {}",
            backend.name(),
            cfg.seed
        );
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
