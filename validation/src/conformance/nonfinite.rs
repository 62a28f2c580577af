//! Non-finite inputs: every op run on inputs holding NaN, `+inf` and `-inf` (in keys,
//! latents, queries, weights, logits, stored scales) must give what the f64 reference
//! gives — NaN where the reference gives NaN (never a plausible number, never the
//! empty-attention values), the same infinities, and within tolerance elsewhere; stores
//! byte for byte.
//!
//! The conventions this pins (documented in `docs/golden.md`):
//! - a store quantises a token holding `±inf` with scale `inf` (every finite value becomes
//!   the code of `0`, `±inf` the NaN code, whose sign is the platform's: compared up to
//!   it), and ignores NaN when it takes the amax;
//! - the indexer's ReLU maps a NaN dot product to 0 (as `fmax` does on every backend);
//!   a NaN or infinite weight or key scale reaches the logit;
//! - top-k never selects NaN or `-inf`; `+inf` is a value like any other;
//! - sparse MLA gives NaN for a head whose softmax meets a NaN score or has no finite
//!   maximum (all its scores `±inf`), and `out = 0`, `lse = -inf` only for a token with no
//!   valid slot.

use half::bf16;
use rand::Rng;
use sparsekit_host::dtype::ScaleFormat;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout, PageLayout};
use sparsekit_host::ops::{
    decode_rows, IndexKStore, IndexerLogits, KvStore, Op, PageTable, SparseMla, Topk, TopkOutput,
};
use sparsekit_host::Backend;

use super::{ensure, seed, Failure, Outcome};
use crate::fixtures::{self, bytes_of, case_rng, Paging, SuiteRng};
use crate::reference;
use crate::tolerance::{self, DataType, ErrorStats, Quantity};

/// Replaces a few values of each listed token row by NaN, `+inf` or `-inf` (pattern
/// `kinds[i % kinds.len()]` for row `rows[i]`).
fn spoil(rng: &mut SuiteRng, xs: &mut [bf16], dim: usize, rows: &[usize], kinds: &[Spoil]) {
    for (i, &r) in rows.iter().enumerate() {
        let row = &mut xs[r * dim..(r + 1) * dim];
        let at = rng.gen_range(0..dim);
        match kinds[i % kinds.len()] {
            Spoil::Nan => row[at] = bf16::NAN,
            Spoil::PosInf => row[at] = bf16::INFINITY,
            Spoil::NegInf => row[at] = bf16::NEG_INFINITY,
            Spoil::InfAndNan => {
                row[at] = bf16::INFINITY;
                row[(at + 1) % dim] = bf16::NAN;
            }
            Spoil::AllNan => row.fill(bf16::NAN),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Spoil {
    Nan,
    PosInf,
    NegInf,
    InfAndNan,
    AllNan,
}

const SPOILS: [Spoil; 5] = [
    Spoil::Nan,
    Spoil::PosInf,
    Spoil::NegInf,
    Spoil::InfAndNan,
    Spoil::AllNan,
];

/// The failure of [`attention`] when the only disagreements are heads without a finite
/// maximum score (every score NaN or `-inf`) reported as an empty attention (`lse =
/// -inf`, `out` 0) where the reference gives NaN.
pub const EMPTY_FOR_NAN: &str = "heads without a finite maximum score reported as empty";

/// Both stores, every dtype: tokens with NaN, `±inf`, both, or all NaN; byte-exact.
pub fn stores<B: Backend>(b: &B) -> Outcome {
    let seed = seed();
    seeded(seed, stores_case(b, seed))
}

fn stores_case<B: Backend>(b: &B, seed: u64) -> Outcome {
    let rng = &mut case_rng(seed, 0x4e4e_0001);
    let n = 12;
    let spoilt: Vec<usize> = (0..n).filter(|t| t % 2 == 0).collect();
    for dt in [
        IndexKDtype::FP8,
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Ue8m0,
        },
        IndexKDtype::Bf16,
    ] {
        let l = IndexKLayout::new(dt, 64, 16)?;
        let mut keys = fixtures::token_rows(rng, n, 64);
        spoil(rng, &mut keys, 64, &spoilt, &SPOILS);
        let slots: Vec<i64> = (0..n as i64).map(|t| (t * 5 + 3) % 32).collect();
        let cache0 = fixtures::garbage(rng, l.buffer_bytes(2));
        let mut want = cache0.clone();
        reference::index_k_store(&l, &mut want, &keys, &slots);
        let mut cache = b.upload(&cache0)?;
        b.index_k_store(
            &IndexKStore {
                layout: l,
                slots: &slots,
            },
            &b.upload(bytes_of(&keys))?,
            &mut cache,
        )?;
        same_bytes(
            &format!("index_k_store {dt:?}"),
            &b.download(&cache)?,
            &want,
        )?;
    }
    for dt in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
        let l = KvLayout::new(dt, 256, 32, 16)?;
        let d = l.d_qk();
        let mut kv = fixtures::token_rows(rng, n, d);
        spoil(rng, &mut kv, d, &spoilt, &SPOILS);
        let slots: Vec<i64> = (0..n as i64).map(|t| (t * 7 + 1) % 32).collect();
        let cache0 = fixtures::garbage(rng, l.buffer_bytes(2));
        let mut want = cache0.clone();
        reference::kv_store(&l, &mut want, &kv, &slots);
        let mut cache = b.upload(&cache0)?;
        b.kv_store(
            &KvStore {
                layout: l,
                slots: &slots,
            },
            &b.upload(bytes_of(&kv))?,
            &mut cache,
        )?;
        same_bytes(
            &format!("kv_store {dt:?}"),
            &canonical_nan_codes(l.into(), &b.download(&cache)?),
            &canonical_nan_codes(l.into(), &want),
        )?;
    }
    Ok(())
}

/// Adds the seed to a failure.
fn seeded(seed: u64, o: Outcome) -> Outcome {
    o.map_err(|f| {
        if f.0.contains("SPARSEKIT_SEED") {
            f
        } else {
            Failure(format!("{f} (SPARSEKIT_SEED={seed})"))
        }
    })
}

/// `cache` with every fp8 NaN code made positive (`0xff` → `0x7f`) at the e4m3 value
/// bytes of `layout`: the sign of `inf / inf` is the platform's (x86 sets it, GPUs do
/// not), so stores of ±inf are compared up to it.
fn canonical_nan_codes(layout: PageLayout, cache: &[u8]) -> Vec<u8> {
    let mut out = cache.to_vec();
    let fp8_values = |offset: usize| -> std::ops::Range<usize> {
        match layout {
            PageLayout::IndexK(l) if l.has_scales() => l.value_range(offset),
            PageLayout::Kv(l) if l.dtype() == KvDtype::Fp8DsMla => {
                let t = l.token_range(offset);
                t.start..t.start + l.nope_range().end
            }
            _ => 0..0,
        }
    };
    for page in out.chunks_exact_mut(layout.bytes_per_page()) {
        for offset in 0..layout.page_size() {
            for b in &mut page[fp8_values(offset)] {
                if *b == 0xff {
                    *b = 0x7f;
                }
            }
        }
    }
    out
}

fn same_bytes(what: &str, got: &[u8], want: &[u8]) -> Outcome {
    match got.iter().zip(want).position(|(g, w)| g != w) {
        None if got.len() == want.len() => Ok(()),
        None => Err(Failure(format!(
            "{what}: {} bytes, want {}",
            got.len(),
            want.len()
        ))),
        Some(i) => Err(Failure(format!(
            "{what}: byte {i} is {:#04x}, the reference writes {:#04x}",
            got[i], want[i]
        ))),
    }
}

/// The indexer over caches holding non-finite keys (stored by the reference), with NaN
/// and infinite queries and weights.
pub fn indexer<B: Backend>(b: &B) -> Outcome {
    let seed = seed();
    seeded(seed, indexer_case(b, seed))
}

fn indexer_case<B: Backend>(b: &B, seed: u64) -> Outcome {
    let rng = &mut case_rng(seed, 0x4e4e_0002);
    let (h, d, ps) = (8, 64, 16);
    for dt in [IndexKDtype::FP8, IndexKDtype::Bf16] {
        let l = IndexKLayout::new(dt, d, ps)?;
        let lens = [40u32, 17, 33, 5];
        let paging = Paging::new(rng, ps, &lens, 1);
        let slots = paging.all_slots();
        let mut keys = fixtures::token_rows(rng, slots.len(), d);
        let spoilt: Vec<usize> = (0..slots.len()).filter(|t| t % 9 == 4).collect();
        spoil(rng, &mut keys, d, &spoilt, &SPOILS);
        let mut pool = fixtures::garbage(rng, l.buffer_bytes(paging.num_pages));
        reference::index_k_store(&l, &mut pool, &keys, &slots);
        let pt = PageTable::new(&paging.table, paging.max_pages)?;
        let rows = decode_rows(&lens, 2)?;
        let stride = 41;
        let (mut q, mut w) = fixtures::indexer_inputs(rng, rows.len(), h, d);
        spoil(rng, &mut q, d, &[1, 6], &[Spoil::Nan, Spoil::PosInf]);
        w[2 * h + 3] = f32::INFINITY;
        w[5 * h] = f32::NAN;
        w[7 * h + 1] = f32::NEG_INFINITY;
        let op = IndexerLogits {
            layout: l,
            n_heads: h,
            page_table: pt,
            rows,
            row_stride: stride,
        };
        let mut out = b.upload(&fixtures::poison_f32(op.rows.len() * stride))?;
        b.indexer_logits(
            &op,
            &b.upload(bytes_of(&q))?,
            &b.upload(bytes_of(&w))?,
            &b.upload(&pool)?,
            &mut out,
        )?;
        let got: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
        let want = reference::indexer_logits(&l, &pool, &pt, &op.rows, h, &q, &w, stride);
        let t = tolerance::get(Op::IndexerLogits, Quantity::Logits, dt.into())?;
        let mut stats = ErrorStats::default();
        for (i, g) in got.iter().enumerate() {
            stats.add_nonfinite(i, *g as f64, want.logits[i], want.magnitude[i], t);
        }
        ensure(stats.pass(), || {
            format!("indexer_logits {dt:?}: {}", stats.summary())
        })?;
        let nans = want.logits.iter().filter(|x| x.is_nan()).count();
        ensure(nans > 0, || "indexer case without a NaN logit".into())?;
    }
    Ok(())
}

/// Top-k rows mixing NaN, `±inf` and signed zeros.
pub fn topk<B: Backend>(b: &B) -> Outcome {
    let seed = seed();
    seeded(seed, topk_case(b, seed))
}

fn topk_case<B: Backend>(b: &B, seed: u64) -> Outcome {
    let rng = &mut case_rng(seed, 0x4e4e_0003);
    let k = 16;
    let lens = [300u32, 20, 17, 16, 64];
    let stride = 301;
    let mut logits = vec![f32::NEG_INFINITY; lens.len() * stride];
    for (r, &len) in lens.iter().enumerate() {
        for x in &mut logits[r * stride..r * stride + len as usize] {
            *x = match rng.gen_range(0..8) {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3 => -0.0,
                4 => 0.0,
                _ => fixtures::normal(rng) as f32,
            };
        }
    }
    let rows = decode_rows(&lens, 1)?;
    let op = Topk {
        short_rows: sparsekit_host::ops::ShortRows::SelectValid,
        k,
        row_stride: stride,
        rows: &rows,
        output: TopkOutput::Positions,
    };
    let mut out = b.upload(&fixtures::poison_i32(rows.len() * k))?;
    b.topk(&op, &b.upload(bytes_of(&logits))?, &mut out)?;
    let got: Vec<i32> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    for (r, range) in rows.iter().enumerate() {
        let row = &logits[r * stride..(r + 1) * stride];
        let (s, e) = (range.start as usize, range.end as usize);
        let mut want: Vec<i32> = reference::topk_row(&row[s..e], k)
            .into_iter()
            .map(|p| (s + p) as i32)
            .collect();
        want.resize(k, -1);
        let g = &got[r * k..(r + 1) * k];
        // Ties (±0, equal infinities) may pick other positions of equal value; the value
        // multisets and the ties-to-lower-position rule are both exact.
        ensure(g == want.as_slice(), || {
            format!("topk row {r}: got {g:?}, the reference selects {want:?}")
        })?;
    }
    Ok(())
}

/// Sparse MLA over caches holding NaN and infinite latents and ropes (bf16: the values;
/// fp8_ds_mla: the NaN code and infinite tile scales), with infinite queries; tokens
/// whose slots are all finite, tokens that meet a non-finite slot, and a token without a
/// valid slot.
pub fn attention<B: Backend>(b: &B) -> Outcome {
    let seed = seed();
    seeded(seed, attention_case(b, seed))
}

fn attention_case<B: Backend>(b: &B, seed: u64) -> Outcome {
    let rng = &mut case_rng(seed, 0x4e4e_0004);
    let (h, ps, topk) = (16, 16, 32);
    for dt in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
        let l = KvLayout::new(dt, 256, 32, ps)?;
        let lens = [30u32, 48, 20];
        let paging = Paging::new(rng, ps, &lens, 1);
        // Spoilt tokens are stored as a deployment would store them (fp8_ds_mla: an
        // infinite value makes its tile's scale infinite and every code of it 0 or NaN).
        let slots = paging.all_slots();
        let d = l.d_qk();
        let mut kv = fixtures::token_rows(rng, slots.len(), d);
        let at = |r: usize, pos: usize| lens[..r].iter().sum::<u32>() as usize + pos;
        kv[at(0, 3) * d + 17] = bf16::NAN;
        kv[at(1, 7) * d + 200] = bf16::INFINITY;
        kv[at(2, 11) * d + 256 + 5] = bf16::NEG_INFINITY;
        // Token 3 (request 0, positions 12..27): rope value 20 positive in every key, so
        // that head 5, whose query holds -inf there, has every score -inf.
        for pos in 12..27 {
            kv[at(0, pos) * d + 256 + 20] = bf16::from_f32(0.5);
        }
        let mut pool = fixtures::garbage(rng, l.buffer_bytes(paging.num_pages));
        reference::kv_store(&l, &mut pool, &kv, &slots);
        let n_tokens = 7;
        let mut indices = vec![-1i32; n_tokens * topk];
        // Token t of request t % 3: its first positions (token 0..2 meet the spoilt slot
        // of their request), token 3 finite slots only, token 6 none at all.
        for t in 0..n_tokens - 1 {
            let r = t % 3;
            let first = if t < 3 { 0 } else { 12 + r };
            for (j, pos) in (first..first + 15).enumerate() {
                if pos < lens[r] as usize {
                    indices[t * topk + 2 * j] = paging.slot(r, pos) as i32;
                }
            }
        }
        let mut q = fixtures::bf16_normal(rng, n_tokens * h * l.d_qk(), 1.0);
        // Token 4, head 2: an infinite query value; token 5, head 0: a NaN (every score
        // NaN); token 3, head 5: every score -inf (no finite maximum: NaN).
        q[(4 * h + 2) * d + 40] = bf16::INFINITY;
        q[(5 * h) * d + 7] = bf16::NAN;
        q[(3 * h + 5) * d + 256 + 20] = bf16::NEG_INFINITY;
        let op = SparseMla {
            layout: l,
            n_tokens,
            n_heads: h,
            topk,
            softmax_scale: 1.0 / (l.d_qk() as f32).sqrt(),
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
        let dtype: DataType = dt.into();
        let to = tolerance::get(Op::SparseMla, Quantity::Out, dtype)?;
        let tl = tolerance::get(Op::SparseMla, Quantity::Lse, dtype)?;
        let (mut so, mut sl) = (ErrorStats::default(), ErrorStats::default());
        for (i, g) in got_out.iter().enumerate() {
            so.add_nonfinite(i, g.to_f64(), want.out[i], want.out_magnitude(i), to);
        }
        for (i, g) in got_lse.iter().enumerate() {
            sl.add_nonfinite(i, *g as f64, want.lse[i], want.lse_magnitude[i], tl);
        }
        if !so.pass() || !sl.pass() {
            // Heads whose NaN-ness differs from the reference's.
            let bad: Vec<usize> = (0..n_tokens * h)
                .filter(|&i| {
                    want.lse[i].is_nan() != got_lse[i].is_nan()
                        || (0..dv)
                            .any(|c| want.out[i * dv + c].is_nan() != got_out[i * dv + c].is_nan())
                })
                .collect();
            // Every other head must agree with the reference.
            let (mut so_rest, mut sl_rest) = (ErrorStats::default(), ErrorStats::default());
            for i in (0..n_tokens * h).filter(|i| !bad.contains(i)) {
                for (c, g) in got_out.iter().enumerate().skip(i * dv).take(dv) {
                    so_rest.add_nonfinite(c, g.to_f64(), want.out[c], want.out_magnitude(c), to);
                }
                sl_rest.add_nonfinite(i, got_lse[i] as f64, want.lse[i], want.lse_magnitude[i], tl);
            }
            let empty_for_nan = !bad.is_empty()
                && (so_rest.failures, sl_rest.failures) == (0, 0)
                && bad.iter().all(|&i| {
                    want.lse[i].is_nan()
                        && got_lse[i] == f32::NEG_INFINITY
                        && got_out[i * dv..(i + 1) * dv]
                            .iter()
                            .all(|x| x.is_nan() || x.to_f32() == 0.0)
                });
            let heads: Vec<String> = bad
                .iter()
                .map(|i| format!("token {} head {}", i / h, i % h))
                .collect();
            return Err(Failure(if empty_for_nan {
                format!(
                    "sparse_mla {dt:?}: {EMPTY_FOR_NAN}: {} (SPARSEKIT_SEED={seed})",
                    heads.join(", ")
                )
            } else {
                format!(
                    "sparse_mla {dt:?}: out {}; lse {}; NaN disagreements at {} (SPARSEKIT_SEED={seed})",
                    so.summary(),
                    sl.summary(),
                    heads.join(", ")
                )
            }));
        }
        ensure(want.lse.iter().any(|x| x.is_nan()), || {
            "attention case without a NaN lse".into()
        })?;
        ensure(want.lse[3 * h + 5].is_nan(), || {
            "token 3 head 5 must have every score -inf".into()
        })?;
        ensure(want.lse[6 * h] == f64::NEG_INFINITY, || {
            "token 6 must have no valid slot".into()
        })?;
    }
    Ok(())
}
