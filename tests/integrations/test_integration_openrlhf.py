"""pyppo.integrations.openrlhf against the real OpenRLHF 0.11.2 functions: values, dtypes, masked
positions, gradients, in-place side effects, errors, and patch()/unpatch().

Every comparison runs the peer's own function (captured before any patching) and the adapter on
the same fresh inputs. Tolerances: bitwise where the adapter does the peer's arithmetic (k1, k2,
compute_reward, the in-place temperature division, masked_mean with a non-bool mask,
masked_normalize); float32 rounding
otherwise. Where the peer itself computes in bf16/fp16 (its row-wise ``log_softmax``, its
entropy), both are compared against float64 math on the same rounded inputs, and pyppo must be
at least as close (or within one rounding of the output dtype).

The peer is imported with tests/support/peer_support.py (a flash-attn stub on CPU); these tests skip
when OpenRLHF is not installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyppo.integrations.openrlhf as O
from pyppo.integrations import PeerVersionWarning, _patching
from support.peer_support import import_peer, pyppo_ops_called

F64 = torch.float64
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
PATCHED = ("compute_approx_kl", "compute_reward", "log_probs_from_logits", "compute_entropy", "masked_mean")
NAMES = PATCHED + ("masked_normalize",)  # the peer's formula, not patched
HYP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Relative error of one rounding to the dtype (unit roundoff, doubled: one ulp).
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23, F64: 2.0**-52}


@pytest.fixture(scope="module")
def peer():
    """OpenRLHF's own functions, captured unpatched."""
    utils = import_peer("openrlhf.models.utils")
    assert _patching.active(O.PEER) is None, "a previous test left OpenRLHF patched"
    return SimpleNamespace(**{n: getattr(utils, n) for n in NAMES}, module=utils)


@pytest.fixture(scope="module", autouse=True)
def _always_unpatch():
    yield
    O.unpatch()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x``'s values in a non-contiguous layout (same shape)."""
    if how == "transposed":  # built [T, B, ...] then viewed [B, T, ...]
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if how == "sliced":  # rows padded, last dim sliced
        pad = torch.zeros(*x.shape[:-1], 3, dtype=x.dtype)
        return torch.cat([x, pad], -1)[..., : x.shape[-1]]
    return x


def make_mask(B, T, g, kind, *, empty_row=True):
    m = torch.rand(B, T, generator=g) < 0.6
    m[0, T - 1] = True
    if B >= 2 and empty_row:
        m[1] = False
    if B >= 3 and T >= 3:
        m[2] = True
        m[2, T // 2] = False  # a hole
    return {"bool": m, "long": m.long(), "float": m.float(), "double": m.double()}[kind]


def assert_at_least_as_close(ours, theirs, ref, dtype, *, scale=1.0):
    """pyppo is within one rounding of ``dtype`` of the float64 reference, and no further from
    it than the peer (or within that rounding when the peer happens to be closer)."""
    if ref.numel() == 0:
        return
    ours, theirs = ours.double(), theirs.double()
    floor = ULP[dtype] * scale * max(1.0, ref.abs().max().item()) + 1e-30
    err_ours = (ours - ref).abs().max().item()
    err_theirs = (theirs - ref).abs().max().item()
    assert err_ours <= max(err_theirs, floor), (err_ours, err_theirs, floor)
    torch.testing.assert_close(ours, ref, rtol=ULP[dtype] * scale, atol=floor)


# ---------------------------------------------------------------------------------------------
# compute_approx_kl
# ---------------------------------------------------------------------------------------------


@HYP
@given(
    est=st.sampled_from(["k1", "k2", "k3"]),
    unbiased=st.booleans(),
    with_old=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    B=st.sampled_from([1, 2, 4]),
    T=st.sampled_from([1, 5, 37]),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
    how=st.sampled_from(["contiguous", "transposed"]),
    seed=st.integers(0, 2**16),
)
def test_compute_approx_kl_matches(peer, est, unbiased, with_old, dtype, B, T, scale, how, seed):
    g = gen(seed)
    lp = layout((torch.randn(B, T, generator=g, dtype=F64) * scale).to(dtype), how)
    base = (torch.randn(B, T, generator=g, dtype=F64) * scale).to(dtype)
    old = (lp.double() + 0.5 * torch.randn(B, T, generator=g, dtype=F64)).to(dtype) if with_old else None
    ins = [(lp.clone().requires_grad_(), base.clone().requires_grad_()) for _ in range(2)]
    theirs = peer.compute_approx_kl(*ins[0], old, est, unbiased)
    ours = O.compute_approx_kl(*ins[1], old, est, unbiased)
    assert ours.dtype == theirs.dtype == torch.float32
    w = torch.randn(B, T, generator=g)
    (theirs * w).sum().backward()
    (ours * w).sum().backward()
    if est == "k3":  # the peer's exp(-d) - 1 + d rounds at the scale of 1, up to the clip (10)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-5)
    else:
        assert torch.equal(ours, theirs)
    for x, y in zip(ins[0], ins[1]):
        assert y.grad.dtype == x.grad.dtype == dtype
        torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-5)


def test_compute_approx_kl_clip_edges(peer):
    # d exactly at the clip (gradient passes, as torch.clamp), beyond it (gradient 0), and k3's
    # pre-exp clamp region (d < -10).
    d = torch.tensor([10.0, -10.0, 10.5, -10.5, -30.0, 4.4721360206604, -2.3, 0.0])
    for est in ("k1", "k2", "k3"):
        a, b = d.clone().requires_grad_(), d.clone().requires_grad_()
        theirs = peer.compute_approx_kl(a, torch.zeros(8), kl_estimator=est)
        ours = O.compute_approx_kl(b, torch.zeros(8), kl_estimator=est)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-5)
        theirs.sum().backward()
        ours.sum().backward()
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-5)
        assert (ours.abs() <= 10).all()


def test_compute_approx_kl_broadcasts_like_the_peer(peer):
    lp, base = torch.randn(3, 5), torch.randn(3, 1)
    theirs = peer.compute_approx_kl(lp, base, kl_estimator="k3")
    torch.testing.assert_close(O.compute_approx_kl(lp, base, kl_estimator="k3"), theirs)
    with pytest.raises(RuntimeError):
        peer.compute_approx_kl(lp, torch.randn(4, 5))
    with pytest.raises(RuntimeError):
        O.compute_approx_kl(lp, torch.randn(4, 5))


def test_compute_approx_kl_errors(peer):
    for fn in (peer.compute_approx_kl, O.compute_approx_kl):
        with pytest.raises(ValueError, match="Unknown kl_estimator: abs"):
            fn(torch.randn(3), torch.randn(3), kl_estimator="abs")


def test_compute_approx_kl_impossible_token_difference(peer):
    # Documented difference: -inf under both policies is 0 in pyppo, NaN (inf - inf) in the peer.
    ninf = torch.tensor([-math.inf])
    assert torch.isnan(peer.compute_approx_kl(ninf, ninf)).all()
    assert O.compute_approx_kl(ninf, ninf).item() == 0.0


# ---------------------------------------------------------------------------------------------
# compute_reward
# ---------------------------------------------------------------------------------------------


@HYP
@given(
    B=st.sampled_from([1, 2, 3, 5]),
    T=st.sampled_from([1, 4, 37]),
    kind=st.sampled_from(["bool", "long", "float"]),
    kl_dtype=st.sampled_from([torch.float32, torch.bfloat16, F64]),
    kl_coef=st.sampled_from([-0.1, 0.0, 0.02, 1.5]),
    clip=st.sampled_from([None, (-1.0, 0.5)]),
    seed=st.integers(0, 2**16),
)
def test_compute_reward_matches_bitwise(peer, B, T, kind, kl_dtype, kl_coef, clip, seed):
    g = gen(seed)
    r = torch.randn(B, generator=g) * 2
    kl = torch.randn(B, T, generator=g).to(kl_dtype)
    mask = make_mask(B, T, g, kind)  # includes an all-zero row: the peer puts its score at T - 1
    theirs = peer.compute_reward(r, kl_coef, kl, mask, clip)
    ours = O.compute_reward(r, kl_coef, kl, mask, clip)
    assert ours.dtype == theirs.dtype == kl_dtype
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_compute_reward_gradients_and_infinities(peer):
    g = gen(3)
    mask = make_mask(3, 6, g, "bool")
    grads = []
    for fn in (peer.compute_reward, O.compute_reward):
        r = torch.randn(3, generator=gen(1)).requires_grad_()
        kl = torch.randn(3, 6, generator=gen(2)).requires_grad_()
        fn(r, 0.1, kl, mask, (-0.5, 0.5)).mul(torch.arange(18.0).view(3, 6)).sum().backward()
        grads.append((r.grad, kl.grad))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    # kl_coef <= 0 multiplies by -0.0, so an infinite KL is NaN in the peer: kept.
    kl = torch.tensor([[math.inf, 1.0]])
    theirs = peer.compute_reward(torch.ones(1), 0.0, kl, torch.ones(1, 2))
    torch.testing.assert_close(O.compute_reward(torch.ones(1), 0.0, kl, torch.ones(1, 2)), theirs, equal_nan=True)


def test_compute_reward_errors_like_the_peer(peer):
    for fn in (peer.compute_reward, O.compute_reward):
        with pytest.raises(AttributeError):
            fn(torch.ones(2), 0.1, torch.zeros(2, 3))  # action_mask=None


# ---------------------------------------------------------------------------------------------
# log_probs_from_logits / compute_entropy
# ---------------------------------------------------------------------------------------------


def ref_log_softmax(z64: torch.Tensor) -> torch.Tensor:
    return z64 - torch.logsumexp(z64, dim=-1, keepdim=True)


def ref_entropy(z64: torch.Tensor) -> torch.Tensor:
    logp = ref_log_softmax(z64)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


@HYP
@given(
    dtype=st.sampled_from(DTYPES),
    B=st.sampled_from([1, 2, 3]),
    T=st.sampled_from([1, 5, 37]),
    V=st.sampled_from([1, 7, 33, 257]),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    how=st.sampled_from(["contiguous", "transposed", "sliced"]),
    seed=st.integers(0, 2**16),
)
def test_log_probs_from_logits_matches(peer, dtype, B, T, V, temperature, how, seed):
    g = gen(seed)
    z = (torch.randn(B, T, V, generator=g, dtype=F64) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    leaves = [z.clone().requires_grad_() for _ in range(2)]
    # Non-leaf, non-contiguous views of the same values: the function divides them in place.
    views = [layout(x * 1, how) for x in leaves]
    theirs = peer.log_probs_from_logits(views[0], labels, temperature)
    ours = O.log_probs_from_logits(views[1], labels, temperature)
    # The in-place division, bit for bit (OpenRLHF reads the scaled logits afterwards).
    assert torch.equal(views[1], views[0])
    if temperature != 1.0:
        assert torch.equal(views[1], z / temperature)
    assert ours.dtype == theirs.dtype == dtype and ours.shape == (B, T)

    scaled = views[1].detach().double().requires_grad_()
    ref = ref_log_softmax(scaled).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    w = torch.randn(B, T, generator=g, dtype=F64)
    (ref * w).sum().backward()
    ref_grad = scaled.grad / temperature
    for out in (theirs, ours):
        (out.double() * w).sum().backward()
    if dtype in (torch.float32, F64):
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours, theirs, **tol)
        torch.testing.assert_close(leaves[1].grad, leaves[0].grad, **tol)
    else:  # the peer's per-row log_softmax in bf16/fp16
        assert_at_least_as_close(ours, theirs, ref, dtype)
        assert_at_least_as_close(leaves[1].grad, leaves[0].grad, ref_grad, dtype, scale=2)


@HYP
@given(
    dtype=st.sampled_from(DTYPES),
    B=st.sampled_from([1, 3]),
    T=st.sampled_from([1, 5, 37]),
    V=st.sampled_from([1, 7, 100]),
    how=st.sampled_from(["contiguous", "transposed", "sliced"]),
    seed=st.integers(0, 2**16),
)
def test_compute_entropy_matches(peer, dtype, B, T, V, how, seed):
    g = gen(seed)
    z = (torch.randn(B, T, V, generator=g, dtype=F64) * 2).to(dtype)
    leaves = [z.clone().requires_grad_() for _ in range(2)]
    eager_peer = peer.compute_entropy.__wrapped__  # the function under OpenRLHF's @torch.compile
    theirs = eager_peer(layout(leaves[0], how))
    ours = O.compute_entropy(layout(leaves[1], how))
    assert ours.dtype == theirs.dtype == dtype and ours.shape == (B, T)
    z64 = z.double().requires_grad_()
    ref = ref_entropy(z64)
    w = torch.randn(B, T, generator=g, dtype=F64)
    (ref * w).sum().backward()
    for out in (theirs, ours):
        (out.double() * w).sum().backward()
    if dtype in (torch.float32, F64):
        s = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(ours, theirs, rtol=s, atol=s)
        torch.testing.assert_close(leaves[1].grad, leaves[0].grad, rtol=s, atol=s)
    else:
        assert_at_least_as_close(ours, theirs, ref, dtype)
        assert_at_least_as_close(leaves[1].grad, leaves[0].grad, z64.grad, dtype, scale=2)


def test_compute_entropy_matches_the_compiled_peer(peer):
    z = torch.randn(2, 3, 11, generator=gen(5)) * 3
    torch.testing.assert_close(O.compute_entropy(z), peer.compute_entropy(z), rtol=1e-5, atol=1e-5)


def test_compute_entropy_neg_inf_logit_difference(peer):
    z = torch.tensor([[0.5, -math.inf, 1.0]])
    assert torch.isnan(peer.compute_entropy.__wrapped__(z)).all()
    torch.testing.assert_close(O.compute_entropy(z).double(), ref_entropy(z.double()), rtol=1e-6, atol=1e-6)


def test_log_probs_from_logits_errors(peer):
    z = torch.randn(2, 3, 7)
    with pytest.raises(ValueError, match=r"log_probs_from_logits: labels = 7 .* outside \[0, V=7\)") as e:
        O.log_probs_from_logits(z, torch.full((2, 3), 7))
    assert "Exception raised from" not in str(e.value) and ".cpp" not in str(e.value)
    with pytest.raises(RuntimeError):  # the peer's torch.gather
        peer.log_probs_from_logits(z, torch.full((2, 3), 7))
    for bad in (0.0, -1.0, math.nan):
        before = z.clone()
        with pytest.raises(ValueError, match="temperature must be positive"):
            O.log_probs_from_logits(z, torch.zeros(2, 3, dtype=torch.long), bad)
        assert torch.equal(z, before)  # checked before the in-place division
    with pytest.raises(ValueError, match="temperature must be finite"):
        O.log_probs_from_logits(z, torch.zeros(2, 3, dtype=torch.long), math.inf)
    leaf = torch.randn(2, 3, 7, requires_grad=True)
    for fn in (peer.log_probs_from_logits, O.log_probs_from_logits):  # in-place on a leaf
        with pytest.raises(RuntimeError, match="in-place"):
            fn(leaf, torch.zeros(2, 3, dtype=torch.long), 0.5)
    with pytest.raises(ValueError, match="compute_entropy: .*empty vocabulary"):
        O.compute_entropy(torch.randn(2, 0))
    with pytest.raises(ValueError, match="compute_entropy: logits must be float"):
        O.compute_entropy(torch.ones(2, 3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# masked_mean / masked_normalize
# ---------------------------------------------------------------------------------------------


@HYP
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, F64]),
    kind=st.sampled_from(["bool", "long", "float", "double", "weights"]),
    dim=st.sampled_from([None, 0, 1, -1, (0, 1)]),
    B=st.sampled_from([1, 2, 3, 6]),
    T=st.sampled_from([1, 5, 37]),
    empty_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_masked_mean_and_normalize_match_the_peer(peer, dtype, kind, dim, B, T, empty_row, seed):
    # A bool mask with an int/None dim runs pyppo's op (float64 sums): within one rounding of the
    # output dtype of the peer, and at least as close to float64 math; an all-masked slice is the
    # peer's NaN. Every other case is the peer's formula, bit for bit (weighted masks included).
    g = gen(seed)
    x = (torch.randn(B, T, generator=g, dtype=F64) * 3 + 1).to(dtype)
    if kind == "weights":
        mask = make_mask(B, T, g, "float", empty_row=empty_row) * (torch.rand(B, T, generator=g) * 2)
    else:
        mask = make_mask(B, T, g, kind, empty_row=empty_row)
    calls = [("masked_mean", (mask, dim)), ("masked_mean", (None, dim))]
    if not isinstance(dim, tuple):
        calls.append(("masked_normalize", (mask, dim)))
    for name, args in calls:
        via_op = name == "masked_mean" and kind == "bool" and args[0] is not None and not isinstance(dim, tuple)
        leaves = [x.clone().requires_grad_() for _ in range(2)]
        theirs = getattr(peer, name)(leaves[0], *args)
        ours = getattr(O, name)(leaves[1], *args)
        assert ours.dtype == theirs.dtype
        if via_op:
            exact = (x.double() * mask).sum(dim=dim) / mask.sum(dim=dim)
            assert torch.equal(ours.isnan(), theirs.isnan())
            ok = ~exact.isnan()
            tol = 4 * ULP[dtype] * exact.abs().clamp_min(1.0)
            err_ours = (ours.double() - exact).abs()[ok]
            err_theirs = (theirs.double() - exact).abs()[ok]
            assert (err_ours <= tol[ok]).all() and (err_ours <= err_theirs + tol[ok]).all()
        else:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
        w = torch.randn(theirs.shape, generator=g, dtype=F64)
        for out in (theirs, ours):
            (out.double() * w).nan_to_num(0.0).sum().backward()
        if via_op:
            torch.testing.assert_close(
                leaves[1].grad, leaves[0].grad, rtol=4 * ULP[dtype], atol=4 * ULP[dtype], equal_nan=True
            )
        else:
            torch.testing.assert_close(leaves[1].grad, leaves[0].grad, rtol=0, atol=0, equal_nan=True)


def test_masked_mean_with_a_bool_mask_runs_the_op_and_ignores_masked_nans(peer):
    g = gen(0)
    x = torch.randn(4, 9, generator=g)
    mask = torch.rand(4, 9, generator=g) > 0.3
    mask[:, 0], mask[:, 1] = True, False  # every row: some valid values, and a masked NaN
    x[~mask] = float("nan")
    with pyppo_ops_called() as ops:
        ours = O.masked_mean(x, mask, -1)
    assert ops == ["pyppo::masked_mean"]
    torch.testing.assert_close(ours, torch.where(mask, x, 0).sum(-1) / mask.sum(-1))
    assert peer.masked_mean(x, mask, -1).isnan().all()  # the peer's NaN·0 propagates


# ---------------------------------------------------------------------------------------------
# group_rewards: the baseline step of RemoteExperienceMaker.compute_advantages_and_returns
# ---------------------------------------------------------------------------------------------

ESTIMATORS = ("rloo", "reinforce_baseline", "dr_grpo", "group_norm", "flash_reinforce", "reinforce", "gae")


@pytest.fixture(scope="module")
def advantage_step(peer):
    """A class with OpenRLHF 0.11.2's own ``RemoteExperienceMaker.compute_advantages_and_returns``
    (and the return methods it calls), compiled from its installed source: its module imports Ray actor
    groups and torchdata, which a CPU test machine lacks, but the method itself needs only torch,
    ``compute_reward`` and ``apply_length_penalties``."""
    import ast
    import importlib.util
    import logging
    from pathlib import Path
    from typing import List, Tuple

    length_penalty = import_peer("openrlhf.trainer.ppo_utils.length_penalty")
    root = Path(importlib.util.find_spec("openrlhf").submodule_search_locations[0])
    tree = ast.parse((root / "trainer/ppo_utils/experience_maker.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RemoteExperienceMaker")
    wanted = {"compute_advantages_and_returns", "get_advantages_and_returns", "get_cumulative_returns"}
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {m.name for m in methods} == wanted
    maker = ast.ClassDef(name="Maker", bases=[], keywords=[], body=methods, decorator_list=[])
    namespace = {
        "torch": torch,
        "itertools": __import__("itertools"),
        "List": List,
        "Tuple": Tuple,
        "Experience": object,
        "compute_reward": peer.module.compute_reward,
        "apply_length_penalties": length_penalty.apply_length_penalties,
        "logger": logging.getLogger("openrlhf-test"),
    }
    exec(
        compile(ast.fix_missing_locations(ast.Module(body=[maker], type_ignores=[])), "experience_maker", "exec"),
        namespace,
    )
    return namespace["Maker"]


def openrlhf_shaped_rewards(maker_class, rewards, n, estimator, seed, T=6):
    """Run OpenRLHF's method on ``rewards`` (``[N]``, prompt order: ``n`` consecutive samples
    per prompt) split over experiences of uneven sizes in a shuffled order, as its rollout hands
    them over, with no KL and no clipping: each sample's return (``info["return"]``, the sum of
    its token rewards) is then its shaped reward. Returned in prompt order."""
    N = rewards.shape[0]
    g = gen(seed)
    order = torch.randperm(N, generator=g)
    cuts = sorted(set(torch.randint(1, max(N, 2), (2,), generator=g).tolist()) - {N})
    experiences = []
    for chunk in torch.tensor_split(order, cuts):
        b = len(chunk)
        mask = torch.rand(b, T, generator=g) < 0.7
        mask[:, 0] = True
        experiences.append(
            SimpleNamespace(
                rewards=rewards[chunk].clone(),
                index=chunk.tolist(),
                kl=torch.zeros(b, T, dtype=rewards.dtype),
                action_mask=mask,
                info={},
                values=torch.zeros(b, T),
            )
        )
    args = SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=1.0, lambd=1.0, no_std_norm=False)),
        rollout=SimpleNamespace(n_samples_per_prompt=n),
        reward=SimpleNamespace(clip_range=None),
    )
    maker = maker_class()
    maker.strategy, maker.advantage_estimator = SimpleNamespace(args=args), estimator
    maker.kl_ctl = SimpleNamespace(value=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.std of one sample (n = 1)
        maker.compute_advantages_and_returns(experiences)
    shaped = torch.empty_like(rewards)
    for e in experiences:
        shaped[torch.tensor(e.index, dtype=torch.long)] = e.info["return"]
    return shaped


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_group_rewards_match_openrlhf(peer, advantage_step, estimator, n, dtype):
    g = gen(n * 10 + ESTIMATORS.index(estimator))
    G = 5
    rewards = (torch.randn(G, n, generator=g, dtype=F64) * 2).to(dtype)
    rewards[1] = rewards[1, 0]  # a group of equal rewards
    theirs = openrlhf_shaped_rewards(advantage_step, rewards.reshape(-1), n, estimator, n)
    with pyppo_ops_called() as ops:
        ours = O.group_rewards(rewards, estimator)
    assert ours.shape == rewards.shape and ours.dtype == theirs.dtype == dtype
    if estimator in ("gae", "reinforce"):
        assert ours is rewards and ops == []
        torch.testing.assert_close(theirs, rewards.reshape(-1), rtol=0, atol=0)
        return
    assert "pyppo::group_advantages.group_size" in ops  # the op's overload for consecutive groups
    ours = ours.reshape(-1)
    if estimator != "flash_reinforce":
        assert torch.all(ours[n : 2 * n] == 0)  # equal rewards: exactly 0
        keep = torch.ones(G * n, dtype=torch.bool)
        keep[n : 2 * n] = False
        ours, theirs = ours[keep], theirs[keep]
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == F64 else {"rtol": 2e-6, "atol": 2e-6}
    torch.testing.assert_close(ours, theirs, **tol)
    assert ours.abs().max() > 0.1


def test_group_rewards_edge_cases(peer, advantage_step):
    # One sample per prompt: OpenRLHF's r - mean(r) is 0; its leave-one-out and std are NaN.
    r = torch.tensor([[1.5], [-2.0], [0.25]])
    for est in ("reinforce_baseline", "dr_grpo"):
        theirs = openrlhf_shaped_rewards(advantage_step, r.reshape(-1), 1, est, 0)
        assert torch.equal(O.group_rewards(r, est).reshape(-1), theirs) and torch.all(theirs == 0)
    for est in ("rloo", "group_norm"):
        assert openrlhf_shaped_rewards(advantage_step, r.reshape(-1), 1, est, 0).isnan().all()
        with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
            O.group_rewards(r, est)
    # flash_reinforce: one group, the whole batch (a batch of one sample gives 0).
    one = torch.tensor([[3.0]])
    assert torch.equal(O.group_rewards(one, "flash_reinforce"), torch.zeros(1, 1))
    assert torch.equal(
        openrlhf_shaped_rewards(advantage_step, one.reshape(-1), 1, "flash_reinforce", 0), torch.zeros(1)
    )
    torch.testing.assert_close(O.group_rewards(r, "flash_reinforce"), r - r.mean())
    # Equal rewards: OpenRLHF's float32 mean is an ulp off, its std is of the order of that ulp,
    # and group_norm divides one by the other (+ 1e-9): eight rewards of 2.9 all get 0.93.
    same = torch.full((1, 8), 2.9)
    assert torch.all(O.group_rewards(same, "group_norm") == 0)
    assert openrlhf_shaped_rewards(advantage_step, same.reshape(-1), 8, "group_norm", 0).abs().min() > 0.5
    # An empty batch, half precision (computed in float32 at least, returned in the input dtype).
    assert O.group_rewards(torch.zeros(0, 4), "rloo").shape == (0, 4)
    h = torch.randn(3, 4, generator=gen(2)).bfloat16()
    out = O.group_rewards(h, "group_norm")
    assert out.dtype == torch.bfloat16
    exact = (h.double() - h.double().mean(-1, keepdim=True)) / (h.double().std(-1, keepdim=True) + 1e-9)
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=2**-8)


def test_group_rewards_errors(peer):
    r = torch.randn(2, 3)
    with pytest.raises(ValueError, match="unknown estimator 'grpo'"):
        O.group_rewards(r, "grpo")
    for bad in (r.reshape(-1), r.long(), r.tolist()):
        with pytest.raises(ValueError, match="2-D float tensor"):
            O.group_rewards(bad, "rloo")
    nan = r.clone()
    nan[1, 2] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        O.group_rewards(nan, "dr_grpo")
    assert O.group_rewards(r, "gae") is r  # unchanged, as OpenRLHF leaves them


# ---------------------------------------------------------------------------------------------
# patch() / unpatch()
# ---------------------------------------------------------------------------------------------


def test_signatures_match_the_peer(peer):
    for name in NAMES:
        assert _patching._same_signature(getattr(peer, name), getattr(O, name)), name
    assert {t.name for t in O.PEER.targets} == set(PATCHED)


def test_patch_routes_openrlhf_through_pyppo(peer):
    import openrlhf.models.actor as actor
    import openrlhf.models.loss as loss
    import openrlhf.models.utils as utils

    originals = {n: getattr(peer, n) for n in NAMES}
    assert actor.compute_entropy is originals["compute_entropy"]  # the @torch.compile wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error", PeerVersionWarning)
        p = O.patch()
    try:
        assert O.patch() is p  # patching twice is a no-op
        for n in PATCHED:
            assert getattr(utils, n) is getattr(O, n)
            assert p.originals[f"openrlhf.models.utils.{n}"] is originals[n]
        assert actor.log_probs_from_logits is O.log_probs_from_logits
        assert actor.compute_entropy is O.compute_entropy
        assert loss.masked_mean is O.masked_mean and utils.masked_normalize is originals["masked_normalize"]
        assert "openrlhf.models.actor.compute_entropy" in p.originals

        lp = torch.randn(2, 5, requires_grad=True)
        with pyppo_ops_called() as ops:
            utils.compute_approx_kl(lp, torch.randn(2, 5), kl_estimator="k3").sum().backward()
        assert "pyppo::kl_penalty" in ops and "pyppo::kl_penalty_backward" in ops
        z = torch.randn(2, 5, 9)
        with pyppo_ops_called() as ops:
            lp_actor = actor.log_probs_from_logits(z.clone(), torch.randint(0, 9, (2, 5)))
            actor.compute_entropy(z)
        assert ops.count("pyppo::gather_logprobs") == 2
    finally:
        assert O.unpatch() is p
    assert O.unpatch() is None
    for n in NAMES:
        assert getattr(utils, n) is originals[n]
    assert actor.log_probs_from_logits is originals["log_probs_from_logits"]
    assert actor.compute_entropy is originals["compute_entropy"]
    with pyppo_ops_called() as ops:
        utils.compute_approx_kl(torch.randn(3), torch.randn(3))
        actor.log_probs_from_logits(torch.randn(2, 5, 9), torch.randint(0, 9, (2, 5)))
    assert ops == []
    assert lp_actor.shape == (2, 5)


def test_patched_context_and_other_versions(peer):
    import openrlhf.models.utils as utils

    with O.patched() as p:
        assert utils.compute_reward is O.compute_reward and len(p) >= len(PATCHED)
    assert utils.compute_reward is peer.compute_reward
    other = dataclasses.replace(O.PEER, versions=("0.0.1",))
    with pytest.warns(PeerVersionWarning, match="Nothing was patched"):
        assert not _patching.patch(other)
    assert utils.compute_reward is peer.compute_reward


def test_openrlhf_actor_forward_through_pyppo(peer):
    # OpenRLHF's own Actor.forward on a tiny random Llama: it scales the logits in place by the
    # temperature, then calls compute_entropy and log_probs_from_logits by name.
    from openrlhf.models.actor import Actor

    from support.tiny_models import tiny_causal_lm

    actor = Actor(tiny_causal_lm(0), temperature=0.7)
    actor.packing_samples = False  # set only when OpenRLHF loads the model from a path itself
    seq = torch.randint(3, 128, (2, 9), generator=gen(0))
    attention = torch.ones(2, 9, dtype=torch.long)
    attention[1, :2] = 0
    action_mask = torch.ones(2, 4, dtype=torch.bool)
    action_mask[1, 3] = False
    results = []
    for use_pyppo in (False, True):
        actor.zero_grad()
        with O.patched() if use_pyppo else contextlib.nullcontext(), pyppo_ops_called() as ops:
            lp, out = actor(seq, action_mask, attention, return_output=True, return_entropy=True)
            (lp.sum() + out.entropy.sum()).backward()
        assert bool(ops) == use_pyppo
        results.append((lp.detach(), out.entropy.detach(), actor.model.lm_head.weight.grad.clone()))
    assert ops.count("pyppo::gather_logprobs") == 2 and ops.count("pyppo::gather_logprobs_backward") == 2
    for theirs, ours in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_adapters_work_without_the_peer():
    # A fresh interpreter where importing openrlhf fails, as on a machine without it.
    code = """
import sys, importlib.abc
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "openrlhf" or name.startswith("openrlhf."):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Absent())
import torch
import pyppo.integrations.openrlhf as O
logprobs, ref_logprobs = torch.randn(3), torch.randn(3)
log_ratio = (ref_logprobs - logprobs).double()
close = lambda a, b: torch.allclose(a.double(), b, atol=1e-5)
# The peer clips k3 to [-10, 10]; without the clip here about one run in ten failed.
k3 = (log_ratio.exp() - 1 - log_ratio).clamp(-10, 10)
assert close(O.compute_approx_kl(logprobs, ref_logprobs, kl_estimator='k3'), k3)
logits, labels = torch.randn(2, 5), torch.randint(0, 5, (2,))
logp = torch.log_softmax(logits.double() / 0.5, -1)
assert close(O.log_probs_from_logits(logits, labels, 0.5), logp.gather(-1, labels[:, None])[:, 0])
logp = torch.log_softmax(logits.double(), -1)
assert close(O.compute_entropy(logits), -(logp.exp() * logp).sum(-1))
assert not any(m == "openrlhf" or m.startswith("openrlhf.") for m in sys.modules)
print("agree")
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    assert out.stdout.split() == ["agree"], out.stderr


def test_the_user_facing_flash_attn_stub_lets_openrlhf_import_and_patch(peer):
    # What docs/integrations.md tells a CPU user to run, in a fresh interpreter.
    code = (
        "import pyppo.integrations.openrlhf as o\n"
        "assert o.install_flash_attn_stub() and o.install_flash_attn_stub()\n"
        "import openrlhf.models.utils as u\n"
        "p = o.patch()\n"
        "assert u.compute_approx_kl is o.compute_approx_kl and p\n"
        "import flash_attn.bert_padding as bp\n"
        "try:\n"
        "    bp.pad_input()\n"
        "except NotImplementedError as e:\n"
        "    assert 'install_flash_attn_stub' in str(e)\n"
        "else:\n"
        "    raise AssertionError('the stub ran')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
