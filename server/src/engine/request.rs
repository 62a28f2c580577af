//! A request's side of the engine: what is asked ([`GenerateRequest`]), what comes back
//! ([`Event`]s in order, folded into a [`Completion`]) and the [`RequestHandle`] that
//! receives them and aborts the request when dropped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::engine::kv::ReceivedPages;
use crate::engine::sampling::SamplingParams;
use crate::engine::service::{Command, Inner};
use crate::error::EngineError;

/// A generation request.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Caller's request id; when `None`, a fresh unguessable one ([`random_id`](crate::engine::random_id)). Must be
    /// unique among requests in flight (the HTTP server always lets the engine choose:
    /// clients' ids live in their own namespace, see `http::ids`).
    pub id: Option<String>,
    /// Prompt token ids (non-empty, each below the vocabulary size).
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// The prompt's KV arrived by transfer (PD decode side): adopt these pages instead
    /// of computing them (see [`ReceivedPages`]); needs a cache-backed engine.
    pub received: Option<ReceivedPages>,
}

impl GenerateRequest {
    /// A request for `prompt` with `sampling` (generated id, prompt computed here).
    pub fn new(prompt: Vec<u32>, sampling: SamplingParams) -> Self {
        GenerateRequest {
            id: None,
            prompt,
            sampling,
            received: None,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop string, stop token or end-of-turn.
    Stop,
    /// Aborted before the end.
    Abort,
}

impl FinishReason {
    /// OpenAI's name.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

/// One generated token.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenEvent {
    pub token: u32,
    /// Position of the token in the sequence (prompt length + index in the output).
    pub position: usize,
    /// Digest of the logits row this token was sampled from ([`logits_digest`](crate::engine::logits_digest)).
    pub logits_digest: u64,
    /// Text that became final with this token (may be empty: held back for a possible
    /// stop string or an incomplete UTF-8 sequence).
    pub text: String,
}

/// The end of a request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finished {
    pub reason: FinishReason,
    /// What matched when `reason` is `Stop`: the stop string or the token id.
    pub matched: Option<String>,
    /// Text released at the end (the rest of what was held back).
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What a request's handle receives, in order: tokens, then exactly one `Done` or `Error`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    Done(Finished),
    Error(EngineError),
}

/// A request's full result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Completion {
    pub rid: String,
    pub prompt_tokens: usize,
    /// Generated token ids (including a final end-of-turn or stop token).
    pub tokens: Vec<u32>,
    /// Digest of the logits of every generated token.
    pub digests: Vec<u64>,
    /// Generated text (stop string excluded).
    pub text: String,
    pub finish: FinishReason,
    pub matched: Option<String>,
    /// Seconds from submission to the first token (None when none came).
    pub ttft: Option<f64>,
}

/// The flags a request's handle and the engine thread share.
pub(super) struct ReqShared {
    pub(super) aborted: AtomicBool,
    pub(super) finished: AtomicBool,
    /// The abort is the request timeout's (counted as `timeout`, not `aborted`).
    pub(super) timed_out: AtomicBool,
}

/// A request's end of the engine: events in order, abort, and abort on drop (a client
/// that goes away aborts its request).
pub struct RequestHandle {
    rid: String,
    events: flume::Receiver<Event>,
    shared: Arc<ReqShared>,
    inner: Arc<Inner>,
    done: bool,
    submitted: Instant,
}

impl std::fmt::Debug for RequestHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestHandle")
            .field("rid", &self.rid)
            .field("done", &self.done)
            .finish()
    }
}

impl RequestHandle {
    pub(super) fn new(
        rid: String,
        events: flume::Receiver<Event>,
        shared: Arc<ReqShared>,
        inner: Arc<Inner>,
        submitted: Instant,
    ) -> Self {
        RequestHandle {
            rid,
            events,
            shared,
            inner,
            done: false,
            submitted,
        }
    }

    /// The request id.
    pub fn rid(&self) -> &str {
        &self.rid
    }

    /// Aborts the request because it ran past its deadline: as [`RequestHandle::abort`],
    /// counted in `sparsekit_requests_total{status="timeout"}`.
    pub fn expire(&self) {
        self.shared.timed_out.store(true, Ordering::Release);
        self.abort();
    }

    /// Asks the engine to abort the request (effective at the next step boundary).
    pub fn abort(&self) {
        if !self.shared.finished.load(Ordering::Acquire) {
            self.shared.aborted.store(true, Ordering::Release);
            let _ = self.inner.commands.send(Command::Wake);
        }
    }

    fn track(&mut self, ev: Result<Event, flume::RecvError>) -> Option<Event> {
        match ev {
            Ok(e) => {
                if matches!(e, Event::Done(_) | Event::Error(_)) {
                    self.done = true;
                }
                Some(e)
            }
            Err(_) if !self.done => {
                self.done = true;
                Some(Event::Error(EngineError::Unavailable(
                    "the engine stopped before the request ended".into(),
                )))
            }
            Err(_) => None,
        }
    }

    /// The next event; `None` after the last one.
    pub async fn next_event(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let ev = self.events.recv_async().await;
        self.track(ev)
    }

    /// The next event, waiting at most `timeout`.
    pub fn next_event_timeout(&mut self, timeout: Duration) -> Result<Option<Event>, EngineError> {
        if self.done {
            return Ok(None);
        }
        match self.events.recv_timeout(timeout) {
            Ok(e) => Ok(self.track(Ok(e))),
            Err(flume::RecvTimeoutError::Timeout) => Err(EngineError::Timeout(format!(
                "no event for request {} within {timeout:?}",
                self.rid
            ))),
            Err(flume::RecvTimeoutError::Disconnected) => {
                Ok(self.track(Err(flume::RecvError::Disconnected)))
            }
        }
    }

    fn fold(&mut self, c: &mut Completion, ev: Event) -> Result<bool, EngineError> {
        match ev {
            Event::Token(t) => {
                if c.ttft.is_none() {
                    c.ttft = Some(self.submitted.elapsed().as_secs_f64());
                }
                c.tokens.push(t.token);
                c.digests.push(t.logits_digest);
                c.text.push_str(&t.text);
                Ok(false)
            }
            Event::Done(f) => {
                c.text.push_str(&f.text);
                c.finish = f.reason;
                c.matched = f.matched;
                c.prompt_tokens = f.prompt_tokens;
                Ok(true)
            }
            Event::Error(e) => Err(e),
        }
    }

    fn empty(&self) -> Completion {
        Completion {
            rid: self.rid.clone(),
            prompt_tokens: 0,
            tokens: Vec::new(),
            digests: Vec::new(),
            text: String::new(),
            finish: FinishReason::Abort,
            matched: None,
            ttft: None,
        }
    }

    /// Waits for the whole result; the request is aborted if it has not ended within
    /// `timeout`.
    pub fn wait(mut self, timeout: Duration) -> Result<Completion, EngineError> {
        let deadline = crate::deadline_after(timeout);
        let mut c = self.empty();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = self.next_event_timeout(left).inspect_err(|e| {
                if matches!(e, EngineError::Timeout(_)) {
                    self.expire();
                }
            })?;
            match ev {
                Some(ev) => {
                    if self.fold(&mut c, ev)? {
                        return Ok(c);
                    }
                }
                None => return Ok(c),
            }
        }
    }

    /// Async [`RequestHandle::wait`] without a deadline of its own (wrap it in a timeout).
    pub async fn collect(mut self) -> Result<Completion, EngineError> {
        self.collect_mut().await
    }

    /// [`RequestHandle::collect`] through a borrow: wrapped in a timeout, the handle is
    /// still there when it expires (to [`RequestHandle::expire`] it).
    pub async fn collect_mut(&mut self) -> Result<Completion, EngineError> {
        let mut c = self.empty();
        while let Some(ev) = self.next_event().await {
            if self.fold(&mut c, ev)? {
                break;
            }
        }
        Ok(c)
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        if !self.done {
            self.abort();
        }
    }
}
