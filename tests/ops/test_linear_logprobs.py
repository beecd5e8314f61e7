"""linear_logprobs against the float64 reference: values, gradients, reduced precision, opcheck, errors.

Tests taking ``device`` run on every device present (conftest.py); those taking ``path`` also
through the Meta kernel that torch.compile traces."""

import pytest
import torch

from pyppo import ops
from support.reference import F64, assert_same_error, gen, ref_linear_logprobs, tol

OP = torch.ops.pyppo.linear_logprobs.default


def _inputs(seed, shape=(3, 7), H=12, V=301, dtype=torch.float32, with_bias=True):
    g = gen(seed)
    hidden = torch.randn(*shape, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.1).to(dtype) if with_bias else None
    labels = torch.randint(0, V, shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.3
    mask.view(-1)[0] = False
    labels.view(-1)[1] = -100
    return hidden, weight, labels, mask, bias


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_grads_match_float64_reference(chunk_size, temperature):
    hidden, weight, labels, mask, bias = _inputs(seed=int(temperature * 10) + (chunk_size or 0))
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    lp, ent = ops.linear_logprobs(
        h, w, labels, mask, bias=b, temperature=temperature, return_entropy=True, chunk_size=chunk_size
    )
    (lp * 1.3 + ent * 0.4).sum().backward()

    hd, wd, bd = (t.double().requires_grad_() for t in (hidden, weight, bias))
    lp_ref, ent_ref = ref_linear_logprobs(hd, wd, labels, mask, bias=bd, temperature=temperature)
    (lp_ref * 1.3 + ent_ref * 0.4).sum().backward()

    assert lp.dtype == torch.float32 and lp.shape == labels.shape
    torch.testing.assert_close(lp.double(), lp_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), rtol=1e-5, atol=1e-5)
    assert (lp[~mask] == 0).all() and lp.view(-1)[1] == 0
    for got, ref in ((h.grad, hd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_matches_gather_logprobs_on_materialised_logits():
    hidden, weight, labels, mask, bias = _inputs(seed=3, with_bias=False)
    lp = ops.linear_logprobs(hidden, weight, labels, mask, chunk_size=5)
    lp_full = ops.gather_logprobs(hidden @ weight.T, labels, mask)
    torch.testing.assert_close(lp, lp_full, rtol=1e-6, atol=1e-6)


def _reduced_precision_case(dtype):
    hidden, weight, labels, mask, bias = _inputs(seed=11, dtype=dtype)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp = ops.linear_logprobs(h, w, labels, mask, bias=bias, chunk_size=4)
    lp.sum().backward()
    return (hidden, weight, labels, mask, bias), lp, h, w


def _reduced_precision_reference(dtype, hidden, weight, labels, mask, bias, *, temperature=1.0):
    # The reference rounds the logits where the op does (its GEMM writes them in the inputs'
    # dtype), so what remains between the two is float32 accumulation order: the tolerance of a
    # float32 op.
    lp, _ = ref_linear_logprobs(hidden, weight, labels, mask, bias=bias, temperature=temperature, logits_dtype=dtype)
    return lp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_inputs(dtype):
    inputs, lp, h, w = _reduced_precision_case(dtype)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), _reduced_precision_reference(dtype, *inputs), **tol(torch.float32))
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    assert torch.isfinite(h.grad.float()).all() and torch.isfinite(w.grad.float()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mutation", ["dropped_bias", "temperature_1.05", "temperature_0.99"])
def test_reduced_precision_tolerance_rejects_a_wrong_op(dtype, mutation):
    # The tolerance above must be tight enough to fail an op that dropped the bias or used the
    # wrong temperature: each such reference is outside it.
    (hidden, weight, labels, mask, bias), lp, _, _ = _reduced_precision_case(dtype)
    if mutation == "dropped_bias":
        wrong = _reduced_precision_reference(dtype, hidden, weight, labels, mask, None)
    elif mutation == "temperature_1.05":
        wrong = _reduced_precision_reference(dtype, hidden, weight, labels, mask, bias, temperature=1.05)
    else:
        wrong = _reduced_precision_reference(dtype, hidden, weight, labels, mask, bias, temperature=0.99)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(lp.double(), wrong, **tol(torch.float32))


def test_gradcheck_float64():
    hidden, weight, labels, mask, bias = _inputs(seed=5, shape=(2, 3), H=4, V=9)
    args = [t.double().requires_grad_() for t in (hidden, weight, bias)]

    def f(h, w, b):
        lp, ent = ops.linear_logprobs(h, w, labels, mask, bias=b, temperature=0.7, return_entropy=True, chunk_size=2)
        return lp, ent

    assert torch.autograd.gradcheck(f, args)


def test_second_derivative_is_an_error_not_silent_zeros():
    hidden, weight, labels, mask, bias = _inputs(seed=8, shape=(2, 3), H=4, V=9)
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    for wrt in (h, w):
        (g,) = torch.autograd.grad(ops.linear_logprobs(h, w, labels, mask).sum(), wrt, create_graph=True)
        with pytest.raises(RuntimeError, match="first derivatives only"):
            g.sum().backward()


def test_opcheck():
    hidden, weight, labels, mask, bias = _inputs(seed=6, shape=(2, 5), H=8, V=33)
    args = (hidden.requires_grad_(), weight.requires_grad_(), labels, mask, bias.requires_grad_(), 0.9, -100, True, 3)
    torch.library.opcheck(OP, args)


def test_bad_inputs_name_the_argument():
    hidden, weight, labels, mask, bias = _inputs(seed=7)
    with pytest.raises(ValueError, match="weight"):
        ops.linear_logprobs(hidden, weight[:, :5], labels)
    with pytest.raises(ValueError, match="labels"):
        ops.linear_logprobs(hidden, weight, labels[:, :3])
    with pytest.raises(ValueError, match="bias"):
        ops.linear_logprobs(hidden, weight, labels, bias=bias[:10])
    with pytest.raises(ValueError, match="chunk_size"):
        ops.linear_logprobs(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        ops.linear_logprobs(hidden, weight, labels, temperature=0.0)
    bad = labels.clone()
    bad[0, 3] = weight.shape[0]
    with pytest.raises(ValueError, match="labels"):
        ops.linear_logprobs(hidden, weight, bad)
    m = torch.ones_like(mask)
    m[0, 3] = False
    assert ops.linear_logprobs(hidden, weight, bad, m)[0, 3] == 0  # a masked bad label is fine


# ------------------------------------------------------------------------ on every device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_device_values_and_grads_match_reference(device, dtype):
    # Device-generic C++ (BLAS / cuBLAS GEMMs and the device's gather_logprobs kernels).
    g = gen(45)
    N, H, V = 37, 64, 1003
    hidden = torch.randn(N, H, generator=g, dtype=F64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=F64) * 0.2).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    mask = torch.rand(N, generator=g) < 0.75
    mask[0] = True
    up = torch.randn(N, generator=g, dtype=F64)
    h = hidden.detach().clone().to(device).requires_grad_()
    w = weight.detach().clone().to(device).requires_grad_()
    lp, ent = ops.linear_logprobs(h, w, labels.to(device), mask.to(device), return_entropy=True, chunk_size=8)
    ((lp.to(F64) + 0.1 * ent.to(F64)) * up.to(device)).sum().backward()
    hr, wr = hidden.to(F64).requires_grad_(), weight.to(F64).requires_grad_()
    lp_r, ent_r = ref_linear_logprobs(hr, wr, labels, mask, logits_dtype=dtype)
    ((lp_r + 0.1 * ent_r) * up).sum().backward()
    # bf16: the logits are rounded to bf16 by the GEMM; a rounding that lands the other way on
    # another device's accumulation order moves a log-prob by up to an ulp of its logit.
    t = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for got, ref in ((lp, lp_r), (ent, ent_r), (h.grad, hr.grad), (w.grad, wr.grad)):
        torch.testing.assert_close(got.detach().cpu().to(F64), ref.detach(), **t)


def _bad_cases():
    hidden, weight, labels, mask, bias = _inputs(seed=9)
    call = lambda h, w, y: ops.linear_logprobs(h, w, y)  # noqa: E731
    return {
        "weight_shape": (call, hidden, weight[:, :5], labels),
        "weight_dtype": (call, hidden, weight.double(), labels),
        "labels_shape": (call, hidden, weight, labels[:, :3]),
        "bias_shape": (lambda h, w, y, b: ops.linear_logprobs(h, w, y, bias=b), hidden, weight, labels, bias[:10]),
        "temperature": (lambda h, w, y: ops.linear_logprobs(h, w, y, temperature=-1.0), hidden, weight, labels),
        "chunk_size": (lambda h, w, y: OP(h, w, y, None, None, 1.0, -100, False, -2), hidden, weight, labels),
        "empty_vocab": (call, hidden, weight[:0], labels),
        "mask_shape": (lambda h, w, y, m: ops.linear_logprobs(h, w, y, m), hidden, weight, labels, mask[:2]),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_errors_are_the_same_on_every_path(path, case):
    fn, *args = _bad_cases()[case]
    assert_same_error(path, fn, *args)


def test_label_errors_are_the_same_on_every_device(device):
    # Checked once over all tokens (the index is the label's in the whole input, whichever chunk
    # holds it), forward and backward, however many chunks there are.
    hidden, weight, labels, mask, _ = _inputs(seed=11)
    bad = labels.clone()
    bad[2, 5] = 301
    mask[2, 5] = True
    for chunk in (0, 1, 4):
        assert_same_error(
            device, lambda h, w, y, m: OP(h, w, y, m, None, 1.0, -100, True, chunk), hidden, weight, bad, mask
        )
    lp, ent, lse = OP(hidden, weight, labels, mask, None, 1.0, -100, True, 4)
    bwd = torch.ops.pyppo.linear_logprobs_backward.default
    assert_same_error(
        device,
        lambda g, h, w, y, m, l: bwd(g, None, h, w, y, m, None, l, None, 1.0, -100, 4, [True, True, False]),
        torch.ones_like(lp),
        hidden,
        weight,
        bad,
        mask,
        lse,
    )


def test_device_opcheck(device):
    hidden, weight, labels, mask, bias = (t.to(device) for t in _inputs(seed=10, shape=(2, 5), H=8, V=33))
    torch.library.opcheck(
        OP, (hidden.requires_grad_(), weight.requires_grad_(), labels, mask, None, 1.0, -100, False, 0)
    )


def test_raw_logsumexp_output_is_not_differentiable():
    hidden = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (6,))
    logprobs, entropy, lse = torch.ops.pyppo.linear_logprobs.default(
        hidden, weight, labels, None, None, 1.0, -100, True, 4
    )
    assert logprobs.requires_grad and entropy.requires_grad
    assert not lse.requires_grad and lse.grad_fn is None
    torch.testing.assert_close(lse, torch.logsumexp(hidden.detach() @ weight.detach().T, -1))
