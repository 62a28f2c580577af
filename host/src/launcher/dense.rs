//! The dense model ops ([`ModelOps`](crate::model_ops::ModelOps)) of every backend that
//! runs the GPU kernels (`emu` here, `cuda` in the root package), written once over
//! [`KernelDevice`] and pasted into its `impl ModelOps` by
//! [`kernel_model_ops!`](crate::kernel_model_ops).
//!
//! Each op validates its descriptor against the buffers (a rejected call launches
//! nothing and writes nothing), converts counts to the kernels' u32 parameters (checked)
//! and views to element offsets, and launches the kernel of `sparsekit_kernels::kernels`
//! with its own geometry. The kernels compute exactly the CPU backend's bits (see the
//! kernels' module docs), so a model gives the same tokens and logits on `cpu`, `emu` and
//! `cuda`.

use sparsekit_kernels::params::{
    dense_dtype, DenseAddParams, DenseArgmaxParams, DenseCastParams, DenseGatedPoolParams,
    DenseGatherRowsParams, DenseMatmulParams, DenseRmsNormParams, DenseRopeParams,
    DenseSwiGluParams, DenseView,
};

use super::{BufferAccess, KernelDevice};
use crate::error::Result;
use crate::kernel_params::{ptr, ptr_mut, u32_of};
use crate::model_ops::{
    Accumulate, Add, Argmax, Cast, DenseDtype, Embed, GatedPool, GatherRows, Matmul, RmsNorm, Rope,
    SwiGlu, View,
};

/// A view as the kernels' element view (validated views fit a buffer, so they fit u64).
fn view(v: &View) -> DenseView {
    DenseView {
        offset: v.offset as u64,
        row_stride: v.row_stride as u64,
        group_stride: v.group_stride as u64,
    }
}

/// The access of a buffer the kernel overwrites (`Write`) or reads first (`ReadWrite`).
fn access(accumulate: Accumulate) -> BufferAccess {
    match accumulate {
        Accumulate::Overwrite => BufferAccess::Write,
        Accumulate::Add => BufferAccess::ReadWrite,
    }
}

/// `matmul` on a [`KernelDevice`].
pub fn matmul<D: KernelDevice>(
    d: &D,
    op: &Matmul,
    x: &D::Buffer,
    w: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(x), d.buffer_len(w), d.buffer_len(out))?;
    if op.rows == 0 {
        return Ok(());
    }
    // SAFETY: the descriptor was validated against the three buffers (views inside them,
    // output views of distinct (row, group) disjoint, weights of groups·k·n f32); `out` is
    // an exclusive borrow, so it overlaps neither input.
    unsafe {
        d.launch(
            &[],
            &[("x", x), ("w", w)],
            &mut [("out", access(op.accumulate), out)],
            |a| {
                Ok(DenseMatmulParams {
                    x: ptr(a.read[0]),
                    w: ptr(a.read[1]),
                    out: ptr_mut(a.write[0]),
                    x_view: view(&op.x),
                    out_view: view(&op.out),
                    rows: u32_of("matmul rows", op.rows)?,
                    groups: u32_of("matmul groups", op.groups)?,
                    k: u32_of("matmul k", op.k)?,
                    n: u32_of("matmul n", op.n)?,
                    accumulate: (op.accumulate == Accumulate::Add) as u32,
                    _pad: 0,
                })
            },
        )
    }
}

/// `rms_norm` on a [`KernelDevice`].
pub fn rms_norm<D: KernelDevice>(
    d: &D,
    op: &RmsNorm,
    x: &D::Buffer,
    gamma: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(x), d.buffer_len(gamma), d.buffer_len(out))?;
    if op.rows == 0 {
        return Ok(());
    }
    // SAFETY: validated views and gamma of `width` f32; `out` exclusive.
    unsafe {
        d.launch(
            &[],
            &[("x", x), ("gamma", gamma)],
            &mut [("out", BufferAccess::Write, out)],
            |a| {
                Ok(DenseRmsNormParams {
                    x: ptr(a.read[0]),
                    gamma: ptr(a.read[1]),
                    out: ptr_mut(a.write[0]),
                    x_view: view(&op.x),
                    out_view: view(&op.out),
                    rows: u32_of("rms_norm rows", op.rows)?,
                    width: u32_of("rms_norm width", op.width)?,
                    eps: op.eps,
                    _pad: 0,
                })
            },
        )
    }
}

/// `rope` on a [`KernelDevice`].
pub fn rope<D: KernelDevice>(
    d: &D,
    op: &Rope<'_>,
    table: &D::Buffer,
    x: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(table), d.buffer_len(x), d.buffer_len(out))?;
    if op.positions.is_empty() || op.heads == 0 {
        return Ok(());
    }
    // SAFETY: validated: every position inside the table, views inside their buffers and
    // output groups disjoint; `out` exclusive.
    unsafe {
        d.launch(
            &[("positions", bytemuck::cast_slice(op.positions))],
            &[("table", table), ("x", x)],
            &mut [("out", BufferAccess::Write, out)],
            |a| {
                Ok(DenseRopeParams {
                    table: ptr(a.read[0]),
                    x: ptr(a.read[1]),
                    positions: ptr(a.meta[0]),
                    out: ptr_mut(a.write[0]),
                    x_view: view(&op.x),
                    out_view: view(&op.out),
                    rows: u32_of("rope rows", op.positions.len())?,
                    heads: u32_of("rope heads", op.heads)?,
                    rope_dim: u32_of("rope_dim", op.rope_dim)?,
                    _pad: 0,
                })
            },
        )
    }
}

/// `swiglu` on a [`KernelDevice`].
pub fn swiglu<D: KernelDevice>(
    d: &D,
    op: &SwiGlu,
    gate_up: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(gate_up), d.buffer_len(out))?;
    if op.rows == 0 || op.width == 0 {
        return Ok(());
    }
    // SAFETY: validated sizes (rows·2·width in, rows·width out); `out` exclusive.
    unsafe {
        d.launch(
            &[],
            &[("gate_up", gate_up)],
            &mut [("out", BufferAccess::Write, out)],
            |a| {
                Ok(DenseSwiGluParams {
                    gate_up: ptr(a.read[0]),
                    out: ptr_mut(a.write[0]),
                    rows: u32_of("swiglu rows", op.rows)?,
                    width: u32_of("swiglu width", op.width)?,
                })
            },
        )
    }
}

/// The row gather behind `embed` and `gather_rows`.
fn gather<D: KernelDevice>(
    d: &D,
    rows: &[u32],
    width: usize,
    views: (&View, &View),
    x: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    if rows.is_empty() || width == 0 {
        return Ok(());
    }
    // SAFETY: the caller validated every source row and both views; `out` exclusive.
    unsafe {
        d.launch(
            &[("rows", bytemuck::cast_slice(rows))],
            &[("x", x)],
            &mut [("out", BufferAccess::Write, out)],
            |a| {
                Ok(DenseGatherRowsParams {
                    x: ptr(a.read[0]),
                    src: ptr(a.meta[0]),
                    out: ptr_mut(a.write[0]),
                    x_view: view(views.0),
                    out_view: view(views.1),
                    n_rows: u32_of("gathered rows", rows.len())?,
                    width: u32_of("gather width", width)?,
                })
            },
        )
    }
}

/// `embed` on a [`KernelDevice`] (a gather of table rows).
pub fn embed<D: KernelDevice>(
    d: &D,
    op: &Embed<'_>,
    table: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(table), d.buffer_len(out))?;
    let v = View::dense(op.dim);
    gather(d, op.tokens, op.dim, (&v, &v), table, out)
}

/// `gather_rows` on a [`KernelDevice`].
pub fn gather_rows<D: KernelDevice>(
    d: &D,
    op: &GatherRows<'_>,
    x: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(x), d.buffer_len(out))?;
    gather(d, op.rows, op.width, (&op.x, &op.out), x, out)
}

/// `add` on a [`KernelDevice`].
pub fn add<D: KernelDevice>(d: &D, op: &Add, x: &D::Buffer, acc: &mut D::Buffer) -> Result<()> {
    op.validate(d.buffer_len(x), d.buffer_len(acc))?;
    if op.rows == 0 || op.width == 0 {
        return Ok(());
    }
    // SAFETY: validated views; `acc` exclusive (so distinct from `x`).
    unsafe {
        d.launch(
            &[],
            &[("x", x)],
            &mut [("acc", BufferAccess::ReadWrite, acc)],
            |a| {
                Ok(DenseAddParams {
                    x: ptr(a.read[0]),
                    acc: ptr_mut(a.write[0]),
                    x_view: view(&op.x),
                    acc_view: view(&op.acc),
                    rows: u32_of("add rows", op.rows)?,
                    width: u32_of("add width", op.width)?,
                })
            },
        )
    }
}

fn dtype(t: DenseDtype) -> u32 {
    match t {
        DenseDtype::F32 => dense_dtype::F32,
        DenseDtype::Bf16 => dense_dtype::BF16,
    }
}

/// `cast` on a [`KernelDevice`].
pub fn cast<D: KernelDevice>(d: &D, op: &Cast, x: &D::Buffer, out: &mut D::Buffer) -> Result<()> {
    op.validate(d.buffer_len(x), d.buffer_len(out))?;
    if op.rows == 0 || op.groups == 0 || op.width == 0 {
        return Ok(());
    }
    // SAFETY: validated views in elements of each side's dtype; `out` exclusive.
    unsafe {
        d.launch(
            &[],
            &[("x", x)],
            &mut [("out", BufferAccess::Write, out)],
            |a| {
                Ok(DenseCastParams {
                    x: ptr(a.read[0]),
                    out: ptr_mut(a.write[0]),
                    x_view: view(&op.x),
                    out_view: view(&op.out),
                    rows: u32_of("cast rows", op.rows)?,
                    groups: u32_of("cast groups", op.groups)?,
                    width: u32_of("cast width", op.width)?,
                    from: dtype(op.from),
                    to: dtype(op.to),
                    _pad: 0,
                })
            },
        )
    }
}

/// `argmax` on a [`KernelDevice`].
pub fn argmax<D: KernelDevice>(
    d: &D,
    op: &Argmax,
    logits: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(logits), d.buffer_len(out))?;
    if op.rows == 0 {
        return Ok(());
    }
    // SAFETY: validated sizes (rows·width logits, rows u32 out, width ≥ 1).
    unsafe {
        d.launch(
            &[],
            &[("logits", logits)],
            &mut [("out", BufferAccess::Write, out)],
            |a| {
                Ok(DenseArgmaxParams {
                    logits: ptr(a.read[0]),
                    out: ptr_mut(a.write[0]),
                    rows: u32_of("argmax rows", op.rows)?,
                    width: u32_of("argmax width", op.width)?,
                })
            },
        )
    }
}

/// `gated_pool` on a [`KernelDevice`]: the source ids are staged as metadata; one thread
/// per output element (`dense_gated_pool`).
pub fn gated_pool<D: KernelDevice>(
    d: &D,
    op: &GatedPool<'_>,
    x: &D::Buffer,
    bias: &D::Buffer,
    out: &mut D::Buffer,
) -> Result<()> {
    op.validate(d.buffer_len(x), d.buffer_len(bias), d.buffer_len(out))?;
    if op.entries == 0 {
        return Ok(());
    }
    // SAFETY: validated: `x` holds rows·2·width f32, `bias` span·width, `out`
    // entries·width; `sources` holds entries·span ids, each a row of `x` or EMPTY, with a
    // valid slot per entry; `out` is an exclusive borrow, so it overlaps neither input.
    unsafe {
        d.launch(
            &[("sources", bytemuck::cast_slice(op.sources))],
            &[("x", x), ("bias", bias)],
            &mut [("out", BufferAccess::Write, out)],
            |a| {
                Ok(DenseGatedPoolParams {
                    x: ptr(a.read[0]),
                    bias: ptr(a.read[1]),
                    sources: ptr(a.meta[0]),
                    out: ptr_mut(a.write[0]),
                    entries: u32_of("gated_pool entries", op.entries)?,
                    span: u32_of("gated_pool span", op.span)?,
                    width: u32_of("gated_pool width", op.width)?,
                    _pad: 0,
                })
            },
        )
    }
}

/// The methods of `impl ModelOps` for a backend that implements
/// [`KernelDevice`](crate::launcher::KernelDevice): the ten dense ops of
/// [`launcher::dense`](crate::launcher::dense).
#[macro_export]
macro_rules! kernel_model_ops {
    () => {
        fn matmul(
            &self,
            op: &$crate::model_ops::Matmul,
            x: &Self::Buffer,
            w: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::matmul(self, op, x, w, out)
        }
        fn rms_norm(
            &self,
            op: &$crate::model_ops::RmsNorm,
            x: &Self::Buffer,
            gamma: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::rms_norm(self, op, x, gamma, out)
        }
        fn rope(
            &self,
            op: &$crate::model_ops::Rope<'_>,
            table: &Self::Buffer,
            x: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::rope(self, op, table, x, out)
        }
        fn swiglu(
            &self,
            op: &$crate::model_ops::SwiGlu,
            gate_up: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::swiglu(self, op, gate_up, out)
        }
        fn embed(
            &self,
            op: &$crate::model_ops::Embed<'_>,
            table: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::embed(self, op, table, out)
        }
        fn gather_rows(
            &self,
            op: &$crate::model_ops::GatherRows<'_>,
            x: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::gather_rows(self, op, x, out)
        }
        fn add(
            &self,
            op: &$crate::model_ops::Add,
            x: &Self::Buffer,
            acc: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::add(self, op, x, acc)
        }
        fn cast(
            &self,
            op: &$crate::model_ops::Cast,
            x: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::cast(self, op, x, out)
        }
        fn argmax(
            &self,
            op: &$crate::model_ops::Argmax,
            logits: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::argmax(self, op, logits, out)
        }
        fn gated_pool(
            &self,
            op: &$crate::model_ops::GatedPool<'_>,
            x: &Self::Buffer,
            bias: &Self::Buffer,
            out: &mut Self::Buffer,
        ) -> $crate::Result<()> {
            $crate::launcher::dense::gated_pool(self, op, x, bias, out)
        }
    };
}
