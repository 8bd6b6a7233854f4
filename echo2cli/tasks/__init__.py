"""Data plane: task adapters turn a seed into prompts and a completion into a reward.

A task is any object with

    name: str
    prompts(seed: int, split: "train" | "eval") -> Iterator[Problem]
    reward(problem: Problem, completion: str) -> float       # pure, deterministic, in [0, 1]

Built-in tasks are named (`arithmetic`); a user's own is given as `package.module:ClassName` and
constructed with no arguments. Rewards are computed by the learner only.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from echo2cli.errors import ConfigError

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Problem:
    prompt: str  # the user message; the learner applies the model's chat template
    answer: str
    meta: dict[str, str | int] = field(default_factory=dict)


class Task(Protocol):
    name: str

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


def builtin_tasks() -> dict[str, type]:
    from echo2cli.tasks.arithmetic import ArithmeticTask

    return {"arithmetic": ArithmeticTask}


def load_task(spec: str) -> Task:
    """`arithmetic` or `my_pkg.my_module:MyTask`."""
    builtins = builtin_tasks()
    if spec in builtins:
        return builtins[spec]()
    if ":" not in spec:
        raise ConfigError(
            f"unknown task {spec!r}: use one of {sorted(builtins)} or 'package.module:ClassName'"
        )
    module_name, _, class_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load task {spec!r}: {exc}") from exc
    task = cls()
    for attr in ("name", "prompts", "reward"):
        if not hasattr(task, attr):
            raise ConfigError(f"task {spec!r} has no {attr!r}: see echo2cli/tasks/__init__.py for the interface")
    return task
