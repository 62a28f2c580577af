//! `sparsekit layouts`: the layout descriptors of every named model config.

use std::process::ExitCode;

use serde::Serialize;
use sparsekit::host::dims::{ModelDims, V4Dims};
use sparsekit::host::dtype::ScaleFormat;
use sparsekit::host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout, LayoutInfo};
use sparsekit::table::Table;

use super::CliError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON (`{"index_k": [...], "kv": [...]}`) instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Entry {
    config: &'static str,
    #[serde(flatten)]
    info: LayoutInfo,
}

#[derive(Serialize)]
struct Layouts {
    index_k: Vec<Entry>,
    kv: Vec<Entry>,
}

fn collect() -> Result<Layouts, CliError> {
    let mut out = Layouts {
        index_k: Vec::new(),
        kv: Vec::new(),
    };
    for d in ModelDims::ALL {
        for dt in [
            IndexKDtype::FP8,
            IndexKDtype::Fp8E4m3 {
                scale: ScaleFormat::Ue8m0,
            },
            IndexKDtype::Bf16,
        ] {
            let info = IndexKLayout::new(dt, d.index_head_dim, d.page_size)?.info();
            out.index_k.push(Entry {
                config: d.name,
                info,
            });
        }
        for dt in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
            let info = KvLayout::new(dt, d.kv_lora_rank, d.qk_rope_dim, d.page_size)?.info();
            out.kv.push(Entry {
                config: d.name,
                info,
            });
        }
    }
    // DeepSeek-V4 (Flash and Pro share their caches): the window pool (P 256), the
    // ratio-4 pools (P 64: KV and index-K), the ratio-128 pool (P 2); fp4 index keys
    // beside fp8 and bf16.
    {
        let d = V4Dims::FLASH;
        let config = "dsv4";
        for dt in [IndexKDtype::Fp4E2m1, IndexKDtype::FP8, IndexKDtype::Bf16] {
            let info = IndexKLayout::new(dt, d.index_head_dim, d.csa_page)?.info();
            out.index_k.push(Entry { config, info });
        }
        for p in [d.window_page, d.csa_page, d.hca_page] {
            for l in [KvLayout::model1_fp8(p)?, KvLayout::bf16_512(p)?] {
                out.kv.push(Entry {
                    config,
                    info: l.info(),
                });
            }
        }
    }
    Ok(out)
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    let l = collect()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&l)?);
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = Table::new([
        "buffer",
        "config",
        "dtype",
        "scale",
        "dims",
        "page",
        "B/token",
        "B/page",
        "scales at",
        "fingerprint",
    ]);
    for e in l.index_k.iter().chain(&l.kv) {
        let i = &e.info;
        let dims = match (i.head_dim, i.nope_dim, i.rope_dim) {
            (Some(h), _, _) => format!("head_dim {h}"),
            (_, Some(n), Some(r)) => format!("nope {n} + rope {r}"),
            _ => String::new(),
        };
        let scale = match i.scale {
            Some(ScaleFormat::Fp32) => "fp32",
            Some(ScaleFormat::Ue8m0) => "ue8m0",
            None if i.dtype == "fp4_e2m1" || i.dtype == "model1_fp8" => "ue8m0 bytes",
            None if i.dtype == "fp8_ds_mla" => "fp32 in row",
            None => "-",
        };
        t.row([
            i.kind.to_string(),
            e.config.to_string(),
            i.dtype.to_string(),
            scale.to_string(),
            dims,
            i.page_size.to_string(),
            i.bytes_per_token.to_string(),
            i.bytes_per_page.to_string(),
            i.scale_section.map_or("-".to_string(), |o| o.to_string()),
            i.fingerprint.clone(),
        ]);
    }
    print!("{}", t.render());
    Ok(ExitCode::SUCCESS)
}
