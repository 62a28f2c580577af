//! Prefill/decode disaggregation (`SERVING.md`, "Prefill/decode disaggregation").
//!
//! Decode allocates a request's prompt pages in its cache and sends prefill a bootstrap
//! (request, prompt, destination pages with their generations, layout fingerprints of KV
//! and index-K). Prefill checks the fingerprints (a mismatch is refused, never adapted),
//! serves the prompt from its cache or computes it, and pushes each layer's pages of both
//! kinds into decode's landing zone, each followed by a notification (request, layer,
//! kind, fingerprint, pages, per-page checksums). Decode verifies fingerprint, request,
//! generations and the checksums of the bytes that landed before it publishes the layer;
//! the destination pages stay quarantined until prefill confirms the end. Aborts go both
//! ways; every malformed or unexpected message is counted, logged and dropped.
//!
//! - [`wire`]: the versioned, checksummed frame format and the messages.
//! - [`receiver`]: the decode endpoint, over `HiCache::inbound`.
//! - [`sender`]: the prefill endpoint, reading pages through the cache's layer guards.
//! - [`prefill`], [`decode`]: the two sides as nodes (an engine and its endpoint per
//!   connection), each usable alone (`serve --role prefill|decode`, two processes).
//! - [`pair`]: both nodes in one process over the local transport (`--role both`, the
//!   harness).
//! - [`remote`]: the nodes as two processes over NIXL (`--transport nixl`): prefill's
//!   listener, decode's connector, finding prefill from its URL.
//! - [`landing`]: decode's landing zone (what prefill writes into), from the layouts.
//! - [`faults`]: the PD fault injections and the receiver's checks.
//! - [`stage`], [`stats`], [`error`]: page staging, counters, errors.
//!
//! Transports (in-process, NIXL) are in [`crate::transfer`].

use std::sync::Arc;
use std::time::Duration;

use sparsekit_host::cache::CacheSpec;

pub mod decode;
pub mod error;
pub mod faults;
pub mod landing;
pub mod pair;
pub mod prefill;
pub mod receiver;
pub mod remote;
pub mod sender;
pub mod stage;
pub mod stats;
pub mod wire;

pub use error::PdError;
pub use faults::{Checks, PdFault, PdFaults};
pub use landing::{LandingGeometry, LandingZone};
pub use receiver::{Outcome, Receiver, ReceiverConfig};
pub use sender::{Job, Liveness, Sender, SenderConfig, StagedLayer};
pub use stats::{PdStats, PdStatsSnapshot};
pub use wire::{Arithmetic, Hello, Message, Role};

/// Ends a cache request when dropped, unless [`RequestGuard::keep`] handed it over: a
/// request a PD side began is never left live by an early return or a panic.
pub(crate) struct RequestGuard<'c, B: sparsekit_host::Backend + 'static> {
    cache: &'c sparsekit_host::cache::HiCache<B>,
    req: u64,
    armed: bool,
}

impl<'c, B: sparsekit_host::Backend + 'static> RequestGuard<'c, B> {
    pub(crate) fn new(cache: &'c sparsekit_host::cache::HiCache<B>, req: u64) -> Self {
        RequestGuard {
            cache,
            req,
            armed: true,
        }
    }

    /// The request is someone else's to end now.
    pub(crate) fn keep(mut self) {
        self.armed = false;
    }
}

impl<B: sparsekit_host::Backend + 'static> Drop for RequestGuard<'_, B> {
    fn drop(&mut self) {
        if self.armed && self.cache.is_live(self.req) {
            let _ = self.cache.abort(self.req);
        }
    }
}

/// Settings of a PD deployment, shared by both sides.
#[derive(Clone, Debug)]
pub struct PdOptions {
    /// Injected PD faults (none in production); each side applies the ones it owns.
    pub faults: PdFaults,
    /// The receiver's checks (all but for `--no-verify`).
    pub checks: Checks,
    /// Prefill threads serving jobs per connection (each waits on the prefill engine,
    /// which batches).
    pub workers: usize,
    /// Bound of one request's transfer (allocation included), and of a prefill job.
    pub timeout: Duration,
    /// Decode connections a prefill node serves at once (each costs a sender and
    /// `workers` threads); more are refused with a clear error.
    pub max_connections: usize,
}

impl Default for PdOptions {
    fn default() -> Self {
        PdOptions {
            faults: PdFaults::none(),
            checks: Checks::all(),
            workers: 8,
            timeout: Duration::from_secs(120),
            max_connections: 16,
        }
    }
}

/// A test hook called with every decoded message before an endpoint handles it (a panic
/// in it is a panicking reader task).
pub type MessageHook = Arc<dyn Fn(&Message) + Send + Sync>;

/// The handshake an endpoint with `spec` and kernels of `arithmetic` (its backend's
/// [`Backend::arithmetic`]) announces (`landing_pages`: decode's landing zone size; 0 for
/// prefill).
///
/// [`Backend::arithmetic`]: sparsekit_host::Backend::arithmetic
pub fn hello(
    role: Role,
    spec: &CacheSpec,
    arithmetic: Arithmetic,
    landing_pages: usize,
    transport: Vec<u8>,
) -> Hello {
    Hello {
        role,
        kv_fingerprint: spec.kv.fingerprint(),
        index_k_fingerprint: spec.index_k.fingerprint(),
        spec_fingerprint: spec.fingerprint(),
        num_layers: spec.num_layers as u32,
        page_size: spec.page_size() as u32,
        arithmetic,
        landing_pages: landing_pages.min(u32::MAX as usize) as u32,
        transport,
    }
}

/// Checks a peer's handshake against our `spec`: the expected role, the same layouts of
/// both kinds, layers and page size, our kernels' arithmetic `ours` (and a landing zone
/// when the peer is decode).
pub fn check_peer(
    spec: &CacheSpec,
    ours: Arithmetic,
    peer: &Hello,
    role: Role,
) -> Result<(), PdError> {
    let mut bad = Vec::new();
    if peer.arithmetic != ours {
        bad.push(format!(
            "arithmetic {} (ours {}: set SPARSEKIT_CPU_ISA=amx on both nodes or neither)",
            peer.arithmetic.name(),
            ours.name()
        ));
    }
    if peer.role != role {
        bad.push(format!(
            "role {} (expected {})",
            peer.role.name(),
            role.name()
        ));
    }
    if peer.kv_fingerprint != spec.kv.fingerprint() {
        bad.push(format!(
            "KV layout {:#018x} (ours {:#018x})",
            peer.kv_fingerprint,
            spec.kv.fingerprint()
        ));
    }
    if peer.index_k_fingerprint != spec.index_k.fingerprint() {
        bad.push(format!(
            "index-K layout {:#018x} (ours {:#018x})",
            peer.index_k_fingerprint,
            spec.index_k.fingerprint()
        ));
    }
    if peer.spec_fingerprint != spec.fingerprint() {
        bad.push(format!(
            "cache spec {:#018x} (ours {:#018x}: pools, layers or tokens per entry differ)",
            peer.spec_fingerprint,
            spec.fingerprint()
        ));
    }
    if peer.num_layers as usize != spec.num_layers || peer.page_size as usize != spec.page_size() {
        bad.push(format!(
            "{} layers of {}-token pages (ours {} of {})",
            peer.num_layers,
            peer.page_size,
            spec.num_layers,
            spec.page_size()
        ));
    }
    if role == Role::Decode && peer.landing_pages == 0 {
        bad.push("no landing zone".into());
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(PdError::Incompatible(bad.join("; ")))
    }
}
