#!/usr/bin/env bash
# The injection evidence of benches/RESULTS.md: every `repro --inject` on a configuration it
# bites, three ways — checks on with the reference comparison (caught: 0 corrupted, how
# many refused), checks on without it (caught by the servers' own checks alone, as in
# production), checks off (reproduced: corrupted > 0). One JSON per run in OUT (default
# target/injection-evidence), then a markdown table on stdout.
#   scripts/injection-evidence.sh [SESSIONS] [TURNS] [OUT]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SESSIONS="${1:-8}"
TURNS="${2:-3}"
OUT="${3:-$ROOT/target/injection-evidence}"
BIN="$ROOT/target/release/sparsekit"
mkdir -p "$OUT"
(cd "$ROOT" && cargo build --release --quiet)
for inj in host-pool-fp8-layout shared-item-size skip-index-wait no-generation-check \
           index-k-after-publish radix-overreach kernel-wrong-slot \
           host-tier-skips-index-k reload-kv-only compressor-state-lost pool-page-size-mismatch \
           pd-fp8-frame pd-read-before-landed stale-transfer-write model1-scales-as-interleaved; do
    case "$inj" in
        pd-*|stale-transfer-write|model1-*) cfg=bf16/host-on/pd-on ;;
        *) cfg=bf16/host-on/pd-off ;;
    esac
    model=tiny
    kv=bf16
    case "$inj" in
        compressor-state-lost|pool-page-size-mismatch) model=dsv4-tiny ;;
        model1-scales-as-interleaved) model=dsv4-tiny; kv=fp8_ds_mla ;;
    esac
    for mode in checks no-reference no-verify; do
        extra=()
        case "$mode" in
            no-reference) extra=(--no-reference) ;;
            no-verify) extra=(--no-verify) ;;
        esac
        echo "== $inj $mode ($cfg)" >&2
        "$BIN" repro --model "$model" --kv "$kv" --sessions "$SESSIONS" --turns "$TURNS" --configs "$cfg" \
            --inject "$inj" "${extra[@]}" --json > "$OUT/$inj.$mode.json" || true
    done
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("| injection | mode | corrupted | refused | detected | fallbacks | caught by | verdict |")
print("|---|---|---|---|---|---|---|---|")
for f in sorted(out.glob("*.json")):
    inj, mode = f.stem.rsplit(".", 1)
    try:
        run = json.loads(f.read_text())
    except Exception as e:
        print(f"| {inj} | {mode} | run failed: {e} |||||| |")
        continue
    for r in run["rows"]:
        if not r.get("available"):
            continue
        by = ", ".join(f"{c['check']} {c['count']}" for c in r.get("caught_by", []))
        cor = "no ref." if not r.get("reference", True) else r.get("corrupted")
        print(f"| {inj} | {mode} | {cor} | {r.get('refused')} | {r.get('detected')} | "
              f"{r.get('fallbacks')} | {by or '-'} | {r.get('verdict')} |")
PY
