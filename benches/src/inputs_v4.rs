//! The `sparse_mla_v4` bench: DeepSeek-V4 decode shapes (a window cache and a compressed
//! cache, both `model1_fp8` with their pools' page sizes), every index valid and distinct.

use half::bf16;
use sparsekit_host::dims::V4Dims;
use sparsekit_host::ops::{SparseMlaV4, V4Cache};
use sparsekit_host::{Backend, KvInput, KvLayout, Result};

use crate::cost::Cost;
use crate::inputs::{bf16_bytes, bf16_values, f32_bytes, filled_kv_cache, i32_bytes, rng};

/// Shape of a `sparse_mla_v4` bench.
#[derive(Clone, Copy, Debug)]
pub struct SparseMlaV4Shape {
    /// The config's name (`dsv4-flash`, `dsv4-pro`).
    pub config: &'static str,
    pub n_tokens: usize,
    pub n_heads: usize,
    /// Window cache (main) and compressed cache (extra): layout and top-k.
    pub main: (KvLayout, usize),
    pub extra: (KvLayout, usize),
}

impl SparseMlaV4Shape {
    /// A config's decode shape for `n_tokens` tokens (model1_fp8 window at its pool's
    /// page size, compressed top-k at the ratio-4 pool's).
    pub fn decode(cfg: V4Dims, n_tokens: usize) -> Result<Self> {
        Ok(SparseMlaV4Shape {
            config: cfg.name,
            n_tokens,
            n_heads: cfg.q_heads,
            main: (KvLayout::model1_fp8(cfg.window_page)?, cfg.window),
            extra: (KvLayout::model1_fp8(cfg.csa_page)?, cfg.index_topk),
        })
    }

    /// Bytes moved (each selected row and its scales once, indices, q, out, lse) and tensor
    /// FLOPs (`2 · heads · 512` per key for the scores and as much for `P·V`).
    pub fn cost(&self) -> Cost {
        let (t, h) = (self.n_tokens as u64, self.n_heads as u64);
        let keys = |c: &(KvLayout, usize)| c.1 as u64;
        let rows = t
            * (keys(&self.main) * self.main.0.bytes_per_token() as u64
                + keys(&self.extra) * self.extra.0.bytes_per_token() as u64);
        let idx = t * (keys(&self.main) + keys(&self.extra)) * 4;
        let io = t * h * 512 * 2 * 2 + t * h * 4;
        Cost {
            bytes: rows + idx + io,
            flops: t * (keys(&self.main) + keys(&self.extra)) * 2 * h * 512 * 2,
            bf16_dot: true,
            tiles: false,
        }
    }

    /// Bench id, e.g. `dsv4-flash/t8_h64_topk128+512`.
    pub fn id(&self) -> String {
        format!(
            "{}/t{}_h{}_topk{}+{}",
            self.config, self.n_tokens, self.n_heads, self.main.1, self.extra.1
        )
    }
}

/// A ready-to-run `sparse_mla_v4` call over pools twice the top-k, fully written.
#[derive(Debug)]
pub struct SparseMlaV4Case<B: Backend> {
    pub shape: SparseMlaV4Shape,
    pub sink: Vec<f32>,
    pub q: B::Buffer,
    pub caches: [B::Buffer; 2],
    pub indices: [B::Buffer; 2],
    pub out: B::Buffer,
    pub lse: B::Buffer,
}

impl<B: Backend> SparseMlaV4Case<B> {
    pub fn build(backend: &B, shape: SparseMlaV4Shape, seed: u64) -> Result<Self> {
        let mut rng = rng(seed);
        let (t, h) = (shape.n_tokens, shape.n_heads);
        let mut cache_of = |(l, k): (KvLayout, usize)| -> Result<(B::Buffer, B::Buffer)> {
            let pages = (2 * k).div_ceil(l.page_size());
            let cache = filled_kv_cache(backend, &mut rng, l, pages)?;
            let cap = pages * l.page_size();
            let mut idx = Vec::with_capacity(t * k);
            for _ in 0..t {
                let picked = rand::seq::index::sample(&mut rng, cap, k);
                idx.extend(picked.into_iter().map(|s| s as i32));
            }
            Ok((cache, backend.upload(&i32_bytes(&idx))?))
        };
        let (mc, mi) = cache_of(shape.main)?;
        let (ec, ei) = cache_of(shape.extra)?;
        let q = backend.upload(&bf16_bytes(&bf16_values(&mut rng, t * h * 512, 1.0)))?;
        let out = backend.upload(&bf16_bytes(&vec![bf16::NAN; t * h * 512]))?;
        let lse = backend.upload(&f32_bytes(&vec![f32::NAN; t * h]))?;
        Ok(SparseMlaV4Case {
            shape,
            sink: vec![0.25; h],
            q,
            caches: [mc, ec],
            indices: [mi, ei],
            out,
            lse,
        })
    }

    pub fn run(&mut self, backend: &B) -> Result<()> {
        let s = self.shape;
        let op = SparseMlaV4 {
            n_tokens: s.n_tokens,
            n_heads: s.n_heads,
            softmax_scale: 1.0 / (SparseMlaV4::D as f32).sqrt(),
            main: V4Cache {
                layout: s.main.0,
                topk: s.main.1,
                lengths: None,
            },
            extra: Some(V4Cache {
                layout: s.extra.0,
                topk: s.extra.1,
                lengths: None,
            }),
            attn_sink: Some(&self.sink),
        };
        backend.sparse_mla_v4(
            &op,
            &self.q,
            KvInput {
                cache: &self.caches[0],
                indices: &self.indices[0],
            },
            Some(KvInput {
                cache: &self.caches[1],
                indices: &self.indices[1],
            }),
            &mut self.out,
            &mut self.lse,
        )
    }
}
