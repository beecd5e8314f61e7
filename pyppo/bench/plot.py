"""The PNG ``pyppo bench`` writes beside its JSON: time against V and T, log-log, one panel per sweep."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot"]

_STYLES = {"pyppo": ("C0", "o"), "eager": ("C3", "s"), "floor": ("0.5", "^")}


def _panel(ax, name: str, sweeps: list[dict]) -> None:
    for s in sweeps:
        xs = [p["value"] for p in s["points"]]
        ls = "-" if s["device"] == "cpu" else "--"
        for var, (color, marker) in _STYLES.items():
            label = f"{var} ({s['device']})" + (f": {s['eager']}" if var == "eager" else "")
            ax.plot(xs, [p[f"{var}_ms"] for p in s["points"]], ls, color=color, marker=marker, label=label)
    shape = sweeps[0]["points"][0]["shape"]
    fixed = "x".join("·" if i == len(shape) - 1 else str(d) for i, d in enumerate(shape))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(sweeps[0]["axis"])
    ax.set_ylabel("ms (median)")
    ax.set_title(f"{name}  [{fixed}]", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot(result: dict, path: Path) -> Path | None:
    """Write the sweeps of ``result`` to ``path``; ``None`` (and no file) when it has none."""
    sweeps = result.get("sweeps") or []
    if not sweeps:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(s["name"] for s in sweeps))
    ncols = 2
    nrows = (len(names) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.2 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        _panel(ax, name, [s for s in sweeps if s["name"] == name])
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    env = result["env"]
    fig.suptitle(
        f"pyppo bench ({result['sizes']}): {', '.join(env['devices'])}, {env['torch_threads']} threads, "
        f"{env['cpu_capability']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
