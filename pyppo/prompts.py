"""Prompt sets (the built-in default and ``.jsonl`` files) and the seeded order they are sampled in.

The built-in prompts are short and open-ended, inviting an opinion or a description, so that the
default sentiment reward has room to move: a response about a rainy afternoon can be gloomy or
cheerful, and PPO learns which one scores.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from .jsonl import read_objects

__all__ = ["DEFAULT_PROMPTS", "PromptSampler", "load_prompts"]

DEFAULT_PROMPTS: list[str] = [
    # Descriptions
    "Describe a rainy afternoon in the city.",
    "Describe the first day of spring.",
    "Describe a busy train station in the morning.",
    "Describe the view from a mountain top.",
    "Describe a walk along the beach at sunset.",
    "Describe your ideal weekend.",
    "Describe a small village in winter.",
    "Describe the smell of fresh bread.",
    "Describe a crowded farmers' market.",
    "Describe an old bookshop.",
    "Describe a thunderstorm at night.",
    "Describe a quiet morning at home.",
    "Describe a long road trip.",
    "Describe a football match from the stands.",
    "Describe a forest in autumn.",
    "Describe the last day of school.",
    "Describe a family dinner.",
    "Describe a neighbourhood cafe.",
    "Describe a snowy street at dawn.",
    "Describe a visit to the dentist.",
    "Describe a city park on a Sunday.",
    "Describe a hospital waiting room.",
    "Describe a concert in a small club.",
    "Describe moving into a new flat.",
    "Describe a day without electricity.",
    "Describe a garden after the rain.",
    "Describe a late-night bus ride.",
    "Describe your favourite meal.",
    "Describe an airport during a delay.",
    "Describe a lake in the early morning.",
    "Describe the first day at a new job.",
    "Describe a museum on a weekday.",
    # Opinions
    "What do you think of public libraries?",
    "What do you think of working from home?",
    "What is your opinion of modern architecture?",
    "How do you feel about Mondays?",
    "What do you think of social media?",
    "What is your view on homework for children?",
    "What do you think of electric cars?",
    "How do you feel about long winters?",
    "What do you think of fast food?",
    "What is your opinion of reality television?",
    "What do you think of learning a second language?",
    "How do you feel about living in a big city?",
    "What do you think of online shopping?",
    "What is your opinion of open-plan offices?",
    "What do you think of public transport?",
    "How do you feel about getting older?",
    "What do you think of video games?",
    "What is your opinion of camping?",
    "What do you think of self-driving cars?",
    "How do you feel about rainy days?",
    "What do you think of tax returns?",
    "What is your opinion of school uniforms?",
    "What do you think of smartphones?",
    "How do you feel about traffic jams?",
    "What do you think of classical music?",
    "What is your opinion of remote meetings?",
    "What do you think of cooking at home?",
    "How do you feel about moving to another country?",
    "What do you think of modern art?",
    "What is your opinion of early mornings?",
    "What do you think of team sports?",
    "How do you feel about the news these days?",
    "Write a short review of a movie you remember.",
    "Write a short review of a restaurant you visited.",
    "Tell me about your neighbours.",
    "Tell me about a recent trip.",
]


def load_prompts(path: str | os.PathLike, *, flag: str = "--prompts") -> list[str]:
    """Read prompts from a JSON Lines file, one ``{"prompt": "..."}`` object per line.

    Blank lines are skipped; other keys on a line are ignored (so a data set with extra fields
    works as is).

    Args:
        path: the ``.jsonl`` file.
        flag: the option that named it (``--prompts``, ``--eval-prompts``), for the messages.

    Returns:
        The prompts, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not a JSON object with a non-empty string ``"prompt"`` (the message
            gives ``path:line``), or the file holds no prompt.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {str(path)!r} does not exist")
    prompts: list[str] = []
    for where, obj in read_objects(path, expected='a JSON object {"prompt": "..."}'):
        if "prompt" not in obj:
            raise ValueError(f"{where}: missing key \"prompt\" (keys: {sorted(obj)})")
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: \"prompt\" must be a non-empty string, got {prompt!r}")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{flag} {str(path)!r}: the file holds no prompt (one {{\"prompt\": ...}} per line)")
    return prompts


class PromptSampler:
    """Prompts in a seeded random order, epoch after epoch (each epoch a fresh permutation).

    Epoch ``e``'s order is ``numpy.random.default_rng([seed, e]).permutation(N)``, a pure function
    of ``(seed, e)``, so the state is just ``(epoch, position)``.

    Raises:
        ValueError: an empty prompt list or a non-string prompt.
    """

    def __init__(self, prompts: Sequence[str], seed: int):
        if len(prompts) == 0:
            raise ValueError("prompts must not be empty")
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise ValueError(f"prompts[{i}] must be a str, got {type(p).__name__}")
        self.prompts = list(prompts)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._perm: Optional[np.ndarray] = None
        self._perm_epoch = -1

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.prompts))
            self._perm_epoch = self.epoch
        return self._perm

    def sample(self, k: int) -> List[str]:
        """The next ``k`` prompts (crossing into the next epoch's permutation when needed)."""
        out: List[str] = []
        n = len(self.prompts)
        while len(out) < k:
            perm = self._permutation()
            take = min(k - len(out), n - self.position)
            out.extend(self.prompts[i] for i in perm[self.position:self.position + take])
            self.position += take
            if self.position == n:
                self.epoch += 1
                self.position = 0
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": len(self.prompts)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if state["n"] != len(self.prompts):
            raise ValueError(f"state: the checkpoint had {state['n']} prompts, this sampler has {len(self.prompts)}")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
