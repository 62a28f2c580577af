//! Chat requests with tools: checking `tools`, `tool_choice` and `parallel_tool_calls`,
//! rendering the conversation through the chat template with DSML ([`crate::dsml`]),
//! and turning DSML in the reply into OpenAI `tool_calls` ([`ChatReply`]).
//!
//! `tool_choice`: `none` (the tools are not shown and the reply is text), `auto` (the
//! default when tools are given), `required` and a named function (the generation prompt
//! ends with the opening markup of a call, the named one's complete with its name, so the
//! reply continues inside it). A block that does not parse, or that the reply leaves open,
//! is returned as `content` and counted in `sparsekit_tool_call_parse_failures_total`.

use serde_json::{json, Map, Value};

use super::api::{ApiError, ChatRequest, Content};
use crate::dsml::{self, CallScanner, Dialect, Piece, ToolCall};
use crate::engine::random_id;
use crate::engine::tokenizer::{self, ChatMessage, Role};

/// What `tool_choice` asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A chat request made ready for the engine.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatPlan {
    /// The prompt: the template, and a forced call's opening markup.
    pub prompt: Vec<u32>,
    /// DSML in the reply becomes `tool_calls` (tools given and `tool_choice` not `none`).
    pub parse_calls: bool,
    /// The forced call's opening markup (the reply continues it).
    pub prefix: Option<String>,
    /// At most one call (`parallel_tool_calls: false`).
    pub single_call: bool,
}

fn bad(param: impl Into<String>, msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg).with_param(param)
}

/// Checks `tools`: each `{"type": "function", "function": {"name", "description"?,
/// "parameters"?: object, "strict"?: bool}}` with a unique name DSML can carry; returns
/// the `function` objects.
pub fn check_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out: Vec<Value> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let p = |f: &str| format!("tools[{i}]{f}");
        let obj = t
            .as_object()
            .ok_or_else(|| bad(p(""), "each tool must be an object"))?;
        if obj.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(p(".type"), "tool type must be \"function\""));
        }
        let f = obj
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| bad(p(".function"), "a tool needs a function object"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(p(".function.name"), "a function needs a name"))?;
        let ok_name = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
        if !ok_name {
            return Err(bad(
                p(".function.name"),
                format!("function name {name:?} must be 1 to 64 of a-z, A-Z, 0-9, _, - and ."),
            ));
        }
        if out.iter().any(|o| o["name"] == name) {
            return Err(bad(
                p(".function.name"),
                format!("two tools named {name:?}"),
            ));
        }
        if f.get("description").is_some_and(|d| !d.is_string()) {
            return Err(bad(
                p(".function.description"),
                "description must be a string",
            ));
        }
        if f.get("parameters").is_some_and(|d| !d.is_object()) {
            return Err(bad(
                p(".function.parameters"),
                "parameters must be a JSON Schema object",
            ));
        }
        if f.get("strict")
            .is_some_and(|d| !d.is_boolean() && !d.is_null())
        {
            return Err(bad(p(".function.strict"), "strict must be a boolean"));
        }
        out.push(Value::Object(f.clone()));
    }
    Ok(out)
}

/// Parses `tool_choice` against the tools' `functions`.
pub fn check_choice(choice: Option<&Value>, functions: &[Value]) -> Result<ToolChoice, ApiError> {
    let has_tools = !functions.is_empty();
    let c = match choice {
        None | Some(Value::Null) => {
            return Ok(if has_tools {
                ToolChoice::Auto
            } else {
                ToolChoice::None
            })
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!("tool_choice {other:?} is not none, auto, required or a function"),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = (o.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| o.get("function")?.get("name")?.as_str())
                .flatten()
                .ok_or_else(|| {
                    bad(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
            if !functions.iter().any(|f| f["name"] == name) {
                return Err(bad(
                    "tool_choice",
                    format!("tool_choice names {name:?}, which is not among the tools"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "tool_choice must be a string or an object",
            ))
        }
    };
    if !has_tools && matches!(c, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(bad("tool_choice", "tool_choice requires tools"));
    }
    Ok(c)
}

/// One of an assistant message's `tool_calls` as a DSML call.
fn history_call(c: &Value, param: &str) -> Result<ToolCall, ApiError> {
    let f = c
        .get("function")
        .ok_or_else(|| bad(param, "a tool call needs a function"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| dsml::valid_name(n))
        .ok_or_else(|| {
            bad(
                format!("{param}.function.name"),
                "a tool call needs a valid name",
            )
        })?;
    let args: Map<String, Value> = match f.get("arguments") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::String(s)) if s.trim().is_empty() => Map::new(),
        Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
            bad(
                format!("{param}.function.arguments"),
                format!("arguments must be a JSON object: {e}"),
            )
        })?,
        Some(Value::Object(o)) => o.clone(),
        Some(_) => {
            return Err(bad(
                format!("{param}.function.arguments"),
                "arguments must be a JSON object (or its text)",
            ))
        }
    };
    Ok(ToolCall {
        name: name.to_string(),
        arguments: args.into_iter().collect(),
    })
}

fn message_text(content: &Option<Content>, i: usize) -> Result<String, ApiError> {
    Ok(match content {
        None => String::new(),
        Some(Content::Text(t)) => t.clone(),
        Some(Content::Parts(parts)) => {
            let mut s = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => s.push_str(t),
                    _ => {
                        return Err(bad(
                            format!("messages[{i}].content[{j}]"),
                            format!(
                                "content part of type {:?} is not supported (text only)",
                                p.kind
                            ),
                        ))
                    }
                }
            }
            s
        }
    })
}

/// The chat template over `r`'s messages, tools rendered in `dialect`'s DSML.
pub fn plan(r: &ChatRequest, dialect: Dialect) -> Result<ChatPlan, ApiError> {
    if r.messages.is_empty() {
        return Err(bad("messages", "messages must not be empty"));
    }
    let functions = check_tools(r.tools.as_deref().unwrap_or_default())?;
    let choice = check_choice(r.tool_choice.as_ref(), &functions)?;
    let forced = matches!(choice, ToolChoice::Required | ToolChoice::Named(_));
    if forced
        && r.sampling
            .response_format
            .as_ref()
            .is_some_and(|f| f.kind == "json_object")
    {
        return Err(bad(
            "response_format",
            "response_format json_object cannot be combined with a forced tool call",
        ));
    }
    let tools_text = (choice != ToolChoice::None).then(|| dsml::render_tools(dialect, &functions));
    let mut msgs = Vec::with_capacity(r.messages.len() + 1);
    for (i, m) in r.messages.iter().enumerate() {
        let role = Role::parse(&m.role).ok_or_else(|| {
            bad(
                format!("messages[{i}].role"),
                format!(
                    "unknown role {:?} (expected system, developer, user, assistant or tool)",
                    m.role
                ),
            )
        })?;
        let mut content = message_text(&m.content, i)?;
        let calls = m.tool_calls.as_deref().unwrap_or_default();
        if !calls.is_empty() {
            if role != Role::Assistant {
                return Err(bad(
                    format!("messages[{i}].tool_calls"),
                    "only assistant messages carry tool calls",
                ));
            }
            let calls = calls
                .iter()
                .enumerate()
                .map(|(j, c)| history_call(c, &format!("messages[{i}].tool_calls[{j}]")))
                .collect::<Result<Vec<_>, _>>()?;
            let block = dsml::render_calls(dialect, &calls)
                .map_err(|e| bad(format!("messages[{i}].tool_calls"), e.to_string()))?;
            if !content.is_empty() {
                content.push_str("\n\n");
            }
            content.push_str(&block);
        }
        msgs.push(ChatMessage::new(role, content));
    }
    if let Some(t) = tools_text.filter(|_| !functions.is_empty()) {
        match msgs.first_mut() {
            Some(m) if m.role == Role::System => {
                if !m.content.is_empty() {
                    m.content.push_str("\n\n");
                }
                m.content.push_str(&t);
            }
            _ => msgs.insert(0, ChatMessage::new(Role::System, t)),
        }
    }
    let mut prompt = tokenizer::apply_chat_template(&msgs, true);
    let prefix = match &choice {
        ToolChoice::Required => Some(dsml::forced_prefix(dialect, None)),
        ToolChoice::Named(n) => Some(dsml::forced_prefix(dialect, Some(n))),
        _ => None,
    }
    .transpose()
    .map_err(|e| bad("tool_choice", e.to_string()))?;
    if let Some(p) = &prefix {
        prompt.extend(tokenizer::encode(p));
    }
    Ok(ChatPlan {
        prompt,
        parse_calls: choice != ToolChoice::None && !functions.is_empty(),
        prefix,
        single_call: r.parallel_tool_calls == Some(false),
    })
}

/// What the reply adds to a chat message.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    Content(String),
    /// A whole call (streamed as its header, then its arguments).
    Call {
        index: usize,
        call: Value,
    },
}

/// Turns a reply into content and OpenAI tool calls as it arrives.
#[derive(Debug)]
pub struct ChatReply {
    scanner: Option<CallScanner>,
    single_call: bool,
    calls: usize,
    /// Blocks that did not parse so far.
    pub failures: u64,
}

impl ChatReply {
    /// A reply to a request planned as `plan`.
    pub fn new(plan: &ChatPlan) -> Self {
        let scanner = plan.parse_calls.then(|| match &plan.prefix {
            Some(p) => CallScanner::after_prefix(p),
            None => CallScanner::new(),
        });
        ChatReply {
            scanner,
            single_call: plan.single_call,
            calls: 0,
            failures: 0,
        }
    }

    /// Calls returned so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    fn convert(&mut self, pieces: Vec<Piece>) -> Vec<Delta> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(t) => out.push(Delta::Content(t)),
                Piece::Malformed { text, why } => {
                    tracing::debug!(%why, "tool-call markup returned as text");
                    self.failures += 1;
                    out.push(Delta::Content(text));
                }
                Piece::Calls(calls) => {
                    for c in calls {
                        if self.single_call && self.calls == 1 {
                            tracing::debug!(name = %c.name, "dropped a second call (parallel_tool_calls: false)");
                            continue;
                        }
                        out.push(Delta::Call {
                            index: self.calls,
                            call: json!({
                                "id": format!("call_{}", &random_id()[..24]),
                                "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments_json()},
                            }),
                        });
                        self.calls += 1;
                    }
                }
            }
        }
        out
    }

    /// Adds released reply text.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        match self.scanner.as_mut() {
            None if text.is_empty() => Vec::new(),
            None => vec![Delta::Content(text.to_string())],
            Some(s) => {
                let pieces = s.push(text.as_bytes());
                self.convert(pieces)
            }
        }
    }

    /// The end of the reply.
    pub fn finish(&mut self) -> Vec<Delta> {
        match self.scanner.as_mut() {
            None => Vec::new(),
            Some(s) => {
                let pieces = s.finish();
                self.convert(pieces)
            }
        }
    }
}

/// A whole reply as an OpenAI chat message and the number of malformed blocks.
pub fn whole_message(plan: &ChatPlan, text: &str) -> (Value, u64) {
    let mut r = ChatReply::new(plan);
    let mut deltas = r.push(text);
    deltas.extend(r.finish());
    let (mut content, mut calls) = (String::new(), Vec::new());
    for d in deltas {
        match d {
            Delta::Content(t) => content.push_str(&t),
            Delta::Call { call, .. } => calls.push(call),
        }
    }
    let mut msg = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        if content.trim().is_empty() {
            msg["content"] = Value::Null;
        }
        msg["tool_calls"] = Value::Array(calls);
    }
    (msg, r.failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> ChatRequest {
        ChatRequest::parse(v.to_string().as_bytes()).unwrap_or_else(|e| panic!("{e:?}"))
    }

    fn text(t: &[u32]) -> String {
        String::from_utf8_lossy(&tokenizer::decode_bytes(t, true)).into_owned()
    }

    const TOOL: &str = r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}"#;

    #[test]
    fn history_and_tools_render_in_dsml() {
        let tool: Value = serde_json::from_str(TOOL).unwrap_or_default();
        let r = req(json!({"model": "tiny", "tools": [tool], "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Hangzhou\", \"days\": 2}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}));
        for d in Dialect::ALL {
            let p = plan(&r, d).unwrap_or_else(|e| panic!("{e:?}"));
            let t = text(&p.prompt);
            assert!(t.starts_with("<|bos|><|system|>## Tools"), "{t}");
            assert!(t.contains("{\"name\":\"get_weather\""), "{t}");
            assert!(
                t.contains(&format!(
                    "<|assistant|>{}\n<｜DSML｜invoke name=\"get_weather\">\n\
                 <｜DSML｜parameter name=\"city\" string=\"true\">Hangzhou</｜DSML｜parameter>\n\
                 <｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n\
                 </｜DSML｜invoke>\n{}<|end|>",
                    d.open(),
                    d.close()
                )),
                "{t}"
            );
            assert!(t.ends_with("<|tool|>sunny<|end|><|assistant|>"), "{t}");
            assert!(p.parse_calls && p.prefix.is_none());
        }
    }

    #[test]
    fn tool_choice_is_honoured() {
        let tool: Value = serde_json::from_str(TOOL).unwrap_or_default();
        let base = json!({"model": "tiny", "tools": [tool],
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]});
        let with = |c: Value| {
            let mut b = base.clone();
            b["tool_choice"] = c;
            plan(&req(b), Dialect::V32)
        };
        let none = with(json!("none")).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(!none.parse_calls && !text(&none.prompt).contains("## Tools"));
        let named = with(json!({"type": "function", "function": {"name": "get_weather"}}))
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert!(text(&named.prompt).ends_with(
            "<|assistant|><｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        ));
        let required = with(json!("required")).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(text(&required.prompt).ends_with("<｜DSML｜invoke name=\""));
        assert!(text(&required.prompt).starts_with("<|bos|><|system|>be brief\n\n## Tools"));
        for (c, why) in [
            (json!("sometimes"), "not none"),
            (
                json!({"type": "function", "function": {"name": "nope"}}),
                "not among",
            ),
            (json!({"type": "function"}), "named tool_choice"),
            (json!(3), "string or an object"),
        ] {
            let e = with(c).err().unwrap_or_else(|| ApiError::bad_request(""));
            assert_eq!(e.param.as_deref(), Some("tool_choice"));
            assert!(e.message.contains(why), "{}", e.message);
        }
        let mut no_tools = base.clone();
        no_tools["tools"] = json!([]);
        no_tools["tool_choice"] = json!("required");
        assert!(plan(&req(no_tools), Dialect::V32).is_err());
    }

    #[test]
    fn malformed_tools_name_the_field() {
        for (tools, param) in [
            (json!([1]), "tools[0]"),
            (json!([{"type": "retrieval"}]), "tools[0].type"),
            (json!([{"type": "function"}]), "tools[0].function"),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                "tools[0].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": []}}]),
                "tools[0].function.parameters",
            ),
            (
                json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
                "tools[1].function.name",
            ),
        ] {
            let r = req(
                json!({"model": "tiny", "tools": tools, "messages": [{"role": "user", "content": "x"}]}),
            );
            assert_eq!(
                plan(&r, Dialect::V32).err().and_then(|e| e.param),
                Some(param.to_string())
            );
        }
    }

    #[test]
    fn replies_become_tool_calls_or_stay_text() {
        let tool: Value = serde_json::from_str(TOOL).unwrap_or_default();
        let r = req(
            json!({"model": "tiny", "tools": [tool], "messages": [{"role": "user", "content": "x"}]}),
        );
        let p = plan(&r, Dialect::V32).unwrap_or_else(|e| panic!("{e:?}"));
        let call = "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
            <｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n\
            </｜DSML｜invoke>\n</｜DSML｜function_calls>";
        let (m, failures) = whole_message(&p, &format!("\n\n{call}"));
        assert_eq!(failures, 0);
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(
            m["tool_calls"][0]["function"]["arguments"],
            "{\"city\": \"Paris\"}"
        );
        let (m, failures) = whole_message(&p, &call[..call.len() - 3]);
        assert_eq!(failures, 1);
        assert_eq!(m["content"], &call[..call.len() - 3]);
        assert!(m.get("tool_calls").is_none());
    }
}
