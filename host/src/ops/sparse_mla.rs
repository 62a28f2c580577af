//! `sparse_mla`: sparse MLA attention over each token's top-k cache slots.

use super::check_bytes;
use crate::error::{Error, Result};
use crate::layout::KvLayout;

/// `sparse_mla`: per token and head, softmax attention over the token's `topk` cache slots
/// (`-1` skipped): `out = Σ_j softmax(scale · q·k_j) v_j`, `lse = ln Σ_j exp(scale · q·k_j)`
/// (natural log). `k_j` is the token's dequantised `[latent | rope]`, `v_j` its latent. A
/// token with no valid slot gets `out = 0` and `lse = -inf`.
#[derive(Clone, Copy, Debug)]
pub struct SparseMla {
    pub layout: KvLayout,
    pub n_tokens: usize,
    pub n_heads: usize,
    pub topk: usize,
    pub softmax_scale: f32,
}

impl SparseMla {
    /// Validates the call against the buffer sizes (bytes); returns the pages in the cache.
    pub fn validate(
        &self,
        q_bytes: usize,
        cache_bytes: usize,
        indices_bytes: usize,
        out_bytes: usize,
        lse_bytes: usize,
    ) -> Result<usize> {
        if self.n_heads == 0 || self.topk == 0 {
            return Err(Error::invalid("n_heads/topk", "must be positive"));
        }
        if !self.softmax_scale.is_finite() {
            return Err(Error::invalid("softmax_scale", "must be finite"));
        }
        let (t, h) = (self.n_tokens, self.n_heads);
        check_bytes("q", t * h * self.layout.d_qk() * 2, q_bytes)?;
        check_bytes("indices", t * self.topk * 4, indices_bytes)?;
        check_bytes("out", t * h * self.layout.nope_dim() * 2, out_bytes)?;
        check_bytes("lse", t * h * 4, lse_bytes)?;
        self.layout.pages_in("KV cache", cache_bytes)
    }

    /// Checks that every index is `-1` or a slot of a cache of `pages` pages.
    pub fn check_indices(&self, indices: &[i32], pages: usize) -> Result<()> {
        let capacity = pages * self.layout.page_size();
        match indices
            .iter()
            .enumerate()
            .find(|(_, &s)| s < -1 || s >= 0 && s as usize >= capacity)
        {
            Some((i, &s)) => Err(Error::SlotOutOfRange {
                what: "indices",
                index: i,
                slot: s as i64,
                capacity,
            }),
            None => Ok(()),
        }
    }
}
