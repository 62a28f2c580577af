//! The dense model ops on the `cuda` backend: the GPU dense kernels of
//! `sparsekit_kernels::kernels` launched through `sparsekit_host::launcher::dense` (the
//! same launches the emulator runs; the same bits as the CPU backend).

use sparsekit_host::model_ops::ModelOps;

use crate::cuda::CudaBackend;

impl ModelOps for CudaBackend {
    sparsekit_host::kernel_model_ops!();
}
