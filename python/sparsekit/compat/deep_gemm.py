"""DeepGEMM's lightning-indexer logits calls, on sparsekit's ``indexer_logits``.

Pinned to DeepGEMM ``54e22612`` (``csrc/apis/attention.hpp``, ``tests/test_attention.py``):
``fp8_mqa_logits``, ``fp8_paged_mqa_logits``, ``get_paged_mqa_logits_metadata`` (and
``get_num_sms`` / ``set_num_sms``) with the same argument names, shapes, dtypes and return
values. The logit is ``Σ_h weights[t, h] · ReLU(q[t, h] · k[s]) · k_scale[s]``.

Beyond the anchor:

- any head count and ``head_dim`` (a multiple of 16; the GPU kernel's maximum applies on
  CUDA) where DeepGEMM takes 32/64 heads (SM90) and head_dim 32/64/128; any ``block_kv``
  (DeepGEMM: 64 on SM90, 32/64 on SM100); ``q`` may also be bf16;
- ``context_lens`` of ``fp8_paged_mqa_logits`` may be 1-D ``[b]`` (the legacy causal
  form: row ``j`` of request ``b`` sees ``[0, L − next_n + j + 1)``, what SGLang passes)
  or 2-D ``[b, next_n]`` (each row its own length; DeepGEMM ``54e22612`` takes only this);
- the ``kv_cache`` may also be the flat ``uint8 [num_blocks, block_kv · (head_dim + 4)]``
  pool, and a block stride above a page is repacked;
- every logit outside a row's range is ``-inf`` whatever ``clean_logits`` says (DeepGEMM
  leaves those columns unwritten when ``clean_logits`` is false); the returned tensor is
  contiguous (DeepGEMM returns a view of a buffer whose rows are padded to 1 KiB).
- SM100's ``indices`` (varlen scheduling) is accepted and has no effect on the values.
- ``fp8_fp4_*``: fp8 (or bf16) queries only (``q`` as a tensor or ``(q, None)``); fp4
  queries (a ``q_scale`` tensor) raise ``NotImplementedError``. ``fp8_fp4_paged_mqa_logits``
  takes DeepSeek-V4's fp4 index-K cache too: ``uint8 [num_blocks, block_kv, 1,
  head_dim / 2 + head_dim / 32]`` (68 B per key at head_dim 128; per page all packed e2m1
  values, even element in the low nibble, then one ue8m0 scale byte per 32 values per
  key), told apart from fp8 (``head_dim + 4``) by that last dim; the logit is then
  ``Σ_h weights[t, h] · ReLU(q[t, h] · k[s])`` with ``k`` the dequantised key
  (``head_dim`` a multiple of 128). The flat 2-D pool form is read as fp8.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple, Union

import torch

from .. import ops
from .._native import IndexKLayout

__all__ = [
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "get_num_sms",
    "set_num_sms",
]

_num_sms: Optional[int] = None


def get_num_sms() -> int:
    """SMs of the current CUDA device (or as set by ``set_num_sms``); 1 without CUDA."""
    if _num_sms is not None:
        return _num_sms
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 1


def set_num_sms(num_sms: int) -> None:
    """Sets what ``get_num_sms`` returns (the kernels here do not depend on it)."""
    global _num_sms
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms: must be a positive int, got {num_sms!r}")
    _num_sms = num_sms


_Q_DTYPES = (torch.bfloat16,) + ops._FP8


def _q_bf16(name, q, ndim):
    q = ops._tensor(name, q, dtypes=_Q_DTYPES, ndim=ndim)
    return q.to(torch.bfloat16) if q.dtype != torch.bfloat16 else q


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int,
                                  indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The scheduling metadata DeepGEMM's paged kernel takes: ``int32 [num_sms + 1, 2]``.
    sparsekit's kernel schedules itself, so this only validates the arguments and returns
    a tensor of the anchor's shape (zeros) for ``fp8_paged_mqa_logits`` to ignore."""
    cl = ops._tensor("context_lens", context_lens, dtypes=(torch.int32,))
    if cl.dim() not in (1, 2):
        raise ValueError(f"context_lens: expected [b] or [b, next_n], got {list(cl.shape)}")
    if not isinstance(block_kv, int) or block_kv < 1:
        raise ValueError(f"block_kv: must be a positive int, got {block_kv!r}")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms: must be a positive int, got {num_sms!r}")
    if indices is not None:
        ops._tensor("indices", indices, dtypes=(torch.int32,), ndim=1)
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=cl.device)


def _paged_index_k(kv_cache: torch.Tensor, head_dim: int, allow_fp4: bool = False):
    """The fused index-K pool as contiguous pages: ``(bytes [num_blocks, page], block_kv,
    fp4)``; ``fp4`` (only when ``allow_fp4``) when a 4-D cache's last dim is the fp4 key's
    ``head_dim / 2 + head_dim / 32`` bytes."""
    kv = ops._tensor("kv_cache", kv_cache)
    if kv.dtype not in ops._CACHE_BYTES:
        raise TypeError(f"kv_cache: dtype {kv.dtype} is not torch.uint8 (or float8_e4m3fn)")
    token = head_dim + 4
    fp4_token = head_dim // 2 + head_dim // 32
    fp4 = False
    if kv.dim() == 4:
        nb, block_kv, h_kv, d4 = kv.shape
        if allow_fp4 and h_kv == 1 and d4 == fp4_token and head_dim % 32 == 0:
            fp4, token = True, fp4_token
        elif h_kv != 1 or d4 != token:
            also = f" (or {fp4_token} for fp4 keys)" if allow_fp4 else ""
            raise ValueError(
                f"kv_cache: expected [num_blocks, block_kv, 1, {token}]{also}, got {list(kv.shape)}"
            )
    elif kv.dim() == 2:
        nb, page = kv.shape
        if kv.element_size() * page % token:
            raise ValueError(
                f"kv_cache: a row of {page * kv.element_size()} bytes is not whole "
                f"{token}-byte tokens"
            )
        block_kv = kv.element_size() * page // token
    else:
        raise ValueError(
            f"kv_cache: expected [num_blocks, block_kv, 1, {token}] or "
            f"[num_blocks, block_kv * {token}], got {list(kv.shape)}"
        )
    page = block_kv * token
    if not kv.is_contiguous():
        if kv.dim() == 4 and kv.stride(1) == token and kv.stride(3) == 1 and kv.stride(0) >= page:
            warnings.warn("kv_cache: pages with a stride above the page size are repacked "
                          "(a copy of the pool per call)", stacklevel=3)
        kv = kv.contiguous()
    return kv.view(torch.uint8).reshape(nb, page), block_kv, fp4


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor,
                         schedule_meta: torch.Tensor, max_context_len: int,
                         clean_logits: bool = False,
                         indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indexer logits over the paged fp8 index-K cache (decode form).

    ``q``: ``float8_e4m3fn [b, next_n, heads, head_dim]``; ``kv_cache``: ``uint8
    [num_blocks, block_kv, 1, head_dim + 4]`` (per page: all e4m3 values, then the f32
    scales); ``weights``: ``float32 [b · next_n, heads]``; ``context_lens``: ``int32
    [b, next_n]`` (or ``[b]``, see the module doc); ``block_table``: ``int32 [b,
    max_blocks]``; ``schedule_meta``: from ``get_paged_mqa_logits_metadata`` (ignored).
    Returns ``float32 [b · next_n, max_context_len]``, ``-inf`` outside each row's range.
    """
    return _paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                             max_context_len, indices, allow_fp4=False)


def _paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                      max_context_len, indices, *, allow_fp4: bool) -> torch.Tensor:
    q = _q_bf16("q", q, 4)
    b, next_n, h, d = q.shape
    cache, block_kv, fp4 = _paged_index_k(kv_cache, d, allow_fp4)
    weights = ops._tensor("weights", weights, dtypes=(torch.float32,), shape=(b * next_n, h))
    cl = ops._tensor("context_lens", context_lens, dtypes=(torch.int32,))
    if cl.dim() == 2 and tuple(cl.shape) != (b, next_n):
        raise ValueError(f"context_lens: expected [{b}, {next_n}], got {list(cl.shape)}")
    if cl.dim() == 1 and cl.shape[0] != b:
        raise ValueError(f"context_lens: expected [{b}], got {list(cl.shape)}")
    bt = ops._tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    if bt.shape[0] != b:
        raise ValueError(f"block_table: {bt.shape[0]} rows for batch {b}")
    ops._tensor("schedule_meta", schedule_meta, dtypes=(torch.int32,), ndim=2)
    if not isinstance(max_context_len, int) or max_context_len < 0:
        raise ValueError(f"max_context_len: must be a non-negative int, got {max_context_len!r}")
    if indices is not None:
        ops._tensor("indices", indices, dtypes=(torch.int32,), ndim=1)
    try:
        layout = IndexKLayout("fp4_e2m1" if fp4 else "fp8_e4m3", d, block_kv)
    except ValueError as e:
        raise ValueError(f"kv_cache: {e}") from None
    rows = ops.decode_rows(cl, next_n)
    if cl.device.type == "cpu":
        over = rows[:, 2] > max_context_len
        if bool(over.any()):
            i = int(over.nonzero()[0][0])
            raise ValueError(
                f"context_lens: row {i} sees {int(rows[i, 2])} positions, above "
                f"max_context_len={max_context_len}"
            )
    return ops.indexer_logits(q.reshape(b * next_n, h, d), weights, cache, bt, layout,
                              rows=rows, row_stride=max_context_len)


def fp8_mqa_logits(q: torch.Tensor, kv: Tuple[torch.Tensor, torch.Tensor],
                   weights: torch.Tensor, cu_seq_len_k_start: torch.Tensor,
                   cu_seq_len_k_end: torch.Tensor, clean_logits: bool = True,
                   max_seqlen_k: int = 0) -> torch.Tensor:
    """Indexer logits over contiguous (ragged, prefill) fp8 keys.

    ``q``: ``float8_e4m3fn [seq_len, heads, head_dim]``; ``kv``: ``(k float8_e4m3fn
    [seq_len_kv, head_dim], k_scale float32 [seq_len_kv])``; ``weights``: ``float32
    [seq_len, heads]``; row ``i`` sees keys ``[cu_seq_len_k_start[i],
    cu_seq_len_k_end[i])`` (``int32 [seq_len]``). Returns ``float32 [seq_len,
    seq_len_kv]`` (``-inf`` outside each row's range), or with ``max_seqlen_k > 0`` the
    compressed ``[seq_len, max_seqlen_k]`` whose column ``j`` of row ``i`` is key
    ``cu_seq_len_k_start[i] + j`` (``-inf`` past the row's length).
    """
    q = _q_bf16("q", q, 3)
    s, h, d = q.shape
    if not (isinstance(kv, (tuple, list)) and len(kv) == 2):
        raise TypeError("kv: expected a tuple (k, k_scale)")
    k = ops._tensor("kv[0]", kv[0], dtypes=_Q_DTYPES, ndim=2)
    if k.shape[1] != d:
        raise ValueError(f"kv[0]: head_dim {k.shape[1]} is not q's {d}")
    n_kv = k.shape[0]
    sf = ops._tensor("kv[1]", kv[1], dtypes=(torch.float32,), shape=(n_kv,))
    weights = ops._tensor("weights", weights, dtypes=(torch.float32,), shape=(s, h))
    ks = ops._tensor("cu_seq_len_k_start", cu_seq_len_k_start,
                     dtypes=(torch.int32, torch.int64), shape=(s,)).to(torch.int64)
    ke = ops._tensor("cu_seq_len_k_end", cu_seq_len_k_end,
                     dtypes=(torch.int32, torch.int64), shape=(s,)).to(torch.int64)
    if not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k: must be a non-negative int, got {max_seqlen_k!r}")
    dev = ops._same_device(q=q, k=k, k_scale=sf, weights=weights, ks=ks, ke=ke)
    if dev.type == "cpu":
        bad = (ks < 0) | (ks > ke) | (ke > n_kv)
        if bool(bad.any()):
            i = int(bad.nonzero()[0][0])
            raise ValueError(
                f"cu_seq_len_k_start[{i}]: range [{int(ks[i])}, {int(ke[i])}) is not "
                f"inside the {n_kv} keys"
            )
    if k.dtype == torch.bfloat16:
        raise TypeError("kv[0]: the keys must be float8_e4m3fn (with their scales)")
    kbytes = k.contiguous().view(torch.uint8)
    sbytes = sf.contiguous().view(torch.uint8).reshape(n_kv, 4)
    if max_seqlen_k == 0:
        # Pages of 64 keys (values, then scales), one request over all of them.
        page = 64
        n_pages = max(1, -(-n_kv // page))
        pad = n_pages * page - n_kv
        vals = torch.nn.functional.pad(kbytes, (0, 0, 0, pad)).reshape(n_pages, page * d)
        scs = torch.nn.functional.pad(sbytes, (0, 0, 0, pad)).reshape(n_pages, page * 4)
        cache = torch.cat([vals, scs], dim=1).contiguous()
        table = torch.arange(n_pages, dtype=torch.int32, device=dev)[None, :]
        rows = ops._narrow_i32("cu_seq_len_k_start/end",
                               torch.stack([torch.zeros_like(ks), ks, ke], dim=1))
        layout = IndexKLayout("fp8_e4m3", d, page)
        return ops.indexer_logits(q, weights, cache, table, layout, rows=rows,
                                  row_stride=n_kv)
    # Compressed: pages of one key; row i's page table lists keys ks[i], ks[i] + 1, ...
    cache = torch.cat([kbytes, sbytes], dim=1).contiguous()
    if n_kv == 0:
        cache = torch.zeros((1, d + 4), dtype=torch.uint8, device=dev)
    j = torch.arange(max_seqlen_k, dtype=torch.int64, device=dev)[None, :]
    table = (ks[:, None] + j).clamp(0, max(n_kv - 1, 0)).to(torch.int32)
    lens = (ke - ks).clamp(0, max_seqlen_k)
    rows = torch.stack([torch.arange(s, dtype=torch.int64, device=dev),
                        torch.zeros_like(lens), lens], dim=1).to(torch.int32)
    layout = IndexKLayout("fp8_e4m3", d, 1)
    return ops.indexer_logits(q, weights, cache, table, layout, rows=rows,
                              row_stride=max_seqlen_k)


def _fp8_only(name, q):
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            raise TypeError(f"{name}: expected a tensor or a tuple (q, q_scale)")
        if q[1] is not None:
            raise NotImplementedError(
                f"{name}: fp4 queries (a q_scale tensor) are not in sparsekit (fp4 *keys* "
                "are, in fp8_fp4_paged_mqa_logits); pass fp8 or bf16 queries (q, None)"
            )
        return q[0]
    return q


def fp8_fp4_mqa_logits(q: Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]],
                       kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                       clean_logits: bool = True, max_seqlen_k: int = 0,
                       logits_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8_mqa_logits`` with DeepGEMM's newer signature (fp8 queries only;
    ``logits_dtype`` float32 or bfloat16)."""
    out = fp8_mqa_logits(_fp8_only("q", q), kv, weights, cu_seq_len_k_start,
                         cu_seq_len_k_end, clean_logits, max_seqlen_k)
    return _cast_logits(out, logits_dtype)


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                             max_context_len: int, clean_logits: bool = False,
                             logits_dtype: torch.dtype = torch.float32,
                             indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fp8_paged_mqa_logits`` with DeepGEMM's newer signature (fp8 or bf16 queries only),
    over an fp8 or (DeepSeek-V4) fp4 index-K cache, see the module doc."""
    out = _paged_mqa_logits(_fp8_only("q", q), kv_cache, weights, context_lens, block_table,
                            schedule_meta, max_context_len, indices, allow_fp4=True)
    return _cast_logits(out, logits_dtype)


def _cast_logits(out, logits_dtype):
    if logits_dtype == torch.float32:
        return out
    if logits_dtype == torch.bfloat16:
        return out.to(torch.bfloat16)
    raise TypeError(f"logits_dtype: {logits_dtype} is not torch.float32 or torch.bfloat16")
