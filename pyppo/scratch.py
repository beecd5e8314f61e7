"""Scratch directories that must not outlive the process, even when a signal ends it at once.

A second Ctrl-C (or a signal while the models load) ends a run with ``os._exit``, which runs no
``finally`` and no ``atexit``: a scratch directory registered here (the vLLM engine's copy of the
weights, hundreds of MB) is deleted by :func:`remove_all` first (``pyppo.run.stopping`` calls it).
"""

from __future__ import annotations

import contextlib
import shutil
from typing import Iterator

__all__ = ["removed_at_exit", "remove_all"]

_SCRATCH: set = set()


@contextlib.contextmanager
def removed_at_exit(path: str) -> Iterator[str]:
    """Within the block, an immediate exit on a signal deletes ``path`` first. The caller still
    deletes it on the normal path."""
    _SCRATCH.add(path)
    try:
        yield path
    finally:
        _SCRATCH.discard(path)


def remove_all() -> None:
    """Delete every registered scratch path (what an immediate exit does before it exits)."""
    for path in list(_SCRATCH):
        shutil.rmtree(path, ignore_errors=True)
