"""veRL's data layout, read as it is: its fields as a reward's columns.

veRL's data files (its ``examples/data_preprocess/*.py`` write them as Parquet) have one row per
prompt::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

Every column is a field for the reward as it is (``data_source``, ``extra_info``, ``ability``,
``reward_model``), and the answer, nested in ``reward_model``, is lifted to the top so that a
reward written for veRL, ``compute_score(data_source, solution_str, ground_truth, extra_info)``,
finds it by name: ``ground_truth``, and also ``answer`` (what ``--reward math`` and
``--reward reasoning-gym`` read) when the row has no ``answer`` of its own.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

__all__ = ["is_verl_record", "lift_ground_truth"]


def is_verl_record(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` is in veRL's layout: a ``reward_model`` mapping with a ``ground_truth``."""
    reward_model = record.get("reward_model")
    return isinstance(reward_model, Mapping) and "ground_truth" in reward_model


def lift_ground_truth(record: Dict[str, Any]) -> Dict[str, Any]:
    """``record`` with ``reward_model["ground_truth"]`` also as ``ground_truth`` and, unless the
    record has them already, as ``answer``; any other record as it is. A field the record has is
    never replaced."""
    if not is_verl_record(record):
        return record
    truth = record["reward_model"]["ground_truth"]
    lifted = dict(record)
    lifted.setdefault("ground_truth", truth)
    lifted.setdefault("answer", truth)
    return lifted
