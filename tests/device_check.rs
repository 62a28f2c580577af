//! `scripts/device-check.sh --dry-run`: the device check's plumbing without a GPU (the
//! same steps, files and summary; validate and bench on the cpu backend; sanitizers and
//! ncu recorded as skipped), and the summary's parsers on recorded tool output.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn dry_run_writes_at_most_eight_files_and_a_summary_of_every_step() {
    let out = std::env::temp_dir().join(format!("sparsekit-device-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new("bash")
        .arg(root().join("scripts/device-check.sh"))
        .args(["--dry-run", "--bin", env!("CARGO_BIN_EXE_sparsekit")])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let log = std::fs::read_to_string(out.join("log.txt")).unwrap_or_default();
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "bench.json",
            "env.txt",
            "log.txt",
            "peers.json",
            "sanitize.txt",
            "summary.json",
            "summary.md",
            "validate.json"
        ],
        "{log}"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["dry_run"], true);
    let steps = s["steps"].as_array().unwrap();
    let status = |name: &str| {
        steps
            .iter()
            .find(|x| x["step"] == name)
            .unwrap_or_else(|| panic!("no step {name}: {log}"))["status"]
            .as_str()
            .unwrap()
            .to_string()
    };
    for name in ["validate_quick", "bench", "peers"] {
        assert_eq!(status(name), "pass", "{name}: {log}");
    }
    for tool in ["memcheck", "racecheck", "synccheck", "initcheck"] {
        assert_eq!(status(&format!("sanitize_{tool}")), "skipped");
    }
    for k in sparsekit::kernels::ENTRY_POINTS {
        assert_eq!(status(&format!("ncu_{k}")), "skipped", "{k}");
    }
    let passed: u64 = s["validate"]["quick"]
        .as_object()
        .unwrap()
        .values()
        .map(|d| d["pass"].as_u64().unwrap())
        .sum();
    assert!(passed > 0, "validation ran: {log}");
    assert!(!s["bench"].as_array().unwrap().is_empty());
    assert_eq!(s["peers_available"], false);
    // Every step passed except `kernels` in a build without PTX (it has no report then).
    let kernels_ok = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .arg("kernels")
        .output()
        .unwrap()
        .status
        .success();
    if kernels_ok {
        assert_eq!(s["ok"], true, "{stdout}\n{log}");
        assert_eq!(run.status.code(), Some(0));
    } else {
        assert_eq!(s["failed_steps"], serde_json::json!(["kernels"]), "{log}");
        assert_eq!(run.status.code(), Some(1));
    }
    assert!(stdout.contains("| step | status |"), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn summary_parsers_read_recorded_tool_output() {
    let run = Command::new("python3")
        .args(["-m", "unittest", "discover", "-s"])
        .arg(root().join("scripts/device"))
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}
