"""Time pyppo's ops against the eager PyTorch users write today and against the memory floor.

For each case (``benchmarks/cases.py``) three callables run on the same inputs, interleaved in one
process (round-robin, order rotated each round, so machine noise hits all three alike):

* **pyppo**: the compiled op;
* **eager**: the eager PyTorch a user of TRL / OpenRLHF / veRL writes today
  (``benchmarks/eager/``, one module per op, mirroring the peers' formulas);
* **floor**: a single read of the same inputs (``logits.amax(-1)`` for ``gather_logprobs``, a sum
  over each ``[B, T]`` input for the small ops; forward+backward reads twice and writes the
  gradient once): the memory-bandwidth floor no implementation can beat by much.

Each callable runs once not counted (warm-up; it sizes the number of rounds), then repeatedly; the table reports medians. "speed-up"
is the median over rounds of eager/pyppo timed back to back (robust to a machine whose load
drifts), "x floor" the median of pyppo/floor likewise. Before timing, pyppo's outputs are checked
against the eager reference (max abs difference over ``max(1, max |eager|)``); a disagreement is
printed and makes the command exit with status 1 (this doubles as a check of the references).

**Peak extra memory**: bytes a call needs beyond its inputs while it runs, outputs included
(the % is of the inputs' bytes: the logits for ``gather_logprobs``). Measured on one extra call
after the timings, two ways on CPU (``--memory both``, the default on Linux; the table shows the
larger, the JSON both; the eager baselines, whose peaks are whole ``[*, V]`` temporaries, get
``rss`` only, which saves a profiled call of the slowest variant):

* ``rss``: growth of the process's resident-set high-water mark. Freed heap is handed back to
  the OS (``malloc_trim(0)``), the mark is reset (``/proc/self/clear_refs`` <- 5), the call runs,
  and ``VmHWM - VmRSS(before)`` is read. Counts every page the call touches: tensors, a kernel's
  private scratch, allocations on worker threads; page granular, so allocations of a few KiB
  that fit in already-resident heap pages are missed, and ~1 MiB of noise is possible.
* ``alloc``: the peak of the running sum of allocations minus frees through torch's CPU
  allocator during the call, from ``torch.profiler(profile_memory=True)``. Exact for tensors,
  blind to memory a kernel gets from ``malloc``/``new`` directly.

On CUDA it is ``torch.cuda.max_memory_allocated()`` growth after ``reset_peak_memory_stats()``.

Output: a table on stdout, and ``bench-YYYYMMDD-HHMMSS.json`` / ``.png`` (time against V and T,
log scales) in ``--output`` (default ``benchmarks/results/`` in a source tree, else the current
directory). The header names the device, torch's thread count and the CPU kernel ISA
(``pyppo._C.cpu_capability()``). On a CUDA machine (pyppo built with CUDA), every case also runs
on CUDA (``torch.cuda.synchronize()`` around each timing).

Interface used by ``pyppo.cli``: :func:`add_arguments` (parser) and :func:`run` (args) -> int;
:func:`main` (argv) -> int for ``python -m pyppo.bench``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import gc
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["add_arguments", "run", "main", "load_benchmarks", "run_bench", "format_table", "default_output_dir"]

_REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# finding the benchmarks package


def _source_tree_benchmarks() -> Path | None:
    pkg = _REPO_ROOT / "benchmarks"
    if (_REPO_ROOT / "pyproject.toml").is_file() and (pkg / "cases.py").is_file() and (pkg / "__init__.py").is_file():
        return pkg
    return None


def load_benchmarks():
    """The benchmarks package: ``pyppo.benchmarks`` when installed inside the wheel, else
    ``<source tree>/benchmarks`` loaded under that same name (so it never clashes with an
    unrelated top-level ``benchmarks`` package). Returns the ``cases`` module."""
    name = "pyppo.benchmarks"
    if name not in sys.modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pkg = _source_tree_benchmarks()
            if pkg is None:
                raise ImportError(
                    "pyppo bench: the benchmark cases were not found (neither pyppo.benchmarks "
                    "nor a source tree's benchmarks/ directory)"
                ) from None
            spec = importlib.util.spec_from_file_location(
                name, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
            )
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    return importlib.import_module(name + ".cases")


def default_output_dir() -> Path:
    """``benchmarks/results/`` when pyppo runs from a source tree that has ``benchmarks/``,
    else the current directory."""
    pkg = _source_tree_benchmarks()
    return pkg / "results" if pkg is not None else Path.cwd()


# ---------------------------------------------------------------------------------------------
# environment


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(devices: list[torch.device]) -> dict:
    import pyppo
    from pyppo import _C

    env = {
        "pyppo": getattr(pyppo, "__version__", "unknown"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "pyppo_threads": int(_C.num_threads()) if hasattr(_C, "num_threads") else None,
        "cpu_capability": _C.cpu_capability() if hasattr(_C, "cpu_capability") else None,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "pyppo_cuda": bool(getattr(_C, "with_cuda", False)),
        "devices": [str(d) for d in devices],
    }
    if any(d.type == "cuda" for d in devices):
        env["cuda_device"] = torch.cuda.get_device_name(0)
        env["cuda_version"] = torch.version.cuda
    try:
        env["load_average"] = list(os.getloadavg())
    except OSError:  # pragma: no cover
        pass
    return env


# ---------------------------------------------------------------------------------------------
# timing


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _time_once(fn, inp, sync) -> float:
    sync()
    t0 = time.perf_counter()
    out = fn(inp)
    sync()
    dt = time.perf_counter() - t0
    del out
    return dt


def measure(variants: dict[str, Callable], inp, sync, *, warmup: int, min_reps: int, max_reps: int,
            budget_s: float) -> dict[str, list[float]]:
    """Seconds per call of each variant: ``warmup`` untimed calls each, then rounds in which
    every variant runs once (order rotated each round), as many rounds as fit ``budget_s``
    (within ``[min_reps, max_reps]``)."""
    names = list(variants)
    est = {}
    for name in names:
        for _ in range(max(1, warmup)):
            est[name] = _time_once(variants[name], inp, sync)
    per_round = max(sum(est.values()), 1e-9)
    reps = int(min(max_reps, max(min_reps, budget_s / per_round)))
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(_time_once(variants[name], inp, sync))
    return times


def _paired_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den) if b > 0)


# ---------------------------------------------------------------------------------------------
# memory


def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _rss_available() -> bool:
    try:
        _proc_status_kb("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except (OSError, KeyError):
        return False


_LIBC = None


def _malloc_trim() -> None:
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


class _QuietStderr:
    """Silence file descriptor 2 (kineto prints profiler_start/stop lines there)."""

    def __enter__(self):
        try:
            sys.stderr.flush()
            self._saved = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        except OSError:  # pragma: no cover
            self._saved = None
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            os.dup2(self._saved, 2)
            os.close(self._saved)
        return False


def _peak_rss(fn, inp) -> int:
    _malloc_trim()
    base = _proc_status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = fn(inp)
    hwm = _proc_status_kb("VmHWM")
    del out
    return max(0, hwm - base) * 1024


def _peak_alloc(fn, inp) -> int:
    from torch.profiler import ProfilerActivity, profile

    with _QuietStderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(inp)
        del out
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    )
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return int(peak)


def peak_extra_bytes(fn, inp, device: torch.device, method: str) -> dict[str, int]:
    """Peak bytes ``fn(inp)`` needs beyond what is allocated before it (see the module doc),
    as ``{method: bytes}`` for each method used (``"both"``: rss and alloc)."""
    if method == "off":
        return {}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(inp)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return {"cuda": int(peak)}
    out: dict[str, int] = {}
    if method in ("rss", "both"):
        out["rss"] = _peak_rss(fn, inp)
    if method in ("alloc", "both"):
        gc.collect()
        out["alloc"] = _peak_alloc(fn, inp)
    if not out:
        raise ValueError(f"unknown memory method {method!r}")
    return out


# ---------------------------------------------------------------------------------------------
# numerical check


def _flat_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def max_error(a, b) -> float:
    """max |a - b| / max(1, max |b|) over corresponding output tensors (NaN counts as inf)."""
    worst = 0.0
    ta, tb = _flat_outputs(a), _flat_outputs(b)
    if len(ta) != len(tb):
        return float("inf")
    for x, y in zip(ta, tb):
        if x.shape != y.shape:
            return float("inf")
        x, y = x.detach().double().cpu(), y.detach().double().cpu()
        if x.numel() == 0:
            continue
        diff = (x - y).abs()
        if not bool(torch.isfinite(diff).all()):
            return float("inf")
        worst = max(worst, float(diff.max()) / max(1.0, float(y.abs().max())))
    return worst


# ---------------------------------------------------------------------------------------------
# the run


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


_INPUT_CACHE: dict = {}


def _inputs(case, device: torch.device, seed: int):
    """The case's inputs; the last set is reused by the next case with the same maker, shape,
    dtype and device (drawing 100M random logits takes about a second)."""
    key = (case.make_inputs, case.shape, case.dtype, str(device), seed)
    if key not in _INPUT_CACHE:
        _INPUT_CACHE.clear()
        gc.collect()
        _INPUT_CACHE[key] = case.make_inputs(case.shape, case.dtype, device, seed)
    return _INPUT_CACHE[key]


def run_case(case, device: torch.device, *, seed: int, warmup: int, min_reps: int, max_reps: int,
             budget_s: float, memory: str, check: bool = True, log=None) -> dict:
    inp = _inputs(case, device, seed)
    sync = _sync_for(device)
    row: dict[str, Any] = {
        "op": case.op, "label": case.label, "eager": case.eager_name, "floor": case.floor_name,
        "shape": list(case.shape), "shape_str": case.shape_str, "dtype": case.dtype_str,
        "device": str(device), "input_bytes": int(case.input_bytes(inp)),
    }
    if check:
        ref_fn = case.compare_eager or case.eager
        err = max_error(case.pyppo(inp), ref_fn(inp))
        row.update(max_error=err, tol=case.tol, agree=bool(err <= case.tol))
    times = measure({"pyppo": case.pyppo, "eager": case.eager, "floor": case.floor}, inp, sync,
                    warmup=warmup, min_reps=min_reps, max_reps=max_reps, budget_s=budget_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    row.update(
        pyppo_ms=med["pyppo"] * 1e3, eager_ms=med["eager"] * 1e3, floor_ms=med["floor"] * 1e3,
        speedup=_paired_ratio(times["eager"], times["pyppo"]),
        floor_ratio=_paired_ratio(times["pyppo"], times["floor"]),
        eager_floor_ratio=_paired_ratio(times["eager"], times["floor"]),
        reps=len(times["pyppo"]),
        times_ms={k: [t * 1e3 for t in v] for k, v in times.items()},
    )
    if memory != "off":
        for name, fn in (("pyppo", case.pyppo), ("eager", case.eager)):
            # The eager baselines' peaks are whole [*, V] temporaries: the rss mark alone is
            # exact enough there, and saves a profiled call of the slowest variant.
            method = "rss" if memory == "both" and name == "eager" else memory
            by_method = peak_extra_bytes(fn, inp, device, method)
            extra = max(by_method.values())
            row[f"{name}_extra_bytes"] = extra
            row[f"{name}_extra_by_method"] = by_method
            row[f"{name}_extra_pct"] = 100.0 * extra / max(1, row["input_bytes"])
    targets = []
    for t in case.targets:
        value = row.get(t.metric)
        if value is None:
            continue
        targets.append({"name": t.name, "metric": t.metric, "value": value, "cmp": t.cmp, "bound": t.bound,
                        "goal": t.goal, "met": t.met(value), "goal_met": t.goal_met(value)})
    row["targets"] = targets
    del inp
    if log is not None:
        log(row)
    return row


def run_bench(*, sizes: str = "quick", devices: list[torch.device] | None = None, ops: list[str] | None = None,
              memory: str = "auto", seed: int = 0, sweeps: bool = True, budget_s: float | None = None,
              verbose: bool = True) -> dict:
    """Run a suite; returns the result dict written as JSON (``rows``, ``sweeps``, ``env``)."""
    cases_mod = load_benchmarks()
    cases, sweep_list = cases_mod.suite(sizes)
    if ops:
        cases = [c for c in cases if c.op in ops]
        sweep_list = [s for s in sweep_list if s.cases and s.cases[0].op in ops]
    if devices is None:
        devices = default_devices()
    if memory == "auto":
        memory = "both" if _rss_available() else "alloc"
    # Timing settings per suite: warm-up calls, rounds, seconds per case.
    cfg = {"full": (2, 5, 50, 6.0), "quick": (1, 3, 20, 1.5), "tiny": (1, 2, 3, 0.05)}[sizes]
    warmup, min_reps, max_reps, budget = cfg
    if budget_s is not None:
        budget = budget_s
    env = environment(devices)
    env["memory_method"] = memory
    result: dict[str, Any] = {"created": _dt.datetime.now().isoformat(timespec="seconds"), "sizes": sizes,
                              "env": env, "rows": [], "sweeps": []}

    def log(row):
        if verbose:
            print(f"  {row['label']:<28} {row['shape_str']:<14} {row['dtype']:<9} {row['device']:<5} "
                  f"pyppo {row['pyppo_ms']:9.3f} ms  eager {row['eager_ms']:9.3f} ms  "
                  f"x{row['speedup']:.1f}", file=sys.stderr, flush=True)

    for device in devices:
        for case in cases:
            result["rows"].append(run_case(case, device, seed=seed, warmup=warmup, min_reps=min_reps,
                                           max_reps=max_reps, budget_s=budget, memory=memory, log=log))
        if not sweeps:
            continue
        for sweep in sweep_list:
            points = []
            for value, case in zip(sweep.values, sweep.cases):
                row = run_case(case, device, seed=seed, warmup=warmup, min_reps=min_reps, max_reps=max_reps,
                               budget_s=budget / 2, memory="off", check=False)
                _INPUT_CACHE.clear()
                points.append({"value": value, "shape": row["shape"], "pyppo_ms": row["pyppo_ms"],
                               "eager_ms": row["eager_ms"], "floor_ms": row["floor_ms"],
                               "speedup": row["speedup"], "floor_ratio": row["floor_ratio"]})
            result["sweeps"].append({"name": sweep.name, "axis": sweep.axis, "device": str(device),
                                     "eager": sweep.cases[0].eager_name, "points": points})
    _INPUT_CACHE.clear()
    try:
        env["load_average_after"] = list(os.getloadavg())
    except OSError:  # pragma: no cover
        pass
    return result


def default_devices() -> list[torch.device]:
    from pyppo import _C

    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and getattr(_C, "with_cuda", False):
        devices.append(torch.device("cuda"))
    return devices


# ---------------------------------------------------------------------------------------------
# output


COLUMNS = ("op", "shape", "dtype", "device", "pyppo ms", "eager ms", "speed-up", "x floor",
           "pyppo extra", "eager extra", "eager")


def format_table(result: dict) -> str:
    env = result["env"]
    lines = [
        f"pyppo bench ({result['sizes']})  pyppo {env['pyppo']}  torch {env['torch']}",
        f"device: {', '.join(env['devices'])}  cpu: {env['cpu']} ({env['cpu_count']} logical cores)"
        + (f"  cuda: {env['cuda_device']}" if env.get("cuda_device") else ""),
        f"threads: torch {env['torch_threads']}, pyppo {env['pyppo_threads']}  "
        f"cpu kernel ISA: {env['cpu_capability']} (torch: {env['torch_cpu_capability']})  "
        f"peak memory: {env['memory_method']}"
        + (f"  load avg: {', '.join(f'{x:.2f}' for x in env['load_average'])}" if env.get("load_average") else ""),
    ]
    cores = env.get("cpu_count") or 1
    before = (env.get("load_average") or [0.0])[0]
    after = (env.get("load_average_after") or [0.0])[0]  # includes this run's own threads
    load = max(before, after)
    if before > 0.75 * cores or after > cores + 0.75:
        lines.append(f"WARNING: load average {load:.1f} on {cores} cores: other processes compete for the CPU, so "
                     "timings are noisy and multi-threaded calls can wait for their worker threads to be scheduled")
    lines.append("")
    rows = []
    for r in result["rows"]:
        def mem(name):
            b = r.get(f"{name}_extra_bytes")
            return "-" if b is None else f"{_fmt_bytes(b)} ({r[f'{name}_extra_pct']:.1f}%)"
        flag = "" if r.get("agree", True) else "  MISMATCH"
        rows.append((r["label"], r["shape_str"], r["dtype"], r["device"], f"{r['pyppo_ms']:.3f}",
                     f"{r['eager_ms']:.3f}", f"{r['speedup']:.1f}x", f"{r['floor_ratio']:.2f}",
                     mem("pyppo"), mem("eager"), r["eager"] + flag))
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    right = {4, 5, 6, 7, 8, 9}

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines.append(fmt(COLUMNS))
    lines.append(fmt(["-" * w for w in widths]))
    lines.extend(fmt(row) for row in rows)
    lines.append("")
    lines.append("speed-up = eager / pyppo, x floor = pyppo / floor (medians of back-to-back ratios); "
                 "extra = peak memory beyond the inputs (% of the inputs' bytes)")
    targets = [(r, t) for r in result["rows"] for t in r.get("targets", [])]
    if targets:
        lines.append("")
        lines.append("issue-3 targets:")
        for r, t in targets:
            goal = "" if t["goal"] is None else f" (goal {t['cmp']} {t['goal']:g}: {'met' if t['goal_met'] else 'not met'})"
            lines.append(f"  [{'PASS' if t['met'] else 'MISS'}] {t['name']} [{r['dtype']}, {r['device']}]: "
                         f"{t['value']:.2f} {t['cmp']} {t['bound']:g}{goal}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    """Time against V (gather_logprobs) and T (the [B, T] ops), log-log; one panel per sweep."""
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
    styles = {"pyppo": ("C0", "o"), "eager": ("C3", "s"), "floor": ("0.5", "^")}
    for ax, name in zip(axes.flat, names):
        for s in (s for s in sweeps if s["name"] == name):
            xs = [p["value"] for p in s["points"]]
            ls = "-" if s["device"] == "cpu" else "--"
            for var, (color, marker) in styles.items():
                label = f"{var} ({s['device']})" + (f": {s['eager']}" if var == "eager" else "")
                ax.plot(xs, [p[f"{var}_ms"] for p in s["points"]], ls, color=color, marker=marker, label=label)
            shape = s["points"][0]["shape"]
            fixed = "x".join("·" if i == (len(shape) - 1) else str(d) for i, d in enumerate(shape))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(s["axis"])
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{name}  [{fixed}]", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    env = result["env"]
    fig.suptitle(f"pyppo bench ({result['sizes']}): {', '.join(env['devices'])}, {env['torch_threads']} threads, "
                 f"{env['cpu_capability']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(result: dict, output_dir: Path) -> tuple[Path, Path | None]:
    output_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = output_dir / f"bench-{stamp}.json"
    n = 1
    while json_path.exists():  # two runs in the same second
        json_path = output_dir / f"bench-{stamp}-{n}.json"
        n += 1
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    png_path = plot(result, json_path.with_suffix(".png"))
    return json_path, png_path


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``pyppo bench`` options to ``parser``."""
    parser.add_argument("--quick", action="store_true",
                        help="about a minute: the issue's target shapes with few repeats, short sweeps (= --sizes quick)")
    parser.add_argument("--sizes", choices=("full", "quick", "tiny"), default=None,
                        help="suite: full (default; several minutes), quick, tiny (seconds, for tests)")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="where bench-YYYYMMDD-HHMMSS.json/.png go (default: benchmarks/results/ in a "
                             "source tree, else the current directory)")
    parser.add_argument("--ops", metavar="OP[,OP...]", default=None,
                        help="only these ops (gather_logprobs, kl_penalty, shape_rewards, gae, masked_whiten)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto (default): CPU, plus CUDA when available and pyppo was built with it")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first (default: torch's)")
    parser.add_argument("--memory", choices=("auto", "both", "rss", "alloc", "off"), default="auto",
                        help="peak-memory method: rss (resident high-water mark), alloc (torch allocator "
                             "profiling), both (the larger; auto on Linux), or off")
    parser.add_argument("--no-sweeps", action="store_true", help="skip the V / T sweeps (and the PNG)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--check-targets", action="store_true",
                        help="exit with status 3 when an issue-3 target is missed")


def run(args: argparse.Namespace) -> int:
    """Run ``pyppo bench`` with parsed ``args``; returns the exit status (1: a pyppo op disagreed
    with its eager reference; 3: ``--check-targets`` and a target was missed)."""
    sizes = args.sizes or ("quick" if args.quick else "full")
    if args.quick and args.sizes not in (None, "quick"):
        raise ValueError("--quick and --sizes disagree")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        devices = default_devices()
    elif args.device == "cuda":
        from pyppo import _C

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        if not getattr(_C, "with_cuda", False):
            raise ValueError("--device cuda: pyppo was built without CUDA")
        devices = [torch.device("cuda")]
    else:
        devices = [torch.device("cpu")]
    ops = None
    if args.ops:
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        known = {"gather_logprobs", "kl_penalty", "shape_rewards", "gae", "masked_whiten"}
        unknown = sorted(set(ops) - known)
        if unknown:
            raise ValueError(f"--ops: unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if args.memory in ("rss", "both") and not _rss_available():
        raise ValueError("--memory rss needs Linux /proc/self/clear_refs; use --memory alloc")
    result = run_bench(sizes=sizes, devices=devices, ops=ops, memory=args.memory, seed=args.seed,
                       sweeps=not args.no_sweeps)
    output_dir = Path(args.output).expanduser() if args.output else default_output_dir()
    json_path, png_path = write_outputs(result, output_dir)
    print(format_table(result))
    print()
    print(f"wrote {json_path}" + (f" and {png_path.name}" if png_path else ""))
    status = 0
    bad = [r for r in result["rows"] if not r.get("agree", True)]
    if bad:
        for r in bad:
            print(f"pyppo bench: {r['label']} {r['shape_str']} {r['dtype']} {r['device']}: pyppo disagrees "
                  f"with {r['eager']} (error {r['max_error']:.3g} > {r['tol']:g})", file=sys.stderr)
        status = 1
    if args.check_targets and status == 0:
        if any(not t["met"] for r in result["rows"] for t in r.get("targets", [])):
            status = 3
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pyppo bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
