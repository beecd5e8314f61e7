"""Replacements for veRL 0.9.1's ``verl.utils.torch_functional``: :func:`masked_mean`,
:func:`masked_var`, :func:`masked_whiten`, :func:`logprobs_from_logits`,
:func:`entropy_from_logits`, :func:`entropy_from_logits_with_chunking`.

The masked statistics with veRL's conventions (:func:`_mean_impl`, :func:`_mean_var`) are also
what :mod:`.core_algos` reduces with, as veRL's ``core_algos`` calls ``verl_F.masked_mean``.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from pyppo.ops import gather_logprobs as _gather_logprobs
from pyppo.ops import masked_mean as _masked_mean
from pyppo.ops import masked_var as _masked_var

from .._logits import positive_index
from ._checks import _acc, _bool_mask, _float_tensor, _mean_dtype, _tensor

PEER_MODULE = "verl.utils.torch_functional"


def _verl_eps_scale(mask: torch.Tensor, mask_dtype: torch.dtype, dim: Optional[int] = None) -> Optional[torch.Tensor]:
    """veRL divides its masked sums by ``mask.sum() + 1e-8`` in the count's dtype: the default
    float dtype for a bool/int mask, the mask's own for a float mask. Below float64 that sum
    rounds back to the count (n ≥ 1); in float64 it scales every masked mean by n / (n + 1e-8),
    which this factor reproduces. None when it is exactly 1."""
    den = mask_dtype if mask_dtype.is_floating_point else torch.get_default_dtype()
    if den != torch.float64:
        return None
    n = (mask != 0).sum(dim, dtype=torch.float64) if dim is not None else (mask != 0).sum(dtype=torch.float64)
    return n / (n + 1e-8)


def _mean_impl(
    x: torch.Tensor, mask: torch.Tensor, dim: Optional[int], mask_dtype: torch.dtype = torch.bool
) -> torch.Tensor:
    """pyppo's masked mean of ``x`` over the bool ``mask`` (from :func:`_bool_mask`) with veRL's
    convention for an empty selection (0, not an error) and veRL's epsilon (``mask_dtype``: the
    dtype of the caller's mask)."""
    if mask_dtype == torch.float64:
        x = x.to(torch.float64)  # veRL's products with a float64 mask are float64
    if x.numel() == 0 and mask.shape == x.shape:
        # Nothing to select (an empty batch, or a size-0 axis): veRL's 0 / (0 + 1e-8) is 0 for
        # every output element, which pyppo's op refuses as an empty slice.
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        total = torch.where(mask != 0, x, zero)
        total = total.sum() if dim is None else total.sum(dim)
        return total.to(_acc(x.dtype))
    try:
        result = _masked_mean(x, mask, dim)
    except ValueError:
        # Only an empty selection is veRL's 0; any other error (a bad mask, a bad dim) stands.
        result = _empty_selection_mean(x, mask, dim)
        if result is None:
            raise
    scale = _verl_eps_scale(mask, mask_dtype, dim)
    return result if scale is None else result * scale


def _empty_selection_mean(x: torch.Tensor, m: torch.Tensor, dim: Optional[int]) -> Optional[torch.Tensor]:
    """veRL's 0 where the bool mask ``m`` (checked by :func:`_bool_mask`) selects nothing; None
    when the op's error had another cause (a bad dim, a mask of another shape)."""
    if m.shape != x.shape or (dim is not None and not -x.dim() <= dim < max(x.dim(), 1)):
        return None
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if dim is None:
        if bool(m.any()):
            return None
        # where() keeps the result attached to x (zero gradient), as veRL's masked sum is.
        return torch.where(m, x, zero).sum().to(_acc(x.dtype))
    empty = (m.sum(dim) == 0).unsqueeze(dim)
    if not bool(empty.any()):
        return None
    return _masked_mean(torch.where(empty, zero, x), m | empty, dim)


def masked_mean(values, mask, axis=None):
    """Mean of ``values`` over the positions where ``mask`` is set; ``masked_sum / mask.sum()``.

    Args:
        values: ``[*]`` tensor (an integer tensor is read as the default float dtype, as veRL does).
        mask: bool or 0/1 tensor of ``values``' shape.
        axis: ``None`` (everything), an int, or a tuple of ints to reduce over.

    Returns:
        0-d tensor, or ``values``' shape without ``axis``. Its dtype is veRL's:
        ``promote(values, mask, c)`` with ``c`` the mask's dtype for a float mask, else the
        default float dtype (so bf16 values with a bool mask give float32). An empty selection
        (the whole mask, or a slice along ``axis``) gives 0 there, as veRL's ``x / (0 + 1e-8)``
        does. Differentiable w.r.t. ``values``.

    Raises:
        ValueError: ``mask`` not of ``values``' shape, or not bool / 0-1 (veRL would take
            fractional weights; pyppo refuses them rather than guess); ``axis`` out of range.
        TypeError: a non-tensor argument.

    Computed by ``pyppo.ops.masked_mean`` (float64 block sums in a fixed order, so the result is
    deterministic and no more rounded than the output dtype). veRL divides by ``count + 1e-8``;
    below float64 that is the count, and with a float64 mask the adapter applies the same
    ``n / (n + 1e-8)``. Matches veRL 0.9.1 ``verl.utils.torch_functional.masked_mean``.
    """
    fn = "masked_mean"
    _tensor(fn, "values", values)
    _tensor(fn, "mask", mask)
    out_dtype, mask_dtype = _mean_dtype(values.dtype, mask.dtype), mask.dtype
    x = values if values.is_floating_point() else values.to(torch.get_default_dtype())
    mask = _bool_mask(fn, "mask", mask, x)
    if isinstance(axis, (tuple, list)):
        if x.dim() == 0:
            raise ValueError(f"{fn}: axis given for a 0-d values")
        dims = set()
        for d in axis:
            if not -x.dim() <= d < x.dim():
                raise ValueError(f"{fn}: axis {d} is out of range for a {x.dim()}-d tensor")
            dims.add(d % x.dim())
        dims = sorted(dims)
        x = x.movedim(dims, list(range(x.dim() - len(dims), x.dim())))
        mask = mask.movedim(dims, list(range(mask.dim() - len(dims), mask.dim())))
        keep = x.shape[: x.dim() - len(dims)]
        x, mask = x.reshape(*keep, -1), mask.reshape(*keep, -1)
        axis = -1
    elif axis is not None:
        axis = int(axis)
    return _mean_impl(x, mask, axis, mask_dtype).to(out_dtype)


def masked_var(values, mask, unbiased=True):
    """Variance of ``values`` over the positions where ``mask`` is set (Bessel-corrected when
    ``unbiased``), over the whole tensor.

    Args:
        values: ``[*]`` float tensor; mask: bool or 0/1 tensor of the same shape.
        unbiased: divide by ``n − 1`` instead of ``n``.

    Returns:
        0-d tensor, dtype as :func:`masked_mean`'s. With ``unbiased=False`` an empty mask gives
        0, as in veRL. Differentiable w.r.t. ``values`` when it requires grad (then computed as
        two ``pyppo.ops.masked_mean`` calls, the mean and the mean square deviation, which have
        gradients; otherwise by the two-pass ``pyppo.ops.masked_var``).

    Raises:
        ValueError: with ``unbiased``, a mask selecting no element or one element (veRL raises
            ``ValueError`` in both cases too); a mask that is not bool / 0-1 or of another shape.

    Matches veRL 0.9.1 ``verl.utils.torch_functional.masked_var``.
    """
    fn = "masked_var"
    _float_tensor(fn, "values", values)
    m = _bool_mask(fn, "mask", mask, values)
    out_dtype = _mean_dtype(values.dtype, mask.dtype)
    if not unbiased and not bool(m.any()):
        # veRL: the mean of nothing is 0 (x / 1e-8), so is the biased variance.
        return _mean_impl(values, m, None).to(out_dtype)
    return _mean_var(fn, values, m, mask.dtype, bool(unbiased))[1].to(out_dtype)


def _mean_var(
    fn: str, x: torch.Tensor, m: torch.Tensor, mask_dtype: torch.dtype, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of ``x`` over the bool mask ``m``, float32 (float64 for float64), with
    veRL's epsilon for a caller's mask of ``mask_dtype`` (both are masked means there).

    ``pyppo.ops.masked_var`` has no gradient; when ``x`` needs one, the variance is the masked mean
    of the squared deviations (both means by ``pyppo.ops.masked_mean``, which has a gradient), as
    veRL computes it. veRL's Bessel factor ``n / (n − 1)`` is an integer division for a bool/int
    mask, rounded to float32; pyppo's is exact (a relative difference below 6e-8, in float64)."""
    if mask_dtype == torch.float64:
        x = x.to(torch.float64)
    mean, var = _mean_var_exact(fn, x, m, unbiased)
    scale = _verl_eps_scale(m, mask_dtype)
    return (mean, var) if scale is None else (mean * scale, var * scale)


def _mean_var_exact(fn: str, x: torch.Tensor, m: torch.Tensor, unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.is_grad_enabled() and x.requires_grad:
        n = int(m.sum())
        if n == 0 or (unbiased and n == 1):
            raise ValueError(
                f"{fn}: the {'unbiased ' if unbiased else ''}variance needs at least "
                f"{2 if unbiased else 1} valid element(s), mask selects {n}"
            )
        xa = x.to(_acc(x.dtype))
        mean = _masked_mean(xa, m)
        var = _masked_mean((xa - mean).square(), m)
        return mean, (var * (n / (n - 1)) if unbiased else var)
    return _masked_mean(x, m), _masked_var(x, m, unbiased)


def _whiten_everywhere(
    fn: str, x: torch.Tensor, m: torch.Tensor, mask_dtype: torch.dtype, shift_mean: bool = True
) -> torch.Tensor:
    """veRL's whitening: statistics over the mask, applied to every position (masked ones too),
    in float32 (float64 for float64)."""
    mean, var = _mean_var(fn, x, m, mask_dtype, True)
    whitened = (x.to(mean.dtype) - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def masked_whiten(values, mask, shift_mean=True):
    """Whiten ``values``: ``(x − μ) / sqrt(σ² + 1e-8)`` (``+ μ`` when ``shift_mean`` is false),
    with the mean ``μ`` and the unbiased variance ``σ²`` over the positions where ``mask`` is set.

    Args:
        values: ``[*]`` float tensor; mask: bool or 0/1 tensor of the same shape.
        shift_mean: if false the mean is added back (scale only).

    Returns:
        Tensor of ``values``' shape and dtype, whitened at **every** position, masked ones
        included, as veRL does (``pyppo.ops.masked_whiten`` writes 0 there; this adapter does not
        use it for that reason). Differentiable w.r.t. ``values`` when it requires grad, like
        veRL's (veRL's own callers whiten constants).

    Raises:
        ValueError: the mask selects fewer than 2 elements (veRL: ``ValueError`` from
            ``masked_var``); a mask that is not bool / 0-1 or of another shape.

    Statistics by ``pyppo.ops.masked_mean`` and ``pyppo.ops.masked_var`` (float64 sums), the
    affine map in float32 (float64 for float64 input), one rounding to the output dtype. Advantage
    normalisation: "The 37 Implementation Details of PPO" (Huang et al. 2022), detail 7.
    Matches veRL 0.9.1 ``verl.utils.torch_functional.masked_whiten``.
    """
    fn = "masked_whiten"
    _float_tensor(fn, "values", values)
    m = _bool_mask(fn, "mask", mask, values)
    return _whiten_everywhere(fn, values, m, mask.dtype, bool(shift_mean)).to(values.dtype)


def _flash_ce_in_use() -> bool:
    # veRL's logprobs_from_logits returns flash-attn's float32 log-probs when its Triton
    # cross-entropy imported and VERL_DISABLE_FLASH_ATTN_CE is not "1"; otherwise log-probs in the
    # logits' dtype. Read veRL's own flag when veRL is loaded; without veRL there is no such path.
    tf = sys.modules.get(PEER_MODULE)
    available = bool(getattr(tf, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False))
    return available and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1"


def logprobs_from_logits(logits, labels, inplace_backward=True):
    """Log-probability of each label under ``softmax(logits)``: ``z[label] − logsumexp(z)``.

    Args:
        logits: ``[*, V]`` float tensor (float32, bf16, fp16, float64), any strides.
        labels: ``[*]`` = ``logits.shape[:-1]`` integer token ids in ``[0, V)``; ``-100`` gives 0
            (flash-attn's ``ignore_index``, which veRL's GPU path inherits).
        inplace_backward: accepted for veRL's signature; pyppo's backward always writes the
            gradient in one pass into a fresh ``[*, V]`` tensor.

    Returns:
        ``[*]`` log-probs in the dtype veRL 0.9.1 returns: float32 where veRL would use
        flash-attn's cross-entropy (flash-attn importable and ``VERL_DISABLE_FLASH_ATTN_CE`` not
        ``"1"``), else ``logits.dtype``. Always computed in float32 (float64 for float64).
        Differentiable w.r.t. ``logits``.

    Raises:
        ValueError: ``labels`` not ``logits.shape[:-1]``, a label outside ``[0, V)`` (veRL's
            ``gather`` raises ``RuntimeError`` there), ``V = 0``, non-float logits or non-integer
            labels. TypeError: a non-tensor argument.

    Computed by ``pyppo.ops.gather_logprobs`` (one pass over each row, no ``[*, V]`` temporary,
    batch-invariant). Matches veRL 0.9.1 ``verl.utils.torch_functional.logprobs_from_logits``.
    """
    fn = "logprobs_from_logits"
    _tensor(fn, "logits", logits)
    _tensor(fn, "labels", labels)
    lp = _gather_logprobs(logits, labels)
    return lp if _flash_ce_in_use() and lp.dtype == torch.float32 else lp.to(logits.dtype)


def _entropy(fn: str, logits) -> torch.Tensor:
    _tensor(fn, "logits", logits)
    if logits.dim() == 0:
        raise ValueError(f"{fn}: logits must have a vocabulary dimension, got a 0-d tensor")
    # The op wants labels; any valid id does, and an expanded 0 allocates nothing per position.
    labels = torch.zeros((), dtype=torch.long, device=logits.device).expand(logits.shape[:-1])
    _, entropy = _gather_logprobs(logits, labels, return_entropy=True)
    return entropy


def entropy_from_logits(logits):
    """Entropy ``H = logsumexp(z) − Σ softmax(z)·z`` of each distribution (nats).

    Args:
        logits: ``[*, V]`` float tensor.

    Returns:
        ``[*]`` in ``logits.dtype`` (veRL's dtype), computed in float32 (veRL computes it in the
        input dtype, which for bf16 loses most digits); differentiable w.r.t. ``logits``.

    Raises:
        ValueError: ``V = 0``, a 0-d or non-float ``logits``. TypeError: not a tensor.

    Computed by ``pyppo.ops.gather_logprobs(..., return_entropy=True)`` in one pass per row
    without the ``[*, V]`` softmax. Matches veRL 0.9.1
    ``verl.utils.torch_functional.entropy_from_logits``.
    """
    return _entropy("entropy_from_logits", logits).to(logits.dtype)


def entropy_from_logits_with_chunking(logits, chunk_size=2048):
    """Entropy of each row of ``logits [N, V]``, as :func:`entropy_from_logits`.

    veRL chunks the rows to bound the memory of the softmax; pyppo's op allocates nothing of size
    ``V`` and needs no chunking, so ``chunk_size`` is only checked.

    Returns:
        ``[N]`` in the default float dtype (veRL writes the float32 chunks into
        ``torch.zeros(N)``), differentiable w.r.t. ``logits``.

    Raises:
        ValueError: ``logits`` not 2-D, ``chunk_size`` not a positive int (veRL raises
            ``ValueError`` for 0 and silently returns zeros for a negative size).

    Matches veRL 0.9.1 ``verl.utils.torch_functional.entropy_from_logits_with_chunking``.
    """
    fn = "entropy_from_logits_with_chunking"
    if not positive_index(chunk_size):
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    _tensor(fn, "logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"{fn}: logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    return _entropy(fn, logits).to(torch.get_default_dtype())
