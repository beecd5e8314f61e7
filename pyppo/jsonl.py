"""Reading JSON Lines files (prompt sets, ``metrics.jsonl``) with errors that name ``path:line``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

__all__ = ["read_objects"]


def read_objects(path: str | os.PathLike, *, expected: str = "a JSON object") -> Iterator[tuple[str, dict]]:
    """``(where, object)`` for each non-blank line of ``path``; ``where`` is ``"path:line"``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not valid JSON or not an object (the message says ``expected``).
    """
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg}); expected {expected}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected {expected}, got {type(obj).__name__}")
            yield where, obj
