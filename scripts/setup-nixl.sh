#!/usr/bin/env bash
# Idempotent setup of what the NIXL transport needs at run time (building needs nothing:
# the transport opens NIXL's C API library when first used): the PyPI wheel nixl-cu12,
# without its dependencies (~240 MB; the default install pulls in torch), in the
# git-ignored .tools/nixl/. sparsekit finds it there by itself (under the working
# directory or above the binary), or through SPARSEKIT_NIXL_LIB=<dir with libnixl_capi.so>.
# Re-running is cheap: every step checks before it acts.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NIXL_PKG="nixl-cu12==1.5.1"
TARGET="$ROOT/.tools/nixl"
PYTHON="${PYTHON:-python3}"

say() { printf '==> %s\n' "$*"; }

# The NIXL runtime -----------------------------------------------------------------
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
say "NIXL runtime: $TARGET/.nixl_cu12.mesonpy.libs (or SPARSEKIT_NIXL_LIB=<that dir>)"
