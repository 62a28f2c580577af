//! Request and response bodies of the HTTP API: OpenAI's completions, chat completions and
//! models, and SGLang's `/generate` and `/abort_request`; the OpenAI error shape.
//!
//! Parsing is strict about types (a wrong type names the field in a 400) and lenient about
//! unknown fields (clients send many we do not use). Options that would change results in
//! ways this server cannot honour (`n > 1`, `logprobs`, `echo`, `best_of`, penalties ≠ 0)
//! are refused with a 400 rather than silently ignored.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::engine::sampling::SamplingParams;
use crate::engine::tokenizer::{self, ChatMessage, Role};
use crate::error::EngineError;

/// An error answered as JSON in OpenAI's shape:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Already counted in `sparsekit_requests_total` (the engine counts what it refuses).
    pub counted: bool,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
            counted: false,
        }
    }

    /// The same error naming the offending parameter.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// The same error with a machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// Any status with a message.
    pub fn status(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            counted: false,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let msg = e.to_string();
        match e {
            EngineError::ContextLength { .. } | EngineError::TooLarge { .. } => {
                ApiError::bad_request(msg).with_code("context_length_exceeded")
            }
            EngineError::InvalidRequest(_) => ApiError::bad_request(msg),
            EngineError::UnknownModel(_) => {
                ApiError::status(404, "invalid_request_error", msg).with_code("model_not_found")
            }
            EngineError::DuplicateId(_) => ApiError::status(409, "invalid_request_error", msg)
                .with_code("duplicate_request_id"),
            EngineError::Overloaded(_) => {
                ApiError::status(503, "server_error", msg).with_code("overloaded")
            }
            EngineError::Unavailable(_) => {
                ApiError::status(503, "server_error", msg).with_code("unavailable")
            }
            EngineError::Timeout(_) => {
                ApiError::status(504, "server_error", msg).with_code("timeout")
            }
            EngineError::Aborted(_) => {
                ApiError::status(499, "server_error", msg).with_code("aborted")
            }
            _ => ApiError::status(500, "server_error", msg),
        }
    }
}

/// Parses a JSON body that must be an object.
pub fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "We could not parse the JSON body of your request ({e}). Send valid JSON."
        ))
    })?;
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    Ok(v)
}

/// Reads `T` out of a JSON object, naming the offending field on a type error.
pub fn from_value<T: for<'de> Deserialize<'de>>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let err = ApiError::bad_request(format!("invalid request: {path}: {inner}"));
        if path == "." {
            err
        } else {
            err.with_param(path)
        }
    })
}

/// [`parse_json`] then [`from_value`].
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    from_value(&parse_json(body)?)
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
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub echo: Option<bool>,
    pub best_of: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
}

/// Default generation budget when a request names none (capped by the context left).
pub const DEFAULT_MAX_TOKENS: usize = 256;

impl OpenAiSampling {
    /// Sampling parameters for a prompt of `prompt_len` tokens in a context of
    /// `max_context`, refusing options this server does not implement.
    pub fn to_params(
        &self,
        prompt_len: usize,
        max_context: usize,
    ) -> Result<SamplingParams, ApiError> {
        let unsupported = |p: &str, what: &str| {
            Err(
                ApiError::bad_request(format!("{what} is not supported by this server"))
                    .with_param(p),
            )
        };
        if self.n.is_some_and(|n| n != 1) {
            return unsupported("n", "n other than 1");
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return unsupported("best_of", "best_of other than 1");
        }
        if self
            .logprobs
            .as_ref()
            .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
        {
            return unsupported("logprobs", "logprobs");
        }
        if self.top_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
            return unsupported("top_logprobs", "top_logprobs");
        }
        if self.echo == Some(true) {
            return unsupported("echo", "echo");
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if v.is_some_and(|x| x != 0.0) {
                return unsupported(name, "a non-zero penalty");
            }
        }
        let max = match self.max_completion_tokens.or(self.max_tokens) {
            Some(0) => {
                return Err(
                    ApiError::bad_request("max_tokens must be at least 1").with_param("max_tokens")
                )
            }
            Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
            None => DEFAULT_MAX_TOKENS.min(max_context.saturating_sub(prompt_len).max(1)),
        };
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(
                    ApiError::bad_request(format!("top_k must be -1 or positive, got {k}"))
                        .with_param("top_k"),
                )
            }
        };
        let p = SamplingParams {
            max_new_tokens: max,
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k,
            seed: self.seed.unwrap_or(0),
            stop: self.stop.clone().map(Stop::into_vec).unwrap_or_default(),
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
        };
        p.validate().map_err(ApiError::from)?;
        Ok(p)
    }
}

/// `prompt` of `/v1/completions`: text, one-element list of text, token ids, or a
/// one-element list of token ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

impl Prompt {
    /// The prompt's tokens (text gets `<|bos|>` first).
    pub fn tokens(&self) -> Result<Vec<u32>, ApiError> {
        let one = |n: usize| {
            if n == 1 {
                Ok(())
            } else {
                Err(ApiError::bad_request(format!(
                    "exactly one prompt per request is supported, got {n}"
                ))
                .with_param("prompt"))
            }
        };
        Ok(match self {
            Prompt::Text(t) => tokenizer::completion_prompt(t),
            Prompt::Texts(v) => {
                one(v.len())?;
                tokenizer::completion_prompt(&v[0])
            }
            Prompt::Ids(ids) => ids.clone(),
            Prompt::IdLists(v) => {
                one(v.len())?;
                v[0].clone()
            }
        })
    }
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Read from the same object by [`from_value`] (not `flatten`: it would lose the
    /// field names of type errors).
    #[serde(skip)]
    pub sampling: OpenAiSampling,
    pub user: Option<String>,
}

impl CompletionRequest {
    /// Parses the body, sampling fields included.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let v = parse_json(body)?;
        let mut r: Self = from_value(&v)?;
        r.sampling = from_value(&v)?;
        Ok(r)
    }
}

/// Content of a chat message: text or a list of parts (only `text` parts are supported).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part message.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// One chat message.
#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    pub name: Option<String>,
    pub tool_call_id: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Read from the same object (see [`CompletionRequest::sampling`]).
    #[serde(skip)]
    pub sampling: OpenAiSampling,
    pub user: Option<String>,
}

impl ChatRequest {
    /// Parses the body, sampling fields included.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let v = parse_json(body)?;
        let mut r: Self = from_value(&v)?;
        r.sampling = from_value(&v)?;
        Ok(r)
    }

    /// The prompt tokens through the chat template (tool schemas, when given, are a
    /// system message listing them as JSON).
    pub fn tokens(&self) -> Result<Vec<u32>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad_request("messages must not be empty").with_param("messages"));
        }
        let mut msgs = Vec::with_capacity(self.messages.len() + 1);
        if let Some(tools) = &self.tools {
            if !tools.is_empty() {
                let schema = serde_json::to_string(tools).unwrap_or_default();
                msgs.push(ChatMessage::new(Role::System, format!("# Tools\n{schema}")));
            }
        }
        for (i, m) in self.messages.iter().enumerate() {
            let role = Role::parse(&m.role).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "unknown role {:?} (expected system, developer, user, assistant or tool)",
                    m.role
                ))
                .with_param(format!("messages[{i}].role"))
            })?;
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            _ => {
                                return Err(ApiError::bad_request(format!(
                                    "content part of type {:?} is not supported (text only)",
                                    p.kind
                                ))
                                .with_param(format!("messages[{i}].content[{j}]")))
                            }
                        }
                    }
                    s
                }
            };
            let tool_calls = m
                .tool_calls
                .iter()
                .flatten()
                .map(|c| serde_json::to_string(c).unwrap_or_default())
                .collect();
            msgs.push(ChatMessage {
                role,
                content,
                tool_calls,
            });
        }
        Ok(tokenizer::apply_chat_template(&msgs, true))
    }
}

/// `sampling_params` of SGLang's `/generate`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SglSampling {
    pub max_new_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub seed: Option<u64>,
    pub sampling_seed: Option<u64>,
}

/// `POST /generate` (SGLang's native API).
#[derive(Clone, Debug, Deserialize)]
pub struct GenerateBody {
    pub text: Option<String>,
    pub input_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub sampling_params: SglSampling,
    #[serde(default)]
    pub stream: bool,
    pub rid: Option<String>,
    /// Return the per-step logits digests (hex) in `meta_info` (the harness's oracle).
    #[serde(default)]
    pub return_logits_digest: bool,
}

impl GenerateBody {
    /// Prompt tokens: `input_ids` as given, or `text` with `<|bos|>` first.
    pub fn tokens(&self) -> Result<Vec<u32>, ApiError> {
        match (&self.text, &self.input_ids) {
            (Some(t), None) => Ok(tokenizer::completion_prompt(t)),
            (None, Some(ids)) => Ok(ids.clone()),
            _ => Err(ApiError::bad_request(
                "give exactly one of text and input_ids",
            )),
        }
    }

    /// Sampling parameters (SGLang's defaults: greedy when temperature is 0, 128 new
    /// tokens when unset).
    pub fn params(&self) -> Result<SamplingParams, ApiError> {
        let s = &self.sampling_params;
        let top_k = match s.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(
                    ApiError::bad_request(format!("top_k must be -1 or positive, got {k}"))
                        .with_param("sampling_params.top_k"),
                )
            }
        };
        let p = SamplingParams {
            max_new_tokens: s
                .max_new_tokens
                .map_or(128, |m| usize::try_from(m).unwrap_or(usize::MAX)),
            temperature: s.temperature.unwrap_or(1.0),
            top_p: s.top_p.unwrap_or(1.0),
            top_k,
            seed: s.sampling_seed.or(s.seed).unwrap_or(0),
            stop: s.stop.clone().map(Stop::into_vec).unwrap_or_default(),
            stop_token_ids: s.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: s.ignore_eos,
        };
        p.validate().map_err(ApiError::from)?;
        Ok(p)
    }
}

/// `POST /abort_request`.
#[derive(Clone, Debug, Deserialize)]
pub struct AbortBody {
    pub rid: String,
}

/// OpenAI `usage`.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }
}

/// Hex form of a logits digest (JSON numbers lose bits above 2^53).
pub fn digest_hex(d: u64) -> String {
    format!("{d:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_errors_name_the_field() {
        let e =
            CompletionRequest::parse(br#"{"model":"tiny","prompt":"x","max_tokens":"many"}"#).err();
        let e = e.unwrap_or_else(|| ApiError::bad_request(""));
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = CompletionRequest::parse(b"{\"model\": ").err();
        assert!(e.is_some_and(|e| e.message.contains("parse the JSON")));
        let e = CompletionRequest::parse(b"[1,2]").err();
        assert!(e.is_some_and(|e| e.message.contains("object")));
        let e = CompletionRequest::parse(br#"{"prompt":"x"}"#).err();
        assert!(e.is_some_and(|e| e.message.contains("model")));
    }

    #[test]
    fn unsupported_options_are_refused() {
        let s = OpenAiSampling {
            n: Some(2),
            ..Default::default()
        };
        assert_eq!(
            s.to_params(3, 100).err().and_then(|e| e.param),
            Some("n".into())
        );
        let s = OpenAiSampling {
            logprobs: Some(Value::from(2)),
            ..Default::default()
        };
        assert!(s.to_params(3, 100).is_err());
        let s = OpenAiSampling::default();
        let p = s.to_params(90, 100).unwrap_or_default();
        assert_eq!(
            p.max_new_tokens, 10,
            "default budget capped by the context left"
        );
        assert_eq!(p.temperature, 1.0);
    }

    #[test]
    fn chat_template_from_messages() {
        let r = ChatRequest::parse(
            br#"{"model":"tiny","messages":[{"role":"system","content":"s"},
                {"role":"user","content":[{"type":"text","text":"hi"}]},
                {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]},
                {"role":"tool","tool_call_id":"1","content":"42"}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        let t = r.tokens().unwrap_or_default();
        let text = String::from_utf8_lossy(&tokenizer::decode_bytes(&t, true)).into_owned();
        assert!(text
            .starts_with("<|bos|><|system|>s<|end|><|user|>hi<|end|><|assistant|><|tool_call|>{"));
        assert!(text.ends_with("<|tool|>42<|end|><|assistant|>"), "{text}");
        let bad =
            ChatRequest::parse(br#"{"model":"tiny","messages":[{"role":"robot","content":"x"}]}"#)
                .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(
            bad.tokens().err().and_then(|e| e.param),
            Some("messages[0].role".into())
        );
    }
}
