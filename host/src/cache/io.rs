//! The io worker: runs host → device loads layer by layer (publishing each layer's ready
//! token after its KV and index-K pages landed and were verified) and batched device →
//! host backups, off the state mutex. Every job runs under `catch_unwind`: a panicking or
//! failing job fails its fence and is cleaned up like any failure; a worker thread that
//! dies anyway fails everything queued and marks the cache load-less, so no waiter is ever
//! wedged and nothing unloaded is ever served.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::faults::Fault;
use super::fence::Fence;
use super::pool::BufferKind;
use super::radix::{DevicePage, HostCopy, LayerRecord};
use super::room::drop_device_page;
use super::state::{BackupItem, Job, LoadPage, Shared, State};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ops::{CopyPages, PageChecksums, PagedRegion};
use crate::sync::{AtomicBool, Ordering};

/// Marks the cache load-less and fails all pending work if the worker thread unwinds.
struct WorkerGuard<'a, B: Backend>(&'a Shared<B>);

impl<B: Backend> Drop for WorkerGuard<'_, B> {
    fn drop(&mut self) {
        let mut st = self.0.state.lock();
        st.worker_alive = false;
        let why = if std::thread::panicking() {
            "cache io worker died"
        } else {
            "cache shut down"
        };
        drain(self.0, &mut st, why);
    }
}

/// Fails every queued or unfinished job.
fn drain<B: Backend>(sh: &Shared<B>, st: &mut State, why: &str) {
    st.queue.clear();
    let loads: Vec<u64> = st.loads.keys().copied().collect();
    for id in loads {
        finalize_load(sh, st, id, Err(Error::Cancelled(why.into())));
    }
    let backups: Vec<u64> = st.backups.keys().copied().collect();
    for id in backups {
        finalize_backup(sh, st, id, Err(Error::Cancelled(why.into())));
    }
    sh.space_cv.notify_all();
}

fn panic_error(p: Box<dyn std::any::Any + Send>) -> Error {
    let msg = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    Error::Cancelled(format!("cache io worker panicked: {msg}"))
}

/// The worker thread: runs [`work`] until shutdown. A panic that escapes a job's own
/// containment (bookkeeping, not a copy) fails every pending job — their waiters get a
/// typed error at once — and the worker goes on with new work: the cache never stays
/// without a worker (counted in `CacheStats::worker_restarts`).
pub(crate) fn worker<B: Backend>(sh: Arc<Shared<B>>) {
    let _guard = WorkerGuard(&sh);
    loop {
        match catch_unwind(AssertUnwindSafe(|| work(&sh))) {
            Ok(()) => return,
            Err(p) => {
                let e = panic_error(p);
                let mut st = sh.state.lock();
                st.stats.worker_restarts += 1;
                drain(&sh, &mut st, &e.to_string());
            }
        }
    }
}

/// The worker loop (returns at shutdown).
fn work<B: Backend>(sh: &Arc<Shared<B>>) {
    loop {
        let job = {
            let mut st = sh.state.lock();
            loop {
                if st.shutdown {
                    return;
                }
                if let Some(j) = st.queue.pop_front() {
                    match j {
                        Job::Load(id) => {
                            if let Some(r) = st.loads.get_mut(&id) {
                                r.queued = false;
                            }
                        }
                        Job::Backup(id) => {
                            if let Some(r) = st.backups.get_mut(&id) {
                                r.queued = false;
                            }
                            if st.open_backup == Some(id) {
                                st.open_backup = None;
                            }
                        }
                    }
                    if sh.fault(Fault::WorkerDies) && !sh.worker_died.swap(true, Ordering::AcqRel) {
                        panic!("injected: the cache io worker dies (worker-dies)");
                    }
                    break j;
                }
                // Idle: woken by new work or shutdown; the bound only re-checks.
                let _ = sh
                    .work_cv
                    .wait_until(&mut st, Instant::now() + Duration::from_secs(1));
            }
        };
        match job {
            Job::Load(id) => {
                let Some((pages, fence, cancel, reads)) = ({
                    let st = sh.state.lock();
                    st.loads.get(&id).map(|r| {
                        (
                            r.pages.clone(),
                            r.fence.clone(),
                            r.cancel.clone(),
                            r.reads_at_queue.clone(),
                        )
                    })
                }) else {
                    continue;
                };
                let res = catch_unwind(AssertUnwindSafe(|| {
                    run_load(sh, &pages, &fence, &cancel, &reads)
                }))
                .unwrap_or_else(|p| Err(panic_error(p)));
                let mut st = sh.state.lock();
                finalize_load(sh, &mut st, id, res);
            }
            Job::Backup(id) => {
                let Some(items) = ({
                    let st = sh.state.lock();
                    st.backups.get(&id).map(|r| r.items.clone())
                }) else {
                    continue;
                };
                let res = catch_unwind(AssertUnwindSafe(|| run_backup(sh, &items)))
                    .unwrap_or_else(|p| Err(panic_error(p)));
                let mut st = sh.state.lock();
                finalize_backup(sh, &mut st, id, res);
            }
        }
    }
}

/// Cancels load `id` (its last dependent went away) unless all its layers landed already:
/// its fence fails at once and its
/// nodes drop the pages it was filling (released at once: quarantined while the job still
/// pins them), so a later request starts a fresh load instead of sharing a dead one. A
/// queued job is finalized now and never runs; a running one stops before its next copy.
pub(crate) fn cancel_load<B: Backend>(sh: &Shared<B>, st: &mut State, id: u64, why: &str) {
    let Some(rec) = st.loads.get_mut(&id) else {
        return;
    };
    if rec.fence.is_complete() {
        // Every layer already landed: the worker is about to finalize it; keep it.
        return;
    }
    rec.cancel.store(true, Ordering::Release);
    let e = Error::Cancelled(format!("load cancelled: {why}"));
    rec.fence.fail(e.clone());
    sh.notify_landed();
    let queued = rec.queued;
    let pages: Vec<(super::radix::NodeId, crate::cache::PageRef)> =
        rec.pages.iter().map(|p| (p.node, p.device)).collect();
    for (node, page) in pages {
        if let Some(n) = st.tree.get_mut(node) {
            if n.device
                .is_some_and(|d| d.page == page && d.load == Some(id))
            {
                n.device = None;
                let _ = st.device.release(page);
            }
        }
    }
    if queued {
        st.queue.retain(|j| *j != Job::Load(id));
        finalize_load(sh, st, id, Err(e));
    }
}

/// Ends load `id`: on success its nodes become ready; on failure (or cancellation, or a
/// panic) its fence fails, its nodes lose the device pages it was filling (and, on an
/// integrity failure, their host copies: never served again). Pins and the job's node
/// locks go; released pages still pinned by a live step stay quarantined.
pub(crate) fn finalize_load<B: Backend>(sh: &Shared<B>, st: &mut State, id: u64, res: Result<()>) {
    let Some(rec) = st.loads.remove(&id) else {
        return;
    };
    // Cancelled after its last copy, before its last layer was published: `cancel_load`
    // already failed the fence and took the pages; it is a cancelled load, not a load.
    let res = match res {
        Ok(()) if rec.cancel.load(Ordering::Acquire) => Err(Error::Cancelled(
            "load cancelled after its last copy".into(),
        )),
        r => r,
    };
    match &res {
        Ok(()) => {
            st.stats.loads += 1;
            for p in &rec.pages {
                if let Some(n) = st.tree.get_mut(p.node) {
                    if n.device
                        == Some(DevicePage {
                            page: p.device,
                            load: Some(id),
                        })
                    {
                        n.device = Some(DevicePage {
                            page: p.device,
                            load: None,
                        });
                    }
                }
            }
        }
        Err(e) => {
            rec.fence.fail(e.clone());
            sh.notify_landed();
            match e {
                Error::Integrity { .. } => {
                    st.stats.integrity_failures += 1;
                    st.stats.host_integrity_failures += 1;
                }
                _ if rec.cancel.load(Ordering::Acquire) => st.stats.cancelled_loads += 1,
                _ => st.stats.load_failures += 1,
            }
            let bad_host = matches!(e, Error::Integrity { .. });
            for p in &rec.pages {
                let Some(n) = st.tree.get_mut(p.node) else {
                    continue;
                };
                if n.device
                    .is_some_and(|d| d.page == p.device && d.load == Some(id))
                {
                    n.device = None;
                    let _ = st.device.release(p.device);
                }
                if bad_host && n.host.as_ref().is_some_and(|h| h.page == p.host) {
                    n.host = None;
                    let _ = st.host.release(p.host);
                }
            }
        }
    }
    for p in &rec.pages {
        st.device.unpin(p.device.id);
        st.host.unpin(p.host.id);
    }
    let nodes: Vec<_> = rec.pages.iter().map(|p| p.node).collect();
    st.tree.unlock(&nodes);
    sh.space_cv.notify_all();
}

/// Ends backup batch `id`: landed copies become the nodes' host copies (and evicting
/// nodes leave the device tier if still unlocked); the host pages of failed or obsolete
/// items are released. Pins go; the batch's ticket is published or failed.
pub(crate) fn finalize_backup<B: Backend>(
    sh: &Shared<B>,
    st: &mut State,
    id: u64,
    res: Result<Vec<Vec<LayerRecord>>>,
) {
    let Some(rec) = st.backups.remove(&id) else {
        return;
    };
    if st.open_backup == Some(id) {
        st.open_backup = None;
    }
    for (i, it) in rec.items.iter().enumerate() {
        let device_ok = st.device.is_current(it.device);
        let mut landed = false;
        if let Some(n) = st.tree.get_mut(it.node) {
            if n.backup == Some(id) {
                n.backup = None;
                let same = n.device.is_some_and(|d| d.page == it.device) && device_ok;
                let evict = std::mem::take(&mut n.evict_after_backup) && n.locks == 0;
                match (&res, same) {
                    (Ok(records), true) => {
                        n.host = Some(HostCopy {
                            page: it.host,
                            layers: records.get(i).cloned().unwrap_or_default(),
                        });
                        landed = true;
                        if evict {
                            drop_device_page(st, it.node);
                        }
                    }
                    (Err(_), true) if evict => {
                        // The eviction cannot wait for a host copy: the cache loses it.
                        drop_device_page(st, it.node);
                    }
                    _ => {}
                }
            }
        }
        if !landed {
            let _ = st.host.release(it.host);
        }
        st.device.unpin(it.device.id);
        st.host.unpin(it.host.id);
        st.tree.prune(it.node);
    }
    match res {
        Ok(_) => {
            st.stats.backups += rec.items.len() as u64;
            rec.ticket.publish(0);
        }
        Err(e) => {
            st.stats.backup_failures += 1;
            rec.ticket.fail(e);
        }
    }
    sh.space_cv.notify_all();
}

/// Checksums of pages `ids` of `region` in `buf`.
pub(crate) fn checksums<B: Backend>(
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

fn load_ids(pages: &[LoadPage]) -> (Vec<i32>, Vec<i32>) {
    (
        pages.iter().map(|p| p.host.id as i32).collect(),
        pages.iter().map(|p| p.device.id as i32).collect(),
    )
}

/// The items of a copy between host pages `host_ids` and device pages `dev_ids` that pool
/// `kind` takes part in, as `(item positions, host ids, device buffer indices)`: every
/// item, but of a window pool only those whose device page holds a frame (a page whose
/// window rows were given back, or whose host copy never had them, moves its other pools
/// only), addressed by the frame.
fn kind_items<B: Backend>(
    sh: &Shared<B>,
    kind: BufferKind,
    host_ids: &[i32],
    dev_ids: &[i32],
) -> (Vec<usize>, Vec<i32>, Vec<i32>) {
    let at = sh.device.indices(kind, dev_ids);
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for (i, (&h, &d)) in host_ids.iter().zip(&at).enumerate() {
        if d >= 0 {
            out.0.push(i);
            out.1.push(h);
            out.2.push(d);
        }
    }
    out
}

/// Under the `loads-trail-readers` / `index-k-after-publish` faults: waits (bounded,
/// re-checking `cancel`) until a step asked for `layer` (`guards`: took its guard) since
/// the load was queued (`reads_at_queue`, counted as in `step::note_read`).
fn trail_readers<B: Backend>(
    sh: &Shared<B>,
    layer: usize,
    guards: bool,
    reads_at_queue: &[u64],
    cancel: &AtomicBool,
) -> Result<()> {
    let i = layer * 2 + usize::from(guards);
    let Some(&seen) = reads_at_queue.get(i) else {
        return Ok(());
    };
    let deadline = sh.deadline();
    let mut reads = sh.reads.lock();
    while reads.get(i).is_some_and(|&r| r <= seen) {
        if cancel.load(Ordering::Acquire) {
            return Err(Error::Cancelled("load cancelled".into()));
        }
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        // Slices of 10 ms: a cancellation is noticed without a notification of its own.
        let _ = sh
            .reads_cv
            .wait_until(&mut reads, deadline.min(now + Duration::from_millis(10)));
    }
    Ok(())
}

/// Where host page `host_id` of `region` sits when addressed with the host layout's page
/// size but moved with `device`'s bytes (the `no-layout-check` fault): a one-page region
/// in the device layout, kept inside the host buffer.
fn host_page_as_device(
    region: PagedRegion,
    host_id: i32,
    device: crate::layout::PageLayout,
    host_len: usize,
) -> PagedRegion {
    let page = device.bytes_per_page();
    let start = region.page_range(host_id.max(0) as usize).start;
    PagedRegion {
        layout: device,
        offset: start.min(host_len.saturating_sub(page)),
        stride: page,
        num_pages: 1,
    }
}

/// One side of a page copy: a region of a buffer and the page ids in it.
struct Side<'a> {
    region: PagedRegion,
    ids: &'a [i32],
}

/// Copies pages `src` → `dst`; `host` says which side is the host tier. Under the
/// `no-layout-check` fault with differing descriptors, page by page with the host side
/// readdressed by [`host_page_as_device`] (the historical copy that never compared them).
fn copy_host<B: Backend>(
    sh: &Shared<B>,
    src: Side<'_>,
    src_buf: &B::Buffer,
    dst: Side<'_>,
    dst_buf: &mut B::Buffer,
    host_is_src: bool,
) -> Result<()> {
    let bypass = sh.fault(Fault::NoLayoutCheck)
        && src.region.layout.fingerprint() != dst.region.layout.fingerprint();
    if !bypass {
        let op = CopyPages {
            src: src.region,
            dst: dst.region,
            src_ids: src.ids,
            dst_ids: dst.ids,
        };
        return sh.backend.copy_pages(&op, src_buf, dst_buf);
    }
    let host_len = sh
        .backend
        .buffer_len(if host_is_src { src_buf } else { &*dst_buf });
    for (&s, &d) in src.ids.iter().zip(dst.ids) {
        let (src_region, dst_region, s, d) = if host_is_src {
            let one = host_page_as_device(src.region, s, dst.region.layout, host_len);
            (one, dst.region, 0, d)
        } else {
            let one = host_page_as_device(dst.region, d, src.region.layout, host_len);
            (src.region, one, s, 0)
        };
        let op = CopyPages {
            src: src_region,
            dst: dst_region,
            src_ids: &[s],
            dst_ids: &[d],
        };
        sh.backend.copy_pages(&op, src_buf, dst_buf)?;
    }
    Ok(())
}

/// One load, layer by layer; publishes each layer after every pool it holds landed and
/// verified (under the `index-k-after-publish` fault: after the other pools — the index-K
/// copy follows once a reader reached the layer; under `reload-kv-only`, index-K is never
/// copied, and the verification of every pool the layer holds catches it).
fn run_load<B: Backend>(
    sh: &Shared<B>,
    pages: &[LoadPage],
    fence: &Fence,
    cancel: &AtomicBool,
    reads_at_queue: &[u64],
) -> Result<()> {
    let host = sh
        .host
        .as_ref()
        .ok_or_else(|| Error::Device("load without a host tier".into()))?;
    let ids = load_ids(pages);
    let late_index_k = sh.fault(Fault::IndexKAfterPublish);
    let cancelled = || {
        if cancel.load(Ordering::Acquire) {
            Err(Error::Cancelled("load cancelled".into()))
        } else {
            Ok(())
        }
    };
    for l in 0..sh.num_layers() {
        cancelled()?;
        if sh.fault(Fault::LoadsTrailReaders) {
            trail_readers(sh, l, false, reads_at_queue, cancel)?;
        }
        let kinds: Vec<BufferKind> = sh.device.spec().kinds(l).collect();
        check_host_records(sh, pages, l, &kinds)?;
        {
            let mut dev = sh.device.lock(l, sh.deadline())?;
            let host_buf = host.buffer();
            let mut copied = Vec::with_capacity(kinds.len());
            for &kind in &kinds {
                cancelled()?;
                if late_index_k && kind == BufferKind::IndexK {
                    // Undefined until the late copy: a pattern, so an early read is wrong.
                    let region = sh.device.region(kind);
                    poison_pages(&*sh.backend, region, dev.get_mut(kind)?, &ids.1)?;
                    continue;
                }
                if sh.fault(Fault::ReloadKvOnly) && kind == BufferKind::IndexK {
                    continue;
                }
                copy_kind(sh, host, &host_buf, &mut dev, l, kind, &ids)?;
                copied.push(kind);
            }
            // Every pool the layer holds, whatever was copied (the late index-K: once it is).
            let verified: Vec<BufferKind> = kinds
                .iter()
                .copied()
                .filter(|k| !(late_index_k && *k == BufferKind::IndexK))
                .collect();
            verify_kinds(sh, &dev, l, &verified, pages)?;
            stamp_kinds(sh, l, &copied, pages);
        }
        fence.publish(l);
        if late_index_k && kinds.contains(&BufferKind::IndexK) {
            // After a reader took the layer's guard: it holds the layer until it waits
            // for the index-K stamps (or, unchecked, has read the pattern).
            trail_readers(sh, l, true, reads_at_queue, cancel)?;
            cancelled()?;
            let mut dev = sh.device.lock(l, sh.deadline())?;
            let host_buf = host.buffer();
            let kind = [BufferKind::IndexK];
            copy_kind(sh, host, &host_buf, &mut dev, l, kind[0], &ids)?;
            verify_kinds(sh, &dev, l, &kind, pages)?;
            stamp_kinds(sh, l, &kind, pages);
        }
    }
    Ok(())
}

/// Refuses (as an integrity failure: the host copy is dropped) a load of layer `l` from
/// host copies whose backup did not copy every pool of `kinds` (not checked under
/// `no-landed-check`).
fn check_host_records<B: Backend>(
    sh: &Shared<B>,
    pages: &[LoadPage],
    l: usize,
    kinds: &[BufferKind],
) -> Result<()> {
    if sh.fault(Fault::NoLandedCheck) {
        return Ok(());
    }
    for p in pages {
        let rec = p.layers.get(l).copied().unwrap_or_default();
        // A window pool the load does not restore (its device page holds no frame: the
        // host copy never had the rows) is not looked for.
        let wanted = |k: &&BufferKind| sh.device.index(**k, p.device.id).is_some();
        if let Some(kind) = kinds
            .iter()
            .filter(wanted)
            .find(|k| rec.copied & (1 << k.index()) == 0)
        {
            return Err(Error::Integrity {
                what: "host copy (pool never backed up)",
                page: p.host.id,
                layer: l,
                kind: kind.name(),
                expected: rec.sums[kind.index()],
                actual: 0,
            });
        }
    }
    Ok(())
}

/// Copies `kind` of layer `l` of a load's pages (`ids`: host ids, device ids) from the
/// host tier into the device layer `dev`.
fn copy_kind<B: Backend>(
    sh: &Shared<B>,
    host: &super::pool::HostPool<B>,
    host_buf: &B::Buffer,
    dev: &mut super::pool::LayerBuffers<B>,
    l: usize,
    kind: BufferKind,
    (host_ids, dev_ids): &(Vec<i32>, Vec<i32>),
) -> Result<()> {
    let (_, host_ids, dev_ids) = kind_items(sh, kind, host_ids, dev_ids);
    if dev_ids.is_empty() {
        return Ok(());
    }
    // Loads address the host pages with the pool's own descriptor: the
    // `pool-page-size-mismatch` fault lives in the backup path only.
    copy_host(
        sh,
        Side {
            region: host.region(l, kind),
            ids: &host_ids,
        },
        host_buf,
        Side {
            region: sh.device.region(kind),
            ids: &dev_ids,
        },
        dev.get_mut(kind)?,
        true,
    )
}

/// Checks the device bytes of `kinds` of layer `l` of a load's pages against the
/// checksums their backup recorded (when the cache verifies).
fn verify_kinds<B: Backend>(
    sh: &Shared<B>,
    dev: &super::pool::LayerBuffers<B>,
    l: usize,
    kinds: &[BufferKind],
    pages: &[LoadPage],
) -> Result<()> {
    if !sh.config.verify {
        return Ok(());
    }
    let (host_ids, dev_ids) = load_ids(pages);
    for &kind in kinds {
        let (items, _, at) = kind_items(sh, kind, &host_ids, &dev_ids);
        let got = checksums(&*sh.backend, sh.device.region(kind), dev.get(kind)?, &at)?;
        for (p, g) in items.iter().map(|&i| &pages[i]).zip(got) {
            let want = p.layers.get(l).map_or(0, |r| r.sums[kind.index()]);
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
    Ok(())
}

/// Stamps `kinds` of layer `l` of a load's pages landed for their generation (after they
/// were copied and verified) and wakes waiting readers.
fn stamp_kinds<B: Backend>(sh: &Shared<B>, l: usize, kinds: &[BufferKind], pages: &[LoadPage]) {
    for &kind in kinds {
        for p in pages {
            if sh.device.index(kind, p.device.id).is_some() {
                sh.device
                    .set_page_landed(l, kind, p.device.id, p.device.generation);
            }
        }
    }
    sh.notify_landed();
}

/// Fills pages `ids` of `region` in `buf` with a fixed pattern (finite in every dtype):
/// the stand-in for bytes that are undefined under a fault injection, so that reading
/// them is a wrong read every time rather than by chance.
pub(crate) fn poison_pages<B: Backend>(
    backend: &B,
    region: PagedRegion,
    buf: &mut B::Buffer,
    ids: &[i32],
) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let src = backend.upload(&vec![0x3c; region.layout.bytes_per_page()])?;
    let op = CopyPages {
        src: PagedRegion::contiguous(region.layout, 1),
        dst: region,
        src_ids: &vec![0; ids.len()],
        dst_ids: ids,
    };
    backend.copy_pages(&op, &src, buf)
}

/// One backup batch; returns each item's record per layer: the checksum of every pool the
/// layer holds, taken on the device copy (what a load verifies against), and the pools
/// copied (under `host-tier-skips-index-k`, all but index-K).
#[allow(clippy::needless_range_loop)] // `l` indexes layers of the pools and of `records`
fn run_backup<B: Backend>(sh: &Shared<B>, items: &[BackupItem]) -> Result<Vec<Vec<LayerRecord>>> {
    let host = sh
        .host
        .as_ref()
        .ok_or_else(|| Error::Device("backup without a host tier".into()))?;
    let dev_ids: Vec<i32> = items.iter().map(|i| i.device.id as i32).collect();
    let host_ids: Vec<i32> = items.iter().map(|i| i.host.id as i32).collect();
    let layers = sh.num_layers();
    let mut records = vec![vec![LayerRecord::default(); layers]; items.len()];
    for l in 0..layers {
        let dev = sh.device.lock(l, sh.deadline())?;
        let mut host_buf = host.buffer();
        let host_len = sh.backend.buffer_len(&host_buf);
        let kinds: Vec<BufferKind> = sh.device.spec().kinds(l).collect();
        for &kind in &kinds {
            if (sh.fault(Fault::HostTierSkipsIndexK) && kind == BufferKind::IndexK)
                || (sh.fault(Fault::CompressorStateLost) && kind == BufferKind::State)
            {
                continue;
            }
            let src = sh.device.region(kind);
            let dst = host_side(sh, host, l, kind)?;
            let (items, host_ids, dev_ids) = kind_items(sh, kind, &host_ids, &dev_ids);
            if sh.fault(Fault::SharedItemSize) && kind == BufferKind::IndexK {
                for (&d, &h) in dev_ids.iter().zip(&host_ids) {
                    let op = CopyPages {
                        src,
                        dst: shared_item_size_page(sh, dst, h, host_len),
                        src_ids: &[d],
                        dst_ids: &[0],
                    };
                    sh.backend.copy_pages(&op, dev.get(kind)?, &mut host_buf)?;
                }
            } else {
                copy_host(
                    sh,
                    Side {
                        region: src,
                        ids: &dev_ids,
                    },
                    dev.get(kind)?,
                    Side {
                        region: dst,
                        ids: &host_ids,
                    },
                    &mut host_buf,
                    false,
                )?;
            }
            for &i in &items {
                records[i][l].copied |= 1 << kind.index();
            }
        }
        // Every pool the layer holds, whatever was copied: what a load verifies.
        for &kind in &kinds {
            let src = sh.device.region(kind);
            let (items, _, at) = kind_items(sh, kind, &host_ids, &dev_ids);
            for (i, c) in items
                .into_iter()
                .zip(checksums(&*sh.backend, src, dev.get(kind)?, &at)?)
            {
                records[i][l].sums[kind.index()] = c;
            }
        }
        if sh.fault(Fault::HostBitFlip) && l + 1 == layers {
            let region = host.region(l, BufferKind::IndexK);
            let mut bytes = sh.backend.download(&host_buf)?;
            for &h in &host_ids {
                bytes[region.page_range(h as usize).start] ^= 0x01;
            }
            *host_buf = sh.backend.upload(&bytes)?;
        }
    }
    Ok(records)
}

/// The host side of a backup of layer `l`'s pool `kind`: its host region (under the
/// `pool-page-size-mismatch` fault, a compressed pool's is described and strided with the
/// window pool's page size — a descriptor the layout comparison refuses; when it is
/// bypassed the backup writes each page where the load, which uses the pool's own
/// descriptor, does not look, and over other pages and pools).
fn host_side<B: Backend>(
    sh: &Shared<B>,
    host: &super::pool::HostPool<B>,
    l: usize,
    kind: BufferKind,
) -> Result<PagedRegion> {
    let region = host.region(l, kind);
    let compressed = matches!(kind, BufferKind::CsaKv | BufferKind::HcaKv);
    let crate::layout::PageLayout::Kv(kv) = region.layout else {
        return Ok(region);
    };
    if !(compressed && sh.fault(Fault::PoolPageSizeMismatch)) {
        return Ok(region);
    }
    let window = sh.device.spec().kv.page_size();
    let wrong: crate::layout::PageLayout =
        crate::layout::KvLayout::new(kv.dtype(), kv.nope_dim(), kv.rope_dim(), window)?.into();
    Ok(PagedRegion {
        layout: wrong,
        stride: wrong.bytes_per_page(),
        ..region
    })
}

/// Under the `shared-item-size` fault, where index-K host page `host_id` of `dst` lands:
/// addressed with the KV page size (one item size for both kinds: the historical io-copy
/// bug), wrapped to stay inside the host buffer — so every layer, the last included, gets
/// its pages at wrong offsets.
fn shared_item_size_page<B: Backend>(
    sh: &Shared<B>,
    dst: PagedRegion,
    host_id: i32,
    host_len: usize,
) -> PagedRegion {
    let wrong = sh.device.spec().kv.bytes_per_page();
    let page = dst.layout.bytes_per_page();
    let span = host_len.saturating_sub(dst.offset + page) + 1;
    PagedRegion {
        offset: dst.offset + (host_id.max(0) as usize * wrong) % span,
        stride: page,
        num_pages: 1,
        ..dst
    }
}
