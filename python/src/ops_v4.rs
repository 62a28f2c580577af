//! DeepSeek-V4's sparse attention on tensors (two caches, sink).

use crate::*;

/// Bytes of `sparse_mla_v4`'s two scratch buffers on CUDA (`total_topk`: the caches' top-k
/// summed).
#[pyfunction]
pub(crate) fn sparse_mla_v4_scratch_bytes(
    n_tokens: usize,
    n_heads: usize,
    total_topk: usize,
) -> PyResult<(usize, usize)> {
    raw::sparse_mla_v4_scratch(n_tokens, n_heads, total_topk).map_err(py_err)
}

/// One cache argument of `sparse_mla_v4`: its layout, pages, indices int32 `[t, topk]` and
/// optional lengths int32 `[t]`.
pub(crate) struct V4Arg {
    pub(crate) layout: HostKv,
    pub(crate) cache: Tensor,
    pub(crate) indices: Tensor,
    pub(crate) lengths: Option<Tensor>,
    pub(crate) topk: usize,
}

impl V4Arg {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn of(
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
    pub(crate) fn reads(&self) -> PyResult<Vec<(&Tensor, usize)>> {
        let mut v = vec![
            (&self.cache, self.cache.bytes()?),
            (&self.indices, self.indices.bytes()?),
        ];
        if let Some(l) = &self.lengths {
            v.push((l, l.bytes()?));
        }
        Ok(v)
    }

    pub(crate) fn device_bufs(&self) -> PyResult<V4CacheBufs> {
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
pub(crate) fn sparse_mla_v4(
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
