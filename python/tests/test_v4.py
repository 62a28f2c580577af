"""DeepSeek-V4 entry points (sparsekit.ops and sparsekit.compat) against independent
NumPy / float64 references written here (codecs by their definitions: e4m3, e2m1, ue8m0;
never sparsekit's code): ragged batches (>= 4 requests), odd page sizes, both V4 KV
layouts, sinks, an extra cache with another page size, the top-k transform with short and
long rows, outputs poisoned with NaN first, and bad arguments naming themselves.

Every test draws fresh inputs from the run's seed (conftest.SEED, from os.urandom through
random.SystemRandom; SPARSEKIT_TEST_SEED replays one) and names it in its failures."""

import math
import zlib

import numpy as np
import pytest
import torch

from conftest import SEED
from sparsekit import IndexKLayout, KvLayout, ops
from sparsekit.compat import deep_gemm, flash_mla, sgl_kernel


@pytest.fixture
def rng(request):
    return np.random.default_rng((SEED * 1_000_003 + zlib.crc32(request.node.name.encode())) % (1 << 62))


def _msg(what):
    return f"{what} (seed {SEED}: SPARSEKIT_TEST_SEED={SEED} replays)"


# ------------------------------------------------------------------ codecs (NumPy)


def _bf16_round(x):
    """float -> the nearest bf16 (ties to even), as float32 (NumPy bit arithmetic)."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (b.astype(np.uint32) << 16).view(np.float32)


def _bf16_bits(x32):
    return (np.asarray(x32, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _bf16_tensor(x32):
    return torch.from_numpy(_bf16_bits(x32).astype(np.int16)).view(torch.bfloat16)


def _e4m3_table():
    v = np.zeros(256)
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 15, c & 7
        if e == 15 and m == 7:
            x = math.nan
        elif e == 0:
            x = m / 8 * 2.0 ** -6
        else:
            x = (1 + m / 8) * 2.0 ** (e - 7)
        v[c] = -x if s else x
    return v


E4M3 = _e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _nearest_code(x, table_pos):
    """Nearest code of ``table_pos`` (ascending non-negative values, code = index) to
    |x|, ties to the even code, saturating; sign separately."""
    a = np.abs(x)
    hi = np.clip(np.searchsorted(table_pos, a), 1, len(table_pos) - 1)
    lo = hi - 1
    dl, dh = a - table_pos[lo], table_pos[hi] - a
    code = np.where(dl < dh, lo, np.where(dh < dl, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= table_pos[-1], len(table_pos) - 1, code)
    return code, np.signbit(x)


def e4m3_encode(x):
    code, neg = _nearest_code(np.asarray(x, dtype=np.float64), E4M3[:127])
    return (code | (neg.astype(np.int64) << 7)).astype(np.uint8)


def e2m1_encode(x):
    code, neg = _nearest_code(np.asarray(x, dtype=np.float64), E2M1[:8])
    return (code | (neg.astype(np.int64) << 3)).astype(np.uint8)


def ue8m0_value(b):
    b = np.asarray(b, dtype=np.float64)
    return np.where(b == 255, np.nan, 2.0 ** (b - 127))


def pow2_ceil_exp(x):
    """ceil(log2(x)) for float32 x > 0, exactly (frexp)."""
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.where(m == 0.5, e - 1, e)


# ------------------------------------------------------------------ V4 layouts (NumPy)


class RefKv:
    """DeepSeek-V4 KV pool: model1_fp8 (per page: 576-B rows of 448 e4m3 + 64 bf16, then
    8 B of ue8m0 tile scales per token, padded to a multiple of 576) or bf16_512."""

    def __init__(self, dtype, page_size):
        self.dtype, self.ps = dtype, page_size
        if dtype == "model1_fp8":
            self.row = 576
            self.page = -(-page_size * 584 // 576) * 576
        else:
            self.row = 1024
            self.page = page_size * 1024

    def encode(self, kv32, pool, slots):
        """Writes bf16-valued float32 tokens ``[n, 512]`` at ``slots`` of ``pool`` (uint8
        [pages, page])."""
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            p, o = divmod(int(slot), self.ps)
            row = pool[p, o * self.row:(o + 1) * self.row]
            x = kv32[t]
            if self.dtype == "bf16_512":
                row[:] = _bf16_bits(x).view(np.uint8)
                continue
            sc = np.zeros(8, dtype=np.uint8)
            for i in range(7):
                tile = x[i * 64:(i + 1) * 64].astype(np.float32)
                r = max(np.float32(np.abs(tile).max()) / np.float32(448), np.float32(1e-4))
                e = int(pow2_ceil_exp(r))
                row[i * 64:(i + 1) * 64] = e4m3_encode(tile.astype(np.float64) * 2.0 ** -e)
                sc[i] = e + 127
            row[448:] = _bf16_bits(x[448:]).view(np.uint8)
            at = self.ps * 576 + 8 * o
            pool[p, at:at + 8] = sc

    def decode(self, pool, slot):
        p, o = divmod(int(slot), self.ps)
        row = pool[p, o * self.row:(o + 1) * self.row]
        if self.dtype == "bf16_512":
            return (row.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        at = self.ps * 576 + 8 * o
        sc = ue8m0_value(pool[p, at:at + 7])
        nope = E4M3[row[:448]] * np.repeat(sc, 64)
        rope = (row[448:].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return np.concatenate([nope, rope.astype(np.float64)])


class RefFp4:
    """fp4 index-K pool: per page all tokens' packed e2m1 (d/2 B), then d/32 ue8m0 B each."""

    def __init__(self, d, page_size):
        self.d, self.ps = d, page_size
        self.vb, self.sb = d // 2, d // 32
        self.page = page_size * (self.vb + self.sb)

    def encode(self, keys32, pool, slots):
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            p, o = divmod(int(slot), self.ps)
            codes = np.zeros(self.d, dtype=np.uint8)
            sc = np.zeros(self.sb, dtype=np.uint8)
            for g in range(self.sb):
                x = keys32[t, g * 32:(g + 1) * 32].astype(np.float32)
                amax = np.float32(np.abs(x).max()) / np.float32(6)
                e = -126 if amax == 0 else max(int(pow2_ceil_exp(amax)), -126)
                codes[g * 32:(g + 1) * 32] = e2m1_encode(x.astype(np.float64) * 2.0 ** -e)
                sc[g] = e + 127
            pool[p, o * self.vb:(o + 1) * self.vb] = codes[0::2] | (codes[1::2] << 4)
            at = self.ps * self.vb + o * self.sb
            pool[p, at:at + self.sb] = sc

    def decode(self, pool, slot):
        p, o = divmod(int(slot), self.ps)
        packed = pool[p, o * self.vb:(o + 1) * self.vb]
        codes = np.empty(self.d, dtype=np.uint8)
        codes[0::2], codes[1::2] = packed & 15, packed >> 4
        at = self.ps * self.vb + o * self.sb
        return E2M1[codes] * np.repeat(ue8m0_value(pool[p, at:at + self.sb]), 32)


def _pool(rng, pages, page_bytes):
    """A pool of random bytes (never zeros): what the store must leave alone stays."""
    return rng.integers(0, 256, size=(pages, page_bytes), dtype=np.uint8)


def _tokens(rng, n, d=512, spread=True):
    x = rng.standard_normal((n, d)).astype(np.float32)
    if spread:
        x *= np.exp2(rng.integers(-6, 6, size=(n, 1))).astype(np.float32)
    return _bf16_round(x)


# ------------------------------------------------------------------ stores


@pytest.mark.parametrize("dtype,page_size", [("model1_fp8", 64), ("model1_fp8", 37),
                                             ("model1_fp8", 2), ("bf16_512", 5),
                                             ("bf16_512", 1)])
def test_kv_store_v4_layouts_byte_exact(rng, dtype, page_size):
    layout = KvLayout(dtype, page_size=page_size)
    ref = RefKv(dtype, page_size)
    assert layout.bytes_per_page == ref.page and layout.d_qk == 512 and layout.d_v == 512
    assert layout.is_v4 and (layout.nope_dim, layout.rope_dim) == (448, 64)
    pages = 5
    n = int(rng.integers(7, 3 * page_size + 9))
    n = min(n, pages * page_size)
    slots = rng.permutation(pages * page_size)[:n].astype(np.int64)
    slots[rng.random(n) < 0.15] = -1
    kv = _tokens(rng, n)
    before = _pool(rng, pages, ref.page)
    want = before.copy()
    ref.encode(kv, want, slots)
    cache = torch.from_numpy(before.copy())
    ops.kv_store(_bf16_tensor(kv), torch.from_numpy(slots), cache, layout)
    got = cache.numpy()
    diff = np.argwhere(got != want)
    assert diff.size == 0, _msg(f"{dtype} P{page_size}: {len(diff)} bytes differ, first at {diff[:3].tolist()}")
    # Dequantised back: within the format's error of the input.
    for t in np.flatnonzero(slots >= 0)[:5]:
        back = ref.decode(got, slots[t])
        tol = (2.0 ** -4) * np.repeat([np.abs(kv[t, i * 64:(i + 1) * 64]).max() for i in range(8)], 64)
        assert np.all(np.abs(back - kv[t]) <= tol + 1e-30), _msg("dequantised row")


@pytest.mark.parametrize("page_size", [64, 1, 5, 33])
def test_index_k_store_fp4_byte_exact(rng, page_size):
    layout = IndexKLayout("fp4_e2m1", 128, page_size)
    ref = RefFp4(128, page_size)
    assert layout.bytes_per_page == ref.page and layout.bytes_per_token == 68
    assert (layout.value_bytes_per_token, layout.scale_bytes_per_token) == (64, 4)
    assert layout.scale_section_offset == 64 * page_size and layout.dtype == "fp4_e2m1"
    pages = 4
    n = min(int(rng.integers(5, 2 * page_size + 7)), pages * page_size)
    slots = rng.permutation(pages * page_size)[:n].astype(np.int64)
    slots[rng.random(n) < 0.2] = -1
    keys = _tokens(rng, n, 128)
    keys[0, :32] = 0.0  # an all-zero group: scale 2^-126
    before = _pool(rng, pages, ref.page)
    want = before.copy()
    ref.encode(keys, want, slots)
    cache = torch.from_numpy(before.copy())
    ops.index_k_store(_bf16_tensor(keys), torch.from_numpy(slots), cache, layout)
    diff = np.argwhere(cache.numpy() != want)
    assert diff.size == 0, _msg(f"fp4 P{page_size}: {len(diff)} bytes differ, first at {diff[:3].tolist()}")


# ------------------------------------------------------------------ indexer over fp4


def _ragged_fp4(rng, lens, page_size, d=128):
    """Pool (NumPy-encoded), page table, dequantised keys per request."""
    ref = RefFp4(d, page_size)
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 2
    perm = rng.permutation(num_pages)
    max_pages = max(need) + 1
    table = np.full((len(lens), max_pages), -1, dtype=np.int32)
    pool = _pool(rng, num_pages, ref.page)
    at = 0
    deq = []
    for r, n in enumerate(lens):
        table[r, :need[r]] = perm[at:at + need[r]]
        at += need[r]
        pos = np.arange(n)
        slots = table[r, pos // page_size].astype(np.int64) * page_size + pos % page_size
        keys = _tokens(rng, n, d)
        ref.encode(keys, pool, slots)
        deq.append(np.stack([ref.decode(pool, s) for s in slots]) if n else np.zeros((0, d)))
    return pool, table, deq


def test_indexer_logits_fp4_ragged_decode(rng):
    page_size, d, h, next_n = 13, 128, 5, 2
    lens = [int(x) for x in rng.integers(2, 90, size=5)]
    lens[1] = 2
    pool, table, deq = _ragged_fp4(rng, lens, page_size, d)
    layout = IndexKLayout("fp4_e2m1", d, page_size)
    n = len(lens) * next_n
    q = _bf16_round(rng.standard_normal((n, h, d)).astype(np.float32))
    w = rng.standard_normal((n, h)).astype(np.float32)
    stride = max(lens) + 3
    out = torch.full((n, stride), float("nan"))
    ops.indexer_logits(_bf16_tensor(q), torch.from_numpy(w), torch.from_numpy(pool),
                       torch.from_numpy(table), layout,
                       context_lens=torch.tensor(lens, dtype=torch.int32), next_n=next_n,
                       row_stride=stride, out=out)
    got = out.numpy()
    for r, L in enumerate(lens):
        for j in range(next_n):
            i = r * next_n + j
            end = L - next_n + j + 1
            s = q[i].astype(np.float64) @ deq[r][:end].T  # [h, end]
            want = (w[i, :, None].astype(np.float64) * np.maximum(s, 0)).sum(0)
            bound = 1e-5 * (np.abs(w[i, :, None]) * (np.abs(q[i]) @ np.abs(deq[r][:end]).T)).sum(0) + 1e-30
            assert np.all(np.abs(got[i, :end] - want) <= bound), _msg(f"row {i} logits")
            assert np.all(got[i, end:] == -np.inf), _msg(f"row {i} past its range")


# ------------------------------------------------------------------ top-k transform


def _ref_topk_row(row, k, take_all):
    n = len(row)
    if take_all and n <= k:
        return list(range(n)) + [-1] * (k - n)
    ok = [p for p in range(n) if not (np.isnan(row[p]) or row[p] == -np.inf)]
    ok.sort(key=lambda p: (-row[p], p))
    sel = sorted(ok[:k])
    return sel + [-1] * (k - len(sel))


@pytest.mark.parametrize("k", [16, 37])
def test_topk_take_all_short_rows_slots(rng, k):
    page_size = 7
    lens = [0, 1, k - 1, k, k + 1, 3 * k + 5, int(rng.integers(1, 4 * k))]
    n, width = len(lens), max(lens) + 4
    logits = rng.standard_normal((n, width)).astype(np.float32)
    logits = np.round(logits * 4) / 4  # ties
    for r, L in enumerate(lens):
        if L:
            logits[r, rng.integers(0, L, size=max(1, L // 4))] = -np.inf
            logits[r, rng.integers(0, L)] = np.nan
    cols = -(-width // page_size)
    table = np.stack([rng.permutation(100)[:cols] for _ in lens]).astype(np.int32)
    rows = np.stack([np.arange(n), np.zeros(n, dtype=np.int64), lens], axis=1).astype(np.int32)
    for take_all in (True, False):
        out = torch.full((n, k), -7, dtype=torch.int32)
        ops.topk(torch.from_numpy(logits), k, rows=torch.from_numpy(rows),
                 page_table=torch.from_numpy(table), page_size=page_size, out=out,
                 take_all_short_rows=take_all)
        pos = ops.topk(torch.from_numpy(logits), k, rows=torch.from_numpy(rows),
                       take_all_short_rows=take_all).numpy()
        for r, L in enumerate(lens):
            want = _ref_topk_row(logits[r, :L], k, take_all)
            assert pos[r].tolist() == want, _msg(f"take_all={take_all} row {r} (len {L}) positions")
            slots = [-1 if p < 0 else int(table[r, p // page_size]) * page_size + p % page_size for p in want]
            assert out[r].tolist() == slots, _msg(f"take_all={take_all} row {r} slots")


def test_sgl_deepseek_v4_topk_transform_512(rng):
    k, page_size = 512, 64
    lens = [0, 3, 511, 512, 513, int(rng.integers(600, 1500))]
    b, width = len(lens), max(lens) + 11
    scores = rng.standard_normal((b, width)).astype(np.float32)
    scores[2, :100] = -np.inf  # a short row takes them anyway
    cols = -(-width // page_size)
    table = np.stack([rng.permutation(400)[:cols] for _ in lens]).astype(np.int32)
    pi = torch.full((b, k), 12345, dtype=torch.int32)
    raw = torch.full((b, k), 12345, dtype=torch.int32)
    sgl_kernel.deepseek_v4_topk_transform_512(
        torch.from_numpy(scores), torch.tensor(lens, dtype=torch.int32),
        torch.from_numpy(table), pi, page_size, raw_indices=raw)
    for r, L in enumerate(lens):
        want = _ref_topk_row(scores[r, :L], k, True)
        assert raw[r].tolist() == want, _msg(f"row {r} raw positions")
        slots = [-1 if p < 0 else int(table[r, p // page_size]) * page_size + p % page_size for p in want]
        assert pi[r].tolist() == slots, _msg(f"row {r} slots")


# ------------------------------------------------------------------ sparse_mla_v4


def _ref_attention(q, keys_by_token, scale, sink):
    """float64: per token t a list of dequantised keys [n_t, 512]; returns (out, lse, mag)
    with FlashMLA's conventions (+inf lse and 0 output for an empty token; sink on out);
    ``mag`` is ``softmax · |keys|`` (sink applied), the scale of the rounding error of the
    weights' bf16 rounding before the weighted sum."""
    t, h, d = q.shape
    out = np.zeros((t, h, d))
    mag = np.zeros((t, h, d))
    lse = np.full((t, h), np.inf)
    for i in range(t):
        k = keys_by_token[i]
        if len(k) == 0:
            continue
        s = scale * (q[i].astype(np.float64) @ k.T)  # [h, n]
        m = s.max(1, keepdims=True)
        p = np.exp(s - m)
        z = p.sum(1, keepdims=True)
        lse[i] = (m + np.log(z))[:, 0]
        o = (p / z) @ k
        a = (p / z) @ np.abs(k)
        if sink is not None:
            f = 1 / (1 + np.exp(sink.astype(np.float64)[:, None] - lse[i][:, None]))
            o, a = o * f, a * f
        out[i] = o
        mag[i] = a
    return out, lse, mag


def _check_attention(got_out, got_lse, want, keys_by_token, what):
    """``want`` = ``_ref_attention``'s (out, lse, mag). The bound: one bf16 rounding of each
    softmax weight before the weighted sum (2^-8 of ``softmax · |keys|``), one of the
    output (2^-8 of it), and f32 slack for the scores and sums."""
    want_out, want_lse, mag = want
    for i in range(want_out.shape[0]):
        if len(keys_by_token[i]) == 0:
            assert np.all(got_lse[i] == np.inf), _msg(f"{what}: empty token {i} lse")
            assert np.all(got_out[i] == 0), _msg(f"{what}: empty token {i} out")
            continue
        kmax = np.abs(keys_by_token[i]).max()
        bound = 2.0 ** -8 * (np.abs(want_out[i]) + mag[i]) + 2e-4 * kmax + 1e-30
        err = np.abs(got_out[i] - want_out[i])
        assert np.all(err <= bound), _msg(f"{what}: token {i} out err {err.max()} (max ratio {(err / bound).max():.2f})")
        assert np.all(np.abs(got_lse[i] - want_lse[i]) <= 1e-4 * (1 + np.abs(want_lse[i]))), \
            _msg(f"{what}: token {i} lse")


def _v4_cache(rng, dtype, page_size, pages, nan_rows=True):
    """A V4 pool (NumPy-encoded) with every slot written; some slots then hold NaN rows
    that no valid index points at. Returns (layout, ref, pool, poisoned slot set)."""
    layout = KvLayout(dtype, page_size=page_size)
    ref = RefKv(dtype, page_size)
    pool = _pool(rng, pages, ref.page)
    cap = pages * page_size
    ref.encode(_tokens(rng, cap), pool, np.arange(cap))
    poisoned = set()
    if nan_rows:
        for s in rng.choice(cap, size=max(1, cap // 10), replace=False):
            p, o = divmod(int(s), page_size)
            pool[p, o * ref.row:(o + 1) * ref.row] = 0xFF  # NaN codes / NaN bf16
            poisoned.add(int(s))
    return layout, ref, pool, poisoned


def _indices(rng, t, topk, cap, poisoned, lens):
    """int32 [t, topk]: used entries slots (not poisoned) or -1, garbage past lengths."""
    clean = np.array([s for s in range(cap) if s not in poisoned])
    idx = rng.choice(clean, size=(t, topk)).astype(np.int32)
    idx[rng.random((t, topk)) < 0.1] = -1
    for i in range(t):
        idx[i, lens[i]:] = rng.choice([-7, 2 ** 31 - 1, cap + 5, int(next(iter(poisoned), 0))],
                                      size=topk - lens[i])
    return idx


@pytest.mark.parametrize("main_dtype,extra_dtype", [("model1_fp8", "bf16_512"),
                                                    ("bf16_512", "model1_fp8"),
                                                    ("model1_fp8", None)])
def test_sparse_mla_v4_ragged(rng, main_dtype, extra_dtype):
    t, h = 7, 3
    scale = 512 ** -0.5 * float(rng.uniform(0.5, 2))
    layout, ref, pool, poisoned = _v4_cache(rng, main_dtype, 37, 4)
    topk = 45
    lens = rng.integers(0, topk + 1, size=t)
    lens[0], lens[1] = 0, topk
    idx = _indices(rng, t, topk, 4 * 37, poisoned, lens)
    idx[2, :lens[2]] = -1  # used but all invalid: empty unless the extra cache has some
    q = _bf16_round(rng.standard_normal((t, h, 512)).astype(np.float32))
    sink = rng.standard_normal(h).astype(np.float32)
    keys = [[ref.decode(pool, s) for s in idx[i, :lens[i]] if s >= 0] for i in range(t)]
    kwargs = {}
    if extra_dtype is not None:
        e_layout, e_ref, e_pool, e_poisoned = _v4_cache(rng, extra_dtype, 2, 9)
        e_topk = 6
        e_lens = rng.integers(0, e_topk + 1, size=t)
        e_lens[0] = 0
        e_idx = _indices(rng, t, e_topk, 18, e_poisoned, e_lens)
        for i in range(t):
            keys[i] += [e_ref.decode(e_pool, s) for s in e_idx[i, :e_lens[i]] if s >= 0]
        kwargs = dict(extra_cache=torch.from_numpy(e_pool), extra_indices=torch.from_numpy(e_idx),
                      extra_layout=e_layout, extra_lengths=torch.from_numpy(e_lens.astype(np.int32)))
    keys = [np.array(k).reshape(-1, 512) for k in keys]
    for with_sink in (True, False):
        out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16)
        lse = torch.full((t, h), float("nan"))
        ops.sparse_mla_v4(_bf16_tensor(q), torch.from_numpy(pool), torch.from_numpy(idx), layout,
                          scale, lengths=torch.from_numpy(lens.astype(np.int32)),
                          attn_sink=torch.from_numpy(sink) if with_sink else None,
                          out=out, lse=lse, **kwargs)
        want = _ref_attention(q, keys, scale, sink if with_sink else None)
        _check_attention(out.float().numpy(), lse.numpy(), want, keys,
                         f"{main_dtype}+{extra_dtype} sink={with_sink}")


def test_sparse_mla_v4_with_no_main_index(rng):
    """A main top-k of 0 as torch makes it (``torch.empty((t, 0))``: strides (1, 1), which
    torch calls contiguous) beside the extra cache: the extra cache alone is attended."""
    layout, _, pool, _ = _v4_cache(rng, "bf16_512", 3, 5)
    e_layout, e_ref, e_pool, e_poisoned = _v4_cache(rng, "model1_fp8", 2, 9)
    t, h, e_topk = 3, 2, 6
    e_idx = _indices(rng, t, e_topk, 18, e_poisoned, [e_topk] * t)
    q = _bf16_round(rng.standard_normal((t, h, 512)).astype(np.float32))
    none = torch.empty((t, 0), dtype=torch.int32)
    assert none.stride() == (1, 1) and none.is_contiguous()
    out, lse = ops.sparse_mla_v4(_bf16_tensor(q), torch.from_numpy(pool), none, layout,
                                 extra_cache=torch.from_numpy(e_pool),
                                 extra_indices=torch.from_numpy(e_idx), extra_layout=e_layout)
    keys = [np.array([e_ref.decode(e_pool, s) for s in e_idx[i] if s >= 0]).reshape(-1, 512)
            for i in range(t)]
    want = _ref_attention(q, keys, 512 ** -0.5, None)
    _check_attention(out.float().numpy(), lse.numpy(), want, keys, "no main index")


def test_sparse_mla_v4_infinite_sinks_and_defaults(rng):
    layout, ref, pool, poisoned = _v4_cache(rng, "bf16_512", 3, 5)
    t, h, topk = 4, 4, 9
    idx = _indices(rng, t, topk, 15, poisoned, [topk] * t)
    q = _bf16_round(rng.standard_normal((t, h, 512)).astype(np.float32))
    sink = np.array([np.inf, -np.inf, 0.5, -2], dtype=np.float32)
    out, lse = ops.sparse_mla_v4(_bf16_tensor(q), torch.from_numpy(pool), torch.from_numpy(idx),
                                 layout, attn_sink=torch.from_numpy(sink))
    keys = [np.array([ref.decode(pool, s) for s in idx[i] if s >= 0]).reshape(-1, 512) for i in range(t)]
    want = _ref_attention(q, keys, 512 ** -0.5, sink)
    got = out.float().numpy()
    assert np.all(got[:, 0] == 0) or all(len(k) == 0 for k in keys), _msg("+inf sink zeroes out")
    _check_attention(got, lse.numpy(), want, keys, "infinite sinks")


# ------------------------------------------------------------------ compat.flash_mla (V4)


def _flashmla_model1(pool, ref):
    """FlashMLA's MODEL1 k_cache view of our pages: [nb, P, 1, 584] uint8 with the padded
    page as its block stride."""
    t = torch.from_numpy(pool)
    nb = pool.shape[0]
    return torch.as_strided(t, (nb, ref.ps, 1, 584), (ref.page, 584, 584, 1))


@pytest.mark.parametrize("fp8", [True, False])
def test_flash_mla_with_kvcache_v4(rng, fp8):
    b, s_q, h = 5, 2, 4
    dtype = "model1_fp8" if fp8 else "bf16_512"
    layout, ref, pool, poisoned = _v4_cache(rng, dtype, 64 if fp8 else 3, 3 if fp8 else 40)
    cap = pool.shape[0] * ref.ps
    topk = 40
    tl = rng.integers(0, topk + 1, size=b)
    tl[0] = 0
    tok_lens = np.repeat(tl, s_q)
    idx = _indices(rng, b * s_q, topk, cap, poisoned, tok_lens)
    # FlashMLA: an index outside the cache is skipped like -1 (inside the length too).
    idx[3, 0] = cap + 3 if tl[1] > 0 else idx[3, 0]
    e_layout, e_ref, e_pool, e_poisoned = _v4_cache(rng, dtype, 2 if fp8 else 5, 9)
    e_cap = e_pool.shape[0] * e_ref.ps
    e_topk = 7
    etl = rng.integers(0, e_topk + 1, size=b)
    e_idx = _indices(rng, b * s_q, e_topk, e_cap, e_poisoned, np.repeat(etl, s_q))
    keys = []
    for i in range(b * s_q):
        k = [ref.decode(pool, s) for s in idx[i, :tok_lens[i]] if 0 <= s < cap]
        k += [e_ref.decode(e_pool, s) for s in e_idx[i, :etl[i // s_q]] if s >= 0]
        keys.append(np.array(k).reshape(-1, 512))
    q = _bf16_round(rng.standard_normal((b, s_q, h, 512)).astype(np.float32))
    sink = rng.standard_normal(h).astype(np.float32)
    if fp8:
        kc, ekc = _flashmla_model1(pool, ref), _flashmla_model1(e_pool, e_ref)
    else:
        kc = torch.from_numpy(pool).view(torch.bfloat16).reshape(-1, ref.ps, 1, 512)
        ekc = torch.from_numpy(e_pool).view(torch.bfloat16).reshape(-1, e_ref.ps, 1, 512)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        _bf16_tensor(q), kc, None, None, 512, meta, softmax_scale=0.04, is_fp8_kvcache=fp8,
        indices=torch.from_numpy(idx).reshape(b, s_q, topk), attn_sink=torch.from_numpy(sink),
        extra_k_cache=ekc, extra_indices_in_kvcache=torch.from_numpy(e_idx).reshape(b, s_q, e_topk),
        topk_length=torch.from_numpy(tl.astype(np.int32)),
        extra_topk_length=torch.from_numpy(etl.astype(np.int32)))
    assert tuple(out.shape) == (b, s_q, h, 512) and tuple(lse.shape) == (b, h, s_q)
    want = _ref_attention(q.reshape(b * s_q, h, 512), keys, 0.04, sink)
    got_lse = lse.transpose(1, 2).reshape(b * s_q, h).numpy()
    _check_attention(out.float().reshape(b * s_q, h, 512).numpy(), got_lse, want, keys,
                     f"flash_mla {dtype}")


def test_flash_mla_sparse_fwd_v4_bf16(rng):
    s_q, h, s_kv, topk = 6, 3, 50, 20
    kv = _tokens(rng, s_kv)
    q = _bf16_round(rng.standard_normal((s_q, h, 512)).astype(np.float32))
    idx = rng.integers(-3, s_kv + 4, size=(s_q, 1, topk)).astype(np.int32)
    tl = rng.integers(0, topk + 1, size=s_q)
    tl[0] = 0
    keys = [np.array([kv[s] for s in idx[i, 0, :tl[i]] if 0 <= s < s_kv], dtype=np.float64).reshape(-1, 512)
            for i in range(s_q)]
    out, maxl, lse = flash_mla.flash_mla_sparse_fwd(
        _bf16_tensor(q), _bf16_tensor(kv).reshape(s_kv, 1, 512), torch.from_numpy(idx), 0.05,
        d_v=512, topk_length=torch.from_numpy(tl.astype(np.int32)))
    want = _ref_attention(q, keys, 0.05, None)
    _check_attention(out.float().numpy(), lse.numpy(), want, keys, "sparse_fwd V4")
    for i in range(s_q):
        if len(keys[i]):
            m = (0.05 * (q[i].astype(np.float64) @ keys[i].T)).max(1)
            assert np.allclose(maxl[i].numpy(), m, rtol=1e-4, atol=1e-4), _msg("max_logits")
        else:
            assert np.all(maxl[i].numpy() == -np.inf), _msg("max_logits of an empty query")


# ------------------------------------------------------------------ compat.deep_gemm fp4


@pytest.mark.parametrize("q_fp8", [True, False])
def test_deep_gemm_fp8_fp4_paged_mqa_logits_fp4_keys(rng, q_fp8):
    block_kv, d, h, next_n = 64, 128, 4, 2
    lens = [int(x) for x in rng.integers(next_n, 200, size=4)]
    pool, table, deq = _ragged_fp4(rng, lens, block_kv, d)
    nb = pool.shape[0]
    kv = torch.from_numpy(pool).reshape(nb, block_kv, 1, 68)
    qf = rng.standard_normal((len(lens), next_n, h, d)).astype(np.float32)
    qt = torch.from_numpy(qf).to(torch.float8_e4m3fn) if q_fp8 else _bf16_tensor(_bf16_round(qf))
    qv = qt.float().numpy().astype(np.float64)
    w = rng.standard_normal((len(lens) * next_n, h)).astype(np.float32)
    max_len = max(lens) + 5
    cl = torch.tensor(lens, dtype=torch.int32)
    meta = deep_gemm.get_paged_mqa_logits_metadata(cl, block_kv, 4)
    got = deep_gemm.fp8_fp4_paged_mqa_logits((qt, None), kv, torch.from_numpy(w), cl,
                                             torch.from_numpy(table), meta, max_len).numpy()
    for r, L in enumerate(lens):
        for j in range(next_n):
            i = r * next_n + j
            end = L - next_n + j + 1
            s = qv[r, j] @ deq[r][:end].T
            want = (w[i, :, None] * np.maximum(s, 0)).sum(0)
            bound = 1e-5 * (np.abs(w[i, :, None]) * (np.abs(qv[r, j]) @ np.abs(deq[r][:end]).T)).sum(0) + 1e-30
            assert np.all(np.abs(got[i, :end] - want) <= bound), _msg(f"row {i}")
            assert np.all(got[i, end:] == -np.inf), _msg(f"row {i} past its range")
    with pytest.raises(NotImplementedError, match="fp4 queries"):
        deep_gemm.fp8_fp4_paged_mqa_logits((qt, torch.ones(1)), kv, torch.from_numpy(w), cl,
                                           torch.from_numpy(table), meta, max_len)
    with pytest.raises(ValueError, match="kv_cache"):
        deep_gemm.fp8_paged_mqa_logits(qt, kv, torch.from_numpy(w), cl, torch.from_numpy(table),
                                       meta, max_len)


# ------------------------------------------------------------------ argument validation


def _small_v4(rng):
    layout, ref, pool, _ = _v4_cache(rng, "model1_fp8", 4, 2, nan_rows=False)
    q = _bf16_tensor(_bf16_round(rng.standard_normal((3, 2, 512)).astype(np.float32)))
    idx = torch.from_numpy(rng.integers(0, 8, size=(3, 5)).astype(np.int32))
    return layout, torch.from_numpy(pool), q, idx


def test_v4_layout_arguments():
    with pytest.raises(ValueError, match="448"):
        KvLayout("model1_fp8", 512, 64, 64)
    with pytest.raises(ValueError, match="dtype"):
        KvLayout("model2", page_size=4)
    with pytest.raises(ValueError, match="128"):
        IndexKLayout("fp4_e2m1", 64, 64)
    with pytest.raises(ValueError, match="scale"):
        IndexKLayout("fp4_e2m1", 128, 64, scale="ue8m0")
    assert KvLayout("model1_fp8", page_size=64).bytes_per_page == 37440
    assert KvLayout("model1_fp8", page_size=256).bytes_per_page == 149760
    assert KvLayout("bf16_512", page_size=2).bytes_per_page == 2048
    assert KvLayout("bf16").nope_dim == 512  # V3.2 defaults unchanged


def test_sparse_mla_v4_argument_errors(rng):
    layout, pool, q, idx = _small_v4(rng)
    good = dict(lengths=torch.tensor([5, 0, 3], dtype=torch.int32))
    ops.sparse_mla_v4(q, pool, idx, layout, **good)  # the baseline call works
    cases = [
        (TypeError, "q", dict(q=q.float())),
        (ValueError, "q", dict(q=q[:, :, :448])),
        (ValueError, "indices", dict(indices=idx[:2])),
        (TypeError, "indices", dict(indices=idx.float())),
        (ValueError, "lengths", dict(lengths=torch.tensor([6, 0, 0], dtype=torch.int32))),
        (ValueError, "lengths", dict(lengths=torch.tensor([1, -1, 0], dtype=torch.int32))),
        (ValueError, "lengths", dict(lengths=torch.tensor([1, 1], dtype=torch.int32))),
        (ValueError, "layout", dict(layout=KvLayout("fp8_ds_mla"))),
        (TypeError, "layout", dict(layout="model1_fp8")),
        (ValueError, "attn_sink", dict(attn_sink=torch.zeros(3))),
        (TypeError, "attn_sink", dict(attn_sink=torch.zeros(2, dtype=torch.float64))),
        (ValueError, "attn_sink", dict(attn_sink=torch.tensor([0.0, float("nan")]))),
        (ValueError, "extra", dict(extra_cache=pool)),
        (ValueError, "extra_lengths", dict(extra_lengths=torch.zeros(3, dtype=torch.int32))),
        (ValueError, "cache", dict(cache=pool.reshape(-1)[:-1])),
        (ValueError, "indices", dict(indices=torch.full((3, 5), 8, dtype=torch.int32))),
        (ValueError, "indices", dict(indices=torch.full((3, 5), -2, dtype=torch.int32))),
        (TypeError, "out", dict(out=torch.zeros(3, 2, 512))),
        (ValueError, "lse", dict(lse=torch.zeros(3, 3))),
    ]
    for exc, name, change in cases:
        args = dict(q=q, cache=pool, indices=idx, layout=layout)
        kw = dict(good)
        for key, v in change.items():
            (args if key in args else kw)[key] = v
        out = torch.full((3, 2, 512), float("nan"), dtype=torch.bfloat16)
        if "out" not in kw:
            kw["out"] = out
        with pytest.raises(exc, match=name):
            ops.sparse_mla_v4(args["q"], args["cache"], args["indices"], args["layout"], **kw)
        if "out" not in change:
            assert torch.isnan(out.float()).all(), _msg(f"a refused call ({name}) wrote out")
    # sparse_mla (V3.2) refuses V4 layouts by name.
    with pytest.raises(ValueError, match="sparse_mla_v4"):
        ops.sparse_mla(q, pool, idx, layout)


def test_v4_compat_argument_errors(rng):
    meta, _ = flash_mla.get_mla_metadata()
    q = torch.zeros((1, 1, 2, 512), dtype=torch.bfloat16).normal_()
    idx = torch.zeros((1, 1, 4), dtype=torch.int32)
    kc = torch.zeros((2, 64, 1, 584), dtype=torch.uint8)  # contiguous: block stride too small
    with pytest.raises(ValueError, match="k_cache"):
        flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)
    with pytest.raises(ValueError, match="k_cache"):
        flash_mla.flash_mla_with_kvcache(q, torch.zeros((2, 4, 1, 576), dtype=torch.uint8), None, None,
                                         512, flash_mla.get_mla_metadata()[0], is_fp8_kvcache=True,
                                         indices=idx)
    kb = torch.zeros((2, 4, 1, 512), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="topk_length"):
        flash_mla.flash_mla_with_kvcache(q, kb, None, None, 512, flash_mla.get_mla_metadata()[0],
                                         indices=idx, topk_length=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match="attn_sink"):
        flash_mla.flash_mla_with_kvcache(q, kb, None, None, 512, flash_mla.get_mla_metadata()[0],
                                         indices=idx, attn_sink=torch.zeros(3))
    with pytest.raises(TypeError, match="take_all_short_rows"):
        ops.topk(torch.zeros((1, 4)), 2, take_all_short_rows=1)
    with pytest.raises(ValueError, match="page_table"):
        sgl_kernel.deepseek_v4_topk_transform_512(
            torch.zeros((2, 100)), torch.tensor([100, 3], dtype=torch.int32),
            torch.zeros((2, 1), dtype=torch.int32), torch.zeros((2, 8), dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="seq_lens"):
        sgl_kernel.deepseek_v4_topk_transform_512(
            torch.zeros((2, 10)), torch.tensor([11, 3], dtype=torch.int32),
            torch.zeros((2, 1), dtype=torch.int32), torch.zeros((2, 8), dtype=torch.int32), 64)


def test_copy_pages_and_checksums_of_v4_pools(rng):
    for layout in (KvLayout("model1_fp8", page_size=37), KvLayout("bf16_512", page_size=3),
                   IndexKLayout("fp4_e2m1", 128, 5)):
        src = torch.from_numpy(_pool(rng, 6, layout.bytes_per_page))
        dst = torch.from_numpy(_pool(rng, 4, layout.bytes_per_page))
        before = dst.clone()
        si, di = torch.tensor([5, 0, 3], dtype=torch.int32), torch.tensor([2, 3, 0], dtype=torch.int32)
        ops.copy_pages(src, dst, si, di, layout)
        want = before.clone()
        want[di.long()] = src[si.long()]
        assert torch.equal(dst, want), _msg(f"copy_pages {layout!r}")
        # The same page bytes give the same checksum, in either pool.
        assert torch.equal(ops.page_checksums(src, si, layout),
                           ops.page_checksums(dst, di, layout)), _msg(f"checksums {layout!r}")
