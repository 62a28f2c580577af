//! Model configurations of the synthetic DSA decoder.
//!
//! The attention dims (indexer heads and head dim, latent KV rank, rope dim, page size)
//! come from [`ModelDims`], the project's single source for them; the rest (hidden size,
//! layers, MLP width, q-projection rank) is sized here per config.

use serde::Serialize;
use sparsekit_host::{ModelDims, V4Dims};

use crate::engine::tokenizer::VOCAB_SIZE;
use crate::error::EngineError;

/// DeepSeek-V4's attention in a [`ModelConfig`] (absent: DeepSeek-V3.2's MLA).
///
/// Layer `l` is window-only for `l < window_layers`; after them CSA (ratio
/// `dims.csa_ratio`) and HCA (ratio `dims.hca_ratio`) layers alternate, CSA first — V4's
/// order. Every layer attends its last `dims.window` raw tokens (the window pool, pages of
/// `dims.window_page` tokens); a CSA layer also attends the `index_topk` compressed entries
/// its indexer selects, an HCA layer every compressed entry it may see.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct V4Attention {
    pub dims: V4Dims,
    /// Leading window-only layers (V4-Flash: 2).
    pub window_layers: usize,
}

impl V4Attention {
    /// Compression ratio of layer `l`: 0 (window only), `csa_ratio` or `hca_ratio`.
    pub fn ratio(&self, l: usize) -> usize {
        if l < self.window_layers {
            0
        } else if (l - self.window_layers) % 2 == 0 {
            self.dims.csa_ratio
        } else {
            self.dims.hca_ratio
        }
    }

    /// Ratios of layers `0..n`.
    pub fn ratios(&self, n: usize) -> Vec<usize> {
        (0..n).map(|l| self.ratio(l)).collect()
    }

    /// Raw tokens in compression window of an entry: CSA windows overlap by half
    /// (`2 · ratio`), HCA windows do not (`ratio`).
    pub fn span(&self, ratio: usize) -> usize {
        if ratio == self.dims.csa_ratio {
            2 * ratio
        } else {
            ratio
        }
    }
}

/// The attention of [`ModelConfig::DSV4_TINY`]: V4's structure at CPU sizes (a window of
/// 16 over pages of 16 tokens, CSA ratio 4 with 4-entry pages, an HCA ratio of 8 with
/// 2-entry pages, top-k 8 so selection matters early, 8 heads).
const V4_TINY_DIMS: V4Dims = V4Dims {
    name: "dsv4-tiny",
    q_heads: 8,
    index_n_heads: 4,
    index_head_dim: 128,
    index_topk: 8,
    window: 16,
    window_page: 16,
    csa_page: 4,
    hca_page: 2,
    csa_ratio: 4,
    hca_ratio: 8,
};

/// The kernel-facing dims of a V4 config as [`ModelDims`] (the 512-d K = V row as 448
/// NoPE + 64 rope, the window pool's page size).
const fn v4_model_dims(v: V4Dims, q_heads: &'static [usize]) -> ModelDims {
    ModelDims {
        name: v.name,
        index_n_heads: v.index_n_heads,
        index_head_dim: v.index_head_dim,
        index_topk: v.index_topk,
        kv_lora_rank: V4Dims::D - 64,
        qk_rope_dim: 64,
        page_size: v.window_page,
        q_heads,
    }
}

/// Every shape of the synthetic model. A config name plus a seed determine every weight.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ModelConfig {
    /// `tiny`, `dsv32`, `dsv4-tiny` or `dsv4`.
    pub name: &'static str,
    /// Attention dims shared with the kernels (index-K, KV, page size).
    pub dims: ModelDims,
    /// Decoder layers.
    pub n_layers: usize,
    /// Residual stream width.
    pub hidden: usize,
    /// Rank of the query down-projection (`q_lora_rank`).
    pub q_lora_rank: usize,
    /// Attention query heads (`h_q` of sparse MLA).
    pub n_heads: usize,
    /// Per-head NoPE query dim before absorption into the latent (`qk_nope_head_dim`).
    pub qk_nope_head_dim: usize,
    /// Per-head value dim after the latent up-projection (`v_head_dim`).
    pub v_head_dim: usize,
    /// SwiGLU hidden width.
    pub intermediate: usize,
    /// Tokens the indexer selects per query (a config value: 2048 for V3.2, 512 for
    /// later models, 64 for `tiny`).
    pub index_topk: usize,
    /// Longest sequence (prompt + generated) in tokens; the rope tables cover it.
    pub max_context: usize,
    /// Rope base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// DeepSeek-V4's attention (window, compressed pools, sink); `None` for V3.2's.
    pub v4: Option<V4Attention>,
}

impl ModelConfig {
    /// The CPU default: [`ModelDims::TINY`] attention (16 query heads, 8×64 indexer,
    /// latent 256 + rope 32, pages of 16, top-k 64 so selection matters early), hidden 128,
    /// 2 layers. Sized so the integrity harness's defaults run in minutes on 2 cores: the
    /// per-token cost is dominated by the indexer (`O(context)`), see `benches`/README.
    pub const TINY: ModelConfig = ModelConfig {
        name: "tiny",
        dims: ModelDims::TINY,
        n_layers: 2,
        hidden: 128,
        q_lora_rank: 64,
        n_heads: 16,
        qk_nope_head_dim: 32,
        v_head_dim: 32,
        intermediate: 256,
        index_topk: ModelDims::TINY.index_topk,
        max_context: 8192,
        rope_theta: 10000.0,
        norm_eps: 1e-6,
        v4: None,
    };

    /// DeepSeek-V3.2 per-layer dims (hidden 7168, q rank 1536, 128 heads of 128 + 64 rope,
    /// latent 512, indexer 64×128 with top-k 2048, pages of 64), a dense SwiGLU the width
    /// of one routed expert (2048) in place of the MoE, and 2 layers: for GPU runs.
    pub const DSV32: ModelConfig = ModelConfig {
        name: "dsv32",
        dims: ModelDims::DSV32,
        n_layers: 2,
        hidden: 7168,
        q_lora_rank: 1536,
        n_heads: 128,
        qk_nope_head_dim: 128,
        v_head_dim: 128,
        intermediate: 2048,
        index_topk: ModelDims::DSV32.index_topk,
        max_context: 32768,
        rope_theta: 10000.0,
        norm_eps: 1e-6,
        v4: None,
    };

    /// DeepSeek-V4's structure at CPU sizes: 3 layers (window, CSA, HCA), hidden 128,
    /// 8 heads of 512 (448 NoPE + 64 rope, K = V), indexer 4×128 (fp4 index keys need
    /// 128) with top-k 8, window 16,
    /// pages of 16 raw tokens (CSA entries 4 a page, HCA entries 2).
    pub const DSV4_TINY: ModelConfig = ModelConfig {
        name: "dsv4-tiny",
        dims: v4_model_dims(V4_TINY_DIMS, &[8]),
        n_layers: 3,
        hidden: 128,
        q_lora_rank: 64,
        n_heads: 8,
        qk_nope_head_dim: V4Dims::D - 64,
        v_head_dim: V4Dims::D,
        intermediate: 256,
        index_topk: V4_TINY_DIMS.index_topk,
        max_context: 8192,
        rope_theta: 10000.0,
        norm_eps: 1e-6,
        v4: Some(V4Attention {
            dims: V4_TINY_DIMS,
            window_layers: 1,
        }),
    };

    /// DeepSeek-V4-Flash's attention dims (hidden 4096, q rank 1024, 64 heads of 512,
    /// indexer 64×128 with top-k 512, window 128, pages of 256 raw tokens: CSA 64 entries,
    /// HCA 2), a dense SwiGLU of 2048 in place of the MoE, and 4 layers in V4's order
    /// (window, window, CSA, HCA): for GPU runs.
    pub const DSV4: ModelConfig = ModelConfig {
        name: "dsv4",
        dims: v4_model_dims(V4Dims::FLASH, &[64]),
        n_layers: 4,
        hidden: 4096,
        q_lora_rank: 1024,
        n_heads: 64,
        qk_nope_head_dim: V4Dims::D - 64,
        v_head_dim: V4Dims::D,
        intermediate: 2048,
        index_topk: V4Dims::FLASH.index_topk,
        max_context: 32768,
        rope_theta: 10000.0,
        norm_eps: 1e-6,
        v4: Some(V4Attention {
            dims: V4Dims::FLASH,
            window_layers: 2,
        }),
    };

    /// Every named config.
    pub const ALL: [ModelConfig; 4] = [
        ModelConfig::TINY,
        ModelConfig::DSV32,
        ModelConfig::DSV4_TINY,
        ModelConfig::DSV4,
    ];

    /// Looks a config up by name.
    pub fn by_name(name: &str) -> Result<ModelConfig, EngineError> {
        Self::ALL
            .into_iter()
            .find(|c| c.name == name)
            .ok_or_else(|| EngineError::UnknownModel(name.to_string()))
    }

    /// The same config with another indexer top-k.
    pub fn with_index_topk(self, k: usize) -> Result<ModelConfig, EngineError> {
        if k == 0 {
            return Err(EngineError::InvalidConfig(
                "index_topk must be positive".into(),
            ));
        }
        Ok(ModelConfig {
            index_topk: k,
            v4: self.v4.map(|v| V4Attention {
                dims: V4Dims {
                    index_topk: k,
                    ..v.dims
                },
                ..v
            }),
            ..self
        })
    }

    /// The same config with another layer count.
    pub fn with_layers(self, n: usize) -> Result<ModelConfig, EngineError> {
        if n == 0 {
            return Err(EngineError::InvalidConfig(
                "n_layers must be positive".into(),
            ));
        }
        Ok(ModelConfig {
            n_layers: n,
            ..self
        })
    }

    /// Values of a V4 compressor state row (bf16, one per raw token in the compressed
    /// layers): the KV compressor's values and gate logits (`2 · 512`), then the index-key
    /// compressor's (`2 · index_head_dim`; unused in HCA layers). 0 for V3.2.
    pub fn v4_state_width(&self) -> usize {
        match self.v4 {
            Some(_) => 2 * V4Dims::D + 2 * self.index_head_dim(),
            None => 0,
        }
    }

    /// Vocabulary size (bytes + special tokens).
    pub fn vocab(&self) -> usize {
        VOCAB_SIZE
    }

    /// Latent KV rank (`kv_lora_rank`, = sparse MLA's `d_v`).
    pub fn kv_lora_rank(&self) -> usize {
        self.dims.kv_lora_rank
    }

    /// Rope dim of the attention keys/queries (also the indexer's rope dim).
    pub fn rope_dim(&self) -> usize {
        self.dims.qk_rope_dim
    }

    /// Width of one cached KV token: `kv_lora_rank + rope_dim`.
    pub fn d_qk(&self) -> usize {
        self.dims.d_qk()
    }

    /// Per-head query width out of the up-projection: NoPE part then rope part.
    pub fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.rope_dim()
    }

    /// Indexer query heads.
    pub fn index_heads(&self) -> usize {
        self.dims.index_n_heads
    }

    /// Indexer head dim (= index key width).
    pub fn index_head_dim(&self) -> usize {
        self.dims.index_head_dim
    }

    /// Tokens per cache page.
    pub fn page_size(&self) -> usize {
        self.dims.page_size
    }

    /// Sparse MLA softmax scale, `(qk_nope_head_dim + rope_dim)^-1/2` as in DeepSeek's MLA
    /// (V4: `512^-1/2`).
    pub fn softmax_scale(&self) -> f32 {
        (1.0 / (self.q_head_dim() as f64).sqrt()) as f32
    }

    /// Checks the shapes fit together and the kernels' constraints.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::InvalidConfig(m));
        if self.n_layers == 0 || self.hidden == 0 || self.q_lora_rank == 0 {
            return bad("layers, hidden and q_lora_rank must be positive".into());
        }
        if self.n_heads == 0 || self.intermediate == 0 || self.v_head_dim == 0 {
            return bad("heads, intermediate and v_head_dim must be positive".into());
        }
        if self.rope_dim() % 2 != 0 || self.rope_dim() > self.index_head_dim() {
            return bad(format!(
                "rope dim {} must be even and fit the indexer head dim {}",
                self.rope_dim(),
                self.index_head_dim()
            ));
        }
        if self.index_topk == 0 || self.max_context == 0 {
            return bad("index_topk and max_context must be positive".into());
        }
        if self.max_context > i32::MAX as usize / 2 {
            return bad("max_context too large for i32 slots".into());
        }
        if let Some(v) = &self.v4 {
            let d = &v.dims;
            if self.d_qk() != V4Dims::D || self.rope_dim() != 64 {
                return bad(format!(
                    "a V4 row is 448 NoPE + 64 rope, not {} + {}",
                    self.kv_lora_rank(),
                    self.rope_dim()
                ));
            }
            if self.n_heads > sparsekit_host::ops::V4_MAX_HEADS {
                return bad(format!(
                    "{} heads: V4 attention takes at most {}",
                    self.n_heads,
                    sparsekit_host::ops::V4_MAX_HEADS
                ));
            }
            if d.window == 0 || d.csa_ratio != 4 || d.hca_ratio <= d.csa_ratio {
                return bad(format!(
                    "V4 window {} and ratios {}/{}: a positive window, CSA ratio 4, a larger \
                     HCA ratio",
                    d.window, d.csa_ratio, d.hca_ratio
                ));
            }
            if d.window_page != self.page_size()
                || d.csa_page * d.csa_ratio != d.window_page
                || d.hca_page * d.hca_ratio != d.window_page
            {
                return bad(format!(
                    "V4 pages: {} raw tokens a page must hold {} CSA entries of {} and {} HCA \
                     entries of {}",
                    d.window_page, d.csa_page, d.csa_ratio, d.hca_page, d.hca_ratio
                ));
            }
            if d.index_topk != self.index_topk || d.index_head_dim < self.rope_dim() {
                return bad("V4 indexer dims disagree with the config".into());
            }
        }
        Ok(())
    }

    /// Parameters in all weights (for sizing and reports).
    pub fn parameters(&self) -> usize {
        let (d, r, h) = (self.hidden, self.q_lora_rank, self.n_heads);
        if let Some(v) = &self.v4 {
            let (row, ih, id) = (V4Dims::D, self.index_heads(), self.index_head_dim());
            let state = self.v4_state_width();
            let mlp = d + d * 2 * self.intermediate + self.intermediate * d;
            let attn = d + d * r + r + r * h * row + row + d * row + (row - 64) + h + h * row * d;
            let per_layer = |l: usize| match v.ratio(l) {
                0 => attn + mlp,
                ratio => {
                    let span = v.span(ratio);
                    let comp = d * state + span * row + (row - 64);
                    let index = if ratio == v.dims.csa_ratio {
                        span * id + id + r * ih * id + d * ih
                    } else {
                        0
                    };
                    attn + mlp + comp + index
                }
            };
            return (0..self.n_layers).map(per_layer).sum::<usize>() + 2 * self.vocab() * d + d;
        }
        let per_layer = 2 * d
            + d * r
            + r
            + r * h * self.q_head_dim()
            + h * self.qk_nope_head_dim * self.kv_lora_rank()
            + d * self.d_qk()
            + self.kv_lora_rank()
            + r * self.index_heads() * self.index_head_dim()
            + d * self.index_head_dim()
            + self.index_head_dim()
            + d * self.index_heads()
            + h * self.kv_lora_rank() * self.v_head_dim
            + h * self.v_head_dim * d
            + d * 2 * self.intermediate
            + self.intermediate * d;
        self.n_layers * per_layer + 2 * self.vocab() * d + d
    }
}
