//! Reading DSML tool calls out of a reply, whole ([`parse_block`]) or as it streams
//! ([`CallScanner`]: fed the reply's bytes in pieces split anywhere, even inside a tag or
//! a UTF-8 sequence).
//!
//! The grammar is strict: a block holds one or more invokes and nothing else but
//! whitespace; an invoke holds parameters and whitespace; every parameter names itself
//! and says `string="true"` or `string="false"` (then its value must be JSON); names are
//! unique within an invoke. A block that breaks a rule, or that the reply leaves open, is
//! returned as text ([`Piece::Malformed`]) for the caller to show and count, never
//! guessed at.

use serde_json::Value;

use super::{valid_name, Dialect, ToolCall, DSML};

/// What a stretch of reply turned out to be.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// Text (content).
    Text(String),
    /// A block's calls, in order.
    Calls(Vec<ToolCall>),
    /// A block that did not parse (or was cut short), as text; `why` says what was wrong.
    Malformed { text: String, why: String },
}

/// A tag at the start of `s`, after ASCII whitespace: its name (`invoke`, `/invoke`,
/// `parameter`, …), attributes, and the bytes it spans.
struct Tag<'a> {
    name: &'a str,
    attrs: Vec<(&'a str, &'a str)>,
    len: usize,
}

fn skip_ws(s: &str) -> usize {
    s.len() - s.trim_start_matches([' ', '\t', '\n', '\r']).len()
}

/// Reads `<｜DSML｜NAME attr="v" …>` or `</｜DSML｜NAME>` at the start of `s`.
fn tag(s: &str) -> Result<Tag<'_>, String> {
    let not_a_tag = || format!("expected a DSML tag at {:?}", head(s));
    let (closing, rest, lead) = if let Some(r) = s.strip_prefix("</") {
        (true, r, 2)
    } else if let Some(r) = s.strip_prefix('<') {
        (false, r, 1)
    } else {
        return Err(not_a_tag());
    };
    let rest = rest.strip_prefix(DSML).ok_or_else(not_a_tag)?;
    let end = rest
        .find('>')
        .ok_or_else(|| format!("unterminated tag at {:?}", head(s)))?;
    let inner = &rest[..end];
    let name_end = inner.find([' ', '\t', '\n', '\r']).unwrap_or(inner.len());
    let mut attrs = Vec::new();
    let mut a = &inner[name_end..];
    loop {
        a = &a[skip_ws(a)..];
        if a.is_empty() {
            break;
        }
        let (key, after) = a
            .split_once("=\"")
            .ok_or_else(|| format!("malformed attribute in {:?}", head(s)))?;
        let (value, after) = after
            .split_once('"')
            .ok_or_else(|| format!("unterminated attribute in {:?}", head(s)))?;
        attrs.push((key, value));
        a = after;
    }
    if closing && !attrs.is_empty() {
        return Err(format!("attributes on a closing tag {:?}", head(s)));
    }
    let name = &inner[..name_end];
    Ok(Tag {
        name: if closing { closing_name(name) } else { name },
        attrs,
        len: lead + DSML.len() + end + 1,
    })
}

/// Closing tags are reported with a leading `/` (a `'static` set is enough: the grammar
/// knows every closing tag it accepts).
fn closing_name(name: &str) -> &'static str {
    match name {
        "invoke" => "/invoke",
        "parameter" => "/parameter",
        "function_calls" => "/function_calls",
        "tool_calls" => "/tool_calls",
        _ => "/?",
    }
}

fn head(s: &str) -> &str {
    let mut end = s.len().min(40);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn attr<'a>(t: &Tag<'a>, key: &str) -> Option<&'a str> {
    t.attrs.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
}

/// Parses one whole block (opening tag to closing tag, surrounding whitespace allowed).
pub fn parse_block(block: &str) -> Result<(Dialect, Vec<ToolCall>), String> {
    let mut s = &block[skip_ws(block)..];
    let open = tag(s)?;
    let dialect = Dialect::ALL
        .into_iter()
        .find(|d| d.block() == open.name && open.attrs.is_empty())
        .ok_or_else(|| format!("not a tool-call block: {:?}", head(s)))?;
    let close = closing_name(dialect.block());
    s = &s[open.len..];
    let mut calls = Vec::new();
    loop {
        s = &s[skip_ws(s)..];
        let t = tag(s)?;
        s = &s[t.len..];
        match t.name {
            n if n == close => break,
            "invoke" => {
                let name = attr(&t, "name")
                    .filter(|n| valid_name(n) && t.attrs.len() == 1)
                    .ok_or_else(|| "an invoke needs exactly a valid name attribute".to_string())?;
                let (args, rest) = parameters(s)?;
                calls.push(ToolCall {
                    name: name.to_string(),
                    arguments: args,
                });
                s = rest;
            }
            other => return Err(format!("unexpected tag {other:?} in a tool-call block")),
        }
    }
    if calls.is_empty() {
        return Err("a tool-call block without an invoke".into());
    }
    if !s.trim_start_matches([' ', '\t', '\n', '\r']).is_empty() {
        return Err(format!("text after the block: {:?}", head(s)));
    }
    Ok((dialect, calls))
}

type Arguments = Vec<(String, Value)>;

/// The parameters of an invoke, through its closing tag; the rest of the text.
fn parameters(mut s: &str) -> Result<(Arguments, &str), String> {
    let mut args: Arguments = Vec::new();
    let end_tag = format!("</{DSML}parameter>");
    loop {
        s = &s[skip_ws(s)..];
        let t = tag(s)?;
        s = &s[t.len..];
        match t.name {
            "/invoke" => return Ok((args, s)),
            "parameter" => {
                let (Some(name), Some(string), 2) =
                    (attr(&t, "name"), attr(&t, "string"), t.attrs.len())
                else {
                    return Err("a parameter needs exactly name and string attributes".into());
                };
                if !valid_name(name) {
                    return Err(format!("invalid parameter name {name:?}"));
                }
                if args.iter().any(|(k, _)| k == name) {
                    return Err(format!("parameter {name:?} given twice"));
                }
                let end = s
                    .find(&end_tag)
                    .ok_or_else(|| format!("parameter {name:?} is not closed"))?;
                let raw = &s[..end];
                let value = match string {
                    "true" => Value::String(raw.to_string()),
                    "false" => serde_json::from_str(raw.trim())
                        .map_err(|e| format!("parameter {name:?} is not JSON: {e}"))?,
                    other => return Err(format!("string=\"{other}\" (true or false)")),
                };
                args.push((name.to_string(), value));
                s = &s[end + end_tag.len()..];
            }
            other => return Err(format!("unexpected tag {other:?} in an invoke")),
        }
    }
}

/// Finds `needle` in `hay` from `from`.
fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

/// Length of the longest proper prefix of `needle` that `hay` ends with.
fn partial_suffix(hay: &[u8], needle: &[u8]) -> usize {
    (1..needle.len().min(hay.len() + 1))
        .rev()
        .find(|&l| hay[hay.len() - l..] == needle[..l])
        .unwrap_or(0)
}

/// Bytes at the end of `b` that start a UTF-8 sequence not complete yet.
fn incomplete_utf8_tail(b: &[u8]) -> usize {
    for back in 1..=b.len().min(3) {
        let c = b[b.len() - back];
        if c & 0xC0 == 0x80 {
            continue;
        }
        let need = match c {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => 1,
        };
        return if back < need { back } else { 0 };
    }
    0
}

/// Splits a streamed reply into text and tool-call blocks. Text is released as soon as
/// it cannot be the start of a block (nor half a UTF-8 sequence); a block is held until
/// it closes, then released as its calls, or as text if it does not parse. Whatever the
/// reply is split into, the pieces are the same (up to how text is cut).
#[derive(Clone, Debug, Default)]
pub struct CallScanner {
    /// Bytes not released yet.
    pending: Vec<u8>,
    /// Inside a block of this dialect (`pending` starts with its opening tag).
    block: Option<Dialect>,
    /// Where to look for the closing tag next.
    searched: usize,
}

impl CallScanner {
    /// A scanner at the start of a reply.
    pub fn new() -> Self {
        Self::default()
    }

    /// A scanner whose reply starts with `prefix` (a forced call's prefill: it opens a
    /// block and is part of what the block is parsed from).
    pub fn after_prefix(prefix: &str) -> Self {
        let mut s = Self::new();
        // The prefix has no text to release before its block.
        let pieces = s.push(prefix.as_bytes());
        debug_assert!(pieces.is_empty());
        s
    }

    /// Adds reply bytes; returns what became final.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Piece> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            match self.block {
                None => {
                    let opens: Vec<(usize, Dialect)> = Dialect::ALL
                        .into_iter()
                        .filter_map(|d| find(&self.pending, d.open().as_bytes(), 0).map(|i| (i, d)))
                        .collect();
                    if let Some(&(at, d)) = opens.iter().min_by_key(|(i, _)| *i) {
                        let text: Vec<u8> = self.pending.drain(..at).collect();
                        push_text(&mut out, &text);
                        self.block = Some(d);
                        self.searched = 0;
                        continue;
                    }
                    let hold = Dialect::ALL
                        .into_iter()
                        .map(|d| partial_suffix(&self.pending, d.open().as_bytes()))
                        .max()
                        .unwrap_or(0)
                        .max(incomplete_utf8_tail(&self.pending));
                    let text: Vec<u8> = self.pending.drain(..self.pending.len() - hold).collect();
                    push_text(&mut out, &text);
                    return out;
                }
                Some(d) => {
                    let close = d.close();
                    match find(&self.pending, close.as_bytes(), self.searched) {
                        Some(at) => {
                            let block: Vec<u8> = self.pending.drain(..at + close.len()).collect();
                            self.block = None;
                            out.push(block_piece(&block));
                        }
                        None => {
                            self.searched = self.pending.len().saturating_sub(close.len());
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// The end of the reply: what is left (an open block as [`Piece::Malformed`]).
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        match self.block.take() {
            Some(_) => out.push(Piece::Malformed {
                text: String::from_utf8_lossy(&rest).into_owned(),
                why: "the reply ended inside a tool-call block".into(),
            }),
            None => push_text(&mut out, &rest),
        }
        out
    }
}

fn push_text(out: &mut Vec<Piece>, bytes: &[u8]) {
    if !bytes.is_empty() {
        out.push(Piece::Text(String::from_utf8_lossy(bytes).into_owned()));
    }
}

fn block_piece(block: &[u8]) -> Piece {
    let text = String::from_utf8_lossy(block).into_owned();
    match std::str::from_utf8(block) {
        Err(e) => Piece::Malformed {
            text,
            why: format!("not UTF-8: {e}"),
        },
        Ok(s) => match parse_block(s) {
            Ok((_, calls)) => Piece::Calls(calls),
            Err(why) => Piece::Malformed { text, why },
        },
    }
}
