"""A scripted rollout engine and a text environment for the multi-turn tests."""

from __future__ import annotations

from pyppo.rollout.engine import RolloutEngine


class Scripted(RolloutEngine):
    """Samples a fixed list of turns, one per call, the same for every episode; records the
    contexts it was asked to continue."""

    def __init__(self, turns):
        self.turns, self.calls = [list(t) for t in turns], []

    def sample_continuations(self, sequences, max_new_tokens):
        turn = self.turns[min(len(self.calls), len(self.turns) - 1)]
        self.calls.append([list(s) for s in sequences])
        return [(turn[:max_new_tokens], None) for _ in sequences]


class Replies:
    """A text environment: replies on turns 1 and 2, done on turn 3; pays :attr:`pay` per turn."""

    pay = (0.25, 0.5, 1.0)

    def reset(self, **row):
        self.n = 0

    def step(self, action):
        self.n += 1
        if self.n == 3:
            return None, self.pay[2], True
        return f"Reply {self.n}: try again.", self.pay[self.n - 1], False
