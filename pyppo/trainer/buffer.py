"""One PPO batch of rollouts, and its minibatch / micro-batch views (``docs/trainer.md``).

Layout: ``B`` sequences, each a left-padded prompt of ``P`` positions followed by a right-padded
response of ``T`` positions. Every per-token quantity (log-probs, values, rewards, ...) is stored at
response positions only, ``[B, T]``, aligned with ``response_ids``: entry ``t`` belongs to the
token ``response_ids[:, t]`` (for values: the state before that token is emitted).

Two masks cover the response positions (``docs/trainer.md``, "Two masks"): ``response_mask`` says
which positions hold a token of the sequence (sampled, or appended by an environment between
turns): it drives attention, positions and EOS. ``loss_mask`` says which of those are the policy's
own actions to train on: log-probs, KL, entropy, advantages, whitening, the losses and their
metrics read it. ``loss_mask`` is always within ``response_mask``; for one sampled response the
two are equal until DAPO's ``mask_truncated`` clears the ``loss_mask`` rows of truncated responses.

The full model inputs are always rebuilt from the stored padded tensors (:attr:`input_ids`,
:attr:`attention_mask`, :attr:`position_ids`), so a row is fed to the model with exactly the same
padding at rollout time and at training time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence

import torch

from ..models import position_ids_from_mask
from ..rollout.engine import Rollout

__all__ = ["RolloutBuffer", "buffer_from_rollout"]

_LIST_FIELDS = ("prompts", "responses", "episodes")
#: What padding holds in a 2-D field that :meth:`RolloutBuffer.cat` pads (else 0): no turn.
_PAD_VALUES = {"turn_ids": -1}


@dataclass
class RolloutBuffer:
    """A batch of rollouts and everything PPO computes from it.

    Required at construction:

    * ``query_ids [B, P]`` int64, left-padded prompt tokens;
    * ``query_mask [B, P]`` bool, 1 at real prompt tokens;
    * ``response_ids [B, T]`` int64, right-padded sampled tokens;
    * ``response_mask [B, T]`` bool, 1 at the tokens of the sequence (up to and including the
      first EOS of a sampled response).

    ``loss_mask [B, T]`` bool, 1 at the policy's own tokens (within ``response_mask``); ``None``
    at construction means a copy of ``response_mask``.

    Filled in as the step proceeds (``None`` until then): ``old_logprobs``, ``entropy`` (of the
    sampling distribution), ``ref_logprobs``, ``values``, ``rewards``, ``kl``, ``advantages``,
    ``returns`` (all ``[B, T]`` float32), ``raw_scores [B]`` (what the reward returned) and
    ``scores [B]`` (clipped and penalised, what the rewards are shaped from) float32,
    ``has_eos [B]`` bool, the decoded ``prompts`` / ``responses`` (lists of ``B`` strings), and
    ``rollout_logprobs [B, T]`` float32: the rollout engine's own log-probs of the sampled tokens,
    when it reports them (:class:`pyppo.rollout.Rollout`; ``None`` from ``transformers.generate``).

    Multi-turn episodes (:mod:`pyppo.agents`) add ``turn_ids [B, T]`` int64 (the agent turn of each
    token, -1 at the environment's tokens and padding), ``turn_rewards [B, T]`` float32 (what the
    environment paid, on the last agent token of each turn) and ``episodes`` (``B``
    :class:`~pyppo.agents.episodes.EpisodeRecord`); ``None`` for one sampled response. An
    estimator that trains the value model on some tokens only (``gae_turn``: each turn's first)
    sets ``value_mask [B, T]`` bool; :attr:`critic_mask` is it, else ``loss_mask``.

    Raises:
        ValueError: (at construction, and from :meth:`validate`) a field with the wrong batch size
            or shape, naming the field.
    """

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    # what a rollout engine returns besides the tokens
    loss_mask: Optional[torch.Tensor] = None
    has_eos: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    prompts: Optional[List[str]] = None
    responses: Optional[List[str]] = None
    # what a multi-turn episode adds (pyppo.agents)
    turn_ids: Optional[torch.Tensor] = None
    turn_rewards: Optional[torch.Tensor] = None
    episodes: Optional[List[Any]] = None
    # what the step fills in: points 3, 4 and 5
    raw_scores: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    rewards: Optional[torch.Tensor] = None
    kl: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    value_mask: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        self.query_mask = self.query_mask.bool()
        self.response_mask = self.response_mask.bool()
        self.loss_mask = self.response_mask.clone() if self.loss_mask is None else self.loss_mask.bool()
        self.validate()

    # ------------------------------------------------------------------ shape bookkeeping
    def __len__(self) -> int:
        return self.query_ids.shape[0]

    @property
    def prompt_length(self) -> int:
        """``P``, the padded prompt length."""
        return self.query_ids.shape[1]

    @property
    def response_length(self) -> int:
        """``T``, the padded response length."""
        return self.response_ids.shape[1]

    def validate(self) -> None:
        """Check every present field's shape against ``B``, ``P`` and ``T``."""
        for name in ("query_ids", "query_mask", "response_ids", "response_mask"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"{name} must be a 2-D tensor")
        B, P = self.query_ids.shape
        T = self.response_ids.shape[1]
        if self.response_ids.shape[0] != B:
            raise ValueError(f"response_ids has batch size {self.response_ids.shape[0]}, expected {B}")
        expected = {"query_mask": (B, P), "response_mask": (B, T), "loss_mask": (B, T)}
        for name in (
            "old_logprobs",
            "entropy",
            "ref_logprobs",
            "values",
            "rewards",
            "kl",
            "advantages",
            "returns",
            "rollout_logprobs",
            "turn_ids",
            "turn_rewards",
            "value_mask",
        ):
            expected[name] = (B, T)
        for name in ("raw_scores", "scores", "has_eos"):
            expected[name] = (B,)
        for name, shape in expected.items():
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        for name in _LIST_FIELDS:
            v = getattr(self, name)
            if v is not None and len(v) != B:
                raise ValueError(f"{name} has {len(v)} entries, expected {B}")

    @property
    def critic_mask(self) -> torch.Tensor:
        """``[B, T]`` bool, the tokens the value loss trains on: ``value_mask``, else ``loss_mask``."""
        return self.loss_mask if self.value_mask is None else self.value_mask

    # ------------------------------------------------------------------ model inputs
    @property
    def input_ids(self) -> torch.Tensor:
        """``[B, P + T]`` int64: prompt then response."""
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[B, P + T]`` int64 0/1: left padding and everything after the first EOS are 0."""
        return torch.cat([self.query_mask, self.response_mask], dim=1).long()

    @property
    def position_ids(self) -> torch.Tensor:
        """``[B, P + T]`` int64: 0 at each row's first real prompt token (left padding does not
        shift positions; this matches what ``generate()`` uses while sampling)."""
        return position_ids_from_mask(self.attention_mask)

    # ------------------------------------------------------------------ slicing
    def select(self, index: torch.Tensor) -> "RolloutBuffer":
        """The rows ``index`` (1-D int64 tensor of row numbers, in that order), as a new buffer."""
        if not isinstance(index, torch.Tensor):
            index = torch.as_tensor(index, dtype=torch.long)
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
        idx_cpu = index.to("cpu", torch.long)
        kwargs = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                kwargs[f.name] = None
            elif f.name in _LIST_FIELDS:
                kwargs[f.name] = [v[i] for i in idx_cpu.tolist()]
            else:
                kwargs[f.name] = v.index_select(0, idx_cpu.to(v.device))
        return RolloutBuffer(**kwargs)

    @classmethod
    def cat(cls, buffers: Sequence["RolloutBuffer"]) -> "RolloutBuffer":
        """The rows of ``buffers``, in order, as one buffer: prompts left-padded and responses
        right-padded to the longest (pad tokens 0, masks false, per-token values 0). A field must
        be set in every buffer or in none.

        Raises:
            ValueError: no buffer, or a field set in some buffers only (naming it).
        """
        if not buffers:
            raise ValueError("cat needs at least one buffer")
        P = max(b.prompt_length for b in buffers)
        T = max(b.response_length for b in buffers)
        kwargs = {}
        for f in dataclasses.fields(cls):
            values = [getattr(b, f.name) for b in buffers]
            if all(v is None for v in values):
                kwargs[f.name] = None
            elif any(v is None for v in values):
                raise ValueError(f"cat: {f.name} is set in some buffers only")
            elif f.name in _LIST_FIELDS:
                kwargs[f.name] = [x for v in values for x in v]
            elif f.name in ("query_ids", "query_mask"):
                kwargs[f.name] = torch.cat([torch.nn.functional.pad(v, (P - v.shape[1], 0)) for v in values])
            elif values[0].dim() == 2:
                fill = _PAD_VALUES.get(f.name, 0)
                kwargs[f.name] = torch.cat(
                    [torch.nn.functional.pad(v, (0, T - v.shape[1]), value=fill) for v in values]
                )
            else:
                kwargs[f.name] = torch.cat(values)
        return cls(**kwargs)

    def to(self, device) -> "RolloutBuffer":
        """A copy with every tensor on ``device``."""
        kwargs = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            kwargs[f.name] = v.to(device) if isinstance(v, torch.Tensor) else v
        return RolloutBuffer(**kwargs)

    def epoch_permutation(self, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """A uniformly random order of the ``B`` rows (1-D int64, on CPU), drawn from ``generator``."""
        return torch.randperm(len(self), generator=generator)

    def minibatches(
        self,
        mini_batch_size: int,
        generator: Optional[torch.Generator] = None,
        *,
        permutation: Optional[torch.Tensor] = None,
    ) -> Iterator["RolloutBuffer"]:
        """Shuffled minibatches that cover the batch exactly once (one PPO epoch).

        Args:
            mini_batch_size: rows per minibatch, ``>= 1``; when it does not divide ``B`` the last
                minibatch is smaller (no row is dropped or repeated).
            generator: source of the shuffle (``torch.Generator``); ``None`` uses the global RNG.
            permutation: use this row order (a permutation of ``range(B)``) instead of drawing one.
                The trainer draws the first epoch's order before the rollout forward passes so that
                those passes see exactly the micro-batches the first epoch trains on.

        Raises:
            ValueError: ``mini_batch_size < 1``, or ``permutation`` not a permutation of the rows.
        """
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}")
        B = len(self)
        if permutation is None:
            permutation = self.epoch_permutation(generator)
        else:
            permutation = torch.as_tensor(permutation, dtype=torch.long).cpu()
            if permutation.shape != (B,) or not torch.equal(permutation.sort().values, torch.arange(B)):
                raise ValueError(f"permutation must be a permutation of range({B})")
        for start in range(0, B, mini_batch_size):
            yield self.select(permutation[start : start + mini_batch_size])

    def micro_batches(self, micro_batch_size: int) -> Iterator["RolloutBuffer"]:
        """Consecutive, unshuffled chunks of ``micro_batch_size`` rows (gradient accumulation).

        Raises:
            ValueError: ``micro_batch_size < 1``.
        """
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
        B = len(self)
        for start in range(0, B, micro_batch_size):
            yield self.select(torch.arange(start, min(start + micro_batch_size, B)))


def buffer_from_rollout(rollout: Any, prompts: Sequence[str], engine: Any) -> "RolloutBuffer":
    """``engine``'s ``rollout`` as a :class:`RolloutBuffer`, after checking that it is a
    :class:`~pyppo.rollout.Rollout` of exactly ``prompts`` with bool masks (the buffer checks
    every shape against the others).

    Raises:
        TypeError: not a :class:`Rollout`, or a mask that is not bool.
        ValueError: other prompts, another order, a tensor of another batch size, a ``loss_mask``
            that is 1 outside ``response_mask``, or ``rollout_logprobs`` that are not finite
            log-probabilities at the policy's tokens.
    """
    name = type(engine).__name__
    if not isinstance(rollout, Rollout):
        raise TypeError(
            f"rollout engine {name}: generate() must return a pyppo.rollout.Rollout, got {type(rollout).__name__}"
        )
    if list(rollout.prompts) != list(prompts):
        raise ValueError(
            f"rollout engine {name}: generate() returned {len(rollout.prompts)} prompts for the "
            f"{len(prompts)} it was given, or not in their order"
        )
    for field in ("query_mask", "response_mask", "has_eos", "loss_mask"):
        t = getattr(rollout, field)
        if t is None and field == "loss_mask":
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
            raise TypeError(
                f"rollout engine {name}: {field} must be a bool tensor, got {getattr(t, 'dtype', type(t).__name__)}"
            )
    try:
        buffer = RolloutBuffer(**vars(rollout))
    except ValueError as exc:
        raise ValueError(f"rollout engine {name}: {exc}") from None
    if bool((buffer.loss_mask & ~buffer.response_mask).any()):
        raise ValueError(
            f"rollout engine {name}: loss_mask is 1 where response_mask is 0 (the policy's tokens "
            "must be tokens of the sequence)"
        )
    if buffer.rollout_logprobs is not None:
        from .rollout_correction import check_rollout_logprobs

        check_rollout_logprobs(buffer.rollout_logprobs, buffer.loss_mask, f"rollout engine {name}")
    return buffer
