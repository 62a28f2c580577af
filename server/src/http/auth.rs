//! The API key (`--api-key`, or `SPARSEKIT_API_KEY`): when one is set, every route but
//! the public ones (`/health` and `/metrics` unless configured otherwise, and CORS
//! preflights) needs `Authorization: Bearer <key>`; anything else is a 401 in OpenAI's
//! error shape. The comparison takes the same time wherever the keys differ.

use std::fmt;

use super::api::ApiError;

/// A secret compared in constant time; its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Why a key cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApiKeyError {
    #[error("the API key is empty")]
    Empty,
    #[error("the API key must be printable ASCII without spaces (it travels in a header)")]
    NotPrintable,
}

impl ApiKey {
    /// A key: non-empty printable ASCII without whitespace.
    pub fn new(key: impl Into<String>) -> Result<Self, ApiKeyError> {
        let key = key.into();
        if key.is_empty() {
            return Err(ApiKeyError::Empty);
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiKeyError::NotPrintable);
        }
        Ok(ApiKey(key))
    }

    /// Whether `presented` is this key, in time that depends only on the lengths.
    pub fn matches(&self, presented: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), presented)
    }
}

/// Byte-string equality whose running time depends on the lengths only, not on where the
/// strings first differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = u64::from(a.len() != b.len());
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    // Keep the loop from being turned into an early exit.
    std::hint::black_box(diff) == 0
}

/// Routes reachable without the key when one is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublicRoutes {
    /// `/health` (and `/health_generate`).
    pub health: bool,
    /// `/metrics`.
    pub metrics: bool,
}

impl Default for PublicRoutes {
    fn default() -> Self {
        PublicRoutes {
            health: true,
            metrics: true,
        }
    }
}

impl PublicRoutes {
    /// Parses `health,metrics`, `health`, `metrics` or `none`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut r = PublicRoutes {
            health: false,
            metrics: false,
        };
        for part in s.split(',').map(str::trim) {
            match part {
                "health" => r.health = true,
                "metrics" => r.metrics = true,
                "none" | "" => {}
                other => {
                    return Err(format!(
                        "unknown public route {other:?} (health, metrics or none)"
                    ))
                }
            }
        }
        Ok(r)
    }

    /// Whether `path` is open without the key.
    pub fn is_public(&self, path: &str) -> bool {
        match path {
            "/health" | "/health_generate" => self.health,
            "/metrics" => self.metrics,
            _ => false,
        }
    }
}

/// Checks a request's `Authorization` header against `key`: `Ok` when no key is set or
/// the header carries it as a bearer token; a 401 otherwise.
pub fn check(key: Option<&ApiKey>, authorization: Option<&[u8]>) -> Result<(), ApiError> {
    let Some(key) = key else { return Ok(()) };
    let unauthorized =
        |m: &str| ApiError::status(401, "invalid_request_error", m).with_code("invalid_api_key");
    let Some(h) = authorization else {
        return Err(unauthorized(
            "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
        ));
    };
    let token = h
        .strip_prefix(b"Bearer ")
        .or_else(|| h.strip_prefix(b"bearer "))
        .map(<[u8]>::trim_ascii);
    match token {
        Some(t) if key.matches(t) => Ok(()),
        _ => Err(unauthorized("Incorrect API key provided.")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_equality_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret1"));
        assert!(!constant_time_eq(b"secret", b""));
        assert!(!constant_time_eq(b"\0", b""));
    }

    #[test]
    fn bearer_tokens_are_checked() {
        let k = ApiKey::new("sk-test").unwrap_or_else(|e| panic!("{e}"));
        assert!(check(None, None).is_ok());
        assert!(check(Some(&k), Some(b"Bearer sk-test")).is_ok());
        assert!(check(Some(&k), Some(b"bearer sk-test ")).is_ok());
        for bad in [
            None,
            Some(&b"sk-test"[..]),
            Some(b"Bearer sk-tes"),
            Some(b"Basic x"),
        ] {
            let e = check(Some(&k), bad).err();
            assert_eq!(
                e.map(|e| (e.status, e.code)),
                Some((401, Some("invalid_api_key")))
            );
        }
        assert_eq!(format!("{k:?}"), "ApiKey(<redacted>)");
        assert!(ApiKey::new("").is_err() && ApiKey::new("a b").is_err());
    }

    #[test]
    fn public_routes() {
        let d = PublicRoutes::default();
        assert!(d.is_public("/health") && d.is_public("/metrics"));
        assert!(!d.is_public("/v1/models") && !d.is_public("/abort_request"));
        let none = PublicRoutes::parse("none").unwrap_or(d);
        assert!(!none.is_public("/health") && !none.is_public("/metrics"));
        assert!(PublicRoutes::parse("health,metrics").is_ok_and(|r| r == d));
        assert!(PublicRoutes::parse("admin").is_err());
    }
}
