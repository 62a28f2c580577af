//! PD over NIXL: the same endpoints and checks as over the local
//! transport, with page bytes moved by NIXL writes (UCX over loopback) into decode's
//! registered landing zone and notifications carrying the `Written` frames.
//!
//! The NIXL runtime is opened once per process, so these tests run their NIXL parts in
//! child processes of this test binary (re-executed with `SPARSEKIT_NIXL_LIB` naming the
//! runtime's directory): `SPARSEKIT_NIXL_LIB`, or `.tools/nixl/` (installed by
//! `scripts/setup-nixl.sh`). Without it they say so and pass, unless
//! `SPARSEKIT_REQUIRE_NIXL=1` (CI) makes that a failure.
//!
//! - prefill and decode as two processes: ragged transfers bit-exact, an abort, then a
//!   killed prefill (decode's transfer fails, its pages are released, no hang) and a killed
//!   decode (prefill's next write is an error, no hang);
//! - both ends in one process (agents shared by the scenarios): a fault injection caught
//!   over NIXL;
//! - without the runtime, NIXL says so instead of aborting the process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::pd_common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use pd_common::*;
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_host::Backend;
use sparsekit_server::pd::{
    hello, Checks, LandingGeometry, LandingZone, Outcome, PdFault, PdFaults, Receiver,
    ReceiverConfig, Role, Sender, SenderConfig,
};
use sparsekit_server::transfer::nixl::{
    self, NixlAgent, NixlListener, NixlOptions, NixlSide, RegisteredZone,
};
use sparsekit_server::transfer::{TransferError, Transport};

const CHILD: &str = "SPARSEKIT_PD_NIXL_CHILD";
const ADDR: &str = "SPARSEKIT_PD_NIXL_ADDR";
const HOLD: &str = "SPARSEKIT_PD_NIXL_HOLD";
const PAGES: usize = 64;

fn spec_() -> sparsekit_host::cache::CacheSpec {
    spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16)
}

/// The directory with `libnixl_capi.so`, if installed.
fn runtime_dir() -> Option<PathBuf> {
    let dir = std::env::var_os(nixl::LIB_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/nixl/.nixl_cu12.mesonpy.libs")
        });
    dir.join("libnixl_capi.so").exists().then_some(dir)
}

/// The runtime directory, or `None` after saying why the test does not run (a failure
/// where `SPARSEKIT_REQUIRE_NIXL=1`).
fn runtime_or_skip(test: &str) -> Option<PathBuf> {
    let dir = runtime_dir();
    if dir.is_none() {
        let msg = format!(
            "{test}: the NIXL runtime is not installed (run `bash scripts/setup-nixl.sh` or set {})",
            nixl::LIB_ENV
        );
        assert!(
            std::env::var("SPARSEKIT_REQUIRE_NIXL").as_deref() != Ok("1"),
            "{msg}, and SPARSEKIT_REQUIRE_NIXL=1"
        );
        // Straight to stderr (not through the test harness's capture): visible under
        // `cargo test`.
        let _ = writeln!(std::io::stderr(), "SKIPPED {msg}");
    }
    dir
}

/// This test binary, running only `test` (a test function of this module), as child
/// `role`, told that the NIXL runtime is in `lib` (or nowhere), stdin/stdout piped.
fn child(test: &str, role: &str, lib: Option<&PathBuf>, env: &[(&str, String)]) -> Child {
    // The test's full name in the binary: this module's path without the crate's name.
    let (_, module) = module_path!()
        .split_once("::")
        .expect("pd_nixl is a module of the integration binary");
    let test = format!("{module}::{test}");
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    match lib {
        Some(d) => {
            c.env(nixl::LIB_ENV, d);
        }
        None => {
            // A directory without the runtime, and no loader path that could hold one.
            c.env(nixl::LIB_ENV, "/nonexistent/sparsekit-no-nixl")
                .env_remove("LD_LIBRARY_PATH");
        }
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// The lines a child prints, as they come.
fn lines(c: &mut Child) -> mpsc::Receiver<String> {
    let out = c.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { return };
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    rx
}

/// Waits (bounded) for a line containing `tag` (libtest may print its own text before it
/// on the same line); returns the rest.
fn expect(rx: &mpsc::Receiver<String>, tag: &str) -> String {
    loop {
        let l = rx
            .recv_timeout(BOUND)
            .unwrap_or_else(|_| panic!("no {tag:?} line from the child within {BOUND:?}"));
        if let Some(i) = l.find(tag) {
            return l[i + tag.len()..].trim().to_owned();
        }
    }
}

/// Waits (bounded) for the child to exit; kills it past the bound.
fn finish(mut c: Child) -> std::process::ExitStatus {
    let (tx, rx) = mpsc::channel();
    let id = c.id();
    std::thread::spawn(move || {
        let _ = tx.send(c.wait());
    });
    match rx.recv_timeout(BOUND) {
        Ok(s) => s.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &id.to_string()]).status();
            panic!("child {id} did not exit within {BOUND:?}");
        }
    }
}

fn say(s: &str) {
    println!("{s}");
    std::io::stdout().flush().unwrap();
}

fn opts() -> NixlOptions {
    NixlOptions {
        io_timeout: Duration::from_secs(10),
        ..NixlOptions::default()
    }
}

/// Prefill and decode as two processes over NIXL, then each killed in turn.
#[test]
fn nixl_two_processes() {
    match std::env::var(CHILD).as_deref() {
        Ok("decode") => return decode_process(),
        Ok("prefill") => return prefill_process(),
        _ => {}
    }
    let Some(lib) = runtime_or_skip("nixl_two_processes") else {
        return;
    };
    let name = "nixl_two_processes";
    let mut d = child(name, "decode", Some(&lib), &[]);
    let d_out = lines(&mut d);
    let addr = expect(&d_out, "LISTEN");
    let mut p = child(
        name,
        "prefill",
        Some(&lib),
        &[(ADDR, addr.clone()), (HOLD, "100".into())],
    );
    let p_out = lines(&mut p);
    let summary = expect(&d_out, "TRANSFERS_OK");
    eprintln!("decode: transfers ok: {summary}");
    // Decode holds request 100 with layer 0 landed and prefill stopped before layer 1:
    // kill prefill. Decode must see the connection die and release everything.
    expect(&d_out, "HOLD");
    expect(&p_out, "GATE");
    p.kill().unwrap();
    let _ = finish(p);
    expect(&d_out, "PEER_DEATH_OK");
    // A second prefill connects; it stops before its second layer; decode is killed; the
    // prefill's next write must fail, not hang.
    let mut p2 = child(
        name,
        "prefill",
        Some(&lib),
        &[(ADDR, addr), (HOLD, "200".into())],
    );
    let p2_out = lines(&mut p2);
    expect(&p2_out, "GATE");
    d.kill().unwrap();
    let _ = finish(d);
    p2.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let e = expect(&p2_out, "DECODE_DEATH_OK");
    eprintln!("prefill: write after decode died: {e}");
    assert!(finish(p2).success());
}

fn decode_process() {
    let s = spec_();
    let d = cache(s, PAGES, &[]);
    let agent = NixlAgent::new(Role::Decode).unwrap();
    let zone = Arc::new(LandingZone::new(LandingGeometry::new(s, PAGES).unwrap()).unwrap());
    let side = NixlSide {
        zone: Some(RegisteredZone::new(&agent, zone).unwrap()),
        agent,
        hello: hello(
            Role::Decode,
            &s,
            d.backend().arithmetic(),
            PAGES,
            Vec::new(),
        ),
        opts: opts(),
    };
    let lis = NixlListener::bind(side, "127.0.0.1:0".parse::<SocketAddr>().unwrap()).unwrap();
    say(&format!("LISTEN {}", lis.local_addr().unwrap()));
    let end = lis.accept(BOUND).unwrap();
    assert_eq!(end.name(), "nixl");
    let rx = Receiver::new(d.clone(), end, ReceiverConfig::default()).unwrap();
    // A ragged batch, one aborted right away.
    let mut reqs = Vec::new();
    for (i, n) in [5usize, 17, 1, 30, 8, 12].into_iter().enumerate() {
        let req = 1 + i as u64;
        let p = prompt(req, n);
        let pages = start_on(&d, &rx, req, &p).unwrap();
        reqs.push((req, p, pages));
    }
    assert!(rx.abort(4, "client went away"));
    for (req, p, pages) in &reqs {
        let out = rx.wait(*req, BOUND).unwrap();
        if *req == 4 {
            assert!(matches!(out, Outcome::Cancelled(_)), "{out:?}");
            continue;
        }
        assert_eq!(out, Outcome::Ready, "request {req}");
        for l in 0..LAYERS {
            let got = received(&d, *req, pages, l).unwrap();
            assert!(
                same_tokens(&s, p.len(), &got, &expected(&s, p, l)),
                "request {req} layer {l}"
            );
        }
        d.finish(*req).unwrap();
    }
    let st = rx.stats();
    assert_eq!(d.leak_check().unwrap().device_free, PAGES);
    say(&format!(
        "TRANSFERS_OK finished={} cancelled={} kv_bytes={} index_k_bytes={} refused={}",
        st.finished,
        st.cancelled,
        st.kv_bytes,
        st.index_k_bytes,
        st.refused_total()
    ));
    // Request 100: prefill stops before layer 1 and is killed.
    let p = prompt(100, 13);
    start_on(&d, &rx, 100, &p).unwrap();
    {
        let step = d.step(&[100]).unwrap();
        step.wait(0).unwrap();
        assert!(!step.ready(1).unwrap());
    }
    say("HOLD");
    let out = rx.wait(100, BOUND).unwrap();
    assert!(
        matches!(&out, Outcome::Failed(r) if r.contains("closed")),
        "{out:?}"
    );
    assert!(rx.is_closed());
    assert!(!d.is_live(100));
    // A NIXL write prefill posted may still land for the write bound: the pages stay
    // quarantined that long after the teardown, then are free.
    let s = d.leak_check().unwrap();
    assert!(s.device_quarantined > 0, "{s:?}");
    let until = std::time::Instant::now() + opts().io_timeout + BOUND;
    while d.leak_check().unwrap().device_free != PAGES {
        assert!(std::time::Instant::now() < until, "pages never released");
        std::thread::sleep(Duration::from_millis(20));
    }
    say("PEER_DEATH_OK");
    drop(rx);
    // Second connection: serve until killed.
    let end = lis.accept(BOUND).unwrap();
    let rx = Receiver::new(d.clone(), end, ReceiverConfig::default()).unwrap();
    start_on(&d, &rx, 200, &prompt(200, 9)).unwrap();
    let _ = rx.wait(200, Duration::from_secs(60));
    panic!("decode was meant to be killed");
}

fn prefill_process() {
    let s = spec_();
    let p = cache(s, PAGES, &[]);
    let addr: SocketAddr = std::env::var(ADDR).unwrap().parse().unwrap();
    let hold: u64 = std::env::var(HOLD).unwrap().parse().unwrap();
    let side = NixlSide {
        agent: NixlAgent::new(Role::Prefill).unwrap(),
        hello: hello(Role::Prefill, &s, p.backend().arithmetic(), 0, Vec::new()),
        zone: None,
        opts: opts(),
    };
    let end = nixl::connect(&side, addr).unwrap();
    let tx = Sender::new(p.clone(), end, SenderConfig::default()).unwrap();
    loop {
        let Some(job) = tx.next_job(BOUND) else {
            panic!("no job within {BOUND:?}");
        };
        let req = job.request();
        let src = fill(&p, req, job.prompt());
        let mut step = p.step(&[req]).unwrap();
        let mut result = Ok(());
        for l in 0..LAYERS {
            if (req, l) == (hold, 1) {
                say("GATE");
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
            }
            let staged = {
                let g = step.wait_layer(l).unwrap();
                job.stage(&g, &src).unwrap()
            };
            result = job.write(staged);
            if result.is_err() {
                break;
            }
        }
        drop(step);
        if req == hold {
            // Only reached when decode died: the write must have failed.
            let e = result.expect_err("a write to a dead decode succeeded");
            say(&format!("DECODE_DEATH_OK {e}"));
            std::process::exit(0);
        }
        match result {
            Ok(()) => {
                let _ = job.finish();
            }
            Err(_) => drop(job),
        }
        let _ = p.abort(req);
    }
}

/// Both ends in one process (one agent each, shared by the scenarios): transfers, and the
/// `stale-transfer-write` fault caught by the checksums of what NIXL landed.
#[test]
fn nixl_in_one_process() {
    let name = "nixl_in_one_process";
    if std::env::var(CHILD).as_deref() != Ok("inproc") {
        let Some(lib) = runtime_or_skip(name) else {
            return;
        };
        let c = child(name, "inproc", Some(&lib), &[]);
        assert!(finish(c).success(), "the in-process NIXL scenarios failed");
        return;
    }
    let s = spec(KvDtype::Bf16, IndexKDtype::FP8);
    let da = NixlAgent::new(Role::Decode).unwrap();
    let pa = NixlAgent::new(Role::Prefill).unwrap();
    // Here prefill listens and decode connects (as `serve --role decode --peer` does).
    let connect = |d: &Arc<sparsekit_host::cache::HiCache<B>>,
                   rc: ReceiverConfig,
                   p: &Arc<sparsekit_host::cache::HiCache<B>>,
                   sc: SenderConfig| {
        let prefill = NixlSide {
            agent: pa.clone(),
            hello: hello(Role::Prefill, &s, p.backend().arithmetic(), 0, Vec::new()),
            zone: None,
            opts: opts(),
        };
        let lis =
            NixlListener::bind(prefill, "127.0.0.1:0".parse::<SocketAddr>().unwrap()).unwrap();
        let addr = lis.local_addr().unwrap();
        let zone =
            Arc::new(LandingZone::new(LandingGeometry::new(s, d.device_pages()).unwrap()).unwrap());
        let decode = NixlSide {
            zone: Some(RegisteredZone::new(&da, zone).unwrap()),
            agent: da.clone(),
            hello: hello(
                Role::Decode,
                &s,
                d.backend().arithmetic(),
                d.device_pages(),
                Vec::new(),
            ),
            opts: opts(),
        };
        let c = std::thread::spawn(move || nixl::connect(&decode, addr).unwrap());
        let p_end = lis.accept(BOUND).unwrap();
        let d_end = c.join().unwrap();
        let rx = Receiver::new(d.clone(), d_end, rc).unwrap();
        let tx = Arc::new(Sender::new(p.clone(), p_end, sc).unwrap());
        (rx, tx)
    };
    // Scenario 1: a batch lands bit-exact.
    let (d, p) = (cache(s, 16, &[]), cache(s, 16, &[]));
    let (rx, tx) = connect(&d, ReceiverConfig::default(), &p, SenderConfig::default());
    let w = Worker::spawn(tx.clone(), p.clone(), go());
    let mut reqs = Vec::new();
    for req in 1..=4u64 {
        let pr = prompt(req, 3 + 4 * req as usize);
        reqs.push((req, pr.clone(), start_on(&d, &rx, req, &pr).unwrap()));
    }
    for (req, pr, pages) in &reqs {
        assert_eq!(rx.wait(*req, BOUND).unwrap(), Outcome::Ready);
        for l in 0..LAYERS {
            let got = received(&d, *req, pages, l).unwrap();
            assert!(same_tokens(&s, pr.len(), &got, &expected(&s, pr, l)));
        }
        d.finish(*req).unwrap();
    }
    drop(w);
    drop(rx);
    drop(tx);
    // Scenario 2: stale-transfer-write over NIXL, checks on: the reusing transfer is
    // refused by its checksums (the late bytes really landed in the registered memory).
    let (d, p) = (cache(s, 3, &[]), cache(s, 8, &[]));
    let sc = SenderConfig {
        faults: PdFaults::with(&[PdFault::StaleTransferWrite]),
        ..SenderConfig::default()
    };
    let rc = ReceiverConfig {
        checks: Checks::all(),
        ..ReceiverConfig::default()
    };
    let (rx, tx) = connect(&d, rc, &p, sc);
    let (held_tx, held_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let held_tx = parking_lot::Mutex::new(held_tx);
    let go_rx = parking_lot::Mutex::new(go_rx);
    let gate: Gate = Arc::new(move |req, l| {
        if (req, l) == (1, 1) {
            held_tx.lock().send(()).unwrap();
            go_rx.lock().recv_timeout(BOUND).unwrap();
        }
        Act::Go
    });
    let _w = Worker::spawn(tx.clone(), p.clone(), gate);
    start_on(&d, &rx, 1, &prompt(1, 12)).unwrap();
    held_rx.recv_timeout(BOUND).unwrap();
    rx.abort(1, "gone");
    assert!(matches!(rx.wait(1, BOUND).unwrap(), Outcome::Cancelled(_)));
    start_on(&d, &rx, 2, &prompt(2, 12)).unwrap();
    go_tx.send(()).unwrap();
    assert!(matches!(rx.wait(2, BOUND).unwrap(), Outcome::Failed(_)));
    assert_eq!(rx.stats().refused("checksum"), 1, "{:?}", rx.stats());
    assert_eq!(d.leak_check().unwrap().device_free, 3);
}

/// Without the runtime, NIXL says so (a typed error naming the fix) instead of aborting
/// the process.
#[test]
fn without_the_runtime_nixl_says_so() {
    let name = "without_the_runtime_nixl_says_so";
    if std::env::var(CHILD).as_deref() != Ok("bare") {
        let c = child(name, "bare", None, &[]);
        assert!(finish(c).success());
        return;
    }
    if nixl::check_runtime().is_ok() {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED {name}: a NIXL runtime is installed system-wide"
        );
        return;
    }
    match NixlAgent::new(Role::Decode) {
        Err(TransferError::Unavailable(m)) => {
            assert!(
                m.contains("setup-nixl.sh") && m.contains(nixl::LIB_ENV),
                "{m}"
            )
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(nixl::check_runtime().is_err());
}
