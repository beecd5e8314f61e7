"""``arithmetic-retry``: the built-in arithmetic problems, with retries after a wrong answer."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ...math_reward import answers_match, extract_answer
from ...prompts import arithmetic_prompts

__all__ = ["ArithmeticRetry"]


_LEFT = {1: "one attempt", 2: "two attempts", 3: "three attempts", 4: "four attempts", 5: "five attempts"}


class ArithmeticRetry:
    """A text environment (``reset(**row)``, ``step(action) -> (observation, reward, done)``) over
    :func:`pyppo.prompts.arithmetic_prompts`: the agent answers, and after a wrong answer is told
    so and may try again, up to ``max_attempts`` answers in all.

    Reward, paid on the turn that ends the episode: 1.0 for the first right answer (its
    :func:`~pyppo.math_reward.extract_answer` matches the record's ``answer`` by
    :func:`~pyppo.math_reward.answers_match`), which ends the episode; 0.0 for each wrong answer,
    and the episode ends at 0.0 once ``max_attempts`` answers were wrong. Every reply is an answer:
    one with no number in it is a wrong one. There is no discount per attempt: a right answer pays
    1.0 on any attempt, and the preference for an early one comes only from the trainer's ``gamma``
    (below 1) or a length penalty, when configured.

    Prompt records: ``{"prompt": "What is 7 + 12? Give the answer as a number.", "answer": "19"}``,
    :meth:`default_prompts` (the ``arithmetic`` train split) and :meth:`default_eval_prompts`
    (the held-out split).

    Args:
        max_attempts: answers allowed per episode (>= 1).

    Raises:
        ValueError: ``max_attempts`` < 1.
    """

    #: Pays itself through step: no reward function is needed.
    default_reward: Optional[str] = None

    # Class methods, so that TRL's rule (functions on the class are tools) never sees them.
    @classmethod
    def default_prompts(cls) -> List[dict]:
        """The training prompt records: ``arithmetic_prompts("train")``."""
        return arithmetic_prompts("train")

    @classmethod
    def default_eval_prompts(cls) -> List[dict]:
        """The held-out prompt records: ``arithmetic_prompts("eval")``."""
        return arithmetic_prompts("eval")

    def __init__(self, max_attempts: int = 3):
        if int(max_attempts) < 1:
            raise ValueError(f"ArithmeticRetry: max_attempts must be >= 1, got {max_attempts}")
        self.max_attempts = int(max_attempts)
        self.answer: Any = None
        self.attempts = 0

    def reset(self, answer: Any, **kwargs: Any) -> None:
        """Starts a problem whose right answer is ``answer`` (the record's field)."""
        self.answer = answer
        self.attempts = 0

    def step(self, action: str) -> Tuple[Optional[str], float, bool]:
        """Checks the answer in ``action``: ``(None, 1.0, True)`` when right; when wrong, ``(hint,
        0.0, False)`` while attempts remain, else ``(None, 0.0, True)``."""
        self.attempts += 1
        if answers_match(extract_answer(action), self.answer):
            return None, 1.0, True
        left = self.max_attempts - self.attempts
        if left <= 0:
            return None, 0.0, True
        # No digits in the hint: the answer is read as the reply's last number, and a model that
        # echoed "2 attempts left" would be paid whenever the answer is 2.
        return f"That is not right. Try again ({_LEFT.get(left, 'more')} left).", 0.0, False
