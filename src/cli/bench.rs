//! `sparsekit bench`: every op a backend implements, timed at DeepSeek-V3.2 sizes and read
//! against the roofline (this CPU's measured copy bandwidth and FMA peak for `cpu`/`emu`;
//! the backend's own device copy rate for `cuda`). Progress while it runs, a table (or
//! `--json`) at the end.

use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use sparsekit::host::ModelOps;
use sparsekit_benches::report::{Machine, Report};
use sparsekit_benches::roofline::{self, Effort};
use sparsekit_benches::runner::{self, RunOptions};
use sparsekit_benches::{Scale, Suite};

use super::{on_backend, CliError, OnBackend};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Backend to time: cpu, emu, emu-sm120a or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Small shapes and few samples (a smoke run, numbers indicative only).
    #[arg(long)]
    quick: bool,
    /// Timed calls per case.
    #[arg(long, default_value_t = 10)]
    samples: usize,
    /// Only these ops (indexer_logits, topk, sparse_mla, index_k_store, kv_store,
    /// copy_pages, page_checksums, dense_matmul); the copy ceiling is measured whatever the filter.
    #[arg(long, value_delimiter = ',')]
    op: Vec<String>,
    /// The cpu backend on these vector paths side by side in one run (`all`, or a list of
    /// amx, avx512bf16, avx512, avx2, scalar): each case is built once and timed on every path
    /// in alternation, each path read against its own roofline; `--samples` calls per
    /// path and round.
    #[arg(long, value_delimiter = ',')]
    isa: Vec<String>,
    /// Rounds of alternation between the paths of `--isa`.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    if !args.isa.is_empty() {
        return paths(&args);
    }
    struct Bench<'a>(&'a Args);
    impl OnBackend for Bench<'_> {
        type Output = ExitCode;
        fn run<B: ModelOps>(self, b: &B) -> Result<ExitCode, CliError> {
            bench(b, self.0)
        }
    }
    on_backend(&args.backend, Bench(&args))
}

fn bench<B: ModelOps>(backend: &B, args: &Args) -> Result<ExitCode, CliError> {
    let scale = if args.quick {
        Scale::Smoke
    } else {
        Scale::Full
    };
    let full = Suite::new(scale)?;
    let suite = only_ops(full.clone(), &args.op)?;
    let spinner = ProgressBar::new_spinner();
    spinner.set_style(
        ProgressStyle::with_template("{spinner} {elapsed} {msg}").map_err(|e| e.to_string())?,
    );
    spinner.enable_steady_tick(std::time::Duration::from_millis(200));
    spinner.set_message("measuring the roofline");
    let effort = if args.quick {
        Effort::Quick
    } else {
        Effort::Full
    };
    let roof = if backend.name() == "cuda" {
        runner::backend_copy_roofline(backend, &full)?
    } else {
        roofline::measure(effort)
    };
    let opts = RunOptions {
        warmup: if args.quick { 1 } else { 2 },
        samples: args.samples.max(1),
    };
    let out = runner::run(backend, &suite, opts, |name| {
        spinner.set_message(name.to_string())
    })?;
    spinner.finish_and_clear();
    let report = Report {
        date: sparsekit_benches::report::utc_date(),
        machine: Machine::detect(),
        roofline: roof,
        roofline_runs: vec![roof],
        results: out.rows(&roof),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("backend {}", backend.name());
        println!("{}", report.table());
    }
    Ok(ExitCode::SUCCESS)
}

/// `--isa`: the cpu backend's vector paths side by side.
fn paths(args: &Args) -> Result<ExitCode, CliError> {
    use sparsekit::host::cpu::{CpuIsa, Isa};
    if args.backend != "cpu" {
        return Err("--isa compares the cpu backend's vector paths: use --backend cpu".into());
    }
    let isas: Vec<CpuIsa> = if args.isa.iter().any(|i| i == "all") {
        CpuIsa::available()
    } else {
        args.isa
            .iter()
            .map(|name| {
                let isa = Isa::parse(name).ok_or_else(|| {
                    format!(
                        "unknown vector path {name:?} (amx, avx512bf16, avx512, avx2, scalar, all)"
                    )
                })?;
                CpuIsa::new(isa).map_err(|e| CliError::from(format!("{name}: {e}")))
            })
            .collect::<Result<_, CliError>>()?
    };
    let (scale, effort) = if args.quick {
        (Scale::Smoke, Effort::Quick)
    } else {
        (Scale::Full, Effort::Full)
    };
    let suite = only_ops(Suite::new(scale)?, &args.op)?;
    let spinner = ProgressBar::new_spinner();
    spinner.set_style(
        ProgressStyle::with_template("{spinner} {elapsed} {msg}").map_err(|e| e.to_string())?,
    );
    spinner.enable_steady_tick(std::time::Duration::from_millis(200));
    spinner.set_message("measuring the rooflines");
    let opts = RunOptions {
        warmup: if args.quick { 1 } else { 2 },
        samples: args.samples.max(1),
    };
    let report =
        sparsekit_benches::paths::run_paths(&isas, &suite, effort, opts, args.rounds, |name| {
            spinner.set_message(name.to_string())
        })?;
    spinner.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("backend cpu, vector paths side by side");
        println!("{}", report.table());
    }
    Ok(ExitCode::SUCCESS)
}

/// `suite` reduced to the named ops (all of it when `ops` is empty).
fn only_ops(mut suite: Suite, ops: &[String]) -> Result<Suite, CliError> {
    if let Some(bad) = ops.iter().find(|o| !Suite::OPS.contains(&o.as_str())) {
        return Err(format!("unknown op {bad:?} (known: {})", Suite::OPS.join(", ")).into());
    }
    let ops: Vec<&str> = ops.iter().map(String::as_str).collect();
    suite.retain_ops(&ops);
    Ok(suite)
}
