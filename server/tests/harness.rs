//! The harness end to end at a small scale: the agentic workload served concurrently
//! through the HTTP server (continuous batching, small prefill chunks) matches the
//! one-at-a-time reference bit for bit.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use sparsekit_host::{Backend, CpuBackend, IndexKLayout, KvLayout};
use sparsekit_server::engine::{
    Engine, EngineOptions, KvSpace, LayerCache, Model, ModelConfig, PagedKvSpace, SeqId,
};
use sparsekit_server::harness::report::{ConfigLabel, EvidenceRow};
use sparsekit_server::harness::{
    run_concurrent, run_reference, EngineTarget, HttpTarget, Tally, Verdict, Workload,
    WorkloadConfig,
};
use sparsekit_server::metrics::Metrics;
use sparsekit_server::EngineError;

const DEADLINE: Duration = Duration::from_secs(120);

fn workload() -> Workload {
    Workload::generate(&WorkloadConfig {
        sessions: 3,
        turns: 2,
        contexts: 2,
        max_jitter_ms: 5,
        seed: 11,
    })
}

/// The reference run, computed once for both tests.
fn reference() -> &'static [sparsekit_server::harness::SessionTrace] {
    static REF: std::sync::OnceLock<Vec<sparsekit_server::harness::SessionTrace>> =
        std::sync::OnceLock::new();
    REF.get_or_init(|| run_reference(&EngineTarget(start(opts())), &workload(), DEADLINE, &|| {}))
}

fn opts() -> EngineOptions {
    EngineOptions {
        kv_pages: 2048,
        ..Default::default()
    }
}

fn start(o: EngineOptions) -> Arc<Engine> {
    Arc::new(
        Engine::start(
            Arc::new(CpuBackend::new()),
            ModelConfig::TINY,
            o,
            Arc::new(Metrics::new("both")),
        )
        .unwrap(),
    )
}

#[test]
fn served_sessions_match_the_reference() {
    let w = workload();
    let reference = reference();
    assert!(reference
        .iter()
        .all(|s| s.failure.is_none() && s.turns.len() == 2));
    let served_engine = start(EngineOptions {
        prefill_chunk: 100,
        max_batch_tokens: 160,
        min_prefill_tokens: 16,
        ..opts()
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt
        .block_on(sparsekit_server::http::spawn(
            served_engine.clone(),
            "127.0.0.1:0".parse().unwrap(),
            Default::default(),
        ))
        .unwrap();
    let target = HttpTarget { addr: server.addr };
    let running = AtomicBool::new(true);
    let (served, health) = std::thread::scope(|s| {
        let probe = s.spawn(|| {
            sparsekit_server::harness::run::probe_health(
                server.addr,
                Duration::from_millis(20),
                &running,
            )
        });
        let served = run_concurrent(&target, &w, DEADLINE, &|| {});
        running.store(false, std::sync::atomic::Ordering::Relaxed);
        (served, probe.join().unwrap())
    });
    let (tally, verdicts) = Tally::of(reference, &served);
    assert!(
        verdicts.iter().all(|v| *v == Verdict::Clean),
        "{verdicts:?}"
    );
    assert_eq!((tally.sessions, tally.clean), (3, 3));
    assert!(
        served_engine.stats().max_step_seqs >= 2,
        "sessions were never batched together"
    );
    let st = served_engine.stats();
    let row = EvidenceRow::measured(
        &ConfigLabel::new("no-cache", "fp8_e4m3", "off", "off"),
        &tally,
        &served,
        &health,
        Some(st.capacity_pages - st.free_pages),
    );
    assert_eq!(row.corrupted, Some(0));
    assert_eq!(row.leaked_pages, Some(0));
    assert!(row.ttft_p99_ms.is_some() && row.health_p99_ms.is_some());
    assert_eq!(row.ttft_by_turn_ms.len(), 2);
    rt.block_on(server.shutdown(Duration::from_secs(5)))
        .unwrap();
}
