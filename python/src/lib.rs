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

/// A sparsekit error as the Python exception of its kind: an invalid call is a
/// `ValueError`, anything else (device, driver) a `RuntimeError`.
fn py_err(e: Error) -> PyErr {
    match e.kind() {
        ErrorKind::Op => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// What this module needs to know of a torch tensor, read from its Python attributes.
#[derive(Debug)]
struct Tensor {
    name: &'static str,
    addr: u64,
    shape: Vec<usize>,
    strides: Vec<isize>,
    /// `str(t.dtype)` without the `torch.` prefix (`bfloat16`, `float8_e4m3fn`, ...).
    dtype: String,
    itemsize: usize,
    device: Device,
    /// Bytes of the tensor's storage from its first element on.
    extent: usize,
}

fn attr_err(name: &'static str, what: &str, e: PyErr) -> PyErr {
    PyTypeError::new_err(format!("{name}: expected a torch.Tensor ({what}: {e})"))
}

impl Tensor {
    /// Reads `obj`'s attributes; a `TypeError` naming `name` when it is not a tensor.
    fn of(name: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
        let shape: Vec<usize> = obj
            .getattr("shape")
            .and_then(|s| s.extract())
            .map_err(|e| attr_err(name, "shape", e))?;
        let strides: Vec<isize> = obj
            .call_method0("stride")
            .and_then(|s| s.extract())
            .map_err(|e| attr_err(name, "stride()", e))?;
        let addr: u64 = obj
            .call_method0("data_ptr")
            .and_then(|s| s.extract())
            .map_err(|e| attr_err(name, "data_ptr()", e))?;
        let dtype: String = obj
            .getattr("dtype")
            .and_then(|d| d.str())
            .and_then(|d| d.extract())
            .map_err(|e| attr_err(name, "dtype", e))?;
        let itemsize: usize = obj
            .call_method0("element_size")
            .and_then(|s| s.extract())
            .map_err(|e| attr_err(name, "element_size()", e))?;
        let device = obj
            .getattr("device")
            .map_err(|e| attr_err(name, "device", e))?;
        let kind: String = device
            .getattr("type")
            .and_then(|t| t.extract())
            .map_err(|e| attr_err(name, "device.type", e))?;
        let index: Option<usize> = device
            .getattr("index")
            .and_then(|t| t.extract())
            .map_err(|e| attr_err(name, "device.index", e))?;
        let device = match kind.as_str() {
            "cpu" => Device::Cpu,
            "cuda" => Device::Cuda(index.unwrap_or(0)),
            other => {
                return Err(PyValueError::new_err(format!(
                    "{name}: tensors on device '{other}' are not supported (cpu or cuda)"
                )))
            }
        };
        let storage_bytes: usize = obj
            .call_method0("untyped_storage")
            .and_then(|s| s.call_method0("nbytes"))
            .and_then(|s| s.extract())
            .map_err(|e| attr_err(name, "untyped_storage().nbytes()", e))?;
        let offset: usize = obj
            .call_method0("storage_offset")
            .and_then(|s| s.extract())
            .map_err(|e| attr_err(name, "storage_offset()", e))?;
        let extent = storage_bytes.saturating_sub(offset.saturating_mul(itemsize));
        let dtype = dtype.trim_start_matches("torch.").to_string();
        let t = Tensor {
            name,
            addr,
            shape,
            strides,
            dtype,
            itemsize,
            device,
            extent,
        };
        if t.shape.len() != t.strides.len() {
            return Err(PyValueError::new_err(format!(
                "{name}: shape and stride() disagree"
            )));
        }
        Ok(t)
    }

    fn numel(&self) -> PyResult<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| PyValueError::new_err(format!("{}: size overflows", self.name)))
    }

    /// Bytes of the tensor's elements.
    fn bytes(&self) -> PyResult<usize> {
        self.numel()?
            .checked_mul(self.itemsize)
            .ok_or_else(|| PyValueError::new_err(format!("{}: size overflows", self.name)))
    }

    fn is_contiguous(&self) -> bool {
        let mut expect = 1isize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expect {
                return false;
            }
            expect = expect.saturating_mul(d as isize);
        }
        true
    }

    /// A `TypeError` unless the dtype is one of `allowed`.
    fn dtype_in(&self, allowed: &[&str]) -> PyResult<&Self> {
        if allowed.contains(&self.dtype.as_str()) {
            Ok(self)
        } else {
            Err(PyTypeError::new_err(format!(
                "{}: dtype torch.{} is not supported here (expected {})",
                self.name,
                self.dtype,
                allowed
                    .iter()
                    .map(|a| format!("torch.{a}"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )))
        }
    }

    /// A `ValueError` unless the tensor is contiguous (row-major, no gaps) and its
    /// storage holds all its bytes.
    fn contiguous(&self) -> PyResult<&Self> {
        if !self.is_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{}: must be contiguous (shape {:?}, strides {:?}); call .contiguous() first",
                self.name, self.shape, self.strides
            )));
        }
        if self.bytes()? > self.extent {
            return Err(PyValueError::new_err(format!(
                "{}: its storage holds {} bytes from the first element, the tensor {}",
                self.name,
                self.extent,
                self.bytes()?
            )));
        }
        Ok(self)
    }

    /// The rows of a 2-D tensor with unit column stride as a row-major buffer of
    /// `[rows, row_stride]` elements (`row_stride = stride(0) ≥ shape[1]`), when its storage
    /// covers every row's full stride: returns `row_stride`.
    fn row_major_2d(&self) -> PyResult<usize> {
        if self.shape.len() != 2 {
            return Err(PyValueError::new_err(format!(
                "{}: expected 2 dimensions, got shape {:?}",
                self.name, self.shape
            )));
        }
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let row_stride = if rows <= 1 {
            cols
        } else {
            self.strides[0].max(0) as usize
        };
        if (cols > 1 && self.strides[1] != 1) || row_stride < cols {
            return Err(PyValueError::new_err(format!(
                "{}: rows must be contiguous (strides {:?}); call .contiguous() first",
                self.name, self.strides
            )));
        }
        let need = rows
            .checked_mul(row_stride)
            .and_then(|x| x.checked_mul(self.itemsize))
            .ok_or_else(|| PyValueError::new_err(format!("{}: size overflows", self.name)))?;
        if need > self.extent {
            return Err(PyValueError::new_err(format!(
                "{}: rows of stride {row_stride} need {need} bytes of storage, it holds {}; call .contiguous() first",
                self.name, self.extent
            )));
        }
        Ok(row_stride)
    }

    /// The bytes `[addr, addr + len)` the kernels touch.
    fn span(&self, len: usize) -> Range<u64> {
        self.addr..self.addr.saturating_add(len as u64)
    }

    fn device_buf(&self, len: usize) -> DeviceBuf {
        DeviceBuf::new(self.addr, len)
    }

    /// The first `len` bytes as a slice of `E` (CPU tensors only).
    ///
    /// # Safety
    /// The tensor object is alive for `'a` and its storage holds `len` bytes from
    /// `addr` (checked by the callers through [`Self::contiguous`] or
    /// [`Self::row_major_2d`]); nothing writes them during `'a` (the callers check that no
    /// mutable slice of this call overlaps them; other threads are the user's business,
    /// as with torch's own CPU ops).
    unsafe fn slice<'a, E: bytemuck::Pod>(&self, len: usize) -> PyResult<&'a [E]> {
        let n = self.elems::<E>(len)?;
        if n == 0 {
            return Ok(&[]);
        }
        // SAFETY: the caller's contract; `elems` checked alignment and size.
        Ok(unsafe { std::slice::from_raw_parts(self.addr as usize as *const E, n) })
    }

    /// The first `len` bytes as a mutable slice of `E` (CPU tensors only).
    ///
    /// # Safety
    /// As [`Self::slice`], and no other slice of this call overlaps these bytes.
    unsafe fn slice_mut<'a, E: bytemuck::Pod>(&self, len: usize) -> PyResult<&'a mut [E]> {
        let n = self.elems::<E>(len)?;
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: the caller's contract; `elems` checked alignment and size.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr as usize as *mut E, n) })
    }

    fn elems<E>(&self, len: usize) -> PyResult<usize> {
        let size = std::mem::size_of::<E>();
        if len > self.extent {
            return Err(PyValueError::new_err(format!(
                "{}: {len} bytes needed, its storage holds {}",
                self.name, self.extent
            )));
        }
        if len % size != 0 || (len > 0 && self.addr % std::mem::align_of::<E>() as u64 != 0) {
            return Err(PyValueError::new_err(format!(
                "{}: data at {:#x} ({len} bytes) is not aligned for {size}-byte elements",
                self.name, self.addr
            )));
        }
        Ok(len / size)
    }
}

/// The device every tensor of a call is on, or a `ValueError` naming the first one on
/// another device.
fn common_device(tensors: &[&Tensor]) -> PyResult<Device> {
    let Some(first) = tensors.first() else {
        return Ok(Device::Cpu);
    };
    for t in tensors {
        if t.device != first.device {
            return Err(PyValueError::new_err(format!(
                "{}: on {}, but {} is on {} (every tensor of a call must be on one device)",
                t.name, t.device, first.name, first.device
            )));
        }
    }
    Ok(first.device)
}

/// A `ValueError` when a written range overlaps another range of the call.
fn no_overlap(written: &[(&Tensor, usize)], read: &[(&Tensor, usize)]) -> PyResult<()> {
    for (i, (w, wl)) in written.iter().enumerate() {
        let a = w.span(*wl);
        let others = written
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, x)| x)
            .chain(read.iter());
        for (o, ol) in others {
            let b = o.span(*ol);
            if a.start < b.end && b.start < a.end && *wl > 0 && *ol > 0 {
                return Err(PyValueError::new_err(format!(
                    "{}: its memory overlaps {} (outputs must not alias other arguments)",
                    w.name, o.name
                )));
            }
        }
    }
    Ok(())
}

/// The stream of a CUDA call, or a `ValueError` when none was given.
fn stream_of(stream: Option<usize>) -> PyResult<usize> {
    stream.ok_or_else(|| {
        PyValueError::new_err(
            "stream: CUDA tensors need the stream to launch on (torch.cuda.current_stream().cuda_stream)",
        )
    })
}

/// Launches `params` on `stream` of device `ordinal`.
///
/// # Safety
/// As [`RawLauncher::launch`].
unsafe fn launch<P: sparsekit_kernels::launch::KernelParams>(
    ordinal: usize,
    stream: usize,
    params: P,
) -> PyResult<()> {
    let l = RawLauncher::for_device(ordinal).map_err(py_err)?;
    // SAFETY: the caller's contract.
    unsafe { l.launch(stream, params) }.map_err(py_err)
}

// ---------------------------------------------------------------- layouts

/// A paged index-K cache layout (`sparsekit_host::layout::IndexKLayout`): fp8 pages hold
/// all `page_size × head_dim` e4m3 bytes, then `page_size` f32 scales; fp4 pages
/// (DeepSeek-V4) all `page_size × head_dim / 2` packed e2m1 bytes, then `head_dim / 32`
/// ue8m0 bytes per token; bf16 pages only bf16 values.
#[pyclass(frozen, module = "sparsekit._native")]
#[derive(Clone, Copy, Debug)]
struct IndexKLayout(HostIndexK);

#[pymethods]
impl IndexKLayout {
    /// `dtype`: `"fp8_e4m3"`, `"bf16"` or `"fp4_e2m1"` (DeepSeek-V4; `head_dim` a
    /// multiple of 128); `scale` (fp8): `"fp32"` (`max(amax, 1e-4) / 448`) or `"ue8m0"`
    /// (rounded up to a power of two); fp4 has its own ue8m0 group scales and takes the
    /// default.
    #[new]
    #[pyo3(signature = (dtype = "fp8_e4m3", head_dim = 128, page_size = 64, scale = "fp32"))]
    fn new(dtype: &str, head_dim: usize, page_size: usize, scale: &str) -> PyResult<Self> {
        let scale = match scale {
            "fp32" => ScaleFormat::Fp32,
            "ue8m0" => ScaleFormat::Ue8m0,
            other => {
                return Err(PyValueError::new_err(format!(
                    "scale: '{other}' is not 'fp32' or 'ue8m0'"
                )))
            }
        };
        let dtype = match dtype {
            "fp8_e4m3" | "fp8" => IndexKDtype::Fp8E4m3 { scale },
            "bf16" | "bfloat16" => IndexKDtype::Bf16,
            "fp4_e2m1" | "fp4" => {
                if scale != ScaleFormat::Fp32 {
                    return Err(PyValueError::new_err(
                        "scale: fp4_e2m1 keys have ue8m0 scales per 32 values; leave scale out",
                    ));
                }
                IndexKDtype::Fp4E2m1
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "dtype: '{other}' is not 'fp8_e4m3', 'bf16' or 'fp4_e2m1'"
                )))
            }
        };
        HostIndexK::new(dtype, head_dim, page_size)
            .map(IndexKLayout)
            .map_err(py_err)
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.0.dtype().name()
    }
    #[getter]
    fn scale(&self) -> Option<&'static str> {
        self.0.scale_format().map(|s| match s {
            ScaleFormat::Fp32 => "fp32",
            ScaleFormat::Ue8m0 => "ue8m0",
        })
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.0.head_dim()
    }
    #[getter]
    fn page_size(&self) -> usize {
        self.0.page_size()
    }
    /// Bytes of one token (values + scale).
    #[getter]
    fn bytes_per_token(&self) -> usize {
        self.0.bytes_per_token()
    }
    /// Bytes of one page.
    #[getter]
    fn bytes_per_page(&self) -> usize {
        self.0.bytes_per_page()
    }
    /// Byte offset of the scale section inside a page (`None` for bf16).
    #[getter]
    fn scale_section_offset(&self) -> Option<usize> {
        self.0.scale_section_offset()
    }
    /// Value bytes of one token (fp8 `head_dim`, fp4 `head_dim / 2`, bf16 `2 · head_dim`).
    #[getter]
    fn value_bytes_per_token(&self) -> usize {
        self.0.value_bytes_per_token()
    }
    /// Scale bytes of one token (fp8 4, fp4 `head_dim / 32`, bf16 0).
    #[getter]
    fn scale_bytes_per_token(&self) -> usize {
        self.0.scale_bytes_per_token()
    }
    /// The descriptor's stable 64-bit fingerprint.
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.0.fingerprint()
    }
    fn __repr__(&self) -> String {
        format!(
            "IndexKLayout(dtype='{}', head_dim={}, page_size={}{})",
            self.dtype(),
            self.head_dim(),
            self.page_size(),
            self.scale()
                .map(|s| format!(", scale='{s}'"))
                .unwrap_or_default()
        )
    }
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<IndexKLayout>()
            .map(|o| o.get().0 == self.0)
            .unwrap_or(false)
    }
    fn __hash__(&self) -> u64 {
        self.0.fingerprint()
    }
}

/// A paged MLA KV cache layout (`sparsekit_host::layout::KvLayout`): bf16 tokens
/// `[nope | rope]`; `fp8_ds_mla` tokens (FlashMLA's V3.2 format) `nope` e4m3 bytes, one
/// f32 scale per 128 values, then `rope` bf16; DeepSeek-V4's `model1_fp8` (per page: rows
/// of 448 e4m3 + 64 bf16 rope, then 8 bytes of ue8m0 tile scales per token, the page
/// padded to a multiple of 576 B) and `bf16_512` (512 bf16 per token), whose value is the
/// whole 512-d row.
#[pyclass(frozen, module = "sparsekit._native")]
#[derive(Clone, Copy, Debug)]
struct KvLayout(HostKv);

#[pymethods]
impl KvLayout {
    /// `dtype`: `"fp8_ds_mla"` or `"bf16"` (DeepSeek-V3.2; `nope_dim` defaults to 512),
    /// `"model1_fp8"` or `"bf16_512"` (DeepSeek-V4; `nope_dim` 448, `rope_dim` 64, the
    /// defaults). `rope_dim` defaults to 64.
    #[new]
    #[pyo3(signature = (dtype = "fp8_ds_mla", nope_dim = None, rope_dim = None, page_size = 64))]
    fn new(
        dtype: &str,
        nope_dim: Option<usize>,
        rope_dim: Option<usize>,
        page_size: usize,
    ) -> PyResult<Self> {
        let dtype = match dtype {
            "fp8_ds_mla" => KvDtype::Fp8DsMla,
            "bf16" | "bfloat16" => KvDtype::Bf16,
            "model1_fp8" => KvDtype::Model1Fp8,
            "bf16_512" => KvDtype::Bf16x512,
            other => {
                return Err(PyValueError::new_err(format!(
                    "dtype: '{other}' is not 'fp8_ds_mla', 'bf16', 'model1_fp8' or 'bf16_512'"
                )))
            }
        };
        let nope_dim = nope_dim.unwrap_or(if dtype.is_v4() { 448 } else { 512 });
        HostKv::new(dtype, nope_dim, rope_dim.unwrap_or(64), page_size)
            .map(KvLayout)
            .map_err(py_err)
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.0.dtype().name()
    }
    #[getter]
    fn nope_dim(&self) -> usize {
        self.0.nope_dim()
    }
    #[getter]
    fn rope_dim(&self) -> usize {
        self.0.rope_dim()
    }
    /// `nope_dim + rope_dim`.
    #[getter]
    fn d_qk(&self) -> usize {
        self.0.d_qk()
    }
    /// The attention value dim: `nope_dim` (V3.2 layouts), the whole row `d_qk` (V4).
    #[getter]
    fn d_v(&self) -> usize {
        self.0.d_v()
    }
    /// Whether this is a DeepSeek-V4 layout (`model1_fp8`, `bf16_512`: `sparse_mla_v4`).
    #[getter]
    fn is_v4(&self) -> bool {
        self.0.dtype().is_v4()
    }
    /// Byte offset of the ue8m0 scale section inside a page (`model1_fp8` only).
    #[getter]
    fn scale_section_offset(&self) -> Option<usize> {
        self.0.scale_section_offset()
    }
    #[getter]
    fn page_size(&self) -> usize {
        self.0.page_size()
    }
    #[getter]
    fn bytes_per_token(&self) -> usize {
        self.0.bytes_per_token()
    }
    #[getter]
    fn bytes_per_page(&self) -> usize {
        self.0.bytes_per_page()
    }
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.0.fingerprint()
    }
    fn __repr__(&self) -> String {
        format!(
            "KvLayout(dtype='{}', nope_dim={}, rope_dim={}, page_size={})",
            self.dtype(),
            self.nope_dim(),
            self.rope_dim(),
            self.page_size()
        )
    }
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<KvLayout>()
            .map(|o| o.get().0 == self.0)
            .unwrap_or(false)
    }
    fn __hash__(&self) -> u64 {
        self.0.fingerprint()
    }
}

/// Either layout, for the page ops.
fn page_layout(layout: &Bound<'_, PyAny>) -> PyResult<PageLayout> {
    if let Ok(l) = layout.cast::<IndexKLayout>() {
        return Ok(l.get().0.into());
    }
    if let Ok(l) = layout.cast::<KvLayout>() {
        return Ok(l.get().0.into());
    }
    Err(PyTypeError::new_err(
        "layout: expected a sparsekit IndexKLayout or KvLayout",
    ))
}

// ---------------------------------------------------------------- ops

/// Reads a contiguous int32 `[n, 3]` tensor of query rows `(request, start, end)` (CPU).
///
/// # Safety
/// As [`Tensor::slice`].
unsafe fn host_rows(rows: &Tensor) -> PyResult<Vec<QueryRange>> {
    // SAFETY: the caller's contract.
    let v: &[i32] = unsafe { rows.slice(rows.bytes()?) }?;
    v.chunks_exact(3)
        .enumerate()
        .map(|(i, r)| {
            let u = |x: i32, what: &str| {
                u32::try_from(x).map_err(|_| {
                    PyValueError::new_err(format!("rows[{i}]: {what} = {x} is negative"))
                })
            };
            Ok(QueryRange {
                request: u(r[0], "request")?,
                start: u(r[1], "start")?,
                end: u(r[2], "end")?,
            })
        })
        .collect()
}

fn check_2d(t: &Tensor, cols: usize) -> PyResult<usize> {
    if t.shape.len() != 2 || t.shape[1] != cols {
        return Err(PyValueError::new_err(format!(
            "{}: expected shape [n, {cols}], got {:?}",
            t.name, t.shape
        )));
    }
    Ok(t.shape[0])
}

/// `index_k_store(layout, keys, slots, cache, stream=None)`: keys bf16 `[n, head_dim]`,
/// slots int64 `[n]` (`-1` skips), cache whole pages (any dtype, contiguous), written in
/// place.
#[pyfunction]
#[pyo3(signature = (layout, keys, slots, cache, stream = None))]
fn index_k_store(
    py: Python<'_>,
    layout: &IndexKLayout,
    keys: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    cache: &Bound<'_, PyAny>,
    stream: Option<usize>,
) -> PyResult<()> {
    let keys = Tensor::of("keys", keys)?;
    let slots = Tensor::of("slots", slots)?;
    let cache = Tensor::of("cache", cache)?;
    keys.dtype_in(&["bfloat16"])?.contiguous()?;
    slots.dtype_in(&["int64"])?.contiguous()?;
    cache.contiguous()?;
    let (kb, sb, cb) = (keys.bytes()?, slots.bytes()?, cache.bytes()?);
    no_overlap(&[(&cache, cb)], &[(&keys, kb), (&slots, sb)])?;
    match common_device(&[&keys, &slots, &cache])? {
        Device::Cpu => {
            // SAFETY: contiguous tensors alive for the call, sizes checked against their
            // storage by `contiguous`, the written cache overlaps no input.
            let (k, s, c) = unsafe {
                (
                    keys.slice::<bf16>(kb)?,
                    slots.slice::<i64>(sb)?,
                    cache.slice_mut::<u8>(cb)?,
                )
            };
            let op = IndexKStore {
                layout: layout.0,
                slots: s,
            };
            op.validate(kb, cb).map_err(py_err)?;
            py.detach(|| cpu::store::index_k_store(CpuIsa::get(), &op, k, c));
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let p = raw::index_k_store(
                layout.0,
                keys.device_buf(kb),
                slots.device_buf(sb),
                cache.device_buf(cb),
            )
            .map_err(py_err)?;
            if p.n_tokens == 0 {
                return Ok(());
            }
            // SAFETY: the buffers are the caller's live device tensors, sizes validated;
            // the slots were sanitised on the device by the Python layer (each -1 or a slot
            // of the cache; duplicates race but stay inside it).
            unsafe { launch(ordinal, stream_of(stream)?, p) }
        }
    }
}

/// `kv_store(layout, kv, slots, cache, stream=None)`: kv bf16 `[n, nope + rope]`, slots
/// int64 `[n]`, cache whole pages, written in place.
#[pyfunction]
#[pyo3(signature = (layout, kv, slots, cache, stream = None))]
fn kv_store(
    py: Python<'_>,
    layout: &KvLayout,
    kv: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    cache: &Bound<'_, PyAny>,
    stream: Option<usize>,
) -> PyResult<()> {
    let kv = Tensor::of("kv", kv)?;
    let slots = Tensor::of("slots", slots)?;
    let cache = Tensor::of("cache", cache)?;
    kv.dtype_in(&["bfloat16"])?.contiguous()?;
    slots.dtype_in(&["int64"])?.contiguous()?;
    cache.contiguous()?;
    let (kb, sb, cb) = (kv.bytes()?, slots.bytes()?, cache.bytes()?);
    no_overlap(&[(&cache, cb)], &[(&kv, kb), (&slots, sb)])?;
    match common_device(&[&kv, &slots, &cache])? {
        Device::Cpu => {
            // SAFETY: as in `index_k_store`.
            let (k, s, c) = unsafe {
                (
                    kv.slice::<bf16>(kb)?,
                    slots.slice::<i64>(sb)?,
                    cache.slice_mut::<u8>(cb)?,
                )
            };
            let op = KvStore {
                layout: layout.0,
                slots: s,
            };
            op.validate(kb, cb).map_err(py_err)?;
            py.detach(|| cpu::store::kv_store(CpuIsa::get(), &op, k, c));
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let p = raw::kv_store(
                layout.0,
                kv.device_buf(kb),
                slots.device_buf(sb),
                cache.device_buf(cb),
            )
            .map_err(py_err)?;
            if p.n_tokens == 0 {
                return Ok(());
            }
            // SAFETY: as in `index_k_store`.
            unsafe { launch(ordinal, stream_of(stream)?, p) }
        }
    }
}

/// `indexer_logits(layout, q, weights, cache, page_table, rows, out, stream=None)`: q bf16
/// `[n, h, head_dim]`, weights f32 `[n, h]`, cache whole pages, page_table int32
/// `[requests, max_pages]`, rows int32 `[n, 3]` `(request, start, end)`, out f32
/// `[n, row_stride]` (contiguous), written.
#[pyfunction]
#[pyo3(signature = (layout, q, weights, cache, page_table, rows, out, stream = None))]
#[allow(clippy::too_many_arguments)]
fn indexer_logits(
    py: Python<'_>,
    layout: &IndexKLayout,
    q: &Bound<'_, PyAny>,
    weights: &Bound<'_, PyAny>,
    cache: &Bound<'_, PyAny>,
    page_table: &Bound<'_, PyAny>,
    rows: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    stream: Option<usize>,
) -> PyResult<()> {
    let q = Tensor::of("q", q)?;
    let w = Tensor::of("weights", weights)?;
    let cache = Tensor::of("cache", cache)?;
    let pt = Tensor::of("page_table", page_table)?;
    let rows = Tensor::of("rows", rows)?;
    let out = Tensor::of("out", out)?;
    q.dtype_in(&["bfloat16"])?.contiguous()?;
    w.dtype_in(&["float32"])?.contiguous()?;
    cache.contiguous()?;
    pt.dtype_in(&["int32"])?.contiguous()?;
    rows.dtype_in(&["int32"])?.contiguous()?;
    out.dtype_in(&["float32"])?.contiguous()?;
    if q.shape.len() != 3 {
        return Err(PyValueError::new_err(format!(
            "q: expected shape [n, heads, head_dim], got {:?}",
            q.shape
        )));
    }
    let n_heads = q.shape[1];
    let n_rows = check_2d(&rows, 3)?;
    let (n_req, max_pages) = match pt.shape.as_slice() {
        [r, c] => (*r, *c),
        s => {
            return Err(PyValueError::new_err(format!(
                "page_table: expected shape [requests, max_pages], got {s:?}"
            )))
        }
    };
    let row_stride = match out.shape.as_slice() {
        [r, c] if *r == n_rows => *c,
        s => {
            return Err(PyValueError::new_err(format!(
                "out: expected shape [{n_rows}, row_stride], got {s:?}"
            )))
        }
    };
    let (qb, wb, cb, pb, rb) = (
        q.bytes()?,
        w.bytes()?,
        cache.bytes()?,
        pt.bytes()?,
        rows.bytes()?,
    );
    let ob = out.bytes()?;
    no_overlap(
        &[(&out, ob)],
        &[(&q, qb), (&w, wb), (&cache, cb), (&pt, pb), (&rows, rb)],
    )?;
    match common_device(&[&q, &w, &cache, &pt, &rows, &out])? {
        Device::Cpu => {
            // SAFETY: contiguous tensors alive for the call, sizes checked against their
            // storage; the output overlaps no input.
            let (qs, ws, cs, ps, os, host) = unsafe {
                (
                    q.slice::<bf16>(qb)?,
                    w.slice::<f32>(wb)?,
                    cache.slice::<u8>(cb)?,
                    pt.slice::<i32>(pb)?,
                    out.slice_mut::<f32>(ob)?,
                    host_rows(&rows)?,
                )
            };
            let op = IndexerLogits {
                layout: layout.0,
                n_heads,
                page_table: PageTable::new(ps, max_pages.max(1)).map_err(py_err)?,
                rows: host,
                row_stride,
            };
            if n_req == 0 && n_rows > 0 {
                return Err(PyValueError::new_err("page_table: has no rows"));
            }
            op.validate(qb, wb, cb, ob).map_err(py_err)?;
            let isa = CpuIsa::get();
            py.detach(|| cpu::indexer_logits::indexer_logits(isa, &op, qs, ws, cs, os));
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let shape = IndexerShape {
                n_heads,
                n_requests: n_req,
                max_pages,
                row_stride,
            };
            let bufs = [
                q.device_buf(qb),
                w.device_buf(wb),
                cache.device_buf(cb),
                pt.device_buf(pb),
                rows.device_buf(rb),
            ];
            let ob = out.device_buf(ob);
            if layout.0.dtype() == IndexKDtype::Fp4E2m1 {
                let p = raw::indexer_logits_fp4(layout.0, shape, bufs, ob).map_err(py_err)?;
                if p.0.n_rows == 0 || p.0.row_stride == 0 {
                    return Ok(());
                }
                // SAFETY: as below (fp4 keys: their own kernel).
                return unsafe { launch(ordinal, stream_of(stream)?, p) };
            }
            let p = raw::indexer_logits(layout.0, shape, bufs, ob).map_err(py_err)?;
            if p.n_rows == 0 || p.row_stride == 0 {
                return Ok(());
            }
            // SAFETY: live device tensors, sizes validated; the rows and page table were
            // sanitised on the device (ranges clamped into the row, the table and the
            // requests; entries inside the pool).
            unsafe { launch(ordinal, stream_of(stream)?, p) }
        }
    }
}

/// Bytes of `topk`'s two scratch buffers on CUDA (`workspace`, `counters`; the counters
/// zero-filled).
#[pyfunction]
fn topk_scratch_bytes(n_rows: usize, row_stride: usize, k: usize) -> PyResult<(usize, usize)> {
    raw::topk_scratch(n_rows, row_stride, k).map_err(py_err)
}

/// Bytes of `sparse_mla`'s two scratch buffers on CUDA.
#[pyfunction]
fn sparse_mla_scratch_bytes(
    layout: &KvLayout,
    n_tokens: usize,
    n_heads: usize,
    topk: usize,
) -> PyResult<(usize, usize)> {
    raw::sparse_mla_scratch(layout.0, n_tokens, n_heads, topk).map_err(py_err)
}

/// `topk(logits, rows, k, out, page_table=None, page_size=None, workspace=None,
/// counters=None, stream=None, take_all_short_rows=False)`: logits f32 `[n, width]` (rows
/// contiguous; a row stride above `width` is read as the row stride when the storage
/// covers it), rows int32 `[n, 3]` (every `end ≤ width`), out int32 `[n, k]`: positions,
/// or slots through `page_table` (int32 `[requests, max_pages]`) of pages of `page_size`.
/// `take_all_short_rows`: DeepSeek-V4's transform (a row of at most `k` positions takes
/// all of them in order, whatever the logits).
#[pyfunction]
#[pyo3(signature = (logits, rows, k, out, page_table = None, page_size = None, workspace = None, counters = None, stream = None, take_all_short_rows = false))]
#[allow(clippy::too_many_arguments)]
fn topk(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    rows: &Bound<'_, PyAny>,
    k: usize,
    out: &Bound<'_, PyAny>,
    page_table: Option<&Bound<'_, PyAny>>,
    page_size: Option<usize>,
    workspace: Option<&Bound<'_, PyAny>>,
    counters: Option<&Bound<'_, PyAny>>,
    stream: Option<usize>,
    take_all_short_rows: bool,
) -> PyResult<()> {
    let short_rows = if take_all_short_rows {
        ShortRows::TakeAll
    } else {
        ShortRows::SelectValid
    };
    let logits = Tensor::of("logits", logits)?;
    let rows = Tensor::of("rows", rows)?;
    let out = Tensor::of("out", out)?;
    logits.dtype_in(&["float32"])?;
    rows.dtype_in(&["int32"])?.contiguous()?;
    out.dtype_in(&["int32"])?.contiguous()?;
    let row_stride = logits.row_major_2d()?;
    let (n, width) = (logits.shape[0], logits.shape[1]);
    if check_2d(&rows, 3)? != n {
        return Err(PyValueError::new_err(format!(
            "rows: {} rows for {n} logits rows",
            rows.shape[0]
        )));
    }
    if out.shape != [n, k] {
        return Err(PyValueError::new_err(format!(
            "out: expected shape [{n}, {k}], got {:?}",
            out.shape
        )));
    }
    let pt = page_table
        .map(|p| Tensor::of("page_table", p))
        .transpose()?;
    if let Some(p) = &pt {
        p.dtype_in(&["int32"])?.contiguous()?;
        if p.shape.len() != 2 {
            return Err(PyValueError::new_err(format!(
                "page_table: expected shape [requests, max_pages], got {:?}",
                p.shape
            )));
        }
    }
    let page_size = match (&pt, page_size) {
        (Some(_), Some(ps)) => Some(ps),
        (None, None) => None,
        _ => {
            return Err(PyValueError::new_err(
                "page_size: give it with page_table (slot output), or neither (positions)",
            ))
        }
    };
    let lb = n
        .checked_mul(row_stride)
        .and_then(|x| x.checked_mul(4))
        .ok_or_else(|| PyValueError::new_err("logits: size overflows"))?;
    let (rb, ob) = (rows.bytes()?, out.bytes()?);
    let pb = pt.as_ref().map(|p| p.bytes()).transpose()?.unwrap_or(0);
    let mut reads = vec![(&logits, lb), (&rows, rb)];
    if let Some(p) = &pt {
        reads.push((p, pb));
    }
    let mut all = vec![&logits, &rows, &out];
    all.extend(pt.as_ref());
    match common_device(&all)? {
        Device::Cpu => {
            no_overlap(&[(&out, ob)], &reads)?;
            // SAFETY: tensors alive for the call; logits' rows covered by its storage
            // (`row_major_2d`), the rest contiguous; the output overlaps no input.
            let (ls, os, host, ps) = unsafe {
                (
                    logits.slice::<f32>(lb)?,
                    out.slice_mut::<i32>(ob)?,
                    host_rows(&rows)?,
                    match &pt {
                        Some(p) => Some(p.slice::<i32>(pb)?),
                        None => None,
                    },
                )
            };
            for (i, r) in host.iter().enumerate() {
                if r.end as usize > width {
                    return Err(PyValueError::new_err(format!(
                        "rows[{i}]: end {} is past the {width} columns of logits",
                        r.end
                    )));
                }
            }
            let output = match (&pt, ps, page_size) {
                (Some(p), Some(ps), Some(page_size)) => TopkOutput::Slots {
                    page_table: PageTable::new(ps, p.shape[1].max(1)).map_err(py_err)?,
                    page_size,
                },
                _ => TopkOutput::Positions,
            };
            let op = Topk {
                short_rows,
                k,
                row_stride,
                rows: &host,
                output,
            };
            op.validate(lb, ob).map_err(py_err)?;
            py.detach(|| cpu::topk::topk(CpuIsa::get(), &op, ls, os));
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let ws = workspace
                .map(|w| Tensor::of("workspace", w))
                .transpose()?
                .ok_or_else(|| PyValueError::new_err("workspace: needed on CUDA"))?;
            let cn = counters
                .map(|w| Tensor::of("counters", w))
                .transpose()?
                .ok_or_else(|| PyValueError::new_err("counters: needed on CUDA"))?;
            ws.contiguous()?;
            cn.contiguous()?;
            common_device(&[&logits, &ws, &cn])?;
            let (wb, cb) = (ws.bytes()?, cn.bytes()?);
            no_overlap(&[(&out, ob), (&ws, wb), (&cn, cb)], &reads)?;
            let target = match (&pt, page_size) {
                (Some(p), Some(page_size)) => TopkTarget::Slots {
                    page_table: p.device_buf(pb),
                    n_requests: p.shape[0],
                    max_pages: p.shape[1],
                    page_size,
                },
                _ => TopkTarget::Positions,
            };
            let p = raw::topk(
                short_rows,
                k,
                row_stride,
                target,
                [logits.device_buf(lb), rows.device_buf(rb)],
                [out.device_buf(ob), ws.device_buf(wb), cn.device_buf(cb)],
            )
            .map_err(py_err)?;
            if p.n_rows == 0 {
                return Ok(());
            }
            // SAFETY: live device tensors, sizes validated; rows sanitised on the device
            // (inside the row's width and the page table), scratch of the kernel's sizes
            // with zeroed counters.
            unsafe { launch(ordinal, stream_of(stream)?, p) }
        }
    }
}

/// `sparse_mla(layout, q, cache, indices, out, lse, softmax_scale, workspace=None,
/// counters=None, stream=None)`: q bf16 `[t, h, d_qk]`, cache whole pages, indices int32
/// `[t, topk]` (`-1` skipped), out bf16 `[t, h, nope_dim]`, lse f32 `[t, h]` (natural log;
/// `-inf` for a token without a valid index).
#[pyfunction]
#[pyo3(signature = (layout, q, cache, indices, out, lse, softmax_scale, workspace = None, counters = None, stream = None))]
#[allow(clippy::too_many_arguments)]
fn sparse_mla(
    py: Python<'_>,
    layout: &KvLayout,
    q: &Bound<'_, PyAny>,
    cache: &Bound<'_, PyAny>,
    indices: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    softmax_scale: f32,
    workspace: Option<&Bound<'_, PyAny>>,
    counters: Option<&Bound<'_, PyAny>>,
    stream: Option<usize>,
) -> PyResult<()> {
    let q = Tensor::of("q", q)?;
    let cache = Tensor::of("cache", cache)?;
    let idx = Tensor::of("indices", indices)?;
    let out = Tensor::of("out", out)?;
    let lse = Tensor::of("lse", lse)?;
    q.dtype_in(&["bfloat16"])?.contiguous()?;
    cache.contiguous()?;
    idx.dtype_in(&["int32"])?.contiguous()?;
    out.dtype_in(&["bfloat16"])?.contiguous()?;
    lse.dtype_in(&["float32"])?.contiguous()?;
    let (n_tokens, n_heads) = match q.shape.as_slice() {
        [t, h, _] => (*t, *h),
        s => {
            return Err(PyValueError::new_err(format!(
                "q: expected shape [tokens, heads, d_qk], got {s:?}"
            )))
        }
    };
    let topk = match idx.shape.as_slice() {
        [t, k] if *t == n_tokens => *k,
        s => {
            return Err(PyValueError::new_err(format!(
                "indices: expected shape [{n_tokens}, topk], got {s:?}"
            )))
        }
    };
    let op = SparseMla {
        layout: layout.0,
        n_tokens,
        n_heads,
        topk,
        softmax_scale,
    };
    let (qb, cb, ib, ob, lb) = (
        q.bytes()?,
        cache.bytes()?,
        idx.bytes()?,
        out.bytes()?,
        lse.bytes()?,
    );
    let reads = [(&q, qb), (&cache, cb), (&idx, ib)];
    match common_device(&[&q, &cache, &idx, &out, &lse])? {
        Device::Cpu => {
            no_overlap(&[(&out, ob), (&lse, lb)], &reads)?;
            // SAFETY: contiguous tensors alive for the call, sizes checked against their
            // storage; the two outputs overlap neither each other nor an input.
            let (qs, cs, is, os, ls) = unsafe {
                (
                    q.slice::<bf16>(qb)?,
                    cache.slice::<u8>(cb)?,
                    idx.slice::<i32>(ib)?,
                    out.slice_mut::<bf16>(ob)?,
                    lse.slice_mut::<f32>(lb)?,
                )
            };
            let pages = op.validate(qb, cb, ib, ob, lb).map_err(py_err)?;
            op.check_indices(is, pages).map_err(py_err)?;
            let isa = CpuIsa::get();
            py.detach(|| cpu::sparse_mla::sparse_mla(isa, &op, qs, cs, is, os, ls));
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let ws = workspace
                .map(|w| Tensor::of("workspace", w))
                .transpose()?
                .ok_or_else(|| PyValueError::new_err("workspace: needed on CUDA"))?;
            let cn = counters
                .map(|w| Tensor::of("counters", w))
                .transpose()?
                .ok_or_else(|| PyValueError::new_err("counters: needed on CUDA"))?;
            ws.contiguous()?;
            cn.contiguous()?;
            common_device(&[&q, &ws, &cn])?;
            let (wb, nb) = (ws.bytes()?, cn.bytes()?);
            no_overlap(&[(&out, ob), (&lse, lb), (&ws, wb), (&cn, nb)], &reads)?;
            let p = raw::sparse_mla(
                &op,
                [q.device_buf(qb), cache.device_buf(cb), idx.device_buf(ib)],
                [
                    out.device_buf(ob),
                    lse.device_buf(lb),
                    ws.device_buf(wb),
                    cn.device_buf(nb),
                ],
            )
            .map_err(py_err)?;
            if n_tokens == 0 {
                return Ok(());
            }
            // SAFETY: live device tensors, sizes validated; indices sanitised on the
            // device (each -1 or a slot of the cache); scratch of the kernel's sizes with
            // zeroed counters.
            unsafe { launch(ordinal, stream_of(stream)?, p) }
        }
    }
}

/// Bytes of `sparse_mla_v4`'s two scratch buffers on CUDA (`total_topk`: the caches' top-k
/// summed).
#[pyfunction]
fn sparse_mla_v4_scratch_bytes(
    n_tokens: usize,
    n_heads: usize,
    total_topk: usize,
) -> PyResult<(usize, usize)> {
    raw::sparse_mla_v4_scratch(n_tokens, n_heads, total_topk).map_err(py_err)
}

/// One cache argument of `sparse_mla_v4`: its layout, pages, indices int32 `[t, topk]` and
/// optional lengths int32 `[t]`.
struct V4Arg {
    layout: HostKv,
    cache: Tensor,
    indices: Tensor,
    lengths: Option<Tensor>,
    topk: usize,
}

impl V4Arg {
    #[allow(clippy::too_many_arguments)]
    fn of(
        names: [&'static str; 3],
        layout: HostKv,
        cache: &Bound<'_, PyAny>,
        indices: &Bound<'_, PyAny>,
        lengths: Option<&Bound<'_, PyAny>>,
        n_tokens: usize,
    ) -> PyResult<V4Arg> {
        let cache = Tensor::of(names[0], cache)?;
        let indices = Tensor::of(names[1], indices)?;
        cache.contiguous()?;
        indices.dtype_in(&["int32"])?.contiguous()?;
        let topk = match indices.shape.as_slice() {
            [t, k] if *t == n_tokens => *k,
            s => {
                return Err(PyValueError::new_err(format!(
                    "{}: expected shape [{n_tokens}, topk], got {s:?}",
                    names[1]
                )))
            }
        };
        let lengths = lengths.map(|l| Tensor::of(names[2], l)).transpose()?;
        if let Some(l) = &lengths {
            l.dtype_in(&["int32"])?.contiguous()?;
            if l.shape != [n_tokens] {
                return Err(PyValueError::new_err(format!(
                    "{}: expected shape [{n_tokens}], got {:?}",
                    names[2], l.shape
                )));
            }
        }
        Ok(V4Arg {
            layout,
            cache,
            indices,
            lengths,
            topk,
        })
    }

    /// The tensors read, with their byte lengths.
    fn reads(&self) -> PyResult<Vec<(&Tensor, usize)>> {
        let mut v = vec![
            (&self.cache, self.cache.bytes()?),
            (&self.indices, self.indices.bytes()?),
        ];
        if let Some(l) = &self.lengths {
            v.push((l, l.bytes()?));
        }
        Ok(v)
    }

    fn device_bufs(&self) -> PyResult<V4CacheBufs> {
        Ok(V4CacheBufs {
            cache: self.cache.device_buf(self.cache.bytes()?),
            indices: self.indices.device_buf(self.indices.bytes()?),
            lengths: match &self.lengths {
                Some(l) => Some(l.device_buf(l.bytes()?)),
                None => None,
            },
        })
    }

    /// The host lengths (CPU): a `ValueError` naming the entry for a negative one.
    ///
    /// # Safety
    /// As [`Tensor::slice`].
    unsafe fn host_lengths(&self) -> PyResult<Option<Vec<u32>>> {
        let Some(l) = &self.lengths else {
            return Ok(None);
        };
        // SAFETY: the caller's contract.
        let v: &[i32] = unsafe { l.slice(l.bytes()?) }?;
        v.iter()
            .enumerate()
            .map(|(i, &x)| {
                u32::try_from(x)
                    .map_err(|_| PyValueError::new_err(format!("{}[{i}]: {x} is negative", l.name)))
            })
            .collect::<PyResult<Vec<u32>>>()
            .map(Some)
    }
}

/// `sparse_mla_v4(layout, q, cache, indices, out, lse, softmax_scale, lengths=None,
/// extra_layout=None, extra_cache=None, extra_indices=None, extra_lengths=None,
/// attn_sink=None, workspace=None, counters=None, stream=None)`: DeepSeek-V4's sparse
/// attention (`sparsekit_host::ops::SparseMlaV4`). q bf16 `[t, h, 512]`; each cache whole
/// pages of a V4 layout with indices int32 `[t, topk]` and optional lengths int32 `[t]`
/// (a token uses its first `lengths[t]` indices; inside them `-1` is skipped); attn_sink
/// f32 `[h]`; out bf16 `[t, h, 512]`, lse f32 `[t, h]` (natural log, without the sink;
/// `+inf` and out 0 for a token without a valid index).
#[pyfunction]
#[pyo3(signature = (layout, q, cache, indices, out, lse, softmax_scale, lengths = None, extra_layout = None, extra_cache = None, extra_indices = None, extra_lengths = None, attn_sink = None, workspace = None, counters = None, stream = None))]
#[allow(clippy::too_many_arguments)]
fn sparse_mla_v4(
    py: Python<'_>,
    layout: &KvLayout,
    q: &Bound<'_, PyAny>,
    cache: &Bound<'_, PyAny>,
    indices: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    softmax_scale: f32,
    lengths: Option<&Bound<'_, PyAny>>,
    extra_layout: Option<&KvLayout>,
    extra_cache: Option<&Bound<'_, PyAny>>,
    extra_indices: Option<&Bound<'_, PyAny>>,
    extra_lengths: Option<&Bound<'_, PyAny>>,
    attn_sink: Option<&Bound<'_, PyAny>>,
    workspace: Option<&Bound<'_, PyAny>>,
    counters: Option<&Bound<'_, PyAny>>,
    stream: Option<usize>,
) -> PyResult<()> {
    let q = Tensor::of("q", q)?;
    let out = Tensor::of("out", out)?;
    let lse = Tensor::of("lse", lse)?;
    q.dtype_in(&["bfloat16"])?.contiguous()?;
    out.dtype_in(&["bfloat16"])?.contiguous()?;
    lse.dtype_in(&["float32"])?.contiguous()?;
    let d = SparseMlaV4::D;
    let (n_tokens, n_heads) = match q.shape.as_slice() {
        [t, h, x] if *x == d => (*t, *h),
        s => {
            return Err(PyValueError::new_err(format!(
                "q: expected shape [tokens, heads, {d}], got {s:?}"
            )))
        }
    };
    if out.shape != [n_tokens, n_heads, d] {
        return Err(PyValueError::new_err(format!(
            "out: expected shape [{n_tokens}, {n_heads}, {d}], got {:?}",
            out.shape
        )));
    }
    if lse.shape != [n_tokens, n_heads] {
        return Err(PyValueError::new_err(format!(
            "lse: expected shape [{n_tokens}, {n_heads}], got {:?}",
            lse.shape
        )));
    }
    let main = V4Arg::of(
        ["cache", "indices", "lengths"],
        layout.0,
        cache,
        indices,
        lengths,
        n_tokens,
    )?;
    let extra = match (extra_layout, extra_cache, extra_indices) {
        (Some(l), Some(c), Some(i)) => Some(V4Arg::of(
            ["extra_cache", "extra_indices", "extra_lengths"],
            l.0,
            c,
            i,
            extra_lengths,
            n_tokens,
        )?),
        (None, None, None) => {
            if extra_lengths.is_some() {
                return Err(PyValueError::new_err(
                    "extra_lengths: given without extra_cache",
                ));
            }
            None
        }
        _ => {
            return Err(PyValueError::new_err(
                "extra_cache: give extra_layout, extra_cache and extra_indices together",
            ))
        }
    };
    let sink = attn_sink.map(|s| Tensor::of("attn_sink", s)).transpose()?;
    if let Some(s) = &sink {
        s.dtype_in(&["float32"])?.contiguous()?;
        if s.shape != [n_heads] {
            return Err(PyValueError::new_err(format!(
                "attn_sink: expected shape [{n_heads}], got {:?}",
                s.shape
            )));
        }
    }
    let (qb, ob, lb) = (q.bytes()?, out.bytes()?, lse.bytes()?);
    let mut reads = vec![(&q, qb)];
    reads.extend(main.reads()?);
    if let Some(e) = &extra {
        reads.extend(e.reads()?);
    }
    let sb = sink.as_ref().map(|s| s.bytes()).transpose()?.unwrap_or(0);
    if let Some(s) = &sink {
        reads.push((s, sb));
    }
    let mut all: Vec<&Tensor> = reads.iter().map(|(t, _)| *t).collect();
    all.extend([&out, &lse]);
    match common_device(&all)? {
        Device::Cpu => {
            no_overlap(&[(&out, ob), (&lse, lb)], &reads)?;
            // SAFETY: contiguous tensors alive for the call, sizes checked against their
            // storage; the two outputs overlap neither each other nor an input.
            let (qs, os, ls, main_lens, extra_lens, sink_vals) = unsafe {
                (
                    q.slice::<bf16>(qb)?,
                    out.slice_mut::<bf16>(ob)?,
                    lse.slice_mut::<f32>(lb)?,
                    main.host_lengths()?,
                    match &extra {
                        Some(e) => e.host_lengths()?,
                        None => None,
                    },
                    match &sink {
                        Some(s) => Some(s.slice::<f32>(sb)?),
                        None => None,
                    },
                )
            };
            let host = |a: &V4Arg| -> PyResult<(&[u8], &[i32])> {
                // SAFETY: as above: contiguous inputs alive for the call, overlapping no
                // output.
                unsafe {
                    Ok((
                        a.cache.slice::<u8>(a.cache.bytes()?)?,
                        a.indices.slice::<i32>(a.indices.bytes()?)?,
                    ))
                }
            };
            let main_in = host(&main)?;
            let extra_in = extra.as_ref().map(host).transpose()?;
            let op = SparseMlaV4 {
                n_tokens,
                n_heads,
                softmax_scale,
                main: V4Cache {
                    layout: main.layout,
                    topk: main.topk,
                    lengths: main_lens.as_deref(),
                },
                extra: extra.as_ref().map(|e| V4Cache {
                    layout: e.layout,
                    topk: e.topk,
                    lengths: extra_lens.as_deref(),
                }),
                attn_sink: sink_vals,
            };
            let pages = op
                .validate(
                    qb,
                    [main_in.0.len(), main_in.1.len() * 4],
                    extra_in.map(|(c, i)| [c.len(), i.len() * 4]),
                    ob,
                    lb,
                )
                .map_err(py_err)?;
            op.check_indices("indices", &op.main, main_in.1, pages.main)
                .map_err(py_err)?;
            if let (Some(c), Some((_, idx))) = (&op.extra, extra_in) {
                op.check_indices("extra_indices", c, idx, pages.extra)
                    .map_err(py_err)?;
            }
            let call = cpu::sparse_mla_v4::V4Call {
                q: qs,
                main: main_in,
                extra: extra_in,
            };
            let isa = CpuIsa::get();
            py.detach(|| cpu::sparse_mla_v4::sparse_mla_v4(isa, &op, call, os, ls));
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let ws = workspace
                .map(|w| Tensor::of("workspace", w))
                .transpose()?
                .ok_or_else(|| PyValueError::new_err("workspace: needed on CUDA"))?;
            let cn = counters
                .map(|w| Tensor::of("counters", w))
                .transpose()?
                .ok_or_else(|| PyValueError::new_err("counters: needed on CUDA"))?;
            ws.contiguous()?;
            cn.contiguous()?;
            common_device(&[&q, &ws, &cn])?;
            let (wb, nb) = (ws.bytes()?, cn.bytes()?);
            no_overlap(&[(&out, ob), (&lse, lb), (&ws, wb), (&cn, nb)], &reads)?;
            let shape = V4Shape {
                n_tokens,
                n_heads,
                softmax_scale,
                main: V4CacheShape {
                    layout: main.layout,
                    topk: main.topk,
                },
                extra: extra.as_ref().map(|e| V4CacheShape {
                    layout: e.layout,
                    topk: e.topk,
                }),
            };
            let p = raw::sparse_mla_v4(
                shape,
                q.device_buf(qb),
                main.device_bufs()?,
                extra.as_ref().map(V4Arg::device_bufs).transpose()?,
                sink.as_ref().map(|s| s.device_buf(sb)),
                [
                    out.device_buf(ob),
                    lse.device_buf(lb),
                    ws.device_buf(wb),
                    cn.device_buf(nb),
                ],
            )
            .map_err(py_err)?;
            if n_tokens == 0 {
                return Ok(());
            }
            // SAFETY: live device tensors, sizes validated; lengths clamped into
            // `[0, topk]` and every index sanitised on the device (each -1 or a slot of its
            // cache); scratch of the kernel's sizes with zeroed counters.
            unsafe { launch(ordinal, stream_of(stream)?, p) }
        }
    }
}

/// `copy_pages(layout, src, dst, src_ids, dst_ids, stream=None)`: whole pages of `layout`
/// from the contiguous pool `src` to the contiguous pool `dst` (distinct memory); ids
/// int32 `[n]`, destinations unique.
#[pyfunction]
#[pyo3(signature = (layout, src, dst, src_ids, dst_ids, stream = None))]
fn copy_pages(
    py: Python<'_>,
    layout: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    src_ids: &Bound<'_, PyAny>,
    dst_ids: &Bound<'_, PyAny>,
    stream: Option<usize>,
) -> PyResult<()> {
    let layout = page_layout(layout)?;
    let src = Tensor::of("src", src)?;
    let dst = Tensor::of("dst", dst)?;
    let si = Tensor::of("src_ids", src_ids)?;
    let di = Tensor::of("dst_ids", dst_ids)?;
    src.contiguous()?;
    dst.contiguous()?;
    si.dtype_in(&["int32"])?.contiguous()?;
    di.dtype_in(&["int32"])?.contiguous()?;
    let (sb, db, sib, dib) = (src.bytes()?, dst.bytes()?, si.bytes()?, di.bytes()?);
    no_overlap(&[(&dst, db)], &[(&src, sb), (&si, sib), (&di, dib)])?;
    let page = layout.bytes_per_page();
    let region = |t: &Tensor, b: usize| -> PyResult<PagedRegion> {
        if b % page != 0 {
            return Err(PyValueError::new_err(format!(
                "{}: {b} bytes is not a whole number of {page}-byte pages",
                t.name
            )));
        }
        Ok(PagedRegion::contiguous(layout, b / page))
    };
    let (sr, dr) = (region(&src, sb)?, region(&dst, db)?);
    match common_device(&[&src, &dst, &si, &di])? {
        Device::Cpu => {
            // SAFETY: contiguous tensors alive for the call; the destination overlaps no
            // input.
            let (ss, ds, sis, dis) = unsafe {
                (
                    src.slice::<u8>(sb)?,
                    dst.slice_mut::<u8>(db)?,
                    si.slice::<i32>(sib)?,
                    di.slice::<i32>(dib)?,
                )
            };
            let op = CopyPages {
                src: sr,
                dst: dr,
                src_ids: sis,
                dst_ids: dis,
            };
            op.validate(sb, db).map_err(py_err)?;
            py.detach(|| cpu::pages::copy_pages(&op, ss, ds));
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let p = raw::copy_pages(
                layout,
                [src.device_buf(sb), dst.device_buf(db)],
                [si.device_buf(sib), di.device_buf(dib)],
            )
            .map_err(py_err)?;
            if p.n_pages == 0 {
                return Ok(());
            }
            // SAFETY: live device tensors, sizes validated; ids sanitised on the device
            // (clamped into their pools).
            unsafe { launch(ordinal, stream_of(stream)?, p) }
        }
    }
}

/// `page_checksums(layout, pool, ids, out, stream=None)`: the 64-bit checksum of each page
/// `ids[i]` of the contiguous pool, into `out` (int64 or uint64 `[n]`, the u64 bits).
#[pyfunction]
#[pyo3(signature = (layout, pool, ids, out, stream = None))]
fn page_checksums(
    py: Python<'_>,
    layout: &Bound<'_, PyAny>,
    pool: &Bound<'_, PyAny>,
    ids: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    stream: Option<usize>,
) -> PyResult<()> {
    let layout = page_layout(layout)?;
    let pool = Tensor::of("pool", pool)?;
    let ids = Tensor::of("ids", ids)?;
    let out = Tensor::of("out", out)?;
    pool.contiguous()?;
    ids.dtype_in(&["int32"])?.contiguous()?;
    out.dtype_in(&["int64", "uint64"])?.contiguous()?;
    let (pb, ib, ob) = (pool.bytes()?, ids.bytes()?, out.bytes()?);
    no_overlap(&[(&out, ob)], &[(&pool, pb), (&ids, ib)])?;
    let page = layout.bytes_per_page();
    if pb % page != 0 {
        return Err(PyValueError::new_err(format!(
            "pool: {pb} bytes is not a whole number of {page}-byte pages"
        )));
    }
    match common_device(&[&pool, &ids, &out])? {
        Device::Cpu => {
            // SAFETY: contiguous tensors alive for the call; the output overlaps no input.
            let (ps, is, os) = unsafe {
                (
                    pool.slice::<u8>(pb)?,
                    ids.slice::<i32>(ib)?,
                    out.slice_mut::<u64>(ob)?,
                )
            };
            let op = PageChecksums {
                region: PagedRegion::contiguous(layout, pb / page),
                ids: is,
            };
            op.validate(pb, ob).map_err(py_err)?;
            py.detach(|| cpu::pages::page_checksums(CpuIsa::get(), &op, ps, os));
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let p = raw::page_checksums(
                layout,
                pool.device_buf(pb),
                ids.device_buf(ib),
                out.device_buf(ob),
            )
            .map_err(py_err)?;
            if p.n_pages == 0 {
                return Ok(());
            }
            // SAFETY: live device tensors, sizes validated; ids sanitised on the device.
            unsafe { launch(ordinal, stream_of(stream)?, p) }
        }
    }
}

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
