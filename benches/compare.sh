#!/bin/bash
# benches/compare.sh FILTER ROUNDS BIN... : runs criterion bench binaries (built with
# `cargo bench -p sparsekit-benches --no-run`, copied out of target/release/deps) in
# alternation, each in its own directory so that their criterion histories stay apart,
# and prints the median time of each case per round with the load average at its start.
# Alternating rounds put both builds under the same load, which on a shared machine
# matters more than the number of samples.
set -euo pipefail
F=$1; R=$2; shift 2
for r in $(seq "$R"); do
  for bin in "$@"; do
    d=$(dirname "$bin")
    echo "== $d round $r load $(cut -d' ' -f1 /proc/loadavg)"
    (cd "$d" && "./$(basename "$bin")" --bench "$F" 2>&1) | awk '
      /^[a-z_]+\/[^ ]+/ {name=$1}
      /time:/ && !/change:/ {s=$0; sub(/.*\[/, "", s); split(s, a, " "); printf "%-55s %s %s\n", name, a[3], a[4]}'
  done
done
