//! The HTTP server (tokio + hyper 1.x, HTTP/1.1): OpenAI's `/v1/completions`,
//! `/v1/chat/completions` (both with SSE streaming) and `/v1/models`, SGLang's
//! `/generate` and `/abort_request`, `/health`, `/metrics` and `/server_info` (the
//! engine's model, seed, dtypes and cache settings: what a harness needs to compute the
//! reference of a running server).
//!
//! - Bad input (malformed JSON, wrong types, unknown model, prompt over the context
//!   limit, oversized body, unsupported options) gets a JSON 4xx in OpenAI's error shape;
//!   nothing reaches the engine and the server stays healthy.
//! - A client that goes away aborts its request: the handler's [`RequestHandle`] (or the
//!   stream feeding the SSE body) is dropped with the connection, and dropping a handle
//!   aborts.
//! - Shutdown (SIGINT/SIGTERM in [`serve_until_signal`], or any future in [`serve`]):
//!   stop accepting connections, let in-flight requests finish for the grace period,
//!   abort what is left, close connections.

pub mod api;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::engine::scheduler::{Engine, Event, FinishReason, GenerateRequest, RequestHandle};
use crate::metrics::RequestStatus;
use api::{
    digest_hex, parse, AbortBody, ApiError, ChatRequest, CompletionRequest, GenerateBody, Usage,
};

/// Connections open at once at most; more are closed as they come.
pub const MAX_CONNECTIONS: usize = 4096;

/// Pause after a failed accept (file descriptors exhausted) before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest accepted request body, in bytes.
    pub max_body_bytes: usize,
    /// Longest a request may run before it is aborted (the client gets 504 or, when
    /// streaming, an error event).
    pub request_timeout: Duration,
    /// How long in-flight requests may finish after a shutdown signal before they are
    /// aborted.
    pub shutdown_grace: Duration,
    /// Name `/v1/models` lists and requests must name (the engine's model by default).
    pub model_name: Option<String>,
    /// Longest a request body may take to arrive once the headers did (they have their
    /// own 30 s bound); slower bodies get a 408.
    pub body_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_body_bytes: 4 << 20,
            request_timeout: Duration::from_secs(600),
            shutdown_grace: Duration::from_secs(10),
            model_name: None,
            body_timeout: Duration::from_secs(30),
        }
    }
}

/// The body type of every response: a full body or an SSE stream.
#[derive(Debug)]
pub enum ResponseBody {
    Full(Full<Bytes>),
    Sse(mpsc::Receiver<Bytes>),
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            ResponseBody::Full(f) => Pin::new(f).poll_frame(cx),
            ResponseBody::Sse(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Full(f) => f.is_end_stream(),
            ResponseBody::Sse(_) => false,
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            ResponseBody::Full(f) => f.size_hint(),
            ResponseBody::Sse(_) => hyper::body::SizeHint::default(),
        }
    }
}

type Resp = Response<ResponseBody>;

fn json_response(status: u16, v: &Value) -> Resp {
    let body = serde_json::to_vec(v).unwrap_or_default();
    let mut r = Response::new(ResponseBody::Full(Full::new(Bytes::from(body))));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn error_response(e: &ApiError) -> Resp {
    json_response(e.status, &e.body())
}

fn text_response(status: u16, content_type: &'static str, body: String) -> Resp {
    let mut r = Response::new(ResponseBody::Full(Full::new(Bytes::from(body))));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn sse_response(rx: mpsc::Receiver<Bytes>) -> Resp {
    let mut r = Response::new(ResponseBody::Sse(rx));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    r
}

fn sse_data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Shared state of the handlers.
struct App {
    engine: Arc<Engine>,
    cfg: ServerConfig,
    model: String,
    created: u64,
}

impl App {
    fn check_model(&self, name: &str) -> Result<(), ApiError> {
        if name == self.model {
            Ok(())
        } else {
            Err(ApiError::status(
                404,
                "invalid_request_error",
                format!(
                    "The model `{name}` does not exist (this server serves `{}`)",
                    self.model
                ),
            )
            .with_param("model")
            .with_code("model_not_found"))
        }
    }

    fn reject(&self, e: ApiError) -> Resp {
        if e.status < 500 && !e.counted {
            self.engine.metrics().request(RequestStatus::Rejected);
        }
        error_response(&e)
    }

    /// Reads the body, refusing more than `max_body_bytes` (by header and by count).
    async fn body(&self, req: Request<Incoming>) -> Result<Bytes, ApiError> {
        let max = self.cfg.max_body_bytes;
        let too_large = || {
            ApiError::status(
                413,
                "invalid_request_error",
                format!("request body exceeds {max} bytes"),
            )
            .with_code("request_too_large")
        };
        if let Some(len) = req.headers().get(CONTENT_LENGTH) {
            let len = len.to_str().ok().and_then(|s| s.parse::<usize>().ok());
            match len {
                Some(l) if l > max => return Err(too_large()),
                None => return Err(ApiError::bad_request("invalid content-length header")),
                _ => {}
            }
        }
        let limit = self.cfg.body_timeout;
        let body = tokio::time::timeout(limit, Limited::new(req.into_body(), max).collect());
        let Ok(body) = body.await else {
            return Err(ApiError::status(
                408,
                "invalid_request_error",
                format!("the request body did not arrive within {limit:?}"),
            )
            .with_code("request_timeout"));
        };
        match body {
            Ok(c) => Ok(c.to_bytes()),
            Err(e)
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some() =>
            {
                Err(too_large())
            }
            Err(e) => Err(ApiError::bad_request(format!(
                "could not read the body: {e}"
            ))),
        }
    }

    fn submit(&self, req: GenerateRequest) -> Result<RequestHandle, ApiError> {
        self.engine.submit(req).map_err(|e| ApiError {
            counted: true,
            ..ApiError::from(e)
        })
    }

    async fn route(self: Arc<Self>, req: Request<Incoming>) -> Resp {
        let path = req.uri().path().to_string();
        let method = req.method().clone();
        let post = |ok: bool| -> Result<(), ApiError> {
            if ok {
                Ok(())
            } else {
                Err(ApiError::status(
                    405,
                    "invalid_request_error",
                    format!("{method} is not allowed on {path}"),
                ))
            }
        };
        let is_post = req.method() == Method::POST;
        let is_get = req.method() == Method::GET;
        match path.as_str() {
            "/health" | "/health_generate" => match post(is_get) {
                Ok(()) => self.health(),
                Err(e) => error_response(&e),
            },
            "/server_info" | "/get_server_info" => match post(is_get) {
                Ok(()) => {
                    let mut v = serde_json::to_value(self.engine.info()).unwrap_or(Value::Null);
                    if let Some(pd) = self.engine.pd_info() {
                        v["pd"] = serde_json::to_value(pd).unwrap_or(Value::Null);
                    }
                    json_response(200, &v)
                }
                Err(e) => error_response(&e),
            },
            "/metrics" => match post(is_get) {
                Ok(()) => text_response(
                    200,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    self.engine.metrics().encode(),
                ),
                Err(e) => error_response(&e),
            },
            "/v1/models" => match post(is_get) {
                Ok(()) => {
                    json_response(200, &json!({"object": "list", "data": [self.model_card()]}))
                }
                Err(e) => error_response(&e),
            },
            "/generate" | "/v1/completions" | "/v1/chat/completions" | "/abort_request" => {
                if let Err(e) = post(is_post) {
                    return error_response(&e);
                }
                let body = match self.body(req).await {
                    Ok(b) => b,
                    Err(e) => return self.reject(e),
                };
                let r = match path.as_str() {
                    "/generate" => self.clone().generate(&body).await,
                    "/v1/completions" => self.clone().completions(&body).await,
                    "/v1/chat/completions" => self.clone().chat(&body).await,
                    _ => self.abort(&body),
                };
                r.unwrap_or_else(|e| self.reject(e))
            }
            _ => error_response(&ApiError::status(
                404,
                "invalid_request_error",
                format!("no route {path}"),
            )),
        }
    }

    fn health(&self) -> Resp {
        if self.engine.is_healthy() {
            json_response(200, &json!({"status": "ok"}))
        } else {
            json_response(503, &json!({"status": "unavailable"}))
        }
    }

    fn model_card(&self) -> Value {
        let i = self.engine.info();
        json!({
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "sparsekit",
            "max_model_len": i.max_context,
            "backend": i.backend,
            "kv_dtype": i.kv_dtype,
            "index_k_dtype": i.index_k_dtype,
            "index_topk": i.index_topk,
        })
    }

    fn abort(&self, body: &[u8]) -> Result<Resp, ApiError> {
        let b: AbortBody = parse(body)?;
        let aborted = self.engine.abort(&b.rid);
        Ok(json_response(
            200,
            &json!({"rid": b.rid, "aborted": aborted}),
        ))
    }

    /// Waits for a whole completion within the request timeout (aborting on expiry).
    async fn complete(&self, h: RequestHandle) -> Result<crate::engine::Completion, ApiError> {
        match tokio::time::timeout(self.cfg.request_timeout, h.collect()).await {
            Ok(r) => r.map_err(ApiError::from),
            Err(_) => Err(ApiError::status(
                504,
                "server_error",
                format!(
                    "the request did not finish within {:?}",
                    self.cfg.request_timeout
                ),
            )
            .with_code("timeout")),
        }
    }

    /// Streams a request's events as SSE: `chunk(event)` renders each event (returning
    /// `None` to skip it) and `[DONE]` ends the stream. The task ends (and its handle
    /// drops, aborting the request) as soon as the client is gone.
    fn stream(
        &self,
        mut h: RequestHandle,
        mut render: impl FnMut(&Event) -> Vec<Value> + Send + 'static,
    ) -> Resp {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let timeout = self.cfg.request_timeout;
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::from_std(crate::deadline_after(timeout));
            loop {
                let ev = tokio::select! {
                    ev = h.next_event() => ev,
                    _ = tx.closed() => break,
                    _ = tokio::time::sleep_until(deadline) => {
                        let e = ApiError::status(504, "server_error", "request timed out").with_code("timeout");
                        let _ = tx.send(sse_data(&e.body())).await;
                        break;
                    }
                };
                let Some(ev) = ev else { break };
                let last = matches!(ev, Event::Done(_) | Event::Error(_));
                let chunks = match &ev {
                    Event::Error(e) => vec![ApiError::from(e.clone()).body()],
                    other => render(other),
                };
                for c in chunks {
                    if tx.send(sse_data(&c)).await.is_err() {
                        return;
                    }
                }
                if last {
                    let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                    break;
                }
            }
        });
        sse_response(rx)
    }

    async fn generate(self: Arc<Self>, body: &[u8]) -> Result<Resp, ApiError> {
        let b: GenerateBody = parse(body)?;
        let req = GenerateRequest {
            id: b.rid.clone(),
            prompt: b.tokens()?,
            sampling: b.params()?,
            received: None,
        };
        let prompt_tokens = req.prompt.len();
        let h = self.submit(req)?;
        let rid = h.rid().to_string();
        let digests = b.return_logits_digest;
        if b.stream {
            let (mut text, mut ids, mut dg) = (String::new(), Vec::new(), Vec::new());
            return Ok(self.stream(h, move |ev| {
                let finish = match ev {
                    Event::Token(t) => {
                        text.push_str(&t.text);
                        ids.push(t.token);
                        dg.push(digest_hex(t.logits_digest));
                        Value::Null
                    }
                    Event::Done(f) => {
                        text.push_str(&f.text);
                        finish_json(f.reason, f.matched.as_deref())
                    }
                    Event::Error(_) => Value::Null,
                };
                let mut meta = json!({
                    "id": rid, "prompt_tokens": prompt_tokens,
                    "completion_tokens": ids.len(), "finish_reason": finish,
                });
                if digests {
                    meta["logits_digests"] = json!(dg);
                }
                vec![json!({"text": text, "output_ids": ids, "meta_info": meta})]
            }));
        }
        let c = self.complete(h).await?;
        let mut meta = json!({
            "id": c.rid, "prompt_tokens": prompt_tokens,
            "completion_tokens": c.tokens.len(),
            "finish_reason": finish_json(c.finish, c.matched.as_deref()),
            "ttft_seconds": c.ttft,
        });
        if digests {
            meta["logits_digests"] =
                json!(c.digests.iter().map(|d| digest_hex(*d)).collect::<Vec<_>>());
        }
        Ok(json_response(
            200,
            &json!({"text": c.text, "output_ids": c.tokens, "meta_info": meta}),
        ))
    }

    async fn completions(self: Arc<Self>, body: &[u8]) -> Result<Resp, ApiError> {
        let r = CompletionRequest::parse(body)?;
        self.check_model(&r.model)?;
        let prompt = r.prompt.tokens()?;
        let max_context = self.engine.info().max_context;
        let sampling = r.sampling.to_params(prompt.len(), max_context)?;
        let prompt_tokens = prompt.len();
        let h = self.submit(GenerateRequest::new(prompt, sampling))?;
        let id = format!("cmpl-{}", h.rid());
        let (model, created) = (self.model.clone(), unix_now());
        if r.stream {
            let usage = r.stream_options.is_some_and(|o| o.include_usage);
            let mut n = 0;
            return Ok(self.stream(h, move |ev| {
                let chunk = |text: &str, finish: Option<&str>| {
                    json!({"id": id, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]})
                };
                match ev {
                    Event::Token(t) => {
                        n += 1;
                        if t.text.is_empty() {
                            vec![]
                        } else {
                            vec![chunk(&t.text, None)]
                        }
                    }
                    Event::Done(f) => {
                        let mut out = vec![chunk(&f.text, Some(f.reason.as_str()))];
                        if usage {
                            out.push(json!({"id": id, "object": "text_completion", "created": created,
                                "model": model, "choices": [],
                                "usage": Usage::new(prompt_tokens, n)}));
                        }
                        out
                    }
                    Event::Error(_) => vec![],
                }
            }));
        }
        let c = self.complete(h).await?;
        Ok(json_response(
            200,
            &json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": c.text, "logprobs": null,
                             "finish_reason": c.finish.as_str()}],
                "usage": Usage::new(prompt_tokens, c.tokens.len()),
            }),
        ))
    }

    async fn chat(self: Arc<Self>, body: &[u8]) -> Result<Resp, ApiError> {
        let r = ChatRequest::parse(body)?;
        self.check_model(&r.model)?;
        let prompt = r.tokens()?;
        let max_context = self.engine.info().max_context;
        let sampling = r.sampling.to_params(prompt.len(), max_context)?;
        let prompt_tokens = prompt.len();
        let h = self.submit(GenerateRequest::new(prompt, sampling))?;
        let id = format!("chatcmpl-{}", h.rid());
        let (model, created) = (self.model.clone(), unix_now());
        if r.stream {
            let usage = r.stream_options.is_some_and(|o| o.include_usage);
            let mut n = 0;
            let mut first = true;
            return Ok(self.stream(h, move |ev| {
                let chunk = |delta: Value, finish: Option<&str>| {
                    json!({"id": id, "object": "chat.completion.chunk", "created": created,
                           "model": model,
                           "choices": [{"index": 0, "delta": delta, "logprobs": null,
                                        "finish_reason": finish}]})
                };
                let mut out = Vec::new();
                if first {
                    first = false;
                    out.push(chunk(json!({"role": "assistant", "content": ""}), None));
                }
                match ev {
                    Event::Token(t) => {
                        n += 1;
                        if !t.text.is_empty() {
                            out.push(chunk(json!({"content": t.text}), None));
                        }
                    }
                    Event::Done(f) => {
                        if !f.text.is_empty() {
                            out.push(chunk(json!({"content": f.text}), None));
                        }
                        out.push(chunk(json!({}), Some(f.reason.as_str())));
                        if usage {
                            out.push(json!({"id": id, "object": "chat.completion.chunk",
                                "created": created, "model": model, "choices": [],
                                "usage": Usage::new(prompt_tokens, n)}));
                        }
                    }
                    Event::Error(_) => {}
                }
                out
            }));
        }
        let c = self.complete(h).await?;
        Ok(json_response(
            200,
            &json!({
                "id": id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": c.text},
                             "logprobs": null,
                             "finish_reason": c.finish.as_str()}],
                "usage": Usage::new(prompt_tokens, c.tokens.len()),
            }),
        ))
    }
}

fn finish_json(reason: FinishReason, matched: Option<&str>) -> Value {
    match matched {
        Some(m) => json!({"type": reason.as_str(), "matched": m}),
        None => json!({"type": reason.as_str()}),
    }
}

/// A running server's address and handle for tests and embedders.
#[derive(Debug)]
pub struct ServerHandle {
    pub addr: SocketAddr,
    shutdown: tokio::sync::watch::Sender<bool>,
    done: tokio::task::JoinHandle<()>,
}

impl ServerHandle {
    /// Signals shutdown and waits for the server to stop (bounded by the grace period
    /// plus 10 s).
    pub async fn shutdown(self, grace: Duration) -> Result<(), crate::EngineError> {
        let _ = self.shutdown.send(true);
        match tokio::time::timeout(grace + Duration::from_secs(10), self.done).await {
            Ok(_) => Ok(()),
            Err(_) => Err(crate::EngineError::Timeout(
                "server did not stop in time".into(),
            )),
        }
    }
}

/// Binds `addr` and serves `engine` on the current tokio runtime until
/// [`ServerHandle::shutdown`].
pub async fn spawn(
    engine: Arc<Engine>,
    addr: SocketAddr,
    cfg: ServerConfig,
) -> std::io::Result<ServerHandle> {
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let (tx, mut rx) = tokio::sync::watch::channel(false);
    let done = tokio::spawn(async move {
        let signal = async move {
            let _ = rx.wait_for(|v| *v).await;
        };
        serve(engine, listener, cfg, signal).await;
    });
    Ok(ServerHandle {
        addr,
        shutdown: tx,
        done,
    })
}

/// Serves until `shutdown` completes, then drains: no new connections, in-flight requests
/// get `cfg.shutdown_grace` to finish before the engine aborts them, connections close.
pub async fn serve(
    engine: Arc<Engine>,
    listener: TcpListener,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()>,
) {
    let model = cfg
        .model_name
        .clone()
        .unwrap_or_else(|| engine.info().model.clone());
    let app = Arc::new(App {
        engine: engine.clone(),
        cfg: cfg.clone(),
        model,
        created: unix_now(),
    });
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // Out of file descriptors, say: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                // At the connection cap a new connection is closed at once.
                let Ok(permit) = connections.clone().try_acquire_owned() else {
                    tracing::warn!("connection refused: {MAX_CONNECTIONS} connections open");
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let app = app.clone();
                let svc = service_fn(move |req| {
                    let app = app.clone();
                    async move { Ok::<_, Infallible>(app.route(req).await) }
                });
                let conn = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(30))
                    .serve_connection(TokioIo::new(stream), svc);
                let fut = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = fut.await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                    drop(permit);
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!("shutting down: draining in-flight requests");
    let grace = cfg.shutdown_grace;
    let e = engine.clone();
    let drained = tokio::task::spawn_blocking(move || e.shutdown(grace)).await;
    if !matches!(drained, Ok(Ok(()))) {
        tracing::warn!("engine did not stop cleanly");
    }
    // Responses of finished and aborted requests are flushed; then connections close.
    if tokio::time::timeout(Duration::from_secs(5), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after shutdown");
    }
}

/// Serves until SIGINT or SIGTERM, then drains as [`serve`] does.
pub async fn serve_until_signal(
    engine: Arc<Engine>,
    listener: TcpListener,
    cfg: ServerConfig,
) -> std::io::Result<()> {
    #[cfg(unix)]
    let signal = {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM"),
                _ = int.recv() => tracing::info!("SIGINT"),
            }
        }
    };
    #[cfg(not(unix))]
    let signal = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    serve(engine, listener, cfg, signal).await;
    Ok(())
}
