//! `sparsekit kernels`: every embedded kernel × arch with its register, spill, shared
//! memory and stack use (from `ptxas -v`), whether its SASS uses tensor cores, and its
//! warp-wide instructions (checked convergent by the build).

use std::process::ExitCode;

use sparsekit::kernel_report::{archs, report};
use sparsekit::ptx::PTX_BUILD_INFO;
use sparsekit::table::Table;

use super::CliError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON records instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    let rows = report();
    if rows.is_empty() {
        eprintln!(
            "no ptxas report embedded: run scripts/setup-gpu-tools.sh and rebuild (PTX: {PTX_BUILD_INFO})"
        );
        return Ok(ExitCode::FAILURE);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        let mut t = Table::new([
            "kernel",
            "arch",
            "registers",
            "spill_bytes",
            "shared_bytes",
            "stack_bytes",
            "barriers",
            "tensor_core",
            "sass hmma/qmma",
            "mma/shfl/vote/bar",
        ]);
        for k in &rows {
            t.row([
                k.kernel.clone(),
                k.arch.clone(),
                k.registers.to_string(),
                k.spill_bytes.to_string(),
                k.shared_bytes.to_string(),
                k.stack_bytes.to_string(),
                k.barriers.to_string(),
                k.tensor_core.map_or("?".into(), |b| b.to_string()),
                k.sass_mma
                    .map_or("?".into(), |m| format!("{}/{}", m.hmma, m.qmma)),
                k.warp_ops.map_or("?".into(), |w| {
                    format!("{}/{}/{}/{}", w.mma, w.shfl, w.vote, w.bar)
                }),
            ]);
        }
        print!("{}", t.render());
        println!(
            "PTX: {PTX_BUILD_INFO} for {}; {} kernel records from ptxas",
            archs().join(", "),
            rows.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}
