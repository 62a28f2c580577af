//! Sampling: greedy, or temperature with optional top-k / top-p, driven by a
//! counter-based generator keyed by (request seed, position) — no state carried between
//! steps, so a token's draw is the same whatever batch, chunking or replay produced its
//! logits.

use serde::Serialize;

use crate::engine::tokenizer::{is_generable, VOCAB_SIZE};
use crate::engine::weights::splitmix64;
use crate::error::EngineError;

/// Upper bound on `max_new_tokens` accepted at all (the context limit applies too).
pub const MAX_NEW_TOKENS_LIMIT: usize = 1 << 20;

/// How a request samples and when it stops.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SamplingParams {
    /// Tokens to generate at most (≥ 1).
    pub max_new_tokens: usize,
    /// 0 = greedy; otherwise softmax temperature (finite, ≤ 100).
    pub temperature: f32,
    /// Nucleus mass in `(0, 1]` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Key of the counter-based generator.
    pub seed: u64,
    /// Stop strings (generation ends before the first match; it is not returned).
    pub stop: Vec<String>,
    /// Token ids that end generation (the token is not part of the text).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-turn.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_new_tokens: 16,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    /// Greedy with a token budget.
    pub fn greedy(max_new_tokens: usize) -> Self {
        SamplingParams {
            max_new_tokens,
            ..Default::default()
        }
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if self.max_new_tokens == 0 || self.max_new_tokens > MAX_NEW_TOKENS_LIMIT {
            return bad(format!(
                "max_new_tokens must be in 1..={MAX_NEW_TOKENS_LIMIT}, got {}",
                self.max_new_tokens
            ));
        }
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return bad(format!(
                "temperature must be in [0, 100], got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.stop.len() > 16 || self.stop.iter().any(|s| s.len() > 256) {
            return bad("at most 16 stop strings of at most 256 bytes".into());
        }
        if let Some(t) = self
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= VOCAB_SIZE)
        {
            return bad(format!("stop token id {t} is outside the vocabulary"));
        }
        Ok(())
    }
}

/// The uniform draw in `[0, 1)` for the token at `position` of a request seeded `seed`
/// (53 random bits of `splitmix64(splitmix64(seed) ⊕ splitmix64(position))`).
pub fn uniform(seed: u64, position: u64) -> f64 {
    let x = splitmix64(splitmix64(seed) ^ splitmix64(position.wrapping_add(0x5bd1_e995)));
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Picks the next token from a logits row (`vocab` entries) for the token at `position`.
/// Only generable tokens (bytes, end-of-turn) compete. A NaN or +inf among them is an
/// error: corrupted logits never turn into a plausible token.
pub fn sample(logits: &[f32], p: &SamplingParams, position: u64) -> Result<u32, EngineError> {
    let cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(t, _)| is_generable(*t as u32))
        .map(|(t, &l)| (t as u32, l))
        .collect();
    if let Some((t, l)) = cand.iter().find(|(_, l)| l.is_nan() || *l == f32::INFINITY) {
        return Err(EngineError::StepFailed(format!(
            "non-finite logit {l} for token {t} at position {position}"
        )));
    }
    let Some(&(first, first_l)) = cand.first() else {
        return Err(EngineError::StepFailed("empty vocabulary".into()));
    };
    // Greedy: highest logit, lowest id on ties.
    let (best, best_l) = cand.iter().fold(
        (first, first_l),
        |(bt, bl), &(t, l)| if l > bl { (t, l) } else { (bt, bl) },
    );
    if p.temperature == 0.0 || best_l == f32::NEG_INFINITY {
        return Ok(best);
    }
    // Probabilities in f64, most likely first (ties: lower id first).
    let inv_t = 1.0 / p.temperature as f64;
    let mut probs: Vec<(u32, f64)> = cand
        .iter()
        .map(|&(t, l)| (t, ((l as f64 - best_l as f64) * inv_t).exp()))
        .collect();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 && p.top_k < probs.len() {
        probs.truncate(p.top_k);
    }
    let total: f64 = probs.iter().map(|x| x.1).sum();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, x) in probs.iter().enumerate() {
            acc += x.1 / total;
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let total: f64 = probs.iter().map(|x| x.1).sum();
    let target = uniform(p.seed, position) * total;
    let mut acc = 0.0;
    for &(t, w) in &probs {
        acc += w;
        if target < acc {
            return Ok(t);
        }
    }
    Ok(probs.last().map_or(best, |x| x.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::tokenizer::{END, USER};

    fn logits() -> Vec<f32> {
        (0..VOCAB_SIZE)
            .map(|i| ((i * 37) % 101) as f32 / 10.0)
            .collect()
    }

    #[test]
    fn greedy_picks_the_first_max_among_generable() {
        let mut l = logits();
        l[USER as usize] = 1e9; // masked
        l[65] = 50.0;
        l[66] = 50.0;
        assert_eq!(sample(&l, &SamplingParams::greedy(1), 0).ok(), Some(65));
        l[END as usize] = 60.0;
        assert_eq!(sample(&l, &SamplingParams::greedy(1), 0).ok(), Some(END));
        l[3] = f32::NAN;
        assert!(sample(&l, &SamplingParams::greedy(1), 0).is_err());
    }

    #[test]
    fn temperature_sampling_is_keyed_by_seed_and_position() {
        let l = logits();
        let p = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..SamplingParams::greedy(1)
        };
        let draws: Vec<u32> = (0..200)
            .map(|pos| sample(&l, &p, pos).unwrap_or(0))
            .collect();
        let again: Vec<u32> = (0..200)
            .map(|pos| sample(&l, &p, pos).unwrap_or(0))
            .collect();
        assert_eq!(draws, again);
        let distinct: std::collections::HashSet<_> = draws.iter().collect();
        assert!(
            distinct.len() > 20,
            "temperature 1 should spread: {}",
            distinct.len()
        );
        let other = SamplingParams {
            seed: 43,
            ..p.clone()
        };
        let d2: Vec<u32> = (0..200)
            .map(|pos| sample(&l, &other, pos).unwrap_or(0))
            .collect();
        assert_ne!(draws, d2);
        // top_k = 1 is greedy.
        let k1 = SamplingParams {
            top_k: 1,
            ..p.clone()
        };
        let g = sample(&l, &SamplingParams::greedy(1), 0).unwrap_or(0);
        assert!((0..50).all(|pos| sample(&l, &k1, pos).ok() == Some(g)));
        // A tiny top_p keeps only the most likely token.
        let p1 = SamplingParams { top_p: 1e-6, ..p };
        assert!((0..50).all(|pos| sample(&l, &p1, pos).ok() == Some(g)));
    }

    #[test]
    fn uniform_is_in_range_and_spread() {
        let xs: Vec<f64> = (0..10_000).map(|i| uniform(7, i)).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }

    #[test]
    fn validation() {
        let ok = SamplingParams::greedy(4);
        assert!(ok.validate().is_ok());
        for bad in [
            SamplingParams {
                max_new_tokens: 0,
                ..ok.clone()
            },
            SamplingParams {
                temperature: -1.0,
                ..ok.clone()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..ok.clone()
            },
            SamplingParams {
                top_p: 0.0,
                ..ok.clone()
            },
            SamplingParams {
                stop_token_ids: vec![9999],
                ..ok.clone()
            },
        ] {
            assert!(matches!(
                bad.validate(),
                Err(EngineError::InvalidRequest(_))
            ));
        }
    }
}
