"""The PPO loop for language models (DESIGN.md §2).

One :meth:`PPOTrainer.step`:

1. take ``batch_size`` prompts (a seeded permutation of the prompt list, epoch by epoch), left-pad
   them (through the chat template when the tokenizer has one and ``use_chat_template``), and sample
   up to ``max_new_tokens`` with the policy (pure sampling: ``temperature``, ``top_k=0``,
   ``top_p=1.0`` by default);
2. cut each response after its first EOS (:func:`response_mask_from_eos`; the pad token may equal
   EOS, so the mask never comes from ``token != pad``);
3. score each (prompt, response) with the reward function (minus ``missing_eos_penalty`` for
   responses that hit the length limit);
4. without gradients: ``old_logprobs`` (policy, sampling temperature), ``ref_logprobs`` (frozen
   reference) and ``values`` at the response positions;
5. ``shape_rewards`` → ``gae`` → ``masked_whiten`` of the advantages over the whole batch;
6. ``ppo_epochs`` passes over shuffled minibatches with gradient accumulation over micro-batches:
   ``policy_loss + vf_coef · value_loss − entropy_coef · entropy``, gradient-norm clipping, AdamW;
7. update the KL coefficient (adaptive controller of Ziegler et al. 2019 when ``target_kl`` is set);
8. return the step's metrics (see :data:`METRIC_KEYS`).

Exactness of the first ratio: the first epoch's row order is drawn *before* the rollout forward
passes, and those passes run on exactly the micro-batches (same rows, same order, same padded
tensors) that the first epoch trains on. The training forward of the first micro-batch therefore
repeats a computation already done bit for bit, and the first PPO ratio is exactly 1 — without
relying on the model's forward being batch-invariant.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import random
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from .buffer import RolloutBuffer
from .kl_control import AdaptiveKLController, FixedKLController
from .ops import gae, gather_logprobs, linear_logprobs, masked_mean, masked_whiten, shape_rewards
from .ops.losses import LOSS_AGG_MODES, aggregate_loss, loss_normalizer, ppo_policy_loss, ppo_value_loss
from .rewards import RewardError, validate_scores

__all__ = [
    "PPOConfig",
    "PPOTrainer",
    "PromptSampler",
    "METRIC_KEYS",
    "NonFiniteUpdateError",
    "find_checkpoint",
    "TIME_KEYS",
    "response_mask_from_eos",
]

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")

PHASES = ("generate", "policy_forward", "ref_forward", "value_forward", "score", "advantages", "update")
TIME_KEYS = tuple(f"time_{p}" for p in PHASES)
#: Keys of the dict :meth:`PPOTrainer.step` returns (DESIGN.md §2.8) — a few diagnostics are added
#: on top (``step``, ``clipfrac_lower``, ``ratio_mean``, ``ratio_max``, ``vf_clipfrac``,
#: ``policy_grad_norm``, ``value_grad_norm``, ``eos_fraction``, ``first_*``).
METRIC_KEYS = (
    "score_mean", "reward_mean", "kl_mean", "kl_coef", "entropy_mean", "policy_loss", "value_loss",
    "clipfrac", "approx_kl", "explained_variance", "response_length_mean", "step_seconds",
) + TIME_KEYS

CHECKPOINT_FILES = ("policy.pt", "value_model.pt", "optimizers.pt", "trainer_state.pt")


class NonFiniteUpdateError(RuntimeError):
    """``max_consecutive_skips`` updates in a row had a NaN/inf loss or gradient: training stopped."""


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class PPOConfig:
    """Every knob of the PPO loop. Validated in ``__post_init__``; an invalid value raises
    ``ValueError`` whose message starts with the key.

    Sizes (counts of sequences):
        steps: PPO steps (rollout + update) to run, ``>= 1``.
        batch_size: prompts sampled per step, ``>= 1``.
        mini_batch_size: sequences per optimizer step; must divide ``batch_size``.
        micro_batch_size: sequences per forward/backward (gradient accumulation); must divide
            ``mini_batch_size``; ``None`` = ``mini_batch_size`` (no accumulation). Rollout forward
            passes use the same size.
        ppo_epochs: passes over the batch per step, ``>= 1``.

    Sampling:
        max_new_tokens: response length limit (tokens), ``>= 1``.
        max_prompt_length: prompts longer than this (tokens) are cut from the left; ``None``: no cut.
        temperature: ``> 0``; also used for the log-probs in the ratio and KL (the sampling
            distribution is ``softmax(z / temperature)``).
        top_k, top_p: ``0`` and ``1.0`` (pure sampling, so that log-probs are of the true sampling
            distribution). Other values change what is sampled but not the log-probs, making PPO
            off-policy; they are allowed for experiments.
        use_chat_template: format prompts with the tokenizer's chat template when it has one.

    Optimisation:
        lr: AdamW learning rate of the policy, ``> 0``.
        value_lr: of the value model; ``None`` = ``lr``.
        weight_decay: AdamW weight decay, ``>= 0``. adam_eps: AdamW ε, ``> 0``.
        max_grad_norm: clip each model's gradient norm to this (``> 0``); ``None``: no clipping.
        logprobs_from_hidden: compute log-probs with :func:`pyppo.ops.linear_logprobs` from the
            backbone's last hidden states and the output embedding, so the ``[B, T, V]`` logits
            never exist (forward or backward). Models whose head is not a plain linear layer
            (logit soft-capping or scaling, no ``get_decoder``) use the full logits instead.
        disable_dropout: set every dropout probability of the policy and the value model to 0, so
            that the training forward matches the rollout forward (TRL does the same).

    KL penalty (per token ``r_t = −kl_coef · kl_t``, plus the score at the last token):
        kl_coef: initial/fixed coefficient β, ``>= 0`` (``> 0`` with ``target_kl``).
        target_kl: target KL in nats per sequence for the adaptive controller; ``None``: fixed β.
        kl_horizon: controller horizon in samples, ``> 0``.
        kl_estimator: ``"k1" | "k2" | "k3" | "abs"`` (Schulman 2020).
        score_clip: clip scores to ``[−score_clip, score_clip]`` (``> 0``) or ``None``.
        missing_eos_penalty: subtracted from the score of responses without EOS (``>= 0``), or None.

    Advantages and losses:
        gamma, lam: GAE discount and λ, in ``[0, 1]``.
        whiten_advantages: whiten advantages over the whole batch's valid tokens.
        cliprange: ε (low side, and high side unless ``cliprange_high``), in ``[0, 1)``.
        cliprange_high: ε_high ``> 0`` (DAPO clip-higher); ``None`` = ``cliprange``.
        dual_clip: dual-clip constant ``> 1`` (Ye et al. 2020), or ``None``.
        cliprange_value: value clip ε_v ``> 0``, or ``None`` (unclipped).
        vf_coef: value-loss weight ``>= 0``. entropy_coef: entropy-bonus weight ``>= 0``.
        loss_agg: one of ``LOSS_AGG_MODES``; loss_agg_norm: the constant of
            ``"seq-mean-token-sum-norm"`` (``> 0``), ``None`` = ``max_new_tokens``.

    Bookkeeping:
        seed: ``0 <= seed < 2**63``; seeds python, numpy and torch, the prompt order and the
            minibatch shuffles.
        save_every: write ``checkpoint/`` every this many steps (``>= 0``; 0 = only at the end).
        log_samples: write ``samples.jsonl``.

    Faults:
        max_consecutive_skips: an update (one optimizer step of both models) whose loss or
            gradient norm is NaN/inf is skipped — no optimizer step, gradients zeroed, a warning,
            counted in the ``skipped_updates`` metric. This many skipped updates in a row
            (counted across PPO steps; ``>= 1``) stop the run with :class:`NonFiniteUpdateError`,
            before the step is logged or checkpointed, so the last good checkpoint is kept.
    """

    steps: int = 100
    batch_size: int = 16
    mini_batch_size: int = 8
    micro_batch_size: Optional[int] = None
    ppo_epochs: int = 4

    max_new_tokens: int = 48
    max_prompt_length: Optional[int] = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    use_chat_template: bool = True

    lr: float = 1e-5
    value_lr: Optional[float] = None
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    max_grad_norm: Optional[float] = 1.0
    logprobs_from_hidden: bool = True
    disable_dropout: bool = True

    kl_coef: float = 0.05
    target_kl: Optional[float] = None
    kl_horizon: float = 10000.0
    kl_estimator: str = "k1"
    score_clip: Optional[float] = None
    missing_eos_penalty: Optional[float] = None

    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    cliprange: float = 0.2
    cliprange_high: Optional[float] = None
    dual_clip: Optional[float] = None
    cliprange_value: Optional[float] = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    loss_agg_norm: Optional[float] = None

    seed: int = 0
    save_every: int = 0
    log_samples: bool = True

    max_consecutive_skips: int = 3

    # -- validation ------------------------------------------------------------------------
    def __post_init__(self) -> None:
        def int_(key: str, lo: int, optional: bool = False) -> None:
            v = getattr(self, key)
            if v is None and optional:
                return
            if not _is_int(v) or v < lo:
                raise ValueError(f"{key} must be an int >= {lo}{' or None' if optional else ''}, got {v!r}")
            setattr(self, key, int(v))

        def num(key: str, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False,
                hi_open: bool = False, optional: bool = False) -> None:
            v = getattr(self, key)
            if v is None and optional:
                return
            ok = _is_num(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
            if not ok:
                lb = "(" if lo_open else "["
                rb = ")" if hi_open else "]"
                raise ValueError(
                    f"{key} must be a finite number in {lb}{lo}, {hi}{rb}{' or None' if optional else ''}, got {v!r}"
                )
            setattr(self, key, float(v))

        def bool_(key: str) -> None:
            v = getattr(self, key)
            if not isinstance(v, bool):
                raise ValueError(f"{key} must be a bool, got {v!r}")

        def choice(key: str, options: Sequence[str]) -> None:
            v = getattr(self, key)
            if v not in options:
                raise ValueError(f"{key} must be one of {tuple(options)}, got {v!r}")

        int_("steps", 1)
        int_("batch_size", 1)
        int_("mini_batch_size", 1)
        int_("micro_batch_size", 1, optional=True)
        int_("ppo_epochs", 1)
        if self.mini_batch_size > self.batch_size or self.batch_size % self.mini_batch_size:
            raise ValueError(
                f"mini_batch_size ({self.mini_batch_size}) must divide batch_size ({self.batch_size})"
            )
        if self.micro_batch_size is not None and (
            self.micro_batch_size > self.mini_batch_size or self.mini_batch_size % self.micro_batch_size
        ):
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide mini_batch_size ({self.mini_batch_size})"
            )
        int_("max_new_tokens", 1)
        int_("max_prompt_length", 1, optional=True)
        num("temperature", 0.0, lo_open=True)
        int_("top_k", 0)
        num("top_p", 0.0, 1.0, lo_open=True)
        bool_("use_chat_template")
        num("lr", 0.0, lo_open=True)
        num("value_lr", 0.0, lo_open=True, optional=True)
        num("weight_decay", 0.0)
        num("adam_eps", 0.0, lo_open=True)
        num("max_grad_norm", 0.0, lo_open=True, optional=True)
        bool_("disable_dropout")
        bool_("logprobs_from_hidden")
        num("kl_coef", 0.0)
        num("target_kl", 0.0, lo_open=True, optional=True)
        if self.target_kl is not None and self.kl_coef == 0:
            raise ValueError("kl_coef must be > 0 when target_kl is set (the adaptive update is multiplicative)")
        num("kl_horizon", 0.0, lo_open=True)
        choice("kl_estimator", KL_ESTIMATORS)
        num("score_clip", 0.0, lo_open=True, optional=True)
        num("missing_eos_penalty", 0.0, optional=True)
        num("gamma", 0.0, 1.0)
        num("lam", 0.0, 1.0)
        bool_("whiten_advantages")
        num("cliprange", 0.0, 1.0, hi_open=True)
        num("cliprange_high", 0.0, lo_open=True, optional=True)
        num("dual_clip", 1.0, lo_open=True, optional=True)
        num("cliprange_value", 0.0, lo_open=True, optional=True)
        num("vf_coef", 0.0)
        num("entropy_coef", 0.0)
        choice("loss_agg", LOSS_AGG_MODES)
        num("loss_agg_norm", 0.0, lo_open=True, optional=True)
        int_("seed", 0)
        if self.seed >= 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        int_("save_every", 0)
        bool_("log_samples")
        int_("max_consecutive_skips", 1)

    # -- (de)serialisation -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "PPOConfig":
        """Build from a mapping (e.g. a parsed TOML file); missing keys keep their defaults.

        Raises:
            ValueError: unknown keys (all of them are named), or an invalid value (naming its key).
        """
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config key(s): {', '.join(map(str, unknown))}")
        return cls(**d)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    # -- derived values --------------------------------------------------------------------------
    @property
    def effective_micro_batch_size(self) -> int:
        return self.micro_batch_size if self.micro_batch_size is not None else self.mini_batch_size

    @property
    def effective_cliprange_high(self) -> float:
        return self.cliprange_high if self.cliprange_high is not None else self.cliprange

    @property
    def effective_loss_agg_norm(self) -> float:
        return self.loss_agg_norm if self.loss_agg_norm is not None else float(self.max_new_tokens)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def response_mask_from_eos(
    response_ids: torch.Tensor, eos_token_id: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask of each response up to and including its first EOS (DESIGN.md §2.2).

    The mask is built from the position of the first EOS, never from ``token != pad``: the pad
    token may equal EOS (SmolLM2), and the real EOS must stay in. A response that is only EOS has
    one valid position; a response without EOS (cut by the length limit) is valid everywhere.

    Args:
        response_ids: ``[B, T]`` int64, right-padded generated tokens, ``T >= 1``.
        eos_token_id: the EOS id.

    Returns:
        ``(response_mask [B, T] bool, lengths [B] int64, has_eos [B] bool)``; every length is >= 1.

    Raises:
        ValueError: ``response_ids`` not 2-D or with ``T == 0``.
    """
    if response_ids.dim() != 2 or response_ids.shape[1] == 0:
        raise ValueError(f"response_ids must be [B, T] with T >= 1, got shape {tuple(response_ids.shape)}")
    T = response_ids.shape[1]
    is_eos = response_ids == eos_token_id
    has_eos = is_eos.any(dim=1)
    # argmax returns the first maximal index, i.e. the first EOS.
    first = is_eos.to(torch.uint8).argmax(dim=1)
    lengths = torch.where(has_eos, first + 1, torch.full_like(first, T))
    mask = torch.arange(T, device=response_ids.device).unsqueeze(0) < lengths.unsqueeze(1)
    return mask, lengths, has_eos


class PromptSampler:
    """Prompts in a seeded random order, epoch after epoch (each epoch a fresh permutation).

    Epoch ``e``'s order is ``numpy.random.default_rng([seed, e]).permutation(N)``, a pure function
    of ``(seed, e)``, so the state is just ``(epoch, position)``.

    Raises:
        ValueError: an empty prompt list or a non-string prompt.
    """

    def __init__(self, prompts: Sequence[str], seed: int):
        if len(prompts) == 0:
            raise ValueError("prompts must not be empty")
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise ValueError(f"prompts[{i}] must be a str, got {type(p).__name__}")
        self.prompts = list(prompts)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._perm: Optional[np.ndarray] = None
        self._perm_epoch = -1

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.prompts))
            self._perm_epoch = self.epoch
        return self._perm

    def sample(self, k: int) -> List[str]:
        """The next ``k`` prompts (crossing into the next epoch's permutation when needed)."""
        out: List[str] = []
        n = len(self.prompts)
        while len(out) < k:
            perm = self._permutation()
            take = min(k - len(out), n - self.position)
            out.extend(self.prompts[i] for i in perm[self.position:self.position + take])
            self.position += take
            if self.position == n:
                self.epoch += 1
                self.position = 0
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": len(self.prompts)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if state["n"] != len(self.prompts):
            raise ValueError(f"state: the checkpoint had {state['n']} prompts, this sampler has {len(self.prompts)}")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def _linear_head(model: nn.Module) -> Optional[Tuple[nn.Module, nn.Linear]]:
    """``(backbone, lm_head)`` when ``logits == lm_head(backbone(...).last_hidden_state)``, else None.

    Heads that rescale or soft-cap the logits (Gemma 2's ``final_logit_softcapping``, Cohere's
    ``logit_scale``) are not a plain linear map of the hidden states; they keep the full-logits path.
    """
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    try:
        backbone, head = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if backbone is None or backbone is model or not isinstance(head, nn.Linear):
        return None
    return backbone, head


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # HF attention modules keep their dropout as a float attribute applied only in train mode.
        for attr in ("attention_dropout", "attn_dropout", "dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _checkpoint_is_complete(d: Path) -> bool:
    return d.is_dir() and all((d / name).is_file() for name in CHECKPOINT_FILES)


def _backup_path(target: Path) -> Path:
    """Where :meth:`PPOTrainer.save_checkpoint` keeps the previous checkpoint while swapping."""
    return target.parent / f"{target.name}.old"


def find_checkpoint(directory: str | os.PathLike) -> Optional[Path]:
    """The complete checkpoint to resume from for ``directory``, or ``None``.

    ``directory`` itself when it holds every checkpoint file; otherwise the previous checkpoint
    that an interrupted :meth:`PPOTrainer.save_checkpoint` left at ``<directory>.old`` (or, from
    older versions, ``<directory>.old-*``), when that one is complete.
    """
    target = Path(directory)
    if _checkpoint_is_complete(target):
        return target
    backups = [_backup_path(target)] + sorted(target.parent.glob(f"{glob.escape(target.name)}.old-*"), reverse=True)
    for cand in backups:
        if _checkpoint_is_complete(cand):
            return cand
    return None


class _Timer:
    """Accumulates seconds per phase and marks each phase for ``torch.profiler``."""

    def __init__(self) -> None:
        self.seconds = {p: 0.0 for p in PHASES}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        with torch.profiler.record_function(f"pyppo/{name}"):
            yield
        self.seconds[name] += time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------
RewardFn = Callable[[List[str], List[str]], Sequence[float]]


def _reward_name(fn: Any) -> str:
    name = getattr(fn, "reward_name", None) or getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


def _clip_text(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _truncate_log(path: Path, last_step: int) -> None:
    """Drop the rows of a JSON-lines log whose ``step`` is after ``last_step`` (a run killed after
    logging a step but before checkpointing it logged steps that a resumed run takes again), and
    any torn last line. Rewritten atomically; untouched when there is nothing to drop."""
    if not path.is_file():
        return
    keep: List[str] = []
    dropped = 0
    with open(path, "r") as f:
        for line in f:
            try:
                row = json.loads(line)
                ok = line.endswith("\n") and float(row["step"]) <= last_step
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok:
                keep.append(line)
            else:
                dropped += 1
    if not dropped:
        return
    warnings.warn(
        f"{path}: dropped {dropped} line(s) logged after step {last_step} (the checkpoint's) or torn",
        RuntimeWarning,
        stacklevel=3,
    )
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class PPOTrainer:
    """PPO for a causal LM policy with a separate value model (DESIGN.md §2).

    Args:
        config: a :class:`PPOConfig`.
        policy: a ``transformers`` causal LM (trained in place).
        ref_policy: frozen reference; ``None`` = a frozen deep copy of ``policy`` taken now.
        value_model: ``pyppo.models.ValueModel`` (``forward(input_ids, attention_mask,
            position_ids) -> [B, L]`` float32); ``None`` = ``ValueModel.from_causal_lm(policy)``.
        tokenizer: the policy's tokenizer; needs an EOS token. Its ``padding_side`` is set to
            ``"left"``; a missing pad token is taken to be EOS.
        reward_fn: ``(prompts, responses) -> scores``, one finite float per pair (a list, array or
            tensor).
        prompts: the prompt strings to sample from.

    Seeds python, numpy and torch from ``config.seed`` (sampling uses torch's global RNG).

    Raises:
        ValueError: bad argument (naming it): no EOS token, empty prompts, non-callable reward.
    """

    def __init__(
        self,
        config: PPOConfig,
        policy: nn.Module,
        ref_policy: Optional[nn.Module],
        value_model: Optional[nn.Module],
        tokenizer: Any,
        reward_fn: RewardFn,
        prompts: Sequence[str],
    ):
        if not isinstance(config, PPOConfig):
            raise ValueError(f"config must be a PPOConfig, got {type(config).__name__}")
        if not callable(reward_fn):
            raise ValueError("reward_fn must be callable (prompts, responses) -> scores")
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("tokenizer must have an eos_token_id")
        self.config = config
        self._seed_everything(config.seed)

        self.policy = policy
        if ref_policy is None:
            from .models import make_reference

            ref_policy = make_reference(policy)
        if value_model is None:
            from .models import ValueModel

            value_model = ValueModel.from_causal_lm(policy)
        self.ref_policy = ref_policy
        self.ref_policy.requires_grad_(False)
        self.ref_policy.eval()
        self.value_model = value_model
        if config.disable_dropout:
            _disable_dropout(self.policy)
            _disable_dropout(self.value_model)

        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            # Padding is masked out everywhere, so any id works; EOS is what SmolLM2 uses.
            tokenizer.pad_token = tokenizer.eos_token
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else self.eos_token_id
        self.reward_fn = reward_fn
        self.sampler = PromptSampler(prompts, config.seed)
        self.device = next(policy.parameters()).device

        self.policy_optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad],
            lr=config.lr, eps=config.adam_eps, weight_decay=config.weight_decay,
        )
        self.value_optimizer = torch.optim.AdamW(
            [p for p in self.value_model.parameters() if p.requires_grad],
            lr=config.value_lr if config.value_lr is not None else config.lr,
            eps=config.adam_eps, weight_decay=config.weight_decay,
        )
        if config.target_kl is not None:
            self.kl_ctl = AdaptiveKLController(config.kl_coef, config.target_kl, config.kl_horizon)
        else:
            self.kl_ctl = FixedKLController(config.kl_coef)
        # Minibatch shuffles have their own stream so that they do not depend on how many random
        # numbers sampling consumed.
        self.shuffle_generator = torch.Generator().manual_seed(config.seed + 1)
        self.step_count = 0
        #: Updates skipped for a NaN/inf loss or gradient: in a row (reset by a good update), and
        #: in all (both saved in checkpoints).
        self.consecutive_skips = 0
        self.skipped_updates_total = 0
        #: Statistics of the first minibatch of the first PPO epoch of the last step (before any
        #: optimizer step): the ratio there must be exactly 1.
        self.first_minibatch_stats: Dict[str, float] = {}
        #: The last step's rollout (a :class:`RolloutBuffer`), for inspection.
        self.last_batch: Optional[RolloutBuffer] = None

    # ---------------------------------------------------------------- setup helpers
    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _generation_config(self):
        from transformers import GenerationConfig

        c = self.config
        # Every field that would otherwise be filled from the model's own generation_config and
        # could alter the sampling distribution is pinned here.
        return GenerationConfig(
            do_sample=True,
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            num_beams=1,
            min_new_tokens=0,
            max_new_tokens=c.max_new_tokens,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )

    def _encode_prompts(self, prompts: List[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        tok = self.tokenizer
        use_template = self.config.use_chat_template and getattr(tok, "chat_template", None)
        if use_template:
            texts = [
                tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                for p in prompts
            ]
        else:
            texts = list(prompts)
        kwargs: Dict[str, Any] = {}
        if self.config.max_prompt_length is not None:
            kwargs.update(truncation=True, max_length=self.config.max_prompt_length)
        old_trunc = getattr(tok, "truncation_side", "right")
        tok.truncation_side = "left"  # keep the end of a long prompt, next to the response
        try:
            enc = tok(
                texts, padding=True, return_tensors="pt",
                # The chat template already contains the special tokens it wants.
                add_special_tokens=not use_template, **kwargs,
            )
        finally:
            tok.truncation_side = old_trunc
        ids = enc["input_ids"].to(self.device)
        mask = enc["attention_mask"].to(self.device).bool()
        if not bool(mask.any(dim=1).all()):
            raise ValueError("prompts: a prompt encoded to zero tokens")
        return ids, mask

    # ---------------------------------------------------------------- forward passes
    def _logprobs(
        self, model: nn.Module, mb: RolloutBuffer, *, return_entropy: bool
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs (and entropies) of the response tokens, ``[b, T]`` float32, 0 where masked."""
        T = mb.response_length
        head = _linear_head(model) if self.config.logprobs_from_hidden else None
        if head is not None:
            backbone, lm_head = head
            hidden = backbone(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                use_cache=False,
            ).last_hidden_state
            # Position P-1+t scores response token t.
            res = linear_logprobs(
                hidden[:, -(T + 1):-1], lm_head.weight, mb.response_ids, mb.response_mask,
                bias=lm_head.bias, temperature=self.config.temperature, return_entropy=return_entropy,
            )
        else:
            # Only the last T+1 positions' logits are needed: position P-1+t scores response token t.
            out = model(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                use_cache=False, logits_to_keep=T + 1,
            )
            # Slicing from the end works whether or not the model honoured logits_to_keep.
            logits = out.logits[:, -(T + 1):-1]
            res = gather_logprobs(
                logits, mb.response_ids, mb.response_mask,
                temperature=self.config.temperature, return_entropy=return_entropy,
            )
        if return_entropy:
            return res[0], res[1]
        return res, None

    def _values(self, mb: RolloutBuffer) -> torch.Tensor:
        """Values at response positions, ``[b, T]`` float32: the value of the state before token t."""
        P, T = mb.prompt_length, mb.response_length
        v = self.value_model(mb.input_ids, mb.attention_mask, mb.position_ids)
        v = v[:, P - 1:P + T - 1].float()
        return torch.where(mb.response_mask, v, torch.zeros((), dtype=v.dtype, device=v.device))

    # ---------------------------------------------------------------- one step
    def _score(self, batch: RolloutBuffer, lengths: torch.Tensor) -> torch.Tensor:
        responses = self.tokenizer.batch_decode(
            [row[: int(n)].tolist() for row, n in zip(batch.response_ids.cpu(), lengths.cpu())],
            skip_special_tokens=True,
        )
        batch.responses = responses
        name = _reward_name(self.reward_fn)
        where = f"step {self.step_count + 1}"
        try:
            raw = self.reward_fn(list(batch.prompts), list(responses))
            values = validate_scores(raw, len(batch), name)
        except RewardError as exc:
            # Bad scores (from validate_scores, here or inside a load_reward wrapper): add the
            # offending pair to the message.
            if exc.index is not None and 0 <= exc.index < len(batch):
                i = exc.index
                raise RewardError(
                    f"{exc} ({where}; prompt {i}: {_clip_text(batch.prompts[i])!r}, "
                    f"response: {_clip_text(responses[i])!r})",
                    reward=exc.reward, index=exc.index, value=exc.value,
                ) from exc
            raise RewardError(f"{exc} ({where})", reward=exc.reward, index=exc.index, value=exc.value) from exc
        except Exception as exc:
            raise RewardError(
                f"reward {name!r} raised {type(exc).__name__}: {exc} "
                f"({where}, scoring {len(batch)} responses)",
                reward=name,
            ) from exc
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def step(self) -> Dict[str, float]:
        """Run one PPO step (rollout, scoring, advantages, ``ppo_epochs`` of updates, KL control).

        Returns:
            metrics (python floats; ``step`` an int): :data:`METRIC_KEYS` plus diagnostics. ``kl_mean`` is the KL
            summed over each response's tokens, averaged over responses; ``reward_mean`` the shaped
            return (score minus KL penalty) likewise; ``kl_coef`` the coefficient used for this
            step's rewards (the controller updates it afterwards); ``entropy_mean`` the mean
            per-token entropy of the sampling distribution over valid response tokens;
            ``policy_loss``, ``value_loss`` and the ``clipfrac`` / ``approx_kl`` /
            ``explained_variance`` statistics are averaged over all minibatches of all epochs.
        """
        c = self.config
        timer = _Timer()
        t_start = time.perf_counter()
        micro = c.effective_micro_batch_size

        # 1. prompts and sampling ------------------------------------------------------------
        prompts = self.sampler.sample(c.batch_size)
        with timer.phase("generate"), torch.no_grad():
            query_ids, query_mask = self._encode_prompts(prompts)
            self.policy.eval()
            out = self.policy.generate(
                input_ids=query_ids, attention_mask=query_mask.long(),
                generation_config=self._generation_config(),
            )
            response_ids = out[:, query_ids.shape[1]:]
            if response_ids.shape[1] == 0:  # pragma: no cover - generate always adds >= 1 token
                raise RuntimeError("generate returned no new tokens")
            # 2. cut after the first EOS
            response_mask, lengths, has_eos = response_mask_from_eos(response_ids, self.eos_token_id)
            response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, self.pad_token_id))
        batch = RolloutBuffer(
            query_ids=query_ids, query_mask=query_mask, response_ids=response_ids,
            response_mask=response_mask, has_eos=has_eos, prompts=prompts,
        )

        # 3. scores ---------------------------------------------------------------------------
        with timer.phase("score"):
            raw_scores = self._score(batch, lengths)
            self._last_raw_scores = raw_scores
            scores = raw_scores
            if c.missing_eos_penalty is not None:
                scores = scores - c.missing_eos_penalty * (~has_eos).float()
            batch.scores = scores

        # 4. rollout forward passes, in the first epoch's micro-batch layout --------------------
        first_perm = batch.epoch_permutation(self.shuffle_generator)
        chunks = [first_perm[i:i + micro] for i in range(0, len(batch), micro)]
        B, T = len(batch), batch.response_length
        dev = self.device
        old_logprobs = torch.zeros(B, T, device=dev)
        entropy = torch.zeros(B, T, device=dev)
        ref_logprobs = torch.zeros(B, T, device=dev)
        values = torch.zeros(B, T, device=dev)
        self.value_model.eval()
        with torch.no_grad():
            for idx in chunks:
                mb = batch.select(idx)
                ix = idx.to(dev)
                with timer.phase("policy_forward"):
                    lp, ent = self._logprobs(self.policy, mb, return_entropy=True)
                    old_logprobs[ix] = lp
                    entropy[ix] = ent
                with timer.phase("ref_forward"):
                    # The log-prob kernels sum in one order whether or not entropy is asked for,
                    # so the step-1 KL is exactly 0 without computing the reference's entropy.
                    ref_logprobs[ix] = self._logprobs(self.ref_policy, mb, return_entropy=False)[0]
                with timer.phase("value_forward"):
                    values[ix] = self._values(mb)
        batch.old_logprobs, batch.ref_logprobs, batch.values = old_logprobs, ref_logprobs, values

        # 5. rewards and advantages -----------------------------------------------------------
        kl_coef = float(self.kl_ctl.value)
        with timer.phase("advantages"), torch.no_grad():
            rewards, kl = shape_rewards(
                scores, old_logprobs, ref_logprobs, response_mask,
                kl_coef=kl_coef, estimator=c.kl_estimator, score_clip=c.score_clip,
            )
            advantages, returns = gae(rewards, values, response_mask, gamma=c.gamma, lam=c.lam)
            if c.whiten_advantages:
                advantages = masked_whiten(advantages, response_mask)
        batch.rewards, batch.kl, batch.advantages, batch.returns = rewards, kl, advantages, returns
        self.last_batch = batch

        # 6. PPO epochs ---------------------------------------------------------------------------
        with timer.phase("update"):
            update_stats = self._update(batch, first_perm)

        # 7. KL control -----------------------------------------------------------------------------
        kl_mean = float((kl * response_mask).sum(dim=1).mean())
        if math.isfinite(kl_mean):
            self.kl_ctl.update(kl_mean, c.batch_size)
        else:
            warnings.warn(
                f"step {self.step_count + 1}: the rollout's KL is {kl_mean}; the KL coefficient is not updated",
                RuntimeWarning,
                stacklevel=2,
            )
        self.step_count += 1

        # 8. metrics ------------------------------------------------------------------------------
        metrics: Dict[str, float] = {
            "step": self.step_count,
            "score_mean": float(raw_scores.mean()),
            "reward_mean": float(rewards.sum(dim=1).mean()),
            "kl_mean": kl_mean,
            "kl_coef": kl_coef,
            "entropy_mean": float(masked_mean(entropy, response_mask)),
            "response_length_mean": float(lengths.float().mean()),
            "eos_fraction": float(has_eos.float().mean()),
        }
        metrics.update(update_stats)
        metrics.update({f"first_{k}": v for k, v in self.first_minibatch_stats.items()})
        for p in PHASES:
            metrics[f"time_{p}"] = timer.seconds[p]
        metrics["step_seconds"] = time.perf_counter() - t_start
        return metrics

    def _update(self, batch: RolloutBuffer, first_perm: torch.Tensor) -> Dict[str, float]:
        c = self.config
        micro = c.effective_micro_batch_size
        norm = c.effective_loss_agg_norm
        sums: Dict[str, float] = {}
        n_tokens_total = 0
        n_minibatches = 0
        skipped = 0
        stat_keys: set = set()
        loss_sums = {"policy_loss": 0.0, "value_loss": 0.0, "policy_grad_norm": 0.0, "value_grad_norm": 0.0}
        ratio_max = -math.inf
        self.policy.train()
        self.value_model.train()
        for epoch in range(c.ppo_epochs):
            perm = first_perm if epoch == 0 else batch.epoch_permutation(self.shuffle_generator)
            for mb_index, mb in enumerate(batch.minibatches(c.mini_batch_size, permutation=perm)):
                first = epoch == 0 and mb_index == 0
                normalizer = loss_normalizer(mb.response_mask, c.loss_agg)
                self.policy_optimizer.zero_grad(set_to_none=True)
                self.value_optimizer.zero_grad(set_to_none=True)
                pg_total = 0.0
                vf_total = 0.0
                ent_ok = True
                mb_sums: Dict[str, float] = {}
                mb_tokens = 0
                mb_ratio_max = -math.inf
                first_acc: Dict[str, float] = {}
                for mu in mb.micro_batches(micro):
                    # The entropy is only needed for the bonus; asking for it or not leaves the
                    # log-prob bits (and so the exact first ratio of 1) unchanged.
                    logprobs, ent = self._logprobs(self.policy, mu, return_entropy=c.entropy_coef > 0)
                    vpred = self._values(mu)
                    pg_loss, pg_stats = ppo_policy_loss(
                        logprobs, mu.old_logprobs, mu.advantages, mu.response_mask,
                        cliprange_low=c.cliprange, cliprange_high=c.effective_cliprange_high,
                        dual_clip=c.dual_clip, loss_agg=c.loss_agg, loss_agg_norm=norm, normalizer=normalizer,
                    )
                    vf_loss, vf_stats = ppo_value_loss(
                        vpred, mu.values, mu.returns, mu.response_mask,
                        cliprange_value=c.cliprange_value, loss_agg=c.loss_agg, loss_agg_norm=norm,
                        normalizer=normalizer,
                    )
                    loss = pg_loss + c.vf_coef * vf_loss
                    if c.entropy_coef > 0:
                        ent_loss = aggregate_loss(ent, mu.response_mask, c.loss_agg, norm, normalizer)
                        ent_ok = ent_ok and bool(torch.isfinite(ent_loss.detach()))
                        loss = loss - c.entropy_coef * ent_loss
                    loss.backward()

                    pg_total += float(pg_loss.detach())
                    vf_total += float(vf_loss.detach())
                    # Token-weighted accumulation: the logged statistics are means over all valid
                    # tokens the update saw, whatever the micro-batch sizes.
                    n_tok = int(mu.response_mask.sum())
                    mb_tokens += n_tok
                    for k, v in {**pg_stats, **vf_stats}.items():
                        if k == "ratio_max":
                            mb_ratio_max = max(mb_ratio_max, float(v))
                            continue
                        mb_sums[k] = mb_sums.get(k, 0.0) + float(v) * n_tok
                        stat_keys.add(k)
                    if first:
                        with torch.no_grad():
                            m = mu.response_mask
                            dev_ = (logprobs.detach() - mu.old_logprobs).abs()
                            ratio = torch.exp(logprobs.detach() - mu.old_logprobs)
                            first_acc["max_abs_logratio"] = max(
                                first_acc.get("max_abs_logratio", 0.0), float(dev_[m].max())
                            )
                            first_acc["ratio_max"] = max(first_acc.get("ratio_max", -math.inf), float(ratio[m].max()))
                            first_acc["ratio_min"] = min(first_acc.get("ratio_min", math.inf), float(ratio[m].min()))
                            for k in ("ratio_mean", "approx_kl", "clipfrac"):
                                first_acc[k + "_sum"] = first_acc.get(k + "_sum", 0.0) + float(pg_stats[k]) * n_tok
                            first_acc["n"] = first_acc.get("n", 0) + n_tok

                gp = self._clip(self.policy)
                gv = self._clip(self.value_model)
                finite = {"policy_loss": pg_total, "value_loss": vf_total,
                          "policy_grad_norm": gp, "value_grad_norm": gv}
                bad = [k for k, v in finite.items() if not math.isfinite(v)]
                if not ent_ok:
                    bad.append("entropy_loss")
                if bad:
                    # Skip this update: no optimizer step, gradients dropped, weights untouched.
                    self.policy_optimizer.zero_grad(set_to_none=True)
                    self.value_optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    self.skipped_updates_total += 1
                    self.consecutive_skips += 1
                    what = ", ".join(f"{k}={finite.get(k, math.nan)}" for k in bad)
                    warnings.warn(
                        f"step {self.step_count + 1}, epoch {epoch + 1}, minibatch {mb_index + 1}: non-finite "
                        f"{what}; update skipped ({self.consecutive_skips} in a row, "
                        f"max_consecutive_skips={c.max_consecutive_skips})",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    if self.consecutive_skips >= c.max_consecutive_skips:
                        self.policy.eval()
                        self.value_model.eval()
                        raise NonFiniteUpdateError(
                            f"training stopped at step {self.step_count + 1}: {self.consecutive_skips} updates "
                            f"in a row had a non-finite loss or gradient (max_consecutive_skips="
                            f"{c.max_consecutive_skips}; last: {what})"
                        )
                else:
                    self.consecutive_skips = 0
                    self.policy_optimizer.step()
                    self.value_optimizer.step()
                    loss_sums["policy_loss"] += pg_total
                    loss_sums["value_loss"] += vf_total
                    loss_sums["policy_grad_norm"] += gp
                    loss_sums["value_grad_norm"] += gv
                    n_minibatches += 1
                    n_tokens_total += mb_tokens
                    ratio_max = max(ratio_max, mb_ratio_max)
                    for k, v in mb_sums.items():
                        sums[k] = sums.get(k, 0.0) + v
                if first:
                    n = first_acc.pop("n")
                    self.first_minibatch_stats = {
                        "max_abs_logratio": first_acc["max_abs_logratio"],
                        "ratio_max": first_acc["ratio_max"],
                        "ratio_min": first_acc["ratio_min"],
                        **{k: first_acc[k + "_sum"] / n for k in ("ratio_mean", "approx_kl", "clipfrac")},
                    }
        self.policy.eval()
        self.value_model.eval()
        # Averages over the updates that were applied (NaN when every update was skipped).
        out = {k: (v / n_minibatches if n_minibatches else math.nan) for k, v in loss_sums.items()}
        out.update({k: (sums[k] / n_tokens_total if n_tokens_total and k in sums else math.nan) for k in stat_keys})
        out["ratio_max"] = ratio_max if n_minibatches else math.nan
        out["skipped_updates"] = skipped
        return out

    def _clip(self, model: nn.Module) -> float:
        """Clip ``model``'s gradient norm to ``max_grad_norm``; returns the norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    # ---------------------------------------------------------------- training loop
    def train(self, output_dir: str | os.PathLike, *, progress: bool = True) -> List[Dict[str, float]]:
        """Run steps ``step_count + 1 … config.steps``, logging to ``output_dir``.

        Appends one JSON object per step to ``metrics.jsonl`` and, with ``log_samples``, one per
        sample (``step``, ``prompt``, ``response``, ``score``) to ``samples.jsonl``; writes
        ``checkpoint/`` every ``save_every`` steps and after the last step. A tqdm bar shows the
        live score and KL. To resume, call :meth:`load_checkpoint` first.

        Rows of ``metrics.jsonl`` / ``samples.jsonl`` for steps after ``step_count`` (logged by a
        run that was killed before it checkpointed them; the resumed run takes those steps again)
        and a torn last line are dropped first, with a warning.

        Returns:
            the metrics of the steps run now.

        Raises:
            NonFiniteUpdateError: ``max_consecutive_skips`` updates in a row had a NaN/inf loss or
                gradient; the step is neither logged nor checkpointed, and the message names the
                last good checkpoint.
        """
        from tqdm.auto import tqdm

        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        history: List[Dict[str, float]] = []
        c = self.config
        _truncate_log(out / "metrics.jsonl", self.step_count)
        _truncate_log(out / "samples.jsonl", self.step_count)
        bar = tqdm(total=c.steps, initial=self.step_count, desc="ppo", disable=not progress, dynamic_ncols=True)
        try:
            while self.step_count < c.steps:
                try:
                    metrics = self.step()
                except NonFiniteUpdateError as exc:
                    ckpt = find_checkpoint(out / "checkpoint")
                    if ckpt is None:
                        where = "no checkpoint was written"
                    else:
                        step = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)["step"]
                        where = f"the last good checkpoint is {str(ckpt)!r} (step {step})"
                    raise NonFiniteUpdateError(f"{exc}; {where}") from exc
                history.append(metrics)
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                if c.log_samples and self.last_batch is not None:
                    b = self.last_batch
                    with open(out / "samples.jsonl", "a") as f:
                        # The score logged is the raw reward, before missing_eos_penalty.
                        for p, r, s in zip(b.prompts, b.responses, self._last_raw_scores.tolist()):
                            f.write(json.dumps({"step": self.step_count, "prompt": p, "response": r, "score": s}) + "\n")
                bar.update(1)
                bar.set_postfix(score=f"{metrics['score_mean']:.3f}", kl=f"{metrics['kl_mean']:.3f}")
                last = self.step_count == c.steps
                if last or (c.save_every > 0 and self.step_count % c.save_every == 0):
                    self.save_checkpoint(out / "checkpoint")
        finally:
            bar.close()
        return history

    # ---------------------------------------------------------------- checkpoints
    def _trainer_state(self) -> Dict[str, Any]:
        np_state = np.random.get_state()
        state = {
            "format": 1,
            "step": self.step_count,
            "kl_ctl": self.kl_ctl.state_dict(),
            "sampler": self.sampler.state_dict(),
            "shuffle_generator": self.shuffle_generator.get_state(),
            "rng_torch": torch.get_rng_state(),
            # numpy's state as plain python values, so that the file loads with weights_only=True.
            "rng_numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "rng_python": random.getstate(),
            "consecutive_skips": self.consecutive_skips,
            "skipped_updates_total": self.skipped_updates_total,
            "config": self.config.to_dict(),
        }
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state_all()
        return state

    def save_checkpoint(self, directory: str | os.PathLike) -> Path:
        """Write everything needed to resume exactly, atomically.

        Files: ``policy.pt``, ``value_model.pt`` (state dicts), ``optimizers.pt`` (both AdamW
        states), ``trainer_state.pt`` (step counter, KL controller, prompt-sampler position,
        shuffle generator, torch/CUDA/numpy/python RNG states, skip counters, config). There are
        no learning-rate schedulers (the learning rates are constant).

        The swap, such that at every instant a complete checkpoint is at a known path:

        1. every file is written into a temporary sibling ``.<name>.tmp-*`` and fsync'ed, then
           the directory is fsync'ed (``<name>`` still holds the previous checkpoint);
        2. ``<name>`` is renamed to ``<name>.old`` (the previous checkpoint, complete);
        3. the temporary directory is renamed to ``<name>`` (the new checkpoint, complete);
        4. ``<name>.old`` is deleted.

        A crash (even SIGKILL) before 2 leaves the previous checkpoint at ``<name>``; between 2
        and 3 at ``<name>.old``, where :meth:`load_checkpoint` and :func:`find_checkpoint` find
        it; after 3 the new one is at ``<name>``. Temporaries of a killed save are removed by the
        next save.

        Returns:
            the checkpoint directory.
        """
        target = Path(directory)
        parent = target.parent
        parent.mkdir(parents=True, exist_ok=True)
        backup = _backup_path(target)
        for stale in parent.glob(f".{glob.escape(target.name)}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            payloads = {
                "policy.pt": self.policy.state_dict(),
                "value_model.pt": self.value_model.state_dict(),
                "optimizers.pt": {
                    "policy": self.policy_optimizer.state_dict(),
                    "value": self.value_optimizer.state_dict(),
                },
                "trainer_state.pt": self._trainer_state(),
            }
            for name, obj in payloads.items():
                with open(tmp / name, "wb") as f:
                    torch.save(obj, f)
                    f.flush()
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
            if target.exists():
                if _checkpoint_is_complete(target) or not _checkpoint_is_complete(backup):
                    # <name> is the newest complete checkpoint: it becomes the backup.
                    shutil.rmtree(backup, ignore_errors=True)
                    os.rename(target, backup)
                else:
                    # An incomplete <name> (not written by this method) next to a complete backup:
                    # keep the backup, drop the debris.
                    shutil.rmtree(target)
                _fsync_dir(parent)
            # (No <name> but a complete <name>.old: a save was killed between the two renames;
            # that backup stays until the new checkpoint is in place.)
            os.rename(tmp, target)
            _fsync_dir(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(backup, ignore_errors=True)
        for legacy in parent.glob(f"{glob.escape(target.name)}.old-*"):
            shutil.rmtree(legacy, ignore_errors=True)
        _fsync_dir(parent)
        return target

    def load_checkpoint(self, directory: str | os.PathLike) -> Path:
        """Restore a checkpoint written by :meth:`save_checkpoint` (models, optimizers, RNG states,
        KL controller, step counter, prompt position, shuffle generator, skip counters), so that
        the next step is identical to the one the saving run would have taken.

        If ``directory`` is missing or incomplete because a save was killed halfway, the previous
        checkpoint that save left at ``<directory>.old`` is loaded instead, with a warning.
        Every file is read before anything is restored, so a failed load leaves the trainer as
        it was.

        The reference policy is not in the checkpoint: pass the same initial reference (or policy)
        to the new trainer.

        Returns:
            the directory actually loaded.

        Raises:
            FileNotFoundError: no complete checkpoint (the message names the missing files).
            ValueError: a file cannot be read (corrupt), or the checkpoint's KL controller type or
                prompt count differs from this trainer's.
        """
        requested = Path(directory)
        d = find_checkpoint(requested)
        if d is None:
            missing = [str(requested / n) for n in CHECKPOINT_FILES if not (requested / n).is_file()]
            raise FileNotFoundError(f"checkpoint file missing: {', '.join(missing)}")
        if d != requested:
            warnings.warn(
                f"checkpoint {str(requested)!r} is missing or incomplete (a save was interrupted); "
                f"resuming from the previous checkpoint {str(d)!r}",
                RuntimeWarning,
                stacklevel=2,
            )
        map_loc = self.device

        def load(name: str, location) -> Any:
            try:
                return torch.load(d / name, map_location=location, weights_only=True)
            except Exception as exc:  # truncated or corrupt file
                raise ValueError(f"checkpoint file {str(d / name)!r} cannot be read: {exc}") from exc

        policy_sd = load("policy.pt", map_loc)
        value_sd = load("value_model.pt", map_loc)
        opt = load("optimizers.pt", map_loc)
        st = load("trainer_state.pt", "cpu")
        self.policy.load_state_dict(policy_sd)
        self.value_model.load_state_dict(value_sd)
        self.policy_optimizer.load_state_dict(opt["policy"])
        self.value_optimizer.load_state_dict(opt["value"])
        self.kl_ctl.load_state_dict(st["kl_ctl"])
        self.sampler.load_state_dict(st["sampler"])
        self.shuffle_generator.set_state(st["shuffle_generator"])
        torch.set_rng_state(st["rng_torch"])
        if "rng_cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["rng_cuda"])
        kind, keys, pos, has_gauss, cached = st["rng_numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        py = st["rng_python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        self.step_count = int(st["step"])
        self.consecutive_skips = int(st.get("consecutive_skips", 0))
        self.skipped_updates_total = int(st.get("skipped_updates_total", 0))
        return d
