//! Dense ops of the synthetic DSA model (the engine's layers besides the DSA ops of
//! [`Backend`]): matmul, RMSNorm, rope (and its inverse, through [`inverse_rope_table`]),
//! SwiGLU, embedding gather, row gather, residual add, f32⇄bf16 casts, argmax and
//! DeepSeek-V4's compressor pooling ([`GatedPool`]).
//!
//! **Batch invariance is the contract.** Every output element is computed from its own
//! row's inputs only, by the same operations in the same order whatever the number of
//! rows in the call, the row's position in it, the thread count or the CPU's vector width.
//! In particular [`ModelOps::matmul`] reduces each output element over `k` with one fused
//! multiply-add per term in order `p = 0..k` (no split-K, no dependence on `rows`). The
//! serving engine's determinism oracle (a token computed alone, in a crowded batch or in a
//! prefill chunk gives bit-identical logits) rests on this.
//!
//! Operands are f32 unless an op says bf16, addressed through a [`View`] (element offsets
//! and strides, never bytes). Every op validates its descriptor against the buffer sizes
//! first; a rejected call writes nothing.
//!
//! Backends: `cpu` runs the rayon kernels of [`crate::cpu::dense`]; `emu` and `cuda` launch
//! the GPU dense kernels (`sparsekit_kernels::kernels::dense_*`, through
//! [`crate::launcher::dense`]). Both follow the same per-element operation sequence
//! (correctly rounded f32 ops only), so every backend gives the **same bits**: beyond
//! batch invariance within a backend, a model's tokens and logits agree across backends.

use crate::backend::Backend;
use crate::error::{Error, Result};

/// Where a `[rows, groups, width]` operand sits in a buffer, in **elements** of the
/// operand's type: element `(r, g, c)` is at `offset + r·row_stride + g·group_stride + c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// Elements before element `(0, 0, 0)`.
    pub offset: usize,
    /// Elements from one row to the next.
    pub row_stride: usize,
    /// Elements from one group to the next inside a row (unused when `groups == 1`).
    pub group_stride: usize,
}

impl View {
    /// Densely packed `[rows, width]` from element 0.
    pub fn dense(width: usize) -> View {
        View {
            offset: 0,
            row_stride: width,
            group_stride: width,
        }
    }

    /// Densely packed `[rows, groups, width]` from element 0.
    pub fn grouped(groups: usize, width: usize) -> View {
        View {
            offset: 0,
            row_stride: groups * width,
            group_stride: width,
        }
    }

    /// Columns `offset..` of each row of a `[rows, row_stride]` array.
    pub fn cols(row_stride: usize, offset: usize) -> View {
        View {
            offset,
            row_stride,
            group_stride: 0,
        }
    }

    /// This view moved `by` elements further into the buffer.
    pub fn shifted(self, by: usize) -> View {
        View {
            offset: self.offset + by,
            ..self
        }
    }

    /// Elements a row spans from its first element: `(groups-1)·group_stride + width`.
    fn span(&self, groups: usize, width: usize) -> Option<usize> {
        if width == 0 || groups == 0 {
            return Some(0);
        }
        (groups - 1)
            .checked_mul(self.group_stride)?
            .checked_add(width)
    }

    /// One past the last element touched by `rows × groups × width`.
    fn end(&self, rows: usize, groups: usize, width: usize) -> Option<usize> {
        if rows == 0 || groups == 0 || width == 0 {
            return Some(0);
        }
        (rows - 1)
            .checked_mul(self.row_stride)?
            .checked_add(self.span(groups, width)?)?
            .checked_add(self.offset)
    }

    /// Checks the view fits a buffer of `buffer_elems` elements.
    pub fn check(
        &self,
        what: &'static str,
        rows: usize,
        groups: usize,
        width: usize,
        buffer_elems: usize,
    ) -> Result<()> {
        let end = self
            .end(rows, groups, width)
            .ok_or_else(|| Error::invalid(what, "view size overflows usize"))?;
        if end > buffer_elems {
            return Err(Error::Shape {
                what,
                expected: end,
                actual: buffer_elems,
            });
        }
        Ok(())
    }

    /// [`View::check`] plus what an output needs: distinct `(row, group)` pairs write
    /// disjoint elements (`group_stride ≥ width` when `groups > 1`, `row_stride ≥` the row
    /// span when `rows > 1`).
    pub fn check_out(
        &self,
        what: &'static str,
        rows: usize,
        groups: usize,
        width: usize,
        buffer_elems: usize,
    ) -> Result<()> {
        self.check(what, rows, groups, width, buffer_elems)?;
        if groups > 1 && self.group_stride < width {
            return Err(Error::invalid(
                what,
                format!(
                    "group_stride {} < width {width}: groups would overlap",
                    self.group_stride
                ),
            ));
        }
        let span = self.span(groups, width).unwrap_or(usize::MAX);
        if rows > 1 && self.row_stride < span {
            return Err(Error::invalid(
                what,
                format!(
                    "row_stride {} < row span {span}: rows would overlap",
                    self.row_stride
                ),
            ));
        }
        Ok(())
    }
}

/// Elements of a buffer of `bytes` bytes holding `elem`-byte values; a length that is not
/// a whole number of elements is an error.
pub fn elems(what: &'static str, bytes: usize, elem: usize) -> Result<usize> {
    if bytes % elem != 0 {
        return Err(Error::BufferSize {
            what,
            expected: bytes / elem * elem,
            actual: bytes,
        });
    }
    Ok(bytes / elem)
}

/// How a matmul treats its output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accumulate {
    /// `out = x·w`: each element's FMA chain starts from `+0.0`.
    Overwrite,
    /// `out += x·w`: each element's FMA chain starts from the element's current value
    /// (a residual connection fused into the projection).
    Add,
}

/// `matmul`: per group `g`, `out[r, g, :] (=|+=) x[r, g, :k] · w[g]`, where `w[g]` is the
/// row-major f32 `[k, n]` matrix at elements `g·k·n ..` of the weight buffer (in-features
/// × out-features). `groups = 1` is a plain GEMM; `groups = heads` applies one matrix per
/// attention head (MLA's absorbed up-projections). Each output element is
/// `fma(x[k-1], w[k-1], … fma(x[0], w[0], init))` in exactly that order.
#[derive(Clone, Copy, Debug)]
pub struct Matmul {
    pub rows: usize,
    pub groups: usize,
    pub k: usize,
    pub n: usize,
    pub x: View,
    pub out: View,
    pub accumulate: Accumulate,
}

impl Matmul {
    /// A plain dense `[rows, k] · [k, n] → [rows, n]`.
    pub fn dense(rows: usize, k: usize, n: usize) -> Matmul {
        Matmul {
            rows,
            groups: 1,
            k,
            n,
            x: View::dense(k),
            out: View::dense(n),
            accumulate: Accumulate::Overwrite,
        }
    }

    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, x_bytes: usize, w_bytes: usize, out_bytes: usize) -> Result<()> {
        if self.k == 0 || self.n == 0 || self.groups == 0 {
            return Err(Error::invalid("matmul", "k, n and groups must be positive"));
        }
        if self.rows > 1 && self.x.row_stride < self.k {
            return Err(Error::invalid(
                "matmul x",
                format!("row_stride {} < k {}", self.x.row_stride, self.k),
            ));
        }
        self.x.check(
            "matmul x",
            self.rows,
            self.groups,
            self.k,
            elems("x", x_bytes, 4)?,
        )?;
        self.out.check_out(
            "matmul out",
            self.rows,
            self.groups,
            self.n,
            elems("out", out_bytes, 4)?,
        )?;
        let w = self
            .groups
            .checked_mul(self.k)
            .and_then(|v| v.checked_mul(self.n))
            .ok_or_else(|| Error::invalid("matmul", "weight size overflows usize"))?;
        crate::ops::check_bytes("matmul weights", w * 4, w_bytes)
    }
}

/// `rms_norm`: `out[r, c] = (x[r, c] · inv_rms(r)) · gamma[c]` for `c < width`, with
/// `inv_rms(r) = 1 / sqrt(Σ_c x[r, c]² / width + eps)`. The sum of squares uses 16 lanes
/// (lane `l` adds the squares of columns `c ≡ l (mod 16)` in increasing `c`, one FMA each)
/// combined by a fixed pairwise tree; all in f32. `gamma`: f32 `[width]`.
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm {
    pub rows: usize,
    pub width: usize,
    pub eps: f32,
    pub x: View,
    pub out: View,
}

impl RmsNorm {
    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, x_bytes: usize, gamma_bytes: usize, out_bytes: usize) -> Result<()> {
        if self.width == 0 {
            return Err(Error::invalid("rms_norm", "width must be positive"));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(Error::invalid(
                "rms_norm",
                "eps must be finite and positive",
            ));
        }
        self.x.check(
            "rms_norm x",
            self.rows,
            1,
            self.width,
            elems("x", x_bytes, 4)?,
        )?;
        crate::ops::check_bytes("rms_norm gamma", self.width * 4, gamma_bytes)?;
        self.out.check_out(
            "rms_norm out",
            self.rows,
            1,
            self.width,
            elems("out", out_bytes, 4)?,
        )
    }
}

/// `rope`: rotary position embedding, non-interleaved ("rotate half"), on `heads` groups
/// of `rope_dim` values per row. With `h = rope_dim / 2`, `(a, b) = (x[i], x[i + h])`,
/// `(c, s)` = entry `(positions[r], i)` of the table:
/// `out[i] = a·c − b·s`, `out[i + h] = a·s + b·c` (each product rounded, no FMA).
/// `table`: f32 `[max_positions, h, 2]` (cos, sin), built by [`rope_table`] (or by
/// [`inverse_rope_table`] for the inverse rotation).
#[derive(Clone, Copy, Debug)]
pub struct Rope<'a> {
    pub heads: usize,
    pub rope_dim: usize,
    /// Position of each row (its length is the row count).
    pub positions: &'a [u32],
    pub max_positions: usize,
    pub x: View,
    pub out: View,
}

impl Rope<'_> {
    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, table_bytes: usize, x_bytes: usize, out_bytes: usize) -> Result<()> {
        if self.rope_dim == 0 || self.rope_dim % 2 != 0 {
            return Err(Error::invalid("rope", "rope_dim must be positive and even"));
        }
        let rows = self.positions.len();
        crate::ops::check_bytes(
            "rope table",
            self.max_positions * self.rope_dim * 4,
            table_bytes,
        )?;
        if let Some((i, &p)) = self
            .positions
            .iter()
            .enumerate()
            .find(|(_, &p)| p as usize >= self.max_positions)
        {
            return Err(Error::invalid(
                "rope positions",
                format!(
                    "positions[{i}] = {p} is beyond the table's {} positions",
                    self.max_positions
                ),
            ));
        }
        self.x.check(
            "rope x",
            rows,
            self.heads,
            self.rope_dim,
            elems("x", x_bytes, 4)?,
        )?;
        self.out.check_out(
            "rope out",
            rows,
            self.heads,
            self.rope_dim,
            elems("out", out_bytes, 4)?,
        )
    }
}

/// The cos/sin table of [`Rope`]: entry `(p, i)` is `(cos θ, sin θ)` of
/// `θ = p · base^(−2i / rope_dim)`, computed in f64 and rounded once to f32, so every
/// backend reads the same values. Returns f32 `[max_positions, rope_dim / 2, 2]`.
pub fn rope_table(rope_dim: usize, max_positions: usize, base: f64) -> Vec<f32> {
    signed_rope_table(rope_dim, max_positions, base, false)
}

/// The table of the **inverse** rotation, for [`Rope`]: entry `(p, i)` is
/// `(cos θ, −sin θ)`, exactly [`rope_table`]'s entry with the sine negated (same θ, same
/// rounding), so `rope` with it rotates each pair by `−θ`:
/// `out[i] = a·c + b·s`, `out[i + h] = b·c − a·s` (as computed, `a·c − b·(−s)` and
/// `a·(−s) + b·c`: the same rounded products). DeepSeek-V4 applies it to the attention
/// output's rope dims at the query's position. Rope with [`rope_table`] then with this
/// table at the same position returns the input up to rounding (`c² + s²` is 1 within
/// about `2u`, `u = 2⁻²⁴`, plus each step's rounded products and sums). Same shape as
/// [`rope_table`].
pub fn inverse_rope_table(rope_dim: usize, max_positions: usize, base: f64) -> Vec<f32> {
    signed_rope_table(rope_dim, max_positions, base, true)
}

/// [`rope_table`], with the sine negated when `inverse`.
fn signed_rope_table(rope_dim: usize, max_positions: usize, base: f64, inverse: bool) -> Vec<f32> {
    let h = rope_dim / 2;
    let mut t = Vec::with_capacity(max_positions * h * 2);
    for p in 0..max_positions {
        for i in 0..h {
            let theta = p as f64 * base.powf(-2.0 * i as f64 / rope_dim as f64);
            let sin = theta.sin() as f32;
            t.push(theta.cos() as f32);
            t.push(if inverse { -sin } else { sin });
        }
    }
    t
}

/// `swiglu`: `out[r, c] = silu(gu[r, c]) · gu[r, width + c]` with
/// `silu(g) = g / (1 + exp(−g))`, `exp` being `sparsekit_kernels::math::exp_portable`
/// (≤ 2 ulp, the same bits on every backend). `gate_up`: f32 `[rows, 2·width]` (gate columns first, as
/// one matmul with the gate and up matrices side by side produces); `out`: f32
/// `[rows, width]`.
#[derive(Clone, Copy, Debug)]
pub struct SwiGlu {
    pub rows: usize,
    pub width: usize,
}

impl SwiGlu {
    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, gate_up_bytes: usize, out_bytes: usize) -> Result<()> {
        crate::ops::check_bytes(
            "swiglu gate_up",
            self.rows * 2 * self.width * 4,
            gate_up_bytes,
        )?;
        crate::ops::check_bytes("swiglu out", self.rows * self.width * 4, out_bytes)
    }
}

/// `gated_pool`: DeepSeek-V4's compressor pooling. Each of `entries` compressed entries
/// pools, per channel, up to `span` raw tokens' projected rows with softmax weights over
/// their gate logits plus a learned bias per position in the window (RMSNorm and rope
/// follow as separate ops).
///
/// Operands (all f32, dense, sizes in **elements**; buffers are checked in bytes, 4 per
/// element):
/// - `x`: `[rows, 2·width]`, one row per raw token: the projected values `v` in columns
///   `0..width`, then the gate logits `g` in columns `width..2·width` (one matmul with
///   the two projections side by side produces it);
/// - `bias`: `[span, width]`, the position bias of slot `i` of every window;
/// - `out`: `[entries, width]`;
/// - `sources` (host metadata): `entries·span` row ids of `x`, row-major `[entries, span]`:
///   `sources[e·span + i]` is the raw token in slot `i` of entry `e`, or
///   [`GatedPool::EMPTY`] (`u32::MAX`) for an empty slot, which is skipped: neither its
///   row nor its bias is read. Ids may repeat (overlapping windows share tokens).
///
/// For entry `e` and channel `c`, over the valid slots `i` in increasing order, with
/// `s = sources[e·span + i]`:
/// ```text
/// z_i = g[s, c] + bias[i, c]                        one rounded f32 add
/// m   = max_i z_i                                   (−inf start, NaN never taken)
/// w_i = exp_portable(z_i − m)                       one rounded subtract, then exp
/// sum = (((+0 + w_0) + w_1) + …)                    sequential, each add rounded
/// acc = (((+0 + w_0·v[s_0, c]) + w_1·v[s_1, c]) + …) each product and add rounded, no FMA
/// out[e, c] = acc / sum                             one rounded division
/// ```
/// `exp_portable` is `sparsekit_kernels::math::exp_portable` (≤ 2 ulp, built from
/// correctly rounded operations), so `cpu`, `emu` and `cuda` give the **same bits** for
/// every non-NaN output; a NaN output is NaN on every backend (its payload bits are the
/// hardware's and are not part of the contract). The result of an entry depends on its
/// own slots only (batch-invariant).
///
/// For finite `z` the slot holding the maximum gets `w = 1` exactly, so
/// `1 ≤ sum ≤ span`: no division by zero, and a weight whose `z_i − m` is below about
/// −104 underflows to 0 (that slot then leaves both sums unchanged when its value is
/// finite). Non-finite inputs of a **valid** slot:
/// - NaN in `v`, `g` or `bias` makes that `(e, c)` output NaN (never dropped);
/// - `z_i = +inf` (a `+inf` logit or bias, or a finite sum overflowing) makes `m = +inf`
///   and `w_i = exp(+inf − +inf) = NaN`: the output is NaN;
/// - `z_i = −inf` with some other `z` finite gives `w_i = 0`: the slot is ignored, as if
///   empty (unless its value is ±inf or NaN: `0 · ±inf` is NaN); when **every** valid
///   `z` is `−inf`, `m = −inf` and `z − m` is NaN: the output is NaN;
/// - `+inf` and `−inf` added in one `z` give NaN, as above;
/// - a `±inf` value with a positive weight gives `±inf` (or NaN if both signs meet).
///
/// Errors (typed, before anything is written): `span` or `width` 0
/// ([`Error::InvalidArgument`]); `sources.len() ≠ entries·span` ([`Error::Shape`]); an
/// id `≥ rows` that is not `EMPTY`, or an entry whose slots are all empty
/// ([`Error::InvalidArgument`], naming the entry and slot); `x`, `bias` or `out` of the
/// wrong byte size ([`Error::BufferSize`]).
#[derive(Clone, Copy, Debug)]
pub struct GatedPool<'a> {
    /// Compressed entries (rows of `out`).
    pub entries: usize,
    /// Slots per entry (rows of `bias`).
    pub span: usize,
    /// Channels (columns of `out`; `x` has twice as many).
    pub width: usize,
    /// `[entries, span]` row ids of `x`, [`GatedPool::EMPTY`] for an empty slot.
    pub sources: &'a [u32],
    /// Rows of `x` (raw tokens).
    pub rows: usize,
}

impl GatedPool<'_> {
    /// The id of an empty slot in [`GatedPool::sources`].
    pub const EMPTY: u32 = sparsekit_kernels::params::GATED_POOL_EMPTY;

    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, x_bytes: usize, bias_bytes: usize, out_bytes: usize) -> Result<()> {
        if self.span == 0 || self.width == 0 {
            return Err(Error::invalid(
                "gated_pool",
                format!(
                    "span ({}) and width ({}) must be positive",
                    self.span, self.width
                ),
            ));
        }
        let overflow = || Error::invalid("gated_pool", "size overflows usize");
        let slots = self.entries.checked_mul(self.span).ok_or_else(overflow)?;
        crate::ops::check_len("gated_pool sources", slots, self.sources.len())?;
        let x = self
            .rows
            .checked_mul(self.width)
            .and_then(|v| v.checked_mul(8))
            .ok_or_else(overflow)?;
        crate::ops::check_bytes("gated_pool x", x, x_bytes)?;
        let bias = self
            .span
            .checked_mul(self.width)
            .and_then(|v| v.checked_mul(4))
            .ok_or_else(overflow)?;
        crate::ops::check_bytes("gated_pool bias", bias, bias_bytes)?;
        let out = self
            .entries
            .checked_mul(self.width)
            .and_then(|v| v.checked_mul(4))
            .ok_or_else(overflow)?;
        crate::ops::check_bytes("gated_pool out", out, out_bytes)?;
        for (e, slots) in self.sources.chunks_exact(self.span).enumerate() {
            let mut valid = false;
            for (i, &s) in slots.iter().enumerate() {
                if s == Self::EMPTY {
                    continue;
                }
                if s as usize >= self.rows {
                    return Err(Error::invalid(
                        "gated_pool sources",
                        format!("entry {e} slot {i}: row {s} but x has {} rows", self.rows),
                    ));
                }
                valid = true;
            }
            if !valid {
                return Err(Error::invalid(
                    "gated_pool sources",
                    format!("entry {e} has no valid slot (all {} empty)", self.span),
                ));
            }
        }
        Ok(())
    }
}

/// `embed`: `out[i, :] = table[tokens[i], :]`. `table`: f32 `[vocab, dim]`; `out`: f32
/// `[tokens.len(), dim]`.
#[derive(Clone, Copy, Debug)]
pub struct Embed<'a> {
    pub vocab: usize,
    pub dim: usize,
    pub tokens: &'a [u32],
}

impl Embed<'_> {
    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, table_bytes: usize, out_bytes: usize) -> Result<()> {
        crate::ops::check_bytes("embedding table", self.vocab * self.dim * 4, table_bytes)?;
        crate::ops::check_bytes("embed out", self.tokens.len() * self.dim * 4, out_bytes)?;
        if let Some((i, &t)) = self
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= self.vocab)
        {
            return Err(Error::invalid(
                "embed tokens",
                format!(
                    "tokens[{i}] = {t} is outside the vocabulary of {}",
                    self.vocab
                ),
            ));
        }
        Ok(())
    }
}

/// `gather_rows`: `out[i, :] = x[rows[i], :]` for `width` f32 columns.
#[derive(Clone, Copy, Debug)]
pub struct GatherRows<'a> {
    pub width: usize,
    /// Source row of each output row.
    pub rows: &'a [u32],
    /// Rows in the source.
    pub src_rows: usize,
    pub x: View,
    pub out: View,
}

impl GatherRows<'_> {
    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, x_bytes: usize, out_bytes: usize) -> Result<()> {
        self.x.check(
            "gather_rows x",
            self.src_rows,
            1,
            self.width,
            elems("x", x_bytes, 4)?,
        )?;
        self.out.check_out(
            "gather_rows out",
            self.rows.len(),
            1,
            self.width,
            elems("out", out_bytes, 4)?,
        )?;
        if let Some((i, &r)) = self
            .rows
            .iter()
            .enumerate()
            .find(|(_, &r)| r as usize >= self.src_rows)
        {
            return Err(Error::invalid(
                "gather_rows rows",
                format!("rows[{i}] = {r} but the source has {} rows", self.src_rows),
            ));
        }
        Ok(())
    }
}

/// `add`: `acc[r, c] += x[r, c]` (one rounded f32 add per element).
#[derive(Clone, Copy, Debug)]
pub struct Add {
    pub rows: usize,
    pub width: usize,
    pub x: View,
    pub acc: View,
}

impl Add {
    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, x_bytes: usize, acc_bytes: usize) -> Result<()> {
        self.x
            .check("add x", self.rows, 1, self.width, elems("x", x_bytes, 4)?)?;
        self.acc.check_out(
            "add acc",
            self.rows,
            1,
            self.width,
            elems("acc", acc_bytes, 4)?,
        )
    }
}

/// Element type of a [`Cast`] operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseDtype {
    F32,
    Bf16,
}

impl DenseDtype {
    /// Bytes per element.
    pub fn size(&self) -> usize {
        match self {
            DenseDtype::F32 => 4,
            DenseDtype::Bf16 => 2,
        }
    }
}

/// `cast`: `out[r, g, c] = convert(x[r, g, c])`. f32 → bf16 rounds to nearest, ties to
/// even (NaN stays NaN); bf16 → f32 is exact. Views count elements of their own dtype.
#[derive(Clone, Copy, Debug)]
pub struct Cast {
    pub rows: usize,
    pub groups: usize,
    pub width: usize,
    pub from: DenseDtype,
    pub to: DenseDtype,
    pub x: View,
    pub out: View,
}

impl Cast {
    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, x_bytes: usize, out_bytes: usize) -> Result<()> {
        self.x.check(
            "cast x",
            self.rows,
            self.groups,
            self.width,
            elems("x", x_bytes, self.from.size())?,
        )?;
        self.out.check_out(
            "cast out",
            self.rows,
            self.groups,
            self.width,
            elems("out", out_bytes, self.to.size())?,
        )
    }
}

/// `argmax`: per row of f32 `[rows, width]` logits, the column of the largest value, the
/// lowest column on ties; NaN counts as larger than every number (a corrupted row shows
/// itself instead of hiding behind a plausible token). `out`: u32 `[rows]`.
#[derive(Clone, Copy, Debug)]
pub struct Argmax {
    pub rows: usize,
    pub width: usize,
}

impl Argmax {
    /// Validates against the buffer sizes (bytes).
    pub fn validate(&self, logits_bytes: usize, out_bytes: usize) -> Result<()> {
        if self.width == 0 {
            return Err(Error::invalid("argmax", "width must be positive"));
        }
        crate::ops::check_bytes("argmax logits", self.rows * self.width * 4, logits_bytes)?;
        crate::ops::check_bytes("argmax out", self.rows * 4, out_bytes)
    }
}

/// The dense ops of the synthetic model on a backend's buffers (see the module docs for
/// the batch-invariance contract and the operand conventions). Every method validates
/// first; a rejected call writes nothing.
pub trait ModelOps: Backend {
    /// See [`Matmul`]. `w`: f32 `[groups, k, n]`.
    fn matmul(
        &self,
        op: &Matmul,
        x: &Self::Buffer,
        w: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// See [`RmsNorm`].
    fn rms_norm(
        &self,
        op: &RmsNorm,
        x: &Self::Buffer,
        gamma: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// See [`Rope`].
    fn rope(
        &self,
        op: &Rope<'_>,
        table: &Self::Buffer,
        x: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// See [`SwiGlu`].
    fn swiglu(&self, op: &SwiGlu, gate_up: &Self::Buffer, out: &mut Self::Buffer) -> Result<()>;

    /// See [`Embed`].
    fn embed(&self, op: &Embed<'_>, table: &Self::Buffer, out: &mut Self::Buffer) -> Result<()>;

    /// See [`GatherRows`].
    fn gather_rows(
        &self,
        op: &GatherRows<'_>,
        x: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// See [`Add`].
    fn add(&self, op: &Add, x: &Self::Buffer, acc: &mut Self::Buffer) -> Result<()>;

    /// See [`Cast`].
    fn cast(&self, op: &Cast, x: &Self::Buffer, out: &mut Self::Buffer) -> Result<()>;

    /// See [`Argmax`].
    fn argmax(&self, op: &Argmax, logits: &Self::Buffer, out: &mut Self::Buffer) -> Result<()>;

    /// See [`GatedPool`]. `x`: f32 `[rows, 2·width]`; `bias`: f32 `[span, width]`;
    /// `out`: f32 `[entries, width]`.
    fn gated_pool(
        &self,
        op: &GatedPool<'_>,
        x: &Self::Buffer,
        bias: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_checks() {
        let v = View::grouped(4, 8);
        assert!(v.check("v", 3, 4, 8, 96).is_ok());
        assert!(matches!(
            v.check("v", 3, 4, 8, 95),
            Err(Error::Shape {
                expected: 96,
                actual: 95,
                ..
            })
        ));
        // Overlapping groups are fine to read but not to write.
        let o = View {
            offset: 0,
            row_stride: 32,
            group_stride: 4,
        };
        assert!(o.check("o", 2, 4, 8, 64).is_ok());
        assert!(o.check_out("o", 2, 4, 8, 64).is_err());
        let o = View::cols(8, 2);
        assert!(o.check_out("o", 4, 1, 6, 32).is_ok());
        assert!(o.check_out("o", 4, 1, 7, 33).is_ok());
        // Rows of 9 elements 8 apart overlap.
        assert!(o.check("o", 4, 1, 9, 40).is_ok());
        assert!(o.check_out("o", 4, 1, 9, 40).is_err());
        let huge = View {
            offset: usize::MAX - 3,
            row_stride: 1,
            group_stride: 1,
        };
        assert!(matches!(
            huge.check("h", 2, 1, 8, 16),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn rope_table_landmarks() {
        let t = rope_table(4, 3, 10000.0);
        assert_eq!(t.len(), 3 * 2 * 2);
        assert_eq!((t[0], t[1]), (1.0, 0.0));
        assert_eq!(t[4], 1f64.cos() as f32);
        assert_eq!(t[5], 1f64.sin() as f32);
        assert_eq!(t[6], (0.01f64).cos() as f32);
        // The inverse table: the same cosines, the sines negated (bit for bit).
        let inv = inverse_rope_table(4, 3, 10000.0);
        assert_eq!(inv.len(), t.len());
        for (k, (&f, &b)) in t.iter().zip(&inv).enumerate() {
            let want = if k % 2 == 1 { -f } else { f };
            assert_eq!(b.to_bits(), want.to_bits(), "entry {k}");
        }
    }
}
