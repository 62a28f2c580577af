//! Sampling options of the OpenAI endpoints and of SGLang's `/generate`, and what this
//! server does with each: honoured (`max_tokens`, `temperature`, `top_p`, `top_k`,
//! `seed`, `stop`, `stop_token_ids`, `ignore_eos`, `min_tokens`, `logit_bias`,
//! `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `response_format`
//! `text` and `json_object`), refused with a 400 naming it (`n` > 1, `best_of` > 1,
//! `logprobs`, `top_logprobs`, `echo`, `suffix`, `min_p` > 0, `response_format`
//! `json_schema` or a schema with `json_object`, `functions`, `max_tokens` and
//! `max_completion_tokens` that disagree, and the options of other servers' APIs in
//! [`NOT_HONOURED_OPENAI`], [`NOT_HONOURED_GENERATE`] and [`NOT_HONOURED_SGL_SAMPLING`]),
//! and a 400 for a malformed value of any of them.
//!
//! A request without a `seed` gets a fresh one (53 random bits, exact in JSON): it is
//! reported in the response (`seed`, or `meta_info.seed`) so the reply can be replayed.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;

use super::api::ApiError;
use crate::engine::sampling::SamplingParams;

/// A fresh sampling seed below 2^53 (a JSON number keeps it exactly).
pub fn fresh_seed() -> u64 {
    rand::random::<u64>() >> 11
}

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields common to the OpenAI endpoints.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct OpenAiSampling {
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub n: Option<u32>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub echo: Option<bool>,
    pub best_of: Option<u32>,
    pub suffix: Option<String>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub min_tokens: Option<u64>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub response_format: Option<ResponseFormat>,
    pub ignore_eos: Option<bool>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
}

/// `response_format`: its `type`, and whatever else it carries (a schema given with
/// `json_object`, as some servers take it, is refused rather than left unenforced).
#[derive(Clone, Debug, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// Default generation budget when a request names none (capped by the context left).
pub const DEFAULT_MAX_TOKENS: usize = 256;

/// Options of other servers' OpenAI-style APIs (vLLM's, newer OpenAI's) that change what
/// is generated or returned, which this server does not implement. Unknown fields are
/// otherwise ignored (clients send many harmless ones), but a request naming one of these
/// with a value other than `null` or `false` would get an answer that silently is not
/// what it asked for: it is refused, the field named.
pub const NOT_HONOURED_OPENAI: &[&str] = &[
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
    "structural_tag",
    "include_stop_str_in_output",
    "prompt_logprobs",
    "use_beam_search",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "logits_processors",
    "return_tokens_as_token_ids",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "mm_processor_kwargs",
    "reasoning_effort",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
];

/// The same for SGLang's `/generate`: its body's fields.
pub const NOT_HONOURED_GENERATE: &[&str] = &[
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "return_hidden_states",
    "image_data",
    "audio_data",
    "video_data",
    "lora_path",
    "custom_logit_processor",
    "session_params",
];

/// The same for `/generate`'s `sampling_params`.
pub const NOT_HONOURED_SGL_SAMPLING: &[&str] = &[
    "no_stop_trim",
    "stop_regex",
    "custom_params",
    "structural_tag",
    "skip_special_tokens",
    "spaces_between_special_tokens",
];

/// A 400 naming the first field of `obj` in `names` whose value is not `null` or `false`
/// (`prefix` goes before the name: `sampling_params.`).
pub fn refuse_not_honoured(obj: &Value, names: &[&str], prefix: &str) -> Result<(), ApiError> {
    let Some(map) = obj.as_object() else {
        return Ok(());
    };
    match names.iter().find(|n| {
        map.get(**n)
            .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
    }) {
        Some(n) => Err(unsupported(
            &format!("{prefix}{n}"),
            &format!("{prefix}{n}"),
        )),
        None => Ok(()),
    }
}

fn unsupported(param: &str, what: &str) -> ApiError {
    ApiError::bad_request(format!("{what} is not supported by this server")).with_param(param)
}

fn top_k(k: Option<i64>, param: &str) -> Result<usize, ApiError> {
    match k {
        None | Some(-1) | Some(0) => Ok(0),
        Some(k) if k > 0 => Ok(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => Err(
            ApiError::bad_request(format!("top_k must be -1 or positive, got {k}"))
                .with_param(param),
        ),
    }
}

/// `logit_bias`: token ids (as JSON object keys: decimal digits only) to biases, one entry
/// per token (`"65"` and `"065"` name one token twice: a 400, so that no sum of entries
/// passes the bound on a bias).
fn logit_bias(m: &HashMap<String, f32>, param: &str) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |msg: String| ApiError::bad_request(msg).with_param(param);
    let mut v = Vec::with_capacity(m.len());
    for (k, &b) in m {
        let t = if !k.is_empty() && k.bytes().all(|c| c.is_ascii_digit()) {
            k.parse::<u32>().ok()
        } else {
            None
        };
        let t = t.ok_or_else(|| bad(format!("logit_bias keys are token ids, got {k:?}")))?;
        v.push((t, b));
    }
    v.sort_by_key(|&(t, _)| t);
    if let Some(w) = v.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!("logit_bias names token {} twice", w[0].0)));
    }
    Ok(v)
}

/// `SamplingParams` field → the OpenAI parameter a client sent.
fn openai_param(field: &str) -> &str {
    match field {
        "max_new_tokens" => "max_tokens",
        "min_new_tokens" => "min_tokens",
        other => other,
    }
}

impl OpenAiSampling {
    /// Sampling parameters for a prompt of `prompt_len` tokens in a context of
    /// `max_context`, refusing options this server does not implement.
    pub fn to_params(
        &self,
        prompt_len: usize,
        max_context: usize,
    ) -> Result<SamplingParams, ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(unsupported("n", "n other than 1"));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(unsupported("best_of", "best_of other than 1"));
        }
        if self
            .logprobs
            .as_ref()
            .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
        {
            return Err(unsupported("logprobs", "logprobs"));
        }
        if self.top_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported("top_logprobs", "top_logprobs"));
        }
        if self.echo == Some(true) {
            return Err(unsupported("echo", "echo"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported("suffix", "suffix (insertion)"));
        }
        if self.min_p.is_some_and(|p| p != 0.0) {
            return Err(unsupported("min_p", "min_p"));
        }
        if self.functions.is_some() || self.function_call.is_some() {
            let p = if self.functions.is_some() {
                "functions"
            } else {
                "function_call"
            };
            return Err(unsupported(p, "the legacy functions API (use tools)"));
        }
        let json_object = match self.response_format.as_ref().map(|f| f.kind.as_str()) {
            None | Some("text") => false,
            Some("json_object") => true,
            Some("json_schema") => {
                return Err(unsupported(
                    "response_format",
                    "response_format json_schema (json_object and text are)",
                ))
            }
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "response_format type {other:?} is not one of text, json_object, json_schema"
                ))
                .with_param("response_format.type"))
            }
        };
        if let Some(key) = self.response_format.as_ref().and_then(|f| {
            f.rest
                .iter()
                .find(|(k, v)| k.as_str() != "type" && !v.is_null())
                .map(|(k, _)| k.clone())
        }) {
            let p = format!("response_format.{key}");
            return Err(unsupported(&p, &p));
        }
        // The field the client sent (both only when they agree).
        let max_param = match (self.max_tokens, self.max_completion_tokens) {
            (Some(a), Some(b)) if a != b => {
                return Err(ApiError::bad_request(format!(
                    "max_tokens ({a}) and max_completion_tokens ({b}) disagree: give one"
                ))
                .with_param("max_completion_tokens"))
            }
            (None, Some(_)) => "max_completion_tokens",
            _ => "max_tokens",
        };
        let max = match self.max_completion_tokens.or(self.max_tokens) {
            Some(0) => {
                return Err(
                    ApiError::bad_request(format!("{max_param} must be at least 1"))
                        .with_param(max_param),
                )
            }
            Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
            None => DEFAULT_MAX_TOKENS.min(max_context.saturating_sub(prompt_len).max(1)),
        };
        let p = SamplingParams {
            max_new_tokens: max,
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: top_k(self.top_k, "top_k")?,
            seed: self.seed.unwrap_or_else(fresh_seed),
            stop: self.stop.clone().map(Stop::into_vec).unwrap_or_default(),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            min_new_tokens: self
                .min_tokens
                .map_or(0, |m| usize::try_from(m).unwrap_or(usize::MAX)),
            logit_bias: self
                .logit_bias
                .as_ref()
                .map(|m| logit_bias(m, "logit_bias"))
                .transpose()?
                .unwrap_or_default(),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            json_object,
        };
        p.check().map_err(|e| {
            let field = match openai_param(e.field) {
                "max_tokens" => max_param,
                f => f,
            };
            ApiError::bad_request(e.message).with_param(field.to_string())
        })?;
        Ok(p)
    }
}

/// `sampling_params` of SGLang's `/generate`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SglSampling {
    pub max_new_tokens: Option<u64>,
    pub min_new_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub seed: Option<u64>,
    pub sampling_seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub n: Option<u32>,
    pub json_schema: Option<Value>,
    pub regex: Option<Value>,
    pub ebnf: Option<Value>,
    pub logit_bias: Option<HashMap<String, f32>>,
}

impl SglSampling {
    /// Sampling parameters (SGLang's defaults: temperature 1, 128 new tokens when unset).
    pub fn to_params(&self) -> Result<SamplingParams, ApiError> {
        let param = |f: &str| format!("sampling_params.{f}");
        if self.n.is_some_and(|n| n != 1) {
            return Err(unsupported(&param("n"), "n other than 1"));
        }
        if self.min_p.is_some_and(|p| p != 0.0) {
            return Err(unsupported(&param("min_p"), "min_p"));
        }
        for (name, v) in [
            ("json_schema", &self.json_schema),
            ("regex", &self.regex),
            ("ebnf", &self.ebnf),
        ] {
            if v.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(unsupported(
                    &param(name),
                    &format!("constrained decoding by {name}"),
                ));
            }
        }
        let p = SamplingParams {
            max_new_tokens: self
                .max_new_tokens
                .map_or(128, |m| usize::try_from(m).unwrap_or(usize::MAX)),
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: top_k(self.top_k, &param("top_k"))?,
            seed: self.sampling_seed.or(self.seed).unwrap_or_else(fresh_seed),
            stop: self.stop.clone().map(Stop::into_vec).unwrap_or_default(),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos,
            min_new_tokens: self
                .min_new_tokens
                .map_or(0, |m| usize::try_from(m).unwrap_or(usize::MAX)),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            logit_bias: self
                .logit_bias
                .as_ref()
                .map(|m| logit_bias(m, &param("logit_bias")))
                .transpose()?
                .unwrap_or_default(),
            ..Default::default()
        };
        p.check()
            .map_err(|e| ApiError::bad_request(e.message).with_param(param(e.field)))?;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(v: Value) -> Result<SamplingParams, ApiError> {
        let s: OpenAiSampling = super::super::api::from_value(&v)?;
        s.to_params(3, 100)
    }

    #[test]
    fn unsupported_options_name_their_parameter() {
        for (body, param) in [
            (serde_json::json!({"n": 2}), "n"),
            (serde_json::json!({"best_of": 3}), "best_of"),
            (serde_json::json!({"logprobs": 2}), "logprobs"),
            (serde_json::json!({"echo": true}), "echo"),
            (serde_json::json!({"suffix": "end"}), "suffix"),
            (serde_json::json!({"min_p": 0.1}), "min_p"),
            (serde_json::json!({"functions": []}), "functions"),
            (
                serde_json::json!({"response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (
                serde_json::json!({"response_format": {"type": "yaml"}}),
                "response_format.type",
            ),
            (serde_json::json!({"logit_bias": {"x": 1}}), "logit_bias"),
            (serde_json::json!({"logit_bias": {" 65": 1}}), "logit_bias"),
            (serde_json::json!({"logit_bias": {"+65": 1}}), "logit_bias"),
            (
                serde_json::json!({"logit_bias": {"65": 60, "065": 60}}),
                "logit_bias",
            ),
            (serde_json::json!({"logit_bias": {"9999": 1}}), "logit_bias"),
            (serde_json::json!({"logit_bias": {"65": 101}}), "logit_bias"),
            (
                serde_json::json!({"min_tokens": 50, "max_tokens": 5}),
                "min_tokens",
            ),
            (
                serde_json::json!({"repetition_penalty": 0}),
                "repetition_penalty",
            ),
            (
                serde_json::json!({"presence_penalty": 3}),
                "presence_penalty",
            ),
            (
                serde_json::json!({"response_format": {"type": "json_object", "schema": {}}}),
                "response_format.schema",
            ),
            (
                serde_json::json!({"max_tokens": 5, "max_completion_tokens": 6}),
                "max_completion_tokens",
            ),
            (
                serde_json::json!({"max_completion_tokens": 0}),
                "max_completion_tokens",
            ),
            (
                serde_json::json!({"max_completion_tokens": 5, "min_tokens": 9}),
                "min_tokens",
            ),
        ] {
            let e = params(body.clone()).err();
            assert_eq!(e.and_then(|e| e.param), Some(param.to_string()), "{body}");
        }
    }

    #[test]
    fn supported_options_reach_the_engine() {
        let p = params(serde_json::json!({
            "min_tokens": 2, "max_tokens": 9, "logit_bias": {"65": 5, "10": -100},
            "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "response_format": {"type": "json_object"}, "seed": 7, "stop_token_ids": [66]
        }))
        .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(p.min_new_tokens, 2);
        assert_eq!(p.logit_bias, vec![(10, -100.0), (65, 5.0)]);
        assert_eq!((p.repetition_penalty, p.presence_penalty), (1.3, 0.5));
        assert!(p.json_object && p.seed == 7 && p.stop_token_ids == vec![66]);
        let d = params(serde_json::json!({})).unwrap_or_default();
        assert_eq!(
            d.max_new_tokens, 97,
            "default budget capped by the context left"
        );
        assert!(d.seed < 1 << 53);
        let e = params(serde_json::json!({})).unwrap_or_default();
        assert_ne!(d.seed, e.seed, "unseeded requests draw fresh seeds");
    }
}
