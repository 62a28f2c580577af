//! [`ReferenceAudit`]: the f64 references and the tolerance table as a
//! [`KernelAudit`], so a serving engine can re-check a sample of its own kernel calls
//! while it serves (injected from above: the serving crate knows only the trait).

use half::bf16;
use sparsekit_host::ops::{IndexerLogits, Op, SparseMla, SparseMlaV4, Topk};
use sparsekit_host::KernelAudit;

use crate::golden::topk_expected_for;
use crate::reference;
use crate::tolerance::{self, judge_topk_row, DataType, ErrorStats, Quantity};

/// An attention call's `out` and `lse` against the reference `r`, with `op`'s tolerances
/// for the KV dtype `dt` (NaN never passes).
fn judge_attention(
    what: &str,
    op: Op,
    dt: DataType,
    r: &reference::MlaRef,
    got_out: &[bf16],
    got_lse: &[f32],
) -> Result<(), String> {
    let table = |quantity| tolerance::get(op, quantity, dt).map_err(|e| e.to_string());
    let (to, tl) = (table(Quantity::Out)?, table(Quantity::Lse)?);
    let mut so = ErrorStats::default();
    let want = r.out.iter().zip(r.out_magnitudes());
    for (i, (g, (w, m))) in got_out.iter().zip(want).enumerate() {
        so.add(i, g.to_f64(), *w, m, to);
    }
    verdict(&format!("{what} out"), so)?;
    let mut sl = ErrorStats::default();
    for (i, ((g, w), m)) in got_lse.iter().zip(&r.lse).zip(&r.lse_magnitude).enumerate() {
        sl.add(i, *g as f64, *w, *m, tl);
    }
    verdict(&format!("{what} lse"), sl)
}

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
            let (want, by_entry) = topk_expected_for(row, range, k, &op.output, op.short_rows, g);
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
        judge_attention(
            "sparse_mla",
            Op::SparseMla,
            dt,
            &r,
            &got_out[..n * h * dv],
            &got_lse[..n * h],
        )
    }

    fn sparse_mla_v4(
        &self,
        op: &SparseMlaV4<'_>,
        q: &[u8],
        main: (&[u8], &[u8]),
        extra: Option<(&[u8], &[u8])>,
        out: &[u8],
        lse: &[u8],
    ) -> Result<(), String> {
        let (n, h, d) = (op.n_tokens, op.n_heads, SparseMlaV4::D);
        let q = values::<bf16>("q", q)?;
        let got_out = values::<bf16>("out", out)?;
        let got_lse = values::<f32>("lse", lse)?;
        let main_idx = values::<i32>("main indices", main.1)?;
        let extra_idx = extra
            .map(|(_, i)| values::<i32>("extra indices", i))
            .transpose()?;
        let short = got_out.len() < n * h * d
            || got_lse.len() < n * h
            || q.len() < n * h * d
            || main_idx.len() < n * op.main.topk
            || match (&op.extra, &extra_idx) {
                (Some(c), Some(i)) => i.len() < n * c.topk,
                (None, None) => false,
                _ => true,
            };
        if short {
            return Err("sparse_mla_v4: buffers shorter than the op's tokens".into());
        }
        let r = reference::sparse_mla_v4(
            op,
            &q,
            (main.0, &main_idx),
            extra.map(|e| e.0).zip(extra_idx.as_deref()),
        );
        let dt: DataType = op.main.layout.dtype().into();
        judge_attention(
            "sparse_mla_v4",
            Op::SparseMlaV4,
            dt,
            &r,
            &got_out[..n * h * d],
            &got_lse[..n * h],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{self, bytes_of, case_rng, Paging};
    use sparsekit_host::layout::KvLayout;
    use sparsekit_host::ops::V4Cache;
    use sparsekit_host::{Backend, CpuBackend, KvInput};

    /// The V4 audit passes the cpu backend's own call (a MODEL1 main cache with per-token
    /// lengths, a bf16_512 extra cache of another page size, sinks) and catches one wrong
    /// output value, one wrong lse, and a NaN output.
    #[test]
    fn sparse_mla_v4_audit_passes_a_right_call_and_catches_wrong_ones() {
        let seed: u64 = rand::random();
        let rng = &mut case_rng(seed, 0x0a0d_0004);
        let (n, h, d) = (5usize, 3usize, SparseMlaV4::D);
        let (ml, el) = (
            KvLayout::model1_fp8(4).unwrap_or_else(|e| panic!("{e}")),
            KvLayout::bf16_512(2).unwrap_or_else(|e| panic!("{e}")),
        );
        let pool = |rng: &mut _, l: &KvLayout, slots: u32| {
            let paging = Paging::new(rng, l.page_size(), &[slots], 0);
            fixtures::kv_pool(rng, l, &paging)
        };
        let (mp, ep) = (pool(rng, &ml, 12), pool(rng, &el, 8));
        let (mk, ek) = (7usize, 4usize);
        let mi: Vec<i32> = (0..n * mk).map(|i| (i * 5 % 12) as i32).collect();
        let ei: Vec<i32> = (0..n * ek).map(|i| (i * 3 % 8) as i32).collect();
        let lens: Vec<u32> = (0..n).map(|t| (t % mk + 1) as u32).collect();
        let q = fixtures::bf16_normal(rng, n * h * d, 1.0);
        let sink = [0.3f32, -1.0, 2.0];
        let op = SparseMlaV4 {
            n_tokens: n,
            n_heads: h,
            softmax_scale: 0.05,
            main: V4Cache {
                layout: ml,
                topk: mk,
                lengths: Some(&lens),
            },
            extra: Some(V4Cache {
                layout: el,
                topk: ek,
                lengths: None,
            }),
            attn_sink: Some(&sink),
        };
        let b = CpuBackend::new();
        let up = |x: &[u8]| b.upload(x).unwrap_or_else(|e| panic!("{e}"));
        let (mc, ec, mib, eib) = (up(&mp), up(&ep), up(bytes_of(&mi)), up(bytes_of(&ei)));
        let mut out = up(&fixtures::poison_bf16(n * h * d));
        let mut lse = up(&fixtures::poison_f32(n * h));
        b.sparse_mla_v4(
            &op,
            &up(bytes_of(&q)),
            KvInput {
                cache: &mc,
                indices: &mib,
            },
            Some(KvInput {
                cache: &ec,
                indices: &eib,
            }),
            &mut out,
            &mut lse,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let out: Vec<bf16> = bytemuck::pod_collect_to_vec(&b.download(&out).unwrap_or_default());
        let lse: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&lse).unwrap_or_default());
        let check = |out: &[bf16], lse: &[f32]| {
            ReferenceAudit.sparse_mla_v4(
                &op,
                bytes_of(&q),
                (&mp, bytes_of(&mi)),
                Some((&ep, bytes_of(&ei))),
                bytes_of(out),
                bytes_of(lse),
            )
        };
        assert_eq!(check(&out, &lse), Ok(()), "seed {seed}");
        let i = (2 * h + 1) * d + 100;
        let mut bad = out.clone();
        // Moved past twice the element's own tolerance, and by at least 0.25 whatever its
        // value. A fixed move was seed-dependent: `x · 1.5 + 0.25` left values near its
        // fixed point −0.5 inside the tolerance, and `x + 0.25 + |x| / 2` left elements
        // whose bound (large scores make it loose) exceeded the move.
        let r = reference::sparse_mla_v4(&op, &q, (&mp, &mi), Some((&ep, &ei)));
        let t = tolerance::get(Op::SparseMlaV4, Quantity::Out, ml.dtype().into())
            .unwrap_or_else(|e| panic!("{e}"));
        let magnitude = r.out_magnitudes().nth(i).unwrap_or(f64::NAN);
        let allowed = t.atol * magnitude + t.rtol * r.out[i].abs();
        assert!(allowed.is_finite(), "the bound at {i} (seed {seed})");
        let x = bad[i].to_f64();
        bad[i] = bf16::from_f64(x + 0.25 + 0.5 * x.abs() + 2.0 * allowed);
        assert!(
            check(&bad, &lse).is_err(),
            "a wrong value passed (seed {seed})"
        );
        bad[i] = bf16::NAN;
        assert!(check(&bad, &lse).is_err(), "NaN passed (seed {seed})");
        // Likewise past twice its tolerance.
        let tl = tolerance::get(Op::SparseMlaV4, Quantity::Lse, ml.dtype().into())
            .unwrap_or_else(|e| panic!("{e}"));
        let allowed = tl.atol * r.lse_magnitude[4] + tl.rtol * r.lse[4].abs();
        assert!(allowed.is_finite(), "the lse bound (seed {seed})");
        let mut bad_lse = lse.clone();
        bad_lse[4] += (0.5 + 2.0 * allowed) as f32;
        assert!(
            check(&out, &bad_lse).is_err(),
            "a wrong lse passed (seed {seed})"
        );
    }
}
