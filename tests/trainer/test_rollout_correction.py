"""The sampler-mismatch metrics and the importance-sampling correction: each mode against a
float64 reference and against veRL 0.9.1's rollout-correction weights; in the trainer, a planted
mismatch (log-probs of another temperature) shows in the metrics and re-weights the advantages."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo.config import PPOConfig
from pyppo.rollout import RolloutEngine
from pyppo.trainer.buffer import buffer_from_rollout
from pyppo.trainer.logprob_head import LogprobHead
from pyppo.trainer.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    check_rollout_logprobs,
    mismatch_metrics,
    rollout_is_weights,
)
from support.peer_support import import_peer
from support.trainer_fixture import make_trainer, small_config

MODES = ROLLOUT_CORRECTIONS[1:]


def _inputs(B=6, T=11, seed=0, spread=0.8):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 4
    old = rollout + torch.randn(B, T, generator=g) * spread
    mask = torch.rand(B, T, generator=g) > 0.3  # holes
    mask[2] = False  # an all-masked row
    mask[3] = True
    return old, rollout, mask


def ref_weights(old, rollout, mask, mode, cap):
    """float64, row by row, written from the definitions in docs/trainer.md."""
    B, T = old.shape
    w = torch.zeros(B, T, dtype=torch.float64)
    corrected = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        if not idx:
            continue
        d = [float(old[b, t]) - float(rollout[b, t]) for t in idx]
        if mode.startswith("sequence"):
            d = [sum(d) / len(d)] * len(d)
        for t, x in zip(idx, d):
            r = math.exp(max(-20.0, min(20.0, x)))
            if mode.endswith("truncate"):
                w[b, t], corrected[b, t] = min(r, cap), r > cap
            else:
                out = r > cap or r < 1 / cap
                w[b, t], corrected[b, t] = (0.0 if out else r), out
    return w, corrected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cap", [1.0, 1.5, 2.0, 5.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_match_the_float64_reference(mode, cap, seed):
    old, rollout, mask = _inputs(seed=seed, T=7 + seed)
    w, corrected = rollout_is_weights(old, rollout, mask, mode=mode, cap=cap)
    ref_w, ref_c = ref_weights(old, rollout, mask, mode, cap)
    assert w.dtype == torch.float32 and not w.requires_grad
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(corrected, ref_c)
    assert bool((w[~mask] == 0).all()) and not bool(corrected[~mask].any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_computed_in_float32(dtype):
    old, rollout, mask = _inputs(seed=3)
    w, _ = rollout_is_weights(old.to(dtype), rollout.to(dtype), mask, mode="token_truncate", cap=2.0)
    ref_w, _ = ref_weights(old.to(dtype).float(), rollout.to(dtype).float(), mask, "token_truncate", 2.0)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-6, atol=1e-7)


def test_sequence_weight_is_the_geometric_mean_not_the_product():
    # 40 tokens each 0.05 nats more likely under the trainer: the product of ratios is e^2 = 7.4
    # (beyond a cap of 2 for every long response); their geometric mean is e^0.05.
    old = torch.full((1, 40), -1.0)
    rollout = old - 0.05
    mask = torch.ones(1, 40, dtype=torch.bool)
    w, corrected = rollout_is_weights(old, rollout, mask, mode="sequence_truncate", cap=2.0)
    torch.testing.assert_close(w, torch.full((1, 40), math.exp(0.05)))
    assert not bool(corrected.any())


def test_extreme_log_ratios_stay_finite():
    old = torch.tensor([[0.0, -200.0, 0.0]])
    rollout = torch.tensor([[-500.0, 0.0, 0.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    for mode in MODES:
        w, _ = rollout_is_weights(old, rollout, mask, mode=mode, cap=3.0)
        assert bool(torch.isfinite(w).all()) and float(w.max()) <= 3.0


def test_bad_mode_and_cap_are_errors():
    old, rollout, mask = _inputs()
    with pytest.raises(ValueError, match="mode must be one of"):
        rollout_is_weights(old, rollout, mask, mode="none", cap=2.0)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        rollout_is_weights(old, rollout, mask, mode="token_mask", cap=0.5)
    with pytest.raises(ValueError, match="rollout_is_cap must be"):
        PPOConfig(rollout_is_cap=0.9)
    with pytest.raises(ValueError, match="rollout_correction must be one of"):
        PPOConfig(rollout_correction="sequence")


# ---------------------------------------------------------------- against veRL 0.9.1


def _verl_weights(old, rollout, mask, mode, cap):
    helper = import_peer("verl.trainer.ppo.rollout_corr_helper")
    log_ratio = (old - rollout).double() * mask
    if mode.startswith("sequence"):
        # veRL's "sequence" weight is exp(sum of log-ratios); fed each row's log-ratios divided by
        # its token count, that sum is pyppo's mean.
        log_ratio = log_ratio / mask.sum(dim=1, keepdim=True).clamp_min(1)
    threshold = cap if mode.endswith("truncate") else f"{1 / cap!r}_{cap!r}"
    w, _ = helper.compute_rollout_correction_weights(
        log_ratio, mask.double(), rollout_is=mode.split("_")[0], rollout_is_threshold=threshold
    )
    return w


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cap", [1.5, 2.0, 4.0])
def test_weights_match_verl(mode, cap):
    old, rollout, mask = _inputs(B=16, T=13, seed=5, spread=0.6)
    w, _ = rollout_is_weights(old, rollout, mask, mode=mode, cap=cap)
    torch.testing.assert_close(w.double(), _verl_weights(old, rollout, mask, mode, cap), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- metrics


def test_mismatch_metrics_match_the_float64_reference():
    old, rollout, mask = _inputs(B=9, T=17, seed=7)
    m = mismatch_metrics(old, rollout, mask)
    d = (old.double() - rollout.double())[mask]
    r = torch.exp(d)
    assert m["mismatch_logprob_diff_mean"] == pytest.approx(float(d.abs().mean()), rel=1e-9)
    assert m["mismatch_logprob_diff_max"] == pytest.approx(float(d.abs().max()), rel=1e-6)
    assert m["mismatch_kl_k3"] == pytest.approx(float((r - 1 - d).mean()), rel=1e-9)
    assert m["mismatch_ratio_outside_fraction"] == pytest.approx(float(((r < 0.5) | (r > 2)).double().mean()))
    assert 0 < m["mismatch_ratio_outside_fraction"] < 1


def test_mismatch_metrics_are_zero_when_equal_or_empty():
    old, _, mask = _inputs()
    assert all(v == 0.0 for v in mismatch_metrics(old, old.clone(), mask).values())
    assert all(v == 0.0 for v in mismatch_metrics(old, old, torch.zeros_like(mask)).values())


def test_bad_rollout_logprobs_name_the_engine():
    _, rollout, mask = _inputs()
    bad = rollout.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="engine X: rollout_logprobs has 1 response token"):
        check_rollout_logprobs(bad, mask, "engine X")
    bad[3, 0] = 0.7  # a probability above 1
    with pytest.raises(ValueError, match="not a finite log-probability <= 0"):
        check_rollout_logprobs(bad, mask, "engine X")
    with pytest.raises(ValueError, match=r"shape \(6, 10\), expected \(6, 11\)"):
        check_rollout_logprobs(rollout[:, :10], mask, "engine X")
    with pytest.raises(ValueError, match="must be a float tensor"):
        check_rollout_logprobs(mask, mask, "engine X")
    check_rollout_logprobs(torch.where(mask, rollout, torch.full_like(rollout, float("nan"))), mask, "ok")


# ---------------------------------------------------------------- in the trainer


class _OtherTemperatureEngine(RolloutEngine):
    """Samples with the trainer's engine and reports the policy's log-probs at another temperature
    (the tiny random model's logits are small: 0.1 makes the difference large):
    an engine whose numerics differ from the trainer's, planted."""

    def __init__(self, trainer, temperature):
        self.inner, self.head = trainer.engine, LogprobHead(trainer.policy, temperature=temperature)

    @torch.no_grad()
    def generate(self, prompts):
        r = self.inner.generate(prompts)
        r.rollout_logprobs = self.head(buffer_from_rollout(r, prompts, self.inner))[0]
        return r


def _step(correction, temperature=0.1, **overrides):
    # PPOConfig refuses a correction with the transformers engine, which reports no log-probs of
    # its own; the planted engine here does, so the settings are put in after the config's check.
    tr = make_trainer(small_config(steps=1))
    tr.config.rollout_correction, tr.config.rollout_is_cap = correction, overrides.get("rollout_is_cap", 2.0)
    tr.engine = _OtherTemperatureEngine(tr, temperature)
    return tr.step()


def test_a_planted_mismatch_shows_and_is_corrected():
    plain, corrected = _step("none"), _step("token_mask", rollout_is_cap=1.5)
    for result in (plain, corrected):
        m = result.metrics
        assert m["mismatch_logprob_diff_mean"] > 0.1 and m["mismatch_kl_k3"] > 0
        assert m["mismatch_ratio_outside_fraction"] > 0
        # The ratio stays pyppo's own: exactly 1 at the first minibatch, whichever engine sampled.
        assert m["first_max_abs_logratio"] == 0.0 and m["kl_mean"] == 0.0
    assert "rollout_corrected_fraction" not in plain.metrics
    assert 0 < corrected.metrics["rollout_corrected_fraction"] < 1
    # Same seed, same rollout: the corrected advantages are the plain ones times the weights.
    a, b = plain.batch, corrected.batch
    assert torch.equal(a.response_ids, b.response_ids)
    w, _ = rollout_is_weights(b.old_logprobs, b.rollout_logprobs, b.loss_mask, mode="token_mask", cap=1.5)
    torch.testing.assert_close(b.advantages, a.advantages * w)
    assert not torch.equal(a.advantages, b.advantages)


def test_the_same_temperature_is_no_mismatch():
    m = _step("token_truncate", temperature=1.0).metrics
    assert m["mismatch_logprob_diff_max"] < 1e-5 and m["rollout_corrected_fraction"] == 0.0


def test_a_correction_without_engine_logprobs_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"rollout_correction = 'sequence_mask' has no effect here: it needs "
        r"rollout_engine = 'vllm'",
    ):
        small_config(steps=1, rollout_correction="sequence_mask")
    # an engine put in by hand that reports no log-probs is named at the step
    tr = make_trainer(small_config(steps=1))
    tr.config.rollout_correction = "sequence_mask"
    with pytest.raises(ValueError, match="rollout_correction='sequence_mask' needs the rollout engine's own"):
        tr.step()
    assert "mismatch_kl_k3" not in make_trainer(small_config(steps=1)).step().metrics
