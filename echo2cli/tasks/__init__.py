"""Data plane: task adapters turn a seed into prompts and a completion into a reward.

A task is any object with

    name: str
    prompts(seed: int, split: "train" | "eval") -> Iterator[Problem]
    score(problem: Problem, completion: str) -> Score      # deterministic; reward in [0, 1]

`prompts` is a stream that depends only on the seed and the task's options, so a resumed learner
replays it to the same position; each Problem carries a stable `id` (the same problem has the same id in
every run) and chat `messages` (an optional system message, then the user's). The eval split never
overlaps the train split. `score` returns the reward and named components (format, correctness, ...),
all of which the learner logs as `reward/<name>`. Rewards are computed on the learner only, through
`scoring.py`, which turns an exception or a timeout into reward 0 and a counted error. A task may set
`max_new_tokens`, the completion length `echo2 eval` uses unless told otherwise, and name each problem's level
(`meta["level"]`) with `level_weights` (level -> share of the training stream): `echo2 eval` then reports each
level's accuracy and their training-mix weighting. A multi-turn task (an environment played turn by turn:
`poker_hands`) also has `max_turns` and `episode(spec)`: see `episodes.py`.

Built-in tasks are named (`arithmetic`, `math`, `poker`); a user's own is given as
`package.module:ClassName` (see examples/my_task.py) and constructed with the task options of the config
file (`[learner.task_options]`) as keyword arguments.
"""

from __future__ import annotations

import importlib
import itertools
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from echo2cli.errors import ConfigError

Split = Literal["train", "eval"]


def chat(user: str, system: str | None = None) -> tuple[dict[str, str], ...]:
    """Chat messages for a problem: the system message (if any), then the user's."""
    head = ({"role": "system", "content": system},) if system else ()
    return (*head, {"role": "user", "content": user})


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Chat messages as the token ids the engine continues: the model's chat template, assistant turn opened.
    The learner encodes every prompt once, so workers and the trainer see the same ids."""
    return list(
        tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    )


@dataclass(frozen=True)
class Problem:
    id: str  # stable across runs and seeds: the same problem always has the same id
    messages: tuple[dict[str, str], ...]
    answer: str
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The user's message."""
        return self.messages[-1]["content"]


@dataclass(frozen=True)
class Score:
    reward: float
    components: Mapping[str, float] = field(default_factory=dict)


class Task(Protocol):
    name: str

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Problem]: ...

    def score(self, problem: Problem, completion: str) -> Score: ...


def fixed_split(train: Sequence[Problem], held_out: Sequence[Problem], seed: int, split: Split) -> Iterator[Problem]:
    """The prompt stream of a fixed set of problems: the eval split once, in order; the train split endless, each
    epoch a shuffle seeded by (seed, epoch)."""
    if split == "eval":
        yield from held_out
        return
    for epoch in itertools.count():
        order = list(train)
        random.Random(f"{seed}/{epoch}").shuffle(order)
        yield from order


def builtin_tasks() -> dict[str, str]:
    """Name -> import path; imported on use, so one task's dependencies never slow another's start."""
    return {
        "arithmetic": "echo2cli.tasks.arithmetic:ArithmeticTask",
        "math": "echo2cli.tasks.math:MathTask",
        "poker": "echo2cli.tasks.poker:PokerTask",
        "poker_hands": "echo2cli.tasks.poker_hands:PokerHandsTask",
        "verifiers": "echo2cli.tasks.verifiers_env:VerifiersTask",
    }


def load_task(spec: str, options: Mapping[str, Any] | None = None) -> Task:
    """`arithmetic`, `math`, `poker` or `my_pkg.my_module:MyTask`, built with `options` as keyword arguments."""
    builtins = builtin_tasks()
    path = builtins.get(spec, spec)
    if ":" not in path:
        raise ConfigError(f"unknown task {spec!r}: use one of {sorted(builtins)} or 'package.module:ClassName'")
    module_name, _, class_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load task {spec!r}: {exc}") from exc
    try:
        task = cls(**dict(options or {}))
    except TypeError as exc:
        raise ConfigError(f"task {spec!r} does not take these options {sorted(options or {})}: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"task {spec!r}: {exc}") from exc
    for attr in ("name", "prompts", "score"):
        if not hasattr(task, attr):
            raise ConfigError(f"task {spec!r} has no {attr!r}: see echo2cli/tasks/__init__.py for the interface")
    return task
