//! `sparsekit check --golden FILE…`: runs the op stored in each golden file on a backend
//! and compares with the file's expected outputs (format: `docs/golden.md`).
//!
//! Exit status: 0 when every file matches, 1 when an output of some file is out of
//! tolerance, 2 when a file is malformed or cannot be run (the message names the file and
//! the problem), 3 when both happened (one file fails, another is malformed).

use std::path::PathBuf;
use std::process::ExitCode;

use serde::Serialize;
use sparsekit::host::Backend;
use sparsekit::table::Table;
use sparsekit::validation::golden::{check_file, GoldenReport};

use super::{on_backend, CliError, OnBackend};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Golden files (.safetensors) to check. Exit status: 0 all match, 1 an output is out
    /// of tolerance, 2 a file is malformed, 3 both.
    #[arg(long, required = true, num_args = 1..)]
    golden: Vec<PathBuf>,
    /// Backend to run the ops on: cpu, emu, emu-sm120a or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Print one JSON record per file instead of a table.
    #[arg(long)]
    json: bool,
}

/// One file's outcome (the JSON record).
#[derive(Debug, Serialize)]
struct Entry {
    file: String,
    pass: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    report: Option<GoldenReport>,
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    struct Check<'a>(&'a Args);
    impl OnBackend for Check<'_> {
        type Output = ExitCode;
        fn run<B: Backend>(self, b: &B) -> Result<ExitCode, CliError> {
            check(b, self.0)
        }
    }
    on_backend(&args.backend, Check(&args))
}

fn check<B: Backend>(backend: &B, args: &Args) -> Result<ExitCode, CliError> {
    let entries: Vec<Entry> = args
        .golden
        .iter()
        .map(|path| {
            let file = path.display().to_string();
            match check_file(backend, path) {
                Ok(r) => Entry {
                    file,
                    pass: r.pass(),
                    error: None,
                    report: Some(r),
                },
                Err(e) => Entry {
                    file,
                    pass: false,
                    error: Some(e.to_string()),
                    report: None,
                },
            }
        })
        .collect();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&entries)?);
    } else {
        print_table(backend.name(), &entries);
    }
    Ok(ExitCode::from(exit_status(&entries)))
}

/// 1 if an output is out of tolerance, plus 2 if a file could not be checked.
fn exit_status(entries: &[Entry]) -> u8 {
    let mismatch = entries.iter().any(|e| e.report.is_some() && !e.pass);
    let malformed = entries.iter().any(|e| e.error.is_some());
    u8::from(mismatch) | (u8::from(malformed) << 1)
}

fn print_table(backend: &str, entries: &[Entry]) {
    let mut t = Table::new([
        "file",
        "op",
        "dtype",
        "quantity",
        "elements",
        "max_abs_err",
        "max_rel_err",
        "err/tol",
        "tolerance",
        "pass",
    ]);
    let mut remarks = Vec::new();
    for e in entries {
        let name = std::path::Path::new(&e.file)
            .file_name()
            .map_or(e.file.clone(), |n| n.to_string_lossy().into_owned());
        let Some(r) = &e.report else {
            eprintln!("error: {}: {}", e.file, e.error.as_deref().unwrap_or(""));
            continue;
        };
        for q in &r.quantities {
            t.row([
                name.clone(),
                r.op.to_string(),
                r.dtype.to_string(),
                q.name.to_string(),
                q.stats.count.to_string(),
                format!("{:.2e}", q.stats.max_abs_err),
                format!("{:.2e}", q.stats.max_rel_err),
                format!("{:.3}", q.stats.worst_ratio),
                q.tolerance.clone(),
                if q.pass { "pass" } else { "FAIL" }.to_string(),
            ]);
            if !q.detail.is_empty() {
                remarks.push(format!("{} {}: {}", e.file, q.name, q.detail));
            }
        }
        remarks.extend(r.notes.iter().map(|n| format!("{}: note: {n}", e.file)));
    }
    if entries.iter().any(|e| e.report.is_some()) {
        print!("{}", t.render());
    }
    for r in &remarks {
        println!("{r}");
    }
    let passed = entries.iter().filter(|e| e.pass).count();
    let malformed = entries.iter().filter(|e| e.error.is_some()).count();
    println!(
        "backend {backend}: {passed} of {} files match, {} mismatch, {malformed} not checked (see the errors)",
        entries.len(),
        entries.len() - passed - malformed,
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

    use super::*;
    use sparsekit::host::ops::{QueryRange, Topk, TopkOutput};
    use sparsekit::validation::golden::{Dtype, Golden, Tensor};

    fn args(files: Vec<PathBuf>) -> Args {
        Args {
            golden: files,
            backend: "cpu".into(),
            json: false,
        }
    }

    #[test]
    fn exit_codes() {
        let dir = std::env::temp_dir().join(format!("sparsekit-cli-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rows = [
            QueryRange {
                request: 0,
                start: 0,
                end: 6,
            },
            QueryRange {
                request: 0,
                start: 2,
                end: 5,
            },
        ];
        let logits = [
            3.0f32, 1.0, 2.0, 2.0, -1.0, 0.5, 9.0, 9.0, 9.0, 7.0, 8.0, 9.0,
        ];
        let op = Topk {
            short_rows: sparsekit::host::ops::ShortRows::SelectValid,
            k: 2,
            row_stride: 6,
            rows: &rows,
            output: TopkOutput::Positions,
        };
        let mut g = Golden::topk(&op, None, &logits).unwrap();
        let good = dir.join("good.safetensors");
        g.write_file(&good).unwrap();
        let bad_values = g.tensors["topk"]
            .values::<i32>()
            .iter()
            .map(|&v| if v == 0 { 1 } else { v })
            .collect::<Vec<i32>>();
        g.tensors
            .insert("topk".into(), Tensor::new(Dtype::I32, &[2, 2], &bad_values));
        let bad = dir.join("bad.safetensors");
        g.write_file(&bad).unwrap();
        g.tensors.remove("logits");
        let malformed = dir.join("malformed.safetensors");
        g.write_file(&malformed).unwrap();
        let code = |files| format!("{:?}", run(args(files)).unwrap());
        assert_eq!(code(vec![good.clone()]), format!("{:?}", ExitCode::SUCCESS));
        assert_eq!(
            code(vec![good.clone(), bad.clone()]),
            format!("{:?}", ExitCode::FAILURE)
        );
        assert_eq!(
            code(vec![good.clone(), malformed.clone()]),
            format!("{:?}", ExitCode::from(2))
        );
        // A failing file next to a malformed one: neither hides the other.
        assert_eq!(
            code(vec![good, bad, malformed]),
            format!("{:?}", ExitCode::from(3))
        );
        assert!(run(Args {
            backend: "gpu9".into(),
            ..args(vec![dir.join("x")])
        })
        .is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
