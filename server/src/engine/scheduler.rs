//! The engine thread: continuous batching with chunked prefill over a [`KvSpace`].
//!
//! Requests are submitted from any thread and answered through per-request event
//! channels. Every step mixes one decode row per decoding sequence with prefill chunks of
//! the sequences still reading their prompt (oldest first, at most `prefill_chunk`
//! tokens each, `max_batch_tokens` rows in all — and at least `min_prefill_tokens` of
//! prefill per step however many sequences decode, so no prompt waits without a bound).
//!
//! Admission is first-come first-served and reserves each request's pages for its whole
//! budget (prompt + `max_new_tokens`) up front: a running sequence never waits for pages
//! and nothing is preempted. A request that could never fit is refused at submission.
//!
//! Aborts (from the handle, its drop — a client that went away —, `/abort_request`, or
//! shutdown) take effect at the next step boundary: the sequence's pages are released and
//! its handle gets [`Event::Done`] with [`FinishReason::Abort`]. A step whose forward pass
//! returns an error or panics fails exactly the requests in that step (each gets
//! [`Event::Error`] and its pages back); the engine goes on with the others.
//!
//! Every wait is bounded: the engine blocks on its command channel for at most
//! [`IDLE_WAIT`] at a time, handles wait with a timeout or asynchronously, shutdown joins
//! with a deadline.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sparsekit_host::{Backend, ModelOps};

use crate::engine::batch::{SeqChunk, StepBatch};
use crate::engine::json_object::JsonObjectState;
use crate::engine::kernel_check::{self, CheckCounts, KernelCheck};
use crate::engine::kv::{KvSpace, ReceivedPages, SeqId};
use crate::engine::model::{logits_digest, Model};
use crate::engine::options::EngineOptions;
use crate::engine::request::{Event, FinishReason, Finished, ReqShared, TokenEvent};
use crate::engine::sampling::{sample_in, SamplingParams, SeqView};
use crate::engine::service::{lock, Command, Inner};
use crate::engine::tokenizer::{TextStream, END};
use crate::error::EngineError;
use crate::metrics::RequestStatus;

/// Longest the idle engine thread blocks on its command channel before looking again.
pub const IDLE_WAIT: Duration = Duration::from_millis(50);

/// Longest the engine thread blocks, when every waiting request waits for pages and
/// nothing runs, before it tries to admit again.
pub const BLOCKED_WAIT: Duration = Duration::from_millis(5);

/// A request inside the engine thread.
pub(super) struct Seq {
    /// The JSON object recogniser of a `json_object` request.
    pub(super) json: Option<JsonObjectState>,
    /// Scripted tokens still to come, last first ([`ReplyScript`]).
    pub(super) script: Option<Vec<u32>>,
    pub(super) id: SeqId,
    pub(super) rid: String,
    /// Prompt followed by the generated tokens.
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: usize,
    /// Tokens prefilled (computed in chunks, logits of the last only): the prompt, or
    /// every token so far for a request recomputing after an integrity fallback.
    pub(super) prefill_end: usize,
    /// Whether admission may reuse a cached prefix (off after an integrity fallback).
    pub(super) reuse: bool,
    /// Integrity fallbacks taken (at most one: a second failure fails the request).
    pub(super) fallbacks: u8,
    /// Tokens whose KV and index keys are in the cache.
    pub(super) computed: usize,
    /// Pages received for the prompt (PD decode side).
    pub(super) received: Option<ReceivedPages>,
    /// Hold the committed prompt pages for this channel ([`Engine::submit_held`]).
    pub(super) hold: Option<flume::Sender<ReceivedPages>>,
    /// Admitted by the KV space (holds its pages).
    pub(super) admitted: bool,
    pub(super) params: SamplingParams,
    pub(super) text: TextStream,
    pub(super) events: flume::Sender<Event>,
    pub(super) shared: Arc<ReqShared>,
    pub(super) arrival: Instant,
    pub(super) last_token: Option<Instant>,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn prefilling(&self) -> bool {
        self.computed < self.prefill_end
    }
}

/// The engine thread's state: the model, the KV space, the queues.
pub(super) struct Scheduler<B: Backend + ModelOps, S: KvSpace<B>> {
    model: Model<B>,
    space: S,
    opts: EngineOptions,
    inner: Arc<Inner>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    drain_until: Option<Instant>,
    /// This engine's kernel checks, and the counts already on `/metrics`.
    check: Option<Arc<KernelCheck>>,
    checks_published: [CheckCounts; kernel_check::OPS.len()],
}

/// How a sequence leaves the engine.
enum End {
    Done(Finished),
    Failed(EngineError),
}

/// A cache failure that recomputing the request's prefix can serve.
#[derive(Clone, Copy, Debug)]
struct Fallback {
    /// The check it comes from (the metric's `reason`).
    reason: &'static str,
    /// Whether it is evidence against the cached bytes, so the prefix must be dropped. A
    /// load past its bound (a slow machine) or a prefix another request already dropped
    /// says nothing about them: dropping a widely shared prefix for it would fail every
    /// request on it and make them all recompute (a retry storm under load).
    against_bytes: bool,
}

/// The fallback a cache failure allows (`None`: not an integrity failure, e.g. an abort).
fn integrity_fallback(e: &sparsekit_host::Error) -> Option<Fallback> {
    use sparsekit_host::Error as E;
    let (reason, against_bytes) = match e {
        E::Integrity { .. } => ("checksum", true),
        E::NotLanded { .. } => ("not_landed", true),
        E::Unwritten { .. } => ("unwritten", true),
        E::LayoutMismatch { .. } => ("layout", true),
        E::Timeout { .. } => ("load_timeout", false),
        E::Cancelled(m) if m.contains("discarded") || m.contains("left the device tier") => {
            ("prefix_discarded", false)
        }
        E::RequestFailed { cause, .. } => return integrity_fallback(cause),
        _ => return None,
    };
    Some(Fallback {
        reason,
        against_bytes,
    })
}

pub(super) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

impl<B: Backend + ModelOps, S: KvSpace<B>> Scheduler<B, S> {
    pub(super) fn new(
        model: Model<B>,
        space: S,
        opts: EngineOptions,
        inner: Arc<Inner>,
        check: Option<Arc<KernelCheck>>,
    ) -> Self {
        Scheduler {
            model,
            space,
            opts,
            inner,
            waiting: VecDeque::new(),
            running: Vec::new(),
            drain_until: None,
            check,
            checks_published: Default::default(),
        }
    }

    /// The engine thread's loop, until shutdown has drained (or the channel is gone).
    pub(super) fn run(&mut self, rx: flume::Receiver<Command>) {
        loop {
            let idle = self.waiting.is_empty() && self.running.is_empty();
            if idle {
                if self.drain_until.is_some() {
                    break;
                }
                self.note_idle();
                match rx.recv_timeout(IDLE_WAIT) {
                    Ok(c) => self.command(c),
                    Err(flume::RecvTimeoutError::Timeout) => continue,
                    Err(flume::RecvTimeoutError::Disconnected) => {
                        self.drain_until = Some(Instant::now());
                    }
                }
            }
            while let Ok(c) = rx.try_recv() {
                self.command(c);
            }
            self.sweep_aborts();
            let admitted = self.admit();
            if self.running.is_empty() && admitted == 0 && !self.waiting.is_empty() {
                // Waiting for pages that nothing running will free: wait for a command
                // (a submit, an abort, a wake) or a short while for pages freed elsewhere
                // (fetches giving up, backups landing) — never spin.
                self.publish_stats();
                match rx.recv_timeout(BLOCKED_WAIT) {
                    Ok(c) => self.command(c),
                    Err(flume::RecvTimeoutError::Timeout) => {}
                    Err(flume::RecvTimeoutError::Disconnected) => {
                        self.drain_until = Some(Instant::now());
                    }
                }
                continue;
            }
            self.step();
            self.publish_stats();
        }
        // Nothing may stay behind: fail what is left (nothing normally).
        let left: Vec<Seq> = self
            .waiting
            .drain(..)
            .chain(self.running.drain(..))
            .collect();
        for s in left {
            self.end(
                s,
                End::Failed(EngineError::Unavailable("engine stopped".into())),
            );
        }
        self.publish_stats();
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Submit(s) => self.waiting.push_back(*s),
            Command::Wake => {}
            Command::Shutdown { drain_until } => {
                self.drain_until =
                    Some(self.drain_until.map_or(drain_until, |d| d.min(drain_until)));
            }
        }
    }

    fn note_idle(&mut self) {
        if self.inner.fetching.load(Ordering::Acquire) > 0 {
            // Pages of fetches in flight are held for requests not queued yet: the
            // accounting is checked once they are.
            return;
        }
        let check = self.space.leak_check().map_err(|e| e.to_string());
        let leaked = self.space.leaked_pages();
        self.space.publish(&self.inner.metrics);
        // Idle: nothing running, waiting or fetching (a request that failed in its fetch
        // leaves no step behind to publish this).
        self.inner.metrics.in_engine(0, 0);
        self.inner.metrics.idle_check(leaked);
        let mut st = lock(&self.inner.stats);
        st.leak_check = Some(check);
        st.leaked_pages = leaked;
    }

    fn publish_stats(&mut self) {
        if let Some(check) = &self.check {
            let now = check.counts();
            for (i, (n, was)) in now.iter().zip(&self.checks_published).enumerate() {
                let m = &self.inner.metrics;
                m.kernel_checks(kernel_check::OPS[i], "ok", n.ok - was.ok);
                m.kernel_checks(kernel_check::OPS[i], "mismatch", n.mismatch - was.mismatch);
            }
            self.checks_published = now;
        }
        let (free, cap) = (self.space.free_pages(), self.space.capacity_pages());
        self.space.publish(&self.inner.metrics);
        let fetching = self.inner.fetching.load(Ordering::Acquire);
        self.inner
            .metrics
            .in_engine(self.running.len(), self.waiting.len() + fetching);
        let mut st = lock(&self.inner.stats);
        st.waiting = self.waiting.len();
        st.running = self.running.len();
        st.free_pages = free;
        st.capacity_pages = cap;
    }

    /// Ends a sequence: commits (normal end) or releases (abort, failure) its pages, sends
    /// its last event, counts it.
    fn end(&mut self, s: Seq, how: End) {
        match &how {
            End::Done(f) if f.reason != FinishReason::Abort && s.admitted => match &s.hold {
                Some(tx) => {
                    let computed = s.computed.min(s.prompt_len);
                    if let Some(h) = self.space.commit_held(s.id, &s.tokens, computed) {
                        if let Err(flume::SendError(h)) = tx.send(h) {
                            self.space.release_received(&h);
                        }
                    }
                }
                None => {
                    self.space.commit(s.id, &s.tokens, s.computed);
                }
            },
            _ => {
                // Admitted, or waiting with a prefix the space already holds for it.
                self.space.release(s.id);
                if let (false, Some(r)) = (s.admitted, &s.received) {
                    self.space.release_received(r);
                }
            }
        }
        s.shared.finished.store(true, Ordering::Release);
        self.inner.forget(&s.rid);
        let timed_out = s.shared.timed_out.load(Ordering::Acquire);
        let status = match &how {
            End::Done(f) if f.reason == FinishReason::Abort && timed_out => RequestStatus::Timeout,
            End::Done(f) if f.reason == FinishReason::Abort => RequestStatus::Aborted,
            End::Done(_) => RequestStatus::Ok,
            End::Failed(_) => RequestStatus::Failed,
        };
        self.inner.metrics.request(status);
        self.inner.metrics.e2e(s.arrival.elapsed().as_secs_f64());
        // Counters first, so a handle that sees its last event sees its pages freed.
        self.publish_stats();
        let ev = match how {
            End::Done(f) => Event::Done(f),
            End::Failed(e) => Event::Error(e),
        };
        let _ = s.events.send(ev);
    }

    fn abort_seq(&mut self, mut s: Seq) {
        let text = s.text.finish();
        let f = Finished {
            reason: FinishReason::Abort,
            matched: None,
            text,
            prompt_tokens: s.prompt_len,
            completion_tokens: s.generated(),
        };
        self.end(s, End::Done(f));
    }

    fn sweep_aborts(&mut self) {
        let past_drain = self.drain_until.is_some_and(|d| Instant::now() >= d);
        let mut i = 0;
        while i < self.waiting.len() {
            let s = &self.waiting[i];
            if past_drain || s.shared.aborted.load(Ordering::Acquire) || s.events.is_disconnected()
            {
                if let Some(s) = self.waiting.remove(i) {
                    self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
                    self.abort_seq(s);
                }
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if past_drain || s.shared.aborted.load(Ordering::Acquire) || s.events.is_disconnected()
            {
                let s = self.running.remove(i);
                self.abort_seq(s);
            } else {
                i += 1;
            }
        }
    }

    /// Admits waiting requests in order while there is room. A request that cannot get
    /// its pages now blocks the ones behind it (first come, first served) — except those
    /// that bring every page they need (fetched over PD with their whole budget): they
    /// need nothing from the pool, so they go ahead, and as they finish they free the
    /// pages the blocked request waits for. Returns how many were admitted.
    fn admit(&mut self) -> usize {
        let mut admitted = 0;
        let mut blocked = false;
        let mut i = 0;
        while self.running.len() < self.opts.max_running && i < self.waiting.len() {
            let s = &self.waiting[i];
            if blocked && s.received.is_none() {
                i += 1;
                continue;
            }
            let total = s.prompt_len + s.params.max_new_tokens;
            match self.space.admit(
                s.id,
                &s.tokens[..s.prompt_len],
                total,
                s.received.as_ref(),
                s.reuse,
            ) {
                Ok(cached) => {
                    if let Some(mut s) = self.waiting.remove(i) {
                        self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
                        // The last prompt token is always computed: its logits are needed.
                        s.computed = cached.min(s.prefill_end - 1);
                        s.admitted = true;
                        self.inner
                            .metrics
                            .queue_time(s.arrival.elapsed().as_secs_f64());
                        self.running.push(s);
                        admitted += 1;
                    }
                }
                Err(EngineError::OutOfPages { .. }) => {
                    blocked = true;
                    i += 1;
                }
                Err(e) => {
                    if let Some(s) = self.waiting.remove(i) {
                        self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
                        self.end(s, End::Failed(e));
                    }
                }
            }
        }
        admitted
    }

    /// Picks the step's chunks: `(running index, start, len, wants logits)`.
    fn plan(&self) -> Vec<(usize, usize, usize, bool)> {
        let mut plan = Vec::new();
        let mut rows = 0;
        for (i, s) in self.running.iter().enumerate() {
            if !s.prefilling() {
                plan.push((i, s.computed, 1, true));
                rows += 1;
            }
        }
        let mut budget = self
            .opts
            .max_batch_tokens
            .saturating_sub(rows)
            .max(self.opts.min_prefill_tokens);
        for (i, s) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if s.prefilling() {
                let n = (s.prefill_end - s.computed)
                    .min(self.opts.prefill_chunk)
                    .min(budget);
                plan.push((i, s.computed, n, s.computed + n == s.prefill_end));
                budget -= n;
            }
        }
        plan
    }

    fn step(&mut self) {
        if self.running.is_empty() {
            return;
        }
        let plan = self.plan();
        if plan.is_empty() {
            return;
        }
        let ids: Vec<SeqId> = plan.iter().map(|p| self.running[p.0].id).collect();
        let page_size = self.model.config().page_size();
        let result = {
            let running = &self.running;
            let chunks: Vec<SeqChunk<'_>> = plan
                .iter()
                .map(|&(i, start, len, logits)| SeqChunk {
                    seq: running[i].id,
                    tokens: &running[i].tokens[start..start + len],
                    start,
                    logits,
                })
                .collect();
            let (model, space, fault) = (&self.model, &mut self.space, &self.opts.fault);
            catch_unwind(AssertUnwindSafe(|| {
                if let Some(f) = fault {
                    f(&ids);
                }
                let batch = StepBatch::build(&chunks, page_size, |s| space.pages(s))?;
                model.forward(&batch, space)
            }))
        };
        {
            let mut st = lock(&self.inner.stats);
            st.steps += 1;
            st.max_step_rows = st.max_step_rows.max(plan.iter().map(|p| p.2).sum());
            st.max_step_seqs = st.max_step_seqs.max(plan.len());
        }
        let logits = match result {
            Ok(Ok(l)) => l,
            Ok(Err(EngineError::SeqFailed { seq, cause })) if ids.contains(&seq) => {
                // One member failed in the cache: it alone leaves the step; the others
                // rerun it next time round (bit-identically: the pass is deterministic).
                if let Some(pos) = self.running.iter().position(|s| s.id == seq) {
                    let s = self.running.remove(pos);
                    self.seq_failed(s, cause);
                }
                return;
            }
            Ok(Err(e)) => return self.fail_step(&ids, e),
            Err(p) => {
                let msg = format!("panic: {}", panic_message(&*p));
                return self.fail_step(&ids, EngineError::StepFailed(msg));
            }
        };
        // Apply the step's results.
        let mut ended: Vec<(SeqId, End)> = Vec::new();
        let mut logit_row = 0;
        let prompt_tokens: usize = plan
            .iter()
            .filter(|p| self.running[p.0].prefilling())
            .map(|p| p.2)
            .sum();
        self.inner.metrics.tokens("prompt", prompt_tokens as u64);
        for &(i, _start, len, wants) in &plan {
            let s = &mut self.running[i];
            s.computed += len;
            if !wants {
                continue;
            }
            let row = logits.row(logit_row);
            logit_row += 1;
            let position = s.tokens.len();
            let view = SeqView {
                tokens: &s.tokens,
                prompt_len: s.prompt_len,
                json: s.json.as_ref(),
            };
            let drawn = match s.script.as_mut().and_then(Vec::pop) {
                Some(t) => Ok(t),
                None => sample_in(row, &s.params, position as u64, &view),
            };
            let token = match drawn {
                Ok(t) => t,
                Err(e) => {
                    ended.push((s.id, End::Failed(e)));
                    continue;
                }
            };
            let now = Instant::now();
            match s.last_token {
                None => self.inner.metrics.ttft((now - s.arrival).as_secs_f64()),
                Some(t) => self.inner.metrics.itl((now - t).as_secs_f64()),
            }
            s.last_token = Some(now);
            self.inner.metrics.tokens("generated", 1);
            s.tokens.push(token);
            if let (Some(j), Ok(b)) = (s.json.as_mut(), u8::try_from(token)) {
                j.push(b);
            }
            let stop_token =
                s.params.stop_token_ids.contains(&token) || (token == END && !s.params.ignore_eos);
            let stop_string = !stop_token && s.text.push(token);
            let text = s.text.take_delta();
            let _ = s.events.send(Event::Token(TokenEvent {
                token,
                position,
                logits_digest: logits_digest(row),
                text,
            }));
            let (reason, matched) = if stop_token {
                (Some(FinishReason::Stop), Some(token.to_string()))
            } else if stop_string {
                (Some(FinishReason::Stop), s.text.matched_stop())
            } else if s.generated() >= s.params.max_new_tokens
                || s.tokens.len() >= self.inner.info.max_context
            {
                (Some(FinishReason::Length), None)
            } else {
                (None, None)
            };
            if let Some(reason) = reason {
                let f = Finished {
                    reason,
                    matched,
                    text: s.text.finish(),
                    prompt_tokens: s.prompt_len,
                    completion_tokens: s.generated(),
                };
                ended.push((s.id, End::Done(f)));
            }
        }
        // Decoding sequences give back the window rows their tokens left (V4's window
        // pool; nothing elsewhere). A prompt's pages keep theirs: a later request's prefix
        // hit may end on any of them.
        for &(i, ..) in &plan {
            let s = &self.running[i];
            if s.computed > s.prompt_len {
                self.space.release_window(s.id, s.prompt_len, s.computed);
            }
        }
        for (id, how) in ended {
            if let Some(pos) = self.running.iter().position(|s| s.id == id) {
                let s = self.running.remove(pos);
                self.end(s, how);
            }
        }
    }

    /// A sequence whose cached or received prefix failed an integrity check: once, it
    /// drops that prefix from the cache (where the failure is evidence against its bytes,
    /// see [`Fallback`]) and goes back to the front of the queue to recompute every token
    /// it has (no reuse; its tokens so far are replayed, not
    /// resampled: the pass is deterministic, so it continues with the same bits). A second
    /// failure, or one that recomputing cannot help, fails it.
    fn seq_failed(&mut self, mut s: Seq, cause: sparsekit_host::Error) {
        let fallback = integrity_fallback(&cause);
        let retry =
            fallback.is_some() && s.fallbacks == 0 && !s.shared.aborted.load(Ordering::Acquire);
        if let (true, Some(f)) = (retry, fallback) {
            tracing::warn!(
                seq = s.id,
                error = %cause,
                dropped = f.against_bytes,
                "a prefix failed an integrity check: recomputing"
            );
            if f.against_bytes {
                self.space.discard_prefix(s.id);
            }
            // Running, so admitted: received pages it adopted go with its release.
            self.space.release(s.id);
            s.received = None;
            s.admitted = false;
            s.computed = 0;
            s.reuse = false;
            s.fallbacks += 1;
            s.prefill_end = s.tokens.len();
            self.inner.metrics.integrity_fallback(f.reason);
            lock(&self.inner.stats).integrity_fallbacks += 1;
            self.inner.waiting.fetch_add(1, Ordering::AcqRel);
            self.waiting.push_front(s);
            return;
        }
        lock(&self.inner.stats).failed_seqs += 1;
        tracing::warn!(seq = s.id, error = %cause, "request failed in the KV cache");
        let seq = s.id;
        self.end(s, End::Failed(EngineError::SeqFailed { seq, cause }));
    }

    fn fail_step(&mut self, ids: &[SeqId], e: EngineError) {
        lock(&self.inner.stats).failed_steps += 1;
        tracing::error!(error = %e, sequences = ids.len(), "engine step failed");
        for id in ids {
            if let Some(pos) = self.running.iter().position(|s| s.id == *id) {
                let s = self.running.remove(pos);
                self.end(s, End::Failed(e.clone()));
            }
        }
    }
}
