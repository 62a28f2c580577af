//! DSML tool calls through the server: the model's reply is scripted (a test injection:
//! random weights never write DSML), the rest is the production path — the template, the
//! forced-call prefill, the parser, the OpenAI `tool_calls` whole and streamed, and the
//! count of blocks that did not parse.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use sparsekit_server::dsml::Dialect;
use sparsekit_server::engine::tokenizer::{decode_bytes, encode, END};
use sparsekit_server::engine::EngineOptions;
use sparsekit_server::engine::ReplyScript;
use sparsekit_server::http::ServerConfig;

use super::client::*;

const CALL: &str = "I'll look.\n\n<｜DSML｜function_calls>\n\
<｜DSML｜invoke name=\"get_weather\">\n\
<｜DSML｜parameter name=\"city\" string=\"true\">Hangzhou</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"days\" string=\"false\">{\"from\": 1, \"to\": [2, 3]}</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n\
</｜DSML｜function_calls>";

/// Replies by the case the last user message names; records every prompt it saw.
fn script(prompts: Arc<Mutex<Vec<String>>>) -> ReplyScript {
    Arc::new(move |prompt: &[u32]| {
        let text = String::from_utf8_lossy(&decode_bytes(prompt, true)).into_owned();
        prompts.lock().unwrap().push(text.clone());
        let reply = if text.contains("CASE call") {
            CALL.to_string()
        } else if text.contains("CASE truncated") {
            CALL[..CALL.len() - 12].to_string()
        } else if text.contains("CASE named") {
            // Continues the prefilled opening of a call to `now`, in its dialect.
            let block = if text.ends_with("tool_calls>\n<｜DSML｜invoke name=\"now\">\n") {
                "tool_calls"
            } else {
                "function_calls"
            };
            format!("</｜DSML｜invoke>\n</｜DSML｜{block}>")
        } else {
            return None;
        };
        let mut t = encode(&reply);
        t.push(END);
        Some(t)
    })
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    ])
}

fn chat(case: &str, extra: Value) -> Value {
    let mut b = json!({"model": "tiny", "max_tokens": 600, "tools": tools(),
                       "messages": [{"role": "user", "content": format!("CASE {case}")}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn expected_calls() -> Vec<(String, Value)> {
    vec![
        (
            "get_weather".into(),
            json!({"city": "Hangzhou", "days": {"from": 1, "to": [2, 3]}}),
        ),
        ("now".into(), json!({})),
    ]
}

/// The calls of a message: name and parsed arguments.
fn calls_of(tool_calls: &Value) -> Vec<(String, Value)> {
    tool_calls
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(c["type"], "function");
            assert!(c["id"].as_str().unwrap().starts_with("call_"));
            let args: Value =
                serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            (c["function"]["name"].as_str().unwrap().to_string(), args)
        })
        .collect()
}

async fn scripted(
    dialect: Dialect,
) -> (
    Arc<Mutex<Vec<String>>>,
    Arc<sparsekit_server::engine::Engine>,
    sparsekit_server::http::ServerHandle,
) {
    let prompts = Arc::new(Mutex::new(Vec::new()));
    let opts = EngineOptions {
        kv_pages: 1024,
        scripted_reply: Some(script(prompts.clone())),
        ..Default::default()
    };
    let cfg = ServerConfig {
        tool_parser: dialect,
        ..Default::default()
    };
    let (engine, server) = start_with(cfg, opts).await;
    (prompts, engine, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dsml_in_the_reply_becomes_tool_calls() {
    let (prompts, engine, server) = scripted(Dialect::V32).await;
    let a = server.addr;
    // Whole.
    let r = post(a, "/v1/chat/completions", &chat("call", json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = r.json();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "I'll look.\n\n");
    assert_eq!(calls_of(&choice["message"]["tool_calls"]), expected_calls());
    // The prompt showed the tools in DSML.
    let p = prompts.lock().unwrap().last().cloned().unwrap();
    assert!(
        p.contains("## Tools") && p.contains("<｜DSML｜function_calls>"),
        "{p}"
    );
    assert!(p.contains("\"name\":\"get_weather\""), "{p}");
    // Streamed: content deltas, then each call as a header delta and an arguments delta.
    let s = post(
        a,
        "/v1/chat/completions",
        &chat("call", json!({"stream": true})),
    )
    .await;
    let events = s.events();
    let mut content = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut finish = None;
    for e in &events {
        let c = &e["choices"][0];
        if let Some(t) = c["delta"]["content"].as_str() {
            content.push_str(t);
        }
        for d in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = d["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                calls.push((
                    d["function"]["name"].as_str().unwrap().to_string(),
                    String::new(),
                ));
            }
            calls[i]
                .1
                .push_str(d["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(content, "I'll look.\n\n");
    let calls: Vec<(String, Value)> = calls
        .into_iter()
        .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
        .collect();
    assert_eq!(calls, expected_calls());
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(engine.metrics().tool_call_parse_failures(), 0);
    // tool_choice none: no tools shown, the markup stays text (nothing failed).
    let r = post(
        a,
        "/v1/chat/completions",
        &chat("call", json!({"tool_choice": "none"})),
    )
    .await
    .json();
    assert_eq!(r["choices"][0]["message"]["content"], CALL);
    assert!(r["choices"][0]["message"].get("tool_calls").is_none());
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let p = prompts.lock().unwrap().last().cloned().unwrap();
    assert!(!p.contains("## Tools"), "{p}");
    assert_eq!(engine.metrics().tool_call_parse_failures(), 0);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_markup_stays_content_and_is_counted() {
    let (_prompts, engine, server) = scripted(Dialect::V32).await;
    let a = server.addr;
    let cut = &CALL[..CALL.len() - 12];
    let r = post(a, "/v1/chat/completions", &chat("truncated", json!({})))
        .await
        .json();
    assert_eq!(r["choices"][0]["message"]["content"], cut);
    assert!(r["choices"][0]["message"].get("tool_calls").is_none());
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(engine.metrics().tool_call_parse_failures(), 1);
    let s = post(
        a,
        "/v1/chat/completions",
        &chat("truncated", json!({"stream": true})),
    )
    .await;
    let content: String = s
        .events()
        .iter()
        .filter_map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(content, cut);
    assert!(s
        .events()
        .iter()
        .all(|e| e["choices"][0]["delta"].get("tool_calls").is_none()));
    assert_eq!(engine.metrics().tool_call_parse_failures(), 2);
    let m = get(a, "/metrics").await.text();
    assert!(
        m.contains("sparsekit_tool_call_parse_failures_total 2"),
        "{m}"
    );
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// A named `tool_choice` prefills the call's opening (in the server's dialect: V4's
/// `tool_calls` block on a V4 server); the reply continues inside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_tool_choice_prefills_the_call() {
    for (dialect, block) in [
        (Dialect::V32, "function_calls"),
        (Dialect::V4, "tool_calls"),
    ] {
        let (prompts, engine, server) = scripted(dialect).await;
        let named = json!({"tool_choice": {"type": "function", "function": {"name": "now"}}});
        let r = post(server.addr, "/v1/chat/completions", &chat("named", named))
            .await
            .json();
        let p = prompts.lock().unwrap().last().cloned().unwrap();
        assert!(
            p.ends_with(&format!(
                "<|assistant|><｜DSML｜{block}>\n<｜DSML｜invoke name=\"now\">\n"
            )),
            "{p}"
        );
        let other = if dialect == Dialect::V4 {
            "function_calls>"
        } else {
            "tool_calls>"
        };
        assert!(p.contains("## Tools") && !p.contains(other), "{p}");
        let m = &r["choices"][0]["message"];
        assert_eq!(
            calls_of(&m["tool_calls"]),
            vec![("now".to_string(), json!({}))]
        );
        assert_eq!(m["content"], Value::Null);
        assert_eq!(r["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(engine.metrics().tool_call_parse_failures(), 0);
        server.shutdown(Duration::from_secs(5)).await.unwrap();
    }
}
