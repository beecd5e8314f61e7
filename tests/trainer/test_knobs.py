"""Every PPOConfig field changes what the trainer does: each has a check here, or a named test
elsewhere, that fails when the trainer ignores it (and a meta-test keeps that list complete)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from pyppo.config import PPOConfig
from support.trainer_fixture import count_e, make_trainer, small_config


def _optimizer_steps(tr):
    counts = {"policy": 0, "value": 0}
    for name, opt in (("policy", tr.policy_optimizer), ("value", tr.critic.optimizer)):
        opt.register_step_post_hook(lambda *a, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def _spy(monkeypatch, name, module="pyppo.trainer.critic"):
    import importlib

    trainer_mod = importlib.import_module(module)
    calls = []
    real = getattr(trainer_mod, name)

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, name, spy)
    return calls


# Each check builds a trainer with the knob set away from its default and asserts the effect.
def check_steps(tmp_path, monkeypatch):
    assert len(make_trainer(small_config(steps=3)).train(tmp_path, progress=False)) == 3


def check_batch_size(tmp_path, monkeypatch):
    assert len(make_trainer(small_config(batch_size=6, mini_batch_size=3, micro_batch_size=None)).step().batch) == 6


def check_mini_batch_size_and_ppo_epochs(tmp_path, monkeypatch):
    for mini, epochs in ((2, 1), (4, 3)):
        tr = make_trainer(small_config(steps=1, mini_batch_size=mini, ppo_epochs=epochs, micro_batch_size=None))
        counts = _optimizer_steps(tr)
        tr.step()
        assert counts == {"policy": epochs * 8 // mini, "value": epochs * 8 // mini}


def check_micro_batch_size(tmp_path, monkeypatch):
    tr = make_trainer(small_config(steps=1, ppo_epochs=1, mini_batch_size=4, micro_batch_size=1))
    calls = []
    real = tr.micro_step
    tr.micro_step = lambda mu, *a, **k: (calls.append(len(mu)), real(mu, *a, **k))[1]
    tr.step()
    assert calls == [1] * 8


def check_max_new_tokens(tmp_path, monkeypatch):
    assert make_trainer(small_config(steps=1, max_new_tokens=3)).step().batch.response_length <= 3


def check_max_prompt_length(tmp_path, monkeypatch):
    from support.tiny_models import tiny_tokenizer

    # A prompt keeps its last tokens, those next to the response, chat template or not.
    tok = tiny_tokenizer()
    for template in (True, False):
        b = make_trainer(small_config(steps=1, max_prompt_length=5, use_chat_template=template)).step().batch
        assert b.prompt_length == 5
        for prompt, ids, mask in zip(b.prompts, b.query_ids, b.query_mask):
            text = (
                tok.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                )
                if template
                else prompt
            )
            full = tok(text, add_special_tokens=not template)["input_ids"]
            assert len(full) > 5 and ids[mask].tolist() == full[-5:], (template, prompt)


def check_temperature(tmp_path, monkeypatch):
    tr = make_trainer(small_config(temperature=0.6))
    assert (
        tr.engine.gen_config.temperature
        == tr.models.policy_logprobs.temperature
        == tr.models.ref_logprobs.temperature
        == 0.6
    )


def check_top_k_and_top_p(tmp_path, monkeypatch):
    tr = make_trainer(small_config(top_k=5, top_p=0.9))
    assert (tr.engine.gen_config.top_k, tr.engine.gen_config.top_p) == (5, 0.9)


def check_use_chat_template(tmp_path, monkeypatch):
    im_start = 3  # the chat template's first token (tiny_models.SPECIALS)
    with_t = make_trainer(small_config(steps=1, use_chat_template=True)).step().batch
    without = make_trainer(small_config(steps=1, use_chat_template=False)).step().batch
    assert (with_t.query_ids == im_start).any(dim=1).all() and not (without.query_ids == im_start).any()


def check_optimizer_knobs(tmp_path, monkeypatch):
    tr = make_trainer(small_config(lr=3e-4, value_lr=7e-4, weight_decay=0.05, adam_eps=1e-6))
    (p,), (v,) = tr.policy_optimizer.param_groups, tr.critic.optimizer.param_groups
    assert (p["lr"], v["lr"]) == (3e-4, 7e-4)
    assert p["weight_decay"] == v["weight_decay"] == 0.05 and p["eps"] == v["eps"] == 1e-6


def check_max_grad_norm(tmp_path, monkeypatch):
    tr = make_trainer(small_config(steps=1, max_grad_norm=1e-3))
    norms = []
    tr.policy_optimizer.register_step_pre_hook(
        lambda opt, *a: norms.append(
            float(
                torch.nn.utils.get_total_norm(
                    [q.grad for g in opt.param_groups for q in g["params"] if q.grad is not None]
                )
            )
        )
    )
    m = tr.step().metrics
    assert norms and max(norms) <= 1e-3 * (1 + 1e-4) and m["policy_grad_norm"] > 1e-3  # clipped


def check_logprobs_from_hidden(tmp_path, monkeypatch):
    assert not make_trainer(small_config(logprobs_from_hidden=False)).models.policy_logprobs.uses_hidden
    assert make_trainer(small_config(logprobs_from_hidden=True)).models.policy_logprobs.uses_hidden


def check_device(tmp_path, monkeypatch):
    tr = make_trainer(small_config(device="cpu"))
    assert tr.device == torch.device("cpu")
    assert {p.device.type for m in (tr.policy, tr.models.reference, tr.critic.model) for p in m.parameters()} == {"cpu"}
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda'"):
            make_trainer(small_config(device="cuda"))


def _spy_policy_loss(monkeypatch, name):
    from pyppo.ops.policy_losses import POLICY_LOSSES

    calls, real = [], POLICY_LOSSES[name]
    monkeypatch.setitem(POLICY_LOSSES, name, lambda *a, **k: (calls.append(k), real(*a, **k))[1])
    return calls


def check_policy_loss(tmp_path, monkeypatch):
    """Each policy loss is the one the update calls, fused or not (the same update either way),
    and changes the update."""

    def policy_after(name, fused):
        tr = make_trainer(
            small_config(steps=1, ppo_epochs=2, policy_loss=name, fused_policy_loss=fused, cliprange=0.01)
        )
        m = tr.step().metrics
        return [p.detach().clone() for p in tr.policy.parameters()], m

    ppo, _ = policy_after("ppo", True)
    for name in ("gspo", "cispo"):
        calls = _spy_policy_loss(monkeypatch, name)
        fused, m_fused = policy_after(name, True)
        plain, m_plain = policy_after(name, False)
        assert calls and all(c["cliprange_low"] == 0.01 and "dual_clip" not in c for c in calls)
        for a, b in zip(fused, plain):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert m_fused["first_ratio_max"] == m_plain["first_ratio_max"] == 1.0
        assert m_fused["clipfrac"] == pytest.approx(m_plain["clipfrac"], abs=1e-6)
        assert any(not torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(fused, ppo)), name


def check_policy_loss_knobs(tmp_path, monkeypatch):
    calls = _spy_policy_loss(monkeypatch, "ppo")
    cfg = small_config(
        steps=1,
        cliprange=0.15,
        cliprange_high=0.28,
        dual_clip=2.5,
        loss_agg="seq-mean-token-sum-norm",
        loss_agg_norm=5.0,
        fused_policy_loss=False,
    )
    make_trainer(cfg).step()
    assert calls and all(
        (c["cliprange_low"], c["cliprange_high"], c["dual_clip"], c["loss_agg"], c["loss_agg_norm"])
        == (0.15, 0.28, 2.5, "seq-mean-token-sum-norm", 5.0)
        for c in calls
    )


def check_fused_policy_loss(tmp_path, monkeypatch):
    import pyppo.ops as ops

    calls = []
    real = ops.linear_ppo_loss
    monkeypatch.setattr(ops, "linear_ppo_loss", lambda *a, **k: (calls.append(k), real(*a, **k))[1])

    def policy_after(fused):
        tr = make_trainer(
            small_config(
                steps=1, ppo_epochs=2, fused_policy_loss=fused, entropy_coef=0.01, kl_loss_coef=0.1, dual_clip=3.0
            )
        )
        m = tr.step().metrics
        return [p.detach().clone() for p in tr.policy.parameters()], m

    fused, m_fused = policy_after(True)
    n = len(calls)
    plain, m_plain = policy_after(False)
    assert n > 0 and len(calls) == n  # only the fused run called the op
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for k in ("policy_loss", "kl_loss", "entropy_loss", "clipfrac", "approx_kl"):
        assert m_fused[k] == pytest.approx(m_plain[k], rel=1e-4, abs=1e-7), k


def check_lr_warmup_steps(tmp_path, monkeypatch):
    def lrs(tr):
        seen = []
        for opt in (tr.policy_optimizer, tr.critic.optimizer):
            opt.register_step_pre_hook(lambda o, *a: seen.append(o.param_groups[0]["lr"]))
        return seen

    # The warm-up (5 optimizer steps) runs on across the resume, after the first step's 2: the
    # resumed trainer's clock is the checkpoint's, not a fresh one nor "past any warm-up".
    cfg = small_config(steps=3, ppo_epochs=1, mini_batch_size=4, lr=1e-3, value_lr=2e-3, lr_warmup_steps=5)
    tr = make_trainer(cfg)
    seen = lrs(tr)
    tr.step()  # two optimizer steps of each model
    tr.save_checkpoint(tmp_path / "ckpt")
    resumed = make_trainer(cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    seen_after = lrs(resumed)
    resumed.step()
    resumed.step()
    # lr · min(1, (n + 1) / 5) before applied step n (policy then value model, each step).
    scale = [min(1.0, (n + 1) / 5) for n in range(6)]
    assert seen == pytest.approx([x for s in scale[:2] for x in (1e-3 * s, 2e-3 * s)])
    assert seen_after == pytest.approx([x for s in scale[2:] for x in (1e-3 * s, 2e-3 * s)])


def check_kl_loss(tmp_path, monkeypatch):
    import pyppo.trainer.logprob_head as forward_mod

    calls = []
    real = forward_mod.kl_penalty
    monkeypatch.setattr(forward_mod, "kl_penalty", lambda *a, **k: (calls.append(k), real(*a, **k))[1])
    m = (
        make_trainer(small_config(steps=1, kl_loss_coef=0.5, kl_loss_estimator="k2", fused_policy_loss=False))
        .step()
        .metrics
    )
    assert calls and all(c["estimator"] == "k2" for c in calls) and "kl_loss" in m


def check_cliprange_value(tmp_path, monkeypatch):
    calls = _spy(monkeypatch, "ppo_value_loss")
    make_trainer(small_config(steps=1, cliprange_value=0.07)).step()
    assert calls and all(c["cliprange_value"] == 0.07 for c in calls)


def check_vf_coef(tmp_path, monkeypatch):
    tr = make_trainer(small_config(steps=1, vf_coef=0.0))
    before = [p.detach().clone() for p in tr.critic.model.parameters()]
    tr.step()  # no value gradient: AdamW (no weight decay) leaves the value model as it was
    assert all(torch.equal(a, b) for a, b in zip(before, tr.critic.model.parameters()))
    tr = make_trainer(small_config(steps=1, vf_coef=0.5))
    before = [p.detach().clone() for p in tr.critic.model.parameters()]
    tr.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.critic.model.parameters()))


def check_entropy_coef(tmp_path, monkeypatch):
    def policy_after(coef):
        tr = make_trainer(small_config(steps=1, ppo_epochs=1, entropy_coef=coef))
        m = tr.step().metrics
        return [p.detach().clone() for p in tr.policy.parameters()], m

    a, _ = policy_after(0.0)
    b, m = policy_after(0.5)
    assert any(not torch.allclose(x, y) for x, y in zip(a, b)) and "entropy_loss" in m


def check_seed(tmp_path, monkeypatch):
    same = [make_trainer(small_config(seed=s)).sampler.sample(8) for s in (5, 5, 6)]
    assert same[0] == same[1] != same[2]


def check_save_every(tmp_path, monkeypatch):
    import pyppo.run.checkpoint

    saved = []
    # The run loop checkpoints through pyppo.run.checkpoint.save_trainer.
    monkeypatch.setattr(pyppo.run.checkpoint, "save_trainer", lambda trainer, d: saved.append(trainer.step_count))
    for every, expected in ((1, [1, 2, 3]), (2, [2, 3]), (0, [3])):
        saved.clear()
        make_trainer(small_config(steps=3, save_every=every)).train(tmp_path / f"e{every}", progress=False)
        assert saved == expected, every


def check_log_samples(tmp_path, monkeypatch):
    make_trainer(small_config(steps=1, log_samples=False)).train(tmp_path / "off", progress=False)
    make_trainer(small_config(steps=1, log_samples=True)).train(tmp_path / "on", progress=False)
    assert not (tmp_path / "off" / "samples.jsonl").exists() and (tmp_path / "on" / "samples.jsonl").is_file()


CHECKS = {
    "steps": check_steps,
    "batch_size": check_batch_size,
    "mini_batch_size": check_mini_batch_size_and_ppo_epochs,
    "ppo_epochs": check_mini_batch_size_and_ppo_epochs,
    "policy_loss": check_policy_loss,
    "micro_batch_size": check_micro_batch_size,
    "max_new_tokens": check_max_new_tokens,
    "max_prompt_length": check_max_prompt_length,
    "temperature": check_temperature,
    "top_k": check_top_k_and_top_p,
    "top_p": check_top_k_and_top_p,
    "use_chat_template": check_use_chat_template,
    "lr": check_optimizer_knobs,
    "value_lr": check_optimizer_knobs,
    "weight_decay": check_optimizer_knobs,
    "adam_eps": check_optimizer_knobs,
    "max_grad_norm": check_max_grad_norm,
    "logprobs_from_hidden": check_logprobs_from_hidden,
    "device": check_device,
    "cliprange": check_policy_loss_knobs,
    "cliprange_high": check_policy_loss_knobs,
    "dual_clip": check_policy_loss_knobs,
    "loss_agg": check_policy_loss_knobs,
    "loss_agg_norm": check_policy_loss_knobs,
    "cliprange_value": check_cliprange_value,
    "vf_coef": check_vf_coef,
    "kl_loss_coef": check_kl_loss,
    "kl_loss_estimator": check_kl_loss,
    "fused_policy_loss": check_fused_policy_loss,
    "lr_warmup_steps": check_lr_warmup_steps,
    "entropy_coef": check_entropy_coef,
    "seed": check_seed,
    "save_every": check_save_every,
    "log_samples": check_log_samples,
}

#: Knobs whose effect is asserted by a test elsewhere: field -> (module, test name).
ELSEWHERE = {
    "max_turns": (
        "agents/test_episodes.py",
        "test_an_episode_at_max_turns_ends_on_the_agents_turn_without_the_unanswered_reply",
    ),
    "max_episode_tokens": (
        "agents/test_episodes.py",
        "test_a_reply_that_leaves_no_room_truncates_the_episode_without_it",
    ),
    "disable_dropout": ("trainer/test_trainer.py", "test_disable_dropout"),
    "kl_coef": ("trainer/test_trainer.py", "test_rollout_tensors_match_the_references_with_the_config_knobs"),
    "kl_estimator": ("trainer/test_trainer.py", "test_rollout_tensors_match_the_references_with_the_config_knobs"),
    "score_clip": ("trainer/test_trainer.py", "test_rollout_tensors_match_the_references_with_the_config_knobs"),
    "missing_eos_penalty": (
        "trainer/test_trainer.py",
        "test_rollout_tensors_match_the_references_with_the_config_knobs",
    ),
    "gamma": ("trainer/test_trainer.py", "test_rollout_tensors_match_the_references_with_the_config_knobs"),
    "lam": ("trainer/test_trainer.py", "test_rollout_tensors_match_the_references_with_the_config_knobs"),
    "lam_critic": ("trainer/test_critic_estimators.py", "test_lam_critic_sets_the_value_targets_lambda"),
    "critic_warmup_steps": (
        "trainer/test_critic_estimators.py",
        "test_critic_warmup_steps_train_the_value_model_only_then_the_policy_from_its_own_lr_warm_up",
    ),
    "lam_alpha": ("trainer/test_critic_estimators.py", "test_lam_alpha_gives_each_response_its_length_adaptive_lambda"),
    "gamma_turn": (
        "trainer/test_critic_estimators.py",
        "test_gae_turn_runs_gae_over_the_turns_with_gamma_turn_and_lam_turn",
    ),
    "lam_turn": (
        "trainer/test_critic_estimators.py",
        "test_gae_turn_runs_gae_over_the_turns_with_gamma_turn_and_lam_turn",
    ),
    "whiten_advantages": ("trainer/test_trainer.py", "test_rollout_tensors_match_the_references_with_the_config_knobs"),
    "target_kl": ("trainer/test_trainer.py", "test_adaptive_kl_controller_is_applied"),
    "kl_horizon": ("trainer/test_trainer.py", "test_adaptive_kl_controller_is_applied"),
    "max_consecutive_skips": (
        "run/test_nonfinite.py",
        "test_nan_gradient_stops_after_max_consecutive_skips_keeping_last_checkpoint",
    ),
    "truncate_prompts": ("run/test_nonfinite.py", "test_prompt_longer_than_the_context_is_cut_with_one_warning"),
    "dtype": ("test_precision.py", "test_bfloat16_runs_the_forwards_in_bfloat16_and_keeps_float32_masters"),
    "gradient_checkpointing": (
        "test_precision.py",
        "test_gradient_checkpointing_recomputes_the_blocks_and_gives_the_same_update",
    ),
    "fsdp": ("test_distributed.py", "test_two_ranks_update_like_one_process"),
    "lora_rank": ("trainer/test_lora.py", "test_only_the_adapters_train_and_there_is_no_reference_copy"),
    "lora_alpha": ("trainer/test_lora.py", "test_target_modules_and_alpha"),
    "lora_target_modules": ("trainer/test_lora.py", "test_target_modules_and_alpha"),
    "value_lora": ("trainer/test_lora.py", "test_value_lora_trains_the_value_adapters_and_head_only"),
    "merge_lora": ("trainer/test_lora.py", "test_policy_export_merges_or_keeps_the_adapter"),
    "eval_every": ("run/test_eval.py", "test_eval_every_logs_scores_kl_and_samples"),
    "report_to": ("run/test_trackers.py", "test_tensorboard_has_every_metric_at_its_step_the_config_and_the_samples"),
    "doctor": ("run/test_doctor.py", "test_doctor_false_runs_no_check_and_logs_no_doctor_metric"),
    "rollout_correction": ("trainer/test_rollout_correction.py", "test_a_planted_mismatch_shows_and_is_corrected"),
    "rollout_is_cap": ("trainer/test_rollout_correction.py", "test_a_planted_mismatch_shows_and_is_corrected"),
    "samples_per_prompt": (
        "trainer/test_group_estimators.py",
        "test_each_prompt_is_sampled_samples_per_prompt_times_in_a_row_and_ranks_take_whole_groups",
    ),
    "advantage_estimator": (
        "trainer/test_group_estimators.py",
        "test_a_critic_free_step_has_no_value_model_and_its_advantages_match_float64",
    ),
    "grpo_std_normalize": ("trainer/test_group_estimators.py", "test_dr_grpo_does_not_divide_by_the_group_std"),
    "filter_groups": (
        "trainer/test_dapo.py",
        "test_filter_groups_keeps_varied_groups_and_samples_again_until_the_batch_is_full",
    ),
    "filter_groups_max_tries": (
        "trainer/test_dapo.py",
        "test_filter_groups_fills_the_batch_with_equal_groups_when_the_tries_run_out",
    ),
    "overlong_buffer": ("trainer/test_dapo.py", "test_the_step_subtracts_the_overlong_penalty_from_the_scores"),
    "overlong_penalty": ("trainer/test_dapo.py", "test_the_step_subtracts_the_overlong_penalty_from_the_scores"),
    "mask_truncated": (
        "trainer/test_dapo.py",
        "test_mask_truncated_takes_responses_without_eos_out_of_the_loss_after_their_group_baseline",
    ),
    "rollout_engine": (
        "rollout/test_vllm_engine.py",
        "test_the_trainer_samples_with_vllm_and_its_first_ratio_is_exactly_one",
    ),
    "vllm_kv_cache_gib": ("rollout/test_vllm_engine.py", "test_the_engine_knobs_reach_vllm"),
    "vllm_gpu_memory_utilization": ("rollout/test_vllm_engine.py", "test_the_engine_knobs_reach_vllm"),
}


def test_every_knob_has_a_check():
    fields = {f.name for f in dataclasses.fields(PPOConfig)}
    assert set(CHECKS) | set(ELSEWHERE) == fields
    assert not set(CHECKS) & set(ELSEWHERE)
    tests = Path(__file__).resolve().parents[1]
    for path, name in ELSEWHERE.values():
        tree = ast.parse((tests / path).read_text())
        assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, (path, name)


@pytest.mark.parametrize("check", sorted(set(CHECKS.values()), key=lambda f: f.__name__), ids=lambda f: f.__name__)
def test_knob(check, tmp_path, monkeypatch):
    check(tmp_path, monkeypatch)


def test_reward_sees_every_response():
    seen = []
    tr = make_trainer(small_config(steps=1), reward=lambda p, r: (seen.append((p, r)), count_e(p, r))[1])
    b = tr.step().batch
    assert seen == [(b.prompts, b.responses)]
