//! sparsekit: DeepSeek Sparse Attention kernels with validation.
pub use sparsekit_host as host;
pub use sparsekit_validation as validation;
