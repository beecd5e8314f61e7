"""Replacing a whole directory so that a crash never leaves a half-written one: what a run's
``checkpoint/`` and ``policy/``, the converted-model cache and the benchmarks' model copies share.

:func:`swap_in` writes the new directory beside the old one and swaps the two with renames:

1. ``write(tmp)`` fills a fresh sibling ``.<name>.tmp-*``, which is then fsync'ed (``<name>``
   still holds the previous directory);
2. ``<name>`` is renamed to ``<name>.old`` (the previous directory, complete);
3. the temporary directory is renamed to ``<name>`` (the new one, complete);
4. ``<name>.old`` is deleted.

A crash before 2 leaves the previous directory at ``<name>``; between 2 and 3 at ``<name>.old``
(:func:`backup_of`), where a reader that knows the protocol finds it (``pyppo.run.checkpoint.find``);
after 3 the new one is at ``<name>``. Temporaries of a killed swap are removed by the next one.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["swap_in", "backup_of", "fsync_dir", "fsync_tree"]


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (the renames and new files in it) to disk, where the platform can."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` to disk."""
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            with open(os.path.join(dirpath, filename), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def backup_of(target: Path) -> Path:
    """``<name>.old``: where the previous directory is between the two renames of :func:`swap_in`."""
    return target.parent / f"{target.name}.old"


def swap_in(
    directory: str | os.PathLike,
    write: Callable[[Path], None],
    is_complete: Callable[[Path], bool],
    *,
    stale_after: float = 0.0,
) -> Path:
    """Replace ``directory`` by what ``write(tmp)`` puts into a fresh sibling temporary directory,
    by the protocol of the module docstring.

    Args:
        directory: the directory to (re)place; its parent is created.
        write: fills ``tmp`` (and fsyncs the files it writes).
        is_complete: tells a whole directory from debris (an incomplete ``<name>`` beside a complete
            ``<name>.old`` is dropped, and the backup kept).
        stale_after: temporaries of earlier swaps are removed when older than this many seconds;
            ``0`` removes all of them (one writer at a time). Several processes that may fill the
            same directory at once (a shared cache) give a positive value, and the one that
            finishes second keeps the first one's directory when it is complete.

    Returns:
        ``Path(directory)``.

    Raises:
        whatever ``write`` raises, or an ``OSError`` of the renames; the temporary directory is
        removed and the previous directory stays where it was.
    """
    target = Path(directory)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    backup = backup_of(target)
    now = time.time()
    for stale in parent.glob(f".{glob.escape(target.name)}.tmp-*"):
        try:
            if now - stale.stat().st_mtime >= stale_after:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:  # another process removed it first
            pass
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        write(tmp)
        fsync_dir(tmp)
        if target.exists():
            if is_complete(target) or not is_complete(backup):
                shutil.rmtree(backup, ignore_errors=True)
                os.rename(target, backup)
            else:
                # An incomplete <name> (not written here) beside a complete backup: keep the
                # backup, drop the debris.
                shutil.rmtree(target)
            fsync_dir(parent)
        # No <name> but a complete <name>.old: a swap was killed between the two renames; that
        # backup stays until the new directory is in place.
        try:
            os.rename(tmp, target)
        except OSError:
            if not (stale_after > 0 and is_complete(target)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process put an equal one in place first
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(backup, ignore_errors=True)
    for legacy in parent.glob(f"{glob.escape(target.name)}.old-*"):  # an older pyppo's backups
        shutil.rmtree(legacy, ignore_errors=True)
    fsync_dir(parent)
    return target
