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

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;
use sparsekit_host::cache::{CacheConfig, CacheSpec, Faults, HiCache, HostLayout};
use sparsekit_host::{Backend, IndexKDtype, KvDtype, ModelOps};

use crate::engine::batch::{SeqChunk, StepBatch};
use crate::engine::cache_space::CacheHandle;
use crate::engine::cache_space::{CacheKvSpace, CacheSpaceOptions};
use crate::engine::config::ModelConfig;
use crate::engine::json_object::JsonObjectState;
use crate::engine::kernel_check::{self, CheckCounts, KernelCheck, KernelCheckConfig, KernelFault};
use crate::engine::kv::{KvSpace, PagedKvSpace, PromptSource, ReceivedPages, SeqId};
use crate::engine::model::{logits_digest, Model};
use crate::engine::sampling::{sample_in, SamplingParams, SeqView};
use crate::engine::tokenizer::{TextStream, END, VOCAB_SIZE};
use crate::error::EngineError;
use crate::metrics::{Metrics, RequestStatus};

/// Longest the idle engine thread blocks on its command channel before looking again.
pub const IDLE_WAIT: Duration = Duration::from_millis(50);

/// Longest the engine thread blocks, when every waiting request waits for pages and
/// nothing runs, before it tries to admit again.
pub const BLOCKED_WAIT: Duration = Duration::from_millis(5);

/// Fault injection for tests: called inside every step, before the forward pass, with the
/// sequences in the step; a panic in it is a panicking step.
pub type StepFault = Arc<dyn Fn(&[SeqId]) + Send + Sync>;

/// Test injection ([`EngineOptions::scripted_reply`]): the tokens a request with this
/// prompt generates instead of sampling (`None`: it samples), one per step while they
/// last; the forward pass, digests and every check run as usual. Shown by
/// [`EngineInfo::scripted_replies`]: a server that uses it says so.
pub type ReplyScript = Arc<dyn Fn(&[u32]) -> Option<Vec<u32>> + Send + Sync>;

/// The prefix cache and host tier of an engine ([`EngineOptions::cache`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CacheOptions {
    /// Pages of the host tier (0: none; evicted pages leave the cache).
    pub host_pages: usize,
    /// Back committed pages up to the host tier at once (so eviction rarely waits).
    pub write_through: bool,
    /// Verify the checksums of pages loaded from the host tier (off only for the
    /// harness's `--no-verify`).
    pub verify: bool,
    pub host_layout: HostLayout,
    /// Bound of every wait in the cache (a load's layer, a layer lock).
    pub wait_timeout: Duration,
    /// Fault injections (none in production).
    pub faults: Faults,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            host_pages: 0,
            write_through: true,
            verify: true,
            host_layout: HostLayout::LayerFirst,
            wait_timeout: Duration::from_secs(10),
            faults: Faults::none(),
        }
    }
}

/// Engine settings besides the model.
#[derive(Clone)]
pub struct EngineOptions {
    /// Weight seed.
    pub seed: u64,
    pub kv_dtype: KvDtype,
    pub index_k_dtype: IndexKDtype,
    /// Pages of the KV space (each holds `page_size` tokens of every layer and kind): the
    /// device pool.
    pub kv_pages: usize,
    /// The prefix cache (radix reuse on the device pool, host tier): `None` serves with
    /// the reference space ([`PagedKvSpace`]: no reuse).
    pub cache: Option<CacheOptions>,
    /// Rows (tokens) per step at most.
    pub max_batch_tokens: usize,
    /// Prompt tokens of one sequence per step at most.
    pub prefill_chunk: usize,
    /// Prefill tokens each step gets even when decode rows fill `max_batch_tokens`.
    pub min_prefill_tokens: usize,
    /// Sequences admitted (holding pages) at once.
    pub max_running: usize,
    /// Requests queued for admission before `submit` answers `Overloaded`.
    pub max_waiting: usize,
    /// Role label of the metrics (`both` for a single process).
    pub role: String,
    /// See [`StepFault`].
    pub fault: Option<StepFault>,
    /// Re-checks a sample of the DSA kernel calls against an independent implementation
    /// (counted on `/metrics` as `sparsekit_kernel_checks_total{op,outcome}`; each engine
    /// counts its own).
    pub kernel_check: Option<KernelCheckConfig>,
    /// An injected kernel bug (harness only).
    pub kernel_fault: Option<KernelFault>,
    /// See [`ReplyScript`] (tests of what clients make of given model output: DSML tool
    /// calls, say, which a model with random weights never writes).
    pub scripted_reply: Option<ReplyScript>,
}

impl std::fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineOptions")
            .field("seed", &self.seed)
            .field("kv_dtype", &self.kv_dtype)
            .field("index_k_dtype", &self.index_k_dtype)
            .field("kv_pages", &self.kv_pages)
            .field("cache", &self.cache)
            .field("max_batch_tokens", &self.max_batch_tokens)
            .field("prefill_chunk", &self.prefill_chunk)
            .field("min_prefill_tokens", &self.min_prefill_tokens)
            .field("max_running", &self.max_running)
            .field("max_waiting", &self.max_waiting)
            .field("role", &self.role)
            .field("fault", &self.fault.is_some())
            .field("kernel_check", &self.kernel_check.is_some())
            .field("kernel_fault", &self.kernel_fault)
            .field("scripted_reply", &self.scripted_reply.is_some())
            .finish()
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            seed: 0,
            kv_dtype: KvDtype::Bf16,
            index_k_dtype: IndexKDtype::FP8,
            kv_pages: 4096,
            cache: None,
            max_batch_tokens: 512,
            prefill_chunk: 256,
            min_prefill_tokens: 32,
            max_running: 128,
            max_waiting: 4096,
            role: "both".into(),
            fault: None,
            kernel_check: None,
            kernel_fault: None,
            scripted_reply: None,
        }
    }
}

impl EngineOptions {
    fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: &str| Err(EngineError::InvalidConfig(m.into()));
        if self.max_batch_tokens == 0 || self.prefill_chunk == 0 || self.min_prefill_tokens == 0 {
            return bad("max_batch_tokens, prefill_chunk and min_prefill_tokens must be positive");
        }
        if self.max_running == 0 || self.kv_pages == 0 {
            return bad("max_running and kv_pages must be positive");
        }
        Ok(())
    }
}

/// A generation request.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Caller's request id; when `None`, a fresh unguessable one ([`random_id`]). Must be
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
    /// Digest of the logits row this token was sampled from ([`logits_digest`]).
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

/// Shape facts clients need (context limit, model name).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineInfo {
    pub model: String,
    pub backend: String,
    pub max_context: usize,
    pub vocab: usize,
    pub page_size: usize,
    pub kv_pages: usize,
    pub kv_dtype: &'static str,
    pub index_k_dtype: &'static str,
    pub index_topk: usize,
    pub n_layers: usize,
    /// Weight seed (with the model name it determines every weight).
    pub seed: u64,
    /// The prefix cache: `None` for the reference space.
    pub cache: Option<CacheInfo>,
    /// Replies are scripted by a test injection ([`ReplyScript`]), not sampled.
    pub scripted_replies: bool,
}

/// How an engine takes part in prefill/decode disaggregation (`/server_info`'s `pd`): what
/// a peer or a harness needs to find and check its counterpart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PdInfo {
    /// `prefill`, `decode`, or `both` (a pair in one process; this is its decode engine).
    pub role: String,
    /// `local` or `nixl`.
    pub transport: String,
    /// Prefill: the TCP port decode's PD connection goes to (on the server's host).
    pub bootstrap_port: Option<u16>,
    /// Decode: the prefill server's URL.
    pub peer: Option<String>,
    /// Host tier pages of the prefill side, where this server knows them (`prefill`, and
    /// `both`, whose engine behind the HTTP server is decode's, without a host tier).
    pub prefill_host_pages: Option<usize>,
}

/// The cache settings an engine serves with ([`EngineInfo::cache`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CacheInfo {
    /// Host tier pages (0: none).
    pub host_pages: usize,
    pub write_through: bool,
    pub verify: bool,
    /// Injected faults (empty in production).
    pub faults: Vec<&'static str>,
}

/// Counters of the engine thread (read from any thread).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EngineStats {
    pub steps: u64,
    pub failed_steps: u64,
    pub waiting: usize,
    pub running: usize,
    pub free_pages: usize,
    pub capacity_pages: usize,
    /// Result of the last KV accounting check (run whenever the engine goes idle).
    pub leak_check: Option<Result<(), String>>,
    /// Pages held for no request the engine knows, at the last idle check.
    pub leaked_pages: usize,
    /// Requests failed alone by a KV cache check or a failed load (the rest of their
    /// step went on).
    pub failed_seqs: u64,
    /// Requests whose prefix failed an integrity check and that recomputed it (served).
    pub integrity_fallbacks: u64,
    /// Largest number of rows in one step.
    pub max_step_rows: usize,
    /// Largest number of sequences in one step.
    pub max_step_seqs: usize,
}

struct ReqShared {
    aborted: AtomicBool,
    finished: AtomicBool,
    /// The abort is the request timeout's (counted as `timeout`, not `aborted`).
    timed_out: AtomicBool,
}

enum Command {
    Submit(Box<Seq>),
    Wake,
    Shutdown { drain_until: Instant },
}

struct Inner {
    commands: flume::Sender<Command>,
    live: Mutex<HashMap<String, Arc<ReqShared>>>,
    next_seq: AtomicU64,
    waiting: AtomicUsize,
    accepting: AtomicBool,
    alive: AtomicBool,
    stats: Mutex<EngineStats>,
    metrics: Arc<Metrics>,
    info: EngineInfo,
    max_waiting: usize,
    scripted_reply: Option<ReplyScript>,
    /// Where prompts' KV comes from (PD decode side); see [`PromptSource`].
    prompt_source: OnceLock<Arc<dyn PromptSource>>,
    /// Requests whose prompt is being fetched from the source (not queued yet).
    fetching: AtomicUsize,
    /// How the engine takes part in PD, once set; see [`PdInfo`].
    pd_info: OnceLock<PdInfo>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Inner {
    fn forget(&self, rid: &str) {
        lock(&self.live).remove(rid);
    }
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

/// The engine: a model, its KV space and the scheduler thread.
pub struct Engine {
    inner: Arc<Inner>,
    exited: flume::Receiver<()>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("info", &self.inner.info)
            .finish()
    }
}

impl Engine {
    /// Builds the model and its reference KV space ([`PagedKvSpace`]) on `backend` and
    /// starts the engine thread.
    pub fn start<B: Backend + ModelOps + 'static>(
        backend: Arc<B>,
        cfg: ModelConfig,
        opts: EngineOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Engine, EngineError> {
        opts.validate()?;
        let model = Model::new(backend.clone(), cfg, opts.seed)?;
        let (kv, ik) = (
            model.kv_layout(opts.kv_dtype)?,
            model.index_k_layout(opts.index_k_dtype)?,
        );
        match &opts.cache {
            None => {
                let space = PagedKvSpace::new(&*backend, kv, ik, cfg.n_layers, opts.kv_pages)?;
                Self::start_with(model, space, opts, metrics)
            }
            Some(_) => {
                Self::start_cached(backend, cfg, opts, metrics, CacheSpaceOptions::default())
                    .map(|(e, _)| e)
            }
        }
    }

    /// [`Engine::start`] over the cache-backed space (`opts.cache` must be set), with the
    /// space's switches; also returns the [`CacheHandle`] a PD receiver works through.
    pub fn start_cached<B: Backend + ModelOps + 'static>(
        backend: Arc<B>,
        cfg: ModelConfig,
        opts: EngineOptions,
        metrics: Arc<Metrics>,
        space_opts: CacheSpaceOptions,
    ) -> Result<(Engine, CacheHandle<B>), EngineError> {
        opts.validate()?;
        let Some(c) = &opts.cache else {
            return Err(EngineError::InvalidConfig(
                "a cache-backed engine needs cache options".into(),
            ));
        };
        let model = Model::new(backend.clone(), cfg, opts.seed)?;
        let (kv, ik) = (
            model.kv_layout(opts.kv_dtype)?,
            model.index_k_layout(opts.index_k_dtype)?,
        );
        let mut config = CacheConfig::new(opts.kv_pages, c.host_pages);
        config.write_through = c.write_through;
        config.verify = c.verify;
        config.host_layout = c.host_layout;
        config.wait_timeout = c.wait_timeout;
        config.faults = c.faults.clone();
        let cache = HiCache::new(backend, CacheSpec::new(kv, ik, cfg.n_layers)?, config)?;
        let space = CacheKvSpace::new(Arc::new(cache), space_opts);
        let handle = space.handle();
        Ok((Self::start_with(model, space, opts, metrics)?, handle))
    }

    /// Makes `source` provide every later request's prompt KV (the PD decode side); once
    /// only (`InvalidConfig` after that).
    pub fn set_prompt_source(&self, source: Arc<dyn PromptSource>) -> Result<(), EngineError> {
        self.inner
            .prompt_source
            .set(source)
            .map_err(|_| EngineError::InvalidConfig("the prompt source is already set".into()))
    }

    /// Records how this engine takes part in PD (shown by `/server_info`); once only
    /// (`InvalidConfig` after that).
    pub fn set_pd_info(&self, info: PdInfo) -> Result<(), EngineError> {
        self.inner
            .pd_info
            .set(info)
            .map_err(|_| EngineError::InvalidConfig("the PD info is already set".into()))
    }

    /// How this engine takes part in PD (`None`: it does not).
    pub fn pd_info(&self) -> Option<&PdInfo> {
        self.inner.pd_info.get()
    }

    /// Requests whose prompt KV is being fetched from the prompt source now.
    pub fn fetching(&self) -> usize {
        self.inner.fetching.load(Ordering::Acquire)
    }

    /// Starts the engine thread over a given model and KV space (the cache-backed space
    /// plugs in here).
    pub fn start_with<B, S>(
        model: Model<B>,
        space: S,
        opts: EngineOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Engine, EngineError>
    where
        B: Backend + ModelOps + 'static,
        S: KvSpace<B> + Send + 'static,
    {
        opts.validate()?;
        let check = opts
            .kernel_check
            .as_ref()
            .map(|k| Arc::new(KernelCheck::new(k.audit.clone(), k.every)));
        let model = model
            .with_kernel_check(check.clone())
            .with_kernel_fault(opts.kernel_fault);
        let cfg = *model.config();
        if space.num_layers() != cfg.n_layers {
            return Err(EngineError::InvalidConfig(format!(
                "KV space holds {} layers, model {} has {}",
                space.num_layers(),
                cfg.name,
                cfg.n_layers
            )));
        }
        let info = EngineInfo {
            model: cfg.name.to_string(),
            backend: model.backend().name().to_string(),
            max_context: cfg.max_context,
            vocab: cfg.vocab(),
            page_size: cfg.page_size(),
            kv_pages: space.capacity_pages(),
            kv_dtype: space.kv_layout().dtype().name(),
            index_k_dtype: space.index_k_layout().dtype().name(),
            index_topk: cfg.index_topk,
            n_layers: cfg.n_layers,
            seed: opts.seed,
            cache: opts.cache.as_ref().map(|c| CacheInfo {
                host_pages: c.host_pages,
                write_through: c.write_through,
                verify: c.verify,
                faults: c.faults.list().iter().map(|f| f.name()).collect(),
            }),
            scripted_replies: opts.scripted_reply.is_some(),
        };
        let (tx, rx) = flume::unbounded();
        let inner = Arc::new(Inner {
            commands: tx,
            live: Mutex::new(HashMap::new()),
            next_seq: AtomicU64::new(1),
            waiting: AtomicUsize::new(0),
            accepting: AtomicBool::new(true),
            alive: AtomicBool::new(true),
            stats: Mutex::new(EngineStats {
                free_pages: space.free_pages(),
                capacity_pages: space.capacity_pages(),
                ..Default::default()
            }),
            metrics,
            info,
            max_waiting: opts.max_waiting,
            scripted_reply: opts.scripted_reply.clone(),
            prompt_source: OnceLock::new(),
            pd_info: OnceLock::new(),
            fetching: AtomicUsize::new(0),
        });
        let (exit_tx, exit_rx) = flume::bounded(1);
        let thread_inner = inner.clone();
        let thread = std::thread::Builder::new()
            .name("sparsekit-engine".into())
            .spawn(move || {
                let guard = ExitGuard {
                    inner: thread_inner.clone(),
                    exit: exit_tx,
                };
                let mut sched = Scheduler {
                    model,
                    space,
                    opts,
                    inner: thread_inner,
                    waiting: VecDeque::new(),
                    running: Vec::new(),
                    drain_until: None,
                    check,
                    checks_published: Default::default(),
                };
                sched.run(rx);
                drop(guard);
            })
            .map_err(|e| EngineError::Unavailable(format!("cannot start engine thread: {e}")))?;
        Ok(Engine {
            inner,
            exited: exit_rx,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Shape facts (model, context limit, dtypes).
    pub fn info(&self) -> &EngineInfo {
        &self.inner.info
    }

    /// The metrics the engine records into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// Whether the engine thread is running and accepting requests.
    pub fn is_healthy(&self) -> bool {
        self.inner.alive.load(Ordering::Acquire) && self.inner.accepting.load(Ordering::Acquire)
    }

    /// A snapshot of the engine's counters.
    pub fn stats(&self) -> EngineStats {
        lock(&self.inner.stats).clone()
    }

    /// Checks a request without submitting it (the HTTP layer answers 4xx from this).
    pub fn check(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        let info = &self.inner.info;
        if req.prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        if let Some((i, t)) = req
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= VOCAB_SIZE)
        {
            return Err(EngineError::InvalidRequest(format!(
                "prompt token {i} is {t}, outside the vocabulary of {VOCAB_SIZE}"
            )));
        }
        req.sampling.validate()?;
        let needed = req.prompt.len() + req.sampling.max_new_tokens;
        if needed > info.max_context {
            return Err(EngineError::ContextLength {
                prompt: req.prompt.len(),
                max_new: req.sampling.max_new_tokens,
                needed,
                limit: info.max_context,
            });
        }
        let pages = needed.div_ceil(info.page_size);
        if pages > info.kv_pages {
            return Err(EngineError::TooLarge {
                wanted: pages,
                capacity: info.kv_pages,
            });
        }
        if let Some(id) = &req.id {
            if id.is_empty() || id.len() > 256 {
                return Err(EngineError::InvalidRequest(
                    "request id must be 1 to 256 bytes".into(),
                ));
            }
        }
        Ok(())
    }

    /// Queues a request; its handle receives the events.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestHandle, EngineError> {
        self.submit_inner(req, None)
    }

    /// [`Engine::submit`] for a PD prefill: when the request ends normally, the full pages
    /// of its prompt stay locked in the engine's cache as a live cache request of their
    /// own, sent to the returned channel before the handle's `Done` (nothing is sent by a
    /// space without a prefix cache, or when the request did not end normally). The
    /// receiver of the pages ends that cache request; if the channel is gone by then, the
    /// engine ends it.
    pub fn submit_held(
        &self,
        req: GenerateRequest,
    ) -> Result<(RequestHandle, flume::Receiver<ReceivedPages>), EngineError> {
        let (tx, rx) = flume::bounded(1);
        Ok((self.submit_inner(req, Some(tx))?, rx))
    }

    fn submit_inner(
        &self,
        req: GenerateRequest,
        hold: Option<flume::Sender<ReceivedPages>>,
    ) -> Result<RequestHandle, EngineError> {
        let inner = &self.inner;
        let rejected = |e: EngineError| {
            inner.metrics.request(RequestStatus::Rejected);
            Err(e)
        };
        if !self.is_healthy() {
            return rejected(EngineError::Unavailable(
                "the engine is shutting down".into(),
            ));
        }
        if let Err(e) = self.check(&req) {
            return rejected(e);
        }
        // Check and take a waiting slot in one step (concurrent submits cannot all pass
        // the check and then all queue); every way out below gives it back.
        let max = inner.max_waiting;
        if inner
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < max).then_some(w + 1)
            })
            .is_err()
        {
            return rejected(EngineError::Overloaded(format!(
                "{max} requests already waiting"
            )));
        }
        let seq = inner.next_seq.fetch_add(1, Ordering::Relaxed);
        let rid = req.id.clone().unwrap_or_else(random_id);
        let shared = Arc::new(ReqShared {
            aborted: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            timed_out: AtomicBool::new(false),
        });
        {
            let mut live = lock(&inner.live);
            if live.contains_key(&rid) {
                drop(live);
                inner.waiting.fetch_sub(1, Ordering::AcqRel);
                return rejected(EngineError::DuplicateId(rid));
            }
            live.insert(rid.clone(), shared.clone());
        }
        let (tx, rx) = flume::unbounded();
        let now = Instant::now();
        let script = inner
            .scripted_reply
            .as_ref()
            .and_then(|f| f(&req.prompt))
            .map(|t| t.into_iter().rev().collect());
        let s = Seq {
            json: req.sampling.json_object.then(JsonObjectState::new),
            script,
            id: seq,
            rid: rid.clone(),
            prompt_len: req.prompt.len(),
            prefill_end: req.prompt.len(),
            reuse: true,
            fallbacks: 0,
            text: TextStream::new(&req.sampling.stop),
            tokens: req.prompt,
            computed: 0,
            params: req.sampling,
            received: req.received,
            hold,
            admitted: false,
            events: tx,
            shared: shared.clone(),
            arrival: now,
            last_token: None,
        };
        if let (Some(src), None) = (inner.prompt_source.get(), &s.received) {
            let (src, fetch_inner) = (src.clone(), inner.clone());
            inner.fetching.fetch_add(1, Ordering::AcqRel);
            let spawned = std::thread::Builder::new()
                .name("sparsekit-fetch".into())
                .spawn(move || fetch_then_queue(&fetch_inner, &*src, s));
            if let Err(e) = spawned {
                inner.fetching.fetch_sub(1, Ordering::AcqRel);
                inner.waiting.fetch_sub(1, Ordering::AcqRel);
                inner.forget(&rid);
                return rejected(EngineError::Unavailable(format!(
                    "cannot start the prompt fetch: {e}"
                )));
            }
        } else if inner.commands.send(Command::Submit(Box::new(s))).is_err() {
            inner.waiting.fetch_sub(1, Ordering::AcqRel);
            inner.forget(&rid);
            return rejected(EngineError::Unavailable(
                "the engine thread has stopped".into(),
            ));
        }
        Ok(RequestHandle {
            rid,
            events: rx,
            shared,
            inner: inner.clone(),
            done: false,
            submitted: now,
        })
    }

    /// Aborts the request with id `rid`; `false` when no such request is in flight.
    pub fn abort(&self, rid: &str) -> bool {
        let found = lock(&self.inner.live).get(rid).cloned();
        match found {
            Some(s) => {
                s.aborted.store(true, Ordering::Release);
                let _ = self.inner.commands.send(Command::Wake);
                true
            }
            None => false,
        }
    }

    /// Stops accepting requests, lets running and queued ones finish for up to `grace`,
    /// aborts the rest, and waits (at most `grace` + 5 s) for the engine thread to exit.
    pub fn shutdown(&self, grace: Duration) -> Result<(), EngineError> {
        self.inner.accepting.store(false, Ordering::Release);
        let _ = self.inner.commands.send(Command::Shutdown {
            drain_until: crate::deadline_after(grace),
        });
        match self.exited.recv_timeout(grace + Duration::from_secs(5)) {
            Ok(()) | Err(flume::RecvTimeoutError::Disconnected) => {
                if let Some(t) = lock(&self.thread).take() {
                    let _ = t.join();
                }
                Ok(())
            }
            Err(flume::RecvTimeoutError::Timeout) => Err(EngineError::Timeout(
                "the engine thread did not exit in time".into(),
            )),
        }
    }
}

/// A fresh request id: 128 random bits as 32 hex digits (unguessable, so knowing one
/// request's id tells nothing of another's).
pub fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.shutdown(Duration::ZERO);
    }
}

/// Marks the engine dead and signals exit when the thread ends, panics included.
struct ExitGuard {
    inner: Arc<Inner>,
    exit: flume::Sender<()>,
}

impl Drop for ExitGuard {
    fn drop(&mut self) {
        self.inner.alive.store(false, Ordering::Release);
        self.inner.accepting.store(false, Ordering::Release);
        let _ = self.exit.try_send(());
    }
}

/// The thread of one request's prompt fetch ([`PromptSource::fetch`]): queues the
/// request with what was fetched, or ends it (aborted, failed) without the engine.
fn fetch_then_queue(inner: &Inner, src: &dyn PromptSource, mut s: Seq) {
    let fetched = catch_unwind(AssertUnwindSafe(|| {
        let total = s.prompt_len + s.params.max_new_tokens;
        src.fetch(&s.tokens[..s.prompt_len], total, &s.shared.aborted)
    }))
    .unwrap_or_else(|p| {
        Err(EngineError::StepFailed(format!(
            "the prompt fetch panicked: {}",
            panic_message(&*p)
        )))
    });
    let err = match fetched {
        Ok(received) => {
            s.received = received;
            match inner.commands.send(Command::Submit(Box::new(s))) {
                Ok(()) => {
                    inner.fetching.fetch_sub(1, Ordering::AcqRel);
                    return;
                }
                Err(flume::SendError(cmd)) => {
                    let Command::Submit(back) = cmd else {
                        inner.fetching.fetch_sub(1, Ordering::AcqRel);
                        return;
                    };
                    s = *back;
                    if let Some(r) = &s.received {
                        src.release(r);
                    }
                    EngineError::Unavailable("the engine thread has stopped".into())
                }
            }
        }
        Err(e) => e,
    };
    inner.waiting.fetch_sub(1, Ordering::AcqRel);
    s.shared.finished.store(true, Ordering::Release);
    inner.forget(&s.rid);
    let (status, ev) = match err {
        EngineError::Aborted(_) => (
            RequestStatus::Aborted,
            Event::Done(Finished {
                reason: FinishReason::Abort,
                matched: None,
                text: String::new(),
                prompt_tokens: s.prompt_len,
                completion_tokens: 0,
            }),
        ),
        e => (RequestStatus::Failed, Event::Error(e)),
    };
    inner.metrics.request(status);
    let _ = s.events.send(ev);
    inner.fetching.fetch_sub(1, Ordering::AcqRel);
}

/// A request inside the engine thread.
struct Seq {
    /// The JSON object recogniser of a `json_object` request.
    json: Option<JsonObjectState>,
    /// Scripted tokens still to come, last first ([`ReplyScript`]).
    script: Option<Vec<u32>>,
    id: SeqId,
    rid: String,
    /// Prompt followed by the generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens prefilled (computed in chunks, logits of the last only): the prompt, or
    /// every token so far for a request recomputing after an integrity fallback.
    prefill_end: usize,
    /// Whether admission may reuse a cached prefix (off after an integrity fallback).
    reuse: bool,
    /// Integrity fallbacks taken (at most one: a second failure fails the request).
    fallbacks: u8,
    /// Tokens whose KV and index keys are in the cache.
    computed: usize,
    /// Pages received for the prompt (PD decode side).
    received: Option<ReceivedPages>,
    /// Hold the committed prompt pages for this channel ([`Engine::submit_held`]).
    hold: Option<flume::Sender<ReceivedPages>>,
    /// Admitted by the KV space (holds its pages).
    admitted: bool,
    params: SamplingParams,
    text: TextStream,
    events: flume::Sender<Event>,
    shared: Arc<ReqShared>,
    arrival: Instant,
    last_token: Option<Instant>,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn prefilling(&self) -> bool {
        self.computed < self.prefill_end
    }
}

struct Scheduler<B: Backend + ModelOps, S: KvSpace<B>> {
    model: Model<B>,
    space: S,
    opts: EngineOptions,
    inner: Arc<Inner>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    drain_until: Option<Instant>,
    /// This engine's kernel checks, and the counts already on `/metrics`.
    check: Option<Arc<KernelCheck>>,
    checks_published: [CheckCounts; 3],
}

/// How a sequence leaves the engine.
enum End {
    Done(Finished),
    Failed(EngineError),
}

/// The integrity check a cache failure comes from, when recomputing the request's prefix
/// can serve it (`None`: not an integrity failure, e.g. an abort).
fn integrity_reason(e: &sparsekit_host::Error) -> Option<&'static str> {
    use sparsekit_host::Error as E;
    match e {
        E::Integrity { .. } => Some("checksum"),
        E::NotLanded { .. } => Some("not_landed"),
        E::Unwritten { .. } => Some("unwritten"),
        E::LayoutMismatch { .. } => Some("layout"),
        E::Timeout { .. } => Some("load_timeout"),
        E::Cancelled(m) if m.contains("discarded") || m.contains("left the device tier") => {
            Some("prefix_discarded")
        }
        E::RequestFailed { cause, .. } => integrity_reason(cause),
        _ => None,
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

impl<B: Backend + ModelOps, S: KvSpace<B>> Scheduler<B, S> {
    fn run(&mut self, rx: flume::Receiver<Command>) {
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
        for (id, how) in ended {
            if let Some(pos) = self.running.iter().position(|s| s.id == id) {
                let s = self.running.remove(pos);
                self.end(s, how);
            }
        }
    }

    /// A sequence whose cached or received prefix failed an integrity check: once, it
    /// drops that prefix from the cache and goes back to the front of the queue to
    /// recompute every token it has (no reuse; its tokens so far are replayed, not
    /// resampled: the pass is deterministic, so it continues with the same bits). A second
    /// failure, or one that recomputing cannot help, fails it.
    fn seq_failed(&mut self, mut s: Seq, cause: sparsekit_host::Error) {
        let reason = integrity_reason(&cause);
        let retry =
            reason.is_some() && s.fallbacks == 0 && !s.shared.aborted.load(Ordering::Acquire);
        if let (true, Some(reason)) = (retry, reason) {
            tracing::warn!(
                seq = s.id,
                error = %cause,
                "a prefix failed an integrity check: dropped from the cache, recomputing"
            );
            self.space.discard_prefix(s.id);
            // Running, so admitted: received pages it adopted go with its release.
            self.space.release(s.id);
            s.received = None;
            s.admitted = false;
            s.computed = 0;
            s.reuse = false;
            s.fallbacks += 1;
            s.prefill_end = s.tokens.len();
            self.inner.metrics.integrity_fallback(reason);
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
