"""benchmarks/peer_step.py without TRL: the transformers-4.53 copy of a model directory, the
venv check, the tables and the options (milliseconds; nothing is loaded or installed)."""

from __future__ import annotations

import importlib.util
import json
from datetime import date
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_step.py"
_spec = importlib.util.spec_from_file_location("peer_step", _PATH)
peer_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_step)


def test_compat_config_moves_rope_theta_and_dtype():
    config = {
        "model_type": "llama",
        "dtype": "float32",
        "hidden_size": 576,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    }
    out = peer_step.compat_config(config)
    assert out == {"model_type": "llama", "torch_dtype": "float32", "hidden_size": 576, "rope_theta": 100000.0}
    assert "rope_parameters" in config  # the input is left as it was


def test_compat_config_keeps_a_scaled_rope_as_rope_scaling():
    rope = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}
    out = peer_step.compat_config({"rope_parameters": rope, "torch_dtype": "bfloat16"})
    assert out == {
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
        "torch_dtype": "bfloat16",
    }


def test_compat_config_leaves_an_old_config_alone():
    old = {"rope_theta": 10000.0, "torch_dtype": "float32", "rope_scaling": None}
    assert peer_step.compat_config(old) == old


def test_compat_tokenizer_config():
    config = {
        "backend": "tokenizers",
        "is_local": True,
        "local_files_only": True,
        "eos_token": "<|im_end|>",
        "tokenizer_class": "TokenizersBackend",
    }
    assert peer_step.compat_tokenizer_config(config) == {
        "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    assert peer_step.compat_tokenizer_config({"tokenizer_class": "GPT2Tokenizer"}) == {
        "tokenizer_class": "GPT2Tokenizer"
    }


def test_write_compat_dir_links_weights_and_rewrites_configs(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"dtype": "float32", "rope_parameters": {"rope_theta": 7.0}}))
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (src / "model.safetensors").write_bytes(b"weights")
    dst = tmp_path / "compat" / "policy"
    for _ in range(2):  # rebuilding over an existing copy works too
        assert peer_step.write_compat_dir(src, dst) == dst
    assert json.loads((dst / "config.json").read_text()) == {"torch_dtype": "float32", "rope_theta": 7.0}
    assert json.loads((dst / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (dst / "model.safetensors").is_symlink() and (dst / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in dst.parent.iterdir()) == ["policy"]  # no temp dir left behind


def test_venv_is_ready_needs_every_pin_and_the_cpu_torch():
    good = {**peer_step.TRL_PINS, "torch": "2.13.0+cpu"}
    assert peer_step.venv_is_ready(good)
    assert not peer_step.venv_is_ready(None)
    assert not peer_step.venv_is_ready({**good, "torch": "2.13.0"})  # a CUDA build reports no +cpu
    assert not peer_step.venv_is_ready({**good, "trl": "1.16.0"})
    assert not peer_step.venv_is_ready({**good, "datasets": None})


def test_median_after_first():
    assert peer_step.median_after_first([30.0, 10.0, 12.0, 11.0]) == 11.0
    assert peer_step.median_after_first([30.0]) == 30.0


def _result(name, seconds, rss_gb, phases):
    steps = [
        {"s": s, "rest": phases["rest"], "phases": {k: v for k, v in phases.items() if k != "rest"}} for s in seconds
    ]
    return peer_step.summarize(name, {"steps": steps}, int(rss_gb * 1e9))


def test_tables_show_both_trainers_and_the_ratios():
    trl = _result("TRL", [25.0, 20.0, 22.0, 21.0], 8.0, {"generate": 7.0, "train_forward": 6.0, "rest": 9.0})
    ppo = _result("pyppo", [19.0, 18.0, 17.0, 16.0], 6.0, {"generate": 7.0, "policy_forward": 0.0, "rest": 8.0})
    text = peer_step.markdown_tables({"trl": trl, "pyppo": ppo})
    assert "| TRL | 21.0 | 25.0, 20.0, 22.0, 21.0 | 8.00 GB |" in text
    assert "| pyppo | 17.0 | 19.0, 18.0, 17.0, 16.0 | 6.00 GB |" in text
    assert "| pyppo / TRL | 0.81x | | 0.75x | |" in text
    assert "median, steps 2-4" in text
    assert "| rollout log-probs (policy forward) | in generate (scores) | 0.00 |" in text
    assert "| of which the training forward | 6.00 | - |" in text
    assert peer_step.ratio(ppo["s_per_step"], trl["s_per_step"]) == pytest.approx(17.0 / 21.0)


def test_tables_with_one_trainer_have_no_ratio():
    ppo = _result("pyppo", [19.0], 6.0, {"generate": 7.0, "rest": 8.0})
    text = peer_step.markdown_tables({"pyppo": ppo})
    assert "pyppo / TRL" not in text and "median, step 1" in text
    assert "| generate (32 decode steps) | 7.00 |" in text and "| TRL" not in text
    assert peer_step.ratio(None, 3.0) is None


def test_options():
    args = peer_step.parse_args([])
    assert (args.steps, args.threads, args.json, args.skip_trl, args.skip_pyppo) == (4, 2, None, False, False)
    assert (args.dtype, args.allocator) == ("both", ["auto"])
    assert peer_step.parse_args(["--allocator", "glibc,jemalloc,glibc"]).allocator == ["glibc", "jemalloc"]
    assert peer_step.parse_args(["--json"]).json == "auto"
    assert peer_step.json_path("auto", date(2026, 12, 2)) == peer_step.RESULTS / "peer_step-2026-12-02.json"
    assert peer_step.json_path("/tmp/x.json", date(2026, 12, 2)) == Path("/tmp/x.json")
    assert peer_step.json_path(None, date(2026, 12, 2)) is None
    for bad in (
        ["--skip-trl", "--skip-pyppo"],
        ["--steps", "0"],
        ["--threads", "0"],
        ["--dtype", "float16"],
        ["--allocator", "mimalloc"],
        ["--allocator", ","],
    ):
        with pytest.raises(SystemExit):
            peer_step.parse_args(bad)


def test_tables_put_each_allocator_beside_trl():
    trl = _result("TRL", [25.0, 20.0], 8.0, {"generate": 7.0, "rest": 9.0})
    glibc = _result("pyppo PPOTrainer (glibc)", [19.0, 18.0], 7.0, {"generate": 7.0, "rest": 8.0})
    jemalloc = _result("pyppo PPOTrainer (jemalloc)", [19.0, 17.0], 6.0, {"generate": 6.0, "rest": 8.0})
    jemalloc["page_faults_per_step"] = {"minor": 52000.0, "major": 0.0}
    text = peer_step.markdown_tables({"trl": trl, "pyppo:glibc": glibc, "pyppo:jemalloc": jemalloc})
    assert "| pyppo PPOTrainer (glibc) / TRL | 0.90x | | 0.88x | |" in text
    assert "| pyppo PPOTrainer (jemalloc) / TRL | 0.85x | | 0.75x | |" in text
    assert "| pyppo PPOTrainer (jemalloc) | 17.0 | 19.0, 17.0 | 6.00 GB | 52k |" in text
    assert "| phase (median s, step 2) | TRL | pyppo (glibc) | pyppo (jemalloc) |" in text
    assert "| generate (32 decode steps) | 7.00 | 7.00 | 6.00 |" in text


def test_allocator_env(monkeypatch):
    from pyppo.run import allocator

    monkeypatch.setenv("LD_PRELOAD", "/x/libfoo.so")
    name, env = peer_step.allocator_env("glibc")
    assert name == "glibc" and "LD_PRELOAD" not in env
    monkeypatch.setattr(allocator, "find_allocator", lambda n: None)
    assert peer_step.allocator_env("auto")[0] == "glibc"
    with pytest.raises(SystemExit, match="--allocator tcmalloc: not installed"):
        peer_step.allocator_env("tcmalloc")
    monkeypatch.setattr(allocator, "find_allocator", lambda n: f"/lib/lib{n}.so")
    name, env = peer_step.allocator_env("auto")
    assert name == allocator.PREFERRED and env["LD_PRELOAD"] == f"/lib/lib{allocator.PREFERRED}.so"
