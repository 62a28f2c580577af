//! `sparse_mla` on the GPU: sparse MLA attention over each token's top-k KV slots, on
//! bf16 tensor cores (`mma.sync.m16n8k16`, f32 accumulation).
//!
//! # Launch geometry
//!
//! One block per (token, group of [`HEADS`] = 16 heads), token-major (the blocks of one
//! token are neighbours, so they share its keys in L2); grid = `n_tokens ·
//! ⌈n_heads / 16⌉` clamped to [`MAX_GRID`], grid-stride beyond it. [`THREADS`] = 256
//! threads = 8 warps; warp `w` has the *quarter* `q4 = w % 4` and the *key half*
//! `kh = w / 4`. Rows of a group past `n_heads` read zero queries and write nothing.
//! Dynamic shared memory: see below (64000 B at DeepSeek-V3.2 dims, so the launcher must
//! raise the kernel's dynamic shared memory limit above the 48 KiB default).
//!
//! # Algorithm (per block)
//!
//! The group's 16 query rows are staged in shared memory once. The token's valid slots
//! (`≥ 0`), in index order, are cut into key blocks of [`BN`] = 32 (the last one
//! shorter): block `b` holds valid slots `32b .. 32b + 32`. The blocking depends only on
//! the token's own indices, and no value ever crosses tokens, so results are
//! batch-invariant (bit-identical whatever else is in the launch). Every warp finds the
//! blocks itself with ballots over 32-index chunks (`gather::Scan`: the same blocks in
//! all warps, no shared memory; the next chunk of indices is always in flight).
//!
//! Per key block:
//! 1. **Gather** (all threads; thread `(w, lane)` owns key `4w + lane/8` of the block and
//!    the 16-byte source units `lane%8 + 8i` of its token row: 8 bf16 or 16 e4m3 codes):
//!    the keys `[latent | rope]` go to shared memory as bf16. fp8_ds_mla latents are stored as their exact bf16 value *without* the tile
//!    scale (e4m3 ⊂ bf16: 4 significant bits, exponents 2^-9..2^8), and the f32 tile
//!    scales go to a table of their own; missing keys (past the block's end) are zero.
//!    Software pipeline: the global loads of block `b + 1` are issued before block `b` is
//!    computed and held in registers ([`MAXIT`] = 9 units + 1 scale per thread, all of a
//!    DeepSeek-V3.2 key block: 72 units per bf16 key, 40 per fp8 key), then stored after
//!    it. Rows wider than the prefetch, more
//!    than 8 tiles, or layouts not 16-byte aligned are (also) gathered synchronously.
//! 2. **S = Q·Kᵀ**, split over the d_qk dimension: quarter `q4` owns k-steps (16 dims)
//!    `⌊ks·q4/4⌋ .. ⌊ks·(q4+1)/4⌋` (DeepSeek-V3.2: 9 each), half `kh` the 16 keys
//!    `16kh .. 16kh+16` (two n-tiles of 8); even and odd k-steps accumulate in separate
//!    chains. The k-steps of one fp8 tile (128 dims) are a segment whose f32 result is
//!    multiplied by the key's tile scale before it is added to the key's score
//!    (`S = Σ_tile scale · (q·k̂)_tile + (q·k)_rope`): exact for any f32 scale, never a
//!    rounded `e4m3 × scale`. The 4 quarters' partial scores go through shared memory
//!    and are summed in quarter order (fixed).
//! 3. **Online softmax** (f32, base 2: `x = S · scale · log2 e`), per head row and per key
//!    half: all 4 warps of a half compute the same running max `m` and sums `l` (of the
//!    f32 probabilities, for the lse) and `l̃` (of the bf16-rounded ones, which normalise
//!    the output so the weights that multiply V sum to one). Probabilities (for fp8 KV
//!    times the key's scale of the tile that holds the warp's columns) are rounded to
//!    bf16 and become, straight from the score fragments' registers, the A operand of
//! 4. **O += P·V**: quarter `q4` owns a quarter of the output columns (DeepSeek-V3.2:
//!    128 = one fp8 tile = 16 n-tiles, 64 f32 accumulators per lane; with fp8 KV a
//!    warp's columns always lie in one tile). Lane `g = lane/4` of n-tile `j` holds
//!    column `base + g·ntw + j` (`ntw` = the warp's n-tiles), so one lane's V columns are
//!    contiguous and load as 16-byte vectors.
//!
//! After the last block the two halves of every quarter are merged (fixed order:
//! `m = max(m₀, m₁)`, weights `2^(mᵢ - m)`) through shared memory, `out = O / l̃` is
//! rounded to bf16 (nearest even) and `lse = ln 2 · (m + log2 l)`. A token without valid
//! slots gets `out = 0`, `lse = -inf`. Latents wider than 512 columns are computed in
//! several *column passes* of 512 (each pass redoes the scores; lse is written once).
//!
//! # Shared memory (bytes; `R` = key row stride = `2·d_qk` rounded up to 128)
//!
//! | offset | size | contents |
//! |---|---|---|
//! | 0 | `32·R` | key block: row `j` = key `j` as bf16 `[latent \| rope]` in 16-byte chunks (8 dims); chunk `c` of row `j` at `j·R + 16·(c ^ swz(j))` |
//! | `32·R` | `16·R` | queries: row `i` = head `h0 + i`, same chunk layout |
//! | `48·R` | 8192 | partial scores `[q4 4][kh 2][n-tile 2][lane 32]` × 4 f32 |
//! | `48·R + 8192` | `32·tiles·4` | fp8 tile scales `[tile][key]` f32 (none for bf16), rounded up to 16 |
//!
//! DeepSeek-V3.2 (d_qk = 576, R = 1152): 36864 + 18432 + 8192 + 512 = 64000 B (bf16 KV:
//! 63488 B). At the end of a token the key block area holds the key-half-1 accumulators
//! (`[n-tile][lane]` × 4 f32) and the partial area their row statistics. `swz(j)` (a
//! permutation of the low 3 bits of the row) makes the 8-byte score-operand loads (rows
//! `lane/4`, `lane/4 + 8`), the 16-byte V loads (rows 2t, 2t+1, 2t+8, 2t+9) and the
//! gather stores free of bank conflicts.
//!
//! # Registers
//!
//! Per thread: 64 f32 accumulators, the 37-register prefetch, softmax state; no register
//! array is indexed at run time (`unroll!`), and the per-lane addresses are recomputed in
//! every key block rather than hoisted (`Role::opaque`), so the kernel compiles without
//! spills or local memory (about 240 registers, 1 block of 8 warps per SM).

mod gather;
#[cfg(all(test, feature = "emu"))]
mod tests;
mod tile;

use crate::global::GlobalPtr;
use crate::kernels::FULL;
use crate::launch::{Launch, MAX_GRID};
use crate::params::kv_format::{self, FP8_DS_MLA_TILE};
use crate::params::SparseMlaParams;
use crate::simt::Simt;

/// Heads per block (the mma M dimension).
pub const HEADS: u32 = 16;
/// Warps per block.
const WARPS: u32 = 8;
/// Threads per block.
pub const THREADS: u32 = 32 * WARPS;
/// Keys per key block.
pub const BN: u32 = 32;
/// Output n-tiles (of 8 columns) per warp and column pass at most.
const MAX_NT: usize = 16;
/// Output n-tiles per column pass (4 quarters × [`MAX_NT`]).
const PASS_TILES: u32 = 4 * MAX_NT as u32;
/// 16-byte source units a thread prefetches per key block.
const MAXIT: usize = 9;
/// Bytes of the partial-score area.
const PART_BYTES: u32 = 4 * 2 * 2 * 32 * 16;
/// Segment id of dims without a tile scale (rope, or any bf16 KV dim).
const PLAIN: u32 = u32::MAX;
/// Top-k indices per split (the smallest split; see [`sparse_mla_split`]).
pub const SPLIT: u32 = 512;
/// Most splits of a token's indices (bounds the merge's reads per output).
const MAX_SPLITS: usize = 16;
/// Floats of a split record's row statistics (16 rows × m, l, l̃, pad).
const STAT_FLOATS: u32 = 16 * 4;

/// Indices per split of a token's `topk` indices: `topk` itself up to `SPLIT` (no
/// split), else `SPLIT` or, past 16 splits, `⌈topk / 16⌉` rounded up to 32. Each split
/// is attended by its own block and the splits are merged in index order, so more blocks
/// fill the GPU at small batches; the split depends on `topk` only, so a token's result
/// is the same in any batch.
pub fn sparse_mla_split(topk: u32) -> u32 {
    if topk <= SPLIT {
        topk.max(1)
    } else {
        SPLIT.max(topk.div_ceil(MAX_SPLITS as u32).div_ceil(32) * 32)
    }
}

/// Bytes of the workspace (partial records) and of the counters a launch needs (both 0
/// without split): one record of `passes · 8192 + 64` f32 per (token, head group, split),
/// one u32 counter per (token, head group).
pub fn sparse_mla_workspace(n_tokens: u32, n_heads: u32, topk: u32, nope_dim: u32) -> (u64, u64) {
    let splits = topk.div_ceil(sparse_mla_split(topk)).max(1) as u64;
    if splits == 1 {
        return (0, 0);
    }
    let groups = n_heads.div_ceil(HEADS) as u64;
    let passes = (nope_dim / 8).div_ceil(PASS_TILES).max(1) as u64;
    let record = passes * tile::PASS_FLOATS as u64 + STAT_FLOATS as u64;
    let units = n_tokens as u64 * groups;
    (4 * units * splits * record, 4 * units)
}

// The `unroll!` counts below are written for these values.
const _: () = assert!(MAXIT == 9 && MAX_NT == 16);

/// Sizes and shared-memory offsets derived from the parameters (the same for the launch
/// and the kernel).
#[derive(Clone, Copy, Debug)]
struct Geometry {
    nope: u32,
    d_qk: u32,
    /// k-steps of 16 dims: `d_qk / 16`.
    ksteps: u32,
    /// 16-byte bf16 chunks per key row: `d_qk / 8`.
    chunks: u32,
    /// Chunks of the latent: `nope / 8`.
    nope_chunks: u32,
    /// 16-byte source units of the latent in a token row: `nope / 16` (16 e4m3 codes,
    /// two chunks each) for fp8, `nope / 8` (8 bf16, one chunk) for bf16.
    lat_units: u32,
    /// 16-byte source units of the fp8 tile scales (4 f32 each; 0 for bf16).
    scale_units: u32,
    /// 16-byte source units of a token row: the latent's, the scales', then `rope / 8` of
    /// rope.
    units: u32,
    /// Shared-memory bytes per key row.
    row_bytes: u32,
    /// fp8 tiles per key (0 for bf16 KV).
    tiles: u32,
    fp8: bool,
    /// Output n-tiles: `nope / 8`.
    ntiles: u32,
    /// Column passes.
    passes: u32,
    /// Splits of a token's indices (1: no split).
    splits: u32,
    /// Whether the prefetch may shift its units to 32-byte sectors: unit `u` of a token
    /// row is at byte `16u` (latent, scales and rope back to back, as in fp8_ds_mla and
    /// bf16 rows) and one more unit still fits the prefetch.
    shiftable: bool,
    /// Shared-memory byte offset of the split-completion flag.
    flag_off: u32,
    q_off: u32,
    part_off: u32,
    scale_off: u32,
    smem: u32,
}

impl Geometry {
    fn new(p: &SparseMlaParams) -> Self {
        let d_qk = p.nope_dim + p.rope_dim;
        let fp8 = p.format == kv_format::FP8_DS_MLA;
        let tiles = if fp8 { p.nope_dim / FP8_DS_MLA_TILE } else { 0 };
        let lat_units = if fp8 { p.nope_dim / 16 } else { p.nope_dim / 8 };
        let scale_units = (4 * tiles).div_ceil(16);
        let row_bytes = (2 * d_qk).div_ceil(128) * 128;
        let ntiles = p.nope_dim / 8;
        let q_off = BN * row_bytes;
        let part_off = q_off + HEADS * row_bytes;
        let scale_off = part_off + PART_BYTES;
        Geometry {
            nope: p.nope_dim,
            d_qk,
            ksteps: d_qk / 16,
            chunks: d_qk / 8,
            nope_chunks: p.nope_dim / 8,
            lat_units,
            scale_units,
            units: lat_units + scale_units + p.rope_dim / 8,
            row_bytes,
            tiles,
            fp8,
            ntiles,
            passes: ntiles.div_ceil(PASS_TILES),
            splits: p.topk.div_ceil(p.split.max(1)).max(1),
            shiftable: p.rope_offset == 16 * (lat_units + scale_units)
                && (!fp8 || p.scales_offset == 16 * lat_units)
                && lat_units + scale_units + p.rope_dim / 8 < 8 * MAXIT as u32,
            flag_off: scale_off + (BN * tiles * 4).div_ceil(16) * 16,
            q_off,
            part_off,
            scale_off,
            smem: scale_off + (BN * tiles * 4).div_ceil(16) * 16 + 16,
        }
    }

    /// Floats of one split's partial record (every pass, then the row statistics).
    fn record_floats(&self) -> u32 {
        self.passes * tile::PASS_FLOATS + STAT_FLOATS
    }

    /// Tile-scale segment of k-step `ks` (its tile, or [`PLAIN`]).
    #[inline(always)]
    fn segment(&self, ks: u32) -> u32 {
        if self.fp8 && 16 * ks < self.nope {
            ks / 8
        } else {
            PLAIN
        }
    }

    /// Shared-memory byte offset of chunk `chunk` of key row `row`.
    #[inline(always)]
    fn chunk_addr(&self, row: u32, chunk: u32) -> usize {
        (row * self.row_bytes + ((chunk ^ swz(row)) << 4)) as usize
    }
}

/// The chunk swizzle of key row `row` (a permutation of the low 3 bits of `row`): rows
/// `4p..4p+3` differ in bits 1..2 (score loads), rows `2t + e` (t = 0..3) in bits 0 and 2
/// (V loads).
#[inline(always)]
fn swz(row: u32) -> u32 {
    ((row & 1) << 1) | (((row >> 1) & 1) << 2) | ((row >> 2) & 1)
}

/// This thread's place in the block.
#[derive(Clone, Copy)]
struct Role {
    lane: u32,
    /// Quarter: k-range of the scores, column slice of the output.
    q4: u32,
    /// Key half of every key block.
    kh: u32,
    /// `lane / 4` (mma group).
    g: u32,
    /// `lane % 4` (mma thread in group).
    t: u32,
    /// Key of the block this thread gathers.
    key: u32,
    /// First source unit of the key it gathers (then every 8th).
    sub: u32,
}

impl Role {
    /// The same role with `z` (0 at run time) added to every field: derived from a
    /// warp vote inside the key loop, it keeps the compiler from hoisting (and pinning in
    /// registers for the whole loop) dozens of per-lane addresses and predicates.
    #[inline(always)]
    fn opaque(&self, z: u32) -> Self {
        Role {
            lane: self.lane + z,
            q4: self.q4 + z,
            kh: self.kh + z,
            g: self.g + z,
            t: self.t + z,
            key: self.key + z,
            sub: self.sub + z,
        }
    }

    #[inline(always)]
    fn new<S: Simt>() -> Self {
        let (warp, lane) = (S::warp_id(), S::lane_id());
        Role {
            lane,
            q4: warp & 3,
            kh: warp >> 2,
            g: lane >> 2,
            t: lane & 3,
            key: 4 * warp + (lane >> 3),
            sub: lane & 7,
        }
    }
}

/// Launch geometry of [`sparse_mla`] (see the module docs).
pub fn sparse_mla_launch(p: &SparseMlaParams) -> Launch {
    let g = Geometry::new(p);
    let items = p.n_tokens as u64 * g.splits as u64 * p.n_heads.div_ceil(HEADS) as u64;
    Launch {
        grid: items.clamp(1, MAX_GRID as u64) as u32,
        block: THREADS,
        smem_bytes: g.smem,
    }
}

/// Sparse MLA attention (algorithm, shared memory and geometry in the module docs).
///
/// # Safety
/// Launch with [`sparse_mla_launch`]; every pointer and size in `p` describes validated
/// buffers (see [`SparseMlaParams`]): `q` holds `n_tokens × n_heads × (nope_dim +
/// rope_dim)` bf16, `indices` `n_tokens × topk` entries that are `-1` or slots of the
/// cache, `out` `n_tokens × n_heads × nope_dim` bf16, `lse` `n_tokens × n_heads` f32;
/// `nope_dim` and `rope_dim` are multiples of 16 (`nope_dim` of 128 for fp8_ds_mla) and
/// the layout fields describe `cache` exactly (from a `KvLayout`); when `split < topk`,
/// `workspace` and `counters` hold [`sparse_mla_workspace`] bytes (16-byte aligned) and
/// the counters are zero.
#[inline(always)]
pub unsafe fn sparse_mla<S: Simt>(p: SparseMlaParams) {
    let g = Geometry::new(&p);
    let mut item = S::block_idx() as u64;
    loop {
        // The item count, recomputed from an opaque zero (see `Role::opaque`) every time,
        // is not held in registers through the attention.
        let z = S::ballot(FULL, false) as u64;
        let per_token = (g.splits as u64 + z) * p.n_heads.div_ceil(HEADS) as u64;
        if item >= p.n_tokens as u64 * per_token {
            break;
        }
        let mut pass = 0;
        while pass < g.passes {
            // SAFETY: item < items, pass < passes (the contract holds).
            unsafe { attend::<S>(&p, &g, item, pass) };
            pass += 1;
        }
        if g.splits > 1 {
            let it = Item::of(&g, &p, item);
            let recs = p.workspace.add(it.record(&g, 0));
            // SAFETY: this item's record is complete; the counter is this unit's.
            unsafe { finish_split::<S>(&p, &g, it.token, it.h0, it.unit, recs.as_const()) };
        }
        item += S::grid_dim() as u64;
    }
}

/// What work item `item` of the grid is: token-major, then split, then head group (the
/// blocks of one split of a token are neighbours and share its keys in L2).
#[derive(Clone, Copy)]
struct Item {
    token: u32,
    h0: u32,
    split: u32,
    /// (token, head group) index: of the counters and the records.
    unit: usize,
}

impl Item {
    #[inline(always)]
    fn of(g: &Geometry, p: &SparseMlaParams, item: u64) -> Self {
        let groups = p.n_heads.div_ceil(HEADS) as u64;
        let per_token = g.splits as u64 * groups;
        let token = (item / per_token) as u32;
        let rem = item % per_token;
        let group = (rem % groups) as u32;
        Item {
            token,
            h0: group * HEADS,
            split: (rem / groups) as u32,
            unit: token as usize * groups as usize + group as usize,
        }
    }

    /// The first index of this item's split.
    #[inline(always)]
    fn begin(&self, p: &SparseMlaParams) -> u32 {
        self.split * p.split
    }

    /// Float offset of split `split`'s record of this item's (token, head group).
    #[inline(always)]
    fn record(&self, g: &Geometry, split: u32) -> usize {
        (self.unit * g.splits as usize + split as usize) * g.record_floats() as usize
    }
}

/// Counts this split of a (token, head group) as finished; the last one merges them all.
///
/// # Safety
/// Every thread of the block calls it after storing its part of this split's record;
/// `unit` indexes the counters, `recs` is the unit's first record.
#[inline(always)]
unsafe fn finish_split<S: Simt>(
    p: &SparseMlaParams,
    g: &Geometry,
    token: u32,
    h0: u32,
    unit: usize,
    recs: GlobalPtr<f32>,
) {
    // Every thread's record stores are visible GPU-wide before the count says so.
    S::threadfence();
    S::sync_threads();
    if S::thread_idx() == 0 {
        let counter = p.counters.add(unit);
        // SAFETY: this unit's counter, only accessed atomically during the launch.
        let done = unsafe { S::atomic_add_u32(counter, 1) } + 1;
        let last = done == g.splits;
        if last {
            // Back to zero for the next launch (every split has counted).
            // SAFETY: as above.
            unsafe { S::atomic_add_u32(counter, 0u32.wrapping_sub(g.splits)) };
        }
        // SAFETY: the flag word, read by everyone after the barrier below.
        unsafe { S::smem_store::<u32>(g.flag_off as usize, last as u32) };
    }
    S::sync_threads();
    // SAFETY: stored before the barrier.
    let last = unsafe { S::smem_load::<u32>(g.flag_off as usize) } != 0;
    if last {
        // The other splits' stores (fenced before their counts) are visible now.
        S::threadfence();
        // Opaque lane roles (see `Role::opaque`): nothing of the merge is hoisted out of
        // the item loop to stay live through the attention (block-uniform branch: every
        // lane runs the vote).
        let z = S::ballot(FULL, false);
        let r = Role::new::<S>().opaque(z);
        // SAFETY: every split has counted, so every record is complete.
        unsafe { tile::merge_splits::<S>(p, g, &r, token, h0, recs) };
    }
    // The flag is rewritten by the next item only after everyone has read it.
    S::sync_threads();
}

/// This warp's output columns of column pass `pass`.
#[inline(always)]
fn pass_cols(g: &Geometry, r: &Role, pass: u32) -> tile::Cols {
    let t0 = pass * PASS_TILES;
    let cnt = PASS_TILES.min(g.ntiles - t0);
    let (first, end) = if g.fp8 && !(cnt % 4 == 0 && 16 % (cnt / 4) == 0) {
        // fp8 with 3 tiles in the pass: a whole tile (16 n-tiles) per quarter, so that a
        // warp's columns share one tile scale.
        ((16 * r.q4).min(cnt), (16 * r.q4 + 16).min(cnt))
    } else {
        (cnt * r.q4 / 4, cnt * (r.q4 + 1) / 4)
    };
    tile::Cols {
        first,
        ntw: end - first,
        base: 8 * (t0 + first),
    }
}

/// One column pass of one (token, head group, split): writes `out`/`lse` (no split), or
/// this split's partial record.
///
/// # Safety
/// As [`sparse_mla`], with `item` a work item of the launch and `pass < g.passes`; every
/// thread of the block calls it with the same arguments.
#[inline(always)]
unsafe fn attend<S: Simt>(p: &SparseMlaParams, g: &Geometry, item: u64, pass: u32) {
    let it = Item::of(g, p, item);
    let token = it.token;
    let r = Role::new::<S>();
    let kr = tile::KRange {
        lo: g.ksteps * r.q4 / 4,
        hi: g.ksteps * (r.q4 + 1) / 4,
    };
    let cols = pass_cols(g, &r, pass);
    // SAFETY: token < n_tokens; the Q area was last read before the previous attend's
    // final barriers, and is next read after the loop's first barrier.
    unsafe { tile::stage_q::<S>(p, g, token, it.h0) };
    let prefetch = gather::prefetchable(p, g);
    // SAFETY: token < n_tokens.
    let mut scan = unsafe { gather::Scan::start::<S>(p, token, r.lane, it.begin(p)) };
    // Block b + 1 (slot, size) while block b (n keys) is computed; n = 0 before block 0.
    // SAFETY: as above.
    let (mut next_slot, mut next_n) = unsafe { scan.next_block::<S>(p, token, r.key, r.lane) };
    let mut n = 0;
    let mut soft = tile::Softmax::new();
    let mut o = [[0f32; 4]; MAX_NT];
    loop {
        // 0, opaque to the compiler (see `Role::opaque`).
        let z = S::ballot(FULL, false);
        let r = r.opaque(z);
        let cols = cols.opaque(z);
        // Global loads of the next block, in flight while this one is computed.
        let pf = if prefetch {
            // SAFETY: `next_slot` is -1 or a validated slot; the layout is prefetchable.
            unsafe { gather::issue::<S>(p, g, &r, next_slot) }
        } else {
            gather::Prefetch::default()
        };
        if n > 0 {
            // SAFETY: Q, key block and scales stored before the last barrier; each
            // partial-score entry is stored by its one owner.
            unsafe { tile::scores::<S>(g, &r, &kr) };
            S::sync_threads();
            // SAFETY: partial scores and key rows complete (barrier above).
            unsafe { tile::softmax_pv::<S>(p, g, &r, &cols, n, &mut soft, &mut o) };
        }
        if next_n == 0 {
            break;
        }
        // The previous block's key rows and partial scores have been read by everyone.
        S::sync_threads();
        if prefetch {
            // SAFETY: this epoch, each key-row chunk and scale is stored by its one owner.
            unsafe { gather::store::<S>(g, &r, &pf) };
        }
        if !prefetch || (MAXIT as u32) * 8 < g.units {
            let from = if prefetch { MAXIT as u32 } else { 0 };
            // SAFETY: as above (what the prefetch did not load).
            unsafe { gather::store_rest::<S>(p, g, &r, next_slot, from) };
        }
        n = next_n;
        // SAFETY: as for the first block.
        (next_slot, next_n) = unsafe { scan.next_block::<S>(p, token, r.key, r.lane) };
        S::sync_threads();
    }
    // Everyone is done with the key rows: they now carry the half-1 accumulators.
    S::sync_threads();
    // The item decoded again from an opaque copy (see `Role::opaque`): its fields are not
    // kept in registers through the key loop.
    let it = Item::of(g, p, item + S::ballot(FULL, false) as u64);
    let (token, h0) = (it.token, it.h0);
    // SAFETY: the barrier above and the one inside order the merge's stores and loads.
    unsafe {
        if g.splits == 1 {
            tile::merge_and_write::<S>(p, g, &r, &cols, token, h0, pass, &soft, &o)
        } else {
            let rec = p.workspace.add(it.record(g, it.split));
            tile::merge_and_store_partial::<S>(g, &r, &cols, pass, &soft, &o, rec)
        }
    }
}
