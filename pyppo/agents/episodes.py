"""Multi-turn episodes, exact to the token (``docs/agents.md``).

An episode is one token sequence: the prompt's ids, then per agent turn the ids the policy sampled
(``loss_mask`` 1, ``turn_ids`` = the turn's index) and the environment's reply (``loss_mask`` 0,
``turn_ids`` -1): the ids of exactly what the chat template puts after the assistant's turn for
that reply (:meth:`pyppo.agents.render.ChatRenderer.reply_ids`), tokenised once. Sampled ids are
never decoded and re-encoded: the next turn continues the very ids of the last
(:meth:`pyppo.rollout.RolloutEngine.sample_continuations`), and the trainer's forwards score the
same ids, so PPO's first ratio is exactly 1 over every agent token of every turn.

What ends an episode: the environment's ``done``, or (tool environments) an agent turn that ends
with EOS and calls no tool. What cuts one (the episode is then *truncated*: ``has_eos`` false, so
``missing_eos_penalty`` and ``mask_truncated`` act on it): a turn that reaches ``max_new_tokens``
(or the room ``max_episode_tokens`` leaves) without EOS, ``max_turns`` turns without an end, or a
reply that would not leave room for one more agent token. The environment still sees a cut turn
and its reward counts; its reply is not appended.

Rewards: each turn's reward (a text environment's ``step``) sits on the last agent token of that
turn; an environment's final reward (``get_reward()``) on the last agent token of the episode. A
reward therefore never lands on an environment token, where GAE over the policy's tokens would
skip it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from .. import distributed
from ..rollout.engine import Rollout, RolloutEngine
from .types import Environment, EnvironmentContractError

__all__ = ["AgentEngine", "EpisodeLimits", "EpisodeRecord", "episode_metrics"]


@dataclass(frozen=True)
class EpisodeLimits:
    """How long an episode may run.

    Attributes:
        max_turns: agent turns at most (>= 1).
        max_new_tokens: sampled tokens per agent turn at most.
        max_episode_tokens: the context the episode may reach: prompt, every turn and every reply.
    """

    max_turns: int
    max_new_tokens: int
    max_episode_tokens: int


@dataclass
class EpisodeRecord:
    """What one episode did, for its metrics and ``samples.jsonl``.

    Attributes:
        group: the episode's group (the samples of one prompt record and environment seed).
        seed: the environment's seed.
        transcript: ``[{"role": "agent" | "environment", "turn": k, "text": str}, ...]`` in order
            (the agent's text decoded with special tokens skipped; the environment's as rendered).
        turns: agent turns sampled. tool_calls, tool_errors: summed over the turns.
        truncated: a limit cut the episode (else the environment or the agent ended it).
        episode_return: the rewards the environment paid, summed (before any penalty).
    """

    group: int
    seed: int
    transcript: List[Dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    episode_return: float = 0.0


@dataclass
class _Live:
    env: Environment
    leading: List[Dict[str, Any]]
    prompt: List[int]
    record: EpisodeRecord
    ids: List[int] = field(default_factory=list)
    loss: List[bool] = field(default_factory=list)
    turn: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    rewards: Dict[int, float] = field(default_factory=dict)  # position -> reward
    done: bool = False

    def room(self, limits: EpisodeLimits) -> int:
        return limits.max_episode_tokens - len(self.prompt) - len(self.ids)


def _finite_reward(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


class AgentEngine:
    """Runs multi-turn episodes with a rollout engine, one environment per episode, and returns
    them as one :class:`~pyppo.rollout.Rollout` (``response_*`` = everything after the prompt).

    Args:
        engine: the run's rollout engine; it samples each turn (``sample_continuations``).
        renderer: a :class:`~pyppo.agents.render.ChatRenderer` with the environment's tools.
        make_env: a fresh :class:`~pyppo.agents.types.Environment` per call (one per episode).
        limits: :class:`EpisodeLimits`.
        tokenizer: the policy's tokenizer (EOS and pad set).
        world: this process's :class:`~pyppo.distributed.World`. collective: sampling is a
            collective (FSDP2 gathers weights; ``synced_gpus``): every rank then samples as many
            turns as the rank that needs the most, a rank with no live episode sampling one token
            for nothing.

    The engine's ``sync_weights`` and ``close`` are the wrapped engine's.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        renderer: Any,
        make_env: Callable[[], Environment],
        limits: EpisodeLimits,
        tokenizer: Any,
        *,
        world: Optional[distributed.World] = None,
        collective: bool = False,
        device: Optional[torch.device] = None,
    ):
        if limits.max_turns < 1 or limits.max_new_tokens < 1:
            raise ValueError(f"max_turns and max_new_tokens must be >= 1, got {limits}")
        self.engine, self.renderer, self.make_env, self.limits = engine, renderer, make_env, limits
        self.tokenizer, self.world, self.collective, self.device = tokenizer, world, collective, device
        #: what ``pyppo train --env`` would name this environment as, when it can (a run started from
        #: Python records it in config.toml); ``None`` otherwise
        self.spec: Optional[str] = None
        self.eos_token_id, self.pad_token_id = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)

    def sync_weights(self, model, *, trainable_only: bool = True) -> Any:
        return self.engine.sync_weights(model, trainable_only=trainable_only)

    def close(self) -> None:
        self.engine.close()

    def generate(self, prompts: Sequence[str]) -> Rollout:
        """Episodes of the prompt strings, each its own group, seeded 0, 1, ... (for a direct
        call; the trainer calls :meth:`run_episodes` with its records and seeds)."""
        prompts = list(prompts)
        return self.run_episodes([{"prompt": p} for p in prompts], list(range(len(prompts))), list(range(len(prompts))))

    # ------------------------------------------------------------------------------ episodes
    def run_episodes(self, rows: Sequence[Mapping[str, Any]], seeds: Sequence[int], groups: Sequence[int]) -> Rollout:
        """One episode per prompt record.

        Args:
            rows: ``B`` prompt records (``{"prompt": str, <field>: ...}``); the environment's
                ``reset`` receives each record's fields.
            seeds: ``B`` ints, the environment seed of each episode (equal within a group).
            groups: ``B`` ints, each episode's group id (the group estimators' groups).

        Raises:
            ValueError: a prompt longer than ``max_episode_tokens`` leaves room for; an
                environment's bad reward (naming it); the renderer's errors.
        """
        if not (len(rows) == len(seeds) == len(groups)):
            raise ValueError(
                f"rows, seeds and groups must have one entry per episode, got {len(rows)}, {len(seeds)}, {len(groups)}"
            )
        episodes = [self._start(row, int(s), int(g)) for row, s, g in zip(rows, seeds, groups)]
        self._logprobs_reported = True
        for k in range(self.limits.max_turns):
            live = [e for e in episodes if not e.done]
            if not self._any_live(bool(live)):
                break
            self._turn(live, k)
        for e in episodes:  # max_turns reached without an end
            if not e.done:
                e.done, e.record.truncated = True, True
            final = e.env.final_reward()
            if final is not None and e.ids:
                last = max(i for i, x in enumerate(e.loss) if x)
                e.rewards[last] = e.rewards.get(last, 0.0) + _finite_reward(
                    final, f"{type(e.env).__name__}.final_reward()"
                )
        return self._rollout(rows, episodes)

    def _start(self, row: Mapping[str, Any], seed: int, group: int) -> _Live:
        if "prompt" not in row or not isinstance(row["prompt"], (str, list, tuple)):
            raise ValueError(f"a prompt record needs a 'prompt' string or message list, got fields {sorted(row)}")
        env = self.make_env()
        appended = env.reset(dict(row), seed)
        if appended is not None and not isinstance(appended, str):
            raise EnvironmentContractError(
                f"{type(env).__name__}.reset() must return a str or None, got {type(appended).__name__}"
            )
        leading = self.renderer.messages(row["prompt"], appended)
        prompt = list(self.renderer.prompt_ids(leading))
        room = self.limits.max_episode_tokens - len(prompt)
        if room < 1:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens leaves no room in max_episode_tokens = "
                f"{self.limits.max_episode_tokens}: raise max_episode_tokens or shorten the prompt"
            )
        return _Live(env, leading, prompt, EpisodeRecord(group=group, seed=seed))

    def _any_live(self, here: bool) -> bool:
        if not self.collective or self.world is None or not self.world.active:
            return here
        return distributed.all_sum([int(here)], self.world)[0] > 0

    def _turn(self, live: List[_Live], k: int) -> None:
        budgets = [min(self.limits.max_new_tokens, e.room(self.limits)) for e in live]
        contexts = [e.prompt + e.ids for e in live]
        if not live:  # a collective engine: this rank samples for nothing, as the others sample
            self.engine.sample_continuations([[self.eos_token_id]], 1)
            return
        sampled = self.engine.sample_continuations(contexts, max(budgets))
        for e, budget, (ids, logprobs) in zip(live, budgets, sampled):
            ids = list(ids)[:budget]
            ended = bool(ids) and ids[-1] == self.eos_token_id
            start = len(e.ids)
            e.ids += ids
            e.loss += [True] * len(ids)
            e.turn += [k] * len(ids)
            if logprobs is None:
                self._logprobs_reported = False
            e.logprobs += list(logprobs[: len(ids)]) if logprobs is not None else [0.0] * len(ids)
            e.record.turns += 1
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            e.record.transcript.append({"role": "agent", "turn": k, "text": text})
            result = e.env.turn(text, ids, ended)
            e.record.tool_calls += int(result.tool_calls)
            e.record.tool_errors += int(result.tool_errors)
            reward = _finite_reward(result.reward, f"{type(e.env).__name__}: a turn's reward")
            if reward and ids:
                e.rewards[start + len(ids) - 1] = e.rewards.get(start + len(ids) - 1, 0.0) + reward
            if result.done or not ended:
                e.done, e.record.truncated = True, not ended
                continue
            if k == self.limits.max_turns - 1:  # no turn follows: the reply would end the episode unanswered
                e.done, e.record.truncated = True, True
                continue
            reply = list(self.renderer.reply_ids(e.leading, ended, result.reply))
            if len(reply) + 1 > e.room(self.limits):  # no room for the reply and one more agent token
                e.done, e.record.truncated = True, True
                continue
            e.ids += reply
            e.loss += [False] * len(reply)
            e.turn += [-1] * len(reply)
            e.logprobs += [0.0] * len(reply)
            e.record.transcript.append(
                {"role": "environment", "turn": k, "text": self.tokenizer.decode(reply, skip_special_tokens=False)}
            )

    def _rollout(self, rows: Sequence[Mapping[str, Any]], episodes: List[_Live]) -> Rollout:
        B = len(episodes)
        P = max(len(e.prompt) for e in episodes)
        T = max(1, max(len(e.ids) for e in episodes))
        pad = self.pad_token_id
        query_ids = torch.full((B, P), pad, dtype=torch.long)
        query_mask = torch.zeros(B, P, dtype=torch.bool)
        response_ids = torch.full((B, T), pad, dtype=torch.long)
        response_mask = torch.zeros(B, T, dtype=torch.bool)
        loss_mask = torch.zeros(B, T, dtype=torch.bool)
        turn_ids = torch.full((B, T), -1, dtype=torch.long)
        turn_rewards = torch.zeros(B, T, dtype=torch.float32)
        logprobs = torch.zeros(B, T, dtype=torch.float32)
        for i, e in enumerate(episodes):
            n, m = len(e.prompt), len(e.ids)
            query_ids[i, P - n :] = torch.tensor(e.prompt, dtype=torch.long)
            query_mask[i, P - n :] = True
            if m:
                response_ids[i, :m] = torch.tensor(e.ids, dtype=torch.long)
                response_mask[i, :m] = True
                loss_mask[i, :m] = torch.tensor(e.loss)
                turn_ids[i, :m] = torch.tensor(e.turn, dtype=torch.long)
                logprobs[i, :m] = torch.tensor(e.logprobs, dtype=torch.float32)
            for pos, r in e.rewards.items():
                turn_rewards[i, pos] += r
            e.record.episode_return = float(sum(e.rewards.values()))
        responses = [self.tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes]
        tensors = dict(query_ids=query_ids, query_mask=query_mask, response_ids=response_ids)
        tensors.update(response_mask=response_mask, loss_mask=loss_mask, turn_ids=turn_ids, turn_rewards=turn_rewards)
        tensors["has_eos"] = torch.tensor([not e.record.truncated for e in episodes], dtype=torch.bool)
        if self._logprobs_reported:
            tensors["rollout_logprobs"] = logprobs
        if self.device is not None:
            tensors = {k: v.to(self.device) for k, v in tensors.items()}
        return Rollout(
            **tensors, prompts=[r["prompt"] for r in rows], responses=responses, episodes=[e.record for e in episodes]
        )


def episode_metrics(
    records: Sequence[EpisodeRecord], turn_ids: torch.Tensor, response_mask: torch.Tensor
) -> Dict[str, float]:
    """The per-step metrics of a batch of episodes (means over this rank's episodes; the trainer
    averages them over ranks): ``turns_mean``, ``episode_tokens_mean`` (tokens after the prompt),
    ``env_token_fraction`` (of those, the environment's), ``tool_calls_mean``,
    ``tool_error_fraction`` (of the calls; 0 without calls), ``truncated_episode_fraction``,
    ``episode_return_mean`` (the environment's rewards, before penalties)."""
    n = max(1, len(records))
    tokens = float(response_mask.sum())
    env_tokens = float((response_mask & (turn_ids < 0)).sum())
    calls = sum(r.tool_calls for r in records)
    return {
        "turns_mean": sum(r.turns for r in records) / n,
        "episode_tokens_mean": tokens / n,
        "env_token_fraction": env_tokens / tokens if tokens else 0.0,
        "tool_calls_mean": calls / n,
        "tool_error_fraction": sum(r.tool_errors for r in records) / calls if calls else 0.0,
        "truncated_episode_fraction": sum(r.truncated for r in records) / n,
        "episode_return_mean": sum(r.episode_return for r in records) / n,
    }
