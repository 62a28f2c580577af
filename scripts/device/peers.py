#!/usr/bin/env python3
"""PyTorch peers for `sparsekit bench --backend cuda`, timed in the same run.

Reads the bench report (`--bench bench.json`), parses each row's shape from its config id,
and times the PyTorch formulation of the same op at the same shape on the same GPU:

- ``topk``: ``torch.topk`` over ``[rows, ctx]`` f32 logits;
- ``indexer_logits``: batched matmul of bf16 queries ``[b, h, d]`` with the request's
  bf16 keys ``[b, ctx, d]``, ReLU, and the weighted sum over heads (fp8 keys are timed as
  bf16: PyTorch has no fp8 batched matmul for this shape);
- ``sparse_mla``: gather of the top-k latent rows ``[t, k, 576]`` from the pool, Q·Kᵀ,
  softmax in f32, P·V over the first 512 dims (the fp8_ds_mla cache is timed as bf16).

It also measures the device's ceilings in the same run: the copy bandwidth of a 1 GiB
device-to-device copy (bytes read + written per second) and the bf16 tensor-core peak of
an 8192³ matmul. Times are medians of CUDA-event-timed calls after warm-up.

Without torch or without a CUDA device (and always under ``--dry-run``) it writes a
report that says so (``available: false`` with the reason) and exits 0: peers are
optional on a bare machine, but never invented.
"""

import argparse
import json
import re
import sys

SHAPES = {
    "indexer_logits": re.compile(r"^(?P<dtype>[^/]+)/b(?P<b>\d+)_ctx(?P<ctx>\d+)_h(?P<h>\d+)_n(?P<n>\d+)$"),
    "topk": re.compile(r"^rows(?P<rows>\d+)_ctx(?P<ctx>\d+)_k(?P<k>\d+)$"),
    "sparse_mla": re.compile(r"^(?P<dtype>[^/]+)/t(?P<t>\d+)_h(?P<h>\d+)_topk(?P<k>\d+)$"),
}


def parse_rows(bench):
    """(op, config, shape dict) for every bench row a peer exists for."""
    out = []
    for r in bench.get("results", []):
        pat = SHAPES.get(r.get("op"))
        if pat is None:
            continue
        m = pat.match(r.get("config", ""))
        if m is None:
            continue
        out.append((r["op"], r["config"], {k: (v if k == "dtype" else int(v)) for k, v in m.groupdict().items()}))
    return out


def timed(torch, fn, warmup=3, iters=10):
    """Median seconds per call of fn() on the current stream, CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def peer_indexer(torch, s):
    b, ctx, h, n = s["b"], s["ctx"], s["h"], s["n"]
    d = 128
    dev = "cuda"
    q = torch.randn(b * n, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, ctx, d, device=dev, dtype=torch.bfloat16)
    w = torch.randn(b * n, 1, h, device=dev, dtype=torch.float32)
    kk = k.repeat_interleave(n, dim=0) if n > 1 else k

    def run():
        s_ = torch.bmm(q, kk.transpose(1, 2)).float().relu_()  # [rows, h, ctx]
        return torch.bmm(w, s_)  # [rows, 1, ctx]

    return timed(torch, run)


def peer_topk(torch, s):
    x = torch.randn(s["rows"], s["ctx"], device="cuda", dtype=torch.float32)
    return timed(torch, lambda: torch.topk(x, s["k"], dim=1))


def peer_sparse_mla(torch, s):
    t, h, k = s["t"], s["h"], s["k"]
    d_qk, d_v, pool = 576, 512, 65536
    q = torch.randn(t, h, d_qk, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(pool, d_qk, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, pool, (t, k), device="cuda")
    scale = d_qk ** -0.5

    def run():
        g = kv[idx]  # [t, k, d_qk]
        p = torch.softmax(torch.bmm(q, g.transpose(1, 2)).float() * scale, dim=-1)
        return torch.bmm(p.to(torch.bfloat16), g[..., :d_v])

    return timed(torch, run)


def ceilings(torch):
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = timed(torch, lambda: dst.copy_(src), warmup=2, iters=10)
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_s = timed(torch, lambda: a @ b, warmup=3, iters=10)
    return {
        "copy_bytes_per_s": 2 * n / copy_s,
        "copy_note": "1 GiB device-to-device copy_, bytes read + written",
        "bf16_tc_flops_per_s": 2 * m**3 / mm_s,
        "bf16_tc_note": "8192^3 bf16 matmul (torch, cuBLAS)",
    }


PEERS = {"indexer_logits": peer_indexer, "topk": peer_topk, "sparse_mla": peer_sparse_mla}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", required=True, help="bench report JSON (sparsekit bench --json)")
    ap.add_argument("--dry-run", action="store_true", help="parse and report, time nothing")
    a = ap.parse_args()
    try:
        with open(a.bench) as f:
            bench = json.load(f)
    except (OSError, ValueError) as e:
        bench = {}
        print(f"bench report unreadable: {e}", file=sys.stderr)
    rows = parse_rows(bench)
    report = {"available": False, "reason": "", "device": None, "ceilings": None, "peers": []}
    if a.dry_run:
        report["reason"] = "dry run: nothing timed"
    else:
        try:
            import torch  # noqa: PLC0415 (optional on the machine)
        except Exception as e:  # pragma: no cover - depends on the machine
            torch = None
            report["reason"] = f"torch not importable: {e}"
        if torch is not None and not torch.cuda.is_available():
            report["reason"] = "torch has no CUDA device"
            torch = None
        if torch is not None:
            report["available"] = True
            report["device"] = torch.cuda.get_device_name(0)
            report["torch"] = torch.__version__
            report["ceilings"] = ceilings(torch)
            torch.manual_seed(0)
    for op, config, shape in rows:
        entry = {"op": op, "config": config, "shape": shape, "peer": "torch", "time_s": None}
        if report["available"]:
            try:
                entry["time_s"] = PEERS[op](torch, shape)
            except Exception as e:  # one failing peer does not stop the others
                entry["error"] = str(e)
            torch.cuda.empty_cache()
        report["peers"].append(entry)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
