//! Device room: how many pages could be freed, eviction (LRU over unlocked ready device
//! pages; to the host tier, or out of the cache), bounded waits for room, and the
//! device → host backups eviction and write-through schedule.

use std::sync::Arc;
use std::time::Instant;

use super::fence::Fence;
use super::pool::CacheSpec;
use super::radix::NodeId;
use super::state::{BackupItem, BackupRec, Job, Shared, State};
use super::window;
use crate::backend::Backend;
use crate::sync::MutexGuard;

/// Whether `want` device pages, `frames` of them with a window frame, could be free once
/// the evictions possible now (and those already waiting for their backup) are done.
pub(crate) fn could_make_room(st: &State, spec: &CacheSpec, want: usize, frames: usize) -> bool {
    let pending = st.tree.live().filter(|(_, n)| n.evict_after_backup).count();
    st.device.num_free_pages() + pending + st.tree.device_victim_count() >= want
        && window::frames_possible(st, spec).is_none_or(|f| f + pending >= frames.min(want))
}

/// Frees device room without waiting: victims with a host copy (or without a host tier)
/// leave at once; the others get a backup with "evict after" (they leave when it lands).
/// Aims at `want` free pages counting the evictions already in flight, and first at
/// `frames` free window frames, taken from cached pages (see [`window::strip_frames`]).
pub(crate) fn make_room<B: Backend>(sh: &Shared<B>, st: &mut State, want: usize, frames: usize) {
    // Window frames first: taking a cached page's frame costs no backup and keeps it.
    window::strip_frames(sh, st, frames.min(want));
    let pending: usize = st.tree.live().filter(|(_, n)| n.evict_after_backup).count();
    let short = want.saturating_sub(st.device.num_free_pages() + pending);
    if short > 0 {
        let _ = evict(sh, st, short);
    }
}

/// Waits (releasing the state mutex) until `want` pages, `frames` of them with a window
/// frame, could be free or `deadline`.
/// Returns false when the deadline passed or nothing in flight can free a page.
pub(crate) fn wait_for_room<B: Backend>(
    sh: &Shared<B>,
    st: &mut MutexGuard<'_, State>,
    want: usize,
    frames: usize,
    deadline: Instant,
) -> bool {
    if st.device.can_alloc(want, frames) {
        return true;
    }
    if crate::sync::held_layers() > 0 {
        // The room may need the io worker, which may need this thread's layer.
        return false;
    }
    let in_flight = !st.backups.is_empty()
        || !st.loads.is_empty()
        || !st.steps.is_empty()
        || !st.inbounds.is_empty()
        || st.device.num_quarantined() > 0
        || !st.tree.device_victims().is_empty();
    if !in_flight || Instant::now() >= deadline {
        return false;
    }
    let _ = sh.space_cv.wait_until(st, deadline);
    Instant::now() < deadline
}

/// Evicts up to `n` device pages (LRU leaves of the device tree). Returns the pages freed
/// at once and the tickets of the backups that free the rest.
pub(crate) fn evict<B: Backend>(
    sh: &Shared<B>,
    st: &mut State,
    n: usize,
) -> (usize, Vec<(Arc<Fence>, usize)>) {
    let victims: Vec<NodeId> = st.tree.device_victims().into_iter().take(n).collect();
    let mut done = 0;
    let mut need_backup = Vec::new();
    for v in victims {
        let Some(node) = st.tree.get(v) else { continue };
        // Without a worker nothing backs the page up: it leaves the cache instead (an
        // eviction never waits for a backup that cannot run).
        if sh.host.is_some() && node.host.is_none() && st.worker_alive {
            need_backup.push(v);
            continue;
        }
        drop_device_page(st, v);
        done += 1;
    }
    let tickets = if need_backup.is_empty() {
        Vec::new()
    } else {
        schedule_backups(sh, st, &need_backup, true)
    };
    (done, tickets)
}

/// Releases a node's device page (quarantined while pinned) and prunes the node if it now
/// holds nothing.
pub(crate) fn drop_device_page(st: &mut State, v: NodeId) {
    let Some(n) = st.tree.get_mut(v) else { return };
    if let Some(d) = n.device.take() {
        let _ = st.device.release(d.page);
    }
    n.evict_after_backup = false;
    st.tree.prune(v);
}

/// Queues device → host backups of `nodes` (ready device pages, no host copy, no backup in
/// flight) into the open batch, allocating host pages (evicting host LRU leaves for room).
/// Nodes that find no host room: with `evict`, their device page is dropped (the cache
/// loses them), otherwise they stay device-only. Returns the tickets and page counts of
/// the batches used.
pub(crate) fn schedule_backups<B: Backend>(
    sh: &Shared<B>,
    st: &mut State,
    nodes: &[NodeId],
    evict: bool,
) -> Vec<(Arc<Fence>, usize)> {
    if !st.worker_alive {
        // Nobody would run the batch: its pins and backing-up marks would stay forever.
        return Vec::new();
    }
    let short = nodes.len().saturating_sub(st.host.num_free());
    if short > 0 {
        for v in st.tree.host_victims().into_iter().take(short) {
            if let Some(n) = st.tree.get_mut(v) {
                if let Some(h) = n.host.take() {
                    let _ = st.host.release(h.page);
                }
            }
            st.tree.prune(v);
        }
    }
    let mut tickets: Vec<(Arc<Fence>, usize)> = Vec::new();
    for &v in nodes {
        let Some(dev) = st
            .tree
            .get(v)
            .filter(|n| n.host.is_none() && n.backup.is_none())
            .and_then(|n| n.device)
            .filter(|d| d.load.is_none())
        else {
            continue;
        };
        let Ok(mut got) = st.host.alloc(1) else {
            if evict {
                drop_device_page(st, v);
            }
            continue;
        };
        let host = got.remove(0);
        let _ = st.host.pin(host);
        let _ = st.device.pin(dev.page);
        let batch = match st.open_backup {
            Some(b)
                if st
                    .backups
                    .get(&b)
                    .is_some_and(|r| r.queued && r.items.len() < sh.config.max_backup_batch) =>
            {
                b
            }
            _ => {
                let b = sh.next_id();
                st.backups.insert(
                    b,
                    BackupRec {
                        items: Vec::new(),
                        ticket: Arc::new(Fence::pending(1)),
                        queued: true,
                    },
                );
                st.queue.push_back(Job::Backup(b));
                st.open_backup = Some(b);
                b
            }
        };
        if let Some(n) = st.tree.get_mut(v) {
            n.backup = Some(batch);
            n.evict_after_backup = evict;
        }
        if let Some(rec) = st.backups.get_mut(&batch) {
            rec.items.push(BackupItem {
                node: v,
                device: dev.page,
                host,
            });
            match tickets
                .iter_mut()
                .find(|(t, _)| Arc::ptr_eq(t, &rec.ticket))
            {
                Some((_, c)) => *c += 1,
                None => tickets.push((rec.ticket.clone(), 1)),
            }
        }
    }
    sh.work_cv.notify_all();
    tickets
}
