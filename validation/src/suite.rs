//! The validation suite: every op checked against its f64 reference on random ragged
//! batches (batch ≥ 4), both dtypes of each cache, DeepSeek-V3.2 and tiny dims, outputs
//! poisoned first; plus batch-invariance checks. One body per check, generic over
//! [`Backend`], so every backend runs the same suite.

use std::time::Instant;

use half::bf16;
use rand::seq::SliceRandom;
use rand::Rng;
use serde::Serialize;
use sparsekit_host::dims::ModelDims;
use sparsekit_host::dtype::ScaleFormat;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout, PageLayout};
use sparsekit_host::ops::{
    decode_rows, CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, PageTable,
    PagedRegion, QueryRange, SparseMla, Topk, TopkOutput,
};
use sparsekit_host::{Backend, Error};

use crate::fixtures::{self, bytes_of, case_rng, Paging, SuiteRng};
use crate::reference;
use crate::tolerance::{self, ErrorStats, Tolerance};

/// How big the cases are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Size {
    /// `cargo test`: every feature of the full suite (64K+ contexts included, at tiny dims),
    /// smaller where the f64 reference would be slow.
    Quick,
    /// `sparsekit validate`: DeepSeek-V3.2 dims at 64K+ contexts and all head counts.
    Full,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct SuiteConfig {
    pub size: Size,
    pub seed: u64,
    /// Restrict to these ops (all when empty).
    pub ops: Vec<Op>,
}

/// What a record checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Output vs the f64 reference.
    Reference,
    /// Bit-identical alone, in a batch, and chunked.
    BatchInvariance,
}

/// Outcome of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pass,
    Fail,
    /// The backend returned an error.
    Error,
}

/// One line of the suite's report.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub op: &'static str,
    pub backend: String,
    pub check: Check,
    pub config: String,
    pub dtype: &'static str,
    pub quantity: &'static str,
    pub batch: usize,
    pub elements: usize,
    pub max_abs_err: f64,
    pub max_rel_err: f64,
    pub worst_ratio: f64,
    pub tolerance: String,
    pub pass: bool,
    pub status: Status,
    pub seed: u64,
    pub millis: u64,
    pub detail: String,
}

/// One planned check.
#[derive(Clone, Debug)]
pub struct Case {
    /// Position in the plan; mixed into the seed.
    pub id: u64,
    pub op: Op,
    pub check: Check,
    pub config: String,
    pub dtype: &'static str,
    pub batch: usize,
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Form {
    Decode(usize),
    Prefill,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Scenario {
    Random,
    AllEqual,
    ThresholdTies,
    Invalid,
}

#[derive(Clone, Debug)]
enum Kind {
    IndexKStore(ModelDims, IndexKDtype),
    KvStore(ModelDims, KvDtype),
    Indexer(ModelDims, IndexKDtype, Form, Vec<u32>),
    Topk(usize, usize, Scenario, Vec<u32>),
    SparseMla(ModelDims, KvDtype, usize, Vec<u32>),
    CopyPages(PageLayout, bool),
    PageChecksums(PageLayout),
    Invariance(ModelDims, &'static str),
}

const INDEX_DTYPES: [IndexKDtype; 3] = [
    IndexKDtype::FP8,
    IndexKDtype::Fp8E4m3 {
        scale: ScaleFormat::Ue8m0,
    },
    IndexKDtype::Bf16,
];
const KV_DTYPES: [KvDtype; 2] = [KvDtype::Bf16, KvDtype::Fp8DsMla];

fn index_dtype_label(d: IndexKDtype) -> &'static str {
    match d {
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Ue8m0,
        } => "fp8_e4m3",
        other => other.name(),
    }
}

fn scale_suffix(d: IndexKDtype) -> &'static str {
    match d {
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Ue8m0,
        } => " ue8m0",
        _ => "",
    }
}

/// The checks of a suite run, in order.
pub fn plan(cfg: &SuiteConfig) -> Vec<Case> {
    let full = cfg.size == Size::Full;
    let mut cases = Vec::new();
    let mut push = |op: Op, check, config: String, dtype, batch, kind| {
        if cfg.ops.is_empty() || cfg.ops.contains(&op) {
            cases.push(Case {
                id: cases.len() as u64,
                op,
                check,
                config,
                dtype,
                batch,
                kind,
            });
        }
    };
    let r = Check::Reference;
    for dims in ModelDims::ALL {
        let dsv = dims.name == "dsv32";
        for dt in INDEX_DTYPES {
            push(
                Op::IndexKStore,
                r,
                format!("{}{}", dims.name, scale_suffix(dt)),
                index_dtype_label(dt),
                5,
                Kind::IndexKStore(dims, dt),
            );
        }
        for dt in KV_DTYPES {
            push(
                Op::KvStore,
                r,
                dims.name.to_string(),
                dt.name(),
                5,
                Kind::KvStore(dims, dt),
            );
        }
        // Indexer: decode next_n 1 and 2, and prefill; contexts 1, page ± 1, 64K+.
        let ps = dims.page_size as u32;
        let long = 65536 + 37;
        let decode1: Vec<u32> = match (dsv, full) {
            (true, false) => vec![1, ps - 1, ps + 1, 700, 2049],
            _ => vec![1, ps - 1, ps, ps + 1, 4097, long, 70001],
        };
        let decode2: Vec<u32> = match (dsv, full) {
            (true, false) => vec![2, ps, 2 * ps + 1, 1500],
            _ => vec![2, ps, 2 * ps + 1, long + 64],
        };
        let prefill: Vec<u32> = match (dsv, full) {
            (true, false) => vec![5, ps, 301, 1000],
            _ => vec![5, ps, 1001, long],
        };
        for dt in INDEX_DTYPES {
            for (form, lens) in [
                (Form::Decode(1), &decode1),
                (Form::Decode(2), &decode2),
                (Form::Prefill, &prefill),
            ] {
                let name = match form {
                    Form::Decode(n) => {
                        format!("{} decode next_n={n}{}", dims.name, scale_suffix(dt))
                    }
                    Form::Prefill => format!("{} prefill{}", dims.name, scale_suffix(dt)),
                };
                push(
                    Op::IndexerLogits,
                    r,
                    name,
                    index_dtype_label(dt),
                    lens.len(),
                    Kind::Indexer(dims, dt, form, lens.clone()),
                );
            }
        }
        // Top-k: short rows (padding), k ± 1, 64K+ (128K+ in full), adversarial ties.
        let k = dims.index_topk as u32;
        let mut lens = vec![1, k - 1, k, k + 1, 9000, long];
        if full {
            lens.push(131072 + 19);
        }
        for sc in [
            Scenario::Random,
            Scenario::AllEqual,
            Scenario::ThresholdTies,
            Scenario::Invalid,
        ] {
            push(
                Op::Topk,
                r,
                format!("{} k={k} {sc:?}", dims.name),
                "fp32",
                lens.len(),
                Kind::Topk(k as usize, dims.page_size, sc, lens.clone()),
            );
        }
        // Sparse MLA.
        let heads: Vec<usize> = if full || !dsv {
            dims.q_heads.to_vec()
        } else {
            vec![16, 64]
        };
        let lens: Vec<u32> = if dsv {
            vec![1, ps + 1, 2100, 5000]
        } else {
            vec![1, ps + 1, 90, 300]
        };
        for dt in KV_DTYPES {
            for &h in &heads {
                push(
                    Op::SparseMla,
                    r,
                    format!("{} h_q={h}", dims.name),
                    dt.name(),
                    6,
                    Kind::SparseMla(dims, dt, h, lens.clone()),
                );
            }
        }
        // Page copies (contiguous and page-first regions) and checksums, every layout.
        for layout in page_layouts(&dims) {
            let dt = layout.info().dtype;
            let kind = if matches!(layout, PageLayout::IndexK(_)) {
                "index_k"
            } else {
                "kv"
            };
            push(
                Op::CopyPages,
                r,
                format!("{} {kind}", dims.name),
                dt,
                24,
                Kind::CopyPages(layout, false),
            );
            push(
                Op::CopyPages,
                r,
                format!("{} {kind} page-first", dims.name),
                dt,
                24,
                Kind::CopyPages(layout, true),
            );
            push(
                Op::PageChecksums,
                r,
                format!("{} {kind}", dims.name),
                dt,
                24,
                Kind::PageChecksums(layout),
            );
        }
        // Batch invariance, one per op.
        for op in Op::ALL {
            push(
                op,
                Check::BatchInvariance,
                dims.name.to_string(),
                invariance_dtype(op),
                8,
                Kind::Invariance(dims, op.name()),
            );
        }
    }
    cases
}

fn invariance_dtype(op: Op) -> &'static str {
    match op {
        Op::IndexKStore | Op::IndexerLogits | Op::CopyPages | Op::PageChecksums => "fp8_e4m3",
        Op::KvStore | Op::SparseMla => "fp8_ds_mla",
        Op::Topk => "fp32",
    }
}

/// Every page layout of a model config: index-K fp8 and bf16, KV bf16 and fp8_ds_mla.
pub(crate) fn page_layouts(d: &ModelDims) -> Vec<PageLayout> {
    let mut v = Vec::new();
    for dt in [IndexKDtype::FP8, IndexKDtype::Bf16] {
        if let Ok(l) = IndexKLayout::new(dt, d.index_head_dim, d.page_size) {
            v.push(l.into());
        }
    }
    for dt in KV_DTYPES {
        if let Ok(l) = KvLayout::new(dt, d.kv_lora_rank, d.qk_rope_dim, d.page_size) {
            v.push(l.into());
        }
    }
    v
}

/// Runs every planned check on `backend`, calling `progress` after each record.
pub fn run<B: Backend>(
    backend: &B,
    cfg: &SuiteConfig,
    mut progress: impl FnMut(&Record),
) -> Vec<Record> {
    let mut out = Vec::new();
    for case in plan(cfg) {
        for rec in run_case(backend, &case, cfg.seed) {
            progress(&rec);
            out.push(rec);
        }
    }
    out
}

/// Runs one check and returns its record(s).
pub fn run_case<B: Backend>(backend: &B, case: &Case, seed: u64) -> Vec<Record> {
    let start = Instant::now();
    let mut rng = case_rng(seed, case.id);
    let base = |quantity: &'static str| Record {
        op: case.op.name(),
        backend: backend.name().to_string(),
        check: case.check,
        config: case.config.clone(),
        dtype: case.dtype,
        quantity,
        batch: case.batch,
        elements: 0,
        max_abs_err: 0.0,
        max_rel_err: 0.0,
        worst_ratio: 0.0,
        tolerance: String::new(),
        pass: false,
        status: Status::Fail,
        seed,
        millis: 0,
        detail: String::new(),
    };
    let result: Result<Vec<Outcome>, Error> = match &case.kind {
        Kind::IndexKStore(d, dt) => index_k_store(backend, &mut rng, d, *dt).map(|o| vec![o]),
        Kind::KvStore(d, dt) => kv_store(backend, &mut rng, d, *dt).map(|o| vec![o]),
        Kind::Indexer(d, dt, form, lens) => {
            indexer(backend, &mut rng, d, *dt, form, lens).map(|o| vec![o])
        }
        Kind::Topk(k, ps, sc, lens) => topk(backend, &mut rng, *k, *ps, *sc, lens).map(|o| vec![o]),
        Kind::SparseMla(d, dt, h, lens) => sparse_mla(backend, &mut rng, d, *dt, *h, lens),
        Kind::CopyPages(l, page_first) => {
            copy_pages(backend, &mut rng, *l, *page_first).map(|o| vec![o])
        }
        Kind::PageChecksums(l) => page_checksums(backend, &mut rng, *l).map(|o| vec![o]),
        Kind::Invariance(d, op) => {
            crate::invariance::check(backend, &mut rng, d, op).map(|o| vec![o])
        }
    };
    let millis = start.elapsed().as_millis() as u64;
    match result {
        Err(e) => {
            let mut rec = base("-");
            rec.status = Status::Error;
            rec.millis = millis;
            rec.detail = format!("{e} (seed {seed})");
            vec![rec]
        }
        Ok(outcomes) => outcomes
            .into_iter()
            .map(|o| {
                let mut rec = base(o.quantity);
                let mut stats = o.stats;
                stats.finish();
                rec.elements = stats.count;
                rec.max_abs_err = stats.max_abs_err;
                rec.max_rel_err = stats.max_rel_err;
                rec.worst_ratio = stats.worst_ratio;
                rec.tolerance = o.tolerance;
                rec.pass = stats.pass();
                rec.status = if rec.pass { Status::Pass } else { Status::Fail };
                rec.millis = millis;
                if let Some((i, got, want)) = stats.first_failure {
                    rec.detail = format!(
                        "{} of {} elements out of tolerance; first at {i}: got {got}, want {want}; {}rerun with --seed {seed}",
                        stats.failures, stats.count, o.note
                    );
                } else {
                    rec.detail = o.note;
                }
                rec
            })
            .collect(),
    }
}

/// The result of one comparison inside a check.
pub(crate) struct Outcome {
    pub quantity: &'static str,
    pub stats: ErrorStats,
    pub tolerance: String,
    pub note: String,
}

impl Outcome {
    pub(crate) fn new(quantity: &'static str, stats: ErrorStats, t: &Tolerance) -> Self {
        Outcome {
            quantity,
            stats,
            tolerance: describe(t),
            note: String::new(),
        }
    }
}

/// Human-readable form of a tolerance row.
pub fn describe(t: &Tolerance) -> String {
    if t.atol == 0.0 && t.rtol == 0.0 {
        "exact".into()
    } else {
        format!("{:e}·mag + {:e}·|ref|", t.atol, t.rtol)
    }
}

pub(crate) fn tol(op: &str, quantity: &str, dtype: &str) -> Result<&'static Tolerance, Error> {
    tolerance::lookup(op, quantity, dtype).ok_or_else(|| Error::InvalidArgument {
        what: "tolerance",
        detail: format!("no tolerance row for {op}/{quantity}/{dtype}"),
    })
}

/// New tokens for a store case: 5 requests with existing lengths and 1..=40 new tokens
/// (one crossing a page boundary), plus `-1` padding entries. Returns (paging, slots).
fn store_batch(rng: &mut SuiteRng, page_size: usize) -> (Paging, Vec<i64>) {
    let existing: Vec<u32> = (0..5).map(|_| rng.gen_range(0..200)).collect();
    let new: Vec<u32> = (0..5)
        .map(|i| {
            if i == 0 {
                page_size as u32 + 1
            } else {
                rng.gen_range(1..=40)
            }
        })
        .collect();
    let lens: Vec<u32> = existing.iter().zip(&new).map(|(a, b)| a + b).collect();
    let paging = Paging::new(rng, page_size, &lens, 2);
    let mut slots = Vec::new();
    for r in 0..5 {
        for p in existing[r]..lens[r] {
            slots.push(paging.slot(r, p as usize));
        }
        if r % 2 == 1 {
            slots.push(-1);
        }
    }
    (paging, slots)
}

fn compare_bytes(stats: &mut ErrorStats, got: &[u8], want: &[u8]) {
    if got.len() != want.len() {
        stats.fail(0, got.len() as f64, want.len() as f64);
        return;
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
        for _ in 0..n {
            stats.fail(i, got[i] as f64, want[i] as f64);
        }
    }
}

fn index_k_store<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    dt: IndexKDtype,
) -> Result<Outcome, Error> {
    let layout = IndexKLayout::new(dt, d.index_head_dim, d.page_size)?;
    let (paging, slots) = store_batch(rng, d.page_size);
    let cache0 = fixtures::garbage(rng, layout.buffer_bytes(paging.num_pages));
    let keys = fixtures::token_rows(rng, slots.len(), layout.head_dim());
    let mut want = cache0.clone();
    reference::index_k_store(&layout, &mut want, &keys, &slots);
    let mut cache = b.upload(&cache0)?;
    b.index_k_store(
        &IndexKStore {
            layout,
            slots: &slots,
        },
        &b.upload(bytes_of(&keys))?,
        &mut cache,
    )?;
    let got = b.download(&cache)?;
    let t = tol("index_k_store", "cache", index_dtype_label(dt))?;
    let mut stats = ErrorStats::default();
    for (i, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
        let (gv, gs) = reference::read_index_key(&layout, &got, s as usize);
        let (wv, ws) = reference::read_index_key(&layout, &want, s as usize);
        for (j, (g, w)) in gv.iter().zip(&wv).enumerate() {
            stats.add(i * layout.head_dim() + j, g * gs, w * ws, 0.0, t);
        }
    }
    compare_bytes(&mut stats, &got, &want);
    Ok(Outcome::new("cache", stats, t))
}

fn kv_store<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    dt: KvDtype,
) -> Result<Outcome, Error> {
    let layout = KvLayout::new(dt, d.kv_lora_rank, d.qk_rope_dim, d.page_size)?;
    let (paging, slots) = store_batch(rng, d.page_size);
    let cache0 = fixtures::garbage(rng, layout.buffer_bytes(paging.num_pages));
    let kv = fixtures::token_rows(rng, slots.len(), layout.d_qk());
    let mut want = cache0.clone();
    reference::kv_store(&layout, &mut want, &kv, &slots);
    let mut cache = b.upload(&cache0)?;
    b.kv_store(
        &KvStore {
            layout,
            slots: &slots,
        },
        &b.upload(bytes_of(&kv))?,
        &mut cache,
    )?;
    let got = b.download(&cache)?;
    let t = tol("kv_store", "cache", dt.name())?;
    let mut stats = ErrorStats::default();
    for (i, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
        let g = reference::read_kv_token(&layout, &got, s as usize);
        let w = reference::read_kv_token(&layout, &want, s as usize);
        for (j, (g, w)) in g.iter().zip(&w).enumerate() {
            stats.add(i * layout.d_qk() + j, *g, *w, 0.0, t);
        }
    }
    compare_bytes(&mut stats, &got, &want);
    Ok(Outcome::new("cache", stats, t))
}

/// Prefill rows: per request, up to 4 queries at its last positions (causal), and for
/// every other request one extra row with a window `start > 0`.
pub(crate) fn prefill_rows(rng: &mut SuiteRng, lens: &[u32]) -> Vec<QueryRange> {
    let mut rows = Vec::new();
    for (r, &len) in lens.iter().enumerate() {
        let nq = rng.gen_range(1..=4u32).min(len);
        for i in 0..nq {
            rows.push(QueryRange {
                request: r as u32,
                start: 0,
                end: len - nq + i + 1,
            });
        }
        if r % 2 == 1 && len > 2 {
            let start = rng.gen_range(1..len - 1);
            rows.push(QueryRange {
                request: r as u32,
                start,
                end: len,
            });
        }
    }
    rows
}

/// Random indexer queries and weights for `n_rows` rows.
pub(crate) fn indexer_inputs(
    rng: &mut SuiteRng,
    n_rows: usize,
    h: usize,
    d: usize,
) -> (Vec<bf16>, Vec<f32>) {
    let q = fixtures::bf16_normal(rng, n_rows * h * d, 1.0);
    let w = (0..n_rows * h)
        .map(|_| (fixtures::normal(rng) / (h as f64 * d as f64).sqrt()) as f32)
        .collect();
    (q, w)
}

fn indexer<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    dt: IndexKDtype,
    form: &Form,
    lens: &[u32],
) -> Result<Outcome, Error> {
    let layout = IndexKLayout::new(dt, d.index_head_dim, d.page_size)?;
    let paging = Paging::new(rng, d.page_size, lens, 3);
    let cache = fixtures::index_k_pool(rng, &layout, &paging);
    let rows = match form {
        Form::Decode(n) => decode_rows(lens, *n)?,
        Form::Prefill => prefill_rows(rng, lens),
    };
    let row_stride = rows.iter().map(|r| r.end as usize).max().unwrap_or(0) + 13;
    let h = d.index_n_heads;
    let (q, w) = indexer_inputs(rng, rows.len(), h, layout.head_dim());
    let pt = PageTable::new(&paging.table, paging.max_pages)?;
    let op = IndexerLogits {
        layout,
        n_heads: h,
        page_table: pt,
        rows: rows.clone(),
        row_stride,
    };
    let mut out = b.upload(&fixtures::poison_f32(rows.len() * row_stride))?;
    b.indexer_logits(
        &op,
        &b.upload(bytes_of(&q))?,
        &b.upload(bytes_of(&w))?,
        &b.upload(&cache)?,
        &mut out,
    )?;
    let got: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    let want = reference::indexer_logits(&layout, &cache, &pt, &rows, h, &q, &w, row_stride);
    let t = tol("indexer_logits", "logits", index_dtype_label(dt))?;
    let mut stats = ErrorStats::default();
    for (i, g) in got.iter().enumerate() {
        stats.add(i, *g as f64, want.logits[i], want.magnitude[i], t);
    }
    let mut o = Outcome::new("logits", stats, t);
    o.note = format!(
        "{} rows, longest context {}",
        rows.len(),
        lens.iter().max().unwrap_or(&0)
    );
    Ok(o)
}

/// Random logits for top-k rows of the given lengths (columns past a row's length are
/// `-inf`), shaped by the scenario.
pub(crate) fn topk_logits(
    rng: &mut SuiteRng,
    k: usize,
    sc: Scenario,
    lens: &[u32],
    stride: usize,
) -> Vec<f32> {
    let mut logits = vec![f32::NEG_INFINITY; lens.len() * stride];
    for (r, &len) in lens.iter().enumerate() {
        let row = &mut logits[r * stride..r * stride + len as usize];
        for x in row.iter_mut() {
            *x = fixtures::normal(rng) as f32;
        }
        match sc {
            Scenario::Random => {}
            Scenario::AllEqual => row.fill(1.5),
            Scenario::ThresholdTies => {
                // k/2 large distinct values, then thousands of copies of the threshold value.
                let n = row.len();
                for x in row.iter_mut() {
                    *x = (*x).min(0.5);
                }
                for _ in 0..k / 2 {
                    row[rng.gen_range(0..n)] = 10.0 + rng.gen::<f32>();
                }
                let ties = (k + 3000).min(n);
                for _ in 0..ties {
                    row[rng.gen_range(0..n)] = 0.75;
                }
            }
            Scenario::Invalid => {
                for x in row.iter_mut() {
                    match rng.gen_range(0..10) {
                        0 => *x = f32::NEG_INFINITY,
                        1 => *x = f32::NAN,
                        2 => *x = -0.0,
                        3 => *x = 0.0,
                        _ => {}
                    }
                }
            }
        }
    }
    logits
}

/// Judges one top-k row: exact positions (ties to the lower position), ascending order,
/// `-1` padding; the value multiset and threshold are implied and reported as errors.
pub(crate) fn judge_topk_row(
    stats: &mut ErrorStats,
    base: usize,
    got: &[i32],
    want: &[i32],
    got_vals: &[f64],
    want_vals: &[f64],
) {
    let mut gv = got_vals.to_vec();
    let mut wv = want_vals.to_vec();
    gv.sort_by(f64::total_cmp);
    wv.sort_by(f64::total_cmp);
    if gv.len() != wv.len() {
        stats.fail(base, gv.len() as f64, wv.len() as f64);
    } else {
        for (i, (g, w)) in gv.iter().zip(&wv).enumerate() {
            if g != w {
                stats.fail(base + i, *g, *w);
            }
        }
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g != w {
            stats.fail(base + i, *g as f64, *w as f64);
        } else {
            stats.count += 1;
        }
    }
}

fn topk<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    k: usize,
    ps: usize,
    sc: Scenario,
    lens: &[u32],
) -> Result<Outcome, Error> {
    let stride = *lens.iter().max().unwrap_or(&1) as usize + 7;
    let logits = topk_logits(rng, k, sc, lens, stride);
    let paging = Paging::new(rng, ps, lens, 1);
    let pt = PageTable::new(&paging.table, paging.max_pages)?;
    let rows: Vec<QueryRange> = lens
        .iter()
        .enumerate()
        .map(|(r, &len)| QueryRange {
            request: r as u32,
            start: 0,
            end: len,
        })
        .collect();
    let op = Topk {
        k,
        row_stride: stride,
        rows: &rows,
        output: TopkOutput::Slots {
            page_table: pt,
            page_size: ps,
        },
    };
    let mut out = b.upload(&fixtures::poison_i32(rows.len() * k))?;
    b.topk(&op, &b.upload(bytes_of(&logits))?, &mut out)?;
    let got: Vec<i32> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    let t = tol("topk", "indices", "fp32")?;
    let mut stats = ErrorStats::default();
    for (r, &len) in lens.iter().enumerate() {
        let row = &logits[r * stride..r * stride + len as usize];
        let pos = reference::topk_row(row, k);
        let mut want: Vec<i32> = pos.iter().map(|&p| paging.slot(r, p) as i32).collect();
        let want_vals: Vec<f64> = pos.iter().map(|&p| row[p] as f64).collect();
        want.resize(k, -1);
        let g = &got[r * k..(r + 1) * k];
        // Map returned slots back to positions to read their values.
        let slot_to_pos: std::collections::HashMap<i64, usize> =
            (0..len as usize).map(|p| (paging.slot(r, p), p)).collect();
        let got_vals: Vec<f64> = g
            .iter()
            .filter(|&&s| s != -1)
            .map(|&s| {
                slot_to_pos
                    .get(&(s as i64))
                    .map_or(f64::NAN, |&p| row[p] as f64)
            })
            .collect();
        judge_topk_row(&mut stats, r * k, g, &want, &got_vals, &want_vals);
    }
    let mut o = Outcome::new("indices", stats, t);
    o.note = format!("k={k}, rows {lens:?}");
    Ok(o)
}

/// Per-token slot lists for sparse MLA: token 0 has no valid slot, token 1 fewer than
/// `topk`, the rest `min(topk, len)` distinct random positions of their request, all
/// shuffled with some `-1` entries mixed in.
pub(crate) fn mla_indices(
    rng: &mut SuiteRng,
    paging: &Paging,
    n_tokens: usize,
    topk: usize,
) -> Vec<i32> {
    let n_req = paging.lens.len();
    let mut idx = vec![-1i32; n_tokens * topk];
    for t in 0..n_tokens {
        let r = t % n_req;
        let len = paging.lens[r] as usize;
        let want = match t {
            0 => 0,
            1 => (topk / 3).min(len),
            _ => topk.min(len),
        };
        let mut pos: Vec<usize> = (0..len).collect();
        pos.shuffle(rng);
        let row = &mut idx[t * topk..(t + 1) * topk];
        for (dst, &p) in row.iter_mut().zip(&pos[..want]) {
            *dst = paging.slot(r, p) as i32;
        }
        row.shuffle(rng);
    }
    idx
}

fn sparse_mla<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    d: &ModelDims,
    dt: KvDtype,
    h: usize,
    lens: &[u32],
) -> Result<Vec<Outcome>, Error> {
    let layout = KvLayout::new(dt, d.kv_lora_rank, d.qk_rope_dim, d.page_size)?;
    let paging = Paging::new(rng, d.page_size, lens, 2);
    let cache = fixtures::kv_pool(rng, &layout, &paging);
    let (n_tokens, topk) = (6, d.index_topk);
    let indices = mla_indices(rng, &paging, n_tokens, topk);
    let q = fixtures::bf16_normal(rng, n_tokens * h * layout.d_qk(), 1.0);
    let scale = 1.0 / (layout.d_qk() as f32).sqrt();
    let op = SparseMla {
        layout,
        n_tokens,
        n_heads: h,
        topk,
        softmax_scale: scale,
    };
    let mut out = b.upload(&fixtures::poison_bf16(n_tokens * h * layout.nope_dim()))?;
    let mut lse = b.upload(&fixtures::poison_f32(n_tokens * h))?;
    b.sparse_mla(
        &op,
        &b.upload(bytes_of(&q))?,
        &b.upload(&cache)?,
        &b.upload(bytes_of(&indices))?,
        &mut out,
        &mut lse,
    )?;
    let got_out: Vec<bf16> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    let got_lse: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&lse)?);
    let want = reference::sparse_mla(&layout, &cache, &q, &indices, n_tokens, h, topk, scale);
    let (to, tl) = (
        tol("sparse_mla", "out", dt.name())?,
        tol("sparse_mla", "lse", dt.name())?,
    );
    let dv = layout.nope_dim();
    let mut so = ErrorStats::default();
    for (i, g) in got_out.iter().enumerate() {
        so.add(i, g.to_f64(), want.out[i], want.out_magnitude[i / dv], to);
    }
    let mut sl = ErrorStats::default();
    for (i, g) in got_lse.iter().enumerate() {
        sl.add(i, *g as f64, want.lse[i], want.lse_magnitude[i], tl);
    }
    Ok(vec![
        Outcome::new("out", so, to),
        Outcome::new("lse", sl, tl),
    ])
}

/// A region of `num_pages` pages of `layout`: contiguous, or page-first (each page slot
/// also holds a foreign page of `extra` bytes before it, as in a multi-layer host pool).
pub(crate) fn region(
    layout: PageLayout,
    num_pages: usize,
    page_first: bool,
    extra: usize,
) -> PagedRegion {
    if page_first {
        PagedRegion {
            layout,
            offset: extra,
            stride: layout.bytes_per_page() + extra,
            num_pages,
        }
    } else {
        PagedRegion::contiguous(layout, num_pages)
    }
}

fn region_bytes(r: &PagedRegion) -> usize {
    r.offset + r.stride * r.num_pages
}

fn copy_pages<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    layout: PageLayout,
    page_first: bool,
) -> Result<Outcome, Error> {
    let extra = if page_first {
        3 * 16 + layout.bytes_per_page() / 3 / 16 * 16
    } else {
        0
    };
    let (np_src, np_dst, n) = (37, 29, 24);
    let src_r = region(layout, np_src, page_first, extra);
    let dst_r = region(layout, np_dst, !page_first, extra + 16);
    let src = fixtures::garbage(rng, region_bytes(&src_r));
    let dst0 = fixtures::garbage(rng, region_bytes(&dst_r));
    let src_ids: Vec<i32> = (0..n).map(|_| rng.gen_range(0..np_src as i32)).collect();
    let mut dst_ids: Vec<i32> = (0..np_dst as i32).collect();
    dst_ids.shuffle(rng);
    dst_ids.truncate(n);
    let op = CopyPages {
        src: src_r,
        dst: dst_r,
        src_ids: &src_ids,
        dst_ids: &dst_ids,
    };
    let mut dst = b.upload(&dst0)?;
    b.copy_pages(&op, &b.upload(&src)?, &mut dst)?;
    let got = b.download(&dst)?;
    let mut want = dst0.clone();
    reference::copy_pages(&src_r, &dst_r, &src, &mut want, &src_ids, &dst_ids);
    let t = tol("copy_pages", "pages", "bytes")?;
    let mut stats = ErrorStats::default();
    compare_bytes(&mut stats, &got, &want);
    stats.count += got.len();
    let mut o = Outcome::new("pages", stats, t);
    o.note = format!(
        "{n} pages, {} B/page, src stride {} dst stride {}",
        layout.bytes_per_page(),
        src_r.stride,
        dst_r.stride
    );
    Ok(o)
}

fn page_checksums<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    layout: PageLayout,
) -> Result<Outcome, Error> {
    let r = region(layout, 31, true, 48);
    let pool = fixtures::garbage(rng, region_bytes(&r));
    let ids: Vec<i32> = (0..24).map(|_| rng.gen_range(0..31)).collect();
    let op = PageChecksums {
        region: r,
        ids: &ids,
    };
    let mut out = b.upload(&fixtures::poison_f32(ids.len() * 2))?;
    b.page_checksums(&op, &b.upload(&pool)?, &mut out)?;
    let got: Vec<u64> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
    let t = tol("page_checksums", "checksums", "u64")?;
    let mut stats = ErrorStats::default();
    for (i, (&g, &id)) in got.iter().zip(&ids).enumerate() {
        let want = reference::page_checksum(&pool[r.page_range(id as usize)]);
        if g == want {
            stats.count += 1;
        } else {
            stats.fail(i, g as f64, want as f64);
        }
    }
    Ok(Outcome::new("checksums", stats, t))
}
