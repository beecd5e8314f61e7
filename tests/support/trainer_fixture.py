"""A trainer on a tiny random model with a character tokenizer, for the tests of the trainer, the
run and the distributed path: ``make_trainer(small_config(...))``. EOS == pad (as in SmolLM2)."""

from __future__ import annotations

import torch
from torch import nn

from pyppo import PPOTrainer
from pyppo.config import PPOConfig
from support.tiny_models import tiny_causal_lm, tiny_tokenizer

PROMPTS = [f"say something {'nice ' * (i % 4)}about {i}" for i in range(24)]
EOS = 2


def count_e(prompts, responses):
    # Any deterministic function of the text will do; this one varies with the sample.
    return [float(r.count("e")) - 0.1 * len(r) for r in responses]


def small_config(**overrides):
    # float32 unless a test asks: `auto` would make these tests' tolerances depend on the CPU
    # (bf16 on AVX512_BF16/AMX); tests/test_precision.py runs `auto` itself.
    cfg = dict(
        steps=2,
        batch_size=8,
        mini_batch_size=4,
        micro_batch_size=2,
        ppo_epochs=2,
        max_new_tokens=8,
        lr=1e-3,
        seed=0,
        dtype="float32",
    )
    cfg.update(overrides)
    return PPOConfig(**cfg)


def with_eos_bias(policy, eos_bias):
    """An LM head with a bias on EOS: makes EOS (= pad) likely, or certain, at every position."""
    head = nn.Linear(policy.lm_head.in_features, policy.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(policy.lm_head.weight)
        head.bias.zero_()
        head.bias[EOS] = eos_bias
    policy.lm_head = head
    return policy


def make_trainer(config=None, *, eos_bias=None, reward=count_e, prompts=PROMPTS, policy=None, ref=None):
    policy = policy if policy is not None else tiny_causal_lm(seed=0)
    if eos_bias is not None:
        policy = with_eos_bias(policy, eos_bias)
    return PPOTrainer(config or small_config(), policy, ref, None, tiny_tokenizer(), reward, prompts)
