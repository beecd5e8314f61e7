"""Environments: the adapters (tool and text conventions, their contract errors), the factory, the
registry, each built-in environment driven by a scripted policy, and TRL's documented
environment class running unchanged."""

from __future__ import annotations

import functools
import inspect
import json
import math
import sys
import textwrap

import numpy as np
import pytest
import torch

from pyppo.agents.adapters import TextEnvironment, ToolEnvironment, environment_factory, environment_methods
from pyppo.agents.envs import ArithmeticRetry, Calculator, GuessNumber, calculator_prompts, evaluate_expression
from pyppo.agents.registry import BUILTIN_ENVIRONMENTS, declared_prompts, load_environment
from pyppo.agents.tools import ToolCallParser
from pyppo.agents.types import EnvironmentContractError, TurnResult
from pyppo.math_reward import math_reward
from pyppo.prompts import arithmetic_prompts
from support.tiny_models import tiny_tokenizer
from support.trl_env import IncrementEnv


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def turn(env, text, ended=True):
    return env.turn(text, [], ended)


# --- TRL's documented environment (docs/source/grpo_trainer.md, "Providing an external dataset"),
# with the docstring of the same method in the docs' first example. Unchanged: it must run as is.


def trl_tool_methods(instance):
    """What TRL's GRPOTrainer offers as tools for an environment instance (its probing rule)."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def test_trl_documented_environment_runs_unchanged():
    make = environment_factory(IncrementEnv, None, tiny_tokenizer())
    assert make.kind == "tool" and make.name == "IncrementEnv"
    assert [t["function"]["name"] for t in make.tools] == ["increment"]
    assert make.tools[0]["function"]["parameters"]["properties"]["step"]["type"] == "integer"
    env = make()
    assert env.reset({"prompt": "Increment the counter to 5.", "target": 5}, seed=0) is None
    result = turn(env, call("increment", step=2) + call("increment", step=3))
    replies = [{"role": "tool", "name": "increment", "content": c} for c in ("2", "5")]
    assert result == TurnResult(reply=replies, tool_calls=2)
    assert turn(env, "Done: the counter is 5.").done
    assert env.final_reward() == 1.0
    other = make()
    other.reset({"prompt": "Increment the counter to 4.", "target": 4}, seed=0)
    assert other.final_reward() == 0.0  # a fresh instance: the first episode's counter is not shared


def test_trl_probing_finds_the_same_tools():
    from transformers.utils import get_json_schema

    for cls in (IncrementEnv, Calculator):
        instance = cls()
        ours = environment_methods(instance)
        theirs = trl_tool_methods(instance)
        assert [m.__name__ for m in ours] == [m.__name__ for m in theirs]
        assert environment_factory(cls).tools == [get_json_schema(m) for m in theirs]
    assert [m.__name__ for m in environment_methods(Calculator())] == ["calculate"]


def test_trl_still_probes_environments_this_way():
    trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    source = inspect.getsource(trainer.GRPOTrainer)
    # If TRL changes how it finds an environment's tools, environment_methods must follow.
    assert "inspect.getmembers(type(instance), predicate=inspect.isfunction)" in source
    assert 'member_name == "reset"' in source and 'member_name == "get_reward"' in source
    assert 'not member_name.startswith("_")' in source


# --- tool environments --------------------------------------------------------------------------


def lookup(key: str) -> str:
    """
    Look a key up.

    Args:
        key: The key.
    """
    return {"a": "alpha"}.get(key, "?")


class Toolbox:
    def __init__(self):
        self.calls = 0

    def reset(self, seed: int, answer: str = "", **kwargs) -> str:
        self.seed, self.answer, self.fields = seed, answer, sorted(kwargs)
        return f"(seed {seed})"

    def divide(self, a: float, b: float) -> float:
        """
        Divide a by b.

        Args:
            a: The dividend.
            b: The divisor.
        """
        self.calls += 1
        return a / b

    async def wait(self, seconds: float) -> str:
        """
        Wait asynchronously.

        Args:
            seconds: How long.
        """
        return f"waited {seconds}"

    def _private(self) -> None:
        pass

    @property
    def prop(self) -> int:
        raise AssertionError("properties are never evaluated")

    async def get_reward(self) -> float:
        return float(self.calls)


def test_every_tool_error_is_counted_and_the_episode_goes_on():
    make = environment_factory(Toolbox, [lookup], tiny_tokenizer())
    assert [t["function"]["name"] for t in make.tools] == ["divide", "wait", "lookup"]
    env = make()
    assert env.reset({"prompt": "p", "answer": "3", "extra": 1}, seed=7) == "(seed 7)"
    assert (env.instance.seed, env.instance.answer, env.instance.fields) == (7, "3", ["extra", "prompt"])
    text = (
        call("divide", a=1, b=0)  # raises
        + call("divide", a=1)  # bad arguments
        + call("missing")  # unknown tool
        + '<tool_call>{"name": "divide", "arguments": </tool_call>'  # malformed
        + call("wait", seconds=1)  # async, fine
        + call("lookup", key="a")  # standalone, fine
    )
    result = turn(env, text)
    assert not result.done and result.reward == 0.0
    assert (result.tool_calls, result.tool_errors) == (6, 4)
    assert [m["content"].startswith("Error:") for m in result.reply] == [True, True, True, False, False, True]
    assert [m["content"] for m in result.reply[3:5]] == ["waited 1", "alpha"]
    assert turn(env, call("divide", a=6, b=3)).reply[0]["content"] == "2.0"
    assert turn(env, "No more calls.") == TurnResult(done=True)
    assert env.final_reward() == 2.0  # async get_reward, awaited


def test_tools_only_environment():
    make = environment_factory(None, [lookup])
    assert make.kind == "tool" and [t["function"]["name"] for t in make.tools] == ["lookup"]
    env = make()
    assert env.reset({"prompt": "p"}, seed=1) is None
    assert turn(env, call("lookup", key="a")).reply == [{"role": "tool", "name": "lookup", "content": "alpha"}]
    assert env.final_reward() is None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", None])
def test_bad_final_reward_names_the_class(value):
    class Payer:
        def reset(self, **kwargs):
            pass

        def get_reward(self):
            return value

    env = environment_factory(Payer)()
    with pytest.raises(ValueError, match="Payer"):
        env.final_reward()


def test_reset_arguments_and_seed():
    seen = []

    class Named:
        def reset(self, answer):  # no **kwargs: only the fields it names
            seen.append(answer)

    class Seeded:
        def reset(self, seed, **kwargs):
            seen.append(seed)

    class AnyFields:
        def reset(self, **kwargs):  # a seed only where reset names one
            seen.append(sorted(kwargs))

    environment_factory(Named)().reset({"prompt": "p", "answer": 4}, seed=1)
    environment_factory(Seeded)().reset({"prompt": "p"}, seed=2)
    environment_factory(Seeded)().reset({"prompt": "p", "seed": 9}, seed=2)  # the record's own seed wins
    environment_factory(AnyFields)().reset({"prompt": "p"}, seed=3)
    assert seen == [4, 2, 9, ["prompt"]]
    with pytest.raises(EnvironmentContractError, match="Named.*answer"):
        environment_factory(Named)().reset({"prompt": "p"}, seed=1)


def test_reset_must_return_text_or_none():
    class Bad:
        def reset(self, **kwargs):
            return 3

    with pytest.raises(EnvironmentContractError, match="Bad: reset\\(\\) must return a str or None, got 3"):
        environment_factory(Bad)().reset({"prompt": "p"}, 0)


def test_duplicate_tool_names():
    with pytest.raises(ValueError, match="'lookup'"):
        environment_factory(None, [lookup, lookup])


# --- the factory --------------------------------------------------------------------------------


def test_factory_probes_once_and_gives_a_fresh_instance_per_episode():
    made = []

    class Counted(IncrementEnv):
        def __init__(self):
            made.append(self)

    make = environment_factory(Counted)
    assert len(made) == 1
    envs = [make() for _ in range(3)]
    assert len(made) == 3 and [e.instance for e in envs] == made  # the probe served the first episode
    assert isinstance(envs[0], ToolEnvironment)


def test_factory_takes_a_zero_argument_callable():
    make = environment_factory(functools.partial(ArithmeticRetry, max_attempts=5))
    assert make.kind == "text" and make.name == "ArithmeticRetry" and make.tools == []
    env = make()
    assert isinstance(env, TextEnvironment) and env.instance.max_attempts == 5


def test_factory_errors():
    with pytest.raises(ValueError, match="give an environment.*or tools"):
        environment_factory()
    with pytest.raises(EnvironmentContractError, match="not an instance"):
        environment_factory(IncrementEnv())

    class NoReset:
        def act(self, x: int) -> int:
            """
            Act.

            Args:
                x: X.
            """
            return x

    with pytest.raises(ValueError, match="NoReset.*reset"):
        environment_factory(NoReset)
    with pytest.raises(ValueError, match="ArithmeticRetry.*text environment.*no tools"):
        environment_factory(ArithmeticRetry, [lookup])

    class Untyped:
        def reset(self, **kwargs):
            pass

        def act(self, x):
            return x

    with pytest.raises(ValueError, match="act"):
        environment_factory(Untyped)
    with pytest.raises(EnvironmentContractError, match="returned None"):
        environment_factory(lambda: None)


def test_an_environment_that_needs_arguments_or_a_method_is_a_contract_error():
    class NeedsArg:
        def __init__(self, size):
            self.size = size

        def reset(self, **kwargs):
            pass

    with pytest.raises(EnvironmentContractError, match=r"NeedsArg.__init__\(size\) needs arguments.*functools.partial"):
        environment_factory(NeedsArg)
    assert environment_factory(functools.partial(NeedsArg, 3))().instance.size == 3
    # `--env module:Cls.reset`: a method, not the class
    with pytest.raises(EnvironmentContractError, match=r"IncrementEnv.reset.*needs arguments.*not a method"):
        environment_factory(IncrementEnv.reset)


def add(a: int, b: int) -> int:
    """
    Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


@pytest.mark.parametrize("tools", [add, "add", {"add": add}, 3])
def test_tools_must_be_a_list_of_functions(tools):
    with pytest.raises(TypeError, match="tools must be a list of functions") as info:
        environment_factory(None, tools)
    assert not isinstance(info.value, EnvironmentContractError)
    if tools is add:
        assert "tools=[add]" in str(info.value)
        from pyppo.agents.build import make_agent_engine  # PPOTrainer(..., tools=add) comes this way

        with pytest.raises(TypeError, match=r"tools must be a list of functions \(tools=\[add\]\)"):
            make_agent_engine(None, None, None, add, None, None, None)
    assert [t["function"]["name"] for t in environment_factory(None, (add,)).tools] == ["add"]


def test_a_tool_named_step_makes_a_text_environment():
    class EchoLike:  # TRL's echo example names its tool `step`: here that is a text environment
        def reset(self, **kwargs) -> None:
            pass

        def step(self, message: str) -> str:
            """
            Echo a message.

            Args:
                message: The message.
            """
            return message

    env = environment_factory(EchoLike)()
    env.reset({"prompt": "p"}, 0)
    with pytest.raises(EnvironmentContractError, match="EchoLike.*rename it"):
        turn(env, "hello")


# --- text environments --------------------------------------------------------------------------


def scripted(returns):
    class Scripted:
        def __init__(self):
            self.actions = []

        def reset(self, **kwargs):
            return "Begin."

        def step(self, action):
            self.actions.append(action)
            return returns.pop(0)

    return Scripted


def test_text_environment_turns():
    make = environment_factory(
        scripted([("Go on.", 0.5, False), ("ignored", 1, False, {"info": 1}), (None, 2.0, True)])
    )
    env = make()
    assert env.reset({"prompt": "p"}, 0) == "Begin."
    assert turn(env, "a") == TurnResult(reply=[{"role": "user", "content": "Go on."}], reward=0.5)
    assert turn(env, "b") == TurnResult(reply=[{"role": "user", "content": "ignored"}], reward=1.0)
    assert turn(env, "c") == TurnResult(reward=2.0, done=True)
    assert env.instance.actions == ["a", "b", "c"]
    assert env.final_reward() is None and env.tools == []


def test_text_environment_gymnasium_five_tuple_and_async_step():
    env = environment_factory(scripted([("obs", 0.0, False, True, {})]))()
    assert turn(env, "a") == TurnResult(done=True)

    class Async:
        def reset(self, **kwargs):
            pass

        async def step(self, action):
            return "more", 1.0, False

    assert turn(environment_factory(Async)(), "a").reply == [{"role": "user", "content": "more"}]


@pytest.mark.parametrize(
    "returned, error, match",
    [
        ("just text", EnvironmentContractError, "Scripted.*step\\(\\) must return"),
        (("obs", 1.0), EnvironmentContractError, "Scripted.*\\('obs', 1.0\\)"),
        ({"observation": "o"}, EnvironmentContractError, "Scripted.*dict"),
        ((3, 1.0, False), EnvironmentContractError, "Scripted.*observation must be a str"),
        (("obs", "1", False), EnvironmentContractError, "Scripted.*reward must be a number"),
        (("obs", torch.tensor(0.5), False), EnvironmentContractError, "Scripted.*reward must be a number.*float"),
        (("obs", False, 1.0), EnvironmentContractError, "Scripted.*done must be a bool"),
        (("obs", 1.0, 1), EnvironmentContractError, "Scripted.*done must be a bool"),
        (("obs", 1.0, False, 0, {}), EnvironmentContractError, "Scripted.*truncated must be a bool.*got int 0"),
        (("obs", float("nan"), False), ValueError, "Scripted.*finite"),
        ((None, 0.0, False), ValueError, "Scripted.*observation None.*not done"),
    ],
)
def test_text_environment_contract_errors(returned, error, match):
    env = environment_factory(scripted([returned]))()
    with pytest.raises(error, match=match) as info:
        turn(env, "a")
    assert isinstance(info.value, TypeError) == (error is EnvironmentContractError)  # except TypeError still works


@pytest.mark.parametrize(
    "returned, done",
    [
        (("obs", 0.5, np.False_), False),
        ((None, 0.5, np.True_), True),
        (("obs", 0.5, np.False_, {}), False),
        (("obs", 0.5, np.False_, np.False_, {}), False),
        (("obs", 0.5, np.True_, np.False_, {}), True),
        (("obs", 0.5, np.False_, np.True_, {}), True),
        (("obs", np.float32(0.5), np.bool_(False)), False),
    ],
)
def test_text_environment_takes_numpy_booleans(returned, done):
    result = turn(environment_factory(scripted([returned]))(), "a")
    assert result.done is done and result.reward == 0.5 and type(result.done) is bool


def test_text_environment_needs_reset_and_step():
    class OnlyStep:
        def step(self, action):
            return None, 0.0, True

    with pytest.raises(ValueError, match="OnlyStep.*reset"):
        TextEnvironment(OnlyStep())
    with pytest.raises(ValueError, match="step"):
        TextEnvironment(IncrementEnv())


# --- the registry -------------------------------------------------------------------------------


def test_registry_by_name_module_and_file(tmp_path):
    assert set(BUILTIN_ENVIRONMENTS) == {"arithmetic-retry", "calculator", "guess-number"}
    for name, cls in BUILTIN_ENVIRONMENTS.items():
        assert load_environment(name) is cls
    assert load_environment("pyppo.agents.envs.calculator:Calculator") is Calculator
    path = tmp_path / "my_env.py"
    path.write_text(
        textwrap.dedent(
            """
            import dataclasses

            @dataclasses.dataclass
            class Inner:
                x: int = 0

            class Outer:
                Inner = Inner

            class MyEnv:
                def reset(self, **kwargs):
                    return "from a file"
            """
        )
    )
    cls = load_environment(f"{path}:MyEnv")
    assert cls.__name__ == "MyEnv" and load_environment(f"{path}:MyEnv") is cls  # imported once
    assert load_environment(f"{path}:Outer.Inner")().x == 0
    assert environment_factory(cls)().reset({"prompt": "p"}, 0) == "from a file"
    sys.modules.pop(cls.__module__, None)


@pytest.mark.parametrize(
    "spec, why",
    [
        ("no-such-env", "not a built-in"),
        ("no_such_module_xyz:Env", "no module named"),
        ("pyppo.agents.envs:NoSuchEnv", "no attribute"),
        ("pyppo.agents.envs.calculator:CALCULATOR_EVAL_SIZE", "not a class"),
        ("missing/file.py:Env", "no file"),
        (":Env", "not a built-in"),
        ("pyppo.agents.envs:", "not a built-in"),
        ("", "empty"),
    ],
)
def test_registry_errors(spec, why):
    with pytest.raises(ValueError) as info:
        load_environment(spec)
    message = str(info.value)
    assert message.startswith(f"--env {spec!r}") and why in message
    assert "module:Class" in message and "path/to/file.py:Class" in message
    assert all(name in message for name in BUILTIN_ENVIRONMENTS)


def test_registry_finds_a_module_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_env_mod.py").write_text("class HereEnv:\n    def reset(self, **kwargs):\n        return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        assert load_environment("cwd_env_mod:HereEnv").__name__ == "HereEnv"
    finally:
        sys.modules.pop("cwd_env_mod", None)


@pytest.mark.parametrize(
    "source, error, original",
    [
        ("class Broken\n    pass\n", ValueError, "SyntaxError: expected ':'"),
        ("raise RuntimeError('module-level boom')\n", ValueError, "RuntimeError: module-level boom"),
        ("import does_not_exist_pkg\n", ImportError, "No module named 'does_not_exist_pkg'"),
    ],
)
@pytest.mark.parametrize("as_module", [False, True])
def test_an_env_file_that_fails_to_import_is_named(source, error, original, as_module, tmp_path, monkeypatch):
    module = f"failing_env_{error.__name__.lower()}_{len(source)}"
    path = tmp_path / f"{module}.py"
    path.write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the registry adds the current directory
    spec = f"{module}:Env" if as_module else f"{path}:Env"
    try:
        with pytest.raises(error) as info:
            load_environment(spec)
    finally:
        sys.modules.pop(module, None)
    message = str(info.value)
    assert message.startswith(f"--env {spec!r}: importing ") and str(path) in message and original in message
    assert "\n" not in message


def test_declared_prompts_must_be_a_class_method_returning_records():
    class Good:
        @classmethod
        def default_prompts(cls):
            return [{"prompt": "p", "x": 1}]

    class Instance:
        def default_prompts(self):
            return [{"prompt": "p"}]

    class Strings:
        @classmethod
        def default_prompts(cls):
            return ["not", "records"]

    class NotAList:
        default_prompts = staticmethod(lambda: "p")

    assert (
        declared_prompts(Good) == [{"prompt": "p", "x": 1}] and declared_prompts(Good, "default_eval_prompts") is None
    )
    assert declared_prompts(functools.partial(Good)) is None  # a factory declares nothing
    for cls, why in ((Instance, "is an instance method"), (Strings, "returned str 'not'"), (NotAList, "returned str")):
        with pytest.raises(EnvironmentContractError, match=f"environment {cls.__qualname__}: default_prompts.*{why}"):
            declared_prompts(cls)


# --- built-in environments ----------------------------------------------------------------------


CALCULATOR_REWARD = "pyppo.agents.envs.calculator:final_answer_reward"


def test_builtins_declare_prompts_and_reward():
    for cls in BUILTIN_ENVIRONMENTS.values():
        assert cls.default_reward in (None, CALCULATOR_REWARD) and cls.__doc__ and "Reward" in cls.__doc__
        for records in (cls.default_prompts(), cls.default_eval_prompts()):
            assert records and all(isinstance(r["prompt"], str) for r in records)
        train = {json.dumps(r, sort_keys=True) for r in cls.default_prompts()}
        assert not train & {json.dumps(r, sort_keys=True) for r in cls.default_eval_prompts()}
    assert Calculator.default_reward == CALCULATOR_REWARD
    assert ArithmeticRetry.default_reward is None and GuessNumber.default_reward is None


def start(cls, record, seed=0, **kwargs):
    env = environment_factory(functools.partial(cls, **kwargs))()
    env.reset(record, seed)
    return env


def test_arithmetic_retry_right_answer():
    record = arithmetic_prompts("train")[0]
    assert ArithmeticRetry.default_prompts() == arithmetic_prompts("train")
    assert ArithmeticRetry.default_eval_prompts() == arithmetic_prompts("eval")
    env = start(ArithmeticRetry, record)
    assert turn(env, f"The answer is {record['answer']}.") == TurnResult(reward=1.0, done=True)


def test_arithmetic_retry_wrong_then_right():
    env = start(ArithmeticRetry, {"prompt": "What is 7 + 12?", "answer": "19"})
    first = turn(env, "It is 20.")
    assert first.reply == [{"role": "user", "content": "That is not right. Try again (two attempts left)."}]
    assert (first.reward, first.done) == (0.0, False)
    assert not any(c.isdigit() for c in first.reply[0]["content"])  # no number for the answer to echo
    assert turn(env, "Sorry: 19") == TurnResult(reward=1.0, done=True)


def test_arithmetic_retry_runs_out_of_attempts():
    env = start(ArithmeticRetry, {"prompt": "What is 7 + 12?", "answer": "19"}, max_attempts=3)
    assert not turn(env, "20").done
    second = turn(env, "no idea")
    assert second.reply[0]["content"].endswith("(one attempt left).") and not second.done
    assert turn(env, "21") == TurnResult(reward=0.0, done=True)
    with pytest.raises(ValueError, match="max_attempts"):
        ArithmeticRetry(max_attempts=0)


def test_calculator_tool_good_and_bad_expressions():
    record = {"prompt": "What is 347 * 28? ...", "answer": "9716"}
    env = start(Calculator, record)
    result = turn(env, call("calculate", expression="347 * 28") + call("calculate", expression="__import__('os')"))
    assert (result.tool_calls, result.tool_errors, result.done) == (2, 1, False)
    assert result.reply[0] == {"role": "tool", "name": "calculate", "content": "9716"}
    assert result.reply[1]["content"].startswith("Error: calculate raised ValueError")
    final = "The answer is 9716."
    assert turn(env, final) == TurnResult(done=True) and env.final_reward() is None
    transcript = "\n".join(["<tool_call>...</tool_call>", result.reply[0]["content"], final])
    assert math_reward([record["prompt"]], [transcript], [record["answer"]]) == [1.0]


@pytest.mark.parametrize(
    "expression, value",
    [("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("-4 - -6", "2"), ("1,234 + 1", "1235"),
     ("12 x 3", "36"), ("1 / 3", "0.333333333333"), ("2.5 * 4", "10")],
)  # fmt: skip
def test_calculate_values(expression, value):
    assert Calculator().calculate(expression) == value


@pytest.mark.parametrize(
    "expression, error",
    [("2 ** 10", ValueError), ("abs(-1)", ValueError), ("x", ValueError), ("1 +", ValueError), ("", ValueError),
     ("1 / (2 - 2)", ZeroDivisionError), ("1" * 201, ValueError), ("'a' + 'b'", ValueError), ("[1][0]", ValueError)],
)  # fmt: skip
def test_calculate_refuses(expression, error):
    with pytest.raises(error):
        evaluate_expression(expression)
    with pytest.raises(TypeError):
        evaluate_expression(3)


def test_calculator_prompts_are_deterministic_disjoint_and_right():
    train, held_out = calculator_prompts("train"), calculator_prompts("eval")
    assert train == calculator_prompts("train") and len(held_out) == 64 and len(train) > 1000
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert calculator_prompts("eval", seed=1) != held_out
    for record in train[:50] + held_out:
        expression = record["prompt"].removeprefix("What is ").split("?")[0]
        assert str(evaluate_expression(expression)) == record["answer"]
    with pytest.raises(ValueError, match="split"):
        calculator_prompts("test")


def binary_search(env, low, high):
    """A scripted policy: guesses the middle of what the feedback leaves; the number of guesses."""
    for k in range(1, 100):
        guess = (low + high) // 2
        result = turn(env, f"My guess is {guess}.")
        if result.done:
            return k if result.reward == 1.0 else None
        feedback = result.reply[0]["content"]
        low, high = (guess + 1, high) if feedback.startswith("Higher") else (low, guess - 1)
    return None


def test_guess_number_binary_search_always_wins():
    records = GuessNumber.default_prompts() + GuessNumber.default_eval_prompts()
    for record in {(r["low"], r["high"]): r for r in records}.values():
        secrets = set()
        for seed in range(60):
            env = start(GuessNumber, record, seed)
            secrets.add(env.instance.secret)
            assert record["low"] <= env.instance.secret <= record["high"]
            guesses = binary_search(env, record["low"], record["high"])
            assert guesses is not None and guesses <= 6, (record, seed)
        assert len(secrets) > 1  # the seed picks the secret


def test_guess_number_feedback_and_limits():
    record = {"prompt": "p", "low": 1, "high": 10}
    a, b = start(GuessNumber, record, 5), start(GuessNumber, record, 5)
    assert a.instance.secret == b.instance.secret  # one group, one secret
    secret = a.instance.secret
    unparsable = turn(a, "hmm, maybe two point five: 2.5?")
    assert unparsable.reply[0]["content"].startswith("Answer with a single whole number between 1 and 10.")
    wrong = 1 if secret != 1 else 2
    assert turn(a, str(wrong)).reply[0]["content"].startswith("Higher" if secret > wrong else "Lower")
    env = start(GuessNumber, record, 5, max_guesses=2)
    assert not turn(env, str(wrong)).done
    assert turn(env, str(wrong)) == TurnResult(reward=0.0, done=True)
    assert turn(start(GuessNumber, record, 5), f"I say {secret}") == TurnResult(reward=1.0, done=True)
    with pytest.raises(ValueError, match="low"):
        start(GuessNumber, {"prompt": "p", "low": 5, "high": 1})


def test_built_in_environments_through_the_tool_parser():
    # Parser built by hand, as the factory would: a ToolEnvironment is usable directly.
    env = ToolEnvironment(Calculator(), [], ToolCallParser(None))
    env.reset({"prompt": "p", "answer": "2"}, 0)
    assert turn(env, call("calculate", expression="1 + 1")).reply[0]["content"] == "2"
    assert math.isclose(float(turn(env, call("calculate", expression="1/8")).reply[0]["content"]), 0.125)


def test_a_text_environments_get_reward_is_said_to_be_unused():
    class TextWithGetReward:
        def reset(self, **row):
            return None

        def step(self, action):
            return None, 0.0, True

        def get_reward(self):
            return 1.0

    with pytest.warns(UserWarning, match="TextWithGetReward is a text environment .* get_reward is never called"):
        factory = environment_factory(TextWithGetReward)
    assert factory.kind == "text"
