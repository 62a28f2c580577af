//! `topk` on the GPU: an exact radix select, one block per row (or per chunk of a long
//! row), grid-stride over the work.
//!
//! A row longer than [`topk_chunk`] positions is cut into chunks of that many: one block
//! finds the exact top-`k'` (`k' = min(k, chunk)`) of each chunk and stores them as
//! candidates (keys and positions, in position order, padded with invalid keys to `k'`);
//! the last block of the row to finish (a counter, with fences) runs the same selection
//! over the row's candidates and writes the output. Every entry of the row's top-k is in
//! its chunk's top-`k'` (the order — key, then lower position — is total), so the result
//! is the same set in the same order as one block over the whole row: exact and
//! independent of the batch and of the split (the chunk size depends on `k` only).
//!
//! Every logit maps to an order-preserving u32 key ([`key_of`]: `-0.0` folded into
//! `+0.0`, so the two tie); `-inf` and NaN map to [`INVALID`] (0), below every valid key
//! (valid keys are at least `0x0080_0000`). The k-th largest key `T` is found in up to
//! three histogram passes over the row's `[start, end)`:
//!
//! 1. a histogram of the top 11 key bits (2048 bins) over all valid entries;
//! 2. a histogram of bits 20..10 over the entries whose top 11 bits equal the bin found;
//! 3. a histogram of bits 9..0 over the entries whose top 22 bits equal the prefix found.
//!
//! After each pass a block-wide suffix scan of the bins ([`find_bin`]) finds the bin that
//! holds the `need`-th largest entry among those counted, and how many of its entries are
//! still needed. A pass whose bin is taken whole (`need` = its count) ends the search
//! early: the threshold is then a key *prefix* (`key >> shift`). The result ([`Threshold`])
//! states the selection exactly: every valid entry whose prefix is above `prefix`, plus the
//! first `need` (in position order) of the `count` entries whose prefix equals it, `k` in
//! all. A row with at most `k` positions skips the search, and one with at most `k` valid
//! entries stops after pass 1: both select every valid entry.
//!
//! Output ([`write_row`]): the row is walked in ascending tiles of `block_dim` positions,
//! one per thread. Per tile, each warp ballots "above the threshold (or equal and all
//! equal entries are taken)" and, while equal entries are being taken partially, "equal";
//! the lane prefixes are popcounts of the ballots, and a cross-warp scan of the per-warp
//! totals (packed: above-count in the low 16 bits, equal-count in the high 16) through
//! shared memory gives every thread its ordered rank: a selected position goes to
//! `written + above_before + min(equal_before, still_needed)`. The walk stops once `k`
//! entries are written; the rest of the row's output is `-1`. The output is thus in
//! ascending position order and ties go to the lower position, which makes the result
//! identical to the CPU backend's (and independent of the batch).
//!
//! Everything is exact for every input: the histograms count every entry, so any number
//! of ties at the threshold, any `k` and any row length are handled; nothing is buffered
//! per candidate.
//!
//! Shared memory (bytes, [`SMEM_BYTES`] in all):
//! - `[0, 8192)` `HIST_A`: 2048 u32 bins (passes 1 and 3);
//! - `[8192, 16384)` `HIST_B`: 2048 u32 bins (pass 2);
//! - `[16384, 16640)` `SCAN`: two buffers of 32 u32 per-warp totals for the block scans
//!   (the output walk alternates between them so that one barrier per tile suffices);
//! - `[16640, 16652)` `RESULT`: the bin found (`bin`, `need`, `count`), written by the one
//!   thread whose chunk holds it;
//! - `[16652, 16656)` `FLAG`: whether this block is the last of its row's chunks.
//!
//! Race discipline (the emulator's model): histograms are zeroed with plain stores, a
//! barrier, then updated with atomics only, a barrier, then read with plain loads; every
//! shared word written by one thread is read by others only after a barrier and rewritten
//! only after another.

use super::FULL;
use crate::global::{GlobalMut, GlobalPtr, V4};
use crate::launch::{Launch, MAX_GRID};
use crate::params::{QueryRange, TopkParams};
use crate::simt::Simt;

/// Threads per block (a multiple of 32 that divides [`BINS`]).
pub const TOPK_BLOCK: u32 = 512;
/// Bins of a histogram (11 bits).
const BINS: u32 = 2048;
/// Byte offset of the first histogram (passes 1 and 3).
const HIST_A: usize = 0;
/// Byte offset of the second histogram (pass 2).
const HIST_B: usize = HIST_A + 4 * BINS as usize;
/// Byte offset of the two 32-word buffers of per-warp totals.
const SCAN: usize = HIST_B + 4 * BINS as usize;
/// Bytes of one per-warp-totals buffer (32 warps at most).
const SCAN_BUF: usize = 4 * 32;
/// Byte offset of the bin found: `bin`, `need`, `count` (u32 each).
const RESULT: usize = SCAN + 2 * SCAN_BUF;
/// Byte offset of the last-chunk flag.
const FLAG: usize = RESULT + 12;
/// Dynamic shared memory of a block.
pub const SMEM_BYTES: u32 = (FLAG + 4) as u32;

/// Positions per chunk of a long row: `max(8192, 4k)` rounded up to a multiple of
/// `TOPK_BLOCK`. A chunk's candidates are at most a quarter of it, so the merge reads
/// at most a quarter of the row again; the size depends on `k` only.
pub fn topk_chunk(k: u32) -> u32 {
    8192u32
        .max(k.saturating_mul(4))
        .div_ceil(TOPK_BLOCK)
        .saturating_mul(TOPK_BLOCK)
}

/// Chunks of a row stride of `row_stride` (1: rows are never split).
fn max_chunks(row_stride: u32, chunk: u32) -> u32 {
    if row_stride > chunk {
        row_stride.div_ceil(chunk)
    } else {
        1
    }
}

/// Bytes of the workspace (candidates) and of the counters a launch needs (both 0 when
/// no row can be split): per row, `chunks · k'` candidate keys then as many positions
/// (u32), and one u32 counter.
pub fn topk_workspace(n_rows: u32, row_stride: u32, k: u32) -> (u64, u64) {
    let chunk = topk_chunk(k);
    let chunks = max_chunks(row_stride, chunk) as u64;
    if chunks == 1 {
        return (0, 0);
    }
    let kc = k.min(chunk) as u64;
    (4 * n_rows as u64 * 2 * chunks * kc, 4 * n_rows as u64)
}

/// The key of an invalid (`-inf` or NaN) entry; every valid key is larger.
const INVALID: u32 = 0;

/// Launch geometry: one block of `TOPK_BLOCK` threads per (row, chunk) (at most
/// [`MAX_GRID`] blocks, which stride over them), `SMEM_BYTES` of dynamic shared memory.
pub fn topk_launch(p: &TopkParams) -> Launch {
    let items = p.n_rows as u64 * max_chunks(p.row_stride, p.chunk.max(1)) as u64;
    Launch {
        grid: items.clamp(1, MAX_GRID as u64) as u32,
        block: TOPK_BLOCK,
        smem_bytes: SMEM_BYTES,
    }
}

/// Order-preserving u32 key of a logit (`-0.0` and `+0.0` equal), or [`INVALID`] for
/// `-inf` and NaN. Valid keys are at least `0x0080_0000` (the key of `f32::MIN`).
#[inline(always)]
fn key_of(x: f32) -> u32 {
    // (Comparisons with NaN are false.)
    let valid = x > f32::NEG_INFINITY;
    let b = if x == 0.0 { 0 } else { x.to_bits() };
    if !valid {
        INVALID
    } else if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The selection of a row: every valid entry with `key >> shift > prefix`, plus the first
/// `need` (in position order) of the `count` valid entries with `key >> shift == prefix`.
#[derive(Clone, Copy)]
struct Threshold {
    shift: u32,
    prefix: u32,
    need: u32,
    count: u32,
}

impl Threshold {
    /// Every valid entry (valid keys are above 0).
    const ALL: Threshold = Threshold {
        shift: 0,
        prefix: INVALID,
        need: 0,
        count: 0,
    };
}

/// What [`find_bin`] found.
#[derive(Clone, Copy)]
struct Found {
    /// The bin holding the `need`-th largest counted entry.
    bin: u32,
    /// How many entries of `bin` complete the `need` largest.
    need: u32,
    /// Entries in `bin`.
    count: u32,
    /// Entries in the histogram.
    total: u32,
}

/// This thread's place in the block (read once: each read is a special register, or a
/// thread-local in the emulator).
#[derive(Clone, Copy)]
struct Me {
    tid: u32,
    lane: u32,
    warp: u32,
    block_dim: u32,
    warps: u32,
}

/// Where a selection reads its keys.
trait Keys: Copy {
    /// The key of position `q`.
    ///
    /// # Safety
    /// `q` is inside the range the caller's contract names.
    unsafe fn key<S: Simt>(self, q: u32) -> u32;
}

/// A row of logits.
#[derive(Clone, Copy)]
struct Logits(GlobalPtr<f32>);

impl Keys for Logits {
    #[inline(always)]
    unsafe fn key<S: Simt>(self, q: u32) -> u32 {
        // SAFETY: q inside the row (caller's contract).
        key_of(unsafe { S::gld(self.0.add(q as usize)) })
    }
}

/// A row's chunk candidates: keys (invalid for padding).
#[derive(Clone, Copy)]
struct Candidates(GlobalPtr<u32>);

impl Keys for Candidates {
    #[inline(always)]
    unsafe fn key<S: Simt>(self, q: u32) -> u32 {
        // SAFETY: q < chunks · k' (caller's contract).
        unsafe { S::gld(self.0.add(q as usize)) }
    }
}

/// Where a selection's entries go, in ascending position order.
trait Sink: Copy {
    /// Output `at` is the entry at position `q` (key `key`).
    ///
    /// # Safety
    /// `at` below the sink's length, `q` a selected position.
    unsafe fn put<S: Simt>(self, at: u32, q: u32, key: u32);
    /// Output `j` holds no entry.
    ///
    /// # Safety
    /// `j` below the sink's length.
    unsafe fn pad<S: Simt>(self, j: u32);
}

/// The op's output row: positions, or slots through the page table.
#[derive(Clone, Copy)]
struct Output {
    out: GlobalMut<i32>,
    /// Where positions become slots ([`TopkParams`]' page table fields).
    slots: Slots,
    request: u32,
    /// Candidate positions (the selection runs over candidates), or `None` (over the row).
    pos: Option<GlobalPtr<u32>>,
}

/// The page table fields of [`TopkParams`] (null table: output positions).
#[derive(Clone, Copy)]
struct Slots {
    page_table: GlobalPtr<i32>,
    page_size: u32,
    max_pages: u32,
}

impl Sink for Output {
    #[inline(always)]
    unsafe fn put<S: Simt>(self, at: u32, q: u32, _key: u32) {
        let pos = match self.pos {
            None => q,
            // SAFETY: a selected candidate's position was stored with it.
            Some(pp) => unsafe { S::gld(pp.add(q as usize)) },
        };
        // SAFETY: at < k; the page table maps pos (contract of `topk`).
        unsafe {
            S::gst(
                self.out.add(at as usize),
                output_of::<S>(self.slots, self.request, pos),
            )
        };
    }
    #[inline(always)]
    unsafe fn pad<S: Simt>(self, j: u32) {
        // SAFETY: j < k.
        unsafe { S::gst(self.out.add(j as usize), -1) };
    }
}

/// A chunk's candidates: `k'` keys and positions.
#[derive(Clone, Copy)]
struct Chunk {
    keys: GlobalMut<u32>,
    pos: GlobalMut<u32>,
}

impl Sink for Chunk {
    #[inline(always)]
    unsafe fn put<S: Simt>(self, at: u32, q: u32, key: u32) {
        // SAFETY: at < k': this chunk's candidate slots.
        unsafe {
            S::gst(self.keys.add(at as usize), key);
            S::gst(self.pos.add(at as usize), q);
        }
    }
    #[inline(always)]
    unsafe fn pad<S: Simt>(self, j: u32) {
        // SAFETY: j < k'.
        unsafe { S::gst(self.keys.add(j as usize), INVALID) };
    }
}

/// Exact top-k.
///
/// # Safety
/// Launch with [`topk_launch`] (any block size that is a multiple of 32, divides 2048 and
/// is at most 1024 also works, with `SMEM_BYTES` of dynamic shared memory); every pointer
/// and size in `p` describes validated buffers (see [`TopkParams`]): `logits` holds
/// `n_rows × row_stride` f32, `rows` `n_rows` ranges with `start ≤ end ≤ row_stride <
/// 2^31`, `out` `n_rows × k` i32, and when `page_table` is not null it maps every position
/// of every row's range to a page whose slots fit in i32; `chunk` is [`topk_chunk`]`(k)`
/// (or at least `row_stride`: no split) and, when rows are split, `workspace` and
/// `counters` hold [`topk_workspace`] bytes with the counters zero.
pub unsafe fn topk<S: Simt>(p: TopkParams) {
    let tid = S::thread_idx();
    let block_dim = S::block_dim();
    let me = Me {
        tid,
        lane: tid & 31,
        warp: tid >> 5,
        block_dim,
        warps: block_dim / 32,
    };
    let chunk = p.chunk.max(1);
    let chunks = max_chunks(p.row_stride, chunk);
    let items = p.n_rows as u64 * chunks as u64;
    let mut item = S::block_idx() as u64;
    while item < items {
        let r = (item / chunks as u64) as u32;
        let c = (item % chunks as u64) as u32;
        // SAFETY: r < n_rows and `rows` holds n_rows ranges.
        let QueryRange {
            request,
            start,
            end,
        } = unsafe { QueryRange::load::<S>(p.rows, r) };
        let n = end.saturating_sub(start);
        let row_chunks = if n > chunk { n.div_ceil(chunk) } else { 1 };
        let row = Logits(p.logits.add(r as usize * p.row_stride as usize));
        let out = Output {
            out: p.out.add(r as usize * p.k as usize),
            slots: Slots {
                page_table: p.page_table,
                page_size: p.page_size,
                max_pages: p.max_pages,
            },
            request,
            pos: None,
        };
        if n <= p.k && p.take_all_short != 0 {
            if c == 0 {
                // Every position of the short row, in order, then padding.
                let mut j = tid;
                while j < p.k {
                    // SAFETY: j < k; start + j < end is a position of the row's range.
                    unsafe {
                        if j < n {
                            out.put::<S>(j, start + j, 0)
                        } else {
                            out.pad::<S>(j)
                        }
                    };
                    j += block_dim;
                }
            }
        } else if row_chunks == 1 && c == 0 {
            let th = if n <= p.k {
                Threshold::ALL
            } else {
                // SAFETY: [start, end) lies in the row (contract); the launch provides
                // the shared memory; every thread of the block takes this branch
                // (uniform).
                unsafe { select::<S>(me, row, start, end, p.k) }
            };
            // SAFETY: as above; `out` holds the row's k outputs.
            unsafe { write_row::<S>(me, p.k, row, out, start, end, th) };
        } else if c < row_chunks {
            // SAFETY: c < row_chunks ≤ chunks; the workspace and counters are sized for
            // the launch (contract).
            unsafe { chunk_and_merge::<S>(me, &p, row, out, r, c, (start, end), row_chunks) };
        }
        // The next item's shared-memory stores come after everyone's last loads.
        S::sync_threads();
        item += S::grid_dim() as u64;
    }
}

/// Chunk `c` of row `r` (positions `range`, `row_chunks` chunks): its top-k' into the
/// workspace, then, in the last of the row's blocks to finish, the row's top-k over the
/// candidates into `out`.
///
/// # Safety
/// As [`topk`]; every thread of the block calls it with the same arguments.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn chunk_and_merge<S: Simt>(
    me: Me,
    p: &TopkParams,
    row: Logits,
    out: Output,
    r: u32,
    c: u32,
    range: (u32, u32),
    row_chunks: u32,
) {
    let chunk = p.chunk.max(1);
    let chunks = max_chunks(p.row_stride, chunk) as usize;
    let kc = p.k.min(chunk);
    let region = p.workspace.add(r as usize * 2 * chunks * kc as usize);
    let (keys, pos) = (region, region.add(chunks * kc as usize));
    let sink = Chunk {
        keys: keys.add(c as usize * kc as usize),
        pos: pos.add(c as usize * kc as usize),
    };
    let c0 = range.0 + c * chunk;
    let c1 = (c0 + chunk).min(range.1);
    let th = if c1 - c0 <= kc {
        Threshold::ALL
    } else {
        // SAFETY: [c0, c1) lies in the row; uniform.
        unsafe { select::<S>(me, row, c0, c1, kc) }
    };
    // SAFETY: the chunk's kc candidate slots.
    unsafe { write_row::<S>(me, kc, row, sink, c0, c1, th) };
    // Count the chunk as done; the last one merges. Every thread's candidate stores are
    // visible GPU-wide before the count says so.
    S::threadfence();
    S::sync_threads();
    if me.tid == 0 {
        let counter = p.counters.add(r as usize);
        // SAFETY: the row's counter, only accessed atomically during the launch.
        let done = unsafe { S::atomic_add_u32(counter, 1) } + 1;
        let last = done == row_chunks;
        if last {
            // Back to zero for the next launch (every chunk has counted).
            // SAFETY: as above.
            unsafe { S::atomic_add_u32(counter, 0u32.wrapping_sub(row_chunks)) };
        }
        // SAFETY: the flag word, read by everyone after the barrier below.
        unsafe { S::smem_store::<u32>(FLAG, last as u32) };
    }
    S::sync_threads();
    // SAFETY: stored before the barrier.
    if unsafe { S::smem_load::<u32>(FLAG) } == 0 {
        return;
    }
    // The other chunks' stores (fenced before their counts) are visible now.
    S::threadfence();
    let cands = Candidates(keys.as_const());
    let n = row_chunks * kc;
    let out = Output {
        pos: Some(pos.as_const()),
        ..out
    };
    // SAFETY: every chunk of the row wrote its kc candidate keys (and the positions of
    // the selected ones) before counting; n > k (two or more chunks of k' ≥ ... entries,
    // or all invalid padding past the valid ones); the last barrier separates the
    // previous shared-memory accesses.
    let th = unsafe { select::<S>(me, cands, 0, n, p.k) };
    // SAFETY: as above; `out` holds the row's k outputs.
    unsafe { write_row::<S>(me, p.k, cands, out, 0, n, th) };
}

/// Finds the exact threshold of a row with more than `k` positions (up to three histogram
/// passes, see the module documentation).
///
/// # Safety
/// Every thread of the block calls it with the same arguments; `row[start..end]` is
/// readable; [`SMEM_BYTES`] of shared memory; the previous shared-memory accesses are
/// separated from this call by a barrier.
#[inline(always)]
unsafe fn select<S: Simt>(me: Me, row: impl Keys, start: u32, end: u32, k: u32) -> Threshold {
    // Zero both histograms (plain stores; the atomics come after the barrier).
    let mut i = me.tid;
    while i < 2 * BINS {
        // SAFETY: i < 2·BINS words: HIST_A and HIST_B.
        unsafe { S::smem_store::<u32>(HIST_A + 4 * i as usize, 0) };
        i += me.block_dim;
    }
    S::sync_threads();

    // Pass 1: the top 11 bits of every valid key.
    // SAFETY: uniform arguments; HIST_A zeroed before the barrier above.
    unsafe { histogram::<S>(me, row, start, end, HIST_A, 0, 0, 21, 0x7ff) };
    S::sync_threads();
    // SAFETY: HIST_A was filled by atomics before the barrier.
    let f = unsafe { find_bin::<S>(me, HIST_A, k) };
    if f.total <= k {
        // At most k valid entries: all of them.
        return Threshold::ALL;
    }
    let mut th = Threshold {
        shift: 21,
        prefix: f.bin,
        need: f.need,
        count: f.count,
    };
    if th.need == th.count {
        return th;
    }

    // Pass 2: bits 20..10 of the keys in the bin; HIST_A is zeroed for pass 3 meanwhile
    // (its last loads were before find_bin's final barrier).
    let mut i = me.tid;
    while i < BINS {
        // SAFETY: i < BINS: a word of HIST_A.
        unsafe { S::smem_store::<u32>(HIST_A + 4 * i as usize, 0) };
        i += me.block_dim;
    }
    let (mask, value) = (!0u32 << 21, th.prefix << 21);
    // SAFETY: uniform arguments; HIST_B zeroed two barriers ago, untouched since.
    unsafe { histogram::<S>(me, row, start, end, HIST_B, mask, value, 10, 0x7ff) };
    S::sync_threads();
    // SAFETY: HIST_B was filled by atomics before the barrier.
    let f = unsafe { find_bin::<S>(me, HIST_B, th.need) };
    th = Threshold {
        shift: 10,
        prefix: (th.prefix << 11) | f.bin,
        need: f.need,
        count: f.count,
    };
    if th.need == th.count {
        return th;
    }

    // Pass 3: bits 9..0 of the keys with the 22-bit prefix (HIST_A, zeroed in pass 2;
    // bins 1024.. stay zero).
    let (mask, value) = (!0u32 << 10, th.prefix << 10);
    // SAFETY: uniform arguments; HIST_A zeroed before pass 2's barrier.
    unsafe { histogram::<S>(me, row, start, end, HIST_A, mask, value, 0, 0x3ff) };
    S::sync_threads();
    // SAFETY: HIST_A was filled by atomics before the barrier.
    let f = unsafe { find_bin::<S>(me, HIST_A, th.need) };
    Threshold {
        shift: 0,
        prefix: (th.prefix << 10) | f.bin,
        need: f.need,
        count: f.count,
    }
}

/// Loads in flight per thread in the histogram passes.
const UNROLL: u32 = 4;

/// Adds every valid entry of `row[start..end]` whose key satisfies `key & mask == value`
/// to bin `(key >> shift) & bins` of the histogram at `hist` (shared-memory atomics).
///
/// Each thread loads [`UNROLL`] entries at a time (strided by `block_dim`, so the loads
/// coalesce) and merges consecutive hits on the same bin into one atomic: a row of equal
/// values costs one atomic per thread, not one per entry.
///
/// # Safety
/// `row[start..end]` is readable; the histogram's 2048 words were zeroed before the last
/// barrier and are accessed by atomics only until the next one.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn histogram<S: Simt>(
    me: Me,
    row: impl Keys,
    start: u32,
    end: u32,
    hist: usize,
    mask: u32,
    value: u32,
    shift: u32,
    bins: u32,
) {
    let (mut run_bin, mut run_len) = (0u32, 0u32);
    let mut add = |key: u32| {
        if key != INVALID && key & mask == value {
            let bin = (key >> shift) & bins;
            if bin != run_bin {
                if run_len > 0 {
                    // SAFETY: run_bin <= bins < 2048: a bin of the histogram.
                    unsafe { S::smem_atomic_add_u32(hist + 4 * run_bin as usize, run_len) };
                }
                (run_bin, run_len) = (bin, 0);
            }
            run_len += 1;
        }
    };
    let load = |q: u32| {
        if q < end {
            // SAFETY: start <= q < end: inside the row.
            unsafe { row.key::<S>(q) }
        } else {
            INVALID
        }
    };
    let step = me.block_dim;
    let mut pos = start + me.tid;
    while pos < end {
        // UNROLL (4) loads first, then their keys.
        let (k0, k1, k2, k3) = (
            load(pos),
            load(pos + step),
            load(pos + 2 * step),
            load(pos + 3 * step),
        );
        add(k0);
        add(k1);
        add(k2);
        add(k3);
        pos += UNROLL * step;
    }
    if run_len > 0 {
        // SAFETY: as above.
        unsafe { S::smem_atomic_add_u32(hist + 4 * run_bin as usize, run_len) };
    }
}

/// Scanning the 2048 bins of the histogram at `hist` from the top, finds the bin holding
/// the `need`-th largest entry (meaningful when `need <= total`). Each thread owns a
/// contiguous chunk of `2048 / block_dim` bins; a block scan of the chunk sums gives each
/// chunk the count above it, and the one thread whose chunk holds the bin writes it to
/// `RESULT`. Ends with a barrier; everyone returns the same value.
///
/// # Safety
/// Every thread of the block calls it with the same arguments, after a barrier that follows
/// the histogram's last atomic; `SCAN[0]` and `RESULT` were last loaded before an earlier
/// barrier.
unsafe fn find_bin<S: Simt>(me: Me, hist: usize, need: u32) -> Found {
    let chunk = BINS / me.block_dim;
    let lo = me.tid * chunk;
    // Bins `lo + j`; four at a time (one 16-byte load: conflict-free, where a lane's
    // stride of `chunk` words would be a `chunk`-way conflict) when the chunk allows.
    let bin_at = |j: u32| -> u32 {
        if chunk % 4 == 0 {
            // SAFETY: lo + j - j % 4 .. + 4 ≤ BINS: bins of the histogram, 16-byte
            // aligned (lo and the histogram offsets are multiples of 4 words).
            let v = unsafe { S::smem_load::<V4>(hist + 4 * (lo + j - j % 4) as usize) }.0;
            // (A select, not an index: no local-memory copy of the vector.)
            match j % 4 {
                0 => v[0],
                1 => v[1],
                2 => v[2],
                _ => v[3],
            }
        } else {
            // SAFETY: lo + j < BINS: a bin of the histogram.
            unsafe { S::smem_load::<u32>(hist + 4 * (lo + j) as usize) }
        }
    };
    let mut sum = 0u32;
    let mut j = 0;
    while j < chunk {
        if chunk % 4 == 0 {
            // SAFETY: as in `bin_at`.
            let v = unsafe { S::smem_load::<V4>(hist + 4 * (lo + j) as usize) }.0;
            sum += v[0] + v[1] + v[2] + v[3];
            j += 4;
        } else {
            sum += bin_at(j);
            j += 1;
        }
    }
    // SAFETY: same arguments in every thread; SCAN[0] is free (contract).
    let (before, total) = unsafe { block_scan::<S>(me, sum, SCAN) };
    // Entries in the bins above this thread's chunk.
    let mut above = total - before - sum;
    let mut j = chunk;
    while j > 0 {
        j -= 1;
        let bin = lo + j;
        let h = bin_at(j);
        if above < need && above + h >= need {
            // SAFETY: exactly one bin satisfies this (cumulative counts from the top
            // cross `need` once), so RESULT has one writer; nobody loads it before the
            // barrier below.
            unsafe {
                S::smem_store::<u32>(RESULT, bin);
                S::smem_store::<u32>(RESULT + 4, need - above);
                S::smem_store::<u32>(RESULT + 8, h);
            }
        }
        above += h;
    }
    S::sync_threads();
    if total < need {
        // Nothing was written (the caller takes every entry).
        return Found {
            bin: 0,
            need: 0,
            count: 0,
            total,
        };
    }
    // SAFETY: written before the barrier by the thread that found the bin.
    unsafe {
        Found {
            bin: S::smem_load::<u32>(RESULT),
            need: S::smem_load::<u32>(RESULT + 4),
            count: S::smem_load::<u32>(RESULT + 8),
            total,
        }
    }
}

/// Inclusive scan over the 32 lanes of a full warp (`shfl.idx` from `lane - d`).
#[inline(always)]
fn warp_inclusive_scan<S: Simt>(lane: u32, mut v: u32) -> u32 {
    let mut d = 1;
    while d < 32 {
        let y = S::shfl_idx(FULL, v, lane.wrapping_sub(d) & 31);
        if lane >= d {
            v = v.wrapping_add(y);
        }
        d <<= 1;
    }
    v
}

/// Block-wide exclusive prefix sum of `v` in thread order, and the block total. Stores the
/// per-warp totals at `buf` (one word per warp), with a barrier in between.
///
/// # Safety
/// Every thread of the block calls it with the same `buf`; the words at `buf` were last
/// accessed before an earlier barrier.
unsafe fn block_scan<S: Simt>(me: Me, v: u32, buf: usize) -> (u32, u32) {
    let incl = warp_inclusive_scan::<S>(me.lane, v);
    if me.lane == 31 {
        // SAFETY: warp < 32: a word of the buffer; only this thread writes it.
        unsafe { S::smem_store::<u32>(buf + 4 * me.warp as usize, incl) };
    }
    S::sync_threads();
    // SAFETY: the warp totals were stored before the barrier.
    let (warp_before, total) = unsafe { cross_warp::<S>(me, buf) };
    (warp_before.wrapping_add(incl).wrapping_sub(v), total)
}

/// Given the per-warp totals at `buf` (stored before a barrier), this warp's exclusive
/// prefix over the warps before it and the block total.
///
/// # Safety
/// `buf` holds `warps` words stored before the last barrier and not stored since.
#[inline(always)]
unsafe fn cross_warp<S: Simt>(me: Me, buf: usize) -> (u32, u32) {
    let w = if me.lane < me.warps {
        // SAFETY: lane < warps <= 32: a word of the buffer.
        unsafe { S::smem_load::<u32>(buf + 4 * me.lane as usize) }
    } else {
        0
    };
    let incl = warp_inclusive_scan::<S>(me.lane, w);
    let total = S::shfl_idx(FULL, incl, 31);
    let prev = S::shfl_idx(FULL, incl, me.warp.wrapping_sub(1) & 31);
    (if me.warp == 0 { 0 } else { prev }, total)
}

/// The output value of position `pos` of a row of request `request`: the position, or its
/// cache slot through the page table.
///
/// # Safety
/// With a page table, it maps `pos` of `request` (contract of [`topk`]).
#[inline(always)]
unsafe fn output_of<S: Simt>(p: Slots, request: u32, pos: u32) -> i32 {
    if p.page_table.is_null() {
        return pos as i32;
    }
    // (Validated positive; `max` keeps a division-by-zero trap out of the kernel.)
    let page_size = p.page_size.max(1);
    let entry = request as usize * p.max_pages as usize + (pos / page_size) as usize;
    // SAFETY: the page table maps every position of the row's range (contract).
    let page = unsafe { S::gld(p.page_table.add(entry)) };
    // Validated to fit in i32.
    (page as u32)
        .wrapping_mul(page_size)
        .wrapping_add(pos % page_size) as i32
}

/// Writes the selection `th` of `row[start..end]` to `out[..k]` in ascending position
/// order, then padding (`-1` for the op's output, invalid keys for candidates; see the
/// module documentation).
///
/// # Safety
/// Every thread of the block calls it with the same arguments; `row[start..end]` is
/// readable, `out` holds `k` entries; both `SCAN` buffers were last accessed before the
/// previous barrier or one before it (the first tile uses buffer 0).
#[allow(clippy::too_many_arguments)]
unsafe fn write_row<S: Simt>(
    me: Me,
    k: u32,
    row: impl Keys,
    out: impl Sink,
    start: u32,
    end: u32,
    th: Threshold,
) {
    let lanes_below = (1u32 << me.lane) - 1;
    // Entries written so far, equal entries seen so far (counted while taking part of
    // them), and whether all equal entries are taken.
    let mut written = 0u32;
    let mut eq_seen = 0u32;
    let all_eq = th.need == th.count;
    let mut buf = SCAN;
    let mut base = start;
    // The next tile's entry is loaded one tile ahead, hiding its latency behind the scan.
    let load = |pos: u32| {
        if pos < end {
            // SAFETY: start <= pos < end (callers pass pos >= start).
            unsafe { row.key::<S>(pos) }
        } else {
            INVALID
        }
    };
    let mut next = load(base + me.tid);
    while base < end && written < k {
        let pos = base + me.tid;
        let key = next;
        next = load(pos + me.block_dim);
        let kp = key >> th.shift;
        let valid = key != INVALID;
        let eq = valid && kp == th.prefix;
        // Equal entries are taken one by one (ranked) only while some are still needed
        // but not all are: uniform across the block.
        let partial = !all_eq && eq_seen < th.need;
        let first = valid && (kp > th.prefix || (eq && all_eq));
        let b_first = S::ballot(FULL, first);
        let b_eq = if partial { S::ballot(FULL, eq) } else { 0 };
        let lane_before =
            (b_first & lanes_below).count_ones() | ((b_eq & lanes_below).count_ones() << 16);
        if me.lane == 0 {
            let warp_total = b_first.count_ones() | (b_eq.count_ones() << 16);
            // SAFETY: warp < 32: a word of this tile's buffer, last loaded two barriers
            // ago; only this thread writes it.
            unsafe { S::smem_store::<u32>(buf + 4 * me.warp as usize, warp_total) };
        }
        S::sync_threads();
        // SAFETY: the warp totals were stored before the barrier.
        let (warp_before, total) = unsafe { cross_warp::<S>(me, buf) };
        // Counts of at most 1024 per field: the packed sums never carry.
        let before = warp_before + lane_before;
        let (first_before, eq_before) = (before & 0xffff, before >> 16);
        let (first_total, eq_total) = (total & 0xffff, total >> 16);
        let left = if partial { th.need - eq_seen } else { 0 };
        if first || (partial && eq && eq_before < left) {
            let at = written + first_before + eq_before.min(left);
            if at < k {
                // SAFETY: at < k: inside the sink; pos is selected.
                unsafe { out.put::<S>(at, pos, key) };
            }
        }
        written += first_total + eq_total.min(left);
        eq_seen += eq_total;
        buf = if buf == SCAN { SCAN + SCAN_BUF } else { SCAN };
        base += me.block_dim;
    }
    let mut j = written + me.tid;
    while j < k {
        // SAFETY: j < k.
        unsafe { out.pad::<S>(j) };
        j += me.block_dim;
    }
}

#[cfg(all(test, feature = "emu"))]
mod tests;
