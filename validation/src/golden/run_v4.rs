//! `check` of a `sparse_mla_v4` file (docs/golden.md): runs the op on the backend and judges
//! `out` and `lse` with the tolerance table, in our conventions or FlashMLA's (`q`,
//! `indices`, `out` with leading `[batch, s_q]`; per-request lengths `[batch]`;
//! `lse_layout = "batch_heads_seq"`; `+inf` for an empty row is ours here).

use half::bf16;
use sparsekit_host::layout::KvLayout;
use sparsekit_host::ops::{Op, SparseMlaV4, V4Cache};
use sparsekit_host::{Backend, KvInput};

use super::conventions::{EmptyLse, LseLayout};
use super::judge::{quantity, widen, Judged, BF16_ROUNDING, F32_ROUNDING};
use super::params::{kv_dtype, SparseMlaV4Params, V4CacheP};
use super::reader::Reader;
use super::run::{conventions_note, internal, Run};
use super::{Dtype, GoldenError, Result};
use crate::fixtures::{poison_bf16, poison_f32};
use crate::reference;
use crate::tolerance::{self, ErrorStats, Quantity};

/// One cache of the file: its layout, bytes, indices and per-token lengths.
struct CacheIn {
    layout: KvLayout,
    topk: usize,
    bytes: Vec<u8>,
    indices: Vec<i32>,
    lengths: Option<Vec<u32>>,
}

/// Reads cache `name` (`main` or `extra`): `{name}_cache`, `{name}_indices` and the
/// optional `{name}_lengths` (`[n_tokens]`, or FlashMLA's `[batch]` when `q` is `[batch,
/// s_q, ..]`: each request's length for its `s_q` tokens).
fn read_cache(
    r: &mut Reader<'_>,
    names: [&'static str; 3],
    c: &V4CacheP,
    n: usize,
    batch: Option<(usize, usize)>,
) -> Result<CacheIn> {
    let layout = KvLayout::new(kv_dtype(c.dtype), 448, 64, c.page_size)
        .map_err(|e| r.bad(format!("{}: {e}", names[0])))?;
    let bytes = r
        .cache(names[0], layout.bytes_per_page(), None)?
        .data
        .clone();
    let indices = r
        .tensor_of(
            names[1],
            &[Dtype::I32],
            &[("n_tokens", Some(n)), ("topk", Some(c.topk))],
            true,
        )?
        .values::<i32>();
    let lengths = if r.holds(names[2]) {
        let t = r.tensor_of(names[2], &[Dtype::I32], &[("lengths", None)], false)?;
        let v = t.values::<i32>();
        let per_token: Vec<i32> = match batch {
            _ if v.len() == n => v,
            Some((b, s_q)) if v.len() == b => v
                .iter()
                .flat_map(|&l| std::iter::repeat_n(l, s_q))
                .collect(),
            _ => {
                return Err(GoldenError::Invalid(format!(
                    "{} holds {} lengths: one per token ({n}) or per request of q's [batch, s_q, ..] expected",
                    names[2],
                    v.len()
                )))
            }
        };
        if let Some((i, l)) = per_token.iter().enumerate().find(|(_, &l)| l < 0) {
            return Err(GoldenError::Invalid(format!(
                "{}[{i}] = {l} is negative",
                names[2]
            )));
        }
        Some(per_token.into_iter().map(|l| l as u32).collect())
    } else {
        None
    };
    Ok(CacheIn {
        layout,
        topk: c.topk,
        bytes,
        indices,
        lengths,
    })
}

impl<B: Backend> Run<'_, B> {
    pub(super) fn sparse_mla_v4(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: SparseMlaV4Params = r.params()?;
        r.conventions(&p.conventions)?;
        r.sizes(&[
            ("n_heads", p.n_heads),
            ("main.page_size", p.main.page_size),
            ("main.topk", p.main.topk),
        ])?;
        if let Some(e) = &p.extra {
            r.sizes(&[("extra.page_size", e.page_size), ("extra.topk", e.topk)])?;
        }
        let (h, d) = (p.n_heads, SparseMlaV4::D);
        let c = p.conventions;
        let q = r.tensor_of(
            "q",
            &[Dtype::BF16],
            &[("n_tokens", None), ("n_heads", Some(h)), ("d", Some(d))],
            true,
        )?;
        let n = Reader::leading(q, 2);
        let batch = (q.shape.len() == 4).then(|| (q.shape[0], q.shape[1]));
        let main = read_cache(
            r,
            ["main_cache", "main_indices", "main_lengths"],
            &p.main,
            n,
            batch,
        )?;
        let extra = match &p.extra {
            Some(e) => Some(read_cache(
                r,
                ["extra_cache", "extra_indices", "extra_lengths"],
                e,
                n,
                batch,
            )?),
            None => None,
        };
        let sink: Option<Vec<f32>> = if r.holds("attn_sink") {
            Some(
                r.tensor_of("attn_sink", &[Dtype::F32], &[("n_heads", Some(h))], false)?
                    .values(),
            )
        } else {
            None
        };
        let want_out: Vec<bf16> = r
            .tensor_of(
                "out",
                &[Dtype::BF16],
                &[("n_tokens", Some(n)), ("n_heads", Some(h)), ("d", Some(d))],
                true,
            )?
            .values();
        let want_lse: Vec<f32> = match c.lse_layout.unwrap_or_default() {
            LseLayout::TokensHeads => r
                .tensor_of(
                    "lse",
                    &[Dtype::F32],
                    &[("n_tokens", Some(n)), ("n_heads", Some(h))],
                    true,
                )?
                .values(),
            LseLayout::BatchHeadsSeq => {
                let t = r.tensor(
                    "lse",
                    Dtype::F32,
                    &[("batch", None), ("n_heads", Some(h)), ("s_q", None)],
                )?;
                let (b, s_q) = (t.shape[0], t.shape[2]);
                if b.checked_mul(s_q) != Some(n) {
                    return Err(GoldenError::Invalid(format!(
                        "lse [batch {b}, n_heads {h}, s_q {s_q}] does not hold the {n} tokens of q"
                    )));
                }
                let v = t.values::<f32>();
                (0..n * h)
                    .map(|i| {
                        let (tok, hh) = (i / h, i % h);
                        v[(tok / s_q * h + hh) * s_q + tok % s_q]
                    })
                    .collect()
            }
        };
        fn cache_of(ci: &CacheIn) -> V4Cache<'_> {
            V4Cache {
                layout: ci.layout,
                topk: ci.topk,
                lengths: ci.lengths.as_deref(),
            }
        }
        let op = SparseMlaV4 {
            n_tokens: n,
            n_heads: h,
            softmax_scale: p.softmax_scale as f32,
            main: cache_of(&main),
            extra: extra.as_ref().map(cache_of),
            attn_sink: sink.as_deref(),
        };
        let sizes = |ci: &CacheIn| [ci.bytes.len(), ci.indices.len() * 4];
        let pages = op
            .validate(
                q.data.len(),
                sizes(&main),
                extra.as_ref().map(sizes),
                n * h * d * 2,
                n * h * 4,
            )
            .map_err(GoldenError::Rejected)?;
        op.check_indices("main_indices", &op.main, &main.indices, pages.main)
            .map_err(GoldenError::Rejected)?;
        if let (Some(oc), Some(e)) = (&op.extra, &extra) {
            op.check_indices("extra_indices", oc, &e.indices, pages.extra)
                .map_err(GoldenError::Rejected)?;
        }
        let mut out = self.up(&poison_bf16(n * h * d))?;
        let mut lse = self.up(&poison_f32(n * h))?;
        let qb = self.up(&q.data)?;
        let up = |ci: &CacheIn| -> Result<(B::Buffer, B::Buffer)> {
            Ok((
                self.up(&ci.bytes)?,
                self.up(bytemuck::cast_slice(&ci.indices))?,
            ))
        };
        let mb = up(&main)?;
        let eb = match &extra {
            Some(e) => Some(up(e)?),
            None => None,
        };
        self.b
            .sparse_mla_v4(
                &op,
                &qb,
                KvInput {
                    cache: &mb.0,
                    indices: &mb.1,
                },
                eb.as_ref().map(|(cb, ib)| KvInput {
                    cache: cb,
                    indices: ib,
                }),
                &mut out,
                &mut lse,
            )
            .map_err(|e| self.err(e))?;
        let (got_out, got_lse): (Vec<bf16>, Vec<f32>) = (self.down(&out)?, self.down(&lse)?);
        let refr = reference::sparse_mla_v4(
            &op,
            &q.values(),
            (&main.bytes, &main.indices),
            extra.as_ref().map(|e| (&e.bytes[..], &e.indices[..])),
        );
        let dt = main.layout.dtype().into();
        let table = |qy| tolerance::get(Op::SparseMlaV4, qy, dt).map_err(internal);
        let to = widen(table(Quantity::Out)?, p.expected_from, BF16_ROUNDING);
        let tl = widen(table(Quantity::Lse)?, p.expected_from, F32_ROUNDING);
        let mut so = ErrorStats::default();
        for (i, (g, w)) in got_out.iter().zip(&want_out).enumerate() {
            so.add(i, g.to_f64(), w.to_f64(), refr.out_magnitude(i), &to);
        }
        let mut sl = ErrorStats::default();
        // Ours is +inf for a token without a valid key; a file stating "-inf" has its
        // expected value of such a token negated (so that a misstated file fails).
        let neg_empty = c.empty_lse == Some(EmptyLse::NegInf);
        for (i, (g, w)) in got_lse.iter().zip(&want_lse).enumerate() {
            let empty = refr.n_valid[i / h] == 0;
            let w = if neg_empty && empty { -*w } else { *w };
            sl.add(i, *g as f64, w as f64, refr.lse_magnitude[i], &tl);
        }
        Ok(Judged {
            dtype: dt,
            quantities: vec![
                quantity("out", &to, so, &[n, h, d]),
                quantity("lse", &tl, sl, &[n, h]),
            ],
            notes: conventions_note(&c),
        })
    }
}
