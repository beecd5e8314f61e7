"""Chat rendering exact to the token, for multi-turn episodes.

An episode is one token sequence: the prompt's ids, then per agent turn the ids the policy sampled
and the environment's reply. Sampled ids are never decoded and re-encoded (PPO is on-policy only
if the trainer scores the very ids that were sampled), so the renderer never renders a whole
conversation: it gives the prompt's ids once (:meth:`ChatRenderer.prompt_ids`) and, after each
turn, the ids of exactly what the chat template puts after the assistant's content for the
environment's reply (:meth:`ChatRenderer.reply_ids`), found as the difference between rendering
the conversation with and without that reply, and tokenised once.

The convention follows TRL's ``GRPOTrainer`` (``_get_tool_suffix_ids``: the reply's ids as the
difference of two renderings; the environment's ``reset()`` text appended to the user message),
with two changes: the difference is taken with the episode's own leading messages (so a template
that injects a default system prompt does not inject it again, and one whose rendering depends on
the system prompt renders the reply as it would in the full conversation), and the closing of the
assistant turn is kept when the model did not sample it.
"""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from pyppo.data.messages import check_prompt, check_renderable, is_prompt
from pyppo.rollout.tokens import _uses_template

__all__ = ["ChatRenderer", "PLAIN_SEPARATOR"]

#: What separates the messages of plain-text mode (no chat template): the tools' system prompt
#: from the prompt, the agent's turn from a reply, the messages of a reply, and a reply from the
#: next agent turn.
PLAIN_SEPARATOR = "\n\n"

# Stands in for the assistant's content while rendering: what the model sampled is never rendered,
# only located. Plain ASCII, so that no template's filters (trim, escaping) alter it.
_SENTINEL = "PYPPO_ASSISTANT_CONTENT_5e0c1f"

_ROLES = ("tool", "user")
_CACHE_SIZE = 1024


class ChatRenderer:
    """Token ids of an episode's prompt and of the environment's replies, for one tokenizer and
    one set of tools.

    Two modes, chosen as :func:`pyppo.rollout.tokens.encode_prompts` chooses (so that a prompt's
    ids are the same as in a single-turn run): the chat template when ``use_chat_template`` is true
    and the tokenizer has one, else plain text (:data:`PLAIN_SEPARATOR` between messages).

    Tools: passed to the template as ``tools=`` when the template renders them (rendering a probe
    conversation with and without ``tools=`` differs); otherwise (SmolLM2's template ignores
    ``tools=``) ``tools_system_prompt(tools)`` is put into the system prompt: appended to a leading
    system message after :data:`PLAIN_SEPARATOR`, else as a new first system message. A template
    that injects a default system prompt when the conversation has none (SmolLM2's, Qwen2.5's) then
    shows that system message instead of its default. A ``UserWarning`` says so, once per renderer
    (at construction). In plain mode the tools' text comes before the prompt, without a warning.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        use_chat_template: render through the tokenizer's chat template (when it has one).
        tools: the tools' JSON schemas (``transformers.utils.get_json_schema``); ``None`` or ``[]``
            for none.
        tools_system_prompt: ``schemas -> text`` describing the tools to the model, used where the
            template does not render ``tools=``; default
            ``pyppo.agents.tools.tools_system_prompt``, imported when needed.

    Raises:
        ImportError: the tools' text is needed, ``tools_system_prompt`` is not given, and
            ``pyppo.agents.tools`` cannot be imported.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        use_chat_template: bool,
        tools: Optional[List[Dict[str, Any]]],
        tools_system_prompt: Optional[Callable[[List[Dict[str, Any]]], str]] = None,
    ):
        self.tokenizer = tokenizer
        self.tools: List[Dict[str, Any]] = list(tools or [])
        #: Whether prompts and replies are rendered with the chat template (else plain text).
        self.uses_template: bool = _uses_template(tokenizer, use_chat_template)
        #: Whether the tools reach the template as ``tools=`` (else they sit in the system prompt).
        self.tools_in_template: bool = False
        self._tools_text: Optional[str] = None
        self._assistant_cache: "OrderedDict[str, str]" = OrderedDict()
        if not self.tools:
            return
        if self.uses_template:
            self.tools_in_template = self._template_renders_tools()
            if self.tools_in_template:
                return
        self._tools_text = _tools_prompt_function(tools_system_prompt)(self.tools)
        if self.uses_template:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            warnings.warn(
                f"the chat template of tokenizer {name!r} ignores tools=: the {len(self.tools)} tool "
                "schema(s) are described in the system prompt instead (tools_system_prompt), which "
                "replaces any default system prompt the template would inject",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------------------------------
    # the prompt

    def messages(self, prompt: Union[str, Sequence[Dict[str, Any]]], appended: Optional[str]) -> List[Dict[str, Any]]:
        """The episode's leading messages: one user message, ``prompt + appended`` (the text an
        environment's ``reset()`` returns, concatenated with no separator, as TRL's
        ``GRPOTrainer`` does, so an environment written for TRL gives the same prompt; an
        environment that wants a separator starts its text with it), preceded by a system message
        with the tools' text where the tools go in the system prompt. A chat-message prompt
        (:mod:`pyppo.data.messages`) starts the conversation as it is, ``appended`` added to its
        last user message; it needs the chat template.

        Args:
            prompt: the prompt record's text, or its list of chat messages.
            appended: ``reset()``'s text, or ``None``.

        Returns:
            ``[{"role": "user", "content": str}]`` (or the prompt's messages), preceded by the tools'
            system message where they go in the system prompt (or added to the prompt's own).

        Raises:
            TypeError: ``prompt`` is neither a string nor a list of mappings, or ``appended`` is
                not a string.
            ValueError: a bad message (:func:`pyppo.data.messages.check_prompt`), a message prompt
                without the chat template, or with ``appended`` and no user message to add it to.
        """
        if not is_prompt(prompt) or not (appended is None or isinstance(appended, str)):
            raise TypeError(
                f"prompt must be a str or a list of chat messages (mappings) and appended a str or None, got "
                f"{type(prompt).__name__} and {type(appended).__name__}"
            )
        if isinstance(prompt, str):
            leading = [{"role": "user", "content": prompt + (appended or "")}]
        else:
            leading = _conversation(prompt, appended, self.uses_template)
        if self._tools_text is not None:
            leading = _with_system_text(leading, self._tools_text)
        return leading

    def prompt_ids(self, leading: Sequence[Dict[str, Any]]) -> List[int]:
        """The prompt's token ids: ``leading`` rendered with the generation prompt (and ``tools=``
        where the template renders them), tokenised once without adding special tokens (the
        template holds those it wants). Plain mode: the messages' contents joined by
        :data:`PLAIN_SEPARATOR`, tokenised with ``add_special_tokens=True``. For a lone user
        message these are exactly :func:`pyppo.rollout.tokens.encode_prompts`' ids (untruncated).

        Args:
            leading: what :meth:`messages` returned.

        Returns:
            the ids, a list of ints.

        Raises:
            ValueError: the prompt encodes to zero tokens.
        """
        if self.uses_template:
            ids = self._encode(self._render(list(leading), generation_prompt=True), special=False)
        else:
            ids = self._encode(PLAIN_SEPARATOR.join(str(m["content"]) for m in leading), special=True)
        if not ids:
            raise ValueError("the prompt encoded to zero tokens")
        return ids

    # ------------------------------------------------------------------------------------------
    # the environment's reply

    def reply_ids(
        self, leading: Sequence[Dict[str, Any]], ended_with_eos: bool, reply: Sequence[Dict[str, Any]]
    ) -> List[int]:
        """The ids that follow an agent turn when the environment answers with ``reply``.

        With a chat template: A = ``leading`` + an assistant message whose content is a sentinel
        (no generation prompt), B = A's messages + ``reply`` (generation prompt). The closing of
        the turn is A's text after the sentinel; when the turn ended with EOS and the closing
        starts with the EOS token's text (after whitespace), that much was sampled already and is
        dropped. B's text after the sentinel must start with A's closing (else the template closes
        the turn otherwise when a reply follows: ``ValueError``); the reply's text is the closing
        (less what was sampled) + the rest of B, tokenised once with ``add_special_tokens=False``:
        the reply's messages, the template's separators and the next generation prompt. Only the
        text from the sentinel on must agree between A and B: what precedes it may differ (Qwen3's
        template writes an empty ``<think>`` block into the last assistant turn only), as in the
        episode it stands for ids the model sampled, never for rendered ones.

        Some templates render a ``tool`` message only after an assistant message with
        ``tool_calls`` (they raise, or drop the tool's content): when rendering B raises or lacks
        a message's content, B is rendered again with the assistant message carrying one
        ``{"type": "function", "function": {"name": <tool message's name>, "arguments": {}}}`` per
        tool message, and the reply's text is the plain turn's closing + B's text after that
        assistant message's rendering (the tool calls' own rendering, which the model sampled as
        text, is left out).

        Plain mode: ``PLAIN_SEPARATOR + PLAIN_SEPARATOR.join(contents) + PLAIN_SEPARATOR``, tokenised
        with ``add_special_tokens=False``; ``ended_with_eos`` changes nothing (no closing).

        Args:
            leading: the episode's leading messages (what :meth:`messages` returned).
            ended_with_eos: the turn's last sampled id was the EOS token.
            reply: the environment's messages, in order: ``{"role": "tool", "name": str, "content":
                str}`` or ``{"role": "user", "content": str}``; at least one.

        Returns:
            the ids, a list of ints.

        Raises:
            ValueError: ``reply`` is empty or holds a message of another role, without a string
                content, or (a tool message) without a name; the template drops or repeats the
                assistant's content, closes the turn differently when a reply follows, or renders
                the reply without its messages' contents, even with ``tool_calls``.
        """
        reply = [dict(m) for m in reply]
        _check_reply(reply)
        if not self.uses_template:
            text = PLAIN_SEPARATOR + PLAIN_SEPARATOR.join(m["content"] for m in reply) + PLAIN_SEPARATOR
            return self._encode(text, special=False)
        leading = list(leading)
        closing = self._closing(leading)
        try:
            body = self._reply_body(leading, None, reply)
        except _Retry as first:
            names = [m["name"] for m in reply if m["role"] == "tool"]
            if not names:
                raise ValueError(f"{self._name()}: {first}") from first.__cause__
            try:
                body = self._reply_body(leading, names, reply)
            except _Retry as second:
                raise ValueError(
                    f"{self._name()}: {first}; and with the assistant message carrying tool_calls for {names}: {second}"
                ) from (second.__cause__ or first.__cause__)
        return self._encode(self._unsampled(closing, ended_with_eos) + body, special=False)

    # ------------------------------------------------------------------------------------------

    def _name(self) -> str:
        name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
        return f"the chat template of tokenizer {name!r}"

    def _render(self, messages: List[Dict[str, Any]], *, generation_prompt: bool) -> str:
        kwargs: Dict[str, Any] = {"tools": self.tools} if self.tools_in_template else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _encode(self, text: str, *, special: bool) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _template_renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "Hi"}]
        plain = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        try:
            with_tools = self.tokenizer.apply_chat_template(
                probe, tokenize=False, add_generation_prompt=True, tools=self.tools
            )
        except Exception:  # a template that cannot take tools= does not render them
            return False
        return with_tools != plain

    def _assistant_text(self, leading: List[Dict[str, Any]], names: Optional[List[str]]) -> str:
        """A's text, cached: the episode runner asks for every turn of an episode with the same
        leading messages."""
        key = json.dumps([leading, names], sort_keys=True, default=str)
        text = self._assistant_cache.get(key)
        if text is not None:
            self._assistant_cache.move_to_end(key)
            return text
        text = self._render(leading + [_assistant(names)], generation_prompt=False)
        self._assistant_cache[key] = text
        if len(self._assistant_cache) > _CACHE_SIZE:
            self._assistant_cache.popitem(last=False)
        return text

    def _closing(self, leading: List[Dict[str, Any]]) -> str:
        """The template's closing of a plain assistant turn: A's text after the sentinel."""
        text = self._assistant_text(leading, None)
        if text.count(_SENTINEL) != 1:
            raise ValueError(
                f"{self._name()} renders an assistant message's content {text.count(_SENTINEL)} times, not "
                "once: the agent's turn cannot be located in the conversation"
            )
        return text[text.index(_SENTINEL) + len(_SENTINEL) :]

    def _reply_body(
        self, leading: List[Dict[str, Any]], names: Optional[List[str]], reply: List[Dict[str, Any]]
    ) -> str:
        """B's text after the assistant turn's rendering in A (the reply's messages, separators
        and generation prompt).

        Raises:
            _Retry: rendering B raised, B does not extend A from the assistant's content on, or
                B lacks a reply message's content.
        """
        try:
            turn = self._assistant_text(leading, names)
            full = self._render(leading + [_assistant(names)] + reply, generation_prompt=True)
        except Exception as exc:  # templates raise their own errors (raise_exception)
            raise _Retry(f"rendering the conversation raised {type(exc).__name__}: {exc}") from exc
        at_a, at_b = turn.count(_SENTINEL), full.count(_SENTINEL)
        if at_a == 1 and at_b == 1:
            closing = turn[turn.index(_SENTINEL) + len(_SENTINEL) :]
            after = full[full.index(_SENTINEL) + len(_SENTINEL) :]
            extends, body = after.startswith(closing), after[len(closing) :]
            seen = f"it closes the assistant's turn with {closing!r} when the turn is last but continues {after!r}"
        elif names is not None and at_a == at_b == 0:
            # Templates that render an assistant message with tool_calls as the calls alone.
            extends, body = full.startswith(turn), full[len(turn) :]
            seen = "the rendering with the reply does not start with the rendering without it"
        else:
            extends, body = False, ""
            seen = f"it renders the assistant's content {at_a} time(s) without the reply and {at_b} with it"
        if not extends:
            raise _Retry(f"the template does not extend the conversation when a reply is added: {seen}")
        missing = _missing_contents(reply, body)
        if missing:
            raise _Retry(f"the rendered reply lacks the content of message(s) {missing}")
        return body

    def _unsampled(self, closing: str, ended_with_eos: bool) -> str:
        """The part of the turn's closing the model did not sample."""
        eos = getattr(self.tokenizer, "eos_token", None)
        if ended_with_eos and eos:
            # Whitespace the template puts before its EOS cannot follow the sampled EOS either.
            stripped = closing.lstrip()
            if stripped.startswith(eos):
                return stripped[len(eos) :]
        return closing


class _Retry(Exception):
    """Rendering the reply failed in a way ``tool_calls`` on the assistant message may fix."""


def _assistant(names: Optional[List[str]]) -> Dict[str, Any]:
    message: Dict[str, Any] = {"role": "assistant", "content": _SENTINEL}
    if names is not None:
        # The real tool name, as TRL does: some templates (GPT-OSS) take a tool reply's header from it.
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": {}}} for n in names]
    return message


def _check_reply(reply: List[Dict[str, Any]]) -> None:
    if not reply:
        raise ValueError("reply_ids: the reply holds no message (an episode that ended has no reply)")
    for i, m in enumerate(reply):
        if m.get("role") not in _ROLES:
            raise ValueError(f"reply message {i}: role must be one of {_ROLES}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"reply message {i}: content must be a str, got {type(m.get('content')).__name__}")
        if m["role"] == "tool" and not isinstance(m.get("name"), str):
            raise ValueError(f"reply message {i}: a tool message needs its tool's 'name' (a str)")


def _missing_contents(reply: List[Dict[str, Any]], text: str) -> List[int]:
    """Indices of the reply's messages whose content ``text`` does not show, in order, as a
    template may render it: verbatim, trimmed, or as a JSON string (templates that ``tojson`` tool
    results). Searching in order keeps a short content from being found in another's text."""
    missing, at = [], 0
    for i, m in enumerate(reply):
        core = m["content"].strip()
        if not core:
            continue
        found = [p for p in (text.find(core, at), text.find(json.dumps(core)[1:-1], at)) if p >= 0]
        if found:
            at = min(found) + 1
        else:
            missing.append(i)
    return missing


def _conversation(
    prompt: Sequence[Dict[str, Any]], appended: Optional[str], uses_template: bool
) -> List[Dict[str, Any]]:
    """A message prompt's messages as an episode's start: copies, ``appended`` added to the last
    user message's content (as to a string prompt's one user message)."""
    leading = check_prompt(prompt, "the episode's prompt")
    check_renderable([leading], uses_template=uses_template, what="episode prompts")
    if appended:
        users = [i for i, m in enumerate(leading) if m.get("role") == "user"]
        if not users:
            raise ValueError("the prompt's messages have no user message to add the environment's reset() text to")
        leading[users[-1]]["content"] += appended
    return leading


def _with_system_text(messages: List[Dict[str, Any]], text: str) -> List[Dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}{PLAIN_SEPARATOR}{text}")
        return [first] + list(messages[1:])
    return [{"role": "system", "content": text}] + list(messages)


def _tools_prompt_function(given: Optional[Callable[[List[Dict[str, Any]]], str]]):
    if given is not None:
        return given
    try:
        from pyppo.agents.tools import tools_system_prompt
    except ImportError as exc:
        raise ImportError(
            "the tools must be described in the prompt (the chat template ignores tools=, or there is "
            "no chat template), and pyppo.agents.tools.tools_system_prompt cannot be imported; pass "
            f"tools_system_prompt= to ChatRenderer ({exc})"
        ) from exc
    return tools_system_prompt
