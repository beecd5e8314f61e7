"""pyppo's ops inside the RL libraries people already run: veRL, OpenRLHF, TRL and rlox.

Each submodule (:mod:`pyppo.integrations.verl`, :mod:`~pyppo.integrations.openrlhf`,
:mod:`~pyppo.integrations.trl`, :mod:`~pyppo.integrations.rlox`) holds adapters: functions with the
exact signature, defaults, return types, dtypes and masking conventions of the peer function of
the same name, computed with pyppo's ops. Call them directly, or swap them into the installed
peer in one line::

    import pyppo.integrations.verl
    pyppo.integrations.verl.patch()      # or pyppo.integrations.patch("verl")

``patch()`` replaces the functions in the peer's defining modules, in the peer's modules that
imported them by name and in its registries; it returns what it replaced, ``unpatch()`` puts it
back. A peer release the adapters were not written for is warned about and left unpatched. The
functions covered, the measured speed-ups and every place where an adapter does more than call a
pyppo op to match the peer's numbers: ``docs/integrations.md``.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager

from ._patching import Patch, PeerVersionWarning

__all__ = ["PEERS", "Patch", "PeerVersionWarning", "patch", "unpatch", "patched", "peer_status"]

PEERS = ("verl", "openrlhf", "trl", "rlox")


def _peer_module(peer: str):
    if peer not in PEERS:
        raise ValueError(f"pyppo.integrations: peer must be one of {', '.join(PEERS)}; got {peer!r}")
    return importlib.import_module(f"{__name__}.{peer}")


def patch(peer: str, *, force: bool = False) -> Patch:
    """``patch("verl")`` is ``pyppo.integrations.verl.patch()``; see the module docstring."""
    return _peer_module(peer).patch(force=force)


def unpatch(peer: str) -> Patch | None:
    """``unpatch("verl")`` is ``pyppo.integrations.verl.unpatch()``."""
    return _peer_module(peer).unpatch()


def patched(peer: str, *, force: bool = False) -> AbstractContextManager[Patch]:
    """``with patched("verl"): ...`` patches for the block only."""
    return _peer_module(peer).patched(force=force)


def peer_status() -> dict[str, dict[str, object]]:
    """For each peer: the installed release (None if absent), the releases the adapters reproduce,
    and whether ``patch()`` would patch without ``force``. Imports no peer package."""
    import importlib.metadata

    status = {}
    for peer in PEERS:
        spec = _peer_module(peer).PEER
        try:
            installed = importlib.metadata.version(spec.distribution)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        status[peer] = {
            "installed": installed,
            "written_for": list(spec.versions),
            "supported": installed in spec.versions,
        }
    return status
