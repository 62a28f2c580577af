//! Torch tensors read through their Python attributes, and the checks memory safety
//! rests on (dtypes, contiguity, byte sizes, devices, overlaps).

use crate::*;

/// A sparsekit error as the Python exception of its kind: an invalid call is a
/// `ValueError`, anything else (device, driver) a `RuntimeError`.
pub(crate) fn py_err(e: Error) -> PyErr {
    match e.kind() {
        ErrorKind::Op => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Device {
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
pub(crate) struct Tensor {
    pub(crate) name: &'static str,
    pub(crate) addr: u64,
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<isize>,
    /// `str(t.dtype)` without the `torch.` prefix (`bfloat16`, `float8_e4m3fn`, ...).
    pub(crate) dtype: String,
    pub(crate) itemsize: usize,
    pub(crate) device: Device,
    /// Bytes of the tensor's storage from its first element on.
    pub(crate) extent: usize,
}

pub(crate) fn attr_err(name: &'static str, what: &str, e: PyErr) -> PyErr {
    PyTypeError::new_err(format!("{name}: expected a torch.Tensor ({what}: {e})"))
}

impl Tensor {
    /// Reads `obj`'s attributes; a `TypeError` naming `name` when it is not a tensor.
    pub(crate) fn of(name: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
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
        // A lazily negated or conjugated view (torch's neg and conj bits) holds the
        // un-negated values in memory, and `data_ptr()` points at them: read as bytes, it
        // would give the wrong signs, and a write into it would land negated.
        for (bit, flag, what, resolve) in [
            ("is_neg", "neg", "negated", "resolve_neg"),
            ("is_conj", "conj", "conjugated", "resolve_conj"),
        ] {
            let set: bool = obj
                .call_method0(bit)
                .and_then(|b| b.extract())
                .map_err(|e| attr_err(name, bit, e))?;
            if set {
                return Err(PyValueError::new_err(format!(
                    "{name}: is a lazily {what} view (torch's {flag} bit): its memory holds \
                     other values; call .{resolve}() first"
                )));
            }
        }
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
        // A tensor with elements but no memory: a lazily zero tensor, a fake or functional
        // tensor (torch.compile's tracing), a wrapper subclass. Its storage may still report
        // a size, so nothing else would stop a read or write at address 0.
        if t.addr == 0 && t.numel()? > 0 {
            return Err(PyValueError::new_err(format!(
                "{name}: has no memory of its own (data_ptr() is 0: a lazily zero, fake or \
                 functional tensor, or a wrapper subclass); pass a tensor that holds its values"
            )));
        }
        Ok(t)
    }

    pub(crate) fn numel(&self) -> PyResult<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| PyValueError::new_err(format!("{}: size overflows", self.name)))
    }

    /// Bytes of the tensor's elements.
    pub(crate) fn bytes(&self) -> PyResult<usize> {
        self.numel()?
            .checked_mul(self.itemsize)
            .ok_or_else(|| PyValueError::new_err(format!("{}: size overflows", self.name)))
    }

    /// Row-major with no gaps, as torch's `is_contiguous()`: a tensor with no element is
    /// contiguous whatever its strides (`torch.empty(3, 0)` has strides `(1, 1)`).
    pub(crate) fn is_contiguous(&self) -> bool {
        if self.shape.contains(&0) {
            return true;
        }
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
    pub(crate) fn dtype_in(&self, allowed: &[&str]) -> PyResult<&Self> {
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
    pub(crate) fn contiguous(&self) -> PyResult<&Self> {
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
    /// covers every row's full stride: returns `row_stride` (0 for rows of no column, which
    /// read nothing).
    pub(crate) fn row_major_2d(&self) -> PyResult<usize> {
        if self.shape.len() != 2 {
            return Err(PyValueError::new_err(format!(
                "{}: expected 2 dimensions, got shape {:?}",
                self.name, self.shape
            )));
        }
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let row_stride = if rows <= 1 || cols == 0 {
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
    pub(crate) fn span(&self, len: usize) -> Range<u64> {
        self.addr..self.addr.saturating_add(len as u64)
    }

    pub(crate) fn device_buf(&self, len: usize) -> DeviceBuf {
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
    pub(crate) unsafe fn slice<'a, E: bytemuck::Pod>(&self, len: usize) -> PyResult<&'a [E]> {
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
    pub(crate) unsafe fn slice_mut<'a, E: bytemuck::Pod>(
        &self,
        len: usize,
    ) -> PyResult<&'a mut [E]> {
        let n = self.elems::<E>(len)?;
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: the caller's contract; `elems` checked alignment and size.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr as usize as *mut E, n) })
    }

    pub(crate) fn elems<E>(&self, len: usize) -> PyResult<usize> {
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
pub(crate) fn common_device(tensors: &[&Tensor]) -> PyResult<Device> {
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
pub(crate) fn no_overlap(written: &[(&Tensor, usize)], read: &[(&Tensor, usize)]) -> PyResult<()> {
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
pub(crate) fn stream_of(stream: Option<usize>) -> PyResult<usize> {
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
pub(crate) unsafe fn launch<P: sparsekit_kernels::launch::KernelParams>(
    ordinal: usize,
    stream: usize,
    params: P,
) -> PyResult<()> {
    let l = RawLauncher::for_device(ordinal).map_err(py_err)?;
    // SAFETY: the caller's contract.
    unsafe { l.launch(stream, params) }.map_err(py_err)
}
