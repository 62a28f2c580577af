//! Request and response bodies of the HTTP API: OpenAI's completions, chat completions,
//! models and vLLM's tokenize/detokenize, SGLang's `/generate` and `/abort_request`; the
//! OpenAI error shape.
//!
//! Parsing is strict about types (a wrong type names the field in a 400) and lenient about
//! unknown fields (clients send many we do not use), except the options of other servers'
//! APIs that would change the answer ([`super::options::NOT_HONOURED_OPENAI`] and the
//! like): those are refused. Sampling options are in [`super::options`]: each is honoured
//! or refused with a 400 naming it, never ignored.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::options::{
    refuse_not_honoured, NOT_HONOURED_GENERATE, NOT_HONOURED_OPENAI, NOT_HONOURED_SGL_SAMPLING,
};
pub use super::options::{OpenAiSampling, SglSampling, Stop, StreamOptions};
use crate::engine::sampling::SamplingParams;
use crate::engine::tokenizer;
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
    /// What a 503 tells the client to wait (1 s when `None`).
    pub retry_after: Option<Duration>,
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
            retry_after: None,
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
            retry_after: None,
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

/// A JSON value none of whose objects names a key twice. `serde_json::Value` keeps the
/// last of a repeated key, so `{"max_tokens": 5, "max_tokens": 100000}` would run with
/// 100000 and `{"65": 60, "65": 60}` pass the one-entry-per-token rule of `logit_bias`:
/// such a body is refused instead.
struct UniqueKeys(Value);

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueKeysVisitor).map(UniqueKeys)
    }
}

struct UniqueKeysVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueKeysVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        UniqueKeys::deserialize(d).map(|u| u.0)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut v = Vec::new();
        while let Some(UniqueKeys(x)) = seq.next_element()? {
            v.push(x);
        }
        Ok(Value::Array(v))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut m = serde_json::Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let UniqueKeys(v) = map.next_value()?;
            if m.contains_key(&k) {
                return Err(serde::de::Error::custom(format_args!(
                    "the key {k:?} appears twice in one object"
                )));
            }
            m.insert(k, v);
        }
        Ok(Value::Object(m))
    }
}

/// Parses a JSON body that must be an object (no object in it naming a key twice).
pub fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice::<UniqueKeys>(body)
        .map(|u| u.0)
        .map_err(|e| {
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
        refuse_not_honoured(&v, NOT_HONOURED_OPENAI, "")?;
        let mut r: Self = from_value(&v)?;
        r.sampling = from_value(&v)?;
        check_stream_options(r.stream, &r.stream_options)?;
        Ok(r)
    }
}

/// `stream_options` only with `stream` (OpenAI's rule: without a stream it would do
/// nothing).
fn check_stream_options(stream: bool, o: &Option<StreamOptions>) -> Result<(), ApiError> {
    if o.is_some() && !stream {
        return Err(
            ApiError::bad_request("stream_options is only allowed when stream is true")
                .with_param("stream_options"),
        );
    }
    Ok(())
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
    /// Checked by [`super::tools::check_tools`].
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// Checked by [`super::tools::check_choice`].
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
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
        refuse_not_honoured(&v, NOT_HONOURED_OPENAI, "")?;
        // The prompt always ends with the assistant's turn opened (vLLM's default).
        if v.get("add_generation_prompt") == Some(&Value::Bool(false)) {
            return Err(ApiError::bad_request(
                "add_generation_prompt false is not supported by this server (the reply \
                 always starts a new assistant turn)",
            )
            .with_param("add_generation_prompt"));
        }
        let mut r: Self = from_value(&v)?;
        r.sampling = from_value(&v)?;
        check_stream_options(r.stream, &r.stream_options)?;
        Ok(r)
    }
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
    /// A client id: a label in the client namespace (see [`super::ids`]).
    pub rid: Option<String>,
    /// Return the per-step logits digests (hex) in `meta_info` (the harness's oracle).
    #[serde(default)]
    pub return_logits_digest: bool,
}

impl GenerateBody {
    /// Parses the body, refusing the SGLang options this server does not implement.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let v = parse_json(body)?;
        refuse_not_honoured(&v, NOT_HONOURED_GENERATE, "")?;
        if let Some(sp) = v.get("sampling_params") {
            refuse_not_honoured(sp, NOT_HONOURED_SGL_SAMPLING, "sampling_params.")?;
        }
        from_value(&v)
    }

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

    /// Sampling parameters (SGLang's defaults: temperature 1, 128 new tokens when unset).
    pub fn params(&self) -> Result<SamplingParams, ApiError> {
        self.sampling_params.to_params()
    }
}

/// `POST /abort_request`: a client id (every request in flight the caller's address
/// labelled with it) or a server id.
#[derive(Clone, Debug, Deserialize)]
pub struct AbortBody {
    pub rid: String,
}

/// `POST /tokenize` (vLLM's): a prompt, or chat messages through the chat template.
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeBody {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
    /// `<|bos|>` first for a prompt (default true).
    pub add_special_tokens: Option<bool>,
    /// `<|assistant|>` last for messages (default true).
    pub add_generation_prompt: Option<bool>,
}

/// `POST /detokenize` (vLLM's).
#[derive(Clone, Debug, Deserialize)]
pub struct DetokenizeBody {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
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
    fn a_key_given_twice_is_refused_at_any_depth() {
        for body in [
            &br#"{"model":"tiny","prompt":"x","max_tokens":5,"max_tokens":100000}"#[..],
            br#"{"model":"tiny","prompt":"x","logit_bias":{"65":60,"65":60}}"#,
            br#"{"model":"tiny","prompt":"x","stop":[{"a":1,"a":2}]}"#,
        ] {
            let e = CompletionRequest::parse(body).err();
            assert!(
                e.as_ref()
                    .is_some_and(|e| e.status == 400 && e.message.contains("appears twice")),
                "{e:?}"
            );
        }
        // The same keys in different objects, every JSON type, nesting: read as before.
        let v = parse_json(br#"{"a":{"x":1},"b":{"x":[1,-2,3.5,"s",null,true,{"x":{}}]}}"#)
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(
            v,
            serde_json::json!({"a":{"x":1},"b":{"x":[1,-2,3.5,"s",null,true,{"x":{}}]}})
        );
    }

    #[test]
    fn other_servers_options_that_change_the_reply_are_refused() {
        let param = |r: Result<(), ApiError>| r.err().and_then(|e| e.param);
        let completion = |extra: &str| {
            let body = format!(r#"{{"model":"tiny","prompt":"x"{extra}}}"#);
            param(CompletionRequest::parse(body.as_bytes()).map(|_| ()))
        };
        assert_eq!(
            completion(r#","guided_json":{}"#),
            Some("guided_json".into())
        );
        assert_eq!(
            completion(r#","prompt_logprobs":1"#),
            Some("prompt_logprobs".into())
        );
        assert_eq!(
            completion(r#","stream_options":{}"#),
            Some("stream_options".into())
        );
        // null and false ask for nothing; other unknown fields are ignored.
        for extra in [
            r#","guided_json":null"#,
            r#","include_stop_str_in_output":false"#,
            r#","stream":true,"stream_options":{"include_usage":true}"#,
            r#","metadata":{"a":"b"},"service_tier":"auto""#,
        ] {
            assert_eq!(completion(extra), None, "{extra}");
        }
        let chat = |extra: &str| {
            let body = format!(
                r#"{{"model":"tiny","messages":[{{"role":"user","content":"x"}}]{extra}}}"#
            );
            param(ChatRequest::parse(body.as_bytes()).map(|_| ()))
        };
        assert_eq!(
            chat(r#","add_generation_prompt":false"#),
            Some("add_generation_prompt".into())
        );
        assert_eq!(chat(r#","add_generation_prompt":true"#), None);
        assert_eq!(
            chat(r#","reasoning_effort":"low""#),
            Some("reasoning_effort".into())
        );
        let generate = |body: &str| param(GenerateBody::parse(body.as_bytes()).map(|_| ()));
        assert_eq!(
            generate(r#"{"text":"x","return_logprob":true}"#),
            Some("return_logprob".into())
        );
        assert_eq!(
            generate(r#"{"text":"x","sampling_params":{"no_stop_trim":true}}"#),
            Some("sampling_params.no_stop_trim".into())
        );
        assert_eq!(
            generate(r#"{"text":"x","return_logprob":false,"sampling_params":{}}"#),
            None
        );
        // SGLang's logit_bias is honoured like OpenAI's.
        let b = GenerateBody::parse(br#"{"text":"x","sampling_params":{"logit_bias":{"65":-5}}}"#)
            .and_then(|b| b.params())
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(b.logit_bias, vec![(65, -5.0)]);
    }

    #[test]
    fn chat_messages_and_their_parts() {
        let r = ChatRequest::parse(
            br#"{"model":"tiny","messages":[{"role":"system","content":"s"},
                {"role":"user","content":[{"type":"text","text":"hi"}]},
                {"role":"tool","tool_call_id":"1","content":"42"}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        let p = super::super::tools::plan(&r, crate::dsml::Dialect::V32)
            .unwrap_or_else(|e| panic!("{e:?}"));
        let text = String::from_utf8_lossy(&tokenizer::decode_bytes(&p.prompt, true)).into_owned();
        assert_eq!(
            text,
            "<|bos|><|system|>s<|end|><|user|>hi<|end|><|tool|>42<|end|><|assistant|>"
        );
        let bad =
            ChatRequest::parse(br#"{"model":"tiny","messages":[{"role":"robot","content":"x"}]}"#)
                .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(
            super::super::tools::plan(&bad, crate::dsml::Dialect::V32)
                .err()
                .and_then(|e| e.param),
            Some("messages[0].role".into())
        );
    }
}
