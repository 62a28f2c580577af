//! Seeded synthetic weights. A weight tensor is a pure function of (seed, config name,
//! tensor name): it is generated in chunks of [`CHUNK`] elements, each from its own
//! ChaCha8 stream keyed by those three and the chunk index, so neither the generation
//! order nor the thread count changes a value. Values are uniform in `±scale` (unit
//! output variance for projections), rounded to bf16 precision so a GPU path with bf16
//! weights would read the same numbers.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use sparsekit_host::model_ops::{inverse_rope_table, rope_table};
use sparsekit_host::{Backend, V4Dims};

use crate::engine::config::ModelConfig;
use crate::error::EngineError;

/// Elements per independently seeded chunk.
pub const CHUNK: usize = 1 << 16;

/// 64-bit FNV-1a of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The splitmix64 finaliser: a bijective mix of 64 bits.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The values of tensor `tensor` of config `config` under `seed`: `n` values uniform in
/// `[-scale, scale)` plus `offset`, rounded to bf16 precision.
///
/// A pure function, so the process keeps what it generated (up to [`MEMO_BYTES`] in all)
/// and hands out copies: the harness builds an engine of the same model for every
/// configuration and round, and the generator was a few per cent of its time.
pub fn synth(seed: u64, config: &str, tensor: &str, n: usize, scale: f32, offset: f32) -> Vec<f32> {
    let id = (
        seed,
        format!("{config}/{tensor}"),
        n,
        scale.to_bits(),
        offset.to_bits(),
    );
    let memo = MEMO.get_or_init(Default::default);
    // A poisoned lock only means another thread panicked while holding it: the map is
    // still whole (every insert is one call).
    let lock = || {
        memo.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    if let Some(v) = lock().values.get(&id) {
        return v.to_vec();
    }
    let v = generate(seed, &id.1, n, scale, offset);
    let mut m = lock();
    let bytes = 4 * n;
    if m.bytes + bytes <= MEMO_BYTES && !m.values.contains_key(&id) {
        m.bytes += bytes;
        m.values.insert(id, v.as_slice().into());
    }
    v
}

/// The most bytes of tensors [`synth`] keeps for later calls (larger models are generated
/// again each time).
pub const MEMO_BYTES: usize = 256 << 20;

/// (seed, "config/tensor", n, scale bits, offset bits).
type TensorId = (u64, String, usize, u32, u32);

/// [`synth`]'s kept tensors.
#[derive(Default)]
struct Memo {
    values: HashMap<TensorId, Box<[f32]>>,
    bytes: usize,
}

static MEMO: OnceLock<Mutex<Memo>> = OnceLock::new();

/// [`synth`]'s generator: `name` is `"config/tensor"`.
fn generate(seed: u64, name: &str, n: usize, scale: f32, offset: f32) -> Vec<f32> {
    let key = splitmix64(seed ^ splitmix64(fnv1a(name.as_bytes())));
    let mut v = vec![0f32; n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let mut rng = ChaCha8Rng::seed_from_u64(splitmix64(key ^ splitmix64(c as u64)));
        for x in out {
            let u: f32 = rng.gen_range(-1.0f32..1.0);
            *x = bf16::from_f32(u * scale + offset).to_f32();
        }
    });
    v
}

/// One decoder layer's weights on a backend. Matrices are row-major `[in, out]`;
/// per-head matrices are `[heads, in, out]`.
#[derive(Debug)]
pub struct LayerWeights<Buf> {
    /// RMSNorm gamma before attention, `[hidden]`.
    pub attn_norm: Buf,
    /// Query down-projection `[hidden, q_lora]`.
    pub wq_a: Buf,
    /// RMSNorm gamma of the query latent `[q_lora]`.
    pub q_norm: Buf,
    /// Query up-projection `[q_lora, heads · (nope + rope)]`.
    pub wq_b: Buf,
    /// Per-head NoPE query → latent (the absorbed key up-projection) `[heads, nope, kv_lora]`.
    pub w_uk: Buf,
    /// Latent KV down-projection `[hidden, kv_lora + rope]`.
    pub wkv_a: Buf,
    /// RMSNorm gamma of the latent `[kv_lora]`.
    pub kv_norm: Buf,
    /// Indexer query projection from the query latent `[q_lora, index_heads · index_dim]`.
    pub wq_index: Buf,
    /// Indexer key projection `[hidden, index_dim]`.
    pub wk_index: Buf,
    /// RMSNorm gamma of the indexer key `[index_dim]`.
    pub k_norm_index: Buf,
    /// Indexer head weights `[hidden, index_heads]`, with `heads^-1/2 · dim^-1/2` folded in.
    pub w_index_heads: Buf,
    /// Per-head latent → value up-projection `[heads, kv_lora, v_head]`.
    pub w_uv: Buf,
    /// Output projection `[heads · v_head, hidden]`.
    pub wo: Buf,
    pub mlp: MlpWeights<Buf>,
}

/// A layer's MLP (the same in V3.2 and V4 layers): `h += swiglu(rms_norm(h)·W_gate_up)·W_down`.
#[derive(Debug)]
pub struct MlpWeights<Buf> {
    /// RMSNorm gamma before the MLP `[hidden]`.
    pub norm: Buf,
    /// Gate and up projections side by side `[hidden, 2 · intermediate]`.
    pub gate_up: Buf,
    /// Down projection `[intermediate, hidden]`.
    pub down: Buf,
}

impl<Buf> MlpWeights<Buf> {
    /// Layer `l`'s MLP of `cfg` under `seed`.
    fn generate<B: Backend<Buffer = Buf>>(
        backend: &B,
        cfg: &ModelConfig,
        seed: u64,
        l: usize,
    ) -> Result<Self, EngineError> {
        let up = |v: Vec<f32>| backend.upload(bytemuck::cast_slice(&v));
        let t = |s: &str| format!("layers.{l}.{s}");
        let (d, i) = (cfg.hidden, cfg.intermediate);
        Ok(MlpWeights {
            norm: up(gamma(seed, cfg, &t("mlp_norm"), d))?,
            gate_up: up(linear(seed, cfg, &t("w_gate_up"), d, d * 2 * i))?,
            down: up(linear(seed, cfg, &t("w_down"), i, i * d))?,
        })
    }
}

/// The compressor of a V4 layer's compressed entries: softmax-gated pooling of a window of
/// state rows with a position bias, then RMSNorm of the NoPE part (rope follows at the
/// entry's position).
#[derive(Debug)]
pub struct Compressor<Buf> {
    /// Position bias `[span, width]` (f32).
    pub bias: Buf,
    /// RMSNorm gamma of the pooled row's normalised part (`[448]` for KV, `[index_dim]`
    /// for index keys).
    pub norm: Buf,
}

/// The indexer of a V4 CSA layer: queries from the query latent, head weights from the
/// hidden state, keys from its own compressor.
#[derive(Debug)]
pub struct V4Indexer<Buf> {
    /// `[q_lora, index_heads · index_dim]`.
    pub wq: Buf,
    /// `[hidden, index_heads]`, with `heads^-1/2 · dim^-1/2` folded in.
    pub heads: Buf,
    pub compressor: Compressor<Buf>,
}

/// One DeepSeek-V4 decoder layer's weights (`row` = 512, K = V).
#[derive(Debug)]
pub struct V4LayerWeights<Buf> {
    /// Compression ratio (0: window only).
    pub ratio: usize,
    /// RMSNorm gamma before attention `[hidden]`.
    pub attn_norm: Buf,
    /// `[hidden, q_lora]`.
    pub wq_a: Buf,
    /// `[q_lora]`.
    pub q_norm: Buf,
    /// `[q_lora, heads · row]`.
    pub wq_b: Buf,
    /// Per-head query RMSNorm gamma `[row]` (shared by the heads).
    pub q_head_norm: Buf,
    /// KV projection `[hidden, row]` (448 NoPE, normalised, then 64 rope).
    pub wkv: Buf,
    /// `[448]`.
    pub kv_norm: Buf,
    /// Per-head attention sink logits `[heads]` (host: the kernel takes them by value).
    pub sink: Vec<f32>,
    /// Output projection `[heads · row, hidden]`.
    pub wo: Buf,
    /// Compressed layers: the state projection `[hidden, state_width]`, the KV
    /// compressor, and (CSA) the indexer.
    pub w_state: Option<Buf>,
    pub kv_compressor: Option<Compressor<Buf>>,
    pub indexer: Option<V4Indexer<Buf>>,
    pub mlp: MlpWeights<Buf>,
}

/// All weights of the model on a backend.
#[derive(Debug)]
pub struct Weights<Buf> {
    /// `[vocab, hidden]`.
    pub embed: Buf,
    /// V3.2 layers (empty for a V4 config).
    pub layers: Vec<LayerWeights<Buf>>,
    /// V4 layers (empty for a V3.2 config).
    pub v4_layers: Vec<V4LayerWeights<Buf>>,
    /// `[hidden]`.
    pub final_norm: Buf,
    /// `[hidden, vocab]`.
    pub lm_head: Buf,
    /// Rope cos/sin table `[max_context, rope_dim / 2, 2]` (attention and indexer share it).
    pub rope: Buf,
    /// V4: the inverse rotation's table (the attention output's rope dims), same shape.
    pub inverse_rope: Option<Buf>,
}

fn linear(seed: u64, cfg: &ModelConfig, name: &str, fan_in: usize, n: usize) -> Vec<f32> {
    synth(seed, cfg.name, name, n, (3.0 / fan_in as f32).sqrt(), 0.0)
}

fn gamma(seed: u64, cfg: &ModelConfig, name: &str, n: usize) -> Vec<f32> {
    synth(seed, cfg.name, name, n, 0.1, 1.0)
}

impl<Buf> Weights<Buf> {
    /// Generates every weight of `cfg` under `seed` and uploads it to `backend`.
    pub fn generate<B: Backend<Buffer = Buf>>(
        backend: &B,
        cfg: &ModelConfig,
        seed: u64,
    ) -> Result<Self, EngineError> {
        cfg.validate()?;
        let up = |v: Vec<f32>| backend.upload(bytemuck::cast_slice(&v));
        let (d, r, h) = (cfg.hidden, cfg.q_lora_rank, cfg.n_heads);
        let (lat, rope) = (cfg.kv_lora_rank(), cfg.rope_dim());
        let (ih, id) = (cfg.index_heads(), cfg.index_head_dim());
        let mut layers = Vec::with_capacity(cfg.n_layers);
        let mut v4_layers = Vec::new();
        for l in (0..cfg.n_layers).filter(|_| cfg.v4.is_some()) {
            v4_layers.push(V4LayerWeights::generate(backend, cfg, seed, l)?);
        }
        for l in (0..cfg.n_layers).filter(|_| cfg.v4.is_none()) {
            let t = |s: &str| format!("layers.{l}.{s}");
            let fold = (1.0 / ((ih * id) as f64).sqrt()) as f32;
            let heads_w: Vec<f32> = linear(seed, cfg, &t("index.heads"), d, d * ih)
                .into_iter()
                .map(|x| x * fold)
                .collect();
            layers.push(LayerWeights {
                attn_norm: up(gamma(seed, cfg, &t("attn_norm"), d))?,
                wq_a: up(linear(seed, cfg, &t("wq_a"), d, d * r))?,
                q_norm: up(gamma(seed, cfg, &t("q_norm"), r))?,
                wq_b: up(linear(seed, cfg, &t("wq_b"), r, r * h * cfg.q_head_dim()))?,
                w_uk: up(linear(
                    seed,
                    cfg,
                    &t("w_uk"),
                    cfg.qk_nope_head_dim,
                    h * cfg.qk_nope_head_dim * lat,
                ))?,
                wkv_a: up(linear(seed, cfg, &t("wkv_a"), d, d * (lat + rope)))?,
                kv_norm: up(gamma(seed, cfg, &t("kv_norm"), lat))?,
                wq_index: up(linear(seed, cfg, &t("index.wq"), r, r * ih * id))?,
                wk_index: up(linear(seed, cfg, &t("index.wk"), d, d * id))?,
                k_norm_index: up(gamma(seed, cfg, &t("index.k_norm"), id))?,
                w_index_heads: up(heads_w)?,
                w_uv: up(linear(seed, cfg, &t("w_uv"), lat, h * lat * cfg.v_head_dim))?,
                wo: up(linear(
                    seed,
                    cfg,
                    &t("wo"),
                    h * cfg.v_head_dim,
                    h * cfg.v_head_dim * d,
                ))?,
                mlp: MlpWeights::generate(backend, cfg, seed, l)?,
            });
        }
        let vocab = cfg.vocab();
        let inverse_rope = match cfg.v4 {
            Some(_) => Some(up(inverse_rope_table(
                rope,
                cfg.max_context,
                cfg.rope_theta,
            ))?),
            None => None,
        };
        Ok(Weights {
            embed: up(synth(seed, cfg.name, "embed", vocab * d, 1.0, 0.0))?,
            layers,
            v4_layers,
            final_norm: up(gamma(seed, cfg, "final_norm", d))?,
            lm_head: up(linear(seed, cfg, "lm_head", d, d * vocab))?,
            rope: up(rope_table(rope, cfg.max_context, cfg.rope_theta))?,
            inverse_rope,
        })
    }
}

impl<Buf> V4LayerWeights<Buf> {
    /// Layer `l` of V4 config `cfg` under `seed`.
    fn generate<B: Backend<Buffer = Buf>>(
        backend: &B,
        cfg: &ModelConfig,
        seed: u64,
        l: usize,
    ) -> Result<Self, EngineError> {
        let v = cfg.v4.ok_or_else(|| {
            EngineError::InvalidConfig(format!("{} has no V4 attention", cfg.name))
        })?;
        let up = |v: Vec<f32>| backend.upload(bytemuck::cast_slice(&v));
        let t = |s: &str| format!("layers.{l}.{s}");
        let (d, r, h, row) = (cfg.hidden, cfg.q_lora_rank, cfg.n_heads, V4Dims::D);
        let (ih, id) = (cfg.index_heads(), cfg.index_head_dim());
        let nope = row - cfg.rope_dim();
        let ratio = v.ratio(l);
        let span = v.span(ratio);
        // Position biases of order one: the gates differ by position as well as by token.
        let bias =
            |name: &str, width: usize| synth(seed, cfg.name, &t(name), span * width, 1.0, 0.0);
        let (w_state, kv_compressor, indexer) = if ratio == 0 {
            (None, None, None)
        } else {
            let state = cfg.v4_state_width();
            let indexer = if ratio == v.dims.csa_ratio {
                let fold = (1.0 / ((ih * id) as f64).sqrt()) as f32;
                let heads: Vec<f32> = linear(seed, cfg, &t("index.heads"), d, d * ih)
                    .into_iter()
                    .map(|x| x * fold)
                    .collect();
                Some(V4Indexer {
                    wq: up(linear(seed, cfg, &t("index.wq"), r, r * ih * id))?,
                    heads: up(heads)?,
                    compressor: Compressor {
                        bias: up(bias("index.compressor.bias", id))?,
                        norm: up(gamma(seed, cfg, &t("index.compressor.norm"), id))?,
                    },
                })
            } else {
                None
            };
            (
                Some(up(linear(seed, cfg, &t("w_state"), d, d * state))?),
                Some(Compressor {
                    bias: up(bias("compressor.bias", row))?,
                    norm: up(gamma(seed, cfg, &t("compressor.norm"), nope))?,
                }),
                indexer,
            )
        };
        Ok(V4LayerWeights {
            ratio,
            attn_norm: up(gamma(seed, cfg, &t("attn_norm"), d))?,
            wq_a: up(linear(seed, cfg, &t("wq_a"), d, d * r))?,
            q_norm: up(gamma(seed, cfg, &t("q_norm"), r))?,
            wq_b: up(linear(seed, cfg, &t("wq_b"), r, r * h * row))?,
            q_head_norm: up(gamma(seed, cfg, &t("q_head_norm"), row))?,
            wkv: up(linear(seed, cfg, &t("wkv"), d, d * row))?,
            kv_norm: up(gamma(seed, cfg, &t("kv_norm"), nope))?,
            // Sinks around the typical logsumexp, so they change the output measurably.
            sink: synth(seed, cfg.name, &t("sink"), h, 2.0, 1.0),
            wo: up(linear(seed, cfg, &t("wo"), h * row, h * row * d))?,
            w_state,
            kv_compressor,
            indexer,
            mlp: MlpWeights::generate(backend, cfg, seed, l)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synth_is_a_function_of_seed_config_and_name() {
        let a = synth(7, "tiny", "w", CHUNK + 100, 0.5, 0.0);
        // The second call is served from the memo: the generator's values.
        assert_eq!(a, synth(7, "tiny", "w", CHUNK + 100, 0.5, 0.0));
        assert_eq!(a, generate(7, "tiny/w", CHUNK + 100, 0.5, 0.0));
        // A prefix is the same tensor's prefix (chunks are independent of length).
        assert_eq!(a[..50], synth(7, "tiny", "w", 50, 0.5, 0.0)[..]);
        assert_ne!(a, synth(8, "tiny", "w", CHUNK + 100, 0.5, 0.0));
        assert_ne!(a, synth(7, "dsv32", "w", CHUNK + 100, 0.5, 0.0));
        assert_ne!(a, synth(7, "tiny", "v", CHUNK + 100, 0.5, 0.0));
        assert!(a
            .iter()
            .all(|x| x.abs() <= 0.5 && *x == bf16::from_f32(*x).to_f32()));
        // Not degenerate.
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64;
        assert!(
            mean.abs() < 0.01 && (var - 0.25 / 3.0).abs() < 0.005,
            "{mean} {var}"
        );
    }
}
