//! The synthetic DSA decoder's forward pass, on any backend with the DSA ops
//! ([`Backend`]) and the dense ops ([`ModelOps`]).
//!
//! One layer, for the rows of a [`StepBatch`] (decode tokens and prefill chunks mixed):
//!
//! 1. `x = rms_norm(h)`; query latent `qa = rms_norm(x·Wq_a)`; per head
//!    `[q_nope | q_rope] = qa·Wq_b`; the absorbed query is `[q_nope·W_uk | rope(q_rope)]`
//!    (`d_qk` = latent + rope per head), cast to bf16.
//! 2. Latent KV `[rms_norm(c) | rope(k_rope)] = x·Wkv_a` → bf16 → `kv_store`.
//! 3. Indexer: queries `rope(qa·Wq_idx)` (rope on the first `rope_dim` dims of each head),
//!    key `rope(rms_norm(x·Wk_idx))` → bf16 → `index_k_store`; head weights `x·W_heads`.
//! 4. `indexer_logits` over each row's causal range, exact `topk` → cache slots,
//!    `sparse_mla` over the selected slots.
//! 5. Per head `o·W_uv`, then `h += (·)·Wo` (residual fused into the projection).
//! 6. `h += swiglu(rms_norm(h)·W_gate_up)·W_down`.
//!
//! The final norm and the LM head run only on the rows that need logits.
//!
//! Every op is batch-invariant and stores happen before any read of the layer, so a
//! token's KV, index key and logits are bit-identical alone, in any batch, in a prefill
//! chunk of any size or a decode step (the determinism oracle of SERVING.md).

use std::sync::Arc;

use sparsekit_host::cache::CacheSpec;
use sparsekit_host::model_ops::{
    Accumulate, Argmax, Cast, DenseDtype, Embed, GatherRows, Matmul, ModelOps, RmsNorm, Rope, View,
};
use sparsekit_host::ops::{IndexerLogits, PageTable, SparseMla, Topk, TopkOutput};
use sparsekit_host::{Backend, IndexKDtype, IndexKLayout, KernelAudit, KvDtype, KvLayout};

use crate::engine::batch::StepBatch;
use crate::engine::config::ModelConfig;
use crate::engine::kernel_check::{AuditedOp, KernelCheck, KernelFault};
use crate::engine::kv::{KvSpace, KvStep, LayerCache, SeqId};
use crate::engine::weights::{LayerWeights, MlpWeights, Weights};
use crate::error::EngineError;

mod activations;
#[cfg(test)]
mod tests;
mod v4;

pub use activations::DEFAULT_POOL_BYTES;
use activations::{Act, ActivationPool};

/// Logits of the rows of a step that asked for them.
#[derive(Clone, Debug, PartialEq)]
pub struct StepLogits {
    /// f32 `[rows, vocab]`, row `i` for `StepBatch::logit_rows[i]`.
    pub logits: Vec<f32>,
    /// The backend's argmax of each row (lowest id on ties).
    pub argmax: Vec<u32>,
    pub vocab: usize,
}

impl StepLogits {
    /// Logits of row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// The model: config, seed, weights on a backend.
#[derive(Debug)]
pub struct Model<B: Backend> {
    backend: Arc<B>,
    cfg: ModelConfig,
    seed: u64,
    weights: Weights<B::Buffer>,
    /// Re-checks a sample of the DSA kernel calls (see [`KernelCheck`]).
    check: Option<Arc<KernelCheck>>,
    /// An injected kernel bug (harness only).
    fault: Option<KernelFault>,
    /// Idle activation buffers, handed out again (see [`activations`]).
    acts: ActivationPool<B::Buffer>,
}

impl<B: Backend + ModelOps> Model<B> {
    /// Generates the weights of `cfg` under `seed` on `backend`.
    pub fn new(backend: Arc<B>, cfg: ModelConfig, seed: u64) -> Result<Self, EngineError> {
        let weights = Weights::generate(&*backend, &cfg, seed)?;
        Ok(Model {
            backend,
            cfg,
            seed,
            weights,
            check: None,
            fault: None,
            acts: ActivationPool::new(DEFAULT_POOL_BYTES),
        })
    }

    /// Keeps at most `max_bytes` of idle activation buffers for reuse by later ops,
    /// layers and steps ([`DEFAULT_POOL_BYTES`] by default; 0 allocates every activation
    /// anew). Reuse changes no result: every activation is written whole before it is
    /// read.
    pub fn with_activation_pool(mut self, max_bytes: usize) -> Self {
        self.acts = ActivationPool::new(max_bytes);
        self
    }

    /// An activation buffer of `bytes` bytes, contents unspecified: the output of an op
    /// that writes all of it.
    fn act(&self, bytes: usize) -> Result<Act<'_, B::Buffer>, EngineError> {
        Ok(self.acts.take(&*self.backend, bytes)?)
    }

    /// [`Self::act`] for `elems` f32 values.
    fn f32s(&self, elems: usize) -> Result<Act<'_, B::Buffer>, EngineError> {
        self.act(elems * 4)
    }

    /// [`Self::act`] for `elems` bf16 values.
    fn bf16s(&self, elems: usize) -> Result<Act<'_, B::Buffer>, EngineError> {
        self.act(elems * 2)
    }

    /// Re-checks a sample of this model's DSA kernel calls with `check`.
    pub fn with_kernel_check(mut self, check: Option<Arc<KernelCheck>>) -> Self {
        self.check = check;
        self
    }

    /// Injects a kernel bug (harness only).
    pub fn with_kernel_fault(mut self, fault: Option<KernelFault>) -> Self {
        self.fault = fault;
        self
    }

    /// Runs `audit` on the downloaded `bufs` when this call of `op` is sampled.
    fn audited(
        &self,
        op: AuditedOp,
        bufs: &[&B::Buffer],
        audit: impl FnOnce(&dyn KernelAudit, &[Vec<u8>]) -> Result<(), String>,
    ) -> Result<(), EngineError> {
        let Some(check) = &self.check else {
            return Ok(());
        };
        if !check.due(op) {
            return Ok(());
        }
        let b = &*self.backend;
        let bytes = bufs
            .iter()
            .map(|x| b.download(x))
            .collect::<Result<Vec<_>, _>>()?;
        check.record(op, audit(check.audit(), &bytes));
        Ok(())
    }

    /// The config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The weight seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The KV layout this model's caches must have (of a V4 model: its window pool's).
    /// A V4 model stores V4's form of the dtype asked for: `bf16` as `bf16_512`,
    /// `fp8_ds_mla` as `model1_fp8`.
    pub fn kv_layout(&self, dtype: KvDtype) -> Result<KvLayout, EngineError> {
        let c = &self.cfg;
        Ok(KvLayout::new(
            self.kv_dtype(dtype),
            c.kv_lora_rank(),
            c.rope_dim(),
            c.page_size(),
        )?)
    }

    /// The KV dtype this model stores for `dtype` (see [`Model::kv_layout`]).
    fn kv_dtype(&self, dtype: KvDtype) -> KvDtype {
        match (self.cfg.v4.is_some(), dtype) {
            (true, KvDtype::Bf16) => KvDtype::Bf16x512,
            (true, KvDtype::Fp8DsMla) => KvDtype::Model1Fp8,
            (_, d) => d,
        }
    }

    /// The index-K layout this model's caches must have (of a V4 model: its compressed
    /// index keys', a page of `page_size / 4` entries).
    pub fn index_k_layout(&self, dtype: IndexKDtype) -> Result<IndexKLayout, EngineError> {
        let c = &self.cfg;
        let page = c.v4.map_or(c.page_size(), |v| v.dims.csa_page);
        Ok(IndexKLayout::new(dtype, c.index_head_dim(), page)?)
    }

    /// Every pool this model's cache holds, for these dtypes: V3.2's KV and index-K in
    /// every layer, or V4's window pool in every layer plus, by layer, the CSA pools
    /// (compressed KV and index keys), the HCA pool and the compressor state (bf16, one
    /// row per raw token, [`ModelConfig::v4_state_width`] values).
    pub fn cache_spec(
        &self,
        kv_dtype: KvDtype,
        index_k_dtype: IndexKDtype,
    ) -> Result<CacheSpec, EngineError> {
        let c = &self.cfg;
        let (kv, ik) = (
            self.kv_layout(kv_dtype)?,
            self.index_k_layout(index_k_dtype)?,
        );
        let Some(v) = &c.v4 else {
            return Ok(CacheSpec::new(kv, ik, c.n_layers)?);
        };
        let row = |page| KvLayout::new(kv.dtype(), c.kv_lora_rank(), c.rope_dim(), page);
        let width = c.v4_state_width();
        let state = KvLayout::new(
            KvDtype::Bf16,
            width - c.rope_dim(),
            c.rope_dim(),
            c.page_size(),
        )?;
        Ok(CacheSpec::v4(
            kv,
            ik,
            row(v.dims.csa_page)?,
            row(v.dims.hca_page)?,
            state,
            &v.ratios(c.n_layers),
        )?
        .with_window(v.dims.window)?)
    }

    fn check_layouts(&self, kv: KvLayout, ik: IndexKLayout) -> Result<(), EngineError> {
        let c = &self.cfg;
        let ok = kv.nope_dim() == c.kv_lora_rank()
            && kv.rope_dim() == c.rope_dim()
            && kv.page_size() == c.page_size()
            && ik.head_dim() == c.index_head_dim()
            && ik.page_size() == c.page_size();
        if ok {
            Ok(())
        } else {
            Err(EngineError::InvalidConfig(format!(
                "cache layouts (KV {kv:?}, index-K {ik:?}) do not fit model {}",
                c.name
            )))
        }
    }

    /// Runs every layer of the step over `space` and returns the logits of the rows that
    /// asked for them. The sequences' pages must already be reserved in `space`. Layer
    /// `l` is taken from the space's step only when its computation starts, so a cache
    /// that is still loading layer `l + 1` keeps loading while layer `l` computes.
    pub fn forward<S: KvSpace<B>>(
        &self,
        batch: &StepBatch,
        space: &mut S,
    ) -> Result<StepLogits, EngineError> {
        let vocab = self.cfg.vocab();
        if batch.is_empty() {
            return Ok(StepLogits {
                logits: Vec::new(),
                argmax: Vec::new(),
                vocab,
            });
        }
        let seqs: Vec<_> = batch.chunks.iter().map(|c| c.seq).collect();
        self.acts.start_step();
        let mut step = space.step(&seqs)?;
        let mut h = self.embed_act(batch)?;
        for l in 0..self.cfg.n_layers {
            let mut cache = step.layer(l)?;
            self.forward_layer(l, batch, &mut h, &mut cache)?;
        }
        drop(step);
        self.logits(batch, &h)
    }

    /// The residual stream of the step's rows after the embedding: f32 `[rows, hidden]`.
    pub fn embed(&self, batch: &StepBatch) -> Result<B::Buffer, EngineError> {
        Ok(self.embed_act(batch)?.into_inner())
    }

    /// [`Self::embed`] into an activation buffer.
    fn embed_act(&self, batch: &StepBatch) -> Result<Act<'_, B::Buffer>, EngineError> {
        let b = &*self.backend;
        let d = self.cfg.hidden;
        let mut h = self.f32s(batch.len() * d)?;
        b.embed(
            &Embed {
                vocab: self.cfg.vocab(),
                dim: d,
                tokens: &batch.tokens,
            },
            &self.weights.embed,
            &mut h,
        )?;
        Ok(h)
    }

    /// Final norm and LM head on the rows of `batch.logit_rows`; downloads the logits.
    pub fn logits(&self, batch: &StepBatch, h: &B::Buffer) -> Result<StepLogits, EngineError> {
        let b = &*self.backend;
        let (d, vocab, s) = (self.cfg.hidden, self.cfg.vocab(), batch.logit_rows.len());
        if s == 0 {
            return Ok(StepLogits {
                logits: Vec::new(),
                argmax: Vec::new(),
                vocab,
            });
        }
        let mut hs = self.f32s(s * d)?;
        b.gather_rows(
            &GatherRows {
                width: d,
                rows: &batch.logit_rows,
                src_rows: batch.len(),
                x: View::dense(d),
                out: View::dense(d),
            },
            h,
            &mut hs,
        )?;
        let mut hn = self.f32s(s * d)?;
        b.rms_norm(&self.norm(s, d), &hs, &self.weights.final_norm, &mut hn)?;
        let mut logits = self.f32s(s * vocab)?;
        b.matmul(
            &Matmul::dense(s, d, vocab),
            &hn,
            &self.weights.lm_head,
            &mut logits,
        )?;
        let mut am = self.act(s * 4)?;
        b.argmax(
            &Argmax {
                rows: s,
                width: vocab,
            },
            &logits,
            &mut am,
        )?;
        let logits: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&logits)?);
        let argmax: Vec<u32> = bytemuck::pod_collect_to_vec(&b.download(&am)?);
        Ok(StepLogits {
            logits,
            argmax,
            vocab,
        })
    }

    fn norm(&self, rows: usize, width: usize) -> RmsNorm {
        RmsNorm {
            rows,
            width,
            eps: self.cfg.norm_eps,
            x: View::dense(width),
            out: View::dense(width),
        }
    }

    /// One decoder layer for every row of `batch`: reads and updates the residual stream
    /// `h` (f32 `[rows, hidden]`), stores the rows' KV and index keys through `cache`,
    /// then attends over `cache`. `cache` must be this layer's caches of the space whose
    /// pages `batch` was built from.
    pub fn forward_layer<L: LayerCache<B>>(
        &self,
        layer: usize,
        batch: &StepBatch,
        h: &mut B::Buffer,
        cache: &mut L,
    ) -> Result<(), EngineError> {
        if let Some(v) = self.cfg.v4 {
            return self.forward_layer_v4(layer, &v, batch, h, cache);
        }
        let (kv_layout, ik_layout) = (cache.kv_layout(), cache.index_k_layout());
        self.check_layouts(kv_layout, ik_layout)?;
        let w: &LayerWeights<B::Buffer> = self.weights.layers.get(layer).ok_or_else(|| {
            EngineError::InvalidRequest(format!("layer {layer} of {}", self.cfg.n_layers))
        })?;
        let b = &*self.backend;
        let c = &self.cfg;
        let t = batch.len();
        let (d, r, nh) = (c.hidden, c.q_lora_rank, c.n_heads);
        let (lat, rope, dqk) = (c.kv_lora_rank(), c.rope_dim(), c.d_qk());
        let (nope, qhd, vh) = (c.qk_nope_head_dim, c.q_head_dim(), c.v_head_dim);
        let (ih, id) = (c.index_heads(), c.index_head_dim());
        let pos = &batch.positions[..];
        let rope_op = |heads: usize, x: View, out: View| Rope {
            heads,
            rope_dim: rope,
            positions: pos,
            max_positions: c.max_context,
            x,
            out,
        };
        let to_bf16 = |width: usize| Cast {
            rows: t,
            groups: 1,
            width,
            from: DenseDtype::F32,
            to: DenseDtype::Bf16,
            x: View::dense(width),
            out: View::dense(width),
        };

        // 1. Queries.
        let mut x = self.f32s(t * d)?;
        b.rms_norm(&self.norm(t, d), h, &w.attn_norm, &mut x)?;
        let mut qa = self.f32s(t * r)?;
        b.matmul(&Matmul::dense(t, d, r), &x, &w.wq_a, &mut qa)?;
        let mut qan = self.f32s(t * r)?;
        b.rms_norm(&self.norm(t, r), &qa, &w.q_norm, &mut qan)?;
        drop(qa);
        let mut qb = self.f32s(t * nh * qhd)?;
        b.matmul(&Matmul::dense(t, r, nh * qhd), &qan, &w.wq_b, &mut qb)?;
        let mut q = self.f32s(t * nh * dqk)?;
        b.matmul(
            &Matmul {
                rows: t,
                groups: nh,
                k: nope,
                n: lat,
                x: View::grouped(nh, qhd),
                out: View::grouped(nh, dqk),
                accumulate: Accumulate::Overwrite,
            },
            &qb,
            &w.w_uk,
            &mut q,
        )?;
        b.rope(
            &rope_op(
                nh,
                View::grouped(nh, qhd).shifted(nope),
                View::grouped(nh, dqk).shifted(lat),
            ),
            &self.weights.rope,
            &qb,
            &mut q,
        )?;
        drop(qb);
        let mut q16 = self.bf16s(t * nh * dqk)?;
        b.cast(&to_bf16(nh * dqk), &q, &mut q16)?;
        drop(q);

        // 2. Latent KV.
        let mut kva = self.f32s(t * dqk)?;
        b.matmul(&Matmul::dense(t, d, dqk), &x, &w.wkv_a, &mut kva)?;
        let mut kv = self.f32s(t * dqk)?;
        b.rms_norm(
            &RmsNorm {
                x: View::dense(dqk),
                out: View::dense(dqk),
                ..self.norm(t, lat)
            },
            &kva,
            &w.kv_norm,
            &mut kv,
        )?;
        b.rope(
            &rope_op(1, View::cols(dqk, lat), View::cols(dqk, lat)),
            &self.weights.rope,
            &kva,
            &mut kv,
        )?;
        drop(kva);
        let mut kv16 = self.bf16s(t * dqk)?;
        b.cast(&to_bf16(dqk), &kv, &mut kv16)?;
        drop(kv);

        // 3. Indexer queries, key, head weights.
        let mut iq = self.f32s(t * ih * id)?;
        b.matmul(&Matmul::dense(t, r, ih * id), &qan, &w.wq_index, &mut iq)?;
        drop(qan);
        let mut iqr = self.f32s(t * ih * id)?;
        self.rope_prefix(ih, id, pos, &iq, &mut iqr)?;
        drop(iq);
        let mut iq16 = self.bf16s(t * ih * id)?;
        b.cast(&to_bf16(ih * id), &iqr, &mut iq16)?;
        drop(iqr);
        let mut ik = self.f32s(t * id)?;
        b.matmul(&Matmul::dense(t, d, id), &x, &w.wk_index, &mut ik)?;
        let mut ikn = self.f32s(t * id)?;
        b.rms_norm(&self.norm(t, id), &ik, &w.k_norm_index, &mut ikn)?;
        self.rope_prefix(1, id, pos, &ikn, &mut ik)?;
        let mut ik16 = self.bf16s(t * id)?;
        b.cast(&to_bf16(id), &ik, &mut ik16)?;
        drop((ik, ikn));
        let mut iw = self.f32s(t * ih)?;
        b.matmul(&Matmul::dense(t, d, ih), &x, &w.w_index_heads, &mut iw)?;
        drop(x);

        // 4. Store, select, attend.
        cache.store(b, &batch.slots, &kv16, &ik16)?;
        drop((kv16, ik16));
        let reads: Vec<(SeqId, usize)> = batch
            .chunks
            .iter()
            .map(|c| (c.seq, batch.positions[c.first + c.len - 1] as usize + 1))
            .collect();
        let (kv_cache, ik_cache) = cache.views(&reads)?;
        let table = PageTable::new(&batch.page_table, batch.max_pages)?;
        let stride = batch.row_stride;
        let mut scores = self.f32s(t * stride)?;
        let logits_op = IndexerLogits {
            layout: ik_layout,
            n_heads: ih,
            page_table: table,
            rows: batch.rows.clone(),
            row_stride: stride,
        };
        b.indexer_logits(&logits_op, &iq16, &iw, ik_cache, &mut scores)?;
        self.audited(
            AuditedOp::IndexerLogits,
            &[&iq16, &iw, ik_cache, &scores],
            |a, x| a.indexer_logits(&logits_op, &x[0], &x[1], &x[2], &x[3]),
        )?;
        drop((iq16, iw));
        let k = c.index_topk;
        let mut slots = self.act(t * k * 4)?;
        let topk_op = Topk {
            short_rows: sparsekit_host::ops::ShortRows::SelectValid,
            k,
            row_stride: stride,
            rows: &batch.rows,
            output: TopkOutput::Slots {
                page_table: table,
                page_size: c.page_size(),
            },
        };
        b.topk(&topk_op, &scores, &mut slots)?;
        if let Some(f) = &self.fault {
            let mut v: Vec<i32> = bytemuck::pod_collect_to_vec(&b.download(&slots)?);
            f.apply_topk(&topk_op, &mut v);
            *slots = b.upload(bytemuck::cast_slice(&v))?;
        }
        self.audited(AuditedOp::Topk, &[&scores, &slots], |a, x| {
            a.topk(&topk_op, &x[0], &x[1])
        })?;
        drop(scores);
        let mut o16 = self.bf16s(t * nh * lat)?;
        let mut lse = self.f32s(t * nh)?;
        let mla_op = SparseMla {
            layout: kv_layout,
            n_tokens: t,
            n_heads: nh,
            topk: k,
            softmax_scale: c.softmax_scale(),
        };
        b.sparse_mla(&mla_op, &q16, kv_cache, &slots, &mut o16, &mut lse)?;
        self.audited(
            AuditedOp::SparseMla,
            &[&q16, kv_cache, &slots, &o16, &lse],
            |a, x| a.sparse_mla(&mla_op, &x[0], &x[1], &x[2], &x[3], &x[4]),
        )?;
        drop((q16, slots, lse));

        // 5. Values and output projection (+ residual).
        let mut o = self.f32s(t * nh * lat)?;
        b.cast(
            &Cast {
                from: DenseDtype::Bf16,
                to: DenseDtype::F32,
                ..to_bf16(nh * lat)
            },
            &o16,
            &mut o,
        )?;
        drop(o16);
        let mut ov = self.f32s(t * nh * vh)?;
        b.matmul(
            &Matmul {
                rows: t,
                groups: nh,
                k: lat,
                n: vh,
                x: View::grouped(nh, lat),
                out: View::grouped(nh, vh),
                accumulate: Accumulate::Overwrite,
            },
            &o,
            &w.w_uv,
            &mut ov,
        )?;
        drop(o);
        b.matmul(
            &Matmul {
                accumulate: Accumulate::Add,
                ..Matmul::dense(t, nh * vh, d)
            },
            &ov,
            &w.wo,
            h,
        )?;
        drop(ov);

        // 6. MLP (+ residual).
        self.mlp(t, h, &w.mlp)
    }

    /// `h += swiglu(rms_norm(h)·W_gate_up)·W_down` over `t` rows.
    fn mlp(
        &self,
        t: usize,
        h: &mut B::Buffer,
        w: &MlpWeights<B::Buffer>,
    ) -> Result<(), EngineError> {
        let b = &*self.backend;
        let (d, i) = (self.cfg.hidden, self.cfg.intermediate);
        let mut xm = self.f32s(t * d)?;
        b.rms_norm(&self.norm(t, d), h, &w.norm, &mut xm)?;
        let mut gu = self.f32s(t * 2 * i)?;
        b.matmul(&Matmul::dense(t, d, 2 * i), &xm, &w.gate_up, &mut gu)?;
        drop(xm);
        let mut act = self.f32s(t * i)?;
        b.swiglu(
            &sparsekit_host::model_ops::SwiGlu { rows: t, width: i },
            &gu,
            &mut act,
        )?;
        drop(gu);
        b.matmul(
            &Matmul {
                accumulate: Accumulate::Add,
                ..Matmul::dense(t, i, d)
            },
            &act,
            &w.down,
            h,
        )?;
        Ok(())
    }

    /// `out = x` with rope applied to the first `rope_dim` dims of each of `heads` heads
    /// of width `dim` (the indexer's convention).
    fn rope_prefix(
        &self,
        heads: usize,
        dim: usize,
        positions: &[u32],
        x: &B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<(), EngineError> {
        let b = &*self.backend;
        let rope = self.cfg.rope_dim();
        let t = positions.len();
        let v = View::grouped(heads, dim);
        b.rope(
            &Rope {
                heads,
                rope_dim: rope,
                positions,
                max_positions: self.cfg.max_context,
                x: v,
                out: v,
            },
            &self.weights.rope,
            x,
            out,
        )?;
        if dim > rope {
            b.cast(
                &Cast {
                    rows: t,
                    groups: heads,
                    width: dim - rope,
                    from: DenseDtype::F32,
                    to: DenseDtype::F32,
                    x: v.shifted(rope),
                    out: v.shifted(rope),
                },
                x,
                out,
            )?;
        }
        Ok(())
    }
}

/// 64-bit FNV-1a digest of a logits row's f32 bit patterns (little-endian): the
/// per-step fingerprint the integrity harness compares.
pub fn logits_digest(row: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in row {
        for byte in v.to_bits().to_le_bytes() {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
