//! The sliding-window pool's frames at the cache's level: which tree nodes still hold
//! their window rows (a prefix hit must end on one), taking frames back from cached
//! pages under pressure, and a request giving back the frames of pages its tokens left.
//!
//! What the host tier keeps: a backup copies a page's window rows when its device page
//! still holds them (a cached page has them until frame pressure takes them), and records
//! which pools it copied; a page loaded from a copy without them gets no frame. So a host
//! hit, like a device hit, ends on the deepest page whose window rows some tier holds —
//! the rows of earlier pages are never read again by a request that starts there.

use std::collections::HashSet;

use super::alloc::PageRef;
use super::pool::{BufferKind, CacheSpec};
use super::radix::{Node, NodeId};
use super::state::{invalid, not_live, Shared, State};
use super::types::RequestId;
use crate::backend::Backend;
use crate::error::Result;

/// Whether a prefix may end on `node`: without a window, always; with one, when its
/// window rows are on the device (its page holds a frame, a load in flight included) or
/// in its host copy.
pub(crate) fn holds_window(spec: &CacheSpec, st: &State, node: &Node) -> bool {
    if spec.window().is_none() {
        return true;
    }
    match (&node.device, &node.host) {
        (Some(d), _) => st.device.frame(d.page.id).is_some(),
        (None, Some(h)) => host_has(h, BufferKind::Kv),
        (None, None) => false,
    }
}

/// Whether a host copy holds pool `kind` in every layer its backup recorded.
pub(crate) fn host_has(h: &super::radix::HostCopy, kind: BufferKind) -> bool {
    !h.layers.is_empty() && h.layers.iter().all(|r| r.copied & (1 << kind.index()) != 0)
}

/// Cuts a matched `path` after its deepest node that [`holds_window`].
pub(crate) fn end_on_window(spec: &CacheSpec, st: &State, path: &mut Vec<NodeId>) {
    if spec.window().is_none() {
        return;
    }
    let keep = path
        .iter()
        .rposition(|&n| st.tree.get(n).is_some_and(|n| holds_window(spec, st, n)))
        .map_or(0, |i| i + 1);
    path.truncate(keep);
}

/// The nodes a live request reads the window rows of: the last pages of its prefix (the
/// ones a window of tokens before the prefix's end covers). Empty without a window.
fn window_read(st: &State, spec: &CacheSpec) -> HashSet<NodeId> {
    let Some(w) = spec.window() else {
        return HashSet::new();
    };
    let tail = w.div_ceil(spec.page_size().max(1)) + 1;
    st.requests
        .values()
        .flat_map(|r| r.path.iter().rev().take(tail).copied())
        .collect()
}

/// Whether cached node `id` may give its frame up: a ready device page with no backup in
/// flight holding an unpinned frame, outside `read` (it may be locked: a request reads
/// only the window rows of the last pages of its prefix).
fn frame_victim(st: &State, read: &HashSet<NodeId>, id: NodeId, n: &Node) -> bool {
    n.backup.is_none()
        && !read.contains(&id)
        && n.device.is_some_and(|d| {
            d.load.is_none()
                && st.device.frame(d.page.id).is_some()
                && st.device.pins(d.page.id) == 0
        })
}

/// How many frames could be free now: free ones plus those [`strip_frames`] could take.
pub(crate) fn frames_possible(st: &State, spec: &CacheSpec) -> Option<usize> {
    let (free, _) = st.device.frames()?;
    let read = window_read(st, spec);
    Some(
        free + st
            .tree
            .live()
            .filter(|&(id, n)| frame_victim(st, &read, id, n))
            .count(),
    )
}

/// Gives back the frame of current page `page` (unless pinned) and forgets what its window
/// rows held: whether it went.
fn give_back<B: Backend>(sh: &Shared<B>, st: &mut State, page: PageRef) -> Result<bool> {
    let freed = st.device.release_frame(page)?;
    if freed {
        sh.device.clear_kind_landed(page.id, BufferKind::Kv);
    }
    Ok(freed)
}

/// Takes frames from cached pages ([`frame_victims`]: their window rows; the pages and
/// their other pools stay cached, a later hit ends before them) until `want` frames are
/// free. Returns how many were taken.
pub(crate) fn strip_frames<B: Backend>(sh: &Shared<B>, st: &mut State, want: usize) -> usize {
    let Some((free, _)) = st.device.frames() else {
        return 0;
    };
    let read = window_read(st, sh.device.spec());
    let victims: Vec<PageRef> = st
        .tree
        .lru(|id, n| frame_victim(st, &read, id, n))
        .into_iter()
        .filter_map(|v| Some(st.tree.get(v)?.device?.page))
        .collect();
    let mut taken = 0;
    for page in victims.into_iter().take(want.saturating_sub(free)) {
        if give_back(sh, st, page).unwrap_or(false) {
            taken += 1;
        }
    }
    st.stats.window_released += taken as u64;
    taken
}

/// See [`super::HiCache::release_window`]; returns the frames that went back to the free
/// list (those handed on to the request's own later pages are not counted).
pub(crate) fn release_window<B: Backend>(
    sh: &Shared<B>,
    st: &mut State,
    req: RequestId,
    pages: &[PageRef],
    from: usize,
    tokens: usize,
) -> Result<usize> {
    let spec = sh.device.spec();
    let r = st.requests.get(&req).ok_or_else(|| not_live(req))?;
    if r.users > 0 {
        return Err(invalid(
            "release_window",
            format!("request {req} is in a live step"),
        ));
    }
    if r.inbound.is_some() {
        // A transfer may still write its pages: nothing goes now (a later call releases).
        return Ok(0);
    }
    let passed = spec.window_passed(tokens).min(pages.len());
    let own: Vec<PageRef> = pages
        .get(from.min(passed)..passed)
        .unwrap_or_default()
        .iter()
        .filter(|p| r.own.contains(p))
        .copied()
        .collect();
    // Pages reserved past the tokens stored and given no frame yet (see
    // `HiCache::try_alloc_framed`): each takes one of the frames given back here.
    let ps = spec.page_size().max(1);
    let waiting: Vec<PageRef> = pages
        .iter()
        .skip(tokens / ps)
        .filter(|p| r.own.contains(p) && st.device.frame(p.id).is_none())
        .copied()
        .collect();
    let mut released = 0;
    for p in own {
        if give_back(sh, st, p)? {
            released += 1;
        }
    }
    let mut handed = 0;
    for p in waiting.into_iter().take(released) {
        if st.device.attach_frame(p) {
            handed += 1;
        }
    }
    st.stats.window_released += released as u64;
    let released = released - handed.min(released);
    if released > 0 {
        sh.space_cv.notify_all();
    }
    Ok(released)
}
