//! The `sparsekit` binary end to end: `SPARSEKIT_CPU_ISA` forces the CPU backend's vector
//! path (and a path the CPU lacks, or an unknown name, is a clear error with exit code 2),
//! and the suite it runs on that path passes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::process::Command;

use sparsekit::host::cpu::Isa;

fn validate_with_isa(isa: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args([
            "validate",
            "--backend",
            "cpu",
            "--quick",
            "--op",
            "kv_store",
            "--json",
        ])
        .env("SPARSEKIT_CPU_ISA", isa)
        .output()
        .unwrap()
}

#[test]
fn cpu_isa_override_forces_the_path() {
    for isa in Isa::ALL {
        let out = validate_with_isa(isa.name());
        let stderr = String::from_utf8_lossy(&out.stderr);
        if isa.supported() {
            assert!(out.status.success(), "{isa}: {stderr}");
            assert!(
                stderr.contains(&format!("cpu vector path: {isa}")),
                "{isa}: {stderr}"
            );
            let records: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let records = records.as_array().unwrap();
            assert!(!records.is_empty());
            assert!(records.iter().all(|r| r["status"] == "pass"), "{isa}");
        } else {
            assert_eq!(out.status.code(), Some(2), "{isa}: {stderr}");
            assert!(stderr.contains("cannot run"), "{isa}: {stderr}");
        }
    }
    let out = validate_with_isa("sse9");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("SPARSEKIT_CPU_ISA"));
}

/// `sparsekit kernels` (the resource report ptxas gave the build): where PTX is required
/// (CI), one record for every kernel on every arch, each using registers and none spilling
/// above sm_80 (the build refuses those); elsewhere a report, or a failure that says how to
/// get one.
#[test]
fn kernels_reports_every_kernel_on_every_arch() {
    let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["kernels", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let required = std::env::var("SPARSEKIT_REQUIRE_PTX").is_ok_and(|v| v == "1");
    if !out.status.success() {
        assert!(!required, "SPARSEKIT_REQUIRE_PTX=1 but no report: {stderr}");
        assert!(stderr.contains("no ptxas report embedded"), "{stderr}");
        assert!(stderr.contains("scripts/setup-gpu-tools.sh"), "{stderr}");
        return;
    }
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    let archs = sparsekit::kernel_report::archs();
    assert_eq!(archs, ["sm_80", "sm_90", "sm_120", "sm_120a"]);
    assert_eq!(
        rows.len(),
        archs.len() * sparsekit::kernels::ENTRY_POINTS.len()
    );
    for arch in &archs {
        for k in sparsekit::kernels::ENTRY_POINTS {
            let r = rows
                .iter()
                .find(|r| r["kernel"] == *k && r["arch"] == *arch)
                .unwrap_or_else(|| panic!("no record of {k} on {arch}"));
            assert!(r["registers"].as_u64().unwrap() > 0, "{k} {arch}");
            if *arch != "sm_80" {
                assert_eq!(r["spill_bytes"], 0, "{k} {arch}");
            }
        }
    }
}

/// `sparsekit profile --quick --json`: every kernel is profiled, the figures are in range,
/// the model states its devices, and with the PTX embedded every launch gets a prediction
/// per device.
#[test]
fn profile_reports_every_kernel() {
    let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["profile", "--backend", "emu", "--quick", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let devices = v["devices"].as_array().unwrap();
    let names: Vec<&str> = devices
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["H200", "RTX 5090", "RTX PRO 6000 Blackwell"]);
    assert!(devices
        .iter()
        .all(|d| !d["source"].as_str().unwrap().is_empty()));
    let kernels = v["kernels"].as_array().unwrap();
    for k in sparsekit::kernels::ENTRY_POINTS {
        assert!(
            kernels.iter().any(|r| r["kernel"] == *k),
            "{k} not profiled"
        );
    }
    let with_ptx = !sparsekit::ptx::PTXAS_LOGS.is_empty();
    for r in kernels {
        let a = &r["access"];
        for key in ["load_efficiency", "store_efficiency", "active_lanes"] {
            if let Some(x) = a[key].as_f64() {
                assert!(x > 0.0 && x <= 1.0, "{}: {key} {x}", r["case"]);
            }
        }
        if let Some(w) = a["smem_ways"].as_f64() {
            assert!((1.0..=32.0).contains(&w), "{}: ways {w}", r["case"]);
        }
        assert!(r["blocks_emulated"].as_u64().unwrap() >= 1);
        let preds = r["predictions"].as_array().unwrap();
        if with_ptx {
            assert!(preds.iter().all(|p| p["time_us"].as_f64().unwrap() > 0.0));
            // Every device is modelled once per case and kernel: by the generic trace, or
            // (the SM120 parts, for kernels with an sm_120a path) by the sm_120a trace.
            let devices_of = |target: &str| -> Vec<String> {
                kernels
                    .iter()
                    .filter(|x| {
                        x["case"] == r["case"]
                            && x["kernel"] == r["kernel"]
                            && x["target"] == target
                    })
                    .flat_map(|x| x["predictions"].as_array().unwrap().clone())
                    .map(|p| p["device"].as_str().unwrap().to_string())
                    .collect()
            };
            let (generic, sm120a) = (devices_of("generic"), devices_of("sm_120a"));
            let mut all = [generic.clone(), sm120a.clone()].concat();
            all.sort();
            assert_eq!(
                all,
                ["H200", "RTX 5090", "RTX PRO 6000 Blackwell"],
                "{}",
                r["case"]
            );
            if r["kernel"] == "sparse_mla_v4" {
                assert_eq!(generic, ["H200"], "{}", r["case"]);
                assert_eq!(
                    sm120a,
                    ["RTX 5090", "RTX PRO 6000 Blackwell"],
                    "{}",
                    r["case"]
                );
            } else {
                assert!(sm120a.is_empty(), "{}", r["case"]);
            }
        }
    }
    // The same run twice gives the same figures (deterministic).
    let again = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["profile", "--quick", "--json", "--op", "topk,sparse_mla"])
        .output()
        .unwrap();
    let w: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    let pick = |v: &serde_json::Value, case: &str| {
        v["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["case"] == case)
            .cloned()
            .unwrap()
    };
    for case in ["topk/b4", "sparse_mla/fp8/b1"] {
        assert_eq!(pick(&v, case), pick(&w, case), "{case}");
    }
    // Other backends and unknown ops are refused with a clear error.
    let bad = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["profile", "--backend", "cpu"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--backend emu"));
    let bad = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["profile", "--op", "gemm"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

/// `validate --backend emu-sm120a` runs the V4 attention cases on the emulated sm_120a
/// image (the block-scaled score product) and passes; an unknown backend is a clear error.
#[test]
fn validate_runs_the_sm120a_emulator() {
    let out = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args([
            "validate",
            "--backend",
            "emu-sm120a",
            "--quick",
            "--json",
            "--op",
            "sparse_mla_v4",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("sm_120a"), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let records = v.as_array().unwrap();
    assert!(records.len() >= 4, "{} records", records.len());
    let bad = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .args(["validate", "--backend", "emu-sm121a", "--quick"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("emu-sm120a"));
}
