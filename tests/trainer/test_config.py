"""PPOConfig: validation from the field metadata, (de)serialisation, the generated docs table,
and the one flag per field of ``pyppo train``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from pyppo import cli
from pyppo.config import PPOConfig, config_knobs, config_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"
BEGIN, END = "<!-- config-keys:begin -->", "<!-- config-keys:end -->"


@pytest.mark.parametrize(
    "key, value",
    [
        ("steps", 0), ("batch_size", 0), ("mini_batch_size", 3), ("mini_batch_size", 32), ("micro_batch_size", 3),
        ("ppo_epochs", 0), ("max_new_tokens", 0), ("temperature", 0.0), ("top_p", 0.0), ("top_k", -1),
        ("lr", 0.0), ("lr", math.nan), ("kl_coef", -0.1), ("target_kl", 0.0), ("kl_horizon", 0.0),
        ("kl_estimator", "k4"), ("gamma", 1.5), ("lam", -0.1), ("cliprange", 1.0), ("cliprange_high", 0.0),
        ("dual_clip", 1.0), ("cliprange_value", 0.0), ("vf_coef", -1.0), ("entropy_coef", -0.1),
        ("max_grad_norm", 0.0), ("score_clip", -1.0), ("missing_eos_penalty", -1.0), ("loss_agg", "mean"),
        ("loss_agg_norm", 0.0), ("whiten_advantages", 1), ("use_chat_template", "yes"), ("seed", -1),
        ("save_every", -1), ("steps", 2.5), ("batch_size", True), ("device", "tpu"), ("device", ""),
        ("device", 3), ("kl_estimator", ["k1"]),
    ],
)
def test_config_validation_names_the_key(key, value):
    with pytest.raises(ValueError, match=f"^{key}"):
        PPOConfig(**{key: value})


def test_every_field_is_checked():
    # A value of the wrong kind is refused for every field: no field escapes validation.
    for name, knob in config_knobs():
        with pytest.raises(ValueError, match=f"^{name} must be"):
            PPOConfig(**{name: object()})


def test_optional_fields_say_so():
    with pytest.raises(ValueError, match=r"max_grad_norm must be a finite number > 0.0 or None, got 0.0"):
        PPOConfig(max_grad_norm=0.0)
    assert PPOConfig(max_grad_norm=None, cliprange_value=None).max_grad_norm is None


def test_config_from_dict():
    cfg = PPOConfig.from_dict({"steps": 3, "lr": 2e-5, "loss_agg": "seq-mean-token-sum-norm"})
    assert cfg.steps == 3 and cfg.lr == 2e-5 and cfg.effective_loss_agg_norm == cfg.max_new_tokens
    assert PPOConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="bogus, learning_rate"):
        PPOConfig.from_dict({"learning_rate": 1.0, "bogus": 2, "steps": 1})
    with pytest.raises(ValueError, match="kl_coef"):
        PPOConfig(kl_coef=0.0, target_kl=1.0)
    assert isinstance(PPOConfig(lr=1).lr, float) and PPOConfig().device == "auto"


def test_docs_key_table_is_current():
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"{DOCS} lost its generated-table markers"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == config_markdown().strip(), (
        "docs/trainer.md's key table is stale: regenerate it from pyppo/config.py with "
        "`python -m pyppo.config` and paste it between the markers")


def test_train_has_a_flag_for_every_field(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    help_text = capsys.readouterr().out
    for f in dataclasses.fields(PPOConfig):
        assert "--" + f.name.replace("_", "-") in help_text, f.name


def test_flags_set_every_kind_of_field(tmp_path):
    args = cli.build_parser().parse_args([
        "train", "--max-grad-norm", "none", "--no-whiten-advantages", "--kl-estimator", "k3", "--device", "cpu",
        "--micro-batch-size", "4", "--gamma", "0.5", "--output", str(tmp_path / "o")])
    cfg = cli.resolve_train_config(args).config
    assert (cfg.max_grad_norm, cfg.whiten_advantages, cfg.kl_estimator, cfg.device, cfg.micro_batch_size,
            cfg.gamma) == (None, False, "k3", "cpu", 4, 0.5)


def test_resolved_config_keeps_none_over_a_non_none_default(tmp_path):
    # cliprange_value defaults to 0.2: a run that turned it off must resume with it off.
    cfg = PPOConfig(cliprange_value=None, max_grad_norm=None)
    path = tmp_path / "config.toml"
    cli.write_resolved_config(path, {"model": "m", "reward": "sentiment", "prompts": None}, cfg)
    args = cli.build_parser().parse_args(["train", "--config", str(path), "--output", str(tmp_path / "o")])
    back = cli.resolve_train_config(args).config
    assert back.cliprange_value is None and back.max_grad_norm is None
    assert back == cfg  # every field is written, so the file alone gives the run's settings back
