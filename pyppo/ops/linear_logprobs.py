"""Log-probabilities straight from hidden states, never holding the [tokens, vocab] logits
(docs/ops.md#linear_logprobs)."""

from __future__ import annotations

import torch

__all__ = ["linear_logprobs"]


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""``gather_logprobs(hidden @ weight.T + bias, labels, ...)`` without the full logits.

    The tokens are processed ``chunk_size`` at a time: each chunk's logits ``[chunk, V]`` are
    computed by one GEMM, reduced by the :func:`gather_logprobs` kernel and dropped. The
    backward recomputes each chunk's logits instead of saving them, so neither pass ever holds
    ``[N, V]``: for ``N = 8192`` tokens and a 49k vocabulary that is 1.6 GB of float32 logits
    (and as much again for ``log_softmax`` and each gradient) that never exist. ``grad_weight``
    and ``grad_bias`` are accumulated in float32. (The chunked-loss idea of Liger-Kernel's fused
    linear cross-entropy and Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language
    Models", applied to the PPO log-probs.)

    Args:
        hidden: ``[*, H]`` float32/bfloat16/float16 (or float64) final hidden states.
        weight: ``[V, H]`` output embedding (``model.get_output_embeddings().weight``), hidden's dtype.
        labels: ``[*]`` int64 token ids in ``[0, V)``.
        mask: optional ``[*]`` bool or 0/1, positions to compute.
        bias: optional ``[V]`` output bias.
        temperature: ``τ > 0``; logits are divided by it.
        ignore_index: label value treated as masked.
        return_entropy: also return the entropy of ``softmax(logits / τ)`` (nats).
        chunk_size: tokens per chunk; ``None`` picks about 128 MB of float32 logits per chunk (the
            forward and the backward each hold one such buffer; on CPU the backward writes the
            chunk's gradient over its recomputed logits).

    Returns:
        ``logprobs [*]`` or ``(logprobs, entropy)``, float32 (float64 for float64 input); 0 at
        masked positions. Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.

    Raises:
        ValueError: shape/dtype mismatches (``weight`` must be ``[V, H]``), an unmasked label
            outside ``[0, V)``, ``temperature <= 0``, ``chunk_size <= 0``.
        RuntimeError: inputs on different devices.
    """
    if chunk_size is not None and int(chunk_size) <= 0:
        raise ValueError(f"pyppo.linear_logprobs: chunk_size must be > 0 or None, got {chunk_size}")
    logprobs, entropy, _ = torch.ops.pyppo.linear_logprobs.default(
        hidden,
        weight,
        labels,
        mask,
        bias,
        float(temperature),
        int(ignore_index),
        bool(return_entropy),
        0 if chunk_size is None else int(chunk_size),
    )
    return (logprobs, entropy) if return_entropy else logprobs


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, mask, bias, temperature, ignore_index, return_entropy, chunk_size = inputs
    _, entropy, lse = output
    # lse is the op's saved statistic, not a result to differentiate: marked so, a loss
    # built on it gets no gradient through it instead of a silently wrong one.
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden, weight, labels, mask, bias, lse, entropy if return_entropy else None)
    ctx.args = (temperature, ignore_index, chunk_size)


def _backward(ctx, grad_logprobs, grad_entropy, grad_lse):
    hidden, weight, labels, mask, bias, lse, entropy = ctx.saved_tensors
    temperature, ignore_index, chunk_size = ctx.args
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(lse)
    if entropy is None:
        grad_entropy = None
    want = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[4]]
    gh, gw, gb = torch.ops.pyppo.linear_logprobs_backward.default(
        grad_logprobs,
        grad_entropy,
        hidden,
        weight,
        labels,
        mask,
        bias,
        lse,
        entropy,
        temperature,
        ignore_index,
        chunk_size,
        want,
    )
    return (
        gh if want[0] else None,
        gw if want[1] else None,
        None,
        None,
        gb if want[2] else None,
        None,
        None,
        None,
        None,
    )


torch.library.register_autograd("pyppo::linear_logprobs", _backward, setup_context=_setup_context)
