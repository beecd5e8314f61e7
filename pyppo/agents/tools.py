"""Tools for agent episodes: their JSON schemas, parsing the model's tool calls, running them.

The conventions are TRL's (``GRPOTrainer(tools=..., environment_factory=...)``): a tool is a Python
function (sync or async) with type hints and a Google-style docstring, described to the model by
``transformers.utils.get_json_schema``; a call is ``{"name": str, "arguments": dict}``; each call's
result goes back to the model as a ``{"role": "tool", "name": name, "content": str}`` message. Where
the tokenizer has a response parser (``tokenizer.parse_response``, transformers 5.x) it reads the
calls; otherwise the Hermes/Qwen form ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
is parsed here (:func:`tools_system_prompt` teaches a model that form when its chat template does
not describe tools itself).

Unlike TRL, which drops a malformed call (the turn then reads as a final answer), a malformed call
here is answered with an error message and counted, so the episode goes on and the policy learns
from the error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "ToolCallParser",
    "call_tools",
    "parse_tool_call_blocks",
    "run_awaitable",
    "tool_schemas",
    "tools_system_prompt",
]

#: The tool name of the error message that answers a call too malformed to have one (TRL's choice).
UNKNOWN_TOOL_NAME = "unknown"


def _describe(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)


def tool_schemas(functions: Sequence[Callable]) -> List[Dict[str, Any]]:
    """The JSON schemas of ``functions``, in order, as ``transformers.utils.get_json_schema`` gives them:
    ``{"type": "function", "function": {"name", "description", "parameters", ...}}``.

    Args:
        functions: functions or bound methods (sync or async), each with a type hint on every
            argument and a Google-style docstring describing the function and every argument.

    Raises:
        ValueError: a function without a docstring, without a type hint or a description for an
            argument, or that is not a function at all; the message names the function and what is
            missing.
    """
    from transformers.utils import get_json_schema

    schemas = []
    for function in functions:
        if not callable(function):
            raise ValueError(f"tool {function!r} is not callable")
        try:
            schemas.append(get_json_schema(function))
        except Exception as exc:  # noqa: BLE001 - transformers raises its own exception types, and TypeError
            raise ValueError(
                f"tool {_describe(function)!r}: cannot describe it to the model ({exc}); a tool needs a type hint "
                "on every argument and a Google-style docstring with a description and an 'Args:' entry per argument"
            ) from exc
    return schemas


def run_awaitable(awaitable: Any) -> Any:
    """The result of ``awaitable`` (a coroutine, say) from synchronous code.

    Runs it with ``asyncio.run``; where an event loop is already running in this thread (a notebook),
    on a fresh loop in a worker thread, since ``asyncio.run`` refuses to nest.
    """

    async def wait() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, wait()).result()


# A <tool_call> block, or an opening tag the turn never closed (a length limit cut it, or the model forgot).
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _normalize_call(raw: Any) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``(call, None)`` for a well-formed call, else ``(None, why)``.

    Accepts ``{"name", "arguments"}`` and the OpenAI form ``{"type": "function", "function": {...}}``
    (what ``tokenizer.parse_response`` gives); ``arguments`` may be a JSON string of an object
    (OpenAI's wire form), ``parameters`` (Llama 3's key) stands for it, and its absence means no
    arguments.
    """
    if isinstance(raw, Mapping) and isinstance(raw.get("function"), Mapping):
        raw = raw["function"]
    if not isinstance(raw, Mapping):
        return None, f"a tool call must be a JSON object with 'name' and 'arguments', got {json.dumps(raw)[:200]}"
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        return None, f"a tool call needs a 'name' string, got {json.dumps(raw, default=str)[:200]}"
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return None, f"the arguments of the call to {name!r} are not valid JSON ({exc.msg})"
    if not isinstance(arguments, Mapping):
        return None, f"the arguments of the call to {name!r} must be a JSON object, got {json.dumps(arguments)[:200]}"
    return {"name": name, "arguments": dict(arguments)}, None


def parse_tool_call_blocks(text: str) -> Tuple[List[Dict[str, Any]], List[str]]:
    """The Hermes/Qwen calls in ``text``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks, in order, as ``(calls, errors)``; a block whose JSON does not parse, has no name, or
    never closes is an entry of ``errors`` (a message for the model), never an exception."""
    calls: List[Dict[str, Any]] = []
    errors: List[str] = []
    for match in _TOOL_CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            errors.append(f"a <tool_call> block was not closed with </tool_call>: {body[:200]!r}")
            continue
        try:
            raw = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"the tool call is not valid JSON ({exc.msg}): {body[:200]!r}")
            continue
        call, error = _normalize_call(raw)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    return calls, errors


class ToolCallParser:
    """Reads an agent turn's tool calls.

    With a tokenizer that has a response parser (a ``response_template``, or on transformers before
    5.13 a ``response_schema``, as set by TRL's ``add_response_schema`` or shipped by the model),
    ``tokenizer.parse_response`` reads the sampled ids, as TRL's GRPOTrainer does; the parser is
    given no prompt prefix (the environment does not see the prompt), so a template that pre-writes
    part of the assistant turn (an opening ``<think>``) may parse less well. Where that parser
    raises (malformed output) or finds no call, and for every other tokenizer, the turn's text is
    searched for ``<tool_call>{json}</tool_call>`` blocks (:func:`parse_tool_call_blocks`).

    Args:
        tokenizer: a Hugging Face tokenizer, or ``None`` (blocks only).
        tools: the tools' JSON schemas (or the functions): from transformers 5.15 the response
            parser types each call's arguments by them (``"7"`` is ``7`` for an integer parameter).

    Call it as ``parser(text, ids) -> (calls, errors)``: ``calls`` is ``[{"name": str,
    "arguments": dict}, ...]`` in order, ``errors`` a message per malformed call.
    """

    def __init__(self, tokenizer: Any = None, tools: Optional[Sequence[Any]] = None):
        self.tokenizer = tokenizer
        self.tools = list(tools or [])
        self._parse_kwargs: Optional[Dict[str, Any]] = self._response_parser_kwargs(tokenizer, self.tools)

    @staticmethod
    def _response_parser_kwargs(tokenizer: Any, tools: List[Any]) -> Optional[Dict[str, Any]]:
        """The keyword arguments ``tokenizer.parse_response`` takes here, or ``None`` when it has no parser."""
        parse = getattr(tokenizer, "parse_response", None)
        if parse is None:
            return None
        try:
            parameters = inspect.signature(parse).parameters
        except (TypeError, ValueError):
            parameters = {}
        if getattr(tokenizer, "response_template", None) is not None:
            kwargs: Dict[str, Any] = {}
            # The new-style parser insists on the prompt before the response; an empty one says "none".
            if "prefix" in parameters:
                kwargs["prefix"] = []
            if "tools" in parameters and tools:
                kwargs["tools"] = tools
            return kwargs
        if getattr(tokenizer, "response_schema", None) is not None:
            return {}
        return None

    def __call__(self, text: str, ids: Sequence[int]) -> Tuple[List[Dict[str, Any]], List[str]]:
        if self._parse_kwargs is not None:
            try:
                parsed = self.tokenizer.parse_response(list(ids), **self._parse_kwargs)
            except Exception:  # noqa: BLE001 - the parser raises on malformed calls; the blocks then say which
                parsed = None
            if isinstance(parsed, Mapping):
                calls: List[Dict[str, Any]] = []
                errors: List[str] = []
                for raw in parsed.get("tool_calls") or []:
                    call, error = _normalize_call(raw)
                    if call is not None:
                        calls.append(call)
                    else:
                        errors.append(error)
                if calls or errors:
                    return calls, errors
                # No call in the template's own form: the model may still write the Hermes form that
                # tools_system_prompt teaches, so the blocks are read below.
        calls, errors = parse_tool_call_blocks(text)
        if not calls and not errors and self.tokenizer is not None and ids and "<tool_call>" not in text:
            # A tokenizer that makes <tool_call> a special token drops it from the skip-special text.
            with_specials = self.tokenizer.decode(list(ids), skip_special_tokens=False)
            if "<tool_call>" in with_specials:
                calls, errors = parse_tool_call_blocks(with_specials)
        return calls, errors


def _error(name: str, message: str) -> Dict[str, Any]:
    return {"role": "tool", "name": name, "content": f"Error: {message}"}


def call_tools(
    calls: Sequence[Mapping[str, Any]], errors: Sequence[str], registry: Mapping[str, Callable]
) -> Tuple[List[Dict[str, Any]], int, int]:
    """Runs a turn's tool calls and answers each with a tool message.

    Args:
        calls: ``[{"name": str, "arguments": dict}, ...]``, run in order.
        errors: a message per malformed call (:class:`ToolCallParser`); each is answered with an
            error message after the calls' results and counts as a call and an error.
        registry: tool name -> function (sync, or async: a coroutine function is run to its end
            with :func:`run_awaitable`).

    Returns:
        ``(messages, n_calls, n_errors)``: ``messages`` is ``[{"role": "tool", "name": name,
        "content": str}, ...]``, one per call then one per malformed call; a result's content is
        ``str(result)``, a failure's ``"Error: ..."``: an unknown tool, arguments that do not bind
        to the tool's signature, or an exception the tool raised (never propagated: the model reads
        it and the episode goes on). ``n_calls = len(calls) + len(errors)``; ``n_errors`` counts
        the failures, malformed calls included.
    """
    messages: List[Dict[str, Any]] = []
    n_errors = 0
    for call in calls:
        name, arguments = call.get("name"), call.get("arguments") or {}
        function = registry.get(name) if isinstance(name, str) else None
        if function is None:
            available = ", ".join(sorted(registry)) or "none"
            messages.append(_error(str(name), f"unknown tool {name!r}; the tools are: {available}"))
            n_errors += 1
            continue
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            signature = None
        if signature is not None:
            try:
                signature.bind(**arguments)
            except TypeError as exc:
                messages.append(_error(name, f"bad arguments for {name}{signature}: {exc}"))
                n_errors += 1
                continue
        try:
            result = function(**arguments)
            if inspect.isawaitable(result):
                result = run_awaitable(result)
        except Exception as exc:  # noqa: BLE001 - any failure of the tool is the model's to read
            messages.append(_error(name, f"{name} raised {type(exc).__name__}: {exc}"))
            n_errors += 1
            continue
        messages.append({"role": "tool", "name": name, "content": str(result)})
    for message in errors:
        messages.append(_error(UNKNOWN_TOOL_NAME, message))
    n_errors += len(errors)
    return messages, len(calls) + len(errors), n_errors


def tools_system_prompt(schemas: Sequence[Mapping[str, Any]]) -> str:
    """Text that describes ``schemas`` to a model whose chat template ignores ``tools=``, in the
    Hermes/Qwen form (the form :class:`ToolCallParser` reads): instructions, the schemas inside
    ``<tools></tools>`` one JSON object per line, and how to call one:
    ``<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>``.

    Args:
        schemas: JSON schemas as :func:`tool_schemas` gives them.
    """
    lines = "\n".join(json.dumps(dict(schema), ensure_ascii=False) for schema in schemas)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request.\n\n"
        "The functions are described by the JSON signatures inside <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, write a JSON object with the function's name and arguments inside "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
        "The results come back in tool messages. When you need no more calls, give your final answer."
    )
