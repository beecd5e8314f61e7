"""veRL's ``compute_score`` as a reward, unchanged: ``compute_score(data_source, solution_str,
ground_truth, extra_info=None)`` scores one response and returns a number or a dict with a
``"score"`` key and more (veRL, ``verl/utils/reward_score/__init__.py``, ``default_compute_score``).

:mod:`pyppo.rewards` recognises one by its parameter named ``solution_str`` and calls it as veRL's
reward managers do (``verl/workers/reward_manager/naive.py``, ``NaiveRewardManager``): once per
response, with keywords, ``solution_str`` the decoded response and ``data_source``,
``ground_truth`` and ``extra_info`` the prompt record's columns of those names (a veRL parquet
row's ``reward_model.ground_truth`` reaches pyppo as its ``ground_truth`` column, ``docs/rewards.md``).
As there, ``extra_info`` is ``{}`` when the record has none, and a dict return's ``"score"`` is the
reward while its other keys are extra information: here, those holding a number (a bool counts as
0 or 1) are logged per reward as ``reward/<name>/<key>_mean`` (:mod:`pyppo.trainer.reward_metrics`).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .rewards import RewardError, RewardTypeError, _is_bool, _sync_only

__all__ = ["call_compute_score", "split_scores"]


def call_compute_score(
    fn: Callable, responses: List[str], fields: Dict[str, list], *, name: str, extra_info: bool
) -> List[Any]:
    """``[fn(solution_str=responses[i], **{field: column[i]}) for i in range(B)]``: veRL's keyword
    call, one response at a time, with each field the function takes (:func:`pyppo.rewards.
    check_reward_fields` chose ``fields``).

    Args:
        fn: the ``compute_score``.
        responses: ``B`` decoded responses.
        fields: the columns it receives, each ``B`` long.
        name: the reward's name, for the error.
        extra_info: whether it takes ``extra_info``, which is then ``{}`` for a record without one
            (veRL's ``non_tensor_batch.get("extra_info", {})``). A record's own dict is copied
            first, so that a function which adds to it (veRL's managers add ``num_turns``) does
            not change the prompt set.

    Returns:
        ``B`` returns as given (numbers, ``None``, dicts): :func:`split_scores` reads them.

    Raises:
        RewardError: the function raised for response ``i`` (``index`` is ``i``), or returned a
            coroutine (an ``async def`` that got past :func:`pyppo.rewards.check_not_async`; it
            is closed, never awaited).
    """
    out = []
    for i, response in enumerate(responses):
        row = {field: column[i] for field, column in fields.items()}
        if "extra_info" in row and isinstance(row["extra_info"], Mapping):
            row["extra_info"] = dict(row["extra_info"])
        elif extra_info and "extra_info" not in row:
            row["extra_info"] = {}
        try:
            result = fn(solution_str=response, **row)
        except Exception as exc:
            raise RewardError(
                f"reward {name!r} raised {type(exc).__name__} at index {i}: {exc}", reward=name, index=i
            ) from exc
        if inspect.iscoroutine(result):  # an async compute_score: closed, never awaited, so no RuntimeWarning
            result.close()
            raise RewardTypeError(
                f"reward {name!r} returned a coroutine at index {i}; {_sync_only(fn)}", reward=name, index=i
            )
        out.append(result)
    return out


def split_scores(results: List[Any], name: str) -> Tuple[List[Any], Dict[str, List[Optional[float]]]]:
    """``(scores, extras)`` of a ``compute_score``'s ``B`` returns: a dict's ``"score"`` (as veRL's
    reward manager takes it) or the return itself, a bool made a float (as veRL's
    ``default_compute_score`` does), for :func:`pyppo.rewards.validate_scores` to check; and, by
    key, the numbers the dicts hold besides (``None`` where a dict lacks the key, or holds
    something else than a finite number there; a key that holds no number, such as a parsed
    answer's string, has no column).

    Raises:
        RewardError: a dict without a ``"score"`` key, naming its index and keys.
    """
    scores: List[Any] = []
    extras: Dict[str, List[Optional[float]]] = {}
    for i, result in enumerate(results):
        if isinstance(result, Mapping):
            if "score" not in result:
                keys = ", ".join(repr(k) for k in result) or "none"
                raise RewardError(
                    f"reward {name!r} returned a dict without a 'score' key at index {i} (its keys: {keys}); "
                    "veRL's compute_score returns a number or {'score': number, ...}",
                    reward=name,
                    index=i,
                    value=result,
                )
            for key, value in result.items():
                number = _number(value)
                if key != "score" and number is not None:
                    extras.setdefault(str(key), [None] * len(results))[i] = number
            result = result["score"]
        scores.append(float(result) if _is_bool(result) else result)
    return scores, extras


def _number(value: Any) -> Optional[float]:
    """``value`` as a finite float (a one-element tensor or numpy scalar, a bool), else ``None``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None
