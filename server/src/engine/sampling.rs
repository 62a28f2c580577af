//! Sampling: greedy, or temperature with optional top-k / top-p, driven by a
//! counter-based generator keyed by (request seed, position) — no state carried between
//! steps, so a token's draw is the same whatever batch, chunking or replay produced its
//! logits.
//!
//! Before the draw, a request may adjust the logits (repetition, presence and frequency
//! penalties, a logit bias) and restrict the candidates (no end of turn or stop token
//! before `min_new_tokens`, unless nothing else may follow; only bytes that continue a
//! JSON object under `response_format: json_object`). A request that uses none of these
//! samples from the model's logits untouched: the same bits as before these options
//! existed.

use serde::Serialize;

use crate::engine::json_object::JsonObjectState;
use crate::engine::tokenizer::{is_generable, END, VOCAB_SIZE};
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
    /// Tokens generated before end-of-turn or a stop token may be (0 = no minimum).
    pub min_new_tokens: usize,
    /// Added to a token's logit (token id, bias in `[-100, 100]`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Divides the positive logits (multiplies the negative ones) of every token already
    /// in the sequence, prompt included (1 = off; in `(0, 10]`).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated (`[-2, 2]`).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit per time it was generated (`[-2, 2]`).
    pub frequency_penalty: f32,
    /// Constrain the reply to one JSON object (`response_format: json_object`).
    pub json_object: bool,
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
            min_new_tokens: 0,
            logit_bias: Vec::new(),
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            json_object: false,
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
        self.check()
            .map_err(|e| EngineError::InvalidRequest(e.message))
    }

    /// Checks every field's range; the error names the field.
    pub fn check(&self) -> Result<(), InvalidField> {
        let bad = |field: &'static str, message: String| Err(InvalidField { field, message });
        if self.max_new_tokens == 0 || self.max_new_tokens > MAX_NEW_TOKENS_LIMIT {
            return bad(
                "max_new_tokens",
                format!(
                    "max_new_tokens must be in 1..={MAX_NEW_TOKENS_LIMIT}, got {}",
                    self.max_new_tokens
                ),
            );
        }
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return bad(
                "temperature",
                format!("temperature must be in [0, 100], got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(
                "top_p",
                format!("top_p must be in (0, 1], got {}", self.top_p),
            );
        }
        if self.stop.len() > 16 || self.stop.iter().any(|s| s.len() > 256) {
            return bad(
                "stop",
                "at most 16 stop strings of at most 256 bytes".into(),
            );
        }
        if let Some(t) = self
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= VOCAB_SIZE)
        {
            return bad(
                "stop_token_ids",
                format!("stop token id {t} is outside the vocabulary"),
            );
        }
        if self.min_new_tokens > self.max_new_tokens {
            return bad(
                "min_new_tokens",
                format!(
                    "min_new_tokens ({}) exceeds max_new_tokens ({})",
                    self.min_new_tokens, self.max_new_tokens
                ),
            );
        }
        if self.logit_bias.len() > 300 {
            return bad("logit_bias", "at most 300 logit_bias entries".into());
        }
        for &(t, b) in &self.logit_bias {
            if t as usize >= VOCAB_SIZE {
                return bad(
                    "logit_bias",
                    format!("logit_bias token id {t} is outside the vocabulary"),
                );
            }
            if !(b.is_finite() && (-100.0..=100.0).contains(&b)) {
                return bad(
                    "logit_bias",
                    format!("logit_bias for token {t} must be in [-100, 100], got {b}"),
                );
            }
        }
        if !(self.repetition_penalty.is_finite()
            && self.repetition_penalty > 0.0
            && self.repetition_penalty <= 10.0)
        {
            return bad(
                "repetition_penalty",
                format!(
                    "repetition_penalty must be in (0, 10], got {}",
                    self.repetition_penalty
                ),
            );
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return bad(name, format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }

    /// Whether any option changes the logits before the draw.
    fn adjusts_logits(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// The logits after the penalties and the bias, for a sequence of `tokens` whose
    /// first `prompt_len` are the prompt.
    fn adjust(&self, logits: &[f32], tokens: &[u32], prompt_len: usize) -> Vec<f32> {
        let mut l = logits.to_vec();
        if self.repetition_penalty != 1.0 {
            let mut seen = vec![false; l.len()];
            for &t in tokens {
                if let Some(s) = seen.get_mut(t as usize) {
                    *s = true;
                }
            }
            for (x, _) in l.iter_mut().zip(&seen).filter(|(_, s)| **s) {
                *x = if *x > 0.0 {
                    *x / self.repetition_penalty
                } else {
                    *x * self.repetition_penalty
                };
            }
        }
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            let mut count = vec![0u32; l.len()];
            for &t in tokens.get(prompt_len..).unwrap_or_default() {
                if let Some(c) = count.get_mut(t as usize) {
                    *c += 1;
                }
            }
            for (x, &c) in l.iter_mut().zip(&count).filter(|(_, c)| **c > 0) {
                *x -= self.frequency_penalty * c as f32 + self.presence_penalty;
            }
        }
        for &(t, b) in &self.logit_bias {
            if let Some(x) = l.get_mut(t as usize) {
                *x += b;
            }
        }
        l
    }
}

/// A field of [`SamplingParams`] out of its range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidField {
    /// The field's name in [`SamplingParams`].
    pub field: &'static str,
    pub message: String,
}

/// What a draw knows of its sequence beyond the logits.
#[derive(Clone, Copy, Debug, Default)]
pub struct SeqView<'a> {
    /// The sequence so far (prompt, then generated tokens).
    pub tokens: &'a [u32],
    pub prompt_len: usize,
    /// The JSON object recogniser of a `json_object` request.
    pub json: Option<&'a JsonObjectState>,
}

impl SeqView<'_> {
    fn generated(&self) -> usize {
        self.tokens.len().saturating_sub(self.prompt_len)
    }

    /// Whether `token` may be drawn now (the JSON object, and `min_new_tokens` when
    /// `with_min`).
    fn allows(&self, token: u32, p: &SamplingParams, with_min: bool) -> bool {
        let stop = token == END || p.stop_token_ids.contains(&token);
        if with_min && stop && self.generated() < p.min_new_tokens {
            return false;
        }
        match self.json {
            None => true,
            Some(j) if token == END => j.is_complete(),
            Some(j) => token < 256 && j.allows(token as u8),
        }
    }
}

/// The uniform draw in `[0, 1)` for the token at `position` of a request seeded `seed`
/// (53 random bits of `splitmix64(splitmix64(seed) ⊕ splitmix64(position))`).
pub fn uniform(seed: u64, position: u64) -> f64 {
    let x = splitmix64(splitmix64(seed) ^ splitmix64(position.wrapping_add(0x5bd1_e995)));
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Picks the next token from a logits row (`vocab` entries) for the token at `position`,
/// for a request that restricts nothing ([`sample_in`] with an empty [`SeqView`]).
pub fn sample(logits: &[f32], p: &SamplingParams, position: u64) -> Result<u32, EngineError> {
    sample_in(logits, p, position, &SeqView::default())
}

/// Picks the next token from a logits row (`vocab` entries) for the token at `position`
/// of `seq`. Only generable tokens (bytes, end-of-turn) that `seq` allows compete. A NaN
/// or +inf among the model's logits is an error: corrupted logits never turn into a
/// plausible token.
pub fn sample_in(
    logits: &[f32],
    p: &SamplingParams,
    position: u64,
    seq: &SeqView<'_>,
) -> Result<u32, EngineError> {
    if let Some((t, l)) = logits
        .iter()
        .enumerate()
        .find(|(t, l)| is_generable(*t as u32) && (l.is_nan() || **l == f32::INFINITY))
    {
        return Err(EngineError::StepFailed(format!(
            "non-finite logit {l} for token {t} at position {position}"
        )));
    }
    let adjusted = p
        .adjusts_logits()
        .then(|| p.adjust(logits, seq.tokens, seq.prompt_len));
    let row = adjusted.as_deref().unwrap_or(logits);
    let restricted = p.min_new_tokens > 0 || seq.json.is_some();
    let candidates = |with_min: bool| -> Vec<(u32, f32)> {
        row.iter()
            .enumerate()
            .filter(|(t, _)| is_generable(*t as u32))
            .filter(|(t, _)| !restricted || seq.allows(*t as u32, p, with_min))
            .map(|(t, &l)| (t as u32, l))
            .collect()
    };
    let mut cand = candidates(true);
    if cand.is_empty() && p.min_new_tokens > 0 {
        // `min_new_tokens` yields when it would forbid every token: the JSON object is
        // complete (only end of turn may follow), or every generable token stops. The
        // request then stops before it, as nothing else may follow.
        cand = candidates(false);
    }
    let Some(&(first, first_l)) = cand.first() else {
        return Err(EngineError::StepFailed(format!(
            "no token may follow at position {position}"
        )));
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
    use crate::engine::tokenizer::USER;

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
    fn penalties_bias_and_restrictions() {
        let mut l = vec![0.0f32; VOCAB_SIZE];
        l[b'a' as usize] = 4.0;
        l[b'b' as usize] = 3.0;
        l[b'c' as usize] = -1.0;
        l[END as usize] = 3.5;
        l[b'{' as usize] = 1.0;
        let tokens = [256, b'c' as u32, b'a' as u32, b'a' as u32];
        let view = SeqView {
            tokens: &tokens,
            prompt_len: 2,
            json: None,
        };
        let greedy = SamplingParams::greedy(8);
        let pick = |p: &SamplingParams| sample_in(&l, p, 9, &view).unwrap_or(0);
        assert_eq!(pick(&greedy), b'a' as u32);
        // Repetition: positive logits of seen tokens divided, negative ones multiplied.
        let rep = SamplingParams {
            repetition_penalty: 2.0,
            ..greedy.clone()
        };
        let adj = rep.adjust(&l, &tokens, 2);
        assert_eq!((adj[b'a' as usize], adj[b'c' as usize]), (2.0, -2.0));
        assert_eq!(pick(&rep), END);
        // Frequency counts generated tokens only (a twice: 4 - 2 * 0.5); presence once.
        let freq = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..greedy.clone()
        };
        let adj = freq.adjust(&l, &tokens, 2);
        assert_eq!((adj[b'a' as usize], adj[b'c' as usize]), (2.75, -1.0));
        // A bias wins; min_new_tokens holds back end of turn and stop tokens.
        let bias = SamplingParams {
            logit_bias: vec![(END, 10.0)],
            ..greedy.clone()
        };
        assert_eq!(pick(&bias), END);
        let held = SamplingParams {
            min_new_tokens: 3,
            stop_token_ids: vec![b'a' as u32],
            ..bias
        };
        assert_eq!(pick(&held), b'b' as u32);
        // ...unless nothing else may follow: every generable token stops.
        let all_stop = SamplingParams {
            stop_token_ids: (0..256).collect(),
            ..held.clone()
        };
        assert_eq!(pick(&all_stop), END);
        // The JSON object: only `{` or whitespace can start it.
        let j = JsonObjectState::new();
        let jv = SeqView {
            json: Some(&j),
            ..view
        };
        assert_eq!(sample_in(&l, &greedy, 9, &jv).ok(), Some(b'{' as u32));
        // A complete object before min_new_tokens: only end of turn may follow, so it does.
        let mut done = JsonObjectState::new();
        for b in *b"{}" {
            done.push(b);
        }
        assert!(done.is_complete());
        let dv = SeqView {
            json: Some(&done),
            ..view
        };
        let min = SamplingParams {
            min_new_tokens: 100,
            ..greedy.clone()
        };
        assert_eq!(sample_in(&l, &min, 9, &dv).ok(), Some(END));
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
