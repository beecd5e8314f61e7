"""``pyppo profile`` on a tiny random Llama saved as a local HF model (no downloads)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from pyppo import profile
from pyppo.stats import PHASES
from tiny_models import save_tiny_causal_lm

FLAGS = ["--batch-size", "2", "--max-new-tokens", "5", "--warmup-steps", "0", "--device", "cpu", "--seed", "1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def profiled(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    buf = io.StringIO()
    with redirect_stdout(buf):
        status = profile.main(["--model", str(tiny_dir), "--output", str(out), *FLAGS])
    return status, out, buf.getvalue()


def test_profile_writes_trace_and_table(profiled):
    status, out, stdout = profiled
    assert status == 0, stdout
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    for phase in PHASES:
        assert f"pyppo/{phase}" in names  # the trainer's record_function ranges
    assert any(str(n).startswith("pyppo::") for n in names)  # the ops themselves

    result = json.loads((out / "profile.json").read_text())
    rows = {r["phase"]: r for r in result["phases"]}
    assert list(rows) == list(PHASES)
    for phase, r in rows.items():
        assert r["seconds"] > 0 and r["profiler_seconds"] > 0, phase
        assert 0.0 <= r["pyppo_share"] <= 1.0
        assert r["pyppo_seconds"] <= r["profiler_seconds"] + 1e-9
    # log-probs come from pyppo.gather_logprobs, advantages from shape_rewards / gae / masked_whiten
    for phase in ("policy_forward", "ref_forward", "advantages", "update"):
        assert rows[phase]["pyppo_seconds"] > 0, phase
    assert rows["generate"]["pyppo_seconds"] == 0
    op_names = {r["name"] for r in result["pyppo_ops"]}
    assert {"pyppo::gather_logprobs", "pyppo::gae", "pyppo::shape_rewards"} <= op_names
    assert result["step_seconds"] >= sum(r["seconds"] for r in result["phases"]) - 1e-6
    assert result["metrics"]["response_length_mean"] > 0
    assert result["config"]["batch_size"] == 2


def test_profile_prints_the_phase_table(profiled):
    _, out, stdout = profiled
    for title in profile.PHASE_TITLES.values():
        assert title in stdout
    assert "pyppo % of phase" in stdout and "trace.json" in stdout


def test_profile_via_cli(tiny_dir, tmp_path, capsys):
    from pyppo import cli

    assert cli.main(["profile", "--model", str(tiny_dir), "--output", str(tmp_path), "--ppo-epochs", "2", *FLAGS]) == 0
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "profile.json").is_file()
    assert "reference forward" in capsys.readouterr().out


def test_bad_flag_is_a_user_error(tiny_dir, tmp_path, capsys):
    from pyppo import cli

    assert cli.main(["profile", "--model", str(tiny_dir), "--output", str(tmp_path), "--warmup-steps", "-1"]) == 2
    assert "warmup-steps" in capsys.readouterr().err
