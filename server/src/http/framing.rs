//! A request with a malformed `Content-Length` (`abc`, `-1`, two different values) is
//! refused by hyper's parser before any handler runs, with an empty 400. To answer it in
//! OpenAI's JSON shape like every other bad request, [`Sniffed`] follows the request
//! framing of the bytes a connection reads (each header block, then its body by length or
//! by chunks) and, in a header block whose `Content-Length` hyper would refuse, renames
//! that header to [`INVALID_CONTENT_LENGTH`] (the same number of bytes). hyper then parses
//! the request with no body, the router answers the JSON 400 and closes the connection.
//!
//! The rename is the only change the wrapper ever makes; whatever it cannot follow (a
//! header block over 64 KiB, a malformed chunk) it passes through untouched from then on,
//! for hyper to judge.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The name a malformed `Content-Length` header is renamed to (14 bytes, as the original).
pub const INVALID_CONTENT_LENGTH: &str = "x-invalid-clen";

/// Largest header block followed (hyper refuses larger ones itself).
const MAX_HEAD: usize = 64 << 10;
/// Longest chunk-size or trailer line followed.
const MAX_LINE: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Reading a header block.
    Head,
    /// A body of this many bytes still to come.
    Fixed(u64),
    /// A chunk-size line.
    ChunkSize,
    /// Chunk data still to come, then its CRLF.
    ChunkData(u64),
    /// Trailer lines after the last chunk, up to an empty line.
    Trailers,
    /// Not followed any more.
    Passthrough,
}

/// A connection's stream whose request framing is followed (see the module docs).
#[derive(Debug)]
pub struct Sniffed<T> {
    inner: T,
    state: State,
    /// Read from `inner`, not looked at yet.
    pending: Vec<u8>,
    /// Looked at, to hand to hyper.
    ready: Vec<u8>,
    ready_at: usize,
    eof: bool,
}

impl<T> Sniffed<T> {
    pub fn new(inner: T) -> Self {
        Sniffed {
            inner,
            state: State::Head,
            pending: Vec::new(),
            ready: Vec::new(),
            ready_at: 0,
            eof: false,
        }
    }

    fn release(&mut self, n: usize) {
        self.ready.extend(self.pending.drain(..n));
    }

    /// Looks at `pending`, moving what is settled to `ready`.
    fn process(&mut self) {
        loop {
            match self.state {
                State::Passthrough => {
                    let n = self.pending.len();
                    self.release(n);
                    return;
                }
                State::Head => {
                    let Some(end) = head_end(&self.pending) else {
                        if self.pending.len() > MAX_HEAD {
                            self.state = State::Passthrough;
                            continue;
                        }
                        return;
                    };
                    self.state = inspect_head(&mut self.pending[..end]);
                    self.release(end);
                }
                State::Fixed(left) => {
                    let n = (self.pending.len() as u64).min(left) as usize;
                    self.release(n);
                    let left = left - n as u64;
                    self.state = if left == 0 {
                        State::Head
                    } else {
                        State::Fixed(left)
                    };
                    if left > 0 {
                        return;
                    }
                }
                State::ChunkSize => {
                    let Some(eol) = self.pending.iter().position(|&b| b == b'\n') else {
                        if self.pending.len() > MAX_LINE {
                            self.state = State::Passthrough;
                            continue;
                        }
                        return;
                    };
                    let line = String::from_utf8_lossy(&self.pending[..eol]).into_owned();
                    let size = line.split(';').next().unwrap_or("").trim();
                    self.state = match u64::from_str_radix(size, 16) {
                        Ok(0) => State::Trailers,
                        // The data, then its CRLF (2 bytes).
                        Ok(n) => State::ChunkData(n.saturating_add(2)),
                        Err(_) => State::Passthrough,
                    };
                    self.release(eol + 1);
                }
                State::ChunkData(left) => {
                    let n = (self.pending.len() as u64).min(left) as usize;
                    self.release(n);
                    let left = left - n as u64;
                    if left > 0 {
                        self.state = State::ChunkData(left);
                        return;
                    }
                    self.state = State::ChunkSize;
                }
                State::Trailers => {
                    let Some(eol) = self.pending.iter().position(|&b| b == b'\n') else {
                        if self.pending.len() > MAX_LINE {
                            self.state = State::Passthrough;
                            continue;
                        }
                        return;
                    };
                    let empty = self.pending[..eol].iter().all(|&b| b == b'\r');
                    self.release(eol + 1);
                    if empty {
                        self.state = State::Head;
                    }
                }
            }
        }
    }
}

/// The end of the header block at the start of `b` (after its blank line), if complete.
fn head_end(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    // Blank lines before a request line are skipped by parsers: not a header block.
    while i < b.len() && (b[i] == b'\r' || b[i] == b'\n') {
        i += 1;
    }
    let mut line_start = i;
    while let Some(nl) = b[line_start..].iter().position(|&c| c == b'\n') {
        let line = &b[line_start..line_start + nl];
        let end = line_start + nl + 1;
        if line.iter().all(|&c| c == b'\r') && line_start > i {
            return Some(end);
        }
        line_start = end;
    }
    None
}

/// Whether a `Content-Length` value is one hyper accepts: comma-separated runs of digits,
/// all the same number.
fn valid_lengths(values: &[&[u8]]) -> Option<u64> {
    let mut seen: Option<u64> = None;
    for v in values {
        for part in v.split(|&c| c == b',') {
            let part = part.trim_ascii();
            if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let n: u64 = std::str::from_utf8(part).ok()?.parse().ok()?;
            if seen.is_some_and(|s| s != n) {
                return None;
            }
            seen = Some(n);
        }
    }
    seen
}

/// Reads a header block's framing headers; renames a malformed `Content-Length`. The
/// state that follows the block.
fn inspect_head(head: &mut [u8]) -> State {
    let mut lengths: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut chunked = None;
    let mut pos = 0;
    for line in head.split(|&c| c == b'\n') {
        let start = pos;
        pos += line.len() + 1;
        let Some(colon) = line.iter().position(|&c| c == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"content-length") {
            lengths.push((start, value.to_vec()));
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            let last = value.rsplit(|&c| c == b',').next().unwrap_or(b"");
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        }
    }
    match chunked {
        Some(true) => return State::ChunkSize,
        // Any other transfer coding: hyper decides.
        Some(false) => return State::Passthrough,
        None => {}
    }
    if lengths.is_empty() {
        return State::Head;
    }
    let values: Vec<&[u8]> = lengths.iter().map(|(_, v)| v.as_slice()).collect();
    match valid_lengths(&values) {
        Some(0) => State::Head,
        Some(n) => State::Fixed(n),
        None => {
            for (start, _) in &lengths {
                head[*start..*start + INVALID_CONTENT_LENGTH.len()]
                    .copy_from_slice(INVALID_CONTENT_LENGTH.as_bytes());
            }
            // The router closes the connection after its 400; nothing after is framed.
            State::Passthrough
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Sniffed<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.ready_at < this.ready.len() {
                let n = (this.ready.len() - this.ready_at).min(buf.remaining());
                buf.put_slice(&this.ready[this.ready_at..this.ready_at + n]);
                this.ready_at += n;
                if this.ready_at == this.ready.len() {
                    this.ready.clear();
                    this.ready_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // What is left can never complete: hand it over as it is.
                if this.pending.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                this.state = State::Passthrough;
                this.process();
                continue;
            }
            let mut chunk = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    if rb.filled().is_empty() {
                        this.eof = true;
                    } else {
                        this.pending.extend_from_slice(rb.filled());
                        this.process();
                    }
                }
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Sniffed<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    async fn through(input: &[u8], cut: usize) -> Vec<u8> {
        let (mut a, b) = tokio::io::duplex(1 << 20);
        let data = input.to_vec();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let _ = a.write_all(&data[..cut]).await;
            let _ = a.flush().await;
            let _ = a.write_all(&data[cut..]).await;
        });
        let mut s = Sniffed::new(b);
        let mut out = Vec::new();
        let mut buf = [0u8; 7];
        while out.len() < input.len() {
            let n = s.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        let _ = writer.await;
        out
    }

    #[tokio::test]
    async fn malformed_lengths_are_renamed_and_nothing_else_changes() {
        let good = b"POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello\
            POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n\
            GET /c HTTP/1.1\r\ncontent-length: abc\r\n\r\n";
        for cut in 0..good.len() {
            let out = through(good, cut).await;
            let want =
                String::from_utf8_lossy(good).replace("content-length: abc", "x-invalid-clen: abc");
            assert_eq!(String::from_utf8_lossy(&out), want, "cut at {cut}");
        }
        // A body that looks like a header block is not inspected.
        let body = b"POST /a HTTP/1.1\r\nContent-Length: 27\r\n\r\nContent-Length: x\r\n\r\n12345";
        assert_eq!(through(body, 3).await, body.to_vec());
        for bad in ["-1", "1,2", "", "0x10", "1 2"] {
            let mut h = b"POST / HTTP/1.1\r\nHost: x\r\n".to_vec();
            h.extend_from_slice(format!("Content-Length: {bad}\r\n\r\n").as_bytes());
            let out = through(&h, 0).await;
            assert!(
                String::from_utf8_lossy(&out).contains("x-invalid-clen:"),
                "{bad}"
            );
        }
        let dup = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc";
        assert_eq!(through(dup, 10).await, dup.to_vec());
    }
}
