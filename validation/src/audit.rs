//! [`ReferenceAudit`]: the f64 references and the tolerance table as a
//! [`KernelAudit`], so a serving engine can re-check a sample of its own kernel calls
//! while it serves (injected from above: the serving crate knows only the trait).

use half::bf16;
use sparsekit_host::ops::{IndexerLogits, Op, SparseMla, Topk};
use sparsekit_host::KernelAudit;

use crate::golden::topk_expected;
use crate::reference;
use crate::tolerance::{self, judge_topk_row, DataType, ErrorStats, Quantity};

/// Judges kernel calls against the f64 references, with the tolerances of the
/// validation suite (top-k by the values it selects and the ties-to-lower rule).
#[derive(Clone, Copy, Debug, Default)]
pub struct ReferenceAudit;

fn values<T: bytemuck::Pod>(what: &str, bytes: &[u8]) -> Result<Vec<T>, String> {
    if bytes.len() % std::mem::size_of::<T>() != 0 {
        return Err(format!(
            "{what}: {} bytes is not whole elements",
            bytes.len()
        ));
    }
    Ok(bytemuck::pod_collect_to_vec(bytes))
}

fn verdict(what: &str, mut stats: ErrorStats) -> Result<(), String> {
    stats.finish();
    if stats.failures == 0 {
        Ok(())
    } else {
        Err(format!("{what}: {}", stats.summary()))
    }
}

impl KernelAudit for ReferenceAudit {
    fn indexer_logits(
        &self,
        op: &IndexerLogits<'_>,
        q: &[u8],
        weights: &[u8],
        cache: &[u8],
        out: &[u8],
    ) -> Result<(), String> {
        let (q, w) = (values::<bf16>("q", q)?, values::<f32>("weights", weights)?);
        let got = values::<f32>("logits", out)?;
        if got.len() < op.rows.len() * op.row_stride {
            return Err(format!(
                "logits: {} values for {} rows",
                got.len(),
                op.rows.len()
            ));
        }
        let r = reference::indexer_logits(
            &op.layout,
            cache,
            &op.page_table,
            &op.rows,
            op.n_heads,
            &q,
            &w,
            op.row_stride,
        );
        let dt: DataType = op.layout.dtype().into();
        let t =
            tolerance::get(Op::IndexerLogits, Quantity::Logits, dt).map_err(|e| e.to_string())?;
        let mut stats = ErrorStats::default();
        for (ri, range) in op.rows.iter().enumerate() {
            for pos in range.start as usize..range.end as usize {
                let i = ri * op.row_stride + pos;
                stats.add(i, got[i] as f64, r.logits[i], r.magnitude[i], t);
            }
        }
        verdict("indexer_logits", stats)
    }

    fn topk(&self, op: &Topk<'_>, logits: &[u8], out: &[u8]) -> Result<(), String> {
        let logits = values::<f32>("logits", logits)?;
        let got = values::<i32>("topk", out)?;
        let (k, stride) = (op.k, op.row_stride);
        if got.len() < op.rows.len() * k || logits.len() < op.rows.len() * stride {
            return Err("top-k: buffers shorter than the op's rows".into());
        }
        let mut stats = ErrorStats::default();
        for (ri, range) in op.rows.iter().enumerate() {
            let row = &logits[ri * stride..(ri + 1) * stride];
            let g = &got[ri * k..(ri + 1) * k];
            let (want, by_entry) = topk_expected(row, range, k, &op.output, op.short_rows);
            let value = |v: &i32| by_entry.get(v).copied();
            let got_vals: Vec<f64> = g
                .iter()
                .filter(|&&v| v != -1)
                .map(|v| value(v).unwrap_or(f64::NAN))
                .collect();
            let want_vals: Vec<f64> = want
                .iter()
                .filter(|&&v| v != -1)
                .map(|v| value(v).unwrap_or(f64::NAN))
                .collect();
            judge_topk_row(&mut stats, ri * k, g, &want, &got_vals, &want_vals);
        }
        verdict("topk", stats)
    }

    fn sparse_mla(
        &self,
        op: &SparseMla,
        q: &[u8],
        cache: &[u8],
        indices: &[u8],
        out: &[u8],
        lse: &[u8],
    ) -> Result<(), String> {
        let q = values::<bf16>("q", q)?;
        let idx = values::<i32>("indices", indices)?;
        let got_out = values::<bf16>("out", out)?;
        let got_lse = values::<f32>("lse", lse)?;
        let (n, h, dv) = (op.n_tokens, op.n_heads, op.layout.nope_dim());
        if got_out.len() < n * h * dv || got_lse.len() < n * h || idx.len() < n * op.topk {
            return Err("sparse_mla: buffers shorter than the op's tokens".into());
        }
        let r = reference::sparse_mla(&op.layout, cache, &q, &idx, n, h, op.topk, op.softmax_scale);
        let dt: DataType = op.layout.dtype().into();
        let table =
            |quantity| tolerance::get(Op::SparseMla, quantity, dt).map_err(|e| e.to_string());
        let (to, tl) = (table(Quantity::Out)?, table(Quantity::Lse)?);
        let mut so = ErrorStats::default();
        for (i, (g, w)) in got_out[..n * h * dv].iter().zip(&r.out).enumerate() {
            so.add(i, g.to_f64(), *w, r.out_magnitude(i), to);
        }
        verdict("sparse_mla out", so)?;
        let mut sl = ErrorStats::default();
        for (i, ((g, w), m)) in got_lse[..n * h]
            .iter()
            .zip(&r.lse)
            .zip(&r.lse_magnitude)
            .enumerate()
        {
            sl.add(i, *g as f64, *w, *m, tl);
        }
        verdict("sparse_mla lse", sl)
    }
}
