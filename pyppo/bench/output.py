"""Where ``pyppo bench`` writes: ``bench-YYYYMMDD-HHMMSS.json`` and ``.png`` in the directory the
user names (the current one by default), never inside the installed package."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .plot import plot

__all__ = ["write_outputs"]


def _dated_path(output_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = output_dir / f"bench-{stamp}.json"
    n = 1
    while path.exists():  # two runs in the same second
        path = output_dir / f"bench-{stamp}-{n}.json"
        n += 1
    return path


def write_outputs(result: dict, output_dir: Path, json_path: Path | None = None) -> tuple[Path, Path | None]:
    """Write the JSON (to ``json_path`` when given, else a dated name in ``output_dir``) and the
    plot beside it; returns both paths (the plot's ``None`` when there were no sweeps)."""
    json_path = json_path if json_path is not None else _dated_path(output_dir)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return json_path, plot(result, json_path.with_suffix(".png"))
