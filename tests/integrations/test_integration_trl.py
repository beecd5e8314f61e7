"""pyppo.integrations.trl against the real TRL 1.16.0 functions: values, dtypes, masked positions,
gradients (top-K included), errors, and patch()/unpatch().

Every comparison runs TRL's own function (captured before any patching; on CPU TRL takes its
torch path, its Triton kernel being CUDA-only) and the adapter on the same fresh inputs.
Tolerances: float32 rounding against the peer for float32/float64 logits. For bf16/fp16 logits
TRL divides by the temperature and takes ``log_softmax`` in the input dtype, so both are compared
against float64 math on the same logits, and pyppo must be at least as close (or within one
rounding of the output dtype). These tests skip when TRL is not installed.
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyppo.integrations.trl as ptrl
from pyppo.integrations import PeerVersionWarning, _patching
from support.peer_support import import_peer, pyppo_ops_called

F64 = torch.float64
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
NAMES = ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy")
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.fixture(scope="module")
def peer():
    """TRL's own functions, captured unpatched."""
    utils = import_peer("trl.trainer.utils")
    assert _patching.active(ptrl.PEER) is None, "a previous test left TRL patched"
    return SimpleNamespace(**{n: getattr(utils, n) for n in NAMES})


@pytest.fixture(scope="module", autouse=True)
def _always_unpatch():
    yield
    ptrl.unpatch()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x``'s values (differentiably) in a non-contiguous layout of the same shape."""
    if how == "transposed":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if how == "sliced":  # row stride > V
        return torch.cat([x, torch.zeros(*x.shape[:-1], 3, dtype=x.dtype)], -1)[..., : x.shape[-1]]
    if how == "strided":  # stride 2 along V
        return torch.stack([x, torch.zeros_like(x)], -1).flatten(-2)[..., ::2]
    return x


def make_row_mask(shape, g, kind):
    if kind is None:
        return None
    m = torch.rand(shape, generator=g) < 0.6
    m.view(-1)[0] = True
    if shape[0] >= 2:
        m[1] = False  # a fully masked row
    if kind == "bool":
        return m
    if kind == "long":
        return m.long()
    if kind == "float":
        return m.float()
    return m.float() * torch.where(torch.rand(shape, generator=g) < 0.5, 0.5, 2.0)  # TRL keeps any non-zero


def ref_log_softmax(z64):
    return z64 - torch.logsumexp(z64, dim=-1, keepdim=True)


def ref_entropy(z64):
    logp = ref_log_softmax(z64)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


def assert_at_least_as_close(ours, theirs, ref, dtype, *, scale=1.0):
    """pyppo within one rounding of ``dtype`` of the float64 reference, and no further from it
    than TRL (or within that rounding where TRL happens to be closer)."""
    if ref.numel() == 0:
        return
    ours, theirs = ours.double(), theirs.double()
    floor = ULP[dtype] * scale * max(1.0, ref.abs().max().item())
    err_ours = (ours - ref).abs().max().item()
    err_theirs = (theirs - ref).abs().max().item()
    assert err_ours <= max(err_theirs, floor), (err_ours, err_theirs, floor)
    torch.testing.assert_close(ours, ref, rtol=ULP[dtype] * scale, atol=floor)


def run_both(peer_fn, our_fn, z, how, *args, **kwargs):
    """Both functions on their own leaf copy of ``z`` (in layout ``how``): outputs and leaves."""
    leaves = [z.clone().requires_grad_() for _ in range(2)]
    theirs = peer_fn(layout(leaves[0], how), *args, **kwargs)
    ours = our_fn(layout(leaves[1], how), *args, **kwargs)
    return theirs, ours, leaves


def check(ours, theirs, ref, dtype, *, scale=1.0):
    assert ours.dtype == theirs.dtype == dtype and ours.shape == theirs.shape
    if dtype in ULP:
        assert_at_least_as_close(ours, theirs, ref, dtype, scale=scale)
    else:
        s = 1e-12 if dtype == F64 else 1e-5
        torch.testing.assert_close(ours, theirs, rtol=s * scale, atol=s * scale)
        torch.testing.assert_close(ours.double(), ref, rtol=s * scale * 2, atol=s * scale * 2)


# ---------------------------------------------------------------------------------------------
# selective_log_softmax
# ---------------------------------------------------------------------------------------------


@HYP
@given(
    dtype=st.sampled_from(DTYPES),
    B=st.sampled_from([1, 2, 3]),
    T=st.sampled_from([1, 5, 37]),
    V=st.sampled_from([1, 7, 33, 130]),
    K=st.sampled_from([None, 1, 3]),
    temperature=st.sampled_from([1.0, 0.7, 1.5]),
    mask=st.sampled_from([None, "bool", "long", "float", "weights"]),
    how=st.sampled_from(["contiguous", "transposed", "sliced", "strided"]),
    seed=st.integers(0, 2**16),
)
def test_selective_log_softmax_matches(peer, dtype, B, T, V, K, temperature, mask, how, seed):
    g = gen(seed)
    z = (torch.randn(B, T, V, generator=g, dtype=F64) * 3).to(dtype)
    ishape = (B, T) if K is None else (B, T, K)
    index = torch.randint(0, V, ishape, generator=g)
    if K == 3:
        index[..., 1] = index[..., 0]  # a repeated top-K index
    row_mask = make_row_mask(ishape, g, mask)
    theirs, ours, leaves = run_both(
        peer.selective_log_softmax, ptrl.selective_log_softmax, z, how, index, temperature, row_mask
    )

    z64 = z.double().requires_grad_()
    gathered = ref_log_softmax(z64 / temperature).gather(-1, index if K else index.unsqueeze(-1))
    ref = gathered if K else gathered.squeeze(-1)
    if row_mask is not None:
        ref = ref.masked_fill(row_mask == 0, 0.0)
        assert torch.equal(ours[row_mask == 0], torch.zeros_like(ours[row_mask == 0]))
    check(ours, theirs, ref.detach(), dtype)

    w = torch.randn(ishape, generator=g, dtype=F64)
    (ref * w).sum().backward()
    for out in (theirs, ours):
        (out.double() * w).sum().backward()
    check(leaves[1].grad, leaves[0].grad, z64.grad, dtype, scale=2)


def test_selective_log_softmax_top_k_gradient_exact_in_bf16(peer):
    # The top-K backward writes the K indexed entries from float32, so even in bf16 they are
    # one rounding from the float64 gradient (TRL's bf16 autograd is further off).
    g = gen(7)
    z = (torch.randn(4, 9, 50, generator=g) * 4).bfloat16()
    index = torch.topk(z.float(), 5, dim=-1).indices
    theirs, ours, leaves = run_both(peer.selective_log_softmax, ptrl.selective_log_softmax, z, "contiguous", index)
    z64 = z.double().requires_grad_()
    ref_log_softmax(z64).gather(-1, index).sum().backward()
    (theirs.double().sum()).backward()
    (ours.double().sum()).backward()
    ref_k = z64.grad.gather(-1, index)
    err_ours = (leaves[1].grad.gather(-1, index).double() - ref_k).abs()
    assert (err_ours <= 2.0**-8 * ref_k.abs() + 1e-6).all()
    assert_at_least_as_close(leaves[1].grad, leaves[0].grad, z64.grad, torch.bfloat16)


def test_selective_log_softmax_one_dim_logits(peer):
    # TRL's row loop iterates the vocabulary of 1-D logits and returns a [V] tensor of differences.
    z, i = torch.randn(7, generator=gen(1)), torch.tensor(3)
    torch.testing.assert_close(ptrl.selective_log_softmax(z, i).double(), ref_log_softmax(z.double())[3])
    assert peer.selective_log_softmax(z, i).shape == (7,)


def test_selective_log_softmax_skips_masked_index(peer):
    # Documented difference: an index at a masked position is not read (TRL gathers it and fails).
    z = torch.randn(2, 3, 7)
    index = torch.tensor([[0, 99, 1], [2, 3, 4]])
    row_mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    out = ptrl.selective_log_softmax(z, index, row_mask=row_mask)
    assert out[0, 1] == 0
    with pytest.raises(RuntimeError):
        peer.selective_log_softmax(z, index, row_mask=row_mask)


# ---------------------------------------------------------------------------------------------
# entropy_from_logits / selective_log_softmax_and_entropy
# ---------------------------------------------------------------------------------------------


@HYP
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.sampled_from([(1, 1), (3, 5), (2, 37), (4,)]),
    V=st.sampled_from([1, 7, 100]),
    chunk_size=st.sampled_from([1, 4, 128]),
    how=st.sampled_from(["contiguous", "transposed", "sliced"]),
    seed=st.integers(0, 2**16),
)
def test_entropy_from_logits_matches(peer, dtype, shape, V, chunk_size, how, seed):
    g = gen(seed)
    how = "sliced" if len(shape) == 1 and how == "transposed" else how
    z = (torch.randn(*shape, V, generator=g, dtype=F64) * 2).to(dtype)
    theirs, ours, leaves = run_both(peer.entropy_from_logits, ptrl.entropy_from_logits, z, how, chunk_size)
    z64 = z.double().requires_grad_()
    ref = ref_entropy(z64)
    check(ours, theirs, ref.detach(), dtype)
    w = torch.randn(shape, generator=g, dtype=F64)
    (ref * w).sum().backward()
    for out in (theirs, ours):
        (out.double() * w).sum().backward()
    check(leaves[1].grad, leaves[0].grad, z64.grad, dtype, scale=2)


@HYP
@given(
    dtype=st.sampled_from(DTYPES),
    B=st.sampled_from([1, 3]),
    T=st.sampled_from([1, 5, 37]),
    V=st.sampled_from([1, 7, 64]),
    topk=st.booleans(),
    entropy_requires_grad=st.booleans(),
    temperature=st.sampled_from([1.0, 0.6]),
    mask=st.sampled_from([None, "bool", "float", "weights"]),
    how=st.sampled_from(["contiguous", "transposed", "strided"]),
    seed=st.integers(0, 2**16),
)
def test_selective_log_softmax_and_entropy_matches(
    peer, dtype, B, T, V, topk, entropy_requires_grad, temperature, mask, how, seed
):
    g = gen(seed)
    z = (torch.randn(B, T, V, generator=g, dtype=F64) * 3).to(dtype)
    ishape = (B, T, 2) if topk else (B, T)
    index = torch.randint(0, V, ishape, generator=g)
    row_mask = None if topk else make_row_mask((B, T), g, mask)  # TRL's row_mask is per position
    (lp_t, h_t), (lp_o, h_o), leaves = run_both(
        peer.selective_log_softmax_and_entropy,
        ptrl.selective_log_softmax_and_entropy,
        z,
        how,
        index,
        entropy_requires_grad,
        temperature,
        row_mask,
    )
    assert h_o.requires_grad == h_t.requires_grad == entropy_requires_grad
    z64 = z.double().requires_grad_()
    s64 = z64 / temperature
    ref_lp = ref_log_softmax(s64).gather(-1, index if topk else index.unsqueeze(-1))
    ref_lp = ref_lp if topk else ref_lp.squeeze(-1)
    ref_h = ref_entropy(s64)
    if row_mask is not None:
        ref_lp, ref_h = ref_lp.masked_fill(row_mask == 0, 0.0), ref_h.masked_fill(row_mask == 0, 0.0)
    check(lp_o, lp_t, ref_lp.detach(), dtype)
    check(h_o, h_t, ref_h.detach(), dtype)

    w_lp = torch.randn(ishape, generator=g, dtype=F64)
    w_h = torch.randn((B, T), generator=g, dtype=F64)
    ((ref_lp * w_lp).sum() + (ref_h * w_h).sum() * entropy_requires_grad).backward()
    for lp, h in ((lp_t, h_t), (lp_o, h_o)):
        loss = (lp.double() * w_lp).sum()
        if entropy_requires_grad:
            loss = loss + (h.double() * w_h).sum()
        loss.backward()
    check(leaves[1].grad, leaves[0].grad, z64.grad, dtype, scale=2)


def test_entropy_neg_inf_logit_difference(peer):
    z = torch.tensor([[0.5, -math.inf, 1.0]])
    assert torch.isnan(peer.entropy_from_logits(z)).all()
    torch.testing.assert_close(ptrl.entropy_from_logits(z).double(), ref_entropy(z.double()))
    lp, h = ptrl.selective_log_softmax_and_entropy(z, torch.tensor([2]))
    torch.testing.assert_close(h.double(), ref_entropy(z.double()))


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_errors(peer):
    z = torch.randn(2, 3, 7)
    index = torch.zeros(2, 3, dtype=torch.long)

    def call(f, t):
        return f(z, index, temperature=t)

    for name in ("selective_log_softmax", "selective_log_softmax_and_entropy"):
        ours, theirs = getattr(ptrl, name), getattr(peer, name)
        for bad in (0.0, -1.0):
            for fn in (ours, theirs):
                with pytest.raises(ValueError, match="temperature must be positive"):
                    call(fn, bad)
        with pytest.raises(ValueError, match="temperature must be positive"):
            call(ours, math.nan)  # TRL divides by NaN
        with pytest.raises(ValueError, match="temperature must be finite"):
            call(ours, math.inf)
        with pytest.raises(ValueError, match=rf"{name}: index = 7 at flattened position 4 is outside \[0, V=7\)") as e:
            ours(z, torch.tensor([[0, 1, 2], [3, 7, 5]]))
        assert "Exception raised from" not in str(e.value) and ".cpp" not in str(e.value)
        with pytest.raises(RuntimeError):  # TRL's torch.gather
            theirs(z, torch.tensor([[0, 1, 2], [3, 7, 5]]))
        for fn in (ours, theirs):  # top-K: the same torch.gather error in both
            with pytest.raises(RuntimeError, match="out of bounds"):
                fn(z, torch.full((2, 3, 2), 9))
        with pytest.raises(ValueError, match=f"{name}: logits must be float"):
            ours(torch.ones(2, 3, 7, dtype=torch.long), index)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="entropy_from_logits: chunk_size must be a positive int"):
            ptrl.entropy_from_logits(z, bad)
        with pytest.raises(RuntimeError):
            peer.entropy_from_logits(z, bad)
    with pytest.raises(ValueError, match="entropy_from_logits: .*empty vocabulary"):
        ptrl.entropy_from_logits(torch.randn(2, 0))


# ---------------------------------------------------------------------------------------------
# patch() / unpatch()
# ---------------------------------------------------------------------------------------------


def test_signatures_match_the_peer(peer):
    for name in NAMES:
        assert _patching._same_signature(getattr(peer, name), getattr(ptrl, name)), name


def test_patch_routes_trl_through_pyppo(peer):
    import trl.trainer.utils as utils

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRLExperimentalWarning
        sdpo = importlib.import_module("trl.experimental.sdpo.loss_utils")  # imports it by name
    originals = {n: getattr(peer, n) for n in NAMES}
    assert sdpo.selective_log_softmax is originals["selective_log_softmax"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PeerVersionWarning)
        p = ptrl.patch()
    try:
        for n in NAMES:
            assert getattr(utils, n) is getattr(ptrl, n)
            assert p.originals[f"trl.trainer.utils.{n}"] is originals[n]
        assert sdpo.selective_log_softmax is ptrl.selective_log_softmax
        assert "trl.experimental.sdpo.loss_utils.selective_log_softmax" in p.originals

        student = torch.randn(2, 5, 11, requires_grad=True)
        teacher, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
        with pyppo_ops_called() as ops:
            # TRL's own loss, calling selective_log_softmax by name
            loss = sdpo.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)
            loss.sum().backward()
        assert ops.count("pyppo::gather_logprobs") == 2 and "pyppo::gather_logprobs_backward" in ops
        expected = originals["selective_log_softmax"](student, ids) - originals["selective_log_softmax"](teacher, ids)
        torch.testing.assert_close(loss, expected.detach() * originals["selective_log_softmax"](student, ids))
        with pyppo_ops_called() as ops:
            utils.selective_log_softmax_and_entropy(student, ids)
            utils.entropy_from_logits(teacher)
        assert ops == ["pyppo::gather_logprobs"] * 2
    finally:
        assert ptrl.unpatch() is p
    for n in NAMES:
        assert getattr(utils, n) is originals[n]
    assert sdpo.selective_log_softmax is originals["selective_log_softmax"]
    with pyppo_ops_called() as ops:
        sdpo.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)
        utils.selective_log_softmax_and_entropy(student, ids)
    assert ops == []


def test_module_imported_while_patched_is_restored(peer):
    candidates = ("trl.experimental.sdft.loss_utils", "trl.experimental.a2po.a2po_trainer")
    late = [m for m in candidates if m not in sys.modules]
    if not late:
        pytest.skip("every candidate module is already imported")
    with ptrl.patched():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(late[0])
        assert mod.selective_log_softmax is ptrl.selective_log_softmax
    assert mod.selective_log_softmax is peer.selective_log_softmax


def test_adapters_work_without_the_peer():
    # A fresh interpreter where importing trl fails, as on a machine without it.
    code = """
import sys, importlib.abc
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "trl" or name.startswith("trl."):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Absent())
import torch
import pyppo.integrations.trl as ptrl
logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
logp = torch.log_softmax(logits.double(), -1)
ref, ref_entropy = logp.gather(-1, labels[..., None])[..., 0], -(logp.exp() * logp).sum(-1)
close = lambda a, b: torch.allclose(a.double(), b, atol=1e-5)
assert close(ptrl.selective_log_softmax(logits, labels), ref)
lp, ent = ptrl.selective_log_softmax_and_entropy(logits, labels)
assert close(lp, ref) and close(ent, ref_entropy) and close(ptrl.entropy_from_logits(logits), ref_entropy)
assert not any(m == "trl" or m.startswith("trl.") for m in sys.modules)
print("agree")
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    assert out.stdout.split() == ["agree"], out.stderr
