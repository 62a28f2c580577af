//! A server on a loopback port and a minimal HTTP/1.1 client whose every wait is bounded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sparsekit_host::CpuBackend;
use sparsekit_server::engine::{Engine, EngineOptions, ModelConfig};
use sparsekit_server::http::{spawn, ServerConfig, ServerHandle};
use sparsekit_server::metrics::Metrics;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bound of every wait.
pub const LIMIT: Duration = Duration::from_secs(60);

/// The tiny model on the cpu backend behind a server with `cfg`.
pub async fn start_with(cfg: ServerConfig, opts: EngineOptions) -> (Arc<Engine>, ServerHandle) {
    let engine = Arc::new(
        Engine::start(
            Arc::new(CpuBackend::new()),
            ModelConfig::TINY,
            opts,
            Arc::new(Metrics::new("both")),
        )
        .unwrap(),
    );
    let server = spawn(engine.clone(), "127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    (engine, server)
}

/// [`start_with`] 1024 pages.
pub async fn start(cfg: ServerConfig) -> (Arc<Engine>, ServerHandle) {
    start_with(cfg, pages(1024)).await
}

/// Engine options with `n` pages.
pub fn pages(n: usize) -> EngineOptions {
    EngineOptions {
        kv_pages: n,
        ..Default::default()
    }
}

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// JSON `data:` payloads of an SSE body (`[DONE]` excluded).
    pub fn events(&self) -> Vec<Value> {
        self.text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }
    /// The OpenAI error's `param` and `code`.
    pub fn error(&self) -> (Value, Value) {
        let v = self.json();
        (v["error"]["param"].clone(), v["error"]["code"].clone())
    }
}

/// Parses a whole response (the connection was closed by the server).
pub fn parse(buf: &[u8]) -> Reply {
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no headers in {:?}", String::from_utf8_lossy(buf)));
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = buf[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
    {
        body = sparsekit_server::harness::run::dechunk(&body).expect("chunked body");
    }
    Reply {
        status,
        headers,
        body,
    }
}

/// One raw exchange on a fresh connection, read to its end.
pub async fn raw(addr: SocketAddr, request: Vec<u8>) -> Reply {
    let s = TcpStream::connect(addr).await.unwrap();
    exchange(s, request).await
}

/// [`raw`] from the local address `from` (another loopback address is another client).
pub async fn raw_from(from: std::net::IpAddr, addr: SocketAddr, request: Vec<u8>) -> Reply {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from, 0)).unwrap();
    let s = socket.connect(addr).await.unwrap();
    exchange(s, request).await
}

async fn exchange(mut s: TcpStream, request: Vec<u8>) -> Reply {
    s.write_all(&request).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(LIMIT, s.read_to_end(&mut buf))
        .await
        .expect("response within the limit")
        .unwrap();
    parse(&buf)
}

/// A request with `Connection: close` and extra headers.
pub fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    if method == "POST" {
        r.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    r.push_str("\r\n");
    let mut r = r.into_bytes();
    r.extend_from_slice(body);
    r
}

pub async fn post_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)], v: &Value) -> Reply {
    raw(
        addr,
        request("POST", path, headers, v.to_string().as_bytes()),
    )
    .await
}

/// [`post`] from the local address `from`.
pub async fn post_from(from: std::net::IpAddr, addr: SocketAddr, path: &str, v: &Value) -> Reply {
    raw_from(
        from,
        addr,
        request("POST", path, &[], v.to_string().as_bytes()),
    )
    .await
}

pub async fn post(addr: SocketAddr, path: &str, v: &Value) -> Reply {
    post_with(addr, path, &[], v).await
}

pub async fn get_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Reply {
    raw(addr, request("GET", path, headers, b"")).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    get_with(addr, path, &[]).await
}

/// Waits (bounded) until `cond` holds, looking again after each yield.
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
