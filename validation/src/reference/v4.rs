//! The f64 reference of `sparse_mla_v4` (DeepSeek-V4; FlashMLA's `tests/ref.py` maths):
//! gather main ‖ extra rows (each token's used entries that are not `-1`), `s = scale ·
//! q·k`, `lse = logsumexp(s)` (natural log, without the sink), `out = softmax(s) · rows`
//! (V = K, all 512 dims), then `out *= 1 / (1 + exp(sink − lse))`; no valid key: `out = 0`,
//! `lse = +inf`.

use half::bf16;
use rayon::prelude::*;
use sparsekit_host::ops::SparseMlaV4;

use super::{bf16_f64s, dot_abs_each, read_kv_token, weigh_into, MlaRef};

/// Reference `sparse_mla_v4` for all tokens (parallel over tokens; naive inside). `main` and
/// `extra` are each cache's bytes and indices.
pub fn sparse_mla_v4(
    op: &SparseMlaV4<'_>,
    q: &[bf16],
    main: (&[u8], &[i32]),
    extra: Option<(&[u8], &[i32])>,
) -> MlaRef {
    let (h, d) = (op.n_heads, SparseMlaV4::D);
    let scale = op.softmax_scale as f64;
    let flush = crate::tolerance::dot_flush_magnitude(d + 1, crate::tolerance::MLA_LSE_ATOL);
    type TokenRef = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, usize, f64);
    let per_token: Vec<TokenRef> = (0..op.n_tokens)
        .into_par_iter()
        .map(|t| {
            let mut keys: Vec<Vec<f64>> = Vec::new();
            let lists = std::iter::once((&op.main, main)).chain(op.extra.as_ref().zip(extra));
            for (c, (cache, idx)) in lists {
                for &i in &idx[t * c.topk..t * c.topk + c.length(t)] {
                    if i >= 0 {
                        keys.push(read_kv_token(&c.layout, cache, i as usize));
                    }
                }
            }
            let vmax = keys.iter().flatten().fold(0.0f64, |m, x| m.max(x.abs()));
            let mut out = vec![0.0; h * d];
            let mut abs = vec![0.0; h * d];
            let mut lse = vec![f64::INFINITY; h];
            let mut lmag = vec![0.0; h];
            for hh in 0..h {
                let qh = bf16_f64s(&q[(t * h + hh) * d..(t * h + hh + 1) * d]);
                let mut scores = Vec::with_capacity(keys.len());
                dot_abs_each(&qh, keys.iter().map(Vec::as_slice), |_, (dot, adot)| {
                    scores.push(dot * scale);
                    lmag[hh] = f64::max(lmag[hh], (adot + flush) * scale.abs());
                });
                if keys.is_empty() {
                    continue;
                }
                let mx = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
                let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let sum: f64 = w.iter().sum();
                lse[hh] = mx + sum.ln();
                let factor = op
                    .attn_sink
                    .map_or(1.0, |s| 1.0 / (1.0 + (s[hh] as f64 - lse[hh]).exp()));
                let o = &mut out[hh * d..(hh + 1) * d];
                let a = &mut abs[hh * d..(hh + 1) * d];
                for (wj, k) in w.iter().zip(&keys) {
                    weigh_into(o, a, k, wj / sum, factor);
                }
            }
            (out, lse, abs, lmag, keys.len(), vmax)
        })
        .collect();
    let mut r = MlaRef {
        out: Vec::new(),
        lse: Vec::new(),
        out_abs: Vec::new(),
        lse_magnitude: Vec::new(),
        n_valid: Vec::new(),
        v_max: Vec::new(),
        n_heads: h,
        d_v: d,
        score_slack: 1.5,
    };
    for (o, l, a, lm, n, vm) in per_token {
        r.v_max.push(vm);
        r.out.extend(o);
        r.lse.extend(l);
        r.out_abs.extend(a);
        r.lse_magnitude.extend(lm);
        r.n_valid.push(n);
    }
    r
}
