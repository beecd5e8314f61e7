"""pyppo.ops.gae: GAE over the valid positions of each row, against an explicit Python loop; its
decoupled λ (``lam_critic``, VC-PPO) and per-row λ (a tensor ``lam``, VAPO's length-adaptive GAE
from ``length_adaptive_lam``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyppo.ops import gae, length_adaptive_lam
from support.reference import (
    F64,
    FLOAT_DTYPES,
    assert_same_error,
    bits_equal,
    gen,
    out_dtype,
    random_mask,
    ref_gae,
    ref_gae_compact,
    ref_length_adaptive_lam,
    tol,
)

OP = torch.ops.pyppo.gae.default


def make_inputs(B, T, dtype, seed, *, with_last=False):
    g = gen(seed)
    rewards = (torch.randn(B, T, generator=g, dtype=F64) * 0.5).to(dtype)
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    mask = random_mask(B, T, g)
    last = torch.randn(B, generator=g, dtype=F64).to(dtype) if with_last else None
    return rewards, values, mask, last


def check(rewards, values, mask, *, gamma, lam, last_values=None, lam_critic=None, scale=1.0):
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam, last_values=last_values, lam_critic=lam_critic)
    exp_adv, exp_ret = ref_gae(
        rewards, values, mask, gamma=gamma, lam=lam, last_values=last_values, lam_critic=lam_critic
    )
    od = out_dtype(rewards.dtype)
    assert adv.dtype == od and ret.dtype == od
    assert adv.shape == rewards.shape and ret.shape == rewards.shape
    T = rewards.shape[1] if rewards.dim() == 2 else 1
    t = tol(rewards.dtype, scale * max(1.0, T / 8))
    torch.testing.assert_close(adv.to(F64), exp_adv, **t)
    torch.testing.assert_close(ret.to(F64), exp_ret, **t)
    m = mask != 0
    assert torch.all(adv[~m] == 0) and torch.all(ret[~m] == 0)
    return adv, ret


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.0, 0.5), (0.9, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("with_last", [False, True])
def test_values_match_reference(dtype, gamma, lam, with_last):
    seed = FLOAT_DTYPES.index(dtype) * 100 + int(gamma * 10) * 10 + int(lam * 10) + with_last
    rewards, values, mask, last = make_inputs(7, 19, dtype, seed, with_last=with_last)
    check(rewards, values, mask, gamma=gamma, lam=lam, last_values=last)


def test_hole_in_the_middle_equals_compacted_episode():
    # A masked stretch in the middle neither adds a TD term nor breaks the chain: GAE over the
    # row equals textbook GAE over the valid positions laid out densely.
    g = gen(1)
    T = 12
    rewards = torch.randn(1, T, generator=g, dtype=F64)
    values = torch.randn(1, T, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0]], dtype=torch.bool)
    for gamma, lam, boot in [(1.0, 0.95, None), (0.9, 0.8, 0.7), (0.99, 1.0, -1.5)]:
        lv = None if boot is None else torch.tensor([boot], dtype=F64)
        adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam, last_values=lv)
        idx = mask[0].nonzero().flatten()
        dense = ref_gae_compact(rewards[0, idx], values[0, idx], gamma=gamma, lam=lam, last_value=boot or 0.0)
        torch.testing.assert_close(adv[0, idx], torch.tensor(dense, dtype=F64), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ret[0, idx], adv[0, idx] + values[0, idx], rtol=0, atol=0)
        assert torch.all(adv[0, ~mask[0]] == 0) and torch.all(ret[0, ~mask[0]] == 0)


def test_hand_computed_example():
    # γ = 0.5, λ = 0.5, one masked position in the middle, no bootstrap.
    rewards = torch.tensor([[1.0, 100.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 100.0, 1.0, 2.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # t=3: δ = 3 + 0 - 2 = 1, A = 1
    # t=2: δ = 2 + 0.5·2 - 1 = 2, A = 2 + 0.25·1 = 2.25
    # t=0: δ = 1 + 0.5·1 - 0.5 = 1, A = 1 + 0.25·2.25 = 1.5625
    torch.testing.assert_close(adv, torch.tensor([[1.5625, 0.0, 2.25, 1.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(ret, torch.tensor([[2.0625, 0.0, 3.25, 3.0]]), rtol=0, atol=1e-7)
    # with a bootstrap value 4 after the last valid position: δ_3 = 3 + 2 - 2 = 3
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=0.5, last_values=torch.tensor([4.0]))
    torch.testing.assert_close(adv, torch.tensor([[1.6875, 0.0, 2.75, 3.0]]), rtol=0, atol=1e-7)


def test_gamma_lambda_one_is_reward_to_go_minus_value():
    # γ = λ = 1, no bootstrap: A_t = Σ_{valid s ≥ t} r_s − V_t
    rewards, values, mask, _ = make_inputs(5, 14, F64, 2)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    r = torch.where(mask, rewards, torch.zeros_like(rewards))
    to_go = r.flip(1).cumsum(1).flip(1)
    expected = torch.where(mask, to_go - values, torch.zeros_like(values))
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(mask, to_go, torch.zeros_like(to_go)), rtol=1e-12, atol=1e-12)


def test_all_masked_and_single_token_rows():
    rewards, values, mask, last = make_inputs(4, 9, torch.float32, 3, with_last=True)
    adv, ret = check(rewards, values, mask, gamma=0.99, lam=0.95, last_values=last)
    assert torch.all(adv[1] == 0) and torch.all(ret[1] == 0)  # all-masked row, even with last_values
    t = int(mask[2].nonzero())
    # a single valid token: A = r + γ·last − V
    expected = float(rewards[2, t]) + 0.99 * float(last[2]) - float(values[2, t])
    assert abs(float(adv[2, t]) - expected) < 1e-5


@pytest.mark.parametrize("B,T", [(0, 5), (0, 0), (3, 0), (1, 1), (5, 1), (2, 500)])
def test_sizes(B, T):
    rewards, values, mask, last = make_inputs(B, T, torch.float32, B * 13 + T, with_last=True)
    check(rewards, values, mask, gamma=0.99, lam=0.9, last_values=last)
    check(rewards, values, mask, gamma=1.0, lam=0.95)


def test_mask_dtypes_agree():
    rewards, values, mask, _ = make_inputs(5, 8, torch.float32, 4)
    base = gae(rewards, values, mask, gamma=0.9, lam=0.9)
    for m in (mask.float(), mask.long(), mask.int(), mask.to(torch.uint8), mask.double()):
        out = gae(rewards, values, m, gamma=0.9, lam=0.9)
        assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])


def test_mixed_dtypes():
    rewards, values, mask, last = make_inputs(4, 10, torch.float32, 5, with_last=True)
    adv, ret = gae(rewards, values.bfloat16(), mask, gamma=0.99, lam=0.95, last_values=last.half())
    exp_adv, exp_ret = ref_gae(rewards, values.bfloat16(), mask, gamma=0.99, lam=0.95, last_values=last.half())
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), exp_adv, **tol(torch.float32, 2))
    torch.testing.assert_close(ret.double(), exp_ret, **tol(torch.float32, 2))


def test_non_contiguous_inputs():
    rewards, values, mask, last = make_inputs(6, 9, torch.float32, 6, with_last=True)
    r_nc = rewards.t().contiguous().t()
    v_nc = torch.stack([values, values], -1)[..., 1]
    m_nc = mask.t().contiguous().t()
    l_nc = torch.stack([last, last], 1)[:, 0]
    assert not (r_nc.is_contiguous() or v_nc.is_contiguous() or m_nc.is_contiguous() or l_nc.is_contiguous())
    a = gae(r_nc, v_nc, m_nc, gamma=0.95, lam=0.9, last_values=l_nc)
    b = gae(rewards, values, mask, gamma=0.95, lam=0.9, last_values=last)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    check(r_nc, v_nc, m_nc, gamma=0.95, lam=0.9, last_values=l_nc)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(0, 5),
    T=st.integers(0, 20),
    gamma=st.floats(0, 1),
    lam=st.floats(0, 1),
    lam_critic=st.one_of(st.none(), st.floats(0, 1)),
    per_row=st.booleans(),
    p_valid=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    with_last=st.booleans(),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**20),
)
def test_hypothesis(B, T, gamma, lam, lam_critic, per_row, p_valid, with_last, dtype, seed):
    g = gen(seed)
    rewards = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    mask = torch.rand(B, T, generator=g) < p_valid
    last = torch.randn(B, generator=g, dtype=F64).to(dtype) if with_last else None
    lam_arg = torch.rand(B, generator=g, dtype=F64).to(dtype) if per_row else lam
    check(rewards, values, mask, gamma=gamma, lam=lam_arg, last_values=last, lam_critic=lam_critic)


def test_opcheck():
    rewards, values, mask, last = make_inputs(4, 7, torch.float32, 7, with_last=True)
    torch.library.opcheck(OP, (rewards, values, mask, 1.0, 0.95, None))
    torch.library.opcheck(
        OP, (rewards.double().t().contiguous().t(), values.double(), mask.float(), 0.9, 0.8, last.double())
    )
    torch.library.opcheck(OP, (rewards.bfloat16(), values.half(), mask.long(), 0.99, 1.0, last))


# ------------------------------------------------ decoupled λ (VC-PPO) and per-row λ (VAPO)


def _row_lam(B, g, dtype=torch.float32):
    """Per-row λ in [0, 1], the ends included when B allows."""
    lam = torch.rand(B, generator=g, dtype=F64)
    if B >= 2:
        lam[0], lam[1] = 0.0, 1.0
    return lam.to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("B,T", [(7, 19), (5, 33), (1, 1), (6, 2)])
@pytest.mark.parametrize("with_last", [False, True])
def test_decoupled_and_row_lam_match_reference(dtype, B, T, with_last):
    # Fresh random inputs with holes, an all-masked row, a single-token row (random_mask).
    seed = 1000 + FLOAT_DTYPES.index(dtype) * 100 + B * 10 + T + with_last
    rewards, values, mask, last = make_inputs(B, T, dtype, seed, with_last=with_last)
    row_lam = _row_lam(B, gen(seed + 1))
    for gamma, lam, lam_critic in [(0.99, 0.95, 1.0), (1.0, 0.9, 0.0), (0.9, 0.0, 0.7), (1.0, 1.0, 0.95)]:
        check(rewards, values, mask, gamma=gamma, lam=lam, last_values=last, lam_critic=lam_critic)
    for gamma, lam_critic in [(0.99, None), (1.0, 1.0), (0.9, 0.5)]:
        check(rewards, values, mask, gamma=gamma, lam=row_lam, last_values=last, lam_critic=lam_critic)


def test_decoupled_hand_computed_example():
    # γ = 1, λ = 0.5 for the advantages, λ_critic = 1 for the returns: the returns are the
    # rewards-to-go (plus the bootstrap), the advantages the λ = 0.5 ones of test_hand_computed_example's kind.
    rewards = torch.tensor([[1.0, 100.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 100.0, 1.0, 2.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5, lam_critic=1.0)
    # δ_3 = 3 − 2 = 1; δ_2 = 2 + 2 − 1 = 3; δ_0 = 1 + 1 − 0.5 = 1.5
    # A(λ=0.5): 1, 3 + 0.5 = 3.5, 1.5 + 1.75 = 3.25; returns: rewards-to-go 3, 5, 6
    torch.testing.assert_close(adv, torch.tensor([[3.25, 0.0, 3.5, 1.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(ret, torch.tensor([[6.0, 0.0, 5.0, 3.0]]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("with_last", [False, True])
def test_decoupled_lam_equals_two_calls(dtype, with_last):
    # Advantages: the bits of the call with lam; returns: the bits of the call with lam_critic.
    rewards, values, mask, last = make_inputs(9, 37, dtype, 2000 + FLOAT_DTYPES.index(dtype), with_last=with_last)
    for gamma, lam, lam_critic in [(0.99, 0.95, 1.0), (1.0, 0.9, 0.3), (0.5, 1.0, 0.0), (0.99, 0.95, 0.95)]:
        adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam, last_values=last, lam_critic=lam_critic)
        a_only, _ = gae(rewards, values, mask, gamma=gamma, lam=lam, last_values=last)
        _, r_only = gae(rewards, values, mask, gamma=gamma, lam=lam_critic, last_values=last)
        assert bits_equal(adv, a_only) and bits_equal(ret, r_only), (gamma, lam, lam_critic)


def test_lam_critic_none_is_todays_gae():
    rewards, values, mask, last = make_inputs(6, 15, torch.float32, 2010, with_last=True)
    adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.9, last_values=last, lam_critic=None)
    old = torch.ops.pyppo.gae.default(rewards, values, mask, 0.99, 0.9, last)  # the schema's defaults
    assert bits_equal(adv, old[0]) and bits_equal(ret, old[1])
    assert torch.equal(ret, torch.where(mask, adv + values, torch.zeros_like(adv)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("lam_dtype", FLOAT_DTYPES, ids=str)
def test_row_lam_equals_per_row_calls(dtype, lam_dtype):
    # Row b of a call with a per-row λ is the bits of a call on row b alone with lam = lam[b]
    # (whatever lam's dtype: the op forms γ·λ in float64, as from a Python float).
    B, T = 7, 23
    seed = 2100 + FLOAT_DTYPES.index(dtype) * 10 + FLOAT_DTYPES.index(lam_dtype)
    rewards, values, mask, last = make_inputs(B, T, dtype, seed, with_last=True)
    row_lam = _row_lam(B, gen(seed + 1), lam_dtype)
    for lam_critic in (None, 1.0, 0.5):
        adv, ret = gae(rewards, values, mask, gamma=0.99, lam=row_lam, last_values=last, lam_critic=lam_critic)
        for b in range(B):
            a, r = gae(
                rewards[b : b + 1],
                values[b : b + 1],
                mask[b : b + 1],
                gamma=0.99,
                lam=float(row_lam[b]),
                last_values=last[b : b + 1],
                lam_critic=lam_critic,
            )
            assert bits_equal(adv[b : b + 1], a) and bits_equal(ret[b : b + 1], r), (b, lam_critic)


def test_constant_row_lam_equals_float_lam():
    rewards, values, mask, last = make_inputs(5, 12, torch.float32, 2200, with_last=True)
    for lam in (0.0, 0.9, 1.0):
        a = gae(rewards, values, mask, gamma=0.99, lam=torch.full((5,), lam), last_values=last)
        b = gae(rewards, values, mask, gamma=0.99, lam=lam, last_values=last)
        assert bits_equal(a[0], b[0]) and bits_equal(a[1], b[1])


def test_row_lam_non_contiguous_and_odd_layouts():
    rewards, values, mask, last = make_inputs(6, 9, torch.bfloat16, 2300, with_last=True)
    row_lam = _row_lam(6, gen(2301))
    lam_nc = torch.stack([row_lam, row_lam], 1)[:, 1]
    r_nc = rewards.t().contiguous().t()
    assert not (lam_nc.is_contiguous() or r_nc.is_contiguous())
    a = gae(r_nc, values, mask.float(), gamma=0.95, lam=lam_nc, last_values=last, lam_critic=1.0)
    b = gae(rewards, values, mask, gamma=0.95, lam=row_lam, last_values=last, lam_critic=1.0)
    assert bits_equal(a[0], b[0]) and bits_equal(a[1], b[1])
    check(r_nc, values, mask, gamma=0.95, lam=lam_nc, last_values=last, lam_critic=1.0)


def test_opcheck_decoupled_and_row_lam():
    rewards, values, mask, last = make_inputs(4, 7, torch.float32, 2400, with_last=True)
    row_lam = _row_lam(4, gen(2401))
    torch.library.opcheck(OP, (rewards, values, mask, 1.0, 0.95, None, 1.0, None))
    torch.library.opcheck(OP, (rewards, values, mask, 0.99, 0.95, last, None, row_lam))
    torch.library.opcheck(
        OP, (rewards.double(), values.bfloat16(), mask.long(), 0.9, 1.0, last.half(), 0.5, row_lam.double())
    )


# ------------------------------------------------------------------------ length_adaptive_lam


def test_length_adaptive_lam_values():
    # l = 0 -> 0; 1 − 1/(α·l) below 0 -> 0; it grows towards 1 with l.
    mask = torch.zeros(5, 400, dtype=torch.bool)
    for b, l in enumerate([0, 1, 20, 40, 400]):
        mask[b, :l] = True
    mask[3, 10] = False  # a hole in the middle,
    mask[3, 45] = True  # and a valid position after a gap: still 40 valid positions
    lam = length_adaptive_lam(mask, 0.05)
    assert lam.dtype == torch.float32 and lam.shape == (5,)
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.0, 0.0, 0.5, 0.95]), rtol=0, atol=0)
    torch.testing.assert_close(lam.double(), ref_length_adaptive_lam(mask, 0.05), rtol=0, atol=1e-7)


@pytest.mark.parametrize("alpha", [0.05, 1.0, 3.7, 1e6])
def test_length_adaptive_lam_matches_reference_and_clamps(alpha):
    g = gen(2500)
    mask = random_mask(9, 31, g)
    for m in (mask, mask.float(), mask.long(), mask.t().contiguous().t()):
        lam = length_adaptive_lam(m, alpha)
        torch.testing.assert_close(lam.double(), ref_length_adaptive_lam(mask, alpha), rtol=0, atol=1e-7)
        assert ((lam >= 0) & (lam <= 1)).all() and lam[1] == 0  # row 1 is all masked
    # the result feeds gae directly
    rewards, values, _, _ = make_inputs(9, 31, torch.float32, 2501)
    check(rewards, values, mask, gamma=1.0, lam=length_adaptive_lam(mask, alpha), lam_critic=1.0)


@pytest.mark.parametrize("alpha", [0, -0.05, float("nan"), float("inf"), None, "0.05", True])
def test_length_adaptive_lam_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lam(torch.ones(2, 3, dtype=torch.bool), alpha)


def test_length_adaptive_lam_bad_mask():
    with pytest.raises(ValueError, match="loss_mask"):
        length_adaptive_lam(torch.ones(3, dtype=torch.bool), 0.05)
    with pytest.raises(ValueError, match="loss_mask"):
        length_adaptive_lam([[1, 0]], 0.05)


# -------------------------------------------------------------------------------- errors


def _ok():
    return make_inputs(3, 5, torch.float32, 8, with_last=True)


@pytest.mark.parametrize("gamma", [-0.01, 1.01, float("nan"), float("inf")])
def test_error_gamma(gamma):
    rewards, values, mask, _ = _ok()
    with pytest.raises(ValueError, match="gamma"):
        gae(rewards, values, mask, gamma=gamma)


@pytest.mark.parametrize("lam", [-0.01, 1.01, float("nan"), float("-inf")])
def test_error_lam(lam):
    rewards, values, mask, _ = _ok()
    with pytest.raises(ValueError, match="lam"):
        gae(rewards, values, mask, lam=lam)


@pytest.mark.parametrize("lam_critic", [-0.01, 1.01, float("nan"), float("inf")])
def test_error_lam_critic(lam_critic):
    rewards, values, mask, _ = _ok()
    with pytest.raises(ValueError, match=r"lam_critic must be in \[0, 1\]"):
        gae(rewards, values, mask, lam_critic=lam_critic)


@pytest.mark.parametrize("bad", [-0.01, 1.01, float("nan"), float("inf")])
def test_error_row_lam_values(bad):
    rewards, values, mask, _ = _ok()
    lam = torch.tensor([0.5, bad, 2.0])
    with pytest.raises(ValueError, match=r"row_lam \(the per-row lam\) must hold values in \[0, 1\], got row_lam\[1\]"):
        gae(rewards, values, mask, lam=lam)


def test_error_row_lam_shape_and_dtype():
    rewards, values, mask, _ = _ok()
    with pytest.raises(ValueError, match=r"row_lam must have shape \[B\] = \[3\]"):
        gae(rewards, values, mask, lam=torch.full((2,), 0.5))
    with pytest.raises(ValueError, match=r"row_lam must have shape \[B\]"):
        gae(rewards, values, mask, lam=torch.full((3, 1), 0.5))
    with pytest.raises(ValueError, match="row_lam must be float32, bfloat16, float16 or float64"):
        gae(rewards, values, mask, lam=torch.ones(3, dtype=torch.long))


def test_error_shapes():
    rewards, values, mask, last = _ok()
    with pytest.raises(ValueError, match="values"):
        gae(rewards, values[:, :4], mask)
    with pytest.raises(ValueError, match="response_mask"):
        gae(rewards, values, mask[:2])
    with pytest.raises(ValueError, match="last_values"):
        gae(rewards, values, mask, last_values=last[:2])
    with pytest.raises(ValueError, match="last_values"):
        gae(rewards, values, mask, last_values=last[:, None])
    with pytest.raises(ValueError, match="rewards"):
        gae(rewards[0], values[0], mask[0])
    with pytest.raises(ValueError, match="rewards"):
        gae(rewards[None], values[None], mask[None])


def test_error_dtypes():
    rewards, values, mask, last = _ok()
    with pytest.raises(ValueError, match="rewards"):
        gae(rewards.long(), values, mask)
    with pytest.raises(ValueError, match="values"):
        gae(rewards, values.int(), mask)
    with pytest.raises(ValueError, match="last_values"):
        gae(rewards, values, mask, last_values=last.long())


def test_error_mask_not_zero_one():
    rewards, values, mask, _ = _ok()
    m = mask.float()
    m[1, 2] = 0.5
    with pytest.raises(ValueError, match="response_mask"):
        gae(rewards, values, m)
    m[1, 2] = 3
    with pytest.raises(ValueError, match="response_mask"):
        gae(rewards, values, m.long())


# ------------------------------------------------------------------------ on every device


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 64, 1023, 1024, 2500], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("bootstrap", [False, True])
def test_device_values_match_reference(device, dtype, T, bootstrap):
    # One tile of CUDA's warp scan and several (512 positions a tile).
    g = gen(71 + T)
    B = 5
    rewards = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[:, 0] = True
    if T > 3:
        mask[1, T // 2 :] = False  # a long masked tail
        mask[2, : T - 2] = False  # only the last two valid
    last = torch.randn(B, generator=g, dtype=F64).to(dtype) if bootstrap else None
    adv, ret = gae(
        rewards.to(device),
        values.to(device),
        mask.to(device),
        gamma=0.99,
        lam=0.95,
        last_values=None if last is None else last.to(device),
    )
    assert adv.dtype == out_dtype(dtype) and adv.device.type == device
    adv_r, ret_r = ref_gae(rewards, values, mask, gamma=0.99, lam=0.95, last_values=last)
    t = dict(rtol=1e-5, atol=2e-5) if dtype != F64 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(adv.cpu().to(F64), adv_r, **t)
    torch.testing.assert_close(ret.cpu().to(F64), ret_r, **t)
    assert (adv.cpu()[~mask] == 0).all() and (ret.cpu()[~mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("bootstrap", [False, True])
def test_device_bits_do_not_change_with_right_padding(device, dtype, bootstrap):
    # A row's advantages are the same bits whether the batch is padded to 1000 positions or to
    # 1023, 1024, 1300 or 2048 (other rows being longer), on every device.
    g = gen(81)
    B, T0 = 6, 1000
    rewards = torch.randn(B, T0, generator=g, dtype=F64).to(dtype)
    values = torch.randn(B, T0, generator=g, dtype=F64).to(dtype)
    lengths = torch.randint(1, T0 + 1, (B,), generator=g)
    lengths[0] = T0
    mask = (torch.arange(T0) < lengths[:, None]) & (torch.rand(B, T0, generator=g) < 0.85)
    mask[:, 0] = True
    last = torch.randn(B, generator=g, dtype=F64).to(dtype).to(device) if bootstrap else None

    def run(T):
        pad = T - T0
        r = torch.nn.functional.pad(rewards, (0, pad), value=7.0)  # junk at masked positions
        v = torch.nn.functional.pad(values, (0, pad), value=-3.0)
        m = torch.nn.functional.pad(mask, (0, pad), value=False)
        return gae(r.to(device), v.to(device), m.to(device), gamma=0.99, lam=0.95, last_values=last)

    adv, ret = run(T0)
    for T in (1023, 1024, 1300, 2048):
        a, r = run(T)
        assert bits_equal(a[:, :T0], adv) and bits_equal(r[:, :T0], ret), T
        assert (a[:, T0:] == 0).all() and (r[:, T0:] == 0).all()


@pytest.mark.parametrize("T", [5, 1500])
def test_device_all_masked_and_single_token_rows(device, T):
    rewards, values, mask, last = make_inputs(6, T, torch.float32, 25 + T, with_last=True)
    adv, ret = gae(
        rewards.to(device), values.to(device), mask.to(device), gamma=0.9, lam=0.8, last_values=last.to(device)
    )
    adv_r, ret_r = ref_gae(rewards, values, mask, gamma=0.9, lam=0.8, last_values=last)
    torch.testing.assert_close(adv.cpu().to(F64), adv_r, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ret.cpu().to(F64), ret_r, rtol=1e-5, atol=2e-5)
    assert torch.all(adv[1] == 0) and torch.all(ret[1] == 0)


def _bad_cases():
    rewards, values, mask, last = _ok()
    call = lambda r, v, m, **kw: gae(r, v, m, **kw)  # noqa: E731
    return {
        "gamma": (lambda r, v, m: gae(r, v, m, gamma=1.5), rewards, values, mask),
        "lam": (lambda r, v, m: gae(r, v, m, lam=-0.5), rewards, values, mask),
        "values_shape": (call, rewards, values[:, :2], mask),
        "mask_shape": (call, rewards, values, mask[:2]),
        "not_2d": (call, rewards[0], values[0], mask[0]),
        "dtype": (call, rewards.long(), values, mask),
        "last_values_shape": (lambda r, v, m, b: gae(r, v, m, last_values=b), rewards, values, mask, last[:2]),
        "last_values_dtype": (lambda r, v, m, b: gae(r, v, m, last_values=b), rewards, values, mask, last.long()),
        "lam_critic": (lambda r, v, m: gae(r, v, m, lam_critic=1.5), rewards, values, mask),
        "row_lam_shape": (lambda r, v, m, b: gae(r, v, m, lam=b), rewards, values, mask, last[:2]),
        "row_lam_dtype": (lambda r, v, m, b: gae(r, v, m, lam=b), rewards, values, mask, last.long()),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_errors_are_the_same_on_every_path(path, case):
    fn, *args = _bad_cases()[case]
    assert_same_error(path, fn, *args)


def test_data_errors_are_the_same_on_every_device(device):
    rewards, values, mask, _ = _ok()
    assert_same_error(device, lambda r, v, m: gae(r, v, m), rewards, values, mask.float() * 0.5)


def test_row_lam_data_error_is_the_same_on_every_device(device):
    rewards, values, mask, _ = _ok()
    for bad in (torch.tensor([0.5, 1.5, 0.2]), torch.tensor([float("nan"), 0.5, 0.2])):
        assert_same_error(device, lambda r, v, m, l: gae(r, v, m, lam=l), rewards, values, mask, bad)


@pytest.mark.parametrize("T", [1, 37, 1500])
def test_device_decoupled_and_row_lam(device, T):
    # CUDA's second composition (the returns' λ) and its per-row γ·λ, across tiles of 512.
    g = gen(90 + T)
    B = 6
    rewards = torch.randn(B, T, generator=g, dtype=F64).float()
    values = torch.randn(B, T, generator=g, dtype=F64).float()
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[1] = False
    last = torch.randn(B, generator=g, dtype=F64).float()
    row_lam = _row_lam(B, g)
    on = [x.to(device) for x in (rewards, values, mask, last, row_lam)]
    for lam, lam_critic in [(0.95, 1.0), (row_lam, None), (row_lam, 1.0)]:
        lam_d = on[4] if isinstance(lam, torch.Tensor) else lam
        adv, ret = gae(*on[:3], gamma=0.99, lam=lam_d, last_values=on[3], lam_critic=lam_critic)
        exp_adv, exp_ret = ref_gae(rewards, values, mask, gamma=0.99, lam=lam, last_values=last, lam_critic=lam_critic)
        torch.testing.assert_close(adv.cpu().to(F64), exp_adv, rtol=1e-5, atol=2e-5 * max(1, T / 512))
        torch.testing.assert_close(ret.cpu().to(F64), exp_ret, rtol=1e-5, atol=2e-5 * max(1, T / 512))
        # the two-call and per-row identities hold on every device
        lc = lam_critic if lam_critic is not None else lam_d
        a_only, _ = gae(*on[:3], gamma=0.99, lam=lam_d, last_values=on[3])
        _, r_only = gae(*on[:3], gamma=0.99, lam=lc, last_values=on[3])
        assert bits_equal(adv, a_only) and bits_equal(ret, r_only)
        if isinstance(lam, torch.Tensor):
            for b in (0, 2, 5):
                a, r = gae(
                    *(x[b : b + 1] for x in on[:3]),
                    gamma=0.99,
                    lam=float(row_lam[b]),
                    last_values=on[3][b : b + 1],
                    lam_critic=lam_critic,
                )
                assert bits_equal(adv[b : b + 1], a) and bits_equal(ret[b : b + 1], r)


def test_device_opcheck(device):
    g = gen(72)
    r, v = torch.randn(2, 3, generator=g).to(device), torch.randn(2, 3, generator=g).to(device)
    torch.library.opcheck(OP, (r, v, random_mask(2, 3, g).to(device), 0.99, 0.95, None))
    torch.library.opcheck(
        OP, (r, v, random_mask(2, 3, g).to(device), 0.99, 0.95, None, 1.0, torch.tensor([0.3, 1.0]).to(device))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,T", [(8, 1024), (21, 64), (9, 131), (17, 257), (4, 7)])
def test_rows_scanned_together_are_the_bits_of_each_row_alone(dtype, B, T):
    # The CPU kernel scans rows in vector lanes, 8 float (4 double) at a time, and the rows left
    # over one by one; a row's bits must not depend on which, nor on its neighbours: holes,
    # all-masked rows and tiles, each row its own lam, lam_critic, NaN and inf in other rows.
    g = gen(11)
    r = torch.randn(B, T, generator=g, dtype=dtype)
    v = torch.randn(B, T, generator=g, dtype=dtype)
    mask = random_mask(B, T, g)
    mask[1] = False
    mask[2, : T // 2] = True
    mask[3, 8:24] = False
    r[-1, T // 3] = float("nan")
    v[-2, T // 2] = float("inf")
    last = torch.randn(B, generator=g, dtype=dtype)
    row_lam = torch.rand(B, generator=g, dtype=torch.float64)
    row_lam[::3] = 0.9
    for kw in ({"lam": 0.95}, {"lam": row_lam}, {"lam": row_lam, "lam_critic": 0.9}, {"lam": 0.95, "lam_critic": 1.0}):
        adv, ret = gae(r, v, mask, gamma=0.99, last_values=last, **kw)
        for b in range(B):
            one = {k: (x[b : b + 1] if isinstance(x, torch.Tensor) else x) for k, x in kw.items()}
            a1, r1 = gae(r[b : b + 1], v[b : b + 1], mask[b : b + 1], gamma=0.99, last_values=last[b : b + 1], **one)
            assert bits_equal(adv[b : b + 1], a1) and bits_equal(ret[b : b + 1], r1), (kw, b)
