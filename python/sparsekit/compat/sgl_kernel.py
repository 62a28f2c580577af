"""sgl-kernel's DSA top-k calls, on sparsekit's exact top-k.

Signatures and conventions of ``sgl_kernel.top_k`` as SGLang's DSA (NSA) backend calls
them (``sgl-kernel/python/sgl_kernel/top_k.py`` and ``csrc/elementwise/topk.cu``):

- row ``i`` of ``score`` (``float32 [B, L]``, unit column stride) is searched over its
  section ``[row_starts[i], row_starts[i] + lengths[i])`` (``row_starts`` ``None``: 0);
- a row with ``lengths[i] <= topk`` yields ``0, 1, …, lengths[i] − 1`` in order, then
  ``-1``, whatever the scores (the anchor's fast path, kept as is);
- a longer row yields the top-``topk`` positions *relative to the row start*.

Beyond the anchor: any ``topk`` (sgl-kernel asserts 2048); the selection is **exact**
for every input — ties go to the lower position and the positions come in ascending
order, where sgl-kernel's radix select is unordered and, with more than its shared-memory
capacity of candidates tied at the threshold, can return a wrong set; ``-inf`` and NaN
scores are never selected (a long row with fewer than ``topk`` finite scores is padded
with ``-1``, where the anchor returns arbitrary masked positions); CPU tensors run too.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops

__all__ = [
    "fast_topk",
    "fast_topk_v2",
    "fast_topk_transform_fused",
    "fast_topk_transform_ragged_fused",
    "deepseek_v4_topk_transform_512",
]


def fast_topk(values, topk, dim):
    """sgl-kernel's plain wrapper (torch.max for k = 1, else torch.topk)."""
    if topk == 1:
        return torch.max(values, dim=dim, keepdim=True)
    return torch.topk(values, topk, dim=dim)


def _lengths(name, t, b, device):
    t = ops._tensor(name, t, dtypes=(torch.int32, torch.int64), ndim=1)
    if t.shape[0] != b:
        raise ValueError(f"{name}: {t.shape[0]} entries for {b} rows of score")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but score is on {device}")
    return t.to(torch.int64)


def _overlap(a, b):
    """Whether the bytes of two contiguous tensors overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _relative_topk(score, lengths, topk, row_starts):
    """``int32 [B, topk]``: per row, positions relative to its start, anchor semantics."""
    score = ops._tensor("score", score, dtypes=(torch.float32,), ndim=2)
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: must be a positive int, got {topk!r}")
    b, width = score.shape
    dev = score.device
    lens = _lengths("lengths", lengths, b, dev)
    starts = (torch.zeros(b, dtype=torch.int64, device=dev) if row_starts is None
              else _lengths("row_starts", row_starts, b, dev))
    if dev.type == "cpu":
        bad = (lens < 0) | (starts < 0) | (starts + lens > width)
        if bool(bad.any()):
            i = int(bad.nonzero()[0][0])
            raise ValueError(
                f"lengths[{i}]: section [{int(starts[i])}, {int(starts[i] + lens[i])}) "
                f"is not inside the {width} columns of score"
            )
    ends = starts + lens.clamp_min(0)
    rows = ops._narrow_i32("row_starts/lengths", torch.stack(
        [torch.arange(b, device=dev, dtype=torch.int64), starts, ends], dim=1))
    # A section of at most `topk` columns takes all of them in order (the anchor's rule
    # for short rows), which is our top-k's `take_all_short_rows`.
    pos = ops.topk(score, topk, rows=rows, take_all_short_rows=True)
    if row_starts is None:
        return pos
    return torch.where(pos >= 0, pos - rows[:, 1:2], pos)


def fast_topk_v2(score: torch.Tensor, lengths: torch.Tensor, topk: int,
                 row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-``topk`` indices of each row's section of ``score`` (``[B, L]``), relative to
    the row start: ``int32 [B, topk]``, ``-1`` padded."""
    return _relative_topk(score, lengths, topk, row_starts)


def fast_topk_transform_fused(score: torch.Tensor, lengths: torch.Tensor,
                              page_table_size_1: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              topk: int,
                              row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-k, then each relative index ``p`` of row ``i`` becomes
    ``page_table_size_1[r, p]`` (page size 1), ``r`` being the request of row ``i``: row
    ``i`` itself when ``row_starts`` is None and there are as many requests as rows
    (decode), else the ``r`` with ``cu_seqlens_q[r] <= i < cu_seqlens_q[r + 1]``."""
    rel = _relative_topk(score, lengths, topk, row_starts)
    b = rel.shape[0]
    dev = rel.device
    pt = ops._tensor("page_table_size_1", page_table_size_1,
                     dtypes=(torch.int32, torch.int64), ndim=2)
    cu = ops._tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32, torch.int64), ndim=1)
    for name, t in (("page_table_size_1", pt), ("cu_seqlens_q", cu)):
        if t.device != dev:
            raise ValueError(f"{name}: on {t.device}, but score is on {dev}")
    n_req = cu.shape[0] - 1
    if n_req < 0 or pt.shape[0] != n_req:
        raise ValueError(
            f"page_table_size_1: {pt.shape[0]} rows for {max(n_req, 0)} requests of cu_seqlens_q"
        )
    if n_req > b:
        raise ValueError(f"cu_seqlens_q: {n_req} requests for {b} rows of score")
    if row_starts is None and n_req == b:
        req = torch.arange(b, device=dev, dtype=torch.int64)
    else:
        i = torch.arange(b, device=dev, dtype=cu.dtype)
        req = (torch.searchsorted(cu.contiguous(), i, right=True) - 1).clamp(0, max(n_req - 1, 0))
    width = pt.shape[1]
    if dev.type == "cpu" and width == 0 and bool((rel >= 0).any()):
        raise ValueError("page_table_size_1: has no columns")
    if dev.type == "cpu" and bool((rel >= width).any()):
        raise ValueError(
            f"page_table_size_1: a selected position is past its {width} columns"
        )
    safe = rel.clamp(0, max(width - 1, 0)).to(torch.int64)
    rows = pt.index_select(0, req) if n_req > 0 else torch.zeros((b, max(width, 1)), dtype=pt.dtype, device=dev)
    if width == 0:
        return torch.full_like(rel, -1)
    # Only the entries the top-k selected are narrowed (an unused row may hold anything).
    got = torch.where(rel >= 0, torch.gather(rows, 1, safe).to(torch.int64), rel.to(torch.int64))
    # Handed back to the caller: on CUDA one past int32 is -1 (none).
    return ops._narrow_i32("page_table_size_1", got, above=-1).contiguous()


def fast_topk_transform_ragged_fused(score: torch.Tensor, lengths: torch.Tensor,
                                     topk_indices_offset: torch.Tensor, topk: int,
                                     row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-k, then each relative index ``p`` of row ``i`` becomes
    ``p + topk_indices_offset[i]`` (an index into ragged, non-paged KV); ``-1`` stays."""
    rel = _relative_topk(score, lengths, topk, row_starts)
    off = _lengths("topk_indices_offset", topk_indices_offset, rel.shape[0], rel.device)
    idx = torch.where(rel >= 0, rel.to(torch.int64) + off[:, None], rel.to(torch.int64))
    return ops._narrow_i32("index + topk_indices_offset", idx, above=-1).contiguous()


def deepseek_v4_topk_transform_512(scores: torch.Tensor, seq_lens: torch.Tensor,
                                   page_table: torch.Tensor, page_indices: torch.Tensor,
                                   page_size: int,
                                   raw_indices: Optional[torch.Tensor] = None) -> None:
    """DeepSeek-V4's indexer top-k with the paged transform (SGLang's
    ``topk_transform_512``): per row ``b``, positions ``[0, seq_lens[b])`` of ``scores``
    (``float32 [B, max_seq_len]``); a row no longer than ``k = page_indices.shape[1]``
    takes ``0 … len − 1`` in order (whatever the scores), a longer one its exact top-``k``
    (ascending, ties to the lower position, ``-inf``/NaN never selected; the anchor's is
    unordered); raw position ``r`` becomes
    ``page_table[b, r // page_size] * page_size + r % page_size`` in ``page_indices``
    (``int32 [B, k]``, written; ``-1`` padding), and the raw positions go to
    ``raw_indices`` when given. One sparsekit ``topk`` launch with the V4 transform
    (``take_all_short_rows``) and the slot output does it (a second, position-output one
    fills ``raw_indices``). Every page of a row's ``[0, seq_lens[b])`` must be mapped (on
    CPU a ``-1`` page there is a ``ValueError``). Beyond the anchor: any ``k`` (it
    supports up to 1024) and any ``page_size`` (it requires a power of two)."""
    pi = ops._tensor("page_indices", page_indices, dtypes=(torch.int32,), ndim=2)
    ops._written("page_indices", pi)
    k = pi.shape[1]
    if k < 1:
        raise ValueError("page_indices: has no columns (k = 0)")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: must be a positive int, got {page_size!r}")
    scores = ops._tensor("scores", scores, dtypes=(torch.float32,), ndim=2)
    b, width = scores.shape
    dev = scores.device
    if pi.shape[0] != b:
        raise ValueError(f"page_indices: {pi.shape[0]} rows for {b} rows of scores")
    if pi.device != dev:
        raise ValueError(f"page_indices: on {pi.device}, but scores is on {dev}")
    pt = ops._tensor("page_table", page_table, dtypes=(torch.int32, torch.int64), ndim=2)
    if pt.shape[0] != b:
        raise ValueError(f"page_table: {pt.shape[0]} rows for {b} rows of scores")
    if pt.device != dev:
        raise ValueError(f"page_table: on {pt.device}, but scores is on {dev}")
    lens = _lengths("seq_lens", seq_lens, b, dev)
    cols = pt.shape[1]
    if dev.type == "cpu" and b:
        bad = (lens < 0) | (lens > width)
        if bool(bad.any()):
            i = int(bad.nonzero()[0][0])
            raise ValueError(f"seq_lens[{i}]: {int(lens[i])} is outside the {width} columns "
                             "of scores")
        over = lens > cols * page_size
        if bool(over.any()):
            i = int(over.nonzero()[0][0])
            raise ValueError(f"page_table: row {i} has {cols} pages of {page_size}, "
                             f"seq_lens[{i}] = {int(lens[i])} needs more")
    ri = None
    if raw_indices is not None:
        ri = ops._tensor("raw_indices", raw_indices, dtypes=(torch.int32,), shape=(b, k))
        ops._written("raw_indices", ri)
        if ri.device == pi.device and ri.numel() and _overlap(ri, pi):
            raise ValueError("raw_indices: shares memory with page_indices (the second "
                             "top-k would overwrite the slots)")
    rows = ops._narrow_i32("seq_lens", torch.stack(
        [torch.arange(b, device=dev, dtype=torch.int64),
         torch.zeros(b, device=dev, dtype=torch.int64), lens.clamp_min(0)], dim=1))
    ops.topk(scores, k, rows=rows, page_table=pt, page_size=page_size, out=pi,
             take_all_short_rows=True)
    if ri is not None:
        ops.topk(scores, k, rows=rows, out=ri, take_all_short_rows=True)
