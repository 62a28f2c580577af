//! `sparsekit._native`: sparsekit's ops on torch tensors, for the Python package
//! (`python/sparsekit/`, whose `ops` module is the public API and validates arguments
//! first, with the user's argument names).
//!
//! No libtorch: a tensor is read through its Python attributes (`data_ptr()`, `shape`,
//! `stride()`, `dtype`, `device`, `untyped_storage().nbytes()`, `storage_offset()`), and
//! every function re-checks here what memory safety rests on (dtypes, contiguity, byte
//! sizes through the op descriptors of `sparsekit_host`, devices, overlaps), raising
//! `TypeError`/`ValueError` that name the argument.
//!
//! - **CPU tensors** run the `cpu` backend's kernels in place on the tensors' memory
//!   (`sparsekit_host::cpu`), with the GIL released, after the op descriptor has validated
//!   every size and every metadata entry (slots, page ids, ranges, indices).
//! - **CUDA tensors** are launched on the stream the caller passes
//!   (`torch.cuda.current_stream().cuda_stream`) through
//!   [`sparsekit::cuda::raw::RawLauncher`]: cudarc cannot wrap a borrowed stream, so the
//!   launch goes through its `sys` layer on the device's primary context (PyTorch's). No
//!   allocation, copy or synchronisation happens here (scratch buffers come from the
//!   caller, allocated by torch), so the call is CUDA-graph-capture safe. Device metadata
//!   cannot be read without a synchronisation: its sizes are checked here, its contents
//!   are the caller's contract (`sparsekit_host::launcher::raw`), which the Python layer
//!   meets by sanitising it on the device first. The CUDA driver is loaded only when the
//!   first CUDA tensor arrives.

use std::ops::Range;

use half::bf16;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use sparsekit::cuda::raw::RawLauncher;
use sparsekit_host::cpu::{self, CpuIsa};
use sparsekit_host::dtype::ScaleFormat;
use sparsekit_host::launcher::raw::{
    self, DeviceBuf, IndexerShape, TopkTarget, V4CacheBufs, V4CacheShape, V4Shape,
};
use sparsekit_host::layout::{
    IndexKDtype, IndexKLayout as HostIndexK, KvDtype, KvLayout as HostKv, PageLayout,
};
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, PageTable, PagedRegion,
    QueryRange, ShortRows, SparseMla, SparseMlaV4, Topk, TopkOutput, V4Cache,
};
use sparsekit_host::{Error, ErrorKind};

mod layouts;
mod ops;
mod ops_v4;
mod pages;
mod tensor;

pub(crate) use layouts::*;
pub(crate) use ops::*;
pub(crate) use ops_v4::*;
pub(crate) use pages::*;
pub(crate) use tensor::*;

/// What this build carries: the PTX archs, whether a CUDA driver can be loaded (probed
/// without loading it), the CPU vector path.
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
    let archs: Vec<&str> = sparsekit::ptx::PTX.iter().map(|(a, _)| *a).collect();
    PyTuple::new(
        py,
        [
            archs.join(",").into_pyobject(py)?.into_any(),
            sparsekit::ptx::PTX_BUILD_INFO.into_pyobject(py)?.into_any(),
            CpuIsa::get().isa().name().into_pyobject(py)?.into_any(),
        ],
    )
}

/// Whether the CUDA driver library can be loaded (a probe: no driver call is made).
#[pyfunction]
fn cuda_driver_present() -> bool {
    sparsekit::cuda::driver_present()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<IndexKLayout>()?;
    m.add_class::<KvLayout>()?;
    m.add_function(wrap_pyfunction!(index_k_store, m)?)?;
    m.add_function(wrap_pyfunction!(kv_store, m)?)?;
    m.add_function(wrap_pyfunction!(indexer_logits, m)?)?;
    m.add_function(wrap_pyfunction!(topk, m)?)?;
    m.add_function(wrap_pyfunction!(decode_rows, m)?)?;
    m.add_function(wrap_pyfunction!(topk_scratch_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_mla, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_mla_scratch_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_mla_v4, m)?)?;
    m.add_function(wrap_pyfunction!(sparse_mla_v4_scratch_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(copy_pages, m)?)?;
    m.add_function(wrap_pyfunction!(page_checksums, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_driver_present, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
