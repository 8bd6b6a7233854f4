"""Admission: which returned groups the learner trains on, the buffer they wait in, and the ledger.

- A group is admitted once: its G samples must be valid (one per sample index, 1..max_new_tokens tokens each,
  token ids inside the vocabulary, one finite log-prob <= 0 per token), come from a live lease of the worker
  that returns them, with the lease's version, at most S versions behind the learner. Everything else is
  rejected with a `RejectReason`, and a rejected leased prompt is leased again at once: nothing is lost.
- Each (prompt id, sample index) is trained on at most once: any later copy (a late worker whose lease had
  expired) is a duplicate.
- Step t (turning version t into t+1) takes the B oldest admitted groups whose version x has t - x <= S; a
  group that aged past S while it waited is dropped, counted, and its prompt leased again.
- The ledger counts prompts: leased = admitted + rejected + expired + returned + outstanding, and
  admitted = trained + waiting + dropped_stale. `audit` checks the same per prompt.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable

from echo2cli.learner.types import Group, RejectReason
from echo2cli.protocol import Sample, SubmitResult
from echo2cli.tasks import Score
from echo2cli.tasks.episodes import mask_problem

LOGPROB_TOLERANCE = 1e-3  # engines may round a near-certain token's log-prob slightly above 0
LEDGER_KEYS = ("leased", "admitted", "rejected", "expired", "returned", "trained", "dropped_stale")


class Admission:
    def __init__(
        self,
        *,
        batch_prompts: int,
        group_size: int,
        staleness: int,
        max_new_tokens: int,
        vocab_size: int,
        requeue: Callable[[Iterable[int]], None],
        counters: Counter[str],
        turns: tuple[int, int] | None = None,
    ) -> None:
        """`max_new_tokens`: a completion's length cap, or a transcript's; `turns`: a multi-turn task's
        (max_turns, tokens per policy turn)."""
        self.B, self.G, self.S = batch_prompts, group_size, staleness
        self.max_new_tokens, self.vocab_size, self.turns = max_new_tokens, vocab_size, turns
        self.requeue, self.counters = requeue, counters
        self.ready: deque[Group] = deque()  # admitted, oldest first
        self.done: set[int] = set()  # prompts admitted (waiting, in training or trained)
        self.training: list[int] = []  # prompts of the step in progress
        self.trained: set[int] = set()  # prompts whose group went into an optimizer step
        self.ledger: Counter[str] = Counter()

    # -- verdicts ------------------------------------------------------------------------------------

    def invalid_reason(self, samples: list[Sample]) -> str:
        """Why a group's samples cannot be trained on, or ''."""
        if sorted(s.sample_idx for s in samples) != list(range(self.G)):
            return f"a group needs sample_idx 0..{self.G - 1} exactly once"
        for s in samples:
            if not 0 < len(s.completion_token_ids) <= self.max_new_tokens:
                return f"completion length {len(s.completion_token_ids)} not in 1..{self.max_new_tokens}"
            if len(s.logprobs) != len(s.completion_token_ids):
                return "logprobs and completion_token_ids differ in length"
            if any(not 0 <= t < self.vocab_size for t in s.completion_token_ids):
                return "token id outside the vocabulary"
            if any(not math.isfinite(lp) or lp > LOGPROB_TOLERANCE for lp in s.logprobs):
                return "log-probs must be finite and <= 0"
            if (s.policy_mask is not None) != (self.turns is not None):
                return "policy_mask is for multi-turn tasks' transcripts, and they need one"
            if self.turns is not None and (problem := mask_problem(s.policy_mask or [], len(s.logprobs), *self.turns)):
                return problem
        return ""

    def verdict(
        self,
        prompt_id: int,
        samples: list[Sample],
        *,
        leased: bool,
        drawn: bool,
        version_ok: bool,
        stale: bool,
        revoked: bool = False,
    ) -> RejectReason | None:
        """None to admit the group, else why it is rejected. `leased`: in a live lease of the worker that
        returns it; `drawn`: a prompt id the learner handed out at all."""
        if prompt_id in self.done:
            return RejectReason.DUPLICATE
        if not leased:
            if revoked:
                return RejectReason.REVOKED
            return RejectReason.LATE if drawn else RejectReason.NOT_LEASED
        if not version_ok:
            return RejectReason.VERSION_MISMATCH
        if self.invalid_reason(samples):
            return RejectReason.INVALID_SAMPLES
        return RejectReason.STALE if stale else None

    def admit(self, group: Group, scores: list[Score]) -> None:
        self.ready.append(group)
        self.done.add(group.prompt_id)
        self.counters["reward_errors"] += sum(1 for s in scores if s.components.get("error"))
        self.counters["reward_timeouts"] += sum(1 for s in scores if s.components.get("timeout"))

    def reject(self, result: SubmitResult, reason: RejectReason, samples: list[Sample]) -> None:
        """Count a rejected group in the worker's answer and the totals; the first reason found is its detail."""
        result.rejected[reason] = result.rejected.get(reason, 0) + len(samples)
        self.counters[f"rejected_{reason}_samples"] += len(samples)
        if reason is RejectReason.INVALID_SAMPLES:
            result.detail = self.invalid_reason(samples)
        elif not result.detail:
            result.detail = reason.detail

    def settle(self, result: SubmitResult) -> None:
        """The answer's summary counts (stale; duplicate = duplicate + late; invalid = untrusted), into the totals."""
        result.stale = result.rejected.get(RejectReason.STALE, 0)
        result.duplicate = result.rejected.get(RejectReason.DUPLICATE, 0) + result.rejected.get(RejectReason.LATE, 0)
        result.invalid = sum(n for r, n in result.rejected.items() if RejectReason(r).untrusted)
        for key in ("stale", "duplicate", "invalid"):
            self.counters[f"{key}_samples"] += getattr(result, key)

    def rejected_samples(self) -> dict[str, int]:
        return {r.value: n for r in RejectReason if (n := self.counters[f"rejected_{r}_samples"])}

    # -- the training loop's side --------------------------------------------------------------------

    def take_batch(self, version: int) -> list[Group] | None:
        """B admissible groups for step t = `version`, oldest first; None if not enough yet."""
        for group in [g for g in self.ready if version - g.version > self.S]:
            self.ready.remove(group)
            self.done.discard(group.prompt_id)
            self.requeue([group.prompt_id])
            self.counters["stale_samples"] += len(group.samples)
            self.ledger["dropped_stale"] += 1
        if len(self.ready) < self.B:
            return None
        self.ledger["trained"] += self.B
        batch = [self.ready.popleft() for _ in range(self.B)]
        self.training = [g.prompt_id for g in batch]
        self.counters["trained_twice"] += sum(i in self.trained for i in self.training)
        self.trained.update(self.training)
        return batch

    def step_done(self) -> None:
        self.training = []

    def accounting(self, outstanding: int) -> dict[str, int]:
        return {**{k: self.ledger[k] for k in LEDGER_KEYS}, "outstanding": outstanding, "waiting": len(self.ready)}

    def audit(self, drawn: int, held_elsewhere: set[int]) -> dict[str, int | list[int]]:
        """Every prompt drawn is trained, in training, waiting or `held_elsewhere` (leased out, queued, skipped):
        `lost` lists any that is none of these; none may be trained twice."""
        held = self.trained | set(self.training) | {g.prompt_id for g in self.ready} | held_elsewhere
        return {
            "prompts": drawn,
            "trained": len(self.trained),
            "trained_twice": self.counters["trained_twice"],
            "lost": [i for i in range(drawn) if i not in held],
        }

    # -- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        assert not self.training, "checkpoint between steps only"
        ready = [
            {
                "prompt_id": g.prompt_id,
                "version": g.version,
                "worker_id": g.worker_id,
                "rewards": g.rewards,
                "components": g.components,
                "samples": [s.model_dump() for s in g.samples],
            }
            for g in self.ready
        ]
        return {"done": sorted(self.done), "trained": sorted(self.trained), "ready": ready, "ledger": dict(self.ledger)}

    def load_state(self, state: dict, prompt_token_ids: dict[int, list[int]]) -> None:
        self.done = {int(i) for i in state["done"]}
        self.trained = {int(i) for i in state["trained"]}
        self.ready = deque(
            Group(
                g["prompt_id"],
                g["version"],
                prompt_token_ids[g["prompt_id"]],
                [Sample.model_validate(s) for s in g["samples"]],
                g["rewards"],
                g["worker_id"],
                g.get("components", []),
            )
            for g in state["ready"]
        )
        self.ledger = Counter(state["ledger"])
