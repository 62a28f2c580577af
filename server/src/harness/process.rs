//! PD-on configurations served by two `sparsekit serve` processes joined by NIXL over
//! loopback (`repro --transport nixl`): a prefill process (`--role prefill`, its prefix
//! cache and host tier as the configuration says) and a decode process (`--role decode
//! --peer` the prefill server) that the sessions talk to. Both are started with the
//! settings the in-process pair gets from the [`RunPlan`] (pool sizes, faults, checks,
//! deadlines), their `/health` probed and `/metrics` merged like any deployment; stopped
//! with SIGTERM (killed if they do not exit in time) when the configuration is done.
//!
//! Each server's output goes to a log file next to the harness's other files (named in
//! errors, with its last lines, when a server does not come up or dies).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::EngineError;
use crate::harness::config::{index_k_name, ConfigKey, Injection};
use crate::harness::deploy::{parse_url, ConfigRunner, Deployment, RunPlan};
use crate::harness::run::HttpTarget;

/// How long a server may take to print its address (model weights, NIXL agent, the
/// decode side's connection to prefill).
const START_BOUND: Duration = Duration::from_secs(120);

/// How long a server may take to exit after SIGTERM before it is killed.
const STOP_BOUND: Duration = Duration::from_secs(20);

/// Starts PD-on configurations as two server processes (see the module docs).
#[derive(Clone, Debug)]
pub struct ProcessRunner {
    /// The `sparsekit` binary.
    pub exe: PathBuf,
    /// Environment added for the servers (`SPARSEKIT_NIXL_LIB`: where the NIXL runtime is).
    pub env: Vec<(String, String)>,
    /// The servers' backend (`cpu`, `emu`, `cuda`): the reference's.
    pub backend: String,
    /// Where the servers' logs go.
    pub log_dir: PathBuf,
}

/// One `serve` process.
#[derive(Debug)]
struct Server {
    name: String,
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Server {
    /// Asks the server to stop (SIGTERM), waits up to [`STOP_BOUND`], kills it after that.
    /// `Err` when it had to be killed or exited with a failure.
    fn stop(mut self) -> Result<(), String> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Err(format!(
                "{} had already exited ({st}); log {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log)
            ));
        }
        terminate(&self.child);
        let until = Instant::now() + STOP_BOUND;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => return Ok(()),
                Ok(Some(st)) => {
                    return Err(format!(
                        "{} exited with {st}; log {}:\n{}",
                        self.name,
                        self.log.display(),
                        tail(&self.log)
                    ))
                }
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!(
                        "{} did not stop within {STOP_BOUND:?} of SIGTERM (killed)",
                        self.name
                    ));
                }
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Only reached without `stop` (a panic, a failed start): never leave it running.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sends SIGTERM to `child` (the server's graceful shutdown).
fn terminate(child: &Child) {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        return;
    };
    // SAFETY: `kill` takes a pid and a signal number and touches no memory of ours; the
    // pid is our child's, not yet reaped (we hold its `Child` and have not waited on it
    // successfully), so it cannot name another process.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
}

/// The last lines of a log, for error messages.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

impl ProcessRunner {
    /// The `serve` arguments both sides share under `plan` for configuration `c`.
    fn common_args(&self, c: &ConfigKey, plan: &RunPlan) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "serve".into(),
            "--transport".into(),
            "nixl".into(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            "0".into(),
            "--backend".into(),
            self.backend.clone(),
            "--model".into(),
            plan.model.name.into(),
            "--index-topk".into(),
            plan.model.index_topk.to_string(),
            "--seed".into(),
            plan.seed.to_string(),
            "--index-k".into(),
            index_k_name(c.index_k).into(),
            "--kv".into(),
            plan.kv_dtype.name().into(),
            "--max-running".into(),
            plan.max_running.max(1).to_string(),
            "--max-waiting".into(),
            "4096".into(),
            "--cache-wait-ms".into(),
            plan.cache_wait.as_millis().to_string(),
            "--request-timeout-s".into(),
            plan.deadline.as_secs().max(1).to_string(),
        ];
        if let Some(i) = plan.injection {
            a.extend(["--inject".into(), i.name().into()]);
        }
        if !plan.verify {
            a.push("--no-verify".into());
        }
        if plan.kernel_checks_on() {
            a.extend(["--kernel-check".into(), plan.kernel_check_every.to_string()]);
        }
        a
    }

    /// Starts one server and waits (bounded) for the address it prints.
    fn spawn(&self, name: &str, args: &[String]) -> Result<Server, EngineError> {
        let log = self.log_dir.join(format!("{name}.log"));
        let unavailable = |m: String| EngineError::Unavailable(format!("{name}: {m}"));
        let file = File::create(&log)
            .map_err(|e| unavailable(format!("cannot create {}: {e}", log.display())))?;
        let err = file
            .try_clone()
            .map_err(|e| unavailable(format!("log file: {e}")))?;
        let mut child = Command::new(&self.exe)
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err))
            .spawn()
            .map_err(|e| unavailable(format!("cannot run {}: {e}", self.exe.display())))?;
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(unavailable("no stdout".into()));
        };
        // Copies the server's stdout into its log, and hands the address line over.
        let (tx, rx) = flume::bounded::<String>(1);
        let mut copy = file;
        std::thread::Builder::new()
            .name(format!("sparsekit-repro-{name}-out"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { return };
                    let _ = writeln!(copy, "{line}");
                    if let Some(at) = line.split("listening on ").nth(1) {
                        let url = at.split_whitespace().next().unwrap_or_default();
                        let _ = tx.try_send(url.to_string());
                    }
                }
            })
            .map_err(|e| unavailable(format!("output thread: {e}")))?;
        let mut server = Server {
            name: name.to_string(),
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            log: log.clone(),
        };
        let until = Instant::now() + START_BOUND;
        let url = loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(url) => break url,
                Err(flume::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(st)) = server.child.try_wait() {
                        return Err(unavailable(format!(
                            "exited ({st}) before serving; log {}:\n{}",
                            log.display(),
                            tail(&log)
                        )));
                    }
                    if Instant::now() >= until {
                        return Err(unavailable(format!(
                            "not serving within {START_BOUND:?}; log {}:\n{}",
                            log.display(),
                            tail(&log)
                        )));
                    }
                }
                Err(flume::RecvTimeoutError::Disconnected) => {
                    // Its stdout closed: it is exiting.
                    let _ = server.child.wait();
                    return Err(unavailable(format!(
                        "stopped before serving; log {}:\n{}",
                        log.display(),
                        tail(&log)
                    )));
                }
            }
        };
        server.addr = parse_url(&url)?;
        Ok(server)
    }
}

/// A prefill and a decode process (see the module docs).
#[derive(Debug)]
struct ProcessDeployment {
    // Drop order: decode first.
    decode: Option<Server>,
    prefill: Option<Server>,
    target: HttpTarget,
    prefill_addr: SocketAddr,
}

impl Deployment for ProcessDeployment {
    fn target(&self) -> &HttpTarget {
        &self.target
    }
    fn health_addrs(&self) -> Vec<SocketAddr> {
        vec![self.target.addr, self.prefill_addr]
    }
    fn note(&self) -> Option<String> {
        Some("prefill and decode as two processes, NIXL over loopback".into())
    }
    fn close(mut self: Box<Self>) -> Result<(), EngineError> {
        let d = self.decode.take().map_or(Ok(()), Server::stop);
        let p = self.prefill.take().map_or(Ok(()), Server::stop);
        match (d, p) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(a), Err(b)) => Err(EngineError::Unavailable(format!("{a}\n{b}"))),
            (Err(e), _) | (_, Err(e)) => Err(EngineError::Unavailable(e)),
        }
    }
}

impl ConfigRunner for ProcessRunner {
    fn unavailable(&self, c: &ConfigKey) -> Option<String> {
        (!c.pd).then(|| "PD off: served in this process".into())
    }

    fn start(&self, c: &ConfigKey, plan: &RunPlan) -> Result<Box<dyn Deployment>, EngineError> {
        if plan.injection == Some(Injection::StaleTransferWrite) {
            return Err(EngineError::InvalidConfig(
                "stale-transfer-write needs both PD sides in one process (its decoy \
                 transfer is synchronised in process): run it with --transport local"
                    .into(),
            ));
        }
        let name = c.name().replace('/', "-");
        let mut p = self.common_args(c, plan);
        p.extend([
            "--role".into(),
            "prefill".into(),
            "--device-pages".into(),
            plan.sizing.device_pages.to_string(),
            "--host-tier".into(),
            if c.host_tier { "on" } else { "off" }.into(),
            "--host-pages".into(),
            plan.sizing.host_pages.to_string(),
        ]);
        let prefill = self.spawn(&format!("{name}-prefill"), &p)?;
        let mut d = self.common_args(c, plan);
        d.extend([
            "--role".into(),
            "decode".into(),
            "--peer".into(),
            format!("http://{}", prefill.addr),
            "--device-pages".into(),
            if c.small_decode {
                plan.sizing.small_decode_pages
            } else {
                plan.sizing.decode_pages.max(plan.sizing.device_pages)
            }
            .to_string(),
        ]);
        let decode = self.spawn(&format!("{name}-decode"), &d)?;
        Ok(Box::new(ProcessDeployment {
            target: HttpTarget { addr: decode.addr },
            prefill_addr: prefill.addr,
            decode: Some(decode),
            prefill: Some(prefill),
        }))
    }
}
