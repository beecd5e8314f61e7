"""A tiny CLI run for the fault tests: a saved random model (``tiny_dir``), a prompts file,
a 3-step config with a checkpoint after every step (``run_toml``), and readers of a run's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.tiny_models import save_tiny_causal_lm

#: The tests folder, for child processes that import the support modules.
TESTS = Path(__file__).resolve().parents[1]

# A tiny CLI run: 3 steps, a checkpoint after every step.
RUN_TOML = """\
steps = 3
batch_size = 2
mini_batch_size = 1
ppo_epochs = 1
max_new_tokens = 4
seed = 3
save_every = 1
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say hi.", "Describe rain.", "Why?"]))
    return path


@pytest.fixture(scope="module")
def run_toml(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "run.toml"
    path.write_text(RUN_TOML)
    return path


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a model loads: for what a command must check (and refuse) before it."""
    import pyppo.models

    def refuse(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("a model was loaded before the command's checks were done")

    monkeypatch.setattr(pyppo.models, "load_model_and_tokenizer", refuse)


def error_line(capsys) -> str:
    """The one line a refused ``pyppo`` command printed on stderr (no traceback)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("pyppo: error: ")
    return err[0]


def read_rows(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def untimed(row):
    return {k: v for k, v in row.items() if "time" not in k and "seconds" not in k}


def ckpt_step(d: Path) -> int:
    return int(torch.load(d / "trainer_state.pt", weights_only=True)["step"])
