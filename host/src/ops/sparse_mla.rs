//! `sparse_mla`: sparse MLA attention over each token's top-k cache slots.

use super::{check_count, check_size};
use crate::error::{Error, Index, Result};
use crate::layout::KvLayout;

/// `sparse_mla`: per token and head, softmax attention over the token's `topk` cache slots
/// (`-1` skipped): `out = Σ_j softmax(scale · q·k_j) v_j`, `lse = ln Σ_j exp(scale · q·k_j)`
/// (natural log). `k_j` is the token's dequantised `[latent | rope]`, `v_j` its latent. A
/// token with no valid slot gets `out = 0` and `lse = -inf`; a head whose scores include
/// NaN, or have no finite maximum, gets NaN. A slot listed twice counts twice.
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
        if self.layout.dtype().is_v4() {
            return Err(Error::invalid(
                "layout",
                format!(
                    "{} is a DeepSeek-V4 KV layout (K = V, 512 dims): use sparse_mla_v4",
                    self.layout.dtype().name()
                ),
            ));
        }
        let (t, h, l) = (self.n_tokens, self.n_heads, &self.layout);
        check_count("n_tokens", t)?;
        check_count("n_heads", h)?;
        check_count("topk", self.topk)?;
        check_size("q", &[t, h, l.d_qk(), 2], q_bytes)?;
        check_size("indices", &[t, self.topk, 4], indices_bytes)?;
        check_size("out", &[t, h, l.nope_dim(), 2], out_bytes)?;
        check_size("lse", &[t, h, 4], lse_bytes)?;
        l.pages_in("KV cache", cache_bytes)
    }

    /// Checks that every index is `-1` or a slot of a cache of `pages` pages (any other
    /// negative value, or a slot at or past the cache's end, is an error naming its
    /// `[token][j]`). Duplicate indices are allowed: a slot listed twice counts twice.
    pub fn check_indices(&self, indices: &[i32], pages: usize) -> Result<()> {
        let capacity = pages.saturating_mul(self.layout.page_size());
        match indices
            .iter()
            .enumerate()
            .find(|(_, &s)| s < -1 || s >= 0 && s as usize >= capacity)
        {
            Some((i, &s)) => Err(Error::SlotOutOfRange {
                what: "indices",
                index: Index::cell(i, self.topk),
                slot: s as i64,
                capacity,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvDtype;

    /// A bad index is named by `[token][j]`, with the cache's capacity; duplicates pass.
    #[test]
    fn index_errors_name_token_and_entry() {
        let op = SparseMla {
            layout: KvLayout::new(KvDtype::Bf16, 16, 16, 4).unwrap(),
            n_tokens: 2,
            n_heads: 1,
            topk: 3,
            softmax_scale: 1.0,
        };
        assert!(op.check_indices(&[0, 0, -1, 7, 7, 7], 2).is_ok());
        let e = op
            .check_indices(&[0, 1, 2, 3, 4, 8], 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("indices[1][2] = 8"), "{e}");
        assert!(e.contains("cache holds 8 slots"), "{e}");
        let e = op
            .check_indices(&[0, -2, 2, 3, 4, 5], 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("indices[0][1] = -2"), "{e}");
    }
}
