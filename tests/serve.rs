//! `sparsekit serve` as a process: the official `openai` Python client against it
//! (streaming and not, tools, the API key from `SPARSEKIT_API_KEY`), graceful shutdown on
//! SIGTERM and SIGINT with a request in flight, what it says at start (the model loaded,
//! every injection in `--help`, a port in use named), and both sides of `--pd on` on
//! `/metrics`.
//!
//! The Python test needs the `openai` package (`server/python/requirements.txt`, which
//! `.ci/run` installs). Without it the test says so and passes locally; with
//! `SPARSEKIT_REQUIRE_PYTHON=1` (set by `.ci/run`) it fails.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;

use common::{get, post, signal, wait_exit, Server};

fn start(extra: &[&str]) -> Server {
    start_env(extra, &[])
}

fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
    let args = [&["--port", "0", "--kv-pages", "1024"][..], extra].concat();
    common::serve(&args, env)
}

/// The reply of the tools server of the openai client check.
const SCRIPTED_CALL: &str = "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
<｜DSML｜parameter name=\"city\" string=\"true\">Hangzhou</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n</｜DSML｜function_calls>";

#[test]
fn openai_python_client_streaming_and_not() {
    let required = std::env::var("SPARSEKIT_REQUIRE_PYTHON").is_ok_and(|v| v == "1");
    let probe = Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        assert!(
            !required,
            "SPARSEKIT_REQUIRE_PYTHON=1 but the openai package is missing: \
             pip install -r server/python/requirements.txt"
        );
        let _ = writeln!(std::io::stderr(), "SKIPPED: python3 with the openai package not found (pip install -r server/python/requirements.txt)");
        return;
    }
    let key = "sk-first-hour";
    let server = start_env(&[], &[("SPARSEKIT_API_KEY", key)]);
    let reply = std::env::temp_dir().join(format!("sparsekit-scripted-{}.txt", std::process::id()));
    std::fs::write(&reply, SCRIPTED_CALL).unwrap();
    let tools = start_env(
        &["--scripted-reply", reply.to_str().unwrap()],
        &[("SPARSEKIT_API_KEY", key)],
    );
    assert!(
        tools.log.iter().any(|l| l.contains("replies are scripted")),
        "{:?}",
        tools.log
    );
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/server/python/openai_client_check.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(format!("http://{}", server.addr))
        .arg(format!("http://{}", tools.addr))
        .arg(key)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&reply);
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "openai client check failed:\n{so}\n{se}"
    );
    assert!(so.contains("all checks passed"), "{so}");
}

#[test]
fn sigterm_and_sigint_drain_then_exit_zero() {
    for sig in ["-TERM", "-INT"] {
        let mut server = start(&["--shutdown-grace-s", "1"]);
        let addr = server.addr.clone();
        // A streamed request that cannot finish within the grace period: wait for its first
        // bytes so it is in flight when the signal lands.
        let body =
            r#"{"model":"tiny","prompt":"x","max_tokens":7000,"ignore_eos":true,"stream":true}"#;
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut first = [0u8; 256];
        assert!(s.read(&mut first).unwrap() > 0);
        // A short one still completes.
        let (st, _) = post(
            &addr,
            "/v1/completions",
            r#"{"model":"tiny","prompt":"y","max_tokens":2}"#,
        );
        assert_eq!(st, 200);
        signal(&server.child, sig);
        let mut rest = String::new();
        s.read_to_string(&mut rest).unwrap();
        assert!(
            rest.contains("\"finish_reason\":\"abort\""),
            "{sig}: {rest}"
        );
        assert!(rest.contains("data: [DONE]"), "{sig}: {rest}");
        let status = wait_exit(&mut server.child, Duration::from_secs(30));
        assert!(status.success(), "{sig}: exit status {status}");
        assert!(TcpStream::connect(&addr).is_err(), "{sig}: still accepting");
    }
}

#[test]
fn pd_flags_are_refused_clearly() {
    for (args, says) in [
        (&["--role", "decode"][..], "needs --transport nixl"),
        (&["--role", "prefill"], "needs --transport nixl"),
        (
            &["--peer", "http://127.0.0.1:1"],
            "--peer is for --role decode",
        ),
        (&["--transport", "nixl"], "joins two processes"),
        (&["--role", "decode", "--transport", "nixl"], "needs --peer"),
        (
            &[
                "--role",
                "prefill",
                "--transport",
                "nixl",
                "--peer",
                "http://x:1",
            ],
            "--peer is for --role decode",
        ),
        (
            &[
                "--role",
                "decode",
                "--transport",
                "nixl",
                "--peer",
                "http://x:1",
                "--host-tier",
                "on",
            ],
            "prefill's",
        ),
        (
            &[
                "--role",
                "prefill",
                "--transport",
                "nixl",
                "--inject",
                "stale-transfer-write",
            ],
            "one process",
        ),
        (
            &["--role", "prefill", "--transport", "nixl", "--pd", "on"],
            "--pd on is for --role both",
        ),
        (&["--role", "router"], "unknown role"),
        (&["--transport", "carrier-pigeon"], "unknown transport"),
        (&["--inject", "pd-fp8-frame"], "needs PD"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
            .arg("serve")
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// `--pd on`: requests go to a decode engine whose prompt pages a prefill engine in the
/// same process computes and pushes over the local transport; the output is bit-identical
/// to a server without PD, and `/metrics` counts the bytes of both kinds that crossed.
#[test]
fn serve_with_an_in_process_prefill_decode_pair() {
    let plain = start(&["--index-k", "bf16", "--prefix-cache", "off"]);
    let pd = start(&["--index-k", "bf16", "--pd", "on", "--host-tier", "on"]);
    let prompt: Vec<u32> = (0..150).map(|i| (i * 13 % 256) as u32).collect();
    let body = serde_json::json!({
        "input_ids": prompt, "return_logits_digest": true,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0}
    })
    .to_string();
    let (s1, a) = post(&plain.addr, "/generate", &body);
    let (s2, b) = post(&pd.addr, "/generate", &body);
    assert_eq!((s1, s2), (200, 200), "{a}\n{b}");
    let field = |r: &str, f: &str| r.split(f).nth(1).map(|x| x[..60.min(x.len())].to_string());
    assert_eq!(
        field(&a, "\"logits_digests\":"),
        field(&b, "\"logits_digests\":")
    );
    assert_eq!(field(&a, "\"output_ids\":"), field(&b, "\"output_ids\":"));
    // The PD counters reach /metrics through a publisher that runs every 20 ms: look
    // again (bounded) until they are there.
    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let (_, m) = get(&pd.addr, "/metrics");
        if m.contains("sparsekit_transfer_bytes_total{kind=\"index_k\",role=\"decode\"}")
            || Instant::now() > deadline
        {
            break m;
        }
        std::thread::yield_now();
    };
    let value = |series: &str| -> f64 {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(series))
            .unwrap_or_else(|| panic!("no {series}: {metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    for kind in ["kv", "index_k"] {
        let n = value(&format!(
            "sparsekit_transfer_bytes_total{{kind=\"{kind}\",role=\"decode\"}}"
        ));
        assert!(n > 0.0, "{kind}");
    }
    assert!(metrics.contains("sparsekit_quarantined_pages{pool=\"pd\",role=\"decode\"} 0"));
    // Issue 18: --pd on served decode's registry only; prefill's prefix cache and host
    // tier were invisible, and the start line said "no host tier".
    assert!(value("sparsekit_cache_lookups_total{role=\"prefill\"}") > 0.0);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sparsekit_pages{pool=\"host\",")
                && l.contains("role=\"prefill\""))
    );
    assert!(metrics.contains("sparsekit_requests_total{role=\"prefill\",status=\"ok\"}"));
    assert!(metrics.contains("sparsekit_requests_total{role=\"decode\",status=\"ok\"}"));
    assert_eq!(metrics.matches("# TYPE sparsekit_pages gauge").count(), 1);
    let note = pd
        .log
        .iter()
        .find(|l| l.contains("pair in this process"))
        .unwrap();
    assert!(
        note.contains("prefill 1024 device pages, prefix cache, host tier 4096 pages"),
        "{note}"
    );
    let (_, info) = get(&pd.addr, "/server_info");
    let info: serde_json::Value = serde_json::from_str(common::body(&info)).unwrap();
    assert_eq!(
        info["pd"]["sides"]["prefill"]["cache"]["host_pages"], 4096,
        "{info}"
    );
}

#[test]
fn start_up_says_what_it_does() {
    // A log line once the model has loaded (dsv32 takes a while), before the address.
    let server = start(&[]);
    assert!(
        server
            .log
            .iter()
            .any(|l| l.contains("model tiny loaded in")),
        "{:?}",
        server.log
    );
    // A port in use is an error naming the address, before any model loads.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["serve", "--port", &port])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cannot listen on 127.0.0.1:{port}")) && err.contains("in use"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("loaded"));
    // --help lists every injection.
    let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for i in sparsekit_server::harness::config::Injection::ALL {
        assert!(help.contains(i.name()), "{} missing from\n{help}", i.name());
    }
    for flag in [
        "--scripted-reply",
        "--api-key",
        "SPARSEKIT_API_KEY",
        "--allowed-origins",
        "--served-model-name",
        "--tool-call-parser",
        "--max-connections-per-client",
    ] {
        assert!(help.contains(flag), "{flag} missing from\n{help}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["serve", "--inject", "no-such-bug"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("stale-transfer-write"));
}

/// `--host-tier on` serves with the prefix cache and a host tier of `--host-pages`;
/// `/server_info` says so, `/metrics` carries the cache series, and a repeated prompt is
/// served from the cache bit-identically.
#[test]
fn serve_with_the_host_tier() {
    let server = start(&[
        "--host-tier",
        "on",
        "--host-pages",
        "256",
        "--index-k",
        "bf16",
    ]);
    let (status, info) = get(&server.addr, "/server_info");
    assert_eq!(status, 200, "{info}");
    assert!(info.contains("\"host_pages\":256"), "{info}");
    assert!(info.contains("\"index_k_dtype\":\"bf16\""), "{info}");
    let prompt: Vec<u32> = (0..100).map(|i| (i * 7 % 256) as u32).collect();
    let body = serde_json::json!({
        "input_ids": prompt, "return_logits_digest": true,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}
    })
    .to_string();
    let (s1, a) = post(&server.addr, "/generate", &body);
    let (s2, b) = post(&server.addr, "/generate", &body);
    assert_eq!((s1, s2), (200, 200));
    let digests = |r: &str| {
        r.split("\"logits_digests\":")
            .nth(1)
            .map(|x| x[..80].to_string())
    };
    assert_eq!(
        digests(&a),
        digests(&b),
        "served from the cache, bit-identically"
    );
    let (_, metrics) = get(&server.addr, "/metrics");
    assert!(
        metrics.contains("sparsekit_cache_hits_total{tier=\"device\"} 6"),
        "{metrics}"
    );
    assert!(metrics.contains("sparsekit_pages{pool=\"host\",state=\"cached\"}"));
    assert!(metrics.contains("sparsekit_backups_total{status=\"ok\"}"));
}
