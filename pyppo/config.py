"""``PPOConfig``: every knob of the PPO loop, each declared once.

A field is declared with :func:`knob`: its default, its check, whether a resume may change it
(``resume="fixed"`` / ``"free"``: :func:`resume_conflicts`), a one-line help and, for a knob that
acts whatever the other knobs say, ``always_acts=True``; the :func:`group` call above it names the
group it is listed under (the component that reads it). A knob that acts only together with others
has a rule in :data:`NEEDS` instead: set away from its default where its rule does not hold, it
would act on nothing, and the config refuses it (or warns, for a rule that turns on what the
config does not know, such as the number of processes). Validation loops over that metadata and
that table, ``pyppo train`` builds one flag per field from it, and the key table of
``docs/trainer.md`` is generated from both (:func:`config_markdown`; a test fails when the file is
stale). Regenerate the table with ``python -m pyppo.config``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .ops.kl import KL_ESTIMATORS
from .ops.losses import LOSS_AGG_MODES
from .ops.policy_losses import POLICY_LOSSES

#: ``PPOConfig.dtype`` values: ``auto`` is bfloat16 where the device computes it natively, else
#: float32 (:func:`pyppo.precision.resolve_dtype`).
DTYPES = ("auto", "float32", "bfloat16")

#: ``PPOConfig.rollout_engine`` values (:func:`pyppo.rollout.make_engine`).
ROLLOUT_ENGINES = ("transformers", "vllm")

#: ``PPOConfig.advantage_estimator`` values (:data:`pyppo.trainer.advantages.ADVANTAGE_ESTIMATORS`):
#: ``gae`` trains a value model, the others are critic-free.
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")

#: The critic-free estimators whose baseline is the mean of a prompt's group of responses.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")

#: ``PPOConfig.rollout_correction`` values (:mod:`pyppo.trainer.rollout_correction`).
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

#: ``resume=`` of :func:`knob`: a ``fixed`` setting shapes the trajectory a checkpoint continues,
#: so a resume that changes it is refused; a ``free`` one (the run's length, its cadences, where
#: and how the same computation runs) a resume may change.
RESUME_RULES = ("fixed", "free")

__all__ = [
    "PPOConfig",
    "Check",
    "Knob",
    "knob",
    "group",
    "config_knobs",
    "config_markdown",
    "Needs",
    "NEEDS",
    "InertSettings",
    "inert_settings",
    "RESUME_RULES",
    "ResumeChange",
    "resume_conflicts",
]


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
    ``float``, ``bool``, ``str``) is the type a valid value is normalised to and a flag parses."""

    kind: str
    ok: Callable[[Any], bool]
    expected: str
    metavar: str = ""

    def normalize(self, v: Any) -> Any:
        return {"int": int, "float": float}.get(self.kind, lambda x: x)(v)


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


# ---------------------------------------------------------------------------------------------
# what acts only with what
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Needs:
    """One rule of :data:`NEEDS`: its ``knobs`` act only where ``holds(settings, world_size)``.

    A knob breaks the rule when it is set away from its field default where the rule does not
    hold. So a knob whose default is ``"auto"`` (a value resolved from other knobs) breaks it only
    once it names a value: ``auto`` always means "what acts here". ``holds`` reads fields only,
    not derived properties, so that :meth:`PPOConfig.with_changes` can ask it of settings that are
    not a valid config yet.

    Attributes:
        knobs: the field names the rule is about.
        when: the condition, as the docs' table shows it (``"lora_rank > 0"``).
        needs: completes "<knob> has no effect here: it needs ..."; ``str.format``-ed with the
            settings as ``c`` and the number of processes as ``world``.
        holds: ``(settings, world_size) -> bool``; ``world_size`` is ``None`` unless ``world``.
        world: the rule turns on the number of processes, which only
            :meth:`PPOConfig.check_world_size` knows: it is checked there.
        warn: a broken rule is a ``UserWarning``, not a ``ValueError``: for a rule whose outcome
            turns on what the config does not know (a single process may still be a test of a
            setting meant for several).
    """

    knobs: Tuple[str, ...]
    when: str
    needs: str
    holds: Callable[[Any, Optional[int]], bool]
    world: bool = False
    warn: bool = False


_VALUE_MODEL = ("value_lr", "vf_coef", "cliprange_value", "lam", "value_lora")
_LORA = ("lora_alpha", "lora_target_modules", "value_lora", "merge_lora")

#: Every knob that acts only together with others, and what it needs. A knob that no rule names
#: is marked ``always_acts`` in its :func:`knob` (a test keeps the two complete).
NEEDS: Tuple[Needs, ...] = (
    Needs(
        _VALUE_MODEL,
        "advantage_estimator = 'gae'",
        "a value model (advantage_estimator = 'gae'; {c.advantage_estimator!r} trains none)",
        lambda c, n: c.advantage_estimator == "gae",
    ),
    Needs(
        ("gamma",),
        "advantage_estimator 'gae' or 'reinforce_pp'",
        "token returns (advantage_estimator 'gae' or 'reinforce_pp', not {c.advantage_estimator!r})",
        lambda c, n: c.advantage_estimator in ("gae", "reinforce_pp"),
    ),
    Needs(
        ("whiten_advantages",),
        "advantage_estimator other than 'grpo' and 'rloo'",
        "a batch-whitened estimator ({c.advantage_estimator!r} normalises within each group)",
        lambda c, n: c.advantage_estimator not in ("grpo", "rloo"),
    ),
    Needs(
        ("grpo_std_normalize",),
        "advantage_estimator = 'grpo'",
        "advantage_estimator = 'grpo', not {c.advantage_estimator!r}",
        lambda c, n: c.advantage_estimator == "grpo",
    ),
    Needs(
        ("dual_clip",),
        "policy_loss = 'ppo'",
        "policy_loss = 'ppo', not {c.policy_loss!r}",
        lambda c, n: c.policy_loss == "ppo",
    ),
    Needs(
        ("loss_agg_norm",),
        "loss_agg = 'seq-mean-token-sum-norm'",
        "loss_agg = 'seq-mean-token-sum-norm' (the one mode that divides by it), not {c.loss_agg!r}",
        lambda c, n: c.loss_agg == "seq-mean-token-sum-norm",
    ),
    # Without the hidden-state path there is no fused op to call: both settings take the log-probs' path.
    Needs(
        ("fused_policy_loss",),
        "logprobs_from_hidden = true",
        "logprobs_from_hidden = true (the fused loss is a step of the hidden-state path)",
        lambda c, n: c.logprobs_from_hidden,
    ),
    Needs(
        ("target_kl",),
        "kl_coef > 0",
        "kl_coef > 0 (the adaptive update is multiplicative: a coefficient of 0 never moves)",
        lambda c, n: c.kl_coef > 0,
    ),
    Needs(
        ("kl_horizon",),
        "target_kl set",
        "target_kl (the horizon is the adaptive controller's; without a target, kl_coef is fixed)",
        lambda c, n: c.target_kl is not None,
    ),
    Needs(
        ("kl_loss_estimator",),
        "kl_loss_coef > 0",
        "kl_loss_coef > 0 (without it the loss has no KL term)",
        lambda c, n: c.kl_loss_coef > 0,
    ),
    Needs(
        ("filter_groups",),
        "samples_per_prompt >= 2",
        "samples_per_prompt >= 2, got {c.samples_per_prompt} (it drops groups whose responses all scored the same)",
        lambda c, n: c.samples_per_prompt >= 2,
    ),
    Needs(("filter_groups_max_tries",), "filter_groups = true", "filter_groups = true", lambda c, n: c.filter_groups),
    Needs(("overlong_penalty",), "overlong_buffer > 0", "overlong_buffer > 0", lambda c, n: c.overlong_buffer > 0),
    Needs(_LORA, "lora_rank > 0", "lora_rank > 0 (LoRA is off)", lambda c, n: c.lora_rank > 0),
    # The transformers engine samples with the trainer's own forward: it returns no log-probs of
    # its own for the correction to weigh against.
    Needs(
        ("rollout_correction",),
        "rollout_engine = 'vllm'",
        "rollout_engine = 'vllm' (an engine that samples with numerics of its own and returns its log-probs), "
        "not {c.rollout_engine!r}",
        lambda c, n: c.rollout_engine == "vllm",
    ),
    Needs(
        ("rollout_is_cap",),
        "rollout_correction other than 'none'",
        "rollout_correction other than 'none'",
        lambda c, n: c.rollout_correction != "none",
    ),
    Needs(
        ("vllm_kv_cache_gib", "vllm_gpu_memory_utilization"),
        "rollout_engine = 'vllm'",
        "rollout_engine = 'vllm', not {c.rollout_engine!r}",
        lambda c, n: c.rollout_engine == "vllm",
    ),
    Needs(
        ("fsdp",),
        "several processes",
        "several processes, and this run has {world} (it shards over torchrun's processes: --nproc N or "
        "torchrun --nproc-per-node N)",
        lambda c, n: n > 1,
        world=True,
        warn=True,
    ),
)


class InertSettings(ValueError):
    """Settings that act on nothing where they are (:data:`NEEDS`).

    Attributes:
        groups: ``[(what they need, [(key, value), ...]), ...]``, one entry per broken rule.
    """

    def __init__(self, groups: List[Tuple[str, List[Tuple[str, Any]]]]):
        self.groups = groups
        super().__init__(self.describe())

    def describe(self, name: Callable[[str, Any], str] = lambda key, value: f"{key} = {value!r}") -> str:
        """The message, each setting shown as ``name(key, value)`` (the command line names its flags)."""
        parts = []
        for needs, settings in self.groups:
            shown = [name(key, value) for key, value in settings]
            one = len(shown) == 1
            listed = shown[0] if one else ", ".join(shown[:-1]) + " and " + shown[-1]
            parts.append(
                f"{listed} {'has' if one else 'have'} no effect here: {'it needs' if one else 'they need'} {needs}"
            )
        return "; ".join(parts)


def inert_settings(
    c: Any, world_size: Optional[int] = None, *, warn: bool = False
) -> List[Tuple[str, List[Tuple[str, Any]]]]:
    """The knobs of ``c`` (a config, or any object with its fields) set away from their defaults
    where their rule of :data:`NEEDS` does not hold, as :attr:`InertSettings.groups` (empty: none).

    Args:
        world_size: check the rules that turn on the number of processes (only those).
        warn: check the rules that warn (only those), not the ones that refuse.
    """
    defaults, groups = _field_defaults(), []
    for rule in NEEDS:
        if rule.warn != warn or rule.world != (world_size is not None) or rule.holds(c, world_size):
            continue
        names = [name for name in rule.knobs if getattr(c, name) != defaults[name]]
        if names:
            groups.append((rule.needs.format(c=c, world=world_size), [(name, getattr(c, name)) for name in names]))
    return groups


def _field_defaults() -> Dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(PPOConfig)}


# ---------------------------------------------------------------------------------------------
# the config
# ---------------------------------------------------------------------------------------------
@dataclass
class PPOConfig:
    """Every knob of the PPO loop (see ``docs/trainer.md`` for the loop and the key table).

    Each field's default, help, check, group and resume rule are declared once, below; what a
    knob needs to act is :data:`NEEDS`. Construction validates every field and the cross-field
    rules, and warns (``UserWarning``) where a group-baseline estimator gets its KL only through
    the reward (``kl_coef > 0``, ``kl_loss_coef == 0``).

    Raises:
        ValueError: an invalid value (the message starts with the key); :class:`InertSettings`
            (a ``ValueError``) for knobs set where they act on nothing, naming each and what it needs.
    """

    # A table, one knob a row: the formatter would spread each call over a line per argument.
    # fmt: off
    group("sizes")  # counts of sequences
    steps: int = knob(100, integer(1), resume="free", always_acts=True, help="PPO steps (rollout + update) to run")
    batch_size: int = knob(16, integer(1), resume="fixed", always_acts=True,
        help="responses (sequences) sampled per step: batch_size / samples_per_prompt prompts, "
             "samples_per_prompt responses to each")
    samples_per_prompt: int = knob(1, integer(1), resume="fixed", always_acts=True,
        help="responses sampled per prompt, a group (the group-relative estimators' baseline); must divide "
             "batch_size and each process's share of it")
    mini_batch_size: int = knob(8, integer(1), resume="fixed", always_acts=True,
        help="sequences per optimizer step; must divide batch_size")
    # Free: the same gradient, accumulated in other slices (what a resume after running out of
    # memory changes).
    micro_batch_size: Optional[int] = knob(None, integer(1), resume="free", always_acts=True, optional=True,
        help="sequences per forward/backward (gradient accumulation; also the rollout forward size); "
             "must divide mini_batch_size; None = mini_batch_size")
    ppo_epochs: int = knob(4, integer(1), resume="fixed", always_acts=True, help="passes over the batch per step")

    group("sampling")  # the rollout engine
    max_new_tokens: int = knob(48, integer(1), resume="fixed", always_acts=True,
        help="response length limit, in tokens")
    max_prompt_length: Optional[int] = knob(None, integer(1), resume="fixed", always_acts=True, optional=True,
        help="prompts longer than this many tokens are cut from the left; None = only what the model's "
             "context cannot hold (see truncate_prompts)")
    truncate_prompts: bool = knob(True, boolean(), resume="fixed", always_acts=True,
        help="a prompt longer than the room the model's context leaves (its positions minus "
             "max_new_tokens) is cut from the left, with a warning naming it; false = that is an error")
    temperature: float = knob(1.0, number(0.0, lo_open=True), resume="fixed", always_acts=True,
        help="sampling temperature; the ratio and KL use the same softmax(z / temperature)")
    top_k: int = knob(0, integer(0), resume="fixed", always_acts=True,
        help="top-k filter of sampling (0 = off); anything else samples from a distribution the "
             "log-probs do not describe (off-policy)")
    top_p: float = knob(1.0, number(0.0, 1.0, lo_open=True), resume="fixed", always_acts=True,
        help="nucleus filter of sampling (1.0 = off); below 1 is off-policy like top_k")
    use_chat_template: bool = knob(True, boolean(), resume="fixed", always_acts=True,
        help="format prompts with the tokenizer's chat template when it has one")
    rollout_engine: str = knob("transformers", one_of(ROLLOUT_ENGINES), resume="fixed", always_acts=True,
        help="what samples the rollouts: 'transformers' (the policy itself, through generate) or "
             "'vllm' (an in-process vLLM copy of the policy, synced after every update; pip install pyppo[vllm]); "
             'old_logprobs are the trainer\'s own either way (docs/trainer.md, "Rollout engines")')

    group("agents")  # multi-turn episodes with an environment (docs/agents.md)
    max_turns: int = knob(4, integer(1), resume="fixed", always_acts=True,
        help="with an environment (pyppo train --env): agent turns per episode at most; max_new_tokens is per turn")
    max_episode_tokens: Optional[int] = knob(None, integer(2), resume="fixed", always_acts=True, optional=True,
        help="with an environment: the context an episode may reach (prompt, turns and replies), in tokens; "
             "None = the model's context")

    group("vLLM engine")
    vllm_kv_cache_gib: float = knob(1.0, number(0.0, lo_open=True), resume="free",
        help="rollout_engine 'vllm' on a CPU: the KV cache it reserves, GiB")
    vllm_gpu_memory_utilization: float = knob(0.3, number(0.0, 1.0, lo_open=True), resume="free",
        help="rollout_engine 'vllm' on CUDA: the fraction of the GPU's memory vLLM may take (weights and KV "
             "cache; the trainer's models share the device)")
    rollout_correction: str = knob("none", one_of(ROLLOUT_CORRECTIONS), resume="fixed",
        help="importance weight exp(old_logprobs - rollout_logprobs) on each token's policy loss, for an "
             'engine that samples from other numerics than the trainer\'s (docs/trainer.md, "Sampler mismatch"); '
             "needs an engine that returns rollout_logprobs")
    rollout_is_cap: float = knob(2.0, number(1.0), resume="fixed",
        help="rollout_correction's cap C: *_truncate clamps the weight at C, *_mask zeroes it outside [1/C, C]")

    group("rewards")  # what becomes of a raw score
    score_clip: Optional[float] = knob(None, number(0.0, lo_open=True), resume="fixed", always_acts=True,
        optional=True,
        help="clip raw scores to [-score_clip, score_clip] (before missing_eos_penalty); None = no clip")
    missing_eos_penalty: Optional[float] = knob(None, number(0.0), resume="fixed", always_acts=True, optional=True,
        help="subtracted from the (clipped) score of responses that hit max_new_tokens without EOS")
    overlong_buffer: int = knob(0, integer(0), resume="fixed", always_acts=True,
        help="DAPO overlong shaping: a penalty rising linearly from 0 to overlong_penalty over a response's last "
             "overlong_buffer tokens before max_new_tokens, subtracted from its score; 0 = off")
    overlong_penalty: float = knob(1.0, number(0.0), resume="fixed", help="the overlong penalty at max_new_tokens")

    group("DAPO's rollout rules")  # docs/trainer.md, "DAPO's rollout rules"
    filter_groups: bool = knob(False, boolean(), resume="fixed",
        help="DAPO dynamic sampling: drop groups whose scores are all equal (no signal for a group baseline) "
             "and sample more prompts until the batch is full; needs samples_per_prompt >= 2")
    filter_groups_max_tries: int = knob(4, integer(1), resume="fixed",
        help="filter_groups: rollouts per step at most; a batch still short then is filled with all-equal groups "
             "(logged as filter_groups_filled)")
    mask_truncated: bool = knob(False, boolean(), resume="fixed", always_acts=True,
        help="responses cut at max_new_tokens (no EOS) take no loss; their scores still count in their group's "
             "baseline")

    group("KL")  # the penalty in the reward, its controller, and the KL term of the loss
    kl_coef: float = knob(0.05, number(0.0), resume="fixed", always_acts=True,
        help="KL penalty coefficient beta (initial value with target_kl)")
    target_kl: Optional[float] = knob(None, number(0.0, lo_open=True), resume="fixed", optional=True,
        help="target KL (nats per sequence) of the adaptive controller; None = fixed kl_coef")
    kl_horizon: float = knob(10000.0, number(0.0, lo_open=True), resume="fixed",
        help="adaptive controller horizon, in samples")
    # Always: the logged kl_mean (and the evaluation's KL) use it even where kl_coef is 0.
    kl_estimator: str = knob("k1", one_of(KL_ESTIMATORS), resume="fixed", always_acts=True,
        help="per-token KL estimator (Schulman 2020)")
    kl_loss_coef: float = knob(0.0, number(0.0), resume="fixed", always_acts=True,
        help="weight of a KL term in the policy loss (veRL's use_kl_loss): kl_loss_estimator of the policy "
             "against the reference, aggregated like the loss; beside or instead of the KL in the reward (kl_coef)")
    kl_loss_estimator: str = knob("k3", one_of(KL_ESTIMATORS), resume="fixed",
        help="per-token KL estimator of the loss's KL term (k3: unbiased, non-negative, low variance)")

    group("advantages")
    advantage_estimator: str = knob("gae", one_of(ADVANTAGE_ESTIMATORS), resume="fixed", always_acts=True,
        help="gae (actor-critic PPO: trains a value model); critic-free, no value model: grpo, rloo (group "
             "baselines over samples_per_prompt responses), reinforce_pp, reinforce_pp_baseline (REINFORCE++) "
             '(docs/trainer.md, "Advantage estimators")')
    grpo_std_normalize: bool = knob(True, boolean(), resume="fixed",
        help="grpo: divide by the group's standard deviation; false = Dr. GRPO (the mean is subtracted only)")
    gamma: float = knob(1.0, number(0.0, 1.0), resume="fixed", help="discount of GAE and of reinforce_pp's returns")
    lam: float = knob(0.95, number(0.0, 1.0), resume="fixed", help="GAE lambda")
    whiten_advantages: bool = knob(True, boolean(), resume="fixed",
        help="whiten advantages over the whole batch's valid tokens (skipped below 2 valid tokens); gae and "
             "reinforce_pp* only: grpo and rloo are normalised within each group")

    group("policy loss")
    policy_loss: str = knob("ppo", one_of(tuple(POLICY_LOSSES)), resume="fixed", always_acts=True,
        help="ppo (clipped token ratio), gspo (clipped sequence ratio, the geometric mean of its tokens'; GSPO "
             "clips far narrower: cliprange ~3e-4), cispo (clipped, detached importance weight times log-prob) "
             "(docs/ops.md)")
    # Both clip ends act in every policy loss (ppo's and gspo's ratio clip, cispo's weight clip).
    cliprange: float = knob(0.2, number(0.0, 1.0, hi_open=True), resume="fixed", always_acts=True,
        help="PPO clip epsilon (low side, and high side unless cliprange_high)")
    cliprange_high: Optional[float] = knob(None, number(0.0, lo_open=True), resume="fixed", always_acts=True,
        optional=True, help="high-side clip epsilon (DAPO clip-higher); None = cliprange")
    dual_clip: Optional[float] = knob(None, number(1.0, lo_open=True), resume="fixed", optional=True,
        help="dual-clip constant c > 1 bounding the loss of negative advantages (Ye et al. 2020)")
    entropy_coef: float = knob(0.0, number(0.0), resume="fixed", always_acts=True, help="entropy-bonus weight")
    loss_agg: str = knob("token-mean", one_of(LOSS_AGG_MODES), resume="fixed", always_acts=True,
        help="how the per-token losses become one number (docs/ops.md)")
    loss_agg_norm: Optional[float] = knob(None, number(0.0, lo_open=True), resume="fixed", optional=True,
        help="the constant of seq-mean-token-sum-norm; None = max_new_tokens")

    group("value model")  # gae only
    value_lr: Optional[float] = knob(None, number(0.0, lo_open=True), resume="fixed", optional=True,
        help="AdamW learning rate of the value model; None = lr")
    cliprange_value: Optional[float] = knob(0.2, number(0.0, lo_open=True), resume="fixed", optional=True,
        help="value clip epsilon around the rollout's values; None = unclipped")
    vf_coef: float = knob(0.1, number(0.0), resume="fixed", help="value-loss weight")

    group("optimisation")
    lr: float = knob(1e-5, number(0.0, lo_open=True), resume="fixed", always_acts=True,
        help="AdamW learning rate of the policy")
    lr_warmup_steps: int = knob(0, integer(0), resume="fixed", always_acts=True,
        help="optimizer steps over which both learning rates rise linearly to lr and value_lr "
             "(Adam's first step moves every weight by about lr; a warm-up keeps the first PPO steps proximal); "
             "0 = none")
    weight_decay: float = knob(0.0, number(0.0), resume="fixed", always_acts=True,
        help="AdamW weight decay of both models")
    adam_eps: float = knob(1e-8, number(0.0, lo_open=True), resume="fixed", always_acts=True,
        help="AdamW epsilon of both models")
    max_grad_norm: Optional[float] = knob(1.0, number(0.0, lo_open=True), resume="fixed", always_acts=True,
        optional=True, help="clip each model's gradient norm to this; None = no clipping")

    group("implementation")  # how the same update is computed
    fused_policy_loss: bool = knob(True, boolean(), resume="free",
        help="on the hidden-state path, compute the policy loss and its gradient in one pass "
             "(linear_ppo_loss: no recompute in the backward); false = from the log-probs, same result")
    logprobs_from_hidden: bool = knob(True, boolean(), resume="free", always_acts=True,
        help="log-probs from the last hidden states with linear_logprobs (no [B, T, V] logits); "
             "falls back to full logits when the model's head is not a plain linear map")
    # Fixed: dropout changes the function trained, not only how it is computed.
    disable_dropout: bool = knob(True, boolean(), resume="fixed", always_acts=True,
        help="set every dropout of the policy and the value model to 0, so training forwards match the rollout's")

    group("devices and precision")  # and memory (gradient_checkpointing)
    device: str = knob("auto", device_name(), resume="free", always_acts=True,
        help="where the models run: auto = CUDA when available, else CPU")
    dtype: str = knob("auto", one_of(DTYPES), resume="fixed", always_acts=True,
        help="compute dtype of the model forwards: bfloat16 runs them under autocast, with float32 "
             "master weights and optimizer state; auto = bfloat16 on a GPU or CPU that computes it natively "
             "(AVX512_BF16, AMX), else float32 (docs/trainer.md)")
    gradient_checkpointing: bool = knob(False, boolean(), resume="free", always_acts=True,
        help="recompute the policy's and the value model's activations in the backward instead of keeping them")
    # Free: a checkpoint holds full weights and optimizer states, sharded or not.
    fsdp: bool = knob(False, boolean(), resume="free",
        help="with several processes, shard the policy and the value model with FSDP2 instead of replicating "
             "them with DDP")

    group("LoRA")  # what a checkpoint's trained weights are
    lora_rank: int = knob(0, integer(0), resume="fixed", always_acts=True,
        help="train LoRA adapters of this rank instead of every weight (0 = full fine-tuning); the "
             "reference is then the policy with its adapters disabled")
    lora_alpha: float = knob(32.0, number(0.0, lo_open=True), resume="fixed",
        help="LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank")
    lora_target_modules: str = knob("all-linear", module_names(), resume="fixed",
        help="modules that get adapters: 'all-linear' = every linear layer of the blocks (not the LM head)")
    value_lora: bool = knob(False, boolean(), resume="fixed",
        help="with lora_rank > 0: the value model trains LoRA adapters (same rank, alpha, targets) on "
             "its backbone copy, plus its head, instead of every weight")
    # Free: only the form policy/ is written in (pyppo export rewrites it in the other).
    merge_lora: bool = knob(True, boolean(), resume="free",
        help="with lora_rank > 0: policy/ holds the merged model; false = the adapter only")

    group("bookkeeping")
    seed: int = knob(0, integer(0, 2**63), resume="fixed", always_acts=True,
        help="seeds python, numpy, torch, the prompt order and the minibatch shuffles")
    save_every: int = knob(0, integer(0), resume="free", always_acts=True,
        help="write checkpoint/ and policy/ every this many steps (0 = only at the end)")
    log_samples: bool = knob(True, boolean(), resume="free", always_acts=True,
        help="write samples.jsonl (prompt, response, raw score per sample)")
    eval_every: int = knob(0, integer(0), resume="free", always_acts=True,
        help="evaluate on the eval prompts (pyppo train --eval-prompts) every this many steps; with "
             "eval prompts they are also evaluated after the last step")
    max_consecutive_skips: int = knob(3, integer(1), resume="free", always_acts=True,
        help="stop after this many updates in a row with a NaN/inf loss or gradient (each is skipped)")
    # fmt: on

    def __post_init__(self) -> None:
        for name, k in config_knobs():
            setattr(self, name, k.validate(name, getattr(self, name)))
        if self.batch_size % self.samples_per_prompt:
            raise ValueError(
                f"samples_per_prompt ({self.samples_per_prompt}) must divide batch_size "
                f"({self.batch_size}): batch_size counts responses, samples_per_prompt to each prompt"
            )
        if self.batch_size % self.mini_batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must divide batch_size ({self.batch_size})")
        if self.micro_batch_size is not None and self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide mini_batch_size ({self.mini_batch_size})"
            )
        if self.advantage_estimator in GROUP_ESTIMATORS and self.samples_per_prompt < 2:
            raise ValueError(
                f"samples_per_prompt must be >= 2 with advantage_estimator = "
                f"{self.advantage_estimator!r}, got {self.samples_per_prompt}: its baseline is the other "
                "responses to the same prompt"
            )
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) must be <= max_new_tokens ({self.max_new_tokens})"
            )
        broken = inert_settings(self)
        if broken:
            raise InertSettings(broken)
        for warning in inert_settings(self, warn=True):
            warnings.warn(InertSettings([warning]).describe(), UserWarning, stacklevel=3)
        if self.advantage_estimator in GROUP_ESTIMATORS and self.kl_coef > 0 and self.kl_loss_coef == 0:
            # Every token of a response gets its summed reward minus its group's mean: of the KL
            # only its spread between a prompt's responses is left, not a per-token pull.
            warnings.warn(
                f"kl_coef = {self.kl_coef!r} with advantage_estimator = {self.advantage_estimator!r} and "
                "kl_loss_coef = 0: the KL penalty only shapes each response's summed score, and the group "
                "baseline subtracts its mean, so it mostly cancels; for a KL that holds the policy near the "
                "reference set kl_loss_coef > 0 (GRPO's KL term in the loss), or kl_coef = 0 to train "
                "without one",
                UserWarning,
                stacklevel=3,
            )

    # -- (de)serialisation
    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "PPOConfig":
        """Build from a mapping (e.g. a parsed TOML file); missing keys keep their defaults.

        Raises:
            ValueError: unknown keys (all of them named), or an invalid value (naming its key).
        """
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown config key(s): {', '.join(map(str, unknown))}")
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def with_changes(self, **changes: Any) -> "PPOConfig":
        """``dataclasses.replace(self, **changes)``, with every other knob that the change leaves
        acting on nothing (:data:`NEEDS`) put back to its default: e.g. ``rollout_engine =
        "transformers"`` takes the vLLM knobs and the rollout correction with it.

        Raises:
            ValueError: as construction does; :class:`InertSettings` when a knob named in
                ``changes`` acts on nothing.
        """
        settings, defaults = {**self.to_dict(), **changes}, _field_defaults()
        while True:
            inert = [
                key
                for _, pairs in inert_settings(types.SimpleNamespace(**settings))
                for key, _ in pairs
                if key not in changes
            ]
            if not inert:
                return PPOConfig(**settings)
            settings.update({key: defaults[key] for key in inert})

    # -- derived values
    @property
    def effective_cliprange_high(self) -> float:
        return self.cliprange_high if self.cliprange_high is not None else self.cliprange

    @property
    def uses_critic(self) -> bool:
        """Whether the run trains a value model (``gae``); the other estimators are critic-free."""
        return self.advantage_estimator == "gae"

    @property
    def effective_value_lr(self) -> float:
        return self.value_lr if self.value_lr is not None else self.lr

    @property
    def effective_loss_agg_norm(self) -> float:
        return self.loss_agg_norm if self.loss_agg_norm is not None else float(self.max_new_tokens)

    @property
    def torch_dtype(self):
        """The compute dtype as a ``torch.dtype``; ``auto`` resolved for the device ``device``
        names (:func:`pyppo.precision.resolve_dtype`)."""
        import torch

        from .precision import resolve_dtype

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        # What `device = "auto"` places the models on (pyppo.distributed.resolve_device, which also
        # refuses a CUDA device that is missing: here auto then means float32).
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        return getattr(torch, resolve_dtype("auto", torch.device(auto if self.device == "auto" else self.device))[0])

    def check_world_size(self, world_size: int) -> None:
        """The rules of a run over ``world_size`` processes: ``batch_size`` and ``mini_batch_size``
        count sequences over all of them, ``micro_batch_size`` is per process. The rules of
        :data:`NEEDS` that turn on the number of processes are checked here: ``fsdp`` in a single
        process warns (once per config: the command line and the trainer both call this).

        Raises:
            ValueError: a size that does not divide, naming it.
        """
        n = world_size
        for broken in inert_settings(self, n, warn=True):
            said = self.__dict__.setdefault("_warned", set())
            message = InertSettings([broken]).describe()
            if message not in said:
                said.add(message)
                warnings.warn(message, UserWarning, stacklevel=2)
        broken = inert_settings(self, n)
        if broken:
            raise InertSettings(broken)
        if n == 1:
            return
        for key in ("batch_size", "mini_batch_size"):
            if getattr(self, key) % n:
                raise ValueError(
                    f"{key} ({getattr(self, key)}) must be divisible by the number of processes ({n}); "
                    f"each process takes {key} / {n} sequences"
                )
        if (self.batch_size // n) % self.samples_per_prompt:
            raise ValueError(
                f"samples_per_prompt ({self.samples_per_prompt}) must divide each process's share of "
                f"batch_size ({self.batch_size} / {n} = {self.batch_size // n}): a prompt's group of "
                "responses is never split between processes"
            )
        local_mini = self.mini_batch_size // n
        if self.micro_batch_size is not None and local_mini % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}, per process) must divide each process's "
                f"share of mini_batch_size ({self.mini_batch_size} / {n} = {local_mini})"
            )


def config_knobs() -> Iterator[tuple[str, Knob]]:
    """``(field name, Knob)`` for every field of :class:`PPOConfig`, in declaration order."""
    for f in dataclasses.fields(PPOConfig):
        yield f.name, f.metadata["knob"]


# ---------------------------------------------------------------------------------------------
# resuming
# ---------------------------------------------------------------------------------------------
class ResumeChange(NamedTuple):
    """A setting a resume changes: ``key``, the checkpoint's value, the new one."""

    key: str
    saved: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_default_text(self.saved)} -> {_default_text(self.new)}"


def resume_conflicts(
    saved: Optional[Mapping[str, Any]],
    config: PPOConfig,
    *,
    where: str = "the checkpoint",
    new_run: str = "start a new run to change them",
) -> List[ResumeChange]:
    """The check of a resume: ``config``, the settings the run goes on with, against ``saved``,
    those its checkpoint was trained with (``trainer_state.pt``'s ``"config"``, a
    :meth:`PPOConfig.to_dict`). Each knob's ``resume`` says whether it may differ. A key that
    ``saved`` lacks (a checkpoint from before the knob existed) is not compared; ``saved`` of
    ``None`` compares nothing.

    Args:
        where: what the message names first (``"checkpoint 'DIR'"``).
        new_run: how the message ends: what to do instead.

    Returns:
        the ``free`` settings that differ, which the resume applies.

    Raises:
        ValueError: ``fixed`` settings differ: one line naming every one, with the checkpoint's
            value and the new one.
    """
    fixed, free = [], []
    for name, k in config_knobs():
        if saved is None or name not in saved or saved[name] == getattr(config, name):
            continue
        (fixed if k.resume == "fixed" else free).append(ResumeChange(name, saved[name], getattr(config, name)))
    if fixed:
        raise ValueError(
            f"{where} was trained with other settings, which a resume cannot change: "
            f"{', '.join(map(str, fixed))} (the checkpoint's -> this run's); {new_run}"
        )
    return free


def _default_text(value: Any) -> str:
    return "None" if value is None else repr(value)


def config_markdown() -> str:
    """The key table of ``docs/trainer.md``, generated from the fields' metadata and :data:`NEEDS`:
    one table per group (``resume``: whether a resume may change the key), then the rules."""
    defaults = _field_defaults()
    lines: list[str] = []
    group = None
    for name, k in config_knobs():
        if k.group != group:
            group = k.group
            lines += ["", f"### {group}", "", "| key | default | values | resume | meaning |", "|---|---|---|---|---|"]
        lines.append(f"| `{name}` | `{_default_text(defaults[name])}` | {k.expected()} | {k.resume} | {k.help} |")
    lines += ["", "### what acts only with what", "", "| keys | act only with | set without it |", "|---|---|---|"]
    for rule in NEEDS:
        keys = ", ".join(f"`{name}`" for name in rule.knobs)
        lines.append(f"| {keys} | {rule.when} | {'warned' if rule.warn else 'refused'} |")
    return "\n".join(lines[1:]) + "\n"


if __name__ == "__main__":  # python -m pyppo.config > table: regenerates the docs table
    sys.stdout.write(config_markdown())
