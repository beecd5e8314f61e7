"""PPO policy / value losses, loss aggregation and explained variance against the float64
references of tests/support/reference.py (written token by token)."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo.ops.losses import (
    LOG_RATIO_CLAMP,
    LOSS_AGG_MODES,
    aggregate_loss,
    explained_variance,
    loss_normalizer,
    loss_token_weights,
    ppo_policy_loss,
    ppo_value_loss,
)
from support.reference import ref_explained_variance, ref_ppo_policy_loss, ref_ppo_value_loss

STAT_KEYS = ("clipfrac", "clipfrac_lower", "approx_kl", "ratio_mean", "ratio_max", "logratio_clampfrac")


def random_inputs(seed, B=6, T=9, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.7  # holes everywhere
    mask[1] = False  # an all-masked row
    mask[2, :] = False
    mask[2, 4] = True  # a single valid token in the middle
    return lp, old, adv, mask


def ref_grad(ref, leaf):
    """Autograd gradient of a reference loss; a loss made only of clipped (constant) terms has none."""
    return torch.autograd.grad(ref, leaf)[0] if ref.requires_grad else torch.zeros_like(leaf)


def assert_stats_match(stats, ref_stats, rel=1e-6, abs_=1e-7):
    for k, v in ref_stats.items():
        assert stats[k].dtype == torch.float32 and stats[k].dim() == 0 and not stats[k].requires_grad, k
        assert stats[k].item() == pytest.approx(v, rel=rel, abs=abs_), k


# ------------------------------------------------------------------------------ policy loss
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("clips", [(0.2, 0.2), (0.1, 0.28)])
@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_matches_reference(mode, dual, clips, seed):
    lp, old, adv, mask = random_inputs(seed)
    lo, hi = clips
    norm = 7.0 if mode == "seq-mean-token-sum-norm" else None
    lp_a = lp.clone().requires_grad_(True)
    loss, stats = ppo_policy_loss(
        lp_a, old, adv, mask, cliprange_low=lo, cliprange_high=hi, dual_clip=dual, loss_agg=mode, loss_agg_norm=norm
    )
    lp_r = lp.clone().requires_grad_(True)
    ref, ref_stats = ref_ppo_policy_loss(lp_r, old, adv, mask, lo, hi, dual, mode, norm)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    assert set(stats) == set(STAT_KEYS)
    assert_stats_match(stats, ref_stats)
    (g,) = torch.autograd.grad(loss, lp_a)
    (g_ref,) = torch.autograd.grad(ref, lp_r)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)
    assert torch.all(g[~mask] == 0)


def test_default_norm_is_T():
    lp, old, adv, mask = random_inputs(3, T=11)
    loss, _ = ppo_policy_loss(lp, old, adv, mask, loss_agg="seq-mean-token-sum-norm")
    ref, _ = ref_ppo_policy_loss(lp, old, adv, mask, mode="seq-mean-token-sum-norm", norm=11)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)


def test_seq_mean_token_sum_norm_is_verl_divided_by_the_sequence_count():
    # veRL's agg_loss "seq-mean-token-sum-norm" is sum_b sum_t m*L / T (a sum over sequences);
    # pyppo's is the mean over the sequences with a valid token, over the same constant (docs/ops.md).
    g = torch.Generator().manual_seed(11)
    loss_mat = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) < 0.6
    mask[3] = False
    mask[0, 0] = mask[1, 0] = mask[2, 0] = mask[4, 0] = True
    verl = (loss_mat * mask).sum() / mask.shape[-1]
    ours = aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm")
    assert ours.item() == pytest.approx(verl.item() / 4, rel=1e-12)  # 4 rows have a valid token
    assert ours.item() != pytest.approx(verl.item(), rel=1e-3)


def test_rows_without_valid_tokens_are_excluded_from_seq_means():
    loss_mat = torch.tensor([[1.0, 3.0, 0.0], [100.0, 100.0, 100.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert aggregate_loss(loss_mat, mask, "token-mean").item() == pytest.approx(2.0)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 2.0) / 2)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((4.0 + 2.0) / 2)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx(3.0 / 3)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_agg_norm=6).item() == pytest.approx(0.5)


def test_clipfrac_and_dual_clip_hand_cases():
    # (ratio, advantage): clipped-term larger?  dual bound active (c=3)?
    cases = [
        (1.5, 1.0, True, False),
        (0.5, 1.0, False, False),
        (1.5, -1.0, False, False),
        (0.5, -1.0, True, False),
        (5.0, -1.0, False, True),
        (1.0, 2.0, False, False),
    ]
    ratio = torch.tensor([[c[0] for c in cases]], dtype=torch.float64)
    adv = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    lp = old + ratio.log()
    mask = torch.ones_like(ratio, dtype=torch.bool)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0)
    assert stats["clipfrac"].item() == pytest.approx(2 / 6)
    assert stats["clipfrac_lower"].item() == pytest.approx(1 / 6)
    expected = [-1.2, -0.5, 1.5, 0.8, 3.0, -2.0]
    assert loss.item() == pytest.approx(sum(expected) / 6)
    assert stats["ratio_max"].item() == pytest.approx(5.0)


def test_ratio_one_gives_exact_stats():
    lp, _, adv, mask = random_inputs(4)
    lp = lp.float()
    loss, stats = ppo_policy_loss(lp, lp.clone(), adv.float(), mask)
    assert stats["ratio_mean"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["approx_kl"].item() == 0.0 and stats["clipfrac"].item() == 0.0
    assert stats["logratio_clampfrac"].item() == 0.0
    assert loss.item() == pytest.approx(-adv[mask].mean().item(), rel=1e-5)


@pytest.mark.parametrize("scale", [1e-5, 1e-3, 0.1])
def test_approx_kl_is_accurate_for_the_small_log_ratios_of_a_ppo_step(scale):
    # approx_kl's k3 = r − 1 − δ in float32, as written, rounds at the scale of exp(δ) ~ 1: its
    # batch mean is 0.4% off at |δ| ~ 1e-3, 26% at 1e-4 and 46 times the value at 1e-5.
    lp, _, adv, mask = random_inputs(5, B=8, T=256)
    g = torch.Generator().manual_seed(6)
    old = lp + torch.randn(lp.shape, generator=g, dtype=torch.float64) * scale
    lp, old = lp.float(), old.float()
    _, stats = ppo_policy_loss(lp, old, adv.float(), mask)
    d = (lp.double() - old.double())[mask]
    exact = (torch.expm1(d) - d).mean().item()
    assert stats["approx_kl"].item() == pytest.approx(exact, rel=1e-5)


def test_masked_garbage_does_not_leak():
    lp, old, adv, mask = random_inputs(5)
    lp2, old2, adv2 = lp.clone(), old.clone(), adv.clone()
    lp2[~mask] = -math.inf
    old2[~mask] = math.nan
    adv2[~mask] = math.inf
    a = lp2.clone().requires_grad_(True)
    loss2, stats2 = ppo_policy_loss(a, old2, adv2, mask, dual_clip=2.0)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, dual_clip=2.0)
    assert loss2.item() == loss.item()
    assert all(stats2[k].item() == stats[k].item() for k in stats)
    (g,) = torch.autograd.grad(loss2, a)
    assert torch.isfinite(g).all() and torch.all(g[~mask] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype):
    lp, old, adv, mask = random_inputs(6)
    loss, stats = ppo_policy_loss(lp.to(dtype), old.to(dtype), adv.to(dtype), mask.float())
    assert loss.dtype == torch.float32
    ref, _ = ref_ppo_policy_loss(lp.to(dtype), old.to(dtype), adv.to(dtype), mask)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    vl, vstats = ppo_value_loss(lp.to(dtype), old.to(dtype), adv.to(dtype), mask)
    assert vl.dtype == torch.float32 and vstats["vf_clipfrac"].dtype == torch.float32


def test_non_contiguous_inputs():
    lp, old, adv, mask = random_inputs(7, B=6, T=18)
    sl = (slice(None), slice(None, None, 2))
    loss, _ = ppo_policy_loss(lp[sl], old[sl], adv[sl], mask[sl], loss_agg="seq-mean-token-mean")
    ref, _ = ref_ppo_policy_loss(lp[sl], old[sl], adv[sl], mask[sl], mode="seq-mean-token-mean")
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ extreme log-ratios
def extreme_inputs(seed, log_ratio, dtype):
    """Ordinary random inputs with every third valid token's log-ratio set to ``log_ratio``."""
    lp, old, adv, mask = random_inputs(seed)
    extreme = torch.zeros_like(mask)
    extreme.view(-1)[::3] = True
    extreme &= mask
    old = torch.where(extreme, lp - log_ratio, old)
    return lp.to(dtype), old.to(dtype), adv.to(dtype), mask, extreme


@pytest.mark.parametrize("log_ratio", [100.0, -100.0, 1000.0, -1000.0, math.inf, -math.inf])
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_extreme_log_ratios_give_finite_loss_grad_and_stats(log_ratio, dual, mode, dtype):
    # An old probability below e^-88 (or 0) puts exp(log-ratio) beyond float32: the clamp to ±20
    # must keep everything finite and equal to the float64 reference computed with the same bound.
    lp, old, adv, mask, extreme = extreme_inputs(12, log_ratio, dtype)
    assert extreme.sum() >= 5
    a = lp.clone().requires_grad_(True)
    loss, stats = ppo_policy_loss(a, old, adv, mask, dual_clip=dual, loss_agg=mode)
    (g,) = torch.autograd.grad(loss, a)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert all(torch.isfinite(v) for v in stats.values())

    lp_r = lp.to(torch.float64).requires_grad_(True)
    ref, ref_stats = ref_ppo_policy_loss(lp_r, old, adv, mask, dual=dual, mode=mode, norm=mask.shape[-1])
    (g_ref,) = torch.autograd.grad(ref, lp_r)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), ref.detach(), **tol)
    # The gradient comes back in the input's dtype: allow its rounding.
    gtol = {torch.bfloat16: dict(rtol=8e-3, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-6)}.get(dtype, tol)
    torch.testing.assert_close(g.double(), g_ref, **gtol)
    assert_stats_match(stats, ref_stats, rel=1e-5, abs_=1e-6)
    # Where the bound is active the token's gradient is exactly 0.
    assert torch.all(g[extreme] == 0)
    assert stats["logratio_clampfrac"].item() == pytest.approx(extreme.sum().item() / mask.sum().item())


# (log-ratio, advantage, dual clip) -> the token's loss and gradient after the clamp (docs/ops.md)
E20 = math.exp(20.0)
HAND_CASES = [
    (100.0, 1.0, None, -1.2, 0.0),  # upper clip active anyway
    (100.0, -1.0, None, E20, 0.0),  # the one real change: -A*r capped at -A*e^20, gradient lost
    (100.0, -1.0, 3.0, 3.0, 0.0),  # dual bound active anyway
    (-100.0, 1.0, None, -math.exp(-20.0), 0.0),  # value moved by < e^-20, tiny gradient dropped
    (-100.0, -1.0, None, 0.8, 0.0),  # lower clip active anyway
    (19.5, -1.0, None, math.exp(19.5), math.exp(19.5)),  # inside the bound: untouched
    (-19.5, 1.0, None, -math.exp(-19.5), -math.exp(-19.5)),
]


@pytest.mark.parametrize("log_ratio, a, dual, loss_expected, grad_expected", HAND_CASES)
def test_log_ratio_clamp_hand_cases(log_ratio, a, dual, loss_expected, grad_expected):
    lp = torch.tensor([[-0.5]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - log_ratio
    loss, stats = ppo_policy_loss(lp, old, torch.tensor([[a]], dtype=torch.float64), torch.ones(1, 1), dual_clip=dual)
    (g,) = torch.autograd.grad(loss, lp)
    assert loss.item() == pytest.approx(loss_expected, rel=1e-9)
    assert g.item() == pytest.approx(grad_expected, rel=1e-9, abs=0.0)
    assert stats["logratio_clampfrac"].item() == float(abs(log_ratio) > LOG_RATIO_CLAMP)


def test_log_ratio_bound_is_20():
    assert LOG_RATIO_CLAMP == 20.0
    adv = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.tensor([[19.99, 20.01]], dtype=torch.float64)
    loss, stats = ppo_policy_loss(lp, old, adv, torch.ones(1, 2), loss_agg="seq-mean-token-sum")
    (g,) = torch.autograd.grad(loss, lp)
    assert g[0, 0].item() == pytest.approx(math.exp(19.99), rel=1e-9) and g[0, 1].item() == 0.0
    assert loss.item() == pytest.approx(math.exp(19.99) + E20, rel=1e-9)
    assert stats["ratio_max"].item() == pytest.approx(E20, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_infinite_log_probs_at_valid_positions(dtype):
    # old = -inf (a token the old policy could not sample), logprobs = -inf, old = +inf (invalid,
    # but must not poison the batch): bounded, finite, zero gradient on those tokens.
    lp = torch.tensor([[-1.0, -math.inf, -2.0, -0.5]], dtype=dtype, requires_grad=True)
    old = torch.tensor([[-math.inf, -1.0, math.inf, -0.4]], dtype=dtype)
    adv = torch.tensor([[-1.0, 1.0, -1.0, 0.5]], dtype=dtype)
    loss, stats = ppo_policy_loss(lp, old, adv, torch.ones(1, 4))
    (g,) = torch.autograd.grad(loss, lp)
    r3 = math.exp(-0.1)
    expected = [E20, -math.exp(-20.0), 0.8, -0.5 * r3]
    assert loss.item() == pytest.approx(sum(expected) / 4, rel=1e-6)
    assert torch.isfinite(g).all() and g[0, :3].eq(0).all()
    assert g[0, 3].item() == pytest.approx(-0.5 * r3 / 4, rel=1e-6)
    assert all(torch.isfinite(v) for v in stats.values())
    assert stats["approx_kl"].item() == pytest.approx(
        ((E20 - 1 - 20) + (math.exp(-20) - 1 + 20) + (math.exp(-20) - 1 + 20) + (r3 - 1 + 0.1)) / 4, rel=1e-6
    )
    assert stats["logratio_clampfrac"].item() == 0.75


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_ordinary_log_ratios_are_unchanged_by_the_clamp(mode, dual):
    # |log-ratio| up to ~12 (scale 3): the textbook formula without any bound, in float64.
    lp, old, adv, mask = random_inputs(13, scale=3.0)
    assert (lp - old)[mask].abs().max() > 5
    norm = 5.0 if mode == "seq-mean-token-sum-norm" else None
    a = lp.clone().requires_grad_(True)
    loss, stats = ppo_policy_loss(a, old, adv, mask, dual_clip=dual, loss_agg=mode, loss_agg_norm=norm)
    r = lp.clone().requires_grad_(True)
    ref, ref_stats = ref_ppo_policy_loss(r, old, adv, mask, dual=dual, mode=mode, norm=norm, log_ratio_clamp=None)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, a)[0], torch.autograd.grad(ref, r)[0], rtol=1e-10, atol=1e-12)
    ref_stats["logratio_clampfrac"] = 0.0
    assert_stats_match(stats, ref_stats)
    # float32 inputs: float32 arithmetic against the same textbook float64 value.
    loss32, _ = ppo_policy_loss(
        lp.float(), old.float(), adv.float(), mask, dual_clip=dual, loss_agg=mode, loss_agg_norm=norm
    )
    ref32, _ = ref_ppo_policy_loss(
        lp.float(), old.float(), adv.float(), mask, dual=dual, mode=mode, norm=norm, log_ratio_clamp=None
    )
    assert loss32.item() == pytest.approx(ref32.item(), rel=1e-5, abs=1e-5)


# ------------------------------------------------------------------------------ value loss
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("eps", [0.2, None])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_loss_matches_reference(mode, eps, seed):
    v_old, v, ret, mask = random_inputs(seed, scale=0.3)
    norm = 5.0 if mode == "seq-mean-token-sum-norm" else None
    va = v.clone().requires_grad_(True)
    loss, stats = ppo_value_loss(va, v_old, ret, mask, cliprange_value=eps, loss_agg=mode, loss_agg_norm=norm)
    vr = v.clone().requires_grad_(True)
    ref, ref_stats = ref_ppo_value_loss(vr, v_old, ret, mask, eps, mode, norm)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    assert set(stats) == {"vf_clipfrac", "explained_variance"}
    assert_stats_match(stats, ref_stats, rel=1e-5, abs_=1e-6)
    (g,) = torch.autograd.grad(loss, va)
    (g_ref,) = torch.autograd.grad(ref, vr)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------ explained variance
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(6, 9), (54,), (3, 2, 9)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_explained_variance_matches_reference(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    ret = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1
    values = (ret + torch.randn(shape, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    ret = ret.to(dtype)
    mask = torch.rand(shape, generator=g) < 0.7
    ev = explained_variance(values, ret, mask)
    assert ev.dtype == torch.float32 and ev.dim() == 0
    ref = ref_explained_variance(values, ret, mask)
    assert 0.3 < ref < 1.0  # a meaningful value, not an edge case
    assert ev.item() == pytest.approx(ref, rel=1e-6, abs=1e-6)
    # The same number with torch's Bessel-corrected variances: the n - 1 cancels in the ratio.
    r, v = ret[mask].double(), values[mask].double()
    assert ev.item() == pytest.approx((1 - (r - v).var() / r.var()).item(), rel=1e-6, abs=1e-6)


def test_explained_variance_pools_rows_and_ignores_masked_garbage():
    ret = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [5.0, 6.0, 7.0]])
    values = torch.tensor([[1.5, 1.5, math.nan], [3.5, math.inf, -math.inf], [4.0, 6.5, 6.0]])
    ret_garbage = ret.clone()
    ret_garbage[0, 2], ret_garbage[1, 1] = math.nan, -math.inf
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    ev = explained_variance(values, ret_garbage, mask)
    # by hand: R = [1, 2, 3, 5, 6, 7] (mean 4, SS 28), d = R - V = [-.5, .5, -.5, 1, -.5, 1] (mean 1/6)
    d = [-0.5, 0.5, -0.5, 1.0, -0.5, 1.0]
    ss_d = sum((x - 1 / 6) ** 2 for x in d)
    assert ev.item() == pytest.approx(1 - ss_d / 28, rel=1e-6)
    assert ev.item() == pytest.approx(ref_explained_variance(values, ret_garbage, mask), rel=1e-6)


@pytest.mark.parametrize(
    "values, returns, mask, expected",
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1, 1, 1], 1.0),  # perfect
        ([2.0, 2.0, 2.0], [1.0, 2.0, 3.0], [1, 1, 1], 0.0),  # the mean return: explains nothing
        ([3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [1, 1, 1], -3.0),  # 1 - Var[2R - 4] / Var[R]
        ([0.3, 9.0, 5.0], [2.0, 2.0, 2.0], [1, 1, 1], 0.0),  # constant returns: undefined -> 0
        ([2.0, 9.0, 5.0], [2.0, 2.0, 2.0], [1, 1, 1], 0.0),  # ... even with a perfect prediction there
        ([0.3, 9.0, 5.0], [1.0, 2.0, 3.0], [0, 1, 0], 0.0),  # one valid token -> 0
        ([0.3, 9.0, 5.0], [1.0, 2.0, 3.0], [0, 0, 0], 0.0),  # none -> 0
    ],
)
def test_explained_variance_edge_cases(values, returns, mask, expected):
    ev = explained_variance(torch.tensor(values), torch.tensor(returns), torch.tensor(mask))
    assert ev.item() == pytest.approx(expected, abs=1e-6)
    assert ref_explained_variance(torch.tensor(values), torch.tensor(returns), torch.tensor(mask)) == pytest.approx(
        expected, abs=1e-12
    )


def test_explained_variance_non_finite_at_a_valid_position_is_nan():
    ret = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.ones(3, dtype=torch.bool)
    assert math.isnan(explained_variance(torch.tensor([1.0, math.nan, 3.0]), ret, mask).item())
    assert math.isnan(
        explained_variance(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, math.inf, 3.0]), mask).item()
    )


def test_explained_variance_is_detached_and_not_a_mean_over_micro_batches():
    lp_old, v, ret, mask = random_inputs(14, B=8, T=7, scale=0.5)
    va = v.clone().requires_grad_(True)
    full = explained_variance(va, ret, mask)
    assert not full.requires_grad
    # ppo_value_loss's stat over the whole minibatch is the same function.
    _, stats = ppo_value_loss(va, lp_old, ret, mask)
    assert stats["explained_variance"].item() == full.item()
    assert full.item() == pytest.approx(ref_explained_variance(v, ret, mask), rel=1e-6)
    # Reordering or splitting the rows does not change the batch's value...
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    assert explained_variance(v[perm], ret[perm], mask[perm]).item() == pytest.approx(full.item(), rel=1e-6)
    # ...while the per-micro-batch mean the trainer used to log depends on the split.
    means = [
        torch.stack([explained_variance(v[i : i + k], ret[i : i + k], mask[i : i + k]) for i in range(0, 8, k)]).mean()
        for k in (2, 4)
    ]
    assert abs(means[0].item() - full.item()) > 1e-3 and abs(means[0].item() - means[1].item()) > 1e-3


def test_explained_variance_bad_arguments():
    x = torch.randn(3, 4)
    m = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="returns"):
        explained_variance(x, x[:, :3], m)
    with pytest.raises(ValueError, match="values"):
        explained_variance(x.long(), x, m)
    with pytest.raises(ValueError, match="values"):
        explained_variance(x.tolist(), x, m)
    with pytest.raises(ValueError, match="response_mask"):
        explained_variance(x, x, m[:2])
    with pytest.raises(ValueError, match="response_mask"):
        explained_variance(x, x, m.float() * 2)


# ------------------------------------------------------------------------------ tiny batches
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("shape, pos", [((1, 1), (0, 0)), ((3, 4), (2, 1))])
@pytest.mark.parametrize("with_normalizer", [False, True])
def test_one_valid_token_in_the_whole_batch(mode, shape, pos, with_normalizer):
    # Batch size 1 with an EOS-only response: one valid token. No variance is involved, so the
    # losses are defined; explained variance is undefined and reported as 0.
    g = torch.Generator().manual_seed(15)
    lp, old, adv = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[pos] = True
    kw = dict(loss_agg=mode, normalizer=loss_normalizer(mask, mode) if with_normalizer else None)
    a, r = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    loss, stats = ppo_policy_loss(a, old, adv, mask, dual_clip=2.0, **kw)
    ref, ref_stats = ref_ppo_policy_loss(r, old, adv, mask, dual=2.0, mode=mode, norm=shape[1])
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    assert_stats_match(stats, ref_stats)
    (g,) = torch.autograd.grad(loss, a)
    torch.testing.assert_close(g, ref_grad(ref, r), rtol=1e-12, atol=1e-12)
    assert torch.isfinite(g).all() and (g[~mask] == 0).all()

    for eps in (0.2, None):
        va, vr = adv.clone().requires_grad_(True), adv.clone().requires_grad_(True)
        vloss, vstats = ppo_value_loss(va, lp, old, mask, cliprange_value=eps, **kw)
        vref, vref_stats = ref_ppo_value_loss(vr, lp, old, mask, eps, mode, shape[1])
        torch.testing.assert_close(vloss, vref.detach(), rtol=1e-12, atol=1e-12)
        assert vstats["explained_variance"].item() == 0.0 and vref_stats["explained_variance"] == 0.0
        (gv,) = torch.autograd.grad(vloss, va)
        torch.testing.assert_close(gv, ref_grad(vref, vr), rtol=1e-12, atol=1e-12)
        assert torch.isfinite(gv).all() and (gv[~mask] == 0).all()
        assert eps is not None or gv[pos] != 0


# ------------------------------------------------------------------------------ accumulation
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_normalizer_makes_micro_batches_sum_to_minibatch(mode):
    lp, old, adv, mask = random_inputs(8, B=8, T=7)
    kw = dict(loss_agg=mode, dual_clip=2.5)
    full, _ = ppo_policy_loss(lp, old, adv, mask, **kw)
    n = loss_normalizer(mask, mode)
    parts = [
        ppo_policy_loss(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], normalizer=n, **kw)[0]
        for i in range(0, 8, 2)
    ]  # rows 1 and 2 (all-masked / one token) fall in the same micro-batch
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-12)
    vfull, _ = ppo_value_loss(lp, old, adv, mask, loss_agg=mode)
    vparts = [
        ppo_value_loss(lp[i : i + 4], old[i : i + 4], adv[i : i + 4], mask[i : i + 4], loss_agg=mode, normalizer=n)[0]
        for i in range(0, 8, 4)
    ]
    torch.testing.assert_close(sum(vparts), vfull, rtol=1e-12, atol=1e-12)


def test_loss_normalizer_counts():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert loss_normalizer(mask, "token-mean") == 4
    for mode in LOSS_AGG_MODES[1:]:
        assert loss_normalizer(mask, mode) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("normalizer", [None, 13])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_token_weights_are_the_gradient_of_aggregate_loss(mode, normalizer, dtype):
    # linear_ppo_loss takes the aggregation as these weights: they must be the gradient of
    # aggregate_loss bit for bit, and their weighted sum its value.
    _, _, _, mask = random_inputs(seed=7)
    loss_mat = torch.randn(mask.shape, generator=torch.Generator().manual_seed(8), dtype=dtype)
    loss_mat[~mask] = math.nan  # masked garbage gets weight 0 and is selected away
    norm = 5 if mode == "seq-mean-token-sum-norm" else None
    leaf = loss_mat.clone().requires_grad_()
    (grad,) = torch.autograd.grad(aggregate_loss(leaf, mask, mode, norm, normalizer), leaf)
    w = loss_token_weights(mask, mode, norm, normalizer, dtype=dtype)
    assert w.dtype == dtype and torch.equal(w, grad)
    assert (w[~mask] == 0).all() and (w[mask] > 0).all()
    torch.testing.assert_close(
        torch.where(mask, w * loss_mat, 0).sum(),
        aggregate_loss(loss_mat, mask, mode, norm, normalizer),
        rtol=1e-6,
        atol=0,
    )


def test_loss_token_weights_errors():
    _, _, _, mask = random_inputs(seed=7)
    with pytest.raises(ValueError, match="no valid token"):
        loss_token_weights(torch.zeros_like(mask))
    assert (loss_token_weights(torch.zeros_like(mask), normalizer=3) == 0).all()
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        loss_token_weights(mask, "token-sum")
    with pytest.raises(ValueError, match="2-D"):
        loss_token_weights(mask[0])
    with pytest.raises(ValueError, match="normalizer"):
        loss_token_weights(mask, normalizer=0)


def test_all_masked_micro_batch_with_normalizer_is_zero():
    lp, old, adv, _ = random_inputs(9)
    mask = torch.zeros_like(lp, dtype=torch.bool)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, normalizer=10)
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in stats.values())
    vloss, vstats = ppo_value_loss(lp, old, adv, mask, normalizer=10)
    assert vloss.item() == 0.0 and all(v.item() == 0.0 for v in vstats.values())


# ------------------------------------------------------------------------------ errors
def _args():
    lp, old, adv, mask = random_inputs(10)
    return lp, old, adv, mask


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_agg="mean"), "loss_agg"),
        (dict(cliprange_low=1.0), "cliprange_low"),
        (dict(cliprange_low=-0.1), "cliprange_low"),
        (dict(cliprange_high=0.0), "cliprange_high"),
        (dict(cliprange_high=math.inf), "cliprange_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(loss_agg="seq-mean-token-sum-norm", loss_agg_norm=0), "loss_agg_norm"),
        (dict(normalizer=0), "normalizer"),
    ],
)
def test_policy_loss_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ppo_policy_loss(*_args(), **kwargs)


def test_shape_dtype_mask_errors():
    lp, old, adv, mask = _args()
    with pytest.raises(ValueError, match="old_logprobs"):
        ppo_policy_loss(lp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="response_mask"):
        ppo_policy_loss(lp, old, adv, mask[:-1])
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(lp, old, adv.long(), mask)
    with pytest.raises(ValueError, match="logprobs"):
        ppo_policy_loss(lp[0], old[0], adv[0], mask[0])
    with pytest.raises(ValueError, match="response_mask"):
        ppo_policy_loss(lp, old, adv, mask.float() * 2)
    with pytest.raises(ValueError, match="no valid token"):
        ppo_policy_loss(lp, old, adv, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="returns"):
        ppo_value_loss(lp, old, adv[:, :3], mask)
    with pytest.raises(ValueError, match="cliprange_value"):
        ppo_value_loss(lp, old, adv, mask, cliprange_value=-1.0)
    with pytest.raises(ValueError, match="loss_agg"):
        ppo_value_loss(lp, old, adv, mask, loss_agg="sum")
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate_loss(lp, mask, "nope")


def test_value_clipfrac_counts_no_clip_where_nothing_is_clipped():
    # V_old + clamp(V - V_old) differs from V by a rounding even inside the clip range; that
    # rounding used to be counted as a clip (2% of tokens here).
    g = torch.Generator().manual_seed(0)
    values = torch.randn(64, 128, generator=g) * 1e-3
    old_values = values + torch.randn(64, 128, generator=g) * 0.3  # |V - V_old| << 1 = ε_v
    returns = torch.randn(64, 128, generator=g)
    mask = torch.ones(64, 128, dtype=torch.bool)
    loss, stats = ppo_value_loss(values, old_values, returns, mask, cliprange_value=3.0)
    assert stats["vf_clipfrac"].item() == 0.0
    torch.testing.assert_close(loss, 0.5 * ((values - returns) ** 2).mean())
    _, stats = ppo_value_loss(values, old_values, returns, mask, cliprange_value=0.1)
    assert stats["vf_clipfrac"].item() > 0  # and real clips are still counted


# ----------------------------------------------------------------------------- tracing


def _loss_inputs(device="cpu", B=3, T=5):
    g = torch.Generator().manual_seed(0)
    t = lambda: torch.randn(B, T, generator=g).to(device)  # noqa: E731
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    return t(), t(), t(), mask


@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_losses_run_on_meta_tensors(loss_agg):
    lp, old, adv, mask = _loss_inputs("meta")
    loss, stats = ppo_policy_loss(lp, old, adv, mask, loss_agg=loss_agg)
    assert loss.device.type == "meta" and loss.shape == () and stats["ratio_max"].shape == ()
    vloss, vstats = ppo_value_loss(lp, old, adv, mask.float(), loss_agg=loss_agg)
    assert vloss.device.type == "meta" and set(vstats) == {"vf_clipfrac", "explained_variance"}


def test_losses_compile_with_fullgraph_and_match_eager():
    lp, old, adv, mask = _loss_inputs()

    def both(lp, old, adv, mask):
        pg, pg_stats = ppo_policy_loss(lp, old, adv, mask, cliprange_low=0.2, cliprange_high=0.3)
        vf, vf_stats = ppo_value_loss(lp, old, adv, mask)
        return pg, vf, pg_stats["clipfrac"], pg_stats["ratio_max"], vf_stats["vf_clipfrac"]

    compiled = torch.compile(both, fullgraph=True, backend="eager")
    for got, want in zip(compiled(lp, old, adv, mask), both(lp, old, adv, mask)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_loss_errors_name_the_op():
    lp, old, adv, mask = _loss_inputs()
    with pytest.raises(ValueError, match=r"^pyppo\.ppo_policy_loss: cliprange_low must be in \[0, 1\)"):
        ppo_policy_loss(lp, old, adv, mask, cliprange_low=1.5)
    with pytest.raises(ValueError, match=r"^pyppo\.ppo_value_loss: mask has no valid token"):
        ppo_value_loss(lp, old, adv, torch.zeros_like(mask))
    with pytest.raises(ValueError, match=r"^pyppo\.aggregate_loss: loss_agg must be one of"):
        aggregate_loss(lp, mask, "sum")
