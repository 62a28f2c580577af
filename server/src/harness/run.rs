//! Running a workload: against an engine in this process or a server over HTTP, one
//! request at a time (the reference) or all sessions concurrently (the served run), and
//! recording every generated token and logits digest per turn.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use crate::engine::sampling::SamplingParams;
use crate::engine::{Engine, GenerateRequest};
use crate::error::EngineError;
use crate::harness::workload::Workload;

/// What one turn produced.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TurnTrace {
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub digests: Vec<u64>,
    /// Seconds from submission to the first token, as the serving side measured it.
    pub ttft: Option<f64>,
}

/// Why a turn has no trace.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum TurnFailure {
    /// The server refused it (a detected problem: typed error, 4xx/5xx).
    Refused(String),
    /// It did not finish before its deadline.
    Wedged(String),
    /// It was aborted.
    Aborted,
}

/// A session's turns in order; the first failed turn ends the session.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SessionTrace {
    pub session: usize,
    pub turns: Vec<TurnTrace>,
    pub failure: Option<(usize, TurnFailure)>,
}

/// Where requests go.
pub trait Target: Send + Sync {
    /// Generates a reply for `prompt` with `sampling`, waiting at most `deadline`.
    fn generate(
        &self,
        rid: &str,
        prompt: &[u32],
        sampling: &SamplingParams,
        deadline: Duration,
    ) -> Result<TurnTrace, TurnFailure>;
}

/// An engine in this process.
#[derive(Debug, Clone)]
pub struct EngineTarget(pub Arc<Engine>);

impl Target for EngineTarget {
    fn generate(
        &self,
        rid: &str,
        prompt: &[u32],
        sampling: &SamplingParams,
        deadline: Duration,
    ) -> Result<TurnTrace, TurnFailure> {
        let h = self
            .0
            .submit(GenerateRequest {
                id: Some(rid.to_string()),
                prompt: prompt.to_vec(),
                sampling: sampling.clone(),
                received: None,
            })
            .map_err(|e| TurnFailure::Refused(e.to_string()))?;
        match h.wait(deadline) {
            Ok(c) if c.finish == crate::engine::FinishReason::Abort => Err(TurnFailure::Aborted),
            Ok(c) => Ok(TurnTrace {
                prompt_tokens: prompt.len(),
                tokens: c.tokens,
                digests: c.digests,
                ttft: c.ttft,
            }),
            Err(EngineError::Timeout(m)) => Err(TurnFailure::Wedged(m)),
            Err(e) => Err(TurnFailure::Refused(e.to_string())),
        }
    }
}

/// A server over HTTP (`/generate` with logits digests).
#[derive(Debug, Clone)]
pub struct HttpTarget {
    pub addr: SocketAddr,
}

/// One HTTP/1.1 exchange (`Connection: close`) with a deadline; returns status and body.
pub fn http_exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    deadline: Duration,
) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect_timeout(&addr, deadline)?;
    s.set_read_timeout(Some(deadline))?;
    s.set_write_timeout(Some(deadline))?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    s.write_all(&req)?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed HTTP response");
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(bad)?;
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(bad)?;
    let mut body = buf[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body).ok_or_else(bad)?;
    }
    Ok((status, body))
}

/// Decodes a chunked transfer-encoded body.
pub fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let n = usize::from_str_radix(std::str::from_utf8(&b[..eol]).ok()?.trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(eol + 2..eol + 2 + n)?);
        b = b.get(eol + 2 + n + 2..)?;
    }
}

/// The `/generate` body of a harness request (token ids in, logits digests out).
fn generate_body(rid: &str, prompt: &[u32], s: &SamplingParams) -> Value {
    json!({
        "input_ids": prompt, "rid": rid, "return_logits_digest": true,
        "sampling_params": {
            "max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
            "top_p": s.top_p, "top_k": s.top_k, "sampling_seed": s.seed,
            "ignore_eos": s.ignore_eos, "stop": s.stop, "stop_token_ids": s.stop_token_ids,
        }
    })
}

/// A finished `/generate` reply as a turn (an aborted one as `Aborted`).
fn parse_generate(v: &Value, prompt_tokens: usize) -> Result<TurnTrace, TurnFailure> {
    let meta = &v["meta_info"];
    if meta["finish_reason"]["type"] == "abort" {
        return Err(TurnFailure::Aborted);
    }
    let bad = |what: &str| TurnFailure::Refused(format!("malformed /generate reply: {what}"));
    let tokens = v["output_ids"]
        .as_array()
        .ok_or_else(|| bad("output_ids"))?
        .iter()
        .map(|t| t.as_u64().map(|t| t as u32).ok_or_else(|| bad("output id")))
        .collect::<Result<Vec<_>, _>>()?;
    let digests = meta["logits_digests"]
        .as_array()
        .ok_or_else(|| bad("logits_digests"))?
        .iter()
        .map(|d| {
            d.as_str()
                .and_then(|s| u64::from_str_radix(s, 16).ok())
                .ok_or_else(|| bad("digest"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(TurnTrace {
        prompt_tokens,
        tokens,
        digests,
        ttft: meta["ttft_seconds"].as_f64(),
    })
}

impl Target for HttpTarget {
    fn generate(
        &self,
        rid: &str,
        prompt: &[u32],
        s: &SamplingParams,
        deadline: Duration,
    ) -> Result<TurnTrace, TurnFailure> {
        let body = generate_body(rid, prompt, s);
        let (status, body) = http_exchange(
            self.addr,
            "POST",
            "/generate",
            body.to_string().as_bytes(),
            deadline,
        )
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                TurnFailure::Wedged(format!("no response within {deadline:?}"))
            }
            _ => TurnFailure::Refused(format!("transport: {e}")),
        })?;
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| TurnFailure::Refused(format!("status {status}, body not JSON: {e}")))?;
        if status != 200 {
            return Err(TurnFailure::Refused(format!(
                "status {status}: {}",
                v["error"]["message"]
            )));
        }
        parse_generate(&v, prompt.len())
    }
}

/// Client aborts (`--abort-rate`): a fraction `rate` of the requests is sent streaming and
/// the connection is closed after `k` tokens (`k` uniform in `0..max_new_tokens`, so some
/// go before their first token, while waiting, prefilling or loading), which aborts the
/// request server-side. Which requests and where is a pure function of `seed` and the
/// request id. The other requests go through `inner` unchanged.
#[derive(Debug, Clone)]
pub struct AbortingTarget {
    pub inner: HttpTarget,
    pub rate: f64,
    pub seed: u64,
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl AbortingTarget {
    /// Whether request `rid` is aborted, and after how many tokens.
    pub fn plan(&self, rid: &str, max_new_tokens: usize) -> Option<usize> {
        let h = rid.bytes().fold(mix(self.seed), |h, b| mix(h ^ b as u64));
        let u = (h >> 11) as f64 / (1u64 << 53) as f64;
        (u < self.rate).then(|| (mix(h) % max_new_tokens.max(1) as u64) as usize)
    }
}

impl Target for AbortingTarget {
    fn generate(
        &self,
        rid: &str,
        prompt: &[u32],
        s: &SamplingParams,
        deadline: Duration,
    ) -> Result<TurnTrace, TurnFailure> {
        let Some(after) = self.plan(rid, s.max_new_tokens) else {
            return self.inner.generate(rid, prompt, s, deadline);
        };
        let mut body = generate_body(rid, prompt, s);
        body["stream"] = json!(true);
        match stream_until(self.inner.addr, &body.to_string(), deadline, after) {
            Ok(StreamEnd::ClosedEarly) => Err(TurnFailure::Aborted),
            Ok(StreamEnd::Finished { last, ttft }) => {
                let mut t = parse_generate(&last, prompt.len())?;
                t.ttft = ttft;
                Ok(t)
            }
            Ok(StreamEnd::Status(status, body)) => Err(TurnFailure::Refused(format!(
                "status {status}: {}",
                String::from_utf8_lossy(&body)
            ))),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Err(TurnFailure::Wedged(format!(
                    "no response within {deadline:?}"
                )))
            }
            Err(e) => Err(TurnFailure::Refused(format!("transport: {e}"))),
        }
    }
}

/// How a streamed `/generate` ended.
enum StreamEnd {
    /// The client closed the connection after the planned tokens.
    ClosedEarly,
    /// The server finished first: the last event and the client-side TTFT (seconds).
    Finished { last: Value, ttft: Option<f64> },
    /// A non-200 answer.
    Status(u16, Vec<u8>),
}

/// Streams `/generate` and closes the connection once `stop_after` tokens arrived (at
/// once when 0). The socket reads are bounded by `deadline`.
fn stream_until(
    addr: SocketAddr,
    body: &str,
    deadline: Duration,
    stop_after: usize,
) -> std::io::Result<StreamEnd> {
    let started = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, deadline)?;
    s.set_read_timeout(Some(deadline))?;
    s.set_write_timeout(Some(deadline))?;
    let req = format!(
        "POST /generate HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())?;
    if stop_after == 0 {
        return Ok(StreamEnd::ClosedEarly);
    }
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed HTTP stream");
    let mut raw: Vec<u8> = Vec::new();
    let mut buf = [0u8; 8192];
    let mut head: Option<(u16, bool)> = None;
    let mut pos = 0; // start of the undecoded body bytes in `raw`
    let mut events: Vec<u8> = Vec::new();
    let mut last = Value::Null;
    let mut ttft = None;
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if head.is_none() {
            let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let h = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
            let status: u16 = h
                .split(' ')
                .nth(1)
                .and_then(|x| x.parse().ok())
                .ok_or_else(bad)?;
            head = Some((status, h.contains("transfer-encoding: chunked")));
            pos = split + 4;
        }
        let Some((status, chunked)) = head else {
            continue;
        };
        if status != 200 {
            continue;
        }
        // Decode whole chunks into the event buffer.
        if chunked {
            loop {
                let rest = &raw[pos..];
                let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
                    break;
                };
                let size = std::str::from_utf8(&rest[..eol])
                    .ok()
                    .and_then(|x| usize::from_str_radix(x.trim(), 16).ok())
                    .ok_or_else(bad)?;
                if rest.len() < eol + 2 + size + 2 {
                    break;
                }
                events.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
                pos += eol + 2 + size + 2;
            }
        } else {
            events.extend_from_slice(&raw[pos..]);
            pos = raw.len();
        }
        while let Some(end) = events.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = events.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&ev);
            let Some(data) = text.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                return Ok(StreamEnd::Finished { last, ttft });
            }
            let v: Value = serde_json::from_str(data).map_err(|_| bad())?;
            let tokens = v["output_ids"].as_array().map_or(0, Vec::len);
            if tokens > 0 && ttft.is_none() {
                ttft = Some(started.elapsed().as_secs_f64());
            }
            if !v["error"].is_null() {
                return Ok(StreamEnd::Status(500, data.as_bytes().to_vec()));
            }
            last = v;
            if tokens >= stop_after && last["meta_info"]["finish_reason"].is_null() {
                return Ok(StreamEnd::ClosedEarly);
            }
        }
    }
    match head {
        Some((status, _)) if status != 200 => Ok(StreamEnd::Status(status, raw[pos..].to_vec())),
        Some(_) if !last.is_null() => Ok(StreamEnd::Finished { last, ttft }),
        _ => Err(bad()),
    }
}

/// Progress callback: called once per finished turn.
pub type Progress<'a> = &'a (dyn Fn() + Sync);

/// How a run sends its turns.
#[derive(Clone, Copy)]
struct Mode<'a> {
    deadline: Duration,
    /// Request-id prefix.
    tag: &'a str,
    /// Pace turns by their jitter.
    jitter: bool,
    progress: Progress<'a>,
    stop: &'a AtomicBool,
}

fn run_session(target: &dyn Target, w: &Workload, s: usize, m: &Mode<'_>) -> SessionTrace {
    let Mode {
        deadline,
        tag,
        jitter,
        progress,
        stop,
    } = *m;
    let plan = &w.sessions[s];
    let mut trace = SessionTrace {
        session: s,
        ..Default::default()
    };
    let mut replies: Vec<Vec<u32>> = Vec::new();
    for (t, turn) in plan.turns.iter().enumerate() {
        if stop.load(Ordering::Relaxed) {
            trace.failure = Some((t, TurnFailure::Aborted));
            break;
        }
        if jitter && turn.jitter_ms > 0 {
            // Workload pacing (arrival jitter), not synchronisation.
            std::thread::sleep(Duration::from_millis(turn.jitter_ms));
        }
        let prompt = plan.prompt(w, t, &replies);
        let rid = format!("{tag}-s{s}-t{t}");
        match target.generate(&rid, &prompt, &turn.sampling, deadline) {
            Ok(tr) => {
                replies.push(tr.tokens.clone());
                trace.turns.push(tr);
                progress();
            }
            Err(f) => {
                trace.failure = Some((t, f));
                progress();
                break;
            }
        }
    }
    trace
}

/// The reference run: every session's turns in order, one request at a time.
pub fn run_reference(
    target: &dyn Target,
    w: &Workload,
    deadline: Duration,
    progress: Progress<'_>,
) -> Vec<SessionTrace> {
    let stop = AtomicBool::new(false);
    let mode = Mode {
        deadline,
        tag: "ref",
        jitter: false,
        progress,
        stop: &stop,
    };
    (0..w.sessions.len())
        .map(|s| run_session(target, w, s, &mode))
        .collect()
}

/// The served run: every session on its own thread, all concurrently, turns paced by
/// their jitter; each request waits at most `deadline`. Request ids start with `tag`.
pub fn run_concurrent(
    target: &dyn Target,
    w: &Workload,
    deadline: Duration,
    tag: &str,
    progress: Progress<'_>,
) -> Vec<SessionTrace> {
    let stop = AtomicBool::new(false);
    let mode = Mode {
        deadline,
        tag,
        jitter: true,
        progress,
        stop: &stop,
    };
    let out: Mutex<Vec<SessionTrace>> = Mutex::new(Vec::with_capacity(w.sessions.len()));
    std::thread::scope(|scope| {
        for s in 0..w.sessions.len() {
            let (out, mode) = (&out, &mode);
            scope.spawn(move || {
                let t = run_session(target, w, s, mode);
                match out.lock() {
                    Ok(mut o) => o.push(t),
                    Err(p) => p.into_inner().push(t),
                }
            });
        }
    });
    let mut v = match out.into_inner() {
        Ok(v) => v,
        Err(p) => p.into_inner(),
    };
    v.sort_by_key(|t| t.session);
    v
}

/// Periodically times `/health` while `running` holds; returns the latencies (seconds).
pub fn probe_health(addr: SocketAddr, every: Duration, running: &AtomicBool) -> Vec<f64> {
    let mut lat = Vec::new();
    while running.load(Ordering::Relaxed) {
        let t = Instant::now();
        let ok = matches!(
            http_exchange(addr, "GET", "/health", b"", Duration::from_secs(5)),
            Ok((200, _))
        );
        lat.push(if ok {
            t.elapsed().as_secs_f64()
        } else {
            f64::INFINITY
        });
        std::thread::sleep(every);
    }
    lat
}
