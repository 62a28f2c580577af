//! Counters of a PD endpoint: refused messages by reason, bytes moved by kind, transfers
//! by outcome, handler panics and task restarts. Cheap to update from any thread;
//! [`PdStats::snapshot`] gives plain data for metrics, reports and tests.
//!
//! Refusal reasons (the `reason` label of `sparsekit_refused_total`):
//! - frames that do not decode ([`crate::pd::wire::WireError::reason`]): `truncated`,
//!   `bad_magic`, `bad_version`, `unknown_kind`, `bad_flags`, `too_large`, `corrupt`
//!   (a CRC), `malformed`, `trailing_bytes`;
//! - messages that do not fit: `wrong_direction` (a kind this side never receives),
//!   `unexpected_hello`, `unknown_request` (no transfer with that id), `ended` (its
//!   transfer already ended: a late message), `after_abort` (a write for a transfer decode
//!   aborted: a late write), `duplicate` (a page or confirmation again, a second bootstrap
//!   for a live transfer), `bad_request` (a bootstrap or notification whose shape is wrong:
//!   pages vs prompt, pages outside the landing zone, a layer out of range), `overloaded`
//!   (a bootstrap beyond prefill's jobs in flight);
//! - data decode refuses: `layout_mismatch` (fingerprint), `not_target` (a page the
//!   transfer does not own), `stale_generation`, `checksum` (the landed bytes differ from
//!   the sender's checksums), `cache_refused` (any other refusal of the cache),
//!   `missing_layers` (prefill finished but layers never arrived);
//! - `panicked`: handling the message panicked (its request failed, the reader restarted).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use sparsekit_host::cache::{BufferKind, KINDS};

use crate::error::EngineError;
use crate::metrics::Metrics;

/// Live counters (see the module docs).
#[derive(Debug, Default)]
pub struct PdStats {
    refused: Mutex<BTreeMap<&'static str, u64>>,
    bytes: [AtomicU64; KINDS],
    started: AtomicU64,
    finished: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    panics: AtomicU64,
    restarts: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PdStatsSnapshot {
    /// Refused (counted, logged, dropped) messages and writes, by reason.
    pub refused: BTreeMap<String, u64>,
    pub kv_bytes: u64,
    pub index_k_bytes: u64,
    /// Bytes of the other pools (a DeepSeek-V4 cache's compressed KV and compressor
    /// state), by kind name.
    pub other_bytes: BTreeMap<String, u64>,
    /// Transfers started, and how they ended.
    pub started: u64,
    pub finished: u64,
    pub cancelled: u64,
    pub failed: u64,
    /// Message handlers that panicked (each failed the request it was handling).
    pub panics: u64,
    /// Reader/worker threads restarted after a panic outside a message handler.
    pub restarts: u64,
}

impl PdStatsSnapshot {
    /// Refusals with `reason` (0 if none).
    pub fn refused(&self, reason: &str) -> u64 {
        self.refused.get(reason).copied().unwrap_or(0)
    }

    /// All refusals.
    pub fn refused_total(&self) -> u64 {
        self.refused.values().sum()
    }

    /// Adds `other`'s counters to these (several connections of one endpoint).
    pub fn add(&mut self, other: &PdStatsSnapshot) {
        for (k, v) in &other.refused {
            *self.refused.entry(k.clone()).or_insert(0) += v;
        }
        self.kv_bytes += other.kv_bytes;
        self.index_k_bytes += other.index_k_bytes;
        for (k, v) in &other.other_bytes {
            *self.other_bytes.entry(k.clone()).or_insert(0) += v;
        }
        self.started += other.started;
        self.finished += other.finished;
        self.cancelled += other.cancelled;
        self.failed += other.failed;
        self.panics += other.panics;
        self.restarts += other.restarts;
    }
}

/// Copies an endpoint's counters into `m`: what grew since `seen` (updated). `side`
/// (`decode`, `prefill`) keys `seen`. Bytes go to `sparsekit_transfer_bytes_total{kind}`
/// (decode: bytes that landed; prefill: bytes it wrote), refusals to
/// `sparsekit_refused_frames_total{reason}` and `sparsekit_refused_total{reason="pd_*"}`.
pub fn publish(m: &Metrics, side: &str, snap: &PdStatsSnapshot, seen: &mut BTreeMap<String, u64>) {
    let mut grow = |key: String, now: u64| {
        let was = seen.entry(key).or_insert(0);
        let d = now.saturating_sub(*was);
        *was = (*was).max(now);
        d
    };
    let pairs = [
        (BufferKind::Kv.name(), snap.kv_bytes),
        (BufferKind::IndexK.name(), snap.index_k_bytes),
    ];
    let others = snap.other_bytes.iter().map(|(k, v)| (k.as_str(), *v));
    for (kind, bytes) in pairs.into_iter().chain(others) {
        let d = grow(format!("{side}:bytes:{kind}"), bytes);
        if d > 0 {
            m.transfer_bytes(kind, d);
        }
    }
    for (reason, &n) in &snap.refused {
        let d = grow(format!("{side}:{reason}"), n);
        if d > 0 {
            m.refused_frames(reason, d);
            m.refused(&format!("pd_{reason}"), d);
        }
    }
}

/// The body of an endpoint's reader thread: runs `run` until it returns. A panic in it
/// is counted; the request whose message was being handled (taken from `handling`) is
/// counted as refused (`panicked`) and failed with `fail`; then `run` starts again unless
/// `shutdown` is set. `side` names the reader in the log.
pub(crate) fn supervise(
    side: &str,
    stats: &PdStats,
    handling: &Mutex<Option<u64>>,
    shutdown: &AtomicBool,
    run: impl Fn(),
    fail: impl Fn(u64),
) {
    loop {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&run)) {
            Ok(()) => return,
            Err(_) => {
                stats.panicked();
                let req = handling.lock().take();
                tracing::error!(request = ?req, "PD {side} reader panicked; restarting it");
                if let Some(req) = req {
                    stats.refuse("panicked");
                    fail(req);
                }
                if shutdown.load(Ordering::Acquire) {
                    return;
                }
                stats.restarted();
            }
        }
    }
}

/// A thread calling a closure every [`Publisher::EVERY`] (an endpoint copying its counters
/// into its metrics), a last time when stopped; stopped and joined on drop.
#[derive(Debug)]
pub struct Publisher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Publisher {
    /// How often the closure runs.
    pub const EVERY: Duration = Duration::from_millis(20);

    /// Starts a thread named after `side` running `tick` until dropped. A panic in `tick`
    /// ends the thread (the metrics stop moving; nothing else depends on it).
    pub fn start(side: &str, mut tick: impl FnMut() + Send + 'static) -> Result<Self, EngineError> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("sparsekit-pd-metrics-{side}"))
            .spawn(move || loop {
                tick();
                if s.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Self::EVERY);
            })
            .map_err(|e| EngineError::Unavailable(format!("PD metrics thread: {e}")))?;
        Ok(Publisher {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How a transfer ended, for [`PdStats::ended`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    Finished,
    Cancelled,
    Failed,
}

impl PdStats {
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one refusal.
    pub fn refuse(&self, reason: &'static str) {
        *self.refused.lock().entry(reason).or_insert(0) += 1;
    }

    pub(crate) fn bytes(&self, kind: BufferKind, n: usize) {
        if let Some(b) = self.bytes.get(kind.index()) {
            b.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    pub(crate) fn started(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn ended(&self, how: Ended) {
        let c = match how {
            Ended::Finished => &self.finished,
            Ended::Cancelled => &self.cancelled,
            Ended::Failed => &self.failed,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn panicked(&self) {
        self.panics.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn restarted(&self) {
        self.restarts.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> PdStatsSnapshot {
        PdStatsSnapshot {
            refused: self
                .refused
                .lock()
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            kv_bytes: self.bytes[BufferKind::Kv.index()].load(Ordering::Relaxed),
            index_k_bytes: self.bytes[BufferKind::IndexK.index()].load(Ordering::Relaxed),
            other_bytes: BufferKind::ALL
                .into_iter()
                .filter(|k| !matches!(k, BufferKind::Kv | BufferKind::IndexK))
                .map(|k| {
                    (
                        k.name().to_string(),
                        self.bytes[k.index()].load(Ordering::Relaxed),
                    )
                })
                .filter(|(_, n)| *n > 0)
                .collect(),
            started: self.started.load(Ordering::Relaxed),
            finished: self.finished.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            panics: self.panics.load(Ordering::Relaxed),
            restarts: self.restarts.load(Ordering::Relaxed),
        }
    }
}
