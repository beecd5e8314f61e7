#!/usr/bin/env bash
# Builds pyppo with its CUDA kernels against the CUDA of the installed torch (PYPPO_CUDA=on, so a
# CPU-only build is an error), after finding what torch's CMake config needs where it is:
#   toolkit  the directory holding bin/nvcc and the CUDA headers, first of: $CUDA_HOME,
#            $CUDA_PATH, the toolkit that the nvcc on PATH belongs to (asked from `nvcc --dryrun`,
#            so a wrapper script such as /usr/local/bin/nvcc resolves to its real toolkit),
#            /usr/local/cuda-<torch's X.Y>, /usr/local/cuda, then the nvidia-* wheels next to
#            torch (site-packages/nvidia/cu<X>, nvidia/cuda_nvcc). Its nvcc must have torch's CUDA
#            major version.
#   nvrtc    libnvrtc.so[.<X>], which torch's Caffe2 config requires (CUDA_nvrtc_LIBRARY): first in
#            the toolkit (lib64, lib, targets/*/lib), then in the nvidia-* wheels torch depends on
#            (site-packages/nvidia/cu<X>/lib, nvidia/cuda_nvrtc/lib).
# Then runs pip install --no-build-isolation --no-deps [-e] . with CUDA_HOME, CUDACXX, PATH and
# -DCUDA_TOOLKIT_ROOT_DIR / -DCUDA_nvrtc_LIBRARY / -DTORCH_CUDA_ARCH_LIST set from what it found.
# Anything missing stops it before the build with one line "build_cuda: <what> not found ...",
# exit status 2.
#
#   bash scripts/build_cuda.sh [-e] [--print] [EXTRA PIP ARGS...]
#     -e         editable install (what gpu_check.sh's build step uses)
#     --print    print what was found (KEY=value lines) and stop: no build
# Settings (environment): PYTHON (default python), TORCH_CUDA_ARCH_LIST (default 9.0: H100/H200),
# CMAKE_BUILD_PARALLEL_LEVEL (default nproc), CUDA_HOME / CUDA_PATH (the toolkit), PYPPO_CUDA_DIRS
# (the fixed places searched after PATH, default "/usr/local/cuda-<X.Y> /usr/local/cuda"),
# PYPPO_NVRTC (a libnvrtc file, skips the search), PYPPO_BUILD_LOG (pip's output goes there
# instead of the terminal; its last 80 lines are printed on failure).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
EDITABLE=()
PRINT=0
PIP_EXTRA=()
for a in "$@"; do
  case "$a" in
    -e|--editable) EDITABLE=(-e) ;;
    --print) PRINT=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) PIP_EXTRA+=("$a") ;;
  esac
done
die() { echo "build_cuda: $*" >&2; exit 2; }

# ---- torch and its CUDA --------------------------------------------------------------------
info=$($PY - <<'PY' 2>/dev/null
import os, sys, sysconfig, torch
print(torch.__version__)
print(torch.version.cuda or "")
print(os.path.dirname(os.path.dirname(torch.__file__)))  # site-packages
PY
) || die "torch not importable by $PY (install torch with CUDA first, e.g. pip install torch==2.11.0)"
{ read -r TORCH_VERSION; read -r TORCH_CUDA; read -r SITE; } <<< "$info"
[ -n "$TORCH_CUDA" ] || die "CUDA not found in torch $TORCH_VERSION (torch.version.cuda is None): install a CUDA build of torch"
CUDA_MAJOR=${TORCH_CUDA%%.*}

# ---- the toolkit (nvcc + headers) -------------------------------------------------------------
nvcc_major() { "$1/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p' | head -n 1; }
candidates=()
[ -n "${CUDA_HOME:-}" ] && candidates+=("$CUDA_HOME")
[ -n "${CUDA_PATH:-}" ] && candidates+=("$CUDA_PATH")
if command -v nvcc >/dev/null 2>&1; then
  top=$(cd /tmp && nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
  [ -n "$top" ] && candidates+=("$(cd "$top" 2>/dev/null && pwd)")
  candidates+=("$(cd "$(dirname "$(readlink -f "$(command -v nvcc)")")/.." && pwd)")
fi
# shellcheck disable=SC2206
candidates+=(${PYPPO_CUDA_DIRS-/usr/local/cuda-$TORCH_CUDA /usr/local/cuda} "$SITE/nvidia/cu$CUDA_MAJOR" "$SITE/nvidia/cuda_nvcc")
ROOT=""
tried=()
for c in "${candidates[@]}"; do
  [ -n "$c" ] || continue
  if [ -x "$c/bin/nvcc" ] && { [ -f "$c/include/cuda_runtime.h" ] || [ -f "$c/targets/x86_64-linux/include/cuda_runtime.h" ] \
                               || [ -f "$c/targets/sbsa-linux/include/cuda_runtime.h" ]; }; then
    m=$(nvcc_major "$c")
    if [ "$m" = "$CUDA_MAJOR" ]; then ROOT=$(cd "$c" && pwd); break; fi
    tried+=("$c (nvcc $m)")
  else
    tried+=("$c")
  fi
done
[ -n "$ROOT" ] || die "CUDA $CUDA_MAJOR.x toolkit (bin/nvcc + include/cuda_runtime.h) not found for torch $TORCH_VERSION; tried: ${tried[*]:-nothing}; set CUDA_HOME"
NVCC=$ROOT/bin/nvcc
NVCC_VERSION=$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p' | head -n 1)

# ---- nvrtc ------------------------------------------------------------------------------------
NVRTC=${PYPPO_NVRTC:-}
if [ -n "$NVRTC" ]; then
  [ -f "$NVRTC" ] || die "libnvrtc not found at PYPPO_NVRTC=$NVRTC"
else
  for d in "$ROOT/lib64" "$ROOT/lib" "$ROOT"/targets/*/lib "$SITE/nvidia/cu$CUDA_MAJOR/lib" "$SITE/nvidia/cuda_nvrtc/lib"; do
    for f in "$d/libnvrtc.so" "$d/libnvrtc.so.$CUDA_MAJOR"; do
      if [ -f "$f" ]; then NVRTC=$f; break 2; fi
    done
  done
  [ -n "$NVRTC" ] || die "libnvrtc.so.$CUDA_MAJOR not found (looked in $ROOT/lib64, $ROOT/lib, $ROOT/targets/*/lib, $SITE/nvidia/cu$CUDA_MAJOR/lib, $SITE/nvidia/cuda_nvrtc/lib): pip install nvidia-cuda-nvrtc, or set PYPPO_NVRTC"
fi

ARCHS=${TORCH_CUDA_ARCH_LIST:-9.0}
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
for v in TORCH_VERSION TORCH_CUDA ROOT NVCC NVCC_VERSION NVRTC ARCHS JOBS; do echo "build_cuda: $v=${!v}"; done
[ "$PRINT" = 1 ] && exit 0

# ---- the build --------------------------------------------------------------------------------
$PY -c "import scikit_build_core" 2>/dev/null || die "scikit-build-core not found by $PY (pip install scikit-build-core)"
$PY -c "import pybind11" 2>/dev/null || die "pybind11 not found by $PY (pip install pybind11)"
export CUDA_HOME=$ROOT CUDACXX=$NVCC PATH=$ROOT/bin:$PATH CMAKE_BUILD_PARALLEL_LEVEL=$JOBS TORCH_CUDA_ARCH_LIST=$ARCHS
cmd=($PY -m pip install --no-build-isolation --no-deps "${EDITABLE[@]}" .
     -Ccmake.define.PYPPO_CUDA=on -Ccmake.define.CUDA_TOOLKIT_ROOT_DIR="$ROOT"
     -Ccmake.define.CMAKE_CUDA_COMPILER="$NVCC" -Ccmake.define.CUDA_nvrtc_LIBRARY="$NVRTC"
     -Ccmake.define.TORCH_CUDA_ARCH_LIST="$ARCHS" -Cbuild.verbose=false "${PIP_EXTRA[@]}")
echo "build_cuda: ${cmd[*]}"
s0=$(date +%s)
if [ -n "${PYPPO_BUILD_LOG:-}" ]; then
  "${cmd[@]}" > "$PYPPO_BUILD_LOG" 2>&1; rc=$?
  [ "$rc" -ne 0 ] && tail -n 80 "$PYPPO_BUILD_LOG"
  grep -E "pyppo: (CUDA|CPU)" "$PYPPO_BUILD_LOG"
else
  "${cmd[@]}"; rc=$?
fi
[ "$rc" -eq 0 ] || { echo "build_cuda: the build failed (pip exit status $rc)" >&2; exit 1; }
echo "build_cuda: built in $(( $(date +%s) - s0 )) s"
