"""The reward stage between a worker's submission and admission: decode each group's completions with the
learner's tokenizer and score them with the task.

It runs outside the coordinator's lock (a task's score may be slow; `tasks/scoring.Scorer` bounds its time and
turns an exception into reward 0), so the coordinator checks each group before scoring it and again after.
Rewards are always computed here: a worker's own claim is never read.

A multi-turn transcript is different from a completion: its score is a replay that checks every environment token
the worker sent. A replay that raised or timed out stopped checking at that point, so such a group is refused
(`refusal`), never admitted with reward 0: the tokens after the failing turn were never verified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from echo2cli.learner.types import RejectReason
from echo2cli.protocol import Sample
from echo2cli.tasks import Problem, Score, Task
from echo2cli.tasks.episodes import FORGED, Turns, is_episodic
from echo2cli.tasks.scoring import Completion, safe_score

ScoreFn = Callable[[Problem, list[Completion]], list[Score]]


class RewardStage:
    def __init__(
        self,
        task: Task,
        decode: Callable[[list[int]], str],
        score: ScoreFn | None = None,
        turns: Turns | None = None,
    ) -> None:
        """`score(problem, texts)` scores a group at once; by default the task's own score, one text at a time.
        A multi-turn task's samples go to it as transcripts (token ids, policy mask), replayed with `turns`."""
        self.decode = decode
        self.episodic = is_episodic(task)
        self.score = score or (lambda problem, items: [safe_score(task, problem, c, turns) for c in items])

    def completion(self, sample: Sample) -> Completion:
        if self.episodic:
            return (list(sample.completion_token_ids), list(sample.policy_mask or []))
        return self.decode(sample.completion_token_ids)

    def __call__(self, problems: Mapping[int, Problem], groups: Mapping[int, list[Sample]]) -> dict[int, list[Score]]:
        """Scores of each group's samples, in sample order, for every prompt in `problems`."""
        scores = {}
        for prompt_id, problem in problems.items():
            samples = sorted(groups[prompt_id], key=lambda s: s.sample_idx)
            scores[prompt_id] = self.score(problem, [self.completion(s) for s in samples])
        return scores

    def refusal(self, scores: list[Score]) -> RejectReason | None:
        """Why a scored group must not be admitted whatever its rewards: a transcript is forged, or its replay
        failed (an exception or a timeout), so it was never checked to the end."""
        if any(s.components.get(FORGED) for s in scores):
            return RejectReason.FORGED_ENV
        if self.episodic and any(s.components.get("error") or s.components.get("timeout") for s in scores):
            return RejectReason.REPLAY_FAILED
        return None
