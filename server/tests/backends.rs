//! The engine on other backends and configs: on `emu` (the GPU kernels of the DSA ops,
//! emulated) the determinism oracle holds too and the logits agree with `cpu` within
//! bf16-level error; the `dsv32` config (DeepSeek-V3.2 per-layer dims, 128 query heads,
//! top-k 2048) runs a forward pass end to end.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::sync::Arc;
use std::time::Duration;

use sparsekit_host::{Backend, CpuBackend, EmuBackend, ModelOps};
use sparsekit_server::engine::{
    Completion, Engine, EngineOptions, GenerateRequest, ModelConfig, SamplingParams,
};
use sparsekit_server::metrics::Metrics;

const WAIT: Duration = Duration::from_secs(300);

fn run<B: Backend + ModelOps + 'static>(
    b: B,
    cfg: ModelConfig,
    opts: EngineOptions,
    reqs: &[GenerateRequest],
    together: bool,
) -> Vec<Completion> {
    let e = Engine::start(Arc::new(b), cfg, opts, Arc::new(Metrics::new("both"))).unwrap();
    if together {
        let hs: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
        hs.into_iter().map(|h| h.wait(WAIT).unwrap()).collect()
    } else {
        reqs.iter()
            .map(|r| e.submit(r.clone()).unwrap().wait(WAIT).unwrap())
            .collect()
    }
}

fn reqs(lens: &[usize], new: usize) -> Vec<GenerateRequest> {
    lens.iter()
        .enumerate()
        .map(|(i, &n)| GenerateRequest {
            id: None,
            received: None,
            prompt: (0..n).map(|j| ((j * 31 + i * 7) % 256) as u32).collect(),
            sampling: SamplingParams {
                max_new_tokens: new,
                ignore_eos: true,
                ..Default::default()
            },
        })
        .collect()
}

#[test]
fn emu_is_deterministic_and_agrees_with_cpu() {
    // A top-k of 8 so selection matters at these short lengths.
    let cfg = ModelConfig::TINY
        .with_index_topk(8)
        .unwrap()
        .with_layers(1)
        .unwrap();
    emu_oracle_and_cpu_agreement(cfg);
}

/// The same for DeepSeek-V4's model: the window, CSA and HCA layers, the compressor's
/// `gated_pool`, `sparse_mla_v4` with sinks and the fp4-free V4 layouts, on the GPU
/// kernels (emulated).
#[test]
fn v4_emu_is_deterministic_and_agrees_with_cpu() {
    emu_oracle_and_cpu_agreement(ModelConfig::DSV4_TINY);
}

fn emu_oracle_and_cpu_agreement(cfg: ModelConfig) {
    let opts = EngineOptions {
        kv_pages: 16,
        prefill_chunk: 5,
        max_batch_tokens: 12,
        min_prefill_tokens: 4,
        ..Default::default()
    };
    let rs = reqs(&[11, 19, 6], 3);
    let alone = run(
        EmuBackend::new(),
        cfg,
        EngineOptions {
            prefill_chunk: 64,
            max_batch_tokens: 64,
            ..opts.clone()
        },
        &rs,
        false,
    );
    let together = run(EmuBackend::new(), cfg, opts.clone(), &rs, true);
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(
            a.digests, t.digests,
            "emu: batched/chunked logits differ from alone"
        );
        assert_eq!(a.tokens, t.tokens);
    }
    // cpu and emu compute the DSA ops with different reduction orders: not bit-identical,
    // but the same model: logits agree to bf16-level error.
    let (lc, le) = (
        logits(CpuBackend::new(), cfg),
        logits(EmuBackend::new(), cfg),
    );
    let scale = lc.iter().map(|x| x.abs()).fold(0f32, f32::max);
    let err = lc
        .iter()
        .zip(&le)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("cpu vs emu logits: max error {err:e}, max magnitude {scale}");
    assert!(scale > 0.1, "degenerate logits");
    assert!(
        err <= 0.005 * scale,
        "cpu vs emu logits: max error {err}, scale {scale}"
    );
    assert!(lc.iter().chain(&le).all(|x| x.is_finite()));
}

/// Logits of one 19-token prefill chunk (all rows' last token) on a backend.
fn logits<B: Backend + ModelOps>(b: B, cfg: ModelConfig) -> Vec<f32> {
    use sparsekit_host::{IndexKDtype, KvDtype};
    use sparsekit_server::engine::{KvSpace, Model, PagedKvSpace, SeqChunk, StepBatch};
    let b = Arc::new(b);
    let model = Model::new(b.clone(), cfg, 0).unwrap();
    let spec = model.cache_spec(KvDtype::Bf16, IndexKDtype::Bf16).unwrap();
    let mut space = PagedKvSpace::with_spec(&*b, spec, 4).unwrap();
    space.reserve(1, 19).unwrap();
    let tokens: Vec<u32> = (0..19).map(|j| (j * 37 % 256) as u32).collect();
    let chunk = SeqChunk {
        seq: 1,
        tokens: &tokens,
        start: 0,
        logits: true,
    };
    let batch = StepBatch::build(&[chunk], cfg.page_size(), |s| space.pages(s)).unwrap();
    model.forward(&batch, &mut space).unwrap().logits
}

/// `dsv4` (DeepSeek-V4-Flash's attention dims: 64 heads of 512, indexer 64×128 with top-k
/// 512, window 128, pages of 256 raw tokens) with its first three layers (window, window,
/// CSA) runs end to end.
#[test]
fn dsv4_forward_runs() {
    let cfg = ModelConfig::DSV4.with_layers(3).unwrap();
    assert_eq!(cfg.d_qk(), 512);
    assert_eq!(cfg.softmax_scale(), 1.0 / 512f32.sqrt());
    let opts = EngineOptions {
        kv_pages: 4,
        ..Default::default()
    };
    let rs = reqs(&[70, 9], 2);
    let a = run(CpuBackend::new(), cfg, opts.clone(), &rs, true);
    for c in &a {
        assert_eq!(c.tokens.len(), 2);
        assert!(c.digests.iter().all(|&d| d != 0));
    }
    assert_ne!(a[0].digests, a[1].digests);
}

#[test]
fn dsv32_forward_runs() {
    let cfg = ModelConfig::DSV32.with_layers(1).unwrap();
    assert_eq!(cfg.d_qk(), 576);
    assert_eq!(cfg.q_head_dim(), 192);
    let opts = EngineOptions {
        kv_pages: 4,
        ..Default::default()
    };
    let rs = reqs(&[70, 9], 2);
    let a = run(CpuBackend::new(), cfg, opts.clone(), &rs, true);
    for c in &a {
        assert_eq!(c.tokens.len(), 2);
        assert!(c.digests.iter().all(|&d| d != 0));
    }
    assert_ne!(a[0].digests, a[1].digests);
}
