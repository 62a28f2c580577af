"""FlashMLA's sparse attention calls, on sparsekit's ``sparse_mla`` (DeepSeek-V3.2) and
``sparse_mla_v4`` (DeepSeek-V4).

Pinned to FlashMLA ``9241ae3e`` (``flash_mla/flash_mla_interface.py``, ``tests/ref.py``,
``tests/quant.py``): ``get_mla_metadata``, ``flash_mla_with_kvcache`` (sparse form),
``flash_mla_sparse_fwd``, with FlashMLA's conventions: ``lse`` in natural log, ``+inf``
for a query with no valid index (its output 0), decode ``lse`` laid out ``[b, h_q, s_q]``,
prefill ``lse`` ``[s_q, h_q]``; an attention sink scales the output by
``1 / (1 + exp(sink − lse))`` and leaves ``lse`` as it was; indices are
``page · page_block_size + offset``.

Beyond the anchor:

- any ``h_q`` (FlashMLA: 64 or 128) and any ``topk`` / ``extra_topk`` (FlashMLA:
  multiples of 64), any ``page_block_size``; CPU tensors run too;
- ``flash_mla_with_kvcache``'s KV cache may also be bf16 (``[num_blocks, block, 1,
  d_qk]``), and any ``d_qk = head_dim_v + rope`` with ``head_dim_v`` a multiple of 128
  (fp8) or 16 (bf16), rope a multiple of 16;
- an index outside the cache (any negative value, or past its last slot) is skipped like
  ``-1``, where FlashMLA's decode kernel would read out of bounds;
- a KV cache whose block stride is larger than a block (FlashMLA's tests make one) is read
  in place when the stride is whole tokens, else repacked.

DeepSeek-V4 (``d_qk = head_dim_v = 512``: K = V is the whole 512-d row, rope included):
``flash_mla_with_kvcache`` takes the MODEL1 fp8 KV cache (``is_fp8_kvcache=True``:
``[num_blocks, page_block_size, 1, 584]`` float8_e4m3fn/uint8 whose block stride is the
MODEL1 page, ``ceil(page_block_size · 584 / 576) · 576`` bytes — per block the 576-B rows
of 448 e4m3 NoPE in 7 tiles of 64 + 64 bf16 RoPE, then 8 B of ue8m0 tile scales per token,
then padding — a contiguous tensor when ``page_block_size · 584`` is already a multiple of
576) or V4's bf16 KV (``[num_blocks, page_block_size, 1, 512]`` bf16), with
``attn_sink``, ``topk_length``, ``extra_k_cache`` / ``extra_indices_in_kvcache`` /
``extra_topk_length`` (the extra cache in either V4 format, its own page size): one
``sparse_mla_v4`` call attends both caches in one softmax. ``flash_mla_sparse_fwd`` with
``d_v = d_qk = 512`` (bf16 ``kv``, K = V) runs ``sparse_mla_v4`` too.

With the V3.2 layouts the V4 *arguments* work as well: the extra cache is attended by a
second ``sparse_mla`` call and the two are merged through their ``lse`` (exact up to one
more bf16 rounding of the output).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Tuple

import torch

from .. import ops
from .._native import KvLayout

__all__ = [
    "FlashMLASchedMeta",
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd",
]

_V4_D = 512
# FlashMLA's MODEL1 token: 576-B row + 8 B of scales (the tensor's last dim).
_MODEL1_TOKEN = 584


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's scheduler metadata object. sparsekit schedules itself: this only records
    the first call's configuration, and a later call with other shapes is refused, as
    FlashMLA refuses it."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """A fresh ``FlashMLASchedMeta`` (and ``None``), as FlashMLA returns; the arguments of
    the older interface are accepted and ignored."""
    return FlashMLASchedMeta(), None


def _kv_layout(name: str, cache: torch.Tensor, d_qk: int, d_v: int, is_fp8: bool):
    """The KvLayout of a ``[num_blocks, block, 1, token]`` cache, and its byte view of
    whole pages: ``(layout, pages uint8 [num_pages, page_bytes], remap)`` where ``remap``
    turns FlashMLA indices into slots of those pages (a padded block stride makes pages
    of more tokens)."""
    c = ops._tensor(name, cache)
    if c.dim() != 4:
        raise ValueError(f"{name}: expected [num_blocks, page_block_size, 1, d], got {list(c.shape)}")
    nb, block, h_k, last = c.shape
    if h_k != 1:
        raise ValueError(f"{name}: num_heads_k must be 1 (MLA), got {h_k}")
    rope = d_qk - d_v
    if rope == 0:
        raise ValueError(f"head_dim_v: {d_v} = q's head dim is DeepSeek-V4's form, which "
                         f"needs d_qk = head_dim_v = {_V4_D}")
    if rope < 0:
        raise ValueError(f"head_dim_v: {d_v} is above q's head dim {d_qk}")
    if is_fp8:
        if c.dtype not in ops._CACHE_BYTES:
            raise TypeError(f"{name}: an fp8 cache must be float8_e4m3fn or uint8, got {c.dtype}")
        try:
            layout = KvLayout("fp8_ds_mla", d_v, rope, block)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if last != layout.bytes_per_token:
            raise ValueError(
                f"{name}: {last} bytes per token, the fp8_ds_mla layout of d_qk={d_qk}, "
                f"head_dim_v={d_v} has {layout.bytes_per_token}"
            )
        token_elems = last
    else:
        if c.dtype != torch.bfloat16:
            raise TypeError(f"{name}: a non-fp8 cache must be bfloat16, got {c.dtype} "
                            "(set is_fp8_kvcache=True for the fp8 format)")
        if last != d_qk:
            raise ValueError(f"{name}: last dim {last} is not q's head dim {d_qk}")
        try:
            layout = KvLayout("bf16", d_v, rope, block)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        token_elems = last
    tok_bytes = layout.bytes_per_token

    def identity(idx):
        return idx

    if c.is_contiguous():
        return layout, c.view(torch.uint8).reshape(nb, -1) if nb else c.view(torch.uint8).reshape(0, layout.bytes_per_page), identity
    s0, s1, s3 = c.stride(0), c.stride(1), c.stride(3)
    stride_bytes = s0 * c.element_size()
    if (s1 == token_elems and s3 == 1 and stride_bytes % tok_bytes == 0
            and stride_bytes >= block * tok_bytes):
        per = stride_bytes // tok_bytes
        need = (c.storage_offset() * c.element_size()) + nb * stride_bytes
        if c.untyped_storage().nbytes() >= need and per <= 4096:
            wide = KvLayout(layout.dtype, d_v, rope, per)
            flat = torch.as_strided(c, (nb, per * token_elems), (s0, 1)).view(torch.uint8)

            def remap(idx):
                return torch.where(idx >= 0, (idx // block) * per + idx % block, idx)

            return wide, flat.reshape(nb, -1), remap
    warnings.warn(f"{name}: a non-contiguous KV cache is repacked (a copy per call)",
                  stacklevel=3)
    packed = c.contiguous()
    return layout, packed.view(torch.uint8).reshape(nb, -1), identity


def _kv_layout_v4(name: str, cache: torch.Tensor, is_fp8: bool):
    """The V4 KvLayout of a FlashMLA ``[num_blocks, page_block_size, 1, 584 | 512]`` cache
    and its pages: ``(layout, pages uint8 [num_blocks, page_bytes], remap)``."""
    c = ops._tensor(name, cache)
    if c.dim() != 4:
        raise ValueError(f"{name}: expected [num_blocks, page_block_size, 1, d], got {list(c.shape)}")
    nb, block, h_k, last = c.shape
    if h_k != 1:
        raise ValueError(f"{name}: num_heads_k must be 1 (MLA), got {h_k}")

    def identity(idx):
        return idx

    if is_fp8:
        if c.dtype not in ops._CACHE_BYTES:
            raise TypeError(f"{name}: a MODEL1 fp8 cache must be float8_e4m3fn or uint8, got {c.dtype}")
        if last != _MODEL1_TOKEN:
            raise ValueError(f"{name}: a MODEL1 fp8 cache has {_MODEL1_TOKEN} bytes per token "
                             f"(last dim), got {last}")
        try:
            layout = KvLayout("model1_fp8", page_size=block)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        page = layout.bytes_per_page
        if nb == 0:
            return layout, torch.zeros((0, page), dtype=torch.uint8, device=c.device), identity
        s0 = c.stride(0) if nb > 1 else page
        if (block > 1 and c.stride(1) != last) or c.stride(3) != 1:
            raise ValueError(f"{name}: tokens must be packed inside a block (strides {list(c.stride())})")
        if s0 < page:
            raise ValueError(
                f"{name}: block stride {s0} bytes is below the MODEL1 page of {page} bytes at "
                f"page_block_size {block} (rows of 576 B, the 8-B scales of each token after "
                "them, padded to a multiple of 576 B)")
        need = c.storage_offset() + (nb - 1) * s0 + page
        if c.untyped_storage().nbytes() < need:
            raise ValueError(f"{name}: its storage holds {c.untyped_storage().nbytes()} bytes, "
                             f"{nb} MODEL1 pages at stride {s0} need {need}")
        flat = torch.as_strided(c.view(torch.uint8), (nb, page), (s0, 1))
        if s0 != page:
            warnings.warn(f"{name}: a block stride above the MODEL1 page is repacked (a copy per call)",
                          stacklevel=3)
            flat = flat.contiguous()
        return layout, flat, identity
    if c.dtype != torch.bfloat16:
        raise TypeError(f"{name}: a non-fp8 cache must be bfloat16, got {c.dtype} "
                        "(set is_fp8_kvcache=True for the MODEL1 fp8 format)")
    if last != _V4_D:
        raise ValueError(f"{name}: last dim {last} is not q's head dim {_V4_D}")
    try:
        layout = KvLayout("bf16_512", page_size=block)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if c.is_contiguous():
        return layout, c.view(torch.uint8).reshape(nb, layout.bytes_per_page), identity
    s0, s1, s3 = c.stride(0), c.stride(1), c.stride(3)
    if s1 == last and s3 == 1 and s0 % last == 0 and s0 >= block * last:
        per = s0 // last
        need = c.storage_offset() + nb * s0
        if c.untyped_storage().nbytes() >= need * 2 and per <= 4096:
            wide = KvLayout("bf16_512", page_size=per)
            flat = torch.as_strided(c, (nb, per * last), (s0, 1)).view(torch.uint8)

            def remap(idx):
                return torch.where(idx >= 0, (idx // block) * per + idx % block, idx)

            return wide, flat, remap
    warnings.warn(f"{name}: a non-contiguous KV cache is repacked (a copy per call)",
                  stacklevel=3)
    return layout, c.contiguous().view(torch.uint8).reshape(nb, -1), identity


def _v4_indices(name, idx, cache, remap, lengths, length_name):
    """FlashMLA indices ``[T, topk]`` of one V4 cache as sparsekit slots (outside the cache:
    -1) and the lengths ``[T]`` checked (CPU) against ``topk``."""
    capacity = cache.shape[0] * cache.shape[1]
    i = idx.to(torch.int64)
    i = torch.where((i >= 0) & (i < capacity), i, torch.full_like(i, -1))
    i = remap(i).to(torch.int32)
    _check_lengths(length_name, lengths, i.shape[1], name)
    return i


def _check_lengths(length_name, lengths, topk, name):
    """On CPU, a ``ValueError`` unless every length (``[T]``, or None) is in ``[0, topk]``
    (FlashMLA's contract; on CUDA the lengths mask the indices as they are)."""
    if lengths is not None and lengths.device.type == "cpu" and lengths.numel():
        bad = (lengths < 0) | (lengths > topk)
        if bool(bad.any()):
            r = int(bad.nonzero()[0][0])
            raise ValueError(f"{length_name}: {int(lengths[r])} (for query {r}) is outside "
                             f"[0, {topk}] (the top-k of {name})")


def _valid(idx: torch.Tensor, capacity: int, length: Optional[torch.Tensor]) -> torch.Tensor:
    """Indices outside the cache or past the row's length become -1."""
    ok = (idx >= 0) & (idx < capacity)
    if length is not None:
        j = torch.arange(idx.shape[-1], device=idx.device)
        ok &= j.view(*([1] * (idx.dim() - 1)), -1) < length.view(
            *length.shape, *([1] * (idx.dim() - length.dim())))
    return torch.where(ok, idx, torch.full_like(idx, -1))


def _attend(q_t, cache_name, cache, indices, length, d_qk, d_v, is_fp8, scale):
    """sparse_mla over one cache: q_t ``[T, h, d_qk]``, indices ``[T, topk]``,
    length ``[T]`` or None. Returns (out bf16, lse f32 with -inf for empty)."""
    layout, pages, remap = _kv_layout(cache_name, cache, d_qk, d_v, is_fp8)
    capacity = cache.shape[0] * cache.shape[1]
    idx = _valid(indices.to(torch.int64), capacity, length)
    idx = remap(idx).to(torch.int32)
    return ops.sparse_mla(q_t, pages, idx, layout, scale)


def _merge(out1, lse1, out2, lse2):
    """Softmax-merges two partial attentions by their lse (natural log, -inf = empty)."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w1 = torch.where(lse1 == float("-inf"), torch.zeros_like(lse1), torch.exp(lse1 - safe))
    w2 = torch.where(lse2 == float("-inf"), torch.zeros_like(lse2), torch.exp(lse2 - safe))
    out = out1.float() * w1[..., None] + out2.float() * w2[..., None]
    return out, lse


def _sink(out_f32, lse, attn_sink, h):
    sink = ops._tensor("attn_sink", attn_sink, dtypes=(torch.float32,), shape=(h,))
    if sink.device != out_f32.device:
        raise ValueError(f"attn_sink: on {sink.device}, but q is on {out_f32.device}")
    if sink.device.type == "cpu" and bool(sink.isnan().any()):
        # As sparse_mla_v4 refuses it on the V4 path.
        raise ValueError(f"attn_sink[{int(sink.isnan().nonzero()[0][0])}] is NaN")
    factor = torch.sigmoid(lse - sink[None, :])  # 1 / (1 + exp(sink - lse))
    factor = torch.where(lse == float("-inf"), torch.zeros_like(factor), factor)
    return out_f32 * factor[..., None]


def _attend_v4(q_t, k_cache, idx, tl, extra_k_cache, e_idx, etl, attn_sink, is_fp8, scale):
    """One ``sparse_mla_v4`` call over the main (and extra) V4 cache: ``(out bf16 [T, h,
    512], lse float32 [T, h])``, FlashMLA's conventions already (``+inf`` for an empty
    query, lse without the sink)."""
    layout, pages, remap = _kv_layout_v4("k_cache", k_cache, is_fp8)
    i = _v4_indices("indices", idx, k_cache, remap, tl, "topk_length")
    extra = {}
    if e_idx is not None:
        e_layout, e_pages, e_remap = _kv_layout_v4("extra_k_cache", extra_k_cache, is_fp8)
        ei = _v4_indices("extra_indices_in_kvcache", e_idx, extra_k_cache, e_remap, etl,
                         "extra_topk_length")
        extra = dict(extra_cache=e_pages, extra_indices=ei, extra_layout=e_layout,
                     extra_lengths=etl)
    sink = None
    if attn_sink is not None:
        sink = ops._tensor("attn_sink", attn_sink, dtypes=(torch.float32,),
                           shape=(q_t.shape[1],))
    return ops.sparse_mla_v4(q_t, pages, i, layout, scale,
                             lengths=tl,
                             attn_sink=sink, **extra)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse decoding attention (FlashMLA's sparse form).

    ``q``: ``bf16 [b, s_q, h_q, d_qk]``; ``k_cache``: ``[num_blocks, page_block_size, 1,
    656]`` float8_e4m3fn/uint8 (V3.2 ``fp8_ds_mla``: 512 e4m3, 4 f32 tile scales, 64 bf16
    RoPE; ``is_fp8_kvcache=True``) or bf16 ``[…, d_qk]``; with ``d_qk = head_dim_v = 512``
    DeepSeek-V4's MODEL1 fp8 ``[…, 584]`` (block stride the padded MODEL1 page, see the
    module doc) or bf16 ``[…, 512]``, K = V; ``indices``: ``int32 [b, s_q,
    topk]`` slots ``page · page_block_size + offset``, ``-1`` invalid; ``topk_length``
    ``[b]``: only the first ``topk_length[i]`` indices of batch ``i`` count; the ``extra_*``
    arguments add a second cache attended together with the first; ``attn_sink`` ``[h_q]``.
    Returns ``(out bf16 [b, s_q, h_q, head_dim_v], lse float32 [b, h_q, s_q])``.
    ``block_table``, ``cache_seqlens`` and ``causal`` belong to the dense form, which
    sparsekit does not provide (``indices=None`` raises ``NotImplementedError``).
    """
    sched = tile_scheduler_metadata
    if not isinstance(sched, FlashMLASchedMeta):
        raise TypeError("tile_scheduler_metadata: expected the FlashMLASchedMeta of get_mla_metadata()")
    if num_splits is not None:
        raise ValueError("num_splits: must be None")
    q = ops._tensor("q", q, dtypes=(torch.bfloat16,), ndim=4)
    b, s_q, h_q, d_qk = q.shape
    if indices is None:
        raise NotImplementedError(
            "indices: dense decoding (indices=None, with block_table/cache_seqlens) is not "
            "in sparsekit; pass the sparse indices"
        )
    if causal:
        raise ValueError("causal: must be False with sparse attention")
    if not isinstance(head_dim_v, int) or head_dim_v < 1:
        raise ValueError(f"head_dim_v: must be a positive int, got {head_dim_v!r}")
    idx = ops._tensor("indices", indices, dtypes=(torch.int32, torch.int64), ndim=3)
    if tuple(idx.shape[:2]) != (b, s_q):
        raise ValueError(f"indices: expected [{b}, {s_q}, topk], got {list(idx.shape)}")
    k_cache = ops._tensor("k_cache", k_cache)
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_indices_in_kvcache: give it together with extra_k_cache")
    if extra_topk_length is not None and extra_k_cache is None:
        raise ValueError("extra_topk_length: given without extra_k_cache")
    e_idx = None
    if extra_indices_in_kvcache is not None:
        e_idx = ops._tensor("extra_indices_in_kvcache", extra_indices_in_kvcache,
                            dtypes=(torch.int32, torch.int64), ndim=3)
        if tuple(e_idx.shape[:2]) != (b, s_q):
            raise ValueError(f"extra_indices_in_kvcache: expected [{b}, {s_q}, extra_topk], "
                             f"got {list(e_idx.shape)}")
        extra_k_cache = ops._tensor("extra_k_cache", extra_k_cache)

    def lens(name, t):
        if t is None:
            return None
        t = ops._tensor(name, t, dtypes=(torch.int32, torch.int64), shape=(b,))
        # per token: [b] -> [b * s_q]
        return t.to(torch.int64).repeat_interleave(s_q)

    tl, etl = lens("topk_length", topk_length), lens("extra_topk_length", extra_topk_length)
    ops._same_device(q=q, k_cache=k_cache, indices=idx, extra_k_cache=extra_k_cache,
                     extra_indices_in_kvcache=e_idx, attn_sink=attn_sink,
                     topk_length=topk_length, extra_topk_length=extra_topk_length)

    cfg = FlashMLASchedMeta.Config(
        b, s_q, h_q, k_cache.shape[1], k_cache.shape[2], causal, is_fp8_kvcache, idx.shape[-1],
        None if extra_k_cache is None else extra_k_cache.shape[1],
        None if e_idx is None else e_idx.shape[-1],
    )
    if not sched.have_initialized:
        sched.have_initialized = True
        sched.config = cfg
    elif sched.config != cfg:
        raise ValueError(
            "tile_scheduler_metadata: the arguments differ from the first call made with "
            f"this metadata ({sched.config} vs {cfg}); use a fresh get_mla_metadata()"
        )

    scale = d_qk ** -0.5 if softmax_scale is None else float(softmax_scale)
    q_t = q.reshape(b * s_q, h_q, d_qk)
    if d_qk == head_dim_v:
        if d_qk != _V4_D:
            raise ValueError(f"head_dim_v: {head_dim_v} = q's head dim is DeepSeek-V4's form, "
                             f"which needs d_qk = head_dim_v = {_V4_D}")
        out, lse = _attend_v4(q_t, k_cache, idx.reshape(b * s_q, -1), tl, extra_k_cache,
                              None if e_idx is None else e_idx.reshape(b * s_q, -1), etl,
                              attn_sink, is_fp8_kvcache, scale)
        out = out.reshape(b, s_q, h_q, head_dim_v)
        lse = lse.reshape(b, s_q, h_q).transpose(1, 2).contiguous()
        sched.tile_scheduler_metadata = None
        sched.num_splits = None
        return out, lse
    _check_lengths("topk_length", tl, idx.shape[-1], "indices")
    if e_idx is not None:
        _check_lengths("extra_topk_length", etl, e_idx.shape[-1], "extra_indices_in_kvcache")
    out, lse = _attend(q_t, "k_cache", k_cache, idx.reshape(b * s_q, -1), tl, d_qk,
                       head_dim_v, is_fp8_kvcache, scale)
    out_f = None
    if e_idx is not None:
        out2, lse2 = _attend(q_t, "extra_k_cache", extra_k_cache, e_idx.reshape(b * s_q, -1),
                             etl, d_qk, head_dim_v, is_fp8_kvcache, scale)
        out_f, lse = _merge(out, lse, out2, lse2)
    if attn_sink is not None:
        out_f = _sink(out.float() if out_f is None else out_f, lse, attn_sink, h_q)
    if out_f is not None:
        out = out_f.to(torch.bfloat16)
    lse = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse)
    out = out.reshape(b, s_q, h_q, head_dim_v)
    lse = lse.reshape(b, s_q, h_q).transpose(1, 2).contiguous()
    sched.tile_scheduler_metadata = None
    sched.num_splits = None
    return out, lse


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill attention over a contiguous bf16 KV.

    ``q``: ``bf16 [s_q, h_q, d_qk]``; ``kv``: ``bf16 [s_kv, 1, d_qk]``; ``indices``:
    ``int32 [s_q, 1, topk]`` (``-1`` or ``>= s_kv`` invalid); ``topk_length`` ``[s_q]``.
    Returns ``(out bf16 [s_q, h_q, d_v], max_logits float32 [s_q, h_q], lse float32
    [s_q, h_q])``: ``max_logits`` is the largest scaled score (``-inf`` when none),
    ``lse`` natural log with ``+inf`` for a query with no valid index.
    """
    q = ops._tensor("q", q, dtypes=(torch.bfloat16,), ndim=3)
    s_q, h_q, d_qk = q.shape
    kv = ops._tensor("kv", kv, dtypes=(torch.bfloat16,), ndim=3)
    if kv.shape[1] != 1:
        raise ValueError(f"kv: h_kv must be 1 (MLA), got {kv.shape[1]}")
    if kv.shape[2] != d_qk:
        raise ValueError(f"kv: head dim {kv.shape[2]} is not q's {d_qk}")
    idx = ops._tensor("indices", indices, dtypes=(torch.int32, torch.int64), ndim=3)
    if idx.shape[0] != s_q or idx.shape[1] != 1:
        raise ValueError(f"indices: expected [{s_q}, 1, topk], got {list(idx.shape)}")
    if not isinstance(d_v, int) or d_v < 1:
        raise ValueError(f"d_v: must be a positive int, got {d_v!r}")
    if d_v == d_qk and d_qk != _V4_D:
        raise ValueError(f"d_v: {d_v} = q's head dim is DeepSeek-V4's form, which needs "
                         f"d_qk = d_v = {_V4_D}")
    if d_v > d_qk:
        raise ValueError(f"d_v: {d_v} is above q's head dim {d_qk}")
    tl = None
    if topk_length is not None:
        tl = ops._tensor("topk_length", topk_length, dtypes=(torch.int32, torch.int64),
                         shape=(s_q,)).to(torch.int64)
    ops._same_device(q=q, kv=kv, indices=idx, attn_sink=attn_sink, topk_length=topk_length)
    _check_lengths("topk_length", tl, idx.shape[-1], "indices")
    s_kv = kv.shape[0]
    if d_v == d_qk:
        kv2 = kv.reshape(s_kv, d_qk).contiguous()
        valid = _valid(idx.reshape(s_q, -1).to(torch.int64), s_kv, tl)
        pool = kv2.view(torch.uint8).reshape(s_kv, -1) if s_kv else torch.zeros(
            (0, 2 * d_qk), dtype=torch.uint8, device=q.device)
        sink = None
        if attn_sink is not None:
            sink = ops._tensor("attn_sink", attn_sink, dtypes=(torch.float32,), shape=(h_q,))
        out, lse = ops.sparse_mla_v4(q, pool, valid.to(torch.int32),
                                     KvLayout("bf16_512", page_size=1), float(sm_scale),
                                     attn_sink=sink)
        return out, _max_logits(q, kv2, valid, float(sm_scale)), lse
    try:
        layout = KvLayout("bf16", d_v, d_qk - d_v, 1)
    except ValueError as e:
        raise ValueError(f"d_v: {e}") from None
    kv2 = kv.reshape(s_kv, d_qk).contiguous()
    valid = _valid(idx.reshape(s_q, -1).to(torch.int64), s_kv, tl)
    scale = float(sm_scale)
    out, lse = ops.sparse_mla(q, kv2.view(torch.uint8).reshape(s_kv, -1) if s_kv else
                              torch.zeros((0, layout.bytes_per_page), dtype=torch.uint8, device=q.device),
                              valid.to(torch.int32), layout, scale)
    max_logits = _max_logits(q, kv2, valid, scale)
    if attn_sink is not None:
        out = _sink(out.float(), lse, attn_sink, h_q).to(torch.bfloat16)
    lse = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse)
    return out, max_logits, lse


def _max_logits(q, kv, valid, scale, budget=1 << 27):
    """``max_j scale · q·k_j`` over each query's valid indices (torch, in chunks of
    queries bounded by ``budget`` float32 elements of gathered keys)."""
    s_q, h_q, d = q.shape
    topk = valid.shape[1]
    out = torch.full((s_q, h_q), float("-inf"), dtype=torch.float32, device=q.device)
    if s_q == 0 or topk == 0 or kv.shape[0] == 0:
        return out
    step = max(1, budget // max(1, topk * d))
    for a in range(0, s_q, step):
        z = min(s_q, a + step)
        v = valid[a:z]
        k = kv.index_select(0, v.clamp_min(0).reshape(-1)).reshape(z - a, topk, d).float()
        s = torch.einsum("thd,tkd->thk", q[a:z].float(), k) * scale
        s = s.masked_fill((v < 0)[:, None, :], float("-inf"))
        out[a:z] = s.amax(dim=-1)
    return out
