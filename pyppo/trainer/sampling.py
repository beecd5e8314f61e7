"""Points 1-3 of the PPO step (``docs/trainer.md``): sample responses to the step's prompts with
the rollout engine, cut each after its first EOS, score them, and, with ``filter_groups``, DAPO's
dynamic sampling (Yu et al. 2025, "DAPO", §3.2): groups whose responses all scored the same carry
no signal for a group baseline (every advantage is 0), so they are dropped and more prompts are
sampled until the batch is full, up to ``filter_groups_max_tries`` rollouts a step.

The functions take what they use (the engine, the prompt sampler, the reward, the config, the
process group); none takes the trainer.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import distributed
from ..agents.episodes import AgentEngine, episode_metrics
from ..config import PPOConfig
from ..prompts import PromptSampler, prompt_columns
from ..reward_sum import RewardSum, score_rewards
from ..rollout import RolloutEngine
from .buffer import RolloutBuffer, buffer_from_rollout
from .overlong import overlong_penalty
from .reward_metrics import RewardColumns, reward_metrics
from .step_stats import PhaseTimer

__all__ = [
    "episode_tokens",
    "reward_scores",
    "rollout",
    "sample_scored_batch",
    "score_batch",
    "shaped_scores",
    "varied_groups",
]


def rollout(
    engine: RolloutEngine, prompts: Sequence[str], fields: Optional[Dict[str, list]] = None, *, group_size: int = 1
) -> RolloutBuffer:
    """Points 1 and 2: one response to each prompt from ``engine``, cut after its first EOS (the
    engine cuts; :func:`~pyppo.trainer.buffer.buffer_from_rollout` checks what it returned).

    With an :class:`~pyppo.agents.episodes.AgentEngine`, one multi-turn episode per prompt: its
    environment's ``reset`` gets the prompt's record (``prompt`` and ``fields``), and each group of
    ``group_size`` consecutive prompts (the samples of one prompt record) shares one environment
    seed, drawn from torch's generator (so a resumed run draws the same).

    Raises:
        TypeError, ValueError: the engine returned something other than a
            :class:`~pyppo.rollout.Rollout` of these prompts, in their order.
    """
    prompts = list(prompts)
    if not isinstance(engine, AgentEngine):
        return buffer_from_rollout(engine.generate(prompts), prompts, engine)
    columns = fields or {}
    rows = [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
    groups = [i // group_size for i in range(len(prompts))]
    seeds = torch.randint(0, 2**31 - 1, (groups[-1] + 1,)).tolist() if prompts else []
    return buffer_from_rollout(engine.run_episodes(rows, [seeds[g] for g in groups], groups), prompts, engine)


def score_batch(
    batch: RolloutBuffer,
    reward_fn: Callable,
    c: PPOConfig,
    world: distributed.World,
    device: torch.device,
    *,
    where: str,
    fields: Optional[Dict[str, list]] = None,
    episode_tokens: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Point 3: ``(raw_scores [B], scores [B])`` float32 on ``device``: the reward's scores (given
    the prompts' ``fields``, a column each; several rewards: their weighted sum,
    :func:`pyppo.reward_sum.score_rewards`), then clipped to ``score_clip``, lowered by
    ``missing_eos_penalty`` where the response has no EOS and by DAPO's overlong penalty over the
    last ``overlong_buffer`` tokens (Yu et al. 2025, eq. 13): :func:`shaped_scores`.

    A batch of multi-turn episodes (``turn_rewards`` set) scores each episode with what its
    environment paid, summed, plus ``reward_fn`` of its whole transcript when there is one
    (``None``: the environment pays alone); the overlong penalty then counts every token after
    the prompt against the room ``episode_tokens`` (the resolved ``max_episode_tokens``) left it.

    Under ``torchrun`` a reward that fails on one rank raises its error on every rank
    (:func:`~pyppo.distributed.on_every_rank`), so that rank 0 reports it and the ranks stop
    together.

    Raises:
        whatever the reward raises (``where`` names the step in pyppo's own errors).
    """
    raw = reward_scores(batch, reward_fn, world, device, where=where, fields=fields)[0]
    return raw, shaped_scores(batch, raw, c, episode_tokens)


def shaped_scores(batch: RolloutBuffer, raw: torch.Tensor, c: PPOConfig, episode_tokens: Optional[int]) -> torch.Tensor:
    """``raw`` ``[B]`` clipped to ``score_clip`` and lowered by the missing-EOS and overlong
    penalties (:func:`score_batch`); ``episode_tokens``: the resolved ``max_episode_tokens`` of
    multi-turn episodes, ``None`` otherwise."""
    episodes = batch.turn_rewards is not None
    scores = raw if c.score_clip is None else raw.clamp(-c.score_clip, c.score_clip)
    if c.missing_eos_penalty is not None:
        scores = scores - c.missing_eos_penalty * (~batch.has_eos).float()
    if c.overlong_buffer:
        cap = c.max_new_tokens
        if episodes:
            cap = episode_tokens - batch.query_mask.sum(dim=1)
        scores = scores - overlong_penalty(batch.response_mask.sum(dim=1), cap, c.overlong_buffer, c.overlong_penalty)
    return scores


def reward_scores(
    batch: RolloutBuffer,
    reward_fn: Optional[Callable],
    world: distributed.World,
    device: torch.device,
    *,
    where: str,
    fields: Optional[Dict[str, list]] = None,
    dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, RewardColumns]:
    """``(raw [B] dtype on device, columns)``: what ``reward_fn`` gave each response (one reward
    or several, weighted and summed, ``None`` left out: :func:`pyppo.reward_sum.score_rewards`; 0
    without a reward), plus, for multi-turn episodes, what the environment paid over the episode (a
    reward that names a ``transcript`` parameter gets each episode's,
    ``pyppo.rewards.EPISODE_FIELDS``); and each reward's own scores
    (:class:`~pyppo.trainer.reward_metrics.RewardColumns`). Under ``torchrun`` a reward that fails
    on one rank raises on every rank, so rank 0 reports it.

    Raises:
        whatever the reward raises (``where`` names the step in pyppo's own errors).
    """
    raw = torch.zeros(len(batch), dtype=dtype, device=device)
    columns = RewardColumns(len(batch))
    if batch.episodes is not None:  # what an episode adds to its record's fields (EPISODE_FIELDS)
        fields = {**(fields or {}), "transcript": [e.transcript for e in batch.episodes]}
    if reward_fn is not None:
        scored = distributed.on_every_rank(
            score_rewards, world, reward_fn, batch.prompts, batch.responses, where=where, fields=fields
        )
        raw = torch.tensor(scored.scores, dtype=dtype, device=device)
        columns = RewardColumns.of(scored, several=isinstance(reward_fn, RewardSum))
    if batch.turn_rewards is not None:
        raw = raw + batch.turn_rewards.sum(dim=1).to(device, dtype)
    return raw, columns


def episode_tokens(engine: RolloutEngine) -> Optional[int]:
    """The resolved ``max_episode_tokens`` of a multi-turn engine; ``None`` for another engine."""
    return engine.limits.max_episode_tokens if isinstance(engine, AgentEngine) else None


def varied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B / group_size]`` bool: whether group ``g`` (rows ``g·n .. g·n + n − 1``) has two
    different scores. ``scores`` is ``[B]``; NaN scores never reach here (the reward's check)."""
    g = scores.reshape(-1, group_size)
    return (g != g[:, :1]).any(dim=1)


def sample_scored_batch(
    engine: RolloutEngine,
    sampler: PromptSampler,
    reward_fn: Callable,
    c: PPOConfig,
    world: distributed.World,
    device: torch.device,
    timer: PhaseTimer,
    *,
    where: str,
) -> Tuple[RolloutBuffer, Dict[str, float]]:
    """Points 1-3: this rank's batch of the step, scored, and the sampling metrics. The caller
    puts the policy in eval mode first (as the rollout's forwards run).

    Without ``filter_groups``: one draw of ``batch_size / samples_per_prompt`` prompts (this rank's
    share, :meth:`~pyppo.prompts.PromptSampler.sample_groups`), sampled and scored. With it: draws
    repeat until this rank holds ``batch_size / world_size`` responses in groups with varied
    raw scores (the reward's, plus what an environment paid: before ``score_clip`` and the
    penalties, as veRL's DAPO filters on accuracy), or ``filter_groups_max_tries`` draws were
    made; then the batch is the varied groups in the order sampled, filled up, if short, with
    groups whose raw scores were all equal. The advantages still use the shaped scores. Every rank
    draws as long as any rank is short (sampling may be a collective: FSDP gathers the weights).
    Groups are never split, across draws or ranks.

    Metrics: each reward's (:func:`~pyppo.trainer.reward_metrics.reward_metrics`, over the batch
    returned); with ``filter_groups``, ``filter_groups_tries`` (draws this step),
    ``filter_groups_dropped`` (all-equal groups sampled and dropped, over every draw),
    ``filter_groups_filled`` (all-equal groups kept to fill the batch: > 0 means the tries ran
    out).

    Raises:
        as :func:`rollout` and :func:`score_batch`.
    """
    n, need = c.samples_per_prompt, c.batch_size // world.size
    kept: List[Tuple[RolloutBuffer, RewardColumns]] = []
    equal: List[Tuple[RolloutBuffer, RewardColumns]] = []
    n_kept = tries = 0
    while True:
        tries += 1
        prompts, fields = prompt_columns(sampler.sample_groups(c.batch_size, n, world.rank, world.size))
        with timer.phase("generate"):
            batch = rollout(engine, prompts, fields, group_size=n)
        with timer.phase("score"):
            batch.raw_scores, columns = reward_scores(batch, reward_fn, world, device, where=where, fields=fields)
            batch.scores = shaped_scores(batch, batch.raw_scores, c, episode_tokens(engine))
        if not c.filter_groups:
            return batch, {**_episode_metrics(batch, world), **reward_metrics(columns, world)}
        # The reward's own scores, not the shaped ones: the overlong and missing-EOS penalties
        # differ with the length, and would keep a group of equally wrong answers.
        rows = varied_groups(batch.raw_scores, n).repeat_interleave(n).cpu()
        for part, chosen in ((kept, torch.nonzero(rows).flatten()), (equal, torch.nonzero(~rows).flatten())):
            part.append((batch.select(chosen), columns.select(chosen)))
        n_kept += int(rows.sum())
        short = distributed.all_sum([int(n_kept < need)], world)[0]
        if not short or tries == c.filter_groups_max_tries:
            break
    dropped = sum(len(b) for b, _ in equal) // n
    filled = max(0, need - n_kept) // n
    parts = [(b, cols) for b, cols in kept + equal if len(b)]
    batch = RolloutBuffer.cat([b for b, _ in parts]).select(torch.arange(need))
    columns = RewardColumns.cat([cols for _, cols in parts]).select(torch.arange(need))
    return batch, {
        "filter_groups_tries": float(tries),
        "filter_groups_dropped": float(dropped - filled),
        "filter_groups_filled": float(filled),
        **_episode_metrics(batch, world),
        **reward_metrics(columns, world),
    }


def _episode_metrics(batch: RolloutBuffer, world: distributed.World) -> Dict[str, float]:
    """:func:`~pyppo.agents.episodes.episode_metrics` of ``batch``'s episodes (``{}`` without),
    its two fractions over every rank's tool calls and tokens (a collective): the ranks' means
    would weigh a rank of one call like a rank of a hundred. The per-episode means are averaged
    over the ranks with the step's other metrics."""
    if batch.episodes is None:
        return {}
    m = episode_metrics(batch.episodes, batch.turn_ids, batch.response_mask)
    n = len(batch.episodes)
    calls, tokens = m["tool_calls_mean"] * n, m["episode_tokens_mean"] * n
    parts = [m["tool_error_fraction"] * calls, calls, m["env_token_fraction"] * tokens, tokens]
    errors, calls, env_tokens, tokens = distributed.all_sum(parts, world)
    m["tool_error_fraction"] = errors / calls if calls else 0.0
    m["env_token_fraction"] = env_tokens / tokens if tokens else 0.0
    return m
