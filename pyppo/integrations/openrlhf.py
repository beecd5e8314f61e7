"""Drop-in adapters for OpenRLHF 0.11.2's ``openrlhf.models.utils``, computed with pyppo's ops.

Patched: ``compute_approx_kl`` (``pyppo.ops.kl_penalty``), ``log_probs_from_logits`` and
``compute_entropy`` (``pyppo.ops.gather_logprobs``), ``masked_mean`` (``pyppo.ops.masked_mean``
for bool masks, the peer's formula otherwise) and ``compute_reward`` (plain torch, two passes
fewer than the peer's: see its docstring). ``masked_normalize`` is here with the peer's exact
formula for direct callers, but not patched (OpenRLHF 0.11.2 never calls it, and pyppo's
``masked_whiten`` is another statistic). Each adapter has the peer's signature, return types,
output dtypes and masking conventions;
:func:`group_rewards` is the group-relative baseline step that OpenRLHF writes inline in
``RemoteExperienceMaker.compute_advantages_and_returns`` (``rloo``, ``reinforce_baseline``,
``dr_grpo``, ``group_norm``, ``flash_reinforce``), computed with ``pyppo.ops.group_advantages``:
a pure function to call from that method, not patched (there is no peer function to replace);
``docs/integrations.md`` lists every place where plain torch around an op keeps the peer's
result, and the tolerances tested.

Usage: ``import pyppo.integrations.openrlhf as o; o.patch()`` (``o.unpatch()`` restores, or
``with o.patched(): ...``). ``openrlhf.models`` imports ``flash_attn`` at module level, so the
peer must be importable first: on a machine without CUDA call :func:`install_flash_attn_stub`
before importing OpenRLHF. This module never imports OpenRLHF: the adapters also work
called directly.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from pyppo.ops import group_advantages, kl_penalty
from pyppo.ops import masked_mean as _masked_mean

from . import _patching
from ._flash_attn_stub import install_flash_attn_stub
from ._logits import check_temperature, gather_raw, zero_labels
from ._patching import Patch

__all__ = [
    "KL_IS_WEIGHT_CLIP",
    "compute_approx_kl",
    "compute_reward",
    "log_probs_from_logits",
    "compute_entropy",
    "masked_mean",
    "masked_normalize",
    "GROUP_REWARD_ESTIMATORS",
    "group_rewards",
    "install_flash_attn_stub",
    "PEER",
    "patch",
    "unpatch",
    "patched",
]

# OpenRLHF 0.11.2's cap on the importance weight π_θ/π_θ_old of the unbiased-gradient KL.
KL_IS_WEIGHT_CLIP = 10.0

# OpenRLHF clips every estimator's value to this range, always.
_KL_CLAMP = (-10.0, 10.0)

_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _as_float32_input(x: torch.Tensor) -> torch.Tensor:
    # OpenRLHF computes in float32 (``.float()``); pyppo's ops read bf16/fp16 and accumulate in
    # float32 themselves, so only float64 (which they would keep in float64) and non-float
    # inputs need the cast.
    return x if x.dtype in _OP_DTYPES else x.float()


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    log_probs_old: Optional[torch.Tensor] = None,
    kl_estimator: str = "k1",
    unbiased_gradient: bool = False,
) -> torch.Tensor:
    r"""Per-token KL(π_θ ‖ π_ref) estimate, clipped to [−10, 10]. Matches OpenRLHF 0.11.2
    ``openrlhf.models.utils.compute_approx_kl``.

    With ``d = log_probs − log_probs_base`` (in float32; J. Schulman, "Approximating KL
    Divergence", 2020): ``k1 = d``, ``k2 = d²/2``, ``k3 = exp(−d) − 1 + d``, each clipped to
    ``[−10, 10]`` (zero gradient where the clip is active, as ``torch.clamp``).

    With ``unbiased_gradient=True`` the forward value is the same and the backward is that of
    ``w · d²/2`` (straight-through), ``w = min(exp(log_probs − log_probs_old), 10)`` detached
    (1 when ``log_probs_old`` is None): the importance-weighted reverse-KL gradient
    ``w · d · ∇log π_θ``. As in the peer the returned value is computed as
    ``value + s − s`` (``s`` the surrogate), so it carries the same rounding.

    Args:
        log_probs, log_probs_base: ``[*]`` log-probs of the sampled tokens under π_θ and π_ref,
            any float dtype (broadcastable, as in the peer).
        log_probs_old: ``[*]`` log-probs under the rollout policy, read only with
            ``unbiased_gradient``.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        unbiased_gradient: straight-through importance-weighted gradient, see above.

    Returns:
        ``[*]`` float32 whatever the input dtype (float64 in gives float32 out, as the peer's
        ``.float()``). Differentiable w.r.t. ``log_probs`` and ``log_probs_base``.

    Raises:
        ValueError: ``Unknown kl_estimator: ...`` for anything but k1/k2/k3 (pyppo's ``abs``
            is not an OpenRLHF estimator). RuntimeError: shapes that do not broadcast.

    Work: ``pyppo.ops.kl_penalty(..., clamp=(-10, 10))``, one pass. Deliberate difference:
    ``log_probs = log_probs_base = −inf`` gives 0 (the token is impossible under both
    policies) where the peer computes ``−inf − (−inf) = NaN``.
    """
    if kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"Unknown kl_estimator: {kl_estimator}")
    lp, base = _as_float32_input(log_probs), _as_float32_input(log_probs_base)
    if lp.dtype != base.dtype:
        lp, base = lp.float(), base.float()
    if lp.shape != base.shape:
        lp, base = torch.broadcast_tensors(lp, base)
    # k3's value saturates the upper clip for every d < -10, so pyppo's k3 with the clamp is
    # OpenRLHF's pre-exp clamp(min=-10) followed by the final clip, in value and gradient.
    value = kl_penalty(lp, base, estimator=kl_estimator, clamp=_KL_CLAMP)
    if not unbiased_gradient:
        return value

    if log_probs_old is None:
        w = 1.0
    else:
        w = (log_probs.float() - log_probs_old.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()
    grad_surrogate = w * kl_penalty(lp, base, estimator="k2")
    return value.detach() + grad_surrogate - grad_surrogate.detach()


def compute_reward(
    r: Union[torch.Tensor, float],
    kl_coef: float,
    kl: Union[torch.Tensor, list[torch.Tensor]],
    action_mask: Optional[torch.Tensor] = None,
    reward_clip_range: Tuple[float, float] = None,
) -> Union[torch.Tensor, list[torch.Tensor]]:
    r"""Per-token rewards ``−kl_coef · kl`` plus the (clipped) score at each row's last action
    position. Matches OpenRLHF 0.11.2 ``openrlhf.models.utils.compute_reward``.

    ``reward[b, t] = −β · kl[b, t] + [t = eos_b] · clamp(r[b], *reward_clip_range)``, with
    ``β = max(kl_coef, 0)`` and ``eos_b = T − 1 − argmax(fliplr(action_mask.long()))[b]``: the
    last position where ``action_mask.long()`` reaches its row maximum, so a row with no
    action position puts its score at ``T − 1``. (InstructGPT, Ouyang et al. 2022, eq. 2.)

    Args:
        r: ``[B]`` scores. kl: ``[B, T]`` per-token KL (any float dtype).
        action_mask: ``[B, T]`` bool/int/float (read through ``.long()``, as the peer does).
        reward_clip_range: optional ``(lo, hi)``.

    Returns:
        ``[B, T]`` of ``kl``'s dtype. The KL term is **not** masked: a masked position holds
        ``−β · kl`` there, exactly as in the peer. Differentiable w.r.t. ``r`` and ``kl``, as
        the peer.

    Raises: what the peer's torch ops raise (``action_mask=None`` is an AttributeError there
    and here).

    Plain torch, no pyppo op: the peer's reward is one multiply of the whole ``kl`` plus one
    scattered score per row. ``pyppo.ops.shape_rewards`` computes the KL itself and zeroes
    masked positions, and refuses a row without valid position and a negative ``kl_coef``; the
    peer does the opposite on all four, so wrapping the op would add passes to undo it. This
    version computes bit-for-bit the peer's values with two fewer ``[B, T]`` passes (no
    ``zeros_like`` and no extra add: the score is ``scatter_add``-ed onto ``−β · kl``).
    """
    if kl_coef <= 0.0:
        kl_coef = 0.0
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    if reward_clip_range:
        r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    reward = -kl_coef * kl
    # score + (-β·kl) is the peer's (-β·kl) + score: IEEE addition commutes, so the bits agree.
    return reward.scatter_add_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype))


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    r"""Log-probability of each label under ``softmax(logits / temperature)``. Matches OpenRLHF
    0.11.2 ``openrlhf.models.utils.log_probs_from_logits``.

    ``log π(y) = z_y − logsumexp(z)`` on ``z = logits / temperature``.

    **Side effect, as in the peer:** with ``temperature != 1`` the caller's ``logits`` are
    divided by it **in place** (``logits.div_(temperature)``) before anything else, so callers
    that read the logits afterwards (entropy) see the scaled ones. That ``div_`` is recorded by
    autograd; as in the peer, a leaf that requires grad cannot be divided in place (RuntimeError).

    Args:
        logits: ``[*, V]`` float32/float64/bfloat16/float16, any strides.
        labels: ``[*]`` int64 (or int32) token ids in ``[0, V)``.
        temperature: ``> 0``.

    Returns:
        ``[*]`` in ``logits``' dtype (the peer's bf16/fp16 path rounds its per-row
        ``log_softmax`` to the input dtype; pyppo accumulates in float32 and rounds once).
        Differentiable w.r.t. ``logits``.

    Raises:
        ValueError: a label outside ``[0, V)`` (the peer's ``torch.gather`` raises RuntimeError
            on CPU and asserts on CUDA), ``V = 0``, non-float logits; ``temperature`` not
            positive and finite (the peer divides by it silently), checked before ``logits``
            is modified.

    Work: ``pyppo.ops.gather_logprobs``, one pass over ``V`` with no ``[*, V]`` temporary
    (the peer's bf16/fp16 path loops over rows and materialises a softmax per row).
    """
    if temperature != 1.0:
        check_temperature("log_probs_from_logits", temperature)
        logits.div_(temperature)
    logprobs, _, _ = gather_raw("log_probs_from_logits", "labels", logits, labels, None, 1.0, False)
    return logprobs.to(logits.dtype)


def compute_entropy(logits: torch.Tensor):
    r"""Entropy of ``softmax(logits)`` over the last dimension. Matches OpenRLHF 0.11.2
    ``openrlhf.models.utils.compute_entropy`` (there ``@torch.compile``-d; this is a plain
    function with the same signature).

    ``H = logsumexp(z) − Σ_v softmax(z)_v z_v``.

    Args:
        logits: ``[*, V]`` float (already temperature-scaled by the caller, as in OpenRLHF's
            actor).

    Returns:
        ``[*]`` in ``logits``' dtype, differentiable w.r.t. ``logits``.

    Raises:
        ValueError: ``V = 0`` or non-float logits.

    Work: ``pyppo.ops.gather_logprobs(..., return_entropy=True)`` (one fused pass; the log-prob
    of a placeholder label comes for free). Deliberate difference: a ``−inf`` logit (a token
    with probability 0) contributes 0, where the peer's ``softmax · logits = 0 · (−inf)`` makes
    the row's entropy NaN.
    """
    _, entropy, _ = gather_raw("compute_entropy", "labels", logits, zero_labels(logits), None, 1.0, True)
    return entropy.to(logits.dtype)


def masked_mean(tensor: torch.Tensor, mask: Optional[torch.Tensor], dim: int = None) -> torch.Tensor:
    r"""Mean of ``tensor`` where ``mask`` is set, over ``dim`` (everything when None). Matches
    OpenRLHF 0.11.2 ``openrlhf.models.utils.masked_mean``: ``(tensor·mask).sum(dim) / mask.sum(dim)``.

    Args:
        tensor: ``[*]``; mask: broadcastable to it, bool/int/float (a float mask weights the
            mean, as in the peer), or None (``tensor.mean(dim)``). dim: int, tuple or None.

    Returns:
        ``tensor``'s shape without ``dim``, dtype ``torch.result_type(tensor, mask)``; an
        all-masked slice is NaN, as in the peer. Differentiable w.r.t. ``tensor`` (and a float
        ``mask``).

    A bool mask of ``tensor``'s shape (OpenRLHF's ``action_mask``) with an int or None ``dim``
    goes through ``pyppo.ops.masked_mean``: one pass, summed in float64 (the peer sums in the
    tensor's dtype, in bf16 for bf16), deterministic, and a NaN or inf at a masked position
    stays out of the mean (the peer's ``NaN·0`` propagates it). An all-masked slice, which the
    op refuses, falls back to the peer's formula and its NaN. Any other mask (weights, 0/1
    numbers, a broadcast shape) or a tuple ``dim`` is the peer's formula, bit for bit: on CPU
    that is faster than converting and validating a non-bool mask (measured in
    ``docs/integrations.md``).
    """
    if mask is None:
        return tensor.mean(dim=dim)
    if (
        isinstance(tensor, torch.Tensor)
        and isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and tensor.is_floating_point()
        and mask.shape == tensor.shape
        and mask.device == tensor.device
        and (dim is None or isinstance(dim, int))
        and tensor.dim() > 0
    ):
        try:
            return _masked_mean(tensor, mask, dim).to(tensor.dtype)
        except ValueError:
            pass  # an all-masked slice (or a bad dim): the peer's formula says what happens
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def masked_normalize(tensor: torch.Tensor, mask: torch.Tensor, dim: int = 1, eps: float = 1e-8) -> torch.Tensor:
    r"""Per-slice whitening along ``dim`` over the masked-in elements. Matches OpenRLHF 0.11.2
    ``openrlhf.models.utils.masked_normalize`` bit for bit.

    ``out = (x − μ)·mask / sqrt(max(σ², eps))`` with ``μ``, ``σ²`` the mean and **population**
    variance (``n``, not ``n − 1``) of each slice's masked-in elements; ``eps`` is a floor on
    the variance, not added to it. A slice with no masked-in element is all 0.

    Args:
        tensor: ``[*]`` float; mask: bool or 0/1 (weights are used as such) broadcastable to it.
        dim: int. eps: float.

    Returns:
        ``tensor``'s shape, dtype ``torch.result_type(tensor, mask)``, 0 at masked positions.
        Differentiable.

    Plain torch: pyppo's ``masked_whiten`` whitens over the whole batch with the Bessel-corrected
    variance plus ``eps``, a different statistic. OpenRLHF 0.11.2 itself never calls it. Not
    patched.
    """
    mask_sum = mask.sum(dim=dim, keepdim=True).clamp(min=1)
    mean = (tensor * mask).sum(dim=dim, keepdim=True) / mask_sum
    mean_centered = (tensor - mean) * mask
    var = (mean_centered**2).sum(dim=dim, keepdim=True) / mask_sum
    return mean_centered * var.clamp(min=eps).rsqrt()


# OpenRLHF 0.11.2's estimators that reshape the per-sample rewards against a baseline before the
# returns are computed; "gae" and "reinforce" leave them as they are.
GROUP_REWARD_ESTIMATORS = ("rloo", "reinforce_baseline", "dr_grpo", "group_norm", "flash_reinforce")
_UNSHAPED_ESTIMATORS = ("gae", "reinforce")
# OpenRLHF's group_norm divides by std + 1e-9.
_GROUP_NORM_EPS = 1e-9


def group_rewards(rewards: torch.Tensor, estimator: str) -> torch.Tensor:
    r"""The reward-shaping (baseline) step of OpenRLHF 0.11.2's
    ``RemoteExperienceMaker.compute_advantages_and_returns``, computed with
    ``pyppo.ops.group_advantages``.

    OpenRLHF gathers the samples' rewards in prompt order, reshapes them to
    ``[num_prompts, n_samples_per_prompt]`` (row ``k``: the ``n`` responses to prompt ``k``) and,
    depending on ``args.algo.advantage.estimator``, replaces each reward ``r_i`` of a row with
    mean ``m`` and unbiased std ``σ`` by:

    * ``"rloo"``: ``r_i − (Σ_j r_j − r_i) / (n − 1) = n/(n−1) · (r_i − m)`` (leave-one-out
      baseline; Kool et al. 2019, Ahmadian et al. 2024);
    * ``"reinforce_baseline"``, ``"dr_grpo"``: ``r_i − m`` (REINFORCE++-baseline, Hu et al. 2025;
      Dr. GRPO, Liu et al. 2025);
    * ``"group_norm"``: ``(r_i − m) / (σ + 1e-9)`` (GRPO, Shao et al. 2024);
    * ``"flash_reinforce"``: ``r_i`` minus the mean of the **whole batch** (one group);
    * ``"gae"``, ``"reinforce"``: unchanged (``rewards`` itself is returned).

    OpenRLHF then puts the shaped reward at each response's last action token
    (``compute_reward``) and computes returns, advantages and whitening from it; this function is
    only the step above, to replace OpenRLHF's ``if``/``elif`` chain::

        rewards = rewards.reshape(-1, args.rollout.n_samples_per_prompt)
        rewards = group_rewards(rewards, args.algo.advantage.estimator)   # the chain
        rewards = rewards.reshape(-1)[indices].split(exp_len)

    Args:
        rewards: ``[num_prompts, n_samples_per_prompt]`` float (OpenRLHF has promoted it to at
            least float32); one scalar reward per response, the responses to one prompt in one
            row.
        estimator: OpenRLHF's estimator name (above).

    Returns:
        ``rewards``' shape and dtype; computed in float64 and rounded once (OpenRLHF computes in
        the rewards' dtype). Not differentiable (OpenRLHF runs it under ``no_grad``).

    Edge cases: ``n = 1`` (one sample per prompt) gives 0 for ``reinforce_baseline`` and
    ``dr_grpo`` (``r − r``, as OpenRLHF), and so does a one-sample batch for
    ``flash_reinforce``. **Differences:** ``rloo`` and ``group_norm`` with ``n = 1`` raise
    ``ValueError`` (OpenRLHF divides by ``n − 1 = 0``, or takes the std of one sample, and every
    reward becomes NaN); a group whose rewards are all equal gets exactly 0 (OpenRLHF's float32
    mean can be an ulp off the equal rewards and its std is then of the order of that ulp, so
    ``group_norm`` gives rewards of order 1: eight rewards of 2.9 all become 0.93); a non-finite reward
    raises ``ValueError`` (OpenRLHF: NaN for its
    group, or for the batch with ``flash_reinforce``); an unknown estimator raises
    ``ValueError`` here (OpenRLHF leaves the rewards alone and raises later, when it computes the
    returns).

    Raises:
        ValueError: see above; ``rewards`` not a 2-D float tensor.

    Not patched into OpenRLHF: the step is inline in the method (no peer function to replace),
    and replacing the whole method would mean copying OpenRLHF's length penalties, KL reward,
    returns and whitening around it. ``docs/integrations.md`` shows where to call it.
    """
    if estimator in _UNSHAPED_ESTIMATORS:
        return rewards
    if estimator not in GROUP_REWARD_ESTIMATORS:
        raise ValueError(
            f"group_rewards: unknown estimator {estimator!r}; OpenRLHF 0.11.2 shapes the rewards for "
            + ", ".join(repr(e) for e in GROUP_REWARD_ESTIMATORS)
            + " and leaves them unchanged for "
            + ", ".join(repr(e) for e in _UNSHAPED_ESTIMATORS)
        )
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2 or not rewards.is_floating_point():
        got = (
            f"shape {tuple(rewards.shape)}, dtype {rewards.dtype}"
            if isinstance(rewards, torch.Tensor)
            else type(rewards).__name__
        )
        raise ValueError(
            f"group_rewards: rewards must be a 2-D float tensor [num_prompts, n_samples_per_prompt], got {got}"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    group_size = rewards.numel() if estimator == "flash_reinforce" else rewards.shape[1]
    if group_size == 1:
        if estimator in ("rloo", "group_norm"):
            raise ValueError(
                f"group_rewards: {estimator!r} needs n_samples_per_prompt >= 2 (with 1, OpenRLHF's "
                f"{'leave-one-out mean divides by n - 1 = 0' if estimator == 'rloo' else 'std of one sample is NaN'}"
                " and every reward becomes NaN)"
            )
        return torch.zeros_like(rewards)  # r - mean(r) over one sample
    scores = rewards.detach().reshape(-1)
    # One valid position per sample: the op's [B, 1] advantages are the shaped rewards.
    mask = torch.ones((), dtype=torch.bool, device=rewards.device).expand(scores.shape[0], 1)
    with torch.no_grad():
        shaped = group_advantages(
            scores.to(torch.float64),
            mask,
            group_size=group_size,
            estimator="rloo" if estimator == "rloo" else "grpo",
            eps=_GROUP_NORM_EPS,
            std_normalize=estimator == "group_norm",
        )
    return shaped.reshape(rewards.shape).to(rewards.dtype)


PEER = _patching.Peer.named(
    "openrlhf",
    versions=("0.11.2",),
    targets=_patching.targets(
        "openrlhf.models.utils", compute_approx_kl, compute_reward, log_probs_from_logits, compute_entropy, masked_mean
    ),
    import_help=(
        "openrlhf.models imports flash_attn at module level (openrlhf/models/ring_attn_utils.py); "
        "install flash-attn, or on a machine without CUDA call "
        "pyppo.integrations.openrlhf.install_flash_attn_stub() before importing OpenRLHF."
    ),
)


def patch(*, force: bool = False) -> Patch:
    """Swap the adapters into the installed OpenRLHF (see :mod:`pyppo.integrations`); returns
    what was replaced. OpenRLHF other than 0.11.2 is warned about and left alone unless ``force``."""
    return _patching.patch(PEER, force=force)


def unpatch() -> Patch | None:
    """Put OpenRLHF's own functions back; returns the patch undone (None if none was active)."""
    return _patching.unpatch(PEER)


def patched(*, force: bool = False):
    """``with patched(): ...``: OpenRLHF patched for the block only."""
    return _patching.patched(PEER, force=force)
