//! The HTTP server (tokio + hyper 1.x, HTTP/1.1): OpenAI's `/v1/completions`,
//! `/v1/chat/completions` (both with SSE streaming; tool calls in DeepSeek's DSML),
//! `/v1/models` and `/v1/models/{id}`, vLLM's `/tokenize` and `/detokenize`, SGLang's
//! `/generate` and `/abort_request`, `/health`, `/metrics` (Prometheus text or
//! OpenMetrics) and `/server_info` (the engine's model, seed, dtypes and cache settings:
//! what a harness needs to compute the reference of a running server).
//!
//! - Bad input (malformed JSON, wrong types, unknown model, prompt over the context
//!   limit, oversized body, a malformed `Content-Length`, unsupported options) gets a
//!   JSON 4xx in OpenAI's error shape; nothing reaches the engine and the server stays
//!   healthy.
//! - With an API key ([`ServerConfig::api_key`]) every route but the public ones needs it
//!   ([`auth`]); request ids are unguessable and clients' ids are labels of their own
//!   ([`ids`]); connections are bounded per client and in all, idle ones make room
//!   ([`limits`]); CORS is opt-in ([`cors`]).
//! - A client that goes away aborts its request: the handler's [`RequestHandle`] (or the
//!   stream feeding the SSE body) is dropped with the connection, and dropping a handle
//!   aborts.
//! - Shutdown (SIGINT/SIGTERM in [`serve_until_signal`], or any future in [`serve`]):
//!   stop accepting connections, let in-flight requests finish for the grace period,
//!   abort what is left, close connections.
//!
//! [`RequestHandle`]: crate::engine::RequestHandle

pub mod api;
mod app;
pub mod auth;
pub mod cors;
pub mod framing;
mod handlers;
pub mod ids;
pub mod limits;
pub mod options;
pub mod response;
pub mod tools;

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hyper::header::{HeaderValue, CONNECTION};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::dsml::Dialect;
use crate::engine::Engine;
use api::ApiError;
use app::App;
use auth::{ApiKey, PublicRoutes};
use limits::{Admission, ConnLimits, ConnSlot, ConnTable, ReserveSlot};
use response::{error_response, set_retry_after, Guarded, ResponseBody};

/// Pause after a failed accept that freed nothing (file descriptors exhausted) before the
/// next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest accepted request body, in bytes.
    pub max_body_bytes: usize,
    /// Longest a request may run before it is aborted (the client gets 504 or, when
    /// streaming, an error event; counted as `status="timeout"`).
    pub request_timeout: Duration,
    /// How long in-flight requests may finish after a shutdown signal before they are
    /// aborted.
    pub shutdown_grace: Duration,
    /// Name `/v1/models` lists and requests must name (the engine's model by default:
    /// `--served-model-name`).
    pub model_name: Option<String>,
    /// Longest a request body may take to arrive once the headers did; slower bodies get
    /// a 408.
    pub body_timeout: Duration,
    /// The key every non-public route needs (`Authorization: Bearer`); none: open.
    pub api_key: Option<ApiKey>,
    /// Routes open without the key.
    pub public_routes: PublicRoutes,
    /// Connection limits.
    pub limits: ConnLimits,
    /// Origins browsers may call from (CORS); empty: none.
    pub allowed_origins: Vec<String>,
    /// The DSML dialect tools and forced calls are rendered in (replies in either parse).
    pub tool_parser: Dialect,
    /// The engines of the other PD sides in this process (`--pd on`: prefill): their
    /// metrics are served on `/metrics` (each sample labelled with its `role`) and their
    /// info on `/server_info` (`pd.sides`).
    pub other_sides: Vec<Arc<Engine>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_body_bytes: 4 << 20,
            request_timeout: Duration::from_secs(600),
            shutdown_grace: Duration::from_secs(10),
            model_name: None,
            body_timeout: Duration::from_secs(30),
            api_key: None,
            public_routes: PublicRoutes::default(),
            limits: ConnLimits::default(),
            allowed_origins: Vec::new(),
            tool_parser: Dialect::default(),
            other_sides: Vec::new(),
        }
    }
}

/// A server configuration that cannot be served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);

impl ServerConfig {
    /// Checks the settings that can be wrong (limits, origins, the model name).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.limits.validate().map_err(ConfigError)?;
        cors::Cors::new(&self.allowed_origins).map_err(ConfigError)?;
        if let Some(n) = &self.model_name {
            if n.is_empty() || n.chars().any(char::is_control) {
                return Err(ConfigError(format!("invalid served model name {n:?}")));
            }
        }
        Ok(())
    }
}

/// A running server's address and handle for tests and embedders.
#[derive(Debug)]
pub struct ServerHandle {
    pub addr: SocketAddr,
    shutdown: watch::Sender<bool>,
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
    cfg.validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let listener = bind(addr).await?;
    let addr = listener.local_addr()?;
    let (tx, mut rx) = watch::channel(false);
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

/// Binds `addr`; an error names the address ("address already in use" says which).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))
}

/// Serves one counted connection until it ends, is evicted, ages out or the server
/// shuts down.
async fn serve_connection(
    app: Arc<App>,
    stream: TcpStream,
    peer: IpAddr,
    slot: ConnSlot,
    mut shutdown: watch::Receiver<bool>,
) {
    let state = slot.state().clone();
    let svc_state = state.clone();
    let svc = service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        // Whose labels the request sets and aborts by (`ids`).
        req.extensions_mut().insert(ids::ClientAddr(peer));
        let app = app.clone();
        let guard = svc_state.enter();
        async move {
            let Some(guard) = guard else {
                // Evicted as idle just as this request arrived: the socket is closing.
                let e = ApiError::status(503, "server_error", "connection closed to make room")
                    .with_code("overloaded");
                let r = error_response(&e);
                return Ok::<_, Infallible>(r.map(|body| Guarded { body, guard: None }));
            };
            let r = app.route(req).await;
            Ok(r.map(|body| Guarded {
                body,
                guard: Some(guard),
            }))
        }
    });
    let limits = slot.table().limits().clone();
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(TokioIo::new(framing::Sniffed::new(stream)), svc);
    tokio::pin!(conn);
    let age = tokio::time::sleep(limits.max_connection_age);
    tokio::pin!(age);
    let mut closing = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                break;
            }
            _ = state.evicted() => break,
            _ = &mut age, if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = shutdown.wait_for(|v| *v), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
    drop(slot);
}

/// Serves a connection over the limits: `/health` as usual, a 503 with `Retry-After`
/// for anything else, then closes.
async fn serve_reserve(app: Arc<App>, stream: TcpStream, slot: ReserveSlot, limits: ConnLimits) {
    let retry = limits.retry_after;
    let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let app = app.clone();
        async move {
            let mut r = if matches!(req.uri().path(), "/health" | "/health_generate") {
                // Through the router: the API key, when `/health` is not public.
                app.route(req).await
            } else {
                let e = ApiError::status(503, "server_error", "too many connections: retry later")
                    .with_code("overloaded");
                let mut r = error_response(&e);
                set_retry_after(&mut r, retry);
                r
            };
            r.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            Ok::<_, Infallible>(r.map(|body: ResponseBody| Guarded { body, guard: None }))
        }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .keep_alive(false)
        .header_read_timeout(limits.reserve_header_timeout)
        .serve_connection(TokioIo::new(stream), svc);
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "reserve connection ended with an error");
    }
    drop(slot);
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
    let cors = cors::Cors::new(&cfg.allowed_origins).unwrap_or_default();
    let table = ConnTable::new(cfg.limits.clone(), engine.metrics().clone());
    let app = Arc::new(App {
        engine: engine.clone(),
        cfg: cfg.clone(),
        cors,
        model,
        created: handlers::unix_now(),
        client_ids: Arc::default(),
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // Out of file descriptors, say: close an idle connection, or back
                        // off instead of spinning.
                        if !table.evict_one_idle() {
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(ACCEPT_BACKOFF).await;
                        }
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                match table.admit(peer.ip()) {
                    Admission::Normal(slot) => {
                        let stop = stop_rx.clone();
                        tokio::spawn(serve_connection(app.clone(), stream, peer.ip(), slot, stop));
                    }
                    Admission::Reserve(slot) => {
                        let limits = table.limits().clone();
                        tokio::spawn(serve_reserve(app.clone(), stream, slot, limits));
                    }
                    Admission::Refused => {
                        tracing::debug!(%peer, "connection refused: no room, reserve full");
                        drop(stream);
                    }
                }
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
    let _ = stop_tx.send(true);
    if !table.wait_empty(Duration::from_secs(5)).await {
        tracing::warn!("connections still open after shutdown");
    }
}

/// Serves until SIGINT or SIGTERM, then drains as [`serve`] does.
pub async fn serve_until_signal(
    engine: Arc<Engine>,
    listener: TcpListener,
    cfg: ServerConfig,
) -> std::io::Result<()> {
    cfg.validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
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
