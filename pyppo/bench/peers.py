"""``pyppo bench --peer verl|openrlhf|trl|rlox|all``: each peer function against its pyppo adapter.

For every function a peer's trainer calls that :mod:`pyppo.integrations` replaces (the rows:
:mod:`pyppo.bench.peer_cases`), the installed peer's own function and the adapter of the same
name and signature run on the same inputs, in one process, interleaved round by round
(:func:`pyppo.bench.timing.measure`), forward and, where the function is differentiable,
forward+backward. A row reports:

* ``peer ms`` / ``pyppo ms``: median milliseconds per call (host clock on CPU, CUDA events on CUDA);
* ``speed-up``: the median over rounds of peer / pyppo timed back to back;
* ``peer extra`` / ``pyppo extra``: peak bytes a call needs beyond its inputs, outputs (and, in
  fwd+bwd, the inputs' gradients) included (:func:`pyppo.bench.memory.peak_extra_bytes`), and
  their ratio pyppo / peer;
* ``max abs err``: max |pyppo - peer| over every output (tensors, the floats of a metrics dict,
  the gradients), and the check: that error over max(1, max |peer|) within the row's tolerance,
  with the same output structure, shapes and dtypes. A failed check makes the command exit 1.

The peer's functions are the module attributes as imported, never a patched one (an active
:func:`pyppo.integrations.patch` is looked through to the originals it replaced). A peer that takes
and returns numpy arrays (rlox) runs on the CPU only; its outputs are compared as tensors.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from . import peer_cases as pc
from .environment import cache_bytes, environment, load_average
from .harness import _row_start, resolve_memory_method
from .memory import peak_extra_bytes
from .suites import Timing
from .table import _grid, _header, fmt_bytes
from .timing import clock_for, measure, paired_ratio

__all__ = ["run_peers", "format_peer_table", "write_peer_json", "resolve_peers", "function_filter"]

TIMING = {
    # [B, T] rows take milliseconds (veRL's GAE loop a fraction of a second); a full-size logits
    # row takes seconds to tens of seconds a call on a CPU, so it gets the fewest rounds that
    # still give a median.
    "rollout": {"full": Timing(2, 5, 50, 4.0), "quick": Timing(1, 3, 20, 1.0), "tiny": Timing(1, 2, 3, 0.05)},
    "logits": {"full": Timing(1, 3, 10, 6.0), "quick": Timing(1, 3, 10, 2.0), "tiny": Timing(1, 2, 3, 0.05)},
    # GRPO scores: tens to hundreds of microseconds a call.
    "group": {"full": Timing(2, 5, 200, 2.0), "quick": Timing(1, 3, 100, 0.5), "tiny": Timing(1, 2, 3, 0.05)},
}


def resolve_peers(choice: str) -> tuple[list[str], list[str]]:
    """(peers to run, one line per peer skipped because it is not installed). A named peer that is
    missing, or ``all`` with none installed, is an ImportError naming the install command."""
    names = list(pc.PEERS) if choice == "all" else [choice]
    missing = {p: pc.peer_available(p) for p in names}
    missing = {p: why for p, why in missing.items() if why}
    if choice != "all" and missing:
        raise ImportError(f"--peer {choice}: {missing[choice]}")
    run = [p for p in names if p not in missing]
    if not run:
        raise ImportError("--peer all: no peer is installed: " + "; ".join(missing.values()))
    return run, [f"--peer {p}: skipped, {why}" for p, why in missing.items()]


def function_filter(text: str | None, peers: list[str]) -> list[str] | None:
    """``--ops`` under ``--peer``: peer function names (their rows, forward and forward+backward)."""
    if not text:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {f for p in peers for f in pc.functions(p)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(
            f"--ops with --peer: unknown function(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return names


# --------------------------------------------------------------------------- adapters


def _adapters(peer: str) -> tuple[dict[tuple[str, str], Callable], Any, Any]:
    """{(peer module, name): adapter} from ``pyppo.integrations.<peer>.PEER``, the Peer and the
    adapters' module (whose functions that ``patch()`` leaves alone are still timed, and said so)."""
    try:
        mod = importlib.import_module(f"pyppo.integrations.{peer}")
    except ModuleNotFoundError as exc:
        if exc.name == f"pyppo.integrations.{peer}":
            raise ImportError(f"--peer {peer}: this pyppo has no pyppo.integrations.{peer} adapters") from None
        raise
    spec = getattr(mod, "PEER", None)
    table = {(t.module, t.name): t.adapter for t in getattr(spec, "targets", ())}
    return table, spec, mod


def _peer_function(case: pc.PeerCase, adapter: Callable | None, spec) -> Callable:
    fn = getattr(importlib.import_module(case.module), case.name)
    if fn is adapter or getattr(fn, "__module__", "").startswith("pyppo."):
        # Patched in this process: time the original it replaced, never the adapter against itself.
        from pyppo.integrations import _patching

        active = _patching.active(spec) if spec is not None else None
        original = active.originals.get(f"{case.module}.{case.name}") if active else None
        if original is None:
            raise RuntimeError(f"{case.module}.{case.name} is patched and its original is unknown")
        fn = original
    return fn


# --------------------------------------------------------------------------- one row


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    return []


def _runner(case: pc.PeerCase, fn: Callable) -> Callable:
    """``inputs -> outputs``; in fwd+bwd mode ``(outputs, gradients of case.wrt)``, back-propagated
    from the outputs that require grad (a loss's first output only), the gradient handed to each
    non-scalar one being the inputs' random ``grad`` (the same for peer and adapter)."""
    if case.mode == "fwd":
        return lambda inp: case.call(fn, inp)

    def run(inp):
        out = case.call(fn, inp)
        ts = [t for t in _tensors(out[0] if case.loss_first else out) if t.requires_grad]
        torch.autograd.backward(ts, [None if t.dim() == 0 else inp["grad"].to(t.dtype) for t in ts])
        grads = tuple(inp[n].grad for n in case.wrt)
        for n in case.wrt:
            inp[n].grad = None
        return out, grads

    return run


def _leaves(out, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(out, torch.Tensor):
        return [(path, out.detach())]
    if hasattr(out, "__array_interface__"):  # a numpy array (rlox's outputs), without importing numpy
        return [(path, torch.from_numpy(out) if type(out).__name__ == "ndarray" else torch.as_tensor(out))]
    if isinstance(out, dict):
        return [leaf for k in sorted(out, key=str) for leaf in _leaves(out[k], f"{path}[{k!r}]")]
    if isinstance(out, (tuple, list)):
        return [leaf for i, v in enumerate(out) for leaf in _leaves(v, f"{path}[{i}]")]
    if isinstance(out, (bool, int, float)):
        return [(path, torch.tensor(float(out), dtype=torch.float64))]
    return [(path, out)]  # None, strings: must be equal


_COMPARE_BLOCK = 2**24


def compare(peer_out, pyppo_out) -> dict[str, Any]:
    """``max_abs_error`` (max |pyppo - peer| over all outputs), ``max_error`` (that over
    max(1, max |peer|), output by output), and ``mismatch``: what differs in structure, shape or
    dtype ('' when nothing). Non-finite values must sit at the same places with the same values.
    Outputs are tensors, numpy arrays (compared as the tensors they convert to), numbers, or
    tuples, lists and dicts of them."""
    a, b = _leaves(pyppo_out), _leaves(peer_out)
    if [p for p, _ in a] != [p for p, _ in b]:
        return {
            "max_abs_error": math.inf,
            "max_error": math.inf,
            "mismatch": f"outputs {[p for p, _ in a]} vs the peer's {[p for p, _ in b]}",
        }
    worst_abs = worst = 0.0
    for (path, x), (_, y) in zip(a, b):
        if not isinstance(y, torch.Tensor) or not isinstance(x, torch.Tensor):
            if x != y:
                return {"max_abs_error": math.inf, "max_error": math.inf, "mismatch": f"output{path}: {x!r} vs {y!r}"}
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return {
                "max_abs_error": math.inf,
                "max_error": math.inf,
                "mismatch": f"output{path}: {x.dtype} {list(x.shape)} vs the peer's {y.dtype} {list(y.shape)}",
            }
        err = scale = 0.0
        # In blocks, and in float32 for 16- and 32-bit outputs (exact for bf16, and its rounding
        # is far below the float32 tolerance): a float64 copy of full-size logits' gradients
        # would be 10 GB, and take minutes.
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        for xb, yb in zip(x.reshape(-1).split(_COMPARE_BLOCK), y.reshape(-1).split(_COMPARE_BLOCK)):
            xb, yb = xb.to("cpu", wide), yb.to("cpu", wide)
            d = float((xb - yb).abs().max()) if xb.numel() else 0.0
            if not math.isfinite(d):  # NaN or inf somewhere: they must sit at the same places
                finite = torch.isfinite(yb)
                if not bool((torch.isfinite(xb) == finite).all()) or not bool(
                    (xb[~finite].nan_to_num(0.0) == yb[~finite].nan_to_num(0.0)).all()
                ):
                    return {
                        "max_abs_error": math.inf,
                        "max_error": math.inf,
                        "mismatch": f"output{path}: non-finite values differ",
                    }
                xb, yb = xb[finite], yb[finite]
                d = float((xb - yb).abs().max()) if xb.numel() else 0.0
            if yb.numel():
                err = max(err, d)
                scale = max(scale, float(yb.abs().max()))
        worst_abs = max(worst_abs, err)
        worst = max(worst, err / max(1.0, scale))
    return {"max_abs_error": worst_abs, "max_error": worst, "mismatch": ""}


def _memory_and_outputs(runs: dict[str, Callable], inp, device, memory: str, big: bool) -> tuple[dict, dict]:
    """Peak extra bytes of each variant (the peer's first: its peak is the largest, and nothing
    else is held then but its inputs) and each one's output from the first measured call."""
    row: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for name in ("peer", "pyppo"):
        fn = runs[name]

        def keep_first(i, fn=fn, name=name):
            out = fn(i)
            outputs.setdefault(name, out)
            return out

        if memory == "off":
            outputs[name] = fn(inp)
            continue
        # The peer's peaks are whole [*, V] temporaries at the logits shapes: the rss mark is exact
        # enough there, and saves a profiled call of the slowest variant.
        method = "rss" if memory == "both" and name == "peer" and big else memory
        by_method = peak_extra_bytes(keep_first, inp, device, method)
        row[f"{name}_extra_bytes"] = max(by_method.values())
        row[f"{name}_extra_by_method"] = by_method
    if memory != "off":
        row["memory_ratio"] = row["pyppo_extra_bytes"] / row["peer_extra_bytes"] if row["peer_extra_bytes"] else None
    return row, outputs


def run_case(
    case: pc.PeerCase, peer_fn: Callable, adapter: Callable, device: torch.device, *, sizes: str, memory: str, seed: int
) -> dict:
    """One row (see the module doc); an exception in either callable is recorded in ``error``."""
    timing = TIMING[case.kind][sizes]
    sets = pc.input_sets(case, device, seed, cache_bytes(device))
    inp = sets[0]
    row = _row_start(
        case,
        device,
        sets,
        int(pc.nbytes(*case.reads)(inp)),
        peer=case.peer,
        module=case.module,
        function=case.name,
        mode=case.mode,
        args=case.args,
    )
    row["tol"] = case.tol
    runs = {"peer": _runner(case, peer_fn), "pyppo": _runner(case, adapter)}
    try:
        times = measure(runs, sets, clock_for(device), **asdict(timing))
        mem, outputs = _memory_and_outputs(runs, inp, device, memory, case.kind == "logits")
    except Exception as exc:  # a broken adapter is a row that says so, not a lost run
        row.update(
            error=f"{type(exc).__name__}: {exc}".splitlines()[0], agree=False, traceback=traceback.format_exc(limit=-4)
        )
        return row
    row.update(
        peer_ms=statistics.median(times["peer"]) * 1e3,
        pyppo_ms=statistics.median(times["pyppo"]) * 1e3,
        speedup=paired_ratio(times["peer"], times["pyppo"]),
        reps=len(times["peer"]),
        times_ms={k: [t * 1e3 for t in v] for k, v in times.items()},
        **mem,
    )
    if "peer_extra_bytes" in row:
        row["peer_extra_pct"] = 100.0 * row["peer_extra_bytes"] / max(1, row["input_bytes"])
        row["pyppo_extra_pct"] = 100.0 * row["pyppo_extra_bytes"] / max(1, row["input_bytes"])
    check = compare(outputs["peer"], outputs["pyppo"])
    row.update(check, agree=bool(not check["mismatch"] and check["max_error"] <= case.tol))
    return row


# --------------------------------------------------------------------------- the run


def _log(row: dict) -> None:
    if "error" in row:
        text = f"ERROR {row['error']}"
        if os.environ.get("PYPPO_DEBUG") and row.get("traceback"):
            text += "\n" + row["traceback"]
    else:
        text = f"peer {row['peer_ms']:10.3f} ms  pyppo {row['pyppo_ms']:9.3f} ms  x{row['speedup']:.2f}" + (
            "" if row["agree"] else "  MISMATCH"
        )
    print(
        f"  {row['peer']:<8} {row['function']:<34} {row['mode']:<7} {row['shape_str']:<16} {text}"
        + (f"  ({row['seconds']:.0f} s)" if "seconds" in row else ""),
        file=sys.stderr,
        flush=True,
    )


def _peer_env(peer: str, spec) -> dict[str, Any]:
    dist, pinned, pip = pc.PINS[peer]
    version = importlib.metadata.version(dist)
    written = list(getattr(spec, "versions", ()) or (pinned,))
    return {
        "version": version,
        "adapters_written_for": written,
        "adapters": f"pyppo.integrations.{peer}",
        "install": pip,
    }


def _cpu_flags() -> list[str]:
    """The vector extensions that decide how fast bf16 runs on a CPU, as /proc/cpuinfo lists them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16") if f in flags]


def run_peers(
    peers: list[str], devices: list[torch.device], *, sizes: str, functions=None, memory="auto", seed=0, verbose=True
) -> dict:
    """Run the rows of ``peers`` on ``devices`` (those of the peer functions named in the list
    ``functions`` alone, when given); returns ``{"created", "kind": "peer", "sizes",
    "peers", "env", "shapes", "rows"}``, the dict ``pyppo bench --peer`` writes as JSON."""
    memory = resolve_memory_method(memory)
    env = environment(devices)
    env["memory_method"] = memory
    env["cpu_flags"] = _cpu_flags()
    env["peers"] = {}
    result: dict[str, Any] = {
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "kind": "peer",
        "sizes": sizes,
        "peers": list(peers),
        "env": env,
        "shapes": {},
        "rows": [],
    }
    start = time.perf_counter()
    # Once, before any logits exist: sized per peer, the first peer's cached logits would shrink
    # the next peer's B, and the peers' rows would not be comparable.
    logits_shapes = {str(d): pc.logits_shape(sizes, d) for d in devices}
    for device, (logits, note) in logits_shapes.items():
        result["shapes"][device] = {
            "rollout": list(pc.SHAPES[sizes][0]),
            "logits": list(logits),
            "logits_note": note,
            "groups": [list(g) for g in pc.SHAPES[sizes][2]],
        }
    with warnings.catch_warnings():
        # veRL's compute_policy_loss warns that it is deprecated on every call.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        for peer in peers:
            pc.import_peer(peer)
            adapters, spec, adapter_module = _adapters(peer)
            # The peers' imports leave millions of objects (ray, transformers) that every
            # gc.collect() before a memory measurement would walk again: ~0.3 s a call.
            gc.freeze()
            env["peers"][peer] = _peer_env(peer, spec)
            if peer == "openrlhf":
                env["flash_attn"] = pc.flash_attn_state()
            for device in devices:
                if peer in pc.CPU_ONLY and device.type != "cpu":
                    continue
                for case in pc.cases(peer, pc.SHAPES[sizes][0], logits_shapes[str(device)][0], pc.SHAPES[sizes][2]):
                    if functions and case.name not in functions:
                        continue
                    adapter = adapters.get((case.module, case.name))
                    patched = adapter is not None
                    if adapter is None:
                        adapter = getattr(adapter_module, case.name, None)
                    if adapter is None:
                        row = {
                            "peer": peer,
                            "module": case.module,
                            "function": case.name,
                            "mode": case.mode,
                            "args": case.args,
                            "shape_str": case.shape_str,
                            "dtype": case.dtype_str,
                            "device": str(device),
                            "agree": False,
                            "error": f"no adapter for {case.module}.{case.name} in pyppo.integrations.{peer}",
                        }
                    else:
                        t0 = time.perf_counter()
                        row = run_case(
                            case,
                            _peer_function(case, adapter, spec),
                            adapter,
                            device,
                            sizes=sizes,
                            memory=memory,
                            seed=seed,
                        )
                        row["seconds"] = time.perf_counter() - t0
                        row["patched"] = patched
                        if not patched:
                            row["args"] = ", ".join(filter(None, [row["args"], "not replaced by patch()"]))
                    result["rows"].append(row)
                    if verbose:
                        _log(row)
    pc.clear_inputs()
    env["load_average_after"] = load_average()
    result["seconds"] = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------- output


COLUMNS = (
    "function",
    "mode",
    "shape",
    "dtype",
    "device",
    "peer ms",
    "pyppo ms",
    "speed-up",
    "peer extra",
    "pyppo extra",
    "extra ratio",
    "max abs err",
    "check",
    "args",
)
_LEFT = {"function", "mode", "shape", "dtype", "device", "check", "args"}


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.0f}"


def _cells(r: dict) -> dict[str, str]:
    cells = {
        "function": r["function"],
        "mode": r["mode"],
        "shape": r["shape_str"],
        "dtype": r["dtype"],
        "device": r["device"],
        "args": r.get("args", ""),
    }
    if "error" in r:
        return {**{c: "-" for c in COLUMNS}, **cells, "check": "ERROR: " + r["error"]}
    ratio = r.get("memory_ratio")
    cells.update(
        {
            "peer ms": _ms(r["peer_ms"]),
            "pyppo ms": _ms(r["pyppo_ms"]),
            "speed-up": f"{r['speedup']:.2f}x",
            "peer extra": fmt_bytes(r.get("peer_extra_bytes")),
            "pyppo extra": fmt_bytes(r.get("pyppo_extra_bytes")),
            "extra ratio": "-" if ratio is None else f"{ratio:.3f}",
            "max abs err": f"{r['max_abs_error']:.2g}",
            "check": "ok" if r["agree"] else ("FAIL: " + (r["mismatch"] or f"{r['max_error']:.2g} > {r['tol']:g}")),
        }
    )
    return cells


def _section(rows: list[dict]) -> list[str]:
    return _grid(COLUMNS, [_cells(r) for r in rows], _LEFT)


def _peer_title(result: dict, peer: str) -> str:
    p = result["env"]["peers"].get(peer, {})
    written = ", ".join(p.get("adapters_written_for", []))
    title = f"peer {peer} {p.get('version', '?')} against {p.get('adapters', 'pyppo.integrations.' + peer)}"
    if p.get("version") and written and p["version"] not in p.get("adapters_written_for", []):
        title += f" (WARNING: the adapters reproduce {written})"
    return title


def _notes(result: dict) -> list[str]:
    lines = []
    for device, s in result.get("shapes", {}).items():
        lines.append(
            f"shapes ({device}): rollout [B, T] {'x'.join(map(str, s['rollout']))} float32 (int64 masks with "
            f"padding and observation-token holes), logits [B, T, V] {'x'.join(map(str, s['logits']))} "
            "bfloat16" + (f" ({s['logits_note']})" if s.get("logits_note") else "")
        )
    if any(p in pc.CPU_ONLY for p in result.get("peers", ())):
        groups = next(iter(result.get("shapes", {}).values()), {}).get("groups", [])
        lines.append(
            "group advantages (rlox) [n_prompts x group_size]: "
            + ", ".join("x".join(map(str, g)) for g in groups)
            + " float64 scores; rlox's rows take numpy arrays and run on the CPU only"
        )
    env = result["env"]
    if env.get("cpu_flags") is not None:
        lines.append(
            f"cpu flags: {' '.join(env['cpu_flags']) or 'none of avx2/avx512'}"
            + (f"  ran in {result['seconds']:.0f} s" if "seconds" in result else "")
        )
    if "flash_attn" in result["env"]:
        lines.append("openrlhf: " + result["env"]["flash_attn"])
    return lines


LEGEND = (
    "speed-up = peer / pyppo (median of back-to-back ratios); extra = peak memory beyond the inputs, outputs "
    "and gradients included; extra ratio = pyppo's / peer's; max abs err = max |pyppo - peer| over all "
    "outputs and gradients, check = that within tol of max(1, |peer|), same shapes and dtypes"
)


def format_peer_table(result: dict) -> str:
    """The text table: the machine, then one section per peer, then the legend."""
    header = {**result, "suites": [f"peer {p}" for p in result["peers"]]}
    lines = _header(header) + _notes(result)
    lines += [f"  {s}" for s in result.get("skipped", [])]
    for peer in result["peers"]:
        rows = [r for r in result["rows"] if r["peer"] == peer]
        lines += ["", _peer_title(result, peer) + ":"] + (_section(rows) if rows else ["  (no rows ran)"])
    return "\n".join(lines + ["", LEGEND])


def write_peer_json(result: dict, output_dir: Path, json_path: Path | None = None) -> Path:
    """The JSON at ``json_path``, else ``bench-peer-<peers>-YYYYMMDD-HHMMSS.json`` in ``output_dir``."""
    if json_path is None:
        tag = "all" if len(result["peers"]) > 1 else result["peers"][0]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        json_path = output_dir / f"bench-peer-{tag}-{stamp}.json"
        n = 1
        while json_path.exists():
            json_path = output_dir / f"bench-peer-{tag}-{stamp}-{n}.json"
            n += 1
    json_path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{k: v for k, v in r.items() if k != "traceback"} for r in result["rows"]]
    json_path.write_text(json.dumps(_finite({**result, "rows": rows}), indent=1, default=str) + "\n")
    return json_path


def _finite(x):
    """inf / NaN (a failed check's error) as null: JSON has no such numbers."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
