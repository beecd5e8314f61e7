"""pyppo.memory: the C heap's free pages go back to the system, and the CPU trainer asks for it
between phases."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pyppo import memory
from pyppo.config import PPOConfig
from pyppo.trainer import PPOTrainer
from tiny_models import tiny_causal_lm, tiny_tokenizer

glibc = pytest.mark.skipif(memory._MALLOC_TRIM is None, reason="needs glibc's malloc_trim")


@glibc
def test_free_heap_pages_are_returned_and_live_tensors_keep_their_values():
    # In a fresh process: 300 MB of 1 MB tensors freed below one that stays stay resident (the
    # heap cannot shrink past a live chunk) until release_free_memory() hands them back.
    script = textwrap.dedent("""
        import torch
        from pyppo.memory import release_free_memory

        def rss_mb():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

        torch.ones(2**18)  # one freed mmapped chunk: 1 MB tensors then come from the heap
        blocks = [torch.ones(2**18) for _ in range(300)]
        keep = blocks[-1]
        del blocks
        before = rss_mb()
        released = release_free_memory()
        after = rss_mb()
        assert released is True, released
        assert before - after > 200, (before, after)
        assert torch.equal(keep, torch.ones(2**18))
        print("ok", round(before), round(after))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout + out.stderr


def test_release_is_a_no_op_without_malloc_trim(monkeypatch):
    monkeypatch.setattr(memory, "_MALLOC_TRIM", None)
    assert memory.release_free_memory() is False


@pytest.mark.parametrize("layout", [dict(mini_batch_size=4), dict(mini_batch_size=4, micro_batch_size=2)])
def test_cpu_trainer_releases_after_the_rollout_and_each_policy_backward(monkeypatch, layout):
    import pyppo.trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "release_free_memory", lambda: calls.append(1))
    config = PPOConfig(steps=1, batch_size=8, ppo_epochs=2, max_new_tokens=4, seed=0, **layout)
    trainer = PPOTrainer(config, tiny_causal_lm(), None, None, tiny_tokenizer(),
                         lambda p, r: [float(len(x)) for x in r], [f"prompt {i}" for i in range(8)])
    trainer.step()
    micro_steps = config.ppo_epochs * config.batch_size // (config.micro_batch_size or config.mini_batch_size)
    assert len(calls) == 1 + micro_steps
