//! What `sparsekit repro` can run before the cache-backed engine and PD exist: the
//! `no-cache` configuration — the agentic workload served concurrently through the HTTP
//! server (continuous batching, chunked prefill, the reference KV space) against the
//! one-at-a-time reference — per index-K dtype. The eight evidence configurations
//! ({fp8, bf16} × host tier × PD) are listed as unavailable rows until their pieces land.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sparsekit_host::{Backend, IndexKDtype, ModelOps};

use crate::engine::scheduler::{Engine, EngineOptions};
use crate::engine::ModelConfig;
use crate::error::EngineError;
use crate::harness::compare::Tally;
use crate::harness::report::{ConfigLabel, EvidenceRow};
use crate::harness::run::{
    probe_health, run_concurrent, run_reference, EngineTarget, HttpTarget, Progress,
};
use crate::harness::workload::{Workload, WorkloadConfig};
use crate::metrics::Metrics;

/// Settings of a harness run.
#[derive(Clone, Debug)]
pub struct ReproOptions {
    pub workload: WorkloadConfig,
    /// Longest a request may take before it counts as wedged.
    pub deadline: Duration,
    /// Served runs against the same server, without a restart.
    pub rounds: usize,
    /// Interval of the `/health` probe during served runs.
    pub health_every: Duration,
    /// Weight seed.
    pub seed: u64,
}

impl Default for ReproOptions {
    fn default() -> Self {
        ReproOptions {
            workload: WorkloadConfig::default(),
            deadline: Duration::from_secs(300),
            rounds: 1,
            health_every: Duration::from_millis(50),
            seed: 0,
        }
    }
}

/// The eight configurations of the evidence table, by name.
pub fn evidence_configs() -> Vec<ConfigLabel> {
    let mut v = Vec::new();
    for ik in ["fp8", "bf16"] {
        for host in ["off", "on"] {
            for pd in ["off", "on"] {
                v.push(ConfigLabel::new(
                    &format!("{ik}/host-{host}/pd-{pd}"),
                    ik,
                    host,
                    pd,
                ));
            }
        }
    }
    v
}

/// Why the evidence configurations cannot run yet.
pub const UNAVAILABLE: &str =
    "needs the cache-backed engine (radix prefix reuse, host tier) and PD transfer";

/// Longest prompt + reply (tokens) of each session, replies at their maximum length.
pub fn session_budgets(w: &Workload) -> Vec<usize> {
    w.sessions
        .iter()
        .map(|s| {
            let replies: Vec<Vec<u32>> = s
                .turns
                .iter()
                .map(|t| vec![b'x' as u32; t.sampling.max_new_tokens])
                .collect();
            let last = s.turns.len().saturating_sub(1);
            s.prompt(w, last, &replies).len() + s.turns[last].sampling.max_new_tokens
        })
        .collect()
}

/// Requests a run sends (for progress bars): reference turns plus served turns.
pub fn total_turns(opts: &ReproOptions) -> u64 {
    (opts.workload.sessions * opts.workload.turns * (1 + opts.rounds)) as u64
}

/// Runs the `no-cache` configuration for one index-K dtype: the reference, then
/// `opts.rounds` served runs against one in-process HTTP server; one row per round.
pub fn run_no_cache<B: Backend + ModelOps + 'static>(
    backend: Arc<B>,
    cfg: ModelConfig,
    index_k: IndexKDtype,
    opts: &ReproOptions,
    progress: Progress<'_>,
) -> Result<Vec<EvidenceRow>, EngineError> {
    let w = Workload::generate(&opts.workload);
    let budgets = session_budgets(&w);
    let page = cfg.page_size();
    let pages = |tokens: usize| tokens.div_ceil(page);
    let base = EngineOptions {
        seed: opts.seed,
        index_k_dtype: index_k,
        ..Default::default()
    };
    let reference = {
        let e = Arc::new(Engine::start(
            backend.clone(),
            cfg,
            EngineOptions {
                kv_pages: pages(budgets.iter().copied().max().unwrap_or(1)).max(1),
                ..base.clone()
            },
            Arc::new(Metrics::new("reference")),
        )?);
        let r = run_reference(&EngineTarget(e.clone()), &w, opts.deadline, progress);
        e.shutdown(Duration::from_secs(10))?;
        r
    };
    if let Some(s) = reference.iter().find(|s| s.failure.is_some()) {
        return Err(EngineError::StepFailed(format!(
            "the reference run failed in session {}: {:?}",
            s.session, s.failure
        )));
    }
    let served_pages: usize = budgets.iter().map(|&b| pages(b)).sum();
    let engine = Arc::new(Engine::start(
        backend,
        cfg,
        EngineOptions {
            kv_pages: served_pages.max(1),
            max_running: opts.workload.sessions.max(1),
            ..base
        },
        Arc::new(Metrics::new("both")),
    )?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| EngineError::Unavailable(format!("tokio runtime: {e}")))?;
    let server = rt
        .block_on(crate::http::spawn(
            engine.clone(),
            ([127, 0, 0, 1], 0).into(),
            Default::default(),
        ))
        .map_err(|e| EngineError::Unavailable(format!("cannot bind the server: {e}")))?;
    let target = HttpTarget { addr: server.addr };
    let ik = match index_k {
        IndexKDtype::Bf16 => "bf16",
        IndexKDtype::Fp8E4m3 { .. } => "fp8",
    };
    let mut rows = Vec::new();
    for round in 0..opts.rounds.max(1) {
        let running = AtomicBool::new(true);
        let (served, health) = std::thread::scope(|s| {
            let probe = s.spawn(|| probe_health(server.addr, opts.health_every, &running));
            let served = run_concurrent(&target, &w, opts.deadline, progress);
            running.store(false, Ordering::Relaxed);
            (served, probe.join().unwrap_or_default())
        });
        let (tally, _) = Tally::of(&reference, &served);
        let st = engine.stats();
        let name = if opts.rounds > 1 {
            format!("{ik}/no-cache/round-{}", round + 1)
        } else {
            format!("{ik}/no-cache")
        };
        let mut row = EvidenceRow::measured(
            &ConfigLabel::new(&name, ik, "off", "off"),
            &tally,
            &served,
            &health,
            Some(st.capacity_pages - st.free_pages),
        );
        row.note =
            Some("no prefix cache: continuous batching + chunked prefill vs the reference".into());
        rows.push(row);
    }
    rt.block_on(server.shutdown(Duration::from_secs(10)))?;
    Ok(rows)
}
