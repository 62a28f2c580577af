//! `sparsekit repro` as a process at a tiny scale: a PD-off and a PD-on configuration
//! report clean sessions with every JSON field of the schema (`docs/repro.md`, version 2:
//! named fields, wall time, pool sizes), the `--report` page and its pictures; bad options
//! are refused with a clear error.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::process::Command;

use serde_json::Value;

#[test]
fn repro_json_rows_and_report() {
    let dir = std::env::temp_dir().join(format!("sparsekit-report-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args([
            "repro",
            "--sessions",
            "2",
            "--turns",
            "2",
            "--configs",
            "bf16/host-on/pd-off,bf16/host-on/pd-on",
            "--json",
            "--report",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(run["schema_version"], 3);
    assert_eq!(run["model"], "tiny,dsv4-tiny");
    assert!(run["wall_seconds"].as_f64().unwrap() > 0.0);
    assert!(run["sizing"]["device_pages"].as_u64().unwrap() > 0);
    assert_eq!(
        (run["sessions"].as_u64(), run["turns"].as_u64()),
        (Some(2), Some(2))
    );
    let rows = run["rows"].as_array().unwrap();
    // Both models by default, DeepSeek-V3.2's rows first.
    assert_eq!(rows.len(), 4);
    for (r, model) in rows.iter().zip(["tiny", "tiny", "dsv4-tiny", "dsv4-tiny"]) {
        assert_eq!(r["model"], model, "{r}");
        assert!(
            r["config"]
                .as_str()
                .unwrap_or_default()
                .starts_with(&format!("{model}/")),
            "{r}"
        );
    }
    let t1 = &rows[0]["ttft_by_turn_ms"][0];
    assert_eq!(t1["turn"], 1, "named fields, not positional pairs: {t1}");
    assert!(t1["p50_ms"].as_f64().is_some());
    assert!(rows[0]["kernel_checks"].as_u64().unwrap() > 0);
    assert_eq!(rows[0]["kernel_mismatches"], 0);
    // The page and its pictures, and the same JSON beside them.
    let html = std::fs::read_to_string(dir.join("index.html")).unwrap();
    for want in [
        "bf16/host-on/pd-off",
        "ttft_by_turn.svg",
        "integrity.svg",
        "report.json",
    ] {
        assert!(html.contains(want), "index.html lacks {want}");
    }
    for svg in ["ttft_by_turn.svg", "integrity.svg"] {
        let text = std::fs::read_to_string(dir.join(svg)).unwrap();
        assert!(
            text.starts_with("<svg") && text.trim_end().ends_with("</svg>"),
            "{svg}"
        );
        assert!(
            text.contains("<polyline") || text.contains("<rect"),
            "{svg} draws nothing"
        );
    }
    let stored: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(stored["rows"], run["rows"]);
    let _ = std::fs::remove_dir_all(&dir);
    let fields = [
        "config",
        "index_k",
        "host_tier",
        "pd",
        "sessions",
        "corrupted",
        "corrupted_pct",
        "refused",
        "wedged",
        "leaked_pages",
        "refused_frames",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "health_p99_ms",
        "host_hit_rate",
        "ttft_speedup_turn3plus",
    ];
    for r in rows {
        for f in fields {
            assert!(r.get(f).is_some(), "missing {f} in {r}");
        }
    }
    let measured = &rows[0];
    assert_eq!(measured["available"], true);
    assert_eq!(measured["sessions"], 2);
    assert_eq!(measured["corrupted"], 0);
    assert_eq!(measured["wedged"], 0);
    assert_eq!(measured["leaked_pages"], 0);
    assert!(measured["ttft_p99_ms"].as_f64().unwrap() > 0.0);
    assert!(measured["health_p99_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(measured["config"], "tiny/bf16/host-on/pd-off");
    assert!(measured["host_hit_rate"].as_f64().is_some(), "{measured}");
    assert!(measured["refused_frames"].is_null(), "no PD: no frames");
    let pd = &rows[1];
    assert_eq!(pd["config"], "tiny/bf16/host-on/pd-on");
    assert_eq!(pd["available"], true, "{pd}");
    assert_eq!(
        (pd["corrupted"].as_u64(), pd["leaked_pages"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(
        pd["refused_frames"], 0,
        "PD on: frames counted, none refused"
    );
    for v4 in &rows[2..] {
        assert_eq!(v4["available"], true, "{v4}");
        for f in ["corrupted", "refused", "wedged", "leaked_pages"] {
            assert_eq!(v4[f], 0, "{f}: {v4}");
        }
    }
}

#[test]
fn repro_refuses_bad_options_clearly() {
    for (args, says) in [
        (&["--inject", "nope"][..], "unknown injection"),
        (&["--abort-rate", "1.5"], "--abort-rate"),
        (&["--configs", "fp9"], "unknown config part"),
        (&["--transport", "carrier-pigeon"], "unknown transport"),
        (
            &["--transport", "nixl", "--url", "http://127.0.0.1:1"],
            "starts its own servers",
        ),
        (
            &["--transport", "nixl", "--inject", "stale-transfer-write"],
            "one process",
        ),
        (&["--url", "http://127.0.0.1:1"], "127.0.0.1:1"),
        (&["--sessions", "0"], "positive"),
        (
            &["--model", "tiny", "--inject", "compressor-state-lost"],
            "needs a DeepSeek-V4 model",
        ),
        (
            &["--model", "tiny", "--inject", "pool-page-size-mismatch"],
            "needs a DeepSeek-V4 model",
        ),
        (
            &[
                "--model",
                "dsv4-tiny",
                "--inject",
                "model1-scales-as-interleaved",
            ],
            "--kv fp8_ds_mla",
        ),
        (&["--model", "gpt2"], "gpt2"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
            .arg("repro")
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
