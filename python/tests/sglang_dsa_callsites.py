"""A decode step shaped like SGLang's DSA (NSA) backend call sites, with the three kernel
modules injected: ``run_decode_step(deep_gemm, flash_mla, sgl_kernel, ...)``. The
calls, argument names and tensor views follow SGLang's ``nsa_indexer.py``
(``_get_topk_paged``) and its NSA attention backend:

    kv_cache_fp8 = pool.get_index_k_with_scale_buffer(layer_id)     # uint8 [pages, 64 * 132]
    schedule_metadata = deep_gemm.get_paged_mqa_logits_metadata(seqlens_32, 64, sm_count)
    logits = deep_gemm.fp8_paged_mqa_logits(
        q_fp8.view(batch_size, -1, n_heads, 128), kv_cache_fp8.view(pages, 64, 1, 132),
        weights, seqlens_32, block_tables, schedule_metadata, max_seq_len, clean_logits=False)
    topk = sgl_kernel.fast_topk_transform_fused(logits, seqlens_32, page_table_1,
                                                cu_seqlens_q, 2048)
    out, _ = flash_mla.flash_mla_with_kvcache(q_all, kv_cache.view(-1, 64, 1, 656), None,
        None, 512, flashmla_metadata, softmax_scale=sm_scale, is_fp8_kvcache=True,
        indices=topk.unsqueeze(1))

With ``sparsekit.compat`` passed in, nothing else changes.
"""

from __future__ import annotations

import torch


class FakeNSAPool:
    """The two per-layer buffers of SGLang's NSATokenToKVPool (page size 64): the fp8
    index-K with scales (``[pages, 64 * 132]`` uint8: values, then scales, per page) and
    the fp8_ds_mla KV (``[pages * 64, 1, 656]`` uint8)."""

    def __init__(self, num_pages: int, device):
        self.page_size = 64
        self.index_k = torch.zeros((num_pages, 64 * 132), dtype=torch.uint8, device=device)
        self.kv = torch.zeros((num_pages * 64, 1, 656), dtype=torch.uint8, device=device)

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_k

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv


def run_decode_step(deep_gemm, flash_mla, sgl_kernel, *, pool: FakeNSAPool, q_fp8, weights,
                    q_all, seqlens_32, block_tables, page_table_1, index_topk: int,
                    sm_scale: float, layer_id: int = 0):
    """One layer's sparse decode: indexer logits -> top-k (page-size-1 slots) -> sparse
    MLA. ``q_fp8`` ``[tokens, n_heads, 128]`` float8; ``weights`` ``[tokens, n_heads]``
    float32; ``q_all`` ``[tokens, h_q, 576]`` bf16; ``seqlens_32`` ``[batch]`` int32."""
    page_size = pool.page_size
    max_seq_len = block_tables.shape[1] * page_size
    kv_cache_fp8 = pool.get_index_k_with_scale_buffer(layer_id=layer_id)
    schedule_metadata = deep_gemm.get_paged_mqa_logits_metadata(
        seqlens_32, page_size, deep_gemm.get_num_sms()
    )
    num_tokens, num_heads, head_dim = q_fp8.shape
    batch_size = block_tables.shape[0]
    assert num_tokens % batch_size == 0
    q_fp8 = q_fp8.view(batch_size, -1, num_heads, head_dim)
    kv_cache_fp8 = kv_cache_fp8.view(kv_cache_fp8.shape[0], 64, 1, 132)
    logits = deep_gemm.fp8_paged_mqa_logits(
        q_fp8, kv_cache_fp8, weights, seqlens_32, block_tables, schedule_metadata,
        max_seq_len, clean_logits=False,
    )
    cu_seqlens_q = torch.arange(batch_size + 1, dtype=torch.int32, device=logits.device)
    topk_result = sgl_kernel.fast_topk_transform_fused(
        logits, seqlens_32, page_table_1, cu_seqlens_q, index_topk
    )
    kv_cache = pool.get_key_buffer(layer_id).view(-1, page_size, 1, 656)
    flashmla_metadata, _ = flash_mla.get_mla_metadata()
    o, _lse = flash_mla.flash_mla_with_kvcache(
        q=q_all.unsqueeze(1), k_cache=kv_cache, block_table=None, cache_seqlens=None,
        head_dim_v=512, tile_scheduler_metadata=flashmla_metadata, num_splits=None,
        softmax_scale=sm_scale, causal=False, is_fp8_kvcache=True,
        indices=topk_result.unsqueeze(1),
    )
    return o.squeeze(1), topk_result, logits
