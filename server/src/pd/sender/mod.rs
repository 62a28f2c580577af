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

mod job;
mod reader;

use reader::supervise;

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
    /// Per pool: the transfer's page indices it carries (every page, but of the window
    /// pool only the last window's) and their staged bytes.
    pools: Vec<(BufferKind, Vec<usize>, StagedPages)>,
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
        if let Err(e) = check_peer(
            &spec,
            cache.backend().arithmetic(),
            transport.peer(),
            Role::Decode,
        ) {
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
