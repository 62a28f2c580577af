//! What the process-level tests share: a `sparsekit serve` child (killed on drop) and a
//! minimal HTTP/1.1 client with bounded reads.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // each test uses a part

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `sparsekit serve`; killed when dropped.
pub struct Server {
    pub child: Child,
    /// `host:port` of its HTTP server.
    pub addr: String,
    /// What it printed up to its `listening on` line (included).
    pub log: Vec<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `sparsekit serve ARGS` with `env` added; waits (bounded) for the address it prints.
pub fn serve<K: AsRef<OsStr>, V: AsRef<OsStr>>(args: &[&str], env: &[(K, V)]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sparsekit"))
        .arg("serve")
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut ready = false;
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if !ready {
                ready = l.contains("listening on");
                let _ = tx.send(l);
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut log = Vec::new();
    let line = loop {
        let l = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the server prints its address");
        log.push(l.clone());
        if l.contains("listening on") {
            break l;
        }
    };
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .to_string();
    Server { child, addr, log }
}

/// Sends a raw request; the status and the whole response (head and body).
pub fn exchange(addr: &str, req: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).unwrap().parse().unwrap();
    (status, out)
}

/// The body of a response from [`exchange`].
pub fn body(response: &str) -> &str {
    response.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

pub fn post(addr: &str, path: &str, body: &str) -> (u16, String) {
    exchange(
        addr,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
}

pub fn get(addr: &str, path: &str) -> (u16, String) {
    exchange(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    )
}

/// Sends signal `sig` (`-TERM`, `-INT`, …) to `child`.
pub fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

/// Waits (bounded) for `child` to exit.
pub fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(Instant::now() < deadline, "did not exit within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
