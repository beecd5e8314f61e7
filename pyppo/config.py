"""``PPOConfig``: every knob of the PPO loop, each declared once.

A field is declared with :func:`knob`: its default, a one-line help and its check live together in
the dataclass field's metadata. Validation loops over that metadata (cross-field rules are written
out in :meth:`PPOConfig.__post_init__`), ``pyppo train`` builds one flag per field from it, and the
key table of ``docs/trainer.md`` is generated from it (:func:`config_markdown`; a test fails when
the file is stale). Regenerate the table with ``python -m pyppo.config``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

from .ops.kl import KL_ESTIMATORS
from .ops.losses import LOSS_AGG_MODES
from .ops.policy_losses import POLICY_LOSSES

#: ``PPOConfig.dtype`` values: ``auto`` is bfloat16 where the device computes it natively, else
#: float32 (:func:`pyppo.precision.resolve_dtype`).
DTYPES = ("auto", "float32", "bfloat16")

#: ``PPOConfig.rollout_engine`` values (:func:`pyppo.rollout.make_engine`).
ROLLOUT_ENGINES = ("transformers", "vllm")

#: ``PPOConfig.advantage_estimator`` values (:data:`pyppo.trainer.advantages.ADVANTAGE_ESTIMATORS`):
#: ``gae`` trains a value model, the others are critic-free.
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")

#: ``PPOConfig.rollout_correction`` values (:mod:`pyppo.trainer.rollout_correction`).
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

__all__ = ["PPOConfig", "Check", "Knob", "knob", "config_knobs", "config_markdown", "resolve_device"]


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy ints too


def _is_num(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Check:
    """A field's check: ``ok(value)``; ``expected`` completes "<key> must be ..."; ``kind`` (``int``,
    ``float``, ``bool``, ``str``) is the type a valid value is normalised to and a flag parses."""

    kind: str
    ok: Callable[[Any], bool]
    expected: str
    metavar: str = ""

    def normalize(self, v: Any) -> Any:
        return {"int": int, "float": float}.get(self.kind, lambda x: x)(v)


def integer(lo: int, hi: Optional[int] = None) -> Check:
    """An int ``>= lo`` (and ``< hi``)."""
    rng = f">= {lo}" if hi is None else f"in [{lo}, {'2**63' if hi == 2**63 else hi})"
    return Check("int", lambda v: _is_int(v) and v >= lo and (hi is None or v < hi), f"an int {rng}", "N")


def number(lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A finite number in ``[lo, hi]``, each end open when asked."""
    def ok(v: Any) -> bool:
        return _is_num(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    if hi == math.inf:
        where = f"{'>' if lo_open else '>='} {lo}"
    else:
        where = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    return Check("float", ok, f"a finite number {where}", "X")


def boolean() -> Check:
    return Check("bool", lambda v: isinstance(v, bool), "a bool")


def one_of(options: Sequence[str]) -> Check:
    return Check("str", lambda v: isinstance(v, str) and v in options, f"one of {tuple(options)}",
                 "{" + ",".join(options) + "}")


def _is_device(v: Any) -> bool:
    import torch

    if not isinstance(v, str) or not v:
        return False
    if v == "auto":
        return True
    try:
        return torch.device(v).type in ("cpu", "cuda")
    except (RuntimeError, ValueError):
        return False


def device_name() -> Check:
    return Check("str", _is_device, "'auto', 'cpu', 'cuda' or 'cuda:N'", "DEVICE")


def _is_module_list(v: Any) -> bool:
    if not isinstance(v, str) or not v.strip():
        return False
    return v == "all-linear" or all(name.strip().replace("_", "").replace(".", "").isalnum()
                                    for name in v.split(","))


def module_names() -> Check:
    return Check("str", _is_module_list, "'all-linear' or comma-separated module names (e.g. 'q_proj,v_proj')",
                 "NAMES")


@dataclass(frozen=True)
class Knob:
    """What :func:`knob` stores in a field's metadata."""

    help: str
    check: Check
    group: str
    optional: bool  # None is allowed (and means what the help says)

    def validate(self, key: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if not self.check.ok(value):
            raise ValueError(f"{key} must be {self.expected()}, got {value!r}")
        return self.check.normalize(value)

    def expected(self) -> str:
        return self.check.expected + (" or None" if self.optional else "")


def knob(default: Any, help: str, check: Any, *, group: str, optional: bool = False) -> Any:
    """A config field: ``default``, a one-line ``help``, its ``check`` and the ``group`` it is listed under."""
    return dataclasses.field(default=default, metadata={"knob": Knob(help, check, group, optional)})


def _inert_knobs(c: "PPOConfig") -> Iterator[tuple]:
    """``(knob, what it needs)`` for each knob set away from its default where it acts on nothing:
    a silently ignored setting is refused instead."""
    est = repr(c.advantage_estimator)
    needs = [
        (("value_lora", "value_lr", "vf_coef", "cliprange_value", "lam"), c.uses_critic,
         f"a value model (advantage_estimator = 'gae'; {est} trains none)"),
        (("gamma",), c.advantage_estimator in ("gae", "reinforce_pp"),
         f"token returns (advantage_estimator 'gae' or 'reinforce_pp', not {est})"),
        (("whiten_advantages",), c.advantage_estimator not in ("grpo", "rloo"),
         f"a batch-whitened estimator ({est} normalises within each group)"),
        (("grpo_std_normalize",), c.advantage_estimator == "grpo", f"advantage_estimator = 'grpo', not {est}"),
        (("dual_clip",), c.policy_loss == "ppo", f"policy_loss = 'ppo', not {c.policy_loss!r}"),
        (("filter_groups_max_tries",), c.filter_groups, "filter_groups = true"),
        (("overlong_penalty",), c.overlong_buffer > 0, "overlong_buffer > 0"),
    ]
    defaults = {f.name: f.default for f in dataclasses.fields(c)}
    for names, active, what in needs:
        for name in names:
            if not active and getattr(c, name) != defaults[name]:
                yield name, what


# ---------------------------------------------------------------------------------------------
# the config
# ---------------------------------------------------------------------------------------------
@dataclass
class PPOConfig:
    """Every knob of the PPO loop (see ``docs/trainer.md`` for the loop and the key table).

    Each field's default, help and check are declared once, below. Construction validates every
    field and the cross-field rules.

    Raises:
        ValueError: an invalid value; the message starts with the key.
    """

    # -- sizes (counts of sequences)
    steps: int = knob(100, "PPO steps (rollout + update) to run", integer(1), group="sizes")
    batch_size: int = knob(16, "responses (sequences) sampled per step: batch_size / samples_per_prompt prompts, "
                           "samples_per_prompt responses to each", integer(1), group="sizes")
    samples_per_prompt: int = knob(
        1, "responses sampled per prompt, a group (the group-relative estimators' baseline); must divide "
        "batch_size and each process's share of it", integer(1), group="sizes")
    mini_batch_size: int = knob(8, "sequences per optimizer step; must divide batch_size", integer(1), group="sizes")
    micro_batch_size: Optional[int] = knob(
        None, "sequences per forward/backward (gradient accumulation; also the rollout forward size); "
        "must divide mini_batch_size; None = mini_batch_size", integer(1), group="sizes", optional=True)
    ppo_epochs: int = knob(4, "passes over the batch per step", integer(1), group="sizes")

    # -- sampling
    max_new_tokens: int = knob(48, "response length limit, in tokens", integer(1), group="sampling")
    max_prompt_length: Optional[int] = knob(
        None, "prompts longer than this many tokens are cut from the left; None = only what the model's "
        "context cannot hold (see truncate_prompts)", integer(1), group="sampling", optional=True)
    truncate_prompts: bool = knob(
        True, "a prompt longer than the room the model's context leaves (its positions minus "
        "max_new_tokens) is cut from the left, with a warning naming it; false = that is an error",
        boolean(), group="sampling")
    temperature: float = knob(
        1.0, "sampling temperature; the ratio and KL use the same softmax(z / temperature)",
        number(0.0, lo_open=True), group="sampling")
    top_k: int = knob(
        0, "top-k filter of sampling (0 = off); anything else samples from a distribution the "
        "log-probs do not describe (off-policy)", integer(0), group="sampling")
    top_p: float = knob(
        1.0, "nucleus filter of sampling (1.0 = off); below 1 is off-policy like top_k",
        number(0.0, 1.0, lo_open=True), group="sampling")
    use_chat_template: bool = knob(
        True, "format prompts with the tokenizer's chat template when it has one", boolean(), group="sampling")
    rollout_engine: str = knob(
        "transformers", "what samples the rollouts: 'transformers' (the policy itself, through generate) or "
        "'vllm' (an in-process vLLM copy of the policy, synced after every update; pip install pyppo[vllm]); "
        "old_logprobs are the trainer's own either way (docs/trainer.md, \"Rollout engines\")",
        one_of(ROLLOUT_ENGINES), group="sampling")
    vllm_kv_cache_gib: float = knob(
        1.0, "rollout_engine 'vllm' on a CPU: the KV cache it reserves, GiB", number(0.0, lo_open=True),
        group="sampling")
    vllm_gpu_memory_utilization: float = knob(
        0.3, "rollout_engine 'vllm' on CUDA: the fraction of the GPU's memory vLLM may take (weights and KV "
        "cache; the trainer's models share the device)", number(0.0, 1.0, lo_open=True),
        group="sampling")
    rollout_correction: str = knob(
        "none", "importance weight exp(old_logprobs - rollout_logprobs) on each token's policy loss, for an "
        "engine that samples from other numerics than the trainer's (docs/trainer.md, \"Sampler mismatch\"); "
        "needs an engine that returns rollout_logprobs", one_of(ROLLOUT_CORRECTIONS), group="sampling")
    rollout_is_cap: float = knob(
        2.0, "rollout_correction's cap C: *_truncate clamps the weight at C, *_mask zeroes it outside [1/C, C]",
        number(1.0), group="sampling")

    # -- optimisation
    lr: float = knob(1e-5, "AdamW learning rate of the policy", number(0.0, lo_open=True), group="optimisation")
    value_lr: Optional[float] = knob(
        None, "AdamW learning rate of the value model; None = lr", number(0.0, lo_open=True),
        group="optimisation", optional=True)
    lr_warmup_steps: int = knob(
        0, "optimizer steps over which both learning rates rise linearly to lr and value_lr (Adam's first "
        "step moves every weight by about lr; a warm-up keeps the first PPO steps proximal); 0 = none",
        integer(0), group="optimisation")
    weight_decay: float = knob(0.0, "AdamW weight decay of both models", number(0.0), group="optimisation")
    adam_eps: float = knob(1e-8, "AdamW epsilon of both models", number(0.0, lo_open=True), group="optimisation")
    max_grad_norm: Optional[float] = knob(
        1.0, "clip each model's gradient norm to this; None = no clipping", number(0.0, lo_open=True),
        group="optimisation", optional=True)
    fused_policy_loss: bool = knob(
        True, "on the hidden-state path, compute the policy loss and its gradient in one pass "
        "(linear_ppo_loss: no recompute in the backward); false = from the log-probs, same result",
        boolean(), group="optimisation")
    logprobs_from_hidden: bool = knob(
        True, "log-probs from the last hidden states with linear_logprobs (no [B, T, V] logits); "
        "falls back to full logits when the model's head is not a plain linear map", boolean(),
        group="optimisation")
    disable_dropout: bool = knob(
        True, "set every dropout of the policy and the value model to 0, so training forwards "
        "match the rollout's", boolean(), group="optimisation")

    # -- devices, precision and memory
    device: str = knob("auto", "where the models run: auto = CUDA when available, else CPU", device_name(),
                       group="devices and precision")
    dtype: str = knob(
        "auto", "compute dtype of the model forwards: bfloat16 runs them under autocast, with float32 "
        "master weights and optimizer state; auto = bfloat16 on a GPU or CPU that computes it natively "
        "(AVX512_BF16, AMX), else float32 (docs/trainer.md)", one_of(DTYPES), group="devices and precision")
    gradient_checkpointing: bool = knob(
        False, "recompute the policy's and the value model's activations in the backward instead of "
        "keeping them", boolean(), group="devices and precision")
    fsdp: bool = knob(
        False, "with several processes, shard the policy and the value model with FSDP2 instead of "
        "replicating them with DDP", boolean(), group="devices and precision")

    # -- LoRA
    lora_rank: int = knob(
        0, "train LoRA adapters of this rank instead of every weight (0 = full fine-tuning); the "
        "reference is then the policy with its adapters disabled", integer(0), group="LoRA")
    lora_alpha: float = knob(32.0, "LoRA scaling numerator: the adapter's update is scaled by "
                             "lora_alpha / lora_rank", number(0.0, lo_open=True), group="LoRA")
    lora_target_modules: str = knob(
        "all-linear", "modules that get adapters: 'all-linear' = every linear layer of the blocks "
        "(not the LM head)", module_names(), group="LoRA")
    value_lora: bool = knob(
        False, "with lora_rank > 0: the value model trains LoRA adapters (same rank, alpha, targets) on "
        "its backbone copy, plus its head, instead of every weight", boolean(), group="LoRA")
    merge_lora: bool = knob(
        True, "with lora_rank > 0: policy/ holds the merged model; false = the adapter only",
        boolean(), group="LoRA")

    # -- KL penalty
    kl_coef: float = knob(0.05, "KL penalty coefficient beta (initial value with target_kl)", number(0.0),
                          group="KL penalty")
    target_kl: Optional[float] = knob(
        None, "target KL (nats per sequence) of the adaptive controller; None = fixed kl_coef",
        number(0.0, lo_open=True), group="KL penalty", optional=True)
    kl_horizon: float = knob(10000.0, "adaptive controller horizon, in samples", number(0.0, lo_open=True),
                             group="KL penalty")
    kl_estimator: str = knob("k1", "per-token KL estimator (Schulman 2020)", one_of(KL_ESTIMATORS),
                             group="KL penalty")
    kl_loss_coef: float = knob(
        0.0, "weight of a KL term in the policy loss (veRL's use_kl_loss): kl_loss_estimator of the policy "
        "against the reference, aggregated like the loss; beside or instead of the KL in the reward (kl_coef)",
        number(0.0), group="KL penalty")
    kl_loss_estimator: str = knob("k3", "per-token KL estimator of the loss's KL term (k3: unbiased, "
                                  "non-negative, low variance)", one_of(KL_ESTIMATORS), group="KL penalty")
    score_clip: Optional[float] = knob(
        None, "clip raw scores to [-score_clip, score_clip] (before missing_eos_penalty); None = no clip",
        number(0.0, lo_open=True), group="KL penalty", optional=True)
    missing_eos_penalty: Optional[float] = knob(
        None, "subtracted from the (clipped) score of responses that hit max_new_tokens without EOS",
        number(0.0), group="KL penalty", optional=True)

    # -- DAPO's rollout rules (docs/trainer.md, "DAPO's rollout rules")
    filter_groups: bool = knob(
        False, "DAPO dynamic sampling: drop groups whose scores are all equal (no signal for a group baseline) "
        "and sample more prompts until the batch is full; needs samples_per_prompt >= 2",
        boolean(), group="DAPO's rollout rules")
    filter_groups_max_tries: int = knob(
        4, "filter_groups: rollouts per step at most; a batch still short then is filled with all-equal groups "
        "(logged as filter_groups_filled)", integer(1), group="DAPO's rollout rules")
    overlong_buffer: int = knob(
        0, "DAPO overlong shaping: a penalty rising linearly from 0 to overlong_penalty over a response's last "
        "overlong_buffer tokens before max_new_tokens, subtracted from its score; 0 = off",
        integer(0), group="DAPO's rollout rules")
    overlong_penalty: float = knob(1.0, "the overlong penalty at max_new_tokens", number(0.0),
                                   group="DAPO's rollout rules")
    mask_truncated: bool = knob(
        False, "responses cut at max_new_tokens (no EOS) take no loss; their scores still count in their "
        "group's baseline", boolean(), group="DAPO's rollout rules")

    # -- advantages and losses
    advantage_estimator: str = knob(
        "gae", "gae (actor-critic PPO: trains a value model); critic-free, no value model: grpo, rloo (group "
        "baselines over samples_per_prompt responses), reinforce_pp, reinforce_pp_baseline (REINFORCE++) "
        "(docs/trainer.md, \"Advantage estimators\")", one_of(ADVANTAGE_ESTIMATORS), group="advantages and losses")
    grpo_std_normalize: bool = knob(
        True, "grpo: divide by the group's standard deviation; false = Dr. GRPO (the mean is subtracted only)",
        boolean(), group="advantages and losses")
    gamma: float = knob(1.0, "discount of GAE and of reinforce_pp's returns", number(0.0, 1.0),
                        group="advantages and losses")
    lam: float = knob(0.95, "GAE lambda", number(0.0, 1.0), group="advantages and losses")
    whiten_advantages: bool = knob(
        True, "whiten advantages over the whole batch's valid tokens (skipped below 2 valid tokens); gae and "
        "reinforce_pp* only: grpo and rloo are normalised within each group",
        boolean(), group="advantages and losses")
    policy_loss: str = knob(
        "ppo", "ppo (clipped token ratio), gspo (clipped sequence ratio, the geometric mean of its tokens'; GSPO "
        "clips far narrower: cliprange ~3e-4), cispo (clipped, detached importance weight times log-prob) "
        "(docs/ops.md)", one_of(tuple(POLICY_LOSSES)), group="advantages and losses")
    cliprange: float = knob(0.2, "PPO clip epsilon (low side, and high side unless cliprange_high)",
                            number(0.0, 1.0, hi_open=True), group="advantages and losses")
    cliprange_high: Optional[float] = knob(
        None, "high-side clip epsilon (DAPO clip-higher); None = cliprange", number(0.0, lo_open=True),
        group="advantages and losses", optional=True)
    dual_clip: Optional[float] = knob(
        None, "dual-clip constant c > 1 bounding the loss of negative advantages (Ye et al. 2020)",
        number(1.0, lo_open=True), group="advantages and losses", optional=True)
    cliprange_value: Optional[float] = knob(
        0.2, "value clip epsilon around the rollout's values; None = unclipped", number(0.0, lo_open=True),
        group="advantages and losses", optional=True)
    vf_coef: float = knob(0.1, "value-loss weight", number(0.0), group="advantages and losses")
    entropy_coef: float = knob(0.0, "entropy-bonus weight", number(0.0), group="advantages and losses")
    loss_agg: str = knob("token-mean", "how the per-token losses become one number (docs/ops.md)",
                         one_of(LOSS_AGG_MODES), group="advantages and losses")
    loss_agg_norm: Optional[float] = knob(
        None, "the constant of seq-mean-token-sum-norm; None = max_new_tokens", number(0.0, lo_open=True),
        group="advantages and losses", optional=True)

    # -- bookkeeping
    seed: int = knob(0, "seeds python, numpy, torch, the prompt order and the minibatch shuffles",
                     integer(0, 2**63), group="bookkeeping")
    save_every: int = knob(0, "write checkpoint/ and policy/ every this many steps (0 = only at the end)", integer(0),
                           group="bookkeeping")
    log_samples: bool = knob(True, "write samples.jsonl (prompt, response, raw score per sample)", boolean(),
                             group="bookkeeping")
    eval_every: int = knob(
        0, "evaluate on the eval prompts (pyppo train --eval-prompts) every this many steps; with "
        "eval prompts they are also evaluated after the last step",
        integer(0), group="bookkeeping")
    max_consecutive_skips: int = knob(
        3, "stop after this many updates in a row with a NaN/inf loss or gradient (each is skipped)",
        integer(1), group="bookkeeping")

    def __post_init__(self) -> None:
        for name, k in config_knobs():
            setattr(self, name, k.validate(name, getattr(self, name)))
        if self.batch_size % self.samples_per_prompt:
            raise ValueError(f"samples_per_prompt ({self.samples_per_prompt}) must divide batch_size "
                             f"({self.batch_size}): batch_size counts responses, samples_per_prompt to each prompt")
        if self.batch_size % self.mini_batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must divide batch_size ({self.batch_size})")
        if self.micro_batch_size is not None and self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide mini_batch_size ({self.mini_batch_size})")
        if self.advantage_estimator in ("grpo", "rloo", "reinforce_pp_baseline") and self.samples_per_prompt < 2:
            raise ValueError(f"samples_per_prompt must be >= 2 with advantage_estimator = {self.advantage_estimator!r}, "
                             f"got {self.samples_per_prompt}: its baseline is the other responses to the same prompt")
        if self.filter_groups and self.samples_per_prompt < 2:
            raise ValueError(f"filter_groups needs samples_per_prompt >= 2, got {self.samples_per_prompt}: it drops "
                             "groups whose responses all scored the same")
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(f"overlong_buffer ({self.overlong_buffer}) must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        for name, needs in _inert_knobs(self):
            raise ValueError(f"{name} = {getattr(self, name)!r} has no effect here: it needs {needs}")
        if self.value_lora and self.lora_rank == 0:
            raise ValueError("value_lora needs lora_rank > 0 (the value model's adapters use the policy's rank)")
        if self.target_kl is not None and self.kl_coef == 0:
            raise ValueError("kl_coef must be > 0 when target_kl is set (the adaptive update is multiplicative)")

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

    # -- derived values
    @property
    def effective_cliprange_high(self) -> float:
        return self.cliprange_high if self.cliprange_high is not None else self.cliprange

    @property
    def uses_critic(self) -> bool:
        """Whether the run trains a value model (``gae``); the other estimators are critic-free."""
        return self.advantage_estimator == "gae"

    @property
    def effective_value_lr(self) -> float:
        return self.value_lr if self.value_lr is not None else self.lr

    @property
    def effective_loss_agg_norm(self) -> float:
        return self.loss_agg_norm if self.loss_agg_norm is not None else float(self.max_new_tokens)

    @property
    def torch_dtype(self):
        """The compute dtype as a ``torch.dtype``; ``auto`` resolved for ``device``
        (:func:`pyppo.precision.resolve_dtype`)."""
        import torch

        from .precision import resolve_dtype

        name = self.dtype if self.dtype != "auto" else resolve_dtype("auto", resolve_device(self.device))[0]
        return getattr(torch, name)

    def check_world_size(self, world_size: int) -> None:
        """The rules of a run over ``world_size`` processes: ``batch_size`` and ``mini_batch_size``
        count sequences over all of them, ``micro_batch_size`` is per process.

        Raises:
            ValueError: a size that does not divide, naming it.
        """
        n = world_size
        if n == 1:
            return
        for key in ("batch_size", "mini_batch_size"):
            if getattr(self, key) % n:
                raise ValueError(f"{key} ({getattr(self, key)}) must be divisible by the number of processes ({n}); "
                                 f"each process takes {key} / {n} sequences")
        if (self.batch_size // n) % self.samples_per_prompt:
            raise ValueError(f"samples_per_prompt ({self.samples_per_prompt}) must divide each process's share of "
                             f"batch_size ({self.batch_size} / {n} = {self.batch_size // n}): a prompt's group of "
                             "responses is never split between processes")
        local_mini = self.mini_batch_size // n
        if self.micro_batch_size is not None and local_mini % self.micro_batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}, per process) must divide each process's "
                             f"share of mini_batch_size ({self.mini_batch_size} / {n} = {local_mini})")


def config_knobs() -> Iterator[tuple[str, Knob]]:
    """``(field name, Knob)`` for every field of :class:`PPOConfig`, in declaration order."""
    for f in dataclasses.fields(PPOConfig):
        yield f.name, f.metadata["knob"]


def resolve_device(device: str):
    """``torch.device`` for a config ``device`` value (``auto`` = CUDA when available).

    Raises:
        ValueError: a CUDA device is asked for and none is available.
    """
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is available (torch {torch.__version__})")
    return dev


def _default_text(value: Any) -> str:
    return "None" if value is None else repr(value)


def config_markdown() -> str:
    """The key table of ``docs/trainer.md``, generated from the fields' metadata."""
    defaults = {f.name: f.default for f in dataclasses.fields(PPOConfig)}
    lines: list[str] = []
    group = None
    for name, k in config_knobs():
        if k.group != group:
            group = k.group
            lines += ["", f"### {group}", "", "| key | default | values | meaning |", "|---|---|---|---|"]
        lines.append(f"| `{name}` | `{_default_text(defaults[name])}` | {k.expected()} | {k.help} |")
    return "\n".join(lines[1:]) + "\n"


if __name__ == "__main__":  # python -m pyppo.config > table: regenerates the docs table
    sys.stdout.write(config_markdown())
