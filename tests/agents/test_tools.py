"""Tools: JSON schemas from typed functions, parsing tool calls (good, malformed, several, through a
tokenizer's response parser), running them with every failure answered and counted, and the
Hermes/Qwen system prompt."""

from __future__ import annotations

import json

import pytest

from pyppo.agents.tools import ToolCallParser, call_tools, tool_schemas, tools_system_prompt
from support.tiny_models import tiny_tokenizer


def add(a: int, b: int) -> int:
    """
    Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    return a + b


async def shout(text: str) -> str:
    """
    Upper-case a text, asynchronously.

    Args:
        text: The text.
    """
    return text.upper()


def explode(reason: str) -> str:
    """
    Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)


def untyped(a):
    """
    No type hint.

    Args:
        a: Something.
    """
    return a


def undocumented(a: int) -> int:
    return a


def test_schemas_from_typed_functions_and_methods():
    class Env:
        def look(self, direction: str) -> str:
            """
            Look somewhere.

            Args:
                direction: Where to look.
            """
            return direction

    schemas = tool_schemas([add, shout, Env().look])
    assert [s["function"]["name"] for s in schemas] == ["add", "shout", "look"]
    assert schemas[0]["type"] == "function"
    params = schemas[0]["function"]["parameters"]
    assert params["properties"] == {
        "a": {"type": "integer", "description": "The first integer."},
        "b": {"type": "integer", "description": "The second integer."},
    }
    assert params["required"] == ["a", "b"]
    assert "self" not in schemas[2]["function"]["parameters"]["properties"]


@pytest.mark.parametrize(
    "function, missing",
    [(untyped, "missing a type hint"), (undocumented, "has no docstring"), (lambda x: x, "has no docstring")],
)
def test_schema_errors_name_the_function_and_what_is_missing(function, missing):
    with pytest.raises(ValueError) as info:
        tool_schemas([add, function])
    message = str(info.value)
    assert function.__name__ in message
    assert missing in message


def test_schema_of_a_non_function():
    with pytest.raises(ValueError, match="not callable"):
        tool_schemas([3])


# --- parsing ----------------------------------------------------------------------------------


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(params=["no tokenizer", "tiny tokenizer"])
def parser(request):
    tokenizer = None if request.param == "no tokenizer" else tiny_tokenizer()
    return ToolCallParser(tokenizer, tool_schemas([add]))


def parse(parser, text):
    ids = parser.tokenizer(text)["input_ids"] if parser.tokenizer is not None else []
    return parser(text, ids)


def test_parse_one_call(parser):
    expected = ([{"name": "add", "arguments": {"a": 1, "b": 2}}], [])
    assert parse(parser, "Let me add. " + call("add", a=1, b=2)) == expected


def test_parse_several_calls_in_order_with_whitespace(parser):
    shout_call = json.dumps({"name": "shout", "arguments": {"text": "hi"}})
    text = f"{call('add', a=1, b=2)}\n  <tool_call>\n  {shout_call}\n</tool_call>"
    calls, errors = parse(parser, text)
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "shout", "arguments": {"text": "hi"}}]
    assert errors == []


def test_parse_arguments_as_a_json_string_and_other_spellings(parser):
    text = (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
        '<tool_call>{"name": "add", "parameters": {"a": 3, "b": 4}}</tool_call>'
        '<tool_call>{"type": "function", "function": {"name": "add", "arguments": {"a": 5, "b": 6}}}</tool_call>'
    )
    calls, errors = parse(parser, text)
    assert calls == [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "now", "arguments": {}},
        {"name": "add", "arguments": {"a": 3, "b": 4}},
        {"name": "add", "arguments": {"a": 5, "b": 6}},
    ]
    assert errors == []


def test_parse_no_call(parser):
    assert parse(parser, "The answer is 3.") == ([], [])
    assert parse(parser, "") == ([], [])


@pytest.mark.parametrize(
    "block, why",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', "'name'"),
        ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', "'name'"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', "not closed"),
    ],
)
def test_malformed_calls_are_errors_not_exceptions(parser, block, why):
    calls, errors = parse(parser, call("add", a=1, b=2) + " " + block)
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert len(errors) == 1 and why in errors[0]


def test_parse_with_the_tokenizers_response_parser():
    trl_templates = pytest.importorskip("trl.chat_template_utils")
    tokenizer = tiny_tokenizer()
    tokenizer.response_template = trl_templates.qwen3_template
    seen = []
    original = tokenizer.parse_response

    def spy(response, schema=None, *, prefix=None, tools=None):
        result = original(response, schema, prefix=prefix, tools=tools)
        seen.append(result)
        return result

    tokenizer.parse_response = spy
    parser = ToolCallParser(tokenizer, tool_schemas([add]))
    text = call("add", a=1, b=2) + call("shout", text="hi") + "<|im_end|>"
    ids = tokenizer(text)["input_ids"]
    assert parser(tokenizer.decode(ids, skip_special_tokens=True), ids) == (
        [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "shout", "arguments": {"text": "hi"}}],
        [],
    )
    assert seen and seen[-1]["tool_calls"][0]["type"] == "function"
    # The template's parser raises on a malformed call; the blocks then report it as an error.
    bad = call("add", a=1, b=2) + '<tool_call>{"name": "add", "argu</tool_call><|im_end|>'
    ids = tokenizer(bad)["input_ids"]
    calls, errors = parser(tokenizer.decode(ids, skip_special_tokens=True), ids)
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}] and len(errors) == 1
    # What TRL's own parse_response makes of the same ids, our parser reads the same way.
    ids = tokenizer(text)["input_ids"]
    trl_calls = trl_templates.parse_response(tokenizer, ids, prefix=[])["tool_calls"]
    assert [c["function"] for c in trl_calls] == parser("", ids)[0]


def test_parse_with_a_legacy_response_schema():
    class Legacy:
        response_schema = {"legacy": True}

        def parse_response(self, ids):
            return {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
                    {"type": "function", "function": {"arguments": {}}},
                ],
            }

    calls, errors = ToolCallParser(Legacy(), [])("ignored", [1, 2, 3])
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert len(errors) == 1 and "'name'" in errors[0]


# --- running ----------------------------------------------------------------------------------

REGISTRY = {"add": add, "shout": shout, "explode": explode}


def test_call_tools_success_and_async():
    messages, n_calls, n_errors = call_tools(
        [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "shout", "arguments": {"text": "hi"}}], [], REGISTRY
    )
    assert messages == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "shout", "content": "HI"},
    ]
    assert (n_calls, n_errors) == (2, 0)


def test_every_error_kind_is_answered_and_counted():
    calls = [
        {"name": "nope", "arguments": {}},  # unknown tool
        {"name": "add", "arguments": {"a": 1}},  # a missing argument
        {"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}},  # an unexpected argument
        {"name": "explode", "arguments": {"reason": "boom"}},  # the tool raises
        {"name": "add", "arguments": {"a": 1, "b": 1}},  # fine
    ]
    messages, n_calls, n_errors = call_tools(calls, ["the tool call is not valid JSON"], REGISTRY)
    assert (n_calls, n_errors) == (6, 5)
    assert [m["name"] for m in messages] == ["nope", "add", "add", "explode", "add", "unknown"]
    assert all(m["role"] == "tool" and isinstance(m["content"], str) for m in messages)
    contents = [m["content"] for m in messages]
    assert [c.startswith("Error: ") for c in contents] == [True, True, True, True, False, True]
    assert "unknown tool 'nope'" in contents[0] and "add" in contents[0]
    assert "missing a required argument: 'b'" in contents[1]
    assert "unexpected keyword argument 'c'" in contents[2]
    assert "RuntimeError: boom" in contents[3]
    assert contents[4] == "2"
    assert "not valid JSON" in contents[5]


def test_call_tools_inside_a_running_event_loop():
    import asyncio

    async def main():
        return call_tools([{"name": "shout", "arguments": {"text": "loop"}}], [], REGISTRY)

    messages, _, n_errors = asyncio.run(main())
    assert messages[0]["content"] == "LOOP" and n_errors == 0


def test_tools_system_prompt_lists_the_schemas_and_the_call_form():
    schemas = tool_schemas([add, shout])
    text = tools_system_prompt(schemas)
    inside = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in inside.splitlines()] == schemas
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    # A call written in the taught form parses.
    example = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert ToolCallParser(None)(example, []) == ([{"name": "add", "arguments": {"a": 1, "b": 2}}], [])
