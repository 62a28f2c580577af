//! `response_format: {"type": "json_object"}`: a byte-level recogniser of one JSON object
//! (RFC 8259, UTF-8 validated inside strings) that tells the sampler which bytes may come
//! next and when the object is complete (only then may generation end). The model still
//! chooses among the allowed bytes; a reply cut short by `max_tokens` is a prefix of an
//! object (`finish_reason: "length"`), as with OpenAI.

/// An open container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Container {
    Object,
    Array,
}

/// Where a number is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpInt,
}

impl Num {
    fn can_end(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpInt)
    }

    fn step(self, b: u8) -> Option<Num> {
        Some(match (self, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, b'1'..=b'9') => Num::Int,
            (Num::Int, b'0'..=b'9') => Num::Int,
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::Exp,
            (Num::Exp, b'+' | b'-') => Num::ExpSign,
            (Num::Exp | Num::ExpSign | Num::ExpInt, b'0'..=b'9') => Num::ExpInt,
            _ => return None,
        })
    }
}

/// What comes next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The top level, before its `{`.
    Start,
    /// A value (after `:` or `,` in an array).
    Value,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After a value inside a container: `,` or the closer.
    After,
    /// Inside a string: `key` for an object key. `escape`: after `\`; `hex`: `\u`
    /// digits left; `cont`: UTF-8 continuation bytes left, the next one in `lo..=hi`.
    Str {
        key: bool,
        escape: bool,
        hex: u8,
        cont: u8,
        lo: u8,
        hi: u8,
    },
    Num(Num),
    /// Inside `true`, `false` or `null`: the bytes still expected.
    Literal(&'static [u8]),
    /// The top-level object closed.
    Done,
}

/// The recogniser's state after the bytes pushed so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonObjectState {
    stack: Vec<Container>,
    mode: Mode,
}

impl Default for JsonObjectState {
    fn default() -> Self {
        Self::new()
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

fn string(key: bool) -> Mode {
    Mode::Str {
        key,
        escape: false,
        hex: 0,
        cont: 0,
        lo: 0,
        hi: 0,
    }
}

impl JsonObjectState {
    /// Before the first byte.
    pub fn new() -> Self {
        JsonObjectState {
            stack: Vec::new(),
            mode: Mode::Start,
        }
    }

    /// Whether the top-level object is complete (generation may end).
    pub fn is_complete(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Whether `b` may come next.
    pub fn allows(&self, b: u8) -> bool {
        self.clone().push(b)
    }

    /// Consumes `b`; `false` (and the state unchanged in meaning) when it may not come.
    pub fn push(&mut self, b: u8) -> bool {
        match self.mode {
            Mode::Start => match b {
                b'{' => self.open(Container::Object),
                _ => is_ws(b),
            },
            Mode::Done => false,
            Mode::Value => self.value(b),
            Mode::ValueOrClose => b == b']' && self.close(Container::Array) || self.value(b),
            Mode::KeyOrClose => match b {
                b'}' => self.close(Container::Object),
                b'"' => self.set(string(true)),
                _ => is_ws(b),
            },
            Mode::Key => match b {
                b'"' => self.set(string(true)),
                _ => is_ws(b),
            },
            Mode::Colon => match b {
                b':' => self.set(Mode::Value),
                _ => is_ws(b),
            },
            Mode::After => self.after(b),
            Mode::Str { .. } => self.string_byte(b),
            Mode::Num(n) => match n.step(b) {
                Some(next) => self.set(Mode::Num(next)),
                None if n.can_end() => {
                    let saved = self.mode;
                    self.mode = Mode::After;
                    if self.after(b) {
                        true
                    } else {
                        self.mode = saved;
                        false
                    }
                }
                None => false,
            },
            Mode::Literal(rest) => match rest.split_first() {
                Some((&want, tail)) if want == b => {
                    self.mode = if tail.is_empty() {
                        Mode::After
                    } else {
                        Mode::Literal(tail)
                    };
                    true
                }
                _ => false,
            },
        }
    }

    fn set(&mut self, m: Mode) -> bool {
        self.mode = m;
        true
    }

    fn open(&mut self, c: Container) -> bool {
        self.stack.push(c);
        self.mode = match c {
            Container::Object => Mode::KeyOrClose,
            Container::Array => Mode::ValueOrClose,
        };
        true
    }

    fn close(&mut self, c: Container) -> bool {
        if self.stack.last() != Some(&c) {
            return false;
        }
        self.stack.pop();
        self.mode = if self.stack.is_empty() {
            Mode::Done
        } else {
            Mode::After
        };
        true
    }

    fn value(&mut self, b: u8) -> bool {
        match b {
            b'{' => self.open(Container::Object),
            b'[' => self.open(Container::Array),
            b'"' => self.set(string(false)),
            b'-' => self.set(Mode::Num(Num::Minus)),
            b'0' => self.set(Mode::Num(Num::Zero)),
            b'1'..=b'9' => self.set(Mode::Num(Num::Int)),
            b't' => self.set(Mode::Literal(b"rue")),
            b'f' => self.set(Mode::Literal(b"alse")),
            b'n' => self.set(Mode::Literal(b"ull")),
            _ => is_ws(b),
        }
    }

    fn after(&mut self, b: u8) -> bool {
        match (self.stack.last(), b) {
            (Some(Container::Object), b',') => self.set(Mode::Key),
            (Some(Container::Array), b',') => self.set(Mode::Value),
            (Some(Container::Object), b'}') => self.close(Container::Object),
            (Some(Container::Array), b']') => self.close(Container::Array),
            _ => is_ws(b),
        }
    }

    fn string_byte(&mut self, b: u8) -> bool {
        let Mode::Str {
            key,
            escape,
            hex,
            cont,
            lo,
            hi,
        } = self.mode
        else {
            return false;
        };
        let s = |escape, hex, cont, lo, hi| Mode::Str {
            key,
            escape,
            hex,
            cont,
            lo,
            hi,
        };
        if cont > 0 {
            if !(lo..=hi).contains(&b) {
                return false;
            }
            return self.set(s(false, 0, cont - 1, 0x80, 0xBF));
        }
        if hex > 0 {
            return b.is_ascii_hexdigit() && self.set(s(false, hex - 1, 0, 0, 0));
        }
        if escape {
            return match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                    self.set(s(false, 0, 0, 0, 0))
                }
                b'u' => self.set(s(false, 4, 0, 0, 0)),
                _ => false,
            };
        }
        match b {
            b'"' => self.set(if key { Mode::Colon } else { Mode::After }),
            b'\\' => self.set(s(true, 0, 0, 0, 0)),
            0x00..=0x1F => false,
            0x20..=0x7F => true,
            0xC2..=0xDF => self.set(s(false, 0, 1, 0x80, 0xBF)),
            0xE0 => self.set(s(false, 0, 2, 0xA0, 0xBF)),
            0xED => self.set(s(false, 0, 2, 0x80, 0x9F)),
            0xE1..=0xEF => self.set(s(false, 0, 2, 0x80, 0xBF)),
            0xF0 => self.set(s(false, 0, 3, 0x90, 0xBF)),
            0xF4 => self.set(s(false, 0, 3, 0x80, 0x8F)),
            0xF1..=0xF3 => self.set(s(false, 0, 3, 0x80, 0xBF)),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepts(text: &[u8]) -> Option<JsonObjectState> {
        let mut s = JsonObjectState::new();
        text.iter().all(|&b| s.push(b)).then_some(s)
    }

    #[test]
    fn objects_are_recognised_and_completed() {
        for ok in [
            &b"{}"[..],
            b" {\"a\": 1}",
            b"{\"a\":[1,-2.5e+3,0.0,true,false,null,{\"b\":\"\\u00e9\\n\"}],\"c\":{}}",
            "{\"é\": \"日本\"}".as_bytes(),
        ] {
            let s =
                accepts(ok).unwrap_or_else(|| panic!("refused {}", String::from_utf8_lossy(ok)));
            assert!(s.is_complete(), "{}", String::from_utf8_lossy(ok));
            assert!(serde_json::from_slice::<serde_json::Value>(ok).is_ok());
            assert!(!s.allows(b' '), "nothing after the object");
        }
        for partial in [&b"{"[..], b"{\"a\"", b"{\"a\":1", b"{\"a\":[1,"] {
            let s = accepts(partial).unwrap_or_else(|| panic!("refused a prefix"));
            assert!(!s.is_complete());
        }
    }

    #[test]
    fn invalid_bytes_are_refused() {
        for bad in [
            &b"["[..],
            b"1",
            b"{a",
            b"{\"a\" 1",
            b"{\"a\":01",
            b"{\"a\":1,}",
            b"{\"a\":tru ",
            b"{\"a\":\"\x01",
            b"{\"a\":\"\\x",
            b"{\"a\":\"\xC0",
            b"{\"a\":\"\xED\xA0",
            b"{}}",
            b"{\"a\":[}",
        ] {
            assert!(accepts(bad).is_none(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_number_ends_at_the_next_structural_byte() {
        let s = accepts(b"{\"n\":12").unwrap_or_default();
        assert!(s.allows(b'}') && s.allows(b',') && s.allows(b'3') && s.allows(b'.'));
        assert!(!s.allows(b']') && !s.allows(b'x'));
        let s = accepts(b"{\"n\":-").unwrap_or_default();
        assert!(!s.allows(b'}'), "a lone minus is not a number");
    }
}
