"""pyppo.ops.group_advantages (GRPO, Dr. GRPO, RLOO) against the float64 definitions, and against
veRL 0.9.1's own estimators where veRL is installed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyppo.ops import group_advantages, masked_whiten
from support.reference import (
    F64,
    FLOAT_DTYPES,
    assert_same_error,
    bits_equal,
    call_on,
    gen,
    out_dtype,
    random_mask,
    ref_group_advantages,
)

OP = torch.ops.pyppo.group_advantages.default
ESTIMATORS = [("grpo", True), ("grpo", False), ("rloo", True), ("rloo", False)]
EST_IDS = ["grpo", "dr_grpo", "rloo", "rloo_std_flag"]


def tol(dtype) -> dict:
    """The op computes in float64 and rounds once: float32 outputs are within an ulp or two."""
    return dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-6, atol=1e-6)


def shuffled_ids(sizes, g) -> torch.Tensor:
    """Group ids for groups of these sizes, numbered in a random order and laid out in a random
    row order (non-contiguous groups)."""
    labels = torch.randperm(len(sizes), generator=g)
    ids = torch.cat([torch.full((n,), int(labels[k])) for k, n in enumerate(sizes)])
    return ids[torch.randperm(len(ids), generator=g)]


def make_inputs(sizes, T, dtype, seed):
    g = gen(seed)
    ids = shuffled_ids(sizes, g)
    B = len(ids)
    scores = (torch.randn(B, generator=g, dtype=F64) * 2 + 0.5).to(dtype)
    return scores, random_mask(B, T, g), ids


SIZES = [1, 2, 3, 5, 8, 1, 3]  # B = 23


def check(scores, mask, ids, *, estimator="grpo", eps=1e-6, std_normalize=True):
    out = group_advantages(scores, mask, group_ids=ids, estimator=estimator, eps=eps, std_normalize=std_normalize)
    expected = ref_group_advantages(scores, mask, ids, estimator=estimator, eps=eps, std_normalize=std_normalize)
    assert out.dtype == out_dtype(scores.dtype) and out.shape == mask.shape
    torch.testing.assert_close(out.to(F64), expected, **tol(scores.dtype))
    assert torch.all(out[mask == 0] == 0)
    return out


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("estimator,std_normalize", ESTIMATORS, ids=EST_IDS)
@pytest.mark.parametrize("eps", [1e-6, 0.0, 0.5])
def test_values_match_reference(dtype, estimator, std_normalize, eps):
    # Groups of 1, 2, 3, 5, 8 in shuffled rows, holes, an all-masked row (random_mask's row 1).
    seed = FLOAT_DTYPES.index(dtype) * 100 + ESTIMATORS.index((estimator, std_normalize)) * 10 + int(eps * 10)
    scores, mask, ids = make_inputs(SIZES, 11, dtype, seed)
    check(scores, mask, ids, estimator=estimator, eps=eps, std_normalize=std_normalize)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("estimator,std_normalize", ESTIMATORS, ids=EST_IDS)
def test_group_size_is_contiguous_groups(n, estimator, std_normalize):
    g = gen(n)
    B, T = 8 * n, 6
    scores = torch.randn(B, generator=g)
    mask = random_mask(B, T, g)
    kw = dict(estimator=estimator, std_normalize=std_normalize)
    out = group_advantages(scores, mask, group_size=n, **kw)
    ids = torch.arange(B) // n
    assert bits_equal(out, group_advantages(scores, mask, group_ids=ids, **kw))
    check(scores, mask, ids, **kw)


def test_hand_computed_example():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 3.0])
    mask = torch.ones(6, 2, dtype=torch.bool)
    mask[1, 1] = False
    ids = torch.tensor([0, 0, 0, 1, 1, 2])
    col = lambda **kw: group_advantages(scores, mask, group_ids=ids, **kw)[:, 0]  # noqa: E731
    # group 0: m = 1/3, σ = sqrt(((2/3)² + 2·(1/3)²) / 2) = 1/sqrt(3); group 1: m = 3, σ = sqrt(2)
    s3, s2 = 1 / math.sqrt(3), math.sqrt(2)
    grpo = [
        (2 / 3) / (s3 + 1e-6),
        -(1 / 3) / (s3 + 1e-6),
        -(1 / 3) / (s3 + 1e-6),
        -1 / (s2 + 1e-6),
        1 / (s2 + 1e-6),
        3 / (1 + 1e-6),
    ]
    torch.testing.assert_close(col(), torch.tensor(grpo), rtol=0, atol=1e-7)
    torch.testing.assert_close(
        col(std_normalize=False), torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 3.0]), rtol=0, atol=1e-7
    )
    # RLOO: s_i minus the mean of the others: 1 − 0, 0 − 0.5, 0 − 0.5; 2 − 4, 4 − 2; alone: s
    rloo = torch.tensor([1.0, -0.5, -0.5, -2.0, 2.0, 3.0])
    torch.testing.assert_close(col(estimator="rloo"), rloo, rtol=0, atol=1e-7)
    assert group_advantages(scores, mask, group_ids=ids)[1, 1] == 0


def test_rloo_is_n_over_n_minus_1_times_dr_grpo():
    scores, mask, ids = make_inputs([4, 4, 6, 2], 5, F64, 3)
    rloo = group_advantages(scores, mask, group_ids=ids, estimator="rloo")
    dr = group_advantages(scores, mask, group_ids=ids, std_normalize=False)
    n = torch.bincount(ids)[ids].to(F64)[:, None]
    torch.testing.assert_close(rloo, dr * n / (n - 1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("estimator,std_normalize", ESTIMATORS, ids=EST_IDS)
@pytest.mark.parametrize("value", [0.1, -3.3, 0.0, 1e-30, 7.0])
def test_all_equal_groups_are_exactly_zero(dtype, estimator, std_normalize, value):
    # 0.1 three times: (0.1 + 0.1 + 0.1) / 3 != 0.1 in float64, so s − m is a few 1e-17 and
    # (s − m) / (σ + eps) would not be 0 without the max == min rule.
    sizes = [3, 7, 2, 5]
    g = gen(int(abs(value) * 10) + 1)
    ids = shuffled_ids(sizes, g)
    scores = torch.full((len(ids),), value, dtype=F64)
    other = ids == ids[0]  # one group that is not constant
    scores[other] = torch.randn(int(other.sum()), generator=g, dtype=F64)
    scores = scores.to(dtype)
    mask = random_mask(len(ids), 4, g)
    out = group_advantages(scores, mask, group_ids=ids, estimator=estimator, std_normalize=std_normalize)
    assert torch.all(out[~other] == 0)
    assert torch.all(out[other][mask[other]] != 0)
    check(scores, mask, ids, estimator=estimator, std_normalize=std_normalize)


def test_the_equal_rule_matters_in_float64():
    # What the rule guards against: the float64 mean of three 0.1s is not 0.1.
    assert (0.1 + 0.1 + 0.1) / 3 != 0.1
    x = torch.full((3,), 0.1, dtype=F64)
    assert float(x[0] - x.sum() / 3) != 0.0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_groups_of_one(dtype):
    scores = torch.tensor([2.5, -1.0, 0.0, 4.0], dtype=dtype)
    mask = torch.ones(4, 3, dtype=torch.bool)
    ids = torch.arange(4)
    s = scores.to(F64)[:, None].expand(4, 3)
    for eps in (1e-6, 0.25):
        got = group_advantages(scores, mask, group_ids=ids, eps=eps).to(F64)
        torch.testing.assert_close(got, s / (1 + eps), **tol(dtype))
        assert torch.equal(group_advantages(scores, mask, group_ids=ids, eps=eps, std_normalize=False).to(F64), s)
        assert torch.equal(group_advantages(scores, mask, group_ids=ids, eps=eps, estimator="rloo").to(F64), s)


def test_a_masked_out_row_still_counts_in_its_group():
    scores = torch.tensor([1.0, 2.0, 6.0])
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2] = False
    out = group_advantages(scores, mask, group_size=3, std_normalize=False)
    assert torch.equal(out[2], torch.zeros(4))
    torch.testing.assert_close(out[:2, 0], torch.tensor([-2.0, -1.0]), rtol=0, atol=1e-6)  # mean 3, not 1.5


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("estimator,std_normalize", ESTIMATORS, ids=EST_IDS)
def test_bits_depend_only_on_the_group(dtype, estimator, std_normalize):
    # A group alone, then inside a larger batch (other groups interleaved, its members in the
    # same relative order) padded to a longer T: the same bits.
    g = gen(5)
    scores = (torch.randn(6, generator=g, dtype=F64) * 3).to(dtype)
    mask = random_mask(6, 9, g)
    kw = dict(estimator=estimator, std_normalize=std_normalize)
    alone = group_advantages(scores, mask, group_ids=torch.zeros(6, dtype=torch.long), **kw)
    B, T = 31, 40
    big_scores = (torch.randn(B, generator=g, dtype=F64) * 3).to(dtype)
    big_ids = torch.randint(1, 9, (B,), generator=g)
    big_mask = random_mask(B, T, g)
    rows = torch.tensor([2, 3, 11, 17, 18, 30])
    big_scores[rows], big_ids[rows] = scores, 0
    big_mask[rows] = False
    big_mask[rows, :9] = mask
    out = group_advantages(big_scores, big_mask, group_ids=big_ids, **kw)
    assert bits_equal(out[rows, :9], alone)
    assert torch.all(out[rows, 9:] == 0)


@pytest.mark.parametrize("B,T", [(0, 5), (0, 0), (3, 0), (1, 1), (5, 1), (2, 700), (257, 3)])
def test_sizes(B, T):
    g = gen(B * 7 + T)
    scores = torch.randn(B, generator=g)
    mask = random_mask(B, T, g)
    ids = torch.randint(0, max(B, 1), (B,), generator=g)
    for estimator, std_normalize in ESTIMATORS:
        check(scores, mask, ids, estimator=estimator, std_normalize=std_normalize)


def test_mask_dtypes_agree():
    scores, mask, ids = make_inputs(SIZES, 8, torch.float32, 4)
    base = group_advantages(scores, mask, group_ids=ids)
    for m in (mask.float(), mask.long(), mask.int(), mask.to(torch.uint8), mask.double()):
        assert bits_equal(group_advantages(scores, m, group_ids=ids), base)


def test_non_contiguous_inputs():
    scores, mask, ids = make_inputs(SIZES, 9, torch.float32, 6)
    s_nc = torch.stack([scores, scores], 1)[:, 0]
    m_nc = mask.t().contiguous().t()
    i_nc = torch.stack([ids, ids], 1)[:, 1]
    assert not (s_nc.is_contiguous() or m_nc.is_contiguous() or i_nc.is_contiguous())
    assert bits_equal(group_advantages(s_nc, m_nc, group_ids=i_nc), group_advantages(scores, mask, group_ids=ids))


def test_not_differentiable():
    scores, mask, ids = make_inputs(SIZES, 4, torch.float32, 7)
    out = group_advantages(scores.requires_grad_(), mask, group_ids=ids)
    assert not out.requires_grad


def test_opcheck():
    scores, mask, ids = make_inputs(SIZES, 7, torch.float32, 8)
    torch.library.opcheck(OP, (scores, mask, ids, "grpo", 1e-6, True))
    torch.library.opcheck(OP, (scores.double(), mask.float(), ids, "rloo", 0.0, False))
    torch.library.opcheck(OP, (scores.bfloat16(), mask.long().t().contiguous().t(), ids, "grpo", 0.1, False))
    torch.library.opcheck(OP, (scores[:0], mask[:0], ids[:0], "grpo", 1e-6, True))


@pytest.mark.parametrize("path", ["meta", "fake"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_fake_kernel_shape_and_dtype(path, dtype):
    scores, mask, ids = make_inputs(SIZES, 5, dtype, 9)
    out = call_on(path, lambda s, m, i: group_advantages(s, m, group_ids=i), scores, mask, ids)
    assert out.shape == (len(ids), 5) and out.dtype == out_dtype(dtype)
    assert out.device.type == ("meta" if path == "meta" else "cpu")  # a FakeTensor keeps its device


# -------------------------------------------------------------------------------- errors


def _ok():
    return make_inputs([2, 3], 5, torch.float32, 10)


def _bad_cases():
    scores, mask, ids = _ok()
    op = lambda s, m, i, est="grpo", eps=1e-6: group_advantages(s, m, group_ids=i, estimator=est, eps=eps)  # noqa: E731
    return {
        "estimator": (
            lambda s, m, i: op(s, m, i, est="ppo"),
            r"estimator must be one of 'grpo', 'rloo', got 'ppo'",
            scores,
            mask,
            ids,
        ),
        "estimator_case": (lambda s, m, i: op(s, m, i, est="GRPO"), "estimator", scores, mask, ids),
        "eps_negative": (lambda s, m, i: op(s, m, i, eps=-1e-6), "eps must be a finite number >= 0", scores, mask, ids),
        "eps_nan": (lambda s, m, i: op(s, m, i, eps=math.nan), "eps", scores, mask, ids),
        "eps_inf": (lambda s, m, i: op(s, m, i, eps=math.inf), "eps", scores, mask, ids),
        "scores_shape": (op, r"scores must have shape \[B\] = \[5\]", scores[:4], mask, ids),
        "scores_2d": (op, "scores must have shape", scores[:, None], mask, ids),
        "scores_dtype": (op, "scores must be float32, bfloat16, float16 or float64", scores.long(), mask, ids),
        "mask_1d": (op, r"response_mask must be 2-D \[B, T\]", scores, mask[:, 0], ids),
        "mask_3d": (op, "response_mask must be 2-D", scores, mask[..., None], ids),
        "mask_complex": (op, "response_mask must be bool or hold 0/1 values", scores, mask.to(torch.complex64), ids),
        "ids_dtype": (op, "group_ids must be int64, got Int", scores, mask, ids.int()),
        "ids_float": (op, "group_ids must be int64", scores, mask, ids.float()),
        "ids_shape": (op, r"group_ids must have shape \[B\] = \[5\]", scores, mask, ids[:3]),
        "ids_2d": (op, "group_ids must have shape", scores, mask, ids[:, None]),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_input_raises_the_documented_error(case):
    fn, message, *args = _bad_cases()[case]
    with pytest.raises(ValueError, match=message) as e:
        fn(*args)
    assert str(e.value).startswith("pyppo.group_advantages: ")


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_errors_are_the_same_on_every_path(path, case):
    fn, _, *args = _bad_cases()[case]
    assert_same_error(path, fn, *args)


def _data_cases():
    scores, mask, ids = _ok()
    nan_scores, inf_scores = scores.clone(), scores.clone()
    nan_scores[3], inf_scores[1] = math.nan, -math.inf
    high, low = ids.clone(), ids.clone()
    high[2], low[4] = 5, -1
    return {
        "id_too_large": (r"group_ids\[2\] = 5 is outside \[0, B\) = \[0, 5\)", scores, mask, high),
        "id_negative": (r"group_ids\[4\] = -1 is outside \[0, B\)", scores, mask, low),
        "score_nan": (r"scores\[3\] = nan is not finite", nan_scores, mask, ids),
        "score_inf": (r"scores\[1\] = -inf is not finite", inf_scores, mask, ids),
        "mask_values": ("response_mask must be bool or hold only 0 and 1", scores, mask.float() * 0.5, ids),
        "ids_before_scores": (r"group_ids\[2\]", nan_scores, mask, high),
    }


@pytest.mark.parametrize("case", sorted(_data_cases()))
def test_data_errors(case):
    message, *args = _data_cases()[case]
    with pytest.raises(ValueError, match=message):
        group_advantages(*args[:2], group_ids=args[2])


@pytest.mark.parametrize("case", sorted(_data_cases()))
def test_data_errors_are_the_same_on_every_device(device, case):
    _, *args = _data_cases()[case]
    assert_same_error(device, lambda s, m, i: group_advantages(s, m, group_ids=i), *args)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(), "exactly one of group_size and group_ids"),
        (dict(group_size=2, group_ids=torch.zeros(6, dtype=torch.long)), "exactly one of group_size and group_ids"),
        (dict(group_size=4), r"B = 6 rows are not a whole number of groups of group_size = 4"),
        (dict(group_size=0), "group_size must be an int >= 1, got 0"),
        (dict(group_size=2.0), "group_size must be an int >= 1"),
        (dict(group_size=True), "group_size must be an int >= 1"),
    ],
    ids=["neither", "both", "not_dividing", "zero", "float", "bool"],
)
def test_wrapper_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(torch.randn(6), torch.ones(6, 3, dtype=torch.bool), **kwargs)


def test_different_devices_is_a_runtime_error():
    scores, mask, ids = _ok()
    with pytest.raises(RuntimeError, match="group_ids is on meta but response_mask is on cpu"):
        group_advantages(scores, mask, group_ids=ids.to("meta"))


# --------------------------------------------------------------------- the group_size overload

SIZED = torch.ops.pyppo.group_advantages.group_size


def sized_inputs(n, groups, T, dtype, seed):
    """groups x n scores with ties and, when n > 1, a first group of equal scores."""
    g = gen(seed)
    B = n * groups
    scores = (torch.randn(B, generator=g, dtype=F64) * 3).round(decimals=1).to(dtype)
    if n > 1 and groups:
        scores[:n] = scores[0]
    return scores, random_mask(B, T, g)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("estimator,std_normalize", ESTIMATORS, ids=EST_IDS)
@pytest.mark.parametrize(
    "n,groups,T",
    [(1, 5, 3), (2, 9, 1), (8, 21, 1), (8, 19, 7), (3, 8, 2), (64, 3, 1), (100, 2, 5), (3, 0, 4), (4, 4, 0)],
)
def test_group_size_overload_gives_the_bits_of_its_ids(dtype, estimator, std_normalize, n, groups, T):
    # The overload reads each run of n rows directly (eight groups at a time, then the ragged
    # rest) instead of looking rows up by id: the same float64 operations in the same order.
    scores, mask = sized_inputs(n, groups, T, dtype, n * 1000 + groups * 10 + T)
    ids = torch.arange(n * groups) // n
    kw = dict(estimator=estimator, std_normalize=std_normalize)
    out = SIZED(scores, mask, n, estimator, 1e-6, std_normalize)
    assert bits_equal(out, group_advantages(scores, mask, group_ids=ids, **kw))
    assert bits_equal(out, group_advantages(scores, mask, group_size=n, **kw))
    if n * groups:
        check(scores, mask, ids, **kw)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 70),
    groups=st.integers(0, 40),
    T=st.integers(0, 4),
    dtype=st.sampled_from(FLOAT_DTYPES),
    estimator=st.sampled_from(["grpo", "rloo"]),
    std_normalize=st.booleans(),
    eps=st.sampled_from([1e-6, 0.0, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_group_size_overload_bits_property(n, groups, T, dtype, estimator, std_normalize, eps, seed):
    # Every block split (whole blocks of eight groups, a ragged rest), every width of group.
    scores, mask = sized_inputs(n, groups, T, dtype, seed)
    ids = torch.arange(n * groups) // n
    kw = dict(estimator=estimator, eps=eps, std_normalize=std_normalize)
    assert bits_equal(
        group_advantages(scores, mask, group_size=n, **kw), group_advantages(scores, mask, group_ids=ids, **kw)
    )


def test_group_size_overload_is_thread_count_invariant():
    # Enough groups and T for the blocks of groups to be split across threads.
    scores, mask = sized_inputs(8, 2000, 64, torch.float32, 61)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = group_advantages(scores, mask, group_size=8)
        torch.set_num_threads(2)
        two = group_advantages(scores, mask, group_size=8)
    finally:
        torch.set_num_threads(threads)
    assert bits_equal(one, two)
    assert bits_equal(one, group_advantages(scores, mask, group_ids=torch.arange(len(scores)) // 8))


def test_group_size_overload_opcheck():
    scores, mask = sized_inputs(4, 5, 7, torch.float32, 62)
    torch.library.opcheck(SIZED, (scores, mask, 4, "grpo", 1e-6, True))
    torch.library.opcheck(SIZED, (scores.double(), mask.float(), 2, "rloo", 0.0, False))
    torch.library.opcheck(SIZED, (scores.bfloat16(), mask.long().t().contiguous().t(), 1, "grpo", 0.1, False))
    torch.library.opcheck(SIZED, (scores[:0], mask[:0], 3, "grpo", 1e-6, True))


def test_group_size_overload_is_not_differentiable():
    scores, mask = sized_inputs(4, 3, 5, torch.float32, 63)
    out = group_advantages(scores.requires_grad_(), mask, group_size=4)
    assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("path", ["meta", "fake"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_group_size_overload_fake_kernel(path, dtype):
    scores, mask = sized_inputs(3, 4, 5, dtype, 64)
    out = call_on(path, lambda s, m: group_advantages(s, m, group_size=3), scores, mask)
    assert out.shape == (12, 5) and out.dtype == out_dtype(dtype)


def _bad_sized_cases():
    scores, mask = sized_inputs(2, 3, 5, torch.float32, 65)
    op = lambda s, m, n=2, est="grpo", eps=1e-6: SIZED(s, m, n, est, eps, True)  # noqa: E731
    return {
        "group_size_zero": (lambda s, m: op(s, m, n=0), "group_size must be an int >= 1, got 0", scores, mask),
        "group_size_negative": (lambda s, m: op(s, m, n=-2), "group_size must be an int >= 1, got -2", scores, mask),
        "not_dividing": (
            lambda s, m: op(s, m, n=4),
            r"B = 6 rows are not a whole number of groups of group_size = 4",
            scores,
            mask,
        ),
        "estimator": (lambda s, m: op(s, m, est="ppo"), "estimator must be one of", scores, mask),
        "eps": (lambda s, m: op(s, m, eps=-1.0), "eps must be a finite number >= 0", scores, mask),
        "scores_shape": (op, r"scores must have shape \[B\] = \[6\]", scores[:4], mask),
        "scores_dtype": (op, "scores must be float32", scores.long(), mask),
        "mask_1d": (op, r"response_mask must be 2-D \[B, T\]", scores, mask[:, 0]),
    }


@pytest.mark.parametrize("case", sorted(_bad_sized_cases()))
def test_group_size_overload_errors(case):
    fn, message, *args = _bad_sized_cases()[case]
    with pytest.raises(ValueError, match=message) as e:
        fn(*args)
    assert str(e.value).startswith("pyppo.group_advantages: ")


@pytest.mark.parametrize("case", sorted(_bad_sized_cases()))
def test_group_size_overload_errors_are_the_same_on_every_path(path, case):
    fn, _, *args = _bad_sized_cases()[case]
    assert_same_error(path, fn, *args)


@pytest.mark.parametrize("bad,row", [(math.nan, 3), (math.inf, 0), (-math.inf, 5)])
def test_group_size_overload_names_the_first_non_finite_score(device, bad, row):
    scores, mask = sized_inputs(2, 3, 4, torch.float32, 66)
    scores[row] = bad
    scores[-1] = math.nan if row < 5 else scores[-1]
    with pytest.raises(ValueError, match=rf"scores\[{row}\] = {bad} is not finite"):
        group_advantages(scores.to(device), mask.to(device), group_size=2)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("estimator,std_normalize", ESTIMATORS, ids=EST_IDS)
def test_group_size_overload_device_matches_the_cpu_bits(device, dtype, estimator, std_normalize):
    scores, mask = sized_inputs(8, 37, 33, dtype, 67)
    kw = dict(estimator=estimator, std_normalize=std_normalize)
    cpu = group_advantages(scores, mask, group_size=8, **kw)
    out = group_advantages(scores.to(device), mask.to(device), group_size=8, **kw)
    assert out.device.type == device and bits_equal(out.cpu(), cpu)


# ------------------------------------------------------------------------ on every device


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("estimator,std_normalize", ESTIMATORS, ids=EST_IDS)
@pytest.mark.parametrize(
    "sizes,T", [(SIZES, 37), ([8] * 512, 256), ([1, 4, 300, 2, 700, 5], 3)], ids=["mixed", "512x8", "large_groups"]
)
def test_device_matches_the_cpu_bits(device, dtype, estimator, std_normalize, sizes, T):
    # CUDA adds the same float64 numbers in the same order as the CPU: the same bits.
    scores, mask, ids = make_inputs(sizes, T, dtype, len(sizes) + T)
    kw = dict(estimator=estimator, std_normalize=std_normalize)
    cpu = group_advantages(scores, mask, group_ids=ids, **kw)
    out = group_advantages(scores.to(device), mask.to(device), group_ids=ids.to(device), **kw)
    assert out.device.type == device and bits_equal(out.cpu(), cpu)
    if len(sizes) < 20:
        check(scores, mask, ids, **kw)


def test_device_opcheck(device):
    scores, mask, ids = make_inputs(SIZES, 6, torch.float32, 11)
    torch.library.opcheck(OP, (scores.to(device), mask.to(device), ids.to(device), "grpo", 1e-6, True))


# ------------------------------------------------------------------------------ veRL 0.9.1


@pytest.fixture(scope="module")
def verl():
    from support.peer_support import import_peer

    return import_peer("verl.trainer.ppo.core_algos")


def verl_inputs(sizes, T, dtype, seed):
    """Scores without ties (veRL computes its statistics in the scores' dtype, so on exact ties it
    can differ from 0 where pyppo gives exactly 0), veRL's token_level_rewards (the score at the
    last valid token; at T − 1 for a row with no valid token, whose score veRL still sums) and
    its index (uid strings)."""
    scores, mask, ids = make_inputs(sizes, T, dtype, seed)
    assert len(torch.unique(scores)) == len(scores)
    B = len(ids)
    last = torch.where(mask.any(1), (mask * torch.arange(T)).argmax(1), torch.full((B,), T - 1))
    rewards = torch.zeros(B, T, dtype=dtype)
    rewards[torch.arange(B), last] = scores
    index = np.array([f"uid-{int(i) * 7919 % 1000:03d}" for i in ids], dtype=object)
    return scores, mask, ids, rewards, index


VERL_DTYPES = [torch.float32, F64]


def verl_tol(dtype):
    # veRL's statistics are sums, means and torch.std in the scores' dtype; with float64 scores a
    # group of one is still divided by the float32 1 + eps (torch.tensor(1.0) + epsilon), 5e-8
    # relative off 1 + 1e-6.
    return dict(rtol=1e-7, atol=1e-9) if dtype == F64 else dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", VERL_DTYPES, ids=str)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64])
def test_verl_grpo(verl, dtype, norm, mask_dtype):
    scores, mask, ids, rewards, index = verl_inputs(SIZES + [4, 4, 6], 13, dtype, 21 + norm)
    m = mask.to(mask_dtype)
    adv, ret = verl.compute_grpo_outcome_advantage(rewards, m, index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm)
    ours = group_advantages(scores, m, group_ids=ids, eps=1e-6, std_normalize=norm)
    torch.testing.assert_close(ours.to(F64), adv.to(F64), **verl_tol(dtype))
    torch.testing.assert_close(ours.to(F64), ret.to(F64), **verl_tol(dtype))


@pytest.mark.parametrize("dtype", VERL_DTYPES, ids=str)
def test_verl_rloo(verl, dtype):
    scores, mask, ids, rewards, index = verl_inputs(SIZES + [4, 4, 6], 13, dtype, 31)
    adv, _ = verl.compute_rloo_outcome_advantage(rewards, mask.long(), index)
    ours = group_advantages(scores, mask, group_ids=ids, estimator="rloo")
    torch.testing.assert_close(ours.to(F64), adv.to(F64), **verl_tol(dtype))


@pytest.mark.parametrize("dtype", VERL_DTYPES, ids=str)
def test_verl_reinforce_plus_plus_baseline_is_dr_grpo_then_masked_whiten(verl, dtype):
    scores, mask, ids, rewards, index = verl_inputs(SIZES + [4, 4, 6], 13, dtype, 41)
    adv, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask.long(), index)
    ours = masked_whiten(group_advantages(scores, mask, group_ids=ids, std_normalize=False), mask)
    torch.testing.assert_close(ours.to(F64), adv.to(F64), **verl_tol(dtype))


def test_verl_grpo_at_the_bench_shape(verl):
    # 512 prompts x 8 samples, contiguous groups, as veRL's rollout lays them out.
    g = gen(51)
    B, T, n = 4096, 64, 8
    scores = torch.randn(B, generator=g)
    mask = random_mask(B, T, g)
    mask[:, -1] = True  # the score sits at T - 1 in every row
    rewards = torch.zeros(B, T)
    rewards[:, -1] = scores
    index = np.repeat(np.array([f"p{k}" for k in range(B // n)], dtype=object), n)
    adv, _ = verl.compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(group_advantages(scores, mask, group_size=n), adv, **verl_tol(torch.float32))


@pytest.mark.parametrize("value,at_least", [(0.1, 5e-3), (2.9, 0.1)])
def test_verl_equal_groups_are_not_zero_there(verl, value, at_least):
    # The deliberate difference (docs/ops.md): veRL's float32 mean of eight equal scores is an
    # ulp off and its std an ulp-sized number, so its GRPO advantage is far from 0; pyppo's is 0.
    scores = torch.full((8,), value)
    rewards = torch.zeros(8, 4)
    rewards[:, -1] = scores
    mask = torch.ones(8, 4, dtype=torch.bool)
    adv, _ = verl.compute_grpo_outcome_advantage(rewards, mask, np.array(["a"] * 8, dtype=object))
    assert adv.abs().max() > at_least
    assert torch.equal(group_advantages(scores, mask, group_size=8), torch.zeros(8, 4))
