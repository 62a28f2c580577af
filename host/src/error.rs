//! The library's typed error. Every caller mistake maps to a variant; nothing panics on it.

use thiserror::Error;

/// Result alias used across sparsekit.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors returned by layouts, backends and ops.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A layout descriptor was constructed with impossible parameters.
    #[error("invalid layout: {0}")]
    InvalidLayout(String),
    /// A buffer holds the wrong number of bytes for the shape and layout it is used with.
    #[error("{what}: expected {expected} bytes, got {actual}")]
    BufferSize {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A host array (metadata or tensor) has the wrong number of elements.
    #[error("{what}: expected {expected} elements, got {actual}")]
    Shape {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// An op parameter is outside what the op supports.
    #[error("invalid argument {what}: {detail}")]
    InvalidArgument { what: &'static str, detail: String },
    /// A token slot is neither `-1` nor inside the cache.
    #[error("{what}[{index}] = {slot} is out of range (cache holds {capacity} slots)")]
    SlotOutOfRange {
        what: &'static str,
        index: usize,
        slot: i64,
        capacity: usize,
    },
    /// Two tokens of one store target the same slot.
    #[error("{what}: slot {slot} is written by tokens {first} and {second}")]
    DuplicateSlot {
        what: &'static str,
        slot: i64,
        first: usize,
        second: usize,
    },
    /// Two copies of one call write the same destination page.
    #[error("{what}: destination page {page} is written by entries {first} and {second}")]
    DuplicatePage {
        what: &'static str,
        page: i64,
        first: usize,
        second: usize,
    },
    /// A page id is outside the pool.
    #[error("{what}[{index}] = page {page} is out of range (pool holds {num_pages} pages)")]
    PageOutOfRange {
        what: &'static str,
        index: usize,
        page: i64,
        num_pages: usize,
    },
    /// A query's key range does not fit its request or the output row.
    #[error("row {row}: key range [{start}, {end}) is invalid ({reason})")]
    InvalidRange {
        row: usize,
        start: i64,
        end: i64,
        reason: String,
    },
    /// Two layout descriptors that must agree do not (fingerprints shown).
    #[error(
        "layout mismatch for {what}: expected fingerprint {expected:#018x}, got {actual:#018x}"
    )]
    LayoutMismatch {
        what: &'static str,
        expected: u64,
        actual: u64,
    },
    /// A pool has too few free pages.
    #[error("{what} pool: {wanted} pages wanted, {free} free")]
    OutOfPages {
        what: &'static str,
        wanted: usize,
        free: usize,
    },
    /// A page reference is stale: the page was freed (and perhaps reused) since.
    #[error("{what} pool: page {page} generation {generation} is stale (current {current:?})")]
    StalePage {
        what: &'static str,
        page: u32,
        generation: u32,
        current: Option<u32>,
    },
    /// A cached page's bytes changed between backup and load.
    #[error("integrity: {what} page {page} layer {layer} {kind}: checksum {actual:#018x}, recorded {expected:#018x}")]
    Integrity {
        what: &'static str,
        page: u32,
        layer: usize,
        kind: &'static str,
        expected: u64,
        actual: u64,
    },
    /// Page accounting found pages lost or held twice.
    #[error("page leak: {0}")]
    Leak(String),
    /// A cache operation was cancelled (request aborted, worker stopped).
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// A bounded wait ran out (the work it waited for did not complete in time).
    #[error("{what}: not complete after {after:?}")]
    Timeout {
        what: &'static str,
        after: std::time::Duration,
    },
    /// The device or its driver reported a failure.
    #[error("device error: {0}")]
    Device(String),
}

impl Error {
    pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> Self {
        Error::InvalidArgument {
            what,
            detail: detail.into(),
        }
    }
}
