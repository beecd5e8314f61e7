"""``PPOConfig``: every knob of the PPO loop, each declared once (with :func:`~.knobs.knob`,
under a :func:`~.knobs.group`), and :func:`config_knobs`, the knobs in declaration order."""

from __future__ import annotations

import dataclasses
import types
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

from ..ops.kl import KL_ESTIMATORS
from ..ops.losses import LOSS_AGG_MODES
from ..ops.policy_losses import POLICY_LOSSES
from . import knobs
from .knobs import (
    ADVANTAGE_ESTIMATORS,
    DTYPES,
    GROUP_ESTIMATORS,
    ROLLOUT_CORRECTIONS,
    ROLLOUT_ENGINES,
    TRACKERS,
    Check,
    Knob,
    boolean,
    device_name,
    group,
    integer,
    knob,
    module_names,
    number,
    one_of,
)
from .rules import InertSettings, inert_settings

#: The words ``report_to`` takes besides the trackers' names, as Hugging Face's
#: ``TrainingArguments`` does: every tracker whose package is installed, and no tracker.
REPORT_TO_ALL, REPORT_TO_NONE = "all", "none"


def _given_trackers(value: Any) -> Optional[tuple]:
    """``report_to`` as given (a name, a list of names, ``"all"`` or ``"none"`` alone, ``None``)
    as a tuple of its words, each once; ``None`` when it is none of those forms."""
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return None
    names = tuple(dict.fromkeys(names))  # a name given twice counts once
    if names in ((REPORT_TO_ALL,), (REPORT_TO_NONE,)) or all(n in TRACKERS for n in names):
        return names
    return None


class _TrackerNames(Check):
    """``report_to``'s check: :func:`_given_trackers`' forms, normalised to the list of trackers
    they mean; ``"all"`` to each tracker whose packages are installed now
    (:func:`pyppo.config.knobs.installed_trackers`), so that ``config.toml`` records the list."""

    def normalize(self, v: Any) -> Any:
        names = _given_trackers(v)
        if names == (REPORT_TO_NONE,):
            return ()
        if names == (REPORT_TO_ALL,):
            return knobs.installed_trackers()  # found, not imported
        return names


def _tracker_names() -> Check:
    return _TrackerNames(
        "list",  # the flag takes several words
        lambda v: _given_trackers(v) is not None,
        f"a name or a list of names from {tuple(TRACKERS)}, or alone {REPORT_TO_ALL!r} (each one "
        f"installed) or {REPORT_TO_NONE!r} (also [] or None: none)",
        "{" + ",".join((*TRACKERS, REPORT_TO_ALL, REPORT_TO_NONE)) + "}",
    )


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
    rollout_correction: str = knob("auto", one_of(("auto", *ROLLOUT_CORRECTIONS)), resume="fixed",
        help="importance weight exp(old_logprobs - rollout_logprobs) on each token's policy loss, for an "
             'engine that samples from other numerics than the trainer\'s (docs/trainer.md, "Sampler mismatch"); '
             "needs an engine that returns rollout_logprobs; auto = token_truncate with vllm, none with transformers")
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
        help="gae (actor-critic PPO: trains a value model), gae_turn (the same, GAE over agent turns); "
             "critic-free, no value model: grpo, rloo (group "
             "baselines over samples_per_prompt responses), reinforce_pp, reinforce_pp_baseline (REINFORCE++) "
             '(docs/trainer.md, "Advantage estimators")')
    grpo_std_normalize: bool = knob(True, boolean(), resume="fixed",
        help="grpo: divide by the group's standard deviation; false = Dr. GRPO (the mean is subtracted only)")
    gamma: float = knob(1.0, number(0.0, 1.0), resume="fixed", help="discount of GAE and of reinforce_pp's returns")
    lam: float = knob(0.95, number(0.0, 1.0), resume="fixed",
        help="GAE lambda of the policy's advantages, and of the value targets unless lam_critic")
    lam_critic: Optional[float] = knob(None, number(0.0, 1.0), resume="fixed", optional=True,
        help="GAE lambda of the value targets (decoupled GAE, VC-PPO: 1.0); None = lam")
    lam_alpha: float = knob(0.0, number(0.0), resume="fixed",
        help="length-adaptive GAE (VAPO): each response's policy lambda = 1 - 1/(lam_alpha * its trained "
             "tokens), clamped to [0, 1], instead of lam; 0 = off; 0.5 suits responses of tens of tokens "
             "(VAPO's 0.05 was for thousands)")
    gamma_turn: float = knob(1.0, number(0.0, 1.0), resume="fixed",
        help="gae_turn: the discount per agent turn")
    lam_turn: float = knob(0.95, number(0.0, 1.0), resume="fixed",
        help="gae_turn: the GAE lambda per agent turn")
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

    group("value model")  # gae and gae_turn only
    value_lr: Optional[float] = knob(None, number(0.0, lo_open=True), resume="fixed", optional=True,
        help="AdamW learning rate of the value model; None = lr")
    cliprange_value: Optional[float] = knob(0.2, number(0.0, lo_open=True), resume="fixed", optional=True,
        help="value clip epsilon around the rollout's values; None = unclipped")
    vf_coef: float = knob(0.1, number(0.0), resume="fixed", help="value-loss weight")
    critic_warmup_steps: int = knob(0, integer(0), resume="fixed",
        help="the first N steps train the value model only (sampled and scored as usual; the policy, its "
             "optimizer and its learning-rate warm-up wait), as VC-PPO pretrains its critic; 0 = none")

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
    doctor: bool = knob(True, boolean(), resume="free", always_acts=True,
        help="after each step, one warning (once per condition) and a doctor/* metric when the step could "
             "not have taught anything or the run is about to go wrong: equal scores, zero advantages, a KL jump, "
             "collapsed entropy... (docs/trainer.md, \"Why isn't it learning\"); false = no checks")
    report_to: tuple = knob((), _tracker_names(), resume="free", always_acts=True,
        help="experiment trackers that also get each step's metrics and samples, offline under the run "
             "directory by default (docs/trainer.md, Experiment trackers)")
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
        broken = inert_settings(self, _field_defaults())
        if broken:
            raise InertSettings(broken)
        for warning in inert_settings(self, _field_defaults(), warn=True):
            warnings.warn(InertSettings([warning]).describe(), UserWarning, stacklevel=3)
        if self.critic_warmup_steps >= self.steps:
            warnings.warn(
                f"critic_warmup_steps = {self.critic_warmup_steps} >= steps = {self.steps}: every step of the run "
                "trains the value model only, and the policy is never trained",
                UserWarning,
                stacklevel=3,
            )
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
                for _, pairs in inert_settings(types.SimpleNamespace(**settings), defaults)
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
        """Whether the run trains a value model (``gae``, ``gae_turn``); the others are critic-free."""
        return self.advantage_estimator in ("gae", "gae_turn")

    @property
    def effective_value_lr(self) -> float:
        return self.value_lr if self.value_lr is not None else self.lr

    @property
    def effective_loss_agg_norm(self) -> float:
        return self.loss_agg_norm if self.loss_agg_norm is not None else float(self.max_new_tokens)

    @property
    def effective_rollout_correction(self) -> str:
        """``rollout_correction`` with ``auto`` resolved: ``token_truncate`` with the vLLM engine
        (in bf16 its sampler is far enough from the trainer to need it; in fp32 the weights stay
        within rounding of 1: docs/performance.md), ``none`` with ``transformers``, which samples
        with the trainer's own forward and reports no log-probs of its own."""
        if self.rollout_correction != "auto":
            return self.rollout_correction
        return "token_truncate" if self.rollout_engine == "vllm" else "none"

    @property
    def torch_dtype(self):
        """The compute dtype as a ``torch.dtype``; ``auto`` resolved for the device ``device``
        names (:func:`pyppo.precision.resolve_dtype`)."""
        import torch

        from ..precision import resolve_dtype

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
        for broken in inert_settings(self, _field_defaults(), n, warn=True):
            said = self.__dict__.setdefault("_warned", set())
            message = InertSettings([broken]).describe()
            if message not in said:
                said.add(message)
                warnings.warn(message, UserWarning, stacklevel=2)
        broken = inert_settings(self, _field_defaults(), n)
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


def _field_defaults() -> Dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(PPOConfig)}
