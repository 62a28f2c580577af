//! Subcommands of the `sparsekit` binary.

mod check;
mod kernels;
mod layouts;
mod validate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// sparsekit: DeepSeek Sparse Attention kernels, validated.
#[derive(Debug, Parser)]
#[command(version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the validation suite on a backend against the f64 references.
    Validate(validate::Args),
    /// Print the cache layout descriptors (bytes per token/page, fingerprints).
    Layouts(layouts::Args),
    /// Check golden files (op inputs + expected outputs in safetensors) on a backend.
    Check(check::Args),
    /// List the embedded GPU kernels per arch with registers, spills, shared memory.
    Kernels(kernels::Args),
}

/// An error that ends the command (exit code 2).
pub type CliError = Box<dyn std::error::Error + Send + Sync>;

/// Runs a parsed command line; `Ok` carries the exit code (1 = checks failed).
pub fn run(cli: Cli) -> Result<ExitCode, CliError> {
    match cli.command {
        Command::Validate(a) => validate::run(a),
        Command::Layouts(a) => layouts::run(a),
        Command::Check(a) => check::run(a),
        Command::Kernels(a) => kernels::run(a),
    }
}
