//! sparsekit validation: naive f64 references that read the packed cache bytes, the
//! tolerance table, random ragged fixtures, the suite that runs every op on any
//! [`sparsekit_host::Backend`] (one body per check, every backend), the conformance suite
//! that every backend instantiates with [`test_backend!`](crate::test_backend), and golden
//! files.
//!
//! - [`reference`](mod@reference): f64 references of every op;
//! - [`fixtures`]: random ragged batches, paged pools, poison, generators of every case;
//! - [`tolerance`]: the tolerance table (by op, quantity and dtype) and the judges;
//! - [`suite`]: the plan, the per-op cases, the batch-invariance checks and the records;
//! - [`conformance`]: the checks every backend must pass, and
//!   [`test_backend!`](crate::test_backend);
//! - [`golden`]: golden files (a user's own tensors) checked on any backend.

pub mod audit;
pub mod conformance;
pub mod fixtures;
pub mod golden;
pub mod reference;
pub mod suite;
pub mod tolerance;

pub use suite::{plan, run, run_case, Check, Record, Size, Status, SuiteConfig};

#[doc(hidden)]
pub use sparsekit_host::{Backend as __Backend, Result as __Result};
