//! The generation endpoints: SGLang's `/generate`, OpenAI's `/v1/completions` and
//! `/v1/chat/completions`, whole or streamed as SSE.
//!
//! Every request runs under an unguessable server id; a client's own id (`rid`,
//! `X-Request-Id`) is a label kept beside it while the request runs ([`super::ids`]) and
//! names the response (`cmpl-<label>`). The seed a request sampled with is in its
//! response (`seed`, `meta_info.seed`). A request that runs past the request timeout is
//! aborted and counted as a timeout.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hyper::header::HeaderValue;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api::{digest_hex, ApiError, ChatRequest, CompletionRequest, GenerateBody, Usage};
use super::app::{App, Meta};
use super::ids::{check_client_id, ClientIdGuard};
use super::response::{json_response, sse_data, sse_response, Resp};
use super::tools::{self, ChatReply, Delta};
use crate::engine::Completion;
use crate::engine::{Event, FinishReason, GenerateRequest, RequestHandle};

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn finish_json(reason: FinishReason, matched: Option<&str>) -> Value {
    match matched {
        Some(m) => json!({"type": reason.as_str(), "matched": m}),
        None => json!({"type": reason.as_str()}),
    }
}

/// A request in flight: its engine handle and what keeps its client label registered.
struct Running {
    handle: RequestHandle,
    _label: Option<ClientIdGuard>,
    /// The client's label, or the server id: what names the response.
    name: String,
}

fn with_request_id(mut r: Resp, id: &str) -> Resp {
    if let Ok(v) = HeaderValue::from_str(id) {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}

impl App {
    /// Submits a request labelled `label` by its client (when given), the label owned by
    /// `meta.owner`.
    fn start(
        &self,
        req: GenerateRequest,
        label: Option<&str>,
        meta: &Meta,
    ) -> Result<Running, ApiError> {
        let handle = self.engine.submit(req).map_err(|e| ApiError {
            counted: true,
            ..ApiError::from(e)
        })?;
        let name = label.unwrap_or(handle.rid()).to_string();
        let label = label.map(|l| self.client_ids.register(meta.owner, l, handle.rid()));
        Ok(Running {
            handle,
            _label: label,
            name,
        })
    }

    /// Waits for a whole completion within the request timeout (expiring it after).
    async fn complete(&self, r: &mut Running) -> Result<Completion, ApiError> {
        let limit = self.cfg.request_timeout;
        match tokio::time::timeout(limit, r.handle.collect_mut()).await {
            Ok(c) => c.map_err(ApiError::from),
            Err(_) => {
                r.handle.expire();
                Err(ApiError::status(
                    504,
                    "server_error",
                    format!("the request did not finish within {limit:?}"),
                )
                .with_code("timeout"))
            }
        }
    }

    /// Streams a request's events as SSE: `render(event)` gives the chunks of each event
    /// and `[DONE]` ends the stream. The task ends (and its handle drops, aborting the
    /// request) as soon as the client is gone; past the request timeout the request is
    /// expired and the stream ends with a timeout error.
    fn stream(
        &self,
        r: Running,
        mut render: impl FnMut(&Event) -> Vec<Value> + Send + 'static,
    ) -> Resp {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let timeout = self.cfg.request_timeout;
        let id = r.name.clone();
        tokio::spawn(async move {
            let mut r = r;
            let deadline = tokio::time::Instant::from_std(crate::deadline_after(timeout));
            loop {
                let ev = tokio::select! {
                    ev = r.handle.next_event() => ev,
                    _ = tx.closed() => break,
                    _ = tokio::time::sleep_until(deadline) => {
                        r.handle.expire();
                        let e = ApiError::status(504, "server_error", "request timed out")
                            .with_code("timeout");
                        // Never wait on a client that stopped reading.
                        let _ = tx.try_send(sse_data(&e.body()));
                        break;
                    }
                };
                let Some(ev) = ev else { break };
                let last = matches!(ev, Event::Done(_) | Event::Error(_));
                let chunks = match &ev {
                    Event::Error(e) => vec![ApiError::from(e.clone()).body()],
                    other => render(other),
                };
                // A client that stops reading fills the channel: each send waits at most
                // until the request's deadline, which then expires the request.
                for c in chunks {
                    match tokio::time::timeout_at(deadline, tx.send(sse_data(&c))).await {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) => return,
                        Err(_) => {
                            r.handle.expire();
                            return;
                        }
                    }
                }
                if last {
                    let done = Bytes::from_static(b"data: [DONE]\n\n");
                    let _ = tokio::time::timeout_at(deadline, tx.send(done)).await;
                    break;
                }
            }
        });
        with_request_id(sse_response(rx), &id)
    }

    pub(crate) async fn generate(
        self: Arc<Self>,
        body: &[u8],
        meta: &Meta,
    ) -> Result<Resp, ApiError> {
        let b = GenerateBody::parse(body)?;
        if let Some(rid) = &b.rid {
            check_client_id(rid, "rid")?;
        }
        let label = b.rid.as_deref().or(meta.request_id.as_deref());
        let sampling = b.params()?;
        let seed = sampling.seed;
        let req = GenerateRequest::new(b.tokens()?, sampling);
        let prompt_tokens = req.prompt.len();
        let r = self.start(req, label, meta)?;
        let rid = r.name.clone();
        let digests = b.return_logits_digest;
        if b.stream {
            let (mut text, mut ids, mut dg) = (String::new(), Vec::new(), Vec::new());
            return Ok(self.stream(r, move |ev| {
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
                    "id": rid, "prompt_tokens": prompt_tokens, "seed": seed,
                    "completion_tokens": ids.len(), "finish_reason": finish,
                });
                if digests {
                    meta["logits_digests"] = json!(dg);
                }
                vec![json!({"text": text, "output_ids": ids, "meta_info": meta})]
            }));
        }
        let mut r = r;
        let c = self.complete(&mut r).await?;
        let mut meta = json!({
            "id": rid, "prompt_tokens": prompt_tokens, "seed": seed,
            "completion_tokens": c.tokens.len(),
            "finish_reason": finish_json(c.finish, c.matched.as_deref()),
            "ttft_seconds": c.ttft,
        });
        if digests {
            meta["logits_digests"] =
                json!(c.digests.iter().map(|d| digest_hex(*d)).collect::<Vec<_>>());
        }
        Ok(with_request_id(
            json_response(
                200,
                &json!({"text": c.text, "output_ids": c.tokens, "meta_info": meta}),
            ),
            &rid,
        ))
    }

    pub(crate) async fn completions(
        self: Arc<Self>,
        body: &[u8],
        meta: &Meta,
    ) -> Result<Resp, ApiError> {
        let r = CompletionRequest::parse(body)?;
        self.check_model(&r.model)?;
        let prompt = r.prompt.tokens()?;
        let max_context = self.engine.info().max_context;
        let sampling = r.sampling.to_params(prompt.len(), max_context)?;
        let seed = sampling.seed;
        let prompt_tokens = prompt.len();
        let run = self.start(
            GenerateRequest::new(prompt, sampling),
            meta.request_id.as_deref(),
            meta,
        )?;
        let id = format!("cmpl-{}", run.name);
        let (model, created) = (self.model.clone(), unix_now());
        if r.stream {
            let usage = r.stream_options.is_some_and(|o| o.include_usage);
            let mut n = 0;
            return Ok(self.stream(run, move |ev| {
                let chunk = |text: &str, finish: Option<&str>| {
                    json!({"id": id, "object": "text_completion", "created": created, "model": model,
                           "seed": seed,
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
        let mut run = run;
        let c = self.complete(&mut run).await?;
        Ok(with_request_id(
            json_response(
                200,
                &json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "seed": seed,
                    "choices": [{"index": 0, "text": c.text, "logprobs": null,
                                 "finish_reason": c.finish.as_str()}],
                    "usage": Usage::new(prompt_tokens, c.tokens.len()),
                }),
            ),
            &run.name,
        ))
    }

    pub(crate) async fn chat(self: Arc<Self>, body: &[u8], meta: &Meta) -> Result<Resp, ApiError> {
        let r = ChatRequest::parse(body)?;
        self.check_model(&r.model)?;
        let plan = tools::plan(&r, self.cfg.tool_parser)?;
        let max_context = self.engine.info().max_context;
        let sampling = r.sampling.to_params(plan.prompt.len(), max_context)?;
        let seed = sampling.seed;
        let prompt_tokens = plan.prompt.len();
        let run = self.start(
            GenerateRequest::new(plan.prompt.clone(), sampling),
            meta.request_id.as_deref(),
            meta,
        )?;
        let id = format!("chatcmpl-{}", run.name);
        let (model, created) = (self.model.clone(), unix_now());
        let metrics = self.engine.metrics().clone();
        // OpenAI's finish reason: a reply that ended (not cut) after calling tools.
        let finish = |reason: FinishReason, calls: usize| match reason {
            FinishReason::Stop if calls > 0 => "tool_calls",
            other => other.as_str(),
        };
        if r.stream {
            let usage = r.stream_options.is_some_and(|o| o.include_usage);
            let mut n = 0;
            let mut first = true;
            let mut reply = ChatReply::new(&plan);
            return Ok(self.stream(run, move |ev| {
                let chunk = |delta: Value, finish: Option<&str>| {
                    json!({"id": id, "object": "chat.completion.chunk", "created": created,
                           "model": model, "seed": seed,
                           "choices": [{"index": 0, "delta": delta, "logprobs": null,
                                        "finish_reason": finish}]})
                };
                let mut out = Vec::new();
                if first {
                    first = false;
                    out.push(chunk(json!({"role": "assistant", "content": ""}), None));
                }
                let mut deltas = Vec::new();
                let mut done = None;
                match ev {
                    Event::Token(t) => {
                        n += 1;
                        deltas = reply.push(&t.text);
                    }
                    Event::Done(f) => {
                        deltas = reply.push(&f.text);
                        deltas.extend(reply.finish());
                        done = Some(f.reason);
                    }
                    Event::Error(_) => {}
                }
                for _ in 0..std::mem::take(&mut reply.failures) {
                    metrics.tool_call_parse_failure();
                }
                for d in deltas {
                    match d {
                        Delta::Content(t) if t.is_empty() => {}
                        Delta::Content(t) => out.push(chunk(json!({"content": t}), None)),
                        Delta::Call { index, call } => {
                            let mut head = call.clone();
                            head["function"]["arguments"] = json!("");
                            head["index"] = json!(index);
                            out.push(chunk(json!({"tool_calls": [head]}), None));
                            let args = json!({"index": index,
                                "function": {"arguments": call["function"]["arguments"]}});
                            out.push(chunk(json!({"tool_calls": [args]}), None));
                        }
                    }
                }
                if let Some(reason) = done {
                    out.push(chunk(json!({}), Some(finish(reason, reply.calls()))));
                    if usage {
                        out.push(json!({"id": id, "object": "chat.completion.chunk",
                            "created": created, "model": model, "choices": [],
                            "usage": Usage::new(prompt_tokens, n)}));
                    }
                }
                out
            }));
        }
        let mut run = run;
        let c = self.complete(&mut run).await?;
        let (message, failures) = tools::whole_message(&plan, &c.text);
        for _ in 0..failures {
            metrics.tool_call_parse_failure();
        }
        let calls = message["tool_calls"].as_array().map_or(0, Vec::len);
        Ok(with_request_id(
            json_response(
                200,
                &json!({
                    "id": id, "object": "chat.completion", "created": created, "model": model,
                    "seed": seed,
                    "choices": [{"index": 0, "message": message, "logprobs": null,
                                 "finish_reason": finish(c.finish, calls)}],
                    "usage": Usage::new(prompt_tokens, c.tokens.len()),
                }),
            ),
            &run.name,
        ))
    }
}
