//! The engine's front: the [`Engine`] any thread calls (start, check, submit, abort,
//! shutdown) and the state it shares with the engine thread ([`super::scheduler`]) and
//! the prompt fetch threads of a PD decode engine.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sparsekit_host::cache::{CacheConfig, HiCache};
use sparsekit_host::{Backend, ModelOps};

use crate::engine::cache_space::{CacheHandle, CacheKvSpace, CacheSpaceOptions};
use crate::engine::config::ModelConfig;
use crate::engine::info::{CacheInfo, EngineInfo, EngineStats, PdInfo};
use crate::engine::json_object::JsonObjectState;
use crate::engine::kernel_check::KernelCheck;
use crate::engine::kv::{KvSpace, PagedKvSpace, PromptSource, ReceivedPages};
use crate::engine::model::Model;
use crate::engine::options::{EngineOptions, ReplyScript};
use crate::engine::request::{
    Event, FinishReason, Finished, GenerateRequest, ReqShared, RequestHandle,
};
use crate::engine::scheduler::{panic_message, Scheduler, Seq};
use crate::engine::tokenizer::{TextStream, VOCAB_SIZE};
use crate::error::EngineError;
use crate::metrics::{Metrics, RequestStatus};

/// What the engine thread is told.
pub(super) enum Command {
    Submit(Box<Seq>),
    Wake,
    Shutdown { drain_until: Instant },
}

/// The state an [`Engine`], its request handles, its fetch threads and its thread share.
pub(super) struct Inner {
    pub(super) commands: flume::Sender<Command>,
    pub(super) live: Mutex<HashMap<String, Arc<ReqShared>>>,
    pub(super) next_seq: AtomicU64,
    pub(super) waiting: AtomicUsize,
    pub(super) accepting: AtomicBool,
    pub(super) alive: AtomicBool,
    pub(super) stats: Mutex<EngineStats>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) info: EngineInfo,
    pub(super) max_waiting: usize,
    pub(super) scripted_reply: Option<ReplyScript>,
    /// Where prompts' KV comes from (PD decode side); see [`PromptSource`].
    pub(super) prompt_source: OnceLock<Arc<dyn PromptSource>>,
    /// Requests whose prompt is being fetched from the source (not queued yet).
    pub(super) fetching: AtomicUsize,
    /// How the engine takes part in PD, once set; see [`PdInfo`].
    pub(super) pd_info: OnceLock<PdInfo>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Inner {
    pub(super) fn forget(&self, rid: &str) {
        lock(&self.live).remove(rid);
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
        let spec = model.cache_spec(opts.kv_dtype, opts.index_k_dtype)?;
        match &opts.cache {
            None => {
                let space = PagedKvSpace::with_spec(&*backend, spec, opts.kv_pages)?;
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
        let spec = model.cache_spec(opts.kv_dtype, opts.index_k_dtype)?;
        let mut config = CacheConfig::new(opts.kv_pages, c.host_pages);
        config.window_pages = c.window_pages;
        config.write_through = c.write_through;
        config.verify = c.verify;
        config.host_layout = c.host_layout;
        config.wait_timeout = c.wait_timeout;
        config.faults = c.faults.clone();
        let cache = HiCache::new(backend, spec, config)?;
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
                let mut sched = Scheduler::new(model, space, opts, thread_inner, check);
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

    /// [`Engine::submit`] for a PD prefill: when the request ends normally, the pages of
    /// its prompt (the full ones committed to the prefix tree) stay locked in the engine's
    /// cache as a live cache request of their own, sent to the returned channel before the
    /// handle's `Done` (nothing is sent by a space without a prefix cache, or when the
    /// request did not end normally). The receiver of the pages ends that cache request;
    /// if the channel is gone by then, the engine ends it.
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
            text: TextStream::with_min_tokens(&req.sampling.stop, req.sampling.min_new_tokens),
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
        Ok(RequestHandle::new(rid, rx, shared, inner.clone(), now))
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
