//! Golden files: a round trip per op (inputs from the fixtures, expected outputs from the
//! f64 references, written, read back, checked on the CPU backend) that must pass and,
//! with one expected value corrupted, must fail; the files of
//! `validation/python/make_golden.py` (NumPy + ml_dtypes) must pass on cpu and emu, those
//! of other deployments' conventions only when they state them; malformed files give
//! typed errors.
//!
//! The Python part needs `python3` with the packages of
//! `validation/python/requirements.txt`; without them it says so and passes, unless
//! `SPARSEKIT_REQUIRE_PYTHON=1` (set by `.ci/run`), where it fails.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use bytemuck::Pod;
use half::bf16;
use rand::seq::SliceRandom;
use rand::Rng;
use sparsekit_host::dims::ModelDims;
use sparsekit_host::dtype::ScaleFormat;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{
    decode_rows, IndexKStore, IndexerLogits, KvStore, Op, PageTable, QueryRange, SparseMla, Topk,
    TopkOutput,
};
use sparsekit_host::{CpuBackend, EmuBackend};
use sparsekit_validation::fixtures::{self, case_rng, Paging, SuiteRng};
use sparsekit_validation::golden::{check_file, Decode, Dtype, Golden, GoldenError, Tensor};
use sparsekit_validation::reference;
use sparsekit_validation::tolerance::{self, Quantity};

const D: ModelDims = ModelDims::TINY;

fn seed() -> u64 {
    std::env::var("SPARSEKIT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random)
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sparsekit-golden-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Replaces the values of tensor `name` by `f` applied to them.
fn edit<T: Pod>(g: &mut Golden, name: &str, f: impl FnOnce(&mut Vec<T>)) {
    let t = g.tensors.get_mut(name).unwrap();
    let mut v: Vec<T> = t.values();
    f(&mut v);
    t.data = bytemuck::cast_slice(&v).to_vec();
}

/// Writes `g`, checks the file (must pass), corrupts it with `corrupt` and checks again
/// (must fail).
fn round_trip(name: &str, seed: u64, g: &Golden, corrupt: impl FnOnce(&mut Golden)) {
    let dir = scratch(name);
    let path = dir.join(format!("{name}.safetensors"));
    g.write_file(&path).unwrap();
    let cpu = CpuBackend::new();
    let report = check_file(&cpu, &path).unwrap();
    assert!(report.pass(), "{name} (SPARSEKIT_SEED={seed}): {report:#?}");
    let mut bad = g.clone();
    corrupt(&mut bad);
    bad.write_file(&path).unwrap();
    let report = check_file(&cpu, &path).unwrap();
    assert!(
        !report.pass(),
        "{name}: a corrupted file passed: {report:#?}"
    );
    assert!(report.quantities.iter().any(|q| !q.detail.is_empty()));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// New tokens of 5 requests (one crossing a page) with `-1` entries: (paging, slots).
fn store_batch(rng: &mut SuiteRng) -> (Paging, Vec<i64>) {
    let existing: Vec<u32> = (0..5).map(|_| rng.gen_range(0..100)).collect();
    let new: Vec<u32> = (0..5)
        .map(|i| {
            if i == 0 {
                D.page_size as u32 + 1
            } else {
                rng.gen_range(1..=20)
            }
        })
        .collect();
    let lens: Vec<u32> = existing.iter().zip(&new).map(|(a, b)| a + b).collect();
    let paging = Paging::new(rng, D.page_size, &lens, 2);
    let mut slots = Vec::new();
    for r in 0..5 {
        slots.extend((existing[r]..lens[r]).map(|p| paging.slot(r, p as usize)));
        slots.push(-1);
    }
    (paging, slots)
}

/// Index of the first written slot's first key byte inside `cache_out`.
fn first_written_byte(
    slots: &[i64],
    bytes_per_page: usize,
    token_offset: impl Fn(usize) -> usize,
) -> usize {
    let s = *slots.iter().find(|&&s| s >= 0).unwrap() as usize;
    (s / D.page_size) * bytes_per_page + token_offset(s % D.page_size)
}

#[test]
fn index_k_store_round_trip() {
    let seed = seed();
    for (i, dt) in [
        IndexKDtype::FP8,
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Ue8m0,
        },
        IndexKDtype::Bf16,
    ]
    .into_iter()
    .enumerate()
    {
        let rng = &mut case_rng(seed, i as u64);
        let layout = IndexKLayout::new(dt, D.index_head_dim, D.page_size).unwrap();
        let (paging, slots) = store_batch(rng);
        let cache_in = fixtures::garbage(rng, layout.buffer_bytes(paging.num_pages));
        let keys = fixtures::token_rows(rng, slots.len(), layout.head_dim());
        let op = IndexKStore {
            layout,
            slots: &slots,
        };
        let g = Golden::index_k_store(&op, &keys, &cache_in).unwrap();
        let at = first_written_byte(&slots, layout.bytes_per_page(), |o| {
            layout.value_range(o).start
        });
        round_trip(&format!("index_k_store_{}", dt.name()), seed, &g, |g| {
            edit::<u8>(g, "cache_out", |c| c[at] ^= 0x01)
        });
    }
}

#[test]
fn kv_store_round_trip() {
    let seed = seed();
    for (i, dt) in [KvDtype::Bf16, KvDtype::Fp8DsMla].into_iter().enumerate() {
        let rng = &mut case_rng(seed, 10 + i as u64);
        let layout = KvLayout::new(dt, D.kv_lora_rank, D.qk_rope_dim, D.page_size).unwrap();
        let (paging, slots) = store_batch(rng);
        let cache_in = fixtures::garbage(rng, layout.buffer_bytes(paging.num_pages));
        let kv = fixtures::token_rows(rng, slots.len(), layout.d_qk());
        let op = KvStore {
            layout,
            slots: &slots,
        };
        let g = Golden::kv_store(&op, &kv, &cache_in).unwrap();
        // The last byte of the first written token's rope.
        let at = first_written_byte(&slots, layout.bytes_per_page(), |o| {
            layout.token_range(o).start + layout.rope_range().end - 1
        });
        round_trip(&format!("kv_store_{}", dt.name()), seed, &g, |g| {
            edit::<u8>(g, "cache_out", |c| c[at] ^= 0x80)
        });
    }
}

/// Rows of a prefill batch: causal rows at each request's end and a window `start > 0`.
fn prefill_rows(lens: &[u32]) -> Vec<QueryRange> {
    let mut rows = Vec::new();
    for (r, &len) in lens.iter().enumerate() {
        let request = r as u32;
        rows.push(QueryRange {
            request,
            start: 0,
            end: len,
        });
        if len > 2 {
            rows.push(QueryRange {
                request,
                start: 0,
                end: len - 1,
            });
            rows.push(QueryRange {
                request,
                start: len / 2,
                end: len,
            });
        }
    }
    rows
}

#[test]
fn indexer_logits_round_trip() {
    let seed = seed();
    let ps = D.page_size as u32;
    let lens = [2, ps - 1, ps + 1, 77, 300];
    let cases = [
        (IndexKDtype::FP8, true),
        (
            IndexKDtype::Fp8E4m3 {
                scale: ScaleFormat::Ue8m0,
            },
            false,
        ),
        (IndexKDtype::Bf16, true),
        (IndexKDtype::Bf16, false),
    ];
    for (i, (dt, decode)) in cases.into_iter().enumerate() {
        let rng = &mut case_rng(seed, 20 + i as u64);
        let layout = IndexKLayout::new(dt, D.index_head_dim, D.page_size).unwrap();
        let paging = Paging::new(rng, D.page_size, &lens, 3);
        let cache = fixtures::index_k_pool(rng, &layout, &paging);
        let next_n = 2;
        let rows = if decode {
            decode_rows(&lens, next_n).unwrap()
        } else {
            prefill_rows(&lens)
        };
        let row_stride = 300 + 13;
        let h = D.index_n_heads;
        let q = fixtures::bf16_normal(rng, rows.len() * h * layout.head_dim(), 1.0);
        let scale = 1.0 / ((h * layout.head_dim()) as f64).sqrt();
        let w: Vec<f32> = (0..rows.len() * h)
            .map(|_| (fixtures::normal(rng) * scale) as f32)
            .collect();
        let pt = PageTable::new(&paging.table, paging.max_pages).unwrap();
        let op = IndexerLogits {
            layout,
            n_heads: h,
            page_table: pt,
            rows: rows.clone(),
            row_stride,
        };
        let form = decode.then_some(Decode {
            context_lens: &lens,
            next_n,
        });
        let g = Golden::indexer_logits(&op, form, &q, &w, &cache).unwrap();
        // Move the logit with the largest magnitude by three times its tolerance.
        let r = reference::indexer_logits(&layout, &cache, &pt, &rows, h, &q, &w, row_stride);
        let atol = tolerance::get(Op::IndexerLogits, Quantity::Logits, dt.into())
            .unwrap()
            .atol;
        let (at, mag) = r
            .magnitude
            .iter()
            .copied()
            .enumerate()
            .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
        let name = format!(
            "indexer_logits_{}_{}",
            dt.name(),
            if decode { "decode" } else { "prefill" }
        );
        round_trip(&name, seed, &g, |g| {
            edit::<f32>(g, "logits", |l| l[at] += (3.0 * atol * mag) as f32)
        });
        // Expected logits from another kernel: the bound doubles.
        let mut kernel = g.clone();
        kernel.params["expected_from"] = "kernel".into();
        let report = kernel.check(&CpuBackend::new()).unwrap();
        assert!(report.pass(), "{report:#?}");
        assert!(
            report.quantities[0].tolerance.starts_with("4.00e-5"),
            "{report:#?}"
        );
    }
}

/// Logits with many ties (values on a coarse grid), `-inf` and NaN entries, and a first
/// row of equal values.
fn tied_logits(rng: &mut SuiteRng, rows: &[QueryRange], stride: usize) -> Vec<f32> {
    let mut l = vec![f32::NEG_INFINITY; rows.len() * stride];
    for (i, r) in rows.iter().enumerate() {
        for x in &mut l[i * stride..i * stride + r.end as usize] {
            *x = match rng.gen_range(0..20) {
                0 => f32::NEG_INFINITY,
                1 => f32::NAN,
                _ if i == 0 => 1.5,
                _ => (fixtures::normal(rng) * 4.0).round() as f32 / 4.0,
            };
        }
    }
    l
}

#[test]
fn topk_round_trip() {
    let seed = seed();
    let rng = &mut case_rng(seed, 30);
    let k = D.index_topk;
    // Positions output, explicit rows (windows with start > 0, a row shorter than k).
    let rows: Vec<QueryRange> = [
        (0, 0, 500),
        (1, 0, 3000),
        (2, 0, 10),
        (3, 0, k + 1),
        (1, 700, 1900),
    ]
    .iter()
    .map(|&(request, start, end)| QueryRange {
        request,
        start,
        end: end as u32,
    })
    .collect();
    let stride = 3000 + 5;
    let logits = tied_logits(rng, &rows, stride);
    let op = Topk {
        short_rows: sparsekit_host::ops::ShortRows::SelectValid,
        k,
        row_stride: stride,
        rows: &rows,
        output: TopkOutput::Positions,
    };
    let g = Golden::topk(&op, None, &logits).unwrap();
    round_trip("topk_positions", seed, &g, |g| {
        edit::<i32>(g, "topk", |t| t[0] = -1)
    });

    // Another choice among tied positions is judged by value: passes, with a note.
    let mut tied = g.clone();
    let row0: Vec<i32> = tied.tensors["topk"].values::<i32>()[..k].to_vec();
    let spare = (0..500)
        .find(|p| !row0.contains(p) && logits[*p as usize] == 1.5)
        .unwrap();
    edit::<i32>(&mut tied, "topk", |t| t[k - 1] = spare);
    let report = tied.check(&CpuBackend::new()).unwrap();
    assert!(report.pass(), "{report:#?}");
    assert_eq!(report.notes.len(), 1, "{:?}", report.notes);

    // Slots output, decode form.
    let lens = [4100, 700, 10, k as u32 + 1];
    let paging = Paging::new(rng, D.page_size, &lens, 1);
    let rows = decode_rows(&lens, 1).unwrap();
    let stride = 4100 + 3;
    let logits = tied_logits(rng, &rows, stride);
    let pt = PageTable::new(&paging.table, paging.max_pages).unwrap();
    let output = TopkOutput::Slots {
        page_table: pt,
        page_size: D.page_size,
    };
    let op = Topk {
        short_rows: sparsekit_host::ops::ShortRows::SelectValid,
        k,
        row_stride: stride,
        rows: &rows,
        output,
    };
    let g = Golden::topk(
        &op,
        Some(Decode {
            context_lens: &lens,
            next_n: 1,
        }),
        &logits,
    )
    .unwrap();
    // Swap in the slot of a valid position of row 1 below its threshold.
    let row1 = &logits[stride..stride + lens[1] as usize];
    let mut vals: Vec<f32> = row1.iter().copied().filter(|x| x.is_finite()).collect();
    vals.sort_by(|a, b| b.total_cmp(a));
    let low = (0..row1.len())
        .find(|&p| row1[p].is_finite() && row1[p] < vals[k - 1])
        .unwrap();
    let spare = paging.slot(1, low) as i32;
    round_trip("topk_slots", seed, &g, |g| {
        edit::<i32>(g, "topk", |t| t[k + 3] = spare)
    });
    // The report of that one wrong entry: one failure among n·k entries, each counted
    // once, err/tol infinite (an exact op), named by its row.
    let mut one = g.clone();
    edit::<i32>(&mut one, "topk", |t| t[k + 3] = spare);
    let report = one.check(&CpuBackend::new()).unwrap();
    let q = &report.quantities[0];
    assert!(!q.pass);
    assert_eq!(
        (q.stats.count, q.stats.failures),
        (rows.len() * k, 1),
        "{q:#?}"
    );
    assert_eq!(q.stats.worst_ratio, f64::INFINITY);
    assert!(
        q.detail.starts_with("1 failures; first at row 1"),
        "{}",
        q.detail
    );
}

#[test]
fn sparse_mla_round_trip() {
    let seed = seed();
    for (i, dt) in [KvDtype::Bf16, KvDtype::Fp8DsMla].into_iter().enumerate() {
        let rng = &mut case_rng(seed, 40 + i as u64);
        let layout = KvLayout::new(dt, D.kv_lora_rank, D.qk_rope_dim, D.page_size).unwrap();
        let lens = [1, D.page_size as u32 + 1, 90, 300];
        let paging = Paging::new(rng, D.page_size, &lens, 2);
        let cache = fixtures::kv_pool(rng, &layout, &paging);
        let (n_tokens, h, topk) = (6, D.q_heads[0], D.index_topk);
        // Token 0 has no valid slot, token 1 a few; the others up to topk, with -1s.
        let mut indices = vec![-1i32; n_tokens * topk];
        for t in 0..n_tokens {
            let r = t % lens.len();
            let mut pos: Vec<usize> = (0..lens[r] as usize).collect();
            pos.shuffle(rng);
            let n = match t {
                0 => 0,
                1 => 3.min(pos.len()),
                _ => topk.min(pos.len()),
            };
            let row = &mut indices[t * topk..(t + 1) * topk];
            for (dst, &p) in row.iter_mut().zip(&pos[..n]) {
                *dst = paging.slot(r, p) as i32;
            }
            row.shuffle(rng);
        }
        let q = fixtures::bf16_normal(rng, n_tokens * h * layout.d_qk(), 1.0);
        let op = SparseMla {
            layout,
            n_tokens,
            n_heads: h,
            topk,
            softmax_scale: 1.0 / (layout.d_qk() as f32).sqrt(),
        };
        let g = Golden::sparse_mla(&op, &q, &cache, &indices).unwrap();
        round_trip(&format!("sparse_mla_{}", dt.name()), seed, &g, |g| {
            // Flip the sign of the largest output.
            edit::<bf16>(g, "out", |o| {
                let at = (0..o.len())
                    .max_by(|&a, &b| o[a].to_f32().abs().total_cmp(&o[b].to_f32().abs()))
                    .unwrap();
                o[at] = -o[at];
            })
        });
    }
}

fn python_files(dir: &Path) -> Option<Vec<PathBuf>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/make_golden.py");
    let required = std::env::var("SPARSEKIT_REQUIRE_PYTHON").is_ok_and(|v| v == "1");
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(dir);
    if let Ok(seed) = std::env::var("SPARSEKIT_SEED") {
        cmd.args(["--seed", &seed]);
    }
    match cmd.output() {
        Ok(o) if o.status.success() => {
            let stdout = String::from_utf8_lossy(&o.stdout).to_string();
            eprintln!("make_golden.py: {}", stdout.lines().next().unwrap_or(""));
            Some(stdout.lines().skip(1).map(PathBuf::from).collect())
        }
        Ok(o) => {
            let msg = String::from_utf8_lossy(&o.stderr).to_string();
            assert!(!required, "make_golden.py failed: {msg}");
            let _ = writeln!(std::io::stderr(), "SKIPPED golden files from NumPy + ml_dtypes (pip install -r validation/python/requirements.txt): {msg}");
            None
        }
        Err(e) => {
            assert!(!required, "python3 not runnable: {e}");
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED golden files from NumPy + ml_dtypes: python3 not runnable: {e}"
            );
            None
        }
    }
}

#[test]
fn numpy_ml_dtypes_golden_files_pass() {
    let dir = scratch("python");
    let Some(files) = python_files(&dir) else {
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    };
    let cpu = CpuBackend::new();
    let mut ops = std::collections::BTreeSet::new();
    let mut conventions = std::collections::BTreeSet::new();
    for f in &files {
        let report = check_file(&cpu, f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(
            report.pass(),
            "{} ({:?}): {report:#?}",
            f.display(),
            report.metadata.get("seed")
        );
        let on_emu = check_file(&EmuBackend::new(), f)
            .unwrap_or_else(|e| panic!("emu: {}: {e}", f.display()));
        assert!(on_emu.pass(), "emu: {}: {on_emu:#?}", f.display());
        ops.insert(report.op);
        let g = Golden::read_file(f).unwrap();
        // A corrupted expected output fails, with or without conventions.
        let mut bad = g.clone();
        corrupt(&mut bad);
        let r = bad.check(&cpu);
        assert!(
            r.as_ref().map_or(true, |r| !r.pass()),
            "{}: a corrupted file passed",
            f.display()
        );
        // A file that states conventions needs them: without, it fails or is refused.
        if let Some(c) = g.params.get("conventions").and_then(|c| c.as_object()) {
            conventions.extend(c.keys().cloned());
            let mut bare = g.clone();
            bare.params.as_object_mut().unwrap().remove("conventions");
            let r = bare.check(&cpu);
            assert!(
                r.as_ref().map_or(true, |r| !r.pass()),
                "{} passes without its conventions {c:?}",
                f.display()
            );
        }
    }
    assert_eq!(ops.len(), 6, "one file per op at least: {ops:?}");
    let every: std::collections::BTreeSet<String> = [
        "scale",
        "quantize",
        "key_dequant",
        "topk_padding",
        "empty_lse",
        "lse_layout",
        "invalid_indices",
    ]
    .map(String::from)
    .into();
    assert_eq!(conventions, every, "one file per convention");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each convention file of `make_golden.py` passes on cpu and emu when it states its
/// convention, and fails (or is refused) when it states a wrong one; files in our
/// conventions that claim another's fail too.
#[test]
fn files_that_misstate_their_conventions_fail() {
    let dir = scratch("lies");
    let Some(files) = python_files(&dir) else {
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    };
    let (cpu, emu) = (CpuBackend::new(), EmuBackend::new());
    let file = |stem: &str| {
        let f = files
            .iter()
            .find(|f| f.file_stem().is_some_and(|s| s == stem))
            .unwrap_or_else(|| panic!("make_golden.py wrote no {stem}"));
        Golden::read_file(f).unwrap()
    };
    // `g` with `params.conventions` replaced by `c` (JSON; `null` removes it).
    let stating = |g: &Golden, c: serde_json::Value| {
        let mut g = g.clone();
        let p = g.params.as_object_mut().unwrap();
        if c.is_null() {
            p.remove("conventions");
        } else {
            p.insert("conventions".into(), c);
        }
        g
    };
    let passes = |what: &str, g: &Golden| {
        for r in [g.check(&cpu), g.check(&emu)] {
            let r = r.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(r.pass(), "{what}: {r:?}");
        }
    };
    // Fails as a mismatch (`refused`: false) or is refused with an error naming `refused`.
    let fails = |what: &str, g: &Golden, refused: Option<&str>| match (g.check(&cpu), refused) {
        (Ok(r), None) => assert!(!r.pass(), "{what} passed"),
        (Err(e), Some(m)) => assert!(e.to_string().contains(m), "{what}: {e}"),
        (r, _) => panic!("{what}: {r:?}"),
    };
    use serde_json::json;

    // Stores: the scale rule and the value rule are told apart.
    let recip = file("index_k_store_fp8_e4m3_scale_reciprocal");
    passes("reciprocal scale", &recip);
    let report = recip.check(&cpu).unwrap();
    let names: Vec<&str> = report.quantities.iter().map(|q| q.name).collect();
    assert_eq!(names, ["cache_out", "cache_ours"]);
    let differ: usize = report
        .notes
        .iter()
        .find_map(|n| n.strip_suffix("stored tokens differ between the two conventions"))
        .and_then(|n| n.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{:?}", report.notes));
    assert!(
        differ > 0,
        "the convention changes no token: {:?}",
        report.notes
    );
    fails(
        "reciprocal-scale dump stating reciprocal values",
        &stating(&recip, json!({"quantize": "reciprocal"})),
        None,
    );
    let deepgemm = file("index_k_store_fp8_e4m3_deepgemm");
    passes("DeepGEMM values", &deepgemm);
    fails(
        "DeepGEMM dump stating the reciprocal scale",
        &stating(&deepgemm, json!({"scale": "reciprocal"})),
        None,
    );
    fails(
        "our store stating the reciprocal scale",
        &stating(
            &file("index_k_store_fp8_e4m3"),
            json!({"scale": "reciprocal"}),
        ),
        None,
    );
    fails(
        "a store stating a sparse_mla convention",
        &stating(&recip, json!({"scale": "reciprocal", "empty_lse": "+inf"})),
        Some("conventions.empty_lse applies to sparse_mla, sparse_mla_v4 only"),
    );

    // Indexer: bf16 keys and bf16 logits.
    let logits = file("indexer_logits_fp8_e4m3_deepgemm");
    assert_eq!(logits.tensors["logits"].dtype, Dtype::BF16);
    passes("DeepGEMM logits", &logits);
    fails(
        "DeepGEMM logits stating exact keys",
        &stating(&logits, json!({"key_dequant": "exact"})),
        None,
    );

    // Top-k: masked padding.
    let masked = file("topk_positions_masked_padding");
    assert_eq!(masked.tensors["topk"].shape.len(), 3, "[batch, seq_len, k]");
    passes("masked padding", &masked);
    fails(
        "masked padding stating ours",
        &stating(&masked, json!({"topk_padding": "minus_one"})),
        Some("topk_padding"),
    );
    fails(
        "-1 padding stating masked padding",
        &stating(
            &file("topk_positions"),
            json!({"topk_padding": "masked_positions"}),
        ),
        Some("never -1"),
    );

    // Sparse MLA: FlashMLA's lse value, lse layout and invalid indices, each on its own.
    let flash = file("sparse_mla_bf16_flashmla");
    assert_eq!(flash.tensors["q"].shape.len(), 4, "[batch, s_q, h, d]");
    passes("FlashMLA", &flash);
    let all = flash.params["conventions"].clone();
    let without = |key: &str| {
        let mut c = all.clone();
        c.as_object_mut().unwrap().remove(key);
        stating(&flash, c)
    };
    fails("FlashMLA without empty_lse", &without("empty_lse"), None);
    let mut minus = all.clone();
    minus["empty_lse"] = json!("-inf");
    fails("FlashMLA stating -inf", &stating(&flash, minus), None);
    fails(
        "FlashMLA without lse_layout",
        &without("lse_layout"),
        Some("lse"),
    );
    fails(
        "FlashMLA without invalid_indices",
        &without("invalid_indices"),
        Some("slot"),
    );
    fails(
        "our sparse_mla (a token without valid slot) stating +inf",
        &stating(&file("sparse_mla_bf16"), json!({"empty_lse": "+inf"})),
        None,
    );

    // DeepSeek-V4 attention in FlashMLA's layout: [batch, s_q, ..] tensors, topk_length per
    // request, lse [batch, h, s_q] (declared), +inf for an empty request (ours for V4).
    let v4 = file("sparse_mla_v4_flashmla");
    assert_eq!(v4.tensors["q"].shape.len(), 4, "[batch, s_q, h, d]");
    assert_eq!(
        v4.tensors["main_lengths"].shape,
        [3],
        "topk_length per request"
    );
    passes("FlashMLA V4", &v4);
    fails(
        "FlashMLA V4 without lse_layout",
        &stating(&v4, serde_json::Value::Null),
        Some("lse"),
    );
    fails(
        "FlashMLA V4 (an empty request) stating -inf",
        &stating(
            &v4,
            json!({"lse_layout": "batch_heads_seq", "empty_lse": "-inf"}),
        ),
        None,
    );
    fails(
        "a V4 file stating an index-K convention",
        &stating(
            &file("sparse_mla_v4_model1"),
            json!({"key_dequant": "bf16"}),
        ),
        Some("key_dequant"),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Corrupts the expected output of a golden file of any op (a written cache byte, the
/// largest logit, a selected top-k entry, the largest attention output).
fn corrupt(g: &mut Golden) {
    match g.op.as_str() {
        "index_k_store" | "kv_store" => {
            let slots: Vec<i64> = g.tensors["slots"].values();
            let bpp = g.tensors["cache_out"].shape[1];
            let ps = g.params["page_size"].as_u64().unwrap() as usize;
            let s = *slots.iter().find(|&&s| s >= 0).unwrap() as usize;
            // The first byte of the token's values (its page's start + its offset's row:
            // both layouts put values first, token-major within the value section).
            let per_token = if g.op == "kv_store" {
                // A token's row: model1_fp8 pages are rows then a scale section, padded
                // (the page is not `ps` equal rows); the other KV layouts are rows only.
                if g.params["dtype"] == "model1_fp8" {
                    let dim = |k: &str| g.params[k].as_u64().unwrap() as usize;
                    dim("nope_dim") + 2 * dim("rope_dim")
                } else {
                    bpp / ps
                }
            } else if g.params["dtype"] == "bf16" {
                2 * g.params["head_dim"].as_u64().unwrap() as usize
            } else if g.params["dtype"] == "fp4_e2m1" {
                g.params["head_dim"].as_u64().unwrap() as usize / 2
            } else {
                g.params["head_dim"].as_u64().unwrap() as usize
            };
            let at = (s / ps) * bpp + (s % ps) * per_token;
            edit::<u8>(g, "cache_out", |c| c[at] ^= 0x11);
        }
        "indexer_logits" => {
            let t = g.tensors.get_mut("logits").unwrap();
            if t.dtype == Dtype::BF16 {
                edit::<bf16>(g, "logits", |l| {
                    let at = (0..l.len()).find(|&i| l[i].to_f32().is_finite()).unwrap();
                    l[at] = bf16::from_f32(l[at].to_f32() * 1.5 + 1.0);
                });
            } else {
                edit::<f32>(g, "logits", |l| {
                    let at = (0..l.len()).find(|&i| l[i].is_finite()).unwrap();
                    l[at] = l[at] * 1.5 + 1.0;
                });
            }
        }
        "topk" => {
            // Push the logit of an expected entry below every other valid logit: the
            // backend no longer selects it, the file still does.
            let k = g.params["k"].as_u64().unwrap() as usize;
            let stride = g.params["row_stride"].as_u64().unwrap() as usize;
            let want: Vec<i32> = g.tensors["topk"].values();
            let logits: Vec<f32> = g.tensors["logits"].values();
            // A row with more than k valid logits (outside a row's range they are -inf).
            let row = (0..want.len() / k)
                .find(|&r| {
                    let valid = logits[r * stride..(r + 1) * stride]
                        .iter()
                        .filter(|x| **x > f32::NEG_INFINITY)
                        .count();
                    valid > k
                })
                .unwrap();
            let entry = *want[row * k..(row + 1) * k]
                .iter()
                .find(|&&v| v >= 0)
                .unwrap();
            let pos = match g.params.get("page_size").and_then(|p| p.as_u64()) {
                None => entry as usize,
                Some(ps) => {
                    // Slot → position through the request's page-table row.
                    let ps = ps as usize;
                    let table: Vec<i32> = g.tensors["page_table"].values();
                    let max_pages = g.tensors["page_table"].shape[1];
                    let request = match g.tensors.get("rows") {
                        Some(r) => r.values::<i32>()[row * 3] as usize,
                        None => row / g.params["next_n"].as_u64().unwrap() as usize,
                    };
                    let page = entry as usize / ps;
                    let col = (0..max_pages)
                        .find(|&c| table[request * max_pages + c] == page as i32)
                        .unwrap();
                    col * ps + entry as usize % ps
                }
            };
            edit::<f32>(g, "logits", |l| l[row * stride + pos] = -1e30);
        }
        _ => edit::<bf16>(g, "out", |o| {
            let at = (0..o.len())
                .max_by(|&a, &b| o[a].to_f32().abs().total_cmp(&o[b].to_f32().abs()))
                .unwrap();
            o[at] = -o[at];
        }),
    }
}

/// A small valid `index_k_store` file.
fn small_store() -> Golden {
    let rng = &mut case_rng(7, 0);
    let layout = IndexKLayout::new(IndexKDtype::FP8, 16, 4).unwrap();
    let slots = [0i64, 5, -1, 2];
    let keys = fixtures::token_rows(rng, slots.len(), 16);
    let cache = fixtures::garbage(rng, layout.buffer_bytes(2));
    Golden::index_k_store(
        &IndexKStore {
            layout,
            slots: &slots,
        },
        &keys,
        &cache,
    )
    .unwrap()
}

fn check(g: &Golden) -> Result<bool, GoldenError> {
    Golden::from_bytes(&g.to_bytes()?)?
        .check(&CpuBackend::new())
        .map(|r| r.pass())
}

#[test]
fn malformed_files_give_typed_errors() {
    let good = small_store();
    assert!(check(&good).unwrap());
    let variant = |f: &dyn Fn(&mut Golden)| {
        let mut g = good.clone();
        f(&mut g);
        check(&g)
    };
    assert!(matches!(
        variant(&|g| { g.tensors.remove("slots"); }),
        Err(GoldenError::MissingTensor { name, .. }) if name == "slots"
    ));
    assert!(matches!(
        variant(&|g| {
            let s: Vec<i32> = g.tensors["slots"].values::<i64>().iter().map(|&s| s as i32).collect();
            g.tensors.insert("slots".into(), Tensor::new(Dtype::I32, &[4], &s));
        }),
        Err(GoldenError::WrongDtype { name, expected: Dtype::I64, actual: Dtype::I32 }) if name == "slots"
    ));
    assert!(matches!(
        variant(&|g| g.tensors.get_mut("keys").unwrap().shape = vec![2, 32]),
        Err(GoldenError::WrongShape { name, .. }) if name == "keys"
    ));
    assert!(matches!(
        variant(&|g| g.op = "flash_attention".into()),
        Err(GoldenError::UnknownOp(op)) if op == "flash_attention"
    ));
    for params in [
        r#"{"version":1,"dtype":"fp8_e4m3","scale":"fp32","page_size":4}"#,
        r#"{"version":1,"dtype":"fp8_e4m3","head_dim":16,"page_size":4}"#,
        r#"{"version":1,"dtype":"fp8_e4m3","scale":"fp32","head_dim":16,"page_size":4,"pagesize":4}"#,
        r#"{"version":2,"dtype":"fp8_e4m3","scale":"fp32","head_dim":16,"page_size":4}"#,
        r#"{"version":1,"dtype":"fp16","head_dim":16,"page_size":4}"#,
        r#"{"version":1,"dtype":"bf16","head_dim":12,"page_size":4}"#,
        r#"{"version":1,"dtype":"bf16","head_dim":16,"page_size":1e30}"#,
    ] {
        let r = variant(&|g| g.params = serde_json::from_str(params).unwrap());
        assert!(
            matches!(r, Err(GoldenError::BadParams { .. })),
            "{params}: {r:?}"
        );
    }
    // Contents the op rejects: a slot beyond the cache, a duplicate slot.
    assert!(matches!(
        variant(&|g| edit::<i64>(g, "slots", |s| s[1] = 8)),
        Err(GoldenError::Rejected(_))
    ));
    assert!(matches!(
        variant(&|g| edit::<i64>(g, "slots", |s| s[1] = 0)),
        Err(GoldenError::Rejected(_))
    ));
    // Not safetensors; metadata without op; params not JSON.
    assert!(matches!(
        Golden::from_bytes(b"not a safetensors file"),
        Err(GoldenError::Safetensors(_))
    ));
    let keys = &good.tensors["keys"];
    let bare = safetensors::serialize([("keys", keys)], &None).unwrap();
    assert!(matches!(
        Golden::from_bytes(&bare),
        Err(GoldenError::MissingMetadata("op"))
    ));
    let meta = [
        ("op".to_string(), "topk".to_string()),
        ("params".to_string(), "{k: 3".to_string()),
    ];
    let bytes =
        safetensors::serialize([("keys", keys)], &Some(meta.into_iter().collect())).unwrap();
    assert!(matches!(
        Golden::from_bytes(&bytes),
        Err(GoldenError::BadParams { .. })
    ));
    // A missing file.
    assert!(matches!(
        check_file(&CpuBackend::new(), "/nonexistent/x.safetensors"),
        Err(GoldenError::Io(_))
    ));
}

#[test]
fn malformed_rows_indices_and_expected_topk_are_errors() {
    let rows = [
        QueryRange {
            request: 0,
            start: 0,
            end: 6,
        },
        QueryRange {
            request: 1,
            start: 1,
            end: 4,
        },
    ];
    let logits: Vec<f32> = (0..12).map(|i| (i % 5) as f32).collect();
    let op = Topk {
        short_rows: sparsekit_host::ops::ShortRows::SelectValid,
        k: 2,
        row_stride: 6,
        rows: &rows,
        output: TopkOutput::Positions,
    };
    let g = Golden::topk(&op, None, &logits).unwrap();
    assert!(check(&g).unwrap());
    let mut bad = g.clone();
    edit::<i32>(&mut bad, "rows", |r| r[4] = -1);
    assert!(matches!(check(&bad), Err(GoldenError::Invalid(_))));
    let mut bad = g.clone();
    edit::<i32>(&mut bad, "topk", |t| t[2] = 5); // position 5 is outside row 1's [1, 4)
    assert!(matches!(check(&bad), Err(GoldenError::Invalid(_))));
    let mut bad = g.clone();
    bad.tensors.insert(
        "context_lens".into(),
        Tensor::new(Dtype::I32, &[2], &[6i32, 4]),
    );
    assert!(matches!(check(&bad), Err(GoldenError::BadParams { .. })));
    let mut bad = g;
    bad.params["output"] = "slots".into();
    bad.params["page_size"] = 4.into();
    assert!(
        matches!(check(&bad), Err(GoldenError::MissingTensor { name, .. }) if name == "page_table")
    );

    // Sparse MLA: an index beyond the cache.
    let layout = KvLayout::new(KvDtype::Bf16, 16, 16, 4).unwrap();
    let rng = &mut case_rng(3, 0);
    let cache = fixtures::garbage(rng, layout.buffer_bytes(2));
    let q = fixtures::bf16_normal(rng, 2 * layout.d_qk(), 1.0);
    let kv = fixtures::token_rows(rng, 8, layout.d_qk());
    let mut cache = cache;
    reference::kv_store(&layout, &mut cache, &kv, &(0..8).collect::<Vec<i64>>());
    let op = SparseMla {
        layout,
        n_tokens: 2,
        n_heads: 1,
        topk: 3,
        softmax_scale: 0.1,
    };
    let g = Golden::sparse_mla(&op, &q, &cache, &[0, 7, -1, 3, -1, -1]).unwrap();
    assert!(check(&g).unwrap());
    let mut bad = g;
    edit::<i32>(&mut bad, "indices", |i| i[1] = 8);
    assert!(matches!(check(&bad), Err(GoldenError::Rejected(_))));
}
