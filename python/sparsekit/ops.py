"""sparsekit's ops on torch tensors.

Every function takes torch tensors on one device (CPU or CUDA), validates shapes, dtypes,
strides and devices first (``TypeError`` for a wrong dtype or a non-tensor, ``ValueError``
for anything else, the message naming the argument), allocates its outputs with torch
unless they are passed in (``out=``), and returns them.

Conventions (as in the Rust crates and ``docs/golden.md``):

- caches are whole pages of raw bytes in the layout of an ``IndexKLayout`` or a
  ``KvLayout`` (any dtype and shape whose contiguous bytes are a whole number of pages;
  ``uint8 [num_pages, bytes_per_page]`` is the natural one). DeepSeek-V3.2's layouts:
  ``KvLayout("fp8_ds_mla" | "bf16")``, ``IndexKLayout("fp8_e4m3" | "bf16")``;
  DeepSeek-V4's: ``KvLayout("model1_fp8" | "bf16_512", page_size=P)`` (512-d rows that
  are both key and value, attended by ``sparse_mla_v4``) and
  ``IndexKLayout("fp4_e2m1", 128, P)`` (68 B per key: 64 B packed e2m1 + 4 ue8m0 scales);
- a *slot* is ``page * page_size + offset``, ``-1`` meaning none;
- query *rows* are ``int32 [n, 3]`` ``(request, start, end)``: the row sees positions
  ``[start, end)`` of that request, read through row ``request`` of the page table; or the
  decode form ``context_lens`` (``[b]``: request ``b`` contributes ``next_n`` causal rows,
  row ``j`` seeing ``[0, L - next_n + j + 1)``; or ``[b, next_n]``: row ``(b, j)`` sees
  ``[0, context_lens[b, j])``).

Non-contiguous *inputs* are copied (``.contiguous()``), and lazily negated or conjugated
views (torch's neg and conj bits) resolved; tensors written in place (caches, ``out=``)
must be contiguous and carry neither bit, and are refused otherwise. The ops have no
backward: under grad mode a tensor that requires grad is refused (``ValueError``), and
every in-place write counts in the tensor's autograd version, as torch's own do.

On CPU tensors every metadata entry is checked (a slot, page id, range or index outside
the cache is a ``ValueError`` and nothing is written). On CUDA tensors the call is
enqueued on ``torch.cuda.current_stream()`` with no host synchronisation and no
allocation outside torch's allocator (so it can be captured in a CUDA graph); the
metadata is device data the host does not read, so instead of checking it the call
*sanitises* it on the device first with elementwise torch ops, which keeps every kernel
access inside its buffers: slots and ``sparse_mla`` indices outside the cache become
``-1`` (skipped: FlashMLA's convention for indices), ranges are clamped into their row,
the page table and the request count, page-table entries and page ids outside the pool
are clamped into it (the values read are then wrong, never out of bounds). Set
``SPARSEKIT_CHECK_DEVICE_METADATA=1`` to have CUDA calls check the metadata on the host
instead (a synchronisation per call; for debugging, not under graph capture).

Integer metadata may be int32 or int64; the kernels read it as int32 (but the stores'
slots, int64). An int64 value outside int32's range is never wrapped (``2**32 + 3`` would
read slot 3): on CPU it is a ``ValueError``; on CUDA one above becomes int32's maximum
and one below ``-1``, out of range like any other value the sanitising handles.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

from . import _native
from ._native import IndexKLayout, KvLayout

__all__ = [
    "IndexKLayout",
    "KvLayout",
    "index_k_store",
    "kv_store",
    "indexer_logits",
    "topk",
    "sparse_mla",
    "sparse_mla_v4",
    "copy_pages",
    "page_checksums",
    "decode_rows",
]

_FP8 = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n)
)

# What a tensor of cache bytes may be typed as: raw bytes, or the e4m3 values those bytes
# are (any other 1-byte dtype, such as float8_e5m2 or an fnuz variant, would mean other
# values for the same bytes).
_CACHE_BYTES = (torch.uint8,) + _FP8


# ------------------------------------------------------------------ argument checks


def _tensor(name: str, t, *, dtypes=None, ndim=None, shape=None) -> torch.Tensor:
    """Checks one tensor argument (``TypeError`` for a non-tensor or a wrong dtype,
    ``ValueError`` for a wrong rank or shape); ``shape`` entries of ``None`` are free."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name}: requires grad, but sparsekit's ops have no backward (no gradient "
            "would flow through them); call them under torch.no_grad() or "
            f"torch.inference_mode(), or pass {name}.detach()"
        )
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: dtype {t.dtype} is not supported (expected {want})")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(
            s is not None and s != d for s, d in zip(shape, t.shape)
        ):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    return t


def _same_device(**tensors) -> torch.device:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.device != t0.device:
            raise ValueError(
                f"{name}: on {t.device}, but {name0} is on {t0.device} "
                "(every tensor of a call must be on one device)"
            )
    if t0.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name0}: device {t0.device} is not supported (cpu or cuda)")
    return t0.device


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """An input whose memory holds its values: a lazily negated or conjugated view
    (torch's neg and conj bits, e.g. ``torch._neg_view``: its memory holds the values
    before the negation, and ``.contiguous()`` keeps the bit) resolved, a lazily zero
    tensor (no memory at all) made real."""
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t.resolve_conj().resolve_neg()


def _values(t: torch.Tensor) -> torch.Tensor:
    """An input's values in a contiguous tensor (see ``_resolved``)."""
    return _resolved(t).contiguous()


def _wrote(*tensors: torch.Tensor) -> None:
    """Counts the native call's in-place writes in each tensor's autograd version, as
    torch's own in-place ops do: a graph that saved one of them for its backward then
    refuses to run instead of reading the new values (an inference tensor, which has no
    version, takes it as a no-op)."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)


def _written(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_neg() or t.is_conj():
        raise ValueError(
            f"{name}: is written in place and must not be a lazily negated or conjugated "
            "view (torch's neg or conj bit); resolve it (.resolve_neg(), .resolve_conj()) "
            "and write into the result"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: is written in place and must be contiguous "
            f"(shape {list(t.shape)}, strides {list(t.stride())})"
        )
    return t


def _pages(name: str, cache: torch.Tensor, layout) -> int:
    """Pages in a contiguous cache tensor of ``layout``."""
    if not isinstance(layout, (IndexKLayout, KvLayout)):
        raise TypeError(
            f"layout: expected an IndexKLayout or a KvLayout, got {type(layout).__name__}"
        )
    _written(name, cache)
    nbytes = cache.numel() * cache.element_size()
    page = layout.bytes_per_page
    if nbytes % page:
        raise ValueError(
            f"{name}: {nbytes} bytes is not a whole number of {page}-byte pages of {layout!r}"
        )
    return nbytes // page


_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _narrow_i32(name: str, t: torch.Tensor, *, above: int = _I32_MAX) -> torch.Tensor:
    """An int32 or int64 tensor as int32, never wrapping: an int64 value outside int32's
    range is a ``ValueError`` on CPU (and on CUDA with
    ``SPARSEKIT_CHECK_DEVICE_METADATA=1``); on CUDA one above it becomes ``above``
    (int32's maximum: out of every buffer, a length that clamps to its row; ``-1``, none,
    for indices handed back to a caller) and one below it ``-1``, so the sanitising
    treats them as any other value out of range (a wrapped ``2**32 + 3`` would read slot
    3, and ``i32::MIN`` times an even page size wraps to page 0)."""
    if t.dtype == torch.int32:
        return t
    if t.device.type == "cpu" or _check_device_metadata():
        h = t.cpu()
        bad = (h < _I32_MIN) | (h > _I32_MAX)
        if h.numel() and bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name}{''.join(f'[{i}]' for i in at)} = {int(h[at])} does not fit in int32"
            )
        return t.to(torch.int32)
    out = torch.where(t > _I32_MAX, torch.full_like(t, above), t)
    return torch.where(t < _I32_MIN, torch.full_like(t, -1), out).to(torch.int32)


def _int_tensor(name: str, t, dtype, *, ndim=None) -> torch.Tensor:
    t = _tensor(name, t, dtypes=(torch.int32, torch.int64), ndim=ndim)
    if dtype == torch.int32:
        return _values(_narrow_i32(name, t))
    return _values(t.to(dtype))


def _stream(device: torch.device):
    """The raw handle of the caller's current stream on ``device`` (CUDA), else None."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


def _check_device_metadata() -> bool:
    return os.environ.get("SPARSEKIT_CHECK_DEVICE_METADATA", "") == "1"


def _scratch(n_bytes: Tuple[int, int], device: torch.device):
    ws, cs = n_bytes
    return (
        torch.empty(ws, dtype=torch.uint8, device=device),
        torch.zeros(cs, dtype=torch.uint8, device=device),
    )


# ------------------------------------------------------------------ rows


def decode_rows(context_lens: torch.Tensor, next_n: int = 1) -> torch.Tensor:
    """Query rows ``int32 [rows, 3]`` of the decode form.

    ``context_lens`` ``[b]``: request ``b`` with context ``L`` contributes ``next_n`` rows,
    row ``j`` seeing ``[0, L - next_n + j + 1)``; ``[b, next_n]``: row ``(b, j)`` sees
    ``[0, context_lens[b, j])``. Rows are ordered by request, then ``j``. On CPU a context
    shorter than ``next_n`` (``[b]``), a negative length (``[b, next_n]``) or an int64
    length outside int32 is a ``ValueError``; on CUDA an end that falls below 0 is
    clamped to 0 (an empty row) and an int64 length past int32 saturates.
    """
    context_lens = _tensor("context_lens", context_lens, dtypes=(torch.int32, torch.int64))
    if not isinstance(next_n, int) or next_n < 1:
        raise ValueError(f"next_n: must be a positive int, got {next_n!r}")
    if context_lens.dim() == 2:
        if context_lens.shape[1] != next_n:
            if next_n != 1:
                raise ValueError(f"context_lens: shape {list(context_lens.shape)} does not "
                                 f"match next_n={next_n}")
            next_n = context_lens.shape[1]
    elif context_lens.dim() != 1:
        raise ValueError(
            f"context_lens: expected [b] or [b, next_n], got shape {list(context_lens.shape)}"
        )
    dev = context_lens.device
    if dev.type == "cpu":
        # The rows and every check in one native pass (torch ops would cost ~30 µs).
        rows = torch.empty((context_lens.shape[0] * next_n, 3), dtype=torch.int32)
        if rows.numel():
            _native.decode_rows(_values(context_lens), next_n, rows)
        return rows
    # On CUDA nothing is read back: every end is at most a length, inside int32, and one
    # that falls below 0 becomes an empty row.
    lens = _narrow_i32("context_lens", context_lens).to(torch.int64)
    b = lens.shape[0]
    if lens.dim() == 1:
        j = torch.arange(next_n, device=dev, dtype=torch.int64)
        ends = lens[:, None] - (next_n - 1 - j)[None, :]
    else:
        ends = lens
    per = ends.shape[1]
    ends = ends.clamp_min(0).to(torch.int32).reshape(-1)
    req = torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(per)
    rows = torch.stack([req, torch.zeros_like(ends), ends], dim=1)
    return _values(rows)


def _rows_arg(rows, context_lens, next_n, n_expected: Optional[int],
              device) -> Optional[torch.Tensor]:
    if rows is not None and context_lens is not None:
        raise ValueError("rows: give rows or context_lens, not both")
    if rows is not None:
        rows = _int_tensor("rows", rows, torch.int32, ndim=2)
        if rows.shape[1] != 3:
            raise ValueError(f"rows: expected shape [n, 3], got {list(rows.shape)}")
    elif context_lens is not None:
        rows = decode_rows(context_lens, next_n)
    else:
        return None
    if n_expected is not None and rows.shape[0] != n_expected:
        raise ValueError(
            f"rows: {rows.shape[0]} query rows, but the other arguments have {n_expected}"
        )
    if rows.device != device:
        raise ValueError(f"rows: on {rows.device}, but the tensors are on {device}")
    return rows


def _sanitize_rows(rows, *, width: int, n_requests: Optional[int], covered: Optional[int]):
    """CUDA: clamps ranges into ``[0, min(width, covered))`` and requests into the table."""
    req, start, end = rows[:, 0], rows[:, 1], rows[:, 2]
    limit = width if covered is None else min(width, covered)
    end = end.clamp(0, limit)
    start = torch.minimum(start.clamp_min(0), end)
    if n_requests is not None:
        req = req.clamp(0, max(n_requests - 1, 0))
    return torch.stack([req, start, end], dim=1).contiguous()


def _host_check_rows(rows, *, width, n_requests):
    """SPARSEKIT_CHECK_DEVICE_METADATA: the CPU checks, on a host copy."""
    r = rows.cpu()
    bad = (r[:, 1] < 0) | (r[:, 1] > r[:, 2]) | (r[:, 2] > width) | (r[:, 0] < 0)
    if n_requests is not None:
        bad |= r[:, 0] >= n_requests
    if bool(bad.any()):
        i = int(bad.nonzero()[0][0])
        raise ValueError(f"rows[{i}]: range {r[i].tolist()} is invalid (width {width})")


# ------------------------------------------------------------------ stores


def _store_slots(slots, n: int, capacity: int, device) -> torch.Tensor:
    slots = _int_tensor("slots", slots, torch.int64, ndim=1)
    if slots.shape[0] != n:
        raise ValueError(f"slots: {slots.shape[0]} entries for {n} tokens")
    if slots.device != device:
        raise ValueError(f"slots: on {slots.device}, but the cache is on {device}")
    if device.type == "cuda":
        if _check_device_metadata():
            s = slots.cpu()
            bad = (s < -1) | (s >= capacity)
            if bool(bad.any()):
                i = int(bad.nonzero()[0][0])
                raise ValueError(f"slots[{i}] = {int(s[i])} is out of range ({capacity} slots)")
        slots = torch.where((slots >= 0) & (slots < capacity), slots, -1)
    return slots


def index_k_store(keys: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                  layout: IndexKLayout) -> torch.Tensor:
    """Quantizes (fp8: e4m3 + one f32 scale per token, ``max(amax, 1e-4) / 448``, or its
    ue8m0 power of two; fp4_e2m1: per 32 values the ue8m0 scale
    ``2^max(ceil(log2(amax / 6)), -126)`` and the nearest e2m1 codes, packed two per byte,
    even element in the low nibble) or copies (bf16) ``keys`` ``bf16 [n, head_dim]`` into
    the paged index-K ``cache`` at ``slots`` (``int64 [n]``, ``-1`` skips, no slot twice);
    returns ``cache``, written in place."""
    if not isinstance(layout, IndexKLayout):
        raise TypeError("layout: expected a sparsekit.IndexKLayout")
    keys = _tensor("keys", keys, dtypes=(torch.bfloat16,), shape=(None, layout.head_dim))
    cache = _tensor("cache", cache)
    dev = _same_device(keys=keys, cache=cache)
    pages = _pages("cache", cache, layout)
    slots = _store_slots(slots, keys.shape[0], pages * layout.page_size, dev)
    _native.index_k_store(layout, _values(keys), slots, cache, _stream(dev))
    _wrote(cache)
    return cache


def kv_store(kv: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
             layout: KvLayout) -> torch.Tensor:
    """Stores MLA tokens ``kv`` ``bf16 [n, nope_dim + rope_dim]`` (latent first) into the
    paged KV ``cache`` at ``slots`` (``fp8_ds_mla``: per-128 tile scale
    ``2^ceil(log2(max(amax / 448, 1e-4)))``, rope kept bf16; ``model1_fp8``: the same rule
    per 64-value tile of the 448 NoPE values, the scale stored as its ue8m0 byte in the
    page's scale section; ``bf16_512``: the 512 values as they are); returns ``cache``."""
    if not isinstance(layout, KvLayout):
        raise TypeError("layout: expected a sparsekit.KvLayout")
    kv = _tensor("kv", kv, dtypes=(torch.bfloat16,), shape=(None, layout.d_qk))
    cache = _tensor("cache", cache)
    dev = _same_device(kv=kv, cache=cache)
    pages = _pages("cache", cache, layout)
    slots = _store_slots(slots, kv.shape[0], pages * layout.page_size, dev)
    _native.kv_store(layout, _values(kv), slots, cache, _stream(dev))
    _wrote(cache)
    return cache


# ------------------------------------------------------------------ indexer


def _page_table(page_table, device, num_pages: int) -> torch.Tensor:
    pt = _int_tensor("page_table", page_table, torch.int32, ndim=2)
    if pt.device != device:
        raise ValueError(f"page_table: on {pt.device}, but the cache is on {device}")
    if device.type == "cuda" and not _check_device_metadata():
        pt = pt.clamp(0, max(num_pages - 1, 0))
    return pt


def _host_check_page_table(pt, rows, page_size, num_pages):
    p, r = pt.cpu(), rows.cpu()
    for i in range(r.shape[0]):
        req, start, end = (int(x) for x in r[i])
        if start >= end:
            continue
        cols = p[req, start // page_size:(end - 1) // page_size + 1]
        bad = (cols < 0) | (cols >= num_pages)
        if bool(bad.any()):
            c = start // page_size + int(bad.nonzero()[0][0])
            raise ValueError(
                f"page_table[{req}][{c}] = page {int(p[req, c])} is out of range "
                f"(pool holds {num_pages} pages)"
            )


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                   page_table: torch.Tensor, layout: IndexKLayout, *,
                   rows: Optional[torch.Tensor] = None,
                   context_lens: Optional[torch.Tensor] = None, next_n: int = 1,
                   row_stride: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The lightning indexer's logits:
    ``out[t, s] = Σ_h weights[t, h] · ReLU(q[t, h] · k[s]) · k_scale[s]`` for every
    position ``s`` of row ``t``'s range, ``-inf`` in every other column.

    ``q``: ``bf16 [n, heads, head_dim]`` (``float8_e4m3fn`` is converted to bf16, exactly);
    ``weights``: ``float32 [n, heads]`` (already folding every constant); ``cache``: the
    paged index-K pool of ``layout`` (fp4_e2m1 keys: ``k[s]`` is the dequantised key, codes
    times their group's scale, and ``k_scale`` is 1); ``page_table``: ``int32 [requests, max_pages]``;
    the rows as ``rows`` or ``context_lens`` (+ ``next_n``), see the module doc.
    ``row_stride`` (columns of ``out``) defaults to ``max_pages · page_size``.
    Returns ``float32 [n, row_stride]``.
    """
    if not isinstance(layout, IndexKLayout):
        raise TypeError("layout: expected a sparsekit.IndexKLayout")
    q = _tensor("q", q, dtypes=(torch.bfloat16,) + _FP8, ndim=3)
    if q.shape[2] != layout.head_dim:
        raise ValueError(f"q: head_dim {q.shape[2]} is not the layout's {layout.head_dim}")
    n, h = q.shape[0], q.shape[1]
    weights = _tensor("weights", weights, dtypes=(torch.float32,), shape=(n, h))
    cache = _tensor("cache", cache)
    dev = _same_device(q=q, weights=weights, cache=cache, page_table=page_table
                       if isinstance(page_table, torch.Tensor) else None)
    num_pages = _pages("cache", cache, layout)
    pt = _page_table(page_table, dev, num_pages)
    r = _rows_arg(rows, context_lens, next_n, n, dev)
    if r is None:
        raise ValueError("rows: give the query rows (rows=) or the decode form (context_lens=)")
    if row_stride is None:
        row_stride = pt.shape[1] * layout.page_size
    if not isinstance(row_stride, int) or row_stride < 0:
        raise ValueError(f"row_stride: must be a non-negative int, got {row_stride!r}")
    if out is None:
        out = torch.empty((n, row_stride), dtype=torch.float32, device=dev)
    else:
        _written("out", _tensor("out", out, dtypes=(torch.float32,), shape=(n, row_stride)))
        _same_device(q=q, out=out)
    if dev.type == "cuda":
        if num_pages == 0 and n > 0:
            raise ValueError("cache: holds no page")
        if pt.shape[0] == 0 and n > 0:
            raise ValueError("page_table: has no rows")
        if _check_device_metadata():
            _host_check_rows(r, width=row_stride, n_requests=pt.shape[0])
            _host_check_page_table(pt, r, layout.page_size, num_pages)
        r = _sanitize_rows(r, width=row_stride, n_requests=pt.shape[0],
                           covered=pt.shape[1] * layout.page_size)
    qb = q.to(torch.bfloat16) if q.dtype != torch.bfloat16 else q
    _native.indexer_logits(layout, _values(qb), _values(weights), cache, pt, r, out,
                           _stream(dev))
    _wrote(out)
    return out


# ------------------------------------------------------------------ top-k


def topk(logits: torch.Tensor, k: int, *, rows: Optional[torch.Tensor] = None,
         context_lens: Optional[torch.Tensor] = None, next_n: int = 1,
         page_table: Optional[torch.Tensor] = None, page_size: Optional[int] = None,
         out: Optional[torch.Tensor] = None,
         take_all_short_rows: bool = False) -> torch.Tensor:
    """Exact top-``k`` of each row's range of ``logits`` (``float32 [n, width]``; rows
    contiguous, a row stride above ``width`` is fine), ignoring ``-inf`` and NaN, ties to
    the lower position, written in ascending position order, then ``-1`` padding.

    The ranges: ``rows`` or ``context_lens`` (+ ``next_n``); without either, row ``i``
    sees all ``width`` columns as request ``i``. Output ``int32 [n, k]``: positions, or
    with ``page_table`` (``int32 [requests, max_pages]``) and ``page_size`` the cache slots
    ``page_table[request, pos // page_size] * page_size + pos % page_size``.

    ``take_all_short_rows=True`` is DeepSeek-V4's top-k transform: a row whose range holds
    at most ``k`` positions gets all of them in order (whatever their logits, ``-inf`` and
    NaN included), then ``-1``; longer rows as above.
    """
    logits = _tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
    if not isinstance(take_all_short_rows, bool):
        raise TypeError(f"take_all_short_rows: expected a bool, got {type(take_all_short_rows).__name__}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: must be a positive int, got {k!r}")
    n, width = logits.shape
    dev = _same_device(logits=logits)
    r = _rows_arg(rows, context_lens, next_n, n, dev)
    if r is None:
        r = torch.stack([
            torch.arange(n, dtype=torch.int32, device=dev),
            torch.zeros(n, dtype=torch.int32, device=dev),
            torch.full((n,), width, dtype=torch.int32, device=dev),
        ], dim=1)
    if (page_table is None) != (page_size is None):
        raise ValueError("page_size: give it with page_table (slot output), or neither")
    pt = None
    if page_table is not None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: must be a positive int, got {page_size!r}")
        pt = _int_tensor("page_table", page_table, torch.int32, ndim=2)
        if pt.device != dev:
            raise ValueError(f"page_table: on {pt.device}, but logits is on {dev}")
    if out is None:
        out = torch.empty((n, k), dtype=torch.int32, device=dev)
    else:
        _written("out", _tensor("out", out, dtypes=(torch.int32,), shape=(n, k)))
        _same_device(logits=logits, out=out)
    logits = _resolved(logits)
    if logits.stride(-1) != 1 or (n > 1 and logits.stride(0) < width):
        logits = _values(logits)
    elif n > 1 and logits.stride(0) > width:
        # A padded row stride (DeepGEMM's aligned logits) is read in place when the
        # storage covers every row's full stride; otherwise packed.
        need = (logits.storage_offset() + n * logits.stride(0)) * 4
        if logits.untyped_storage().nbytes() < need:
            logits = _values(logits)
    if dev.type == "cuda":
        if _check_device_metadata():
            _host_check_rows(r, width=width, n_requests=None if pt is None else pt.shape[0])
        covered = None if pt is None or page_size is None else pt.shape[1] * page_size
        r = _sanitize_rows(r, width=width, n_requests=None if pt is None else pt.shape[0],
                           covered=covered)
        row_stride = logits.stride(0) if n > 1 else width
        ws, cn = _scratch(_native.topk_scratch_bytes(n, row_stride, k), dev)
        _native.topk(logits, r, k, out, pt, page_size, ws, cn, _stream(dev),
                     take_all_short_rows)
    else:
        _native.topk(logits, r, k, out, pt, page_size, None, None, None, take_all_short_rows)
    _wrote(out)
    return out


# ------------------------------------------------------------------ sparse MLA


def sparse_mla(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor,
               layout: KvLayout, softmax_scale: Optional[float] = None, *,
               out: Optional[torch.Tensor] = None,
               lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention: per token and head, softmax attention over the token's
    ``indices`` (cache slots, ``-1`` skipped; a slot listed twice counts twice):
    ``out = Σ_j softmax(scale · q·k_j) v_j``, ``lse = ln Σ_j exp(scale · q·k_j)``.

    ``q``: ``bf16 [tokens, heads, d_qk]``; ``cache``: the paged KV pool of ``layout``
    (``k_j`` its dequantised ``[latent | rope]``, ``v_j`` its latent); ``indices``:
    ``int32 [tokens, topk]``. ``softmax_scale`` defaults to ``d_qk ** -0.5``. Returns
    ``(out bf16 [tokens, heads, nope_dim], lse float32 [tokens, heads])``; a token without
    a valid index gets ``out = 0``, ``lse = -inf``.
    """
    if not isinstance(layout, KvLayout):
        raise TypeError("layout: expected a sparsekit.KvLayout")
    if layout.is_v4:
        raise ValueError(f"layout: {layout!r} is a DeepSeek-V4 layout: use sparse_mla_v4")
    q = _tensor("q", q, dtypes=(torch.bfloat16,), ndim=3)
    if q.shape[2] != layout.d_qk:
        raise ValueError(f"q: d_qk {q.shape[2]} is not the layout's {layout.d_qk}")
    t, h = q.shape[0], q.shape[1]
    cache = _tensor("cache", cache)
    idx = _int_tensor("indices", indices, torch.int32, ndim=2)
    if idx.shape[0] != t:
        raise ValueError(f"indices: {idx.shape[0]} rows for {t} tokens")
    dev = _same_device(q=q, cache=cache, indices=idx)
    pages = _pages("cache", cache, layout)
    if softmax_scale is None:
        softmax_scale = layout.d_qk ** -0.5
    softmax_scale = float(softmax_scale)
    if out is None:
        out = torch.empty((t, h, layout.nope_dim), dtype=torch.bfloat16, device=dev)
    else:
        _written("out", _tensor("out", out, dtypes=(torch.bfloat16,),
                                shape=(t, h, layout.nope_dim)))
    if lse is None:
        lse = torch.empty((t, h), dtype=torch.float32, device=dev)
    else:
        _written("lse", _tensor("lse", lse, dtypes=(torch.float32,), shape=(t, h)))
    _same_device(q=q, out=out, lse=lse)
    if dev.type == "cuda":
        capacity = pages * layout.page_size
        if _check_device_metadata():
            i = idx.cpu()
            bad = (i < -1) | (i >= capacity)
            if bool(bad.any()):
                a, b = (int(x) for x in bad.nonzero()[0])
                raise ValueError(f"indices[{a}][{b}] = {int(i[a, b])} is out of range "
                                 f"(cache holds {capacity} slots)")
        idx = torch.where((idx >= 0) & (idx < capacity), idx, -1)
        ws, cn = _scratch(_native.sparse_mla_scratch_bytes(layout, t, h, idx.shape[1]), dev)
        _native.sparse_mla(layout, _values(q), cache, idx, out, lse, softmax_scale,
                           ws, cn, _stream(dev))
    else:
        _native.sparse_mla(layout, _values(q), cache, idx, out, lse, softmax_scale)
    _wrote(out, lse)
    return out, lse


def _v4_layout(name: str, layout) -> KvLayout:
    if not isinstance(layout, KvLayout):
        raise TypeError(f"{name}: expected a sparsekit.KvLayout")
    if not layout.is_v4:
        raise ValueError(f"{name}: {layout!r} is not a DeepSeek-V4 layout (model1_fp8 or "
                         "bf16_512); DeepSeek-V3.2 layouts take sparse_mla")
    return layout


def _v4_cache(names, cache, indices, lengths, layout, t: int, device):
    """One cache of ``sparse_mla_v4``: ``(pages tensor, indices int32, lengths int32 or
    None, capacity)``; CUDA metadata sanitised (lengths clamped into ``[0, topk]``, indices
    outside the cache made ``-1``)."""
    cname, iname, lname = names
    cache = _tensor(cname, cache)
    if cache.device != device:
        raise ValueError(f"{cname}: on {cache.device}, but q is on {device}")
    pages = _pages(cname, cache, layout)
    capacity = pages * layout.page_size
    idx = _int_tensor(iname, indices, torch.int32, ndim=2)
    if idx.shape[0] != t:
        raise ValueError(f"{iname}: {idx.shape[0]} rows for {t} tokens")
    if idx.device != device:
        raise ValueError(f"{iname}: on {idx.device}, but q is on {device}")
    topk_ = idx.shape[1]
    lens = None
    if lengths is not None:
        lens = _int_tensor(lname, lengths, torch.int64, ndim=1)
        if lens.shape[0] != t:
            raise ValueError(f"{lname}: {lens.shape[0]} entries for {t} tokens")
        if lens.device != device:
            raise ValueError(f"{lname}: on {lens.device}, but q is on {device}")
        if device.type == "cpu" and lens.numel():
            bad = (lens < 0) | (lens > topk_)
            if bool(bad.any()):
                i = int(bad.nonzero()[0][0])
                raise ValueError(f"{lname}[{i}] = {int(lens[i])} is outside [0, {topk_}] "
                                 f"(the top-k of {iname})")
    if device.type == "cuda":
        if _check_device_metadata():
            i_h = idx.cpu()
            used = torch.ones_like(i_h, dtype=torch.bool)
            if lens is not None:
                l_h = lens.cpu()
                bad = (l_h < 0) | (l_h > topk_)
                if bool(bad.any()):
                    r = int(bad.nonzero()[0][0])
                    raise ValueError(f"{lname}[{r}] = {int(l_h[r])} is outside [0, {topk_}]")
                used = torch.arange(topk_)[None, :] < l_h[:, None]
            bad = used & ((i_h < -1) | (i_h >= capacity))
            if bool(bad.any()):
                a, b = (int(x) for x in bad.nonzero()[0])
                raise ValueError(f"{iname}[{a}][{b}] = {int(i_h[a, b])} is out of range "
                                 f"({cname} holds {capacity} slots)")
        if lens is not None:
            lens = lens.clamp(0, topk_)
        idx = torch.where((idx >= 0) & (idx < capacity), idx, -1)
    if lens is not None:
        lens = _values(lens.to(torch.int32))
    return cache, _values(idx), lens, topk_


def sparse_mla_v4(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor,
                  layout: KvLayout, softmax_scale: Optional[float] = None, *,
                  lengths: Optional[torch.Tensor] = None,
                  extra_cache: Optional[torch.Tensor] = None,
                  extra_indices: Optional[torch.Tensor] = None,
                  extra_layout: Optional[KvLayout] = None,
                  extra_lengths: Optional[torch.Tensor] = None,
                  attn_sink: Optional[torch.Tensor] = None,
                  out: Optional[torch.Tensor] = None,
                  lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's sparse attention (the Rust ``sparse_mla_v4`` op; FlashMLA's sparse
    ``flash_mla_with_kvcache`` with MODEL1): per token and head, one softmax over the
    token's used entries of ``cache``, then of ``extra_cache``, with ``K = V`` the
    dequantised 512-d row (rope included):
    ``s_j = softmax_scale · q·k_j``, ``lse = ln Σ_j exp(s_j)`` (natural log, **without**
    the sink), ``out = Σ_j softmax_j · k_j``, then with ``attn_sink``
    ``out *= 1 / (1 + exp(attn_sink[h] − lse))``.

    ``q``: ``bf16 [tokens, heads, 512]`` (1 to 128 heads); ``cache`` / ``extra_cache``:
    pools of the V4 layouts ``layout`` / ``extra_layout`` (``model1_fp8`` or
    ``bf16_512``, each its own page size); ``indices`` / ``extra_indices``: ``int32
    [tokens, topk]`` slots ``page · page_size + offset``; ``lengths`` / ``extra_lengths``
    (``[tokens]``): token ``t`` uses only its first ``lengths[t]`` indices (all without
    it) — inside them ``-1`` is skipped, past them nothing is read; a slot listed twice
    counts twice. ``attn_sink``: ``float32 [heads]`` (``+inf`` zeroes the output,
    ``-inf`` changes nothing; NaN is refused on CPU). ``softmax_scale`` defaults to
    ``512 ** -0.5``. Returns ``(out bf16 [tokens, heads, 512], lse float32 [tokens,
    heads])``; a token without a valid index gets ``out = 0`` and ``lse = +inf``
    (FlashMLA's convention; ``sparse_mla`` writes ``-inf``).

    On CPU a used index outside its cache (other than ``-1``) or a length outside
    ``[0, topk]`` is a ``ValueError``; on CUDA such indices become ``-1`` and lengths are
    clamped (see the module doc).
    """
    layout = _v4_layout("layout", layout)
    q = _tensor("q", q, dtypes=(torch.bfloat16,), ndim=3)
    if q.shape[2] != 512:
        raise ValueError(f"q: head dim {q.shape[2]} is not 512 (DeepSeek-V4's d_qk)")
    t, h = q.shape[0], q.shape[1]
    if not 1 <= h <= 128:
        raise ValueError(f"q: {h} heads is outside 1..=128")
    dev = _same_device(q=q)
    cache, idx, lens, topk_main = _v4_cache(("cache", "indices", "lengths"), cache, indices,
                                            lengths, layout, t, dev)
    given = [x is not None for x in (extra_cache, extra_indices, extra_layout)]
    if any(given) and not all(given):
        raise ValueError("extra_cache: give extra_cache, extra_indices and extra_layout together")
    if extra_lengths is not None and extra_cache is None:
        raise ValueError("extra_lengths: given without extra_cache")
    extra = None
    topk_total = topk_main
    if extra_cache is not None:
        extra_layout = _v4_layout("extra_layout", extra_layout)
        extra = _v4_cache(("extra_cache", "extra_indices", "extra_lengths"), extra_cache,
                          extra_indices, extra_lengths, extra_layout, t, dev)
        topk_total += extra[3]
    sink = None
    if attn_sink is not None:
        sink = _tensor("attn_sink", attn_sink, dtypes=(torch.float32,), shape=(h,))
        if sink.device != dev:
            raise ValueError(f"attn_sink: on {sink.device}, but q is on {dev}")
        if dev.type == "cpu" and bool(sink.isnan().any()):
            i = int(sink.isnan().nonzero()[0][0])
            raise ValueError(f"attn_sink[{i}] is NaN")
        sink = _values(sink)
    if softmax_scale is None:
        softmax_scale = 512 ** -0.5
    softmax_scale = float(softmax_scale)
    if out is None:
        out = torch.empty((t, h, 512), dtype=torch.bfloat16, device=dev)
    else:
        _written("out", _tensor("out", out, dtypes=(torch.bfloat16,), shape=(t, h, 512)))
    if lse is None:
        lse = torch.empty((t, h), dtype=torch.float32, device=dev)
    else:
        _written("lse", _tensor("lse", lse, dtypes=(torch.float32,), shape=(t, h)))
    _same_device(q=q, out=out, lse=lse)
    e = (None, None, None, None) if extra is None else extra
    args = (layout, _values(q), cache, idx, out, lse, softmax_scale, lens,
            extra_layout if extra is not None else None, e[0], e[1], e[2], sink)
    if dev.type == "cuda":
        ws, cn = _scratch(_native.sparse_mla_v4_scratch_bytes(t, h, topk_total), dev)
        _native.sparse_mla_v4(*args, ws, cn, _stream(dev))
    else:
        _native.sparse_mla_v4(*args)
    _wrote(out, lse)
    return out, lse


# ------------------------------------------------------------------ pages


def _ids(name, ids, device, num_pages):
    ids = _int_tensor(name, ids, torch.int32, ndim=1)
    if ids.device != device:
        raise ValueError(f"{name}: on {ids.device}, but the pool is on {device}")
    if device.type == "cuda":
        if _check_device_metadata():
            i = ids.cpu()
            bad = (i < 0) | (i >= num_pages)
            if bool(bad.any()):
                j = int(bad.nonzero()[0][0])
                raise ValueError(f"{name}[{j}] = page {int(i[j])} is out of range "
                                 f"(pool holds {num_pages} pages)")
        ids = ids.clamp(0, max(num_pages - 1, 0))
    return ids


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
               dst_ids: torch.Tensor, layout) -> torch.Tensor:
    """Copies page ``src_ids[i]`` of the pool ``src`` to page ``dst_ids[i]`` of ``dst``
    (both contiguous pools of ``layout``, distinct memory; destinations unique). Returns
    ``dst``."""
    src = _tensor("src", src)
    dst = _tensor("dst", dst)
    dev = _same_device(src=src, dst=dst)
    sp, dp = _pages("src", src, layout), _pages("dst", dst, layout)
    si = _ids("src_ids", src_ids, dev, sp)
    di = _ids("dst_ids", dst_ids, dev, dp)
    if si.shape != di.shape:
        raise ValueError(f"dst_ids: {di.shape[0]} entries for {si.shape[0]} source pages")
    if dev.type == "cuda" and si.shape[0] > 0 and (sp == 0 or dp == 0):
        raise ValueError("src: a pool with no page")
    _native.copy_pages(layout, src, dst, si, di, _stream(dev))
    _wrote(dst)
    return dst


def page_checksums(pool: torch.Tensor, ids: torch.Tensor, layout, *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The 64-bit checksum of each page ``ids[i]`` of the contiguous ``pool`` (the same
    checksum the cache tiers and transfers use), as ``int64 [n]`` holding the u64 bits
    (or into ``out``, int64 or uint64)."""
    pool = _tensor("pool", pool)
    dev = _same_device(pool=pool)
    pages = _pages("pool", pool, layout)
    ids = _ids("ids", ids, dev, pages)
    if out is None:
        out = torch.empty(ids.shape[0], dtype=torch.int64, device=dev)
    else:
        dtypes = (torch.int64,) + ((torch.uint64,) if hasattr(torch, "uint64") else ())
        _written("out", _tensor("out", out, dtypes=dtypes, shape=(ids.shape[0],)))
        _same_device(pool=pool, out=out)
    if dev.type == "cuda" and ids.shape[0] > 0 and pages == 0:
        raise ValueError("pool: holds no page")
    _native.page_checksums(layout, pool, ids, out, _stream(dev))
    _wrote(out)
    return out
