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
//!
//! Files: `params` (the params of each op), `format` (tensors, reading, writing, the
//! constructors), `reader` (one op's tensors out of a file), `judge` (comparisons and
//! reports), `run` (running the op on a backend).

mod conventions;
mod format;
mod judge;
mod params;
mod reader;
mod run;
mod run_v4;

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sparsekit_host::ops::Op;
use sparsekit_host::Backend;

pub use conventions::{
    Conventions, Division, EmptyLse, InvalidIndices, KeyDequant, LseLayout, TopkPadding,
};
pub use format::Tensor;
pub use judge::{topk_expected, topk_expected_for};
pub use safetensors::Dtype;

use crate::tolerance::{DataType, ErrorStats};
use params::op_by_name;
use reader::Reader;
use run::Run;

/// The format version this build reads and writes (`params.version`).
pub const VERSION: u32 = 1;

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

/// Result of golden-file operations.
pub type Result<T, E = GoldenError> = std::result::Result<T, E>;

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
/// `context_lens[r]` tokens (see [`decode_rows`](sparsekit_host::ops::decode_rows)). Written as `context_lens` + `next_n`.
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
pub struct QuantityReport {
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
    pub op: Op,
    pub backend: String,
    /// Dtype column of the tolerance table (`fp8_e4m3`, `bf16`, `fp8_ds_mla`, `fp32`).
    pub dtype: DataType,
    pub params: Value,
    pub metadata: BTreeMap<String, String>,
    pub quantities: Vec<QuantityReport>,
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

impl Golden {
    /// Runs the file's op on `backend` and judges the outputs against the expected tensors.
    pub fn check<B: Backend>(&self, backend: &B) -> Result<GoldenReport> {
        let op = op_by_name(&self.op)?;
        let mut r = Reader::new(self, op);
        let run = Run { b: backend };
        let judged = match op {
            Op::IndexKStore => run.index_k_store(&mut r)?,
            Op::KvStore => run.kv_store(&mut r)?,
            Op::IndexerLogits => run.indexer_logits(&mut r)?,
            Op::Topk => run.topk(&mut r)?,
            Op::SparseMla => run.sparse_mla(&mut r)?,
            Op::SparseMlaV4 => run.sparse_mla_v4(&mut r)?,
            Op::CopyPages | Op::PageChecksums => {
                return Err(GoldenError::UnknownOp(self.op.clone()))
            }
        };
        let mut notes = judged.notes;
        let ignored: Vec<&str> = self
            .tensors
            .keys()
            .map(String::as_str)
            .filter(|n| !r.used(n))
            .collect();
        if !ignored.is_empty() {
            notes.push(format!(
                "ignored tensors not used by {}: {}",
                op.name(),
                ignored.join(", ")
            ));
        }
        Ok(GoldenReport {
            op,
            backend: backend.name().to_string(),
            dtype: judged.dtype,
            params: self.params.clone(),
            metadata: self.metadata.clone(),
            quantities: judged.quantities,
            notes,
        })
    }
}
