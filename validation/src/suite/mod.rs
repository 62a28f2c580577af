//! The validation suite: every op checked against its f64 reference on random ragged
//! batches (batch ≥ 4), both dtypes of each cache, DeepSeek-V3.2 and tiny dims, outputs
//! poisoned first; plus batch-invariance checks. One body per check, generic over
//! [`Backend`], so every backend runs the same suite.

mod indexer_logits;
mod invariance;
mod pages;
mod plan;
mod record;
mod sparse_mla;
mod sparse_mla_v4;
mod store;
mod topk;

use std::time::Instant;

use serde::Serialize;
use sparsekit_host::ops::Op;
use sparsekit_host::{Backend, Error};

use plan::Kind;
pub use plan::{plan, Case};
pub(crate) use record::Outcome;
pub use record::{Check, Record, Status};
pub use sparse_mla_v4::{SinkKind, V4CacheShape, V4Shape};

use crate::fixtures::case_rng;

/// How big the cases are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Size {
    /// `cargo test`: every feature of the full suite (64K+ contexts included, at tiny dims),
    /// smaller where the f64 reference would be slow.
    Quick,
    /// `sparsekit validate`: DeepSeek-V3.2 dims at 64K+ contexts and all head counts.
    Full,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct SuiteConfig {
    pub size: Size,
    pub seed: u64,
    /// Restrict to these ops (all when empty).
    pub ops: Vec<Op>,
}

/// Runs every planned check on `backend`, calling `progress` after each record.
pub fn run<B: Backend>(
    backend: &B,
    cfg: &SuiteConfig,
    mut progress: impl FnMut(&Record),
) -> Vec<Record> {
    let mut out = Vec::new();
    for case in plan(cfg) {
        for rec in run_case(backend, &case, cfg.seed) {
            progress(&rec);
            out.push(rec);
        }
    }
    out
}

/// Runs one check and returns its record(s).
pub fn run_case<B: Backend>(backend: &B, case: &Case, seed: u64) -> Vec<Record> {
    let start = Instant::now();
    let rng = &mut case_rng(seed, case.id);
    let b = backend;
    let one = |o: Outcome| vec![o];
    let result: Result<Vec<Outcome>, Error> = match &case.kind {
        Kind::IndexKStore(d, dt) => store::index_k_store(b, rng, d, *dt).map(one),
        Kind::KvStore(d, dt) => store::kv_store(b, rng, d, *dt).map(one),
        Kind::KvStoreV4(dt, ps) => store::kv_store_v4(b, rng, *dt, *ps).map(one),
        Kind::IndexerLogits(d, dt, form, lens) => {
            indexer_logits::indexer_logits(b, rng, d, *dt, form, lens).map(one)
        }
        Kind::Topk(k, ps, sc, lens, short) => {
            topk::topk(b, rng, *k, *ps, *sc, lens, *short).map(one)
        }
        Kind::SparseMla(d, dt, h, lens) => sparse_mla::sparse_mla(b, rng, d, *dt, *h, lens),
        Kind::SparseMlaCancel(d, dt) => sparse_mla::cancellation(b, rng, d, *dt),
        Kind::SparseMlaV4(s) => sparse_mla_v4::sparse_mla_v4(b, rng, s),
        Kind::CopyPages(l, page_first) => pages::copy_pages(b, rng, *l, *page_first).map(one),
        Kind::PageChecksums(l) => pages::page_checksums(b, rng, *l).map(one),
        Kind::Invariance(d, op) => invariance::check(b, rng, d, *op).map(one),
    };
    let millis = start.elapsed().as_millis() as u64;
    record::records(case, backend.name(), seed, millis, result)
}
