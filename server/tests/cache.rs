//! The engine over the cache-backed KV space (`CacheKvSpace` over `HiCache`):
//!
//! - the determinism oracle across tiers: a session's second turn gives bit-identical
//!   tokens and logits digests whether its prefix came from the device tier, the host
//!   tier (layer-wise load) or was recomputed, on `cpu` and on `emu`;
//! - layer `l` computes while layer `l + 1` is still loading (a gate holds the load of
//!   layer 1; layer 0's attention runs meanwhile);
//! - a failed or corrupted load fails its request alone and cleanly (nothing unloaded is
//!   served), the other requests of its steps go on bit-identically, and a retry is
//!   served right; a stuck load ends in typed timeouts within the bound, never a wedge;
//! - pages received from elsewhere (`ReceivedPages`: the PD decode side's hook) continue
//!   bit-identically;
//! - aborts from other threads leave no page behind.
//!
//! Every wait is bounded; gates and counters order the threads, never sleeps.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{assert_idle_and_clean, cached_engine, opts, run, Gated, BOUND};
use rand::{Rng, SeedableRng};
use sparsekit_host::cache::{BufferKind, CacheConfig, Fault, Faults, PageRef};
use sparsekit_host::ops::PageChecksums;
use sparsekit_host::{Backend, CpuBackend, EmuBackend, Error as HostError, ModelOps};
use sparsekit_server::engine::{
    Completion, Engine, EngineOptions, GenerateRequest, ModelConfig, ReceivedPages, SamplingParams,
};
use sparsekit_server::metrics::Metrics;
use sparsekit_server::EngineError;

fn seed() -> u64 {
    let s = std::env::var("SPARSEKIT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("seed {s} (replay with SPARSEKIT_SEED={s})");
    s
}

/// A two-turn session: a shared head, then a user part; turn 2 = turn 1's prompt, its
/// reply and a new message.
struct Session {
    first: GenerateRequest,
    more: Vec<u32>,
    sampling2: SamplingParams,
}

impl Session {
    fn new(rng: &mut impl Rng, head: &[u32], len: usize, new: usize, tag: &str) -> Self {
        let mut prompt = head.to_vec();
        while prompt.len() < len {
            prompt.push(rng.gen_range(0..256));
        }
        let sampling = |s: u64, t: f32| SamplingParams {
            max_new_tokens: new,
            temperature: t,
            seed: s,
            ignore_eos: true,
            ..Default::default()
        };
        Session {
            first: GenerateRequest {
                id: Some(format!("{tag}-1")),
                received: None,
                prompt,
                sampling: sampling(rng.gen(), 0.0),
            },
            more: (0..len / 3).map(|_| rng.gen_range(0..256)).collect(),
            sampling2: sampling(rng.gen(), 0.8),
        }
    }

    fn second(&self, reply: &Completion) -> GenerateRequest {
        let mut prompt = self.first.prompt.clone();
        prompt.extend(&reply.tokens);
        prompt.extend(&self.more);
        GenerateRequest {
            id: self.first.id.as_ref().map(|i| i.replace("-1", "-2")),
            received: None,
            prompt,
            sampling: self.sampling2.clone(),
        }
    }
}

fn same(a: &Completion, b: &Completion, what: &str) {
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    assert_eq!(a.digests, b.digests, "{what}: logits digests");
}

fn plain<B: Backend + ModelOps + 'static>(
    b: Arc<B>,
    cfg: ModelConfig,
    o: &EngineOptions,
) -> Engine {
    Engine::start(b, cfg, o.clone(), Arc::new(Metrics::new("both"))).unwrap()
}

/// Turn 2 of `s` served with its prefix from each tier, against recompute.
fn oracle_across_tiers<B: Backend + ModelOps + 'static>(
    backend: impl Fn() -> B,
    cfg: ModelConfig,
    s: &Session,
) {
    let o = opts(64);
    let reference = plain(Arc::new(backend()), cfg, &o);
    let r1 = run(&reference, &s.first).unwrap();
    let turn2 = s.second(&r1);
    let r2 = run(&reference, &turn2).unwrap();
    let full_pages = (turn2.prompt.len() - 1) / cfg.page_size();

    // Device tier: the first turn's pages are still on the device.
    let (e, h) = cached_engine(Arc::new(backend()), cfg, o.clone(), CacheConfig::new(64, 0));
    same(&run(&e, &s.first).unwrap(), &r1, "device tier, turn 1");
    same(&run(&e, &turn2).unwrap(), &r2, "device tier, turn 2");
    let st = h.cache().stats();
    assert!(st.hits_device_pages as usize >= s.first.prompt.len() / cfg.page_size() - 1);
    assert_eq!((st.hits_host_pages, st.loads), (0, 0));
    assert_idle_and_clean(&e);

    // Host tier: everything evicted to the host between the turns, loaded back layer by
    // layer (checksums verified).
    let mut config = CacheConfig::new(64, 64);
    config.write_through = true;
    let (e, h) = cached_engine(Arc::new(backend()), cfg, o.clone(), config);
    same(&run(&e, &s.first).unwrap(), &r1, "host tier, turn 1");
    h.cache().wait_idle().unwrap();
    assert!(h.cache().evict_device(usize::MAX).unwrap() > 0);
    assert_eq!(h.cache().stats().device_cached, 0);
    same(&run(&e, &turn2).unwrap(), &r2, "host tier, turn 2");
    let st = h.cache().stats();
    assert!(st.hits_host_pages > 0 && st.loads >= 1, "{st:?}");
    assert_eq!(st.integrity_failures, 0);
    assert_idle_and_clean(&e);

    // No host tier: evicted pages are gone, turn 2 recomputes in the cache space.
    let (e, h) = cached_engine(Arc::new(backend()), cfg, o.clone(), CacheConfig::new(64, 0));
    same(&run(&e, &s.first).unwrap(), &r1, "recompute, turn 1");
    h.cache().evict_device(usize::MAX).unwrap();
    let before = h.cache().stats();
    same(&run(&e, &turn2).unwrap(), &r2, "recompute, turn 2");
    let st = h.cache().stats();
    assert_eq!(
        (st.hits_device_pages, st.hits_host_pages),
        (before.hits_device_pages, 0),
        "nothing was reused"
    );
    assert!(full_pages > 4, "the prefix spans pages");
    assert_idle_and_clean(&e);
}

#[test]
fn the_oracle_holds_across_tiers_on_cpu() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let head: Vec<u32> = (0..70).map(|_| rng.gen_range(0..256)).collect();
    let s = Session::new(&mut rng, &head, 150, 12, "cpu");
    oracle_across_tiers(CpuBackend::new, ModelConfig::TINY, &s);
}

/// DeepSeek-V4's pools (window, CSA and HCA compressed KV, compressed index keys, the
/// compressor's state rows) through the device tier, the host tier and recompute: a
/// prefix reused from any tier resumes every compression window exactly.
#[test]
fn the_v4_oracle_holds_across_tiers_on_cpu() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let head: Vec<u32> = (0..70).map(|_| rng.gen_range(0..256)).collect();
    let s = Session::new(&mut rng, &head, 150, 12, "v4");
    oracle_across_tiers(CpuBackend::new, ModelConfig::DSV4_TINY, &s);
}

/// A V4 decode longer than the window pool's frames: the pages its tokens left give their
/// window rows back as it goes, every token's logits are those of the reference engine,
/// and the next turn's hit still reaches the last full page it committed.
#[test]
fn a_v4_decode_longer_than_its_window_frames_gives_rows_back() {
    let cfg = ModelConfig::DSV4_TINY;
    let ps = cfg.page_size();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let s = Session::new(&mut rng, &[], 40, 120, "v4-window");
    let o = opts(64);
    let reference = plain(Arc::new(CpuBackend::new()), cfg, &o);
    let r1 = run(&reference, &s.first).unwrap();
    let turn2 = s.second(&r1);
    let r2 = run(&reference, &turn2).unwrap();
    let total = s.first.prompt.len() + r1.tokens.len();
    // Fewer frames than the first turn's pages: it runs only by giving rows back.
    let frames = 7;
    assert!(total.div_ceil(ps) > frames);
    let mut config = CacheConfig::new(64, 0);
    config.window_pages = Some(frames);
    let (e, h) = cached_engine(Arc::new(CpuBackend::new()), cfg, o, config);
    same(&run(&e, &s.first).unwrap(), &r1, "turn 1");
    let st = h.cache().stats();
    assert_eq!(st.window_frames, frames);
    assert!(st.window_released >= 5, "{st:?}");
    let before = st.hits_device_pages;
    same(&run(&e, &turn2).unwrap(), &r2, "turn 2");
    let st = h.cache().stats();
    assert!(
        (st.hits_device_pages - before) as usize >= (total - 1) / ps,
        "turn 2 starts on turn 1's last full page: {st:?}"
    );
    assert_idle_and_clean(&e);
}

#[test]
fn the_oracle_holds_across_tiers_on_emu() {
    // Small enough for the emulator: one layer, a top-k of 8 so selection matters.
    let cfg = ModelConfig::TINY
        .with_index_topk(8)
        .unwrap()
        .with_layers(1)
        .unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let head: Vec<u32> = (0..20).map(|_| rng.gen_range(0..256)).collect();
    let s = Session::new(&mut rng, &head, 90, 3, "emu");
    oracle_across_tiers(EmuBackend::new, cfg, &s);
}

/// A cache engine on a gated backend whose session `s` has turn 1 served and every page
/// moved to the host tier; returns the engine, handle, gate and the reference turns.
#[allow(clippy::type_complexity)]
fn host_only_session(
    s: &Session,
    config: CacheConfig,
) -> (
    Engine,
    sparsekit_server::engine::CacheHandle<Gated<CpuBackend>>,
    Arc<common::GateCtl>,
    GenerateRequest,
    Completion,
) {
    let cfg = ModelConfig::TINY;
    let o = opts(64);
    let reference = plain(Arc::new(CpuBackend::new()), cfg, &o);
    let r1 = run(&reference, &s.first).unwrap();
    let turn2 = s.second(&r1);
    let r2 = run(&reference, &turn2).unwrap();
    let (b, ctl) = Gated::new(CpuBackend::new());
    let (e, h) = cached_engine(Arc::new(b), cfg, o, config);
    same(&run(&e, &s.first).unwrap(), &r1, "turn 1");
    h.cache().wait_idle().unwrap();
    h.cache().evict_device(usize::MAX).unwrap();
    (e, h, ctl, turn2, r2)
}

#[test]
fn layer_l_computes_while_layer_l_plus_1_loads() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let s = Session::new(&mut rng, &[], 150, 6, "overlap");
    let (e, h, ctl, turn2, r2) = host_only_session(&s, CacheConfig::new(64, 64));
    // Hold the load's layer-1 KV copy at the gate.
    *ctl.hold_src.lock().unwrap() = h.cache().host_region(1, BufferKind::Kv);
    ctl.close();
    let before = ctl.attention_calls.load(Ordering::SeqCst);
    let loads = h.cache().stats().loads;
    let handle = e.submit(turn2).unwrap();
    ctl.wait_for("the layer-1 load held at the gate", |c| {
        c.held.load(Ordering::SeqCst) == 1
    });
    // Layer 0 of the request's first step computes meanwhile (its attention reads the
    // loaded layer 0), and no further layer can.
    ctl.wait_for("layer 0 computed while layer 1 is loading", |c| {
        c.attention_calls.load(Ordering::SeqCst) > before
    });
    assert_eq!(ctl.held.load(Ordering::SeqCst), 1, "layer 1 still held");
    assert_eq!(
        ctl.attention_calls.load(Ordering::SeqCst),
        before + 1,
        "exactly layer 0 ran; layer 1 waits for its ready token"
    );
    assert_eq!(h.cache().stats().loads, loads, "the load has not finished");
    ctl.open();
    let c = handle.wait(BOUND).unwrap();
    same(&c, &r2, "overlapped load");
    let log = ctl.attention_log.lock().unwrap().clone();
    assert!(
        log[before as usize..].first() == Some(&false),
        "layer 0's attention ran with the gate closed"
    );
    assert_idle_and_clean(&e);
}

#[test]
fn a_failed_load_fails_its_request_alone_and_a_retry_is_served() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let s = Session::new(&mut rng, &[], 150, 6, "fail");
    let other = Session::new(&mut rng, &[], 120, 10, "other");
    let (e, h, ctl, turn2, r2) = host_only_session(&s, CacheConfig::new(64, 64));
    let r_other = {
        let reference = plain(Arc::new(CpuBackend::new()), ModelConfig::TINY, &opts(64));
        run(&reference, &other.first).unwrap()
    };
    // The load's layer-1 index-K copy fails; another request shares its steps.
    *ctl.fail_src.lock().unwrap() = h.cache().host_region(1, BufferKind::IndexK);
    ctl.fail_count.store(1, Ordering::SeqCst);
    let a = e.submit(turn2.clone()).unwrap();
    let b = e.submit(other.first.clone()).unwrap();
    match a.wait(BOUND) {
        Err(EngineError::SeqFailed { cause, .. }) => {
            assert!(matches!(cause, HostError::Device(_)), "{cause:?}")
        }
        other => panic!("the failed load must fail its request: {other:?}"),
    }
    same(&b.wait(BOUND).unwrap(), &r_other, "the other request");
    assert_eq!(e.stats().failed_steps, 0, "no whole step failed");
    assert_eq!(e.stats().failed_seqs, 1);
    // The host copy is intact (a copy failure is not corruption): the retry loads it.
    let loads = h.cache().stats().loads;
    same(&run(&e, &turn2).unwrap(), &r2, "retry");
    assert_eq!(h.cache().stats().loads, loads + 1);
    assert_idle_and_clean(&e);
}

/// A corrupted host copy is never served: the load's checksums refuse it, the copies are
/// dropped from the cache, and the request recomputes its prefix — served, with the
/// bits of an uncached run, and counted as an integrity fallback.
#[test]
fn a_corrupted_host_copy_is_refused_and_the_request_recomputes() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let s = Session::new(&mut rng, &[], 150, 6, "flip");
    let mut config = CacheConfig::new(64, 64);
    config.faults = Faults::with(&[Fault::HostBitFlip]);
    let (e, h, _ctl, turn2, r2) = host_only_session(&s, config);
    same(&run(&e, &turn2).unwrap(), &r2, "served by recomputing");
    let st = h.cache().stats();
    assert_eq!(st.host_integrity_failures, 1);
    assert_eq!(e.stats().integrity_fallbacks, 1);
    assert_eq!(e.stats().failed_seqs, 0);
    assert_idle_and_clean(&e);
    let text = e.metrics().encode();
    assert!(
        text.contains("sparsekit_checksum_failures_total{where=\"host_load\"} 1"),
        "{text}"
    );
    assert!(text.contains("sparsekit_refused_total{reason=\"load_failed\"} 1"));
    assert!(
        text.contains("sparsekit_integrity_fallbacks_total{reason=\"checksum\"} 1"),
        "{text}"
    );
    // The corrupted copies were dropped: the next turn recomputes and is right too.
    same(&run(&e, &turn2).unwrap(), &r2, "again");
    assert_eq!(e.stats().integrity_fallbacks, 1);
    assert_idle_and_clean(&e);
}

#[test]
fn a_load_past_the_wait_bound_fails_its_request_and_the_engine_goes_on() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let s = Session::new(&mut rng, &[], 150, 6, "slow");
    let other = Session::new(&mut rng, &[], 60, 4, "quick");
    let mut config = CacheConfig::new(64, 64);
    config.wait_timeout = std::time::Duration::from_millis(300);
    let (e, h, ctl, turn2, _r2) = host_only_session(&s, config);
    *ctl.hold_src.lock().unwrap() = h.cache().host_region(0, BufferKind::Kv);
    ctl.close();
    // The load times out; recomputing the prefix instead needs layer 0, which the stuck
    // copy holds: a typed timeout within the bounds either way.
    match run(&e, &turn2) {
        Err(EngineError::SeqFailed { cause, .. }) | Err(EngineError::Backend(cause)) => {
            assert!(matches!(cause, HostError::Timeout { .. }), "{cause:?}")
        }
        other => panic!("{other:?}"),
    }
    // The stuck copy holds layer 0 (a copy writes it): the engine's other requests get a
    // typed timeout within the bound too, never a wedge; /health stays up.
    assert_eq!(ctl.held.load(Ordering::SeqCst), 1);
    match run(&e, &other.first) {
        Err(EngineError::Backend(HostError::Timeout { .. })) => {}
        other => panic!("{other:?}"),
    }
    assert!(e.is_healthy());
    ctl.open();
    h.cache().wait_idle().unwrap();
    // Once the copy ends, everything is served again.
    run(&e, &other.first).unwrap();
    assert_idle_and_clean(&e);
}

/// A load past the wait bound says nothing against the cached bytes: the request falls
/// back on its own, the prefix stays cached (other requests on it are not failed), and once
/// the copy ends the next turn is served from it.
#[test]
fn a_load_timeout_keeps_the_prefix_cached() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let s = Session::new(&mut rng, &[], 150, 6, "slow");
    let mut config = CacheConfig::new(64, 64);
    config.wait_timeout = std::time::Duration::from_millis(300);
    let (e, h, ctl, turn2, r2) = host_only_session(&s, config);
    *ctl.hold_src.lock().unwrap() = h.cache().host_region(1, BufferKind::Kv);
    ctl.close();
    assert!(
        run(&e, &turn2).is_err(),
        "the held load times the request out"
    );
    ctl.open();
    h.cache().wait_idle().unwrap();
    assert_eq!(
        h.cache().stats().discarded_pages,
        0,
        "a timeout drops nothing"
    );
    let hits = h.cache().stats();
    same(
        &run(&e, &turn2).unwrap(),
        &r2,
        "served from the kept prefix",
    );
    let after = h.cache().stats();
    assert!(
        after.hits_device_pages + after.hits_host_pages
            > hits.hits_device_pages + hits.hits_host_pages,
        "the prefix was reused: {hits:?} -> {after:?}"
    );
    assert_idle_and_clean(&e);
}

/// The PD decode side's hook: pages received through `HiCache::inbound` (here copied out
/// of another engine's cache, layer by layer with checksums, as a transport would) are
/// adopted by a request, which continues bit-identically to the reference.
#[test]
fn received_pages_continue_bit_identically() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let s = Session::new(&mut rng, &[], 150, 8, "pd");
    let cfg = ModelConfig::TINY;
    let o = opts(64);
    let reference = plain(Arc::new(CpuBackend::new()), cfg, &o);
    let want = run(&reference, &s.first).unwrap();
    // "Prefill": computes the prompt and keeps its full pages in its tree.
    let (pre, ph) = cached_engine(
        Arc::new(CpuBackend::new()),
        cfg,
        o.clone(),
        CacheConfig::new(64, 0),
    );
    let mut probe = s.first.clone();
    probe.sampling.max_new_tokens = 1;
    run(&pre, &probe).unwrap();
    let src = ph.cache();
    let id = ph.next_request_id();
    let prefix = src.begin(id, &s.first.prompt).unwrap();
    assert!(prefix.tokens > 0 && prefix.tokens < s.first.prompt.len());
    // "Decode": pages for the prompt's full pages, filled by an inbound transfer.
    let (dec, dh) = cached_engine(Arc::new(CpuBackend::new()), cfg, o, CacheConfig::new(64, 0));
    let dst = dh.cache();
    let rid = dh.next_request_id();
    dst.begin(rid, &[]).unwrap();
    let targets: Vec<PageRef> = dst.alloc(rid, prefix.pages.len()).unwrap();
    let mut inbound = dst.inbound(rid, &targets).unwrap();
    {
        let mut step = src.step(&[id]).unwrap();
        let b = src.backend();
        let ids: Vec<i32> = prefix.pages.iter().map(|p| p.id as i32).collect();
        for l in 0..cfg.n_layers {
            let g = step.wait_layer(l).unwrap();
            let (kv, ik) = g.views().unwrap();
            for (kind, buf) in [(BufferKind::Kv, kv), (BufferKind::IndexK, ik)] {
                let region = src.device_region(kind);
                let mut sums = b.alloc(ids.len() * 8).unwrap();
                b.page_checksums(&PageChecksums { region, ids: &ids }, buf, &mut sums)
                    .unwrap();
                let sums: Vec<u64> = bytemuck::pod_collect_to_vec(&b.download(&sums).unwrap());
                inbound
                    .write(l, kind, &targets, buf, region, &ids, &sums)
                    .unwrap();
            }
        }
    }
    src.finish(id).unwrap();
    inbound.complete().unwrap();
    let mut req = s.first.clone();
    req.received = Some(ReceivedPages {
        cache_request: rid,
        pages: targets,
        extra: Vec::new(),
        tokens: prefix.tokens,
    });
    let got = run(&dec, &req).unwrap();
    same(&got, &want, "received prefix");
    // The decode side computed only past the received pages (its stores stamped its own
    // pages; nothing was matched in its own tree).
    assert_eq!(dst.stats().hits_device_pages, 0);
    // A request with received pages that are not live is refused, not served.
    let mut bad = s.first.clone();
    bad.id = Some("bad".into());
    bad.received = Some(ReceivedPages {
        cache_request: 999_999,
        pages: vec![],
        extra: Vec::new(),
        tokens: 0,
    });
    assert!(matches!(
        run(&dec, &bad),
        Err(EngineError::InvalidRequest(_))
    ));
    assert_idle_and_clean(&dec);
    assert_idle_and_clean(&pre);
}

/// Concurrent sessions sharing prefixes on a small device pool with a host tier, while
/// another thread aborts a third of the requests at random moments: every completed one
/// is bit-identical to the reference and no page is left behind.
#[test]
fn aborts_from_other_threads_leave_nothing_behind() {
    let seed = seed();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let head: Vec<u32> = (0..48).map(|_| rng.gen_range(0..256)).collect();
    let sessions: Vec<Session> = (0..8)
        .map(|i| Session::new(&mut rng, &head, 80 + 13 * i, 6, &format!("s{i}")))
        .collect();
    let cfg = ModelConfig::TINY;
    let reference = plain(Arc::new(CpuBackend::new()), cfg, &opts(64));
    let want: Vec<Completion> = sessions
        .iter()
        .map(|s| run(&reference, &s.first).unwrap())
        .collect();
    let mut config = CacheConfig::new(40, 128);
    config.write_through = true;
    let (e, h) = cached_engine(Arc::new(CpuBackend::new()), cfg, opts(40), config);
    let e = Arc::new(e);
    let mut aborted = 0;
    for round in 0..3 {
        let handles: Vec<_> = sessions
            .iter()
            .map(|s| {
                let mut r = s.first.clone();
                r.id = Some(format!("{}-r{round}", r.id.unwrap()));
                e.submit(r).unwrap()
            })
            .collect();
        let doomed: Vec<String> = handles
            .iter()
            .filter(|_| rng.gen_bool(0.35))
            .map(|h| h.rid().to_string())
            .collect();
        let e2 = e.clone();
        let aborter = std::thread::spawn(move || {
            for rid in doomed {
                e2.abort(&rid);
                std::thread::yield_now();
            }
        });
        for (i, hd) in handles.into_iter().enumerate() {
            let c = hd.wait(BOUND).unwrap();
            if c.finish == sparsekit_server::engine::FinishReason::Abort {
                aborted += 1;
            } else {
                same(&c, &want[i], &format!("round {round} session {i}"));
            }
        }
        aborter.join().unwrap();
        assert_idle_and_clean(&e);
        h.cache().leak_check().unwrap();
    }
    let st = h.cache().stats();
    assert!(st.hits_device_pages + st.hits_host_pages > 0, "{st:?}");
    assert!(aborted > 0, "no abort took effect");
}

/// The engine under `skip-index-wait` (+ `loads-trail-readers`, which makes the early read
/// certain): the landed stamps see every early read, wait for the bytes and serve the
/// right ones (counted as detections); with the stamps off the output is wrong.
#[test]
fn an_early_read_is_caught_by_landed_stamps_and_corrupts_without_them() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed());
    let s = Session::new(&mut rng, &[], 150, 6, "early");
    for stamps in [true, false] {
        let mut config = CacheConfig::new(64, 64);
        let mut faults = vec![Fault::SkipIndexWait, Fault::LoadsTrailReaders];
        if !stamps {
            faults.push(Fault::NoLandedCheck);
        }
        config.faults = Faults::with(&faults);
        let (e, h, _ctl, turn2, r2) = host_only_session(&s, config);
        let c = run(&e, &turn2).unwrap();
        if stamps {
            same(&c, &r2, "served after waiting for the load");
            assert!(h.cache().stats().landing_waits > 0);
        } else {
            assert_ne!(c.digests, r2.digests, "the early read corrupts");
            assert_eq!(h.cache().stats().landing_waits, 0);
        }
        assert_idle_and_clean(&e);
        let text = e.metrics().encode();
        let waits = text
            .lines()
            .find_map(|l| {
                l.strip_prefix("sparsekit_integrity_detections_total{check=\"landing_wait\"} ")
            })
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        assert_eq!(waits > 0.0, stamps, "{text}");
    }
}
