//! Transports: how the two ends of a prefill/decode pair exchange protocol frames and how
//! prefill's page bytes reach decode's landing zone.
//!
//! A [`Transport`] is one end of one connection. It moves opaque frames (the PD protocol,
//! [`crate::pd::wire`], is decoded and checked by the endpoints, identically for every
//! transport) and performs one-sided writes of page bytes into the peer's landing zone,
//! each optionally followed by a notification frame that is delivered only after the bytes
//! landed. Implementations:
//!
//! - [`local`]: in-process (the default for `--role both` and the harness): channels and a
//!   shared landing zone.
//! - [`nixl`]: NIXL agents over UCX in two processes; frames over a TCP control
//!   connection, notifications attached to the NIXL writes. Always built: the NIXL runtime
//!   is opened at run time, and its absence is a typed error.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::pd::landing::LandingZone;
use crate::pd::wire::Hello;

pub mod local;
pub mod nixl;

/// Errors of a transport.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransferError {
    /// The connection is gone (closed by either side, or the peer died). Nothing more
    /// can be sent or land through it.
    #[error("connection closed: {0}")]
    Closed(String),
    /// A write outside the peer's landing zone.
    #[error("write of {len} bytes at {offset} is outside the {zone}-byte landing zone")]
    OutOfBounds {
        offset: usize,
        len: usize,
        zone: usize,
    },
    /// The operation does not exist on this end (decode does not write).
    #[error("{0}")]
    Unsupported(&'static str),
    /// A bounded wait ran out.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The transport's runtime is not available on this machine.
    #[error("{0}")]
    Unavailable(String),
    /// Any other failure of the underlying transport.
    #[error("{0}")]
    Failed(String),
}

/// Bytes to write at `offset` of the peer's landing zone.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    pub offset: usize,
    pub bytes: &'a [u8],
}

/// One end of a PD connection (see the module docs). Every call is bounded in time.
pub trait Transport: Send + Sync + Debug {
    /// Short name (`local`, `nixl`).
    fn name(&self) -> &'static str;

    /// The peer's handshake, as received when the connection opened.
    fn peer(&self) -> &Hello;

    /// Sends one frame to the peer (ordered with this end's other `send`s).
    fn send(&self, frame: &[u8]) -> Result<(), TransferError>;

    /// The next frame from the peer (frames sent with `send` and write notifications),
    /// waiting at most `timeout`: `Ok(None)` when none came. `Err(Closed)` once the
    /// connection is gone and nothing is left to read.
    fn recv(&self, timeout: Duration) -> Result<Option<Vec<u8>>, TransferError>;

    /// Writes `segments` into the peer's landing zone and returns once every byte landed
    /// (or the write failed); then, if given, delivers `notification` to the peer. Only
    /// the prefill end writes.
    fn write(
        &self,
        segments: &[Segment<'_>],
        notification: Option<&[u8]>,
    ) -> Result<(), TransferError>;

    /// The landing zone peers write into (the decode end's; `None` on a prefill end).
    fn landing(&self) -> Option<Arc<LandingZone>>;

    /// Tears the connection down: both ends' `recv` report `Closed` once drained, writes
    /// and sends fail from now on.
    fn close(&self, why: &str);

    /// Whether the connection is gone.
    fn is_closed(&self) -> bool;

    /// How long after the connection closed a write the peer posted before may still
    /// land in the landing zone (a one-sided remote write in flight). Pages a torn-down
    /// transfer targeted stay quarantined that long. Zero where a write has landed when
    /// `write` returns (in-process).
    fn late_write_bound(&self) -> Duration {
        Duration::ZERO
    }
}

/// The default bound of a transport's blocking operations (a write to a dead peer, a
/// send into a full socket).
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The environment variable naming the directory with the NIXL runtime libraries
/// (`<site>/.nixl_cu12.mesonpy.libs` of the `nixl-cu12` wheel).
pub const NIXL_LIB_ENV: &str = "SPARSEKIT_NIXL_LIB";

/// Where the NIXL runtime (`libnixl_capi.so`) is: `$SPARSEKIT_NIXL_LIB`, else
/// `.tools/nixl/.nixl_cu12.mesonpy.libs` (what `scripts/setup-nixl.sh` installs) under the
/// working directory or any directory above `near` (e.g. the running binary). A process
/// that uses NIXL needs this directory on its `LD_LIBRARY_PATH` when it starts.
pub fn nixl_runtime_dir(near: Option<&std::path::Path>) -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let has = |d: &PathBuf| d.join("libnixl_capi.so").is_file();
    if let Some(d) = std::env::var_os(NIXL_LIB_ENV).map(PathBuf::from) {
        return has(&d).then_some(d);
    }
    let rel = std::path::Path::new(".tools/nixl/.nixl_cu12.mesonpy.libs");
    let mut roots: Vec<PathBuf> = std::env::current_dir().into_iter().collect();
    if let Some(p) = near {
        roots.extend(p.ancestors().map(PathBuf::from));
    }
    roots.into_iter().map(|r| r.join(rel)).find(has)
}
