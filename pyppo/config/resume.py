"""What a resume may change: :func:`resume_conflicts` compares the settings a run goes on with
against those its checkpoint was trained with (each knob's ``resume``: ``fixed`` or ``free``)."""

from __future__ import annotations

from typing import Any, List, Mapping, NamedTuple, Optional

from .knobs import _default_text
from .ppo_config import PPOConfig, config_knobs


class ResumeChange(NamedTuple):
    """A setting a resume changes: ``key``, the checkpoint's value, the new one."""

    key: str
    saved: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_default_text(self.saved)} -> {_default_text(self.new)}"


def resume_conflicts(
    saved: Optional[Mapping[str, Any]],
    config: PPOConfig,
    *,
    where: str = "the checkpoint",
    new_run: str = "start a new run to change them",
) -> List[ResumeChange]:
    """The check of a resume: ``config``, the settings the run goes on with, against ``saved``,
    those its checkpoint was trained with (``trainer_state.pt``'s ``"config"``, a
    :meth:`PPOConfig.to_dict`). Each knob's ``resume`` says whether it may differ. A key that
    ``saved`` lacks (a checkpoint from before the knob existed) is not compared; ``saved`` of
    ``None`` compares nothing.

    Args:
        where: what the message names first (``"checkpoint 'DIR'"``).
        new_run: how the message ends: what to do instead.

    Returns:
        the ``free`` settings that differ, which the resume applies.

    Raises:
        ValueError: ``fixed`` settings differ: one line naming every one, with the checkpoint's
            value and the new one.
    """
    fixed, free = [], []
    for name, k in config_knobs():
        if saved is None or name not in saved or saved[name] == getattr(config, name):
            continue
        (fixed if k.resume == "fixed" else free).append(ResumeChange(name, saved[name], getattr(config, name)))
    if fixed:
        raise ValueError(
            f"{where} was trained with other settings, which a resume cannot change: "
            f"{', '.join(map(str, fixed))} (the checkpoint's -> this run's); {new_run}"
        )
    return free
