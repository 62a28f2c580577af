//! Subcommands of the `sparsekit` binary.

mod bench;
mod check;
mod kernels;
mod layouts;
mod profile;
mod repro;
mod repro_report;
mod serve;
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
    /// Time every op a backend implements against the roofline.
    Bench(bench::Args),
    /// List the embedded GPU kernels per arch with registers, spills, shared memory.
    Kernels(kernels::Args),
    /// Model the GPU kernels' performance from an emulated, traced run (no GPU needed).
    Profile(profile::Args),
    /// Serve the synthetic DSA model over HTTP (OpenAI and SGLang APIs).
    Serve(Box<serve::Args>),
    /// The integrity harness: concurrent agentic sessions vs the uncached reference.
    Repro(repro::Args),
}

/// An error that ends the command (exit code 2).
pub type CliError = Box<dyn std::error::Error + Send + Sync>;

/// Work to run on whichever backend the user named.
pub trait OnBackend {
    type Output;
    fn run<B: sparsekit::host::ModelOps>(self, backend: &B) -> Result<Self::Output, CliError>;
}

/// Backend names accepted by `--backend` of `serve` and `repro`.
pub const BACKENDS: &str = "cpu, emu, cuda";

/// Backend names accepted by `--backend` of `validate`, `check` and `bench`: also the
/// emulator as `sm_120a` (its block-scaled MXFP8 kernel paths).
pub const KERNEL_BACKENDS: &str = "cpu, emu, emu-sm120a, cuda";

/// Opens the named backend (`cpu`, `emu`, `emu-sm120a`, `cuda`) and runs `work` on it. A
/// missing CUDA driver or device, or a `SPARSEKIT_CPU_ISA` this CPU cannot run, is a clear
/// error, never a panic.
pub fn on_backend<W: OnBackend>(name: &str, work: W) -> Result<W::Output, CliError> {
    use sparsekit::host::{CpuBackend, EmuBackend, EmuTarget};
    match name {
        "cpu" => {
            let b = CpuBackend::from_env().map_err(|e| format!("cpu backend: {e}"))?;
            // Why the default is what it is on a CPU with the bf16 dot product.
            let dot = match sparsekit::host::cpu::peak::bf16_dot_speedup() {
                _ if !b.isa().same_bits() => {
                    " (indexer scores on AMX tiles: within tolerance, not the other paths' bits)"
                        .to_string()
                }
                Some(s) => format!(" (bf16 dot product at {s:.2}× the f32 FMA rate here)"),
                None => String::new(),
            };
            eprintln!("cpu vector path: {}{dot}", b.isa());
            work.run(&b)
        }
        "emu" => work.run(&EmuBackend::new()),
        "emu-sm120a" => {
            eprintln!("emu target: sm_120a (the block-scaled MXFP8 paths)");
            work.run(&EmuBackend::new().with_target(EmuTarget::Sm120a))
        }
        "cuda" => {
            let b = sparsekit::cuda::CudaBackend::new(0)
                .map_err(|e| format!("cuda backend unavailable: {e}"))?;
            eprintln!("cuda device: {}", b.device());
            work.run(&b)
        }
        other => Err(format!("unknown backend {other:?} (available: {KERNEL_BACKENDS})").into()),
    }
}

/// Runs a parsed command line; `Ok` carries the exit code (1 = checks failed).
pub fn run(cli: Cli) -> Result<ExitCode, CliError> {
    match cli.command {
        Command::Validate(a) => validate::run(a),
        Command::Layouts(a) => layouts::run(a),
        Command::Check(a) => check::run(a),
        Command::Kernels(a) => kernels::run(a),
        Command::Profile(a) => profile::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Serve(a) => serve::run(*a),
        Command::Repro(a) => repro::run(a),
    }
}
