//! The layout descriptors as Python classes.

use crate::*;

// ---------------------------------------------------------------- layouts

/// A paged index-K cache layout (`sparsekit_host::layout::IndexKLayout`): fp8 pages hold
/// all `page_size × head_dim` e4m3 bytes, then `page_size` f32 scales; fp4 pages
/// (DeepSeek-V4) all `page_size × head_dim / 2` packed e2m1 bytes, then `head_dim / 32`
/// ue8m0 bytes per token; bf16 pages only bf16 values.
#[pyclass(frozen, module = "sparsekit._native")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct IndexKLayout(pub(crate) HostIndexK);

#[pymethods]
impl IndexKLayout {
    /// `dtype`: `"fp8_e4m3"`, `"bf16"` or `"fp4_e2m1"` (DeepSeek-V4; `head_dim` a
    /// multiple of 128); `scale` (fp8): `"fp32"` (`max(amax, 1e-4) / 448`) or `"ue8m0"`
    /// (rounded up to a power of two); fp4 has its own ue8m0 group scales and takes the
    /// default.
    #[new]
    #[pyo3(signature = (dtype = "fp8_e4m3", head_dim = 128, page_size = 64, scale = "fp32"))]
    pub(crate) fn new(
        dtype: &str,
        head_dim: usize,
        page_size: usize,
        scale: &str,
    ) -> PyResult<Self> {
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
    pub(crate) fn dtype(&self) -> &'static str {
        self.0.dtype().name()
    }
    #[getter]
    pub(crate) fn scale(&self) -> Option<&'static str> {
        self.0.scale_format().map(|s| match s {
            ScaleFormat::Fp32 => "fp32",
            ScaleFormat::Ue8m0 => "ue8m0",
        })
    }
    #[getter]
    pub(crate) fn head_dim(&self) -> usize {
        self.0.head_dim()
    }
    #[getter]
    pub(crate) fn page_size(&self) -> usize {
        self.0.page_size()
    }
    /// Bytes of one token (values + scale).
    #[getter]
    pub(crate) fn bytes_per_token(&self) -> usize {
        self.0.bytes_per_token()
    }
    /// Bytes of one page.
    #[getter]
    pub(crate) fn bytes_per_page(&self) -> usize {
        self.0.bytes_per_page()
    }
    /// Byte offset of the scale section inside a page (`None` for bf16).
    #[getter]
    pub(crate) fn scale_section_offset(&self) -> Option<usize> {
        self.0.scale_section_offset()
    }
    /// Value bytes of one token (fp8 `head_dim`, fp4 `head_dim / 2`, bf16 `2 · head_dim`).
    #[getter]
    pub(crate) fn value_bytes_per_token(&self) -> usize {
        self.0.value_bytes_per_token()
    }
    /// Scale bytes of one token (fp8 4, fp4 `head_dim / 32`, bf16 0).
    #[getter]
    pub(crate) fn scale_bytes_per_token(&self) -> usize {
        self.0.scale_bytes_per_token()
    }
    /// The descriptor's stable 64-bit fingerprint.
    #[getter]
    pub(crate) fn fingerprint(&self) -> u64 {
        self.0.fingerprint()
    }
    pub(crate) fn __repr__(&self) -> String {
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
    pub(crate) fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<IndexKLayout>()
            .map(|o| o.get().0 == self.0)
            .unwrap_or(false)
    }
    pub(crate) fn __hash__(&self) -> u64 {
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
pub(crate) struct KvLayout(pub(crate) HostKv);

#[pymethods]
impl KvLayout {
    /// `dtype`: `"fp8_ds_mla"` or `"bf16"` (DeepSeek-V3.2; `nope_dim` defaults to 512),
    /// `"model1_fp8"` or `"bf16_512"` (DeepSeek-V4; `nope_dim` 448, `rope_dim` 64, the
    /// defaults). `rope_dim` defaults to 64.
    #[new]
    #[pyo3(signature = (dtype = "fp8_ds_mla", nope_dim = None, rope_dim = None, page_size = 64))]
    pub(crate) fn new(
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
    pub(crate) fn dtype(&self) -> &'static str {
        self.0.dtype().name()
    }
    #[getter]
    pub(crate) fn nope_dim(&self) -> usize {
        self.0.nope_dim()
    }
    #[getter]
    pub(crate) fn rope_dim(&self) -> usize {
        self.0.rope_dim()
    }
    /// `nope_dim + rope_dim`.
    #[getter]
    pub(crate) fn d_qk(&self) -> usize {
        self.0.d_qk()
    }
    /// The attention value dim: `nope_dim` (V3.2 layouts), the whole row `d_qk` (V4).
    #[getter]
    pub(crate) fn d_v(&self) -> usize {
        self.0.d_v()
    }
    /// Whether this is a DeepSeek-V4 layout (`model1_fp8`, `bf16_512`: `sparse_mla_v4`).
    #[getter]
    pub(crate) fn is_v4(&self) -> bool {
        self.0.dtype().is_v4()
    }
    /// Byte offset of the ue8m0 scale section inside a page (`model1_fp8` only).
    #[getter]
    pub(crate) fn scale_section_offset(&self) -> Option<usize> {
        self.0.scale_section_offset()
    }
    #[getter]
    pub(crate) fn page_size(&self) -> usize {
        self.0.page_size()
    }
    #[getter]
    pub(crate) fn bytes_per_token(&self) -> usize {
        self.0.bytes_per_token()
    }
    #[getter]
    pub(crate) fn bytes_per_page(&self) -> usize {
        self.0.bytes_per_page()
    }
    #[getter]
    pub(crate) fn fingerprint(&self) -> u64 {
        self.0.fingerprint()
    }
    pub(crate) fn __repr__(&self) -> String {
        format!(
            "KvLayout(dtype='{}', nope_dim={}, rope_dim={}, page_size={})",
            self.dtype(),
            self.nope_dim(),
            self.rope_dim(),
            self.page_size()
        )
    }
    pub(crate) fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<KvLayout>()
            .map(|o| o.get().0 == self.0)
            .unwrap_or(false)
    }
    pub(crate) fn __hash__(&self) -> u64 {
        self.0.fingerprint()
    }
}

/// Either layout, for the page ops.
pub(crate) fn page_layout(layout: &Bound<'_, PyAny>) -> PyResult<PageLayout> {
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
