//! Prefill and decode as two `sparsekit serve` processes joined by NIXL over loopback
//! (`--role prefill|decode --transport nixl`), and `sparsekit repro --transport nixl`
//! running its PD-on rows through such pairs.
//!
//! - Two servers give the tokens and logits digests of a plain server; `/server_info`
//!   shows how they are joined; decode's `/metrics` counts the bytes that landed. A
//!   killed prefill fails decode's requests with a JSON 503 (decode stays healthy); a
//!   prefill restarted on the same port is found again and serves the same bits; SIGTERM
//!   stops both with status 0.
//! - The harness over NIXL: four PD-on configurations clean (0 corrupted, wedged, leaked,
//!   quarantined); `pd-fp8-frame` caught with the checks on, reproduced with them off.
//!
//! The servers need the NIXL runtime (`bash scripts/setup-nixl.sh`, or
//! `SPARSEKIT_NIXL_LIB`). Without it these tests say so and pass, unless
//! `SPARSEKIT_REQUIRE_NIXL=1` (CI) makes that a failure.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{get, post, signal, wait_exit, Server};

use serde_json::Value;
use sparsekit_server::transfer::{nixl_runtime_dir, NIXL_LIB_ENV};

/// The runtime directory, or `None` after saying why the test does not run (a failure
/// where `SPARSEKIT_REQUIRE_NIXL=1`).
fn runtime_or_skip(test: &str) -> Option<PathBuf> {
    let dir = nixl_runtime_dir(Some(Path::new(env!("CARGO_MANIFEST_DIR"))));
    if dir.is_none() {
        let msg = format!(
            "{test}: the NIXL runtime is not installed (run `bash scripts/setup-nixl.sh` or set {NIXL_LIB_ENV})"
        );
        assert!(
            std::env::var("SPARSEKIT_REQUIRE_NIXL").as_deref() != Ok("1"),
            "{msg}, and SPARSEKIT_REQUIRE_NIXL=1"
        );
        let _ = writeln!(std::io::stderr(), "SKIPPED {msg}");
    }
    dir
}

/// `sparsekit serve ARGS`, told where the NIXL runtime is.
fn serve(lib: &Path, args: &[&str]) -> Server {
    common::serve(
        args,
        &[
            (NIXL_LIB_ENV, lib.as_os_str().to_owned()),
            ("RUST_LOG", "warn".into()),
        ],
    )
}

/// Output ids and logits digests of a greedy request for `prompt`.
fn generate(addr: &str, prompt: &[u32]) -> (u16, Value) {
    let body = serde_json::json!({
        "input_ids": prompt, "return_logits_digest": true,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0}
    })
    .to_string();
    let (status, response) = post(addr, "/generate", &body);
    let v: Value = serde_json::from_str(common::body(&response)).unwrap_or(Value::Null);
    (status, v)
}

fn bits(v: &Value) -> (Value, Value) {
    (
        v["output_ids"].clone(),
        v["meta_info"]["logits_digests"].clone(),
    )
}

#[test]
fn prefill_and_decode_as_two_processes_over_nixl() {
    let Some(lib) = runtime_or_skip("prefill_and_decode_as_two_processes_over_nixl") else {
        return;
    };
    let common = ["--port", "0", "--kv-pages", "1024", "--index-k", "bf16"];
    let plain = serve(&lib, &[&common[..], &["--prefix-cache", "off"]].concat());
    // The prefill side, on `port` (0: any free one).
    let start_prefill = |port: &str| {
        serve(
            &lib,
            &[
                "--port",
                port,
                "--kv-pages",
                "1024",
                "--index-k",
                "bf16",
                "--role",
                "prefill",
                "--transport",
                "nixl",
                "--host-tier",
                "on",
            ],
        )
    };
    let prefill = start_prefill("0");
    let peer = format!("http://{}", prefill.addr);
    let (_, info) = get(&prefill.addr, "/server_info");
    let info: Value = serde_json::from_str(common::body(&info)).unwrap();
    assert_eq!(info["pd"]["role"], "prefill", "{info}");
    let bootstrap = info["pd"]["bootstrap_port"].as_u64().unwrap();
    assert!(bootstrap > 0);
    // Three clients connect to the bootstrap port and never speak: each handshake waits
    // up to its bound (10 s) on a thread of its own, so decode is not kept waiting.
    let mut at: std::net::SocketAddr = prefill.addr.parse().unwrap();
    at.set_port(bootstrap as u16);
    let silent: Vec<std::net::TcpStream> = (0..3)
        .map(|_| std::net::TcpStream::connect(at).unwrap())
        .collect();
    let started = Instant::now();
    let decode = serve(
        &lib,
        &[
            &common[..],
            &["--role", "decode", "--transport", "nixl", "--peer", &peer],
        ]
        .concat(),
    );
    let (_, info) = get(&decode.addr, "/server_info");
    let info: Value = serde_json::from_str(common::body(&info)).unwrap();
    assert_eq!(
        (&info["pd"]["role"], &info["pd"]["peer"]),
        (&Value::from("decode"), &Value::from(peer.clone()))
    );

    // A prompt of several full pages (moved by NIXL) plus a partial one.
    let prompt: Vec<u32> = (0..150).map(|i| (i * 13 % 256) as u32).collect();
    let (s1, got) = generate(&decode.addr, &prompt);
    let connected_in = started.elapsed();
    drop(silent);
    assert!(
        connected_in < Duration::from_secs(9),
        "silent clients delayed decode's connection: {connected_in:?}"
    );
    let (s0, want) = generate(&plain.addr, &prompt);
    assert_eq!((s0, s1), (200, 200), "{want}\n{got}");
    assert!(want["output_ids"].as_array().is_some_and(|a| a.len() == 6));
    assert_eq!(bits(&want), bits(&got));
    // The counters reach /metrics through a publisher (every 20 ms): bounded look.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, m) = get(&decode.addr, "/metrics");
        let landed = m
            .lines()
            .find(|l| l.starts_with("sparsekit_transfer_bytes_total{kind=\"index_k\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        if landed > 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "no index-K bytes landed: {m}");
        std::thread::sleep(Duration::from_millis(20));
    }

    // The harness measures the running pair through decode's URL, as the PD-on,
    // host-tier-on configuration it is (read from /server_info and prefill's).
    let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args([
            "repro",
            "--sessions",
            "2",
            "--turns",
            "2",
            "--json",
            "--url",
        ])
        .arg(format!("http://{}", decode.addr))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows: Vec<Value> = serde_json::from_value(run["rows"].clone()).unwrap();
    let row = rows.iter().find(|r| r["available"] == true).unwrap();
    assert_eq!(row["config"], "bf16/host-on/pd-on", "{row}");
    assert_eq!(
        (&row["corrupted"], &row["wedged"]),
        (&Value::from(0), &Value::from(0))
    );

    // Prefill dies: decode answers with a JSON error and stays healthy.
    let prefill_port = prefill.addr.rsplit(':').next().unwrap().to_string();
    drop(prefill);
    let other: Vec<u32> = prompt.iter().map(|t| (t + 1) % 256).collect();
    let (status, err) = generate(&decode.addr, &other);
    // 503 when decode already saw the connection close, 500 when the transfer was
    // started on it first; either way a JSON error naming the PD side.
    assert!(matches!(status, 500 | 503), "{status}: {err}");
    assert!(
        err["error"]["message"].as_str().unwrap().contains("PD"),
        "{err}"
    );
    assert_eq!(get(&decode.addr, "/health").0, 200);

    // A prefill restarted on the same port is found again (decode reconnects on a later
    // request, at most one attempt a second) and serves the same bits.
    let prefill = start_prefill(&prefill_port);
    let deadline = Instant::now() + Duration::from_secs(30);
    let again = loop {
        let (status, v) = generate(&decode.addr, &prompt);
        if status == 200 {
            break v;
        }
        assert!(matches!(status, 500 | 503), "{status}: {v}");
        assert!(Instant::now() < deadline, "decode did not reconnect: {v}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(bits(&want), bits(&again));

    // SIGTERM: both stop cleanly.
    for mut s in [decode, prefill] {
        signal(&s.child, "-TERM");
        let st = wait_exit(&mut s.child, Duration::from_secs(30));
        assert!(st.success(), "{st}");
    }
}

fn repro(args: &[&str]) -> Vec<Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["repro", "--transport", "nixl", "--json"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: Value = serde_json::from_slice(&out.stdout).unwrap();
    serde_json::from_value(run["rows"].clone()).unwrap()
}

#[test]
fn the_harness_over_nixl_processes() {
    if runtime_or_skip("the_harness_over_nixl_processes").is_none() {
        return;
    }
    let rows = repro(&["--sessions", "3", "--turns", "2", "--configs", "pd-on"]);
    // Both models by default: DeepSeek-V3.2's and DeepSeek-V4's (every pool over NIXL).
    assert_eq!(rows.len(), 8);
    assert_eq!(rows[0]["model"], "tiny");
    assert_eq!(rows[4]["model"], "dsv4-tiny");
    assert!(rows[4]["config"]
        .as_str()
        .unwrap_or_default()
        .starts_with("dsv4-tiny/"));
    for r in &rows {
        assert_eq!(r["available"], true, "{r}");
        assert_eq!(r["pd"], "on", "{r}");
        assert!(
            r["note"]
                .as_str()
                .unwrap_or_default()
                .contains("two processes"),
            "{r}"
        );
        assert_eq!(r["sessions"], 3);
        for f in [
            "corrupted",
            "wedged",
            "leaked_pages",
            "quarantined_pages",
            "refused",
            "refused_frames",
        ] {
            assert_eq!(r[f], 0, "{f}: {r}");
        }
        assert!(r["ttft_p99_ms"].as_f64().unwrap() > 0.0, "{r}");
    }
    for (extra, verdict) in [(None, "caught"), (Some("--no-verify"), "reproduced")] {
        let mut args = vec![
            "--sessions",
            "3",
            "--turns",
            "2",
            "--configs",
            "bf16/host-on/pd-on",
            "--inject",
            "pd-fp8-frame",
            "--model",
            "tiny",
        ];
        args.extend(extra);
        let rows = repro(&args);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["verdict"], verdict, "{}", rows[0]);
        assert_eq!(rows[0]["leaked_pages"], 0, "{}", rows[0]);
    }
}
