//! Parameters of the dense kernels of the synthetic model (`sparsekit_host::model_ops`):
//! matmul, RMSNorm, rope, SwiGLU, embedding and row gathers, residual add, casts,
//! argmax and DeepSeek-V4's compressor pooling. Operands are addressed in **elements** of their own type through
//! [`DenseView`]s, never in bytes; counts are u32 (the host checks they fit).

use crate::global::{GlobalMut, GlobalPtr};

/// Where a `[rows, groups, width]` operand sits in its buffer, in elements: element
/// `(r, g, c)` is at `offset + r·row_stride + g·group_stride + c`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DenseView {
    pub offset: u64,
    pub row_stride: u64,
    pub group_stride: u64,
}

impl DenseView {
    /// Element index of `(r, g, c)`.
    #[inline(always)]
    pub fn at(&self, r: u32, g: u32, c: u32) -> usize {
        (self.offset + r as u64 * self.row_stride + g as u64 * self.group_stride + c as u64)
            as usize
    }
}

/// Element type codes of [`DenseCastParams`].
pub mod dense_dtype {
    /// f32.
    pub const F32: u32 = 0;
    /// bf16 (its bits as u16).
    pub const BF16: u32 = 1;
}

/// `dense_matmul`: per group `g`, `out[r, g, :] (=|+=) x[r, g, :k] · w[g]` with `w[g]` the
/// row-major f32 `[k, n]` matrix at elements `g·k·n`; every output element is one FMA
/// chain over `p = 0..k` in order, from `+0.0` (overwrite) or the element's value (add).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseMatmulParams {
    pub x: GlobalPtr<f32>,
    /// `[groups, k, n]`.
    pub w: GlobalPtr<f32>,
    pub out: GlobalMut<f32>,
    pub x_view: DenseView,
    pub out_view: DenseView,
    pub rows: u32,
    pub groups: u32,
    pub k: u32,
    pub n: u32,
    /// 1: add into `out`; 0: overwrite it.
    pub accumulate: u32,
    pub _pad: u32,
}

/// `dense_rms_norm`: `out[r, c] = (x[r, c] · inv) · gamma[c]`, `inv = 1 / sqrt(Σ x² /
/// width + eps)`, the sum over 16 lanes in column order and a fixed pairwise tree.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseRmsNormParams {
    pub x: GlobalPtr<f32>,
    /// `[width]`.
    pub gamma: GlobalPtr<f32>,
    pub out: GlobalMut<f32>,
    pub x_view: DenseView,
    pub out_view: DenseView,
    pub rows: u32,
    pub width: u32,
    pub eps: f32,
    pub _pad: u32,
}

/// `dense_rope`: rotate-half rope on `heads` groups of `rope_dim` values per row, the
/// (cos, sin) of row `r` from entry `positions[r]` of the `[positions, rope_dim/2, 2]`
/// table.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseRopeParams {
    pub table: GlobalPtr<f32>,
    pub x: GlobalPtr<f32>,
    /// `[rows]` (validated inside the table).
    pub positions: GlobalPtr<u32>,
    pub out: GlobalMut<f32>,
    pub x_view: DenseView,
    pub out_view: DenseView,
    pub rows: u32,
    pub heads: u32,
    pub rope_dim: u32,
    pub _pad: u32,
}

/// `dense_swiglu`: `out[r, c] = silu(gu[r, c]) · gu[r, width + c]`, dense operands.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseSwiGluParams {
    /// `[rows, 2·width]`.
    pub gate_up: GlobalPtr<f32>,
    /// `[rows, width]`.
    pub out: GlobalMut<f32>,
    pub rows: u32,
    pub width: u32,
}

/// The source id of an empty slot of [`DenseGatedPoolParams::sources`] (skipped: neither
/// its row nor its position bias is read).
pub const GATED_POOL_EMPTY: u32 = u32::MAX;

/// `dense_gated_pool`: DeepSeek-V4's compressor pooling. For entry `e` and channel `c`,
/// over the valid slots `i` of `sources[e, :]` in increasing `i`:
/// `z_i = g[src, c] + bias[i, c]`, `m = max z_i`, `w_i = exp_portable(z_i − m)`,
/// `out[e, c] = (Σ w_i · v[src, c]) / (Σ w_i)`, both sums sequential from `+0.0`
/// (see `sparsekit_host::model_ops::GatedPool` for the whole contract).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseGatedPoolParams {
    /// `[rows, 2·width]`: per raw token the values (columns `0..width`), then the gate
    /// logits (columns `width..2·width`).
    pub x: GlobalPtr<f32>,
    /// `[span, width]` position bias, added to the gate logit of slot `i`.
    pub bias: GlobalPtr<f32>,
    /// `[entries, span]` row ids of `x` ([`GATED_POOL_EMPTY`] = empty slot); validated:
    /// every id is a row of `x` or empty, and every entry has a valid slot.
    pub sources: GlobalPtr<u32>,
    /// `[entries, width]`.
    pub out: GlobalMut<f32>,
    pub entries: u32,
    pub span: u32,
    pub width: u32,
    pub _pad: u32,
}

/// `dense_gather_rows`: `out[i, :width] = x[src[i], :width]` (the embedding lookup is the
/// case of a dense `[vocab, dim]` table).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseGatherRowsParams {
    pub x: GlobalPtr<f32>,
    /// `[n_rows]` source rows (validated below the source's row count).
    pub src: GlobalPtr<u32>,
    pub out: GlobalMut<f32>,
    pub x_view: DenseView,
    pub out_view: DenseView,
    pub n_rows: u32,
    pub width: u32,
}

/// `dense_add`: `acc[r, c] += x[r, c]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseAddParams {
    pub x: GlobalPtr<f32>,
    pub acc: GlobalMut<f32>,
    pub x_view: DenseView,
    pub acc_view: DenseView,
    pub rows: u32,
    pub width: u32,
}

/// `dense_cast`: `out[r, g, c] = convert(x[r, g, c])` between [`dense_dtype`]s (f32 → bf16
/// rounds to nearest even, NaN stays NaN with its quiet bit set; bf16 → f32 exact).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseCastParams {
    pub x: GlobalPtr<u8>,
    pub out: GlobalMut<u8>,
    pub x_view: DenseView,
    pub out_view: DenseView,
    pub rows: u32,
    pub groups: u32,
    pub width: u32,
    pub from: u32,
    pub to: u32,
    pub _pad: u32,
}

/// `dense_argmax`: per row of `[rows, width]` f32 logits, the column of the largest value,
/// the lowest on ties, the first NaN above every number.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseArgmaxParams {
    pub logits: GlobalPtr<f32>,
    /// `[rows]`.
    pub out: GlobalMut<u32>,
    pub rows: u32,
    pub width: u32,
}
