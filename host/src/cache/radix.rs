//! The prefix cache's radix tree over page-granular token prefixes.
//!
//! Each node below the root stands for one full page of tokens following its parent's
//! prefix, and may hold that page in the device tier, in the host tier, or both. Nodes are
//! locked by live requests (a locked node is never evicted) and carry a last-use tick for
//! LRU. The tree is pure bookkeeping: page contents move in [`super::HiCache`].

use std::collections::HashMap;

use super::alloc::PageRef;

/// A node handle: slab slot plus the slot's generation, so a handle to a removed node
/// never aliases a newer node in the same slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId {
    slot: u32,
    gen: u32,
}

/// A page's copy in the host tier with the checksums recorded at backup, one per layer and
/// buffer kind (`[layer][kind]`, kinds in `BufferKind::ALL` order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostCopy {
    pub page: PageRef,
    pub checksums: Vec<[u64; 2]>,
}

#[derive(Clone, Debug)]
struct Node {
    gen: u32,
    parent: Option<NodeId>,
    key: Vec<u32>,
    children: HashMap<Vec<u32>, NodeId>,
    device: Option<PageRef>,
    host: Option<HostCopy>,
    locks: u32,
    last_use: u64,
}

/// The tree.
#[derive(Clone, Debug)]
pub struct RadixTree {
    page_size: usize,
    nodes: Vec<Option<Node>>,
    /// Generation the next node placed in each slot gets.
    slot_gen: Vec<u32>,
    free_slots: Vec<u32>,
    clock: u64,
}

const ROOT: NodeId = NodeId { slot: 0, gen: 0 };

impl RadixTree {
    /// An empty tree over pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        RadixTree {
            page_size,
            nodes: vec![Some(Node {
                gen: 0,
                parent: None,
                key: Vec::new(),
                children: HashMap::new(),
                device: None,
                host: None,
                locks: 0,
                last_use: 0,
            })],
            slot_gen: vec![1],
            free_slots: Vec::new(),
            clock: 0,
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    fn get(&self, id: NodeId) -> Option<&Node> {
        match self.nodes.get(id.slot as usize) {
            Some(Some(n)) if n.gen == id.gen => Some(n),
            _ => None,
        }
    }

    fn get_mut(&mut self, id: NodeId) -> Option<&mut Node> {
        match self.nodes.get_mut(id.slot as usize) {
            Some(Some(n)) if n.gen == id.gen => Some(n),
            _ => None,
        }
    }

    /// A node reached by walking the tree (children, parents, `live`): always present.
    fn node(&self, id: NodeId) -> &Node {
        match self.get(id) {
            Some(n) => n,
            None => unreachable!("radix tree link to a removed node {id:?}"),
        }
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        match self.get_mut(id) {
            Some(n) => n,
            None => unreachable!("radix tree link to a removed node {id:?}"),
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The longest cached prefix of `tokens` in whole pages whose every node still holds
    /// its page in some tier; touches the nodes (LRU).
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Vec<NodeId> {
        let now = self.tick();
        let mut path = Vec::new();
        let mut cur = ROOT;
        for key in tokens.chunks_exact(self.page_size) {
            let Some(&next) = self.node(cur).children.get(key) else {
                break;
            };
            let n = self.node(next);
            if n.device.is_none() && n.host.is_none() {
                break;
            }
            path.push(next);
            cur = next;
        }
        for &id in &path {
            self.node_mut(id).last_use = now;
        }
        path
    }

    /// Adds the full pages of `tokens` below the root, given the device page holding each
    /// (`pages[i]` holds page `i`). Pages for which a node already holds a device page are
    /// returned (the caller frees them: the cache keeps its own copy); pages adopted by new
    /// or device-less nodes are owned by the tree from now on. Returns the path and the
    /// duplicates.
    pub fn insert(&mut self, tokens: &[u32], pages: &[PageRef]) -> (Vec<NodeId>, Vec<PageRef>) {
        let now = self.tick();
        let mut path = Vec::new();
        let mut dup = Vec::new();
        let mut cur = ROOT;
        for (key, &page) in tokens.chunks_exact(self.page_size).zip(pages) {
            let next = match self.node(cur).children.get(key) {
                Some(&n) => n,
                None => {
                    let id = self.alloc_node(Node {
                        gen: 0,
                        parent: Some(cur),
                        key: key.to_vec(),
                        children: HashMap::new(),
                        device: None,
                        host: None,
                        locks: 0,
                        last_use: now,
                    });
                    self.node_mut(cur).children.insert(key.to_vec(), id);
                    id
                }
            };
            let n = self.node_mut(next);
            n.last_use = now;
            if n.device.is_none() {
                n.device = Some(page);
            } else {
                dup.push(page);
            }
            path.push(next);
            cur = next;
        }
        (path, dup)
    }

    fn alloc_node(&mut self, mut n: Node) -> NodeId {
        let slot = match self.free_slots.pop() {
            Some(i) => i,
            None => {
                self.nodes.push(None);
                self.slot_gen.push(0);
                self.nodes.len() as u32 - 1
            }
        };
        let gen = self.slot_gen[slot as usize];
        self.slot_gen[slot as usize] = gen.wrapping_add(1);
        n.gen = gen;
        self.nodes[slot as usize] = Some(n);
        NodeId { slot, gen }
    }

    /// Locks every node of `path` (a live request or a load uses them). Removed nodes
    /// are skipped.
    pub fn lock(&mut self, path: &[NodeId]) {
        for &id in path {
            if let Some(n) = self.get_mut(id) {
                n.locks += 1;
            }
        }
    }

    /// Undoes [`RadixTree::lock`]; removed nodes are skipped.
    pub fn unlock(&mut self, path: &[NodeId]) {
        for &id in path {
            if let Some(n) = self.get_mut(id) {
                n.locks = n.locks.saturating_sub(1);
            }
        }
    }

    /// The node's device page (`None` if it has none or was removed).
    pub fn device_page(&self, id: NodeId) -> Option<PageRef> {
        self.get(id).and_then(|n| n.device)
    }

    /// The node's host copy (`None` if it has none or was removed).
    pub fn host_copy(&self, id: NodeId) -> Option<&HostCopy> {
        self.get(id).and_then(|n| n.host.as_ref())
    }

    /// Sets the node's device page (no-op on a removed node).
    pub fn set_device(&mut self, id: NodeId, page: Option<PageRef>) {
        if let Some(n) = self.get_mut(id) {
            n.device = page;
        }
    }

    /// Sets the node's host copy (no-op on a removed node).
    pub fn set_host(&mut self, id: NodeId, copy: Option<HostCopy>) {
        if let Some(n) = self.get_mut(id) {
            n.host = copy;
        }
    }

    /// Whether a live request or load holds the node.
    pub fn is_locked(&self, id: NodeId) -> bool {
        self.get(id).is_some_and(|n| n.locks > 0)
    }

    /// Nodes whose device page may leave the device tier, least recently used first:
    /// unlocked, holding a device page, and no child holds a device page (so device-tier
    /// prefixes stay contiguous from the root).
    pub fn device_victims(&self) -> Vec<NodeId> {
        let mut v: Vec<(u64, NodeId)> = self
            .live()
            .filter(|&(_, n)| {
                n.locks == 0
                    && n.device.is_some()
                    && n.children.values().all(|&c| self.node(c).device.is_none())
            })
            .map(|(id, n)| (n.last_use, id))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, id)| id).collect()
    }

    /// Nodes that may leave the cache entirely, least recently used first: unlocked
    /// leaves holding only a host copy.
    pub fn host_victims(&self) -> Vec<NodeId> {
        let mut v: Vec<(u64, NodeId)> = self
            .live()
            .filter(|&(_, n)| {
                n.locks == 0 && n.device.is_none() && n.host.is_some() && n.children.is_empty()
            })
            .map(|(id, n)| (n.last_use, id))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, id)| id).collect()
    }

    /// Removes a leaf (or an empty node) and returns what it held. Fails (returns `None`)
    /// for the root or a node with children.
    pub fn remove_leaf(&mut self, id: NodeId) -> Option<(Option<PageRef>, Option<HostCopy>)> {
        if id == ROOT || !self.get(id)?.children.is_empty() {
            return None;
        }
        let n = self.nodes.get_mut(id.slot as usize)?.take()?;
        if let Some(p) = n.parent {
            self.node_mut(p).children.remove(&n.key);
        }
        self.free_slots.push(id.slot);
        Some((n.device, n.host))
    }

    /// Removes `id` and its whole subtree, returning every page they held. Locked nodes are
    /// removed too (their users' loads fail instead).
    pub fn remove_subtree(&mut self, id: NodeId) -> Vec<(Option<PageRef>, Option<HostCopy>)> {
        if id == ROOT || self.get(id).is_none() {
            return Vec::new();
        }
        // Pre-order, then remove children before parents.
        let mut order = Vec::new();
        let mut stack = vec![id];
        while let Some(x) = stack.pop() {
            order.push(x);
            stack.extend(self.node(x).children.values().copied());
        }
        order
            .into_iter()
            .rev()
            .filter_map(|x| self.remove_leaf(x))
            .collect()
    }

    /// Whether `id` is still in the tree.
    pub fn contains(&self, id: NodeId) -> bool {
        self.get(id).is_some()
    }

    fn live(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.nodes.iter().enumerate().skip(1).filter_map(|(i, n)| {
            n.as_ref().map(|n| {
                (
                    NodeId {
                        slot: i as u32,
                        gen: n.gen,
                    },
                    n,
                )
            })
        })
    }

    /// Every device page held by the tree.
    pub fn device_pages(&self) -> Vec<PageRef> {
        self.live().filter_map(|(_, n)| n.device).collect()
    }

    /// Every host page held by the tree.
    pub fn host_pages(&self) -> Vec<PageRef> {
        self.live()
            .filter_map(|(_, n)| n.host.as_ref().map(|h| h.page))
            .collect()
    }

    /// Nodes in the tree (root excluded).
    pub fn len(&self) -> usize {
        self.live().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: u32) -> PageRef {
        PageRef { id, generation: 0 }
    }

    #[test]
    fn insert_match_evict() {
        let mut t = RadixTree::new(2);
        let (path, dup) = t.insert(&[1, 2, 3, 4, 5], &[p(0), p(1)]);
        assert_eq!(path.len(), 2);
        assert!(dup.is_empty());
        assert_eq!(t.match_prefix(&[1, 2, 3, 4, 9, 9]).len(), 2);
        assert_eq!(t.match_prefix(&[1, 2, 3, 9]).len(), 1);
        assert_eq!(t.match_prefix(&[2, 2]).len(), 0);
        // A second request with the same first page: its copy is a duplicate.
        let (path2, dup) = t.insert(&[1, 2, 7, 7], &[p(5), p(6)]);
        assert_eq!(dup, vec![p(5)]);
        assert_eq!(path2[0], path[0]);
        // Only leaves of the device tree are device victims; locked nodes never.
        t.lock(&path2);
        let v = t.device_victims();
        assert_eq!(v, vec![path[1]]);
        t.unlock(&path2);
        assert_eq!(t.device_victims().len(), 2);
        // Move the leaf to host: it becomes a host victim once its device page is gone.
        t.set_device(path[1], None);
        t.set_host(
            path[1],
            Some(HostCopy {
                page: p(0),
                checksums: vec![],
            }),
        );
        assert_eq!(t.host_victims(), vec![path[1]]);
        assert_eq!(
            t.match_prefix(&[1, 2, 3, 4]).len(),
            2,
            "host-only nodes still match"
        );
        let (d, h) = t.remove_leaf(path[1]).unwrap();
        assert!(d.is_none() && h.is_some());
        assert!(t.remove_leaf(path[0]).is_none(), "has a child");
        let all = t.remove_subtree(path[0]);
        assert_eq!(all.len(), 2);
        assert!(t.is_empty());
        // Handles of removed nodes are inert, even when their slot is reused.
        let (fresh, _) = t.insert(&[8, 8], &[p(9)]);
        assert!(!t.contains(path[0]) && t.contains(fresh[0]));
        t.lock(&path);
        assert!(!t.is_locked(fresh[0]));
        assert_eq!(t.device_page(path[0]), None);
    }
}
