//! What an engine tells about itself: its shape ([`EngineInfo`]), its part in PD
//! ([`PdInfo`]), its cache settings ([`CacheInfo`]) and its counters ([`EngineStats`]).

use serde::Serialize;

/// Shape facts clients need (context limit, model name).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineInfo {
    pub model: String,
    pub backend: String,
    pub max_context: usize,
    pub vocab: usize,
    pub page_size: usize,
    pub kv_pages: usize,
    pub kv_dtype: &'static str,
    pub index_k_dtype: &'static str,
    pub index_topk: usize,
    pub n_layers: usize,
    /// Weight seed (with the model name it determines every weight).
    pub seed: u64,
    /// The prefix cache: `None` for the reference space.
    pub cache: Option<CacheInfo>,
    /// Replies are scripted by a test injection ([`ReplyScript`](crate::engine::ReplyScript)), not sampled.
    pub scripted_replies: bool,
}

/// How an engine takes part in prefill/decode disaggregation (`/server_info`'s `pd`): what
/// a peer or a harness needs to find and check its counterpart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PdInfo {
    /// `prefill`, `decode`, or `both` (a pair in one process; this is its decode engine).
    pub role: String,
    /// `local` or `nixl`.
    pub transport: String,
    /// Prefill: the TCP port decode's PD connection goes to (on the server's host).
    pub bootstrap_port: Option<u16>,
    /// Decode: the prefill server's URL.
    pub peer: Option<String>,
    /// Host tier pages of the prefill side, where this server knows them (`prefill`, and
    /// `both`, whose engine behind the HTTP server is decode's, without a host tier).
    pub prefill_host_pages: Option<usize>,
}

/// The cache settings an engine serves with ([`EngineInfo::cache`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CacheInfo {
    /// Host tier pages (0: none).
    pub host_pages: usize,
    pub write_through: bool,
    pub verify: bool,
    /// Injected faults (empty in production).
    pub faults: Vec<&'static str>,
}

/// Counters of the engine thread (read from any thread).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EngineStats {
    pub steps: u64,
    pub failed_steps: u64,
    pub waiting: usize,
    pub running: usize,
    pub free_pages: usize,
    pub capacity_pages: usize,
    /// Result of the last KV accounting check (run whenever the engine goes idle).
    pub leak_check: Option<Result<(), String>>,
    /// Pages held for no request the engine knows, at the last idle check.
    pub leaked_pages: usize,
    /// Requests failed alone by a KV cache check or a failed load (the rest of their
    /// step went on).
    pub failed_seqs: u64,
    /// Requests whose prefix failed an integrity check and that recomputed it (served).
    pub integrity_fallbacks: u64,
    /// Largest number of rows in one step.
    pub max_step_rows: usize,
    /// Largest number of sequences in one step.
    pub max_step_seqs: usize,
}
