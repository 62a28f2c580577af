#!/usr/bin/env bash
# Idempotent setup of everything the PTX build (build.rs) and its checks use:
#   * nightly toolchain + rust-src + llvm-tools (rustc -> bitcode, llvm-link/opt/llc)
#   * crates the -Zbuild-std=core build resolves (pre-fetched, so later builds work offline)
#   * ptxas + cuobjdump from PyPI, in the git-ignored .tools/ folder (no CUDA install needed)
# Re-running is cheap: every step checks before it acts.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLCHAIN="${SPARSEKIT_NIGHTLY:-nightly}"
# CUDA 13.2 (ptxas 13.2: sm_75..sm_121, PTX ISA <= 9.2). The cuobjdump wheel
# only exists from 13.2.51 on; keep both at the same release.
NVCC_PKG="nvidia-cuda-nvcc==13.2.86"
CUOBJDUMP_PKG="nvidia-cuda-cuobjdump==13.2.86"
NVDISASM_PKG="nvidia-cuda-nvdisasm==13.2.86"   # cuobjdump --dump-sass runs nvdisasm
TOOLS="$ROOT/.tools"
PYTHON="${PYTHON:-python3}"

say() { printf '==> %s\n' "$*"; }

# 1. nightly toolchain + components -------------------------------------------
if ! command -v rustup >/dev/null; then
    echo "rustup not found: install it from https://rustup.rs first" >&2
    exit 1
fi
if rustup run "$TOOLCHAIN" rustc -V >/dev/null 2>&1; then
    say "rustup component add rust-src llvm-tools --toolchain $TOOLCHAIN"
    rustup component add rust-src llvm-tools --toolchain "$TOOLCHAIN"
else
    say "rustup toolchain install $TOOLCHAIN (+ rust-src, llvm-tools)"
    rustup toolchain install "$TOOLCHAIN" --profile minimal --component rust-src --component llvm-tools
fi
SYSROOT="$(rustup run "$TOOLCHAIN" rustc --print sysroot)"

# 2. crates needed by -Zbuild-std (cargo resolves the whole std workspace even
#    for `core`; without this an offline build fails) ----------------------------
say "cargo +$TOOLCHAIN fetch (std workspace deps for -Zbuild-std)"
rustup run "$TOOLCHAIN" cargo fetch --manifest-path "$SYSROOT/lib/rustlib/src/rust/library/Cargo.toml" -q

# 3. ptxas + cuobjdump ----------------------------------------------------------
mkdir -p "$TOOLS/bin"
printf '*\n' > "$TOOLS/.gitignore"       # ignored even without the root .gitignore entry
want_nvcc="$TOOLS/cuda/nvidia_cuda_nvcc-${NVCC_PKG#*==}.dist-info"
want_cuobj="$TOOLS/cuda/nvidia_cuda_cuobjdump-${CUOBJDUMP_PKG#*==}.dist-info"
want_disasm="$TOOLS/cuda/nvidia_cuda_nvdisasm-${NVDISASM_PKG#*==}.dist-info"
if [[ -d "$want_nvcc" && -d "$want_cuobj" && -d "$want_disasm" ]]; then
    say "$NVCC_PKG, $CUOBJDUMP_PKG, $NVDISASM_PKG already in .tools/cuda"
else
    say "pip install --target .tools/cuda $NVCC_PKG $CUOBJDUMP_PKG $NVDISASM_PKG"
    # --no-deps: nvcc's deps (nvidia-nvvm, -cuda-runtime, -cuda-crt) are not needed for ptxas.
    # --upgrade: lets pip replace an older version already in the --target dir.
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
        --target "$TOOLS/cuda" "$NVCC_PKG" "$CUOBJDUMP_PKG" "$NVDISASM_PKG"
fi
CUDA_BIN="$TOOLS/cuda/nvidia/cu13/bin"
for t in ptxas cuobjdump nvdisasm; do
    if [[ -x "$CUDA_BIN/$t" ]]; then ln -sfn "../cuda/nvidia/cu13/bin/$t" "$TOOLS/bin/$t"; fi
done
"$TOOLS/bin/ptxas" --version | grep -i release
"$TOOLS/bin/cuobjdump" --version | grep -i release

# 4. make cargo rerun build.rs so it starts validating with ptxas --------------
touch "$ROOT/build.rs"

cat <<EOF

nightly sysroot : $SYSROOT
llc / llvm-link : $SYSROOT/lib/rustlib/$(rustup run "$TOOLCHAIN" rustc -vV | sed -n 's/^host: //p')/bin/
ptxas           : $TOOLS/bin/ptxas -> $(readlink -f "$TOOLS/bin/ptxas")
cuobjdump       : $TOOLS/bin/cuobjdump -> $(readlink -f "$TOOLS/bin/cuobjdump")
nvdisasm        : $TOOLS/bin/nvdisasm -> $(readlink -f "$TOOLS/bin/nvdisasm")
SASS            : PATH="$TOOLS/bin:\$PATH" cuobjdump --dump-sass <file.cubin>   (cuobjdump needs nvdisasm on PATH or NVDISASM_PATH)
build.rs finds ptxas in .tools/bin automatically (or set PTXAS=/path/to/ptxas).
EOF
