"""pyppo.ops.shape_rewards: −β·KL on every valid token plus the score on each row's last valid token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyppo.ops import KL_ESTIMATORS, kl_penalty, shape_rewards
from support.reference import F64, FLOAT_DTYPES, assert_same_error, gen, out_dtype, ref_shape_rewards, tol

OP = torch.ops.pyppo.shape_rewards.default


def make_inputs(B, T, dtype, seed, *, mask_kind="holes"):
    g = gen(seed)
    scores = (torch.randn(B, generator=g, dtype=F64) * 3).to(dtype)
    lp = -torch.rand(B, T, generator=g, dtype=F64) * 5
    ref = lp + torch.randn(B, T, generator=g, dtype=F64) * 0.5
    if mask_kind == "holes":
        mask = torch.rand(B, T, generator=g) < 0.6
        mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True  # every row has >= 1 valid
        if B >= 2:
            mask[1] = False
            mask[1, 0] = True  # single token at the start
        if B >= 3 and T >= 2:
            mask[2] = False
            mask[2, T - 1] = True  # single token at the end
    elif mask_kind == "right_pad":
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = torch.arange(T)[None, :] < lengths[:, None]
    elif mask_kind == "left_pad":
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = torch.arange(T)[None, :] >= (T - lengths)[:, None]
    else:
        raise ValueError(mask_kind)
    return scores, lp.to(dtype), ref.to(dtype), mask


def check(scores, lp, ref, mask, **kw):
    rewards, kl = shape_rewards(scores, lp, ref, mask, **kw)
    exp_r, exp_kl = ref_shape_rewards(scores, lp, ref, mask, **kw)
    od = out_dtype(lp.dtype)
    assert rewards.dtype == od and kl.dtype == od
    assert rewards.shape == lp.shape and kl.shape == lp.shape
    t = tol(lp.dtype, 20.0)
    torch.testing.assert_close(kl.to(F64), exp_kl, **t)
    torch.testing.assert_close(rewards.to(F64), exp_r, **t)
    m = mask != 0
    assert torch.all(rewards[~m] == 0) and torch.all(kl[~m] == 0)
    return rewards, kl


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["holes", "right_pad", "left_pad"])
def test_values_match_reference(estimator, dtype, mask_kind):
    seed = KL_ESTIMATORS.index(estimator) * 7 + FLOAT_DTYPES.index(dtype) * 3 + len(mask_kind)
    scores, lp, ref, mask = make_inputs(6, 11, dtype, seed, mask_kind=mask_kind)
    check(scores, lp, ref, mask, kl_coef=0.07, estimator=estimator)


@pytest.mark.parametrize("score_clip", [None, 0.5, 2.0, 100.0])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05, 1.0])
def test_score_clip_and_kl_coef(score_clip, kl_coef):
    scores, lp, ref, mask = make_inputs(8, 9, torch.float32, int(kl_coef * 100) + int(score_clip or 0))
    rewards, kl = check(scores, lp, ref, mask, kl_coef=kl_coef, estimator="k3", score_clip=score_clip)
    if kl_coef == 0.0:
        # only the score remains, on the last valid position
        last = torch.tensor([int(torch.nonzero(row).max()) for row in mask])
        s = scores.double() if score_clip is None else scores.double().clamp(-score_clip, score_clip)
        expected = torch.zeros(8, 9, dtype=F64)
        expected[torch.arange(8), last] = s
        torch.testing.assert_close(rewards.double(), expected, **tol(torch.float32))


def test_kl_output_is_kl_penalty_on_valid_positions():
    scores, lp, ref, mask = make_inputs(5, 13, torch.float32, 3)
    for est in KL_ESTIMATORS:
        _, kl = shape_rewards(scores, lp, ref, mask, kl_coef=0.1, estimator=est)
        full = kl_penalty(lp, ref, estimator=est)
        assert torch.equal(kl, torch.where(mask, full, torch.zeros_like(full)))


def test_mask_dtypes_agree():
    scores, lp, ref, mask = make_inputs(4, 7, torch.float32, 4)
    base = shape_rewards(scores, lp, ref, mask, kl_coef=0.2)
    for m in (mask.float(), mask.long(), mask.to(torch.uint8), mask.double()):
        out = shape_rewards(scores, lp, ref, m, kl_coef=0.2)
        assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])


def test_non_contiguous_inputs():
    scores, lp, ref, mask = make_inputs(7, 10, torch.float32, 5)
    lp_nc = lp.t().contiguous().t()
    ref_nc = torch.stack([ref, ref], -1)[..., 0]
    mask_nc = mask.t().contiguous().t()
    scores_nc = torch.stack([scores, scores], 1)[:, 1]
    assert (
        not lp_nc.is_contiguous()
        and not ref_nc.is_contiguous()
        and not mask_nc.is_contiguous()
        and not scores_nc.is_contiguous()
    )
    a = shape_rewards(scores_nc, lp_nc, ref_nc, mask_nc, kl_coef=0.1, estimator="k2")
    b = shape_rewards(scores, lp, ref, mask, kl_coef=0.1, estimator="k2")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    check(scores_nc, lp_nc, ref_nc, mask_nc, kl_coef=0.1, estimator="k2")


@pytest.mark.parametrize("B,T", [(0, 5), (0, 0), (1, 1), (3, 1), (1, 300)])
def test_small_and_empty(B, T):
    scores, lp, ref, mask = (
        make_inputs(B, T, torch.float32, B * 31 + T, mask_kind="right_pad")
        if T
        else (torch.zeros(0), torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.bool))
    )
    rewards, kl = shape_rewards(scores, lp, ref, mask, kl_coef=0.1)
    assert rewards.shape == (B, T) and kl.shape == (B, T)
    if B:
        check(scores, lp, ref, mask, kl_coef=0.1)


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 5),
    T=st.integers(1, 12),
    seed=st.integers(0, 2**20),
    estimator=st.sampled_from(KL_ESTIMATORS),
    kl_coef=st.floats(0, 2),
    score_clip=st.one_of(st.none(), st.floats(0.01, 5)),
    dtype=st.sampled_from(FLOAT_DTYPES),
)
def test_hypothesis(B, T, seed, estimator, kl_coef, score_clip, dtype):
    scores, lp, ref, mask = make_inputs(B, T, dtype, seed)
    check(scores, lp, ref, mask, kl_coef=kl_coef, estimator=estimator, score_clip=score_clip)


def test_opcheck():
    scores, lp, ref, mask = make_inputs(4, 6, torch.float32, 6)
    torch.library.opcheck(OP, (scores, lp, ref, mask, 0.1, "k1", None))
    torch.library.opcheck(
        OP, (scores.double(), lp.double().t().contiguous().t(), ref.double(), mask.float(), 0.5, "k3", 1.0)
    )
    torch.library.opcheck(OP, (scores.bfloat16(), lp.bfloat16(), ref.bfloat16(), mask.long(), 0.0, "abs", 0.3))


# -------------------------------------------------------------------------------- errors


def _ok():
    return make_inputs(3, 5, torch.float32, 7)


def test_error_row_with_no_valid_position():
    scores, lp, ref, mask = _ok()
    mask[2] = False
    with pytest.raises(ValueError, match="response_mask"):
        shape_rewards(scores, lp, ref, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="response_mask"):
        shape_rewards(scores, lp, ref, mask.float(), kl_coef=0.1)
    # T = 0 with B > 0: every row is empty
    with pytest.raises(ValueError, match="response_mask"):
        shape_rewards(scores, lp[:, :0], ref[:, :0], mask[:, :0], kl_coef=0.1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_error_non_finite_score(bad):
    scores, lp, ref, mask = _ok()
    scores[1] = bad
    with pytest.raises(ValueError, match="scores"):
        shape_rewards(scores, lp, ref, mask, kl_coef=0.1)
    # clipping does not make a non-finite score acceptable
    with pytest.raises(ValueError, match="scores"):
        shape_rewards(scores, lp, ref, mask, kl_coef=0.1, score_clip=1.0)


@pytest.mark.parametrize("kl_coef", [-0.1, float("nan"), float("inf")])
def test_error_kl_coef(kl_coef):
    scores, lp, ref, mask = _ok()
    with pytest.raises(ValueError, match="kl_coef"):
        shape_rewards(scores, lp, ref, mask, kl_coef=kl_coef)


@pytest.mark.parametrize("score_clip", [0.0, -1.0, float("nan")])
def test_error_score_clip(score_clip):
    scores, lp, ref, mask = _ok()
    with pytest.raises(ValueError, match="score_clip"):
        shape_rewards(scores, lp, ref, mask, kl_coef=0.1, score_clip=score_clip)


def test_error_shapes():
    scores, lp, ref, mask = _ok()
    with pytest.raises(ValueError, match="scores"):
        shape_rewards(scores[:2], lp, ref, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="scores"):
        shape_rewards(scores[:, None], lp, ref, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        shape_rewards(scores, lp, ref[:, :4], mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="response_mask"):
        shape_rewards(scores, lp, ref, mask[:, :4], kl_coef=0.1)
    with pytest.raises(ValueError, match="logprobs"):
        shape_rewards(scores, lp[0], ref[0], mask[0], kl_coef=0.1)
    with pytest.raises(ValueError, match="logprobs"):
        shape_rewards(scores, lp[None], ref[None], mask[None], kl_coef=0.1)


def test_error_dtypes():
    scores, lp, ref, mask = _ok()
    with pytest.raises(ValueError, match="logprobs"):
        shape_rewards(scores, lp.long(), ref, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        shape_rewards(scores, lp, ref.long(), mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="scores"):
        shape_rewards(scores.long(), lp, ref, mask, kl_coef=0.1)


def test_error_mask_not_zero_one():
    scores, lp, ref, mask = _ok()
    m = mask.float()
    m[0, 0] = 0.5
    with pytest.raises(ValueError, match="response_mask"):
        shape_rewards(scores, lp, ref, m, kl_coef=0.1)
    m[0, 0] = -1
    with pytest.raises(ValueError, match="response_mask"):
        shape_rewards(scores, lp, ref, m.long(), kl_coef=0.1)


def test_error_unknown_estimator():
    scores, lp, ref, mask = _ok()
    with pytest.raises(ValueError, match="estimator"):
        shape_rewards(scores, lp, ref, mask, kl_coef=0.1, estimator="k9")
    with pytest.raises(ValueError, match="estimator"):
        OP(scores, lp, ref, mask, 0.1, "k9", None)


# ------------------------------------------------------------------------ on every device


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("score_clip", [None, 0.5])
def test_device_values_match_reference(device, dtype, score_clip):
    g = gen(61)
    B, T = 7, 300
    lp = (torch.randn(B, T, generator=g, dtype=F64) - 2).to(dtype)
    ref = (torch.randn(B, T, generator=g, dtype=F64) - 2).to(dtype)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[:, 0] = True
    mask[2, 1:] = False  # only the first position valid
    mask[3, -1] = True
    scores = torch.randn(B, generator=g, dtype=F64).to(dtype)
    args = dict(kl_coef=0.05, estimator="k3", score_clip=score_clip)
    rewards, kl = shape_rewards(scores.to(device), lp.to(device), ref.to(device), mask.to(device), **args)
    assert rewards.dtype == out_dtype(dtype) and kl.dtype == out_dtype(dtype) and rewards.device.type == device
    r_ref, kl_ref = ref_shape_rewards(scores, lp, ref, mask, **args)
    torch.testing.assert_close(rewards.cpu().to(F64), r_ref, **tol(dtype))
    torch.testing.assert_close(kl.cpu().to(F64), kl_ref, **tol(dtype))


def _bad_cases():
    g = gen(62)
    lp, ref = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    scores = torch.randn(3, generator=g)

    def call(**kw):
        return lambda s, a, b, m: shape_rewards(s, a, b, m, **{"kl_coef": 0.1, **kw})

    return {
        "kl_coef": (call(kl_coef=-1.0), scores, lp, ref, mask),
        "score_clip": (call(score_clip=0.0), scores, lp, ref, mask),
        "estimator": (call(estimator="k7"), scores, lp, ref, mask),
        "scores_shape": (call(), scores[:2], lp, ref, mask),
        "mask_shape": (call(), scores, lp, ref, mask[:, :4]),
        "not_2d": (call(), scores, lp[0], ref[0], mask[0]),
        "ref_shape": (call(), scores, lp, ref[:, :2], mask),
        "dtype": (call(), scores, lp.long(), ref, mask),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_errors_are_the_same_on_every_path(path, case):
    fn, *args = _bad_cases()[case]
    assert_same_error(path, fn, *args)


def test_data_errors_are_the_same_on_every_device(device):
    g = gen(63)
    lp, ref = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    scores = torch.randn(3, generator=g)
    call = lambda s, a, b, m: shape_rewards(s, a, b, m, kl_coef=0.1)  # noqa: E731
    empty_row = torch.ones(3, 5, dtype=torch.bool)
    empty_row[1] = False
    assert_same_error(device, call, scores, lp, ref, empty_row)
    bad_scores = scores.clone()
    bad_scores[2] = float("inf")
    assert_same_error(device, call, bad_scores, lp, ref, torch.ones(3, 5, dtype=torch.bool))
    assert_same_error(device, call, scores, lp, ref, torch.ones(3, 5) * 0.5)


def test_device_opcheck(device):
    g = gen(64)
    lp, ref = torch.randn(2, 3, generator=g).to(device), torch.randn(2, 3, generator=g).to(device)
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    scores = torch.randn(2, generator=g).to(device)
    torch.library.opcheck(OP, (scores, lp, ref, mask, 0.1, "k1", None))
