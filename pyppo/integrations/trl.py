"""Drop-in adapters for TRL 1.16.0's ``trl.trainer.utils``, computed with pyppo's ops.

Covered: ``selective_log_softmax`` (one label per position, or ``K`` per position for top-K),
``entropy_from_logits`` and ``selective_log_softmax_and_entropy``, all with
``pyppo.ops.gather_logprobs``, which computes the log-prob and the entropy of a position in one
pass over the vocabulary, forward and backward, without a ``[*, V]`` temporary. Each has the
peer's signature, return types, output dtypes and masking conventions; ``docs/integrations.md``
lists every place where plain torch around the op keeps the peer's result, and the tolerances
tested.

Usage: ``import pyppo.integrations.trl as t; t.patch()`` (``t.unpatch()`` restores, or
``with t.patched(): ...``). This module never imports TRL: the adapters also work called
directly.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import _patching
from ._logits import NO_IGNORE_INDEX, check_temperature, gather_raw, positive_index, zero_labels
from ._patching import Patch

__all__ = [
    "selective_log_softmax",
    "entropy_from_logits",
    "selective_log_softmax_and_entropy",
    "PEER",
    "patch",
    "unpatch",
    "patched",
]


def _keep(row_mask: torch.Tensor | None) -> torch.Tensor | None:
    # TRL skips the positions where ``row_mask == 0``: any non-zero value keeps a position.
    if row_mask is None:
        return None
    return row_mask if row_mask.dtype == torch.bool else row_mask != 0


class _TopKLogprobs(torch.autograd.Function):
    """log-softmax(z/τ) at ``K`` indices per position (and optionally the entropy), from one
    pass of the pyppo op: it gives ``lse = logsumexp(z/τ)`` and the entropy; the ``K`` values
    are ``z_k/τ − lse``.

    The op's autograd formula covers one label per position, so the backward is written here
    with the op's backward kernel: called with ``G = Σ_k g_k`` on the first index it writes
    ``(−G·p − g_H·p·(log p + H))/τ`` at every vocabulary entry plus ``G/τ`` at that index; the
    ``K`` indexed entries are then overwritten with their exact value
    ``(Σ_{k: i_k = i_j} g_k − G·p_j − g_H·p_j·(log p_j + H))/τ``, computed in float32. (Adding a
    correction instead would cancel ``G/τ`` in the gradient's dtype, which costs ~1% in bf16.)
    """

    @staticmethod
    def forward(ctx, logits, index, pos_mask, temperature, want_entropy, fn):
        # torch.gather first: a bad index raises what the peer raises.
        selected = logits.gather(-1, index)
        first = index[..., 0] if index.shape[-1] > 0 else zero_labels(logits)
        _, entropy, lse = gather_raw(fn, "index", logits, first, pos_mask, temperature, want_entropy)
        logps = selected.to(lse.dtype) / temperature - lse.unsqueeze(-1)
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.want_entropy = want_entropy
        ctx.save_for_backward(logits, index, first, pos_mask, lse, logps, entropy if want_entropy else None)
        return logps, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps, grad_entropy):
        logits, index, first, pos_mask, lse, logps, entropy = ctx.saved_tensors
        g = torch.zeros_like(logps) if grad_logps is None else grad_logps.to(logps.dtype)
        with_entropy = ctx.want_entropy and grad_entropy is not None
        g_h = grad_entropy.to(lse.dtype) if with_entropy else None
        G = g.sum(-1)
        grad = torch.ops.pyppo.gather_logprobs_backward.default(
            G, g_h, logits, first, pos_mask, lse, entropy if with_entropy else None, ctx.temperature, NO_IGNORE_INDEX
        )
        p = logps.exp()
        # Repeated indices share one vocabulary entry: each gets the sum of their gradients.
        same = index.unsqueeze(-1) == index.unsqueeze(-2)
        value = (same.to(g.dtype) * g.unsqueeze(-2)).sum(-1) - G.unsqueeze(-1) * p
        if with_entropy:
            # p·log p is 0 at p = 0 (a -inf logit), not 0·(-inf).
            plogp = torch.where(p > 0, p * (logps + entropy.unsqueeze(-1)), torch.zeros_like(p))
            value = value - g_h.unsqueeze(-1) * plogp
        value = value / ctx.temperature
        if pos_mask is not None:
            value = value.masked_fill(~pos_mask.unsqueeze(-1), 0.0)
        grad.scatter_(-1, index, value.to(grad.dtype))
        return grad, None, None, None, None, None


def _top_k(fn, logits, index, temperature, keep, want_entropy):
    # A position whose K indices are all masked can be skipped; partly masked ones are computed
    # and their masked entries zeroed by the caller's masked_fill (which gives them no gradient).
    pos_mask = keep.any(-1) if keep is not None and keep.shape == index.shape and not want_entropy else None
    return _TopKLogprobs.apply(logits, index, pos_mask, temperature, want_entropy, fn)


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, row_mask: torch.Tensor | None = None
) -> torch.Tensor:
    r"""``log_softmax(logits / temperature)`` gathered at ``index``. Matches TRL 1.16.0
    ``trl.trainer.utils.selective_log_softmax``.

    ``out = z_i/τ − logsumexp(z/τ)`` for each index ``i``.

    Args:
        logits: ``[..., V]`` float32/bfloat16/float16/float64, any strides.
        index: ``[...]`` (one log-prob per position) or ``[..., K]`` (``K`` per position, top-K),
            int64 or int32.
        temperature: ``τ > 0``.
        row_mask: optional, ``index``'s shape; positions where it is 0 are 0 with zero gradient.
            Any non-zero value keeps a position (TRL's ``row_mask == 0`` test); other
            broadcastable shapes are applied with TRL's ``masked_fill``.

    Returns:
        ``index``'s shape, in ``logits``' dtype (TRL rounds its bf16/fp16 ``log_softmax`` to the
        input dtype; pyppo accumulates in float32 and rounds once). Differentiable w.r.t.
        ``logits``.

    Raises:
        ValueError: ``temperature must be positive`` (TRL's message; also for NaN and inf,
            which TRL divides by); an unmasked index outside ``[0, V)`` (TRL's
            ``torch.gather`` raises RuntimeError on CPU and asserts on CUDA; the top-K path
            keeps TRL's RuntimeError); ``V = 0``; non-float logits.

    Work: ``pyppo.ops.gather_logprobs`` (its autograd) for ``[...]``; for ``[..., K]`` the op's
    third output, ``logsumexp(z/τ)``, and its backward kernel in a custom autograd function.
    Deliberate differences: an index at a masked position is not read (TRL indexes it and fails
    when it is out of range); 1-D logits give the right answer (TRL's row loop returns a ``[V]``
    tensor of differences for them).
    """
    t = check_temperature("selective_log_softmax", temperature)
    keep = _keep(row_mask)
    if index.ndim == logits.ndim - 1:
        op_mask = keep if keep is not None and keep.shape == index.shape else None
        logps, _, _ = gather_raw("selective_log_softmax", "index", logits, index, op_mask, t, False)
        if keep is not None and op_mask is None:
            logps = logps.masked_fill(~keep, 0.0)
    else:
        logps, _ = _top_k("selective_log_softmax", logits, index, t, keep, False)
        if keep is not None:
            logps = logps.masked_fill(~keep, 0.0)
    return logps.to(logits.dtype)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    r"""Shannon entropy (nats) of ``softmax(logits)`` over the last dimension. Matches TRL 1.16.0
    ``trl.trainer.utils.entropy_from_logits``.

    ``H = −Σ_v p_v log p_v``.

    Args:
        logits: ``[..., V]`` float, any strides.
        chunk_size: accepted for compatibility, must be a positive int. TRL processes that
            many rows at a time to bound its ``[chunk, V]`` temporaries; pyppo has none, so it
            does not change the result or the memory used.

    Returns:
        ``logits.shape[:-1]``, in ``logits``' dtype. Differentiable w.r.t. ``logits``.

    Raises:
        ValueError: ``chunk_size`` not positive (TRL's ``split`` raises RuntimeError), ``V = 0``,
            non-float logits.

    Work: ``pyppo.ops.gather_logprobs(..., return_entropy=True)`` on a placeholder label.
    Deliberate difference: a ``−inf`` logit (probability 0) contributes 0, where TRL's
    ``exp(logp)·logp = 0·(−inf)`` makes the row NaN.
    """
    if not positive_index(chunk_size):
        raise ValueError(f"entropy_from_logits: chunk_size must be a positive int, got {chunk_size!r}")
    _, entropy, _ = gather_raw("entropy_from_logits", "labels", logits, zero_labels(logits), None, 1.0, True)
    return entropy.to(logits.dtype)


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    entropy_requires_grad: bool = True,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Log-probs at ``index`` and entropy of ``softmax(logits / temperature)``, in one pass.
    Matches TRL 1.16.0 ``trl.trainer.utils.selective_log_softmax_and_entropy``.

    Args:
        logits: ``[..., V]`` float, any strides.
        index: ``[...]`` (TRL's documented shape; ``[..., K]`` is accepted as TRL's CPU path
            does, giving ``[..., K]`` log-probs and ``[...]`` entropy).
        entropy_requires_grad: if false the entropy is returned detached.
        temperature: ``τ > 0``.
        row_mask: optional, ``index``'s shape; both outputs are 0 with zero gradient where it
            is 0.

    Returns:
        ``(logprobs, entropy)``, ``index``'s and ``logits.shape[:-1]``'s shapes, in
        ``logits``' dtype.

    Raises:
        as :func:`selective_log_softmax`.

    Work: one ``pyppo.ops.gather_logprobs(..., return_entropy=True)`` call (TRL's CPU path
    reads the logits twice, once per quantity, and materialises a softmax per chunk). The same
    deliberate differences as :func:`selective_log_softmax` and :func:`entropy_from_logits`.
    """
    fn = "selective_log_softmax_and_entropy"
    t = check_temperature(fn, temperature)
    keep = _keep(row_mask)
    if index.ndim == logits.ndim - 1:
        op_mask = keep if keep is not None and keep.shape == index.shape else None
        logps, entropy, _ = gather_raw(fn, "index", logits, index, op_mask, t, True)
        if keep is not None and op_mask is None:
            logps, entropy = logps.masked_fill(~keep, 0.0), entropy.masked_fill(~keep, 0.0)
    else:
        logps, entropy = _top_k(fn, logits, index, t, keep, True)
        if keep is not None:
            logps, entropy = logps.masked_fill(~keep, 0.0), entropy.masked_fill(~keep, 0.0)
    if not entropy_requires_grad:
        entropy = entropy.detach()
    return logps.to(logits.dtype), entropy.to(logits.dtype)


PEER = _patching.Peer.named(
    "trl",
    versions=("1.16.0",),
    targets=_patching.targets(
        "trl.trainer.utils", selective_log_softmax, entropy_from_logits, selective_log_softmax_and_entropy
    ),
)


def patch(*, force: bool = False) -> Patch:
    """Swap the adapters into the installed TRL (see :mod:`pyppo.integrations`); returns what was
    replaced. TRL other than 1.16.0 is warned about and left alone unless ``force``."""
    return _patching.patch(PEER, force=force)


def unpatch() -> Patch | None:
    """Put TRL's own functions back; returns the patch undone (None if none was active)."""
    return _patching.unpatch(PEER)


def patched(*, force: bool = False):
    """``with patched(): ...``: TRL patched for the block only."""
    return _patching.patched(PEER, force=force)
