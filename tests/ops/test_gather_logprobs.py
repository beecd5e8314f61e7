"""pyppo.ops.gather_logprobs against the float64 reference: values, entropy, gradients, layouts, errors.

Most tests run on CPU; those taking ``device`` run on every device present (conftest.py), and
those taking ``path`` also through the Meta kernel that torch.compile traces."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyppo.ops import gather_logprobs
from support.reference import (
    F64,
    FLOAT_DTYPES,
    assert_same_error,
    bits_equal,
    gen,
    grad_tol,
    out_dtype,
    random_mask,
    ref_gather_logprobs,
    tol,
    valid_positions,
)

OP = torch.ops.pyppo.gather_logprobs.default
OP_BWD = torch.ops.pyppo.gather_logprobs_backward.default


def make_inputs(B, T, V, dtype, seed, *, scale=3.0, with_mask=True, ignore_frac=0.0, ignore_index=-100):
    g = gen(seed)
    logits = (torch.randn(B, T, V, generator=g, dtype=F64) * scale).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = random_mask(B, T, g) if with_mask else None
    if ignore_frac > 0:
        ign = torch.rand(B, T, generator=g) < ignore_frac
        labels = torch.where(ign, torch.full_like(labels, ignore_index), labels)
    return logits, labels, mask


def check_against_reference(logits, labels, mask=None, *, temperature=1.0, ignore_index=-100, scale=1.0):
    lp, ent = gather_logprobs(
        logits, labels, mask, temperature=temperature, ignore_index=ignore_index, return_entropy=True
    )
    lp_only = gather_logprobs(logits, labels, mask, temperature=temperature, ignore_index=ignore_index)
    ref_lp, ref_ent = ref_gather_logprobs(logits, labels, mask, temperature=temperature, ignore_index=ignore_index)
    od = out_dtype(logits.dtype)
    assert lp.dtype == od and ent.dtype == od and lp_only.dtype == od
    assert lp.shape == labels.shape and ent.shape == labels.shape
    # V adds float32 rounding in the sum of exponentials; allow for it
    V = logits.shape[-1]
    s = scale * max(1.0, math.log2(V) / 4)
    torch.testing.assert_close(lp.to(F64), ref_lp, **tol(logits.dtype, s))
    torch.testing.assert_close(ent.to(F64), ref_ent, **tol(logits.dtype, s))
    valid = valid_positions(labels, mask, ignore_index)
    # masked / ignored positions are exactly 0
    assert torch.all(lp[~valid] == 0) and torch.all(ent[~valid] == 0)
    return lp, ent


# ------------------------------------------------------------------------------------------ values


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("V", [1, 2, 3, 17, 2047, 2048, 2049, 4099])
def test_values_match_reference(dtype, V):
    seed = 1000 + V * 7 + FLOAT_DTYPES.index(dtype)
    logits, labels, mask = make_inputs(5, 3, V, dtype, seed)
    lp, ent = check_against_reference(logits, labels, mask)
    if V == 1:
        valid = mask
        assert torch.all(lp[valid] == 0) and torch.all(ent[valid] == 0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
def test_temperature(dtype, temperature):
    logits, labels, mask = make_inputs(4, 5, 2049, dtype, 77 + int(temperature * 10))
    check_against_reference(logits, labels, mask, temperature=temperature)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.9, 0.7, 1.1, 3.0])
def test_logprobs_never_positive(dtype, temperature):
    # log p <= 0 always, and a one-token vocabulary (or a one-hot row) gives exactly 0:
    # the label's z/τ and the max inside logsumexp(z/τ) must be rounded the same way.
    g = gen(int(temperature * 100) + FLOAT_DTYPES.index(dtype))
    v1 = (torch.randn(64, 1, generator=g) * 5).to(dtype)
    lp, ent = gather_logprobs(v1, torch.zeros(64, dtype=torch.long), temperature=temperature, return_entropy=True)
    assert torch.all(lp == 0), lp[lp != 0]
    assert torch.all(ent == 0), ent[ent != 0]
    peaked = (torch.randn(64, 40, generator=g)).to(dtype)
    labels = torch.randint(0, 40, (64,), generator=g)
    peaked[torch.arange(64), labels] = 60.0
    lp = gather_logprobs(peaked, labels, temperature=temperature)
    assert torch.all(lp <= 0), lp[lp > 0]


def test_temperature_scales_logits():
    # gather_logprobs(z, τ) == gather_logprobs(z/τ, 1) (up to rounding of z/τ)
    logits, labels, mask = make_inputs(3, 4, 100, torch.float64, 5)
    a = gather_logprobs(logits, labels, mask, temperature=0.6, return_entropy=True)
    b = gather_logprobs(logits / 0.6, labels, mask, return_entropy=True)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("V", [2049, 4099, 6200])
def test_max_in_a_later_block(V):
    # The running max must be rebased when a later 2048-block holds a larger logit.
    g = gen(V)
    logits = torch.randn(6, V, generator=g)
    logits[0, -1] = 40.0  # max in the last (short) block
    logits[1, 2048] = 25.0  # first element of the second block
    logits[2, 2047] = 30.0  # last element of the first block
    logits[3, : min(V, 4096)] = -1e4  # huge negative first blocks, normal tail
    logits[4, -3:] = 15.0
    logits[5] = torch.linspace(-20, 20, V)  # increasing: the max grows in every block
    labels = torch.tensor([V - 1, 2048, 2047, 0, V - 2, V // 2])
    check_against_reference(logits, labels)
    check_against_reference(logits, labels, temperature=0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("V", [5, 33, 47, 2048 + 40, 4096 + 31])
def test_max_in_the_unvectorised_tail(dtype, V):
    # The largest logit sits in the last few elements of the row (the scalar tail after the
    # vector loop), 150 above the rest: if the tail is left out of the running max,
    # exp(x - max) overflows float32.
    g = gen(V + 17 * FLOAT_DTYPES.index(dtype))
    logits = torch.randn(3, V, generator=g, dtype=F64)
    logits[0, -1] = 150.0
    logits[1, -3] = 120.0
    logits[2, -2] = 100.0
    logits = logits.to(dtype)
    labels = torch.tensor([V - 1, 0, V - 2])
    lp, ent = check_against_reference(logits, labels)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    x = logits.clone().requires_grad_()
    lp, ent = gather_logprobs(x, labels, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all()


def test_neg_inf_logits():
    # -inf logits are probability 0: finite results; a label at a -inf logit has logprob -inf.
    V = 2100
    logits = torch.randn(4, V, generator=gen(3))
    logits[0, :2048] = float("-inf")  # first block all -inf
    logits[1, ::2] = float("-inf")
    logits[2, 5] = float("-inf")
    logits[3, 1:] = float("-inf")  # one-hot distribution
    labels = torch.tensor([2050, 1, 7, 0])
    lp, ent = gather_logprobs(logits, labels, return_entropy=True)
    ref_lp, ref_ent = ref_gather_logprobs(logits, labels)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    assert lp[3] == 0 and ent[3] == 0
    # label at a -inf logit
    lp2, ent2 = gather_logprobs(logits, torch.tensor([0, 0, 5, 1]), return_entropy=True)
    assert torch.isneginf(lp2).tolist() == [True, True, True, True]
    assert torch.isfinite(ent2).all()


def test_large_logits_are_stable():
    g = gen(11)
    base = torch.randn(3, 4, 3000, generator=g, dtype=F64)
    labels = torch.randint(0, 3000, (3, 4), generator=g)
    for shift in (1e3, -1e3, 3e4):
        logits = (base * 5 + shift).float()
        lp, ent = gather_logprobs(logits, labels, return_entropy=True)
        assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
        ref_lp, ref_ent = ref_gather_logprobs(logits, labels)
        # |z| ~ 3e4 carries float32 rounding of ~2e-3 in z/τ itself; scale the tolerance with |z|
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-4, atol=1e-7 * abs(shift) + 1e-4)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-4, atol=1e-7 * abs(shift) + 1e-4)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_masks_holes_all_masked_single_token(dtype):
    B, T, V = 6, 9, 70
    logits, labels, _ = make_inputs(B, T, V, dtype, 21)
    mask = random_mask(B, T, gen(22))
    lp, ent = check_against_reference(logits, labels, mask)
    assert torch.all(lp[1] == 0) and torch.all(ent[1] == 0)  # all-masked row
    assert int((lp[2] != 0).sum()) <= 1  # single-token row


def test_mask_dtypes_agree():
    logits, labels, mask = make_inputs(4, 6, 33, torch.float32, 8)
    base = gather_logprobs(logits, labels, mask, return_entropy=True)
    for m in (mask.float(), mask.double(), mask.long(), mask.int(), mask.to(torch.uint8), mask.bfloat16()):
        out = gather_logprobs(logits, labels, m, return_entropy=True)
        assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])


def test_no_mask_means_all_valid():
    logits, labels, _ = make_inputs(3, 4, 50, torch.float32, 9, with_mask=False)
    a = gather_logprobs(logits, labels)
    b = gather_logprobs(logits, labels, torch.ones(3, 4, dtype=torch.bool))
    assert torch.equal(a, b)
    check_against_reference(logits, labels)


@pytest.mark.parametrize("ignore_index", [-100, -1, 3])
def test_ignore_index(ignore_index):
    logits, labels, mask = make_inputs(5, 8, 40, torch.float32, 31, ignore_frac=0.3, ignore_index=ignore_index)
    lp, _ = check_against_reference(logits, labels, mask, ignore_index=ignore_index)
    assert torch.all(lp[labels == ignore_index] == 0)
    if ignore_index < 0:
        # the default ignore_index does not treat a custom one as ignored: it is an out-of-range label
        if ignore_index != -100 and (mask & (labels == ignore_index)).any():
            with pytest.raises(ValueError, match="labels"):
                gather_logprobs(logits, labels, mask)


def test_int32_labels_match_int64():
    logits, labels, mask = make_inputs(4, 7, 2050, torch.bfloat16, 41, ignore_frac=0.2)
    a = gather_logprobs(logits, labels, mask, return_entropy=True)
    b = gather_logprobs(logits, labels.int(), mask, return_entropy=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    check_against_reference(logits, labels.int(), mask)


@pytest.mark.parametrize(
    "shape", [(0, 5), (0, 3, 5), (3, 0, 5), (5,), (7, 5), (2, 3, 4, 5)], ids=lambda s: "x".join(map(str, s))
)
def test_shapes_and_empty(shape):
    g = gen(sum(shape))
    logits = torch.randn(*shape, generator=g, requires_grad=True)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    lp, ent = gather_logprobs(logits, labels, return_entropy=True)
    assert lp.shape == labels.shape and ent.shape == labels.shape
    ref_lp, ref_ent = ref_gather_logprobs(logits.detach(), labels)
    torch.testing.assert_close(lp.detach().double(), ref_lp, **tol(torch.float32))
    torch.testing.assert_close(ent.detach().double(), ref_ent, **tol(torch.float32))
    (lp.sum() + ent.sum()).backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape
    ref_logits = logits.detach().double().requires_grad_()
    r_lp, r_ent = ref_gather_logprobs(ref_logits, labels)
    (r_lp.sum() + r_ent.sum()).backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, **tol(torch.float32))


def test_zero_dim_label_on_vector_logits():
    logits = torch.randn(11, generator=gen(2))
    lp = gather_logprobs(logits, torch.tensor(4))
    assert lp.shape == ()
    torch.testing.assert_close(lp.double(), torch.log_softmax(logits.double(), 0)[4], **tol(torch.float32))


# -------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_non_contiguous_inputs(dtype):
    g = gen(51)
    B, T, V = 4, 6, 2053
    base = (torch.randn(T, B, V + 9, generator=g, dtype=F64) * 2).to(dtype)
    logits = base.transpose(0, 1)[..., 3 : V + 3]  # transposed and sliced along V
    assert not logits.is_contiguous()
    labels_big = torch.randint(0, V, (B, 2 * T), generator=g)
    labels = labels_big[:, ::2]  # strided labels
    mask_big = random_mask(B, 2 * T, g)
    mask = mask_big[:, 1::2]
    lp, ent = gather_logprobs(logits, labels, mask, return_entropy=True)
    lp_c, ent_c = gather_logprobs(logits.contiguous(), labels.contiguous(), mask.contiguous(), return_entropy=True)
    assert torch.equal(lp, lp_c) and torch.equal(ent, ent_c)
    check_against_reference(logits, labels, mask)


def test_vocab_not_unit_stride():
    # logits [N, V] whose V dimension is strided (a transposed [V, N] tensor)
    g = gen(52)
    for V in (1, 3, 2049):
        zt = torch.randn(V, 10, generator=g)
        logits = zt.t()
        labels = torch.randint(0, V, (10,), generator=g)
        lp, ent = check_against_reference(logits, labels, temperature=0.9)
        assert torch.equal(lp, gather_logprobs(logits.contiguous(), labels, temperature=0.9))


def test_expanded_logits():
    # a broadcast row (stride 0 along the batch)
    row = torch.randn(1, 300, generator=gen(53))
    logits = row.expand(5, 300)
    labels = torch.arange(5) * 50
    lp, _ = check_against_reference(logits, labels)


def test_nan_row_only_poisons_that_row():
    logits, labels, _ = make_inputs(3, 4, 2100, torch.float32, 61, with_mask=False)
    clean_lp, clean_ent = gather_logprobs(logits, labels, return_entropy=True)
    bad = logits.clone()
    bad[1, 2, 2070] = float("nan")
    bad[2, 0, 5] = float("inf")
    lp, ent = gather_logprobs(bad, labels, return_entropy=True)
    poisoned = torch.zeros(3, 4, dtype=torch.bool)
    poisoned[1, 2] = poisoned[2, 0] = True
    assert torch.isnan(lp[poisoned]).all() and torch.isnan(ent[poisoned]).all()
    assert torch.equal(lp[~poisoned], clean_lp[~poisoned]) and torch.equal(ent[~poisoned], clean_ent[~poisoned])
    # a NaN row that is masked is just 0
    m = ~poisoned
    lp_m = gather_logprobs(bad, labels, m)
    assert torch.all(lp_m[poisoned] == 0)
    assert torch.equal(lp_m[~poisoned], clean_lp[~poisoned])
    # gradient: the poisoned rows' gradients are not finite, the others are the clean ones
    x = bad.clone().requires_grad_()
    lp, ent = gather_logprobs(x, labels, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    xc = logits.clone().requires_grad_()
    lp, ent = gather_logprobs(xc, labels, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert not torch.isfinite(x.grad[1, 2]).any()
    assert not torch.isfinite(x.grad[2, 0]).any()
    assert torch.equal(x.grad[~poisoned], xc.grad[~poisoned])


# ----------------------------------------------------------------------------- gradients


def _grads(logits, labels, mask, temperature, which, g_lp, g_ent):
    x = logits.detach().clone().requires_grad_()
    lp, ent = gather_logprobs(x, labels, mask, temperature=temperature, return_entropy=True)
    loss = 0
    if which in ("lp", "both"):
        loss = loss + (lp * g_lp).sum()
    if which in ("ent", "both"):
        loss = loss + (ent * g_ent).sum()
    loss.backward()

    xr = logits.detach().to(F64).requires_grad_()
    rlp, rent = ref_gather_logprobs(xr, labels, mask, temperature=temperature)
    rloss = 0
    if which in ("lp", "both"):
        rloss = rloss + (rlp * g_lp.double()).sum()
    if which in ("ent", "both"):
        rloss = rloss + (rent * g_ent.double()).sum()
    rloss.backward()
    return x.grad, xr.grad


@pytest.mark.parametrize("which", ["lp", "ent", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("V,temperature", [(3, 1.0), (2049, 0.7), (4099, 1.0), (1, 1.3)])
def test_gradient_matches_reference(which, dtype, V, temperature):
    seed = V + ["lp", "ent", "both"].index(which) * 13 + FLOAT_DTYPES.index(dtype) * 101
    logits, labels, mask = make_inputs(4, 3, V, dtype, seed, ignore_frac=0.15)
    g = gen(seed + 1)
    g_lp = torch.randn(4, 3, generator=g)
    g_ent = torch.randn(4, 3, generator=g)
    grad, ref_grad = _grads(logits, labels, mask, temperature, which, g_lp, g_ent)
    assert grad.dtype == dtype and grad.shape == logits.shape
    valid = valid_positions(labels, mask, -100)
    assert torch.all(grad[~valid] == 0), "masked / ignored positions must get zero gradient"
    if dtype in (torch.float32, torch.float64):
        t = tol(dtype, 5.0)
    else:  # the gradient is rounded to the input dtype on output
        eps = torch.finfo(dtype).eps
        t = dict(rtol=2 * eps, atol=2 * eps * float(ref_grad.abs().max()) + 1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, **t)


def test_gradient_non_contiguous_logits():
    g = gen(71)
    base = torch.randn(5, 4, 2060, generator=g, dtype=F64)
    logits = base.transpose(0, 1)[..., 7:2057]
    labels = torch.randint(0, 2050, (4, 5), generator=g)
    mask = random_mask(4, 5, g)
    g_lp = torch.randn(4, 5, generator=g)
    g_ent = torch.randn(4, 5, generator=g)
    grad, ref_grad = _grads(logits, labels, mask, 0.8, "both", g_lp, g_ent)
    torch.testing.assert_close(grad, ref_grad, **tol(F64))


def test_gradient_non_contiguous_upstream():
    logits, labels, mask = make_inputs(4, 6, 50, torch.float64, 72)
    x = logits.clone().requires_grad_()
    lp, ent = gather_logprobs(x, labels, mask, return_entropy=True)
    up = torch.randn(6, 4, dtype=F64, generator=gen(73)).t()  # non-contiguous upstream grads
    torch.autograd.backward([lp, ent], [up, up * 0.5])
    xr = logits.clone().requires_grad_()
    rlp, rent = ref_gather_logprobs(xr, labels, mask)
    torch.autograd.backward([rlp, rent], [up, up * 0.5])
    torch.testing.assert_close(x.grad, xr.grad, **tol(F64))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_nonfinite_logit_anywhere_in_a_row(dtype, temperature):
    # The CPU block max skips NaNs (exp carries them into the sums) and a block of nothing but
    # -inf is skipped: wherever a NaN or +inf sits (among -inf only, in a later block, in the
    # tail past the last whole vector) it poisons its row's values and every element of its
    # gradient; the other rows, -inf logits included, are unaffected.
    V = 2 * 2048 + 37  # two whole blocks and a tail no vector width divides
    logits = (torch.randn(8, V, generator=gen(67), dtype=F64) * 3).to(dtype)
    nan, inf = float("nan"), float("inf")
    logits[0, :2048] = -inf
    logits[0, 100] = nan  # a NaN in a block of -inf, finite blocks after it
    logits[1, :] = -inf
    logits[1, V - 3] = nan  # only -inf and a NaN in the tail
    logits[2, V - 2] = nan
    logits[3, V - 1] = inf
    logits[4, 3000] = nan
    logits[5, :2048] = -inf  # clean: a whole block of -inf, then finite logits
    logits[6, ::3] = -inf  # clean
    labels = torch.tensor([7, 7, 7, 7, 7, 2050, 1, 9])
    poisoned = torch.tensor([True] * 5 + [False] * 3)
    x = logits.clone().requires_grad_()
    lp, ent = gather_logprobs(x, labels, temperature=temperature, return_entropy=True)
    assert torch.isnan(lp[poisoned]).all() and torch.isnan(ent[poisoned]).all()
    up_lp, up_ent = torch.randn(8, generator=gen(68)), torch.randn(8, generator=gen(69))
    ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
    assert torch.isnan(x.grad[poisoned]).all()
    xr = logits[~poisoned].to(F64).requires_grad_()
    lp_r, ent_r = ref_gather_logprobs(xr, labels[~poisoned], temperature=temperature)
    ((lp_r * up_lp[~poisoned]).sum() + (ent_r * up_ent[~poisoned]).sum()).backward()
    s = math.log2(V) / 4
    torch.testing.assert_close(lp[~poisoned].to(F64), lp_r, **tol(dtype, s))
    torch.testing.assert_close(ent[~poisoned].to(F64), ent_r, **tol(dtype, s))
    grad = x.grad[~poisoned]
    finite = torch.isfinite(logits[~poisoned])
    assert torch.all(grad[~finite] == 0)
    torch.testing.assert_close(grad[finite].to(F64), xr.grad[finite], **grad_tol(dtype))


def test_gradient_with_neg_inf_logits_is_finite():
    logits = torch.randn(3, 2100, generator=gen(74), dtype=F64)
    logits[0, :2048] = float("-inf")
    logits[1, ::3] = float("-inf")
    labels = torch.tensor([2090, 1, 4])
    x = logits.clone().requires_grad_()
    lp, ent = gather_logprobs(x, labels, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all()
    xr = logits.clone().requires_grad_()
    rlp, rent = ref_gather_logprobs(xr, labels)
    (rlp.sum() + rent.sum()).backward()
    finite = torch.isfinite(logits)
    torch.testing.assert_close(x.grad[finite], xr.grad[finite], **tol(F64))
    assert torch.all(x.grad[~finite] == 0)


def test_gradcheck_float64():
    g = gen(81)
    logits = torch.randn(2, 3, 5, generator=g, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=g)
    labels[0, 1] = -100
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)

    def both(x):
        return gather_logprobs(x, labels, mask, temperature=0.7, return_entropy=True)

    def lp_only(x):
        return gather_logprobs(x, labels, mask, temperature=1.3)

    def ent_only(x):
        return gather_logprobs(x, labels, None, return_entropy=True)[1]

    assert torch.autograd.gradcheck(both, (logits,))
    assert torch.autograd.gradcheck(lp_only, (logits,))
    assert torch.autograd.gradcheck(ent_only, (logits,))
    # across a block boundary
    big = torch.randn(2, 2050, generator=g, dtype=F64, requires_grad=True)
    lab = torch.tensor([2049, 3])
    assert torch.autograd.gradcheck(lambda x: gather_logprobs(x, lab, return_entropy=True), (big,), fast_mode=True)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(0, 4),
    T=st.integers(1, 5),
    V=st.sampled_from([1, 2, 5, 64, 2049]),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**20),
)
def test_hypothesis_values(B, T, V, temperature, dtype, seed):
    g = gen(seed)
    logits = (torch.randn(B, T, V, generator=g, dtype=F64) * 4).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.6
    check_against_reference(logits, labels, mask, temperature=temperature)


# ---------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    g = gen(91)
    lg = torch.randn(3, 4, 7, generator=g)
    lab = torch.randint(0, 7, (3, 4), generator=g)
    mask = random_mask(3, 4, g)
    nc = torch.randn(4, 3, 2050, generator=g, dtype=F64).transpose(0, 1)
    nc_lab = torch.randint(0, 2050, (3, 4), generator=g)
    return [
        (lg, lab, None, 1.0, -100, False),
        (lg, lab, mask, 0.7, -100, True),
        (lg.bfloat16(), lab.int(), mask.float(), 1.0, -100, True),
        (lg.half(), lab, mask, 2.0, 3, False),
        (nc, nc_lab, None, 1.0, -100, True),
        (torch.randn(0, 5), torch.zeros(0, dtype=torch.long), None, 1.0, -100, True),
    ]


@pytest.mark.parametrize("case", range(6))
def test_opcheck_forward(case):
    args = list(_opcheck_cases()[case])
    args[0] = args[0].detach().clone().requires_grad_()  # differentiable w.r.t. logits, any float dtype
    torch.library.opcheck(OP, tuple(args))


@pytest.mark.parametrize("case", range(6))
def test_opcheck_backward_op(case):
    logits, labels, mask, temperature, ignore_index, _ = _opcheck_cases()[case]
    lp, ent, lse = OP(logits, labels, mask, temperature, ignore_index, True)
    g = gen(case)
    g_lp = torch.randn(lp.shape, generator=g, dtype=lp.dtype)
    g_ent = torch.randn(lp.shape, generator=g, dtype=lp.dtype)
    torch.library.opcheck(OP_BWD, (g_lp, g_ent, logits, labels, mask, lse, ent, temperature, ignore_index))
    torch.library.opcheck(OP_BWD, (g_lp, None, logits, labels, mask, lse, None, temperature, ignore_index))


# ------------------------------------------------------------------------------ errors


def _ok_inputs():
    g = gen(101)
    return torch.randn(2, 3, 10, generator=g), torch.randint(0, 10, (2, 3), generator=g)


def test_error_labels_shape():
    logits, labels = _ok_inputs()
    with pytest.raises(ValueError, match="labels"):
        gather_logprobs(logits, labels[:, :2])
    with pytest.raises(ValueError, match="labels"):
        gather_logprobs(logits, labels.reshape(6))
    with pytest.raises(ValueError, match="labels"):
        gather_logprobs(logits, labels.unsqueeze(-1))


def test_error_mask_shape():
    logits, labels = _ok_inputs()
    with pytest.raises(ValueError, match="mask"):
        gather_logprobs(logits, labels, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        gather_logprobs(logits, labels, torch.ones(6, dtype=torch.bool))


def test_error_mask_not_zero_one():
    logits, labels = _ok_inputs()
    m = torch.ones(2, 3)
    m[1, 1] = 0.5
    with pytest.raises(ValueError, match="mask"):
        gather_logprobs(logits, labels, m)
    m[1, 1] = 2
    with pytest.raises(ValueError, match="mask"):
        gather_logprobs(logits, labels, m.long())
    m[1, 1] = float("nan")
    with pytest.raises(ValueError, match="mask"):
        gather_logprobs(logits, labels, m)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_error_logits_dtype(dtype):
    logits, labels = _ok_inputs()
    with pytest.raises(ValueError, match="logits"):
        gather_logprobs(logits.to(dtype), labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_error_labels_dtype(dtype):
    logits, labels = _ok_inputs()
    with pytest.raises(ValueError, match="labels"):
        gather_logprobs(logits, labels.to(dtype))


def test_error_zero_dim_logits():
    with pytest.raises(ValueError, match="logits"):
        gather_logprobs(torch.tensor(1.0), torch.tensor(0))


@pytest.mark.parametrize("bad", [10, 11, 10**9, -1, -101])
def test_error_label_out_of_range_unmasked(bad):
    logits, labels = _ok_inputs()
    labels[1, 2] = bad
    with pytest.raises(ValueError, match="labels"):
        gather_logprobs(logits, labels)
    with pytest.raises(ValueError, match="labels"):
        gather_logprobs(logits, labels.int() if abs(bad) < 2**31 else labels, torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.parametrize("bad", [10, 10**9, -1, -101])
def test_out_of_range_label_is_fine_when_masked_or_ignored(bad):
    logits, labels = _ok_inputs()
    labels[1, 2] = bad
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    lp, ent = gather_logprobs(logits, labels, mask, return_entropy=True)
    assert lp[1, 2] == 0 and ent[1, 2] == 0
    ref_lp, _ = ref_gather_logprobs(logits, labels, mask)
    torch.testing.assert_close(lp.double(), ref_lp, **tol(torch.float32))
    # and its gradient is zero (the backward also sees the bad label)
    x = logits.clone().requires_grad_()
    lp, ent = gather_logprobs(x, labels, mask.float(), return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.all(x.grad[1, 2] == 0)
    # the same label equal to ignore_index, unmasked
    lp2 = gather_logprobs(logits, labels, ignore_index=bad)
    assert lp2[1, 2] == 0


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), -0.0])
def test_error_temperature(temperature):
    logits, labels = _ok_inputs()
    with pytest.raises(ValueError, match="temperature"):
        gather_logprobs(logits, labels, temperature=temperature)


def test_error_empty_vocab():
    with pytest.raises(ValueError, match="logits|V"):
        gather_logprobs(torch.randn(2, 0), torch.zeros(2, dtype=torch.long))


def test_second_derivative_is_an_error_not_silent_zeros():
    z = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 7, (3,))
    (g,) = torch.autograd.grad(gather_logprobs(z, y).sum(), z, create_graph=True)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        g.sum().backward()


# ------------------------------------------------------------------------ on every device


# Tolerances of a device kernel against the float64 reference on the same rounded inputs: only
# the float32 accumulation differs (in another order on CUDA).
def device_tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == F64 else dict(rtol=1e-5, atol=1e-4)


def holes_inputs(B, T, V, dtype, seed, *, ignore=True):
    """Logits, labels and a mask with holes in which every row keeps a valid position."""
    g = gen(seed)
    logits = (torch.randn(B, T, V, generator=g, dtype=F64) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[:, 0] = True
    if ignore:
        labels[0, -1] = -100
    return logits, labels, mask


DEVICE_SHAPES = [(2, 3, 7), (3, 5, 4096), (2, 4, 4099), (1, 3, 32771)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", DEVICE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_device_values_match_reference(device, dtype, shape, temperature):
    logits, labels, mask = holes_inputs(*shape, dtype, seed=sum(shape))
    lp, ent = gather_logprobs(
        logits.to(device), labels.to(device), mask.to(device), temperature=temperature, return_entropy=True
    )
    assert lp.device.type == device and lp.dtype == out_dtype(dtype) and ent.dtype == out_dtype(dtype)
    lp_r, ent_r = ref_gather_logprobs(logits, labels, mask, temperature=temperature)
    torch.testing.assert_close(lp.cpu().to(F64), lp_r, **device_tol(dtype))
    torch.testing.assert_close(ent.cpu().to(F64), ent_r, **device_tol(dtype))
    invalid = ~(mask & (labels != -100))
    assert (lp.cpu()[invalid] == 0).all() and (ent.cpu()[invalid] == 0).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_device_all_masked_and_single_token_rows(device, dtype):
    logits, labels, _ = make_inputs(6, 9, 2049, dtype, 23)
    mask = random_mask(6, 9, gen(24))  # a full row, an all-masked row, a single token, a hole
    lp, ent = gather_logprobs(logits.to(device), labels.to(device), mask.to(device), return_entropy=True)
    lp_r, ent_r = ref_gather_logprobs(logits, labels, mask)
    torch.testing.assert_close(lp.cpu().to(F64), lp_r, **device_tol(dtype))
    torch.testing.assert_close(ent.cpu().to(F64), ent_r, **device_tol(dtype))
    assert torch.all(lp[1] == 0) and torch.all(ent[1] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_device_non_contiguous_logits(device, dtype):
    logits, labels, mask = holes_inputs(3, 4, 1000, dtype, seed=5)
    big = torch.zeros(3, 4, 1003, dtype=dtype)
    big[..., 1:1001] = logits
    sliced = big.to(device)[..., 1:1001]  # unit stride along V, rows 1003 apart, misaligned start
    transposed = logits.transpose(0, 1).contiguous().transpose(0, 1).to(device)
    expect, _ = ref_gather_logprobs(logits, labels, mask)
    for x in (sliced, transposed):
        got = gather_logprobs(x, labels.to(device), mask.to(device))
        torch.testing.assert_close(got.cpu().to(F64), expect, **device_tol(dtype))


def _t_sliced(B, P, T, V, dtype, seed):
    """logits[:, P-1:-1] of a [B, P+T, V] tensor, as the full-logits path slices the response
    positions out of a model's output: rows T apart in B, not collapsible into [N, V]."""
    full = (torch.randn(B, P + T, V, generator=gen(seed), dtype=F64) * 3).to(dtype)
    return full[:, P - 1 : -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_device_t_sliced_view_gives_the_bits_of_its_contiguous_copy(device, dtype):
    view = _t_sliced(3, 5, 7, 1031, dtype, seed=7).to(device)
    assert not view.is_contiguous()
    labels = torch.randint(0, 1031, (3, 7), generator=gen(8)).to(device)
    mask = random_mask(3, 7, gen(9)).to(device)
    up = torch.randn(3, 7, generator=gen(10)).to(device)
    outs = []
    for x in (view, view.contiguous()):
        x = x.detach().clone() if x is not view else x.detach()
        x.requires_grad_()
        lp, ent = gather_logprobs(x, labels, mask, temperature=0.8, return_entropy=True)
        ((lp + 0.3 * ent) * up).sum().backward()
        outs.append((lp, ent, x.grad))
    for a, b in zip(*outs):
        assert bits_equal(a, b)


def test_cpu_t_sliced_view_is_read_in_place():
    # No [N, V] copy of the view in the forward or the backward: the only allocation of that
    # size is the backward's fresh gradient.
    view = _t_sliced(2, 4, 64, 4096, torch.float32, seed=11).detach().requires_grad_()
    labels = torch.randint(0, 4096, (2, 64), generator=gen(12))
    nbytes = 2 * 64 * 4096 * 4

    def big_allocations(fn):
        """Sizes of the allocations of at least half an [N, V] tensor that fn makes."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage >= nbytes // 2]

    lp, _, lse = OP(view.detach(), labels, None, 1.0, -100, True)
    assert big_allocations(lambda: OP(view.detach(), labels, None, 1.0, -100, True)) == []
    # The probe sees a copy where there is one.
    assert big_allocations(lambda: OP(view.detach().contiguous(), labels, None, 1.0, -100, True)) == [nbytes]
    # The backward allocates its fresh gradient, and nothing else of that size.
    bwd = lambda: OP_BWD(torch.ones_like(lp), None, view.detach(), labels, None, lse, None, 1.0, -100)  # noqa: E731
    assert big_allocations(bwd) == [nbytes]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_device_logprobs_never_positive_and_zero_where_certain(device, dtype, temperature):
    # One-hot rows (every other logit far below the label's, an arbitrary value), V = 1, and
    # sharp random rows whose label is the max: log p <= 0 always, exactly 0 where p is 1.
    g = gen(int(temperature * 10) + FLOAT_DTYPES.index(dtype))
    for V in (1, 7, 4099):
        R = 256
        labels = torch.randint(0, V, (R,), generator=g)
        top = torch.randn(R, generator=g, dtype=F64) * 20
        z = top[:, None] - 200 * temperature - torch.rand(R, V, generator=g, dtype=F64) * 50
        z[torch.arange(R), labels] = top
        lp = gather_logprobs(z.to(dtype).to(device), labels.to(device), temperature=temperature)
        assert (lp == 0).all(), lp[lp != 0][:5]
        sharp = (torch.randn(R, V, generator=g, dtype=F64) * 40).to(dtype)
        lp = gather_logprobs(sharp.to(device), sharp.float().argmax(-1).to(device), temperature=temperature)
        assert torch.isfinite(lp).all() and (lp <= 0).all(), lp.max()


def test_device_huge_finite_logits_stay_finite(device):
    # |z / temperature| between FLT_MAX / log2(e) and FLT_MAX: finite on every device.
    g = gen(13)
    sign = torch.randint(0, 2, (6, 300), generator=g) * 2 - 1
    z = (sign * (2.4e38 + torch.rand(6, 300, generator=g) * 0.9e38)).float()
    labels = z.argmax(-1)
    lp, ent = gather_logprobs(z.to(device), labels.to(device), return_entropy=True)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and (lp <= 0).all()
    lse = OP(z.to(device), labels.to(device), None, 1.0, -100, False)[2]
    assert torch.equal(lse.cpu(), z.amax(-1))


def test_device_int_mask_and_int32_labels(device):
    logits, labels, mask = holes_inputs(2, 6, 300, torch.float32, seed=6)
    x = logits.to(device)
    a = gather_logprobs(x, labels.to(device), mask.to(device))
    b = gather_logprobs(x, labels.int().to(device), mask.long().to(device))
    assert bits_equal(a, b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_device_gradient_matches_reference(device, dtype, with_entropy):
    B, T, V = 3, 4, 4099
    logits, labels, mask = holes_inputs(B, T, V, dtype, seed=11)
    g = gen(12)
    up_lp = torch.randn(B, T, generator=g, dtype=F64)
    up_ent = torch.randn(B, T, generator=g, dtype=F64)
    x = logits.detach().clone().to(device).requires_grad_()
    lp, ent = gather_logprobs(x, labels.to(device), mask.to(device), temperature=0.9, return_entropy=True)
    loss = (lp.to(F64) * up_lp.to(device)).sum()
    if with_entropy:
        loss = loss + (ent.to(F64) * up_ent.to(device)).sum()
    loss.backward()
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    xr = logits.detach().to(F64).clone().requires_grad_()
    lp_r, ent_r = ref_gather_logprobs(xr, labels, mask, temperature=0.9)
    ((lp_r * up_lp).sum() + ((ent_r * up_ent).sum() if with_entropy else 0)).backward()
    torch.testing.assert_close(x.grad.cpu().to(F64), xr.grad, **grad_tol(dtype))
    invalid = ~(mask & (labels != -100))
    assert (x.grad.cpu()[invalid] == 0).all()


def test_device_nonfinite_rows_are_isolated(device):
    logits, labels, mask = holes_inputs(1, 6, 700, torch.float32, seed=31, ignore=False)
    mask[:] = True
    logits[0, 1, 5] = float("nan")
    logits[0, 2, 9] = float("inf")
    logits[0, 3, :] = float("-inf")
    logits[0, 4, :350] = float("-inf")  # half the row (several whole chunks) -inf
    lp, ent = gather_logprobs(logits.to(device), labels.to(device), mask.to(device), return_entropy=True)
    lp_r, ent_r = ref_gather_logprobs(logits, labels, mask)
    # A NaN or +inf logit makes its row NaN (the reference would give -inf for +inf), and so does
    # a row of -inf only (no distribution at all); other -inf logits are zero-probability tokens.
    poisoned = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | torch.isneginf(logits).all(-1)
    for got, ref in ((lp.cpu().to(F64), lp_r), (ent.cpu().to(F64), ent_r)):
        assert torch.equal(torch.isnan(got), poisoned | torch.isnan(ref))
        finite = torch.isfinite(ref) & ~poisoned
        torch.testing.assert_close(got[finite], ref[finite], rtol=1e-5, atol=1e-4)
    assert torch.isfinite(lp[0, 0]) and torch.isfinite(lp[0, 5])


def _error_inputs():
    logits, labels, mask = holes_inputs(2, 3, 50, torch.float32, seed=41, ignore=False)
    return logits, labels, mask


def _bad_shape_and_argument_cases():
    """Bad inputs that the checks catch from shapes, dtypes and arguments alone: every path,
    the Meta kernel included, must raise the CPU kernel's error."""
    logits, labels, mask = _error_inputs()
    grads = torch.ones(2, 3)
    bwd = torch.ops.pyppo.gather_logprobs_backward.default
    return {
        "temperature": (lambda z, y: gather_logprobs(z, y, temperature=0.0), logits, labels),
        "labels_shape": (lambda z, y: gather_logprobs(z, y), logits, labels[:, :2]),
        "labels_dtype": (lambda z, y: gather_logprobs(z, y), logits, labels.float()),
        "logits_dtype": (lambda z, y: gather_logprobs(z, y), logits.long(), labels),
        "mask_shape": (lambda z, y, m: gather_logprobs(z, y, m), logits, labels, mask[:, :2]),
        "mask_dtype": (lambda z, y, m: gather_logprobs(z, y, m), logits, labels, mask.to(torch.complex64)),
        "empty_vocab": (lambda z, y: gather_logprobs(z, y), logits[..., :0], labels),
        "zero_dim": (lambda z, y: gather_logprobs(z, y), torch.tensor(1.0), torch.tensor(0)),
        "bwd_grad_shape": (
            lambda g, z, y, l: bwd(g, None, z, y, None, l, None, 1.0, -100),
            grads[:, :2],
            logits,
            labels,
            grads,
        ),
        "bwd_entropy_missing": (
            lambda g, z, y, l: bwd(g, g, z, y, None, l, None, 1.0, -100),
            grads,
            logits,
            labels,
            grads,
        ),
    }


@pytest.mark.parametrize("case", sorted(_bad_shape_and_argument_cases()))
def test_errors_are_the_same_on_every_path(path, case):
    fn, *args = _bad_shape_and_argument_cases()[case]
    assert_same_error(path, fn, *args)


def test_data_errors_are_the_same_on_every_device(device):
    logits, labels, mask = _error_inputs()
    bad = labels.clone()
    bad[1, 2] = 50
    bad[0, 1] = -7
    mask[0, 1] = False  # masked: -7 is fine there; [1, 2] = 50 is the first unmasked bad label
    mask[1, 2] = True
    assert_same_error(device, lambda z, y, m: gather_logprobs(z, y, m), logits, bad, mask)
    assert_same_error(device, lambda z, y, m: gather_logprobs(z, y, m), logits, labels, mask.float() * 0.5)
    # The raw backward checks its labels too.
    ones = torch.ones(2, 3)
    assert_same_error(device, lambda g, z, y, m: OP_BWD(g, None, z, y, m, g, None, 1.0, -100), ones, logits, bad, mask)


def test_device_mismatch_names_the_devices(device):
    if device == "cpu":
        pytest.skip("needs a second device")
    logits, labels, _ = _error_inputs()
    with pytest.raises(RuntimeError, match="device"):
        gather_logprobs(logits.to(device), labels)


def test_fake_output_shapes_match_the_kernel():
    # The Meta kernel, not a Python fake, gives the traced shapes: 0-d labels, no entropy, bf16.
    from support.reference import call_on

    for logits, labels, want_ent in (
        (torch.randn(11), torch.tensor(4), True),
        (torch.randn(2, 3, 7).bfloat16(), torch.zeros(2, 3, dtype=torch.long), False),
    ):
        real = OP(logits, labels, None, 1.0, -100, want_ent)
        fake = call_on("fake", lambda z, y: OP(z, y, None, 1.0, -100, want_ent), logits, labels)
        for r, f in zip(real, fake):
            assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())


def _device_opcheck_cases(device):
    g = gen(101)
    B, T, V = 2, 3, 37
    logits = torch.randn(B, T, V, generator=g).to(device)
    labels = torch.randint(0, V, (B, T), generator=g).to(device)
    mask = random_mask(B, T, g).to(device)
    return [(logits.clone().requires_grad_(), labels, mask, 0.9, -100, True), (logits, labels, None, 1.0, -100, False)]


@pytest.mark.parametrize("case", range(2))
def test_device_opcheck(device, case):
    torch.library.opcheck(OP, _device_opcheck_cases(device)[case])


def test_raw_logsumexp_output_is_not_differentiable():
    # The raw op's third output (logsumexp of logits/τ) is saved for the backward, which has no
    # term for it: it must not carry a grad_fn, or a loss built on it gets a silently wrong gradient.
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5))
    logprobs, entropy, lse = torch.ops.pyppo.gather_logprobs.default(logits, labels, None, 0.7, -100, True)
    assert logprobs.requires_grad and entropy.requires_grad
    assert not lse.requires_grad and lse.grad_fn is None
    torch.testing.assert_close(lse, torch.logsumexp(logits.detach() / 0.7, -1))
