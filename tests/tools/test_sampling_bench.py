"""benchmarks/sampling.py end to end on a tiny random model: every engine asked for samples
exactly ``T`` tokens per row in every shape and dtype, and the floor follows from the quantities it
reports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from support.tiny_models import save_tiny_causal_lm

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sampling.py"
_spec = importlib.util.spec_from_file_location("sampling_bench", _PATH)
sampling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sampling)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    import torch

    threads = torch.get_num_threads()  # main() sets --threads for the whole process
    yield
    torch.set_num_threads(threads)


def _run(tmp_path, model_dir, engines, dtypes="float32,bfloat16"):
    out = tmp_path / "sampling.json"
    assert (
        sampling.main(
            [
                "--model",
                str(model_dir),
                "--shapes",
                "3x4,2x5",
                "--dtypes",
                dtypes,
                "--engines",
                engines,
                "--rounds",
                "1",
                "--threads",
                "1",
                "--kv-cache-gib",
                "0.125",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def _check(r, engines, dtypes):
    assert [(row["dtype"], row["batch"], row["tokens"]) for row in r["rows"]] == [
        (d, b, t) for d in dtypes for b, t in ((3, 4), (2, 5))
    ]
    for row in r["rows"]:
        assert set(row["seconds"]) == set(engines) and all(v > 0 for v in row["seconds"].values())
        itemsize = {"float32": 4, "bfloat16": 2}[row["dtype"]]
        floor = row["tokens"] * r["linear_weight_elements"] * itemsize / (r["copy_bandwidth_GBps"] * 1e9)
        assert abs(row["floor_seconds"] - floor) <= 1e-9 * floor


def test_sampling_bench_times_the_default_engine_packed_plain_with_torch_multinomial_and_autocast_attention(tmp_path):
    engines = "plain,multinomial,autocast-attention,transformers"
    r = _run(tmp_path, save_tiny_causal_lm(tmp_path / "tiny"), engines)
    _check(r, set(engines.split(",")), ["float32", "bfloat16"])
    assert all(row["vllm_sync_seconds"] is None for row in r["rows"]) and r["vllm_lora_sync_seconds"] == {}


def test_sampling_bench_times_vllm_with_its_weight_sync(tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM (scripts/install_vllm.sh)")
    from transformers import LlamaForCausalLM

    from support.tiny_models import tiny_llama_config, tiny_tokenizer

    path = tmp_path / "tiny-vllm"  # head_dim 32: a size vLLM's CPU attention runs
    LlamaForCausalLM(tiny_llama_config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)).save_pretrained(
        path
    )
    tiny_tokenizer().save_pretrained(path)
    r = _run(tmp_path, path, "transformers,vllm", dtypes="float32")
    _check(r, {"transformers", "vllm"}, ["float32"])
    assert r["lora_rank"] == 8 and r["vllm_lora_sync_seconds"]["float32"] > 0
    for row in r["rows"]:
        assert row["vllm_sync_seconds"] > 0
        want = row["seconds"]["transformers"] / (row["seconds"]["vllm"] + row["vllm_sync_seconds"])
        assert row["transformers_over_vllm_with_sync"] == pytest.approx(want)


def test_a_bad_shape_is_one_clear_error():
    with pytest.raises(SystemExit, match="--shapes: '8by32' is not BxT"):
        sampling.main(["--shapes", "8by32"])
    with pytest.raises(
        SystemExit, match="--engines: 'sglang' is not transformers, plain, multinomial, autocast-attention or vllm"
    ):
        sampling.main(["--engines", "sglang"])
