//! Bench cases of the serving model's dense matmul ([`sparsekit_host::ModelOps::matmul`]):
//! `x [rows, k] · w [k, n] → out [rows, n]`, all f32, each output element one FMA chain
//! over `k` in order (the order every backend shares, so the bits agree).
//!
//! Cost model: `x`, `w` read once and `out` written once (`4 · (rows·k + k·n + rows·n)`
//! bytes), `2 · rows · k · n` FLOP of f32 FMA (not bf16 products: the weights are f32).
//! A decode step's few rows make the matmul memory-bound (every weight read for 8 rows); a
//! prefill chunk's rows make it compute-bound.

use sparsekit_host::model_ops::Matmul;
use sparsekit_host::{ModelOps, Result};

use crate::cost::Cost;
use crate::inputs::{f32_bytes, f32_values, rng};

/// One matmul's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
}

impl MatmulShape {
    /// Bench id, e.g. `m8_k4096_n1024`.
    pub fn id(&self) -> String {
        format!("m{}_k{}_n{}", self.rows, self.k, self.n)
    }

    pub fn cost(&self) -> Cost {
        let (m, k, n) = (self.rows as u64, self.k as u64, self.n as u64);
        Cost {
            bytes: 4 * (m * k + k * n + m * n),
            flops: 2 * m * k * n,
            bf16_dot: false,
            tiles: false,
        }
    }
}

/// A ready-to-run matmul (random nonzero operands; the output is overwritten each call).
#[derive(Debug)]
pub struct MatmulCase<B: ModelOps> {
    shape: MatmulShape,
    x: B::Buffer,
    w: B::Buffer,
    out: B::Buffer,
}

impl<B: ModelOps> MatmulCase<B> {
    pub fn build(backend: &B, shape: MatmulShape, seed: u64) -> Result<Self> {
        let mut r = rng(seed);
        let MatmulShape { rows, k, n } = shape;
        Ok(MatmulCase {
            shape,
            x: backend.upload(&f32_bytes(&f32_values(&mut r, rows * k, 1.0)))?,
            w: backend.upload(&f32_bytes(&f32_values(
                &mut r,
                k * n,
                1.0 / (k as f32).sqrt(),
            )))?,
            out: backend.alloc(4 * rows * n)?,
        })
    }

    pub fn run(&mut self, backend: &B) -> Result<()> {
        let MatmulShape { rows, k, n } = self.shape;
        backend.matmul(&Matmul::dense(rows, k, n), &self.x, &self.w, &mut self.out)
    }
}
