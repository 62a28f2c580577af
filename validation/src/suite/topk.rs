//! `topk` cases: rows of every length class (shorter than k, k ± 1, 64K+), adversarial
//! ties and invalid entries, output as cache slots; judged by exact positions and values.
//! DeepSeek-V4's transform ([`ShortRows::TakeAll`]) at its k (512, 1024) and page 64.

use sparsekit_host::ops::{Op, PageTable, QueryRange, ShortRows, Topk, TopkOutput};
use sparsekit_host::{Backend, Error};

use super::record::Outcome;
use crate::fixtures::{self, bytes_of, topk_logits, Paging, Scenario, SuiteRng};
use crate::reference;
use crate::tolerance::{self, judge_topk_row, DataType, ErrorStats, Quantity};

/// One `topk` case.
pub(super) fn topk<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    k: usize,
    ps: usize,
    sc: Scenario,
    lens: &[u32],
    short: ShortRows,
) -> Result<Outcome, Error> {
    let stride = *lens.iter().max().unwrap_or(&1) as usize + 7;
    let logits = topk_logits(rng, k, sc, lens, stride);
    let paging = Paging::new(rng, ps, lens, 1);
    let pt = PageTable::new(&paging.table, paging.max_pages)?;
    let rows: Vec<QueryRange> = lens
        .iter()
        .enumerate()
        .map(|(r, &len)| QueryRange {
            request: r as u32,
            start: 0,
            end: len,
        })
        .collect();
    let op = Topk {
        short_rows: short,
        k,
        row_stride: stride,
        rows: &rows,
        output: TopkOutput::Slots {
            page_table: pt,
            page_size: ps,
        },
    };
    let mut out = b.upload(&fixtures::poison_i32(rows.len() * k))?;
    b.topk(&op, &b.upload(bytes_of(&logits))?, &mut out)?;
    let got: Vec<i32> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    let t = tolerance::get(Op::Topk, Quantity::Indices, DataType::Fp32)?;
    let mut stats = ErrorStats::default();
    for (r, &len) in lens.iter().enumerate() {
        let row = &logits[r * stride..r * stride + len as usize];
        let pos = match short {
            ShortRows::SelectValid => reference::topk_row(row, k),
            ShortRows::TakeAll => reference::topk_transform(row, k),
        };
        let mut want: Vec<i32> = pos.iter().map(|&p| paging.slot(r, p) as i32).collect();
        let want_vals: Vec<f64> = pos.iter().map(|&p| row[p] as f64).collect();
        want.resize(k, -1);
        let g = &got[r * k..(r + 1) * k];
        // Map returned slots back to positions to read their values.
        let slot_to_pos: std::collections::HashMap<i64, usize> =
            (0..len as usize).map(|p| (paging.slot(r, p), p)).collect();
        let got_vals: Vec<f64> = g
            .iter()
            .filter(|&&s| s != -1)
            .map(|&s| {
                slot_to_pos
                    .get(&(s as i64))
                    .map_or(f64::NAN, |&p| row[p] as f64)
            })
            .collect();
        judge_topk_row(&mut stats, r * k, g, &want, &got_vals, &want_vals);
    }
    let mut o = Outcome::new(Quantity::Indices, stats, t);
    o.note = format!("k={k}, rows {lens:?}, short rows {short:?}");
    Ok(o)
}
