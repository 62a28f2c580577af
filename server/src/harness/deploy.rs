//! Who serves a configuration during a harness run: a [`ConfigRunner`] starts a
//! [`Deployment`] (one server, or a prefill/decode pair) for a [`ConfigKey`] and a
//! [`RunPlan`]; the harness sends its sessions to the deployment's [`Target`](crate::harness::run::Target), probes its
//! `/health`, and reads its `/metrics` — the same for servers in this process and servers
//! running elsewhere (`--url`).
//!
//! [`LocalRunner`] serves every configuration in this process (PD off: the engine over the
//! cache-backed KV space behind the HTTP server; PD on: a prefill/decode pair over the
//! local transport); [`UrlRunner`] points at running servers;
//! [`crate::harness::process::ProcessRunner`] serves the PD-on rows by two `serve`
//! processes joined by NIXL.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use sparsekit_host::cache::Faults;
use sparsekit_host::{Backend, IndexKDtype, KernelAudit, KvDtype, ModelOps};

use crate::engine::kernel_check::KernelCheckConfig;
use crate::engine::ModelConfig;
use crate::engine::{CacheOptions, Engine, EngineOptions};
use crate::error::EngineError;
use crate::harness::config::{no_verify_faults, ConfigKey, Injection};
use crate::harness::run::{http_exchange, HttpTarget};
use crate::harness::scrape::Scrape;
use crate::metrics::Metrics;
use crate::pd::pair::PdPair;
use crate::pd::{Checks, PdFaults, PdOptions};

/// Pool sizes of a run (pages of `page_size` tokens of every layer and kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Sizing {
    /// The device pool: about a quarter of the workload's working set.
    pub device_pages: usize,
    /// The host tier (when on): the whole working set.
    pub host_pages: usize,
    /// A PD decode side's pool (no prefix reuse: room for the requests it runs at once).
    pub decode_pages: usize,
    /// The decode pool of a `decode-small` configuration: room for about two of the
    /// largest requests, far below the load.
    pub small_decode_pages: usize,
}

/// Everything a runner needs besides the configuration.
#[derive(Clone)]
pub struct RunPlan {
    pub model: ModelConfig,
    pub seed: u64,
    pub kv_dtype: KvDtype,
    pub sizing: Sizing,
    /// Requests holding pages at once at most (the sessions of the workload).
    pub max_running: usize,
    pub injection: Option<Injection>,
    /// The second checks (load checksums, landed stamps); off for `--no-verify`.
    pub verify: bool,
    /// Bound of every wait in the cache.
    pub cache_wait: Duration,
    /// How long a request may take (the harness's `--deadline-s`).
    pub deadline: Duration,
    /// The independent kernel checks (with the checks on): every served engine re-checks
    /// one call in `kernel_check_every` of each DSA op with this auditor.
    pub audit: Option<Arc<dyn KernelAudit>>,
    pub kernel_check_every: u64,
}

impl std::fmt::Debug for RunPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunPlan")
            .field("model", &self.model.name)
            .field("sizing", &self.sizing)
            .field("injection", &self.injection)
            .field("verify", &self.verify)
            .field("kernel_checks", &self.kernel_checks_on())
            .field("kernel_check_every", &self.kernel_check_every)
            .finish_non_exhaustive()
    }
}

impl RunPlan {
    /// Whether served engines re-check their kernels (an auditor, and the checks on).
    pub fn kernel_checks_on(&self) -> bool {
        self.verify && self.audit.is_some()
    }

    /// The kernel checks of the served engines (with the checks on).
    pub fn kernel_check(&self) -> Option<KernelCheckConfig> {
        self.audit
            .as_ref()
            .filter(|_| self.verify)
            .map(|a| KernelCheckConfig {
                audit: a.clone(),
                every: self.kernel_check_every,
            })
    }

    /// The cache options of configuration `c` under this plan.
    pub fn cache_options(&self, c: &ConfigKey) -> CacheOptions {
        let mut faults = Faults::none();
        if let Some(i) = self.injection {
            for f in i.cache_faults() {
                faults.insert(f);
            }
        }
        if !self.verify {
            for f in no_verify_faults() {
                faults.insert(f);
            }
        }
        CacheOptions {
            host_pages: if c.host_tier {
                self.sizing.host_pages
            } else {
                0
            },
            write_through: true,
            verify: self.verify,
            wait_timeout: self.cache_wait,
            faults,
            ..Default::default()
        }
    }

    /// The engine options of configuration `c` under this plan.
    pub fn engine_options(&self, c: &ConfigKey) -> EngineOptions {
        EngineOptions {
            seed: self.seed,
            kv_dtype: self.kv_dtype,
            index_k_dtype: c.index_k,
            kv_pages: self.sizing.device_pages,
            cache: Some(self.cache_options(c)),
            max_running: self.max_running.max(1),
            max_waiting: 4096,
            role: "both".into(),
            kernel_check: self.kernel_check(),
            kernel_fault: self.injection.and_then(|i| i.kernel_fault()),
            ..Default::default()
        }
    }

    /// The PD settings under this plan (a PD injection's fault; the receiver's checks off
    /// for `--no-verify`).
    pub fn pd_options(&self) -> PdOptions {
        let fault = self.injection.and_then(|i| i.pd_fault());
        PdOptions {
            faults: PdFaults::with(&fault.into_iter().collect::<Vec<_>>()),
            checks: if self.verify {
                Checks::all()
            } else {
                Checks::none()
            },
            workers: self.max_running.clamp(1, 16),
            // A transfer may wait for prefill as long as the request may take.
            timeout: self.deadline,
            ..Default::default()
        }
    }

    /// The engine options of the two sides of PD configuration `c`: prefill as
    /// [`RunPlan::engine_options`] (prefix cache, host tier), decode with a pool for the
    /// requests it runs and no host tier (its prompts arrive by transfer).
    pub fn pd_engine_options(&self, c: &ConfigKey) -> (EngineOptions, EngineOptions) {
        let prefill = EngineOptions {
            role: "prefill".into(),
            ..self.engine_options(c)
        };
        let mut cache = self.cache_options(c);
        cache.host_pages = 0;
        let kv_pages = if c.small_decode {
            self.sizing.small_decode_pages
        } else {
            self.sizing.decode_pages.max(self.sizing.device_pages)
        };
        let decode = EngineOptions {
            role: "decode".into(),
            kv_pages,
            cache: Some(cache),
            ..self.engine_options(c)
        };
        (prefill, decode)
    }
}

/// The servers of one configuration, up for all rounds of a run.
pub trait Deployment: Send + Sync {
    /// Where the sessions' requests go.
    fn target(&self) -> &HttpTarget;
    /// The servers whose `/health` is probed during the run.
    fn health_addrs(&self) -> Vec<SocketAddr>;
    /// `/metrics` of every server of the deployment, merged.
    fn scrape(&self) -> Result<Scrape, String> {
        Ok(merged(self.scrape_each()?))
    }
    /// `/metrics` of each server of the deployment ([`Deployment::health_addrs`]), one
    /// scrape per server (what [`wait_idle`] needs: each server's own accounting checks).
    fn scrape_each(&self) -> Result<Vec<Scrape>, String> {
        self.health_addrs()
            .into_iter()
            .map(|a| get(a, "/metrics", Duration::from_secs(10)).map(|t| Scrape::parse(&t)))
            .collect()
    }
    /// A note for the table (what serves the row).
    fn note(&self) -> Option<String> {
        None
    }
    /// Stops what the deployment started (nothing for external servers).
    fn close(self: Box<Self>) -> Result<(), EngineError>;
}

/// Starts deployments for the configurations it can serve.
pub trait ConfigRunner {
    /// Why this runner cannot serve `c` (`None`: it can).
    fn unavailable(&self, c: &ConfigKey) -> Option<String>;
    /// Starts the servers of `c`.
    fn start(&self, c: &ConfigKey, plan: &RunPlan) -> Result<Box<dyn Deployment>, EngineError>;
}

/// GETs `path` of `addr` (bounded); the body when the status is 200.
pub fn get(addr: SocketAddr, path: &str, deadline: Duration) -> Result<String, String> {
    match http_exchange(addr, "GET", path, b"", deadline) {
        Ok((200, body)) => Ok(String::from_utf8_lossy(&body).into_owned()),
        Ok((status, _)) => Err(format!("{path}: status {status}")),
        Err(e) => Err(format!("{path}: {e}")),
    }
}

/// Every configuration in this process: PD off, the engine (cache-backed space) behind the
/// HTTP server on a loopback port; PD on, a prefill/decode pair ([`PdPair`], in-process
/// transport) with an HTTP server each (requests go to decode).
#[derive(Debug)]
pub struct LocalRunner<B> {
    pub backend: Arc<B>,
}

struct LocalDeployment {
    rt: tokio::runtime::Runtime,
    server: Option<crate::http::ServerHandle>,
    target: HttpTarget,
}

impl Deployment for LocalDeployment {
    fn target(&self) -> &HttpTarget {
        &self.target
    }
    fn health_addrs(&self) -> Vec<SocketAddr> {
        vec![self.target.addr]
    }
    fn close(mut self: Box<Self>) -> Result<(), EngineError> {
        match self.server.take() {
            Some(s) => self.rt.block_on(s.shutdown(Duration::from_secs(10))),
            None => Ok(()),
        }
    }
}

/// A PD pair in this process, each engine behind its own HTTP server.
struct PdDeployment<B: Backend + 'static> {
    rt: tokio::runtime::Runtime,
    servers: Vec<crate::http::ServerHandle>,
    pair: Option<PdPair<B>>,
    target: HttpTarget,
    prefill_addr: SocketAddr,
}

impl<B: Backend + ModelOps + 'static> Deployment for PdDeployment<B> {
    fn target(&self) -> &HttpTarget {
        &self.target
    }
    fn health_addrs(&self) -> Vec<SocketAddr> {
        vec![self.target.addr, self.prefill_addr]
    }
    fn note(&self) -> Option<String> {
        Some("prefill/decode pair in process, local transport".into())
    }
    fn close(mut self: Box<Self>) -> Result<(), EngineError> {
        let mut r = Ok(());
        for s in self.servers.drain(..) {
            let x = self.rt.block_on(s.shutdown(Duration::from_secs(10)));
            r = r.and(x);
        }
        if let Some(p) = self.pair.take() {
            r = r.and(p.shutdown(Duration::from_secs(10)));
        }
        r
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, EngineError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| EngineError::Unavailable(format!("tokio runtime: {e}")))
}

impl<B: Backend + ModelOps + 'static> LocalRunner<B> {
    fn start_pd(&self, c: &ConfigKey, plan: &RunPlan) -> Result<Box<dyn Deployment>, EngineError> {
        let (p_opts, d_opts) = plan.pd_engine_options(c);
        let pair = PdPair::start_local(
            self.backend.clone(),
            plan.model,
            p_opts,
            d_opts,
            plan.pd_options(),
            Arc::new(Metrics::new("prefill")),
            Arc::new(Metrics::new("decode")),
        )?;
        let rt = runtime()?;
        let mut servers = Vec::new();
        for e in [pair.decode.clone(), pair.prefill.clone()] {
            let s = rt
                .block_on(crate::http::spawn(
                    e,
                    ([127, 0, 0, 1], 0).into(),
                    Default::default(),
                ))
                .map_err(|e| EngineError::Unavailable(format!("cannot bind the server: {e}")))?;
            servers.push(s);
        }
        let target = HttpTarget {
            addr: servers[0].addr,
        };
        let prefill_addr = servers[1].addr;
        Ok(Box::new(PdDeployment {
            rt,
            servers,
            pair: Some(pair),
            target,
            prefill_addr,
        }))
    }
}

impl<B: Backend + ModelOps + 'static> ConfigRunner for LocalRunner<B> {
    fn unavailable(&self, _c: &ConfigKey) -> Option<String> {
        None
    }

    fn start(&self, c: &ConfigKey, plan: &RunPlan) -> Result<Box<dyn Deployment>, EngineError> {
        if c.pd {
            return self.start_pd(c, plan);
        }
        let engine = Arc::new(Engine::start(
            self.backend.clone(),
            plan.model,
            plan.engine_options(c),
            Arc::new(Metrics::new("both")),
        )?);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| EngineError::Unavailable(format!("tokio runtime: {e}")))?;
        let server = rt
            .block_on(crate::http::spawn(
                engine,
                ([127, 0, 0, 1], 0).into(),
                Default::default(),
            ))
            .map_err(|e| EngineError::Unavailable(format!("cannot bind the server: {e}")))?;
        let target = HttpTarget { addr: server.addr };
        Ok(Box::new(LocalDeployment {
            rt,
            server: Some(server),
            target,
        }))
    }
}

/// What a running server says about itself (`/server_info`).
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteInfo {
    pub addr: SocketAddr,
    /// The backend it computes on (its reference must run on the same).
    pub backend: String,
    pub model: ModelConfig,
    pub seed: u64,
    pub kv_dtype: KvDtype,
    pub key: ConfigKey,
    pub device_pages: usize,
    pub faults: Vec<String>,
    pub verify: bool,
}

/// Parses `http://host:port` (or `host:port`) into an address.
pub fn parse_url(url: &str) -> Result<SocketAddr, EngineError> {
    let hostport = url
        .trim()
        .trim_start_matches("http://")
        .trim_end_matches('/');
    if hostport.contains('/') || url.trim().starts_with("https://") {
        return Err(EngineError::InvalidRequest(format!(
            "expected http://host:port, got {url:?}"
        )));
    }
    hostport
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| EngineError::InvalidRequest(format!("cannot resolve {url:?}")))
}

/// The host tier pages behind a server's `/server_info` `v`: its own, or its prefill
/// side's under PD (a decode server's, read from its peer).
fn host_pages(v: &Value) -> Result<u64, EngineError> {
    let own = v["cache"]["host_pages"].as_u64().unwrap_or(0);
    let pd = &v["pd"];
    if let Some(n) = pd["prefill_host_pages"].as_u64() {
        return Ok(n);
    }
    match (pd["role"].as_str(), pd["peer"].as_str()) {
        (Some("decode"), Some(peer)) => {
            let addr = parse_url(peer)?;
            let body = get(addr, "/server_info", Duration::from_secs(10))
                .map_err(|e| EngineError::Unavailable(format!("decode's peer {peer}: {e}")))?;
            let p: Value = serde_json::from_str(&body).map_err(|e| {
                EngineError::Unavailable(format!("decode's peer {peer}: /server_info: {e}"))
            })?;
            Ok(p["cache"]["host_pages"].as_u64().unwrap_or(0))
        }
        _ => Ok(own),
    }
}

/// Asks a running server what it serves.
pub fn remote_info(addr: SocketAddr) -> Result<RemoteInfo, EngineError> {
    let body = get(addr, "/server_info", Duration::from_secs(10))
        .map_err(|e| EngineError::Unavailable(format!("{addr}: {e}")))?;
    let v: Value = serde_json::from_str(&body)
        .map_err(|e| EngineError::Unavailable(format!("{addr}: /server_info: {e}")))?;
    let bad = |what: &str| EngineError::Unavailable(format!("{addr}: /server_info lacks {what}"));
    let name = v["model"].as_str().ok_or_else(|| bad("model"))?;
    let n = |k: &str| v[k].as_u64().map(|x| x as usize).ok_or_else(|| bad(k));
    let model = ModelConfig::by_name(name)?
        .with_index_topk(n("index_topk")?)?
        .with_layers(n("n_layers")?)?;
    let index_k = match v["index_k_dtype"].as_str() {
        Some("bf16") => IndexKDtype::Bf16,
        Some(s) if s.starts_with("fp8") => IndexKDtype::FP8,
        _ => return Err(bad("index_k_dtype")),
    };
    let kv_dtype = match v["kv_dtype"].as_str() {
        Some("bf16") => KvDtype::Bf16,
        Some(s) if s.starts_with("fp8") => KvDtype::Fp8DsMla,
        _ => return Err(bad("kv_dtype")),
    };
    let cache = &v["cache"];
    Ok(RemoteInfo {
        addr,
        backend: v["backend"].as_str().unwrap_or_default().to_string(),
        model,
        seed: v["seed"].as_u64().ok_or_else(|| bad("seed"))?,
        kv_dtype,
        key: ConfigKey {
            index_k,
            host_tier: host_pages(&v)? > 0,
            // A decode server (or a pair in one process) serves a PD-on configuration.
            pd: matches!(v["pd"]["role"].as_str(), Some("decode" | "both")),
            small_decode: false,
        },
        device_pages: n("kv_pages")?,
        faults: cache["faults"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|f| f.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
        verify: cache["verify"].as_bool().unwrap_or(true),
    })
}

/// Servers already running (`--url`): one deployment per server, whatever its config.
#[derive(Debug)]
pub struct UrlRunner {
    pub servers: Vec<RemoteInfo>,
}

struct UrlDeployment {
    target: HttpTarget,
}

impl Deployment for UrlDeployment {
    fn target(&self) -> &HttpTarget {
        &self.target
    }
    fn health_addrs(&self) -> Vec<SocketAddr> {
        vec![self.target.addr]
    }
    fn note(&self) -> Option<String> {
        Some(format!("running server {}", self.target.addr))
    }
    fn close(self: Box<Self>) -> Result<(), EngineError> {
        Ok(())
    }
}

impl ConfigRunner for UrlRunner {
    fn unavailable(&self, c: &ConfigKey) -> Option<String> {
        (!self.servers.iter().any(|s| s.key == *c)).then(|| "no --url server serves it".into())
    }

    fn start(&self, c: &ConfigKey, _plan: &RunPlan) -> Result<Box<dyn Deployment>, EngineError> {
        let s = self
            .servers
            .iter()
            .find(|s| s.key == *c)
            .ok_or_else(|| EngineError::Unavailable(format!("no --url server serves {c}")))?;
        Ok(Box::new(UrlDeployment {
            target: HttpTarget { addr: s.addr },
        }))
    }
}

/// What a deployment looked like once it went idle after a round.
#[derive(Clone, Debug, Default)]
pub struct IdleState {
    pub scrape: Scrape,
    pub leaked_pages: usize,
    pub quarantined_pages: usize,
    /// Whether it went idle (and ran its accounting check twice) within the bound.
    pub idle: bool,
}

/// The scrapes of several servers as one.
fn merged(each: Vec<Scrape>) -> Scrape {
    let mut s = Scrape::default();
    for one in each {
        s.merge(one);
    }
    s
}

/// Whether a server's scrape shows work in flight: requests in its engine, or PD
/// transfers not ended (their target pages are still pinned: quarantined while released).
fn busy(s: &Scrape) -> bool {
    s.value("sparsekit_requests_in_engine", &[]) + s.value("sparsekit_pd_transfers_in_flight", &[])
        > 0.0
}

/// Waits (bounded by `bound`) until every server of `d` is idle and each ran its
/// accounting check twice since the deployment was first seen idle, then reads leaked and
/// quarantined pages.
///
/// The checks are counted from the first scrape that finds *every* server idle, not from
/// the call: a server's engine runs its idle checks (and publishes its pools' page states)
/// while PD transfers are still in flight, and a transfer that ends afterwards unpins its
/// pages on another thread; the gauges the engine published before that still count them
/// as quarantined. Any sight of work in flight starts the count again. Two checks, not
/// one: the first counted may have published its numbers just before that scrape (an
/// idle check publishes, then counts itself); the second published after it.
pub fn wait_idle(d: &dyn Deployment, bound: Duration) -> IdleState {
    let started = Instant::now();
    // Each server's idle checks when the whole deployment was first seen idle.
    let mut since: Option<Vec<f64>> = None;
    loop {
        let each = d.scrape_each().unwrap_or_default();
        let checks: Vec<f64> = each
            .iter()
            .map(|s| s.value("sparsekit_idle_checks_total", &[]))
            .collect();
        let idle = if each.is_empty() || each.iter().any(busy) {
            since = None;
            false
        } else {
            match &since {
                Some(base) if base.len() == checks.len() => {
                    base.iter().zip(&checks).all(|(b, c)| *c >= b + 2.0)
                }
                _ => {
                    since = Some(checks);
                    false
                }
            }
        };
        if idle || started.elapsed() >= bound {
            let s = merged(each);
            return IdleState {
                leaked_pages: s.value("sparsekit_leaked_pages", &[]) as usize,
                quarantined_pages: s.value("sparsekit_quarantined_pages", &[]) as usize,
                scrape: s,
                idle,
            };
        }
        // Polling a server over HTTP; the engine's idle check runs every 50 ms.
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// One server's `/metrics` as the engine and the PD publisher write them.
    fn server(in_engine: u32, transfers: u32, checks: u32, device_q: u32, pd_q: u32) -> Scrape {
        Scrape::parse(&format!(
            "sparsekit_requests_in_engine {in_engine}\n\
             sparsekit_pd_transfers_in_flight {transfers}\n\
             sparsekit_idle_checks_total {checks}\n\
             sparsekit_leaked_pages 0\n\
             sparsekit_quarantined_pages{{pool=\"device\"}} {device_q}\n\
             sparsekit_quarantined_pages{{pool=\"pd\"}} {pd_q}\n"
        ))
    }

    /// A deployment whose servers' scrapes follow a script (the last one repeats).
    struct Scripted {
        target: HttpTarget,
        script: Vec<Vec<Scrape>>,
        next: Mutex<usize>,
    }

    impl Scripted {
        fn new(script: Vec<Vec<Scrape>>) -> Self {
            Scripted {
                target: HttpTarget {
                    addr: ([127, 0, 0, 1], 9).into(),
                },
                script,
                next: Mutex::new(0),
            }
        }

        fn scrapes_taken(&self) -> usize {
            *self.next.lock().unwrap()
        }
    }

    impl Deployment for Scripted {
        fn target(&self) -> &HttpTarget {
            &self.target
        }
        fn health_addrs(&self) -> Vec<SocketAddr> {
            vec![self.target.addr; self.script[0].len()]
        }
        fn scrape(&self) -> Result<Scrape, String> {
            Ok(merged(self.scrape_each()?))
        }
        fn scrape_each(&self) -> Result<Vec<Scrape>, String> {
            let mut i = self.next.lock().unwrap();
            let s = self.script[(*i).min(self.script.len() - 1)].clone();
            *i += 1;
            Ok(s)
        }
        fn close(self: Box<Self>) -> Result<(), EngineError> {
            Ok(())
        }
    }

    /// The PD pair after a round under `pd-read-before-landed`: the decode requests ended
    /// early, their transfers are still in flight (prefill still computing), and the idle
    /// decode engine keeps publishing its device pool with their pages quarantined. When
    /// the transfers end, the device gauge is stale until decode's next idle checks. The
    /// idle state must be read from checks made after that, not from checks counted since
    /// the call (which grew while the transfers were in flight).
    #[test]
    fn idle_is_read_from_checks_made_after_the_last_transfer_ended() {
        let (pages, q) = (171, 171);
        let d = Scripted::new(vec![
            // The call: prefill computing, decode's transfers in flight.
            vec![server(0, 2, 10, q, 0), server(1, 0, 10, 0, 0)],
            // Many idle checks later, still in flight (one transfer aborted: pd quarantine).
            vec![server(0, 2, 50, q, pages), server(1, 0, 40, 0, 0)],
            // The transfers ended (pins gone); decode's device gauge not republished yet.
            vec![server(0, 0, 50, q, 0), server(0, 0, 40, 0, 0)],
            // Decode's next check published before the transfers ended (stale).
            vec![server(0, 0, 51, q, 0), server(0, 0, 41, 0, 0)],
            // Work again: the count starts over.
            vec![server(0, 1, 52, 0, 0), server(0, 0, 42, 0, 0)],
            vec![server(0, 0, 53, 0, 0), server(0, 0, 43, 0, 0)],
            vec![server(0, 0, 54, 0, 0), server(0, 0, 44, 0, 0)],
            // Two checks on each server since the deployment was last seen idle.
            vec![server(0, 0, 55, 0, 0), server(0, 0, 45, 0, 0)],
        ]);
        let s = wait_idle(&d, Duration::from_secs(30));
        assert!(s.idle);
        assert_eq!((s.quarantined_pages, s.leaked_pages), (0, 0));
        assert_eq!(
            d.scrapes_taken(),
            8,
            "idle only at the last scripted scrape"
        );
    }

    /// Each server must have run two checks: one busy-free server checking fast does not
    /// stand for another that has not checked yet.
    #[test]
    fn every_server_must_check_twice() {
        let d = Scripted::new(vec![
            vec![server(0, 0, 5, 3, 0), server(0, 0, 5, 0, 0)],
            vec![server(0, 0, 5, 3, 0), server(0, 0, 9, 0, 0)],
            vec![server(0, 0, 6, 3, 0), server(0, 0, 12, 0, 0)],
            vec![server(0, 0, 7, 0, 0), server(0, 0, 13, 0, 0)],
        ]);
        let s = wait_idle(&d, Duration::from_secs(30));
        assert!(s.idle);
        assert_eq!(s.quarantined_pages, 0);
        assert_eq!(d.scrapes_taken(), 4);
    }

    /// A deployment that never goes idle is given up at the bound, and says so.
    #[test]
    fn a_deployment_that_stays_busy_is_not_idle_at_the_bound() {
        let d = Scripted::new(vec![vec![server(0, 1, 5, 7, 7)]]);
        let s = wait_idle(&d, Duration::from_millis(100));
        assert!(!s.idle);
        assert_eq!(s.quarantined_pages, 14);
    }
}
