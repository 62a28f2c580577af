//! The decode side of PD: receives each request's prompt pages into the decode cache.
//!
//! [`Receiver::start`] opens `HiCache::inbound` over the pages decode allocated for the
//! prompt and sends prefill the bootstrap. A supervised reader thread then handles what
//! prefill sends. For every write notification it checks, before anything reaches the
//! cache: that the request has a live transfer (not aborted, not ended), that the layout
//! fingerprint is ours for that kind, that every page is one of the transfer's targets at
//! the generation decode handed out, that it did not land already; then it copies the
//! landed bytes through `Inbound::write`, which re-checks generations and compares the
//! bytes' checksums with the sender's. A layer is published (its ready token minted for
//! the request) only when all its pages of both kinds landed and verified.
//!
//! **Quarantine.** A transfer's target pages stay pinned by its `Inbound` until prefill
//! confirms that nothing more will land (`Finished`, `Cancelled`, or its own `Abort`) or
//! the connection is torn down — and then, where a one-sided write prefill posted may
//! still land (NIXL), for the transport's `late_write_bound` more. Aborting a transfer from decode aborts the request in the
//! cache at once (every reference to its pages goes stale, readers fail) and sends prefill
//! an `Abort`, but keeps the pins until the confirmation: the pages are never reused while
//! a write may still land. A confirmation that never comes within
//! [`ReceiverConfig::confirm_timeout`] tears the connection down. A transfer whose decode
//! request ends while it is in flight (the engine failed it, or served it without waiting
//! for its pages) is aborted the same way at the reader's next tick: nothing will read
//! what lands, so prefill is stopped at once instead of computing and sending the rest.
//!
//! **Every message is survivable.** A frame that does not decode, a message for an
//! unknown, aborted or ended request, a duplicate, a stale or foreign page, a layout
//! mismatch, a checksum mismatch: each is counted by reason ([`PdStats`]), logged and
//! dropped, and the reader goes on. Refused data fails only its own transfer. A panic while
//! handling a message fails the request that message was about and restarts the reader.
//!
//! **Threads.** `start`, `abort` and the queries may be called from any thread, but not
//! from one that holds a layer guard of the decode cache. The reader copies landed pages
//! outside the receiver's state lock, under that transfer's own lock, waiting (bounded by
//! the cache's `wait_timeout`) for the layer's lock; only a call that ends that same
//! transfer meanwhile waits for the copy.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use sparsekit_host::cache::{BufferKind, HiCache, Inbound, PageRef, KINDS};
use sparsekit_host::ops::PagedRegion;
use sparsekit_host::{Backend, Error as HostError};

use crate::pd::error::PdError;
use crate::pd::faults::Checks;
use crate::pd::landing::LandingZone;
use crate::pd::stage::{checksums, zero_outside};
use crate::pd::stats::{Ended, PdStats, PdStatsSnapshot};
use crate::pd::wire::{decode_frame, Bootstrap, Message, Role, Written};
use crate::pd::{check_peer, MessageHook};
use crate::transfer::{TransferError, Transport};

/// Settings of a [`Receiver`].
#[derive(Clone)]
pub struct ReceiverConfig {
    pub checks: Checks,
    /// Longest the reader blocks on the transport before it looks at its deadlines.
    pub tick: Duration,
    /// After prefill's `Finished`, how long notifications it sent earlier may still be on
    /// their way (transports may deliver notifications and control frames out of order).
    pub finish_grace: Duration,
    /// An active transfer without progress for this long is aborted. Progress is a layer
    /// landed or prefill's `Pending` heartbeat naming the transfer (sent while it waits
    /// in prefill's queue and prefill's engine advances), so the bound measures prefill's
    /// silence, not how long its queue is.
    pub stall_timeout: Duration,
    /// An aborted transfer whose confirmation does not come within this bound tears the
    /// connection down (the only safe way to release its pages).
    pub confirm_timeout: Duration,
    /// Ended transfers remembered (to tell a late message from an unknown one).
    pub remember_ended: usize,
    /// Fault injection for tests: called with each decoded message before it is handled;
    /// a panic in it is a panicking reader.
    pub hook: Option<MessageHook>,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        ReceiverConfig {
            checks: Checks::all(),
            tick: Duration::from_millis(20),
            finish_grace: Duration::from_secs(5),
            stall_timeout: Duration::from_secs(60),
            confirm_timeout: Duration::from_secs(30),
            remember_ended: 4096,
            hook: None,
        }
    }
}

impl std::fmt::Debug for ReceiverConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverConfig")
            .field("checks", &self.checks)
            .field("tick", &self.tick)
            .field("finish_grace", &self.finish_grace)
            .field("stall_timeout", &self.stall_timeout)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("remember_ended", &self.remember_ended)
            .field("hook", &self.hook.is_some())
            .finish()
    }
}

/// How a transfer ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every layer landed, verified and was published; prefill confirmed the end.
    Ready,
    /// Aborted (by decode, or by prefill) before it finished.
    Cancelled(String),
    /// Refused data, a protocol violation, a stall or a lost connection.
    Failed(String),
}

#[derive(Debug)]
enum Phase {
    Active,
    /// Aborted; the pins are held until prefill confirms. `outcome` is what the transfer
    /// ends as.
    Aborting {
        since: Instant,
        outcome: Outcome,
    },
}

#[derive(Debug)]
struct Transfer<B: Backend + 'static> {
    /// Behind its own lock, so that landing a layer (which may wait for the cache's layer
    /// lock) happens outside the receiver's state lock; `None` once the transfer ended.
    inbound: SharedInbound<B>,
    targets: Vec<PageRef>,
    index: HashMap<u32, usize>,
    prompt_tokens: usize,
    /// `[layer · targets + i][kind]`: that page landed (verified) for that kind.
    landed: Vec<[bool; KINDS]>,
    phase: Phase,
    finished_at: Option<Instant>,
    progress: Instant,
}

type SharedInbound<B> = Arc<Mutex<Option<Inbound<B>>>>;

/// Whether every layer of the transfer was published (false once it ended).
fn published<B: Backend + 'static>(cache: &HiCache<B>, t: &Transfer<B>) -> bool {
    match t.inbound.lock().as_ref() {
        Some(i) => (0..cache.spec().num_layers).all(|l| i.is_layer_ready(l)),
        None => false,
    }
}

/// A layer's pages of one kind to copy into the cache, validated under the state lock
/// and landed outside it.
#[derive(Debug)]
struct LandJob<B: Backend + 'static> {
    req: u64,
    layer: usize,
    kind: BufferKind,
    pages: Vec<PageRef>,
    checksums: Vec<u64>,
    /// The transfer's partly filled last page, when among `pages`: its index there and
    /// the byte ranges of it that the transfer carries (the rest is zeroed on landing).
    tail: Option<(usize, Vec<std::ops::Range<usize>>)>,
    inbound: SharedInbound<B>,
}

#[derive(Debug)]
struct RxState<B: Backend + 'static> {
    transfers: HashMap<u64, Transfer<B>>,
    ended: HashMap<u64, Outcome>,
    ended_order: VecDeque<u64>,
    closed: Option<String>,
}

#[derive(Debug)]
struct RxShared<B: Backend + 'static> {
    cache: Arc<HiCache<B>>,
    transport: Arc<dyn Transport>,
    landing: Arc<LandingZone>,
    config: ReceiverConfig,
    state: Mutex<RxState<B>>,
    changed: Condvar,
    stats: PdStats,
    /// The request of the message being handled (failed if the handler panics).
    handling: Mutex<Option<u64>>,
    shutdown: AtomicBool,
}

/// The decode side's PD endpoint (see the module docs).
#[derive(Debug)]
pub struct Receiver<B: Backend + 'static> {
    shared: Arc<RxShared<B>>,
    reader: Option<JoinHandle<()>>,
}

/// Frames to send once the state lock is released.
type Outbox = Vec<Message>;

fn kind_index(kind: BufferKind) -> usize {
    kind.index()
}

impl<B: Backend + 'static> Receiver<B> {
    /// A receiver writing into `cache` what arrives over `transport` (a decode end, whose
    /// landing zone mirrors `cache`'s device pool). Refuses a peer that is not a prefill
    /// endpoint with our layouts.
    pub fn new(
        cache: Arc<HiCache<B>>,
        transport: Arc<dyn Transport>,
        config: ReceiverConfig,
    ) -> Result<Self, PdError> {
        let spec = *cache.spec();
        let landing = transport.landing().ok_or_else(|| {
            PdError::Invalid("the transport is not a decode end (no landing zone)".into())
        })?;
        let g = landing.geometry();
        if *g.spec() != spec || g.num_pages() != cache.device_pages() {
            return Err(PdError::Invalid(format!(
                "the landing zone ({} pages) does not mirror the cache's device pool ({} pages)",
                g.num_pages(),
                cache.device_pages()
            )));
        }
        if let Err(e) = check_peer(&spec, transport.peer(), Role::Prefill) {
            transport.close(&e.to_string());
            return Err(e);
        }
        let shared = Arc::new(RxShared {
            cache,
            transport,
            landing,
            config,
            state: Mutex::new(RxState {
                transfers: HashMap::new(),
                ended: HashMap::new(),
                ended_order: VecDeque::new(),
                closed: None,
            }),
            changed: Condvar::new(),
            stats: PdStats::new(),
            handling: Mutex::new(None),
            shutdown: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let reader = std::thread::Builder::new()
            .name("sparsekit-pd-decode".into())
            .spawn(move || supervise(&sh))
            .map_err(|e| PdError::Invalid(format!("cannot start the PD reader: {e}")))?;
        Ok(Receiver {
            shared,
            reader: Some(reader),
        })
    }

    /// The decode cache.
    pub fn cache(&self) -> &Arc<HiCache<B>> {
        &self.shared.cache
    }

    /// Starts receiving `prompt`'s pages into `pages` (owned by live request `req` of the
    /// cache, `ceil(prompt.len() / page_size)` of them, in token order) and sends prefill
    /// the bootstrap.
    pub fn start(&self, req: u64, prompt: &[u32], pages: &[PageRef]) -> Result<(), PdError> {
        let sh = &*self.shared;
        let ps = sh.cache.spec().page_size();
        if prompt.is_empty() || pages.len() != prompt.len().div_ceil(ps) {
            return Err(PdError::Invalid(format!(
                "{} pages for a prompt of {} tokens ({ps} per page)",
                pages.len(),
                prompt.len()
            )));
        }
        {
            let mut st = sh.state.lock();
            if let Some(why) = &st.closed {
                return Err(TransferError::Closed(why.clone()).into());
            }
            if st.transfers.contains_key(&req) {
                return Err(PdError::Duplicate(req));
            }
            let inbound = Arc::new(Mutex::new(Some(sh.cache.inbound(req, pages)?)));
            let layers = sh.cache.spec().num_layers;
            let now = Instant::now();
            st.transfers.insert(
                req,
                Transfer {
                    inbound,
                    targets: pages.to_vec(),
                    index: pages.iter().enumerate().map(|(i, p)| (p.id, i)).collect(),
                    prompt_tokens: prompt.len(),
                    landed: vec![[false; KINDS]; layers * pages.len()],
                    phase: Phase::Active,
                    finished_at: None,
                    progress: now,
                },
            );
            st.ended.remove(&req);
            sh.stats.started();
        }
        let spec = sh.cache.spec();
        let boot = Message::Bootstrap(Bootstrap {
            req,
            kv_fingerprint: spec.kv.fingerprint(),
            index_k_fingerprint: spec.index_k.fingerprint(),
            prompt: prompt.to_vec(),
            pages: pages.to_vec(),
        });
        if let Err(e) = sh.send(&boot) {
            let mut st = sh.state.lock();
            // Nothing was sent: nothing can land. Release at once.
            sh.end(
                &mut st,
                req,
                Outcome::Failed(format!("bootstrap not sent: {e}")),
            );
            return Err(e);
        }
        Ok(())
    }

    /// Aborts `req`'s transfer: the request is aborted in the cache (its readers fail, its
    /// page references go stale), prefill is told, and the pages stay quarantined until it
    /// confirms. Returns whether there was an active transfer.
    pub fn abort(&self, req: u64, reason: &str) -> bool {
        let sh = &*self.shared;
        let mut out = Outbox::new();
        let found = {
            let mut st = sh.state.lock();
            let active = st
                .transfers
                .get(&req)
                .is_some_and(|t| matches!(t.phase, Phase::Active));
            if active {
                sh.begin_abort(
                    &mut st,
                    req,
                    Outcome::Cancelled(reason.to_owned()),
                    &mut out,
                );
            }
            active
        };
        sh.flush(out);
        found
    }

    /// Whether every layer of `req`'s transfer has been published (decode may run it).
    pub fn is_ready(&self, req: u64) -> bool {
        let st = self.shared.state.lock();
        match st.transfers.get(&req) {
            Some(t) => matches!(t.phase, Phase::Active) && published(&self.shared.cache, t),
            None => st.ended.get(&req) == Some(&Outcome::Ready),
        }
    }

    /// How `req`'s transfer ended (`None` while it is in flight or unknown).
    pub fn outcome(&self, req: u64) -> Option<Outcome> {
        self.shared.state.lock().ended.get(&req).cloned()
    }

    /// Waits (at most `timeout`) until `req`'s transfer ended, and returns how.
    pub fn wait(&self, req: u64, timeout: Duration) -> Result<Outcome, PdError> {
        let deadline = crate::deadline_after(timeout);
        let mut st = self.shared.state.lock();
        loop {
            if let Some(o) = st.ended.get(&req) {
                return Ok(o.clone());
            }
            if !st.transfers.contains_key(&req) {
                return Err(PdError::UnknownRequest(req));
            }
            if self
                .shared
                .changed
                .wait_until(&mut st, deadline)
                .timed_out()
            {
                return Err(PdError::Timeout(format!(
                    "transfer of request {req} still in flight after {timeout:?}"
                )));
            }
        }
    }

    /// Transfers not ended yet (active or waiting for their confirmation).
    pub fn in_flight(&self) -> usize {
        self.shared.state.lock().transfers.len()
    }

    /// Pages held for aborted transfers until prefill confirms (the quarantine).
    pub fn quarantined_pages(&self) -> usize {
        self.shared
            .state
            .lock()
            .transfers
            .values()
            .filter(|t| matches!(t.phase, Phase::Aborting { .. }))
            .map(|t| t.targets.len())
            .sum()
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.state.lock().closed.is_some()
    }

    pub fn stats(&self) -> PdStatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Closes the connection and ends every transfer (failed), releasing their pages.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let sh = &*self.shared;
        sh.shutdown.store(true, Ordering::Release);
        sh.transport.close("decode receiver shut down");
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
        let mut st = sh.state.lock();
        sh.teardown(&mut st, "decode receiver shut down");
    }
}

impl<B: Backend + 'static> Drop for Receiver<B> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The reader thread: [`RxShared::run`] under [`crate::pd::stats::supervise`] (a panic
/// fails the request whose message was being handled and restarts it).
fn supervise<B: Backend + 'static>(sh: &Arc<RxShared<B>>) {
    crate::pd::stats::supervise(
        "decode",
        &sh.stats,
        &sh.handling,
        &sh.shutdown,
        || sh.run(),
        |req| {
            let mut out = Outbox::new();
            {
                let mut st = sh.state.lock();
                sh.begin_abort(
                    &mut st,
                    req,
                    Outcome::Failed("the PD reader panicked handling it".into()),
                    &mut out,
                );
            }
            sh.flush(out);
        },
    )
}

impl<B: Backend + 'static> RxShared<B> {
    fn send(&self, m: &Message) -> Result<(), PdError> {
        let f = m.encode()?;
        self.transport.send(&f)?;
        Ok(())
    }

    /// Sends what the handlers queued (a failed send surfaces as a closed connection).
    fn flush(&self, out: Outbox) {
        for m in out {
            if let Err(e) = self.send(&m) {
                tracing::warn!(error = %e, message = m.name(), "PD send failed");
            }
        }
    }

    fn refuse(&self, reason: &'static str, req: Option<u64>, detail: &dyn std::fmt::Display) {
        self.stats.refuse(reason);
        tracing::warn!(reason, request = ?req, %detail, "PD decode refused a message");
    }

    fn run(&self) {
        let mut last_tick = Instant::now();
        loop {
            if self.shutdown.load(Ordering::Acquire) {
                return;
            }
            match self.transport.recv(self.config.tick) {
                Ok(Some(frame)) => self.handle(&frame),
                Ok(None) => {}
                Err(e) => {
                    let mut st = self.state.lock();
                    self.teardown(&mut st, &e.to_string());
                    return;
                }
            }
            // Deadlines are scanned once per tick, not once per frame.
            if last_tick.elapsed() >= self.config.tick {
                last_tick = Instant::now();
                self.tick();
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
        let mut out = Outbox::new();
        let job = {
            let mut st = self.state.lock();
            self.dispatch(&mut st, msg, &mut out)
        };
        // A layer lands outside the state lock: the copy may wait (bounded) for the
        // cache's layer lock, and nothing else of the receiver waits behind it.
        if let Some(job) = job {
            let result = self.land(&job);
            let mut st = self.state.lock();
            self.landed(&mut st, job, result, &mut out);
        }
        *self.handling.lock() = None;
        self.flush(out);
    }

    /// Handles `msg`; a valid write notification comes back as the pages to land.
    fn dispatch(&self, st: &mut RxState<B>, msg: Message, out: &mut Outbox) -> Option<LandJob<B>> {
        let req = msg.request();
        if !msg.valid_towards(Role::Decode) {
            self.refuse("wrong_direction", req, &msg.name());
            return None;
        }
        match msg {
            Message::Hello(_) => self.refuse("unexpected_hello", None, &"second handshake"),
            Message::Written(w) => return self.on_written(st, w, out),
            Message::Finished { req, tokens } => self.on_finished(st, req, tokens),
            Message::Cancelled { req, reason } => {
                self.on_confirmation(st, req, Outcome::Cancelled(reason))
            }
            Message::Abort { req, reason } => self.on_confirmation(
                st,
                req,
                Outcome::Cancelled(format!("prefill aborted: {reason}")),
            ),
            Message::Bootstrap(_) => self.refuse("wrong_direction", req, &"bootstrap"),
            Message::Pending { reqs } => {
                // Requests that ended meanwhile (or were never ours) are skipped: a
                // heartbeat only ever extends a live transfer's stall bound.
                let now = Instant::now();
                for r in reqs {
                    if let Some(t) = st.transfers.get_mut(&r) {
                        if matches!(t.phase, Phase::Active) {
                            t.progress = now;
                        }
                    }
                }
            }
        }
        None
    }

    /// Refusal reason for a message about a request without a live transfer.
    fn missing(&self, st: &RxState<B>, req: u64, what: &str) {
        if st.ended.contains_key(&req) {
            self.refuse(
                "ended",
                Some(req),
                &format!("{what} after the transfer ended"),
            );
        } else {
            self.refuse("unknown_request", Some(req), &what);
        }
    }

    /// Validates a write notification; the pages to land when it is acceptable.
    fn on_written(&self, st: &mut RxState<B>, w: Written, out: &mut Outbox) -> Option<LandJob<B>> {
        let req = w.req;
        let spec = *self.cache.spec();
        let Some(t) = st.transfers.get_mut(&req) else {
            self.missing(st, req, "write notification");
            return None;
        };
        if let Phase::Aborting { .. } = t.phase {
            self.refuse("after_abort", Some(req), &"late write after abort");
            return None;
        }
        let layer = w.layer as usize;
        if layer >= spec.num_layers {
            self.refuse(
                "bad_request",
                Some(req),
                &format!("layer {layer} of {}", spec.num_layers),
            );
            return None;
        }
        let want = spec.layout(w.kind).fingerprint();
        if self.config.checks.fingerprints && w.fingerprint != want {
            self.refuse(
                "layout_mismatch",
                Some(req),
                &format!(
                    "{} pages framed with layout {:#018x}, ours is {want:#018x}",
                    w.kind.name(),
                    w.fingerprint
                ),
            );
            self.begin_abort(
                st,
                req,
                Outcome::Failed(format!("{} layout mismatch", w.kind.name())),
                out,
            );
            return None;
        }
        let n = t.targets.len();
        let k = kind_index(w.kind);
        let mut seen = HashSet::new();
        for p in &w.pages {
            let refused = match t.index.get(&p.id) {
                None => Some((
                    "not_target",
                    format!("page {} is not a target of the transfer", p.id),
                )),
                Some(&i) if t.targets[i].generation != p.generation => Some((
                    "stale_generation",
                    format!(
                        "page {} generation {} (the transfer's is {})",
                        p.id, p.generation, t.targets[i].generation
                    ),
                )),
                Some(&i) if !seen.insert(i) || t.landed[layer * n + i][k] => Some((
                    "duplicate",
                    format!("page {} of layer {layer} {} again", p.id, w.kind.name()),
                )),
                Some(_) => None,
            };
            if let Some((reason, detail)) = refused {
                self.refuse(reason, Some(req), &detail);
                return None;
            }
        }
        let tail = t.targets.last().and_then(|last| {
            let i = w.pages.iter().position(|p| p.id == last.id)?;
            Some((i, spec.tail_spans(w.kind, t.prompt_tokens)?))
        });
        Some(LandJob {
            req,
            layer,
            kind: w.kind,
            pages: w.pages,
            checksums: w.checksums,
            tail,
            inbound: t.inbound.clone(),
        })
    }

    /// Applies the outcome of landing `job` (the transfer may have ended meanwhile).
    fn landed(
        &self,
        st: &mut RxState<B>,
        job: LandJob<B>,
        result: Result<usize, PdError>,
        out: &mut Outbox,
    ) {
        let (req, layer) = (job.req, job.layer);
        let Some(t) = st.transfers.get_mut(&req) else {
            return;
        };
        let (n, k) = (t.targets.len(), kind_index(job.kind));
        match result {
            Ok(bytes) => {
                self.stats.bytes(job.kind, bytes);
                for p in &job.pages {
                    if let Some(&i) = t.index.get(&p.id) {
                        t.landed[layer * n + i][k] = true;
                    }
                }
                t.progress = Instant::now();
                if t.finished_at.is_some() && self.all_published(t) {
                    self.complete(st, req);
                }
            }
            Err(PdError::Cache(HostError::StalePage { .. })) => {
                self.refuse(
                    "stale_generation",
                    Some(req),
                    &"the cache refused a stale page",
                );
                if !self.cache.is_live(req) {
                    // The decode request ended (failed, or served without waiting for
                    // its pages): nothing will read this transfer; stop it, keeping the
                    // pages quarantined until prefill confirms.
                    self.begin_abort(
                        st,
                        req,
                        Outcome::Cancelled("the decode request ended".into()),
                        out,
                    );
                }
            }
            Err(PdError::Cache(e @ HostError::Integrity { .. })) => {
                self.refuse("checksum", Some(req), &e);
                self.begin_abort(
                    st,
                    req,
                    Outcome::Failed(format!("refused landed bytes: {e}")),
                    out,
                );
            }
            Err(e) => {
                self.refuse("cache_refused", Some(req), &e);
                self.begin_abort(st, req, Outcome::Failed(e.to_string()), out);
            }
        }
    }

    /// Copies the landed pages into the cache through the transfer's inbound (generation
    /// and checksum checks there), holding only that transfer's lock. Returns the bytes
    /// copied.
    fn land(&self, job: &LandJob<B>) -> Result<usize, PdError> {
        let (layer, kind, pages) = (job.layer, job.kind, &job.pages);
        let ids: Vec<u32> = pages.iter().map(|p| p.id).collect();
        let b = self.cache.backend();
        let mut bytes = self.landing.read_pages(layer, kind, &ids)?;
        let region = PagedRegion::contiguous(self.cache.spec().layout(kind), pages.len());
        if let Some((i, spans)) = &job.tail {
            // Only the entries' bytes of a partly filled last page were sent: the rest of
            // the landing page is whatever an earlier transfer left there.
            let page = region.layout.bytes_per_page();
            if let Some(one) = bytes.get_mut(i * page..(i + 1) * page) {
                zero_outside(one, spans);
            }
        }
        let buf = b.upload(&bytes)?;
        let src_ids: Vec<i32> = (0..pages.len() as i32).collect();
        // Checks off: trust whatever landed (its own checksums always match).
        let sums = if self.config.checks.checksums {
            job.checksums.clone()
        } else {
            checksums(b, region, &buf, &src_ids)?
        };
        let mut inbound = job.inbound.lock();
        let Some(inbound) = inbound.as_mut() else {
            return Err(PdError::Invalid(
                "the transfer ended while its pages landed".into(),
            ));
        };
        inbound.write(layer, kind, pages, &buf, region, &src_ids, &sums)?;
        Ok(bytes.len())
    }

    fn all_published(&self, t: &Transfer<B>) -> bool {
        published(&self.cache, t)
    }

    fn on_finished(&self, st: &mut RxState<B>, req: u64, tokens: u32) {
        let Some(t) = st.transfers.get_mut(&req) else {
            return self.missing(st, req, "finished");
        };
        match t.phase {
            // Our abort crossed prefill's end: nothing more lands either way.
            Phase::Aborting { ref outcome, .. } => {
                let o = outcome.clone();
                self.end(st, req, o)
            }
            Phase::Active if t.finished_at.is_some() => {
                self.refuse("duplicate", Some(req), &"second finished")
            }
            Phase::Active if tokens as usize != t.prompt_tokens => {
                let detail = format!(
                    "prefill finished {tokens} tokens of a {}-token prompt",
                    t.prompt_tokens
                );
                self.refuse("bad_request", Some(req), &detail);
                // Prefill says nothing more lands: release at once.
                let _ = self.cache.abort(req);
                self.end(st, req, Outcome::Failed(detail));
            }
            Phase::Active => {
                t.finished_at = Some(Instant::now());
                if self.all_published(t) {
                    self.complete(st, req);
                }
            }
        }
    }

    /// Prefill says nothing more will land for `req` (`Cancelled`, or its own `Abort`).
    fn on_confirmation(&self, st: &mut RxState<B>, req: u64, peer: Outcome) {
        let Some(t) = st.transfers.get(&req) else {
            return self.missing(st, req, "cancellation");
        };
        let outcome = match &t.phase {
            Phase::Aborting { outcome, .. } => outcome.clone(),
            Phase::Active => {
                // Prefill gave up on its own: the request cannot be served.
                let _ = self.cache.abort(req);
                peer
            }
        };
        self.end(st, req, outcome);
    }

    /// Aborts an active transfer: the cache request is aborted (readers fail, references go
    /// stale; the inbound keeps the pages pinned) and prefill is asked to stop.
    fn begin_abort(&self, st: &mut RxState<B>, req: u64, outcome: Outcome, out: &mut Outbox) {
        let Some(t) = st.transfers.get_mut(&req) else {
            return;
        };
        if !matches!(t.phase, Phase::Active) {
            return;
        }
        let reason = match &outcome {
            Outcome::Cancelled(r) | Outcome::Failed(r) => r.clone(),
            Outcome::Ready => String::new(),
        };
        t.phase = Phase::Aborting {
            since: Instant::now(),
            outcome,
        };
        let _ = self.cache.abort(req);
        tracing::info!(request = req, %reason, "PD transfer aborted; pages quarantined until prefill confirms");
        out.push(Message::Abort {
            req,
            reason: crate::pd::wire::fit_reason(reason),
        });
        self.changed.notify_all();
    }

    /// Every layer published and prefill finished: the transfer completes.
    fn complete(&self, st: &mut RxState<B>, req: u64) {
        self.end(st, req, Outcome::Ready);
    }

    /// Ends a transfer for good: its inbound ends (pins released), the outcome is kept.
    fn end(&self, st: &mut RxState<B>, req: u64, outcome: Outcome) {
        let Some(t) = st.transfers.remove(&req) else {
            return;
        };
        let inbound = t.inbound.lock().take();
        let outcome = match (outcome, inbound) {
            (Outcome::Ready, Some(i)) => match i.complete() {
                Ok(()) => Outcome::Ready,
                Err(e) => Outcome::Failed(e.to_string()),
            },
            (o, i) => {
                let e = match &o {
                    Outcome::Cancelled(r) => HostError::Cancelled(r.clone()),
                    _ => HostError::Cancelled(format!("PD transfer failed: {o:?}")),
                };
                if let Some(i) = i {
                    i.fail(e);
                }
                o
            }
        };
        self.record_end(st, req, outcome);
    }

    /// Counts an ended transfer and remembers its outcome.
    fn record_end(&self, st: &mut RxState<B>, req: u64, outcome: Outcome) {
        self.stats.ended(match outcome {
            Outcome::Ready => Ended::Finished,
            Outcome::Cancelled(_) => Ended::Cancelled,
            Outcome::Failed(_) => Ended::Failed,
        });
        st.ended.insert(req, outcome);
        st.ended_order.push_back(req);
        while st.ended_order.len() > self.config.remember_ended {
            if let Some(old) = st.ended_order.pop_front() {
                if !st.transfers.contains_key(&old) {
                    st.ended.remove(&old);
                }
            }
        }
        self.changed.notify_all();
    }

    /// The connection is gone: every transfer ends. Where a write the peer posted before
    /// may still land ([`Transport::late_write_bound`]), the transfers' target pages stay
    /// quarantined for that bound before they can be reused.
    fn teardown(&self, st: &mut RxState<B>, why: &str) {
        if st.closed.is_none() {
            st.closed = Some(why.to_owned());
            tracing::warn!(%why, transfers = st.transfers.len(), "PD connection to prefill closed");
        }
        let bound = self.transport.late_write_bound();
        let mut held = Vec::new();
        let reqs: Vec<u64> = st.transfers.keys().copied().collect();
        for req in reqs {
            let outcome = match st.transfers.get(&req).map(|t| &t.phase) {
                Some(Phase::Aborting { outcome, .. }) => outcome.clone(),
                _ => {
                    let _ = self.cache.abort(req);
                    Outcome::Failed(format!("connection closed: {why}"))
                }
            };
            if bound.is_zero() {
                self.end(st, req, outcome);
            } else if let Some(t) = self.end_keep_pinned(st, req, outcome) {
                held.push(t);
            }
        }
        if !held.is_empty() {
            // A timer, not a synchronisation: the pins go when no posted write can land.
            let spawned = std::thread::Builder::new()
                .name("sparsekit-pd-quarantine".into())
                .spawn(move || {
                    std::thread::sleep(bound);
                    drop(held);
                });
            if let Err(e) = spawned {
                tracing::error!("PD quarantine timer: {e}; releasing at once");
            }
        }
        self.changed.notify_all();
    }

    /// [`Self::end`] for a transfer whose bytes may still land: its readers fail now, its
    /// inbound (with the pins) is returned to be dropped later.
    fn end_keep_pinned(
        &self,
        st: &mut RxState<B>,
        req: u64,
        outcome: Outcome,
    ) -> Option<Inbound<B>> {
        let t = st.transfers.remove(&req)?;
        let mut inbound = t.inbound.lock().take()?;
        let e = HostError::Cancelled(format!("PD transfer failed: {outcome:?}"));
        inbound.fail_keep_pinned(e);
        self.record_end(st, req, outcome);
        Some(inbound)
    }

    /// Deadlines and orphans: transfers whose decode request ended, finished transfers
    /// whose notifications never came, stalled transfers, unconfirmed aborts.
    fn tick(&self) {
        let now = Instant::now();
        let c = &self.config;
        let mut out = Outbox::new();
        let mut close = None;
        {
            let mut st = self.state.lock();
            let mut late_finish = Vec::new();
            let mut stalled = Vec::new();
            let mut orphaned = Vec::new();
            for (&req, t) in &st.transfers {
                match &t.phase {
                    Phase::Active => {
                        if !self.cache.is_live(req) {
                            orphaned.push(req);
                        } else if t.finished_at.is_some_and(|f| now - f > c.finish_grace) {
                            late_finish.push(req);
                        } else if now - t.progress > c.stall_timeout {
                            stalled.push(req);
                        }
                    }
                    Phase::Aborting { since, .. } => {
                        if now - *since > c.confirm_timeout {
                            close = Some(req);
                        }
                    }
                }
            }
            for req in late_finish {
                self.refuse("missing_layers", Some(req), &"finished with layers missing");
                let _ = self.cache.abort(req);
                self.end(
                    &mut st,
                    req,
                    Outcome::Failed("prefill finished with layers missing".into()),
                );
            }
            for req in orphaned {
                // The decode request ended while its transfer was in flight (failed, or
                // served without waiting for its pages): nothing will read what lands.
                // Stop prefill now rather than at its next write, which may be a whole
                // prompt's compute away; the pages stay quarantined until it confirms.
                self.begin_abort(
                    &mut st,
                    req,
                    Outcome::Cancelled("the decode request ended".into()),
                    &mut out,
                );
            }
            for req in stalled {
                self.begin_abort(
                    &mut st,
                    req,
                    Outcome::Failed(format!("no progress for {:?}", c.stall_timeout)),
                    &mut out,
                );
            }
        }
        self.flush(out);
        if let Some(req) = close {
            let why = format!("prefill did not confirm the abort of request {req}");
            tracing::error!(%why, "tearing the PD connection down");
            self.transport.close(&why);
        }
    }
}
