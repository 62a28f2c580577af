//! DeepSeek's DSML tool-call markup: what the chat template writes (the tools a request
//! offers, the calls earlier assistant turns made) and what the server reads back out of
//! a reply ([`parse`]).
//!
//! ```text
//! <｜DSML｜function_calls>
//! <｜DSML｜invoke name="get_weather">
//! <｜DSML｜parameter name="city" string="true">Hangzhou</｜DSML｜parameter>
//! <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
//! </｜DSML｜invoke>
//! </｜DSML｜function_calls>
//! ```
//!
//! The bars are U+FF5C (`｜`), not ASCII `|`. A parameter with `string="true"` holds its
//! value as is (no quotes, no escaping); with `string="false"` it holds JSON. DeepSeek-V3.2
//! names the outer block `function_calls`, DeepSeek-V4 `tool_calls` ([`Dialect`]); the
//! invoke and parameter tags are the same in both.

pub mod parse;

use serde_json::Value;

pub use parse::{parse_block, CallScanner, Piece};

/// `｜DSML｜`, the marker every DSML tag starts with (after `<` or `</`).
pub const DSML: &str = "\u{FF5C}DSML\u{FF5C}";

/// Which model family's markup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dialect {
    /// DeepSeek-V3.2: `<｜DSML｜function_calls>`.
    #[default]
    V32,
    /// DeepSeek-V4: `<｜DSML｜tool_calls>`.
    V4,
}

impl Dialect {
    /// Both dialects (the parser reads either).
    pub const ALL: [Dialect; 2] = [Dialect::V32, Dialect::V4];

    /// The outer block's tag name.
    pub fn block(self) -> &'static str {
        match self {
            Dialect::V32 => "function_calls",
            Dialect::V4 => "tool_calls",
        }
    }

    /// The vLLM name of its tool-call parser (`--tool-call-parser`).
    pub fn name(self) -> &'static str {
        match self {
            Dialect::V32 => "deepseek_v32",
            Dialect::V4 => "deepseek_v4",
        }
    }

    /// Parses [`Dialect::name`].
    pub fn parse(s: &str) -> Result<Dialect, String> {
        Dialect::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown tool-call parser {s:?} (deepseek_v32, deepseek_v4)"))
    }

    /// `<｜DSML｜function_calls>` (or V4's `tool_calls`).
    pub fn open(self) -> String {
        format!("<{DSML}{}>", self.block())
    }

    /// `</｜DSML｜function_calls>` (or V4's `tool_calls`).
    pub fn close(self) -> String {
        format!("</{DSML}{}>", self.block())
    }
}

/// One call: a function name and its arguments in order.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Vec<(String, Value)>,
}

impl ToolCall {
    /// The arguments as a JSON object's text (OpenAI's `function.arguments`), in order.
    pub fn arguments_json(&self) -> String {
        let mut s = String::from("{");
        for (i, (k, v)) in self.arguments.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            s.push_str(&Value::from(k.as_str()).to_string());
            s.push_str(": ");
            s.push_str(&v.to_string());
        }
        s.push('}');
        s
    }
}

/// A name or text DSML cannot carry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DsmlError {
    #[error("name {0:?} cannot be written in DSML (no quotes, angle brackets or control characters, 1 to 256 bytes)")]
    Name(String),
}

/// Whether `name` can be an attribute value (a function or parameter name).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && !name
            .chars()
            .any(|c| c == '"' || c == '<' || c == '>' || c.is_control())
}

fn check_name(name: &str) -> Result<(), DsmlError> {
    if valid_name(name) {
        Ok(())
    } else {
        Err(DsmlError::Name(name.to_string()))
    }
}

/// JSON text that cannot contain a DSML tag (`<` escaped).
fn json_without_tags(v: &Value) -> String {
    v.to_string().replace('<', "\\u003c")
}

/// A parameter as DSML: strings as they are (`string="true"`), unless they hold a DSML
/// tag, which would end the value early (then as JSON with `<` escaped); everything
/// else as JSON (`string="false"`).
fn render_parameter(out: &mut String, name: &str, v: &Value) {
    let (string, text) = match v {
        Value::String(s) if !s.contains(DSML) => ("true", s.clone()),
        other => ("false", json_without_tags(other)),
    };
    out.push_str(&format!(
        "<{DSML}parameter name=\"{name}\" string=\"{string}\">{text}</{DSML}parameter>\n"
    ));
}

/// The block of `calls` (what an assistant turn that called tools wrote).
pub fn render_calls(dialect: Dialect, calls: &[ToolCall]) -> Result<String, DsmlError> {
    let mut out = dialect.open();
    out.push('\n');
    for c in calls {
        check_name(&c.name)?;
        out.push_str(&format!("<{DSML}invoke name=\"{}\">\n", c.name));
        for (k, v) in &c.arguments {
            check_name(k)?;
            render_parameter(&mut out, k, v);
        }
        out.push_str(&format!("</{DSML}invoke>\n"));
    }
    out.push_str(&dialect.close());
    Ok(out)
}

/// The tools section of the system prompt: how to call, then each function's JSON
/// schema (`functions`: OpenAI's `function` objects) on a line of its own.
pub fn render_tools(dialect: Dialect, functions: &[Value]) -> String {
    let (open, close) = (dialect.open(), dialect.close());
    let mut out = format!(
        "## Tools\n\n\
         You may call the functions listed below. To call one or more of them, end your reply \
         with a {open} block:\n\n\
         {open}\n\
         <{DSML}invoke name=\"FUNCTION_NAME\">\n\
         <{DSML}parameter name=\"PARAMETER_NAME\" string=\"true|false\">VALUE</{DSML}parameter>\n\
         </{DSML}invoke>\n\
         {close}\n\n\
         Use one invoke per call and one parameter tag per argument. With string=\"true\" the \
         value is a string written as it is, without quotes or escapes; with string=\"false\" \
         it is JSON (numbers, booleans, null, arrays, objects).\n\n\
         The functions, as JSON Schema:\n<functions>\n"
    );
    for f in functions {
        out.push_str(&f.to_string());
        out.push('\n');
    }
    out.push_str("</functions>");
    out
}

/// What a forced call prefills after the generation prompt: the block's opening and the
/// invoke tag, named (`tool_choice` naming a function) or up to the name
/// (`tool_choice: "required"`).
pub fn forced_prefix(dialect: Dialect, name: Option<&str>) -> Result<String, DsmlError> {
    let mut s = format!("{}\n<{DSML}invoke name=\"", dialect.open());
    if let Some(n) = name {
        check_name(n)?;
        s.push_str(n);
        s.push_str("\">\n");
    }
    Ok(s)
}

#[cfg(test)]
mod tests;
