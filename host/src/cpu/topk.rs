//! CPU exact top-k: a radix select per row.
//!
//! Values map to order-preserving u32 keys (`-0.0` folded into `+0.0`). Pass 1 builds a
//! histogram of the top 11 key bits over the row's valid entries and finds the bin that
//! holds the k-th largest. Pass 2 keeps every position above that bin (certainly selected)
//! and collects the bin's entries as candidates; two more 11/10-bit radix rounds over the
//! candidates find the exact threshold key and how many entries equal to it are taken
//! (the lowest positions). Output is the merge of both position-ordered lists, so the row
//! is written in ascending position order. Exact for every input, ties included.

use rayon::prelude::*;

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

/// Runs top-k over every row. Inputs are validated by the caller.
pub fn topk(op: &Topk<'_>, logits: &[f32], out: &mut [i32]) {
    let k = op.k;
    out.par_chunks_mut(k)
        .zip(op.rows.par_iter())
        .enumerate()
        .for_each(|(r, (dst, range))| {
            let row = &logits[r * op.row_stride..][range.start as usize..range.end as usize];
            let n = if op.short_rows == ShortRows::TakeAll && row.len() <= k {
                for (j, d) in dst[..row.len()].iter_mut().enumerate() {
                    *d = j as i32;
                }
                row.len()
            } else {
                select_row(row, k, dst)
            };
            let base = range.start as usize;
            for p in &mut dst[..n] {
                let pos = *p as usize + base;
                *p = match op.output {
                    TopkOutput::Positions => pos as i32,
                    TopkOutput::Slots {
                        page_table,
                        page_size,
                    } => page_table.slot(range.request as usize, pos, page_size) as i32,
                };
            }
            dst[n..].fill(-1);
        });
}

/// Writes the positions (relative to `row`) of the top `k` valid entries of `row` into
/// `dst` in ascending order; returns how many were written (`min(k, valid count)`).
pub fn select_row(row: &[f32], k: usize, dst: &mut [i32]) -> usize {
    match prefiltered(row, k) {
        Some(cand) => select_candidates(&cand, k, dst),
        None => select_full(row, k, dst),
    }
}

/// Rows shorter than this (or than `4k`) skip the pre-filter.
const PREFILTER_MIN: usize = 8192;
/// Sample size of the pre-filter (entries).
const SAMPLE: usize = 2048;

/// The pre-filter's survivors `(key, position)` in position order, or `None` when it does
/// not apply or keeps fewer than `k`.
fn prefiltered(row: &[f32], k: usize) -> Option<Vec<(u32, i32)>> {
    let n = row.len();
    if n < PREFILTER_MIN || n < 4 * k {
        return None;
    }
    // 64 runs of 32 contiguous entries spread over the row: a few cache lines, not a pass.
    let runs = SAMPLE / 32;
    let mut sample: Vec<f32> = (0..runs)
        .flat_map(|r| row[r * (n / runs)..][..32].iter().copied())
        .filter(|&x| valid(x))
        .collect();
    // Rank in the sample of about 2k entries of the row, plus slack.
    let rank = (2 * k * sample.len()).div_ceil(n) + 16;
    if rank >= sample.len() {
        return None;
    }
    sample.select_nth_unstable_by(rank, |a, b| b.total_cmp(a));
    let t = sample[rank];
    let mut cand = Vec::with_capacity(4 * k);
    // 16 lanes at a time: a compare mask (vectorised), then only the set bits are visited.
    // Comparisons with NaN are false and t is finite: invalid entries never pass.
    let mut chunks = row.chunks_exact(16);
    let mut base = 0usize;
    for c in chunks.by_ref() {
        let mut m = 0u32;
        for (j, &x) in c.iter().enumerate() {
            m |= ((x >= t) as u32) << j;
        }
        while m != 0 {
            let j = m.trailing_zeros() as usize;
            cand.push((key(c[j]), (base + j) as i32));
            m &= m - 1;
        }
        base += 16;
    }
    for (j, &x) in chunks.remainder().iter().enumerate() {
        if x >= t {
            cand.push((key(x), (base + j) as i32));
        }
    }
    (cand.len() >= k).then_some(cand)
}

/// Exact top-`k` of position-ordered candidates (at least `k` of them).
fn select_candidates(cand: &[(u32, i32)], k: usize, dst: &mut [i32]) -> usize {
    let mut threshold = 0u32;
    let mut need = k;
    let mut prefix_shift = 32u32;
    for (shift, bits) in [(21u32, 11u32), (10, 11), (0, 10)] {
        let mut h = [0u32; 2048];
        let mask = (1u32 << bits) - 1;
        for &(kk, _) in cand {
            if prefix_shift == 32 || kk >> prefix_shift == threshold >> prefix_shift {
                h[((kk >> shift) & mask) as usize] += 1;
            }
        }
        let (b, nn) = find_bin(&h[..1 << bits], need);
        threshold |= (b as u32) << shift;
        need = nn;
        prefix_shift = shift;
    }
    let mut n = 0;
    let mut eq = 0;
    for &(kk, i) in cand {
        if kk > threshold || (kk == threshold && eq < need) {
            eq += (kk == threshold) as usize;
            dst[n] = i;
            n += 1;
        }
    }
    debug_assert_eq!(n, k);
    n
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
        ] {
            let mut row: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
            // Some ties near the top and invalid entries.
            for _ in 0..n / 50 {
                let i = rng.gen_range(0..n);
                row[i] = if rng.gen() { 2.5 } else { f32::NEG_INFINITY };
            }
            row[7] = f32::NAN;
            assert!(
                prefiltered(&row, k).is_some(),
                "pre-filter applies to n={n} k={k}"
            );
            let (mut a, mut b) = (vec![-1; k], vec![-1; k]);
            let na = select_row(&row, k, &mut a);
            let nb = select_full(&row, k, &mut b);
            assert_eq!((na, &a), (nb, &b), "n={n} k={k}");
        }
    }
}
