"""pyppo.ops.gae: GAE over the valid positions of each row, against an explicit Python loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyppo.ops import gae
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


def check(rewards, values, mask, *, gamma, lam, last_values=None, scale=1.0):
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam, last_values=last_values)
    exp_adv, exp_ret = ref_gae(rewards, values, mask, gamma=gamma, lam=lam, last_values=last_values)
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


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(0, 5),
    T=st.integers(0, 20),
    gamma=st.floats(0, 1),
    lam=st.floats(0, 1),
    p_valid=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    with_last=st.booleans(),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**20),
)
def test_hypothesis(B, T, gamma, lam, p_valid, with_last, dtype, seed):
    g = gen(seed)
    rewards = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    mask = torch.rand(B, T, generator=g) < p_valid
    last = torch.randn(B, generator=g, dtype=F64).to(dtype) if with_last else None
    check(rewards, values, mask, gamma=gamma, lam=lam, last_values=last)


def test_opcheck():
    rewards, values, mask, last = make_inputs(4, 7, torch.float32, 7, with_last=True)
    torch.library.opcheck(OP, (rewards, values, mask, 1.0, 0.95, None))
    torch.library.opcheck(
        OP, (rewards.double().t().contiguous().t(), values.double(), mask.float(), 0.9, 0.8, last.double())
    )
    torch.library.opcheck(OP, (rewards.bfloat16(), values.half(), mask.long(), 0.99, 1.0, last))


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
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_errors_are_the_same_on_every_path(path, case):
    fn, *args = _bad_cases()[case]
    assert_same_error(path, fn, *args)


def test_data_errors_are_the_same_on_every_device(device):
    rewards, values, mask, _ = _ok()
    assert_same_error(device, lambda r, v, m: gae(r, v, m), rewards, values, mask.float() * 0.5)


def test_device_opcheck(device):
    g = gen(72)
    r, v = torch.randn(2, 3, generator=g).to(device), torch.randn(2, 3, generator=g).to(device)
    torch.library.opcheck(OP, (r, v, random_mask(2, 3, g).to(device), 0.99, 0.95, None))
