"""Procedural arithmetic: "Compute a + b. Reply with only the number."

Difficulty is a mix, because a single level is either solved or hopeless for a 135M model
(measured with SmolLM2-135M-Instruct at temperature 1: single-digit addition ~21 % sampled reward,
two-digit addition ~1.5 %). The mix below leaves headroom in sampled reward and in greedy
held-out accuracy; docs/BENCHMARKS.md has the measured base rates.

Reward = 1 if the last integer in the completion equals the answer, else 0 (component `correct`;
`format` = the completion contains an integer at all). The eval split is the set of problems whose
stable hash falls in buckets 0-2 of 10 (340 of the 1,090 distinct problems, so a 200-problem eval has room);
training never sees them. A problem's id is its expression; its `meta["level"]` names its level. The whole
eval split is not the training mix: 282 of its 340 problems are two-digit sums, which training draws a quarter
of the time. `level_weights` is the training mix; `echo2 eval` reports each level's greedy accuracy and their
mean weighted by it (`greedy_accuracy_train_mix`): the accuracy on unseen problems drawn as training draws.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator

from echo2cli.tasks import Problem, Score, Split, chat

_INT = re.compile(r"-?\d+")

# (weight, op, range of a, range of b)
LEVELS: list[tuple[float, str, tuple[int, int], tuple[int, int]]] = [
    (0.5, "+", (0, 9), (0, 9)),
    (0.25, "+", (10, 99), (0, 9)),
    (0.25, "-", (5, 19), (0, 5)),
]


def level_name(op: str, a_range: tuple[int, int], b_range: tuple[int, int]) -> str:
    """A level's name, e.g. '10-99 + 0-9'."""
    return f"{a_range[0]}-{a_range[1]} {op} {b_range[0]}-{b_range[1]}"


def _is_eval(op: str, a: int, b: int) -> bool:
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return digest[0] % 10 < 3


def last_int(text: str) -> int | None:
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


class ArithmeticTask:
    name = "arithmetic"
    max_new_tokens = 16
    level_weights = {level_name(op, a, b): w for w, op, a, b in LEVELS}  # the training mix

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Problem]:
        rng = random.Random(seed)
        weights = [w for w, *_ in LEVELS]
        while True:
            _, op, a_range, b_range = rng.choices(LEVELS, weights)[0]
            a, b = rng.randint(*a_range), rng.randint(*b_range)
            if _is_eval(op, a, b) != (split == "eval"):
                continue
            answer = a + b if op == "+" else a - b
            yield Problem(
                id=f"{a}{op}{b}",
                messages=chat(f"Compute {a} {op} {b}. Reply with only the number."),
                answer=str(answer),
                meta={"op": op, "a": a, "b": b, "level": level_name(op, a_range, b_range)},
            )

    def score(self, problem: Problem, completion: str) -> Score:
        got = last_int(completion)
        correct = 1.0 if got is not None and str(got) == problem.answer else 0.0
        return Score(correct, {"correct": correct, "format": float(got is not None)})
