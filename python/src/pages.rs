//! Page copies and page checksums on tensors.

use crate::*;

/// `copy_pages(layout, src, dst, src_ids, dst_ids, stream=None)`: whole pages of `layout`
/// from the contiguous pool `src` to the contiguous pool `dst` (distinct memory); ids
/// int32 `[n]`, destinations unique.
#[pyfunction]
#[pyo3(signature = (layout, src, dst, src_ids, dst_ids, stream = None))]
pub(crate) fn copy_pages(
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
pub(crate) fn page_checksums(
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
