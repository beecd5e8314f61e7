"""``loss_mask`` apart from ``response_mask``: positions in the sequence that are not the policy's
actions (an environment's reply between turns) are attended to but never trained on. An engine
planted here returns such holes in the middle of every response."""

from __future__ import annotations

import pytest
import torch

from pyppo.rollout import Rollout, RolloutEngine
from pyppo.trainer.buffer import RolloutBuffer, buffer_from_rollout
from support.trainer_fixture import make_trainer, small_config


class _HoleEngine(RolloutEngine):
    """Samples with the trainer's own engine and marks response positions 1 and 2 as not the
    policy's (where the response is long enough to have tokens on both sides)."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, prompts):
        r = self.inner.generate(prompts)
        r.loss_mask = r.response_mask.clone()
        long = r.response_mask.sum(dim=1) > 3
        r.loss_mask[long, 1:3] = False
        return r


def _hole_trainer(**overrides):
    tr = make_trainer(small_config(steps=1, max_new_tokens=8, **overrides), eos_bias=-3.0)
    tr.engine = _HoleEngine(tr.engine)
    return tr


def _last_true(mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    return torch.where(mask, positions, -1).max(dim=1).values


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_holes_are_attended_but_never_trained_on(estimator):
    extra = dict(advantage_estimator="grpo", samples_per_prompt=4) if estimator == "grpo" else {}
    tr = _hole_trainer(**extra)
    metrics, b = tr.step()
    holes = b.response_mask & ~b.loss_mask
    assert holes.any() and b.loss_mask[holes.any(dim=1)].any()  # holes with policy tokens around them
    # the sequence keeps the holes: attention and positions cover them
    P = b.prompt_length
    assert torch.equal(b.attention_mask[:, P:].bool(), b.response_mask)
    # nothing of the policy's at a hole: no log-prob, entropy, KL, reward, value or advantage
    for name in ("old_logprobs", "ref_logprobs", "entropy", "kl", "rewards", "values", "advantages"):
        assert (getattr(b, name)[holes] == 0).all(), name
    assert (b.old_logprobs[b.loss_mask] < 0).all()
    # the first ratio is exactly 1 over every policy token, and the step-1 KL exactly 0
    assert metrics["first_max_abs_logratio"] == 0.0 and metrics["kl_mean"] == 0.0
    # the score sits on the last policy token (the KL is 0 at step 1, so the reward is the score)
    rows = torch.arange(len(b))
    last = _last_true(b.loss_mask)
    torch.testing.assert_close(b.rewards[rows, last], b.scores)
    assert int((b.rewards != 0).sum()) <= len(b)


def test_a_hole_gets_no_gradient():
    """The update's gradient is the same whatever the rollout's numbers at the holes are."""
    grads = []
    for noise in (0.0, 5.0):
        tr = _hole_trainer(ppo_epochs=1, mini_batch_size=8, micro_batch_size=8)
        b = tr.rollout(["say something nice", "why", "a b c", "the cat sat"] * 2)
        b.raw_scores, b.scores = tr.score(b)
        from pyppo.trainer.rollout_forwards import rollout_forwards
        from pyppo.trainer.step_stats import PhaseTimer, RunningStats

        rollout_forwards(tr.models, b, torch.arange(len(b)), 8, PhaseTimer())
        tr.advantages(b, 0.05)
        holes = b.response_mask & ~b.loss_mask
        assert holes.any()
        g = torch.Generator().manual_seed(1)
        for name in ("advantages", "returns", "old_logprobs", "ref_logprobs", "values"):
            t = getattr(b, name)
            t[holes] += noise * torch.randn(t[holes].shape, generator=g)
        tr.train_mode(True)
        tr.zero_grad()
        tr.minibatch_step(b, RunningStats(), "test")
        grads.append(
            [p.grad.clone() for p in tr.policy.parameters() if p.grad is not None]
            + [p.grad.clone() for p in tr.critic.model.parameters() if p.grad is not None]
        )
    # minibatch_step applied the update and kept the gradients of the step it applied
    assert grads[0] and len(grads[0]) == len(grads[1])
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_loss_mask_defaults_to_the_response_mask_and_stays_inside_it():
    ids = torch.tensor([[5, 6, 2, 0]])
    mask = torch.tensor([[True, True, True, False]])
    b = RolloutBuffer(
        query_ids=ids[:, :2], query_mask=torch.ones(1, 2, dtype=torch.bool), response_ids=ids, response_mask=mask
    )
    assert torch.equal(b.loss_mask, mask) and b.loss_mask is not b.response_mask
    assert torch.equal(b.select(torch.tensor([0, 0])).loss_mask, mask.repeat(2, 1))
    r = Rollout(
        query_ids=ids[:, :2],
        query_mask=torch.ones(1, 2, dtype=torch.bool),
        response_ids=ids,
        response_mask=mask,
        has_eos=torch.tensor([True]),
        prompts=["p"],
        responses=["r"],
        loss_mask=torch.tensor([[True, False, True, True]]),
    )
    with pytest.raises(ValueError, match="loss_mask is 1 where response_mask is 0"):
        buffer_from_rollout(r, ["p"], object())
    r.loss_mask = torch.tensor([[1, 0, 1, 0]])
    with pytest.raises(TypeError, match="loss_mask must be a bool tensor"):
        buffer_from_rollout(r, ["p"], object())
