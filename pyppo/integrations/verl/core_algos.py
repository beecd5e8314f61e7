"""Replacements for veRL 0.9.1's ``verl.trainer.ppo.core_algos``:
:func:`compute_gae_advantage_return`, the critic-free outcome advantage estimators
(:func:`compute_grpo_outcome_advantage`, :func:`compute_grpo_vectorized_outcome_advantage`,
:func:`compute_rloo_outcome_advantage`, :func:`compute_rloo_vectorized_outcome_advantage`,
:func:`compute_reinforce_plus_plus_baseline_outcome_advantage`,
:func:`compute_reinforce_plus_plus_outcome_advantage`), :func:`kl_penalty`,
:func:`kl_penalty_forward`, :func:`agg_loss`, :func:`compute_policy_loss`,
:func:`compute_policy_loss_vanilla`, :func:`compute_policy_loss_gspo`,
:func:`compute_policy_loss_cispo`, :func:`compute_value_loss`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:  # veRL passes numpy labels; pyppo's wheel itself runs without numpy
    import numpy as np

from pyppo.ops import cispo_policy_loss as _cispo_policy_loss
from pyppo.ops import gae as _gae
from pyppo.ops import group_advantages as _group_advantages
from pyppo.ops import gspo_policy_loss as _gspo_policy_loss
from pyppo.ops import kl_penalty as _kl_penalty
from pyppo.ops import masked_whiten as _masked_whiten

from ._checks import _acc, _bool_mask, _float_tensor, _mean_dtype, _promote, _real_tensor, _tensor
from .torch_functional import _mean_impl, _mean_var, _whiten_everywhere

PEER_MODULE = "verl.trainer.ppo.core_algos"

# veRL's names of the KL estimators (kl_penalty_forward) and pyppo's estimator for each.
_KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
# veRL clamps its k3 estimate to [-10, 10] (and ref - logprob to ±20 before the exp, which that
# clamp makes redundant: |d| > 20 puts k3 above 10).
_K3_CLAMP = (-10.0, 10.0)
_LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def _scalar_result_dtype(dtype: torch.dtype, *operands: Any) -> torch.dtype:
    """dtype of ``x / a * b ...`` for a 0-d tensor ``x`` of ``dtype`` and Python or tensor operands."""
    for op in operands:
        if isinstance(op, torch.Tensor):
            dtype = torch.result_type(torch.empty((), dtype=dtype), op)
    return dtype


def _count(m: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Number of set positions of the bool mask ``m`` (an int32 sum of bools is several times
    faster than the default int64 one on CPU)."""
    dtype = torch.int32 if m.numel() < 2**31 else torch.int64
    return m.sum(dtype=dtype) if dim is None else m.sum(dim, dtype=dtype)


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
        token_level_rewards: ``[B, T]`` float, or integer / bool (promoted with ``values``, as
            veRL's ``r + γ V`` promotes them).
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
            shapes that differ, a mask that is not bool / 0-1, non-float values, complex rewards.
        TypeError: a non-tensor argument.

    ``pyppo.ops.gae`` runs the scan (one pass per row instead of veRL's Python loop over ``T``),
    ``pyppo.ops.masked_mean``/``masked_var`` the whitening statistics; a suffix-min over positions
    fills the masked positions. Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.compute_gae_advantage_return``.
    """
    fn = "compute_gae_advantage_return"
    _real_tensor(fn, "token_level_rewards", token_level_rewards)
    _float_tensor(fn, "values", values)
    _tensor(fn, "response_mask", response_mask)
    out_dtype = _promote(token_level_rewards.dtype, values.dtype, response_mask.dtype)
    acc = _acc(out_dtype)
    rewards, vals = token_level_rewards, values
    if acc == torch.float64:
        # pyppo.gae computes in the rewards' precision; veRL computes in the promoted dtype.
        rewards, vals = rewards.to(acc), vals.to(acc)
    elif not rewards.is_floating_point():
        rewards = rewards.to(acc)  # veRL's r + γV promotes integer rewards the same way
    m = _bool_mask(fn, "response_mask", response_mask, token_level_rewards)
    with torch.no_grad():
        adv, _ = _gae(rewards, vals, m, gamma=float(gamma), lam=float(lam))
        carried = _next_valid(adv, m)
        returns = (carried + vals.detach().to(acc)).to(out_dtype)
        try:
            mean, var = _mean_var(fn, adv, m, response_mask.dtype, True)
        except ValueError:
            raise _too_few_to_whiten(fn, m) from None
        whitened = (carried - mean) * torch.rsqrt(var + 1e-8)
    return whitened.to(out_dtype), returns


# ----------------------------------------------------------------------------------------------
# critic-free outcome advantages: GRPO, Dr. GRPO, RLOO, REINFORCE++(-baseline)


def _group_ids(fn: str, index: Any, B: int, device: torch.device) -> torch.Tensor:
    """veRL's groups as ``pyppo.ops.group_advantages``'s ``group_ids``: rows whose ``index``
    entries are equal form a group, numbered ``0..G-1`` by ``np.unique(..., return_inverse=True)``
    (``G ≤ B``, so every id is in the op's ``[0, B)``); a group's rows need not be contiguous.
    Labels that cannot be sorted (mixed types) are numbered by a dict, which is how veRL's
    ``defaultdict(list)`` groups them (equality and hash). A torch tensor is grouped by value,
    with ``torch.unique`` on its device."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1 or index.shape[0] != B:
            raise ValueError(f"{fn}: index must hold one group label per row ({B}), got shape {tuple(index.shape)}")
        return torch.unique(index, return_inverse=True)[1].to(device=device, dtype=torch.int64)
    import numpy as np

    arr = np.asarray(index)
    if arr.ndim != 1 or arr.shape[0] != B:
        raise ValueError(f"{fn}: index must hold one group label per row ({B}), got shape {arr.shape}")
    try:
        inv = np.unique(arr, return_inverse=True)[1]
    except TypeError:
        seen: dict[Any, int] = {}
        inv = np.fromiter((seen.setdefault(u, len(seen)) for u in arr.tolist()), dtype=np.int64, count=B)
    return torch.from_numpy(np.ascontiguousarray(inv, dtype=np.int64).reshape(-1)).to(device)


def _outcome_mask(
    fn: str, token_level_rewards: Any, response_mask: Any, *, integer_rewards: bool = False
) -> torch.Tensor:
    """The checks every outcome estimator shares: ``[B, T]`` float rewards (integer / bool too
    with ``integer_rewards``) and a bool / 0-1 mask of their shape, returned as bool."""
    if integer_rewards:
        _real_tensor(fn, "token_level_rewards", token_level_rewards)
    else:
        _float_tensor(fn, "token_level_rewards", token_level_rewards)
    if token_level_rewards.dim() != 2:
        raise ValueError(f"{fn}: token_level_rewards must be [B, T], got shape {tuple(token_level_rewards.shape)}")
    return _bool_mask(fn, "response_mask", response_mask, token_level_rewards)


def _group_outcome(
    fn: str,
    token_level_rewards,
    response_mask,
    index,
    estimator: str,
    epsilon: float = 1e-6,
    std_normalize: bool = True,
    *,
    stats_dtype: Optional[torch.dtype] = None,
    singletons_zero: bool = False,
    cast: bool = True,
    integer_rewards: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pyppo.ops.group_advantages`` of veRL's scores (each row's reward summed over **every**
    position, masked ones included, as veRL's ``token_level_rewards.sum(-1)``) grouped by
    ``index``; and the checked bool mask.

    The result is in veRL's dtype ``promote(token_level_rewards, stats_dtype, response_mask)``
    (``stats_dtype``: the dtype of the statistics a vectorized estimator subtracts), or with
    ``cast=False`` in the precision computed in (float32, float64 for a float64 result).
    ``singletons_zero``: a group of one gets advantage 0 (its rows are masked out of the op's
    output) instead of the op's baseline-0 convention. ``integer_rewards``: integer / bool rewards
    are accepted (the vectorized estimators, where veRL's float statistics promote them)."""
    m = _outcome_mask(fn, token_level_rewards, response_mask, integer_rewards=integer_rewards)
    out_dtype = _promote(token_level_rewards.dtype, response_mask.dtype)
    if stats_dtype is not None:
        out_dtype = _promote(out_dtype, stats_dtype)
    ids = _group_ids(fn, index, token_level_rewards.shape[0], token_level_rewards.device)
    with torch.no_grad():
        rows = m
        if singletons_zero and ids.numel():
            rows = m & (torch.bincount(ids)[ids] > 1).unsqueeze(-1)
        if token_level_rewards.is_floating_point():
            scores = token_level_rewards.detach().sum(-1, dtype=_acc(out_dtype))
        else:
            scores = token_level_rewards.sum(-1).to(_acc(out_dtype))  # veRL: an exact integer sum
        adv = _group_advantages(
            scores, rows, group_ids=ids, estimator=estimator, eps=float(epsilon), std_normalize=bool(std_normalize)
        )
    return (adv.to(out_dtype) if cast else adv), m


def _whiten_valid(fn: str, x: torch.Tensor, m: torch.Tensor, mask_dtype: torch.dtype) -> torch.Tensor:
    """veRL's ``masked_whiten(x, mask) * mask``: the mean and unbiased variance over the mask,
    ``(x − μ) · rsqrt(σ² + 1e-8)`` at valid positions and 0 at masked ones, in ``x``'s precision.
    ``pyppo.ops.masked_whiten`` computes exactly that; a float64 mask, whose ``count + 1e-8``
    veRL divides by in float64, takes veRL's scaled statistics (:func:`._whiten_everywhere`)."""
    try:
        if mask_dtype == torch.float64:
            return torch.where(m, _whiten_everywhere(fn, x, m, mask_dtype), 0.0)
        return _masked_whiten(x, m)
    except ValueError:
        if int(m.sum()) >= 2:
            raise
        raise _too_few_to_whiten(fn, m) from None


def _next_valid(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x`` at the first valid position at or after each position (0 past a row's last one):
    veRL's GAE carries its running values through masked positions this way, here without a
    loop over ``T``."""
    B, T = x.shape
    pos = torch.arange(T, device=x.device)
    nxt = torch.where(m, pos, T).flip(-1).cummin(-1).values.flip(-1)
    return torch.cat([x, x.new_zeros(B, 1)], dim=1).gather(1, nxt)


def _too_few_to_whiten(fn: str, m: torch.Tensor) -> ValueError:
    """The error for advantages whitened over fewer than 2 valid positions, naming the mask."""
    return ValueError(
        f"{fn}: response_mask selects {int(m.sum())} position(s) in the whole batch; whitening the "
        "advantages needs at least 2 (veRL raises ValueError here too)"
    )


_GROUP_ARGS = """Args:
        token_level_rewards: ``[B, T]`` float; a row's score is its sum over all ``T``
            positions (masked ones included), as in veRL. The vectorized variants also take
            integer / bool rewards (summed exactly, then promoted as veRL's float statistics
            promote them); the others refuse them with ``ValueError``, where veRL's own fail
            (``torch.mean`` of an integer tensor).
        response_mask: ``[B, T]`` bool or 0/1 (the shape of ``token_level_rewards``).
        index: ``[B]`` group labels (veRL passes ``non_tensor_batch["uid"]``, a numpy array of
            uid strings): rows with equal labels are the responses to one prompt, in any order
            and any group sizes. A list or a torch tensor is grouped by value too."""


def _verl_adapter(adapter: Callable[..., Any], name: str, doc: str) -> Callable[..., Any]:
    """``adapter`` (veRL's signature of a family of functions, around one member's computation) as
    veRL's function ``name``, documented by ``doc`` (the group estimators' ``{args}`` filled in)."""
    adapter.__name__ = adapter.__qualname__ = name
    adapter.__doc__ = doc.replace("{args}", _GROUP_ARGS)
    return adapter


def _grpo_estimator(name: str, doc: str, **options: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """veRL's GRPO estimator ``name`` (the plain and the vectorized one share veRL's signature):
    :func:`_group_outcome`'s ``"grpo"`` advantages with ``options``, returned twice."""

    def estimator(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: np.ndarray,
        epsilon: float = 1e-6,
        norm_adv_by_std_in_grpo: bool = True,
        config: Optional[Any] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        adv, _ = _group_outcome(
            name, token_level_rewards, response_mask, index, "grpo", epsilon, norm_adv_by_std_in_grpo, **options
        )
        return adv, adv

    return _verl_adapter(estimator, name, doc)


compute_grpo_outcome_advantage = _grpo_estimator(
    "compute_grpo_outcome_advantage",
    r"""GRPO outcome advantages: each response's score against the other responses to its prompt.

    For a group with scores ``s_i``, mean ``m`` and unbiased std ``σ``:
    :math:`a_i = (s_i - m) / (\sigma + \epsilon)` (Shao et al. 2024, "DeepSeekMath", §4.1.2), or
    with ``norm_adv_by_std_in_grpo=False`` :math:`a_i = s_i - m` (Dr. GRPO, Liu et al. 2025).
    ``a_b`` is written at every valid position of row ``b`` (``a_b · response_mask``).

    {args}
        epsilon: added to the std; finite and ``≥ 0`` (veRL accepts any number).
        norm_adv_by_std_in_grpo: divide by the group's std.
        config: unused, as in veRL.

    Returns:
        ``(advantages, advantages)``: one ``[B, T]`` tensor twice, in veRL's dtype
        ``promote(token_level_rewards, response_mask)``, 0 at masked positions; no gradient.

    Edge cases, as veRL: a group of one has mean 0 and std 1 (``s / (1 + ε)``, or ``s``); a row
    with no valid position is all 0 but its score counts in its group. **Differences:** a group
    whose scores are all equal gets exactly 0 (veRL's float32 mean and std leave rounding noise
    that ``/ (σ + 1e-6)`` magnifies, up to ``±0.19`` for eight scores of 2.9); a non-finite score
    raises ``ValueError`` (veRL: NaN for its group).

    Raises:
        ValueError: ``index`` without one label per row, a bad mask, non-``[B, T]`` or non-float
            rewards, a non-finite score, a negative or non-finite ``epsilon``.

    Computed by ``pyppo.ops.group_advantages`` (one pass over the scores, float64 group
    statistics, no Python loop over rows or groups; the labels are numbered with ``np.unique``).
    Matches veRL 0.9.1 ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage``.
    """,
)

compute_grpo_vectorized_outcome_advantage = _grpo_estimator(
    "compute_grpo_vectorized_outcome_advantage",
    r"""GRPO / Dr. GRPO outcome advantages, veRL's vectorized variant: the same values as
    :func:`compute_grpo_outcome_advantage`.

    {args}
        epsilon, norm_adv_by_std_in_grpo, config: as :func:`compute_grpo_outcome_advantage`.

    Returns:
        ``(advantages, advantages)``: one ``[B, T]`` tensor twice, in veRL's dtype for this
        variant, ``promote(token_level_rewards, float32, response_mask)`` (its group statistics
        are float32, so bf16 rewards give float32), 0 at masked positions; no gradient.

    Edge cases and differences as :func:`compute_grpo_outcome_advantage` (singletons: mean 0,
    std 1; equal scores: exactly 0). **Grouping difference:** veRL's ``as_torch_index`` also
    merges labels that are equal as integers (the strings ``"1"`` and ``"01"``, floats within
    ``1e-6`` of one integer); pyppo groups equal labels only, as the non-vectorized estimators
    do. veRL's uid strings (``uuid4``) are grouped the same way by both.

    Computed by ``pyppo.ops.group_advantages`` (deterministic: veRL's ``index_add_`` uses float32
    atomics on CUDA). Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.compute_grpo_vectorized_outcome_advantage``.
    """,
    stats_dtype=torch.float32,
    integer_rewards=True,
)


def _baseline_estimator(
    name: str, doc: str, advantages: Callable[[str, Any, Any, Any], torch.Tensor], index_annotation: str = "np.ndarray"
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """veRL's estimator ``name`` of the RLOO / REINFORCE++-baseline signature, whose ``epsilon``,
    ``config`` and ``kwargs`` are unused: ``advantages(name, token_level_rewards, response_mask,
    index)``, returned twice. ``index_annotation``: veRL's annotation of ``index``."""

    def estimator(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: np.ndarray,
        epsilon: float = 1e-6,
        config: Optional[Any] = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        adv = advantages(name, token_level_rewards, response_mask, index)
        return adv, adv

    estimator.__annotations__["index"] = index_annotation
    return _verl_adapter(estimator, name, doc)


def _rloo_advantages(fn: str, token_level_rewards, response_mask, index, **options: Any) -> torch.Tensor:
    return _group_outcome(fn, token_level_rewards, response_mask, index, "rloo", **options)[0]


def _rloo_vectorized_advantages(fn: str, token_level_rewards, response_mask, index) -> torch.Tensor:
    # veRL subtracts torch.bincount(weights=scores), which is float32 for float32 weights and
    # float64 for every other dtype (ATen's bincount).
    f32 = isinstance(token_level_rewards, torch.Tensor) and token_level_rewards.dtype == torch.float32
    return _rloo_advantages(
        fn,
        token_level_rewards,
        response_mask,
        index,
        stats_dtype=torch.float32 if f32 else torch.float64,
        singletons_zero=True,
        integer_rewards=True,
    )


def _reinforce_plus_plus_baseline_advantages(fn: str, token_level_rewards, response_mask, index) -> torch.Tensor:
    centered, m = _group_outcome(fn, token_level_rewards, response_mask, index, "grpo", std_normalize=False, cast=False)
    with torch.no_grad():
        adv = _whiten_valid(fn, centered, m, response_mask.dtype)
    return adv.to(_promote(token_level_rewards.dtype, response_mask.dtype))


compute_rloo_outcome_advantage = _baseline_estimator(
    "compute_rloo_outcome_advantage",
    r"""RLOO outcome advantages: each score minus the mean of the **other** scores of its group.

    :math:`a_i = s_i - \frac{1}{n-1}\sum_{j \ne i} s_j = \frac{n}{n-1}(s_i - m)` (Kool et al. 2019;
    Ahmadian et al. 2024, "Back to Basics"), written at every valid position of row ``i``.

    {args}
        epsilon, config, kwargs: unused, as in veRL (its trainer passes ``reward_baselines``).

    Returns:
        ``(advantages, advantages)``: one ``[B, T]`` tensor twice, in veRL's dtype
        ``promote(token_level_rewards, response_mask)``, 0 at masked positions; no gradient.

    Edge cases, as veRL: a group of one keeps its score (``a = s``); an all-masked row is 0 and
    its score counts in its group. **Differences:** equal scores give exactly 0 (veRL's
    ``s·n/(n−1) − m·n/(n−1)`` can leave a rounding residue); a non-finite score raises
    ``ValueError``.

    Raises:
        ValueError: as :func:`compute_grpo_outcome_advantage`.

    Computed by ``pyppo.ops.group_advantages(estimator="rloo")``. Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.compute_rloo_outcome_advantage``.
    """,
    _rloo_advantages,
)

compute_rloo_vectorized_outcome_advantage = _baseline_estimator(
    "compute_rloo_vectorized_outcome_advantage",
    r"""RLOO outcome advantages, veRL's vectorized variant: :func:`compute_rloo_outcome_advantage`'s
    values, except that a group of one gets advantage **0** (veRL's ``· (count > 1)``), not its
    score.

    {args}
        epsilon, config, kwargs: unused, as in veRL.

    Returns:
        ``(advantages, advantages)``: one ``[B, T]`` tensor twice, 0 at masked positions, no
        gradient, in veRL's dtype for this variant: ``promote(token_level_rewards, w,
        response_mask)`` with ``w`` the dtype of ``torch.bincount(..., weights=scores)``
        (float32 for float32 rewards, **float64** for bf16, fp16 and float64 rewards).

    Grouping as the non-vectorized estimators (veRL's ``np.unique`` too). **Differences:** as
    :func:`compute_rloo_outcome_advantage` (equal scores: exactly 0; non-finite: ``ValueError``).

    Computed by ``pyppo.ops.group_advantages(estimator="rloo")`` with the singleton rows masked
    out of its output. Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.compute_rloo_vectorized_outcome_advantage``.
    """,
    _rloo_vectorized_advantages,
)

compute_reinforce_plus_plus_baseline_outcome_advantage = _baseline_estimator(
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    r"""REINFORCE++-baseline outcome advantages: the score minus its group's mean, then whitened
    over the batch's valid tokens (Hu et al. 2025, "REINFORCE++", arXiv:2501.03262).

    ``c_b = s_b − m_g`` (a group of one: ``c_b = s_b``) at every valid position of row ``b``, then
    ``(c − μ) · rsqrt(σ² + 1e-8)`` with ``μ``, ``σ²`` (unbiased) over all valid positions (a row
    counts once per valid token), 0 at masked positions.

    {args}
        epsilon, config, kwargs: unused, as in veRL.

    Returns:
        ``(advantages, advantages)``: one ``[B, T]`` tensor twice, in veRL's dtype
        ``promote(token_level_rewards, response_mask)``; no gradient.

    Raises:
        ValueError: fewer than 2 valid positions in the batch (veRL: ``ValueError`` from its
            whitening); otherwise as :func:`compute_grpo_outcome_advantage`.

    **Differences:** equal scores in a group give exactly 0 before the whitening; a non-finite
    score raises ``ValueError``. Computed by ``pyppo.ops.group_advantages(estimator="grpo",
    std_normalize=False)`` then ``pyppo.ops.masked_whiten`` (float64 statistics; a float64 mask
    takes veRL's ``count + 1e-8`` scaling, with ``pyppo.ops.masked_mean`` / ``masked_var``).
    Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage``.
    """,
    _reinforce_plus_plus_baseline_advantages,
    index_annotation="torch.Tensor",
)


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Optional[Any] = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""REINFORCE++ advantages: the discounted return of every valid token, whitened over the batch.

    ``G_t = r_t + γ G_{t'}`` with ``t'`` the next valid position of the row: a masked position
    (a multi-turn observation) is skipped, its reward dropped and the return carried past it, as
    veRL does; ``G = 0`` at masked positions. The advantages are ``(G − μ) · rsqrt(σ² + 1e-8)``
    over the valid positions, 0 at masked ones (Hu et al. 2025, "REINFORCE++").

    Args:
        token_level_rewards: ``[B, T]`` float.
        response_mask: ``[B, T]`` 0/1 (int or float) or bool (veRL itself fails on bool with a
            ``RuntimeError`` from ``1 - mask``; pyppo accepts it).
        config: veRL's ``AlgoConfig`` (or anything with ``.gamma``); required.
        kwargs: unused, as in veRL.

    Returns:
        ``(advantages, returns)``, ``[B, T]``: ``returns`` in ``token_level_rewards``' dtype,
        ``advantages`` in ``promote(token_level_rewards, response_mask)`` (veRL's dtypes); no
        gradient. Computed in float32 (float64 for a float64 result).

    Raises:
        AssertionError: ``config`` is None (veRL's assert). ValueError: ``config.gamma`` outside
            ``[0, 1]`` (veRL accepts any value); fewer than 2 valid positions in the batch (veRL:
            ``ValueError`` from its whitening); a bad mask; non-``[B, T]`` or non-float rewards
            (veRL computes on integer rewards, but truncates the returns to their dtype).

    ``pyppo.ops.gae`` with zero values and ``λ = 1`` is exactly this return (its ``δ_t = r_t``,
    chained over valid positions only), one scan per row instead of veRL's Python loop over
    ``T``; ``pyppo.ops.masked_whiten`` whitens it. Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.compute_reinforce_plus_plus_outcome_advantage``.
    """
    fn = "compute_reinforce_plus_plus_outcome_advantage"
    if config is None:
        raise AssertionError(f"{fn}: config is required (veRL asserts config is not None)")
    gamma = config.gamma
    if isinstance(token_level_rewards, torch.Tensor) and not (
        token_level_rewards.is_floating_point() or token_level_rewards.is_complex()
    ):
        raise ValueError(
            f"{fn}: token_level_rewards must be a floating-point tensor, got dtype {token_level_rewards.dtype} "
            "(veRL would store the discounted returns in that dtype, truncating them); pass rewards.float()"
        )
    m = _outcome_mask(fn, token_level_rewards, response_mask)
    out_dtype = _promote(token_level_rewards.dtype, response_mask.dtype)
    acc = _acc(out_dtype)
    with torch.no_grad():
        rewards = token_level_rewards.detach()
        if acc == torch.float64:
            rewards = rewards.to(acc)  # pyppo.gae computes in the rewards' precision
        zero_values = torch.zeros((), dtype=rewards.dtype, device=rewards.device).expand(rewards.shape)
        returns, _ = _gae(rewards, zero_values, m, gamma=float(gamma), lam=1.0)
        adv = _whiten_valid(fn, returns, m, response_mask.dtype).to(out_dtype)
    return adv, returns.to(token_level_rewards.dtype)


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
    loss_mat: torch.Tensor, loss_dtype: torch.dtype, m: torch.Tensor, mask_dtype: torch.dtype, loss_agg_mode: str,
    dp_size: int = 1, batch_num_tokens: Optional[int] = None, global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None, *, sums: Optional[Callable[[str], torch.Tensor]] = None,
) -> torch.Tensor:  # fmt: skip
    """agg_loss on a validated bool mask ``m``. ``loss_dtype`` is the dtype veRL's loss matrix
    would have (the losses compute theirs in float32), ``mask_dtype`` the caller's mask dtype:
    both take part in veRL's type promotion.

    ``sums``, when given, supplies the totals instead of ``loss_mat`` (then only its shape is
    read): ``sums("token")`` is ``Σ L`` over the valid tokens, ``sums("row")`` is
    ``Σ_b Σ_t L_bt / n_b`` over the rows with a valid token (what a pyppo policy-loss op returns
    with ``normalizer=1``); veRL's normalisers are applied to them here."""
    if loss_agg_mode not in _LOSS_AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    # veRL's per-token product loss_mat * loss_mask: its dtype is that of every sum below.
    s_dtype = _promote(loss_dtype, mask_dtype)
    shape = loss_mat.shape
    lm = loss_mat
    if sums is None:
        # The op reads half precision as it is; a float64 result needs float64 terms.
        lm = loss_mat.to(torch.float64) if s_dtype == torch.float64 else loss_mat
    if lm.dim() != 2:
        lm, m = lm.reshape(-1, shape[-1]), m.reshape(-1, shape[-1])

    if loss_agg_mode in ("token-mean", "token-sum"):
        n = _count(m)
        # Σ L over the mask = masked mean · count; pyppo's mean sums in float64, and an empty
        # mask gives 0 (so 0 / 0 = NaN below for token-mean, as in veRL).
        total = sums("token") if sums is not None else _mean_impl(lm, m, None) * n
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
    den_dtype = mask_dtype if mask_dtype.is_floating_point else torch.get_default_dtype()
    if loss_agg_mode == "seq-mean-token-mean" and sums is not None:
        # The op divides each row by its count, without veRL's + 1e-8 (a 1e-8 / n_b relative
        # difference, below float32's resolution).
        total = sums("row")
        sum_dtype = _promote(s_dtype, den_dtype, torch.float32)
    elif loss_agg_mode == "seq-mean-token-mean":
        # veRL's formula, each row's sum over (its count + 1e-8) in the count's float dtype (the
        # epsilon keeps an empty row at 0 and vanishes below float64), with where() for veRL's
        # multiply by the mask and sums accumulated in float32 at least.
        row_sum = torch.where(m, lm, 0.0).sum(dim=-1, dtype=_acc(s_dtype))
        # An empty row is dropped with where(), as veRL's masked_sum over the sequences does: in
        # float16 the epsilon underflows and its 0 / 0 would be NaN.
        row_mean = row_sum / (tokens_per_row.to(den_dtype) + 1e-8)
        total = torch.where(tokens_per_row > 0, row_mean, 0.0).sum()
        sum_dtype = _promote(s_dtype, den_dtype, torch.float32)
    else:
        # Σ over the sequences of their token sums: the token sum of the whole batch.
        total = sums("token") if sums is not None else _mean_impl(lm, m, None) * tokens_per_row.sum()
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
    global_batch = (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    return _agg_impl(loss_mat, loss_mat.dtype, m, loss_mask.dtype, loss_agg_mode, *global_batch)


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
        # Each temporary is dropped once it is no longer needed, and the statistics are written
        # into their [3, *] tensor as their terms appear (no stack), to keep the peak low.
        raw = log_prob.to(acc) - old_log_prob.to(acc)
        log_ratio = raw.clamp(-20.0, 20.0)
        stats = log_ratio.new_empty((3, *log_ratio.shape))
        torch.neg(log_ratio, out=stats[2])
        ratio = log_ratio.exp()
        del log_ratio
        neg_adv = -advantages.to(acc)
        clipped_ratio = ratio.clamp(1 - low, 1 + high)
        pg1 = neg_adv * ratio
        pg2 = neg_adv * clipped_ratio
        stats[0] = pg2 > pg1
        clip1 = torch.maximum(pg1, pg2)
        pg3 = neg_adv * c
        negative = neg_adv > 0
        del neg_adv
        stats[1] = (clip1 > pg3) & negative
        loss = torch.where(negative, torch.minimum(pg3, clip1), clip1)
        need_lp, need_adv = ctx.needs_input_grad[0] or ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        saved = []
        if need_lp or need_adv:
            dual = _tie_weight(clip1, pg3)  # share of min(pg3, clip1) that reaches clip1
        del clip1, pg3
        if need_lp:
            # d pg1 / d log_prob = pg1 (d ratio = ratio). maximum(pg1, pg2) passes it where pg1 is
            # the larger; at a tie the ratio is inside the clip range, where pg2 has the same
            # derivative, so the two halves add up to all of it. clamp passes |raw| <= 20.
            coef = torch.where((pg1 >= pg2) & (raw >= -20.0) & (raw <= 20.0), pg1, 0.0)
            saved.append(torch.where(negative, coef * dual, coef))
            del coef
        del raw
        if need_adv:
            # Each term is linear in A: d/dA is minus its ratio factor, ties split evenly.
            d1 = -torch.where(pg1 > pg2, ratio, torch.where(pg1 < pg2, clipped_ratio, 0.5 * (ratio + clipped_ratio)))
            saved.append(torch.where(negative, dual * d1 - (1 - dual) * c, d1))
        ctx.save_for_backward(*saved)
        ctx.need = (need_lp, need_adv)
        ctx.dtypes = (log_prob.dtype, old_log_prob.dtype, advantages.dtype)
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


def _policy_inputs(fn, old_log_prob, log_prob, advantages, response_mask) -> torch.Tensor:
    """The policy losses' checks: three float tensors of ``log_prob``'s shape and a bool / 0-1
    mask of it, returned as bool."""
    for name, t in (("old_log_prob", old_log_prob), ("log_prob", log_prob), ("advantages", advantages)):
        _float_tensor(fn, name, t)
        if t.shape != log_prob.shape:
            raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)} but log_prob has shape {tuple(log_prob.shape)}")
    return _bool_mask(fn, "response_mask", response_mask, log_prob)


def _clip_ratios(config: Any) -> tuple[float, float]:
    """veRL's ``(clip_ratio_low, clip_ratio_high)`` from an actor config, each defaulting to
    ``clip_ratio``."""
    clip_ratio = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    return low, high


def _policy_terms(fn, old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_ratio_c):
    """veRL's dual-clip PPO per-token loss and its three statistics, in float32 (float64)."""
    if not clip_ratio_c > 1.0:
        raise AssertionError(
            "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
            + f" but get the value: {clip_ratio_c}."
        )
    if cliprange_low is None or cliprange_high is None:
        raise TypeError(f"{fn}: the clip range is None; give cliprange (or cliprange_low and cliprange_high)")
    m = _policy_inputs(fn, old_log_prob, log_prob, advantages, response_mask)
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


def _policy_loss_adapter(
    name: str, doc: str, loss: Callable[..., tuple[torch.Tensor, dict[str, Any]]], loss_agg_default: str = "token-mean"
) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """veRL's policy loss ``name``, of the signature its vanilla, GSPO and CISPO losses share
    (``POLICY_LOSS_REGISTRY``'s; ``loss_agg_default``: veRL's default mode): ``loss(name,
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``."""

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = loss_agg_default,
        config: Optional[Any] = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if config is None:
            raise AssertionError(f"{name}: config is required (veRL asserts config is not None)")
        return loss(name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)

    return _verl_adapter(policy_loss, name, doc)


def _vanilla_policy_loss(
    fn: str, old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode: str, config: Any, rollout_is_weights: Optional[torch.Tensor],
) -> tuple[torch.Tensor, dict[str, Any]]:  # fmt: skip
    if type(config).__name__ == "AlgoConfig":
        raise AssertionError(f"{fn}: config must be the actor config, not an AlgoConfig")
    clip_ratio_low, clip_ratio_high = _clip_ratios(config)
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


compute_policy_loss_vanilla = _policy_loss_adapter(
    "compute_policy_loss_vanilla",
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
    aggregates before veRL's ``rollout_is_weights`` can be applied, reports ``k3`` rather than
    veRL's ``k1`` ``ppo_kl``, and with veRL's conventions around it is slower and keeps about 4x
    the memory for the backward (``benchmarks/verl_loss.py``), so the adapter writes the formula
    out. Matches veRL 0.9.1 ``verl.trainer.ppo.core_algos.compute_policy_loss_vanilla``.
    """,
    _vanilla_policy_loss,
)


def _op_policy_loss(
    fn: str, op: Callable[..., Any], old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode: str, config: Any, rollout_is_weights: Optional[torch.Tensor],
    kl_clamp: Optional[float], weights_fold_sign: bool,
) -> tuple[torch.Tensor, dict[str, Any]]:  # fmt: skip
    """A veRL policy loss computed by a pyppo policy-loss op (``gspo_policy_loss``,
    ``cispo_policy_loss``): the op gives the differentiable token sum (or row-mean sum) with
    ``normalizer=1``, :func:`_agg_impl` applies veRL's mode and ``config.global_batch_info``.

    ``rollout_is_weights`` multiplies veRL's per-token loss; both losses are linear in the
    advantage per token (GSPO's ``max(−A·r, −A·clip(r))`` for weights ``≥ 0``:
    ``weights_fold_sign``), so the op takes ``A·w`` as its advantages. veRL's statistics ignore
    the weights: where a weight zeroes a token's ``A·w``, the clip fraction comes from a second,
    gradient-free op call on the unweighted advantages. ``kl_clamp``: veRL's clamp of the
    log-ratio in its ``ppo_kl``."""
    if not any(c.__name__ == "ActorConfig" for c in type(config).__mro__):
        raise AssertionError(
            f"{fn}: config must be a veRL ActorConfig (veRL asserts isinstance(config, ActorConfig)), "
            f"got {type(config).__name__}"
        )
    low, high = _clip_ratios(config)
    m = _policy_inputs(fn, old_log_prob, log_prob, advantages, response_mask)
    # veRL's per-token loss dtype (a float mask joins in its sums, in _agg_impl).
    loss_dtype = _promote(old_log_prob.dtype, log_prob.dtype, advantages.dtype)
    adv = advantages
    if rollout_is_weights is not None:
        w = _tensor(fn, "rollout_is_weights", rollout_is_weights)
        loss_dtype = torch.promote_types(loss_dtype, w.dtype)
        if weights_fold_sign and bool((w < 0).any()):
            raise ValueError(f"{fn}: rollout_is_weights must be >= 0 (importance weights); got a negative weight")
        adv = advantages.to(_acc(loss_dtype)) * w.to(_acc(loss_dtype))
    if _acc(_promote(loss_dtype, response_mask.dtype)) == torch.float64:
        # veRL's sums are float64 (a float64 mask or loss); the op computes in its inputs' precision.
        adv = adv.to(torch.float64)
    kwargs = {"cliprange_low": float(low), "cliprange_high": float(high), "normalizer": 1.0}
    stats: list = []

    def sums(kind: str) -> torch.Tensor:
        loss, st = op(
            log_prob,
            old_log_prob,
            adv,
            m,
            loss_agg="token-mean" if kind == "token" else "seq-mean-token-mean",
            **kwargs,
        )
        stats.append(st)
        return loss

    pg_loss = _agg_impl(
        log_prob, loss_dtype, m, response_mask.dtype, loss_agg_mode, sums=sums, **config.global_batch_info
    )
    clipfrac = stats[0]["clipfrac"]
    with torch.no_grad():
        if rollout_is_weights is not None and weights_fold_sign and bool((m & (adv == 0) & (advantages != 0)).any()):
            clipfrac = op(log_prob, old_log_prob, advantages.to(adv.dtype), m, **kwargs)[1]["clipfrac"]
        acc = _acc(_promote(log_prob.dtype, old_log_prob.dtype))
        neg_kl = old_log_prob.to(acc) - log_prob.to(acc)
        if kl_clamp is not None:
            neg_kl = neg_kl.clamp(-kl_clamp, kl_clamp)
        ppo_kl = _mean_impl(neg_kl, m, None, response_mask.dtype)
        clipfrac, ppo_kl = torch.stack([clipfrac.to(acc), ppo_kl.to(acc)]).tolist()
    return pg_loss, {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": 0.0}


# The ops are looked up when called, so that a wrapper put on them (the tests count the calls) is used.
compute_policy_loss_gspo = _policy_loss_adapter(
    "compute_policy_loss_gspo",
    r"""GSPO's clipped surrogate with a sequence-level ratio (Zheng et al. 2025, "Group Sequence
    Policy Optimization", GSPO-token, eq. 13-14).

    Per row ``i``, ``s_i = exp(min(mean_t (log_prob − old_log_prob), 10))`` over its valid tokens;
    per token the ratio has ``s_i``'s value and ``s_i · ∇ log_prob``'s gradient, and
    ``L = max(−A·s, −A·clip(s, 1 − ε_low, 1 + ε_high))``, times ``rollout_is_weights``, reduced
    with :func:`agg_loss` (default ``"seq-mean-token-mean"``, the paper's, as veRL).

    Args:
        old_log_prob, log_prob, advantages: ``[B, T]`` float; differentiable w.r.t. ``log_prob``
            and ``advantages`` (veRL's autograd; ties of the ``max`` split evenly).
        response_mask: ``[B, T]`` bool or 0/1.
        loss_agg_mode: see :func:`agg_loss`.
        config: veRL's ``ActorConfig`` (veRL asserts its type; ``clip_ratio``,
            ``clip_ratio_low``, ``clip_ratio_high``, ``global_batch_info``).
        rollout_is_weights: optional ``≥ 0`` weights broadcastable to ``[B, T]`` multiplying the
            per-token loss; the statistics ignore them, as in veRL.

    Returns:
        ``(pg_loss, metrics)``: ``pg_loss`` 0-d in veRL's dtype; ``metrics``
        ``{"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}`` of Python floats
        (``ppo_kl`` the mean of ``old − new``, unclamped, as veRL; ``pg_clipfrac_lower`` 0.0).

    Raises:
        AssertionError: ``config`` None or not an ``ActorConfig`` (veRL's asserts).
        ValueError: a clip range the op refuses (``ε_low`` outside ``[0, 1)``, ``ε_high`` not
            positive and finite; veRL takes any), a negative rollout weight (veRL would turn the
            ``max`` into a ``min`` there), shape mismatch, a bad mask, unknown mode, a missing
            global count with ``dp_size > 1``.

    **Difference:** the op clamps each token's log-ratio to ±20 before the sequence mean (veRL
    averages them unclamped), so a row with a token beyond ±20 gets a different ``s_i``. Computed
    by ``pyppo.ops.gspo_policy_loss`` (loss and gradient, ``normalizer=1``), veRL's normalisers
    as :func:`agg_loss`, ``ppo_kl`` by ``pyppo.ops.masked_mean``. Matches veRL 0.9.1
    ``verl.trainer.ppo.core_algos.compute_policy_loss_gspo``.
    """,
    lambda fn, *args: _op_policy_loss(fn, _gspo_policy_loss, *args, kl_clamp=None, weights_fold_sign=True),
    loss_agg_default="seq-mean-token-mean",
)

compute_policy_loss_cispo = _policy_loss_adapter(
    "compute_policy_loss_cispo",
    r"""CISPO: REINFORCE with a clipped, detached importance weight (MiniMax 2025, "MiniMax-M1",
    eq. 4-5). Per token, ``r = exp(clamp(log_prob − old_log_prob, ±20))`` and
    ``L = −sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log_prob``, times ``rollout_is_weights``,
    reduced with :func:`agg_loss`.

    Args:
        old_log_prob, log_prob, advantages: ``[B, T]`` float; differentiable w.r.t. ``log_prob``
            and ``advantages``.
        response_mask, loss_agg_mode, config, rollout_is_weights: as
            :func:`compute_policy_loss_gspo` (the weights may have any sign here).

    Returns:
        ``(pg_loss, metrics)`` as :func:`compute_policy_loss_gspo`; ``pg_clipfrac`` is the
        fraction of tokens whose weight was clipped (``r ≠ clip(r)``), ``ppo_kl`` the mean of the
        clamped ``old − new``, as veRL.

    Raises:
        AssertionError, ValueError: as :func:`compute_policy_loss_gspo` (no sign condition on
            the weights).

    Computed by ``pyppo.ops.cispo_policy_loss`` (loss and gradient, ``normalizer=1``), veRL's
    normalisers as :func:`agg_loss`, ``ppo_kl`` by ``pyppo.ops.masked_mean``. The log-prob at a
    masked position is never read (veRL's ``agg_loss`` multiplies it by 0, so a ``−inf`` there is
    NaN in veRL). Matches veRL 0.9.1 ``verl.trainer.ppo.core_algos.compute_policy_loss_cispo``.
    """,
    lambda fn, *args: _op_policy_loss(fn, _cispo_policy_loss, *args, kl_clamp=20.0, weights_fold_sign=False),
)


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
    ``ppo_value_loss`` clips with ``torch.clamp``, whose gradient at a clip boundary goes all to
    ``V`` where veRL's ``min``/``max`` split it with ``V_old``; it has no ``token-sum`` mode, global
    normalisers or tensor ``cliprange_value``, and is slower and keeps about 3.5x the memory for
    the backward (``benchmarks/verl_loss.py``), so the adapter writes veRL's form out. Matches
    veRL 0.9.1 ``verl.trainer.ppo.core_algos.compute_value_loss``.
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
    global_batch = (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    vf_loss = 0.5 * _agg_impl(token_loss, loss_dtype, m, response_mask.dtype, loss_agg_mode, *global_batch)
    with torch.no_grad():
        vf_clipfrac = _mean_impl(clipped_larger.to(acc), m, None, response_mask.dtype)
    return vf_loss, vf_clipfrac.to(_mean_dtype(torch.float32, response_mask.dtype))
