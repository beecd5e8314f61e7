"""Per-token KL estimators and KL-shaped rewards (docs/ops.md#kl_penalty, docs/ops.md#shape_rewards)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["kl_penalty", "shape_rewards", "KL_ESTIMATORS"]

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


def _clamp_bounds(clamp: Sequence[float | None] | None) -> tuple[float | None, float | None]:
    if clamp is None:
        return None, None
    if not isinstance(clamp, Sequence) or isinstance(clamp, str) or len(clamp) != 2:
        raise ValueError(f"pyppo.kl_penalty: clamp must be None or a pair (lo, hi), got {clamp!r}")
    lo, hi = clamp
    return (None if lo is None else float(lo)), (None if hi is None else float(hi))


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    estimator: str = "k1",
    clamp: Sequence[float | None] | None = None,
) -> torch.Tensor:
    r"""Per-token estimate of KL(π ‖ π_ref) from the sampled tokens' log-probs.

    With ``d = logprobs − ref_logprobs`` (J. Schulman, "Approximating KL Divergence", 2020):

    - ``k1 = d`` (unbiased, high variance, can be negative)
    - ``k2 = ½ d²``
    - ``k3 = exp(−d) + d − 1`` (unbiased, always ≥ 0; the "low-variance KL")
    - ``abs = |d|``

    ``k3`` and its gradient are within 3 float32 ulps of their exact values on the given inputs
    for every ``d``, however small the value (a series for ``|d| ≤ 1``, float64 beyond; the
    formula as written rounds at the scale of ``exp(−d) ≈ 1``): see docs/ops.md#kl_penalty.

    Args:
        logprobs: ``[*]`` (usually ``[B, T]``) float tensor, log π of the sampled tokens (nats).
        ref_logprobs: same shape, log π_ref of the same tokens.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``.
        clamp: optional ``(lo, hi)`` (either may be ``None``) clipping the result. Where the
            clip saturates the gradient is 0; ``k3`` never computes ``inf − inf`` there, so no
            input yields a NaN value or gradient. Unclamped, ``k3`` overflows to ``+inf``.

    Returns:
        ``kl`` with the shape of ``logprobs``, float32 (float64 for float64 input), in nats.
        Differentiable w.r.t. ``logprobs`` (and ``ref_logprobs``), for KL-in-loss.

    Raises:
        ValueError: unknown ``estimator``, shape mismatch, bad ``clamp``, non-float dtypes.
        RuntimeError: inputs on different devices.
    """
    lo, hi = _clamp_bounds(clamp)
    return torch.ops.pyppo.kl_penalty.default(logprobs, ref_logprobs, estimator, lo, hi)


def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
    score_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Per-token rewards: a KL penalty on every response token plus the score on the last one.

    .. math:: r_t = -\beta\,\mathrm{KL}_t + \mathbb{1}[t = t_{last}]\,\mathrm{clip}(s, \pm c)

    (InstructGPT, Ouyang et al. 2022, eq. 2; Ziegler et al. 2019, §2.) ``t_last`` is the last
    valid position of each row, wherever the row's padding is.

    Args:
        scores: ``[B]`` float, one scalar reward per sequence (must be finite).
        logprobs, ref_logprobs: ``[B, T]`` float, log-probs of the response tokens under the
            policy that sampled them and under the frozen reference.
        response_mask: ``[B, T]`` bool or 0/1, valid response positions.
        kl_coef: β ≥ 0.
        estimator: KL estimator, see :func:`kl_penalty`.
        score_clip: optional ``c > 0``; scores are clipped to ``[−c, c]``.

    Returns:
        ``(rewards [B, T], kl [B, T])``, float32 (float64 for float64 input), 0 at masked positions.

    Raises:
        ValueError: a row of ``response_mask`` has no valid position, a non-finite score,
            ``kl_coef < 0``, shape or dtype mismatches, unknown ``estimator``.
    """
    return torch.ops.pyppo.shape_rewards.default(
        scores,
        logprobs,
        ref_logprobs,
        response_mask,
        float(kl_coef),
        estimator,
        None if score_clip is None else float(score_clip),
    )


def _kl_setup_context(ctx, inputs, output):
    logprobs, ref_logprobs, estimator, clamp_min, clamp_max = inputs
    ctx.save_for_backward(logprobs, ref_logprobs)
    ctx.args = (estimator, clamp_min, clamp_max)


def _kl_backward(ctx, grad_kl):
    logprobs, ref_logprobs = ctx.saved_tensors
    grad_lp = torch.ops.pyppo.kl_penalty_backward.default(grad_kl, logprobs, ref_logprobs, *ctx.args)
    # Every estimator is a function of logprobs - ref_logprobs, so d/d ref = -d/d logprobs.
    grad_ref = (-grad_lp).to(ref_logprobs.dtype) if ctx.needs_input_grad[1] else None
    return grad_lp, grad_ref, None, None, None


torch.library.register_autograd("pyppo::kl_penalty", _kl_backward, setup_context=_kl_setup_context)
