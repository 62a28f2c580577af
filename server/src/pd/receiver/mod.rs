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

mod reader;

use reader::supervise;

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
    /// An active transfer not done this long after it started is aborted, heartbeats or
    /// not: the bound on every transfer whatever the peer sends (a peer naming a transfer
    /// in `Pending` forever cannot keep its pages held).
    pub transfer_timeout: Duration,
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
            transfer_timeout: Duration::from_secs(600),
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
            .field("transfer_timeout", &self.transfer_timeout)
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
    started: Instant,
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
        if let Err(e) = check_peer(
            &spec,
            cache.backend().arithmetic(),
            transport.peer(),
            Role::Prefill,
        ) {
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
            let inbound = Arc::new(Mutex::new(Some(sh.cache.inbound_tokens(
                req,
                pages,
                prompt.len(),
            )?)));
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
                    started: now,
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
