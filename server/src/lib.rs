//! sparsekit serving shell: the synthetic DSA engine (batch-invariant and deterministic
//! on every backend), the continuous-batching scheduler, the HTTP server and the integrity
//! harness's pieces.
//!
//! Everything is generic over the backend (`B: Backend + ModelOps`): the CLI injects
//! `cpu`, `emu` or `cuda` as a value.

pub mod engine;
pub mod error;
pub mod harness;
pub mod http;
pub mod metrics;
pub mod pd;
pub mod transfer;

pub use error::EngineError;
