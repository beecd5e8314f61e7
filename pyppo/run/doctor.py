"""The run's doctor: after each step, one warning line when the step could not have taught the
policy anything or the run is about to go wrong, and a ``doctor/<check>`` metric (1.0 when the
step's own numbers show the check's condition, else 0.0) in the step's metrics
(``docs/trainer.md``, "Why isn't it learning", which states every threshold).

Each check has its own warning class, a :class:`DoctorWarning`, so that one of them (or all)
can be filtered. A warning is said at the first step its condition holds (two checks need it
several steps in a row), and again only after a step where it did not; a resumed run takes that
state up from its ``metrics.jsonl`` (:meth:`Doctor.replay`). The checks read the step's metrics
and its batch (raw and shaped scores, ``has_eos``, advantages, ``loss_mask``, the sampled
tokens); under ``torchrun`` they take every process's numbers (a few collectives on every rank)
and only rank 0 warns. They change nothing: no tensor of the step, no random generator, no
weight. ``doctor = false`` turns them off.

Inside the run loop the doctor speaks for the trainer's own all-truncated warning
(:class:`~pyppo.trainer.overlong.AllTruncatedWarning`, which :meth:`Doctor.__enter__` silences),
so that a step whose every response ``mask_truncated`` removed is said once, as the doctor's
:class:`TruncationWarning`.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from .. import distributed
from ..config.knobs import GROUP_ESTIMATORS
from ..jsonl import read_objects
from ..trainer.advantages import get_estimator

if TYPE_CHECKING:
    from ..trainer import PPOTrainer
    from ..trainer.results import StepResult

__all__ = [
    "CHECKS",
    "Doctor",
    "applicable_checks",
    "step_facts",
    "DoctorWarning",
    "EntropyCollapseWarning",
    "KLJumpWarning",
    "NoGroupSignalWarning",
    "NoSignalWarning",
    "RewardIgnoresResponseWarning",
    "TruncationWarning",
    "ValueModelWarning",
    "ZeroAdvantagesWarning",
    "ENTROPY_FLOOR",
    "EQUAL_TOLERANCE",
    "IGNORED_RESPONSE_STEPS",
    "KL_JUMP_PER_TOKEN",
    "VALUE_AFTER_STEP",
    "VALUE_PATIENCE",
]

#: Two scores (or an advantage and 0) are equal when they differ by at most this, relative to
#: ``max(1, |score|)``: float32 rounding of a reward that returns one value.
EQUAL_TOLERANCE = 1e-6
#: Nats per response token: a rise of the KL to the reference (``kl_mean / response_length_mean``)
#: larger than this from one step to the next is a jump. A healthy run of the default preset
#: gains about 0.02 a step (README: 6.9 nats over its 16 tokens after 20 steps).
KL_JUMP_PER_TOKEN = 0.5
#: Nats per token: a mean entropy of the sampling distribution below this has collapsed (the
#: default preset's SmolLM2 samples at 2.4 at its first step).
ENTROPY_FLOOR = 0.05
#: The value model's explained variance is judged from this step on (its first steps learn the
#: returns' scale) ...
VALUE_AFTER_STEP = 6
#: ... and said when it has been negative this many judged steps in a row (at step 10 at the
#: earliest).
VALUE_PATIENCE = 5
#: Steps in a row of a reward that gave each prompt's differing responses one score.
IGNORED_RESPONSE_STEPS = 3
#: The checks said only after their condition showed this many steps in a row (the others: 1).
_PERSISTENCE = {"reward_ignores_response": IGNORED_RESPONSE_STEPS, "value_model": VALUE_PATIENCE}

_DOCS = 'docs/trainer.md, "Why isn\'t it learning"'


class DoctorWarning(UserWarning):
    """Base of the doctor's warnings: ``warnings.filterwarnings("ignore", category=DoctorWarning)``
    silences them all (``doctor = false`` also skips the checks and their metrics)."""


class NoSignalWarning(DoctorWarning):
    """``doctor/no_signal``: every score of the step (after ``score_clip`` and the penalties) was
    the same: no estimator can tell a response from another."""


class NoGroupSignalWarning(DoctorWarning):
    """``doctor/no_group_signal``: with a group estimator, every group's responses scored alike,
    so every group baseline cancels its scores (every advantage is 0)."""


class RewardIgnoresResponseWarning(DoctorWarning):
    """``doctor/reward_ignores_response``: with ``samples_per_prompt >= 2``, each prompt's differing
    responses got one raw score while those scores took three values or more between prompts
    (said after :data:`IGNORED_RESPONSE_STEPS` such steps in a row: the reward reads the prompt
    only)."""


class ZeroAdvantagesWarning(DoctorWarning):
    """``doctor/zero_advantages``: every advantage at the policy's tokens (``loss_mask``) is 0,
    so the policy loss has no gradient."""


class TruncationWarning(DoctorWarning):
    """``doctor/truncation``: every response was cut at the length limit without EOS, and
    ``mask_truncated`` took them all out of the loss, or ``missing_eos_penalty`` lowered every
    score alike. (Truncation alone is normal and is not said.)"""


class KLJumpWarning(DoctorWarning):
    """``doctor/kl_jump``: the KL to the reference rose by more than :data:`KL_JUMP_PER_TOKEN`
    nats per token since the previous step."""


class EntropyCollapseWarning(DoctorWarning):
    """``doctor/entropy_collapse``: the sampling distribution's mean entropy is below
    :data:`ENTROPY_FLOOR` nats per token."""


class ValueModelWarning(DoctorWarning):
    """``doctor/value_model``: from step :data:`VALUE_AFTER_STEP` on, the value model's explained
    variance is negative (said after :data:`VALUE_PATIENCE` such steps in a row)."""


#: Every check: its metric's name (``doctor/<name>``) and its warning class, in the order they run.
CHECKS: Dict[str, type] = {
    "truncation": TruncationWarning,
    "no_signal": NoSignalWarning,
    "reward_ignores_response": RewardIgnoresResponseWarning,
    "no_group_signal": NoGroupSignalWarning,
    "zero_advantages": ZeroAdvantagesWarning,
    "kl_jump": KLJumpWarning,
    "entropy_collapse": EntropyCollapseWarning,
    "value_model": ValueModelWarning,
}


@dataclass(frozen=True)
class _Facts:
    """What the checks read of one step, over every process's share of it."""

    responses: int
    with_eos: int
    groups: int
    varied_groups: int  # groups with two different (shaped) scores
    distinct_groups: int  # groups with two different responses
    distinct_varied_groups: int  # of those, groups with two different raw scores
    prompt_scores: int  # different raw scores among the groups whose responses differ
    score_min: float
    score_max: float
    raw_score_min: float
    raw_score_max: float
    advantage_abs_max: float  # over loss_mask; 0 with no loss_mask token


def _varied(rows: torch.Tensor) -> torch.Tensor:
    """``[G]`` bool: whether row ``g`` of ``rows`` ``[G, n]`` holds two values further apart than
    :data:`EQUAL_TOLERANCE` relative to its largest magnitude (at least 1)."""
    spread = rows.max(dim=1).values - rows.min(dim=1).values
    return spread > EQUAL_TOLERANCE * rows.abs().max(dim=1).values.clamp_min(1.0)


def _distinct(response_ids: torch.Tensor, response_mask: torch.Tensor, n: int) -> torch.Tensor:
    """``[B / n]`` bool: whether the ``n`` consecutive responses of each group (``[B, T]`` ids and
    mask) are not all the same tokens."""
    ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, -1)).cpu()
    groups = ids.reshape(-1, n, ids.shape[1])
    return (groups != groups[:, :1]).flatten(1).any(dim=1)


def _equal(low: float, high: float) -> bool:
    return high - low <= EQUAL_TOLERANCE * max(1.0, abs(low), abs(high))


def _distinct_values(values: list) -> list:
    """``values`` without those :func:`_equal` to a smaller one kept before them."""
    kept: list = []
    for v in sorted(values):
        if not kept or not _equal(kept[-1], v):
            kept.append(v)
    return kept


def step_facts(result: StepResult, samples_per_prompt: int, world: distributed.World) -> _Facts:
    """The numbers the checks need of ``result``'s batch, over every rank (three collectives, which
    every rank must make).

    Args:
        result: a step's :class:`~pyppo.trainer.results.StepResult`; its batch's rows are groups of
            ``samples_per_prompt`` consecutive responses to one prompt.
        samples_per_prompt: the group size ``n`` (1: no groups).
        world: the processes.
    """
    b, n = result.batch, samples_per_prompt
    scores, raw = b.scores.detach().double().cpu(), b.raw_scores.detach().double().cpu()
    groups = len(b) // n
    if n >= 2:
        varied = _varied(scores.reshape(groups, n))
        distinct = _distinct(b.response_ids, b.response_mask, n)
        distinct_varied = distinct & _varied(raw.reshape(groups, n))
        counts = [int(varied.sum()), int(distinct.sum()), int(distinct_varied.sum())]
        firsts = raw.reshape(groups, n)[distinct, 0].tolist()
    else:
        counts, firsts = [0, 0, 0], []
    # A few numbers a rank (one per group): every rank's, to count the different ones.
    every = [x for rank in distributed.gather_objects(firsts, world) for x in rank]
    advantages = b.advantages.detach()[b.loss_mask]
    counted = distributed.all_sum([len(b), int(b.has_eos.sum()), groups, *counts], world)
    extremes = distributed.reduce_metrics(
        {
            "score_min": float(scores.min()),
            "score_max": float(scores.max()),
            "raw_score_min": float(raw.min()),
            "raw_score_max": float(raw.max()),
            "advantage_abs_max": float(advantages.abs().max()) if advantages.numel() else 0.0,
        },
        world,
    )
    responses, with_eos, groups, varied_groups, distinct_groups, distinct_varied_groups = (int(v) for v in counted)
    prompt_scores = len(_distinct_values(every))
    return _Facts(
        responses, with_eos, groups, varied_groups, distinct_groups, distinct_varied_groups, prompt_scores, **extremes
    )


def _kl_per_token(m: Dict[str, float]) -> Optional[float]:
    """A step's KL to the reference per response token (``kl_mean`` over
    ``response_length_mean``), nats; ``None`` where the step has no finite one."""
    kl, length = m.get("kl_mean"), m.get("response_length_mean")
    if not isinstance(kl, (int, float)) or not math.isfinite(kl) or not length:
        return None
    return kl / length


class Doctor:
    """The checks of ``docs/trainer.md``, "Why isn't it learning", run after each step of
    ``trainer``'s run (:func:`pyppo.run.loop.train` calls :meth:`examine`; a loop of your own can
    too, on each ``trainer.step()``'s result).

    ``doctor/<check>`` is 1.0 at each step whose own numbers show the check's condition. A
    warning is said at the first step where a condition holds (``reward_ignores_response``: seen
    :data:`IGNORED_RESPONSE_STEPS` steps in a row; ``value_model``: :data:`VALUE_PATIENCE`) and no
    other check explains it, and again only after a step where it did not. That state follows from
    the logged rows, so a resumed run takes it up where its checkpoint left it (:meth:`replay`):
    its ``doctor/*`` metrics and warnings are the uninterrupted run's.

    Used as a context manager around the steps, it silences the trainer's own all-truncated
    warning, which :class:`TruncationWarning` then says instead (put back on exit).

    Args:
        trainer: a :class:`pyppo.trainer.PPOTrainer`; its ``config.doctor`` turns the checks on.
        log: the run's ``metrics.jsonl``, whose rows are the steps before the next one
            (:meth:`replay`); ``None``: none. Under ``torchrun`` rank 0 reads it and hands its rows
            to the others (a collective), so every rank passes it, or none does.

    Raises:
        ValueError: a line of ``log`` that is not a JSON object (naming ``path:line``).
    """

    def __init__(self, trainer: PPOTrainer, log: Optional[os.PathLike] = None):
        c = trainer.config
        self.enabled = bool(c.doctor)
        self.config, self.world = c, trainer.world
        self.say = trainer.world.is_main
        self.all_truncated = getattr(trainer, "all_truncated", None)
        self.checks = applicable_checks(c)
        self._streak = {name: 0 for name in CHECKS}  # steps in a row that showed the condition
        self._said = {name: False for name in CHECKS}
        self._previous_kl: Optional[float] = None  # per token, the last step's
        self._was_saying: Optional[bool] = None
        if self.enabled and log is not None:
            rows = [row for _, row in read_objects(log)] if self.say and Path(log).is_file() else []
            self.replay(distributed.gather_objects(rows if self.say else None, self.world)[0])

    def __enter__(self) -> "Doctor":
        if self.all_truncated is not None:
            self._was_saying, self.all_truncated.say = self.all_truncated.say, False
        return self

    def __exit__(self, *_exc) -> None:
        if self.all_truncated is not None and self._was_saying is not None:
            self.all_truncated.say = self._was_saying
            self._was_saying = None

    def examine(self, result: StepResult) -> Dict[str, float]:
        """Run the checks on one step: add ``doctor/<check>`` (1.0 or 0.0) to ``result.metrics``
        for each check that applies to the run, and warn (rank 0) where one says something new.
        Every rank must call it (the numbers are global). Nothing when ``config.doctor`` is false.

        Returns:
            the ``doctor/*`` metrics added.
        """
        if not self.enabled:
            return {}
        m = result.metrics
        facts = step_facts(result, self.config.samples_per_prompt, self.world)
        found = {name: getattr(self, f"_{name}")(facts, m) for name in self.checks}
        metrics = {f"doctor/{name}": float(message is not None) for name, message in found.items()}
        for name in self._advance(metrics, m):
            if self.say:
                warnings.warn(f"step {m.get('step', '?')}: {found[name]}; {_DOCS}", CHECKS[name], stacklevel=2)
        m.update(metrics)
        return metrics

    def replay(self, rows) -> None:
        """Take the state of the checks up to the end of ``rows`` (the logged metrics of the steps
        before the next one, in order), saying nothing: what :meth:`examine` left after those
        steps. A row without ``doctor/*`` (a run that had the doctor off) shows no condition."""
        for row in rows:
            self._advance({f"doctor/{name}": float(row.get(f"doctor/{name}") == 1.0) for name in self.checks}, row)

    def _advance(self, seen: Dict[str, float], m: Dict[str, float]) -> list:
        """One step: ``seen`` (``doctor/<check>`` -> 1.0 or 0.0) and its metrics ``m``. Returns the
        checks to say now."""
        self._previous_kl = _kl_per_token(m)
        holds = {}
        for key, value in seen.items():
            name = key.removeprefix("doctor/")
            self._streak[name] = self._streak[name] + 1 if value else 0
            holds[name] = self._streak[name] >= _PERSISTENCE.get(name, 1)
        # One warning per cause: a check another explains this step waits until it stands alone.
        explained = {
            "no_group_signal": holds.get("no_signal", False) or holds.get("reward_ignores_response", False),
            "zero_advantages": any(
                holds.get(k, False) for k in ("truncation", "no_signal", "no_group_signal", "reward_ignores_response")
            ),
        }
        new = []
        for name, held in holds.items():
            saying = held and not explained.get(name, False)
            if saying and not self._said[name]:
                new.append(name)
            self._said[name] = saying
        return new

    # ------------------------------------------------------------------------------ the checks
    # Each: what its warning says when the step's own numbers show its condition, else None.
    def _truncation(self, facts: _Facts, m: Dict[str, float]) -> Optional[str]:
        c = self.config
        if facts.with_eos:
            return None
        if c.mask_truncated and m.get("truncated_masked") == facts.responses and self.all_truncated is not None:
            return self.all_truncated.describe(facts.responses)
        if c.missing_eos_penalty:
            limits = self.all_truncated.limits if self.all_truncated is not None else "max_new_tokens"
            return (
                f"all {facts.responses} responses were cut without EOS (max_new_tokens = {c.max_new_tokens}), so "
                "missing_eos_penalty lowered every score alike and no response shows the policy how to end; "
                f"raise {limits}"
            )
        return None

    def _no_signal(self, facts: _Facts, m: Dict[str, float]) -> Optional[str]:
        if not _equal(facts.score_min, facts.score_max):
            return None
        return (
            f"all {facts.responses} responses scored {facts.score_max:.6g} (after score_clip and the penalties): "
            "a step that scores everything alike teaches nothing; check that the reward varies with the response "
            "(docs/rewards.md) and that score_clip does not clip every score"
        )

    def _reward_ignores_response(self, facts: _Facts, m: Dict[str, float]) -> Optional[str]:
        # Three values at least: prompts that a right-or-wrong reward finds all solved or all failed
        # give each group one score too, of two values.
        ignoring = facts.distinct_groups > 0 and facts.distinct_varied_groups == 0 and facts.prompt_scores >= 3
        if not ignoring:
            return None
        return (
            f"for {IGNORED_RESPONSE_STEPS} steps each prompt's different responses got one score, while the "
            f"prompts' scores took {facts.prompt_scores} values: the reward seems to read the prompt, not the "
            "response; check which of its arguments it scores (docs/rewards.md)"
        )

    def _no_group_signal(self, facts: _Facts, m: Dict[str, float]) -> Optional[str]:
        if facts.varied_groups:
            return None
        n = self.config.samples_per_prompt
        return (
            f"each of the {facts.groups} groups of {n} responses scored alike, so every group baseline "
            f"({self.config.advantage_estimator}) gave advantage 0; the prompts are all too easy or too hard "
            "for the policy: try filter_groups, a larger samples_per_prompt, or other prompts"
        )

    def _zero_advantages(self, facts: _Facts, m: Dict[str, float]) -> Optional[str]:
        if facts.advantage_abs_max > EQUAL_TOLERANCE:
            return None
        return (
            "every advantage at the policy's tokens is 0, so the policy loss has no gradient (only kl_loss_coef "
            "and entropy_coef train it); check the reward and advantage_estimator"
        )

    def _kl_jump(self, facts: _Facts, m: Dict[str, float]) -> Optional[str]:
        current, previous = _kl_per_token(m), self._previous_kl
        if previous is None or current is None or current - previous <= KL_JUMP_PER_TOKEN:
            return None
        return (
            f"the KL to the reference jumped from {previous:.3g} to {current:.3g} nats per token in one step (more "
            f"than {KL_JUMP_PER_TOKEN}): the last update moved the policy far; lower lr, keep max_grad_norm set, "
            "or raise kl_coef (or set target_kl)"
        )

    def _entropy_collapse(self, facts: _Facts, m: Dict[str, float]) -> Optional[str]:
        entropy = m.get("entropy_mean")
        if entropy is None or not math.isfinite(entropy) or entropy >= ENTROPY_FLOOR:
            return None
        return (
            f"the policy's entropy is {entropy:.3g} nats per token (under {ENTROPY_FLOOR}): it samples nearly one "
            "response per prompt, which leaves nothing to compare; lower lr, or raise entropy_coef or kl_coef"
        )

    def _value_model(self, facts: _Facts, m: Dict[str, float]) -> Optional[str]:
        ev = m.get("explained_variance")
        if m.get("step", 0) < VALUE_AFTER_STEP or ev is None or not math.isfinite(ev) or ev >= 0:
            return None
        return (
            f"the value model's explained variance has been negative for {VALUE_PATIENCE} steps ({ev:.3g} now): "
            "its values predict the returns worse than a constant, so GAE's advantages are mostly its noise; "
            "raise value_lr, warm it up with critic_warmup_steps, or go critic-free (advantage_estimator = "
            "'grpo' with samples_per_prompt >= 2)"
        )


def applicable_checks(config) -> Tuple[str, ...]:
    """The checks that apply to a run of ``config`` (a :class:`~pyppo.config.PPOConfig`), whose
    ``doctor/<name>`` metrics its steps log, in :data:`CHECKS`' order; none when ``config.doctor``
    is false. ``truncation`` needs ``mask_truncated`` or a ``missing_eos_penalty`` > 0,
    ``reward_ignores_response`` ``samples_per_prompt >= 2``, ``no_group_signal`` a group estimator
    (``grpo``, ``rloo``, ``reinforce_pp_baseline``), ``value_model`` a value model."""
    if not config.doctor:
        return ()
    applies = {
        "truncation": config.mask_truncated or bool(config.missing_eos_penalty),
        "reward_ignores_response": config.samples_per_prompt >= 2,
        "no_group_signal": config.advantage_estimator in GROUP_ESTIMATORS,
        "value_model": get_estimator(config.advantage_estimator).uses_critic,
    }
    return tuple(name for name in CHECKS if applies.get(name, True))
