//! The PD wire format: versioned, length-prefixed, checksummed frames with strict decoding.
//!
//! One frame (all integers little-endian):
//!
//! ```text
//! offset  size  field
//!      0     4  magic  b"SKPD"
//!      4     2  version (VERSION)
//!      6     1  kind    (message type, see `Message`)
//!      7     1  flags   (must be 0)
//!      8     4  payload length in bytes (<= MAX_PAYLOAD)
//!     12     4  CRC-32C of the payload
//!     16     4  CRC-32C of bytes 0..16 (the header)
//!     20     …  payload
//! ```
//!
//! Decoding is strict: every field is range-checked, every count is bounded by the bytes
//! that are actually there (a hostile count cannot make the decoder allocate), the payload
//! must be consumed exactly, strings are UTF-8 of bounded length. Any deviation is a typed
//! [`WireError`] with a short [`WireError::reason`] (the metrics label); nothing panics.
//!
//! Datagram-style transports (the in-process channel, NIXL notifications) carry exactly one
//! frame per message: [`decode_frame`]. Stream transports (the TCP control channel) use
//! [`FrameReader`], which resynchronises after garbage: a header whose CRC fails is
//! skipped byte by byte until the next valid header, so one corrupt frame costs that
//! frame only.

use sparsekit_host::cache::{BufferKind, PageRef};
pub use sparsekit_host::Arithmetic;
use thiserror::Error;

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"SKPD";
/// The protocol version this build speaks (and the only one it accepts). 2: `Hello`
/// carries the whole-spec fingerprint and page kinds are numbered by
/// [`BufferKind::index`] (V4's compressed-KV and state pools). 3: prefill's `Pending`
/// heartbeat. 4: `Hello` carries the kernels' arithmetic ([`Arithmetic`]).
pub const VERSION: u16 = 4;
/// Bytes of the frame header.
pub const HEADER_LEN: usize = 20;
/// Largest payload accepted (bytes).
pub const MAX_PAYLOAD: usize = 16 << 20;
/// Longest reason string in `Cancelled` / `Abort` (bytes of UTF-8).
pub const MAX_REASON: usize = 1024;

/// `reason` cut to at most [`MAX_REASON`] bytes at a char boundary: what the `Abort` and
/// `Cancelled` senders pass, so a long reason never makes the message unsendable.
pub fn fit_reason(mut reason: String) -> String {
    if reason.len() > MAX_REASON {
        let mut end = MAX_REASON;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    reason
}
/// Longest opaque transport blob in `Hello` (bytes).
pub const MAX_TRANSPORT_INFO: usize = 1 << 20;

/// Why a frame was not accepted. [`WireError::reason`] is the stable label counted in
/// metrics (`sparsekit_refused_total{reason}`).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum WireError {
    /// Fewer bytes than the header or the declared payload needs.
    #[error("truncated frame: {need} bytes needed, {have} present")]
    Truncated { need: usize, have: usize },
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    Version(u16),
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("reserved flags set: {0:#04x}")]
    Flags(u8),
    #[error("payload of {0} bytes exceeds the limit of {MAX_PAYLOAD}")]
    TooLarge(usize),
    #[error("header checksum mismatch")]
    HeaderChecksum,
    #[error("payload checksum mismatch")]
    PayloadChecksum,
    /// The payload does not parse as its kind.
    #[error("malformed {kind} payload: {detail}")]
    Malformed { kind: &'static str, detail: String },
    /// Bytes left after the payload or after the frame.
    #[error("{0} unexpected trailing bytes")]
    Trailing(usize),
}

impl WireError {
    /// Stable short label of the error class.
    pub fn reason(&self) -> &'static str {
        match self {
            WireError::Truncated { .. } => "truncated",
            WireError::BadMagic(_) => "bad_magic",
            WireError::Version(_) => "bad_version",
            WireError::UnknownKind(_) => "unknown_kind",
            WireError::Flags(_) => "bad_flags",
            WireError::TooLarge(_) => "too_large",
            WireError::HeaderChecksum | WireError::PayloadChecksum => "corrupt",
            WireError::Malformed { .. } => "malformed",
            WireError::Trailing(_) => "trailing_bytes",
        }
    }
}

/// Which side of a PD pair an endpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn name(&self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Connection handshake, sent once by each side when a connection opens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    /// Fingerprint of the KV page layout descriptor.
    pub kv_fingerprint: u64,
    /// Fingerprint of the index-K page layout descriptor.
    pub index_k_fingerprint: u64,
    /// Fingerprint of the whole cache spec ([`CacheSpec::fingerprint`]: every pool, its
    /// layers and tokens per entry); catches a V4 peer whose extra pools differ.
    ///
    /// [`CacheSpec::fingerprint`]: sparsekit_host::cache::CacheSpec::fingerprint
    pub spec_fingerprint: u64,
    pub num_layers: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// The arithmetic of the sender's kernels (its backend's [`Backend::arithmetic`]): the
    /// bits its pages hold depend on it.
    ///
    /// [`Backend::arithmetic`]: sparsekit_host::Backend::arithmetic
    pub arithmetic: Arithmetic,
    /// Pages of the sender's landing zone (decode; 0 for prefill): the page ids a
    /// bootstrap may name are below this.
    pub landing_pages: u32,
    /// Transport-specific connection data (NIXL: agent metadata and the landing zone's
    /// address); opaque to the protocol.
    pub transport: Vec<u8>,
}

/// Decode → prefill: transfer this prompt's KV and index-K into these pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bootstrap {
    pub req: u64,
    pub kv_fingerprint: u64,
    pub index_k_fingerprint: u64,
    /// Prompt token ids (non-empty); every token's KV is transferred.
    pub prompt: Vec<u32>,
    /// Destination pages on decode, in token order (`pages[i]` holds tokens
    /// `i·page_size ..`), each with the generation it had when decode allocated it.
    pub pages: Vec<PageRef>,
}

/// Prefill → decode: one layer's pages of one kind were written into the landing zone.
/// Sent after the bytes landed (as the NIXL write's notification message).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    pub req: u64,
    pub layer: u32,
    pub kind: BufferKind,
    /// Fingerprint of the layout the sender framed these pages with.
    pub fingerprint: u64,
    /// Destination pages written (non-empty).
    pub pages: Vec<PageRef>,
    /// Checksum of each page as the sender computed it over its own copy
    /// (`page_checksums` with the layout named by `fingerprint`).
    pub checksums: Vec<u64>,
}

/// Every message of the protocol ([`VERSION`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Both ways, first on a connection.
    Hello(Hello),
    /// Decode → prefill.
    Bootstrap(Bootstrap),
    /// Prefill → decode.
    Written(Written),
    /// Prefill → decode: every layer of `req` was written (all writes completed); nothing
    /// more will land for it. `tokens`: prompt tokens whose KV was transferred.
    Finished { req: u64, tokens: u32 },
    /// Prefill → decode: answer to decode's `Abort`; nothing more will land for `req`.
    Cancelled { req: u64, reason: String },
    /// Both ways. Decode → prefill: stop transferring `req` (answered by `Cancelled`).
    /// Prefill → decode: prefill gave `req` up; nothing more will land for it.
    Abort { req: u64, reason: String },
    /// Prefill → decode, periodically: these transfers are queued or being computed and
    /// prefill's engine is advancing. It is what keeps a transfer that waits behind other
    /// prompts alive under decode's stall bound, which measures prefill's silence, not
    /// its queue. Never empty.
    Pending { reqs: Vec<u64> },
}

const K_HELLO: u8 = 1;
const K_BOOTSTRAP: u8 = 2;
const K_WRITTEN: u8 = 3;
const K_FINISHED: u8 = 4;
const K_CANCELLED: u8 = 5;
const K_ABORT: u8 = 6;
const K_PENDING: u8 = 7;
/// Requests in one `Pending` frame, at most.
pub const MAX_PENDING: usize = 65536;

impl Message {
    /// Short name of the message type (logs, metrics).
    pub fn name(&self) -> &'static str {
        kind_name(self.kind())
    }

    fn kind(&self) -> u8 {
        match self {
            Message::Hello(_) => K_HELLO,
            Message::Bootstrap(_) => K_BOOTSTRAP,
            Message::Written(_) => K_WRITTEN,
            Message::Finished { .. } => K_FINISHED,
            Message::Cancelled { .. } => K_CANCELLED,
            Message::Abort { .. } => K_ABORT,
            Message::Pending { .. } => K_PENDING,
        }
    }

    /// The request the message is about (`None` for `Hello` and `Pending`, which name
    /// none or several).
    pub fn request(&self) -> Option<u64> {
        match self {
            Message::Hello(_) | Message::Pending { .. } => None,
            Message::Bootstrap(b) => Some(b.req),
            Message::Written(w) => Some(w.req),
            Message::Finished { req, .. }
            | Message::Cancelled { req, .. }
            | Message::Abort { req, .. } => Some(*req),
        }
    }

    /// Whether a side with role `to` may receive this message.
    pub fn valid_towards(&self, to: Role) -> bool {
        match self {
            Message::Hello(_) | Message::Abort { .. } => true,
            Message::Bootstrap(_) => to == Role::Prefill,
            Message::Written(_)
            | Message::Finished { .. }
            | Message::Cancelled { .. }
            | Message::Pending { .. } => to == Role::Decode,
        }
    }

    /// The whole frame (header and payload). Refuses a message that the decoder would
    /// refuse (empty lists, mismatched lengths, oversized fields).
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let mut p = Vec::new();
        let kind = kind_name(self.kind());
        let bad = |detail: &str| WireError::Malformed {
            kind,
            detail: detail.into(),
        };
        match self {
            Message::Hello(h) => {
                if h.transport.len() > MAX_TRANSPORT_INFO {
                    return Err(bad("transport info too long"));
                }
                p.push(match h.role {
                    Role::Prefill => 1,
                    Role::Decode => 2,
                });
                put_u64(&mut p, h.kv_fingerprint);
                put_u64(&mut p, h.index_k_fingerprint);
                put_u64(&mut p, h.spec_fingerprint);
                put_u32(&mut p, h.num_layers);
                put_u32(&mut p, h.page_size);
                p.push(match h.arithmetic {
                    Arithmetic::Shared => 0,
                    Arithmetic::AmxTiles => 1,
                });
                put_u32(&mut p, h.landing_pages);
                put_u32(&mut p, h.transport.len() as u32);
                p.extend_from_slice(&h.transport);
            }
            Message::Bootstrap(b) => {
                if b.prompt.is_empty() || b.pages.is_empty() {
                    return Err(bad("empty prompt or page list"));
                }
                put_u64(&mut p, b.req);
                put_u64(&mut p, b.kv_fingerprint);
                put_u64(&mut p, b.index_k_fingerprint);
                put_u32(&mut p, len_u32(b.prompt.len(), kind)?);
                for &t in &b.prompt {
                    put_u32(&mut p, t);
                }
                put_u32(&mut p, len_u32(b.pages.len(), kind)?);
                for r in &b.pages {
                    put_u32(&mut p, r.id);
                    put_u32(&mut p, r.generation);
                }
            }
            Message::Written(w) => {
                if w.pages.is_empty() || w.pages.len() != w.checksums.len() {
                    return Err(bad(
                        "pages and checksums must be non-empty and of equal length",
                    ));
                }
                put_u64(&mut p, w.req);
                put_u32(&mut p, w.layer);
                p.push(w.kind.index() as u8);
                put_u64(&mut p, w.fingerprint);
                put_u32(&mut p, len_u32(w.pages.len(), kind)?);
                for (r, &c) in w.pages.iter().zip(&w.checksums) {
                    put_u32(&mut p, r.id);
                    put_u32(&mut p, r.generation);
                    put_u64(&mut p, c);
                }
            }
            Message::Finished { req, tokens } => {
                put_u64(&mut p, *req);
                put_u32(&mut p, *tokens);
            }
            Message::Cancelled { req, reason } | Message::Abort { req, reason } => {
                if reason.len() > MAX_REASON {
                    return Err(bad("reason too long"));
                }
                put_u64(&mut p, *req);
                put_u16(&mut p, reason.len() as u16);
                p.extend_from_slice(reason.as_bytes());
            }
            Message::Pending { reqs } => {
                if reqs.is_empty() || reqs.len() > MAX_PENDING {
                    return Err(bad("request list empty or too long"));
                }
                put_u32(&mut p, reqs.len() as u32);
                for &r in reqs {
                    put_u64(&mut p, r);
                }
            }
        }
        if p.len() > MAX_PAYLOAD {
            return Err(WireError::TooLarge(p.len()));
        }
        let mut f = Vec::with_capacity(HEADER_LEN + p.len());
        f.extend_from_slice(&MAGIC);
        put_u16(&mut f, VERSION);
        f.push(self.kind());
        f.push(0);
        put_u32(&mut f, p.len() as u32);
        put_u32(&mut f, crc32c(&p));
        let hc = crc32c(&f);
        put_u32(&mut f, hc);
        f.extend_from_slice(&p);
        Ok(f)
    }
}

fn kind_name(k: u8) -> &'static str {
    match k {
        K_HELLO => "hello",
        K_BOOTSTRAP => "bootstrap",
        K_WRITTEN => "written",
        K_FINISHED => "finished",
        K_CANCELLED => "cancelled",
        K_ABORT => "abort",
        K_PENDING => "pending",
        _ => "unknown",
    }
}

fn len_u32(n: usize, kind: &'static str) -> Result<u32, WireError> {
    u32::try_from(n).map_err(|_| WireError::Malformed {
        kind,
        detail: format!("{n} entries"),
    })
}

fn put_u16(v: &mut Vec<u8>, x: u16) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// A validated header.
#[derive(Clone, Copy, Debug)]
struct Header {
    kind: u8,
    len: usize,
    payload_crc: u32,
}

/// Checks the header at the start of `b` (at least [`HEADER_LEN`] bytes). The header CRC
/// is checked before anything it protects is interpreted.
fn parse_header(b: &[u8]) -> Result<Header, WireError> {
    let mut magic = [0u8; 4];
    magic.copy_from_slice(&b[..4]);
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    if crc32c(&b[..16]) != le_u32(&b[16..20]) {
        return Err(WireError::HeaderChecksum);
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(WireError::Version(version));
    }
    let kind = b[6];
    if kind_name(kind) == "unknown" {
        return Err(WireError::UnknownKind(kind));
    }
    if b[7] != 0 {
        return Err(WireError::Flags(b[7]));
    }
    let len = le_u32(&b[8..12]) as usize;
    if len > MAX_PAYLOAD {
        return Err(WireError::TooLarge(len));
    }
    Ok(Header {
        kind,
        len,
        payload_crc: le_u32(&b[12..16]),
    })
}

fn le_u32(b: &[u8]) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[..4]);
    u32::from_le_bytes(w)
}

/// Decodes exactly one frame occupying all of `bytes`.
pub fn decode_frame(bytes: &[u8]) -> Result<Message, WireError> {
    if bytes.len() < HEADER_LEN {
        return Err(WireError::Truncated {
            need: HEADER_LEN,
            have: bytes.len(),
        });
    }
    let h = parse_header(bytes)?;
    let total = HEADER_LEN + h.len;
    if bytes.len() < total {
        return Err(WireError::Truncated {
            need: total,
            have: bytes.len(),
        });
    }
    if bytes.len() > total {
        return Err(WireError::Trailing(bytes.len() - total));
    }
    decode_payload(h, &bytes[HEADER_LEN..])
}

fn decode_payload(h: Header, payload: &[u8]) -> Result<Message, WireError> {
    if crc32c(payload) != h.payload_crc {
        return Err(WireError::PayloadChecksum);
    }
    let mut r = Reader {
        b: payload,
        kind: kind_name(h.kind),
    };
    let m = match h.kind {
        K_HELLO => {
            let role = match r.u8("role")? {
                1 => Role::Prefill,
                2 => Role::Decode,
                x => return Err(r.bad(format!("role {x}"))),
            };
            let kv_fingerprint = r.u64("kv fingerprint")?;
            let index_k_fingerprint = r.u64("index-K fingerprint")?;
            let spec_fingerprint = r.u64("spec fingerprint")?;
            let num_layers = r.u32("layers")?;
            let page_size = r.u32("page size")?;
            let arithmetic = match r.u8("arithmetic")? {
                0 => Arithmetic::Shared,
                1 => Arithmetic::AmxTiles,
                x => return Err(r.bad(format!("arithmetic {x}"))),
            };
            let landing_pages = r.u32("landing pages")?;
            let n = r.count("transport info", 1, MAX_TRANSPORT_INFO)?;
            let transport = r.bytes(n, "transport info")?.to_vec();
            if num_layers == 0 || page_size == 0 {
                return Err(r.bad("zero layers or page size".into()));
            }
            Message::Hello(Hello {
                role,
                kv_fingerprint,
                index_k_fingerprint,
                spec_fingerprint,
                num_layers,
                page_size,
                arithmetic,
                landing_pages,
                transport,
            })
        }
        K_BOOTSTRAP => {
            let req = r.u64("request")?;
            let kv_fingerprint = r.u64("kv fingerprint")?;
            let index_k_fingerprint = r.u64("index-K fingerprint")?;
            let n = r.count("prompt", 4, usize::MAX)?;
            if n == 0 {
                return Err(r.bad("empty prompt".into()));
            }
            let prompt = (0..n)
                .map(|_| r.u32("prompt token"))
                .collect::<Result<Vec<_>, _>>()?;
            let n = r.count("pages", 8, usize::MAX)?;
            if n == 0 {
                return Err(r.bad("no pages".into()));
            }
            let pages = (0..n).map(|_| r.page()).collect::<Result<Vec<_>, _>>()?;
            Message::Bootstrap(Bootstrap {
                req,
                kv_fingerprint,
                index_k_fingerprint,
                prompt,
                pages,
            })
        }
        K_WRITTEN => {
            let req = r.u64("request")?;
            let layer = r.u32("layer")?;
            let code = r.u8("buffer kind")?;
            let Some(kind) = BufferKind::from_index(code as usize) else {
                return Err(r.bad(format!("buffer kind {code}")));
            };
            let fingerprint = r.u64("fingerprint")?;
            let n = r.count("pages", 16, usize::MAX)?;
            if n == 0 {
                return Err(r.bad("no pages".into()));
            }
            let mut pages = Vec::with_capacity(n);
            let mut checksums = Vec::with_capacity(n);
            for _ in 0..n {
                pages.push(r.page()?);
                checksums.push(r.u64("checksum")?);
            }
            Message::Written(Written {
                req,
                layer,
                kind,
                fingerprint,
                pages,
                checksums,
            })
        }
        K_FINISHED => Message::Finished {
            req: r.u64("request")?,
            tokens: r.u32("tokens")?,
        },
        K_CANCELLED | K_ABORT => {
            let req = r.u64("request")?;
            let n = r.u16("reason length")? as usize;
            if n > MAX_REASON {
                return Err(r.bad(format!("reason of {n} bytes")));
            }
            let reason = std::str::from_utf8(r.bytes(n, "reason")?)
                .map_err(|_| r.bad("reason is not UTF-8".into()))?
                .to_owned();
            if h.kind == K_CANCELLED {
                Message::Cancelled { req, reason }
            } else {
                Message::Abort { req, reason }
            }
        }
        K_PENDING => {
            let n = r.count("requests", 8, MAX_PENDING)?;
            if n == 0 {
                return Err(r.bad("no requests".into()));
            }
            let reqs = (0..n)
                .map(|_| r.u64("request"))
                .collect::<Result<Vec<_>, _>>()?;
            Message::Pending { reqs }
        }
        k => return Err(WireError::UnknownKind(k)),
    };
    if !r.b.is_empty() {
        return Err(WireError::Trailing(r.b.len()));
    }
    Ok(m)
}

/// Bounds-checked little-endian reader over a payload.
struct Reader<'a> {
    b: &'a [u8],
    kind: &'static str,
}

impl<'a> Reader<'a> {
    fn bad(&self, detail: String) -> WireError {
        WireError::Malformed {
            kind: self.kind,
            detail,
        }
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(self.bad(format!("{what}: {n} bytes needed, {} left", self.b.len())));
        }
        let (head, tail) = self.b.split_at(n);
        self.b = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        Ok(self.bytes(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, WireError> {
        let b = self.bytes(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, WireError> {
        Ok(le_u32(self.bytes(4, what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.bytes(8, what)?);
        Ok(u64::from_le_bytes(w))
    }
    fn page(&mut self) -> Result<PageRef, WireError> {
        Ok(PageRef {
            id: self.u32("page id")?,
            generation: self.u32("page generation")?,
        })
    }

    /// A `u32` count of entries of `elem` bytes each: refused when the bytes left cannot
    /// hold them (so a hostile count never drives an allocation) or it exceeds `max`.
    fn count(&mut self, what: &str, elem: usize, max: usize) -> Result<usize, WireError> {
        let n = self.u32(what)? as usize;
        if n > max || n.saturating_mul(elem) > self.b.len() {
            return Err(self.bad(format!(
                "{what}: {n} entries do not fit in {} bytes",
                self.b.len()
            )));
        }
        Ok(n)
    }
}

/// Splits a byte stream into frames. Push bytes as they arrive; pull frames. After a
/// header error it skips to the next possible header (resynchronisation); a frame whose
/// payload is corrupt costs that frame only.
#[derive(Debug, Default)]
pub struct FrameReader {
    buf: Vec<u8>,
}

impl FrameReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes buffered but not yet consumed.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next piece of the stream, undecoded: a whole frame (valid header, payload not
    /// yet checked), or a run of bytes skipped while resynchronising (which
    /// [`decode_frame`] refuses, so it is counted like any bad frame). `None` when more
    /// bytes are needed.
    pub fn next_raw(&mut self) -> Option<Vec<u8>> {
        if self.buf.len() < HEADER_LEN {
            // Keep what could still be the start of a header.
            return None;
        }
        match parse_header(&self.buf) {
            Err(_) => {
                // Skip to the next possible magic.
                let skip = self.buf[1..]
                    .windows(4)
                    .position(|w| w == MAGIC)
                    .map_or(self.buf.len().saturating_sub(3), |p| p + 1)
                    .max(1);
                Some(self.buf.drain(..skip).collect())
            }
            Ok(h) => {
                let total = HEADER_LEN + h.len;
                if self.buf.len() < total {
                    return None;
                }
                Some(self.buf.drain(..total).collect())
            }
        }
    }

    /// The next frame, decoded: `None` when more bytes are needed; `Some(Err)` for garbage
    /// or a dropped frame (call again: reading goes on after it).
    pub fn next_frame(&mut self) -> Option<Result<Message, WireError>> {
        self.next_raw().map(|raw| decode_frame(&raw))
    }
}

/// CRC-32C (Castagnoli, reflected, as in iSCSI/ext4) of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c = CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

const CRC_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82f6_3b78
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vector() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    fn sample() -> Message {
        Message::Written(Written {
            req: 7,
            layer: 3,
            kind: BufferKind::IndexK,
            fingerprint: 0xdead_beef,
            pages: vec![
                PageRef {
                    id: 1,
                    generation: 2,
                },
                PageRef {
                    id: 9,
                    generation: 0,
                },
            ],
            checksums: vec![11, 22],
        })
    }

    #[test]
    fn every_truncation_and_extension_is_refused() {
        let f = sample().encode().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(decode_frame(&f), Ok(sample()));
        for n in 0..f.len() {
            let e = decode_frame(&f[..n]).expect_err("truncated frame accepted");
            assert_eq!(e.reason(), "truncated", "{n} bytes");
        }
        let mut long = f.clone();
        long.push(0);
        assert_eq!(decode_frame(&long), Err(WireError::Trailing(1)));
    }

    #[test]
    fn header_fields_are_checked_after_the_header_crc() {
        let f = sample().encode().unwrap_or_else(|e| panic!("{e}"));
        let reseal = |mut f: Vec<u8>| {
            let c = crc32c(&f[..16]);
            f[16..20].copy_from_slice(&c.to_le_bytes());
            f
        };
        let mut v = f.clone();
        v[4] = (VERSION + 1) as u8;
        assert_eq!(
            decode_frame(&reseal(v.clone())),
            Err(WireError::Version(VERSION + 1))
        );
        assert_eq!(decode_frame(&v), Err(WireError::HeaderChecksum));
        let mut k = f.clone();
        k[6] = 99;
        assert_eq!(decode_frame(&reseal(k)), Err(WireError::UnknownKind(99)));
        let mut fl = f.clone();
        fl[7] = 1;
        assert_eq!(decode_frame(&reseal(fl)), Err(WireError::Flags(1)));
        let mut big = f.clone();
        big[8..12].copy_from_slice(&((MAX_PAYLOAD + 1) as u32).to_le_bytes());
        assert!(matches!(
            decode_frame(&reseal(big)),
            Err(WireError::TooLarge(_))
        ));
        let mut m = f.clone();
        m[0] = b'X';
        assert!(matches!(decode_frame(&m), Err(WireError::BadMagic(_))));
        let mut p = f;
        let last = p.len() - 1;
        p[last] ^= 0x40;
        assert_eq!(decode_frame(&p), Err(WireError::PayloadChecksum));
    }

    /// A payload whose count claims more entries than its bytes hold is refused without
    /// allocating for the claimed count.
    #[test]
    fn hostile_counts_are_refused() {
        let mut p = Vec::new();
        put_u64(&mut p, 1);
        put_u64(&mut p, 2);
        put_u64(&mut p, 3);
        put_u32(&mut p, u32::MAX);
        let h = Header {
            kind: K_BOOTSTRAP,
            len: p.len(),
            payload_crc: crc32c(&p),
        };
        assert_eq!(
            decode_payload(h, &p).map_err(|e| e.reason()),
            Err("malformed")
        );
    }

    #[test]
    fn encode_refuses_what_decode_would_refuse() {
        let Message::Written(mut w) = sample() else {
            unreachable!()
        };
        w.checksums.pop();
        assert!(Message::Written(w).encode().is_err());
        let m = Message::Abort {
            req: 1,
            reason: "x".repeat(MAX_REASON + 1),
        };
        assert!(m.encode().is_err());
    }
}
