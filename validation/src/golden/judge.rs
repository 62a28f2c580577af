//! Judging a backend's outputs against a file's expected tensors: tolerance widening for
//! rounded expected values, per-quantity reports, byte comparison of caches, the top-k
//! tie rule.

use sparsekit_host::ops::{QueryRange, ShortRows, TopkOutput};

use super::{ExpectedFrom, QuantityReport};
use crate::reference;
use crate::tolerance::{DataType, ErrorStats, Tolerance};

/// The reference top-k of one row (`row` = the whole logits row), padded with `-1`.
pub(super) fn topk_want(
    row: &[f32],
    range: &QueryRange,
    k: usize,
    output: &TopkOutput<'_>,
    short: ShortRows,
) -> Vec<i32> {
    let (s, e) = (range.start as usize, range.end as usize);
    let pick = match short {
        ShortRows::SelectValid => reference::topk_row(&row[s..e], k),
        ShortRows::TakeAll => reference::topk_transform(&row[s..e], k),
    };
    let mut want: Vec<i32> = pick
        .into_iter()
        .map(|p| encode_position(output, range, s + p))
        .collect();
    want.resize(k, -1);
    want
}

/// The reference top-k of one row by the tie rule (`-1` padding; `short`: what a row of
/// at most `k` positions gives), and the logit that each output entry of the row's range
/// selects (an entry not in the map selects nothing of the range).
pub fn topk_expected(
    row: &[f32],
    range: &QueryRange,
    k: usize,
    output: &TopkOutput<'_>,
    short: ShortRows,
) -> (Vec<i32>, std::collections::HashMap<i32, f64>) {
    let (s, e) = (range.start as usize, range.end as usize);
    let by_entry = (s..e.min(row.len()))
        .map(|pos| (encode_position(output, range, pos), row[pos] as f64))
        .collect();
    (topk_want(row, range, k, output, short), by_entry)
}

/// [`topk_expected`] with the map holding only the entries of `got` and of the reference's
/// pick (all a judge of the row looks up), each with the value `topk_expected` gives it:
/// no map of the whole range per row (the serving audit's top-k check spent more on
/// that map than on the selection).
pub fn topk_expected_for(
    row: &[f32],
    range: &QueryRange,
    k: usize,
    output: &TopkOutput<'_>,
    short: ShortRows,
    got: &[i32],
) -> (Vec<i32>, std::collections::HashMap<i32, f64>) {
    let want = topk_want(row, range, k, output, short);
    let (s, e) = (range.start as usize, (range.end as usize).min(row.len()));
    let needed: std::collections::HashSet<i32> = got
        .iter()
        .chain(&want)
        .copied()
        .filter(|&v| v >= 0)
        .collect();
    let by_entry = match output {
        // An entry is its position.
        TopkOutput::Positions => needed
            .iter()
            .filter(|&&v| (s..e).contains(&(v as usize)))
            .map(|&v| (v, row[v as usize] as f64))
            .collect(),
        // Positions in order, as `topk_expected` maps them (a later position of the same
        // slot wins there too).
        TopkOutput::Slots { .. } => (s..e)
            .map(|pos| (encode_position(output, range, pos), pos))
            .filter(|(c, _)| needed.contains(c))
            .map(|(c, pos)| (c, row[pos] as f64))
            .collect(),
    };
    (want, by_entry)
}

pub(super) fn encode_position(output: &TopkOutput<'_>, range: &QueryRange, pos: usize) -> i32 {
    match output {
        TopkOutput::Positions => pos as i32,
        TopkOutput::Slots {
            page_table,
            page_size,
        } => page_table.slot(range.request as usize, pos, *page_size) as i32,
    }
}

/// Widens a tolerance row for expected values rounded to their dtype (`rounding`: the
/// relative half-ulp, 2^-8 for bf16 and 2^-24 for f32), doubled for kernel-made values.
pub(super) fn widen(t: &Tolerance, from: ExpectedFrom, rounding: f64) -> Tolerance {
    let f = match from {
        ExpectedFrom::Reference => 1.0,
        ExpectedFrom::Kernel => 2.0,
    };
    Tolerance {
        atol: t.atol * f,
        rtol: t.rtol * f + rounding,
        ..*t
    }
}

/// Relative half-ulp of bf16 (expected values rounded to bf16).
pub(super) const BF16_ROUNDING: f64 = 1.0 / 256.0;
/// Relative half-ulp of f32.
pub(super) const F32_ROUNDING: f64 = 1.0 / 16_777_216.0;

pub(super) fn quantity(
    name: &'static str,
    t: &Tolerance,
    mut stats: ErrorStats,
    shape: &[usize],
) -> QuantityReport {
    stats.finish();
    let detail = stats.first_failure.map_or(String::new(), |(i, got, want)| {
        format!(
            "{} of {} elements out of tolerance; first at {name}{:?}: got {got}, expected {want}",
            stats.failures,
            stats.count,
            unflatten(i, shape)
        )
    });
    QuantityReport {
        name,
        tolerance: t.describe(),
        pass: stats.pass(),
        stats,
        detail,
    }
}

/// Row-major coordinates of flat index `i` in `shape`.
fn unflatten(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut c = vec![0; shape.len()];
    for (ci, &s) in c.iter_mut().zip(shape).rev() {
        *ci = i % s.max(1);
        i /= s.max(1);
    }
    c
}

/// Byte comparison of a whole cache (the pass criterion), reported as `name`, with the
/// errors of the dequantised values at `slots` as figures.
pub(super) fn compare_cache(
    name: &'static str,
    t: &Tolerance,
    got: &[u8],
    want: &[u8],
    slots: &[i64],
    bytes_per_page: usize,
    read: impl Fn(&[u8], usize) -> Vec<f64>,
) -> QuantityReport {
    let mut values = ErrorStats::default();
    for &s in slots.iter().filter(|&&s| s >= 0) {
        for (g, w) in read(got, s as usize)
            .into_iter()
            .zip(read(want, s as usize))
        {
            values.add(0, g, w, 0.0, t);
        }
    }
    values.finish();
    let mut stats = ErrorStats::default();
    stats.count = got.len();
    stats.max_abs_err = values.max_abs_err;
    stats.max_rel_err = values.max_rel_err;
    for (i, (g, w)) in got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g != w)
    {
        stats.failures += 1;
        stats.first_failure.get_or_insert((i, *g as f64, *w as f64));
    }
    stats.worst_ratio = if stats.failures > 0 {
        f64::INFINITY
    } else {
        0.0
    };
    let detail = stats.first_failure.map_or(String::new(), |(i, g, w)| {
        format!(
            "{} of {} bytes differ; first at page {}, byte {}: got {g:#04x}, expected {w:#04x}",
            stats.failures,
            stats.count,
            i / bytes_per_page,
            i % bytes_per_page,
            g = g as u8,
            w = w as u8
        )
    });
    QuantityReport {
        name,
        tolerance: t.describe(),
        pass: stats.failures == 0 && stats.count > 0,
        stats,
        detail,
    }
}

/// What one op's check produced.
pub(super) struct Judged {
    pub dtype: DataType,
    pub quantities: Vec<QuantityReport>,
    pub notes: Vec<String>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use sparsekit_host::ops::PageTable;

    use super::*;

    /// The restricted map holds every entry a judge looks up, with `topk_expected`'s value,
    /// for both output kinds, short rows and entries that select nothing of the range.
    #[test]
    fn topk_expected_for_agrees_with_topk_expected_on_every_entry_it_is_asked() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let ps = 16;
        // Request 1's pages in a shuffled order (one repeated, as a corrupt table might).
        let mut pages: Vec<i32> = (0..8).collect();
        pages.shuffle(&mut rng);
        pages[7] = pages[2];
        let table: Vec<i32> = (100..108).chain(pages).collect();
        let page_table = PageTable::new(&table, 8).unwrap();
        let row: Vec<f32> = (0..8 * ps).map(|_| rng.gen_range(-4.0..4.0)).collect();
        for output in [
            TopkOutput::Positions,
            TopkOutput::Slots {
                page_table,
                page_size: ps,
            },
        ] {
            for (start, end, k) in [(5, 120, 17), (0, 128, 64), (30, 40, 16), (3, 127, 9)] {
                for short in [ShortRows::SelectValid, ShortRows::TakeAll] {
                    let range = QueryRange {
                        request: 1,
                        start,
                        end,
                    };
                    let end = (end as usize).min(row.len());
                    // The kernel's picks: some in range, some outside it, padding.
                    let mut got: Vec<i32> = (0..k)
                        .map(|_| match rng.gen_range(0..4) {
                            0 => -1,
                            1 => rng.gen_range(-5..300),
                            _ => {
                                encode_position(&output, &range, rng.gen_range(start as usize..end))
                            }
                        })
                        .collect();
                    got.sort_unstable();
                    let (want, all) = topk_expected(&row, &range, k, &output, short);
                    let (want2, some) = topk_expected_for(&row, &range, k, &output, short, &got);
                    assert_eq!(want, want2);
                    for v in got.iter().chain(&want) {
                        assert_eq!(some.get(v), all.get(v), "entry {v}");
                    }
                    assert!(!some.is_empty());
                }
            }
        }
    }
}
