"""PPOTrainer takes a model source (a path or an embedded model's name) as its policy, as TRL's
trainers take a model name, and loads it as ``pyppo train --model`` does; a policy of any other
type is refused with what to pass, before anything loads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyppo import PPOTrainer
from support.tiny_models import save_tiny_causal_lm, tiny_causal_lm, tiny_tokenizer
from support.trainer_fixture import PROMPTS, count_e, small_config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_a_model_source_policy_is_loaded_with_its_tokenizer_and_recorded(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_dir.parent)
    trainer = PPOTrainer(small_config(steps=1), "model", None, None, None, count_e, PROMPTS)
    assert isinstance(trainer.policy, nn.Module) and trainer.tokenizer.eos_token_id == 2
    saved = tiny_causal_lm(seed=0).state_dict()
    assert all(torch.equal(saved[name], w) for name, w in trainer.policy.state_dict().items())
    # Recorded absolute, as `pyppo train --model` records it: the run's config.toml names it.
    assert trainer.base_model_source == str(tiny_dir.resolve())
    trainer.train(tmp_path / "run", progress=False)
    assert f'model = "{tiny_dir.resolve()}"' in (tmp_path / "run" / "config.toml").read_text().splitlines()


def test_a_path_policy_keeps_a_given_tokenizer(tiny_dir):
    tokenizer = tiny_tokenizer()
    trainer = PPOTrainer(small_config(), tiny_dir, None, None, tokenizer, count_e, PROMPTS)
    assert trainer.tokenizer is tokenizer and trainer.base_model_source == str(tiny_dir.resolve())


@pytest.mark.parametrize(
    "args, error, message",
    [
        (
            (42, None, None, "tok"),
            TypeError,
            "policy must be a transformers causal LM (an nn.Module) or a model source",
        ),
        (("MODEL", "ref", None, "tok"), TypeError, "ref_policy must be an nn.Module, or None (a frozen copy"),
        (("MODEL", None, "value", "tok"), TypeError, "value_model must be an nn.Module, or None (built from"),
        (("MISSING", None, None, None), FileNotFoundError, "does not exist: name_or_path must be"),
        (("LM", None, None, None), ValueError, "tokenizer is None: pass the policy's tokenizer"),
    ],
)
def test_a_bad_model_argument_says_what_to_pass(args, error, message, tiny_dir, tmp_path, monkeypatch):
    import pyppo.trainer.assemble as assemble

    def never(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(assemble, "load_model_and_tokenizer", never)
    named = {
        "MODEL": str(tiny_dir),
        "MISSING": str(tmp_path / "missing"),
        "LM": tiny_causal_lm(),
        "tok": tiny_tokenizer(),
    }
    policy, ref, value, tok = (named.get(a, a) if isinstance(a, str) else a for a in args)
    with pytest.raises(error) as caught:
        PPOTrainer(small_config(), policy, ref, value, tok, count_e, PROMPTS)
    assert message in str(caught.value)
