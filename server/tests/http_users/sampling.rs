//! Seeds and sampling options: an unseeded request draws a fresh seed and reports it (the
//! reply can be replayed), a seeded one is bit-reproducible; each supported option changes
//! what is generated, each unsupported one is a 400 naming it, each malformed one a 400.

use std::time::Duration;

use serde_json::{json, Value};
use sparsekit_server::engine::json_object::JsonObjectState;
use sparsekit_server::http::ServerConfig;

use super::client::*;

/// Issue 18: three calls at temperature 1 without a seed gave the same text (seed 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unseeded_requests_draw_fresh_seeds_and_report_them() {
    let (_engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    let body = json!({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24,
                      "temperature": 1.0, "ignore_eos": true});
    let mut texts = Vec::new();
    let mut seeds = Vec::new();
    for _ in 0..3 {
        let r = post(a, "/v1/completions", &body).await.json();
        texts.push(r["choices"][0]["text"].as_str().unwrap().to_string());
        seeds.push(r["seed"].as_u64().expect("the seed is reported"));
    }
    assert!(
        texts[0] != texts[1] || texts[1] != texts[2],
        "three unseeded calls gave the same text: {texts:?}"
    );
    assert!(seeds[0] != seeds[1] && seeds[1] != seeds[2], "{seeds:?}");
    // Replaying with a reported seed gives that reply again, bit for bit.
    for (seed, text) in seeds.iter().zip(&texts) {
        let mut replay = body.clone();
        replay["seed"] = json!(seed);
        let r = post(a, "/v1/completions", &replay).await.json();
        assert_eq!(r["choices"][0]["text"], json!(text));
        assert_eq!(r["seed"], json!(seed));
    }
    // Chat and /generate report theirs too, streamed or not.
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 8, "seed": 99, "stream": true});
    let s = post(a, "/v1/chat/completions", &chat).await;
    assert!(s
        .events()
        .iter()
        .all(|e| e.get("usage").is_some() || e["seed"] == 99));
    let g = post(
        a,
        "/generate",
        &json!({"text": "x", "sampling_params": {"max_new_tokens": 4}}),
    )
    .await
    .json();
    assert!(g["meta_info"]["seed"].as_u64().is_some(), "{g}");
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

async fn complete(a: std::net::SocketAddr, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "prompt": "The quick brown fox", "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = post(a, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

fn text(r: &Value) -> String {
    r["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Issue 18: `response_format`, `logit_bias`, `min_tokens`, penalties, `suffix`… all got
/// 200 with unconstrained text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supported_options_are_honoured() {
    let (_engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    // logit_bias: +100 on "A" makes it the greedy choice every time.
    let r = complete(a, json!({"max_tokens": 12, "logit_bias": {"65": 100}})).await;
    assert_eq!(text(&r), "A".repeat(12));
    // frequency_penalty wears that off: each "A" costs 2.
    let r = complete(
        a,
        json!({"max_tokens": 120, "logit_bias": {"65": 100}, "frequency_penalty": 2.0,
               "ignore_eos": true}),
    )
    .await;
    let t = text(&r);
    assert!(t.starts_with("AAAA") && t.bytes().any(|b| b != b'A'), "{t}");
    // presence_penalty is paid once: the bias still wins.
    let r = complete(
        a,
        json!({"max_tokens": 12, "logit_bias": {"65": 100}, "presence_penalty": 2.0}),
    )
    .await;
    assert_eq!(text(&r), "A".repeat(12));
    // End of turn biased up: the reply ends at once — unless min_tokens holds it back.
    let r = complete(a, json!({"max_tokens": 20, "logit_bias": {"257": 100}})).await;
    assert_eq!(r["usage"]["completion_tokens"], 1);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let r = complete(
        a,
        json!({"max_tokens": 20, "logit_bias": {"257": 100}, "min_tokens": 5}),
    )
    .await;
    assert_eq!(r["usage"]["completion_tokens"], 6, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // stop_token_ids ends on the biased token, which min_tokens holds back for 3 tokens.
    let r = complete(
        a,
        json!({"max_tokens": 20, "logit_bias": {"65": 100}, "stop_token_ids": [65]}),
    )
    .await;
    assert_eq!(
        (text(&r), r["usage"]["completion_tokens"].clone()),
        (String::new(), json!(1))
    );
    let r = complete(
        a,
        json!({"max_tokens": 20, "logit_bias": {"65": 100}, "stop_token_ids": [65], "min_tokens": 3}),
    )
    .await;
    assert_eq!(r["usage"]["completion_tokens"], 4, "{r}");
    assert!(!text(&r).contains('A'), "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // repetition_penalty changes what a greedy reply repeats.
    let plain = complete(a, json!({"max_tokens": 40, "ignore_eos": true})).await;
    let penalised = complete(
        a,
        json!({"max_tokens": 40, "ignore_eos": true, "repetition_penalty": 3.0}),
    )
    .await;
    assert_ne!(text(&plain), text(&penalised));
    // response_format json_object: a JSON object, or a prefix of one when cut short.
    for seed in 0..3 {
        let r = post(
            a,
            "/v1/chat/completions",
            &json!({"model": "tiny", "messages": [{"role": "user", "content": "JSON please"}],
                    "max_tokens": 64, "temperature": 1, "seed": seed,
                    "response_format": {"type": "json_object"}}),
        )
        .await
        .json();
        let content = r["choices"][0]["message"]["content"].as_str().unwrap();
        let mut j = JsonObjectState::new();
        assert!(
            content.bytes().all(|b| j.push(b)),
            "not a JSON object prefix: {content:?}"
        );
        match r["choices"][0]["finish_reason"].as_str() {
            Some("stop") => {
                assert!(j.is_complete());
                assert!(serde_json::from_str::<Value>(content).is_ok_and(|v| v.is_object()));
            }
            Some("length") => assert!(!j.is_complete()),
            other => panic!("finish {other:?}"),
        }
    }
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_and_malformed_options_are_400s_naming_the_parameter() {
    let (engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    let cases = [
        ("/v1/completions", json!({"suffix": "tail"}), "suffix"),
        ("/v1/completions", json!({"n": 2}), "n"),
        ("/v1/completions", json!({"best_of": 2}), "best_of"),
        ("/v1/completions", json!({"echo": true}), "echo"),
        ("/v1/completions", json!({"logprobs": 1}), "logprobs"),
        ("/v1/completions", json!({"min_p": 0.05}), "min_p"),
        (
            "/v1/completions",
            json!({"logit_bias": {"A": 1}}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"logit_bias": {"65": 500}}),
            "logit_bias",
        ),
        ("/v1/completions", json!({"logit_bias": [1]}), "logit_bias"),
        (
            "/v1/completions",
            json!({"min_tokens": 9, "max_tokens": 3}),
            "min_tokens",
        ),
        ("/v1/completions", json!({"min_tokens": -1}), "min_tokens"),
        (
            "/v1/completions",
            json!({"repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (
            "/v1/completions",
            json!({"frequency_penalty": 9}),
            "frequency_penalty",
        ),
        (
            "/v1/completions",
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            "/v1/completions",
            json!({"response_format": "json"}),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            json!({"functions": [{"name": "f"}]}),
            "functions",
        ),
        (
            "/v1/chat/completions",
            json!({"tool_choice": "required"}),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            json!({"tools": {"name": "f"}}),
            "tools",
        ),
        (
            "/v1/chat/completions",
            json!({"tools": [{"type": "function", "function": {}}]}),
            "tools[0].function.name",
        ),
        (
            "/v1/chat/completions",
            json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                                        "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                                        "tool_choice": "sometimes"}),
            "tool_choice",
        ),
    ];
    for (path, extra, param) in cases {
        let mut body = if path.ends_with("chat/completions") {
            json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        } else {
            json!({"model": "tiny", "prompt": "x"})
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(a, path, &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.error().0, param, "{body}: {}", r.text());
    }
    // SGLang's sampling_params too.
    let r = post(
        a,
        "/generate",
        &json!({"text": "x", "sampling_params": {"regex": "a+"}}),
    )
    .await;
    assert_eq!(r.error().0, "sampling_params.regex");
    let r = post(
        a,
        "/generate",
        &json!({"text": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}}),
    )
    .await;
    assert_eq!(r.error().0, "sampling_params.min_new_tokens");
    let st = engine.stats();
    assert_eq!(
        st.free_pages, st.capacity_pages,
        "nothing reached the engine"
    );
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// `min_tokens` never fails a request: where it would forbid every token (the JSON object
/// is complete, or every token is a stop token) it yields, and the request stops there —
/// a 200, not a 500 "engine step failed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_tokens_yields_when_nothing_else_may_follow() {
    let (engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    let mut early = 0;
    for seed in 0..6 {
        let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 30, "min_tokens": 30,
                          "seed": seed, "response_format": {"type": "json_object"}});
        let r = post(a, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "seed {seed}: {}", r.text());
        let r = r.json();
        let t = text(&r);
        let mut j = JsonObjectState::new();
        assert!(
            t.bytes().all(|b| j.push(b)),
            "seed {seed}: not a JSON object prefix: {t:?}"
        );
        if r["choices"][0]["finish_reason"] == "stop" {
            assert!(
                j.is_complete(),
                "seed {seed}: stopped inside the object: {t:?}"
            );
            early += 1;
        }
    }
    assert!(
        early > 0,
        "no seed closed its object before min_tokens: the case is untested"
    );
    let every: Vec<u32> = (0..258).collect();
    let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 5, "min_tokens": 1,
                      "stop_token_ids": every});
    let r = post(a, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["finish_reason"], "stop");
    assert_eq!(r.json()["usage"]["completion_tokens"], 1);
    assert_eq!(
        engine
            .metrics()
            .requests_with(sparsekit_server::metrics::RequestStatus::Failed),
        0
    );
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}
