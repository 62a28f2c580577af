//! Model configurations of the synthetic DSA decoder.
//!
//! The attention dims (indexer heads and head dim, latent KV rank, rope dim, page size)
//! come from [`ModelDims`], the project's single source for them; the rest (hidden size,
//! layers, MLP width, q-projection rank) is sized here per config.

use serde::Serialize;
use sparsekit_host::ModelDims;

use crate::engine::tokenizer::VOCAB_SIZE;
use crate::error::EngineError;

/// Every shape of the synthetic model. A config name plus a seed determine every weight.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ModelConfig {
    /// `tiny` or `dsv32`.
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
    };

    /// Every named config.
    pub const ALL: [ModelConfig; 2] = [ModelConfig::TINY, ModelConfig::DSV32];

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

    /// Sparse MLA softmax scale, `(qk_nope_head_dim + rope_dim)^-1/2` as in DeepSeek's MLA.
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
        Ok(())
    }

    /// Parameters in all weights (for sizing and reports).
    pub fn parameters(&self) -> usize {
        let (d, r, h) = (self.hidden, self.q_lora_rank, self.n_heads);
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
