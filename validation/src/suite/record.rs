//! The records of a suite run: what each check found, and how a check's comparisons
//! become records.

use serde::Serialize;
use sparsekit_host::ops::Op;
use sparsekit_host::Error;

use super::plan::Case;
use crate::tolerance::{DataType, ErrorStats, Quantity, Tolerance};

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
    pub op: Op,
    pub backend: String,
    pub check: Check,
    pub config: String,
    pub dtype: DataType,
    pub quantity: Quantity,
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

/// The result of one comparison inside a check.
pub(crate) struct Outcome {
    pub quantity: Quantity,
    pub stats: ErrorStats,
    pub tolerance: String,
    pub note: String,
}

impl Outcome {
    pub(crate) fn new(quantity: Quantity, stats: ErrorStats, t: &Tolerance) -> Self {
        Outcome {
            quantity,
            stats,
            tolerance: t.describe(),
            note: String::new(),
        }
    }
}

/// The records of one case: one per outcome, or one `error` record when the backend
/// returned an error.
pub(super) fn records(
    case: &Case,
    backend: &str,
    seed: u64,
    millis: u64,
    result: Result<Vec<Outcome>, Error>,
) -> Vec<Record> {
    let base = |quantity: Quantity| Record {
        op: case.op,
        backend: backend.to_string(),
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
        millis,
        detail: String::new(),
    };
    match result {
        Err(e) => {
            let mut rec = base(Quantity::None);
            rec.status = Status::Error;
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
                rec.detail = match stats.first_failure {
                    Some((i, got, want)) => format!(
                        "{} of {} elements out of tolerance; first at {i}: got {got}, want {want}; {}rerun with --seed {seed}",
                        stats.failures, stats.count, o.note
                    ),
                    None => o.note,
                };
                rec
            })
            .collect(),
    }
}
