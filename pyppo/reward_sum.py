"""Several rewards with weights, and ``None`` for "does not apply", as TRL's ``GRPOTrainer`` takes
them (``reward_funcs``, ``reward_weights``; ``_calculate_rewards``): each reward scores every
response, a reward may return ``None`` for a response it does not apply to (a math reward on a
prompt without an answer), and a response's score is the weighted sum of the rewards that apply,
``Σ_k w_k · r_k`` over the ``k`` whose ``r_k`` is not ``None`` (TRL: ``(rewards_per_func *
reward_weights).nansum(dim=1)``).

A response that no reward applies to (every reward returned ``None``) scores 0.0, as TRL's
``nansum`` makes it, and an :class:`UnscoredWarning` names it, as TRL warns: its score is a
default, not a judgement, which a reward that returns a number where it applies avoids. NaN never
reaches the training: ``None`` is the only way to say "does not apply", and a NaN score is
refused (:func:`pyppo.rewards.validate_scores`).

``pyppo train --reward a --reward b --reward-weights 1.0 0.5`` and ``PPOTrainer(config, model,
..., reward_fn=[f, g], reward_weights=[1.0, 0.5])`` build a :class:`RewardSum`; each reward's own
mean over the responses it applies to is logged as ``reward/<name>_mean`` beside ``score_mean``
(:mod:`pyppo.trainer.reward_metrics`).
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from .rewards import RewardError, RewardFn, load_reward, reward_name, score_reward

__all__ = [
    "RewardScores",
    "RewardSum",
    "UnscoredWarning",
    "as_reward",
    "check_reward_weights",
    "load_rewards",
    "reward_metric_name",
    "reward_parts",
    "score_rewards",
]


class UnscoredWarning(UserWarning):
    """Every reward returned ``None`` for a response: it scores 0.0 (TRL's ``nansum``)."""


def check_reward_weights(weights: Any, n_rewards: int, *, what: str = "reward_weights") -> List[float]:
    """``weights`` as ``n_rewards`` floats.

    Args:
        weights: one finite real number per reward (a bool is refused).
        n_rewards: how many rewards there are.
        what: how the message names the weights (``"--reward-weights"`` on the command line).

    Raises:
        ValueError: not a list of finite numbers, or not one per reward, e.g. ``reward_weights
            has 3 values for 2 rewards``.
    """
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ValueError(f"{what} must be a list of numbers, one per reward, got {weights!r}")
    if len(weights) != n_rewards:
        raise ValueError(
            f"{what} has {len(weights)} value{'s' * (len(weights) != 1)} for {n_rewards} "
            f"reward{'s' * (n_rewards != 1)}; give one weight per reward, in their order"
        )
    out = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"{what}[{i}] must be a finite number, got {w!r}")
        out.append(float(w))
    return out


def reward_metric_name(fn: Any) -> str:
    """A reward's name in metric keys: its function's name for ``module:function`` and
    ``file.py:function`` specs (``compute_score``), a model directory's last part, else
    :func:`pyppo.rewards.reward_name` (``math``, a function's ``__name__``), with characters other
    than letters, digits, ``.`` and ``-`` made ``_`` (a ``/`` would look like a metric group)."""
    name = reward_name(fn)
    if ":" in name and not Path(name).is_dir():
        name = name.rpartition(":")[2]
    elif "/" in name or "\\" in name:
        name = Path(name).name
    return re.sub(r"[^\w.\-]+", "_", name).strip("_") or "reward"


def _unique(names: List[str]) -> List[str]:
    """``names`` with a repeated one made ``name_2``, ``name_3``, ... (in order)."""
    out: List[str] = []
    for name in names:
        candidate, k = name, 1
        while candidate in out:
            k += 1
            candidate = f"{name}_{k}"
        out.append(candidate)
    return out


class RewardSum:
    """Several rewards and their weights: a response's score is the weighted sum of those that
    apply to it (module docstring). Called as a reward, ``(prompts, responses, **fields) ->
    B floats``; :func:`score_rewards` also returns each reward's own scores.

    Args:
        rewards: the rewards, each a reward function in any convention of :mod:`pyppo.rewards`
            (pyppo's, TRL's, veRL's ``compute_score``) or a :func:`~pyppo.rewards.load_reward`
            result; each receives the prompt fields it takes.
        weights: one finite number per reward (TRL's ``reward_weights``); ``None``: 1.0 each.

    Attributes:
        rewards, weights: as given (tuples; ``weights`` floats).
        names: each reward's metric name (:func:`reward_metric_name`), a repeated one made
            unique (``compute_score``, ``compute_score_2``).
        reward_name: ``"a + 0.5*b"``, how errors name the sum.

    Raises:
        TypeError: a reward is not callable, naming its index.
        ValueError: no reward, or bad weights (:func:`check_reward_weights`).
    """

    def __init__(self, rewards: Sequence[RewardFn], weights: Optional[Sequence[float]] = None):
        rewards = list(rewards)
        if not rewards:
            raise ValueError("reward_fn is an empty list; give at least one reward")
        for i, fn in enumerate(rewards):
            if isinstance(fn, RewardSum) or not callable(fn):
                raise TypeError(
                    f"reward_fn[{i}] must be a reward function (prompts, responses) -> scores, got {type(fn).__name__}"
                )
        self.rewards = tuple(rewards)
        self.weights = tuple(check_reward_weights([1.0] * len(rewards) if weights is None else weights, len(rewards)))
        self.names = tuple(_unique([reward_metric_name(fn) for fn in rewards]))
        self.reward_name = " + ".join(
            name if w == 1.0 else f"{w:g}*{name}" for name, w in zip(self.names, self.weights)
        )

    def __call__(self, prompts: List[str], responses: List[str], **fields) -> List[float]:
        return score_rewards(self, prompts, responses, where="called directly", fields=fields).scores

    def __repr__(self) -> str:
        return f"RewardSum({self.reward_name})"


def as_reward(reward_fn: Any, reward_weights: Optional[Sequence[float]] = None) -> Any:
    """The reward a trainer scores with: a list or tuple of rewards (or one reward with
    ``reward_weights``) as a :class:`RewardSum`; one reward, a :class:`RewardSum` or ``None`` as
    it is.

    Raises:
        TypeError, ValueError: as :class:`RewardSum`; ``reward_weights`` beside a
            :class:`RewardSum` (which has its own) or beside ``None``.
    """
    if isinstance(reward_fn, (list, tuple)):
        return RewardSum(reward_fn, reward_weights)
    if reward_weights is None:
        return reward_fn
    if reward_fn is None or isinstance(reward_fn, RewardSum):
        what = "no reward_fn" if reward_fn is None else "a RewardSum, which has its own weights"
        raise ValueError(f"reward_weights {list(reward_weights)!r} given with {what}")
    return RewardSum([reward_fn], reward_weights)


def reward_parts(reward_fn: Any) -> tuple:
    """The rewards of a :class:`RewardSum`, or ``(reward_fn,)`` (``()`` for ``None``)."""
    if isinstance(reward_fn, RewardSum):
        return reward_fn.rewards
    return () if reward_fn is None else (reward_fn,)


class RewardScores(NamedTuple):
    """What :func:`score_rewards` returns for ``B`` responses."""

    #: ``B`` floats: the weighted sum of the rewards that apply; 0.0 where none does.
    scores: List[float]
    #: Several rewards: each one's own scores (``None`` where it does not apply), by name; one
    #: reward: empty (its scores are ``scores``).
    parts: Dict[str, List[Optional[float]]]
    #: veRL ``compute_score`` dicts' other numbers, by ``"<name>/<key>"`` (``None``: absent).
    extras: Dict[str, List[Optional[float]]]
    #: ``B`` bools: no reward applied (every one returned ``None``), so the score is 0.0.
    unscored: List[bool]


def score_rewards(
    reward_fn: RewardFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    where: str,
    fields: Optional[Dict[str, List[Any]]] = None,
) -> RewardScores:
    """Score ``B`` responses with one reward or a :class:`RewardSum`: each reward is called and
    checked by :func:`pyppo.rewards.score_reward` (it gets the columns of ``fields`` it takes),
    and a response's score is ``Σ_k w_k · r_k`` over the rewards that do not return ``None`` for
    it (TRL's ``nansum``; one reward has weight 1.0, so its scores are unchanged), summed with
    ``math.fsum``; 0.0 where none applies, with an :class:`UnscoredWarning` naming how many, the
    first prompt and response, and ``where``.

    Raises:
        RewardError: as :func:`~pyppo.rewards.score_reward`, naming the reward at fault; or the
            weighted sum overflows to ±inf (naming the index).
        ValueError: a column of ``fields`` of the wrong length.
    """
    several = isinstance(reward_fn, RewardSum)
    rewards = reward_fn.rewards if several else (reward_fn,)
    weights = reward_fn.weights if several else (1.0,)
    names = reward_fn.names if several else (reward_metric_name(reward_fn),)
    outputs = [score_reward(fn, prompts, responses, where=where, fields=fields) for fn in rewards]
    scores: List[float] = []
    unscored: List[bool] = []
    for i in range(len(responses)):
        applied = [w * out.scores[i] for w, out in zip(weights, outputs) if out.scores[i] is not None]
        total = math.fsum(applied) if applied else 0.0
        if not math.isfinite(total):  # finite scores and weights whose products overflow
            name = reward_name(reward_fn)
            raise RewardError(
                f"reward {name!r}: the weighted sum at index {i} is {total} ({where})", reward=name, index=i
            )
        scores.append(total)
        unscored.append(not applied)
    if any(unscored):
        i = unscored.index(True)
        count = f"{sum(unscored)} of {len(responses)} responses"
        first = f"the first: prompt {i}: {_clip(str(prompts[i]))!r}, response: {_clip(responses[i])!r}"
        if several:
            message = (
                f"no reward applied to {count} ({where}; {first}): each scores 0.0, as in TRL. "
                "Return a number for every response some reward applies to"
            )
        else:
            message = (
                f"reward {reward_name(reward_fn)!r} did not apply to {count} (returned None; {where}; {first}): "
                "each scores 0.0, as in TRL. Return a number for every response it should score"
            )
        warnings.warn(message, UnscoredWarning, stacklevel=2)
    parts = {name: out.scores for name, out in zip(names, outputs)} if several else {}
    extras = {f"{name}/{key}": column for name, out in zip(names, outputs) for key, column in out.extras.items()}
    return RewardScores(scores, parts, extras, unscored)


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def load_rewards(specs: Sequence[str] | str, weights: Optional[Sequence[float]] = None, **kwargs) -> Callable:
    """:func:`pyppo.rewards.load_reward` of each spec: one spec (a string, or a list of one without
    ``weights``) gives its reward, several (or weights) a :class:`RewardSum`; ``kwargs`` go to
    ``load_reward`` (``device``).

    Raises:
        as :func:`~pyppo.rewards.load_reward` and :class:`RewardSum`.
    """
    if isinstance(specs, str):
        specs = [specs]
    loaded = [load_reward(spec, **kwargs) for spec in specs]
    if len(loaded) == 1 and weights is None:
        return loaded[0]
    return RewardSum(loaded, weights)
