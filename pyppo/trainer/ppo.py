"""The PPO step for language models, read top to bottom in :meth:`PPOTrainer.step`
(``docs/trainer.md``, "One step"):

1. sample ``samples_per_prompt`` responses to each of ``batch_size / samples_per_prompt`` prompts
   with the rollout engine (:mod:`pyppo.rollout`), 2. cut each after its first EOS, 3. score them
   (clip, missing-EOS and overlong penalties; DAPO's dynamic sampling): :mod:`.sampling`;
4. the rollout's forwards, ``old_logprobs``, ``ref_logprobs`` and ``values`` at the policy's tokens
   (``loss_mask``): :mod:`.rollout_forwards`;
5. reward shaping, the advantage estimator and the whitening: :mod:`.advantages`;
6. ``ppo_epochs`` passes over shuffled minibatches, gradient accumulation over micro-batches,
   clipping, AdamW: one minibatch's step is :mod:`.update` (the value model's share: :mod:`.critic`);
7. the KL coefficient's update; 8. the step's metrics and its batch.

The first PPO ratio is exactly 1: point 4 runs on exactly the micro-batches (rows, order,
padding, autocast) that the first epoch trains on, whose order is drawn before it; when the first
minibatch is one micro-batch, its policy forward runs once, with grad, for both
(``docs/trainer.md``, "Choices that matter").

Under ``torchrun`` each of the N processes samples ``batch_size / N`` responses (whole groups of
``samples_per_prompt``) to its share of one global order of prompts and trains on its share of
each minibatch; :mod:`pyppo.distributed` makes the whitening, the loss
normaliser, the KL controller's input and the metrics global, and DDP or FSDP2 the gradients.
The run around the steps (logs, cadences, signals, evaluation, checkpoints, export) is
:mod:`pyppo.run`, which drives this class (``pyppo.PPOTrainer`` is it with its run methods);
this package imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from .. import distributed
from ..agents.build import make_agent_engine
from ..config import PPOConfig
from ..data import prompt_list
from ..precision import resolve_dtype
from ..prompts import PromptSampler
from ..reward_sum import as_reward
from ..rollout import EngineSync, RolloutEngine, make_engine
from . import assemble
from .advantages import get_estimator, shaped_advantages
from .assemble import StepModels, TrainedPart
from .buffer import RolloutBuffer
from .critic import Critic
from .guards import NonFiniteUpdateError, SkipPolicy
from .kl_controllers import make_kl_controller
from .logprob_head import PolicyObjective
from .overlong import AllTruncatedWarning
from .results import METRIC_KEYS, MicroStepResult, StepResult
from .rollout_correction import correct_for_sampler
from .rollout_forwards import first_policy_forward, rollout_forwards
from .sampling import episode_tokens, rollout, sample_scored_batch, score_batch
from .step_stats import PhaseTimer, RunningStats, ratio_stats
from .update import LiveForward, MinibatchUpdate

__all__ = ["PPOTrainer", "StepResult", "MicroStepResult", "METRIC_KEYS", "NonFiniteUpdateError", "TrainedPart"]

RewardFn = Callable[[List[str], List[str]], Sequence[float]]


class PPOTrainer(MinibatchUpdate):
    """PPO for a causal LM policy: actor-critic with a separate value model (GAE), or critic-free
    (GRPO, RLOO, REINFORCE++: ``advantage_estimator``). This class is the algorithm, one
    :meth:`step` at a time, for a loop of your own; :class:`pyppo.PPOTrainer` adds the run around
    the steps (``train``, held-out evaluation, checkpoints, export: :mod:`pyppo.run`).

    Args:
        config: a :class:`~pyppo.config.PPOConfig`; ``config.device`` says where the models run
            (they are moved there).
        policy: a ``transformers`` causal LM (trained in place), or a model source (``str`` or
            path: a local Hugging Face model directory, a ``.gguf`` file or an embedded model's
            name), loaded as ``pyppo train --model`` loads it (``policy`` then holds the model;
            it is the run's recorded model unless ``base_model_source`` is given).
        ref_policy: frozen reference; ``None`` = a frozen deep copy of ``policy`` taken now.
        value_model: ``forward(input_ids, attention_mask, position_ids) -> [B, L]`` float32;
            ``None`` = ``ValueModel.from_causal_lm(policy)`` (seeded by ``config.seed``); must be
            ``None`` for a critic-free estimator, which builds none.
        tokenizer: the policy's tokenizer; needs an EOS token. Its ``padding_side`` is set to
            ``"left"``; a missing pad token is taken to be EOS. ``None`` with a model source
            ``policy``: the one loaded with it.
        reward_fn: ``(prompts, responses) -> scores``, one finite float per pair (``None`` where
            it does not apply); a reward with more parameters gets the prompts' fields of those
            names (``docs/rewards.md``); or a list of rewards, whose weighted sum is the score
            (:class:`pyppo.reward_sum.RewardSum`). With an environment it scores each episode's
            whole transcript, added to what the environment paid; ``None``: the environment pays alone.
        prompts: the prompts to sample from: strings, chat-message lists, or records ``{"prompt":
            ..., <field>: ...}`` (:func:`pyppo.prompts.load_prompt_records`) whose fields the
            reward receives; or a ``datasets.Dataset`` of such records (:func:`pyppo.data.prompt_list`).
        eval_prompts: held-out prompts (in the same forms) for the run's evaluation.
        base_model_source: the model source ``policy`` was loaded from (``pyppo train`` passes
            its ``--model``), for an adapter-only export's record of its base
            (:func:`pyppo.models.export.save_policy`'s ``base_model``); ``None`` = the policy's
            ``name_or_path``.
        environment: multi-turn episodes (``docs/agents.md``): a class or zero-argument factory of
            environments, in TRL's ``environment_factory`` convention (``reset(**row)``, public
            methods as tools, optional ``get_reward()``) or a text environment's (``reset(**row)``,
            ``step(action) -> (observation, reward, done)``); one instance per episode.
        tools: plain typed, documented functions the model may call (with or without an
            ``environment``).
        reward_weights: one finite weight per reward of a list ``reward_fn`` (TRL's
            ``reward_weights``); ``None``: 1.0 each.

    With ``lora_rank > 0`` the policy is wrapped in ``peft`` LoRA adapters here (``policy`` then
    holds the ``PeftModel``) and ``ref_policy`` must be ``None``. Under ``torchrun`` every rank
    builds the trainer with the same arguments.

    Attributes:
        config: the config, ``dtype = "auto"`` resolved. world: this process's
            :class:`~pyppo.distributed.World` (rank, number of processes, device).
        models: the step's models (:class:`~pyppo.trainer.assemble.StepModels`): the policy, its
            log-prob head and wrapped module, the reference, the critic, the export replica.
        policy, critic: ``models.policy`` and ``models.critic`` (``None`` for a critic-free
            estimator; the value model is ``critic.model``).
        engine: the :class:`~pyppo.rollout.RolloutEngine` that samples (``rollout_engine``).
        objective: the run's :class:`~pyppo.trainer.logprob_head.PolicyObjective`.
        step_count, optimizer_steps: finished steps, applied optimizer steps.

    Raises:
        ValueError: a bad argument (naming it), ``config.device`` names a missing device, or a
            batch size does not divide by the number of processes.
        TypeError: a model argument that is not a module (nor, for ``policy``, a model source).
        FileNotFoundError, ModuleNotFoundError: a model source ``policy`` that cannot be loaded.
    """

    def __init__(
        self,
        config: PPOConfig,
        policy: nn.Module | str | os.PathLike,
        ref_policy: Optional[nn.Module],
        value_model: Optional[nn.Module],
        tokenizer: Any,
        reward_fn: RewardFn,
        prompts: Sequence[Any],
        *,
        eval_prompts: Optional[Sequence[Any]] = None,
        base_model_source: Optional[str] = None,
        environment: Any = None,
        tools: Optional[Sequence[Callable]] = None,
        reward_weights: Optional[Sequence[float]] = None,
    ):
        reward_fn = as_reward(reward_fn, reward_weights)  # a list of rewards: their weighted sum
        agent = environment is not None or bool(tools)
        prompts, eval_prompts = prompt_list(prompts), prompt_list(eval_prompts, "eval_prompts")  # a Dataset: records
        assemble.check_arguments(
            config, policy, ref_policy, value_model, tokenizer, reward_fn, eval_prompts, agent=agent
        )
        policy, tokenizer, base_model_source = assemble.load_policy(policy, tokenizer, base_model_source)
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

        self.estimator = get_estimator(c.advantage_estimator)
        self.models: StepModels = assemble.assemble_models(c, policy, ref_policy, value_model, self.world, self.dtype)
        self.shared_weight_bytes = assemble.share_reward_weights(self.models.reference, reward_fn, self.models.dtype)
        self.local_mini_batch_size = c.mini_batch_size // self.world.size
        self.micro_batch_size = c.micro_batch_size or self.local_mini_batch_size

        self.tokenizer = assemble.prepare_tokenizer(tokenizer)
        self.reward_fn = reward_fn
        self.sampler = PromptSampler(prompts, c.seed)
        self.eval_prompts = list(eval_prompts or [])
        sets = {"prompts": prompts, "eval_prompts": self.eval_prompts}
        limit = assemble.check_prompt_sets(c, self.policy, tokenizer, reward_fn, sets, agent=agent)
        m, on = self.models, dict(device=self.device, dtype=self.dtype)
        self.engine: RolloutEngine = make_engine(
            c, policy=m.policy, policy_module=m.policy_module, tokenizer=tokenizer, max_prompt_tokens=limit, **on
        )
        if agent:  # multi-turn episodes, sampled turn by turn with that engine
            self.engine = make_agent_engine(c, self.engine, environment, tools, m, tokenizer, self.world)
        self.engine_sync = EngineSync()
        self.all_truncated = AllTruncatedWarning(c.max_new_tokens, episodes=agent, say=self.world.is_main)

        self.policy_optimizer = assemble.make_adamw(self.policy, c.lr, c)
        self.objective = PolicyObjective.from_config(c)
        self.kl_ctl = make_kl_controller(c)
        # Minibatch shuffles have their own stream, independent of how much sampling consumed.
        self.shuffle_generator = torch.Generator().manual_seed(c.seed + 1)
        self.skips = SkipPolicy(c.max_consecutive_skips)
        self.step_count = 0
        self.optimizer_steps = 0  # applied ones (skipped updates do not count): the warm-up's clock
        self.policy_steps = 0  # those that moved the policy (not the critic warm-up's)
        self.base_model_source = base_model_source
        self.resumed_step: Optional[int] = None  # set by the run when it restores a checkpoint
        if self.world.active:
            torch.manual_seed(c.seed + 1_000_003 * self.world.rank)  # each rank samples its own responses

    @property
    def policy(self) -> nn.Module:
        """The policy (the ``peft`` model under LoRA), trained in place."""
        return self.models.policy

    @property
    def agent(self) -> bool:
        """Whether the run samples multi-turn episodes with an environment (``docs/agents.md``)."""
        return episode_tokens(self.engine) is not None

    @property
    def critic(self) -> Optional[Critic]:
        """The value model's share of a step, ``None`` for a critic-free estimator."""
        return self.models.critic

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
        c, where = self.config, self._where()
        timer = PhaseTimer(absent=() if self.critic is not None else ("value_forward",))
        with timer.phase("weight_sync"):
            self.sync_engine()
        self.train_mode(False)
        # 1, 2, 3: sample, cut, score (and DAPO's dynamic sampling)
        batch, sampled = sample_scored_batch(
            self.engine, self.sampler, self.reward_fn, c, self.world, self.device, timer, where=where
        )
        # 4: the rollout's forwards, on the micro-batches the first epoch trains on
        first_perm, n = batch.epoch_permutation(self.shuffle_generator), self.micro_batch_size
        fold = self.first_pass_is_rollout_pass() and not self.critic_warming_up
        rollout_forwards(self.models, batch, first_perm, n, timer, first_policy=not fold)
        first_forward = first_policy_forward(self.models, batch, first_perm, n, timer) if fold else None
        # 5: rewards, advantages, and the sampler's mismatch
        kl_coef = float(self.kl_ctl.value)
        with timer.phase("advantages"):
            rollout_stats = shaped_advantages(batch, kl_coef, self.estimator, c, self.world, where=where)
            engine = type(self.engine).__name__
            mismatch = correct_for_sampler(batch, c.effective_rollout_correction, c.rollout_is_cap, self.world, engine)
        # 6: the update
        with timer.phase("update"):
            update_metrics = self.update(batch, first_perm, first_forward)
        # 7: the KL coefficient; the KL is 0 outside loss_mask, so this sums the policy's tokens
        kl_mean = distributed.all_sum([float(batch.kl.sum())], self.world)[0] / c.batch_size
        self.update_kl_coef(kl_mean)
        self.step_count += 1
        # 8: the metrics
        metrics = {"step": self.step_count, "kl_mean": kl_mean, "kl_coef": kl_coef, **rollout_stats, **sampled}
        metrics.update(mismatch, **update_metrics, **timer.metrics())
        metrics = distributed.reduce_metrics(metrics, self.world)
        self.all_truncated(metrics.get("truncated_masked"), c.batch_size, where)
        return StepResult(metrics, batch)

    def _where(self) -> str:
        return f"step {self.step_count + 1}"

    def close(self) -> None:
        """Release the rollout engine (vLLM: its memory and process groups). Under ``torchrun``,
        call it before the process group is destroyed."""
        self.engine.close()

    def sync_engine(self) -> None:
        """Give an engine that holds its own copy of the policy the current weights
        (:class:`~pyppo.rollout.EngineSync`)."""
        self.engine_sync(self.engine, self.policy, self.policy_steps)

    def rollout(self, prompts: List[str], fields: Optional[Dict[str, list]] = None) -> RolloutBuffer:
        """Points 1 and 2 for ``prompts`` (:func:`pyppo.trainer.sampling.rollout`; ``fields``: the
        prompts' other columns, which an environment's ``reset`` receives), with the models in
        eval mode (as the rollout's forwards)."""
        self.train_mode(False)
        return rollout(self.engine, prompts, fields)

    def score(self, batch: RolloutBuffer, fields: Optional[Dict[str, list]] = None) -> Tuple[torch.Tensor, ...]:
        """``(raw_scores [B], scores [B])`` of point 3: :func:`pyppo.trainer.sampling.score_batch`."""
        c, where = self.config, self._where()
        limit = episode_tokens(self.engine)
        return score_batch(
            batch, self.reward_fn, c, self.world, self.device, where=where, fields=fields, episode_tokens=limit
        )

    def advantages(self, batch: RolloutBuffer, kl_coef: float) -> Dict[str, float]:
        """Point 5 on ``batch``: :func:`pyppo.trainer.advantages.shaped_advantages`."""
        return shaped_advantages(batch, kl_coef, self.estimator, self.config, self.world, where=self._where())

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
            message = f"{self._where()}: the rollout's KL is {kl_mean}; the KL coefficient is not updated"
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------------------ the update
    def update(
        self, batch: RolloutBuffer, first_perm: torch.Tensor, first_forward: LiveForward = None
    ) -> Dict[str, float]:
        """``ppo_epochs`` passes over shuffled minibatches, one optimizer step each (point 6).
        ``first_forward``: :func:`~pyppo.trainer.rollout_forwards.first_policy_forward`'s live output,
        the first minibatch's
        policy forward.

        Returns:
            token-weighted means of the loss statistics (over every rank's tokens) and minibatch
            means of the losses and gradient norms, over the applied updates (``nan`` when all
            were skipped);
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
                first = first or (ratio_stats(seen_mb, self.world) if seen_mb else {})
                seen += seen_mb
        self.train_mode(False)
        # The gradients are not needed until the next update: freed now, they do not add to the
        # memory of the next rollout.
        self.zero_grad()
        out = {k: math.nan for k in ("policy_loss", "clipfrac", "approx_kl", "ratio_max")}
        if self.critic is not None and seen:
            values, returns, mask = (
                torch.cat([getattr(s, k) for s in seen]) for k in ("values", "returns", "critic_mask")
            )
            out.update(
                value_loss=math.nan,
                explained_variance=distributed.explained_variance(values, returns, mask, self.world),
            )
        out.update(stats.means(self.world), skipped_updates=self.skips.total - skipped_before)
        return {**out, **{f"first_{k}": v for k, v in first.items()}}

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Where the run is, apart from weights and RNGs: the step, the applied optimizer steps,
        the KL controller, the prompt position, the shuffle generator and the skip counters (what
        a checkpoint's ``trainer_state.pt`` holds beside them)."""
        return {
            "step": self.step_count,
            "optimizer_steps": self.optimizer_steps,
            "policy_steps": self.policy_steps,
            "kl_ctl": self.kl_ctl.state_dict(),
            "sampler": self.sampler.state_dict(),
            "shuffle_generator": self.shuffle_generator.get_state(),
            **self.skips.state_dict(),
        }

    def load_state_dict(self, st: dict) -> None:
        """Put back what :meth:`state_dict` returned."""
        self.kl_ctl.load_state_dict(st["kl_ctl"])
        self.sampler.load_state_dict(st["sampler"])
        self.shuffle_generator.set_state(st["shuffle_generator"])
        self.skips.load_state_dict(st)
        self.step_count = int(st["step"])
        # Checkpoints from before the warm-up existed: their runs are past any warm-up.
        self.optimizer_steps = int(st.get("optimizer_steps", 2**62))
        self.policy_steps = int(st.get("policy_steps", self.optimizer_steps))

    def checkpoint_parts(self) -> Dict[str, Optional[TrainedPart]]:
        """What trains, as a checkpoint saves it: ``"policy"`` and ``"value"`` (``None`` for a
        critic-free estimator), each its module as the forwards call it (DDP- or FSDP2-wrapped),
        its optimizer and the prefix its weight names carry (``"model."`` of the policy's
        log-prob head)."""
        critic = self.critic
        return {
            "policy": TrainedPart(self.models.policy_module, self.policy_optimizer, "model."),
            "value": TrainedPart(critic.module, critic.optimizer, "") if critic is not None else None,
        }

    def weights_loaded(self) -> None:
        """The trained weights were replaced (a checkpoint was restored): an engine with its own
        copy of them copies every weight at its next sync."""
        self.engine_sync.weights_loaded()
