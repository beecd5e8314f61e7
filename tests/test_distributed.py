"""Several processes (gloo on CPU): N ranks compute what one process computes on the same global
batch, up to the order of the reductions; a 2-process ``pyppo train`` resumes exactly."""

from __future__ import annotations

import json
import math
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


def test_two_ranks_sum_their_counts_and_weigh_their_means(tmp_path):
    # This file is the worker (its __main__ below): each rank reports what it had and what the
    # reductions made of it; every count must be the sum of the ranks', not their mean.
    out = tmp_path / "ranks.pt"
    torchrun(2, str(Path(__file__).resolve()), "rank-metrics", str(out))
    ranks = torch.load(out, weights_only=False)
    (a, b), reduced = ranks["local"], ranks["reduced"]
    # One step: all 4 groups (2 a rank) scored alike (dropped or filled) and every response truncated.
    for key in ("filter_groups_dropped", "filter_groups_filled", "truncated_masked"):
        assert a[key] > 0 and reduced[key] == a[key] + b[key], key
    assert isinstance(reduced["truncated_masked"], int) and reduced["truncated_masked"] == 8
    assert reduced["filter_groups_tries"] == a["filter_groups_tries"] == b["filter_groups_tries"] == 2
    assert reduced["skipped_updates"] == 0
    # Rank 0 holds (1 call, 1 error; 1 token, its own) and rank 1 (3 calls, no error; 3 env tokens).
    assert ranks["episodes"]["tool_error_fraction"] == pytest.approx(1 / 4)  # the ranks' mean: 1/2
    assert ranks["episodes"]["env_token_fraction"] == pytest.approx(3 / 4)
    # The update's token means: 1.0 over 1 token on rank 0, 0.0 over 3 tokens on rank 1.
    assert ranks["token_stats"] == {"clipfrac": pytest.approx(1 / 4), "ratio_max": 3.0}
    assert ranks["synthetic"] == {"first_max_abs_logratio": 2.0, "first_ratio_min": 0.5, "score_mean": 1.5}
    # Token means over both ranks' tokens: rank 0 has 1 token (entropy 1, ratio 2), rank 1 has 3
    # (entropy 0, ratio 1); the mean of the ranks' means would say 1/2 and 3/2.
    assert ranks["rollout"]["entropy_mean"] == pytest.approx(1 / 4)
    first = ranks["first"]
    assert first["first_ratio_mean"] == pytest.approx(5 / 4) and first["first_ratio_max"] == pytest.approx(2.0)
    assert first["first_ratio_min"] == pytest.approx(1.0) and first["first_max_abs_logratio"] == pytest.approx(
        math.log(2)
    )
    assert first["first_approx_kl"] == pytest.approx((2 - 1 - math.log(2)) / 4)


def _rank_metrics_worker(out_path: str) -> None:
    from types import SimpleNamespace

    from pyppo import distributed
    from pyppo.trainer.sampling import _episode_metrics
    from pyppo.trainer.step_stats import RunningStats, ratio_stats, rollout_metrics
    from support.trainer_fixture import small_config

    step_metrics = []
    real = distributed.reduce_metrics

    def recording(metrics, world):
        reduced = real(metrics, world)
        if "step" in metrics:  # the step's, not a minibatch's losses
            step_metrics.append((dict(metrics), reduced))
        return reduced

    distributed.reduce_metrics = recording
    config = small_config(steps=1, mini_batch_size=4, samples_per_prompt=2, advantage_estimator="grpo", device="cpu")
    config = config.with_changes(filter_groups=True, filter_groups_max_tries=2, mask_truncated=True, max_new_tokens=4)
    trainer = make_trainer(config, eos_bias=-30.0, reward=lambda p, r: [1.0] * len(r))  # never EOS, all equal
    trainer.step()
    world, r = trainer.world, trainer.world.rank
    [(local, reduced)] = step_metrics
    calls = 1 if r == 0 else 3
    episode = SimpleNamespace(turns=1, tool_calls=calls, tool_errors=1 - r, truncated=False, episode_return=0.0)
    ids = torch.tensor([[0, 0, 0]]) if r == 0 else torch.tensor([[-1, -1, -1]])
    mask = torch.tensor([[True, False, False]]) if r == 0 else torch.ones(1, 3, dtype=torch.bool)
    batch = SimpleNamespace(episodes=[episode], turn_ids=ids, response_mask=mask)
    stats = RunningStats()
    stats.add({"clipfrac": 1.0 - r}, weight=1 + 2 * r)
    stats.add_max("ratio_max", 1.0 + 2 * r)
    synthetic = {"first_max_abs_logratio": 2.0 * r, "first_ratio_min": 0.5 + r, "score_mean": 1.0 + r}
    result = {
        "local": distributed.gather_objects(local, world),
        "reduced": reduced,
        "episodes": _episode_metrics(batch, world),
        "token_stats": stats.means(world),
        "synthetic": distributed.reduce_metrics(synthetic, world),
    }
    tokens = torch.tensor([[True, False, False]]) if r == 0 else torch.ones(1, 3, dtype=torch.bool)
    rollout = SimpleNamespace(
        raw_scores=torch.zeros(1),
        rewards=torch.zeros(1, 3),
        entropy=torch.full((1, 3), 1.0 - r),
        loss_mask=tokens,
        response_mask=tokens,
        has_eos=torch.ones(1, dtype=torch.bool),
    )
    result["rollout"] = distributed.reduce_metrics(rollout_metrics(rollout, world), world)
    micro = SimpleNamespace(
        logprobs=torch.full((1, 3), math.log(2.0) * (1 - r)), old_logprobs=torch.zeros(1, 3), loss_mask=tokens
    )
    first = {f"first_{k}": v for k, v in ratio_stats([micro], world).items()}
    result["first"] = distributed.reduce_metrics(first, world)
    if r == 0:
        torch.save(result, out_path)
    distributed.barrier(world)
    del trainer
    distributed.leave(world)


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


if __name__ == "__main__":  # a worker of the tests above, under torchrun
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)  # a rank stuck in a collective fails the test
    if sys.argv[1] == "rank-metrics":
        _rank_metrics_worker(*sys.argv[2:])
