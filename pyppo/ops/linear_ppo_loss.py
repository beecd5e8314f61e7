"""The PPO policy loss straight from hidden states, its gradients computed in the forward pass
(docs/ops.md#linear_ppo_loss)."""

from __future__ import annotations

import functools

import torch

from ._non_differentiable import first_derivative_only
from .kl import kl_penalty
from .losses import _as_bool_mask, aggregate_loss, loss_token_weights, named_errors
from .policy_losses import policy_loss_fn

__all__ = ["linear_ppo_loss"]

_OP = "pyppo.linear_ppo_loss"


def _named(fn):
    # The losses' own checks raise messages without an op name (or their own): say which op the
    # user called.
    return named_errors(fn, "linear_ppo_loss")


def linear_ppo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,  # what linear_logprobs takes
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,  # what the loss takes
    *,
    policy_loss: str = "ppo",
    bias: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_loss_estimator: str = "k3",
    entropy_coef: float = 0.0,
    cliprange_low: float = 0.2,
    cliprange_high: float = 0.2,
    dual_clip: float | None = None,
    loss_agg: str = "token-mean",
    loss_agg_norm: float | None = None,
    normalizer: float | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    r"""The policy loss of ``hidden @ weight.T + bias``, without the ``[tokens, V]`` logits and
    without a second pass over them in the backward.

    The value and gradients of::

        lp, ent = linear_logprobs(hidden, weight, labels, response_mask, bias=bias,
                                  temperature=temperature, return_entropy=True)
        policy_loss, stats = POLICY_LOSSES[policy_loss](lp, old_logprobs, advantages, response_mask, ...)
        loss = (policy_loss
                + kl_loss_coef * aggregate_loss(kl_penalty(lp, ref_logprobs, estimator=kl_loss_estimator),
                                                response_mask, ...)   # when kl_loss_coef > 0
                - entropy_coef * aggregate_loss(ent, response_mask, ...))  # when entropy_coef > 0

    with the same ``loss_agg`` / ``loss_agg_norm`` / ``normalizer`` for every term. ``policy_loss``
    picks the policy term (:data:`~pyppo.ops.POLICY_LOSSES`): ``"ppo"``, the clipped surrogate
    of Schulman et al. 2017 (eq. 7) with the ±20 log-ratio clamp and the optional dual clip of
    Ye et al. 2020 (:func:`~pyppo.ops.ppo_policy_loss`); ``"gspo"``, the sequence-level ratio of
    :func:`~pyppo.ops.gspo_policy_loss`; ``"cispo"``, the clipped detached weight of
    :func:`~pyppo.ops.cispo_policy_loss`.

    Each token's loss depends on its own log-prob and entropy only, and the aggregation is a fixed
    weight per token (:func:`~pyppo.ops.losses.loss_token_weights`), so the gradient of a chunk
    of tokens is known as soon as its log-probs are: the op computes each chunk's logits (one
    GEMM), turns them in place into their gradient, and multiplies that into ``grad_hidden`` and
    ``grad_weight`` (two GEMMs), all in the forward. The backward only scales the saved gradients
    by the incoming gradient of ``loss``. GSPO's ratio is a row's mean, so its tokens' gradients
    wait for every log-prob of the row: when the tokens take more than one chunk, a first pass
    computes the log-probs alone (one more GEMM per chunk). Three GEMMs in all, against four for ``linear_logprobs``
    (which recomputes the logits in its backward), and one ``[chunk, V]`` buffer instead of the
    ``[tokens, V]`` logits, softmax and gradients of the eager path: the chunked fused loss of
    Liger-Kernel's fused linear cross-entropy and of Wijmans et al. 2024, "Cut Your Losses in
    Large-Vocabulary Language Models", applied to PPO. ``grad_weight`` and ``grad_bias`` are
    accumulated in float32.

    The loss value, ``logprobs``, ``entropy`` and ``stats`` are those of the unfused path on the
    same log-probs: they are computed by the policy loss, ``kl_penalty`` and
    ``aggregate_loss`` on the returned log-probs, so ``loss`` is their result bit for bit. The
    gradients agree with the unfused path's to float32 rounding.

    Args:
        hidden: ``[B, T, H]`` float32/bfloat16/float16 (or float64) final hidden states.
        weight: ``[V, H]`` output embedding, hidden's dtype.
        labels: ``[B, T]`` int64 token ids in ``[0, V)`` at valid positions (``-100``: a log-prob of
            0 with no gradient, as ``linear_logprobs``' ``ignore_index``).
        old_logprobs, advantages: ``[B, T]`` float, log π_old of the labels and their advantages.
        response_mask: ``[B, T]`` bool or 0/1; masked positions add nothing to the loss, its
            gradients or the stats, whatever they hold (−inf old log-probs, NaN advantages).
        bias: optional ``[V]`` output bias, hidden's dtype.
        ref_logprobs: ``[B, T]`` float, log π_ref of the labels; required when ``kl_loss_coef > 0``.
        kl_loss_coef: β ≥ 0 of the KL-in-loss term (off at 0).
        kl_loss_estimator: one of :data:`~pyppo.ops.KL_ESTIMATORS` (see :func:`~pyppo.ops.kl_penalty`).
        entropy_coef: ≥ 0, weight of the entropy bonus (off at 0).
        policy_loss: ``"ppo"``, ``"gspo"`` or ``"cispo"``.
        cliprange_low, cliprange_high, dual_clip: as :func:`~pyppo.ops.ppo_policy_loss`
            (``dual_clip`` with ``"ppo"`` only).
        loss_agg, loss_agg_norm, normalizer: as :func:`~pyppo.ops.aggregate_loss`; with
            ``normalizer`` the losses (and gradients) of the micro-batches of a minibatch sum to the
            minibatch's.
        temperature: τ > 0; logits are divided by it.
        chunk_size: tokens per chunk; ``None`` picks about 128 MB of float32 logits per chunk, as
            ``linear_logprobs``.
        return_entropy: also return the per-token entropy.

    Returns:
        ``(loss, stats, logprobs, entropy)``: ``loss`` 0-d, float32 (float64 when ``hidden``,
        ``old_logprobs`` or ``advantages`` is float64), differentiable w.r.t. ``hidden``,
        ``weight`` and ``bias`` (first derivatives only); ``stats`` the 0-d detached float32 stats of
        the policy loss plus ``policy_loss``, ``kl_loss`` (when ``kl_loss_coef > 0``) and
        ``entropy_loss`` (when ``entropy_coef > 0``); ``logprobs [B, T]`` detached, float32 (float64
        for float64 hidden), 0 at masked positions; ``entropy [B, T]`` likewise when
        ``return_entropy`` or ``entropy_coef > 0``, else ``None``.

    Raises:
        ValueError: the errors of ``linear_logprobs`` and the policy loss (shapes, dtypes,
            ranges, unknown ``loss_agg``, no valid token without ``normalizer``, ...), naming the
            argument after ``pyppo.linear_ppo_loss:``; ``ref_logprobs`` missing with
            ``kl_loss_coef > 0``; an unknown ``policy_loss`` or ``kl_loss_estimator``; ``dual_clip``
            with a ``policy_loss`` other than ``"ppo"``; a negative or non-finite
            ``kl_loss_coef`` / ``entropy_coef``; ``chunk_size <= 0``; ``hidden`` not ``[B, T, H]``.
        RuntimeError: inputs on different devices.
    """
    if chunk_size is not None and int(chunk_size) <= 0:
        raise ValueError(f"{_OP}: chunk_size must be > 0 or None, got {chunk_size}")
    for name, t in (("hidden", hidden), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 3:
        raise ValueError(f"{_OP}: hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    kl_on, ent_on = float(kl_loss_coef) > 0, float(entropy_coef) > 0
    f64 = torch.float64 in (hidden.dtype, old_logprobs.dtype, advantages.dtype)
    response_mask = _named(_as_bool_mask)(response_mask, "response_mask")
    weights = _named(loss_token_weights)(
        response_mask, loss_agg, loss_agg_norm, normalizer, dtype=torch.float64 if f64 else torch.float32
    )
    grad_on = torch.is_grad_enabled()
    want = [grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    op_loss, logprobs, entropy, *_ = torch.ops.pyppo.linear_ppo_loss.default(
        hidden,
        weight,
        labels,
        old_logprobs,
        advantages,
        response_mask,
        weights,
        ref_logprobs,
        bias,
        float(temperature),
        -100,
        float(cliprange_low),
        float(cliprange_high),
        None if dual_clip is None else float(dual_clip),
        float(kl_loss_coef),
        kl_loss_estimator,
        float(entropy_coef),
        bool(return_entropy),
        0 if chunk_size is None else int(chunk_size),
        want,
        policy_loss,
    )
    agg = _named(
        functools.partial(aggregate_loss, loss_agg=loss_agg, loss_agg_norm=loss_agg_norm, normalizer=normalizer)
    )
    clip = dict(dual_clip=dual_clip) if policy_loss == "ppo" else {}
    with torch.no_grad():
        loss, stats = _named(policy_loss_fn(policy_loss))(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            cliprange_low=cliprange_low,
            cliprange_high=cliprange_high,
            loss_agg=loss_agg,
            loss_agg_norm=loss_agg_norm,
            normalizer=normalizer,
            **clip,
        )
        stats["policy_loss"] = loss.float()
        if kl_on:
            kl_loss = agg(kl_penalty(logprobs, ref_logprobs, estimator=kl_loss_estimator), response_mask)
            stats["kl_loss"] = kl_loss.float()
            loss = loss + kl_loss_coef * kl_loss
        if ent_on:
            entropy_loss = agg(entropy, response_mask)
            stats["entropy_loss"] = entropy_loss.float()
            loss = loss - entropy_coef * entropy_loss
    if op_loss.requires_grad:
        # The op's own Σ w·ℓ carries the gradient; its value is replaced by the unfused path's
        # (to which it is equal up to summation order): op_loss − op_loss is exactly 0.
        # A non-finite op_loss would make that NaN; the value is then the unfused one (inf) too.
        zero = op_loss - op_loss.detach()
        loss = loss + torch.where(torch.isfinite(op_loss.detach()), zero, torch.zeros_like(zero))
    return loss, stats, logprobs, entropy if (return_entropy or ent_on) else None


# The differentiable inputs' positions in the schema, and their output_mask entries; output_mask's.
_DIFFERENTIABLE = ((0, "hidden"), (1, "weight"), (8, "bias"))
_OUTPUT_MASK = 19


def _setup_context(ctx, inputs, output):
    hidden = inputs[0]
    _, logprobs, entropy, grad_hidden, grad_weight, grad_bias = output
    ctx.mark_non_differentiable(logprobs, entropy, grad_hidden, grad_weight, grad_bias)
    # Otherwise autograd would hand the backward a zero "gradient" for each of those outputs: a
    # [V, H] grad_weight-sized tensor of zeros, allocated for nothing.
    ctx.set_materialize_grads(False)
    # hidden is saved only to tie the gradients to it, so that a second derivative raises.
    ctx.save_for_backward(hidden, grad_hidden, grad_weight, grad_bias)
    ctx.want = inputs[_OUTPUT_MASK]
    ctx.n_inputs = len(inputs)


def _backward(ctx, grad_loss, *_):
    hidden, *saved = ctx.saved_tensors
    grads = [None] * ctx.n_inputs
    if grad_loss is None:
        return tuple(grads)
    for (i, name), wanted, g in zip(_DIFFERENTIABLE, ctx.want, saved):
        if ctx.needs_input_grad[i] and not wanted:
            raise RuntimeError(
                f"{_OP}: the gradient w.r.t. {name} was not computed in the forward (its output_mask "
                "entry was False), and the op has no backward pass that could compute it"
            )
        if wanted:
            grads[i] = first_derivative_only("pyppo::linear_ppo_loss", g * grad_loss, hidden)
    return tuple(grads)


torch.library.register_autograd("pyppo::linear_ppo_loss", _backward, setup_context=_setup_context)
