"""The CUDA kernels against the CPU kernels and float64 references (needs a CUDA device).

Skipped cleanly when torch has no usable CUDA device or pyppo was built without CUDA
(`pyppo._C.with_cuda`). Run on a GPU machine with `pytest -m cuda` (benchmarks/gpu_check.sh).

What is checked, op by op: values against the CPU kernel and an independent float64
reference, for float32 / bfloat16 / float16 (and float64) inputs, masks with holes, non-
contiguous inputs; gradients; the CPU kernels' error messages, word for word; determinism
(bitwise, call after call) and batch invariance (a row's bits do not depend on the other rows,
nor on the row's alignment in memory); torch.library.opcheck.
"""

from __future__ import annotations

import pytest
import torch

pyppo = pytest.importorskip("pyppo", reason="pyppo is not built")

_HAS_CUDA = torch.cuda.is_available() and bool(getattr(pyppo._C, "with_cuda", False))
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not _HAS_CUDA,
        reason="needs a CUDA device and pyppo built with CUDA (torch.cuda.is_available() and pyppo._C.with_cuda)",
    ),
]

from pyppo.ops import gae, gather_logprobs, kl_penalty, masked_mean, masked_var, masked_whiten, shape_rewards  # noqa: E402

F64 = torch.float64
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
DEV = "cuda"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def out_dtype(dt):
    return F64 if dt == F64 else torch.float32


def holes_mask(B, T, g, p_valid=0.75):
    """Random 0/1 mask with holes in the middle of rows, every row keeping >= 1 valid position."""
    m = torch.rand(B, T, generator=g) < p_valid
    m[:, 0] = True
    return m


# Tolerances against float64 references (the inputs are rounded to their dtype first, so the
# reference is exact on the same numbers: only the float32 accumulation differs).
def tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == F64 else dict(rtol=1e-5, atol=1e-4)


def grad_tol(dtype):
    return {
        F64: dict(rtol=1e-10, atol=1e-12),
        torch.float32: dict(rtol=1e-4, atol=1e-6),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1e-4),
        torch.float16: dict(rtol=2e-3, atol=1e-5),
    }[dtype]


def bits_equal(a, b):
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is compared too
        return type(e), str(e).split("\n")[0]
    return None


def same_error(cpu_fn, cuda_fn):
    ec, eg = error_of(cpu_fn), error_of(cuda_fn)
    assert ec is not None, "the CPU kernel raised nothing"
    assert eg == ec, f"CUDA error {eg} differs from CPU error {ec}"


# ------------------------------------------------------------------------------------------
# float64 references
# ------------------------------------------------------------------------------------------


def ref_gather(logits, labels, mask=None, temperature=1.0, ignore_index=-100):
    z = logits.to(F64) / temperature
    valid = labels != ignore_index
    if mask is not None:
        valid = valid & (mask != 0)
    lse = torch.logsumexp(z, dim=-1)
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lp = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1) - lse
    logp = z - lse.unsqueeze(-1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    zero = torch.zeros_like(lp)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def ref_gae(rewards, values, mask, gamma, lam, last_values=None):
    r, v, m = rewards.to(F64).cpu(), values.to(F64).cpu(), mask.bool().cpu()
    B, T = r.shape
    rl, vl, ml = r.tolist(), v.tolist(), m.tolist()
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        nv = float(last_values[b]) if last_values is not None else 0.0
        na = 0.0
        for t in range(T - 1, -1, -1):
            if not ml[b][t]:
                continue
            delta = rl[b][t] + gamma * nv - vl[b][t]
            na = delta + gamma * lam * na
            nv = vl[b][t]
            adv[b][t] = na
    adv = torch.tensor(adv, dtype=F64).reshape(B, T)
    ret = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv, ret


def ref_kl(lp, ref, est):
    d = lp.to(F64) - ref.to(F64)
    return {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1, "abs": d.abs()}[est]


# ------------------------------------------------------------------------------------------
# gather_logprobs
# ------------------------------------------------------------------------------------------

GATHER_SHAPES = [(2, 3, 7), (3, 5, 4096), (2, 4, 4099), (1, 3, 32771)]


def _gather_inputs(B, T, V, dtype, seed, ignore=True):
    g = gen(seed)
    logits = (torch.randn(B, T, V, generator=g, dtype=F64) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = holes_mask(B, T, g)
    if ignore:
        labels[0, -1] = -100
    return logits, labels, mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GATHER_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gather_forward_matches_cpu_and_reference(dtype, shape, temperature):
    logits, labels, mask = _gather_inputs(*shape, dtype, seed=sum(shape))
    lp_c, ent_c = gather_logprobs(logits, labels, mask, temperature=temperature, return_entropy=True)
    lp_g, ent_g = gather_logprobs(logits.to(DEV), labels.to(DEV), mask.to(DEV), temperature=temperature, return_entropy=True)
    assert lp_g.device.type == "cuda" and lp_g.dtype == out_dtype(dtype) and ent_g.dtype == out_dtype(dtype)
    lp_r, ent_r = ref_gather(logits, labels, mask, temperature)
    torch.testing.assert_close(lp_g.cpu().to(F64), lp_r, **tol(dtype))
    torch.testing.assert_close(ent_g.cpu().to(F64), ent_r, **tol(dtype))
    torch.testing.assert_close(lp_g.cpu(), lp_c, **tol(dtype))
    torch.testing.assert_close(ent_g.cpu(), ent_c, **tol(dtype))
    invalid = ~(mask & (labels != -100))
    assert (lp_g.cpu()[invalid] == 0).all() and (ent_g.cpu()[invalid] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gather_noncontiguous_inputs(dtype):
    logits, labels, mask = _gather_inputs(3, 4, 1000, dtype, seed=5)
    big = torch.zeros(3, 4, 1003, dtype=dtype)
    big[..., 1:1001] = logits
    sliced = big.to(DEV)[..., 1:1001]  # unit stride along V, rows 1003 apart, misaligned start
    transposed = logits.transpose(0, 1).contiguous().transpose(0, 1).to(DEV)  # [3, 4, V] with odd strides
    expect = gather_logprobs(logits, labels, mask)
    for x in (sliced, transposed):
        got = gather_logprobs(x, labels.to(DEV), mask.to(DEV))
        torch.testing.assert_close(got.cpu(), expect, **tol(dtype))


def test_gather_int_mask_and_int32_labels():
    logits, labels, mask = _gather_inputs(2, 6, 300, torch.float32, seed=6)
    a = gather_logprobs(logits.to(DEV), labels.to(DEV), mask.to(DEV))
    b = gather_logprobs(logits.to(DEV), labels.int().to(DEV), mask.long().to(DEV))
    assert bits_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gather_backward_matches_reference_and_cpu(dtype, with_entropy):
    B, T, V = 3, 4, 4099
    logits, labels, mask = _gather_inputs(B, T, V, dtype, seed=11)
    g = gen(12)
    up_lp = torch.randn(B, T, generator=g, dtype=F64)
    up_ent = torch.randn(B, T, generator=g, dtype=F64)

    def run(device):
        x = logits.detach().clone().to(device).requires_grad_()
        lp, ent = gather_logprobs(x, labels.to(device), mask.to(device), temperature=0.9, return_entropy=True)
        loss = (lp.to(F64) * up_lp.to(device)).sum()
        if with_entropy:
            loss = loss + (ent.to(F64) * up_ent.to(device)).sum()
        loss.backward()
        return x.grad

    g_cuda, g_cpu = run(DEV), run("cpu")
    assert g_cuda.dtype == dtype and g_cuda.shape == logits.shape
    xr = logits.detach().to(F64).clone().requires_grad_()
    lp_r, ent_r = ref_gather(xr, labels, mask, 0.9)
    loss = (lp_r * up_lp).sum() + ((ent_r * up_ent).sum() if with_entropy else 0)
    loss.backward()
    torch.testing.assert_close(g_cuda.cpu().to(F64), xr.grad, **grad_tol(dtype))
    torch.testing.assert_close(g_cuda.cpu().to(F64), g_cpu.to(F64), **grad_tol(dtype))
    invalid = ~(mask & (labels != -100))
    assert (g_cuda.cpu()[invalid] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gather_deterministic_and_batch_invariant(dtype):
    # V = 4099: rows of 4099 elements are not 16-byte aligned in turn, so the same row takes the
    # vector path in one batch and the element-by-element path in another: same bits required.
    logits, labels, mask = _gather_inputs(4, 5, 4099, dtype, seed=21, ignore=False)
    x, y, m = logits.to(DEV).reshape(20, -1), labels.to(DEV).reshape(20), mask.to(DEV).reshape(20)
    full = gather_logprobs(x, y, m, temperature=0.8, return_entropy=True)
    again = gather_logprobs(x, y, m, temperature=0.8, return_entropy=True)
    assert bits_equal(full[0], again[0]) and bits_equal(full[1], again[1])
    shifted = gather_logprobs(x[1:].contiguous(), y[1:], m[1:], temperature=0.8, return_entropy=True)
    assert bits_equal(full[0][1:], shifted[0]) and bits_equal(full[1][1:], shifted[1])
    for i in (0, 7, 19):
        alone = gather_logprobs(x[i : i + 1].clone(), y[i : i + 1], m[i : i + 1], temperature=0.8, return_entropy=True)
        assert bits_equal(full[0][i : i + 1], alone[0]) and bits_equal(full[1][i : i + 1], alone[1])
    # The log-probs do not depend on whether the entropy is asked for.
    no_ent = gather_logprobs(x, y, m, temperature=0.8)
    assert bits_equal(no_ent, full[0])
    # Backward: same bits twice.
    up = torch.randn(20, generator=gen(22)).to(DEV)

    def bwd():
        xx = x.clone().requires_grad_()
        lp, ent = gather_logprobs(xx, y, m, temperature=0.8, return_entropy=True)
        ((lp + 0.1 * ent) * up).sum().backward()
        return xx.grad

    assert bits_equal(bwd(), bwd())


def test_gather_nonfinite_rows_are_isolated():
    logits, labels, mask = _gather_inputs(1, 6, 700, torch.float32, seed=31, ignore=False)
    mask[:] = True
    logits[0, 1, 5] = float("nan")
    logits[0, 2, 9] = float("inf")
    logits[0, 3, :] = float("-inf")
    logits[0, 4, :350] = float("-inf")  # half the row (several whole chunks) -inf
    lp_c, ent_c = gather_logprobs(logits, labels, mask, return_entropy=True)
    lp_g, ent_g = gather_logprobs(logits.to(DEV), labels.to(DEV), mask.to(DEV), return_entropy=True)
    for a, b in ((lp_g.cpu(), lp_c), (ent_g.cpu(), ent_c)):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        finite = torch.isfinite(b)
        torch.testing.assert_close(a[finite], b[finite], rtol=1e-5, atol=1e-4)
    assert torch.isfinite(lp_g[0, 0]) and torch.isfinite(lp_g[0, 5])


def test_gather_errors_match_cpu():
    logits, labels, mask = _gather_inputs(2, 3, 50, torch.float32, seed=41, ignore=False)
    bad = labels.clone()
    bad[1, 2] = 50
    bad[0, 1] = -7
    mask[0, 1] = False  # masked: -7 is fine there; [1, 2] = 50 is the first unmasked bad label
    mask[1, 2] = True
    same_error(lambda: gather_logprobs(logits, bad, mask), lambda: gather_logprobs(logits.to(DEV), bad.to(DEV), mask.to(DEV)))
    same_error(
        lambda: gather_logprobs(logits, labels, temperature=0.0),
        lambda: gather_logprobs(logits.to(DEV), labels.to(DEV), temperature=0.0),
    )
    same_error(
        lambda: gather_logprobs(logits, labels[:, :2]), lambda: gather_logprobs(logits.to(DEV), labels[:, :2].to(DEV))
    )
    same_error(
        lambda: gather_logprobs(logits, labels, mask.float() * 0.5),
        lambda: gather_logprobs(logits.to(DEV), labels.to(DEV), (mask.float() * 0.5).to(DEV)),
    )
    with pytest.raises(RuntimeError, match="device"):
        gather_logprobs(logits.to(DEV), labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_logprobs_on_cuda_matches_cpu(dtype):
    # linear_logprobs is device-generic C++ (cuBLAS GEMMs + the gather_logprobs kernels).
    from pyppo.ops import linear_logprobs

    g = gen(45)
    N, H, V = 37, 64, 1003
    hidden = (torch.randn(N, H, generator=g, dtype=F64)).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=F64) * 0.2).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    mask = holes_mask(1, N, g)[0]
    up = torch.randn(N, generator=g)

    def run(device):
        h = hidden.detach().clone().to(device).requires_grad_()
        w = weight.detach().clone().to(device).requires_grad_()
        lp, ent = linear_logprobs(h, w, labels.to(device), mask.to(device), return_entropy=True, chunk_size=8)
        ((lp + 0.1 * ent) * up.to(device)).sum().backward()
        return lp.detach().cpu(), ent.detach().cpu(), h.grad.cpu(), w.grad.cpu()

    got, expect = run(DEV), run("cpu")
    t = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for a, b in zip(got, expect):
        torch.testing.assert_close(a.float(), b.float(), **t)


# ------------------------------------------------------------------------------------------
# kl_penalty, shape_rewards
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("est", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("clamp", [None, (-0.5, 2.0)], ids=["noclamp", "clamp"])
def test_kl_penalty_matches_cpu_and_reference(dtype, est, clamp):
    g = gen(51)
    lp = (torch.randn(6, 33, generator=g, dtype=F64) - 2).to(dtype)
    ref = (torch.randn(6, 33, generator=g, dtype=F64) - 2).to(dtype)
    lp[0, 0], ref[0, 0] = -1.0, 95.0  # k3's exponent past the bound
    kc = kl_penalty(lp, ref, estimator=est, clamp=clamp)
    kg = kl_penalty(lp.to(DEV), ref.to(DEV), estimator=est, clamp=clamp)
    assert kg.dtype == out_dtype(dtype)
    torch.testing.assert_close(kg.cpu(), kc, rtol=1e-6 if dtype != F64 else 1e-12, atol=1e-6 if dtype != F64 else 1e-12)
    r = ref_kl(lp, ref, est)
    if clamp is not None:
        r = r.clamp(*clamp)
    fin = torch.isfinite(r)
    fin[0, 0] = False  # k3 past its exp bound: the kernels give +inf (or the clamp) by design
    torch.testing.assert_close(kg.cpu().to(F64)[fin], r[fin], **tol(dtype))
    # gradient w.r.t. logprobs against the CPU kernel's
    up = torch.randn(6, 33, generator=g)
    up[1, 1] = 0.0
    xg = lp.to(DEV).requires_grad_()
    (kl_penalty(xg, ref.to(DEV), estimator=est, clamp=clamp).to(F64) * up.to(F64).to(DEV)).sum().backward()
    xc = lp.clone().requires_grad_()
    (kl_penalty(xc, ref, estimator=est, clamp=clamp).to(F64) * up.to(F64)).sum().backward()
    assert xg.grad.dtype == dtype
    assert not torch.isnan(xg.grad).any()
    torch.testing.assert_close(xg.grad.cpu(), xc.grad, equal_nan=True, **grad_tol(dtype))


def test_kl_penalty_errors_match_cpu():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    same_error(lambda: kl_penalty(a, b, estimator="k9"), lambda: kl_penalty(a.to(DEV), b.to(DEV), estimator="k9"))
    same_error(lambda: kl_penalty(a, b[:, :3]), lambda: kl_penalty(a.to(DEV), b[:, :3].to(DEV)))
    same_error(lambda: kl_penalty(a, b, clamp=(1.0, 0.0)), lambda: kl_penalty(a.to(DEV), b.to(DEV), clamp=(1.0, 0.0)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("score_clip", [None, 0.5])
def test_shape_rewards_matches_cpu(dtype, score_clip):
    g = gen(61)
    B, T = 7, 300
    lp = (torch.randn(B, T, generator=g, dtype=F64) - 2).to(dtype)
    ref = (torch.randn(B, T, generator=g, dtype=F64) - 2).to(dtype)
    mask = holes_mask(B, T, g)
    mask[2, 1:] = False  # only the first position valid
    mask[3, -1] = True
    scores = torch.randn(B, generator=g, dtype=F64).to(dtype)
    args = dict(kl_coef=0.05, estimator="k3", score_clip=score_clip)
    rc, kc = shape_rewards(scores, lp, ref, mask, **args)
    rg, kg = shape_rewards(scores.to(DEV), lp.to(DEV), ref.to(DEV), mask.to(DEV), **args)
    assert rg.dtype == out_dtype(dtype) and kg.dtype == out_dtype(dtype)
    t = dict(rtol=1e-6, atol=1e-6) if dtype != F64 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rg.cpu(), rc, **t)
    torch.testing.assert_close(kg.cpu(), kc, **t)
    # independent reference: -coef * k3 on valid positions, the (clipped) score at the last one
    k = ref_kl(lp, ref, "k3") * mask
    rew = -0.05 * k
    s = scores.to(F64).clamp(-score_clip, score_clip) if score_clip else scores.to(F64)
    for b in range(B):
        last = int(mask[b].nonzero().max())
        rew[b, last] += s[b]
    torch.testing.assert_close(rg.cpu().to(F64), rew, **tol(dtype))


def test_shape_rewards_errors_match_cpu():
    g = gen(62)
    lp, ref = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    scores = torch.randn(3, generator=g)

    def both(s, m):
        return (
            lambda: shape_rewards(s, lp, ref, m, kl_coef=0.1),
            lambda: shape_rewards(s.to(DEV), lp.to(DEV), ref.to(DEV), m.to(DEV), kl_coef=0.1),
        )

    same_error(*both(scores, mask))
    bad_scores = scores.clone()
    bad_scores[2] = float("inf")
    same_error(*both(bad_scores, torch.ones(3, 5, dtype=torch.bool)))


# ------------------------------------------------------------------------------------------
# gae
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 64, 1023, 1024, 2500], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("bootstrap", [False, True])
def test_gae_matches_cpu_and_reference(dtype, T, bootstrap):
    g = gen(71 + T)
    B = 5
    rewards = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    mask = holes_mask(B, T, g)
    if T > 3:
        mask[1, T // 2 :] = False  # a long masked tail
        mask[2, : T - 2] = False  # only the last two valid
    last = torch.randn(B, generator=g, dtype=F64).to(dtype) if bootstrap else None
    args = dict(gamma=0.99, lam=0.95)
    ac, rc = gae(rewards, values, mask, last_values=last, **args)
    ag, rg = gae(
        rewards.to(DEV), values.to(DEV), mask.to(DEV), last_values=None if last is None else last.to(DEV), **args
    )
    assert ag.dtype == out_dtype(dtype)
    t = dict(rtol=1e-5, atol=2e-5) if dtype != F64 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ag.cpu(), ac, **t)
    torch.testing.assert_close(rg.cpu(), rc, **t)
    ar, rr = ref_gae(rewards, values, mask, 0.99, 0.95, None if last is None else last.to(F64))
    torch.testing.assert_close(ag.cpu().to(F64), ar, **t)
    torch.testing.assert_close(rg.cpu().to(F64), rr, **t)
    assert (ag.cpu()[~mask] == 0).all() and (rg.cpu()[~mask] == 0).all()


@pytest.mark.parametrize("T", [64, 2048])
def test_gae_deterministic_and_batch_invariant(T):
    g = gen(81)
    B = 9
    r, v = torch.randn(B, T, generator=g).to(DEV), torch.randn(B, T, generator=g).to(DEV)
    m = holes_mask(B, T, g).to(DEV)
    a1, r1 = gae(r, v, m, gamma=0.99, lam=0.95)
    a2, r2 = gae(r, v, m, gamma=0.99, lam=0.95)
    assert bits_equal(a1, a2) and bits_equal(r1, r2)
    a3, r3 = gae(r[4:5].clone(), v[4:5].clone(), m[4:5].clone(), gamma=0.99, lam=0.95)
    assert bits_equal(a1[4:5], a3) and bits_equal(r1[4:5], r3)


def test_gae_errors_match_cpu():
    r, v = torch.randn(2, 3), torch.randn(2, 3)
    m = torch.ones(2, 3)
    same_error(lambda: gae(r, v, m, gamma=1.5), lambda: gae(r.to(DEV), v.to(DEV), m.to(DEV), gamma=1.5))
    same_error(lambda: gae(r, v[:, :2], m), lambda: gae(r.to(DEV), v[:, :2].to(DEV), m.to(DEV)))
    same_error(
        lambda: gae(r, v, m, last_values=torch.zeros(3)),
        lambda: gae(r.to(DEV), v.to(DEV), m.to(DEV), last_values=torch.zeros(3, device=DEV)),
    )


# ------------------------------------------------------------------------------------------
# masked_mean / masked_var / masked_whiten
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7,), (13, 37), (64, 4100)], ids=lambda s: "x".join(map(str, s)))
def test_masked_stats_match_cpu(dtype, shape):
    g = gen(91 + len(shape))
    x = (torch.randn(*shape, generator=g, dtype=F64) * 2 + 0.5).to(dtype)
    mask = torch.rand(*shape, generator=g) < 0.7
    mask.view(-1)[:2] = True
    xg, mg = x.to(DEV), mask.to(DEV)
    t = dict(rtol=1e-6, atol=1e-6) if dtype != F64 else dict(rtol=1e-12, atol=1e-12)
    for unbiased in (True, False):
        torch.testing.assert_close(masked_var(xg, mg, unbiased).cpu(), masked_var(x, mask, unbiased), **t)
    torch.testing.assert_close(masked_mean(xg, mg).cpu(), masked_mean(x, mask), **t)
    for shift in (True, False):
        torch.testing.assert_close(
            masked_whiten(xg, mg, shift_mean=shift).cpu(), masked_whiten(x, mask, shift_mean=shift), **t
        )
    xr = x.to(F64)[mask]
    torch.testing.assert_close(masked_mean(xg, mg).cpu().to(F64), xr.mean(), **tol(dtype))
    torch.testing.assert_close(masked_var(xg, mg).cpu().to(F64), xr.var(), **tol(dtype))
    if len(shape) == 2:
        mask[:, 0] = True
        mg = mask.to(DEV)
        for d in (0, 1, -1):
            torch.testing.assert_close(masked_mean(xg, mg, dim=d).cpu(), masked_mean(x, mask, dim=d), **t)
    # determinism: the same bits again
    assert bits_equal(masked_whiten(xg, mg), masked_whiten(xg, mg))
    assert bits_equal(masked_var(xg, mg), masked_var(xg, mg))


def test_masked_mean_gradient():
    g = gen(95)
    x = torch.randn(4, 9, generator=g)
    mask = holes_mask(4, 9, g)
    xg = x.to(DEV).requires_grad_()
    masked_mean(xg, mask.to(DEV)).backward()
    xc = x.clone().requires_grad_()
    masked_mean(xc, mask).backward()
    torch.testing.assert_close(xg.grad.cpu(), xc.grad)


def test_masked_stats_errors_match_cpu():
    x = torch.randn(3, 4)
    none = torch.zeros(3, 4, dtype=torch.bool)
    one = none.clone()
    one[1, 2] = True
    const = torch.ones(3, 4)
    full = torch.ones(3, 4, dtype=torch.bool)
    for fn in (
        lambda x, m: masked_mean(x, m),
        lambda x, m: masked_var(x, m),
        lambda x, m: masked_whiten(x, m),
    ):
        same_error(lambda: fn(x, none), lambda: fn(x.to(DEV), none.to(DEV)))
    same_error(lambda: masked_var(x, one), lambda: masked_var(x.to(DEV), one.to(DEV)))
    same_error(lambda: masked_whiten(x, one), lambda: masked_whiten(x.to(DEV), one.to(DEV)))
    same_error(lambda: masked_whiten(const, full, eps=0.0), lambda: masked_whiten(const.to(DEV), full.to(DEV), eps=0.0))
    same_error(lambda: masked_mean(x, none, dim=1), lambda: masked_mean(x.to(DEV), none.to(DEV), dim=1))


# ------------------------------------------------------------------------------------------
# torch.library.opcheck on CUDA inputs
# ------------------------------------------------------------------------------------------


def _opcheck_cases():
    g = gen(101)
    B, T, V = 2, 3, 37
    logits = torch.randn(B, T, V, generator=g).to(DEV)
    labels = torch.randint(0, V, (B, T), generator=g).to(DEV)
    mask = holes_mask(B, T, g).to(DEV)
    lp, ref = torch.randn(B, T, generator=g).to(DEV), torch.randn(B, T, generator=g).to(DEV)
    scores = torch.randn(B, generator=g).to(DEV)
    ops = torch.ops.pyppo
    return [
        ("gather_logprobs", ops.gather_logprobs.default, (logits.clone().requires_grad_(), labels, mask, 0.9, -100, True)),
        ("gather_logprobs_nograd", ops.gather_logprobs.default, (logits, labels, None, 1.0, -100, False)),
        ("kl_penalty", ops.kl_penalty.default, (lp.clone().requires_grad_(), ref, "k3", -1.0, 5.0)),
        ("shape_rewards", ops.shape_rewards.default, (scores, lp, ref, mask, 0.1, "k1", None)),
        ("gae", ops.gae.default, (lp, ref, mask, 0.99, 0.95, None)),
        ("masked_mean", ops.masked_mean.default, (lp.clone().requires_grad_(), mask, None)),
        ("masked_mean_dim", ops.masked_mean.default, (lp, mask, 1)),
        ("masked_var", ops.masked_var.default, (lp, mask, True)),
        ("masked_whiten", ops.masked_whiten.default, (lp, mask, True, True, 1e-8)),
    ]


@pytest.mark.parametrize("case", range(9))
def test_opcheck(case):
    name, op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


def test_build_reports_archs():
    archs = pyppo._C.cuda_archs
    assert archs, "pyppo._C.cuda_archs is empty in a CUDA build"
    major, minor = torch.cuda.get_device_capability()
    built = []
    for a in archs.split(","):
        num = a.split("+")[0].rstrip("abf")
        bmaj, bmin = (int(v) for v in num.split("."))
        built.append((bmaj, bmin))
    # A cubin for sm_XY runs on sm_XZ with Z >= Y.
    assert any(bmaj == major and bmin <= minor for bmaj, bmin in built), (
        f"pyppo was built for {archs} but this GPU is sm_{major}{minor}; rebuild with TORCH_CUDA_ARCH_LIST"
    )
