//! The decode side of a PD deployment, usable alone (`serve --role decode`, prefill in
//! another process) or in a [`crate::pd::pair::PdPair`].
//!
//! - [`DecodeNode`]: the decode engine (no prefix reuse: every prompt page arrives by
//!   transfer), its landing zone, the [`DecodeSource`] the engine fetches prompts through,
//!   and a thread copying the PD counters into the engine's metrics.
//! - [`DecodeSource`] (the engine's [`PromptSource`]): for each request it allocates pages
//!   for the prompt's pages (all but the last token, whose logits decode computes itself;
//!   a partly filled last page moves as its entries' bytes), starts the transfer through
//!   the [`Receiver`] (the bootstrap goes to prefill), waits (bounded) until every layer
//!   of both kinds landed, verified and was published, and hands the pages to the engine
//!   as [`ReceivedPages`]. A client abort aborts the transfer (the pages stay quarantined
//!   until prefill confirms); a refused transfer fails the request.
//! - The connection to prefill is made by a [`Connector`] (in-process pair, NIXL over
//!   TCP + UCX). When it closes — prefill died or restarted — the transfers on it fail and
//!   release their pages, and the next request reconnects (at most one attempt per
//!   [`RECONNECT_EVERY`]; meanwhile requests fail at once with the last connect error).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sparsekit_host::cache::Fault;
use sparsekit_host::{Backend, Error as HostError, ModelOps};

use crate::engine::{CacheHandle, CacheSpaceOptions, ModelConfig, PromptSource, ReceivedPages};
use crate::engine::{Engine, EngineOptions};
use crate::error::EngineError;
use crate::metrics::Metrics;
use crate::pd::error::{pd_error, PdError};
use crate::pd::faults::{PdFault, StaleWriteBarrier};
use crate::pd::landing::{LandingGeometry, LandingZone};
use crate::pd::receiver::{Outcome, Receiver, ReceiverConfig};
use crate::pd::stats::{PdStatsSnapshot, Publisher};
use crate::pd::wire::{Hello, Role};
use crate::pd::{hello, PdOptions, RequestGuard};
use crate::transfer::Transport;

/// Opens a connection to prefill: given decode's landing zone and the handshake decode
/// announces, returns decode's end. Bounded in time. Called at start and again whenever
/// the connection closed.
pub type Connector =
    Arc<dyn Fn(&Arc<LandingZone>, &Hello) -> Result<Arc<dyn Transport>, PdError> + Send + Sync>;

/// How decode reaches prefill: the connector, and how long to keep trying at start.
#[derive(Clone)]
pub struct PeerLink {
    pub connector: Connector,
    /// How long [`DecodeNode::start`] retries (prefill may still be starting).
    pub connect_wait: Duration,
}

impl std::fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerLink")
            .field("connect_wait", &self.connect_wait)
            .finish()
    }
}

/// Least time between two connection attempts after the connection closed.
pub const RECONNECT_EVERY: Duration = Duration::from_secs(1);

/// How long a polling loop below sleeps between looks (room in the decode pool).
const POLL: Duration = Duration::from_millis(2);

/// Longest a fetch waiting for room in the decode pool sleeps between looks.
const MAX_NAP: Duration = Duration::from_millis(50);

/// Under `stale-transfer-write`, one fetch in this many starts with a decoy transfer.
const DECOY_EVERY: u64 = 4;

/// The connection to prefill as the source sees it.
struct Link<B: Backend + 'static> {
    receiver: Option<Arc<Receiver<B>>>,
    last_attempt: Option<Instant>,
    last_error: String,
    /// Counters of the receivers of connections that closed.
    retired: PdStatsSnapshot,
    connections: u64,
}

/// The decode side's [`PromptSource`] (see the module docs).
pub struct DecodeSource<B: Backend + 'static> {
    handle: CacheHandle<B>,
    page_size: usize,
    timeout: Duration,
    zone: Arc<LandingZone>,
    hello: Hello,
    connector: Connector,
    receiver_config: ReceiverConfig,
    link: Mutex<Link<B>>,
    /// Held by the one caller connecting now.
    connecting: Mutex<()>,
    /// `pd-read-before-landed`: hand the pages to the engine as soon as the transfer
    /// started (the engine's steps then skip the ready tokens: the decode cache carries
    /// the `skip-index-wait` fault).
    read_before_landed: bool,
    /// `stale-transfer-write`: the rendezvous with prefill for the decoy transfers, and
    /// the fetches seen (every [`DECOY_EVERY`]th is preceded by a decoy).
    stale_write: Option<Arc<StaleWriteBarrier>>,
    fetches: AtomicU64,
    /// Transfers retried after one ended failed.
    retries: AtomicU64,
}

impl<B: Backend + 'static> std::fmt::Debug for DecodeSource<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeSource")
            .field("page_size", &self.page_size)
            .field("read_before_landed", &self.read_before_landed)
            .field("stale_write", &self.stale_write.is_some())
            .finish()
    }
}

impl<B: Backend + 'static> DecodeSource<B> {
    /// The receiver of the live connection; reconnects when the connection closed (see
    /// the module docs). The link's lock is not held while connecting (bounded, but up
    /// to seconds): one caller connects, the others fail at once meanwhile.
    fn receiver(&self) -> Result<Arc<Receiver<B>>, PdError> {
        let closed = |why: String| {
            PdError::Transfer(crate::transfer::TransferError::Closed(format!(
                "no connection to prefill ({why})"
            )))
        };
        {
            let mut l = self.link.lock();
            match &l.receiver {
                Some(r) if !r.is_closed() => return Ok(r.clone()),
                Some(r) => {
                    // Its transfers ended (failed) with the connection; requests still
                    // holding it see that; the receiver stops when the last of them lets go.
                    let s = r.stats();
                    l.retired.add(&s);
                    l.receiver = None;
                    tracing::warn!("PD: the connection to prefill closed; reconnecting");
                }
                None => {}
            }
            if l.last_attempt
                .is_some_and(|t| t.elapsed() < RECONNECT_EVERY)
            {
                return Err(closed(l.last_error.clone()));
            }
            l.last_attempt = Some(Instant::now());
        }
        let Some(_connecting) = self.connecting.try_lock() else {
            return Err(closed("connecting now".into()));
        };
        let r = (self.connector)(&self.zone, &self.hello).and_then(|end| {
            Receiver::new(
                self.handle.cache().clone(),
                end,
                self.receiver_config.clone(),
            )
        });
        let mut l = self.link.lock();
        match r {
            Ok(r) => {
                let r = Arc::new(r);
                l.receiver = Some(r.clone());
                l.connections += 1;
                if l.connections > 1 {
                    tracing::info!("PD: reconnected to prefill");
                }
                Ok(r)
            }
            Err(e) => {
                l.last_error = e.to_string();
                Err(e)
            }
        }
    }

    /// Counters of every connection so far, transfers in flight and quarantined pages on
    /// the live one.
    fn observe(&self) -> (PdStatsSnapshot, usize, usize) {
        let l = self.link.lock();
        let mut s = l.retired.clone();
        let (mut in_flight, mut quarantined) = (0, 0);
        if let Some(r) = &l.receiver {
            s.add(&r.stats());
            in_flight = r.in_flight();
            quarantined = r.quarantined_pages();
        }
        (s, in_flight, quarantined)
    }

    /// Whether a connection to prefill is up.
    fn connected(&self) -> bool {
        self.link
            .lock()
            .receiver
            .as_ref()
            .is_some_and(|r| !r.is_closed())
    }

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
    fn decoy(
        &self,
        receiver: &Receiver<B>,
        barrier: &StaleWriteBarrier,
        prompt: &[u32],
        pages_n: usize,
    ) {
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
        if receiver.start(req, &decoy, &pages).is_ok() {
            // Prefill may give the decoy up before writing (the transfer then ends).
            let deadline = crate::deadline_after(self.timeout);
            let in_flight = loop {
                if barrier.wait_in_flight(req, POLL * 10) {
                    break true;
                }
                if receiver.outcome(req).is_some() || Instant::now() >= deadline {
                    break false;
                }
            };
            receiver.abort(
                req,
                "stale-transfer-write: decode cancels the transfer while its writes are in flight",
            );
            if in_flight && receiver.wait(req, self.timeout).is_ok() {
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

/// How one attempt at a prompt's transfer ended.
enum Attempt {
    Done(Option<ReceivedPages>),
    /// The transfer ended failed or cancelled by the other side (its bytes refused by a
    /// check, prefill gave up): worth one more try.
    TransferFailed(String),
}

impl<B: Backend + 'static> PromptSource for DecodeSource<B> {
    /// A transfer that ends failed (a check refused what landed, prefill gave it up) is
    /// retried once, with fresh pages; a second failure fails the request with both
    /// reasons.
    fn fetch(
        &self,
        prompt: &[u32],
        total_tokens: usize,
        aborted: &AtomicBool,
    ) -> Result<Option<ReceivedPages>, EngineError> {
        match self.attempt(prompt, total_tokens, aborted)? {
            Attempt::Done(r) => Ok(r),
            Attempt::TransferFailed(first) => {
                tracing::warn!(reason = %first, "PD transfer of a prompt failed; retrying once");
                self.retries.fetch_add(1, Ordering::Relaxed);
                match self.attempt(prompt, total_tokens, aborted)? {
                    Attempt::Done(r) => Ok(r),
                    Attempt::TransferFailed(second) => Err(EngineError::StepFailed(format!(
                        "PD transfer of the prompt failed twice: {first}; then: {second}"
                    ))),
                }
            }
        }
    }

    fn release(&self, received: &ReceivedPages) {
        self.drop_request(received.cache_request);
    }
}

impl<B: Backend + 'static> DecodeSource<B> {
    /// One attempt at bringing `prompt`'s pages over (see [`PromptSource::fetch`]).
    fn attempt(
        &self,
        prompt: &[u32],
        total_tokens: usize,
        aborted: &AtomicBool,
    ) -> Result<Attempt, EngineError> {
        let ps = self.page_size;
        // Every prompt token but the last (decode computes it for its logits).
        let tokens = prompt.len().saturating_sub(1);
        if tokens == 0 {
            return Ok(Attempt::Done(None));
        }
        let pages_n = tokens.div_ceil(ps);
        // The whole budget at once (all or nothing): a fetch never holds pages while it
        // waits for more, and the engine admits a fetched request without new pages —
        // so fetches cannot deadlock against each other or against admission.
        let want = total_tokens.max(prompt.len()).div_ceil(ps);
        let capacity = self.handle.cache().device_pages();
        if want > capacity {
            return Err(EngineError::TooLarge {
                wanted: want,
                capacity,
            });
        }
        let receiver = self.receiver().map_err(pd_error)?;
        if let Some(b) = &self.stale_write {
            if self.fetches.fetch_add(1, Ordering::Relaxed) % DECOY_EVERY == 0 {
                self.decoy(&receiver, b, &prompt[..tokens], pages_n);
            }
        }
        let cache = self.handle.cache();
        let req = self.handle.next_request_id();
        let deadline = crate::deadline_after(self.timeout);
        cache.begin(req, &[])?;
        // Ends the request on every way out but a hand-over (a panic included); where the
        // receiver aborted the transfer it ended the request itself (pages quarantined).
        let guard = RequestGuard::new(cache, req);
        let mut nap = POLL;
        let pages = loop {
            if aborted.load(Ordering::Acquire) {
                self.drop_request(req);
                return Err(EngineError::Aborted("aborted before its transfer".into()));
            }
            match cache.try_alloc(req, want) {
                Ok(p) => break p,
                Err(HostError::OutOfPages { .. }) if Instant::now() < deadline => {
                    // Room comes back as decode requests end; look again shortly, less
                    // often the longer it takes (many waiting fetches must not hammer
                    // the cache's lock).
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(MAX_NAP);
                }
                Err(e) => {
                    self.drop_request(req);
                    return Err(e.into());
                }
            }
        };
        let extra = pages[pages_n..].to_vec();
        let pages = pages[..pages_n].to_vec();
        if let Err(e) = receiver.start(req, &prompt[..tokens], &pages) {
            self.drop_request(req);
            return Err(pd_error(e));
        }
        let received = ReceivedPages {
            cache_request: req,
            pages,
            extra,
            tokens,
        };
        if self.read_before_landed {
            guard.keep();
            return Ok(Attempt::Done(Some(received)));
        }
        loop {
            if aborted.load(Ordering::Acquire) {
                receiver.abort(req, "the client aborted the request");
                return Err(EngineError::Aborted("aborted during its transfer".into()));
            }
            match receiver.wait(req, Duration::from_millis(20)) {
                Ok(Outcome::Ready) => {
                    guard.keep();
                    return Ok(Attempt::Done(Some(received)));
                }
                Ok(Outcome::Cancelled(why)) | Ok(Outcome::Failed(why)) => {
                    self.drop_request(req);
                    return Ok(Attempt::TransferFailed(why));
                }
                Err(PdError::Timeout(_)) if Instant::now() < deadline => {}
                Err(e) => {
                    receiver.abort(req, "the transfer timed out");
                    return Err(pd_error(e));
                }
            }
        }
    }
}

/// The decode side (see the module docs).
pub struct DecodeNode<B: Backend + 'static> {
    pub engine: Arc<Engine>,
    source: Arc<DecodeSource<B>>,
    publisher: Option<Publisher>,
}

impl<B: Backend + 'static> std::fmt::Debug for DecodeNode<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeNode")
            .field("engine", &self.engine)
            .field("source", &self.source)
            .finish()
    }
}

impl<B: Backend + ModelOps + 'static> DecodeNode<B> {
    /// Starts the decode engine (`opts`; its cache gets the decode-side faults of `pd`)
    /// with `metrics`, and connects to prefill through `peer` (retrying for up to its
    /// `connect_wait`). `stale_write`: the rendezvous shared
    /// with an in-process prefill under `stale-transfer-write` (`None` elsewhere).
    pub fn start(
        backend: Arc<B>,
        cfg: ModelConfig,
        mut opts: EngineOptions,
        pd: &PdOptions,
        metrics: Arc<Metrics>,
        peer: PeerLink,
        stale_write: Option<Arc<StaleWriteBarrier>>,
    ) -> Result<Self, EngineError> {
        if let Some(c) = opts.cache.as_mut() {
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
        let (engine, handle) = Engine::start_cached(
            backend,
            cfg,
            opts,
            metrics.clone(),
            CacheSpaceOptions {
                prefix_reuse: false,
            },
        )?;
        let engine = Arc::new(engine);
        let d = handle.cache().clone();
        let g = LandingGeometry::new(*d.spec(), d.device_pages()).map_err(pd_error)?;
        let zone = Arc::new(LandingZone::new(g).map_err(pd_error)?);
        let source = Arc::new(DecodeSource {
            hello: hello(
                Role::Decode,
                d.spec(),
                d.backend().arithmetic(),
                d.device_pages(),
                Vec::new(),
            ),
            handle,
            page_size: cfg.page_size(),
            timeout: pd.timeout,
            zone,
            connector: peer.connector,
            receiver_config: ReceiverConfig {
                checks: pd.checks,
                // A transfer never outlives the request's own deadline.
                transfer_timeout: pd.timeout,
                ..Default::default()
            },
            link: Mutex::new(Link {
                receiver: None,
                last_attempt: None,
                last_error: String::new(),
                retired: PdStatsSnapshot::default(),
                connections: 0,
            }),
            connecting: Mutex::new(()),
            read_before_landed: pd.faults.active(PdFault::ReadBeforeLanded),
            stale_write,
            fetches: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        });
        let until = crate::deadline_after(peer.connect_wait);
        loop {
            match source.receiver() {
                Ok(_) => break,
                Err(e @ PdError::Incompatible(_)) => return Err(pd_error(e)),
                Err(e) if Instant::now() >= until => {
                    return Err(EngineError::Unavailable(format!(
                        "cannot connect to prefill: {e}"
                    )))
                }
                Err(_) => std::thread::sleep(RECONNECT_EVERY),
            }
        }
        engine.set_prompt_source(source.clone())?;
        let publisher = {
            let source = source.clone();
            let mut seen = BTreeMap::new();
            let mut retries_seen = 0;
            Publisher::start("decode", move || {
                let (s, in_flight, quarantined) = source.observe();
                crate::pd::stats::publish(&metrics, "decode", &s, &mut seen);
                metrics.quarantined("pd", quarantined);
                metrics.transfers_in_flight("decode", in_flight);
                let retries = source.retries.load(Ordering::Relaxed);
                for _ in retries_seen..retries {
                    metrics.integrity_fallback("pd_transfer_retry");
                }
                retries_seen = retries;
            })?
        };
        Ok(DecodeNode {
            engine,
            source,
            publisher: Some(publisher),
        })
    }
}

impl<B: Backend + 'static> DecodeNode<B> {
    /// Transfers not ended yet on the live connection.
    pub fn transfers_in_flight(&self) -> usize {
        self.source.observe().1
    }

    /// Pages held for aborted transfers until prefill confirms.
    pub fn quarantined_pages(&self) -> usize {
        self.source.observe().2
    }

    /// The receiver's counters, over every connection so far.
    pub fn stats(&self) -> PdStatsSnapshot {
        self.source.observe().0
    }

    /// Whether a connection to prefill is up now.
    pub fn connected(&self) -> bool {
        self.source.connected()
    }

    /// Stops the engine (up to `grace` for what is in flight), then the connection and
    /// the metrics thread.
    pub fn shutdown(mut self, grace: Duration) -> Result<(), EngineError> {
        let r = self.engine.shutdown(grace);
        self.stop();
        r
    }

    fn stop(&mut self) {
        self.publisher.take();
        if let Some(r) = self.source.link.lock().receiver.take() {
            // Ours is the last handle once the engine stopped: dropping it closes the
            // connection and ends (fails) its transfers.
            drop(r);
        }
    }
}

impl<B: Backend + 'static> Drop for DecodeNode<B> {
    fn drop(&mut self) {
        self.stop();
    }
}
