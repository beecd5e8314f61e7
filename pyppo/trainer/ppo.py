"""The PPO step for language models. ``docs/trainer.md`` walks through it; each step is:

1. take ``batch_size / samples_per_prompt`` prompts and sample ``samples_per_prompt`` responses to
   each, ``batch_size`` in all (pure sampling at ``temperature``, by the rollout engine:
   :mod:`pyppo.rollout`);
2. cut each response after its first EOS;
3. score each (prompt, response); clip the score, then subtract ``missing_eos_penalty`` and
   DAPO's overlong penalty (:mod:`pyppo.trainer.scoring`; with ``filter_groups``, 1-3 repeat until the batch holds groups
   whose scores differ: :mod:`pyppo.trainer.group_filter`);
4. the rollout's forwards: ``old_logprobs`` and the entropy (policy), ``ref_logprobs`` (frozen
   reference), ``values`` (value model, :mod:`pyppo.trainer.critic`; none for a critic-free
   estimator), at the response positions;
5. ``shape_rewards`` -> the advantage estimator (:mod:`pyppo.trainer.advantages`: GAE, or the
   group-relative GRPO / RLOO, or REINFORCE++) -> ``masked_whiten`` of the advantages over the
   whole batch (GAE and REINFORCE++ only);
6. ``ppo_epochs`` passes over shuffled minibatches (gradient accumulation over micro-batches):
   ``policy_loss + vf_coef * value_loss - entropy_coef * entropy`` (no value loss without a value
   model), gradient clipping, AdamW;
7. update the KL coefficient (adaptive when ``target_kl`` is set);
8. return the step's metrics and its batch.

The first PPO ratio is exactly 1: the first epoch's row order is drawn before point 4, and point 4
runs on exactly the micro-batches (same rows, order and padding) that the first epoch trains on,
so the first training forward repeats a computation bit for bit, batch-invariant model or not.
That holds in bfloat16 too (every forward runs under the same autocast) and with LoRA (the
reference is the policy with its adapters disabled, and the adapters start at 0).

When the first minibatch is one micro-batch, point 4's policy forward of its rows runs with grad
(:func:`~pyppo.trainer.rollout_forwards.first_policy_forward`): its detached log-probs are the
rollout's, and the first :meth:`PPOTrainer.micro_step` trains on the live ones, so that forward
is not run twice.

Under ``torchrun`` each of the N processes samples ``batch_size / N`` responses (whole groups of
``samples_per_prompt``) to its share of one global order of prompts and trains on its share of
each minibatch; :mod:`pyppo.distributed` makes the whitening, the loss
normaliser, the KL controller's input and the metrics global, and DDP or FSDP2 the gradients.
The run around the steps (logs, cadences, signals, evaluation, checkpoints, export) is
:mod:`pyppo.run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from .. import distributed
from ..config import PPOConfig
from ..ops import shape_rewards
from ..ops.losses import loss_normalizer
from ..precision import autocast, resolve_dtype
from ..prompts import PromptSampler
from ..rollout import EngineSync, RolloutEngine, make_engine
from ..rollout.hf_generate import generation_config
from ..run import checkpoint as run_checkpoint, evaluate, export, loop
from ..run.nonfinite import NonFiniteUpdateError, SkipPolicy, check_rollout
from ..run.stopping import GracefulStop
from .advantages import get_estimator
from .rollout_correction import correct_for_sampler
from .assemble import (check_arguments, check_lora_exportable, check_prompt_sets, check_trainable, logprob_modules,
                       make_adamw, prepare_models, prepare_tokenizer, share_reward_weights)
from .buffer import RolloutBuffer, buffer_from_rollout
from .kl_controllers import AdaptiveKLController, FixedKLController
from .critic import Critic
from .group_filter import sample_scored_batch
from .overlong import mask_truncated
from .logprob_head import PolicyObjective, policy_objective
from .rollout_forwards import first_policy_forward, rollout_forwards
from .scoring import score_batch
from .results import METRIC_KEYS, MicroStepResult, StepResult
from .step_stats import PhaseTimer, RunningStats, ratio_stats, record_token_stats, rollout_metrics

__all__ = ["PPOTrainer", "StepResult", "MicroStepResult", "METRIC_KEYS", "NonFiniteUpdateError"]

RewardFn = Callable[[List[str], List[str]], Sequence[float]]


class PPOTrainer:
    """PPO for a causal LM policy: actor-critic with a separate value model (GAE), or critic-free
    (GRPO, RLOO, REINFORCE++: ``advantage_estimator``).

    Args:
        config: a :class:`~pyppo.config.PPOConfig`; ``config.device`` says where the models run
            (they are moved there).
        policy: a ``transformers`` causal LM (trained in place).
        ref_policy: frozen reference; ``None`` = a frozen deep copy of ``policy`` taken now.
        value_model: ``forward(input_ids, attention_mask, position_ids) -> [B, L]`` float32;
            ``None`` = ``ValueModel.from_causal_lm(policy)`` (seeded by ``config.seed``); must be
            ``None`` for a critic-free estimator, which builds none.
        tokenizer: the policy's tokenizer; needs an EOS token. Its ``padding_side`` is set to
            ``"left"``; a missing pad token is taken to be EOS.
        reward_fn: ``(prompts, responses) -> scores``, one finite float per pair; a reward with
            more parameters gets the prompts' fields of those names (``docs/rewards.md``).
        prompts: the prompts to sample from: strings, or records ``{"prompt": str, <field>: ...}``
            (:func:`pyppo.prompts.load_prompt_records`) whose fields the reward receives.
        eval_prompts: held-out prompts (strings or records) for :meth:`evaluate_prompts`; :meth:`train` evaluates them
            every ``eval_every`` steps and after the last.
        base_model_source: the model source ``policy`` was loaded from (``pyppo train`` passes
            its ``--model``), for an adapter-only export's record of its base
            (:func:`pyppo.run.export.save_policy`'s ``base_model``); ``None`` = the policy's
            ``name_or_path``.

    With ``lora_rank > 0`` the policy is wrapped in ``peft`` LoRA adapters here (``policy`` then
    holds the ``PeftModel``) and ``ref_policy`` must be ``None``. Under ``torchrun`` every rank
    builds the trainer with the same arguments.

    Attributes:
        world: this process's :class:`~pyppo.distributed.World` (rank, number of processes, device).
        policy_module, value_module: the models as the forwards call them (DDP- or FSDP2-wrapped
            under torchrun); ``policy`` and ``value_model`` are the models themselves.
            ``value_model``, ``value_module``, ``value_optimizer`` and ``critic`` are ``None``
            for a critic-free estimator.
        critic: the value model's share of a step (:class:`~pyppo.trainer.critic.Critic`).
        engine: the :class:`~pyppo.rollout.RolloutEngine` that samples (``rollout_engine``).
        resumed_step: the step of the checkpoint :meth:`load_checkpoint` restored (``None``).

    Raises:
        ValueError: a bad argument (naming it), ``config.device`` names a missing device, or a
            batch size does not divide by the number of processes.
    """

    def __init__(self, config: PPOConfig, policy: nn.Module, ref_policy: Optional[nn.Module],
                 value_model: Optional[nn.Module], tokenizer: Any, reward_fn: RewardFn, prompts: Sequence[Any],
                 *, eval_prompts: Optional[Sequence[Any]] = None, base_model_source: Optional[str] = None):
        check_arguments(config, ref_policy, tokenizer, reward_fn, eval_prompts)
        self.world = distributed.join(config.device)
        config.check_world_size(self.world.size)
        # `auto` is resolved once, here, and the config keeps the answer: its checkpoint and the
        # run's config.toml then name the dtype the run trained in, which a resume keeps.
        self.config = c = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, self.world.device)[0])
        self.device, self.dtype = self.world.device, c.torch_dtype
        # Every rank seeds alike, so the models are built identically everywhere; sampling is
        # reseeded per rank below.
        random.seed(c.seed)
        np.random.seed(c.seed % 2**32)
        torch.manual_seed(c.seed)

        self.estimate_advantages = get_estimator(c.advantage_estimator)
        self.policy, self.ref_policy, self.value_model = prepare_models(c, policy, ref_policy, value_model,
                                                                        self.device)
        check_lora_exportable(self.policy, c)
        self.shared_weight_bytes = share_reward_weights(self.ref_policy, reward_fn)
        modules = logprob_modules(c, self.policy, self.ref_policy, self.value_model, self.world, self.dtype)
        self.policy_logprobs, self.policy_module = modules["policy_logprobs"], modules["policy_module"]
        self.value_module, self.ref_logprobs = modules["value_module"], modules["ref_logprobs"]
        self.export_replica = modules["export_replica"]
        n = self.world.size
        self.local_batch_size, self.local_mini_batch_size = c.batch_size // n, c.mini_batch_size // n
        self.micro_batch_size = c.micro_batch_size or self.local_mini_batch_size

        self.tokenizer = prepare_tokenizer(tokenizer)
        self.eos_token_id, self.pad_token_id = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)
        self.generation_config = generation_config(c, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        self.reward_fn = reward_fn
        self.sampler = PromptSampler(prompts, c.seed)
        self.eval_prompts = list(eval_prompts or [])
        self.max_prompt_tokens = check_prompt_sets(c, self.policy, tokenizer, reward_fn,
                                                   {"prompts": prompts, "eval_prompts": self.eval_prompts})
        self.engine: RolloutEngine = make_engine(
            c, policy=self.policy, policy_module=self.policy_module, tokenizer=tokenizer,
            gen_config=self.generation_config, device=self.device, dtype=self.dtype,
            max_prompt_tokens=self.max_prompt_tokens, sharded=distributed.is_sharded(self.policy_module))
        self.engine_sync = EngineSync()

        check_trainable(self.policy, self.value_model, c)
        self.policy_optimizer = make_adamw(self.policy, c.lr, c)
        self.value_optimizer = make_adamw(self.value_model, c.effective_value_lr, c) if c.uses_critic else None
        self.critic = (Critic(self.value_model, self.value_module, self.value_optimizer, c, device=self.device,
                              dtype=self.dtype) if c.uses_critic else None)
        self.kl_ctl = (AdaptiveKLController(c.kl_coef, c.target_kl, c.kl_horizon) if c.target_kl is not None
                       else FixedKLController(c.kl_coef))
        # Minibatch shuffles have their own stream, independent of how much sampling consumed.
        self.shuffle_generator = torch.Generator().manual_seed(c.seed + 1)
        self.skips = SkipPolicy(c.max_consecutive_skips)
        self.step_count = 0
        self.optimizer_steps = 0  # applied ones (skipped updates do not count): the warm-up's clock
        self.base_model_source = base_model_source
        self.resumed_step: Optional[int] = None
        if self.world.active:
            torch.manual_seed(c.seed + 1_000_003 * self.world.rank)  # each rank samples its own responses

    # ------------------------------------------------------------------------------ one step
    def step(self) -> StepResult:
        """Run one PPO step (the eight points of the module docstring).

        Returns:
            a :class:`StepResult`. ``metrics``: :data:`METRIC_KEYS` plus diagnostics; ``kl_mean``
            and ``reward_mean`` are summed over each response's tokens and averaged over
            responses; ``kl_coef`` is the coefficient this step's rewards used; ``score_mean`` is
            of the raw scores; losses and update statistics are means over the applied updates.

        Raises:
            RewardError: the reward raised or returned bad scores.
            NonFiniteUpdateError: ``max_consecutive_skips`` non-finite updates in a row.
        """
        c, timer = self.config, PhaseTimer(absent=() if self.critic is not None else ("value_forward",))
        with timer.phase("weight_sync"):
            self.sync_engine()
        batch, sampled = sample_scored_batch(self, timer)                                 # 1, 2, 3
        first_perm = batch.epoch_permutation(self.shuffle_generator)
        fold = self.first_pass_is_rollout_pass()
        rollout_forwards(self, batch, first_perm, timer, first_policy=not fold)           # 4
        first_forward = first_policy_forward(self, batch, first_perm, timer) if fold else None
        kl_coef = float(self.kl_ctl.value)
        with timer.phase("advantages"):
            rollout = self.advantages(batch, kl_coef)                                     # 5
            mismatch = correct_for_sampler(batch, c.rollout_correction, c.rollout_is_cap, self.world,
                                           type(self.engine).__name__)
        with timer.phase("update"):
            update_metrics = self.update(batch, first_perm, first_forward)                # 6
        kl_sum = float(batch.kl.sum())  # 0 where masked: every sampled token, truncated or not
        kl_mean = distributed.all_sum([kl_sum], self.world)[0] / c.batch_size
        self.update_kl_coef(kl_mean)                                                     # 7
        self.step_count += 1
        metrics = {"step": self.step_count, "kl_mean": kl_mean, "kl_coef": kl_coef,        # 8
                   **rollout, **sampled, **mismatch, **update_metrics, **timer.metrics()}
        return StepResult(distributed.reduce_metrics(metrics, self.world), batch)

    def close(self) -> None:
        """Release the rollout engine, if it holds anything (vLLM: its memory and process
        groups). Under ``torchrun``, call it before the process group is destroyed."""
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()

    def sync_engine(self) -> None:
        """Give an engine that holds its own copy of the policy the current weights
        (:class:`~pyppo.rollout.EngineSync`)."""
        self.engine_sync(self.engine, self.policy, self.optimizer_steps)

    def rollout(self, prompts: List[str]) -> RolloutBuffer:
        """Sample one response per prompt with :attr:`engine` and cut it after its first EOS
        (points 1 and 2), with the policy in eval mode (as the rollout's forwards).

        Raises:
            TypeError, ValueError: the engine returned something other than a
                :class:`~pyppo.rollout.Rollout` of these prompts, in their order.
        """
        self.policy.eval()
        return buffer_from_rollout(self.engine.generate(prompts), prompts, self.engine)

    def score(self, batch: RolloutBuffer, fields: Optional[Dict[str, list]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(raw_scores [B], scores [B])`` of point 3: see :func:`pyppo.trainer.scoring.score_batch`."""
        return score_batch(batch, self.reward_fn, self.config, self.world, self.device,
                           where=f"step {self.step_count + 1}", fields=fields)

    @torch.no_grad()
    def advantages(self, batch: RolloutBuffer, kl_coef: float) -> Dict[str, float]:
        """Fill ``rewards``, ``kl``, ``advantages`` and ``returns`` (point 5). With
        ``mask_truncated``, responses without EOS then leave the loss (their scores served their
        group's baseline). Whitening needs two valid tokens; with fewer, the raw advantages are
        used. Group-normalised estimators (``grpo``, ``rloo``) are not whitened.

        Returns:
            the rollout's metrics (:func:`rollout_metrics`, over every sampled response), and
            ``truncated_masked``, the responses taken out of the loss, with ``mask_truncated``.
        """
        c = self.config
        batch.rewards, batch.kl = shape_rewards(batch.scores, batch.old_logprobs, batch.ref_logprobs,
                                                batch.response_mask, kl_coef=kl_coef, estimator=c.kl_estimator)
        check_rollout(batch, self.world, f"step {self.step_count + 1}")
        batch.advantages, batch.returns = self.estimate_advantages(batch, c)
        metrics = rollout_metrics(batch)
        if c.mask_truncated:
            metrics["truncated_masked"] = mask_truncated(batch.response_mask, batch.advantages, batch.has_eos)
        valid = distributed.all_sum([int(batch.response_mask.sum())], self.world)[0]
        if c.whiten_advantages and self.estimate_advantages.whitened and valid >= 2:
            batch.advantages = distributed.whiten(batch.advantages, batch.response_mask, self.world)
        return metrics

    def first_pass_is_rollout_pass(self) -> bool:
        """Whether the first epoch's first minibatch is one micro-batch, so that its policy
        forward, before any optimizer step, is exactly the rollout's for its rows and need not run
        twice (the other rows still get their no-grad rollout forward). Not with dropout on: the
        rollout's forwards run without it."""
        return self.config.disable_dropout and self.local_mini_batch_size == self.micro_batch_size

    def update_kl_coef(self, kl_mean: float) -> None:
        """Feed this step's KL (nats per sequence) to the controller (point 7)."""
        if math.isfinite(kl_mean):
            self.kl_ctl.update(kl_mean, self.config.batch_size)
        else:
            warnings.warn(f"step {self.step_count + 1}: the rollout's KL is {kl_mean}; the KL coefficient is "
                          "not updated", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------------------ the update
    def update(self, batch: RolloutBuffer, first_perm: torch.Tensor,
               first_forward: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Dict[str, float]:
        """``ppo_epochs`` passes over shuffled minibatches, one optimizer step each (point 6).
        ``first_forward``: :func:`~pyppo.trainer.rollout_forwards.first_policy_forward`'s live output, the first minibatch's
        policy forward.

        Returns:
            token-weighted means of the loss statistics and minibatch means of the losses and
            gradient norms, over the applied updates (``nan`` when all were skipped);
            ``explained_variance`` over every token the update saw; ``skipped_updates``; and
            ``first_*``: the ratio statistics of the first minibatch, before any optimizer step.
        """
        c = self.config
        stats, seen, first, skipped_before = RunningStats(), [], {}, self.skips.total
        self.train_mode(True)
        for epoch in range(c.ppo_epochs):
            perm = first_perm if epoch == 0 else batch.epoch_permutation(self.shuffle_generator)
            for index, mb in enumerate(batch.minibatches(self.local_mini_batch_size, permutation=perm)):
                where = f"step {self.step_count + 1}, epoch {epoch + 1}, minibatch {index + 1}"
                live = first_forward if epoch == 0 and index == 0 else None
                seen_mb = self.minibatch_step(mb, stats, where, first_forward=live)
                first = first or (ratio_stats(seen_mb) if seen_mb else {})
                seen += seen_mb
        self.train_mode(False)
        # The gradients are not needed until the next update: freed now, they do not add to the
        # memory of the next rollout.
        self.zero_grad()
        out = {k: math.nan for k in ("policy_loss", "clipfrac", "approx_kl", "ratio_max")}
        if self.critic is not None and seen:
            values, returns, mask = (torch.cat([getattr(s, k) for s in seen]) for k in ("values", "returns", "response_mask"))
            out.update(value_loss=math.nan,
                       explained_variance=distributed.explained_variance(values, returns, mask, self.world))
        out.update(stats.means(), skipped_updates=self.skips.total - skipped_before)
        return {**out, **{f"first_{k}": v for k, v in first.items()}}

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

    def minibatch_step(self, mb: RolloutBuffer, stats: RunningStats, where: str, *,
                       first_forward: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> List["MicroStepResult"]:
        """One optimizer step of both models on a minibatch, accumulated over its micro-batches;
        skipped when a loss or gradient norm is not finite. Its statistics go into ``stats``
        when applied. Returns the micro-batches' :meth:`micro_step` results. ``first_forward``:
        the live policy forward of the minibatch's only micro-batch (:meth:`micro_step`)."""
        self.zero_grad()
        token_stats, losses = RunningStats(), RunningStats()
        # The whole minibatch's count over all ranks, divided by N because DDP and FSDP average
        # the ranks' gradients: each rank's loss is then its share of the global minibatch's sum.
        count = distributed.all_sum([loss_normalizer(mb.response_mask, self.config.loss_agg)], self.world)[0]
        if count == 0:  # every response of the minibatch left the loss (mask_truncated): nothing to learn
            return []
        normalizer = count / self.world.size
        micros = list(mb.micro_batches(self.micro_batch_size))
        seen = []
        for i, mu in enumerate(micros):
            sync = i == len(micros) - 1  # gradients are reduced once, after the last micro-batch
            value_sync = self.critic.gradient_sync(sync) if self.critic is not None else contextlib.nullcontext()
            with distributed.gradient_sync(self.policy_module, sync), value_sync:
                seen.append(self.micro_step(mu, normalizer, token_stats, losses,
                                                 first_forward=first_forward if i == 0 else None))
        # The micro losses sum to this rank's share; the ranks' shares average to the minibatch's.
        totals = distributed.reduce_metrics({k: losses.total(k) for k in losses.means()}, self.world)
        totals.update(policy_grad_norm=self.clip_grad_norm(self.policy))
        if self.critic is not None:
            totals.update(value_grad_norm=self.clip_grad_norm(self.critic.model))
        if self.skips.allows(totals, where):
            self.warm_up_learning_rates()
            self.policy_optimizer.step()
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
        lr_warmup_steps)`` after ``n`` applied steps (Goyal et al. 2017, "Accurate, Large Minibatch
        SGD", §2.2), then constant."""
        c = self.config
        scale = min(1.0, (self.optimizer_steps + 1) / c.lr_warmup_steps) if c.lr_warmup_steps else 1.0
        for group in self.policy_optimizer.param_groups:
            group["lr"] = c.lr * scale
        if self.critic is not None:
            self.critic.set_lr_scale(scale)

    def micro_step(self, mu: RolloutBuffer, normalizer: float, token_stats: RunningStats, losses: RunningStats,
                   *, first_forward: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> MicroStepResult:
        """Forward and backward of one micro-batch. The losses are divided by the minibatch's
        ``normalizer``, so the accumulated gradient (and the sum of the micro-batch losses) is the
        minibatch's. The policy's backward runs before the value model's forward, so the two
        models' activations are never held at once. ``first_forward``: the policy's live
        ``(logprobs, entropy)`` of ``mu`` (``rollout_forwards.first_policy_forward``), trained on
        instead of a new forward."""
        c = self.config
        objective = PolicyObjective(
            cliprange_low=c.cliprange, cliprange_high=c.effective_cliprange_high, dual_clip=c.dual_clip,
            loss_agg=c.loss_agg, loss_agg_norm=c.effective_loss_agg_norm, normalizer=normalizer,
            entropy_coef=c.entropy_coef, kl_loss_coef=c.kl_loss_coef, kl_loss_estimator=c.kl_loss_estimator,
            fused=c.fused_policy_loss, policy_loss=c.policy_loss)
        if first_forward is None:
            with autocast(self.device, self.dtype):
                pg_loss, pg_stats, logprobs, _ = self.policy_module(mu, objective=objective)
        else:
            logprobs, entropy = first_forward
            pg_loss, pg_stats = policy_objective(logprobs, entropy, mu, objective)
            logprobs = logprobs.detach()
        pg_loss.backward()
        terms = {k: float(pg_stats.pop(k)) for k in ("policy_loss", "kl_loss", "entropy_loss") if k in pg_stats}
        vf_stats, values = {}, mu.values
        if self.critic is not None:
            terms["value_loss"], vf_stats, values = self.critic.loss_backward(mu, normalizer)
        losses.add(terms)
        record_token_stats(token_stats, {**pg_stats, **vf_stats}, int(mu.response_mask.sum()))
        return MicroStepResult(logprobs, mu.old_logprobs, values, mu.returns, mu.response_mask)

    def clip_grad_norm(self, model: nn.Module) -> float:
        """Clip ``model``'s gradient norm to ``max_grad_norm``; returns the norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor

    # ------------------------------------------------------------------------------ state and the run
    def state_dict(self) -> dict:
        """Where the run is, apart from weights and RNGs: the step, the applied optimizer steps,
        the KL controller, the prompt position, the shuffle generator and the skip counters (what
        a checkpoint's ``trainer_state.pt`` holds beside them)."""
        return {"step": self.step_count, "optimizer_steps": self.optimizer_steps, "kl_ctl": self.kl_ctl.state_dict(),
                "sampler": self.sampler.state_dict(), "shuffle_generator": self.shuffle_generator.get_state(),
                **self.skips.state_dict()}

    def load_state_dict(self, st: dict) -> None:
        """Put back what :meth:`state_dict` returned."""
        self.kl_ctl.load_state_dict(st["kl_ctl"])
        self.sampler.load_state_dict(st["sampler"])
        self.shuffle_generator.set_state(st["shuffle_generator"])
        self.skips.load_state_dict(st)
        self.step_count = int(st["step"])
        # Checkpoints from before the warm-up existed: their runs are past any warm-up.
        self.optimizer_steps = int(st.get("optimizer_steps", 2**62))

    def train(self, output_dir: str | os.PathLike, *, progress: bool = True,
              stop: Optional[GracefulStop] = None) -> List[Dict[str, float]]:
        """Run steps ``step_count + 1 … config.steps``, logging to ``output_dir``: see
        :func:`pyppo.run.loop.train`."""
        return loop.train(self, output_dir, progress=progress, stop=stop)

    def evaluate_prompts(self, prompts: Optional[Sequence[str]] = None) -> Tuple[Dict[str, float], List[dict]]:
        """Held-out evaluation (``eval_prompts`` by default): see :func:`pyppo.run.evaluate.evaluate_prompts`."""
        return evaluate.evaluate_prompts(self, prompts)

    def save_checkpoint(self, directory: str | os.PathLike) -> Optional[Path]:
        """Write everything needed to resume exactly: see :func:`pyppo.run.checkpoint.save_trainer`."""
        return run_checkpoint.save_trainer(self, directory)

    def load_checkpoint(self, directory: str | os.PathLike) -> Path:
        """Restore a checkpoint of :meth:`save_checkpoint`: see :func:`pyppo.run.checkpoint.load_trainer`."""
        path = run_checkpoint.load_trainer(self, directory)
        self.engine_sync.weights_loaded()
        return path

    def export_policy(self, directory: str | os.PathLike) -> Optional[Path]:
        """Write the policy as a Hugging Face model directory: see :func:`pyppo.run.export.export_trainer_policy`."""
        return export.export_trainer_policy(self, directory)
