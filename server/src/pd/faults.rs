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
//! | `model1-scales-as-interleaved` | prefill's copy of a partly filled last page takes a model1_fp8 page for token-interleaved: the rows move, the tile scales at the page's end do not | the per-page checksums (the sender's digest covers the page's real entries; decode's landed page holds its old scale bytes) | decode dequantises the prompt's last tokens with stale scales |
//! | `stale-transfer-write` | prefill confirms an aborted transfer as cancelled while its writes are still in flight; they land late, in pages decode already reused | generations (the late notification is stale) and the checksums of the reusing transfer (its landed bytes were overwritten) | the reusing request is served the aborted one's bytes |
//!
//! In a [`crate::pd::pair::PdPair`] the race of `stale-transfer-write` is made
//! deterministic by a [`StaleWriteBarrier`]: decode starts a decoy transfer before every
//! fourth request, aborts it exactly while prefill's writes are in flight, and allocates
//! the request's pages (the decoy's, just freed) only after every late write is held.
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
    /// Prefill's copy of a transfer's partly filled last page takes a model1_fp8 page for
    /// token-interleaved (a token's 576-byte row and its 8 scale bytes together): it moves
    /// the first `n · 584` bytes, so the rows land and the tile scales, kept at the page's
    /// end, do not. A no-op without model1_fp8 pools.
    Model1ScalesAsInterleaved,
}

impl PdFault {
    pub const ALL: [PdFault; 4] = [
        PdFault::Fp8Frame,
        PdFault::ReadBeforeLanded,
        PdFault::StaleTransferWrite,
        PdFault::Model1ScalesAsInterleaved,
    ];

    /// The fault's name on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            PdFault::Fp8Frame => "pd-fp8-frame",
            PdFault::ReadBeforeLanded => "pd-read-before-landed",
            PdFault::StaleTransferWrite => "stale-transfer-write",
            PdFault::Model1ScalesAsInterleaved => "model1-scales-as-interleaved",
        }
    }

    /// Cache faults the decode side's cache must be built with for this fault.
    pub fn cache_faults(&self) -> Vec<Fault> {
        match self {
            PdFault::ReadBeforeLanded => vec![Fault::SkipIndexWait],
            PdFault::Fp8Frame
            | PdFault::StaleTransferWrite
            | PdFault::Model1ScalesAsInterleaved => Vec::new(),
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

/// Where a decoy transfer of the `stale-transfer-write` injection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DecoyStage {
    /// Bootstrapped; prefill has not reached its first write.
    Expected,
    /// Prefill staged its first write and waits: its writes are in flight.
    InFlight,
    /// Decode aborted the transfer and prefill confirmed the cancel: the pages are free.
    Cancelled,
    /// Prefill went on writing after its confirmation: every late write is held.
    Held,
}

/// The rendezvous that makes `stale-transfer-write` deterministic in a PD pair: decode
/// starts a decoy transfer, prefill stops before its first write
/// ([`StaleWriteBarrier::writes_in_flight`]), decode aborts it in exactly that window,
/// prefill (with the fault) confirms the cancel and goes on writing; decode waits until
/// every late write is held ([`StaleWriteBarrier::wait_held`] for [`StaleWriteBarrier::all_held`])
/// before it allocates the next request's pages, which are the decoy's just-freed ones.
/// Every wait is bounded; a party that gives up leaves the other to time out.
#[derive(Debug, Default)]
pub struct StaleWriteBarrier {
    decoys: parking_lot::Mutex<std::collections::HashMap<u64, DecoyStage>>,
    changed: parking_lot::Condvar,
}

impl StaleWriteBarrier {
    pub fn new() -> Self {
        Self::default()
    }

    fn set(&self, req: u64, stage: DecoyStage) {
        let mut d = self.decoys.lock();
        if let Some(s) = d.get_mut(&req) {
            *s = stage;
            self.changed.notify_all();
        }
    }

    /// Waits (at most `timeout`) until `req`'s decoy reached `stage`.
    fn wait_for(&self, req: u64, stage: DecoyStage, timeout: std::time::Duration) -> bool {
        let deadline = crate::deadline_after(timeout);
        let mut d = self.decoys.lock();
        loop {
            match d.get(&req) {
                Some(&s) if s == stage => return true,
                None => return false,
                Some(_) => {}
            }
            if self.changed.wait_until(&mut d, deadline).timed_out() {
                return false;
            }
        }
    }

    /// Decode: `req` is a decoy (before its bootstrap is sent).
    pub fn expect(&self, req: u64) {
        self.decoys.lock().insert(req, DecoyStage::Expected);
    }

    /// Decode: waits (bounded) until prefill's writes of decoy `req` are in flight.
    pub fn wait_in_flight(&self, req: u64, timeout: std::time::Duration) -> bool {
        self.wait_for(req, DecoyStage::InFlight, timeout)
    }

    /// Decode: prefill confirmed the cancel of decoy `req` (its pages are free again).
    pub fn cancelled(&self, req: u64) {
        self.set(req, DecoyStage::Cancelled);
    }

    /// Decode: waits (bounded) until every late write of decoy `req` is held.
    pub fn wait_held(&self, req: u64, timeout: std::time::Duration) -> bool {
        self.wait_for(req, DecoyStage::Held, timeout)
    }

    /// Decode: `req` is done with (a prefill write still waiting gives up at once).
    pub fn forget(&self, req: u64) {
        self.decoys.lock().remove(&req);
        self.changed.notify_all();
    }

    /// Prefill, before a write of `req`: for a decoy's first write, says the writes are in
    /// flight and waits (bounded) until decode aborted and prefill confirmed. Returns
    /// whether `req` is a decoy.
    pub fn writes_in_flight(&self, req: u64, timeout: std::time::Duration) -> bool {
        let first = {
            let mut d = self.decoys.lock();
            match d.get_mut(&req) {
                None => return false,
                Some(s) if *s == DecoyStage::Expected => {
                    *s = DecoyStage::InFlight;
                    self.changed.notify_all();
                    true
                }
                Some(_) => false,
            }
        };
        if first {
            self.wait_for(req, DecoyStage::Cancelled, timeout);
        }
        true
    }

    /// Prefill: every layer of decoy `req` was written (held late).
    pub fn all_held(&self, req: u64) {
        self.set(req, DecoyStage::Held);
    }
}
