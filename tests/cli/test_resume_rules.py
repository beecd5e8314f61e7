"""What a resume may change (``pyppo.config.resume_conflicts``): every ``fixed`` setting, given
by a flag or by ``--config FILE.toml``, is refused in one line before any model loads; a ``free``
one is applied and said. The run's sources keep their rule. ``PPOTrainer.load_checkpoint`` makes
the same check."""

from __future__ import annotations

import pytest
import torch

from pyppo import cli
from pyppo.cli.flags import shown_as_flag
from pyppo.cli.train import TRAIN_DEFAULTS
from pyppo.config import PPOConfig, ResumeChange, config_knobs
from pyppo.run.config_file import write_config
from support.run_fixture import no_loading  # noqa: F401  (a fixture)
from support.trainer_fixture import make_trainer, small_config

#: For each fixed setting: the settings of a run where it acts (beside TRAIN_DEFAULTS), and a
#: new value for it there.
FIXED = {
    "batch_size": ({}, 64),
    "samples_per_prompt": ({}, 2),
    "mini_batch_size": ({}, 8),
    "ppo_epochs": ({}, 2),
    "max_new_tokens": ({}, 24),
    "max_turns": ({}, 2),
    "max_episode_tokens": ({}, 512),
    "max_prompt_length": ({}, 64),
    "truncate_prompts": ({}, False),
    "temperature": ({}, 0.7),
    "top_k": ({}, 5),
    "top_p": ({}, 0.9),
    "use_chat_template": ({}, False),
    "rollout_engine": ({}, "vllm"),
    "rollout_correction": ({"rollout_engine": "vllm"}, "token_mask"),
    "rollout_is_cap": ({"rollout_engine": "vllm", "rollout_correction": "token_mask"}, 1.5),
    "score_clip": ({}, 5.0),
    "missing_eos_penalty": ({}, 1.0),
    "overlong_buffer": ({}, 4),
    "overlong_penalty": ({"overlong_buffer": 4}, 0.5),
    "filter_groups": ({"samples_per_prompt": 2}, True),
    "filter_groups_max_tries": ({"samples_per_prompt": 2, "filter_groups": True}, 2),
    "mask_truncated": ({}, True),
    "kl_coef": ({}, 0.1),
    "target_kl": ({}, 1.0),
    "kl_horizon": ({"target_kl": 1.0}, 50.0),
    "kl_estimator": ({}, "k3"),
    "kl_loss_coef": ({}, 0.1),
    "kl_loss_estimator": ({"kl_loss_coef": 0.1}, "k2"),
    "advantage_estimator": ({"samples_per_prompt": 2}, "rloo"),
    "grpo_std_normalize": ({"advantage_estimator": "grpo", "samples_per_prompt": 2, "kl_coef": 0.0}, False),
    "gamma": ({}, 0.99),
    "lam": ({}, 0.9),
    "critic_warmup_steps": ({}, 2),
    "lam_critic": ({}, 1.0),
    "lam_alpha": ({}, 0.5),
    "gamma_turn": ({"advantage_estimator": "gae_turn"}, 0.9),
    "lam_turn": ({"advantage_estimator": "gae_turn"}, 1.0),
    "whiten_advantages": ({}, False),
    "policy_loss": ({}, "cispo"),
    "cliprange": ({}, 0.1),
    "cliprange_high": ({}, 0.3),
    "dual_clip": ({}, 3.0),
    "entropy_coef": ({}, 0.01),
    "loss_agg": ({}, "seq-mean-token-mean"),
    "loss_agg_norm": ({"loss_agg": "seq-mean-token-sum-norm"}, 5.0),
    "value_lr": ({}, 1e-4),
    "cliprange_value": ({}, None),
    "vf_coef": ({}, 0.5),
    "lr": ({}, 1e-4),
    "lr_warmup_steps": ({}, 3),
    "weight_decay": ({}, 0.01),
    "adam_eps": ({}, 1e-6),
    "max_grad_norm": ({}, None),
    "disable_dropout": ({}, False),
    "dtype": ({}, "bfloat16"),
    "lora_rank": ({}, 8),
    "lora_alpha": ({"lora_rank": 8}, 64.0),
    "lora_target_modules": ({"lora_rank": 8}, "q_proj,v_proj"),
    "value_lora": ({"lora_rank": 8}, True),
    "seed": ({}, 4),
}

#: For each free setting: the settings of a run where it acts (beside TRAIN_DEFAULTS and the
#: fake run's), and a new value for it there.
FREE = {
    "steps": ({}, 40),
    "micro_batch_size": ({}, 2),
    "vllm_kv_cache_gib": ({"rollout_engine": "vllm"}, 2.0),
    "vllm_gpu_memory_utilization": ({"rollout_engine": "vllm"}, 0.5),
    "fused_policy_loss": ({}, False),
    "logprobs_from_hidden": ({}, False),
    "device": ({}, "auto"),
    "gradient_checkpointing": ({}, True),
    "fsdp": ({}, True),
    "merge_lora": ({"lora_rank": 8}, False),
    "save_every": ({}, 5),
    "log_samples": ({}, False),
    "eval_every": ({}, 5),
    "max_consecutive_skips": ({}, 5),
    "doctor": ({}, False),
    "report_to": ({}, ["tensorboard"]),
}
#: The run's sources where a free setting needs one to act.
FREE_SOURCES = {"eval_every": {"eval_prompts": "arithmetic-eval"}}


def _fake_run(path, sources=None, **settings):
    """A run directory as pyppo train leaves it, without models: config.toml, and a checkpoint whose
    trainer_state.pt (the only file read before the models load) says it was trained with
    ``settings`` at step 1 by one process, from ``sources`` beside its model and reward. Its model
    does not exist, so nothing could load it."""
    config = PPOConfig(**{**TRAIN_DEFAULTS, "dtype": "float32", **settings})
    path.mkdir()
    sources = {"model": str(path / "no-such-model"), "reward": "sentiment", **(sources or {})}
    write_config(path / "config.toml", sources, config)
    (path / "checkpoint").mkdir()
    for name in ("policy.pt", "value_model.pt", "optimizers.pt"):
        torch.save({}, path / "checkpoint" / name)
    torch.save({"step": 1, "world_size": 1, "config": config.to_dict()}, path / "checkpoint" / "trainer_state.pt")
    return config


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("pyppo: error: ")]
    assert len(errors) == 1 and not any("Traceback" in line for line in err), err
    return errors[0]


def _toml(key, value) -> str:
    import tomli_w

    return tomli_w.dumps({key: "none" if value is None else value})


def test_every_fixed_setting_has_a_case():
    assert set(FIXED) == {name for name, k in config_knobs() if k.resume == "fixed"}


@pytest.mark.filterwarnings("ignore:kl_coef")  # a critic-free case: the KL-in-the-reward warning
@pytest.mark.parametrize("via", ["flag", "config file"])
@pytest.mark.parametrize("key", sorted(FIXED))
def test_a_fixed_setting_is_refused_in_one_line_before_loading(key, via, tmp_path, capsys, no_loading):
    context, value = FIXED[key]
    run = tmp_path / "run"
    saved = _fake_run(run, **context)
    before = (run / "config.toml").read_text()
    if via == "flag":
        given = shown_as_flag(key, value).split(" ", 1)
    else:
        (tmp_path / "new.toml").write_text(_toml(key, value))
        given = ["--config", str(tmp_path / "new.toml")]
    assert cli.main(["train", "--resume", str(run), "--steps", "40", *given]) == 2
    line = _one_error(capsys)
    new = getattr(PPOConfig(**{**saved.to_dict(), key: value}), key)
    assert line.startswith(f"pyppo: error: --resume {str(run)!r}: its checkpoint was trained with other settings")
    assert str(ResumeChange(key, getattr(saved, key), new)) in line, line
    assert "steps 20 -> 40" not in line  # a free change is no conflict
    assert line.endswith("start a new run (--output) to change them")
    assert (run / "config.toml").read_text() == before


def test_every_conflict_is_named_in_the_one_line(tmp_path, capsys, no_loading):
    run = tmp_path / "run"
    _fake_run(run, lora_rank=8, lora_alpha=8.0)
    (tmp_path / "new.toml").write_text('lora_alpha = 64\ndtype = "bfloat16"\n')
    argv = ["train", "--resume", str(run), "--config", str(tmp_path / "new.toml"), "--kl-coef", "0.1", "--seed", "7"]
    assert cli.main(argv) == 2
    line = _one_error(capsys)
    for change in ("kl_coef 0.06 -> 0.1", "dtype 'float32' -> 'bfloat16'", "lora_alpha 8.0 -> 64.0", "seed 0 -> 7"):
        assert change in line, (change, line)


def test_every_free_setting_has_a_case():
    assert set(FREE) == {name for name, k in config_knobs() if k.resume == "free"}


@pytest.fixture
def stop_before_loading(monkeypatch):
    """Stops ``pyppo train`` where it would build the trainer; returns the configs it was given."""
    import pyppo.cli.build
    from pyppo.cli.flags import CLIError

    built = []

    def build_trainer(config, **sources):  # what the run would train: no model needed to see it
        built.append(config)
        raise CLIError("stopped before loading")

    monkeypatch.setattr(pyppo.cli.build, "build_trainer", build_trainer)
    return built


@pytest.mark.filterwarnings("ignore:fsdp = True has no effect")  # one process: said, and free
@pytest.mark.parametrize("via", ["flag", "config file"])
@pytest.mark.parametrize("key", sorted(FREE))
def test_each_free_setting_is_applied_and_said(key, via, tmp_path, capsys, stop_before_loading):
    context, value = FREE[key]
    run = tmp_path / "run"
    saved = _fake_run(run, FREE_SOURCES.get(key), **{"device": "cpu", **context})
    if via == "flag":
        given = shown_as_flag(key, value).split(" ")
    else:
        (tmp_path / "new.toml").write_text(_toml(key, value))
        given = ["--config", str(tmp_path / "new.toml")]
    assert cli.main(["train", "--resume", str(run), *given]) == 2
    err = capsys.readouterr().err
    (config,) = stop_before_loading
    new = getattr(PPOConfig(**{**saved.to_dict(), key: value}), key)
    assert getattr(config, key) == new != getattr(saved, key)
    assert f"pyppo: resuming with {ResumeChange(key, getattr(saved, key), new)}\n" in err, err


@pytest.mark.parametrize("via", ["flag", "config file"])
def test_free_settings_are_applied_and_said(via, tmp_path, capsys, monkeypatch):
    import pyppo.cli.build
    from pyppo.cli.flags import CLIError

    built = []

    def build_trainer(config, **sources):  # what the run would train: no model needed to see it
        built.append(config)
        raise CLIError("stopped before loading")

    monkeypatch.setattr(pyppo.cli.build, "build_trainer", build_trainer)
    run = tmp_path / "run"
    _fake_run(run, device="cpu")
    if via == "flag":
        given = ["--steps", "40", "--save-every", "5", "--no-log-samples"]
    else:
        (tmp_path / "new.toml").write_text("steps = 40\nsave_every = 5\nlog_samples = false\n")
        given = ["--config", str(tmp_path / "new.toml")]
    assert cli.main(["train", "--resume", str(run), *given]) == 2
    err = capsys.readouterr().err
    assert "pyppo: resuming with steps 20 -> 40, save_every 10 -> 5, log_samples True -> False\n" in err
    assert f"resuming {str(run)!r} from step 1 of 40" in err
    (config,) = built
    assert (config.steps, config.save_every, config.log_samples) == (40, 5, False)


def test_dtype_auto_on_a_resume_is_the_runs_dtype(tmp_path, no_loading):
    run = tmp_path / "run"
    _fake_run(run, dtype="bfloat16")
    (tmp_path / "auto.toml").write_text('dtype = "auto"\n')
    for given in (["--dtype", "auto"], ["--config", str(tmp_path / "auto.toml")]):
        args = cli.build_parser().parse_args(["train", "--resume", str(run), "--steps", "40", *given])
        plan = cli.resolve_train_config(args)
        assert plan.config.dtype == "bfloat16" and plan.changes == (ResumeChange("steps", 20, 40),)


@pytest.mark.parametrize("key, value", [("model", "other-model"), ("reward", "math")])
def test_the_runs_sources_from_a_config_file_are_kept_too(key, value, tmp_path, capsys, no_loading):
    run = tmp_path / "run"
    _fake_run(run)
    (tmp_path / "new.toml").write_text(f'{key} = "{value}"\n')
    assert cli.main(["train", "--resume", str(run), "--config", str(tmp_path / "new.toml")]) == 2
    line = _one_error(capsys)
    assert f"{key} = {value!r} differs from the resumed run's {key}" in line and "start a new run (--output)" in line


def test_a_run_without_a_checkpoint_starts_over_with_the_new_settings(tmp_path):
    run = tmp_path / "run"
    _fake_run(run)
    for name in ("policy.pt", "value_model.pt", "optimizers.pt", "trainer_state.pt"):
        (run / "checkpoint" / name).unlink()
    args = cli.build_parser().parse_args(["train", "--resume", str(run), "--kl-coef", "0.1"])
    plan = cli.resolve_train_config(args)
    assert plan.resume_step is None and plan.config.kl_coef == 0.1


def test_load_checkpoint_refuses_a_fixed_setting_before_restoring_anything(tmp_path):
    trained = make_trainer(small_config(steps=1))
    trained.step()
    trained.save_checkpoint(tmp_path / "ck")
    other = make_trainer(small_config(steps=1, kl_coef=0.1, seed=5))
    before = [p.detach().clone() for p in other.policy.parameters()]
    with pytest.raises(
        ValueError,
        match=r"^checkpoint '.*ck' was trained with other settings, which a resume cannot "
        r"change: kl_coef 0.05 -> 0.1, seed 0 -> 5 ",
    ):
        other.load_checkpoint(tmp_path / "ck")
    assert other.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before, other.policy.parameters()))
    # A free setting differs: the checkpoint loads, and the run goes on with the new one.
    longer = make_trainer(small_config(steps=3, save_every=1))
    longer.load_checkpoint(tmp_path / "ck")
    assert longer.step_count == 1 and longer.config.steps == 3
