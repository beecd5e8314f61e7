"""Held-out evaluation (eval_prompts, eval_every) and the policy/ directory a run leaves."""

from __future__ import annotations

import json

import pytest
import torch

from pyppo import cli
from pyppo.run.plotting import PANELS
from support.tiny_models import save_tiny_causal_lm, tiny_tokenizer
from support.trainer_fixture import PROMPTS, count_e, make_trainer, small_config

EVAL = [f"held out question {i}?" for i in range(11)]


def test_eval_every_logs_scores_kl_and_samples(tmp_path):
    from pyppo import PPOTrainer
    from support.tiny_models import tiny_causal_lm

    tr = PPOTrainer(
        small_config(steps=3, eval_every=2),
        tiny_causal_lm(seed=0),
        None,
        None,
        tiny_tokenizer(),
        count_e,
        PROMPTS,
        eval_prompts=EVAL,
    )
    rows = tr.train(tmp_path, progress=False)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [("eval/score_mean" in r) for r in logged] == [False, True, True]  # step 2, and the last
    samples = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2] * 11 + [3] * 11
    assert [s["prompt"] for s in samples[:11]] == EVAL  # every prompt once, in order
    for step, row in ((2, logged[1]), (3, logged[2])):
        mine = [s for s in samples if s["step"] == step]
        assert row["eval/score_mean"] == pytest.approx(sum(s["score"] for s in mine) / 11)
        assert row["eval/kl_mean"] == pytest.approx(sum(s["kl"] for s in mine) / 11)
        assert row["eval/score_mean"] == pytest.approx(sum(count_e(None, [s["response"] for s in mine])) / 11)
    assert rows[-1]["eval/kl_mean"] != 0.0  # the policy moved away from the reference
    assert any("eval/score_mean" in keys for _, keys in PANELS)


def test_eval_kl_is_zero_before_training():
    tr = make_trainer(small_config(steps=1))
    metrics, rows = tr.evaluate_prompts(EVAL[:3])
    assert metrics["eval/kl_mean"] == 0.0 and len(rows) == 3
    assert {"step", "prompt", "response", "score", "kl"} == set(rows[0])


def test_eval_every_needs_eval_prompts(tmp_path, capsys):
    with pytest.raises(ValueError, match="eval_every = 2 needs eval_prompts"):
        make_trainer(small_config(eval_every=2))
    assert cli.main(["train", "--eval-every", "2", "--output", str(tmp_path / "o")]) == 2
    assert "--eval-every 2 needs --eval-prompts" in capsys.readouterr().err
    assert cli.main(["train", "--eval-prompts", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "--eval-prompts" in capsys.readouterr().err


def test_a_run_leaves_a_policy_that_transformers_and_pyppo_load(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    tiny = save_tiny_causal_lm(tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:6]) + "\n")
    flags = [
        "--prompts",
        str(prompts),
        "--eval-prompts",
        str(prompts),
        "--batch-size",
        "4",
        "--mini-batch-size",
        "4",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "6",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--lr",
        "1e-2",
    ]
    assert cli.main(["train", "--model", str(tiny), *flags, "--output", str(tmp_path / "a")]) == 0
    assert "policy" in capsys.readouterr().out
    policy_dir = tmp_path / "a" / "policy"
    trained = AutoModelForCausalLM.from_pretrained(policy_dir)
    start = AutoModelForCausalLM.from_pretrained(tiny)
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), start.parameters()))
    assert (tmp_path / "a" / "eval_samples.jsonl").is_file()
    # A refused resume (a full fine-tune's checkpoint into a LoRA run) leaves the run's files alone;
    # refused before anything loads.
    config_before = (tmp_path / "a" / "config.toml").read_text()
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(tmp_path / "a"), "--steps", "2", "--lora-rank", "4"]) == 2
    err = capsys.readouterr().err
    assert "lora_rank 0 -> 4" in err and "Loading weights" not in err
    assert (tmp_path / "a" / "config.toml").read_text() == config_before
    # ... and a new run starts from it.
    assert cli.main(["train", "--model", str(policy_dir), *flags, "--output", str(tmp_path / "b")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl_mean"] == 0.0  # its reference is the exported policy itself


def test_extending_a_finished_run_with_eval_prompts_takes_the_uninterrupted_runs_steps(tmp_path, capsys):
    """`--steps 2`, then `--resume --steps 4`: the first run evaluates after its last step (2),
    where the 4-step run does not; steps 3 and 4 must not see that evaluation's sampling."""
    tiny = save_tiny_causal_lm(tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:6]) + "\n")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("\n".join(json.dumps({"prompt": p}) for p in EVAL[:3]) + "\n")
    flags = [
        "--model",
        str(tiny),
        "--prompts",
        str(prompts),
        "--eval-prompts",
        str(held_out),
        "--batch-size",
        "2",
        "--mini-batch-size",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "6",
        "--device",
        "cpu",
        "--seed",
        "5",
    ]
    assert cli.main(["train", *flags, "--steps", "2", "--output", str(tmp_path / "extended")]) == 0
    assert cli.main(["train", "--resume", str(tmp_path / "extended"), "--steps", "4"]) == 0
    assert cli.main(["train", *flags, "--steps", "4", "--output", str(tmp_path / "straight")]) == 0
    capsys.readouterr()

    def logs(run, name):
        rows = [json.loads(line) for line in (tmp_path / run / name).read_text().splitlines()]
        return [{k: v for k, v in r.items() if "time" not in k and "seconds" not in k} for r in rows]

    extended, straight = logs("extended", "metrics.jsonl"), logs("straight", "metrics.jsonl")
    assert [r["step"] for r in extended] == [r["step"] for r in straight] == [1, 2, 3, 4]
    assert "eval/score_mean" in extended[1] and "eval/score_mean" not in straight[1]
    assert extended[2:] == straight[2:]
    assert logs("extended", "samples.jsonl")[4:] == logs("straight", "samples.jsonl")[4:]  # steps 3 and 4
    assert logs("extended", "eval_samples.jsonl")[3:] == logs("straight", "eval_samples.jsonl")  # after step 4
