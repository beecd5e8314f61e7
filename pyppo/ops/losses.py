"""PPO policy and value losses, their loss aggregation and the explained-variance statistic.

Plain PyTorch on top of the compiled ops; ``docs/ops.md`` (sections ``ppo_policy_loss``,
``ppo_value_loss``, ``loss aggregation``, ``explained_variance``) is the reference for the formulas
and for how they differ from TRL, OpenRLHF and veRL.

Both losses take right-padded ``[B, T]`` tensors (``B`` sequences, ``T`` response positions) and a
``response_mask [B, T]`` (bool or 0/1) whose zeros are excluded from the loss and from every
statistic. They return ``(loss, stats)``: ``loss`` is a 0-d tensor differentiable w.r.t. the first
argument, ``stats`` a dict of 0-d detached float32 tensors.

Arithmetic runs in float32 (float64 when an input is float64) whatever the input dtype, so bf16 /
fp16 logprobs do not lose the small differences the PPO ratio is made of.

``loss_agg`` selects how the per-token loss matrix ``L`` (mask ``m``) becomes a scalar, with
``S = {b : Σ_t m[b, t] > 0}`` the sequences that have at least one valid token:

* ``"token-mean"``: ``Σ_{b,t} m·L / Σ_{b,t} m``.
* ``"seq-mean-token-mean"``: ``(1/|S|) Σ_{b∈S} (Σ_t m·L / Σ_t m)``.
* ``"seq-mean-token-sum"``: ``(1/|S|) Σ_{b∈S} Σ_t m·L``.
* ``"seq-mean-token-sum-norm"``: ``(1/|S|) Σ_{b∈S} Σ_t m·L / loss_agg_norm`` (default
  ``loss_agg_norm = T``): each sequence's token sum over a constant instead of its own length, so
  long and short responses are not weighted by a length-dependent denominator (Dr. GRPO, Liu et
  al. 2025, "Understanding R1-Zero-Like Training"). veRL 0.9.1's mode of the same name computes
  the same without ``global_batch_size`` (older veRL summed over the sequences instead). TRL's
  GRPO ``dr_grpo`` divides by ``B · max_completion_length``, which is pyppo's mode when every
  row has a valid token.

Under gradient accumulation the trainer passes ``normalizer`` (the whole minibatch's number of
valid tokens, or of sequences with a valid token), so that summing the micro-batch losses gives
exactly the minibatch loss instead of a mean of per-micro-batch means.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Tuple

import torch

from .kl import kl_penalty

__all__ = [
    "LOG_RATIO_CLAMP",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "explained_variance",
    "loss_normalizer",
    "loss_token_weights",
    "ppo_policy_loss",
    "ppo_value_loss",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# Bound on |log π_θ − log π_old| before the exp in ppo_policy_loss (veRL uses the same ±20).
# exp(20) ≈ 4.85e8 is far past any clip range, so the bound never changes a clipped term, and it
# keeps exp() and its gradient finite in float32, where exp overflows above ≈ 88.7.
LOG_RATIO_CLAMP = 20.0

Stats = Dict[str, torch.Tensor]


def named_errors(fn, op: Optional[str] = None):
    """``fn`` with its ``ValueError`` messages starting ``pyppo.<op>:`` (``op`` defaults to
    ``fn``'s name), as the compiled ops' argument checks do; another op's prefix is replaced, so
    the message names the function the user called."""
    prefix = f"pyppo.{op or fn.__name__}: "

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as exc:
            message = str(exc)
            if message.startswith("pyppo.") and ": " in message:
                message = message.split(": ", 1)[1]
            raise ValueError(prefix + message) from None

    return wrapper


def _check_positive_or_none(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_loss_agg(loss_agg: str, loss_agg_norm: Optional[float]) -> None:
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {loss_agg!r}")
    _check_positive_or_none("loss_agg_norm", loss_agg_norm)


def _as_bool_mask(mask: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    if (
        mask.is_floating_point()
        or mask.is_complex()
        or mask.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    ):
        # A mask of arbitrary weights would silently become a weighting; insist on 0/1 (where the
        # values can be read: not while tracing).
        if _can_read(mask) and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{name} must be bool or contain only 0 and 1")
        return mask != 0
    raise ValueError(f"{name} must be a bool or 0/1 tensor, got dtype {mask.dtype}")


def _can_read(t: torch.Tensor) -> bool:
    """Whether a value check may read ``t`` on the host: not for meta or fake tensors, and not while
    ``torch.compile`` traces (a host read there is a graph break, and fails under ``fullgraph``)."""
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_float_2d(
    named: Dict[str, torch.Tensor], mask_name: str, mask: torch.Tensor, *, require_2d: bool = True
) -> None:
    shape = None
    device = None
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if require_2d and t.dim() != 2:
            raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(t.shape)}")
        if shape is None:
            shape, device, first = t.shape, t.device, name
        else:
            if t.shape != shape:
                raise ValueError(f"{name} shape {tuple(t.shape)} != {first} shape {tuple(shape)}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but {first} is on {device}")
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{mask_name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"{mask_name} shape {tuple(mask.shape)} != {first} shape {tuple(shape)}")
    if mask.device != device:
        raise ValueError(f"{mask_name} is on {mask.device} but {first} is on {device}")


@named_errors
def loss_normalizer(mask: torch.Tensor, loss_agg: str = "token-mean") -> int:
    """The count that ``loss_agg`` divides by, for ``mask [B, T]`` (bool or 0/1).

    Returns the number of valid tokens for ``"token-mean"`` and the number of rows with at least one
    valid token for the ``seq-mean-*`` modes, as a Python ``int``. The trainer computes it over a
    whole minibatch and passes it to each micro-batch's loss as ``normalizer``.

    Raises:
        ValueError: unknown ``loss_agg``, or ``mask`` not 2-D / not bool or 0/1.
    """
    _check_loss_agg(loss_agg, None)
    m = _as_bool_mask(mask, "mask")
    if m.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(m.shape)}")
    if loss_agg == "token-mean":
        return int(m.sum())
    return int(m.any(dim=-1).sum())


def _agg_count(m: torch.Tensor, loss_agg: str, normalizer: Optional[float]):
    """What ``loss_agg`` divides by: ``normalizer``, else the valid tokens (``token-mean``) or the
    sequences with one (``seq-mean-*``) of the bool mask ``m``."""
    if normalizer is not None:
        return normalizer
    # A 0-d tensor, not a Python int: no host sync, so the losses trace (meta tensors,
    # torch.compile(fullgraph=True)). The empty check needs the value; where it cannot be read,
    # an empty mask gives a loss of 0.
    count = m.sum() if loss_agg == "token-mean" else m.any(dim=-1).sum()
    if _can_read(count) and int(count) == 0:
        raise ValueError(f"mask has no valid token: {loss_agg} is undefined (pass normalizer)")
    return count.clamp_min(1)


@named_errors
def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "token-mean",
    loss_agg_norm: Optional[float] = None,
    normalizer: Optional[float] = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar with one of the ``loss_agg`` modes.

    Args:
        loss_mat: ``[B, T]`` floating point. Values at masked positions are ignored (even inf/NaN:
            they are selected away with ``torch.where``, not multiplied by 0, so they cannot poison
            the sum or its gradient).
        mask: ``[B, T]`` bool or 0/1; 1 = the token counts.
        loss_agg: one of :data:`LOSS_AGG_MODES` (see the module docstring for the formulas).
        loss_agg_norm: the constant divisor of ``"seq-mean-token-sum-norm"``; default ``T``
            (``loss_mat.shape[-1]``). Ignored by the other modes.
        normalizer: divide by this instead of the count taken from ``mask`` — the number of valid
            tokens (``"token-mean"``) or of sequences with a valid token (``seq-mean-*``) of the
            whole minibatch when ``loss_mat`` is one micro-batch of it (see :func:`loss_normalizer`).
            With it, the sum of the micro-batch results equals the minibatch result.

    Returns:
        0-d tensor in ``loss_mat``'s dtype, differentiable w.r.t. ``loss_mat``.

    Raises:
        ValueError: unknown ``loss_agg``, bad ``loss_agg_norm`` / ``normalizer``, shape or device
            mismatch, or — without ``normalizer`` — a ``mask`` with no valid token (the mean of
            nothing is undefined; a loss of silently 0 would hide a masking bug).
    """
    _check_loss_agg(loss_agg, loss_agg_norm)
    if not isinstance(loss_mat, torch.Tensor) or not loss_mat.is_floating_point():
        raise ValueError("loss_mat must be a floating-point torch.Tensor")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be 2-D [B, T], got shape {tuple(loss_mat.shape)}")
    m = _as_bool_mask(mask, "mask")
    if m.shape != loss_mat.shape:
        raise ValueError(f"mask shape {tuple(m.shape)} != loss_mat shape {tuple(loss_mat.shape)}")
    if m.device != loss_mat.device:
        raise ValueError(f"mask is on {m.device} but loss_mat is on {loss_mat.device}")
    _check_positive_or_none("normalizer", normalizer)

    masked = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    count = _agg_count(m, loss_agg, normalizer)
    if loss_agg == "token-mean":
        return masked.sum() / count

    tokens_per_row = m.sum(dim=-1)
    row_sum = masked.sum(dim=-1)
    if loss_agg == "seq-mean-token-mean":
        # Rows with no valid token have row_sum 0; clamping their denominator to 1 keeps them at 0
        # (they add nothing and are not counted) instead of producing 0/0.
        row_val = row_sum / tokens_per_row.clamp_min(1).to(loss_mat.dtype)
        return row_val.sum() / count
    seq_mean = row_sum.sum() / count
    if loss_agg == "seq-mean-token-sum":
        return seq_mean
    norm = loss_agg_norm if loss_agg_norm is not None else loss_mat.shape[-1]
    return seq_mean / norm


@named_errors
def loss_token_weights(
    mask: torch.Tensor,
    loss_agg: str = "token-mean",
    loss_agg_norm: Optional[float] = None,
    normalizer: Optional[float] = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The per-token weights ``w`` of a ``loss_agg`` mode: ``aggregate_loss(L, mask, ...) == Σ w·L``
    for every loss matrix ``L``, and ``w`` is its gradient w.r.t. ``L``.

    With ``c`` the count ``aggregate_loss`` divides by (``normalizer``, or the valid tokens /
    sequences of ``mask``) and ``n_b`` the valid tokens of row ``b``, at a valid position:

    * ``"token-mean"``, ``"seq-mean-token-sum"``: ``w = 1 / c``;
    * ``"seq-mean-token-mean"``: ``w = (1 / c) / n_b``;
    * ``"seq-mean-token-sum-norm"``: ``w = (1 / loss_agg_norm) / c`` (default ``loss_agg_norm = T``);

    and 0 at masked positions. They are computed in the order autograd computes the gradient of
    :func:`aggregate_loss`, so they are that gradient's bits. This is what lets a fused kernel
    (:func:`pyppo.ops.linear_ppo_loss`) take the loss aggregation as one ``[B, T]`` input.

    Args:
        mask: ``[B, T]`` bool or 0/1; 1 = the token counts.
        loss_agg, loss_agg_norm, normalizer: as :func:`aggregate_loss`.
        dtype: of the result (float32 or float64, the dtype of the loss matrix being weighted).

    Returns:
        ``[B, T]`` tensor of ``dtype`` on ``mask``'s device.

    Raises:
        ValueError: as :func:`aggregate_loss` (unknown ``loss_agg``, bad ``loss_agg_norm`` /
            ``normalizer``, a mask that is not 2-D bool or 0/1, no valid token without ``normalizer``).
    """
    _check_loss_agg(loss_agg, loss_agg_norm)
    m = _as_bool_mask(mask, "mask")
    if m.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(m.shape)}")
    _check_positive_or_none("normalizer", normalizer)
    count = _agg_count(m, loss_agg, normalizer)
    one = torch.ones((), dtype=dtype, device=m.device)
    if loss_agg == "seq-mean-token-mean":
        w = (one / count) / m.sum(dim=-1, keepdim=True).clamp_min(1).to(dtype)
    elif loss_agg == "seq-mean-token-sum-norm":
        w = one / (loss_agg_norm if loss_agg_norm is not None else m.shape[-1]) / count
    else:
        w = one / count
    return torch.where(m, w, torch.zeros((), dtype=dtype, device=m.device))


def _masked_stat_mean(x: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the ``n`` (a 0-d tensor) valid tokens of ``m``; 0 when there is none."""
    return (torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / n.clamp_min(1)).float()


@named_errors
def ppo_policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
    cliprange_low: float = 0.2, cliprange_high: float = 0.2, dual_clip: Optional[float] = None,
    loss_agg: str = "token-mean", loss_agg_norm: Optional[float] = None, normalizer: Optional[float] = None,
) -> Tuple[torch.Tensor, Stats]:  # fmt: skip
    """Clipped-surrogate PPO policy loss (Schulman et al. 2017, eq. 7), with optional dual clip.

    Per valid token, with ``δ = clamp(logprobs − old_logprobs, −20, 20)`` (:data:`LOG_RATIO_CLAMP`),
    ``r = exp(δ)`` and advantage ``A``::

        L_clip = max(−A·r, −A·clip(r, 1 − cliprange_low, 1 + cliprange_high))
        L      = min(L_clip, −A·dual_clip)   where A < 0 and dual_clip is set   (Ye et al. 2020,
                 L_clip                      otherwise                            "Mastering Complex
                                                                                  Control in MOBA
                                                                                  Games", eq. 5)

    (the loss is the negated PPO objective, so PPO's ``min`` becomes ``max``), then reduced with
    ``loss_agg``. Asymmetric ranges (``cliprange_high > cliprange_low``) give DAPO's "clip-higher".

    The log-ratio clamp keeps the loss, its gradient and the stats finite for any log-ratio,
    including an ``old_logprobs`` of ``−inf`` or below float32's ``exp`` range (e^−88). It changes
    nothing for ``|δ| ≤ 20``; beyond, the token's gradient is 0 (``torch.clamp``'s gradient), which
    loses nothing in every case but one:

    * ``δ > 20``, ``A > 0``: the upper clip is active anyway (value ``−A(1 + ε_high)``, gradient 0);
    * ``δ > 20``, ``A < 0`` with ``dual_clip = c < e^20``: the dual bound is active anyway
      (value ``−A·c``, gradient 0);
    * ``δ > 20``, ``A < 0`` **without** ``dual_clip``: the one real change. Unclamped the loss
      would be ``−A·r`` with gradient ``−A·r`` (≥ 4.85e8·|A|, infinite past e^88); clamped it is
      the constant ``−A·e^20``. Such a token no longer pushes its probability down — use
      ``dual_clip`` for a bounded loss with the same behaviour by design;
    * ``δ < −20``, ``A < 0``: the lower clip is active anyway (``−A(1 − ε_low)``, gradient 0);
    * ``δ < −20``, ``A > 0``: the value moves by less than ``A·e^−20 ≈ 2e−9·A`` and a gradient of
      at most that size is dropped.

    A NaN log-ratio (a NaN input, or ``logprobs = old_logprobs = −inf``) stays NaN.

    Args:
        logprobs: ``[B, T]`` float (any float dtype), log π_θ of the sampled tokens (nats);
            gradients flow through it.
        old_logprobs: ``[B, T]`` float, log π_old of the same tokens (the policy that sampled them).
        advantages: ``[B, T]`` float.
        response_mask: ``[B, T]`` bool or 0/1; 0 = padding / not trained on.
        cliprange_low: ε_low in ``[0, 1)``.
        cliprange_high: ε_high ``> 0``.
        dual_clip: ``c > 1`` or ``None`` (off).
        loss_agg, loss_agg_norm, normalizer: see :func:`aggregate_loss`.

    Returns:
        ``(loss, stats)``. ``loss`` is 0-d (float32, or float64 for float64 inputs). ``stats``
        (0-d detached float32, over valid tokens of this call; 0 when there is none):

        * ``clipfrac``: fraction where the clipped term is strictly larger, i.e. clipping changed
          the loss (as veRL and TRL count it);
        * ``clipfrac_lower``: fraction where the dual-clip bound is active (``A < 0`` and
          ``−A·c < L_clip``); 0 without dual clip;
        * ``approx_kl``: mean of ``k3 = r − 1 − δ``, the unbiased, non-negative estimator of
          KL(π_old ‖ π_θ) for tokens sampled from π_old (Schulman 2020, "Approximating KL
          divergence"), from the clamped ``δ`` (so at most ``e^20 − 21`` per token), evaluated
          by ``kl_penalty``'s ``k3`` (accurate however small ``δ`` is);
        * ``ratio_mean``, ``ratio_max``: mean and max of ``r`` (clamped: ``r ≤ e^20``);
        * ``logratio_clampfrac``: fraction where ``|logprobs − old_logprobs| > 20``, i.e. where
          the clamp changed ``δ``.

    Raises:
        ValueError: non-tensor / non-float / non-2-D input, shape or device mismatch, a mask that is
            not bool or 0/1, ``cliprange_low`` outside ``[0, 1)``, ``cliprange_high <= 0``,
            ``dual_clip <= 1``, unknown ``loss_agg``, bad ``loss_agg_norm`` / ``normalizer``, or
            no valid token without ``normalizer``.
    """
    token_loss = functools.partial(_ppo_token_loss, dual_clip=dual_clip)
    clip, agg = (cliprange_low, cliprange_high, dual_clip), (loss_agg, loss_agg_norm, normalizer)
    return _policy_loss(token_loss, logprobs, old_logprobs, advantages, response_mask, clip, agg)


def _ppo_token_loss(
    logprobs: torch.Tensor,
    zero: torch.Tensor,
    m: torch.Tensor,
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
    *,
    dual_clip: Optional[float],
):
    """:func:`ppo_policy_loss`'s per-token terms, as :func:`_policy_loss` takes them."""
    ratio = torch.exp(log_ratio)
    pg_clip, clipped = _clipped_surrogate(adv, ratio, cliprange_low, cliprange_high)
    if dual_clip is None:
        return pg_clip, ratio, clipped, torch.zeros_like(m)
    pg_bound = -adv * dual_clip
    lower_active = (adv < 0) & (pg_bound < pg_clip)
    return torch.where(adv < 0, torch.minimum(pg_clip, pg_bound), pg_clip), ratio, clipped, lower_active


def _clipped_surrogate(adv: torch.Tensor, ratio: torch.Tensor, cliprange_low: float, cliprange_high: float):
    """``(max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)), clipped)``: PPO's clipped surrogate (the
    negated objective, so ``min`` becomes ``max``) and where the clipped term is strictly larger."""
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    return torch.maximum(pg_unclipped, pg_clipped), pg_clipped > pg_unclipped


def _policy_loss(
    token_loss, logprobs, old_logprobs, advantages, response_mask, clip, agg
) -> Tuple[torch.Tensor, Stats]:
    """What every policy loss does around its per-token terms: the argument checks, the clamped
    token log-ratio (:func:`_token_log_ratio`), the aggregation and :func:`policy_stats`.
    ``clip`` is ``(cliprange_low, cliprange_high, dual_clip)`` (``dual_clip`` None for the losses
    without one), ``agg`` is ``(loss_agg, loss_agg_norm, normalizer)`` as :func:`aggregate_loss`
    takes them. ``token_loss(logprobs, zero, m, log_ratio, adv, cliprange_low, cliprange_high)``
    (``zero`` a 0-d zero of the compute dtype, ``log_ratio`` and ``adv`` 0 at masked positions)
    returns ``(loss_mat, ratio, clipped, lower_active)``: the per-token loss, the ratio the stats
    report and the masks ``clipfrac`` and ``clipfrac_lower`` count."""
    cliprange_low, cliprange_high, dual_clip = clip
    loss_agg, loss_agg_norm, normalizer = agg
    _check_float_2d(
        {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}, "response_mask", response_mask
    )
    if not (isinstance(cliprange_low, (int, float)) and 0 <= cliprange_low < 1):
        raise ValueError(f"cliprange_low must be in [0, 1), got {cliprange_low!r}")
    if not (isinstance(cliprange_high, (int, float)) and 0 < cliprange_high < math.inf):
        raise ValueError(f"cliprange_high must be a positive finite number, got {cliprange_high!r}")
    if dual_clip is not None and not (isinstance(dual_clip, (int, float)) and 1 < dual_clip < math.inf):
        raise ValueError(f"dual_clip must be a finite number > 1 or None, got {dual_clip!r}")
    _check_loss_agg(loss_agg, loss_agg_norm)
    m = _as_bool_mask(response_mask, "response_mask")

    _, zero, raw_log_ratio, log_ratio, adv = _token_log_ratio(logprobs, old_logprobs, advantages, m)
    loss_mat, ratio, clipped, lower_active = token_loss(
        logprobs, zero, m, log_ratio, adv, cliprange_low, cliprange_high
    )
    loss = aggregate_loss(loss_mat, m, loss_agg, loss_agg_norm, normalizer)
    return loss, policy_stats(m, raw_log_ratio, log_ratio, ratio, clipped, lower_active)


def _token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, m: torch.Tensor):
    """``(dt, zero, raw, log_ratio, adv)``: the compute dtype, a 0-d zero of it, the raw token
    log-ratio ``logprobs − old_logprobs``, the same clamped to ±:data:`LOG_RATIO_CLAMP` and 0 at
    masked positions, and the advantages, 0 at masked positions."""
    dt = _compute_dtype(logprobs, old_logprobs, advantages)
    zero = torch.zeros((), dtype=dt, device=logprobs.device)
    raw_log_ratio = logprobs.to(dt) - old_logprobs.to(dt)
    # Masked positions may hold garbage (e.g. -inf logprobs): where() zeroes their log-ratio and
    # its gradient. The clamp bounds the exponent at valid ones (see LOG_RATIO_CLAMP).
    log_ratio = torch.where(m, torch.clamp(raw_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), zero)
    return dt, zero, raw_log_ratio, log_ratio, torch.where(m, advantages.to(dt), zero)


def policy_stats(
    m: torch.Tensor,
    raw_log_ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    ratio: torch.Tensor,
    clipped: torch.Tensor,
    lower_active: torch.Tensor,
) -> Stats:
    """The statistics every policy loss reports (see :func:`ppo_policy_loss`), over the valid
    tokens of ``m``: ``approx_kl`` and ``logratio_clampfrac`` from the token log-ratios (raw and
    clamped), ``ratio_mean`` / ``ratio_max`` of the ratio the loss used, ``clipfrac`` /
    ``clipfrac_lower`` the fractions of ``clipped`` / ``lower_active``."""
    with torch.no_grad():
        dt = log_ratio.dtype
        zero = torch.zeros((), dtype=dt, device=log_ratio.device)
        n = m.sum()
        r = ratio.detach()
        # k3 = exp(δ) − 1 − δ by pyppo's kl_penalty (its x = δ − 0, exactly): the formula as written
        # rounds at the scale of 1, which is all of k3 for the small δ of a PPO step in float32.
        lr = log_ratio.detach()
        k3 = kl_penalty(torch.zeros_like(lr), lr, estimator="k3").to(dt)
        return {
            "clipfrac": _masked_stat_mean(clipped.to(dt), m, n),
            "clipfrac_lower": _masked_stat_mean(lower_active.to(dt), m, n),
            "approx_kl": _masked_stat_mean(k3, m, n),
            "ratio_mean": _masked_stat_mean(r, m, n),
            "logratio_clampfrac": _masked_stat_mean((raw_log_ratio.detach().abs() > LOG_RATIO_CLAMP).to(dt), m, n),
            "ratio_max": torch.where(
                n > 0, torch.where(m, r, torch.full((), -math.inf, dtype=dt, device=r.device)).max(), zero
            ).float()
            if r.numel()
            else torch.zeros((), dtype=torch.float32, device=r.device),
        }


@named_errors
def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: Optional[float] = 0.2,
    loss_agg: str = "token-mean",
    loss_agg_norm: Optional[float] = None,
    normalizer: Optional[float] = None,
) -> Tuple[torch.Tensor, Stats]:
    """Clipped value loss (the PPO2 baseline / OpenAI ``lm-human-preferences`` form).

    Per valid token::

        V_clip = clip(V, V_old − ε_v, V_old + ε_v)
        L      = ½ · max((V − R)², (V_clip − R)²)

    then reduced with ``loss_agg``. ``cliprange_value=None`` disables clipping (``L = ½(V − R)²``).

    Args:
        values: ``[B, T]`` float, current value predictions; gradients flow through it.
        old_values: ``[B, T]`` float, the values recorded at rollout time.
        returns: ``[B, T]`` float, the regression targets (GAE returns).
        response_mask: ``[B, T]`` bool or 0/1.
        cliprange_value: ε_v ``> 0`` (in reward units), or ``None``.
        loss_agg, loss_agg_norm, normalizer: see :func:`aggregate_loss`.

    Returns:
        ``(loss, stats)``; ``stats`` (0-d detached float32, over valid tokens of this call):

        * ``vf_clipfrac``: fraction where the clipped error is strictly larger;
        * ``explained_variance``: :func:`explained_variance` of ``values`` against ``returns``
          over this call's valid tokens (0 when undefined). Over a micro-batch it is not the
          minibatch's value: for a batch-level figure call :func:`explained_variance` on the
          whole batch instead of averaging this stat.

    Raises:
        ValueError: as :func:`ppo_policy_loss`, or ``cliprange_value`` not positive and finite.
    """
    _check_float_2d({"values": values, "old_values": old_values, "returns": returns}, "response_mask", response_mask)
    if cliprange_value is not None and not (
        isinstance(cliprange_value, (int, float)) and 0 < cliprange_value < math.inf
    ):
        raise ValueError(f"cliprange_value must be a positive finite number or None, got {cliprange_value!r}")
    _check_loss_agg(loss_agg, loss_agg_norm)
    m = _as_bool_mask(response_mask, "response_mask")

    dt = _compute_dtype(values, old_values, returns)
    zero = torch.zeros((), dtype=dt, device=values.device)
    v = torch.where(m, values.to(dt), zero)
    v_old = torch.where(m, old_values.to(dt), zero)
    ret = torch.where(m, returns.to(dt), zero)

    err_unclipped = (v - ret) ** 2
    if cliprange_value is not None:
        # Clamping V itself (not V_old + clamp(V − V_old)) leaves V_clip == V bit for bit where
        # nothing is clipped, so vf_clipfrac counts only real clips, not roundings.
        v_clip = torch.clamp(v, v_old - cliprange_value, v_old + cliprange_value)
        err_clipped = (v_clip - ret) ** 2
        vf_loss_mat = 0.5 * torch.maximum(err_unclipped, err_clipped)
        clipped = err_clipped > err_unclipped
    else:
        vf_loss_mat = 0.5 * err_unclipped
        clipped = torch.zeros_like(m)

    loss = aggregate_loss(vf_loss_mat, m, loss_agg, loss_agg_norm, normalizer)

    with torch.no_grad():
        n = m.sum()
        stats = {
            "vf_clipfrac": _masked_stat_mean(clipped.to(dt), m, n),
            "explained_variance": _explained_variance(v.detach(), ret, m),
        }
    return loss, stats


@named_errors
def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Fraction of the variance of the returns that the value predictions explain.

    Over the valid tokens (``response_mask`` true) of the whole input, pooled across rows::

        EV = 1 − Var[R − V] / Var[R]  =  1 − Σ (d − d̄)² / Σ (R − R̄)²,   d = R − V

    (the standard value-function diagnostic of OpenAI Baselines' PPO2, SB3 and veRL's
    ``critic/vf_explained_var``). Both variances are over the same ``n`` tokens, so the ratio is
    the same whether they are Bessel-corrected (``n − 1``, as ``torch.var`` in veRL) or not
    (``n``); it is computed as a ratio of centred sums of squares, in float64. 1 means perfect
    predictions, 0 no better than the constant mean return, negative worse than that.

    Call it on the whole minibatch or batch: a mean of per-micro-batch values is not the batch's
    value and changes with the micro-batch size.

    Edge cases (never an error):

    * ``Var[R] = 0`` exactly — constant returns, a single valid token, or none — makes the ratio
      undefined; the result is then **0**, not NaN, so logged metrics stay finite and JSON-safe
      (veRL instead adds 1e-5 to ``Var[R]``, giving large negative values for near-constant
      returns; SB3 returns NaN).
    * A non-finite value or return at a valid position gives NaN; masked positions are ignored
      whatever they hold.

    Args:
        values: ``[*]`` float (any float dtype), value predictions ``V`` (reward units).
        returns: same shape, float, regression targets ``R`` (e.g. GAE returns).
        response_mask: same shape, bool or 0/1; 0 = excluded.

    Returns:
        0-d float32 tensor on ``values``' device, detached (no gradient).

    Raises:
        ValueError: a non-tensor or non-float ``values`` / ``returns``, a shape or device
            mismatch, or a mask that is not bool or 0/1.
    """
    _check_float_2d({"values": values, "returns": returns}, "response_mask", response_mask, require_2d=False)
    return _explained_variance(values, returns, _as_bool_mask(response_mask, "response_mask"))


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        # Float64: the ratio of two variances of nearly equal data is cancellation-prone. Masked
        # sums rather than boolean indexing, so no host sync and no data-dependent shape.
        zero = torch.zeros((), dtype=torch.float64, device=values.device)
        r = torch.where(m, returns.detach().double(), zero)
        d = torch.where(m, r - values.detach().double(), zero)
        n = m.sum().double().clamp_min(1.0)
        ss_r = torch.where(m, r - r.sum() / n, zero).square().sum()
        ss_d = torch.where(m, d - d.sum() / n, zero).square().sum()
        # ss_r == 0 (constant returns, n < 2) is undefined: report 0. A NaN ss_r is not == 0 and
        # stays NaN.
        ev = torch.where(ss_r == 0, zero, 1.0 - ss_d / torch.where(ss_r == 0, torch.ones_like(ss_r), ss_r))
        return ev.float()
