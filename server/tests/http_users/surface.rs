//! The rest of what users expect: `/metrics` in the format `Accept` asks for, checked by
//! `promtool`; timeouts counted as timeouts; `/v1/models/{id}` and a served model name;
//! `/tokenize` and `/detokenize`; CORS; a malformed `Content-Length` answered in JSON.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use sparsekit_host::CpuBackend;
use sparsekit_server::engine::{Engine, EngineOptions, ModelConfig};
use sparsekit_server::http::{spawn, ServerConfig};
use sparsekit_server::metrics::{Metrics, RequestStatus};

use super::client::*;

/// `promtool check metrics` over `text`; `None` (after saying so) when promtool is not
/// installed, which `SPARSEKIT_REQUIRE_PROMTOOL=1` makes a failure.
fn promtool(text: &str) -> Option<(bool, String)> {
    let required = std::env::var("SPARSEKIT_REQUIRE_PROMTOOL").is_ok_and(|v| v == "1");
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        let msg =
            "promtool not found: install it with `apt-get install prometheus` (Debian/Ubuntu)";
        assert!(!required, "SPARSEKIT_REQUIRE_PROMTOOL=1 but {msg}");
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED metrics_pass_promtool (promtool check): {msg}"
        );
        return None;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success() && said.trim().is_empty(), said))
}

/// Issue 18: `/metrics` was OpenMetrics whatever `Accept` said, so text parsers read
/// counters as untyped and `promtool check metrics` failed ("no help text").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_accept_and_pass_promtool() {
    let (_engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    // Traffic, so that every kind of family has samples.
    for stream in [false, true] {
        let r = post(
            a,
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": stream}),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let _ = post(
        a,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    let text = get(a, "/metrics").await;
    assert_eq!(
        text.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let body = text.text();
    assert!(!body.contains("# EOF"));
    // Every family has HELP and TYPE, named as its samples are.
    for family in [
        "sparsekit_requests_total counter",
        "sparsekit_tokens_total counter",
        "sparsekit_ttft_seconds histogram",
        "sparsekit_e2e_request_latency_seconds histogram",
        "sparsekit_request_queue_time_seconds histogram",
        "sparsekit_tool_call_parse_failures_total counter",
        "sparsekit_pages gauge",
    ] {
        let name = family.split(' ').next().unwrap();
        assert!(
            body.contains(&format!("# TYPE {family}\n")),
            "{family}:\n{body}"
        );
        assert!(body.contains(&format!("# HELP {name} ")), "{name}");
    }
    let types = body.matches("# TYPE ").count();
    assert_eq!(types, body.matches("# HELP ").count());
    assert!(
        body.contains("sparsekit_e2e_request_latency_seconds_count 2"),
        "{body}"
    );
    assert!(
        body.contains("sparsekit_request_queue_time_seconds_count 2"),
        "{body}"
    );
    // The TTFT buckets reach the request timeout (600 s by default).
    assert!(
        body.contains("sparsekit_ttft_seconds_bucket{le=\"1048.576\"}"),
        "{body}"
    );
    // OpenMetrics when asked for.
    let om = get_with(
        a,
        "/metrics",
        &[(
            "Accept",
            "application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
        )],
    )
    .await;
    assert!(om
        .header("content-type")
        .is_some_and(|c| c.starts_with("application/openmetrics-text")));
    let om = om.text();
    assert!(om.ends_with("# EOF\n") && om.contains("# TYPE sparsekit_requests counter\n"));
    if let Some((ok, said)) = promtool(&body) {
        assert!(ok, "promtool check metrics:\n{said}\n{body}");
    }
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// A request that runs past the request timeout is counted as a timeout, not an abort,
/// whole or streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_are_labelled_as_timeouts() {
    let cfg = ServerConfig {
        request_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let (engine, server) = start(cfg).await;
    let a = server.addr;
    let long = json!({"model": "tiny", "prompt": "x", "max_tokens": 6000, "ignore_eos": true});
    let r = post(a, "/v1/completions", &long).await;
    assert_eq!(r.status, 504);
    assert_eq!(r.error().1, "timeout");
    let mut s = long.clone();
    s["stream"] = json!(true);
    let r = post(a, "/v1/completions", &s).await;
    assert!(r.text().contains("\"code\":\"timeout\""), "{}", r.text());
    let m = engine.metrics().clone();
    until("both are counted", || {
        m.requests_with(RequestStatus::Timeout) == 2
    })
    .await;
    assert_eq!(m.requests_with(RequestStatus::Aborted), 0);
    let text = get(a, "/metrics").await.text();
    assert!(text.contains("sparsekit_requests_total{role=\"both\",status=\"timeout\"} 2"));
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// A streaming client that stops reading (its socket's receive buffer full) does not keep
/// its request running past the request timeout: the server's sends wait at most until
/// the deadline, which expires the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_client_stops_reading_still_times_out() {
    let cfg = ServerConfig {
        request_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let (engine, server) = start(cfg).await;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(2048).unwrap();
    let mut conn = sock.connect(server.addr).await.unwrap();
    let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 8000,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, head.as_bytes())
        .await
        .unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut conn, body.as_bytes())
        .await
        .unwrap();
    // Never read. 8000 tokens take far longer than the 1 s timeout plus this bound.
    let m = engine.metrics().clone();
    let started = std::time::Instant::now();
    until("the unread stream is expired", || {
        m.requests_with(RequestStatus::Timeout) == 1
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    drop(conn);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_by_id_served_names_tokenize_and_detokenize() {
    let (_engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    let m = get(a, "/v1/models/tiny").await;
    assert_eq!(m.status, 200);
    assert_eq!(m.json()["id"], "tiny");
    assert_eq!(m.json()["object"], "model");
    let m = get(a, "/v1/models/gpt-9").await;
    assert_eq!(m.status, 404);
    assert_eq!(m.error().1, "model_not_found");
    let t = post(a, "/tokenize", &json!({"prompt": "AB"})).await.json();
    assert_eq!(t["tokens"], json!([256, 65, 66]));
    assert_eq!(t["count"], 3);
    assert_eq!(t["max_model_len"], 8192);
    let t = post(
        a,
        "/tokenize",
        &json!({"prompt": "AB", "add_special_tokens": false}),
    )
    .await;
    assert_eq!(t.json()["tokens"], json!([65, 66]));
    let t = post(
        a,
        "/tokenize",
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "A"}]}),
    )
    .await
    .json();
    assert_eq!(t["tokens"], json!([256, 259, 65, 257, 260]));
    let d = post(a, "/detokenize", &json!({"tokens": [256, 104, 105]}))
        .await
        .json();
    assert_eq!(d["prompt"], "hi");
    for (path, body, param) in [
        ("/detokenize", json!({"tokens": [99999]}), "tokens"),
        (
            "/tokenize",
            json!({"model": "gpt-9", "prompt": "x"}),
            "model",
        ),
        ("/tokenize", json!({}), "prompt"),
    ] {
        let r = post(a, path, &body).await;
        assert!(r.status == 400 || r.status == 404, "{path} {body}");
        assert_eq!(r.error().0, param);
    }
    server.shutdown(Duration::from_secs(5)).await.unwrap();

    // --served-model-name: the name clients use instead of the model's own.
    let cfg = ServerConfig {
        model_name: Some("deepseek-ai/DeepSeek-V3.2".into()),
        ..Default::default()
    };
    let (_engine, server) = start(cfg).await;
    let a = server.addr;
    let list = get(a, "/v1/models").await.json();
    assert_eq!(list["data"][0]["id"], "deepseek-ai/DeepSeek-V3.2");
    assert_eq!(list["data"][0]["root"], "tiny");
    assert_eq!(
        get(a, "/v1/models/deepseek-ai/DeepSeek-V3.2").await.status,
        200
    );
    let ok = json!({"model": "deepseek-ai/DeepSeek-V3.2", "prompt": "x", "max_tokens": 2});
    let r = post(a, "/v1/completions", &ok).await;
    assert_eq!(r.json()["model"], "deepseek-ai/DeepSeek-V3.2");
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "x"}),
    )
    .await;
    assert_eq!(r.status, 404);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_is_opt_in() {
    let (_engine, server) = start(ServerConfig::default()).await;
    let r = get_with(
        server.addr,
        "/v1/models",
        &[("Origin", "https://app.example")],
    )
    .await;
    assert_eq!(r.header("access-control-allow-origin"), None);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
    let cfg = ServerConfig {
        allowed_origins: vec!["https://app.example".into()],
        api_key: Some(sparsekit_server::http::auth::ApiKey::new("k").unwrap()),
        ..Default::default()
    };
    let (_engine, server) = start(cfg).await;
    let a = server.addr;
    // The preflight needs no key (browsers send none).
    let pre = raw(
        a,
        request(
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("Origin", "https://app.example"),
                ("Access-Control-Request-Method", "POST"),
                (
                    "Access-Control-Request-Headers",
                    "authorization, content-type",
                ),
            ],
            b"",
        ),
    )
    .await;
    assert_eq!(pre.status, 204);
    assert_eq!(
        pre.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    assert!(pre
        .header("access-control-allow-headers")
        .is_some_and(|h| h.contains("authorization")));
    let r = get_with(
        a,
        "/v1/models",
        &[
            ("Origin", "https://app.example"),
            ("Authorization", "Bearer k"),
        ],
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    assert_eq!(
        r.header("access-control-expose-headers"),
        Some("x-request-id")
    );
    // A completion posted from a page of `origin`, with the key.
    let post_from_page = |origin: &'static str| async move {
        let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 2});
        let headers = [("Origin", origin), ("Authorization", "Bearer k")];
        post_with(a, "/v1/completions", &headers, &body).await
    };
    // An allowed origin's POST is served.
    let r = post_from_page("https://app.example").await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Another origin: no CORS headers (the browser refuses), no preflight, no POST.
    let r = get_with(a, "/health", &[("Origin", "https://evil.example")]).await;
    assert_eq!(r.header("access-control-allow-origin"), None);
    let pre = raw(
        a,
        request(
            "OPTIONS",
            "/v1/models",
            &[("Origin", "https://evil.example")],
            b"",
        ),
    )
    .await;
    assert_eq!(pre.status, 403);
    let r = post_from_page("https://evil.example").await;
    assert_eq!(r.status, 403, "{}", r.text());
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// A body that is not declared JSON is a 415 on every JSON route, before anything runs;
/// JSON (parameters allowed, `+json` types) and no `Content-Type` at all are served. A POST
/// from a browser page of another origin (its `Origin`, sent with every cross-origin POST,
/// a `no-cors` one without a `Content-Type` included) is a 403: a page the user visits
/// cannot generate or abort on a server without an API key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_not_declared_json_is_a_415() {
    let (engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    let body = br#"{"model": "tiny", "prompt": "x", "max_tokens": 2}"#;
    let abort = br#"{"rid": "job-1"}"#;
    let gen = br#"{"text": "x", "sampling_params": {"max_new_tokens": 2}}"#;
    // A POST with exactly `headers` (no Content-Type unless given).
    let send = |path: &'static str, headers: &[(&str, &str)], b: &'static [u8]| {
        let mut r = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
            b.len()
        );
        for (k, v) in headers {
            r.push_str(&format!("{k}: {v}\r\n"));
        }
        r.push_str("\r\n");
        let mut r = r.into_bytes();
        r.extend_from_slice(b);
        raw(a, r)
    };
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "text/json",
    ] {
        for (path, b) in [
            ("/v1/completions", &body[..]),
            ("/v1/chat/completions", &body[..]),
            ("/generate", &gen[..]),
            ("/abort_request", &abort[..]),
            ("/tokenize", &body[..]),
            ("/detokenize", &br#"{"tokens": [65]}"#[..]),
        ] {
            let r = send(path, &[("Content-Type", ct)], b).await;
            assert_eq!(r.status, 415, "{path} {ct}: {}", r.text());
            assert_eq!(r.error().0, "content-type", "{path} {ct}");
        }
    }
    assert_eq!(
        engine.metrics().requests_with(RequestStatus::Ok),
        0,
        "nothing ran"
    );
    for ct in [
        None,
        Some("application/json"),
        Some("Application/JSON; charset=utf-8"),
        Some("application/vnd.api+json"),
    ] {
        let ct: Vec<_> = ct.map(|v| ("Content-Type", v)).into_iter().collect();
        let r = send("/v1/completions", &ct, &body[..]).await;
        assert_eq!(r.status, 200, "{ct:?}: {}", r.text());
    }
    // A browser page's POST: refused whatever its body type (CORS is off here).
    for (path, b) in [("/generate", &gen[..]), ("/abort_request", &abort[..])] {
        let r = send(path, &[("Origin", "https://evil.example")], b).await;
        assert_eq!(r.status, 403, "{path}: {}", r.text());
    }
    assert_eq!(engine.metrics().requests_with(RequestStatus::Ok), 4);
    // A GET from a page is answered (the browser keeps the answer from it).
    let r = get_with(a, "/health", &[("Origin", "https://evil.example")]).await;
    assert_eq!(r.status, 200);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// `HEAD /health` (a load balancer's probe) answers as `GET` does, without a body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_health_answers_without_a_body() {
    let (_engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    for path in ["/health", "/health_generate"] {
        let r = raw(a, request("HEAD", path, &[], b"")).await;
        assert_eq!(r.status, 200, "{path}");
        assert!(r.body.is_empty(), "{path}: {:?}", r.text());
    }
    let r = raw(a, request("HEAD", "/v1/models", &[], b"")).await;
    assert_eq!(r.status, 405);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// Issue 18: `Content-Length: abc` got hyper's empty 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_content_length_gets_a_json_400() {
    let (engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    for bad in ["abc", "-5", "1, 2", "12abc"] {
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {bad}\r\n\r\n{{\"model\": \"tiny\", \"prompt\": \"x\"}}"
        );
        let r = raw(a, req.into_bytes()).await;
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.error().0, "content-length");
        assert_eq!(r.header("connection"), Some("close"));
    }
    // Keep-alive requests before it are framed right: a valid request, then a bad one,
    // on one connection.
    let good = r#"{"model": "tiny", "prompt": "x", "max_tokens": 2}"#;
    let pipelined = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{good}\
         POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n",
        good.len()
    );
    let mut s = tokio::net::TcpStream::connect(a).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(pipelined.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(LIMIT, s.read_to_end(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let all = String::from_utf8_lossy(&buf);
    assert_eq!(all.matches("HTTP/1.1 200").count(), 1, "{all}");
    assert_eq!(all.matches("HTTP/1.1 400").count(), 1, "{all}");
    assert!(all.contains("invalid Content-Length"), "{all}");
    assert!(engine.is_healthy());
    assert_eq!(get(a, "/health").await.status, 200);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// The latency histograms' buckets follow the request timeout they are made for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_buckets_reach_a_longer_request_timeout() {
    let engine = Arc::new(
        Engine::start(
            Arc::new(CpuBackend::new()),
            ModelConfig::TINY,
            EngineOptions {
                kv_pages: 256,
                ..Default::default()
            },
            Arc::new(Metrics::with_latency_limit(
                "both",
                Duration::from_secs(3600),
            )),
        )
        .unwrap(),
    );
    let server = spawn(
        engine,
        "127.0.0.1:0".parse().unwrap(),
        ServerConfig::default(),
    )
    .await
    .unwrap();
    let text = get(server.addr, "/metrics").await.text();
    assert!(
        text.contains("sparsekit_ttft_seconds_bucket{le=\"4194.304\"}"),
        "{text}"
    );
    assert!(text.contains("sparsekit_e2e_request_latency_seconds_bucket{le=\"4194.304\"}"));
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}
