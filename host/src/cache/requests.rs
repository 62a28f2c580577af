//! A request entering and leaving the cache: registering it on its matched path (sharing
//! loads in flight, starting one for host-only pages) and ending it (cancelling loads only
//! it waited for, releasing its pages).

use std::sync::Arc;

use super::alloc::PageRef;
use super::faults::Fault;
use super::fence::Fence;
use super::io;
use super::pool::BufferKind;
use super::radix::{DevicePage, NodeId};
use super::state::{Job, LoadPage, LoadRec, Req, Shared, State};
use super::types::{Prefix, RequestId};
use crate::backend::Backend;
use crate::error::Error;
use crate::sync::{AtomicBool, Ordering};

/// Registers `req` with its (locked) `path`, sharing loads in flight and starting one for
/// `missing` (room for it was made by the caller).
pub(crate) fn start_request<B: Backend>(
    sh: &Shared<B>,
    st: &mut State,
    req: RequestId,
    path: Vec<NodeId>,
    missing: &[NodeId],
) -> Prefix {
    let mut loads: Vec<u64> = Vec::new();
    let mut shared_pages = 0;
    for &n in &path {
        if let Some(j) = st.tree.get(n).and_then(|n| n.device).and_then(|d| d.load) {
            shared_pages += 1;
            if !loads.contains(&j) {
                loads.push(j);
            }
        }
    }
    let mut fences: Vec<Arc<Fence>> = Vec::new();
    for j in &loads {
        if let Some(rec) = st.loads.get_mut(j) {
            rec.dependents += 1;
            fences.push(rec.fence.clone());
        }
    }
    let mut path = path;
    let mut loaded = 0;
    if !missing.is_empty() {
        let (job, fence, n) = start_load(sh, st, missing);
        loads.push(job);
        fences.push(fence);
        loaded = n;
    }
    // Every node of the prefix has a device page now (room was made for the loads); were
    // one left without, the prefix would end before it.
    if let Some(cut) = path
        .iter()
        .position(|&n| st.tree.get(n).is_none_or(|n| n.device.is_none()))
    {
        let rest = path.split_off(cut);
        st.tree.unlock(&rest);
    }
    let pages: Vec<PageRef> = path
        .iter()
        .filter_map(|&n| st.tree.get(n).and_then(|n| n.device).map(|d| d.page))
        .collect();
    st.stats.hits_host_pages += loaded as u64;
    st.stats.hits_in_flight_pages += shared_pages as u64;
    st.stats.hits_device_pages += pages.len().saturating_sub(loaded + shared_pages) as u64;
    st.requests.insert(
        req,
        Req {
            path: path.clone(),
            own: Vec::new(),
            loads,
            fences,
            received: Vec::new(),
            inbound: None,
            users: 0,
            aborted: Arc::new(AtomicBool::new(false)),
        },
    );
    Prefix {
        tokens: path.len() * sh.device.spec().page_size(),
        pages,
        loaded_pages: loaded,
        shared_in_flight_pages: shared_pages,
    }
}

/// Creates and queues a load of `nodes` (host-only, locked by the caller's path) into fresh
/// device pages; the job locks the nodes and pins both pages of every one. Returns the
/// job, its fence and the number of pages it loads.
pub(crate) fn start_load<B: Backend>(
    sh: &Shared<B>,
    st: &mut State,
    nodes: &[NodeId],
) -> (u64, Arc<Fence>, usize) {
    let id = sh.next_id();
    let fence = Arc::new(Fence::pending(sh.num_layers()));
    let mut pages = Vec::new();
    for &node in nodes {
        let Some(copy) = st.tree.get(node).and_then(|n| n.host.clone()) else {
            continue;
        };
        // A copy without window rows loads into a page without a frame.
        let framed = super::window::host_has(&copy, BufferKind::Kv) as usize;
        let Ok(mut got) = st.device.alloc_framed(1, framed) else {
            continue;
        };
        let device = got.remove(0);
        sh.device.clear_landed(device.id);
        let _ = st.device.pin(device);
        let _ = st.host.pin(copy.page);
        if let Some(n) = st.tree.get_mut(node) {
            n.device = Some(DevicePage {
                page: device,
                load: Some(id),
            });
        }
        pages.push(LoadPage {
            node,
            host: copy.page,
            device,
            layers: copy.layers,
        });
    }
    let nodes: Vec<NodeId> = pages.iter().map(|p| p.node).collect();
    st.tree.lock(&nodes);
    let reads_at_queue =
        if sh.fault(Fault::LoadsTrailReaders) || sh.fault(Fault::IndexKAfterPublish) {
            sh.reads.lock().clone()
        } else {
            Vec::new()
        };
    st.loads.insert(
        id,
        LoadRec {
            fence: fence.clone(),
            pages,
            dependents: 1,
            cancel: Arc::new(AtomicBool::new(false)),
            queued: true,
            reads_at_queue,
        },
    );
    st.queue.push_back(Job::Load(id));
    sh.work_cv.notify_all();
    let n = nodes.len();
    (id, fence, n)
}

/// Removes `req` and releases everything it holds (see [`HiCache::abort`]).
pub(crate) fn end_request<B: Backend>(sh: &Shared<B>, st: &mut State, req: RequestId, why: &str) {
    let Some(r) = st.requests.remove(&req) else {
        return;
    };
    r.aborted.store(true, Ordering::Release);
    for j in &r.loads {
        let cancel = match st.loads.get_mut(j) {
            Some(rec) => {
                rec.dependents = rec.dependents.saturating_sub(1);
                rec.dependents == 0
            }
            None => false,
        };
        if cancel {
            io::cancel_load(sh, st, *j, why);
        }
    }
    if let Some((_, f)) = &r.inbound {
        f.fail(Error::Cancelled(format!("inbound transfer: {why}")));
    }
    st.tree.unlock(&r.path);
    if sh.fault(Fault::LateWrite) {
        sh.late.lock().orphan(&r.own);
    }
    for p in r.own {
        let _ = st.device.release(p);
    }
    sh.space_cv.notify_all();
}
