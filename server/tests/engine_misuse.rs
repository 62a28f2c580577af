//! The engine's public API used wrongly on purpose (found by a hostile-caller review):
//! "received" pages that no transfer received are refused, not read as the prompt's KV.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use crate::common;

use std::sync::Arc;

use common::{cached_engine, opts, run};
use sparsekit_host::cache::CacheConfig;
use sparsekit_host::CpuBackend;
use sparsekit_server::engine::{GenerateRequest, ModelConfig, ReceivedPages, SamplingParams};

/// `GenerateRequest::received` is plain data: pages the cache request allocated but
/// never received through an inbound transfer are refused at adoption.
#[test]
fn received_pages_that_no_transfer_received_are_refused() {
    let cfg = ModelConfig::TINY;
    let (e, h) = cached_engine(
        Arc::new(CpuBackend::new()),
        cfg,
        opts(64),
        CacheConfig::new(64, 0),
    );
    let c = h.cache();
    let ps = cfg.page_size();
    let rid = h.next_request_id();
    c.begin(rid, &[]).unwrap();
    let pages = c.alloc(rid, 2).unwrap();
    let prompt: Vec<u32> = (0..(2 * ps + 1) as u32).map(|t| 3 + t % 200).collect();
    let req = GenerateRequest {
        id: Some("never-landed".into()),
        prompt,
        sampling: SamplingParams {
            max_new_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        },
        received: Some(ReceivedPages {
            cache_request: rid,
            pages,
            extra: Vec::new(),
            tokens: 2 * ps,
        }),
    };
    let r = run(&e, &req);
    assert!(
        r.as_ref()
            .is_err_and(|e| e.to_string().contains("cannot adopt")),
        "a request was served from 'received' pages nothing was ever written to: {:?}",
        r.map(|c| c.tokens)
    );
}
