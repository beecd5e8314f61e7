"""Advantage estimators: from a rollout's scores, shaped per-token rewards (and values) to
advantages and returns, point 5 of a step (``docs/trainer.md``, "Advantage estimators": the
formulas and their sources; the group step's numerics in ``docs/ops.md``, "group_advantages").

An estimator is an :class:`Estimator`: a function ``(batch, config) -> (advantages [B, T],
returns [B, T])``, float32, 0 at masked positions, plus whether it needs a value model and
whether the trainer whitens its advantages over the whole batch (every rank's) afterwards. It is
registered by name in :data:`ADVANTAGE_ESTIMATORS` (the names of ``PPOConfig.advantage_estimator``).
Each reads the batch's ``rewards`` (the score and the KL penalty already shaped in,
:func:`pyppo.ops.shape_rewards`); ``gae`` also its ``values``. The group estimators take each
response's rewards summed (:func:`sequence_rewards`): with ``kl_coef = 0`` its score, the KL then
regularised through ``kl_loss_coef`` as GRPO does.

Every estimator reads the batch's ``loss_mask`` (the policy's own tokens; ``docs/trainer.md``,
"Two masks"): GAE skips the other positions, so a reply of an environment between two turns
neither adds a TD term nor breaks the chain.

:func:`shaped_advantages` is point 5 as a whole: the reward shaping, the estimator, DAPO's
truncated-sample masking and the whitening.

The group estimators take the batch's rows as groups of ``samples_per_prompt`` consecutive
responses to one prompt (the layout :meth:`pyppo.trainer.PPOTrainer.step` samples; a group is
never split between processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from .. import distributed
from ..config import ADVANTAGE_ESTIMATORS as NAMES
from ..config import PPOConfig
from ..ops import gae, group_advantages, length_adaptive_lam, shape_rewards, turn_gae, turn_start_mask
from .buffer import RolloutBuffer
from .guards import check_rollout
from .overlong import mask_truncated
from .step_stats import rollout_metrics

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "Estimator",
    "GROUP_EPS",
    "gae_advantages",
    "gae_turn_advantages",
    "agent_turn_ids",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "sequence_rewards",
    "reinforce_pp_baseline_advantages",
    "get_estimator",
    "shaped_advantages",
]

#: The ``eps`` of the group standard deviation (veRL 0.9.1's ``compute_grpo_outcome_advantage``).
GROUP_EPS = 1e-6

EstimatorFn = Callable[[RolloutBuffer, PPOConfig], Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator as the trainer uses it.

    Attributes:
        fn: ``(batch, config) -> (advantages [B, T], returns [B, T])``.
        uses_critic: it reads ``batch.values``: the trainer builds, trains and checkpoints a
            value model (otherwise none exists, and the value metrics are absent).
        whitened: the trainer whitens its advantages over the global batch afterwards (when
            ``whiten_advantages``); ``False`` for estimators normalised within each group.
        value_positions: ``batch -> [B, T]`` bool, where the value loss trains (intersected
            with ``loss_mask``); ``None``: every ``loss_mask`` token.
    """

    fn: EstimatorFn
    uses_critic: bool
    whitened: bool
    value_positions: Optional[Callable[[RolloutBuffer], torch.Tensor]] = None

    def __call__(self, batch: RolloutBuffer, config: PPOConfig) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.fn(batch, config)


def gae_advantages(batch: RolloutBuffer, config: PPOConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation", eq. 16) over each response's valid tokens,
    with ``config.gamma`` and ``config.lam`` (:func:`pyppo.ops.gae`). The value targets take
    ``lam_critic`` when set (decoupled GAE: VC-PPO, Yuan et al. 2025, arXiv 2503.01491); ``lam_alpha > 0``
    gives each response its own policy λ, ``1 - 1/(lam_alpha · l)`` for ``l`` trained tokens
    (VAPO's Length-Adaptive GAE: Yue et al. 2025, arXiv 2504.05118;
    :func:`pyppo.ops.length_adaptive_lam`)."""
    lam = length_adaptive_lam(batch.loss_mask, config.lam_alpha) if config.lam_alpha > 0 else config.lam
    return gae(batch.rewards, batch.values, batch.loss_mask, gamma=config.gamma, lam=lam, lam_critic=config.lam_critic)


def agent_turn_ids(batch: RolloutBuffer) -> torch.Tensor:
    """``[B, T]`` int64: each ``loss_mask`` token's agent turn (``batch.turn_ids``; a response
    of one turn is turn 0), -1 elsewhere."""
    ids = batch.turn_ids if batch.turn_ids is not None else torch.zeros_like(batch.loss_mask, dtype=torch.long)
    return torch.where(batch.loss_mask, ids, torch.full_like(ids, -1))


def turn_starts(batch: RolloutBuffer) -> torch.Tensor:
    """``[B, T]`` bool: each agent turn's first token (:func:`pyppo.ops.turn_start_mask`), where
    ``gae_turn`` reads and trains the value model."""
    return turn_start_mask(agent_turn_ids(batch))


def gae_turn_advantages(batch: RolloutBuffer, config: PPOConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE over agent turns (:func:`pyppo.ops.turn_gae`): a turn is one action, valued by the
    value model at its first token, paid the sum of its tokens' rewards (the KL penalty
    included); GAE with ``config.gamma_turn`` and ``config.lam_turn`` runs over the turns, and
    every token of a turn gets its turn's advantage. The value loss trains at the turns' first
    tokens (:func:`pyppo.ops.turn_start_mask`), toward the turn returns. On a response of one
    turn it is a bandit estimate: ``A = R − V`` of the response's first token."""
    return turn_gae(batch.rewards, batch.values, agent_turn_ids(batch), gamma=config.gamma_turn, lam=config.lam_turn)


def sequence_rewards(batch: RolloutBuffer) -> torch.Tensor:
    """``[B]`` float32: each response's rewards summed over its valid tokens, the score plus its
    KL penalty (``kl_coef = 0``: the score), what veRL's outcome estimators sum from
    ``token_level_rewards``."""
    return (batch.rewards * batch.loss_mask).sum(-1)


def _outcome(batch: RolloutBuffer, config: PPOConfig, estimator: str, std_normalize: bool):
    advantages = group_advantages(
        sequence_rewards(batch),
        batch.loss_mask,
        group_size=config.samples_per_prompt,
        estimator=estimator,
        eps=GROUP_EPS,
        std_normalize=std_normalize,
    )
    return advantages, advantages  # no value model: the returns are only logged


def grpo_advantages(batch: RolloutBuffer, config: PPOConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """GRPO's outcome advantage (Shao et al. 2024, "DeepSeekMath", §4.1.2): each response's
    :func:`sequence_rewards` minus its group's mean, over the group's standard deviation (``+ 1e-6``), on every token of
    the response; ``grpo_std_normalize = false`` subtracts the mean only (Dr. GRPO, Liu et al.
    2025, "Understanding R1-Zero-Like Training", §3.2). :func:`pyppo.ops.group_advantages`."""
    return _outcome(batch, config, "grpo", config.grpo_std_normalize)


def rloo_advantages(batch: RolloutBuffer, config: PPOConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for
    Free!"; Ahmadian et al. 2024, "Back to Basics", eq. 6): each response's :func:`sequence_rewards`
    minus the mean of the other responses' to its prompt, on every token. :func:`pyppo.ops.group_advantages`."""
    return _outcome(batch, config, "rloo", False)


def reinforce_pp_advantages(batch: RolloutBuffer, config: PPOConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++", eqs. 4-6): each token's discounted return
    ``sum_{k >= t} gamma^(k-t) r_k`` of the KL-shaped rewards, no value baseline (the trainer
    whitens them over the global batch). Computed as GAE with ``values = 0`` and ``lam = 1``."""
    zeros = torch.zeros_like(batch.rewards)
    advantages, _ = gae(batch.rewards, zeros, batch.loss_mask, gamma=config.gamma, lam=1.0)
    return advantages, advantages


def reinforce_pp_baseline_advantages(batch: RolloutBuffer, config: PPOConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025; veRL's ``reinforce_plus_plus_baseline``):
    each response's :func:`sequence_rewards` minus its group's mean, on every token (the trainer
    then whitens over the global batch)."""
    return _outcome(batch, config, "grpo", False)


#: Estimators by name (``PPOConfig.advantage_estimator``).
ADVANTAGE_ESTIMATORS: Dict[str, Estimator] = {
    "gae": Estimator(gae_advantages, uses_critic=True, whitened=True),
    "gae_turn": Estimator(gae_turn_advantages, uses_critic=True, whitened=True, value_positions=turn_starts),
    "grpo": Estimator(grpo_advantages, uses_critic=False, whitened=False),
    "rloo": Estimator(rloo_advantages, uses_critic=False, whitened=False),
    "reinforce_pp": Estimator(reinforce_pp_advantages, uses_critic=False, whitened=True),
    "reinforce_pp_baseline": Estimator(reinforce_pp_baseline_advantages, uses_critic=False, whitened=True),
}
assert tuple(ADVANTAGE_ESTIMATORS) == NAMES


def get_estimator(name: str) -> Estimator:
    """The estimator registered as ``name``.

    Raises:
        ValueError: no estimator of that name (naming the known ones).
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is not one of {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def paid_before_end(turn_rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float32: ``turn_rewards`` (what an environment paid, each on the last agent token
    of a turn) at every agent token but each row's last, 0 elsewhere: the per-turn rewards that
    :func:`shaped_advantages` leaves in place, the last one joining the score on the last token.

    Args:
        turn_rewards: ``[B, T]`` float32. loss_mask: ``[B, T]`` bool, the agent's tokens.
    """
    T = loss_mask.shape[1]
    positions = torch.arange(T, device=loss_mask.device).expand_as(loss_mask)
    last = torch.where(loss_mask, positions, torch.full_like(positions, -1)).max(dim=1, keepdim=True).values
    return torch.where(loss_mask & (positions != last), turn_rewards, torch.zeros_like(turn_rewards))


@torch.no_grad()
def shaped_advantages(
    batch: RolloutBuffer, kl_coef: float, estimator: Estimator, c: PPOConfig, world: distributed.World, *, where: str
) -> Dict[str, float]:
    """Point 5 of a step: fill ``batch``'s ``rewards`` and ``kl`` (:func:`pyppo.ops.shape_rewards`
    of its ``scores`` with ``kl_coef`` and ``c.kl_estimator``, over ``loss_mask``), then its
    ``advantages`` and ``returns`` (``estimator``). With ``mask_truncated``, responses without
    EOS then leave the loss (their ``loss_mask`` rows are cleared; their scores served their
    group's baseline). Last, with ``whiten_advantages`` and a whitened estimator, the advantages
    are whitened over every rank's ``loss_mask`` tokens (with fewer than 2, the raw advantages
    are kept).

    Multi-turn episodes: the rewards an environment paid before an episode's last agent token
    stay on the token they were paid at (:func:`paid_before_end`), and the rest of its score
    (what it paid last, the reward function's share, the penalties) sits on its last agent
    token; a token's reward is its KL penalty plus what was paid on it, so an episode's rewards
    sum to its score minus its KL.

    Returns:
        the rollout's metrics (:func:`~pyppo.trainer.step_stats.rollout_metrics`, over every
        sampled response), and ``truncated_masked``, the responses taken out of the loss, with
        ``mask_truncated``.

    Raises:
        NonFiniteRolloutError: the rollout's log-probs, values or rewards are NaN/inf
            (:func:`~pyppo.trainer.guards.check_rollout`; ``where`` names the step).
    """
    scores, paid = batch.scores, None
    if batch.turn_rewards is not None:
        paid = paid_before_end(batch.turn_rewards, batch.loss_mask)
        scores = scores - paid.sum(dim=1)
    batch.rewards, batch.kl = shape_rewards(
        scores, batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, kl_coef=kl_coef, estimator=c.kl_estimator
    )
    if paid is not None:
        batch.rewards = batch.rewards + paid
    check_rollout(batch, world, where)
    batch.advantages, batch.returns = estimator(batch, c)
    metrics = rollout_metrics(batch, world)
    if c.mask_truncated:
        metrics["truncated_masked"] = mask_truncated(batch.loss_mask, batch.advantages, batch.has_eos)
    if estimator.value_positions is not None:
        batch.value_mask = estimator.value_positions(batch) & batch.loss_mask
    valid = distributed.all_sum([int(batch.loss_mask.sum())], world)[0]
    if c.whiten_advantages and estimator.whitened and valid >= 2:
        batch.advantages = distributed.whiten(batch.advantages, batch.loss_mask, world)
    return metrics
