"""pyppo: PPO for language models, with compiled hot paths.

Importing pyppo loads the compiled extension ``pyppo._C``, which registers the operators
``torch.ops.pyppo.*`` with their CPU, CUDA and Meta (fake) kernels; :mod:`pyppo.ops` wraps them
with keyword arguments and registers their autograd. ``pyppo.PPOTrainer`` (the trainer with its run,
:mod:`pyppo.run.trainer`) and
``pyppo.PPOConfig`` are imported on first use, so that ``import pyppo`` stays light.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _pkg_version

import torch  # noqa: F401  (libtorch must be loaded before the extension that links to it)

try:
    from . import _C
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "pyppo's compiled extension pyppo._C could not be loaded "
        f"({e}). Build it against the installed torch with: "
        "pip install --no-build-isolation -e ."
    ) from e


def _check_torch_abi() -> None:
    built, running = _C.torch_version, torch.__version__
    # A libtorch extension is tied to the exact torch release it was compiled against; the
    # local tag (+cpu, +cu128) matters too, since CPU and CUDA builds differ in symbols.
    if built != running:
        raise ImportError(
            f"pyppo was built against torch {built} but torch {running} is installed. "
            "Rebuild pyppo against the installed torch with: "
            "pip install --no-build-isolation --force-reinstall --no-deps ."
        )


_check_torch_abi()


def _check_cpu_capability() -> None:
    # Checked here so a typo fails at import with one line, not at the first kernel call with a
    # C++ stack trace.
    import os

    value = os.environ.get("PYPPO_CPU_CAPABILITY", "")
    if value and value.lower() not in ("default", "avx2", "avx512"):
        raise ImportError(f"PYPPO_CPU_CAPABILITY must be one of default, avx2, avx512 (or unset); got {value!r}")


_check_cpu_capability()

try:
    __version__ = _pkg_version("pyppo")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = _C.__version__

from . import ops  # noqa: E402,F401

__all__ = ["PPOConfig", "PPOTrainer", "ops", "__version__"]


def __getattr__(name: str):
    if name == "PPOTrainer":
        from .run.trainer import PPOTrainer

        return PPOTrainer
    if name == "PPOConfig":
        from .config import PPOConfig

        return PPOConfig
    raise AttributeError(f"module 'pyppo' has no attribute {name!r}")
