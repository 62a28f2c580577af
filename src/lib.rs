//! sparsekit: DeepSeek Sparse Attention kernels (lightning indexer, exact top-k, sparse
//! MLA attention, index-K and KV stores) with a validation suite.
//!
//! The root package holds the CLI and (later) the CUDA backend with the embedded PTX; the
//! kernels, host backends and validation live in the workspace crates re-exported here.

pub mod table;

pub use sparsekit_host as host;
pub use sparsekit_validation as validation;
