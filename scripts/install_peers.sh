#!/usr/bin/env bash
# Installs the peer RL libraries whose functions pyppo.integrations replaces, at the releases the
# adapters reproduce, for the agreement tests and `pyppo bench --peer`. setup.sh runs it.
#
# veRL, OpenRLHF and TRL are installed with --no-deps: their declared dependencies pull vLLM, flash-attn,
# DeepSpeed's CUDA ops, wandb and other pins (transformers, ray) a CPU test machine neither needs
# nor can build. What is installed instead is only what importing these modules needs:
#   verl.trainer.ppo.core_algos, verl.utils.torch_functional   (veRL 0.9.1)
#   openrlhf.models.utils, openrlhf.models.actor               (OpenRLHF 0.11.2; flash_attn stubbed in tests)
#   trl.trainer.utils                                          (TRL 1.16.0)
#   verl.trainer.ppo.ray_trainer                               (veRL's compute_advantage)
#   rlox                                                       (rlox 1.2.0)
# and torch stays the release installed before (the constraint file forbids replacing it).
# Note: the veRL and OpenRLHF wheels install their test suites as a top-level `tests` package.
#
#   PYTHON=python3.11 bash scripts/install_peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

VERL=0.9.1
OPENRLHF=0.11.2
TRL=1.16.0
RLOX=1.2.0   # the `rlox` extra's pin (build_support/torch_pin.py)
DEEPSPEED=0.19.6   # OpenRLHF 0.11.2's pin; imported by openrlhf.models

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
$PY -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$constraints"

$PY -m pip install --quiet --no-deps "verl==$VERL" "openrlhf==$OPENRLHF" "trl==$TRL"
# DeepSpeed ships as an sdist; DS_BUILD_OPS=0 builds none of its CUDA/C++ ops (they are JIT-built
# on first use, which these imports never reach), and --no-build-isolation builds it against the
# installed torch instead of downloading another.
DS_BUILD_OPS=0 $PY -m pip install --quiet --no-deps --no-build-isolation "deepspeed==$DEEPSPEED"
# ray and tensordict: the newest releases inside both peers' pins (veRL: tensordict<=0.10.0;
# OpenRLHF: ray==2.55.0).
$PY -m pip install --quiet -c "$constraints" \
    "ray==2.55.0" "tensordict==0.10.0" omegaconf codetiming orjson pylatexenc pandas datasets \
    hjson msgpack py-cpuinfo pydantic psutil einops ninja
# rlox: one wheel whose few dependencies (numpy, gymnasium, which `import rlox` loads) install as
# they are, as the `rlox` extra installs them; torch stays (the constraint file).
$PY -m pip install --quiet -c "$constraints" "rlox==$RLOX"
# torchdata: veRL's trainer module (verl.trainer.ppo.ray_trainer, whose compute_advantage the
# critic estimators' adapter replaces) imports its data loader; --no-deps keeps torch as it is.
$PY -m pip install --quiet --no-deps "torchdata==0.11.0"
$PY - <<'PY'
import importlib.metadata as md
print("peers installed: " + ", ".join(f"{p} {md.version(p)}" for p in ("verl", "openrlhf", "trl", "rlox")))
PY
