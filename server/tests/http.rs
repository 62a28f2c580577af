//! The HTTP server against a real socket: the OpenAI and SGLang endpoints (streaming and
//! not), every kind of bad input answered with a JSON 4xx in OpenAI's shape while the
//! server stays healthy, client disconnects aborting their requests, `/abort_request`,
//! metrics, and graceful shutdown.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use sparsekit_host::CpuBackend;
use sparsekit_server::engine::{Engine, EngineOptions, ModelConfig};
use sparsekit_server::http::{spawn, ServerConfig, ServerHandle};
use sparsekit_server::metrics::{Metrics, RequestStatus};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMIT: Duration = Duration::from_secs(60);

async fn start(cfg: ServerConfig) -> (Arc<Engine>, ServerHandle) {
    let engine = Arc::new(
        Engine::start(
            Arc::new(CpuBackend::new()),
            ModelConfig::TINY,
            EngineOptions {
                kv_pages: 1024,
                ..Default::default()
            },
            Arc::new(Metrics::new("both")),
        )
        .unwrap(),
    );
    let server = spawn(engine.clone(), "127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    (engine, server)
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// `data:` payloads of an SSE body.
    fn events(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.body)
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: ").map(str::to_string))
            .collect()
    }
}

fn dechunk(b: &[u8]) -> Vec<u8> {
    sparsekit_server::harness::run::dechunk(b).expect("well-formed chunked body")
}

/// One raw HTTP/1.1 exchange (`Connection: close`).
async fn raw(addr: SocketAddr, request: Vec<u8>) -> Reply {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&request).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(LIMIT, s.read_to_end(&mut buf))
        .await
        .expect("response within the limit")
        .unwrap();
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("headers");
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = buf[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    Reply {
        status,
        headers,
        body,
    }
}

fn request(method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

async fn post(addr: SocketAddr, path: &str, v: &Value) -> Reply {
    raw(addr, request("POST", path, v.to_string().as_bytes())).await
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    raw(addr, request("GET", path, b"")).await
}

fn assert_openai_error(r: &Reply, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_answer_and_agree() {
    let (engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    let h = get(a, "/health").await;
    assert_eq!(h.status, 200);
    let m = get(a, "/v1/models").await.json();
    assert_eq!(m["data"][0]["id"], "tiny");
    assert_eq!(m["data"][0]["max_model_len"], 8192);

    // /v1/completions, greedy.
    let body = json!({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12,
                      "temperature": 0, "ignore_eos": true});
    let c = post(a, "/v1/completions", &body).await;
    assert_eq!(c.status, 200, "{}", String::from_utf8_lossy(&c.body));
    let c = c.json();
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["usage"]["completion_tokens"], 12);
    assert_eq!(c["usage"]["prompt_tokens"], 20);
    assert_eq!(c["choices"][0]["finish_reason"], "length");
    let text = c["choices"][0]["text"].as_str().unwrap().to_string();

    // The same request streamed gives the same text.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let s = post(a, "/v1/completions", &sb).await;
    assert_eq!(s.status, 200);
    assert_eq!(s.header("content-type"), Some("text/event-stream"));
    let ev = s.events();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 12);

    // /generate with the same prompt and greedy sampling agrees, and returns digests.
    let g = post(
        a,
        "/generate",
        &json!({"text": "The quick brown fox", "rid": "g1", "return_logits_digest": true,
                "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}}),
    )
    .await
    .json();
    assert_eq!(g["text"], text);
    assert_eq!(g["meta_info"]["id"], "g1");
    assert_eq!(g["meta_info"]["finish_reason"]["type"], "length");
    assert_eq!(
        g["meta_info"]["logits_digests"].as_array().unwrap().len(),
        12
    );
    assert_eq!(g["output_ids"].as_array().unwrap().len(), 12);

    // Chat, streamed and not, agree.
    let chat = json!({"model": "tiny", "temperature": 0, "max_tokens": 10, "ignore_eos": true,
                      "messages": [{"role": "system", "content": "You are terse."},
                                   {"role": "user", "content": "hi"}]});
    let c = post(a, "/v1/chat/completions", &chat).await.json();
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    let content = c["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let mut sc = chat.clone();
    sc["stream"] = json!(true);
    let s = post(a, "/v1/chat/completions", &sc).await;
    let ev = s.events();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content);

    // Metrics carry SERVING.md's names.
    let m = get(a, "/metrics").await;
    assert_eq!(m.status, 200);
    let text = String::from_utf8_lossy(&m.body).into_owned();
    for name in [
        "sparsekit_requests_total{role=\"both\",status=\"ok\"} 5",
        "sparsekit_tokens_total{kind=\"generated\"}",
        "sparsekit_ttft_seconds_count",
        "sparsekit_itl_seconds_bucket",
        "sparsekit_pages{pool=\"device\",state=\"free\"}",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
    server.shutdown(Duration::from_secs(5)).await.unwrap();
    assert!(!engine.is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_json_4xx_and_the_server_stays_healthy() {
    let (engine, server) = start(ServerConfig {
        max_body_bytes: 64 << 10,
        ..Default::default()
    })
    .await;
    let a = server.addr;
    // Malformed JSON.
    let r = raw(
        a,
        request(
            "POST",
            "/v1/completions",
            b"{\"model\": \"tiny\", \"prompt\": ",
        ),
    )
    .await;
    let v = assert_openai_error(&r, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("parse"));
    // Wrong types name the field.
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "x", "max_tokens": "ten"}),
    )
    .await;
    assert_eq!(assert_openai_error(&r, 400)["error"]["param"], "max_tokens");
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": "hello"}),
    )
    .await;
    assert_eq!(assert_openai_error(&r, 400)["error"]["param"], "messages");
    let r = post(
        a,
        "/generate",
        &json!({"text": "x", "sampling_params": {"temperature": "hot"}}),
    )
    .await;
    assert_openai_error(&r, 400);
    let r = post(a, "/generate", &json!({"input_ids": [1, 2, 99999]})).await;
    assert_openai_error(&r, 400);
    // Missing model, unknown model.
    let r = post(a, "/v1/completions", &json!({"prompt": "x"})).await;
    assert_openai_error(&r, 400);
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "gpt-5", "prompt": "x"}),
    )
    .await;
    let v = assert_openai_error(&r, 404);
    assert_eq!(v["error"]["code"], "model_not_found");
    // Prompt over the context limit (8192), and prompt + max_tokens over it.
    let long = "a".repeat(9000);
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": long}),
    )
    .await;
    assert_eq!(
        assert_openai_error(&r, 400)["error"]["code"],
        "context_length_exceeded"
    );
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "x", "max_tokens": 9000}),
    )
    .await;
    assert_eq!(
        assert_openai_error(&r, 400)["error"]["code"],
        "context_length_exceeded"
    );
    // Oversized body: by content-length, and by count when the body is chunked.
    let big = vec![b' '; 70 << 10];
    let r = raw(a, request("POST", "/v1/completions", &big)).await;
    assert_eq!(
        assert_openai_error(&r, 413)["error"]["code"],
        "request_too_large"
    );
    let mut chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..20 {
        chunked.extend_from_slice(format!("{:x}\r\n", 8192).as_bytes());
        chunked.extend_from_slice(&[b' '; 8192]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let r = raw(a, chunked).await;
    assert_openai_error(&r, 413);
    // Unsupported options, wrong method, unknown route, empty messages, bad role.
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "x", "n": 3}),
    )
    .await;
    assert_eq!(assert_openai_error(&r, 400)["error"]["param"], "n");
    let r = get(a, "/v1/completions").await;
    assert_openai_error(&r, 405);
    let r = get(a, "/nope").await;
    assert_openai_error(&r, 404);
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": []}),
    )
    .await;
    assert_openai_error(&r, 400);
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": [{"role": "bot", "content": "x"}]}),
    )
    .await;
    assert_openai_error(&r, 400);
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "x", "temperature": -2}),
    )
    .await;
    assert_openai_error(&r, 400);
    let r = post(a, "/abort_request", &json!({"id": 3})).await;
    assert_openai_error(&r, 400);
    // A JSON body that is not an object.
    let r = raw(a, request("POST", "/generate", b"[1,2,3]")).await;
    assert_openai_error(&r, 400);
    // Still healthy, still serving, nothing held.
    assert_eq!(get(a, "/health").await.status, 200);
    let ok = post(
        a,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "x", "max_tokens": 2}),
    )
    .await;
    assert_eq!(ok.status, 200);
    let st = engine.stats();
    assert_eq!(st.free_pages, st.capacity_pages);
    // Each refused generation-endpoint request is counted once (HTTP or engine); the
    // malformed /abort_request is not a generation request.
    assert_eq!(engine.metrics().requests_with(RequestStatus::Rejected), 16);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// Waits (bounded) until the engine has counted `n` aborted requests.
async fn aborted_reaches(engine: &Engine, n: u64) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while engine.metrics().requests_with(RequestStatus::Aborted) < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "request was not aborted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_aborts_its_request() {
    let (engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    let long = json!({"model": "tiny", "prompt": "x", "max_tokens": 6000, "ignore_eos": true});
    // Non-streaming: send, wait for the engine to start, hang up.
    let mut s = TcpStream::connect(a).await.unwrap();
    s.write_all(&request(
        "POST",
        "/v1/completions",
        long.to_string().as_bytes(),
    ))
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + LIMIT;
    while engine.stats().running == 0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(s);
    aborted_reaches(&engine, 1).await;
    // Streaming: read the first event, hang up.
    let mut sl = long.clone();
    sl["stream"] = json!(true);
    let mut s = TcpStream::connect(a).await.unwrap();
    s.write_all(&request(
        "POST",
        "/v1/completions",
        sl.to_string().as_bytes(),
    ))
    .await
    .unwrap();
    let mut buf = [0u8; 512];
    let n = tokio::time::timeout(LIMIT, s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(n > 0);
    drop(s);
    aborted_reaches(&engine, 2).await;
    let st = engine.stats();
    assert_eq!(st.running, 0);
    assert_eq!(get(a, "/health").await.status, 200);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
    let st = engine.stats();
    assert_eq!(st.free_pages, st.capacity_pages);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_request_ends_a_stream() {
    let (engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    let body = json!({"text": "x", "rid": "to-abort", "stream": true,
                      "sampling_params": {"max_new_tokens": 6000, "ignore_eos": true}});
    let stream = tokio::spawn(async move { post(a, "/generate", &body).await });
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let r = post(a, "/abort_request", &json!({"rid": "to-abort"}))
            .await
            .json();
        if r["aborted"] == true {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never saw the request"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = tokio::time::timeout(LIMIT, stream).await.unwrap().unwrap();
    let ev = r.events();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "abort");
    assert!(last["meta_info"]["completion_tokens"].as_u64().unwrap() < 6000);
    assert_eq!(engine.metrics().requests_with(RequestStatus::Aborted), 1);
    let r = post(a, "/abort_request", &json!({"rid": "to-abort"}))
        .await
        .json();
    assert_eq!(r["aborted"], false);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_or_aborts_in_flight_requests() {
    let (engine, server) = start(ServerConfig {
        shutdown_grace: Duration::from_millis(300),
        ..Default::default()
    })
    .await;
    let a = server.addr;
    let long = json!({"model": "tiny", "prompt": "x", "max_tokens": 6000, "ignore_eos": true});
    let short = json!({"model": "tiny", "prompt": "y", "max_tokens": 3, "ignore_eos": true});
    let l = tokio::spawn(async move { post(a, "/v1/completions", &long).await });
    let s = tokio::spawn(async move { post(a, "/v1/completions", &short).await });
    // Both requests in the engine (the short one perhaps already done) before the shutdown
    // starts: a connection the listener had not accepted yet would be reset, and that is
    // not what this test checks.
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let st = engine.stats();
        let done = engine.metrics().requests_with(RequestStatus::Ok);
        if (st.running + st.waiting) as u64 + done >= 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "both requests in the engine"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.shutdown(Duration::from_millis(300)).await.unwrap();
    let l = l.await.unwrap().json();
    assert_eq!(l["choices"][0]["finish_reason"], "abort");
    let s = s.await.unwrap().json();
    assert_eq!(s["choices"][0]["finish_reason"], "length");
    let st = engine.stats();
    assert_eq!(st.free_pages, st.capacity_pages);
    // The port no longer accepts.
    assert!(TcpStream::connect(a).await.is_err());
}

/// A body that stops arriving gets a JSON 408 once `body_timeout` passed (the connection
/// does not hold a task forever), and the server stays healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_gets_408() {
    let (engine, server) = start(ServerConfig {
        body_timeout: Duration::from_millis(300),
        ..Default::default()
    })
    .await;
    let a = server.addr;
    let started = std::time::Instant::now();
    let r = raw(
        a,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{\"model\": \"ti"
            .to_vec(),
    )
    .await;
    assert_eq!(r.status, 408, "{}", r.json());
    assert_eq!(r.json()["error"]["code"], "request_timeout", "{}", r.json());
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(engine.is_healthy());
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}
