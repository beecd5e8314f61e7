"""``guess-number``: guess a secret number from "higher" / "lower" feedback."""

from __future__ import annotations

import hashlib
import re
from typing import Any, List, Optional, Tuple

__all__ = ["GuessNumber"]

# A whole number, not part of a word or a decimal ("2.5" holds none).
_INTEGER = re.compile(r"(?<![\w.])-?\d+(?!\d|\.\d)")

_TRAIN_RANGES = [(1, 10), (1, 20), (1, 30), (1, 50)]
_EVAL_RANGES = [(1, 15), (1, 40), (1, 60)]
_PHRASINGS = [
    "I am thinking of a whole number between {low} and {high}. Guess it! Answer each turn with one number; "
    "I will tell you whether my number is higher or lower. You have {n} guesses.",
    "Let's play a game: find my secret number. It is between {low} and {high}, inclusive. After each guess "
    "I say 'higher' or 'lower'. Reply with just your guess. You have {n} guesses.",
    "Guess the secret number between {low} and {high}. Reply with a single number each turn and use my "
    "higher/lower hints. You have {n} guesses.",
]


def _records(ranges: List[Tuple[int, int]], max_guesses: int) -> List[dict]:
    return [
        {"prompt": phrasing.format(low=low, high=high, n=max_guesses), "low": low, "high": high}
        for low, high in ranges
        for phrasing in _PHRASINGS
    ]


class GuessNumber:
    """A text environment (``reset(**row, seed)``, ``step(action) -> (observation, reward, done)``):
    the agent guesses a secret integer in ``[low, high]``, told "higher" or "lower" after each guess.

    The secret is drawn from the episode's ``seed`` (and ``low``, ``high``) by a hash, so the
    samples of one prompt record share it. A guess is the last integer in the agent's reply; a
    reply without one is told to answer with a number and still uses up a guess.

    Reward, paid on the turn that ends the episode: 1.0 when a guess equals the secret (which ends
    the episode), 0.0 on every other turn; the episode ends at 0.0 after ``max_guesses`` guesses
    without it. No discount per guess: the trainer's ``gamma`` (below 1) or a length penalty, when
    configured, prefers fewer guesses. Binary search wins within ``max_guesses`` whenever ``high -
    low + 1 <= 2**max_guesses - 1``, true of every default range (``1..50`` at most in training,
    ``1..60`` held out) with the default 6 guesses.

    Prompt records: ``{"prompt": "...", "low": 1, "high": 20}``; :meth:`default_prompts` and
    :meth:`default_eval_prompts` (other ranges).

    Args:
        max_guesses: guesses per episode (>= 1).

    Raises:
        ValueError: ``max_guesses`` < 1; at reset, ``low > high``.
    """

    #: Pays itself through step: no reward function is needed.
    default_reward: Optional[str] = None

    # Class methods, so that TRL's rule (functions on the class are tools) never sees them.
    @classmethod
    def default_prompts(cls) -> List[dict]:
        """Training prompt records: ranges 1..10, 1..20, 1..30, 1..50, three phrasings each."""
        return _records(_TRAIN_RANGES, 6)

    @classmethod
    def default_eval_prompts(cls) -> List[dict]:
        """Held-out prompt records: ranges 1..15, 1..40, 1..60, three phrasings each."""
        return _records(_EVAL_RANGES, 6)

    def __init__(self, max_guesses: int = 6):
        if int(max_guesses) < 1:
            raise ValueError(f"GuessNumber: max_guesses must be >= 1, got {max_guesses}")
        self.max_guesses = int(max_guesses)
        self.low, self.high, self.secret, self.guesses = 1, 100, 1, 0

    def reset(self, low: int = 1, high: int = 100, seed: int = 0, **kwargs: Any) -> None:
        """Draws the secret in ``[low, high]`` from ``seed``."""
        low, high = int(low), int(high)
        if low > high:
            raise ValueError(f"GuessNumber: low ({low}) must not exceed high ({high})")
        digest = hashlib.sha256(f"guess-number:{int(seed)}:{low}:{high}".encode()).digest()
        self.low, self.high, self.guesses = low, high, 0
        self.secret = low + int.from_bytes(digest[:8], "big") % (high - low + 1)

    def step(self, action: str) -> Tuple[Optional[str], float, bool]:
        """Judges the guess in ``action``: ``(None, 1.0, True)`` when right, else the feedback
        (``(None, 0.0, True)`` once the guesses are used up)."""
        self.guesses += 1
        found = _INTEGER.findall(action)
        guess = int(found[-1]) if found else None
        if guess == self.secret:
            return None, 1.0, True
        left = self.max_guesses - self.guesses
        if left <= 0:
            return None, 0.0, True
        remaining = f"{left} guess{'es' if left > 1 else ''} left."
        if guess is None:
            return f"Answer with a single whole number between {self.low} and {self.high}. {remaining}", 0.0, False
        hint = "Higher" if self.secret > guess else "Lower"
        return f"{hint}. {remaining}", 0.0, False
