//! Request ids. The engine names every request with an unguessable server id (128 random
//! bits, [`crate::engine::random_id`]). An id a client chooses — SGLang's
//! `rid`, or an `X-Request-Id` header — is a label in a namespace of its own: it never
//! becomes an engine id, so it cannot squat the id of another request, and two clients
//! that choose the same label both get served (no 409). A label belongs to the client
//! address that sent its request ([`Owner`]): `/abort_request` with a label aborts that
//! address's requests in flight with it, never another client's (labels are guessable:
//! `job-1`); with a server id it aborts that request from anywhere (the id is the
//! capability: only its client and the server know it). Behind a proxy or a NAT every
//! client has one address: the proxy is then the client, and keeps its clients apart.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use super::api::ApiError;

/// Longest client id accepted, in bytes.
pub const MAX_CLIENT_ID_BYTES: usize = 256;

/// Checks a client-chosen id: 1 to 256 bytes of printable ASCII (it is echoed in a header).
pub fn check_client_id(id: &str, param: &str) -> Result<(), ApiError> {
    if id.is_empty() || id.len() > MAX_CLIENT_ID_BYTES {
        return Err(ApiError::bad_request(format!(
            "{param} must be 1 to {MAX_CLIENT_ID_BYTES} bytes"
        ))
        .with_param(param));
    }
    if !id.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
        return Err(
            ApiError::bad_request(format!("{param} must be printable ASCII")).with_param(param),
        );
    }
    Ok(())
}

/// The address of the client a request came from: the server puts it in each request's
/// extensions as the connection's peer address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAddr(pub IpAddr);

/// Whose a client label is: the canonical address of the client that sent the request
/// (an IPv4-mapped IPv6 address as IPv4), or `None` for a request that carried no
/// [`ClientAddr`].
pub type Owner = Option<IpAddr>;

/// The [`Owner`] of a request that came from `addr`.
pub fn owner(addr: Option<ClientAddr>) -> Owner {
    addr.map(|a| a.0.to_canonical())
}

/// Client labels of the requests in flight: (owner, label) → server ids.
#[derive(Debug, Default)]
pub struct ClientIds {
    map: Mutex<HashMap<(Owner, String), Vec<String>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ClientIds {
    /// Records that the request with server id `server`, from `owner`, carries the client
    /// label `client`, until the returned guard drops.
    pub fn register(self: &Arc<Self>, owner: Owner, client: &str, server: &str) -> ClientIdGuard {
        let key = (owner, client.to_string());
        lock(&self.map)
            .entry(key.clone())
            .or_default()
            .push(server.to_string());
        ClientIdGuard {
            ids: self.clone(),
            key,
            server: server.to_string(),
        }
    }

    /// The server ids of `owner`'s requests in flight labelled `client` (none of another
    /// owner's).
    pub fn lookup(&self, owner: Owner, client: &str) -> Vec<String> {
        lock(&self.map)
            .get(&(owner, client.to_string()))
            .cloned()
            .unwrap_or_default()
    }

    fn remove(&self, key: &(Owner, String), server: &str) {
        let mut m = lock(&self.map);
        if let Some(v) = m.get_mut(key) {
            v.retain(|s| s != server);
            if v.is_empty() {
                m.remove(key);
            }
        }
    }
}

/// Keeps a client label registered ([`ClientIds::register`]).
#[derive(Debug)]
pub struct ClientIdGuard {
    ids: Arc<ClientIds>,
    key: (Owner, String),
    server: String,
}

impl Drop for ClientIdGuard {
    fn drop(&mut self) {
        self.ids.remove(&self.key, &self.server);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_map_to_every_request_of_their_owner_and_go_with_their_guards() {
        let ids = Arc::new(ClientIds::default());
        let (me, other) = (
            owner(Some(ClientAddr([10, 0, 0, 1].into()))),
            owner(Some(ClientAddr([10, 0, 0, 2].into()))),
        );
        let a = ids.register(me, "job", "s1");
        let b = ids.register(me, "job", "s2");
        let c = ids.register(other, "job", "s3");
        let d = ids.register(None, "job", "s4");
        assert_eq!(
            ids.lookup(me, "job"),
            vec!["s1".to_string(), "s2".to_string()]
        );
        assert_eq!(ids.lookup(other, "job"), vec!["s3".to_string()]);
        assert_eq!(ids.lookup(None, "job"), vec!["s4".to_string()]);
        // The same client over IPv6 (an IPv4-mapped address) is the same owner.
        let mapped = std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped();
        assert_eq!(owner(Some(ClientAddr(mapped.into()))), me);
        drop(a);
        assert_eq!(ids.lookup(me, "job"), vec!["s2".to_string()]);
        drop((b, c, d));
        assert!(ids.lookup(me, "job").is_empty());
        assert!(lock(&ids.map).is_empty());
    }

    #[test]
    fn client_ids_are_checked() {
        assert!(check_client_id("abc-1 x", "rid").is_ok());
        assert!(check_client_id("", "rid").is_err());
        assert!(check_client_id(&"x".repeat(257), "rid").is_err());
        assert_eq!(
            check_client_id("a\nb", "x-request-id")
                .err()
                .and_then(|e| e.param),
            Some("x-request-id".into())
        );
    }
}
