"""A run's policy/ is never left unwritable: LoRA on a tied LM head with a merged export is refused
before training, and a final export that fails (a full disk) keeps the checkpoint, says so in one
line, and ``pyppo export DIR`` writes policy/ from the checkpoint, in either LoRA form."""

from __future__ import annotations

import errno
import os

import pytest
import torch

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
    from transformers import AutoModelForCausalLM

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


def test_export_of_a_directory_without_a_checkpoint_is_one_line(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path)]) == 2
    assert _errors(capsys) == [f"pyppo: error: {str(tmp_path)!r}: it has no checkpoint/ to export"]
