//! Prometheus metrics (names from SERVING.md), one registry per server instance through
//! the `prometheus-client` crate, exposed as OpenMetrics text on `/metrics`.
//!
//! Registered now: `sparsekit_requests_total{role,status}`, `sparsekit_tokens_total{kind}`,
//! `sparsekit_ttft_seconds`, `sparsekit_itl_seconds`, `sparsekit_pages{pool,state}`.
//! The cache, transfer and integrity counters (`cache_hits_total`, `loads_total`,
//! `backups_total`, `transfer_bytes_total`, `checksum_failures_total`, `refused_total`,
//! `quarantined_pages`) are registered by the cache-backed engine and the PD transfer,
//! which are what can move them; this engine's reference KV space has none of those.

use std::sync::Mutex;

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
    /// `ok`, `aborted`, `failed`, `rejected`.
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

/// How a request ended, for `sparsekit_requests_total{status}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    Ok,
    Aborted,
    Failed,
    Rejected,
}

impl RequestStatus {
    fn label(&self) -> &'static str {
        match self {
            RequestStatus::Ok => "ok",
            RequestStatus::Aborted => "aborted",
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
    pages: Family<PageLabels, Gauge>,
}

impl Metrics {
    /// A fresh registry for a server of `role`.
    pub fn new(role: &str) -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let tokens = Family::<TokenLabels, Counter>::default();
        // 1 ms .. ~33 s.
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 16));
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
            "sparsekit_pages",
            "KV pages by pool and state",
            pages.clone(),
        );
        Metrics {
            role: role.to_string(),
            registry: Mutex::new(registry),
            requests,
            tokens,
            ttft,
            itl,
            pages,
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

    /// Records an inter-token latency, in seconds.
    pub fn itl(&self, seconds: f64) {
        self.itl.observe(seconds);
    }

    /// Sets the page gauges of `pool`.
    pub fn pages(&self, pool: &str, free: usize, held: usize) {
        for (state, v) in [("free", free), ("held", held)] {
            self.pages
                .get_or_create(&PageLabels {
                    pool: pool.to_string(),
                    state: state.to_string(),
                })
                .set(v as i64);
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
        m.pages("device", 3, 1);
        let text = m.encode();
        for needle in [
            "sparsekit_requests_total{role=\"both\",status=\"ok\"} 1",
            "sparsekit_tokens_total{kind=\"generated\"} 5",
            "sparsekit_ttft_seconds_bucket",
            "sparsekit_itl_seconds_count 1",
            "sparsekit_pages{pool=\"device\",state=\"free\"} 3",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
        assert_eq!(m.requests_with(RequestStatus::Ok), 1);
    }
}
