//! Typed errors of the engine (and what the HTTP layer maps to status codes).

use thiserror::Error;

/// Errors of the engine, its scheduler and its KV space.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum EngineError {
    /// A backend op rejected a call or the device failed.
    #[error("backend: {0}")]
    Backend(#[from] sparsekit_host::Error),
    /// No model config of that name.
    #[error("unknown model {0:?} (available: tiny, dsv32)")]
    UnknownModel(String),
    /// A model config whose shapes do not fit together.
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// A request the engine cannot serve as asked (bad sampling parameter, token id
    /// outside the vocabulary, empty prompt…).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Prompt plus requested tokens exceed the model's context.
    #[error(
        "this model's maximum context length is {limit} tokens; the request needs {needed} \
         ({prompt} in the prompt + {max_new} to generate)"
    )]
    ContextLength {
        prompt: usize,
        max_new: usize,
        needed: usize,
        limit: usize,
    },
    /// The KV space cannot hold a request even when empty.
    #[error("request needs {wanted} KV pages but the space holds only {capacity}")]
    TooLarge { wanted: usize, capacity: usize },
    /// The KV space has too few free pages right now.
    #[error("out of KV pages: {wanted} wanted, {free} free")]
    OutOfPages { wanted: usize, free: usize },
    /// A sequence id the KV space does not know.
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    /// The request was aborted (by the client, `/abort_request`, or shutdown).
    #[error("request aborted: {0}")]
    Aborted(String),
    /// The step this request was part of failed (a backend error or a panic).
    #[error("engine step failed: {0}")]
    StepFailed(String),
    /// The engine is not accepting requests (shut down or its thread died).
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// The engine's queue is full.
    #[error("engine overloaded: {0}")]
    Overloaded(String),
    /// A request id already in flight.
    #[error("duplicate request id {0:?}")]
    DuplicateId(String),
    /// One sequence of a step failed in the KV cache (its load or transfer failed or timed
    /// out, or a page it was about to read had not landed): that request alone fails.
    #[error("request failed in the KV cache: {cause}")]
    SeqFailed {
        seq: u64,
        cause: sparsekit_host::Error,
    },
    /// A bounded wait ran out.
    #[error("timed out: {0}")]
    Timeout(String),
}
