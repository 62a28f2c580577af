//! Response bodies and builders: JSON (errors in OpenAI's shape), text, SSE streams.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Frame};
use hyper::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Response, StatusCode};
use serde_json::Value;
use tokio::sync::mpsc;

use super::api::ApiError;
use super::limits::BusyGuard;

/// The body type of every response: a full body or an SSE stream.
#[derive(Debug)]
pub enum ResponseBody {
    Full(Full<Bytes>),
    Sse(mpsc::Receiver<Bytes>),
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            ResponseBody::Full(f) => Pin::new(f).poll_frame(cx),
            ResponseBody::Sse(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Full(f) => f.is_end_stream(),
            ResponseBody::Sse(_) => false,
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            ResponseBody::Full(f) => f.size_hint(),
            ResponseBody::Sse(_) => hyper::body::SizeHint::default(),
        }
    }
}

/// A response body that keeps its connection marked busy until it is sent (or dropped).
#[derive(Debug)]
pub struct Guarded {
    pub body: ResponseBody,
    pub guard: Option<BusyGuard>,
}

impl Body for Guarded {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

pub type Resp = Response<ResponseBody>;

fn status(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// A JSON response.
pub fn json_response(code: u16, v: &Value) -> Resp {
    let body = serde_json::to_vec(v).unwrap_or_default();
    let mut r = Response::new(ResponseBody::Full(Full::new(Bytes::from(body))));
    *r.status_mut() = status(code);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An error in OpenAI's shape (a 503 says when to retry; a 401 which scheme to use).
pub fn error_response(e: &ApiError) -> Resp {
    let mut r = json_response(e.status, &e.body());
    if e.status == 503 {
        set_retry_after(&mut r, e.retry_after.unwrap_or(Duration::from_secs(1)));
    }
    if e.status == 401 {
        r.headers_mut()
            .insert("www-authenticate", HeaderValue::from_static("Bearer"));
    }
    r
}

/// Sets `Retry-After` (whole seconds, at least 1).
pub fn set_retry_after(r: &mut Resp, after: Duration) {
    let secs = after.as_secs().max(1);
    if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
        r.headers_mut().insert(RETRY_AFTER, v);
    }
}

/// A text response.
pub fn text_response(code: u16, content_type: &'static str, body: String) -> Resp {
    let mut r = Response::new(ResponseBody::Full(Full::new(Bytes::from(body))));
    *r.status_mut() = status(code);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// An empty response (CORS preflights).
pub fn empty_response(code: u16) -> Resp {
    let mut r = Response::new(ResponseBody::Full(Full::new(Bytes::new())));
    *r.status_mut() = status(code);
    r
}

/// An SSE stream fed by `rx`.
pub fn sse_response(rx: mpsc::Receiver<Bytes>) -> Resp {
    let mut r = Response::new(ResponseBody::Sse(rx));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    r
}

/// One SSE `data:` event.
pub fn sse_data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}
