//! Request ids. The engine names every request with an unguessable server id (128 random
//! bits, [`crate::engine::random_id`]). An id a client chooses — SGLang's
//! `rid`, or an `X-Request-Id` header — is a label in a namespace of its own: it never
//! becomes an engine id, so it cannot squat the id of another request, and two clients
//! that choose the same label both get served (no 409). `/abort_request` aborts every
//! request in flight with that label, or the request with that server id.

use std::collections::HashMap;
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

/// Client labels of the requests in flight: label → server ids.
#[derive(Debug, Default)]
pub struct ClientIds {
    map: Mutex<HashMap<String, Vec<String>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ClientIds {
    /// Records that the request with server id `server` carries the client label
    /// `client`, until the returned guard drops.
    pub fn register(self: &Arc<Self>, client: &str, server: &str) -> ClientIdGuard {
        lock(&self.map)
            .entry(client.to_string())
            .or_default()
            .push(server.to_string());
        ClientIdGuard {
            ids: self.clone(),
            client: client.to_string(),
            server: server.to_string(),
        }
    }

    /// The server ids of the requests in flight labelled `client`.
    pub fn lookup(&self, client: &str) -> Vec<String> {
        lock(&self.map).get(client).cloned().unwrap_or_default()
    }

    fn remove(&self, client: &str, server: &str) {
        let mut m = lock(&self.map);
        if let Some(v) = m.get_mut(client) {
            v.retain(|s| s != server);
            if v.is_empty() {
                m.remove(client);
            }
        }
    }
}

/// Keeps a client label registered ([`ClientIds::register`]).
#[derive(Debug)]
pub struct ClientIdGuard {
    ids: Arc<ClientIds>,
    client: String,
    server: String,
}

impl Drop for ClientIdGuard {
    fn drop(&mut self) {
        self.ids.remove(&self.client, &self.server);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_map_to_every_request_and_go_with_their_guards() {
        let ids = Arc::new(ClientIds::default());
        let a = ids.register("job", "s1");
        let b = ids.register("job", "s2");
        assert_eq!(ids.lookup("job"), vec!["s1".to_string(), "s2".to_string()]);
        drop(a);
        assert_eq!(ids.lookup("job"), vec!["s2".to_string()]);
        drop(b);
        assert!(ids.lookup("job").is_empty());
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
