"""The intake: a worker's returned batch, from the wire to the admission buffer.

    check each group (admission.verdict)  ->  score the admissible ones, outside the lock (rewards.py)
    ->  check again under the lock (the lease may have expired while scoring)  ->  admit or reject each
    ->  close the lease if it is complete, measure the worker, judge it (cut off after repeated invalid data)

Only groups of a live lease of the worker that returns them are admitted: a copy that arrives after its lease
expired is 'late' (the prompt has been leased again). A rejected leased prompt is leased again at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from echo2cli.learner.admission import Admission
from echo2cli.learner.dispatch import Dispatcher
from echo2cli.learner.fleet import Fleet
from echo2cli.learner.leases import LeaseBook, LeaseRecord
from echo2cli.learner.prompts import PromptSource
from echo2cli.learner.rewards import RewardStage
from echo2cli.learner.types import Group, RejectReason
from echo2cli.protocol import RolloutBatch, Sample, SubmitResult
from echo2cli.tasks import Score


class Intake:
    def __init__(
        self,
        *,
        lock: threading.Condition,
        prompts: PromptSource,
        leases: LeaseBook,
        fleet: Fleet,
        admission: Admission,
        rewards: RewardStage,
        dispatcher: Dispatcher,
        cut_off: Callable[[str], object],
    ) -> None:
        """`lock` is the coordinator's, notified when a group is admitted; `cut_off(worker_id)` removes a worker."""
        self.lock, self.prompts, self.leases, self.fleet = lock, prompts, leases, fleet
        self.admission, self.rewards, self.dispatcher, self.cut_off = admission, rewards, dispatcher, cut_off

    def submit(self, batch: RolloutBatch, current: Callable[[], int]) -> SubmitResult:
        """`current()`: the learner's version, read under the lock (it may advance while groups are scored)."""
        groups: dict[int, list[Sample]] = {}
        for s in batch.samples:
            groups.setdefault(s.prompt_id, []).append(s)
        with self.lock:
            now = current()
            problems = {p: self.prompts.problems[p] for p, ss in groups.items() if not self._verdict(batch, p, ss, now)}
        scores = self.rewards(problems, groups)
        with self.lock:
            now = current()
            self.fleet.saw(batch.worker_id)
            lease = self.leases.live(batch.lease_id, batch.worker_id)
            self.dispatcher.unservable(batch.worker_id, lease, batch.unservable)
            result = SubmitResult()
            for prompt_id, samples in groups.items():
                reason = self._verdict(batch, prompt_id, samples, now)
                if reason is None and prompt_id not in scores:
                    reason = RejectReason.LATE  # admissible only now: its lease was re-granted while we scored
                if reason is None:
                    reason = self.rewards.refusal(scores[prompt_id])  # a transcript forged, or its replay failed
                self._settle(batch, lease, prompt_id, samples, reason, scores.get(prompt_id, []), result)
            self.admission.settle(result)
            self._close(batch, lease, result)
            if result.accepted:
                self.lock.notify_all()
            return result

    def _verdict(self, batch: RolloutBatch, prompt_id: int, samples: list[Sample], current: int) -> RejectReason | None:
        lease = self.leases.live(batch.lease_id, batch.worker_id)
        return self.admission.verdict(
            prompt_id,
            samples,
            leased=lease is not None and prompt_id in lease.outstanding,
            drawn=prompt_id in self.prompts.problems,
            version_ok=batch.version <= current and (lease is None or lease.version == batch.version),
            stale=current - batch.version > self.admission.S,
            revoked=self.leases.was_revoked(batch.lease_id, batch.worker_id),
        )

    def _settle(
        self,
        batch: RolloutBatch,
        lease: LeaseRecord | None,
        prompt_id: int,
        samples: list[Sample],
        reason: RejectReason | None,
        scores: list[Score],
        result: SubmitResult,
    ) -> None:
        """One group: admitted, or rejected and, if it was leased, queued again."""
        if reason is None:
            samples = sorted(samples, key=lambda s: s.sample_idx)
            rewards, components = [s.reward for s in scores], [dict(s.components) for s in scores]
            group = Group(
                prompt_id,
                batch.version,
                self.prompts.token_ids[prompt_id],
                samples,
                rewards,
                batch.worker_id,
                components,
            )
            self.admission.admit(group, scores)
            result.accepted += len(samples)
        else:
            self.admission.reject(result, reason, samples)
            self.fleet.workers[batch.worker_id].rejected[reason] += len(samples)
        if lease is not None and prompt_id in lease.outstanding:
            lease.outstanding.discard(prompt_id)
            self.admission.ledger["admitted" if reason is None else "rejected"] += 1
            if reason is not None and prompt_id not in self.admission.done:
                self.prompts.requeue([prompt_id])  # lease it again: nothing lost

    def _close(self, batch: RolloutBatch, lease: LeaseRecord | None, result: SubmitResult) -> None:
        """Close the lease once every prompt came back, measure the worker, judge it."""
        if lease is not None:
            if not lease.outstanding:
                self.leases.close(batch.lease_id, revoked=result.invalid > 0)
            valid = result.accepted + sum(n for r, n in result.rejected.items() if not RejectReason(r).untrusted)
            held_s = self.leases.clock() - lease.granted_at
            self.fleet.returned(batch.worker_id, admitted=result.accepted, valid=valid, held_s=held_s)
        self.fleet.workers[batch.worker_id].rollouts += result.accepted
        if self.fleet.judge(batch.worker_id, bad=result.invalid > 0):
            self.cut_off(batch.worker_id)
