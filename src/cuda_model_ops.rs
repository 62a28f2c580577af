//! The dense model ops on the `cuda` backend. There are no GPU dense kernels yet: each op
//! runs the CPU kernels on host copies of its operands ([`staged`]) — bit-identical to
//! the `cpu` backend's dense ops and batch-invariant, but slow (operands cross the bus on
//! every call). The DSA ops inside the model (stores, indexer, top-k, sparse MLA) run on
//! the GPU.

use sparsekit_host::cpu::dense::staged;
use sparsekit_host::model_ops::{
    Add, Argmax, Cast, Embed, GatherRows, Matmul, ModelOps, RmsNorm, Rope, SwiGlu,
};
use sparsekit_host::Result;

use crate::cuda::{CudaBackend, CudaBuffer};

impl ModelOps for CudaBackend {
    fn matmul(
        &self,
        op: &Matmul,
        x: &CudaBuffer,
        w: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        staged::matmul(self, op, x, w, out)
    }

    fn rms_norm(
        &self,
        op: &RmsNorm,
        x: &CudaBuffer,
        gamma: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        staged::rms_norm(self, op, x, gamma, out)
    }

    fn rope(
        &self,
        op: &Rope<'_>,
        table: &CudaBuffer,
        x: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        staged::rope(self, op, table, x, out)
    }

    fn swiglu(&self, op: &SwiGlu, gate_up: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        staged::swiglu(self, op, gate_up, out)
    }

    fn embed(&self, op: &Embed<'_>, table: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        staged::embed(self, op, table, out)
    }

    fn gather_rows(&self, op: &GatherRows<'_>, x: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        staged::gather_rows(self, op, x, out)
    }

    fn add(&self, op: &Add, x: &CudaBuffer, acc: &mut CudaBuffer) -> Result<()> {
        staged::add(self, op, x, acc)
    }

    fn cast(&self, op: &Cast, x: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        staged::cast(self, op, x, out)
    }

    fn argmax(&self, op: &Argmax, logits: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        staged::argmax(self, op, logits, out)
    }
}
