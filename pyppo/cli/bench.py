"""Time pyppo's ops against the eager PyTorch users write today and against the memory floor.

Suites (``--suite``; see :mod:`pyppo.bench.suites`): ``ops`` (default: every op at the shapes of
a SmolLM2-sized PPO step, with sweeps over V and T; CPU, plus CUDA when present), ``gpu`` (CUDA
only: GPU-sized batches, the log-prob forward against copy bandwidth), ``memory`` (peak memory of
the log-prob ops where the eager path materialises [N, V] logits), ``all``. Sizes: ``--sizes
full`` (default), ``quick`` (``--quick``), ``tiny`` (seconds, for tests).

Each case (one per op and shape, :mod:`pyppo.bench.cases`) runs three callables on the same
inputs, interleaved in one process (round-robin, order rotated each round, so machine noise
hits all three alike):

* pyppo: the compiled op;
* eager: what a user of TRL / OpenRLHF / veRL writes today (:mod:`pyppo.bench.eager`, one
  module per op, mirroring the peers' formulas);
* floor: the least work any implementation must do, usually one read of the same inputs
  (``logits.amax(-1)``; a sum over each [B, T] input; on the GPU suite a device-to-device copy
  of the logits).

Before timing, pyppo's outputs are checked against the eager reference (max abs difference over
max(1, max |eager|)); a disagreement is printed and makes the command exit with status 1. Each
callable is warmed up, then timed in rounds (host clock on CPU, CUDA events around batches of
calls on CUDA), rotating among several input sets when one set fits in the cache; the table
reports medians. "speed-up" is the median over rounds of eager/pyppo timed back to back,
"x floor" the median of pyppo/floor likewise. "extra" is the peak memory a call needs beyond its
inputs, outputs included (CPU: resident-set high-water mark and torch allocator profiling, the
larger shown; CUDA: max_memory_allocated); see :mod:`pyppo.bench.memory`.

Output: the table on stdout (last), and ``bench-YYYYMMDD-HHMMSS.json`` plus a ``.png`` of the
sweeps in ``--output DIR`` (default: the current directory), or the JSON at ``--json FILE``.
Exit status: 0; 1 when an op disagreed with its reference; 2 on a usage error; 3 with
``--check-targets`` when a target was missed.

``--peer verl|openrlhf|trl|rlox|all`` times the installed peer library's own functions against
pyppo's drop-in adapters (:mod:`pyppo.integrations`) instead, at the peer's typical shapes, and
checks that both return the same values (:mod:`pyppo.bench.peers`; the rows:
:mod:`pyppo.bench.peer_cases`). JSON: ``bench-peer-<peer>-YYYYMMDD-HHMMSS.json``. ``--ops`` then
names peer functions; ``--check-targets`` exits 3 when an adapter is slower than its peer.
A peer that is not installed is exit status 2, with the pip command that installs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..run.rundir import check_output_dir

__all__ = ["add_arguments", "run"]

SUITE_CHOICES = ("ops", "gpu", "memory", "all")
PEER_CHOICES = ("verl", "openrlhf", "trl", "rlox", "all")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``pyppo bench`` options to ``parser``."""
    parser.add_argument(
        "--suite",
        choices=SUITE_CHOICES,
        default=None,
        help="ops (default): every op against its eager peers and its floor; gpu: CUDA only, "
        "GPU-sized batches against copy bandwidth; memory: peak memory of the log-prob ops "
        "at large N; all: every suite (gpu only where CUDA is)",
    )
    parser.add_argument(
        "--peer",
        choices=PEER_CHOICES,
        default=None,
        help="instead of a suite: the installed peer library's own functions against pyppo's "
        "drop-in adapters (pyppo.integrations), side by side, with a check that both agree",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the same shapes with fewer repeats and short sweeps (= --sizes quick; "
        "about a minute for the ops suite on 2 cores)",
    )
    parser.add_argument(
        "--sizes",
        choices=("full", "quick", "tiny"),
        default=None,
        help="full (default; several minutes), quick, tiny (seconds, for tests)",
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        default=None,
        help="where bench-YYYYMMDD-HHMMSS.json/.png go (default: the current directory)",
    )
    parser.add_argument(
        "--json", metavar="FILE", default=None, help="write the JSON to FILE instead (the PNG, if any, beside it)"
    )
    parser.add_argument(
        "--ops",
        metavar="OP[,OP...]",
        default=None,
        help="only the cases of these ops (with --peer: of these peer functions)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (default): CPU, plus CUDA when available and pyppo was built with it",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first (default: torch's)")
    parser.add_argument(
        "--memory",
        choices=("auto", "both", "rss", "alloc", "off"),
        default="auto",
        help="peak-memory method on CPU: rss (resident high-water mark), alloc (torch allocator "
        "profiling), both (the larger; auto on Linux), or off",
    )
    parser.add_argument("--no-sweeps", action="store_true", help="skip the V / T sweeps (and the PNG)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--check-targets", action="store_true", help="exit with status 3 when a target is missed")


def _sizes(args: argparse.Namespace) -> str:
    if args.quick and args.sizes not in (None, "quick"):
        raise ValueError("--quick and --sizes disagree")
    return args.sizes or ("quick" if args.quick else "full")


def _devices(device: str):
    import torch

    from ..bench.environment import cuda_usable, default_devices

    if device == "auto":
        return default_devices()
    if device == "cuda" and not cuda_usable():
        raise ValueError(
            "--device cuda: "
            + ("pyppo was built without CUDA" if torch.cuda.is_available() else "no CUDA device is available")
        )
    return [torch.device(device)]


def _suite_names(choice: str, devices) -> list[str]:
    from ..bench.suites import SUITES

    names = list(SUITES) if choice == "all" else [choice]
    if "gpu" in names and not any(d.type == "cuda" for d in devices):
        if choice == "gpu":
            raise ValueError("--suite gpu needs a CUDA device and pyppo built with CUDA (PYPPO_CUDA=on)")
        names.remove("gpu")
        print("pyppo bench: no CUDA device, so the gpu suite is skipped", file=sys.stderr)
    return names


def _ops(text: str | None) -> list[str] | None:
    if not text:
        return None
    from ..bench.suites import SUITES, suite

    ops = [o.strip() for o in text.split(",") if o.strip()]
    known = {c.op for name in SUITES for c in suite(name, "tiny").cases}
    unknown = sorted(set(ops) - known)
    if unknown:
        raise ValueError(f"--ops: unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return ops


def run(args: argparse.Namespace) -> int:
    """Run ``pyppo bench`` with parsed ``args``; returns the exit status (see the module doc)."""
    import torch

    from ..bench.harness import run_suites
    from ..bench.memory import rss_available
    from ..bench.output import write_outputs
    from ..bench.suites import suite
    from ..bench.table import format_table

    sizes = _sizes(args)
    # Before any timing: a bad path would otherwise only fail once the results exist.
    if args.output is not None or not args.json:  # without either, the files go to the current directory
        check_output_dir(Path(args.output or ".").expanduser())
    if args.json:
        check_output_dir(Path(args.json).expanduser().parent, "--json")
    if args.peer is not None and args.suite is not None:
        raise ValueError("--peer and --suite: choose one")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.peer is not None:
        return _run_peer(args, sizes)
    devices = _devices(args.device)
    suites = [suite(name, sizes) for name in _suite_names(args.suite or "ops", devices)]
    ops = _ops(args.ops)
    if args.memory in ("rss", "both") and not rss_available():
        raise ValueError("--memory rss needs Linux /proc/self/clear_refs; use --memory alloc")
    result = run_suites(
        suites, devices, sizes=sizes, ops=ops, memory=args.memory, seed=args.seed, sweeps=not args.no_sweeps
    )
    json_path, png_path = write_outputs(
        result, Path(args.output or ".").expanduser(), Path(args.json).expanduser() if args.json else None
    )
    print(f"wrote {json_path}" + (f" and {png_path.name}" if png_path else ""), flush=True)
    status = 0
    for r in result["rows"]:
        if not r.get("agree", True):
            print(
                f"pyppo bench: {r['label']} {r['shape_str']} {r['dtype']} {r['device']}: pyppo disagrees "
                f"with {r['eager']} (error {r['max_error']:.3g} > {r['tol']:g})",
                file=sys.stderr,
                flush=True,
            )
            status = 1
    if args.check_targets and status == 0:
        if any(not t["met"] for r in result["rows"] for t in r.get("targets", [])):
            status = 3
    print()
    print(format_table(result))  # last, so that a log's tail shows it
    return status


def _run_peer(args: argparse.Namespace, sizes: str) -> int:
    from ..bench.memory import rss_available
    from ..bench.peers import format_peer_table, function_filter, resolve_peers, run_peers, write_peer_json

    peers, skipped = resolve_peers(args.peer)
    functions = function_filter(args.ops, peers)
    devices = _devices(args.device)
    if args.memory in ("rss", "both") and not rss_available():
        raise ValueError("--memory rss needs Linux /proc/self/clear_refs; use --memory alloc")
    for line in skipped:
        print(f"pyppo bench: {line}", file=sys.stderr, flush=True)
    result = run_peers(peers, devices, sizes=sizes, functions=functions, memory=args.memory, seed=args.seed)
    result["skipped"] = skipped
    json_path = write_peer_json(
        result, Path(args.output or ".").expanduser(), Path(args.json).expanduser() if args.json else None
    )
    print(f"wrote {json_path}", flush=True)
    status = 0
    for r in result["rows"]:
        if not r.get("agree", False):
            why = r.get("error") or r.get("mismatch") or f"error {r['max_error']:.3g} > {r['tol']:g}"
            print(
                f"pyppo bench: {r['peer']} {r['function']} {r['mode']} {r['shape_str']} {r['device']}: "
                f"pyppo's adapter disagrees with the peer ({why})",
                file=sys.stderr,
                flush=True,
            )
            status = 1
    if args.check_targets and status == 0 and any(r["speedup"] < 1.0 for r in result["rows"]):
        status = 3
    print()
    print(format_peer_table(result))  # last, so that a log's tail shows it
    return status
