"""The critic-free estimators in the trainer: several responses per prompt laid out as groups,
each estimator's advantages in a real step against a float64 reference, no value model anywhere
(built, trained, checkpointed, logged), and the size rules."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo import PPOTrainer
from pyppo.config import ADVANTAGE_ESTIMATORS, PPOConfig
from pyppo.trainer.advantages import ADVANTAGE_ESTIMATORS as REGISTRY
from support.tiny_models import tiny_causal_lm, tiny_tokenizer
from support.trainer_fixture import PROMPTS, count_e, make_trainer, small_config

F64 = torch.float64
CRITIC_FREE = [name for name in ADVANTAGE_ESTIMATORS if name not in ("gae", "gae_turn")]
VALUE_KEYS = ("value_loss", "explained_variance", "value_grad_norm", "vf_clipfrac", "time_value_forward")


def group_config(estimator, k=4, **overrides):
    base = dict(
        batch_size=8,
        mini_batch_size=4,
        micro_batch_size=2,
        samples_per_prompt=k,
        advantage_estimator=estimator,
        kl_coef=0.05,
    )
    base.update(overrides)
    return small_config(**base)


def sequence_rewards(batch):
    return (batch.rewards.double() * batch.response_mask).sum(-1)


def whiten(x, mask):
    m = mask.double()
    mean = (x * m).sum() / m.sum()
    var = (((x - mean) ** 2) * m).sum() / (m.sum() - 1)  # unbiased, as masked_whiten
    return (x - mean) * torch.rsqrt(var + 1e-8) * m


def reference(batch, estimator, k, std_normalize=True, gamma=1.0):
    """float64 advantages of ``estimator`` from the step's own rewards and masks."""
    mask = batch.response_mask
    if estimator == "reinforce_pp":
        r = batch.rewards.double() * mask
        out = torch.zeros_like(r)
        running = torch.zeros(r.shape[0], dtype=F64)
        for t in reversed(range(r.shape[1])):
            running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
            out[:, t] = running
        return whiten(out * mask, mask)
    s = sequence_rewards(batch).view(-1, k)
    mean = s.mean(1, keepdim=True)
    if estimator == "rloo":
        a = (s * k - s.sum(1, keepdim=True)) / (k - 1)
    elif estimator == "grpo" and std_normalize:
        a = (s - mean) / (s.std(1, keepdim=True) + 1e-6)
    else:
        a = s - mean
    a = a.reshape(-1, 1) * mask
    return whiten(a, mask) if estimator == "reinforce_pp_baseline" else a


def test_the_config_names_and_the_registry_agree():
    assert tuple(REGISTRY) == ADVANTAGE_ESTIMATORS
    critics = [n for n, e in REGISTRY.items() if e.uses_critic]
    assert critics == ["gae", "gae_turn"] and all(PPOConfig(advantage_estimator=n).uses_critic for n in critics)
    assert PPOConfig(advantage_estimator="grpo", samples_per_prompt=2).uses_critic is False and PPOConfig().uses_critic
    assert PPOConfig(advantage_estimator="reinforce_pp").uses_critic is False  # no group: one response is enough


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(batch_size=8, mini_batch_size=4, samples_per_prompt=3),
            r"samples_per_prompt \(3\) must divide batch_size \(8\)",
        ),
        (
            dict(advantage_estimator="grpo", samples_per_prompt=2, lora_rank=4, value_lora=True),
            r"value_lora = True has no effect here: it needs a value model "
            r"\(advantage_estimator 'gae' or 'gae_turn'; 'grpo' trains none\)",
        ),
        (dict(advantage_estimator="rloo", samples_per_prompt=2, vf_coef=0.5), r"vf_coef = 0.5 has no effect here"),
        (dict(advantage_estimator="reinforce_pp", value_lr=1e-4), r"value_lr = 0.0001 has no effect here"),
        (dict(advantage_estimator="reinforce_pp", lam=0.9), r"lam = 0.9 has no effect here"),
        (
            dict(advantage_estimator="grpo", samples_per_prompt=2, cliprange_value=None),
            r"cliprange_value = None has no effect here",
        ),
        (
            dict(advantage_estimator="grpo", samples_per_prompt=2, gamma=0.99),
            r"gamma = 0.99 has no effect here: it needs token returns",
        ),
        (
            dict(advantage_estimator="reinforce_pp_baseline", samples_per_prompt=2, gamma=0.9),
            r"gamma = 0.9 has no effect here: it needs token returns "
            r"\(advantage_estimator 'gae' or 'reinforce_pp', not "
            r"'reinforce_pp_baseline'\)",
        ),
        (
            dict(advantage_estimator="grpo", samples_per_prompt=2, whiten_advantages=False),
            r"whiten_advantages = False has no effect here: it needs a batch-whitened estimator \('grpo' normalises",
        ),
        (
            dict(advantage_estimator="rloo", samples_per_prompt=2, grpo_std_normalize=False),
            r"grpo_std_normalize = False has no effect here: it needs advantage_estimator = 'grpo', not 'rloo'",
        ),
        (
            dict(policy_loss="cispo", dual_clip=3.0),
            r"dual_clip = 3.0 has no effect here: it needs policy_loss = 'ppo', not 'cispo'",
        ),
        (dict(policy_loss="sapo"), r"policy_loss must be one of"),
        (dict(advantage_estimator="dapo"), r"advantage_estimator must be one of"),
        (dict(advantage_estimator="rloo"), r"samples_per_prompt must be >= 2 with advantage_estimator = 'rloo', got 1"),
    ],
)
def test_bad_sizes_and_settings_are_refused_with_the_argument_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)


def test_knobs_that_act_are_accepted_with_their_estimator():
    PPOConfig(advantage_estimator="reinforce_pp", gamma=0.99, whiten_advantages=False)
    PPOConfig(advantage_estimator="grpo", samples_per_prompt=2, grpo_std_normalize=False, policy_loss="gspo")
    PPOConfig(lam=0.9, vf_coef=0.5, dual_clip=3.0, gamma=0.99)
    # a critic-free config that spells out the value knobs' defaults (a saved config.json) loads
    PPOConfig.from_dict({**PPOConfig().to_dict(), "advantage_estimator": "rloo", "samples_per_prompt": 2})


def test_a_group_is_never_split_between_processes():
    cfg = PPOConfig(batch_size=12, mini_batch_size=6, samples_per_prompt=3)
    cfg.check_world_size(1)
    with pytest.raises(
        ValueError,
        match=r"samples_per_prompt \(3\) must divide each process's share of batch_size "
        r"\(12 / 2 = 6\)|a prompt's group",
    ):
        PPOConfig(batch_size=8, mini_batch_size=4, samples_per_prompt=4).check_world_size(4)
    cfg.check_world_size(2)  # 6 per process: two groups of 3


def test_each_prompt_is_sampled_samples_per_prompt_times_in_a_row_and_ranks_take_whole_groups():
    tr = make_trainer(group_config("grpo", k=4, batch_size=16, mini_batch_size=8))
    first = tr.sampler.sample_groups(16, 4)
    assert len(first) == 16 and all(first[g * 4 : (g + 1) * 4] == [first[g * 4]] * 4 for g in range(4))
    assert len(set(first)) == 4
    # Two ranks of the same run: rank r takes the r-th consecutive half of the same prompt draw.
    shares = []
    for rank in (0, 1):
        tr.sampler.load_state_dict({**tr.sampler.state_dict(), "position": 0, "epoch": 0})
        shares.append(tr.sampler.sample_groups(16, 4, rank, 2))
    assert shares[0] + shares[1] == first
    # The trainer's step samples exactly that layout.
    tr.sampler.load_state_dict({**tr.sampler.state_dict(), "position": 0, "epoch": 0})
    assert tr.step().batch.prompts == first


@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_a_critic_free_step_has_no_value_model_and_its_advantages_match_float64(estimator):
    k = 4
    # A discount away from 1 where the estimator has token returns, so that it shows.
    gamma = dict(gamma=0.8) if estimator == "reinforce_pp" else {}
    tr = make_trainer(group_config(estimator, k=k, steps=1, **gamma))
    assert tr.critic is None and tr.models.critic is None and tr.checkpoint_parts()["value"] is None
    metrics, batch = tr.step()
    assert not any(key in metrics for key in VALUE_KEYS), sorted(set(VALUE_KEYS) & set(metrics))
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in metrics.values()), metrics
    assert metrics["first_max_abs_logratio"] == 0.0
    assert (batch.values == 0).all()
    want = reference(batch, estimator, k, **gamma)
    torch.testing.assert_close(batch.advantages.double(), want, rtol=1e-5, atol=1e-5)
    # The groups are real: every group's responses are to one prompt.
    assert all(len(set(batch.prompts[g * k : (g + 1) * k])) == 1 for g in range(len(batch) // k))


def test_dr_grpo_does_not_divide_by_the_group_std():
    tr = make_trainer(group_config("grpo", steps=1, grpo_std_normalize=False))
    _, batch = tr.step()
    torch.testing.assert_close(
        batch.advantages.double(), reference(batch, "grpo", 4, std_normalize=False), rtol=1e-5, atol=1e-6
    )


def test_group_advantages_are_not_whitened_over_the_batch():
    # A group whose rewards are all higher than another's still has advantages summing to 0.
    tr = make_trainer(group_config("rloo", steps=1))
    _, batch = tr.step()
    per_seq = batch.advantages[:, 0].double().view(-1, 4)  # every response has its first token
    torch.testing.assert_close(per_seq.sum(1), torch.zeros(2, dtype=F64), atol=1e-5, rtol=0)


def test_gae_still_trains_its_value_model_and_logs_its_metrics():
    tr = make_trainer(small_config(steps=1))
    metrics, _ = tr.step()
    assert tr.critic is not None and all(math.isfinite(metrics[k]) for k in ("value_loss", "explained_variance"))


def test_a_value_model_given_to_a_critic_free_estimator_is_refused():
    policy = tiny_causal_lm(seed=0)
    from pyppo.models import ValueModel

    with pytest.raises(ValueError, match=r"value_model: advantage_estimator = 'rloo' trains no value model"):
        PPOTrainer(
            group_config("rloo"), policy, None, ValueModel.from_causal_lm(policy), tiny_tokenizer(), count_e, PROMPTS
        )


def test_a_critic_free_checkpoint_holds_no_value_model_and_resumes_exactly(tmp_path):
    cfg = group_config("grpo", k=2, steps=2)
    straight = make_trainer(cfg)
    want = [straight.step().metrics for _ in range(2)]

    first = make_trainer(cfg)
    first.step()
    path = first.save_checkpoint(tmp_path / "ckpt")
    assert torch.load(path / "value_model.pt") == {}
    resumed = make_trainer(cfg)
    resumed.load_checkpoint(path)
    got = resumed.step().metrics
    keep = [k for k in want[1] if "time" not in k and "seconds" not in k]
    assert {k: got[k] for k in keep} == {k: want[1][k] for k in keep}

    # A GAE run cannot resume it, nor the reverse.
    with pytest.raises(
        ValueError, match=r"has no value model, and this run \(advantage_estimator = 'gae'\) trains one"
    ):
        make_trainer(small_config()).load_checkpoint(path)
    gae_path = make_trainer(small_config()).save_checkpoint(tmp_path / "gae")
    with pytest.raises(
        ValueError, match=r"has a value model, and this run \(advantage_estimator = 'grpo'\) trains none"
    ):
        make_trainer(cfg).load_checkpoint(gae_path)


# ---------------------------------------------------------------------------------- the CLI
def test_pyppo_train_grpo_with_the_math_reward_and_prompt_records(tmp_path):
    import json
    import subprocess
    import sys

    from support.tiny_models import save_tiny_causal_lm

    model = save_tiny_causal_lm(tmp_path / "model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": str(a + 1)}) for a in range(6)))
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyppo",
            "train",
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--reward",
            "math",
            "--eval-prompts",
            str(prompts),
            "--advantage-estimator",
            "grpo",
            "--samples-per-prompt",
            "2",
            "--batch-size",
            "4",
            "--mini-batch-size",
            "2",
            "--ppo-epochs",
            "1",
            "--max-new-tokens",
            "4",
            "--steps",
            "2",
            "--kl-coef",
            "0",
            "--kl-loss-coef",
            "0.001",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and not any(k in row for row in rows for k in VALUE_KEYS)
    assert all(0.0 <= row["score_mean"] <= 1.0 for row in rows) and "eval/score_mean" in rows[-1]
    assert torch.load(out / "checkpoint" / "value_model.pt") == {}
    # Without eval prompts (a field-taking reward once refused their absence).
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyppo",
            "train",
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--reward",
            "math",
            "--advantage-estimator",
            "rloo",
            "--samples-per-prompt",
            "2",
            "--batch-size",
            "4",
            "--mini-batch-size",
            "4",
            "--ppo-epochs",
            "1",
            "--max-new-tokens",
            "4",
            "--steps",
            "1",
            "--output",
            str(tmp_path / "no_eval"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(out / "checkpoint" / "optimizers.pt")["value"] is None
    assert (out / "policy" / "config.json").is_file() and (out / "curves.png").is_file()
    assert not (out / "value").exists()
