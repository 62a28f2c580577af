#!/usr/bin/env bash
# Device check for a bare GPU machine (no cargo, no pip, no network): everything it runs
# was built elsewhere and carried (see scripts/device-bundle.sh and the README).
#
#   bash scripts/device-check.sh [--dry-run] [--bin PATH] [--suite-bin PATH]
#                                [--budget-s N] OUT_DIR
#
# In one run of at most --budget-s seconds (default 330, for a 6-minute slot) it:
#   1. records nvidia-smi, the driver and the kernels report            -> env.txt
#   2. validates every op on cuda (quick sizes; the full suite if time is left),
#      and runs the carried conformance-suite test binary (cuda instance) -> validate.json
#   3. runs compute-sanitizer memcheck, racecheck, synccheck, initcheck over a small
#      validate run of every kernel (tiny configs)                       -> sanitize.txt
#   4. `sparsekit bench --backend cuda` (our copy ceiling measured in the run) -> bench.json
#   5. times PyTorch peers at the bench's shapes, and measures the device's copy
#      bandwidth and bf16 tensor-core peak in the same run               -> peers.json
#   6. ncu --clock-control none on one launch of each kernel: bandwidth, occupancy,
#      tensor-pipe utilisation (where counters are readable)             -> in summary.json
#   7. the Python package (carried in out/device/python by device-bundle.sh): its pytest
#      suite on CUDA tensors (python/tests, the cuda instances of every test), and
#      python/bench/bench_torch.py timing ours against pure-torch references in the same run
#      (its JSON goes to log.txt)
#   8. summary.md (the table) + summary.json; log.txt (every step's command, status,
#      seconds and output tail).
# At most 8 files under OUT_DIR. A step that fails, times out or finds its tool missing
# is recorded as such and the others still run. Exit status: 0 when every step that ran
# passed, 1 otherwise (2 on usage errors).
#
# --dry-run: the same plumbing without a GPU (CI runs it): validate and bench on the cpu
# backend at smoke sizes, peers in "no torch" or cpu mode, sanitizers and ncu recorded
# as skipped; the same files, the same summary.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
DRY=0
BIN=""
SUITE_BIN=""
BUDGET=330
OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --bin) BIN="${2:-}"; shift ;;
        --suite-bin) SUITE_BIN="${2:-}"; shift ;;
        --budget-s) BUDGET="${2:-}"; shift ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) OUT="$1" ;;
    esac
    shift
done
[[ -n "$OUT" ]] || { echo "usage: $0 [--dry-run] [--bin PATH] [--suite-bin PATH] [--budget-s N] OUT_DIR" >&2; exit 2; }
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "--budget-s wants whole seconds" >&2; exit 2; }
if [[ -z "$BIN" ]]; then
    for cand in "$ROOT/out/device/sparsekit" "$ROOT/target/release/sparsekit"; do
        [[ -x "$cand" ]] && { BIN="$cand"; break; }
    done
fi
[[ -x "$BIN" ]] || { echo "no sparsekit binary (give --bin; build it with scripts/device-bundle.sh)" >&2; exit 2; }
if [[ -z "$SUITE_BIN" && -x "$ROOT/out/device/cuda_suite" ]]; then
    SUITE_BIN="$ROOT/out/device/cuda_suite"
fi
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || { echo "python3 not found" >&2; exit 2; }

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
RAW="$(mktemp -d)"
trap 'rm -rf "$RAW"' EXIT
START=$(date +%s)
DEADLINE=$((START + BUDGET))
STEPS="$RAW/steps.tsv"   # name, status, seconds, note
: >"$STEPS"
LOG="$OUT/log.txt"
{
    echo "device-check $(date -u +%FT%TZ) dry_run=$DRY budget=${BUDGET}s"
    echo "bin: $BIN"
    echo "suite bin: ${SUITE_BIN:-none}"
} >"$LOG"

if [[ $DRY == 1 ]]; then
    BACKEND=cpu
    SMALL=(--quick --op copy_pages,page_checksums --config tiny)
else
    BACKEND=cuda
    SMALL=(--quick --config tiny)
fi

now() { date +%s; }
left() { echo $((DEADLINE - $(now))); }

# run_step NAME MAX_SECONDS RESERVE_SECONDS OUTFILE CMD...: runs CMD with stdout to
# OUTFILE (stderr to the raw log) for at most min(MAX, time left - RESERVE) seconds, where
# RESERVE is what the steps after it need at least. Records the outcome in $STEPS.
run_step() {
    local name="$1" max="$2" reserve="$3" out="$4"
    shift 4
    local avail=$(( $(left) - reserve ))
    local limit=$(( max < avail ? max : avail ))
    if (( limit < 5 )); then
        printf '%s\tskipped\t0\tno time left in the %ss budget\n' "$name" "$BUDGET" >>"$STEPS"
        echo "== $name: skipped (no time left)" >>"$LOG"
        return 0
    fi
    local t0 rc t
    t0=$(now)
    echo "== $name (limit ${limit}s): $*" >>"$LOG"
    timeout --kill-after=5 "$limit" "$@" >"$out" 2>"$RAW/$name.err"
    rc=$?
    t=$(( $(now) - t0 ))
    tail -n 25 "$RAW/$name.err" >>"$LOG"
    local status=pass note="exit $rc"
    if (( rc == 124 || rc == 137 )); then
        status=timeout note="stopped after ${limit}s"
    elif (( rc != 0 )); then
        status=fail
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$t" "$note" >>"$STEPS"
    echo "-- $name: $status ($note, ${t}s)" >>"$LOG"
}

skip_step() {
    printf '%s\tskipped\t0\t%s\n' "$1" "$2" >>"$STEPS"
    echo "== $1: skipped ($2)" >>"$LOG"
}

# 1. environment ------------------------------------------------------------------------
{
    echo "### date"; date -u +%FT%TZ
    echo "### uname"; uname -a
    echo "### nvidia-smi"
    if [[ $DRY == 1 ]]; then
        echo "(dry run: not queried)"
    elif command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
        nvidia-smi 2>&1 | head -n 20
    else
        echo "nvidia-smi not found"
    fi
    echo "### tools"
    for t in compute-sanitizer ncu cuobjdump; do
        printf '%s: %s\n' "$t" "$(command -v "$t" || echo missing)"
    done
    "$PYTHON" -c 'import sys; print("python", sys.version.split()[0])' 2>&1
    echo "### sparsekit kernels"
} >"$OUT/env.txt"
run_step kernels 20 300 "$RAW/kernels.txt" "$BIN" kernels
cat "$RAW/kernels.txt" >>"$OUT/env.txt"

# 2. validation -------------------------------------------------------------------------
if [[ $DRY == 1 ]]; then
    run_step validate_quick 120 200 "$RAW/validate_quick.json" \
        "$BIN" validate --backend "$BACKEND" --json --quick --op copy_pages,page_checksums
else
    run_step validate_quick 90 230 "$RAW/validate_quick.json" \
        "$BIN" validate --backend "$BACKEND" --json --quick
fi
if [[ -n "$SUITE_BIN" && -x "$SUITE_BIN" ]]; then
    if [[ $DRY == 1 ]]; then
        skip_step conformance_cuda "dry run (binary present: $SUITE_BIN)"
    else
        run_step conformance_cuda 90 200 "$RAW/conformance.txt" \
            env SPARSEKIT_REQUIRE_BACKENDS=cuda "$SUITE_BIN" --test-threads 1
        tail -n 40 "$RAW/conformance.txt" >>"$LOG"
    fi
else
    skip_step conformance_cuda "no carried test binary (scripts/device-bundle.sh builds it)"
fi

# 3. sanitizers --------------------------------------------------------------------------
: >"$OUT/sanitize.txt"
for tool in memcheck racecheck synccheck initcheck; do
    if [[ $DRY == 1 ]]; then
        skip_step "sanitize_$tool" "dry run"
        echo "### $tool: skipped (dry run)" >>"$OUT/sanitize.txt"
        continue
    fi
    if ! command -v compute-sanitizer >/dev/null; then
        skip_step "sanitize_$tool" "compute-sanitizer not found"
        echo "### $tool: compute-sanitizer not found" >>"$OUT/sanitize.txt"
        continue
    fi
    run_step "sanitize_$tool" 45 150 "$RAW/sanitize_$tool.out" \
        compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
        "$BIN" validate --backend "$BACKEND" "${SMALL[@]}"
    {
        echo "### $tool"
        grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|========= (Invalid|Uninitialized|Barrier|Race|Error|Program hit)' \
            "$RAW/sanitize_$tool.out" "$RAW/sanitize_$tool.err" | head -n 40
        tail -n 3 "$RAW/sanitize_$tool.err"
    } >>"$OUT/sanitize.txt" 2>/dev/null
done

# 4. bench ------------------------------------------------------------------------------
if [[ $DRY == 1 ]]; then
    run_step bench 120 60 "$RAW/bench.json" "$BIN" bench --backend "$BACKEND" --json --quick --samples 2
else
    run_step bench 90 100 "$RAW/bench.json" "$BIN" bench --backend "$BACKEND" --json --samples 10
fi

# 5. peers ------------------------------------------------------------------------------
PEER_ARGS=(--bench "$RAW/bench.json")
[[ $DRY == 1 ]] && PEER_ARGS+=(--dry-run)
run_step peers 60 60 "$RAW/peers.json" "$PYTHON" "$HERE/device/peers.py" "${PEER_ARGS[@]}"

# 6. ncu ---------------------------------------------------------------------------------
: >"$RAW/ncu.csv"
NCU_METRICS="gpu__time_duration.sum,dram__bytes_read.sum.per_second,dram__bytes_write.sum.per_second,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers"
# The DSA kernels each have a bench op of their name (the fp4 indexer runs in the
# indexer_logits bench, DeepSeek-V4 attention in sparse_mla_v4); the dense model kernels
# run in the carried suite binary's dense_ops_give_the_cpu_bits test.
DSA_KERNELS="index_k_store kv_store copy_pages page_checksums indexer_logits indexer_logits_fp4 topk sparse_mla sparse_mla_v4"
DENSE_KERNELS="dense_matmul dense_rms_norm dense_rope dense_swiglu dense_gather_rows dense_add dense_cast dense_argmax dense_gated_pool"
for k in $DSA_KERNELS $DENSE_KERNELS; do
    if [[ $DRY == 1 ]]; then
        skip_step "ncu_$k" "dry run"
        continue
    fi
    if ! command -v ncu >/dev/null; then
        skip_step "ncu_$k" "ncu not found"
        continue
    fi
    if [[ " $DENSE_KERNELS " == *" $k "* ]]; then
        if [[ -z "$SUITE_BIN" ]]; then
            skip_step "ncu_$k" "no carried test binary (the dense kernels run in it)"
            continue
        fi
        target=("$SUITE_BIN" --exact dense_ops_give_the_cpu_bits --test-threads 1)
    else
        # A kernel's bench op is its name, but for the fp4 indexer (in indexer_logits).
        op="$k"
        [[ $k == indexer_logits_fp4 ]] && op=indexer_logits
        target=("$BIN" bench --backend "$BACKEND" --quick --samples 1 --op "$op")
    fi
    run_step "ncu_$k" 25 25 "$RAW/ncu_$k.csv" \
        ncu --clock-control none --target-processes all -k "regex:^${k}\$" -c 1 \
        --metrics "$NCU_METRICS" --csv "${target[@]}"
    cat "$RAW/ncu_$k.csv" >>"$RAW/ncu.csv"
done

# 7. the Python package on CUDA tensors ----------------------------------------------------
PYPKG="${SPARSEKIT_PYPKG:-$ROOT/out/device/python}"
if [[ $DRY == 1 ]]; then
    skip_step python_cuda "dry run"
    skip_step python_timing "dry run"
elif [[ ! -d "$PYPKG/sparsekit" ]]; then
    skip_step python_cuda "no carried package in $PYPKG (scripts/device-bundle.sh builds it)"
    skip_step python_timing "no carried package in $PYPKG"
elif ! "$PYTHON" -c 'import torch, pytest; assert torch.cuda.is_available()' 2>/dev/null; then
    skip_step python_cuda "$PYTHON lacks torch with CUDA, or pytest"
    skip_step python_timing "$PYTHON lacks torch with CUDA"
else
    run_step python_cuda 120 60 "$RAW/python_cuda.txt" \
        env PYTHONPATH="$PYPKG" PYTHONDONTWRITEBYTECODE=1 \
        "$PYTHON" -m pytest -q -p no:cacheprovider -k cuda "$ROOT/python/tests"
    tail -n 30 "$RAW/python_cuda.txt" >>"$LOG"
    run_step python_timing 60 30 "$RAW/python_timing.json" \
        env PYTHONPATH="$PYPKG" "$PYTHON" "$ROOT/python/bench/bench_torch.py" --device cuda
    { echo "### python_timing (ours vs pure torch, same run)"; cat "$RAW/python_timing.json"; } >>"$LOG"
fi

# 8. full validation if time is left -----------------------------------------------------
if [[ $DRY == 1 ]]; then
    skip_step validate_full "dry run"
else
    run_step validate_full 240 15 "$RAW/validate_full.json" \
        "$BIN" validate --backend "$BACKEND" --json
fi

# summary --------------------------------------------------------------------------------
"$PYTHON" "$HERE/device/summary.py" --raw "$RAW" --out "$OUT" --dry-run "$DRY" \
    --elapsed "$(( $(now) - START ))" --budget "$BUDGET" >>"$LOG" 2>&1
rc=$?
if (( rc == 2 )); then
    echo "summary failed: see $OUT/log.txt" >&2
    exit 1
fi
cat "$OUT/summary.md"
exit "$rc"
