"""A stand-in ``flash_attn`` for importing OpenRLHF on a machine without CUDA.

OpenRLHF 0.11.2's ``openrlhf.models`` imports ``flash_attn`` at module level
(``ring_attn_utils.py``), and flash-attn does not install without CUDA. The stub binds only the
names those imports need; calling any of them raises. OpenRLHF's ``log_probs_from_logits`` looks
for ``flash_attn.ops.triton.cross_entropy`` inside ``try/except ImportError``: the stub lacks it,
so OpenRLHF takes its torch path, which is what it runs without flash-attn. A real flash-attn, when
importable, is always used instead.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["install_flash_attn_stub", "flash_attn_is_stub"]

_NAMES = {
    "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils.distributed": ("all_gather",),
}
_PACKAGES = ("flash_attn", "flash_attn.utils")


def _unavailable(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(
            f"{name}: flash-attn is not installed; pyppo.integrations.openrlhf.install_flash_attn_stub() "
            "put a stand-in in its place so that OpenRLHF imports on a machine without CUDA"
        )

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


def flash_attn_is_stub() -> bool:
    """True when ``sys.modules["flash_attn"]`` is this stub."""
    return bool(getattr(sys.modules.get("flash_attn"), "__pyppo_stub__", False))


def install_flash_attn_stub() -> bool:
    """Put the stub in ``sys.modules`` unless a real ``flash_attn`` is importable (or imported).
    Call it before importing OpenRLHF. Returns True when the stub is (now) in place."""
    if "flash_attn" in sys.modules:
        return flash_attn_is_stub()
    if importlib.util.find_spec("flash_attn") is not None:
        return False
    for name in sorted(set(_PACKAGES) | set(_NAMES)):
        mod = types.ModuleType(name)
        # transformers probes find_spec("flash_attn") and rejects a module without a spec.
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name in _PACKAGES)
        if name in _PACKAGES:
            mod.__path__ = []
        mod.__pyppo_stub__ = True
        for attr in _NAMES.get(name, ()):
            setattr(mod, attr, _unavailable(f"{name}.{attr}"))
        sys.modules[name] = mod
    for name in sorted(set(_PACKAGES) | set(_NAMES)):
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
    return True
