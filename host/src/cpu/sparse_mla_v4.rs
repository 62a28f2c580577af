//! CPU `sparse_mla_v4` (DeepSeek-V4): the attention core of [`super::sparse_mla`] over the
//! keys of two caches (main, then extra: each token's used entries that are not `-1`, in
//! index order), V = the whole 512-d row; then `lse` without the sink, `out` scaled by
//! the sink factor `1 / (1 + exp(sink − lse))`, and `+inf` / `0` for a token without a
//! valid key. Per (token, head chunk) task, as the V3.2 op: batch-invariant.

use half::bf16;

use super::attend::{attend_task, scaled_to_bf16, with_scratch, AttnDims, Scratch, Source};
use super::isa::CpuIsa;
use super::tasks::for_each_indexed;
use crate::ops::SparseMlaV4;

/// Heads per task at most.
const MAX_HEAD_CHUNK: usize = 64;

/// The buffers of one call: q, each cache with its indices, out, lse (validated).
#[derive(Clone, Copy, Debug)]
pub struct V4Call<'a> {
    pub q: &'a [bf16],
    pub main: (&'a [u8], &'a [i32]),
    pub extra: Option<(&'a [u8], &'a [i32])>,
}

/// Computes attention on the vector path `isa`. Inputs (every used index included) are
/// validated by the caller.
pub fn sparse_mla_v4(
    isa: CpuIsa,
    op: &SparseMlaV4<'_>,
    call: V4Call<'_>,
    out: &mut [bf16],
    lse: &mut [f32],
) {
    let h = op.n_heads;
    let hc = (1..=MAX_HEAD_CHUNK.min(h))
        .rev()
        .find(|c| h % c == 0)
        .unwrap_or(1);
    let d = SparseMlaV4::D;
    let chunks_per_token = h / hc;
    let mut sources = vec![Source {
        layout: &op.main.layout,
        cache: call.main.0,
    }];
    if let (Some(c), Some((cache, _))) = (&op.extra, call.extra) {
        sources.push(Source {
            layout: &c.layout,
            cache,
        });
    }
    let dims = AttnDims {
        dqk: d,
        dv: d,
        hc,
        scale: op.softmax_scale,
        wide: super::peak::wide_tiles(isa),
    };
    let tasks = out.chunks_mut(hc * d).zip(lse.chunks_mut(hc));
    for_each_indexed(tasks, 1, |task, (out, lse)| {
        with_scratch(|scratch| {
            let t = task / chunks_per_token;
            let h0 = (task % chunks_per_token) * hc;
            scratch.size(isa, dims);
            // Token `t`'s keys: main's used entries that are not -1, then extra's.
            let keys = |t: usize| {
                let lists = std::iter::once((&op.main, call.main.1)).chain(
                    op.extra
                        .as_ref()
                        .zip(call.extra)
                        .map(|(c, (_, idx))| (c, idx)),
                );
                lists.enumerate().flat_map(move |(src, (c, idx))| {
                    idx[t * c.topk..t * c.topk + c.length(t)]
                        .iter()
                        .filter(|&&i| i >= 0)
                        .map(move |&i| (src as u8, i as usize))
                })
            };
            // As in the V3.2 op: the next token's first keys after its last head chunk.
            let next = (h0 + hc == h && t + 1 < op.n_tokens).then_some(t + 1);
            scratch.plan(t, next, keys);
            let qrow = &call.q[(t * h + h0) * d..(t * h + h0 + hc) * d];
            attend_task(isa, dims, qrow, &sources, scratch);
            let sink = op.attn_sink.map(|s| &s[h0..h0 + hc]);
            finish(isa, dims, scratch, sink, out, lse);
        })
    });
}

/// DeepSeek-V4's output of a task: `lse = m + ln sum` (without the sink), `out = O / sum ·
/// 1 / (1 + exp(sink − lse))` (bf16); without a valid key `out = 0`, `lse = +inf`.
fn finish(
    isa: CpuIsa,
    d: AttnDims,
    s: &Scratch,
    sink: Option<&[f32]>,
    out: &mut [bf16],
    lse: &mut [f32],
) {
    let dv = d.dv;
    for i in 0..d.hc {
        let dst = &mut out[i * dv..(i + 1) * dv];
        if s.valid.is_empty() {
            dst.fill(bf16::ZERO);
            lse[i] = f32::INFINITY;
            continue;
        }
        let l = s.m[i] + s.sum[i].ln();
        let factor = sink.map_or(1.0, |sk| 1.0 / (1.0 + (sk[i] - l).exp()));
        scaled_to_bf16(isa, &s.o[i * dv..(i + 1) * dv], 1.0 / s.sum[i], factor, dst);
        lse[i] = l;
    }
}
