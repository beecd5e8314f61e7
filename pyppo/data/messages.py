"""Chat-message prompts: a record's ``"prompt"`` given as a conversation, checked and rendered.

A prompt is a non-empty string or a list of chat messages ``[{"role": "system" | "user" |
"assistant", "content": str}, ...]``: TRL's "conversational" format and the ``prompt`` column of
veRL's data files. A message prompt is rendered with the tokenizer's chat template and the
generation prompt, as TRL's trainers render it (``apply_chat_template(messages,
add_generation_prompt=True)``); a system message is kept as given (a template such as SmolLM2's
inserts its default system message only when the conversation has none). Without a chat template
there is no faithful way to write a conversation as text, so a message prompt is then an error
naming it (:func:`check_renderable`), never a made-up format.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

__all__ = [
    "ROLES",
    "check_prompt",
    "check_renderable",
    "classifier_text",
    "is_messages",
    "is_prompt",
    "render_messages",
]

#: The roles a message of a prompt may have.
ROLES = ("system", "user", "assistant")

#: What a prompt may be besides a string, for the error messages.
ALTERNATIVE = 'or a list of chat messages [{"role": ..., "content": ...}]'


def is_messages(prompt: Any) -> bool:
    """Whether ``prompt`` is given as chat messages: a list or tuple (not yet checked, see
    :func:`check_prompt`)."""
    return isinstance(prompt, (list, tuple))


def is_prompt(prompt: Any) -> bool:
    """Whether ``prompt`` has a prompt's shape: a string, or a non-empty list of mappings (the
    quick test of the trainer's arguments; :func:`check_prompt` checks the messages in full)."""
    if isinstance(prompt, str):
        return True
    return is_messages(prompt) and len(prompt) > 0 and all(isinstance(m, Mapping) for m in prompt)


def check_prompt(prompt: Any, where: str) -> Any:
    """``prompt`` checked: a non-empty string as it is, or a list of chat messages as new dicts.

    Args:
        prompt: a record's ``"prompt"`` value.
        where: the record, for the messages (``path:line``, ``path: row 3``).

    Returns:
        The string, or a list of dicts each with a ``"role"`` in :data:`ROLES` and a string
        ``"content"`` (and any other keys of the message, which reach the chat template).

    Raises:
        ValueError: naming ``where``, the column ``"prompt"`` and, for a bad message, its index:
            not a non-empty string or a non-empty list of messages, a message that is not a
            mapping, has an unknown role, or a content that is not a string.
    """
    if isinstance(prompt, str) and prompt.strip():
        return prompt
    if not is_messages(prompt) or not prompt:
        raise ValueError(f'{where}: "prompt" must be a non-empty string, got {_short(prompt)} ({ALTERNATIVE})')
    messages: List[Dict[str, Any]] = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise ValueError(
                f'{where}: "prompt" message {i} must be a mapping {{"role": ..., "content": ...}}, '
                f"got {_short(message)}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(
                f'{where}: "prompt" message {i}: "role" must be one of {", ".join(map(repr, ROLES))}, got {role!r}'
            )
        if not isinstance(content, str):
            raise ValueError(f'{where}: "prompt" message {i} ({role}): "content" must be a str, got {_short(content)}')
        messages.append(dict(message))
    return messages


def _short(value: Any, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def check_renderable(
    prompts: Sequence[Any], *, uses_template: bool, what: str = "prompts", source: str | None = None
) -> None:
    """Refuse message prompts when there is no chat template to render them with.

    Args:
        prompts: strings and message lists.
        uses_template: whether prompts are rendered with the tokenizer's chat template (it has
            one and ``use_chat_template`` is true).
        what: the prompt set, for the message (``prompts``, ``eval_prompts``): ``prompts[3] is ...``.
        source: where the set came from (``--prompts 'data.jsonl'``), to name instead:
            ``--prompts 'data.jsonl': prompt 3 is ...`` (the check before the model loads, where
            ``use_chat_template = false`` is given).

    Raises:
        ValueError: ``uses_template`` is false and a prompt is a list of messages, naming the
            first such prompt's index and how many there are.
    """
    if uses_template:
        return
    found = [i for i, p in enumerate(prompts) if is_messages(p)]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        first = f"{source}: prompt {found[0]}" if source else f"{what}[{found[0]}]"
        raise ValueError(
            f"{first}{more} is a list of chat messages, but prompts are not rendered with a chat "
            "template (the tokenizer has none, or use_chat_template = false): give the tokenizer a "
            "chat_template, set use_chat_template = true, or write the prompts as strings"
        )


def render_messages(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> str:
    """The text of a message prompt: the tokenizer's chat template with the generation prompt
    (``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``, as TRL's
    trainers render a conversational prompt). The template holds the special tokens it wants, so
    the text is tokenised with ``add_special_tokens=False``."""
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True)


def classifier_text(tokenizer: Any, prompt: Any, response: str) -> str:
    """The text a sequence-classification reward model scores for ``(prompt, response)``.

    A string prompt: ``prompt + response``, as before. A message prompt: as TRL's ``GRPOTrainer``
    gives a conversation to a reward model, the messages plus ``{"role": "assistant", "content":
    response}`` rendered with the classifier's own chat template (without the generation prompt),
    less a leading BOS text the tokenizer adds again when it encodes; without a chat template, the
    messages' contents and the response, each on its own paragraph (``"\\n\\n"`` between them).
    """
    if not is_messages(prompt):
        return prompt + response
    conversation = [dict(m) for m in prompt] + [{"role": "assistant", "content": response}]
    if not getattr(tokenizer, "chat_template", None):
        return "\n\n".join(m["content"] for m in conversation)
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    bos = getattr(tokenizer, "bos_token", None)
    # The classifier's call adds the special tokens: a BOS in the text as well would be doubled.
    if bos and text.startswith(bos) and _adds_bos(tokenizer):
        text = text[len(bos) :]
    return text


def _adds_bos(tokenizer: Any) -> bool:
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == getattr(tokenizer, "bos_token_id", None)
