#!/usr/bin/env bash
# GPU check of pyppo's CUDA kernels, in one go, on a fresh CUDA machine with no network whose
# image has torch (with CUDA), nvcc, cmake, ninja, pybind11 and scikit-build-core:
#   1. build pyppo in place with the CUDA kernels (PYPPO_CUDA=on: a CPU-only build is an error);
#   2. run the CUDA tests (pytest -m cuda);
#   3. run the GPU suite of the benchmark harness (pyppo bench --suite gpu --quick), whose
#      table is printed last.
# Finishes in well under 8 minutes on an H100/H200-class machine. Exit status: the tests',
# else the benchmark's (1 = an op disagreed with its eager reference, 3 = a target missed).
#
#   bash benchmarks/gpu_check.sh            # TORCH_CUDA_ARCH_LIST defaults to 8.0;9.0
# Results: $OUT/gpu_bench.json when OUT is set (else a dated JSON in benchmarks/results/), and
# the log on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

PY=${PYTHON:-python}
stamp "environment"
$PY - <<'PYEOF' || exit 1
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
if torch.version.cuda is None:
    sys.exit("gpu_check: this torch has no CUDA")
p = torch.cuda.get_device_properties(0)
print("device:", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
PYEOF
command -v nvcc >/dev/null && nvcc --version | tail -n 2
nproc

stamp "build (pip install --no-build-isolation --no-deps -e ., PYPPO_CUDA=on)"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0}
if ! timeout 420 $PY -m pip install --no-build-isolation --no-deps --no-index -e . \
      -Ccmake.define.PYPPO_CUDA=on -Cbuild.verbose=false > /tmp/pyppo_build.log 2>&1; then
  tail -n 80 /tmp/pyppo_build.log
  stamp "BUILD FAILED"
  exit 1
fi
grep -E "pyppo: (CUDA|CPU)" /tmp/pyppo_build.log || true
$PY -c "import pyppo, pyppo._C as C; print('pyppo', pyppo.__version__, '| with_cuda', C.with_cuda, '| archs', C.cuda_archs); assert C.with_cuda" || exit 1

stamp "tests (pytest -m cuda)"
timeout 240 $PY -m pytest -m cuda -q -p no:cacheprovider --maxfail=25 --durations=5
TEST_RC=$?
stamp "tests exit status $TEST_RC"

stamp "benchmark (pyppo bench --suite gpu --quick)"
timeout 180 $PY -m pyppo.bench --suite gpu --quick --check-targets --output benchmarks/results \
  ${OUT:+--json "$OUT/gpu_bench.json"}
BENCH_RC=$?
stamp "done: tests $TEST_RC, benchmark $BENCH_RC"
if [ "$TEST_RC" -ne 0 ]; then exit "$TEST_RC"; fi
exit "$BENCH_RC"
