"""SGLang's DSA decode call pattern (sglang_dsa_callsites.py) with sparsekit.compat swapped
in, against a pure-torch end-to-end reference of the same step (dequantised caches,
DeepGEMM's logits, exact top-k, FlashMLA's attention)."""

import torch

import refs
import sglang_dsa_callsites as sg
from sparsekit import IndexKLayout, KvLayout, ops
from sparsekit.compat import deep_gemm, flash_mla, sgl_kernel


def test_sglang_dsa_decode_step_with_sparsekit_compat(device, gen):
    batch, n_heads, h_q, topk = 4, 16, 16, 96
    lens = torch.tensor([150, 64, 97, 260], dtype=torch.int32)
    pages_per = -(-lens // 64)
    num_pages = int(pages_per.sum()) + 2
    pool = sg.FakeNSAPool(num_pages, device)
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    block_tables = torch.zeros((batch, int(pages_per.max())), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per.tolist()):
        block_tables[b, :n] = perm[at: at + n]
        at += n
    max_len = block_tables.shape[1] * 64
    pos = torch.arange(max_len)
    page_table_1 = (block_tables[:, pos // 64] * 64 + pos % 64).to(torch.int32)

    # Prefill wrote each request's index keys and KV (as SGLang's set_index_k / set_kv do).
    ik_layout = IndexKLayout("fp8_e4m3", 128, 64)
    kv_layout = KvLayout("fp8_ds_mla", 512, 64, 64)
    all_slots, all_keys, all_kv = [], [], []
    for b in range(batch):
        n = int(lens[b])
        slots = page_table_1[b, :n].long()
        keys = torch.randn((n, 128), generator=gen).to(torch.bfloat16)
        kv = (torch.randn((n, 576), generator=gen) * 2).to(torch.bfloat16)
        ops.index_k_store(keys.to(device), slots.to(device), pool.index_k, ik_layout)
        ops.kv_store(kv.to(device), slots.to(device), pool.kv, kv_layout)
        all_slots.append(slots)

    q_fp8 = torch.randn((batch, n_heads, 128), generator=gen).to(torch.float8_e4m3fn)
    weights = torch.randn((batch, n_heads), generator=gen) * n_heads ** -0.5
    q_all = torch.randn((batch, h_q, 576), generator=gen).to(torch.bfloat16)
    sm_scale = 576 ** -0.5

    out, topk_result, logits = sg.run_decode_step(
        deep_gemm, flash_mla, sgl_kernel, pool=pool, q_fp8=q_fp8.to(device),
        weights=weights.to(device), q_all=q_all.to(device), seqlens_32=lens.to(device),
        block_tables=block_tables.to(device), page_table_1=page_table_1.to(device),
        index_topk=topk, sm_scale=sm_scale,
    )

    # Pure torch: dequantised index keys -> DeepGEMM's logits -> exact top-k -> slots ->
    # FlashMLA's attention over the dequantised KV.
    tokens = refs.index_k_dequant(pool.index_k.cpu(), 64, 128, True)
    ref_logits = refs.paged_mqa_logits(q_fp8.float().unsqueeze(1), tokens, weights, lens,
                                       block_tables, 64, max_len)
    neg = ref_logits == float("-inf")
    assert torch.equal(logits.cpu() == float("-inf"), neg)
    assert float((logits.cpu() - ref_logits).masked_fill(neg, 0).abs().max()) <= 1e-3
    rel = torch.where(lens[:, None] <= topk,
                      torch.where(torch.arange(topk)[None] < lens[:, None], torch.arange(topk)[None], -1),
                      refs.topk_positions(logits.cpu(), torch.zeros(batch), lens, topk))
    want = torch.where(rel >= 0, torch.gather(page_table_1, 1, rel.clamp_min(0).long()), rel)
    assert torch.equal(topk_result.cpu(), want.to(torch.int32))
    rows = refs.fp8_ds_mla_dequant(pool.kv.cpu().reshape(-1, 656))
    r_out, _, _, mag = refs.sparse_attn(q_all, rows, want.clamp_min(0), want >= 0, sm_scale, 512)
    err = (out.cpu().float() - r_out).abs()
    assert out.shape == (batch, h_q, 512)
    assert (err <= refs.mla_out_bound(mag, r_out)).all(), float(err.max())
