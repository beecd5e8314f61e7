"""Test support for the peer-integration tests (tests/test_integration_*.py).

* :func:`import_peer` imports a peer module, or skips the test when the peer is not installed
  (``bash scripts/setup.sh`` installs the pinned releases; a bare ``pip install pyppo[test]``
  does not).
* OpenRLHF's ``openrlhf.models`` imports ``flash_attn``, which cannot be installed on a CPU
  machine: :func:`import_peer` first calls pyppo's ``install_flash_attn_stub()`` (the one users
  call, ``pyppo/integrations/_flash_attn_stub.py``), which leaves a real flash-attn alone.
* :func:`pyppo_ops_called` records which ``torch.ops.pyppo.*`` operators ran in a block, to
  check that a patched peer function really went through pyppo.
"""

from __future__ import annotations

import importlib
import importlib.util
from contextlib import contextmanager

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from pyppo.integrations.openrlhf import install_flash_attn_stub


def import_peer(module: str):
    """Import ``module`` of a peer package, or skip the calling test if the peer is absent."""
    top = module.split(".", 1)[0]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"{top} is not installed (bash scripts/setup.sh installs the pinned peers)")
    if top == "openrlhf":
        install_flash_attn_stub()
    return importlib.import_module(module)


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("pyppo::"):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def pyppo_ops_called():
    """``with pyppo_ops_called() as ops: ...`` then ``ops`` lists the pyppo operators that ran
    (``"pyppo::gae"``, ...), in order, forward and backward."""
    recorder = _OpRecorder()
    with recorder:
        yield recorder.names
