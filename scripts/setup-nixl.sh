#!/usr/bin/env bash
# Idempotent setup of what the NIXL transport needs:
#   * libclang (build time: the nixl-sys crate generates its bindings with bindgen). Test
#     builds (`cargo test --workspace`) include the NIXL transport; `cargo build` does not.
#   * the NIXL runtime (run time): the PyPI wheel nixl-cu12, without its dependencies
#     (~240 MB; the default install pulls in torch), in the git-ignored .tools/nixl/.
#     Programs find it through LD_LIBRARY_PATH=.tools/nixl/.nixl_cu12.mesonpy.libs; the
#     NIXL tests find it there by themselves (or through SPARSEKIT_NIXL_LIB).
# Re-running is cheap: every step checks before it acts.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NIXL_PKG="nixl-cu12==1.5.1"
TARGET="$ROOT/.tools/nixl"
PYTHON="${PYTHON:-python3}"

say() { printf '==> %s\n' "$*"; }

# 1. libclang -------------------------------------------------------------------
have_libclang() {
    [[ -n "${LIBCLANG_PATH:-}" ]] && ls "$LIBCLANG_PATH"/libclang*.so* >/dev/null 2>&1 && return 0
    ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang*.so* \
        /usr/lib/aarch64-linux-gnu/libclang*.so* /usr/lib64/libclang*.so* >/dev/null 2>&1
}
if have_libclang; then
    say "libclang present"
elif command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
    say "apt-get install libclang-dev"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >/dev/null
elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then
    say "sudo apt-get install libclang-dev"
    sudo apt-get update -qq
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >/dev/null
else
    echo "libclang not found: install it (Debian/Ubuntu: apt-get install libclang-dev;" \
         "Fedora: dnf install clang-devel) or point LIBCLANG_PATH at it" >&2
    exit 1
fi

# 2. NIXL runtime -----------------------------------------------------------------
mkdir -p "$ROOT/.tools"
want="$TARGET/nixl_cu12-${NIXL_PKG#*==}.dist-info"
if [[ -d "$want" && -e "$TARGET/.nixl_cu12.mesonpy.libs/libnixl_capi.so" ]]; then
    say "$NIXL_PKG already in .tools/nixl"
else
    say "pip install --no-deps --target .tools/nixl $NIXL_PKG"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
        --target "$TARGET" "$NIXL_PKG"
fi
printf '*\n' > "$ROOT/.tools/.gitignore" 2>/dev/null || true
test -e "$TARGET/.nixl_cu12.mesonpy.libs/libnixl_capi.so"
say "NIXL runtime: LD_LIBRARY_PATH=$TARGET/.nixl_cu12.mesonpy.libs"
