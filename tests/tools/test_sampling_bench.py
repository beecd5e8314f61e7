"""benchmarks/sampling.py end to end on a tiny random model: both samplers produce exactly
``--tokens`` tokens, and the floor follows from the quantities it reports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from support.tiny_models import save_tiny_causal_lm

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sampling.py"
_spec = importlib.util.spec_from_file_location("sampling_bench", _PATH)
sampling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sampling)


def test_sampling_bench_reports_both_samplers_and_a_consistent_floor(tmp_path):
    model_dir = save_tiny_causal_lm(tmp_path / "tiny")
    out = tmp_path / "sampling.json"
    assert sampling.main(["--model", str(model_dir), "--batch", "3", "--tokens", "4", "--rounds", "1",
                          "--threads", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["seconds"]) == {"packed", "plain"} and all(v > 0 for v in r["seconds"].values())
    assert r["batch"] == 3 and r["tokens"] == 4
    weight_floor = r["linear_weight_bytes"] / (r["copy_bandwidth_GBps"] * 1e9)
    flop_floor = 2 * 3 * (r["linear_weight_bytes"] / 4) / (r["mm_peak_GFLOPs"] * 1e9)
    assert abs(r["floor_step_ms"] - 1e3 * max(weight_floor, flop_floor)) <= 1e-6 * r["floor_step_ms"]
