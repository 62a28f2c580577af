//! The activation pool changes no result: a model whose idle buffers hold only `0xFF`
//! bytes (NaN as f32 and bf16, `-1` as i32) computes the same logits, bit for bit, as one
//! that allocates every activation anew (zero-filled).

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparsekit_host::{CpuBackend, IndexKDtype, KvDtype};

use super::Model;
use crate::engine::batch::{SeqChunk, StepBatch};
use crate::engine::config::ModelConfig;
use crate::engine::kv::{KvSpace, PagedKvSpace};

fn poisoned_pool_matches_fresh_buffers(cfg: ModelConfig) {
    // A fresh seed each run (weights and tokens), printed.
    let seed: u64 = rand::random();
    eprintln!("{}: seed {seed}", cfg.name);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let b = Arc::new(CpuBackend::new());
    let fresh = Model::new(b.clone(), cfg, seed)
        .unwrap()
        .with_activation_pool(0);
    let pooled = Model::new(b.clone(), cfg, seed).unwrap();
    let spec = fresh.cache_spec(KvDtype::Bf16, IndexKDtype::FP8).unwrap();
    let mut spaces = [
        PagedKvSpace::with_spec(&*b, spec, 64).unwrap(),
        PagedKvSpace::with_spec(&*b, spec, 64).unwrap(),
    ];
    // Four sequences: ragged prefill chunks (odd lengths, one past a page), then a
    // second chunk for two of them with decode tokens for the others.
    let steps: [[usize; 4]; 3] = [[37, 5, 70, 19], [1, 23, 1, 1], [1, 1, 1, 1]];
    let mut done = [0usize; 4];
    for (si, lens) in steps.iter().enumerate() {
        let toks: Vec<Vec<u32>> = lens
            .iter()
            .map(|&n| (0..n).map(|_| rng.gen_range(0..256)).collect())
            .collect();
        let mut logits = Vec::new();
        for (space, model) in spaces.iter_mut().zip([&fresh, &pooled]) {
            for (s, &n) in lens.iter().enumerate() {
                space.reserve(s as u64, done[s] + n).unwrap();
            }
            let chunks: Vec<SeqChunk<'_>> = toks
                .iter()
                .enumerate()
                .map(|(s, t)| SeqChunk {
                    seq: s as u64,
                    tokens: t,
                    start: done[s],
                    logits: true,
                })
                .collect();
            let batch = StepBatch::build(&chunks, cfg.page_size(), |s| space.pages(s)).unwrap();
            if std::ptr::eq(model, &pooled) {
                // Fill the pool with buffers of every length this step takes (the same
                // step again: it stores the same rows in the same slots), then poison them.
                model.forward(&batch, space).unwrap();
                assert!(model.acts.idle_counts().0 > 0, "the step left nothing idle");
                model.acts.poison(&*b).unwrap();
            }
            logits.push(model.forward(&batch, space).unwrap());
        }
        let (want, got) = (&logits[0], &logits[1]);
        assert!(want.logits.iter().all(|x| x.is_finite()), "step {si}");
        assert!(want.logits.iter().any(|&x| x != 0.0), "step {si}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&want.logits),
            bits(&got.logits),
            "{}: step {si}, seed {seed}",
            cfg.name
        );
        assert_eq!(want.argmax, got.argmax);
        for (d, n) in done.iter_mut().zip(lens) {
            *d += n;
        }
    }
}

#[test]
fn v32_poisoned_activation_pool_changes_no_logit() {
    poisoned_pool_matches_fresh_buffers(ModelConfig::TINY);
}

#[test]
fn v4_poisoned_activation_pool_changes_no_logit() {
    poisoned_pool_matches_fresh_buffers(ModelConfig::DSV4_TINY);
}
