"""Critic-free, group-relative advantages: GRPO, Dr. GRPO and RLOO (docs/ops.md#group_advantages)."""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "GROUP_ESTIMATORS"]

GROUP_ESTIMATORS = ("grpo", "rloo")

# The two overloads of the op: groups by id, and groups of group_size consecutive rows (no ids
# tensor to build: the kernel walks each run of rows directly).
_BY_IDS = torch.ops.pyppo.group_advantages.default
_BY_SIZE = torch.ops.pyppo.group_advantages.group_size


def group_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    estimator: str = "grpo",
    eps: float = 1e-6,
    std_normalize: bool = True,
) -> torch.Tensor:
    r"""Outcome advantages of responses against the other responses to the same prompt.

    Each response ``b`` has one scalar score; the responses sampled for one prompt form a group.
    For a group of ``n`` responses with scores ``s_i``, mean ``m = (1/n) Σ s_i`` and unbiased
    (Bessel, ``n − 1``) standard deviation ``σ``, the advantage of response ``i`` is:

    - ``estimator="grpo"``, ``std_normalize=True``: :math:`a_i = (s_i - m) / (\sigma + \epsilon)`
      (GRPO with outcome supervision: Shao et al. 2024, "DeepSeekMath", §4.1.2);
    - ``estimator="grpo"``, ``std_normalize=False``: :math:`a_i = s_i - m` (Dr. GRPO: Liu et al.
      2025, "Understanding R1-Zero-Like Training: A Critical Perspective");
    - ``estimator="rloo"``: :math:`a_i = s_i - \frac{1}{n-1}\sum_{j \ne i} s_j = \frac{n}{n-1}(s_i - m)`
      (REINFORCE leave-one-out: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for
      Free!"; Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
      Learning from Human Feedback in LLMs").

    Special cases, as veRL 0.9.1 treats them: a group of one response has baseline 0 and std 1
    (``grpo`` gives ``s / (1 + eps)`` with ``std_normalize``, ``s`` without; ``rloo`` gives
    ``s``). A group whose scores are all equal (``σ = 0``) gets advantages of exactly 0, whatever
    the estimator: the op tests ``max == min`` rather than trusting a rounded mean.

    The advantage of row ``b`` is written at every valid position of the row, 0 at masked
    positions (a row with no valid position is all 0; its score still counts in its group's
    statistics). Group sums are accumulated in float64, in row order: a group's advantages
    depend only on its members' scores (deterministic, batch-invariant, the same bits on CPU and
    CUDA). Whiten the result over the batch with :func:`masked_whiten` for REINFORCE++-baseline
    (``estimator="grpo", std_normalize=False``, then ``masked_whiten``).

    Args:
        scores: ``[B]`` float32, bfloat16, float16 or float64; one scalar score (reward) per
            response, in the reward's units. Must be finite.
        response_mask: ``[B, T]`` bool or 0/1; the valid positions of each response.
        group_size: ``n``: the batch is ``B / n`` groups of ``n`` consecutive rows (rows
            ``[k·n, (k+1)·n)`` are the responses to prompt ``k``, as a rollout that repeats each
            prompt ``n`` times lays them out). ``B`` must be a multiple of ``n``.
        group_ids: ``[B]`` int64 in ``[0, B)``; rows with the same id form a group. Groups may
            have any sizes and their rows need not be contiguous (``torch.unique(uids,
            return_inverse=True)[1]`` numbers arbitrary labels this way). Exactly one of
            ``group_size`` and ``group_ids`` must be given.
        estimator: ``"grpo"`` or ``"rloo"`` (:data:`GROUP_ESTIMATORS`).
        eps: added to the std in ``grpo`` with ``std_normalize`` (in the scores' units); finite,
            ``≥ 0``. veRL's default, ``1e-6``.
        std_normalize: divide by the group's std (``grpo`` only; ignored by ``rloo``).

    Returns:
        ``[B, T]`` advantages, float32 (float64 for float64 scores), 0 at masked positions. Not
        differentiable (policy-gradient advantages are constants).

    Raises:
        ValueError: neither or both of ``group_size`` and ``group_ids``; ``group_size`` not an
            int ``≥ 1`` or not dividing ``B``; ``scores`` not ``[B]`` float; ``response_mask``
            not 2-D or not 0/1; ``group_ids`` not ``[B]`` int64 or an id outside ``[0, B)``; a
            non-finite score; ``eps`` negative or not finite; an unknown ``estimator``.
        RuntimeError: tensors on different devices.

    Example::

        >>> scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
        >>> mask = torch.ones(6, 2, dtype=torch.bool)
        >>> group_advantages(scores, mask, group_size=3)[:, 0]  # groups [1, 0, 0] and [1, 1, 1]
        tensor([ 1.1547, -0.5773, -0.5773,  0.0000,  0.0000,  0.0000])
    """
    if group_ids is None:
        if group_size is None:
            raise ValueError("pyppo.group_advantages: pass exactly one of group_size and group_ids")
        # The op's int argument would take a bool or round nothing else; its value (>= 1, dividing
        # B) is checked by the op.
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise ValueError(f"pyppo.group_advantages: group_size must be an int >= 1, got {group_size!r}")
        return _BY_SIZE(scores, response_mask, group_size, str(estimator), float(eps), bool(std_normalize))
    if group_size is not None:
        raise ValueError("pyppo.group_advantages: pass exactly one of group_size and group_ids")
    return _BY_IDS(scores, response_mask, group_ids, str(estimator), float(eps), bool(std_normalize))
