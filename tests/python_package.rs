//! The Python package (`python/`): built the way `pip install ./python` builds it (maturin,
//! through pip, with `--no-build-isolation` so no network is needed once the test
//! requirements are installed), installed into `target/python/site`, and its pytest suite
//! (`python/tests/`: every `sparsekit.ops` function and every `sparsekit.compat` function
//! against torch references written from the anchors' published maths, bad arguments, a
//! script shaped like SGLang's DSA backend call sites) run on CPU tensors.
//!
//! Repeated runs are cheap: the extension's Cargo build lives in `target/python/cargo`
//! (incremental, the `dev` profile of `python/Cargo.toml`), the wheel is rebuilt only
//! when its inputs changed.
//!
//! Needs python3 with torch, pytest and maturin (`pip install -r
//! python/requirements-test.txt`; torch from PyPI). Without them the test prints
//! `SKIPPED …` and passes; with `SPARSEKIT_REQUIRE_PYTHON=1` (set by `.ci/run`) it fails.
//! `SPARSEKIT_PYTHON` names another interpreter (a venv's).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn python() -> String {
    std::env::var("SPARSEKIT_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn show(o: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Newest modification time under `dir` (files whose name ends in one of `exts`).
fn newest(dir: &Path, exts: &[&str], acc: &mut std::time::SystemTime) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == "target" || name.starts_with('.') || name == "__pycache__" {
            continue;
        }
        if p.is_dir() {
            newest(&p, exts, acc);
        } else if exts.iter().any(|x| name.ends_with(x)) {
            if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
                *acc = (*acc).max(t);
            }
        }
    }
}

#[test]
fn python_package_pytest_suite_on_cpu() {
    let required = std::env::var("SPARSEKIT_REQUIRE_PYTHON").is_ok_and(|v| v == "1");
    let py = python();
    let probe = Command::new(&py)
        .args([
            "-c",
            "import torch, pytest, maturin, mypy; print(torch.__version__)",
        ])
        .output();
    let missing = match &probe {
        Err(e) => Some(format!("{py} is not runnable: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "{py} lacks torch, pytest, maturin or mypy ({})",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Ok(_) => None,
    };
    if let Some(why) = missing {
        assert!(
            !required,
            "SPARSEKIT_REQUIRE_PYTHON=1 but {why}: pip install -r python/requirements-test.txt"
        );
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED python_package_pytest_suite_on_cpu: {why}; install them with \
             `{py} -m pip install -r python/requirements-test.txt` (torch from PyPI)"
        );
        return;
    }

    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let work = root.join("target").join("python");
    let wheels = work.join("wheels");
    let site = work.join("site");
    let stamp = work.join("site.stamp");
    std::fs::create_dir_all(&wheels).unwrap();

    // Rebuild when a source the wheel is made of is newer than the last install.
    let mut inputs = std::time::SystemTime::UNIX_EPOCH;
    for d in [
        "python",
        "host",
        "kernels-rs",
        "src",
        "server",
        "validation",
        "benches",
    ] {
        newest(
            &root.join(d),
            &[".rs", ".py", ".pyi", ".typed", ".toml"],
            &mut inputs,
        );
    }
    for f in ["build.rs", "Cargo.toml", "Cargo.lock"] {
        if let Ok(t) = std::fs::metadata(root.join(f)).and_then(|m| m.modified()) {
            inputs = inputs.max(t);
        }
    }
    let fresh = std::fs::metadata(&stamp)
        .and_then(|m| m.modified())
        .is_ok_and(|t| t >= inputs)
        && site.join("sparsekit").exists();
    if !fresh {
        for e in std::fs::read_dir(&wheels).unwrap().flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        // `pip install ./python` as a user runs it, but offline (maturin already
        // installed), on the test profile, into our own target dir.
        let o = run(Command::new(&py)
            .args([
                "-m",
                "pip",
                "wheel",
                "--no-build-isolation",
                "--no-deps",
                "-q",
                "-w",
            ])
            .arg(&wheels)
            .arg(root.join("python"))
            .env("CARGO_TARGET_DIR", work.join("cargo"))
            .env("MATURIN_PEP517_ARGS", "--profile pytest"));
        assert!(
            o.status.success(),
            "building the wheel failed:\n{}",
            show(&o)
        );
        let wheel = std::fs::read_dir(&wheels)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .expect("pip wheel wrote no wheel");
        let name = wheel.file_name().unwrap().to_string_lossy().to_string();
        assert!(
            name.contains("abi3"),
            "the wheel is not an abi3 wheel: {name}"
        );
        let _ = std::fs::remove_dir_all(&site);
        let o = run(Command::new(&py)
            .args(["-m", "pip", "install", "--no-deps", "-q", "--target"])
            .arg(&site)
            .arg(&wheel));
        assert!(
            o.status.success(),
            "installing the wheel failed:\n{}",
            show(&o)
        );
        std::fs::write(&stamp, name).unwrap();
    }

    // The package imports without a GPU and without loading the CUDA driver.
    let o = run(Command::new(&py)
        .args([
            "-c",
            "import sys, sparsekit; print(sparsekit.__version__, sparsekit.build_info()); \
             assert 'torch' not in sys.modules, 'import sparsekit imported torch'",
        ])
        .env("PYTHONPATH", &site)
        .current_dir(&work));
    assert!(o.status.success(), "import sparsekit failed:\n{}", show(&o));

    let o = run(Command::new(&py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"])
        .arg(root.join("python").join("tests"))
        .env("PYTHONPATH", &site)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("CUDA_VISIBLE_DEVICES", "")
        .current_dir(&work));
    let out = show(&o);
    let stdout = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let tail = lines[lines.len().saturating_sub(3)..].join("\n");
    let _ = writeln!(std::io::stderr(), "python/tests: {tail}");
    assert!(o.status.success(), "the pytest suite failed:\n{out}");
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(" passed"),
        "pytest ran no test:\n{out}"
    );
}
