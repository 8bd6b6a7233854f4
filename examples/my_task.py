"""An example of a user task: spell a word backwards. Copy this file to start your own.

Run it from the directory holding this file (or put that directory on PYTHONPATH):

    PYTHONPATH=examples echo2 learner --task my_task:ReverseWordTask
    PYTHONPATH=examples echo2 eval --task my_task:ReverseWordTask --limit 50

Task options come from the config file's `[learner.task_options]` table and arrive as keyword
arguments, here `min_len` and `max_len`:

    [learner]
    task = "my_task:ReverseWordTask"
    [learner.task_options]
    max_len = 5

A task needs `name`, `prompts(seed, split)` (an endless or finite stream that depends only on the seed and
the options, each Problem with a stable id and chat messages; the eval split disjoint from train) and
`score(problem, completion)` (a Score: reward in [0, 1] plus named components, each logged as
`reward/<name>`). Rewards run on the learner, in a separate process with a time limit.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from echo2cli.tasks import Problem, Score, Split, chat

WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "piano",
    "lemon",
    "candle",
    "garden",
    "rocket",
    "silver",
    "window",
    "pencil",
    "orange",
    "bridge",
    "forest",
    "dragon",
    "planet",
    "mirror",
    "castle",
    "hat",
    "sun",
    "book",
    "tree",
    "fish",
    "bird",
    "moon",
    "star",
    "lamp",
    "door",
)


class ReverseWordTask:
    name = "reverse-word"

    def __init__(self, min_len: int = 3, max_len: int = 6) -> None:
        self.words = [w for w in WORDS if min_len <= len(w) <= max_len]
        if not self.words:
            raise ValueError(f"no word has {min_len}..{max_len} letters")

    @staticmethod
    def _is_eval(word: str) -> bool:
        return hashlib.sha256(word.encode()).digest()[0] % 5 == 0

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Problem]:
        pool = [w for w in self.words if self._is_eval(w) == (split == "eval")]
        if split == "eval":  # each held-out word once
            yield from (self._problem(w) for w in pool)
            return
        rng = random.Random(seed)
        while True:
            yield self._problem(rng.choice(pool))

    @staticmethod
    def _problem(word: str) -> Problem:
        return Problem(
            id=f"reverse-{word}",
            messages=chat(f"Spell the word '{word}' backwards. Reply with one word."),
            answer=word[::-1],
        )

    def score(self, problem: Problem, completion: str) -> Score:
        words = completion.strip().strip(".'\"").split()
        one_word = float(len(words) == 1)
        correct = float(bool(words) and words[-1].strip(".'\"").lower() == problem.answer)
        return Score(0.9 * correct + 0.1 * one_word, {"correct": correct, "format": one_word})
