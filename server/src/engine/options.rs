//! What an engine is started with besides the model: [`EngineOptions`] (pages, batching,
//! admission limits, checks, test injections) and [`CacheOptions`] (prefix cache and host
//! tier).

use std::sync::Arc;
use std::time::Duration;

use sparsekit_host::cache::{Faults, HostLayout};
use sparsekit_host::{IndexKDtype, KvDtype};

use crate::engine::kernel_check::{KernelCheckConfig, KernelFault};
use crate::engine::kv::SeqId;
use crate::error::EngineError;

/// Fault injection for tests: called inside every step, before the forward pass, with the
/// sequences in the step; a panic in it is a panicking step.
pub type StepFault = Arc<dyn Fn(&[SeqId]) + Send + Sync>;

/// Test injection ([`EngineOptions::scripted_reply`]): the tokens a request with this
/// prompt generates instead of sampling (`None`: it samples), one per step while they
/// last; the forward pass, digests and every check run as usual. Shown by
/// [`EngineInfo::scripted_replies`](crate::engine::EngineInfo::scripted_replies): a server that uses it says so.
pub type ReplyScript = Arc<dyn Fn(&[u32]) -> Option<Vec<u32>> + Send + Sync>;

/// The prefix cache and host tier of an engine ([`EngineOptions::cache`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CacheOptions {
    /// Pages of the host tier (0: none; evicted pages leave the cache).
    pub host_pages: usize,
    /// Frames of a V4 cache's window pool (its KV rows; `None`: one a device page). A
    /// decode gives back the frames of the pages its tokens left, so fewer frames than
    /// pages serve long generations in less memory (see `docs/cache.md`). Ignored by a
    /// V3.2 model.
    pub window_pages: Option<usize>,
    /// Back committed pages up to the host tier at once (so eviction rarely waits).
    pub write_through: bool,
    /// Verify the checksums of pages loaded from the host tier (off only for the
    /// harness's `--no-verify`).
    pub verify: bool,
    pub host_layout: HostLayout,
    /// Bound of every wait in the cache (a load's layer, a layer lock).
    pub wait_timeout: Duration,
    /// Fault injections (none in production).
    pub faults: Faults,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            host_pages: 0,
            window_pages: None,
            write_through: true,
            verify: true,
            host_layout: HostLayout::LayerFirst,
            wait_timeout: Duration::from_secs(10),
            faults: Faults::none(),
        }
    }
}

/// Engine settings besides the model.
#[derive(Clone)]
pub struct EngineOptions {
    /// Weight seed.
    pub seed: u64,
    pub kv_dtype: KvDtype,
    pub index_k_dtype: IndexKDtype,
    /// Pages of the KV space (each holds `page_size` tokens of every layer and kind): the
    /// device pool.
    pub kv_pages: usize,
    /// The prefix cache (radix reuse on the device pool, host tier): `None` serves with
    /// the reference space ([`PagedKvSpace`](crate::engine::PagedKvSpace): no reuse).
    pub cache: Option<CacheOptions>,
    /// Rows (tokens) per step at most.
    pub max_batch_tokens: usize,
    /// Prompt tokens of one sequence per step at most.
    pub prefill_chunk: usize,
    /// Prefill tokens each step gets even when decode rows fill `max_batch_tokens`.
    pub min_prefill_tokens: usize,
    /// Sequences admitted (holding pages) at once.
    pub max_running: usize,
    /// Requests queued for admission before `submit` answers `Overloaded`.
    pub max_waiting: usize,
    /// Role label of the metrics (`both` for a single process).
    pub role: String,
    /// See [`StepFault`].
    pub fault: Option<StepFault>,
    /// Re-checks a sample of the DSA kernel calls against an independent implementation
    /// (counted on `/metrics` as `sparsekit_kernel_checks_total{op,outcome}`; each engine
    /// counts its own).
    pub kernel_check: Option<KernelCheckConfig>,
    /// An injected kernel bug (harness only).
    pub kernel_fault: Option<KernelFault>,
    /// See [`ReplyScript`] (tests of what clients make of given model output: DSML tool
    /// calls, say, which a model with random weights never writes).
    pub scripted_reply: Option<ReplyScript>,
}

impl std::fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineOptions")
            .field("seed", &self.seed)
            .field("kv_dtype", &self.kv_dtype)
            .field("index_k_dtype", &self.index_k_dtype)
            .field("kv_pages", &self.kv_pages)
            .field("cache", &self.cache)
            .field("max_batch_tokens", &self.max_batch_tokens)
            .field("prefill_chunk", &self.prefill_chunk)
            .field("min_prefill_tokens", &self.min_prefill_tokens)
            .field("max_running", &self.max_running)
            .field("max_waiting", &self.max_waiting)
            .field("role", &self.role)
            .field("fault", &self.fault.is_some())
            .field("kernel_check", &self.kernel_check.is_some())
            .field("kernel_fault", &self.kernel_fault)
            .field("scripted_reply", &self.scripted_reply.is_some())
            .finish()
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            seed: 0,
            kv_dtype: KvDtype::Bf16,
            index_k_dtype: IndexKDtype::FP8,
            kv_pages: 4096,
            cache: None,
            max_batch_tokens: 512,
            prefill_chunk: 256,
            min_prefill_tokens: 32,
            max_running: 128,
            max_waiting: 4096,
            role: "both".into(),
            fault: None,
            kernel_check: None,
            kernel_fault: None,
            scripted_reply: None,
        }
    }
}

impl EngineOptions {
    pub(crate) fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: &str| Err(EngineError::InvalidConfig(m.into()));
        if self.max_batch_tokens == 0 || self.prefill_chunk == 0 || self.min_prefill_tokens == 0 {
            return bad("max_batch_tokens, prefill_chunk and min_prefill_tokens must be positive");
        }
        if self.max_running == 0 || self.kv_pages == 0 {
            return bad("max_running and kv_pages must be positive");
        }
        Ok(())
    }
}
