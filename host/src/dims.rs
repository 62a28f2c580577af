//! Model dimensions the suite, benches and engine are configured with.

use serde::Serialize;

/// The per-layer dimensions of a DSA model that the kernels depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ModelDims {
    /// Short name (`dsv32`, `tiny`).
    pub name: &'static str,
    /// Lightning-indexer query heads.
    pub index_n_heads: usize,
    /// Lightning-indexer head dim (also the index-K dim).
    pub index_head_dim: usize,
    /// Tokens selected per query by the indexer.
    pub index_topk: usize,
    /// MLA latent (NoPE) dim; equals `d_v`.
    pub kv_lora_rank: usize,
    /// MLA rope dim; `d_qk = kv_lora_rank + qk_rope_dim`.
    pub qk_rope_dim: usize,
    /// Tokens per cache page.
    pub page_size: usize,
    /// Attention query-head counts this config is validated with.
    pub q_heads: &'static [usize],
}

impl ModelDims {
    /// DeepSeek-V3.2 per-layer dims.
    pub const DSV32: ModelDims = ModelDims {
        name: "dsv32",
        index_n_heads: 64,
        index_head_dim: 128,
        index_topk: 2048,
        kv_lora_rank: 512,
        qk_rope_dim: 64,
        page_size: 64,
        q_heads: &[16, 32, 64, 128],
    };

    /// The tiny synthetic model: small dims, page 16, top-k 64 so selection matters early.
    /// Two fp8 tiles of 128 in the latent so the per-tile scale logic is exercised.
    pub const TINY: ModelDims = ModelDims {
        name: "tiny",
        index_n_heads: 8,
        index_head_dim: 64,
        index_topk: 64,
        kv_lora_rank: 256,
        qk_rope_dim: 32,
        page_size: 16,
        q_heads: &[16],
    };

    /// All named configs.
    pub const ALL: [ModelDims; 2] = [ModelDims::DSV32, ModelDims::TINY];

    /// `d_qk = kv_lora_rank + qk_rope_dim`.
    pub fn d_qk(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_dim
    }

    /// `d_v = kv_lora_rank`.
    pub fn d_v(&self) -> usize {
        self.kv_lora_rank
    }

    /// Looks a config up by name.
    pub fn by_name(name: &str) -> Option<ModelDims> {
        Self::ALL.into_iter().find(|d| d.name == name)
    }
}
