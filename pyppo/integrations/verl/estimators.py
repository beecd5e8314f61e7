"""Critic estimators of pyppo that veRL 0.9.1 lacks, as veRL advantage estimators:
:func:`compute_decoupled_gae_advantage_return` (registered as ``"pyppo_gae"``) and
:func:`compute_turn_gae_advantage_return` (``"pyppo_gae_turn"``), plus :func:`compute_advantage`,
a replacement for ``verl.trainer.ppo.ray_trainer.compute_advantage`` that hands them the critic's
values.

veRL's ``compute_advantage`` computes GAE itself for ``"gae"`` and calls every other registered
estimator with ``token_level_rewards``, ``response_mask``, ``config`` and ``index`` only: no
values, so a critic estimator registered by name alone never sees them. The replacement calls
the two estimators here with ``values=data.batch["values"]`` (and ``turn_ids`` when the batch has
them) and hands every other estimator to veRL's own ``compute_advantage``, unchanged.

Both estimators follow veRL's ``compute_gae_advantage_return``: ``(advantages, returns)`` of
``[B, T]``, the advantages whitened over ``response_mask`` and written at every position, a masked
position carrying the values of the next valid position of its row, in veRL's dtype
``promote(rewards, values, mask)``, computed in float32 (float64 for a float64 result), no
gradient. Neither imports veRL.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Any, Optional

import torch

from pyppo.ops import gae as _gae
from pyppo.ops import length_adaptive_lam as _length_adaptive_lam
from pyppo.ops import turn_gae as _turn_gae

from .. import _patching
from ._checks import _acc, _bool_mask, _float_tensor, _promote, _real_tensor, _tensor
from .core_algos import _next_valid, _too_few_to_whiten
from .torch_functional import _whiten_everywhere

PYPPO_GAE = "pyppo_gae"
PYPPO_GAE_TURN = "pyppo_gae_turn"
REGISTRY = "ADV_ESTIMATOR_REGISTRY"
TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"

_NO_VALUES = (
    "{fn}: values is required (the critic's [B, T] values). veRL 0.9.1's compute_advantage passes "
    "estimators other than 'gae' no values; pyppo.integrations.verl.patch() replaces it with one "
    "that does (see Patch.skipped if veRL's trainer module could not be imported), and "
    "critic.enable=True makes veRL compute them."
)


# ----------------------------------------------------------------------------------------------
# shared argument handling


def _setting(fn: str, key: str, given: Any, config: Any, default: float, hi: float = 1.0) -> float:
    """``given`` when not None, else ``config.get(key)`` (veRL's ``AlgoConfig`` and ``DictConfig``
    both have ``get``), else ``default``; checked to be a finite real number in ``[0, hi]``."""
    value = given
    if value is None and config is not None:
        value = config.get(key, None)
    if value is None:
        value = default
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()  # veRL's own GAE takes 0-d tensors for gamma and lam
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if not ok or not 0.0 <= float(value) <= hi:
        bound = f"[0, {hi:g}]" if math.isfinite(hi) else "[0, inf)"
        raise ValueError(f"{fn}: {key} must be a finite number in {bound}, got {value!r}")
    return float(value)


def _inputs(
    fn: str, token_level_rewards: Any, values: Any, response_mask: Any, config: Any, gamma: Any, lam: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype, float, float]:
    """``(rewards, values, mask, out_dtype, gamma, lam)``: rewards and values in the precision the
    result is computed in, the mask as bool, veRL's result dtype ``promote(rewards, values, mask)``,
    and γ, λ as passed or from ``config`` (veRL's default 1.0)."""
    _real_tensor(fn, "token_level_rewards", token_level_rewards)
    if values is None:
        raise TypeError(_NO_VALUES.format(fn=fn))
    _float_tensor(fn, "values", values)
    if token_level_rewards.dim() != 2:
        raise ValueError(f"{fn}: token_level_rewards must be [B, T], got shape {tuple(token_level_rewards.shape)}")
    if values.shape != token_level_rewards.shape:
        raise ValueError(
            f"{fn}: values has shape {tuple(values.shape)} but token_level_rewards has shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    _tensor(fn, "response_mask", response_mask)
    out_dtype = _promote(token_level_rewards.dtype, values.dtype, response_mask.dtype)
    m = _bool_mask(fn, "response_mask", response_mask, token_level_rewards)
    acc = _acc(out_dtype)
    # The ops take rewards and values of one dtype; upcasting both is exact, so the result is what
    # a computation in veRL's promoted dtype gives, without its roundings in between.
    gamma, lam = _setting(fn, "gamma", gamma, config, 1.0), _setting(fn, "lam", lam, config, 1.0)
    return token_level_rewards.to(acc), values.detach().to(acc), m, out_dtype, gamma, lam


def _whiten(fn: str, x: torch.Tensor, m: torch.Tensor, mask_dtype: torch.dtype) -> torch.Tensor:
    """veRL's ``masked_whiten(x, response_mask)``, turning the statistics' error on too few valid
    positions into one that says what the caller passed."""
    try:
        return _whiten_everywhere(fn, x, m, mask_dtype)
    except ValueError:
        if int(m.sum()) >= 2:
            raise
        raise _too_few_to_whiten(fn, m) from None


# ----------------------------------------------------------------------------------------------
# decoupled and length-adaptive GAE


def compute_decoupled_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: Optional[torch.Tensor] = None,
    config: Any = None,
    gamma: Optional[float] = None,
    lam: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""GAE with a separate λ for the value targets, and optionally a λ per response for the
    advantages: veRL's estimator ``"pyppo_gae"``.

    .. math::
        \delta_t = r_t + \gamma V_{t'} - V_t,\quad
        A^{\lambda}_t = \delta_t + \gamma\lambda A^{\lambda}_{t'},\quad
        \text{advantages} = \operatorname{whiten}(A^{\lambda_b}),\quad
        \text{returns} = A^{\lambda_c} + V

    with ``t'`` the next valid position of the row (Schulman et al. 2015, "High-Dimensional
    Continuous Control Using GAE", eq. 16). The returns, which the critic regresses on, use
    ``λ_c = lam_critic``: decoupled GAE (Yuan et al. 2025, "What's Behind PPO's Collapse in
    Long-CoT? Value Optimization Holds the Secret", VC-PPO, arXiv 2503.01491, which takes
    ``λ_c = 1`` so that the value targets are unbiased by the value model). The advantages use
    ``λ_b = lam``, or with ``lam_alpha = α > 0`` VAPO's length-adaptive
    :math:`\lambda_b = \operatorname{clamp}(1 - 1/(\alpha l_b), 0, 1)` with :math:`l_b` the number of
    valid response tokens of row ``b`` (Yue et al. 2025, "VAPO", arXiv 2504.05118; VAPO pairs it with
    ``λ_c = 1``). With ``lam_critic = lam`` and ``lam_alpha = 0`` this is veRL's ``"gae"``.

    Args:
        token_level_rewards: ``[B, T]`` float, or integer / bool (promoted as veRL promotes them).
        response_mask: ``[B, T]`` bool or 0/1, the positions trained on (0 at tool / observation
            tokens and padding in veRL's agent loop).
        values: ``[B, T]`` float, the critic's values. Required; ``None`` (what veRL's
            unpatched ``compute_advantage`` passes) is a ``TypeError`` that says so.
        config: veRL's ``algorithm`` config (``AlgoConfig`` or ``DictConfig``) or None; read with
            ``config.get``: ``gamma``, ``lam`` (when not passed), ``lam_critic`` (default: ``lam``),
            ``lam_alpha`` (default 0: off).
        gamma, lam: discount and λ in ``[0, 1]``; None: from ``config`` (default 1.0, veRL's).
        **kwargs: what veRL passes estimators (``index``, ``reward_baselines``), ignored.

    Returns:
        ``(advantages, returns)``, ``[B, T]``, dtype ``promote(rewards, values, mask)``. As in
        veRL's GAE, a masked position carries the advantage of the next valid position of its row
        (0 after the last) and its return is that position's :math:`A^{\lambda_c}` plus its own
        value; the advantages are whitened over the mask and written at every position.

    Raises:
        ValueError: ``gamma``, ``lam``, ``lam_critic`` outside ``[0, 1]`` or ``lam_alpha`` negative
            (or not finite numbers), each named; ``values`` of another shape than the rewards; a
            mask that is not bool / 0-1; fewer than 2 valid positions in the batch.
        TypeError: ``values`` missing, or a non-tensor argument.
    """
    fn = "compute_decoupled_gae_advantage_return"
    rewards, vals, m, out_dtype, gamma, lam = _inputs(
        fn, token_level_rewards, values, response_mask, config, gamma, lam
    )
    lam_critic = _setting(fn, "lam_critic", None, config, lam)
    alpha = _setting(fn, "lam_alpha", None, config, 0.0, hi=math.inf)
    row_lam = _length_adaptive_lam(m, alpha) if alpha > 0 else lam
    with torch.no_grad():
        adv, ret = _gae(rewards, vals, m, gamma=gamma, lam=row_lam, lam_critic=lam_critic)
        # ret - V at a valid position is its A^{λc}: what veRL's carry gives the masked positions.
        returns = torch.where(m, ret, _next_valid(ret - vals, m) + vals)
        advantages = _whiten(fn, _next_valid(adv, m), m, response_mask.dtype)
    return advantages.to(out_dtype), returns.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# GAE over agent turns


def _turn_ids_from_mask(m: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64: ``k`` on the ``k``-th run of valid positions of each row, -1 elsewhere.

    veRL's agent loop gives no turn boundaries, only ``response_mask`` (1 on the model's tokens,
    0 on tool / observation tokens), so a turn is a run of 1s; two agent turns with no
    environment token between them are one run, hence one turn."""
    start = m.clone()
    start[:, 1:] &= ~m[:, :-1]
    return torch.where(m, start.cumsum(-1) - 1, -1)


def _checked_turn_ids(fn: str, turn_ids: Any, m: torch.Tensor) -> torch.Tensor:
    _tensor(fn, "turn_ids", turn_ids)
    if turn_ids.is_floating_point() or turn_ids.is_complex() or turn_ids.dtype == torch.bool:
        raise ValueError(f"{fn}: turn_ids must be an integer tensor (int64), got dtype {turn_ids.dtype}")
    if turn_ids.shape != m.shape:
        raise ValueError(f"{fn}: turn_ids has shape {tuple(turn_ids.shape)} but the rewards have {tuple(m.shape)}")
    if turn_ids.device != m.device:
        raise ValueError(f"{fn}: turn_ids is on {turn_ids.device} but the rewards are on {m.device}")
    ids = turn_ids.long()
    # A token trained with no turn (or a turn token not trained) has no consistent meaning for
    # both veRL's losses, which read response_mask, and the estimator, which reads turn_ids.
    differ = int(((ids >= 0) != m).sum())
    if differ:
        raise ValueError(f"{fn}: turn_ids must be >= 0 exactly where response_mask is 1; {differ} position(s) differ")
    return ids


def compute_turn_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: Optional[torch.Tensor] = None,
    config: Any = None,
    gamma: Optional[float] = None,
    lam: Optional[float] = None,
    turn_ids: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""GAE over each row's agent turns, one action per turn: veRL's estimator ``"pyppo_gae_turn"``.

    For turn ``k`` of a row with first position ``s_k``, ``V_k = values[b, s_k]`` and ``R_k`` the
    sum of its rewards:

    .. math::
        \delta_k = R_k + \gamma V_{k+1} - V_k,\quad A_k = \delta_k + \gamma\lambda A_{k+1},\quad
        \text{return}_k = A_k + V_k

    (Schulman et al. 2015, eq. 16, with a turn as the time step; ``V`` and ``A`` after the last
    turn are 0), by ``pyppo.ops.turn_gae``. Every token of turn ``k`` gets ``A_k`` (then whitened
    over ``response_mask``, as veRL whitens GAE) and the return ``A_k + V_k``; veRL's critic then
    regresses each of those tokens' values on that return.

    Turns: ``turn_ids`` when given (``pyppo.ops.turn_gae``'s convention: the turn's index on agent
    tokens, -1 elsewhere; it must be ``>= 0`` exactly where ``response_mask`` is 1); otherwise
    each run of 1s of ``response_mask`` is a turn, since veRL's agent loop sets it to 0 on
    tool / observation tokens. Derived turns merge two agent turns with no environment token
    between them into one.

    Args:
        token_level_rewards: ``[B, T]`` float, or integer / bool (promoted as veRL promotes them).
        response_mask: ``[B, T]`` bool or 0/1.
        values: ``[B, T]`` float, the critic's values (read at each turn's first token). Required.
        config: veRL's ``algorithm`` config or None, read with ``config.get``: ``gamma``, ``lam``
            (when not passed), ``gamma_turn`` and ``lam_turn`` (the per-turn γ and λ; default
            ``gamma`` and ``lam``).
        gamma, lam: in ``[0, 1]``; None: from ``config`` (default 1.0, veRL's).
        turn_ids: optional ``[B, T]`` integer tensor, as above.
        **kwargs: what veRL passes estimators (``index``, ``reward_baselines``), ignored.

    Returns:
        ``(advantages, returns)``, ``[B, T]``, dtype ``promote(rewards, values, mask)``; a masked
        position carries the advantage and the return of the next valid position of its row (0
        after the last), the advantages are whitened over the mask and written at every position.

    Raises:
        ValueError: ``gamma``, ``lam``, ``gamma_turn`` or ``lam_turn`` outside ``[0, 1]``, each
            named; ``values`` or ``turn_ids`` of another shape, ``turn_ids`` not integer or not
            agreeing with ``response_mask``; a mask that is not bool / 0-1; fewer than 2 valid
            positions in the batch.
        TypeError: ``values`` missing, or a non-tensor argument.
    """
    fn = "compute_turn_gae_advantage_return"
    rewards, vals, m, out_dtype, gamma, lam = _inputs(
        fn, token_level_rewards, values, response_mask, config, gamma, lam
    )
    gamma_turn = _setting(fn, "gamma_turn", None, config, gamma)
    lam_turn = _setting(fn, "lam_turn", None, config, lam)
    ids = _turn_ids_from_mask(m) if turn_ids is None else _checked_turn_ids(fn, turn_ids, m)
    with torch.no_grad():
        adv, ret = _turn_gae(rewards, vals, ids, gamma=gamma_turn, lam=lam_turn)
        returns = _next_valid(ret, m)
        advantages = _whiten(fn, _next_valid(adv, m), m, response_mask.dtype)
    return advantages.to(out_dtype), returns.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# veRL's trainer entry point


_ESTIMATORS = {PYPPO_GAE: compute_decoupled_gae_advantage_return, PYPPO_GAE_TURN: compute_turn_gae_advantage_return}


def _verl_compute_advantage() -> Any:
    fn = _patching.original("verl", TRAINER_MODULE, "compute_advantage")
    if fn is compute_advantage:
        raise RuntimeError(
            f"{TRAINER_MODULE}.compute_advantage is pyppo's adapter, but no active patch holds veRL's own; "
            "install it with pyppo.integrations.verl.patch() instead of assigning it"
        )
    return fn


def compute_advantage(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1, norm_adv_by_std_in_grpo=True, config=None):
    """veRL 0.9.1's ``compute_advantage`` (``verl.trainer.ppo.ray_trainer``), which also feeds
    the critic's values to pyppo's critic estimators.

    For ``adv_estimator`` ``"pyppo_gae"`` (:func:`compute_decoupled_gae_advantage_return`) or
    ``"pyppo_gae_turn"`` (:func:`compute_turn_gae_advantage_return`), it calls the estimator with
    ``data.batch``'s ``token_level_rewards``, ``response_mask`` (computed first by veRL's
    ``compute_response_mask`` when absent, as veRL does), ``values``, ``turn_ids`` (turn estimator,
    when present) and ``gamma``, ``lam``, ``config``, and writes ``advantages`` and ``returns``
    into ``data.batch``. Every other estimator (``"gae"``, ``"grpo"``, registered ones) goes to
    veRL's own ``compute_advantage`` with the same arguments, unchanged.

    Args:
        data: veRL's ``DataProto``; ``data.batch`` holds ``[B, T]`` tensors.
        adv_estimator: the estimator's name (str or veRL's ``AdvantageEstimator``).
        gamma, lam: ``algorithm.gamma`` and ``algorithm.lam``.
        num_repeat, norm_adv_by_std_in_grpo: passed on to veRL for its estimators.
        config: veRL's ``algorithm`` config.

    Returns:
        ``data``, with ``advantages`` and ``returns`` set.

    Raises:
        ValueError: a pyppo estimator and no ``values`` in ``data.batch`` (the critic is off:
            ``critic.enable=True``), and whatever the estimator raises.
        ImportError: veRL's trainer module cannot be imported.

    Matches veRL 0.9.1 ``verl.trainer.ppo.ray_trainer.compute_advantage`` for its own estimators
    (it is what runs them).
    """
    name = getattr(adv_estimator, "value", adv_estimator)
    estimator = _ESTIMATORS.get(name) if isinstance(name, str) else None
    if estimator is None:
        return _verl_compute_advantage()(
            data,
            adv_estimator=adv_estimator,
            gamma=gamma,
            lam=lam,
            num_repeat=num_repeat,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            config=config,
        )
    batch = data.batch
    if "response_mask" not in batch.keys():
        batch["response_mask"] = importlib.import_module(TRAINER_MODULE).compute_response_mask(data)
    if "values" not in batch.keys():
        raise ValueError(
            f"compute_advantage: adv_estimator {name!r} needs data.batch['values'], the critic's values; "
            "set critic.enable=True (veRL turns the critic on by itself only for 'gae')"
        )
    extra = {"turn_ids": batch.get("turn_ids", None)} if estimator is compute_turn_gae_advantage_return else {}
    advantages, returns = estimator(
        token_level_rewards=batch["token_level_rewards"],
        response_mask=batch["response_mask"],
        values=batch["values"],
        config=config,
        gamma=gamma,
        lam=lam,
        **extra,
    )
    batch["advantages"] = advantages
    batch["returns"] = returns
    return data
