//! CPU exact top-k: a pre-filter by a threshold, then an exact select among its
//! survivors; a radix select per row where the pre-filter does not apply.
//!
//! A threshold `t` first. Rows up to 16384 entries: about the `k`-th largest of the
//! maxima of about `2k` blocks of the row (at most 4 blocks' maxima more reach it), which
//! at least `k` entries reach whatever the row (about `1.4k` on i.i.d. rows). Longer rows:
//! from a sample of the row (128 runs of 16 entries spread over it; about its value of
//! rank `1.5k` scaled to the row, plus slack), expected to keep about `1.5k` entries. One
//! branch-free vectorised scan keeps every entry `≥ t` (ties included, so every entry of
//! the top k survives when at least k do). The exact k-th value `T` of the survivors comes
//! from a bisection over the order-preserving keys (below) between `t` and their maximum,
//! each step one vectorised count of the survivors at or above the midpoint, until at
//! most 4 survivors lie between the bounds; those are sorted. How many entries equal to
//! `T` are taken (the lowest positions) follows from how many lie above it (the count at
//! the bracket's high end, plus the sorted values above `T`), and a last vectorised pass
//! over the survivors (in position order) writes the positions. The thresholds come from
//! the same bisection, stopped once at most 4 more than asked reach the lower bound. Compiled per vector path ([`crate::isa_dispatch`]): comparison and
//! integer work only, the same result on every path. With fewer than k survivors (a long
//! row whose sample misjudged it: about 4% of random-walk rows, none of i.i.d. ones) the
//! row takes the full path below, exact as well.
//!
//! Values map to order-preserving u32 keys (`-0.0` folded into `+0.0`). Pass 1 builds a
//! histogram of the top 11 key bits over the row's valid entries and finds the bin that
//! holds the k-th largest. Pass 2 keeps every position above that bin (certainly selected)
//! and collects the bin's entries as candidates; two more 11/10-bit radix rounds over the
//! candidates find the exact threshold key and how many entries equal to it are taken
//! (the lowest positions). Output is the merge of both position-ordered lists, so the row
//! is written in ascending position order. Exact for every input, ties included.

use super::isa::CpuIsa;
#[cfg(target_arch = "x86_64")]
use super::raw;
use super::tasks::for_each_indexed;
use crate::ops::{ShortRows, Topk, TopkOutput};

/// Order-preserving map of a non-NaN f32 to u32.
#[inline(always)]
fn key(x: f32) -> u32 {
    let b = if x == 0.0 { 0 } else { x.to_bits() };
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Whether a logit takes part in selection (`-inf` and NaN never do).
#[inline(always)]
fn valid(x: f32) -> bool {
    x > f32::NEG_INFINITY
}

/// The f32 whose [`key`] is `k` (`+0.0` for the key of zero).
#[inline(always)]
fn unkey(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 {
        k & 0x7FFF_FFFF
    } else {
        !k
    })
}

/// How many of `vals` are `≥ t` on the vector path `isa`: a compare and a population
/// count per vector, the tail's lanes masked.
#[inline(always)]
fn count_at_least(isa: CpuIsa, vals: &[f32], t: f32) -> usize {
    let pass = |x: f32| x >= t;
    match isa.isa() {
        // SAFETY: a `CpuIsa` names only a path this CPU supports (AVX-512F and POPCNT here).
        #[cfg(target_arch = "x86_64")]
        super::isa::Isa::Amx | super::isa::Isa::Avx512Bf16 | super::isa::Isa::Avx512 => unsafe {
            count_avx512(vals, t)
        },
        // SAFETY: as above (AVX2 and POPCNT).
        #[cfg(target_arch = "x86_64")]
        super::isa::Isa::Avx2 => unsafe {
            let n = vals.len() / 8 * 8;
            count_avx2(&vals[..n], t) + vals[n..].iter().filter(|&&x| pass(x)).count()
        },
        _ => vals.iter().filter(|&&x| pass(x)).count(),
    }
}

/// The AVX-512 [`count_at_least`]: a compare into a mask and its population count per 16
/// lanes, four counts in flight; the last partial vector's lanes masked.
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,popcnt")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
unsafe fn count_avx512(vals: &[f32], t: f32) -> usize {
    use std::arch::x86_64::*;
    let tv = _mm512_set1_ps(t);
    let cmp = |m: __mmask16, x: __m512| -> u32 {
        _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(m, x, tv).count_ones()
    };
    let p = vals.as_ptr();
    let (n, mut c) = (vals.len(), [0u32; 4]);
    let mut i = 0;
    while i + 64 <= n {
        for (j, c) in c.iter_mut().enumerate() {
            // SAFETY: `i + 16·j + 16 ≤ i + 64 ≤ n`.
            *c += cmp(!0, unsafe { raw::read::<__m512>(p.add(i + 16 * j).cast()) });
        }
        i += 64;
    }
    while i + 16 <= n {
        // SAFETY: `i + 16 ≤ n`.
        c[0] += cmp(!0, unsafe { raw::read::<__m512>(p.add(i).cast()) });
        i += 16;
    }
    if i < n {
        let m = (1u16 << (n - i)) - 1;
        // SAFETY: the masked load reads only the `n − i < 16` lanes inside `vals`.
        c[1] += cmp(m, unsafe { _mm512_maskz_loadu_ps(m, p.add(i)) });
    }
    c.iter().sum::<u32>() as usize
}

/// The AVX2 [`count_at_least`] over whole vectors of 8 (`vals.len()` a multiple of 8): a
/// compare, its sign mask and a population count per vector, four counts in flight.
///
/// # Safety
/// The CPU must support AVX2 and POPCNT; `vals.len() % 8 == 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
unsafe fn count_avx2(vals: &[f32], t: f32) -> usize {
    use std::arch::x86_64::*;
    let tv = _mm256_set1_ps(t);
    let cmp = |x: __m256| -> u32 {
        (_mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(x, tv)) as u32).count_ones()
    };
    let p = vals.as_ptr();
    let (n, mut c) = (vals.len(), [0u32; 4]);
    let mut i = 0;
    while i + 32 <= n {
        for (j, c) in c.iter_mut().enumerate() {
            // SAFETY: `i + 8·j + 8 ≤ i + 32 ≤ n`.
            *c += cmp(unsafe { raw::read::<__m256>(p.add(i + 8 * j).cast()) });
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: `i + 8 ≤ n`.
        c[0] += cmp(unsafe { raw::read::<__m256>(p.add(i).cast()) });
        i += 8;
    }
    c.iter().sum::<u32>() as usize
}

/// A range of keys `[lo, hi)` that brackets a select: `at_lo` values are `≥ unkey(lo)`
/// (at least the `k` asked for) and `at_hi < k` are `≥ unkey(hi)`.
#[derive(Clone, Copy)]
struct Bracket {
    lo: u32,
    at_lo: usize,
    hi: u32,
    at_hi: usize,
}

/// Narrows a bracket of the `k`-th largest of `vals` (none NaN; all `≥ lo`, `lo` not NaN,
/// at least `k` of them) by bisection over the order-preserving keys, from `lo` up to past
/// the largest value, until `enough` holds or the bracket is one key wide: each step one
/// vectorised count of the values at or above the midpoint.
#[inline(always)]
fn bisect(
    isa: CpuIsa,
    vals: &[f32],
    lo: f32,
    k: usize,
    enough: impl Fn(&Bracket) -> bool,
) -> Bracket {
    let top = fold16(vals, lo, |m, x| if x > m { x } else { m });
    let mut b = Bracket {
        lo: key(lo),
        at_lo: vals.len(),
        hi: key(top) + 1,
        at_hi: 0,
    };
    while b.hi - b.lo > 1 && !enough(&b) {
        let mid = b.lo + (b.hi - b.lo) / 2;
        let at = count_at_least(isa, vals, unkey(mid));
        if at >= k {
            (b.lo, b.at_lo) = (mid, at);
        } else {
            (b.hi, b.at_hi) = (mid, at);
        }
    }
    b
}

/// A threshold that at least `k` of `vals` reach and at most `k + slack` do (fewer steps
/// than the exact `k`-th largest; more only where ties or values one key apart decide):
/// same input contract as [`bisect`].
#[inline(always)]
fn reached_by(isa: CpuIsa, vals: &[f32], lo: f32, k: usize, slack: usize) -> f32 {
    unkey(bisect(isa, vals, lo, k, |b| b.at_lo <= k + slack).lo)
}

/// The most values a bracket holds before [`kth_largest`] stops narrowing it and sorts them
/// (one thread, 32 rows of 2048, k 64: 3% faster than 16, whose sort cost more than the
/// two steps it saved).
const BRACKET: usize = 4;

/// The `k`-th largest of `vals` (same input contract as [`bisect`]) and how many values are
/// above it, exact for any input: [`bisect`] until at most [`BRACKET`] values lie in the
/// bracket, then those values sorted (`bin` holds them). A bracket one key wide holds one
/// value (its copies), and the values above it are those at or above its high end.
#[inline(always)]
fn kth_largest(isa: CpuIsa, vals: &[f32], lo: f32, k: usize, bin: &mut Vec<f32>) -> (f32, usize) {
    let b = bisect(isa, vals, lo, k, |b| b.at_lo - b.at_hi <= BRACKET);
    if b.hi - b.lo == 1 {
        return (unkey(b.lo), b.at_hi);
    }
    values_between(isa, vals, unkey(b.lo), unkey(b.hi), bin);
    bin.sort_unstable_by(|x, y| y.total_cmp(x));
    let big = bin[k - b.at_hi - 1];
    (big, b.at_hi + bin.iter().take_while(|&&x| x > big).count())
}

/// Replaces `bin` with the values of `vals` at or above `lo` and not at or above `hi`
/// (which may be NaN, the key past +inf: nothing is at or above it), in order:
/// branch-free, the passing lanes packed and stored whole as in [`scan_at_least`].
#[inline(always)]
fn values_between(isa: CpuIsa, vals: &[f32], lo: f32, hi: f32, bin: &mut Vec<f32>) {
    bin.clear();
    let done = match isa.isa() {
        // SAFETY: a `CpuIsa` names only a path this CPU supports (AVX-512F and POPCNT here).
        #[cfg(target_arch = "x86_64")]
        super::isa::Isa::Amx | super::isa::Isa::Avx512Bf16 | super::isa::Isa::Avx512 => unsafe {
            between_avx512(vals, lo, hi, bin)
        },
        // SAFETY: as above (AVX2 and POPCNT).
        #[cfg(target_arch = "x86_64")]
        super::isa::Isa::Avx2 => unsafe { between_avx2(vals, lo, hi, bin) },
        _ => 0,
    };
    // `x < hi` or `hi` NaN: not `x ≥ hi` for the values here (none NaN).
    bin.extend(
        vals[done..]
            .iter()
            .filter(|&&x| x >= lo && (x < hi || hi.is_nan())),
    );
}

/// The AVX-512 [`values_between`] over the first `vals.len() / 16 · 16` values (returned).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,popcnt")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
unsafe fn between_avx512(vals: &[f32], lo: f32, hi: f32, bin: &mut Vec<f32>) -> usize {
    use std::arch::x86_64::*;
    let n = vals.len() / 16 * 16;
    // Room for every value plus one whole vector past the last kept one.
    bin.reserve(n + 16);
    let (lv, hv, bp) = (_mm512_set1_ps(lo), _mm512_set1_ps(hi), bin.as_mut_ptr());
    let mut len = 0usize;
    let mut i = 0usize;
    while i < n {
        // SAFETY: `i + 16 ≤ n ≤ vals.len()`.
        let x = unsafe { raw::read::<__m512>(vals.as_ptr().add(i).cast()) };
        // `NGE_UQ`: not `x ≥ hi`, true where `hi` is NaN.
        let m =
            _mm512_mask_cmp_ps_mask::<_CMP_NGE_UQ>(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, lv), x, hv);
        // SAFETY: `len ≤ i` values kept so far and capacity `≥ n + 16`: the 16 lanes
        // stored at `len` stay inside the allocation.
        unsafe { raw::write::<__m512>(bp.add(len).cast(), _mm512_maskz_compress_ps(m, x)) };
        len += m.count_ones() as usize;
        i += 16;
    }
    // SAFETY: the first `len` values were written above (f32: any bits valid).
    unsafe { bin.set_len(len) };
    n
}

/// The AVX2 [`values_between`] over the first `vals.len() / 8 · 8` values (returned): the
/// passing lanes packed by a permutation from [`PACK8`].
///
/// # Safety
/// The CPU must support AVX2 and POPCNT.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
unsafe fn between_avx2(vals: &[f32], lo: f32, hi: f32, bin: &mut Vec<f32>) -> usize {
    use std::arch::x86_64::*;
    let n = vals.len() / 8 * 8;
    bin.reserve(n + 8);
    let (lv, hv, bp) = (_mm256_set1_ps(lo), _mm256_set1_ps(hi), bin.as_mut_ptr());
    let mut len = 0usize;
    let mut i = 0usize;
    while i < n {
        // SAFETY: `i + 8 ≤ n ≤ vals.len()`.
        let x = unsafe { raw::read::<__m256>(vals.as_ptr().add(i).cast()) };
        let pass = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GE_OQ>(x, lv),
            _mm256_cmp_ps::<_CMP_NGE_UQ>(x, hv),
        );
        let m = _mm256_movemask_ps(pass) as usize;
        // SAFETY: `m < 256`, a row of 8 u32 of the table; `len ≤ i` values kept so far
        // and capacity `≥ n + 8`: the 8 lanes stored at `len` stay inside the allocation.
        unsafe {
            let perm = raw::read::<__m256i>(PACK8[m].as_ptr().cast());
            raw::write::<__m256>(bp.add(len).cast(), _mm256_permutevar8x32_ps(x, perm));
        }
        len += m.count_ones() as usize;
        i += 8;
    }
    // SAFETY: the first `len` values were written above (f32: any bits valid).
    unsafe { bin.set_len(len) };
    n
}

/// Runs top-k over every row on the vector path `isa`. Inputs are validated by the caller.
pub fn topk(isa: CpuIsa, op: &Topk<'_>, logits: &[f32], out: &mut [i32]) {
    let k = op.k;
    for_each_indexed(out.chunks_mut(k).zip(op.rows), 1, |r, (dst, range)| {
        let row = &logits[r * op.row_stride..][range.start as usize..range.end as usize];
        let n = if op.short_rows == ShortRows::TakeAll && row.len() <= k {
            for (j, d) in dst[..row.len()].iter_mut().enumerate() {
                *d = j as i32;
            }
            row.len()
        } else {
            // The buffers of the rows this thread ran before: no allocation (and no
            // page faults on fresh memory) per task.
            SCRATCH.with_borrow_mut(|scratch| select_row_with(isa, row, k, dst, scratch))
        };
        let base = range.start as usize;
        match op.output {
            TopkOutput::Positions => {
                for p in &mut dst[..n] {
                    *p += base as i32;
                }
            }
            TopkOutput::Slots {
                page_table,
                page_size,
            } => page_table.slots_in_place(range.request as usize, base, &mut dst[..n], page_size),
        }
        dst[n..].fill(-1);
    });
}

/// Writes the positions (relative to `row`) of the top `k` valid entries of `row` into
/// `dst` in ascending order; returns how many were written (`min(k, valid count)`).
pub fn select_row(row: &[f32], k: usize, dst: &mut [i32]) -> usize {
    select_row_with(CpuIsa::get(), row, k, dst, &mut Scratch::default())
}

/// [`select_row`] on the vector path `isa` with reusable buffers.
fn select_row_with(isa: CpuIsa, row: &[f32], k: usize, dst: &mut [i32], s: &mut Scratch) -> usize {
    match prefiltered(isa, row, k, dst, s) {
        Some(n) => n,
        None => select_full(row, k, dst),
    }
}

/// Rows shorter than this skip the pre-filter (as do rows longer than [`BLOCK_ROW_MAX`]
/// and shorter than `4k`). Down to here the pre-filter beats the full path (one thread,
/// k = n/16, with a quarter-row sample: 1024 entries 3.75 → 1.29 µs, 256 entries 1.55 →
/// 1.18 µs).
const PREFILTER_MIN: usize = 256;
/// The longest row whose threshold comes from its blocks' maxima ([`block_threshold`], a
/// second pass over the row, in cache at this length) rather than a sample.
const BLOCK_ROW_MAX: usize = 16_384;
/// Sample size of the pre-filter (entries) from rows of `4 · SAMPLE` entries up; a quarter
/// of a shorter row.
const SAMPLE: usize = 2048;
/// Length of each contiguous run of the sample (entries).
const RUN: usize = 16;
/// How many more than asked the pre-filter's thresholds may keep (of the block maxima or
/// the sample), saving the bisection's last steps.
const SLACK: usize = 4;

thread_local! {
    /// The pre-filtered path's buffers of this thread.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// The working buffers of the pre-filtered path, reused across the rows a thread runs.
#[derive(Default)]
struct Scratch {
    /// The sample's valid entries.
    sample: Vec<f32>,
    /// Survivors' values and positions, in position order.
    vals: Vec<f32>,
    pos: Vec<i32>,
    /// The exact select's last bracket.
    bin: Vec<f32>,
    /// Survivors' positions as 16-bit words (the AVX-512 scan with VBMI2).
    words: Vec<u16>,
}

crate::isa_dispatch! {
    /// [`prefilter`] compiled for the path.
    fn prefiltered(row: &[f32], k: usize, dst: &mut [i32], s: &mut Scratch) -> Option<usize> =
        |ISA| prefilter(ISA, row, k, dst, s);
}

/// Replaces `vals`/`pos` with the entries of `row` that are `≥ t` and their positions, in
/// position order (`t` finite: NaN and `-inf` never pass). The scan is the pre-filter's one
/// pass over the row: a vector compare per 16 (AVX-512) or 8 (AVX2) lanes, branch-free; a
/// row of at most [`BLOCK_ROW_MAX`] entries on a CPU with VBMI2 packs its positions as
/// 16-bit words, 32 lanes at a time (one thread, 32 rows of 2048, k 64, Zen 4: 18.0 →
/// 14.7 µs).
#[inline(always)]
fn scan_at_least(
    isa: CpuIsa,
    row: &[f32],
    t: f32,
    vals: &mut Vec<f32>,
    pos: &mut Vec<i32>,
    words: &mut Vec<u16>,
) {
    vals.clear();
    pos.clear();
    let done = match isa.isa() {
        // SAFETY: a `CpuIsa` names only a path this CPU supports (AVX-512F and POPCNT here).
        #[cfg(target_arch = "x86_64")]
        super::isa::Isa::Amx | super::isa::Isa::Avx512Bf16 | super::isa::Isa::Avx512 => unsafe {
            if row.len() > BLOCK_ROW_MAX {
                scan_avx512::<true>(row, t, vals, pos)
            } else if has_word_compress() {
                // SAFETY: AVX-512BW and VBMI2 checked just now; `row.len() ≤ BLOCK_ROW_MAX
                // < 2¹⁶`.
                scan_avx512_words(row, t, vals, pos, words)
            } else {
                scan_avx512::<false>(row, t, vals, pos)
            }
        },
        // SAFETY: as above (AVX2 and POPCNT).
        #[cfg(target_arch = "x86_64")]
        super::isa::Isa::Avx2 => unsafe { scan_avx2(row, t, vals, pos) },
        _ => 0,
    };
    for (j, &x) in row.iter().enumerate().skip(done) {
        if x >= t {
            vals.push(x);
            pos.push(j as i32);
        }
    }
}

/// The AVX-512 scan over the first `row.len() / 16 · 16` entries (returned): the
/// positions of each vector's passing lanes are compressed into a register and stored
/// whole at the end of `pos` (which has room for 16 more), whether any pass or not: no
/// branch on the data (a few percent of lanes pass, so about half the vectors hold one,
/// and a branch on that mispredicts every other vector). The kept values are compressed
/// and stored the same way when `VALUES`, else read back from the row afterwards, as on
/// AVX2: cheaper while the row sits in L1 (one thread, 32 rows of 2048, k 64: 5% faster),
/// dearer once it has left it (64 rows of 65536, k 2048: 2.5% slower).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,popcnt")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
unsafe fn scan_avx512<const VALUES: bool>(
    row: &[f32],
    t: f32,
    vals: &mut Vec<f32>,
    pos: &mut Vec<i32>,
) -> usize {
    use std::arch::x86_64::*;
    let n = row.len() / 16 * 16;
    // Room for every entry plus one whole vector past the last kept one.
    pos.reserve(n + 16);
    if VALUES {
        vals.reserve(n + 16);
    }
    let (vp, pp) = (vals.as_mut_ptr(), pos.as_mut_ptr());
    let tv = _mm512_set1_ps(t);
    // The lanes' positions, stepped by 16 each vector (no broadcast of `i` per vector).
    let mut at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let sixteen = _mm512_set1_epi32(16);
    let mut len = 0usize;
    let mut i = 0usize;
    while i < n {
        // SAFETY: `i + 16 ≤ n ≤ row.len()`.
        let x = unsafe { raw::read::<__m512>(row.as_ptr().add(i).cast()) };
        let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, tv);
        // SAFETY: `len ≤ i` entries kept so far and capacity `≥ n + 16`, so the 16
        // lanes stored at `len` stay inside the allocation.
        unsafe {
            raw::write::<__m512i>(pp.add(len).cast(), _mm512_maskz_compress_epi32(m, at));
            if VALUES {
                raw::write::<__m512>(vp.add(len).cast(), _mm512_maskz_compress_ps(m, x));
            }
        }
        len += m.count_ones() as usize;
        at = _mm512_add_epi32(at, sixteen);
        i += 16;
    }
    // SAFETY: the first `len` entries were written above (i32: any bits valid), and
    // of `vals` too when `VALUES` (f32: any bits valid).
    unsafe {
        pos.set_len(len);
        if VALUES {
            vals.set_len(len);
        }
    }
    if !VALUES {
        vals.extend(pos.iter().map(|&j| row[j as usize]));
    }
    n
}

/// Whether this CPU compresses 16-bit lanes (AVX-512BW and VBMI2: Ice Lake and Zen 4 on,
/// not Skylake-X or Cooper Lake). Read once by std, then a load.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_word_compress() -> bool {
    std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vbmi2")
}

/// The AVX-512 scan of a row shorter than 2¹⁶ entries over its first `row.len() / 32 · 32`
/// entries (returned), as [`scan_avx512`] without values but 32 lanes at a time: the two
/// vectors' masks joined, the passing positions compressed as 16-bit words and stored
/// whole at the end of `words` (half the compresses and stores), then widened into `pos`
/// and the values read back from the row.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, VBMI2 and POPCNT; `row.len() ≤ 65536`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,popcnt")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
unsafe fn scan_avx512_words(
    row: &[f32],
    t: f32,
    vals: &mut Vec<f32>,
    pos: &mut Vec<i32>,
    words: &mut Vec<u16>,
) -> usize {
    use std::arch::x86_64::*;
    let n = row.len() / 32 * 32;
    words.clear();
    // Room for every entry plus one whole vector of 32 words past the last kept one.
    words.reserve(n + 32);
    let wp = words.as_mut_ptr();
    let tv = _mm512_set1_ps(t);
    let mut at = _mm512_set_epi16(
        31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,
        8, 7, 6, 5, 4, 3, 2, 1, 0,
    );
    let step = _mm512_set1_epi16(32);
    let mut len = 0usize;
    let mut i = 0usize;
    while i < n {
        // SAFETY: `i + 32 ≤ n ≤ row.len()`.
        let (x0, x1) = unsafe {
            (
                raw::read::<__m512>(row.as_ptr().add(i).cast()),
                raw::read::<__m512>(row.as_ptr().add(i + 16).cast()),
            )
        };
        let m = _mm512_kunpackw(
            _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x1, tv) as u32,
            _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x0, tv) as u32,
        );
        // SAFETY: `len ≤ i` words kept so far and capacity `≥ n + 32`: the 32 lanes stored
        // at `len` stay inside the allocation.
        unsafe { raw::write::<__m512i>(wp.add(len).cast(), _mm512_maskz_compress_epi16(m, at)) };
        len += m.count_ones() as usize;
        // Positions stay below 2¹⁶ (`row.len() ≤ 65536`): the 16-bit add does not wrap.
        at = _mm512_add_epi16(at, step);
        i += 32;
    }
    // SAFETY: the first `len` words were written above (u16: any bits valid).
    unsafe { words.set_len(len) };
    pos.extend(words.iter().map(|&j| i32::from(j)));
    vals.extend(words.iter().map(|&j| row[usize::from(j)]));
    n
}

/// For each 8-bit mask, the lanes whose bit is set, in order, then zeros: the permutation
/// that packs an AVX2 vector's passing lanes to its front.
#[cfg(target_arch = "x86_64")]
static PACK8: [[u32; 8]; 256] = {
    let mut t = [[0u32; 8]; 256];
    let mut m = 0;
    while m < 256 {
        let (mut j, mut n) = (0, 0);
        while j < 8 {
            if m & (1 << j) != 0 {
                t[m][n] = j as u32;
                n += 1;
            }
            j += 1;
        }
        m += 1;
    }
    t
};

/// The AVX2 scan over the first `row.len() / 8 · 8` entries (returned): a vector compare
/// per 8 lanes; every vector's passing positions are its first position plus the lanes
/// that [`PACK8`] lists for the mask, stored whole at the end of `pos` (which has room for
/// 8 more), branch-free as the AVX-512 scan; the kept values are read back from the row
/// afterwards (in cache, and one permute and store per vector fewer).
///
/// # Safety
/// The CPU must support AVX2 and POPCNT.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
unsafe fn scan_avx2(row: &[f32], t: f32, vals: &mut Vec<f32>, pos: &mut Vec<i32>) -> usize {
    use std::arch::x86_64::*;
    let n = row.len() / 8 * 8;
    pos.reserve(n + 8);
    let pp = pos.as_mut_ptr();
    let tv = _mm256_set1_ps(t);
    // The vector's first position in every lane, stepped by 8 each vector (built from `i`
    // each time, LLVM splits the add into two permutes, a broadcast and an `or`: three
    // shuffles a vector on the one port that runs them). The packed positions are then
    // that plus the table's lane numbers: an add, where permuting a vector of positions
    // took a lane-crossing `vpermd` (three micro-ops on Zen 1).
    let mut at = _mm256_setzero_si256();
    let eight = _mm256_set1_epi32(8);
    let mut len = 0usize;
    let mut i = 0usize;
    while i < n {
        // SAFETY: `i + 8 ≤ n ≤ row.len()`.
        let x = unsafe { raw::read::<__m256>(row.as_ptr().add(i).cast()) };
        let m = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(x, tv)) as usize;
        // SAFETY: `m < 256`, a row of 8 u32 (32 bytes) of the table.
        let lanes = unsafe { raw::read::<__m256i>(PACK8[m].as_ptr().cast()) };
        // SAFETY: `len ≤ i` entries kept so far and capacity `≥ n + 8`: the 8 lanes
        // stored at `len` stay inside the allocation.
        unsafe { raw::write::<__m256i>(pp.add(len).cast(), _mm256_add_epi32(at, lanes)) };
        len += m.count_ones() as usize;
        at = _mm256_add_epi32(at, eight);
        i += 8;
    }
    // SAFETY: the first `len` entries were written above (i32: any bits valid).
    unsafe { pos.set_len(len) };
    // The values from the row (in cache: just scanned), rather than a second permute and
    // store per vector.
    vals.extend(pos.iter().map(|&j| row[j as usize]));
    n
}

/// The pre-filtered path (module docs): `Some(k)` with the positions in `dst`, or `None`
/// when it does not apply or keeps fewer than `k`.
#[inline(always)]
fn prefilter(
    isa: CpuIsa,
    row: &[f32],
    k: usize,
    dst: &mut [i32],
    s: &mut Scratch,
) -> Option<usize> {
    let n = row.len();
    if n < PREFILTER_MIN {
        return None;
    }
    let t = match blocks(n, k) {
        Some(b) => block_threshold(isa, row, k, b, s)?,
        None if n >= 4 * k => sampled_threshold(isa, row, k, s)?,
        None => return None,
    };
    scan_at_least(isa, row, t, &mut s.vals, &mut s.pos, &mut s.words);
    if s.vals.len() < k {
        return None;
    }
    let (big, above) = kth_largest(isa, &s.vals, t, k, &mut s.bin);
    let eq_need = k - above;
    let out = take_top(isa, big, eq_need, &s.vals, &mut s.pos);
    debug_assert_eq!(out, k);
    dst[..k].copy_from_slice(&s.pos[..k]);
    Some(k)
}

/// Compacts `pos` in place to the positions of the survivors above `big` and of the first
/// `eq_need` equal to it (`vals[i]` is the value at `pos[i]`; position order kept); returns
/// how many it kept. The write index never passes the read index, so a vector path
/// stores whole vectors over lanes it has already read.
#[inline(always)]
fn take_top(isa: CpuIsa, big: f32, eq_need: usize, vals: &[f32], pos: &mut [i32]) -> usize {
    let (mut out, mut eq, mut i) = (0usize, 0usize, 0usize);
    match isa.isa() {
        // SAFETY: a `CpuIsa` names only a path this CPU supports (AVX-512F and POPCNT here).
        #[cfg(target_arch = "x86_64")]
        super::isa::Isa::Amx | super::isa::Isa::Avx512Bf16 | super::isa::Isa::Avx512 => unsafe {
            (out, eq, i) = take_top_avx512(big, eq_need, vals, pos);
        },
        // SAFETY: as above (AVX2 and POPCNT).
        #[cfg(target_arch = "x86_64")]
        super::isa::Isa::Avx2 => unsafe {
            (out, eq, i) = take_top_avx2(big, eq_need, vals, pos);
        },
        _ => {}
    }
    while i < vals.len() {
        let (v, p) = (vals[i], pos[i]);
        let is_eq = v == big;
        let take = v > big || (is_eq && eq < eq_need);
        eq += is_eq as usize;
        pos[out] = p;
        out += take as usize;
        i += 1;
    }
    out
}

/// The AVX-512 part of [`take_top`] over the first `vals.len() / 16 · 16` survivors: a
/// compare per 16 lanes, the kept positions compressed into a register and stored whole
/// at the write index; lanes equal to `big` (in one or a few vectors) are taken in order
/// up to `eq_need`. Returns (kept, equal lanes seen, survivors done).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT; `pos.len() == vals.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,popcnt")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
unsafe fn take_top_avx512(
    big: f32,
    eq_need: usize,
    vals: &[f32],
    pos: &mut [i32],
) -> (usize, usize, usize) {
    use std::arch::x86_64::*;
    let n = vals.len().min(pos.len()) / 16 * 16;
    let bv = _mm512_set1_ps(big);
    let pp = pos.as_mut_ptr();
    let (mut out, mut eq) = (0usize, 0usize);
    let mut i = 0usize;
    while i < n {
        // SAFETY: `i + 16 ≤ n ≤ len` of both slices.
        let (x, p) = unsafe {
            (
                raw::read::<__m512>(vals.as_ptr().add(i).cast()),
                raw::read::<__m512i>(pp.add(i).cast()),
            )
        };
        let take = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, bv) as u64
            | first_ties(
                _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(x, bv) as u64,
                &mut eq,
                eq_need,
            );
        let take = take as u16;
        // SAFETY: `out ≤ i`, so the 16 lanes stored at `out` end at or before `i + 16 ≤
        // n`: inside `pos`, over lanes already read.
        unsafe { raw::write::<__m512i>(pp.add(out).cast(), _mm512_maskz_compress_epi32(take, p)) };
        out += take.count_ones() as usize;
        i += 16;
    }
    (out, eq, i)
}

/// The AVX2 part of [`take_top`] over the first `vals.len() / 8 · 8` survivors: as the
/// AVX-512 one, with the kept lanes packed by a permutation from [`PACK8`].
///
/// # Safety
/// The CPU must support AVX2 and POPCNT.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
unsafe fn take_top_avx2(
    big: f32,
    eq_need: usize,
    vals: &[f32],
    pos: &mut [i32],
) -> (usize, usize, usize) {
    use std::arch::x86_64::*;
    let n = vals.len().min(pos.len()) / 8 * 8;
    let bv = _mm256_set1_ps(big);
    let pp = pos.as_mut_ptr();
    let (mut out, mut eq) = (0usize, 0usize);
    let mut i = 0usize;
    while i < n {
        // SAFETY: `i + 8 ≤ n ≤ len` of both slices.
        let (x, p) = unsafe {
            (
                raw::read::<__m256>(vals.as_ptr().add(i).cast()),
                raw::read::<__m256i>(pp.add(i).cast()),
            )
        };
        let ties = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(x, bv)) as u64;
        let take = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(x, bv)) as usize
            | first_ties(ties, &mut eq, eq_need) as usize;
        // SAFETY: `take < 256`, a row of 8 u32 of the table; `out ≤ i`, so the 8 lanes
        // stored at `out` end at or before `i + 8 ≤ n`: inside `pos`, over lanes already
        // read.
        unsafe {
            let perm = raw::read::<__m256i>(PACK8[take].as_ptr().cast());
            raw::write::<__m256i>(pp.add(out).cast(), _mm256_permutevar8x32_epi32(p, perm));
        }
        out += take.count_ones() as usize;
        i += 8;
    }
    (out, eq, i)
}

/// The lanes of `ties` (a mask of survivors equal to the k-th value) the top k takes: the
/// lowest ones, while fewer than `eq_need` have been taken (`eq` counts them across
/// vectors).
#[inline(always)]
fn first_ties(mut ties: u64, eq: &mut usize, eq_need: usize) -> u64 {
    let mut take = 0;
    while ties != 0 && *eq < eq_need {
        take |= ties & ties.wrapping_neg();
        ties &= ties - 1;
        *eq += 1;
    }
    take
}

/// How many blocks [`block_threshold`] splits a row of `n` entries into for its top `k`:
/// about `2k` (a multiple of 16), at least two entries a block, at most [`SAMPLE`]; `None`
/// where that leaves no more than `k` blocks, or the row is long enough that a sample is
/// cheaper than a second pass over it. (One thread, 32 rows of 2048, k 64: 1.00 µs a row
/// with `4k` blocks, 0.94 with `2k`; `1.5k` is no faster on AVX-512 and slower on AVX2.)
#[inline(always)]
fn blocks(n: usize, k: usize) -> Option<usize> {
    let b = (2 * k).min(n / 2).min(SAMPLE) / 16 * 16;
    (n <= BLOCK_ROW_MAX && b > k).then_some(b)
}

/// A threshold that at least `k` entries of `row` reach, from `b` blocks of the row
/// (block `j` holds the entries at `j`, `j + b`, `j + 2b`, … below `row.len() / b · b`):
/// a value that at least `k` and at most `k + SLACK` of the blocks' maxima reach (where
/// ties allow). The `k` blocks whose maxima reach it hold `k` distinct such entries, so
/// the scan keeps at least `k` whatever the row; on i.i.d. rows with `b = 2k` (the top half
/// of the maxima) it keeps about `1.4k`. One vectorised pass of maxima (NaN and `-inf`
/// never win), then [`reached_by`] over the `b` maxima. `None` when fewer than `k` blocks
/// hold a valid entry, or every block's maximum is `+inf`.
#[inline(always)]
fn block_threshold(isa: CpuIsa, row: &[f32], k: usize, b: usize, s: &mut Scratch) -> Option<f32> {
    let maxima = &mut s.sample;
    maxima.clear();
    let per_block = row.len() / b;
    // Sixty-four blocks at a time (four vectors: four chains of maxima in flight), then
    // sixteen, their maxima in registers (a loop over the whole row per block would store
    // and reload them every chunk).
    let wide = b / 64 * 64;
    for j in (0..wide).step_by(64) {
        maxima.extend_from_slice(&column_maxima::<64>(row, b, j, per_block));
    }
    for j in (wide..b).step_by(16) {
        maxima.extend_from_slice(&column_maxima::<16>(row, b, j, per_block));
    }
    // A block of invalid entries only (rare): its maximum is `-inf`.
    if maxima.iter().fold(false, |bad, &x| bad | !valid(x)) {
        maxima.retain(|&x| valid(x));
        if maxima.len() < k {
            return None;
        }
    }
    let lo = fold16(maxima, f32::INFINITY, |m, x| if x < m { x } else { m });
    if !lo.is_finite() {
        return None;
    }
    Some(reached_by(isa, &s.sample, lo, k, SLACK))
}

/// The maxima of blocks `j..j + W` of `row` split into blocks of stride `b` with
/// `per_block` entries each ([`block_threshold`]): `-inf` for a block without a valid entry.
#[inline(always)]
fn column_maxima<const W: usize>(row: &[f32], b: usize, j: usize, per_block: usize) -> [f32; W] {
    let mut m = [f32::NEG_INFINITY; W];
    for c in 0..per_block {
        for (m, &x) in m.iter_mut().zip(&row[c * b + j..][..W]) {
            // `x > m` is false for a NaN `x`: the maximum of the valid entries.
            *m = if x > *m { x } else { *m };
        }
    }
    m
}

/// A threshold from a sample of `row` (128 runs of 16 contiguous entries spread over it —
/// a few cache lines, not a pass — or on a row shorter than 8192 entries a quarter of it
/// in such runs) that about `1.5k` entries of the row reach, with slack; `None` when the
/// sample is too small to say.
#[inline(always)]
fn sampled_threshold(isa: CpuIsa, row: &[f32], k: usize, s: &mut Scratch) -> Option<f32> {
    let n = row.len();
    let runs = (n / (4 * RUN)).min(SAMPLE / RUN);
    s.sample.clear();
    for r in 0..runs {
        s.sample.extend_from_slice(&row[r * (n / runs)..][..RUN]);
    }
    // Invalid entries (`-inf`, NaN) are rare: a branch-free test, and a filter only when
    // the sample holds one.
    if s.sample.iter().fold(false, |bad, &x| bad | !valid(x)) {
        s.sample.retain(|&x| valid(x));
    }
    // Rank in the sample of about 1.5k entries of the row, plus slack.
    let rank = (3 * k * s.sample.len()).div_ceil(2 * n) + 16;
    if rank >= s.sample.len() {
        return None;
    }
    // The smallest sample value (no NaN in it: a plain compare is the minimum), then about
    // the sample's `rank + 1`-th largest (a value that `rank + 1` to `rank + 1 + SLACK` of
    // the sample reach).
    let lo = fold16(&s.sample, f32::INFINITY, |m, x| if x < m { x } else { m });
    if !lo.is_finite() {
        // Every sampled entry is +inf: the row decides nothing cheaper than the full path.
        return None;
    }
    Some(reached_by(isa, &s.sample, lo, rank + 1, SLACK))
}

/// `f` folded over `xs` from `init` in 16 independent lanes, then across them: a
/// branch-free `f` vectorises. `f` must be associative and commutative with `init` as its
/// identity (a minimum or a maximum), so the lanes give the sequential result.
#[inline(always)]
fn fold16(xs: &[f32], init: f32, f: impl Fn(f32, f32) -> f32 + Copy) -> f32 {
    let mut lanes = [init; 16];
    let mut chunks = xs.chunks_exact(16);
    for c in chunks.by_ref() {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = f(*m, x);
        }
    }
    let across = lanes.into_iter().fold(init, f);
    chunks.remainder().iter().fold(across, |m, &x| f(m, x))
}

/// The exact path over the whole row.
fn select_full(row: &[f32], k: usize, dst: &mut [i32]) -> usize {
    let mut hist = [0u32; 2048];
    let mut n_valid = 0usize;
    for &x in row {
        if valid(x) {
            hist[(key(x) >> 21) as usize] += 1;
            n_valid += 1;
        }
    }
    if n_valid <= k {
        let mut n = 0;
        for (i, &x) in row.iter().enumerate() {
            if valid(x) {
                dst[n] = i as i32;
                n += 1;
            }
        }
        return n;
    }
    let (bin, need) = find_bin(&hist, k);
    // Pass 2: certainly-selected positions and the threshold bin's candidates.
    let mut above: Vec<i32> = Vec::with_capacity(k - need);
    let mut cand: Vec<(u32, i32)> = Vec::with_capacity(hist[bin] as usize);
    for (i, &x) in row.iter().enumerate() {
        if valid(x) {
            let kk = key(x);
            let b = (kk >> 21) as usize;
            if b > bin {
                above.push(i as i32);
            } else if b == bin {
                cand.push((kk, i as i32));
            }
        }
    }
    // Refine the threshold inside the bin: bits 20..10, then 9..0.
    let mut need = need;
    let mut prefix_shift = 21u32;
    let mut threshold = (bin as u32) << 21;
    for (shift, bits) in [(10u32, 11u32), (0, 10)] {
        let mut h = [0u32; 2048];
        let mask = (1u32 << bits) - 1;
        for &(kk, _) in &cand {
            if kk >> prefix_shift == threshold >> prefix_shift {
                h[((kk >> shift) & mask) as usize] += 1;
            }
        }
        let (b, nn) = find_bin(&h[..1 << bits], need);
        threshold |= (b as u32) << shift;
        need = nn;
        prefix_shift = shift;
    }
    // Take candidates above the threshold, and the first `need` equal to it.
    let mut chosen: Vec<i32> = Vec::with_capacity(k - above.len());
    let mut eq = 0;
    for &(kk, i) in &cand {
        if kk > threshold || (kk == threshold && eq < need) {
            eq += (kk == threshold) as usize;
            chosen.push(i);
        }
    }
    // Merge the two ascending lists.
    let (mut a, mut c, mut n) = (0, 0, 0);
    while a < above.len() || c < chosen.len() {
        let take_a = c >= chosen.len() || (a < above.len() && above[a] < chosen[c]);
        dst[n] = if take_a {
            a += 1;
            above[a - 1]
        } else {
            c += 1;
            chosen[c - 1]
        };
        n += 1;
    }
    debug_assert_eq!(n, k);
    n
}

/// Scanning bins from the top, returns the bin holding the `k`-th largest entry and how
/// many entries of that bin are needed to complete `k`.
fn find_bin(hist: &[u32], k: usize) -> (usize, usize) {
    let mut above = 0usize;
    for b in (0..hist.len()).rev() {
        let c = hist[b] as usize;
        if above + c >= k {
            return (b, k - above);
        }
        above += c;
    }
    (0, k - above)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn naive(row: &[f32], k: usize) -> Vec<i32> {
        let mut idx: Vec<usize> = (0..row.len()).filter(|&i| valid(row[i])).collect();
        idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort_unstable();
        idx.into_iter().map(|i| i as i32).collect()
    }

    #[test]
    fn matches_naive_including_ties() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &(n, k, distinct) in &[
            (1000, 10, 1000u32),
            (5000, 100, 7),
            (5000, 4500, 3),
            (300, 300, 50),
            (10, 20, 5),
            (70000, 2048, 1),
            (70000, 2048, 2),
            (70000, 2048, 70000),
            (131_072, 2048, 50),
            (9000, 64, 9000),
        ] {
            let mut row: Vec<f32> = (0..n)
                .map(|_| (rng.gen_range(0..distinct) as f32 - 3.0) * 0.5)
                .collect();
            for _ in 0..n / 10 {
                let i = rng.gen_range(0..n);
                row[i] = if rng.gen() {
                    f32::NEG_INFINITY
                } else {
                    f32::NAN
                };
            }
            row[0] = -0.0;
            let mut dst = vec![-7; k];
            let m = select_row(&row, k, &mut dst);
            let want = naive(&row, k);
            assert_eq!(&dst[..m], &want[..], "n={n} k={k} distinct={distinct}");
        }
    }
}

#[cfg(test)]
mod prefilter_tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The pre-filtered path and the full path agree exactly, and the pre-filter really
    /// runs on random long rows.
    #[test]
    fn prefilter_matches_the_full_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &(n, k) in &[
            (65_536usize, 2048usize),
            (70_001, 100),
            (131_072, 2048),
            (20_000, 4000),
            // Short rows: the serving model's decode (2048 keys, top 64), a quarter-row
            // sample.
            (2048, 64),
            (1024, 16),
            (4099, 512),
        ] {
            let mut row: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
            // Some ties near the top and invalid entries.
            for _ in 0..n / 50 {
                let i = rng.gen_range(0..n);
                row[i] = if rng.gen() { 2.5 } else { f32::NEG_INFINITY };
            }
            row[7] = f32::NAN;
            let (mut a, mut b) = (vec![-1; k], vec![-1; k]);
            let nb = select_full(&row, k, &mut b);
            for isa in CpuIsa::available() {
                let s = &mut Scratch::default();
                let na = prefiltered(isa, &row, k, &mut a, s);
                assert_eq!(na, Some(k), "pre-filter applies to n={n} k={k}");
                assert_eq!((k, &a), (nb, &b), "n={n} k={k} {}", isa.isa());
            }
        }
    }
}

#[cfg(test)]
mod block_tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Rows short enough for the blocks' maxima: the pre-filter applies to every row
    /// with at least `k` valid entries — random walks, sorted rows, rows whose blocks are
    /// all invalid but a few, lengths that leave a tail outside the blocks — and agrees
    /// with the full path exactly on every vector path.
    #[test]
    fn block_threshold_keeps_at_least_k_on_any_row() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &(n, k) in &[
            (2048usize, 64usize),
            (2053, 64),
            (1000, 100),
            (16_384, 512),
            (257, 9),
        ] {
            assert!(
                blocks(n, k).is_some(),
                "n {n} k {k} takes the blocks' maxima"
            );
            for case in 0..6 {
                let mut walk = 0.0f32;
                let mut row: Vec<f32> = (0..n)
                    .map(|j| match case {
                        0 => rng.gen_range(-1.0..1.0),
                        1 => {
                            walk += rng.gen_range(-1.0f32..1.0);
                            walk
                        }
                        2 => j as f32,
                        3 => -(j as f32),
                        // Few distinct values: ties across the threshold.
                        4 => rng.gen_range(0..4) as f32,
                        _ => f32::NEG_INFINITY,
                    })
                    .collect();
                if case == 5 {
                    // Just over k valid entries, bunched into a few blocks, and a NaN.
                    let at = rng.gen_range(0..n - 2 * k);
                    for x in &mut row[at..at + k + 3] {
                        *x = rng.gen_range(-1.0..1.0);
                    }
                    row[at + 1] = f32::NAN;
                }
                let mut want = vec![-1; k];
                let nw = select_full(&row, k, &mut want);
                for isa in CpuIsa::available() {
                    let mut got = vec![-1; k];
                    let s = &mut Scratch::default();
                    let ng = prefiltered(isa, &row, k, &mut got, s);
                    assert_eq!(ng, Some(k), "n {n} k {k} case {case} {}", isa.isa());
                    assert_eq!(
                        (nw, &got),
                        (k, &want),
                        "n {n} k {k} case {case} {}",
                        isa.isa()
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod extreme_tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Survivors spanning the whole f32 range, +inf, signed zeros at the threshold and
    /// heavy ties: the pre-filtered select stays exact on every path.
    #[test]
    fn prefilter_is_exact_on_extreme_rows() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for (n, k, case) in (0..6)
            .map(|c| (40_000usize, 1000usize, c))
            .chain((0..6).map(|c| (2048, 64, c)))
        {
            let mut row: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            for _ in 0..n / 20 {
                let i = rng.gen_range(0..n);
                row[i] = match case {
                    0 => f32::INFINITY,
                    1 => f32::MAX * if rng.gen() { 1.0 } else { -1.0 },
                    2 => {
                        if rng.gen() {
                            0.0
                        } else {
                            -0.0
                        }
                    }
                    3 => 0.99,
                    4 => f32::MIN_POSITIVE * rng.gen_range(1.0..2.0),
                    _ => 1e-3 * rng.gen_range(0..3) as f32,
                };
            }
            if case == 2 || case == 5 {
                // The threshold among ties of zeros.
                for x in row.iter_mut().filter(|x| **x > 0.0) {
                    *x *= 1e-3;
                }
            }
            let mut b = vec![-1; k];
            let nb = select_full(&row, k, &mut b);
            for isa in CpuIsa::available() {
                let mut a = vec![-1; k];
                let s = &mut Scratch::default();
                if let Some(na) = prefiltered(isa, &row, k, &mut a, s) {
                    assert_eq!((na, &a), (nb, &b), "n {n} case {case} {}", isa.isa());
                }
                let mut c = vec![-1; k];
                let nc = select_row_with(isa, &row, k, &mut c, s);
                assert_eq!((nc, &c), (nb, &b), "n {n} case {case} {}", isa.isa());
            }
        }
    }
}

#[cfg(test)]
mod select_tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A random draw from awkward values: ties, signed zeros, infinities, the largest and
    /// the subnormal magnitudes, both signs.
    fn awkward(rng: &mut impl Rng, case: usize) -> f32 {
        match (case, rng.gen_range(0..10)) {
            (0, _) => rng.gen_range(-3.0f32..3.0),
            (1, _) => rng.gen_range(0..3) as f32,
            (_, 0) => f32::INFINITY,
            (_, 1) => {
                if rng.gen() {
                    0.0
                } else {
                    -0.0
                }
            }
            (_, 2) => f32::MAX * if rng.gen() { 1.0 } else { -1.0 },
            (_, 3) => f32::from_bits(rng.gen_range(1..0x0080_0000)),
            (_, 4) => -f32::from_bits(rng.gen_range(1..0x0080_0000)),
            (_, 5) => 1e30 * rng.gen_range(-1.0f32..1.0),
            _ => rng.gen_range(-1e-3f32..1e-3),
        }
    }

    /// The bisection's exact select, its thresholds and the bracket's extraction agree
    /// with a sort on every vector path, at lengths that leave every tail of a vector.
    #[test]
    fn bisection_selects_match_a_sort() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for trial in 0..600 {
            let n = match trial % 3 {
                0 => rng.gen_range(1..40),
                1 => rng.gen_range(40..300),
                _ => rng.gen_range(300..3000),
            };
            let case = trial % 4;
            let vals: Vec<f32> = (0..n).map(|_| awkward(&mut rng, case)).collect();
            let mut sorted = vals.clone();
            sorted.sort_by(|x, y| y.total_cmp(x));
            let lo = *sorted.last().expect("n > 0");
            let k = rng.gen_range(1..=n);
            let at_least = |t: f32| vals.iter().filter(|&&x| x >= t).count();
            for isa in CpuIsa::available() {
                let name = isa.isa();
                let (got, above) = kth_largest(isa, &vals, lo, k, &mut Vec::new());
                assert!(
                    got == sorted[k - 1],
                    "{name} n {n} k {k} case {case}: {got} vs {}",
                    sorted[k - 1]
                );
                let want_above = vals.iter().filter(|&&x| x > got).count();
                assert_eq!(
                    above, want_above,
                    "{name} n {n} k {k} case {case}: above {got}"
                );
                let t = reached_by(isa, &vals, lo, k, SLACK);
                let at = at_least(t);
                assert!(
                    at >= k && t <= sorted[k - 1],
                    "{name} n {n} k {k}: {t} {at}"
                );
                assert!(
                    at <= k + SLACK || at_least(unkey(key(t) + 1)) < k,
                    "{name} n {n} k {k} case {case}: {at} reach {t}"
                );
                for t in [lo, sorted[k - 1], sorted[n / 2]] {
                    let want = (0..n).filter(|&i| vals[i] >= t).count();
                    assert_eq!(count_at_least(isa, &vals, t), want, "{name}");
                }
                let (a, b) = (
                    sorted[n - 1 - rng.gen_range(0..n)],
                    sorted[rng.gen_range(0..n)],
                );
                for hi in [b, f32::NAN] {
                    let mut bin = vec![f32::NAN; 3];
                    values_between(isa, &vals, a, hi, &mut bin);
                    let want: Vec<f32> = vals
                        .iter()
                        .copied()
                        .filter(|&x| x >= a && (x < hi || hi.is_nan()))
                        .collect();
                    assert_eq!(
                        bin.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "{name} n {n} [{a}, {hi})"
                    );
                }
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod scan_tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every vector scan this CPU runs keeps exactly the entries `≥ t` with their
    /// positions, in order: the one a path picks and the ones it passes over here (the
    /// 16-bit one where VBMI2 is present, the 32-bit one otherwise).
    #[test]
    fn every_scan_keeps_what_a_filter_keeps() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for _ in 0..300 {
            let n = rng.gen_range(0..BLOCK_ROW_MAX + 1);
            let mut row: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            for _ in 0..n / 50 {
                let i = rng.gen_range(0..n);
                row[i] = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, -0.0][rng.gen_range(0..4)];
            }
            let t = if n > 0 && rng.gen() {
                row[rng.gen_range(0..n)].clamp(-1.0, 1.0)
            } else {
                rng.gen_range(-1.0f32..1.0)
            };
            let want: Vec<(i32, u32)> = (0..n)
                .filter(|&j| row[j] >= t)
                .map(|j| (j as i32, row[j].to_bits()))
                .collect();
            // Each scan, finished by the scalar tail as `scan_at_least` does.
            let check = |name: &str, done: usize, vals: &mut Vec<f32>, pos: &mut Vec<i32>| {
                for (j, &x) in row.iter().enumerate().skip(done) {
                    if x >= t {
                        vals.push(x);
                        pos.push(j as i32);
                    }
                }
                let got: Vec<(i32, u32)> = pos
                    .iter()
                    .zip(vals.iter())
                    .map(|(&p, v)| (p, v.to_bits()))
                    .collect();
                assert_eq!(got, want, "{name} n {n} t {t}");
            };
            let (mut vals, mut pos, mut words) = (Vec::new(), Vec::new(), Vec::new());
            let popcnt = std::arch::is_x86_feature_detected!("popcnt");
            if popcnt && std::arch::is_x86_feature_detected!("avx2") {
                vals.clear();
                pos.clear();
                // SAFETY: AVX2 and POPCNT checked just now.
                let done = unsafe { scan_avx2(&row, t, &mut vals, &mut pos) };
                check("avx2", done, &mut vals, &mut pos);
            }
            if popcnt && std::arch::is_x86_feature_detected!("avx512f") {
                vals.clear();
                pos.clear();
                // SAFETY: AVX-512F and POPCNT checked just now.
                let done = unsafe { scan_avx512::<false>(&row, t, &mut vals, &mut pos) };
                check("avx512", done, &mut vals, &mut pos);
                vals.clear();
                pos.clear();
                // SAFETY: as above.
                let done = unsafe { scan_avx512::<true>(&row, t, &mut vals, &mut pos) };
                check("avx512 values", done, &mut vals, &mut pos);
            }
            if popcnt && std::arch::is_x86_feature_detected!("avx512f") && has_word_compress() {
                vals.clear();
                pos.clear();
                // SAFETY: AVX-512F, BW, VBMI2 and POPCNT checked just now; `n ≤
                // BLOCK_ROW_MAX`.
                let done = unsafe { scan_avx512_words(&row, t, &mut vals, &mut pos, &mut words) };
                check("avx512 words", done, &mut vals, &mut pos);
            }
        }
    }
}
