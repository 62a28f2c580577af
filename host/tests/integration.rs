//! The host crate's integration tests, one module per file beside this one, built as one
//! test binary (one binary per file linked the crate once per file).
//!
//! Run one file's tests with its module name as the filter, e.g.
//! `cargo test -p sparsekit-host --test integration cache_v4::`.
//!
//! The model-checked tests are binaries of their own (`cache_shuttle`, `claims_loom`,
//! `fence_loom`, `gate_loom`): each includes sources of this crate whose `crate::sync`
//! must resolve to that test's own loom or shuttle facade, at its crate root.
//!
//! Nothing here may rely on being alone in its process: no test sets environment
//! variables or process-wide state.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

mod common;

mod cache;
mod cache_blind_spots;
mod cache_misuse;
mod cache_model;
mod cache_props;
mod cache_v4;
mod ml_dtypes;
mod model_ops;
