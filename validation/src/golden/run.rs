//! Running a golden file's op on a backend and judging its outputs.

use std::collections::HashMap;

use bytemuck::Pod;
use half::bf16;
use sparsekit_host::layout::{IndexKLayout, KvLayout};
use sparsekit_host::ops::{
    IndexKStore, IndexerLogits, KvStore, Op, PageTable, SparseMla, Topk, TopkOutput,
};
use sparsekit_host::Backend;

use super::judge::{
    compare_cache, encode_position, quantity, topk_want, widen, Judged, BF16_ROUNDING, F32_ROUNDING,
};
use super::params::{
    index_dtype, kv_dtype, IndexKStoreParams, IndexerLogitsParams, KvStoreParams, SparseMlaParams,
    TopkOut, TopkParams,
};
use super::reader::Reader;
use super::{Dtype, GoldenError, Result};
use crate::fixtures::{poison_bf16, poison_f32, poison_i32};
use crate::reference;
use crate::tolerance::{self, judge_topk_row, DataType, ErrorStats, Quantity};

/// Runs ops on one backend, mapping its errors.
pub(super) struct Run<'b, B> {
    pub b: &'b B,
}

impl<B: Backend> Run<'_, B> {
    fn err(&self, source: sparsekit_host::Error) -> GoldenError {
        GoldenError::Backend {
            backend: self.b.name().to_string(),
            source,
        }
    }

    fn up(&self, bytes: &[u8]) -> Result<B::Buffer> {
        self.b.upload(bytes).map_err(|e| self.err(e))
    }

    fn down<T: Pod>(&self, buf: &B::Buffer) -> Result<Vec<T>> {
        Ok(bytemuck::pod_collect_to_vec(
            &self.b.download(buf).map_err(|e| self.err(e))?,
        ))
    }

    pub(super) fn index_k_store(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: IndexKStoreParams = r.params()?;
        r.sizes(&[("head_dim", p.head_dim), ("page_size", p.page_size)])?;
        let dt = index_dtype(p.dtype, p.scale).map_err(|e| r.bad(e))?;
        let layout =
            IndexKLayout::new(dt, p.head_dim, p.page_size).map_err(|e| r.bad(e.to_string()))?;
        let bpp = layout.bytes_per_page();
        let keys = r.tensor(
            "keys",
            Dtype::BF16,
            &[("n_tokens", None), ("head_dim", Some(p.head_dim))],
        )?;
        let slots: Vec<i64> = r
            .tensor("slots", Dtype::I64, &[("n_tokens", Some(keys.shape[0]))])?
            .values();
        let cache_in = r.cache("cache_in", bpp, None)?;
        let want = r.cache("cache_out", bpp, Some(cache_in.shape[0]))?;
        let op = IndexKStore {
            layout,
            slots: &slots,
        };
        op.validate(keys.data.len(), cache_in.data.len())
            .map_err(GoldenError::Rejected)?;
        let mut cache = self.up(&cache_in.data)?;
        self.b
            .index_k_store(&op, &self.up(&keys.data)?, &mut cache)
            .map_err(|e| self.err(e))?;
        let got: Vec<u8> = self.down(&cache)?;
        let t = tolerance::get(Op::IndexKStore, Quantity::Cache, dt.into()).map_err(internal)?;
        let read = |c: &[u8], s: usize| {
            let (v, scale) = reference::read_index_key(&layout, c, s);
            v.into_iter().map(|x| x * scale).collect()
        };
        Ok(Judged {
            dtype: dt.into(),
            quantities: vec![compare_cache(t, &got, &want.data, &slots, bpp, read)],
            notes: Vec::new(),
        })
    }

    pub(super) fn kv_store(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: KvStoreParams = r.params()?;
        r.sizes(&[
            ("nope_dim", p.nope_dim),
            ("rope_dim", p.rope_dim),
            ("page_size", p.page_size),
        ])?;
        let dt = kv_dtype(p.dtype);
        let layout = KvLayout::new(dt, p.nope_dim, p.rope_dim, p.page_size)
            .map_err(|e| r.bad(e.to_string()))?;
        let bpp = layout.bytes_per_page();
        let kv = r.tensor(
            "kv",
            Dtype::BF16,
            &[("n_tokens", None), ("d_qk", Some(layout.d_qk()))],
        )?;
        let slots: Vec<i64> = r
            .tensor("slots", Dtype::I64, &[("n_tokens", Some(kv.shape[0]))])?
            .values();
        let cache_in = r.cache("cache_in", bpp, None)?;
        let want = r.cache("cache_out", bpp, Some(cache_in.shape[0]))?;
        let op = KvStore {
            layout,
            slots: &slots,
        };
        op.validate(kv.data.len(), cache_in.data.len())
            .map_err(GoldenError::Rejected)?;
        let mut cache = self.up(&cache_in.data)?;
        self.b
            .kv_store(&op, &self.up(&kv.data)?, &mut cache)
            .map_err(|e| self.err(e))?;
        let got: Vec<u8> = self.down(&cache)?;
        let t = tolerance::get(Op::KvStore, Quantity::Cache, dt.into()).map_err(internal)?;
        let read = |c: &[u8], s: usize| reference::read_kv_token(&layout, c, s);
        Ok(Judged {
            dtype: dt.into(),
            quantities: vec![compare_cache(t, &got, &want.data, &slots, bpp, read)],
            notes: Vec::new(),
        })
    }

    pub(super) fn indexer_logits(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: IndexerLogitsParams = r.params()?;
        r.sizes(&[
            ("head_dim", p.head_dim),
            ("page_size", p.page_size),
            ("n_heads", p.n_heads),
            ("row_stride", p.row_stride),
        ])?;
        let dt = index_dtype(p.dtype, p.scale).map_err(|e| r.bad(e))?;
        let layout =
            IndexKLayout::new(dt, p.head_dim, p.page_size).map_err(|e| r.bad(e.to_string()))?;
        let (h, d, stride) = (p.n_heads, p.head_dim, p.row_stride);
        let q = r.tensor(
            "q",
            Dtype::BF16,
            &[
                ("n_rows", None),
                ("n_heads", Some(h)),
                ("head_dim", Some(d)),
            ],
        )?;
        let n = q.shape[0];
        let (rows, n_req) = r.rows(n, p.next_n)?;
        let (table, max_pages) = r.page_table(n_req)?;
        let w = r.tensor(
            "weights",
            Dtype::F32,
            &[("n_rows", Some(n)), ("n_heads", Some(h))],
        )?;
        let cache = r.cache("cache", layout.bytes_per_page(), None)?;
        let want: Vec<f32> = r
            .tensor(
                "logits",
                Dtype::F32,
                &[("n_rows", Some(n)), ("row_stride", Some(stride))],
            )?
            .values();
        let pt = PageTable::new(&table, max_pages).map_err(GoldenError::Rejected)?;
        let op = IndexerLogits {
            layout,
            n_heads: h,
            page_table: pt,
            rows,
            row_stride: stride,
        };
        op.validate(q.data.len(), w.data.len(), cache.data.len(), n * stride * 4)
            .map_err(GoldenError::Rejected)?;
        let mut out = self.up(&poison_f32(n * stride))?;
        self.b
            .indexer_logits(
                &op,
                &self.up(&q.data)?,
                &self.up(&w.data)?,
                &self.up(&cache.data)?,
                &mut out,
            )
            .map_err(|e| self.err(e))?;
        let got: Vec<f32> = self.down(&out)?;
        // The file holds no magnitudes: the reference computes them from the inputs.
        let (qv, wv) = (q.values::<bf16>(), w.values::<f32>());
        let refr =
            reference::indexer_logits(&layout, &cache.data, &pt, &op.rows, h, &qv, &wv, stride);
        let t = widen(
            tolerance::get(Op::IndexerLogits, Quantity::Logits, dt.into()).map_err(internal)?,
            p.expected_from,
            F32_ROUNDING,
        );
        let mut stats = ErrorStats::default();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            stats.add(i, *g as f64, *w as f64, refr.magnitude[i], &t);
        }
        Ok(Judged {
            dtype: dt.into(),
            quantities: vec![quantity("logits", &t, stats, &[n, stride])],
            notes: Vec::new(),
        })
    }

    pub(super) fn topk(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: TopkParams = r.params()?;
        r.sizes(&[("k", p.k), ("row_stride", p.row_stride)])?;
        let (k, stride) = (p.k, p.row_stride);
        let logits_t = r.tensor(
            "logits",
            Dtype::F32,
            &[("n_rows", None), ("row_stride", Some(stride))],
        )?;
        let n = logits_t.shape[0];
        let (rows, n_req) = r.rows(n, p.next_n)?;
        let table = match (p.output, p.page_size) {
            (TopkOut::Slots, Some(ps)) => {
                r.sizes(&[("page_size", ps)])?;
                Some((r.page_table(n_req)?, ps))
            }
            (TopkOut::Slots, None) => {
                return Err(r.bad("page_size is required for output \"slots\""))
            }
            (TopkOut::Positions, Some(_)) => {
                return Err(r.bad("page_size applies to output \"slots\" only"))
            }
            (TopkOut::Positions, None) => None,
        };
        let want_t = r.tensor("topk", Dtype::I32, &[("n_rows", Some(n)), ("k", Some(k))])?;
        let (logits, file_want) = (logits_t.values::<f32>(), want_t.values::<i32>());
        let output = match &table {
            Some(((t, max_pages), ps)) => TopkOutput::Slots {
                page_table: PageTable::new(t, *max_pages).map_err(GoldenError::Rejected)?,
                page_size: *ps,
            },
            None => TopkOutput::Positions,
        };
        let op = Topk {
            k,
            row_stride: stride,
            rows: &rows,
            output,
        };
        op.validate(logits_t.data.len(), n * k * 4)
            .map_err(GoldenError::Rejected)?;
        let mut out = self.up(&poison_i32(n * k))?;
        self.b
            .topk(&op, &self.up(&logits_t.data)?, &mut out)
            .map_err(|e| self.err(e))?;
        let got: Vec<i32> = self.down(&out)?;
        let t = tolerance::get(Op::Topk, Quantity::Indices, DataType::Fp32).map_err(internal)?;
        let (mut stats, mut detail, mut other_ties) = (ErrorStats::default(), String::new(), 0);
        for (ri, range) in rows.iter().enumerate() {
            let row = &logits[ri * stride..(ri + 1) * stride];
            let (s, e) = (range.start as usize, range.end as usize);
            // Output entry -> the logit it selects (None: not a position of the range).
            let by_entry: HashMap<i32, f64> = (s..e)
                .map(|pos| (encode_position(&output, range, pos), row[pos] as f64))
                .collect();
            let value = |v: &i32| by_entry.get(v).copied();
            let (g, fw) = (&got[ri * k..(ri + 1) * k], &file_want[ri * k..(ri + 1) * k]);
            let got_vals: Vec<f64> = g
                .iter()
                .filter(|&&v| v != -1)
                .map(|v| value(v).unwrap_or(f64::NAN))
                .collect();
            let mut want_vals = Vec::with_capacity(k);
            for (j, v) in fw.iter().enumerate().filter(|(_, &v)| v != -1) {
                want_vals.push(value(v).ok_or_else(|| {
                    GoldenError::Invalid(format!(
                        "expected topk[{ri}][{j}] = {v} is not a {} of row {ri}'s range [{s}, {e})",
                        if table.is_some() { "slot" } else { "position" }
                    ))
                })?);
            }
            // Judged against the tie rule (the file's own tie choices may differ).
            let rule = topk_want(row, range, k, &output);
            let before = stats.failures;
            judge_topk_row(&mut stats, ri * k, g, &rule, &got_vals, &want_vals);
            if stats.failures > before && detail.is_empty() {
                detail = match g.iter().zip(&rule).position(|(a, b)| a != b) {
                    Some(j) => format!(
                        "row {ri}, entry {j}: got {}, want {} (ascending, ties to the lower position, -1 padding)",
                        g[j], rule[j]
                    ),
                    None => format!("row {ri}: the selected values differ from the expected top-k's"),
                };
            } else if stats.failures == before && fw != rule.as_slice() {
                other_ties += 1;
            }
        }
        let mut q = quantity("topk", t, stats, &[n, k]);
        if !detail.is_empty() {
            q.detail = format!("{} failures; first at {detail}", q.stats.failures);
        }
        let mut notes = Vec::new();
        if other_ties > 0 {
            notes.push(format!(
                "{other_ties} rows of the expected top-k hold the same values in another order or with other tied positions; judged by value and the ties-to-lower-position rule"
            ));
        }
        Ok(Judged {
            dtype: DataType::Fp32,
            quantities: vec![q],
            notes,
        })
    }

    pub(super) fn sparse_mla(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: SparseMlaParams = r.params()?;
        r.sizes(&[
            ("nope_dim", p.nope_dim),
            ("rope_dim", p.rope_dim),
            ("page_size", p.page_size),
            ("n_heads", p.n_heads),
            ("topk", p.topk),
        ])?;
        let dt = kv_dtype(p.dtype);
        let layout = KvLayout::new(dt, p.nope_dim, p.rope_dim, p.page_size)
            .map_err(|e| r.bad(e.to_string()))?;
        let (h, dv, topk) = (p.n_heads, layout.nope_dim(), p.topk);
        let q = r.tensor(
            "q",
            Dtype::BF16,
            &[
                ("n_tokens", None),
                ("n_heads", Some(h)),
                ("d_qk", Some(layout.d_qk())),
            ],
        )?;
        let n = q.shape[0];
        let cache = r.cache("cache", layout.bytes_per_page(), None)?;
        let idx_t = r.tensor(
            "indices",
            Dtype::I32,
            &[("n_tokens", Some(n)), ("topk", Some(topk))],
        )?;
        let want_out: Vec<bf16> = r
            .tensor(
                "out",
                Dtype::BF16,
                &[
                    ("n_tokens", Some(n)),
                    ("n_heads", Some(h)),
                    ("d_v", Some(dv)),
                ],
            )?
            .values();
        let want_lse: Vec<f32> = r
            .tensor(
                "lse",
                Dtype::F32,
                &[("n_tokens", Some(n)), ("n_heads", Some(h))],
            )?
            .values();
        let op = SparseMla {
            layout,
            n_tokens: n,
            n_heads: h,
            topk,
            softmax_scale: p.softmax_scale as f32,
        };
        let pages = op
            .validate(
                q.data.len(),
                cache.data.len(),
                idx_t.data.len(),
                n * h * dv * 2,
                n * h * 4,
            )
            .map_err(GoldenError::Rejected)?;
        let indices = idx_t.values::<i32>();
        op.check_indices(&indices, pages)
            .map_err(GoldenError::Rejected)?;
        let mut out = self.up(&poison_bf16(n * h * dv))?;
        let mut lse = self.up(&poison_f32(n * h))?;
        self.b
            .sparse_mla(
                &op,
                &self.up(&q.data)?,
                &self.up(&cache.data)?,
                &self.up(&idx_t.data)?,
                &mut out,
                &mut lse,
            )
            .map_err(|e| self.err(e))?;
        let (got_out, got_lse): (Vec<bf16>, Vec<f32>) = (self.down(&out)?, self.down(&lse)?);
        let refr = reference::sparse_mla(
            &layout,
            &cache.data,
            &q.values(),
            &indices,
            n,
            h,
            topk,
            op.softmax_scale,
        );
        let table = |q| tolerance::get(Op::SparseMla, q, dt.into()).map_err(internal);
        let to = widen(table(Quantity::Out)?, p.expected_from, BF16_ROUNDING);
        let tl = widen(table(Quantity::Lse)?, p.expected_from, F32_ROUNDING);
        let mut so = ErrorStats::default();
        for (i, (g, w)) in got_out.iter().zip(&want_out).enumerate() {
            so.add(i, g.to_f64(), w.to_f64(), refr.out_magnitude(i), &to);
        }
        let mut sl = ErrorStats::default();
        for (i, (g, w)) in got_lse.iter().zip(&want_lse).enumerate() {
            sl.add(i, *g as f64, *w as f64, refr.lse_magnitude[i], &tl);
        }
        Ok(Judged {
            dtype: dt.into(),
            quantities: vec![
                quantity("out", &to, so, &[n, h, dv]),
                quantity("lse", &tl, sl, &[n, h]),
            ],
            notes: Vec::new(),
        })
    }
}

/// A missing tolerance row (a bug in the table, not in the file).
fn internal(e: sparsekit_host::Error) -> GoldenError {
    GoldenError::Invalid(e.to_string())
}
