"""PPOConfig: validation from the field metadata, (de)serialisation, the generated docs table,
the one flag per field of ``pyppo train``, the rules of what acts only with what (``NEEDS``) and
of what a resume may change."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import pytest

from pyppo import cli
from pyppo.config import (
    NEEDS,
    RESUME_RULES,
    InertSettings,
    PPOConfig,
    ResumeChange,
    config_knobs,
    config_markdown,
    resume_conflicts,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"
BEGIN, END = "<!-- config-keys:begin -->", "<!-- config-keys:end -->"


@pytest.mark.parametrize(
    "key, value",
    [
        ("steps", 0),
        ("batch_size", 0),
        ("mini_batch_size", 3),
        ("mini_batch_size", 32),
        ("micro_batch_size", 3),
        ("ppo_epochs", 0),
        ("max_new_tokens", 0),
        ("temperature", 0.0),
        ("top_p", 0.0),
        ("top_k", -1),
        ("lr", 0.0),
        ("lr", math.nan),
        ("kl_coef", -0.1),
        ("target_kl", 0.0),
        ("kl_horizon", 0.0),
        ("kl_estimator", "k4"),
        ("gamma", 1.5),
        ("lam", -0.1),
        ("cliprange", 1.0),
        ("cliprange_high", 0.0),
        ("dual_clip", 1.0),
        ("cliprange_value", 0.0),
        ("vf_coef", -1.0),
        ("entropy_coef", -0.1),
        ("max_grad_norm", 0.0),
        ("score_clip", -1.0),
        ("missing_eos_penalty", -1.0),
        ("loss_agg", "mean"),
        ("loss_agg_norm", 0.0),
        ("whiten_advantages", 1),
        ("use_chat_template", "yes"),
        ("seed", -1),
        ("save_every", -1),
        ("steps", 2.5),
        ("batch_size", True),
        ("device", "tpu"),
        ("device", ""),
        ("device", 3),
        ("kl_estimator", ["k1"]),
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
        "docs/trainer.md's key table is stale: regenerate it from pyppo/config/ with "
        "`python -m pyppo.config` and paste it between the markers"
    )


def test_train_has_a_flag_for_every_field(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    help_text = capsys.readouterr().out
    for f in dataclasses.fields(PPOConfig):
        assert "--" + f.name.replace("_", "-") in help_text, f.name


def test_flags_set_every_kind_of_field(tmp_path):
    args = cli.build_parser().parse_args(
        [
            "train",
            "--max-grad-norm",
            "none",
            "--no-whiten-advantages",
            "--kl-estimator",
            "k3",
            "--device",
            "cpu",
            "--micro-batch-size",
            "4",
            "--gamma",
            "0.5",
            "--output",
            str(tmp_path / "o"),
        ]
    )
    cfg = cli.resolve_train_config(args).config
    assert (
        cfg.max_grad_norm,
        cfg.whiten_advantages,
        cfg.kl_estimator,
        cfg.device,
        cfg.micro_batch_size,
        cfg.gamma,
    ) == (None, False, "k3", "cpu", 4, 0.5)


def test_resolved_config_keeps_none_over_a_non_none_default(tmp_path):
    # cliprange_value defaults to 0.2: a run that turned it off must resume with it off.
    cfg = PPOConfig(cliprange_value=None, max_grad_norm=None)
    path = tmp_path / "config.toml"
    cli.write_resolved_config(path, {"model": "m", "reward": "sentiment", "prompts": None}, cfg)
    args = cli.build_parser().parse_args(["train", "--config", str(path), "--output", str(tmp_path / "o")])
    back = cli.resolve_train_config(args).config
    assert back.cliprange_value is None and back.max_grad_norm is None
    assert back == cfg  # every field is written, so the file alone gives the run's settings back


# ----------------------------------------------------------------------------- what acts with what
#: For each rule of NEEDS (by its first knob): settings where it does not hold, and settings where it does.
RULE_OFF_ON = {
    "value_lr": (dict(advantage_estimator="grpo", samples_per_prompt=2, kl_coef=0.0, lora_rank=4), dict(lora_rank=4)),
    "lam": (dict(advantage_estimator="gae_turn"), {}),
    "gamma_turn": ({}, dict(advantage_estimator="gae_turn")),
    "gamma": (
        dict(advantage_estimator="rloo", samples_per_prompt=2, kl_coef=0.0),
        dict(advantage_estimator="reinforce_pp"),
    ),
    "whiten_advantages": (
        dict(advantage_estimator="grpo", samples_per_prompt=2, kl_coef=0.0),
        dict(advantage_estimator="reinforce_pp_baseline", samples_per_prompt=2, kl_coef=0.0),
    ),
    "grpo_std_normalize": ({}, dict(advantage_estimator="grpo", samples_per_prompt=2, kl_coef=0.0)),
    "dual_clip": (dict(policy_loss="cispo"), {}),
    "loss_agg_norm": ({}, dict(loss_agg="seq-mean-token-sum-norm")),
    "fused_policy_loss": (dict(logprobs_from_hidden=False), {}),
    "target_kl": (dict(kl_coef=0.0), {}),
    "kl_horizon": ({}, dict(target_kl=2.0)),
    "kl_loss_estimator": ({}, dict(kl_loss_coef=0.1)),
    "filter_groups": ({}, dict(samples_per_prompt=2)),
    "filter_groups_max_tries": (dict(samples_per_prompt=2), dict(samples_per_prompt=2, filter_groups=True)),
    "overlong_penalty": ({}, dict(overlong_buffer=4)),
    "lora_alpha": ({}, dict(lora_rank=4)),
    "rollout_correction": ({}, dict(rollout_engine="vllm")),
    "rollout_is_cap": (dict(rollout_engine="vllm", rollout_correction="none"), dict(rollout_engine="vllm")),
    "vllm_kv_cache_gib": ({}, dict(rollout_engine="vllm")),
    "fsdp": ({}, {}),  # turns on the number of processes: 1 where it does not hold, 2 where it does
}
#: A value away from the default for each knob a rule names.
OTHER_VALUE = {
    "value_lr": 1e-4,
    "vf_coef": 0.5,
    "cliprange_value": None,
    "lam": 0.9,
    "critic_warmup_steps": 2,
    "lam_critic": 1.0,
    "lam_alpha": 0.5,
    "gamma_turn": 0.9,
    "lam_turn": 1.0,
    "value_lora": True,
    "gamma": 0.99,
    "whiten_advantages": False,
    "grpo_std_normalize": False,
    "dual_clip": 3.0,
    "loss_agg_norm": 5.0,
    "fused_policy_loss": False,
    "target_kl": 1.0,
    "kl_horizon": 50.0,
    "kl_loss_estimator": "k2",
    "filter_groups": True,
    "filter_groups_max_tries": 2,
    "overlong_penalty": 0.5,
    "lora_alpha": 8.0,
    "lora_target_modules": "q_proj",
    "merge_lora": False,
    "rollout_correction": "token_mask",
    "rollout_is_cap": 1.5,
    "vllm_kv_cache_gib": 2.0,
    "vllm_gpu_memory_utilization": 0.5,
    "fsdp": True,
}
RULE_KNOBS = [pytest.param(rule, name, id=f"{rule.knobs[0]}-rule:{name}") for rule in NEEDS for name in rule.knobs]


def test_every_knob_has_a_rule_or_always_acts():
    named = {name for rule in NEEDS for name in rule.knobs}
    for name, k in config_knobs():
        assert k.always_acts != (name in named), (
            f"{name}: mark it always_acts=True in its knob(...), or give it a rule in pyppo.config.NEEDS (not both)"
        )
    assert set(RULE_OFF_ON) == {rule.knobs[0] for rule in NEEDS} and set(OTHER_VALUE) == named


def test_every_knob_says_whether_a_resume_may_change_it():
    rules = {name: k.resume for name, k in config_knobs()}
    assert set(rules.values()) <= set(RESUME_RULES)
    for name in (
        "seed",
        "kl_coef",
        "target_kl",
        "kl_horizon",
        "lora_rank",
        "lora_alpha",
        "lora_target_modules",
        "value_lora",
        "dtype",
        "advantage_estimator",
        "batch_size",
        "mini_batch_size",
        "ppo_epochs",
    ):
        assert rules[name] == "fixed", name
    for name in (
        "steps",
        "save_every",
        "eval_every",
        "log_samples",
        "max_consecutive_skips",
        "device",
        "vllm_kv_cache_gib",
        "vllm_gpu_memory_utilization",
    ):
        assert rules[name] == "free", name


@pytest.mark.parametrize("rule, name", RULE_KNOBS)
def test_each_rule_refuses_a_knob_where_it_acts_on_nothing(rule, name):
    off, on = RULE_OFF_ON[rule.knobs[0]]
    settings = {**off, name: OTHER_VALUE[name]}
    if rule.world:
        config = PPOConfig(**settings)
        with pytest.warns(UserWarning) as said:
            config.check_world_size(1)
        message = str(said[-1].message)
        expected = rule.needs.format(c=config, world=1)
        with warnings.catch_warnings(record=True) as more:
            warnings.simplefilter("always")
            config.check_world_size(1)  # said once per config
            config.check_world_size(2)  # where it acts
        assert not more
    else:
        with pytest.raises(InertSettings) as refused:
            PPOConfig(**settings)
        message = str(refused.value)
        expected = rule.needs.format(c=PPOConfig(**off), world=None)
        assert refused.value.groups == [(expected, [(name, OTHER_VALUE[name])])]
        PPOConfig(**on, **{name: OTHER_VALUE[name]})  # accepted where it acts
    assert message == f"{name} = {OTHER_VALUE[name]!r} has no effect here: it needs {expected}"


def test_several_inert_knobs_are_named_in_one_message():
    with pytest.raises(
        ValueError,
        match=r"^kl_horizon = 5.0 has no effect here: it needs target_kl .*; lora_alpha = "
        r"8.0 and merge_lora = False have no effect here: they need lora_rank > 0 "
        r"\(LoRA is off\)$",
    ):
        PPOConfig(lora_alpha=8.0, merge_lora=False, kl_horizon=5.0)


@pytest.mark.parametrize(
    "estimator, kl_coef, kl_loss_coef, warns",
    [
        ("grpo", 0.05, 0.0, True),
        ("rloo", 0.05, 0.0, True),
        ("reinforce_pp_baseline", 0.1, 0.0, True),
        ("grpo", 0.05, 0.1, False),
        ("grpo", 0.0, 0.0, False),
        ("reinforce_pp", 0.05, 0.0, False),
        ("gae", 0.05, 0.0, False),
    ],
)
def test_a_group_estimator_with_the_kl_only_in_the_reward_warns_once(estimator, kl_coef, kl_loss_coef, warns, recwarn):
    PPOConfig(advantage_estimator=estimator, samples_per_prompt=2, kl_coef=kl_coef, kl_loss_coef=kl_loss_coef)
    said = [str(w.message) for w in recwarn if "kl_loss_coef = 0" in str(w.message)]
    assert len(said) == int(warns)
    if warns:
        assert said[0].startswith(f"kl_coef = {kl_coef!r} with advantage_estimator = {estimator!r}")


def test_with_changes_resets_the_knobs_the_change_leaves_inert():
    vllm = PPOConfig(rollout_engine="vllm", rollout_correction="token_mask", rollout_is_cap=1.5, vllm_kv_cache_gib=2.0)
    plain = vllm.with_changes(rollout_engine="transformers", device="cpu")
    assert (
        plain.rollout_engine,
        plain.rollout_correction,
        plain.rollout_is_cap,
        plain.vllm_kv_cache_gib,
        plain.device,
    ) == ("transformers", "auto", 2.0, 1.0, "cpu")
    with pytest.raises(InertSettings, match="rollout_is_cap = 1.5"):
        vllm.with_changes(rollout_engine="transformers", rollout_is_cap=1.5)


def test_rollout_correction_auto_truncates_vllm_s_samples_only():
    assert PPOConfig().effective_rollout_correction == "none"
    assert PPOConfig(rollout_engine="vllm").effective_rollout_correction == "token_truncate"
    assert PPOConfig(rollout_engine="vllm", rollout_correction="none").effective_rollout_correction == "none"
    # The cap acts wherever auto corrects; with the transformers engine nothing is corrected.
    assert PPOConfig(rollout_engine="vllm", rollout_is_cap=3.0).rollout_is_cap == 3.0
    with pytest.raises(InertSettings, match="rollout_is_cap"):
        PPOConfig(rollout_is_cap=3.0)
    # An earlier run's config file names "none" with the transformers engine: still valid.
    assert PPOConfig(rollout_correction="none").effective_rollout_correction == "none"


def test_resume_conflicts_names_the_fixed_changes_and_returns_the_free_ones():
    saved = PPOConfig(steps=10, kl_coef=0.05, seed=1).to_dict()
    assert resume_conflicts(saved, PPOConfig(steps=20, kl_coef=0.05, seed=1, device="cpu")) == [
        ResumeChange("steps", 10, 20),
        ResumeChange("device", "auto", "cpu"),
    ]
    with pytest.raises(
        ValueError,
        match=r"^the checkpoint was trained with other settings, which a resume cannot "
        r"change: kl_coef 0.05 -> 0.1, seed 1 -> 2 "
        r"\(the checkpoint's -> this run's\); start a new run to change them$",
    ):
        resume_conflicts(saved, PPOConfig(steps=20, kl_coef=0.1, seed=2))
    # A key the checkpoint lacks (written before the knob existed) and no config at all compare nothing.
    assert resume_conflicts({"steps": 10}, PPOConfig(steps=10, seed=3)) == []
    assert resume_conflicts(None, PPOConfig(seed=3)) == []
