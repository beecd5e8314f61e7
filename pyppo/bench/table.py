"""The text table ``pyppo bench`` prints: a header naming the machine, one section per suite,
and the targets."""

from __future__ import annotations

__all__ = ["format_table", "fmt_bytes"]

COLUMNS = (
    "op",
    "shape",
    "dtype",
    "device",
    "pyppo ms",
    "eager ms",
    "speed-up",
    "x floor",
    "pyppo extra",
    "eager extra",
    "eager",
)
BANDWIDTH_COLUMNS = ("GB/s", "% floor bw")
MEMORY_COLUMNS = ("extra ratio",)  # the memory suite's point: pyppo's peak against eager's
_LEFT = {"op", "shape", "dtype", "device", "eager"}


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _header(result: dict) -> list[str]:
    env = result["env"]
    lines = [
        f"pyppo bench ({', '.join(result['suites'])}; {result['sizes']})  pyppo {env['pyppo']}  torch {env['torch']}",
        f"device: {', '.join(env['devices'])}  cpu: {env['cpu']} ({env['cpu_count']} logical cores)"
        + (
            f"  cuda: {env['cuda_device']} (sm_{env['cuda_sm']}, pyppo archs {env['pyppo_cuda_archs']})"
            if env.get("cuda_device")
            else ""
        ),
        f"threads: torch {env['torch_threads']}, pyppo {env['pyppo_threads']}  "
        f"cpu kernel ISA: {env['cpu_capability']} (torch: {env['torch_cpu_capability']})  "
        f"peak memory: {env['memory_method']}"
        + (f"  load avg: {', '.join(f'{x:.2f}' for x in env['load_average'])}" if env.get("load_average") else ""),
    ]
    cores = env.get("cpu_count") or 1
    before = (env.get("load_average") or [0.0])[0]
    after = (env.get("load_average_after") or [0.0])[0]  # includes this run's own threads
    if before > 0.75 * cores or after > cores + 0.75:
        lines.append(
            f"WARNING: load average {max(before, after):.1f} on {cores} cores: other processes compete "
            "for the CPU, so timings are noisy and multi-threaded calls can wait for their worker threads "
            "to be scheduled"
        )
    return lines


def _gbps(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.2g}"


def _cells(r: dict, bandwidth: bool, memory: bool) -> dict[str, str]:
    def mem(name):
        b = r.get(f"{name}_extra_bytes")
        return "-" if b is None else f"{fmt_bytes(b)} ({r[f'{name}_extra_pct']:.1f}%)"

    cells = {
        "op": r["label"],
        "shape": r["shape_str"],
        "dtype": r["dtype"],
        "device": r["device"],
        "pyppo ms": f"{r['pyppo_ms']:.3f}",
        "eager ms": f"{r['eager_ms']:.3f}",
        "speed-up": f"{r['speedup']:.1f}x",
        "x floor": f"{r['floor_ratio']:.2f}",
        "pyppo extra": mem("pyppo"),
        "eager extra": mem("eager"),
        "eager": r["eager"] + ("" if r.get("agree", True) else "  MISMATCH"),
    }
    if bandwidth:
        cells["GB/s"] = _gbps(r["pyppo_gbps"]) if "pyppo_gbps" in r else "-"
        cells["% floor bw"] = f"{r['bandwidth_pct']:.1f}" if "bandwidth_pct" in r else "-"
    if memory:
        cells["extra ratio"] = f"{r['memory_ratio']:.3f}" if "memory_ratio" in r else "-"
    return cells


def _section(rows: list[dict], memory: bool) -> list[str]:
    bandwidth = any("pyppo_gbps" in r for r in rows)
    columns = (
        COLUMNS[:8]
        + (BANDWIDTH_COLUMNS if bandwidth else ())
        + COLUMNS[8:10]
        + (MEMORY_COLUMNS if memory else ())
        + COLUMNS[10:]
    )
    return _grid(columns, [_cells(r, bandwidth, memory) for r in rows], _LEFT)


def _grid(columns: tuple[str, ...], cells: list[dict[str, str]], left: set[str]) -> list[str]:
    """The header, a rule and a line per row of ``cells``, each column as wide as its widest
    cell: the ``left`` columns left-aligned, the others right-aligned."""
    widths = {c: max([len(c)] + [len(row[c]) for row in cells]) for c in columns}

    def fmt(values: dict[str, str]) -> str:
        return "  ".join(
            values[c].ljust(widths[c]) if c in left else values[c].rjust(widths[c]) for c in columns
        ).rstrip()

    return [fmt({c: c for c in columns}), fmt({c: "-" * widths[c] for c in columns})] + [fmt(row) for row in cells]


def _targets(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        for t in r.get("targets", []):
            goal = (
                ""
                if t["goal"] is None
                else f" (goal {t['cmp']} {t['goal']:g}: {'met' if t['goal_met'] else 'not met'})"
            )
            lines.append(
                f"  [{'PASS' if t['met'] else 'MISS'}] {t['name']} [{r['suite']}, {r['dtype']}, "
                f"{r['device']}]: {t['value']:.2f} {t['cmp']} {t['bound']:g}{goal}"
            )
    return ["", "targets:"] + lines if lines else []


def format_table(result: dict) -> str:
    lines = _header(result)
    for name in result["suites"]:
        rows = [r for r in result["rows"] if r["suite"] == name]
        lines += ["", f"suite {name}:"] + (_section(rows, name == "memory") if rows else ["  (no cases ran)"])
    lines += [
        "",
        "speed-up = eager / pyppo, x floor = pyppo / floor (medians of back-to-back ratios); "
        "extra = peak memory beyond the inputs (% of the inputs' bytes)"
        + (", extra ratio = pyppo's / eager's" if "memory" in result["suites"] else ""),
    ]
    if any("pyppo_gbps" in r for r in result["rows"]):
        lines.append(
            "GB/s = the bytes the op must move / its median time; % floor bw = that against the "
            "floor's bandwidth, round by round"
        )
    lines += _targets(result["rows"])
    return "\n".join(lines)
