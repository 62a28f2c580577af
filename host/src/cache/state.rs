//! What the cache's handles and its io worker share ([`Shared`]): the device and host
//! pools, the bookkeeping behind the state mutex ([`State`]: the tree, the allocators, live
//! requests, loads, backups, transfers), the condvars, and small helpers.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::alloc::{PageAllocator, PageRef};
use super::faults::Fault;
use super::fence::Fence;
use super::pool::{DevicePool, HostPool};
use super::radix::{NodeId, RadixTree};
use super::types::{CacheConfig, CacheStats, RequestId};
use crate::backend::Backend;
use crate::error::Error;
use crate::sync::{AtomicBool, AtomicU64, Condvar, Mutex, Ordering};

/// A live request's bookkeeping.
#[derive(Debug)]
pub(crate) struct Req {
    /// Matched / committed tree nodes, locked by the request.
    pub path: Vec<NodeId>,
    /// Device pages the request owns (not in the tree).
    pub own: Vec<PageRef>,
    /// Load jobs the request depends on (it counts as their dependent).
    pub loads: Vec<u64>,
    /// Fences gating its reads (its loads and inbound transfers).
    pub fences: Vec<Arc<Fence>>,
    /// Own pages that inbound transfers write (their landed stamps are checked strictly).
    pub received: Vec<PageRef>,
    /// Its live inbound transfer and that transfer's fence.
    pub inbound: Option<(u64, Arc<Fence>)>,
    /// Live steps that include it.
    pub users: u32,
    /// Set when the request is aborted (steps still holding it skip it).
    pub aborted: Arc<AtomicBool>,
}

/// One page moving host → device.
#[derive(Clone, Debug)]
pub(crate) struct LoadPage {
    pub node: NodeId,
    pub host: PageRef,
    pub device: PageRef,
    /// What the backup recorded ([`super::radix::HostCopy::layers`]).
    pub layers: Vec<super::radix::LayerRecord>,
}

#[derive(Debug)]
pub(crate) struct LoadRec {
    pub fence: Arc<Fence>,
    pub pages: Vec<LoadPage>,
    pub dependents: u32,
    pub cancel: Arc<AtomicBool>,
    pub queued: bool,
    /// Steps' layer requests counted when the load was queued (the `loads-trail-readers`
    /// fault; empty otherwise).
    pub reads_at_queue: Vec<u64>,
}

/// One page moving device → host.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BackupItem {
    pub node: NodeId,
    pub device: PageRef,
    pub host: PageRef,
}

#[derive(Debug)]
pub(crate) struct BackupRec {
    pub items: Vec<BackupItem>,
    /// One-layer fence: published when the batch landed, failed with its error.
    pub ticket: Arc<Fence>,
    pub queued: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Job {
    Load(u64),
    Backup(u64),
}

#[derive(Debug)]
pub(crate) struct InboundRec {
    pub req: RequestId,
    pub targets: Vec<PageRef>,
}

/// Everything behind the state mutex.
#[derive(Debug)]
pub(crate) struct State {
    pub tree: RadixTree,
    pub device: PageAllocator,
    pub host: PageAllocator,
    pub requests: HashMap<RequestId, Req>,
    pub loads: HashMap<u64, LoadRec>,
    pub backups: HashMap<u64, BackupRec>,
    /// The queued backup batch new items join (batching).
    pub open_backup: Option<u64>,
    pub queue: VecDeque<Job>,
    /// Device pages pinned by each live step.
    pub steps: HashMap<u64, Vec<u32>>,
    pub inbounds: HashMap<u64, InboundRec>,
    pub stats: CacheStats,
    pub shutdown: bool,
    pub worker_alive: bool,
}

/// What the cache's handles and its io worker share.
#[derive(Debug)]
pub(crate) struct Shared<B: Backend> {
    pub id: u64,
    pub backend: Arc<B>,
    pub device: DevicePool<B>,
    pub host: Option<HostPool<B>>,
    pub state: Mutex<State>,
    /// Signalled when device pages may have become free (backups landed, pins dropped).
    pub space_cv: Condvar,
    /// Signalled when the io queue got work (or shutdown).
    pub work_cv: Condvar,
    pub config: CacheConfig,
    pub(crate) next_id: AtomicU64,
    /// Per layer, how many times a step asked for it (kept under the
    /// `loads-trail-readers` fault only) and the condvar loads wait on for it.
    pub reads: Mutex<Vec<u64>>,
    pub reads_cv: Condvar,
    /// The `late-write` fault's writer (empty otherwise).
    pub late: Mutex<super::late::LateWrites>,
    /// Signalled (under `landed`) after pages were stamped landed by a load or a
    /// transfer, or one of those failed: what a reader that found pages not landed yet
    /// behind a published fence waits on ([`super::Step::layer`]).
    pub landed: Mutex<()>,
    pub landed_cv: Condvar,
    /// The `worker-dies` fault fired already (it fires once).
    pub worker_died: AtomicBool,
}

pub(crate) static NEXT_CACHE_ID: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(1);

impl<B: Backend> Shared<B> {
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Now plus the cache's wait bound (saturating: a bound too far to represent means
    /// about a century).
    pub fn deadline(&self) -> Instant {
        deadline_after(self.config.wait_timeout)
    }

    /// Wakes readers waiting for pages to land (call after stamping, or after a load or
    /// transfer failed).
    pub fn notify_landed(&self) {
        let _g = self.landed.lock();
        self.landed_cv.notify_all();
    }

    pub fn fault(&self, f: Fault) -> bool {
        self.config.faults.active(f)
    }

    pub fn num_layers(&self) -> usize {
        self.device.spec().num_layers
    }
}

/// `Instant::now() + d`, saturating at about a century from now (`Duration::MAX` as a
/// bound must not overflow).
pub(crate) fn deadline_after(d: std::time::Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(std::time::Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> Error {
    Error::InvalidArgument {
        what,
        detail: detail.into(),
    }
}

pub(crate) fn not_live(req: RequestId) -> Error {
    invalid("request", format!("{req} is not live"))
}
