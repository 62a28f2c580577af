//! `sparsekit repro`: the integrity harness. Today it runs the `no-cache` configuration
//! (concurrent agentic sessions through the HTTP server vs the one-at-a-time reference,
//! per index-K dtype) and lists the eight evidence configurations as unavailable until
//! the cache-backed engine and PD transfer land; options that need them are refused.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use sparsekit::host::model_ops::ModelOps;
use sparsekit::host::{Backend, CpuBackend, EmuBackend, IndexKDtype};
use sparsekit_server::engine::ModelConfig;
use sparsekit_server::harness::report::{render_table, EvidenceRow};
use sparsekit_server::harness::repro::{
    evidence_configs, run_no_cache, total_turns, ReproOptions, UNAVAILABLE,
};
use sparsekit_server::harness::WorkloadConfig;

use super::{CliError, BACKENDS};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Concurrent agentic sessions (16 by default: about 3 minutes on 2 cores for both
    /// index-K dtypes; the reference recomputes every prompt, ~1 M tokens for 80 × 4).
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Served runs against the same server without a restart.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Index-K dtypes to run: fp8, bf16 (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "fp8,bf16")]
    index_k: Vec<String>,
    /// Backend: cpu, emu or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Model config.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Workload and weight seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds a request may take before it counts as wedged.
    #[arg(long, default_value_t = 300)]
    deadline_s: u64,
    /// Print the rows as JSON.
    #[arg(long)]
    json: bool,
    /// Evidence configurations to run (needs the cache-backed engine; refused for now).
    #[arg(long, value_delimiter = ',')]
    configs: Vec<String>,
    /// Fault injection (needs the cache and PD layers; refused for now).
    #[arg(long)]
    inject: Option<String>,
    /// Turn the integrity checks off (needs the cache and PD layers; refused for now).
    #[arg(long)]
    no_verify: bool,
    /// Fraction of requests aborted mid-flight (not available yet).
    #[arg(long)]
    abort_rate: Option<f64>,
    /// PD transport (not available yet).
    #[arg(long)]
    transport: Option<String>,
    /// Run against servers already running (not available yet).
    #[arg(long)]
    url: Option<String>,
}

fn not_yet(what: &str) -> CliError {
    format!("{what} is not available in this build: {UNAVAILABLE}").into()
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    if !args.configs.is_empty() {
        return Err(not_yet("--configs"));
    }
    if let Some(i) = &args.inject {
        return Err(not_yet(&format!("--inject {i}")));
    }
    if args.no_verify {
        return Err(not_yet("--no-verify"));
    }
    if args.abort_rate.is_some() {
        return Err(not_yet("--abort-rate"));
    }
    if let Some(t) = &args.transport {
        return Err(not_yet(&format!("--transport {t}")));
    }
    if args.url.is_some() {
        return Err(not_yet("--url"));
    }
    if args.sessions == 0 || args.turns == 0 || args.rounds == 0 {
        return Err("--sessions, --turns and --rounds must be positive".into());
    }
    let dtypes = args
        .index_k
        .iter()
        .map(|d| match d.as_str() {
            "fp8" => Ok(IndexKDtype::FP8),
            "bf16" => Ok(IndexKDtype::Bf16),
            other => Err(format!("--index-k takes fp8 and bf16, not {other:?}")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let cfg = ModelConfig::by_name(&args.model)?;
    let opts = ReproOptions {
        workload: WorkloadConfig {
            sessions: args.sessions,
            turns: args.turns,
            seed: args.seed,
            ..Default::default()
        },
        deadline: Duration::from_secs(args.deadline_s),
        rounds: args.rounds,
        seed: args.seed,
        ..Default::default()
    };
    let rows = match args.backend.as_str() {
        "cpu" => run_all(Arc::new(CpuBackend::new()), cfg, &dtypes, &opts, args.json)?,
        "emu" => run_all(Arc::new(EmuBackend::new()), cfg, &dtypes, &opts, args.json)?,
        "cuda" => {
            let b = sparsekit::cuda::CudaBackend::new(0)
                .map_err(|e| format!("cuda backend unavailable: {e}"))?;
            run_all(Arc::new(b), cfg, &dtypes, &opts, args.json)?
        }
        other => return Err(format!("unknown backend {other:?} (available: {BACKENDS})").into()),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", render_table(&rows));
        for r in rows.iter().filter(|r| !r.first_divergences.is_empty()) {
            println!(
                "{}: first divergences (session, turn, step): {:?}",
                r.config, r.first_divergences
            );
        }
    }
    let bad = rows.iter().any(|r| {
        r.available
            && (r.corrupted.unwrap_or(0) > 0
                || r.wedged.unwrap_or(0) > 0
                || r.refused.unwrap_or(0) > 0
                || r.leaked_pages.unwrap_or(0) > 0)
    });
    Ok(if bad {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn run_all<B: Backend + ModelOps + 'static>(
    backend: Arc<B>,
    cfg: ModelConfig,
    dtypes: &[IndexKDtype],
    opts: &ReproOptions,
    quiet: bool,
) -> Result<Vec<EvidenceRow>, CliError> {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total_turns(opts) * dtypes.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} turns {elapsed} (eta {eta}) {msg}")
            .map_err(|e| e.to_string())?,
    );
    let mut rows = Vec::new();
    for &ik in dtypes {
        bar.set_message(format!("no-cache, index-K {}", ik.name()));
        rows.extend(run_no_cache(backend.clone(), cfg, ik, opts, &|| {
            bar.inc(1)
        })?);
    }
    bar.finish_and_clear();
    for c in evidence_configs() {
        rows.push(EvidenceRow::unavailable(&c, UNAVAILABLE));
    }
    Ok(rows)
}
