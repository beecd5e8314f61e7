"""No stray output, no telemetry: a tiny ``pyppo train`` prints nothing of another library's (no
warning, no DeepSpeed line, no loading bar), ``save_pretrained`` inside the run no longer imports
DeepSpeed, and the Hugging Face Hub's telemetry and vLLM's usage statistics are off unless the
user turned them on (pyppo.run.quiet, pyppo.rollout.vllm_engine.usage_stats_off)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from pyppo.rollout import vllm_engine
from pyppo.run import quiet
from support.tiny_models import save_tiny_causal_lm

TELEMETRY = quiet.HUB_TELEMETRY_SWITCHES + vllm_engine.USAGE_STATS_SWITCHES


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model")


def _clean_env() -> dict:
    """This environment without any telemetry switch (a clean setup) and with every warning shown
    (Python hides DeprecationWarnings raised outside ``__main__``)."""
    env = {k: v for k, v in os.environ.items() if k not in TELEMETRY}
    return {**env, "PYTHONWARNINGS": "default"}


def test_a_tiny_pyppo_train_prints_nothing_of_other_libraries(tiny_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say hi.", "Describe rain."]))
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts), "--output", str(tmp_path / "o")]
    argv += ["--steps", "2", "--batch-size", "2", "--mini-batch-size", "1", "--ppo-epochs", "1"]
    argv += ["--max-new-tokens", "4"]
    res = subprocess.run(
        [sys.executable, "-m", "pyppo", *argv], capture_output=True, text=True, timeout=600, env=_clean_env()
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # The bar redraws itself after carriage returns; every other piece is one of pyppo's lines.
    pieces = [p for line in res.stderr.splitlines() for p in line.split("\r") if p.strip()]
    assert any(p.startswith("ppo: 100%") for p in pieces)
    foreign = [p for p in pieces if not p.startswith(("pyppo: ", "ppo: "))]
    assert foreign == [], res.stderr
    # DeepSpeed's logger writes to stdout: pyppo's summary alone is there.
    out = [line for line in res.stdout.splitlines() if line.strip()]
    assert out[0].startswith("pyppo: run written to") and all(line.startswith("  ") for line in out[1:]), out


def test_save_pretrained_in_the_run_does_not_import_deepspeed(tmp_path):
    # A child process: whether deepspeed is imported is a property of the whole process.
    probe = (
        "import sys\n"
        "from support.tiny_models import tiny_causal_lm\n"
        "from pyppo.run.quiet import quiet_libraries\n"
        "model = tiny_causal_lm()\n"
        "with quiet_libraries():\n"
        f"    model.save_pretrained({str(tmp_path / 'a')!r})\n"
        "print('inside:', 'deepspeed' in sys.modules)\n"
        f"model.save_pretrained({str(tmp_path / 'b')!r})\n"
        "print('outside:', 'deepspeed' in sys.modules)\n"
    )
    tests = str(os.path.dirname(os.path.dirname(__file__)))
    env = {**_clean_env(), "PYTHONPATH": f"{tests}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    said = dict(line.split(": ") for line in res.stdout.splitlines() if line.startswith(("inside: ", "outside: ")))
    inside, outside = said["inside"], said["outside"]
    assert inside == "False"
    # Where DeepSpeed is installed, transformers' own save_pretrained imports it.
    assert outside == str(importlib.util.find_spec("deepspeed") is not None)


def test_the_hubs_telemetry_is_off_unless_the_user_chose(monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    for name in TELEMETRY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)  # read once, when it was imported
    quiet.no_telemetry()
    assert os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1" and constants.HF_HUB_DISABLE_TELEMETRY is True
    # A user who turned it on keeps it.
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "0")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    quiet.no_telemetry()
    assert os.environ["HF_HUB_DISABLE_TELEMETRY"] == "0" and constants.HF_HUB_DISABLE_TELEMETRY is False
    # The run loop switches it off (quiet_libraries).
    monkeypatch.delenv("HF_HUB_DISABLE_TELEMETRY")
    with quiet.quiet_libraries():
        assert constants.HF_HUB_DISABLE_TELEMETRY is True


def test_vllms_usage_stats_are_off_before_vllm_is_imported(monkeypatch):
    for name in TELEMETRY:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    class Finder:  # an empty vllm, which records the environment at its import
        def find_spec(self, name, path=None, target=None):
            if name != "vllm":
                return None
            seen.update({k: os.environ.get(k) for k in ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK")})
            return importlib.util.spec_from_loader(name, self)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            pass

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    assert isinstance(vllm_engine.import_vllm(), types.ModuleType)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert seen == {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    # A user who set any switch has chosen: VLLM_NO_USAGE_STATS=0 keeps the report on.
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")
    monkeypatch.delenv("VLLM_DO_NOT_TRACK")
    vllm_engine.usage_stats_off()
    assert os.environ["VLLM_NO_USAGE_STATS"] == "0" and "VLLM_DO_NOT_TRACK" not in os.environ


def test_vllm_itself_sees_its_usage_stats_off():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    probe = (
        "from vllm.usage import usage_lib\n"
        "before = usage_lib.is_usage_stats_enabled()\n"
        "from pyppo.rollout.vllm_engine import usage_stats_off\n"
        "usage_stats_off()\n"
        "usage_lib._USAGE_STATS_ENABLED = None  # it decides once per process\n"
        "print(before, usage_lib.is_usage_stats_enabled())\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=_clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    before, after = res.stdout.split()[-2:]
    if before == "False":  # this machine's ~/.config/vllm/do_not_track already says no
        pytest.skip("vLLM's usage stats are off on this machine already")
    assert after == "False"


def test_a_warning_said_under_the_progress_bar_gets_its_own_line():
    # In a fresh interpreter: pytest records warnings instead of printing them.
    code = (
        "import sys, warnings\n"
        "from tqdm import tqdm\n"
        "from pyppo.cli.main import _plain_warnings\n"
        "with _plain_warnings():\n"
        "    bar = tqdm(total=2, desc='ppo', file=sys.stderr, ascii=True)\n"
        "    bar.update(1)\n"
        "    warnings.warn('the doctor says so', UserWarning)\n"
        "    bar.update(1)\n"
        "    bar.close()\n"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr
    at = err.index("the doctor says so")
    line_start = max(err.rfind("\n", 0, at), err.rfind("\r", 0, at))
    assert "ppo" not in err[line_start + 1 : at], repr(err)  # not glued to the bar's text
    assert err[line_start] == "\n", repr(err)  # a pipe or a log file: a line of its own there too
    assert "ppo" in err[at:], repr(err)  # the bar is drawn again after it


def test_transformers_gguf_conversion_bar_obeys_its_progress_bar_switch():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from pyppo.models.loading import gguf_conversion_bar_follows_transformers

    drawn = gguf_utils.tqdm
    assert hf_logging.is_progress_bar_enabled()
    with gguf_conversion_bar_follows_transformers():  # bars on: the bar is transformers' own
        assert gguf_utils.tqdm is drawn
    with quiet.quiet_libraries(), gguf_conversion_bar_follows_transformers():
        assert gguf_utils.tqdm(range(3)).disable  # as pyppo train loads: no bar
    assert gguf_utils.tqdm is drawn
