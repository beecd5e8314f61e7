"""The key table of ``docs/trainer.md`` (:func:`config_markdown`), generated from the knobs'
metadata and :data:`~.rules.NEEDS`; ``python -m pyppo.config`` prints it."""

from __future__ import annotations

from .knobs import _default_text
from .ppo_config import _field_defaults, config_knobs
from .rules import NEEDS


def config_markdown() -> str:
    """The key table of ``docs/trainer.md``, generated from the fields' metadata and :data:`NEEDS`:
    one table per group (``resume``: whether a resume may change the key), then the rules."""
    defaults = _field_defaults()
    lines: list[str] = []
    group = None
    for name, k in config_knobs():
        if k.group != group:
            group = k.group
            lines += ["", f"### {group}", "", "| key | default | values | resume | meaning |", "|---|---|---|---|---|"]
        lines.append(f"| `{name}` | `{_default_text(defaults[name])}` | {k.expected()} | {k.resume} | {k.help} |")
    lines += ["", "### what acts only with what", "", "| keys | act only with | set without it |", "|---|---|---|"]
    for rule in NEEDS:
        keys = ", ".join(f"`{name}`" for name in rule.knobs)
        lines.append(f"| {keys} | {rule.when} | {'warned' if rule.warn else 'refused'} |")
    return "\n".join(lines[1:]) + "\n"
