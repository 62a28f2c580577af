#!/usr/bin/env python3
"""Writes sparsekit golden files (format: docs/golden.md) from an implementation of every
op in NumPy + ml_dtypes that shares no code with sparsekit, in sparsekit's conventions and,
for each convention a real dump may follow (docs/golden.md), one file that states it:
DeepSeek/SGLang index-K scales, DeepGEMM quantisation and bf16 logits, DeepSeek-V3.2
prefill top-k padding, FlashMLA decode lse and indices. DeepSeek-V4's caches and ops
(MODEL1 fp8 and bf16_512 KV, fp4 index keys) are in golden_v4.py.

    python3 make_golden.py OUT_DIR [--seed N]

One safetensors file per op and cache dtype: stores byte-exact, indexer logits and
sparse MLA in float64 (rounded once to the output dtype), top-k exact with ties to the
lower position (a stable sort). Batches are small, random and ragged: >= 4 requests,
shuffled non-contiguous pages with garbage in unused ones, -1 slots, a row shorter than k.
The seed is fresh unless given; it is printed and stored in each file's metadata.
Saturating fp8 cast: np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).
"""
import argparse
import json
import math
import os

import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_v4  # noqa: E402  (DeepSeek-V4 caches and ops)

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
F32 = np.float32
TILE = 128  # fp8_ds_mla values per scale

# Dims: stores at DeepSeek-V3.2 sizes, the rest at the tiny model's (two fp8 tiles).
DSV32 = dict(index_head_dim=128, page_size=64, nope=512, rope=64)
TINY = dict(index_head_dim=64, index_heads=8, page_size=16, nope=256, rope=32, q_heads=16, topk=64)


def encode_e4m3(x):
    """f32 -> e4m3fn codes: round to nearest even, saturate to +-448."""
    x = np.asarray(x, dtype=F32)
    return np.clip(x, F32(-448), F32(448)).astype(E4M3).view(np.uint8)


def decode_e4m3(codes):
    return np.asarray(codes, dtype=np.uint8).view(E4M3).astype(np.float64)


def pow2_ceil(s):
    m, e = np.frexp(F32(s))  # s = m * 2^e, m in [0.5, 1)
    return F32(s) if m == 0.5 else F32(np.ldexp(F32(1), e))


def bytes_f32(x):
    return np.asarray(x, dtype=F32).reshape(-1).view(np.uint8)


# ---------------------------------------------------------------------------- fixtures

def token_rows(rng, n, dim):
    """bf16 rows with a random magnitude per row: tiny (below the 1e-4 scale floor),
    large (300), 2^U(-6, 4) with an outlier beyond 448, or plain 2^U(-6, 4)."""
    out = np.empty((n, dim))
    for i in range(n):
        kind = i if i < 3 else int(rng.integers(20))
        scale = {0: 1e-6, 1: 300.0}.get(kind, 2.0 ** rng.uniform(-6, 4))
        out[i] = rng.standard_normal(dim) * scale
        if kind == 2:
            out[i, rng.integers(dim)] = 2000.0 if rng.integers(2) else -1500.0
    return out.astype(BF16)


class Paging:
    """Per-request page tables over a pool of shuffled pages (plus `spare` unused ones);
    rows padded with -1 to one more page than the longest request needs."""

    def __init__(self, rng, page_size, lens, spare=2):
        need = [-(-int(n) // page_size) for n in lens]
        self.page_size, self.lens = page_size, [int(n) for n in lens]
        self.num_pages = sum(need) + spare
        ids = iter(rng.permutation(self.num_pages))
        self.table = np.full((len(lens), max(need) + 1), -1, dtype=np.int32)
        for r, n in enumerate(need):
            for p in range(n):
                self.table[r, p] = next(ids)

    def slot(self, r, pos):
        return int(self.table[r, pos // self.page_size]) * self.page_size + pos % self.page_size

    def all_slots(self):
        return [self.slot(r, p) for r, n in enumerate(self.lens) for p in range(n)]


def garbage(rng, pages, bytes_per_page):
    return rng.integers(0, 256, size=(pages, bytes_per_page), dtype=np.uint8)


def store_batch(rng, page_size):
    """5 requests with existing tokens and new ones (the first crossing a page); returns
    the paging and the new tokens' slots with -1 entries mixed in."""
    existing = rng.integers(0, 200, 5)
    new = [page_size + 1] + list(rng.integers(1, 41, 4))
    paging = Paging(rng, page_size, existing + np.array(new))
    slots = []
    for r in range(5):
        slots += [paging.slot(r, p) for p in range(existing[r], existing[r] + new[r])]
        if r % 2 == 1:
            slots.append(-1)
    return paging, np.array(slots, dtype=np.int64)


# ---------------------------------------------------------------------------- index-K

class IndexK:
    """Paged index-K: fp8 pages hold all e4m3 values, then one f32 scale per token;
    bf16 pages hold bf16 values only. `scale_rule` / `quantize`: "divide" (sparsekit's
    amax / 448, x / s) or "reciprocal" (DeepSeek's and SGLang's amax * f32(1/448),
    DeepGEMM's x * (1/s))."""

    def __init__(self, dtype, scale, head_dim, page_size, scale_rule="divide", quantize="divide"):
        self.dtype, self.scale, self.d, self.ps = dtype, scale, head_dim, page_size
        self.scale_rule, self.quantize = scale_rule, quantize
        self.value_bytes = head_dim if dtype == "fp8_e4m3" else 2 * head_dim
        self.bytes_per_page = page_size * (self.value_bytes + (4 if dtype == "fp8_e4m3" else 0))

    def params(self):
        p = dict(version=1, dtype=self.dtype, head_dim=self.d, page_size=self.ps)
        if self.dtype == "fp8_e4m3":
            p["scale"] = self.scale
        conventions = {k: v for k, v in [("scale", self.scale_rule), ("quantize", self.quantize)]
                       if v != "divide"}
        if conventions:
            p["conventions"] = conventions
        return p

    def store(self, cache, keys, slots):
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            page, off = divmod(int(slot), self.ps)
            values = slice(off * self.value_bytes, (off + 1) * self.value_bytes)
            if self.dtype == "bf16":
                cache[page, values] = keys[t].view(np.uint8)
                continue
            k = keys[t].astype(F32)
            amax = np.maximum(np.abs(k).max(), F32(1e-4))
            if self.scale_rule == "reciprocal":
                s = F32(amax * (F32(1) / F32(448)))
            else:
                s = F32(amax / F32(448))
            if self.scale == "ue8m0":
                s = pow2_ceil(s)
            if self.quantize == "reciprocal":
                cache[page, values] = encode_e4m3(k * (F32(1) / F32(s)))
            else:
                cache[page, values] = encode_e4m3(k / F32(s))
            at = self.ps * self.d + 4 * off
            cache[page, at:at + 4] = bytes_f32(s)

    def read(self, cache, slot):
        """(values as float64, scale) of the key at `slot`."""
        page, off = divmod(int(slot), self.ps)
        raw = cache[page, off * self.value_bytes:(off + 1) * self.value_bytes]
        if self.dtype == "bf16":
            return raw.view(BF16).astype(np.float64), 1.0
        at = self.ps * self.d + 4 * off
        return decode_e4m3(raw), float(cache[page, at:at + 4].view(F32)[0])


# ---------------------------------------------------------------------------- MLA KV

class Kv:
    """Paged MLA KV, token-major: bf16 tokens are [nope | rope] bf16; fp8_ds_mla tokens
    are nope e4m3 bytes, one f32 scale per 128-value tile, then rope bf16."""

    def __init__(self, dtype, nope, rope, page_size):
        self.dtype, self.nope, self.rope, self.ps = dtype, nope, rope, page_size
        self.tiles = nope // TILE
        nope_bytes = 2 * nope if dtype == "bf16" else nope + 4 * self.tiles
        self.rope_at = nope_bytes
        self.token_bytes = nope_bytes + 2 * rope
        self.bytes_per_page = page_size * self.token_bytes

    def params(self):
        return dict(version=1, dtype=self.dtype, nope_dim=self.nope, rope_dim=self.rope, page_size=self.ps)

    def token(self, cache, slot):
        page, off = divmod(int(slot), self.ps)
        return cache[page, off * self.token_bytes:(off + 1) * self.token_bytes]

    def store(self, cache, kv, slots):
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            tok = self.token(cache, slot)
            if self.dtype == "bf16":
                tok[:] = kv[t].view(np.uint8)
                continue
            for i in range(self.tiles):
                x = kv[t, i * TILE:(i + 1) * TILE].astype(F32)
                s = pow2_ceil(np.maximum(np.abs(x).max() / F32(448), F32(1e-4)))
                tok[i * TILE:(i + 1) * TILE] = encode_e4m3(x / s)
                tok[self.nope + 4 * i:self.nope + 4 * i + 4] = bytes_f32(s)
            tok[self.rope_at:] = kv[t, self.nope:].view(np.uint8)

    def read(self, cache, slot):
        """The dequantised [nope | rope] of the token at `slot`, float64."""
        tok = self.token(cache, slot)
        rope = tok[self.rope_at:].view(BF16).astype(np.float64)
        if self.dtype == "bf16":
            nope = tok[:2 * self.nope].view(BF16).astype(np.float64)
        else:
            scales = tok[self.nope:self.nope + 4 * self.tiles].view(F32).astype(np.float64)
            nope = decode_e4m3(tok[:self.nope]) * np.repeat(scales, TILE)
        return np.concatenate([nope, rope])


# ---------------------------------------------------------------------------- ops

def decode_rows(context_lens, next_n):
    """(request, start, end) rows of the decode form: row j of request r sees
    [0, L - next_n + j + 1)."""
    return [(r, 0, int(n) - next_n + j + 1) for r, n in enumerate(context_lens) for j in range(next_n)]


def prefill_rows(rng, lens):
    """Up to 3 causal queries at each request's last positions, plus a window row with
    start > 0 for every other request."""
    rows = []
    for r, n in enumerate(lens):
        nq = min(int(rng.integers(1, 4)), n)
        rows += [(r, 0, n - nq + i + 1) for i in range(nq)]
        if r % 2 == 1 and n > 2:
            rows.append((r, int(rng.integers(1, n - 1)), n))
    return rows


def indexer_logits(index_k, cache, paging, rows, q, w, row_stride, bf16_keys=False):
    """I[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s]) * scale[s] in float64, -inf outside
    the row's range. With `bf16_keys` (DeepGEMM's reference), each key is dequantised as
    bf16(e4m3 * scale) first and used with scale 1."""
    out = np.full((len(rows), row_stride), -np.inf)
    for i, (r, start, end) in enumerate(rows):
        keys = [index_k.read(cache, paging.slot(r, p)) for p in range(start, end)]
        if not keys:
            continue
        k = np.stack([v for v, _ in keys])
        s = np.array([sc for _, sc in keys])
        if bf16_keys:
            k = (k * s[:, None]).astype(F32).astype(BF16).astype(np.float64)
            s = np.ones_like(s)
        dots = q[i].astype(np.float64) @ k.T  # [heads, positions]
        out[i, start:end] = (w[i].astype(np.float64)[:, None] * np.maximum(dots, 0)).sum(0) * s
    return out


def topk(logits, rows, k, to_entry):
    """Exact top-k of each row's range, ignoring -inf and NaN; ties to the lower position
    (stable sort); ascending position order; -1 padding."""
    out = np.full((len(rows), k), -1, dtype=np.int32)
    for i, (r, start, end) in enumerate(rows):
        vals = logits[i, start:end]
        valid = np.nonzero(~np.isnan(vals) & (vals != -np.inf))[0]
        best = valid[np.argsort(-vals[valid], kind="stable")[:k]]
        out[i, :len(best)] = [to_entry(r, start + p) for p in np.sort(best)]
    return out


def sparse_mla(kv, cache, q, indices, softmax_scale, capacity=None, empty_lse=-np.inf):
    """Per token and head, softmax(scale * q.k) over the valid slots, in float64:
    out = sum_j p_j v_j, lse = ln sum_j exp(scale * q.k_j); no slot: out 0, lse
    `empty_lse`. Valid: >= 0, and below `capacity` when given (FlashMLA skips the rest)."""
    t_n, h, _ = q.shape
    out = np.zeros((t_n, h, kv.nope))
    lse = np.full((t_n, h), empty_lse)
    for t in range(t_n):
        ok = indices[t] >= 0
        if capacity is not None:
            ok &= indices[t] < capacity
        slots = indices[t][ok]
        if len(slots) == 0:
            continue
        keys = np.stack([kv.read(cache, s) for s in slots])
        scores = float(softmax_scale) * (q[t].astype(np.float64) @ keys.T)  # [h, n]
        m = scores.max(axis=1, keepdims=True)
        p = np.exp(scores - m)
        total = p.sum(axis=1, keepdims=True)
        lse[t] = (m + np.log(total))[:, 0]
        out[t] = (p / total) @ keys[:, :kv.nope]
    return out.astype(BF16), lse.astype(F32)


# ---------------------------------------------------------------------------- files

def save(out_dir, name, op, params, tensors, seed):
    path = os.path.join(out_dir, f"{name}.safetensors")
    meta = {"op": op, "params": json.dumps(params), "seed": str(seed),
            "generator": "validation/python/make_golden.py"}
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path, metadata=meta)
    return path


def store_files(rng, out_dir, seed):
    d = DSV32
    paths = []
    for dtype, scale in [("fp8_e4m3", "fp32"), ("fp8_e4m3", "ue8m0"), ("bf16", None)]:
        layout = IndexK(dtype, scale, d["index_head_dim"], d["page_size"])
        paging, slots = store_batch(rng, layout.ps)
        cache_in = garbage(rng, paging.num_pages, layout.bytes_per_page)
        keys = token_rows(rng, len(slots), layout.d)
        cache_out = cache_in.copy()
        layout.store(cache_out, keys, slots)
        name = f"index_k_store_{dtype}" + (f"_{scale}" if scale == "ue8m0" else "")
        paths.append(save(out_dir, name, "index_k_store", layout.params(),
                          dict(keys=keys, slots=slots, cache_in=cache_in, cache_out=cache_out), seed))
    for dtype in ["bf16", "fp8_ds_mla"]:
        layout = Kv(dtype, d["nope"], d["rope"], d["page_size"])
        paging, slots = store_batch(rng, layout.ps)
        cache_in = garbage(rng, paging.num_pages, layout.bytes_per_page)
        kv = token_rows(rng, len(slots), layout.nope + layout.rope)
        cache_out = cache_in.copy()
        layout.store(cache_out, kv, slots)
        paths.append(save(out_dir, f"kv_store_{dtype}", "kv_store", layout.params(),
                          dict(kv=kv, slots=slots, cache_in=cache_in, cache_out=cache_out), seed))
    # Dumps of other deployments' quantisers, stating their conventions: DeepSeek-V3.2's
    # and SGLang's index-K scale amax * f32(1/448); DeepGEMM's kv_cache_cast_to_fp8 values
    # x * (1/s). 600 tokens, so that the rule changes some bytes.
    for name, scale_rule, quantize in [("scale_reciprocal", "reciprocal", "divide"),
                                       ("deepgemm", "divide", "reciprocal")]:
        layout = IndexK("fp8_e4m3", "fp32", d["index_head_dim"], d["page_size"], scale_rule, quantize)
        pages = 12
        slots = rng.permutation(pages * layout.ps)[:600].astype(np.int64)
        slots[::97] = -1
        cache_in = garbage(rng, pages, layout.bytes_per_page)
        keys = token_rows(rng, len(slots), layout.d)
        cache_out = cache_in.copy()
        layout.store(cache_out, keys, slots)
        ours = cache_in.copy()
        IndexK("fp8_e4m3", "fp32", d["index_head_dim"], d["page_size"]).store(ours, keys, slots)
        assert not np.array_equal(ours, cache_out), "the convention changes no byte"
        paths.append(save(out_dir, f"index_k_store_fp8_e4m3_{name}", "index_k_store", layout.params(),
                          dict(keys=keys, slots=slots, cache_in=cache_in, cache_out=cache_out), seed))
    return paths


def ragged_lens(rng, page_size, longest):
    """>= 4 unequal context lengths: 2, page - 1, page + 1, and random ones."""
    extra = rng.integers(3, longest, int(rng.integers(1, 4)))
    return [2, page_size - 1, page_size + 1] + [int(n) for n in extra]


def indexer_files(rng, out_dir, seed):
    d = TINY
    paths = []
    for dtype, scale, form in [("fp8_e4m3", "fp32", "decode"), ("fp8_e4m3", "ue8m0", "prefill"),
                               ("bf16", None, "decode"), ("bf16", None, "prefill")]:
        layout = IndexK(dtype, scale, d["index_head_dim"], d["page_size"])
        lens = ragged_lens(rng, layout.ps, 300)
        paging = Paging(rng, layout.ps, lens, spare=3)
        cache = garbage(rng, paging.num_pages, layout.bytes_per_page)
        layout.store(cache, token_rows(rng, sum(lens), layout.d), paging.all_slots())
        params = layout.params()
        tensors = dict(cache=cache, page_table=paging.table)
        if form == "decode":
            params["next_n"] = 2
            rows = decode_rows(lens, 2)
            tensors["context_lens"] = np.array(lens, dtype=np.int32)
        else:
            rows = prefill_rows(rng, lens)
            tensors["rows"] = np.array(rows, dtype=np.int32)
        h, n = d["index_heads"], len(rows)
        row_stride = max(end for _, _, end in rows) + 13
        q = rng.standard_normal((n, h, layout.d)).astype(BF16)
        w = (rng.standard_normal((n, h)) / math.sqrt(h * layout.d)).astype(F32)
        params.update(n_heads=h, row_stride=row_stride)
        logits = indexer_logits(layout, cache, paging, rows, q, w, row_stride).astype(F32)
        tensors.update(q=q, weights=w, logits=logits)
        name = f"indexer_logits_{dtype}" + ("_ue8m0" if scale == "ue8m0" else "") + f"_{form}"
        paths.append(save(out_dir, name, "indexer_logits", params, tensors, seed))
    # A DeepGEMM-style dump: keys dequantised to bf16 before the dots, logits in bf16.
    layout = IndexK("fp8_e4m3", "fp32", d["index_head_dim"], d["page_size"])
    lens = ragged_lens(rng, layout.ps, 300)
    paging = Paging(rng, layout.ps, lens, spare=3)
    cache = garbage(rng, paging.num_pages, layout.bytes_per_page)
    layout.store(cache, token_rows(rng, sum(lens), layout.d), paging.all_slots())
    rows = decode_rows(lens, 1)
    h, n = d["index_heads"], len(rows)
    row_stride = max(lens) + 5
    q = rng.standard_normal((n, h, layout.d)).astype(BF16)
    w = (rng.standard_normal((n, h)) / math.sqrt(h * layout.d)).astype(F32)
    logits = indexer_logits(layout, cache, paging, rows, q, w, row_stride, bf16_keys=True).astype(BF16)
    params = layout.params()
    params.update(n_heads=h, row_stride=row_stride, next_n=1, conventions={"key_dequant": "bf16"})
    paths.append(save(out_dir, "indexer_logits_fp8_e4m3_deepgemm", "indexer_logits", params,
                      dict(cache=cache, page_table=paging.table, context_lens=np.array(lens, dtype=np.int32),
                           q=q, weights=w, logits=logits), seed))
    return paths


def topk_logits(rng, rows, row_stride, k):
    """Normal logits; the first row all equal, the second with thousands of ties at the
    threshold, the third with -inf, NaN and signed zeros."""
    logits = np.full((len(rows), row_stride), -np.inf, dtype=F32)
    for i, (_, _, end) in enumerate(rows):
        row = rng.standard_normal(end).astype(F32)
        if i == 0:
            row[:] = F32(1.5)
        elif i == 1:
            row = np.minimum(row, F32(0.5))
            row[rng.integers(0, end, k // 2)] = F32(10) + rng.random(k // 2).astype(F32)
            row[rng.integers(0, end, k + 3000)] = F32(0.75)
        elif i == 2:
            kind = rng.integers(0, 10, end)
            row[kind == 0], row[kind == 1], row[kind == 2], row[kind == 3] = -np.inf, np.nan, -0.0, 0.0
        logits[i, :end] = row
    return logits


def topk_files(rng, out_dir, seed):
    k, ps = TINY["topk"], TINY["page_size"]
    paths = []
    # Positions output, explicit rows (some windows with start > 0).
    lens = [5000, 6000, 300, k - 1, k, k + 1, 10]
    rows = [(r, 0, n) for r, n in enumerate(lens)] + [(0, 100, 900), (2, 250, 300)]
    row_stride = max(lens) + 7
    logits = topk_logits(rng, rows, row_stride, k)
    params = dict(version=1, k=k, row_stride=row_stride, output="positions")
    out = topk(logits, rows, k, lambda r, pos: pos)
    paths.append(save(out_dir, "topk_positions", "topk", params,
                      dict(logits=logits, rows=np.array(rows, dtype=np.int32), topk=out), seed))
    # Slots output, decode form (next_n = 1).
    lens = [4100, 4100, 700, 10, k + 1]
    paging = Paging(rng, ps, lens, spare=1)
    rows = decode_rows(lens, 1)
    row_stride = max(lens) + 3
    logits = topk_logits(rng, rows, row_stride, k)
    params = dict(version=1, k=k, row_stride=row_stride, output="slots", page_size=ps, next_n=1)
    out = topk(logits, rows, k, paging.slot)
    paths.append(save(out_dir, "topk_slots", "topk", params,
                      dict(logits=logits, context_lens=np.array(lens, dtype=np.int32),
                           page_table=paging.table, topk=out), seed))
    # DeepSeek-V3.2 prefill: torch.topk over causally masked rows lists masked positions
    # (logit -inf) where a row has fewer than k valid entries; logits and top-k keep its
    # [batch, seq_len, ...] shape.
    n_rows, row_stride = 9, 3 * k
    rows = [(0, 0, e) for e in [1, 5, k - 1, k, k + 1, 2 * k, 3, 17, 3 * k]]
    logits = np.full((n_rows, row_stride), -np.inf, dtype=F32)
    for i, (_, _, e) in enumerate(rows):
        logits[i, :e] = rng.standard_normal(e).astype(F32)
    out = np.empty((n_rows, k), dtype=np.int32)
    for i in range(n_rows):
        order = np.argsort(-logits[i], kind="stable")  # -inf last, in position order
        out[i] = order[:k]
    params = dict(version=1, k=k, row_stride=row_stride, output="positions",
                  conventions={"topk_padding": "masked_positions"})
    paths.append(save(out_dir, "topk_positions_masked_padding", "topk", params,
                      dict(logits=logits[None], rows=np.array(rows, dtype=np.int32), topk=out[None]),
                      seed))
    return paths


def mla_indices(rng, paging, n_tokens, topk_n):
    """Token 0 has no valid slot, token 1 fewer than topk, the others min(topk, len)
    distinct random positions of their request; shuffled with -1 entries."""
    idx = np.full((n_tokens, topk_n), -1, dtype=np.int32)
    for t in range(n_tokens):
        r = t % len(paging.lens)
        n = paging.lens[r]
        want = 0 if t == 0 else min(topk_n // 3 if t == 1 else topk_n, n)
        idx[t, :want] = [paging.slot(r, int(p)) for p in rng.permutation(n)[:want]]
        rng.shuffle(idx[t])
    return idx


def sparse_mla_files(rng, out_dir, seed):
    d = TINY
    paths = []
    for dtype in ["bf16", "fp8_ds_mla"]:
        layout = Kv(dtype, d["nope"], d["rope"], d["page_size"])
        lens = [1, layout.ps + 1, 90, 300]
        paging = Paging(rng, layout.ps, lens)
        cache = garbage(rng, paging.num_pages, layout.bytes_per_page)
        layout.store(cache, token_rows(rng, sum(lens), layout.nope + layout.rope), paging.all_slots())
        n_tokens, h, topk_n = 6, d["q_heads"], d["topk"]
        indices = mla_indices(rng, paging, n_tokens, topk_n)
        q = rng.standard_normal((n_tokens, h, layout.nope + layout.rope)).astype(BF16)
        scale = F32(1 / math.sqrt(layout.nope + layout.rope))
        out, lse = sparse_mla(layout, cache, q, indices, scale)
        params = layout.params()
        params.update(n_heads=h, topk=topk_n, softmax_scale=float(scale))
        paths.append(save(out_dir, f"sparse_mla_{dtype}", "sparse_mla", params,
                          dict(q=q, cache=cache, indices=indices, out=out, lse=lse), seed))
    # A FlashMLA decode dump: q/indices/out [batch, s_q, ...], lse [batch, h_q, s_q], +inf
    # lse for a token without a valid slot, invalid indices other than -1.
    layout = Kv("bf16", d["nope"], d["rope"], d["page_size"])
    lens = [1, layout.ps + 1, 90, 300]
    paging = Paging(rng, layout.ps, lens)
    cache = garbage(rng, paging.num_pages, layout.bytes_per_page)
    layout.store(cache, token_rows(rng, sum(lens), layout.nope + layout.rope), paging.all_slots())
    capacity = paging.num_pages * layout.ps
    batch, s_q, h, topk_n = 3, 2, d["q_heads"], d["topk"]
    indices = mla_indices(rng, paging, batch * s_q, topk_n)
    for t in range(1, batch * s_q):
        bad = rng.integers(0, topk_n, 4)
        indices[t, bad] = [-7, capacity, capacity + 100, 2**31 - 1]
    indices[0, :3] = [-2, capacity, -(2**31)]  # token 0: only invalid entries
    q = rng.standard_normal((batch * s_q, h, layout.nope + layout.rope)).astype(BF16)
    scale = F32(1 / math.sqrt(layout.nope + layout.rope))
    out, lse = sparse_mla(layout, cache, q, indices, scale, capacity=capacity, empty_lse=np.inf)
    assert np.isposinf(lse[0]).all()
    params = layout.params()
    params.update(n_heads=h, topk=topk_n, softmax_scale=float(scale),
                  conventions={"empty_lse": "+inf", "lse_layout": "batch_heads_seq",
                               "invalid_indices": "out_of_range"})
    tensors = dict(q=q.reshape(batch, s_q, h, -1), cache=cache,
                   indices=indices.reshape(batch, s_q, topk_n),
                   out=out.reshape(batch, s_q, h, -1),
                   lse=np.ascontiguousarray(lse.reshape(batch, s_q, h).transpose(0, 2, 1)))
    paths.append(save(out_dir, "sparse_mla_bf16_flashmla", "sparse_mla", params, tensors, seed))
    return paths


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    os.makedirs(a.out_dir, exist_ok=True)
    paths = []
    for make in (store_files, indexer_files, topk_files, sparse_mla_files):
        paths += make(rng, a.out_dir, seed)
    for make in (golden_v4.store_files, golden_v4.indexer_files, golden_v4.topk_files,
                 golden_v4.sparse_mla_files):
        paths += make(rng, a.out_dir, seed, sys.modules[__name__])
    print(f"seed {seed}")
    for p in paths:
        print(p)


if __name__ == "__main__":
    main()
