"""Held-out evaluation: responses to prompts the policy does not train on, their scores under
the training reward, and their KL to the reference (``eval_every``, ``--eval-prompts``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import distributed
from ..ops import kl_penalty
from ..precision import autocast
from ..prompts import prompt_columns
from ..trainer.reward_metrics import RewardColumns, reward_metrics
from ..trainer.sampling import reward_scores
from .checkpoint import capture_rng, restore_rng

if TYPE_CHECKING:
    from ..trainer import PPOTrainer

__all__ = ["evaluate_prompts"]


@torch.no_grad()
def evaluate_prompts(
    trainer: PPOTrainer, prompts: Optional[Sequence[Any]] = None
) -> Tuple[Dict[str, float], List[dict]]:
    """Sample one response to each held-out prompt (``trainer.eval_prompts`` by default: strings,
    or records whose fields the reward receives) as a rollout does, score it with the training
    reward and measure its KL to the reference.

    Every evaluation samples from torch's generator seeded with the run's ``seed`` (plus the
    rank): the held-out episodes of every evaluation get the same environment seeds (the same
    secret numbers, the same tasks) and the same sampling noise, so evaluations at different steps
    differ by the policy only. The torch (CPU and CUDA), numpy and Python generators are put back
    afterwards (also when it fails): an evaluation does not move the training's random streams,
    so the steps after it sample what they would have sampled without it, and a run extended from
    a checkpoint written after an evaluation (``--steps 2``, then ``--resume --steps 4``, which
    evaluates at step 2 where the 4-step run does not) takes the 4-step run's steps.

    Returns:
        ``(metrics, rows)``: ``eval/score_mean`` (raw scores), ``eval/kl_mean`` (the
        ``kl_estimator`` summed over each response's tokens, averaged over responses, nats),
        ``eval/response_length_mean`` and ``eval/eos_fraction`` (with an environment: of whole
        episodes, scored with what the environment paid, plus ``eval/turns_mean``, ``eval/tool_calls_mean`` and
        ``eval/first_turn_success``, the fraction that scored > 0 in one turn; with several
        rewards, or veRL ``compute_score`` dicts, each reward's ``eval/reward/<name>_mean`` as
        :mod:`pyppo.trainer.reward_metrics` computes them for a step); and one row per prompt
        (``step``, ``prompt``, ``response``, ``score``, ``kl``; with an environment also
        ``turns``, ``tool_calls`` and ``transcript``). The same on every rank.

    Raises:
        ValueError: no prompts. RewardError: as ``trainer.step``.
    """
    prompts = list(trainer.eval_prompts if prompts is None else prompts)
    if not prompts:
        raise ValueError("evaluate_prompts: no prompts (pass eval_prompts to the trainer)")
    training_rng = capture_rng()
    try:
        torch.manual_seed(trainer.config.seed + trainer.world.rank)
        return _evaluate(trainer, prompts)
    finally:
        restore_rng(training_rng)


def _evaluate(trainer: PPOTrainer, prompts: List[Any]) -> Tuple[Dict[str, float], List[dict]]:
    n, b = trainer.world.size, trainer.config.batch_size // trainer.world.size
    # Every rank runs the same number of batches (FSDP's collectives need it): its share is
    # padded with its last prompt, and the padding's results are dropped.
    mine = prompts[trainer.world.rank :: n]
    per_rank = -(-len(prompts) // n)
    padded = mine + [mine[-1] if mine else prompts[-1]] * (per_rank - len(mine))
    rows: List[dict] = []
    columns: List[RewardColumns] = []  # each reward's own scores, of this rank's prompts
    trainer.sync_engine()  # an engine with its own copy of the weights samples the current policy
    for start in range(0, per_rank, b):
        chunk, fields = prompt_columns(padded[start : start + b])
        batch = trainer.rollout(chunk, fields)
        where = f"evaluation after step {trainer.step_count}"
        # float64: the reward's own floats, as the rows report them
        scores, parts = reward_scores(
            batch, trainer.reward_fn, trainer.world, trainer.device, where=where, fields=fields, dtype=torch.float64
        )
        scores = scores.tolist()
        columns.append(parts.select(torch.arange(min(len(batch), len(mine) - start))))
        logprobs, ref = torch.zeros(2, len(batch), batch.response_length, device=trainer.device)
        for idx in torch.arange(len(batch)).split(trainer.micro_batch_size):
            mb, ix = batch.select(idx), idx.to(trainer.device)
            with autocast(trainer.device, trainer.dtype):
                logprobs[ix] = trainer.models.policy_module(mb)[0]
                ref[ix] = trainer.models.ref_logprobs(mb)[0]
        kl = kl_penalty(logprobs, ref, estimator=trainer.config.kl_estimator)
        kl = torch.where(batch.loss_mask, kl, torch.zeros_like(kl)).sum(dim=1)
        lengths = batch.response_mask.sum(dim=1)
        for i in range(len(batch)):
            if start + i < len(mine):
                rows.append(
                    {
                        "step": trainer.step_count,
                        "prompt": batch.prompts[i],
                        "response": batch.responses[i],
                        "score": float(scores[i]),
                        "kl": float(kl[i]),
                        "length": int(lengths[i]),
                        "eos": bool(batch.has_eos[i]),
                        "turns": batch.episodes[i].turns if batch.episodes is not None else 1,
                        "tool_calls": batch.episodes[i].tool_calls if batch.episodes is not None else 0,
                        "transcript": batch.episodes[i].transcript if batch.episodes is not None else None,
                    }
                )
    # Back in the prompts' order: rank r evaluated prompts r, r + n, r + 2n, ...
    by_rank = distributed.gather_objects(rows, trainer.world)
    ordered = [by_rank[i % n][i // n] for i in range(len(prompts))]
    mean = lambda key: sum(float(r[key]) for r in ordered) / len(ordered)  # noqa: E731
    metrics = {
        "eval/score_mean": mean("score"),
        "eval/kl_mean": mean("kl"),
        "eval/response_length_mean": mean("length"),
        "eval/eos_fraction": mean("eos"),
    }
    metrics.update({f"eval/{k}": v for k, v in reward_metrics(RewardColumns.cat(columns), trainer.world).items()})
    if trainer.agent:  # episodes: how many turns, and how often the first turn earned the score
        metrics["eval/turns_mean"] = mean("turns")
        metrics["eval/tool_calls_mean"] = mean("tool_calls")
        metrics["eval/first_turn_success"] = sum(r["turns"] == 1 and r["score"] > 0 for r in ordered) / len(ordered)
    keys = ("step", "prompt", "response", "score", "kl") + (
        ("turns", "tool_calls", "transcript") if trainer.agent else ()
    )
    return metrics, [{k: r[k] for k in keys} for r in ordered]
