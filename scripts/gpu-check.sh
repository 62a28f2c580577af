#!/usr/bin/env bash
# One-shot check on a machine with an NVIDIA GPU: build (PTX required), list the kernels
# with their resources, run the conformance suite's cuda instance (tests/cuda_suite.rs:
# every op against the f64 references, typed errors, streams and events, the copy/compute
# overlap; a skip is a failure here), validate the CUDA backend at full size, run the CUDA
# benches, then print a short summary. Full results go to the folder given as the first
# argument (default: ./gpu-check-<date>).
#
#   bash scripts/gpu-check.sh [OUT_DIR] [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}"
QUICK=""
[[ "${2:-}" == "--quick" ]] && QUICK="--quick"
mkdir -p "$OUT"
status=0

echo "==> setup (nightly components, ptxas) and release build with PTX required"
bash scripts/setup-gpu-tools.sh >"$OUT/setup.log" 2>&1 || { echo "setup failed: see $OUT/setup.log"; exit 2; }
SPARSEKIT_REQUIRE_PTX=1 cargo build --release >"$OUT/build.log" 2>&1 || { echo "build failed: see $OUT/build.log"; exit 2; }
BIN=target/release/sparsekit

echo "==> kernels"
$BIN kernels --json >"$OUT/kernels.json" || status=1
$BIN kernels | tee "$OUT/kernels.txt" >/dev/null

echo "==> conformance suite, cuda instance (cargo test --test cuda_suite)"
if SPARSEKIT_REQUIRE_PTX=1 SPARSEKIT_REQUIRE_BACKENDS=cuda \
    cargo test --release -p sparsekit --test cuda_suite -- --nocapture >"$OUT/cuda-suite.log" 2>&1; then
    c_status=pass
else
    c_status=FAIL; status=1
fi
grep -E "^test result|overlap|on two streams" "$OUT/cuda-suite.log" || true

echo "==> validate --backend cuda $QUICK"
if $BIN validate --backend cuda $QUICK --json >"$OUT/validate-cuda.json" 2>"$OUT/validate-cuda.err"; then
    v_status=pass
else
    v_status=FAIL; status=1
fi
$BIN validate --backend cpu --quick --op index_k_store,kv_store,copy_pages,page_checksums --json \
    >"$OUT/validate-cpu-quick.json" 2>/dev/null || true

echo "==> bench --backend cuda"
if $BIN bench --backend cuda --json >"$OUT/bench-cuda.json" 2>"$OUT/bench-cuda.err"; then
    b_status=ok
else
    b_status=FAIL; status=1
fi

echo
echo "=== summary ($(date -u +%FT%TZ), results in $OUT)"
head -n 1 "$OUT/validate-cuda.err" 2>/dev/null
python3 - "$OUT" <<'PY' || true
import json, sys, os
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception as e:
        print(f"  {name}: unreadable ({e})")
        return None
k = load("kernels.json") or []
spills = [r for r in k if r.get("spill_bytes", 0) and r.get("arch") != "sm_80"]
print(f"kernels: {len(k)} kernel x arch records, {len(spills)} with spills at sm_90/sm_120")
v = load("validate-cuda.json") or []
by = {}
for r in v:
    by.setdefault((r["op"], r["status"]), 0)
    by[(r["op"], r["status"])] += 1
print("validate cuda:")
for (op, st), n in sorted(by.items()):
    print(f"  {op:16s} {st:16s} {n}")
b = load("bench-cuda.json") or []
print("bench cuda:")
for r in b if isinstance(b, list) else b.get("results", []):
    print("  " + "  ".join(f"{k}={r[k]}" for k in ("op", "config", "time_us", "gbps", "fraction") if k in r))
PY
echo "conformance (cuda): $c_status, validate: $v_status, bench: $b_status"
exit $status
