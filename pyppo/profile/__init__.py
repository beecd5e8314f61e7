"""Where a PPO step's time and FLOPs go: the phase table (:mod:`.phases`), the analytic FLOP
count of a transformer (:mod:`.flops`) and the counting of one profiled step's model work
(:mod:`.counting`). ``pyppo profile`` is the command (:mod:`pyppo.cli.profile`)."""

from .counting import profile_step
from .phases import PHASE_TITLES, format_table, phase_table

__all__ = ["PHASE_TITLES", "format_table", "phase_table", "profile_step"]
