//! The `Backend` trait: every op the engine and the validation suite need, over buffers
//! that live wherever the backend computes (host memory for `cpu`, device memory for
//! `cuda`).
//!
//! Contract for every op method:
//! - the descriptor's `validate` is called first; a rejected call returns the error and
//!   writes nothing;
//! - every element of every output is written (the suite poisons outputs with NaN first);
//! - results are batch-invariant: a row's outputs are bit-identical whatever the other rows
//!   in the call and however a caller splits its rows into calls.

use std::fmt::Debug;

use crate::error::Result;
use crate::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, SparseMla, Topk,
};

/// A compute backend (`cpu`, `emu`, `cuda`).
pub trait Backend: Send + Sync + Debug {
    /// An untyped byte buffer owned by this backend.
    type Buffer: Send + Sync + Debug;

    /// Short name (`cpu`, `emu`, `cuda`).
    fn name(&self) -> &str;

    /// Whether the backend implements `op`; the others return `Error::NotImplemented`.
    fn supports(&self, op: Op) -> bool;

    /// Copies `bytes` into a new buffer of exactly that length.
    fn upload(&self, bytes: &[u8]) -> Result<Self::Buffer>;

    /// A new zero-filled buffer of `bytes` bytes where the backend computes (device memory
    /// for `cuda`).
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;

    /// A new zero-filled buffer of `bytes` bytes in host memory that the backend's kernels
    /// can read and write directly (page-locked, device-mapped memory for `cuda`; plain
    /// host memory for `cpu`/`emu`). Host cache tiers live in these.
    fn alloc_host(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Copies a whole buffer back to the host.
    fn download(&self, buf: &Self::Buffer) -> Result<Vec<u8>>;

    /// Length of a buffer in bytes.
    fn buffer_len(&self, buf: &Self::Buffer) -> usize;

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
