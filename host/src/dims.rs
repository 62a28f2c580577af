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

/// The per-layer dimensions of DeepSeek-V4 attention that the kernels depend on (DSV4.md:
/// HF `DeepseekV4Config`, FlashMLA's tests, SGLang's V4 memory pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct V4Dims {
    /// Short name (`dsv4-flash`, `dsv4-pro`).
    pub name: &'static str,
    /// Attention query heads.
    pub q_heads: usize,
    /// Lightning-indexer heads and head dim (as V3.2).
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    /// Compressed entries the indexer selects per query (CSA layers): the extra cache's
    /// top-k.
    pub index_topk: usize,
    /// Sliding-window tokens per query: the main cache's top-k.
    pub window: usize,
    /// Page sizes of the window pool (256 raw tokens), the ratio-4 (CSA) pools and the
    /// ratio-128 (HCA) pool: one page table of 256 raw tokens for all.
    pub window_page: usize,
    pub csa_page: usize,
    pub hca_page: usize,
    /// Compression ratios of CSA and HCA layers.
    pub csa_ratio: usize,
    pub hca_ratio: usize,
}

impl V4Dims {
    /// DeepSeek-V4-Flash: 64 heads, index top-k 512.
    pub const FLASH: V4Dims = V4Dims {
        name: "dsv4-flash",
        q_heads: 64,
        index_n_heads: 64,
        index_head_dim: 128,
        index_topk: 512,
        window: 128,
        window_page: 256,
        csa_page: 64,
        hca_page: 2,
        csa_ratio: 4,
        hca_ratio: 128,
    };

    /// DeepSeek-V4-Pro (secondary sources): 128 heads, index top-k 1024.
    pub const PRO: V4Dims = V4Dims {
        name: "dsv4-pro",
        q_heads: 128,
        index_topk: 1024,
        ..V4Dims::FLASH
    };

    /// Both configs.
    pub const ALL: [V4Dims; 2] = [V4Dims::FLASH, V4Dims::PRO];

    /// The 512-d K = V row (448 NoPE + 64 rope).
    pub const D: usize = 512;

    /// Softmax scale `512^-0.5`.
    pub fn softmax_scale(&self) -> f32 {
        1.0 / (Self::D as f32).sqrt()
    }

    /// Looks a config up by name.
    pub fn by_name(name: &str) -> Option<V4Dims> {
        Self::ALL.into_iter().find(|d| d.name == name)
    }
}
