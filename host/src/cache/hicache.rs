//! The hierarchical cache: device pool ⇄ host mirror pool under a radix prefix tree.
//!
//! Request lifecycle:
//! 1. [`HiCache::begin`] matches the request's tokens against the tree, locks the matched
//!    nodes, and for nodes held only by the host tier allocates device pages and queues a
//!    layer-wise load on the io worker. The returned [`Prefix`] carries the device pages of
//!    the cached prefix and a [`LoadGroup`] whose ready tokens gate every read.
//! 2. [`HiCache::alloc`] hands out device pages for the uncached tokens, evicting least
//!    recently used cache pages (device → host backup with checksums, host → out) as needed.
//! 3. [`HiCache::commit`] inserts the request's full pages into the tree.
//! 4. [`HiCache::finish`] (or [`HiCache::abort`]) unlocks and frees what the request owns.
//!
//! Integrity: every page backed up to the host records a checksum per layer and buffer
//! kind (computed on the device copy); loads verify them after the copy (on unless
//! `verify` is off) and a mismatch fails the load's fence and drops the cached pages.
//! Writes that arrive for pages by [`PageRef`] ([`HiCache::write_pages`]) are refused when
//! the page's generation changed. [`HiCache::leak_check`] accounts for every page.
//!
//! Lock order: the state mutex may be held while taking a layer lock, never the reverse;
//! the io worker takes the state mutex only while holding no layer lock. Do not call
//! into the cache while holding a [`super::fence::BufferView`].

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;

use super::alloc::{PageAllocator, PageRef};
use super::faults::{Fault, Faults};
use super::fence::{LayerFence, LoadGroup};
use super::pool::{BufferKind, CacheSpec, DevicePool, HostLayout, HostPool};
use super::radix::{HostCopy, NodeId, RadixTree};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ops::{CopyPages, PageChecksums, PagedRegion};

/// Caller-chosen request id.
pub type RequestId = u64;

/// Sizes and switches of a [`HiCache`].
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Pages in the device tier.
    pub device_pages: usize,
    /// Pages in the host tier (0 disables it: evicted pages are dropped).
    pub host_pages: usize,
    pub host_layout: HostLayout,
    /// Verify checksums of pages loaded from the host tier (default on; off only for
    /// benchmarks).
    pub verify: bool,
    /// Extra delay before each layer of a load (widens races in tests).
    pub io_delay: Duration,
    pub faults: Faults,
}

impl CacheConfig {
    /// Defaults: layer-first host tier, verification on, no delay, no faults.
    pub fn new(device_pages: usize, host_pages: usize) -> Self {
        CacheConfig {
            device_pages,
            host_pages,
            host_layout: HostLayout::LayerFirst,
            verify: true,
            io_delay: Duration::ZERO,
            faults: Faults::none(),
        }
    }
}

/// The cached prefix of a request.
#[derive(Debug)]
pub struct Prefix {
    /// Tokens covered (a multiple of the page size).
    pub tokens: usize,
    /// Device pages of the prefix, in order (valid to read once `loads` has landed).
    pub pages: Vec<PageRef>,
    /// Pages that come from the host tier.
    pub loaded_pages: usize,
    /// Ready tokens of every load the prefix depends on.
    pub loads: LoadGroup,
}

/// Page accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    pub device_pages: usize,
    pub device_free: usize,
    /// Owned by live requests.
    pub device_in_use: usize,
    /// Held by the prefix tree.
    pub device_cached: usize,
    pub host_pages: usize,
    pub host_free: usize,
    pub host_cached: usize,
    pub hits_device_pages: u64,
    pub hits_host_pages: u64,
    pub backups: u64,
    pub integrity_failures: u64,
    pub stale_writes_refused: u64,
}

#[derive(Debug, Default)]
struct Req {
    path: Vec<NodeId>,
    own: Vec<PageRef>,
}

#[derive(Debug)]
struct State {
    tree: RadixTree,
    device: PageAllocator,
    host: PageAllocator,
    requests: HashMap<RequestId, Req>,
    stats: CacheStats,
}

/// One page moving host → device.
#[derive(Clone, Debug)]
struct LoadPage {
    node: NodeId,
    host: PageRef,
    device: PageRef,
    checksums: Vec<[u64; 2]>,
}

#[derive(Debug)]
struct LoadJob {
    fence: LayerFence,
    pages: Vec<LoadPage>,
}

struct Shared<B: Backend> {
    backend: Arc<B>,
    device: DevicePool<B>,
    host: Option<HostPool<B>>,
    state: Mutex<State>,
    config: CacheConfig,
}

/// The hierarchical cache (see the module docs).
pub struct HiCache<B: Backend + 'static> {
    shared: Arc<Shared<B>>,
    io_tx: Option<Sender<LoadJob>>,
    io_thread: Option<JoinHandle<()>>,
}

impl<B: Backend + 'static> std::fmt::Debug for HiCache<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HiCache({:?})", self.shared.config)
    }
}

fn lock(m: &Mutex<State>) -> Result<MutexGuard<'_, State>> {
    m.lock()
        .map_err(|_| Error::Device("cache state lock poisoned".into()))
}

impl<B: Backend + 'static> HiCache<B> {
    /// A cache for `spec` on `backend`, with its io worker thread.
    pub fn new(backend: Arc<B>, spec: CacheSpec, config: CacheConfig) -> Result<Self> {
        let device = DevicePool::new(&*backend, spec, config.device_pages)?;
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
            device: PageAllocator::new("device", config.device_pages),
            host: PageAllocator::new("host", config.host_pages),
            requests: HashMap::new(),
            stats: CacheStats::default(),
        };
        let shared = Arc::new(Shared {
            backend,
            device,
            host,
            state: Mutex::new(state),
            config,
        });
        let (tx, rx) = mpsc::channel();
        let worker = Arc::clone(&shared);
        let io_thread = std::thread::Builder::new()
            .name("sparsekit-cache-io".into())
            .spawn(move || io_worker(worker, rx))
            .map_err(|e| Error::Device(format!("cannot start the cache io thread: {e}")))?;
        Ok(HiCache {
            shared,
            io_tx: Some(tx),
            io_thread: Some(io_thread),
        })
    }

    pub fn spec(&self) -> &CacheSpec {
        self.shared.device.spec()
    }

    pub fn config(&self) -> &CacheConfig {
        &self.shared.config
    }

    /// The device tier (layer views need a ready token, see [`LoadGroup::wait`]).
    pub fn device(&self) -> &DevicePool<B> {
        &self.shared.device
    }

    /// The host tier, if configured.
    pub fn host(&self) -> Option<&HostPool<B>> {
        self.shared.host.as_ref()
    }

    /// The backend the pools live on.
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }

    /// Matches `tokens` against the cache, locks the prefix for `req`, and starts loading
    /// its host-only pages. `req` must not be live already.
    pub fn begin(&self, req: RequestId, tokens: &[u32]) -> Result<Prefix> {
        let sh = &*self.shared;
        let mut st = lock(&sh.state)?;
        if st.requests.contains_key(&req) {
            return Err(Error::invalid("request", format!("{req} is already live")));
        }
        let path = st.tree.match_prefix(tokens);
        st.tree.lock(&path);
        let missing: Vec<NodeId> = path
            .iter()
            .copied()
            .filter(|&n| st.tree.device_page(n).is_none())
            .collect();
        let mut load = Vec::new();
        if !missing.is_empty() {
            let pages = match evict_and_alloc(sh, &mut st, missing.len()) {
                Ok(p) => p,
                Err(e) => {
                    st.tree.unlock(&path);
                    return Err(e);
                }
            };
            for (&node, device) in missing.iter().zip(pages) {
                let Some(copy) = st.tree.host_copy(node).cloned() else {
                    continue;
                };
                st.tree.set_device(node, Some(device));
                load.push(LoadPage {
                    node,
                    host: copy.page,
                    device,
                    checksums: copy.checksums,
                });
            }
        }
        let pages: Vec<PageRef> = path
            .iter()
            .filter_map(|&n| st.tree.device_page(n))
            .collect();
        st.stats.hits_host_pages += load.len() as u64;
        st.stats.hits_device_pages += (pages.len() - load.len()) as u64;
        let layers = sh.device.spec().num_layers;
        let fence = if load.is_empty() {
            LayerFence::complete(layers)
        } else {
            // The load holds its own lock on the nodes until it ends.
            let nodes: Vec<NodeId> = load.iter().map(|p| p.node).collect();
            st.tree.lock(&nodes);
            LayerFence::pending(layers)
        };
        st.requests.insert(
            req,
            Req {
                path: path.clone(),
                own: Vec::new(),
            },
        );
        let n_loaded = load.len();
        drop(st);
        if !load.is_empty() {
            let job = LoadJob {
                fence: fence.clone(),
                pages: load,
            };
            self.io_tx
                .as_ref()
                .ok_or_else(|| Error::Cancelled("cache is shutting down".into()))?
                .send(job)
                .map_err(|_| Error::Cancelled("cache io worker stopped".into()))?;
        }
        Ok(Prefix {
            tokens: path.len() * sh.device.spec().page_size(),
            pages,
            loaded_pages: n_loaded,
            loads: LoadGroup::new(vec![fence], layers),
        })
    }

    /// `n` fresh device pages owned by `req`, evicting cached pages if needed.
    pub fn alloc(&self, req: RequestId, n: usize) -> Result<Vec<PageRef>> {
        let sh = &*self.shared;
        let mut st = lock(&sh.state)?;
        if !st.requests.contains_key(&req) {
            return Err(Error::invalid("request", format!("{req} is not live")));
        }
        let pages = evict_and_alloc(sh, &mut st, n)?;
        if let Some(r) = st.requests.get_mut(&req) {
            r.own.extend(&pages);
        }
        Ok(pages)
    }

    /// Inserts the full pages of `tokens` (the request's whole sequence so far), held in
    /// `pages` (`pages[i]` holds tokens `i*page_size..`), into the prefix tree. Pages the
    /// tree adopts stop being the request's; the request locks the new path.
    pub fn commit(&self, req: RequestId, tokens: &[u32], pages: &[PageRef]) -> Result<()> {
        let sh = &*self.shared;
        let mut st = lock(&sh.state)?;
        let full = tokens.len() / sh.device.spec().page_size();
        if pages.len() < full {
            return Err(Error::Shape {
                what: "commit pages",
                expected: full,
                actual: pages.len(),
            });
        }
        let Some(r) = st.requests.get(&req) else {
            return Err(Error::invalid("request", format!("{req} is not live")));
        };
        let own: HashSet<PageRef> = r.own.iter().copied().collect();
        let old_path = r.path.clone();
        // Every page handed in must be the request's own or its prefix's.
        let prefix: HashSet<PageRef> = old_path
            .iter()
            .filter_map(|&n| st.tree.device_page(n))
            .collect();
        if let Some(bad) = pages[..full]
            .iter()
            .find(|p| !own.contains(p) && !prefix.contains(p))
        {
            return Err(Error::invalid(
                "commit pages",
                format!("page {} is neither the request's nor its prefix's", bad.id),
            ));
        }
        let (path, _dups) = st.tree.insert(
            &tokens[..full * sh.device.spec().page_size()],
            &pages[..full],
        );
        st.tree.lock(&path);
        st.tree.unlock(&old_path);
        let adopted: HashSet<PageRef> = path
            .iter()
            .filter_map(|&n| st.tree.device_page(n))
            .collect();
        if let Some(r) = st.requests.get_mut(&req) {
            r.own.retain(|p| !adopted.contains(p));
            r.path = path;
        }
        Ok(())
    }

    /// Ends a request: unlocks its prefix and frees the pages it still owns.
    pub fn finish(&self, req: RequestId) -> Result<()> {
        let mut st = lock(&self.shared.state)?;
        let r = st
            .requests
            .remove(&req)
            .ok_or_else(|| Error::invalid("request", format!("{req} is not live")))?;
        st.tree.unlock(&r.path);
        for p in r.own {
            st.device.free(p)?;
        }
        Ok(())
    }

    /// Aborts a request: as [`HiCache::finish`]; loads it started run to completion under
    /// their own locks (their pages belong to the tree), so nothing lands in freed pages.
    pub fn abort(&self, req: RequestId) -> Result<()> {
        self.finish(req)
    }

    /// Writes page `src_ids[i]` of `src` into device page `pages[i]` of layer `layer`,
    /// kind `kind` — the path for transfers that arrive by page reference. Every page's
    /// generation is checked under the state lock first; a stale reference (its request
    /// was aborted and the page reused) refuses the whole write.
    pub fn write_pages(
        &self,
        layer: usize,
        kind: BufferKind,
        pages: &[PageRef],
        src: &B::Buffer,
        src_region: PagedRegion,
        src_ids: &[i32],
    ) -> Result<()> {
        let sh = &*self.shared;
        let mut st = lock(&sh.state)?;
        if !sh.config.faults.active(Fault::NoGenerationCheck) {
            if let Some(&stale) = pages.iter().find(|&&p| !st.device.is_current(p)) {
                st.stats.stale_writes_refused += 1;
                return Err(Error::StalePage {
                    what: "device",
                    page: stale.id,
                    generation: stale.generation,
                    current: None,
                });
            }
        }
        let ids: Vec<i32> = pages.iter().map(|p| p.id as i32).collect();
        let mut layer_bufs = sh.device.write(layer)?;
        let op = CopyPages {
            src: src_region,
            dst: sh.device.region(kind),
            src_ids,
            dst_ids: &ids,
        };
        sh.backend.copy_pages(&op, src, layer_bufs.get_mut(kind))
    }

    /// Write access to a layer's buffers, for stores into pages the caller owns.
    pub fn layer_mut(
        &self,
        layer: usize,
    ) -> Result<std::sync::RwLockWriteGuard<'_, super::pool::LayerBuffers<B>>> {
        self.shared.device.write(layer)
    }

    /// Moves up to `n` cached device pages to the host tier (or drops them without one).
    pub fn evict_device(&self, n: usize) -> Result<usize> {
        let sh = &*self.shared;
        let mut st = lock(&sh.state)?;
        evict_device(sh, &mut st, n)
    }

    /// Page accounting now.
    pub fn stats(&self) -> Result<CacheStats> {
        let sh = &*self.shared;
        let st = lock(&sh.state)?;
        Ok(stats(&st))
    }

    /// Checks that every page is accounted for exactly once: free, owned by one live
    /// request, or held by the tree (device); free or held by the tree (host); and that
    /// every held page is a current allocation.
    pub fn leak_check(&self) -> Result<CacheStats> {
        let sh = &*self.shared;
        let st = lock(&sh.state)?;
        let mut problems = Vec::new();
        let mut seen: HashMap<u32, &'static str> = HashMap::new();
        let mut claim = |id: u32, who: &'static str, problems: &mut Vec<String>| {
            if let Some(prev) = seen.insert(id, who) {
                problems.push(format!("device page {id} held by {prev} and {who}"));
            }
        };
        for p in st.tree.device_pages() {
            claim(p.id, "the tree", &mut problems);
            if !st.device.is_current(p) {
                problems.push(format!("tree holds stale device page {p:?}"));
            }
        }
        for r in st.requests.values() {
            for &p in &r.own {
                claim(p.id, "a request", &mut problems);
                if !st.device.is_current(p) {
                    problems.push(format!("request holds stale device page {p:?}"));
                }
            }
        }
        if seen.len() != st.device.num_in_use() {
            problems.push(format!(
                "{} device pages in use, {} accounted for",
                st.device.num_in_use(),
                seen.len()
            ));
        }
        let host_pages = st.tree.host_pages();
        let host_set: HashSet<u32> = host_pages.iter().map(|p| p.id).collect();
        if host_set.len() != host_pages.len() {
            problems.push("a host page is held twice".into());
        }
        if host_pages.len() != st.host.num_in_use() {
            problems.push(format!(
                "{} host pages in use, {} held by the tree",
                st.host.num_in_use(),
                host_pages.len()
            ));
        }
        if let Some(p) = host_pages.iter().find(|&&p| !st.host.is_current(p)) {
            problems.push(format!("tree holds stale host page {p:?}"));
        }
        if problems.is_empty() {
            Ok(stats(&st))
        } else {
            Err(Error::Leak(problems.join("; ")))
        }
    }
}

impl<B: Backend + 'static> Drop for HiCache<B> {
    fn drop(&mut self) {
        self.io_tx.take();
        if let Some(t) = self.io_thread.take() {
            let _ = t.join();
        }
    }
}

fn stats(st: &State) -> CacheStats {
    let in_use: usize = st.requests.values().map(|r| r.own.len()).sum();
    CacheStats {
        device_pages: st.device.capacity(),
        device_free: st.device.num_free(),
        device_in_use: in_use,
        device_cached: st.tree.device_pages().len(),
        host_pages: st.host.capacity(),
        host_free: st.host.num_free(),
        host_cached: st.tree.host_pages().len(),
        ..st.stats
    }
}

/// `n` device pages, evicting cached pages to make room.
fn evict_and_alloc<B: Backend>(sh: &Shared<B>, st: &mut State, n: usize) -> Result<Vec<PageRef>> {
    let short = n.saturating_sub(st.device.num_free());
    if short > 0 {
        evict_device(sh, st, short)?;
    }
    st.device.alloc(n)
}

/// Evicts up to `n` device pages (LRU leaves of the device tree), backing each up to the
/// host tier first. Returns how many were evicted.
fn evict_device<B: Backend>(sh: &Shared<B>, st: &mut State, n: usize) -> Result<usize> {
    let mut done = 0;
    while done < n {
        let victims: Vec<NodeId> = st
            .tree
            .device_victims()
            .into_iter()
            .take(n - done)
            .collect();
        if victims.is_empty() {
            break;
        }
        let need_backup: Vec<NodeId> = victims
            .iter()
            .copied()
            .filter(|&v| st.tree.host_copy(v).is_none())
            .collect();
        if sh.host.is_some() && !need_backup.is_empty() {
            backup(sh, st, &need_backup)?;
        }
        for v in victims {
            let Some(page) = st.tree.device_page(v) else {
                continue;
            };
            st.tree.set_device(v, None);
            st.device.free(page)?;
            if st.tree.host_copy(v).is_none() {
                // No host tier (or no room): the page leaves the cache, with any host-only
                // pages below it.
                for (dev, host) in st.tree.remove_subtree(v) {
                    if let Some(p) = dev {
                        st.device.free(p)?;
                    }
                    if let Some(h) = host {
                        st.host.free(h.page)?;
                    }
                }
            }
            done += 1;
        }
    }
    Ok(done)
}

/// Copies the device pages of `nodes` to newly allocated host pages (evicting host LRU
/// leaves for room) and records their checksums. Nodes that find no host room stay
/// device-only.
fn backup<B: Backend>(sh: &Shared<B>, st: &mut State, nodes: &[NodeId]) -> Result<()> {
    let Some(host) = sh.host.as_ref() else {
        return Ok(());
    };
    let short = nodes.len().saturating_sub(st.host.num_free());
    if short > 0 {
        for v in st.tree.host_victims().into_iter().take(short) {
            if let Some((_, Some(copy))) = st.tree.remove_leaf(v) {
                st.host.free(copy.page)?;
            }
        }
    }
    let k = nodes.len().min(st.host.num_free());
    if k == 0 {
        return Ok(());
    }
    let nodes = &nodes[..k];
    let host_pages = st.host.alloc(k)?;
    let dev_ids: Vec<i32> = nodes
        .iter()
        .map(|&n| st.tree.device_page(n).map_or(-1, |p| p.id as i32))
        .collect();
    let host_ids: Vec<i32> = host_pages.iter().map(|p| p.id as i32).collect();
    let layers = sh.device.spec().num_layers;
    // Checksums per layer and kind, then transposed to per node.
    let mut per_layer: Vec<[Vec<u64>; 2]> = Vec::with_capacity(layers);
    let mut host_buf = host.write()?;
    for l in 0..layers {
        let dev = sh.device.read(l)?;
        let mut layer_sums: [Vec<u64>; 2] = Default::default();
        for (ki, kind) in BufferKind::ALL.into_iter().enumerate() {
            let src = sh.device.region(kind);
            let dst = geometry(&sh.config.faults, src, host.region(l, kind));
            let op = CopyPages {
                src,
                dst,
                src_ids: &dev_ids,
                dst_ids: &host_ids,
            };
            sh.backend.copy_pages(&op, dev.get(kind), &mut host_buf)?;
            layer_sums[ki] = checksums(&*sh.backend, src, dev.get(kind), &dev_ids)?;
        }
        per_layer.push(layer_sums);
    }
    let sums: Vec<Vec<[u64; 2]>> = (0..k)
        .map(|i| per_layer.iter().map(|s| [s[0][i], s[1][i]]).collect())
        .collect();
    for ((&node, page), checksums) in nodes.iter().zip(host_pages).zip(sums) {
        st.tree.set_host(node, Some(HostCopy { page, checksums }));
    }
    st.stats.backups += k as u64;
    Ok(())
}

/// The destination geometry of a backup copy: `dst`, or (under the `shared-item-size`
/// fault) `dst`'s layout with the source's row geometry — the historical io-copy bug of
/// one item size for both sides.
fn geometry(faults: &Faults, src: PagedRegion, dst: PagedRegion) -> PagedRegion {
    if faults.active(Fault::SharedItemSize) {
        PagedRegion {
            stride: src.stride,
            ..dst
        }
    } else {
        dst
    }
}

fn checksums<B: Backend>(
    b: &B,
    region: PagedRegion,
    buf: &B::Buffer,
    ids: &[i32],
) -> Result<Vec<u64>> {
    let mut out = b.alloc(ids.len() * 8)?;
    b.page_checksums(&PageChecksums { region, ids }, buf, &mut out)?;
    Ok(b.download(&out)?
        .chunks_exact(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect())
}

/// The io worker: runs loads layer by layer, publishing each layer's ready token after its
/// KV and index-K pages landed (and verified).
fn io_worker<B: Backend>(sh: Arc<Shared<B>>, rx: Receiver<LoadJob>) {
    while let Ok(job) = rx.recv() {
        let result = run_load(&sh, &job);
        let nodes: Vec<NodeId> = job.pages.iter().map(|p| p.node).collect();
        let Ok(mut st) = lock(&sh.state) else {
            job.fence
                .fail(Error::Device("cache state lock poisoned".into()));
            continue;
        };
        st.tree.unlock(&nodes);
        if let Err(e) = result {
            if matches!(e, Error::Integrity { .. }) {
                st.stats.integrity_failures += 1;
            }
            // Never serve what failed: drop the loaded nodes (and what hangs below them).
            for n in &nodes {
                for (dev, host) in st.tree.remove_subtree(*n) {
                    if let Some(p) = dev {
                        let _ = st.device.free(p);
                    }
                    if let Some(h) = host {
                        let _ = st.host.free(h.page);
                    }
                }
            }
            drop(st);
            job.fence.fail(e);
        }
    }
}

fn run_load<B: Backend>(sh: &Shared<B>, job: &LoadJob) -> Result<()> {
    let host = sh
        .host
        .as_ref()
        .ok_or_else(|| Error::Device("load without a host tier".into()))?;
    let host_ids: Vec<i32> = job.pages.iter().map(|p| p.host.id as i32).collect();
    let dev_ids: Vec<i32> = job.pages.iter().map(|p| p.device.id as i32).collect();
    for l in 0..sh.device.spec().num_layers {
        if !sh.config.io_delay.is_zero() {
            std::thread::sleep(sh.config.io_delay);
        }
        {
            let st = lock(&sh.state)?;
            let stale = job
                .pages
                .iter()
                .find(|p| !st.device.is_current(p.device) || !st.host.is_current(p.host));
            if let Some(p) = stale {
                if !sh.config.faults.active(Fault::NoGenerationCheck) {
                    return Err(Error::StalePage {
                        what: "device",
                        page: p.device.id,
                        generation: p.device.generation,
                        current: None,
                    });
                }
            }
        }
        let host_buf = host.read()?;
        let mut dev = sh.device.write(l)?;
        for (ki, kind) in BufferKind::ALL.into_iter().enumerate() {
            let src = host.region(l, kind);
            let dst = sh.device.region(kind);
            let op = CopyPages {
                src,
                dst,
                src_ids: &host_ids,
                dst_ids: &dev_ids,
            };
            sh.backend.copy_pages(&op, &host_buf, dev.get_mut(kind))?;
            if sh.config.verify {
                let got = checksums(
                    &*sh.backend,
                    sh.device.region(kind),
                    dev.get(kind),
                    &dev_ids,
                )?;
                for (p, g) in job.pages.iter().zip(got) {
                    let want = p.checksums.get(l).map_or(0, |c| c[ki]);
                    if g != want {
                        return Err(Error::Integrity {
                            what: "host→device",
                            page: p.host.id,
                            layer: l,
                            kind: kind.name(),
                            expected: want,
                            actual: g,
                        });
                    }
                }
            }
        }
        drop(dev);
        drop(host_buf);
        job.fence.publish(l);
    }
    Ok(())
}
