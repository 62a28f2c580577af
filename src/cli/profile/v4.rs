//! The DeepSeek-V4 cases of `sparsekit profile`: the MODEL1 and fp4 stores, the indexer
//! over fp4 keys (64 heads × 128, the compressed context), and `sparse_mla_v4` at
//! V4-Flash (64 heads, window 128 at P 256 + compressed 512 at P 64) and V4-Pro (128
//! heads, compressed 1024) decode shapes.

use sparsekit::host::dims::V4Dims;
use sparsekit::host::ops::{IndexKStore, IndexerLogits, KvStore, PageTable, SparseMlaV4, V4Cache};
use sparsekit::host::{Backend, CpuBackend, IndexKDtype, IndexKLayout, KvInput, KvLayout};
use sparsekit::kernels::kernels::sparse_mla_v4_split;
use sparsekit_benches::inputs::{
    bf16_bytes, bf16_values, f32_bytes, f32_values, filled_index_k_cache, filled_kv_cache,
    i32_bytes, rng,
};

use super::{scattered_pages, Case, CliError, Sizes};

/// Appends the V4 cases for the run's sizes.
pub(super) fn cases(s: Sizes, out: &mut Vec<Case>) -> Result<(), CliError> {
    let d = V4Dims::FLASH;
    let (n, pool) = (s.store_tokens, s.pool_pages);
    let model1 = KvLayout::model1_fp8(d.csa_page)?;
    out.push(Case {
        name: "kv_store/model1_fp8".into(),
        op: "kv_store",
        shape: format!("{n} tokens, 448 e4m3 + 64 bf16, P {}", d.csa_page),
        min_blocks: 1,
        run: Box::new(move |emu| {
            let mut r = rng(40);
            let rows = emu.upload(&bf16_bytes(&bf16_values(&mut r, n * 512, 1.0)))?;
            let mut cache = emu.alloc(model1.buffer_bytes(pool))?;
            let slots: Vec<i64> = (0..n as i64)
                .map(|t| (t * 37) % (pool * model1.page_size()) as i64)
                .collect();
            emu.kv_store(
                &KvStore {
                    layout: model1,
                    slots: &slots,
                },
                &rows,
                &mut cache,
            )?;
            Ok(())
        }),
    });
    let fp4 = IndexKLayout::new(IndexKDtype::Fp4E2m1, d.index_head_dim, d.csa_page)?;
    out.push(Case {
        name: "index_k_store/fp4".into(),
        op: "index_k_store",
        shape: format!("{n} tokens, head_dim {}", fp4.head_dim()),
        min_blocks: 1,
        run: Box::new(move |emu| {
            let mut r = rng(41);
            let keys = emu.upload(&bf16_bytes(&bf16_values(&mut r, n * fp4.head_dim(), 1.0)))?;
            let mut cache = emu.alloc(fp4.buffer_bytes(pool))?;
            let slots: Vec<i64> = (0..n as i64)
                .map(|t| (t * 37) % (pool * fp4.page_size()) as i64)
                .collect();
            emu.index_k_store(
                &IndexKStore {
                    layout: fp4,
                    slots: &slots,
                },
                &keys,
                &mut cache,
            )?;
            Ok(())
        }),
    });
    for &batch in s.batches {
        // The compressed context of a CSA layer: a quarter of the raw one.
        let (context, heads) = (s.context / d.csa_ratio, d.index_n_heads);
        out.push(Case {
            name: format!("indexer_logits/fp4/b{batch}"),
            op: "indexer_logits",
            shape: format!("batch {batch} × compressed {context}, next_n 1, {heads} heads"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(42);
                let max_pages = context.div_ceil(fp4.page_size());
                let pool = max_pages.next_power_of_two();
                let cache = filled_index_k_cache(&CpuBackend::new(), &mut r, fp4, pool)?;
                let pages = scattered_pages(batch, max_pages, pool);
                let lens = vec![context as u32; batch];
                let q = emu.upload(&bf16_bytes(&bf16_values(&mut r, batch * heads * 128, 1.0)))?;
                let w = emu.upload(&f32_bytes(&f32_values(&mut r, batch * heads, 0.01)))?;
                let mut logits = emu.alloc(4 * batch * context)?;
                let op = IndexerLogits::decode(
                    fp4,
                    heads,
                    PageTable::new(&pages, max_pages)?,
                    &lens,
                    1,
                    context,
                )?;
                emu.indexer_logits(&op, &q, &w, &cache, &mut logits)?;
                Ok(())
            }),
        });
    }
    for cfg in V4Dims::ALL {
        for &batch in s.batches {
            out.push(attention(cfg, batch)?);
        }
    }
    Ok(())
}

/// `sparse_mla_v4` at a config's decode shape: a window cache (P 256, top-k 128) and a
/// compressed one (P 64, the config's index top-k), every index valid and distinct.
fn attention(cfg: V4Dims, batch: usize) -> Result<Case, CliError> {
    let (h, mk, ek) = (cfg.q_heads, cfg.window, cfg.index_topk);
    let (ml, el) = (
        KvLayout::model1_fp8(cfg.window_page)?,
        KvLayout::model1_fp8(cfg.csa_page)?,
    );
    let total = (mk + ek) as u32;
    let splits = (total.div_ceil(sparse_mla_v4_split(total))) as usize;
    let tag = cfg.name.trim_start_matches("dsv4-");
    Ok(Case {
        name: format!("sparse_mla_v4/{tag}/b{batch}"),
        op: "sparse_mla_v4",
        shape: format!("{batch} tokens × {h} heads, top-k {mk} + {ek} (model1_fp8)"),
        // The last split of a (token, head group) merges all of them: sample a token.
        min_blocks: (h.div_ceil(16) * splits) as u32,
        run: Box::new(move |emu| {
            let mut r = rng(43);
            let pool_of =
                |l: &KvLayout, k: usize| (k.div_ceil(l.page_size()) * 2).next_power_of_two();
            let (mp, ep) = (pool_of(&ml, mk), pool_of(&el, ek));
            let cpu = CpuBackend::new();
            let mc = filled_kv_cache(&cpu, &mut r, ml, mp)?;
            let ec = filled_kv_cache(&cpu, &mut r, el, ep)?;
            let pick = |r: &mut _, cap: usize, k: usize| -> Vec<i32> {
                (0..batch)
                    .flat_map(|_| rand::seq::index::sample(r, cap, k).into_iter())
                    .map(|s| s as i32)
                    .collect()
            };
            let mi = pick(&mut r, mp * ml.page_size(), mk);
            let ei = pick(&mut r, ep * el.page_size(), ek);
            let q = emu.upload(&bf16_bytes(&bf16_values(&mut r, batch * h * 512, 1.0)))?;
            let (mib, eib) = (emu.upload(&i32_bytes(&mi))?, emu.upload(&i32_bytes(&ei))?);
            let mut out = emu.alloc(2 * batch * h * 512)?;
            let mut lse = emu.alloc(4 * batch * h)?;
            let sink = vec![0.5f32; h];
            let op = SparseMlaV4 {
                n_tokens: batch,
                n_heads: h,
                softmax_scale: cfg.softmax_scale(),
                main: V4Cache {
                    layout: ml,
                    topk: mk,
                    lengths: None,
                },
                extra: Some(V4Cache {
                    layout: el,
                    topk: ek,
                    lengths: None,
                }),
                attn_sink: Some(&sink),
            };
            emu.sparse_mla_v4(
                &op,
                &q,
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
            Ok(())
        }),
    })
}
