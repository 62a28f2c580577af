//! The harness end to end at a small scale: the agentic workload served concurrently
//! through the HTTP server (continuous batching, small prefill chunks) matches the
//! one-at-a-time reference bit for bit; and a KV space with an injected fault (index keys
//! of some tokens never stored: the indexer reads what the page held before) is reported
//! as corrupted sessions with their first diverging turn and step.

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

/// A reference space whose layer-0 store drops the index key of every row whose slot is
/// ≡ 5 (mod 7): those keys stay zero, as if their copy never landed, and the indexer
/// scores them anyway.
struct DropsIndexKeys(PagedKvSpace<CpuBackend>);

struct DroppingLayer<'a, L> {
    inner: L,
    drop_rows: bool,
    _space: std::marker::PhantomData<&'a ()>,
}

impl<L: LayerCache<CpuBackend>> LayerCache<CpuBackend> for DroppingLayer<'_, L> {
    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }
    fn index_k_layout(&self) -> IndexKLayout {
        self.inner.index_k_layout()
    }
    fn store(
        &mut self,
        b: &CpuBackend,
        slots: &[i64],
        kv: &<CpuBackend as Backend>::Buffer,
        index_k: &<CpuBackend as Backend>::Buffer,
    ) -> Result<(), EngineError> {
        if !self.drop_rows {
            return self.inner.store(b, slots, kv, index_k);
        }
        // Store KV for every row, index keys only for the rows that are kept (the others
        // are redirected to slot -1, which stores skip).
        let kept: Vec<i64> = slots
            .iter()
            .map(|&s| if s % 7 == 5 { -1 } else { s })
            .collect();
        let everything_kv = slots.to_vec();
        self.inner
            .store(b, &everything_kv, kv, &b.alloc(b.buffer_len(index_k))?)?;
        self.inner.store(b, &kept, kv, index_k)
    }
    fn kv(&self) -> &<CpuBackend as Backend>::Buffer {
        self.inner.kv()
    }
    fn index_k(&self) -> &<CpuBackend as Backend>::Buffer {
        self.inner.index_k()
    }
}

impl KvSpace<CpuBackend> for DropsIndexKeys {
    type Layer<'a> =
        DroppingLayer<'a, <PagedKvSpace<CpuBackend> as KvSpace<CpuBackend>>::Layer<'a>>;
    fn kv_layout(&self) -> KvLayout {
        self.0.kv_layout()
    }
    fn index_k_layout(&self) -> IndexKLayout {
        self.0.index_k_layout()
    }
    fn num_layers(&self) -> usize {
        self.0.num_layers()
    }
    fn capacity_pages(&self) -> usize {
        self.0.capacity_pages()
    }
    fn free_pages(&self) -> usize {
        self.0.free_pages()
    }
    fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<(), EngineError> {
        self.0.reserve(seq, tokens)
    }
    fn pages(&self, seq: SeqId) -> Result<&[i32], EngineError> {
        self.0.pages(seq)
    }
    fn release(&mut self, seq: SeqId) -> usize {
        self.0.release(seq)
    }
    fn layer(&mut self, l: usize) -> Result<Self::Layer<'_>, EngineError> {
        Ok(DroppingLayer {
            inner: self.0.layer(l)?,
            drop_rows: l == 0,
            _space: std::marker::PhantomData,
        })
    }
    fn leak_check(&self) -> Result<(), EngineError> {
        self.0.leak_check()
    }
}

#[test]
fn an_injected_cache_fault_is_reported_as_corruption() {
    let w = workload();
    let reference = reference();
    let backend = Arc::new(CpuBackend::new());
    let model = Model::new(backend.clone(), ModelConfig::TINY, 0).unwrap();
    let o = opts();
    let space = PagedKvSpace::new(
        &*backend,
        model.kv_layout(o.kv_dtype).unwrap(),
        model.index_k_layout(o.index_k_dtype).unwrap(),
        ModelConfig::TINY.n_layers,
        o.kv_pages,
    )
    .unwrap();
    let faulty = Arc::new(
        Engine::start_with(
            model,
            DropsIndexKeys(space),
            o,
            Arc::new(Metrics::new("both")),
        )
        .unwrap(),
    );
    let served = run_concurrent(&EngineTarget(faulty), &w, DEADLINE, &|| {});
    let (tally, verdicts) = Tally::of(reference, &served);
    assert_eq!(tally.corrupted, 3, "{verdicts:?}");
    for v in &verdicts {
        // The prompt is computed wrongly from its first positions on, so the very first
        // logits already differ.
        assert!(
            matches!(
                v,
                Verdict::Corrupted {
                    turn: 0,
                    step: 0,
                    ..
                }
            ),
            "{v:?}"
        );
    }
}
