"""The step's guards against NaN/inf: an update whose loss or gradient is not finite is skipped
(:class:`SkipPolicy`), too many in a row stop the run, and a rollout with non-finite log-probs,
values or rewards stops it before anything of the step is logged or checkpointed
(:func:`check_rollout`). The weights' own check before a checkpoint is the run's
(``pyppo.run.nonfinite``)."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Dict, Mapping

import torch

from .. import distributed

if TYPE_CHECKING:
    from .buffer import RolloutBuffer

__all__ = ["NonFiniteUpdateError", "NonFiniteRolloutError", "check_rollout", "check_rollout_finite", "SkipPolicy"]


class NonFiniteUpdateError(RuntimeError):
    """``max_consecutive_skips`` updates in a row had a NaN/inf loss or gradient: training stopped."""


class NonFiniteRolloutError(NonFiniteUpdateError):
    """A rollout's log-probs, values or rewards are NaN/inf: the model has diverged, and training
    stopped before anything of the step was logged or checkpointed."""


def check_rollout_finite(counts: Mapping[str, float], tokens: float, where: str) -> None:
    """Raise :class:`NonFiniteRolloutError` when any of ``counts`` (name -> number of non-finite
    response tokens, over all ranks) is not 0; ``tokens`` is the number of response tokens.
    Checked before the advantages are whitened, whose statistics such values would make NaN."""
    bad = {name: int(n) for name, n in counts.items() if n}
    if bad:
        listed = ", ".join(f"{name} ({n} of {int(tokens)} response tokens)" for name, n in bad.items())
        raise NonFiniteRolloutError(
            f"{where}: the rollout has non-finite {listed}: the model probably diverged "
            "(try a lower lr, a max_grad_norm, or lr_warmup_steps)"
        )


def check_rollout(batch: RolloutBuffer, world: distributed.World, where: str) -> None:
    """Raise :class:`NonFiniteRolloutError` when a rollout's ``old_logprobs``, ``ref_logprobs``,
    ``values`` or ``rewards`` (``[B, T]`` each, a :class:`~pyppo.trainer.buffer.RolloutBuffer`'s)
    hold NaN/inf at the positions of ``loss_mask`` (where they are used), counted over every rank of
    ``world``."""
    m = batch.loss_mask
    names = ("old_logprobs", "ref_logprobs", "values", "rewards")
    counts = [int((~torch.isfinite(getattr(batch, name)) & m).sum()) for name in names] + [int(m.sum())]
    counts = distributed.all_sum(counts, world)
    check_rollout_finite(dict(zip(names, counts[:-1])), counts[-1], where)


class SkipPolicy:
    """Counts non-finite updates: in a row (reset by a good update) and in all.

    Args:
        max_consecutive: this many skipped updates in a row raise :class:`NonFiniteUpdateError`.
    """

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0

    def allows(self, values: Mapping[str, float], where: str) -> bool:
        """Whether an update with these ``values`` (losses, gradient norms, the same on every rank:
        reduced over the ranks) may be applied.

        A non-finite value skips it with a ``RuntimeWarning`` naming ``where`` and the values.

        Raises:
            NonFiniteUpdateError: the ``max_consecutive``-th skip in a row, raised by every rank
                at once (:func:`~pyppo.distributed.mark_on_every_rank`), so that the ranks can
                checkpoint the last finished step together.
        """
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        if not bad:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total += 1
        what = ", ".join(f"{k}={v}" for k, v in bad.items())
        warnings.warn(
            f"{where}: non-finite {what}; update skipped ({self.consecutive} in a row, "
            f"max_consecutive_skips={self.max_consecutive})",
            RuntimeWarning,
            stacklevel=3,
        )
        if self.consecutive >= self.max_consecutive:
            raise distributed.mark_on_every_rank(
                NonFiniteUpdateError(
                    f"training stopped at {where}: {self.consecutive} updates in a row had a non-finite loss or "
                    f"gradient (max_consecutive_skips={self.max_consecutive}; last: {what})"
                )
            )
        return False

    def state_dict(self) -> Dict[str, int]:
        return {"consecutive_skips": self.consecutive, "skipped_updates_total": self.total}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.consecutive = int(state.get("consecutive_skips", 0))
        self.total = int(state.get("skipped_updates_total", 0))
