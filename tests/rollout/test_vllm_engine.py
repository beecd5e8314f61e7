"""The vLLM rollout engine on a tiny random Llama (vLLM's CPU backend): its log-probs are the
policy's, a weight sync makes it sample from the updated policy (full and LoRA), the first ratio
stays exactly 1, a planted mismatch shows in the metrics, and ``pyppo train --rollout-engine vllm``
stops on a signal and resumes to the uninterrupted run's numbers. Skipped without vLLM
(``scripts/install_vllm.sh``)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from support.tiny_models import tiny_llama_config, tiny_tokenizer
from support.trainer_fixture import PROMPTS, count_e, small_config

vllm = pytest.importorskip("vllm", reason="needs vLLM (scripts/install_vllm.sh)")

from pyppo import PPOTrainer  # noqa: E402
from pyppo.config import PPOConfig  # noqa: E402
from pyppo.rollout.vllm_engine import LOGPROBS_MODE, VLLMEngine, policy_state_dict  # noqa: E402

# fp32, the same weights: only kernels and summation order differ (4.8e-7 measured on the tiny model).
LOGPROB_ATOL = 1e-4
KV_GIB = 0.125  # the tiny model needs almost none; many engines live in one test process


def vllm_llama(seed: int = 0):
    """A tiny random Llama that vLLM's CPU attention runs: head_dim 32 (8, the other tests' tiny
    model, is not among its kernels' sizes)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)).eval()


def tokenizer():
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    return tok


def hf_logprobs(model, rollout, temperature=1.0):
    """float32 log-probs of the sampled tokens under ``model``, one padded forward (the reference)."""
    ids = torch.cat([rollout.query_ids, rollout.response_ids], 1)
    mask = torch.cat([rollout.query_mask, rollout.response_mask], 1)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits.float()
    P = rollout.query_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1 : -1] / temperature, -1)
    return lp.gather(-1, rollout.response_ids.unsqueeze(-1)).squeeze(-1)


def max_diff(a, b, mask):
    return float((a - b)[mask].abs().max())


@pytest.fixture(scope="module")
def model_and_engine():
    model = vllm_llama()
    engine = VLLMEngine(model, tokenizer(), max_new_tokens=12, temperature=1.0, seed=0, kv_cache_gib=KV_GIB)
    yield model, engine
    engine.close()


def test_the_engine_s_checkpoint_is_gone_once_vllm_has_read_it(model_and_engine):
    _, engine = model_and_engine
    assert not os.path.exists(engine._dir) and engine.generate(PROMPTS[:1]).response_ids.numel() > 0


def _scratch():
    tmp = tempfile.gettempdir()
    return set(glob.glob(os.path.join(tmp, "vllm_dist_*"))) | set(glob.glob(os.path.join(tmp, "pyppo-vllm-*")))


def test_a_kv_cache_too_small_names_pyppo_s_knob_and_leaves_no_file_behind():
    before = _scratch()
    with pytest.raises(ValueError, match=r"vllm_kv_cache_gib = 1e-05 \(--vllm-kv-cache-gib\) leaves vLLM too little"):
        VLLMEngine(vllm_llama(), tokenizer(), max_new_tokens=4, kv_cache_gib=1e-5)
    assert _scratch() <= before  # neither vLLM's rendezvous file nor pyppo's copy of the weights


def test_a_kv_cache_larger_than_the_machine_names_pyppo_s_knob():
    from pyppo.rollout.vllm_engine import _memory_error

    vllm_says = (
        "Available memory on node 0 (20.83/23.54 GiB) on kv cache allocation is less than requested memory "
        "for kv (64.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE"
    )
    err = str(_memory_error(ValueError(vllm_says), torch.device("cpu"), 64.0, 0.3))
    assert err.startswith("vllm_kv_cache_gib = 64 (--vllm-kv-cache-gib) asks for more memory than this machine")
    assert err.endswith("lower it") and "VLLM_CPU_KVCACHE_SPACE" not in err and "--kv-cache-memory-bytes" not in err
    other = ValueError("something else")
    assert _memory_error(other, torch.device("cpu"), 1.0, 0.3) is other


def test_a_head_size_vllm_s_cpu_kernels_lack_is_refused_before_vllm_loads_the_policy(monkeypatch):
    from pyppo.rollout.vllm_support import VLLMStartError
    from support.tiny_models import tiny_causal_lm

    monkeypatch.setattr(vllm, "LLM", lambda **kw: pytest.fail("vLLM was started on a model it cannot run"))
    with pytest.raises(VLLMStartError) as err:  # the other tests' tiny Llama: head_dim 8
        VLLMEngine(tiny_causal_lm(), tokenizer(), max_new_tokens=4, kv_cache_gib=KV_GIB)
    text = str(err.value)
    assert "\n" not in text and "head size is 8" in text and "--rollout-engine transformers" in text


def test_any_other_start_failure_is_one_line_with_vllm_s_own_error_chained(monkeypatch):
    from pyppo.rollout.vllm_support import VLLMStartError

    deep = RuntimeError("Traceback (most recent call last):\n  File ...\nUnsupported CPU attention configuration")
    monkeypatch.setattr(vllm, "LLM", lambda **kw: (_ for _ in ()).throw(deep))
    with pytest.raises(VLLMStartError) as err:
        VLLMEngine(vllm_llama(), tokenizer(), max_new_tokens=4, kv_cache_gib=KV_GIB)
    text = str(err.value)
    assert "\n" not in text and "RuntimeError: Unsupported CPU attention configuration" in text
    assert "(llama, float32, cpu)" in text and err.value.__cause__ is deep


def test_pyppo_train_with_a_model_vllm_cannot_run_exits_2_with_one_line(tmp_path):
    from support.tiny_models import tiny_causal_lm

    model = tmp_path / "hd8"
    tiny_causal_lm().save_pretrained(model)
    tokenizer().save_pretrained(model)
    # vLLM's loader is never reached: the child fails if it is.
    code = (
        "import sys, vllm\n"
        "def no(**kw): raise SystemExit('vLLM was started')\n"
        "vllm.LLM = no\n"
        "from pyppo import cli\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", code, "train", "--model", str(model), *FLAGS, "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pyppo: error:")]
    assert len(errors) == 1 and "head size is 8" in errors[0] and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_are_the_policy_logprobs(model_and_engine, temperature):
    model, engine = model_and_engine
    engine.temperature = temperature
    try:
        torch.manual_seed(1)
        r = engine.generate(PROMPTS[:6])
    finally:
        engine.temperature = 1.0
    assert r.rollout_logprobs.dtype == torch.float32 and r.rollout_logprobs.shape == r.response_ids.shape
    assert r.response_mask.any(1).all()
    assert torch.equal(r.rollout_logprobs[~r.response_mask], torch.zeros(int((~r.response_mask).sum())))
    # After temperature: the processed log-probs (the raw ones would not match at 0.7).
    assert max_diff(r.rollout_logprobs, hf_logprobs(model, r, temperature), r.response_mask) < LOGPROB_ATOL
    if temperature != 1.0:
        assert max_diff(r.rollout_logprobs, hf_logprobs(model, r, 1.0), r.response_mask) > 1e-3
    assert engine.llm.llm_engine.model_config.logprobs_mode == LOGPROBS_MODE


def test_the_same_seed_samples_the_same_responses_whatever_the_batch(model_and_engine):
    _, engine = model_and_engine
    torch.manual_seed(7)
    a = engine.generate(PROMPTS[:4])
    torch.manual_seed(7)
    b = engine.generate(PROMPTS[:4])
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    torch.manual_seed(8)
    c = engine.generate(PROMPTS[:4])
    assert not torch.equal(a.response_ids, c.response_ids)


def test_each_request_has_its_own_seed_so_a_prompt_repeated_in_a_batch_gets_different_responses(model_and_engine):
    # samples_per_prompt puts a prompt's group in one batch: one seed for all its requests would
    # make the group's responses identical (every group advantage 0).
    _, engine = model_and_engine
    torch.manual_seed(11)
    group = engine.generate([PROMPTS[0]] * 4)
    responses = {tuple(r[m].tolist()) for r, m in zip(group.response_ids, group.response_mask)}
    assert len(responses) == 4


def test_a_weight_sync_makes_the_engine_sample_from_the_updated_policy(model_and_engine):
    model, engine = model_and_engine
    old = vllm_llama()
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        seconds = engine.sync_weights(model)
        assert seconds == engine.last_sync_s > 0
        torch.manual_seed(2)
        r = engine.generate(PROMPTS[:6])
        assert max_diff(r.rollout_logprobs, hf_logprobs(model, r), r.response_mask) < LOGPROB_ATOL
        assert max_diff(r.rollout_logprobs, hf_logprobs(old, r), r.response_mask) > 1e-2
    finally:  # the module's other tests keep the original weights
        model.load_state_dict(old.state_dict())
        engine.sync_weights(model)


def test_sample_continuations_continues_the_given_ids_with_the_policys_logprobs(model_and_engine):
    model, engine = model_and_engine
    tok = tokenizer()
    contexts = [tok("Say hi.")["input_ids"], tok("Describe the rain, please.")["input_ids"]]
    out = engine.sample_continuations(contexts, 6)
    assert len(out) == 2
    for context, (ids, logprobs) in zip(contexts, out):
        assert 1 <= len(ids) <= 6 and len(logprobs) == len(ids)
        if 2 in ids:
            assert ids.index(2) == len(ids) - 1  # cut after the first EOS
        full = torch.tensor([context + ids])
        with torch.no_grad():
            logits = model(input_ids=full).logits.float()
        lp = torch.log_softmax(logits[0, len(context) - 1 : -1], -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), lp, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("sync", ["direct", "reload"])
def test_both_sync_paths_copy_every_weight_and_say_nothing(sync, capfd):
    model = vllm_llama(seed=3)
    engine = VLLMEngine(model, tokenizer(), max_new_tokens=6, seed=0, kv_cache_gib=KV_GIB, sync=sync)
    try:
        assert engine.sync == sync
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        capfd.readouterr()
        engine.sync_weights(model)
        # vLLM's reload logged (to stdout) "RotaryEmbedding: Failed to load weights" per layer per sync.
        said = capfd.readouterr()
        assert said.out == said.err == ""
        torch.manual_seed(4)
        r = engine.generate(PROMPTS[:5])
        assert max_diff(r.rollout_logprobs, hf_logprobs(model, r), r.response_mask) < LOGPROB_ATOL
    finally:
        engine.close()


def test_a_sync_copies_the_trainable_weights_or_all(monkeypatch):
    from pyppo.rollout import vllm_engine

    model = vllm_llama(seed=6)
    engine = VLLMEngine(model, tokenizer(), max_new_tokens=6, seed=0, kv_cache_gib=KV_GIB, sync="direct")
    try:
        repacked = []
        real = vllm_engine._repack
        monkeypatch.setattr(
            vllm_engine, "_repack", lambda module: (repacked.append(type(module).__name__), real(module))
        )
        model.requires_grad_(False)
        trained = [
            model.model.layers[1].mlp.down_proj.weight,
            model.model.layers[0].self_attn.k_proj.weight,
        ]  # one part of vLLM's fused qkv_proj
        with torch.no_grad():
            for p in trained:
                p.requires_grad_(True)
                p.add_(torch.randn_like(p) * 0.3)
            model.model.layers[0].mlp.up_proj.weight.mul_(3.0)  # frozen: not copied by default
        engine.sync_weights(model)
        assert sorted(repacked) == ["QKVParallelLinear", "RowParallelLinear"]
        torch.manual_seed(6)
        r = engine.generate(PROMPTS[:5])
        assert max_diff(r.rollout_logprobs, hf_logprobs(model, r), r.response_mask) > 1e-3  # up_proj is stale
        repacked.clear()
        engine.sync_weights(model, trainable_only=False)  # what the trainer does after a resume
        # Per block qkv, o, gate_up and down; the embedding and the LM head (each has a packed copy on a CPU).
        assert sorted(repacked) == sorted(
            ["QKVParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear"] * 2
            + ["VocabParallelEmbedding", "ParallelLMHead"]
        )
        torch.manual_seed(6)
        r = engine.generate(PROMPTS[:5])
        assert max_diff(r.rollout_logprobs, hf_logprobs(model, r), r.response_mask) < LOGPROB_ATOL
    finally:
        engine.close()


def test_a_lora_policy_is_synced_with_its_adapters_merged():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(vllm_llama(seed=4), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    engine = VLLMEngine(model, tokenizer(), max_new_tokens=6, seed=0, kv_cache_gib=KV_GIB)
    try:
        with torch.no_grad():  # adapters start at B = 0: give them a delta
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        engine.sync_weights(model)
        assert engine.sync == "direct"
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # not merged in place
        assert not any("lora" in k for k in policy_state_dict(model))
        torch.manual_seed(5)
        r = engine.generate(PROMPTS[:5])
        assert max_diff(r.rollout_logprobs, hf_logprobs(model, r), r.response_mask) < LOGPROB_ATOL
        with model.disable_adapter():
            assert max_diff(r.rollout_logprobs, hf_logprobs(model, r), r.response_mask) > 1e-3
    finally:
        engine.close()


# ---------------------------------------------------------------------------------- in the trainer
def vllm_trainer(**overrides):
    cfg = small_config(**{"rollout_engine": "vllm", "vllm_kv_cache_gib": KV_GIB, **overrides})
    return PPOTrainer(cfg, vllm_llama(), None, None, tokenizer(), count_e, PROMPTS)


def test_the_trainer_samples_with_vllm_and_its_first_ratio_is_exactly_one():
    tr = vllm_trainer(steps=2)
    assert isinstance(tr.engine, VLLMEngine)
    calls = []
    real = tr.engine.sync_weights
    tr.engine.sync_weights = lambda model, **kw: (calls.append((model, kw)), real(model, **kw))[1]
    m1, b1 = tr.step()
    assert calls == []  # the engine was built from these weights
    # pyppo's own forward gives old_logprobs: the first ratio is exactly 1, the step-1 KL exactly 0.
    assert m1["first_max_abs_logratio"] == 0.0 and m1["kl_mean"] == 0.0
    assert b1.rollout_logprobs is not None
    assert max_diff(b1.old_logprobs, b1.rollout_logprobs, b1.response_mask) < LOGPROB_ATOL
    assert m1["mismatch_logprob_diff_max"] < LOGPROB_ATOL and abs(m1["mismatch_kl_k3"]) < 1e-6
    assert m1["mismatch_ratio_outside_fraction"] == 0.0
    m2, b2 = tr.step()
    assert calls == [(tr.policy, {"trainable_only": True})] and m2["time_weight_sync"] >= tr.engine.last_sync_s > 0
    # The engine sampled from the updated policy: its log-probs are the trainer's again.
    assert m2["mismatch_logprob_diff_max"] < LOGPROB_ATOL and m2["first_max_abs_logratio"] == 0.0


def test_multi_turn_episodes_sample_with_vllm_and_the_first_ratio_is_exactly_one():
    """Each turn continues the episode's token ids in vLLM (its prefix cache holds the context of
    the turn before); vLLM's log-probs are the trainer's on the agent's tokens and 0 on the
    environment's."""
    from support.agent_fixture import Replies

    cfg = small_config(rollout_engine="vllm", vllm_kv_cache_gib=KV_GIB, max_new_tokens=48, max_turns=3, steps=1)
    tr = PPOTrainer(cfg, vllm_llama(), None, None, tokenizer(), None, PROMPTS, environment=Replies)
    m, b = tr.step()
    assert m["turns_mean"] > 1.0 and m["env_token_fraction"] > 0
    assert m["first_max_abs_logratio"] == 0.0 and m["kl_mean"] == 0.0
    env = b.response_mask & ~b.loss_mask
    assert b.rollout_logprobs is not None and float(b.rollout_logprobs[env].abs().sum()) == 0.0
    assert max_diff(b.old_logprobs, b.rollout_logprobs, b.loss_mask) < LOGPROB_ATOL


def test_a_planted_mismatch_in_the_engine_shows_in_the_metrics_and_the_default_corrects_it():
    tr = vllm_trainer(steps=1, rollout_is_cap=1.2)  # rollout_correction "auto": token_truncate with vLLM
    assert tr.config.rollout_correction == "auto" and tr.config.effective_rollout_correction == "token_truncate"
    tr.engine.temperature = 0.5  # the sampler's distribution is no longer the trainer's
    m = tr.step().metrics
    assert m["mismatch_logprob_diff_mean"] > 0.05 and m["mismatch_kl_k3"] > 1e-3
    assert m["rollout_corrected_fraction"] > 0 and m["first_max_abs_logratio"] == 0.0


def test_the_engine_knobs_reach_vllm(monkeypatch):
    seen = []
    real = vllm.LLM

    def spy(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(vllm, "LLM", spy)
    tr = vllm_trainer(steps=1, vllm_kv_cache_gib=0.1, temperature=0.9, seed=5)
    assert seen[0]["kv_cache_memory_bytes"] == int(0.1 * 2**30) and seen[0]["seed"] == 5
    assert seen[0]["dtype"] == "float32" and seen[0]["logprobs_mode"] == LOGPROBS_MODE
    assert tr.engine.temperature == 0.9 and tr.engine.max_new_tokens == tr.config.max_new_tokens
    # On CUDA the engine's share of the device is the knob's (built here on the CPU: only the kwargs).
    from pyppo.rollout import build

    captured = {}
    monkeypatch.setattr(
        "pyppo.rollout.vllm_engine.VLLMEngine.__init__", lambda self, model, tok, **kw: captured.update(kw)
    )
    cfg = PPOConfig(rollout_engine="vllm", vllm_gpu_memory_utilization=0.45)
    build.make_engine(
        cfg,
        policy=None,
        policy_module=None,
        tokenizer=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_prompt_tokens=None,
        sharded=False,
    )
    assert captured["gpu_memory_utilization"] == 0.45 and captured["kv_cache_gib"] == cfg.vllm_kv_cache_gib


# ---------------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-tiny") / "model"
    vllm_llama().save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:6]))
    return path


# float32: the mismatch bound below is float32's (with `auto`, a bf16 CPU would sample in bf16).
FLAGS = [
    "--rollout-engine",
    "vllm",
    "--vllm-kv-cache-gib",
    str(KV_GIB),
    "--steps",
    "3",
    "--batch-size",
    "2",
    "--mini-batch-size",
    "1",
    "--ppo-epochs",
    "1",
    "--max-new-tokens",
    "6",
    "--seed",
    "3",
    "--save-every",
    "100",
    "--dtype",
    "float32",
]


def rows(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if "time" not in k and "seconds" not in k} for line in lines]


def _pyppo(*argv):
    """``pyppo`` in a child process: every run of the comparison in the same fresh state (this
    process's torch threads and RNGs are whatever earlier tests left)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from pyppo import cli; sys.exit(cli.main(sys.argv[1:]))", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_pyppo_train_with_vllm_stops_on_a_signal_and_resumes_exactly(vllm_model_dir, prompts_path, tmp_path):
    straight = tmp_path / "straight"
    argv = ["train", "--model", str(vllm_model_dir), "--prompts", str(prompts_path), *FLAGS]
    _pyppo(*argv, "--output", str(straight))
    want = rows(straight)
    assert len(want) == 3 and want[0]["first_max_abs_logratio"] == 0.0
    assert all(r["mismatch_logprob_diff_max"] < LOGPROB_ATOL for r in want)

    # A real SIGINT in a child process, once step 2 has been logged; then --resume.
    stopped = tmp_path / "stopped"
    code = (
        "import os, signal, sys\n"
        "from pyppo import cli\n"
        "from pyppo import PPOTrainer\n"
        "real = PPOTrainer.step\n"
        "def step(self):\n"
        "    out = real(self)\n"
        "    if self.step_count == 2:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return out\n"
        "PPOTrainer.step = step\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv, "--output", str(stopped)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "its checkpoint is at step 2" in proc.stderr, proc.stderr[-3000:]
    _pyppo("train", "--resume", str(stopped))
    # Seeded per-request sampling from the restored torch generator, and the engine synced to the
    # checkpoint's weights before the first resumed rollout: the uninterrupted run's numbers.
    assert rows(stopped) == want


@pytest.mark.parametrize("parallel", [["--lora-rank", "0"], ["--fsdp", "--lora-rank", "4"]], ids=["ddp", "fsdp2-lora"])
def test_under_torchrun_each_rank_samples_with_its_own_synced_engine(vllm_model_dir, prompts_path, tmp_path, parallel):
    # A large learning rate: a rank whose engine kept the weights of the step before would show
    # a mismatch of ~0.5 nats (measured with the sync switched off), not ~5e-7.
    out = tmp_path / "run"
    proc = _pyppo(
        "train",
        "--nproc",
        "2",
        "--model",
        str(vllm_model_dir),
        "--prompts",
        str(prompts_path),
        *FLAGS,
        "--batch-size",
        "4",
        "--mini-batch-size",
        "2",
        "--lr",
        "0.01",
        *parallel,
        "--output",
        str(out),
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    got = rows(out)
    assert len(got) == 3 and all(r["first_max_abs_logratio"] == 0.0 for r in got)
    assert all(r["mismatch_logprob_diff_max"] < LOGPROB_ATOL for r in got), [
        r["mismatch_logprob_diff_max"] for r in got
    ]
    assert (out / "policy" / "config.json").is_file()
