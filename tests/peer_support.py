"""Test support for the peer-integration tests (tests/test_integration_*.py).

* :func:`import_peer` imports a peer module, or skips the test when the peer is not installed
  (``bash scripts/setup.sh`` installs the pinned releases; a bare ``pip install pyppo[test]``
  does not).
* :func:`install_flash_attn_stub`: OpenRLHF's ``openrlhf.models`` imports ``flash_attn`` at
  module level (``ring_attn_utils``), and flash-attn cannot be installed on a CPU machine. The
  stub provides only the names those imports bind; calling any of them raises. OpenRLHF's
  ``log_probs_from_logits`` looks for ``flash_attn.ops.triton.cross_entropy`` inside a
  ``try/except ImportError``: the stub does not provide it, so OpenRLHF takes its torch path,
  which is what a CPU user of OpenRLHF runs. A real flash-attn, when installed, is used instead.
* :func:`pyppo_ops_called` records which ``torch.ops.pyppo.*`` operators ran in a block, to
  check that a patched peer function really went through pyppo.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

FLASH_ATTN_STUB_NAMES = {
    "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils.distributed": ("all_gather",),
}


def _unavailable(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"{name} is a test stub of flash-attn (not installable on a CPU machine)")

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


def install_flash_attn_stub() -> bool:
    """Put a stub ``flash_attn`` in ``sys.modules`` unless a real one is importable.
    Returns True when the stub was installed (or already is)."""
    if "flash_attn" in sys.modules:
        return getattr(sys.modules["flash_attn"], "__pyppo_stub__", False)
    if importlib.util.find_spec("flash_attn") is not None:
        return False
    packages = {"flash_attn", "flash_attn.utils"}
    for name in sorted(packages | set(FLASH_ATTN_STUB_NAMES)):
        mod = types.ModuleType(name)
        # A spec is needed: transformers probes find_spec("flash_attn") and rejects a None spec.
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name in packages)
        if name in packages:
            mod.__path__ = []
        mod.__pyppo_stub__ = True
        for attr in FLASH_ATTN_STUB_NAMES.get(name, ()):
            setattr(mod, attr, _unavailable(f"{name}.{attr}"))
        sys.modules[name] = mod
    sys.modules["flash_attn"].bert_padding = sys.modules["flash_attn.bert_padding"]
    sys.modules["flash_attn"].utils = sys.modules["flash_attn.utils"]
    sys.modules["flash_attn.utils"].distributed = sys.modules["flash_attn.utils.distributed"]
    return True


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
