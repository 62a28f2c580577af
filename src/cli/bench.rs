//! `sparsekit bench`: every op a backend implements, timed at DeepSeek-V3.2 sizes and read
//! against the roofline (this CPU's measured copy bandwidth and FMA peak for `cpu`/`emu`;
//! the backend's own device copy rate for `cuda`). Progress while it runs, a table (or
//! `--json`) at the end.

use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use sparsekit::host::Backend;
use sparsekit_benches::report::{Machine, Report};
use sparsekit_benches::roofline::{self, Effort};
use sparsekit_benches::runner::{self, RunOptions};
use sparsekit_benches::{Scale, Suite};

use super::{on_backend, CliError, OnBackend};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Backend to time: cpu, emu or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Small shapes and few samples (a smoke run, numbers indicative only).
    #[arg(long)]
    quick: bool,
    /// Timed calls per case.
    #[arg(long, default_value_t = 10)]
    samples: usize,
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    struct Bench<'a>(&'a Args);
    impl OnBackend for Bench<'_> {
        type Output = ExitCode;
        fn run<B: Backend>(self, b: &B) -> Result<ExitCode, CliError> {
            bench(b, self.0)
        }
    }
    on_backend(&args.backend, Bench(&args))
}

fn bench<B: Backend>(backend: &B, args: &Args) -> Result<ExitCode, CliError> {
    let scale = if args.quick {
        Scale::Smoke
    } else {
        Scale::Full
    };
    let suite = Suite::new(scale)?;
    let spinner = ProgressBar::new_spinner();
    spinner.set_style(
        ProgressStyle::with_template("{spinner} {elapsed} {msg}").map_err(|e| e.to_string())?,
    );
    spinner.enable_steady_tick(std::time::Duration::from_millis(200));
    spinner.set_message("measuring the roofline");
    let effort = if args.quick {
        Effort::Quick
    } else {
        Effort::Full
    };
    let roof = if backend.name() == "cuda" {
        runner::backend_copy_roofline(backend, &suite)?
    } else {
        roofline::measure(effort)
    };
    let opts = RunOptions {
        warmup: if args.quick { 1 } else { 2 },
        samples: args.samples.max(1),
    };
    let out = runner::run(backend, &suite, opts, |name| {
        spinner.set_message(name.to_string())
    })?;
    spinner.finish_and_clear();
    let report = Report {
        date: sparsekit_benches::report::utc_date(),
        machine: Machine::detect(),
        roofline: roof,
        roofline_runs: vec![roof],
        results: out.rows(&roof),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("backend {}", backend.name());
        println!("{}", report.table());
    }
    Ok(ExitCode::SUCCESS)
}
