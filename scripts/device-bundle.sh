#!/usr/bin/env bash
# Builds what scripts/device-check.sh runs on a bare GPU machine, here, into out/device/
# (git-ignored): the release `sparsekit` binary with the PTX (and ptxas-built cubins)
# embedded, the conformance suite's cuda test binary (tests/cuda_suite.rs), and the Python
# package (python/, built by maturin through pip, release, PTX embedded) installed into
# out/device/python (the device check runs its pytest suite on CUDA tensors there).
# cudarc loads the driver at run time, so nothing CUDA is needed to build. The debug
# info is stripped from the three binaries (function names stay, for backtraces): with it
# the bundle is ~165 MB, without it ~52 MB, so that it travels with the working tree to a
# device machine that takes 64 MiB in all.
#
#   bash scripts/device-bundle.sh            # then carry out/device and scripts/
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup-gpu-tools.sh >/dev/null
export SPARSEKIT_REQUIRE_PTX=1
cargo build --release --bin sparsekit
suite="$(cargo test --release -p sparsekit --test cuda_suite --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_suite":
        print(m["executable"])')"
[[ -x "$suite" ]] || { echo "cuda_suite test binary not found" >&2; exit 1; }
mkdir -p out/device
cp target/release/sparsekit out/device/sparsekit
cp "$suite" out/device/cuda_suite
# The Python package: needs maturin here (pip install -r python/requirements-test.txt);
# the device machine needs only its own python3 with torch and pytest.
rm -rf out/device/python out/device/wheel
python3 -m pip wheel --no-build-isolation --no-deps -q -w out/device/wheel ./python
python3 -m pip install --no-deps -q --target out/device/python out/device/wheel/*.whl
rm -rf out/device/wheel
# binutils' strip, else the llvm-objcopy of the nightly's llvm-tools (which
# setup-gpu-tools.sh installed above: a machine with only Rust has no strip).
if strip --version >/dev/null 2>&1; then
    strip_debug() { strip --strip-debug "$1"; }
else
    host="$(rustc -vV | sed -n 's/^host: //p')"
    nightly="$(rustup run "${SPARSEKIT_NIGHTLY:-nightly}" rustc --print sysroot)"
    objcopy="$nightly/lib/rustlib/$host/bin/llvm-objcopy"
    "$objcopy" --version >/dev/null || { echo "no strip, no $objcopy" >&2; exit 1; }
    strip_debug() { "$objcopy" --strip-debug "$1"; }
fi
for bin in out/device/sparsekit out/device/cuda_suite out/device/python/sparsekit/_native*.so; do
    strip_debug "$bin"
done
ls -la out/device
du -sh out/device
