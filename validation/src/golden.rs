//! Golden files: a user's own tensors, checked on any backend.
//!
//! A golden file is a safetensors file holding the inputs of one op and its expected
//! outputs. `__metadata__` holds `op` (an [`Op`] name) and `params` (a JSON string: the
//! op's parameters and the format `version`); extra metadata keys (a `seed`, say) are kept
//! and ignored. `docs/golden.md` documents the tensors of every op; in short:
//!
//! | op | inputs | expected |
//! |----|--------|----------|
//! | `index_k_store` | `keys`, `slots`, `cache_in` | `cache_out` |
//! | `kv_store` | `kv`, `slots`, `cache_in` | `cache_out` |
//! | `indexer_logits` | `q`, `weights`, `cache`, `page_table`, `rows` or `context_lens` | `logits` |
//! | `topk` | `logits`, `rows` or `context_lens`, `page_table` (slots output) | `topk` |
//! | `sparse_mla` | `q`, `cache`, `indices` | `out`, `lse` |
//!
//! [`check_file`] runs the op on a backend (outputs poisoned with NaN first) and judges the
//! result against the expected tensors with the [tolerance table](crate::tolerance):
//! stores byte for byte; indexer and attention with the table's bound, whose magnitude is
//! computed from the file's inputs by the f64 [reference](mod@crate::reference), widened by
//! the rounding of the expected values to their dtype (and doubled when `expected_from`
//! is `kernel`); top-k by the multiset of selected values and the ties-to-lower-position
//! rule. The `Golden::{index_k_store, …}` constructors write files from the references.
//! A malformed file is a [`GoldenError`], never a panic.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use bytemuck::Pod;
use half::bf16;
use safetensors::{SafeTensorError, SafeTensors, View};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sparsekit_host::dtype::ScaleFormat;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{
    decode_rows, IndexKStore, IndexerLogits, KvStore, Op, PageTable, QueryRange, SparseMla, Topk,
    TopkOutput,
};
use sparsekit_host::Backend;

pub use safetensors::Dtype;

use crate::fixtures::{poison_bf16, poison_f32, poison_i32};
use crate::reference;
use crate::suite::{judge_topk_row, tol};
use crate::tolerance::{ErrorStats, Tolerance};

/// The format version this build reads and writes (`params.version`).
pub const VERSION: u32 = 1;

/// Largest value accepted for a size parameter (keeps every size product in range).
const MAX_PARAM: usize = 1 << 24;

/// Why a golden file could not be checked (or written). Every variant is about the file or
/// the backend; a mismatch is not an error but a failing [`GoldenReport`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GoldenError {
    /// The file could not be read or written.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Not a safetensors file (bad header, offsets, or non-string metadata values).
    #[error("not a valid safetensors file: {0}")]
    Safetensors(String),
    /// `__metadata__` lacks `op` or `params`.
    #[error("__metadata__ has no {0:?} entry (golden files need \"op\" and \"params\")")]
    MissingMetadata(&'static str),
    /// `op` names no op.
    #[error("unknown op {0:?} (golden files cover index_k_store, kv_store, indexer_logits, topk, sparse_mla)")]
    UnknownOp(String),
    /// `params` is not valid JSON, lacks a key, has an unknown key or an impossible value.
    #[error("bad params for {op}: {detail}")]
    BadParams { op: String, detail: String },
    /// A tensor the op needs is absent.
    #[error("missing tensor {name:?} (required by {op})")]
    MissingTensor { op: &'static str, name: String },
    /// A tensor has the wrong dtype.
    #[error("tensor {name:?} has dtype {actual:?}, expected {expected:?}")]
    WrongDtype {
        name: String,
        expected: Dtype,
        actual: Dtype,
    },
    /// A tensor has the wrong shape.
    #[error("tensor {name:?} has shape {actual:?}, expected {expected}")]
    WrongShape {
        name: String,
        expected: String,
        actual: Vec<usize>,
    },
    /// The tensors are well-formed but their contents are impossible (a negative range,
    /// an expected top-k entry outside its row, …).
    #[error("invalid file contents: {0}")]
    Invalid(String),
    /// The op's descriptor rejected the file's inputs (slot or page out of range, …).
    #[error("the op rejects the file's inputs: {0}")]
    Rejected(#[source] sparsekit_host::Error),
    /// The backend failed while running the op.
    #[error("backend {backend} failed: {source}")]
    Backend {
        backend: String,
        source: sparsekit_host::Error,
    },
}

type Result<T, E = GoldenError> = std::result::Result<T, E>;

/// One tensor of a golden file: little-endian, row-major bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Tensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?} {:?}, {} bytes)",
            self.dtype,
            self.shape,
            self.data.len()
        )
    }
}

impl Tensor {
    /// A tensor holding `values` (whose length must match `shape`).
    pub fn new<T: Pod>(dtype: Dtype, shape: &[usize], values: &[T]) -> Tensor {
        Tensor {
            dtype,
            shape: shape.to_vec(),
            data: bytemuck::cast_slice(values).to_vec(),
        }
    }

    /// The elements as `T` (copied: file data need not be aligned).
    pub fn values<T: Pod>(&self) -> Vec<T> {
        bytemuck::pod_collect_to_vec(&self.data)
    }
}

impl View for &Tensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        (&self.data[..]).into()
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Where a file's expected outputs come from (`params.expected_from`, default
/// `reference`). Only the toleranced ops (indexer, attention) use it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpectedFrom {
    /// An exact or f64 computation rounded once to the output dtype.
    #[default]
    Reference,
    /// Another kernel held to the same tolerance table: the allowed error doubles.
    Kernel,
}

/// The decode form of a batch's query rows: per request, `next_n` rows over its
/// `context_lens[r]` tokens (see [`decode_rows`]). Written as `context_lens` + `next_n`.
#[derive(Clone, Copy, Debug)]
pub struct Decode<'a> {
    pub context_lens: &'a [u32],
    pub next_n: usize,
}

/// A golden file in memory: op name, params (a JSON object), extra metadata and tensors.
#[derive(Clone, Debug, Default)]
pub struct Golden {
    pub op: String,
    pub params: Value,
    /// Metadata besides `op` and `params` (kept, not interpreted).
    pub metadata: BTreeMap<String, String>,
    pub tensors: BTreeMap<String, Tensor>,
}

/// Judgement of one expected tensor.
#[derive(Clone, Debug, Serialize)]
pub struct Quantity {
    /// The expected tensor (`cache_out`, `logits`, `topk`, `out`, `lse`).
    pub name: &'static str,
    /// The bound applied, in words.
    pub tolerance: String,
    /// Element counts and error figures (for caches: bytes; errors of dequantised values).
    #[serde(flatten)]
    pub stats: ErrorStats,
    pub pass: bool,
    /// Where the first failure is, or empty.
    pub detail: String,
}

/// The result of checking one golden file.
#[derive(Clone, Debug, Serialize)]
pub struct GoldenReport {
    pub op: &'static str,
    pub backend: String,
    /// Dtype column of the tolerance table (`fp8_e4m3`, `bf16`, `fp8_ds_mla`, `fp32`).
    pub dtype: &'static str,
    pub params: Value,
    pub metadata: BTreeMap<String, String>,
    pub quantities: Vec<Quantity>,
    /// Remarks that do not fail the check (ignored tensors, tie choices, …).
    pub notes: Vec<String>,
}

impl GoldenReport {
    /// Whether every expected tensor matched.
    pub fn pass(&self) -> bool {
        !self.quantities.is_empty() && self.quantities.iter().all(|q| q.pass)
    }
}

/// Reads a golden file and checks it on `backend`.
pub fn check_file<B: Backend>(backend: &B, path: impl AsRef<Path>) -> Result<GoldenReport> {
    Golden::read_file(path)?.check(backend)
}

// ---------------------------------------------------------------------------------------
// Params, one struct per op (unknown keys are errors: a misspelt key must not default).

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum IndexDt {
    #[serde(rename = "fp8_e4m3")]
    Fp8E4m3,
    #[serde(rename = "bf16")]
    Bf16,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum KvDt {
    #[serde(rename = "bf16")]
    Bf16,
    #[serde(rename = "fp8_ds_mla")]
    Fp8DsMla,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum TopkOut {
    Positions,
    Slots,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct IndexKStoreParams {
    version: u32,
    dtype: IndexDt,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    scale: Option<ScaleFormat>,
    head_dim: usize,
    page_size: usize,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KvStoreParams {
    version: u32,
    dtype: KvDt,
    nope_dim: usize,
    rope_dim: usize,
    page_size: usize,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct IndexerParams {
    version: u32,
    dtype: IndexDt,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    scale: Option<ScaleFormat>,
    head_dim: usize,
    page_size: usize,
    n_heads: usize,
    row_stride: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next_n: Option<usize>,
    #[serde(default)]
    expected_from: ExpectedFrom,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TopkParams {
    version: u32,
    k: usize,
    row_stride: usize,
    output: TopkOut,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    page_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next_n: Option<usize>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SparseMlaParams {
    version: u32,
    dtype: KvDt,
    nope_dim: usize,
    rope_dim: usize,
    page_size: usize,
    n_heads: usize,
    topk: usize,
    softmax_scale: f64,
    #[serde(default)]
    expected_from: ExpectedFrom,
}

fn index_dtype(dt: IndexDt, scale: Option<ScaleFormat>) -> Result<IndexKDtype, String> {
    match (dt, scale) {
        (IndexDt::Fp8E4m3, Some(scale)) => Ok(IndexKDtype::Fp8E4m3 { scale }),
        (IndexDt::Fp8E4m3, None) => {
            Err("scale (\"fp32\" or \"ue8m0\") is required for fp8_e4m3".into())
        }
        (IndexDt::Bf16, None) => Ok(IndexKDtype::Bf16),
        (IndexDt::Bf16, Some(_)) => Err("scale applies to fp8_e4m3 only".into()),
    }
}

fn index_dt(d: IndexKDtype) -> (IndexDt, Option<ScaleFormat>) {
    match d {
        IndexKDtype::Fp8E4m3 { scale } => (IndexDt::Fp8E4m3, Some(scale)),
        IndexKDtype::Bf16 => (IndexDt::Bf16, None),
    }
}

fn kv_dtype(dt: KvDt) -> KvDtype {
    match dt {
        KvDt::Bf16 => KvDtype::Bf16,
        KvDt::Fp8DsMla => KvDtype::Fp8DsMla,
    }
}

fn kv_dt(d: KvDtype) -> KvDt {
    match d {
        KvDtype::Bf16 => KvDt::Bf16,
        KvDtype::Fp8DsMla => KvDt::Fp8DsMla,
    }
}

/// The ops golden files cover.
const GOLDEN_OPS: [Op; 5] = [
    Op::IndexKStore,
    Op::KvStore,
    Op::IndexerLogits,
    Op::Topk,
    Op::SparseMla,
];

fn op_by_name(name: &str) -> Result<Op> {
    GOLDEN_OPS
        .into_iter()
        .find(|o| o.name() == name)
        .ok_or_else(|| GoldenError::UnknownOp(name.to_string()))
}

// ---------------------------------------------------------------------------------------
// Reading and writing files.

impl Golden {
    /// Parses a golden file's bytes (any op name is accepted here; [`Golden::check`]
    /// rejects unknown ones).
    pub fn from_bytes(bytes: &[u8]) -> Result<Golden> {
        let st_err = |e: SafeTensorError| {
            let hint = match e {
                SafeTensorError::InvalidHeaderDeserialization => {
                    " (__metadata__ values must be strings: params is a JSON string)"
                }
                _ => "",
            };
            GoldenError::Safetensors(format!("{e}{hint}"))
        };
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(st_err)?;
        let st = SafeTensors::deserialize(bytes).map_err(st_err)?;
        let mut metadata: BTreeMap<String, String> = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let op = metadata
            .remove("op")
            .ok_or(GoldenError::MissingMetadata("op"))?;
        let params = metadata
            .remove("params")
            .ok_or(GoldenError::MissingMetadata("params"))?;
        let params: Value = serde_json::from_str(&params).map_err(|e| GoldenError::BadParams {
            op: op.clone(),
            detail: format!("params is not JSON: {e}"),
        })?;
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(name, v)| {
                let t = Tensor {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    data: v.data().to_vec(),
                };
                (name, t)
            })
            .collect();
        Ok(Golden {
            op,
            params,
            metadata,
            tensors,
        })
    }

    /// Reads a golden file.
    pub fn read_file(path: impl AsRef<Path>) -> Result<Golden> {
        Golden::from_bytes(&std::fs::read(path)?)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut meta: HashMap<String, String> = self.metadata.clone().into_iter().collect();
        meta.insert("op".into(), self.op.clone());
        meta.insert("params".into(), self.params.to_string());
        safetensors::serialize(self.tensors.iter(), &Some(meta))
            .map_err(|e| GoldenError::Safetensors(e.to_string()))
    }

    /// Writes the file.
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(std::fs::write(path, self.to_bytes()?)?)
    }

    fn set_params(&mut self, op: Op, params: &impl Serialize) -> Result<()> {
        self.op = op.name().to_string();
        self.params =
            serde_json::to_value(params).map_err(|e| GoldenError::Invalid(e.to_string()))?;
        Ok(())
    }

    fn put<T: Pod>(&mut self, name: &str, dtype: Dtype, shape: &[usize], values: &[T]) {
        self.tensors
            .insert(name.to_string(), Tensor::new(dtype, shape, values));
    }

    /// The tensors of a query-row batch: `rows` `[n, 3]`, or `context_lens` for the decode
    /// form (which must produce exactly `rows`). Returns `next_n` for the params.
    fn put_rows(
        &mut self,
        rows: &[QueryRange],
        decode: Option<Decode<'_>>,
    ) -> Result<Option<usize>> {
        let i32_of = |what: &str, v: u32| {
            i32::try_from(v).map_err(|_| GoldenError::Invalid(format!("{what} {v} exceeds i32")))
        };
        match decode {
            Some(d) => {
                if decode_rows(d.context_lens, d.next_n).map_err(GoldenError::Rejected)? != rows {
                    return Err(GoldenError::Invalid(
                        "the decode form does not produce the op's rows".into(),
                    ));
                }
                let lens = d
                    .context_lens
                    .iter()
                    .map(|&l| i32_of("context length", l))
                    .collect::<Result<Vec<i32>>>()?;
                self.put("context_lens", Dtype::I32, &[lens.len()], &lens);
                Ok(Some(d.next_n))
            }
            None => {
                let mut flat = Vec::with_capacity(rows.len() * 3);
                for r in rows {
                    for v in [r.request, r.start, r.end] {
                        flat.push(i32_of("row value", v)?);
                    }
                }
                self.put("rows", Dtype::I32, &[rows.len(), 3], &flat);
                Ok(None)
            }
        }
    }

    fn put_page_table(&mut self, pt: &PageTable<'_>) {
        self.put(
            "page_table",
            Dtype::I32,
            &[pt.num_requests(), pt.max_pages()],
            pt.as_slice(),
        );
    }

    /// An `index_k_store` file: inputs `keys` (bf16 `[n, head_dim]`), the op's slots and
    /// `cache_in` (whole pages); `cache_out` from [`reference::index_k_store`].
    pub fn index_k_store(op: &IndexKStore<'_>, keys: &[bf16], cache_in: &[u8]) -> Result<Golden> {
        let l = op.layout;
        let pages = op
            .validate(std::mem::size_of_val(keys), cache_in.len())
            .map_err(GoldenError::Rejected)?;
        let (dtype, scale) = index_dt(l.dtype());
        let p = IndexKStoreParams {
            version: VERSION,
            dtype,
            scale,
            head_dim: l.head_dim(),
            page_size: l.page_size(),
        };
        let mut g = Golden::default();
        g.set_params(Op::IndexKStore, &p)?;
        let mut out = cache_in.to_vec();
        reference::index_k_store(&l, &mut out, keys, op.slots);
        let cache_shape = [pages, l.bytes_per_page()];
        g.put("keys", Dtype::BF16, &[op.slots.len(), l.head_dim()], keys);
        g.put("slots", Dtype::I64, &[op.slots.len()], op.slots);
        g.put("cache_in", Dtype::U8, &cache_shape, cache_in);
        g.put("cache_out", Dtype::U8, &cache_shape, &out);
        Ok(g)
    }

    /// A `kv_store` file: inputs `kv` (bf16 `[n, nope_dim + rope_dim]`), the op's slots and
    /// `cache_in`; `cache_out` from [`reference::kv_store`].
    pub fn kv_store(op: &KvStore<'_>, kv: &[bf16], cache_in: &[u8]) -> Result<Golden> {
        let l = op.layout;
        let pages = op
            .validate(std::mem::size_of_val(kv), cache_in.len())
            .map_err(GoldenError::Rejected)?;
        let p = KvStoreParams {
            version: VERSION,
            dtype: kv_dt(l.dtype()),
            nope_dim: l.nope_dim(),
            rope_dim: l.rope_dim(),
            page_size: l.page_size(),
        };
        let mut g = Golden::default();
        g.set_params(Op::KvStore, &p)?;
        let mut out = cache_in.to_vec();
        reference::kv_store(&l, &mut out, kv, op.slots);
        let cache_shape = [pages, l.bytes_per_page()];
        g.put("kv", Dtype::BF16, &[op.slots.len(), l.d_qk()], kv);
        g.put("slots", Dtype::I64, &[op.slots.len()], op.slots);
        g.put("cache_in", Dtype::U8, &cache_shape, cache_in);
        g.put("cache_out", Dtype::U8, &cache_shape, &out);
        Ok(g)
    }

    /// An `indexer_logits` file; `logits` from [`reference::indexer_logits`] rounded to
    /// f32. With `decode`, the rows are written in the decode form.
    pub fn indexer_logits(
        op: &IndexerLogits<'_>,
        decode: Option<Decode<'_>>,
        q: &[bf16],
        weights: &[f32],
        cache: &[u8],
    ) -> Result<Golden> {
        let l = op.layout;
        let (n, h, stride) = (op.rows.len(), op.n_heads, op.row_stride);
        let pages = op
            .validate(
                std::mem::size_of_val(q),
                std::mem::size_of_val(weights),
                cache.len(),
                n * stride * 4,
            )
            .map_err(GoldenError::Rejected)?;
        let (dtype, scale) = index_dt(l.dtype());
        let mut g = Golden::default();
        let next_n = g.put_rows(&op.rows, decode)?;
        let p = IndexerParams {
            version: VERSION,
            dtype,
            scale,
            head_dim: l.head_dim(),
            page_size: l.page_size(),
            n_heads: h,
            row_stride: stride,
            next_n,
            expected_from: ExpectedFrom::Reference,
        };
        let want =
            reference::indexer_logits(&l, cache, &op.page_table, &op.rows, h, q, weights, stride);
        let logits: Vec<f32> = want.logits.iter().map(|&x| x as f32).collect();
        g.set_params(Op::IndexerLogits, &p)?;
        g.put_page_table(&op.page_table);
        g.put("q", Dtype::BF16, &[n, h, l.head_dim()], q);
        g.put("weights", Dtype::F32, &[n, h], weights);
        g.put("cache", Dtype::U8, &[pages, l.bytes_per_page()], cache);
        g.put("logits", Dtype::F32, &[n, stride], &logits);
        Ok(g)
    }

    /// A `topk` file; `topk` from [`reference::topk_row`] (ties to the lower position),
    /// as positions or slots per the op's output.
    pub fn topk(op: &Topk<'_>, decode: Option<Decode<'_>>, logits: &[f32]) -> Result<Golden> {
        let (n, k, stride) = (op.rows.len(), op.k, op.row_stride);
        op.validate(std::mem::size_of_val(logits), n * k * 4)
            .map_err(GoldenError::Rejected)?;
        let mut g = Golden::default();
        let next_n = g.put_rows(op.rows, decode)?;
        let (output, page_size) = match op.output {
            TopkOutput::Positions => (TopkOut::Positions, None),
            TopkOutput::Slots {
                page_table,
                page_size,
            } => {
                g.put_page_table(&page_table);
                (TopkOut::Slots, Some(page_size))
            }
        };
        let p = TopkParams {
            version: VERSION,
            k,
            row_stride: stride,
            output,
            page_size,
            next_n,
        };
        let mut out = vec![-1i32; n * k];
        for (r, range) in op.rows.iter().enumerate() {
            let row = &logits[r * stride..(r + 1) * stride];
            let want = topk_want(row, range, k, &op.output);
            out[r * k..(r + 1) * k].copy_from_slice(&want);
        }
        g.set_params(Op::Topk, &p)?;
        g.put("logits", Dtype::F32, &[n, stride], logits);
        g.put("topk", Dtype::I32, &[n, k], &out);
        Ok(g)
    }

    /// A `sparse_mla` file; `out` (rounded to bf16) and `lse` (to f32) from
    /// [`reference::sparse_mla`].
    pub fn sparse_mla(op: &SparseMla, q: &[bf16], cache: &[u8], indices: &[i32]) -> Result<Golden> {
        let l = op.layout;
        let (t, h) = (op.n_tokens, op.n_heads);
        let pages = op
            .validate(
                std::mem::size_of_val(q),
                cache.len(),
                std::mem::size_of_val(indices),
                t * h * l.nope_dim() * 2,
                t * h * 4,
            )
            .map_err(GoldenError::Rejected)?;
        check_indices(indices, pages * l.page_size())?;
        let p = SparseMlaParams {
            version: VERSION,
            dtype: kv_dt(l.dtype()),
            nope_dim: l.nope_dim(),
            rope_dim: l.rope_dim(),
            page_size: l.page_size(),
            n_heads: h,
            topk: op.topk,
            softmax_scale: op.softmax_scale as f64,
            expected_from: ExpectedFrom::Reference,
        };
        let mut g = Golden::default();
        g.set_params(Op::SparseMla, &p)?;
        let want = reference::sparse_mla(&l, cache, q, indices, t, h, op.topk, op.softmax_scale);
        let out: Vec<bf16> = want.out.iter().map(|&x| bf16::from_f64(x)).collect();
        let lse: Vec<f32> = want.lse.iter().map(|&x| x as f32).collect();
        g.put("q", Dtype::BF16, &[t, h, l.d_qk()], q);
        g.put("cache", Dtype::U8, &[pages, l.bytes_per_page()], cache);
        g.put("indices", Dtype::I32, &[t, op.topk], indices);
        g.put("out", Dtype::BF16, &[t, h, l.nope_dim()], &out);
        g.put("lse", Dtype::F32, &[t, h], &lse);
        Ok(g)
    }
}

/// The reference top-k of one row (`row` = the whole logits row), padded with `-1`.
fn topk_want(row: &[f32], range: &QueryRange, k: usize, output: &TopkOutput<'_>) -> Vec<i32> {
    let (s, e) = (range.start as usize, range.end as usize);
    let mut want: Vec<i32> = reference::topk_row(&row[s..e], k)
        .into_iter()
        .map(|p| encode_position(output, range, s + p))
        .collect();
    want.resize(k, -1);
    want
}

fn encode_position(output: &TopkOutput<'_>, range: &QueryRange, pos: usize) -> i32 {
    match output {
        TopkOutput::Positions => pos as i32,
        TopkOutput::Slots {
            page_table,
            page_size,
        } => page_table.slot(range.request as usize, pos, *page_size) as i32,
    }
}

fn check_indices(indices: &[i32], capacity: usize) -> Result<()> {
    match indices
        .iter()
        .enumerate()
        .find(|(_, &s)| s < -1 || (s >= 0 && s as usize >= capacity))
    {
        Some((i, &s)) => Err(GoldenError::Rejected(
            sparsekit_host::Error::SlotOutOfRange {
                what: "indices",
                index: i,
                slot: s as i64,
                capacity,
            },
        )),
        None => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------
// Checking.

/// Reads the tensors of one file for one op, remembering which were used.
struct Reader<'g> {
    g: &'g Golden,
    op: Op,
    used: BTreeSet<&'static str>,
}

/// A dimension of an expected shape: its name and, when fixed, its size.
type Dim = (&'static str, Option<usize>);

impl<'g> Reader<'g> {
    fn bad(&self, detail: impl Into<String>) -> GoldenError {
        GoldenError::BadParams {
            op: self.op.name().into(),
            detail: detail.into(),
        }
    }

    fn params<P: DeserializeOwned>(&self) -> Result<P> {
        match self.g.params.get("version").map(Value::as_u64) {
            Some(Some(v)) if v == VERSION as u64 => {}
            Some(_) => {
                return Err(self.bad(format!(
                    "version {} is not supported (this build reads version {VERSION})",
                    self.g.params["version"]
                )))
            }
            None => return Err(self.bad(format!("version is missing (use {VERSION})"))),
        }
        serde_json::from_value(self.g.params.clone()).map_err(|e| self.bad(e.to_string()))
    }

    /// Checks that size parameters are in `1..=2^24`.
    fn sizes(&self, sizes: &[(&str, usize)]) -> Result<()> {
        match sizes.iter().find(|(_, v)| *v == 0 || *v > MAX_PARAM) {
            Some((name, v)) => Err(self.bad(format!("{name} = {v} must be in 1..={MAX_PARAM}"))),
            None => Ok(()),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.g.tensors.contains_key(name)
    }

    /// The tensor `name`, checked against `dtype` and `dims`.
    fn tensor(&mut self, name: &'static str, dtype: Dtype, dims: &[Dim]) -> Result<&'g Tensor> {
        self.used.insert(name);
        let t = self.g.tensors.get(name).ok_or(GoldenError::MissingTensor {
            op: self.op.name(),
            name: name.to_string(),
        })?;
        if t.dtype != dtype {
            return Err(GoldenError::WrongDtype {
                name: name.into(),
                expected: dtype,
                actual: t.dtype,
            });
        }
        let fits = t.shape.len() == dims.len()
            && t.shape
                .iter()
                .zip(dims)
                .all(|(s, (_, d))| d.is_none_or(|d| d == *s));
        let elems = t.shape.iter().try_fold(1usize, |a, &s| a.checked_mul(s));
        if !fits || elems.and_then(|n| n.checked_mul(dtype.size())) != Some(t.data.len()) {
            let expected: Vec<String> = dims
                .iter()
                .map(|(n, d)| d.map_or(n.to_string(), |d| format!("{n}={d}")))
                .collect();
            return Err(GoldenError::WrongShape {
                name: name.into(),
                expected: format!("[{}]", expected.join(", ")),
                actual: t.shape.clone(),
            });
        }
        Ok(t)
    }

    /// A paged cache: U8 `[num_pages, bytes_per_page]`.
    fn cache(
        &mut self,
        name: &'static str,
        bytes_per_page: usize,
        pages: Option<usize>,
    ) -> Result<&'g Tensor> {
        self.tensor(
            name,
            Dtype::U8,
            &[
                ("num_pages", pages),
                ("bytes_per_page", Some(bytes_per_page)),
            ],
        )
    }

    /// The query rows of a batch of `n_rows`: `rows` I32 `[n_rows, 3]` (request, start,
    /// end) or `context_lens` I32 `[n_requests]` with `params.next_n`. Returns the rows
    /// and, for the decode form, the number of requests.
    fn rows(
        &mut self,
        n_rows: usize,
        next_n: Option<usize>,
    ) -> Result<(Vec<QueryRange>, Option<usize>)> {
        let non_neg = |what: &str, v: i32| {
            u32::try_from(v).map_err(|_| GoldenError::Invalid(format!("{what} = {v} is negative")))
        };
        match (self.has("rows"), self.has("context_lens"), next_n) {
            (true, true, _) => Err(self.bad("give rows or context_lens, not both")),
            (true, false, Some(_)) => {
                Err(self.bad("next_n applies to the decode form (context_lens) only"))
            }
            (false, true, None) => Err(self.bad("next_n is required with context_lens")),
            (true, false, None) => {
                let t = self.tensor(
                    "rows",
                    Dtype::I32,
                    &[("n_rows", Some(n_rows)), ("3", Some(3))],
                )?;
                let rows = t
                    .values::<i32>()
                    .chunks(3)
                    .enumerate()
                    .map(|(i, c)| {
                        Ok(QueryRange {
                            request: non_neg(&format!("rows[{i}][0]"), c[0])?,
                            start: non_neg(&format!("rows[{i}][1]"), c[1])?,
                            end: non_neg(&format!("rows[{i}][2]"), c[2])?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((rows, None))
            }
            (false, true, Some(next_n)) => {
                self.sizes(&[("next_n", next_n)])?;
                let t = self.tensor("context_lens", Dtype::I32, &[("n_requests", None)])?;
                let lens = t
                    .values::<i32>()
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| non_neg(&format!("context_lens[{i}]"), v))
                    .collect::<Result<Vec<u32>>>()?;
                if lens.len().checked_mul(next_n) != Some(n_rows) {
                    return Err(GoldenError::Invalid(format!(
                        "{} requests × next_n {next_n} rows, but the batch has {n_rows} rows",
                        lens.len()
                    )));
                }
                let rows = decode_rows(&lens, next_n).map_err(GoldenError::Rejected)?;
                Ok((rows, Some(lens.len())))
            }
            (false, false, _) => Err(GoldenError::MissingTensor {
                op: self.op.name(),
                name: "rows (or context_lens)".into(),
            }),
        }
    }

    /// The page table: I32 `[n_requests, max_pages]`.
    fn page_table(&mut self, n_requests: Option<usize>) -> Result<(Vec<i32>, usize)> {
        let t = self.tensor(
            "page_table",
            Dtype::I32,
            &[("n_requests", n_requests), ("max_pages", None)],
        )?;
        Ok((t.values(), t.shape[1]))
    }
}

/// Widens a tolerance row for expected values rounded to their dtype (`rounding`: the
/// relative half-ulp, 2^-8 for bf16 and 2^-24 for f32), doubled for kernel-made values.
fn widen(t: &Tolerance, from: ExpectedFrom, rounding: f64) -> Tolerance {
    let f = match from {
        ExpectedFrom::Reference => 1.0,
        ExpectedFrom::Kernel => 2.0,
    };
    Tolerance {
        atol: t.atol * f,
        rtol: t.rtol * f + rounding,
        ..*t
    }
}

/// A tolerance row in words (`exact`, or the bound with the widened factors).
fn describe(t: &Tolerance) -> String {
    if t.atol == 0.0 && t.rtol == 0.0 {
        "exact".into()
    } else {
        format!("{:.2e}·mag + {:.2e}·|ref|", t.atol, t.rtol)
    }
}

const BF16_ROUNDING: f64 = 1.0 / 256.0;
const F32_ROUNDING: f64 = 1.0 / 16_777_216.0;

fn quantity(name: &'static str, t: &Tolerance, mut stats: ErrorStats, shape: &[usize]) -> Quantity {
    stats.finish();
    let detail = stats.first_failure.map_or(String::new(), |(i, got, want)| {
        format!(
            "{} of {} elements out of tolerance; first at {name}{:?}: got {got}, expected {want}",
            stats.failures,
            stats.count,
            unflatten(i, shape)
        )
    });
    Quantity {
        name,
        tolerance: describe(t),
        pass: stats.pass(),
        stats,
        detail,
    }
}

/// Row-major coordinates of flat index `i` in `shape`.
fn unflatten(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut c = vec![0; shape.len()];
    for (ci, &s) in c.iter_mut().zip(shape).rev() {
        *ci = i % s.max(1);
        i /= s.max(1);
    }
    c
}

/// Byte comparison of a whole cache (the pass criterion), with the errors of the
/// dequantised values at `slots` as figures.
fn compare_cache(
    t: &Tolerance,
    got: &[u8],
    want: &[u8],
    slots: &[i64],
    bytes_per_page: usize,
    read: impl Fn(&[u8], usize) -> Vec<f64>,
) -> Quantity {
    let mut values = ErrorStats::default();
    for &s in slots.iter().filter(|&&s| s >= 0) {
        for (g, w) in read(got, s as usize)
            .into_iter()
            .zip(read(want, s as usize))
        {
            values.add(0, g, w, 0.0, t);
        }
    }
    values.finish();
    let mut stats = ErrorStats::default();
    stats.count = got.len();
    stats.max_abs_err = values.max_abs_err;
    stats.max_rel_err = values.max_rel_err;
    for (i, (g, w)) in got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g != w)
    {
        stats.failures += 1;
        stats.first_failure.get_or_insert((i, *g as f64, *w as f64));
    }
    stats.worst_ratio = if stats.failures > 0 {
        f64::INFINITY
    } else {
        0.0
    };
    let detail = stats.first_failure.map_or(String::new(), |(i, g, w)| {
        format!(
            "{} of {} bytes differ; first at page {}, byte {}: got {g:#04x}, expected {w:#04x}",
            stats.failures,
            stats.count,
            i / bytes_per_page,
            i % bytes_per_page,
            g = g as u8,
            w = w as u8
        )
    });
    Quantity {
        name: "cache_out",
        tolerance: describe(t),
        pass: stats.failures == 0 && stats.count > 0,
        stats,
        detail,
    }
}

/// A missing tolerance row (a bug in the table, not in the file).
fn internal(e: sparsekit_host::Error) -> GoldenError {
    GoldenError::Invalid(e.to_string())
}

/// What one op's check produced.
struct Judged {
    dtype: &'static str,
    quantities: Vec<Quantity>,
    notes: Vec<String>,
}

impl Golden {
    /// Runs the file's op on `backend` and judges the outputs against the expected tensors.
    pub fn check<B: Backend>(&self, backend: &B) -> Result<GoldenReport> {
        let op = op_by_name(&self.op)?;
        let mut r = Reader {
            g: self,
            op,
            used: BTreeSet::new(),
        };
        let run = Run { b: backend };
        let judged = match op.name() {
            "index_k_store" => run.index_k_store(&mut r)?,
            "kv_store" => run.kv_store(&mut r)?,
            "indexer_logits" => run.indexer(&mut r)?,
            "topk" => run.topk(&mut r)?,
            "sparse_mla" => run.sparse_mla(&mut r)?,
            _ => return Err(GoldenError::UnknownOp(self.op.clone())),
        };
        let mut notes = judged.notes;
        let ignored: Vec<&str> = self
            .tensors
            .keys()
            .map(String::as_str)
            .filter(|n| !r.used.contains(n))
            .collect();
        if !ignored.is_empty() {
            notes.push(format!(
                "ignored tensors not used by {}: {}",
                op.name(),
                ignored.join(", ")
            ));
        }
        Ok(GoldenReport {
            op: op.name(),
            backend: backend.name().to_string(),
            dtype: judged.dtype,
            params: self.params.clone(),
            metadata: self.metadata.clone(),
            quantities: judged.quantities,
            notes,
        })
    }
}

/// Runs ops on one backend, mapping its errors.
struct Run<'b, B> {
    b: &'b B,
}

impl<B: Backend> Run<'_, B> {
    fn err(&self, source: sparsekit_host::Error) -> GoldenError {
        GoldenError::Backend {
            backend: self.b.name().to_string(),
            source,
        }
    }

    fn up(&self, bytes: &[u8]) -> Result<B::Buffer> {
        self.b.upload(bytes).map_err(|e| self.err(e))
    }

    fn down<T: Pod>(&self, buf: &B::Buffer) -> Result<Vec<T>> {
        Ok(bytemuck::pod_collect_to_vec(
            &self.b.download(buf).map_err(|e| self.err(e))?,
        ))
    }

    fn index_k_store(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: IndexKStoreParams = r.params()?;
        r.sizes(&[("head_dim", p.head_dim), ("page_size", p.page_size)])?;
        let dt = index_dtype(p.dtype, p.scale).map_err(|e| r.bad(e))?;
        let layout =
            IndexKLayout::new(dt, p.head_dim, p.page_size).map_err(|e| r.bad(e.to_string()))?;
        let bpp = layout.bytes_per_page();
        let keys = r.tensor(
            "keys",
            Dtype::BF16,
            &[("n_tokens", None), ("head_dim", Some(p.head_dim))],
        )?;
        let slots: Vec<i64> = r
            .tensor("slots", Dtype::I64, &[("n_tokens", Some(keys.shape[0]))])?
            .values();
        let cache_in = r.cache("cache_in", bpp, None)?;
        let want = r.cache("cache_out", bpp, Some(cache_in.shape[0]))?;
        let op = IndexKStore {
            layout,
            slots: &slots,
        };
        op.validate(keys.data.len(), cache_in.data.len())
            .map_err(GoldenError::Rejected)?;
        let mut cache = self.up(&cache_in.data)?;
        self.b
            .index_k_store(&op, &self.up(&keys.data)?, &mut cache)
            .map_err(|e| self.err(e))?;
        let got: Vec<u8> = self.down(&cache)?;
        let t = tol(Op::IndexKStore.name(), "cache", dt.name()).map_err(internal)?;
        let read = |c: &[u8], s: usize| {
            let (v, scale) = reference::read_index_key(&layout, c, s);
            v.into_iter().map(|x| x * scale).collect()
        };
        Ok(Judged {
            dtype: dt.name(),
            quantities: vec![compare_cache(t, &got, &want.data, &slots, bpp, read)],
            notes: Vec::new(),
        })
    }

    fn kv_store(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: KvStoreParams = r.params()?;
        r.sizes(&[
            ("nope_dim", p.nope_dim),
            ("rope_dim", p.rope_dim),
            ("page_size", p.page_size),
        ])?;
        let dt = kv_dtype(p.dtype);
        let layout = KvLayout::new(dt, p.nope_dim, p.rope_dim, p.page_size)
            .map_err(|e| r.bad(e.to_string()))?;
        let bpp = layout.bytes_per_page();
        let kv = r.tensor(
            "kv",
            Dtype::BF16,
            &[("n_tokens", None), ("d_qk", Some(layout.d_qk()))],
        )?;
        let slots: Vec<i64> = r
            .tensor("slots", Dtype::I64, &[("n_tokens", Some(kv.shape[0]))])?
            .values();
        let cache_in = r.cache("cache_in", bpp, None)?;
        let want = r.cache("cache_out", bpp, Some(cache_in.shape[0]))?;
        let op = KvStore {
            layout,
            slots: &slots,
        };
        op.validate(kv.data.len(), cache_in.data.len())
            .map_err(GoldenError::Rejected)?;
        let mut cache = self.up(&cache_in.data)?;
        self.b
            .kv_store(&op, &self.up(&kv.data)?, &mut cache)
            .map_err(|e| self.err(e))?;
        let got: Vec<u8> = self.down(&cache)?;
        let t = tol(Op::KvStore.name(), "cache", dt.name()).map_err(internal)?;
        let read = |c: &[u8], s: usize| reference::read_kv_token(&layout, c, s);
        Ok(Judged {
            dtype: dt.name(),
            quantities: vec![compare_cache(t, &got, &want.data, &slots, bpp, read)],
            notes: Vec::new(),
        })
    }

    fn indexer(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: IndexerParams = r.params()?;
        r.sizes(&[
            ("head_dim", p.head_dim),
            ("page_size", p.page_size),
            ("n_heads", p.n_heads),
            ("row_stride", p.row_stride),
        ])?;
        let dt = index_dtype(p.dtype, p.scale).map_err(|e| r.bad(e))?;
        let layout =
            IndexKLayout::new(dt, p.head_dim, p.page_size).map_err(|e| r.bad(e.to_string()))?;
        let (h, d, stride) = (p.n_heads, p.head_dim, p.row_stride);
        let q = r.tensor(
            "q",
            Dtype::BF16,
            &[
                ("n_rows", None),
                ("n_heads", Some(h)),
                ("head_dim", Some(d)),
            ],
        )?;
        let n = q.shape[0];
        let (rows, n_req) = r.rows(n, p.next_n)?;
        let (table, max_pages) = r.page_table(n_req)?;
        let w = r.tensor(
            "weights",
            Dtype::F32,
            &[("n_rows", Some(n)), ("n_heads", Some(h))],
        )?;
        let cache = r.cache("cache", layout.bytes_per_page(), None)?;
        let want: Vec<f32> = r
            .tensor(
                "logits",
                Dtype::F32,
                &[("n_rows", Some(n)), ("row_stride", Some(stride))],
            )?
            .values();
        let pt = PageTable::new(&table, max_pages).map_err(GoldenError::Rejected)?;
        let op = IndexerLogits {
            layout,
            n_heads: h,
            page_table: pt,
            rows,
            row_stride: stride,
        };
        op.validate(q.data.len(), w.data.len(), cache.data.len(), n * stride * 4)
            .map_err(GoldenError::Rejected)?;
        let mut out = self.up(&poison_f32(n * stride))?;
        self.b
            .indexer_logits(
                &op,
                &self.up(&q.data)?,
                &self.up(&w.data)?,
                &self.up(&cache.data)?,
                &mut out,
            )
            .map_err(|e| self.err(e))?;
        let got: Vec<f32> = self.down(&out)?;
        // The file holds no magnitudes: the reference computes them from the inputs.
        let (qv, wv) = (q.values::<bf16>(), w.values::<f32>());
        let refr =
            reference::indexer_logits(&layout, &cache.data, &pt, &op.rows, h, &qv, &wv, stride);
        let t = widen(
            tol(Op::IndexerLogits.name(), "logits", dt.name()).map_err(internal)?,
            p.expected_from,
            F32_ROUNDING,
        );
        let mut stats = ErrorStats::default();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            stats.add(i, *g as f64, *w as f64, refr.magnitude[i], &t);
        }
        Ok(Judged {
            dtype: dt.name(),
            quantities: vec![quantity("logits", &t, stats, &[n, stride])],
            notes: Vec::new(),
        })
    }

    fn topk(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: TopkParams = r.params()?;
        r.sizes(&[("k", p.k), ("row_stride", p.row_stride)])?;
        let (k, stride) = (p.k, p.row_stride);
        let logits_t = r.tensor(
            "logits",
            Dtype::F32,
            &[("n_rows", None), ("row_stride", Some(stride))],
        )?;
        let n = logits_t.shape[0];
        let (rows, n_req) = r.rows(n, p.next_n)?;
        let table = match (p.output, p.page_size) {
            (TopkOut::Slots, Some(ps)) => {
                r.sizes(&[("page_size", ps)])?;
                Some((r.page_table(n_req)?, ps))
            }
            (TopkOut::Slots, None) => {
                return Err(r.bad("page_size is required for output \"slots\""))
            }
            (TopkOut::Positions, Some(_)) => {
                return Err(r.bad("page_size applies to output \"slots\" only"))
            }
            (TopkOut::Positions, None) => None,
        };
        let want_t = r.tensor("topk", Dtype::I32, &[("n_rows", Some(n)), ("k", Some(k))])?;
        let (logits, file_want) = (logits_t.values::<f32>(), want_t.values::<i32>());
        let output = match &table {
            Some(((t, max_pages), ps)) => TopkOutput::Slots {
                page_table: PageTable::new(t, *max_pages).map_err(GoldenError::Rejected)?,
                page_size: *ps,
            },
            None => TopkOutput::Positions,
        };
        let op = Topk {
            k,
            row_stride: stride,
            rows: &rows,
            output,
        };
        op.validate(logits_t.data.len(), n * k * 4)
            .map_err(GoldenError::Rejected)?;
        let mut out = self.up(&poison_i32(n * k))?;
        self.b
            .topk(&op, &self.up(&logits_t.data)?, &mut out)
            .map_err(|e| self.err(e))?;
        let got: Vec<i32> = self.down(&out)?;
        let t = tol(Op::Topk.name(), "indices", "fp32").map_err(internal)?;
        let (mut stats, mut detail, mut other_ties) = (ErrorStats::default(), String::new(), 0);
        for (ri, range) in rows.iter().enumerate() {
            let row = &logits[ri * stride..(ri + 1) * stride];
            let (s, e) = (range.start as usize, range.end as usize);
            // Output entry -> the logit it selects (None: not a position of the range).
            let by_entry: HashMap<i32, f64> = (s..e)
                .map(|pos| (encode_position(&output, range, pos), row[pos] as f64))
                .collect();
            let value = |v: &i32| by_entry.get(v).copied();
            let (g, fw) = (&got[ri * k..(ri + 1) * k], &file_want[ri * k..(ri + 1) * k]);
            let got_vals: Vec<f64> = g
                .iter()
                .filter(|&&v| v != -1)
                .map(|v| value(v).unwrap_or(f64::NAN))
                .collect();
            let mut want_vals = Vec::with_capacity(k);
            for (j, v) in fw.iter().enumerate().filter(|(_, &v)| v != -1) {
                want_vals.push(value(v).ok_or_else(|| {
                    GoldenError::Invalid(format!(
                        "expected topk[{ri}][{j}] = {v} is not a {} of row {ri}'s range [{s}, {e})",
                        if table.is_some() { "slot" } else { "position" }
                    ))
                })?);
            }
            // Judged against the tie rule (the file's own tie choices may differ).
            let rule = topk_want(row, range, k, &output);
            let before = stats.failures;
            judge_topk_row(&mut stats, ri * k, g, &rule, &got_vals, &want_vals);
            if stats.failures > before && detail.is_empty() {
                detail = match g.iter().zip(&rule).position(|(a, b)| a != b) {
                    Some(j) => format!(
                        "row {ri}, entry {j}: got {}, want {} (ascending, ties to the lower position, -1 padding)",
                        g[j], rule[j]
                    ),
                    None => format!("row {ri}: the selected values differ from the expected top-k's"),
                };
            } else if stats.failures == before && fw != rule.as_slice() {
                other_ties += 1;
            }
        }
        let mut q = quantity("topk", t, stats, &[n, k]);
        if !detail.is_empty() {
            q.detail = format!("{} failures; first at {detail}", q.stats.failures);
        }
        let mut notes = Vec::new();
        if other_ties > 0 {
            notes.push(format!(
                "{other_ties} rows of the expected top-k hold the same values in another order or with other tied positions; judged by value and the ties-to-lower-position rule"
            ));
        }
        Ok(Judged {
            dtype: "fp32",
            quantities: vec![q],
            notes,
        })
    }

    fn sparse_mla(&self, r: &mut Reader<'_>) -> Result<Judged> {
        let p: SparseMlaParams = r.params()?;
        r.sizes(&[
            ("nope_dim", p.nope_dim),
            ("rope_dim", p.rope_dim),
            ("page_size", p.page_size),
            ("n_heads", p.n_heads),
            ("topk", p.topk),
        ])?;
        let dt = kv_dtype(p.dtype);
        let layout = KvLayout::new(dt, p.nope_dim, p.rope_dim, p.page_size)
            .map_err(|e| r.bad(e.to_string()))?;
        let (h, dv, topk) = (p.n_heads, layout.nope_dim(), p.topk);
        let q = r.tensor(
            "q",
            Dtype::BF16,
            &[
                ("n_tokens", None),
                ("n_heads", Some(h)),
                ("d_qk", Some(layout.d_qk())),
            ],
        )?;
        let n = q.shape[0];
        let cache = r.cache("cache", layout.bytes_per_page(), None)?;
        let idx_t = r.tensor(
            "indices",
            Dtype::I32,
            &[("n_tokens", Some(n)), ("topk", Some(topk))],
        )?;
        let want_out: Vec<bf16> = r
            .tensor(
                "out",
                Dtype::BF16,
                &[
                    ("n_tokens", Some(n)),
                    ("n_heads", Some(h)),
                    ("d_v", Some(dv)),
                ],
            )?
            .values();
        let want_lse: Vec<f32> = r
            .tensor(
                "lse",
                Dtype::F32,
                &[("n_tokens", Some(n)), ("n_heads", Some(h))],
            )?
            .values();
        let op = SparseMla {
            layout,
            n_tokens: n,
            n_heads: h,
            topk,
            softmax_scale: p.softmax_scale as f32,
        };
        let pages = op
            .validate(
                q.data.len(),
                cache.data.len(),
                idx_t.data.len(),
                n * h * dv * 2,
                n * h * 4,
            )
            .map_err(GoldenError::Rejected)?;
        let indices = idx_t.values::<i32>();
        check_indices(&indices, pages * layout.page_size())?;
        let mut out = self.up(&poison_bf16(n * h * dv))?;
        let mut lse = self.up(&poison_f32(n * h))?;
        self.b
            .sparse_mla(
                &op,
                &self.up(&q.data)?,
                &self.up(&cache.data)?,
                &self.up(&idx_t.data)?,
                &mut out,
                &mut lse,
            )
            .map_err(|e| self.err(e))?;
        let (got_out, got_lse): (Vec<bf16>, Vec<f32>) = (self.down(&out)?, self.down(&lse)?);
        let refr = reference::sparse_mla(
            &layout,
            &cache.data,
            &q.values(),
            &indices,
            n,
            h,
            topk,
            op.softmax_scale,
        );
        let table = |quantity| tol(Op::SparseMla.name(), quantity, dt.name()).map_err(internal);
        let to = widen(table("out")?, p.expected_from, BF16_ROUNDING);
        let tl = widen(table("lse")?, p.expected_from, F32_ROUNDING);
        let mut so = ErrorStats::default();
        for (i, (g, w)) in got_out.iter().zip(&want_out).enumerate() {
            so.add(i, g.to_f64(), w.to_f64(), refr.out_magnitude[i / dv], &to);
        }
        let mut sl = ErrorStats::default();
        for (i, (g, w)) in got_lse.iter().zip(&want_lse).enumerate() {
            sl.add(i, *g as f64, *w as f64, refr.lse_magnitude[i], &tl);
        }
        Ok(Judged {
            dtype: dt.name(),
            quantities: vec![
                quantity("out", &to, so, &[n, h, dv]),
                quantity("lse", &tl, sl, &[n, h]),
            ],
            notes: Vec::new(),
        })
    }
}
