//! DeepSeek-V4's decoder layer ([`crate::engine::ModelConfig::v4`]), on the same dense
//! and DSA ops as the V3.2 layer.
//!
//! One layer, for the rows of a [`StepBatch`]:
//!
//! 1. `x = rms_norm(h)`; `q = rope_tail(rms_norm_per_head(rms_norm(x·Wq_a)·Wq_b))`: 512
//!    per head, rope on the last 64 dims at the row's position → bf16.
//! 2. `kv = [rms_norm(k_nope) | rope(k_rope)] = x·Wkv` → bf16 → the window pool (`Kv`).
//! 3. Compressed layers: the state row `x·W_state` (the KV compressor's values and gate
//!    logits, then the index-key compressor's) → bf16 → the `State` pool; then every
//!    compressed entry the step completes (entry `e` of ratio `r` completes at raw
//!    position `(e + 1)·r − 1`) is pooled from its window's state rows, read back from
//!    the pool (`gated_pool`: CSA windows `[(e − 1)·r, (e + 1)·r)`, HCA `[e·r, (e + 1)·r)`),
//!    normalised, roped at position `e·r` → bf16 → `CsaKv` / `HcaKv`; CSA layers also
//!    pool their index keys the same way → `IndexK`.
//! 4. Attention (`sparse_mla_v4`, sink per head): the window (the last `window` raw tokens
//!    up to the row) plus, in a CSA layer, the indexer's top-k compressed entries
//!    (`indexer_logits` over the entries the row may see, `w < (p + 1) / r`, then exact
//!    top-k with V4's transform: a row with at most `k` entries takes all of them), in an
//!    HCA layer every compressed entry it may see.
//! 5. The output's rope dims get the inverse rotation at the row's position, then
//!    `h += o·Wo`; the MLP as in V3.2.
//!
//! Every value a compressed entry depends on is read back from the cache in bf16, in the
//! same order whatever the step: an entry is bit-identical whether its window's tokens
//! were computed in this step, an earlier one, or loaded from the host tier.

use std::collections::HashMap;

use sparsekit_host::cache::{BufferKind, CacheSpec};
use sparsekit_host::layout::PageLayout;
use sparsekit_host::model_ops::{
    Cast, DenseDtype, GatedPool, GatherRows, Matmul, ModelOps, RmsNorm, Rope, View,
};
use sparsekit_host::ops::{
    IndexerLogits, PageTable, QueryRange, ShortRows, SparseMlaV4, Topk, TopkOutput, V4Cache,
};
use sparsekit_host::{Backend, KvInput, KvLayout, V4Dims};

use super::activations::Act;
use super::Model;
use crate::engine::batch::StepBatch;
use crate::engine::config::V4Attention;
use crate::engine::kernel_check::AuditedOp;
use crate::engine::kv::{LayerCache, SeqId};
use crate::engine::weights::{Compressor, V4LayerWeights};
use crate::error::EngineError;

/// The rope dims at the end of a V4 row.
const ROPE: usize = 64;

/// The compressed entries one step completes in one layer, and where their inputs are.
#[derive(Debug, Default)]
struct Completed {
    /// Slot of each entry in the compressed pools (`page · entries_per_page + offset`).
    slots: Vec<i64>,
    /// Rope position of each entry (`e · ratio`).
    positions: Vec<u32>,
    /// `[entries, span]` indices into `gather`, [`GatedPool::EMPTY`] before position 0.
    sources: Vec<u32>,
    /// State-pool slots of the rows the entries pool, each once.
    gather: Vec<u32>,
}

/// Raw position `p` of chunk `c` as a slot of a pool of `per_page` entries of `tokens`
/// raw tokens each (`tokens · per_page` = the page span).
fn slot(batch: &StepBatch, c: usize, p: usize, tokens: usize, per_page: usize) -> i64 {
    let span = tokens * per_page;
    let page = batch.page_table[c * batch.max_pages + p / span];
    page as i64 * per_page as i64 + ((p / tokens) % per_page) as i64
}

impl Completed {
    /// The entries of ratio `ratio` (window `span` raw tokens) that `batch` completes.
    fn plan(batch: &StepBatch, spec: &CacheSpec, ratio: usize, span: usize) -> Self {
        let tpp = spec.page_size();
        let per_page = tpp / ratio;
        let mut out = Completed::default();
        let mut gathered: HashMap<i64, u32> = HashMap::new();
        for (c, ch) in batch.chunks.iter().enumerate() {
            let a = batch.positions[ch.first] as usize;
            let b = a + ch.len;
            for e in a / ratio..b / ratio {
                out.slots.push(slot(batch, c, e * ratio, ratio, per_page));
                out.positions.push((e * ratio) as u32);
                // The window ends at the entry's last raw token.
                let end = (e + 1) * ratio;
                for i in 0..span {
                    let Some(p) = (end + i).checked_sub(span) else {
                        out.sources.push(GatedPool::EMPTY);
                        continue;
                    };
                    let s = slot(batch, c, p, 1, tpp);
                    let next = out.gather.len() as u32;
                    let id = *gathered.entry(s).or_insert(next);
                    if id == next {
                        out.gather.push(s as u32);
                    }
                    out.sources.push(id);
                }
            }
        }
        out
    }
}

/// The KV layout of a row pool of `spec` (every kind but `IndexK`).
fn row_layout(spec: &CacheSpec, kind: BufferKind) -> Result<KvLayout, EngineError> {
    match spec.layout(kind) {
        PageLayout::Kv(l) => Ok(l),
        PageLayout::IndexK(_) => Err(EngineError::InvalidConfig(format!(
            "the {} pool does not hold rows",
            kind.name()
        ))),
    }
}

impl<B: Backend + ModelOps> Model<B> {
    /// One V4 decoder layer (module docs); `cache` holds this layer's pools of the space's
    /// spec, which must be [`Model::cache_spec`]'s for its dtypes.
    pub(super) fn forward_layer_v4<L: LayerCache<B>>(
        &self,
        layer: usize,
        v: &V4Attention,
        batch: &StepBatch,
        h: &mut B::Buffer,
        cache: &mut L,
    ) -> Result<(), EngineError> {
        let spec = cache.spec();
        let want = self.cache_spec(spec.kv.dtype(), spec.index_k.dtype())?;
        if want.fingerprint() != spec.fingerprint() {
            return Err(EngineError::InvalidConfig(format!(
                "the cache's pools do not fit model {}",
                self.cfg.name
            )));
        }
        let w: &V4LayerWeights<B::Buffer> = self.weights.v4_layers.get(layer).ok_or_else(|| {
            EngineError::InvalidRequest(format!("layer {layer} of {}", self.cfg.n_layers))
        })?;
        let b = &*self.backend;
        let c = &self.cfg;
        let t = batch.len();
        let (d, r, nh, row) = (c.hidden, c.q_lora_rank, c.n_heads, V4Dims::D);
        let nope = row - ROPE;
        let pos = &batch.positions[..];

        // 1. Queries.
        let mut x = self.f32s(t * d)?;
        b.rms_norm(&self.norm(t, d), h, &w.attn_norm, &mut x)?;
        let mut qa = self.f32s(t * r)?;
        b.matmul(&Matmul::dense(t, d, r), &x, &w.wq_a, &mut qa)?;
        let mut qan = self.f32s(t * r)?;
        b.rms_norm(&self.norm(t, r), &qa, &w.q_norm, &mut qan)?;
        drop(qa);
        let mut qb = self.f32s(t * nh * row)?;
        b.matmul(&Matmul::dense(t, r, nh * row), &qan, &w.wq_b, &mut qb)?;
        let mut qn = self.f32s(t * nh * row)?;
        b.rms_norm(&self.norm(t * nh, row), &qb, &w.q_head_norm, &mut qn)?;
        drop(qb);
        let mut q = self.f32s(t * nh * row)?;
        self.rope_tail(nh, pos, &self.weights.rope, &qn, &mut q)?;
        drop(qn);
        let mut q16 = self.bf16s(t * nh * row)?;
        b.cast(&to_bf16(t, nh * row), &q, &mut q16)?;
        drop(q);

        // 2. The window's KV row.
        let mut kvp = self.f32s(t * row)?;
        b.matmul(&Matmul::dense(t, d, row), &x, &w.wkv, &mut kvp)?;
        let mut kv = self.f32s(t * row)?;
        self.norm_and_rope(t, row, nope, &kvp, &w.kv_norm, pos, &mut kv)?;
        drop(kvp);
        let mut kv16 = self.bf16s(t * row)?;
        b.cast(&to_bf16(t, row), &kv, &mut kv16)?;
        drop(kv);
        cache.store_kind(b, BufferKind::Kv, &batch.slots, &kv16)?;
        drop(kv16);

        let reads: Vec<(SeqId, usize)> = batch
            .chunks
            .iter()
            .map(|ch| (ch.seq, batch.positions[ch.first + ch.len - 1] as usize + 1))
            .collect();

        // 3. The compressor (compressed layers).
        let ratio = w.ratio;
        let extra_kind = match ratio {
            0 => None,
            r if r == v.dims.csa_ratio => Some(BufferKind::CsaKv),
            _ => Some(BufferKind::HcaKv),
        };
        if let Some(kind) = extra_kind {
            self.compress(layer, v, w, batch, &spec, kind, &x, &reads, cache)?;
        }
        // The indexer's head weights (CSA layers), from the layer's normalised input.
        let iw = match &w.indexer {
            Some(ix) => {
                let ih = c.index_heads();
                let mut iw = self.f32s(t * ih)?;
                b.matmul(&Matmul::dense(t, d, ih), &x, &ix.heads, &mut iw)?;
                Some(iw)
            }
            None => None,
        };
        drop(x);

        // 4. Attention: the window, plus the compressed entries.
        let table = PageTable::new(&batch.page_table, batch.max_pages)?;
        let window = v.dims.window;
        let tpp = spec.page_size();
        // The window pool's page indices (its frames in a cache that gives them back).
        let frames = cache.buffer_pages(BufferKind::Kv, &batch.page_table);
        let mut win = vec![-1i32; t * window];
        let mut win_len = vec![0u32; t];
        for (ci, ch) in batch.chunks.iter().enumerate() {
            for i in ch.first..ch.first + ch.len {
                let p = pos[i] as usize;
                let from = (p + 1).saturating_sub(window);
                for (j, q) in (from..=p).enumerate() {
                    let frame = frames[ci * batch.max_pages + q / tpp];
                    if frame < 0 {
                        return Err(EngineError::InvalidRequest(format!(
                            "sequence {}: the window rows of token {q} were given back",
                            ch.seq
                        )));
                    }
                    win[i * window + j] = (frame as usize * tpp + q % tpp) as i32;
                }
                win_len[i] = (p + 1 - from) as u32;
            }
        }
        let win_idx = b.upload(bytemuck::cast_slice(&win))?;
        // The extra cache's indices and how many each row uses.
        let extra = match extra_kind {
            None => None,
            Some(BufferKind::CsaKv) => {
                let iq = self.indexer_queries(w, &qan, pos)?;
                let iw = iw.as_ref().ok_or_else(|| {
                    EngineError::InvalidConfig(format!("a CSA layer of {} has no indexer", c.name))
                })?;
                let (slots, k) = self.select(v, batch, &table, &iq, iw, &reads, cache)?;
                // `-1` marks the unused entries: no lengths.
                Some((BufferKind::CsaKv, (slots, k, None)))
            }
            Some(kind) => {
                let per_page = spec.entries_per_page(kind);
                let seen = |p: u32| (p as usize + 1) / ratio;
                let k = pos.iter().map(|&p| seen(p)).max().unwrap_or(0);
                if k == 0 {
                    None
                } else {
                    let mut idx = vec![-1i32; t * k];
                    let mut len = vec![0u32; t];
                    for (ci, ch) in batch.chunks.iter().enumerate() {
                        for i in ch.first..ch.first + ch.len {
                            let n = seen(pos[i]);
                            for e in 0..n {
                                idx[i * k + e] = slot(batch, ci, e * ratio, ratio, per_page) as i32;
                            }
                            len[i] = n as u32;
                        }
                    }
                    Some((kind, (b.upload(bytemuck::cast_slice(&idx))?, k, Some(len))))
                }
            }
        };
        drop(qan);
        let main_view = cache.view(BufferKind::Kv, &reads)?;
        let extra_view = match &extra {
            Some((kind, _)) => Some(cache.view(*kind, &reads)?),
            None => None,
        };
        let extra_layout = match &extra {
            Some((kind, _)) => Some(row_layout(&spec, *kind)?),
            None => None,
        };
        let op = SparseMlaV4 {
            n_tokens: t,
            n_heads: nh,
            softmax_scale: c.softmax_scale(),
            main: V4Cache {
                layout: spec.kv,
                topk: window,
                lengths: Some(&win_len),
            },
            extra: match (&extra, extra_layout) {
                (Some((_, (_, k, len))), Some(layout)) => Some(V4Cache {
                    layout,
                    topk: *k,
                    lengths: len.as_deref(),
                }),
                _ => None,
            },
            attn_sink: Some(&w.sink),
        };
        let mut o16 = self.bf16s(t * nh * row)?;
        let mut lse = self.f32s(t * nh)?;
        b.sparse_mla_v4(
            &op,
            &q16,
            KvInput {
                cache: main_view,
                indices: &win_idx,
            },
            match (&extra, extra_view) {
                (Some((_, (idx, _, _))), Some(view)) => Some(KvInput {
                    cache: view,
                    indices: idx,
                }),
                _ => None,
            },
            &mut o16,
            &mut lse,
        )?;
        {
            let mut bufs: Vec<&B::Buffer> = vec![&q16, main_view, &win_idx, &o16, &lse];
            if let (Some((_, (idx, _, _))), Some(view)) = (&extra, extra_view) {
                bufs.push(view);
                bufs.push(idx);
            }
            self.audited(AuditedOp::SparseMlaV4, &bufs, |a, x| {
                let extra = (x.len() == 7).then(|| (&x[5][..], &x[6][..]));
                a.sparse_mla_v4(&op, &x[0], (&x[1], &x[2]), extra, &x[3], &x[4])
            })?;
        }
        drop((q16, win_idx, extra, lse));

        // 5. The inverse rotation of the output's rope dims, the output projection.
        let mut o = self.f32s(t * nh * row)?;
        b.cast(&to_f32(t, nh * row), &o16, &mut o)?;
        let mut ou = self.f32s(t * nh * row)?;
        b.cast(&to_f32(t, nh * row), &o16, &mut ou)?;
        drop(o16);
        let inverse = self.weights.inverse_rope.as_ref().ok_or_else(|| {
            EngineError::InvalidConfig(format!("{} has no inverse rope table", c.name))
        })?;
        let tail = View::grouped(nh, row).shifted(nope);
        b.rope(&self.rope_op(nh, pos, tail, tail), inverse, &o, &mut ou)?;
        drop(o);
        b.matmul(
            &Matmul {
                accumulate: sparsekit_host::model_ops::Accumulate::Add,
                ..Matmul::dense(t, nh * row, d)
            },
            &ou,
            &w.wo,
            h,
        )?;
        drop(ou);
        self.mlp(t, h, &w.mlp)
    }

    /// Step 3 of the module docs for a layer whose compressed pool is `kind`.
    #[allow(clippy::too_many_arguments)]
    fn compress<L: LayerCache<B>>(
        &self,
        layer: usize,
        v: &V4Attention,
        w: &V4LayerWeights<B::Buffer>,
        batch: &StepBatch,
        spec: &CacheSpec,
        kind: BufferKind,
        x: &B::Buffer,
        reads: &[(SeqId, usize)],
        cache: &mut L,
    ) -> Result<(), EngineError> {
        let b = &*self.backend;
        let c = &self.cfg;
        let (t, d, row) = (batch.len(), c.hidden, V4Dims::D);
        let width = c.v4_state_width();
        let missing = |what: &str| {
            EngineError::InvalidConfig(format!("layer {layer} of {} has no {what}", c.name))
        };
        let w_state = w
            .w_state
            .as_ref()
            .ok_or_else(|| missing("state projection"))?;
        let kv_comp = w
            .kv_compressor
            .as_ref()
            .ok_or_else(|| missing("compressor"))?;
        if spec.tokens_per_entry(BufferKind::State) != 1 {
            return Err(EngineError::InvalidConfig(
                "the engine keeps one state row per raw token".into(),
            ));
        }
        // Every raw token's state row, then the entries the step completes.
        let mut st = self.f32s(t * width)?;
        b.matmul(&Matmul::dense(t, d, width), x, w_state, &mut st)?;
        let mut st16 = self.bf16s(t * width)?;
        b.cast(&to_bf16(t, width), &st, &mut st16)?;
        drop(st);
        cache.store_kind(b, BufferKind::State, &batch.slots, &st16)?;
        drop(st16);
        let ratio = w.ratio;
        let plan = Completed::plan(batch, spec, ratio, v.span(ratio));
        let entries = plan.slots.len();
        if entries == 0 {
            return Ok(());
        }
        // The windows' state rows, read back (bit moves: bf16 pairs as f32 words).
        let pool = cache.view(BufferKind::State, reads)?;
        let n = plan.gather.len();
        let mut g = self.bf16s(n * width)?;
        b.gather_rows(
            &GatherRows {
                width: width / 2,
                rows: &plan.gather,
                src_rows: b.buffer_len(pool) / (width * 2),
                x: View::dense(width / 2),
                out: View::dense(width / 2),
            },
            pool,
            &mut g,
        )?;
        let pooled = |comp: &Compressor<B::Buffer>, offset: usize, w: usize| {
            let mut xs = self.f32s(n * 2 * w)?;
            b.cast(
                &Cast {
                    rows: n,
                    groups: 1,
                    width: 2 * w,
                    from: DenseDtype::Bf16,
                    to: DenseDtype::F32,
                    x: View::cols(width, offset),
                    out: View::dense(2 * w),
                },
                &g,
                &mut xs,
            )?;
            let mut out = self.f32s(entries * w)?;
            b.gated_pool(
                &GatedPool {
                    entries,
                    span: v.span(ratio),
                    width: w,
                    sources: &plan.sources,
                    rows: n,
                },
                &xs,
                &comp.bias,
                &mut out,
            )?;
            Ok::<_, EngineError>(out)
        };
        let ckv = pooled(kv_comp, 0, row)?;
        let mut e = self.f32s(entries * row)?;
        self.norm_and_rope(
            entries,
            row,
            row - ROPE,
            &ckv,
            &kv_comp.norm,
            &plan.positions,
            &mut e,
        )?;
        drop(ckv);
        let mut e16 = self.bf16s(entries * row)?;
        b.cast(&to_bf16(entries, row), &e, &mut e16)?;
        drop(e);
        cache.store_kind(b, kind, &plan.slots, &e16)?;
        drop(e16);
        if let Some(ix) = &w.indexer {
            let id = c.index_head_dim();
            let pk = pooled(&ix.compressor, 2 * row, id)?;
            let mut kn = self.f32s(entries * id)?;
            b.rms_norm(&self.norm(entries, id), &pk, &ix.compressor.norm, &mut kn)?;
            drop(pk);
            let mut k = self.f32s(entries * id)?;
            self.rope_prefix(1, id, &plan.positions, &kn, &mut k)?;
            drop(kn);
            let mut k16 = self.bf16s(entries * id)?;
            b.cast(&to_bf16(entries, id), &k, &mut k16)?;
            drop(k);
            cache.store_kind(b, BufferKind::IndexK, &plan.slots, &k16)?;
        }
        Ok(())
    }

    /// The indexer's queries (bf16 `[t, heads, index_dim]`, rope on the first rope dims).
    fn indexer_queries(
        &self,
        w: &V4LayerWeights<B::Buffer>,
        qan: &B::Buffer,
        pos: &[u32],
    ) -> Result<Act<'_, B::Buffer>, EngineError> {
        let b = &*self.backend;
        let c = &self.cfg;
        let (t, r, ih, id) = (
            pos.len(),
            c.q_lora_rank,
            c.index_heads(),
            c.index_head_dim(),
        );
        let ix = w.indexer.as_ref().ok_or_else(|| {
            EngineError::InvalidConfig(format!("a CSA layer of {} has no indexer", c.name))
        })?;
        let mut iq = self.f32s(t * ih * id)?;
        b.matmul(&Matmul::dense(t, r, ih * id), qan, &ix.wq, &mut iq)?;
        let mut iqr = self.f32s(t * ih * id)?;
        self.rope_prefix(ih, id, pos, &iq, &mut iqr)?;
        drop(iq);
        let mut iq16 = self.bf16s(t * ih * id)?;
        b.cast(&to_bf16(t, ih * id), &iqr, &mut iq16)?;
        Ok(iq16)
    }

    /// A CSA layer's selection: indexer logits over the compressed entries each row may
    /// see (queries `iq16`, head weights `iw`), then V4's top-k; returns the slots (i32
    /// `[t, k]`, `-1` padded) and `k`.
    #[allow(clippy::too_many_arguments)]
    fn select<L: LayerCache<B>>(
        &self,
        v: &V4Attention,
        batch: &StepBatch,
        table: &PageTable<'_>,
        iq16: &B::Buffer,
        iw: &B::Buffer,
        reads: &[(SeqId, usize)],
        cache: &L,
    ) -> Result<(B::Buffer, usize), EngineError> {
        let b = &*self.backend;
        let c = &self.cfg;
        let t = batch.len();
        let ih = c.index_heads();
        let ratio = v.dims.csa_ratio;
        let mut rows = Vec::with_capacity(t);
        for (ci, ch) in batch.chunks.iter().enumerate() {
            for i in ch.first..ch.first + ch.len {
                rows.push(QueryRange {
                    request: ci as u32,
                    start: 0,
                    end: (batch.positions[i] + 1) / ratio as u32,
                });
            }
        }
        let stride = rows
            .iter()
            .map(|q| q.end as usize)
            .max()
            .unwrap_or(0)
            .max(1);
        let ik_cache = cache.view(BufferKind::IndexK, reads)?;
        let spec = cache.spec();
        let mut scores = self.f32s(t * stride)?;
        let logits_op = IndexerLogits {
            layout: spec.index_k,
            n_heads: ih,
            page_table: *table,
            rows: rows.clone(),
            row_stride: stride,
        };
        b.indexer_logits(&logits_op, iq16, iw, ik_cache, &mut scores)?;
        self.audited(
            AuditedOp::IndexerLogits,
            &[iq16, iw, ik_cache, &scores],
            |a, x| a.indexer_logits(&logits_op, &x[0], &x[1], &x[2], &x[3]),
        )?;
        let k = c.index_topk;
        let mut slots = self.act(t * k * 4)?;
        let topk_op = Topk {
            short_rows: ShortRows::TakeAll,
            k,
            row_stride: stride,
            rows: &rows,
            output: TopkOutput::Slots {
                page_table: *table,
                page_size: spec.entries_per_page(BufferKind::IndexK),
            },
        };
        b.topk(&topk_op, &scores, &mut slots)?;
        self.audited(AuditedOp::Topk, &[&scores, &slots], |a, x| {
            a.topk(&topk_op, &x[0], &x[1])
        })?;
        // Kept: the HCA layers' indices are uploaded, so `extra` holds plain buffers.
        Ok((slots.into_inner(), k))
    }

    /// `out = x` with rope on the last [`ROPE`] dims of each of `heads` heads of 512, at
    /// the rows' positions, with `table`.
    fn rope_tail(
        &self,
        heads: usize,
        pos: &[u32],
        table: &B::Buffer,
        x: &B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<(), EngineError> {
        let b = &*self.backend;
        let row = V4Dims::D;
        let v = View::grouped(heads, row);
        b.rope(
            &self.rope_op(heads, pos, v.shifted(row - ROPE), v.shifted(row - ROPE)),
            table,
            x,
            out,
        )?;
        b.cast(
            &Cast {
                rows: pos.len(),
                groups: heads,
                width: row - ROPE,
                from: DenseDtype::F32,
                to: DenseDtype::F32,
                x: v,
                out: v,
            },
            x,
            out,
        )?;
        Ok(())
    }

    /// `out = [rms_norm(x[.., ..nope]) | rope(x[.., nope..])]` for `rows` rows of `width`
    /// (`width − nope` = the rope dims) at `positions`.
    #[allow(clippy::too_many_arguments)]
    fn norm_and_rope(
        &self,
        rows: usize,
        width: usize,
        nope: usize,
        x: &B::Buffer,
        gamma: &B::Buffer,
        positions: &[u32],
        out: &mut B::Buffer,
    ) -> Result<(), EngineError> {
        let b = &*self.backend;
        b.rms_norm(
            &RmsNorm {
                x: View::dense(width),
                out: View::dense(width),
                ..self.norm(rows, nope)
            },
            x,
            gamma,
            out,
        )?;
        b.rope(
            &self.rope_op(
                1,
                positions,
                View::cols(width, nope),
                View::cols(width, nope),
            ),
            &self.weights.rope,
            x,
            out,
        )?;
        Ok(())
    }

    /// A rope over `heads` groups at `positions` (rope dim of the config).
    fn rope_op<'p>(&self, heads: usize, positions: &'p [u32], x: View, out: View) -> Rope<'p> {
        Rope {
            heads,
            rope_dim: self.cfg.rope_dim(),
            positions,
            max_positions: self.cfg.max_context,
            x,
            out,
        }
    }
}

/// f32 → bf16 over `rows × width`.
fn to_bf16(rows: usize, width: usize) -> Cast {
    Cast {
        rows,
        groups: 1,
        width,
        from: DenseDtype::F32,
        to: DenseDtype::Bf16,
        x: View::dense(width),
        out: View::dense(width),
    }
}

/// bf16 → f32 over `rows × width`.
fn to_f32(rows: usize, width: usize) -> Cast {
    Cast {
        from: DenseDtype::Bf16,
        to: DenseDtype::F32,
        ..to_bf16(rows, width)
    }
}
