"""pyppo.integrations.verl against the real veRL 0.9.1 functions: values, dtypes, masked positions,
gradients, errors, and patch()/unpatch().

Every comparison runs veRL's own function (captured before any patching) and the adapter on the
same fresh inputs. Tolerances: float64 results agree to 1e-9 relative; float32 results to float32
rounding (rtol 1e-5, a few ulps scaled by the reduction length). For bf16/fp16 inputs veRL
computes in the input dtype (its GAE recursion, k3, entropy, row sums), so both are compared
against veRL's own formula on the inputs upcast to float64, and pyppo must be at least as close
(mean error) and within one rounding of the output dtype of veRL's worst error. These tests skip
when veRL is not installed.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyppo.integrations as integrations
import pyppo.integrations.verl as pv
from pyppo.integrations import PeerVersionWarning, _patching
from support.peer_support import import_peer, pyppo_ops_called

F64 = torch.float64
BF16, F16 = torch.bfloat16, torch.float16
FLOATS = (torch.float32, BF16, F16, F64)
MASK_DTYPES = (torch.bool, torch.int64, torch.float32, F64)
HYP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ULP = {BF16: 2.0**-8, F16: 2.0**-11, torch.float32: 2.0**-24, F64: 2.0**-53}  # half an ulp, relative
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
KL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
CORE_NAMES = (
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "kl_penalty",
    "kl_penalty_forward",
    "agg_loss",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_cispo",
    "compute_value_loss",
)
TF_NAMES = (
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "logprobs_from_logits",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
)


@pytest.fixture(scope="module")
def peer():
    """veRL's modules and its own functions, captured unpatched."""
    ca = import_peer("verl.trainer.ppo.core_algos")
    tf = import_peer("verl.utils.torch_functional")
    assert _patching.active(pv.PEER) is None, "a previous test left veRL patched"
    fns = {n: getattr(ca, n) for n in CORE_NAMES} | {n: getattr(tf, n) for n in TF_NAMES}
    return SimpleNamespace(ca=ca, tf=tf, **fns)


@pytest.fixture(autouse=True)
def _always_unpatch():
    yield
    if _patching.active(pv.PEER) is not None:
        pv.unpatch()
        pytest.fail("the test left veRL patched")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, g, dtype=torch.float32, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=g, dtype=F64) * scale + shift).to(dtype)


def make_mask(B, T, g, kind="holes", dtype=torch.int64):
    """A response mask: right padding with random lengths, plus, for ``holes``, masked observation
    spans inside rows (multi-turn tool outputs); ``empty_row``: row 0 all masked; ``leading``:
    the first positions masked."""
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    m = torch.arange(T)[None, :] < lengths[:, None]
    if kind in ("holes", "empty_row", "leading") and T >= 4:
        for b in range(B):
            a = int(torch.randint(1, T - 2, (1,), generator=g))
            m[b, a : a + int(torch.randint(1, 3, (1,), generator=g))] = False
    if kind == "leading":
        m[:, : max(1, T // 4)] = False
        m[:, -1] = True
    if kind == "empty_row" and B >= 2:
        m[0] = False
    if kind == "full":
        m[:] = True
    if m.sum() < 2:
        m.view(-1)[:2] = True
    return m.to(dtype)


def layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x``'s values in a non-contiguous layout of the same shape."""
    if how == "transposed":
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    if how == "sliced":
        return torch.cat([x, torch.zeros_like(x)], -1)[..., : x.shape[-1]]
    return x


def assert_same(ours, theirs, *, rtol=None, atol=None):
    """Same type, dtype, shape and (within tolerance) values, NaN where veRL has NaN."""
    if isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs)
        for o, t in zip(ours, theirs):
            assert_same(o, t, rtol=rtol, atol=atol)
        return
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys()
        for k in theirs:
            assert type(ours[k]) is type(theirs[k]), k
            assert ours[k] == pytest.approx(theirs[k], rel=rtol or 1e-5, abs=atol or 1e-7, nan_ok=True), k
        return
    assert isinstance(ours, torch.Tensor)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (ours.dtype, theirs.dtype, ours.shape)
    if rtol is None:
        rtol = {F64: 1e-9, torch.float32: 1e-5}.get(theirs.dtype, 2 * ULP.get(theirs.dtype, 1e-5) * 2)
        atol = {F64: 1e-10, torch.float32: 1e-6}.get(theirs.dtype, rtol)
    torch.testing.assert_close(ours.detach().double(), theirs.detach().double(), rtol=rtol, atol=atol, equal_nan=True)


def assert_at_least_as_close(ours, theirs, ref, dtype):
    """pyppo's half-precision result is no further from the float64 reference than veRL's (mean
    error), and its worst error is within one output rounding of veRL's."""
    assert ours.dtype == theirs.dtype
    e_ours = (ours.double() - ref).abs()
    e_theirs = (theirs.double() - ref).abs()
    scale = ref.abs().max().item() + 1e-30
    # A mean over a handful of elements is one or two roundings, which either side can win by
    # luck: the mean must then only be within half an output rounding.
    slack = (0.5 if e_ours.numel() < 256 else 1e-3) * ULP[dtype] * scale
    assert e_ours.mean() <= e_theirs.mean() + slack, (e_ours.mean(), e_theirs.mean())
    assert e_ours.max() <= e_theirs.max() + 2 * ULP[dtype] * scale, (e_ours.max(), e_theirs.max())


def grads(fn, inputs, outputs_weight_seed=0):
    """Gradients of ``Σ w·out`` w.r.t. ``inputs`` (fresh leaves with the same values)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    w = torch.rand(out.shape, generator=gen(outputs_weight_seed), dtype=F64).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)


# ------------------------------------------------------------------------------------------------
# signatures


def test_signatures_match_the_peer(peer):
    for target in pv.PEER.targets:
        original = getattr(peer, target.name)
        assert _patching._same_signature(original, target.adapter), target.name
        doc = " ".join(target.adapter.__doc__.split())
        assert target.adapter.__module__ == pv.__name__
        assert f"Matches veRL 0.9.1 ``{target.module}.{target.name}``" in doc, target.name


# ------------------------------------------------------------------------------------------------
# GAE


@pytest.mark.parametrize("kind", ["holes", "pad", "empty_row", "leading", "full"])
@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float32, F64])
@pytest.mark.parametrize("B,T", [(4, 37), (1, 5), (6, 1), (3, 8)])
def test_gae_matches(peer, kind, mask_dtype, B, T):
    g = gen(B * 100 + T)
    r, v = randn((B, T), g, scale=0.5), randn((B, T), g)
    m = make_mask(B, T, g, kind, mask_dtype)
    for gamma, lam in ((1.0, 0.95), (0.99, 0.9)):
        theirs = peer.compute_gae_advantage_return(r, v, m, gamma, lam)
        with pyppo_ops_called() as ops:
            ours = pv.compute_gae_advantage_return(r, v, m, gamma, lam)
        assert "pyppo::gae" in ops
        assert_same(ours, theirs, rtol=1e-5 * max(1, T / 8), atol=2e-6 * max(1, T / 8))
    # float64: the same numbers up to float64 rounding with a float64 mask. With an integer mask
    # veRL's Bessel factor n / (n - 1) is an int / int division, rounded to float32 (pyppo's is
    # exact): a relative difference below 6e-8.
    r64, v64 = r.double(), v.double()
    m64 = m.double()
    assert_same(
        pv.compute_gae_advantage_return(r64, v64, m64, 0.97, 0.8),
        peer.compute_gae_advantage_return(r64, v64, m64, 0.97, 0.8),
    )
    assert_same(
        pv.compute_gae_advantage_return(r64, v64, m, 0.97, 0.8),
        peer.compute_gae_advantage_return(r64, v64, m, 0.97, 0.8),
        rtol=2e-7,
        atol=1e-7,
    )


def test_gae_masked_positions_carry_and_are_whitened(peer):
    # One row, a hole at 2-3 and padding at 6-7: the hole carries position 4's advantage, the
    # padding carries 0, and every position is whitened (not zeroed).
    g = gen(3)
    r, v = randn((1, 8), g), randn((1, 8), g)
    m = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0]])
    adv, ret = pv.compute_gae_advantage_return(r, v, m, 1.0, 0.95)
    assert_same((adv, ret), peer.compute_gae_advantage_return(r, v, m, 1.0, 0.95))
    assert adv[0, 2] == adv[0, 3] == adv[0, 4]
    assert adv[0, 6] == adv[0, 7] != 0
    assert torch.equal(ret[0, 6:], v[0, 6:])


@pytest.mark.parametrize("how", ["transposed", "sliced"])
def test_gae_non_contiguous(peer, how):
    g = gen(11)
    r, v = randn((5, 13), g), randn((5, 13), g)
    m = make_mask(5, 13, g)
    theirs = peer.compute_gae_advantage_return(r, v, m, 1.0, 0.95)
    assert_same(pv.compute_gae_advantage_return(layout(r, how), layout(v, how), layout(m, how), 1.0, 0.95), theirs)


def test_gae_bool_mask_and_tensor_gamma(peer):
    # veRL's loop cannot take a bool mask (1 - bool raises); the adapter reads it as 0/1.
    g = gen(5)
    r, v = randn((3, 9), g), randn((3, 9), g)
    m = make_mask(3, 9, g)
    with pytest.raises(RuntimeError):
        peer.compute_gae_advantage_return(r, v, m.bool(), 1.0, 0.95)
    theirs = peer.compute_gae_advantage_return(r, v, m, torch.tensor(0.99), torch.tensor(0.9))
    assert_same(pv.compute_gae_advantage_return(r, v, m.bool(), torch.tensor(0.99), torch.tensor(0.9)), theirs)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_gae_half_precision_at_least_as_close(peer, dtype):
    # veRL runs its recursion in bf16/fp16; pyppo in float32 with one rounding at the end.
    g = gen(7)
    B, T = 8, 64
    r, v = randn((B, T), g, dtype, 0.3), randn((B, T), g, dtype)
    m = make_mask(B, T, g)
    ref = peer.compute_gae_advantage_return(r.double(), v.double(), m, 1.0, 0.95)
    theirs = peer.compute_gae_advantage_return(r, v, m, 1.0, 0.95)
    ours = pv.compute_gae_advantage_return(r, v, m, 1.0, 0.95)
    for o, t, rf in zip(ours, theirs, ref):
        assert o.dtype == t.dtype == dtype
        assert_at_least_as_close(o, t, rf, dtype)


@HYP
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 24),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    bits=st.integers(0, 2**96 - 1),
    seed=st.integers(0, 2**16),
)
def test_gae_property_float64(peer, B, T, gamma, lam, bits, seed):
    # Any mask pattern, float64: equal to veRL's recursion, or the same ValueError (fewer than 2
    # valid positions cannot be whitened).
    g = gen(seed)
    r, v = randn((B, T), g, F64), randn((B, T), g, F64)
    m = torch.tensor([(bits >> i) & 1 for i in range(B * T)], dtype=torch.int64).reshape(B, T)
    if m.sum() < 2:
        with pytest.raises(ValueError):
            peer.compute_gae_advantage_return(r, v, m, gamma, lam)
        with pytest.raises(ValueError, match="response_mask selects"):
            pv.compute_gae_advantage_return(r, v, m, gamma, lam)
        return
    m = m.double()  # veRL's Bessel factor in float64 (an int mask rounds it to float32)
    theirs = peer.compute_gae_advantage_return(r, v, m, gamma, lam)
    assert_same(pv.compute_gae_advantage_return(r, v, m, gamma, lam), theirs, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------------
# masked_mean / masked_var / masked_whiten


def _masked_inputs(dtype, mask_dtype, seed, shape=(5, 37), kind="holes"):
    g = gen(seed)
    x = randn(shape, g, dtype, 2.0, 0.5)
    m = make_mask(*shape, g, kind, mask_dtype)
    return x, m


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
def test_masked_stats_dtypes_and_values(peer, dtype, mask_dtype):
    x, m = _masked_inputs(dtype, mask_dtype, FLOATS.index(dtype) * 10 + MASK_DTYPES.index(mask_dtype), kind="empty_row")
    x64 = x.double()
    cases = [
        ("masked_mean", (), {}),
        ("masked_mean", (-1,), {}),
        ("masked_mean", (0,), {}),
        ("masked_mean", ((0, 1),), {}),
        ("masked_var", (), {}),
        ("masked_var", (False,), {}),
        ("masked_whiten", (), {}),
        ("masked_whiten", (), {"shift_mean": False}),
    ]
    for name, args, kw in cases:
        theirs = getattr(peer, name)(x, m, *args, **kw)
        with pyppo_ops_called() as ops:
            ours = getattr(pv, name)(x, m, *args, **kw)
        assert ops, name
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (name, args, ours.dtype, theirs.dtype)
        if dtype in (torch.float32, F64) and mask_dtype != F64 or dtype == F64:
            assert_same(ours, theirs, rtol=1e-5 if ours.dtype != F64 or dtype != F64 else 1e-9, atol=1e-5)
        else:
            # veRL rounds its sums (and, for a half-precision float mask, its statistics) to the
            # input dtype: compare both with veRL's formula in float64.
            ref = getattr(peer, name)(x64, m.double() if mask_dtype.is_floating_point else m, *args, **kw)
            assert_at_least_as_close(ours, theirs, ref, dtype if ours.dtype in (BF16, F16) else torch.float32)


def test_masked_mean_empty_selection_is_zero_with_gradient(peer):
    x = torch.randn(3, 6, dtype=F64)
    m = torch.ones(3, 6)
    m[1] = 0
    for axis in (-1, 1):
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        theirs = peer.masked_mean(xs[0], m, axis=axis)
        ours = pv.masked_mean(xs[1], m, axis=axis)
        assert ours[1] == 0
        assert_same(ours, theirs)
        theirs.sum().backward()
        ours.sum().backward()
        assert_same(xs[1].grad, xs[0].grad)
    z = torch.zeros(3, 6)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    theirs, ours = peer.masked_mean(xs[0], z), pv.masked_mean(xs[1], z)
    assert ours == 0 and ours.requires_grad
    assert_same(ours, theirs)
    ours.backward()
    assert torch.equal(xs[1].grad, torch.zeros_like(x))
    assert_same(pv.masked_var(x, z, unbiased=False), peer.masked_var(x, z, unbiased=False))


@pytest.mark.parametrize("dtype", [torch.float32, F64, BF16])
def test_masked_stats_gradients(peer, dtype):
    x, m = _masked_inputs(dtype, torch.float32, 3)
    rtol = 1e-5 if dtype != BF16 else 2e-2
    for name, kw in (
        ("masked_mean", {}),
        ("masked_mean", {"axis": -1}),
        ("masked_var", {}),
        ("masked_whiten", {}),
        ("masked_whiten", {"shift_mean": False}),
    ):
        theirs = grads(lambda t: getattr(peer, name)(t, m, **kw), [x])
        ours = grads(lambda t: getattr(pv, name)(t, m, **kw), [x])
        assert_same(ours[0], theirs[0], rtol=rtol, atol=rtol)


def test_masked_stats_non_contiguous(peer):
    x, m = _masked_inputs(torch.float32, torch.int64, 9, shape=(6, 10))
    for how in ("transposed", "sliced"):
        for name in ("masked_mean", "masked_var", "masked_whiten"):
            assert_same(getattr(pv, name)(layout(x, how), layout(m, how)), getattr(peer, name)(x, m))


def test_masked_stats_too_few_elements(peer):
    x = torch.randn(2, 3)
    for n in (0, 1):
        m = torch.zeros(2, 3)
        m.view(-1)[:n] = 1
        for name in ("masked_var", "masked_whiten"):
            with pytest.raises(ValueError):
                getattr(peer, name)(x, m)
            with pytest.raises(ValueError):
                getattr(pv, name)(x, m)
            with pytest.raises(ValueError):  # the differentiable path checks the count itself
                getattr(pv, name)(x.clone().requires_grad_(True), m)
    with pytest.raises(ValueError, match="mask must be bool or hold only 0 and 1"):
        pv.masked_mean(x, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="mask must be bool or hold only 0 and 1"):
        pv.masked_mean(x, torch.tensor([[0.0, 0, 0], [0.5, 0, 0]]), axis=-1)  # not read as empty
    with pytest.raises(ValueError, match="shape"):
        pv.masked_mean(x, torch.ones(3, 2))
    with pytest.raises(ValueError, match="axis"):
        pv.masked_mean(x, torch.ones(2, 3), axis=(0, 5))


# ------------------------------------------------------------------------------------------------
# KL


@pytest.mark.parametrize("name", KL_NAMES + tuple(k + "+" for k in KL_NAMES))
@pytest.mark.parametrize(
    "dtypes", [(torch.float32, torch.float32), (F64, F64), (torch.float32, BF16), (BF16, F64)], ids=str
)
def test_kl_penalty_matches(peer, name, dtypes):
    g = gen(len(name))
    shape = (4, 37)
    lp = randn(shape, g, dtypes[0], 1.0, -2.0)
    ref = randn(shape, g, dtypes[1], 1.0, -2.0)
    lp.view(-1)[:4] = torch.tensor([-30.0, 30.0, -2.0, 0.0]).to(lp.dtype)  # beyond veRL's ±20 and its 10-clamp
    theirs = peer.kl_penalty(lp, ref, name)
    with pyppo_ops_called() as ops:
        ours = pv.kl_penalty(lp, ref, name)
    assert "pyppo::kl_penalty" in ops
    assert_same(ours, theirs, rtol=1e-5, atol=1e-6)
    g_theirs = grads(lambda a, b: peer.kl_penalty(a, b, name), [lp, ref])
    g_ours = grads(lambda a, b: pv.kl_penalty(a, b, name), [lp, ref])
    for o, t in zip(g_ours, g_theirs):
        assert_same(o, t, rtol=1e-5, atol=1e-6)
    if not name.endswith("+"):
        assert_same(pv.kl_penalty_forward(lp, ref, name), peer.kl_penalty_forward(lp, ref, name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["transposed", "sliced"])
def test_kl_penalty_non_contiguous_and_odd_shapes(peer, how):
    g = gen(2)
    for shape in ((1, 1), (7,), (3, 5, 2)):
        lp, ref = randn(shape, g, scale=0.3), randn(shape, g, scale=0.3)
        for name in ("k3", "k3+", "abs"):
            assert_same(pv.kl_penalty(layout(lp, how), layout(ref, how), name), peer.kl_penalty(lp, ref, name))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_kl_k3_half_precision_at_least_as_close(peer, dtype):
    # k3 = exp(-d) + d - 1 cancels catastrophically in bf16 for the small d PPO sees.
    g = gen(4)
    lp = randn((8, 64), g, dtype, 0.05, -1.0)
    ref = randn((8, 64), g, dtype, 0.05, -1.0)
    exact = peer.kl_penalty(lp.double(), ref.double(), "k3")
    for name in ("k3", "low_var_kl", "k3+"):
        assert_at_least_as_close(pv.kl_penalty(lp, ref, name), peer.kl_penalty(lp, ref, name), exact, dtype)


def test_kl_penalty_errors(peer):
    x = torch.randn(2, 3)
    for name in ("full", "full+", "k4", "K3", ""):
        with pytest.raises(NotImplementedError):
            peer.kl_penalty(x, x, name)
        with pytest.raises(NotImplementedError, match="kl_penalty"):
            pv.kl_penalty(x, x, name)
    for name in ("k3+", "full"):
        with pytest.raises(NotImplementedError):
            peer.kl_penalty_forward(x, x, name)
        with pytest.raises(NotImplementedError):
            pv.kl_penalty_forward(x, x, name)
    with pytest.raises(TypeError, match="kl_penalty must be an estimator name"):
        pv.kl_penalty(x, x, None)
    with pytest.raises(TypeError, match="ref_logprob"):
        pv.kl_penalty(x, 1.0, "k1")
    with pytest.raises(ValueError, match="shape"):
        pv.kl_penalty(x, torch.randn(3, 2), "k3")


# ------------------------------------------------------------------------------------------------
# agg_loss


AGG_KWARGS = [
    {},
    {"dp_size": 4, "batch_num_tokens": 113, "global_batch_size": 9, "loss_scale_factor": 64},
    {"batch_num_tokens": torch.tensor(50), "global_batch_size": torch.tensor(6.0)},
    {"loss_scale_factor": 3},
]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("kwargs", range(len(AGG_KWARGS)))
def test_agg_loss_matches(peer, mode, mask_dtype, kwargs):
    kw = AGG_KWARGS[kwargs]
    g = gen(AGG_MODES.index(mode) * 10 + kwargs)
    L = randn((6, 37), g)
    m = make_mask(6, 37, g, "empty_row", mask_dtype)
    theirs = peer.agg_loss(L, m, mode, **kw)
    ours = pv.agg_loss(L, m, mode, **kw)
    assert_same(ours, theirs)
    g_theirs = grads(lambda t: peer.agg_loss(t, m, mode, **kw), [L])
    g_ours = grads(lambda t: pv.agg_loss(t, m, mode, **kw), [L])
    assert_same(g_ours[0], g_theirs[0])
    L64 = L.double()
    assert_same(pv.agg_loss(L64, m, mode, **kw), peer.agg_loss(L64, m, mode, **kw))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_agg_loss_half_precision(peer, mode, dtype):
    g = gen(8)
    L = randn((16, 200), g, dtype, 1.0, 0.5)
    m = make_mask(16, 200, g)
    theirs, ours = peer.agg_loss(L, m, mode), pv.agg_loss(L, m, mode)
    assert ours.dtype == theirs.dtype
    exact = peer.agg_loss(L.double(), m, mode)
    assert abs(ours.double() - exact) <= abs(theirs.double() - exact) + ULP[ours.dtype] * abs(exact)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_all_masked_and_odd_shapes(peer, mode):
    z = torch.zeros(3, 4, dtype=torch.bool)
    L = torch.randn(3, 4)
    assert_same(pv.agg_loss(L, z, mode), peer.agg_loss(L, z, mode))  # NaN in the mean modes, as veRL
    for shape in ((1, 1), (1, 9), (7,), (2, 3, 5)):
        g = gen(len(shape))
        L = randn(shape, g)
        m = (torch.rand(shape, generator=g) < 0.7).long()
        m.view(-1)[0] = 1
        assert_same(pv.agg_loss(layout(L, "sliced"), m, mode), peer.agg_loss(L, m, mode))


def test_agg_loss_ignores_garbage_at_masked_positions(peer):
    # veRL's seq-mean-* modes multiply the loss by the mask, so a NaN at a masked position makes
    # the loss NaN; pyppo selects masked positions away (a deliberate difference).
    g = gen(1)
    L = randn((3, 8), g)
    m = make_mask(3, 8, g, "pad")
    dirty = torch.where(m.bool(), L, torch.tensor(float("nan")))
    for mode in AGG_MODES:
        assert_same(pv.agg_loss(dirty, m, mode), peer.agg_loss(L, m, mode))
    assert torch.isnan(peer.agg_loss(dirty, m, "seq-mean-token-mean"))


def test_agg_loss_errors(peer):
    L, m = torch.randn(2, 3), torch.ones(2, 3)
    for mode, kw in (("token-mean", {"dp_size": 2}), ("seq-mean-token-mean", {"dp_size": 2}), ("bogus", {})):
        with pytest.raises(ValueError) as theirs:
            peer.agg_loss(L, m, mode, **kw)
        with pytest.raises(ValueError) as ours:
            pv.agg_loss(L, m, mode, **kw)
        assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError, match="loss_mask must be bool or hold only 0 and 1"):
        pv.agg_loss(L, m * 0.5, "token-mean")
    with pytest.raises(ValueError, match="loss_mask has shape"):
        pv.agg_loss(L, torch.ones(3, 2), "token-mean")
    with pytest.raises(ValueError, match="loss_mat must be a floating-point"):
        pv.agg_loss(torch.ones(2, 3, dtype=torch.long), m, "token-mean")
    with pytest.raises(TypeError, match="loss_mask must be a torch.Tensor"):
        pv.agg_loss(L, [[1, 1, 1]] * 2, "token-mean")


# ------------------------------------------------------------------------------------------------
# policy and value losses


def actor_config(**kw):
    from verl.workers.config import ActorConfig

    base = {"strategy": "fsdp", "rollout_n": 1, "ppo_micro_batch_size_per_gpu": 1}
    return ActorConfig(**(base | kw))


def dict_config(**kw):
    from omegaconf import OmegaConf

    base = {
        "clip_ratio": 0.2,
        "clip_ratio_low": None,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 2.5,
        "global_batch_info": {},
    }
    return OmegaConf.create(base | kw)


def policy_inputs(B, T, seed, dtype=torch.float32, kind="holes", mask_dtype=torch.bool, spread=0.4):
    g = gen(seed)
    old = randn((B, T), g, dtype, 1.0, -2.0)
    new = (old.double() + randn((B, T), g, F64, spread)).to(dtype)
    adv = randn((B, T), g, dtype)
    m = make_mask(B, T, g, kind, mask_dtype)
    return old, new, adv, m


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
@pytest.mark.parametrize(
    "clips",
    [
        {"cliprange": 0.2},
        {"cliprange": 0.1, "cliprange_high": 0.28, "clip_ratio_c": 2.0},
        {"cliprange_low": 0.3, "cliprange_high": 0.2, "clip_ratio_c": 10.0},
    ],
    ids=str,
)
def test_compute_policy_loss_matches(peer, mode, mask_dtype, clips):
    old, new, adv, m = policy_inputs(5, 37, AGG_MODES.index(mode), mask_dtype=mask_dtype, kind="empty_row")
    old.view(-1)[:2] = torch.tensor([-40.0, 30.0])  # a log-ratio beyond the ±20 clamp
    with pytest.warns(FutureWarning) as theirs_w:
        theirs = peer.compute_policy_loss(old, new, adv, m, loss_agg_mode=mode, **clips)
    with pytest.warns(FutureWarning) as ours_w:
        ours = pv.compute_policy_loss(old, new, adv, m, loss_agg_mode=mode, **clips)
    assert [str(w.message) for w in ours_w] == [str(w.message) for w in theirs_w]
    assert ours_w[0].filename == __file__  # stacklevel: the caller, as veRL's decorator
    assert_same(ours, theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        g_theirs = grads(lambda a: peer.compute_policy_loss(old, a, adv, m, loss_agg_mode=mode, **clips), [new])
        g_ours = grads(lambda a: pv.compute_policy_loss(old, a, adv, m, loss_agg_mode=mode, **clips), [new])
    assert_same(g_ours[0], g_theirs[0])


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("config", ["actor", "dict", "actor_global"])
@pytest.mark.parametrize("weights", [False, True])
def test_compute_policy_loss_vanilla_matches(peer, mode, config, weights):
    old, new, adv, m = policy_inputs(6, 29, AGG_MODES.index(mode) + 50)
    cfg = {
        "actor": lambda: actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28),
        "dict": lambda: dict_config(),
        "actor_global": lambda: actor_config(
            clip_ratio_c=4.0,
            global_batch_info={"dp_size": 2, "batch_num_tokens": 300, "global_batch_size": 12, "loss_scale_factor": 32},
        ),
    }[config]()
    w = None
    if weights:  # truncated IS weights, zeros included (IcePop rejects tokens with weight 0)
        w = torch.rand(6, 29, generator=gen(3)) * 2
        w[torch.rand(6, 29, generator=gen(4)) < 0.2] = 0
    theirs = peer.compute_policy_loss_vanilla(old, new, adv, m, mode, cfg, w)
    with pyppo_ops_called() as ops:
        ours = pv.compute_policy_loss_vanilla(old, new, adv, m, mode, cfg, w)
    assert "pyppo::masked_mean" in ops
    assert_same(ours, theirs)
    g_theirs = grads(lambda a: peer.compute_policy_loss_vanilla(old, a, adv, m, mode, cfg, w), [new])
    g_ours = grads(lambda a: pv.compute_policy_loss_vanilla(old, a, adv, m, mode, cfg, w), [new])
    assert_same(g_ours[0], g_theirs[0])


OP_LOSSES = {"compute_policy_loss_gspo": "_gspo_policy_loss", "compute_policy_loss_cispo": "_cispo_policy_loss"}


def op_loss_config(name, kind):
    # GSPO's sequence ratio stays near 1 (a mean of token log-ratios): its clip range is narrow,
    # as in the paper, so that some sequences are clipped.
    clips = (
        {"clip_ratio_low": 0.03, "clip_ratio_high": 0.04}
        if "gspo" in name
        else {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    )
    if kind == "global":
        clips["global_batch_info"] = {
            "dp_size": 2,
            "batch_num_tokens": 300,
            "global_batch_size": 12,
            "loss_scale_factor": 32,
        }
    return actor_config(**clips)


@pytest.mark.parametrize("name", list(OP_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("config", ["actor", "global"])
@pytest.mark.parametrize("weights", [False, True])
def test_gspo_and_cispo_match(peer, monkeypatch, name, mode, config, weights):
    from pyppo.integrations.verl import core_algos

    old, new, adv, m = policy_inputs(6, 29, AGG_MODES.index(mode) + 70, kind="empty_row", mask_dtype=torch.int64)
    cfg = op_loss_config(name, config)
    w = None
    if weights:  # truncated IS weights, zeros included (IcePop rejects tokens with weight 0)
        w = torch.rand(6, 29, generator=gen(5)) * 2
        w[torch.rand(6, 29, generator=gen(6)) < 0.2] = 0
    calls = []
    op = getattr(core_algos, OP_LOSSES[name])
    monkeypatch.setattr(core_algos, OP_LOSSES[name], lambda *a, **k: calls.append(k.get("loss_agg")) or op(*a, **k))
    theirs = getattr(peer.ca, name)(old, new, adv, m, mode, cfg, w)
    with pyppo_ops_called() as ops:
        ours = getattr(pv, name)(old, new, adv, m, mode, cfg, w)
    assert calls and "pyppo::masked_mean" in ops  # the loss from the op, ppo_kl from masked_mean
    assert_same(ours, theirs)
    if mode == "token-mean" and not weights:
        assert ours[1]["actor/pg_clipfrac"] > 0.05  # not vacuous: some tokens are clipped
    for i in (1, 2):  # gradients w.r.t. log_prob and advantages

        def run(f, a):
            inputs = [old, new, adv]
            inputs[i] = a
            return f(*inputs, m, mode, cfg, w)

        assert_same(
            grads(lambda a: run(pv.__dict__[name], a), [(old, new, adv)[i]])[0],
            grads(lambda a: run(getattr(peer.ca, name), a), [(old, new, adv)[i]])[0],
        )


@pytest.mark.parametrize("name", list(OP_LOSSES))
@pytest.mark.parametrize(
    "dtypes",
    [
        (F64, F64, torch.bool),
        (BF16, BF16, torch.int64),
        (BF16, torch.float32, F64),
        (torch.float32, torch.float32, F64),
        (F16, F16, torch.float32),
    ],
    ids=str,
)
def test_gspo_and_cispo_dtypes(peer, name, dtypes):
    lp_dtype, adv_dtype, mask_dtype = dtypes
    old, new, adv, m = policy_inputs(4, 16, 1, dtype=lp_dtype, mask_dtype=mask_dtype, spread=0.05)
    adv = adv.to(adv_dtype)
    w = torch.rand(4, 16, generator=gen(1)).to(adv_dtype)
    cfg = op_loss_config(name, "actor")
    for mode in AGG_MODES:
        theirs = getattr(peer.ca, name)(old, new, adv, m, mode, cfg, w)
        ours = getattr(pv, name)(old, new, adv, m, mode, cfg, w)
        assert ours[0].dtype == theirs[0].dtype and ours[1].keys() == theirs[1].keys()
        assert all(type(v) is float for v in ours[1].values())
        if lp_dtype == F64 or ours[0].dtype == lp_dtype == torch.float32:
            assert_same(ours, theirs)
        elif ours[0].dtype == F64:
            # float64 sums of veRL's per-token losses, which are rounded to the inputs' dtype
            # (pyppo computes them in float64).
            assert_same(ours, theirs, rtol=1e-6 if lp_dtype == torch.float32 else 2 * ULP[lp_dtype], atol=1e-7)
        else:  # veRL computes in bf16/fp16: pyppo must be at least as close to float64
            exact = getattr(peer.ca, name)(old.double(), new.double(), adv.double(), m, mode, cfg, w.double())
            e_ours, e_theirs = abs(ours[0].double() - exact[0]), abs(theirs[0].double() - exact[0])
            assert e_ours <= e_theirs + ULP[ours[0].dtype] * abs(exact[0]), (mode, e_ours, e_theirs)


def test_gspo_and_cispo_edges(peer):
    old, new, adv, m = policy_inputs(3, 7, 4, mask_dtype=torch.int64)
    cfg = op_loss_config("cispo", "actor")
    # CISPO clamps each log-ratio to ±20, as veRL does; GSPO's sequence mean is of clamped
    # log-ratios in pyppo, of raw ones in veRL: a row with a token beyond ±20 differs.
    far = old.clone()
    far[0, 0], m[0, 0] = new[0, 0] - 40.0, 1
    assert_same(
        pv.compute_policy_loss_cispo(far, new, adv, m, "token-mean", cfg),
        peer.ca.compute_policy_loss_cispo(far, new, adv, m, "token-mean", cfg),
    )
    ours = pv.compute_policy_loss_gspo(far, new, adv, m, "token-mean", cfg)[0]
    assert not torch.isclose(ours, peer.ca.compute_policy_loss_gspo(far, new, adv, m, "token-mean", cfg)[0])
    # An all-masked batch: veRL's 0 / 0 (NaN loss, zero statistics).
    z = torch.zeros_like(m)
    for name in OP_LOSSES:
        ours, theirs = (
            getattr(pv, name)(old, new, adv, z, "token-mean", cfg),
            getattr(peer.ca, name)(old, new, adv, z, "token-mean", cfg),
        )
        assert ours[0].isnan() and theirs[0].isnan() and ours[1] == theirs[1]
    # Errors: veRL's asserts, and what the ops refuse.
    for name in OP_LOSSES:
        for bad in (None, dict_config()):
            for f in (getattr(pv, name), getattr(peer.ca, name)):
                with pytest.raises(AssertionError):
                    f(old, new, adv, m, "token-mean", bad)
        with pytest.raises(ValueError, match="cliprange_low"):
            getattr(pv, name)(old, new, adv, m, "token-mean", actor_config(clip_ratio_low=1.5))
    neg = torch.ones_like(adv)
    neg[1, 1] = -1.0
    with pytest.raises(ValueError, match="rollout_is_weights must be >= 0"):
        pv.compute_policy_loss_gspo(old, new, adv, m, "token-mean", cfg, neg)
    assert_same(
        pv.compute_policy_loss_cispo(old, new, adv, m, "token-mean", cfg, neg),
        peer.ca.compute_policy_loss_cispo(old, new, adv, m, "token-mean", cfg, neg),
    )


@pytest.mark.parametrize(
    "dtypes",
    [(F64, F64, torch.bool), (BF16, BF16, torch.int64), (BF16, torch.float32, torch.bool), (F16, F16, torch.float32)],
    ids=str,
)
def test_policy_and_value_loss_dtypes(peer, dtypes):
    lp_dtype, adv_dtype, mask_dtype = dtypes
    old, new, adv, m = policy_inputs(4, 16, 1, dtype=lp_dtype, mask_dtype=mask_dtype, spread=0.05)
    adv = adv.to(adv_dtype)
    w = torch.rand(4, 16, generator=gen(1)).to(adv_dtype)
    cfg = actor_config()
    exact = peer.compute_policy_loss_vanilla(old.double(), new.double(), adv.double(), m, "token-mean", cfg, w.double())
    for mode in AGG_MODES:
        theirs = peer.compute_policy_loss_vanilla(old, new, adv, m, mode, cfg, w)
        ours = pv.compute_policy_loss_vanilla(old, new, adv, m, mode, cfg, w)
        assert ours[0].dtype == theirs[0].dtype and ours[1].keys() == theirs[1].keys()
        assert all(type(v) is float for v in ours[1].values())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            t4 = peer.compute_policy_loss(old, new, adv, m, cliprange=0.2, loss_agg_mode=mode)
            o4 = pv.compute_policy_loss(old, new, adv, m, cliprange=0.2, loss_agg_mode=mode)
        assert [t.dtype for t in o4] == [t.dtype for t in t4]
        vt = peer.compute_value_loss(new, adv, old, m, 0.5, mode)
        vo = pv.compute_value_loss(new, adv, old, m, 0.5, mode)
        assert [t.dtype for t in vo] == [t.dtype for t in vt]
    if lp_dtype == F64:
        assert_same(ours, theirs)
        assert_same(vo, vt)
    else:
        theirs = peer.compute_policy_loss_vanilla(old, new, adv, m, "token-mean", cfg, w)
        ours = pv.compute_policy_loss_vanilla(old, new, adv, m, "token-mean", cfg, w)
        e_ours, e_theirs = abs(ours[0].double() - exact[0]), abs(theirs[0].double() - exact[0])
        assert e_ours <= e_theirs + ULP[ours[0].dtype] * abs(exact[0]), (e_ours, e_theirs)
        assert (
            abs(ours[1]["actor/ppo_kl"] - exact[1]["actor/ppo_kl"])
            <= abs(theirs[1]["actor/ppo_kl"] - exact[1]["actor/ppo_kl"]) + 1e-6
        )


def test_loss_gradients_at_ties_and_wrt_old_log_prob(peer):
    # The adapters compute torch's derivative of veRL's expression themselves; check it where
    # torch splits a tie (maximum/minimum of equal terms) and at the clamp boundaries.
    old = torch.zeros(2, 4)
    lp = torch.tensor([[1.0, 0.0, -0.5, 25.0], [1.0, 0.1, -30.0, 0.9]])  # A = 0 outside the clip range last
    adv = torch.tensor([[-1.0, 1.0, -2.0, -1.0], [1.0, -1.0, 1.0, 0.0]])
    m = torch.ones(2, 4, dtype=torch.bool)
    r = float(torch.exp(torch.tensor(1.0)))  # the float32 ratio at log-ratio 1
    cfg_tie_dual = dict_config(clip_ratio_c=r)  # -A·c == clipped term for A < 0 at ratio r
    cfg_tie_clip = dict_config(clip_ratio_high=r - 1, clip_ratio_c=10.0)  # ratio exactly at 1 + ε_high
    for cfg in (cfg_tie_dual, cfg_tie_clip):
        for fn_args in ((0,), (1,)):

            def run(f, a):
                inputs = [old, lp]
                inputs[fn_args[0]] = a
                return f(inputs[0], inputs[1], adv, m, "token-sum", cfg)

            start = (old, lp)[fn_args[0]]
            assert_same(
                grads(lambda a: run(pv.compute_policy_loss_vanilla, a), [start])[0],
                grads(lambda a: run(peer.compute_policy_loss_vanilla, a), [start])[0],
            )
    # Gradients w.r.t. the advantages too (PPO treats them as constants; veRL's autograd does not).
    for cfg in (cfg_tie_dual, cfg_tie_clip):
        assert_same(
            grads(lambda a: pv.compute_policy_loss_vanilla(old, lp, a, m, "token-sum", cfg), [adv])[0],
            grads(lambda a: peer.compute_policy_loss_vanilla(old, lp, a, m, "token-sum", cfg), [adv])[0],
        )
    values = torch.tensor([[0.0, 1.0, -1.0, 0.5, 0.3]])
    returns = torch.tensor([[1.0, 0.0, 2.0, 0.5, 0.3]])
    m1 = torch.ones(1, 5, dtype=torch.bool)
    for vpreds in (values + 0.2, values - 0.2, values.clone(), values + 0.1, values + 0.5):
        for i in range(3):

            def run(f, a):
                inputs = [vpreds, returns, values]
                inputs[i] = a
                return f(*inputs, m1, 0.2, "token-sum")

            start = (vpreds, returns, values)[i]
            assert_same(
                grads(lambda a: run(pv.compute_value_loss, a), [start])[0],
                grads(lambda a: run(peer.compute_value_loss, a), [start])[0],
            )


def test_policy_loss_all_masked(peer):
    old, new, adv, _ = policy_inputs(3, 5, 2)
    z = torch.zeros(3, 5, dtype=torch.bool)
    cfg = actor_config()
    assert_same(
        pv.compute_policy_loss_vanilla(old, new, adv, z, "token-mean", cfg),
        peer.compute_policy_loss_vanilla(old, new, adv, z, "token-mean", cfg),
    )
    assert_same(pv.compute_value_loss(new, adv, old, z, 0.2), peer.compute_value_loss(new, adv, old, z, 0.2))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_compute_value_loss_matches(peer, mode, mask_dtype):
    g = gen(AGG_MODES.index(mode))
    B, T = 5, 37
    values, returns = randn((B, T), g), randn((B, T), g)
    vpreds = (values.double() + randn((B, T), g, F64, 0.5)).float()
    m = make_mask(B, T, g, "empty_row", mask_dtype)
    for kw in ({}, {"dp_size": 3, "batch_num_tokens": 90, "global_batch_size": 7, "loss_scale_factor": 40}):
        theirs = peer.compute_value_loss(vpreds, returns, values, m, 0.2, mode, **kw)
        with pyppo_ops_called() as ops:
            ours = pv.compute_value_loss(vpreds, returns, values, m, 0.2, mode, **kw)
        assert "pyppo::masked_mean" in ops
        assert_same(ours, theirs)
        g_theirs = grads(lambda a: peer.compute_value_loss(a, returns, values, m, 0.2, mode, **kw), [vpreds])
        g_ours = grads(lambda a: pv.compute_value_loss(a, returns, values, m, 0.2, mode, **kw), [vpreds])
        assert_same(g_ours[0], g_theirs[0])
    # Unclipped predictions: no token counts as clipped (veRL's clip_by_value returns V itself).
    assert pv.compute_value_loss(vpreds, returns, values, m, 100.0)[1] == 0


def test_policy_and_value_loss_errors(peer):
    old, new, adv, m = policy_inputs(2, 4, 0)
    cases = [
        (AssertionError, "compute_policy_loss", (old, new, adv, m), {"cliprange": 0.2, "clip_ratio_c": 1.0}),
        (TypeError, "compute_policy_loss", (old, new, adv, m), {}),
        (AssertionError, "compute_policy_loss_vanilla", (old, new, adv, m), {}),
        (
            AssertionError,
            "compute_policy_loss_vanilla",
            (old, new, adv, m, "token-mean", actor_config(clip_ratio_c=0.5)),
            {},
        ),
        (ValueError, "compute_policy_loss_vanilla", (old, new, adv, m, "bogus", actor_config()), {}),
        (TypeError, "compute_value_loss", (new, adv, old, m, None), {}),
        (ValueError, "compute_value_loss", (new, adv, old, m, 0.2, "bogus"), {}),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for exc, name, args, kw in cases:
            with pytest.raises(exc):
                getattr(peer, name)(*args, **kw)
            with pytest.raises(exc) as ours:
                getattr(pv, name)(*args, **kw)
            assert "Exception raised from" not in str(ours.value)
        with pytest.raises(ValueError, match="response_mask must be bool or hold only 0 and 1"):
            pv.compute_policy_loss(old, new, adv, m * 0.5, cliprange=0.2)
        with pytest.raises(ValueError, match="advantages has shape"):
            pv.compute_policy_loss(old, new, adv[:, :2], m, cliprange=0.2)
        with pytest.raises(ValueError, match="returns has shape"):
            pv.compute_value_loss(new, adv[:1], old, m, 0.2)


# ------------------------------------------------------------------------------------------------
# critic-free outcome advantages: GRPO, Dr. GRPO, RLOO, REINFORCE++(-baseline)

GROUP_CASES = [  # (function, keyword arguments)
    ("compute_grpo_outcome_advantage", {}),
    ("compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": False}),  # Dr. GRPO
    ("compute_grpo_outcome_advantage", {"epsilon": 1e-3}),
    ("compute_grpo_vectorized_outcome_advantage", {}),
    ("compute_grpo_vectorized_outcome_advantage", {"norm_adv_by_std_in_grpo": False, "epsilon": 0.0}),
    ("compute_rloo_outcome_advantage", {}),
    ("compute_rloo_vectorized_outcome_advantage", {}),
    ("compute_reinforce_plus_plus_baseline_outcome_advantage", {}),
]
GROUP_IDS = ["grpo", "dr_grpo", "grpo_eps", "grpo_vec", "dr_grpo_vec", "rloo", "rloo_vec", "rfpp_baseline"]
REGISTRY = {
    "grpo": "compute_grpo_outcome_advantage",
    "grpo_vectorized": "compute_grpo_vectorized_outcome_advantage",
    "rloo": "compute_rloo_outcome_advantage",
    "rloo_vectorized": "compute_rloo_vectorized_outcome_advantage",
    "reinforce_plus_plus_baseline": "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "reinforce_plus_plus": "compute_reinforce_plus_plus_outcome_advantage",
}
SIZES = (4, 1, 3, 8, 1, 2, 5)  # group 0 gets all-equal scores; two singletons


def group_batch(sizes, T, seed, dtype=torch.float32, mask_dtype=torch.int64, kind="empty_row"):
    """A batch of groups of these sizes, labelled by uid strings (veRL's ``non_tensor_batch["uid"]``)
    and laid out in a random row order (non-contiguous groups); rewards at every position (veRL
    sums the row, masked positions included); the rows of the first group are copies of one row
    (all-equal scores). Returns rewards, mask, index and the rows of that group."""
    g = gen(seed)
    labels = np.repeat(np.array([f"{seed}-{k}" for k in range(len(sizes))], dtype=object), sizes)
    index = labels[torch.randperm(len(labels), generator=g).numpy()]
    rewards = randn((len(labels), T), g, F64, 0.5)
    equal = torch.from_numpy(index == labels[0])
    rewards[equal] = rewards[equal][0]
    return rewards.to(dtype), make_mask(len(labels), T, g, kind, mask_dtype), index, equal


def group_tolerance(name, kwargs, dtype, mask_dtype):
    if dtype != F64 or "grpo_vectorized" in name:  # veRL's vectorized GRPO has float32 statistics
        return {"rtol": 1e-5, "atol": 1e-5}
    if name == "compute_grpo_outcome_advantage" and kwargs.get("norm_adv_by_std_in_grpo", True):
        # veRL divides a singleton by its float32 std + epsilon, float32(1 + 1e-6): 5e-8 relative.
        return {"rtol": 1e-7, "atol": 1e-9}
    if "plus_plus" in name:
        # veRL's whitening: the Bessel factor n / (n - 1) is float32 unless the mask is float64;
        # with a float64 mask, veRL's count + 1e-8 (a 1e-10 effect here) is reproduced.
        return {"rtol": 2e-7, "atol": 1e-7} if mask_dtype != F64 else {"rtol": 1e-12, "atol": 1e-12}
    return {"rtol": 1e-9, "atol": 1e-10}


def assert_group_same(ours, theirs, equal, name, tol):
    """veRL's types, dtypes and values; ``advantages is returns`` as in veRL; exactly 0 at masked
    positions and, before any whitening, in the all-equal group (veRL leaves rounding noise
    there, so its rows there are only compared after whitening)."""
    assert isinstance(ours, tuple) and len(ours) == 2 and ours[0] is ours[1]
    adv, ref = ours[0], theirs[0]
    assert adv.dtype == ref.dtype and adv.shape == ref.shape and not adv.requires_grad, (adv.dtype, ref.dtype)
    if "plus_plus" in name:
        assert_same(adv, ref, **tol)
        return
    assert torch.all(adv[equal] == 0)
    assert_same(adv[~equal], ref[~equal], **tol)


@pytest.mark.parametrize("case", GROUP_CASES, ids=GROUP_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
def test_group_estimators_match(peer, case, dtype, mask_dtype):
    name, kwargs = case
    r, m, index, equal = group_batch(SIZES, 9, GROUP_CASES.index(case), dtype, mask_dtype)
    theirs = getattr(peer, name)(r, m, index, **kwargs)
    with pyppo_ops_called() as ops:
        ours = getattr(pv, name)(r, m, index, **kwargs)
    assert "pyppo::group_advantages" in ops
    assert_group_same(ours, theirs, equal, name, group_tolerance(name, kwargs, dtype, mask_dtype))
    mb = m.bool()
    assert torch.all(ours[0][~mb] == 0)  # masked positions, the all-masked row 0 included
    assert torch.any(ours[0][~equal].abs() > 1e-3)  # not vacuous
    # veRL's trainer passes everything by keyword, and the estimators that take **kwargs get the
    # reward baselines too.
    extra = {"reward_baselines": r[:, 0]} if "rloo" in name or "plus_plus" in name else {}
    again = getattr(pv, name)(token_level_rewards=r, response_mask=m, index=index, config=None, **kwargs, **extra)
    assert torch.equal(again[0], ours[0])


@HYP
@given(
    case=st.sampled_from(GROUP_CASES),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=7),
    T=st.sampled_from([1, 2, 7]),
    seed=st.integers(0, 2**16),
)
def test_group_estimators_property(peer, case, sizes, T, seed):
    name, kwargs = case
    if "plus_plus" in name and len(sizes) == 1:
        # The whitening needs 2 valid positions, and a batch that is one all-equal group would
        # whiten veRL's rounding residue (pyppo: 0) into an O(1e-3) value.
        sizes = sizes + [2]
    r, m, index, equal = group_batch(sizes, T, seed, mask_dtype=torch.int64, kind="pad")
    if sizes[0] == 1:
        equal[:] = False  # a singleton is not an all-equal group
    theirs = getattr(peer, name)(r, m, index, **kwargs)
    assert_group_same(getattr(pv, name)(r, m, index, **kwargs), theirs, equal, name, {"rtol": 1e-5, "atol": 1e-5})


def test_group_edge_cases(peer):
    # A singleton (score 2), eight equal scores of 2.9, and a pair (1, -1) whose second row is
    # all masked: its score still counts in the pair's statistics.
    scores = torch.tensor([2.0] + [2.9] * 8 + [1.0, -1.0])
    r = torch.zeros(11, 3)
    r[:, 1] = scores
    m = torch.ones(11, 3, dtype=torch.int64)
    m[10] = 0
    index = np.array(["solo"] + ["same"] * 8 + ["pair"] * 2, dtype=object)
    expect = {  # row 0 (singleton), row 9 (the pair's valid row)
        "compute_grpo_outcome_advantage": (2.0 / (1 + 1e-6), 1 / (2**0.5 + 1e-6)),
        "compute_grpo_vectorized_outcome_advantage": (2.0 / (1 + 1e-6), 1 / (2**0.5 + 1e-6)),
        "compute_rloo_outcome_advantage": (2.0, 2.0),
        "compute_rloo_vectorized_outcome_advantage": (0.0, 2.0),
    }
    for name, (solo, pair) in expect.items():
        ours, theirs = getattr(pv, name)(r, m, index), getattr(peer, name)(r, m, index)
        for adv in (ours[0], theirs[0]):
            torch.testing.assert_close(adv[0], torch.full((3,), solo), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(adv[9], torch.full((3,), pair), rtol=1e-6, atol=1e-6)
            assert torch.all(adv[10] == 0)
        assert torch.all(ours[0][1:9] == 0)  # equal scores: exactly 0
    # veRL's float32 mean and std of the equal group leave noise that / (std + 1e-6) magnifies.
    assert peer.compute_grpo_outcome_advantage(r, m, index)[0][1:9].abs().max() > 0.1
    dr = pv.compute_grpo_outcome_advantage(r, m, index, norm_adv_by_std_in_grpo=False)[0]
    assert dr[0, 0] == 2.0 and dr[9, 0] == 1.0
    # An empty batch gives veRL's empty result.
    for name in expect:
        ours, theirs = getattr(pv, name)(r[:0], m[:0], index[:0]), getattr(peer, name)(r[:0], m[:0], index[:0])
        assert ours[0].shape == theirs[0].shape == (0, 3) and ours[0].dtype == theirs[0].dtype


def test_group_index_forms(peer):
    r, m, index, _ = group_batch(SIZES, 5, 7)
    codes = {u: k for k, u in enumerate(dict.fromkeys(index))}
    ints = np.array([codes[u] * 7 + 2 for u in index])  # non-consecutive labels
    mixed = np.array([None if codes[u] == 0 else (u if codes[u] % 2 else codes[u]) for u in index], dtype=object)
    for name in dict(GROUP_CASES):
        expected = getattr(pv, name)(r, m, index)[0]
        for form in (list(index), ints, ints - 50, list(ints), mixed):  # mixed: np.unique cannot sort them
            assert torch.equal(getattr(pv, name)(r, m, form)[0], expected), (name, type(form))
        assert torch.equal(getattr(pv, name)(r, m, torch.from_numpy(ints))[0], expected)
        if "vectorized" not in name:
            # veRL's dict groups these labels the same way.
            assert_same(getattr(peer, name)(r, m, mixed)[0], expected, rtol=1e-5, atol=1e-5)
    # veRL's loop estimators key a dict by index[i]: a torch tensor's elements are new objects
    # hashed by identity, so GRPO's lookups fail and RLOO finds no group (the scores come back
    # unchanged); pyppo groups a tensor by value, as veRL's vectorized estimators do.
    for name in ("compute_grpo_outcome_advantage", "compute_reinforce_plus_plus_baseline_outcome_advantage"):
        with pytest.raises(KeyError):
            getattr(peer, name)(r, m, torch.from_numpy(ints))
    unchanged = peer.compute_rloo_outcome_advantage(r, m, torch.from_numpy(ints))[0]
    assert torch.equal(unchanged, r.sum(-1, keepdim=True) * m)
    assert_same(
        pv.compute_grpo_outcome_advantage(r, m, torch.from_numpy(ints))[0],
        peer.compute_grpo_vectorized_outcome_advantage(r, m, torch.from_numpy(ints))[0],
        rtol=1e-5,
        atol=1e-5,
    )


def test_group_errors(peer):
    r, m, index, _ = group_batch((2, 3), 4, 1)
    for name, _ in GROUP_CASES:
        fn = getattr(pv, name)
        with pytest.raises(ValueError, match="index must hold one group label per row"):
            fn(r, m, index[:-1])
        with pytest.raises(ValueError, match="index must hold one group label per row"):
            fn(r, m, np.stack([index, index], 1))
        with pytest.raises(ValueError, match="response_mask must be bool or hold only 0 and 1"):
            fn(r, m * 2, index)
        with pytest.raises(ValueError, match="response_mask has shape"):
            fn(r, m[:, :2], index)
        with pytest.raises(ValueError, match=r"token_level_rewards must be \[B, T\]"):
            fn(r[:, 0], m[:, 0], index)
        if "vectorized" not in name:  # integer rewards: see test_integer_rewards_are_promoted_as_verl_does
            with pytest.raises(ValueError, match="floating-point"):
                fn(r.long(), m, index)
        bad = r.clone()
        bad[3, 0] = float("nan")  # veRL: NaN advantages for the whole group
        with pytest.raises(ValueError, match="finite"):
            fn(bad, m, index)
        assert getattr(peer, name)(bad, m, index)[0].isnan().any()
    with pytest.raises(ValueError, match="eps"):
        pv.compute_grpo_outcome_advantage(r, m, index, epsilon=-1e-6)
    with pytest.raises(IndexError):
        peer.compute_grpo_outcome_advantage(r, m, index[:-1])
    one = torch.zeros_like(m)
    one[0, 0] = 1
    name = "compute_reinforce_plus_plus_baseline_outcome_advantage"
    with pytest.raises(ValueError):
        getattr(peer, name)(r, one, index)
    with pytest.raises(ValueError, match="selects 1 position"):
        getattr(pv, name)(r, one, index)


@pytest.mark.parametrize(
    "case", GROUP_CASES + [("compute_reinforce_plus_plus_outcome_advantage", {})], ids=GROUP_IDS + ["rfpp"]
)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_group_estimators_half_precision_at_least_as_close(peer, case, dtype):
    # veRL sums, centres and divides in the input dtype (its vectorized estimators round the row
    # sums to it first); pyppo computes in float32 from the rewards as given.
    name, kwargs = case
    r, m, index, _ = group_batch((8, 8, 4, 1, 6, 5), 16, 11, torch.float32)
    r = r.to(dtype)
    args = (m, SimpleNamespace(gamma=0.95)) if "plus_plus_outcome" in name else (m, index)
    theirs = getattr(peer, name)(r, *args, **kwargs)
    ours = getattr(pv, name)(r, *args, **kwargs)
    # The reference: veRL's (non-vectorized, for GRPO: float64 statistics) estimator in float64.
    exact = getattr(peer, name.replace("grpo_vectorized", "grpo"))(r.double(), *args, **kwargs)
    for o, t, e in zip(ours, theirs, exact):
        assert o.dtype == t.dtype and o.shape == t.shape
        assert_at_least_as_close(o, t, e, o.dtype if o.dtype in ULP else dtype)


@pytest.mark.parametrize("kind", ["holes", "pad", "empty_row", "leading", "full"])
@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float32, F64], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_reinforce_plus_plus_matches(peer, kind, mask_dtype, dtype):
    g = gen(len(kind))
    B, T = 5, 23
    r, m = randn((B, T), g, dtype), make_mask(B, T, g, kind, mask_dtype)
    for gamma in (1.0, 0.9, 0.0):
        cfg = SimpleNamespace(gamma=gamma)
        theirs = peer.compute_reinforce_plus_plus_outcome_advantage(r, m, cfg)
        with pyppo_ops_called() as ops:
            ours = pv.compute_reinforce_plus_plus_outcome_advantage(r, m, cfg)
        assert "pyppo::gae" in ops
        tol = group_tolerance("compute_reinforce_plus_plus_outcome_advantage", {}, dtype, mask_dtype)
        assert_same(ours, theirs, rtol=tol["rtol"] * 4, atol=tol["atol"] * 4)
        mb = m.bool()
        assert torch.all(ours[0][~mb] == 0) and torch.all(ours[1][~mb] == 0)
    # A bool mask, on which veRL fails (1 - bool), gives the int mask's result.
    cfg = SimpleNamespace(gamma=0.9)
    with pytest.raises(RuntimeError):
        peer.compute_reinforce_plus_plus_outcome_advantage(r, m.bool(), cfg)
    expected = pv.compute_reinforce_plus_plus_outcome_advantage(r, m.long(), cfg)
    assert_same(pv.compute_reinforce_plus_plus_outcome_advantage(r, m.bool(), cfg), expected, rtol=0, atol=0)


def test_reinforce_plus_plus_errors(peer):
    g = gen(0)
    r, m = randn((3, 6), g), make_mask(3, 6, g, "holes")
    for fn in (peer.compute_reinforce_plus_plus_outcome_advantage, pv.compute_reinforce_plus_plus_outcome_advantage):
        with pytest.raises(AssertionError):
            fn(r, m)
        one = torch.zeros_like(m)
        one[1, 2] = 1
        with pytest.raises(ValueError):
            fn(r, one, SimpleNamespace(gamma=1.0))
    with pytest.raises(ValueError, match="gamma"):
        pv.compute_reinforce_plus_plus_outcome_advantage(r, m, SimpleNamespace(gamma=1.5))
    with pytest.raises(ValueError, match="selects 1 position"):
        pv.compute_reinforce_plus_plus_outcome_advantage(r, one, SimpleNamespace(gamma=1.0))


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float32, torch.bool], ids=str)
@pytest.mark.parametrize("reward_dtype", [torch.int64, torch.int32, torch.bool], ids=str)
def test_integer_rewards_are_promoted_as_verl_does(peer, mask_dtype, reward_dtype):
    # A user's rule-based reward returns integer scores (0/1, or -1/+1): veRL's GAE and its
    # vectorized group estimators promote them and compute; so do the adapters, to veRL's values
    # and dtypes. Where veRL itself fails (its non-vectorized estimators' torch.mean of integers)
    # or truncates (REINFORCE++ keeps the returns in the rewards' dtype), a ValueError says so.
    g = gen(7)
    B, T = 9, 6
    m = make_mask(B, T, g, "holes", mask_dtype)
    m[:, 0] = True if mask_dtype == torch.bool else 1
    r = torch.randint(-2, 3, (B, T), generator=g).to(reward_dtype)
    index = np.array(["a"] * 3 + ["b"] * 4 + ["c"] * 2, dtype=object)
    cases = [
        ("compute_grpo_vectorized_outcome_advantage", (m, index)),
        ("compute_rloo_vectorized_outcome_advantage", (m, index)),
    ]
    if mask_dtype != torch.bool:  # veRL's GAE fails on a bool mask (1 - mask)
        cases.append(("compute_gae_advantage_return", (randn((B, T), g), m, 0.99, 0.95)))
    for name, args in cases:
        theirs = getattr(peer, name)(r, *args)
        with pyppo_ops_called() as ops:
            ours = getattr(pv, name)(r, *args)
        assert ops, name
        assert_same(ours, theirs, rtol=1e-5, atol=1e-6)
    for name in (
        "compute_grpo_outcome_advantage",
        "compute_rloo_outcome_advantage",
        "compute_reinforce_plus_plus_baseline_outcome_advantage",
    ):
        with pytest.raises(RuntimeError, match="mean"):
            getattr(peer, name)(r, m, index)
        with pytest.raises(ValueError, match="token_level_rewards must be a floating-point tensor"):
            getattr(pv, name)(r, m, index)
    with pytest.raises(ValueError, match="truncating"):
        pv.compute_reinforce_plus_plus_outcome_advantage(r, m, SimpleNamespace(gamma=0.9))


# ------------------------------------------------------------------------------------------------
# log-probs and entropy


@HYP
@given(
    dtype=st.sampled_from(FLOATS),
    shape=st.sampled_from([(1, 1), (2, 5), (3, 1), (7,), (2, 3, 4)]),
    V=st.sampled_from([1, 7, 33, 257]),
    how=st.sampled_from(["contiguous", "transposed", "sliced"]),
    seed=st.integers(0, 2**16),
)
def test_logprobs_and_entropy_match(peer, dtype, shape, V, how, seed):
    g = gen(seed)
    z = randn((*shape, V), g, dtype, 3.0)
    labels = torch.randint(0, V, shape, generator=g)
    zl = layout(z, how)
    for name, args in (("logprobs_from_logits", (labels,)), ("entropy_from_logits", ())):
        theirs = getattr(peer, name)(z, *args)
        with pyppo_ops_called() as ops:
            ours = getattr(pv, name)(zl, *args)
        assert "pyppo::gather_logprobs" in ops
        g_theirs = grads(lambda t: getattr(peer, name)(t, *args), [z])[0]
        g_ours = grads(lambda t: getattr(pv, name)(layout(t, how), *args), [z])[0]
        if dtype in (torch.float32, F64):
            assert_same(ours, theirs, rtol=1e-5, atol=2e-6)
            assert_same(g_ours, g_theirs, rtol=1e-5, atol=2e-6)
        else:
            z64 = z.double()
            assert_at_least_as_close(ours, theirs, getattr(peer, name)(z64, *args), dtype)
            g_exact = grads(lambda t: getattr(peer, name)(t, *args), [z64])[0]
            assert_at_least_as_close(g_ours, g_theirs, g_exact, dtype)
    if len(shape) == 2:
        assert_same(
            pv.entropy_from_logits_with_chunking(zl.flatten(0, 1), 3),
            peer.entropy_from_logits_with_chunking(z.flatten(0, 1), 3),
            rtol=1e-3 if dtype != F64 else 1e-5,
            atol=1e-3,
        )


def test_logprobs_from_logits_inplace_backward_and_errors(peer):
    z = torch.randn(2, 3, 7)
    labels = torch.randint(0, 7, (2, 3))
    assert_same(pv.logprobs_from_logits(z, labels, inplace_backward=False), peer.logprobs_from_logits(z, labels))
    bad = labels.clone()
    bad[1, 2] = 7
    with pytest.raises(RuntimeError):
        peer.logprobs_from_logits(z, bad)  # veRL's gather: index out of bounds
    with pytest.raises(ValueError, match="label") as e:
        pv.logprobs_from_logits(z, bad)
    assert "Exception raised from" not in str(e.value)
    with pytest.raises(ValueError, match="labels"):
        pv.logprobs_from_logits(z, labels[:, :2])
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        pv.logprobs_from_logits(z, [0, 1])
    with pytest.raises(ValueError):
        peer.entropy_from_logits_with_chunking(z[0], 0)
    for bad_chunk in (0, -1, 2.5):
        with pytest.raises(ValueError, match="chunk_size"):
            pv.entropy_from_logits_with_chunking(z[0], bad_chunk)
    with pytest.raises(ValueError, match="2-D"):
        pv.entropy_from_logits_with_chunking(z, 4)


def test_logprobs_dtype_follows_verl_dispatch(peer, monkeypatch):
    # With flash-attn's cross-entropy veRL returns float32 log-probs, else the logits' dtype.
    z = torch.randn(2, 3, 7, dtype=BF16)
    labels = torch.randint(0, 7, (2, 3))
    assert pv.logprobs_from_logits(z, labels).dtype == peer.logprobs_from_logits(z, labels).dtype == BF16
    monkeypatch.setattr(peer.tf, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", True)
    assert pv.logprobs_from_logits(z, labels).dtype == torch.float32
    monkeypatch.setenv("VERL_DISABLE_FLASH_ATTN_CE", "1")
    assert pv.logprobs_from_logits(z, labels).dtype == BF16


# ------------------------------------------------------------------------------------------------
# patch / unpatch


def _call_sites(peer):
    """Calls through veRL's own module paths, each with the pyppo op it must reach when patched."""
    losses = import_peer("verl.workers.utils.losses")  # imported kl_penalty, agg_loss, masked_mean by name
    naive = import_peer("verl.workers.rollout.naive.naive_rollout")  # imported logprobs_from_logits by name
    ca, tf = peer.ca, peer.tf
    old, new, adv, m = policy_inputs(3, 6, 0)
    mi = m.long()
    logits, labels = torch.randn(3, 6, 5), torch.randint(0, 5, (3, 6))
    algo = SimpleNamespace(gamma=1.0)
    index = np.array(["a", "b", "a"], dtype=object)
    return [
        ("pyppo::gae", lambda: ca.compute_gae_advantage_return(adv, old, mi, 1.0, 0.95)),
        ("pyppo::gae", lambda: ca.get_adv_estimator_fn("gae")(adv, old, mi, 1.0, 0.95)),
        (
            "pyppo::masked_mean",
            lambda: ca.get_policy_loss_fn("vanilla")(old, new, adv, m, "token-mean", actor_config()),
        ),
        ("pyppo::masked_mean", lambda: ca.compute_value_loss(new, adv, old, m, 0.2)),
        ("pyppo::kl_penalty", lambda: losses.kl_penalty(new, old, "low_var_kl")),
        ("pyppo::kl_penalty", lambda: ca.kl_penalty_forward(new, old, "k1")),
        ("pyppo::masked_mean", lambda: losses.masked_mean(new, m)),
        ("pyppo::gather_logprobs", lambda: naive.logprobs_from_logits(logits, labels)),
        ("pyppo::gather_logprobs", lambda: tf.entropy_from_logits(logits)),
        ("pyppo::gae", lambda: ca.get_adv_estimator_fn("reinforce_plus_plus")(adv, mi, algo)),
        *[
            ("pyppo::group_advantages", lambda name=name: ca.get_adv_estimator_fn(name)(adv, mi, index))
            for name in REGISTRY
            if name != "reinforce_plus_plus"
        ],
        (
            "pyppo::group_advantages",
            lambda: ca.compute_grpo_outcome_advantage(adv, mi, index, norm_adv_by_std_in_grpo=False),
        ),
        # veRL functions that are not replaced but call replaced ones through their module
        ("pyppo::group_advantages", lambda: ca.compute_gdpo_outcome_advantage(adv, mi, index)),
        ("pyppo::masked_var", lambda: ca.compute_gdpo_outcome_advantage(adv, mi, index)),
        ("pyppo::masked_mean", lambda: ca.get_policy_loss_fn("gspo")(old, new, adv, m, config=actor_config())),
        ("pyppo::masked_mean", lambda: ca.get_policy_loss_fn("cispo")(old, new, adv, m, config=actor_config())),
        ("pyppo::masked_mean", lambda: ca.compute_policy_loss_gpg(old, new, adv, m, config=actor_config())),
    ]


def test_patch_routes_verl_through_pyppo(peer):
    sites = _call_sites(peer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no version or signature warning for 0.9.1
        p = pv.patch()
    try:
        assert p.version == "0.9.1" and pv.patch() is p
        wheres = set(p.originals)
        for name in CORE_NAMES:
            assert getattr(peer.ca, name) is getattr(pv, name)
        for name in TF_NAMES:
            assert getattr(peer.tf, name) is getattr(pv, name)
        assert "verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY['gae']" in wheres
        for key, name in REGISTRY.items():
            assert f"verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY[{key!r}]" in wheres
            assert peer.ca.ADV_ESTIMATOR_REGISTRY[key] is getattr(pv, name) is peer.ca.get_adv_estimator_fn(key)
        assert "verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY['vanilla']" in wheres
        for key in ("gspo", "cispo"):
            assert peer.ca.POLICY_LOSS_REGISTRY[key] is getattr(pv, f"compute_policy_loss_{key}")
        assert "verl.workers.utils.losses.agg_loss" in wheres
        assert "verl.workers.rollout.naive.naive_rollout.logprobs_from_logits" in wheres
        gae_where = "verl.trainer.ppo.core_algos.compute_gae_advantage_return"
        assert p.originals[gae_where] is peer.compute_gae_advantage_return
        for op, call in sites:
            with pyppo_ops_called() as ops:
                call()
            assert op in ops, (op, ops)
        with pytest.warns(FutureWarning, match="compute_policy_loss' is deprecated"):
            peer.ca.compute_policy_loss(*policy_inputs(2, 3, 0), cliprange=0.2)
    finally:
        assert pv.unpatch() is p
    for name in CORE_NAMES:
        assert getattr(peer.ca, name) is getattr(peer, name)
    assert peer.ca.ADV_ESTIMATOR_REGISTRY["gae"] is peer.compute_gae_advantage_return
    for key, name in REGISTRY.items():
        assert peer.ca.ADV_ESTIMATOR_REGISTRY[key] is getattr(peer, name)
    assert peer.ca.POLICY_LOSS_REGISTRY["vanilla"] is peer.compute_policy_loss_vanilla
    for key in ("gspo", "cispo"):
        assert peer.ca.POLICY_LOSS_REGISTRY[key] is getattr(peer, f"compute_policy_loss_{key}")
    for op, call in sites:
        with pyppo_ops_called() as ops:
            call()
        assert ops == [], ops
    assert pv.unpatch() is None


def test_patched_context_and_package_entry_point(peer):
    with pv.patched() as p:
        assert p and peer.tf.masked_whiten is pv.masked_whiten
    assert peer.tf.masked_whiten is peer.masked_whiten
    with integrations.patched("verl"):
        assert peer.ca.agg_loss is pv.agg_loss
    assert peer.ca.agg_loss is peer.agg_loss
    assert integrations.patch("verl") is _patching.active(pv.PEER)
    integrations.unpatch("verl")
    assert peer.ca.kl_penalty is peer.kl_penalty


def test_other_release_is_not_patched(peer, monkeypatch):
    monkeypatch.setattr(_patching, "installed_version", lambda p: "0.8.0")
    with pytest.warns(PeerVersionWarning, match="0.9.1"):
        p = pv.patch()
    assert not p and peer.ca.compute_gae_advantage_return is peer.compute_gae_advantage_return
    with pytest.warns(PeerVersionWarning):
        p = pv.patch(force=True)
    try:
        assert p and peer.ca.compute_gae_advantage_return is pv.compute_gae_advantage_return
    finally:
        pv.unpatch()


def test_deprecated_signature_is_read_through_the_wrapper(peer):
    # veRL's @deprecated wrapper keeps __wrapped__, so the signature compared is the function's.
    assert list(inspect.signature(peer.compute_policy_loss).parameters) == list(
        inspect.signature(pv.compute_policy_loss).parameters
    )


def test_module_imported_while_patched_is_restored(peer):
    late = "verl.trainer.distillation.losses"  # binds agg_loss and kl_penalty by name
    # patch() imports veRL's trainer, which imports this module: take it out, so that it is
    # imported afresh while patched, and put the first copy back afterwards.
    package, _, leaf = late.rpartition(".")
    earlier = sys.modules.pop(late, None)
    try:
        with pv.patched():
            mod = importlib.import_module(late)
            assert mod is not earlier
            assert mod.kl_penalty is pv.kl_penalty and mod.agg_loss is pv.agg_loss
            x = torch.randn(2, 3)
            with pyppo_ops_called() as ops:
                mod.kl_penalty(x, x * 0.5, "k3")
            assert "pyppo::kl_penalty" in ops
        assert mod.kl_penalty is peer.kl_penalty and mod.agg_loss is peer.agg_loss
    finally:
        if earlier is not None:
            sys.modules[late] = earlier
            setattr(sys.modules[package], leaf, earlier)


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (0, 0)])
def test_empty_batches_give_verls_results(peer, shape):
    # veRL's 0 / (0 + 1e-8) is 0 for an empty selection; pyppo's op refuses size-0 slices, so
    # the adapters must not pass them on (the error used to name the op's x and dim).
    x, m = torch.randn(shape), torch.ones(shape)
    for axis in (None, 0, 1, -1):
        ours, theirs = pv.masked_mean(x, m, axis), peer.masked_mean(x, m, axis)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs)
    cfg = actor_config()
    for mode in ("token-mean", "seq-mean-token-mean"):
        ours = pv.compute_policy_loss_vanilla(x, x, x, m, mode, cfg)
        theirs = peer.compute_policy_loss_vanilla(x, x, x, m, mode, cfg)
        torch.testing.assert_close(ours[0], theirs[0], equal_nan=True)
        assert ours[1] == theirs[1]


def test_seq_mean_token_mean_drops_an_empty_row_under_a_float16_mask(peer):
    # In float16 the 1e-8 of count + 1e-8 underflows: an empty row's 0 / 0 must be dropped, as
    # veRL's masked_sum over the sequences drops it.
    loss_mat = torch.randn(3, 5, generator=gen(0))
    mask = torch.ones(3, 5, dtype=torch.float16)
    mask[1] = 0
    ours = pv.agg_loss(loss_mat, mask, "seq-mean-token-mean")
    theirs = peer.agg_loss(loss_mat, mask, "seq-mean-token-mean")
    assert torch.isfinite(ours) and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs)


def test_chunk_size_takes_any_integer_veRL_takes(peer):
    logits = torch.randn(4, 9, generator=gen(1))
    for n in (2, np.int64(2), torch.tensor(2)):
        torch.testing.assert_close(
            pv.entropy_from_logits_with_chunking(logits, n), peer.entropy_from_logits_with_chunking(logits, n)
        )
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        pv.entropy_from_logits_with_chunking(logits, 2.0)
