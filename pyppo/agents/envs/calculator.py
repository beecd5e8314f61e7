"""``calculator``: larger arithmetic, with a calculator tool (TRL's environment convention)."""

from __future__ import annotations

import ast
import hashlib
import re
from fractions import Fraction
from typing import Any, List, Optional

__all__ = ["CALCULATOR_EVAL_SIZE", "Calculator", "calculator_prompts", "evaluate_expression", "final_answer_reward"]

#: Problems the ``eval`` split holds back from ``train``.
CALCULATOR_EVAL_SIZE = 64
_POOL_SIZE = 1200
_MAX_EXPRESSION_CHARS = 200

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers (``12``, ``2.5``, ``1,234``), ``+ - *
    /`` (``x``/``×`` and ``÷`` too), unary signs and parentheses. Parsed with :mod:`ast`, never
    ``eval``: anything else (names, calls, powers, ...) is refused.

    Raises:
        TypeError: ``expression`` is not a str.
        ValueError: it is empty, longer than 200 characters, does not parse, or uses anything else.
        ZeroDivisionError: a division by zero.
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    text = _THOUSANDS.sub("", expression.strip().replace("×", "*").replace("÷", "/"))
    text = re.sub(r"(?<=[\d)\s])[xX](?=[\d(\s])", "*", text)
    if not text:
        raise ValueError("the expression is empty")
    if len(text) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise ZeroDivisionError("division by zero")
        return left / right
    raise ValueError("only numbers, + - * /, and parentheses are allowed")


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:  # a terminating decimal: written exactly
        return format(value.numerator / value.denominator, ".15g")
    return format(float(value), ".12g")


def _problem(i: int) -> tuple:
    h = hashlib.sha256(f"calculator:{i}".encode()).digest()
    kind = h[0] % 3
    x, y = int.from_bytes(h[1:9], "big"), int.from_bytes(h[9:17], "big")
    if kind == 0:  # 4-digit + 4-digit
        return (1000 + x % 9000, "+", 1000 + y % 9000)
    if kind == 1:  # 3-digit * 2-digit
        return (100 + x % 900, "*", 10 + y % 90)
    return (1000 + x % 9000, "-", 100 + y % 900)  # 4-digit - 3-digit


def calculator_prompts(split: str = "train", *, seed: int = 0) -> List[dict]:
    """The calculator problems: ``{"prompt": "What is 4821 + 7390? ...", "answer": "12211"}``.

    1200 problems drawn by hashing their index (the same on every machine and Python version):
    sums of two 4-digit numbers, products of a 3-digit and a 2-digit number, differences of a
    4-digit and a 3-digit number. ``"eval"`` is :data:`CALCULATOR_EVAL_SIZE` of them, chosen by a
    hash of ``seed`` and the question; ``"train"`` is the rest (disjoint).

    Raises:
        ValueError: an unknown split.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"calculator_prompts: split must be 'train' or 'eval', got {split!r}")
    problems = list(dict.fromkeys(_problem(i) for i in range(_POOL_SIZE)))

    def question(a: int, op: str, b: int) -> str:
        return f"What is {a} {op} {b}? You can use the calculate tool to compute it. Give the final answer as a number."

    def rank(problem: tuple) -> bytes:
        return hashlib.sha256(f"{seed}:{question(*problem)}".encode()).digest()

    held_out = set(sorted(problems, key=rank)[:CALCULATOR_EVAL_SIZE])
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    return [
        {"prompt": question(a, op, b), "answer": str(ops[op](a, b))}
        for a, op, b in problems
        if ((a, op, b) in held_out) == (split == "eval")
    ]


def final_answer_reward(
    prompts: List[str], responses: List[str], answer: List[Any], transcript: List[List[dict]]
) -> List[float]:
    """The ``math`` reward of each episode's last agent turn only: 1.0 when its last number (or
    ``\\boxed{}``) equals the record's ``answer``, else 0.0 (:func:`pyppo.math_reward.math_reward`).
    The whole transcript would also hold the tool's replies, and an agent that called the tool
    and then never answered would be paid for the tool's number.

    Args:
        prompts, responses: the episodes' prompts and transcripts (unused: the turns are read
            from ``transcript``). answer: ``B`` reference answers.
        transcript: ``B`` episode transcripts (``[{"role", "turn", "text"}, ...]``).
    """
    from ...math_reward import math_reward

    finals = [next((t["text"] for t in reversed(turns) if t["role"] == "agent"), "") for turns in transcript]
    return math_reward(prompts, finals, answer)


class Calculator:
    """A tool environment in TRL's ``environment_factory`` convention: ``reset(**row)`` and one
    tool, :meth:`calculate`.

    Reward: the environment pays nothing itself (no ``get_reward``); :attr:`default_reward` is
    :func:`final_answer_reward`: 1.0 when the last number (or ``\\boxed{}``) of the agent's
    final turn equals the record's ``answer``, else 0.0. Tool calls cost nothing.

    Prompt records: :meth:`default_prompts` / :meth:`default_eval_prompts`
    (:func:`calculator_prompts`).
    """

    #: The reward that scores the episode: the ``math`` reward of its last agent turn.
    default_reward: Optional[str] = "pyppo.agents.envs.calculator:final_answer_reward"

    # Class methods, so that TRL's rule (functions on the class are tools) never sees them.
    @classmethod
    def default_prompts(cls) -> List[dict]:
        """The training prompt records: ``calculator_prompts("train")``."""
        return calculator_prompts("train")

    @classmethod
    def default_eval_prompts(cls) -> List[dict]:
        """The held-out prompt records: ``calculator_prompts("eval")``."""
        return calculator_prompts("eval")

    def reset(self, **kwargs: Any) -> None:
        """Nothing to set up: the calculator has no state."""
        return None

    def calculate(self, expression: str) -> str:
        """
        Evaluate an arithmetic expression with numbers, +, -, *, / and parentheses.

        Args:
            expression: The expression to evaluate, for example "(12 + 30) * 7 / 2".

        Returns:
            The exact value of the expression, as a number.
        """
        return _format(evaluate_expression(expression))
