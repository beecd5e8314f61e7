"""JSON Lines files: reading them (prompt sets, ``metrics.jsonl``) with errors that name
``path:line``, and writing a run's logs as strict JSON (RFC 8259, which has no NaN or infinity)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

__all__ = ["json_line", "read_objects"]


def read_objects(path: str | os.PathLike, *, expected: str = "a JSON object") -> Iterator[tuple[str, dict]]:
    """``(where, object)`` for each non-blank line of ``path``; ``where`` is ``"path:line"``.

    Lines are decoded as UTF-8 one by one (a byte-order mark before the first is skipped), so
    that a byte that is not UTF-8 is reported at its line rather than as the codec's bare
    position in the file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not UTF-8, not valid JSON, or not an object (the message says
            ``expected``).
    """
    path = Path(path)
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{where}: not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the "
                    "line); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg}); expected {expected}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected {expected}, got {type(obj).__name__}")
            yield where, obj


def _strict(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def json_line(obj: dict) -> str:
    """``obj`` as one line of strict JSON, ending in ``"\\n"``: NaN and ±infinity become ``null``
    (Python's ``json`` would write the bare ``NaN`` / ``Infinity`` that other parsers refuse),
    in nested lists and dicts too.

    Raises:
        TypeError: a value JSON cannot hold (as ``json.dumps``).
    """
    return json.dumps(_strict(obj), allow_nan=False) + "\n"
