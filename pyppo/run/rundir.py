"""The run directory: the one owner of its file names, of the check every command makes of
``--output`` before any work, and of what a restart or a resume does to the files already there.

A run directory holds :data:`OUTPUT_FILES`. Logs are JSON lines, one object per step (or per
sample) with its ``step``; a resumed run first drops the rows logged after the checkpoint it
resumes from (:meth:`RunDir.truncate_logs`), so that its logs are the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Iterable, List, Optional

from ..jsonl import json_line

__all__ = ["OUTPUT_FILES", "LOG_FILES", "RunDir", "check_output_dir", "truncate_log"]

#: Every file a run writes, and what it holds (``pyppo train`` lists them when it ends).
OUTPUT_FILES = {
    "config.toml": "resolved configuration",
    "metrics.jsonl": "per-step metrics",
    "samples.jsonl": "prompts, responses and scores",
    "curves.png": "score, KL and losses over steps",
    "eval_samples.jsonl": "held-out prompts' responses, scores and KL (with --eval-prompts)",
    "policy": "the trained policy as a Hugging Face model directory (from_pretrained, --model)",
    "checkpoint": "trained weights, optimizer, RNG and KL controller state (for --resume)",
    "prompts.jsonl": "the prompts of a run started from Python (its config.toml names them)",
    "eval_prompts.jsonl": "the held-out prompts of a run started from Python",
    "tensorboard": "TensorBoard's event files (with --report-to tensorboard)",
    "wandb": "W&B's offline run (with --report-to wandb; wandb sync uploads it)",
    "trackio": "Trackio's local store (with --report-to trackio)",
    "mlruns": "MLflow's file store (with --report-to mlflow)",
    "trackers.json": "each tracker's run id, which a resumed run continues",
}

#: The JSON-lines logs, each row with its ``step``.
LOG_FILES = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")


class RunDir:
    """A run directory's paths, and what it holds.

    Args:
        path: the directory (it need not exist yet).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.config = self.path / "config.toml"
        self.metrics = self.path / "metrics.jsonl"
        self.curves = self.path / "curves.png"
        self.checkpoint = self.path / "checkpoint"
        self.policy = self.path / "policy"

    def find_checkpoint(self) -> Optional[Path]:
        """The complete checkpoint in it (:func:`pyppo.run.checkpoint.find`), or ``None``."""
        # Imported here: every command imports this module, and `pyppo info` or `--help` must
        # start with torch alone (no numpy, which checkpoints need).
        from .checkpoint import find

        return find(self.checkpoint)

    def checkpoint_step(self) -> Optional[int]:
        """The step of its checkpoint; ``None`` without one."""
        from .checkpoint import saved_step

        found = self.find_checkpoint()
        return None if found is None else saved_step(found)

    def holds_a_run(self) -> bool:
        """Whether any file of a run is in it."""
        return self.path.is_dir() and any((self.path / name).exists() for name in OUTPUT_FILES)

    def existing_outputs(self) -> List[str]:
        """The names of :data:`OUTPUT_FILES` present, in that order."""
        return [name for name in OUTPUT_FILES if (self.path / name).exists()]

    def clear(self) -> None:
        """Remove what a run without a checkpoint left (logs, curves, debris of a first save)."""
        for name in (*LOG_FILES, "curves.png"):
            (self.path / name).unlink(missing_ok=True)
        for debris in [self.checkpoint, *self.path.glob(".checkpoint.tmp-*")]:
            shutil.rmtree(debris, ignore_errors=True)

    def truncate_logs(self, last_step: int) -> None:
        """Drop every log's rows after ``last_step`` (:func:`truncate_log`)."""
        for name in LOG_FILES:
            truncate_log(self.path / name, last_step)

    def append(self, name: str, rows: Iterable[dict]) -> None:
        """Append ``rows`` to the log ``name`` (one of :data:`LOG_FILES`), one strict JSON object a
        line: a NaN or infinite value (e.g. the losses of a step whose updates were all skipped) is
        written ``null`` (:func:`pyppo.jsonl.json_line`)."""
        rows = list(rows)
        if rows:
            with open(self.path / name, "a") as f:
                f.writelines(json_line(row) for row in rows)


def check_output_dir(output: Path, flag: str = "--output") -> None:
    """``output`` must be a directory or creatable as one, and writable.

    Writability is tried, not inferred from the mode bits: a directory is created in, and removed
    from, ``output`` (or the nearest existing parent it will be created under), because
    ``os.access`` says yes to root on a directory of mode 0555 and to anyone on a directory that
    refuses writes for another reason (``/proc``, an NFS export mapping root to nobody).

    Raises:
        ValueError: it, or a parent of it, is an existing file; or nothing can be created in it
            (or in that parent); the message names ``flag`` and the reason (``Permission
            denied``, ``Read-only file system``).
    """
    if output.exists() and not output.is_dir():
        raise ValueError(f"{flag} {str(output)!r} is an existing file, not a directory")
    # `Path(".").parents` is empty: the current directory is checked as `output` itself.
    existing = next((d for d in (output, *output.parents) if d.exists()), None)
    if existing is None:
        return  # not even the current directory exists: the write will say why
    if not existing.is_dir():
        raise ValueError(f"{flag} {str(output)!r}: {str(existing)!r} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".pyppo-write-check-", dir=existing))
    except OSError as exc:
        raise ValueError(
            f"{flag} {str(output)!r}: cannot write in {str(existing.resolve())!r} ({exc.strerror or exc})"
        ) from None


def truncate_log(path: Path, last_step: int) -> None:
    """Drop the rows of a JSON-lines log whose ``step`` is after ``last_step``, and a torn last line.

    A run killed after logging a step but before checkpointing it logged steps that the resumed
    run takes again. Rewritten atomically; untouched when there is nothing to drop.
    """
    if not path.is_file():
        return
    keep: List[str] = []
    dropped = 0
    with open(path, "r") as f:
        for line in f:
            try:
                ok = line.endswith("\n") and float(json.loads(line)["step"]) <= last_step
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok:
                keep.append(line)
            else:
                dropped += 1
    if not dropped:
        return
    warnings.warn(
        f"{path}: dropped {dropped} line(s) logged after step {last_step} (the checkpoint's) or torn",
        RuntimeWarning,
        stacklevel=3,
    )
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
