//! Documented rules of the ops (`docs/golden.md`) that random inputs rarely hit, each
//! pinned on every backend with outputs poisoned first:
//! - top-k reads only a row's `[start, end)` (values outside that would win are never
//!   selected), `+inf` is a valid entry, `-0.0` and `+0.0` tie (the lower position wins,
//!   whichever sign it has), `-1` pads a row with fewer than `k` valid entries;
//! - sparse_mla counts a slot listed twice twice (the softmax weight doubles: `lse` grows
//!   by `ln 2` for a token whose one slot is listed twice, `out` stays that slot's value).

use half::bf16;
use sparsekit_host::layout::{KvDtype, KvLayout};
use sparsekit_host::ops::{Op, QueryRange, SparseMla, Topk, TopkOutput};
use sparsekit_host::Backend;

use super::{ensure, seed, Failure, Outcome};
use crate::fixtures::{self, bytes_of, case_rng, Paging};
use crate::reference;
use crate::tolerance::{self, DataType, ErrorStats, Quantity};

/// The top-k rules above, on rows built to break each.
pub fn topk_rules<B: Backend>(b: &B) -> Outcome {
    const STRIDE: usize = 16;
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let mut logits = vec![inf; 4 * STRIDE];
    // Outside each range: +inf and NaN, which would be selected if read.
    for (i, x) in logits.iter_mut().enumerate() {
        if i % 3 == 0 {
            *x = nan;
        }
    }
    let mut set = |row: usize, start: usize, vals: &[f32]| {
        logits[row * STRIDE + start..][..vals.len()].copy_from_slice(vals);
    };
    // Rows 0 and 1: a ±0 tie at the k-th place, either sign first.
    set(
        0,
        2,
        &[5.0, inf, 0.0, -0.0, -1.0, -2.0, nan, f32::NEG_INFINITY],
    );
    set(
        1,
        2,
        &[5.0, inf, -0.0, 0.0, -1.0, -2.0, nan, f32::NEG_INFINITY],
    );
    // Row 2: two valid entries (one +inf) among NaN and -inf: padded with -1.
    set(2, 0, &[nan, f32::NEG_INFINITY, 1.0, inf]);
    // Row 3: every entry of its range +inf (ties to the lower positions).
    set(3, 5, &[inf, inf, inf, inf, inf]);
    let range = |request, start, end| QueryRange {
        request,
        start,
        end,
    };
    let rows = [
        range(0, 2, 10),
        range(0, 2, 10),
        range(0, 0, 4),
        range(0, 5, 10),
    ];
    let k = 3;
    let want: [i32; 12] = [2, 3, 4, 2, 3, 4, 2, 3, -1, 5, 6, 7];
    let op = Topk {
        short_rows: sparsekit_host::ops::ShortRows::SelectValid,
        k,
        row_stride: STRIDE,
        rows: &rows,
        output: TopkOutput::Positions,
    };
    let mut out = b.upload(&fixtures::poison_i32(rows.len() * k))?;
    b.topk(&op, &b.upload(bytes_of(&logits))?, &mut out)?;
    let got: Vec<i32> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    ensure(got == want, || {
        format!(
            "topk rules (range only, +inf valid, ±0 tie to the lower position, -1 padding): got {got:?}, want {want:?}"
        )
    })
}

/// Duplicate sparse_mla indices count twice, on both KV dtypes (see the module docs).
pub fn duplicate_indices<B: Backend>(b: &B) -> Outcome {
    let seed = seed();
    duplicates_case(b, seed).map_err(|f| {
        Failure(format!(
            "{f} (seed {seed}: replay with SPARSEKIT_SEED={seed})"
        ))
    })
}

fn duplicates_case<B: Backend>(b: &B, seed: u64) -> Outcome {
    let rng = &mut case_rng(seed, 0x00d0_b1e5);
    let (h, ps, topk) = (16, 16, 32);
    for dt in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
        let l = KvLayout::new(dt, 256, 32, ps)?;
        let lens = [40u32];
        let paging = Paging::new(rng, ps, &lens, 1);
        let slots = paging.all_slots();
        let kv = fixtures::token_rows(rng, slots.len(), l.d_qk());
        let mut pool = fixtures::garbage(rng, l.buffer_bytes(paging.num_pages));
        reference::kv_store(&l, &mut pool, &kv, &slots);
        let slot = |pos: usize| paging.slot(0, pos) as i32;
        let n_tokens = 5;
        let mut indices = vec![-1i32; n_tokens * topk];
        let mut put = |t: usize, j: usize, pos: usize| indices[t * topk + j] = slot(pos);
        // Token 0: a, a, b. Tokens 1 and 2 (same query): a once, a twice. Tokens 3 and 4
        // (same query): c once, c in every entry.
        put(0, 0, 3);
        put(0, 5, 3);
        put(0, 9, 17);
        put(1, 3, 3);
        put(2, 1, 3);
        put(2, 30, 3);
        put(3, 7, 29);
        for j in 0..topk {
            put(4, j, 29);
        }
        let d = l.d_qk();
        let mut q = fixtures::bf16_normal(rng, n_tokens * h * d, 1.0);
        let token = h * d;
        q.copy_within(token..2 * token, 2 * token);
        q.copy_within(3 * token..4 * token, 4 * token);
        let op = SparseMla {
            layout: l,
            n_tokens,
            n_heads: h,
            topk,
            softmax_scale: 1.0 / (d as f32).sqrt(),
        };
        let dv = l.nope_dim();
        let mut out = b.upload(&fixtures::poison_bf16(n_tokens * h * dv))?;
        let mut lse = b.upload(&fixtures::poison_f32(n_tokens * h))?;
        b.sparse_mla(
            &op,
            &b.upload(bytes_of(&q))?,
            &b.upload(&pool)?,
            &b.upload(bytes_of(&indices))?,
            &mut out,
            &mut lse,
        )?;
        let got_out: Vec<bf16> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
        let got_lse: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&lse)?);
        let want =
            reference::sparse_mla(&l, &pool, &q, &indices, n_tokens, h, topk, op.softmax_scale);
        // The reference itself: twice one slot is ln 2 more lse and the same output.
        let ln2 = std::f64::consts::LN_2;
        for (once, many, copies) in [(1, 2, 2.0f64), (3, 4, topk as f64)] {
            for hh in 0..h {
                let (a, m) = (once * h + hh, many * h + hh);
                ensure(
                    (want.lse[m] - want.lse[a] - copies.ln()).abs() < 1e-9,
                    || {
                        format!("reference: lse of token {many} head {hh} is not lse of token {once} + ln {copies}")
                    },
                )?;
            }
        }
        ensure(want.n_valid[..3] == [3, 1, 2], || {
            format!("reference counts {:?} valid slots", &want.n_valid[..3])
        })?;
        let dtype: DataType = dt.into();
        let to = tolerance::get(Op::SparseMla, Quantity::Out, dtype)?;
        let tl = tolerance::get(Op::SparseMla, Quantity::Lse, dtype)?;
        let (mut so, mut sl) = (ErrorStats::default(), ErrorStats::default());
        for (i, g) in got_out.iter().enumerate() {
            so.add(i, g.to_f64(), want.out[i], want.out_magnitude(i), to);
        }
        for (i, g) in got_lse.iter().enumerate() {
            sl.add(i, *g as f64, want.lse[i], want.lse_magnitude[i], tl);
        }
        ensure(so.pass() && sl.pass(), || {
            format!(
                "sparse_mla {dt:?} with duplicate indices: out {}; lse {}",
                so.summary(),
                sl.summary()
            )
        })?;
        // And directly: token 2 is token 1 with its slot listed twice.
        let d_lse = (0..h)
            .map(|hh| got_lse[2 * h + hh] as f64 - got_lse[h + hh] as f64)
            .fold(0.0f64, |m, x| m.max((x - ln2).abs()));
        ensure(d_lse < 1e-4, || {
            format!("sparse_mla {dt:?}: lse of a slot listed twice is off ln 2 by {d_lse:.3e}")
        })?;
    }
    Ok(())
}
