//! The DSML parser suite: nested JSON, `string="true|false"`, the U+FF5C bars, both
//! dialects, malformed and truncated markup, every split of a streamed reply, and
//! render → parse round trips.

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;

fn call(name: &str, args: &[(&str, Value)]) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: args
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    }
}

/// Everything a scanner yields for `parts`, with adjacent texts joined.
fn scan(parts: &[&[u8]], start: Option<&str>) -> Vec<Piece> {
    let mut s = match start {
        Some(p) => CallScanner::after_prefix(p),
        None => CallScanner::new(),
    };
    let mut out = Vec::new();
    for p in parts {
        out.extend(s.push(p));
    }
    out.extend(s.finish());
    let mut joined: Vec<Piece> = Vec::new();
    for p in out {
        match (joined.last_mut(), p) {
            (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
            (_, p) => joined.push(p),
        }
    }
    joined
}

const REPLY: &str = "Let me check.\n\n<｜DSML｜function_calls>\n\
<｜DSML｜invoke name=\"get_weather\">\n\
<｜DSML｜parameter name=\"city\" string=\"true\">Hangzhou, 浙江</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"opts\" string=\"false\">{\"units\": {\"t\": \"C\", \"alerts\": [true, null, 1.5]}}</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n\
</｜DSML｜function_calls>";

fn expected_calls() -> Vec<ToolCall> {
    vec![
        call(
            "get_weather",
            &[
                ("city", json!("Hangzhou, 浙江")),
                ("days", json!(3)),
                (
                    "opts",
                    json!({"units": {"t": "C", "alerts": [true, null, 1.5]}}),
                ),
            ],
        ),
        call("now", &[]),
    ]
}

#[test]
fn a_reply_with_calls_splits_into_text_and_calls() {
    let got = scan(&[REPLY.as_bytes()], None);
    assert_eq!(
        got,
        vec![
            Piece::Text("Let me check.\n\n".into()),
            Piece::Calls(expected_calls())
        ]
    );
    assert_eq!(
        expected_calls()[0].arguments_json(),
        r#"{"city": "Hangzhou, 浙江", "days": 3, "opts": {"units":{"alerts":[true,null,1.5],"t":"C"}}}"#
    );
}

#[test]
fn string_true_is_taken_as_is_and_string_false_as_json() {
    let b = "<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\">\
        <｜DSML｜parameter name=\"a\" string=\"true\">  \"quoted\" \\n 3 </｜DSML｜parameter>\
        <｜DSML｜parameter name=\"b\" string=\"false\"> \"text\" </｜DSML｜parameter>\
        <｜DSML｜parameter name=\"c\" string=\"false\">false</｜DSML｜parameter>\
        </｜DSML｜invoke></｜DSML｜tool_calls>";
    let (d, calls) = parse_block(b).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(d, Dialect::V4);
    assert_eq!(
        calls,
        vec![call(
            "f",
            &[
                ("a", json!("  \"quoted\" \\n 3 ")),
                ("b", json!("text")),
                ("c", json!(false))
            ]
        )]
    );
}

#[test]
fn malformed_blocks_stay_text() {
    let o = "<｜DSML｜function_calls>";
    let c = "</｜DSML｜function_calls>";
    let inv = |body: &str| format!("{o}<｜DSML｜invoke name=\"f\">{body}</｜DSML｜invoke>{c}");
    for bad in [
        format!("{o}\n{c}"),
        format!("{o}hello{c}"),
        inv("<｜DSML｜parameter name=\"a\" string=\"false\">{not json</｜DSML｜parameter>"),
        inv("<｜DSML｜parameter name=\"a\" string=\"maybe\">x</｜DSML｜parameter>"),
        inv("<｜DSML｜parameter name=\"a\">x</｜DSML｜parameter>"),
        inv("<｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter><｜DSML｜parameter name=\"a\" string=\"true\">y</｜DSML｜parameter>"),
        inv("stray text"),
        format!("{o}<｜DSML｜invoke name=\"f\"></｜DSML｜invoke></｜DSML｜tool_calls>{c}"),
        format!("{o}<｜DSML｜invoke>x</｜DSML｜invoke>{c}"),
        format!("{o}<｜DSML｜invoke name=\"f\"></｜DSML｜parameter>{c}"),
    ] {
        let got = scan(&[bad.as_bytes()], None);
        match got.as_slice() {
            [Piece::Malformed { text, why }] => {
                assert_eq!(text, &bad, "{why}");
                assert!(!why.is_empty());
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
}

#[test]
fn a_truncated_block_is_returned_as_text_at_the_end() {
    let cut = &REPLY[..REPLY.len() - 10];
    let got = scan(&[cut.as_bytes()], None);
    assert_eq!(got.len(), 2);
    assert_eq!(got[0], Piece::Text("Let me check.\n\n".into()));
    assert!(matches!(&got[1], Piece::Malformed { text, .. } if text == &cut[15..]));
}

#[test]
fn ascii_bars_are_not_dsml() {
    let ascii = REPLY.replace('｜', "|");
    assert_eq!(scan(&[ascii.as_bytes()], None), vec![Piece::Text(ascii)]);
}

#[test]
fn every_split_point_gives_the_same_pieces() {
    let whole = scan(&[REPLY.as_bytes()], None);
    let b = REPLY.as_bytes();
    for i in 0..=b.len() {
        assert_eq!(scan(&[&b[..i], &b[i..]], None), whole, "split at byte {i}");
    }
    // Byte by byte, and three-way splits around the closing tag.
    let bytes: Vec<&[u8]> = b.chunks(1).collect();
    assert_eq!(scan(&bytes, None), whole);
    let close = REPLY.rfind("</").unwrap_or(0);
    for i in close - 5..b.len() {
        for j in i..b.len() {
            assert_eq!(scan(&[&b[..i], &b[i..j], &b[j..]], None), whole, "{i}/{j}");
        }
    }
}

#[test]
fn text_is_released_before_the_block_ends() {
    let mut s = CallScanner::new();
    assert_eq!(s.push(b"Hello <"), vec![Piece::Text("Hello ".into())]);
    assert_eq!(s.push("｜DS".as_bytes()), vec![]);
    assert_eq!(s.push(b"ML? no"), vec![Piece::Text("<｜DSML? no".into())]);
    // Half a UTF-8 sequence waits for the rest.
    assert_eq!(s.push(&[0xE6]), vec![]);
    assert_eq!(s.push(&[0xB5, 0x99]), vec![Piece::Text("浙".into())]);
}

#[test]
fn a_forced_prefix_opens_the_block() {
    for d in Dialect::ALL {
        let named = forced_prefix(d, Some("now")).unwrap_or_default();
        let rest = format!("</｜DSML｜invoke>\n{}", d.close());
        assert_eq!(
            scan(&[rest.as_bytes()], Some(&named)),
            vec![Piece::Calls(vec![call("now", &[])])]
        );
        let required = forced_prefix(d, None).unwrap_or_default();
        let rest = format!("now\">\n</｜DSML｜invoke>\n{}", d.close());
        assert_eq!(
            scan(&[rest.as_bytes()], Some(&required)),
            vec![Piece::Calls(vec![call("now", &[])])]
        );
        // Random bytes after the prefix: the whole (prefix included) comes back as text.
        let got = scan(&[b"x\x01yz"], Some(&required));
        assert!(matches!(&got[..], [Piece::Malformed { text, .. }] if text.starts_with(&d.open())));
    }
    assert!(forced_prefix(Dialect::V32, Some("a\"b")).is_err());
}

#[test]
fn tools_render_in_each_dialect() {
    let f = json!({"name": "get_weather", "parameters": {"type": "object"}});
    for d in Dialect::ALL {
        let t = render_tools(d, std::slice::from_ref(&f));
        assert!(t.contains(&d.open()) && t.contains(&d.close()), "{t}");
        assert!(t.contains(&f.to_string()));
        let other = Dialect::ALL.into_iter().find(|o| *o != d).unwrap_or(d);
        assert!(!t.contains(&other.open()));
    }
    assert_eq!(Dialect::parse("deepseek_v4"), Ok(Dialect::V4));
    assert!(Dialect::parse("hermes").is_err());
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (-4000i32..4000).prop_map(|x| Value::from(f64::from(x) / 4.0)),
        ".{0,12}".prop_map(Value::String),
        Just(json!(
            "</｜DSML｜parameter> and <｜DSML｜invoke name=\"x\">"
        )),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z\"<]{1,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn tool_call() -> impl Strategy<Value = ToolCall> {
    (
        "[A-Za-z_][A-Za-z0-9_.-]{0,15}",
        prop::collection::btree_map("[A-Za-z_][A-Za-z0-9_ ]{0,10}", json_value(), 0..5),
    )
        .prop_map(|(name, args)| ToolCall {
            name,
            arguments: args.into_iter().collect(),
        })
}

proptest! {
    #[test]
    fn render_then_parse_round_trips(
        calls in prop::collection::vec(tool_call(), 1..4),
        v4 in any::<bool>(),
        text in "[^<]{0,20}",
        cut in any::<prop::sample::Index>(),
    ) {
        let d = if v4 { Dialect::V4 } else { Dialect::V32 };
        let block = render_calls(d, &calls).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let (pd, parsed) = parse_block(&block).map_err(TestCaseError::fail)?;
        prop_assert_eq!(pd, d);
        prop_assert_eq!(&parsed, &calls);
        // Streamed with text before it, split anywhere: the same.
        let reply = format!("{text}{block}");
        let at = cut.index(reply.len() + 1);
        let b = reply.as_bytes();
        let mut want = Vec::new();
        if !text.is_empty() {
            want.push(Piece::Text(text.clone()));
        }
        want.push(Piece::Calls(calls));
        prop_assert_eq!(scan(&[&b[..at], &b[at..]], None), want);
    }
}
