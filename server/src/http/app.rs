//! The router and the endpoints that do not generate: health, models, server info,
//! metrics, tokenize/detokenize, abort. Every request goes through the same gate: CORS
//! preflights, the framing check, the `X-Request-Id` check, the API key.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{
    HeaderValue, ACCEPT, AUTHORIZATION, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, ORIGIN,
};
use hyper::{Method, Request};
use serde_json::{json, Value};

use super::api::{parse, AbortBody, ApiError, DetokenizeBody, TokenizeBody};
use super::framing::INVALID_CONTENT_LENGTH;
use super::ids::{self, check_client_id, ClientAddr, ClientIds, Owner};
use super::response::{error_response, json_response, text_response, Resp};
use super::{auth, ServerConfig};
use crate::engine::tokenizer::{self, VOCAB_SIZE};
use crate::engine::Engine;
use crate::metrics::expose::Format;
use crate::metrics::{Metrics, RequestStatus};

/// Shared state of the handlers.
pub(crate) struct App {
    pub engine: Arc<Engine>,
    pub cfg: ServerConfig,
    pub cors: super::cors::Cors,
    /// The name requests must use (`--served-model-name`, or the engine's model).
    pub model: String,
    pub created: u64,
    pub client_ids: Arc<ClientIds>,
}

/// What the router knows of a request besides its body.
#[derive(Debug, Clone, Default)]
pub(crate) struct Meta {
    /// `X-Request-Id`, checked.
    pub request_id: Option<String>,
    /// Whose labels the request may set and abort by ([`ids::owner`] of its
    /// [`ClientAddr`]).
    pub owner: Owner,
}

/// A 415 unless a request body's `Content-Type` is JSON (`application/json` or
/// `application/*+json`, parameters allowed) or absent, as the FastAPI servers (vLLM,
/// SGLang) decide. (Browser pages of other origins are refused before this, by their
/// `Origin`: [`super::cors::Cors::refuses`].)
fn json_body_type(content_type: Option<&[u8]>) -> Result<(), ApiError> {
    let Some(raw) = content_type else {
        return Ok(());
    };
    let mime = std::str::from_utf8(raw)
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let json = mime == "application/json"
        || mime
            .strip_prefix("application/")
            .is_some_and(|t| t.ends_with("+json"));
    if json {
        return Ok(());
    }
    Err(ApiError::status(
        415,
        "invalid_request_error",
        format!(
            "Content-Type {:?} is not JSON: send application/json",
            String::from_utf8_lossy(raw)
        ),
    )
    .with_param("content-type"))
}

fn header(req: &Request<Incoming>, name: impl hyper::header::AsHeaderName) -> Option<&[u8]> {
    req.headers().get(name).map(HeaderValue::as_bytes)
}

impl App {
    pub fn check_model(&self, name: &str) -> Result<(), ApiError> {
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

    /// A 4xx for a generation request, counted as rejected (unless the engine counted it).
    pub fn reject(&self, e: ApiError) -> Resp {
        if e.status < 500 && !e.counted {
            self.engine.metrics().request(RequestStatus::Rejected);
        }
        error_response(&e)
    }

    /// Reads a JSON body: a 415 for a `Content-Type` that is not JSON ([`json_body_type`]),
    /// a 413 past `max_body_bytes` (by header and by count).
    async fn body(&self, req: Request<Incoming>) -> Result<Bytes, ApiError> {
        json_body_type(header(&req, CONTENT_TYPE))?;
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
            if len.is_some_and(|l| l > max) {
                return Err(too_large());
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

    /// Routes a request and adds what every response carries (CORS, `X-Request-Id`).
    pub async fn route(self: Arc<Self>, req: Request<Incoming>) -> Resp {
        let origin = req.headers().get(ORIGIN).cloned();
        let echo = req.headers().get("x-request-id").cloned();
        let mut r = self.clone().gate(req).await;
        self.cors.decorate(&mut r, origin.as_ref());
        // The client's own id is echoed as sent (a generation response that has none
        // carries its server id).
        if let Some(id) = echo {
            r.headers_mut().insert("x-request-id", id);
        }
        r
    }

    async fn gate(self: Arc<Self>, req: Request<Incoming>) -> Resp {
        if req.method() == Method::OPTIONS {
            return self.cors.preflight(req.headers());
        }
        let origin = req.headers().get(ORIGIN);
        if req.method() == Method::POST && self.cors.refuses(origin) {
            let o = origin.map_or_else(String::new, |o| {
                String::from_utf8_lossy(o.as_bytes()).into_owned()
            });
            return error_response(&ApiError::status(
                403,
                "invalid_request_error",
                format!("a POST from the web page origin {o:?} is not allowed (--allowed-origins)"),
            ));
        }
        if req.headers().contains_key(INVALID_CONTENT_LENGTH) {
            let mut r = error_response(
                &ApiError::bad_request("invalid Content-Length header (a byte count is expected)")
                    .with_param("content-length"),
            );
            r.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
        let mut meta = Meta {
            owner: ids::owner(req.extensions().get::<ClientAddr>().copied()),
            ..Meta::default()
        };
        if let Some(v) = header(&req, "x-request-id") {
            let id = String::from_utf8_lossy(v).into_owned();
            if let Err(e) = check_client_id(&id, "x-request-id") {
                return error_response(&e);
            }
            meta.request_id = Some(id);
        }
        let path = req.uri().path().to_string();
        if !self.cfg.public_routes.is_public(&path) {
            if let Err(e) = auth::check(self.cfg.api_key.as_ref(), header(&req, AUTHORIZATION)) {
                return error_response(&e);
            }
        }
        self.dispatch(req, path, meta).await
    }

    async fn dispatch(self: Arc<Self>, req: Request<Incoming>, path: String, meta: Meta) -> Resp {
        let method = req.method().clone();
        let wrong_method = || {
            error_response(&ApiError::status(
                405,
                "invalid_request_error",
                format!("{method} is not allowed on {path}"),
            ))
        };
        let get = req.method() == Method::GET;
        let head = req.method() == Method::HEAD;
        let post = req.method() == Method::POST;
        match path.as_str() {
            // HEAD too (load balancers probe with it; hyper sends no body for a HEAD).
            "/health" | "/health_generate" if get || head => self.health(),
            "/server_info" | "/get_server_info" if get => json_response(200, &self.server_info()),
            "/metrics" if get => {
                let accept = req.headers().get(ACCEPT).and_then(|v| v.to_str().ok());
                let format = Format::negotiate(accept);
                text_response(200, format.content_type(), self.metrics_text(format))
            }
            "/v1/models" if get => {
                json_response(200, &json!({"object": "list", "data": [self.model_card()]}))
            }
            p if p.starts_with("/v1/models/") && get => {
                match self.check_model(&p["/v1/models/".len()..]) {
                    Ok(()) => json_response(200, &self.model_card()),
                    Err(e) => error_response(&e),
                }
            }
            "/generate" | "/v1/completions" | "/v1/chat/completions" if post => {
                let body = match self.body(req).await {
                    Ok(b) => b,
                    Err(e) => return self.reject(e),
                };
                let r = match path.as_str() {
                    "/generate" => self.clone().generate(&body, &meta).await,
                    "/v1/completions" => self.clone().completions(&body, &meta).await,
                    _ => self.clone().chat(&body, &meta).await,
                };
                r.unwrap_or_else(|e| self.reject(e))
            }
            "/abort_request" | "/tokenize" | "/detokenize" if post => {
                let r = match self.body(req).await {
                    Err(e) => Err(e),
                    Ok(body) => match path.as_str() {
                        "/abort_request" => self.abort(&body, &meta),
                        "/tokenize" => self.tokenize(&body),
                        _ => self.detokenize(&body),
                    },
                };
                r.unwrap_or_else(|e| error_response(&e))
            }
            "/health"
            | "/health_generate"
            | "/server_info"
            | "/get_server_info"
            | "/metrics"
            | "/v1/models"
            | "/generate"
            | "/v1/completions"
            | "/v1/chat/completions"
            | "/abort_request"
            | "/tokenize"
            | "/detokenize" => wrong_method(),
            p if p.starts_with("/v1/models/") => wrong_method(),
            _ => error_response(&ApiError::status(
                404,
                "invalid_request_error",
                format!("no route {path}"),
            )),
        }
    }

    pub fn health(&self) -> Resp {
        if self.engine.is_healthy() {
            json_response(200, &json!({"status": "ok"}))
        } else {
            json_response(503, &json!({"status": "unavailable"}))
        }
    }

    /// The engine's info; with `--pd on`, the other sides' under `pd.sides`.
    fn server_info(&self) -> Value {
        let mut v = serde_json::to_value(self.engine.info()).unwrap_or(Value::Null);
        v["served_model_name"] = json!(self.model);
        if let Some(pd) = self.engine.pd_info() {
            v["pd"] = serde_json::to_value(pd).unwrap_or(Value::Null);
        }
        for e in &self.cfg.other_sides {
            let role = e.metrics().role().to_string();
            v["pd"]["sides"][role] = serde_json::to_value(e.info()).unwrap_or(Value::Null);
        }
        v
    }

    /// Every engine's metrics in `format` (each side labelled by its role when there are
    /// several).
    fn metrics_text(&self, format: Format) -> String {
        let several = !self.cfg.other_sides.is_empty();
        let mut sides: Vec<(&Metrics, Option<&str>)> = Vec::new();
        for e in self
            .cfg
            .other_sides
            .iter()
            .chain(std::iter::once(&self.engine))
        {
            let m: &Metrics = e.metrics();
            sides.push((m, several.then(|| m.role())));
        }
        Metrics::expose(&sides, format)
    }

    pub fn model_card(&self) -> Value {
        let i = self.engine.info();
        json!({
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "sparsekit",
            "root": i.model,
            "max_model_len": i.max_context,
            "backend": i.backend,
            "kv_dtype": i.kv_dtype,
            "index_k_dtype": i.index_k_dtype,
            "index_topk": i.index_topk,
        })
    }

    /// Aborts the caller's requests labelled `rid` (never another client's: see
    /// [`super::ids`]), and the request whose server id is `rid`.
    fn abort(&self, body: &[u8], meta: &Meta) -> Result<Resp, ApiError> {
        let b: AbortBody = parse(body)?;
        let mut aborted = false;
        for id in self.client_ids.lookup(meta.owner, &b.rid) {
            aborted |= self.engine.abort(&id);
        }
        aborted |= self.engine.abort(&b.rid);
        Ok(json_response(
            200,
            &json!({"rid": b.rid, "aborted": aborted}),
        ))
    }

    fn tokenize(&self, body: &[u8]) -> Result<Resp, ApiError> {
        let b: TokenizeBody = parse(body)?;
        if let Some(m) = &b.model {
            self.check_model(m)?;
        }
        let tokens = match (&b.prompt, &b.messages) {
            (Some(p), None) if b.add_special_tokens.unwrap_or(true) => {
                tokenizer::completion_prompt(p)
            }
            (Some(p), None) => tokenizer::encode(p),
            (None, Some(msgs)) => {
                let r = super::api::ChatRequest {
                    model: self.model.clone(),
                    messages: msgs.clone(),
                    tools: None,
                    tool_choice: None,
                    parallel_tool_calls: None,
                    stream: false,
                    stream_options: None,
                    sampling: Default::default(),
                    user: None,
                };
                let mut t = super::tools::plan(&r, self.cfg.tool_parser)?.prompt;
                if !b.add_generation_prompt.unwrap_or(true) {
                    t.pop();
                }
                t
            }
            _ => {
                return Err(
                    ApiError::bad_request("give exactly one of prompt and messages")
                        .with_param("prompt"),
                )
            }
        };
        Ok(json_response(
            200,
            &json!({"count": tokens.len(), "max_model_len": self.engine.info().max_context,
                    "tokens": tokens}),
        ))
    }

    fn detokenize(&self, body: &[u8]) -> Result<Resp, ApiError> {
        let b: DetokenizeBody = parse(body)?;
        if let Some(m) = &b.model {
            self.check_model(m)?;
        }
        if let Some((i, t)) = b
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= VOCAB_SIZE)
        {
            return Err(ApiError::bad_request(format!(
                "token {i} is {t}, outside the vocabulary of {VOCAB_SIZE}"
            ))
            .with_param("tokens"));
        }
        Ok(json_response(
            200,
            &json!({"prompt": tokenizer::decode(&b.tokens)}),
        ))
    }
}
