//! PD fault injections and the receiver's checks they are measured against.
//!
//! Each fault re-creates a historical PD bug. Every check has an independent second
//! check behind it, so with [`Checks::all`] each fault is caught (refused, counted) by the
//! check it did not disable, and with [`Checks::none`] (`--no-verify`) it corrupts what
//! decode serves:
//!
//! | fault | the bug | caught by (checks on) | with `--no-verify` |
//! |---|---|---|---|
//! | `pd-fp8-frame` | prefill sizes index-K pages with the fp8 layout (132 B/token) whatever the dtype | the frame's layout fingerprint; behind it the per-page checksums of what landed | bf16 index-K pages land misplaced and are served |
//! | `pd-read-before-landed` | decode reads a layer before its notification was verified (the step skips the transfer's ready token) | the guard's landed stamps (a page is stamped only after its bytes were verified) | the step reads bytes that were never sent |
//! | `stale-transfer-write` | prefill confirms an aborted transfer as cancelled while its writes are still in flight; they land late, in pages decode already reused | generations (the late notification is stale) and the checksums of the reusing transfer (its landed bytes were overwritten) | the reusing request is served the aborted one's bytes |
//!
//! `pd-read-before-landed` lives in the decode cache: it maps to the cache fault
//! `skip-index-wait` ([`PdFault::cache_faults`]); `--no-verify` adds `no-landed-check`.

use std::collections::HashSet;
use std::str::FromStr;

use sparsekit_host::cache::Fault;

use crate::pd::error::PdError;

/// One injectable PD fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PdFault {
    /// Prefill frames index-K pages with the fp8 layout (page size, stride and the frame's
    /// fingerprint) whatever the real dtype. A no-op where index-K is fp8.
    Fp8Frame,
    /// Decode reads a layer without waiting for its transfer's ready token.
    ReadBeforeLanded,
    /// Prefill answers an ABORT with `Cancelled` at once but keeps the transfer's writes
    /// going; they are delivered late, right after the next write of another request to
    /// the same destination pages (the race, made deterministic).
    StaleTransferWrite,
}

impl PdFault {
    pub const ALL: [PdFault; 3] = [
        PdFault::Fp8Frame,
        PdFault::ReadBeforeLanded,
        PdFault::StaleTransferWrite,
    ];

    /// The fault's name on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            PdFault::Fp8Frame => "pd-fp8-frame",
            PdFault::ReadBeforeLanded => "pd-read-before-landed",
            PdFault::StaleTransferWrite => "stale-transfer-write",
        }
    }

    /// Cache faults the decode side's cache must be built with for this fault.
    pub fn cache_faults(&self) -> Vec<Fault> {
        match self {
            PdFault::ReadBeforeLanded => vec![Fault::SkipIndexWait],
            PdFault::Fp8Frame | PdFault::StaleTransferWrite => Vec::new(),
        }
    }
}

impl FromStr for PdFault {
    type Err = PdError;
    fn from_str(s: &str) -> Result<Self, PdError> {
        PdFault::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                PdError::Invalid(format!(
                    "unknown PD fault {s:?} (known: {})",
                    PdFault::ALL.map(|f| f.name()).join(", ")
                ))
            })
    }
}

/// The set of active PD faults (empty in production).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PdFaults(HashSet<PdFault>);

impl PdFaults {
    pub fn none() -> Self {
        Self::default()
    }
    pub fn with(faults: &[PdFault]) -> Self {
        PdFaults(faults.iter().copied().collect())
    }
    pub fn active(&self, f: PdFault) -> bool {
        self.0.contains(&f)
    }
}

/// The decode receiver's checks of what prefill sent. Generations are always checked by
/// the cache (`Inbound::write`) unless the decode cache was built with the
/// `no-generation-check` fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checks {
    /// Each write notification's layout fingerprint must equal ours for its kind.
    pub fingerprints: bool,
    /// The landed bytes' checksums must equal the sender's.
    pub checksums: bool,
}

impl Checks {
    /// Every check on (the default).
    pub fn all() -> Self {
        Checks {
            fingerprints: true,
            checksums: true,
        }
    }
    /// Every check off (`--no-verify`): whatever lands is published.
    pub fn none() -> Self {
        Checks {
            fingerprints: false,
            checksums: false,
        }
    }
}

impl Default for Checks {
    fn default() -> Self {
        Self::all()
    }
}
