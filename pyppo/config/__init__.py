"""``PPOConfig``: every knob of the PPO loop, each declared once.

A field is declared with :func:`knob`: its default, its check, whether a resume may change it
(``resume="fixed"`` / ``"free"``: :func:`resume_conflicts`), a one-line help and, for a knob that
acts whatever the other knobs say, ``always_acts=True``; the :func:`group` call above it names the
group it is listed under (the component that reads it). A knob that acts only together with others
has a rule in :data:`NEEDS` instead: set away from its default where its rule does not hold, it
would act on nothing, and the config refuses it (or warns, for a rule that turns on what the
config does not know, such as the number of processes). Validation loops over that metadata and
that table, ``pyppo train`` builds one flag per field from it, and the key table of
``docs/trainer.md`` is generated from both (:func:`config_markdown`; a test fails when the file is
stale). Regenerate the table with ``python -m pyppo.config``.

The parts, one job each (import from ``pyppo.config``, which re-exports them):

- :mod:`.knobs`: the option tuples (``DTYPES``, ``ROLLOUT_ENGINES``, ...), the checks
  (:class:`Check`, :func:`integer`, :func:`number`, ...), :class:`Knob`, :func:`knob` and
  :func:`group`;
- :mod:`.rules`: what acts only with what (:class:`Needs`, :data:`NEEDS`, :func:`inert_settings`,
  :class:`InertSettings`);
- :mod:`.ppo_config`: :class:`PPOConfig` and :func:`config_knobs`;
- :mod:`.resume`: what a resume may change (:func:`resume_conflicts`, :class:`ResumeChange`);
- :mod:`.docs_table`: the key table of ``docs/trainer.md`` (:func:`config_markdown`), which
  ``python -m pyppo.config`` (:mod:`.__main__`) prints.
"""

from __future__ import annotations

from .docs_table import config_markdown

# The option tuples and the checks are importable from here too, as before the split into
# modules; __all__ lists what it always listed.
from .knobs import *  # noqa: F401, F403
from .knobs import RESUME_RULES, Check, Knob, group, knob
from .ppo_config import PPOConfig, config_knobs
from .resume import ResumeChange, resume_conflicts
from .rules import NEEDS, InertSettings, Needs, inert_settings

__all__ = [
    "PPOConfig",
    "Check",
    "Knob",
    "knob",
    "group",
    "config_knobs",
    "config_markdown",
    "Needs",
    "NEEDS",
    "InertSettings",
    "inert_settings",
    "RESUME_RULES",
    "ResumeChange",
    "resume_conflicts",
]
