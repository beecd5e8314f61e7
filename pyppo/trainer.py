"""The PPO loop for language models. ``docs/trainer.md`` walks through it; each step is:

1. take ``batch_size`` prompts and sample a response to each (pure sampling at ``temperature``);
2. cut each response after its first EOS;
3. score each (prompt, response); clip the score, then subtract ``missing_eos_penalty``;
4. without gradients: ``old_logprobs`` and the entropy (policy), ``ref_logprobs`` (frozen
   reference), ``values`` (value model), at the response positions;
5. ``shape_rewards`` -> ``gae`` -> ``masked_whiten`` of the advantages over the whole batch;
6. ``ppo_epochs`` passes over shuffled minibatches (gradient accumulation over micro-batches):
   ``policy_loss + vf_coef * value_loss - entropy_coef * entropy``, gradient clipping, AdamW;
7. update the KL coefficient (adaptive when ``target_kl`` is set);
8. return the step's metrics and its batch.

The first PPO ratio is exactly 1: the first epoch's row order is drawn before step 4, and step 4
runs on exactly the micro-batches (same rows, order and padding) that the first epoch trains on,
so the first training forward repeats a computation bit for bit, batch-invariant model or not.
That holds in bfloat16 too (every forward runs under the same autocast) and with LoRA (the
reference is the policy with its adapters disabled, and the adapters start at 0).

Under ``torchrun`` each of the N processes samples ``batch_size / N`` prompts of one global order
and trains on its share of each minibatch; :mod:`pyppo.distributed` makes the whitening, the loss
normaliser, the KL controller's input and the metrics global, and DDP or FSDP2 the gradients.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from . import checkpoint, distributed
from .buffer import RolloutBuffer
from .config import PPOConfig
from .forward import AdaptersDisabled, LogprobHead, PolicyObjective, autocast, policy_objective, response_values
from .kl_control import AdaptiveKLController, FixedKLController
from .lora import add_lora
from .ops import gae, kl_penalty, masked_mean, shape_rewards
from .ops.losses import LOG_RATIO_CLAMP, loss_normalizer, ppo_value_loss
from .prompts import PromptSampler
from .rewards import SequenceClassifierReward, score_responses
from .rollout import (check_prompt_lengths, encode_prompts, generation_config, prompt_token_limit,
                      response_mask_from_eos)
from .skips import NonFiniteUpdateError, SkipPolicy, check_rollout_finite
from .stopping import GracefulStop, StepAbandoned
from .stats import PHASES, PhaseTimer, RunningStats

__all__ = ["PPOTrainer", "StepResult", "METRIC_KEYS", "NonFiniteUpdateError"]

#: Keys every step's metrics have; diagnostics come on top (``step``, ``clipfrac_lower``,
#: ``ratio_mean``, ``ratio_max``, ``vf_clipfrac``, grad norms, ``eos_fraction``, ``first_*``...).
METRIC_KEYS = (
    "score_mean", "reward_mean", "kl_mean", "kl_coef", "entropy_mean", "policy_loss", "value_loss",
    "clipfrac", "approx_kl", "explained_variance", "response_length_mean", "step_seconds",
) + tuple(f"time_{p}" for p in PHASES)

RewardFn = Callable[[List[str], List[str]], Sequence[float]]


@dataclass
class StepResult:
    """What :meth:`PPOTrainer.step` returns: its ``metrics`` (python numbers) and its ``batch``
    (prompts, responses, raw and final scores, and every per-token tensor of the step)."""

    metrics: Dict[str, float]
    batch: RolloutBuffer

    def __iter__(self):  # metrics, batch = trainer.step()
        return iter((self.metrics, self.batch))


def prepare_models(c: PPOConfig, policy: nn.Module, ref_policy: Optional[nn.Module], value_model: Optional[nn.Module],
                   device: torch.device) -> tuple:
    """``(policy, reference or None, value model)`` on ``device``, as ``c`` asks: the reference a
    frozen copy of the policy (none with LoRA: the adapters are disabled instead), the value model
    a copy of the policy's backbone with a scalar head (taken before any adapter is added), LoRA,
    dropout off, gradient checkpointing.

    Raises:
        ValueError: ``value_lora`` without a value model that has a ``.backbone``; a model that
            cannot checkpoint; ``lora_target_modules`` matching nothing.
    """
    from .models import ValueModel, make_reference

    policy = policy.to(device)
    ref = None
    if not c.lora_rank:
        ref = (ref_policy if ref_policy is not None else make_reference(policy)).to(device)
        ref.requires_grad_(False).eval()
    value_model = (value_model if value_model is not None else ValueModel.from_causal_lm(policy)).to(device)
    if c.lora_rank:
        policy = add_lora(policy, rank=c.lora_rank, alpha=c.lora_alpha, targets=c.lora_target_modules)
    if c.value_lora:
        if not isinstance(getattr(value_model, "backbone", None), nn.Module):
            raise ValueError("value_lora needs a value model with a .backbone module (a pyppo ValueModel)")
        value_model.backbone = add_lora(value_model.backbone, rank=c.lora_rank, alpha=c.lora_alpha,
                                        targets=c.lora_target_modules)
    if c.disable_dropout:
        disable_dropout(policy)
        disable_dropout(value_model)
    if c.gradient_checkpointing:
        enable_gradient_checkpointing(policy, "policy")
        enable_gradient_checkpointing(getattr(value_model, "backbone", value_model), "value model")
    return policy, ref, value_model


def make_adamw(model: nn.Module, lr: float, c: PPOConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters; the fused kernel where it applies (plain CPU
    or CUDA tensors): one pass over each parameter's state instead of the multi-tensor
    implementation's temporaries, each as large as the parameters (faster, and a smaller peak)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, eps=c.adam_eps, weight_decay=c.weight_decay, fused=fused or None)


def share_reward_weights(ref: Optional[nn.Module], reward_fn: RewardFn) -> int:
    """Bytes of a classifier reward model's weights now shared with the frozen reference (equal
    and frozen in both: :func:`pyppo.models.share_frozen_weights`); 0 for other rewards, or without
    a separate reference (LoRA)."""
    from .models import share_frozen_weights

    reward = getattr(reward_fn, "__wrapped__", reward_fn)  # load_reward's validating wrapper
    if ref is None or not isinstance(reward, SequenceClassifierReward):
        return 0
    return share_frozen_weights(ref, reward.model)


def enable_gradient_checkpointing(model: nn.Module, what: str) -> None:
    """Recompute ``model``'s block activations in the backward (transformers' own checkpointing,
    non-reentrant, so frozen inputs and LoRA need nothing more).

    Raises:
        ValueError: ``model`` is not a ``transformers`` model that supports it.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: the {what} ({type(model).__name__}) does not support it")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0 (modules and HF attention attributes)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # HF attention modules keep their dropout as a float applied only in train mode.
        for attr in ("attention_dropout", "attn_dropout", "dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)


class PPOTrainer:
    """PPO for a causal LM policy with a separate value model.

    Args:
        config: a :class:`~pyppo.config.PPOConfig`; ``config.device`` says where the models run
            (they are moved there).
        policy: a ``transformers`` causal LM (trained in place).
        ref_policy: frozen reference; ``None`` = a frozen deep copy of ``policy`` taken now.
        value_model: ``forward(input_ids, attention_mask, position_ids) -> [B, L]`` float32;
            ``None`` = ``ValueModel.from_causal_lm(policy)`` (seeded by ``config.seed``).
        tokenizer: the policy's tokenizer; needs an EOS token. Its ``padding_side`` is set to
            ``"left"``; a missing pad token is taken to be EOS.
        reward_fn: ``(prompts, responses) -> scores``, one finite float per pair.
        prompts: the prompt strings to sample from.
        eval_prompts: held-out prompts for :meth:`evaluate_prompts`; :meth:`train` evaluates them
            every ``eval_every`` steps and after the last.

    With ``lora_rank > 0`` the policy is wrapped in ``peft`` LoRA adapters here (``policy`` then
    holds the ``PeftModel``) and ``ref_policy`` must be ``None``. Under ``torchrun`` every rank
    builds the trainer with the same arguments.

    Attributes:
        world: this process's :class:`~pyppo.distributed.World` (rank, number of processes, device).
        policy_module, value_module: the models as the forwards call them (DDP- or FSDP2-wrapped
            under torchrun); ``policy`` and ``value_model`` are the models themselves.
        base_model_source: what an adapter-only ``policy/`` names as its base (``build_trainer``
            sets it to the ``--model`` spec); ``None`` = peft's record of the base's path.

    Raises:
        ValueError: a bad argument (naming it), ``config.device`` names a missing device, or a
            batch size does not divide by the number of processes.
    """

    def __init__(self, config: PPOConfig, policy: nn.Module, ref_policy: Optional[nn.Module],
                 value_model: Optional[nn.Module], tokenizer: Any, reward_fn: RewardFn, prompts: Sequence[str],
                 *, eval_prompts: Optional[Sequence[str]] = None):
        if not isinstance(config, PPOConfig):
            raise ValueError(f"config must be a PPOConfig, got {type(config).__name__}")
        if not callable(reward_fn):
            raise ValueError("reward_fn must be callable (prompts, responses) -> scores")
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("tokenizer must have an eos_token_id")
        if config.lora_rank and ref_policy is not None:
            raise ValueError("ref_policy must be None with lora_rank > 0: the reference is the policy with its "
                             "adapters disabled")
        if config.eval_every and not eval_prompts:
            raise ValueError(f"eval_every = {config.eval_every} needs eval_prompts (a non-empty list of prompts)")
        if eval_prompts is not None and not all(isinstance(p, str) for p in eval_prompts):
            raise ValueError("eval_prompts must be a list of strings")
        self.config = c = config
        self.world = distributed.join(c.device)
        c.check_world_size(self.world.size)
        self.device, self.dtype = self.world.device, c.torch_dtype
        # Every rank seeds alike, so the models are built identically everywhere; sampling is
        # reseeded per rank below.
        random.seed(c.seed)
        np.random.seed(c.seed % 2**32)
        torch.manual_seed(c.seed)

        self.policy, self.ref_policy, self.value_model = prepare_models(c, policy, ref_policy, value_model,
                                                                        self.device)
        self.shared_weight_bytes = share_reward_weights(self.ref_policy, reward_fn)
        head = LogprobHead(self.policy, temperature=c.temperature, from_hidden=c.logprobs_from_hidden,
                           dtype=self.dtype)
        # FSDP2 shards the policy in place; rank 0 keeps its structure (no weights) to export into.
        self._export_replica = None
        if c.fsdp and self.world.active and self.world.is_main:
            self._export_replica = copy.deepcopy(self.policy).to("meta")
        self.policy_module = distributed.wrap(head, self.world, fsdp=c.fsdp)
        self.value_module = distributed.wrap(self.value_model, self.world, fsdp=c.fsdp)
        self.policy_logprobs = head
        if c.lora_rank:
            self.ref_logprobs = AdaptersDisabled(self.policy_module, head)
        else:
            self.ref_logprobs = LogprobHead(self.ref_policy, temperature=c.temperature,
                                            from_hidden=c.logprobs_from_hidden, dtype=self.dtype)
        n = self.world.size
        self.local_batch_size, self.local_mini_batch_size = c.batch_size // n, c.mini_batch_size // n
        self.micro_batch_size = c.micro_batch_size or self.local_mini_batch_size

        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token  # padding is masked out everywhere
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.generation_config = generation_config(c, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        self.reward_fn = reward_fn
        self.sampler = PromptSampler(prompts, c.seed)
        self.eval_prompts = list(eval_prompts or [])
        # Checked once, up front: a prompt the context cannot hold would otherwise make generation
        # crawl past the model's positions.
        self.max_prompt_tokens, room = prompt_token_limit(self.policy, max_new_tokens=c.max_new_tokens,
                                                          max_prompt_length=c.max_prompt_length)
        for what, texts in (("prompts", prompts), ("eval_prompts", self.eval_prompts)):
            check_prompt_lengths(tokenizer, texts, use_chat_template=c.use_chat_template, room=room,
                                 max_new_tokens=c.max_new_tokens, max_prompt_length=c.max_prompt_length,
                                 truncate=c.truncate_prompts, what=what)

        for what, model in (("policy", self.policy), ("value model", self.value_model)):
            if not any(p.requires_grad for p in model.parameters()):
                raise ValueError(f"the {what} has no trainable parameter (lora_target_modules = "
                                 f"{c.lora_target_modules!r}, lora_rank = {c.lora_rank})")
        self.policy_optimizer = make_adamw(self.policy, c.lr, c)
        self.value_optimizer = make_adamw(self.value_model, c.effective_value_lr, c)
        self.kl_ctl = (AdaptiveKLController(c.kl_coef, c.target_kl, c.kl_horizon) if c.target_kl is not None
                       else FixedKLController(c.kl_coef))
        # Minibatch shuffles have their own stream, independent of how much sampling consumed.
        self.shuffle_generator = torch.Generator().manual_seed(c.seed + 1)
        self.skips = SkipPolicy(c.max_consecutive_skips)
        self.step_count = 0
        self.optimizer_steps = 0  # applied ones (skipped updates do not count): the warm-up's clock
        self.base_model_source: Optional[str] = None
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
        c, timer = self.config, PhaseTimer()
        with timer.phase("generate"):
            batch = self.rollout(self.local_share(self.sampler.sample(c.batch_size)))    # 1, 2
        with timer.phase("score"):
            batch.raw_scores, batch.scores = self.score(batch)                           # 3
        first_perm = batch.epoch_permutation(self.shuffle_generator)
        kl_coef = float(self.kl_ctl.value)
        # When the first minibatch is one micro-batch, its first policy forward is the rollout's
        # for its rows: point 4's policy forward of those rows and point 5 happen inside it.
        first_pass = self.first_pass_is_rollout_pass()
        self.evaluate(batch, first_perm, timer, first_policy=not first_pass)              # 4
        if not first_pass:
            with timer.phase("advantages"):
                self.advantages(batch, kl_coef)                                           # 5
        with timer.phase("update"):
            update_metrics = self.update(batch, first_perm, kl_coef if first_pass else None)  # 6
        kl_sum = float((batch.kl * batch.response_mask).sum())
        kl_mean = distributed.all_sum([kl_sum], self.world)[0] / c.batch_size
        self.update_kl_coef(kl_mean)                                                     # 7
        self.step_count += 1
        metrics = {"step": self.step_count, "kl_mean": kl_mean, "kl_coef": kl_coef,        # 8
                   **rollout_metrics(batch), **update_metrics, **timer.metrics()}
        return StepResult(distributed.reduce_metrics(metrics, self.world), batch)

    def local_share(self, prompts: List[str]) -> List[str]:
        """This rank's contiguous share of the global batch's prompts (all of them with one process)."""
        b, r = self.local_batch_size, self.world.rank
        return prompts[r * b:(r + 1) * b]

    def rollout(self, prompts: List[str]) -> RolloutBuffer:
        """Sample one response per prompt and cut it after its first EOS (points 1 and 2)."""
        c = self.config
        query_ids, query_mask = encode_prompts(self.tokenizer, prompts, use_chat_template=c.use_chat_template,
                                               max_prompt_length=self.max_prompt_tokens, device=self.device)
        self.policy.eval()
        # FSDP2: every decode step all-gathers, so synced_gpus keeps each rank stepping until all
        # are done.
        extra = {"synced_gpus": True} if distributed.is_sharded(self.policy_module) else {}
        with torch.no_grad(), autocast(self.device, self.dtype):  # no_grad: DDP then expects no backward
            sequences = self.policy_module(None, sample=(query_ids, query_mask, self.generation_config, extra))
        response_ids = sequences[:, query_ids.shape[1]:]
        response_mask, lengths, has_eos = response_mask_from_eos(response_ids, self.eos_token_id)
        response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, self.pad_token_id))
        responses = self.tokenizer.batch_decode(
            [row[:n].tolist() for row, n in zip(response_ids.cpu(), lengths.tolist())], skip_special_tokens=True)
        return RolloutBuffer(query_ids=query_ids, query_mask=query_mask, response_ids=response_ids,
                             response_mask=response_mask, has_eos=has_eos, prompts=prompts, responses=responses)

    def score(self, batch: RolloutBuffer) -> tuple[torch.Tensor, torch.Tensor]:
        """``(raw_scores [B], scores [B])``: the reward's scores, then clipped to ``score_clip`` and
        lowered by ``missing_eos_penalty`` where the response has no EOS (point 3)."""
        c = self.config
        raw = torch.tensor(score_responses(self.reward_fn, batch.prompts, batch.responses,
                                           where=f"step {self.step_count + 1}"),
                           dtype=torch.float32, device=self.device)
        scores = raw if c.score_clip is None else raw.clamp(-c.score_clip, c.score_clip)
        if c.missing_eos_penalty is not None:
            scores = scores - c.missing_eos_penalty * (~batch.has_eos).float()
        return raw, scores

    @torch.no_grad()
    def advantages(self, batch: RolloutBuffer, kl_coef: float) -> None:
        """Fill ``rewards``, ``kl``, ``advantages`` and ``returns`` (point 5). Whitening needs two
        valid tokens; with fewer, the raw advantages are used."""
        c = self.config
        batch.rewards, batch.kl = shape_rewards(batch.scores, batch.old_logprobs, batch.ref_logprobs,
                                                batch.response_mask, kl_coef=kl_coef, estimator=c.kl_estimator)
        self.check_finite(batch)
        batch.advantages, batch.returns = gae(batch.rewards, batch.values, batch.response_mask,
                                              gamma=c.gamma, lam=c.lam)
        valid = distributed.all_sum([int(batch.response_mask.sum())], self.world)[0]
        if c.whiten_advantages and valid >= 2:
            batch.advantages = distributed.whiten(batch.advantages, batch.response_mask, self.world)

    def check_finite(self, batch: RolloutBuffer) -> None:
        """Stop with :class:`~pyppo.skips.NonFiniteRolloutError` when the rollout's log-probs,
        values or rewards hold NaN/inf at response positions (counted over every rank)."""
        m = batch.response_mask
        names = ("old_logprobs", "ref_logprobs", "values", "rewards")
        counts = [int((~torch.isfinite(getattr(batch, name)) & m).sum()) for name in names] + [int(m.sum())]
        counts = distributed.all_sum(counts, self.world)
        check_rollout_finite(dict(zip(names, counts[:-1])), counts[-1], f"step {self.step_count + 1}")

    def first_pass_is_rollout_pass(self) -> bool:
        """Whether the first epoch's first minibatch is one micro-batch, so that its policy
        forward, before any optimizer step, is exactly the rollout's for its rows and need not run
        twice (the other rows still get their no-grad rollout forward). Not with dropout on: the
        rollout's forwards run without it."""
        return self.config.disable_dropout and self.local_mini_batch_size == self.micro_batch_size

    @torch.no_grad()
    def evaluate(self, batch: RolloutBuffer, first_perm: torch.Tensor, timer: PhaseTimer, *,
                 first_policy: bool = True) -> None:
        """Fill ``old_logprobs``, ``entropy``, ``ref_logprobs`` and ``values`` (point 4), on the
        micro-batches of the first epoch's layout (``first_policy=False``: the first micro-batch's
        ``old_logprobs`` and ``entropy`` are left to the first update pass)."""
        B, T = len(batch), batch.response_length
        for name in ("old_logprobs", "entropy", "ref_logprobs", "values"):
            setattr(batch, name, torch.zeros(B, T, device=self.device))
        self.value_model.eval()
        for i, idx in enumerate(first_perm.split(self.micro_batch_size)):
            mb, ix = batch.select(idx), idx.to(self.device)
            with autocast(self.device, self.dtype):
                if first_policy or i > 0:
                    with timer.phase("policy_forward"):
                        batch.old_logprobs[ix], batch.entropy[ix] = self.policy_module(mb, return_entropy=True)
                with timer.phase("ref_forward"):
                    batch.ref_logprobs[ix] = self.ref_logprobs(mb)[0]
                with timer.phase("value_forward"):
                    batch.values[ix] = response_values(self.value_module, mb)

    def update_kl_coef(self, kl_mean: float) -> None:
        """Feed this step's KL (nats per sequence) to the controller (point 7)."""
        if math.isfinite(kl_mean):
            self.kl_ctl.update(kl_mean, self.config.batch_size)
        else:
            warnings.warn(f"step {self.step_count + 1}: the rollout's KL is {kl_mean}; the KL coefficient is "
                          "not updated", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------------------ the update
    def update(self, batch: RolloutBuffer, first_perm: torch.Tensor, kl_coef: Optional[float] = None) -> Dict[str, float]:
        """``ppo_epochs`` passes over shuffled minibatches, one optimizer step each (point 6).
        ``kl_coef`` given: the first minibatch's pass is also the rollout's policy forward of its
        rows, and computes the advantages with this coefficient (:meth:`first_pass_is_rollout_pass`).

        Returns:
            token-weighted means of the loss statistics and minibatch means of the losses and
            gradient norms, over the applied updates (``nan`` when all were skipped);
            ``explained_variance`` over every token the update saw; ``skipped_updates``; and
            ``first_*``: the ratio statistics of the first minibatch, before any optimizer step.
        """
        c = self.config
        stats, seen, first, skipped_before = RunningStats(), [], {}, self.skips.total
        self.policy.train()
        self.value_model.train()
        for epoch in range(c.ppo_epochs):
            perm = first_perm if epoch == 0 else batch.epoch_permutation(self.shuffle_generator)
            for index, mb in enumerate(batch.minibatches(self.local_mini_batch_size, permutation=perm)):
                where = f"step {self.step_count + 1}, epoch {epoch + 1}, minibatch {index + 1}"
                first_pass = epoch == 0 and index == 0 and kl_coef is not None
                rollout = (batch, perm[:len(mb)], kl_coef) if first_pass else None
                seen_mb = self.minibatch_step(mb, stats, where, rollout=rollout)
                first = first or ratio_stats(seen_mb)
                seen += seen_mb
        self.policy.eval()
        self.value_model.eval()
        # The gradients are not needed until the next update: freed now, they do not add to the
        # memory of the next rollout.
        self.policy_optimizer.zero_grad(set_to_none=True)
        self.value_optimizer.zero_grad(set_to_none=True)
        out = {k: math.nan for k in ("policy_loss", "value_loss", "clipfrac", "approx_kl", "ratio_max")}
        values, returns, mask = (torch.cat(t) for t in zip(*[s[2:] for s in seen]))
        out.update(stats.means(), explained_variance=distributed.explained_variance(values, returns, mask, self.world),
                   skipped_updates=self.skips.total - skipped_before)
        return {**out, **{f"first_{k}": v for k, v in first.items()}}

    def minibatch_step(self, mb: RolloutBuffer, stats: RunningStats, where: str, *,
                       rollout: Optional[tuple] = None) -> list:
        """One optimizer step of both models on a minibatch, accumulated over its micro-batches;
        skipped when a loss or gradient norm is not finite. Its statistics go into ``stats``
        when applied. Returns the micro-batches' :meth:`micro_step` results. ``rollout``: see
        :meth:`micro_step` (the minibatch is then one micro-batch)."""
        self.policy_optimizer.zero_grad(set_to_none=True)
        self.value_optimizer.zero_grad(set_to_none=True)
        token_stats, losses = RunningStats(), RunningStats()
        # The whole minibatch's count over all ranks, divided by N because DDP and FSDP average
        # the ranks' gradients: each rank's loss is then its share of the global minibatch's sum.
        count = distributed.all_sum([loss_normalizer(mb.response_mask, self.config.loss_agg)], self.world)[0]
        normalizer = count / self.world.size
        micros = list(mb.micro_batches(self.micro_batch_size))
        seen = []
        for i, mu in enumerate(micros):
            sync = i == len(micros) - 1  # gradients are reduced once, after the last micro-batch
            with distributed.gradient_sync(self.policy_module, sync), distributed.gradient_sync(self.value_module, sync):
                seen.append(self.micro_step(mu, normalizer, token_stats, losses, rollout=rollout))
        # The micro losses sum to this rank's share; the ranks' shares average to the minibatch's.
        totals = distributed.reduce_metrics({k: losses.total(k) for k in losses.means()}, self.world)
        totals.update(policy_grad_norm=self.clip_grad_norm(self.policy),
                      value_grad_norm=self.clip_grad_norm(self.value_model))
        if self.skips.allows(totals, where):
            self.warm_up_learning_rates()
            self.policy_optimizer.step()
            self.value_optimizer.step()
            self.optimizer_steps += 1
            stats.merge(token_stats)
            stats.add(totals)
        else:
            self.policy_optimizer.zero_grad(set_to_none=True)
            self.value_optimizer.zero_grad(set_to_none=True)
        return seen

    def warm_up_learning_rates(self) -> None:
        """Set both learning rates for the next optimizer step: ``lr · min(1, (n + 1) /
        lr_warmup_steps)`` after ``n`` applied steps (Goyal et al. 2017, "Accurate, Large Minibatch
        SGD", §2.2), then constant."""
        c = self.config
        scale = min(1.0, (self.optimizer_steps + 1) / c.lr_warmup_steps) if c.lr_warmup_steps else 1.0
        for opt, lr in ((self.policy_optimizer, c.lr), (self.value_optimizer, c.effective_value_lr)):
            for group in opt.param_groups:
                group["lr"] = lr * scale

    def micro_step(self, mu: RolloutBuffer, normalizer: float, token_stats: RunningStats,
                   losses: RunningStats, *, rollout: Optional[tuple] = None) -> tuple:
        """Forward and backward of one micro-batch. The losses are divided by the minibatch's
        ``normalizer``, so the accumulated gradient (and the sum of the micro-batch losses) is the
        minibatch's. The policy's backward runs before the value model's forward, so the two
        models' activations are never held at once.

        ``rollout = (batch, rows, kl_coef)``: ``mu`` is ``batch``'s ``rows``, in that order, and
        this pass, before any optimizer step, is also the rollout's policy forward of those rows:
        it fills their ``old_logprobs`` and ``entropy`` (the other rows' are already there) and
        computes the whole batch's advantages (points 4 and 5) before its loss. (The value
        model's rollout forward stays separate: reusing it too would hold both models' activations
        at once.)

        Returns the detached ``(logprobs, old_logprobs, values, returns, mask)``, ``[b, T]``."""
        c = self.config
        objective = PolicyObjective(
            cliprange_low=c.cliprange, cliprange_high=c.effective_cliprange_high, dual_clip=c.dual_clip,
            loss_agg=c.loss_agg, loss_agg_norm=c.effective_loss_agg_norm, normalizer=normalizer,
            entropy_coef=c.entropy_coef, kl_loss_coef=c.kl_loss_coef, kl_loss_estimator=c.kl_loss_estimator,
            fused=c.fused_policy_loss)
        if rollout is None:
            with autocast(self.device, self.dtype):
                pg_loss, pg_stats, logprobs, _ = self.policy_module(mu, objective=objective)
            pg_loss.backward()
            with autocast(self.device, self.dtype):
                values = response_values(self.value_module, mu)
        else:
            with autocast(self.device, self.dtype):
                logprobs, entropy = self.policy_module(mu, return_entropy=True)
            self.fill_rollout(rollout, mu, logprobs.detach(), entropy.detach())
            pg_loss, pg_stats = policy_objective(logprobs, entropy, mu, objective)
            pg_loss.backward()
            logprobs = logprobs.detach()
            with autocast(self.device, self.dtype):
                values = response_values(self.value_module, mu)
        vf_loss, vf_stats = ppo_value_loss(values, mu.values, mu.returns, mu.response_mask,
                                           cliprange_value=c.cliprange_value, loss_agg=c.loss_agg,
                                           loss_agg_norm=c.effective_loss_agg_norm, normalizer=normalizer)
        (c.vf_coef * vf_loss).backward()
        terms = {k: pg_stats.pop(k) for k in ("policy_loss", "kl_loss", "entropy_loss") if k in pg_stats}
        losses.add({"value_loss": float(vf_loss.detach()), **{k: float(v) for k, v in terms.items()}})
        record_token_stats(token_stats, {**pg_stats, **vf_stats}, int(mu.response_mask.sum()))
        return logprobs, mu.old_logprobs, values.detach(), mu.returns, mu.response_mask

    def fill_rollout(self, rollout: tuple, mu: RolloutBuffer, logprobs: torch.Tensor, entropy: torch.Tensor) -> None:
        """Points 4 and 5 from the first pass's own policy forward (see :meth:`micro_step`): write
        it into the batch, compute the advantages, and give ``mu`` its rows of the results."""
        batch, rows, kl_coef = rollout
        ix = rows.to(self.device)
        batch.old_logprobs[ix], batch.entropy[ix] = logprobs, entropy
        self.advantages(batch, kl_coef)
        for name in ("old_logprobs", "entropy", "rewards", "kl", "advantages", "returns"):
            setattr(mu, name, getattr(batch, name)[ix])

    def clip_grad_norm(self, model: nn.Module) -> float:
        """Clip ``model``'s gradient norm to ``max_grad_norm``; returns the norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor

    # ------------------------------------------------------------------------------ the run
    def train(self, output_dir: str | os.PathLike, *, progress: bool = True,
              stop: Optional[GracefulStop] = None) -> List[Dict[str, float]]:
        """Run steps ``step_count + 1 … config.steps``, logging to ``output_dir``.

        Appends one JSON object per step to ``metrics.jsonl`` and, with ``log_samples``, one per
        sample (``step``, ``prompt``, ``response``, raw ``score``) to ``samples.jsonl``; with
        ``eval_every``, evaluates on the eval prompts (:meth:`evaluate_prompts`), adds ``eval/*`` to
        that step's row and appends the samples to ``eval_samples.jsonl``. Every ``save_every``
        steps and after the last step it writes ``checkpoint/`` and the policy as a Hugging Face
        directory, ``policy/``. Rows logged after the checkpoint being resumed (a run killed before
        it checkpointed them) and a torn last line are dropped first, with a warning. To resume,
        call :meth:`load_checkpoint` first. With several processes every rank calls this; rank 0
        writes.

        ``stop`` (installed :class:`~pyppo.stopping.GracefulStop` handlers): after a SIGINT or
        SIGTERM the loop ends after the current step, or without it when a second signal abandons
        it (the state of the last finished step is put back), and a checkpoint of the last
        finished step is written if none is; then this returns (``self.step_count`` tells where it
        stopped).

        Returns:
            the metrics of the steps run now.

        Raises:
            NonFiniteUpdateError: as :meth:`step`; the step is neither logged nor checkpointed,
                and the message names the last good checkpoint.
        """
        from tqdm.auto import tqdm

        out, c, main = Path(output_dir), self.config, self.world.is_main
        if main:
            out.mkdir(parents=True, exist_ok=True)
            for log in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):
                checkpoint.truncate_log(out / log, self.step_count)
        history: List[Dict[str, float]] = []
        # The step the newest checkpoint holds, when it is the current state (0: nothing to save).
        saved_step = self.step_count if self.step_count in (0, getattr(self, "_loaded_step", None)) else None
        stopped = False
        hooks = [] if stop is None else (
            [opt.register_step_pre_hook(stop.commit) for opt in (self.policy_optimizer, self.value_optimizer)]
            + [m.register_forward_pre_hook(stop.poll) for m in (self.policy, self.ref_policy, self.value_model)
               if m is not None])
        with tqdm(total=c.steps, initial=self.step_count, desc="ppo", disable=not (progress and main),
                  dynamic_ncols=True) as bar, _removing(hooks):
            while self.step_count < c.steps:
                if stop is not None and stop.should_stop(lambda v: distributed.all_sum(v, self.world)):
                    stopped = True
                    break
                start_state = self._step_start_state() if stop is not None else None
                try:
                    with stop.step() if stop is not None else contextlib.nullcontext():
                        result = self.step()
                except StepAbandoned:
                    self._restore_step_start(start_state)
                    stopped = True
                    break
                except NonFiniteUpdateError as exc:
                    last = checkpoint.find(out / "checkpoint")
                    where = ("no checkpoint was written" if last is None else
                             f"the last good checkpoint is {str(last)!r} (step {checkpoint.saved_step(last)})")
                    raise NonFiniteUpdateError(f"{exc}; {where}") from exc
                last_step = self.step_count == c.steps
                eval_rows: List[dict] = []
                if self.eval_prompts and (last_step or (c.eval_every and self.step_count % c.eval_every == 0)):
                    eval_metrics, eval_rows = self.evaluate_prompts()
                    result.metrics.update(eval_metrics)
                history.append(result.metrics)
                self._log(out, result, eval_rows)
                bar.update(1)
                bar.set_postfix(score=f"{result.metrics['score_mean']:.3f}", kl=f"{result.metrics['kl_mean']:.3f}")
                if last_step or (c.save_every and self.step_count % c.save_every == 0):
                    with stop.save() if stop is not None else contextlib.nullcontext():
                        self.save_checkpoint(out / "checkpoint")
                        self.export_policy(out / "policy")
                    saved_step = self.step_count
            if stopped and saved_step != self.step_count:
                with stop.save():  # the last finished step, so that --resume loses nothing
                    self.save_checkpoint(out / "checkpoint")
        return history

    def _step_start_state(self) -> dict:
        """What a step changes before its first optimizer step (cheap to copy): put back by
        :meth:`_restore_step_start` when the step is abandoned, so that a checkpoint written then is
        exactly the last finished step's."""
        return {"rng": checkpoint.capture_rng(), **self.progress_state()}

    def _restore_step_start(self, state: dict) -> None:
        checkpoint.restore_rng(state["rng"])
        self.load_progress_state(state)
        self.policy_optimizer.zero_grad(set_to_none=True)
        self.value_optimizer.zero_grad(set_to_none=True)

    def _log(self, out: Path, result: StepResult, eval_rows: List[dict]) -> None:
        b = result.batch
        samples = [{"step": self.step_count, "prompt": p, "response": r, "score": s}
                   for p, r, s in zip(b.prompts, b.responses, b.raw_scores.tolist())] if self.config.log_samples else []
        samples = [row for rank_rows in distributed.gather_objects(samples, self.world) for row in rank_rows]
        if not self.world.is_main:
            return
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(result.metrics) + "\n")
        for name, rows in (("samples.jsonl", samples), ("eval_samples.jsonl", eval_rows)):
            if rows:
                with open(out / name, "a") as f:
                    f.writelines(json.dumps(row) + "\n" for row in rows)

    @torch.no_grad()
    def evaluate_prompts(self, prompts: Optional[Sequence[str]] = None) -> tuple[Dict[str, float], List[dict]]:
        """Sample one response to each held-out prompt (``eval_prompts`` by default) as a rollout
        does, score it with the training reward and measure its KL to the reference.

        Returns:
            ``(metrics, rows)``: ``eval/score_mean`` (raw scores), ``eval/kl_mean`` (the
            ``kl_estimator`` summed over each response's tokens, averaged over responses, nats),
            ``eval/response_length_mean`` and ``eval/eos_fraction``; and one row per prompt
            (``step``, ``prompt``, ``response``, ``score``, ``kl``). The same on every rank.

        Raises:
            ValueError: no prompts. RewardError: as :meth:`step`.
        """
        prompts = list(self.eval_prompts if prompts is None else prompts)
        if not prompts:
            raise ValueError("evaluate_prompts: no prompts (pass eval_prompts to the trainer)")
        n, b = self.world.size, self.local_batch_size
        # Every rank runs the same number of batches (FSDP's collectives need it): its share is
        # padded with its last prompt, and the padding's results are dropped.
        mine = prompts[self.world.rank::n]
        per_rank = -(-len(prompts) // n)
        padded = mine + [mine[-1] if mine else prompts[-1]] * (per_rank - len(mine))
        rows: List[dict] = []
        for start in range(0, per_rank, b):
            chunk = padded[start:start + b]
            batch = self.rollout(chunk)
            scores = score_responses(self.reward_fn, batch.prompts, batch.responses,
                                     where=f"evaluation after step {self.step_count}")
            logprobs, ref = torch.zeros(2, len(batch), batch.response_length, device=self.device)
            for idx in torch.arange(len(batch)).split(self.micro_batch_size):
                mb, ix = batch.select(idx), idx.to(self.device)
                with autocast(self.device, self.dtype):
                    logprobs[ix] = self.policy_module(mb)[0]
                    ref[ix] = self.ref_logprobs(mb)[0]
            kl = kl_penalty(logprobs, ref, estimator=self.config.kl_estimator)
            kl = torch.where(batch.response_mask, kl, torch.zeros_like(kl)).sum(dim=1)
            lengths = batch.response_mask.sum(dim=1)
            for i in range(len(batch)):
                if start + i < len(mine):
                    rows.append({"step": self.step_count, "prompt": batch.prompts[i], "response": batch.responses[i],
                                 "score": float(scores[i]), "kl": float(kl[i]), "length": int(lengths[i]),
                                 "eos": bool(batch.has_eos[i])})
        # Back in the prompts' order: rank r evaluated prompts r, r + n, r + 2n, ...
        by_rank = distributed.gather_objects(rows, self.world)
        ordered = [by_rank[i % n][i // n] for i in range(len(prompts))]
        mean = lambda key: sum(float(r[key]) for r in ordered) / len(ordered)  # noqa: E731
        metrics = {"eval/score_mean": mean("score"), "eval/kl_mean": mean("kl"),
                   "eval/response_length_mean": mean("length"), "eval/eos_fraction": mean("eos")}
        return metrics, [{k: r[k] for k in ("step", "prompt", "response", "score", "kl")} for r in ordered]

    def export_policy(self, directory: str | os.PathLike) -> Optional[Path]:
        """Write the policy as a Hugging Face model directory (``save_pretrained`` and the
        tokenizer; with LoRA the merged model, or the adapter when ``merge_lora`` is false),
        swapped in atomically (:func:`pyppo.export.save_policy`). Every rank calls it (FSDP2
        gathers the weights onto rank 0's CPU copy of the model's structure); rank 0 writes and
        gets the directory, the others ``None``."""
        from .export import save_policy

        model = self.policy
        if distributed.is_sharded(self.policy_module):
            state = distributed.full_state_dict(self.policy_module, prefix="model.")  # every rank
            if not self.world.is_main:
                return None
            model = self._export_replica
            model.load_state_dict(state, assign=True)
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.tie_weights()  # assign=True gave the tied head its own tensor
        elif not self.world.is_main:
            return None
        try:
            return save_policy(model, self.tokenizer, directory, merge_lora=self.config.merge_lora,
                               base_model=self.base_model_source)
        finally:
            if self._export_replica is not None:
                self._export_replica.to("meta")  # drop the gathered weights

    def save_checkpoint(self, directory: str | os.PathLike) -> Optional[Path]:
        """Write everything needed to resume exactly, swapped in atomically (SIGKILL-safe; see
        :mod:`pyppo.checkpoint`): the trained weights of both models (every weight, or only the
        LoRA adapters and the value head), both AdamW states, and the trainer state (step, KL
        controller, prompt position, shuffle generator, every rank's RNGs, skip counters, config).
        The warm-up's learning rate is a function of the applied optimizer steps, which are saved. Every rank calls it;
        rank 0 writes and gets the directory, the others ``None``."""
        policy_state, policy_optim = checkpoint.training_state(self.policy_module, self.policy_optimizer,
                                                               prefix="model.")
        value_state, value_optim = checkpoint.training_state(self.value_module, self.value_optimizer)
        rngs = distributed.gather_objects(checkpoint.capture_rng(), self.world)
        saved = None
        if self.world.is_main:
            state = {"format": 2, **self.progress_state(), **rngs[0], "world_size": self.world.size,
                     "rank_rng": rngs, "config": self.config.to_dict()}
            saved = checkpoint.save(directory, {
                "policy.pt": policy_state, "value_model.pt": value_state,
                "optimizers.pt": {"policy": policy_optim, "value": value_optim}, "trainer_state.pt": state})
        distributed.barrier(self.world)
        return saved

    def load_checkpoint(self, directory: str | os.PathLike) -> Path:
        """Restore a checkpoint written by :meth:`save_checkpoint`, so that the next step is the
        one the saving run would have taken. A checkpoint left half-swapped by a killed save is
        recovered from ``<directory>.old``, with a warning. Every file is read before anything is
        restored. The reference and the frozen base weights are not in the checkpoint: build the
        trainer from the same initial policy. Every rank calls it.

        Returns:
            the directory actually loaded.

        Raises:
            FileNotFoundError: no complete checkpoint (naming the missing files).
            ValueError: a corrupt file; a different KL controller type or prompt count; weights that
                do not match the trained ones (e.g. a LoRA checkpoint into a full fine-tune); or a
                checkpoint of another number of processes.
        """
        d, files = checkpoint.load(directory, self.device)
        st = files["trainer_state.pt"]
        saved_n = int(st.get("world_size", 1))
        if saved_n != self.world.size:
            raise ValueError(f"checkpoint {str(d)!r} was written by {saved_n} process(es), this run has "
                             f"{self.world.size}; resume with torchrun --nproc-per-node {saved_n}")
        checkpoint.restore_training_state(self.policy_module, self.policy_optimizer, files["policy.pt"],
                                          files["optimizers.pt"]["policy"], prefix="model.", what="policy")
        checkpoint.restore_training_state(self.value_module, self.value_optimizer, files["value_model.pt"],
                                          files["optimizers.pt"]["value"], what="value model")
        self.load_progress_state(st)
        checkpoint.restore_rng(st["rank_rng"][self.world.rank] if "rank_rng" in st else st)
        self._loaded_step = self.step_count
        return d

    def progress_state(self) -> dict:
        """Where the run is, apart from weights and RNGs: the step, the applied optimizer steps,
        the KL controller, the prompt position, the shuffle generator and the skip counters (what
        a checkpoint's ``trainer_state.pt`` holds beside them)."""
        return {"step": self.step_count, "optimizer_steps": self.optimizer_steps, "kl_ctl": self.kl_ctl.state_dict(),
                "sampler": self.sampler.state_dict(), "shuffle_generator": self.shuffle_generator.get_state(),
                **self.skips.state_dict()}

    def load_progress_state(self, st: dict) -> None:
        """Put back what :meth:`progress_state` returned."""
        self.kl_ctl.load_state_dict(st["kl_ctl"])
        self.sampler.load_state_dict(st["sampler"])
        self.shuffle_generator.set_state(st["shuffle_generator"])
        self.skips.load_state_dict(st)
        self.step_count = int(st["step"])
        # Checkpoints from before the warm-up existed: their runs are past any warm-up.
        self.optimizer_steps = int(st.get("optimizer_steps", 2**62))


def rollout_metrics(batch: RolloutBuffer) -> Dict[str, float]:
    """What the rollout alone says: scores, shaped reward, entropy, lengths."""
    return {"score_mean": float(batch.raw_scores.mean()), "reward_mean": float(batch.rewards.sum(dim=1).mean()),
            "entropy_mean": float(masked_mean(batch.entropy, batch.response_mask)),
            "response_length_mean": float(batch.response_mask.sum(dim=1).float().mean()),
            "eos_fraction": float(batch.has_eos.float().mean())}


def record_token_stats(stats: RunningStats, op_stats: Dict[str, torch.Tensor], n_tokens: int) -> None:
    """Add a micro-batch's loss statistics to ``stats``, weighted by its valid tokens (the
    maximum as a maximum; explained variance is computed once over the whole update)."""
    stats.add({k: float(v) for k, v in op_stats.items() if k not in ("ratio_max", "explained_variance")},
              weight=n_tokens)
    stats.add_max("ratio_max", float(op_stats["ratio_max"]))


def ratio_stats(seen: list) -> Dict[str, float]:
    """Ratio statistics over the micro-batches ``seen`` so far (``micro_step`` results): in the
    first minibatch of a step, before any optimizer step, the ratio must be exactly 1."""
    logratio = torch.cat([(lp - old)[m] for lp, old, _, _, m in seen])
    max_abs = float(logratio.abs().max())
    logratio = logratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # as the loss does: exp stays finite
    ratio = torch.exp(logratio)
    return {"max_abs_logratio": max_abs, "ratio_min": float(ratio.min()),
            "ratio_max": float(ratio.max()), "ratio_mean": float(ratio.mean()),
            "approx_kl": float((ratio - 1 - logratio).mean())}


@contextlib.contextmanager
def _removing(handles: list):
    """Remove the hook ``handles`` on leaving the block."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
