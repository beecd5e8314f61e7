"""linear_ppo_loss against the unfused path (linear_logprobs + ppo_policy_loss + kl_penalty +
aggregate_loss) and the float64 reference: values, gradients, every loss_agg mode, micro-batch
accumulation, clip boundaries, reduced precision, gradcheck, opcheck, errors.

Tests taking ``device`` run on every device present (conftest.py); those taking ``path`` also
through the Meta kernel that torch.compile traces."""

import math

import pytest
import torch

from pyppo import ops
from pyppo.ops.losses import LOG_RATIO_CLAMP, LOSS_AGG_MODES, loss_normalizer
from support.reference import F64, assert_same_error, gen, grad_tol, random_mask, ref_linear_ppo_loss

OP = torch.ops.pyppo.linear_ppo_loss.default


def _inputs(seed, B=5, T=7, H=12, V=37, dtype=torch.float32, with_bias=True, garbage=True):
    """Inputs whose ratios straddle the clip range; masked positions hold garbage (an
    out-of-range label, −inf old log-probs, NaN advantages and reference log-probs)."""
    g = gen(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=F64)
    weight = torch.randn(V, H, generator=g, dtype=F64) * 0.3
    bias = torch.randn(V, generator=g, dtype=F64) * 0.1 if with_bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = random_mask(B, T, g)  # holes, an all-masked row, a single-token row
    lp = torch.log_softmax(hidden @ weight.T + (bias if with_bias else 0), -1).gather(-1, labels[..., None]).squeeze(-1)
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    ref = lp + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    if garbage:
        labels = torch.where(mask, labels, torch.full_like(labels, V + 5))
        old = torch.where(mask, old, torch.full_like(old, -math.inf))
        adv = torch.where(mask, adv, torch.full_like(adv, math.nan))
        ref = torch.where(mask, ref, torch.full_like(ref, math.nan))
    cast = (lambda t: t.to(dtype)) if dtype != F64 else (lambda t: t)
    rollout = F64 if dtype == F64 else torch.float32
    return dict(
        hidden=cast(hidden),
        weight=cast(weight),
        bias=None if bias is None else cast(bias),
        labels=labels,
        old_logprobs=old.to(rollout),
        advantages=adv.to(rollout),
        response_mask=mask,
        ref_logprobs=ref.to(rollout),
    )


def _unfused(
    hidden,
    weight,
    labels,
    old_logprobs,
    advantages,
    response_mask,
    *,
    bias=None,
    ref_logprobs=None,
    kl_loss_coef=0.0,
    kl_loss_estimator="k3",
    entropy_coef=0.0,
    cliprange_low=0.2,
    cliprange_high=0.2,
    dual_clip=None,
    loss_agg="token-mean",
    loss_agg_norm=None,
    normalizer=None,
    temperature=1.0,
    chunk_size=None,
    return_entropy=False,
):
    """The path linear_ppo_loss fuses, as the docstring writes it."""
    lp, ent = ops.linear_logprobs(
        hidden,
        weight,
        labels,
        response_mask,
        bias=bias,
        temperature=temperature,
        return_entropy=True,
        chunk_size=chunk_size,
    )
    agg = dict(loss_agg=loss_agg, loss_agg_norm=loss_agg_norm, normalizer=normalizer)
    loss, stats = ops.ppo_policy_loss(
        lp,
        old_logprobs,
        advantages,
        response_mask,
        cliprange_low=cliprange_low,
        cliprange_high=cliprange_high,
        dual_clip=dual_clip,
        **agg,
    )
    stats["policy_loss"] = loss.detach().float()
    if kl_loss_coef > 0:
        kl_loss = ops.aggregate_loss(
            ops.kl_penalty(lp, ref_logprobs, estimator=kl_loss_estimator), response_mask, **agg
        )
        stats["kl_loss"] = kl_loss.detach().float()
        loss = loss + kl_loss_coef * kl_loss
    if entropy_coef > 0:
        entropy_loss = ops.aggregate_loss(ent, response_mask, **agg)
        stats["entropy_loss"] = entropy_loss.detach().float()
        loss = loss - entropy_coef * entropy_loss
    return loss, stats, lp, ent


def _run(fn, inp, **kw):
    """fn's (loss, stats, logprobs, grads of hidden/weight/bias) on fresh leaves."""
    leaves = {k: inp[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias") if inp[k] is not None}
    loss, stats, lp, _ = fn(**{**inp, **leaves}, **kw)
    loss.backward()
    return loss.detach(), stats, lp.detach(), {k: v.grad for k, v in leaves.items()}


def _assert_matches_unfused(inp, rtol=1e-5, atol=1e-7, **kw):
    loss, stats, lp, grads = _run(ops.linear_ppo_loss, inp, **kw)
    loss_u, stats_u, lp_u, grads_u = _run(_unfused, inp, **kw)
    # Same chunks, same GEMMs, same gather kernel: the same log-prob bits, hence the same loss and
    # stats bits (they are computed from the log-probs by the same code).
    assert torch.equal(lp, lp_u)
    assert loss.dtype == loss_u.dtype and torch.equal(loss, loss_u)
    assert stats.keys() == stats_u.keys()
    for k in stats:
        assert stats[k].dtype == torch.float32 and not stats[k].requires_grad
        torch.testing.assert_close(stats[k], stats_u[k], rtol=0, atol=0, msg=k)
    for k in grads_u:
        torch.testing.assert_close(grads[k], grads_u[k], rtol=rtol, atol=atol, msg=k)
    return loss, stats, grads


# ------------------------------------------------------------------ against the unfused path


@pytest.mark.parametrize("chunk_size", [None, 4])  # 4 does not divide N = 35
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_matches_unfused_every_loss_agg(loss_agg, chunk_size):
    inp = _inputs(seed=LOSS_AGG_MODES.index(loss_agg) + (chunk_size or 0))
    _assert_matches_unfused(
        inp,
        loss_agg=loss_agg,
        chunk_size=chunk_size,
        cliprange_high=0.28,
        loss_agg_norm=11 if loss_agg == "seq-mean-token-sum-norm" else None,
    )


@pytest.mark.parametrize("estimator", ops.KL_ESTIMATORS)
def test_kl_term_every_estimator(estimator):
    inp = _inputs(seed=20 + ops.KL_ESTIMATORS.index(estimator))
    _, stats, _ = _assert_matches_unfused(inp, kl_loss_coef=0.3, kl_loss_estimator=estimator, chunk_size=6)
    assert stats["kl_loss"] != 0


def test_entropy_term_dual_clip_and_temperature():
    inp = _inputs(seed=30)
    inp["advantages"] = inp["advantages"] - 0.5  # mostly negative: the dual clip binds
    inp["old_logprobs"] = inp["old_logprobs"] - 0.8  # ratios well above 1 + ε
    loss, stats, _ = _assert_matches_unfused(
        inp, entropy_coef=0.05, dual_clip=1.5, temperature=0.7, cliprange_low=0.1, cliprange_high=0.3, chunk_size=8
    )
    assert stats["clipfrac_lower"] > 0 and stats["entropy_loss"] > 0
    _, _, _, ent = ops.linear_ppo_loss(**inp, entropy_coef=0.05, temperature=0.7)
    assert ent is not None and ent.shape == inp["labels"].shape
    assert ops.linear_ppo_loss(**inp)[3] is None


def test_log_ratio_clamp():
    inp = _inputs(seed=31)
    m = inp["response_mask"]
    old = inp["old_logprobs"].clone()
    old[0, :3] = -40.0  # log-ratio > 20
    old[0, 3:5] = 30.0  # log-ratio < -20
    inp["old_logprobs"] = old
    assert m[0, :5].all()
    _, stats, _ = _assert_matches_unfused(inp)
    assert stats["logratio_clampfrac"] > 0 and LOG_RATIO_CLAMP == 20.0


def test_without_bias_and_with_frozen_head():
    inp = _inputs(seed=32, with_bias=False)
    _assert_matches_unfused(inp)
    h = inp["hidden"].clone().requires_grad_()
    loss, *_ = ops.linear_ppo_loss(**{**inp, "hidden": h})  # weight does not require grad (LoRA, frozen head)
    loss.backward()
    hu = inp["hidden"].clone().requires_grad_()
    loss_u, *_ = _unfused(**{**inp, "hidden": hu})
    loss_u.backward()
    torch.testing.assert_close(h.grad, hu.grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ against the float64 reference


@pytest.mark.parametrize("case", ["plain", "kl_k2_entropy", "dual_seq_mean", "sum_norm_temperature"])
def test_matches_float64_reference(case):
    kw = {
        "plain": dict(),
        "kl_k2_entropy": dict(kl_loss_coef=0.2, kl_loss_estimator="k2", entropy_coef=0.03),
        "dual_seq_mean": dict(dual_clip=2.0, loss_agg="seq-mean-token-mean", cliprange_high=0.3),
        "sum_norm_temperature": dict(
            loss_agg="seq-mean-token-sum-norm",
            loss_agg_norm=9,
            temperature=0.6,
            kl_loss_coef=0.1,
            kl_loss_estimator="abs",
        ),
    }[case]
    inp = _inputs(seed=40 + len(case))
    inp["advantages"] = inp["advantages"] - 0.3  # some negative advantages with ratios past 1 + ε
    loss, _, lp, grads = _run(ops.linear_ppo_loss, inp, chunk_size=5, **kw)

    leaves = {k: inp[k].double().requires_grad_() for k in ("hidden", "weight", "bias")}
    ref_loss, lp_r, _ = ref_linear_ppo_loss(
        leaves["hidden"],
        leaves["weight"],
        inp["labels"],
        inp["old_logprobs"],
        inp["advantages"],
        inp["response_mask"],
        bias=leaves["bias"],
        ref=inp["ref_logprobs"],
        kl_coef=kw.get("kl_loss_coef", 0.0),
        estimator=kw.get("kl_loss_estimator", "k3"),
        entropy_coef=kw.get("entropy_coef", 0.0),
        lo=kw.get("cliprange_low", 0.2),
        hi=kw.get("cliprange_high", 0.2),
        dual=kw.get("dual_clip"),
        mode=kw.get("loss_agg", "token-mean"),
        norm=kw.get("loss_agg_norm"),
        temperature=kw.get("temperature", 1.0),
    )
    ref_loss.backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp.double(), lp_r.detach(), rtol=1e-5, atol=1e-5)
    assert (lp[~inp["response_mask"]] == 0).all()
    for k, v in leaves.items():
        torch.testing.assert_close(grads[k].double(), v.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_gradcheck_float64():
    inp = _inputs(seed=50, B=3, T=4, H=4, V=9, dtype=F64)
    args = [inp[k].requires_grad_() for k in ("hidden", "weight", "bias")]
    rest = {k: v for k, v in inp.items() if k not in ("hidden", "weight", "bias")}

    def f(h, w, b):
        return ops.linear_ppo_loss(
            h, w, bias=b, **rest, kl_loss_coef=0.1, entropy_coef=0.02, dual_clip=3.0, temperature=0.8, chunk_size=5
        )[0]

    assert f(*args).dtype == F64
    assert torch.autograd.gradcheck(f, args)


# ------------------------------------------------------------------ the kinks: ties and clip bounds


def _ratios(inp):
    """The ratios ppo_policy_loss computes for these inputs, and the log-probs (one chunk, so the
    op's per-token arithmetic runs over the same contiguous layout)."""
    with torch.no_grad():
        lp = ops.linear_logprobs(inp["hidden"], inp["weight"], inp["labels"], inp["response_mask"], bias=inp["bias"])
    d = torch.clamp(lp - inp["old_logprobs"], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return lp, torch.exp(torch.where(inp["response_mask"], d, torch.zeros(())))


def test_ratio_exactly_one_splits_the_tie():
    # The first PPO epoch: the policy that trains is the one that sampled, every ratio is exactly
    # 1, the two surrogate terms tie everywhere and their half-gradients must add up to −A.
    inp = _inputs(seed=60)
    inp["old_logprobs"] = _ratios(inp)[0]
    assert (_ratios(inp)[1] == 1).all()
    _, stats, grads = _assert_matches_unfused(inp)
    assert stats["clipfrac"] == 0
    # −A at every valid token, so the loss gradient is that of −mean(A·lp): check through hidden.
    h = inp["hidden"].clone().requires_grad_()
    lp = ops.linear_logprobs(h, inp["weight"], inp["labels"], inp["response_mask"], bias=inp["bias"])
    m = inp["response_mask"]
    (-(torch.where(m, inp["advantages"], torch.zeros(())) * lp).sum() / m.sum()).backward()
    torch.testing.assert_close(grads["hidden"], h.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("where", ["upper", "lower", "dual"])
@pytest.mark.parametrize("nudge", [0, 1])  # 0: exactly on the bound; 1: the bound one float32 step toward 1
def test_clip_bounds(where, nudge):
    # torch.clamp passes the gradient on its bounds and torch.maximum / minimum split it at a
    # tie: a token whose ratio is exactly 1 + ε (A > 0), 1 − ε (A < 0) or the dual-clip bound
    # c (A < 0) keeps its gradient; one step past the bound it has none.
    inp = _inputs(seed=61)
    m, adv = inp["response_mask"], inp["advantages"]
    _, r = _ratios(inp)
    pick = {
        "upper": m & (adv > 0) & (r > 1.05),
        "lower": m & (adv < 0) & (r < 0.95),
        "dual": m & (adv < 0) & (r > 1.25),
    }[where]
    k = tuple(int(i) for i in pick.nonzero()[0])
    bound = r[k]  # float32, so 1 ± ε below round back to it exactly
    if nudge:
        bound = torch.nextafter(bound, torch.tensor(1.0))
    bound = bound.item()
    kw = {
        "upper": dict(cliprange_high=bound - 1.0),
        "lower": dict(cliprange_low=1.0 - bound),
        "dual": dict(dual_clip=bound),
    }[where]
    _assert_matches_unfused(inp, **kw)
    h = inp["hidden"].clone().requires_grad_()
    loss, *_ = ops.linear_ppo_loss(**{**inp, "hidden": h}, **kw)
    (g,) = torch.autograd.grad(loss, h)
    assert bool(g[k].abs().max() > 0) == (nudge == 0)


# ------------------------------------------------------------------ masks and micro-batches


@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_micro_batches_with_normalizer_sum_to_the_minibatch(loss_agg):
    inp = _inputs(seed=70 + LOSS_AGG_MODES.index(loss_agg), B=6)
    kw = dict(loss_agg=loss_agg, kl_loss_coef=0.1, entropy_coef=0.01, chunk_size=4)
    normalizer = loss_normalizer(inp["response_mask"], loss_agg)
    full_loss, _, _, full = _run(ops.linear_ppo_loss, inp, normalizer=normalizer, **kw)
    # Without normalizer a micro-batch would be averaged over its own tokens or rows.
    plain, *_ = _run(ops.linear_ppo_loss, inp, **kw)
    torch.testing.assert_close(plain, full_loss)  # same thing on the whole minibatch
    total, grads_w, grads_h = 0.0, 0.0, []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):  # row 1 is all-masked
        part = {
            k: (
                v[rows]
                if k in ("hidden", "labels", "old_logprobs", "advantages", "response_mask", "ref_logprobs")
                else v
            )
            for k, v in inp.items()
        }
        loss, _, _, g = _run(ops.linear_ppo_loss, part, normalizer=normalizer, **kw)
        total = total + loss
        grads_w = grads_w + g["weight"]
        grads_h.append(g["hidden"])
    torch.testing.assert_close(total, full_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads_w, full["weight"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat(grads_h), full["hidden"], rtol=1e-5, atol=1e-7)


def test_all_masked_batch():
    inp = _inputs(seed=80)
    inp["response_mask"] = torch.zeros_like(inp["response_mask"])
    loss, stats, lp, grads = _run(ops.linear_ppo_loss, inp, normalizer=17, kl_loss_coef=0.1, entropy_coef=0.1)
    assert loss == 0 and (lp == 0).all() and stats["policy_loss"] == 0
    assert all((g == 0).all() for g in grads.values())
    with pytest.raises(ValueError, match="pyppo.linear_ppo_loss: mask has no valid token"):
        ops.linear_ppo_loss(**inp)


def test_masked_garbage_changes_nothing():
    a = _inputs(seed=81, garbage=True)
    b = _inputs(seed=81, garbage=False)
    kw = dict(kl_loss_coef=0.2, entropy_coef=0.05, dual_clip=2.0, chunk_size=6)
    la, sa, lpa, ga = _run(ops.linear_ppo_loss, a, **kw)
    lb, sb, lpb, gb = _run(ops.linear_ppo_loss, b, **kw)
    assert torch.isfinite(la) and torch.equal(la, lb) and torch.equal(lpa, lpb)
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k


def test_backward_scales_by_the_incoming_gradient():
    inp = _inputs(seed=82)
    h = inp["hidden"].clone().requires_grad_()
    loss, *_ = ops.linear_ppo_loss(**{**inp, "hidden": h}, chunk_size=4)
    (g1,) = torch.autograd.grad(loss, h, retain_graph=True)
    (g3,) = torch.autograd.grad(loss * 3.5, h, retain_graph=True)
    torch.testing.assert_close(g3, 3.5 * g1)
    # The saved gradients are not consumed: a second backward through the graph gives the same.
    (g1b,) = torch.autograd.grad(loss, h)
    assert torch.equal(g1, g1b)


def test_raw_op_loss_is_the_weighted_sum():
    inp = _inputs(seed=83)
    kw = dict(kl_loss_coef=0.2, entropy_coef=0.05, dual_clip=2.0)
    loss, *_ = ops.linear_ppo_loss(**inp, loss_agg="seq-mean-token-mean", **kw)
    w = ops.loss_token_weights(inp["response_mask"], "seq-mean-token-mean")
    raw = OP(
        inp["hidden"],
        inp["weight"],
        inp["labels"],
        inp["old_logprobs"],
        inp["advantages"],
        inp["response_mask"],
        w,
        inp["ref_logprobs"],
        inp["bias"],
        1.0,
        -100,
        0.2,
        0.2,
        2.0,
        0.2,
        "k3",
        0.05,
        False,
        0,
        [False, False, False],
    )
    torch.testing.assert_close(raw[0], loss, rtol=1e-6, atol=1e-7)
    assert raw[2].numel() > 0  # entropy, which the entropy term needs, is returned
    assert all(t.numel() == 0 for t in raw[3:])  # no gradient asked for, none computed


def test_no_grad_computes_no_gradient():
    inp = _inputs(seed=84)
    h = inp["hidden"].clone().requires_grad_()
    with torch.no_grad():
        loss, stats, lp, _ = ops.linear_ppo_loss(**{**inp, "hidden": h})
    assert not loss.requires_grad and not lp.requires_grad
    loss_u, *_ = _unfused(**inp)
    assert torch.equal(loss, loss_u.detach())


def test_second_derivative_is_an_error_not_silent_zeros():
    inp = _inputs(seed=85, B=2, T=3, H=4, V=9, dtype=F64)
    h = inp["hidden"].requires_grad_()
    loss, *_ = ops.linear_ppo_loss(**inp)
    (g,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        g.sum().backward()


# ------------------------------------------------------------------ reduced precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_matches_unfused(dtype):
    inp = _inputs(seed=90, dtype=dtype)
    loss, _, lp, grads = _run(ops.linear_ppo_loss, inp, chunk_size=8, kl_loss_coef=0.1, entropy_coef=0.01)
    loss_u, _, lp_u, grads_u = _run(_unfused, inp, chunk_size=8, kl_loss_coef=0.1, entropy_coef=0.01)
    assert loss.dtype == torch.float32 and lp.dtype == torch.float32
    assert torch.equal(loss, loss_u) and torch.equal(lp, lp_u)
    for k in grads:
        assert grads[k].dtype == dtype
        # Both write the logits gradient in the input dtype and run the same GEMMs: what remains
        # is a rounding of the per-token derivative, well under the dtype's own step.
        torch.testing.assert_close(grads[k], grads_u[k], **grad_tol(dtype), msg=k)
    # Against float64 on the same rounded logits: the tolerance of a float32 op.
    leaves = {k: inp[k].double().requires_grad_() for k in ("hidden", "weight")}
    ref_loss, _, _ = ref_linear_ppo_loss(
        leaves["hidden"],
        leaves["weight"],
        inp["labels"],
        inp["old_logprobs"],
        inp["advantages"],
        inp["response_mask"],
        bias=inp["bias"],
        ref=inp["ref_logprobs"],
        kl_coef=0.1,
        entropy_coef=0.01,
        logits_dtype=dtype,
    )
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------ the raw op


def _raw_args(inp, **over):
    a = dict(
        hidden=inp["hidden"],
        weight=inp["weight"],
        labels=inp["labels"],
        old_logprobs=inp["old_logprobs"],
        advantages=inp["advantages"],
        response_mask=inp["response_mask"],
        token_weights=ops.loss_token_weights(inp["response_mask"]),
        ref_logprobs=inp["ref_logprobs"],
        bias=inp["bias"],
        temperature=0.9,
        ignore_index=-100,
        cliprange_low=0.2,
        cliprange_high=0.25,
        dual_clip=3.0,
        kl_loss_coef=0.1,
        kl_loss_estimator="k3",
        entropy_coef=0.02,
        return_entropy=True,
        chunk_size=3,
        output_mask=[True, True, True],
    )
    a.update(over)
    return tuple(a.values())


def test_opcheck():
    inp = _inputs(seed=100, B=2, T=5, H=8, V=33)
    for k in ("hidden", "weight", "bias"):
        inp[k].requires_grad_()
    torch.library.opcheck(OP, _raw_args(inp))


def test_device_matches_unfused(device):
    inp = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in _inputs(seed=101).items()}
    loss, _, lp, grads = _run(ops.linear_ppo_loss, inp, chunk_size=8, kl_loss_coef=0.1, entropy_coef=0.01)
    loss_u, _, lp_u, grads_u = _run(_unfused, inp, chunk_size=8, kl_loss_coef=0.1, entropy_coef=0.01)
    torch.testing.assert_close(loss, loss_u, rtol=1e-5, atol=1e-6)
    for k in grads:
        torch.testing.assert_close(grads[k], grads_u[k], rtol=1e-4, atol=1e-6, msg=k)


def _bad_cases():
    inp = _inputs(seed=110, garbage=False)
    bad_label = inp["labels"].clone()
    bad_label[0, 0] = 1000  # row 0 is fully valid
    return {
        "weight": (dict(weight=inp["weight"][:, :5]), "weight"),
        "weight_dtype": (dict(weight=inp["weight"].double()), "weight"),
        "labels_shape": (dict(labels=inp["labels"][:, :3]), "labels"),
        "labels_range": (dict(labels=bad_label), r"labels\[0\]"),
        "bias": (dict(bias=inp["bias"][:10]), "bias"),
        "old_logprobs": (dict(old_logprobs=inp["old_logprobs"][:, :3]), "old_logprobs"),
        "advantages": (dict(advantages=inp["advantages"].long()), "advantages"),
        "response_mask_shape": (dict(response_mask=inp["response_mask"][:2]), "response_mask"),
        "response_mask_values": (dict(response_mask=inp["response_mask"].float() * 0.5), "response_mask"),
        "ref_logprobs_missing": (dict(kl_loss_coef=0.1, ref_logprobs=None), "ref_logprobs"),
        "ref_logprobs_shape": (dict(kl_loss_coef=0.1, ref_logprobs=inp["ref_logprobs"][:1]), "ref_logprobs"),
        "kl_loss_estimator": (dict(kl_loss_estimator="k4"), "kl_loss_estimator"),
        "kl_loss_coef": (dict(kl_loss_coef=-1.0), "kl_loss_coef"),
        "entropy_coef": (dict(entropy_coef=math.inf), "entropy_coef"),
        "cliprange_low": (dict(cliprange_low=1.0), "cliprange_low"),
        "cliprange_high": (dict(cliprange_high=0.0), "cliprange_high"),
        "dual_clip": (dict(dual_clip=1.0), "dual_clip"),
        "loss_agg": (dict(loss_agg="token-sum"), "loss_agg"),
        "loss_agg_norm": (dict(loss_agg="seq-mean-token-sum-norm", loss_agg_norm=0), "loss_agg_norm"),
        "normalizer": (dict(normalizer=-2), "normalizer"),
        "temperature": (dict(temperature=0.0), "temperature"),
        "chunk_size": (dict(chunk_size=0), "chunk_size"),
        "hidden_2d": (dict(hidden=inp["hidden"][0]), "hidden"),
    }, inp


@pytest.mark.parametrize("case", sorted(_bad_cases()[0]))
def test_bad_inputs_name_the_argument(case):
    cases, inp = _bad_cases()
    over, name = cases[case]
    with pytest.raises(ValueError, match=rf"^pyppo\.linear_ppo_loss: .*{name}"):
        ops.linear_ppo_loss(**{**inp, **over})


_RAW_BAD = {
    "weight_shape": dict(weight=lambda i: i["weight"][:, :5]),
    "labels_shape": dict(labels=lambda i: i["labels"][:, :3]),
    "old_logprobs_shape": dict(old_logprobs=lambda i: i["old_logprobs"][:, :3]),
    "token_weights_dtype": dict(token_weights=lambda i: torch.ones_like(i["labels"])),
    "ref_missing": dict(ref_logprobs=lambda i: None),
    "estimator": dict(kl_loss_estimator=lambda i: "kl"),
    "dual_clip": dict(dual_clip=lambda i: 0.5),
    "chunk_size": dict(chunk_size=lambda i: -1),
}


@pytest.mark.parametrize("case", sorted(_RAW_BAD))
def test_errors_are_the_same_on_every_path(path, case):
    inp = _inputs(seed=111, garbage=False)
    over = {k: f(inp) for k, f in _RAW_BAD[case].items()}
    assert_same_error(path, lambda *a: OP(*a), *_raw_args(inp, **over))


def test_peak_memory_is_one_chunk_and_the_gradients():
    # Nothing of size [N, V]: the forward holds one [chunk, V] buffer and the accumulating
    # grad_weight, the backward the saved grad_weight and its scaled copy (torch's allocator
    # counts, outputs included).
    from pyppo.bench.memory import peak_extra_bytes

    B, T, H, V, C = 4, 64, 64, 8192, 32
    inp = _inputs(seed=120, B=B, T=T, H=H, V=V, with_bias=False)
    h, w = inp["hidden"].requires_grad_(), inp["weight"].requires_grad_()

    def step(_):
        loss, *_ = ops.linear_ppo_loss(**inp, chunk_size=C)
        loss.backward()
        out = (h.grad, w.grad)
        h.grad = w.grad = None
        return out

    peak = peak_extra_bytes(step, None, torch.device("cpu"), "alloc")["alloc"]
    chunk, grad_w, grad_h = C * V * 4, V * H * 4, B * T * H * 4
    assert peak <= max(chunk + grad_w, 2 * grad_w) + grad_h + 256 * 1024
    assert peak < B * T * V * 4  # less than the logits alone
