//! `sparsekit repro`: the integrity harness. Concurrent multi-turn agentic sessions served
//! to each configuration of the evidence table ({fp8, bf16} index keys × host tier × PD),
//! every token and logits digest compared with the uncached one-at-a-time reference; the
//! table, or `--json`. The PD-on rows run through a prefill/decode pair in this process
//! (local transport) or, with `--transport nixl`, two `serve` processes of this binary
//! joined by NIXL over loopback. Exit status 1 when a row shows a problem or a
//! configuration failed to start (or, with `--inject`, when an injection was not caught
//! with the checks on / did not corrupt with them off).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use sparsekit::host::model_ops::ModelOps;
use sparsekit::host::{Backend, CpuBackend, EmuBackend, KernelAudit, KvDtype};
use sparsekit::validation::audit::ReferenceAudit;
use sparsekit_server::engine::ModelConfig;
use sparsekit_server::harness::config::{select, Injection};
use sparsekit_server::harness::deploy::{
    parse_url, remote_info, ConfigRunner, LocalRunner, RunPlan, Sizing, UrlRunner,
};
use sparsekit_server::harness::process::ProcessRunner;
use sparsekit_server::harness::report::{
    render_table, EvidenceRow, RunReport, REPORT_SCHEMA_VERSION,
};
use sparsekit_server::harness::repro::{
    reference_runs, run_configs, run_repro, total_turns, ReproOptions,
};
use sparsekit_server::harness::{Workload, WorkloadConfig};
use sparsekit_server::transfer::{nixl_runtime_dir, NIXL_LIB_ENV};

use super::{CliError, BACKENDS};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Concurrent agentic sessions.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Served runs against the same servers without a restart (one row per round).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Configurations to run: `/`-separated parts (fp8, bf16, host-on, host-off, pd-on,
    /// pd-off, decode-small), comma-separated filters, e.g.
    /// `bf16/host-on,fp8/host-off/pd-off`. All nine by default.
    #[arg(long, value_delimiter = ',')]
    configs: Vec<String>,
    /// Fault injection: host-pool-fp8-layout, shared-item-size, skip-index-wait,
    /// no-generation-check, index-k-after-publish, radix-overreach, kernel-wrong-slot,
    /// host-tier-skips-index-k, reload-kv-only, compressor-state-lost and
    /// pool-page-size-mismatch (V4 models) (pd-fp8-frame, pd-read-before-landed,
    /// stale-transfer-write need PD; model1-scales-as-interleaved needs PD, a V4 model
    /// and --kv fp8_ds_mla).
    #[arg(long)]
    inject: Option<String>,
    /// Turn the integrity checks off (load checksums, landed stamps, written slots,
    /// kernel checks): with an injection, the historical corruption must show.
    #[arg(long)]
    no_verify: bool,
    /// Do not compare sessions with the uncached reference run: only the servers' own
    /// checks judge each row, as in production (an injection must still be caught).
    #[arg(long)]
    no_reference: bool,
    /// Re-check one call in N of each DSA kernel against the f64 references while
    /// serving (0: no kernel checks).
    #[arg(long, default_value_t = 8)]
    kernel_check_every: u64,
    /// Fraction of requests the clients abort mid-flight (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    abort_rate: f64,
    /// PD transport for the PD-on rows: local (a pair in this process) or nixl (a prefill
    /// and a decode `serve` process of this binary over loopback; needs the NIXL runtime
    /// from scripts/setup-nixl.sh).
    #[arg(long, default_value = "local")]
    transport: String,
    /// Run against servers already running (`sparsekit serve`), comma-separated
    /// `http://host:port`; one row per server, its config read from `/server_info`.
    #[arg(long, value_delimiter = ',')]
    url: Vec<String>,
    /// Backend: cpu, emu or cuda (the reference runs here; with --url it must be the
    /// servers' backend).
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Model configs, comma-separated: tiny, dsv32, dsv4-tiny, dsv4. By default
    /// DeepSeek-V3.2's (`tiny`) and DeepSeek-V4's (`dsv4-tiny`) rows; with several models
    /// every row is named `MODEL/config`. With --url: the servers' model.
    #[arg(long, value_delimiter = ',', default_value = "tiny,dsv4-tiny")]
    model: Vec<String>,
    /// KV dtype: bf16 or fp8_ds_mla.
    #[arg(long, default_value = "bf16")]
    kv: String,
    /// Workload and weight seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds a request may take before it counts as wedged.
    #[arg(long, default_value_t = 300)]
    deadline_s: u64,
    /// Print the run as JSON (the schema of docs/repro.md, `schema_version` 3).
    #[arg(long)]
    json: bool,
    /// Also write the run as a page to DIR: index.html (the tables, TTFT by turn and
    /// what the checks caught as pictures), the pictures as SVG, report.json.
    #[arg(long, value_name = "DIR")]
    report: Option<std::path::PathBuf>,
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    if args.sessions == 0 || args.turns == 0 || args.rounds == 0 {
        return Err("--sessions, --turns and --rounds must be positive".into());
    }
    if !(0.0..=1.0).contains(&args.abort_rate) {
        return Err(format!("--abort-rate must be in [0, 1], got {}", args.abort_rate).into());
    }
    let nixl = match args.transport.as_str() {
        "local" => false,
        "nixl" => true,
        t => return Err(format!("unknown transport {t:?} (local, nixl)").into()),
    };
    if nixl && args.inject.as_deref() == Some("stale-transfer-write") {
        return Err(
            "--inject stale-transfer-write needs both PD sides in one process (its \
                    decoy transfer is synchronised in process): use --transport local"
                .into(),
        );
    }
    if nixl && !args.url.is_empty() {
        return Err(
            "--transport nixl starts its own servers; with --url the servers are \
                    already running (start them with `serve --transport nixl`)"
                .into(),
        );
    }
    if args.no_reference && args.no_verify {
        return Err(
            "--no-reference with --no-verify judges nothing: without the reference only the \
             checks can see an injection, and --no-verify turns them off"
                .into(),
        );
    }
    if args.no_reference && !args.url.is_empty() {
        return Err("--no-reference applies to servers this command starts, not --url".into());
    }
    let injection: Option<Injection> = args.inject.as_deref().map(str::parse).transpose()?;
    let mut models = args
        .model
        .iter()
        .map(|m| ModelConfig::by_name(m))
        .collect::<Result<Vec<_>, _>>()?;
    if models.is_empty() {
        return Err("--model names no model".into());
    }
    if !args.url.is_empty() {
        // The running servers' model (checked against each other below).
        models.truncate(1);
    }
    if let Some(i) = injection.filter(|i| i.needs_v4()) {
        models.retain(|m| m.v4.is_some());
        if models.is_empty() {
            return Err(format!(
                "--inject {} needs a DeepSeek-V4 model (its compressor state): --model \
                 dsv4-tiny",
                i.name()
            )
            .into());
        }
    }
    let kv_dtype = match args.kv.as_str() {
        "bf16" => KvDtype::Bf16,
        "fp8_ds_mla" => KvDtype::Fp8DsMla,
        v => return Err(format!("--kv must be bf16 or fp8_ds_mla, got {v:?}").into()),
    };
    if let Some(i) = injection.filter(|i| i.needs_fp8_kv() && kv_dtype != KvDtype::Fp8DsMla) {
        return Err(format!(
            "--inject {} needs fp8 KV pages (a V4 model stores them as model1_fp8): --kv \
             fp8_ds_mla",
            i.name()
        )
        .into());
    }
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
        model: models[0],
        kv_dtype,
        configs: select(&args.configs)?,
        injection,
        verify: !args.no_verify,
        abort_rate: args.abort_rate,
        reference: !args.no_reference,
        audit: (args.kernel_check_every > 0)
            .then(|| Arc::new(ReferenceAudit) as Arc<dyn KernelAudit>),
        kernel_check_every: args.kernel_check_every,
        ..Default::default()
    };
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut sizings = Vec::new();
    for m in &models {
        let opts = ReproOptions {
            model: *m,
            ..opts.clone()
        };
        let (mut got, sizing) = match args.backend.as_str() {
            "cpu" => run_on(Arc::new(CpuBackend::from_env()?), &args, opts)?,
            "emu" => run_on(Arc::new(EmuBackend::new()), &args, opts)?,
            "cuda" => {
                let b = sparsekit::cuda::CudaBackend::new(0)
                    .map_err(|e| format!("cuda backend unavailable: {e}"))?;
                run_on(Arc::new(b), &args, opts)?
            }
            other => {
                return Err(format!("unknown backend {other:?} (available: {BACKENDS})").into())
            }
        };
        if models.len() > 1 {
            for r in &mut got {
                r.config = format!("{}/{}", m.name, r.config);
            }
        }
        rows.extend(got);
        sizings.extend(sizing.map(|s| (m.name, s)));
    }
    let sizing = sizings.first().map(|(_, s)| *s);
    let wall = started.elapsed();
    let run = RunReport {
        schema_version: REPORT_SCHEMA_VERSION,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        wall_seconds: wall.as_secs_f64(),
        sessions: args.sessions,
        turns: args.turns,
        rounds: args.rounds,
        backend: args.backend.clone(),
        model: models.iter().map(|m| m.name).collect::<Vec<_>>().join(","),
        sizing,
        reference: !args.no_reference,
        injection: args.inject.clone(),
        verify: !args.no_verify,
        rows: rows.clone(),
    };
    if let Some(dir) = &args.report {
        super::repro_report::write(dir, &run)?;
        if !args.json {
            println!("report: {}", dir.join("index.html").display());
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&run)?);
    } else {
        print!("{}", render_table(&rows));
        for (name, s) in &sizings {
            println!(
                "{name}: device pool {} pages, host tier {} pages (working set ≈ {} pages)",
                s.device_pages,
                s.host_pages,
                s.host_pages.saturating_sub(64) * 4 / 5
            );
        }
        println!(
            "{} sessions × {} turns, {} round(s): {:.1} s",
            args.sessions,
            args.turns,
            args.rounds,
            wall.as_secs_f64()
        );
    }
    // Without --url every selected configuration is served here: an unavailable row is
    // one that failed to start.
    let failed_start = args.url.is_empty() && rows.iter().any(|r| !r.available);
    let bad = failed_start
        || rows
            .iter()
            .filter(|r| r.available)
            .any(|r| match r.verdict {
                Some(v) => !v.is_expected(r),
                None => !(r.is_clean() || args.abort_rate > 0.0 && clean_but_aborts(r)),
            });
    Ok(if bad {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// Aborted sessions are no problem; anything else is.
fn clean_but_aborts(r: &EvidenceRow) -> bool {
    r.corrupted.unwrap_or(0) == 0
        && r.refused.unwrap_or(0) == 0
        && r.detected.unwrap_or(0) == 0
        && r.wedged.unwrap_or(0) == 0
        && r.leaked_pages.unwrap_or(0) == 0
}

fn progress_bar(total: u64, quiet: bool) -> Result<ProgressBar, CliError> {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} turns {elapsed} (eta {eta}) {msg}")
            .map_err(|e| e.to_string())?,
    );
    Ok(bar)
}

fn run_on<B: Backend + ModelOps + 'static>(
    backend: Arc<B>,
    args: &Args,
    opts: ReproOptions,
) -> Result<(Vec<EvidenceRow>, Option<Sizing>), CliError> {
    if !args.url.is_empty() {
        return run_urls(backend, args, opts).map(|r| (r, None));
    }
    let local = LocalRunner {
        backend: backend.clone(),
    };
    // PD-on rows: an in-process prefill/decode pair (local transport), or with
    // `--transport nixl` two server processes joined by NIXL.
    let process = match args.transport.as_str() {
        "nixl" => Some(process_runner(backend.name())?),
        _ => None,
    };
    let mut runners: Vec<&dyn ConfigRunner> = Vec::new();
    if let Some(p) = &process {
        runners.push(p);
    }
    runners.push(&local);
    let refs = {
        let mut d = Vec::new();
        for c in &opts.configs {
            if !d.contains(&c.index_k) {
                d.push(c.index_k);
            }
        }
        d.len()
    };
    let runnable = opts.configs.len();
    let bar = progress_bar(total_turns(&opts, refs, runnable), args.json)?;
    let report = run_repro(backend, &opts, &runners, &|| bar.inc(1), &|phase| {
        bar.set_message(phase.to_string())
    })?;
    bar.finish_and_clear();
    Ok((report.rows, Some(report.sizing)))
}

/// `--transport nixl`: PD-on rows served by `sparsekit serve` processes (this binary),
/// told where the NIXL runtime is.
fn process_runner(backend: &str) -> Result<ProcessRunner, CliError> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let lib = nixl_runtime_dir(Some(&exe)).ok_or_else(|| {
        format!(
            "--transport nixl: the NIXL runtime (libnixl_capi.so) was not found: run \
             `bash scripts/setup-nixl.sh` (installs it under .tools/nixl) or set {NIXL_LIB_ENV}"
        )
    })?;
    let log_dir = std::env::temp_dir().join(format!("sparsekit-repro-{}", std::process::id()));
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| format!("cannot create {}: {e}", log_dir.display()))?;
    Ok(ProcessRunner {
        exe,
        env: vec![(NIXL_LIB_ENV.into(), lib.to_string_lossy().into_owned())],
        backend: backend.to_string(),
        log_dir,
    })
}

/// `--url`: the rows of running servers against references computed here.
fn run_urls<B: Backend + ModelOps + 'static>(
    backend: Arc<B>,
    args: &Args,
    mut opts: ReproOptions,
) -> Result<Vec<EvidenceRow>, CliError> {
    let servers = args
        .url
        .iter()
        .map(|u| parse_url(u).and_then(remote_info))
        .collect::<Result<Vec<_>, _>>()?;
    let first = &servers[0];
    for s in &servers {
        if s.backend != backend.name() {
            return Err(format!(
                "{} serves on the {} backend; the reference must run on the same backend \
                 (--backend {})",
                s.addr, s.backend, s.backend
            )
            .into());
        }
        if (s.model, s.seed, s.kv_dtype) != (first.model, first.seed, first.kv_dtype) {
            return Err(format!(
                "{} serves another model, seed or KV dtype than {}: one reference cannot cover both",
                s.addr, first.addr
            )
            .into());
        }
        if let Some(i) = opts.injection {
            let missing: Vec<_> = i
                .cache_faults()
                .into_iter()
                .filter(|f| !s.faults.iter().any(|x| x == f.name()))
                .collect();
            if !missing.is_empty() {
                return Err(format!(
                    "{} was not started with --inject {} (missing faults {missing:?})",
                    s.addr,
                    i.name()
                )
                .into());
            }
        }
        if s.verify == opts.verify {
            continue;
        }
        return Err(format!(
            "{} runs with verification {}, the harness was told {}",
            s.addr,
            if s.verify { "on" } else { "off" },
            if opts.verify {
                "on"
            } else {
                "off (--no-verify)"
            }
        )
        .into());
    }
    opts.model = first.model;
    opts.seed = first.seed;
    opts.kv_dtype = first.kv_dtype;
    let wanted = select(&args.configs)?;
    opts.configs = servers
        .iter()
        .map(|s| s.key)
        .filter(|k| wanted.contains(k))
        .collect();
    let mut dtypes = Vec::new();
    for c in &opts.configs {
        if !dtypes.contains(&c.index_k) {
            dtypes.push(c.index_k);
        }
    }
    let bar = progress_bar(
        total_turns(&opts, dtypes.len(), opts.configs.len()),
        args.json,
    )?;
    bar.set_message("reference runs");
    let w = Workload::generate(&opts.workload);
    let references = reference_runs(backend, &opts, &w, &dtypes, &|| bar.inc(1))?;
    let runner = UrlRunner { servers };
    let plan = RunPlan {
        model: opts.model,
        seed: opts.seed,
        kv_dtype: opts.kv_dtype,
        sizing: Sizing {
            device_pages: 0,
            host_pages: 0,
            decode_pages: 0,
            small_decode_pages: 0,
        },
        max_running: opts.workload.sessions,
        injection: opts.injection,
        verify: opts.verify,
        cache_wait: opts.cache_wait,
        deadline: opts.deadline,
        audit: None,
        kernel_check_every: opts.kernel_check_every,
    };
    let rows = run_configs(
        &[&runner],
        &opts,
        &plan,
        &w,
        &references,
        &|| bar.inc(1),
        &|c| bar.set_message(c.name()),
    );
    bar.finish_and_clear();
    Ok(rows)
}
