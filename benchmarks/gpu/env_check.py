"""gpu_check.sh's environment check, its first step: prints the Python, torch and torch CUDA
versions and, with GPU_CHECK_DEVICE=cuda, every device's name, sm_XY and memory; checks that every
Python package the selected steps import is there; exits non-zero (with a gpu_check: message) when
that torch has no CUDA, sees no device, or a package is missing (named in one line, with where its
wheel would come from).

    GPU_CHECK_DEVICE=cuda|cpu [GPU_CHECK_BUILDS=1] python benchmarks/gpu/env_check.py

No arguments; GPU_CHECK_DEVICE must be set (gpu_check.sh passes its own; GPU_CHECK_BUILDS=1 when
the build step is selected, which also needs the build tools). A non-zero exit makes gpu_check.sh
stop with status 1.
"""

import importlib.util
import os
import sys

import torch

# import name -> distribution: what pyppo imports at run time (build_support/torch_pin.py's
# DEPENDENCIES), what the tests import, and, for the build step, the build tools.
RUNTIME = {
    "numpy": "numpy",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "peft": "peft",
    "gguf": "gguf",
    "vaderSentiment": "vaderSentiment",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
    "tomli_w": "tomli-w",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "psutil": "psutil",
}
BUILD = {"scikit_build_core": "scikit-build-core", "pybind11": "pybind11", "cmake": "cmake", "ninja": "ninja"}


def missing_packages(builds: bool) -> list[str]:
    wanted = {**RUNTIME, **(BUILD if builds else {})}
    return sorted(dist for mod, dist in wanted.items() if importlib.util.find_spec(mod) is None)


if __name__ == "__main__":
    print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
    missing = missing_packages(os.environ.get("GPU_CHECK_BUILDS") == "1")
    if missing:
        sys.exit(
            "gpu_check: missing Python packages: "
            + " ".join(missing)
            + " (put their wheels in build/gpu_wheels, or GPU_CHECK_WHEELS: scripts/gpu_rehearsal.sh builds them)"
        )
    if os.environ["GPU_CHECK_DEVICE"] == "cuda":
        if torch.version.cuda is None:
            sys.exit("gpu_check: this torch has no CUDA")
        if not torch.cuda.is_available():
            sys.exit("gpu_check: torch sees no CUDA device")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"device {i}:", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
