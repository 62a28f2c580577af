"""Times sparsekit's torch entry points against pure-torch implementations of the same
maths, in the same run, at DeepSeek-V3.2 decode shapes (the device check runs it on CUDA;
``--smoke`` runs tiny shapes on CPU). Prints one JSON object: per case, our time, the torch
time (median of timed repeats, CUDA events on a GPU) and the largest difference.

    PYTHONPATH=<installed package> python3 python/bench/bench_torch.py [--smoke] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sparsekit.compat import deep_gemm, flash_mla, sgl_kernel


def timed(fn, device, repeats):
    fn()  # warm-up (loads the kernels)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_paged_logits(q, kv_cache, weights, lens, table, width):
    """Pure torch: dequantise the pages of the batch, then DeepGEMM's reference maths."""
    b, next_n, h, d = q.shape
    nb, block = kv_cache.shape[0], kv_cache.shape[1]
    flat = kv_cache.reshape(nb, -1)
    vals = flat[:, : block * d].reshape(nb * block, d).view(torch.float8_e4m3fn).float()
    sc = flat[:, block * d:].contiguous().view(torch.float32).reshape(nb * block)
    keys = vals * sc[:, None]
    pos = torch.arange(width, device=q.device)
    slots = table[:, pos // block].long() * block + pos % block  # [b, width]
    k = keys[slots]  # [b, width, d]
    s = torch.einsum("bnhd,bwd->bnhw", q.float(), k).relu()
    logits = torch.einsum("bnhw,bnh->bnw", s, weights.view(b, next_n, h)).reshape(b * next_n, width)
    mask = pos[None, :] < lens.repeat_interleave(next_n)[:, None]
    return logits.masked_fill(~mask, float("-inf"))


def torch_sparse_attn(q, rows, idx, scale):
    t, h, d = q.shape
    g = rows.index_select(0, idx.clamp_min(0).reshape(-1).long()).reshape(t, -1, d).float()
    w = torch.einsum("thd,tkd->thk", q.float(), g) * scale
    w = w.masked_fill((idx < 0)[:, None, :], float("-inf"))
    lse = torch.logsumexp(w, -1)
    return torch.einsum("thk,tkd->thd", torch.softmax(w, -1), g[..., :512]).to(torch.bfloat16), lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    if args.smoke:
        b, ctx, h_idx, h_q, topk, repeats = 2, 256, 8, 16, 64, 2
    else:
        b, ctx, h_idx, h_q, topk, repeats = 32, 8192, 64, 128, 2048, 10
    results = {"device": str(dev), "torch": torch.__version__, "cases": []}

    # indexer logits (DeepGEMM fp8_paged_mqa_logits form)
    block = 64
    pages = ctx // block
    table = torch.stack([torch.randperm(b * pages, generator=g)[:pages] for _ in range(b)]).to(torch.int32).to(dev)
    kv_cache = torch.randint(0, 256, (b * pages, block * 132), generator=g, dtype=torch.uint8)
    kv_cache[:, block * 128:] = torch.full((b * pages, block), 0.01).view(torch.uint8).reshape(b * pages, -1)
    vals = kv_cache[:, : block * 128]
    kv_cache[:, : block * 128] = torch.where((vals & 0x7F) == 0x7F, vals ^ 1, vals)  # no NaN codes
    kv_cache = kv_cache.to(dev).view(b * pages, block, 1, 132)
    q = torch.randn((b, 1, h_idx, 128), generator=g).to(torch.float8_e4m3fn).to(dev)
    w = torch.randn((b, h_idx), generator=g).to(dev)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    meta = deep_gemm.get_paged_mqa_logits_metadata(lens, block, deep_gemm.get_num_sms())
    ours = lambda: deep_gemm.fp8_paged_mqa_logits(q, kv_cache, w, lens, table, meta, ctx)  # noqa: E731
    ref = lambda: torch_paged_logits(q, kv_cache, w, lens, table, ctx)  # noqa: E731
    a, r = ours(), ref()
    fin = torch.isfinite(r)
    results["cases"].append({
        "case": f"fp8_paged_mqa_logits b={b} ctx={ctx} h={h_idx}",
        "ours_s": timed(ours, dev, repeats), "torch_s": timed(ref, dev, repeats),
        "max_abs_diff": float((a - r)[fin].abs().max()) if bool(fin.any()) else 0.0,
    })

    # top-k (sgl-kernel fast_topk_v2 form): the indexer's logits, then long rows at the CLI
    # bench's shape (`sparsekit bench --op topk`: 64 rows of 65536 standard-normal logits)
    def topk_case(scores, lengths):
        ours = lambda: sgl_kernel.fast_topk_v2(scores, lengths, topk)  # noqa: E731
        ref = lambda: torch.topk(scores, topk, dim=-1).indices  # noqa: E731
        same = torch.equal(torch.sort(ours(), -1).values.long(), torch.sort(ref(), -1).values)
        results["cases"].append({
            "case": f"fast_topk_v2 b={scores.shape[0]} len={scores.shape[1]} k={topk}",
            "ours_s": timed(ours, dev, repeats), "torch_s": timed(ref, dev, repeats),
            "same_set_as_torch_topk": same,
        })

    topk_case(a, lens)
    rows, long_ctx = (4, 4096) if args.smoke else (64, 65536)
    topk_case(torch.randn((rows, long_ctx), generator=g).to(dev),
              torch.full((rows,), long_ctx, dtype=torch.int32, device=dev))

    # sparse MLA decode (FlashMLA flash_mla_with_kvcache form, fp8_ds_mla)
    nb = max(1, (b * ctx) // block)
    toks = torch.randint(0, 256, (nb * block, 656), generator=g, dtype=torch.uint8)
    toks[:, :512] = torch.where((toks[:, :512] & 0x7F) == 0x7F, toks[:, :512] ^ 1, toks[:, :512])
    toks[:, 512:528] = torch.full((nb * block, 4), 0.05).view(torch.uint8).reshape(nb * block, 16)
    toks[:, 528:] = (torch.randn((nb * block, 64), generator=g) * 0.1).to(torch.bfloat16).view(torch.uint8)
    cache = toks.to(dev).view(nb, block, 1, 656)
    qa = (torch.randn((b, 1, h_q, 576), generator=g) * 0.1).to(torch.bfloat16).to(dev)
    idx = torch.randint(0, nb * block, (b, 1, topk), generator=g, dtype=torch.int32).to(dev)
    rows = torch.empty((nb * block, 576), dtype=torch.bfloat16, device=dev)
    rows[:, :512] = (cache.view(-1, 656)[:, :512].view(torch.float8_e4m3fn).float() * 0.05).to(torch.bfloat16)
    rows[:, 512:] = cache.view(-1, 656)[:, 528:].contiguous().view(torch.bfloat16)

    def ours():
        m, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(qa, cache, None, None, 512, m, is_fp8_kvcache=True,
                                                indices=idx)

    ref = lambda: torch_sparse_attn(qa.view(b, h_q, 576), rows, idx.view(b, topk), 576 ** -0.5)  # noqa: E731
    (o1, _), (o2, _) = ours(), ref()
    results["cases"].append({
        "case": f"flash_mla_with_kvcache b={b} h_q={h_q} topk={topk}",
        "ours_s": timed(ours, dev, repeats), "torch_s": timed(ref, dev, repeats),
        "max_abs_diff": float((o1.view(b, h_q, 512).float() - o2.float()).abs().max()),
    })
    for c in results["cases"]:
        c["speedup_vs_torch"] = c["torch_s"] / c["ours_s"] if c["ours_s"] > 0 else None
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
