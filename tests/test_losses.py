"""PPO policy / value losses against a float64 reference written token by token."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo.ops.losses import LOSS_AGG_MODES, aggregate_loss, loss_normalizer, ppo_policy_loss, ppo_value_loss


# ------------------------------------------------------------------------------ reference
def ref_aggregate(rows, mode, norm):
    """rows: list (one per sequence) of lists of per-token float64 tensors (valid tokens only)."""
    if mode == "token-mean":
        toks = [x for r in rows for x in r]
        return sum(toks) / len(toks)
    kept = [r for r in rows if len(r) > 0]  # sequences without a valid token are excluded
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in kept) / len(kept)
    seq_mean = sum(sum(r) for r in kept) / len(kept)
    if mode == "seq-mean-token-sum":
        return seq_mean
    return seq_mean / norm


def ref_policy_loss(lp, old, adv, mask, lo, hi, dual, mode, norm):
    B, T = lp.shape
    rows, n, clipped, lower, kl, ratios = [], 0, 0, 0, 0.0, []
    for b in range(B):
        row = []
        for t in range(T):
            if not mask[b, t]:
                continue
            r = torch.exp(lp[b, t] - old[b, t])
            a = adv[b, t]
            l1 = -a * r
            l2 = -a * min(max(r, 1 - lo), 1 + hi)
            l = l1 if l1 >= l2 else l2
            clipped += int(l2 > l1)
            if dual is not None and a < 0:
                l3 = -a * dual
                lower += int(l3 < l)
                l = l if l <= l3 else l3
            row.append(l)
            n += 1
            kl += (r - 1 - (lp[b, t] - old[b, t])).item()
            ratios.append(r.item())
        rows.append(row)
    stats = dict(clipfrac=clipped / n, clipfrac_lower=lower / n, approx_kl=kl / n,
                 ratio_mean=sum(ratios) / n, ratio_max=max(ratios))
    return ref_aggregate(rows, mode, norm), stats


def ref_value_loss(v, v_old, ret, mask, eps, mode, norm):
    B, T = v.shape
    rows, n, clipped = [], 0, 0
    for b in range(B):
        row = []
        for t in range(T):
            if not mask[b, t]:
                continue
            e1 = (v[b, t] - ret[b, t]) ** 2
            if eps is None:
                l = 0.5 * e1
            else:
                vc = v_old[b, t] + min(max(v[b, t] - v_old[b, t], -eps), eps)
                e2 = (vc - ret[b, t]) ** 2
                clipped += int(e2 > e1)
                l = 0.5 * (e1 if e1 >= e2 else e2)
            row.append(l)
            n += 1
        rows.append(row)
    m = mask.bool()
    r, d = ret[m].double(), (ret[m] - v.detach()[m]).double()
    ev = 1 - d.var(unbiased=False) / r.var(unbiased=False)
    return ref_aggregate(rows, mode, norm), dict(vf_clipfrac=clipped / n, explained_variance=float(ev))


def random_inputs(seed, B=6, T=9, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.7  # holes everywhere
    mask[1] = False  # an all-masked row
    mask[2, :] = False
    mask[2, 4] = True  # a single valid token in the middle
    return lp, old, adv, mask


# ------------------------------------------------------------------------------ policy loss
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("clips", [(0.2, 0.2), (0.1, 0.28)])
@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_matches_reference(mode, dual, clips, seed):
    lp, old, adv, mask = random_inputs(seed)
    lo, hi = clips
    norm = 7.0 if mode == "seq-mean-token-sum-norm" else None
    lp_a = lp.clone().requires_grad_(True)
    loss, stats = ppo_policy_loss(lp_a, old, adv, mask, cliprange_low=lo, cliprange_high=hi, dual_clip=dual,
                                  loss_agg=mode, loss_agg_norm=norm)
    lp_r = lp.clone().requires_grad_(True)
    ref, ref_stats = ref_policy_loss(lp_r, old, adv, mask, lo, hi, dual, mode, norm)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    for k, v in ref_stats.items():
        assert stats[k].dtype == torch.float32 and stats[k].dim() == 0 and not stats[k].requires_grad
        assert stats[k].item() == pytest.approx(v, rel=1e-6, abs=1e-7), k
    (g,) = torch.autograd.grad(loss, lp_a)
    (g_ref,) = torch.autograd.grad(ref, lp_r)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)
    assert torch.all(g[~mask] == 0)


def test_default_norm_is_T():
    lp, old, adv, mask = random_inputs(3, T=11)
    loss, _ = ppo_policy_loss(lp, old, adv, mask, loss_agg="seq-mean-token-sum-norm")
    ref, _ = ref_policy_loss(lp, old, adv, mask, 0.2, 0.2, None, "seq-mean-token-sum-norm", 11)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)


def test_rows_without_valid_tokens_are_excluded_from_seq_means():
    loss_mat = torch.tensor([[1.0, 3.0, 0.0], [100.0, 100.0, 100.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert aggregate_loss(loss_mat, mask, "token-mean").item() == pytest.approx(2.0)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 2.0) / 2)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((4.0 + 2.0) / 2)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx(3.0 / 3)
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_agg_norm=6).item() == pytest.approx(0.5)


def test_clipfrac_and_dual_clip_hand_cases():
    # (ratio, advantage): clipped-term larger?  dual bound active (c=3)?
    cases = [(1.5, 1.0, True, False), (0.5, 1.0, False, False), (1.5, -1.0, False, False),
             (0.5, -1.0, True, False), (5.0, -1.0, False, True), (1.0, 2.0, False, False)]
    ratio = torch.tensor([[c[0] for c in cases]], dtype=torch.float64)
    adv = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    lp = old + ratio.log()
    mask = torch.ones_like(ratio, dtype=torch.bool)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0)
    assert stats["clipfrac"].item() == pytest.approx(2 / 6)
    assert stats["clipfrac_lower"].item() == pytest.approx(1 / 6)
    expected = [-1.2, -0.5, 1.5, 0.8, 3.0, -2.0]
    assert loss.item() == pytest.approx(sum(expected) / 6)
    assert stats["ratio_max"].item() == pytest.approx(5.0)


def test_ratio_one_gives_exact_stats():
    lp, _, adv, mask = random_inputs(4)
    lp = lp.float()
    loss, stats = ppo_policy_loss(lp, lp.clone(), adv.float(), mask)
    assert stats["ratio_mean"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["approx_kl"].item() == 0.0 and stats["clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx(-adv[mask].mean().item(), rel=1e-5)


def test_masked_garbage_does_not_leak():
    lp, old, adv, mask = random_inputs(5)
    lp2, old2, adv2 = lp.clone(), old.clone(), adv.clone()
    lp2[~mask] = -math.inf
    old2[~mask] = math.nan
    adv2[~mask] = math.inf
    a = lp2.clone().requires_grad_(True)
    loss2, stats2 = ppo_policy_loss(a, old2, adv2, mask, dual_clip=2.0)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, dual_clip=2.0)
    assert loss2.item() == loss.item()
    assert all(stats2[k].item() == stats[k].item() for k in stats)
    (g,) = torch.autograd.grad(loss2, a)
    assert torch.isfinite(g).all() and torch.all(g[~mask] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype):
    lp, old, adv, mask = random_inputs(6)
    loss, stats = ppo_policy_loss(lp.to(dtype), old.to(dtype), adv.to(dtype), mask.float())
    assert loss.dtype == torch.float32
    ref, _ = ref_policy_loss(lp.to(dtype).double(), old.to(dtype).double(), adv.to(dtype).double(), mask,
                             0.2, 0.2, None, "token-mean", None)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    vl, vstats = ppo_value_loss(lp.to(dtype), old.to(dtype), adv.to(dtype), mask)
    assert vl.dtype == torch.float32 and vstats["vf_clipfrac"].dtype == torch.float32


def test_non_contiguous_inputs():
    lp, old, adv, mask = random_inputs(7, B=6, T=18)
    sl = (slice(None), slice(None, None, 2))
    loss, _ = ppo_policy_loss(lp[sl], old[sl], adv[sl], mask[sl], loss_agg="seq-mean-token-mean")
    ref, _ = ref_policy_loss(lp[sl], old[sl], adv[sl], mask[sl], 0.2, 0.2, None, "seq-mean-token-mean", None)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ value loss
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("eps", [0.2, None])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_loss_matches_reference(mode, eps, seed):
    v_old, v, ret, mask = random_inputs(seed, scale=0.3)
    norm = 5.0 if mode == "seq-mean-token-sum-norm" else None
    va = v.clone().requires_grad_(True)
    loss, stats = ppo_value_loss(va, v_old, ret, mask, cliprange_value=eps, loss_agg=mode, loss_agg_norm=norm)
    vr = v.clone().requires_grad_(True)
    ref, ref_stats = ref_value_loss(vr, v_old, ret, mask, eps, mode, norm)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    for k, x in ref_stats.items():
        assert stats[k].dtype == torch.float32 and stats[k].dim() == 0 and not stats[k].requires_grad
        assert stats[k].item() == pytest.approx(x, rel=1e-5, abs=1e-6), k
    (g,) = torch.autograd.grad(loss, va)
    (g_ref,) = torch.autograd.grad(ref, vr)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


def test_explained_variance_edge_cases():
    ret = torch.randn(3, 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    _, s = ppo_value_loss(ret.clone(), ret.clone(), ret, mask)
    assert s["explained_variance"].item() == pytest.approx(1.0)
    _, s = ppo_value_loss(torch.randn(3, 4), torch.zeros(3, 4), torch.full((3, 4), 2.0), mask)
    assert s["explained_variance"].item() == 0.0  # Var[R] = 0: reported as 0, not NaN / -inf


# ------------------------------------------------------------------------------ accumulation
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_normalizer_makes_micro_batches_sum_to_minibatch(mode):
    lp, old, adv, mask = random_inputs(8, B=8, T=7)
    kw = dict(loss_agg=mode, dual_clip=2.5)
    full, _ = ppo_policy_loss(lp, old, adv, mask, **kw)
    n = loss_normalizer(mask, mode)
    parts = [ppo_policy_loss(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], normalizer=n, **kw)[0]
             for i in range(0, 8, 2)]  # rows 1 and 2 (all-masked / one token) fall in the same micro-batch
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-12)
    vfull, _ = ppo_value_loss(lp, old, adv, mask, loss_agg=mode)
    vparts = [ppo_value_loss(lp[i:i + 4], old[i:i + 4], adv[i:i + 4], mask[i:i + 4], loss_agg=mode, normalizer=n)[0]
              for i in range(0, 8, 4)]
    torch.testing.assert_close(sum(vparts), vfull, rtol=1e-12, atol=1e-12)


def test_loss_normalizer_counts():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert loss_normalizer(mask, "token-mean") == 4
    for mode in LOSS_AGG_MODES[1:]:
        assert loss_normalizer(mask, mode) == 2


def test_all_masked_micro_batch_with_normalizer_is_zero():
    lp, old, adv, _ = random_inputs(9)
    mask = torch.zeros_like(lp, dtype=torch.bool)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, normalizer=10)
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in stats.values())


# ------------------------------------------------------------------------------ errors
def _args():
    lp, old, adv, mask = random_inputs(10)
    return lp, old, adv, mask


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_agg="mean"), "loss_agg"),
        (dict(cliprange_low=1.0), "cliprange_low"),
        (dict(cliprange_low=-0.1), "cliprange_low"),
        (dict(cliprange_high=0.0), "cliprange_high"),
        (dict(cliprange_high=math.inf), "cliprange_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(loss_agg="seq-mean-token-sum-norm", loss_agg_norm=0), "loss_agg_norm"),
        (dict(normalizer=0), "normalizer"),
    ],
)
def test_policy_loss_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ppo_policy_loss(*_args(), **kwargs)


def test_shape_dtype_mask_errors():
    lp, old, adv, mask = _args()
    with pytest.raises(ValueError, match="old_logprobs"):
        ppo_policy_loss(lp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="response_mask"):
        ppo_policy_loss(lp, old, adv, mask[:-1])
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(lp, old, adv.long(), mask)
    with pytest.raises(ValueError, match="logprobs"):
        ppo_policy_loss(lp[0], old[0], adv[0], mask[0])
    with pytest.raises(ValueError, match="response_mask"):
        ppo_policy_loss(lp, old, adv, mask.float() * 2)
    with pytest.raises(ValueError, match="no valid token"):
        ppo_policy_loss(lp, old, adv, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="returns"):
        ppo_value_loss(lp, old, adv[:, :3], mask)
    with pytest.raises(ValueError, match="cliprange_value"):
        ppo_value_loss(lp, old, adv, mask, cliprange_value=-1.0)
    with pytest.raises(ValueError, match="loss_agg"):
        ppo_value_loss(lp, old, adv, mask, loss_agg="sum")
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate_loss(lp, mask, "nope")
