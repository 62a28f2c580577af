//! `sparsekit profile --backend emu [--op a,b] [--json] [--quick] [--blocks N] [--sites]`:
//! what a profiler would say about each GPU kernel at the standard shapes, without a GPU.
//!
//! Each case builds its inputs (caches filled by the CPU backend), runs the op once on a
//! profiling emulator backend (a sample of the launch's blocks, every global and shared
//! access traced; see `sparsekit_kernels::emu::profile`), and combines the trace with the
//! ptxas registers of the embedded kernels in the performance model
//! ([`sparsekit::perf_model`]): global load/store efficiency and access widths, shared
//! memory bank conflicts (average, worst site, and by site with `--sites`), active lanes,
//! barriers per block, then occupancy, waves and a predicted time on each modelled GPU.
//! Deterministic: fixed seeds, fibers.

use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use sparsekit::host::layout::PageLayout;
use sparsekit::host::model_ops::{
    rope_table, Accumulate, Add, Argmax, Cast, DenseDtype, GatedPool, GatherRows, Matmul, RmsNorm,
    Rope, SwiGlu, View,
};
use sparsekit::host::ops::{
    decode_rows, CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, PageTable,
    PagedRegion, SparseMla, Topk, TopkOutput,
};
use sparsekit::host::{
    Backend, CpuBackend, EmuBackend, IndexKDtype, IndexKLayout, KvDtype, KvLayout, ModelDims,
    ModelOps,
};
use sparsekit::kernel_report::report;
use sparsekit::kernels::emu::{EmuTarget, Profile, SiteProfile, Space};
use sparsekit::kernels::kernels::{sparse_mla_split, topk_chunk};
use sparsekit::perf_model::{
    occupancy, predict, widths_label, AccessSummary, DeviceSpec, GridTotals, Prediction, DEVICES,
};
use sparsekit::table::Table;
use sparsekit_benches::inputs::{
    bf16_bytes, bf16_values, f32_bytes, f32_values, filled_index_k_cache, filled_kv_cache,
    i32_bytes, normal_values, rng,
};

use super::CliError;

mod v4;

/// Op names `--op` accepts.
const OPS: [&str; 17] = [
    "index_k_store",
    "kv_store",
    "indexer_logits",
    "topk",
    "sparse_mla",
    "sparse_mla_v4",
    "copy_pages",
    "page_checksums",
    "dense_matmul",
    "dense_rms_norm",
    "dense_rope",
    "dense_swiglu",
    "dense_gather_rows",
    "dense_add",
    "dense_cast",
    "dense_argmax",
    "dense_gated_pool",
];

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Backend: `emu` (the only one that can trace the kernels' accesses).
    #[arg(long, default_value = "emu")]
    backend: String,
    /// Only these ops (comma-separated): index_k_store, kv_store, indexer_logits, topk,
    /// sparse_mla, sparse_mla_v4, copy_pages, page_checksums, and the dense kernels dense_matmul,
    /// dense_rms_norm, dense_rope, dense_swiglu, dense_gather_rows, dense_add, dense_cast,
    /// dense_argmax, dense_gated_pool.
    #[arg(long, value_delimiter = ',')]
    op: Vec<String>,
    /// Print JSON records instead of tables.
    #[arg(long)]
    json: bool,
    /// Small shapes: a smoke run of the machinery (the figures describe the small shapes).
    #[arg(long)]
    quick: bool,
    /// Blocks emulated per launch (the first ones of the grid; at least what the kernel
    /// needs to show every phase of its work).
    #[arg(long, default_value_t = 4)]
    blocks: u32,
    /// Also list every access site (shared-memory bank conflicts by site).
    #[arg(long)]
    sites: bool,
}

/// Builds a case's inputs and runs its op once on the (profiling) emulator.
type RunCase = Box<dyn Fn(&EmuBackend) -> Result<(), CliError>>;

/// One profiled case: an op at one shape.
struct Case {
    /// `op/variant`.
    name: String,
    op: &'static str,
    shape: String,
    /// Fewest blocks to emulate (a kernel whose blocks cooperate needs whole groups).
    min_blocks: u32,
    run: RunCase,
}

/// Problem sizes of a run.
#[derive(Clone, Copy)]
struct Sizes {
    /// Batch of the big cases and of the small-batch decode cases.
    batches: &'static [usize],
    context: usize,
    topk: usize,
    mla_heads: usize,
    store_tokens: usize,
    pool_pages: usize,
    copy_pages: usize,
    /// Divisor of DeepSeek-V3.2's dense dims for the dense kernels' cases.
    dense_divisor: usize,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            Sizes {
                batches: &[4, 1],
                context: 4096,
                topk: 256,
                mla_heads: 32,
                store_tokens: 16,
                pool_pages: 16,
                copy_pages: 8,
                dense_divisor: 4,
            }
        } else {
            Sizes {
                batches: &[64, 8, 1],
                context: 65536,
                topk: 2048,
                mla_heads: 128,
                store_tokens: 64,
                pool_pages: 64,
                copy_pages: 64,
                dense_divisor: 1,
            }
        }
    }
}

/// A page table mapping position page `j` of request `r` to pool page
/// `(r·131 + j·17) mod pool`: distinct within a request when `pool ≥ pages per request`
/// (17 is odd, pools are powers of two), scattered over the pool.
fn scattered_pages(requests: usize, max_pages: usize, pool: usize) -> Vec<i32> {
    let mut t = Vec::with_capacity(requests * max_pages);
    for r in 0..requests {
        for j in 0..max_pages {
            t.push(((r * 131 + j * 17) % pool) as i32);
        }
    }
    t
}

fn cases(s: Sizes) -> Result<Vec<Case>, CliError> {
    let d = ModelDims::DSV32;
    let ik = |dtype| IndexKLayout::new(dtype, d.index_head_dim, d.page_size);
    let kv = |dtype| KvLayout::new(dtype, d.kv_lora_rank, d.qk_rope_dim, d.page_size);
    let mut out: Vec<Case> = Vec::new();
    let big = s.batches[0];

    for (dtype, tag) in [(IndexKDtype::FP8, "fp8"), (IndexKDtype::Bf16, "bf16")] {
        let layout = ik(dtype)?;
        let (n, pool) = (s.store_tokens, s.pool_pages);
        out.push(Case {
            name: format!("index_k_store/{tag}"),
            op: "index_k_store",
            shape: format!("{n} tokens, head_dim {}", layout.head_dim()),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(1);
                let keys = emu.upload(&bf16_bytes(&bf16_values(
                    &mut r,
                    n * layout.head_dim(),
                    1.0,
                )))?;
                let mut cache = emu.alloc(layout.buffer_bytes(pool))?;
                let slots: Vec<i64> = (0..n as i64)
                    .map(|t| (t * 37) % (pool * layout.page_size()) as i64)
                    .collect();
                emu.index_k_store(
                    &IndexKStore {
                        layout,
                        slots: &slots,
                    },
                    &keys,
                    &mut cache,
                )?;
                Ok(())
            }),
        });
    }
    for (dtype, tag) in [(KvDtype::Fp8DsMla, "fp8_ds_mla"), (KvDtype::Bf16, "bf16")] {
        let layout = kv(dtype)?;
        let (n, pool) = (s.store_tokens, s.pool_pages);
        out.push(Case {
            name: format!("kv_store/{tag}"),
            op: "kv_store",
            shape: format!("{n} tokens, d_qk {}", layout.d_qk()),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(2);
                let rows = emu.upload(&bf16_bytes(&bf16_values(&mut r, n * layout.d_qk(), 1.0)))?;
                let mut cache = emu.alloc(layout.buffer_bytes(pool))?;
                let slots: Vec<i64> = (0..n as i64)
                    .map(|t| (t * 37) % (pool * layout.page_size()) as i64)
                    .collect();
                emu.kv_store(
                    &KvStore {
                        layout,
                        slots: &slots,
                    },
                    &rows,
                    &mut cache,
                )?;
                Ok(())
            }),
        });
    }

    let indexer_cases: Vec<(IndexKDtype, &str, usize)> =
        std::iter::once((IndexKDtype::Bf16, "bf16", big))
            .chain(s.batches.iter().map(|&b| (IndexKDtype::FP8, "fp8", b)))
            .collect();
    for (dtype, tag, batch) in indexer_cases {
        let layout = ik(dtype)?;
        let (context, heads) = (s.context, d.index_n_heads);
        out.push(Case {
            name: format!("indexer_logits/{tag}/b{batch}"),
            op: "indexer_logits",
            shape: format!("batch {batch} × context {context}, next_n 1, {heads} heads"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(3);
                let max_pages = context.div_ceil(layout.page_size());
                let pool = max_pages.next_power_of_two();
                let cache = filled_index_k_cache(&CpuBackend::new(), &mut r, layout, pool)?;
                let pages = scattered_pages(batch, max_pages, pool);
                let lens = vec![context as u32; batch];
                let hd = layout.head_dim();
                let q = emu.upload(&bf16_bytes(&bf16_values(&mut r, batch * heads * hd, 1.0)))?;
                let w = emu.upload(&f32_bytes(&f32_values(&mut r, batch * heads, 0.01)))?;
                let mut logits = emu.alloc(4 * batch * context)?;
                let op = IndexerLogits::decode(
                    layout,
                    heads,
                    PageTable::new(&pages, max_pages)?,
                    &lens,
                    1,
                    context,
                )?;
                emu.indexer_logits(&op, &q, &w, &cache, &mut logits)?;
                Ok(())
            }),
        });
    }

    for &batch in s.batches {
        let (context, k, ps) = (s.context, s.topk, d.page_size);
        out.push(Case {
            name: format!("topk/b{batch}"),
            op: "topk",
            shape: format!("{batch} rows × {context}, k {k}"),
            // A long row's chunks are merged by the last of them: sample a whole row.
            min_blocks: context.div_ceil(topk_chunk(k as u32) as usize) as u32,
            run: Box::new(move |emu| {
                let mut r = rng(4);
                let logits = emu.upload(&f32_bytes(&normal_values(&mut r, batch * context)))?;
                let max_pages = context.div_ceil(ps);
                let pages = scattered_pages(batch, max_pages, max_pages.next_power_of_two());
                let rows = decode_rows(&vec![context as u32; batch], 1)?;
                let mut out = emu.alloc(4 * batch * k)?;
                let op = Topk {
                    short_rows: sparsekit::host::ops::ShortRows::SelectValid,
                    k,
                    row_stride: context,
                    rows: &rows,
                    output: TopkOutput::Slots {
                        page_table: PageTable::new(&pages, max_pages)?,
                        page_size: ps,
                    },
                };
                emu.topk(&op, &logits, &mut out)?;
                Ok(())
            }),
        });
    }

    let mla_cases: Vec<(KvDtype, &str, usize)> = std::iter::once((KvDtype::Bf16, "bf16", big))
        .chain(s.batches.iter().map(|&b| (KvDtype::Fp8DsMla, "fp8", b)))
        .collect();
    for (dtype, tag, batch) in mla_cases {
        let layout = kv(dtype)?;
        let (heads, topk) = (s.mla_heads, s.topk);
        let pool = (topk.div_ceil(layout.page_size()) * 2).next_power_of_two();
        out.push(Case {
            name: format!("sparse_mla/{tag}/b{batch}"),
            op: "sparse_mla",
            shape: format!("{batch} tokens × {heads} heads, top-k {topk}"),
            // The head groups of one token share its keys, and the last of its top-k
            // splits merges them: sample a whole token.
            min_blocks: (heads.div_ceil(16) * topk.div_ceil(sparse_mla_split(topk as u32) as usize))
                as u32,
            run: Box::new(move |emu| {
                let mut r = rng(5);
                let cache = filled_kv_cache(&CpuBackend::new(), &mut r, layout, pool)?;
                let capacity = pool * layout.page_size();
                let mut idx = Vec::with_capacity(batch * topk);
                for _ in 0..batch {
                    let picked = rand::seq::index::sample(&mut r, capacity, topk);
                    idx.extend(picked.into_iter().map(|s| s as i32));
                }
                let q = emu.upload(&bf16_bytes(&bf16_values(
                    &mut r,
                    batch * heads * layout.d_qk(),
                    1.0,
                )))?;
                let indices = emu.upload(&i32_bytes(&idx))?;
                let mut out = emu.alloc(2 * batch * heads * layout.nope_dim())?;
                let mut lse = emu.alloc(4 * batch * heads)?;
                let op = SparseMla {
                    layout,
                    n_tokens: batch,
                    n_heads: heads,
                    topk,
                    softmax_scale: 1.0 / (layout.d_qk() as f32).sqrt(),
                };
                emu.sparse_mla(&op, &q, &cache, &indices, &mut out, &mut lse)?;
                Ok(())
            }),
        });
    }

    let copy_layouts: [(PageLayout, &str); 2] = [
        (kv(KvDtype::Bf16)?.into(), "kv_bf16"),
        (ik(IndexKDtype::FP8)?.into(), "index_k_fp8"),
    ];
    for (layout, tag) in copy_layouts {
        let n = s.copy_pages;
        out.push(Case {
            name: format!("copy_pages/{tag}"),
            op: "copy_pages",
            shape: format!("{n} pages × {} B", layout.bytes_per_page()),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let pool = 2 * n;
                let region = PagedRegion::contiguous(layout, pool);
                let src = emu.alloc(layout.bytes_per_page() * pool)?;
                let mut dst = emu.alloc(layout.bytes_per_page() * pool)?;
                let src_ids: Vec<i32> = (0..n as i32).map(|i| (i * 7) % pool as i32).collect();
                let dst_ids: Vec<i32> = (0..n as i32).map(|i| (i * 5 + 1) % pool as i32).collect();
                let op = CopyPages {
                    src: region,
                    dst: region,
                    src_ids: &src_ids,
                    dst_ids: &dst_ids,
                };
                emu.copy_pages(&op, &src, &mut dst)?;
                Ok(())
            }),
        });
    }
    {
        let layout: PageLayout = kv(KvDtype::Bf16)?.into();
        let n = s.copy_pages;
        out.push(Case {
            name: "page_checksums/kv_bf16".into(),
            op: "page_checksums",
            shape: format!("{n} pages × {} B", layout.bytes_per_page()),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let region = PagedRegion::contiguous(layout, n);
                let pool = emu.alloc(layout.bytes_per_page() * n)?;
                let ids: Vec<i32> = (0..n as i32).rev().collect();
                let mut sums = emu.alloc(8 * n)?;
                emu.page_checksums(&PageChecksums { region, ids: &ids }, &pool, &mut sums)?;
                Ok(())
            }),
        });
    }
    v4::cases(s, &mut out)?;
    dense_cases(s, &mut out);
    Ok(out)
}

/// The dense kernels of the model at DeepSeek-V3.2's dense shapes (hidden 7168, q rank
/// 1536, SwiGLU width 2048, 128 rope heads of 64, vocabulary 129280; `--quick`: a quarter
/// of each), for the decode batches of the run; the gated pooling at DeepSeek-V4's CSA
/// compressor shape (windows of 8 raw tokens overlapping by 4, head_dim 512), one entry
/// per row of the batch.
fn dense_cases(s: Sizes, out: &mut Vec<Case>) {
    let q = s.dense_divisor;
    let (hidden, q_rank, inter, heads, rope, vocab) =
        (7168 / q, 1536 / q, 2048 / q, 128 / q, 64, 129_280 / q);
    for &rows in s.batches {
        out.push(Case {
            name: format!("dense_matmul/b{rows}"),
            op: "dense_matmul",
            shape: format!("{rows} × {hidden} · {hidden} × {q_rank}"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(20);
                let x = emu.upload(&f32_bytes(&f32_values(&mut r, rows * hidden, 1.0)))?;
                let w = emu.upload(&f32_bytes(&f32_values(&mut r, hidden * q_rank, 0.02)))?;
                let mut o = emu.alloc(rows * q_rank * 4)?;
                let op = Matmul {
                    accumulate: Accumulate::Overwrite,
                    ..Matmul::dense(rows, hidden, q_rank)
                };
                emu.matmul(&op, &x, &w, &mut o)?;
                Ok(())
            }),
        });
        out.push(Case {
            name: format!("dense_rms_norm/b{rows}"),
            op: "dense_rms_norm",
            shape: format!("{rows} × {hidden}"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(21);
                let x = emu.upload(&f32_bytes(&f32_values(&mut r, rows * hidden, 1.0)))?;
                let g = emu.upload(&f32_bytes(&f32_values(&mut r, hidden, 1.0)))?;
                let mut o = emu.alloc(rows * hidden * 4)?;
                let op = RmsNorm {
                    rows,
                    width: hidden,
                    eps: 1e-6,
                    x: View::dense(hidden),
                    out: View::dense(hidden),
                };
                emu.rms_norm(&op, &x, &g, &mut o)?;
                Ok(())
            }),
        });
        out.push(Case {
            name: format!("dense_rope/b{rows}"),
            op: "dense_rope",
            shape: format!("{rows} × {heads} heads × {rope}"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(22);
                let table = emu.upload(&f32_bytes(&rope_table(rope, 4096, 10000.0)))?;
                let x = emu.upload(&f32_bytes(&f32_values(&mut r, rows * heads * rope, 1.0)))?;
                let mut o = emu.alloc(rows * heads * rope * 4)?;
                let positions: Vec<u32> = (0..rows as u32).map(|i| 4000 - 7 * i).collect();
                let op = Rope {
                    heads,
                    rope_dim: rope,
                    positions: &positions,
                    max_positions: 4096,
                    x: View::grouped(heads, rope),
                    out: View::grouped(heads, rope),
                };
                emu.rope(&op, &table, &x, &mut o)?;
                Ok(())
            }),
        });
        out.push(Case {
            name: format!("dense_swiglu/b{rows}"),
            op: "dense_swiglu",
            shape: format!("{rows} × {inter}"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(23);
                let gu = emu.upload(&f32_bytes(&f32_values(&mut r, rows * 2 * inter, 4.0)))?;
                let mut o = emu.alloc(rows * inter * 4)?;
                emu.swiglu(&SwiGlu { rows, width: inter }, &gu, &mut o)?;
                Ok(())
            }),
        });
        out.push(Case {
            name: format!("dense_gather_rows/b{rows}"),
            op: "dense_gather_rows",
            shape: format!("{rows} rows of {hidden} (embedding lookup)"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(24);
                let table = emu.upload(&f32_bytes(&f32_values(&mut r, 1024 * hidden, 1.0)))?;
                let ids: Vec<u32> = (0..rows as u32).map(|i| (i * 389) % 1024).collect();
                let mut o = emu.alloc(rows * hidden * 4)?;
                let op = GatherRows {
                    width: hidden,
                    rows: &ids,
                    src_rows: 1024,
                    x: View::dense(hidden),
                    out: View::dense(hidden),
                };
                emu.gather_rows(&op, &table, &mut o)?;
                Ok(())
            }),
        });
        out.push(Case {
            name: format!("dense_add/b{rows}"),
            op: "dense_add",
            shape: format!("{rows} × {hidden}"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(25);
                let x = emu.upload(&f32_bytes(&f32_values(&mut r, rows * hidden, 1.0)))?;
                let mut acc = emu.upload(&f32_bytes(&f32_values(&mut r, rows * hidden, 1.0)))?;
                let op = Add {
                    rows,
                    width: hidden,
                    x: View::dense(hidden),
                    acc: View::dense(hidden),
                };
                emu.add(&op, &x, &mut acc)?;
                Ok(())
            }),
        });
        out.push(Case {
            name: format!("dense_cast/b{rows}"),
            op: "dense_cast",
            shape: format!("{rows} × {heads} heads × {rope} f32 → bf16"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(26);
                let x = emu.upload(&f32_bytes(&f32_values(&mut r, rows * heads * rope, 1.0)))?;
                let mut o = emu.alloc(rows * heads * rope * 2)?;
                let op = Cast {
                    rows,
                    groups: heads,
                    width: rope,
                    from: DenseDtype::F32,
                    to: DenseDtype::Bf16,
                    x: View::grouped(heads, rope),
                    out: View::grouped(heads, rope),
                };
                emu.cast(&op, &x, &mut o)?;
                Ok(())
            }),
        });
        out.push(Case {
            name: format!("dense_argmax/b{rows}"),
            op: "dense_argmax",
            shape: format!("{rows} × {vocab} logits"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(27);
                let l = emu.upload(&f32_bytes(&f32_values(&mut r, rows * vocab, 1.0)))?;
                let mut o = emu.alloc(rows * 4)?;
                emu.argmax(&Argmax { rows, width: vocab }, &l, &mut o)?;
                Ok(())
            }),
        });
        let (span, pool_width) = (8, 512 / q);
        out.push(Case {
            name: format!("dense_gated_pool/b{rows}"),
            op: "dense_gated_pool",
            shape: format!("{rows} entries × {span} slots × {pool_width}"),
            min_blocks: 1,
            run: Box::new(move |emu| {
                let mut r = rng(28);
                // Entry e pools raw rows 4e .. 4e + 8 (CSA: ratio 4, windows overlap by half).
                let raw = 4 * rows + 4;
                let x = emu.upload(&f32_bytes(&f32_values(&mut r, raw * 2 * pool_width, 1.0)))?;
                let bias = emu.upload(&f32_bytes(&f32_values(&mut r, span * pool_width, 1.0)))?;
                let sources: Vec<u32> = (0..rows * span)
                    .map(|k| (4 * (k / span) + k % span) as u32)
                    .collect();
                let mut o = emu.alloc(rows * pool_width * 4)?;
                let op = GatedPool {
                    entries: rows,
                    span,
                    width: pool_width,
                    sources: &sources,
                    rows: raw,
                };
                emu.gated_pool(&op, &x, &bias, &mut o)?;
                Ok(())
            }),
        });
    }
}

/// Registers per thread of `kernel` at `arch`, from the embedded ptxas logs.
fn registers(kernel: &str, arch: &str) -> Option<u32> {
    report()
        .into_iter()
        .find(|k| k.kernel == kernel && k.arch == arch)
        .map(|k| k.registers)
}

/// One access site of a profile (for `--sites` and JSON).
#[derive(Debug, Serialize)]
struct SiteRecord {
    location: String,
    space: &'static str,
    op: String,
    instructions: u64,
    active_lanes: Option<f64>,
    efficiency: Option<f64>,
    ways: Option<f64>,
    widths: String,
}

impl SiteRecord {
    fn of(s: &SiteProfile) -> Self {
        SiteRecord {
            location: s.location.clone(),
            space: match s.space {
                Some(Space::Global) => "global",
                _ => "shared",
            },
            op: s.op.map_or("?".into(), |o| o.to_string()),
            instructions: s.instructions,
            active_lanes: s.active_lanes(),
            efficiency: s.efficiency(),
            ways: s.ways(),
            widths: widths_label(&s.widths),
        }
    }
}

/// One kernel launch of one case.
#[derive(Debug, Serialize)]
struct Record {
    case: String,
    op: &'static str,
    shape: String,
    kernel: String,
    grid: u32,
    block: u32,
    smem_bytes: usize,
    blocks_emulated: u32,
    /// The GPU the trace emulated: `generic` (every arch's PTX) or `sm_120a`.
    target: &'static str,
    registers_sm_90: Option<u32>,
    registers_sm_120: Option<u32>,
    registers_sm_120a: Option<u32>,
    access: AccessSummary,
    totals: GridTotals,
    /// Per device; empty when no ptxas report is embedded.
    predictions: Vec<Prediction>,
    sites: Vec<SiteRecord>,
}

/// Ops whose kernel takes an arch-specific path on `sm_120a` (the block-scaled MXFP8 score
/// product of `sparse_mla_v4`): traced a second time as `sm_120a`, and that trace models the
/// devices that load the `sm_120a` image. Every other kernel's code is the same on every
/// arch, so its generic trace models all devices.
const SM120A_OPS: &[&str] = &["sparse_mla_v4"];

/// Whether a trace on `target` models `dev`.
fn models(case: &Case, target: EmuTarget, dev: &DeviceSpec) -> bool {
    let specific = dev.arch.ends_with('a');
    match target {
        EmuTarget::Sm120a => specific,
        EmuTarget::Generic => !specific || !SM120A_OPS.contains(&case.op),
    }
}

fn record(case: &Case, p: &Profile, target: EmuTarget) -> Record {
    let totals = GridTotals::of(p);
    let predictions = DEVICES
        .iter()
        .filter(|dev| models(case, target, dev))
        .filter_map(|dev| {
            let regs = registers(&p.kernel, dev.arch)?;
            let occ = occupancy(dev, p.block, regs, p.smem_bytes as u32);
            Some(predict(dev, occ, p.grid, totals))
        })
        .collect();
    Record {
        case: case.name.clone(),
        op: case.op,
        shape: case.shape.clone(),
        kernel: p.kernel.clone(),
        grid: p.grid,
        block: p.block,
        smem_bytes: p.smem_bytes,
        blocks_emulated: p.blocks_run,
        target: target.name(),
        registers_sm_90: registers(&p.kernel, "sm_90"),
        registers_sm_120: registers(&p.kernel, "sm_120"),
        registers_sm_120a: registers(&p.kernel, "sm_120a"),
        access: AccessSummary::of(p),
        totals,
        predictions,
        sites: p.sites.iter().map(SiteRecord::of).collect(),
    }
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v))
}

fn num(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.digits$}"))
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    if args.backend != "emu" {
        return Err(format!(
            "profile traces the kernels in the emulator: --backend emu (got {:?}); time a \
             backend with `sparsekit bench`",
            args.backend
        )
        .into());
    }
    if let Some(bad) = args.op.iter().find(|o| !OPS.contains(&o.as_str())) {
        return Err(format!("unknown op {bad:?} (ops: {})", OPS.join(", ")).into());
    }
    let all = cases(Sizes::new(args.quick))?;
    let selected: Vec<&Case> = all
        .iter()
        .filter(|c| args.op.is_empty() || args.op.iter().any(|o| o == c.op))
        .collect();
    let bar = ProgressBar::new(selected.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
            .map_err(|e| e.to_string())?,
    );
    let mut records = Vec::new();
    for case in &selected {
        bar.set_message(case.name.clone());
        let mut targets = vec![EmuTarget::Generic];
        if SM120A_OPS.contains(&case.op) {
            targets.push(EmuTarget::Sm120a);
        }
        for target in targets {
            let emu = EmuBackend::profiling(args.blocks.max(case.min_blocks)).with_target(target);
            (case.run)(&emu).map_err(|e| format!("{}: {e}", case.name))?;
            for p in emu.take_profiles() {
                records.push(record(case, &p, target));
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    if args.json {
        #[derive(Serialize)]
        struct Out<'a> {
            devices: &'a [sparsekit::perf_model::DeviceSpec],
            kernels: &'a [Record],
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&Out {
                devices: &DEVICES,
                kernels: &records,
            })?
        );
        return Ok(ExitCode::SUCCESS);
    }
    print_tables(&records, args.sites);
    Ok(ExitCode::SUCCESS)
}

/// The case's name, with the emulated target when it is not the generic one.
fn case_label(r: &Record) -> String {
    if r.target == EmuTarget::Generic.name() {
        r.case.clone()
    } else {
        format!("{} [{}]", r.case, r.target)
    }
}

fn print_tables(records: &[Record], sites: bool) {
    let mut t = Table::new([
        "case",
        "grid×block",
        "gld_eff",
        "gst_eff",
        "ld_widths",
        "st_widths",
        "smem_ways",
        "worst_site",
        "lanes",
        "bar/blk",
        "regs 90/120/120a",
    ]);
    for r in records {
        let a = &r.access;
        t.row([
            case_label(r),
            format!("{}×{}", r.grid, r.block),
            pct(a.load_efficiency),
            pct(a.store_efficiency),
            widths_label(&a.load_widths),
            widths_label(&a.store_widths),
            num(a.smem_ways, 2),
            num(a.smem_worst_ways, 2),
            pct(a.active_lanes),
            format!("{:.1}", a.barriers_per_block),
            [r.registers_sm_90, r.registers_sm_120, r.registers_sm_120a]
                .map(|x| x.map_or("?".into(), |x| x.to_string()))
                .join("/"),
        ]);
    }
    println!("Accesses (emulated blocks, per warp-level instruction):");
    print!("{}", t.render());

    let mut m = Table::new([
        "case",
        "device",
        "blocks/SM",
        "waves",
        "MB",
        "GFLOP",
        "t_mem_us",
        "t_mma_us",
        "predicted_us",
        "bound",
    ]);
    for r in records {
        for p in &r.predictions {
            m.row([
                case_label(r),
                p.device.to_string(),
                format!("{} ({})", p.occupancy.blocks_per_sm, p.occupancy.limiter),
                format!("{:.2}", p.waves),
                format!("{:.1}", r.totals.bytes / 1e6),
                format!("{:.1}", r.totals.mma_flops / 1e9),
                format!("{:.1}", p.memory_us),
                format!("{:.1}", p.mma_us),
                format!("{:.1}", p.time_us),
                p.bound.to_string(),
            ]);
        }
    }
    println!();
    if records.iter().all(|r| r.predictions.is_empty()) {
        println!("Model: no ptxas report embedded (build with the GPU toolchain for occupancy and time).");
    } else {
        println!("Model (occupancy from ptxas registers and the launch; time = max(bytes/BW, FLOPs/peak) / SM fill × wave tail):");
        print!("{}", m.render());
    }
    println!();
    for d in &DEVICES {
        println!(
            "{}: {} SMs, {:.2} TB/s, {:.1} TFLOP/s bf16 mma — {}",
            d.name,
            d.sms,
            d.bandwidth / 1e12,
            d.mma_bf16_flops / 1e12,
            d.source
        );
    }
    if sites {
        let mut s = Table::new([
            "case", "site", "space", "op", "instr", "lanes", "eff", "ways", "widths",
        ]);
        for r in records {
            for x in &r.sites {
                s.row([
                    case_label(r),
                    x.location.clone(),
                    x.space.to_string(),
                    x.op.clone(),
                    x.instructions.to_string(),
                    pct(x.active_lanes),
                    pct(x.efficiency),
                    num(x.ways, 2),
                    x.widths.clone(),
                ]);
            }
        }
        println!();
        println!("Sites:");
        print!("{}", s.render());
    }
}
