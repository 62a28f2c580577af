//! The validation suite at quick sizes on the CPU backend, one test per op so failures
//! are reported per op; fresh seed every run (printed on failure).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use sparsekit_host::ops::Op;
use sparsekit_host::CpuBackend;
use sparsekit_validation::{run, Size, Status, SuiteConfig};

fn suite(op: Op) {
    let seed: u64 = std::env::var("SPARSEKIT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let cfg = SuiteConfig {
        size: Size::Quick,
        seed,
        ops: vec![op],
    };
    let records = run(&CpuBackend::new(), &cfg, |_| {});
    assert!(!records.is_empty());
    let mut failed = Vec::new();
    for r in &records {
        assert!(r.batch >= 4, "batch >= 4 everywhere: {r:?}");
        if r.status != Status::Pass {
            failed.push(format!(
                "{} {} [{}] {}: {:?} {}",
                r.op, r.config, r.dtype, r.quantity, r.status, r.detail
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "seed {seed} (rerun with SPARSEKIT_SEED={seed}):\n{}",
        failed.join("\n")
    );
}

#[test]
fn index_k_store() {
    suite(Op::IndexKStore)
}

#[test]
fn kv_store() {
    suite(Op::KvStore)
}

#[test]
fn indexer_logits() {
    suite(Op::IndexerLogits)
}

#[test]
fn topk() {
    suite(Op::Topk)
}

#[test]
fn sparse_mla() {
    suite(Op::SparseMla)
}

#[test]
fn copy_pages() {
    suite(Op::CopyPages)
}

#[test]
fn page_checksums() {
    suite(Op::PageChecksums)
}
