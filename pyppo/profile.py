"""Profile one PPO step: wall time per phase and the share spent inside pyppo's ops.

Runs :class:`pyppo.trainer.PPOTrainer` for ``--warmup-steps`` steps (default 1, unprofiled: the
first step pays one-time costs such as allocator growth and lazy initialisation), then one step
under :mod:`torch.profiler`, and prints a table with one row per phase — generate, policy
forward, reference forward, value forward, score, advantages, update — giving its wall seconds
(the trainer's own per-phase timer, ``time_<phase>`` in its metrics), its share of the step, and
the seconds and share of it spent inside pyppo ops (profiler events whose name starts with
``pyppo::``; nested or overlapping op events are counted once). The trainer wraps each phase in
``torch.profiler.record_function("pyppo/<phase>")``, so the phases also show up as ranges in the
trace and in any profiler a user runs around their own training loop.

Files written to ``--output DIR`` (default: the current directory):

* ``trace.json``: the Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing);
* ``profile.json``: the table, the pyppo ops by time, the step's metrics and the settings.

Times include the profiler's own overhead (a few percent for a model forward; more for phases
made of many tiny ops, e.g. token-by-token generation). On CUDA the pyppo seconds are host-side
(launch) time, and the device time of pyppo's kernels is reported alongside.

Interface used by ``pyppo.cli``: :func:`add_arguments` (parser) and :func:`run` (args) -> int;
:func:`main` (argv) -> int for ``python -m pyppo.profile``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

import torch

__all__ = ["add_arguments", "run", "main", "profile_step", "phase_table", "format_table", "PHASE_TITLES"]

#: trainer phase key -> the name shown in the table
PHASE_TITLES = {
    "generate": "generate",
    "policy_forward": "policy forward",
    "ref_forward": "reference forward",
    "value_forward": "value forward",
    "score": "score",
    "advantages": "advantages",
    "update": "update",
}


# ---------------------------------------------------------------------------------------------
# analysis


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _span(e) -> tuple[float, float]:
    return float(e.time_range.start), float(e.time_range.end)


def phase_table(events, metrics: dict) -> dict:
    """Per-phase rows from the profiler's events (``prof.events()``) and the step's metrics.

    Returns ``{"phases": [...], "pyppo_ops": [...], "step_seconds": s, "pyppo_seconds": s}``;
    each phase row has ``phase``, ``title``, ``seconds`` (trainer timer), ``share_of_step``,
    ``profiler_seconds`` (the ``pyppo/<phase>`` ranges), ``pyppo_seconds``, ``pyppo_share``
    (of the phase) and ``pyppo_device_seconds``.
    """
    from pyppo.stats import PHASES

    ranges: dict[str, list] = {p: [] for p in PHASES}
    op_events = []
    for e in events:
        name = e.name
        if name.startswith("pyppo/"):
            phase = name[len("pyppo/"):]
            if phase in ranges:
                ranges[phase].append(_span(e))
        elif name.startswith("pyppo::"):
            op_events.append(e)
    op_spans = _merge([_span(e) for e in op_events])

    # pyppo ops by name (an op nested in another pyppo op is counted under its own name too)
    by_name: dict[str, dict] = {}
    for e in op_events:
        row = by_name.setdefault(e.name, {"name": e.name, "calls": 0, "seconds": 0.0, "device_seconds": 0.0})
        row["calls"] += 1
        row["seconds"] += (e.time_range.end - e.time_range.start) * 1e-6
        row["device_seconds"] += float(getattr(e, "device_time_total", 0.0) or 0.0) * 1e-6

    step_s = float(metrics.get("step_seconds", 0.0))
    rows = []
    for phase in PHASES:
        merged = _merge(ranges[phase])
        prof_s = sum(b - a for a, b in merged) * 1e-6
        seconds = float(metrics.get(f"time_{phase}", prof_s))
        pyppo_s = _overlap(merged, op_spans) * 1e-6
        device_s = sum(
            float(getattr(e, "device_time_total", 0.0) or 0.0)
            for e in op_events
            if any(a <= e.time_range.start <= b for a, b in merged)
        ) * 1e-6
        rows.append({
            "phase": phase,
            "title": PHASE_TITLES.get(phase, phase),
            "seconds": seconds,
            "share_of_step": seconds / step_s if step_s > 0 else None,
            "profiler_seconds": prof_s,
            "pyppo_seconds": pyppo_s,
            "pyppo_share": pyppo_s / prof_s if prof_s > 0 else 0.0,
            "pyppo_device_seconds": device_s,
        })
    phase_total = sum(r["seconds"] for r in rows)
    return {
        "phases": rows,
        "other_seconds": max(0.0, step_s - phase_total),
        "step_seconds": step_s,
        "pyppo_seconds": sum(b - a for a, b in op_spans) * 1e-6,
        "pyppo_ops": sorted(by_name.values(), key=lambda r: -r["seconds"]),
    }


def format_table(table: dict, header: str = "") -> str:
    cols = ("phase", "ms", "% of step", "pyppo ops ms", "pyppo % of phase")
    body = []
    for r in table["phases"]:
        share = "-" if r["share_of_step"] is None else f"{100 * r['share_of_step']:.1f}"
        body.append((r["title"], f"{1e3 * r['seconds']:.2f}", share, f"{1e3 * r['pyppo_seconds']:.3f}",
                     f"{100 * r['pyppo_share']:.1f}"))
    step = table["step_seconds"]
    body.append(("(outside phases)", f"{1e3 * table['other_seconds']:.2f}",
                 f"{100 * table['other_seconds'] / step:.1f}" if step > 0 else "-", "", ""))
    body.append(("step", f"{1e3 * step:.2f}", "100.0", f"{1e3 * table['pyppo_seconds']:.3f}",
                 f"{100 * table['pyppo_seconds'] / step:.1f}" if step > 0 else "-"))
    widths = [max(len(c), *(len(row[i]) for row in body)) for i, c in enumerate(cols)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [header] if header else []
    lines += [fmt(cols), fmt(["-" * w for w in widths])]
    lines += [fmt(row) for row in body[:-2]]
    lines.append(fmt(["-" * w for w in widths]))
    lines += [fmt(row) for row in body[-2:]]
    if table["pyppo_ops"]:
        lines.append("")
        lines.append("pyppo ops: " + ", ".join(
            f"{r['name'][len('pyppo::'):]} {r['calls']}x {1e3 * r['seconds']:.2f} ms" for r in table["pyppo_ops"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the run


def profile_step(trainer, output_dir: Path, *, warmup_steps: int = 1, record_shapes: bool = False,
                 with_stack: bool = False) -> dict:
    """Run ``warmup_steps`` unprofiled steps, then one step under the profiler; write
    ``trace.json`` to ``output_dir`` and return ``{"metrics": ..., **phase_table(...)}``."""
    from torch.profiler import ProfilerActivity, profile

    from .bench import quiet_stderr

    for _ in range(warmup_steps):
        trainer.step()
    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, record_shapes=record_shapes, with_stack=with_stack)
    with quiet_stderr():  # kineto prints profiler_start / profiler_stop lines on stderr
        prof.start()
    try:
        metrics = trainer.step().metrics
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        with quiet_stderr():
            prof.stop()
    output_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(output_dir / "trace.json"))
    table = phase_table(prof.events(), metrics)
    table["metrics"] = {k: float(v) for k, v in metrics.items()}
    return table


#: What ``pyppo profile`` changes from PPOConfig's defaults: one small step after the warm-up.
PROFILE_DEFAULTS = {"batch_size": 4, "mini_batch_size": 4, "ppo_epochs": 1, "max_new_tokens": 16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``pyppo profile`` options to ``parser``: the model, reward and prompts, every
    ``PPOConfig`` field (as ``pyppo train``), and the profiler's own options."""
    from pyppo.cli import add_config_flags, add_source_flags, field_defaults

    add_source_flags(parser, required_defaults=True, eval_prompts=False)
    prof = parser.add_argument_group("profiler")
    prof.add_argument("--warmup-steps", type=int, default=1, metavar="N",
                      help="unprofiled steps first, so one-time costs stay out (default 1)")
    prof.add_argument("--threads", type=int, default=None, metavar="N",
                      help="torch.set_num_threads(N) first (default: torch's choice)")
    prof.add_argument("--record-shapes", action="store_true", help="record op input shapes in the trace")
    prof.add_argument("--with-stack", action="store_true", help="record Python stacks in the trace (slower)")
    prof.add_argument("--output", metavar="DIR", default=".",
                      help="where trace.json and profile.json go (default: the current directory)")
    add_config_flags(parser, field_defaults(PROFILE_DEFAULTS))


def run(args: argparse.Namespace) -> int:
    """Run ``pyppo profile`` with parsed ``args``; returns the exit status."""
    import pyppo
    from pyppo import _C
    from pyppo.builder import build_trainer
    from pyppo.cli import config_flag_values, make_config

    if args.warmup_steps < 0:
        raise ValueError("--warmup-steps must be >= 0")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    flags = config_flag_values(args)
    settings = {**PROFILE_DEFAULTS, **flags, "steps": args.warmup_steps + 1}
    if "mini_batch_size" not in flags:  # one minibatch: the whole profiled batch
        settings["mini_batch_size"] = settings["batch_size"]
    config = make_config(settings)
    output = Path(args.output).expanduser()

    trainer = build_trainer(config, model=args.model, reward=args.reward, prompts=args.prompts,
                            before_loading=lambda: print(f"pyppo profile: loading {args.model} ...", file=sys.stderr))
    print(f"pyppo profile: {args.warmup_steps} warm-up step(s), then one profiled step ...", file=sys.stderr)
    table = profile_step(trainer, output, warmup_steps=args.warmup_steps,
                         record_shapes=args.record_shapes, with_stack=args.with_stack)

    device = trainer.device
    env = {
        "pyppo": getattr(pyppo, "__version__", "unknown"),
        "torch": torch.__version__,
        "device": str(device) if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": _C.cpu_capability(),
    }
    header = (f"pyppo profile: {args.model} on {env['device']}, {env['torch_threads']} threads "
              f"({env['cpu_capability']}); batch {config.batch_size}, mini-batch {config.mini_batch_size}, "
              f"{config.ppo_epochs} epoch(s), max {config.max_new_tokens} new tokens "
              f"(mean response {table['metrics'].get('response_length_mean', float('nan')):.1f})")
    result = {
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "model": args.model,
        "reward": args.reward,
        "config": config.to_dict(),
        "warmup_steps": args.warmup_steps,
        "env": env,
        "trace": "trace.json",
        **table,
    }
    (output / "profile.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(format_table(table, header))
    print()
    print(f"wrote {output / 'trace.json'} and {output / 'profile.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pyppo profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
