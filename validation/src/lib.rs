//! sparsekit validation: naive f64 references that read the packed cache bytes, the
//! tolerance table, random ragged fixtures, and the suite that runs every op on any
//! [`sparsekit_host::Backend`] (one body per check, every backend).

pub mod conformance;
pub mod fixtures;
pub mod golden;
mod invariance;
pub mod reference;
pub mod suite;
pub mod tolerance;

pub use suite::{plan, run, run_case, Check, Record, Size, Status, SuiteConfig};

#[doc(hidden)]
pub use sparsekit_host::{Backend as __Backend, Result as __Result};
