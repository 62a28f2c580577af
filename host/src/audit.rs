//! Independent re-checks of kernel calls while serving.
//!
//! A serving engine's outputs can only be compared with an uncached reference run in a
//! test harness; a kernel bug that both runs share (a top-k that drops the k-th best) is
//! invisible to that comparison and to every cache check. A [`KernelAudit`] re-checks a
//! sample of the engine's own kernel calls — the inputs it gave the kernel and the outputs
//! it got — against an independent implementation (the f64 references of
//! `sparsekit-validation` implement it; the engine only knows this trait, so the serving
//! crate does not depend on the validation crate). Everything is passed as the bytes of
//! the buffers, in the layouts the ops document.

use crate::ops::{IndexerLogits, SparseMla, SparseMlaV4, Topk};

/// Re-checks one kernel call: `Ok(())` when the outputs are what the op's contract says
/// for these inputs (within the op's tolerance), `Err` describing the first difference.
pub trait KernelAudit: Send + Sync + std::fmt::Debug {
    /// `q` bf16 `[rows, n_heads, head_dim]`, `weights` f32 `[rows, n_heads]`, `cache` the
    /// whole index-K pool, `out` f32 `[rows, row_stride]`.
    fn indexer_logits(
        &self,
        op: &IndexerLogits<'_>,
        q: &[u8],
        weights: &[u8],
        cache: &[u8],
        out: &[u8],
    ) -> Result<(), String>;

    /// `logits` f32 `[rows, row_stride]`, `out` i32 `[rows, k]`.
    fn topk(&self, op: &Topk<'_>, logits: &[u8], out: &[u8]) -> Result<(), String>;

    /// `q` bf16 `[n_tokens, n_heads, d_qk]`, `cache` the whole KV pool, `indices` i32
    /// `[n_tokens, topk]`, `out` bf16 `[n_tokens, n_heads, d_v]`, `lse` f32
    /// `[n_tokens, n_heads]`.
    fn sparse_mla(
        &self,
        op: &SparseMla,
        q: &[u8],
        cache: &[u8],
        indices: &[u8],
        out: &[u8],
        lse: &[u8],
    ) -> Result<(), String>;

    /// `q` bf16 `[n_tokens, n_heads, 512]`, `main` and `extra` each `(cache, indices)`:
    /// the whole pool and i32 `[n_tokens, topk]` of that cache; `out` bf16
    /// `[n_tokens, n_heads, 512]`, `lse` f32 `[n_tokens, n_heads]`.
    fn sparse_mla_v4(
        &self,
        op: &SparseMlaV4<'_>,
        q: &[u8],
        main: (&[u8], &[u8]),
        extra: Option<(&[u8], &[u8])>,
        out: &[u8],
        lse: &[u8],
    ) -> Result<(), String>;
}
