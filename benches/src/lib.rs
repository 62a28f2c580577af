//! Helpers for sparsekit's criterion benches (`benches/ops.rs`): this machine's roofline
//! ([`roofline`]), seeded inputs with caches filled by the backend's own store ops
//! ([`inputs`]), the bytes/FLOPs cost model of each op ([`cost`]) and the summary that
//! reads every result as a fraction of its roofline ([`report`]).

pub mod cost;
pub mod dense;
pub mod inputs;
pub mod inputs_v4;
pub mod pages;
pub mod paths;
pub mod report;
pub mod roofline;
pub mod runner;

use sparsekit_host::{IndexKDtype, IndexKLayout, KvDtype, KvLayout, ModelDims, Result};

use dense::MatmulShape;
use inputs::{IndexerLogitsShape, SparseMlaShape, TopkShape};
use inputs_v4::SparseMlaV4Shape;
use pages::{ChecksumShape, CopyShape, Direction, StoreShape};
use sparsekit_host::dims::V4Dims;
use sparsekit_host::layout::PageLayout;

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
    pub indexer_logits: Vec<IndexerLogitsShape>,
    pub topk: Vec<TopkShape>,
    pub sparse_mla: Vec<SparseMlaShape>,
    pub sparse_mla_v4: Vec<SparseMlaV4Shape>,
    pub stores: Vec<StoreShape>,
    pub copies: Vec<CopyShape>,
    pub checksums: Vec<ChecksumShape>,
    pub matmuls: Vec<MatmulShape>,
}

impl Suite {
    /// DSV32 dims: indexer batch 8 × context 65536 (both index-K dtypes, next_n 1); top-k
    /// 64 rows × 65536, k 2048; sparse_mla 8 tokens × 64 heads × top-k 2048 (both KV dtypes)
    /// over a pool of 65536 tokens. Then the serving engine's tiny model
    /// ([`ModelDims::TINY`]) at the shapes of its forward bench: an indexer decode step of
    /// 32 requests at context 2048 and a prefill chunk of 256 rows at the end of a 2048
    /// context (the decode form with `next_n = 256` gives exactly a chunk's causal rows),
    /// fp8 index keys; sparse_mla (16 heads, top-k 64, bf16 KV) for 32 and 256 tokens.
    /// DeepSeek-V4 ([`V4Dims`]): the indexer over fp4 keys (64 heads × 128, batch 8 × a
    /// compressed context of 16384, page 64), `sparse_mla_v4` decode at batch 8 for
    /// V4-Flash (64 heads, top-k 128 + 512) and V4-Pro (128 heads, 128 + 1024), and
    /// V4-Flash's 8 heads a rank of tensor parallelism 8 at batch 32 (few heads: the
    /// attention's keys-along route on cores with full-width 512-bit FMAs), the model1_fp8
    /// and fp4 stores. [`Scale::Smoke`] shrinks batch and context.
    pub fn new(scale: Scale) -> Result<Suite> {
        let d = ModelDims::DSV32;
        let (batch, context, topk_rows, mla_tokens, mla_topk, pool_tokens) = match scale {
            Scale::Full => (8, 65536, 64, 8, d.index_topk, 65536),
            Scale::Smoke => (2, 4096, 4, 2, 256, 4096),
        };
        let mut indexer_logits = Vec::new();
        for dtype in [IndexKDtype::FP8, IndexKDtype::Bf16] {
            indexer_logits.push(IndexerLogitsShape {
                layout: IndexKLayout::new(dtype, d.index_head_dim, d.page_size)?,
                n_heads: d.index_n_heads,
                batch,
                context,
                next_n: 1,
            });
        }
        let v4 = V4Dims::FLASH;
        indexer_logits.push(IndexerLogitsShape {
            layout: IndexKLayout::new(IndexKDtype::Fp4E2m1, v4.index_head_dim, v4.csa_page)?,
            n_heads: v4.index_n_heads,
            batch,
            context: context / v4.csa_ratio,
            next_n: 1,
        });
        let v4_tokens = match scale {
            Scale::Full => 8,
            Scale::Smoke => 1,
        };
        let mut sparse_mla_v4 = V4Dims::ALL
            .into_iter()
            .map(|cfg| SparseMlaV4Shape::decode(cfg, v4_tokens))
            .collect::<Result<Vec<_>>>()?;
        let flash = V4Dims::FLASH;
        sparse_mla_v4.push(SparseMlaV4Shape {
            n_heads: flash.q_heads / 8,
            ..SparseMlaV4Shape::decode(flash, 4 * v4_tokens)?
        });
        let t = ModelDims::TINY;
        let (tiny_batch, tiny_ctx, tiny_chunk) = match scale {
            Scale::Full => (32, 2048, 256),
            Scale::Smoke => (4, 256, 32),
        };
        let tiny_ik = IndexKLayout::new(IndexKDtype::FP8, t.index_head_dim, t.page_size)?;
        for (batch, next_n) in [(tiny_batch, 1), (1, tiny_chunk)] {
            indexer_logits.push(IndexerLogitsShape {
                layout: tiny_ik,
                n_heads: t.index_n_heads,
                batch,
                context: tiny_ctx,
                next_n,
            });
        }
        let topk = vec![
            TopkShape {
                rows: topk_rows,
                context,
                k: d.index_topk,
                page_size: d.page_size,
            },
            // The serving model's decode: one row a sequence over its context.
            TopkShape {
                rows: tiny_batch,
                context: tiny_ctx,
                k: t.index_topk,
                page_size: t.page_size,
            },
        ];
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
        let tiny_kv = KvLayout::new(KvDtype::Bf16, t.kv_lora_rank, t.qk_rope_dim, t.page_size)?;
        for n_tokens in [tiny_batch, tiny_chunk] {
            sparse_mla.push(SparseMlaShape {
                layout: tiny_kv,
                n_tokens,
                n_heads: t.q_heads[0],
                topk: t.index_topk,
                pool_pages: tiny_batch * tiny_ctx / t.page_size,
            });
        }
        // Cache ops of one layer: a prefill chunk of new tokens, and host⇄device moves of
        // 2048 pages (131072 tokens) of bf16 KV and of fp8 index-K.
        let (tokens, pages) = match scale {
            Scale::Full => (8192, 2048),
            Scale::Smoke => (256, 16),
        };
        let ik = IndexKLayout::new(IndexKDtype::FP8, d.index_head_dim, d.page_size)?;
        let kv = KvLayout::new(KvDtype::Bf16, d.kv_lora_rank, d.qk_rope_dim, d.page_size)?;
        let kv8 = KvLayout::new(
            KvDtype::Fp8DsMla,
            d.kv_lora_rank,
            d.qk_rope_dim,
            d.page_size,
        )?;
        let stores = vec![
            StoreShape::IndexK { layout: ik, tokens },
            StoreShape::Kv { layout: kv, tokens },
            StoreShape::Kv {
                layout: kv8,
                tokens,
            },
            StoreShape::IndexK {
                layout: IndexKLayout::new(IndexKDtype::Fp4E2m1, v4.index_head_dim, v4.csa_page)?,
                tokens,
            },
            StoreShape::Kv {
                layout: KvLayout::model1_fp8(v4.csa_page)?,
                tokens,
            },
        ];
        let mut copies = Vec::new();
        for direction in [
            Direction::HostToDevice,
            Direction::DeviceToHost,
            Direction::DeviceToDevice,
        ] {
            for layout in [PageLayout::Kv(kv), PageLayout::IndexK(ik)] {
                copies.push(CopyShape {
                    layout,
                    pages,
                    direction,
                });
            }
        }
        let checksums = vec![
            ChecksumShape {
                layout: PageLayout::Kv(kv),
                pages,
            },
            ChecksumShape {
                layout: PageLayout::IndexK(ik),
                pages,
            },
        ];
        // The serving model's dense matmul at V4-Flash's q projection (hidden 4096 → q
        // rank 1024): a decode step of 8 rows (memory-bound) and a prefill chunk of 256
        // rows (compute-bound); DeepSeek-V3.2's (7168 → 1536) for 64 rows.
        let matmuls = match scale {
            Scale::Full => vec![
                MatmulShape {
                    rows: 8,
                    k: 4096,
                    n: 1024,
                },
                MatmulShape {
                    rows: 256,
                    k: 4096,
                    n: 1024,
                },
                MatmulShape {
                    rows: 64,
                    k: 7168,
                    n: 1536,
                },
            ],
            Scale::Smoke => vec![
                MatmulShape {
                    rows: 3,
                    k: 96,
                    n: 160,
                },
                MatmulShape {
                    rows: 50,
                    k: 70,
                    n: 96,
                },
            ],
        };
        Ok(Suite {
            indexer_logits,
            topk,
            sparse_mla,
            sparse_mla_v4,
            stores,
            copies,
            checksums,
            matmuls,
        })
    }
}

impl Suite {
    /// The op names [`Suite::retain_ops`] knows.
    pub const OPS: [&'static str; 9] = [
        "indexer_logits",
        "topk",
        "sparse_mla",
        "sparse_mla_v4",
        "index_k_store",
        "kv_store",
        "copy_pages",
        "page_checksums",
        "dense_matmul",
    ];

    /// Keeps only the cases of the named ops (every case when `ops` is empty).
    pub fn retain_ops(&mut self, ops: &[&str]) {
        if ops.is_empty() {
            return;
        }
        let want = |name: &str| ops.contains(&name);
        if !want("indexer_logits") {
            self.indexer_logits.clear();
        }
        if !want("topk") {
            self.topk.clear();
        }
        if !want("sparse_mla") {
            self.sparse_mla.clear();
        }
        if !want("sparse_mla_v4") {
            self.sparse_mla_v4.clear();
        }
        if !want("copy_pages") {
            self.copies.clear();
        }
        if !want("page_checksums") {
            self.checksums.clear();
        }
        if !want("dense_matmul") {
            self.matmuls.clear();
        }
        self.stores.retain(|s| {
            want(match s {
                StoreShape::IndexK { .. } => "index_k_store",
                StoreShape::Kv { .. } => "kv_store",
            })
        });
    }
}

/// Bench id of an indexer shape, e.g. `fp8_e4m3/b8_ctx65536_h64_n1` (`d64` added when the
/// head dim is not DeepSeek-V3.2's 128).
pub fn indexer_logits_id(s: &IndexerLogitsShape) -> String {
    let d = match s.layout.head_dim() {
        128 => String::new(),
        d => format!("_d{d}"),
    };
    format!(
        "{}/b{}_ctx{}_h{}{d}_n{}",
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

/// Bench id of a sparse_mla shape, e.g. `bf16/t8_h64_topk2048` (`dqk288` added when
/// `d_qk` is not DeepSeek-V3.2's 576).
pub fn sparse_mla_id(s: &SparseMlaShape) -> String {
    let d = match s.layout.d_qk() {
        576 => String::new(),
        d => format!("_dqk{d}"),
    };
    format!(
        "{}/t{}_h{}{d}_topk{}",
        s.layout.dtype().name(),
        s.n_tokens,
        s.n_heads,
        s.topk
    )
}
