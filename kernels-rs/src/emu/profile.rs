//! Access tracing for the performance model: what a profiler would measure about a
//! kernel's memory accesses, computed from an emulated run.
//!
//! Every global ([`Simt::gld`](crate::Simt::gld), `gst`, `atomic_add_u32`) and shared
//! (`smem_load`, `smem_store`, `smem_atomic_add_u32`) access of a traced launch is recorded
//! with its static instruction — the call site (`#[track_caller]`) and, inside the
//! kernels' forced unrolls, the unrolled copy (the iteration indices of the enclosing
//! `unroll!`s) — and the lanes of a warp that executed the same static instruction for the
//! same time since their last warp collective or barrier form one *warp-level
//! instruction*, as on the GPU. (A lane predicated off in one unrolled copy, or leaving a
//! loop early, thus never shifts the others' grouping.) Per instruction:
//!
//! - **global**: requested bytes (Σ lanes × width), the distinct 32-byte sectors touched,
//!   and the useful bytes `min(requested, 32 · sectors)` (a broadcast counts once); the
//!   load (store) efficiency of a kernel is Σ useful / Σ 32 · sectors;
//! - **shared**: the bank conflict degree. A warp access is served in phases (all 32
//!   lanes for accesses up to 4 bytes, half-warps for 8 bytes, quarter-warps for 16), each
//!   phase in as many wavefronts as the largest number of distinct 4-byte words any one
//!   of the 32 banks holds among the phase's lanes (same word = broadcast). Ways = Σ
//!   wavefronts / Σ phases (1.0: conflict-free);
//! - the active lanes (of 32), for the divergence of the accessing code.
//!
//! Per block the profile also counts barriers and the warp-level collectives (`mma`,
//! shuffles, ballots). Everything is deterministic: grouping depends only on each lane's
//! own sequence of accesses, never on how the emulator interleaved the threads.

use std::collections::{HashMap, HashSet};
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::global::GlobalOp;
use super::pool::lock;

/// Memory space of an access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Space {
    Global,
    Shared,
}

/// One access of one lane.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Event {
    /// Call site (address of its `Location`).
    site: usize,
    /// The unrolled copy (a code of the enclosing `unroll!` iteration indices).
    copy: u64,
    /// Warp collectives and barriers the lane had executed before the access.
    sync: u32,
    /// Which execution of the static instruction by this lane since then (0, 1, ...).
    occ: u32,
    /// Warp within the block.
    warp: u32,
    lane: u32,
    space: Space,
    op: GlobalOp,
    size: u32,
    addr: u64,
}

/// One GPU thread's trace (kept in its context while it runs).
#[derive(Debug, Default)]
pub(crate) struct ThreadTrace {
    /// Executions of each static instruction since the last sync.
    occ: HashMap<(usize, u64), u32>,
    events: Vec<Event>,
    sites: HashMap<usize, &'static Location<'static>>,
    /// Syncs (warp collectives, barriers) executed so far.
    sync: u32,
    /// Iteration indices of the enclosing `unroll!`s, innermost last.
    unroll: Vec<u32>,
}

impl ThreadTrace {
    /// The lane executed a warp collective or a barrier: the lanes of its warp are in step
    /// again.
    pub(crate) fn sync(&mut self) {
        self.sync += 1;
        self.occ.clear();
    }

    /// Enters iteration `i` of a forced unroll.
    pub(crate) fn unroll_enter(&mut self, i: u32) {
        self.unroll.push(i);
    }

    /// Leaves the innermost forced unroll iteration.
    pub(crate) fn unroll_exit(&mut self) {
        self.unroll.pop();
    }

    /// Records an access by `thread` at `loc`.
    pub(crate) fn record(
        &mut self,
        loc: &'static Location<'static>,
        thread: u32,
        space: Space,
        op: GlobalOp,
        addr: u64,
        size: usize,
    ) {
        let site = loc as *const Location<'static> as usize;
        let copy = self.unroll.iter().fold(0u64, |c, &i| {
            c.wrapping_mul(0x9E37_79B9).wrapping_add(u64::from(i) + 1)
        });
        let occ = self.occ.entry((site, copy)).or_insert(0);
        self.events.push(Event {
            site,
            copy,
            sync: self.sync,
            occ: *occ,
            warp: thread / 32,
            lane: thread % 32,
            space,
            op,
            size: size as u32,
            addr,
        });
        *occ += 1;
        self.sites.entry(site).or_insert(loc);
    }
}

/// Statistics of one call site over the traced blocks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SiteProfile {
    /// `file:line:column` of the access in the kernel source.
    pub location: String,
    pub space: Option<Space>,
    pub op: Option<GlobalOp>,
    /// Warp-level instructions.
    pub instructions: u64,
    /// Σ active lanes over the instructions.
    pub lanes: u64,
    /// Σ lanes × access width, bytes.
    pub bytes: u64,
    /// Global: Σ min(requested, 32 · sectors) per instruction, bytes.
    pub useful_bytes: u64,
    /// Global: distinct 32-byte sectors per instruction, summed.
    pub sectors: u64,
    /// Shared: wavefronts (Σ over phases of the worst bank's distinct words).
    pub wavefronts: u64,
    /// Shared: phases with at least one lane (the conflict-free wavefront count).
    pub phases: u64,
    /// Instructions by access width: 1, 2, 4, 8, 16 bytes.
    pub widths: [u64; 5],
}

impl SiteProfile {
    /// Bytes requested per byte of sectors moved (global; capped per instruction at 1).
    pub fn efficiency(&self) -> Option<f64> {
        (self.sectors > 0).then(|| self.useful_bytes as f64 / (32 * self.sectors) as f64)
    }
    /// Average shared-memory bank conflict degree (1.0: none).
    pub fn ways(&self) -> Option<f64> {
        (self.phases > 0).then(|| self.wavefronts as f64 / self.phases as f64)
    }
    /// Active lanes per instruction, as a fraction of 32.
    pub fn active_lanes(&self) -> Option<f64> {
        (self.instructions > 0).then(|| self.lanes as f64 / (32 * self.instructions) as f64)
    }
    fn add(&mut self, o: &SiteProfile) {
        self.instructions += o.instructions;
        self.lanes += o.lanes;
        self.bytes += o.bytes;
        self.useful_bytes += o.useful_bytes;
        self.sectors += o.sectors;
        self.wavefronts += o.wavefronts;
        self.phases += o.phases;
        for (a, b) in self.widths.iter_mut().zip(o.widths) {
            *a += b;
        }
    }
}

/// What a traced launch measured (over the blocks it ran).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    /// The kernel's name (from its registered buffers, or `kernel`).
    pub kernel: String,
    /// The launch's grid (blocks), block (threads) and dynamic shared memory (bytes).
    pub grid: u32,
    pub block: u32,
    pub smem_bytes: usize,
    /// Blocks emulated (all of the grid, or a sample).
    pub blocks_run: u32,
    /// Per call site, sorted by space, op and location.
    pub sites: Vec<SiteProfile>,
    /// Completed `sync_threads` (block-wide barriers) over the blocks run.
    pub barriers: u64,
    /// Warp-level `mma.sync` m16n8k16 bf16, m16n8k32 e4m3 and block-scaled m16n8k32
    /// MXFP8 (e4m3 × e4m3, ue8m0 scales) instructions.
    pub mma_bf16: u64,
    pub mma_e4m3: u64,
    pub mma_mxf8: u64,
    /// Warp-level shuffles and ballots.
    pub shuffles: u64,
    pub ballots: u64,
    /// Distinct 32-byte sectors the blocks run loaded (and stored, atomics included),
    /// counted once however often they were touched: the DRAM traffic if every reuse
    /// hits in cache, bytes.
    pub unique_load_bytes: u64,
    pub unique_store_bytes: u64,
}

impl Profile {
    /// The sum of the sites of `space` doing `op` (`None`: any op).
    pub fn total(&self, space: Space, op: Option<GlobalOp>) -> SiteProfile {
        let mut t = SiteProfile {
            location: "total".into(),
            space: Some(space),
            op,
            ..SiteProfile::default()
        };
        for s in &self.sites {
            if s.space == Some(space) && (op.is_none() || s.op == op) {
                t.add(s);
            }
        }
        t
    }

    /// Active lanes per traced memory instruction (both spaces), as a fraction of 32.
    pub fn active_lanes(&self) -> Option<f64> {
        let (lanes, inst) = self
            .sites
            .iter()
            .fold((0, 0), |(l, i), s| (l + s.lanes, i + s.instructions));
        (inst > 0).then(|| lanes as f64 / (32 * inst) as f64)
    }

    /// Barriers per block run.
    pub fn barriers_per_block(&self) -> f64 {
        self.barriers as f64 / self.blocks_run.max(1) as f64
    }
}

/// The tracing state of a launch.
#[derive(Debug, Default)]
pub(crate) struct Tracer {
    /// Events of the block being run (threads hand theirs in when they finish).
    events: Mutex<Vec<Event>>,
    /// Sites seen.
    locations: Mutex<HashMap<usize, &'static Location<'static>>>,
    /// Accumulated per site (key: space, op, site), and the distinct global sectors
    /// loaded and stored.
    acc: Mutex<Acc>,
    pub(crate) barriers: AtomicU64,
    pub(crate) mma_bf16: AtomicU64,
    pub(crate) mma_e4m3: AtomicU64,
    pub(crate) mma_mxf8: AtomicU64,
    pub(crate) shuffles: AtomicU64,
    pub(crate) ballots: AtomicU64,
    blocks: AtomicU64,
}

/// What [`Tracer::finish_block`] accumulates.
#[derive(Debug, Default)]
struct Acc {
    sites: HashMap<(Space, u8, usize), SiteProfile>,
    /// Distinct sectors loaded (`[0]`) and stored or updated atomically (`[1]`).
    unique: [HashSet<u64>; 2],
}

fn op_code(op: GlobalOp) -> u8 {
    match op {
        GlobalOp::Load => 0,
        GlobalOp::Store => 1,
        GlobalOp::Atomic => 2,
    }
}

impl Tracer {
    /// A finished thread hands in its trace.
    pub(crate) fn hand_in(&self, t: ThreadTrace) {
        lock(&self.events).extend(t.events);
        let mut l = lock(&self.locations);
        for (k, v) in t.sites {
            l.entry(k).or_insert(v);
        }
    }

    /// The block being run has finished: group its events into warp-level instructions.
    pub(crate) fn finish_block(&self) {
        let mut events = std::mem::take(&mut *lock(&self.events));
        self.blocks.fetch_add(1, Ordering::Relaxed);
        events.sort_unstable_by_key(|e| {
            (
                e.warp,
                e.sync,
                e.site,
                e.copy,
                e.occ,
                op_code(e.op),
                e.space,
                e.lane,
            )
        });
        let mut acc = lock(&self.acc);
        let mut i = 0;
        while i < events.len() {
            let e = events[i];
            let mut j = i + 1;
            while j < events.len() {
                let f = &events[j];
                if (f.warp, f.sync, f.site, f.copy, f.occ, f.op, f.space)
                    != (e.warp, e.sync, e.site, e.copy, e.occ, e.op, e.space)
                {
                    break;
                }
                j += 1;
            }
            let group = &events[i..j];
            if e.space == Space::Global {
                let set = &mut acc.unique[usize::from(e.op != GlobalOp::Load)];
                for f in group {
                    for sec in f.addr / 32..=(f.addr + f.size as u64 - 1) / 32 {
                        set.insert(sec);
                    }
                }
            }
            let s = acc
                .sites
                .entry((e.space, op_code(e.op), e.site))
                .or_insert_with(|| SiteProfile {
                    space: Some(e.space),
                    op: Some(e.op),
                    ..SiteProfile::default()
                });
            instruction(s, group);
            i = j;
        }
    }

    /// The profile of the launch.
    pub(crate) fn profile(&self, kernel: &str, grid: u32, block: u32, smem: usize) -> Profile {
        let locs = lock(&self.locations);
        let acc = lock(&self.acc);
        let mut sites: Vec<SiteProfile> = acc
            .sites
            .iter()
            .map(|(&(_, _, site), s)| {
                let mut s = s.clone();
                s.location = locs.get(&site).map_or_else(
                    || "?".to_string(),
                    |l| format!("{}:{}:{}", l.file(), l.line(), l.column()),
                );
                s
            })
            .collect();
        // Two sites may share a location (one source access inlined into two callers):
        // their figures order them, so that the order is the same on every run.
        let key = |s: &SiteProfile| {
            (
                s.space,
                s.op.map(op_code),
                s.location.clone(),
                [
                    s.instructions,
                    s.lanes,
                    s.bytes,
                    s.useful_bytes,
                    s.sectors,
                    s.wavefronts,
                    s.phases,
                ],
                s.widths,
            )
        };
        sites.sort_by_cached_key(key);
        Profile {
            kernel: kernel.to_string(),
            grid,
            block,
            smem_bytes: smem,
            blocks_run: self.blocks.load(Ordering::Relaxed) as u32,
            sites,
            barriers: self.barriers.load(Ordering::Relaxed),
            mma_bf16: self.mma_bf16.load(Ordering::Relaxed),
            mma_e4m3: self.mma_e4m3.load(Ordering::Relaxed),
            mma_mxf8: self.mma_mxf8.load(Ordering::Relaxed),
            shuffles: self.shuffles.load(Ordering::Relaxed),
            ballots: self.ballots.load(Ordering::Relaxed),
            unique_load_bytes: 32 * acc.unique[0].len() as u64,
            unique_store_bytes: 32 * acc.unique[1].len() as u64,
        }
    }
}

/// Adds one warp-level instruction (the lanes' accesses, sorted by lane) to `s`.
fn instruction(s: &mut SiteProfile, group: &[Event]) {
    s.instructions += 1;
    s.lanes += group.len() as u64;
    let size = group[0].size as u64;
    let bytes: u64 = group.iter().map(|e| e.size as u64).sum();
    s.bytes += bytes;
    let w = match size {
        1 => 0,
        2 => 1,
        4 => 2,
        8 => 3,
        _ => 4,
    };
    s.widths[w] += 1;
    match group[0].space {
        Space::Global => {
            let mut sectors: Vec<u64> = Vec::with_capacity(group.len() * 2);
            for e in group {
                let end = e.addr + e.size as u64 - 1;
                for sec in e.addr / 32..=end / 32 {
                    sectors.push(sec);
                }
            }
            sectors.sort_unstable();
            sectors.dedup();
            let n = sectors.len() as u64;
            s.sectors += n;
            s.useful_bytes += bytes.min(32 * n);
        }
        Space::Shared => {
            let (wavefronts, phases) = bank_wavefronts(group);
            s.wavefronts += wavefronts;
            s.phases += phases;
        }
    }
}

/// Shared-memory wavefronts of one warp access and the number of non-empty phases.
fn bank_wavefronts(group: &[Event]) -> (u64, u64) {
    let size = group.iter().map(|e| e.size).max().unwrap_or(4);
    let lanes_per_phase = match size {
        0..=4 => 32,
        5..=8 => 16,
        _ => 8,
    };
    let (mut wavefronts, mut phases) = (0u64, 0u64);
    for phase in 0..32 / lanes_per_phase {
        let lo = phase * lanes_per_phase;
        let mut words: Vec<u64> = Vec::new();
        for e in group
            .iter()
            .filter(|e| e.lane >= lo && e.lane < lo + lanes_per_phase)
        {
            let end = e.addr + e.size.max(1) as u64 - 1;
            for w in e.addr / 4..=end / 4 {
                words.push(w);
            }
        }
        if words.is_empty() {
            continue;
        }
        words.sort_unstable();
        words.dedup();
        let mut per_bank = [0u64; 32];
        for w in words {
            per_bank[(w % 32) as usize] += 1;
        }
        phases += 1;
        wavefronts += per_bank.iter().copied().max().unwrap_or(1);
    }
    (wavefronts, phases)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic
mod tests {
    use super::*;

    fn ev(lane: u32, addr: u64, size: u32, space: Space) -> Event {
        Event {
            site: 1,
            copy: 0,
            sync: 0,
            occ: 0,
            warp: 0,
            lane,
            space,
            op: GlobalOp::Load,
            size,
            addr,
        }
    }

    #[test]
    fn bank_conflicts_by_hand() {
        let g = |f: &dyn Fn(u32) -> (u64, u32)| -> Vec<Event> {
            (0..32)
                .map(|l| {
                    let (a, s) = f(l);
                    ev(l, a, s, Space::Shared)
                })
                .collect()
        };
        // Consecutive words: conflict-free.
        assert_eq!(bank_wavefronts(&g(&|l| (4 * l as u64, 4))), (1, 1));
        // Stride of 32 words: every lane in bank 0, 32 distinct words.
        assert_eq!(bank_wavefronts(&g(&|l| (128 * l as u64, 4))), (32, 1));
        // Stride 2 words: 2-way.
        assert_eq!(bank_wavefronts(&g(&|l| (8 * l as u64, 4))), (2, 1));
        // All lanes read one word: broadcast.
        assert_eq!(bank_wavefronts(&g(&|_| (64, 4))), (1, 1));
        // 16-byte accesses, consecutive: 4 phases, conflict-free.
        assert_eq!(bank_wavefronts(&g(&|l| (16 * l as u64, 16))), (4, 4));
        // 8-byte accesses, consecutive: 2 phases.
        assert_eq!(bank_wavefronts(&g(&|l| (8 * l as u64, 8))), (2, 2));
        // Half a warp active, u16 accesses sharing words.
        let half: Vec<Event> = (0..16)
            .map(|l| ev(l, 2 * l as u64, 2, Space::Shared))
            .collect();
        assert_eq!(bank_wavefronts(&half), (1, 1));
    }

    #[test]
    fn sectors_by_hand() {
        let mut s = SiteProfile::default();
        let coalesced: Vec<Event> = (0..32)
            .map(|l| ev(l, 4 * l as u64, 4, Space::Global))
            .collect();
        instruction(&mut s, &coalesced);
        assert_eq!((s.bytes, s.sectors, s.useful_bytes), (128, 4, 128));
        let mut s = SiteProfile::default();
        let strided: Vec<Event> = (0..32)
            .map(|l| ev(l, 64 * l as u64, 4, Space::Global))
            .collect();
        instruction(&mut s, &strided);
        assert_eq!((s.bytes, s.sectors, s.useful_bytes), (128, 32, 128));
        assert_eq!(s.efficiency(), Some(0.125));
        let mut s = SiteProfile::default();
        let broadcast: Vec<Event> = (0..32).map(|l| ev(l, 8, 4, Space::Global)).collect();
        instruction(&mut s, &broadcast);
        assert_eq!((s.bytes, s.sectors, s.useful_bytes), (128, 1, 32));
        // A 16-byte access straddling two sectors.
        let mut s = SiteProfile::default();
        instruction(&mut s, &[ev(0, 24, 16, Space::Global)]);
        assert_eq!(s.sectors, 2);
    }
}
