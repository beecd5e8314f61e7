"""KL-penalty coefficient controllers (``docs/trainer.md``, point 7 of a step).

The shaped reward is ``score − β · KL(π ‖ π_ref)`` per token (InstructGPT eq. 2). ``β`` is either
fixed or adapted so that the measured KL tracks a target (Ziegler et al. 2019, "Fine-Tuning Language
Models from Human Preferences", §2.2)::

    e_t     = clip(KL_t / KL_target − 1, −0.2, 0.2)
    β_{t+1} = β_t · (1 + K_β · e_t),   K_β = n_steps / horizon

where ``KL_t`` is the current per-sequence KL (summed over tokens, averaged over sequences) and
``n_steps`` the number of samples (sequences) since the last update.
"""

from __future__ import annotations

import math
from typing import Any, Dict

__all__ = ["FixedKLController", "AdaptiveKLController", "make_kl_controller"]


def _check_number(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


class FixedKLController:
    """A constant KL coefficient ``β``.

    Args:
        kl_coef: ``β >= 0``.

    Raises:
        ValueError: ``kl_coef`` negative or not finite.
    """

    def __init__(self, kl_coef: float):
        self.value = _check_number("kl_coef", kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """No-op (the coefficient is fixed); returns the coefficient."""
        return self.value

    def state_dict(self) -> Dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Raises ``ValueError`` for another controller's state."""
        if state.get("type") != "fixed":
            raise ValueError(f"state: expected a FixedKLController state, got type {state.get('type')!r}")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (§2.2): a proportional controller on log β.

    Args:
        init_kl_coef: initial ``β > 0`` (a zero β could never grow: the update is multiplicative).
        target: target KL ``> 0`` in nats per sequence (summed over tokens).
        horizon: ``> 0``, in samples; larger means slower adaptation.

    Raises:
        ValueError: a non-positive or non-finite argument.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value = _check_number("init_kl_coef", init_kl_coef, positive=True)
        self.target = _check_number("target", target, positive=True)
        self.horizon = _check_number("horizon", horizon, positive=True)

    def update(self, current_kl: float, n_steps: int) -> float:
        """One controller step; returns the new coefficient.

        Args:
            current_kl: measured KL (nats per sequence) of the last batch.
            n_steps: number of samples the measurement covers (the batch size), ``>= 0``.

        Raises:
            ValueError: ``current_kl`` not finite, or ``n_steps`` negative.
        """
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl!r}")
        if isinstance(n_steps, bool) or int(n_steps) != n_steps or n_steps < 0:
            raise ValueError(f"n_steps must be a non-negative integer, got {n_steps!r}")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> Dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Raises ``ValueError`` for another controller's state."""
        if state.get("type") != "adaptive":
            raise ValueError(f"state: expected an AdaptiveKLController state, got type {state.get('type')!r}")
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


def make_kl_controller(config) -> "FixedKLController | AdaptiveKLController":
    """The controller of a :class:`~pyppo.config.PPOConfig`: adaptive from ``kl_coef`` towards
    ``target_kl`` over ``kl_horizon`` samples when ``target_kl`` is set, else fixed at ``kl_coef``."""
    if config.target_kl is not None:
        return AdaptiveKLController(config.kl_coef, config.target_kl, config.kl_horizon)
    return FixedKLController(config.kl_coef)
