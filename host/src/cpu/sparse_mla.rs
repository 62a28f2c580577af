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
    let dims = AttnDims {
        dqk,
        dv,
        hc,
        scale: op.softmax_scale,
        wide: super::peak::wide_tiles(isa),
    };
    let tasks = out.chunks_mut(hc * dv).zip(lse.chunks_mut(hc));
    for_each_indexed(tasks, 1, |task, (out, lse)| {
        with_scratch(|scratch| {
            let t = task / chunks_per_token;
            let h0 = (task % chunks_per_token) * hc;
            let qrow = &q[(t * h + h0) * dqk..(t * h + h0 + hc) * dqk];
            scratch.size(isa, dims);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{KvDtype, KvLayout};
    use rand::{Rng, SeedableRng};

    /// The index of the first element whose bits differ between `a` and `b`.
    fn first_difference<T: bytemuck::Pod>(a: &[T], b: &[T]) -> Option<usize> {
        a.iter()
            .zip(b)
            .position(|(x, y)| bytemuck::bytes_of(x) != bytemuck::bytes_of(y))
    }

    /// A `SparseMla` over a bf16 cache (`Bf16`: 64 + 32 dims; `Bf16x512`) of `page`-token
    /// pages.
    fn bf16_op(dtype: KvDtype, page: usize, n_tokens: usize, h: usize, topk: usize) -> SparseMla {
        let layout = match dtype {
            KvDtype::Bf16 => KvLayout::new(dtype, 64, 32, page).unwrap(),
            _ => KvLayout::bf16_512(page).unwrap(),
        };
        SparseMla {
            layout,
            n_tokens,
            n_heads: h,
            topk,
            softmax_scale: 0.7 / (layout.d_qk() as f32).sqrt(),
        }
    }

    /// A few heads (the keys-along route on cores with full-width 512-bit FMAs) over keys
    /// with bf16 subnormals (flushed, as the bf16 dot product reads them) and exact zeros:
    /// every path gives the portable path's bits (ragged batch, blocks of 128 keys and odd
    /// partial ones, poisoned outputs).
    #[test]
    fn few_heads_over_subnormal_keys_give_the_portable_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let (page, pages, n_tokens, topk) = (16, 13, 6, 151);
        for (dtype, h) in [
            (KvDtype::Bf16, 8),
            (KvDtype::Bf16x512, 3),
            (KvDtype::Bf16, 5),
        ] {
            let op = bf16_op(dtype, page, n_tokens, h, topk);
            let (dqk, dv) = (op.layout.d_qk(), op.layout.nope_dim());
            let value = |rng: &mut rand_chacha::ChaCha8Rng| match rng.gen_range(0..50) {
                0 => bf16::from_bits(rng.gen_range(1..0x80) | rng.gen_range(0..2) << 15),
                1 => bf16::from_bits(rng.gen_range(0..2) << 15),
                _ => bf16::from_f32(rng.gen_range(-2.0..2.0)),
            };
            let mut cache = vec![0u8; op.layout.buffer_bytes(pages)];
            for b in cache.chunks_exact_mut(2) {
                b.copy_from_slice(&value(&mut rng).to_le_bytes());
            }
            let q: Vec<bf16> = (0..n_tokens * h * dqk)
                .map(|_| bf16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let slots = (pages * page) as i32;
            let mut indices: Vec<i32> = (0..n_tokens * topk)
                .map(|_| match rng.gen_range(0..7) {
                    0 => -1,
                    _ => rng.gen_range(0..slots),
                })
                .collect();
            // Token 0 sees one key, whose V holds subnormals: its output is that V, with
            // each subnormal read as zero.
            indices[0] = rng.gen_range(0..slots);
            indices[1..topk].fill(-1);
            let row = op.layout.slot_token_bytes(indices[0] as usize).start;
            for c in (0..dv).step_by(7) {
                let sub = 0x0011u16 + (c % 64) as u16;
                cache[row + 2 * c..row + 2 * c + 2].copy_from_slice(&sub.to_le_bytes());
            }
            let run = |isa: CpuIsa| {
                let mut out = vec![bf16::NAN; n_tokens * h * dv];
                let mut lse = vec![f32::NAN; n_tokens * h];
                sparse_mla(isa, &op, &q, &cache, &indices, &mut out, &mut lse);
                (out, lse)
            };
            let (want_out, want_lse) = run(CpuIsa::new(crate::cpu::isa::Isa::Scalar).unwrap());
            assert!(
                want_out.iter().all(|x| x.is_finite()) && want_lse.iter().all(|x| x.is_finite())
            );
            assert!(want_out[..dv]
                .iter()
                .step_by(7)
                .all(|x| x.to_bits() & 0x7fff == 0));
            for isa in CpuIsa::available() {
                let (out, lse) = run(isa);
                for (name, differ) in [
                    ("out", first_difference(&want_out, &out)),
                    ("lse", first_difference(&want_lse, &lse)),
                ] {
                    assert_eq!(
                        differ,
                        None,
                        "{} {dtype:?} h{h}: {name} differs at",
                        isa.isa()
                    );
                }
            }
        }
    }

    /// A bf16 cache's key rows are read where they lie when their bytes are 2-byte aligned
    /// and copied first otherwise, and so are the queries' pairs when 4-byte aligned: on
    /// every path, a cache starting at an odd address, or the queries at the other 4-byte
    /// alignment, give the bits of the aligned run (ragged batch: 5 tokens, some slots
    /// `-1`, blocks of 128 keys and a partial one; outputs poisoned first).
    #[test]
    fn unaligned_caches_and_queries_give_the_aligned_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let (page, pages, n_tokens, h, topk) = (16, 13, 5, 24, 150);
        for dtype in [KvDtype::Bf16, KvDtype::Bf16x512] {
            let op = bf16_op(dtype, page, n_tokens, h, topk);
            let (dqk, dv) = (op.layout.d_qk(), op.layout.nope_dim());
            let value =
                |rng: &mut rand_chacha::ChaCha8Rng| bf16::from_f32(rng.gen_range(-2.0..2.0));
            let mut cache = vec![0u8; op.layout.buffer_bytes(pages) + 1];
            for b in cache.chunks_exact_mut(2) {
                b.copy_from_slice(&value(&mut rng).to_le_bytes());
            }
            let q: Vec<bf16> = (0..n_tokens * h * dqk).map(|_| value(&mut rng)).collect();
            let slots = (pages * page) as i32;
            let indices: Vec<i32> = (0..n_tokens * topk)
                .map(|i| match (i / topk, rng.gen_range(0..10)) {
                    (3, _) => -1, // a token with no valid slot
                    (_, 0) => -1,
                    _ => rng.gen_range(0..slots),
                })
                .collect();
            let mut odd = vec![0u8; cache.len() + 1];
            odd[1..].copy_from_slice(&cache);
            let (aligned, unaligned) = (&cache[..cache.len() - 1], &odd[1..cache.len()]);
            assert_eq!(aligned.as_ptr() as usize % 2, 0);
            assert_eq!(unaligned.as_ptr() as usize % 2, 1);
            // The queries again at the other 4-byte alignment: on the bf16 dot product's
            // path one copy is read in place as pairs, the other copied first.
            let mut q_buf = vec![bf16::ZERO; q.len() + 1];
            let shift = usize::from(q_buf.as_ptr() as usize % 4 == q.as_ptr() as usize % 4);
            q_buf[shift..shift + q.len()].copy_from_slice(&q);
            let q_other = &q_buf[shift..shift + q.len()];
            assert_ne!(q.as_ptr() as usize % 4, q_other.as_ptr() as usize % 4);
            for isa in CpuIsa::available() {
                let run = |q: &[bf16], c: &[u8]| {
                    let mut out = vec![bf16::NAN; n_tokens * h * dv];
                    let mut lse = vec![f32::NAN; n_tokens * h];
                    sparse_mla(isa, &op, q, c, &indices, &mut out, &mut lse);
                    (out, lse)
                };
                let (oa, la) = run(&q, aligned);
                assert!(
                    oa.iter().all(|x| !x.is_nan()) && la.iter().take(3 * h).all(|x| x.is_finite())
                );
                for (what, (ou, lu)) in [
                    ("an odd-addressed cache", run(&q, unaligned)),
                    ("the queries' other alignment", run(q_other, aligned)),
                ] {
                    for (name, differ) in [
                        ("out", first_difference(&oa, &ou)),
                        ("lse", first_difference(&la, &lu)),
                    ] {
                        let isa = isa.isa();
                        assert_eq!(differ, None, "{isa} {dtype:?}, {what}: {name} differs at");
                    }
                }
            }
        }
    }
}
