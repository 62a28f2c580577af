"""sparsekit.compat against the anchors' published reference maths (refs.py), in the
anchors' conventions: DeepGEMM's logits, FlashMLA's lse layout and +inf, sgl-kernel's
relative top-k indices."""

import pytest
import torch

import refs
from sparsekit import ops
from sparsekit.compat import deep_gemm, flash_mla, sgl_kernel

E4M3 = torch.float8_e4m3fn


# ------------------------------------------------------------------ DeepGEMM


def _deepgemm_kv_cache(x):
    """DeepGEMM's test quantiser (kv_cache_cast_to_fp8): [blocks, block, 1, d] bf16 ->
    uint8 [blocks, block, 1, d + 4] (values, then scales, per block) and the dequantised
    float keys."""
    nb, bs, _, d = x.shape
    amax = x.abs().float().amax(dim=3, keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    xs = (x * (1.0 / sf)).to(E4M3)
    back = xs.float() * sf
    fused = torch.empty((nb, bs * (d + 4)), dtype=torch.uint8)
    fused[:, : bs * d] = xs.view(nb, bs * d).view(torch.uint8)
    fused[:, bs * d:] = sf.view(nb, bs).view(torch.uint8)
    return fused.view(nb, bs, 1, d + 4), back.reshape(nb * bs, d)


@pytest.mark.parametrize("two_d", [True, False])
@pytest.mark.parametrize("h,block_kv", [(64, 64), (12, 16)])
def test_fp8_paged_mqa_logits(device, gen, two_d, h, block_kv):
    b, next_n, d = 5, 2, 128
    lens = torch.randint(3, 300, (b,), generator=gen, dtype=torch.int32)
    blocks = -(-lens // block_kv)
    nb = int(blocks.sum()) + 2
    table = torch.zeros((b, int(blocks.max()) + 1), dtype=torch.int32)
    perm = torch.randperm(nb, generator=gen).to(torch.int32)
    at = 0
    for i, n in enumerate(blocks.tolist()):
        table[i, :n] = perm[at: at + n]
        at += n
    kv_bf16 = torch.randn((nb, block_kv, 1, d), generator=gen).to(torch.bfloat16)
    fused, tokens = _deepgemm_kv_cache(kv_bf16)
    q = torch.randn((b, next_n, h, d), generator=gen).to(torch.bfloat16).to(E4M3)
    w = torch.randn((b * next_n, h), generator=gen)
    max_len = table.shape[1] * block_kv
    if two_d:
        cl = torch.stack([(lens.float() * torch.rand(b, generator=gen)).int(), lens], dim=1).to(torch.int32)
        ends = cl.reshape(-1)
    else:
        cl = lens
        ends = torch.stack([lens - 1, lens], dim=1).reshape(-1)
    meta = deep_gemm.get_paged_mqa_logits_metadata(cl.to(device), block_kv, deep_gemm.get_num_sms())
    assert meta.shape == (deep_gemm.get_num_sms() + 1, 2) and meta.dtype == torch.int32
    out = deep_gemm.fp8_paged_mqa_logits(q.to(device), fused.to(device), w.to(device), cl.to(device),
                                         table.to(device), meta, max_len, clean_logits=False)
    ref = refs.paged_mqa_logits(q.float(), tokens, w, ends, table, block_kv, max_len)
    assert out.shape == (b * next_n, max_len) and out.dtype == torch.float32
    neg = ref == float("-inf")
    assert torch.equal(out.cpu() == float("-inf"), neg)
    diff = (out.cpu() - ref).masked_fill(neg, 0)
    # DeepGEMM's own acceptance: calc_diff < 1e-3 (1 - cosine-like similarity); ours is tighter.
    assert float(diff.abs().max()) <= 1e-4 * float(ref.masked_fill(neg, 0).abs().max() + 1)
    # The flat [num_blocks, block * 132] pool is the same call.
    out2 = deep_gemm.fp8_paged_mqa_logits(q.to(device), fused.reshape(nb, -1).to(device), w.to(device),
                                          cl.to(device), table.to(device), meta, max_len)
    assert torch.equal(out, out2)


@pytest.mark.parametrize("compressed", [False, True])
def test_fp8_mqa_logits(device, gen, compressed):
    s, n_kv, h, d = 24, 200, 32, 64
    q = torch.randn((s, h, d), generator=gen).to(torch.bfloat16).to(E4M3)
    k = torch.randn((n_kv, d), generator=gen).to(torch.bfloat16)
    amax = k.float().abs().amax(1).clamp(1e-4)
    sf = amax / 448.0
    k8 = (k.float() / sf[:, None]).to(E4M3)
    w = torch.randn((s, h), generator=gen)
    ks = torch.randint(0, 100, (s,), generator=gen, dtype=torch.int32)
    ke = (ks + torch.randint(0, 101, (s,), generator=gen, dtype=torch.int32)).clamp(max=n_kv)
    ke[0] = ks[0]  # an empty row
    ref = refs.mqa_logits(q.float(), k8.float() * sf[:, None], w, ks, ke)
    if not compressed:
        out = deep_gemm.fp8_mqa_logits(q.to(device), (k8.to(device), sf.to(device)), w.to(device),
                                       ks.to(device), ke.to(device), clean_logits=True)
        assert out.shape == (s, n_kv)
        got = out.cpu()
    else:
        m = int((ke - ks).max())
        out = deep_gemm.fp8_mqa_logits(q.to(device), (k8.to(device), sf.to(device)), w.to(device),
                                       ks.to(device), ke.to(device), clean_logits=False, max_seqlen_k=m)
        assert out.shape == (s, m)
        got = torch.full((s, n_kv), float("-inf"))
        for i in range(s):
            got[i, ks[i]: ke[i]] = out.cpu()[i, : ke[i] - ks[i]]
        j = torch.arange(m)[None, :]
        assert bool((out.cpu()[j >= (ke - ks)[:, None]] == float("-inf")).all())
    neg = ref == float("-inf")
    assert torch.equal(got == float("-inf"), neg)
    diff = (got - ref).masked_fill(neg, 0).abs()
    assert float(diff.max()) <= 1e-4 * float(ref.masked_fill(neg, 0).abs().max() + 1)


def test_deep_gemm_errors(device):
    q = torch.zeros((2, 1, 8, 64), device=device).to(E4M3)
    kv = torch.zeros((4, 16, 1, 68), dtype=torch.uint8, device=device)
    w = torch.zeros((2, 8), device=device)
    cl = torch.tensor([3, 4], dtype=torch.int32, device=device)
    bt = torch.zeros((2, 2), dtype=torch.int32, device=device)
    meta = deep_gemm.get_paged_mqa_logits_metadata(cl, 16, 4)
    with pytest.raises(ValueError, match="kv_cache"):
        deep_gemm.fp8_paged_mqa_logits(q, kv[..., :60], w, cl, bt, meta, 32)
    with pytest.raises(ValueError, match="weights"):
        deep_gemm.fp8_paged_mqa_logits(q, kv, w[:1], cl, bt, meta, 32)
    with pytest.raises(TypeError, match="context_lens"):
        deep_gemm.fp8_paged_mqa_logits(q, kv, w, cl.long(), bt, meta, 32)
    with pytest.raises(ValueError, match="block_table"):
        deep_gemm.fp8_paged_mqa_logits(q, kv, w, cl, bt[:1], meta, 32)
    with pytest.raises(TypeError, match="q"):
        deep_gemm.fp8_paged_mqa_logits(q.float(), kv, w, cl, bt, meta, 32)
    with pytest.raises(NotImplementedError, match="fp4"):
        deep_gemm.fp8_fp4_paged_mqa_logits((q, torch.zeros(1)), kv, w, cl, bt, meta, 32)
    for other in [torch.float8_e5m2, torch.int8]:
        with pytest.raises(TypeError, match="kv_cache.*uint8"):
            deep_gemm.fp8_paged_mqa_logits(q, kv.view(other), w, cl, bt, meta, 32)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="max_context_len"):
            deep_gemm.fp8_paged_mqa_logits(q, kv, w, cl, bt, meta, 3)
        with pytest.raises(ValueError, match="cu_seq_len_k_start"):
            deep_gemm.fp8_mqa_logits(q[:, 0], (kv[0, :, 0, :64].view(E4M3), torch.ones(16)), w,
                                     torch.tensor([0, 5], dtype=torch.int32),
                                     torch.tensor([4, 17], dtype=torch.int32))


# ------------------------------------------------------------------ FlashMLA


def _flashmla_cache(gen, nb, block, padded=False):
    """FlashMLA's quantize_k_cache layout: [nb, block, 1, 656] float8_e4m3fn (optionally a
    view of [nb, block + 1, 656] storage, as FlashMLA's tests make it)."""
    kv = (torch.randn((nb * block, 576), generator=gen) * torch.rand((nb * block, 1), generator=gen) * 3).to(torch.bfloat16)
    toks = refs.fp8_ds_mla_quant(kv)
    if padded:
        store = torch.zeros((nb, block + 1, 656), dtype=torch.uint8)
        store[:, :block] = toks.view(nb, block, 656)
        cache = store[:, :block, :].view(E4M3).unsqueeze(2)
    else:
        cache = toks.view(nb, block, 1, 656).view(E4M3)
    return cache, refs.fp8_ds_mla_dequant(toks)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("h_q,topk", [(16, 64), (5, 96)])
def test_flash_mla_with_kvcache_v32(device, gen, padded, h_q, topk):
    b, s_q, nb, block = 4, 2, 7, 32
    cache, rows = _flashmla_cache(gen, nb, block, padded)
    cap = nb * block
    q = torch.randn((b, s_q, h_q, 576), generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, cap, (b, s_q, topk), generator=gen, dtype=torch.int32)
    idx[0, 1, :] = -1              # a query with nothing to attend: out 0, lse +inf
    idx[1, 0, ::4] = -1
    tlen = torch.tensor([topk, topk // 2, 3, topk], dtype=torch.int32)
    idx[2, :, 3:] = 999_999        # past topk_length: ignored whatever it holds
    meta, none = flash_mla.get_mla_metadata()
    assert none is None
    out, lse = flash_mla.flash_mla_with_kvcache(
        q.to(device), cache.to(device) if not padded else cache.to(device), None, None, 512, meta,
        is_fp8_kvcache=True, indices=idx.to(device), topk_length=tlen.to(device))
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32
    j = torch.arange(topk)
    valid = (idx >= 0) & (j[None, None, :] < tlen[:, None, None])
    r_out, r_lse, _, mag = refs.sparse_attn(q.reshape(b * s_q, h_q, 576), rows,
                                            idx.reshape(b * s_q, topk).clamp(0, cap - 1),
                                            valid.reshape(b * s_q, topk), 576 ** -0.5, 512)
    r_lse = r_lse.reshape(b, s_q, h_q).transpose(1, 2)
    assert torch.equal(lse.cpu() == float("inf"), r_lse == float("inf"))
    fin = torch.isfinite(r_lse)
    assert ((lse.cpu() - r_lse)[fin].abs() <= 1e-4 * (1 + r_lse[fin].abs())).all()
    err = (out.cpu().float().reshape(b * s_q, h_q, 512) - r_out).abs()
    assert (err <= refs.mla_out_bound(mag, r_out)).all(), float(err.max())
    # The same metadata with other shapes is refused, as FlashMLA refuses it.
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(q[:2].to(device), cache.to(device), None, None, 512, meta,
                                         is_fp8_kvcache=True, indices=idx[:2].to(device))


def test_flash_mla_with_kvcache_v4_arguments_on_v32_layouts(device, gen):
    """attn_sink, extra cache (another page size) and both lengths, on V3.2 caches."""
    b, s_q, h_q = 4, 1, 8
    cache, rows = _flashmla_cache(gen, 5, 16)
    extra, erows = _flashmla_cache(gen, 3, 64)
    q = torch.randn((b, s_q, h_q, 576), generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, 80, (b, s_q, 32), generator=gen, dtype=torch.int32)
    eidx = torch.randint(0, 192, (b, s_q, 48), generator=gen, dtype=torch.int32)
    idx[3] = -1
    eidx[3] = -1                    # batch 3: nothing anywhere -> out 0, lse +inf
    tl = torch.tensor([32, 5, 0, 32], dtype=torch.int32)
    etl = torch.tensor([48, 48, 7, 0], dtype=torch.int32)
    sink = torch.randn(h_q, generator=gen)
    sink[0] = float("inf")          # +inf: output 0
    sink[1] = float("-inf")         # -inf: no effect
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        q.to(device), cache.to(device), None, None, 512, meta, is_fp8_kvcache=True,
        indices=idx.to(device), attn_sink=sink.to(device), extra_k_cache=extra.to(device),
        extra_indices_in_kvcache=eidx.to(device), topk_length=tl.to(device),
        extra_topk_length=etl.to(device))
    allrows = torch.cat([rows, erows])
    both = torch.cat([idx, eidx + rows.shape[0]], dim=2).reshape(b, -1)
    valid = torch.cat([(idx >= 0) & (torch.arange(32)[None, None] < tl[:, None, None]),
                       (eidx >= 0) & (torch.arange(48)[None, None] < etl[:, None, None])], dim=2).reshape(b, -1)
    r_out, r_lse, _, mag = refs.sparse_attn(q.reshape(b, h_q, 576), allrows, both.clamp_min(0), valid,
                                            576 ** -0.5, 512, attn_sink=sink)
    got_lse = lse.cpu().reshape(b, h_q)
    assert torch.equal(got_lse == float("inf"), r_lse == float("inf"))
    fin = torch.isfinite(r_lse)
    assert ((got_lse - r_lse)[fin].abs() <= 1e-4 * (1 + r_lse[fin].abs())).all()
    err = (out.cpu().float().reshape(b, h_q, 512) - r_out).abs()
    # One more bf16 rounding than FlashMLA (each cache's output is rounded before the merge).
    assert (err <= 2 * refs.mla_out_bound(mag, r_out)).all(), float(err.max())
    assert bool((out.cpu()[:, :, 0] == 0).all()), "a +inf sink zeroes the output"


def test_flash_mla_v4_dense_form_and_unpadded_model1_refused(device):
    """V4 runs (test_v4.py); a contiguous MODEL1 tensor whose blocks are not the padded
    MODEL1 page is refused naming k_cache, and the dense form stays NotImplementedError."""
    q = torch.zeros((1, 1, 64, 512), dtype=torch.bfloat16, device=device)
    model1 = torch.zeros((2, 64, 1, 584), dtype=torch.uint8, device=device)
    idx = torch.zeros((1, 1, 64), dtype=torch.int32, device=device)
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ValueError, match="k_cache: block stride 37376 bytes is below the MODEL1 page of 37440"):
        flash_mla.flash_mla_with_kvcache(q, model1, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)
    with pytest.raises(NotImplementedError, match="dense"):
        flash_mla.flash_mla_with_kvcache(q, model1, None, None, 512, flash_mla.get_mla_metadata()[0])


@pytest.mark.parametrize("with_sink", [False, True])
def test_flash_mla_sparse_fwd(device, gen, with_sink):
    s_q, s_kv, h_q, topk = 10, 150, 16, 40
    q = torch.randn((s_q, h_q, 576), generator=gen).to(torch.bfloat16)
    kv = torch.randn((s_kv, 1, 576), generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    idx[0, 0, :5] = s_kv + 3     # >= s_kv: invalid (FlashMLA's convention)
    idx[1, 0, :] = -1            # nothing valid
    tl = torch.randint(0, topk + 1, (s_q,), generator=gen, dtype=torch.int32)
    tl[2] = topk
    sink = torch.randn(h_q, generator=gen) if with_sink else None
    out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(
        q.to(device), kv.to(device), idx.to(device), 0.05, 512,
        attn_sink=None if sink is None else sink.to(device), topk_length=tl.to(device))
    i2 = idx[:, 0, :]
    valid = (i2 >= 0) & (i2 < s_kv) & (torch.arange(topk)[None, :] < tl[:, None])
    r_out, r_lse, r_max, mag = refs.sparse_attn(q, kv[:, 0], i2.clamp(0, s_kv - 1), valid, 0.05, 512,
                                                attn_sink=sink)
    assert out.shape == (s_q, h_q, 512) and max_logits.shape == (s_q, h_q) and lse.shape == (s_q, h_q)
    assert torch.equal(lse.cpu() == float("inf"), r_lse == float("inf"))
    assert bool((lse.cpu()[1] == float("inf")).all()) and bool((max_logits.cpu()[1] == float("-inf")).all())
    fin = torch.isfinite(r_lse)
    assert ((lse.cpu() - r_lse)[fin].abs() <= 1e-4 * (1 + r_lse[fin].abs())).all()
    fm = torch.isfinite(r_max)
    assert torch.allclose(max_logits.cpu()[fm], r_max[fm], rtol=1e-5, atol=1e-5)
    err = (out.cpu().float() - r_out).abs()
    assert (err <= 2 * refs.mla_out_bound(mag, r_out)).all(), float(err.max())


def test_flash_mla_errors(device):
    q = torch.zeros((1, 1, 16, 576), dtype=torch.bfloat16, device=device)
    cache = torch.zeros((2, 64, 1, 656), dtype=torch.uint8, device=device)
    idx = torch.zeros((1, 1, 64), dtype=torch.int32, device=device)
    meta = lambda: flash_mla.get_mla_metadata()[0]  # noqa: E731
    with pytest.raises(TypeError, match="tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, None, indices=idx, is_fp8_kvcache=True)
    with pytest.raises(ValueError, match="k_cache"):
        flash_mla.flash_mla_with_kvcache(q, cache[..., :600], None, None, 512, meta(), indices=idx,
                                         is_fp8_kvcache=True)
    with pytest.raises(ValueError, match="indices"):
        flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, meta(), indices=idx[0], is_fp8_kvcache=True)
    with pytest.raises(TypeError, match="k_cache"):
        flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, meta(), indices=idx)
    with pytest.raises(ValueError, match="extra_indices_in_kvcache"):
        flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, meta(), indices=idx,
                                         is_fp8_kvcache=True, extra_k_cache=cache)
    with pytest.raises(ValueError, match="attn_sink"):
        flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, meta(), indices=idx,
                                         is_fp8_kvcache=True, attn_sink=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="kv"):
        flash_mla.flash_mla_sparse_fwd(q[0], torch.zeros((4, 2, 576), dtype=torch.bfloat16, device=device),
                                       idx[0][:, None], 0.1)
    # A 1-byte dtype whose bytes mean other values than e4m3's is refused, not reinterpreted.
    for other in [torch.float8_e5m2, torch.int8, torch.bool]:
        with pytest.raises(TypeError, match="k_cache.*float8_e4m3fn or uint8"):
            flash_mla.flash_mla_with_kvcache(q, cache.view(other), None, None, 512, meta(),
                                             indices=idx, is_fp8_kvcache=True)


# ------------------------------------------------------------------ sgl-kernel


def _sgl_expected(score, lengths, starts, topk):
    """sgl-kernel semantics: short rows -> 0..len-1 then -1; long rows -> top-k relative to
    the start (exact, ascending here)."""
    b = score.shape[0]
    out = refs.topk_positions(score, starts, starts + lengths, topk)
    out = torch.where(out >= 0, out - starts[:, None].to(torch.int32), out)
    j = torch.arange(topk, dtype=torch.int32)[None, :]
    short = torch.where(j < lengths[:, None], j, torch.full_like(j, -1))
    return torch.where((lengths <= topk)[:, None], short, out)


@pytest.mark.parametrize("topk", [2048, 50])
def test_fast_topk_v2(device, gen, topk):
    b, width = 6, 5000
    score = torch.randn((b, width), generator=gen)
    score[:, ::7] = score[:, 3:4]  # ties
    lengths = torch.tensor([5000, 40, 2048, 2049, 1, 4000], dtype=torch.int32)
    starts = torch.tensor([0, 100, 0, 500, 4999, 1000], dtype=torch.int32)
    out = sgl_kernel.fast_topk_v2(score.to(device), lengths.to(device), topk, starts.to(device))
    assert out.shape == (b, topk) and out.dtype == torch.int32
    assert torch.equal(out.cpu(), _sgl_expected(score, lengths, starts, topk))
    out0 = sgl_kernel.fast_topk_v2(score.to(device), lengths.to(device), topk)
    assert torch.equal(out0.cpu(), _sgl_expected(score, lengths, torch.zeros_like(starts), topk))


def test_fast_topk_transform_fused_decode_and_prefill(device, gen):
    topk, width = 64, 400
    # decode: one row per request
    score = torch.randn((4, width), generator=gen)
    lengths = torch.tensor([400, 30, 64, 65], dtype=torch.int32)
    pt1 = torch.randint(0, 10_000, (4, width), generator=gen, dtype=torch.int32)
    cu = torch.arange(5, dtype=torch.int32)
    out = sgl_kernel.fast_topk_transform_fused(score.to(device), lengths.to(device), pt1.to(device),
                                               cu.to(device), topk)
    rel = _sgl_expected(score, lengths, torch.zeros(4, dtype=torch.int32), topk)
    exp = torch.where(rel >= 0, torch.gather(pt1, 1, rel.clamp_min(0).long()), rel)
    assert torch.equal(out.cpu(), exp)
    # prefill: 7 rows of 2 requests (cu_seqlens_q), ragged row starts
    score = torch.randn((7, width), generator=gen)
    lengths = torch.tensor([10, 100, 200, 70, 64, 300, 1], dtype=torch.int32)
    starts = torch.tensor([0, 0, 100, 5, 0, 50, 9], dtype=torch.int32)
    pt1 = torch.randint(0, 10_000, (2, width), generator=gen, dtype=torch.int32)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = sgl_kernel.fast_topk_transform_fused(score.to(device), lengths.to(device), pt1.to(device),
                                               cu.to(device), topk, starts.to(device))
    rel = _sgl_expected(score, lengths, starts, topk)
    req = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    exp = torch.where(rel >= 0, torch.gather(pt1[req], 1, rel.clamp_min(0).long()), rel)
    assert torch.equal(out.cpu(), exp)


def test_fast_topk_transform_ragged_and_v4_512(device, gen):
    topk, width = 32, 300
    score = torch.randn((5, width), generator=gen)
    lengths = torch.tensor([300, 10, 32, 33, 200], dtype=torch.int32)
    starts = torch.tensor([0, 5, 0, 100, 50], dtype=torch.int32)
    offs = torch.tensor([0, 1000, 2000, 3000, 4000], dtype=torch.int32)
    out = sgl_kernel.fast_topk_transform_ragged_fused(score.to(device), lengths.to(device), offs.to(device),
                                                      topk, starts.to(device))
    rel = _sgl_expected(score, lengths, starts, topk)
    assert torch.equal(out.cpu(), torch.where(rel >= 0, rel + offs[:, None], rel))
    # V4's 512 transform (k = page_indices.shape[1], any page size)
    page = 8
    table = torch.randint(0, 500, (5, -(-width // page)), generator=gen, dtype=torch.int32)
    pi = torch.empty((5, topk), dtype=torch.int32, device=device)
    raw = torch.empty((5, topk), dtype=torch.int32, device=device)
    sgl_kernel.deepseek_v4_topk_transform_512(score.to(device), lengths.to(device), table.to(device), pi,
                                              page, raw)
    rel0 = _sgl_expected(score, lengths, torch.zeros(5, dtype=torch.int32), topk)
    slots = torch.gather(table, 1, (rel0.clamp_min(0) // page).long()) * page + rel0.clamp_min(0) % page
    assert torch.equal(raw.cpu(), rel0)
    assert torch.equal(pi.cpu(), torch.where(rel0 >= 0, slots, rel0))


def test_sgl_kernel_errors(device):
    score = torch.randn((3, 100), device=device)
    lengths = torch.tensor([100, 5, 7], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="lengths"):
        sgl_kernel.fast_topk_v2(score, lengths[:2], 16)
    with pytest.raises(TypeError, match="score"):
        sgl_kernel.fast_topk_v2(score.half(), lengths, 16)
    with pytest.raises(ValueError, match="topk"):
        sgl_kernel.fast_topk_v2(score, lengths, 0)
    with pytest.raises(ValueError, match="page_table_size_1"):
        sgl_kernel.fast_topk_transform_fused(score, lengths, torch.zeros((2, 100), dtype=torch.int32, device=device),
                                             torch.arange(4, dtype=torch.int32, device=device), 16)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="lengths"):
            sgl_kernel.fast_topk_v2(score, torch.tensor([101, 5, 7], dtype=torch.int32), 16)


def test_sgl_kernel_indices_beyond_int32_and_aliased_outputs(device, gen):
    """An index past int32 (an int64 offset or page-table entry) is refused on CPU and is
    -1 (none) on CUDA, never a wrapped one; raw_indices sharing page_indices' memory is
    refused."""
    score = torch.randn((2, 50), generator=gen).to(device)
    lengths = torch.tensor([50, 5], dtype=torch.int32, device=device)
    offs = torch.tensor([2**31 - 2, 0], dtype=torch.int64, device=device)
    table = torch.randint(0, 1000, (2, 50), generator=gen, dtype=torch.int64).to(device)
    table[0] = 2**32 + 7
    cu = torch.arange(3, dtype=torch.int32, device=device)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="topk_indices_offset.*does not fit in int32"):
            sgl_kernel.fast_topk_transform_ragged_fused(score, lengths, offs, 8)
        with pytest.raises(ValueError, match="page_table_size_1.*does not fit in int32"):
            sgl_kernel.fast_topk_transform_fused(score, lengths, table, cu, 8)
    else:
        out = sgl_kernel.fast_topk_transform_ragged_fused(score, lengths, offs, 8).cpu()
        rel = sgl_kernel.fast_topk_v2(score, lengths, 8).cpu()
        # Row 0: 2**31 - 2 + p fits only for p <= 1.
        assert torch.equal(out[0], torch.where(rel[0] <= 1, rel[0] + (2**31 - 2), -1))
        assert torch.equal(out[1], rel[1])
        out = sgl_kernel.fast_topk_transform_fused(score, lengths, table, cu, 8).cpu()
        assert bool((out[0] == -1).all())
    # An unused row's entries are never narrowed: any int64 there is fine.
    unused = torch.tensor([50, 0], dtype=torch.int32, device=device)
    wide = torch.randint(0, 1000, (2, 50), generator=gen, dtype=torch.int64).to(device)
    wide[1] = 2**40
    out = sgl_kernel.fast_topk_transform_fused(score, unused, wide, cu, 8).cpu()
    assert bool((out[1] == -1).all())
    rel = sgl_kernel.fast_topk_v2(score, unused, 8).cpu()
    assert torch.equal(out[0], torch.gather(wide[0].cpu(), 0, rel[0].long()).to(torch.int32))
    pi = torch.empty((2, 8), dtype=torch.int32, device=device)
    pt = torch.zeros((2, 7), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="raw_indices"):
        sgl_kernel.deepseek_v4_topk_transform_512(score, lengths, pt, pi, 8, pi)
    with pytest.raises(ValueError, match="raw_indices"):
        sgl_kernel.deepseek_v4_topk_transform_512(score, lengths, pt, pi, 8, pi.view(-1)[:16].view(2, 8))


def test_flash_mla_v32_path_checks_lengths_and_sink_as_v4_does(device, gen):
    """On CPU, the V3.2 form refuses a topk_length outside [0, topk] and a NaN sink, as the
    V4 form does (before: masked silently, NaN output)."""
    if device.type != "cpu":
        pytest.skip("the checks are CPU-side (CUDA sanitises on the device)")
    s_q, s_kv, h_q, topk = 3, 20, 4, 8
    q = torch.randn((s_q, h_q, 576), generator=gen).to(torch.bfloat16)
    kv = torch.randn((s_kv, 1, 576), generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    for bad in (-3, topk + 1):
        tl = torch.tensor([topk, bad, 0], dtype=torch.int32)
        with pytest.raises(ValueError, match="topk_length"):
            flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.1, 512, topk_length=tl)
    sink = torch.zeros(h_q)
    sink[2] = float("nan")
    with pytest.raises(ValueError, match=r"attn_sink\[2\] is NaN"):
        flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.1, 512, attn_sink=sink)
    cache, _ = _flashmla_cache(gen, 2, 64)
    qk = torch.randn((1, s_q, h_q, 576), generator=gen).to(torch.bfloat16)
    ik = torch.randint(0, 128, (1, s_q, 64), generator=gen, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_length"):
        flash_mla.flash_mla_with_kvcache(qk, cache, None, None, 512, flash_mla.get_mla_metadata()[0],
                                         is_fp8_kvcache=True, indices=ik,
                                         topk_length=torch.tensor([65], dtype=torch.int32))


def test_flash_mla_with_kvcache_bf16_cache_beyond_anchor(device, gen):
    """A bf16 KV cache [blocks, block, 1, 576] (FlashMLA's sparse form takes fp8 only),
    batch 4 with ragged valid counts and an odd page size."""
    b, s_q, h_q, nb, block, topk = 4, 3, 10, 5, 24, 40
    kv = torch.randn((nb * block, 576), generator=gen).to(torch.bfloat16)
    cache = kv.view(nb, block, 1, 576)
    q = torch.randn((b, s_q, h_q, 576), generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, nb * block, (b, s_q, topk), generator=gen, dtype=torch.int32)
    idx[:, :, 30:] = -1
    idx[1, 2, 5:] = -7                # any negative: skipped like -1 (beyond the anchor)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q.to(device), cache.to(device), None, None, 512, meta,
                                                softmax_scale=0.07, indices=idx.to(device))
    valid = idx >= 0
    r_out, r_lse, _, mag = refs.sparse_attn(q.reshape(-1, h_q, 576), kv, idx.reshape(-1, topk).clamp_min(0),
                                            valid.reshape(-1, topk), 0.07, 512)
    got = lse.cpu().transpose(1, 2).reshape(-1, h_q)
    assert ((got - r_lse).abs() <= 1e-4 * (1 + r_lse.abs())).all()
    err = (out.cpu().float().reshape(-1, h_q, 512) - r_out).abs()
    assert (err <= refs.mla_out_bound(mag, r_out)).all(), float(err.max())


def test_install_registers_or_patches_the_anchor_modules(monkeypatch):
    """compat.install(): an anchor that does not import gets sparsekit's module under its
    name; one that imports keeps its other functions and gets ours for the DSA ones."""
    import sys
    import types

    import sparsekit.compat as compat

    for name in ("deep_gemm", "flash_mla", "sgl_kernel", "sgl_kernel.top_k"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    fake = types.ModuleType("sgl_kernel")
    fake.fast_topk_v2 = lambda *a: "theirs"
    fake.silu_and_mul = lambda *a: "their other kernel"
    monkeypatch.setitem(sys.modules, "sgl_kernel", fake)
    done = compat.install()
    assert done["sgl_kernel"] == "patched"
    assert fake.fast_topk_v2 is sgl_kernel.fast_topk_v2
    assert fake.silu_and_mul() == "their other kernel"
    for name in ("deep_gemm", "flash_mla"):
        if done[name] == "registered":
            assert sys.modules[name] is getattr(compat, name)
        else:  # the real anchor is installed here: patched in place
            assert getattr(sys.modules[name], compat._ANCHORS[name][1][0]) is not None
    import deep_gemm as dg  # noqa: F401  (resolves to ours when registered)
    if done["deep_gemm"] == "registered":
        assert dg.fp8_paged_mqa_logits is deep_gemm.fp8_paged_mqa_logits
