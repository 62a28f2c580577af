//! One client cannot touch another's request: server ids are unguessable, client ids are
//! labels that squat nothing and abort only their own client's requests, and with an API
//! key nothing but the public routes answers without it — `/abort_request` included.

use std::time::Duration;

use serde_json::json;
use sparsekit_server::http::auth::{ApiKey, PublicRoutes};
use sparsekit_server::http::ServerConfig;
use sparsekit_server::metrics::RequestStatus;

use super::client::*;

/// The abort/squat attack of issue 18: ids were `req-N` (visible as `cmpl-req-N`), so a
/// client aborting `req-1`…`req-64` cut its neighbours' answers, and a client posting
/// `/generate` with `rid: "req-N"` made the next server-named request fail with 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_client_can_abort_or_squat_another_clients_request() {
    let (engine, server) = start_with(ServerConfig::default(), pages(2048)).await;
    let a = server.addr;
    // The squatter takes the ids a sequential server would hand out next (and a label
    // another client is going to use), with requests that run a while.
    let squat: Vec<_> = ["req-1", "req-2", "req-3", "req-4", "shared"]
        .into_iter()
        .map(|rid| {
            let body = json!({"text": "x", "rid": rid, "stream": true,
                              "sampling_params": {"max_new_tokens": 3000, "ignore_eos": true}});
            tokio::spawn(async move { post(a, "/generate", &body).await })
        })
        .collect();
    until("the squatter's requests run", || {
        engine.stats().running >= 5
    })
    .await;
    // The victim: a request named by the server, and one labelled "shared" too.
    let victim = json!({"model": "tiny", "prompt": "hello", "max_tokens": 1500, "ignore_eos": true,
                        "temperature": 0});
    let v1 = tokio::spawn(async move { post(a, "/v1/completions", &victim).await });
    let labelled = json!({"text": "hello", "rid": "shared",
                          "sampling_params": {"max_new_tokens": 8, "temperature": 0}});
    let v2 = post(a, "/generate", &labelled).await;
    assert_eq!(
        v2.status,
        200,
        "a label another client uses is no conflict: {}",
        v2.text()
    );
    assert_eq!(v2.json()["meta_info"]["id"], "shared");
    until("the victim runs", || engine.stats().running >= 6).await;
    // The attacker sprays aborts at every id a sequential server would have used.
    for n in 0..64 {
        for rid in [format!("req-{n}"), format!("{n}"), format!("cmpl-req-{n}")] {
            if rid.starts_with("req-") && n <= 4 {
                continue; // the squatter's own labels: it may abort those
            }
            let r = post(a, "/abort_request", &json!({"rid": rid})).await;
            assert_eq!(r.status, 200);
            assert_eq!(r.json()["aborted"], false, "{rid} aborted something");
        }
    }
    let v1 = tokio::time::timeout(LIMIT, v1).await.unwrap().unwrap();
    assert_eq!(v1.status, 200, "{}", v1.text());
    let v1 = v1.json();
    assert_eq!(v1["choices"][0]["finish_reason"], "length");
    // Its id is 128 random bits, and the X-Request-Id header names it too.
    let id = v1["id"].as_str().unwrap();
    let hex = id.strip_prefix("cmpl-").unwrap();
    assert!(
        hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "{id}"
    );
    // A client can abort what it labelled (all of it).
    let r = post(a, "/abort_request", &json!({"rid": "shared"})).await;
    assert_eq!(r.json()["aborted"], true);
    for rid in ["req-1", "req-2", "req-3", "req-4"] {
        let r = post(a, "/abort_request", &json!({"rid": rid})).await;
        assert_eq!(r.json()["aborted"], true, "{rid}");
    }
    for s in squat {
        let r = tokio::time::timeout(LIMIT, s).await.unwrap().unwrap();
        let last = r.events().pop().unwrap();
        assert_eq!(last["meta_info"]["finish_reason"]["type"], "abort");
    }
    assert_eq!(engine.metrics().requests_with(RequestStatus::Aborted), 5);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// A label is its client's: another client (another address) aborting `job-1` — a label
/// anyone can guess — reaches only its own `job-1`, never the first client's; the first
/// client's abort reaches its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_aborts_only_its_own_clients_requests() {
    let (engine, server) = start_with(ServerConfig::default(), pages(2048)).await;
    let a = server.addr;
    let (alice, mallory): (std::net::IpAddr, std::net::IpAddr) =
        ([127, 0, 0, 1].into(), [127, 0, 0, 2].into());
    let long = json!({"text": "victim", "rid": "job-1", "stream": true,
                      "sampling_params": {"max_new_tokens": 3000, "ignore_eos": true}});
    let (l1, l2) = (long.clone(), long);
    let victim = tokio::spawn(async move { post_from(alice, a, "/generate", &l1).await });
    let own = tokio::spawn(async move { post_from(mallory, a, "/generate", &l2).await });
    until("both run", || engine.stats().running == 2).await;
    let r = post_from(mallory, a, "/abort_request", &json!({"rid": "job-1"})).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["aborted"], true, "its own job-1");
    let own = tokio::time::timeout(LIMIT, own).await.unwrap().unwrap();
    let last = own.events().pop().unwrap();
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "abort");
    // The victim still runs: nothing of mallory's reaches it.
    until("mallory's request has ended", || {
        engine.stats().running == 1
    })
    .await;
    let r = post_from(mallory, a, "/abort_request", &json!({"rid": "job-1"})).await;
    assert_eq!(r.json()["aborted"], false, "another client's job-1 aborted");
    assert_eq!(engine.stats().running, 1);
    // Its own client aborts it.
    let r = post_from(alice, a, "/abort_request", &json!({"rid": "job-1"})).await;
    assert_eq!(r.json()["aborted"], true);
    let victim = tokio::time::timeout(LIMIT, victim).await.unwrap().unwrap();
    let last = victim.events().pop().unwrap();
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "abort");
    assert_eq!(engine.metrics().requests_with(RequestStatus::Aborted), 2);
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_guards_every_route_but_the_public_ones() {
    let cfg = ServerConfig {
        api_key: Some(ApiKey::new("sk-test-123").unwrap()),
        ..Default::default()
    };
    let (engine, server) = start(cfg).await;
    let a = server.addr;
    let good = [("Authorization", "Bearer sk-test-123")];
    let gen = json!({"text": "x", "sampling_params": {"max_new_tokens": 2}});
    let cmpl = json!({"model": "tiny", "prompt": "x", "max_tokens": 2});
    let chat =
        json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2});
    let posts = [
        ("/generate", gen.clone()),
        ("/v1/completions", cmpl.clone()),
        ("/v1/chat/completions", chat.clone()),
        ("/abort_request", json!({"rid": "x"})),
        ("/tokenize", json!({"prompt": "x"})),
        ("/detokenize", json!({"tokens": [65]})),
    ];
    let gets = ["/v1/models", "/v1/models/tiny", "/server_info"];
    for bad in [
        vec![],
        vec![("Authorization", "Bearer sk-test-12")],
        vec![("Authorization", "Bearer sk-test-1234")],
        vec![("Authorization", "sk-test-123")],
        vec![("Authorization", "Basic c2stdGVzdC0xMjM=")],
    ] {
        for (path, body) in &posts {
            let r = post_with(a, path, &bad, body).await;
            assert_eq!(r.status, 401, "{path} {bad:?}");
            assert_eq!(r.error().1, "invalid_api_key");
            assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        }
        for path in gets {
            assert_eq!(get_with(a, path, &bad).await.status, 401, "{path}");
        }
    }
    assert_eq!(
        engine.metrics().requests_with(RequestStatus::Rejected),
        0,
        "nothing reached the engine"
    );
    // Public by default.
    assert_eq!(get(a, "/health").await.status, 200);
    assert_eq!(get(a, "/metrics").await.status, 200);
    // With the key, everything answers.
    for (path, body) in &posts {
        assert_eq!(post_with(a, path, &good, body).await.status, 200, "{path}");
    }
    for path in gets {
        assert_eq!(get_with(a, path, &good).await.status, 200, "{path}");
    }
    // An attacker without the key cannot abort a request even knowing its id.
    let long = json!({"text": "x", "rid": "mine", "stream": true,
                      "sampling_params": {"max_new_tokens": 3000, "ignore_eos": true}});
    let s = tokio::spawn(async move {
        post_with(
            a,
            "/generate",
            &[("Authorization", "Bearer sk-test-123")],
            &long,
        )
        .await
    });
    until("the request runs", || engine.stats().running == 1).await;
    let r = post(a, "/abort_request", &json!({"rid": "mine"})).await;
    assert_eq!(r.status, 401);
    let r = post_with(a, "/abort_request", &good, &json!({"rid": "mine"})).await;
    assert_eq!(r.json()["aborted"], true);
    let r = tokio::time::timeout(LIMIT, s).await.unwrap().unwrap();
    assert_eq!(
        r.events().pop().unwrap()["meta_info"]["finish_reason"]["type"],
        "abort"
    );
    server.shutdown(Duration::from_secs(5)).await.unwrap();

    // Nothing public: /health and /metrics want the key too.
    let cfg = ServerConfig {
        api_key: Some(ApiKey::new("k").unwrap()),
        public_routes: PublicRoutes::parse("none").unwrap(),
        ..Default::default()
    };
    let (_engine, server) = start(cfg).await;
    for path in ["/health", "/metrics"] {
        assert_eq!(get(server.addr, path).await.status, 401, "{path}");
        let ok = get_with(server.addr, path, &[("Authorization", "Bearer k")]).await;
        assert_eq!(ok.status, 200, "{path}");
    }
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}

/// `X-Request-Id`: echoed, names the response, and is a label in the client namespace
/// (abortable as such); a malformed one is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_request_id_is_echoed_and_labels_the_request() {
    let (engine, server) = start(ServerConfig::default()).await;
    let a = server.addr;
    let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 3});
    let r = post_with(a, "/v1/completions", &[("X-Request-Id", "trace-42")], &body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-request-id"), Some("trace-42"));
    assert_eq!(r.json()["id"], "cmpl-trace-42");
    // Without one, the server's id is in the header.
    let r = post(a, "/v1/completions", &body).await;
    let id = r.json()["id"].as_str().unwrap().to_string();
    assert_eq!(Some(&id[5..]), r.header("x-request-id"));
    // Malformed.
    let long = "x".repeat(300);
    let r = post_with(a, "/v1/completions", &[("X-Request-Id", &long)], &body).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.error().0, "x-request-id");
    // A label to abort by.
    let stream = json!({"model": "tiny", "prompt": "x", "max_tokens": 3000, "ignore_eos": true,
                        "stream": true});
    let s = tokio::spawn(async move {
        post_with(a, "/v1/completions", &[("X-Request-Id", "job-7")], &stream).await
    });
    until("the request runs", || engine.stats().running == 1).await;
    let r = post(a, "/abort_request", &json!({"rid": "job-7"})).await;
    assert_eq!(r.json()["aborted"], true);
    let r = tokio::time::timeout(LIMIT, s).await.unwrap().unwrap();
    assert_eq!(r.header("x-request-id"), Some("job-7"));
    let last = r.events().pop().unwrap();
    assert_eq!(last["id"], "cmpl-job-7");
    assert_eq!(last["choices"][0]["finish_reason"], "abort");
    server.shutdown(Duration::from_secs(5)).await.unwrap();
}
