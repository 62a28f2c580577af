//! sparsekit: DeepSeek Sparse Attention kernels (lightning indexer, exact top-k, sparse
//! MLA attention, index-K and KV stores, page copies and checksums) with a validation
//! suite.
//!
//! The root package holds the CLI, the embedded PTX ([`ptx`]) with its resource report
//! ([`kernel_report`]), and the CUDA backend; the kernels, host backends and validation
//! live in the workspace crates re-exported here. Without the default `cli` feature the
//! library is the CUDA backend, the PTX and its reports alone (what the Python extension
//! links).

pub mod cuda;
mod cuda_model_ops;
pub mod kernel_report;
pub mod perf_model;
pub mod ptx;
pub mod ptxas;
pub mod table;

pub use sparsekit_host as host;
pub use sparsekit_kernels as kernels;
/// The validation suite (with the `cli` feature, on by default).
#[cfg(feature = "cli")]
pub use sparsekit_validation as validation;
