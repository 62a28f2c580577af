//! `indexer_logits` cases: decode (`next_n` 1 and 2) and prefill rows over paged index-K
//! pools with shuffled pages, against the f64 reference.

use sparsekit_host::dims::ModelDims;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout};
use sparsekit_host::ops::{decode_rows, IndexerLogits, Op, PageTable};
use sparsekit_host::{Backend, Error};

use super::plan::Form;
use super::record::Outcome;
use crate::fixtures::{self, bytes_of, indexer_inputs, prefill_rows, Paging, SuiteRng};
use crate::reference;
use crate::tolerance::{self, ErrorStats, Quantity};

/// One `indexer_logits` case.
pub(super) fn indexer_logits<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    dt: IndexKDtype,
    form: &Form,
    lens: &[u32],
) -> Result<Outcome, Error> {
    let layout = IndexKLayout::new(dt, d.index_head_dim, d.page_size)?;
    let paging = Paging::new(rng, d.page_size, lens, 3);
    let cache = fixtures::index_k_pool(rng, &layout, &paging);
    let rows = match form {
        Form::Decode(n) => decode_rows(lens, *n)?,
        Form::Prefill => prefill_rows(rng, lens),
    };
    let row_stride = rows.iter().map(|r| r.end as usize).max().unwrap_or(0) + 13;
    let h = d.index_n_heads;
    let (q, w) = indexer_inputs(rng, rows.len(), h, layout.head_dim());
    let pt = PageTable::new(&paging.table, paging.max_pages)?;
    let op = IndexerLogits {
        layout,
        n_heads: h,
        page_table: pt,
        rows: rows.clone(),
        row_stride,
    };
    let mut out = b.upload(&fixtures::poison_f32(rows.len() * row_stride))?;
    b.indexer_logits(
        &op,
        &b.upload(bytes_of(&q))?,
        &b.upload(bytes_of(&w))?,
        &b.upload(&cache)?,
        &mut out,
    )?;
    let got: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    let want = reference::indexer_logits(&layout, &cache, &pt, &rows, h, &q, &w, row_stride);
    let t = tolerance::get(Op::IndexerLogits, Quantity::Logits, dt.into())?;
    let mut stats = ErrorStats::default();
    for (i, g) in got.iter().enumerate() {
        stats.add(i, *g as f64, want.logits[i], want.magnitude[i], t);
    }
    let mut o = Outcome::new(Quantity::Logits, stats, t);
    o.note = format!(
        "{} rows, longest context {}",
        rows.len(),
        lens.iter().max().unwrap_or(&0)
    );
    Ok(o)
}
