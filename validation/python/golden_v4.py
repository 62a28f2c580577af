"""DeepSeek-V4 caches and ops for make_golden.py, in NumPy + ml_dtypes (no sparsekit code):
the MODEL1 fp8 KV layout (rows of 448 e4m3 + 64 bf16, then 8 bytes of ue8m0 tile scales per
token after the page's rows, the page padded to a multiple of 576 B), bf16_512 KV, and fp4
index keys (packed e2m1, even element in the low nibble, one ue8m0 byte per 32 values after
the page's values).

Quantisers (docs/golden.md): a MODEL1 tile's scale is 2^ceil(log2(max(amax / 448, 1e-4)))
(ml_dtypes float8_e8m0fnu byte; pad byte 0); an fp4 group's scale is
2^max(ceil(log2(amax / 6)), -126), codes from ml_dtypes float4_e2m1fn (nearest even,
saturating); a group holding NaN or +-inf stores scale 0xff and codes 0.
"""
import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
E8M0 = ml_dtypes.float8_e8m0fnu
BF16 = ml_dtypes.bfloat16
F32 = np.float32

V4_NOPE, V4_ROPE, V4_TILE, ROW = 448, 64, 64, 576
FP4_GROUP = 32


def encode_e4m3(x):
    x = np.asarray(x, dtype=F32)
    return np.clip(x, F32(-448), F32(448)).astype(E4M3).view(np.uint8)


def pow2_at_least(x, floor):
    """The smallest power of two >= max(x, floor) (float32)."""
    x = max(float(x), floor)
    p = 1.0
    while p < x:
        p *= 2.0
    while p / 2.0 >= x:
        p /= 2.0
    return F32(p)


def e8m0_byte(s):
    return int(np.asarray(s, dtype=F32).astype(E8M0).view(np.uint8))


def e8m0_value(b):
    return float(np.asarray(b, dtype=np.uint8).view(E8M0).astype(np.float64))


class Model1Kv:
    """Paged V4 KV: `model1_fp8` or `bf16_512` (1024 B per token), pages of `page_size`."""

    def __init__(self, dtype, page_size):
        self.dtype, self.ps = dtype, page_size
        if dtype == "model1_fp8":
            raw = page_size * (ROW + 8)
            self.bytes_per_page = -(-raw // ROW) * ROW
            self.row = ROW
        else:
            self.bytes_per_page = page_size * 1024
            self.row = 1024

    def params(self):
        return dict(version=1, dtype=self.dtype, nope_dim=V4_NOPE, rope_dim=V4_ROPE, page_size=self.ps)

    def store(self, cache, kv, slots):
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            page, off = divmod(int(slot), self.ps)
            row = cache[page, off * self.row:(off + 1) * self.row]
            if self.dtype == "bf16_512":
                row[:] = kv[t].view(np.uint8)
                continue
            scales = np.zeros(8, dtype=np.uint8)
            for i in range(V4_NOPE // V4_TILE):
                x = kv[t, i * V4_TILE:(i + 1) * V4_TILE].astype(F32)
                s = pow2_at_least(np.abs(x).max() / F32(448), float(F32(1e-4)))
                row[i * V4_TILE:(i + 1) * V4_TILE] = encode_e4m3(x / s)
                scales[i] = e8m0_byte(s)
            row[V4_NOPE:] = kv[t, V4_NOPE:].view(np.uint8)
            at = self.ps * ROW + 8 * off
            cache[page, at:at + 8] = scales

    def read(self, cache, slot):
        """The dequantised 512-d row of the token at `slot`, float64."""
        page, off = divmod(int(slot), self.ps)
        row = cache[page, off * self.row:(off + 1) * self.row]
        if self.dtype == "bf16_512":
            return row.view(BF16).astype(np.float64)
        at = self.ps * ROW + 8 * off
        scales = np.array([e8m0_value(b) for b in cache[page, at:at + 7]])
        nope = row[:V4_NOPE].view(E4M3).astype(np.float64) * np.repeat(scales, V4_TILE)
        return np.concatenate([nope, row[V4_NOPE:].view(BF16).astype(np.float64)])


class IndexKFp4:
    """Paged fp4 index-K: values of every token (head_dim / 2 bytes), then head_dim / 32
    ue8m0 bytes per token."""

    def __init__(self, head_dim, page_size):
        self.d, self.ps = head_dim, page_size
        self.value_bytes = head_dim // 2
        self.scale_bytes = head_dim // FP4_GROUP
        self.bytes_per_page = page_size * (self.value_bytes + self.scale_bytes)

    def params(self):
        return dict(version=1, dtype="fp4_e2m1", head_dim=self.d, page_size=self.ps)

    def store(self, cache, keys, slots):
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            page, off = divmod(int(slot), self.ps)
            k = keys[t].astype(F32)
            codes = np.zeros(self.d, dtype=np.uint8)
            scales = np.zeros(self.scale_bytes, dtype=np.uint8)
            for g in range(self.scale_bytes):
                x = k[g * FP4_GROUP:(g + 1) * FP4_GROUP]
                if not np.all(np.isfinite(x)):
                    scales[g] = 0xFF
                    continue
                s = pow2_at_least(np.abs(x).max() / F32(6), 2.0 ** -126)
                codes[g * FP4_GROUP:(g + 1) * FP4_GROUP] = (x / s).astype(E2M1).view(np.uint8) & 0xF
                scales[g] = e8m0_byte(s)
            packed = codes[0::2] | (codes[1::2] << 4)
            cache[page, off * self.value_bytes:(off + 1) * self.value_bytes] = packed
            at = self.ps * self.value_bytes + off * self.scale_bytes
            cache[page, at:at + self.scale_bytes] = scales

    def read(self, cache, slot):
        """(values as float64, scale 1) of the key at `slot`."""
        page, off = divmod(int(slot), self.ps)
        packed = cache[page, off * self.value_bytes:(off + 1) * self.value_bytes]
        codes = np.empty(self.d, dtype=np.uint8)
        codes[0::2], codes[1::2] = packed & 0xF, packed >> 4
        vals = codes.view(E2M1).astype(np.float64)
        at = self.ps * self.value_bytes + off * self.scale_bytes
        scales = np.array([e8m0_value(b) for b in cache[page, at:at + self.scale_bytes]])
        return vals * np.repeat(scales, FP4_GROUP), 1.0


def store_files(rng, out_dir, seed, h):
    """V4 store files: fp4 index-K (P 64), model1_fp8 (P 64, 256 and 2), bf16_512 (P 256).
    `h` carries make_golden's fixtures (save, store_batch, garbage, token_rows)."""
    paths = []
    layout = IndexKFp4(128, 64)
    paging, slots = h.store_batch(rng, layout.ps)
    cache_in = h.garbage(rng, paging.num_pages, layout.bytes_per_page)
    keys = h.token_rows(rng, len(slots), layout.d)
    cache_out = cache_in.copy()
    layout.store(cache_out, keys, slots)
    paths.append(h.save(out_dir, "index_k_store_fp4_e2m1", "index_k_store", layout.params(),
                        dict(keys=keys, slots=slots, cache_in=cache_in, cache_out=cache_out), seed))
    for dtype, ps in [("model1_fp8", 64), ("model1_fp8", 256), ("model1_fp8", 2), ("bf16_512", 256)]:
        layout = Model1Kv(dtype, ps)
        paging, slots = h.store_batch(rng, ps)
        cache_in = h.garbage(rng, paging.num_pages, layout.bytes_per_page)
        kv = h.token_rows(rng, len(slots), V4_NOPE + V4_ROPE)
        cache_out = cache_in.copy()
        layout.store(cache_out, kv, slots)
        paths.append(h.save(out_dir, f"kv_store_{dtype}_p{ps}", "kv_store", layout.params(),
                            dict(kv=kv, slots=slots, cache_in=cache_in, cache_out=cache_out), seed))
    return paths


def indexer_files(rng, out_dir, seed, h):
    """fp4 index-K logits at DeepSeek-V4's shape (64 heads x 128, page 64), decode
    next_n = 2 over ragged compressed lengths, in float64 (keys dequantised exactly)."""
    layout = IndexKFp4(128, 64)
    lens = h.ragged_lens(rng, layout.ps, 700)
    paging = h.Paging(rng, layout.ps, lens, spare=3)
    cache = h.garbage(rng, paging.num_pages, layout.bytes_per_page)
    layout.store(cache, h.token_rows(rng, sum(lens), layout.d), paging.all_slots())
    rows = h.decode_rows(lens, 2)
    heads, n = 64, len(rows)
    row_stride = max(lens) + 9
    q = rng.standard_normal((n, heads, layout.d)).astype(BF16)
    w = (rng.standard_normal((n, heads)) / np.sqrt(heads * layout.d)).astype(F32)
    logits = h.indexer_logits(layout, cache, paging, rows, q, w, row_stride).astype(F32)
    params = layout.params()
    params.update(n_heads=heads, row_stride=row_stride, next_n=2)
    tensors = dict(cache=cache, page_table=paging.table, context_lens=np.array(lens, dtype=np.int32),
                   q=q, weights=w, logits=logits)
    return [h.save(out_dir, "indexer_logits_fp4_e2m1_decode", "indexer_logits", params, tensors, seed)]


def topk_transform(logits, rows, k, to_entry):
    """DeepSeek-V4's transform: a row of at most k positions takes all of them in order
    (whatever the logits), a longer one its exact top-k (ties to the lower position);
    ascending; -1 padding."""
    out = np.full((len(rows), k), -1, dtype=np.int32)
    for i, (r, start, end) in enumerate(rows):
        if end - start <= k:
            best = np.arange(end - start)
        else:
            vals = logits[i, start:end]
            valid = np.nonzero(~np.isnan(vals) & (vals != -np.inf))[0]
            best = np.sort(valid[np.argsort(-vals[valid], kind="stable")[:k]])
        out[i, :len(best)] = [to_entry(r, start + p) for p in best]
    return out


def topk_files(rng, out_dir, seed, h):
    """The V4 top-k transform at k = 512 over a compressed pool of page 64, slots output:
    compressed lengths 1, 63, 64, 65, k, k + 1 and thousands; short rows hold -inf and NaN."""
    k, ps = 512, 64
    lens = [1, 63, 64, 65, k, k + 1, 3000]
    paging = h.Paging(rng, ps, lens, spare=1)
    rows = h.decode_rows(lens, 1)
    row_stride = max(lens) + 3
    logits = np.full((len(rows), row_stride), -np.inf, dtype=F32)
    for i, (_, _, end) in enumerate(rows):
        row = rng.standard_normal(end).astype(F32)
        kind = rng.integers(0, 12, end)
        row[kind == 0], row[kind == 1] = -np.inf, np.nan
        logits[i, :end] = row
    params = dict(version=1, k=k, row_stride=row_stride, output="slots", short_rows="take_all",
                  page_size=ps, next_n=1)
    out = topk_transform(logits, rows, k, paging.slot)
    return [h.save(out_dir, "topk_v4_transform", "topk", params,
                   dict(logits=logits, context_lens=np.array(lens, dtype=np.int32),
                        page_table=paging.table, topk=out), seed)]


def nan_pool(layout, pages):
    """A pool whose every row reads as NaN (e4m3 code 0x7f, bf16 0x7fc0), scales garbage-free
    (ue8m0 127): rows no valid index points at must never reach the result."""
    cache = np.zeros((pages, layout.bytes_per_page), dtype=np.uint8)
    for p in range(pages):
        for off in range(layout.ps):
            row = cache[p, off * layout.row:(off + 1) * layout.row]
            if layout.dtype == "model1_fp8":
                row[:V4_NOPE] = 0x7F
                row[V4_NOPE:] = np.full(V4_ROPE, 0x7FC0, dtype=np.uint16).view(np.uint8)
                at = layout.ps * ROW + 8 * off
                cache[p, at:at + 7] = 127
            else:
                row[:] = np.full(512, 0x7FC0, dtype=np.uint16).view(np.uint8)
    return cache


def sparse_mla_v4(caches, q, scale, sink):
    """FlashMLA's tests/ref.py maths in float64: per token, the rows of each cache's used,
    valid entries (main, then extra); s = scale q.k; lse = logsumexp(s) (natural log,
    without the sink); out = softmax(s) . rows (V = K, 512 dims), times 1/(1 + exp(sink -
    lse)); no valid key: out 0, lse +inf. `caches`: (layout, cache, indices [n, topk],
    lengths [n])."""
    n, h, _ = q.shape
    out = np.zeros((n, h, 512))
    lse = np.full((n, h), np.inf)
    for t in range(n):
        rows = [layout.read(cache, s) for layout, cache, idx, lens in caches
                for s in idx[t, :lens[t]] if s != -1]
        if not rows:
            continue
        k = np.stack(rows)
        s = q[t].astype(np.float64) @ k.T * scale
        m = s.max(axis=1, keepdims=True)
        w = np.exp(s - m)
        lse[t] = (m[:, 0] + np.log(w.sum(axis=1)))
        o = (w / w.sum(axis=1, keepdims=True)) @ k
        if sink is not None:
            o *= (1.0 / (1.0 + np.exp(sink.astype(np.float64) - lse[t])))[:, None]
        out[t] = o
    return out, lse


def v4_cache(rng, h, dtype, ps, topk, lens):
    """A NaN-filled pool with live rows, indices [n, topk] (live slots, some -1 inside each
    length, garbage past it: i32 max, negative, past the pool)."""
    layout = Model1Kv(dtype, ps)
    pages = -(-topk // ps) + 2
    cache = nan_pool(layout, pages)
    cap = pages * ps
    live = np.sort(rng.permutation(cap)[:max(1, cap * 3 // 4)])
    layout.store(cache, h.token_rows(rng, len(live), 512), live)
    idx = np.empty((len(lens), topk), dtype=np.int64)
    for t, n in enumerate(lens):
        idx[t, :n] = np.where(rng.integers(0, 20, n) == 0, -1, rng.choice(live, n))
        tail = rng.integers(0, 4, topk - n)
        idx[t, n:] = np.select([tail == 0, tail == 1, tail == 2],
                               [2**31 - 1, -rng.integers(1, 1000, topk - n), cap + rng.integers(0, 99, topk - n)],
                               rng.integers(0, cap, topk - n))
    return layout, cache, idx.astype(np.int32)


def sparse_mla_files(rng, out_dir, seed, h):
    """V4 attention: V4-Flash CSA (64 heads, window 128 at P 256 + compressed 512 at P 64,
    sink) in our conventions; the same in FlashMLA's ([batch, s_q, ...] tensors, lengths per
    request, lse [batch, h, s_q]); an HCA call over bf16_512 (P 2) without sink."""
    paths = []
    heads, scale = 64, 512 ** -0.5
    # Ours: 6 tokens, lengths 0/1/63/64/65/full, the last token with no valid key.
    n = 6
    main_lens = np.array([128, 1, 63, 64, 65, 0], dtype=np.int32)
    extra_lens = np.array([512, 65, 0, 511, 64, 0], dtype=np.int32)
    ml, mc, mi = v4_cache(rng, h, "model1_fp8", 256, 128, main_lens)
    el, ec, ei = v4_cache(rng, h, "model1_fp8", 64, 512, extra_lens)
    q = (rng.standard_normal((n, heads, 512))).astype(BF16)
    sink = (2 * rng.standard_normal(heads)).astype(F32)
    out, lse = sparse_mla_v4([(ml, mc, mi, main_lens), (el, ec, ei, extra_lens)], q, scale, sink)
    params = dict(version=1, n_heads=heads, softmax_scale=scale,
                  main=dict(dtype="model1_fp8", page_size=256, topk=128),
                  extra=dict(dtype="model1_fp8", page_size=64, topk=512))
    paths.append(h.save(out_dir, "sparse_mla_v4_model1", "sparse_mla_v4", params,
                        dict(q=q, main_cache=mc, main_indices=mi, main_lengths=main_lens,
                             extra_cache=ec, extra_indices=ei, extra_lengths=extra_lens,
                             attn_sink=sink, out=out.astype(F32).astype(BF16), lse=lse.astype(F32)), seed))
    # FlashMLA's layout: batch 3 × s_q 2, topk_length per request, lse [b, h, s_q].
    b, s_q = 3, 2
    req_main, req_extra = np.array([128, 70, 0], dtype=np.int32), np.array([512, 1, 0], dtype=np.int32)
    tok_main, tok_extra = np.repeat(req_main, s_q), np.repeat(req_extra, s_q)
    ml, mc, mi = v4_cache(rng, h, "model1_fp8", 256, 128, tok_main)
    el, ec, ei = v4_cache(rng, h, "model1_fp8", 64, 512, tok_extra)
    q = rng.standard_normal((b * s_q, heads, 512)).astype(BF16)
    out, lse = sparse_mla_v4([(ml, mc, mi, tok_main), (el, ec, ei, tok_extra)], q, scale, sink)
    params = dict(version=1, n_heads=heads, softmax_scale=scale,
                  main=dict(dtype="model1_fp8", page_size=256, topk=128),
                  extra=dict(dtype="model1_fp8", page_size=64, topk=512),
                  conventions={"lse_layout": "batch_heads_seq"})
    tensors = dict(q=q.reshape(b, s_q, heads, 512), main_cache=mc, main_indices=mi.reshape(b, s_q, 128),
                   main_lengths=req_main, extra_cache=ec, extra_indices=ei.reshape(b, s_q, 512),
                   extra_lengths=req_extra, attn_sink=sink,
                   out=out.astype(F32).astype(BF16).reshape(b, s_q, heads, 512),
                   lse=np.ascontiguousarray(lse.astype(F32).reshape(b, s_q, heads).transpose(0, 2, 1)))
    paths.append(h.save(out_dir, "sparse_mla_v4_flashmla", "sparse_mla_v4", params, tensors, seed))
    # HCA over bf16_512 at P 2 (all of a request's compressed entries), 16 heads, no sink.
    n, heads = 5, 16
    main_lens = np.array([100, 3, 64, 0, 63], dtype=np.int32)
    extra_lens = np.array([40, 0, 1, 0, 37], dtype=np.int32)
    ml, mc, mi = v4_cache(rng, h, "bf16_512", 256, 100, main_lens)
    el, ec, ei = v4_cache(rng, h, "bf16_512", 2, 40, extra_lens)
    q = rng.standard_normal((n, heads, 512)).astype(BF16)
    out, lse = sparse_mla_v4([(ml, mc, mi, main_lens), (el, ec, ei, extra_lens)], q, scale, None)
    params = dict(version=1, n_heads=heads, softmax_scale=scale,
                  main=dict(dtype="bf16_512", page_size=256, topk=100),
                  extra=dict(dtype="bf16_512", page_size=2, topk=40))
    paths.append(h.save(out_dir, "sparse_mla_v4_bf16_512", "sparse_mla_v4", params,
                        dict(q=q, main_cache=mc, main_indices=mi, main_lengths=main_lens,
                             extra_cache=ec, extra_indices=ei, extra_lengths=extra_lens,
                             out=out.astype(F32).astype(BF16), lse=lse.astype(F32)), seed))
    return paths
