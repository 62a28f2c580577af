//! Typed errors of the PD endpoints.

use thiserror::Error;

use crate::error::EngineError;
use crate::pd::wire::WireError;
use crate::transfer::TransferError;

/// Errors of a PD endpoint ([`crate::pd::Receiver`], [`crate::pd::Sender`]).
#[derive(Clone, Debug, Error, PartialEq)]
#[non_exhaustive]
pub enum PdError {
    /// A frame that could not be encoded or decoded.
    #[error("wire: {0}")]
    Wire(#[from] WireError),
    /// The transport failed or the connection is gone.
    #[error("transport: {0}")]
    Transfer(#[from] TransferError),
    /// The cache refused an operation (stale page, checksum mismatch, out of pages…).
    #[error("cache: {0}")]
    Cache(#[from] sparsekit_host::Error),
    /// The peer's layouts, geometry or role do not match ours: refused, never adapted.
    #[error("incompatible peer: {0}")]
    Incompatible(String),
    /// A request that already has a transfer.
    #[error("request {0} already has a transfer in flight")]
    Duplicate(u64),
    /// A request this endpoint has no transfer for.
    #[error("no transfer for request {0}")]
    UnknownRequest(u64),
    /// The transfer was cancelled (by either side) before it finished.
    #[error("request {req}: transfer cancelled: {reason}")]
    Cancelled { req: u64, reason: String },
    /// The transfer failed (refused data, the peer gave up, the connection dropped).
    #[error("request {req}: transfer failed: {reason}")]
    Failed { req: u64, reason: String },
    /// A call that does not fit the transfer's state or arguments.
    #[error("invalid: {0}")]
    Invalid(String),
    /// A bounded wait ran out.
    #[error("timed out: {0}")]
    Timeout(String),
}

/// The engine's error for a PD failure: a timeout stays a timeout, a transport failure
/// (the peer is away) is `Unavailable`, anything else fails the request's step.
pub(crate) fn pd_error(e: PdError) -> EngineError {
    match e {
        PdError::Timeout(m) => EngineError::Timeout(m),
        PdError::Transfer(e) => EngineError::Unavailable(format!("PD peer: {e}")),
        e => EngineError::StepFailed(format!("PD transfer: {e}")),
    }
}
