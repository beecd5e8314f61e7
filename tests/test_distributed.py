"""Several processes (gloo on CPU): N ranks compute what one process computes on the same global
batch, up to the order of the reductions; a 2-process ``pyppo train`` resumes exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyppo.trainer.rollout_forwards import rollout_forwards
from pyppo.trainer.step_stats import PhaseTimer
from support.distributed_worker import one_update, update_config
from support.reference import ref_adaptive_kl_coef, ref_sequence_kl
from support.tiny_models import save_tiny_causal_lm
from support.trainer_fixture import EOS, PROMPTS, make_trainer

HERE = Path(__file__).resolve().parent  # the tests folder: support.*
# Only the reduction order differs (one process sums 4 rows' gradients, two ranks sum 2 each and
# average): float32 rounding, amplified at most a little by one AdamW step.
RTOL, ATOL = 1e-5, 1e-6


def torchrun(nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=HERE,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


@pytest.fixture(scope="module")
def fixed_rollout(tmp_path_factory):
    """One rollout of 4 sequences with its old log-probs, reference log-probs, values and scores."""
    trainer = make_trainer(update_config(False, 4))
    batch = trainer.rollout(PROMPTS[:4])
    batch.raw_scores, batch.scores = trainer.score(batch)
    rollout_forwards(trainer.models, batch, torch.arange(4), trainer.micro_batch_size, PhaseTimer())
    path = tmp_path_factory.mktemp("rollout") / "batch.pt"
    torch.save({"batch": batch, "kl_coef": 0.05}, path)
    return path, batch


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_update_like_one_process(fixed_rollout, tmp_path, mode):
    path, batch = fixed_rollout
    one = one_update(make_trainer(update_config(False, 4)), batch.select(torch.arange(4)), 0.05)
    torchrun(2, str(HERE / "support" / "distributed_worker.py"), str(path), str(tmp_path / "two.pt"), mode)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    # Advantage whitening used the global batch: each rank's rows are the single process's rows.
    torch.testing.assert_close(two["advantages"], one["advantages"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(two["returns"], one["returns"], rtol=RTOL, atol=ATOL)
    for model in ("policy", "value"):
        assert two[model].keys() == one[model].keys()
        moved = 0
        for name, weight in one[model].items():
            torch.testing.assert_close(two[model][name], weight, rtol=RTOL, atol=ATOL, msg=f"{model} {name}")
        initial = make_trainer(update_config(False, 4))
        start = (
            dict(initial.policy.named_parameters())
            if model == "policy"
            else dict(initial.critic.model.named_parameters())
        )
        moved = sum(not torch.equal(start[n], w) for n, w in one[model].items())
        assert moved > len(one[model]) // 2  # the update moved the weights being compared


@pytest.fixture(scope="module")
def episode_rollout(tmp_path_factory):
    """Four 3-turn episodes (the environment's replies between the policy's turns) with their
    old log-probs, reference log-probs, values and scores."""
    from pyppo.trainer import PPOTrainer
    from support.agent_fixture import Replies, Scripted
    from support.tiny_models import tiny_causal_lm, tiny_tokenizer

    tok = tiny_tokenizer()
    config = update_config(False, 4).with_changes(max_turns=3)
    trainer = PPOTrainer(config, tiny_causal_lm(0), None, None, tok, None, PROMPTS, environment=Replies)
    no, maybe = (tok(t, add_special_tokens=False)["input_ids"] for t in ("no", "maybe"))
    trainer.engine.engine = Scripted([no + [EOS], maybe + [EOS], [EOS]])
    batch = trainer.rollout(PROMPTS[:4])
    batch.raw_scores, batch.scores = trainer.score(batch)
    rollout_forwards(trainer.models, batch, torch.arange(4), trainer.micro_batch_size, PhaseTimer())
    assert bool((batch.response_mask & ~batch.loss_mask).any())  # environment tokens in every row
    path = tmp_path_factory.mktemp("episodes") / "batch.pt"
    torch.save({"batch": batch, "kl_coef": 0.05}, path)
    return path, batch


def test_two_ranks_update_on_episodes_like_one_process(episode_rollout, tmp_path):
    path, batch = episode_rollout
    one = one_update(make_trainer(update_config(False, 4)), batch.select(torch.arange(4)), 0.05)
    torchrun(2, str(HERE / "support" / "distributed_worker.py"), str(path), str(tmp_path / "two.pt"), "ddp")
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    torch.testing.assert_close(two["advantages"], one["advantages"], rtol=RTOL, atol=ATOL)
    for model in ("policy", "value"):
        for name, weight in one[model].items():
            torch.testing.assert_close(two[model][name], weight, rtol=RTOL, atol=ATOL, msg=f"{model} {name}")


def test_the_kl_controller_is_fed_the_global_kl_of_ranks_whose_kls_differ(tmp_path):
    # Each rank samples its own responses against a reference unlike the policy: the ranks' KLs
    # differ, and every rank's coefficient must be Ziegler's update from the whole batch's KL
    # (nats per sequence over both ranks' responses, by hand from their log-probs) and its 4 samples.
    out = tmp_path / "ranks.pt"
    torchrun(2, str(HERE / "support" / "distributed_worker.py"), "kl-controller", str(out))
    ranks = torch.load(out, weights_only=False)
    kls = [ref_sequence_kl(r["old_logprobs"], r["ref_logprobs"], r["response_ids"], EOS) for r in ranks]
    assert [len(k) for k in kls] == [2, 2]
    global_kl = sum(sum(k) for k in kls) / 4
    target = ranks[0]["target"]
    expected = ref_adaptive_kl_coef(0.2, global_kl, target, 4, 20.0)
    assert ranks[0]["target"] == ranks[1]["target"] and 0.8 < global_kl / target < 1.2
    for r in ranks:
        assert r["kl_coef"] == pytest.approx(expected, rel=1e-6)
    # A rank that fed the controller its own KL (or its own count of samples) would be off.
    local = [ref_adaptive_kl_coef(0.2, sum(k) / 2, target, n, 20.0) for k in kls for n in (2, 4)]
    assert min(abs(x - expected) for x in local) > 1e-4 * expected


def test_world_size_must_divide_the_batch():
    from pyppo.config import PPOConfig

    cfg = PPOConfig(batch_size=6, mini_batch_size=3)
    cfg.check_world_size(3)
    with pytest.raises(ValueError, match=r"mini_batch_size \(3\) must be divisible by the number of processes \(2\)"):
        cfg.check_world_size(2)
    with pytest.raises(ValueError, match=r"batch_size \(6\) must be divisible .* \(4\)"):
        cfg.check_world_size(4)
    with pytest.raises(ValueError, match="micro_batch_size"):
        PPOConfig(batch_size=8, mini_batch_size=8, micro_batch_size=3).check_world_size(2)


def test_two_process_train_resumes_like_an_uninterrupted_run(tmp_path):
    model = save_tiny_causal_lm(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:10]) + "\n")
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def count_e(prompts, responses):\n    return [float(r.count('e')) - 0.1 * len(r) for r in responses]\n"
    )
    flags = [
        "--model",
        str(model),
        "--reward",
        f"{reward}:count_e",
        "--prompts",
        str(prompts),
        "--device",
        "cpu",
        "--batch-size",
        "4",
        "--mini-batch-size",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "6",
        "--lr",
        "1e-3",
        "--seed",
        "3",
        "--save-every",
        "1",
        "--lr-warmup-steps",
        "8",
    ]
    # Two optimizer steps a step: the warm-up is at 4 of 8 when the run resumes.
    torchrun(2, "-m", "pyppo", "train", *flags, "--steps", "2", "--output", str(tmp_path / "run"))
    torchrun(2, "-m", "pyppo", "train", "--resume", str(tmp_path / "run"), "--steps", "3")
    torchrun(2, "-m", "pyppo", "train", *flags, "--steps", "3", "--output", str(tmp_path / "straight"))

    def rows(run):
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    untimed = lambda r: {k: v for k, v in r.items() if "time" not in k and "seconds" not in k}  # noqa: E731
    resumed, straight = rows("run"), rows("straight")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [untimed(r) for r in resumed] == [untimed(r) for r in straight]
    samples = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 3 * 4  # both ranks' samples, rank 0 writes them
    a = torch.load(tmp_path / "run" / "checkpoint" / "policy.pt", weights_only=True)
    b = torch.load(tmp_path / "straight" / "checkpoint" / "policy.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["rank_rng"]) == 2
    assert not torch.equal(state["rank_rng"][0]["rng_torch"], state["rank_rng"][1]["rng_torch"])
    from transformers import AutoModelForCausalLM

    # The exported policy/ is the checkpoint's trained policy, weight for weight.
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy").state_dict()
    matched = [k for k in a if k in exported]
    assert len(matched) >= len(a) - 1  # (a tied head may be saved once)
    assert all(torch.equal(exported[k], a[k]) for k in matched)

    # The checkpoint is of 2 processes: one process refuses it, naming both counts.
    from pyppo import cli

    os.environ.pop("WORLD_SIZE", None)
    # ... before anything loads, naming the command that resumes it.
    from pyppo.cli.flags import CLIError

    with pytest.raises(
        CLIError,
        match=r"written by 2 process\(es\), this run has 1; resume it with: pyppo train "
        r"--resume \S+ --nproc 2$",
    ):
        os.environ["PYPPO_DEBUG"] = "1"
        try:
            cli.main(["train", "--resume", str(tmp_path / "run"), "--steps", "4"])
        finally:
            del os.environ["PYPPO_DEBUG"]


def test_two_process_agent_run_gives_each_rank_its_own_episodes_and_resumes_exactly(tmp_path):
    model = save_tiny_causal_lm(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:8]) + "\n")
    flags = ["--model", str(model), "--env", f"{HERE / 'support' / 'echo_env.py'}:Echo", "--device", "cpu"]
    flags += ["--prompts", str(prompts)]
    flags += ["--batch-size", "4", "--mini-batch-size", "2", "--ppo-epochs", "1", "--max-new-tokens", "12"]
    flags += ["--max-turns", "3", "--seed", "5", "--save-every", "1", "--dtype", "float32"]
    torchrun(2, "-m", "pyppo", "train", *flags, "--steps", "1", "--output", str(tmp_path / "run"))
    torchrun(2, "-m", "pyppo", "train", "--resume", str(tmp_path / "run"), "--steps", "2")
    torchrun(2, "-m", "pyppo", "train", *flags, "--steps", "2", "--output", str(tmp_path / "straight"))

    def rows(run, name):
        return [json.loads(line) for line in (tmp_path / run / name).read_text().splitlines()]

    untimed = lambda r: {k: v for k, v in r.items() if "time" not in k and "seconds" not in k}  # noqa: E731
    assert [untimed(r) for r in rows("run", "metrics.jsonl")] == [untimed(r) for r in rows("straight", "metrics.jsonl")]
    assert all(r["first_max_abs_logratio"] == 0.0 and "turns_mean" in r for r in rows("run", "metrics.jsonl"))
    samples = rows("run", "samples.jsonl")
    assert len(samples) == 2 * 4 and samples == rows("straight", "samples.jsonl")  # both ranks' episodes


def test_two_process_fsdp_lora_train_exports_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM

    model = save_tiny_causal_lm(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:10]) + "\n")
    flags = [
        "--model",
        str(model),
        "--reward",
        f"{HERE / 'support' / 'trainer_fixture.py'}:count_e",
        "--prompts",
        str(prompts),
        "--device",
        "cpu",
        "--batch-size",
        "4",
        "--mini-batch-size",
        "4",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "6",
        "--lr",
        "1e-2",
        "--seed",
        "3",
        "--fsdp",
        "--lora-rank",
        "4",
        "--save-every",
        "1",
        "--eval-prompts",
        str(prompts),
        "--eval-every",
        "1",
    ]
    torchrun(2, "-m", "pyppo", "train", *flags, "--steps", "1", "--output", str(tmp_path / "run"))
    torchrun(2, "-m", "pyppo", "train", "--resume", str(tmp_path / "run"), "--steps", "2")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("eval/score_mean" in r for r in rows)
    assert rows[0]["first_max_abs_logratio"] == 0.0 and rows[0]["kl_mean"] == 0.0
    assert len((tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()) == 2 * 10
    weights = torch.load(tmp_path / "run" / "checkpoint" / "policy.pt", weights_only=True)
    assert weights and all("lora_" in k for k in weights)  # only what trains
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy")
    base = AutoModelForCausalLM.from_pretrained(model)
    changed = [n for n, p in exported.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert changed and all("proj" in n for n in changed)  # the merged adapters moved the adapted layers only
