//! DeepSeek-V4 attention checks beyond the suite's reference cases: typed errors for every
//! malformed `sparse_mla_v4` call (a rejected call writes nothing), the documented sink and
//! empty-row values, garbage past the lengths, and an empty batch.

use half::bf16;
use sparsekit_host::layout::{KvDtype, KvLayout};
use sparsekit_host::ops::{SparseMla, SparseMlaV4, V4Cache};
use sparsekit_host::{Backend, Error, KvInput};

use super::{ensure, Failure, Outcome};
use crate::fixtures::{self, bytes_of, case_rng, Paging};
use crate::tolerance::{ErrorStats, Quantity};

/// A small valid call: `n` tokens, 4 heads, a model1_fp8 main cache (P 3, top-k 8) and a
/// bf16_512 extra cache (P 2, top-k 5), every slot filled.
struct Small {
    main_l: KvLayout,
    extra_l: KvLayout,
    main_pool: Vec<u8>,
    extra_pool: Vec<u8>,
    main_idx: Vec<i32>,
    extra_idx: Vec<i32>,
    q: Vec<bf16>,
    n: usize,
    h: usize,
}

const MAIN_K: usize = 8;
const EXTRA_K: usize = 5;

impl Small {
    fn new(n: usize, h: usize) -> Result<Self, Error> {
        let rng = &mut case_rng(5, 16);
        let main_l = KvLayout::model1_fp8(3)?;
        let extra_l = KvLayout::bf16_512(2)?;
        let pool = |rng: &mut _, l: &KvLayout, slots: u32| {
            let paging = Paging::new(rng, l.page_size(), &[slots], 0);
            fixtures::kv_pool(rng, l, &paging)
        };
        let main_pool = pool(rng, &main_l, 12);
        let extra_pool = pool(rng, &extra_l, 8);
        let main_idx = (0..n * MAIN_K).map(|i| (i % 12) as i32).collect();
        let extra_idx = (0..n * EXTRA_K).map(|i| (i * 3 % 8) as i32).collect();
        let q = fixtures::bf16_normal(rng, n * h * SparseMlaV4::D, 1.0);
        Ok(Small {
            main_l,
            extra_l,
            main_pool,
            extra_pool,
            main_idx,
            extra_idx,
            q,
            n,
            h,
        })
    }

    fn op<'a>(&self, main_lens: Option<&'a [u32]>, sink: Option<&'a [f32]>) -> SparseMlaV4<'a> {
        SparseMlaV4 {
            n_tokens: self.n,
            n_heads: self.h,
            softmax_scale: 0.05,
            main: V4Cache {
                layout: self.main_l,
                topk: MAIN_K,
                lengths: main_lens,
            },
            extra: Some(V4Cache {
                layout: self.extra_l,
                topk: EXTRA_K,
                lengths: None,
            }),
            attn_sink: sink,
        }
    }

    /// Runs `op` with `main_idx` as the main indices; returns (out, lse) or the error.
    fn run<B: Backend>(
        &self,
        b: &B,
        op: &SparseMlaV4<'_>,
        main_idx: &[i32],
        out: &mut B::Buffer,
        lse: &mut B::Buffer,
    ) -> Result<(), Error> {
        let (mc, ec) = (b.upload(&self.main_pool)?, b.upload(&self.extra_pool)?);
        let (mi, ei) = (
            b.upload(bytes_of(main_idx))?,
            b.upload(bytes_of(&self.extra_idx))?,
        );
        let q = b.upload(bytes_of(&self.q))?;
        b.sparse_mla_v4(
            op,
            &q,
            KvInput {
                cache: &mc,
                indices: &mi,
            },
            op.extra.map(|_| KvInput {
                cache: &ec,
                indices: &ei,
            }),
            out,
            lse,
        )
    }

    /// Runs `op` and returns (out, lse).
    fn outputs<B: Backend>(
        &self,
        b: &B,
        op: &SparseMlaV4<'_>,
        main_idx: &[i32],
    ) -> Result<(Vec<bf16>, Vec<f32>), Error> {
        let mut out = b.upload(&fixtures::poison_bf16(op.n_tokens * op.n_heads * 512))?;
        let mut lse = b.upload(&fixtures::poison_f32(op.n_tokens * op.n_heads))?;
        self.run(b, op, main_idx, &mut out, &mut lse)?;
        Ok((
            bytemuck::pod_collect_to_vec(&b.download(&out)?),
            bytemuck::pod_collect_to_vec(&b.download(&lse)?),
        ))
    }
}

/// A malformed call: its name, the op, its main indices and the error it must give.
type Case<'a> = (&'a str, SparseMlaV4<'a>, &'a [i32], fn(&Error) -> bool);

/// Every malformed call is a typed error and writes neither `out` nor `lse`: heads 0 and
/// 129, lengths past the top-k, an index past its pool or below -1 inside the length,
/// V3.2 layouts given to the V4 op (and V4 layouts to the V3.2 op), extra buffers without
/// an extra cache, a sink of the wrong length or NaN, a short `q`; page size 0 is refused by
/// the layout.
pub fn typed_errors<B: Backend>(b: &B) -> Outcome {
    let s = Small::new(4, 4)?;
    let lens = [8u32, 9, 1, 0];
    let good_lens = [8u32, 2, 1, 0];
    let nan_sink = [0.0f32, f32::NAN, 0.0, 0.0];
    let short_sink = [0.0f32; 3];
    let mut past = s.main_idx.clone();
    past[MAIN_K + 1] = 36; // pool of 12 pages × 3 = 36 slots
    let mut below = s.main_idx.clone();
    below[3] = -2;
    let v32 = KvLayout::new(KvDtype::Bf16, 448, 64, 3)?;
    let mut cases: Vec<Case<'_>> = vec![
        (
            "n_heads 0",
            SparseMlaV4 {
                n_heads: 0,
                ..s.op(None, None)
            },
            &s.main_idx,
            |e| {
                matches!(
                    e,
                    Error::InvalidArgument {
                        what: "n_heads",
                        ..
                    }
                )
            },
        ),
        (
            "n_heads 129",
            SparseMlaV4 {
                n_heads: 129,
                ..s.op(None, None)
            },
            &s.main_idx,
            |e| {
                matches!(
                    e,
                    Error::InvalidArgument {
                        what: "n_heads",
                        ..
                    }
                )
            },
        ),
        (
            "length above top-k",
            s.op(Some(&lens), None),
            &s.main_idx,
            |e| matches!(e, Error::InvalidArgument { .. }),
        ),
        (
            "index past the pool",
            s.op(Some(&good_lens), None),
            &past,
            |e| matches!(e, Error::SlotOutOfRange { slot: 36, .. }),
        ),
        ("index -2", s.op(None, None), &below, |e| {
            matches!(e, Error::SlotOutOfRange { slot: -2, .. })
        }),
        ("NaN sink", s.op(None, Some(&nan_sink)), &s.main_idx, |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "attn_sink",
                    ..
                }
            )
        }),
        (
            "sink of 3 for 4 heads",
            s.op(None, Some(&short_sink)),
            &s.main_idx,
            |e| {
                matches!(
                    e,
                    Error::Shape {
                        what: "attn_sink",
                        ..
                    }
                )
            },
        ),
    ];
    let mut op = s.op(None, None);
    op.main.layout = v32;
    cases.push(("V3.2 layout in the V4 op", op, &s.main_idx, |e| {
        matches!(e, Error::InvalidArgument { .. })
    }));
    let before_out = fixtures::poison_bf16(4 * 4 * 512);
    let before_lse = fixtures::poison_f32(4 * 4);
    for (what, op, idx, pred) in cases {
        let mut out = b.upload(&before_out)?;
        let mut lse = b.upload(&before_lse)?;
        match s.run(b, &op, idx, &mut out, &mut lse) {
            Ok(()) => return Err(Failure(format!("{what}: accepted, must be rejected"))),
            Err(e) => ensure(pred(&e), || format!("{what}: unexpected error {e:?}"))?,
        }
        ensure(
            b.download(&out)? == before_out && b.download(&lse)? == before_lse,
            || format!("{what}: the rejected call wrote"),
        )?;
    }
    // Extra buffers for a call without an extra cache, and a short q.
    let op = SparseMlaV4 {
        extra: None,
        ..s.op(None, None)
    };
    let (mc, mi) = (b.upload(&s.main_pool)?, b.upload(bytes_of(&s.main_idx))?);
    let q = b.upload(bytes_of(&s.q))?;
    let short_q = b.upload(bytes_of(&s.q[1..]))?;
    for (what, q, extra) in [
        ("extra buffers without an extra cache", &q, true),
        ("short q", &short_q, false),
    ] {
        let mut out = b.upload(&before_out)?;
        let mut lse = b.upload(&before_lse)?;
        let kv = KvInput {
            cache: &mc,
            indices: &mi,
        };
        let r = b.sparse_mla_v4(&op, q, kv, extra.then_some(kv), &mut out, &mut lse);
        ensure(r.is_err(), || format!("{what}: accepted"))?;
        ensure(
            b.download(&out)? == before_out && b.download(&lse)? == before_lse,
            || format!("{what}: the rejected call wrote"),
        )?;
    }
    // A V4 layout given to the V3.2 op.
    let v3 = SparseMla {
        layout: s.main_l,
        n_tokens: 4,
        n_heads: 4,
        topk: MAIN_K,
        softmax_scale: 0.1,
    };
    let mut out = b.upload(&fixtures::poison_bf16(4 * 4 * 448))?;
    let mut lse = b.upload(&before_lse)?;
    let q3 = b.upload(bytes_of(&vec![bf16::ONE; 4 * 4 * 512]))?;
    ensure(
        matches!(
            b.sparse_mla(&v3, &q3, &mc, &mi, &mut out, &mut lse),
            Err(Error::InvalidArgument { what: "layout", .. })
        ),
        || "sparse_mla accepted a model1_fp8 layout".into(),
    )?;
    ensure(KvLayout::model1_fp8(0).is_err(), || {
        "model1_fp8 with page size 0 accepted".into()
    })?;
    Ok(())
}

/// The documented values: a token without a valid key (lengths 0, or only `-1`) gets
/// `out = 0`, `lse = +inf`; a sink of `-inf` changes nothing (bit-identical to no sink); a
/// sink of `+inf` zeroes `out` and leaves `lse`; entries past a length are never read
/// (`i32::MAX` there is no error and changes nothing).
pub fn sinks_and_empty_rows<B: Backend>(b: &B) -> Outcome {
    let s = Small::new(4, 4)?;
    let lens = [8u32, 3, 0, 5];
    let mut minus = s.main_idx.clone();
    minus[3 * MAIN_K..3 * MAIN_K + 5].fill(-1); // token 3: only -1 inside its length
    let mut op = s.op(Some(&lens), None);
    // Token 2 and 3 use no extra entry either: give them lengths 0 there.
    let extra_lens = [5u32, 2, 0, 0];
    op.extra = op.extra.map(|c| V4Cache {
        lengths: Some(&extra_lens),
        ..c
    });
    let (out, lse) = s.outputs(b, &op, &minus)?;
    let per = 4 * 512;
    for t in [2usize, 3] {
        ensure(
            out[t * per..(t + 1) * per]
                .iter()
                .all(|x| x.to_f32() == 0.0),
            || format!("token {t} without a valid key: out is not 0"),
        )?;
        ensure(
            lse[t * 4..(t + 1) * 4].iter().all(|&x| x == f32::INFINITY),
            || {
                format!(
                    "token {t} without a valid key: lse {:?}, want +inf",
                    &lse[t * 4..t * 4 + 4]
                )
            },
        )?;
    }
    // Garbage past the lengths: i32::MAX and a slot past the pool are never read.
    let mut garbage = minus.clone();
    garbage[MAIN_K + 3] = i32::MAX;
    garbage[MAIN_K + 7] = 1_000_000;
    let (out_g, lse_g) = s.outputs(b, &op, &garbage)?;
    ensure(
        bits(&out_g) == bits(&out)
            && lse_g
                .iter()
                .map(|x| x.to_bits())
                .eq(lse.iter().map(|x| x.to_bits())),
        || "entries past a length changed the result".into(),
    )?;
    // Sinks: -inf is no sink; +inf zeroes out and keeps lse.
    let neg = [f32::NEG_INFINITY; 4];
    let pos = [f32::INFINITY; 4];
    let op_neg = SparseMlaV4 {
        attn_sink: Some(&neg),
        ..op
    };
    let (out_n, lse_n) = s.outputs(b, &op_neg, &minus)?;
    ensure(bits(&out_n) == bits(&out), || {
        "sink -inf changed out".into()
    })?;
    ensure(
        lse_n
            .iter()
            .map(|x| x.to_bits())
            .eq(lse.iter().map(|x| x.to_bits())),
        || "sink -inf changed lse".into(),
    )?;
    let op_pos = SparseMlaV4 {
        attn_sink: Some(&pos),
        ..op
    };
    let (out_p, lse_p) = s.outputs(b, &op_pos, &minus)?;
    ensure(out_p.iter().all(|x| x.to_f32() == 0.0), || {
        "sink +inf left a non-zero out".into()
    })?;
    ensure(
        lse_p
            .iter()
            .map(|x| x.to_bits())
            .eq(lse.iter().map(|x| x.to_bits())),
        || "sink +inf changed lse (it must exclude the sink)".into(),
    )?;
    // An empty batch writes nothing.
    let empty = SparseMlaV4 {
        n_tokens: 0,
        ..s.op(None, None)
    };
    let mut o = b.upload(&[])?;
    let mut l = b.upload(&[])?;
    let (mc, ec, nothing) = (
        b.upload(&s.main_pool)?,
        b.upload(&s.extra_pool)?,
        b.upload(&[])?,
    );
    b.sparse_mla_v4(
        &empty,
        &nothing,
        KvInput {
            cache: &mc,
            indices: &nothing,
        },
        Some(KvInput {
            cache: &ec,
            indices: &nothing,
        }),
        &mut o,
        &mut l,
    )?;
    Ok(())
}

fn bits(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Non-finite inputs: a valid main key holding NaN (in its RoPE dims) and an extra key ±inf
/// (model1_fp8: its tile's scale is NaN), queries holding NaN and inf, a token without a
/// valid key: every head gets NaN exactly where the reference does, and the rest agrees
/// with it. Run with a bf16_512 main cache and with a model1_fp8 one.
pub fn nonfinite<B: Backend>(b: &B) -> Outcome {
    // A bf16_512 main cache, then every cache model1_fp8 (the block-scaled path on
    // sm_120a targets).
    nonfinite_with(b, KvLayout::bf16_512(4)?)?;
    nonfinite_with(b, KvLayout::model1_fp8(4)?)
}

fn nonfinite_with<B: Backend>(b: &B, ml: KvLayout) -> Outcome {
    let rng = &mut case_rng(super::seed(), 0x4e4e_0404);
    let (n, h, d) = (6usize, 16usize, SparseMlaV4::D);
    let el = KvLayout::model1_fp8(3)?;
    let (mk, ek) = (8usize, 6usize);
    let pool = |rng: &mut _, l: &KvLayout, slots: usize, spoil: &[(usize, usize, f32)]| {
        let mut kv = fixtures::token_rows(rng, slots, d);
        for &(s, c, v) in spoil {
            kv[s * d + c] = bf16::from_f32(v);
        }
        let mut p = fixtures::garbage(rng, l.buffer_bytes(slots / l.page_size()));
        let all: Vec<i64> = (0..slots as i64).collect();
        crate::reference::kv_store(l, &mut p, &kv, &all);
        p
    };
    // Main slot 5 holds NaN (rope dim 470); extra slot 4 holds +inf in tile 2.
    let mpool = pool(rng, &ml, 16, &[(5, 470, f32::NAN)]);
    let epool = pool(rng, &el, 12, &[(4, 130, f32::INFINITY)]);
    // Token 0 meets main slot 5, token 1 extra slot 4, the others finite slots only;
    // token 5 uses nothing.
    let mut mi: Vec<i32> = (0..n * mk)
        .map(|i| [0, 1, 2, 3, 6, 7, 8, 9][i % mk])
        .collect();
    mi[3] = 5;
    let mut ei: Vec<i32> = (0..n * ek).map(|i| [0, 1, 2, 3, 5, 6][i % ek]).collect();
    ei[ek + 2] = 4;
    let mlens = [8u32, 8, 8, 8, 8, 0];
    let elens = [6u32, 6, 6, 6, 6, 0];
    let mut q = fixtures::bf16_normal(rng, n * h * d, 1.0);
    q[(3 * h + 1) * d + 11] = bf16::NAN; // token 3 head 1: every score NaN
    q[(4 * h + 2) * d + 300] = bf16::INFINITY; // token 4 head 2: ±inf scores
    let op = SparseMlaV4 {
        n_tokens: n,
        n_heads: h,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        main: V4Cache {
            layout: ml,
            topk: mk,
            lengths: Some(&mlens),
        },
        extra: Some(V4Cache {
            layout: el,
            topk: ek,
            lengths: Some(&elens),
        }),
        attn_sink: None,
    };
    let mut out = b.upload(&fixtures::poison_bf16(n * h * d))?;
    let mut lse = b.upload(&fixtures::poison_f32(n * h))?;
    let (mc, ec) = (b.upload(&mpool)?, b.upload(&epool)?);
    let (mib, eib) = (b.upload(bytes_of(&mi))?, b.upload(bytes_of(&ei))?);
    b.sparse_mla_v4(
        &op,
        &b.upload(bytes_of(&q))?,
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
    )?;
    let got_out: Vec<bf16> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    let got_lse: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&lse)?);
    let want = crate::reference::sparse_mla_v4(&op, &q, (&mpool, &mi), Some((&epool, &ei)));
    let dt = ml.dtype().into();
    let to = crate::tolerance::get(sparsekit_host::ops::Op::SparseMlaV4, Quantity::Out, dt)?;
    let tl = crate::tolerance::get(sparsekit_host::ops::Op::SparseMlaV4, Quantity::Lse, dt)?;
    let (mut so, mut sl) = (ErrorStats::default(), ErrorStats::default());
    for (i, g) in got_out.iter().enumerate() {
        so.add_nonfinite(i, g.to_f64(), want.out[i], want.out_magnitude(i), to);
    }
    for (i, g) in got_lse.iter().enumerate() {
        sl.add_nonfinite(i, *g as f64, want.lse[i], want.lse_magnitude[i], tl);
    }
    ensure(want.lse.iter().any(|x| x.is_nan()), || {
        "the case has no NaN head".into()
    })?;
    ensure(so.pass() && sl.pass(), || {
        let bad: Vec<String> = (0..n * h)
            .filter(|&i| {
                want.lse[i].is_nan() != got_lse[i].is_nan()
                    || (0..d).any(|c| want.out[i * d + c].is_nan() != got_out[i * d + c].is_nan())
            })
            .map(|i| format!("token {} head {}", i / h, i % h))
            .collect();
        format!(
            "sparse_mla_v4 non-finite (main {:?}): out {}; lse {}; NaN disagreements at {}",
            ml.dtype(),
            so.summary(),
            sl.summary(),
            bad.join(", ")
        )
    })
}
