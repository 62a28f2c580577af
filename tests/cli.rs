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
