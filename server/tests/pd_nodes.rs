//! The PD nodes on their own, joined by a connector the test controls (local transport):
//! a decode node serves the bits of a plain engine; when its connection to prefill is cut
//! with requests in flight from several threads, each of those requests ends within its
//! bound (served, or failed with a typed error), the decode node reconnects on a later
//! request (at most one attempt per `RECONNECT_EVERY`, one caller at a time), serves the
//! same bits again, and no page stays held or quarantined.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use sparsekit_host::{CpuBackend, IndexKDtype, KvDtype};
use sparsekit_server::engine::{
    CacheOptions, Engine, EngineOptions, GenerateRequest, ModelConfig, SamplingParams,
};
use sparsekit_server::metrics::Metrics;
use sparsekit_server::pd::decode::{Connector, DecodeNode, PeerLink, RECONNECT_EVERY};
use sparsekit_server::pd::prefill::PrefillNode;
use sparsekit_server::pd::PdOptions;
use sparsekit_server::transfer::{local, Transport};
use sparsekit_server::EngineError;

const WAIT: Duration = Duration::from_secs(120);

fn opts(role: &str, host_pages: usize) -> EngineOptions {
    EngineOptions {
        seed: 7,
        kv_dtype: KvDtype::Bf16,
        index_k_dtype: IndexKDtype::Bf16,
        kv_pages: 256,
        cache: Some(CacheOptions {
            host_pages,
            ..Default::default()
        }),
        role: role.into(),
        ..Default::default()
    }
}

fn request(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest::new(
        prompt,
        SamplingParams {
            max_new_tokens: 4,
            ignore_eos: true,
            ..Default::default()
        },
    )
}

/// Prompts of several full pages (moved by PD) plus a partial one, random each run.
fn prompts(n: usize) -> Vec<Vec<u32>> {
    let seed: u64 = std::env::var("SPARSEKIT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("seed {seed} (replay with SPARSEKIT_SEED={seed})");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.gen_range(70..200);
            (0..len).map(|_| rng.gen_range(0..256)).collect()
        })
        .collect()
}

/// The prefill end of every connection made, and how many attempts there were.
#[derive(Default)]
struct Links {
    ends: Mutex<Vec<Arc<dyn Transport>>>,
    attempts: AtomicUsize,
}

fn connector(prefill: Arc<PrefillNode<CpuBackend>>, links: Arc<Links>) -> Connector {
    Arc::new(move |zone, hello| {
        links.attempts.fetch_add(1, Ordering::SeqCst);
        let (d, p) = local::pair(zone.clone(), hello.clone(), prefill.hello())?;
        let p: Arc<dyn Transport> = p;
        prefill
            .attach(p.clone())
            .map_err(|e| sparsekit_server::pd::PdError::Invalid(e.to_string()))?;
        links.ends.lock().unwrap().push(p);
        let d: Arc<dyn Transport> = d;
        Ok(d)
    })
}

#[test]
fn decode_reconnects_after_its_connection_is_cut_under_load() {
    let backend = Arc::new(CpuBackend::new());
    let cfg = ModelConfig::TINY;
    let pd = PdOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let prefill = Arc::new(
        PrefillNode::start(
            backend.clone(),
            cfg,
            opts("prefill", 512),
            &pd,
            Arc::new(Metrics::new("prefill")),
            None,
        )
        .unwrap(),
    );
    let links = Arc::new(Links::default());
    let decode = DecodeNode::start(
        backend.clone(),
        cfg,
        opts("decode", 0),
        &pd,
        Arc::new(Metrics::new("decode")),
        PeerLink {
            connector: connector(prefill.clone(), links.clone()),
            connect_wait: Duration::ZERO,
        },
        None,
    )
    .unwrap();
    assert!(decode.connected());
    let plain = Engine::start(
        backend,
        cfg,
        EngineOptions {
            cache: None,
            ..opts("both", 0)
        },
        Arc::new(Metrics::new("both")),
    )
    .unwrap();
    let ps = prompts(12);
    let want: Vec<_> = ps
        .iter()
        .map(|p| {
            let c = plain
                .submit(request(p.clone()))
                .unwrap()
                .wait(WAIT)
                .unwrap();
            (c.tokens, c.digests)
        })
        .collect();

    // Six threads submit to decode; the connection is cut while they run.
    let engine = decode.engine.clone();
    let started = Instant::now();
    let outcomes: Vec<_> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..6)
            .map(|t| {
                let (engine, ps, want) = (&engine, &ps, &want);
                s.spawn(move || {
                    (t..ps.len())
                        .step_by(6)
                        .map(|i| match engine.submit(request(ps[i].clone())) {
                            Ok(h) => match h.wait(WAIT) {
                                Ok(c) => {
                                    assert_eq!((c.tokens, c.digests), want[i], "prompt {i}");
                                    Ok(())
                                }
                                Err(e) => Err(e),
                            },
                            Err(e) => Err(e),
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        // Cut once some transfers finished (others are in flight then).
        let until = Instant::now() + WAIT;
        while decode.stats().finished < 3 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        links.ends.lock().unwrap()[0].close("the test cuts the connection");
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    assert!(
        started.elapsed() < WAIT,
        "requests ended within their bound"
    );
    let failed = outcomes.iter().filter(|o| o.is_err()).count();
    eprintln!(
        "{failed} of {} requests failed across the cut",
        outcomes.len()
    );
    for o in &outcomes {
        match o {
            Ok(()) => {}
            Err(EngineError::Unavailable(_) | EngineError::StepFailed(_)) => {}
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }

    // Later requests reconnect (bounded) and give the same bits.
    let deadline = Instant::now() + Duration::from_secs(30);
    for (i, p) in ps.iter().enumerate() {
        let c = loop {
            match engine.submit(request(p.clone())).unwrap().wait(WAIT) {
                Ok(c) => break c,
                Err(e) => {
                    assert!(Instant::now() < deadline, "never reconnected: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        assert_eq!(
            (c.tokens, c.digests),
            want[i],
            "prompt {i} after reconnecting"
        );
    }
    assert!(decode.connected());
    let attempts = links.attempts.load(Ordering::SeqCst);
    eprintln!("{attempts} connection attempts");
    let bound = 2 + (started.elapsed().as_secs_f64() / RECONNECT_EVERY.as_secs_f64()) as usize;
    assert!(
        (2..=bound).contains(&attempts),
        "{attempts} connection attempts (at most {bound})"
    );

    // Idle: nothing held, nothing quarantined, nothing in flight.
    let deadline = Instant::now() + Duration::from_secs(30);
    while decode.transfers_in_flight() + decode.quarantined_pages() + prefill.in_flight() > 0 {
        assert!(Instant::now() < deadline, "transfers never ended");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Decode keeps no prefix cache: every page is free again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = engine.stats();
        if st.running + st.waiting == 0 && st.free_pages == st.capacity_pages {
            break;
        }
        assert!(Instant::now() < deadline, "decode pages still held: {st:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    let d = decode.stats();
    assert!(d.finished as usize >= ps.len(), "{d:?}");
    decode.shutdown(Duration::from_secs(5)).unwrap();
    prefill.shutdown(Duration::from_secs(5)).unwrap();
}

/// A decode pool smaller than the load: 20 pages, two requests that each need 12 (10 of
/// them received). Fetches take a request's whole budget at once (or wait, holding
/// nothing), so neither can hold pages the other needs: both are served, with the bits of
/// a plain engine, and nothing stays held.
#[test]
fn a_decode_pool_smaller_than_the_load_never_wedges() {
    let backend = Arc::new(CpuBackend::new());
    let cfg = ModelConfig::TINY;
    let ps = cfg.page_size();
    let pd = PdOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let prefill = Arc::new(
        PrefillNode::start(
            backend.clone(),
            cfg,
            opts("prefill", 0),
            &pd,
            Arc::new(Metrics::new("prefill")),
            None,
        )
        .unwrap(),
    );
    let links = Arc::new(Links::default());
    let decode = DecodeNode::start(
        backend.clone(),
        cfg,
        EngineOptions {
            kv_pages: 20,
            ..opts("decode", 0)
        },
        &pd,
        Arc::new(Metrics::new("decode")),
        PeerLink {
            connector: connector(prefill.clone(), links),
            connect_wait: Duration::ZERO,
        },
        None,
    )
    .unwrap();
    let plain = Engine::start(
        backend,
        cfg,
        EngineOptions {
            cache: None,
            ..opts("both", 0)
        },
        Arc::new(Metrics::new("both")),
    )
    .unwrap();
    // 10 full pages + 1 token of prompt (10 pages received), 12 pages with the reply.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let make = |rng: &mut rand_chacha::ChaCha8Rng| -> GenerateRequest {
        let prompt: Vec<u32> = (0..10 * ps + 1).map(|_| rng.gen_range(0..256)).collect();
        GenerateRequest::new(
            prompt,
            SamplingParams {
                max_new_tokens: 2 * ps - 1,
                ignore_eos: true,
                ..Default::default()
            },
        )
    };
    let reqs = [make(&mut rng), make(&mut rng)];
    let want: Vec<_> = reqs
        .iter()
        .map(|r| {
            let c = plain.submit(r.clone()).unwrap().wait(WAIT).unwrap();
            (c.tokens, c.digests)
        })
        .collect();
    let started = Instant::now();
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| decode.engine.submit(r.clone()).unwrap())
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let c = h
            .wait(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!((c.tokens, c.digests), want[i], "request {i}");
    }
    eprintln!("both served in {:?}", started.elapsed());
    let until = Instant::now() + WAIT;
    while decode.engine.stats().leak_check.is_none() && Instant::now() < until {
        std::thread::yield_now();
    }
    assert_eq!(decode.engine.stats().leaked_pages, 0);
}

/// A prefill node serves at most `max_connections` decode connections: one more is
/// refused with `Overloaded` and closed, and a place freed by a closed connection is
/// taken again.
#[test]
fn a_prefill_node_caps_its_decode_connections() {
    let backend = Arc::new(CpuBackend::new());
    let pd = PdOptions {
        max_connections: 3,
        workers: 1,
        ..Default::default()
    };
    let prefill = PrefillNode::start(
        backend,
        ModelConfig::TINY,
        opts("prefill", 0),
        &pd,
        Arc::new(Metrics::new("prefill")),
        None,
    )
    .unwrap();
    use sparsekit_server::pd::{hello, LandingGeometry, LandingZone, Role};
    let spec = prefill.spec();
    let zone = Arc::new(LandingZone::new(LandingGeometry::new(spec, 4).unwrap()).unwrap());
    let arithmetic = prefill.hello().arithmetic;
    let decode_hello = || hello(Role::Decode, &spec, arithmetic, 4, Vec::new());
    let mut ends: Vec<Arc<dyn Transport>> = Vec::new();
    let mut decode_ends = Vec::new();
    for _ in 0..4 {
        let (d, p) = local::pair(zone.clone(), decode_hello(), prefill.hello()).unwrap();
        let p: Arc<dyn Transport> = p;
        ends.push(p);
        decode_ends.push(d);
    }
    for e in &ends[..3] {
        prefill.attach(e.clone()).unwrap();
    }
    match prefill.attach(ends[3].clone()) {
        Err(EngineError::Overloaded(m)) => assert!(m.contains("at most 3"), "{m}"),
        other => panic!("a fourth connection must be refused: {other:?}"),
    }
    assert!(ends[3].is_closed(), "the refused connection is closed");
    assert_eq!(prefill.connections(), 3);
    ends[0].close("decode went away");
    // The sender notices its connection closed on its own thread (bounded).
    let until = Instant::now() + WAIT;
    while prefill.connections() != 2 {
        assert!(
            Instant::now() < until,
            "the closed connection was never noticed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let (d, p) = local::pair(zone, decode_hello(), prefill.hello()).unwrap();
    prefill.attach(p).unwrap();
    assert_eq!(prefill.connections(), 3);
    drop((d, decode_ends));
}

/// DeepSeek-V4 over PD: every pool of every layer (the window, CSA and HCA compressed KV,
/// compressed index keys, the compressor state) crosses from prefill to decode, and the
/// decode node serves the bits of a plain engine, with fp4 index keys and MODEL1 KV.
#[test]
fn v4_prompts_cross_pd_with_every_pool_and_serve_the_same_bits() {
    let backend = Arc::new(CpuBackend::new());
    let cfg = ModelConfig::DSV4_TINY;
    let v4 = |role: &str| EngineOptions {
        kv_dtype: KvDtype::Model1Fp8,
        index_k_dtype: IndexKDtype::Fp4E2m1,
        ..opts(role, 0)
    };
    let pd = PdOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let prefill = Arc::new(
        PrefillNode::start(
            backend.clone(),
            cfg,
            v4("prefill"),
            &pd,
            Arc::new(Metrics::new("prefill")),
            None,
        )
        .unwrap(),
    );
    let links = Arc::new(Links::default());
    let decode = DecodeNode::start(
        backend.clone(),
        cfg,
        v4("decode"),
        &pd,
        Arc::new(Metrics::new("decode")),
        PeerLink {
            connector: connector(prefill.clone(), links.clone()),
            connect_wait: Duration::ZERO,
        },
        None,
    )
    .unwrap();
    assert!(decode.connected());
    let plain = Engine::start(
        backend,
        cfg,
        EngineOptions {
            cache: None,
            ..v4("both")
        },
        Arc::new(Metrics::new("both")),
    )
    .unwrap();
    let ps = prompts(4);
    for p in ps.clone() {
        let want = plain
            .submit(request(p.clone()))
            .unwrap()
            .wait(WAIT)
            .unwrap();
        let got = decode
            .engine
            .submit(request(p))
            .unwrap()
            .wait(WAIT)
            .unwrap();
        assert_eq!(got.tokens, want.tokens);
        assert_eq!(got.digests, want.digests);
    }
    let d = decode.stats();
    assert!(d.finished >= 4, "the prompts did not cross PD: {d:?}");
    // The window pool crosses for the pages decode's queries read only: at most the 3
    // pages a 16-token window after a prompt touches, of every layer; the compressed
    // pools for every page.
    let kv_page = sparsekit_host::layout::KvLayout::new(KvDtype::Model1Fp8, 448, 64, 16)
        .unwrap()
        .bytes_per_page() as u64;
    let layers = cfg.n_layers as u64;
    let every: u64 = ps.iter().map(|p| (p.len() as u64 - 1).div_ceil(16)).sum();
    assert!(every > 3 * 4, "the prompts span more than the window");
    assert!(
        d.kv_bytes > 0 && d.kv_bytes <= 3 * 4 * layers * kv_page,
        "window rows moved: {} bytes, every page's would be {}: {d:?}",
        d.kv_bytes,
        every * layers * kv_page
    );
    assert!(d.other_bytes.values().sum::<u64>() > 0, "{d:?}");
    decode.shutdown(Duration::from_secs(5)).unwrap();
    prefill.shutdown(Duration::from_secs(5)).unwrap();
}
