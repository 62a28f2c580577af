//! Named fault injections. Compiled in, off unless configured; each reproduces a
//! historical bug so that a test can show the check that catches it.

use std::collections::HashSet;
use std::str::FromStr;

use crate::error::{Error, Result};

/// One injectable fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Size the host index-K rows with the fp8 layout whatever the dtype (the original
    /// bug: 132 B host rows under 256 B device rows).
    HostPoolFp8Layout,
    /// Hand out a layer's index-K view without waiting for its ready token.
    SkipIndexWait,
    /// Copy both sides of a page transfer with the source's row geometry.
    SharedItemSize,
    /// Accept writes into pages whose generation changed (stale transfers after abort).
    NoGenerationCheck,
}

impl Fault {
    pub const ALL: [Fault; 4] = [
        Fault::HostPoolFp8Layout,
        Fault::SkipIndexWait,
        Fault::SharedItemSize,
        Fault::NoGenerationCheck,
    ];

    /// The fault's name on the command line and in configs.
    pub fn name(&self) -> &'static str {
        match self {
            Fault::HostPoolFp8Layout => "host-pool-fp8-layout",
            Fault::SkipIndexWait => "skip-index-wait",
            Fault::SharedItemSize => "shared-item-size",
            Fault::NoGenerationCheck => "no-generation-check",
        }
    }
}

impl FromStr for Fault {
    type Err = Error;
    fn from_str(s: &str) -> Result<Fault> {
        Fault::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                Error::invalid(
                    "fault",
                    format!(
                        "unknown fault {s:?} (known: {})",
                        Fault::ALL.map(|f| f.name()).join(", ")
                    ),
                )
            })
    }
}

/// The set of active faults (empty in production).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults(HashSet<Fault>);

impl Faults {
    /// No fault.
    pub fn none() -> Self {
        Faults::default()
    }
    /// Exactly these faults.
    pub fn with(faults: &[Fault]) -> Self {
        Faults(faults.iter().copied().collect())
    }
    /// Whether `f` is injected.
    pub fn active(&self, f: Fault) -> bool {
        self.0.contains(&f)
    }
}
