//! The NIXL transport (cargo feature `nixl`): prefill and decode in two processes (or
//! machines). Page bytes move as NIXL one-sided writes (UCX backend) from prefill's
//! registered staging memory into decode's registered landing zone; each write carries its
//! PD `Written` frame as the NIXL notification message, delivered only after the bytes
//! landed. Control frames (handshake, bootstrap, abort, finished, cancelled) travel over one
//! TCP connection, whose end — a peer that closed or died — tears the PD connection down on
//! both sides.
//!
//! Setup, following the sequence that works on these machines (`DESIGN.md`):
//! `nixl_sys::is_stub()` first (without the runtime any NIXL call aborts the process:
//! [`check_runtime`] turns that into a typed error) → `Agent::new_configured` → UCX plugin
//! parameters with `ucx_error_handling_mode=none` (needed for the shared-memory transports)
//! → `create_backend` → `register_memory` (decode: the landing zone; prefill: its staging
//! memory) → the handshake over TCP carries each side's `get_local_md()` (and decode's
//! landing zone address) in `Hello::transport` → `load_remote_md`. A write builds two
//! descriptor lists (local staging ranges, remote landing ranges — offsets from the layout
//! descriptors, computed by the PD sender), `create_xfer_req(Write, …, notification)`,
//! `post_xfer_req`, then polls `get_xfer_status` until done or the bound. Decode polls
//! `get_notifications` on its own thread (the agents run without NIXL's progress thread:
//! polling progresses them). Metadata goes over our TCP connection, so NIXL's listener
//! thread is not used.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::pd::landing::LandingZone;
use crate::pd::wire::{decode_frame, FrameReader, Hello, Message, Role};
use crate::transfer::{Segment, TransferError, Transport, IO_TIMEOUT};

pub use crate::transfer::NIXL_LIB_ENV as LIB_ENV;

mod capi;

/// Whether the NIXL runtime can be used in this process: its C API library is found and
/// opened on the first call (see the `capi` module); without it this says how to install it.
pub fn check_runtime() -> Result<(), TransferError> {
    capi::api().map(|_| ()).map_err(TransferError::Unavailable)
}

fn nixl_err(what: &str, e: capi::CallError) -> TransferError {
    TransferError::Failed(format!("NIXL {what}: {e}"))
}

/// Control frames and notifications an end holds unread at most; past it the readers
/// wait (the peer's TCP sends back up), re-checking every 100 ms whether the end closed.
const INBOX_FRAMES: usize = 4096;

/// Puts `frame` into the inbox, waiting for room while the connection is open. `false`
/// when it cannot be delivered (closed, or nobody reads any more).
fn forward(tx: &flume::Sender<Vec<u8>>, mut frame: Vec<u8>, link: &Link) -> bool {
    loop {
        match tx.send_timeout(frame, Duration::from_millis(100)) {
            Ok(()) => return true,
            Err(flume::SendTimeoutError::Timeout(f)) => {
                if link.is_closed() {
                    return false;
                }
                frame = f;
            }
            Err(flume::SendTimeoutError::Disconnected(_)) => return false,
        }
    }
}

/// Settings of NIXL connections.
#[derive(Clone, Debug)]
pub struct NixlOptions {
    /// Bound of one write, one control send, and the handshake.
    pub io_timeout: Duration,
    /// How often decode polls NIXL for notifications when none came.
    pub poll: Duration,
}

impl Default for NixlOptions {
    fn default() -> Self {
        NixlOptions {
            io_timeout: IO_TIMEOUT,
            poll: Duration::from_micros(500),
        }
    }
}

/// A NIXL agent with its UCX backend. Creating one costs ~250 ms; one per process serves
/// every connection of that process. Each NIXL call locks the agent for that call only
/// (a transfer's polling loop takes it per poll), so a slow peer does not stall the
/// others.
#[derive(Debug)]
pub struct NixlAgent {
    name: String,
    agent: Mutex<capi::Agent>,
}

static NEXT_AGENT: AtomicU64 = AtomicU64::new(1);

impl NixlAgent {
    /// A fresh agent named after `role`, this process and a counter.
    pub fn new(role: Role) -> Result<Arc<Self>, TransferError> {
        let api = capi::api().map_err(TransferError::Unavailable)?;
        let name = format!(
            "sparsekit-{}-{}-{}",
            role.name(),
            std::process::id(),
            NEXT_AGENT.fetch_add(1, Ordering::Relaxed)
        );
        // `ucx_error_handling_mode=none` is needed for UCX's shared-memory transports.
        let agent = capi::Agent::with_ucx(api, &name, &[("ucx_error_handling_mode", "none")])
            .map_err(|e| nixl_err("agent with a UCX backend", e))?;
        Ok(Arc::new(NixlAgent {
            name,
            agent: Mutex::new(agent),
        }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers `len` bytes at `addr` (host memory) with the agent; deregistered when
    /// the returned value drops.
    ///
    /// # Safety
    /// The memory must stay allocated until the returned registration is dropped.
    unsafe fn register(
        self: &Arc<Self>,
        addr: usize,
        len: usize,
    ) -> Result<Registration, TransferError> {
        // SAFETY: forwarded: the caller keeps the memory until the registration drops,
        // and `Registration::drop` deregisters exactly this range.
        unsafe { self.agent.lock().register(addr, len) }
            .map_err(|e| nixl_err("memory registration", e))?;
        Ok(Registration {
            agent: self.clone(),
            addr,
            len,
        })
    }

    fn local_md(&self) -> Result<Vec<u8>, TransferError> {
        self.agent
            .lock()
            .local_md()
            .map_err(|e| nixl_err("local metadata", e))
    }

    fn load_md(&self, md: &[u8]) -> Result<String, TransferError> {
        self.agent
            .lock()
            .load_remote_md(md)
            .map_err(|e| nixl_err("remote metadata", e))
    }

    fn forget(&self, peer: &str) {
        self.agent.lock().forget(peer);
    }
}

/// Host memory registered with an agent; deregistered on drop.
#[derive(Debug)]
struct Registration {
    agent: Arc<NixlAgent>,
    addr: usize,
    len: usize,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Err(e) = self.agent.agent.lock().deregister(self.addr, self.len) {
            tracing::warn!("NIXL: {e}");
        }
    }
}

/// What `Hello::transport` carries for NIXL: the agent's metadata and, from decode, the
/// landing zone's address and length.
fn encode_blob(md: &[u8], zone: Option<(usize, usize)>) -> Vec<u8> {
    let mut v = Vec::with_capacity(md.len() + 21);
    v.extend_from_slice(&(md.len() as u32).to_le_bytes());
    v.extend_from_slice(md);
    match zone {
        Some((a, l)) => {
            v.push(1);
            v.extend_from_slice(&(a as u64).to_le_bytes());
            v.extend_from_slice(&(l as u64).to_le_bytes());
        }
        None => v.push(0),
    }
    v
}

/// A peer's NIXL handshake data: its agent metadata, and decode's landing zone
/// `(address, length)`.
type Blob = (Vec<u8>, Option<(u64, u64)>);

fn decode_blob(b: &[u8]) -> Result<Blob, TransferError> {
    let bad = || TransferError::Failed("malformed NIXL handshake data".into());
    let n = u32::from_le_bytes(b.get(..4).ok_or_else(bad)?.try_into().map_err(|_| bad())?) as usize;
    let md = b.get(4..4 + n).ok_or_else(bad)?.to_vec();
    let rest = &b[4 + n..];
    match rest.first() {
        Some(0) if rest.len() == 1 => Ok((md, None)),
        Some(1) if rest.len() == 17 => {
            let a = u64::from_le_bytes(rest[1..9].try_into().map_err(|_| bad())?);
            let l = u64::from_le_bytes(rest[9..17].try_into().map_err(|_| bad())?);
            Ok((md, Some((a, l))))
        }
        _ => Err(bad()),
    }
}

/// Prefill's registered source memory for writes (grown on demand).
#[derive(Debug)]
struct Staging {
    // Field order: deregister before the memory is freed.
    reg: Option<Registration>,
    mem: Vec<u8>,
}

/// The memory a decode endpoint receives into: its landing zone, registered with the
/// agent. Built once; every connection of that decode endpoint shares it.
#[derive(Debug, Clone)]
pub struct RegisteredZone {
    // Field order: deregister before the zone can be freed.
    _reg: Arc<Registration>,
    zone: Arc<LandingZone>,
}

impl RegisteredZone {
    /// Registers `zone` with `agent`.
    pub fn new(agent: &Arc<NixlAgent>, zone: Arc<LandingZone>) -> Result<Self, TransferError> {
        let (a, l) = zone.raw_parts();
        // SAFETY: the zone outlives the registration: both are held together here (and by
        // every end using it), the registration declared first so it drops first.
        let reg = Arc::new(unsafe { agent.register(a, l)? });
        Ok(RegisteredZone { _reg: reg, zone })
    }

    pub fn zone(&self) -> &Arc<LandingZone> {
        &self.zone
    }
}

/// One side's part of a connection: its agent, its handshake, and (decode) its zone.
#[derive(Debug, Clone)]
pub struct NixlSide {
    pub agent: Arc<NixlAgent>,
    /// The handshake this side announces (its transport data is filled in here).
    pub hello: Hello,
    /// Decode's registered landing zone (`None` for prefill).
    pub zone: Option<RegisteredZone>,
    pub opts: NixlOptions,
}

impl NixlSide {
    fn check(&self) -> Result<(), TransferError> {
        match (self.hello.role, &self.zone) {
            (Role::Decode, None) => Err(TransferError::Failed(
                "a decode endpoint needs a registered landing zone".into(),
            )),
            (Role::Prefill, Some(_)) => Err(TransferError::Failed(
                "a prefill endpoint has no landing zone".into(),
            )),
            _ => Ok(()),
        }
    }

    fn my_hello(&self) -> Result<Vec<u8>, TransferError> {
        let mut h = self.hello.clone();
        h.transport = encode_blob(
            &self.agent.local_md()?,
            self.zone.as_ref().map(|z| z.zone.raw_parts()),
        );
        Message::Hello(h).encode().map_err(wire_err)
    }

    fn peer_role(&self) -> Role {
        match self.hello.role {
            Role::Decode => Role::Prefill,
            Role::Prefill => Role::Decode,
        }
    }

    /// After the handshakes: loads the peer's metadata and starts the end.
    fn finish(
        &self,
        stream: TcpStream,
        reader: FrameReader,
        peer: Hello,
    ) -> Result<Arc<NixlEnd>, TransferError> {
        let (md, zone) = decode_blob(&peer.transport)?;
        let remote_zone =
            match self.hello.role {
                Role::Prefill => Some(zone.ok_or_else(|| {
                    TransferError::Failed("decode announced no landing zone".into())
                })?),
                Role::Decode => None,
            };
        let peer_agent = self.agent.load_md(&md)?;
        NixlEnd::start(
            self.hello.role,
            peer,
            peer_agent,
            stream,
            reader,
            self.agent.clone(),
            self.zone.clone(),
            remote_zone,
            self.opts.clone(),
        )
    }
}

/// Listens for PD connections (either role may listen; the connector speaks first).
#[derive(Debug)]
pub struct NixlListener {
    tcp: TcpListener,
    side: NixlSide,
}

impl NixlListener {
    pub fn bind(side: NixlSide, addr: SocketAddr) -> Result<Self, TransferError> {
        side.check()?;
        let tcp = TcpListener::bind(addr)
            .map_err(|e| TransferError::Failed(format!("cannot listen on {addr}: {e}")))?;
        Ok(NixlListener { tcp, side })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, TransferError> {
        self.tcp
            .local_addr()
            .map_err(|e| TransferError::Failed(e.to_string()))
    }

    /// Accepts one connection (waits at most `timeout` for it) and completes the
    /// handshake (bounded by the side's `io_timeout` from the moment it was accepted).
    /// `Timeout` only when no connection came.
    pub fn accept(&self, timeout: Duration) -> Result<Arc<NixlEnd>, TransferError> {
        let stream = self.accept_stream(timeout)?;
        self.handshake(stream)
    }

    /// Accepts one TCP connection, waiting at most `timeout` (`Timeout` when none came);
    /// its handshake is [`NixlListener::handshake`]'s — run it on a thread of its own so
    /// that a silent client delays nobody else.
    pub fn accept_stream(&self, timeout: Duration) -> Result<TcpStream, TransferError> {
        let deadline = crate::deadline_after(timeout);
        self.tcp
            .set_nonblocking(true)
            .map_err(|e| TransferError::Failed(e.to_string()))?;
        loop {
            match self.tcp.accept() {
                Ok((s, _)) => return Ok(s),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(TransferError::Timeout(format!(
                            "no PD connection within {timeout:?}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(TransferError::Failed(format!("accept: {e}"))),
            }
        }
    }

    /// Completes the handshake of an accepted connection, bounded by the side's
    /// `io_timeout` (a timeout is reported as a failed handshake, never as "no
    /// connection").
    pub fn handshake(&self, stream: TcpStream) -> Result<Arc<NixlEnd>, TransferError> {
        stream
            .set_nonblocking(false)
            .map_err(|e| TransferError::Failed(e.to_string()))?;
        let side = &self.side;
        let mut reader = FrameReader::new();
        let handshake = crate::deadline_after(side.opts.io_timeout);
        let peer =
            read_hello(&stream, &mut reader, side.peer_role(), handshake).map_err(|e| match e {
                // Not "no connection came": the caller must not take it for that.
                TransferError::Timeout(m) => TransferError::Failed(format!("handshake: {m}")),
                e => e,
            })?;
        write_frame(&stream, &side.my_hello()?, side.opts.io_timeout)?;
        side.finish(stream, reader, peer)
    }
}

/// Connects to the peer listening at `addr` and completes the handshake (bounded by
/// `side.opts.io_timeout`).
pub fn connect(side: &NixlSide, addr: SocketAddr) -> Result<Arc<NixlEnd>, TransferError> {
    side.check()?;
    let deadline = crate::deadline_after(side.opts.io_timeout);
    let stream = TcpStream::connect_timeout(&addr, side.opts.io_timeout)
        .map_err(|e| TransferError::Failed(format!("cannot connect to the peer at {addr}: {e}")))?;
    write_frame(&stream, &side.my_hello()?, side.opts.io_timeout)?;
    let mut reader = FrameReader::new();
    let peer = read_hello(&stream, &mut reader, side.peer_role(), deadline)?;
    side.finish(stream, reader, peer)
}

fn wire_err(e: crate::pd::wire::WireError) -> TransferError {
    TransferError::Failed(format!("handshake: {e}"))
}

fn write_frame(mut s: &TcpStream, frame: &[u8], timeout: Duration) -> Result<(), TransferError> {
    s.set_write_timeout(Some(timeout))
        .map_err(|e| TransferError::Failed(e.to_string()))?;
    s.write_all(frame)
        .map_err(|e| TransferError::Closed(format!("control connection: {e}")))
}

/// Reads the peer's handshake (the first frame) before `deadline`.
fn read_hello(
    mut s: &TcpStream,
    reader: &mut FrameReader,
    role: Role,
    deadline: Instant,
) -> Result<Hello, TransferError> {
    let mut buf = [0u8; 4096];
    loop {
        if let Some(raw) = reader.next_raw() {
            return match decode_frame(&raw) {
                Ok(Message::Hello(h)) if h.role == role => Ok(h),
                Ok(m) => Err(TransferError::Failed(format!(
                    "expected the {} handshake, got {}",
                    role.name(),
                    m.name()
                ))),
                Err(e) => Err(wire_err(e)),
            };
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TransferError::Timeout("handshake".into()));
        }
        s.set_read_timeout(Some(left))
            .map_err(|e| TransferError::Failed(e.to_string()))?;
        match s.read(&mut buf) {
            Ok(0) => {
                return Err(TransferError::Closed(
                    "peer closed during the handshake".into(),
                ))
            }
            Ok(n) => reader.push(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(TransferError::Closed(format!("handshake: {e}"))),
        }
    }
}

/// What an end's threads share.
#[derive(Debug)]
struct Link {
    closed: AtomicBool,
    why: Mutex<String>,
    wake: flume::Sender<Vec<u8>>,
}

impl Link {
    fn close(&self, why: &str) -> bool {
        if self.closed.swap(true, Ordering::AcqRel) {
            return false;
        }
        *self.why.lock() = why.to_owned();
        // A full inbox is read before the end sees it closed: no need to wait for room.
        let _ = self.wake.try_send(Vec::new());
        true
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// One end of a NIXL connection.
#[derive(Debug)]
pub struct NixlEnd {
    role: Role,
    peer: Hello,
    peer_agent: String,
    link: Arc<Link>,
    inbox: flume::Receiver<Vec<u8>>,
    stream: Mutex<TcpStream>,
    opts: NixlOptions,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Prefill: the source memory of writes, and decode's landing zone (address, length).
    staging: Mutex<Staging>,
    remote_zone: Option<(u64, u64)>,
    /// Decode: the registered landing zone.
    zone: Option<RegisteredZone>,
    agent: Arc<NixlAgent>,
}

impl NixlEnd {
    #[allow(clippy::too_many_arguments)]
    fn start(
        role: Role,
        peer: Hello,
        peer_agent: String,
        stream: TcpStream,
        reader: FrameReader,
        agent: Arc<NixlAgent>,
        zone: Option<RegisteredZone>,
        remote_zone: Option<(u64, u64)>,
        opts: NixlOptions,
    ) -> Result<Arc<Self>, TransferError> {
        let (tx, inbox) = flume::bounded(INBOX_FRAMES);
        let link = Arc::new(Link {
            closed: AtomicBool::new(false),
            why: Mutex::new(String::new()),
            wake: tx.clone(),
        });
        let failed = |e: std::io::Error| TransferError::Failed(e.to_string());
        let rd = stream.try_clone().map_err(failed)?;
        rd.set_read_timeout(Some(Duration::from_millis(100)))
            .map_err(failed)?;
        let mut threads = Vec::new();
        {
            let (tx, link) = (tx.clone(), link.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("sparsekit-nixl-tcp".into())
                    .spawn(move || tcp_reader(rd, reader, tx, link))
                    .map_err(failed)?,
            );
        }
        if role == Role::Decode {
            let (tx, link, agent) = (tx.clone(), link.clone(), agent.clone());
            let (peer_name, poll) = (peer_agent.clone(), opts.poll);
            threads.push(
                std::thread::Builder::new()
                    .name("sparsekit-nixl-notif".into())
                    .spawn(move || notif_poller(agent, peer_name, tx, link, poll))
                    .map_err(failed)?,
            );
        }
        Ok(Arc::new(NixlEnd {
            role,
            peer,
            peer_agent,
            link,
            inbox,
            stream: Mutex::new(stream),
            opts,
            threads: Mutex::new(threads),
            staging: Mutex::new(Staging {
                reg: None,
                mem: Vec::new(),
            }),
            remote_zone,
            zone,
            agent,
        }))
    }

    fn closed_err(&self) -> TransferError {
        TransferError::Closed(self.link.why.lock().clone())
    }

    /// Fails the connection (and returns `e`): after a failed or timed-out write nothing
    /// about the peer's memory can be assumed, so the connection ends.
    fn fail(&self, e: TransferError) -> TransferError {
        self.close(&e.to_string());
        e
    }

    fn xfer(
        &self,
        segments: &[Segment<'_>],
        notification: Option<&[u8]>,
    ) -> Result<(), TransferError> {
        let (zone_addr, zone_len) = self
            .remote_zone
            .ok_or(TransferError::Unsupported("the decode end does not write"))?;
        let total: usize = segments.iter().map(|s| s.bytes.len()).sum();
        for s in segments {
            if s.offset
                .checked_add(s.bytes.len())
                .is_none_or(|e| e as u64 > zone_len)
            {
                return Err(TransferError::OutOfBounds {
                    offset: s.offset,
                    len: s.bytes.len(),
                    zone: zone_len as usize,
                });
            }
        }
        let ag = &self.agent;
        let mut st = self.staging.lock();
        if st.mem.len() < total {
            st.reg = None;
            st.mem = vec![0u8; total.next_power_of_two().max(1 << 16)];
            // SAFETY: `st.mem` is not reallocated while registered: it is replaced only
            // after the registration is dropped (above), and `reg` is declared first so it
            // is dropped before `mem`.
            st.reg = Some(unsafe { ag.register(st.mem.as_ptr() as usize, st.mem.len())? });
        }
        let base = st.mem.as_ptr() as usize;
        let api = capi::api().map_err(TransferError::Unavailable)?;
        let descriptors = |e| nixl_err("descriptors", e);
        let mut local = capi::XferList::new(api).map_err(descriptors)?;
        let mut remote = capi::XferList::new(api).map_err(descriptors)?;
        let mut at = 0;
        for s in segments {
            st.mem[at..at + s.bytes.len()].copy_from_slice(s.bytes);
            local.push(base + at, s.bytes.len()).map_err(descriptors)?;
            remote
                .push(zone_addr as usize + s.offset, s.bytes.len())
                .map_err(descriptors)?;
            at += s.bytes.len();
        }
        if segments.is_empty() {
            if let Some(n) = notification {
                ag.agent
                    .lock()
                    .notify(&self.peer_agent, n)
                    .map_err(|e| nixl_err("notification", e))?;
            }
            return Ok(());
        }
        // The agent is locked per call, never across the polling loop.
        let req = {
            let mut a = ag.agent.lock();
            let mut o = a.transfer_opts().map_err(|e| nixl_err("options", e))?;
            if let Some(n) = notification {
                o.notify(n).map_err(|e| nixl_err("notification", e))?;
            }
            a.post_write(&local, &remote, &self.peer_agent, &o)
                .map_err(|e| nixl_err("write", e))?
        };
        let deadline = crate::deadline_after(self.opts.io_timeout);
        let outcome = loop {
            let state = ag.agent.lock().status(&req);
            match state {
                Ok(capi::XferState::Done) => break Ok(()),
                Ok(capi::XferState::InProgress) => {
                    if self.link.is_closed() {
                        break Err(self.closed_err());
                    }
                    if Instant::now() >= deadline {
                        break Err(TransferError::Timeout(format!(
                            "NIXL write of {total} bytes not complete after {:?}",
                            self.opts.io_timeout
                        )));
                    }
                    std::thread::yield_now();
                }
                Err(e) => break Err(nixl_err("transfer", e)),
            }
        };
        ag.agent.lock().release(req);
        outcome
    }
}

/// Reads control frames off the TCP connection into the inbox until it ends.
fn tcp_reader(
    mut s: TcpStream,
    mut reader: FrameReader,
    tx: flume::Sender<Vec<u8>>,
    link: Arc<Link>,
) {
    let mut buf = vec![0u8; 64 << 10];
    // Frames that arrived with the handshake.
    while let Some(raw) = reader.next_raw() {
        if !forward(&tx, raw, &link) {
            return;
        }
    }
    while !link.is_closed() {
        match s.read(&mut buf) {
            Ok(0) => {
                link.close("the peer closed the connection");
                return;
            }
            Ok(n) => {
                reader.push(&buf[..n]);
                while let Some(raw) = reader.next_raw() {
                    if !forward(&tx, raw, &link) {
                        return;
                    }
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => {
                link.close(&format!("control connection: {e}"));
                return;
            }
        }
    }
}

/// Decode: moves NIXL notifications from the peer agent into the inbox.
fn notif_poller(
    agent: Arc<NixlAgent>,
    peer: String,
    tx: flume::Sender<Vec<u8>>,
    link: Arc<Link>,
    poll: Duration,
) {
    while !link.is_closed() {
        let taken = agent.agent.lock().take_notifications(&peer);
        let got = match taken {
            Ok(got) => got,
            Err(e) => {
                link.close(&format!("NIXL notifications: {e}"));
                return;
            }
        };
        if got.is_empty() {
            std::thread::sleep(poll);
        }
        for b in got {
            // An empty notification would read as the close marker: never forward one.
            if !b.is_empty() && !forward(&tx, b, &link) {
                return;
            }
        }
    }
}

impl Transport for NixlEnd {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn peer(&self) -> &Hello {
        &self.peer
    }

    fn send(&self, frame: &[u8]) -> Result<(), TransferError> {
        if self.link.is_closed() {
            return Err(self.closed_err());
        }
        let s = self.stream.lock();
        write_frame(&s, frame, self.opts.io_timeout).map_err(|e| self.fail(e))
    }

    fn recv(&self, timeout: Duration) -> Result<Option<Vec<u8>>, TransferError> {
        let got = match self.inbox.try_recv() {
            Ok(f) => Some(f),
            Err(_) if self.link.is_closed() => return Err(self.closed_err()),
            Err(_) => match self.inbox.recv_timeout(timeout) {
                Ok(f) => Some(f),
                Err(flume::RecvTimeoutError::Timeout) => None,
                Err(flume::RecvTimeoutError::Disconnected) => return Err(self.closed_err()),
            },
        };
        match got {
            Some(f) if f.is_empty() => Err(self.closed_err()),
            other => Ok(other),
        }
    }

    fn write(
        &self,
        segments: &[Segment<'_>],
        notification: Option<&[u8]>,
    ) -> Result<(), TransferError> {
        if self.role != Role::Prefill {
            return Err(TransferError::Unsupported("the decode end does not write"));
        }
        if self.link.is_closed() {
            return Err(self.closed_err());
        }
        self.xfer(segments, notification).map_err(|e| match e {
            e @ TransferError::OutOfBounds { .. } => e,
            e => self.fail(e),
        })
    }

    fn landing(&self) -> Option<Arc<LandingZone>> {
        self.zone.as_ref().map(|z| z.zone.clone())
    }

    fn close(&self, why: &str) {
        if self.link.close(why) {
            let _ = self.stream.lock().shutdown(Shutdown::Both);
        }
    }

    fn is_closed(&self) -> bool {
        self.link.is_closed()
    }

    /// A NIXL write posted by prefill before the teardown may still land until its own
    /// bound (`io_timeout`) has passed.
    fn late_write_bound(&self) -> Duration {
        self.opts.io_timeout
    }
}

impl Drop for NixlEnd {
    fn drop(&mut self) {
        self.close(&format!("{} end dropped", self.role.name()));
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
        // Registrations drop before their memory (field order in `Staging` and
        // `RegisteredZone`).
        self.agent.forget(&self.peer_agent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handshake data decodes strictly: round trip, and every truncation or extension
    /// refused (no NIXL call involved).
    #[test]
    fn blob_round_trip_and_strictness() {
        for zone in [None, Some((0x7f00_dead_b000usize, 123_456usize))] {
            let b = encode_blob(b"agent metadata", zone);
            let (md, z) = decode_blob(&b).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(md, b"agent metadata");
            assert_eq!(z, zone.map(|(a, l)| (a as u64, l as u64)));
            for n in 0..b.len() {
                assert!(decode_blob(&b[..n]).is_err(), "{n} bytes accepted");
            }
            let mut long = b.clone();
            long.push(0);
            assert!(decode_blob(&long).is_err());
        }
        let mut bad = encode_blob(b"x", None);
        *bad.last_mut().unwrap_or(&mut 0) = 7;
        assert!(decode_blob(&bad).is_err());
    }
}
