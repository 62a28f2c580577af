"""sparsekit.ops against the torch references of refs.py: ragged batches (>= 4 requests),
both cache dtypes, both query-row forms, bad arguments raising with the argument's name,
rejected calls writing nothing."""

import pytest
import torch

import refs
import sparsekit
from sparsekit import IndexKLayout, KvLayout, ops


def _randperm_pages(n, gen):
    return torch.randperm(n, generator=gen).to(torch.int32)


def _ragged_index_k(gen, device, *, fp8=True, d=128, page=16, lens=(37, 5, 64, 90, 1)):
    """A paged index-K pool holding ragged requests: (layout, pool, page_table, keys by
    request, slots by request)."""
    layout = IndexKLayout("fp8_e4m3" if fp8 else "bf16", d, page)
    need = [-(-n // page) for n in lens]
    num_pages = sum(need) + 3
    perm = _randperm_pages(num_pages, gen)
    max_pages = max(need) + 1
    table = torch.full((len(lens), max_pages), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[at: at + n]
        at += n
    pool = torch.zeros((num_pages, layout.bytes_per_page), dtype=torch.uint8, device=device)
    keys, slots = [], []
    for r, n in enumerate(lens):
        k = (torch.randn((n, d), generator=gen) * (1 + r)).to(torch.bfloat16)
        pos = torch.arange(n)
        s = table[r, pos // page].long() * page + pos % page
        ops.index_k_store(k.to(device), s.to(device), pool, layout)
        keys.append(k)
        slots.append(s)
    return layout, pool, table, keys, slots


# ------------------------------------------------------------------ stores


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_index_k_store_fp8_matches_deepseek_quantiser(device, gen, scale):
    layout = IndexKLayout("fp8_e4m3", 128, 16, scale=scale)
    n, pages = 40, 5
    keys = (torch.randn((n, 128), generator=gen) * torch.rand((n, 1), generator=gen) * 30).to(torch.bfloat16)
    keys[3] = 0  # amax floor 1e-4
    slots = torch.randperm(pages * 16, generator=gen)[:n].long()
    slots[7] = -1
    pool = torch.full((pages, layout.bytes_per_page), 0x5A, dtype=torch.uint8, device=device)
    before = pool.clone()
    ops.index_k_store(keys.to(device), slots.to(device), pool, layout)
    codes, sf = refs.index_k_quant(keys, ue8m0=scale == "ue8m0")
    expect = before.cpu().clone()
    want = refs.index_k_page_bytes(codes, sf, slots, pages, 16, 128)
    written = torch.zeros(pages * 16, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for s in range(pages * 16):
        if not written[s]:
            continue
        p, o = divmod(s, 16)
        expect[p, o * 128:(o + 1) * 128] = want[p, o * 128:(o + 1) * 128]
        expect[p, 2048 + 4 * o: 2048 + 4 * o + 4] = want[p, 2048 + 4 * o: 2048 + 4 * o + 4]
    assert torch.equal(pool.cpu(), expect), "pool differs from DeepSeek's quantiser (x / scale)"
    # DeepGEMM's kv_cache_cast_to_fp8 multiplies by 1 / scale: within one code of ours.
    recip = (keys.float() * (1.0 / sf[:, None])).to(refs.E4M3).float()
    ours = refs.index_k_dequant(pool.cpu(), 16, 128, True)[slots.clamp_min(0)] / sf[:, None]
    ok = slots >= 0
    # one e4m3 code apart at most: 1/8 relative (3 mantissa bits), 2^-9 among subnormals
    assert ((ours[ok] - recip[ok]).abs() <= (recip[ok].abs() * 0.1251 + 2 ** -9)).all()


def test_index_k_store_bf16_copies(device, gen):
    layout = IndexKLayout("bf16", 64, 8)
    keys = torch.randn((20, 64), generator=gen).to(torch.bfloat16)
    slots = torch.randperm(32, generator=gen)[:20].long()
    pool = torch.zeros((4, layout.bytes_per_page), dtype=torch.uint8, device=device)
    ops.index_k_store(keys.to(device), slots.to(device), pool, layout)
    got = pool.cpu().view(torch.bfloat16).reshape(32, 64)[slots]
    assert torch.equal(got, keys)


@pytest.mark.parametrize("dtype", ["fp8_ds_mla", "bf16"])
def test_kv_store_matches_flashmla_quantiser(device, gen, dtype):
    layout = KvLayout(dtype, 512, 64, 16)
    n, pages = 30, 3
    kv = (torch.randn((n, 576), generator=gen) * 4).to(torch.bfloat16)
    kv[2, :128] = 0
    slots = torch.randperm(pages * 16, generator=gen)[:n].long()
    cache = torch.zeros((pages, 16, 1, layout.bytes_per_token), dtype=torch.uint8, device=device)
    ops.kv_store(kv.to(device), slots.to(device), cache, layout)
    tok = cache.cpu().reshape(pages * 16, -1)[slots]
    if dtype == "fp8_ds_mla":
        assert torch.equal(tok, refs.fp8_ds_mla_quant(kv))
        back = refs.fp8_ds_mla_dequant(tok).float()
        assert ((back - kv.float()).abs() <= kv.float().abs() * 0.07 + 1e-3).all()
    else:
        assert torch.equal(tok.view(torch.bfloat16), kv)


def test_store_errors_name_the_argument_and_write_nothing(device, gen):
    layout = IndexKLayout("fp8_e4m3", 128, 16)
    keys = torch.randn((4, 128), generator=gen).to(torch.bfloat16).to(device)
    pool = torch.full((2, layout.bytes_per_page), 7, dtype=torch.uint8, device=device)
    good = torch.tensor([0, 1, 2, 3], device=device)
    with pytest.raises(TypeError, match="keys"):
        ops.index_k_store(keys.float(), good, pool, layout)
    with pytest.raises(ValueError, match="keys"):
        ops.index_k_store(keys[:, :64], good, pool, layout)
    with pytest.raises(ValueError, match="slots"):
        ops.index_k_store(keys, good[:3], pool, layout)
    with pytest.raises(TypeError, match="slots"):
        ops.index_k_store(keys, good.float(), pool, layout)
    with pytest.raises(ValueError, match="cache"):
        ops.index_k_store(keys, good, pool[:, :100], layout)
    with pytest.raises(ValueError, match="cache"):
        ops.index_k_store(keys, good, pool.t(), layout)
    with pytest.raises(TypeError, match="layout"):
        ops.index_k_store(keys, good, pool, KvLayout())
    with pytest.raises(ValueError, match="meta|device"):
        ops.index_k_store(keys, good, torch.empty_like(pool, device="meta"), layout)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="slots"):
            ops.index_k_store(keys, torch.tensor([0, 1, 2, 32]), pool, layout)
        with pytest.raises(ValueError, match="slots"):
            ops.index_k_store(keys, torch.tensor([0, 1, 1, 3]), pool, layout)
        with pytest.raises(ValueError, match="slots"):
            ops.index_k_store(keys, torch.tensor([0, 1, -2, 3]), pool, layout)
    assert bool((pool == 7).all()), "a rejected call wrote to the cache"
    with pytest.raises(ValueError, match="overlap|alias"):
        ops.kv_store(pool.view(torch.bfloat16)[:1, :576], torch.tensor([0], device=device),
                     pool.reshape(-1)[: KvLayout("bf16", 512, 64, 1).bytes_per_page * 2],
                     KvLayout("bf16", 512, 64, 1))


# ------------------------------------------------------------------ indexer


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("form", ["decode_1d", "decode_2d", "rows"])
def test_indexer_logits_ragged(device, gen, fp8, form):
    lens = (37, 5, 64, 90, 1)
    layout, pool, table, keys, _ = _ragged_index_k(gen, device, fp8=fp8)
    b, h, d, page = len(lens), 16, 128, 16
    tokens = refs.index_k_dequant(pool.cpu(), page, d, fp8)
    next_n = 2
    q = torch.randn((b, next_n, h, d), generator=gen).to(torch.bfloat16)
    w = torch.randn((b * next_n, h), generator=gen)
    width = table.shape[1] * page
    if form == "decode_1d":
        cl = torch.tensor(lens, dtype=torch.int32)
        ends = torch.stack([cl - 1, cl], dim=1).clamp_min(0).reshape(-1)
        kw = dict(context_lens=cl.to(device), next_n=next_n)
        if min(lens) < next_n:
            cl = torch.tensor([max(x, next_n) for x in lens], dtype=torch.int32)
            ends = torch.stack([cl - 1, cl], dim=1).reshape(-1)
            kw = dict(context_lens=cl.to(device), next_n=next_n)
            # context 2 > 1 token stored: extend that request's page (already mapped).
    elif form == "decode_2d":
        cl2 = torch.stack([torch.tensor(lens) // 2, torch.tensor(lens)], dim=1).to(torch.int32)
        ends = cl2.reshape(-1)
        kw = dict(context_lens=cl2.to(device), next_n=next_n)
    else:
        starts = torch.tensor([3, 0, 10, 50, 0, 1, 0, 64, 89, 0], dtype=torch.int32)
        ends = torch.tensor([37, 20, 11, 64, 60, 90, 1, 64, 90, 1], dtype=torch.int32)
        req = torch.arange(b * next_n, dtype=torch.int32) // next_n
        ends = torch.minimum(ends, torch.tensor(lens, dtype=torch.int32)[req.long()])
        starts = torch.minimum(starts, ends)
        rows = torch.stack([req, starts, ends], dim=1)
        kw = dict(rows=rows.to(device))
    out = ops.indexer_logits(q.reshape(b * next_n, h, d).to(device), w.to(device), pool,
                             table.to(device), layout, **kw)
    assert out.shape == (b * next_n, width) and out.dtype == torch.float32
    q4 = q
    if form == "rows":
        ref = torch.full((b * next_n, width), float("-inf"))
        for r in range(b * next_n):
            req_, s0, e0 = (int(x) for x in rows[r])
            full = refs.paged_mqa_logits(q4[req_: req_ + 1, r % next_n: r % next_n + 1], tokens,
                                         w[r: r + 1], torch.tensor([e0]),
                                         table[req_: req_ + 1], page, width)
            ref[r, s0:e0] = full[0, s0:e0]
    else:
        ref = refs.paged_mqa_logits(q4, tokens, w, ends, table, page, width)
    inf = ref == float("-inf")
    assert torch.equal(out.cpu() == float("-inf"), inf), "the -inf mask differs"
    mag = (w.abs().sum(1, keepdim=True) * 4 * d).expand_as(ref)  # generous |q||k| scale
    err = (out.cpu() - ref).masked_fill(inf, 0).abs()
    assert not torch.isnan(out).any()
    assert (err <= 2e-5 * mag + 1e-4 * ref.abs().masked_fill(inf, 0)).all(), float(err.max())


def test_indexer_logits_fp8_queries_are_exact_bf16(device, gen):
    layout, pool, table, _, _ = _ragged_index_k(gen, device, lens=(20, 33, 7, 16))
    q = torch.randn((4, 8, 128), generator=gen).to(refs.E4M3)
    w = torch.rand((4, 8), generator=gen)
    cl = torch.tensor([20, 33, 7, 16], dtype=torch.int32, device=device)
    a = ops.indexer_logits(q.to(device), w.to(device), pool, table.to(device), layout, context_lens=cl)
    b = ops.indexer_logits(q.to(torch.bfloat16).to(device), w.to(device), pool, table.to(device), layout,
                           context_lens=cl)
    assert torch.equal(a, b)


def test_indexer_errors(device, gen):
    layout, pool, table, _, _ = _ragged_index_k(gen, device, lens=(20, 33, 7, 16))
    q = torch.randn((4, 8, 128), generator=gen).to(torch.bfloat16).to(device)
    w = torch.rand((4, 8), generator=gen).to(device)
    cl = torch.tensor([20, 33, 7, 16], dtype=torch.int32, device=device)
    t = table.to(device)
    with pytest.raises(TypeError, match="weights"):
        ops.indexer_logits(q, w.double(), pool, t, layout, context_lens=cl)
    with pytest.raises(ValueError, match="weights"):
        ops.indexer_logits(q, w[:, :4], pool, t, layout, context_lens=cl)
    with pytest.raises(ValueError, match="q"):
        ops.indexer_logits(q[..., :64], w, pool, t, layout, context_lens=cl)
    with pytest.raises(ValueError, match="rows"):
        ops.indexer_logits(q, w, pool, t, layout, context_lens=cl[:3])
    with pytest.raises(ValueError, match="rows"):
        ops.indexer_logits(q, w, pool, t, layout)
    with pytest.raises(ValueError, match="out"):
        ops.indexer_logits(q, w, pool, t, layout, context_lens=cl,
                           out=torch.empty((4, 1000), device=device)[:, ::2])
    if device.type == "cpu":
        bad = t.clone()
        bad[1, 0] = 999
        with pytest.raises(ValueError, match="page_table"):
            ops.indexer_logits(q, w, pool, bad, layout, context_lens=cl)
        with pytest.raises(ValueError, match="row 0|rows|row_stride"):
            ops.indexer_logits(q, w, pool, t, layout, context_lens=cl, row_stride=10)
        with pytest.raises(ValueError, match="context_lens"):
            ops.indexer_logits(q, w, pool, t, layout, context_lens=-cl)
        none = torch.zeros((4, 0), dtype=torch.int32)
        with pytest.raises(ValueError, match=r"page_table: has no column .*rows\[0\]"):
            ops.indexer_logits(q, w, pool, none, layout, context_lens=cl, row_stride=40)
        with pytest.raises(ValueError, match=r"page_table: has no column .*rows\[1\]"):
            ops.topk(torch.randn((4, 40)), 4, page_table=none, page_size=16,
                     rows=torch.tensor([[0, 0, 0], [1, 2, 5], [2, 0, 0], [3, 0, 0]]))


# ------------------------------------------------------------------ top-k


@pytest.mark.parametrize("k", [1, 7, 64, 300])
def test_topk_exact_with_ties_nan_and_inf(device, gen, k):
    rows, width = 6, 700
    logits = torch.randint(-20, 20, (rows, width), generator=gen).float()  # many ties
    logits[0, :] = float("-inf")
    logits[1, 5:50] = float("nan")
    logits[2, 100] = float("inf")
    logits[3, :] = 0.0
    logits[3, ::2] = -0.0
    starts = torch.tensor([0, 3, 10, 0, 650, 0], dtype=torch.int32)
    ends = torch.tensor([700, 600, 700, 700, 660, 0], dtype=torch.int32)
    rws = torch.stack([torch.arange(rows, dtype=torch.int32), starts, ends], dim=1)
    out = ops.topk(logits.to(device), k, rows=rws.to(device))
    assert torch.equal(out.cpu(), refs.topk_positions(logits, starts, ends, k))


def test_topk_slots_and_padded_row_stride(device, gen):
    b, page, width = 4, 16, 200
    buf = torch.randn((b, 256), generator=gen)
    logits = buf[:, :width]  # row stride 256 > width: read in place
    table = torch.stack([torch.randperm(13, generator=gen) for _ in range(b)]).to(torch.int32)
    cl = torch.tensor([200, 17, 64, 150], dtype=torch.int32)
    out = ops.topk(logits.to(device) if device.type == "cpu" else buf.to(device)[:, :width], 32,
                   context_lens=cl.to(device), page_table=table.to(device), page_size=page)
    pos = refs.topk_positions(logits, torch.zeros(b), cl, 32)
    req = torch.arange(b)[:, None].expand_as(pos)
    slot = table[req, pos.clamp_min(0).long() // page] * page + pos.clamp_min(0) % page
    assert torch.equal(out.cpu(), torch.where(pos >= 0, slot, pos))


def test_topk_errors(device):
    lg = torch.randn((3, 50), device=device)
    with pytest.raises(TypeError, match="logits"):
        ops.topk(lg.double(), 4)
    with pytest.raises(ValueError, match="k"):
        ops.topk(lg, 0)
    with pytest.raises(ValueError, match="page_size"):
        ops.topk(lg, 4, page_table=torch.zeros((3, 4), dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="out"):
        ops.topk(lg, 4, out=torch.empty((3, 5), dtype=torch.int32, device=device))
    if device.type == "cpu":
        with pytest.raises(ValueError, match="rows"):
            ops.topk(lg, 4, rows=torch.tensor([[0, 0, 51]] * 3, dtype=torch.int32))


# ------------------------------------------------------------------ sparse MLA


def _kv_pool(gen, device, dtype, pages=6, page=16):
    layout = KvLayout(dtype, 512, 64, page)
    n = pages * page
    kv = (torch.randn((n, 576), generator=gen) * torch.rand((n, 1), generator=gen) * 3).to(torch.bfloat16)
    cache = torch.zeros((pages, page, 1, layout.bytes_per_token), dtype=torch.uint8, device=device)
    ops.kv_store(kv.to(device), torch.arange(n, device=device), cache, layout)
    rows = refs.fp8_ds_mla_dequant(cache.cpu().reshape(n, -1)) if dtype == "fp8_ds_mla" else kv
    return layout, cache, rows


@pytest.mark.parametrize("dtype", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("h,topk", [(16, 64), (7, 130)])
def test_sparse_mla_matches_flashmla_reference(device, gen, dtype, h, topk):
    layout, cache, rows = _kv_pool(gen, device, dtype)
    t = 9
    cap = cache.shape[0] * cache.shape[1]
    q = torch.randn((t, h, 576), generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, cap, (t, topk), generator=gen, dtype=torch.int32)
    idx[1, ::3] = -1
    idx[2, :] = -1            # a token with no valid slot
    idx[3, 1] = idx[3, 0]     # duplicates count twice
    scale = 576 ** -0.5
    out, lse = ops.sparse_mla(q.to(device), cache, idx.to(device), layout, scale)
    r_out, r_lse, _, mag = refs.sparse_attn(q, rows, idx, idx >= 0, scale, 512)
    r_lse = r_lse.masked_fill(r_lse == float("inf"), float("-inf"))  # ours: -inf when empty
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[2].cpu(), torch.zeros_like(out[2].cpu()))
    assert bool((lse[2] == float("-inf")).all())
    ok = r_lse != float("-inf")
    assert ((lse.cpu() - r_lse)[ok].abs() <= 1e-4 * (1 + r_lse[ok].abs())).all()
    err = (out.cpu().float() - r_out).abs()
    assert (err <= refs.mla_out_bound(mag, r_out)).all(), float(err.max())


def test_sparse_mla_errors(device, gen):
    layout, cache, _ = _kv_pool(gen, device, "bf16", pages=2)
    q = torch.randn((3, 4, 576), generator=gen).to(torch.bfloat16).to(device)
    idx = torch.zeros((3, 8), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="q"):
        ops.sparse_mla(q[..., :512], cache, idx, layout)
    with pytest.raises(ValueError, match="indices"):
        ops.sparse_mla(q, cache, idx[:2], layout)
    with pytest.raises(TypeError, match="q"):
        ops.sparse_mla(q.float(), cache, idx, layout)
    with pytest.raises(ValueError, match="lse"):
        ops.sparse_mla(q, cache, idx, layout, lse=torch.empty((3, 5), device=device))
    if device.type == "cpu":
        with pytest.raises(ValueError, match="indices\\[1\\]\\[2\\]"):
            bad = idx.clone()
            bad[1, 2] = 10_000
            ops.sparse_mla(q, cache, bad, layout)


# ------------------------------------------------------------------ pages


@pytest.mark.parametrize("kind", ["index_k", "kv"])
def test_copy_pages_and_checksums(device, gen, kind):
    layout = IndexKLayout("fp8_e4m3", 128, 16) if kind == "index_k" else KvLayout("fp8_ds_mla", 512, 64, 4)
    src = torch.randint(0, 256, (6, layout.bytes_per_page), generator=gen, dtype=torch.uint8).to(device)
    dst = torch.zeros((5, layout.bytes_per_page), dtype=torch.uint8, device=device)
    si = torch.tensor([5, 0, 3], dtype=torch.int32, device=device)
    di = torch.tensor([1, 4, 0], dtype=torch.int32, device=device)
    ops.copy_pages(src, dst, si, di, layout)
    expect = torch.zeros_like(dst.cpu())
    expect[di.cpu().long()] = src.cpu()[si.cpu().long()]
    assert torch.equal(dst.cpu(), expect)
    a = ops.page_checksums(src, si, layout)
    b = ops.page_checksums(dst, di, layout)
    assert a.dtype == torch.int64 and torch.equal(a.cpu(), b.cpu())
    c = ops.page_checksums(dst, torch.tensor([2, 3], dtype=torch.int32, device=device), layout)
    assert int(c[0]) == int(c[1]), "two zero pages share a checksum"
    src2 = src.clone()
    src2[5, 17] ^= 1
    assert int(ops.page_checksums(src2, si[:1], layout)[0]) != int(a[0]), "a flipped bit must show"
    if device.type == "cpu":
        with pytest.raises(ValueError, match="dst_ids"):
            ops.copy_pages(src, dst, si, torch.tensor([1, 1, 0], dtype=torch.int32), layout)
        with pytest.raises(ValueError, match="src_ids"):
            ops.copy_pages(src, dst, torch.tensor([6, 0, 0], dtype=torch.int32), di, layout)
    with pytest.raises(ValueError, match="dst"):
        ops.copy_pages(src, dst[:, :10], si, di, layout)
    with pytest.raises(TypeError, match="ids"):
        ops.page_checksums(src, si.float(), layout)


def test_layouts_and_package_surface():
    l = IndexKLayout()
    assert (l.bytes_per_token, l.bytes_per_page) == (132, 8448)
    assert IndexKLayout("bf16").bytes_per_page == 16384
    kv = KvLayout()
    assert (kv.bytes_per_token, kv.bytes_per_page) == (656, 41984)
    assert KvLayout("bf16").bytes_per_token == 1152
    assert l == IndexKLayout() and l != IndexKLayout(scale="ue8m0")
    assert hash(l) == hash(IndexKLayout()) and len({l, IndexKLayout(), KvLayout()}) == 2
    with pytest.raises(ValueError, match="dtype"):
        KvLayout("model1")
    with pytest.raises(ValueError, match="scale"):
        IndexKLayout(scale="e8m0")
    with pytest.raises(ValueError, match="head_dim"):
        IndexKLayout(head_dim=100)
    archs, info, isa = sparsekit.build_info()
    assert isinstance(info, str) and isa
    assert isinstance(sparsekit.cuda_driver_present(), bool)


# ------------------------------------------------------------------ integer metadata


def test_int64_metadata_outside_int32_is_never_wrapped(device, gen):
    """An int64 entry beyond int32 (2**32 + 3 wraps to 3) is refused on CPU; on CUDA it is
    out of range like any other (skipped, clamped), never slot 3 (nor, below int32, a
    wrapped page 0)."""
    layout, cache, _ = _kv_pool(gen, device, "bf16", pages=2)
    q = torch.randn((2, 4, 576), generator=gen).to(torch.bfloat16).to(device)
    idx = torch.randint(0, 32, (2, 5), generator=gen, dtype=torch.int64)
    wide = idx.clone()
    wide[1, 2] = 2**32 + 3
    wide[1, 4] = -(2**40)
    pool = cache.view(-1, layout.bytes_per_page)
    ids = torch.tensor([2**32 + 1], dtype=torch.int64, device=device)
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"indices\[1\]\[2\] = 4294967299 does not fit in int32"):
            ops.sparse_mla(q, cache, wide, layout)
        with pytest.raises(ValueError, match="src_ids"):
            ops.copy_pages(pool, torch.zeros_like(pool), ids, ids.new_zeros(1), layout)
        with pytest.raises(ValueError, match="context_lens"):
            ops.topk(torch.randn((1, 16)), 2, context_lens=torch.tensor([2**32 + 4]))
        return
    skipped = idx.clone()
    skipped[1, 2] = skipped[1, 4] = -1
    got = ops.sparse_mla(q, cache, wide.to(device), layout)
    want = ops.sparse_mla(q, cache, skipped.to(device), layout)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_decode_rows_checks_every_short_context(device):
    if device.type == "cpu":
        for lens, n in (([1], 2), ([0], 1), ([5, 3], 4)):
            with pytest.raises(ValueError, match="shorter than next_n"):
                ops.decode_rows(torch.tensor(lens), n)
        with pytest.raises(ValueError, match=r"context_lens\[0\]\[1\] = -1 is negative"):
            ops.decode_rows(torch.tensor([[3, -1]]), 2)
    else:
        rows = ops.decode_rows(torch.tensor([1], device=device), 2)
        assert rows.cpu().tolist() == [[0, 0, 0], [0, 0, 1]]
    # A [b, next_n] length of 0 is an empty row, and a context of exactly next_n is fine.
    assert ops.decode_rows(torch.tensor([[0, 2]], device=device), 2).cpu().tolist() == [
        [0, 0, 0], [0, 0, 2]]
    assert ops.decode_rows(torch.tensor([2], device=device), 2).cpu().tolist() == [
        [0, 0, 1], [0, 0, 2]]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_decode_rows_match_their_definition(device, gen, dtype):
    """Both forms against the definition, on random lengths (the CPU path is native)."""
    for next_n in (1, 2, 3):
        lens = torch.randint(next_n, 500, (7,), generator=gen)
        got = ops.decode_rows(lens.to(dtype).to(device), next_n).cpu()
        want = [[b, 0, int(lens[b]) - next_n + j + 1] for b in range(7) for j in range(next_n)]
        assert got.dtype == torch.int32 and got.tolist() == want
        lens2 = torch.randint(0, 500, (5, next_n), generator=gen)
        got = ops.decode_rows(lens2.to(dtype).to(device), next_n).cpu()
        want = [[b, 0, int(lens2[b, j])] for b in range(5) for j in range(next_n)]
        assert got.tolist() == want
    # [b, n] with the default next_n takes n; a view with strides is read by value.
    lens2 = torch.randint(0, 500, (4, 6), generator=gen).to(dtype).to(device)
    assert ops.decode_rows(lens2[:, ::2]).cpu().tolist() == [
        [b, 0, int(lens2[b, 2 * j])] for b in range(4) for j in range(3)]
    assert ops.decode_rows(torch.zeros((3, 0), dtype=dtype, device=device)).shape == (0, 3)
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"context_lens\[1\] = 2147483648 does not fit"):
            ops.decode_rows(torch.tensor([5, 2**31, 7]))
        with pytest.raises(ValueError, match=r"context_lens\[2\] = 1: a context shorter"):
            ops.decode_rows(torch.tensor([5, 3, 1], dtype=dtype), 2)
        with pytest.raises(ValueError, match="does not match next_n=2"):
            ops.decode_rows(torch.tensor([[5, 3, 1]], dtype=dtype), 2)


def test_zero_width_logits_and_a_wrong_layout_type(device, gen):
    out = ops.topk(torch.empty((3, 0), device=device), 2)
    assert out.shape == (3, 2) and bool((out == -1).all())
    layout, cache, _ = _kv_pool(gen, device, "bf16", pages=2)
    pool = cache.view(-1, layout.bytes_per_page)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="layout"):
        ops.copy_pages(pool, torch.zeros_like(pool), none, none, "bf16")
    with pytest.raises(TypeError, match="layout"):
        ops.page_checksums(pool, none, "bf16")


def test_negated_views_read_their_values_and_are_never_written(device, gen):
    """torch's lazily negated views keep the values before the negation in memory (and
    ``.contiguous()`` keeps the bit): every input reads the view's values, a written
    tensor with the bit is refused with nothing written, and the native layer refuses the
    bit rather than read the wrong signs."""
    layout, pool, table, _, _ = _ragged_index_k(gen, device, lens=(20, 33, 7, 16))
    q = torch.randn((4, 8, 128), generator=gen).to(torch.bfloat16).to(device)
    w = torch.randn((4, 8), generator=gen).to(device)
    cl = torch.tensor([20, 33, 7, 16], dtype=torch.int32, device=device)
    t = table.to(device)
    want = ops.indexer_logits(-q, -w, pool, t, layout, context_lens=cl)
    got = ops.indexer_logits(torch._neg_view(q), torch._neg_view(w), pool, t, layout,
                             context_lens=cl)
    assert not torch.isnan(want).any() and torch.equal(got, want)
    assert bool((want[:, :7] != 0).any())  # the signs matter: ReLU of the dot products

    buf = torch.randn((4, 256), generator=gen).to(device)
    logits = buf[:, :200]  # a padded row stride, otherwise read in place
    assert torch.equal(ops.topk(torch._neg_view(logits), 16), ops.topk(-logits, 16))

    out = torch.full((4, table.shape[1] * layout.page_size), 7.0, device=device)
    with pytest.raises(ValueError, match="out.*negated"):
        ops.indexer_logits(q, w, pool, t, layout, context_lens=cl, out=torch._neg_view(out))
    assert bool((out == 7.0).all())

    rows = torch.stack([torch.arange(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                        cl.cpu()], dim=1).to(device)
    with pytest.raises(ValueError, match="q: .*negated.*resolve_neg"):
        sparsekit._native.indexer_logits(layout, torch._neg_view(q), w, pool, t, rows,
                                         out, None)
    assert bool((out == 7.0).all())


def test_no_backward_and_in_place_writes_seen_by_autograd(device, gen):
    """The ops have no backward: under grad mode a tensor that requires grad is refused
    (its gradient would silently miss the op), under no_grad it is fine; an in-place write
    bumps the tensor's autograd version, so a graph that saved it refuses its backward."""
    layout = KvLayout("bf16", 512, 64, 16)
    cache = torch.zeros((2, 16, 1, layout.bytes_per_token), dtype=torch.uint8, device=device)
    kv = torch.randn((5, 576), generator=gen).to(torch.bfloat16).to(device)
    slots = torch.tensor([3, 17, 0, 30, 9], device=device)
    ops.kv_store(kv, slots, cache, layout)
    q = torch.randn((3, 4, 576), generator=gen).to(torch.bfloat16).to(device)
    idx = torch.tensor([[3, 17, 0], [30, 9, -1], [0, 0, 3]], dtype=torch.int32, device=device)
    want, _ = ops.sparse_mla(q, cache, idx, layout)
    assert bool((want != 0).any())

    qg = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="q: requires grad.*no backward"):
        ops.sparse_mla(qg, cache, idx, layout)
    with torch.no_grad():
        got, _ = ops.sparse_mla(qg, cache, idx, layout)
    assert torch.equal(got, want)

    w = torch.ones(4, dtype=torch.bfloat16, device=device, requires_grad=True)
    out = torch.full((3, 4, 512), 1.0, dtype=torch.bfloat16, device=device)
    loss = (out * w[None, :, None]).sum()  # saves `out` for w's gradient
    v = out._version
    ops.sparse_mla(q, cache, idx, layout, out=out)
    assert out._version > v and torch.equal(out, want)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

    v = cache._version
    ops.kv_store(kv[:1], torch.tensor([1], device=device), cache, layout)
    assert cache._version > v

    # A pool made under inference mode (a serving engine's) is written from grad mode too.
    with torch.inference_mode():
        pool = torch.zeros_like(cache)
    ops.kv_store(kv, slots, pool, layout)
    assert torch.equal(ops.sparse_mla(q, pool, idx, layout)[0], want)


def test_tensors_without_memory_are_made_real_or_refused(device, gen):
    """A lazily zero tensor has no memory (data_ptr() 0): an input one reads as zeros, and
    the native layer refuses any tensor with elements at address 0 instead of touching it."""
    layout = KvLayout("bf16", 512, 64, 16)
    cache = torch.zeros((2, 16, 1, layout.bytes_per_token), dtype=torch.uint8, device=device)
    ops.kv_store(torch.randn((32, 576), generator=gen).to(torch.bfloat16).to(device),
                 torch.arange(32, device=device), cache, layout)
    idx = torch.tensor([[3, 17, 0]] * 2, dtype=torch.int32, device=device)
    zq = torch._efficientzerotensor((2, 4, 576), dtype=torch.bfloat16, device=device)
    assert zq.data_ptr() == 0
    out, lse = ops.sparse_mla(zq, cache, idx, layout)
    ref, ref_lse = ops.sparse_mla(torch.zeros((2, 4, 576), dtype=torch.bfloat16, device=device),
                                  cache, idx, layout)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert bool((out != 0).any())  # zero scores: the mean of the three values
    lse_out = torch.empty((2, 4), device=device)
    with pytest.raises(ValueError, match="q: has no memory"):
        sparsekit._native.sparse_mla(layout, zq, cache, idx, torch.empty_like(out), lse_out, 0.1)
