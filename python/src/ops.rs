//! The DeepSeek-V3.2 ops on tensors: stores, indexer logits, top-k, sparse MLA.

use crate::*;

// ---------------------------------------------------------------- ops

/// Reads a contiguous int32 `[n, 3]` tensor of query rows `(request, start, end)` (CPU).
///
/// # Safety
/// As [`Tensor::slice`].
pub(crate) unsafe fn host_rows(rows: &Tensor) -> PyResult<Vec<QueryRange>> {
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

/// The page table `ps` of `requests × max_pages` entries. A table of no column maps no
/// position: a `ValueError` naming the first row that sees one (the library's table needs
/// a row length to count its requests).
pub(crate) fn page_table_of<'a>(
    ps: &'a [i32],
    requests: usize,
    max_pages: usize,
    rows: &[QueryRange],
) -> PyResult<PageTable<'a>> {
    if max_pages == 0 {
        if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| r.start < r.end) {
            return Err(PyValueError::new_err(format!(
                "page_table: has no column (shape [{requests}, 0]), but rows[{i}] sees \
                 positions [{}, {})",
                r.start, r.end
            )));
        }
    }
    PageTable::new(ps, max_pages.max(1)).map_err(py_err)
}

/// `decode_rows(context_lens, next_n, out)`: the query rows of the decode form into `out`
/// (int32 `[b · next_n, 3]`, CPU, contiguous), from `context_lens` (int32 or int64, CPU,
/// contiguous): `[b]`, request `b` of context `L` contributing rows `j < next_n` that see
/// `[0, L − next_n + j + 1)`; or `[b, next_n]`, row `(b, j)` seeing `[0, lens[b, j])`.
/// A length outside int32, a context shorter than `next_n` (`[b]`) or a negative length
/// (`[b, next_n]`) is a `ValueError` naming the first one, and `out` is not written.
/// `sparsekit.ops.decode_rows`' CPU path (its torch ops cost ~30 µs a call).
#[pyfunction]
pub(crate) fn decode_rows(
    context_lens: &Bound<'_, PyAny>,
    next_n: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let lens = Tensor::of("context_lens", context_lens)?;
    let out = Tensor::of("out", out)?;
    lens.dtype_in(&["int32", "int64"])?.contiguous()?;
    out.dtype_in(&["int32"])?.contiguous()?;
    if common_device(&[&lens, &out])? != Device::Cpu {
        return Err(PyValueError::new_err(
            "context_lens: decode_rows here takes CPU tensors",
        ));
    }
    let (b, per, two_d) = match lens.shape.as_slice() {
        [b] => (*b, next_n, false),
        [b, n] if *n == next_n => (*b, next_n, true),
        s => {
            return Err(PyValueError::new_err(format!(
                "context_lens: expected [b] or [b, {next_n}], got shape {s:?}"
            )))
        }
    };
    if next_n == 0 {
        return Err(PyValueError::new_err(
            "next_n: must be a positive int, got 0",
        ));
    }
    let n_rows = b
        .checked_mul(per)
        .filter(|&n| i32::try_from(n).is_ok())
        .ok_or_else(|| PyValueError::new_err("context_lens: more rows than int32 can count"))?;
    if out.shape != [n_rows, 3] {
        return Err(PyValueError::new_err(format!(
            "out: expected shape [{n_rows}, 3], got {:?}",
            out.shape
        )));
    }
    let (lb, ob) = (lens.bytes()?, out.bytes()?);
    no_overlap(&[(&out, ob)], &[(&lens, lb)])?;
    // SAFETY: contiguous CPU tensors alive for the call, sizes checked against their
    // storage; the output overlaps the input nowhere.
    let (wide, os) = unsafe {
        let wide: Vec<i64> = match lens.dtype.as_str() {
            "int32" => lens.slice::<i32>(lb)?.iter().map(|&x| x.into()).collect(),
            _ => lens.slice::<i64>(lb)?.to_vec(),
        };
        (wide, out.slice_mut::<i32>(ob)?)
    };
    let at = |i: usize| {
        if two_d {
            format!("context_lens[{}][{}]", i / per, i % per)
        } else {
            format!("context_lens[{i}]")
        }
    };
    // Checked in full before anything is written.
    for (i, &l) in wide.iter().enumerate() {
        if i32::try_from(l).is_err() {
            return Err(PyValueError::new_err(format!(
                "{} = {l} does not fit in int32",
                at(i)
            )));
        }
        if two_d && l < 0 {
            return Err(PyValueError::new_err(format!(
                "{} = {l} is negative",
                at(i)
            )));
        }
        if !two_d && l < next_n as i64 {
            return Err(PyValueError::new_err(format!(
                "{} = {l}: a context shorter than next_n={next_n}",
                at(i)
            )));
        }
    }
    for (r, row) in os.chunks_exact_mut(3).enumerate() {
        let (req, j) = (r / per, r % per);
        let end = if two_d {
            wide[r]
        } else {
            wide[req] - (next_n - 1 - j) as i64
        };
        // In range: every length fits in int32 and every end lies in 0..=its length.
        row.copy_from_slice(&[req as i32, 0, end as i32]);
    }
    Ok(())
}

pub(crate) fn check_2d(t: &Tensor, cols: usize) -> PyResult<usize> {
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
pub(crate) fn index_k_store(
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
            py.detach(|| cpu::store::index_k_store(CpuIsa::get(), &op, k, c))
                .map_err(py_err)
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
pub(crate) fn kv_store(
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
            py.detach(|| cpu::store::kv_store(CpuIsa::get(), &op, k, c))
                .map_err(py_err)
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
pub(crate) fn indexer_logits(
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
                page_table: page_table_of(ps, n_req, max_pages, &host)?,
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
pub(crate) fn topk_scratch_bytes(
    n_rows: usize,
    row_stride: usize,
    k: usize,
) -> PyResult<(usize, usize)> {
    raw::topk_scratch(n_rows, row_stride, k).map_err(py_err)
}

/// Bytes of `sparse_mla`'s two scratch buffers on CUDA.
#[pyfunction]
pub(crate) fn sparse_mla_scratch_bytes(
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
pub(crate) fn topk(
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
                    page_table: page_table_of(ps, p.shape[0], p.shape[1], &host)?,
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
pub(crate) fn sparse_mla(
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
