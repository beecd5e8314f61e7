"""Runs suites: for each case and device, checks pyppo against the eager reference, times
pyppo, eager and the floor interleaved, measures peak memory, and evaluates the case's targets.
The result is the dict ``pyppo bench`` writes as JSON."""

from __future__ import annotations

import datetime as _dt
import gc
import math
import statistics
import sys
from dataclasses import asdict
from typing import Any

import torch

from .case import Case, Inputs, RowLabels
from .check import max_error
from .environment import cache_bytes, environment, load_average
from .memory import peak_extra_bytes, rss_available
from .suites import Suite, Timing
from .timing import clock_for, measure, paired_ratio

__all__ = ["run_case", "run_suites", "resolve_memory_method"]

#: Input sets rotated through while timing when one set fits in the cache (see pyppo.bench.timing).
MAX_INPUT_SETS = 64

_INPUT_CACHE: dict[tuple, list[Inputs]] = {}


def _input_sets(case: Case, device: torch.device, seed: int) -> list[Inputs]:
    """The case's input sets: the first drawn with ``seed``, more (``seed + i``) until they span
    twice the cache in front of the device. The last cases' sets are reused by the next case with
    the same maker, shape, dtype and device: drawing 100M random logits takes about a second."""
    key = (case.make_inputs, case.shape, case.dtype, str(device), seed)
    if key not in _INPUT_CACHE:
        _INPUT_CACHE.clear()
        gc.collect()
        _INPUT_CACHE[key] = [case.make_inputs(case.shape, case.dtype, device, seed)]
    sets = _INPUT_CACHE[key]
    per_set = max(1, case.input_bytes(sets[0]))
    wanted = min(MAX_INPUT_SETS, max(1, math.ceil(2 * cache_bytes(device) / per_set)))
    while len(sets) < wanted:
        sets.append(case.make_inputs(case.shape, case.dtype, device, seed + len(sets)))
    return sets[:wanted]


def resolve_memory_method(memory: str) -> str:
    if memory == "auto":
        return "both" if rss_available() else "alloc"
    return memory


def _bandwidth(case: Case, inp: Inputs, times: dict[str, list[float]]) -> dict[str, float]:
    if case.bytes_moved is None or case.floor_bytes_moved is None:
        return {}
    moved, floor_moved = case.bytes_moved(inp), case.floor_bytes_moved(inp)
    return {
        "pyppo_gbps": moved / statistics.median(times["pyppo"]) / 1e9,
        "floor_gbps": floor_moved / statistics.median(times["floor"]) / 1e9,
        "bandwidth_pct": 100.0 * moved / floor_moved * paired_ratio(times["floor"], times["pyppo"]),
    }


def _memory(case: Case, inp: Inputs, device: torch.device, memory: str, input_bytes: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, fn in (("pyppo", case.pyppo), ("eager", case.eager)):
        # The eager baselines' peaks are whole [*, V] temporaries: the rss mark alone is exact
        # enough there, and saves a profiled call of the slowest variant.
        method = "rss" if memory == "both" and name == "eager" else memory
        by_method = peak_extra_bytes(fn, inp, device, method)
        extra = max(by_method.values())
        row[f"{name}_extra_bytes"] = extra
        row[f"{name}_extra_by_method"] = by_method
        row[f"{name}_extra_pct"] = 100.0 * extra / max(1, input_bytes)
    row["memory_ratio"] = row["pyppo_extra_bytes"] / max(1, row["eager_extra_bytes"])
    return row


def _row_start(
    case: RowLabels, device: torch.device, sets: list[Inputs], input_bytes: int, **names: str
) -> dict[str, Any]:
    """A row's first fields (of the bench's and the peer bench's alike): ``names``, what the row
    compares, then where it ran and on how much input."""
    return {
        **names,
        "shape": list(case.shape),
        "shape_str": case.shape_str,
        "dtype": case.dtype_str,
        "device": str(device),
        "input_bytes": input_bytes,
        "input_sets": len(sets),
    }


def run_case(
    case: Case, device: torch.device, *, timing: Timing, memory: str, seed: int = 0, check: bool = True
) -> dict:
    """One row: the check, the timings, the peak memory (``memory`` a method of
    :func:`~pyppo.bench.memory.peak_extra_bytes`, or ``"off"``) and the targets."""
    sets = _input_sets(case, device, seed)
    inp = sets[0]
    row = _row_start(
        case,
        device,
        sets,
        int(case.input_bytes(inp)),
        op=case.op,
        label=case.label,
        eager=case.eager_name,
        floor=case.floor_name,
    )
    if check:
        err = max_error(case.pyppo(inp), (case.compare_eager or case.eager)(inp))
        row.update(max_error=err, tol=case.tol, agree=bool(err <= case.tol))
    times = measure(
        {"pyppo": case.pyppo, "eager": case.eager, "floor": case.floor}, sets, clock_for(device), **asdict(timing)
    )
    row.update(
        pyppo_ms=statistics.median(times["pyppo"]) * 1e3,
        eager_ms=statistics.median(times["eager"]) * 1e3,
        floor_ms=statistics.median(times["floor"]) * 1e3,
        speedup=paired_ratio(times["eager"], times["pyppo"]),
        floor_ratio=paired_ratio(times["pyppo"], times["floor"]),
        eager_floor_ratio=paired_ratio(times["eager"], times["floor"]),
        reps=len(times["pyppo"]),
        times_ms={k: [t * 1e3 for t in v] for k, v in times.items()},
        **_bandwidth(case, inp, times),
    )
    if memory != "off":
        row.update(_memory(case, inp, device, memory, row["input_bytes"]))
    row["targets"] = [
        {
            "name": t.name,
            "metric": t.metric,
            "value": row[t.metric],
            "cmp": t.cmp,
            "bound": t.bound,
            "goal": t.goal,
            "met": t.met(row[t.metric]),
            "goal_met": t.goal_met(row[t.metric]),
        }
        for t in case.targets
        if row.get(t.metric) is not None
    ]
    return row


def _log(row: dict) -> None:
    print(
        f"  {row['suite']:<6} {row['label']:<30} {row['shape_str']:<14} {row['dtype']:<9} {row['device']:<5} "
        f"pyppo {row['pyppo_ms']:9.3f} ms  eager {row['eager_ms']:9.3f} ms  x{row['speedup']:.1f}",
        file=sys.stderr,
        flush=True,
    )


def _sweep_points(sweep, device, suite: Suite, seed: int) -> list[dict]:
    timing = Timing(suite.timing.warmup, suite.timing.min_reps, suite.timing.max_reps, suite.timing.budget_s / 2)
    points = []
    for value, case in zip(sweep.values, sweep.cases):
        row = run_case(case, device, timing=timing, memory="off", seed=seed, check=False)
        _INPUT_CACHE.clear()
        points.append(
            {
                "value": value,
                **{k: row[k] for k in ("shape", "pyppo_ms", "eager_ms", "floor_ms", "speedup", "floor_ratio")},
            }
        )
    return points


def run_suites(
    suites: list[Suite],
    devices: list[torch.device],
    *,
    sizes: str,
    ops: list[str] | None = None,
    memory: str = "auto",
    seed: int = 0,
    sweeps: bool = True,
    verbose: bool = True,
) -> dict:
    """Run ``suites`` on ``devices`` (a CUDA-only suite on the CUDA ones alone); returns
    ``{"created", "sizes", "suites", "env", "rows", "sweeps"}``, each row naming its suite."""
    memory = resolve_memory_method(memory)
    env = environment(devices)
    env["memory_method"] = memory
    result: dict[str, Any] = {
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "sizes": sizes,
        "suites": [s.name for s in suites],
        "env": env,
        "rows": [],
        "sweeps": [],
    }
    for suite in suites:
        cases = [c for c in suite.cases if not ops or c.op in ops]
        for device in (d for d in devices if d.type == "cuda" or not suite.cuda_only):
            for case in cases:
                row = {"suite": suite.name, **run_case(case, device, timing=suite.timing, memory=memory, seed=seed)}
                result["rows"].append(row)
                if verbose:
                    _log(row)
            for sweep in suite.sweeps if sweeps else ():
                if ops and sweep.cases[0].op not in ops:
                    continue
                result["sweeps"].append(
                    {
                        "suite": suite.name,
                        "name": sweep.name,
                        "axis": sweep.axis,
                        "device": str(device),
                        "eager": sweep.cases[0].eager_name,
                        "points": _sweep_points(sweep, device, suite, seed),
                    }
                )
        _INPUT_CACHE.clear()
    env["load_average_after"] = load_average()
    return result
