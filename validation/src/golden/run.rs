//! Running a golden file's op on a backend and judging its outputs.

use std::collections::HashMap;

use bytemuck::Pod;
use half::bf16;
use sparsekit_host::layout::{IndexKLayout, KvLayout};
use sparsekit_host::ops::{
    IndexKStore, IndexerLogits, KvStore, Op, PageTable, ShortRows, SparseMla, Topk, TopkOutput,
};
use sparsekit_host::Backend;

use super::conventions::{
    Conventions, EmptyLse, InvalidIndices, KeyDequant, LseLayout, TopkPadding,
};
use super::judge::{
    compare_cache, encode_position, quantity, topk_want, widen, Judged, BF16_ROUNDING, F32_ROUNDING,
};
use super::params::{
    index_dtype, kv_dtype, IndexKStoreParams, IndexerLogitsParams, KvStoreParams, ShortRowsP,
    SparseMlaParams, TopkOut, TopkParams,
};
use super::reader::Reader;
use super::{Dtype, GoldenError, Result};
use crate::fixtures::{poison_bf16, poison_f32, poison_i32};
use crate::reference::{self, QuantRules};
use crate::tolerance::{self, judge_topk_row, DataType, ErrorStats, Quantity};

/// Runs ops on one backend, mapping its errors.
pub(super) struct Run<'b, B> {
    pub b: &'b B,
}

impl<B: Backend> Run<'_, B> {
    pub(super) fn err(&self, source: sparsekit_host::Error) -> GoldenError {
        GoldenError::Backend {
            backend: self.b.name().to_string(),
            source,
        }
    }

    pub(super) fn up(&self, bytes: &[u8]) -> Result<B::Buffer> {
        self.b.upload(bytes).map_err(|e| self.err(e))
    }

    pub(super) fn down<T: Pod>(&self, buf: &B::Buffer) -> Result<Vec<T>> {
        Ok(bytemuck::pod_collect_to_vec(
            &self.b.download(buf).map_err(|e| self.err(e))?,
        ))
    }

    pub(super) fn index_k_store(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: IndexKStoreParams = r.params()?;
        r.conventions(&p.conventions)?;
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
        let keys: Vec<bf16> = keys.values();
        let store = |rules, out: &mut Vec<u8>| {
            reference::index_k_store_with(&layout, out, &keys, &slots, rules)
        };
        Ok(judge_store(
            t,
            &p.conventions,
            &cache_in.data,
            &want.data,
            &got,
            &slots,
            bpp,
            read,
            store,
        ))
    }

    pub(super) fn kv_store(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: KvStoreParams = r.params()?;
        r.conventions(&p.conventions)?;
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
        let kv: Vec<bf16> = kv.values();
        let store =
            |rules, out: &mut Vec<u8>| reference::kv_store_with(&layout, out, &kv, &slots, rules);
        Ok(judge_store(
            t,
            &p.conventions,
            &cache_in.data,
            &want.data,
            &got,
            &slots,
            bpp,
            read,
            store,
        ))
    }

    pub(super) fn indexer_logits(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: IndexerLogitsParams = r.params()?;
        r.conventions(&p.conventions)?;
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
        // Expected logits in f32, or in bf16 (DeepGEMM's `logits_dtype=bf16`).
        let want_t = r.tensor_of(
            "logits",
            &[Dtype::F32, Dtype::BF16],
            &[("n_rows", Some(n)), ("row_stride", Some(stride))],
            false,
        )?;
        let (want, rounding): (Vec<f64>, f64) = match want_t.dtype {
            Dtype::BF16 => (
                want_t.values::<bf16>().iter().map(|x| x.to_f64()).collect(),
                BF16_ROUNDING,
            ),
            _ => (
                want_t.values::<f32>().iter().map(|&x| x as f64).collect(),
                F32_ROUNDING,
            ),
        };
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
        let mut t = widen(
            tolerance::get(Op::IndexerLogits, Quantity::Logits, dt.into()).map_err(internal)?,
            p.expected_from,
            rounding,
        );
        // Keys dequantised to bf16 before the dots: each product is off by at most 2^-8
        // relative, so each logit by at most 2^-8 · magnitude (the ReLU is 1-Lipschitz).
        if p.conventions.key_dequant == Some(KeyDequant::Bf16) {
            t.atol += BF16_ROUNDING;
        }
        let mut stats = ErrorStats::default();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            stats.add(i, *g as f64, *w, refr.magnitude[i], &t);
        }
        Ok(Judged {
            dtype: dt.into(),
            quantities: vec![quantity("logits", &t, stats, &[n, stride])],
            notes: conventions_note(&p.conventions),
        })
    }

    pub(super) fn topk(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: TopkParams = r.params()?;
        r.conventions(&p.conventions)?;
        r.sizes(&[("k", p.k), ("row_stride", p.row_stride)])?;
        let (k, stride) = (p.k, p.row_stride);
        // Leading dimensions are rows: ours `[n_rows, ..]`, DeepSeek-V3.2's `[batch,
        // seq_len, ..]`.
        let logits_t = r.tensor_of(
            "logits",
            &[Dtype::F32],
            &[("n_rows", None), ("row_stride", Some(stride))],
            true,
        )?;
        let n = Reader::leading(logits_t, 1);
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
        let want_t = r.tensor_of(
            "topk",
            &[Dtype::I32],
            &[("n_rows", Some(n)), ("k", Some(k))],
            true,
        )?;
        let (logits, file_want) = (logits_t.values::<f32>(), want_t.values::<i32>());
        let output = match &table {
            Some(((t, max_pages), ps)) => TopkOutput::Slots {
                page_table: PageTable::new(t, *max_pages).map_err(GoldenError::Rejected)?,
                page_size: *ps,
            },
            None => TopkOutput::Positions,
        };
        let short = match p.short_rows {
            ShortRowsP::SelectValid => ShortRows::SelectValid,
            ShortRowsP::TakeAll => ShortRows::TakeAll,
        };
        let op = Topk {
            short_rows: short,
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
        let masked_padding = p.conventions.topk_padding == Some(TopkPadding::MaskedPositions);
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
            if let Some(j) = fw.iter().position(|&v| v == -1).filter(|_| masked_padding) {
                return Err(GoldenError::Invalid(format!(
                    "expected topk[{ri}][{j}] = -1, but the file states conventions.topk_padding = \"masked_positions\" (rows are padded with masked positions, never -1)"
                )));
            }
            for (j, v) in fw.iter().enumerate().filter(|(_, &v)| v != -1) {
                // Under `masked_positions`, entries that select no valid logit (outside the
                // range, or masked: -inf or NaN) are the row's padding.
                let selectable = value(v).filter(|x| !x.is_nan() && *x != f64::NEG_INFINITY);
                if masked_padding && selectable.is_none() {
                    continue;
                }
                want_vals.push(value(v).ok_or_else(|| {
                    GoldenError::Invalid(format!(
                        "expected topk[{ri}][{j}] = {v} is not a {} of row {ri}'s range [{s}, {e}){}",
                        if table.is_some() { "slot" } else { "position" },
                        if masked_padding {
                            ""
                        } else {
                            " (a dump that pads with masked positions states conventions.topk_padding = \"masked_positions\")"
                        }
                    ))
                })?);
            }
            // Judged against the tie rule (the file's own tie choices may differ).
            let rule = topk_want(row, range, k, &output, short);
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
            } else if stats.failures == before {
                // Another order or other tied positions (masked padding read as -1).
                let padded: Vec<i32> = fw
                    .iter()
                    .map(|v| match value(v) {
                        Some(x) if !x.is_nan() && x != f64::NEG_INFINITY => *v,
                        _ if masked_padding => -1,
                        _ => *v,
                    })
                    .collect();
                if padded != rule {
                    other_ties += 1;
                }
            }
        }
        let mut q = quantity("topk", t, stats, &[n, k]);
        if !detail.is_empty() {
            q.detail = format!("{} failures; first at {detail}", q.stats.failures);
        }
        let mut notes = conventions_note(&p.conventions);
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
        r.conventions(&p.conventions)?;
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
        let c = p.conventions;
        // Leading dimensions are tokens: ours `[n_tokens, ..]`, FlashMLA's
        // `[batch, s_q, ..]`.
        let q = r.tensor_of(
            "q",
            &[Dtype::BF16],
            &[
                ("n_tokens", None),
                ("n_heads", Some(h)),
                ("d_qk", Some(layout.d_qk())),
            ],
            true,
        )?;
        let n = Reader::leading(q, 2);
        let cache = r.cache("cache", layout.bytes_per_page(), None)?;
        let idx_t = r.tensor_of(
            "indices",
            &[Dtype::I32],
            &[("n_tokens", Some(n)), ("topk", Some(topk))],
            true,
        )?;
        let want_out: Vec<bf16> = r
            .tensor_of(
                "out",
                &[Dtype::BF16],
                &[
                    ("n_tokens", Some(n)),
                    ("n_heads", Some(h)),
                    ("d_v", Some(dv)),
                ],
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
                let (batch, s_q) = (t.shape[0], t.shape[2]);
                if batch.checked_mul(s_q) != Some(n) {
                    return Err(GoldenError::Invalid(format!(
                        "lse [batch {batch}, n_heads {h}, s_q {s_q}] does not hold the {n} tokens of q"
                    )));
                }
                // [batch, h, s_q] → [batch·s_q, h]: token b·s_q + s, head hh.
                let v = t.values::<f32>();
                (0..n * h)
                    .map(|i| {
                        let (tok, hh) = (i / h, i % h);
                        let (b, sq) = (tok / s_q, tok % s_q);
                        v[(b * h + hh) * s_q + sq]
                    })
                    .collect()
            }
        };
        let mut indices = idx_t.values::<i32>();
        let pages = layout
            .pages_in("KV cache", cache.data.len())
            .map_err(GoldenError::Rejected)?;
        let mut notes = conventions_note(&c);
        if c.invalid_indices == Some(InvalidIndices::OutOfRange) {
            // FlashMLA: every negative index and every one at or past the cache's end is
            // skipped, as -1 is here.
            let capacity = pages.saturating_mul(layout.page_size());
            let mut skipped = 0;
            for i in indices.iter_mut() {
                if *i < -1 || (*i >= 0 && *i as usize >= capacity) {
                    *i = -1;
                    skipped += 1;
                }
            }
            notes.push(format!(
                "{skipped} indices other than -1 outside the cache of {capacity} slots skipped as invalid"
            ));
        }
        let idx_bytes: Vec<u8> = bytemuck::cast_slice(&indices).to_vec();
        let op = SparseMla {
            layout,
            n_tokens: n,
            n_heads: h,
            topk,
            softmax_scale: p.softmax_scale as f32,
        };
        op.validate(
            q.data.len(),
            cache.data.len(),
            idx_bytes.len(),
            n * h * dv * 2,
            n * h * 4,
        )
        .map_err(GoldenError::Rejected)?;
        op.check_indices(&indices, pages)
            .map_err(GoldenError::Rejected)?;
        let mut out = self.up(&poison_bf16(n * h * dv))?;
        let mut lse = self.up(&poison_f32(n * h))?;
        self.b
            .sparse_mla(
                &op,
                &self.up(&q.data)?,
                &self.up(&cache.data)?,
                &self.up(&idx_bytes)?,
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
        let plus_inf_empty = c.empty_lse == Some(EmptyLse::PosInf);
        for (i, (g, w)) in got_lse.iter().zip(&want_lse).enumerate() {
            // FlashMLA writes +inf for a token without a valid slot, we write -inf: under
            // its convention the expected value of such a token is negated, so that +inf
            // matches our -inf and a -inf (a file that misstates its convention) fails.
            let empty = refr.n_valid[i / h] == 0;
            let w = if plus_inf_empty && empty { -*w } else { *w };
            sl.add(i, *g as f64, w as f64, refr.lse_magnitude[i], &tl);
        }
        Ok(Judged {
            dtype: dt.into(),
            quantities: vec![
                quantity("out", &to, so, &[n, h, dv]),
                quantity("lse", &tl, sl, &[n, h]),
            ],
            notes,
        })
    }
}

/// Judges a store: without conventions, our backend's cache against the file's byte for
/// byte. With a quantiser convention (`scale`, `quantize`), two comparisons that must both
/// hold: the file's `cache_out` against the reference under the file's convention (an
/// honest dump), and our backend against the reference under ours (`cache_ours`); a note
/// counts the tokens whose bytes differ between the two conventions.
#[allow(clippy::too_many_arguments)]
fn judge_store(
    t: &tolerance::Tolerance,
    conventions: &Conventions,
    cache_in: &[u8],
    file: &[u8],
    got: &[u8],
    slots: &[i64],
    bpp: usize,
    read: impl Fn(&[u8], usize) -> Vec<f64> + Copy,
    store: impl Fn(QuantRules, &mut Vec<u8>),
) -> Judged {
    let dtype = t.dtype;
    let rules = conventions.quant_rules();
    if rules == QuantRules::default() {
        return Judged {
            dtype,
            quantities: vec![compare_cache("cache_out", t, got, file, slots, bpp, read)],
            notes: Vec::new(),
        };
    }
    let (mut ours, mut theirs) = (cache_in.to_vec(), cache_in.to_vec());
    store(QuantRules::default(), &mut ours);
    store(rules, &mut theirs);
    // Bitwise, so that a token holding NaN differs only if its values do.
    let bits = |c: &[u8], s: i64| -> Vec<u64> {
        read(c, s as usize).iter().map(|x| x.to_bits()).collect()
    };
    let differ = slots
        .iter()
        .filter(|&&s| s >= 0 && bits(&ours, s) != bits(&theirs, s))
        .count();
    let mut notes = vec![format!(
        "conventions {}: the file is judged against the reference under its convention, our backend against ours",
        conventions.describe().join(", ")
    )];
    notes.push(format!(
        "{differ} of {} stored tokens differ between the two conventions",
        slots.iter().filter(|&&s| s >= 0).count()
    ));
    Judged {
        dtype,
        quantities: vec![
            compare_cache("cache_out", t, file, &theirs, slots, bpp, read),
            compare_cache("cache_ours", t, got, &ours, slots, bpp, read),
        ],
        notes,
    }
}

/// The report's note naming the conventions a file states (none when all are ours).
pub(super) fn conventions_note(c: &Conventions) -> Vec<String> {
    let d = c.describe();
    if d.is_empty() {
        Vec::new()
    } else {
        vec![format!(
            "judged under the file's conventions: {}",
            d.join(", ")
        )]
    }
}

/// A missing tolerance row (a bug in the table, not in the file).
pub(super) fn internal(e: sparsekit_host::Error) -> GoldenError {
    GoldenError::Invalid(e.to_string())
}
