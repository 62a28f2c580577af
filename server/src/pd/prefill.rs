//! The prefill side of a PD deployment, usable alone (`serve --role prefill`, decode in
//! another process) or in a [`crate::pd::pair::PdPair`].
//!
//! [`PrefillNode`] runs the prefill engine (prefix cache, host tier as configured) and,
//! for every decode connection given to [`PrefillNode::attach`], a [`Sender`] with its
//! job threads ([`PrefillWorkers`]). For each bootstrapped job a worker runs the prompt
//! through the engine (its prefix cache and host tier serve what they hold; the request's
//! end commits every full page), keeps the prompt's pages locked (the committed ones and
//! a partly filled last one) and pushes each layer of both kinds with
//! [`Job::send_all`], then confirms. A connection that closed is dropped (its threads
//! joined) by the node's metrics thread; its counters stay in the totals.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sparsekit_host::cache::CacheSpec;
use sparsekit_host::{Backend, ModelOps};

use crate::engine::SamplingParams;
use crate::engine::{CacheHandle, CacheSpaceOptions, ModelConfig, ReceivedPages};
use crate::engine::{Engine, EngineOptions, Event, GenerateRequest};
use crate::error::EngineError;
use crate::metrics::Metrics;
use crate::pd::error::PdError;
use crate::pd::faults::StaleWriteBarrier;
use crate::pd::sender::{Job, Liveness, Sender, SenderConfig};
use crate::pd::stats::{PdStatsSnapshot, Publisher};
use crate::pd::wire::{Hello, Role};
use crate::pd::{hello, PdOptions, RequestGuard};
use crate::transfer::Transport;

/// Prefill's job threads for one connection (see the module docs); stopped on drop.
#[derive(Debug)]
pub struct PrefillWorkers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl PrefillWorkers {
    /// Starts `n` threads taking `sender`'s jobs and computing them on `engine` (whose
    /// cache is `handle`'s). A job may take up to `timeout`.
    pub fn start<B: Backend + 'static>(
        n: usize,
        sender: Arc<Sender<B>>,
        engine: Arc<Engine>,
        handle: CacheHandle<B>,
        timeout: Duration,
    ) -> Result<Self, EngineError> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for i in 0..n.max(1) {
            let (stop_t, sender, engine, handle) =
                (stop.clone(), sender.clone(), engine.clone(), handle.clone());
            let t = std::thread::Builder::new()
                .name(format!("sparsekit-prefill-{i}"))
                .spawn(move || {
                    while !stop_t.load(Ordering::Acquire) {
                        let Some(job) = sender.next_job(Duration::from_millis(20)) else {
                            continue;
                        };
                        let req = job.request();
                        // A panic fails only this job (dropping it tells decode).
                        let r = catch_unwind(AssertUnwindSafe(|| {
                            serve_job(job, &engine, &handle, timeout)
                        }));
                        if r.is_err() {
                            tracing::error!(request = req, "prefill job panicked");
                        }
                    }
                });
            match t {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // Stop those already started before reporting.
                    drop(PrefillWorkers { stop, threads });
                    return Err(EngineError::Unavailable(format!("prefill worker: {e}")));
                }
            }
        }
        Ok(PrefillWorkers { stop, threads })
    }
}

impl Drop for PrefillWorkers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Runs the job's prompt through the prefill engine (one token sampled and dropped: the
/// engine computes every prompt token) and receives its pages, the full ones committed to
/// the prefix tree, all held for us. `Ok(None)`: the job was cancelled meanwhile.
fn compute<B: Backend + 'static>(
    job: &Job<B>,
    engine: &Engine,
    handle: &CacheHandle<B>,
    deadline: Instant,
) -> Result<Option<ReceivedPages>, String> {
    let sampling = SamplingParams {
        max_new_tokens: 1,
        ..Default::default()
    };
    let (mut h, held) = engine
        .submit_held(GenerateRequest::new(job.prompt().to_vec(), sampling))
        .map_err(|e| format!("prefill engine: {e}"))?;
    // Gives up the engine request; pages it may already hold for us are released.
    let give_up = |h: &mut crate::engine::RequestHandle| {
        h.abort();
        let until = crate::deadline_after(Duration::from_secs(5));
        while Instant::now() < until {
            match h.next_event_timeout(Duration::from_millis(20)) {
                Ok(Some(Event::Token(_))) | Err(EngineError::Timeout(_)) => {}
                _ => break,
            }
        }
        if let Ok(p) = held.try_recv() {
            let _ = handle.cache().abort(p.cache_request);
        }
    };
    loop {
        if job.is_cancelled() {
            give_up(&mut h);
            return Ok(None);
        }
        if Instant::now() >= deadline {
            give_up(&mut h);
            return Err("prefill did not finish in time".into());
        }
        match h.next_event_timeout(Duration::from_millis(20)) {
            Ok(Some(Event::Done(_))) | Ok(None) => {
                // Sent before `Done`.
                return held
                    .try_recv()
                    .map(Some)
                    .map_err(|_| "prefill engine kept no pages".to_string());
            }
            Ok(Some(Event::Error(e))) => return Err(format!("prefill engine: {e}")),
            Ok(Some(Event::Token(_))) | Err(EngineError::Timeout(_)) => {}
            Err(e) => return Err(format!("prefill engine: {e}")),
        }
    }
}

fn serve_job<B: Backend + 'static>(
    job: Job<B>,
    engine: &Engine,
    handle: &CacheHandle<B>,
    timeout: Duration,
) {
    let deadline = crate::deadline_after(timeout);
    let cache = handle.cache();
    let held = match compute(&job, engine, handle, deadline) {
        Ok(Some(h)) => h,
        Ok(None) => return, // dropping the cancelled job confirms
        Err(why) => return job.cancel(&why),
    };
    let req = held.cache_request;
    // Ends the held request if anything below panics (each path ends it otherwise).
    let _guard = RequestGuard::new(cache, req);
    if held.tokens < job.prompt().len() {
        let _ = cache.abort(req);
        let why = format!(
            "prefill holds {} of the prompt's {} tokens",
            held.tokens,
            job.prompt().len()
        );
        return job.cancel(&why);
    }
    let sent = job.send_all(req, &held.pages);
    let _ = if sent.is_ok() {
        cache.finish(req)
    } else {
        cache.abort(req)
    };
    match sent {
        Ok(()) => {
            let _ = job.finish();
        }
        Err(PdError::Cancelled { .. }) => {}
        Err(e) => job.cancel(&format!("prefill could not push the prompt: {e}")),
    }
}

/// One decode connection: its sender and job threads.
struct Link<B: Backend + 'static> {
    sender: Arc<Sender<B>>,
    workers: PrefillWorkers,
}

/// The node's connections, and the counters of those that closed.
struct Links<B: Backend + 'static> {
    live: Vec<Link<B>>,
    retired: PdStatsSnapshot,
}

impl<B: Backend + 'static> Links<B> {
    /// Takes the closed connections out (their counters go to `retired`); the caller drops
    /// them outside the lock (that joins their threads).
    fn take_closed(&mut self) -> Vec<Link<B>> {
        let (closed, live): (Vec<_>, Vec<_>) =
            self.live.drain(..).partition(|l| l.sender.is_closed());
        self.live = live;
        for l in &closed {
            self.retired.add(&l.sender.stats());
        }
        closed
    }

    fn observe(&self) -> (PdStatsSnapshot, usize) {
        let mut s = self.retired.clone();
        let mut in_flight = 0;
        for l in &self.live {
            s.add(&l.sender.stats());
            in_flight += l.sender.in_flight();
        }
        (s, in_flight)
    }
}

/// The prefill side (see the module docs).
pub struct PrefillNode<B: Backend + 'static> {
    pub engine: Arc<Engine>,
    handle: CacheHandle<B>,
    sender_config: SenderConfig,
    workers: usize,
    timeout: Duration,
    max_connections: usize,
    links: Arc<Mutex<Links<B>>>,
    publisher: Mutex<Option<Publisher>>,
}

impl<B: Backend + 'static> std::fmt::Debug for PrefillNode<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillNode")
            .field("engine", &self.engine)
            .field("workers", &self.workers)
            .finish()
    }
}

impl<B: Backend + ModelOps + 'static> PrefillNode<B> {
    /// Starts the prefill engine (`opts`: prefix cache, host tier) with `metrics` (its PD
    /// counters go there too). `stale_write`: the rendezvous shared with an in-process
    /// decode under `stale-transfer-write` (`None` elsewhere).
    pub fn start(
        backend: Arc<B>,
        cfg: ModelConfig,
        opts: EngineOptions,
        pd: &PdOptions,
        metrics: Arc<Metrics>,
        stale_write: Option<Arc<StaleWriteBarrier>>,
    ) -> Result<Self, EngineError> {
        let (engine, handle) = Engine::start_cached(
            backend,
            cfg,
            opts,
            metrics.clone(),
            CacheSpaceOptions::default(),
        )?;
        let links = Arc::new(Mutex::new(Links {
            live: Vec::new(),
            retired: PdStatsSnapshot::default(),
        }));
        let publisher = {
            let links = links.clone();
            let mut seen = BTreeMap::new();
            Publisher::start("prefill", move || {
                let closed = links.lock().take_closed();
                drop(closed);
                let (s, in_flight) = links.lock().observe();
                crate::pd::stats::publish(&metrics, "prefill", &s, &mut seen);
                metrics.transfers_in_flight("prefill", in_flight);
            })?
        };
        let engine = Arc::new(engine);
        // Transfers queued behind other prompts stay alive while the engine steps.
        let steps = Arc::downgrade(&engine);
        let liveness: Liveness = Arc::new(move || steps.upgrade().map_or(0, |e| e.stats().steps));
        Ok(PrefillNode {
            engine,
            handle,
            sender_config: SenderConfig {
                faults: pd.faults.clone(),
                stale_barrier: stale_write,
                liveness: Some(liveness),
                ..Default::default()
            },
            workers: pd.workers,
            timeout: pd.timeout,
            max_connections: pd.max_connections.max(1),
            links,
            publisher: Mutex::new(Some(publisher)),
        })
    }
}

impl<B: Backend + 'static> PrefillNode<B> {
    /// The cache layouts and geometry this side serves (what decode must match).
    pub fn spec(&self) -> CacheSpec {
        *self.handle.cache().spec()
    }

    /// The handshake this side announces on a connection.
    pub fn hello(&self) -> Hello {
        let cache = self.handle.cache();
        hello(
            Role::Prefill,
            cache.spec(),
            cache.backend().arithmetic(),
            0,
            Vec::new(),
        )
    }

    /// Serves the decode connection `end` (a prefill end whose handshake is done): a
    /// sender and its job threads. Refused (and closed) when decode's layouts differ, or
    /// when `max_connections` decode connections are up already (`Overloaded`).
    pub fn attach(&self, end: Arc<dyn Transport>) -> Result<(), EngineError> {
        let closed = self.links.lock().take_closed();
        drop(closed);
        let live = self.links.lock().live.len();
        if live >= self.max_connections {
            let why = format!(
                "this prefill node serves at most {} decode connections",
                self.max_connections
            );
            end.close(&why);
            return Err(EngineError::Overloaded(why));
        }
        let sender = Arc::new(
            Sender::new(self.handle.cache().clone(), end, self.sender_config.clone())
                .map_err(crate::pd::error::pd_error)?,
        );
        let workers = PrefillWorkers::start(
            self.workers,
            sender.clone(),
            self.engine.clone(),
            self.handle.clone(),
            self.timeout,
        )?;
        self.links.lock().live.push(Link { sender, workers });
        Ok(())
    }

    /// Decode connections up now.
    pub fn connections(&self) -> usize {
        self.links
            .lock()
            .live
            .iter()
            .filter(|l| !l.sender.is_closed())
            .count()
    }

    /// Prefill's jobs not ended yet, over every connection.
    pub fn in_flight(&self) -> usize {
        self.links.lock().observe().1
    }

    /// The senders' counters, over every connection so far.
    pub fn stats(&self) -> PdStatsSnapshot {
        self.links.lock().observe().0
    }

    /// Stops the engine (up to `grace` for what is in flight; the jobs waiting on it then
    /// end), the connections (their threads) and the metrics thread.
    /// Idempotent.
    pub fn shutdown(&self, grace: Duration) -> Result<(), EngineError> {
        let r = self.engine.shutdown(grace);
        self.stop_links();
        let p = self.publisher.lock().take();
        drop(p);
        r
    }

    fn stop_links(&self) {
        let live: Vec<_> = self.links.lock().live.drain(..).collect();
        for l in live {
            // Workers first (they hold the sender), then the sender closes on drop.
            drop(l.workers);
            let s = l.sender.stats();
            self.links.lock().retired.add(&s);
        }
    }
}

impl<B: Backend + 'static> Drop for PrefillNode<B> {
    fn drop(&mut self) {
        // The engine first: a job waiting on it ends, so its worker can be joined.
        let _ = self.shutdown(Duration::ZERO);
    }
}
