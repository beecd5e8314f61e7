"""The built-in ``math`` reward (``--reward math``): 1.0 when a response's final answer equals the
prompt's ``answer`` field, else 0.0.

The final answer is the content of the response's last ``\\boxed{...}`` (nested braces included),
or, without one, the last number in the text: ``12``, ``-3``, ``2.50``, ``1,234``, ``3/4``,
``5e3`` (a sentence's closing period is not part of it). It equals the answer when both are
numbers of the same value, compared exactly as fractions (``2.50 == 2.5``, ``6/8 == 3/4``,
``0.75 == 3/4``, ``\\frac34 == 3/4``, ``5e3 == 5000``), and otherwise when both are the same
string once stripped of surrounding space. An empty box is no answer, and an empty or missing
reference answer (``""``, ``null``) matches nothing. Rule-based and deterministic: no model, no
tolerance.
"""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction
from typing import Any, Optional, Sequence

__all__ = ["answers_match", "extract_answer", "math_reward", "parse_number"]

_BOXED = re.compile(r"\\boxed\s*\{")

# A number inside text. A minus sign counts only where it cannot be a subtraction: "15-8" is 15
# and 8, "x = -3" is -3. Thousands groups are exactly three digits ("1,234" is one number, "1,23"
# two), and a list such as "1,234, 5" keeps its comma; a decimal point needs a digit after it.
_NUMBER_IN_TEXT = re.compile(
    r"(?:(?<![\w)\]])-)?"
    r"(?:\d+/\d+(?!\d)"  # 3/4
    r"|\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!,?\d)"  # 1,234 and 1,234.5
    r"|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"  # 12, 2.50 and 5e3 (one number, not 5 and 3)
)

# A whole string that is one number (the same forms, a sign, and ".5").
_NUMBER = re.compile(r"[+-]?(?:\d+/\d+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?)")

#: The largest power of ten an exponent may give: ``1e999999999`` would be a billion-digit integer.
_MAX_EXPONENT = 1000

# \frac{3}{4}, and LaTeX's one-token arguments: \frac34, \frac3{4}, \frac{3}4 (\frac345 is 3/4
# followed by 5, not a number). Replaced by " 3/4 ", so that a digit around it ("2\frac12", a
# mixed number) keeps the whole from reading as one number.
_TEX_FRACTION = re.compile(r"([+-]?)\s*\\[dt]?frac\s*(?:\{\s*(\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))")


def _plain_fraction(match: re.Match) -> str:
    sign, num, num_digit, den, den_digit = match.groups()
    return f" {sign}{num or num_digit}/{den or den_digit} "


def parse_number(text: str) -> Optional[Fraction]:
    """The exact value of ``text`` when it is one number, else None.

    Accepts an optional sign, integers, decimals, thousands separators (``1,234.5``), an exponent
    (``5e3``, ``2.5E-3``: exact, up to ``e±1000``), fractions (``3/4``, ``\\frac{3}{4}``,
    ``\\frac34``), a surrounding ``$ ... $`` and a trailing period; a zero denominator is not a
    number.
    """
    s = _TEX_FRACTION.sub(_plain_fraction, text.replace("\u2212", "-")).strip().strip("$").strip()
    s = s[:-1].rstrip() if s.endswith(".") else s
    if not _NUMBER.fullmatch(s):
        return None
    exponent = s.lower().partition("e")[2]
    if exponent and abs(int(exponent)) > _MAX_EXPONENT:
        return None
    try:
        return Fraction(s.replace(",", ""))
    except ZeroDivisionError:
        return None


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` whose braces close, or None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for i in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[match.end() : i]
    return None


def extract_answer(response: str) -> Optional[str]:
    """A response's final answer: the stripped content of its last ``\\boxed{...}`` (None when
    that box is empty: the response's final answer holds nothing), else its last number (as
    written, e.g. ``"1,234"``), else None."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed.strip() or None
    numbers_found = _NUMBER_IN_TEXT.findall(response.replace("\u2212", "-"))
    return numbers_found[-1] if numbers_found else None


def _answer_value(answer: Any) -> Optional[Fraction]:
    if isinstance(answer, str):
        return parse_number(answer)
    if isinstance(answer, bool):  # JSON true/false: not a number
        return None
    if isinstance(answer, numbers.Integral):
        return Fraction(int(answer))
    if isinstance(answer, numbers.Real) and math.isfinite(answer):
        return Fraction(str(float(answer)))  # 2.5 as written in the JSON, not its binary expansion
    return None


def _missing(answer: Any) -> bool:
    if isinstance(answer, str):
        return not answer.strip()
    return answer is None or (isinstance(answer, numbers.Real) and not math.isfinite(answer))


def answers_match(predicted: Optional[str], answer: Any) -> bool:
    """Whether an extracted answer equals the reference ``answer`` (a string or a JSON number):
    as exact numbers when both parse as one (:func:`parse_number`), else as stripped strings;
    never when nothing (or only space) was extracted, nor for a reference that is missing:
    ``None`` (JSON ``null``), only space, or a NaN or infinite number."""
    if predicted is None or not predicted.strip() or _missing(answer):
        return False
    expected, got = _answer_value(answer), parse_number(predicted)
    if expected is not None and got is not None:
        return expected == got
    return predicted.strip() == str(answer).strip()


def math_reward(prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any]) -> list[float]:
    """1.0 for each response whose final answer (:func:`extract_answer`) equals its prompt's
    ``answer`` (:func:`answers_match`), else 0.0 (no answer found included).

    Args:
        prompts: ``B`` prompt strings (unused, kept for the reward signature).
        responses: ``B`` response strings.
        answer: ``B`` reference answers, the prompts' ``answer`` field: strings or numbers.

    Raises:
        ValueError: ``answer`` and ``responses`` differ in length.
    """
    if len(answer) != len(responses):
        raise ValueError(f"math_reward: {len(answer)} answers for {len(responses)} responses")
    return [1.0 if answers_match(extract_answer(r), a) else 0.0 for r, a in zip(responses, answer)]
