"""Training curves (``curves.png``) from a run's ``metrics.jsonl``."""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..jsonl import read_objects

__all__ = ["PANELS", "plot_metrics", "read_metrics"]

#: One panel per entry: (title, metric keys drawn on it).
PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("score", ("score_mean", "reward_mean", "eval/score_mean")),
    ("KL to reference", ("kl_mean", "eval/kl_mean")),
    ("policy loss", ("policy_loss",)),
    ("value loss", ("value_loss",)),
]


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The objects of a ``metrics.jsonl`` file, one per step, in order.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not a JSON object (the message gives ``path:line``).
    """
    return [row for _, row in read_objects(path)]


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, row in enumerate(rows):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            # Steps are 1-based in the plot when the trainer does not log its own step counter.
            xs.append(row.get("step", i + 1))
            ys.append(float(value))
    return xs, ys


def plot_metrics(metrics_path: str | os.PathLike, out_path: str | os.PathLike) -> Path:
    """Draw score, KL, policy loss and value loss over steps into ``out_path`` (PNG); the
    held-out evaluation (``eval/*``, logged every ``eval_every`` steps) beside the training score and KL.

    A key the trainer did not log leaves its panel empty with a note rather than failing, so the
    plot still comes out for a run with a different metric set.

    Returns:
        ``out_path`` as a ``Path``.
    """
    import matplotlib

    # Agg: no display is needed (servers, CI) and no GUI backend gets imported.
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        drawn = False
        for key in keys:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
                drawn = True
        if drawn:
            if len(keys) > 1:
                ax.legend(fontsize=8)
        else:
            ax.text(
                0.5,
                0.5,
                f"no {', '.join(keys)} in metrics",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=9,
                color="gray",
            )
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    fig.suptitle(f"{Path(metrics_path).parent.name or 'run'}: {len(rows)} steps")
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
