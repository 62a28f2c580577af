#!/usr/bin/env python3
"""Test vectors for sparsekit's fp8 e4m3fn codec and quantization scales, computed with
NumPy + ml_dtypes (an implementation independent of ours).

Prints one JSON object on stdout:
  decode:   [[code, f32 bits], ...]          all 256 codes
  encode:   [[f32 bits, code], ...]          random, subnormal, tie, boundary, NaN, inf
  index_k:  [[key bf16 bits...], fmt, [code...], scale f32 bits]   per-token quantization
  kv_tiles: [[tile bf16 bits...], [code...], scale f32 bits]       fp8_ds_mla tiles
  model1:   [[448 NoPE bf16 bits...], [code...], [7 ue8m0 bytes]]  DeepSeek-V4 MODEL1 tiles
  fp4:      [[128 bf16 bits...], [64 packed bytes], [4 ue8m0 bytes]] fp4 index-K keys
Saturating conversion is np.clip(x, -448, 448) followed by the ml_dtypes cast; e2m1 codes
come from ml_dtypes' float4_e2m1fn cast (round to nearest even, saturating) and ue8m0
bytes from its float8_e8m0fnu cast of the power-of-two scale.
"""
import json
import sys

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
E2M1 = ml_dtypes.float4_e2m1fn
E8M0 = ml_dtypes.float8_e8m0fnu


def encode(x):
    x = np.asarray(x, dtype=np.float32)
    return np.clip(x, np.float32(-448), np.float32(448)).astype(E4M3).view(np.uint8)


def pow2_ceil(s):
    s = np.asarray(s, dtype=np.float32)
    m, e = np.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    return np.where(m == 0.5, s, np.ldexp(np.float32(1), e)).astype(np.float32)


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    codes = np.arange(256, dtype=np.uint8)
    decode = codes.view(E4M3).astype(np.float32)

    vals = [decode[(decode == decode)].astype(np.float32)]  # every finite code value
    finite = np.sort(np.unique(np.abs(decode[np.isfinite(decode)])))
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2  # exact ties
    vals.append(mids.astype(np.float32))
    vals.append(np.nextafter(mids.astype(np.float32), np.float32(np.inf)))
    vals.append(np.nextafter(mids.astype(np.float32), np.float32(-np.inf)))
    vals.append(rng.standard_normal(3000).astype(np.float32) * np.float32(2.0) ** rng.integers(-12, 10, 3000).astype(np.float32))
    vals.append(np.array([0.0, -0.0, 2**-10, 2**-9, 2**-11, 1e-40, -1e-40, 447.9, 448.0, 449.0, 463.9, 464.0,
                          465.0, 480.0, 1e30, np.inf, -np.inf, np.nan, -np.nan, 2**-6, 2**-7 * 1.5,
                          np.finfo(np.float32).tiny, -np.finfo(np.float32).max], dtype=np.float32))
    allv = np.concatenate(vals).astype(np.float32)
    allv = np.concatenate([allv, -allv])
    enc = encode(allv)

    index_k = []
    for fmt in ("fp32", "ue8m0"):
        for i in range(200):
            mag = [1e-7, 1.0, 300.0][i % 3] * np.float32(2.0) ** rng.integers(-4, 4)
            key = (rng.standard_normal(128) * mag).astype(BF16)
            amax = np.abs(key.astype(np.float32)).max()
            s = np.maximum(amax, np.float32(1e-4)) / np.float32(448)
            if fmt == "ue8m0":
                s = pow2_ceil(s)
            s = np.float32(s)
            q = encode(key.astype(np.float32) / s)
            index_k.append([key.view(np.uint16).tolist(), fmt, q.tolist(), int(np.float32(s).view(np.uint32))])

    kv_tiles = []
    for i in range(200):
        mag = [1e-7, 1.0, 3000.0][i % 3]
        tile = (rng.standard_normal(128) * mag).astype(BF16)
        amax = np.abs(tile.astype(np.float32)).max()
        s = pow2_ceil(np.maximum(amax / np.float32(448), np.float32(1e-4)))
        s = np.float32(s)
        q = encode(tile.astype(np.float32) / s)
        kv_tiles.append([tile.view(np.uint16).tolist(), q.tolist(), int(s.view(np.uint32))])

    model1 = []
    for i in range(100):
        mag = [1e-7, 1.0, 3000.0, 1e-30][i % 4]
        nope = (rng.standard_normal(448) * mag).astype(BF16)
        m_codes, m_scales = [], []
        for t in range(7):
            tile = nope[64 * t:64 * t + 64].astype(np.float32)
            s = pow2_ceil(np.maximum(np.abs(tile).max() / np.float32(448), np.float32(1e-4)))
            m_codes += encode(tile / s).tolist()
            m_scales.append(int(np.float32(s).astype(E8M0).view(np.uint8)))
        model1.append([nope.view(np.uint16).tolist(), m_codes, m_scales])

    fp4 = []
    for i in range(300):
        mag = [1e-3, 1.0, 50.0, 1e-37, 0.0][i % 5]
        key = (rng.standard_normal(128) * mag).astype(BF16)
        packed, scales = [], []
        for g in range(4):
            grp = key[32 * g:32 * g + 32].astype(np.float32)
            amax = np.abs(grp).max()
            s = np.maximum(pow2_ceil(np.float32(amax / np.float32(6))), np.float32(2.0 ** -126))
            if amax / np.float32(6) < np.float32(2.0 ** -126):
                s = np.float32(2.0 ** -126)
            c = (grp / s).astype(E2M1).view(np.uint8) & 0xF
            packed += (c[0::2] | (c[1::2] << 4)).tolist()
            scales.append(int(np.float32(s).astype(E8M0).view(np.uint8)))
        fp4.append([key.view(np.uint16).tolist(), packed, scales])

    json.dump({
        "seed": seed,
        "decode": [[int(c), int(b)] for c, b in zip(codes, decode.view(np.uint32))],
        "encode": [[int(b), int(c)] for b, c in zip(allv.view(np.uint32), enc)],
        "index_k": index_k,
        "kv_tiles": kv_tiles,
        "model1": model1,
        "fp4": fp4,
    }, sys.stdout)


if __name__ == "__main__":
    main()
