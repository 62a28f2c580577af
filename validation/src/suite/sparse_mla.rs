//! `sparse_mla` cases: tokens with no, few and full slot lists (shuffled, `-1` mixed in)
//! over paged KV pools, against the f64 reference (output and lse).

use half::bf16;
use sparsekit_host::dims::ModelDims;
use sparsekit_host::layout::{KvDtype, KvLayout};
use sparsekit_host::ops::{Op, SparseMla};
use sparsekit_host::{Backend, Error};

use super::record::Outcome;
use crate::fixtures::{self, bytes_of, mla_indices, Paging, SuiteRng};
use crate::reference;
use crate::tolerance::{self, ErrorStats, Quantity};

/// One `sparse_mla` case (two records: out and lse).
pub(super) fn sparse_mla<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    dt: KvDtype,
    h: usize,
    lens: &[u32],
) -> Result<Vec<Outcome>, Error> {
    let layout = KvLayout::new(dt, d.kv_lora_rank, d.qk_rope_dim, d.page_size)?;
    let paging = Paging::new(rng, d.page_size, lens, 2);
    let cache = fixtures::kv_pool(rng, &layout, &paging);
    let (n_tokens, topk) = (6, d.index_topk);
    let indices = mla_indices(rng, &paging, n_tokens, topk);
    let q = fixtures::bf16_normal(rng, n_tokens * h * layout.d_qk(), 1.0);
    let scale = 1.0 / (layout.d_qk() as f32).sqrt();
    let op = SparseMla {
        layout,
        n_tokens,
        n_heads: h,
        topk,
        softmax_scale: scale,
    };
    let mut out = b.upload(&fixtures::poison_bf16(n_tokens * h * layout.nope_dim()))?;
    let mut lse = b.upload(&fixtures::poison_f32(n_tokens * h))?;
    b.sparse_mla(
        &op,
        &b.upload(bytes_of(&q))?,
        &b.upload(&cache)?,
        &b.upload(bytes_of(&indices))?,
        &mut out,
        &mut lse,
    )?;
    let got_out: Vec<bf16> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    let got_lse: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&lse)?);
    let want = reference::sparse_mla(&layout, &cache, &q, &indices, n_tokens, h, topk, scale);
    let (to, tl) = (
        tolerance::get(Op::SparseMla, Quantity::Out, dt.into())?,
        tolerance::get(Op::SparseMla, Quantity::Lse, dt.into())?,
    );
    let dv = layout.nope_dim();
    let mut so = ErrorStats::default();
    for (i, g) in got_out.iter().enumerate() {
        so.add(i, g.to_f64(), want.out[i], want.out_magnitude[i / dv], to);
    }
    let mut sl = ErrorStats::default();
    for (i, g) in got_lse.iter().enumerate() {
        sl.add(i, *g as f64, want.lse[i], want.lse_magnitude[i], tl);
    }
    Ok(vec![
        Outcome::new(Quantity::Out, so, to),
        Outcome::new(Quantity::Lse, sl, tl),
    ])
}
