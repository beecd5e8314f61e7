"""Prompt data: files in every format people keep them in (:mod:`.files`), chat-message prompts
(:mod:`.messages`), veRL's layout (:mod:`.verl`), and the checks every record passes
(:mod:`.records`). :mod:`pyppo.prompts` reads prompt sets through it (``docs/rewards.md``)."""

from .files import SUFFIXES, read_rows
from .messages import ROLES, check_prompt, check_renderable, classifier_text, is_messages, is_prompt, render_messages
from .records import checked_rows, is_dataset, prompt_list, same_fields
from .verl import is_verl_record, lift_ground_truth

__all__ = [
    "ROLES",
    "SUFFIXES",
    "check_prompt",
    "check_renderable",
    "checked_rows",
    "classifier_text",
    "is_dataset",
    "is_messages",
    "is_prompt",
    "is_verl_record",
    "lift_ground_truth",
    "prompt_list",
    "read_rows",
    "render_messages",
    "same_fields",
]
