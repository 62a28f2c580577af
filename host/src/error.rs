//! The library's typed error. Every caller mistake maps to a variant; nothing panics on it.
//!
//! The variants fall in three groups, told apart by [`Error::kind`]:
//! - [`ErrorKind::Op`]: the call was invalid (a layout, a buffer size, a slot, a range,
//!   a parameter); it was rejected before anything was written;
//! - [`ErrorKind::Cache`]: the cache refused or lost something (out of pages, a stale page
//!   reference, an integrity or accounting failure, a cancelled load);
//! - [`ErrorKind::Device`]: the backend's device, driver or emulator failed, or a bounded
//!   wait ran out. [`Error::Backend`] keeps the underlying error as its
//!   [`source`](std::error::Error::source) (a cudarc `DriverError`, an emulator
//!   `EmuError`); [`Error::Device`] carries a message only.

use std::sync::Arc;

use thiserror::Error;

/// Result alias used across sparsekit.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The underlying error of an [`Error::Backend`] (shared, so [`Error`](enum@Error) stays
/// `Clone`).
pub type ErrorSource = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// Which group an [`Error`](enum@Error) belongs to (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// An invalid call, rejected before anything was written.
    Op,
    /// A cache refusal or failure.
    Cache,
    /// A device, driver or emulator failure, or a bounded wait that ran out.
    Device,
}

/// Where an entry sits in a host array: `[i]` of a list, or `[row][col]` of a row-major
/// table (page tables, per-token slot lists). Displays with its brackets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Index {
    /// Entry `i` of a list.
    Flat(usize),
    /// Row `row`, column `col` of a row-major table.
    Cell { row: usize, col: usize },
}

impl Index {
    /// Entry `flat` of a row-major table whose rows are `row_len` long.
    pub fn cell(flat: usize, row_len: usize) -> Index {
        match row_len {
            0 => Index::Flat(flat),
            n => Index::Cell {
                row: flat / n,
                col: flat % n,
            },
        }
    }
}

impl std::fmt::Display for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Index::Flat(i) => write!(f, "[{i}]"),
            Index::Cell { row, col } => write!(f, "[{row}][{col}]"),
        }
    }
}

impl From<usize> for Index {
    fn from(i: usize) -> Self {
        Index::Flat(i)
    }
}

/// Errors returned by layouts, backends, ops and the cache.
#[derive(Debug, Error, Clone)]
#[non_exhaustive]
pub enum Error {
    // ---- op validation ([`ErrorKind::Op`])
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
    #[error("{what}{index} = {slot} is out of range (cache holds {capacity} slots)")]
    SlotOutOfRange {
        what: &'static str,
        index: Index,
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
    #[error("{what}{index} = page {page} is out of range (pool holds {num_pages} pages)")]
    PageOutOfRange {
        what: &'static str,
        index: Index,
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
    // ---- cache ([`ErrorKind::Cache`])
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
    /// A page's bytes of one kind in a layer were not written for the reference's
    /// generation (never landed, or overwritten by a stale write): the landed-stamp check
    /// of a read guard, per buffer kind.
    #[error(
        "page {page} layer {layer} {kind}: not landed for generation {generation} (stamp {stamp:?})"
    )]
    NotLanded {
        page: u32,
        layer: usize,
        kind: &'static str,
        generation: u32,
        stamp: Option<u32>,
    },
    /// A token slot that was never written for the page's generation: a read past what a
    /// request's stores, loads and transfers filled, a store that would leave a gap, or a
    /// commit of a page not filled in every layer and kind.
    #[error(
        "page {page} layer {layer} {kind}: slot {slot} was never written (slots 0..{filled} were)"
    )]
    Unwritten {
        page: u32,
        layer: usize,
        kind: &'static str,
        slot: u32,
        filled: u32,
    },
    /// One request of a batch cannot be served (its load or transfer failed, it was
    /// aborted, ...): `cause` says why; drop the request from the batch and go on.
    #[error("request {request}: {cause}")]
    RequestFailed { request: u64, cause: Box<Error> },
    // ---- device ([`ErrorKind::Device`])
    /// A backend's device, driver or emulator failed; `source` is its own error.
    #[error("{backend} backend: {context}: {source}")]
    Backend {
        /// `cpu`, `emu` or `cuda`.
        backend: &'static str,
        /// What was being done (`launch of sparse_mla`, `upload`, …).
        context: String,
        #[source]
        source: ErrorSource,
    },
    /// A bounded wait ran out (the work it waited for did not complete in time).
    #[error("{what}: not complete after {after:?}")]
    Timeout {
        what: &'static str,
        after: std::time::Duration,
    },
    /// A device-side failure described by a message only (prefer [`Error::Backend`], which
    /// keeps the underlying error).
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

    /// A backend failure with its underlying error kept as the source.
    pub fn backend(
        backend: &'static str,
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Backend {
            backend,
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// Which group the error belongs to.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidLayout(_)
            | Error::BufferSize { .. }
            | Error::Shape { .. }
            | Error::InvalidArgument { .. }
            | Error::SlotOutOfRange { .. }
            | Error::DuplicateSlot { .. }
            | Error::DuplicatePage { .. }
            | Error::PageOutOfRange { .. }
            | Error::InvalidRange { .. }
            | Error::LayoutMismatch { .. } => ErrorKind::Op,
            Error::OutOfPages { .. }
            | Error::StalePage { .. }
            | Error::Integrity { .. }
            | Error::Leak(_)
            | Error::Cancelled(_)
            | Error::NotLanded { .. }
            | Error::Unwritten { .. }
            | Error::RequestFailed { .. } => ErrorKind::Cache,
            Error::Backend { .. } | Error::Timeout { .. } | Error::Device(_) => ErrorKind::Device,
        }
    }
}

/// Errors compare by kind and message (a source is compared by its message).
impl PartialEq for Error {
    fn eq(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
            && self.to_string() == other.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[derive(Debug)]
    struct DriverSaid;
    impl std::fmt::Display for DriverSaid {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("CUDA_ERROR_ILLEGAL_ADDRESS")
        }
    }
    impl std::error::Error for DriverSaid {}

    #[test]
    fn backend_errors_keep_their_source_and_kinds_separate() {
        let e = Error::backend("cuda", "launch of topk", DriverSaid);
        assert_eq!(e.kind(), ErrorKind::Device);
        let source = e.source().map(|s| s.to_string());
        assert_eq!(source.as_deref(), Some("CUDA_ERROR_ILLEGAL_ADDRESS"));
        assert!(e.to_string().contains("launch of topk"));
        assert_eq!(e.clone(), e);
        assert_eq!(
            Error::invalid("k", "must be positive").kind(),
            ErrorKind::Op
        );
        assert_eq!(Error::Leak("page 3".into()).kind(), ErrorKind::Cache);
        assert_ne!(Error::Leak("a".into()), Error::Cancelled("a".into()));
    }
}
