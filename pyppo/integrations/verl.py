"""Drop-in replacements for veRL 0.9.1's PPO math, computed with pyppo's ops.

Covered, each with veRL's exact signature, return types, output dtypes and masking conventions:

* ``verl.trainer.ppo.core_algos``: :func:`compute_gae_advantage_return` (also registered as
  ``ADV_ESTIMATOR_REGISTRY["gae"]``), :func:`kl_penalty`, :func:`kl_penalty_forward`,
  :func:`agg_loss`, :func:`compute_policy_loss` (deprecated in veRL, warns the same way),
  :func:`compute_policy_loss_vanilla` (``POLICY_LOSS_REGISTRY["vanilla"]``),
  :func:`compute_value_loss`;
* ``verl.utils.torch_functional``: :func:`masked_mean`, :func:`masked_var`,
  :func:`masked_whiten`, :func:`logprobs_from_logits`, :func:`entropy_from_logits`,
  :func:`entropy_from_logits_with_chunking`.

Usage: ``import pyppo.integrations.verl as pv; pv.patch()`` (or ``with pv.patched(): ...``), or
call the functions here directly; this module does not import veRL.

Half-precision inputs are computed in float32 (float64 when veRL's result is float64) and the
result is cast to the dtype veRL returns, so bf16/fp16 results are at least as close to a float64
computation as veRL's own. Masks must be bool or hold only 0 and 1 (veRL would also accept
fractional weights); any other value is a ``ValueError`` naming the argument. Every deliberate
difference from veRL is listed in ``docs/integrations.md``.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from contextlib import AbstractContextManager
from typing import Any, Optional

import torch

from pyppo.ops import gae as _gae
from pyppo.ops import gather_logprobs as _gather_logprobs
from pyppo.ops import kl_penalty as _kl_penalty
from pyppo.ops import masked_mean as _masked_mean
from pyppo.ops import masked_var as _masked_var

from . import _patching
from ._logits import positive_index
from ._patching import Patch

__all__ = [
    "compute_gae_advantage_return",
    "kl_penalty",
    "kl_penalty_forward",
    "agg_loss",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "logprobs_from_logits",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "PEER",
    "patch",
    "unpatch",
    "patched",
]

_CORE = "verl.trainer.ppo.core_algos"
_TF = "verl.utils.torch_functional"

# veRL's names of the KL estimators (kl_penalty_forward) and pyppo's estimator for each.
_KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
# veRL clamps its k3 estimate to [-10, 10] (and ref - logprob to ±20 before the exp, which that
# clamp makes redundant: |d| > 20 puts k3 above 10).
_K3_CLAMP = (-10.0, 10.0)
_LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


# ----------------------------------------------------------------------------------------------
# dtype bookkeeping: the dtype veRL's eager expression would produce, worked out from torch's
# type promotion rules rather than by running it.


def _promote(*dtypes: torch.dtype) -> torch.dtype:
    return functools.reduce(torch.promote_types, dtypes)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype pyppo computes in for a result of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mean_dtype(values_dtype: torch.dtype, mask_dtype: torch.dtype) -> torch.dtype:
    # veRL: (where(mask.bool(), values, 0.0) * mask).sum() / (mask.sum() + 1e-8). The numerator
    # promotes values with the mask; an integer/bool mask's count plus 1e-8 is the default float
    # dtype, and the division promotes both (they have the same number of dimensions).
    v = values_dtype if values_dtype.is_floating_point else torch.get_default_dtype()
    den = mask_dtype if mask_dtype.is_floating_point else torch.get_default_dtype()
    return _promote(v, mask_dtype, den)


def _scalar_result_dtype(dtype: torch.dtype, *operands: Any) -> torch.dtype:
    """dtype of ``x / a * b ...`` for a 0-d tensor ``x`` of ``dtype`` and Python or tensor operands."""
    for op in operands:
        if isinstance(op, torch.Tensor):
            dtype = torch.result_type(torch.empty((), dtype=dtype), op)
    return dtype


# ----------------------------------------------------------------------------------------------
# argument checks


def _tensor(fn: str, name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _float_tensor(fn: str, name: str, x: Any) -> torch.Tensor:
    _tensor(fn, name, x)
    if not x.is_floating_point():
        raise ValueError(f"{fn}: {name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def _bool_mask(fn: str, name: str, mask: Any, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool tensor of ``like``'s shape. A non-bool mask is checked to hold only 0
    and 1 (one host sync; an integer mask in one ``aminmax`` pass) and converted once, so the
    pyppo ops below get a bool mask and skip their own check."""
    _tensor(fn, name, mask)
    if mask.shape != like.shape:
        raise ValueError(f"{fn}: {name} has shape {tuple(mask.shape)} but the values have shape {tuple(like.shape)}")
    if mask.device != like.device:
        raise ValueError(f"{fn}: {name} is on {mask.device} but the values are on {like.device}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{fn}: {name} must be bool or hold only 0 and 1, got dtype {mask.dtype}")
    if mask.numel():
        if mask.is_floating_point():
            ok = ((mask == 0) | (mask == 1)).all()
        else:
            # An integer is 0 or 1 iff it lies in [0, 1]: one pass instead of three.
            lo, hi = torch.aminmax(mask)
            ok = (lo >= 0) & (hi <= 1)
        if not bool(ok):
            raise ValueError(f"{fn}: {name} must be bool or hold only 0 and 1, got other values")
    return mask.bool()


def _count(m: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Number of set positions of the bool mask ``m`` (an int32 sum of bools is several times
    faster than the default int64 one on CPU)."""
    dtype = torch.int32 if m.numel() < 2**31 else torch.int64
    return m.sum(dtype=dtype) if dim is None else m.sum(dim, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# verl.utils.torch_functional


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
    tf = sys.modules.get(_TF)
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


# ----------------------------------------------------------------------------------------------
# verl.trainer.ppo.core_algos


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: torch.Tensor,
    lam: torch.Tensor,
):
    r"""GAE(γ, λ) advantages (whitened) and returns over the valid positions of each row.

    .. math::
        \delta_t = r_t + \gamma V_{t'} - V_t,\quad A_t = \delta_t + \gamma\lambda A_{t'},\quad R_t = A_t + V_t

    with ``t'`` the next valid position (Schulman et al. 2015, "High-Dimensional Continuous
    Control Using GAE", eq. 16): a masked position inside a row (a multi-turn observation token)
    neither adds a TD term nor breaks the chain. As in veRL, a masked position carries the
    advantage of the next valid position of its row (0 after the last one), its return is that
    advantage plus its own value, and the advantages are then whitened over the mask and written
    at **every** position (masked ones included).

    Args:
        token_level_rewards: ``[B, T]`` float.
        values: ``[B, T]`` float.
        response_mask: ``[B, T]`` 0/1 (int or float) or bool (veRL itself fails on bool with a
            ``RuntimeError``; pyppo accepts it).
        gamma, lam: floats (or 0-d tensors) in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, ``[B, T]``, in veRL's dtype ``promote(rewards, values, mask)``
        (bf16 inputs with an int mask give bf16). Computed in float32 (float64 for a float64
        result), whereas veRL runs its recursion in the output dtype; no gradient.

    Raises:
        ValueError: fewer than 2 valid positions in the whole batch (veRL: ``ValueError`` from
            its whitening); ``gamma``/``lam`` outside ``[0, 1]`` (veRL accepts any value);
            shapes that differ, a mask that is not bool / 0-1, non-float inputs.
        TypeError: a non-tensor argument.

    ``pyppo.ops.gae`` runs the scan (one pass per row instead of veRL's Python loop over ``T``),
    ``pyppo.ops.masked_mean``/``masked_var`` the whitening statistics; a suffix-min over positions
    fills the masked positions. Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.compute_gae_advantage_return``.
    """
    fn = "compute_gae_advantage_return"
    _float_tensor(fn, "token_level_rewards", token_level_rewards)
    _float_tensor(fn, "values", values)
    _tensor(fn, "response_mask", response_mask)
    out_dtype = _promote(token_level_rewards.dtype, values.dtype, response_mask.dtype)
    acc = _acc(out_dtype)
    rewards, vals = token_level_rewards, values
    if acc == torch.float64:
        # pyppo.gae computes in the rewards' precision; veRL computes in the promoted dtype.
        rewards, vals = rewards.to(acc), vals.to(acc)
    m = _bool_mask(fn, "response_mask", response_mask, token_level_rewards)
    with torch.no_grad():
        adv, _ = _gae(rewards, vals, m, gamma=float(gamma), lam=float(lam))
        B, T = adv.shape
        # Each position takes the advantage of the first valid position at or after it (T: none,
        # advantage 0): veRL's carry through masked positions, without a loop over T.
        pos = torch.arange(T, device=adv.device)
        nxt = torch.where(m, pos, T).flip(-1).cummin(-1).values.flip(-1)
        carried = torch.cat([adv, adv.new_zeros(B, 1)], dim=1).gather(1, nxt)
        returns = (carried + vals.detach().to(acc)).to(out_dtype)
        try:
            mean, var = _mean_var(fn, adv, m, response_mask.dtype, True)
        except ValueError:
            n = int(m.sum())
            raise ValueError(
                f"{fn}: response_mask selects {n} position(s) in the whole batch; whitening the "
                "advantages needs at least 2 (veRL raises ValueError here too)"
            ) from None
        whitened = (carried - mean) * torch.rsqrt(var + 1e-8)
    return whitened.to(out_dtype), returns


def kl_penalty_forward(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """Per-token KL(π ‖ π_ref) estimate from the sampled tokens' log-probs, ``d = logprob − ref``.

    Estimators (J. Schulman, "Approximating KL Divergence", 2020): ``"kl"``/``"k1"`` ``d``;
    ``"abs"`` ``|d|``; ``"mse"``/``"k2"`` ``½d²``; ``"low_var_kl"``/``"k3"``
    ``exp(−d) + d − 1`` clamped to ``[−10, 10]`` (veRL also clamps ``−d`` to ±20 before the exp;
    wherever that clamp acts, the result clamp acts too, so value and gradient are veRL's).

    Args:
        logprob, ref_logprob: float tensors of one shape.
        kl_penalty: the estimator name.

    Returns:
        Tensor of ``logprob``'s shape in ``promote(logprob, ref_logprob)`` (veRL's dtype),
        computed in float32 (float64 for a float64 result); veRL computes ``k3`` in the input
        dtype, which in bf16 cancels away small KLs. Differentiable w.r.t. both inputs.

    Raises:
        NotImplementedError: ``"full"`` and unknown names (as veRL), with a message listing the
            accepted names. ValueError: shape mismatch, non-float inputs. TypeError: a non-tensor
            input or a non-string name.

    Computed by ``pyppo.ops.kl_penalty`` (one fused elementwise kernel and its backward).
    Matches veRL 0.9.1 ``verl.trainer.ppo.core_algos.kl_penalty_forward``.
    """
    return _kl_forward("kl_penalty_forward", logprob, ref_logprob, kl_penalty)


def _kl_check(fn: str, logprob, ref_logprob, name) -> None:
    _tensor(fn, "logprob", logprob)
    _tensor(fn, "ref_logprob", ref_logprob)
    if not isinstance(name, str):
        raise TypeError(f"{fn}: kl_penalty must be an estimator name (str), got {type(name).__name__}")


def _kl_inputs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    out_dtype = torch.promote_types(logprob.dtype, ref_logprob.dtype)
    if _acc(out_dtype) == torch.float64:
        # The op computes in logprob's precision; veRL computes in the promoted dtype.
        logprob, ref_logprob = logprob.to(torch.float64), ref_logprob.to(torch.float64)
    return logprob, ref_logprob, out_dtype


def _kl_forward(fn: str, logprob, ref_logprob, name) -> torch.Tensor:
    _kl_check(fn, logprob, ref_logprob, name)
    est = _KL_ESTIMATORS.get(name)
    if est is None:
        if name == "full":
            raise NotImplementedError(
                f"{fn}: kl_penalty='full' needs the full-vocabulary logits and is not implemented "
                "(veRL 0.9.1 raises NotImplementedError too)"
            )
        raise NotImplementedError(
            f"{fn}: unknown kl_penalty {name!r}; veRL 0.9.1 implements "
            + ", ".join(repr(k) for k in _KL_ESTIMATORS)
            + ("" if fn == "kl_penalty_forward" else ", each also with a '+' suffix (straight-through k2 gradient)")
        )
    lp, ref, out_dtype = _kl_inputs(logprob, ref_logprob)
    return _kl_penalty(lp, ref, estimator=est, clamp=_K3_CLAMP if est == "k3" else None).to(out_dtype)


def kl_penalty(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """Per-token KL estimate; a ``"+"`` suffix gives the estimator's value with ``k2``'s gradient.

    ``kl_penalty`` is one of :func:`kl_penalty_forward`'s names, optionally followed by ``"+"``
    (``"k3+"``, ``"low_var_kl+"``, ``"k1+"``, ...): the value of the named estimator and the
    gradient of ``k2 = ½d²`` (straight-through), the unbiased gradient of KL (veRL's docstring;
    Schulman 2020). ``"k2+"``/``"mse+"`` are ``k2``.

    Returns:
        Tensor of ``logprob``'s shape in ``promote(logprob, ref_logprob)``, differentiable.

    Raises:
        NotImplementedError: ``"full"``, ``"full+"`` and unknown names, as veRL.
        ValueError / TypeError: as :func:`kl_penalty_forward`.

    Computed by ``pyppo.ops.kl_penalty`` (the ``"+"`` variants: the estimator without gradient
    plus ``k2 − k2.detach()``, both from the op). Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.kl_penalty``.
    """
    fn = "kl_penalty"
    _kl_check(fn, logprob, ref_logprob, kl_penalty)
    if not kl_penalty.endswith("+"):
        return _kl_forward(fn, logprob, ref_logprob, kl_penalty)
    base = kl_penalty[:-1]
    if _KL_ESTIMATORS.get(base) == "k2":
        return _kl_forward(fn, logprob, ref_logprob, base)
    with torch.no_grad():
        forward = _kl_forward(fn, logprob, ref_logprob, base)
    lp, ref, out_dtype = _kl_inputs(logprob, ref_logprob)
    k2 = _kl_penalty(lp, ref, estimator="k2").to(out_dtype)
    return k2 - k2.detach() + forward


def _agg_impl(
    loss_mat: torch.Tensor,
    loss_dtype: torch.dtype,
    m: torch.Tensor,
    mask_dtype: torch.dtype,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
) -> torch.Tensor:
    """agg_loss on a validated bool mask ``m``. ``loss_dtype`` is the dtype veRL's loss matrix
    would have (the losses compute theirs in float32), ``mask_dtype`` the caller's mask dtype:
    both take part in veRL's type promotion."""
    if loss_agg_mode not in _LOSS_AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    # veRL's per-token product loss_mat * loss_mask: its dtype is that of every sum below.
    s_dtype = _promote(loss_dtype, mask_dtype)
    shape = loss_mat.shape
    # The op reads half precision as it is; a float64 result needs float64 terms.
    lm = loss_mat.to(torch.float64) if s_dtype == torch.float64 else loss_mat
    if lm.dim() != 2:
        lm, m = lm.reshape(-1, shape[-1]), m.reshape(-1, shape[-1])

    if loss_agg_mode in ("token-mean", "token-sum"):
        n = _count(m)
        # Σ L over the mask = masked mean · count; pyppo's mean sums in float64, and an empty
        # mask gives 0 (so 0 / 0 = NaN below for token-mean, as in veRL).
        total = _mean_impl(lm, m, None) * n
        if loss_agg_mode == "token-sum":
            return (total * dp_size).to(_scalar_result_dtype(s_dtype, dp_size))
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = n  # veRL: loss_mask.sum()
        loss = total / batch_num_tokens * dp_size
        return loss.to(_scalar_result_dtype(s_dtype, batch_num_tokens, dp_size))

    tokens_per_row = _count(m, -1)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        # veRL counts the sequences with a valid token as a float32 tensor.
        global_batch_size = (tokens_per_row > 0).sum(dtype=torch.float32)
    if loss_agg_mode == "seq-mean-token-mean":
        # veRL's formula, each row's sum over (its count + 1e-8) in the count's float dtype (the
        # epsilon keeps an empty row at 0 and vanishes below float64), with where() for veRL's
        # multiply by the mask and sums accumulated in float32 at least.
        den_dtype = mask_dtype if mask_dtype.is_floating_point else torch.get_default_dtype()
        row_sum = torch.where(m, lm, 0.0).sum(dim=-1, dtype=_acc(s_dtype))
        # An empty row is dropped with where(), as veRL's masked_sum over the sequences does: in
        # float16 the epsilon underflows and its 0 / 0 would be NaN.
        row_mean = row_sum / (tokens_per_row.to(den_dtype) + 1e-8)
        total = torch.where(tokens_per_row > 0, row_mean, 0.0).sum()
        sum_dtype = _promote(s_dtype, den_dtype, torch.float32)
    else:
        # Σ over the sequences of their token sums: the token sum of the whole batch.
        total = _mean_impl(lm, m, None) * tokens_per_row.sum()
        sum_dtype = _promote(s_dtype, torch.float32)
    loss = total / global_batch_size * dp_size
    out_dtype = _scalar_result_dtype(sum_dtype, global_batch_size, dp_size)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        # veRL divides in place, which keeps the dtype.
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else shape[-1])
    return loss.to(out_dtype)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
):
    """Reduce a per-token loss matrix to the scalar veRL backpropagates, invariant to data parallelism.

    With ``m`` the mask, ``Σ`` over valid tokens, ``S`` the rows with a valid token:

    * ``"token-mean"``: ``Σ L / batch_num_tokens · dp_size`` (default ``batch_num_tokens``: the
      micro-batch's valid-token count);
    * ``"token-sum"``: ``Σ L · dp_size``;
    * ``"seq-mean-token-sum"``: ``Σ L / global_batch_size · dp_size`` (default: ``|S|``);
    * ``"seq-mean-token-sum-norm"``: the same over ``loss_scale_factor`` (default ``T``), Dr. GRPO
      (Liu et al. 2025);
    * ``"seq-mean-token-mean"``: ``Σ_b (Σ_t L / (n_b + 1e-8)) / global_batch_size · dp_size``.

    Args:
        loss_mat: ``[B, T]`` (or ``[*, T]``) float. Values at masked positions are ignored, even
            NaN/inf (veRL's ``seq-mean-*`` modes multiply them by 0, which lets a NaN through).
        loss_mask: bool or 0/1 of ``loss_mat``'s shape.
        loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: as veRL
            (``batch_num_tokens`` / ``global_batch_size`` may be Python numbers or tensors).

    Returns:
        0-d tensor in veRL's dtype (the token modes: ``promote(loss_mat, loss_mask)``; the
        ``seq-mean-*`` modes at least float32), accumulated in float32 (float64 for float64);
        differentiable w.r.t. ``loss_mat``. An empty mask gives NaN in the mean modes (``0/0``),
        as in veRL.

    Raises:
        ValueError: unknown mode (veRL's message), ``dp_size > 1`` without the global count the
            mode needs (veRL's messages), a mask that is not bool / 0-1 or of another shape,
            non-float ``loss_mat``. TypeError: non-tensor inputs.

    Token sums by ``pyppo.ops.masked_mean`` (float64 sums, any input dtype read in place) times
    the count; veRL's normalisers applied to them in plain torch. ``"seq-mean-token-mean"`` is
    veRL's formula in plain torch (row sums with ``where`` instead of veRL's multiply by the
    mask, accumulated in float32 at least), which reproduces its per-row ``+ 1e-8`` exactly.
    Matches veRL 0.9.1 ``verl.trainer.ppo.core_algos.agg_loss``.
    """
    fn = "agg_loss"
    _float_tensor(fn, "loss_mat", loss_mat)
    if loss_mat.dim() == 0:
        raise ValueError(f"{fn}: loss_mat must have a token dimension, got a 0-d tensor")
    m = _bool_mask(fn, "loss_mask", loss_mask, loss_mat)
    return _agg_impl(
        loss_mat, loss_mat.dtype, m, loss_mask.dtype, loss_agg_mode,
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor,
    )


def _tie_weight(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Share of the gradient of ``minimum(a, b)`` that reaches ``a``: 1 where ``a < b``, ½ at a tie
    (torch splits a tie evenly), 0 where ``a > b``."""
    return torch.where(a < b, 1.0, torch.where(a == b, 0.5, 0.0)).to(a.dtype)


class _DualClipTokenLoss(torch.autograd.Function):
    """veRL's per-token dual-clip PPO loss, with torch's derivative of veRL's expression computed
    in the forward: the backward is one multiply instead of autograd's pass through the ten
    elementwise ops, and only that one tensor is kept for it.

    Schulman et al. 2017, eq. 7 (negated into a loss); dual clip: Ye et al. 2020, eq. 5. The ±20
    clamp of the log-ratio is veRL's (and ``pyppo.ops.ppo_policy_loss``'s). Returns the loss and
    the ``[3, *]`` statistics (clipped, dual bound active, −log-ratio), which have no gradient."""

    @staticmethod
    def forward(ctx, log_prob, old_log_prob, advantages, low, high, c, acc):
        raw = log_prob.to(acc) - old_log_prob.to(acc)
        log_ratio = raw.clamp(-20.0, 20.0)
        ratio = log_ratio.exp()
        neg_adv = -advantages.to(acc)
        pg1 = neg_adv * ratio
        pg2 = neg_adv * ratio.clamp(1 - low, 1 + high)
        clip1 = torch.maximum(pg1, pg2)
        pg3 = neg_adv * c
        negative = neg_adv > 0
        loss = torch.where(negative, torch.minimum(pg3, clip1), clip1)
        need_lp, need_adv = ctx.needs_input_grad[0] or ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        saved = []
        if need_lp or need_adv:
            dual = _tie_weight(clip1, pg3)  # share of min(pg3, clip1) that reaches clip1
        if need_lp:
            # d pg1 / d log_prob = pg1 (d ratio = ratio). maximum(pg1, pg2) passes it where pg1 is
            # the larger; at a tie the ratio is inside the clip range, where pg2 has the same
            # derivative, so the two halves add up to all of it. clamp passes |raw| <= 20.
            coef = torch.where((pg1 >= pg2) & (raw >= -20.0) & (raw <= 20.0), pg1, 0.0)
            saved.append(torch.where(negative, coef * dual, coef))
        if need_adv:
            # Each term is linear in A: d/dA is minus its ratio factor, ties split evenly.
            clipped_ratio = ratio.clamp(1 - low, 1 + high)
            d1 = -torch.where(pg1 > pg2, ratio, torch.where(pg1 < pg2, clipped_ratio, 0.5 * (ratio + clipped_ratio)))
            saved.append(torch.where(negative, dual * d1 - (1 - dual) * c, d1))
        ctx.save_for_backward(*saved)
        ctx.need = (need_lp, need_adv)
        ctx.dtypes = (log_prob.dtype, old_log_prob.dtype, advantages.dtype)
        stats = torch.stack([(pg2 > pg1).to(acc), ((clip1 > pg3) & negative).to(acc), -log_ratio])
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        saved = list(ctx.saved_tensors)
        grad_lp = grad_old = grad_adv = None
        if ctx.need[0]:
            grad = grad_loss * saved.pop(0)
            grad_lp = grad.to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
            grad_old = (-grad).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        if ctx.need[1]:
            grad_adv = (grad_loss * saved.pop(0)).to(ctx.dtypes[2])
        return grad_lp, grad_old, grad_adv, None, None, None, None


class _ClippedValueTokenLoss(torch.autograd.Function):
    """veRL's per-token clipped value loss ``max((V − R)², (clip(V, V_old ± ε) − R)²)`` with its
    derivatives computed in the forward (one multiply per input in the backward). Returns the
    loss and the clipped-error-is-larger indicator (no gradient)."""

    @staticmethod
    def forward(ctx, vpreds, returns, values, eps, acc):
        v, ret, v_old = vpreds.to(acc), returns.to(acc), values.to(acc)
        upper, lower = v_old + eps, v_old - eps
        # veRL's clip_by_value: max(min(V, V_old + ε), V_old − ε).
        below_upper = torch.minimum(v, upper)
        clipped = torch.maximum(below_upper, lower)
        e1, e2 = v - ret, clipped - ret
        vf1, vf2 = e1.square(), e2.square()
        saved = []
        if any(ctx.needs_input_grad[:3]):
            # torch's derivatives of the expression, ties split evenly as torch does.
            to_upper = _tie_weight(v, upper)  # share of min(V, V_old + ε) that reaches V
            to_below = _tie_weight(-below_upper, -lower)  # share of max(·, V_old − ε) reaching min(·)
            share1 = torch.where(vf1 > vf2, 1.0, torch.where(vf1 < vf2, 0.0, 0.5)).to(acc)  # of max(vf1, vf2)
            g1, g2 = 2 * share1 * e1, 2 * (1 - share1) * e2
            if ctx.needs_input_grad[0]:
                saved.append(g1 + g2 * to_below * to_upper)
            if ctx.needs_input_grad[1]:
                saved.append(-(g1 + g2))
            if ctx.needs_input_grad[2]:
                saved.append(g2 * (to_below * (1 - to_upper) + (1 - to_below)))
        ctx.save_for_backward(*saved)
        ctx.dtypes = (vpreds.dtype, returns.dtype, values.dtype)
        clipped_larger = vf2 > vf1
        ctx.mark_non_differentiable(clipped_larger)
        return torch.maximum(vf1, vf2), clipped_larger

    @staticmethod
    def backward(ctx, grad_loss, grad_clipped):
        saved = list(ctx.saved_tensors)
        grads = [
            (grad_loss * saved.pop(0)).to(dtype) if need else None
            for need, dtype in zip(ctx.needs_input_grad[:3], ctx.dtypes)
        ]
        return (*grads, None, None)




def _policy_terms(fn, old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_ratio_c):
    """veRL's dual-clip PPO per-token loss and its three statistics, in float32 (float64)."""
    if not clip_ratio_c > 1.0:
        raise AssertionError(
            "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
            + f" but get the value: {clip_ratio_c}."
        )
    if cliprange_low is None or cliprange_high is None:
        raise TypeError(f"{fn}: the clip range is None; give cliprange (or cliprange_low and cliprange_high)")
    for name, t in (("old_log_prob", old_log_prob), ("log_prob", log_prob), ("advantages", advantages)):
        _float_tensor(fn, name, t)
        if t.shape != log_prob.shape:
            raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)} but log_prob has shape {tuple(log_prob.shape)}")
    m = _bool_mask(fn, "response_mask", response_mask, log_prob)
    loss_dtype = _promote(old_log_prob.dtype, log_prob.dtype, advantages.dtype)
    acc = _acc(loss_dtype)

    pg_losses, stats = _DualClipTokenLoss.apply(
        log_prob, old_log_prob, advantages, float(cliprange_low), float(cliprange_high), float(clip_ratio_c), acc
    )
    with torch.no_grad():
        # One pyppo.ops.masked_mean over the three statistics; an empty mask gives veRL's zeros.
        stats = _mean_impl(stats.reshape(3, -1), m.reshape(1, -1).expand(3, -1), 1, response_mask.dtype)
    kl_dtype = _mean_dtype(_promote(old_log_prob.dtype, log_prob.dtype), response_mask.dtype)
    frac_dtype = _mean_dtype(torch.float32, response_mask.dtype)
    return pg_losses, loss_dtype, m, stats, kl_dtype, frac_dtype


_DEPRECATION = (
    "Warning: Function 'verl.trainer.ppo.core_algos.compute_policy_loss' is deprecated. "
    "Please use 'verl.trainer.ppo.core_algos.compute_policy_loss_vanilla' instead."
)


def compute_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    cliprange=None,
    cliprange_low=None,
    cliprange_high=None,
    clip_ratio_c=3.0,
    loss_agg_mode: str = "token-mean",
):
    """Dual-clip PPO policy loss (deprecated in veRL; warns with veRL's ``FutureWarning``).

    Per token, ``r = exp(clamp(log_prob − old_log_prob, ±20))``::

        L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))          (A ≥ 0)
        L = min(max(...), −A·clip_ratio_c)                        (A < 0: the dual clip, always on)

    (Schulman et al. 2017, eq. 7; Ye et al. 2020, eq. 5), reduced with :func:`agg_loss`.

    Args:
        old_log_prob, log_prob, advantages: ``[B, T]`` float; differentiable w.r.t. each, with
            the derivative torch's autograd takes of veRL's expression (ties split evenly).
        response_mask: ``[B, T]`` bool or 0/1.
        cliprange, cliprange_low, cliprange_high: ε (``low``/``high`` default to ``cliprange``).
        clip_ratio_c: dual-clip bound, ``> 1``.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, 0-d tensors in veRL's dtypes:
        ``pg_loss`` as :func:`agg_loss` of ``promote(old, new, advantages)``, ``ppo_kl`` (mean of
        ``old − new``, clamped) as :func:`masked_mean` of ``promote(old, new)``, the fractions
        float32. The per-token loss is computed in float32 (float64 for float64 inputs).

    Raises:
        AssertionError: ``clip_ratio_c <= 1`` (veRL's assert and message). TypeError: no clip
            range given (veRL fails on ``1 - None``). ValueError: shape mismatch, a bad mask,
            unknown ``loss_agg_mode``.

    The per-token loss and its derivative in one forward (the backward is one multiply), the
    statistics by one ``pyppo.ops.masked_mean``, the aggregation as :func:`agg_loss`. Matches
    veRL 0.9.1 ``verl.trainer.ppo.core_algos.compute_policy_loss``.
    """
    warnings.warn(_DEPRECATION, category=FutureWarning, stacklevel=2)
    low = cliprange_low if cliprange_low is not None else cliprange
    high = cliprange_high if cliprange_high is not None else cliprange
    pg_losses, loss_dtype, m, stats, kl_dtype, frac_dtype = _policy_terms(
        "compute_policy_loss", old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c
    )
    pg_loss = _agg_impl(pg_losses, loss_dtype, m, response_mask.dtype, loss_agg_mode)
    return pg_loss, stats[0].to(frac_dtype), stats[2].to(kl_dtype), stats[1].to(frac_dtype)


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """veRL's default ("vanilla") PPO policy loss: :func:`compute_policy_loss`'s dual-clip loss
    with the clip ranges from ``config``, optional rollout-correction weights, and the
    global-batch normalisers of ``config.global_batch_info``.

    Args:
        old_log_prob, log_prob, advantages: ``[B, T]`` float; differentiable as in
            :func:`compute_policy_loss`.
        response_mask: ``[B, T]`` bool or 0/1.
        loss_agg_mode: see :func:`agg_loss`.
        config: veRL's ``ActorConfig`` or a ``DictConfig`` (duck-typed: ``clip_ratio``,
            ``clip_ratio_low``, ``clip_ratio_high``, ``get("clip_ratio_c", 3.0)``,
            ``global_batch_info``, a dict of :func:`agg_loss` keyword arguments).
        rollout_is_weights: optional tensor broadcastable to ``[B, T]`` multiplying the
            per-token loss before aggregation (truncated IS / IcePop weights, zeros included);
            the statistics ignore it, as in veRL.

    Returns:
        ``(pg_loss, metrics)``: ``pg_loss`` 0-d in veRL's dtype (see :func:`agg_loss`);
        ``metrics`` ``{"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}`` of
        Python floats (one host sync for the three; veRL syncs three times).

    Raises:
        AssertionError: ``config`` is None, an ``AlgoConfig``, or ``clip_ratio_c <= 1`` (veRL's
            asserts). ValueError: shape mismatch, a bad mask, unknown mode, a missing global
            count with ``dp_size > 1``. TypeError: unknown ``global_batch_info`` keys.

    The per-token loss and its derivative in one forward in float32 (float64 for float64
    inputs; the backward is one multiply), its three statistics by one
    ``pyppo.ops.masked_mean``, the aggregation as :func:`agg_loss`. pyppo's
    ``ppo_policy_loss`` has the same per-token formula (``dual_clip = clip_ratio_c``) but
    aggregates before veRL's ``rollout_is_weights`` can be applied and reports ``k3`` rather than
    veRL's ``k1`` ``ppo_kl``, so the adapter writes the formula out. Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.compute_policy_loss_vanilla``.
    """
    fn = "compute_policy_loss_vanilla"
    if config is None:
        raise AssertionError(f"{fn}: config is required (veRL asserts config is not None)")
    if type(config).__name__ == "AlgoConfig":
        raise AssertionError(f"{fn}: config must be the actor config, not an AlgoConfig")
    clip_ratio = config.clip_ratio
    clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    pg_losses, loss_dtype, m, stats, _, _ = _policy_terms(
        fn, old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    if rollout_is_weights is not None:
        _tensor(fn, "rollout_is_weights", rollout_is_weights)
        loss_dtype = torch.promote_types(loss_dtype, rollout_is_weights.dtype)
        pg_losses = pg_losses * rollout_is_weights.to(_acc(loss_dtype))
    pg_loss = _agg_impl(pg_losses, loss_dtype, m, response_mask.dtype, loss_agg_mode, **config.global_batch_info)
    clipfrac, clipfrac_lower, ppo_kl = stats.tolist()
    return pg_loss, {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": clipfrac_lower}


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
):
    """Clipped value loss ``½ · agg(max((V − R)², (clip(V, V_old ± ε) − R)²))``.

    The PPO2 / ``lm-human-preferences`` value clipping ("The 37 Implementation Details of PPO",
    detail 9); ``clip`` is veRL's ``clip_by_value``, ``max(min(V, V_old + ε), V_old − ε)``.

    Args:
        vpreds: ``[B, T]`` float, current predictions.
        returns: ``[B, T]`` float targets. values: ``[B, T]`` float, old (rollout) values.
        (Differentiable w.r.t. all three, with torch's derivative of veRL's expression.)
        response_mask: ``[B, T]`` bool or 0/1.
        cliprange_value: ε (a number or a tensor broadcastable to ``[B, T]``).
        loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: as
            :func:`agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``: 0-d tensors, ``vf_loss`` in :func:`agg_loss`'s dtype for
        ``promote(vpreds, returns, values)``, ``vf_clipfrac`` (fraction where the clipped error is
        strictly larger) float32 (as :func:`masked_mean` of a float32 tensor). Per-token terms in
        float32 (float64 for float64 inputs).

    Raises:
        ValueError: shape mismatch, a bad mask, unknown mode. TypeError: ``cliprange_value`` is
            None (veRL: ``TypeError`` from ``values - None``).

    The per-token loss and its derivatives in one forward (the backward is one multiply),
    ``vf_clipfrac`` by ``pyppo.ops.masked_mean``, the aggregation as :func:`agg_loss`. pyppo's
    ``ppo_value_loss`` clips as ``V_old + clip(V − V_old, ±ε)``, which differs from ``V`` by a
    rounding where nothing is clipped and so can count such a token as clipped; the adapter keeps
    veRL's form. Matches veRL 0.9.1 ``verl.trainer.ppo.core_algos.compute_value_loss``.
    """
    fn = "compute_value_loss"
    for name, t in (("vpreds", vpreds), ("returns", returns), ("values", values)):
        _float_tensor(fn, name, t)
        if t.shape != vpreds.shape:
            raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)} but vpreds has shape {tuple(vpreds.shape)}")
    if cliprange_value is None:
        raise TypeError(f"{fn}: cliprange_value must be a number, got None")
    m = _bool_mask(fn, "response_mask", response_mask, vpreds)
    loss_dtype = _promote(vpreds.dtype, returns.dtype, values.dtype)
    acc = _acc(loss_dtype)
    if isinstance(cliprange_value, torch.Tensor):
        eps = cliprange_value.to(acc)
    else:
        eps = float(cliprange_value)
    token_loss, clipped_larger = _ClippedValueTokenLoss.apply(vpreds, returns, values, eps, acc)
    vf_loss = 0.5 * _agg_impl(
        token_loss, loss_dtype, m, response_mask.dtype, loss_agg_mode,
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor,
    )
    with torch.no_grad():
        vf_clipfrac = _mean_impl(clipped_larger.to(acc), m, None, response_mask.dtype)
    return vf_loss, vf_clipfrac.to(_mean_dtype(torch.float32, response_mask.dtype))


# ----------------------------------------------------------------------------------------------
# patching

PEER = _patching.Peer(
    name="verl",
    distribution="verl",
    package="verl",
    versions=("0.9.1",),
    targets=(
        _patching.Target(_CORE, "compute_gae_advantage_return", compute_gae_advantage_return),
        _patching.Target(_CORE, "kl_penalty", kl_penalty),
        _patching.Target(_CORE, "kl_penalty_forward", kl_penalty_forward),
        _patching.Target(_CORE, "agg_loss", agg_loss),
        _patching.Target(_CORE, "compute_policy_loss", compute_policy_loss),
        _patching.Target(_CORE, "compute_policy_loss_vanilla", compute_policy_loss_vanilla),
        _patching.Target(_CORE, "compute_value_loss", compute_value_loss),
        _patching.Target(_TF, "masked_mean", masked_mean),
        _patching.Target(_TF, "masked_var", masked_var),
        _patching.Target(_TF, "masked_whiten", masked_whiten),
        _patching.Target(_TF, "logprobs_from_logits", logprobs_from_logits),
        _patching.Target(_TF, "entropy_from_logits", entropy_from_logits),
        _patching.Target(_TF, "entropy_from_logits_with_chunking", entropy_from_logits_with_chunking),
    ),
    import_help="veRL's modules import ray, tensordict and omegaconf; install veRL's dependencies.",
)


def patch(*, force: bool = False) -> Patch:
    """Replace veRL's functions listed in :data:`PEER` with this module's adapters, everywhere
    veRL's package refers to them (defining modules, modules that imported them by name,
    ``ADV_ESTIMATOR_REGISTRY["gae"]``, ``POLICY_LOSS_REGISTRY["vanilla"]``).

    Returns the :class:`~pyppo.integrations.Patch` (what was replaced; the active one if already
    patched). A veRL release other than 0.9.1 is warned about (``PeerVersionWarning``) and left
    unpatched unless ``force=True``. Raises ImportError when veRL is not installed or its modules
    fail to import.
    """
    return _patching.patch(PEER, force=force)


def unpatch() -> Patch | None:
    """Put veRL's originals back; returns the patch that was undone, or None if none was active."""
    return _patching.unpatch(PEER)


def patched(*, force: bool = False) -> AbstractContextManager[Patch]:
    """``with patched(): ...`` patches veRL for the block and restores the originals on exit."""
    return _patching.patched(PEER, force=force)
