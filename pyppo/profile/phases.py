"""The phase table of a profiled step: wall seconds per phase (the trainer's own timer), the
share of each spent inside pyppo's ops (profiler events named ``pyppo::*``, overlaps counted once),
and its printed form with the FLOP columns of :mod:`pyppo.profile.counting`."""

from __future__ import annotations

from typing import List, Optional

from ..trainer.step_stats import PHASES
from .flops import significant as _sig

__all__ = ["FLOP_COLUMNS", "PHASE_TITLES", "format_table", "phase_table"]

#: trainer phase key -> the name shown in the table
PHASE_TITLES = {
    "weight_sync": "weight sync",
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
    ranges: dict[str, list] = {p: [] for p in PHASES}
    op_events = []
    for e in events:
        name = e.name
        if name.startswith("pyppo/"):
            phase = name[len("pyppo/") :]
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
        if f"time_{phase}" not in metrics and not ranges[phase]:
            continue  # a phase this step does not have (value_forward without a value model)
        merged = _merge(ranges[phase])
        prof_s = sum(b - a for a, b in merged) * 1e-6
        seconds = float(metrics.get(f"time_{phase}", prof_s))
        pyppo_s = _overlap(merged, op_spans) * 1e-6
        device_s = (
            sum(
                float(getattr(e, "device_time_total", 0.0) or 0.0)
                for e in op_events
                if any(a <= e.time_range.start <= b for a, b in merged)
            )
            * 1e-6
        )
        rows.append(
            {
                "phase": phase,
                "title": PHASE_TITLES.get(phase, phase),
                "seconds": seconds,
                "share_of_step": seconds / step_s if step_s > 0 else None,
                "profiler_seconds": prof_s,
                "pyppo_seconds": pyppo_s,
                "pyppo_share": pyppo_s / prof_s if prof_s > 0 else 0.0,
                "pyppo_device_seconds": device_s,
            }
        )
    phase_total = sum(r["seconds"] for r in rows)
    return {
        "phases": rows,
        "other_seconds": max(0.0, step_s - phase_total),
        "step_seconds": step_s,
        "pyppo_seconds": sum(b - a for a, b in op_spans) * 1e-6,
        "pyppo_ops": sorted(by_name.values(), key=lambda r: -r["seconds"]),
    }


#: The FLOP columns of the table; "shape MFU %" is the headline MFU (:func:`_flop_notes`).
FLOP_COLUMNS = ("GFLOP", "GFLOP/s", "ideal ms", "shape MFU %", "square MFU %", "tokens", "pad", "tokens/s")


def _percent(x: Optional[float]) -> str:
    return _sig(None if x is None else 100 * x)


def _flop_cells(r: dict) -> tuple:
    """The :data:`FLOP_COLUMNS` cells of a row (a phase's or the step's)."""
    if r.get("tokens") is None:  # no model work in it
        return ("-",) * len(FLOP_COLUMNS)
    if r.get("flops") is None:  # a model whose config is not understood
        flops = ("n/a",) * 5
    else:
        flops = (
            _sig(r["flops"] / 1e9),
            _sig(r["flops_per_s"] / 1e9 if r["flops_per_s"] else None),
            _sig(None if r.get("ideal_seconds") is None else 1e3 * r["ideal_seconds"]),
            _percent(r.get("mfu")),
            _percent(r.get("square_mfu")),
        )
    return flops + (str(r["tokens"]), str(r["padding_tokens"]), _sig(r["tokens_per_s"]))


def _ms(seconds: Optional[float]) -> str:
    return _sig(None if seconds is None else 1e3 * seconds)


def _bytes(n: float) -> str:
    return f"{_sig(n / 1e9)} GB" if n >= 1e9 else f"{_sig(n / 1e6)} MB"


def _peak_notes(info: dict) -> List[str]:
    """The MFU, HFU, peak, product and floor lines below the table."""
    peak, step = info["peak"], info["step"]
    if not peak:
        return ["peak: not measured (--peak-size 0), so no MFU and no floors"]
    rates = [s["flops_per_s"] for s in peak["shapes"]]
    spread = f", {_sig(min(rates) / 1e9)} to {_sig(max(rates) / 1e9)} GFLOP/s" if rates else ""
    lines = [
        "shape MFU % = ideal ms / ms, PaLM's model FLOPs utilization (Chowdhery et al. 2022, appendix B) "
        "with the peak taken at each product's own shape: ideal ms = the sum over the phase's matrix products "
        "(q/k/v/o projections, MLP, LoRA adapters, heads; attention's scores and weighted values as torch.bmm "
        "over batch x heads, timed at the full q_len x kv_len; backward: each product's input- and "
        "weight-gradient products) of its FLOPs / torch.mm's FLOP/s at that [m x k] x [k x n] shape in "
        f"{peak['dtype']} on {peak['device']}, {peak['threads']} thread(s), measured after the step "
        f"({len(rates)} distinct shapes{spread}). square MFU % = GFLOP/s / the square peak."
    ]
    if step["recompute_flops"]:
        what = "gradient checkpointing's second forward, " if info["gradient_checkpointing"] else ""
        lines.append(
            f"The step's backwards also recompute {_sig(step['recompute_flops'] / 1e9)} GFLOP ({what}the scores "
            "of the attention kernel, the logits of linear_logprobs), not in the MFU: hardware FLOPs utilization "
            f"{_percent(step['hfu'])} % at the shapes, {_percent(step['square_hfu'])} % of the square peak."
        )
    others = [f"{k} {_sig(v / 1e9)}" for k, v in peak["by_dtype"].items() if k != peak["dtype"]]
    lines.append(
        f"square peak: torch.mm {peak['size']}x{peak['size']} {peak['dtype']}: {_sig(peak['flops_per_s'] / 1e9)} "
        f"GFLOP/s" + (f" ({', '.join(others)})" if others else "") + ", the higher of before and after the step."
    )
    if info["slowest_products"]:
        lines.append(
            "most of the step's ideal time: "
            + ", ".join(
                f"[{s['m']}x{s['k']}]x[{s['k']}x{s['n']}]" + (f" x {s['batch']}" if s["batch"] > 1 else "") + " "
                f"{_sig(s['flops'] / 1e9)} GFLOP at {_sig(s['flops_per_s'] / 1e9)} GFLOP/s "
                f"({_ms(s['ideal_seconds'])} ms)"
                for s in info["slowest_products"]
            )
        )
    gen = info["floors"].get("generate")
    if gen and gen["bytes"]:
        read, bw = gen["bytes"], gen["bandwidth_bytes_per_s"]
        line = (
            f"generate floors: compute {_ms(gen['compute_floor_seconds'])} ms (its ideal ms); bytes "
            f"{_ms(gen['byte_floor_seconds'])} ms: {read['forwards']} forwards read {_bytes(read['total'])} "
            f"(linear weights {_bytes(read['weights_per_forward'])} a forward in {peak['dtype']}, "
            f"{read['element_size']} bytes a weight; KV cache "
            f"{_bytes(read['kv_cache'])} in all) at {_sig(bw / 1e9)} GB/s ({peak['bandwidth']['method']}). "
            f"The phase took {_sig(gen['time_over_compute_floor'])}x its compute floor and "
            f"{_sig(gen['time_over_byte_floor'])}x its byte floor: "
            + ("compute-bound (its compute floor is the higher)." if gen["bound"] == "compute" else "")
            + ("memory-bound (its byte floor is the higher)." if gen["bound"] == "memory" else "")
        )
        lines.append(line)
    secs = peak["seconds"]
    lines.append(
        f"measured after the step in {_sig(sum(secs.values()))} s: square peak {_sig(secs['square'])} s, "
        f"{len(rates)} shapes {_sig(secs['shapes'])} s (at most {peak['shape_max_seconds']} s each), "
        f"bandwidth {_sig(secs['bandwidth'])} s."
    )
    return lines


def _flop_notes(table: dict) -> List[str]:
    info = table["flops"]
    rows = {r["phase"]: r for r in table["phases"]}
    lines = list(info["notes"])
    described = "; ".join(f"{name}: {d}" for name, d in info["models"].items() if d)
    if described:
        lines.append(
            f"FLOPs: model FLOPs (matmuls; forward + backward) from each model's config ({described}) "
            "and the shapes it was fed in this step (forward hooks); causal attention; "
            "backward 2x the forward for trained weights, 1x for frozen ones (pyppo.profile.flops)."
        )
    lines += _peak_notes(info)
    gen = rows.get("generate", {})
    if gen.get("tokens") is not None:
        lines.append(
            f"tokens: generate = tokens sampled, B x T (pad: sampled after the row's EOS), after a prefill of "
            f"{gen['prefill_tokens']} prompt positions ({gen['prefill_padding_tokens']} padding) and "
            f"{gen['decode_forwards']} decode forwards; a forward = positions fed, B x (P + T) (pad: padding "
            f"positions); update = those x {info['ppo_epochs']} epoch(s), through the policy and the value model "
            "(if any) each; step = tokens sampled per step second."
        )
    lines.append("score and advantages: no model FLOPs (the reward function's own model is not counted).")
    return lines


def format_table(table: dict, header: str = "") -> str:
    with_flops = "flops" in table
    cols = ("phase", "ms", "% of step", "pyppo ops ms", "pyppo % of phase")
    if with_flops:
        cols += FLOP_COLUMNS
    extra = _flop_cells if with_flops else (lambda r: ())
    body = []
    for r in table["phases"]:
        share = "-" if r["share_of_step"] is None else f"{100 * r['share_of_step']:.1f}"
        body.append(
            (
                r["title"],
                f"{1e3 * r['seconds']:.2f}",
                share,
                f"{1e3 * r['pyppo_seconds']:.3f}",
                f"{100 * r['pyppo_share']:.1f}",
            )
            + extra(r)
        )
    step = table["step_seconds"]
    body.append(
        (
            "(outside phases)",
            f"{1e3 * table['other_seconds']:.2f}",
            f"{100 * table['other_seconds'] / step:.1f}" if step > 0 else "-",
            "",
            "",
        )
        + (("",) * len(FLOP_COLUMNS) if with_flops else ())
    )
    body.append(
        (
            "step",
            f"{1e3 * step:.2f}",
            "100.0",
            f"{1e3 * table['pyppo_seconds']:.3f}",
            f"{100 * table['pyppo_seconds'] / step:.1f}" if step > 0 else "-",
        )
        + (extra(table["flops"]["step"]) if with_flops else ())
    )
    widths = [max(len(c), *(len(row[i]) for row in body)) for i, c in enumerate(cols)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [header] if header else []
    lines += [fmt(cols), fmt(["-" * w for w in widths])]
    lines += [fmt(row) for row in body[:-2]]
    lines.append(fmt(["-" * w for w in widths]))
    lines += [fmt(row) for row in body[-2:]]
    if with_flops:
        lines.append("")
        lines += _flop_notes(table)
    if table["pyppo_ops"]:
        lines.append("")
        lines.append(
            "pyppo ops: "
            + ", ".join(
                f"{r['name'][len('pyppo::') :]} {r['calls']}x {1e3 * r['seconds']:.2f} ms" for r in table["pyppo_ops"]
            )
        )
    return "\n".join(lines)
