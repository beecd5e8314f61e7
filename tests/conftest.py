"""Fixtures shared by the test files. The op tests run on every device present: ``device`` is
``cpu`` always and ``cuda`` where there is a CUDA device and pyppo was built with CUDA (those
cases carry the ``cuda`` mark, so ``pytest -m cuda`` selects them; elsewhere they skip)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# CI draws the same hypothesis examples on every run (a red CI run must be reproducible and must
# not depend on luck); a developer's run explores new ones unless HYPOTHESIS_PROFILE=ci.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])


def _cuda_usable() -> bool:
    try:
        import pyppo
    except ImportError:
        return False
    return torch.cuda.is_available() and bool(getattr(pyppo._C, "with_cuda", False))


HAS_CUDA = _cuda_usable()
_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and pyppo built with CUDA (pyppo._C.with_cuda)"),
    ],
)


@pytest.fixture(params=["cpu", _CUDA])
def device(request) -> str:
    return request.param


@pytest.fixture(params=["cpu", _CUDA, "meta", "fake"])
def path(request) -> str:
    """Where an op runs: a device, or its Meta kernel (meta tensors, or FakeTensorMode as
    torch.compile traces it). Error tests compare each path's exception with the CPU one's."""
    return request.param
