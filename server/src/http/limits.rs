//! Connection limits: what keeps a flood of sockets from locking everyone out.
//!
//! - At most [`ConnLimits::max_connections`] connections, and at most
//!   [`ConnLimits::max_per_client`] from one client address.
//! - A connection is *idle* while no request of it is being handled (before its first
//!   request, between keep-alive requests, or stuck in a slow header). When a limit is
//!   reached, the longest-idle connection (of that client, for the per-client limit) is
//!   closed to make room: idle sockets cannot hold the server, however many there are.
//! - When every counted connection is busy, a new one goes to a small reserve
//!   ([`ConnLimits::reserve`]): it gets one answer — `/health` as usual, anything else a
//!   JSON 503 with `Retry-After` — and is closed. Past the reserve, it is closed at once.
//! - A connection's headers must arrive within [`ConnLimits::header_timeout`] (which
//!   also closes a keep-alive connection idle that long), and keep-alive ends once a
//!   connection is [`ConnLimits::max_connection_age`] old: a client that sends a request
//!   every few seconds cannot keep a connection forever.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::metrics::Metrics;

/// The limits ([`super::ServerConfig::limits`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections counted at once at most (idle ones are closed to make room).
    pub max_connections: usize,
    /// Connections of one client address at most.
    pub max_per_client: usize,
    /// Connections over the limits, with every counted one busy, that still get an answer
    /// (`/health`, or a 503 with `Retry-After`) before they close.
    pub reserve: usize,
    /// How long the headers of a request may take (and how long a keep-alive connection
    /// may sit idle).
    pub header_timeout: Duration,
    /// The headers' bound on a reserve connection.
    pub reserve_header_timeout: Duration,
    /// Age after which a connection ends its keep-alive (the request in flight finishes).
    pub max_connection_age: Duration,
    /// What a 503 tells the client to wait before retrying.
    pub retry_after: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: 4096,
            max_per_client: 1024,
            reserve: 64,
            header_timeout: Duration::from_secs(30),
            reserve_header_timeout: Duration::from_secs(5),
            max_connection_age: Duration::from_secs(600),
            retry_after: Duration::from_secs(1),
        }
    }
}

impl ConnLimits {
    /// Checks that every bound is positive and the per-client limit fits the total.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 || self.max_per_client == 0 {
            return Err("connection limits must be positive".into());
        }
        if self.max_per_client > self.max_connections {
            return Err(format!(
                "the per-client connection limit ({}) exceeds the total ({})",
                self.max_per_client, self.max_connections
            ));
        }
        if self.header_timeout.is_zero() || self.reserve_header_timeout.is_zero() {
            return Err("header timeouts must be positive".into());
        }
        Ok(())
    }

    /// File descriptors these limits can use at once (connections, reserve, and a margin
    /// for the engine and the listener).
    pub fn descriptors_needed(&self) -> u64 {
        (self.max_connections + self.reserve + 64) as u64
    }
}

/// Raises the soft limit of open files to the hard limit; returns the soft limit now.
#[cfg(unix)]
pub fn raise_fd_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit read by the call; failure leaves the limit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every unix
    Some(lim.rlim_cur as u64)
}

/// Non-unix: the limit is not known.
#[cfg(not(unix))]
pub fn raise_fd_limit() -> Option<u64> {
    None
}

/// A busy count of `EVICTED` marks a connection closed to make room.
const EVICTED: usize = usize::MAX;

/// What the service of a connection and the table share about it.
#[derive(Debug)]
pub struct ConnState {
    /// Requests being handled (0: idle), or [`EVICTED`].
    busy: AtomicUsize,
    /// When it last went idle, in ms since the table's epoch.
    idle_since_ms: AtomicU64,
    epoch: Instant,
    evict: Notify,
}

impl ConnState {
    /// Marks a request as being handled; `None` when the connection was evicted (its
    /// socket is about to close).
    pub fn enter(self: &Arc<Self>) -> Option<BusyGuard> {
        let mut cur = self.busy.load(Ordering::Acquire);
        loop {
            if cur == EVICTED {
                return None;
            }
            match self
                .busy
                .compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(BusyGuard(self.clone())),
                Err(now) => cur = now,
            }
        }
    }

    /// Resolves once the connection is evicted.
    pub async fn evicted(&self) {
        self.evict.notified().await;
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Claims an idle connection for eviction (fails when it is busy).
    fn try_evict(&self) -> bool {
        self.busy
            .compare_exchange(0, EVICTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// Held while a request (its response body included) is being handled.
#[derive(Debug)]
pub struct BusyGuard(Arc<ConnState>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        let s = &self.0;
        s.idle_since_ms.store(s.now_ms(), Ordering::Release);
        s.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug)]
struct Entry {
    ip: IpAddr,
    state: Arc<ConnState>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    conns: HashMap<u64, Entry>,
    per_ip: HashMap<IpAddr, usize>,
    reserve: usize,
}

/// Every connection of a server.
#[derive(Debug)]
pub struct ConnTable {
    limits: ConnLimits,
    inner: Mutex<Inner>,
    epoch: Instant,
    metrics: Arc<Metrics>,
    empty: Notify,
}

/// How a new connection is served.
#[derive(Debug)]
pub enum Admission {
    /// As usual, counted until the slot drops.
    Normal(ConnSlot),
    /// One answer, then closed (see the module docs).
    Reserve(ReserveSlot),
    /// Closed at once.
    Refused,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ConnTable {
    pub fn new(limits: ConnLimits, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(ConnTable {
            limits,
            inner: Mutex::new(Inner::default()),
            epoch: Instant::now(),
            metrics,
            empty: Notify::new(),
        })
    }

    pub fn limits(&self) -> &ConnLimits {
        &self.limits
    }

    /// Connections counted now (reserve ones excluded).
    pub fn len(&self) -> usize {
        lock(&self.inner).conns.len()
    }

    /// Whether no connection is counted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Decides how a new connection from `ip` is served (evicting an idle one to make
    /// room when a limit is reached).
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Admission {
        let mut t = lock(&self.inner);
        let mine = t.per_ip.get(&ip).copied().unwrap_or(0);
        let full = if mine >= self.limits.max_per_client {
            (!self.evict_idle(&mut t, Some(ip))).then_some("per_client")
        } else if t.conns.len() >= self.limits.max_connections {
            (!self.evict_idle(&mut t, None)).then_some("capacity")
        } else {
            None
        };
        if let Some(reason) = full {
            self.metrics.connection_refused(reason);
            if t.reserve < self.limits.reserve {
                t.reserve += 1;
                return Admission::Reserve(ReserveSlot {
                    table: self.clone(),
                });
            }
            self.metrics.connection_refused("reserve_full");
            return Admission::Refused;
        }
        let id = t.next;
        t.next += 1;
        let state = Arc::new(ConnState {
            busy: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(self.epoch.elapsed().as_millis() as u64),
            epoch: self.epoch,
            evict: Notify::new(),
        });
        t.conns.insert(
            id,
            Entry {
                ip,
                state: state.clone(),
            },
        );
        *t.per_ip.entry(ip).or_default() += 1;
        Admission::Normal(ConnSlot {
            table: self.clone(),
            id,
            state,
        })
    }

    /// Closes the longest-idle connection (of `ip` when given) to make room; `false` when
    /// every candidate is busy.
    fn evict_idle(&self, t: &mut Inner, ip: Option<IpAddr>) -> bool {
        // The longest idle first; one that turned busy meanwhile is skipped.
        let mut skipped: Vec<u64> = Vec::new();
        loop {
            let oldest = t
                .conns
                .iter()
                .filter(|(id, e)| ip.is_none_or(|ip| e.ip == ip) && !skipped.contains(id))
                .filter(|(_, e)| e.state.busy.load(Ordering::Acquire) == 0)
                .min_by_key(|(id, e)| (e.state.idle_since_ms.load(Ordering::Acquire), **id))
                .map(|(id, e)| (*id, e.state.try_evict()));
            match oldest {
                None => return false,
                Some((id, false)) => skipped.push(id),
                Some((id, true)) => {
                    if let Some(e) = t.conns.remove(&id) {
                        Self::uncount(t, e.ip);
                        e.state.evict.notify_one();
                        self.metrics.connection_refused("evicted_idle");
                    }
                    return true;
                }
            }
        }
    }

    /// Closes one idle connection (out of file descriptors, say); `false` when none is.
    pub fn evict_one_idle(&self) -> bool {
        let mut t = lock(&self.inner);
        self.evict_idle(&mut t, None)
    }

    fn uncount(t: &mut Inner, ip: IpAddr) {
        if let Some(n) = t.per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                t.per_ip.remove(&ip);
            }
        }
    }

    fn release(&self, id: u64) {
        let mut t = lock(&self.inner);
        if let Some(e) = t.conns.remove(&id) {
            Self::uncount(&mut t, e.ip);
        }
        if t.conns.is_empty() && t.reserve == 0 {
            self.empty.notify_waiters();
        }
    }

    /// Waits (at most `limit`) until no connection is left; whether none is.
    pub async fn wait_empty(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.empty.notified();
            {
                let t = lock(&self.inner);
                if t.conns.is_empty() && t.reserve == 0 {
                    return true;
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }
}

/// A counted connection; uncounted when dropped.
#[derive(Debug)]
pub struct ConnSlot {
    table: Arc<ConnTable>,
    id: u64,
    state: Arc<ConnState>,
}

impl ConnSlot {
    /// The table the connection is counted in.
    pub fn table(&self) -> &Arc<ConnTable> {
        &self.table
    }

    /// What the connection's service marks busy.
    pub fn state(&self) -> &Arc<ConnState> {
        &self.state
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.table.release(self.id);
    }
}

/// A reserve connection; uncounted when dropped.
#[derive(Debug)]
pub struct ReserveSlot {
    table: Arc<ConnTable>,
}

impl Drop for ReserveSlot {
    fn drop(&mut self) {
        let mut t = lock(&self.table.inner);
        t.reserve = t.reserve.saturating_sub(1);
        if t.conns.is_empty() && t.reserve == 0 {
            self.table.empty.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(max: usize, per: usize, reserve: usize) -> Arc<ConnTable> {
        ConnTable::new(
            ConnLimits {
                max_connections: max,
                max_per_client: per,
                reserve,
                ..Default::default()
            },
            Arc::new(Metrics::new("both")),
        )
    }

    fn normal(a: Admission) -> ConnSlot {
        match a {
            Admission::Normal(s) => s,
            other => panic!("expected a normal admission, got {other:?}"),
        }
    }

    #[test]
    fn idle_connections_make_room_busy_ones_do_not() {
        let t = table(2, 2, 1);
        let ip: IpAddr = [10, 0, 0, 1].into();
        let a = normal(t.admit(ip));
        let b = normal(t.admit(ip));
        let busy_b = b.state().enter();
        assert!(busy_b.is_some());
        // Full: the idle one (a) is evicted for the newcomer.
        let c = normal(t.admit(ip));
        assert!(a.state().enter().is_none(), "a was evicted");
        assert_eq!(t.len(), 2);
        let _busy_c = c.state().enter();
        // Everything busy: the reserve, then refusal.
        let r = t.admit(ip);
        assert!(matches!(r, Admission::Reserve(_)));
        assert!(matches!(t.admit(ip), Admission::Refused));
        drop(r);
        assert!(matches!(t.admit(ip), Admission::Reserve(_)));
        drop(a);
        assert_eq!(t.len(), 2, "dropping an evicted slot changes nothing");
        drop(busy_b);
        drop(b);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn the_per_client_limit_evicts_that_clients_idle_connections_only() {
        let t = table(4, 2, 0);
        let (x, y): (IpAddr, IpAddr) = ([10, 0, 0, 1].into(), [10, 0, 0, 2].into());
        let other = normal(t.admit(y));
        let x1 = normal(t.admit(x));
        let x2 = normal(t.admit(x));
        let _x3 = normal(t.admit(x));
        assert!(
            x1.state().enter().is_none(),
            "x's oldest idle connection went"
        );
        assert!(x2.state().enter().is_some());
        assert!(other.state().enter().is_some(), "y's connection stayed");
    }
}
