//! Who serves a configuration during a harness run: a [`ConfigRunner`] starts a
//! [`Deployment`] (one server, or a prefill/decode pair) for a [`ConfigKey`] and a
//! [`RunPlan`]; the harness sends its sessions to the deployment's [`Target`], probes its
//! `/health`, and reads its `/metrics` — the same for servers in this process and servers
//! running elsewhere (`--url`).
//!
//! [`LocalRunner`] serves the PD-off configurations in this process (the engine over the
//! cache-backed KV space behind the HTTP server); [`UrlRunner`] points at running servers.
//! The PD runner plugs in beside them for the PD-on rows.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use sparsekit_host::cache::Faults;
use sparsekit_host::{Backend, IndexKDtype, KvDtype, ModelOps};

use crate::engine::scheduler::{CacheOptions, Engine, EngineOptions};
use crate::engine::ModelConfig;
use crate::error::EngineError;
use crate::harness::config::{no_verify_faults, ConfigKey, Injection};
use crate::harness::run::{http_exchange, HttpTarget};
use crate::harness::scrape::Scrape;
use crate::metrics::Metrics;
use crate::pd::pair::PdPair;
use crate::pd::{Checks, PdFaults, PdOptions};

/// Pool sizes of a run (pages of `page_size` tokens of every layer and kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizing {
    /// The device pool: about a quarter of the workload's working set.
    pub device_pages: usize,
    /// The host tier (when on): the whole working set.
    pub host_pages: usize,
    /// A PD decode side's pool (no prefix reuse: room for the requests it runs at once).
    pub decode_pages: usize,
}

/// Everything a runner needs besides the configuration.
#[derive(Clone, Debug)]
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
}

impl RunPlan {
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
        let decode = EngineOptions {
            role: "decode".into(),
            kv_pages: self.sizing.decode_pages.max(self.sizing.device_pages),
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
    fn scrape(&self) -> Result<Scrape, String>;
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
    fn scrape(&self) -> Result<Scrape, String> {
        get(self.target.addr, "/metrics", Duration::from_secs(10)).map(|t| Scrape::parse(&t))
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
    fn scrape(&self) -> Result<Scrape, String> {
        let mut s = Scrape::default();
        for a in self.health_addrs() {
            s.merge(get(a, "/metrics", Duration::from_secs(10)).map(|t| Scrape::parse(&t))?);
        }
        Ok(s)
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
            "--url takes http://host:port, got {url:?}"
        )));
    }
    hostport
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| EngineError::InvalidRequest(format!("cannot resolve {url:?}")))
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
            host_tier: cache["host_pages"].as_u64().unwrap_or(0) > 0,
            pd: false,
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
    fn scrape(&self) -> Result<Scrape, String> {
        get(self.target.addr, "/metrics", Duration::from_secs(10)).map(|t| Scrape::parse(&t))
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

/// Waits (bounded by `bound`) until every server of `d` is idle and ran its accounting
/// check twice since the call, then reads leaked and quarantined pages.
pub fn wait_idle(d: &dyn Deployment, bound: Duration) -> IdleState {
    let started = Instant::now();
    let first = d.scrape().unwrap_or_default();
    let checks0 = first.value("sparsekit_idle_checks_total", &[]);
    let servers = d.health_addrs().len().max(1) as f64;
    loop {
        let s = d.scrape().unwrap_or_default();
        let busy = s.value("sparsekit_requests_in_engine", &[])
            + s.value("sparsekit_pd_transfers_in_flight", &[]);
        let checks = s.value("sparsekit_idle_checks_total", &[]);
        let idle = busy == 0.0 && checks >= checks0 + 2.0 * servers;
        if idle || started.elapsed() >= bound {
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
