//! The prefix cache's radix tree over page-granular token prefixes (pure bookkeeping: page
//! contents move in [`super::HiCache`]).
//!
//! Each node below the root stands for one full page of tokens following its parent's
//! prefix, and may hold that page in the device tier (ready, or with a load in flight), in
//! the host tier, or both. Nodes are locked by live requests and by the loads that fill
//! them (a locked node is never evicted) and carry a last-use tick for LRU.

use std::collections::HashMap;

use super::alloc::PageRef;

/// A node handle: slab slot plus the slot's generation, so a handle to a removed node
/// never aliases a newer node in the same slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct NodeId {
    slot: u32,
    gen: u32,
}

/// What a backup recorded of one layer of a page: the checksum of each pool the layer
/// holds, taken on the device copy (`sums[kind.index()]`; 0 for a pool the layer lacks),
/// and which pools it copied to the host tier (bit `kind.index()` of `copied`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LayerRecord {
    pub sums: [u64; super::pool::KINDS],
    pub copied: u8,
}

/// A page's copy in the host tier with what its backup recorded, one record per layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostCopy {
    pub page: PageRef,
    pub layers: Vec<LayerRecord>,
}

/// A node's device page. `load` is the id of the load job still filling it (the page must
/// not be read before that job's fence says so).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DevicePage {
    pub page: PageRef,
    pub load: Option<u64>,
}

#[derive(Clone, Debug)]
pub(crate) struct Node {
    gen: u32,
    pub parent: Option<NodeId>,
    key: Vec<u32>,
    children: HashMap<Vec<u32>, NodeId>,
    pub device: Option<DevicePage>,
    pub host: Option<HostCopy>,
    /// Id of the backup batch copying the device page to the host tier.
    pub backup: Option<u64>,
    /// Free the device page once the backup lands (an eviction is waiting for it).
    pub evict_after_backup: bool,
    /// Dropped after an integrity failure: never matched again (its pages were released
    /// where no copy was in flight) until a commit fills it afresh.
    pub discarded: bool,
    pub locks: u32,
    last_use: u64,
}

impl Node {
    fn new(parent: Option<NodeId>, key: Vec<u32>, now: u64) -> Self {
        Node {
            gen: 0,
            parent,
            key,
            children: HashMap::new(),
            device: None,
            host: None,
            backup: None,
            evict_after_backup: false,
            discarded: false,
            locks: 0,
            last_use: now,
        }
    }
}

/// The tree.
#[derive(Clone, Debug)]
pub(crate) struct RadixTree {
    page_size: usize,
    nodes: Vec<Option<Node>>,
    /// Generation the next node placed in each slot gets.
    slot_gen: Vec<u32>,
    free_slots: Vec<u32>,
    clock: u64,
}

pub(crate) const ROOT: NodeId = NodeId { slot: 0, gen: 0 };

impl RadixTree {
    /// An empty tree over pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        RadixTree {
            page_size,
            nodes: vec![Some(Node::new(None, Vec::new(), 0))],
            slot_gen: vec![1],
            free_slots: Vec::new(),
            clock: 0,
        }
    }

    pub fn get(&self, id: NodeId) -> Option<&Node> {
        match self.nodes.get(id.slot as usize) {
            Some(Some(n)) if n.gen == id.gen => Some(n),
            _ => None,
        }
    }

    pub fn get_mut(&mut self, id: NodeId) -> Option<&mut Node> {
        match self.nodes.get_mut(id.slot as usize) {
            Some(Some(n)) if n.gen == id.gen => Some(n),
            _ => None,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The child of `parent` for the page `key`.
    pub fn child(&self, parent: NodeId, key: &[u32]) -> Option<NodeId> {
        self.get(parent)?.children.get(key).copied()
    }

    /// The longest prefix of `tokens` in whole pages whose every node holds its page in
    /// some tier (device, ready or loading, or host); touches the nodes (LRU).
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Vec<NodeId> {
        let path = self.peek_prefix(tokens);
        self.touch(&path);
        path
    }

    /// [`RadixTree::match_prefix`] without touching anything.
    pub fn peek_prefix(&self, tokens: &[u32]) -> Vec<NodeId> {
        let mut path = Vec::new();
        let mut cur = ROOT;
        for key in tokens.chunks_exact(self.page_size) {
            let Some(next) = self.child(cur, key) else {
                break;
            };
            match self.get(next) {
                Some(n) if !n.discarded && (n.device.is_some() || n.host.is_some()) => {}
                _ => break,
            }
            path.push(next);
            cur = next;
        }
        path
    }

    /// Marks `nodes` used now, all with the same tick (a path touched together keeps its
    /// ancestors at least as recent as its descendants, so LRU empties it from the leaf).
    pub fn touch(&mut self, nodes: &[NodeId]) {
        let now = self.tick();
        for &id in nodes {
            if let Some(n) = self.get_mut(id) {
                n.last_use = now;
            }
        }
    }

    /// The child of `parent` for `key`, created (empty) if missing; touches it.
    pub fn child_or_insert(&mut self, parent: NodeId, key: &[u32]) -> Option<NodeId> {
        let now = self.tick();
        if let Some(c) = self.child(parent, key) {
            if let Some(n) = self.get_mut(c) {
                n.last_use = now;
            }
            return Some(c);
        }
        self.get(parent)?;
        let id = self.alloc_node(Node::new(Some(parent), key.to_vec(), now));
        self.get_mut(parent)?.children.insert(key.to_vec(), id);
        Some(id)
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

    /// Locks every node of `path` (a live request or a load uses them).
    pub fn lock(&mut self, path: &[NodeId]) {
        for &id in path {
            if let Some(n) = self.get_mut(id) {
                n.locks += 1;
            }
        }
    }

    /// Undoes [`RadixTree::lock`], then prunes nodes left holding nothing.
    pub fn unlock(&mut self, path: &[NodeId]) {
        for &id in path {
            if let Some(n) = self.get_mut(id) {
                n.locks = n.locks.saturating_sub(1);
            }
        }
        for &id in path.iter().rev() {
            self.prune(id);
        }
    }

    /// Removes `id` and then its ancestors while each is an unlocked, childless node that
    /// holds no page in either tier and has no backup in flight.
    pub fn prune(&mut self, mut id: NodeId) {
        while id != ROOT {
            let Some(n) = self.get(id) else { return };
            if n.locks > 0
                || !n.children.is_empty()
                || n.device.is_some()
                || n.host.is_some()
                || n.backup.is_some()
            {
                return;
            }
            let parent = n.parent.unwrap_or(ROOT);
            self.remove_leaf(id);
            id = parent;
        }
    }

    fn children_have_device(&self, n: &Node) -> bool {
        n.children
            .values()
            .any(|&c| self.get(c).is_some_and(|c| c.device.is_some()))
    }

    /// Whether `n`'s device page may leave the device tier: unlocked, holding a ready
    /// device page with no backup in flight.
    fn is_device_victim(n: &Node) -> bool {
        n.locks == 0 && n.device.is_some_and(|d| d.load.is_none()) && n.backup.is_none()
    }

    /// Nodes whose device page may leave the device tier ([`RadixTree::lru`] of those).
    pub fn device_victims(&self) -> Vec<NodeId> {
        self.lru(|_, n| Self::is_device_victim(n))
    }

    /// The nodes `keep` accepts, least recently used first (among equally recent ones,
    /// those without device children first, so a path empties from its leaf).
    pub fn lru(&self, keep: impl Fn(NodeId, &Node) -> bool) -> Vec<NodeId> {
        let mut v: Vec<(u64, bool, NodeId)> = self
            .live()
            .filter(|&(id, n)| keep(id, n))
            .map(|(id, n)| (n.last_use, self.children_have_device(n), id))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, _, id)| id).collect()
    }

    /// How many nodes [`RadixTree::device_victims`] would return (without sorting them).
    pub fn device_victim_count(&self) -> usize {
        self.live()
            .filter(|&(_, n)| Self::is_device_victim(n))
            .count()
    }

    /// Nodes that may leave the cache entirely, least recently used first: unlocked
    /// childless nodes holding only a host copy.
    pub fn host_victims(&self) -> Vec<NodeId> {
        let mut v: Vec<(u64, NodeId)> = self
            .live()
            .filter(|&(_, n)| {
                n.locks == 0
                    && n.device.is_none()
                    && n.backup.is_none()
                    && n.host.is_some()
                    && n.children.is_empty()
            })
            .map(|(id, n)| (n.last_use, id))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, id)| id).collect()
    }

    /// Removes a childless node and returns it. `None` for the root, a node with children
    /// or a removed node.
    pub fn remove_leaf(&mut self, id: NodeId) -> Option<Node> {
        if id == ROOT || !self.get(id)?.children.is_empty() {
            return None;
        }
        let n = self.nodes.get_mut(id.slot as usize)?.take()?;
        if let Some(p) = n.parent.and_then(|p| self.get_mut(p)) {
            p.children.remove(&n.key);
        }
        self.free_slots.push(id.slot);
        Some(n)
    }

    /// Whether `id` is still in the tree.
    #[cfg(test)]
    pub fn contains(&self, id: NodeId) -> bool {
        self.get(id).is_some()
    }

    /// Every node but the root.
    pub fn live(&self) -> impl Iterator<Item = (NodeId, &Node)> {
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

    /// Nodes in the tree (root excluded).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.live().count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: u32) -> PageRef {
        PageRef { id, generation: 0 }
    }

    fn insert(t: &mut RadixTree, tokens: &[u32], pages: &[PageRef]) -> Vec<NodeId> {
        let mut cur = ROOT;
        let mut path = Vec::new();
        for (key, &page) in tokens.chunks_exact(2).zip(pages) {
            cur = t.child_or_insert(cur, key).unwrap();
            let n = t.get_mut(cur).unwrap();
            if n.device.is_none() {
                n.device = Some(DevicePage { page, load: None });
            }
            path.push(cur);
        }
        path
    }

    #[test]
    fn match_victims_prune() {
        let mut t = RadixTree::new(2);
        let path = insert(&mut t, &[1, 2, 3, 4, 5], &[p(0), p(1)]);
        assert_eq!(path.len(), 2);
        assert_eq!(t.match_prefix(&[1, 2, 3, 4, 9, 9]).len(), 2);
        assert_eq!(t.match_prefix(&[1, 2, 3, 9]).len(), 1);
        assert_eq!(t.match_prefix(&[2, 2]).len(), 0);
        let path2 = insert(&mut t, &[1, 2, 7, 7], &[p(5), p(6)]);
        assert_eq!(path2[0], path[0]);
        // Locked nodes are never victims; leaves go before their parents.
        t.lock(&path2);
        assert_eq!(t.device_victims(), vec![path[1]]);
        t.unlock(&path2);
        // Least recently used first: path[1], then path[0] (touched on the way to
        // path2[1], which was created after it).
        assert_eq!(t.device_victims(), vec![path[1], path[0], path2[1]]);
        // A loading page is no victim.
        t.get_mut(path[1]).unwrap().device = Some(DevicePage {
            page: p(1),
            load: Some(3),
        });
        assert_eq!(t.device_victims(), vec![path[0], path2[1]]);
        // Host-only leaves are host victims and still match.
        t.get_mut(path[1]).unwrap().device = None;
        t.get_mut(path[1]).unwrap().host = Some(HostCopy {
            page: p(0),
            layers: vec![],
        });
        assert_eq!(t.host_victims(), vec![path[1]]);
        assert_eq!(t.match_prefix(&[1, 2, 3, 4]).len(), 2);
        // A node holding nothing stops matching, and is pruned once unlocked.
        t.get_mut(path[1]).unwrap().host = None;
        assert_eq!(t.match_prefix(&[1, 2, 3, 4]).len(), 1);
        t.lock(&[path[1]]);
        t.prune(path[1]);
        assert!(t.contains(path[1]), "locked nodes stay");
        t.unlock(&[path[1]]);
        assert!(!t.contains(path[1]));
        assert!(t.remove_leaf(path[0]).is_none(), "has a child");
        // Handles of removed nodes are inert, even when their slot is reused.
        let fresh = insert(&mut t, &[8, 8], &[p(9)]);
        assert!(t.contains(fresh[0]));
        t.lock(&path);
        assert_eq!(t.get(fresh[0]).unwrap().locks, 0);
        assert_eq!(t.len(), 3);
    }
}
