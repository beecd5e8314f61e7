"""pyppo.ops.masked_mean / masked_var / masked_whiten against float64 statistics of the masked-in elements."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyppo.ops import masked_mean, masked_var, masked_whiten
from support.reference import (
    F64,
    FLOAT_DTYPES,
    assert_same_error,
    bits_equal,
    call_on,
    gen,
    out_dtype,
    random_mask,
    ref_masked_mean,
    ref_masked_var,
    ref_masked_whiten,
    tol,
)

OP_MEAN = torch.ops.pyppo.masked_mean.default
OP_VAR = torch.ops.pyppo.masked_var.default
OP_WHITEN = torch.ops.pyppo.masked_whiten.default


def make_inputs(shape, dtype, seed, p_valid=0.6):
    g = gen(seed)
    x = (torch.randn(shape, generator=g, dtype=F64) * 2 + 0.7).to(dtype)
    mask = torch.rand(shape, generator=g) < p_valid
    mask.view(-1)[0] = True
    if mask.numel() > 1:
        mask.view(-1)[-1] = True
    return x, mask


SHAPES = [(1,), (2,), (7, 13), (3, 4, 5), (9000,), (3, 4097)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_masked_mean_values(dtype, shape):
    x, mask = make_inputs(shape, dtype, sum(shape) + FLOAT_DTYPES.index(dtype))
    out = masked_mean(x, mask)
    assert out.shape == () and out.dtype == out_dtype(dtype)
    torch.testing.assert_close(out.to(F64), ref_masked_mean(x, mask), **tol(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1, 2, -3])
def test_masked_mean_dim(dtype, dim):
    x, _ = make_inputs((4, 5, 6), dtype, 10 + dim)
    mask = torch.rand(4, 5, 6, generator=gen(11 + dim)) < 0.5
    # every slice along dim gets at least one valid element
    idx = [slice(None)] * 3
    idx[dim] = 0
    mask[tuple(idx)] = True
    out = masked_mean(x, mask, dim=dim)
    expected = ref_masked_mean(x, mask, dim)
    assert out.shape == expected.shape and out.dtype == out_dtype(dtype)
    torch.testing.assert_close(out.to(F64), expected, **tol(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_values(dtype, shape, unbiased):
    x, mask = make_inputs(shape, dtype, sum(shape) * 3 + unbiased)
    out = masked_var(x, mask, unbiased=unbiased)
    assert out.shape == () and out.dtype == out_dtype(dtype)
    torch.testing.assert_close(out.to(F64), ref_masked_var(x, mask, unbiased), **tol(dtype))


def test_masked_var_single_element_biased_is_zero():
    x = torch.tensor([3.0, 5.0])
    assert masked_var(x, torch.tensor([True, False]), unbiased=False) == 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("eps", [1e-8, 0.0, 0.5])
def test_masked_whiten_values(dtype, shift_mean, unbiased, eps):
    x, mask = make_inputs((6, 11), dtype, 20 + shift_mean + 2 * unbiased)
    mask[1] = False  # an all-masked row
    out = masked_whiten(x, mask, shift_mean=shift_mean, unbiased=unbiased, eps=eps)
    assert out.shape == x.shape and out.dtype == out_dtype(dtype)
    expected = ref_masked_whiten(x, mask, shift_mean=shift_mean, unbiased=unbiased, eps=eps)
    torch.testing.assert_close(out.to(F64), expected, **tol(dtype, 5))
    assert torch.all(out[~mask] == 0)
    if shift_mean and eps == 0.0:
        vals = out[mask].double()
        assert abs(float(vals.mean())) < 1e-5
        assert abs(float(vals.var(unbiased=unbiased)) - 1) < 1e-5


def test_masked_whiten_default_is_unbiased_shift_mean():
    x, mask = make_inputs((50,), torch.float32, 30)
    assert torch.equal(masked_whiten(x, mask), masked_whiten(x, mask, shift_mean=True, unbiased=True, eps=1e-8))
    torch.testing.assert_close(masked_whiten(x, mask).double(), ref_masked_whiten(x, mask), **tol(torch.float32))


def test_large_offset_is_stable():
    # two-pass variance: a large common offset must not destroy the variance
    x, mask = make_inputs((5000,), F64, 31)
    x = x + 1e6
    torch.testing.assert_close(masked_var(x, mask), ref_masked_var(x, mask), rtol=1e-9, atol=0)
    xf = x.float()
    torch.testing.assert_close(masked_var(xf, mask).double(), ref_masked_var(xf, mask), rtol=1e-5, atol=0)


def test_mask_dtypes_agree():
    x, mask = make_inputs((8, 9), torch.float32, 32)
    for m in (mask.float(), mask.long(), mask.to(torch.uint8), mask.double(), mask.bfloat16()):
        assert torch.equal(masked_mean(x, m), masked_mean(x, mask))
        assert torch.equal(masked_mean(x, m, dim=1), masked_mean(x, mask, dim=1))
        assert torch.equal(masked_var(x, m), masked_var(x, mask))
        assert torch.equal(masked_whiten(x, m), masked_whiten(x, mask))


def test_non_contiguous():
    x, mask = make_inputs((9, 12), torch.float32, 33)
    xn = x.t().contiguous().t()
    mn = torch.stack([mask, mask], -1)[..., 0]
    assert not xn.is_contiguous() and not mn.is_contiguous()
    assert torch.equal(masked_mean(xn, mn), masked_mean(x, mask))
    assert torch.equal(masked_mean(xn, mn, dim=0), masked_mean(x, mask, dim=0))
    assert torch.equal(masked_var(xn, mn), masked_var(x, mask))
    assert torch.equal(masked_whiten(xn, mn), masked_whiten(x, mask))
    xt, mt = x.t(), mask.t()
    torch.testing.assert_close(masked_mean(xt, mt, dim=1).double(), ref_masked_mean(xt, mt, 1), **tol(torch.float32))
    torch.testing.assert_close(masked_whiten(xt, mt).double(), ref_masked_whiten(xt, mt), **tol(torch.float32))


def test_nan_in_masked_out_position_is_ignored():
    x, mask = make_inputs((20,), torch.float32, 34)
    mask[3] = False
    x[3] = float("nan")
    assert torch.isfinite(masked_mean(x, mask))
    assert torch.isfinite(masked_var(x, mask))
    out = masked_whiten(x, mask)
    assert torch.isfinite(out).all() and out[3] == 0


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(2, 60),
    p_valid=st.floats(0.05, 1.0),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**20),
    unbiased=st.booleans(),
    shift_mean=st.booleans(),
)
def test_hypothesis(n, p_valid, dtype, seed, unbiased, shift_mean):
    x, mask = make_inputs((n,), dtype, seed, p_valid)
    torch.testing.assert_close(masked_mean(x, mask).to(F64), ref_masked_mean(x, mask), **tol(dtype))
    torch.testing.assert_close(
        masked_var(x, mask, unbiased).to(F64), ref_masked_var(x, mask, unbiased), **tol(dtype, 5)
    )
    torch.testing.assert_close(
        masked_whiten(x, mask, shift_mean=shift_mean, unbiased=unbiased).to(F64),
        ref_masked_whiten(x, mask, shift_mean=shift_mean, unbiased=unbiased),
        **tol(dtype, 50),
    )


# ------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_masked_mean_gradient(dim, dtype):
    x, _ = make_inputs((5, 7), dtype, 40)
    mask = random_mask(5, 7, gen(41))
    mask[1, 0] = True  # the "all masked" row gets one element so every slice is non-empty
    mask[:, 2] = True
    x = x.clone().requires_grad_()
    out = masked_mean(x, mask, dim=dim)
    up = torch.randn(out.shape, generator=gen(42), dtype=out.dtype)
    (out * up).sum().backward()
    xr = x.detach().to(F64).requires_grad_()
    (ref_masked_mean(xr, mask, dim) * up.double()).sum().backward()
    assert x.grad.dtype == dtype
    t = tol(dtype) if dtype != torch.bfloat16 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(x.grad.double(), xr.grad, **t)
    assert torch.all(x.grad[~mask] == 0)


def test_masked_mean_gradcheck():
    g = gen(43)
    x = torch.randn(4, 6, generator=g, dtype=F64, requires_grad=True)
    mask = torch.rand(4, 6, generator=g) < 0.5
    mask[:, 0] = True
    mask[0, :] = True
    for dim in (None, 0, 1, -2):
        assert torch.autograd.gradcheck(lambda a: masked_mean(a, mask, dim=dim), (x,))
    assert torch.autograd.gradcheck(lambda a: masked_mean(a, mask.float(), dim=1), (x,))


def test_opcheck():
    x, mask = make_inputs((4, 6), torch.float32, 44)
    mask[:, 0] = True
    xg = x.clone().requires_grad_()
    for dim in (None, 0, -1):
        torch.library.opcheck(OP_MEAN, (xg, mask, dim))
    torch.library.opcheck(OP_MEAN, (x.double().t().requires_grad_(), mask.t().float(), 1))
    torch.library.opcheck(OP_MEAN, (x.bfloat16().requires_grad_(), mask, None))
    for unbiased in (True, False):
        torch.library.opcheck(OP_VAR, (x, mask, unbiased))
        torch.library.opcheck(OP_VAR, (x.half().t(), mask.long().t(), unbiased))
        torch.library.opcheck(OP_WHITEN, (x, mask, True, unbiased, 1e-8))
        torch.library.opcheck(OP_WHITEN, (x.double().t(), mask.t(), False, unbiased, 0.1))


# ---------------------------------------------------------------------------------- errors


def test_error_all_masked():
    x, _ = make_inputs((3, 4), torch.float32, 50)
    none = torch.zeros(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask"):
        masked_mean(x, none)
    with pytest.raises(ValueError, match="mask"):
        masked_var(x, none, unbiased=False)
    with pytest.raises(ValueError, match="mask"):
        masked_var(x, none)
    for shift_mean in (True, False):
        with pytest.raises(ValueError, match="mask"):
            masked_whiten(x, none.float(), shift_mean=shift_mean, unbiased=False)
    # an empty tensor selects nothing either
    with pytest.raises(ValueError, match="mask"):
        masked_mean(torch.zeros(0), torch.zeros(0, dtype=torch.bool))


def test_error_all_masked_slice_along_dim():
    x, _ = make_inputs((3, 4), torch.float32, 51)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match="masked"):
        masked_mean(x, mask, dim=1)
    # along the other dim every slice has a valid element: fine
    masked_mean(x, mask, dim=0)


def test_error_unbiased_with_one_element():
    x, _ = make_inputs((3, 4), torch.float32, 52)
    one = torch.zeros(3, 4, dtype=torch.bool)
    one[2, 1] = True
    with pytest.raises(ValueError, match="unbiased"):
        masked_var(x, one)
    with pytest.raises(ValueError, match="unbiased"):
        masked_whiten(x, one)
    # biased with one element: var 0; whitening needs eps > 0 then
    assert masked_var(x, one, unbiased=False) == 0
    out = masked_whiten(x, one, unbiased=False, eps=1e-8)
    assert out[2, 1] == 0 and torch.all(out == 0)


def test_error_zero_variance_without_eps():
    x = torch.full((10,), 2.5)
    mask = torch.ones(10, dtype=torch.bool)
    with pytest.raises(ValueError, match="eps|variance"):
        masked_whiten(x, mask, eps=0.0)
    out = masked_whiten(x, mask, eps=1e-8)
    assert torch.all(out == 0)


@pytest.mark.parametrize("eps", [-1e-8, float("nan"), float("inf")])
def test_error_eps(eps):
    x, mask = make_inputs((10,), torch.float32, 53)
    with pytest.raises(ValueError, match="eps"):
        masked_whiten(x, mask, eps=eps)


def test_error_shape_mismatch():
    x, mask = make_inputs((3, 4), torch.float32, 54)
    for fn in (lambda m: masked_mean(x, m), lambda m: masked_var(x, m), lambda m: masked_whiten(x, m)):
        with pytest.raises(ValueError, match="mask"):
            fn(mask[:, :3])
        with pytest.raises(ValueError, match="mask"):
            fn(mask.reshape(12))


def test_error_dtypes():
    x, mask = make_inputs((3, 4), torch.float32, 55)
    for fn in (masked_mean, masked_var, masked_whiten):
        with pytest.raises(ValueError, match=r"\bx must be"):
            fn(x.long(), mask)
        with pytest.raises(ValueError, match=r"\bx must be"):
            fn(x.bool(), mask)


def test_error_mask_not_zero_one():
    x, mask = make_inputs((3, 4), torch.float32, 56)
    m = mask.float()
    m[0, 1] = 0.5
    for fn in (masked_mean, masked_var, masked_whiten):
        with pytest.raises(ValueError, match="mask"):
            fn(x, m)
        with pytest.raises(ValueError, match="mask"):
            fn(x, (m * 4).long())


@pytest.mark.parametrize("dim", [2, -3, 100])
def test_error_bad_dim(dim):
    x, mask = make_inputs((3, 4), torch.float32, 57)
    with pytest.raises(ValueError, match=r"pyppo.masked_mean: dim must be in \[-2, 1\] for a 2-d x"):
        masked_mean(x, mask, dim=dim)


def test_second_derivative_is_an_error_not_silent_zeros():
    x, _ = make_inputs((3, 4), F64, 58)
    mask = random_mask(3, 4, gen(59))
    mask[:, 0] = True
    x.requires_grad_()
    for dim in (None, 1):
        (g,) = torch.autograd.grad(masked_mean(x, mask, dim=dim).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="first derivatives only"):
            g.sum().backward()
    # a Hessian-vector product through a nonlinear function of x reaches the mean's gradient too
    (g,) = torch.autograd.grad(masked_mean(x * x, mask), x, create_graph=True)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        g.sum().backward()


# ------------------------------------------------------------------------ on every device


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7,), (13, 37), (64, 4100)], ids=lambda s: "x".join(map(str, s)))
def test_device_values_match_reference(device, dtype, shape):
    x, mask = make_inputs(shape, dtype, 91 + len(shape), p_valid=0.7)
    xd, md = x.to(device), mask.to(device)
    for unbiased in (True, False):
        got = masked_var(xd, md, unbiased)
        assert got.device.type == device
        torch.testing.assert_close(got.cpu().to(F64), ref_masked_var(x, mask, unbiased), **tol(dtype))
    torch.testing.assert_close(masked_mean(xd, md).cpu().to(F64), ref_masked_mean(x, mask), **tol(dtype))
    for shift in (True, False):
        torch.testing.assert_close(
            masked_whiten(xd, md, shift_mean=shift).cpu().to(F64),
            ref_masked_whiten(x, mask, shift_mean=shift),
            **tol(dtype, 5),
        )
    if len(shape) == 2:
        mask[:, 0] = True
        md = mask.to(device)
        for d in (0, 1, -1):
            torch.testing.assert_close(
                masked_mean(xd, md, dim=d).cpu().to(F64), ref_masked_mean(x, mask, d), **tol(dtype)
            )
    # the same bits again
    assert bits_equal(masked_whiten(xd, md), masked_whiten(xd, md))
    assert bits_equal(masked_var(xd, md), masked_var(xd, md))


def test_device_masked_mean_gradient(device):
    g = gen(95)
    x = torch.randn(4, 9, generator=g)
    mask = random_mask(4, 9, g)
    xd = x.clone().to(device).requires_grad_()
    masked_mean(xd, mask.to(device)).backward()
    xr = x.to(F64).clone().requires_grad_()
    ref_masked_mean(xr, mask).backward()
    torch.testing.assert_close(xd.grad.cpu().to(F64), xr.grad, **tol(torch.float32))


def _bad_cases():
    x, mask = make_inputs((3, 4), torch.float32, 60)
    return {
        "mean_dim_high": (lambda a, m: masked_mean(a, m, dim=2), x, mask),
        "mean_dim_low": (lambda a, m: masked_mean(a, m, dim=-3), x, mask),
        "mean_dim_0d": (lambda a, m: masked_mean(a, m, dim=0), x[0, 0], mask[0, 0]),
        "mean_empty_dim": (lambda a, m: masked_mean(a, m, dim=1), x[:, :0], mask[:, :0]),
        "mean_mask_shape": (lambda a, m: masked_mean(a, m), x, mask[:, :3]),
        "var_dtype": (lambda a, m: masked_var(a, m), x.long(), mask),
        "var_mask_dtype": (lambda a, m: masked_var(a, m), x, mask.to(torch.complex64)),
        "whiten_eps": (lambda a, m: masked_whiten(a, m, eps=-1.0), x, mask),
        "whiten_mask_shape": (lambda a, m: masked_whiten(a, m), x, mask.reshape(12)),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_errors_are_the_same_on_every_path(path, case):
    fn, *args = _bad_cases()[case]
    assert_same_error(path, fn, *args)


def test_data_errors_are_the_same_on_every_device(device):
    x = torch.randn(3, 4)
    none = torch.zeros(3, 4, dtype=torch.bool)
    one = none.clone()
    one[1, 2] = True
    const = torch.ones(3, 4)
    full = torch.ones(3, 4, dtype=torch.bool)
    for fn in (masked_mean, masked_var, masked_whiten):
        assert_same_error(device, fn, x, none)
        assert_same_error(device, fn, x, full * 0.5)
    assert_same_error(device, masked_var, x, one)
    assert_same_error(device, masked_whiten, x, one)
    assert_same_error(device, lambda a, m: masked_whiten(a, m, eps=0.0), const, full)
    assert_same_error(device, lambda a, m: masked_mean(a, m, dim=1), x, none)


@pytest.mark.parametrize("path", ["meta", "fake"])
def test_traced_masked_mean_shapes(path):
    x, mask = make_inputs((3, 4, 5), torch.bfloat16, 61)
    for dim, shape in ((None, ()), (0, (4, 5)), (1, (3, 5)), (-1, (3, 4)), (-3, (4, 5))):
        out = call_on(path, lambda a, m: masked_mean(a, m, dim=dim), x, mask)
        assert tuple(out.shape) == shape and out.dtype == torch.float32
    assert call_on(path, masked_whiten, x.double(), mask).dtype == F64


def test_device_opcheck(device):
    g = gen(101)
    lp = torch.randn(2, 3, generator=g).to(device)
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    torch.library.opcheck(OP_MEAN, (lp.clone().requires_grad_(), mask, None))
    torch.library.opcheck(OP_MEAN, (lp, mask, 1))
    torch.library.opcheck(OP_VAR, (lp, mask, True))
    torch.library.opcheck(OP_WHITEN, (lp, mask, True, True, 1e-8))
