"""Environments with hidden state, stepped on the learner: a worker sends each turn's action, the learner answers
with the next observation.

Why not on the worker. A multi-turn episode is deterministic given its spec (`tasks/episodes.py`), and for a card
game the spec is the deal's seed: a worker that holds it rebuilds the opponent's hole cards and the board, plays
lines that replay as genuine, and earns rewards it did not earn (training on them teaches the policy to cheat).
So for a task with `hidden_state = True` the lease carries no spec, and the learner, which scores every transcript
anyway, holds each episode and steps it: the worker gets only what a player in its seat sees, one observation at
a time. (The alternative, a worker given only the observations it is entitled to, does not work: the next
observation depends on the opponent's cards, which the worker must not have.) The prompt stream of such a task is
drawn with a secret seed (`prompts.PromptSource`), so that the run's public `--seed` and a prompt id do not name
the deal either.

The cost is one HTTP round trip per turn per lease (all the lease's live episodes in one request) plus the
environment's step on the learner's CPU: `scripts/bench_episode_steps.py` measures both against local stepping.

    POST /v1/episodes/step  {worker_id, lease_id, actions: [{prompt_id, sample_idx, turn, token_ids}]}
      -> {steps: [{done, env_token_ids}]}, one per action, in order

An action is accepted for a prompt of the worker's live lease, a sample index below G, and the episode's next
turn; the same turn sent again with the same tokens (a retried request) gets the same answer. The learner decodes
the action with its own tokenizer, exactly as the replay at scoring does, so a transcript played here replays as
played. An environment that raises on an action ends the episode there; the replay then fails the same way and
the group is refused (`RejectReason.REPLAY_FAILED`). Episodes of leases that ended are dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from echo2cli.learner.coordinator import Coordinator
from echo2cli.protocol import EpisodeAction, EpisodeStep
from echo2cli.tasks.episodes import Turns


class StepRefused(ValueError):
    """An action the learner does not take; `status` is the HTTP answer (409: the lease or turn moved on)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


@dataclass
class _Episode:
    episode: Any  # built at its first action
    turn: int = 0  # the next policy turn
    done: bool = False
    last: tuple[list[int], EpisodeStep] | None = field(default=None)  # the last action and its answer


class EpisodeHost:
    def __init__(
        self,
        task: Any,
        turns: Turns,
        *,
        spec_of: Callable[[str, str, int], str | None],
        live_leases: Callable[[], set[str]],
        group_size: int,
        max_turns: int,
        turn_tokens: int,
    ) -> None:
        """`spec_of(worker_id, lease_id, prompt_id)`: the episode spec if the prompt is in that worker's live lease,
        else None; `live_leases()`: the ids of leases out now; `turn_tokens`: a policy turn's tokens, at most."""
        self.task, self.turns, self.spec_of, self.live_leases = task, turns, spec_of, live_leases
        self.G, self.max_turns, self.turn_tokens = group_size, max_turns, turn_tokens
        self.episodes: dict[tuple[str, int, int], _Episode] = {}
        self.lock = threading.Lock()  # one request at a time: a step is a few milliseconds of Python

    def step(self, worker_id: str, lease_id: str, actions: list[EpisodeAction]) -> list[EpisodeStep]:
        """Each action's answer, in order; StepRefused (nothing stepped) if any action is not acceptable, or if two
        are for the same episode: one action an episode a request, so a request is at most the lease's episodes
        (copies once each got the whole next observation, ~20 MB of answers to one request)."""
        with self.lock:
            self._forget_ended()
            seen: set[tuple[int, int]] = set()
            for a in actions:
                if (a.prompt_id, a.sample_idx) in seen:
                    raise StepRefused(
                        422, f"two actions for episode (prompt {a.prompt_id}, sample {a.sample_idx}) in one request"
                    )
                seen.add((a.prompt_id, a.sample_idx))
                self._check(worker_id, lease_id, a)
            return [self._step(worker_id, lease_id, a) for a in actions]

    def _check(self, worker_id: str, lease_id: str, a: EpisodeAction) -> None:
        where = f"episode (prompt {a.prompt_id}, sample {a.sample_idx})"
        if self.spec_of(worker_id, lease_id, a.prompt_id) is None:
            raise StepRefused(409, f"prompt {a.prompt_id} is not in a live lease {lease_id} of this worker: drop it")
        if a.sample_idx >= self.G:
            raise StepRefused(422, f"sample_idx {a.sample_idx} is not below G = {self.G}")
        if not 0 < len(a.token_ids) <= self.turn_tokens:
            raise StepRefused(422, f"an action of {len(a.token_ids)} tokens: 1..{self.turn_tokens} per turn")
        if a.turn >= self.max_turns:
            raise StepRefused(422, f"turn {a.turn}: the task has {self.max_turns} policy turns")
        held = self.episodes.get((lease_id, a.prompt_id, a.sample_idx))
        expected = held.turn if held is not None else 0
        if a.turn == expected and not (held is not None and held.done):
            return
        if held is not None and held.last is not None and a.turn == expected - 1 and held.last[0] == a.token_ids:
            return  # the same action again (a retried request): the same answer
        state = "has ended" if held is not None and held.done else f"is at turn {expected}"
        raise StepRefused(409, f"{where} {state}, not at turn {a.turn}")

    def _step(self, worker_id: str, lease_id: str, a: EpisodeAction) -> EpisodeStep:
        key = (lease_id, a.prompt_id, a.sample_idx)
        held = self.episodes.get(key)
        if held is not None and held.last is not None and a.turn == held.turn - 1:
            return held.last[1]
        if held is None:
            held = self.episodes[key] = _Episode(None)
        try:
            if held.episode is None:
                held.episode = self.task.episode(self.spec_of(worker_id, lease_id, a.prompt_id) or "")
                held.episode.reset()  # its first observation is the prompt the worker holds
            step = held.episode.step(self.turns.action(a.token_ids))
            answer = EpisodeStep(
                done=step.done, env_token_ids=[] if step.done else self.turns.env_tokens(step.observation, a.token_ids)
            )
        except Exception:  # the environment on an untrusted action: the episode ends; its replay is refused
            answer = EpisodeStep(done=True, env_token_ids=[])
        held.turn, held.done, held.last = held.turn + 1, answer.done, (list(a.token_ids), answer)
        return answer

    def _forget_ended(self) -> None:
        live = self.live_leases()
        for key in [k for k in self.episodes if k[0] not in live]:
            del self.episodes[key]


def episode_host(coord: Coordinator, tokenizer_dir: Any) -> EpisodeHost | None:
    """The host for a run whose task hides state (`PromptSource.hidden`), else None. It reads the coordinator's
    leases and prompts under the coordinator's lock, as the coordinator's own parts do."""
    if not coord.prompts.hidden or coord.admission.turns is None:
        return None
    from transformers import AutoTokenizer

    def spec_of(worker_id: str, lease_id: str, prompt_id: int) -> str | None:
        with coord.lock:
            lease = coord.leases.live(lease_id, worker_id)
            if lease is None or prompt_id not in lease.outstanding:
                return None
            return str(coord.prompts.problems[prompt_id].meta.get("episode", ""))

    def live_leases() -> set[str]:
        with coord.lock:
            return set(coord.leases.leases)

    max_turns, turn_tokens = coord.admission.turns
    return EpisodeHost(
        coord.prompts.task,
        Turns(AutoTokenizer.from_pretrained(tokenizer_dir)),
        spec_of=spec_of,
        live_leases=live_leases,
        group_size=coord.G,
        max_turns=max_turns,
        turn_tokens=turn_tokens,
    )
