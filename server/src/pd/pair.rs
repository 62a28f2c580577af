//! A prefill/decode pair of engines joined by the PD protocol (`serve --role both`, the
//! harness's PD-on configurations).
//!
//! - **Decode** ([`DecodeSource`], the decode engine's [`PromptSource`]): for each request
//!   it allocates pages for the prompt's leading full pages (all but the last token, whose
//!   logits decode computes itself) in the decode cache, starts the transfer through the
//!   [`Receiver`] (the bootstrap goes to prefill), waits (bounded) until every layer of
//!   both kinds landed, verified and was published, and hands the pages to the engine as
//!   [`ReceivedPages`]. A client abort aborts the transfer (the pages stay quarantined
//!   until prefill confirms); a refused transfer fails the request.
//! - **Prefill** ([`PrefillWorkers`]): for each bootstrapped job it runs the prompt through
//!   the prefill engine (its prefix cache and host tier serve what they hold; its end
//!   commits every full page), locks the committed pages in a cache request of its own
//!   (host-tier pages load back layer by layer) and pushes each layer of both kinds with
//!   [`Job::send_all`], then confirms.
//! - [`PdPair::start_local`] builds both engines and the in-process transport; a
//!   publisher thread copies the endpoints' counters into the decode engine's metrics
//!   (`sparsekit_transfer_bytes_total{kind}`, `sparsekit_refused_frames_total{reason}`,
//!   `sparsekit_refused_total{reason="pd_*"}`, `sparsekit_quarantined_pages{pool="pd"}`).

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sparsekit_host::cache::{BufferKind, Fault};
use sparsekit_host::{Backend, Error as HostError, ModelOps};

use crate::engine::scheduler::{Engine, EngineOptions, Event, GenerateRequest};
use crate::engine::SamplingParams;
use crate::engine::{CacheHandle, CacheSpaceOptions, ModelConfig, PromptSource, ReceivedPages};
use crate::error::EngineError;
use crate::metrics::Metrics;
use crate::pd::error::PdError;
use crate::pd::faults::{Checks, PdFault, PdFaults, StaleWriteBarrier};
use crate::pd::hello;
use crate::pd::landing::{LandingGeometry, LandingZone};
use crate::pd::receiver::{Outcome, Receiver, ReceiverConfig};
use crate::pd::sender::{Job, Sender, SenderConfig};
use crate::pd::stats::PdStatsSnapshot;
use crate::pd::wire::Role;
use crate::transfer::local;

/// Settings of a PD pair.
#[derive(Clone, Debug)]
pub struct PdOptions {
    /// Injected PD faults (none in production).
    pub faults: PdFaults,
    /// The receiver's checks (all but for `--no-verify`).
    pub checks: Checks,
    /// Prefill threads serving jobs (each waits on the prefill engine, which batches).
    pub workers: usize,
    /// Bound of one request's transfer (allocation included), and of a prefill job.
    pub timeout: Duration,
}

impl Default for PdOptions {
    fn default() -> Self {
        PdOptions {
            faults: PdFaults::none(),
            checks: Checks::all(),
            workers: 8,
            timeout: Duration::from_secs(120),
        }
    }
}

/// How long a polling loop below sleeps between looks (room in the decode pool, the
/// prefill engine's events while watching for a cancellation).
const POLL: Duration = Duration::from_millis(2);

/// The decode side's [`PromptSource`] (see the module docs).
pub struct DecodeSource<B: Backend + 'static> {
    handle: CacheHandle<B>,
    receiver: Arc<Receiver<B>>,
    page_size: usize,
    timeout: Duration,
    /// `pd-read-before-landed`: hand the pages to the engine as soon as the transfer
    /// started (the engine's steps then skip the ready tokens: the decode cache carries
    /// the `skip-index-wait` fault).
    read_before_landed: bool,
    /// `stale-transfer-write`: the rendezvous with prefill for the decoy transfers, and
    /// the fetches seen (every [`DECOY_EVERY`]th is preceded by a decoy).
    stale_write: Option<Arc<StaleWriteBarrier>>,
    fetches: AtomicU64,
}

/// Under `stale-transfer-write`, one fetch in this many starts with a decoy transfer.
const DECOY_EVERY: u64 = 4;

impl<B: Backend + 'static> std::fmt::Debug for DecodeSource<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeSource")
            .field("page_size", &self.page_size)
            .field("read_before_landed", &self.read_before_landed)
            .field("stale_write", &self.stale_write.is_some())
            .finish()
    }
}

fn pd_error(e: PdError) -> EngineError {
    match e {
        PdError::Timeout(m) => EngineError::Timeout(m),
        e => EngineError::StepFailed(format!("PD transfer: {e}")),
    }
}

impl<B: Backend + 'static> DecodeSource<B> {
    /// Ends cache request `req` (a transfer that did not deliver).
    fn drop_request(&self, req: u64) {
        let cache = self.handle.cache();
        if cache.is_live(req) {
            let _ = cache.abort(req);
        }
    }

    /// `stale-transfer-write`, made deterministic: a decoy transfer of the same number of
    /// pages (the prompt reversed, so its bytes differ) is started, aborted exactly while
    /// prefill's writes are in flight, confirmed by prefill (the fault: its writes go on
    /// and are held late), and its pages freed, on top of the free list, just before the
    /// real request allocates: the real request's transfer gets the decoy's pages, and the
    /// late writes land in them between its bytes and its notification. With the checks
    /// on its checksums refuse what landed; without them the request is served the
    /// decoy's bytes. Gives up quietly (bounded waits) where the decoy cannot run.
    fn decoy(&self, barrier: &StaleWriteBarrier, prompt: &[u32], pages_n: usize) {
        let cache = self.handle.cache();
        let req = self.handle.next_request_id();
        if cache.begin(req, &[]).is_err() {
            return;
        }
        let Ok(pages) = cache.try_alloc(req, pages_n) else {
            self.drop_request(req);
            return;
        };
        let decoy: Vec<u32> = prompt.iter().rev().copied().collect();
        barrier.expect(req);
        if self.receiver.start(req, &decoy, &pages).is_ok() {
            // Prefill may give the decoy up before writing (the transfer then ends).
            let deadline = Instant::now() + self.timeout;
            let in_flight = loop {
                if barrier.wait_in_flight(req, POLL * 10) {
                    break true;
                }
                if self.receiver.outcome(req).is_some() || Instant::now() >= deadline {
                    break false;
                }
            };
            self.receiver.abort(
                req,
                "stale-transfer-write: decode cancels the transfer while its writes are in flight",
            );
            if in_flight && self.receiver.wait(req, self.timeout).is_ok() {
                // Prefill confirmed: the decoy's pages are free again.
                barrier.cancelled(req);
                if !barrier.wait_held(req, self.timeout) {
                    tracing::warn!(request = req, "stale-transfer-write: late writes not held");
                }
            } else {
                tracing::warn!(
                    request = req,
                    "stale-transfer-write: the decoy ended before its writes"
                );
            }
        }
        barrier.forget(req);
        self.drop_request(req);
    }
}

impl<B: Backend + 'static> PromptSource for DecodeSource<B> {
    fn fetch(
        &self,
        prompt: &[u32],
        aborted: &AtomicBool,
    ) -> Result<Option<ReceivedPages>, EngineError> {
        let ps = self.page_size;
        let pages_n = prompt.len().saturating_sub(1) / ps;
        if pages_n == 0 {
            return Ok(None);
        }
        let tokens = pages_n * ps;
        if let Some(b) = &self.stale_write {
            if self.fetches.fetch_add(1, Ordering::Relaxed) % DECOY_EVERY == 0 {
                self.decoy(b, &prompt[..tokens], pages_n);
            }
        }
        let cache = self.handle.cache();
        let req = self.handle.next_request_id();
        let deadline = Instant::now() + self.timeout;
        cache.begin(req, &[])?;
        let pages = loop {
            if aborted.load(Ordering::Acquire) {
                self.drop_request(req);
                return Err(EngineError::Aborted("aborted before its transfer".into()));
            }
            match cache.try_alloc(req, pages_n) {
                Ok(p) => break p,
                Err(HostError::OutOfPages { .. }) if Instant::now() < deadline => {
                    // Room comes back as decode requests end; look again shortly.
                    std::thread::sleep(POLL);
                }
                Err(e) => {
                    self.drop_request(req);
                    return Err(e.into());
                }
            }
        };
        if let Err(e) = self.receiver.start(req, &prompt[..tokens], &pages) {
            self.drop_request(req);
            return Err(pd_error(e));
        }
        let received = ReceivedPages {
            cache_request: req,
            pages,
            tokens,
        };
        if self.read_before_landed {
            return Ok(Some(received));
        }
        loop {
            if aborted.load(Ordering::Acquire) {
                self.receiver.abort(req, "the client aborted the request");
                return Err(EngineError::Aborted("aborted during its transfer".into()));
            }
            match self.receiver.wait(req, Duration::from_millis(20)) {
                Ok(Outcome::Ready) => return Ok(Some(received)),
                Ok(Outcome::Cancelled(why)) | Ok(Outcome::Failed(why)) => {
                    self.drop_request(req);
                    return Err(EngineError::StepFailed(format!(
                        "PD transfer of the prompt failed: {why}"
                    )));
                }
                Err(PdError::Timeout(_)) if Instant::now() < deadline => {}
                Err(e) => {
                    self.receiver.abort(req, "the transfer timed out");
                    return Err(pd_error(e));
                }
            }
        }
    }

    fn release(&self, received: &ReceivedPages) {
        self.drop_request(received.cache_request);
    }
}

/// Prefill's job threads (see the module docs); stopped on drop.
#[derive(Debug)]
pub struct PrefillWorkers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl PrefillWorkers {
    /// Starts `n` threads taking `sender`'s jobs and computing them on `engine` (whose
    /// cache is `handle`'s).
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
            let (stop, sender, engine, handle) =
                (stop.clone(), sender.clone(), engine.clone(), handle.clone());
            let t = std::thread::Builder::new()
                .name(format!("sparsekit-prefill-{i}"))
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
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
                })
                .map_err(|e| EngineError::Unavailable(format!("prefill worker: {e}")))?;
            threads.push(t);
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
/// engine computes every prompt token) and receives its full pages, committed to the
/// prefix tree and held for us. `Ok(None)`: the job was cancelled meanwhile.
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
    let give_up = |h: &mut crate::engine::scheduler::RequestHandle| {
        h.abort();
        let until = Instant::now() + Duration::from_secs(5);
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
    let deadline = Instant::now() + timeout;
    let cache = handle.cache();
    let held = match compute(&job, engine, handle, deadline) {
        Ok(Some(h)) => h,
        Ok(None) => return, // dropping the cancelled job confirms
        Err(why) => return job.cancel(&why),
    };
    let req = held.cache_request;
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

/// Both engines of an in-process PD pair (see the module docs).
pub struct PdPair<B: Backend + 'static> {
    pub prefill: Arc<Engine>,
    pub decode: Arc<Engine>,
    receiver: Arc<Receiver<B>>,
    sender: Arc<Sender<B>>,
    workers: Option<PrefillWorkers>,
    publisher: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

impl<B: Backend + 'static> std::fmt::Debug for PdPair<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdPair")
            .field("prefill", &self.prefill)
            .field("decode", &self.decode)
            .finish()
    }
}

/// Copies PD counters into `m`: what grew since `seen` (updated).
fn publish(
    m: &Metrics,
    rx: &PdStatsSnapshot,
    tx: &PdStatsSnapshot,
    seen: &mut BTreeMap<String, u64>,
) {
    let mut grow = |key: String, now: u64| {
        let was = seen.entry(key).or_insert(0);
        let d = now.saturating_sub(*was);
        *was = (*was).max(now);
        d
    };
    for (kind, bytes) in [
        (BufferKind::Kv, tx.kv_bytes),
        (BufferKind::IndexK, tx.index_k_bytes),
    ] {
        let d = grow(format!("bytes:{}", kind.name()), bytes);
        if d > 0 {
            m.transfer_bytes(kind.name(), d);
        }
    }
    for (side, snap) in [("decode", rx), ("prefill", tx)] {
        for (reason, &n) in &snap.refused {
            let d = grow(format!("{side}:{reason}"), n);
            if d > 0 {
                m.refused_frames(reason, d);
                m.refused(&format!("pd_{reason}"), d);
            }
        }
    }
}

impl<B: Backend + ModelOps + 'static> PdPair<B> {
    /// Starts a prefill engine (`prefill_opts`, its cache: prefix reuse and host tier as
    /// configured) and a decode engine (`decode_opts`, no prefix reuse: every prompt page
    /// arrives by transfer) on `backend`, joined by the in-process transport. PD faults
    /// that live in the decode cache are added to `decode_opts`' cache faults.
    pub fn start_local(
        backend: Arc<B>,
        cfg: ModelConfig,
        prefill_opts: EngineOptions,
        mut decode_opts: EngineOptions,
        pd: PdOptions,
        prefill_metrics: Arc<Metrics>,
        decode_metrics: Arc<Metrics>,
    ) -> Result<Self, EngineError> {
        let read_before_landed = pd.faults.active(PdFault::ReadBeforeLanded);
        let stale_write = pd
            .faults
            .active(PdFault::StaleTransferWrite)
            .then(|| Arc::new(StaleWriteBarrier::new()));
        if let Some(c) = decode_opts.cache.as_mut() {
            for f in PdFault::ALL
                .into_iter()
                .filter(|f| pd.faults.active(*f))
                .flat_map(|f| f.cache_faults())
            {
                c.faults.insert(f);
            }
            if !pd.checks.checksums {
                c.faults.insert(Fault::NoLandedCheck);
            }
        }
        let (prefill, p_handle) = Engine::start_cached(
            backend.clone(),
            cfg,
            prefill_opts,
            prefill_metrics,
            CacheSpaceOptions::default(),
        )?;
        let (decode, d_handle) = Engine::start_cached(
            backend,
            cfg,
            decode_opts,
            decode_metrics.clone(),
            CacheSpaceOptions {
                prefix_reuse: false,
            },
        )?;
        let (prefill, decode) = (Arc::new(prefill), Arc::new(decode));
        let (d, p) = (d_handle.cache(), p_handle.cache());
        let g = LandingGeometry::new(*d.spec(), d.device_pages()).map_err(pd_error)?;
        let zone = Arc::new(LandingZone::new(g).map_err(pd_error)?);
        let (d_end, p_end) = local::pair(
            zone,
            hello(Role::Decode, d.spec(), d.device_pages(), Vec::new()),
            hello(Role::Prefill, p.spec(), 0, Vec::new()),
        )
        .map_err(pd_error)?;
        let receiver = Arc::new(
            Receiver::new(
                d.clone(),
                d_end,
                ReceiverConfig {
                    checks: pd.checks,
                    ..Default::default()
                },
            )
            .map_err(pd_error)?,
        );
        let sender = Arc::new(
            Sender::new(
                p.clone(),
                p_end,
                SenderConfig {
                    faults: pd.faults.clone(),
                    stale_barrier: stale_write.clone(),
                    ..Default::default()
                },
            )
            .map_err(pd_error)?,
        );
        let workers = PrefillWorkers::start(
            pd.workers,
            sender.clone(),
            prefill.clone(),
            p_handle,
            pd.timeout,
        )?;
        decode.set_prompt_source(Arc::new(DecodeSource {
            handle: d_handle,
            receiver: receiver.clone(),
            page_size: cfg.page_size(),
            timeout: pd.timeout,
            read_before_landed,
            stale_write,
            fetches: AtomicU64::new(0),
        }))?;
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = {
            let (stop, rx, tx, m) = (
                stop.clone(),
                receiver.clone(),
                sender.clone(),
                decode_metrics,
            );
            std::thread::Builder::new()
                .name("sparsekit-pd-metrics".into())
                .spawn(move || {
                    let mut seen = BTreeMap::new();
                    loop {
                        publish(&m, &rx.stats(), &tx.stats(), &mut seen);
                        m.quarantined("pd", rx.quarantined_pages());
                        m.transfers_in_flight(rx.in_flight() + tx.in_flight());
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                })
                .map_err(|e| EngineError::Unavailable(format!("PD metrics thread: {e}")))?
        };
        Ok(PdPair {
            prefill,
            decode,
            receiver,
            sender,
            workers: Some(workers),
            publisher: Some((stop, publisher)),
        })
    }

    /// Decode's transfers not ended yet.
    pub fn transfers_in_flight(&self) -> usize {
        self.receiver.in_flight()
    }

    /// Pages decode holds for aborted transfers until prefill confirms.
    pub fn quarantined_pages(&self) -> usize {
        self.receiver.quarantined_pages()
    }

    /// The endpoints' counters (decode's receiver, prefill's sender).
    pub fn stats(&self) -> (PdStatsSnapshot, PdStatsSnapshot) {
        (self.receiver.stats(), self.sender.stats())
    }

    /// Stops both engines (up to `grace` each for what is in flight), the prefill
    /// workers and the metrics thread.
    pub fn shutdown(mut self, grace: Duration) -> Result<(), EngineError> {
        let d = self.decode.shutdown(grace);
        let p = self.prefill.shutdown(grace);
        self.workers.take();
        if let Some((stop, t)) = self.publisher.take() {
            stop.store(true, Ordering::Release);
            let _ = t.join();
        }
        d.and(p)
    }
}

impl<B: Backend + 'static> Drop for PdPair<B> {
    fn drop(&mut self) {
        self.workers.take();
        if let Some((stop, t)) = self.publisher.take() {
            stop.store(true, Ordering::Release);
            let _ = t.join();
        }
    }
}
