"""Tasks whose scores misbehave on purpose, for tests/test_scoring.py (imported by the scoring process)."""

from __future__ import annotations

import time

from echo2cli.tasks import Problem, Score, chat


class MisbehavingTask:
    """score: 'raise' raises, 'nan' returns NaN, 'big' returns 7, 'hang' never returns, else reward 1."""

    name = "misbehaving"

    def prompts(self, seed, split="train"):
        while True:
            yield Problem(id="p", messages=chat("say something"), answer="")

    def score(self, problem: Problem, completion: str) -> Score:
        if completion == "raise":
            raise ZeroDivisionError("user code fails")
        if completion == "hang":
            while True:
                time.sleep(1)
        reward = {"nan": float("nan"), "big": 7.0}.get(completion, 1.0)
        return Score(reward, {"format": 1.0})


class SlowStartTask(MisbehavingTask):
    """Takes 2 s to build, as a task that loads a tokenizer or a table does on a busy box; scores fast."""

    name = "slow_start"

    def __init__(self) -> None:
        time.sleep(2.0)
