"""A run's policy/ is never left unwritable: LoRA on a tied LM head with a merged export is refused
before training, and a final export that fails (a full disk) keeps the checkpoint, says so in one
line, and ``pyppo export DIR`` writes policy/ from the checkpoint, in either LoRA form."""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from pyppo import cli
from support.run_fixture import ckpt_step, prompts_file, tiny_dir  # noqa: F401 (fixtures)
from support.tiny_models import tiny_arch, tiny_tokenizer

FLAGS = [
    "--steps",
    "2",
    "--batch-size",
    "2",
    "--mini-batch-size",
    "1",
    "--ppo-epochs",
    "1",
    "--max-new-tokens",
    "4",
    "--seed",
    "3",
]


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A tiny Llama whose LM head is its embedding (tie_word_embeddings, as SmolLM2's)."""
    path = tmp_path_factory.mktemp("tied") / "model"
    tiny_arch("llama", tie_word_embeddings=True, bos_token_id=1, eos_token_id=2).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _errors(capsys) -> list:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("pyppo: error: ")]


def test_lora_on_a_tied_head_is_refused_before_training_and_the_adapter_form_exports(
    tied_dir, prompts_file, tmp_path, capsys
):
    out = tmp_path / "run"
    argv = [
        "train",
        "--model",
        str(tied_dir),
        "--prompts",
        str(prompts_file),
        "--output",
        str(out),
        *FLAGS,
        "--lora-rank",
        "2",
        "--lora-target-modules",
        "q_proj,lm_head",
    ]
    assert cli.main(argv) == 2
    (line,) = _errors(capsys)
    assert "LoRA layer 'lm_head' adapts 'lm_head.weight', which is tied to ['model.embed_tokens.weight']" in line
    assert line.endswith("(--no-merge-lora)")
    assert not out.exists()  # refused before a step ran

    # The adapter alone can be written: that run trains and exports it ...
    assert cli.main([*argv, "--no-merge-lora"]) == 0
    assert (out / "policy" / "adapter_config.json").is_file()
    # ... and pyppo export writes it again from the checkpoint, in the run's form, and refuses
    # the merged form, as training did.
    (out / "policy" / "adapter_model.safetensors").unlink()
    assert cli.main(["export", str(out)]) == 0
    assert (out / "policy" / "adapter_model.safetensors").is_file()
    capsys.readouterr()
    assert cli.main(["export", str(out), "--merge-lora"]) == 2
    assert "tied to ['model.embed_tokens.weight']" in _errors(capsys)[0]
    assert (out / "policy" / "adapter_model.safetensors").is_file()


def test_a_failed_final_export_keeps_the_checkpoint_and_pyppo_export_writes_policy(
    tiny_dir, prompts_file, tmp_path, capsys, monkeypatch
):
    import pyppo.run.export as export

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export, "save_policy", disk_full)
    out = tmp_path / "run"
    assert (
        cli.main(["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(out), *FLAGS]) == 2
    )
    assert _errors(capsys) == [
        f"pyppo: error: [Errno 28] No space left on device; every step is done and "
        f"checkpointed (step 2); (re)write policy/ from it with: pyppo export {out}"
    ]
    assert ckpt_step(out / "checkpoint") == 2 and not (out / "policy").exists()
    monkeypatch.undo()

    # --resume has nothing left to run, and says which command writes policy/.
    assert cli.main(["train", "--resume", str(out)]) == 0
    assert f"its policy/ is missing: write it with: pyppo export {out}" in capsys.readouterr().err
    assert cli.main(["export", str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out / "policy").state_dict()
    trained = torch.load(out / "checkpoint" / "policy.pt", weights_only=True)
    assert trained and all(torch.equal(exported[name], weight) for name, weight in trained.items())


def test_export_of_a_directory_that_is_not_a_run_says_so(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path)]) == 2
    assert _errors(capsys) == [
        f"pyppo: error: {str(tmp_path)!r} is not a pyppo run directory (no config.toml or checkpoint/ in it); "
        "pass the directory, which pyppo train or PPOTrainer.train wrote"
    ]
    (tmp_path / "config.toml").write_text("steps = 1\n")
    assert cli.main(["export", str(tmp_path)]) == 2
    assert _errors(capsys) == [f"pyppo: error: {str(tmp_path)!r}: the run has no complete checkpoint/ to export yet"]


@pytest.mark.parametrize("command", ["export", "bench", "profile"])
def test_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    shown = capsys.readouterr().out
    if command == "export":
        assert "--model NAME|DIR|FILE.gguf" in shown and "no model named in its config.toml" in shown
    assert "``" not in shown and not re.search(r":[a-z]+:`", shown), shown


def test_a_python_run_on_a_model_built_in_memory_exports_onto_the_given_model(tmp_path, capsys):
    """Its config.toml names no model and no reward: export asks for --model alone, and writes
    policy/ from the checkpoint onto it, in either LoRA form, config.toml staying a Python run's."""
    from pyppo import PPOTrainer
    from pyppo.config import PPOConfig
    from pyppo.run.config_file import written_from_python
    from support.tiny_models import save_tiny_causal_lm, tiny_causal_lm

    config = PPOConfig(steps=1, batch_size=2, mini_batch_size=2, ppo_epochs=1, max_new_tokens=4, lora_rank=2)
    scores = lambda prompts, responses: [float(len(r)) for r in responses]  # noqa: E731 (no name to record)
    trainer = PPOTrainer(config, tiny_causal_lm(seed=0), None, None, tiny_tokenizer(), scores, ["Say hi."])
    trainer.train(tmp_path / "run", progress=False)
    run, policy = tmp_path / "run", tmp_path / "run" / "policy"
    capsys.readouterr()
    assert cli.main(["export", str(run)]) == 2
    assert _errors(capsys) == [
        f"pyppo: error: {str(run)!r}: the run's config.toml names no model (a run started from Python with a "
        "model built in memory); pass --model NAME|DIR|FILE.gguf: the base model it started from, which the "
        "checkpoint's trained weights go onto (no reward is needed)"
    ]

    base = save_tiny_causal_lm(tmp_path / "base", seed=0)  # the same weights, now in a directory
    assert cli.main(["export", str(run), "--model", str(base), "--no-merge-lora"]) == 0
    adapter = torch.load(run / "checkpoint" / "policy.pt", weights_only=True)
    from safetensors.torch import load_file

    written = load_file(policy / "adapter_model.safetensors")
    assert written and len(written) == len(adapter)
    assert all(any(torch.equal(w, a) for a in adapter.values()) for w in written.values())
    assert written_from_python(run / "config.toml") and "model =" not in (run / "config.toml").read_text()
    assert "merge_lora = false" in (run / "config.toml").read_text()
    assert cli.main(["export", str(run), "--model", str(base), "--merge-lora"]) == 0
    assert (policy / "config.json").is_file() and not (policy / "adapter_config.json").exists()
    capsys.readouterr()
    assert cli.main(["export", str(run), "--model", str(tmp_path)]) == 2
    (line,) = _errors(capsys)
    assert line.startswith(f"pyppo: error: model {str(tmp_path)!r}: directory has no config.json"), line


def test_export_needs_no_reward_prompts_or_environment(tiny_dir, tmp_path, capsys):
    """A Python run with an environment the command line cannot load (and episode settings that
    need one): its policy is built without it, and written."""
    from pyppo import PPOConfig, PPOTrainer
    from support.echo_env import Echo

    class Local(Echo):  # no name the command line imports
        pass

    config = PPOConfig(steps=1, batch_size=2, mini_batch_size=2, ppo_epochs=1, max_new_tokens=8, max_turns=2)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir)
    trainer = PPOTrainer(config, policy, None, None, tiny_tokenizer(), None, ["Say hi.", "Why?"], environment=Local)
    trainer.train(tmp_path / "run", progress=False)
    assert 'env = "python:text environment Local"' in (tmp_path / "run" / "config.toml").read_text()
    assert cli.main(["export", str(tmp_path / "run")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy").state_dict()
    trained = torch.load(tmp_path / "run" / "checkpoint" / "policy.pt", weights_only=True)
    assert all(torch.equal(exported[name], weight) for name, weight in trained.items())
