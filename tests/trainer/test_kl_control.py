"""KL coefficient controllers (Ziegler et al. 2019, §2.2)."""

from __future__ import annotations

import math

import pytest

from pyppo.trainer.kl_controllers import AdaptiveKLController, FixedKLController


def test_fixed_never_changes():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 10.0, 1e6):
        assert ctl.update(kl, 64) == 0.05
    assert ctl.value == 0.05
    assert FixedKLController(0.0).value == 0.0


@pytest.mark.parametrize(
    "kl, expected_error", [(6.0, 0.2), (4.0, -0.2), (5.5, 0.1), (4.75, -0.05), (5.0, 0.0), (0.0, -0.2)]
)
def test_adaptive_matches_formula(kl, expected_error):
    ctl = AdaptiveKLController(0.1, target=5.0, horizon=1000)
    new = ctl.update(kl, 16)
    assert new == pytest.approx(0.1 * (1 + expected_error * 16 / 1000), rel=1e-12)
    assert ctl.value == new


def test_adaptive_moves_towards_target_over_many_steps():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    for _ in range(50):
        ctl.update(3.0, 10)  # KL too high: β grows by exactly (1 + 0.2 * 0.1) per step
    assert ctl.value == pytest.approx(0.1 * 1.02**50, rel=1e-10)
    for _ in range(50):
        ctl.update(0.0, 10)
    assert ctl.value == pytest.approx(0.1 * 1.02**50 * 0.98**50, rel=1e-10)


def test_state_dict_round_trip():
    a = AdaptiveKLController(0.2, target=3.0, horizon=500)
    a.update(7.0, 32)
    b = AdaptiveKLController(1.0, target=1.0, horizon=1)
    b.load_state_dict(a.state_dict())
    assert (b.value, b.target, b.horizon) == (a.value, a.target, a.horizon)
    assert b.update(2.0, 8) == a.update(2.0, 8)
    f = FixedKLController(0.3)
    g = FixedKLController(0.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.3
    with pytest.raises(ValueError, match="state"):
        g.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="state"):
        a.load_state_dict(f.state_dict())


@pytest.mark.parametrize(
    "args, match",
    [
        ((0.0, 1.0, 10.0), "init_kl_coef"),
        ((-1.0, 1.0, 10.0), "init_kl_coef"),
        ((0.1, 0.0, 10.0), "target"),
        ((0.1, 1.0, 0.0), "horizon"),
        ((0.1, math.nan, 1.0), "target"),
        ((0.1, 1.0, math.inf), "horizon"),
    ],
)
def test_adaptive_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveKLController(*args)


def test_bad_update_and_fixed_arguments():
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-0.1)
    ctl = AdaptiveKLController(0.1, 1.0, 10.0)
    with pytest.raises(ValueError, match="current_kl"):
        ctl.update(math.nan, 1)
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(1.0, -1)
