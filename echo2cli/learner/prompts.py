"""The prompt source: the task's prompt stream, numbered, and the queue of prompts to lease again.

Prompt ids count the problems drawn from `task.prompts(seed, "train")`, so a resumed learner that replays
the stream to the same position (`load_state`) means the same problems by the same ids. Each problem is
encoded once, by the learner's tokenizer, and leased as token ids. A prompt that cannot fit the learner's
own sequence limit with max_new_tokens is skipped and counted; one that cannot fit a worker's context waits
in the queue, in order, for a worker with a longer one.

A task whose episodes hide state (`hidden_state`, learner/episode_host.py) is drawn with the run's seed mixed with
a secret of the learner's, kept in its checkpoints: the seed is public (0 by default, or guessable), and the
stream is the task's public code, so seed and prompt id alone would name every deal.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Sequence

from echo2cli.tasks import Problem, Task
from echo2cli.tasks.episodes import is_episodic

MAX_DRAWS_PER_PROMPT = 16  # new prompts drawn in search of one that fits a worker's context


class PromptSource:
    def __init__(
        self,
        task: Task,
        seed: int,
        encode: Callable[[Sequence[dict[str, str]]], list[int]],
        max_new_tokens: int,
        max_seq_len: int | None,
        counters: Counter[str],
    ) -> None:
        self.task, self.seed = task, seed
        # an environment with hidden state is stepped by the learner (episode_host.py): its specs never leave it
        self.hidden = bool(getattr(task, "hidden_state", False)) and is_episodic(task)
        self.secret = secrets.token_hex(16) if self.hidden else None
        self._stream = task.prompts(self._stream_seed(), "train")
        self.encode, self.max_new_tokens, self.max_seq_len = encode, max_new_tokens, max_seq_len
        self.problems: dict[int, Problem] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.pending: deque[int] = deque()  # to lease again, oldest first
        self.skipped: set[int] = set()  # longer than the learner's own limit: never leased
        self.counters = counters  # the coordinator's totals: prompts_too_long

    def _stream_seed(self) -> int:
        if self.secret is None:
            return self.seed
        return int.from_bytes(hashlib.sha256(f"{self.seed}/{self.secret}".encode()).digest()[:8], "big")

    def next(self, context: int | None, done: Collection[int]) -> int | None:
        """The oldest queued prompt that fits a worker's context (prompt + max_new_tokens <= context), else a
        new one; None if none of MAX_DRAWS_PER_PROMPT new ones fits. Prompts in `done` leave the queue (a late
        copy may have finished one)."""
        self.pending = deque(i for i in self.pending if i not in done)
        for i, prompt_id in enumerate(self.pending):
            if self.fits(prompt_id, context):
                del self.pending[i]
                return prompt_id
        for _ in range(MAX_DRAWS_PER_PROMPT):
            drawn = self.draw()
            if drawn is None:
                continue
            if self.fits(drawn, context):
                return drawn
            self.pending.append(drawn)
        return None

    def fits(self, prompt_id: int, context: int | None) -> bool:
        return context is None or self.longest(prompt_id) <= context

    def longest(self, prompt_id: int) -> int:
        """Prompt plus completion tokens, at most."""
        return len(self.token_ids[prompt_id]) + self.max_new_tokens

    def draw(self) -> int | None:
        """A new prompt's id; None if it cannot fit the learner's own sequence limit (skipped, and counted)."""
        prompt_id = len(self.problems)
        problem = next(self._stream)
        self.problems[prompt_id] = problem
        self.token_ids[prompt_id] = self.encode(problem.messages)
        if self.max_seq_len is not None and self.longest(prompt_id) > self.max_seq_len:
            self.skipped.add(prompt_id)
            self.counters["prompts_too_long"] += 1
            return None
        return prompt_id

    def requeue(self, prompt_ids: Iterable[int]) -> None:
        """Back to the front of the queue, oldest first: leased again before any new prompt."""
        self.pending.extendleft(sorted(prompt_ids, reverse=True))

    def state_dict(self) -> dict:
        secret = {} if self.secret is None else {"deal_secret": self.secret}
        return {"problems_drawn": len(self.problems), "pending": list(self.pending), **secret}

    def load_state(self, state: dict, leased_out: list[int]) -> None:
        """Replay the stream to where it was; prompts that were leased out go first (their workers join again)."""
        if self.secret is not None and state.get("deal_secret"):
            self.secret = str(state["deal_secret"])
            self._stream = self.task.prompts(self._stream_seed(), "train")
        for _ in range(int(state["problems_drawn"])):
            self.draw()
        self.pending = deque(leased_out + [int(i) for i in state["pending"]])
