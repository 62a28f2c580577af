//! The `Backend` trait: every op the engine and the validation suite need, over buffers
//! that live wherever the backend computes (host memory for `cpu`, device memory for
//! `cuda`), and the streams and events that order that work.
//!
//! Contract for every op method:
//! - the descriptor's `validate` is called first; a rejected call returns the error and
//!   writes nothing;
//! - every element of every output is written (the suite poisons outputs with NaN first);
//! - results are batch-invariant: a row's outputs are bit-identical whatever the other rows
//!   in the call and however a caller splits its rows into calls.
//!
//! # Streams and events
//!
//! A backend value is a handle on one of its queues ([`StreamKind`]): ops called through
//! it are *enqueued* there, in call order, and may still be running when the call returns.
//! [`Backend::on_stream`] gives a handle on another queue of the same backend (buffers are
//! shared between them). Work on one stream runs in order; across streams, order is
//! expressed with events: [`Backend::record_event`] marks everything enqueued so far on a
//! stream, [`Backend::wait_event`] makes a stream wait for it without blocking the host,
//! [`Event::wait`] blocks the host (bounded). [`Backend::download`] returns the bytes after
//! all work enqueued on its stream has completed.
//!
//! `cpu` and `emu` run every op synchronously: their events are complete when recorded
//! and their waits return at once. `cuda` has two CUDA streams (compute and copy) and
//! real events, so a host-tier page load on the copy stream overlaps the kernels of the
//! compute stream.
//!
//! For the cache's layer fences (to be wired after the cache redesign lands): the io
//! worker holds `backend.on_stream(StreamKind::Copy)`, enqueues a layer's page copies on
//! it and records an event right after them; the layer's ready token carries that event.
//! A reader on the compute stream calls `compute.wait_event(&token_event)` before the
//! layer's kernels (no host wait: the kernels queue behind the copy on the device), and
//! only code that needs the bytes on the host (checksum verification, downloads) calls
//! `event.wait(timeout)`. A failed or cancelled load still fails the fence on the host
//! side; an event never replaces the fence's error path.

use std::any::Any;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, SparseMla, SparseMlaV4, Topk,
};

/// One KV cache of a `sparse_mla_v4` call and its indices (i32 `[n_tokens, topk]`).
#[derive(Debug)]
pub struct KvInput<'b, B> {
    pub cache: &'b B,
    pub indices: &'b B,
}

impl<B> Clone for KvInput<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for KvInput<'_, B> {}

/// A queue of a backend's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum StreamKind {
    /// The ops of the model (the stream a new backend value enqueues on).
    #[default]
    Compute,
    /// Page copies between cache tiers (host-tier loads and backups), so they overlap
    /// compute.
    Copy,
}

impl StreamKind {
    /// Both streams.
    pub const ALL: [StreamKind; 2] = [StreamKind::Compute, StreamKind::Copy];

    /// Index of the stream (0 compute, 1 copy).
    pub fn index(self) -> usize {
        match self {
            StreamKind::Compute => 0,
            StreamKind::Copy => 1,
        }
    }
}

/// The completion of the work one stream had enqueued when the event was recorded.
/// Cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct Event(EventState);

#[derive(Clone, Debug)]
enum EventState {
    /// Recorded on a synchronous backend: the work is done.
    Complete,
    /// A backend's device event.
    Pending(Arc<dyn DeviceEvent>),
}

/// A device backend's completion marker behind an [`Event`].
pub trait DeviceEvent: Send + Sync + Debug + Any {
    /// Whether the marked work has completed; an error of that work (a failed launch) is
    /// returned here.
    fn query(&self) -> Result<bool>;
    /// For the backend that made it, to recover its own event type.
    fn as_any(&self) -> &dyn Any;
}

impl Event {
    /// How long [`Backend::wait_event`]'s host-side default waits before it gives up.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// An event whose work is already done (what synchronous backends record).
    pub fn complete() -> Self {
        Event(EventState::Complete)
    }

    /// An event backed by a device event.
    pub fn pending(event: Arc<dyn DeviceEvent>) -> Self {
        Event(EventState::Pending(event))
    }

    /// The device event, `None` for an event that was complete when recorded.
    pub fn device(&self) -> Option<&dyn DeviceEvent> {
        match &self.0 {
            EventState::Complete => None,
            EventState::Pending(e) => Some(e.as_ref()),
        }
    }

    /// Whether the marked work has completed (without waiting).
    pub fn is_complete(&self) -> Result<bool> {
        match &self.0 {
            EventState::Complete => Ok(true),
            EventState::Pending(e) => e.query(),
        }
    }

    /// Blocks the calling thread until the marked work has completed, at most `timeout`
    /// (then [`Error::Timeout`]). Polls with a growing pause (up to 1 ms): meant for
    /// waits the host cannot avoid, not for ordering device work.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(2);
        loop {
            if self.is_complete()? {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(Error::Timeout {
                    what: "event",
                    after: timeout,
                });
            }
            std::thread::sleep(pause.min(timeout.saturating_sub(start.elapsed())));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

/// Which arithmetic a backend's kernels compute with. Every backend and CPU path gives the
/// same bits but one: the CPU's opt-in `amx` path scores the indexer on AMX tiles
/// ([`crate::cpu::amx`]). Pages written under one arithmetic hold other bits than the
/// other's, so two engines that exchange pages (prefill/decode) must agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arithmetic {
    /// The bits every backend and CPU path shares.
    Shared,
    /// The CPU's `amx` path: indexer scores from AMX tiles.
    AmxTiles,
}

impl Arithmetic {
    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Arithmetic::Shared => "shared",
            Arithmetic::AmxTiles => "amx tiles",
        }
    }
}

/// A compute backend (`cpu`, `emu`, `cuda`).
pub trait Backend: Send + Sync + Debug {
    /// An untyped byte buffer owned by this backend.
    type Buffer: Send + Sync + Debug;

    /// Short name (`cpu`, `emu`, `cuda`).
    fn name(&self) -> &str;

    /// The arithmetic of this backend's kernels ([`Arithmetic`]): `Shared` unless a
    /// backend says otherwise.
    fn arithmetic(&self) -> Arithmetic {
        Arithmetic::Shared
    }

    /// Copies `bytes` into a new buffer of exactly that length.
    fn upload(&self, bytes: &[u8]) -> Result<Self::Buffer>;

    /// A new zero-filled buffer of `bytes` bytes where the backend computes (device memory
    /// for `cuda`).
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;

    /// A new zero-filled buffer of `bytes` bytes in host memory that the backend's kernels
    /// can read and write directly (page-locked, device-mapped memory for `cuda`; plain
    /// host memory for `cpu`/`emu`). Host cache tiers live in these.
    fn alloc_host(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Copies a whole buffer back to the host, once the work enqueued on this handle's
    /// stream has completed.
    fn download(&self, buf: &Self::Buffer) -> Result<Vec<u8>>;

    /// Length of a buffer in bytes.
    fn buffer_len(&self, buf: &Self::Buffer) -> usize;

    /// A handle on `stream` of the same backend (same buffers, same device). The default,
    /// for backends with one in-order queue, is a clone of this handle.
    fn on_stream(&self, _stream: StreamKind) -> Result<Self>
    where
        Self: Sized + Clone,
    {
        Ok(self.clone())
    }

    /// The stream this handle enqueues on (the default, for one-queue backends: compute).
    fn stream(&self) -> StreamKind {
        StreamKind::Compute
    }

    /// An event marking all work enqueued on this handle's stream so far. The default,
    /// for synchronous backends, is a complete event.
    fn record_event(&self) -> Result<Event> {
        Ok(Event::complete())
    }

    /// Makes this handle's stream wait for `event` before it runs work enqueued later,
    /// without blocking the host where the backend can (cuda). The default waits on the
    /// host, at most [`Event::DEFAULT_TIMEOUT`].
    fn wait_event(&self, event: &Event) -> Result<()> {
        event.wait(Event::DEFAULT_TIMEOUT)
    }

    /// Blocks until all work enqueued on this handle's stream has completed. The default,
    /// for synchronous backends, returns at once.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// See [`IndexKStore`]. `keys`: bf16 `[slots.len(), head_dim]`; `cache`: whole pages.
    fn index_k_store(
        &self,
        op: &IndexKStore<'_>,
        keys: &Self::Buffer,
        cache: &mut Self::Buffer,
    ) -> Result<()>;

    /// See [`KvStore`]. `kv`: bf16 `[slots.len(), d_qk]`; `cache`: whole pages.
    fn kv_store(&self, op: &KvStore<'_>, kv: &Self::Buffer, cache: &mut Self::Buffer)
        -> Result<()>;

    /// See [`IndexerLogits`]. `q`: bf16 `[rows, n_heads, head_dim]`; `weights`: f32
    /// `[rows, n_heads]`; `out`: f32 `[rows, row_stride]`.
    fn indexer_logits(
        &self,
        op: &IndexerLogits<'_>,
        q: &Self::Buffer,
        weights: &Self::Buffer,
        cache: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// See [`Topk`]. `logits`: f32 `[rows, row_stride]`; `out`: i32 `[rows, k]`.
    fn topk(&self, op: &Topk<'_>, logits: &Self::Buffer, out: &mut Self::Buffer) -> Result<()>;

    /// See [`SparseMla`]. `q`: bf16 `[n_tokens, n_heads, d_qk]`; `indices`: i32
    /// `[n_tokens, topk]` slots or `-1`; `out`: bf16 `[n_tokens, n_heads, d_v]`; `lse`: f32
    /// `[n_tokens, n_heads]`.
    fn sparse_mla(
        &self,
        op: &SparseMla,
        q: &Self::Buffer,
        cache: &Self::Buffer,
        indices: &Self::Buffer,
        out: &mut Self::Buffer,
        lse: &mut Self::Buffer,
    ) -> Result<()>;

    /// See [`SparseMlaV4`]. `q`: bf16 `[n_tokens, n_heads, 512]`; `main` (and `extra`, when
    /// the op has an extra cache): the cache and its i32 indices `[n_tokens, topk]`;
    /// `out`: bf16 `[n_tokens, n_heads, 512]`; `lse`: f32 `[n_tokens, n_heads]`.
    fn sparse_mla_v4(
        &self,
        op: &SparseMlaV4<'_>,
        q: &Self::Buffer,
        main: KvInput<'_, Self::Buffer>,
        extra: Option<KvInput<'_, Self::Buffer>>,
        out: &mut Self::Buffer,
        lse: &mut Self::Buffer,
    ) -> Result<()>;

    /// See [`CopyPages`]: whole pages from `src` to `dst` (distinct buffers).
    fn copy_pages(
        &self,
        op: &CopyPages<'_>,
        src: &Self::Buffer,
        dst: &mut Self::Buffer,
    ) -> Result<()>;

    /// See [`PageChecksums`]. `out`: u64 `[ids.len()]`.
    fn page_checksums(
        &self,
        op: &PageChecksums<'_>,
        pool: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;
}
