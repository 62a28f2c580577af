//! `sparse_mla_v4` cases: DeepSeek-V4-Flash and -Pro shapes (window + compressed caches
//! with their own layouts and page sizes), main only, odd head counts; ragged batches of
//! ≥ 4 requests, per-token lengths 0, 1, 63, 64, 65 and full, `-1` inside the lengths,
//! garbage past them (`i32::MAX`, negative, past the pool), rows no valid entry points at
//! filled with NaN, sinks finite and ±inf; against the f64 reference (out and lse).

use half::bf16;
use rand::seq::SliceRandom;
use rand::Rng;
use sparsekit_host::layout::{KvDtype, KvLayout, V4_NOPE, V4_ROPE};
use sparsekit_host::ops::{Op, SparseMlaV4, V4Cache};
use sparsekit_host::{Backend, Error, KvInput};

use super::record::Outcome;
use crate::fixtures::{self, bytes_of, SuiteRng};
use crate::reference;
use crate::tolerance::{self, ErrorStats, Quantity};

/// One cache of a case: its layout, page size and top-k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V4CacheShape {
    pub dtype: KvDtype,
    pub page_size: usize,
    pub topk: usize,
}

/// The sink of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SinkKind {
    None,
    /// Finite, about `N(0, 4)`.
    Finite,
    /// `+inf`, `-inf` and finite values mixed over the heads.
    Infinite,
}

/// The shape of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V4Shape {
    pub heads: usize,
    pub main: V4CacheShape,
    pub extra: Option<V4CacheShape>,
    pub sink: SinkKind,
    /// Query tokens (over `≥ 4` requests).
    pub tokens: usize,
}

/// A pool of `pages` pages of `layout`: every row NaN, then random rows (`token_rows`) at
/// `live` slots. Returns the pool and its live slots.
fn v4_pool(rng: &mut SuiteRng, layout: &KvLayout, pages: usize) -> (Vec<u8>, Vec<i64>) {
    let capacity = pages * layout.page_size();
    let mut pool = fixtures::garbage(rng, layout.buffer_bytes(pages));
    let all: Vec<i64> = (0..capacity as i64).collect();
    let nan = vec![bf16::NAN; capacity * layout.d_qk()];
    reference::kv_store(layout, &mut pool, &nan, &all);
    let mut live: Vec<i64> = all.iter().copied().filter(|_| rng.gen_bool(0.75)).collect();
    if live.is_empty() {
        live.push(0);
    }
    let kv = fixtures::token_rows(rng, live.len(), layout.d_qk());
    reference::kv_store(layout, &mut pool, &kv, &live);
    (pool, live)
}

/// Indices `[tokens, topk]` and lengths: token `t` uses `lens[t]` entries (live slots,
/// some repeated, some `-1`); past its length, garbage.
fn v4_indices(
    rng: &mut SuiteRng,
    topk: usize,
    lens: &[u32],
    live: &[i64],
    capacity: usize,
) -> Vec<i32> {
    let mut idx = Vec::with_capacity(lens.len() * topk);
    for &len in lens {
        for j in 0..topk {
            let v = if j < len as usize {
                match rng.gen_range(0..20) {
                    0 => -1,
                    _ => *live.choose(rng).unwrap_or(&0) as i32,
                }
            } else {
                match rng.gen_range(0..4) {
                    0 => i32::MAX,
                    1 => -rng.gen_range(1..1000),
                    2 => (capacity + rng.gen_range(0..100)) as i32,
                    _ => rng.gen_range(0..capacity.max(1)) as i32,
                }
            };
            idx.push(v);
        }
    }
    idx
}

/// Per-token lengths of a cache of top-k `k`: 0, 1, 63, 64, 65 and `k` (those that fit),
/// then random; the last token uses none of either cache when `empty`.
fn v4_lengths(rng: &mut SuiteRng, k: usize, tokens: usize, empty: bool) -> Vec<u32> {
    let pattern: Vec<u32> = [0usize, 1, 63, 64, 65, k]
        .into_iter()
        .filter(|&l| l <= k)
        .map(|l| l as u32)
        .collect();
    (0..tokens)
        .map(|t| {
            if empty && t + 1 == tokens {
                0
            } else if t < pattern.len() {
                pattern[(t + 3) % pattern.len()]
            } else {
                rng.gen_range(0..=k as u32)
            }
        })
        .collect()
}

/// One `sparse_mla_v4` case (two records: out and lse).
pub(super) fn sparse_mla_v4<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    s: &V4Shape,
) -> Result<Vec<Outcome>, Error> {
    let (n, h, d) = (s.tokens, s.heads, SparseMlaV4::D);
    let make = |rng: &mut SuiteRng, c: &V4CacheShape, empty: bool| -> Result<_, Error> {
        let layout = KvLayout::new(c.dtype, V4_NOPE, V4_ROPE, c.page_size)?;
        // Enough pages for the top-k (with repeats) and some unused ones.
        let pages = (c.topk / 2).div_ceil(c.page_size) + 2;
        let (pool, live) = v4_pool(rng, &layout, pages);
        let lens = v4_lengths(rng, c.topk, n, empty);
        let idx = v4_indices(rng, c.topk, &lens, &live, pages * c.page_size);
        Ok((layout, pool, lens, idx))
    };
    let (ml, mpool, mlens, midx) = make(rng, &s.main, true)?;
    let extra = match &s.extra {
        Some(c) => Some((make(rng, c, true)?, c.topk)),
        None => None,
    };
    let sink: Option<Vec<f32>> = match s.sink {
        SinkKind::None => None,
        SinkKind::Finite => Some((0..h).map(|_| 2.0 * fixtures::normal(rng) as f32).collect()),
        SinkKind::Infinite => Some(
            (0..h)
                .map(|i| match i % 3 {
                    0 => f32::INFINITY,
                    1 => f32::NEG_INFINITY,
                    _ => fixtures::normal(rng) as f32,
                })
                .collect(),
        ),
    };
    let q = fixtures::bf16_normal(rng, n * h * d, 1.0);
    let op = SparseMlaV4 {
        n_tokens: n,
        n_heads: h,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        main: V4Cache {
            layout: ml,
            topk: s.main.topk,
            lengths: Some(&mlens),
        },
        extra: extra.as_ref().map(|((l, _, lens, _), k)| V4Cache {
            layout: *l,
            topk: *k,
            lengths: Some(lens),
        }),
        attn_sink: sink.as_deref(),
    };
    let mut out = b.upload(&fixtures::poison_bf16(n * h * d))?;
    let mut lse = b.upload(&fixtures::poison_f32(n * h))?;
    let (qb, mc, mi) = (
        b.upload(bytes_of(&q))?,
        b.upload(&mpool)?,
        b.upload(bytes_of(&midx))?,
    );
    let eb = match &extra {
        Some(((_, pool, _, idx), _)) => Some((b.upload(pool)?, b.upload(bytes_of(idx))?)),
        None => None,
    };
    b.sparse_mla_v4(
        &op,
        &qb,
        KvInput {
            cache: &mc,
            indices: &mi,
        },
        eb.as_ref().map(|(c, i)| KvInput {
            cache: c,
            indices: i,
        }),
        &mut out,
        &mut lse,
    )?;
    let got_out: Vec<bf16> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    let got_lse: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&lse)?);
    let want = reference::sparse_mla_v4(
        &op,
        &q,
        (&mpool, &midx),
        extra.as_ref().map(|((_, p, _, i), _)| (&p[..], &i[..])),
    );
    let dt = s.main.dtype.into();
    let (to, tl) = (
        tolerance::get(Op::SparseMlaV4, Quantity::Out, dt)?,
        tolerance::get(Op::SparseMlaV4, Quantity::Lse, dt)?,
    );
    let mut so = ErrorStats::default();
    for (i, (g, m)) in got_out.iter().zip(want.out_magnitudes()).enumerate() {
        so.add(i, g.to_f64(), want.out[i], m, to);
    }
    let mut sl = ErrorStats::default();
    for (i, g) in got_lse.iter().enumerate() {
        sl.add(i, *g as f64, want.lse[i], want.lse_magnitude[i], tl);
    }
    let note = format!(
        "main lengths {mlens:?}{}",
        extra
            .as_ref()
            .map_or(String::new(), |((_, _, l, _), _)| format!(", extra {l:?}"))
    );
    let mut o = Outcome::new(Quantity::Out, so, to);
    o.note = note.clone();
    let mut ol = Outcome::new(Quantity::Lse, sl, tl);
    ol.note = note;
    Ok(vec![o, ol])
}
