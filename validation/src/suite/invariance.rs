//! Batch-invariance checks: each request's outputs must be bit-identical when computed
//! alone, inside a batch of 8, and with its rows/tokens split into chunks.

use half::bf16;
use rand::Rng;
use sparsekit_host::dims::ModelDims;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, PageTable, QueryRange,
    SparseMla, SparseMlaV4, Topk, TopkOutput, V4Cache,
};
use sparsekit_host::{Backend, Error, KvInput};

use super::record::Outcome;
use crate::fixtures::{
    self, bytes_of, indexer_inputs, mla_indices, page_layouts, prefill_rows, region, topk_logits,
    Paging, Scenario, SuiteRng,
};
use crate::tolerance::{bitwise, ErrorStats, Quantity};

const BATCH: usize = 8;

fn outcome(stats: ErrorStats, note: &str) -> Outcome {
    Outcome {
        quantity: Quantity::Bits,
        stats,
        tolerance: "bit-identical".into(),
        note: note.into(),
    }
}

/// Runs the invariance check of `op` at dims `d`.
pub(super) fn check<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    op: Op,
) -> Result<Outcome, Error> {
    let ps = d.page_size as u32;
    let lens: Vec<u32> = vec![1, ps + 1, 300, 77, 1000, 5, 2 * ps, 513];
    match op {
        Op::IndexKStore | Op::KvStore => stores(b, rng, d, op == Op::KvStore, &lens),
        Op::IndexerLogits => indexer_logits(b, rng, d, &lens),
        // Rows past `topk_chunk(k)` (8192 positions at k ≤ 2048) too: the GPU kernel
        // splits them into chunks merged by the row's last block.
        Op::Topk => topk(b, rng, d, &[1, ps + 1, 9000, 77, 20000, 5, 2 * ps, 8193]),
        Op::SparseMla => sparse_mla(b, rng, d, &lens),
        Op::SparseMlaV4 => sparse_mla_v4(b, rng),
        Op::CopyPages | Op::PageChecksums => pages(b, rng, d, op == Op::PageChecksums),
    }
}

fn stores<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    kv: bool,
    lens: &[u32],
) -> Result<Outcome, Error> {
    // Each request stores its newest 1..=24 tokens (a decode step or a prefill chunk).
    let paging = Paging::new(rng, d.page_size, lens, 1);
    let new: Vec<u32> = lens.iter().map(|&l| rng.gen_range(1..=24).min(l)).collect();
    let slots: Vec<i64> = lens
        .iter()
        .zip(&new)
        .enumerate()
        .flat_map(|(r, (&l, &n))| (l - n..l).map(move |p| (r, p as usize)))
        .map(|(r, p)| paging.slot(r, p))
        .collect();
    let ilayout = IndexKLayout::new(IndexKDtype::FP8, d.index_head_dim, d.page_size)?;
    let klayout = KvLayout::new(
        KvDtype::Fp8DsMla,
        d.kv_lora_rank,
        d.qk_rope_dim,
        d.page_size,
    )?;
    let (dim, bytes) = if kv {
        (klayout.d_qk(), klayout.buffer_bytes(paging.num_pages))
    } else {
        (ilayout.head_dim(), ilayout.buffer_bytes(paging.num_pages))
    };
    let cache0 = fixtures::garbage(rng, bytes);
    let data = fixtures::token_rows(rng, slots.len(), dim);
    let store = |cache: &mut B::Buffer, from: usize, to: usize| -> Result<(), Error> {
        let s = &slots[from..to];
        let x = b.upload(bytes_of(&data[from * dim..to * dim]))?;
        if kv {
            b.kv_store(
                &KvStore {
                    layout: klayout,
                    slots: s,
                },
                &x,
                cache,
            )
        } else {
            b.index_k_store(
                &IndexKStore {
                    layout: ilayout,
                    slots: s,
                },
                &x,
                cache,
            )
        }
    };
    let mut all = b.upload(&cache0)?;
    store(&mut all, 0, slots.len())?;
    let all = b.download(&all)?;
    let mut stats = ErrorStats::default();
    // Request by request, then in chunks of 3 tokens.
    for chunk in [0usize, 3] {
        let mut c = b.upload(&cache0)?;
        let mut from = 0;
        for &len in &new {
            let end = from + len as usize;
            if chunk == 0 {
                store(&mut c, from, end)?;
            } else {
                let mut s = from;
                while s < end {
                    store(&mut c, s, (s + chunk).min(end))?;
                    s += chunk;
                }
            }
            from = end;
        }
        bitwise(&mut stats, 0, &b.download(&c)?, &all);
    }
    Ok(outcome(
        stats,
        "whole batch vs per request vs chunks of 3 tokens",
    ))
}

fn indexer_logits<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    lens: &[u32],
) -> Result<Outcome, Error> {
    let layout = IndexKLayout::new(IndexKDtype::FP8, d.index_head_dim, d.page_size)?;
    let paging = Paging::new(rng, d.page_size, lens, 2);
    let cache = b.upload(&fixtures::index_k_pool(rng, &layout, &paging))?;
    let mut rows = prefill_rows(rng, lens);
    // A long prefill chunk (40 causal rows of the 1000-token request): large row groups,
    // whose head sums the CPU backend vectorises over rows instead of keys.
    let long = lens.iter().position(|&l| l >= 40).unwrap_or(0);
    let len = lens[long];
    rows.extend((0..40.min(len)).map(|i| QueryRange {
        request: long as u32,
        start: 0,
        end: len - 40.min(len) + i + 1,
    }));
    let stride = *lens.iter().max().unwrap_or(&1) as usize + 3;
    let h = d.index_n_heads;
    let hd = layout.head_dim();
    let (q, w) = indexer_inputs(rng, rows.len(), h, hd);
    let pt = PageTable::new(&paging.table, paging.max_pages)?;
    let run = |pt: PageTable<'_>, sel: &[usize], remap: bool| -> Result<Vec<u8>, Error> {
        let rs: Vec<QueryRange> = sel
            .iter()
            .map(|&i| QueryRange {
                request: if remap { 0 } else { rows[i].request },
                ..rows[i]
            })
            .collect();
        let qs: Vec<bf16> = sel
            .iter()
            .flat_map(|&i| q[i * h * hd..(i + 1) * h * hd].iter().copied())
            .collect();
        let ws: Vec<f32> = sel
            .iter()
            .flat_map(|&i| w[i * h..(i + 1) * h].iter().copied())
            .collect();
        let op = IndexerLogits {
            layout,
            n_heads: h,
            page_table: pt,
            rows: rs,
            row_stride: stride,
        };
        let mut out = b.upload(&fixtures::poison_f32(sel.len() * stride))?;
        b.indexer_logits(
            &op,
            &b.upload(bytes_of(&qs))?,
            &b.upload(bytes_of(&ws))?,
            &cache,
            &mut out,
        )?;
        b.download(&out)
    };
    let all_idx: Vec<usize> = (0..rows.len()).collect();
    let all = run(pt, &all_idx, false)?;
    let row_bytes = stride * 4;
    let mut stats = ErrorStats::default();
    for r in 0..lens.len() {
        let sel: Vec<usize> = all_idx
            .iter()
            .copied()
            .filter(|&i| rows[i].request as usize == r)
            .collect();
        let table = &paging.table[r * paging.max_pages..(r + 1) * paging.max_pages];
        let alone = run(PageTable::new(table, paging.max_pages)?, &sel, true)?;
        for (j, &i) in sel.iter().enumerate() {
            bitwise(
                &mut stats,
                i * row_bytes,
                &alone[j * row_bytes..(j + 1) * row_bytes],
                &all[i * row_bytes..(i + 1) * row_bytes],
            );
        }
    }
    for chunk in all_idx.chunks(2) {
        let got = run(pt, chunk, false)?;
        bitwise(
            &mut stats,
            chunk[0] * row_bytes,
            &got,
            &all[chunk[0] * row_bytes..(chunk[0] + chunk.len()) * row_bytes],
        );
    }
    Ok(outcome(
        stats,
        "batch of 8 requests vs each alone vs chunks of 2 rows",
    ))
}

fn topk<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    lens: &[u32],
) -> Result<Outcome, Error> {
    let k = d.index_topk;
    let stride = *lens.iter().max().unwrap_or(&1) as usize + 1;
    let sc = if rng.gen() {
        Scenario::Random
    } else {
        Scenario::ThresholdTies
    };
    let logits = topk_logits(rng, k, sc, lens, stride);
    let rows: Vec<QueryRange> = lens
        .iter()
        .map(|&l| QueryRange {
            request: 0,
            start: 0,
            end: l,
        })
        .collect();
    let run = |from: usize, to: usize| -> Result<Vec<u8>, Error> {
        let op = Topk {
            short_rows: sparsekit_host::ops::ShortRows::SelectValid,
            k,
            row_stride: stride,
            rows: &rows[from..to],
            output: TopkOutput::Positions,
        };
        let mut out = b.upload(&fixtures::poison_i32((to - from) * k))?;
        b.topk(
            &op,
            &b.upload(bytes_of(&logits[from * stride..to * stride]))?,
            &mut out,
        )?;
        b.download(&out)
    };
    let all = run(0, rows.len())?;
    let mut stats = ErrorStats::default();
    for step in [1usize, 3] {
        let mut from = 0;
        while from < rows.len() {
            let to = (from + step).min(rows.len());
            bitwise(
                &mut stats,
                from * k * 4,
                &run(from, to)?,
                &all[from * k * 4..to * k * 4],
            );
            from = to;
        }
    }
    Ok(outcome(
        stats,
        "batch of 8 rows vs each alone vs chunks of 3",
    ))
}

fn sparse_mla<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    lens: &[u32],
) -> Result<Outcome, Error> {
    let layout = KvLayout::new(
        KvDtype::Fp8DsMla,
        d.kv_lora_rank,
        d.qk_rope_dim,
        d.page_size,
    )?;
    let paging = Paging::new(rng, d.page_size, lens, 1);
    let cache = b.upload(&fixtures::kv_pool(rng, &layout, &paging))?;
    let (topk, h) = (d.index_topk, d.q_heads[0]);
    let indices = mla_indices(rng, &paging, BATCH, topk);
    let dqk = layout.d_qk();
    let q = fixtures::bf16_normal(rng, BATCH * h * dqk, 1.0);
    let scale = 1.0 / (dqk as f32).sqrt();
    let run = |from: usize, to: usize| -> Result<(Vec<u8>, Vec<u8>), Error> {
        let n = to - from;
        let op = SparseMla {
            layout,
            n_tokens: n,
            n_heads: h,
            topk,
            softmax_scale: scale,
        };
        let mut out = b.upload(&fixtures::poison_bf16(n * h * layout.nope_dim()))?;
        let mut lse = b.upload(&fixtures::poison_f32(n * h))?;
        b.sparse_mla(
            &op,
            &b.upload(bytes_of(&q[from * h * dqk..to * h * dqk]))?,
            &cache,
            &b.upload(bytes_of(&indices[from * topk..to * topk]))?,
            &mut out,
            &mut lse,
        )?;
        Ok((b.download(&out)?, b.download(&lse)?))
    };
    let (all_o, all_l) = run(0, BATCH)?;
    let (ob, lb) = (h * layout.nope_dim() * 2, h * 4);
    let mut stats = ErrorStats::default();
    for step in [1usize, 3] {
        let mut from = 0;
        while from < BATCH {
            let to = (from + step).min(BATCH);
            let (o, l) = run(from, to)?;
            bitwise(&mut stats, from * ob, &o, &all_o[from * ob..to * ob]);
            bitwise(&mut stats, from * lb, &l, &all_l[from * lb..to * lb]);
            from = to;
        }
    }
    Ok(outcome(
        stats,
        "batch of 8 tokens vs each alone vs chunks of 3",
    ))
}

/// `sparse_mla_v4` of 8 tokens (16 heads, a model1_fp8 window cache at P 256 and a
/// compressed one at P 64, lengths and sink) at once vs each alone vs chunks of 3.
fn sparse_mla_v4<B: Backend>(b: &B, rng: &mut SuiteRng) -> Result<Outcome, Error> {
    let (h, d) = (16usize, SparseMlaV4::D);
    let main_l = KvLayout::model1_fp8(256)?;
    let extra_l = KvLayout::model1_fp8(64)?;
    let (mk, ek) = (128usize, 512usize);
    let pool = |rng: &mut SuiteRng, l: &KvLayout, pages: usize| {
        let paging = Paging::new(rng, l.page_size(), &[(pages * l.page_size()) as u32], 0);
        (fixtures::kv_pool(rng, l, &paging), pages * l.page_size())
    };
    let (mpool, mcap) = pool(rng, &main_l, 2);
    let (epool, ecap) = pool(rng, &extra_l, 10);
    let idx = |rng: &mut SuiteRng, k: usize, cap: usize| -> Vec<i32> {
        (0..BATCH * k)
            .map(|_| {
                if rng.gen_range(0..16) == 0 {
                    -1
                } else {
                    rng.gen_range(0..cap as i32)
                }
            })
            .collect()
    };
    let (mi, ei) = (idx(rng, mk, mcap), idx(rng, ek, ecap));
    let mlens: Vec<u32> = (0..BATCH)
        .map(|t| [128, 0, 65, 1, 128, 64, 7, 128][t])
        .collect();
    let elens: Vec<u32> = (0..BATCH)
        .map(|t| [512, 0, 300, 1, 63, 511, 0, 512][t])
        .collect();
    let sink: Vec<f32> = (0..h).map(|_| fixtures::normal(rng) as f32).collect();
    let q = fixtures::bf16_normal(rng, BATCH * h * d, 1.0);
    let (mc, ec) = (b.upload(&mpool)?, b.upload(&epool)?);
    let run = |from: usize, to: usize| -> Result<(Vec<u8>, Vec<u8>), Error> {
        let n = to - from;
        let op = SparseMlaV4 {
            n_tokens: n,
            n_heads: h,
            softmax_scale: 1.0 / (d as f32).sqrt(),
            main: V4Cache {
                layout: main_l,
                topk: mk,
                lengths: Some(&mlens[from..to]),
            },
            extra: Some(V4Cache {
                layout: extra_l,
                topk: ek,
                lengths: Some(&elens[from..to]),
            }),
            attn_sink: Some(&sink),
        };
        let mut out = b.upload(&fixtures::poison_bf16(n * h * d))?;
        let mut lse = b.upload(&fixtures::poison_f32(n * h))?;
        let (mib, eib) = (
            b.upload(bytes_of(&mi[from * mk..to * mk]))?,
            b.upload(bytes_of(&ei[from * ek..to * ek]))?,
        );
        b.sparse_mla_v4(
            &op,
            &b.upload(bytes_of(&q[from * h * d..to * h * d]))?,
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
        Ok((b.download(&out)?, b.download(&lse)?))
    };
    let (all_o, all_l) = run(0, BATCH)?;
    let (ob, lb) = (h * d * 2, h * 4);
    let mut stats = ErrorStats::default();
    for step in [1usize, 3] {
        let mut from = 0;
        while from < BATCH {
            let to = (from + step).min(BATCH);
            let (o, l) = run(from, to)?;
            bitwise(&mut stats, from * ob, &o, &all_o[from * ob..to * ob]);
            bitwise(&mut stats, from * lb, &l, &all_l[from * lb..to * lb]);
            from = to;
        }
    }
    Ok(outcome(
        stats,
        "V4: batch of 8 tokens vs each alone vs chunks of 3",
    ))
}

/// Page copies (or checksums) of 8 pages at once vs one at a time vs chunks of 3.
fn pages<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    checksums: bool,
) -> Result<Outcome, Error> {
    let layout = page_layouts(d)[0];
    let (np, n) = (13usize, BATCH);
    let src_r = region(layout, np, true, 64);
    let dst_r = region(layout, np, false, 0);
    let src = b.upload(&fixtures::garbage(rng, src_r.offset + src_r.stride * np))?;
    let dst0 = fixtures::garbage(rng, dst_r.stride * np);
    let src_ids: Vec<i32> = (0..n).map(|_| rng.gen_range(0..np as i32)).collect();
    let dst_ids: Vec<i32> = (0..n as i32).map(|i| (i * 5 + 3) % np as i32).collect();
    let run = |from: usize, to: usize, dst: &mut B::Buffer| -> Result<Vec<u8>, Error> {
        if checksums {
            let op = PageChecksums {
                region: src_r,
                ids: &src_ids[from..to],
            };
            let mut out = b.upload(&fixtures::poison_f32((to - from) * 2))?;
            b.page_checksums(&op, &src, &mut out)?;
            b.download(&out)
        } else {
            let op = CopyPages {
                src: src_r,
                dst: dst_r,
                src_ids: &src_ids[from..to],
                dst_ids: &dst_ids[from..to],
            };
            b.copy_pages(&op, &src, dst)?;
            Ok(Vec::new())
        }
    };
    let mut all_dst = b.upload(&dst0)?;
    let all = run(0, n, &mut all_dst)?;
    let all_dst = b.download(&all_dst)?;
    let mut stats = ErrorStats::default();
    for step in [1usize, 3] {
        let mut dst = b.upload(&dst0)?;
        let mut from = 0;
        while from < n {
            let to = (from + step).min(n);
            let got = run(from, to, &mut dst)?;
            if checksums {
                bitwise(&mut stats, from * 8, &got, &all[from * 8..to * 8]);
            }
            from = to;
        }
        if !checksums {
            bitwise(&mut stats, 0, &b.download(&dst)?, &all_dst);
        }
    }
    Ok(outcome(
        stats,
        "8 pages at once vs one at a time vs chunks of 3",
    ))
}
