//! Helpers for sparsekit's criterion benches (`benches/ops.rs`): this machine's roofline
//! ([`roofline`]), seeded inputs with caches filled by the backend's own store ops
//! ([`inputs`]), the bytes/FLOPs cost model of each op ([`cost`]) and the summary that
//! reads every result as a fraction of its roofline ([`report`]).

pub mod cost;
pub mod inputs;
pub mod report;
pub mod roofline;

use sparsekit_host::{IndexKDtype, IndexKLayout, KvDtype, KvLayout, ModelDims, Result};

use inputs::{IndexerShape, SparseMlaShape, TopkShape};

/// Problem sizes of one bench run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// The DeepSeek-V3.2 configurations of the benches.
    Full,
    /// Small shapes of the same kinds, for test mode (`cargo test --benches`).
    Smoke,
}

/// Every bench configuration at `scale`.
#[derive(Clone, Debug)]
pub struct Suite {
    pub indexer: Vec<IndexerShape>,
    pub topk: Vec<TopkShape>,
    pub sparse_mla: Vec<SparseMlaShape>,
}

impl Suite {
    /// DSV32 dims: indexer batch 8 × context 65536 (both index-K dtypes, next_n 1); top-k
    /// 64 rows × 65536, k 2048; sparse_mla 8 tokens × 64 heads × top-k 2048 (both KV dtypes)
    /// over a pool of 65536 tokens. [`Scale::Smoke`] shrinks batch and context.
    pub fn new(scale: Scale) -> Result<Suite> {
        let d = ModelDims::DSV32;
        let (batch, context, topk_rows, mla_tokens, mla_topk, pool_tokens) = match scale {
            Scale::Full => (8, 65536, 64, 8, d.index_topk, 65536),
            Scale::Smoke => (2, 4096, 4, 2, 256, 4096),
        };
        let mut indexer = Vec::new();
        for dtype in [IndexKDtype::FP8, IndexKDtype::Bf16] {
            indexer.push(IndexerShape {
                layout: IndexKLayout::new(dtype, d.index_head_dim, d.page_size)?,
                n_heads: d.index_n_heads,
                batch,
                context,
                next_n: 1,
            });
        }
        let topk = vec![TopkShape {
            rows: topk_rows,
            context,
            k: d.index_topk,
            page_size: d.page_size,
        }];
        let mut sparse_mla = Vec::new();
        for dtype in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
            sparse_mla.push(SparseMlaShape {
                layout: KvLayout::new(dtype, d.kv_lora_rank, d.qk_rope_dim, d.page_size)?,
                n_tokens: mla_tokens,
                n_heads: 64,
                topk: mla_topk,
                pool_pages: pool_tokens / d.page_size,
            });
        }
        Ok(Suite {
            indexer,
            topk,
            sparse_mla,
        })
    }
}

/// Bench id of an indexer shape, e.g. `fp8_e4m3/b8_ctx65536_h64_n1`.
pub fn indexer_id(s: &IndexerShape) -> String {
    format!(
        "{}/b{}_ctx{}_h{}_n{}",
        s.layout.dtype().name(),
        s.batch,
        s.context,
        s.n_heads,
        s.next_n
    )
}

/// Bench id of a top-k shape, e.g. `rows64_ctx65536_k2048`.
pub fn topk_id(s: &TopkShape) -> String {
    format!("rows{}_ctx{}_k{}", s.rows, s.context, s.k)
}

/// Bench id of a sparse_mla shape, e.g. `bf16/t8_h64_topk2048`.
pub fn sparse_mla_id(s: &SparseMlaShape) -> String {
    format!(
        "{}/t{}_h{}_topk{}",
        s.layout.dtype().name(),
        s.n_tokens,
        s.n_heads,
        s.topk
    )
}
