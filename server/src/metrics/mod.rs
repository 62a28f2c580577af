//! Prometheus metrics (names from SERVING.md), one registry per engine through the
//! `prometheus-client` crate, exposed on `/metrics` as Prometheus text or OpenMetrics
//! ([`expose`]: negotiated by `Accept`; the engines of a `--pd on` server merged, each
//! sample labelled with its `role`).
//!
//! Every name of SERVING.md is registered: `sparsekit_requests_total{role,status}`,
//! `sparsekit_tokens_total{kind}`, `sparsekit_ttft_seconds`, `sparsekit_itl_seconds`,
//! `sparsekit_pages{pool,state}`, `sparsekit_cache_hits_total{tier}` (pages),
//! `sparsekit_loads_total{status}` (load jobs), `sparsekit_backups_total{status}` (pages),
//! `sparsekit_transfer_bytes_total{kind}`, `sparsekit_checksum_failures_total{where}`,
//! `sparsekit_refused_total{reason}`, `sparsekit_quarantined_pages{pool}`; plus
//! `sparsekit_cache_lookups_total` (prompt pages looked up: the hit rates' denominator),
//! `sparsekit_leaked_pages` and `sparsekit_idle_checks_total` (the accounting check the
//! engine runs whenever it is idle), `sparsekit_requests_in_engine{state}` (running,
//! waiting), `sparsekit_e2e_request_latency_seconds` and
//! `sparsekit_request_queue_time_seconds` (histograms, like TTFT's with buckets up to the
//! request timeout), `sparsekit_tool_call_parse_failures_total` (DSML tool-call markup
//! that did not parse and was returned as text) and
//! `sparsekit_connections_refused_total{reason}` (the HTTP server's connection limits). Label families only show the series something set: a measure a server
//! cannot have (no host tier, no transfer) is absent, never a made-up zero.

pub mod expose;

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of `sparsekit_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `prefill`, `decode` or `both`.
    pub role: String,
    /// `ok`, `aborted`, `timeout`, `failed`, `rejected`.
    pub status: String,
}

/// Labels of `sparsekit_tokens_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    /// `prompt` (tokens prefilled) or `generated`.
    pub kind: String,
}

/// Labels of `sparsekit_pages`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PageLabels {
    /// Which pool (`device`).
    pub pool: String,
    /// `free` or `held`.
    pub state: String,
}

/// A family labelled by whatever label set its users name.
type Labelled<M> = Family<Vec<(String, String)>, M>;

fn label(name: &str, value: &str) -> Vec<(String, String)> {
    vec![(name.to_string(), value.to_string())]
}

/// How a request ended, for `sparsekit_requests_total{status}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    Ok,
    /// Aborted by its client (a disconnect, `/abort_request`) or by shutdown.
    Aborted,
    /// Aborted because it ran past the server's request timeout.
    Timeout,
    Failed,
    Rejected,
}

impl RequestStatus {
    fn label(&self) -> &'static str {
        match self {
            RequestStatus::Ok => "ok",
            RequestStatus::Aborted => "aborted",
            RequestStatus::Timeout => "timeout",
            RequestStatus::Failed => "failed",
            RequestStatus::Rejected => "rejected",
        }
    }
}

/// The metrics of one server instance.
#[derive(Debug)]
pub struct Metrics {
    role: String,
    registry: Mutex<Registry>,
    requests: Family<RequestLabels, Counter>,
    tokens: Family<TokenLabels, Counter>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    tool_parse_failures: Counter,
    connections_refused: Labelled<Counter>,
    pages: Family<PageLabels, Gauge>,
    cache_hits: Labelled<Counter>,
    cache_lookups: Counter,
    loads: Labelled<Counter>,
    backups: Labelled<Counter>,
    transfer_bytes: Labelled<Counter>,
    checksum_failures: Labelled<Counter>,
    refused: Labelled<Counter>,
    refused_frames: Labelled<Counter>,
    detections: Labelled<Counter>,
    fallbacks: Labelled<Counter>,
    kernel_checks: Labelled<Counter>,
    quarantined: Labelled<Gauge>,
    leaked: Gauge,
    transfers: Labelled<Gauge>,
    idle_checks: Counter,
    in_engine: Labelled<Gauge>,
}

/// The request timeout [`Metrics::new`] sizes the latency histograms for (the server's
/// default).
pub const DEFAULT_LATENCY_LIMIT: Duration = Duration::from_secs(600);

/// Buckets of a request-latency histogram: 1 ms doubling up to the first bucket at or
/// above `limit` (a request cannot take longer: it is aborted at the limit).
pub fn latency_buckets(limit: Duration) -> Vec<f64> {
    let limit = limit.as_secs_f64().max(0.001);
    let mut b = vec![0.001];
    while b.last().is_some_and(|&x| x < limit) && b.len() < 48 {
        let next = b.last().map_or(0.001, |x| x * 2.0);
        b.push(next);
    }
    b
}

impl Metrics {
    /// A fresh registry for a server of `role` whose requests take at most
    /// [`DEFAULT_LATENCY_LIMIT`].
    pub fn new(role: &str) -> Self {
        Self::with_latency_limit(role, DEFAULT_LATENCY_LIMIT)
    }

    /// A fresh registry for a server of `role` whose requests are aborted after `limit`
    /// (the TTFT, end-to-end and queue-time buckets reach it).
    pub fn with_latency_limit(role: &str, limit: Duration) -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let tokens = Family::<TokenLabels, Counter>::default();
        let buckets = latency_buckets(limit);
        let ttft = Histogram::new(buckets.iter().copied());
        let e2e = Histogram::new(buckets.iter().copied());
        let queue = Histogram::new(buckets);
        // 0.1 ms .. ~3.3 s.
        let itl = Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        let pages = Family::<PageLabels, Gauge>::default();
        registry.register(
            "sparsekit_requests",
            "Requests finished, by server role and how they ended",
            requests.clone(),
        );
        registry.register(
            "sparsekit_tokens",
            "Tokens processed: prompt tokens prefilled and tokens generated",
            tokens.clone(),
        );
        registry.register(
            "sparsekit_ttft_seconds",
            "Time from a request's arrival to its first generated token",
            ttft.clone(),
        );
        registry.register(
            "sparsekit_itl_seconds",
            "Time between consecutive generated tokens of a request",
            itl.clone(),
        );
        registry.register(
            "sparsekit_e2e_request_latency_seconds",
            "Time from a request's arrival to its end (finished, aborted, timed out or failed)",
            e2e.clone(),
        );
        registry.register(
            "sparsekit_request_queue_time_seconds",
            "Time a request waited from its arrival until the engine admitted it (pages reserved)",
            queue.clone(),
        );
        registry.register(
            "sparsekit_pages",
            "KV pages by pool and state",
            pages.clone(),
        );
        let mut family = |name: &str, help: &str| {
            let f = Labelled::<Counter>::default();
            registry.register(name, help, f.clone());
            f
        };
        let cache_hits = family(
            "sparsekit_cache_hits",
            "Prompt pages found in the prefix cache, by the tier their bytes came from",
        );
        let loads = family(
            "sparsekit_loads",
            "Host-to-device prefix loads (jobs), by how they ended",
        );
        let backups = family(
            "sparsekit_backups",
            "Pages backed up from the device tier to the host tier, by how they ended",
        );
        let transfer_bytes = family(
            "sparsekit_transfer_bytes",
            "Bytes moved by prefill/decode transfers, by buffer kind",
        );
        let checksum_failures = family(
            "sparsekit_checksum_failures",
            "Pages whose checksum did not match what was written, by where it was checked",
        );
        let refused = family(
            "sparsekit_refused",
            "Writes, reads, frames or requests refused by an integrity check, by reason",
        );
        let refused_frames = family(
            "sparsekit_refused_frames",
            "PD messages and page writes the decode receiver refused, by reason",
        );
        let detections = family(
            "sparsekit_integrity_detections",
            "Integrity problems a check found and the server repaired without refusing anything (a read that waited for bytes behind a published fence), by check",
        );
        let fallbacks = family(
            "sparsekit_integrity_fallbacks",
            "Requests whose cached or received prefix failed an integrity check and that were served by recomputing it (the prefix dropped from the cache), by reason",
        );
        let connections_refused = family(
            "sparsekit_connections_refused",
            "HTTP connections refused (503 or closed) or closed idle to make room, by reason",
        );
        let mut gauge = |name: &str, help: &str| {
            let f = Labelled::<Gauge>::default();
            registry.register(name, help, f.clone());
            f
        };
        let quarantined = gauge(
            "sparsekit_quarantined_pages",
            "Pages released but still pinned by an in-flight copy, step or transfer",
        );
        let in_engine = gauge(
            "sparsekit_requests_in_engine",
            "Requests in the engine now: running (holding pages) or waiting for admission",
        );
        let kernel_checks = Labelled::<Counter>::default();
        registry.register(
            "sparsekit_kernel_checks",
            "Sampled kernel calls re-checked against the f64 references, by op and outcome (ok, mismatch)",
            kernel_checks.clone(),
        );
        let cache_lookups = Counter::default();
        registry.register(
            "sparsekit_cache_lookups",
            "Prompt pages looked up in the prefix cache (the denominator of the hit rates)",
            cache_lookups.clone(),
        );
        let tool_parse_failures = Counter::default();
        registry.register(
            "sparsekit_tool_call_parse_failures",
            "Generated DSML tool-call blocks that were malformed or truncated (returned as text)",
            tool_parse_failures.clone(),
        );
        let idle_checks = Counter::default();
        registry.register(
            "sparsekit_idle_checks",
            "Accounting checks run while the engine was idle",
            idle_checks.clone(),
        );
        let leaked = Gauge::default();
        registry.register(
            "sparsekit_leaked_pages",
            "Pages held for no request the engine knows, at the last idle check",
            leaked.clone(),
        );
        let transfers = Labelled::<Gauge>::default();
        registry.register(
            "sparsekit_pd_transfers_in_flight",
            "PD transfers not ended yet, by side: decode's (including those waiting for a confirmation) and prefill's jobs",
            transfers.clone(),
        );
        Metrics {
            role: role.to_string(),
            registry: Mutex::new(registry),
            requests,
            tokens,
            ttft,
            itl,
            e2e,
            queue,
            tool_parse_failures,
            connections_refused,
            pages,
            cache_hits,
            cache_lookups,
            loads,
            backups,
            transfer_bytes,
            checksum_failures,
            refused,
            refused_frames,
            detections,
            fallbacks,
            kernel_checks,
            transfers,
            quarantined,
            leaked,
            idle_checks,
            in_engine,
        }
    }

    /// Counts a finished request.
    pub fn request(&self, status: RequestStatus) {
        self.requests
            .get_or_create(&RequestLabels {
                role: self.role.clone(),
                status: status.label().to_string(),
            })
            .inc();
    }

    /// Counts tokens of `kind` (`prompt` or `generated`).
    pub fn tokens(&self, kind: &str, n: u64) {
        self.tokens
            .get_or_create(&TokenLabels {
                kind: kind.to_string(),
            })
            .inc_by(n);
    }

    /// Records a time to first token, in seconds.
    pub fn ttft(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    /// Records a request's end-to-end latency, in seconds.
    pub fn e2e(&self, seconds: f64) {
        self.e2e.observe(seconds);
    }

    /// Records how long a request waited for admission, in seconds.
    pub fn queue_time(&self, seconds: f64) {
        self.queue.observe(seconds);
    }

    /// Counts a DSML tool-call block that did not parse.
    pub fn tool_call_parse_failure(&self) {
        self.tool_parse_failures.inc();
    }

    /// The value of `sparsekit_tool_call_parse_failures_total` (tests, reports).
    pub fn tool_call_parse_failures(&self) -> u64 {
        self.tool_parse_failures.get()
    }

    /// Counts a connection refused or evicted for `reason` (`capacity`, `per_client`,
    /// `reserve_full`, `evicted_idle`).
    pub fn connection_refused(&self, reason: &str) {
        self.connections_refused
            .get_or_create(&label("reason", reason))
            .inc();
    }

    /// The role label of `sparsekit_requests_total`.
    pub fn role(&self) -> &str {
        &self.role
    }

    /// Records an inter-token latency, in seconds.
    pub fn itl(&self, seconds: f64) {
        self.itl.observe(seconds);
    }

    /// Sets `sparsekit_pages{pool,state}`.
    pub fn pages(&self, pool: &str, state: &str, n: usize) {
        self.pages
            .get_or_create(&PageLabels {
                pool: pool.to_string(),
                state: state.to_string(),
            })
            .set(n as i64);
    }

    /// Counts `pages` prompt pages found in `tier` (`device`, `host`).
    pub fn cache_hits(&self, tier: &str, pages: u64) {
        self.cache_hits
            .get_or_create(&label("tier", tier))
            .inc_by(pages);
    }

    /// Counts prompt pages looked up in the prefix cache.
    pub fn cache_lookups(&self, pages: u64) {
        self.cache_lookups.inc_by(pages);
    }

    /// Counts load jobs that ended with `status` (`ok`, `failed`, `cancelled`).
    pub fn loads(&self, status: &str, n: u64) {
        self.loads.get_or_create(&label("status", status)).inc_by(n);
    }

    /// Counts backups (`ok`: pages; `failed`: batches).
    pub fn backups(&self, status: &str, n: u64) {
        self.backups
            .get_or_create(&label("status", status))
            .inc_by(n);
    }

    /// Counts transfer bytes of `kind` (`kv`, `index_k`).
    pub fn transfer_bytes(&self, kind: &str, n: u64) {
        self.transfer_bytes
            .get_or_create(&label("kind", kind))
            .inc_by(n);
    }

    /// Counts checksum failures detected at `place` (`host_load`, `inbound`...).
    pub fn checksum_failures(&self, place: &str, n: u64) {
        self.checksum_failures
            .get_or_create(&label("where", place))
            .inc_by(n);
    }

    /// Counts refusals by an integrity check for `reason` (`stale_write`, `not_landed`,
    /// `load_failed`, `fingerprint`, ...).
    pub fn refused(&self, reason: &str, n: u64) {
        self.refused
            .get_or_create(&label("reason", reason))
            .inc_by(n);
    }

    /// Counts integrity problems found by `check` and repaired in place (`landing_wait`:
    /// a read that found bytes not landed behind a published fence and waited for them).
    pub fn detection(&self, check: &str, n: u64) {
        self.detections
            .get_or_create(&label("check", check))
            .inc_by(n);
    }

    /// Counts a request served by recomputing a prefix that failed an integrity check
    /// (`reason`: the check, e.g. `checksum`, `not_landed`, `unwritten`).
    pub fn integrity_fallback(&self, reason: &str) {
        self.fallbacks.get_or_create(&label("reason", reason)).inc();
    }

    /// Counts `n` sampled kernel calls of `op` re-checked with `outcome` (`ok`,
    /// `mismatch`).
    pub fn kernel_checks(&self, op: &str, outcome: &str, n: u64) {
        self.kernel_checks
            .get_or_create(&vec![
                ("op".to_string(), op.to_string()),
                ("outcome".to_string(), outcome.to_string()),
            ])
            .inc_by(n);
    }

    /// Counts PD frames (messages, page writes) refused by the decode receiver for
    /// `reason` (`fingerprint`, `checksum`, `stale`, ...).
    pub fn refused_frames(&self, reason: &str, n: u64) {
        self.refused_frames
            .get_or_create(&label("reason", reason))
            .inc_by(n);
    }

    /// Sets `sparsekit_quarantined_pages{pool}`.
    pub fn quarantined(&self, pool: &str, n: usize) {
        self.quarantined
            .get_or_create(&label("pool", pool))
            .set(n as i64);
    }

    /// Sets `sparsekit_pd_transfers_in_flight{side}` (`decode`, `prefill`).
    pub fn transfers_in_flight(&self, side: &str, n: usize) {
        self.transfers
            .get_or_create(&label("side", side))
            .set(n as i64);
    }

    /// Records an idle accounting check and the pages it found leaked.
    pub fn idle_check(&self, leaked: usize) {
        self.leaked.set(leaked as i64);
        self.idle_checks.inc();
    }

    /// Sets `sparsekit_requests_in_engine{state}`.
    pub fn in_engine(&self, running: usize, waiting: usize) {
        for (state, n) in [("running", running), ("waiting", waiting)] {
            self.in_engine
                .get_or_create(&label("state", state))
                .set(n as i64);
        }
    }

    /// The value of `sparsekit_requests_total{status}` for this role (tests, reports).
    pub fn requests_with(&self, status: RequestStatus) -> u64 {
        self.requests
            .get_or_create(&RequestLabels {
                role: self.role.clone(),
                status: status.label().to_string(),
            })
            .get()
    }

    /// The exposition of `sides` (each engine's metrics, with the role to label its
    /// samples by; `None` for a server of one engine) in `format`.
    pub fn expose(sides: &[(&Metrics, Option<&str>)], format: expose::Format) -> String {
        let mut e = expose::Exposition::default();
        for (m, role) in sides {
            e.add_openmetrics(&m.encode(), *role);
        }
        e.render(format)
    }

    /// OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = match self.registry.lock() {
            Ok(r) => r,
            Err(poisoned) => poisoned.into_inner(),
        };
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_serving_md() {
        let m = Metrics::new("both");
        m.request(RequestStatus::Ok);
        m.tokens("generated", 5);
        m.ttft(0.01);
        m.itl(0.001);
        m.pages("device", "free", 3);
        let before = m.encode();
        assert!(
            !before.contains("sparsekit_cache_hits_total{"),
            "no series before something counts: {before}"
        );
        m.cache_hits("host", 4);
        m.checksum_failures("host_load", 1);
        m.refused("stale_write", 2);
        m.quarantined("device", 5);
        m.idle_check(0);
        let text = m.encode();
        for needle in [
            "sparsekit_requests_total{role=\"both\",status=\"ok\"} 1",
            "sparsekit_tokens_total{kind=\"generated\"} 5",
            "sparsekit_ttft_seconds_bucket",
            "sparsekit_itl_seconds_count 1",
            "sparsekit_pages{pool=\"device\",state=\"free\"} 3",
            "sparsekit_cache_hits_total{tier=\"host\"} 4",
            "sparsekit_checksum_failures_total{where=\"host_load\"} 1",
            "sparsekit_refused_total{reason=\"stale_write\"} 2",
            "sparsekit_quarantined_pages{pool=\"device\"} 5",
            "sparsekit_leaked_pages 0",
            "sparsekit_idle_checks_total 1",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
        assert_eq!(m.requests_with(RequestStatus::Ok), 1);
    }
}
