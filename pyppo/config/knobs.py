"""The knob machinery of :class:`~pyppo.config.PPOConfig`: the option tuples of its
string-valued knobs, the checks a field's value must pass (:class:`Check` and the constructors
:func:`integer`, :func:`number`, :func:`boolean`, :func:`one_of`, :func:`device_name`,
:func:`module_names`, :func:`names_from`), and :func:`knob` / :func:`group`, which declare a field and the group it is
listed under, storing a :class:`Knob` in its metadata.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

__all__ = [
    "DTYPES",
    "ROLLOUT_ENGINES",
    "ADVANTAGE_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "TRACKERS",
    "TRACKER_MODULES",
    "installed_trackers",
    "RESUME_RULES",
    "Check",
    "integer",
    "number",
    "boolean",
    "one_of",
    "device_name",
    "module_names",
    "names_from",
    "Knob",
    "group",
    "knob",
]

#: ``PPOConfig.dtype`` values: ``auto`` is bfloat16 where the device computes it natively, else
#: float32 (:func:`pyppo.precision.resolve_dtype`).
DTYPES = ("auto", "float32", "bfloat16")

#: ``PPOConfig.rollout_engine`` values (:func:`pyppo.rollout.make_engine`).
ROLLOUT_ENGINES = ("transformers", "vllm")

#: ``PPOConfig.advantage_estimator`` values (:data:`pyppo.trainer.advantages.ADVANTAGE_ESTIMATORS`):
#: ``gae`` and ``gae_turn`` train a value model, the others are critic-free.
ADVANTAGE_ESTIMATORS = ("gae", "gae_turn", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")

#: The critic-free estimators whose baseline is the mean of a prompt's group of responses.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")

#: ``PPOConfig.rollout_correction`` values (:mod:`pyppo.trainer.rollout_correction`).
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

#: ``PPOConfig.report_to`` values: the experiment trackers a run can log to (:mod:`pyppo.run.trackers`).
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")

#: The modules each tracker needs (``pip install 'pyppo[<tracker>]'`` installs them): MLflow's
#: tables are written with pandas.
TRACKER_MODULES: Dict[str, Tuple[str, ...]] = {
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "trackio": ("trackio",),
    "mlflow": ("mlflow", "pandas"),
}


def installed_trackers() -> Tuple[str, ...]:
    """The trackers whose modules are all installed (``importlib.util.find_spec``: nothing is
    imported), in :data:`TRACKERS`' order: what ``report_to = "all"`` means."""
    return tuple(name for name in TRACKERS if all(_findable(m) for m in TRACKER_MODULES[name]))


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails, a module whose __spec__ is unset
        return False


#: ``resume=`` of :func:`knob`: a ``fixed`` setting shapes the trajectory a checkpoint continues,
#: so a resume that changes it is refused; a ``free`` one (the run's length, its cadences, where
#: and how the same computation runs) a resume may change.
RESUME_RULES = ("fixed", "free")


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy ints too


def _is_num(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Check:
    """A field's check: ``ok(value)``; ``expected`` completes "<key> must be ..."; ``kind`` (``int``,
    ``float``, ``bool``, ``str``, ``list``) is the type a valid value is normalised to and a flag
    parses (``list``: a tuple of strings, without repeats; its flag takes several words)."""

    kind: str
    ok: Callable[[Any], bool]
    expected: str
    metavar: str = ""

    def normalize(self, v: Any) -> Any:
        # A list becomes a tuple: a dataclass default cannot be a list, and a config stays hashable.
        return {"int": int, "float": float, "list": lambda x: tuple(dict.fromkeys(x))}.get(self.kind, lambda x: x)(v)


def integer(lo: int, hi: Optional[int] = None) -> Check:
    """An int ``>= lo`` (and ``< hi``)."""
    rng = f">= {lo}" if hi is None else f"in [{lo}, {'2**63' if hi == 2**63 else hi})"
    return Check("int", lambda v: _is_int(v) and v >= lo and (hi is None or v < hi), f"an int {rng}", "N")


def number(lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A finite number in ``[lo, hi]``, each end open when asked."""

    def ok(v: Any) -> bool:
        return _is_num(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    if hi == math.inf:
        where = f"{'>' if lo_open else '>='} {lo}"
    else:
        where = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    return Check("float", ok, f"a finite number {where}", "X")


def boolean() -> Check:
    return Check("bool", lambda v: isinstance(v, bool), "a bool")


def one_of(options: Sequence[str]) -> Check:
    return Check(
        "str", lambda v: isinstance(v, str) and v in options, f"one of {tuple(options)}", "{" + ",".join(options) + "}"
    )


def _is_device(v: Any) -> bool:
    import torch

    if not isinstance(v, str) or not v:
        return False
    if v == "auto":
        return True
    try:
        return torch.device(v).type in ("cpu", "cuda")
    except (RuntimeError, ValueError):
        return False


def device_name() -> Check:
    return Check("str", _is_device, "'auto', 'cpu', 'cuda' or 'cuda:N'", "DEVICE")


def _is_module_list(v: Any) -> bool:
    if not isinstance(v, str) or not v.strip():
        return False
    return v == "all-linear" or all(name.strip().replace("_", "").replace(".", "").isalnum() for name in v.split(","))


def module_names() -> Check:
    return Check("str", _is_module_list, "'all-linear' or comma-separated module names (e.g. 'q_proj,v_proj')", "NAMES")


def names_from(options: Sequence[str]) -> Check:
    """A list (or tuple) of names, each one of ``options``; empty is allowed."""
    return Check(
        "list",
        lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) and x in options for x in v),
        f"a list of names from {tuple(options)} (empty: none)",
        "{" + ",".join(options) + "}",
    )


@dataclass(frozen=True)
class Knob:
    """What :func:`knob` stores in a field's metadata."""

    help: str
    check: Check
    group: str
    optional: bool  # None is allowed (and means what the help says)
    resume: str  # one of RESUME_RULES
    always_acts: bool  # True: no rule of NEEDS, the knob acts whatever the others say

    def validate(self, key: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if not self.check.ok(value):
            raise ValueError(f"{key} must be {self.expected()}, got {value!r}")
        return self.check.normalize(value)

    def expected(self) -> str:
        return self.check.expected + (" or None" if self.optional else "")


_group = ""  # what `knob` lists a field under: the last `group(...)` of PPOConfig's body


def group(name: str) -> None:
    """In :class:`PPOConfig`'s body: the knobs declared after it, up to the next ``group``, are
    listed under ``name``."""
    global _group
    _group = name


def knob(
    default: Any, check: Check, *, resume: str, help: str, always_acts: bool = False, optional: bool = False
) -> Any:
    """A config field: ``default``, its ``check``, whether a resume may change it (``resume``, one
    of :data:`RESUME_RULES`), a one-line ``help`` and whether it acts alone (``always_acts``;
    otherwise a rule of :data:`NEEDS` names it). It is listed under the last :func:`group`.

    Raises:
        ValueError: ``resume`` is not one of :data:`RESUME_RULES`, or no group is set.
    """
    if resume not in RESUME_RULES:
        raise ValueError(f"resume must be one of {RESUME_RULES}, got {resume!r}")
    if not _group:
        raise ValueError("knob(...) declared before any group(...)")
    return dataclasses.field(
        default=default, metadata={"knob": Knob(help, check, _group, optional, resume, always_acts)}
    )


# How the docs' key table and a resume's message show a knob's value.
def _default_text(value: Any) -> str:
    if isinstance(value, tuple):  # a list knob, shown as TOML and a flag's words give it
        return repr(list(value))
    return "None" if value is None else repr(value)
