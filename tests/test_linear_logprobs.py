"""linear_logprobs against the eager float64 path: values, gradients, opcheck, errors."""

import pytest
import torch

from pyppo import ops


def _eager(hidden, weight, labels, mask, bias, temperature, ignore_index=-100):
    h, w = hidden.double(), weight.double()
    logits = h @ w.T + (bias.double() if bias is not None else 0.0)
    ls = torch.log_softmax(logits / temperature, -1)
    valid = labels != ignore_index
    if mask is not None:
        valid = valid & mask.bool()
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lp = ls.gather(-1, safe[..., None])[..., 0] * valid
    ent = -(ls.exp() * ls).sum(-1) * valid
    return lp, ent


def _inputs(seed, shape=(3, 7), H=12, V=301, dtype=torch.float32, with_bias=True):
    g = torch.Generator().manual_seed(seed)
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
def test_values_and_grads_match_float64_eager(chunk_size, temperature):
    hidden, weight, labels, mask, bias = _inputs(seed=int(temperature * 10) + (chunk_size or 0))
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    lp, ent = ops.linear_logprobs(h, w, labels, mask, bias=b, temperature=temperature, return_entropy=True,
                                  chunk_size=chunk_size)
    (lp * 1.3 + ent * 0.4).sum().backward()

    hd, wd, bd = (t.double().requires_grad_() for t in (hidden, weight, bias))
    lp_ref, ent_ref = _eager(hd, wd, labels, mask, bd, temperature)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_inputs(dtype):
    hidden, weight, labels, mask, bias = _inputs(seed=11, dtype=dtype)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp = ops.linear_logprobs(h, w, labels, mask, bias=bias, chunk_size=4)
    lp.sum().backward()
    lp_ref, _ = _eager(hidden, weight, labels, mask, bias, 1.0)
    assert lp.dtype == torch.float32
    # The chunk GEMM runs in the input precision, as the model's own lm_head would.
    torch.testing.assert_close(lp.double(), lp_ref, rtol=0.05, atol=0.1)
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    assert torch.isfinite(h.grad.float()).all() and torch.isfinite(w.grad.float()).all()


def test_gradcheck_float64():
    hidden, weight, labels, mask, bias = _inputs(seed=5, shape=(2, 3), H=4, V=9)
    args = [t.double().requires_grad_() for t in (hidden, weight, bias)]

    def f(h, w, b):
        lp, ent = ops.linear_logprobs(h, w, labels, mask, bias=b, temperature=0.7, return_entropy=True,
                                      chunk_size=2)
        return lp, ent

    assert torch.autograd.gradcheck(f, args)


def test_opcheck():
    hidden, weight, labels, mask, bias = _inputs(seed=6, shape=(2, 5), H=8, V=33)
    args = (hidden.requires_grad_(), weight.requires_grad_(), labels, mask, bias.requires_grad_(), 0.9, -100, True, 3)
    torch.library.opcheck(torch.ops.pyppo.linear_logprobs.default, args)


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
