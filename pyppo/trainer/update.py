"""Point 6 of a PPO step for one minibatch (``docs/trainer.md``, "One step"): the forward and
backward of each micro-batch (the policy's loss, then the value model's), gradient accumulation
with the minibatch's loss normalisers, gradient clipping, the non-finite guard, the learning-rate
warm-up and AdamW; during the critic warm-up the value model's share alone.

:class:`MinibatchUpdate` is a part of :class:`~pyppo.trainer.PPOTrainer` (its base class): it reads
the trainer's ``config``, ``models``, ``policy_optimizer``, ``world``, ``objective``, ``skips``,
``micro_batch_size``, ``step_count`` and its step counters, and :meth:`PPOTrainer.update
<pyppo.trainer.PPOTrainer.update>` calls :meth:`minibatch_step` once per minibatch.
"""

from __future__ import annotations

import contextlib
import math
from typing import List, Optional, Tuple

import torch
from torch import nn

from .. import distributed
from ..ops.losses import loss_normalizer
from ..precision import autocast
from .buffer import RolloutBuffer
from .logprob_head import policy_objective
from .results import MicroStepResult
from .step_stats import RunningStats, record_token_stats

__all__ = ["LiveForward", "MinibatchUpdate"]

#: The first minibatch's live policy forward, ``(logprobs, entropy)`` ``[b, T]``, when point 4 ran it.
LiveForward = Optional[Tuple[torch.Tensor, torch.Tensor]]


class MinibatchUpdate:
    """One optimizer step of both models on a minibatch (the methods of
    :class:`~pyppo.trainer.PPOTrainer` that point 6 calls)."""

    @property
    def critic_warming_up(self) -> bool:
        """Whether this step trains the value model only (its first ``critic_warmup_steps``)."""
        return self.step_count < self.config.critic_warmup_steps

    def train_mode(self, mode: bool) -> None:
        """The policy and the value model in training (``True``) or eval mode."""
        self.policy.train(mode)
        if self.critic is not None:
            self.critic.train(mode)

    def zero_grad(self) -> None:
        """Free the gradients of the policy and the value model."""
        self.policy_optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.zero_grad()

    def minibatch_step(
        self, mb: RolloutBuffer, stats: RunningStats, where: str, *, first_forward: LiveForward = None
    ) -> List[MicroStepResult]:
        """One optimizer step of both models on a minibatch, accumulated over its micro-batches;
        skipped when a loss or gradient norm is not finite. Its statistics go into ``stats``
        when applied. Returns the micro-batches' :meth:`micro_step` results. ``first_forward``:
        the live policy forward of the minibatch's only micro-batch (:meth:`micro_step`)."""
        self.zero_grad()
        token_stats, losses = RunningStats(), RunningStats()
        # The whole minibatch's count over all ranks, divided by N because DDP and FSDP average
        # the ranks' gradients: each rank's loss is then its share of the global minibatch's sum.
        counts = [loss_normalizer(m, self.config.loss_agg) for m in (mb.loss_mask, mb.critic_mask)]
        count, value_count = distributed.all_sum(counts, self.world)
        if count == 0:  # every response of the minibatch left the loss (mask_truncated): nothing to learn
            return []
        normalizer = (count / self.world.size, max(value_count, 1) / self.world.size)
        micros = list(mb.micro_batches(self.micro_batch_size))
        seen = []
        for i, mu in enumerate(micros):
            sync = i == len(micros) - 1  # gradients are reduced once, after the last micro-batch
            value_sync = self.critic.gradient_sync(sync) if self.critic is not None else contextlib.nullcontext()
            with distributed.gradient_sync(self.models.policy_module, sync), value_sync:
                live = first_forward if i == 0 else None
                seen.append(self.micro_step(mu, normalizer, token_stats, losses, first_forward=live))
        # The micro losses sum to this rank's share; the ranks' shares average to the minibatch's.
        totals = distributed.reduce_metrics({k: losses.total(k) for k in losses.means()}, self.world)
        frozen = self.critic_warming_up
        totals.update(policy_grad_norm=0.0 if frozen else self.clip_grad_norm(self.policy))
        if self.critic is not None:
            totals.update(value_grad_norm=self.clip_grad_norm(self.critic.model))
        if self.skips.allows(totals, where):
            self.warm_up_learning_rates()
            if not frozen:
                self.policy_optimizer.step()
                self.policy_steps += 1
            if self.critic is not None:
                self.critic.step()
            self.optimizer_steps += 1
            stats.merge(token_stats)
            stats.add(totals)
        else:
            self.zero_grad()
        return seen

    def warm_up_learning_rates(self) -> None:
        """Set both learning rates for the next optimizer step: ``lr · min(1, (n + 1) /
        lr_warmup_steps)`` after ``n`` applied steps of that model (Goyal et al. 2017, "Accurate,
        Large Minibatch SGD", §2.2), then constant; the policy's count starts after the critic
        warm-up."""
        c = self.config

        def scale(n: int) -> float:
            return min(1.0, (n + 1) / c.lr_warmup_steps) if c.lr_warmup_steps else 1.0

        for group in self.policy_optimizer.param_groups:
            group["lr"] = c.lr * scale(self.policy_steps)
        if self.critic is not None:
            self.critic.set_lr_scale(scale(self.optimizer_steps))

    def micro_step(
        self,
        mu: RolloutBuffer,
        normalizer: Tuple[float, float],
        token_stats: RunningStats,
        losses: RunningStats,
        *,
        first_forward: LiveForward = None,
    ) -> MicroStepResult:
        """Forward and backward of one micro-batch. The losses are divided by the minibatch's
        ``normalizer`` (the policy's, the value model's), so the accumulated gradient (and the sum
        of the micro-batch losses) is the minibatch's. The policy's backward runs before the value
        model's forward, so the two models' activations are never held at once. ``first_forward``: the policy's live
        ``(logprobs, entropy)`` of ``mu`` (``rollout_forwards.first_policy_forward``), trained on
        instead of a new forward."""
        if self.critic_warming_up:  # the value model's loss only: the policy is not run
            pg_loss, pg_stats, logprobs = None, {}, mu.old_logprobs
        elif first_forward is None:
            with autocast(self.device, self.dtype):
                pg_loss, pg_stats, logprobs, _ = self.models.policy_module(
                    mu, objective=self.objective, normalizer=normalizer[0]
                )
        else:
            logprobs, entropy = first_forward
            pg_loss, pg_stats = policy_objective(logprobs, entropy, mu, self.objective, normalizer[0])
            logprobs = logprobs.detach()
        if pg_loss is not None:
            pg_loss.backward()
        terms = {k: float(pg_stats.pop(k)) for k in ("policy_loss", "kl_loss", "entropy_loss") if k in pg_stats}
        vf_stats, values = {}, mu.values
        if self.critic is not None:
            terms["value_loss"], vf_stats, values = self.critic.loss_backward(mu, normalizer[1])
        losses.add(terms)
        record_token_stats(token_stats, pg_stats, int(mu.loss_mask.sum()))
        # The value statistics are over the value loss's own positions (each turn's first token
        # under gae_turn), so they are weighted by those.
        record_token_stats(token_stats, vf_stats, int(mu.critic_mask.sum()))
        return MicroStepResult(logprobs, mu.old_logprobs, values, mu.returns, mu.loss_mask, mu.critic_mask)

    def clip_grad_norm(self, model: nn.Module) -> float:
        """Clip ``model``'s gradient norm to ``max_grad_norm``; returns the norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
