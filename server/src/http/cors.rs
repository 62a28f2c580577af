//! CORS (`--allowed-origins`): browsers on the listed origins (or any, with `*`) may call
//! the API. Preflights (`OPTIONS`) are answered without the API key (browsers send none);
//! every response to an allowed origin carries `Access-Control-Allow-Origin` and exposes
//! `X-Request-Id`. With no origins listed (the default) the server sends no CORS headers
//! and browsers keep their same-origin rule. A POST from a browser page of any other
//! origin (its `Origin` header) is a 403 before any route runs ([`Cors::refuses`]): the
//! same-origin rule only keeps a page from reading an answer, not from sending the request.

use hyper::header::{HeaderMap, HeaderValue, ORIGIN, VARY};

use super::api::ApiError;
use super::response::{empty_response, error_response, Resp};

/// The allowed origins.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cors {
    origins: Vec<String>,
}

impl Cors {
    /// `origins`: `*`, or origins such as `https://app.example.com` (scheme, host and
    /// port, no path).
    pub fn new(origins: &[String]) -> Result<Self, String> {
        for o in origins {
            let ok = o == "*"
                || (o.starts_with("http://") || o.starts_with("https://"))
                    && !o.ends_with('/')
                    && HeaderValue::from_str(o).is_ok();
            if !ok {
                return Err(format!(
                    "allowed origin {o:?} is neither * nor scheme://host[:port]"
                ));
            }
        }
        Ok(Cors {
            origins: origins.to_vec(),
        })
    }

    /// Whether CORS is on.
    pub fn enabled(&self) -> bool {
        !self.origins.is_empty()
    }

    /// `Access-Control-Allow-Origin` for a request from `origin`, if allowed.
    fn allow(&self, origin: Option<&HeaderValue>) -> Option<HeaderValue> {
        if self.origins.iter().any(|o| o == "*") {
            return Some(HeaderValue::from_static("*"));
        }
        let origin = origin?;
        let s = origin.to_str().ok()?;
        self.origins.iter().any(|o| o == s).then(|| origin.clone())
    }

    /// Whether a state-changing request (a POST) from `origin` is refused: it comes from a
    /// browser page (`Origin` present) whose origin is not allowed. A browser sends
    /// `Origin` with every cross-origin POST, a `no-cors` one included (which needs no
    /// preflight and may carry no `Content-Type`); clients that are not browsers send none.
    /// So a page the user visits cannot generate or abort through the user's browser.
    pub fn refuses(&self, origin: Option<&HeaderValue>) -> bool {
        origin.is_some() && self.allow(origin).is_none()
    }

    /// The answer to a preflight (`OPTIONS`).
    pub fn preflight(&self, headers: &HeaderMap) -> Resp {
        if !self.enabled() {
            return error_response(&ApiError::status(
                405,
                "invalid_request_error",
                "OPTIONS is not allowed (CORS is off)",
            ));
        }
        let Some(allow) = self.allow(headers.get(ORIGIN)) else {
            return error_response(&ApiError::status(
                403,
                "invalid_request_error",
                "this origin is not allowed (--allowed-origins)",
            ));
        };
        let mut r = empty_response(204);
        let h = r.headers_mut();
        h.insert("access-control-allow-origin", allow);
        h.insert(
            "access-control-allow-methods",
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            "access-control-allow-headers",
            HeaderValue::from_static("authorization, content-type, x-request-id"),
        );
        h.insert("access-control-max-age", HeaderValue::from_static("600"));
        h.insert(VARY, HeaderValue::from_static("Origin"));
        r
    }

    /// Adds the CORS headers to a response to a request from `origin`.
    pub fn decorate(&self, r: &mut Resp, origin: Option<&HeaderValue>) {
        if let Some(allow) = self.enabled().then(|| self.allow(origin)).flatten() {
            let h = r.headers_mut();
            h.insert("access-control-allow-origin", allow);
            h.insert(
                "access-control-expose-headers",
                HeaderValue::from_static("x-request-id"),
            );
            h.insert(VARY, HeaderValue::from_static("Origin"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_checked_and_matched() {
        assert!(Cors::new(&["example.com".into()]).is_err());
        assert!(Cors::new(&["https://a.example/".into()]).is_err());
        let c = Cors::new(&["https://a.example".into()]).unwrap_or_default();
        let mut h = HeaderMap::new();
        h.insert(ORIGIN, HeaderValue::from_static("https://a.example"));
        let r = c.preflight(&h);
        assert_eq!(r.status(), 204);
        assert_eq!(
            r.headers().get("access-control-allow-origin"),
            Some(&HeaderValue::from_static("https://a.example"))
        );
        h.insert(ORIGIN, HeaderValue::from_static("https://evil.example"));
        assert_eq!(c.preflight(&h).status(), 403);
        assert_eq!(Cors::default().preflight(&h).status(), 405);
    }
}
