//! The two PD nodes in two processes over NIXL (`serve --role prefill|decode --transport
//! nixl`): prefill listens for decode's control connection on its bootstrap port (shown
//! by its `/server_info` as `pd.bootstrap_port`); decode finds that port from prefill's
//! URL (`--peer`), connects, and reconnects the same way when the connection closes.
//! Page bytes then move as NIXL writes into decode's registered landing zone
//! ([`crate::transfer::nixl`]).
//!
//! Without the NIXL runtime every entry point here returns [`EngineError::Unavailable`]
//! saying how to install it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use serde_json::Value;
use sparsekit_host::Backend;

use crate::error::EngineError;
use crate::harness::deploy::parse_url;
use crate::pd::decode::Connector;
use crate::pd::prefill::PrefillNode;

/// Handshakes a prefill listener runs at once (each bounded by `io_timeout`).
pub const MAX_HANDSHAKES: usize = 8;

/// Prefill's PD address from its server URL: its `/server_info` must say it is a prefill
/// server on the NIXL transport; the address is the URL's host with its bootstrap port.
/// Bounded by `timeout`.
pub fn discover(url: &str, timeout: Duration) -> Result<SocketAddr, EngineError> {
    let http = parse_url(url)?;
    let body = crate::harness::deploy::get(http, "/server_info", timeout)
        .map_err(|e| EngineError::Unavailable(format!("prefill at {url}: {e}")))?;
    let v: Value = serde_json::from_str(&body)
        .map_err(|e| EngineError::Unavailable(format!("prefill at {url}: /server_info: {e}")))?;
    let pd = &v["pd"];
    if pd["role"].as_str() != Some("prefill") {
        return Err(EngineError::Unavailable(format!(
            "the server at {url} is not a prefill server (its /server_info has pd.role {})",
            pd["role"]
        )));
    }
    if pd["transport"].as_str() != Some("nixl") {
        return Err(EngineError::Unavailable(format!(
            "the prefill server at {url} does not serve the NIXL transport (pd.transport {})",
            pd["transport"]
        )));
    }
    let bp = pd["bootstrap_port"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| {
            EngineError::Unavailable(format!("prefill at {url}: no pd.bootstrap_port"))
        })?;
    let mut at = http;
    at.set_port(bp);
    Ok(at)
}

/// Accepts decode connections on prefill's bootstrap port and attaches each to the
/// prefill node (see the module docs). A handshake that fails (wrong role, other layouts,
/// garbage) is logged and dropped; the listener goes on. Stopped on drop.
#[derive(Debug)]
pub struct PrefillListener {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PrefillListener {
    /// Listens at `addr` (port 0: any free port; see [`PrefillListener::local_addr`]).
    pub fn start<B: Backend + 'static>(
        node: Arc<PrefillNode<B>>,
        addr: SocketAddr,
    ) -> Result<Self, EngineError> {
        use crate::pd::wire::Role;
        use crate::transfer::nixl::{NixlAgent, NixlListener, NixlOptions, NixlSide};

        let unavailable = |e: crate::transfer::TransferError| {
            EngineError::Unavailable(format!("NIXL prefill listener: {e}"))
        };
        let side = NixlSide {
            agent: NixlAgent::new(Role::Prefill).map_err(unavailable)?,
            hello: node.hello(),
            zone: None,
            opts: NixlOptions::default(),
        };
        let listener = Arc::new(NixlListener::bind(side, addr).map_err(unavailable)?);
        let addr = listener.local_addr().map_err(unavailable)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("sparsekit-pd-listener".into())
            .spawn(move || {
                // Each handshake on a thread of its own (bounded by the side's io_timeout):
                // a silent client delays no other decode. At most MAX_HANDSHAKES at once;
                // a connection beyond that is closed at once.
                let handshaking = Arc::new(AtomicUsize::new(0));
                while !s.load(Ordering::Acquire) {
                    let stream = match listener.accept_stream(Duration::from_millis(200)) {
                        Ok(stream) => stream,
                        Err(crate::transfer::TransferError::Timeout(_)) => continue,
                        Err(e) => {
                            tracing::warn!("PD: a connection attempt failed: {e}");
                            continue;
                        }
                    };
                    if handshaking.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                        handshaking.fetch_sub(1, Ordering::AcqRel);
                        tracing::warn!(
                            "PD: {MAX_HANDSHAKES} handshakes in flight; closing a new connection"
                        );
                        continue;
                    }
                    let (l, node, count) = (listener.clone(), node.clone(), handshaking.clone());
                    let spawned = std::thread::Builder::new()
                        .name("sparsekit-pd-handshake".into())
                        .spawn(move || {
                            match l.handshake(stream) {
                                Ok(end) => match node.attach(end) {
                                    Ok(()) => tracing::info!("PD: decode connected"),
                                    Err(e) => {
                                        tracing::warn!("PD: refused a decode connection: {e}")
                                    }
                                },
                                Err(e) => tracing::warn!("PD: a handshake failed: {e}"),
                            }
                            count.fetch_sub(1, Ordering::AcqRel);
                        });
                    if let Err(e) = spawned {
                        handshaking.fetch_sub(1, Ordering::AcqRel);
                        tracing::warn!("PD: cannot start a handshake thread: {e}");
                    }
                }
            })
            .map_err(|e| EngineError::Unavailable(format!("PD listener thread: {e}")))?;
        Ok(PrefillListener {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Where decode connects.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for PrefillListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Decode's [`Connector`] to the prefill server at `peer_url`: each call finds prefill's
/// bootstrap port (a restarted prefill may have another) and opens a NIXL connection;
/// the landing zone is registered with decode's agent on the first call. Every step is
/// bounded (`io_timeout` each).
pub fn nixl_connector(peer_url: &str, io_timeout: Duration) -> Result<Connector, EngineError> {
    use crate::pd::error::PdError;
    use crate::pd::wire::Role;
    use crate::transfer::nixl::{self, NixlAgent, NixlOptions, NixlSide, RegisteredZone};
    use crate::transfer::{TransferError, Transport};
    use parking_lot::Mutex;

    parse_url(peer_url)?;
    let agent = NixlAgent::new(Role::Decode)
        .map_err(|e| EngineError::Unavailable(format!("NIXL decode agent: {e}")))?;
    let url = peer_url.to_string();
    let registered: Mutex<Option<RegisteredZone>> = Mutex::new(None);
    let opts = NixlOptions {
        io_timeout,
        ..Default::default()
    };
    Ok(Arc::new(move |zone, hello| {
        let zone = {
            let mut r = registered.lock();
            match &*r {
                Some(z) if Arc::ptr_eq(z.zone(), zone) => z.clone(),
                Some(_) => {
                    return Err(PdError::Invalid(
                        "one decode connector serves one landing zone".into(),
                    ))
                }
                None => {
                    let z = RegisteredZone::new(&agent, zone.clone())?;
                    *r = Some(z.clone());
                    z
                }
            }
        };
        let addr = discover(&url, io_timeout).map_err(|e| {
            let m = match e {
                EngineError::Unavailable(m) | EngineError::InvalidRequest(m) => m,
                e => e.to_string(),
            };
            PdError::Transfer(TransferError::Unavailable(m))
        })?;
        let side = NixlSide {
            agent: agent.clone(),
            hello: hello.clone(),
            zone: Some(zone),
            opts: opts.clone(),
        };
        let end: Arc<dyn Transport> = nixl::connect(&side, addr)?;
        Ok(end)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_urls_parse_or_are_refused() {
        assert_eq!(
            parse_url("http://127.0.0.1:30001").unwrap(),
            SocketAddr::from(([127, 0, 0, 1], 30001))
        );
        assert_eq!(parse_url("localhost:8/").unwrap().port(), 8);
        assert_eq!(
            parse_url("http://[::1]:9").unwrap(),
            "[::1]:9".parse::<SocketAddr>().unwrap()
        );
        for bad in [
            "https://x:1",
            "http://x",
            "http://x:1/path",
            "http://:1",
            "x:99999",
            "",
        ] {
            assert!(
                matches!(parse_url(bad), Err(EngineError::InvalidRequest(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn discovery_of_a_server_that_is_not_there_fails_in_time() {
        // A port nothing listens on (bound, then closed).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let t = std::time::Instant::now();
        let e = discover(&format!("http://127.0.0.1:{port}"), Duration::from_secs(2));
        assert!(matches!(e, Err(EngineError::Unavailable(_))), "{e:?}");
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}
