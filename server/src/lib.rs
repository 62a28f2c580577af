//! sparsekit serving shell: the synthetic DSA engine (batch-invariant and deterministic
//! on every backend), the continuous-batching scheduler, the HTTP server and the integrity
//! harness's pieces.
//!
//! Everything is generic over the backend (`B: Backend + ModelOps`): the CLI injects
//! `cpu`, `emu` or `cuda` as a value.

pub mod dsml;
pub mod engine;
pub mod error;
pub mod harness;
pub mod http;
pub mod metrics;
pub mod pd;
pub mod transfer;

pub use error::EngineError;

/// `now + d` as a deadline; where that overflows (a caller's huge bound), a year from now,
/// or now where even that does: a caller's bound never panics.
pub(crate) fn deadline_after(d: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(std::time::Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}
