//! The prefill side of PD: takes decode's bootstraps and pushes each request's pages.
//!
//! A supervised reader thread handles what decode sends. A bootstrap is checked (layout
//! fingerprints equal ours — a mismatch is refused with an `Abort`, never adapted —, one
//! destination page per `page_size` prompt tokens, page ids inside decode's landing zone,
//! no page twice) and queued as a [`Job`] for the prefill engine ([`Sender::next_job`]).
//! The engine serves the prompt from its cache or computes it, then for each layer reads
//! the request's pages through the cache's layer guard ([`Job::stage`], both kinds under
//! one guard, with the checksums the cache's backend computes over the layout) and pushes
//! them ([`Job::write`]): the bytes go to decode's landing zone at offsets derived from the
//! layout descriptors, followed by a notification carrying request, layer, kind, layout
//! fingerprint, pages and checksums. [`Job::finish`] confirms the end.
//!
//! **Aborts.** Decode's `Abort` cancels the job: the reader takes the job's write lock (so
//! no write of it is in flight), marks it cancelled — every later write is refused — and
//! answers `Cancelled`: from then on nothing lands for it. An `Abort` for a request
//! without a job is answered `Cancelled` too (nothing is in flight for it). A job the
//! engine cancels, or drops (a panicking worker unwinds through it), sends prefill's own
//! `Abort`. So every transfer ends with exactly one confirmation, and decode can release
//! its quarantine.
//!
//! **Heartbeats.** While prefill advances (a job taken, a layer written, a job ended, or
//! the engine's [`SenderConfig::liveness`] counter moved within
//! [`SenderConfig::quiet_limit`]), the reader sends decode a `Pending` message naming
//! every job not ended, every [`SenderConfig::heartbeat`]. Decode's stall bound so
//! measures prefill's silence, not its queue: a prompt waiting behind others stays alive,
//! a prefill that stops advancing goes quiet and its transfers end.
//!
//! **Every message is survivable**: malformed frames, unexpected kinds, duplicate
//! bootstraps, aborts for unknown requests are counted, logged and dropped (or answered);
//! a panic while handling a message fails that message's request and restarts the reader.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sparsekit_host::cache::{BufferKind, HiCache, LayerGuard, PageRef, RequestId};
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, PageLayout};
use sparsekit_host::ops::PagedRegion;
use sparsekit_host::Backend;

use crate::pd::error::PdError;
use crate::pd::faults::{PdFault, PdFaults, StaleWriteBarrier};
use crate::pd::landing::LandingGeometry;
use crate::pd::stage::{stage, StagedPages};
use crate::pd::stats::{Ended, PdStats, PdStatsSnapshot};
use crate::pd::wire::{decode_frame, fit_reason, Bootstrap, Message, Role, Written, MAX_PENDING};
use crate::pd::{check_peer, MessageHook};
use crate::transfer::{Segment, Transport};

/// Settings of a [`Sender`].
#[derive(Clone)]
pub struct SenderConfig {
    pub faults: PdFaults,
    /// Longest the reader blocks on the transport at a time.
    pub tick: Duration,
    /// Longest the reader waits for a job's write in flight before it leaves the `Cancelled`
    /// to the job's owner (sent when the owner next touches or drops the job).
    pub abort_wait: Duration,
    /// Late writes held back under the `stale-transfer-write` fault, at most.
    pub max_late: usize,
    /// Jobs (bootstrapped transfers not ended) at most; more bootstraps are refused
    /// (`overloaded`, an `Abort` back to decode): a peer cannot queue prompts without
    /// bound.
    pub max_jobs: usize,
    /// Under `stale-transfer-write`: the rendezvous with decode's decoy transfers (a
    /// decoy's first write waits, bounded, until decode aborted it; see
    /// [`StaleWriteBarrier`]). `None`: the fault bites only where an abort happens to
    /// arrive while writes are in flight.
    pub stale_barrier: Option<Arc<StaleWriteBarrier>>,
    /// How often the reader tells decode which transfers are still pending (`Pending`);
    /// must be well under decode's stall bound.
    pub heartbeat: Duration,
    /// The reader vouches for pending transfers only while prefill advances: a job handed
    /// to a worker, a layer written, a job ended, or `liveness` changed within this bound.
    /// A prefill that stops advancing goes silent, and decode's stall bound ends its
    /// transfers.
    pub quiet_limit: Duration,
    /// A counter that grows while prefill's engine works (e.g. its step count); `None`:
    /// only the sender's own events count as advancing.
    pub liveness: Option<Liveness>,
    /// Fault injection for tests: called with each decoded message before it is handled;
    /// a panic in it is a panicking reader.
    pub hook: Option<MessageHook>,
}

/// A counter that grows while the prefill engine advances ([`SenderConfig::liveness`]).
pub type Liveness = Arc<dyn Fn() -> u64 + Send + Sync>;

impl Default for SenderConfig {
    fn default() -> Self {
        SenderConfig {
            faults: PdFaults::none(),
            tick: Duration::from_millis(20),
            abort_wait: Duration::from_secs(2),
            max_late: 64,
            max_jobs: 4096,
            stale_barrier: None,
            heartbeat: Duration::from_secs(1),
            quiet_limit: Duration::from_secs(30),
            liveness: None,
            hook: None,
        }
    }
}

impl std::fmt::Debug for SenderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SenderConfig")
            .field("faults", &self.faults)
            .field("tick", &self.tick)
            .field("abort_wait", &self.abort_wait)
            .field("max_late", &self.max_late)
            .field("stale_barrier", &self.stale_barrier.is_some())
            .field("heartbeat", &self.heartbeat)
            .field("quiet_limit", &self.quiet_limit)
            .field("liveness", &self.liveness.is_some())
            .field("hook", &self.hook.is_some())
            .finish()
    }
}

/// Longest a decoy's first write waits for decode's abort (`stale-transfer-write`).
const DECOY_WAIT: Duration = Duration::from_secs(30);

/// A job's mutable state; its mutex is the job's write lock.
#[derive(Debug, Default)]
struct JobState {
    /// The confirmation (`Finished`, `Cancelled` or `Abort`) was sent: nothing more is
    /// written for this job.
    ended: bool,
    /// Under `stale-transfer-write`: confirmed as cancelled but still writing (late).
    zombie: bool,
    /// Layers pushed.
    written: Vec<bool>,
}

#[derive(Debug)]
struct JobCore {
    req: u64,
    prompt: Vec<u32>,
    dest: Vec<PageRef>,
    /// Decode asked to stop (its reason).
    cancel: AtomicBool,
    cancel_reason: Mutex<String>,
    state: Mutex<JobState>,
}

/// A write held back under the `stale-transfer-write` fault.
#[derive(Debug)]
struct LateWrite {
    layer: usize,
    kind: BufferKind,
    pages: HashSet<u32>,
    segments: Vec<(usize, Vec<u8>)>,
    notification: Vec<u8>,
}

#[derive(Debug)]
struct TxShared<B: Backend + 'static> {
    cache: Arc<HiCache<B>>,
    transport: Arc<dyn Transport>,
    /// Decode's landing zone.
    geometry: LandingGeometry,
    config: SenderConfig,
    jobs: Mutex<HashMap<u64, Arc<JobCore>>>,
    queue_tx: flume::Sender<Arc<JobCore>>,
    queue_rx: flume::Receiver<Arc<JobCore>>,
    late: Mutex<VecDeque<LateWrite>>,
    stats: PdStats,
    handling: Mutex<Option<u64>>,
    shutdown: AtomicBool,
    closed: Mutex<Option<String>>,
    /// When prefill last advanced (see [`SenderConfig::quiet_limit`]).
    advanced: Mutex<Instant>,
}

/// The reader's heartbeat bookkeeping.
struct Beat {
    last: Instant,
    liveness: Option<u64>,
}

/// The prefill side's PD endpoint (see the module docs).
#[derive(Debug)]
pub struct Sender<B: Backend + 'static> {
    shared: Arc<TxShared<B>>,
    reader: Option<JoinHandle<()>>,
}

/// One request to push, as bootstrapped by decode. Dropping it without [`Job::finish`]
/// or [`Job::cancel`] cancels it (decode is told).
#[derive(Debug)]
pub struct Job<B: Backend + 'static> {
    core: Arc<JobCore>,
    shared: Arc<TxShared<B>>,
    done: bool,
}

/// One layer's pages of every kind the layer holds, staged under its guard.
#[derive(Clone, Debug)]
pub struct StagedLayer {
    layer: usize,
    pools: Vec<(BufferKind, StagedPages)>,
}

impl StagedLayer {
    pub fn layer(&self) -> usize {
        self.layer
    }
}

impl<B: Backend + 'static> Sender<B> {
    /// A sender pushing pages of `cache` (prefill's) over `transport` (a prefill end).
    /// Refuses a peer that is not a decode endpoint with our layouts.
    pub fn new(
        cache: Arc<HiCache<B>>,
        transport: Arc<dyn Transport>,
        config: SenderConfig,
    ) -> Result<Self, PdError> {
        let spec = *cache.spec();
        if let Err(e) = check_peer(&spec, transport.peer(), Role::Decode) {
            transport.close(&e.to_string());
            return Err(e);
        }
        let geometry = LandingGeometry::new(spec, transport.peer().landing_pages as usize)?;
        let (queue_tx, queue_rx) = flume::unbounded();
        let shared = Arc::new(TxShared {
            cache,
            transport,
            geometry,
            config,
            jobs: Mutex::new(HashMap::new()),
            queue_tx,
            queue_rx,
            late: Mutex::new(VecDeque::new()),
            stats: PdStats::new(),
            handling: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            closed: Mutex::new(None),
            advanced: Mutex::new(Instant::now()),
        });
        let sh = shared.clone();
        let reader = std::thread::Builder::new()
            .name("sparsekit-pd-prefill".into())
            .spawn(move || supervise(&sh))
            .map_err(|e| PdError::Invalid(format!("cannot start the PD reader: {e}")))?;
        Ok(Sender {
            shared,
            reader: Some(reader),
        })
    }

    /// The next bootstrapped request (waits at most `timeout`). Jobs cancelled while queued
    /// are skipped (already confirmed).
    pub fn next_job(&self, timeout: Duration) -> Option<Job<B>> {
        let deadline = crate::deadline_after(timeout);
        loop {
            let core = self.shared.queue_rx.recv_deadline(deadline).ok()?;
            if !core.state.lock().ended {
                self.shared.advance();
                return Some(Job {
                    core,
                    shared: self.shared.clone(),
                    done: false,
                });
            }
        }
    }

    /// Jobs not ended yet.
    pub fn in_flight(&self) -> usize {
        self.shared.jobs.lock().len()
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.lock().is_some()
    }

    pub fn stats(&self) -> PdStatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Closes the connection; every job's writes fail from now on.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let sh = &*self.shared;
        sh.shutdown.store(true, Ordering::Release);
        sh.transport.close("prefill sender shut down");
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
        sh.teardown("prefill sender shut down");
    }
}

impl<B: Backend + 'static> Drop for Sender<B> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The reader thread: [`TxShared::run`] under [`crate::pd::stats::supervise`] (a panic
/// fails the request whose message was being handled and restarts it).
fn supervise<B: Backend + 'static>(sh: &Arc<TxShared<B>>) {
    crate::pd::stats::supervise(
        "prefill",
        &sh.stats,
        &sh.handling,
        &sh.shutdown,
        || sh.run(),
        |req| sh.fail_request(req, "the prefill PD reader panicked handling it"),
    )
}

impl<B: Backend + 'static> TxShared<B> {
    fn send(&self, m: &Message) -> Result<(), PdError> {
        let f = m.encode()?;
        self.transport.send(&f)?;
        Ok(())
    }

    fn send_logged(&self, m: &Message) {
        if let Err(e) = self.send(m) {
            tracing::warn!(error = %e, message = m.name(), "PD send failed");
        }
    }

    fn refuse(&self, reason: &'static str, req: Option<u64>, detail: &dyn std::fmt::Display) {
        self.stats.refuse(reason);
        tracing::warn!(reason, request = ?req, %detail, "PD prefill refused a message");
    }

    fn run(&self) {
        let mut beat = Beat {
            last: Instant::now(),
            liveness: None,
        };
        loop {
            if self.shutdown.load(Ordering::Acquire) {
                return;
            }
            self.heartbeat(&mut beat);
            match self.transport.recv(self.config.tick) {
                Ok(Some(frame)) => self.handle(&frame),
                Ok(None) => {}
                Err(e) => {
                    self.teardown(&e.to_string());
                    return;
                }
            }
        }
    }

    fn handle(&self, frame: &[u8]) {
        let msg = match decode_frame(frame) {
            Ok(m) => m,
            Err(e) => return self.refuse(e.reason(), None, &e),
        };
        *self.handling.lock() = msg.request();
        if let Some(h) = &self.config.hook {
            h(&msg);
        }
        let req = msg.request();
        if !msg.valid_towards(Role::Prefill) {
            self.refuse("wrong_direction", req, &msg.name());
        } else {
            match msg {
                Message::Bootstrap(b) => self.on_bootstrap(b),
                Message::Abort { req, reason } => self.on_abort(req, &reason),
                Message::Hello(_) => self.refuse("unexpected_hello", None, &"second handshake"),
                m => self.refuse("wrong_direction", req, &m.name()),
            }
        }
        *self.handling.lock() = None;
    }

    fn on_bootstrap(&self, b: Bootstrap) {
        let req = b.req;
        let spec = self.cache.spec();
        let refuse = |reason: &'static str, detail: String| {
            self.refuse(reason, Some(req), &detail);
            self.send_logged(&Message::Abort {
                req,
                reason: fit_reason(format!("bootstrap refused: {detail}")),
            });
        };
        if (b.kv_fingerprint, b.index_k_fingerprint)
            != (spec.kv.fingerprint(), spec.index_k.fingerprint())
        {
            return refuse(
                "layout_mismatch",
                format!(
                    "layouts kv {:#018x} / index-K {:#018x}, ours {:#018x} / {:#018x}",
                    b.kv_fingerprint,
                    b.index_k_fingerprint,
                    spec.kv.fingerprint(),
                    spec.index_k.fingerprint()
                ),
            );
        }
        let need = b.prompt.len().div_ceil(spec.page_size());
        if b.pages.len() != need {
            return refuse(
                "bad_request",
                format!(
                    "{} pages for {} tokens ({need} needed)",
                    b.pages.len(),
                    b.prompt.len()
                ),
            );
        }
        let mut ids = HashSet::new();
        for p in &b.pages {
            if p.id as usize >= self.geometry.num_pages() {
                return refuse(
                    "bad_request",
                    format!(
                        "page {} outside the {}-page landing zone",
                        p.id,
                        self.geometry.num_pages()
                    ),
                );
            }
            if !ids.insert(p.id) {
                return refuse("bad_request", format!("page {} named twice", p.id));
            }
        }
        let core = {
            let mut jobs = self.jobs.lock();
            if jobs.contains_key(&req) {
                drop(jobs);
                return self.refuse("duplicate", Some(req), &"bootstrap for a live transfer");
            }
            if jobs.len() >= self.config.max_jobs {
                drop(jobs);
                return refuse(
                    "overloaded",
                    format!("{} transfers in flight already", self.config.max_jobs),
                );
            }
            let core = Arc::new(JobCore {
                req,
                prompt: b.prompt,
                dest: b.pages,
                cancel: AtomicBool::new(false),
                cancel_reason: Mutex::new(String::new()),
                state: Mutex::new(JobState {
                    written: vec![false; spec.num_layers],
                    ..JobState::default()
                }),
            });
            jobs.insert(req, core.clone());
            core
        };
        self.stats.started();
        if self.queue_tx.send(core).is_err() {
            self.fail_request(req, "the prefill job queue is closed");
        }
    }

    fn on_abort(&self, req: u64, reason: &str) {
        let core = self.jobs.lock().get(&req).cloned();
        let Some(core) = core else {
            // Nothing is in flight for it: confirm, so decode can release its pages.
            self.refuse("unknown_request", Some(req), &"abort");
            return self.send_logged(&Message::Cancelled {
                req,
                reason: "no transfer in flight".into(),
            });
        };
        *core.cancel_reason.lock() = reason.to_owned();
        if self.config.faults.active(PdFault::StaleTransferWrite) {
            // The bug: confirm at once while the job keeps writing.
            let mut st = core.state.lock();
            if !st.ended {
                st.ended = true;
                st.zombie = true;
                self.jobs.lock().remove(&req);
                self.stats.ended(Ended::Cancelled);
                self.send_logged(&Message::Cancelled {
                    req,
                    reason: fit_reason(reason.to_owned()),
                });
            }
            return;
        }
        core.cancel.store(true, Ordering::Release);
        // With the write lock held no write of the job is in flight, and none follows.
        let locked = core.state.try_lock_for(self.config.abort_wait);
        if let Some(mut st) = locked {
            self.confirm_cancelled(&core, &mut st);
        }
    }

    /// Sends `Cancelled` for a job decode asked to stop (once).
    fn confirm_cancelled(&self, core: &JobCore, st: &mut JobState) {
        if st.ended {
            return;
        }
        st.ended = true;
        self.jobs.lock().remove(&core.req);
        self.stats.ended(Ended::Cancelled);
        let reason = core.cancel_reason.lock().clone();
        self.send_logged(&Message::Cancelled {
            req: core.req,
            reason: fit_reason(reason),
        });
    }

    /// Prefill gives `req` up: no more writes; decode is told with an `Abort`.
    fn fail_request(&self, req: u64, why: &str) {
        let core = self.jobs.lock().get(&req).cloned();
        match core {
            Some(core) => {
                core.cancel.store(true, Ordering::Release);
                if let Some(mut st) = core.state.try_lock_for(self.config.abort_wait) {
                    self.end_job(&core, &mut st, why);
                }
            }
            None => self.send_logged(&Message::Abort {
                req,
                reason: fit_reason(why.to_owned()),
            }),
        }
    }

    /// Prefill advanced (a job taken, a layer written, a job ended).
    fn advance(&self) {
        *self.advanced.lock() = Instant::now();
    }

    /// Every `heartbeat`: while prefill advances, tells decode which transfers are still
    /// pending (queued or being computed), so that waiting behind other prompts is not
    /// mistaken for a stall.
    fn heartbeat(&self, beat: &mut Beat) {
        let now = Instant::now();
        if now.duration_since(beat.last) < self.config.heartbeat {
            return;
        }
        beat.last = now;
        if let Some(probe) = &self.config.liveness {
            let v = probe();
            if beat.liveness.is_some_and(|old| old != v) {
                self.advance();
            }
            beat.liveness = Some(v);
        }
        if now.duration_since(*self.advanced.lock()) > self.config.quiet_limit {
            return;
        }
        let reqs: Vec<u64> = self.jobs.lock().keys().copied().collect();
        for chunk in reqs.chunks(MAX_PENDING) {
            self.send_logged(&Message::Pending {
                reqs: chunk.to_vec(),
            });
        }
    }

    /// Ends a job that did not finish: `Cancelled` if decode asked, else `Abort`.
    fn end_job(&self, core: &JobCore, st: &mut JobState, why: &str) {
        if st.ended {
            return;
        }
        self.advance();
        if core.cancel.load(Ordering::Acquire) && !core.cancel_reason.lock().is_empty() {
            return self.confirm_cancelled(core, st);
        }
        st.ended = true;
        self.jobs.lock().remove(&core.req);
        self.stats.ended(Ended::Failed);
        self.send_logged(&Message::Abort {
            req: core.req,
            reason: fit_reason(why.to_owned()),
        });
    }

    /// The connection is gone: every job ends without a message (none can be sent).
    fn teardown(&self, why: &str) {
        {
            let mut c = self.closed.lock();
            if c.is_none() {
                *c = Some(why.to_owned());
                tracing::warn!(%why, "PD connection to decode closed");
            }
        }
        let jobs: Vec<Arc<JobCore>> = self.jobs.lock().drain().map(|(_, c)| c).collect();
        for core in jobs {
            core.cancel.store(true, Ordering::Release);
            if let Some(mut st) = core.state.try_lock_for(self.config.abort_wait) {
                if !st.ended {
                    st.ended = true;
                    self.stats.ended(Ended::Cancelled);
                }
            }
        }
        self.late.lock().clear();
    }

    /// The byte ranges of a `tokens`-token transfer's last page that its copy moves for
    /// pool `kind` framed as `layout` (`None`: the page is full, it moves whole). Under
    /// `model1-scales-as-interleaved` a model1_fp8 page is taken for token-interleaved
    /// (each token's 584 bytes one after the other): the rows move, the tile scales at the
    /// page's end do not.
    fn tail_copy(
        &self,
        kind: BufferKind,
        layout: PageLayout,
        tokens: usize,
    ) -> Option<Vec<std::ops::Range<usize>>> {
        let entries = self.cache.spec().tail_entries(kind, tokens)?;
        match layout {
            PageLayout::Kv(kv)
                if kv.dtype() == KvDtype::Model1Fp8
                    && self
                        .config
                        .faults
                        .active(PdFault::Model1ScalesAsInterleaved) =>
            {
                let end = (entries * kv.bytes_per_token()).min(layout.bytes_per_page());
                Some(std::iter::once(0..end).collect())
            }
            _ => Some(layout.entry_spans(entries)),
        }
    }

    /// Where and how `kind` pages are framed: the layout, and the region of `layer` in
    /// decode's landing zone. Under `pd-fp8-frame`, index-K uses the fp8 layout of the same
    /// shape (its page size and stride; the region's base stays where decode put it).
    fn framing(&self, layer: usize, kind: BufferKind) -> (PageLayout, PagedRegion) {
        let spec = self.cache.spec();
        let region = self.geometry.region(layer, kind);
        if kind == BufferKind::IndexK && self.config.faults.active(PdFault::Fp8Frame) {
            if let Ok(fp8) = IndexKLayout::new(
                IndexKDtype::FP8,
                spec.index_k.head_dim(),
                spec.index_k.page_size(),
            ) {
                let l = PageLayout::from(fp8);
                return (
                    l,
                    PagedRegion {
                        layout: l,
                        stride: l.bytes_per_page(),
                        ..region
                    },
                );
            }
        }
        (region.layout, region)
    }
}

impl<B: Backend + 'static> Job<B> {
    /// Decode's request id.
    pub fn request(&self) -> u64 {
        self.core.req
    }

    /// The prompt whose KV is to be pushed.
    pub fn prompt(&self) -> &[u32] {
        &self.core.prompt
    }

    /// Decode's destination pages (token order).
    pub fn destination(&self) -> &[PageRef] {
        &self.core.dest
    }

    /// Whether decode asked to stop (or the connection is gone): stop computing and drop
    /// or [`Job::cancel`] the job.
    pub fn is_cancelled(&self) -> bool {
        self.core.cancel.load(Ordering::Acquire) || self.core.state.lock().ended
    }

    /// Copies this layer's source pages `src` (prefill's pages of the request, token order,
    /// one per destination page) of both kinds out of the layer `guard` of the sender's
    /// cache, with their checksums. Hold the guard only for this call.
    pub fn stage(
        &self,
        guard: &LayerGuard<'_, B>,
        src: &[PageRef],
    ) -> Result<StagedLayer, PdError> {
        if src.len() != self.core.dest.len() {
            return Err(PdError::Invalid(format!(
                "{} source pages for {} destination pages",
                src.len(),
                self.core.dest.len()
            )));
        }
        let cache = &self.shared.cache;
        // Only pages the guard's step holds, written for their generation in this layer
        // (every pool holding an entry of the prompt, with at least its entries).
        guard.check_pages(src, self.core.prompt.len())?;
        let ids: Vec<i32> = src.iter().map(|p| p.id as i32).collect();
        let b = cache.backend();
        let layer = guard.layer();
        let mut pools = Vec::new();
        let spec = cache.spec();
        for kind in spec.kinds(layer) {
            let view = guard.view(kind, &[])?;
            let tail = spec.tail_spans(kind, self.core.prompt.len());
            let staged = stage(b, cache.device_region(kind), view, &ids, tail.as_deref())?;
            pools.push((kind, staged));
        }
        Ok(StagedLayer { layer, pools })
    }

    /// Pushes a staged layer to decode: every pool's bytes into its landing zone, each
    /// followed by its notification. Refused once the job is cancelled or ended.
    pub fn write(&self, staged: StagedLayer) -> Result<(), PdError> {
        let sh = &*self.shared;
        let core = &*self.core;
        // `stale-transfer-write` in a pair: a decoy's first write waits (outside the write
        // lock, which the reader takes to answer decode's abort) until decode aborted it.
        let decoy = sh.config.faults.active(PdFault::StaleTransferWrite)
            && sh
                .config
                .stale_barrier
                .as_ref()
                .is_some_and(|b| b.writes_in_flight(core.req, DECOY_WAIT));
        let mut st = core.state.lock();
        if core.cancel.load(Ordering::Acquire) {
            sh.confirm_or_end(core, &mut st);
            return Err(self.cancelled());
        }
        if st.ended && !st.zombie {
            return Err(self.cancelled());
        }
        let layer = staged.layer;
        if layer >= st.written.len() {
            return Err(PdError::Invalid(format!("layer {layer}")));
        }
        for (kind, pages) in staged.pools.iter().map(|(k, p)| (*k, p)) {
            let (layout, region) = sh.framing(layer, kind);
            let page = layout.bytes_per_page();
            let mut segments = Vec::with_capacity(core.dest.len() + 1);
            let tail = sh.tail_copy(kind, layout, core.prompt.len());
            for (i, p) in core.dest.iter().enumerate() {
                let bytes = pages.bytes.get(i * page..(i + 1) * page).ok_or_else(|| {
                    PdError::Invalid(format!("staged {} pages too short", kind.name()))
                })?;
                let at = region.page_range(p.id as usize).start;
                match &tail {
                    // A partly filled last page: only its entries' bytes travel.
                    Some(spans) if i + 1 == core.dest.len() => {
                        for r in spans {
                            segments.push(Segment {
                                offset: at + r.start,
                                bytes: &bytes[r.clone()],
                            });
                        }
                    }
                    _ => segments.push(Segment { offset: at, bytes }),
                }
            }
            let note = Message::Written(Written {
                req: core.req,
                layer: layer as u32,
                kind,
                fingerprint: layout.fingerprint(),
                pages: core.dest.clone(),
                checksums: pages.checksums.clone(),
            })
            .encode()?;
            if st.zombie {
                sh.hold_late(layer, kind, &core.dest, &segments, note);
                continue;
            }
            sh.push(layer, kind, &core.dest, &segments, &note)?;
            sh.stats
                .bytes(kind, segments.iter().map(|s| s.bytes.len()).sum());
        }
        st.written[layer] = true;
        sh.advance();
        if decoy && st.zombie && st.written.iter().all(|w| *w) {
            if let Some(b) = &sh.config.stale_barrier {
                b.all_held(core.req);
            }
        }
        Ok(())
    }

    /// [`Job::stage`] then [`Job::write`] (the guard is held while writing: use the two
    /// calls to release it before the write).
    pub fn send_layer(&self, guard: &LayerGuard<'_, B>, src: &[PageRef]) -> Result<(), PdError> {
        let s = self.stage(guard, src)?;
        self.write(s)
    }

    /// Pushes every layer of request `req` of the sender's cache (its pages `src`), one
    /// step over the request, each layer staged under its guard and written after the guard
    /// is released. Stops with `Cancelled` as soon as decode asks.
    pub fn send_all(&self, req: RequestId, src: &[PageRef]) -> Result<(), PdError> {
        let cache = self.shared.cache.clone();
        let mut step = cache.step(&[req])?;
        for l in 0..cache.spec().num_layers {
            if self.core.cancel.load(Ordering::Acquire) {
                return Err(self.cancelled());
            }
            let staged = {
                let g = step.wait_layer(l)?;
                self.stage(&g, src)?
            };
            self.write(staged)?;
        }
        Ok(())
    }

    /// Confirms the end to decode: every layer was pushed and nothing more will land.
    pub fn finish(mut self) -> Result<(), PdError> {
        self.done = true;
        let sh = &*self.shared;
        let core = &*self.core;
        let mut st = core.state.lock();
        if core.cancel.load(Ordering::Acquire) {
            sh.confirm_or_end(core, &mut st);
            return Err(self.cancelled());
        }
        if st.ended {
            return Err(self.cancelled());
        }
        if let Some(l) = st.written.iter().position(|w| !w) {
            sh.end_job(core, &mut st, &format!("prefill did not push layer {l}"));
            return Err(PdError::Invalid(format!(
                "finish with layer {l} not pushed (the transfer was aborted)"
            )));
        }
        st.ended = true;
        sh.jobs.lock().remove(&core.req);
        sh.advance();
        let m = Message::Finished {
            req: core.req,
            tokens: core.prompt.len() as u32,
        };
        let r = sh.send(&m);
        sh.stats.ended(if r.is_ok() {
            Ended::Finished
        } else {
            Ended::Failed
        });
        r
    }

    /// Prefill gives the request up (decode is told; after a decode abort, this is the
    /// confirmation).
    pub fn cancel(mut self, reason: &str) {
        self.done = true;
        let mut st = self.core.state.lock();
        self.shared.end_job(&self.core, &mut st, reason);
    }

    fn cancelled(&self) -> PdError {
        let reason = self.core.cancel_reason.lock().clone();
        PdError::Cancelled {
            req: self.core.req,
            reason: if reason.is_empty() {
                "the transfer ended".into()
            } else {
                reason
            },
        }
    }
}

impl<B: Backend + 'static> Drop for Job<B> {
    fn drop(&mut self) {
        if !self.done {
            let why = if std::thread::panicking() {
                "the prefill worker failed"
            } else {
                "the prefill job was dropped"
            };
            let mut st = self.core.state.lock();
            self.shared.end_job(&self.core, &mut st, why);
        }
    }
}

impl<B: Backend + 'static> TxShared<B> {
    /// A cancelled job's owner touched it: confirm now if the reader could not.
    fn confirm_or_end(&self, core: &JobCore, st: &mut JobState) {
        self.end_job(core, st, "cancelled");
    }

    /// One kind of one layer to decode: the bytes, then the notification — with, under
    /// `stale-transfer-write`, any held late write to the same pages landing in between.
    fn push(
        &self,
        layer: usize,
        kind: BufferKind,
        dest: &[PageRef],
        segments: &[Segment<'_>],
        note: &[u8],
    ) -> Result<(), PdError> {
        let late = self.take_late(layer, kind, dest);
        if late.is_empty() {
            self.transport.write(segments, Some(note))?;
            return Ok(());
        }
        self.transport.write(segments, None)?;
        for w in late {
            let segs: Vec<Segment<'_>> = w
                .segments
                .iter()
                .map(|(offset, bytes)| Segment {
                    offset: *offset,
                    bytes,
                })
                .collect();
            tracing::warn!(
                layer,
                kind = kind.name(),
                "stale-transfer-write: late write lands"
            );
            self.transport.write(&segs, Some(&w.notification))?;
        }
        self.transport.send(note)?;
        Ok(())
    }

    fn hold_late(
        &self,
        layer: usize,
        kind: BufferKind,
        dest: &[PageRef],
        segments: &[Segment<'_>],
        notification: Vec<u8>,
    ) {
        let mut late = self.late.lock();
        late.push_back(LateWrite {
            layer,
            kind,
            pages: dest.iter().map(|p| p.id).collect(),
            segments: segments
                .iter()
                .map(|s| (s.offset, s.bytes.to_vec()))
                .collect(),
            notification,
        });
        while late.len() > self.config.max_late {
            late.pop_front();
        }
    }

    fn take_late(&self, layer: usize, kind: BufferKind, dest: &[PageRef]) -> Vec<LateWrite> {
        let mut late = self.late.lock();
        if late.is_empty() {
            return Vec::new();
        }
        let (hit, keep): (Vec<LateWrite>, Vec<LateWrite>) = late.drain(..).partition(|w| {
            w.layer == layer && w.kind == kind && dest.iter().any(|p| w.pages.contains(&p.id))
        });
        late.extend(keep);
        hit
    }
}
