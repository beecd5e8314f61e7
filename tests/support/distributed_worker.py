"""Run by tests/test_distributed.py under ``torchrun``: from one fixed rollout (a saved batch),
each rank takes its share, computes the advantages and one minibatch update, and rank 0 saves
what it got; or (``kl-controller OUT``) each rank runs one whole step with the adaptive KL
controller, and rank 0 saves every rank's batch and coefficient. Not a test module itself."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder: support.*

from pyppo.run import checkpoint  # noqa: E402
from pyppo.trainer.step_stats import RunningStats  # noqa: E402
from support.tiny_models import tiny_causal_lm  # noqa: E402
from support.trainer_fixture import make_trainer, small_config  # noqa: E402


def update_config(fsdp: bool, batch_size: int):
    # adam_eps 1e-4: AdamW's first step moves a weight by lr · g / (|g| + eps), which turns the
    # reduction-order rounding of a gradient near eps into up to lr / eps times as much; with
    # 1e-4 that factor is 10, and the two updates agree to float32 rounding.
    return small_config(
        steps=1,
        batch_size=batch_size,
        mini_batch_size=batch_size,
        micro_batch_size=None,
        ppo_epochs=1,
        device="cpu",
        fsdp=fsdp,
        adam_eps=1e-4,
    )


def one_update(trainer, batch, kl_coef: float) -> dict:
    """Advantages then one minibatch step on ``batch``; the trained weights and the advantages."""
    trainer.advantages(batch, kl_coef)
    stats = RunningStats()
    trainer.minibatch_step(batch, stats, "test")
    policy, _ = checkpoint.training_state(trainer.models.policy_module, trainer.policy_optimizer, prefix="model.")
    value, _ = checkpoint.training_state(trainer.critic.module, trainer.critic.optimizer)
    return {
        "policy": policy,
        "value": value,
        "advantages": batch.advantages,
        "returns": batch.returns,
        "stats": stats.means(),
    }


def main(batch_path: str, out_path: str, fsdp: str) -> None:
    saved = torch.load(batch_path, weights_only=False)
    batch = saved["batch"]
    trainer = make_trainer(update_config(fsdp == "fsdp", len(batch)))
    n, r = trainer.world.size, trainer.world.rank
    share = len(batch) // n
    result = one_update(trainer, batch.select(torch.arange(r * share, (r + 1) * share)), saved["kl_coef"])
    shares = [None] * n
    torch.distributed.all_gather_object(shares, {"advantages": result["advantages"], "returns": result["returns"]})
    if r == 0:
        result["advantages"] = torch.cat([s["advantages"] for s in shares])
        result["returns"] = torch.cat([s["returns"] for s in shares])
        torch.save(result, out_path)
    # The DDP/FSDP wrappers go before the process group: torn down after it, a rank's reducer
    # was seen to block at exit.
    torch.distributed.barrier()
    del trainer, result
    gc.collect()
    torch.distributed.destroy_process_group()


def controller_config(target_kl: float):
    """2 responses a rank; ``kl_horizon`` 20 samples, so one step of the batch's 4 moves the
    controller by a fifth of its error."""
    return small_config(
        steps=1,
        batch_size=4,
        mini_batch_size=4,
        micro_batch_size=None,
        ppo_epochs=1,
        device="cpu",
        kl_coef=0.2,
        target_kl=target_kl,
        kl_horizon=20.0,
    )


def kl_controller(out_path: str) -> None:
    # A reference unlike the policy (KL > 0), and each rank samples its own responses, so the
    # ranks' KLs differ. A first trainer sets the target to the step's KL over 1.07 (the
    # controller's error, 0.07, is then inside its ±0.2 clip); the second, seeded alike, samples
    # the same batch and is the one checked.
    probe = make_trainer(controller_config(1.0), ref=tiny_causal_lm(seed=1))
    target = probe.step().metrics["kl_mean"] / 1.07
    trainer = make_trainer(controller_config(target), ref=tiny_causal_lm(seed=1))
    b = trainer.step().batch
    mine = {
        "old_logprobs": b.old_logprobs,
        "ref_logprobs": b.ref_logprobs,
        "response_ids": b.response_ids,
        "kl_coef": trainer.kl_ctl.value,
        "target": target,
    }
    ranks = [None] * trainer.world.size
    torch.distributed.all_gather_object(ranks, mine)
    if trainer.world.rank == 0:
        torch.save(ranks, out_path)
    torch.distributed.barrier()
    del probe, trainer
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import faulthandler

    # A rank stuck in a collective prints every thread's stack and exits, instead of hanging the test.
    faulthandler.dump_traceback_later(150, exit=True)
    if sys.argv[1] == "kl-controller":
        kl_controller(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
