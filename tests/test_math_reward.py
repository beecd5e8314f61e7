"""pyppo.math_reward: the final answer of a response, its comparison with the prompt's answer, and
``--reward math``."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from pyppo.math_reward import answers_match, extract_answer, math_reward, parse_number
from pyppo.prompts import arithmetic_prompts
from pyppo.rewards import RewardError, check_reward_fields, load_reward, score_responses


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is \\boxed{19}.", "19"),
        ("\\boxed{3} at first, then \\boxed{ 4 } finally", "4"),  # the last box counts
        ("So x = \\boxed{\\frac{3}{4}} and that is 2.", "\\frac{3}{4}"),  # nested braces; a box beats numbers
        ("\\boxed{{a}+{b}}", "{a}+{b}"),
        ("\\boxed{7} then a cut-off \\boxed{12", "7"),  # an unclosed box is no box
        ("\\boxed{12 with no close, and 5 later", "5"),  # ... nor is the only one
        ("7 + 12 = 19", "19"),  # several numbers: the last
        ("It is 19.", "19"),  # a closing period is not a decimal
        ("The result is -3.", "-3"),
        ("15-8 is 7, and 8-15", "15"),  # a minus between numbers subtracts
        ("x=-3", "-3"),
        ("(-4)", "-4"),
        ("about 2.50 dollars", "2.50"),
        ("a total of 1,234 apples", "1,234"),
        ("1,234,567", "1,234,567"),
        ("it costs 1,234, I think", "1,234"),
        ("pick 1,23", "23"),  # not a thousands group
        ("half: 3/4", "3/4"),
        ("minus \u22125", "-5"),  # the Unicode minus sign
        ("so 5e3 apples", "5e3"),  # one number with its exponent, not 5 and 3
        ("x=-2.5E-1", "-2.5E-1"),
        ("\\boxed{}", None),  # an empty box is no answer ...
        ("12, so \\boxed{ }", None),  # ... also after a number
        ("\\boxed{\\frac34}", "\\frac34"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    "text, value",
    [
        ("12", Fraction(12)),
        (" -3 ", Fraction(-3)),
        ("+3", Fraction(3)),
        ("2.50", Fraction(5, 2)),
        (".5", Fraction(1, 2)),
        ("1,234.5", Fraction(2469, 2)),
        ("3/4", Fraction(3, 4)),
        ("-6/8", Fraction(-3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{1}{2}", Fraction(-1, 2)),
        ("$12$", Fraction(12)),
        ("19.", Fraction(19)),
        ("0.1", Fraction(1, 10)),  # exact, not the float nearest 0.1
        ("\\frac34", Fraction(3, 4)),  # LaTeX's one-token arguments
        ("\\frac3{4}", Fraction(3, 4)),
        ("\\tfrac{3}4", Fraction(3, 4)),
        ("- \\frac12", Fraction(-1, 2)),
        ("$\\frac{12}{16}$", Fraction(3, 4)),
        ("5e3", Fraction(5000)),  # exact
        ("2.5E-3", Fraction(1, 400)),
        ("-.5e1", Fraction(-5)),
        ("1e1000", Fraction(10**1000)),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text",
    [
        *("", "x = 5", "5 apples", "1/0", "1,23", "1.2.3", "3/", "--3", "nan", "inf"),
        *("\\frac345", "2\\frac12", "\\frac{1}{2}3"),  # 3/4 then 5; a mixed number; 1/2 then 3
        *("5e", "e3", "1,234e3", "1e1001", "1e-1001"),  # an exponent beyond 1000: a 1000-digit value
    ],
)
def test_parse_number_refuses(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "predicted, answer, match",
    [
        ("2.50", "2.5", True),
        ("2.5", 2.5, True),  # a JSON float answer
        ("5", 5, True),  # a JSON int answer
        ("5.0", 5, True),
        ("6/8", "3/4", True),
        ("0.75", "3/4", True),
        ("\\frac{3}{4}", "0.75", True),
        ("1,234", "1234", True),
        ("-3", "-3", True),
        ("3", "-3", False),
        ("0.3333", "1/3", False),  # exact: no tolerance
        ("5", "6", False),
        ("5", True, False),  # JSON true is not the number 1... nor the string "5"
        ("Paris", " Paris ", True),  # not numbers: stripped strings
        ("paris", "Paris", False),
        ("x = 5", "5", False),  # the box's content is the answer as a whole
        (None, "5", False),  # nothing extracted
        ("\\frac34", "0.75", True),
        ("5e3", 5000, True),
        ("5000", "5e3", True),
        ("", "", False),  # an empty answer matches nothing ...
        (" ", " ", False),
        ("None", None, False),  # ... nor does a missing one (JSON null)
        ("nan", float("nan"), False),
        ("inf", float("inf"), False),
    ],
)
def test_answers_match(predicted, answer, match):
    assert answers_match(predicted, answer) is match


def test_math_reward_scores():
    prompts = ["What is 7 + 5? Give the answer as a number."] * 8
    responses = [
        "7 + 5 = 12.",  # right
        "The answer is \\boxed{12}",  # right, boxed
        "\\boxed{12} ... or maybe 13",  # a box beats a later number
        "7 + 5",  # only repeats the question's numbers
        "I think it is 13.",  # wrong
        "twelve",  # no number
        "It's 12, no wait, 11",  # the last number counts
        "12.00",  # the same value
    ]
    assert math_reward(prompts, responses, ["12"] * 8) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert math_reward(prompts[:2], responses[:2], [12, 12.0]) == [1.0, 1.0]  # numbers from JSON
    # An empty box never matches an empty or missing answer; \frac34 and 5e3 are numbers.
    edge = ["\\boxed{}", "\\boxed{ }", "\\boxed{None}", "\\boxed{\\frac34}", "about 5e3 of them", "5e3"]
    assert math_reward(["q"] * 6, edge, ["", " ", None, "0.75", 5000, "3"]) == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="1 answers for 2 responses"):
        math_reward(prompts[:2], responses[:2], ["12"])


def test_load_reward_math_takes_the_answer_field():
    fn = load_reward("math")
    assert fn.reward_name == "math"
    assert check_reward_fields(fn, ["answer", "id"]) == ["answer"]
    scores = score_responses(
        fn,
        ["q1", "q2", "q3"],
        ["so \\boxed{3/4}", "-2", "I don't know"],
        where="step 1",
        fields={"answer": ["0.75", -2, "1"], "id": [1, 2, 3]},
    )
    assert scores == [1.0, 1.0, 0.0]
    with pytest.raises(
        RewardError,
        match=r"reward 'math' needs the prompt field 'answer', missing from the prompts, "
        r"whose fields besides \"prompt\" are: 'id' \(step 1\)",
    ):
        score_responses(fn, ["q"], ["1"], where="step 1", fields={"id": [1]})


def test_math_reward_scores_the_arithmetic_sets_own_answers():
    for split in ("train", "eval"):
        records = arithmetic_prompts(split)
        prompts = [r["prompt"] for r in records]
        answers = [r["answer"] for r in records]
        assert math_reward(prompts, answers, answers) == [1.0] * len(records)
        # A response that only repeats the question scores 0, unless its last number is the
        # answer (a - b with a = 2b).
        echoes = [p.removesuffix(" Give the answer as a number.") for p in prompts]
        expected = [
            1.0 if re.fullmatch(r"What is \d+ [+-] (\d+)\?", e).group(1) == a else 0.0 for e, a in zip(echoes, answers)
        ]
        assert math_reward(prompts, echoes, answers) == expected
        assert sum(expected) < len(records) / 10
