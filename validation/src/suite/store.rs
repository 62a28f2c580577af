//! `index_k_store` and `kv_store` cases: random tokens of a ragged batch (one crossing a
//! page boundary, `-1` padding) stored into a garbage-filled cache, compared byte for byte
//! with the reference store (and as dequantised values, for the error figures).

use sparsekit_host::dims::ModelDims;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout, V4_NOPE, V4_ROPE};
use sparsekit_host::ops::{IndexKStore, KvStore, Op};
use sparsekit_host::{Backend, Error};

use super::record::Outcome;
use crate::fixtures::{self, bytes_of, store_batch, SuiteRng};
use crate::reference;
use crate::tolerance::{self, compare_bytes, ErrorStats, Quantity};

/// One `index_k_store` case.
pub(super) fn index_k_store<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    dt: IndexKDtype,
) -> Result<Outcome, Error> {
    let layout = IndexKLayout::new(dt, d.index_head_dim, d.page_size)?;
    let (paging, slots) = store_batch(rng, d.page_size);
    let cache0 = fixtures::garbage(rng, layout.buffer_bytes(paging.num_pages));
    let keys = fixtures::token_rows(rng, slots.len(), layout.head_dim());
    let mut want = cache0.clone();
    reference::index_k_store(&layout, &mut want, &keys, &slots);
    let mut cache = b.upload(&cache0)?;
    b.index_k_store(
        &IndexKStore {
            layout,
            slots: &slots,
        },
        &b.upload(bytes_of(&keys))?,
        &mut cache,
    )?;
    let got = b.download(&cache)?;
    let t = tolerance::get(Op::IndexKStore, Quantity::Cache, dt.into())?;
    let mut stats = ErrorStats::default();
    for (i, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
        let (gv, gs) = reference::read_index_key(&layout, &got, s as usize);
        let (wv, ws) = reference::read_index_key(&layout, &want, s as usize);
        for (j, (g, w)) in gv.iter().zip(&wv).enumerate() {
            stats.add(i * layout.head_dim() + j, g * gs, w * ws, 0.0, t);
        }
    }
    compare_bytes(&mut stats, &got, &want);
    Ok(Outcome::new(Quantity::Cache, stats, t))
}

/// One `kv_store` case at a model's dims.
pub(super) fn kv_store<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    dt: KvDtype,
) -> Result<Outcome, Error> {
    let layout = KvLayout::new(dt, d.kv_lora_rank, d.qk_rope_dim, d.page_size)?;
    kv_store_into(b, rng, layout)
}

/// One `kv_store` case into a DeepSeek-V4 layout (`model1_fp8` or `bf16_512`) with pages of
/// `page_size` tokens.
pub(super) fn kv_store_v4<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    dt: KvDtype,
    page_size: usize,
) -> Result<Outcome, Error> {
    let layout = KvLayout::new(dt, V4_NOPE, V4_ROPE, page_size)?;
    kv_store_into(b, rng, layout)
}

/// One `kv_store` case into `layout`.
fn kv_store_into<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    layout: KvLayout,
) -> Result<Outcome, Error> {
    let dt = layout.dtype();
    let (paging, slots) = store_batch(rng, layout.page_size());
    let cache0 = fixtures::garbage(rng, layout.buffer_bytes(paging.num_pages));
    let kv = fixtures::token_rows(rng, slots.len(), layout.d_qk());
    let mut want = cache0.clone();
    reference::kv_store(&layout, &mut want, &kv, &slots);
    let mut cache = b.upload(&cache0)?;
    b.kv_store(
        &KvStore {
            layout,
            slots: &slots,
        },
        &b.upload(bytes_of(&kv))?,
        &mut cache,
    )?;
    let got = b.download(&cache)?;
    let t = tolerance::get(Op::KvStore, Quantity::Cache, dt.into())?;
    let mut stats = ErrorStats::default();
    for (i, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
        let g = reference::read_kv_token(&layout, &got, s as usize);
        let w = reference::read_kv_token(&layout, &want, s as usize);
        for (j, (g, w)) in g.iter().zip(&w).enumerate() {
            stats.add(i * layout.d_qk() + j, *g, *w, 0.0, t);
        }
    }
    compare_bytes(&mut stats, &got, &want);
    Ok(Outcome::new(Quantity::Cache, stats, t))
}
