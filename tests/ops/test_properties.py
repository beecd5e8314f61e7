"""Property-based tests of every op (hypothesis): random shapes (0-length dims included), dtypes,
strides (transposed, sliced, broadcast-expanded views), masks (none, empty, full, with holes),
temperatures and labels (ignore_index, out of range, negative).

Each call either returns the float64 reference's result (tests/support/reference.py) or raises the
ValueError/RuntimeError that the op documents for those inputs — never another exception, a
crash, a hang, or a NaN that the reference does not have. The whole file runs in well under a
minute (few examples per property, ``derandomize=True`` so CI sees the same examples every run).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pyppo.ops import (  # noqa: E402
    gae,
    gather_logprobs,
    group_advantages,
    kl_penalty,
    linear_logprobs,
    masked_mean,
    masked_var,
    masked_whiten,
    shape_rewards,
    turn_gae,
)
from support.reference import (  # noqa: E402
    random_turn_ids,
    ref_gae,
    ref_gather_logprobs,
    ref_group_advantages,
    ref_kl_penalty,
    ref_masked_mean,
    ref_masked_var,
    ref_masked_whiten,
    ref_shape_rewards,
    ref_turn_gae,
)

#: PYPPO_PROPERTY_SCALE=N runs N times as many examples, freshly random (a bug hunt); the
#: default (1) is small and derandomized, for CI.
_SCALE = int(os.environ.get("PYPPO_PROPERTY_SCALE", "1"))
SETTINGS = dict(
    deadline=None, derandomize=_SCALE == 1, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded")
ERRORS = (ValueError, RuntimeError)


# ----------------------------------------------------------------------------- helpers


def _seed(data) -> torch.Generator:
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))


def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values (or, for "expanded", row 0 repeated) in a non-contiguous view."""
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == "sliced" and t.dim() >= 1:
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1] + 1, dtype=t.dtype)
        big[..., 1::2] = t
        return big[..., 1::2]
    if kind == "expanded" and t.dim() >= 1 and t.shape[0] >= 1:
        return t[:1].expand(t.shape)
    return t.contiguous()


def _mask(data, g, shape, *, allow_none=False):
    kinds = ["empty", "full", "holes", "holes"] + (["none"] if allow_none else [])
    kind = data.draw(st.sampled_from(kinds), label="mask")
    if kind == "none":
        return None
    if kind == "empty":
        m = torch.zeros(shape, dtype=torch.bool)
    elif kind == "full":
        m = torch.ones(shape, dtype=torch.bool)
    else:
        m = torch.rand(shape, generator=g) < 0.6
    as_dtype = data.draw(
        st.sampled_from([torch.bool, torch.bool, torch.int64, torch.float32, torch.uint8]), label="mask dtype"
    )
    m = m.to(as_dtype)
    return _layout(m, data.draw(st.sampled_from(LAYOUTS), label="mask layout"))


def _close(out: torch.Tensor, ref: torch.Tensor, *, rtol: float, atol: float) -> None:
    ref = ref.to(out.dtype)  # a float64 value beyond float32's range is inf in a float32 output
    assert out.shape == ref.shape, (out.shape, ref.shape)
    silent = torch.isnan(out) & ~torch.isnan(ref)
    assert not silent.any(), f"NaN where the reference has {ref[silent][:5].tolist()}"
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, equal_nan=True)


def _tols(dtype):
    return dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)


def _run(fn, expect_error: bool):
    """fn() must raise a documented error iff expect_error; returns its result otherwise."""
    if expect_error:
        with pytest.raises(ERRORS):
            fn()
        return None
    return fn()


# ----------------------------------------------------------------------------- gather_logprobs

_LEADS = st.lists(st.integers(0, 4), min_size=0, max_size=2)


@settings(max_examples=80 * _SCALE, **SETTINGS)
@given(st.data())
def test_gather_logprobs_property(data):
    g = _seed(data)
    lead = data.draw(_LEADS, label="lead shape")
    # small vocabularies, and a few past the kernels' block sizes (tails)
    V = data.draw(st.one_of(st.integers(0, 19), st.sampled_from([255, 257, 1027, 2049])), label="V")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    scale = data.draw(st.sampled_from([0.1, 1.0, 10.0, 60.0]), label="scale")
    logits = (torch.randn(*lead, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    if V >= 2 and data.draw(st.booleans(), label="-inf logits"):
        logits[..., 1::3] = -math.inf  # zero-probability tokens (vocab 0 stays finite)
    logits = _layout(logits, data.draw(st.sampled_from(LAYOUTS), label="logits layout"))

    ignore_index = data.draw(st.sampled_from([-100, -1, 0, 7]), label="ignore_index")
    kind = data.draw(
        st.sampled_from(["in range", "in range", "with ignore", "out of range", "negative"]), label="labels"
    )
    labels = torch.randint(0, max(V, 1), lead, generator=g)
    if kind == "with ignore" and labels.numel():
        labels.view(-1)[::2] = ignore_index
    elif kind == "out of range" and labels.numel():
        labels.view(-1)[-1] = V + data.draw(st.integers(0, 5))
    elif kind == "negative" and labels.numel():
        labels.view(-1)[0] = -data.draw(st.integers(1, 200))
    labels = labels.to(data.draw(st.sampled_from([torch.int64, torch.int64, torch.int32]), label="labels dtype"))
    labels = _layout(labels, data.draw(st.sampled_from(LAYOUTS), label="labels layout"))
    mask = _mask(data, g, tuple(lead), allow_none=True)
    temperature = data.draw(st.sampled_from([1.0, 0.7, 2.5, 0.05, 0.0, -1.0]), label="temperature")
    entropy = data.draw(st.booleans(), label="return_entropy")
    want_grad = dtype in (torch.float32, torch.float64) and data.draw(st.booleans(), label="grad")
    if want_grad:
        logits = logits.detach().requires_grad_(True)

    valid = labels.long() != ignore_index
    if mask is not None:
        valid &= mask != 0
    bad_label = bool(((labels.long() < 0) | (labels.long() >= V))[valid].any())
    expect_error = temperature <= 0 or bad_label or V == 0
    res = _run(
        lambda: gather_logprobs(
            logits, labels, mask, temperature=temperature, ignore_index=ignore_index, return_entropy=entropy
        ),
        expect_error,
    )
    if res is None:
        return
    lp, ent = res if entropy else (res, None)
    ref_lp, ref_ent = ref_gather_logprobs(logits, labels, mask, temperature=temperature, ignore_index=ignore_index)
    _close(lp, ref_lp, **_tols(dtype))
    assert (lp[~valid] == 0).all() and not (lp > 0).any()
    if ent is not None:
        _close(ent, ref_ent, **_tols(dtype))
    if want_grad and lp.numel():
        # the hand-written backward against autograd through the float64 reference
        g_lp = torch.randn(lp.shape, dtype=torch.float64)
        g_ent = torch.randn(lp.shape, dtype=torch.float64)
        loss = (lp * g_lp.to(lp.dtype)).sum() + ((ent * g_ent.to(ent.dtype)).sum() if ent is not None else 0)
        (grad,) = torch.autograd.grad(loss, logits)
        ref_loss = (ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if ent is not None else 0)
        (ref_grad,) = torch.autograd.grad(ref_loss, logits)
        _close(grad, ref_grad, **_tols(dtype))
        assert (grad[~valid] == 0).all()


@settings(max_examples=25 * _SCALE, **SETTINGS)
@given(st.data())
def test_gather_logprobs_nonfinite_logits_poison_only_their_row(data):
    """A NaN or +inf logit makes that row's (valid) results NaN; other rows are bit-identical."""
    g = _seed(data)
    B = data.draw(st.integers(2, 5))
    V = data.draw(st.integers(1, 40))
    dtype = data.draw(st.sampled_from(DTYPES))
    logits = torch.randn(B, V, generator=g).to(dtype)
    labels = torch.randint(0, V, (B,), generator=g)
    clean_lp, clean_ent = gather_logprobs(logits, labels, return_entropy=True)
    bad_row = data.draw(st.integers(0, B - 1))
    bad = logits.clone()
    bad[bad_row, data.draw(st.integers(0, V - 1))] = data.draw(st.sampled_from([math.nan, math.inf]))
    lp, ent = gather_logprobs(bad, labels, return_entropy=True)
    assert torch.isnan(lp[bad_row]) and torch.isnan(ent[bad_row])
    others = torch.arange(B) != bad_row
    assert torch.equal(lp[others], clean_lp[others]) and torch.equal(ent[others], clean_ent[others])
    # masked, the poisoned row gives 0 like any masked row
    mask = others.clone()
    assert gather_logprobs(bad, labels, mask)[bad_row] == 0


# ----------------------------------------------------------------------------- linear_logprobs


@settings(max_examples=40 * _SCALE, **SETTINGS)
@given(st.data())
def test_linear_logprobs_property(data):
    g = _seed(data)
    lead = data.draw(_LEADS, label="lead shape")
    H = data.draw(st.integers(1, 12), label="H")
    V = data.draw(st.integers(1, 23), label="V")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    hidden = _layout(torch.randn(*lead, H, generator=g).to(dtype), data.draw(st.sampled_from(LAYOUTS)))
    weight = _layout((torch.randn(V, H, generator=g) * 0.5).to(dtype), data.draw(st.sampled_from(LAYOUTS)))
    bias = None
    if data.draw(st.booleans(), label="bias"):
        bias = _layout(torch.randn(V, generator=g).to(dtype), data.draw(st.sampled_from(["contiguous", "sliced"])))
    labels = torch.randint(0, V, lead, generator=g)
    kind = data.draw(st.sampled_from(["ok", "ok", "ignore", "out of range", "negative"]), label="labels")
    if kind == "ignore" and labels.numel():
        labels.view(-1)[1::2] = -100
    elif kind == "out of range" and labels.numel():
        labels.view(-1)[0] = V
    elif kind == "negative" and labels.numel():
        labels.view(-1)[-1] = -3
    mask = _mask(data, g, tuple(lead), allow_none=True)
    temperature = data.draw(st.sampled_from([1.0, 0.6, 3.0, 0.0]), label="temperature")
    chunk = data.draw(st.sampled_from([None, 1, 2, 5, 1000]), label="chunk_size")
    entropy = data.draw(st.booleans(), label="return_entropy")

    valid = labels != -100
    if mask is not None:
        valid &= mask != 0
    expect_error = temperature <= 0 or bool(((labels < 0) | (labels >= V))[valid].any())
    res = _run(
        lambda: linear_logprobs(
            hidden, weight, labels, mask, bias=bias, temperature=temperature, return_entropy=entropy, chunk_size=chunk
        ),
        expect_error,
    )
    if res is None:
        return
    lp, ent = res if entropy else (res, None)
    # The GEMM runs in the input dtype: the reference starts from the same rounded logits.
    logits = hidden @ weight.T + (bias if bias is not None else 0)
    ref_lp, ref_ent = ref_gather_logprobs(logits, labels, mask, temperature=temperature)
    tol = (
        dict(rtol=1e-9, atol=1e-9)
        if dtype == torch.float64
        else (dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=0.05, atol=0.1))
    )
    _close(lp, ref_lp, **tol)
    if ent is not None:
        _close(ent, ref_ent, **tol)


# ----------------------------------------------------------------------------- kl_penalty / shape_rewards

_LP = st.sampled_from([0.0, -0.01, -0.5, -2.0, -7.0, -30.0, -200.0, -1e4])


def _logprob_pair(data, g, shape, dtype):
    base = -torch.rand(shape, generator=g, dtype=torch.float64) * data.draw(st.sampled_from([0.1, 3.0, 20.0]))
    lp, ref = base.clone(), base + torch.randn(shape, generator=g, dtype=torch.float64)
    ref = ref.clamp(max=0)
    if lp.numel():
        lp.view(-1)[0] = data.draw(_LP)  # extremes: k3 overflows to +inf (never NaN) when unclamped
        ref.view(-1)[-1] = data.draw(_LP)
    return lp.to(dtype), ref.to(dtype)


@settings(max_examples=60 * _SCALE, **SETTINGS)
@given(st.data())
def test_kl_penalty_property(data):
    g = _seed(data)
    shape = tuple(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=3), label="shape"))
    dtype = data.draw(st.sampled_from(DTYPES))
    lp, ref = _logprob_pair(data, g, shape, dtype)
    lp = _layout(lp, data.draw(st.sampled_from(LAYOUTS)))
    ref = _layout(ref, data.draw(st.sampled_from(LAYOUTS)))
    estimator = data.draw(st.sampled_from(["k1", "k2", "k3", "abs", "k4"]))
    clamp = data.draw(st.sampled_from([None, (-10.0, 10.0), (None, 5.0), (0.0, None), (-1.0, 1.0)]))
    want_grad = dtype in (torch.float32, torch.float64) and data.draw(st.booleans())
    lp_in = lp.detach().clone().requires_grad_(True) if want_grad else lp
    out = _run(lambda: kl_penalty(lp_in, ref, estimator=estimator, clamp=clamp), estimator == "k4")
    if out is None:
        return
    expected = ref_kl_penalty(lp, ref, estimator=estimator, clamp=clamp)
    _close(out.detach(), expected, **_tols(dtype))
    assert not torch.isnan(out).any()
    if want_grad and clamp is not None and out.numel():
        out.sum().backward()
        assert torch.isfinite(lp_in.grad).all(), "clamped kl_penalty gave a non-finite gradient"


@settings(max_examples=60 * _SCALE, **SETTINGS)
@given(st.data())
def test_shape_rewards_property(data):
    g = _seed(data)
    B = data.draw(st.integers(0, 5), label="B")
    T = data.draw(st.integers(0, 6), label="T")
    dtype = data.draw(st.sampled_from(DTYPES))
    lp, ref = _logprob_pair(data, g, (B, T), dtype)
    lp = _layout(lp, data.draw(st.sampled_from(LAYOUTS)))
    mask = _mask(data, g, (B, T))
    scores = torch.randn(B, generator=g, dtype=torch.float64) * 3
    if B and data.draw(st.booleans(), label="bad score"):
        scores[-1] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    scores = _layout(
        scores.to(data.draw(st.sampled_from(DTYPES))), data.draw(st.sampled_from(["contiguous", "sliced"]))
    )
    kl_coef = data.draw(st.sampled_from([0.0, 0.05, 1.0, -0.1]))
    estimator = data.draw(st.sampled_from(["k1", "k2", "k3", "abs"]))
    score_clip = data.draw(st.sampled_from([None, 0.5, 10.0]))

    empty_row = bool(((mask != 0).sum(dim=1) == 0).any()) if B else False
    expect_error = empty_row or kl_coef < 0 or not bool(torch.isfinite(scores).all())
    res = _run(
        lambda: shape_rewards(scores, lp, ref, mask, kl_coef=kl_coef, estimator=estimator, score_clip=score_clip),
        expect_error,
    )
    if res is None:
        return
    rewards, kl = res
    exp_rewards, exp_kl = ref_shape_rewards(
        scores, lp, ref, mask, kl_coef=kl_coef, estimator=estimator, score_clip=score_clip
    )
    _close(kl, exp_kl, **_tols(dtype))
    _close(rewards, exp_rewards, **_tols(dtype))


# ----------------------------------------------------------------------------- gae, turn_gae


def _rollout(data, g, max_T: int):
    """Rewards and values ``[B, T]`` in drawn layouts, an optional ``last_values [B]``, and a
    discount γ (out of range too): what gae and turn_gae share."""
    B = data.draw(st.integers(0, 5), label="B")
    T = data.draw(st.integers(0, max_T), label="T")
    dtype = data.draw(st.sampled_from(DTYPES))
    rewards = _layout(torch.randn(B, T, generator=g).to(dtype), data.draw(st.sampled_from(LAYOUTS)))
    values = _layout(torch.randn(B, T, generator=g).to(dtype), data.draw(st.sampled_from(LAYOUTS)))
    last_values = None
    if data.draw(st.booleans(), label="last_values"):
        last_values = _layout(
            torch.randn(B, generator=g).to(dtype), data.draw(st.sampled_from(["contiguous", "sliced"]))
        )
    gamma = data.draw(st.sampled_from([1.0, 0.99, 0.5, 0.0, 1.01, -0.1]))
    return B, T, dtype, rewards, values, last_values, gamma


_LAMS = st.sampled_from([0.95, 1.0, 0.0, 0.3, 1.5, -0.5])


@settings(max_examples=80 * _SCALE, **SETTINGS)
@given(st.data())
def test_gae_property(data):
    g = _seed(data)
    B, T, dtype, rewards, values, last_values, gamma = _rollout(data, g, 7)
    mask = _mask(data, g, (B, T))
    lam = data.draw(_LAMS)
    expect_error = not (0 <= gamma <= 1 and 0 <= lam <= 1)
    if data.draw(st.booleans(), label="a lam per row"):  # replaces the float
        expect_error = not 0 <= gamma <= 1
        row = torch.rand(B, generator=g, dtype=torch.float64)
        if B and data.draw(st.booleans(), label="a row's lam out of range"):
            row[data.draw(st.integers(0, B - 1))] = data.draw(st.sampled_from([1.5, -0.1, math.nan]))
            expect_error = True
        lam = _layout(row.to(data.draw(st.sampled_from(DTYPES), label="row lam dtype")), "sliced")
    lam_critic = data.draw(st.sampled_from([None, None, 1.0, 0.0, 0.7, 1.5, -0.1, math.nan]), label="lam_critic")
    expect_error = expect_error or (lam_critic is not None and not 0 <= lam_critic <= 1)
    res = _run(
        lambda: gae(rewards, values, mask, gamma=gamma, lam=lam, last_values=last_values, lam_critic=lam_critic),
        expect_error,
    )
    if res is None:
        return
    adv, ret = res
    exp_adv, exp_ret = ref_gae(
        rewards, values, mask, gamma=gamma, lam=lam, last_values=last_values, lam_critic=lam_critic
    )
    _close(adv, exp_adv, **_tols(dtype))
    _close(ret, exp_ret, **_tols(dtype))


@settings(max_examples=60 * _SCALE, **SETTINGS)
@given(st.data())
def test_turn_gae_property(data):
    g = _seed(data)
    B, T, dtype, rewards, values, last_values, gamma = _rollout(data, g, 12)
    ids = random_turn_ids(B, T, g, max_span=data.draw(st.integers(1, 5), label="max_span"))
    ids = _layout(ids.to(data.draw(st.sampled_from([torch.int64, torch.int32]))), data.draw(st.sampled_from(LAYOUTS)))
    lam = data.draw(_LAMS)
    expect_error = not (0 <= gamma <= 1 and 0 <= lam <= 1)
    res = _run(lambda: turn_gae(rewards, values, ids, gamma=gamma, lam=lam, last_values=last_values), expect_error)
    if res is None:
        return
    adv, ret = res
    exp_adv, exp_ret = ref_turn_gae(rewards, values, ids, gamma=gamma, lam=lam, last_values=last_values)
    _close(adv, exp_adv, **_tols(dtype))
    _close(ret, exp_ret, **_tols(dtype))


# ----------------------------------------------------------------------------- group_advantages


@settings(max_examples=60 * _SCALE, **SETTINGS)
@given(st.data())
def test_group_advantages_property(data):
    g = _seed(data)
    B = data.draw(st.integers(0, 9), label="B")
    T = data.draw(st.integers(0, 5), label="T")
    dtype = data.draw(st.sampled_from(DTYPES))
    scores = torch.randn(B, generator=g, dtype=torch.float64) * data.draw(st.sampled_from([1e-3, 1.0, 100.0]))
    n_labels = data.draw(st.integers(1, max(B, 1)), label="groups")
    ids = torch.randint(0, n_labels, (B,), generator=g)
    if B and data.draw(st.booleans(), label="constant group"):
        scores[ids == ids[0]] = data.draw(st.sampled_from([0.0, 0.1, -2.5]))
    bad_score = bool(B) and data.draw(st.booleans(), label="bad score")
    if bad_score:
        scores[-1] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    bad_id = bool(B) and data.draw(st.booleans(), label="bad id")
    if bad_id:
        ids[0] = data.draw(st.sampled_from([-1, B, B + 3]))
    scores = _layout(scores.to(dtype), data.draw(st.sampled_from(["contiguous", "sliced"])))
    ids = _layout(ids, data.draw(st.sampled_from(["contiguous", "sliced"])))
    mask = _mask(data, g, (B, T))
    estimator = data.draw(st.sampled_from(["grpo", "rloo", "ppo"]))
    std_normalize = data.draw(st.booleans(), label="std_normalize")
    eps = data.draw(st.sampled_from([1e-6, 0.0, 0.5, -1.0, math.nan]), label="eps")

    expect_error = bad_score or bad_id or estimator == "ppo" or not eps >= 0
    res = _run(
        lambda: group_advantages(
            scores, mask, group_ids=ids, estimator=estimator, eps=eps, std_normalize=std_normalize
        ),
        expect_error,
    )
    if res is None:
        return
    expected = ref_group_advantages(scores, mask, ids, estimator=estimator, eps=eps, std_normalize=std_normalize)
    _close(res, expected, **_tols(dtype))
    assert (res[mask == 0] == 0).all()


# ----------------------------------------------------------------------------- masked statistics


@settings(max_examples=60 * _SCALE, **SETTINGS)
@given(st.data())
def test_masked_property(data):
    g = _seed(data)
    shape = tuple(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=3), label="shape"))
    dtype = data.draw(st.sampled_from(DTYPES))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * data.draw(st.sampled_from([1e-3, 1.0, 100.0]))
    if x.numel() and data.draw(st.booleans(), label="constant"):
        x.fill_(data.draw(st.sampled_from([0.0, 3.0])))
    x = _layout(x.to(dtype), data.draw(st.sampled_from(LAYOUTS)))
    mask = _mask(data, g, shape)
    valid = mask != 0
    n = int(valid.sum())

    dim = data.draw(st.sampled_from([None, 0, -1, len(shape) - 1]), label="dim")
    if dim is None:
        mean_error = n == 0
    else:
        mean_error = bool((valid.sum(dim) == 0).any())
    out = _run(lambda: masked_mean(x, mask, dim), mean_error)
    if out is not None:
        _close(out, ref_masked_mean(x, mask, dim), **_tols(dtype))

    unbiased = data.draw(st.booleans(), label="unbiased")
    out = _run(lambda: masked_var(x, mask, unbiased), n < (2 if unbiased else 1))
    if out is not None:
        _close(out, ref_masked_var(x, mask, unbiased), **_tols(dtype))

    shift_mean = data.draw(st.booleans(), label="shift_mean")
    eps = data.draw(st.sampled_from([1e-8, 0.0, 1.0, -1.0]), label="eps")
    whiten_error = n < (2 if unbiased else 1) or eps < 0
    if not whiten_error and eps == 0:
        whiten_error = float(ref_masked_var(x, mask, unbiased)) == 0.0
    out = _run(lambda: masked_whiten(x, mask, shift_mean=shift_mean, unbiased=unbiased, eps=eps), whiten_error)
    if out is not None:
        expected = ref_masked_whiten(x, mask, shift_mean=shift_mean, unbiased=unbiased, eps=eps)
        # (x - mean) / std amplifies the float32 rounding of x by 1/std.
        std = math.sqrt(float(ref_masked_var(x, mask, unbiased)) + eps)
        scale = 1.0 + float(x.double().abs().max()) / std if x.numel() else 1.0
        tol = _tols(dtype)
        _close(out, expected, rtol=tol["rtol"], atol=tol["atol"] * scale)


# ----------------------------------------------------------------------------- found by the properties


def test_linear_logprobs_checks_temperature_without_tokens():
    hidden, weight, labels = torch.randn(0, 4), torch.randn(3, 4), torch.zeros(0, dtype=torch.long)
    for temperature in (0.0, -1.0, math.nan):
        try:
            linear_logprobs(hidden, weight, labels, temperature=temperature)
        except ValueError:
            continue
        raise AssertionError(f"temperature={temperature} accepted for zero tokens")


def test_masked_mean_out_of_range_dim_is_a_value_error():
    with pytest.raises(ValueError, match="dim"):
        masked_mean(torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool), 2)


def test_shape_rewards_zero_kl_coef_ignores_an_infinite_kl():
    rewards, kl = shape_rewards(
        torch.tensor([0.5]),
        torch.tensor([[-200.0]]),
        torch.tensor([[0.0]]),
        torch.ones(1, 1, dtype=torch.bool),
        kl_coef=0.0,
        estimator="k3",
    )
    assert torch.isposinf(kl).all()  # as documented for unclamped k3
    assert rewards.tolist() == [[0.5]]
