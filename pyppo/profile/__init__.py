"""Where a PPO step's time and FLOPs go: the phase table (:mod:`.phases`), the analytic FLOP
count of a transformer and the matmul peak (:mod:`.flops`), the floors a phase is held to: its
products at their shapes' measured rates and the bytes sampling reads (:mod:`.floors`), and the
counting of one profiled step's model work (:mod:`.counting`). ``pyppo profile`` is the command
(:mod:`pyppo.cli.profile`).

The names below load their modules on first use: :mod:`.flops` and :mod:`.floors` import torch
only, so that ``pyppo info`` measures the matmul peak without importing the trainer (nor numpy,
which it runs without)."""

__all__ = ["PHASE_TITLES", "format_table", "phase_table", "profile_step"]


def __getattr__(name: str):
    if name in ("PHASE_TITLES", "format_table", "phase_table"):
        from . import phases

        return getattr(phases, name)
    if name == "profile_step":
        from .counting import profile_step

        return profile_step
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
