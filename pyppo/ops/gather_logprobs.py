"""Log-probabilities (and entropy) of chosen tokens, gathered from logits in one pass
(docs/ops.md#gather_logprobs)."""

from __future__ import annotations

import torch

__all__ = ["gather_logprobs"]


def gather_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Log-probability of each label under ``softmax(logits / temperature)``, and optionally the entropy.

    .. math::
        \log \pi(y_t) = z_{t,y_t}/\tau - \operatorname{logsumexp}_v(z_{t,v}/\tau), \qquad
        H_t = -\textstyle\sum_v p_{t,v} \log p_{t,v}

    The forward reads each row of logits once (blocked online logsumexp) and allocates nothing
    of size ``V``; the backward writes ``∂/∂z = (g_lp·(onehot − p) − g_H·p·(log p + H)) / τ``
    in one pass. Results are deterministic and batch-invariant: a row's value does not depend
    on the thread count or on the other rows, so rollout-time and train-time log-probs agree
    bit for bit.

    Args:
        logits: ``[*, V]`` float32, bfloat16, float16 (or float64), any strides. Unnormalised scores.
        labels: ``[*]`` int64 (or int32) token ids in ``[0, V)``.
        mask: optional ``[*]`` bool or 0/1 tensor; ``False``/0 positions are skipped.
        temperature: ``τ > 0``, the sampling temperature the logits were sampled at.
        ignore_index: label value treated as masked (HF's ``-100``).
        return_entropy: also return the entropy of ``softmax(logits / τ)`` per position (nats).

    Returns:
        ``logprobs [*]`` (nats, ``≤ 0``), or ``(logprobs, entropy)``. float32 (float64 for
        float64 logits). Masked and ``ignore_index`` positions are 0 and get zero gradient.
        Differentiable w.r.t. ``logits``.

    Raises:
        ValueError: ``labels`` is not ``logits.shape[:-1]``, ``mask`` does not match ``labels``,
            an unmasked label is outside ``[0, V)`` (negative labels other than
            ``ignore_index`` included), an empty vocabulary (``V = 0``), ``temperature <= 0``
            or not finite, wrong dtypes.
        RuntimeError: inputs on different devices.

    On CUDA the label range is checked on the device and read back once per call; while a CUDA
    graph is being captured nothing can be read back, and a row whose label is outside
    ``[0, V)`` gets NaN results (and a NaN gradient) instead of an error.

    A NaN or ``+inf`` logit makes that row's results NaN (log-prob, entropy and gradient); other
    rows are unaffected, bit for bit. A masked row gives 0 whatever its logits. ``-inf`` logits
    are zero-probability tokens: the results stay finite, except the log-prob of a label whose
    logit is ``-inf``, which is ``-inf``.
    Source: the PPO log-ratio inputs of Schulman et al. 2017 (eq. 6) and InstructGPT (Ouyang et
    al. 2022, eq. 2); "The N+ Implementation Details of RLHF with PPO" (Huang et al. 2024) §
    temperature scaling.
    """
    logprobs, entropy, _ = torch.ops.pyppo.gather_logprobs.default(
        logits, labels, mask, float(temperature), int(ignore_index), bool(return_entropy)
    )
    return (logprobs, entropy) if return_entropy else logprobs


def _setup_context(ctx, inputs, output):
    logits, labels, mask, temperature, ignore_index, return_entropy = inputs
    _, entropy, lse = output
    # lse is the op's saved statistic, not a result to differentiate: marked so, a loss
    # built on it gets no gradient through it instead of a silently wrong one.
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, labels, mask, lse, entropy if return_entropy else None)
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index


def _backward(ctx, grad_logprobs, grad_entropy, grad_lse):
    logits, labels, mask, lse, entropy = ctx.saved_tensors
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(lse)
    if entropy is None:
        grad_entropy = None
    grad_logits = torch.ops.pyppo.gather_logprobs_backward.default(
        grad_logprobs, grad_entropy, logits, labels, mask, lse, entropy, ctx.temperature, ctx.ignore_index
    )
    return grad_logits, None, None, None, None, None


torch.library.register_autograd("pyppo::gather_logprobs", _backward, setup_context=_setup_context)
