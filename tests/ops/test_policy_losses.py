"""GSPO and CISPO (pyppo.ops.policy_losses), eager and fused (linear_ppo_loss): against float64
references written token by token from the papers, against veRL 0.9.1's registered losses, the
first ratio, the per-sequence clip, gradcheck, opcheck, reduced precision and errors."""

import math

import pytest
import torch

from pyppo import ops
from pyppo.ops.losses import LOSS_AGG_MODES
from pyppo.ops.policy_losses import GSPO_LOG_RATIO_MAX, POLICY_LOSSES, policy_loss_fn
from support.reference import F64, gen, random_mask, ref_aggregate_loss, ref_linear_logprobs

LOSSES = ("gspo", "cispo")


def _inputs(seed, B=6, T=9, dtype=F64, spread=0.3):
    g = gen(seed)
    lp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = lp + spread * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    return lp.to(dtype), old.to(dtype), adv.to(dtype), random_mask(B, T, g)


def ref_gspo(lp, old, adv, mask, lo, hi, mode, norm=None):
    """GSPO-token (Zheng et al. 2025, eq. 13-14), float64, row by row: s_i the geometric mean of
    the row's token ratios (log-ratios clamped at ±20, mean bounded by 10), each token's ratio
    s_i · π/sg(π), clipped per token."""
    lp, old, adv = lp.to(F64), old.to(F64), adv.to(F64)
    rows = []
    for b in range(lp.shape[0]):
        valid = [t for t in range(lp.shape[1]) if mask[b, t]]
        if not valid:
            rows.append([])
            continue
        d = [float(torch.clamp(lp[b, t] - old[b, t], -20, 20).detach()) for t in valid]
        log_s = math.fsum(d) / len(valid)
        row = []
        for t in valid:
            log_r = lp[b, t] - lp[b, t].detach() + log_s
            r = torch.exp(torch.clamp(log_r, max=GSPO_LOG_RATIO_MAX))
            a = adv[b, t]
            row.append(torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo, 1 + hi)))
        rows.append(row)
    return ref_aggregate_loss(rows, mode, norm if norm is not None else lp.shape[1])


def ref_cispo(lp, old, adv, mask, lo, hi, mode, norm=None):
    """CISPO (MiniMax 2025, eq. 4-5), float64, token by token: −sg(clip(r)) · A · log π."""
    lp, old, adv = lp.to(F64), old.to(F64), adv.to(F64)
    rows = []
    for b in range(lp.shape[0]):
        row = []
        for t in range(lp.shape[1]):
            if mask[b, t]:
                r = torch.exp(torch.clamp(lp[b, t] - old[b, t], -20, 20)).detach()
                row.append(-min(max(float(r), 1 - lo), 1 + hi) * adv[b, t] * lp[b, t])
        rows.append(row)
    return ref_aggregate_loss(rows, mode, norm if norm is not None else lp.shape[1])


REFS = {"gspo": ref_gspo, "cispo": ref_cispo}


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_matches_float64_reference(name, loss_agg, dtype):
    lp, old, adv, m = _inputs(seed=LOSS_AGG_MODES.index(loss_agg) + 10 * LOSSES.index(name), B=7, T=11, dtype=dtype)
    norm = 13 if loss_agg == "seq-mean-token-sum-norm" else None
    x = lp.clone().requires_grad_()
    loss, stats = POLICY_LOSSES[name](
        x, old, adv, m, cliprange_low=0.05, cliprange_high=0.08, loss_agg=loss_agg, loss_agg_norm=norm
    )
    loss.backward()
    xr = lp.to(F64).requires_grad_()
    ref = REFS[name](xr, old, adv, m, 0.05, 0.08, loss_agg, norm)
    ref.backward()
    assert loss.dtype == (F64 if dtype == F64 else torch.float32)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == F64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.double(), ref.detach(), **tol)
    torch.testing.assert_close(
        x.grad.double(),
        xr.grad,
        **({} if dtype != F64 else tol),
        **({} if dtype == F64 else dict(rtol=1e-2, atol=1e-4)),
    )
    assert (x.grad[~m] == 0).all()
    assert 0 < stats["clipfrac"] < 1  # the inputs straddle the clip range: both branches are tested


@pytest.mark.parametrize("name", ("ppo",) + LOSSES)
def test_first_ratio_is_exactly_one_and_the_gradient_is_on_policy(name):
    """logprobs == old_logprobs (a step's first minibatch): every ratio is exactly 1 and the
    gradient is the on-policy policy gradient −A·w (w the loss_agg weight)."""
    lp, _, adv, m = _inputs(seed=3)
    x = lp.clone().requires_grad_()
    loss, stats = POLICY_LOSSES[name](x, lp, adv, m, loss_agg="seq-mean-token-mean")
    loss.backward()
    assert stats["ratio_max"] == 1 and stats["ratio_mean"] == 1 and stats["clipfrac"] == 0
    w = ops.loss_token_weights(m, "seq-mean-token-mean", dtype=F64)
    torch.testing.assert_close(x.grad, -adv * w, rtol=1e-14, atol=0)


def test_gspo_clips_whole_sequences():
    """A sequence whose geometric-mean ratio is past 1 + ε with A > 0 has no gradient on any token,
    even tokens whose own ratio is inside the range (where PPO would push them); the sequence
    ratio is the geometric mean, not the mean of ratios."""
    T = 4
    lp = torch.full((2, T), -1.0, dtype=F64)
    old = lp.clone()
    old[0] = torch.tensor([-1.0, -1.0, -1.0, -2.0])  # token ratios 1, 1, 1, e: s = e^(1/4) ≈ 1.28
    adv = torch.ones(2, T, dtype=F64)
    m = torch.ones(2, T, dtype=torch.bool)
    x = lp.clone().requires_grad_()
    _, stats = ops.gspo_policy_loss(x, old, adv, m)
    (ops.gspo_policy_loss(x, old, adv, m)[0]).backward()
    assert (x.grad[0] == 0).all() and (x.grad[1] != 0).all()
    assert stats["clipfrac"] == 0.5
    torch.testing.assert_close(stats["ratio_max"], torch.tensor(math.exp(0.25), dtype=torch.float32))
    xp = lp.clone().requires_grad_()
    ops.ppo_policy_loss(xp, old, adv, m)[0].backward()
    assert (xp.grad[0, :3] != 0).all()  # PPO's token clip leaves these tokens their gradient


def test_gspo_bound_and_clamp_edges():
    """The sequence log-ratio's upper bound (10) stops the gradient above it, as veRL's clamp
    does; masked garbage (−inf old log-probs, NaN advantages) changes nothing."""
    lp = torch.zeros(2, 3, dtype=F64)
    old = torch.tensor([[-11.0, -11.0, -11.0], [0.0, 0.0, -math.inf]], dtype=F64)
    adv = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, math.nan]], dtype=F64)
    m = torch.tensor([[True, True, True], [True, True, False]])
    x = lp.clone().requires_grad_()
    loss, stats = ops.gspo_policy_loss(x, old, adv, m)
    loss.backward()
    assert torch.isfinite(loss) and (x.grad[0] == 0).all() and x.grad[1, 2] == 0 and (x.grad[1, :2] != 0).all()
    assert stats["ratio_max"] == pytest.approx(math.exp(10), rel=1e-6)


def test_cispo_keeps_every_gradient_and_bounds_the_weight():
    """Clipped tokens keep a gradient (the weight is bounded, not zeroed), unlike PPO's."""
    lp, old, adv, m = _inputs(seed=4, spread=1.0)
    x = lp.clone().requires_grad_()
    loss, stats = ops.cispo_policy_loss(x, old, adv, m, cliprange_low=0.1, cliprange_high=0.1)
    loss.backward()
    r = torch.exp(torch.clamp(lp - old, -20, 20))
    assert stats["clipfrac"] > 0.3
    assert ((x.grad != 0) == (m & (adv != 0))).all()
    w = ops.loss_token_weights(m, dtype=F64)
    torch.testing.assert_close(x.grad, torch.where(m, -r.clamp(0.9, 1.1) * adv * w, 0.0), rtol=1e-14, atol=0)


def _gradcheck_case(name, adv, old, lp):
    """The surrogate gradients are a loss's derivative where its detached parts are locally
    constant: GSPO's under sequence-level advantages and seq-mean-token-mean (then GSPO-token's
    gradient is that of the paper's sequence objective, eq. 5), CISPO's where every weight is
    clipped. Returns (advantages, old_logprobs, loss kwargs) making that so."""
    if name == "gspo":
        return (
            adv[:, :1].expand_as(adv).contiguous(),
            old,
            dict(loss_agg="seq-mean-token-mean", cliprange_low=0.1, cliprange_high=0.1),
        )
    far = torch.where(lp > old, lp + 0.3, lp - 0.3)  # every |log-ratio| = 0.3 > log(1 + ε)
    return adv, far.detach(), dict(cliprange_low=0.01, cliprange_high=0.01)


@pytest.mark.parametrize("name", LOSSES)
def test_gradcheck(name):
    lp, old, adv, m = _inputs(seed=5, B=3, T=5)
    adv, old, kw = _gradcheck_case(name, adv, old, lp)
    _, stats = POLICY_LOSSES[name](lp, old, adv, m, **kw)
    assert name == "gspo" or stats["clipfrac"] == 1
    assert torch.autograd.gradcheck(
        lambda x: POLICY_LOSSES[name](x, old, adv, m, **kw)[0], (lp.clone().requires_grad_(),)
    )


def test_gradcheck_fails_where_the_gradient_is_a_surrogate():
    """Token-level advantages: GSPO-token's gradient is not its value's derivative (the detached
    sequence ratio), which is why test_gradcheck picks its inputs."""
    lp, old, adv, m = _inputs(seed=5, B=3, T=5)
    assert not torch.autograd.gradcheck(
        lambda x: ops.gspo_policy_loss(x, old, adv, m)[0], (lp.clone().requires_grad_(),), raise_exception=False
    )


@pytest.mark.parametrize("name", LOSSES)
def test_errors_name_the_argument(name):
    lp, old, adv, m = _inputs(seed=6)
    fn = POLICY_LOSSES[name]
    with pytest.raises(ValueError, match=f"pyppo.{name}_policy_loss: cliprange_low must be in"):
        fn(lp, old, adv, m, cliprange_low=1.0)
    with pytest.raises(ValueError, match="old_logprobs shape"):
        fn(lp, old[:, :3], adv, m)
    with pytest.raises(ValueError, match="response_mask must be bool or contain only 0 and 1"):
        fn(lp, old, adv, m.double() * 2)
    with pytest.raises(ValueError, match="no valid token"):
        fn(lp, old, adv, torch.zeros_like(m))
    with pytest.raises(ValueError, match=r"policy_loss must be one of \('ppo', 'gspo', 'cispo'\), got 'grpo'"):
        policy_loss_fn("grpo")


# ------------------------------------------------------------------ fused: linear_ppo_loss


def _linear_inputs(seed, B=5, T=7, H=12, V=37, spread=0.05):
    g = gen(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=F64)
    weight = torch.randn(V, H, generator=g, dtype=F64) * 0.3
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = random_mask(B, T, g)
    lp, _ = ref_linear_logprobs(hidden, weight, labels, mask)
    old = lp + spread * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    labels = torch.where(mask, labels, torch.full_like(labels, V + 5))  # garbage where masked
    old = torch.where(mask, old, torch.full_like(old, -math.inf))
    adv = torch.where(mask, adv, torch.full_like(adv, math.nan))
    return dict(
        hidden=hidden.float(),
        weight=weight.float(),
        labels=labels,
        old_logprobs=old.float(),
        advantages=adv.float(),
        response_mask=mask,
    )


@pytest.mark.parametrize("chunk_size", [None, 4, 35])  # one chunk, chunks splitting rows, exactly N
@pytest.mark.parametrize("name", LOSSES)
def test_fused_matches_unfused(name, chunk_size):
    inp = _linear_inputs(seed=20 + (chunk_size or 0))
    kw = dict(cliprange_low=0.02, cliprange_high=0.03, loss_agg="seq-mean-token-mean")
    h, w = inp["hidden"].clone().requires_grad_(), inp["weight"].clone().requires_grad_()
    loss, stats, lp, _ = ops.linear_ppo_loss(
        **{**inp, "hidden": h, "weight": w}, policy_loss=name, chunk_size=chunk_size, **kw
    )
    loss.backward()
    hu, wu = inp["hidden"].clone().requires_grad_(), inp["weight"].clone().requires_grad_()
    lpu = ops.linear_logprobs(hu, wu, inp["labels"], inp["response_mask"], chunk_size=chunk_size)
    loss_u, stats_u = POLICY_LOSSES[name](lpu, inp["old_logprobs"], inp["advantages"], inp["response_mask"], **kw)
    loss_u.backward()
    assert torch.equal(lp, lpu.detach()) and torch.equal(loss.detach(), loss_u.detach())
    for k in stats_u:
        assert torch.equal(stats[k], stats_u[k]), k
    assert 0 < stats["clipfrac"] < 1
    torch.testing.assert_close(h.grad, hu.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad, wu.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", LOSSES)
def test_fused_matches_float64_reference(name):
    inp = _linear_inputs(seed=30)
    kw = dict(cliprange_low=0.02, cliprange_high=0.03)
    h, w = inp["hidden"].clone().requires_grad_(), inp["weight"].clone().requires_grad_()
    loss, *_ = ops.linear_ppo_loss(**{**inp, "hidden": h, "weight": w}, policy_loss=name, chunk_size=6, **kw)
    loss.backward()
    hr, wr = inp["hidden"].double().requires_grad_(), inp["weight"].double().requires_grad_()
    lpr, _ = ref_linear_logprobs(hr, wr, inp["labels"], inp["response_mask"])
    ref = REFS[name](lpr, inp["old_logprobs"], inp["advantages"], inp["response_mask"], 0.02, 0.03, "token-mean")
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), hr.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_fused_gradcheck_and_opcheck(name):
    g = gen(40)
    B, T, H, V = 2, 4, 4, 9
    hidden = torch.randn(B, T, H, generator=g, dtype=F64, requires_grad=True)
    weight = (torch.randn(V, H, generator=g, dtype=F64) * 0.3).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    m = random_mask(B, T, g)
    old = (
        torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None]).squeeze(-1)
        + 0.05 * torch.randn(B, T, generator=g, dtype=F64)
    ).detach()
    adv = torch.randn(B, T, generator=g, dtype=F64)
    with torch.no_grad():
        lp = ops.linear_logprobs(hidden, weight, labels, m)
    adv, old, kw = _gradcheck_case(name, adv, old, lp)
    assert torch.autograd.gradcheck(
        lambda h, w: ops.linear_ppo_loss(h, w, labels, old, adv, m, policy_loss=name, chunk_size=3, **kw)[0],
        (hidden, weight),
    )
    args = (
        hidden,
        weight,
        labels,
        old,
        adv,
        m,
        ops.loss_token_weights(m, dtype=F64),
        None,
        None,
        1.0,
        -100,
        0.2,
        0.2,
        None,
        0.0,
        "k3",
        0.0,
        False,
        3,
        [True, True, False],
        name,
    )
    torch.library.opcheck(torch.ops.pyppo.linear_ppo_loss.default, args)


def test_fused_errors():
    inp = _linear_inputs(seed=50)
    with pytest.raises(ValueError, match="pyppo.linear_ppo_loss: dual_clip applies to policy_loss 'ppo' only"):
        ops.linear_ppo_loss(**inp, policy_loss="gspo", dual_clip=3.0)
    with pytest.raises(ValueError, match="pyppo.linear_ppo_loss: policy_loss must be one of 'ppo', 'gspo', 'cispo'"):
        ops.linear_ppo_loss(**inp, policy_loss="GSPO")


# ------------------------------------------------------------------ against veRL 0.9.1


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("name", LOSSES)
def test_matches_verl(name, loss_agg):
    """Value, gradient and clip fraction of veRL's registered loss on the same inputs. veRL's
    seq-mean-token-mean divides by (n + 1e-8): hence the tolerance."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.workers.config import ActorConfig

    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.04,
        clip_ratio_high=0.06,
    )
    for dtype in (torch.float32, F64):
        lp, old, adv, m = _inputs(seed=60 + LOSSES.index(name), dtype=dtype, spread=0.2)
        m[:, 0] = True  # veRL's mean over an empty row divides 0 by 1e-8 (fine) but keep rows alive
        x, xv = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        loss, stats = POLICY_LOSSES[name](x, old, adv, m, cliprange_low=0.04, cliprange_high=0.06, loss_agg=loss_agg)
        loss.backward()
        loss_v, metrics = core_algos.POLICY_LOSS_REGISTRY[name](old, xv, adv, m.to(dtype), loss_agg, config)
        loss_v.backward()
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(loss, loss_v.detach().to(loss.dtype), **tol)
        torch.testing.assert_close(x.grad, xv.grad, **tol)
        assert float(stats["clipfrac"]) == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
        assert 0 < float(stats["clipfrac"]) < 1
