"""A value model warm-started from an earlier run (``PPOTrainer.load_value_model``,
``pyppo train --value-model DIR``): the earlier run's trained value weights and nothing else; each
wrong source refused in one line, on the command line before any model loads."""

from __future__ import annotations

import pytest
import torch

from pyppo import cli
from support.run_fixture import no_loading  # noqa: F401  (a fixture)
from support.trainer_fixture import make_trainer, small_config


def _weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A gae run of two steps, checkpointed as pyppo train leaves it (``<run>/checkpoint``)."""
    run = tmp_path_factory.mktemp("earlier")
    tr = make_trainer(small_config(steps=2))
    tr.step()
    tr.step()
    tr.save_checkpoint(run / "checkpoint")
    return run, _weights(tr.critic.model)


@pytest.mark.parametrize("where", ["run", "checkpoint"])
def test_the_value_model_starts_from_the_earlier_runs_and_nothing_else_does(earlier_run, where):
    run, trained = earlier_run
    fresh = make_trainer(small_config(steps=2))
    policy, value = _weights(fresh.policy), _weights(fresh.critic.model)
    assert any(not torch.equal(value[n], trained[n]) for n in trained)  # the start differs
    loaded = fresh.load_value_model(run if where == "run" else run / "checkpoint")
    assert loaded == run / "checkpoint"
    now = _weights(fresh.critic.model)
    assert now.keys() == trained.keys() and all(torch.equal(now[n], trained[n]) for n in trained)
    assert all(torch.equal(a, p) for a, p in zip(policy.values(), fresh.policy.parameters()))
    assert fresh.step_count == 0 and not fresh.critic.optimizer.state  # a fresh optimizer
    m = fresh.step().metrics
    assert torch.isfinite(torch.tensor([m["value_loss"], m["policy_loss"]])).all()


def test_a_warm_started_value_predicts_as_the_earlier_one(earlier_run):
    # The weights make the model: the same batch gets the same values from both.
    run, _ = earlier_run
    a, b = make_trainer(small_config()), make_trainer(small_config())
    b.load_value_model(run)
    batch = torch.randint(3, 60, (2, 7))
    with torch.no_grad():
        va, vb = a.critic.model(batch), b.critic.model(batch)
    assert not torch.equal(va, vb)
    a.load_value_model(run)
    with torch.no_grad():
        assert torch.equal(a.critic.model(batch), vb)


def test_a_warm_start_is_refused_where_it_would_be_wrong(earlier_run, tmp_path):
    run, _ = earlier_run
    grpo = make_trainer(small_config(advantage_estimator="grpo", samples_per_prompt=2, kl_coef=0.0))
    with pytest.raises(ValueError, match=r"this run trains no value model \(advantage_estimator = 'grpo'\)"):
        grpo.load_value_model(run)
    # A critic-free run's checkpoint holds no value model.
    grpo.step()
    grpo.save_checkpoint(tmp_path / "grpo" / "checkpoint")
    with pytest.raises(ValueError, match=r"has no value model \(its run used a critic-free estimator\)"):
        make_trainer(small_config()).load_value_model(tmp_path / "grpo")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in it or in its checkpoint/"):
        make_trainer(small_config()).load_value_model(tmp_path / "nothing")
    stepped = make_trainer(small_config())
    stepped.step()
    before = _weights(stepped.critic.model)
    with pytest.raises(ValueError, match=r"has taken 1 step\(s\); a value model is warm-started before the first"):
        stepped.load_value_model(run)
    assert all(torch.equal(before[n], p) for n, p in stepped.critic.model.named_parameters())
    # Another value model's trained weights (LoRA adapters against a full fine-tune) are named.
    lora = make_trainer(small_config(lora_rank=4, value_lora=True))
    mismatch = r"^value_model .*: the checkpoint's value model weights do not match .* lora_rank / value_lora"
    with pytest.raises(ValueError, match=mismatch):
        lora.load_value_model(run)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("pyppo: error: ")]
    assert len(errors) == 1 and not any("Traceback" in line for line in err), err
    return errors[0]


def test_the_command_line_resolves_value_model_and_records_it(earlier_run, tmp_path):
    run, _ = earlier_run
    args = cli.build_parser().parse_args(["train", "--value-model", str(run), "--output", str(tmp_path / "new")])
    plan = cli.resolve_train_config(args)
    assert plan.run["value_model"] == str(run.resolve())
    (tmp_path / "vm.toml").write_text(f'value_model = "{run}"\n')
    args = cli.build_parser().parse_args(
        ["train", "--config", str(tmp_path / "vm.toml"), "--output", str(tmp_path / "n")]
    )
    assert cli.resolve_train_config(args).run["value_model"] == str(run.resolve())


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--advantage-estimator", "rloo", "--samples-per-prompt", "2", "--kl-coef", "0"], "trains no value model"),
        (["--value-model", "NOWHERE"], "no such directory"),
    ],
)
def test_the_command_line_refuses_a_bad_value_model_before_loading(
    earlier_run, extra, expected, tmp_path, capsys, no_loading, monkeypatch
):
    run, _ = earlier_run
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--value-model", str(run), *extra, "--output", str(tmp_path / "new")]
    assert cli.main(argv) == 2
    assert expected in _one_error(capsys)
    (tmp_path / "empty").mkdir()
    assert cli.main(["train", "--value-model", str(tmp_path / "empty"), "--output", str(tmp_path / "new")]) == 2
    assert "no complete checkpoint in it or in its checkpoint/" in _one_error(capsys)
    a_file = run / "checkpoint" / "trainer_state.pt"
    assert cli.main(["train", "--value-model", str(a_file), "--output", str(tmp_path / "new")]) == 2
    assert "is a file; pass the earlier run's directory or its checkpoint/" in _one_error(capsys)
    assert not (tmp_path / "new").exists()


def test_a_resume_takes_its_value_model_from_its_checkpoint(earlier_run, tmp_path, capsys, no_loading):
    run, _ = earlier_run
    from pyppo.cli.train import TRAIN_DEFAULTS
    from pyppo.config import PPOConfig
    from pyppo.run.config_file import write_config

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    config = PPOConfig(**{**TRAIN_DEFAULTS, "dtype": "float32"})
    write_config(resumed / "config.toml", {"model": str(tmp_path / "no-model"), "reward": "sentiment"}, config)
    (resumed / "checkpoint").mkdir()
    for name in ("policy.pt", "value_model.pt", "optimizers.pt"):
        torch.save({}, resumed / "checkpoint" / name)
    torch.save({"step": 1, "world_size": 1, "config": config.to_dict()}, resumed / "checkpoint" / "trainer_state.pt")
    assert cli.main(["train", "--resume", str(resumed), "--value-model", str(run)]) == 2
    line = _one_error(capsys)
    assert line.startswith(f"pyppo: error: --value-model {str(run)!r}: a value model is warm-started when a run")
    assert "the resumed run's comes from its checkpoint" in line
    # Recorded by the run that started from it, it is not read again: the directory may be gone.
    write_config(
        resumed / "config.toml",
        {"model": str(tmp_path / "no-model"), "reward": "sentiment", "value_model": str(tmp_path / "gone")},
        config,
    )
    args = cli.build_parser().parse_args(["train", "--resume", str(resumed), "--steps", "40"])
    plan = cli.resolve_train_config(args)
    assert plan.resume_step == 1 and plan.run["value_model"] == str(tmp_path / "gone")
    # The same directory again names the run's own source; another one is refused by its flag.
    same = ["train", "--resume", str(resumed), "--steps", "40", "--value-model", str(tmp_path / "gone")]
    assert cli.resolve_train_config(cli.build_parser().parse_args(same)).resume_step == 1
    assert cli.main(["train", "--resume", str(resumed), "--value-model", str(run)]) == 2
    assert _one_error(capsys).startswith(f"pyppo: error: --value-model {str(run)!r} differs from the resumed run's")


def test_a_warm_up_as_long_as_the_run_is_said():
    from support.trainer_fixture import small_config as config

    with pytest.warns(UserWarning, match=r"critic_warmup_steps = 2 >= steps = 2: .* the policy is never trained"):
        config(steps=2, critic_warmup_steps=2)
