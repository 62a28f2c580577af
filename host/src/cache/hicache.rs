//! The hierarchical cache: device pool ⇄ host mirror pool under a radix prefix tree.
//!
//! Request lifecycle (see `docs/cache.md` for the invariants and where each is enforced):
//! 1. [`HiCache::begin`] matches the request's tokens against the tree and locks the
//!    matched nodes. Nodes held only by the host tier get device pages and one layer-wise
//!    load job on the io worker; nodes whose load is already in flight are shared (the
//!    request depends on that load's fence). Nothing is readable yet.
//! 2. [`HiCache::alloc`] hands out device pages owned by the request (for the uncached and
//!    later the decode tokens), evicting least recently used cache pages as needed.
//! 3. [`HiCache::step`] opens a forward step over a batch of requests: per layer it waits
//!    (bounded) for every member's loads and transfers of that layer, then hands out one
//!    [`LayerGuard`] with both views and generation-checked stores.
//! 4. [`HiCache::commit`] inserts the request's full pages into the tree (optionally
//!    backing them up at once: write-through).
//! 5. [`HiCache::finish`] or [`HiCache::abort`] (any time, any thread) unlocks the prefix,
//!    cancels loads nobody else waits for and releases the request's pages; pages that an
//!    in-flight copy or a live step still touches stay quarantined until it ends.
//!
//! [`HiCache::inbound`] receives a request's pages from elsewhere (prefill → decode) with
//! generation and checksum checks and per-layer readiness.
//!
//! Locking: the state mutex guards bookkeeping only and is never held while waiting for a
//! layer lock or copying bytes. Layer locks (one per layer, covering both kinds) may be
//! held while taking the state mutex, never the reverse. The io worker holds at most one
//! layer lock and then the host buffer's lock.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::alloc::{PageAllocator, PageRef};
use super::check::{check, stats};
use super::faults::Fault;
use super::fence::Fence;
use super::inbound::Inbound;
use super::io;
use super::pool::{BufferKind, CacheSpec, DevicePool, HostPool};
use super::radix::{DevicePage, NodeId, RadixTree, ROOT};
use super::requests::{end_request, start_request};
use super::room::{could_make_room, evict, make_room, schedule_backups, wait_for_room};
use super::state::{invalid, not_live, Shared, State, NEXT_CACHE_ID};
use super::step::Step;
pub use super::types::{CacheConfig, CacheStats, Prefix, RequestId, Room};
use super::window;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ops::PagedRegion;
use crate::sync::{AtomicBool, AtomicU64, Condvar, JoinHandle, Mutex};

/// The hierarchical cache (see the module docs).
pub struct HiCache<B: Backend + 'static> {
    pub(crate) shared: Arc<Shared<B>>,
    io_thread: Option<JoinHandle>,
}

impl<B: Backend + 'static> std::fmt::Debug for HiCache<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HiCache({:?})", self.shared.config)
    }
}

impl<B: Backend + 'static> HiCache<B> {
    /// A cache for `spec` on `backend`, with its io worker thread.
    pub fn new(backend: Arc<B>, spec: CacheSpec, config: CacheConfig) -> Result<Self> {
        if config.max_backup_batch == 0 {
            return Err(invalid("max_backup_batch", "must be at least 1"));
        }
        let allocator = match spec.window() {
            Some(_) => {
                let frames = config.window_pages.unwrap_or(config.device_pages);
                if frames > config.device_pages {
                    return Err(invalid(
                        "window_pages",
                        format!(
                            "{frames} window frames for {} device pages",
                            config.device_pages
                        ),
                    ));
                }
                PageAllocator::with_frames("device", config.device_pages, frames)
            }
            None => PageAllocator::new("device", config.device_pages),
        };
        let device = DevicePool::new(&*backend, spec, config.device_pages, allocator.frame_map())?;
        let host = if config.host_pages > 0 {
            Some(HostPool::mirror(
                &*backend,
                &device,
                config.host_pages,
                config.host_layout,
                &config.faults,
            )?)
        } else {
            None
        };
        let state = State {
            tree: RadixTree::new(spec.page_size()),
            device: allocator,
            host: PageAllocator::new("host", config.host_pages),
            requests: HashMap::new(),
            loads: HashMap::new(),
            backups: HashMap::new(),
            open_backup: None,
            queue: VecDeque::new(),
            steps: HashMap::new(),
            inbounds: HashMap::new(),
            stats: CacheStats::default(),
            shutdown: false,
            worker_alive: true,
        };
        let shared = Arc::new(Shared {
            id: NEXT_CACHE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            backend,
            device,
            host,
            state: Mutex::new(state),
            space_cv: Condvar::new(),
            work_cv: Condvar::new(),
            reads: Mutex::new(vec![0; spec.num_layers * 2]),
            reads_cv: Condvar::new(),
            late: Mutex::new(super::late::LateWrites::default()),
            landed: Mutex::new(()),
            landed_cv: Condvar::new(),
            worker_died: AtomicBool::new(false),
            config,
            next_id: AtomicU64::new(1),
        });
        let worker = Arc::clone(&shared);
        let io_thread = crate::sync::spawn("sparsekit-cache-io", move || io::worker(worker))
            .map_err(|e| Error::Device(format!("cannot start the cache io thread: {e}")))?;
        Ok(HiCache {
            shared,
            io_thread: Some(io_thread),
        })
    }

    pub fn spec(&self) -> &CacheSpec {
        self.shared.device.spec()
    }

    pub fn config(&self) -> &CacheConfig {
        &self.shared.config
    }

    /// The backend the pools live on.
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }

    /// Pages in the device tier.
    pub fn device_pages(&self) -> usize {
        self.shared.device.num_pages()
    }

    /// Frames of the window pool (`None`: the spec has no window).
    pub fn window_frames(&self) -> Option<usize> {
        self.shared.device.window_frames()
    }

    /// Where pages of `kind` sit in a device layer buffer (what the ops' slot numbers and
    /// page tables index).
    pub fn device_region(&self, kind: BufferKind) -> PagedRegion {
        self.shared.device.region(kind)
    }

    /// Where pages of `layer`/`kind` sit in the host buffer (`None` without a host tier).
    pub fn host_region(&self, layer: usize, kind: BufferKind) -> Option<PagedRegion> {
        self.shared.host.as_ref().map(|h| h.region(layer, kind))
    }

    /// Matches `tokens` against the cache, locks the prefix for `req`, and starts loading
    /// its host-only pages (sharing loads already in flight). May wait (bounded) for
    /// device room. `req` must not be live already.
    pub fn begin(&self, req: RequestId, tokens: &[u32]) -> Result<Prefix> {
        self.begin_until(req, tokens, self.shared.deadline())
    }

    /// [`HiCache::begin`] without waiting: when the prefix's loads need device room that is
    /// not free now, the evictions (and backups) that make it are started and the call
    /// returns `OutOfPages` at once, leaving nothing behind; a later try finds the room.
    /// When even evicting every unlocked cached page would not make the room, nothing is
    /// evicted (a request that cannot start must not empty the cache).
    /// For a caller that must not block, such as an engine thread admitting requests.
    pub fn try_begin(&self, req: RequestId, tokens: &[u32]) -> Result<Prefix> {
        self.begin_until(req, tokens, Instant::now())
    }

    fn begin_until(&self, req: RequestId, tokens: &[u32], deadline: Instant) -> Result<Prefix> {
        let sh = &*self.shared;
        let mut st = sh.state.lock();
        loop {
            if st.requests.contains_key(&req) {
                return Err(invalid("request", format!("{req} is already live")));
            }
            let mut path = st.tree.match_prefix(tokens);
            // A prefix ends where the window rows of its last tokens are held.
            window::end_on_window(sh.device.spec(), &st, &mut path);
            // Without a worker nothing can be loaded: serve the device-resident part only.
            if !st.worker_alive {
                if let Some(cut) = path
                    .iter()
                    .position(|&n| st.tree.get(n).is_some_and(|n| n.device.is_none()))
                {
                    path.truncate(cut);
                }
            }
            st.tree.lock(&path);
            let missing: Vec<NodeId> = path
                .iter()
                .copied()
                .filter(|&n| st.tree.get(n).is_some_and(|n| n.device.is_none()))
                .collect();
            // Loads take a window frame only for a copy that has the window rows.
            let framed = missing
                .iter()
                .filter(|&&n| {
                    st.tree
                        .get(n)
                        .and_then(|n| n.host.as_ref())
                        .is_some_and(|h| window::host_has(h, BufferKind::Kv))
                })
                .count();
            if !st.device.can_alloc(missing.len(), framed) {
                if Instant::now() >= deadline
                    && !could_make_room(&st, sh.device.spec(), missing.len(), framed)
                {
                    // A try that cannot succeed now changes nothing (evicts nothing).
                    st.tree.unlock(&path);
                    return Err(Error::OutOfPages {
                        what: st.device.scarce(missing.len()),
                        wanted: missing.len(),
                        free: st.device.num_free(),
                    });
                }
                make_room(sh, &mut st, missing.len(), framed);
            }
            if !st.device.can_alloc(missing.len(), framed) {
                st.tree.unlock(&path);
                if !wait_for_room(sh, &mut st, missing.len(), framed, deadline) {
                    return Err(Error::OutOfPages {
                        what: st.device.scarce(missing.len()),
                        wanted: missing.len(),
                        free: st.device.num_free(),
                    });
                }
                continue;
            }
            let mut prefix = start_request(sh, &mut st, req, path, &missing);
            if sh.fault(Fault::RadixOverreach) && prefix.tokens > 0 && prefix.tokens < tokens.len()
            {
                prefix.tokens += 1;
            }
            return Ok(prefix);
        }
    }

    /// What a request for `tokens` would find now (see [`Room`]): a caller that must not
    /// block compares `available` with the device pages the request needs (its pages in
    /// all, less `device_pages`) before it begins anything.
    pub fn room(&self, tokens: &[u32]) -> Room {
        let st = self.shared.state.lock();
        let mut path = st.tree.peek_prefix(tokens);
        window::end_on_window(self.shared.device.spec(), &st, &mut path);
        let on_device = |n: &super::radix::Node| n.device.is_some();
        let device_pages = path
            .iter()
            .filter(|&&id| st.tree.get(id).is_some_and(on_device))
            .count();
        let victims_on_path = path
            .iter()
            .filter(|&&id| {
                st.tree.get(id).is_some_and(|n| {
                    n.locks == 0 && n.device.is_some_and(|d| d.load.is_none()) && n.backup.is_none()
                })
            })
            .count();
        let pending = st.tree.live().filter(|(_, n)| n.evict_after_backup).count();
        Room {
            device_pages,
            host_pages: path.len() - device_pages,
            available: (st.device.num_free_pages() + pending + st.tree.device_victim_count())
                .saturating_sub(victims_on_path),
            frames_available: window::frames_possible(&st, self.shared.device.spec()),
        }
    }

    /// `n` fresh device pages owned by `req`, evicting cached pages if needed (waits,
    /// bounded, for backups to make room).
    pub fn alloc(&self, req: RequestId, n: usize) -> Result<Vec<PageRef>> {
        self.alloc_until(req, n, n, self.shared.deadline())
    }

    /// [`HiCache::alloc`] without waiting: when `n` pages are not free now, the evictions
    /// (and backups) that make room are started and the call returns `OutOfPages` at once,
    /// allocating nothing; a later try finds the room. When even evicting every unlocked
    /// cached page would not make the room, nothing is evicted.
    pub fn try_alloc(&self, req: RequestId, n: usize) -> Result<Vec<PageRef>> {
        self.alloc_until(req, n, n, Instant::now())
    }

    /// [`HiCache::try_alloc`] of `n` pages of which only the first `framed` take a window
    /// frame now (a cache without a window: all of them, as `try_alloc`): the others get
    /// theirs as [`HiCache::release_window`] gives back the request's frames of the pages
    /// its tokens left. So a request reserves all its pages up front but holds at most
    /// [`CacheSpec::frames_needed`] frames. A caller must not store into a page before it
    /// has a frame (refused: [`LayerGuard::buffer_pages`](super::LayerGuard::buffer_pages) says `-1`).
    pub fn try_alloc_framed(
        &self,
        req: RequestId,
        n: usize,
        framed: usize,
    ) -> Result<Vec<PageRef>> {
        self.alloc_until(req, n, framed, Instant::now())
    }

    fn alloc_until(
        &self,
        req: RequestId,
        n: usize,
        framed: usize,
        deadline: Instant,
    ) -> Result<Vec<PageRef>> {
        let sh = &*self.shared;
        let mut st = sh.state.lock();
        loop {
            if !st.requests.contains_key(&req) {
                return Err(not_live(req));
            }
            if !st.device.can_alloc(n, framed) {
                if Instant::now() >= deadline && !could_make_room(&st, sh.device.spec(), n, framed)
                {
                    // A try that cannot succeed now changes nothing (evicts nothing).
                    return Err(Error::OutOfPages {
                        what: st.device.scarce(n),
                        wanted: n,
                        free: st.device.num_free(),
                    });
                }
                make_room(sh, &mut st, n, framed);
            }
            if st.device.can_alloc(n, framed) {
                break;
            }
            if !wait_for_room(sh, &mut st, n, framed, deadline) {
                return Err(Error::OutOfPages {
                    what: st.device.scarce(n),
                    wanted: n,
                    free: st.device.num_free(),
                });
            }
        }
        let pages = st.device.alloc_framed(n, framed)?;
        for p in &pages {
            // Nothing landed yet: the owner's stores (or a transfer) stamp them.
            sh.device.clear_landed(p.id);
        }
        if let Some(r) = st.requests.get_mut(&req) {
            r.own.extend(&pages);
        }
        Ok(pages)
    }

    /// Gives back the window rows (their frames) of the pages of `req` whose tokens left
    /// every later query's window ([`CacheSpec::window_passed`] of `tokens`, the tokens
    /// stored so far; `pages[i]` holds tokens `i * page_size..`), from page `from` on:
    /// the pages the request owns (a cached page's frame goes only under frame pressure).
    /// A caller keeps `from` past the pages a later request may want to start on — a
    /// prompt's: a prefix hit ends on a page that holds its window rows, and the pages a
    /// request commits keep what they hold. The pages keep their other pools. Refused
    /// while a step holds the request; nothing goes while a transfer writes it, and a
    /// pinned page keeps its frame. Each frame freed goes first to the request's next
    /// page reserved without one (a store into such a page also takes a free frame).
    /// Returns how many frames went back to the pool (0 without a window).
    pub fn release_window(
        &self,
        req: RequestId,
        pages: &[PageRef],
        from: usize,
        tokens: usize,
    ) -> Result<usize> {
        let sh = &*self.shared;
        let mut st = sh.state.lock();
        window::release_window(sh, &mut st, req, pages, from, tokens)
    }

    /// Opens a forward step over `reqs` (distinct live requests): pins every page they
    /// read or write until the step is dropped. See [`Step`].
    pub fn step(&self, reqs: &[RequestId]) -> Result<Step<'_, B>> {
        Step::open(self, reqs)
    }

    /// Starts receiving `pages` (owned by `req`, e.g. allocated for a prompt on the decode
    /// side) from elsewhere. See [`Inbound`].
    pub fn inbound(&self, req: RequestId, pages: &[PageRef]) -> Result<Inbound<B>> {
        Inbound::open(&self.shared, req, pages, None)
    }

    /// [`HiCache::inbound`] of the first `tokens` raw tokens of a sequence (`pages` holds
    /// exactly those): every pool of every page lands, except the window pool's
    /// ([`CacheSpec::with_window`]), of which only the pages a query after those tokens
    /// reads ([`CacheSpec::window_pages`]) do — the others give their frame back at once.
    /// What a PD decode side receives a prompt with.
    pub fn inbound_tokens(
        &self,
        req: RequestId,
        pages: &[PageRef],
        tokens: usize,
    ) -> Result<Inbound<B>> {
        Inbound::open(&self.shared, req, pages, Some(tokens))
    }

    /// Inserts the full pages of `tokens` (the request's whole sequence so far), held in
    /// `pages` (`pages[i]` holds tokens `i*page_size..`), into the prefix tree. The first
    /// pages must be the request's matched prefix, in position; the others must be pages
    /// the request owns, each once. Pages the tree adopts stop being the request's; the
    /// request locks the new path. Refused while a step holds the request or while any of
    /// its loads is unfinished (its pages could not have been computed on a landed prefix),
    /// and with [`Error::NotLanded`] for a page not written in every layer.
    pub fn commit(&self, req: RequestId, tokens: &[u32], pages: &[PageRef]) -> Result<()> {
        let sh = &*self.shared;
        let ps = sh.device.spec().page_size();
        let mut st = sh.state.lock();
        let st = &mut *st;
        let full = tokens.len() / ps;
        let r = st.requests.get(&req).ok_or_else(|| not_live(req))?;
        if r.users > 0 {
            return Err(invalid(
                "commit",
                format!("request {req} is in a live step"),
            ));
        }
        if r.inbound.is_some() {
            // Its pages would be shared while the transfer can still write them.
            return Err(invalid(
                "commit",
                format!("request {req} has a transfer still open"),
            ));
        }
        if let Some(e) = r.fences.iter().find_map(|f| f.failure()) {
            return Err(Error::RequestFailed {
                request: req,
                cause: Box::new(e),
            });
        }
        if r.fences.iter().any(|f| !f.is_complete()) {
            return Err(invalid(
                "commit",
                format!("request {req} has loads or transfers still in flight"),
            ));
        }
        if pages.len() < full {
            return Err(Error::Shape {
                what: "commit pages",
                expected: full,
                actual: pages.len(),
            });
        }
        let pages = &pages[..full];
        let mut first_use: HashMap<u32, usize> = HashMap::new();
        for (i, p) in pages.iter().enumerate() {
            if let Some(first) = first_use.insert(p.id, i) {
                return Err(Error::DuplicatePage {
                    what: "commit pages",
                    page: p.id as i64,
                    first,
                    second: i,
                });
            }
        }
        let old_path = r.path.clone();
        let mut cur = ROOT;
        for (i, (&node, key)) in old_path.iter().zip(tokens.chunks_exact(ps)).enumerate() {
            if st.tree.child(cur, key) != Some(node) {
                return Err(invalid(
                    "commit tokens",
                    format!("page {i} of the tokens is not the request's matched prefix"),
                ));
            }
            let dev = st.tree.get(node).and_then(|n| n.device).map(|d| d.page);
            if dev != Some(pages[i]) {
                return Err(invalid(
                    "commit pages",
                    format!(
                        "pages[{i}] = {:?} is not the prefix page at that position ({dev:?})",
                        pages[i]
                    ),
                ));
            }
            cur = node;
        }
        let own: HashSet<PageRef> = r.own.iter().copied().collect();
        if let Some((i, bad)) = pages
            .iter()
            .enumerate()
            .skip(old_path.len())
            .find(|(_, p)| !own.contains(p))
        {
            return Err(invalid(
                "commit pages",
                format!("pages[{i}] = {bad:?} is not a page the request owns"),
            ));
        }
        // Pages entering the tree must be full: every entry written for their
        // generation, in every layer and every kind it holds.
        for p in pages.iter().skip(old_path.len()) {
            for l in 0..sh.num_layers() {
                for kind in sh.device.spec().kinds(l) {
                    if sh.device.index(kind, p.id).is_none() {
                        // Window rows given back: the page enters without them.
                        continue;
                    }
                    let landed = sh.device.landed(l, kind, p.id);
                    let stamp = landed.map(|x| x.generation);
                    if stamp != Some(p.generation) {
                        return Err(Error::NotLanded {
                            page: p.id,
                            layer: l,
                            kind: kind.name(),
                            generation: p.generation,
                            stamp,
                        });
                    }
                    let filled = landed.map_or(0, |x| x.filled);
                    if filled < sh.device.spec().entries_per_page(kind) as u32 {
                        return Err(Error::Unwritten {
                            page: p.id,
                            layer: l,
                            kind: kind.name(),
                            slot: filled,
                            filled,
                        });
                    }
                }
            }
        }
        // All checked: insert.
        let mut new_nodes = Vec::new();
        let mut adopted = Vec::new();
        let mut backup = Vec::new();
        for (key, &page) in tokens.chunks_exact(ps).zip(pages).skip(old_path.len()) {
            // A node a load is still filling: the request keeps its own (written) copy
            // and its path stops here — joining the node would mean reading a page that
            // has not landed, without that load's fence.
            if let Some(c) = st.tree.child(cur, key) {
                if st
                    .tree
                    .get(c)
                    .and_then(|n| n.device)
                    .is_some_and(|d| d.load.is_some())
                {
                    break;
                }
            }
            let Some(node) = st.tree.child_or_insert(cur, key) else {
                return Err(invalid("commit", "prefix tree node vanished"));
            };
            if let Some(n) = st.tree.get_mut(node) {
                if n.device.is_none() {
                    // A node discarded after an integrity failure is filled afresh.
                    n.discarded = false;
                    n.device = Some(DevicePage { page, load: None });
                    adopted.push(page);
                    if n.host.is_none() && n.backup.is_none() {
                        backup.push(node);
                    }
                }
            }
            new_nodes.push(node);
            cur = node;
        }
        st.tree.lock(&new_nodes);
        // One tick for the whole path: a parent must never look older than its child, or
        // eviction would cut the path at the parent and strand the child's page.
        let whole: Vec<NodeId> = old_path.iter().chain(&new_nodes).copied().collect();
        st.tree.touch(&whole);
        if let Some(r) = st.requests.get_mut(&req) {
            r.own.retain(|p| !adopted.contains(p));
            r.path.extend(new_nodes);
        }
        if sh.config.write_through && sh.host.is_some() && !backup.is_empty() {
            schedule_backups(sh, st, &backup, false);
        }
        Ok(())
    }

    /// Ends a request normally: unlocks its prefix and releases the pages it still owns.
    /// Refused while a step holds it (use [`HiCache::abort`] to end it from elsewhere).
    pub fn finish(&self, req: RequestId) -> Result<()> {
        let sh = &*self.shared;
        let mut st = sh.state.lock();
        let r = st.requests.get(&req).ok_or_else(|| not_live(req))?;
        if r.users > 0 {
            return Err(invalid(
                "finish",
                format!("request {req} is in a live step"),
            ));
        }
        end_request(sh, &mut st, req, "request finished");
        Ok(())
    }

    /// Aborts a request, from any thread at any time: cancels the loads only it waits for
    /// (queued ones never run; a running one stops at the next layer), fails its inbound
    /// transfer, unlocks its prefix and releases its pages. Pages a running copy or a live
    /// step still touches are quarantined until that ends; every reference to them is stale
    /// at once, so a late write is refused.
    pub fn abort(&self, req: RequestId) -> Result<()> {
        let sh = &*self.shared;
        let mut st = sh.state.lock();
        if !st.requests.contains_key(&req) {
            return Err(not_live(req));
        }
        end_request(sh, &mut st, req, "request aborted");
        Ok(())
    }

    /// Drops request `req`'s matched prefix from the cache after an integrity failure
    /// showed it cannot be trusted: its nodes are never matched again, and their pages in
    /// both tiers are released (quarantined while anything pins them; a page with a load
    /// or backup still in flight is left to that copy, which no longer makes it
    /// matchable). Every live request whose path crosses those nodes — `req` included —
    /// gets a failed fence, so its next step is refused (`Cancelled`) instead of reading
    /// pages that left: its caller recomputes. Returns the pages released.
    pub fn discard_prefix(&self, req: RequestId) -> Result<usize> {
        let sh = &*self.shared;
        let mut guard = sh.state.lock();
        let st = &mut *guard;
        let path = st
            .requests
            .get(&req)
            .ok_or_else(|| not_live(req))?
            .path
            .clone();
        if path.is_empty() {
            return Ok(0);
        }
        let mut released = 0;
        for &v in &path {
            let Some(n) = st.tree.get_mut(v) else {
                continue;
            };
            n.discarded = true;
            if let Some(d) = n.device.filter(|d| d.load.is_none()) {
                n.device = None;
                let _ = st.device.release(d.page);
                released += 1;
            }
            if n.backup.is_none() {
                if let Some(h) = n.host.take() {
                    let _ = st.host.release(h.page);
                    released += 1;
                }
            }
        }
        let e = Error::Cancelled("its prefix was discarded after an integrity failure".into());
        for r in st.requests.values_mut() {
            if r.path.iter().any(|n| path.contains(n)) {
                let f = Arc::new(Fence::pending(sh.num_layers()));
                f.fail(e.clone());
                r.fences.push(f);
            }
        }
        st.stats.discarded_pages += released as u64;
        drop(guard);
        sh.space_cv.notify_all();
        sh.notify_landed();
        Ok(released)
    }

    /// Whether `req` is live.
    pub fn is_live(&self, req: RequestId) -> bool {
        self.shared.state.lock().requests.contains_key(&req)
    }

    /// Checks that `pages` are pages request `req` received through an inbound transfer
    /// ([`HiCache::inbound`]): live, owned by it, current, and targets of its transfer —
    /// what a caller must show before treating them as the request's prompt (whether each
    /// layer landed is then gated by the transfer's fence and the landed stamps, as for
    /// every read). `Err(InvalidArgument)` naming the first page that is not.
    pub fn check_received(&self, req: RequestId, pages: &[PageRef]) -> Result<()> {
        let st = self.shared.state.lock();
        let r = st.requests.get(&req).ok_or_else(|| not_live(req))?;
        match pages
            .iter()
            .find(|p| !r.received.contains(p) || !r.own.contains(p) || !st.device.is_current(**p))
        {
            Some(p) => Err(invalid(
                "received pages",
                format!("{p:?} was not received by request {req} (or is stale)"),
            )),
            None => Ok(()),
        }
    }

    /// Checks that `pages` are pages request `req` owns, live and current (not received:
    /// its own stores fill them). `Err(InvalidArgument)` naming the first that is not.
    pub fn check_owned(&self, req: RequestId, pages: &[PageRef]) -> Result<()> {
        let st = self.shared.state.lock();
        let r = st.requests.get(&req).ok_or_else(|| not_live(req))?;
        match pages
            .iter()
            .find(|p| r.received.contains(p) || !r.own.contains(p) || !st.device.is_current(**p))
        {
            Some(p) => Err(invalid(
                "owned pages",
                format!("{p:?} is not a page request {req} owns (or is stale or received)"),
            )),
            None => Ok(()),
        }
    }

    /// Moves up to `n` cached device pages out of the device tier (to the host tier, or
    /// dropped without one) and waits (bounded) for their backups. Returns how many left;
    /// the first backup error, if any.
    pub fn evict_device(&self, n: usize) -> Result<usize> {
        let sh = &*self.shared;
        if crate::sync::held_layers() > 0 {
            return Err(invalid(
                "evict_device",
                "this thread holds a layer guard: drop it before waiting for backups",
            ));
        }
        let deadline = sh.deadline();
        let started = Instant::now();
        let (mut done, tickets) = {
            let mut st = sh.state.lock();
            evict(sh, &mut st, n)
        };
        for (t, count) in tickets {
            t.wait(0, deadline, started)?;
            done += count;
        }
        Ok(done)
    }

    /// Waits (bounded) until no load or backup is queued or running.
    pub fn wait_idle(&self) -> Result<()> {
        let sh = &*self.shared;
        if crate::sync::held_layers() > 0 {
            return Err(invalid(
                "wait_idle",
                "this thread holds a layer guard: drop it before waiting for the io worker",
            ));
        }
        let started = Instant::now();
        let deadline = sh.deadline();
        let mut st = sh.state.lock();
        while !st.loads.is_empty() || !st.backups.is_empty() {
            if sh.space_cv.wait_until(&mut st, deadline).timed_out() {
                return Err(Error::Timeout {
                    what: "the io worker to go idle",
                    after: started.elapsed(),
                });
            }
        }
        Ok(())
    }

    /// Page accounting and counters now.
    pub fn stats(&self) -> CacheStats {
        stats(&self.shared.state.lock())
    }

    /// Checks the whole bookkeeping (see `docs/cache.md`): every device page exactly once
    /// free, quarantined (and then pinned), held by the tree or owned by one live request;
    /// every host page free, quarantined, held by the tree or by an in-flight backup; pins
    /// equal the pins of live steps, copies and transfers; node lock counts equal the live
    /// requests' paths plus the running loads; every live request's path is present and
    /// linked; loading and backing-up nodes point at live jobs.
    pub fn leak_check(&self) -> Result<CacheStats> {
        let st = self.shared.state.lock();
        let problems = check(&self.shared, &st);
        if problems.is_empty() {
            Ok(stats(&st))
        } else {
            Err(Error::Leak(problems.join("; ")))
        }
    }
}

impl<B: Backend + 'static> Drop for HiCache<B> {
    fn drop(&mut self) {
        {
            let mut st = self.shared.state.lock();
            st.shutdown = true;
        }
        self.shared.work_cv.notify_all();
        if let Some(t) = self.io_thread.take() {
            let _ = t.join();
        }
    }
}
