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
    /// Hand out a layer's guard (its index-K and KV views) without waiting for the layer's
    /// ready token (the historical bug: the index-K read path was not gated on the
    /// "load finished" signal). Caught by the landed-stamp check of the guard. The bytes of
    /// a page whose load has not landed are undefined: under this fault the guard fills
    /// them with a pattern first, rather than leave what the page held before (which may
    /// be the same bytes by chance), so an early read is always a wrong read.
    SkipIndexWait,
    /// Address the host side of index-K copies with the KV page size (one item size for
    /// both buffer kinds: the historical io-copy bug). Caught by the load checksums.
    SharedItemSize,
    /// Accept writes into pages whose generation changed (stale transfers after abort).
    /// Caught by the landed-stamp check of the reader's guard.
    NoGenerationCheck,
    /// The read guard skips its landed-stamp and written-slot checks (the checks behind
    /// the fences), and stores no longer refuse gaps. Alone it changes nothing; with
    /// `skip-index-wait`, `no-generation-check`, `index-k-after-publish` or
    /// `radix-overreach` it lets their corruption through, which shows that each check is
    /// real.
    NoLandedCheck,
    /// Flip one bit of every page backed up to the host tier (last layer, index-K), after
    /// its checksums were taken: host memory corruption. Caught by the load checksums.
    HostBitFlip,
    /// The io worker's host copies skip the layout-descriptor comparison: each host page
    /// is addressed with the host layout's page size but moved with the device layout's
    /// bytes (one item size for both sides, as the historical code did). Harmless while
    /// both sides share a descriptor; with `host-pool-fp8-layout` the device-sized pages
    /// overlap their neighbours in the host tier. Caught by the load checksums.
    NoLayoutCheck,
    /// Each layer of a host load starts only after a step reached that layer since the
    /// load was queued — took its guard, or began waiting for its ready token — (bounded
    /// by the cache's wait bound): with `skip-index-wait` the reader holds the layer
    /// before its bytes land every time, instead of by chance. Without it the reader
    /// waits at the fence as always, so this only orders loads after their readers.
    LoadsTrailReaders,
    /// A writer that outlives its request: the rows a request stored into a page it then
    /// released are written again, late, through their old references, right after a
    /// later owner of that page stores the same slot. Refused by the generation check
    /// (`stale_writes_refused`); with `no-generation-check` it lands and the new owner's
    /// landed stamps catch it.
    LateWrite,
    /// A host → device load that stamps and publishes each layer once its KV landed and
    /// copies the layer's index-K only afterwards — after a reader reached the layer
    /// (bounded by the cache's wait bound); the index-K bytes meanwhile are undefined (a
    /// fixed pattern). The story's read-before-ready, for index-K behind a published
    /// fence. Caught by the per-kind landed stamps of the reader's guard (which then waits
    /// for the late copy); with `no-landed-check` the reader reads the pattern.
    IndexKAfterPublish,
    /// The radix match reports one token more than it matched (when it matched at least
    /// one page and the key goes on): the request believes the first slot of its first
    /// own page is cached, though nobody wrote it. Caught by the written-slot tracking:
    /// the request's first store would leave that slot a gap, and a read of it is refused.
    RadixOverreach,
    /// The cache io worker panics once outside a job's own containment (as a bug in its
    /// bookkeeping would): its pending work fails with a typed error, and the worker goes
    /// on — later loads, backups and evictions work.
    WorkerDies,
    /// Backups copy every pool of a page but its index keys (the host tier of SGLang
    /// 17085: "the model will use empty index_k"); the host copy's index-K is whatever
    /// that host page held. Caught by the load checksums (taken of every pool the layer
    /// holds, whatever was copied) and, independently, by the host copy's record of the
    /// pools it copied (a load refuses a copy lacking one); `no-landed-check` turns the
    /// second off.
    HostTierSkipsIndexK,
    /// Host-tier loads restore the KV pools (window, compressed) and leave index-K as the
    /// device page held it (Mooncake 2236: a storage hit restored the MLA KV only). Caught
    /// by the load checksums (every pool verified after the copies) and, independently,
    /// by the per-kind landed stamps (index-K never landed for the page's generation).
    ReloadKvOnly,
    /// The host tier sizes the compressed pools (CSA and HCA KV) with the window pool's
    /// page size, so their host pages have the wrong descriptor and stride. Refused by
    /// the layout-descriptor comparison of every host copy; with `no-layout-check` the
    /// copies land at the wrong offsets and the load checksums catch them.
    PoolPageSizeMismatch,
    /// Backups leave out the compressor's state pool (DeepSeek-V4): a prefix reused from
    /// the host tier that ends inside a compression window resumes it from whatever the
    /// host page held. Caught by the host copy's record of the pools it holds and,
    /// with that off (`no-landed-check`), by the load checksums of every pool.
    CompressorStateLost,
}

impl Fault {
    pub const ALL: [Fault; 16] = [
        Fault::HostPoolFp8Layout,
        Fault::SkipIndexWait,
        Fault::SharedItemSize,
        Fault::NoGenerationCheck,
        Fault::NoLandedCheck,
        Fault::HostBitFlip,
        Fault::NoLayoutCheck,
        Fault::LoadsTrailReaders,
        Fault::LateWrite,
        Fault::IndexKAfterPublish,
        Fault::RadixOverreach,
        Fault::WorkerDies,
        Fault::HostTierSkipsIndexK,
        Fault::ReloadKvOnly,
        Fault::PoolPageSizeMismatch,
        Fault::CompressorStateLost,
    ];

    /// The fault's name on the command line and in configs.
    pub fn name(&self) -> &'static str {
        match self {
            Fault::HostPoolFp8Layout => "host-pool-fp8-layout",
            Fault::SkipIndexWait => "skip-index-wait",
            Fault::SharedItemSize => "shared-item-size",
            Fault::NoGenerationCheck => "no-generation-check",
            Fault::NoLandedCheck => "no-landed-check",
            Fault::HostBitFlip => "host-bit-flip",
            Fault::NoLayoutCheck => "no-layout-check",
            Fault::LoadsTrailReaders => "loads-trail-readers",
            Fault::LateWrite => "late-write",
            Fault::IndexKAfterPublish => "index-k-after-publish",
            Fault::RadixOverreach => "radix-overreach",
            Fault::WorkerDies => "worker-dies",
            Fault::HostTierSkipsIndexK => "host-tier-skips-index-k",
            Fault::ReloadKvOnly => "reload-kv-only",
            Fault::PoolPageSizeMismatch => "pool-page-size-mismatch",
            Fault::CompressorStateLost => "compressor-state-lost",
        }
    }
}

impl FromStr for Fault {
    type Err = Error;
    fn from_str(s: &str) -> Result<Fault> {
        Fault::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| Error::InvalidArgument {
                what: "fault",
                detail: format!(
                    "unknown fault {s:?} (known: {})",
                    Fault::ALL.map(|f| f.name()).join(", ")
                ),
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
    /// Adds `f`.
    pub fn insert(&mut self, f: Fault) {
        self.0.insert(f);
    }
    /// Whether no fault is injected.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// The injected faults, in [`Fault::ALL`] order.
    pub fn list(&self) -> Vec<Fault> {
        Fault::ALL.into_iter().filter(|f| self.active(*f)).collect()
    }
}
