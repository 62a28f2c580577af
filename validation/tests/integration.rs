//! The validation crate's integration tests, one module per file beside this one, built as
//! one test binary (one binary per file linked the crate and its dependencies once per
//! file): the conformance suite's cpu instances (`cpu_suite`, once per vector path) and
//! emu instances (`emu_suite`), the golden files, hostile calls of every op, and the
//! suite's own fault detection.
//!
//! Run one file's tests with its module name as the filter, e.g.
//! `cargo test -p sparsekit-validation --test integration cpu_suite::cpu_avx2::`.
//!
//! Nothing here may rely on being alone in its process: no test sets environment
//! variables or process-wide state.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

mod cpu_suite;
mod emu_suite;
mod golden;
mod hostile_ops;
mod suite_detects_faults;
