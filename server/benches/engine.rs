//! The engine's forward pass on the cpu backend, for the DeepSeek-V3.2 (`tiny`) and
//! DeepSeek-V4 (`dsv4-tiny`) models: a prefill chunk of 256 tokens at contexts 256 and
//! 2048, and a decode step of 32 sequences at context 2048 (bf16 KV, fp8 index keys).
//! Throughput is reported per token (criterion's `elements`). Run with
//! `cargo bench -p sparsekit-server`.

#![allow(clippy::expect_used)] // a bench may panic on setup failure

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sparsekit_host::{CpuBackend, IndexKDtype, KvDtype};
use sparsekit_server::engine::{KvSpace, Model, ModelConfig, PagedKvSpace, SeqChunk, StepBatch};

fn setup(
    cfg: ModelConfig,
    seqs: usize,
    ctx: usize,
) -> (Model<CpuBackend>, PagedKvSpace<CpuBackend>) {
    let b = Arc::new(CpuBackend::new());
    let model = Model::new(b.clone(), cfg, 0).expect("model");
    let pages = seqs * ctx.div_ceil(cfg.page_size());
    let spec = model
        .cache_spec(KvDtype::Bf16, IndexKDtype::FP8)
        .expect("cache spec");
    let mut space = PagedKvSpace::with_spec(&*b, spec, pages).expect("space");
    for s in 0..seqs as u64 {
        space.reserve(s, ctx).expect("reserve");
    }
    (model, space)
}

fn bench(c: &mut Criterion) {
    bench_model(c, "engine_tiny", ModelConfig::TINY);
    bench_model(c, "engine_dsv4_tiny", ModelConfig::DSV4_TINY);
}

fn bench_model(c: &mut Criterion, group: &str, cfg: ModelConfig) {
    let mut g = c.benchmark_group(group);
    g.sample_size(10);
    for ctx in [256usize, 2048] {
        let (model, mut space) = setup(cfg, 1, ctx);
        let tokens: Vec<u32> = (0..256).map(|i| (i * 13 % 256) as u32).collect();
        let chunk = SeqChunk {
            seq: 0,
            tokens: &tokens,
            start: ctx - 256,
            logits: true,
        };
        let batch = StepBatch::build(&[chunk], cfg.page_size(), |s| space.pages(s)).expect("batch");
        g.throughput(Throughput::Elements(256));
        g.bench_function(BenchmarkId::new("prefill_chunk256", ctx), |b| {
            b.iter(|| model.forward(&batch, &mut space).expect("forward"))
        });
    }
    let (model, mut space) = setup(cfg, 32, 2048);
    let tokens = [7u32];
    let chunks: Vec<SeqChunk<'_>> = (0..32)
        .map(|s| SeqChunk {
            seq: s,
            tokens: &tokens,
            start: 2047,
            logits: true,
        })
        .collect();
    let batch = StepBatch::build(&chunks, cfg.page_size(), |s| space.pages(s)).expect("batch");
    g.throughput(Throughput::Elements(32));
    g.bench_function(BenchmarkId::new("decode_batch32", 2048), |b| {
        b.iter(|| model.forward(&batch, &mut space).expect("forward"))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
