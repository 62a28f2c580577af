//! The in-process transport: two ends joined by channels and one shared landing zone.
//! Same frames, same checks as any other transport; a write is a copy into the decode
//! end's landing zone, bounds-checked like a registered-memory write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::pd::error::PdError;
use crate::pd::landing::LandingZone;
use crate::pd::wire::{decode_frame, Hello, Message, Role};
use crate::transfer::{Segment, TransferError, Transport};

/// What the two ends share.
#[derive(Debug)]
struct Link {
    closed: AtomicBool,
    why: Mutex<String>,
}

/// One end of an in-process connection (see [`pair`]).
#[derive(Debug)]
pub struct LocalEnd {
    role: Role,
    peer: Hello,
    tx: flume::Sender<Vec<u8>>,
    rx: flume::Receiver<Vec<u8>>,
    /// Into our own inbox: wakes our reader on close.
    wake: flume::Sender<Vec<u8>>,
    /// The decode end's landing zone (on both ends: decode owns it, prefill writes it).
    landing: Arc<LandingZone>,
    link: Arc<Link>,
}

/// Connects a decode end (announcing `decode`, owning `landing`) and a prefill end
/// (announcing `prefill`). Each handshake goes through the wire codec, as it would over a
/// network. Returns `(decode end, prefill end)`.
pub fn pair(
    landing: Arc<LandingZone>,
    decode: Hello,
    prefill: Hello,
) -> Result<(Arc<LocalEnd>, Arc<LocalEnd>), PdError> {
    let through_wire = |h: Hello, role: Role| -> Result<Hello, PdError> {
        if h.role != role {
            return Err(PdError::Invalid(format!(
                "the {} end announced role {}",
                role.name(),
                h.role.name()
            )));
        }
        match decode_frame(&Message::Hello(h).encode()?)? {
            Message::Hello(h) => Ok(h),
            m => Err(PdError::Invalid(format!(
                "handshake decoded as {}",
                m.name()
            ))),
        }
    };
    let decode = through_wire(decode, Role::Decode)?;
    let prefill = through_wire(prefill, Role::Prefill)?;
    let (to_decode, decode_rx) = flume::unbounded();
    let (to_prefill, prefill_rx) = flume::unbounded();
    let link = Arc::new(Link {
        closed: AtomicBool::new(false),
        why: Mutex::new(String::new()),
    });
    let d = LocalEnd {
        role: Role::Decode,
        peer: prefill,
        tx: to_prefill.clone(),
        rx: decode_rx,
        wake: to_decode.clone(),
        landing: landing.clone(),
        link: link.clone(),
    };
    let p = LocalEnd {
        role: Role::Prefill,
        peer: decode,
        tx: to_decode,
        rx: prefill_rx,
        wake: to_prefill,
        landing,
        link,
    };
    Ok((Arc::new(d), Arc::new(p)))
}

impl LocalEnd {
    fn closed_err(&self) -> TransferError {
        TransferError::Closed(self.link.why.lock().clone())
    }

    fn check_open(&self) -> Result<(), TransferError> {
        if self.link.closed.load(Ordering::Acquire) {
            Err(self.closed_err())
        } else {
            Ok(())
        }
    }
}

impl Transport for LocalEnd {
    fn name(&self) -> &'static str {
        "local"
    }

    fn peer(&self) -> &Hello {
        &self.peer
    }

    fn send(&self, frame: &[u8]) -> Result<(), TransferError> {
        self.check_open()?;
        if frame.is_empty() {
            // An empty message is the close wake-up; never a frame.
            return Err(TransferError::Failed("empty frame".into()));
        }
        self.tx.send(frame.to_vec()).map_err(|_| self.closed_err())
    }

    fn recv(&self, timeout: Duration) -> Result<Option<Vec<u8>>, TransferError> {
        // Frames sent before a close are still delivered; then `Closed`.
        let got = match self.rx.try_recv() {
            Ok(f) => Some(f),
            Err(_) if self.link.closed.load(Ordering::Acquire) => return Err(self.closed_err()),
            Err(flume::TryRecvError::Disconnected) => return Err(self.closed_err()),
            Err(flume::TryRecvError::Empty) => match self.rx.recv_timeout(timeout) {
                Ok(f) => Some(f),
                Err(flume::RecvTimeoutError::Timeout) => None,
                Err(flume::RecvTimeoutError::Disconnected) => return Err(self.closed_err()),
            },
        };
        match got {
            Some(f) if f.is_empty() => Err(self.closed_err()),
            other => Ok(other),
        }
    }

    fn write(
        &self,
        segments: &[Segment<'_>],
        notification: Option<&[u8]>,
    ) -> Result<(), TransferError> {
        if self.role != Role::Prefill {
            return Err(TransferError::Unsupported("the decode end does not write"));
        }
        self.check_open()?;
        for s in segments {
            self.landing.write(s.offset, s.bytes)?;
        }
        if let Some(n) = notification {
            self.send(n)?;
        }
        Ok(())
    }

    fn landing(&self) -> Option<Arc<LandingZone>> {
        (self.role == Role::Decode).then(|| self.landing.clone())
    }

    fn close(&self, why: &str) {
        if !self.link.closed.swap(true, Ordering::AcqRel) {
            *self.link.why.lock() = format!("{} end closed: {why}", self.role.name());
            // Wake both readers.
            let _ = self.tx.send(Vec::new());
            let _ = self.wake.send(Vec::new());
        }
    }

    fn is_closed(&self) -> bool {
        self.link.closed.load(Ordering::Acquire)
    }
}

impl Drop for LocalEnd {
    fn drop(&mut self) {
        self.close("dropped");
    }
}
