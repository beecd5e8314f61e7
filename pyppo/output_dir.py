"""The check every command makes of its ``--output`` directory before it does any work, so that a
bad path costs a line, not a finished run."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_output_dir"]


def check_output_dir(output: Path, flag: str = "--output") -> None:
    """``output`` must be a directory or creatable as one.

    Raises:
        ValueError: it, or a parent of it, is an existing file; or it cannot be written (the
            message names ``flag``).
    """
    if output.exists() and not output.is_dir():
        raise ValueError(f"{flag} {str(output)!r} is an existing file, not a directory")
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {str(output)!r}: {str(parent)!r} is a file, not a directory")
            if not os.access(output if output.exists() else parent, os.W_OK | os.X_OK):
                raise ValueError(f"{flag} {str(output)!r}: no permission to write in "
                                 f"{str(output if output.exists() else parent)!r}")
            break
