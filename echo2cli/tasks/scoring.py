"""Rewards on the learner that can neither crash it nor stall it.

A task's `score` is user code run on untrusted completions: it may raise, or take forever on a 100,000-digit
number or a deeply nested expression. `safe_score` turns an exception into reward 0 with component
`error` = 1. `Scorer` also bounds time: groups are scored in a worker process (built once from the task's
spec and options); if a group is not done within `timeout_s` per completion, the process is killed and the
group's completions are scored one at a time, so only the completion that hangs gets reward 0 with
component `timeout` = 1. Both counts are logged (`reward/errors_total`, `reward/timeouts_total`).

A multi-turn task's "completion" is a transcript, (token ids, policy mask): the scoring process loads the
model's tokenizer (`tokenizer_dir`) and replays the episode (`episodes.score_transcript`).
"""

from __future__ import annotations

import math
import multiprocessing
import threading
from collections.abc import Mapping
from typing import Any

from echo2cli.tasks import Problem, Score, Task, load_task
from echo2cli.tasks.episodes import FORGED, Turns, is_episodic, score_transcript

Completion = str | tuple[list[int], list[int]]  # a text, or a multi-turn transcript's (token ids, policy mask)

STARTUP_TIMEOUT_S = 300.0  # the scoring process's own start: imports, the task, a tokenizer
ERROR = Score(0.0, {"error": 1.0})
TIMEOUT = Score(0.0, {"timeout": 1.0})


def safe_score(task: Task, problem: Problem, completion: Completion, turns: Turns | None = None) -> Score:
    """The task's score, with anything but a finite reward in [0, 1] turned into reward 0 and `error` = 1."""
    try:
        if isinstance(completion, tuple):
            if turns is None:
                raise ValueError("a transcript needs the tokenizer's turns")
            ids, mask = completion
            score = score_transcript(task, turns, problem.meta["episode"], ids, mask)
            if score.components.get(FORGED):
                return score
        else:
            score = task.score(problem, completion)
        reward = float(score.reward)
        components = {str(k): float(v) for k, v in dict(score.components).items()}
    except Exception:  # user code on untrusted input: any failure is a zero reward, counted
        return ERROR
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        return ERROR
    return Score(reward, components)


_task: Task | None = None  # in the scoring process
_turns: Turns | None = None


def _init(spec: str, options: Mapping[str, Any], tokenizer_dir: str | None) -> None:
    global _task, _turns
    _task = load_task(spec, options)
    if tokenizer_dir is not None and is_episodic(_task):
        from transformers import AutoTokenizer

        _turns = Turns(AutoTokenizer.from_pretrained(tokenizer_dir))


def _ready() -> bool:
    return _task is not None


def _score_all(problem: Problem, completions: list[Completion]) -> list[tuple[float, dict[str, float]]]:
    assert _task is not None
    return [(s.reward, dict(s.components)) for s in (safe_score(_task, problem, c, _turns) for c in completions)]


class Scorer:
    """Scores a group of completions in a separate process, with a deadline (see the module docstring)."""

    def __init__(
        self,
        spec: str,
        options: Mapping[str, Any] | None = None,
        timeout_s: float = 5.0,
        tokenizer_dir: str | None = None,
    ) -> None:
        """`tokenizer_dir`: the model's, for a multi-turn task's transcripts."""
        self.spec, self.options, self.timeout_s = spec, dict(options or {}), timeout_s
        self.tokenizer_dir = tokenizer_dir
        self.errors = 0
        self.timeouts = 0
        self._pool: Any = None
        self._lock = threading.Lock()  # one group at a time: the pool is one process

    def _get_pool(self) -> Any:
        """The scoring process, started and initialised before any deadline runs: its start (imports, the task,
        a tokenizer; seconds on a busy box) must not count against a completion, or every group scored right after
        a (re)start would time out."""
        if self._pool is None:
            ctx = multiprocessing.get_context("forkserver")  # never fork a process that runs torch threads
            self._pool = ctx.Pool(1, initializer=_init, initargs=(self.spec, self.options, self.tokenizer_dir))
            self._pool.apply_async(_ready).get(timeout=STARTUP_TIMEOUT_S)
        return self._pool

    def _kill(self) -> None:
        self._pool.terminate()
        self._pool.join()
        self._pool = None

    def _run(self, problem: Problem, completions: list[Completion]) -> list[Score] | None:
        try:
            job = self._get_pool().apply_async(_score_all, (problem, completions))
            return [Score(r, c) for r, c in job.get(timeout=self.timeout_s * len(completions))]
        except multiprocessing.TimeoutError:
            self._kill()
            return None

    def __call__(self, problem: Problem, completions: list[Completion]) -> list[Score]:
        with self._lock:
            scores = self._run(problem, completions)
            if scores is None:  # one of them hangs: find it
                scores = [(self._run(problem, [c]) or [TIMEOUT])[0] for c in completions]
            self.errors += sum(1 for s in scores if s.components.get("error"))
            self.timeouts += sum(1 for s in scores if s.components.get("timeout"))
            return scores

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._kill()
