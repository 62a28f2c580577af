//! `sparse_mla_v4`: DeepSeek-V4's sparse attention over a main and an optional extra KV
//! cache (FlashMLA's `flash_mla_with_kvcache`, sparse form, MODEL1).
//!
//! A new op rather than a generalised `sparse_mla`: V4 differs in every part of the call
//! (K = V rows of 512 dims, two caches with their own layouts, page sizes, indices and
//! lengths, the attention sink, `+inf` for an empty row), and the V3.2 form keeps its
//! signature, validation and kernels unchanged.

use super::{check_count, check_size};
use crate::error::{Error, Index, Result};
use crate::layout::KvLayout;

/// Most query heads of a call (DeepSeek-V4-Pro has 128).
pub const V4_MAX_HEADS: usize = 128;

/// One KV cache of a [`SparseMlaV4`] call: its layout (`model1_fp8` or `bf16_512`, any
/// page size), the indices per token (`topk`), and optionally the number of them each
/// token uses (`lengths`, `[n_tokens]`: a request's `topk_length` repeated over its query
/// tokens; absent: all `topk`).
#[derive(Clone, Copy, Debug)]
pub struct V4Cache<'a> {
    pub layout: KvLayout,
    /// Indices per token in the call's index buffer of this cache (`[n_tokens, topk]`).
    pub topk: usize,
    pub lengths: Option<&'a [u32]>,
}

impl V4Cache<'_> {
    /// Indices token `t` uses (`≤ topk`; validated).
    #[inline]
    pub fn length(&self, t: usize) -> usize {
        self.lengths.map_or(self.topk, |l| l[t] as usize)
    }
}

/// `sparse_mla_v4`: per token and head, softmax attention over the token's used slots of
/// the main cache, then of the extra cache (`page · page_size + offset`; inside a token's
/// length only `-1` is invalid, past it every entry is ignored, whatever it holds):
/// `s_j = softmax_scale · q · k_j` over the 512 dims of the dequantised row `k_j`,
/// `lse = ln Σ_j exp(s_j)` (natural log, **without** the sink), `out = Σ_j softmax_j ·
/// k_j` (V = K, the rope dims included), then with a sink `out *= 1 / (1 + exp(sink_h −
/// lse))`. A token without a valid slot gets `out = 0` and `lse = +inf` (FlashMLA's
/// convention); a sink of `+inf` zeroes `out`, `-inf` leaves it. Slots listed twice count
/// twice; rows behind unused or invalid entries are never read (they may hold NaN).
#[derive(Clone, Copy, Debug)]
pub struct SparseMlaV4<'a> {
    pub n_tokens: usize,
    /// Query heads, 1..=[`V4_MAX_HEADS`].
    pub n_heads: usize,
    pub softmax_scale: f32,
    pub main: V4Cache<'a>,
    pub extra: Option<V4Cache<'a>>,
    /// Per-head sink logits `[n_heads]` (any f32, ±inf included; NaN is refused).
    pub attn_sink: Option<&'a [f32]>,
}

/// What [`SparseMlaV4::validate`] found: the pages of each cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V4Pages {
    pub main: usize,
    pub extra: usize,
}

impl SparseMlaV4<'_> {
    /// The dims of q, out and every K = V row.
    pub const D: usize = 512;

    /// The caches in attention order (main, then extra).
    pub fn caches(&self) -> impl Iterator<Item = &V4Cache<'_>> {
        std::iter::once(&self.main).chain(self.extra.as_ref())
    }

    /// Validates the call against the buffer sizes in bytes (`extra` = the extra cache
    /// and its indices, when the call has one); returns the pages of each cache.
    #[allow(clippy::too_many_arguments)]
    pub fn validate(
        &self,
        q_bytes: usize,
        main: [usize; 2],
        extra: Option<[usize; 2]>,
        out_bytes: usize,
        lse_bytes: usize,
    ) -> Result<V4Pages> {
        let (t, h) = (self.n_tokens, self.n_heads);
        if h == 0 || h > V4_MAX_HEADS {
            return Err(Error::invalid(
                "n_heads",
                format!("{h} is outside 1..={V4_MAX_HEADS}"),
            ));
        }
        if !self.softmax_scale.is_finite() {
            return Err(Error::invalid("softmax_scale", "must be finite"));
        }
        check_count("n_tokens", t)?;
        if let Some(s) = self.attn_sink {
            if s.len() != h {
                return Err(Error::Shape {
                    what: "attn_sink",
                    expected: h,
                    actual: s.len(),
                });
            }
            if let Some(i) = s.iter().position(|x| x.is_nan()) {
                return Err(Error::invalid(
                    "attn_sink",
                    format!("attn_sink[{i}] is NaN"),
                ));
            }
        }
        let d = Self::D;
        check_size("q", &[t, h, d, 2], q_bytes)?;
        check_size("out", &[t, h, d, 2], out_bytes)?;
        check_size("lse", &[t, h, 4], lse_bytes)?;
        let main_pages = self.check_cache("main", &self.main, main)?;
        let extra_pages = match (&self.extra, extra) {
            (Some(c), Some(bytes)) => self.check_cache("extra", c, bytes)?,
            (None, None) => 0,
            (Some(_), None) => {
                return Err(Error::invalid(
                    "extra",
                    "the call has an extra cache but no extra buffers",
                ))
            }
            (None, Some(_)) => {
                return Err(Error::invalid(
                    "extra",
                    "extra buffers given to a call without an extra cache",
                ))
            }
        };
        Ok(V4Pages {
            main: main_pages,
            extra: extra_pages,
        })
    }

    /// Checks one cache's layout, lengths and buffer sizes (`[cache, indices]` bytes);
    /// returns its pages.
    fn check_cache(&self, what: &'static str, c: &V4Cache<'_>, bytes: [usize; 2]) -> Result<usize> {
        if !c.layout.dtype().is_v4() {
            return Err(Error::invalid(
                what,
                format!(
                    "layout {} is not a DeepSeek-V4 KV layout (model1_fp8 or bf16_512)",
                    c.layout.dtype().name()
                ),
            ));
        }
        check_count("topk", c.topk)?;
        if let Some(l) = c.lengths {
            if l.len() != self.n_tokens {
                return Err(Error::Shape {
                    what: "lengths",
                    expected: self.n_tokens,
                    actual: l.len(),
                });
            }
            if let Some((i, &n)) = l.iter().enumerate().find(|(_, &n)| n as usize > c.topk) {
                return Err(Error::invalid(
                    what,
                    format!("lengths[{i}] = {n} is above its top-k {}", c.topk),
                ));
            }
        }
        check_size("indices", &[self.n_tokens, c.topk, 4], bytes[1])?;
        c.layout.pages_in("KV cache", bytes[0])
    }

    /// Checks that every used index of `cache` (the first `length(t)` of each token) is
    /// `-1` or a slot of a cache of `pages` pages; unused ones are not looked at.
    pub fn check_indices(
        &self,
        what: &'static str,
        c: &V4Cache<'_>,
        indices: &[i32],
        pages: usize,
    ) -> Result<()> {
        let capacity = pages.saturating_mul(c.layout.page_size());
        for t in 0..self.n_tokens {
            let row = &indices[t * c.topk..t * c.topk + c.length(t)];
            if let Some((j, &s)) = row
                .iter()
                .enumerate()
                .find(|(_, &s)| s < -1 || s >= 0 && s as usize >= capacity)
            {
                return Err(Error::SlotOutOfRange {
                    what,
                    index: Index::Cell { row: t, col: j },
                    slot: s as i64,
                    capacity,
                });
            }
        }
        Ok(())
    }
}
