//! CPU sparse MLA attention (decode/prefill alike: one query token at a time).
//!
//! Per (token, head chunk) task: the token's valid slots (`-1` skipped), in the order
//! given, through the attention core of [`super::attend`]. The tasks of a rayon job share
//! one set of working buffers. The operation sequence of a head depends only on its
//! token's slots, never on the batch or head chunking; a head of a token with no valid
//! slot gets `out = 0`, `lse = -inf`, decided by the slots (a NaN score gives NaN).

use half::bf16;

use super::attend::{attend_task, scaled_to_bf16, with_scratch, AttnDims, Scratch, Source};
use super::isa::CpuIsa;
use super::tasks::for_each_indexed;
use crate::ops::SparseMla;

/// Heads per task at most.
const MAX_HEAD_CHUNK: usize = 64;

/// Computes attention on the vector path `isa`. Inputs (including every index) are
/// validated by the caller.
pub fn sparse_mla(
    isa: CpuIsa,
    op: &SparseMla,
    q: &[bf16],
    cache: &[u8],
    indices: &[i32],
    out: &mut [bf16],
    lse: &mut [f32],
) {
    let h = op.n_heads;
    let hc = (1..=MAX_HEAD_CHUNK.min(h))
        .rev()
        .find(|c| h % c == 0)
        .unwrap_or(1);
    let (dqk, dv) = (op.layout.d_qk(), op.layout.nope_dim());
    let chunks_per_token = h / hc;
    let tasks = out.chunks_mut(hc * dv).zip(lse.chunks_mut(hc));
    for_each_indexed(tasks, 1, |task, (out, lse)| {
        with_scratch(|scratch| {
            let t = task / chunks_per_token;
            let h0 = (task % chunks_per_token) * hc;
            let qrow = &q[(t * h + h0) * dqk..(t * h + h0 + hc) * dqk];
            scratch.size(isa, dqk, dv, hc);
            let keys = |t: usize| {
                indices[t * op.topk..(t + 1) * op.topk]
                    .iter()
                    .filter(|&&i| i >= 0)
                    .map(|&i| (0, i as usize))
            };
            // The next task (this worker's likely next) reads another token's keys when
            // this is the token's last head chunk.
            let next = (h0 + hc == h && t + 1 < op.n_tokens).then_some(t + 1);
            scratch.plan(t, next, keys);
            let sources = [Source {
                layout: &op.layout,
                cache,
            }];
            let dims = AttnDims {
                dqk,
                dv,
                hc,
                scale: op.softmax_scale,
            };
            attend_task(isa, dims, qrow, &sources, scratch);
            finish_v32(isa, dims, &scratch.valid, scratch, out, lse);
        })
    });
}

/// DeepSeek-V3.2's output of a task: `out = O / sum` (bf16), `lse = m + ln sum`; a token
/// without a valid slot gets `out = 0`, `lse = -inf`.
fn finish_v32(
    isa: CpuIsa,
    d: AttnDims,
    valid: &[(u8, usize)],
    s: &Scratch,
    out: &mut [bf16],
    lse: &mut [f32],
) {
    // "No valid slot" is decided by the slots, never by the sum: a NaN or infinite score
    // makes the sum NaN, and that NaN must reach out and lse (as in the reference), not
    // pass for the empty-attention values.
    let dv = d.dv;
    for i in 0..d.hc {
        let dst = &mut out[i * dv..(i + 1) * dv];
        if !valid.is_empty() {
            // `o · inv · 1` is `o · inv`, bit for bit.
            scaled_to_bf16(isa, &s.o[i * dv..(i + 1) * dv], 1.0 / s.sum[i], 1.0, dst);
            lse[i] = s.m[i] + s.sum[i].ln();
        } else {
            dst.fill(bf16::ZERO);
            lse[i] = f32::NEG_INFINITY;
        }
    }
}
