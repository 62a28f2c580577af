//! sparsekit: DeepSeek Sparse Attention kernels (lightning indexer, exact top-k, sparse
//! MLA attention, index-K and KV stores, page copies and checksums) with a validation
//! suite.
//!
//! The root package holds the CLI, the embedded PTX ([`ptx`]) with its resource report
//! ([`kernel_report`]), and the CUDA backend; the kernels, host backends and validation
//! live in the workspace crates re-exported here.

pub mod cuda;
mod cuda_model_ops;
pub mod kernel_report;
pub mod perf_model;
pub mod ptx;
pub mod ptxas;
pub mod table;

pub use sparsekit_host as host;
pub use sparsekit_kernels as kernels;
pub use sparsekit_validation as validation;
