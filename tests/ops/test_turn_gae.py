"""pyppo.ops.turn_gae: GAE over the agent turns of each row, against a Python loop over the turns;
pyppo.ops.turn_start_mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyppo.ops import gae, turn_gae, turn_start_mask
from support.reference import (
    F64,
    FLOAT_DTYPES,
    assert_same_error,
    bits_equal,
    gen,
    out_dtype,
    random_turn_ids,
    ref_turn_gae,
    ref_turns,
    tol,
)

OP = torch.ops.pyppo.turn_gae.default


def make_inputs(B, T, dtype, seed, *, with_last=False, max_span=6):
    g = gen(seed)
    rewards = (torch.randn(B, T, generator=g, dtype=F64) * 0.5).to(dtype)
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    ids = random_turn_ids(B, T, g, max_span=max_span)
    last = torch.randn(B, generator=g, dtype=F64).to(dtype) if with_last else None
    return rewards, values, ids, last


def check(rewards, values, ids, *, gamma, lam, last_values=None, scale=1.0):
    adv, ret = turn_gae(rewards, values, ids, gamma=gamma, lam=lam, last_values=last_values)
    exp_adv, exp_ret = ref_turn_gae(rewards, values, ids, gamma=gamma, lam=lam, last_values=last_values)
    od = out_dtype(rewards.dtype)
    assert adv.dtype == od and ret.dtype == od
    assert adv.shape == rewards.shape and ret.shape == rewards.shape
    T = rewards.shape[1] if rewards.dim() == 2 else 1
    t = tol(rewards.dtype, scale * max(1.0, T / 8))
    torch.testing.assert_close(adv.to(F64), exp_adv, **t)
    torch.testing.assert_close(ret.to(F64), exp_ret, **t)
    agent = ids >= 0
    assert torch.all(adv[~agent] == 0) and torch.all(ret[~agent] == 0)
    return adv, ret


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.0, 0.5), (0.9, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("with_last", [False, True])
def test_values_match_reference(dtype, gamma, lam, with_last):
    seed = FLOAT_DTYPES.index(dtype) * 100 + int(gamma * 10) * 10 + int(lam * 10) + with_last
    rewards, values, ids, last = make_inputs(9, 41, dtype, seed, with_last=with_last)
    check(rewards, values, ids, gamma=gamma, lam=lam, last_values=last)


def test_hand_computed_example():
    # Row: turn 0 = {0, 1, 3} (an environment token between, the same id), env, turn 1 = {5, 6},
    # padding. γ = 0.5, λ = 0.5, no bootstrap. Rewards and values off the turns are junk.
    nan = float("nan")
    ids = torch.tensor([[0, 0, -1, 0, -1, 1, 1, -1]])
    rewards = torch.tensor([[1.0, 2.0, nan, 3.0, nan, 4.0, 1.0, nan]])
    values = torch.tensor([[2.0, nan, nan, nan, nan, 1.0, nan, nan]])
    adv, ret = turn_gae(rewards, values, ids, gamma=0.5, lam=0.5)
    # turn 1: R = 5, V = 1: δ = 5 + 0 − 1 = 4, A = 4
    # turn 0: R = 6, V = 2: δ = 6 + 0.5·1 − 2 = 4.5, A = 4.5 + 0.25·4 = 5.5
    torch.testing.assert_close(adv, torch.tensor([[5.5, 5.5, 0, 5.5, 0, 4.0, 4.0, 0]]), rtol=0, atol=0)
    torch.testing.assert_close(ret, torch.tensor([[7.5, 7.5, 0, 7.5, 0, 5.0, 5.0, 0]]), rtol=0, atol=0)
    # with a bootstrap value 2 after the last turn: δ_1 = 5 + 1 − 1 = 5, A_0 = 4.5 + 1.25 = 5.75
    adv, _ = turn_gae(rewards, values, ids, gamma=0.5, lam=0.5, last_values=torch.tensor([2.0]))
    torch.testing.assert_close(adv, torch.tensor([[5.75, 5.75, 0, 5.75, 0, 5.0, 5.0, 0]]), rtol=0, atol=0)


def test_turns_are_runs_of_equal_ids():
    # A new turn starts wherever the id differs from the previous agent position's: the same id
    # again after another id is a new turn, and ids need not count up.
    ids = torch.tensor([[0, 1, 0, -1, -1, 0, 7, 7, -1, 3]])
    assert ref_turns(ids[0]) == [[0], [1], [2, 5], [6, 7], [9]]
    expected = torch.zeros_like(ids, dtype=torch.bool)
    expected[0, [0, 1, 2, 6, 9]] = True
    assert torch.equal(turn_start_mask(ids), expected)
    rewards, values, _, last = make_inputs(1, 10, F64, 5, with_last=True)
    check(rewards, values, ids, gamma=0.9, lam=0.8, last_values=last)


def test_single_turn_rows_are_the_bandit_estimate():
    # One turn = the whole response: A = R − V at the response's first token (+ γ·last_values).
    B, T = 6, 17
    rewards, values, _, last = make_inputs(B, T, F64, 11, with_last=True)
    ids = torch.full((B, T), -1)
    starts, ends = [0, 0, 3, 5, 0, 16], [17, 1, 10, 6, 12, 17]
    for b, (s, e) in enumerate(zip(starts, ends)):
        ids[b, s:e] = b % 2  # any id
    for lv in (None, last):
        adv, ret = turn_gae(rewards, values, ids, gamma=0.99, lam=0.5, last_values=lv)
        for b, (s, e) in enumerate(zip(starts, ends)):
            boot = 0.0 if lv is None else 0.99 * float(lv[b])
            a = float(rewards[b, s:e].sum()) + boot - float(values[b, s])
            torch.testing.assert_close(adv[b, s:e], torch.full((e - s,), a, dtype=F64), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(
                ret[b, s:e], torch.full((e - s,), a + float(values[b, s]), dtype=F64), rtol=1e-12, atol=1e-12
            )
        assert (adv[ids < 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("with_last", [False, True])
def test_one_token_turns_equal_gae_on_the_agent_tokens(dtype, with_last):
    # Each turn exactly one token: turn_gae is gae with the agent tokens as the valid positions
    # (the same operations in the same order on CPU: the same bits).
    B, T = 8, 53
    g = gen(21)
    rewards = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    agent = torch.rand(B, T, generator=g) < 0.6
    agent[1] = False
    ids = torch.where(agent, agent.long().cumsum(1), torch.full_like(agent, -1, dtype=torch.long))
    last = torch.randn(B, generator=g, dtype=F64).to(dtype) if with_last else None
    for gamma, lam in [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (1.0, 1.0)]:
        a1, r1 = turn_gae(rewards, values, ids, gamma=gamma, lam=lam, last_values=last)
        a2, r2 = gae(rewards, values, agent, gamma=gamma, lam=lam, last_values=last)
        assert bits_equal(a1, a2) and bits_equal(r1, r2), (gamma, lam)


def test_all_environment_rows_and_empty_shapes():
    rewards, values, ids, last = make_inputs(5, 12, torch.float32, 31, with_last=True)
    adv, ret = check(rewards, values, ids, gamma=0.99, lam=0.95, last_values=last)
    assert torch.all(adv[1] == 0) and torch.all(ret[1] == 0)  # all -1, even with last_values
    for B, T in [(0, 5), (0, 0), (3, 0)]:
        rewards, values, ids, last = make_inputs(B, T, torch.float32, 32, with_last=True)
        adv, ret = turn_gae(rewards, values, ids, last_values=last)
        assert adv.shape == (B, T) and ret.shape == (B, T)
        assert turn_start_mask(ids).shape == (B, T)


@pytest.mark.parametrize("B,T", [(1, 1), (5, 1), (3, 2), (7, 97), (2, 700)])
def test_sizes(B, T):
    rewards, values, ids, last = make_inputs(B, T, torch.float32, B * 13 + T, with_last=True)
    check(rewards, values, ids, gamma=0.99, lam=0.9, last_values=last)
    check(rewards, values, ids, gamma=1.0, lam=0.95)


def test_turn_ids_dtypes_agree():
    rewards, values, ids, _ = make_inputs(5, 20, torch.float32, 41)
    base = turn_gae(rewards, values, ids, gamma=0.9, lam=0.9)
    for i in (ids.int(), ids.short(), ids.to(torch.int8)):
        out = turn_gae(rewards, values, i, gamma=0.9, lam=0.9)
        assert bits_equal(out[0], base[0]) and bits_equal(out[1], base[1])
        assert torch.equal(turn_start_mask(i), turn_start_mask(ids))


def test_other_negative_ids_are_environment_positions():
    rewards, values, ids, _ = make_inputs(5, 20, torch.float32, 42)
    other = ids.clone()
    other[other < 0] = -7
    a, b = turn_gae(rewards, values, ids), turn_gae(rewards, values, other)
    assert bits_equal(a[0], b[0]) and bits_equal(a[1], b[1])


def test_mixed_dtypes():
    rewards, values, ids, last = make_inputs(4, 30, torch.float32, 43, with_last=True)
    adv, ret = turn_gae(rewards, values.bfloat16(), ids, gamma=0.99, lam=0.95, last_values=last.half())
    exp_adv, exp_ret = ref_turn_gae(rewards, values.bfloat16(), ids, gamma=0.99, lam=0.95, last_values=last.half())
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), exp_adv, **tol(torch.float32, 4))
    torch.testing.assert_close(ret.double(), exp_ret, **tol(torch.float32, 4))


def test_non_contiguous_inputs():
    rewards, values, ids, last = make_inputs(6, 25, torch.float32, 44, with_last=True)
    r_nc = rewards.t().contiguous().t()
    v_nc = torch.stack([values, values], -1)[..., 1]
    i_nc = ids.t().contiguous().t()
    l_nc = torch.stack([last, last], 1)[:, 0]
    assert not (r_nc.is_contiguous() or v_nc.is_contiguous() or i_nc.is_contiguous() or l_nc.is_contiguous())
    a = turn_gae(r_nc, v_nc, i_nc, gamma=0.95, lam=0.9, last_values=l_nc)
    b = turn_gae(rewards, values, ids, gamma=0.95, lam=0.9, last_values=last)
    assert bits_equal(a[0], b[0]) and bits_equal(a[1], b[1])
    assert torch.equal(turn_start_mask(i_nc), turn_start_mask(ids))
    check(r_nc, v_nc, i_nc, gamma=0.95, lam=0.9, last_values=l_nc)


def test_batch_invariance():
    # A row's bits do not depend on the other rows, on B, or on extra padding.
    rewards, values, ids, last = make_inputs(9, 60, torch.float32, 45, with_last=True)
    full = turn_gae(rewards, values, ids, gamma=0.99, lam=0.95, last_values=last)
    for b in range(9):
        alone = turn_gae(rewards[b : b + 1], values[b : b + 1], ids[b : b + 1], gamma=0.99, lam=0.95,
                         last_values=last[b : b + 1])  # fmt: skip
        assert bits_equal(alone[0], full[0][b : b + 1]) and bits_equal(alone[1], full[1][b : b + 1])
    pad = lambda x, v: torch.nn.functional.pad(x, (0, 40), value=v)  # noqa: E731
    padded = turn_gae(pad(rewards, 7.0), pad(values, -3.0), pad(ids, -1), gamma=0.99, lam=0.95, last_values=last)
    assert bits_equal(padded[0][:, :60], full[0]) and bits_equal(padded[1][:, :60], full[1])


def test_junk_off_the_turns_never_leaks():
    rewards, values, ids, last = make_inputs(6, 30, torch.float32, 46, with_last=True)
    base = turn_gae(rewards, values, ids, gamma=0.99, lam=0.95, last_values=last)
    starts = turn_start_mask(ids)
    r, v = rewards.clone(), values.clone()
    r[ids < 0] = float("nan")
    v[~starts] = float("inf")
    out = turn_gae(r, v, ids, gamma=0.99, lam=0.95, last_values=last)
    assert bits_equal(out[0], base[0]) and bits_equal(out[1], base[1])


def test_not_differentiable():
    rewards, values, ids, _ = make_inputs(3, 8, torch.float32, 47)
    adv, ret = turn_gae(rewards.requires_grad_(), values.requires_grad_(), ids)
    assert not adv.requires_grad and not ret.requires_grad


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(0, 5),
    T=st.integers(0, 24),
    gamma=st.floats(0, 1),
    lam=st.floats(0, 1),
    max_span=st.integers(1, 8),
    with_last=st.booleans(),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**20),
)
def test_hypothesis(B, T, gamma, lam, max_span, with_last, dtype, seed):
    rewards, values, ids, last = make_inputs(B, T, dtype, seed, with_last=with_last, max_span=max_span)
    check(rewards, values, ids, gamma=gamma, lam=lam, last_values=last)


def test_opcheck():
    rewards, values, ids, last = make_inputs(4, 9, torch.float32, 48, with_last=True)
    torch.library.opcheck(OP, (rewards, values, ids, 1.0, 0.95, None))
    torch.library.opcheck(
        OP, (rewards.double().t().contiguous().t(), values.double(), ids.int(), 0.9, 0.8, last.double())
    )
    torch.library.opcheck(OP, (rewards.bfloat16(), values.half(), ids, 0.99, 1.0, last))


# ------------------------------------------------------------------------------ turn_start_mask


def test_turn_start_mask_matches_the_reference_turns():
    g = gen(50)
    ids = random_turn_ids(12, 45, g)
    mask = turn_start_mask(ids)
    assert mask.dtype == torch.bool and mask.shape == ids.shape
    for b in range(12):
        starts = [turn[0] for turn in ref_turns(ids[b])]
        assert mask[b].nonzero().flatten().tolist() == starts


def test_turn_start_mask_errors():
    with pytest.raises(ValueError, match="turn_ids must be an integer tensor"):
        turn_start_mask(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="turn_ids must be an integer tensor"):
        turn_start_mask(torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"turn_ids must be a 2-D \[B, T\] tensor"):
        turn_start_mask(torch.zeros(3, dtype=torch.long))


# -------------------------------------------------------------------------------- errors


def _ok():
    return make_inputs(3, 7, torch.float32, 60, with_last=True)


@pytest.mark.parametrize("gamma", [-0.01, 1.01, float("nan"), float("inf")])
def test_error_gamma(gamma):
    rewards, values, ids, _ = _ok()
    with pytest.raises(ValueError, match=r"pyppo.turn_gae: gamma must be in \[0, 1\]"):
        turn_gae(rewards, values, ids, gamma=gamma)


@pytest.mark.parametrize("lam", [-0.01, 1.01, float("nan"), float("-inf")])
def test_error_lam(lam):
    rewards, values, ids, _ = _ok()
    with pytest.raises(ValueError, match=r"pyppo.turn_gae: lam must be in \[0, 1\]"):
        turn_gae(rewards, values, ids, lam=lam)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.complex64])
def test_error_turn_ids_dtype(dtype):
    rewards, values, ids, _ = _ok()
    with pytest.raises(ValueError, match="pyppo.turn_gae: turn_ids must be an integer tensor"):
        turn_gae(rewards, values, ids.to(dtype))


def test_error_shapes():
    rewards, values, ids, last = _ok()
    with pytest.raises(ValueError, match="values has shape"):
        turn_gae(rewards, values[:, :4], ids)
    with pytest.raises(ValueError, match="turn_ids has shape"):
        turn_gae(rewards, values, ids[:2])
    with pytest.raises(ValueError, match="last_values"):
        turn_gae(rewards, values, ids, last_values=last[:2])
    with pytest.raises(ValueError, match="rewards must be 2-D"):
        turn_gae(rewards[0], values[0], ids[0])


def test_error_dtypes():
    rewards, values, ids, last = _ok()
    with pytest.raises(ValueError, match="rewards must be float"):
        turn_gae(rewards.long(), values, ids)
    with pytest.raises(ValueError, match="values must be float"):
        turn_gae(rewards, values.int(), ids)
    with pytest.raises(ValueError, match="last_values must be float"):
        turn_gae(rewards, values, ids, last_values=last.long())


# ------------------------------------------------------------------------ on every device


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 64, 1500])
@pytest.mark.parametrize("bootstrap", [False, True])
def test_device_values_match_reference(device, dtype, T, bootstrap):
    rewards, values, ids, last = make_inputs(7, T, dtype, 70 + T, with_last=bootstrap, max_span=40)
    adv, ret = turn_gae(
        rewards.to(device),
        values.to(device),
        ids.to(device),
        gamma=0.99,
        lam=0.95,
        last_values=None if last is None else last.to(device),
    )
    assert adv.dtype == out_dtype(dtype) and adv.device.type == device
    exp_adv, exp_ret = ref_turn_gae(rewards, values, ids, gamma=0.99, lam=0.95, last_values=last)
    t = dict(rtol=1e-5, atol=1e-4) if dtype != F64 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(adv.cpu().to(F64), exp_adv, **t)
    torch.testing.assert_close(ret.cpu().to(F64), exp_ret, **t)
    assert (adv.cpu()[ids < 0] == 0).all() and (ret.cpu()[ids < 0] == 0).all()
    assert torch.equal(turn_start_mask(ids.to(device)).cpu(), turn_start_mask(ids))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_device_bits_equal_cpu(device, dtype):
    # CUDA's thread per row runs the CPU loops' operations in their order: the CPU's bits.
    rewards, values, ids, last = make_inputs(33, 300, dtype, 80, with_last=True, max_span=20)
    cpu = turn_gae(rewards, values, ids, gamma=0.99, lam=0.95, last_values=last)
    dev = turn_gae(rewards.to(device), values.to(device), ids.to(device), gamma=0.99, lam=0.95,
                   last_values=last.to(device))  # fmt: skip
    assert bits_equal(dev[0].cpu(), cpu[0]) and bits_equal(dev[1].cpu(), cpu[1])


def _bad_cases():
    rewards, values, ids, last = _ok()
    call = lambda r, v, i, **kw: turn_gae(r, v, i, **kw)  # noqa: E731
    return {
        "gamma": (lambda r, v, i: turn_gae(r, v, i, gamma=1.5), rewards, values, ids),
        "lam": (lambda r, v, i: turn_gae(r, v, i, lam=-0.5), rewards, values, ids),
        "values_shape": (call, rewards, values[:, :2], ids),
        "turn_ids_shape": (call, rewards, values, ids[:2]),
        "turn_ids_dtype": (call, rewards, values, ids.float()),
        "not_2d": (call, rewards[0], values[0], ids[0]),
        "dtype": (call, rewards.long(), values, ids),
        "last_values_shape": (lambda r, v, i, b: turn_gae(r, v, i, last_values=b), rewards, values, ids, last[:2]),
        "last_values_dtype": (lambda r, v, i, b: turn_gae(r, v, i, last_values=b), rewards, values, ids, last.long()),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_errors_are_the_same_on_every_path(path, case):
    fn, *args = _bad_cases()[case]
    assert_same_error(path, fn, *args)


def test_device_opcheck(device):
    rewards, values, ids, last = make_inputs(3, 11, torch.float32, 90, with_last=True)
    torch.library.opcheck(OP, (rewards.to(device), values.to(device), ids.to(device), 0.99, 0.95, None))
    torch.library.opcheck(OP, (rewards.to(device), values.to(device), ids.to(device), 0.9, 1.0, last.to(device)))
