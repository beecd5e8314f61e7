"""A text environment for the ``pyppo train --env FILE:Echo`` runs: numbers drawn from the
episode's seed, so a resumed run sees the episodes an uninterrupted one sees."""

import random


class Echo:
    """Replies with a number drawn from its seed; done on the third turn; pays 0.1 per turn
    and 1 when the last reply's number appears in the agent's text."""

    def reset(self, seed, **row):
        self.rng, self.n = random.Random(seed), 0

    def step(self, action):
        self.n += 1
        self.secret = self.rng.randint(0, 9)
        if self.n == 3:
            return None, 0.1 + float(str(self.secret) in action), True
        return f"Say {self.secret}.", 0.1, False
