//! `sparsekit serve`: the engine behind the HTTP server, until SIGINT/SIGTERM.
//!
//! Start-up says what it does: a log line when the model has loaded (a large model takes
//! a while), then the address and what is served (for `--pd on`, each side's cache and
//! host tier). A port in use is an error that names the address.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use sparsekit::host::cache::Faults;
use sparsekit::host::model_ops::ModelOps;
use sparsekit::host::{Backend, CpuBackend, EmuBackend, IndexKDtype, KvDtype};
use sparsekit::validation::audit::ReferenceAudit;
use sparsekit_server::dsml::Dialect;
use sparsekit_server::engine::kernel_check::KernelCheckConfig;
use sparsekit_server::engine::tokenizer::END;
use sparsekit_server::engine::{CacheOptions, Engine, EngineOptions, ModelConfig};
use sparsekit_server::engine::{EngineInfo, PdInfo, ReplyScript};
use sparsekit_server::harness::config::{no_verify_faults, Injection};
use sparsekit_server::http::auth::{ApiKey, PublicRoutes};
use sparsekit_server::http::limits::{raise_fd_limit, ConnLimits};
use sparsekit_server::http::{serve_until_signal, ServerConfig};
use sparsekit_server::metrics::Metrics;
use sparsekit_server::pd::decode::{DecodeNode, PeerLink};
use sparsekit_server::pd::pair::PdPair;
use sparsekit_server::pd::prefill::PrefillNode;
use sparsekit_server::pd::remote::{nixl_connector, PrefillListener};
use sparsekit_server::pd::{Checks, PdFaults, PdOptions};
use sparsekit_server::transfer::IO_TIMEOUT;

use super::{CliError, BACKENDS};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Server role: `both` (one process; with `--pd on`, a prefill/decode pair inside it
    /// over the local transport), or one side of a pair in two processes over NIXL:
    /// `prefill` (listens for decode on `--pd-port`) or `decode` (`--peer` names the
    /// prefill server; clients send their requests here).
    #[arg(long, default_value = "both")]
    role: String,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 30000)]
    port: u16,
    /// Backend: cpu, emu or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Model config: tiny, dsv32, dsv4-tiny or dsv4 (DeepSeek-V4's attention: window,
    /// CSA and HCA layers, each pool its own page size).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Weight seed (with the model name it determines every weight).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Index-key dtype: fp8, bf16 or fp4 (fp4_e2m1: 68 B a key; index head dims that are
    /// multiples of 128).
    #[arg(long, default_value = "fp8")]
    index_k: String,
    /// KV dtype: bf16 or fp8_ds_mla (a V4 model stores them as bf16_512 and model1_fp8;
    /// those names are accepted too).
    #[arg(long, default_value = "bf16")]
    kv: String,
    /// Indexer top-k (the config's value when omitted).
    #[arg(long)]
    index_topk: Option<usize>,
    /// Pages of the device pool (each holds a page of tokens of every layer and kind).
    #[arg(long, alias = "kv-pages", default_value_t = 8192)]
    device_pages: usize,
    /// Prefix cache (radix reuse of prompt pages): on, or off for the reference space.
    #[arg(long, default_value = "on")]
    prefix_cache: String,
    /// Pages of the host tier when it is on (4 × the device pool when omitted).
    #[arg(long)]
    host_pages: Option<usize>,
    /// Frames of a DeepSeek-V4 cache's window pool (its KV rows), at most the device
    /// pages (one a page when omitted): decodes give back the rows their tokens left.
    #[arg(long)]
    window_pages: Option<usize>,
    /// Back committed pages up to the host tier at once: on or off.
    #[arg(long, default_value = "on")]
    write_through: String,
    /// Fault injection: re-creates one of the historical bugs the integrity harness must
    /// catch (`sparsekit repro --url ... --inject NAME`; the pd-* ones and
    /// stale-transfer-write need PD).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(Injection::ALL.map(|i| i.name())))]
    inject: Option<String>,
    /// Test injection: every reply is FILE's bytes (then end of turn) instead of sampled
    /// tokens — to test what clients make of given model output, such as DSML tool calls
    /// (a model with random weights never writes them). `/server_info` reports
    /// `scripted_replies: true`.
    #[arg(long, value_name = "FILE")]
    scripted_reply: Option<std::path::PathBuf>,
    /// Turn the integrity checks off (load checksums, landed stamps, written slots): for
    /// the harness's `--no-verify` only.
    #[arg(long)]
    no_verify: bool,
    /// Re-check one call in N of each DSA kernel (indexer, top-k, sparse attention)
    /// against the f64 references while serving, counted on `/metrics` as
    /// `sparsekit_kernel_checks_total{op,outcome}` (0: off). Each check downloads the
    /// call's inputs and outputs, KV pools included: keep N large on big pools.
    #[arg(long, default_value_t = 0)]
    kernel_check: u64,
    /// Decode connections a prefill server serves at once (--role prefill); more are
    /// refused with a clear error.
    #[arg(long, default_value_t = 16)]
    max_decode_connections: usize,
    /// Rows per engine step.
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Prompt tokens of one request per step.
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    /// Requests holding pages at once.
    #[arg(long, default_value_t = 128)]
    max_running: usize,
    /// Requests queued for admission at most (more are refused with 503).
    #[arg(long, default_value_t = 4096)]
    max_waiting: usize,
    /// Milliseconds a wait in the cache (a page's layer to land, a load) may take before
    /// the request fails.
    #[arg(long, default_value_t = 10_000)]
    cache_wait_ms: u64,
    /// CPU worker threads for the cpu backend (all cores when omitted).
    #[arg(long)]
    threads: Option<usize>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Seconds a request may run before it is aborted.
    #[arg(long, default_value_t = 600)]
    request_timeout_s: u64,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 10)]
    shutdown_grace_s: u64,
    /// API key every route but the public ones requires (`Authorization: Bearer KEY`);
    /// also read from SPARSEKIT_API_KEY when the flag is absent.
    #[arg(long)]
    api_key: Option<String>,
    /// Routes open without the API key: health, metrics, both (the default) or none.
    #[arg(long, default_value = "health,metrics")]
    public_routes: String,
    /// Model name clients must use (and `/v1/models` lists); the model's own by default.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Origins browsers may call from (CORS): `*` or a comma-separated list of
    /// scheme://host[:port]; none by default.
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// DSML dialect of tools and forced tool calls in the chat template: deepseek_v32
    /// (`function_calls`) or deepseek_v4 (`tool_calls`); replies in either are parsed.
    #[arg(long, default_value = "deepseek_v32")]
    tool_call_parser: String,
    /// Connections at most (idle ones are closed to make room; the open-files limit is
    /// raised to fit, or this lowered to it).
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Connections of one client address at most.
    #[arg(long, default_value_t = 1024)]
    max_connections_per_client: usize,
    /// Seconds a request's headers may take, and a keep-alive connection may sit idle.
    #[arg(long, default_value_t = 30)]
    header_timeout_s: u64,
    /// Seconds after which a connection ends its keep-alive.
    #[arg(long, default_value_t = 600)]
    max_connection_age_s: u64,
    /// The prefill server's URL, `http://host:port` (--role decode): decode reads its PD
    /// port from the prefill server's `/server_info` and connects (again whenever the
    /// connection closes).
    #[arg(long)]
    peer: Option<String>,
    /// Seconds decode waits at start for the prefill server to come up.
    #[arg(long, default_value_t = 60)]
    peer_wait_s: u64,
    /// Port prefill listens on for decode's PD connection (--role prefill; 0 picks a free
    /// one, shown by `/server_info` as `pd.bootstrap_port`).
    #[arg(long, default_value_t = 0)]
    pd_port: u16,
    /// Host cache tier (device pool ⇄ host mirror, layer-wise loads): on or off. On the
    /// prefill side of a pair (decode's prompt pages arrive by transfer).
    #[arg(long, default_value = "off")]
    host_tier: String,
    /// PD transport: local (in process, `--role both --pd on`) or nixl (`--role
    /// prefill|decode`, two processes; needs the NIXL runtime: `bash
    /// scripts/setup-nixl.sh`, found under .tools/nixl or through SPARSEKIT_NIXL_LIB).
    #[arg(long, default_value = "local")]
    transport: String,
    /// Prefill/decode disaggregation inside this process (`--role both`): on or off. With
    /// on, requests go to a decode engine whose prompt pages a prefill engine (prefix
    /// cache, host tier) computes and pushes over the local transport.
    #[arg(long, default_value = "off")]
    pd: String,
}

fn on_off(flag: &str, v: &str) -> Result<bool, CliError> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        v => Err(format!("--{flag} must be on or off, got {v:?}").into()),
    }
}

/// What this process serves.
#[derive(Clone, Debug)]
enum Mode {
    /// One engine.
    Single,
    /// A prefill/decode pair in this process (local transport).
    Pair,
    /// The prefill side, listening for decode at this address.
    Prefill(SocketAddr),
    /// The decode side of the prefill server at this URL.
    Decode(String),
}

pub fn run(args: Args) -> Result<ExitCode, CliError> {
    let pd_on = on_off("pd", &args.pd)?;
    let nixl = match args.transport.as_str() {
        "local" => false,
        "nixl" => true,
        v => return Err(format!("unknown transport {v:?} (local, nixl)").into()),
    };
    let mode = match (args.role.as_str(), &args.peer) {
        ("both", Some(_)) => {
            return Err("--peer is for --role decode (the prefill server's URL)".into())
        }
        ("both", None) if nixl => {
            return Err(
                "--transport nixl joins two processes: run one `serve --role prefill \
                 --transport nixl` and one `serve --role decode --transport nixl --peer URL` \
                 (--role both --pd on pairs the sides in process over the local transport)"
                    .into(),
            )
        }
        ("both", None) if pd_on => Mode::Pair,
        ("both", None) => Mode::Single,
        ("prefill" | "decode", _) if !nixl => {
            return Err(format!(
                "--role {} runs one side of a pair in its own process: it needs --transport nixl",
                args.role
            )
            .into())
        }
        ("prefill", Some(_)) => {
            return Err("--peer is for --role decode; prefill waits for decode on --pd-port".into())
        }
        ("prefill", None) => Mode::Prefill(
            format!("{}:{}", args.host, args.pd_port)
                .parse()
                .map_err(|e| format!("bad PD address {}:{}: {e}", args.host, args.pd_port))?,
        ),
        ("decode", Some(url)) => Mode::Decode(url.clone()),
        ("decode", None) => {
            return Err("--role decode needs --peer http://host:port (the prefill server)".into())
        }
        (r, _) => return Err(format!("unknown role {r:?} (prefill, decode, both)").into()),
    };
    if matches!(mode, Mode::Prefill(_) | Mode::Decode(_)) && args.pd == "on" {
        return Err("--pd on is for --role both; --role prefill|decode is PD already".into());
    }
    let pd = !matches!(mode, Mode::Single);
    let host_tier = on_off("host-tier", &args.host_tier)?;
    let prefix_cache = on_off("prefix-cache", &args.prefix_cache)?;
    let write_through = on_off("write-through", &args.write_through)?;
    if host_tier && !prefix_cache {
        return Err("--host-tier on needs --prefix-cache on".into());
    }
    let mut faults = Faults::none();
    let mut pd_faults = Vec::new();
    let mut kernel_fault = None;
    if let Some(name) = &args.inject {
        let i: Injection = name.parse()?;
        if i.needs_v4() && ModelConfig::by_name(&args.model)?.v4.is_none() {
            return Err(
                format!("--inject {name} needs a DeepSeek-V4 model (--model dsv4-tiny)").into(),
            );
        }
        if i.needs_pd() && !pd {
            return Err(
                format!("--inject {name} needs PD (--pd on, or --role prefill/decode)").into(),
            );
        }
        if i == Injection::StaleTransferWrite && matches!(mode, Mode::Prefill(_) | Mode::Decode(_))
        {
            return Err(format!(
                "--inject {name} needs both PD sides in one process (--role both --pd on): \
                 its decoy transfer is synchronised between them in process"
            )
            .into());
        }
        i.cache_faults().into_iter().for_each(|f| faults.insert(f));
        pd_faults.extend(i.pd_fault());
        kernel_fault = i.kernel_fault();
    }
    if pd && !prefix_cache {
        return Err("PD needs --prefix-cache on (the pages move between caches)".into());
    }
    if args.no_verify {
        no_verify_faults()
            .into_iter()
            .for_each(|f| faults.insert(f));
    }
    if !prefix_cache && (!faults.is_empty() || args.host_pages.is_some()) {
        return Err("--inject, --no-verify and --host-pages need --prefix-cache on".into());
    }
    let cache = prefix_cache.then(|| CacheOptions {
        host_pages: if host_tier {
            args.host_pages.unwrap_or(4 * args.device_pages)
        } else {
            0
        },
        window_pages: args.window_pages,
        write_through,
        verify: !args.no_verify,
        wait_timeout: Duration::from_millis(args.cache_wait_ms),
        faults,
        ..Default::default()
    });
    if matches!(mode, Mode::Decode(_)) && host_tier {
        return Err("--host-tier is prefill's (decode's prompt pages arrive by transfer)".into());
    }
    let index_k = match args.index_k.as_str() {
        "fp8" => IndexKDtype::FP8,
        "bf16" => IndexKDtype::Bf16,
        "fp4" | "fp4_e2m1" => IndexKDtype::Fp4E2m1,
        v => return Err(format!("--index-k must be fp8, bf16 or fp4, got {v:?}").into()),
    };
    let kv = match args.kv.as_str() {
        "bf16" => KvDtype::Bf16,
        "fp8_ds_mla" => KvDtype::Fp8DsMla,
        "bf16_512" => KvDtype::Bf16x512,
        "model1_fp8" => KvDtype::Model1Fp8,
        v => {
            return Err(
                format!("--kv must be bf16, fp8_ds_mla, bf16_512 or model1_fp8, got {v:?}").into(),
            )
        }
    };
    if let Some(name) = &args.inject {
        let i: Injection = name.parse()?;
        if i.needs_fp8_kv() && !matches!(kv, KvDtype::Fp8DsMla | KvDtype::Model1Fp8) {
            return Err(format!(
                "--inject {name} needs fp8 KV pages: --kv fp8_ds_mla (or model1_fp8)"
            )
            .into());
        }
    }
    let mut cfg = ModelConfig::by_name(&args.model)?;
    if let Some(k) = args.index_topk {
        cfg = cfg.with_index_topk(k)?;
    }
    let scripted_reply = match &args.scripted_reply {
        None => None,
        Some(path) => {
            let text = std::fs::read(path)
                .map_err(|e| format!("--scripted-reply {}: {e}", path.display()))?;
            let mut reply: Vec<u32> = text.into_iter().map(u32::from).collect();
            reply.push(END);
            let script: ReplyScript = Arc::new(move |_prompt: &[u32]| Some(reply.clone()));
            Some(script)
        }
    };
    let opts = EngineOptions {
        seed: args.seed,
        scripted_reply,
        kv_dtype: kv,
        index_k_dtype: index_k,
        kv_pages: args.device_pages,
        cache,
        max_batch_tokens: args.max_batch_tokens,
        prefill_chunk: args.prefill_chunk,
        max_running: args.max_running,
        max_waiting: args.max_waiting,
        role: "both".into(),
        kernel_check: (args.kernel_check > 0).then(|| KernelCheckConfig {
            audit: Arc::new(ReferenceAudit),
            every: args.kernel_check,
        }),
        kernel_fault,
        ..Default::default()
    };
    let pd = PdOptions {
        faults: PdFaults::with(&pd_faults),
        checks: if args.no_verify {
            Checks::none()
        } else {
            Checks::all()
        },
        workers: args.max_running.clamp(1, 16),
        // A transfer may wait for prefill as long as the request may take.
        timeout: Duration::from_secs(args.request_timeout_s),
        max_connections: args.max_decode_connections,
    };
    let setup = Setup {
        cfg,
        opts,
        pd,
        mode,
        peer_wait: Duration::from_secs(args.peer_wait_s),
        latency_limit: Duration::from_secs(args.request_timeout_s),
    };
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .map_err(|e| format!("bad address {}:{}: {e}", args.host, args.port))?;
    let server = server_config(&args)?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    match args.backend.as_str() {
        "cpu" => {
            let b = match args.threads {
                Some(t) => CpuBackend::with_threads(t)?,
                None => CpuBackend::new(),
            };
            serve_on(Arc::new(b), setup, addr, server)
        }
        "emu" => serve_on(Arc::new(EmuBackend::new()), setup, addr, server),
        "cuda" => {
            let b = sparsekit::cuda::CudaBackend::new(0)
                .map_err(|e| format!("cuda backend unavailable: {e}"))?;
            eprintln!("cuda device: {}", b.device());
            serve_on(Arc::new(b), setup, addr, server)
        }
        other => Err(format!("unknown backend {other:?} (available: {BACKENDS})").into()),
    }
}

/// Everything `serve_on` starts from.
struct Setup {
    cfg: ModelConfig,
    opts: EngineOptions,
    pd: PdOptions,
    mode: Mode,
    peer_wait: Duration,
    /// The request timeout (the latency histograms' buckets reach it).
    latency_limit: Duration,
}

/// What keeps the PD side(s) of this process up (dropped after the HTTP server stopped).
enum Running<B: Backend + 'static> {
    Single,
    Pair(PdPair<B>),
    Prefill(Arc<PrefillNode<B>>, PrefillListener),
    Decode(DecodeNode<B>),
}

impl<B: Backend + 'static> Running<B> {
    fn shutdown(self, grace: Duration) -> Result<(), CliError> {
        match self {
            Running::Single => {}
            Running::Pair(p) => p.shutdown(grace)?,
            Running::Prefill(node, listener) => {
                drop(listener);
                node.shutdown(grace)?;
            }
            Running::Decode(node) => node.shutdown(grace)?,
        }
        Ok(())
    }
}

/// What `start` started: the engine the HTTP server serves, the other PD side in this
/// process (its metrics and info are served too), what keeps the PD side(s) up, and a
/// line to print.
struct Started<B: Backend + 'static> {
    engine: Arc<Engine>,
    other_sides: Vec<Arc<Engine>>,
    running: Running<B>,
    note: Option<String>,
}

fn start<B: Backend + ModelOps + 'static>(
    backend: Arc<B>,
    setup: Setup,
) -> Result<Started<B>, CliError> {
    let Setup {
        cfg,
        opts,
        pd,
        mode,
        peer_wait,
        latency_limit,
    } = setup;
    let metrics = |role: &str| Arc::new(Metrics::with_latency_limit(role, latency_limit));
    let host_pages = opts.cache.as_ref().map_or(0, |c| c.host_pages);
    let decode_opts = |opts: &EngineOptions| {
        let mut d = EngineOptions {
            role: "decode".into(),
            ..opts.clone()
        };
        if let Some(c) = d.cache.as_mut() {
            c.host_pages = 0;
        }
        d
    };
    let prefill_opts = |opts: EngineOptions| EngineOptions {
        role: "prefill".into(),
        ..opts
    };
    Ok(match mode {
        Mode::Single => Started {
            engine: Arc::new(Engine::start(backend, cfg, opts, metrics("both"))?),
            other_sides: Vec::new(),
            running: Running::Single,
            note: None,
        },
        Mode::Pair => {
            let p = PdPair::start_local(
                backend,
                cfg,
                prefill_opts(opts.clone()),
                decode_opts(&opts),
                pd,
                metrics("prefill"),
                metrics("decode"),
            )?;
            let d = p.decode.clone();
            d.set_pd_info(PdInfo {
                role: "both".into(),
                transport: "local".into(),
                bootstrap_port: None,
                peer: None,
                prefill_host_pages: Some(host_pages),
            })?;
            let prefill = p.prefill.clone();
            Started {
                note: Some(format!(
                    "prefill/decode pair in this process (local transport): prefill {}; \
                     decode {} (its prompt pages arrive from prefill)",
                    describe_cache(prefill.info()),
                    describe_pool(d.info()),
                )),
                engine: d,
                other_sides: vec![prefill],
                running: Running::Pair(p),
            }
        }
        Mode::Prefill(pd_addr) => {
            let node = Arc::new(PrefillNode::start(
                backend,
                cfg,
                prefill_opts(opts),
                &pd,
                metrics("prefill"),
                None,
            )?);
            let listener = PrefillListener::start(node.clone(), pd_addr)?;
            let at = listener.local_addr();
            let e = node.engine.clone();
            e.set_pd_info(PdInfo {
                role: "prefill".into(),
                transport: "nixl".into(),
                bootstrap_port: Some(at.port()),
                peer: None,
                prefill_host_pages: Some(host_pages),
            })?;
            Started {
                engine: e,
                other_sides: Vec::new(),
                running: Running::Prefill(node, listener),
                note: Some(format!("PD prefill: waiting for decode (NIXL) on {at}")),
            }
        }
        Mode::Decode(url) => {
            let node = DecodeNode::start(
                backend,
                cfg,
                decode_opts(&opts),
                &pd,
                metrics("decode"),
                PeerLink {
                    connector: nixl_connector(&url, IO_TIMEOUT)?,
                    connect_wait: peer_wait,
                },
                None,
            )?;
            let e = node.engine.clone();
            e.set_pd_info(PdInfo {
                role: "decode".into(),
                transport: "nixl".into(),
                bootstrap_port: None,
                peer: Some(url.clone()),
                prefill_host_pages: None,
            })?;
            Started {
                engine: e,
                other_sides: Vec::new(),
                running: Running::Decode(node),
                note: Some(format!(
                    "PD decode: connected to the prefill server {url} (NIXL)"
                )),
            }
        }
    })
}

/// A pool's size and cache as the start line tells them.
fn describe_cache(info: &EngineInfo) -> String {
    let cache = match &info.cache {
        None => "no prefix cache".to_string(),
        Some(c) if c.host_pages > 0 => format!("prefix cache, host tier {} pages", c.host_pages),
        Some(_) => "prefix cache, no host tier".to_string(),
    };
    format!("{}, {cache}", describe_pool(info))
}

fn describe_pool(info: &EngineInfo) -> String {
    format!("{} device pages", info.kv_pages)
}

/// The HTTP server's settings from the command line (the API key from
/// `SPARSEKIT_API_KEY` when `--api-key` is absent).
fn server_config(args: &Args) -> Result<ServerConfig, CliError> {
    let key = match &args.api_key {
        Some(k) => Some(k.clone()),
        None => std::env::var("SPARSEKIT_API_KEY")
            .ok()
            .filter(|k| !k.is_empty()),
    };
    let api_key = key
        .map(ApiKey::new)
        .transpose()
        .map_err(|e| format!("--api-key: {e}"))?;
    let mut limits = ConnLimits {
        max_connections: args.max_connections,
        max_per_client: args.max_connections_per_client,
        header_timeout: Duration::from_secs(args.header_timeout_s),
        max_connection_age: Duration::from_secs(args.max_connection_age_s),
        ..Default::default()
    };
    if let Some(fds) = raise_fd_limit() {
        if fds < limits.descriptors_needed() {
            let fit = usize::try_from(fds)
                .unwrap_or(usize::MAX)
                .saturating_sub(limits.reserve + 64)
                .max(1);
            eprintln!(
                "sparsekit serve: the open-files limit is {fds}: at most {fit} connections \
                 (not {}; raise it with `ulimit -n`)",
                limits.max_connections
            );
            limits.max_connections = fit;
            limits.max_per_client = limits.max_per_client.min(fit);
        }
    }
    let cfg = ServerConfig {
        max_body_bytes: args.max_body_bytes,
        request_timeout: Duration::from_secs(args.request_timeout_s),
        shutdown_grace: Duration::from_secs(args.shutdown_grace_s),
        model_name: args.served_model_name.clone(),
        api_key,
        public_routes: PublicRoutes::parse(&args.public_routes)
            .map_err(|e| format!("--public-routes: {e}"))?,
        limits,
        allowed_origins: args.allowed_origins.clone(),
        tool_parser: Dialect::parse(&args.tool_call_parser)
            .map_err(|e| format!("--tool-call-parser: {e}"))?,
        ..Default::default()
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Binds `addr` before the model loads (a port in use fails at once, naming it).
fn listen(addr: SocketAddr) -> Result<std::net::TcpListener, CliError> {
    let l = std::net::TcpListener::bind(addr).map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
            " (another server is listening there: stop it or pick another --port)"
        } else {
            ""
        };
        format!("cannot listen on {addr}: {e}{hint}")
    })?;
    l.set_nonblocking(true)?;
    Ok(l)
}

fn serve_on<B: Backend + ModelOps + 'static>(
    backend: Arc<B>,
    setup: Setup,
    addr: SocketAddr,
    mut server: ServerConfig,
) -> Result<ExitCode, CliError> {
    let listener = listen(addr)?;
    let (model, backend_name) = (setup.cfg.name, backend.name().to_string());
    println!("sparsekit serve: loading model {model} on {backend_name}");
    let loading = std::time::Instant::now();
    let started = start(backend, setup)?;
    let loaded = format!(
        "model {model} loaded in {:.1} s ({backend_name})",
        loading.elapsed().as_secs_f64()
    );
    println!("sparsekit serve: {loaded}");
    let Started {
        engine,
        other_sides,
        running,
        note,
    } = started;
    server.other_sides = other_sides;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let local = listener.local_addr()?;
        let info = engine.info();
        let what = if server.other_sides.is_empty() {
            format!(", {}", describe_cache(info))
        } else {
            String::new()
        };
        if info.scripted_replies {
            println!("sparsekit serve: replies are scripted (--scripted-reply): not sampled from the model");
        }
        if let Some(n) = note {
            println!("sparsekit serve: {n}");
        }
        println!(
            "sparsekit serve: listening on http://{local} (model {}, backend {}, index-K {}, KV {}{what})",
            server.model_name.as_deref().unwrap_or(&info.model), info.backend, info.index_k_dtype, info.kv_dtype,
        );
        serve_until_signal(engine, listener, server).await
    })?;
    running.shutdown(Duration::from_secs(5))?;
    eprintln!("sparsekit serve: stopped");
    Ok(ExitCode::SUCCESS)
}
