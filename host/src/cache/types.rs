//! The cache's plain data: its configuration ([`CacheConfig`]), what a request matched
//! ([`Prefix`]), what a request would find ([`Room`]) and the accounting ([`CacheStats`]).

use std::time::Duration;

use serde::Serialize;

use super::alloc::PageRef;
use super::faults::Faults;
use super::pool::HostLayout;
#[cfg(doc)]
use super::{HiCache, Step};
#[cfg(doc)]
use crate::Error;

pub type RequestId = u64;

/// Sizes and switches of a [`HiCache`].
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Pages in the device tier.
    pub device_pages: usize,
    /// Frames of the window pool, for a spec with a sliding window
    /// ([`super::CacheSpec::with_window`]): the window KV's physical pages, each `kv`
    /// page's bytes in every layer. `None`: one a page (nothing saved, but pages still give
    /// theirs back as their tokens leave the window). At most `device_pages`; ignored
    /// without a window.
    pub window_pages: Option<usize>,
    /// Pages in the host tier (0 disables it: evicted pages are dropped).
    pub host_pages: usize,
    pub host_layout: HostLayout,
    /// Verify checksums of pages loaded from the host tier (default on; off only for
    /// benchmarks).
    pub verify: bool,
    /// Back up committed pages to the host tier right away (on the io worker), so that
    /// eviction rarely has to wait for a backup.
    pub write_through: bool,
    /// The bound of every wait in the cache: a layer's ready token, a layer lock, free
    /// pages. A wait that runs out returns [`Error::Timeout`] (or `OutOfPages`).
    pub wait_timeout: Duration,
    /// Most pages in one backup batch.
    pub max_backup_batch: usize,
    /// Fault injections (none in production).
    pub faults: Faults,
}

impl CacheConfig {
    /// Defaults: layer-first host tier, verification on, no write-through, 10 s bound,
    /// backup batches of up to 64 pages, no faults.
    pub fn new(device_pages: usize, host_pages: usize) -> Self {
        CacheConfig {
            device_pages,
            window_pages: None,
            host_pages,
            host_layout: HostLayout::LayerFirst,
            verify: true,
            write_through: false,
            wait_timeout: Duration::from_secs(10),
            max_backup_batch: 64,
            faults: Faults::none(),
        }
    }
}

/// The cached prefix of a request, as matched by [`HiCache::begin`]. Plain data: reading
/// any of these pages goes through a [`Step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefix {
    /// Tokens covered (a multiple of the page size).
    pub tokens: usize,
    /// Device pages of the prefix, in order.
    pub pages: Vec<PageRef>,
    /// Pages this request's own load brings from the host tier.
    pub loaded_pages: usize,
    /// Pages whose load another request started and that is still in flight (shared).
    pub shared_in_flight_pages: usize,
}

/// What [`HiCache::try_begin`] and [`HiCache::try_alloc`] would find for a request now
/// ([`HiCache::room`]); nothing is locked or changed by asking.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Room {
    /// Pages of the matched prefix held in the device tier (ready or loading): no new
    /// device page needed.
    pub device_pages: usize,
    /// Pages of the matched prefix held only in the host tier (each needs a device page
    /// to load into).
    pub host_pages: usize,
    /// Device pages that could be free for the request now: free, leaving (eviction
    /// waiting for its backup), or evictable (unlocked cached pages outside its prefix).
    pub available: usize,
    /// Window frames that could be free now (free, or held by cached pages that could give
    /// them up); `None` without a window pool.
    pub frames_available: Option<usize>,
}

/// Page accounting and counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    pub device_pages: usize,
    pub device_free: usize,
    /// Owned by live requests.
    pub device_in_use: usize,
    /// Held by the prefix tree.
    pub device_cached: usize,
    /// Released but still targeted by an in-flight copy or a live step.
    pub device_quarantined: usize,
    /// Window-pool frames (0 without a window) and how many are free.
    pub window_frames: usize,
    pub window_frames_free: usize,
    /// Window rows given back before their page ([`HiCache::release_window`], and cached
    /// pages' under frame pressure), in pages.
    pub window_released: u64,
    pub host_pages: usize,
    pub host_free: usize,
    pub host_cached: usize,
    pub host_quarantined: usize,
    pub live_requests: usize,
    pub hits_device_pages: u64,
    pub hits_host_pages: u64,
    pub hits_in_flight_pages: u64,
    pub loads: u64,
    pub load_failures: u64,
    pub cancelled_loads: u64,
    pub backups: u64,
    pub backup_failures: u64,
    /// Reads that found a layer's pages not landed behind a published (or skipped) fence
    /// and waited for them to land instead of reading them: each is a fence that was not
    /// honoured, caught by the landed stamps.
    pub landing_waits: u64,
    /// Pages released by [`HiCache::discard_prefix`].
    pub discarded_pages: u64,
    /// Panics of the io worker outside a job's containment (each failed the pending work;
    /// the worker went on).
    pub worker_restarts: u64,
    pub integrity_failures: u64,
    /// Of the integrity failures, those of host → device loads (the rest: inbound
    /// transfers).
    pub host_integrity_failures: u64,
    pub stale_writes_refused: u64,
}
