"""Torch reference maths, written from the anchors' published references (FlashMLA
``tests/ref.py`` + ``tests/quant.py`` at 9241ae3e, DeepGEMM ``tests/test_attention.py`` at
54e22612, sgl-kernel's ``topk.cu`` semantics) and DeepSeek's quantiser conventions
(``docs/golden.md``) — never from sparsekit's Rust code. Plain, slow, float32/float64."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


# ------------------------------------------------------------------ quantisers


def index_k_quant(keys: torch.Tensor, ue8m0: bool = False):
    """DeepSeek / DeepGEMM index-K fp8: per token scale ``max(amax, 1e-4) / 448`` (or its
    power of two rounded up), codes of ``x / scale``. Returns (codes uint8 [n, d],
    scales float32 [n])."""
    x = keys.float()
    amax = x.abs().amax(dim=1).clamp_min(1e-4)
    sf = amax / 448.0
    if ue8m0:
        sf = torch.pow(2.0, torch.ceil(torch.log2(sf)))
    codes = (x / sf[:, None]).to(E4M3).view(torch.uint8)
    return codes, sf


def index_k_page_bytes(codes, scales, slots, num_pages, page_size, d):
    """The fp8 index-K pool (per page: values, then f32 scales) with tokens at ``slots``."""
    page = page_size * (d + 4)
    pool = torch.zeros(num_pages * page, dtype=torch.uint8)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        p, o = divmod(s, page_size)
        base = p * page
        pool[base + o * d: base + (o + 1) * d] = codes[t]
        so = base + page_size * d + 4 * o
        pool[so: so + 4] = scales[t: t + 1].view(torch.uint8)
    return pool.reshape(num_pages, page)


def index_k_dequant(pool: torch.Tensor, page_size: int, d: int, fp8: bool):
    """All tokens of a pool as float32 ``[num_pages * page_size, d]``."""
    n = pool.shape[0]
    flat = pool.reshape(n, -1)
    if not fp8:
        return flat.view(torch.bfloat16).reshape(n * page_size, d).float()
    vals = flat[:, : page_size * d].reshape(n * page_size, d).view(E4M3).float()
    sc = flat[:, page_size * d:].contiguous().view(torch.float32).reshape(n * page_size)
    return vals * sc[:, None]


def fp8_ds_mla_quant(kv: torch.Tensor):
    """FlashMLA ``quantize_k_cache`` (V32_FP8Sparse) per token: 512 e4m3 (4 tiles of 128,
    scale ``2^ceil(log2(max(amax / 448, 1e-4)))``), 4 f32 scales, 64 bf16 RoPE: uint8
    ``[n, 656]`` (general nope / rope)."""
    n, dqk = kv.shape
    nope = dqk - 64 if dqk == 576 else None
    raise_if = nope is None
    if raise_if:
        raise ValueError("reference written for d_qk 576")
    tiles = nope // 128
    out = torch.empty((n, nope + 4 * tiles + 128), dtype=torch.uint8)
    x = kv.float()
    for t in range(tiles):
        part = x[:, t * 128:(t + 1) * 128]
        inv = part.abs().amax(dim=1) / 448.0
        sc = torch.pow(2.0, torch.clamp_min(inv, 1e-4).log2().ceil())
        out[:, t * 128:(t + 1) * 128] = (part / sc[:, None]).to(E4M3).view(torch.uint8)
        out[:, nope + 4 * t: nope + 4 * t + 4] = sc.contiguous().view(torch.uint8).reshape(n, 4)
    out[:, nope + 4 * tiles:] = kv[:, nope:].contiguous().view(torch.uint8).reshape(n, 128)
    return out


def fp8_ds_mla_dequant(tokens: torch.Tensor, nope: int = 512):
    """FlashMLA ``dequantize_k_cache`` (V32_FP8Sparse): uint8 ``[n, 656]`` -> bf16
    ``[n, 576]``."""
    n = tokens.shape[0]
    tiles = nope // 128
    res = torch.empty((n, nope + 64), dtype=torch.bfloat16)
    vals = tokens[:, :nope].contiguous().view(E4M3).float()
    sc = tokens[:, nope: nope + 4 * tiles].contiguous().view(torch.float32)
    for t in range(tiles):
        res[:, t * 128:(t + 1) * 128] = vals[:, t * 128:(t + 1) * 128] * sc[:, t: t + 1]
    res[:, nope:] = tokens[:, nope + 4 * tiles:].contiguous().view(torch.bfloat16)
    return res


# ------------------------------------------------------------------ indexer (DeepGEMM)


def mqa_logits(q, k, weights, starts, ends):
    """DeepGEMM ``ref_fp8_mqa_logits``: ``logits[m, n] = Σ_h relu(q[m,h]·k[n]) · w[m,h]``
    for ``starts[m] <= n < ends[m]``, else -inf. q ``[M, H, D]``, k ``[N, D]`` float."""
    q, k = q.float(), k.float()
    score = torch.einsum("mhd,nd->hmn", q, k)
    logits = torch.einsum("hmn,hm->mn", score.relu(), weights.float().t())
    cols = torch.arange(k.shape[0])
    mask = (cols[None, :] >= starts[:, None].long()) & (cols[None, :] < ends[:, None].long())
    return logits.masked_fill(~mask, float("-inf"))


def paged_mqa_logits(q, kv_tokens, weights, ends, block_table, page_size, width):
    """DeepGEMM ``ref_paged_mqa_logits`` in the 2-D context-lens form: row ``r`` (of
    request ``r // next_n``) sees positions ``[0, ends[r])`` of its request's pages.
    ``q`` ``[b, next_n, H, D]``, ``kv_tokens`` float ``[num_pages * page_size, D]``."""
    b, next_n, h, d = q.shape
    out = torch.full((b * next_n, width), float("-inf"))
    for r in range(b * next_n):
        req = r // next_n
        e = int(ends[r])
        if e <= 0:
            continue
        pos = torch.arange(e)
        slots = block_table[req, pos // page_size].long() * page_size + pos % page_size
        k = kv_tokens[slots]
        s = q[req, r % next_n].float() @ k.t()  # [H, e]
        out[r, :e] = (s.relu() * weights[r].float()[:, None]).sum(0)
    return out


# ------------------------------------------------------------------ top-k


def topk_positions(logits, starts, ends, k):
    """Exact top-k of ``logits[r, starts[r]:ends[r]]`` (NaN and -inf excluded, ties to the
    lower position), ascending positions, -1 padded: ``int32 [rows, k]``."""
    rows = logits.shape[0]
    out = torch.full((rows, k), -1, dtype=torch.int32)
    for r in range(rows):
        s, e = int(starts[r]), int(ends[r])
        v = logits[r, s:e].double()
        valid = ~torch.isnan(v) & (v != float("-inf"))
        key = torch.where(valid, v, torch.full_like(v, float("-inf")))
        order = torch.sort(key, descending=True, stable=True).indices
        take = [int(i) for i in order[: min(k, int(valid.sum()))]]
        take.sort()
        if take:
            out[r, : len(take)] = torch.tensor(take, dtype=torch.int32) + s
    return out


# ------------------------------------------------------------------ sparse attention (FlashMLA)


def sparse_attn(q, kv_rows, indices, valid, sm_scale, d_v, attn_sink=None):
    """FlashMLA ``ref_sparse_attn_decode`` / ``ref_sparse_attn_fwd``: per token, softmax
    over the valid gathered rows. ``q`` ``[T, H, D]``, ``kv_rows`` float ``[S, D]`` (the
    dequantised cache rows), ``indices`` ``[T, K]``, ``valid`` bool ``[T, K]``. Returns
    (out float32 [T, H, d_v] with 0 for an empty token, lse [T, H] natural log with +inf for
    an empty token, max_logits [T, H], magnitude [T, H, d_v]: Σ_j p_j |v_j|, the scale of
    the bf16 output's error bound)."""
    t, h, d = q.shape
    idx = torch.where(valid, indices.long(), torch.zeros_like(indices.long()))
    g = kv_rows.float().index_select(0, idx.reshape(-1)).reshape(t, -1, d)
    g = torch.where(valid[..., None], g, torch.zeros_like(g))
    w = torch.einsum("thd,tkd->thk", q.float(), g) * sm_scale
    w = w.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(w, dim=-1)
    max_logits = w.amax(dim=-1) if w.shape[-1] else torch.full((t, h), float("-inf"))
    p = torch.exp(w - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("thk,tkd->thd", p, g[..., :d_v])
    mag = torch.einsum("thk,tkd->thd", p, g[..., :d_v].abs())
    if attn_sink is not None:
        f = (1.0 / (1.0 + torch.exp(attn_sink[None, :] - lse)))[..., None]
        out, mag = out * f, mag * f
    lonely = lse == float("-inf")
    out[lonely] = 0.0
    mag[lonely] = 0.0
    lse = lse.masked_fill(lonely, float("inf"))
    return out, lse, max_logits, mag


def mla_out_bound(p_weights_abs_v, ref_out):
    """FlashMLA-style bf16 output bound (docs/golden.md): 2u/(1-u) · A + 2^-8 |ref|."""
    u = 2.0 ** -8
    return 2 * u / (1 - u) * p_weights_abs_v + u * ref_out.abs() + 1e-6
