//! `sparsekit repro`, the integrity harness's main job: the agentic workload served
//! concurrently to each selected configuration of the evidence table, every session
//! compared token by token and digest by digest with the uncached one-at-a-time reference.
//!
//! 1. **References**, one per index-K dtype the selected configurations use, computed once
//!    (the same requests, one at a time, no prefix cache, no host tier, no PD) and shared
//!    by every configuration and round.
//! 2. **Sizing** from the references: the working set is every distinct full page of every
//!    session's sequences; the device pool gets about a quarter of it (at least room for
//!    the largest request), the host tier all of it — so reuse must go through the host
//!    tier, as in production.
//! 3. **Each configuration** is started by the first [`ConfigRunner`] that can serve it and
//!    kept up for all `--rounds`; per round: the sessions run concurrently (with client
//!    aborts at `--abort-rate`) while `/health` is probed; then the harness waits for the
//!    servers to go idle and reads their metrics (hits by tier, detections, leaked and
//!    quarantined pages). One row per configuration and round.
//! 4. **Speed-up**: TTFT p50 at turns ≥ 3 of each host-tier-on row against the same
//!    configuration and round with the host tier off.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sparsekit_host::{Backend, IndexKDtype, KernelAudit, KvDtype, ModelOps};

use crate::engine::ModelConfig;
use crate::engine::{Engine, EngineOptions};
use crate::error::EngineError;
use crate::harness::compare::Tally;
use crate::harness::config::{index_k_name, ConfigKey, Injection};
use crate::harness::deploy::{wait_idle, ConfigRunner, Deployment, RunPlan, Sizing};
use crate::harness::report::{CheckCount, ConfigLabel, EvidenceRow, Verdict};
use crate::harness::run::{
    probe_health, run_concurrent, run_reference, AbortingTarget, EngineTarget, Progress,
    SessionTrace, Target, TurnFailure,
};
use crate::harness::scrape::Scrape;
use crate::harness::workload::{Workload, WorkloadConfig};
use crate::metrics::Metrics;

/// Settings of a harness run.
#[derive(Clone, Debug)]
pub struct ReproOptions {
    pub workload: WorkloadConfig,
    /// Longest a request may take before it counts as wedged.
    pub deadline: Duration,
    /// Served runs against the same servers, without a restart.
    pub rounds: usize,
    /// Interval of the `/health` probe during served runs.
    pub health_every: Duration,
    /// Weight seed.
    pub seed: u64,
    pub model: ModelConfig,
    pub kv_dtype: KvDtype,
    /// The configurations to run (table order).
    pub configs: Vec<ConfigKey>,
    pub injection: Option<Injection>,
    /// The second checks; off for `--no-verify`.
    pub verify: bool,
    /// Fraction of requests the clients abort mid-flight.
    pub abort_rate: f64,
    /// Bound of every wait in the cache.
    pub cache_wait: Duration,
    /// Longest the harness waits for the servers to go idle after a round.
    pub idle_bound: Duration,
    /// Compare every session with the uncached reference run (off: `--no-reference`,
    /// only what production has — the checks — judges the row).
    pub reference: bool,
    /// The independent kernel checks (with the checks on).
    pub audit: Option<Arc<dyn KernelAudit>>,
    /// One call in this many of each DSA op is re-checked.
    pub kernel_check_every: u64,
}

impl Default for ReproOptions {
    fn default() -> Self {
        ReproOptions {
            workload: WorkloadConfig::default(),
            deadline: Duration::from_secs(300),
            rounds: 1,
            health_every: Duration::from_millis(50),
            seed: 0,
            model: ModelConfig::TINY,
            kv_dtype: KvDtype::Bf16,
            configs: ConfigKey::all(),
            injection: None,
            verify: true,
            abort_rate: 0.0,
            cache_wait: Duration::from_secs(10),
            idle_bound: Duration::from_secs(60),
            reference: true,
            audit: None,
            kernel_check_every: 8,
        }
    }
}

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

/// Traces with every reply at its longest (`x` tokens): what sizes the pools when no
/// reference runs (`--no-reference`).
pub fn placeholder_traces(w: &Workload) -> Vec<SessionTrace> {
    w.sessions
        .iter()
        .enumerate()
        .map(|(i, s)| SessionTrace {
            session: i,
            turns: s
                .turns
                .iter()
                .map(|t| crate::harness::run::TurnTrace {
                    prompt_tokens: 0,
                    tokens: vec![b'x' as u32; t.sampling.max_new_tokens],
                    digests: Vec::new(),
                    ttft: None,
                })
                .collect(),
            failure: None,
        })
        .collect()
}

/// Requests a run sends (for progress bars): reference turns plus served turns.
pub fn total_turns(opts: &ReproOptions, references: usize, configs: usize) -> u64 {
    (opts.workload.sessions * opts.workload.turns * (references + configs * opts.rounds)) as u64
}

/// The references of `dtypes`: the workload's sessions one request at a time on an
/// engine without prefix cache, host tier or PD.
pub fn reference_runs<B: Backend + ModelOps + 'static>(
    backend: Arc<B>,
    opts: &ReproOptions,
    w: &Workload,
    dtypes: &[IndexKDtype],
    progress: Progress<'_>,
) -> Result<HashMap<&'static str, Vec<SessionTrace>>, EngineError> {
    let page = opts.model.page_size();
    let budget = session_budgets(w).into_iter().max().unwrap_or(1);
    let mut out = HashMap::new();
    for &ik in dtypes {
        let e = Arc::new(Engine::start(
            backend.clone(),
            opts.model,
            EngineOptions {
                seed: opts.seed,
                kv_dtype: opts.kv_dtype,
                index_k_dtype: ik,
                kv_pages: budget.div_ceil(page).max(1),
                cache: None,
                prefill_chunk: 512,
                max_batch_tokens: 512,
                ..Default::default()
            },
            Arc::new(Metrics::new("reference")),
        )?);
        let r = run_reference(&EngineTarget(e.clone()), w, opts.deadline, progress);
        e.shutdown(Duration::from_secs(10))?;
        if let Some(s) = r.iter().find(|s| s.failure.is_some()) {
            return Err(EngineError::StepFailed(format!(
                "the {} reference failed in session {}: {:?}",
                index_k_name(ik),
                s.session,
                s.failure
            )));
        }
        out.insert(index_k_name(ik), r);
    }
    Ok(out)
}

/// Pool sizes from the workload as the reference ran it (see the module docs): the device
/// pool a quarter of the working set, but never less than the largest request (a single
/// request must fit) plus a little.
pub fn sizing(w: &Workload, references: &[&[SessionTrace]], page_size: usize) -> Sizing {
    let largest = session_budgets(w)
        .into_iter()
        .map(|b| b.div_ceil(page_size))
        .max()
        .unwrap_or(1);
    let mut working_set = 0;
    for r in references {
        let mut pages: HashSet<u64> = HashSet::new();
        for (plan, trace) in w.sessions.iter().zip(r.iter()) {
            let replies: Vec<Vec<u32>> = trace.turns.iter().map(|t| t.tokens.clone()).collect();
            for (t, turn) in trace.turns.iter().enumerate() {
                let mut seq = plan.prompt(w, t, &replies);
                seq.extend(&turn.tokens);
                let mut h: u64 = 0xcbf2_9ce4_8422_2325;
                for (i, &tok) in seq.iter().enumerate() {
                    h = (h ^ tok as u64).wrapping_mul(0x100_0000_01b3);
                    if (i + 1) % page_size == 0 {
                        pages.insert(h);
                    }
                }
            }
        }
        working_set = working_set.max(pages.len());
    }
    Sizing {
        device_pages: working_set.div_ceil(4).max(largest + 8),
        host_pages: working_set + working_set / 4 + 64,
        // Decode holds a request's pages from its bootstrap on, while prefill computes:
        // room for every session at once, so no request waits for decode pages behind
        // transfers that wait for prefill.
        decode_pages: w.sessions.len().max(1) * largest + 8,
        small_decode_pages: 2 * largest + 4,
    }
}

/// Probes `/health` of `addrs` while `f` runs; returns `f`'s result and the latencies.
fn with_health<T>(addrs: &[SocketAddr], every: Duration, f: impl FnOnce() -> T) -> (T, Vec<f64>) {
    let running = AtomicBool::new(true);
    std::thread::scope(|s| {
        let probes: Vec<_> = addrs
            .iter()
            .map(|&a| {
                let running = &running;
                s.spawn(move || probe_health(a, every, running))
            })
            .collect();
        let out = f();
        running.store(false, Ordering::Relaxed);
        let lat = probes
            .into_iter()
            .flat_map(|p| p.join().unwrap_or_default())
            .collect();
        (out, lat)
    })
}

/// Counters a row takes from the servers' metrics over a round.
fn cache_numbers(row: &mut EvidenceRow, c: &ConfigKey, before: &Scrape, after: &Scrape) {
    let d = |name: &str, labels: &[(&str, &str)]| after.delta(before, name, labels);
    let lookups = d("sparsekit_cache_lookups_total", &[]);
    if lookups > 0.0 {
        row.device_hit_rate =
            Some(d("sparsekit_cache_hits_total", &[("tier", "device")]) / lookups);
        if c.host_tier {
            row.host_hit_rate =
                Some(d("sparsekit_cache_hits_total", &[("tier", "host")]) / lookups);
        }
    }
    row.detected = Some(
        (d("sparsekit_refused_total", &[])
            + d("sparsekit_checksum_failures_total", &[])
            + d("sparsekit_integrity_detections_total", &[])
            + d("sparsekit_kernel_checks_total", &[("outcome", "mismatch")])) as u64,
    );
    // Which check counted what.
    let mut by = Vec::new();
    for (short, family, label) in [
        ("checksum", "sparsekit_checksum_failures_total", "where"),
        ("refused", "sparsekit_refused_total", "reason"),
        ("detection", "sparsekit_integrity_detections_total", "check"),
        ("frame", "sparsekit_refused_frames_total", "reason"),
        ("fallback", "sparsekit_integrity_fallbacks_total", "reason"),
    ] {
        for v in after.label_values(family, label) {
            let n = d(family, &[(label, &v)]) as u64;
            if n > 0 {
                by.push(CheckCount {
                    check: format!("{short}:{v}"),
                    count: n,
                });
            }
        }
    }
    let kernel = "sparsekit_kernel_checks_total";
    for op in after.label_values(kernel, "op") {
        let n = d(kernel, &[("op", &op), ("outcome", "mismatch")]) as u64;
        if n > 0 {
            by.push(CheckCount {
                check: format!("kernel:{op}"),
                count: n,
            });
        }
    }
    row.caught_by = by;
    row.fallbacks = Some(d("sparsekit_integrity_fallbacks_total", &[]) as u64);
    if after.get(kernel, &[]).is_some() {
        row.kernel_checks = Some(d(kernel, &[]) as u64);
        row.kernel_mismatches = Some(d(kernel, &[("outcome", "mismatch")]) as u64);
    }
    if c.pd {
        row.refused_frames = Some(d("sparsekit_refused_frames_total", &[]) as u64);
    }
}

/// Runs one configuration for every round on `dep`.
fn run_rounds(
    c: &ConfigKey,
    dep: &dyn Deployment,
    opts: &ReproOptions,
    w: &Workload,
    reference: Option<&[SessionTrace]>,
    progress: Progress<'_>,
) -> Vec<EvidenceRow> {
    let mut rows = Vec::new();
    let label = ConfigLabel::of(c);
    for round in 0..opts.rounds.max(1) {
        let before = dep.scrape().unwrap_or_default();
        let tag = format!("{}-r{round}", c.name().replace('/', "-"));
        let aborting = AbortingTarget {
            inner: dep.target().clone(),
            rate: opts.abort_rate,
            seed: opts.seed ^ (round as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        };
        let target: &dyn Target = if opts.abort_rate > 0.0 {
            &aborting
        } else {
            dep.target()
        };
        let (served, health) = with_health(&dep.health_addrs(), opts.health_every, || {
            run_concurrent(target, w, opts.deadline, &tag, progress)
        });
        let idle = wait_idle(dep, opts.idle_bound);
        let tally = match reference {
            Some(r) => Tally::of(r, &served).0,
            None => Tally::unjudged(&served),
        };
        let mut row =
            EvidenceRow::measured(&label, &tally, &served, &health, Some(idle.leaked_pages));
        if reference.is_none() {
            row.reference = false;
            row.corrupted = None;
            row.corrupted_pct = None;
        }
        row.round = (opts.rounds > 1).then_some(round + 1);
        row.quarantined_pages = Some(idle.quarantined_pages);
        row.injection = opts.injection.map(|i| i.name().to_string());
        row.verify = opts.verify;
        cache_numbers(&mut row, c, &before, &idle.scrape);
        let mut notes: Vec<String> = dep.note().into_iter().collect();
        if let Some(why) = served.iter().find_map(|t| match &t.failure {
            Some((turn, TurnFailure::Refused(why))) => Some(format!("turn {}: {why}", turn + 1)),
            _ => None,
        }) {
            notes.push(format!("first refusal: {why}"));
        }
        if !idle.idle {
            row.wedged = Some(row.wedged.unwrap_or(0) + 1);
            notes.push(format!(
                "the servers did not go idle within {:?} after the round",
                opts.idle_bound
            ));
        }
        if let Some(i) = opts.injection {
            let v = Verdict::judge(i, c, opts.verify, &row);
            row.verdict = Some(v);
            notes.push(match (v, opts.verify) {
                (Verdict::NotAffected, _) => format!("{} cannot bite this config", i.name()),
                (_, true) => format!("{} with checks on: {}", i.name(), i.caught_by()),
                (_, false) => format!("{} with --no-verify", i.name()),
            });
        }
        if !notes.is_empty() {
            row.note = Some(notes.join("; "));
        }
        rows.push(row);
    }
    rows
}

/// Fills `ttft_speedup_turn3plus` of every host-tier-on row from the host-tier-off row of
/// the same configuration and round.
pub fn fill_speedups(rows: &mut [EvidenceRow]) {
    let base: HashMap<(String, String, Option<usize>), f64> = rows
        .iter()
        .filter(|r| r.available && r.host_tier == "off")
        .filter_map(|r| {
            Some((
                (r.index_k.clone(), r.pd.clone(), r.round),
                r.ttft_turn3plus_p50_ms?,
            ))
        })
        .collect();
    for r in rows
        .iter_mut()
        .filter(|r| r.available && r.host_tier == "on")
    {
        let key = (r.index_k.clone(), r.pd.clone(), r.round);
        r.ttft_speedup_turn3plus = match (base.get(&key), r.ttft_turn3plus_p50_ms) {
            (Some(off), Some(on)) if on > 0.0 => Some(off / on),
            _ => None,
        };
    }
}

/// Runs every configuration of `opts.configs` with the first runner that can serve it,
/// against the shared `references` (by index-K dtype name); returns the rows, table
/// order, speed-ups filled.
pub fn run_configs(
    runners: &[&dyn ConfigRunner],
    opts: &ReproOptions,
    plan: &RunPlan,
    w: &Workload,
    references: &HashMap<&'static str, Vec<SessionTrace>>,
    progress: Progress<'_>,
    on_config: &dyn Fn(&ConfigKey),
) -> Vec<EvidenceRow> {
    let mut rows = Vec::new();
    for c in &opts.configs {
        let label = ConfigLabel::of(c);
        let runner = runners.iter().find(|r| r.unavailable(c).is_none());
        let Some(runner) = runner else {
            let why = runners
                .first()
                .and_then(|r| r.unavailable(c))
                .unwrap_or_else(|| "no runner".into());
            rows.push(EvidenceRow::unavailable(&label, &why));
            continue;
        };
        let reference = references.get(index_k_name(c.index_k)).map(Vec::as_slice);
        if reference.is_none() && opts.reference {
            rows.push(EvidenceRow::unavailable(
                &label,
                "no reference for its index-K dtype",
            ));
            continue;
        }
        on_config(c);
        match runner.start(c, plan) {
            Ok(dep) => {
                rows.extend(run_rounds(c, &*dep, opts, w, reference, progress));
                if let Err(e) = dep.close() {
                    if let Some(r) = rows.last_mut() {
                        let n = r.note.take().map_or(String::new(), |n| n + "; ");
                        r.note = Some(format!("{n}shutdown: {e}"));
                    }
                }
            }
            Err(e) => rows.push(EvidenceRow::unavailable(
                &label,
                &format!("failed to start: {e}"),
            )),
        }
    }
    fill_speedups(&mut rows);
    for r in &mut rows {
        r.model = opts.model.name.to_string();
    }
    rows
}

/// What [`run_repro`] measured.
#[derive(Clone, Debug)]
pub struct ReproReport {
    pub rows: Vec<EvidenceRow>,
    pub sizing: Sizing,
}

/// The whole harness in this process: references, sizing, then every configuration with
/// `runners` (the in-process runner for PD off, and whatever else is given).
pub fn run_repro<B: Backend + ModelOps + 'static>(
    backend: Arc<B>,
    opts: &ReproOptions,
    runners: &[&dyn ConfigRunner],
    progress: Progress<'_>,
    on_phase: &dyn Fn(&str),
) -> Result<ReproReport, EngineError> {
    let w = Workload::generate(&opts.workload);
    let mut dtypes: Vec<IndexKDtype> = Vec::new();
    for c in &opts.configs {
        if runners.iter().any(|r| r.unavailable(c).is_none()) && !dtypes.contains(&c.index_k) {
            dtypes.push(c.index_k);
        }
    }
    let (references, placeholders) = if opts.reference {
        on_phase("reference runs");
        (
            reference_runs(backend, opts, &w, &dtypes, progress)?,
            Vec::new(),
        )
    } else {
        (HashMap::new(), placeholder_traces(&w))
    };
    let refs: Vec<&[SessionTrace]> = if opts.reference {
        references.values().map(Vec::as_slice).collect()
    } else {
        vec![&placeholders]
    };
    let plan = RunPlan {
        model: opts.model,
        seed: opts.seed,
        kv_dtype: opts.kv_dtype,
        sizing: sizing(&w, &refs, opts.model.page_size()),
        max_running: opts.workload.sessions,
        injection: opts.injection,
        verify: opts.verify,
        cache_wait: opts.cache_wait,
        deadline: opts.deadline,
        audit: opts.audit.clone(),
        kernel_check_every: opts.kernel_check_every,
    };
    let done = std::cell::Cell::new(0usize);
    let n = opts.configs.len();
    let rows = run_configs(runners, opts, &plan, &w, &references, progress, &|c| {
        done.set(done.get() + 1);
        on_phase(&format!("config {}/{n}: {}", done.get(), c.name()))
    });
    Ok(ReproReport {
        rows,
        sizing: plan.sizing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(host: &str, round: Option<usize>, t3: Option<f64>) -> EvidenceRow {
        let mut r = EvidenceRow::unavailable(&ConfigLabel::new("x", "fp8", host, "off"), "");
        r.available = true;
        r.round = round;
        r.ttft_turn3plus_p50_ms = t3;
        r
    }

    #[test]
    fn speedups_pair_rows_of_the_same_config_and_round() {
        let mut rows = vec![
            row("off", Some(1), Some(300.0)),
            row("on", Some(1), Some(100.0)),
            row("off", Some(2), Some(200.0)),
            row("on", Some(2), Some(50.0)),
            row("on", Some(3), Some(50.0)),
        ];
        fill_speedups(&mut rows);
        let s: Vec<Option<f64>> = rows.iter().map(|r| r.ttft_speedup_turn3plus).collect();
        assert_eq!(s, [None, Some(3.0), None, Some(4.0), None]);
    }

    #[test]
    fn sizing_quarters_the_working_set() {
        let w = Workload::generate(&WorkloadConfig {
            sessions: 6,
            turns: 2,
            ..Default::default()
        });
        let fake: Vec<SessionTrace> = (0..6)
            .map(|s| SessionTrace {
                session: s,
                turns: (0..2)
                    .map(|_| crate::harness::run::TurnTrace {
                        prompt_tokens: 0,
                        tokens: vec![65; 20],
                        digests: vec![0; 20],
                        ttft: None,
                    })
                    .collect(),
                failure: None,
            })
            .collect();
        let s = sizing(&w, &[&fake], 16);
        // Shared system prompt and contexts count once: the working set is far below the
        // sum of the sessions' pages.
        let total: usize = session_budgets(&w).iter().map(|b| b.div_ceil(16)).sum();
        assert!(s.host_pages < total, "{s:?} vs {total}");
        assert!(s.device_pages * 4 >= s.host_pages - 64 - s.host_pages / 5);
    }
}
