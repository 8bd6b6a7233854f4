"""The dispatcher: prompts out to workers, and back into the queue when a lease does not come home.

A worker asking for work is answered, in this order:
    update    its version was never published (a lag below 0 would make the room unbounded)
    finished  the run reached its last step
    standby   cost-aware activation chose other workers
    update    its version is more than S behind the learner's
    wait      it is too slow to return one group while that stays admissible (`leases.lease_cap` is 0), the
              fleet has as much in flight as stays admissible (`leases.room_left`), it holds its cap already,
              or no queued prompt fits its engine's context
    ok        a lease of at most what it asked for

Leases that expire, leases of a worker that leaves, and prompts a worker's engine could not take go back to
the front of the queue, oldest first, counted in the ledger.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from echo2cli.learner.admission import Admission
from echo2cli.learner.fleet import Fleet, WorkerRecord, rate
from echo2cli.learner.leases import LeaseBook, LeaseRecord
from echo2cli.learner.prompts import PromptSource
from echo2cli.protocol import Lease, LeaseResponse, PromptItem

Status = Literal["ok", "wait", "update", "standby", "finished"]


class Dispatcher:
    def __init__(
        self, *, prompts: PromptSource, leases: LeaseBook, fleet: Fleet, admission: Admission, counters: Counter[str]
    ) -> None:
        self.prompts, self.leases, self.fleet, self.admission = prompts, leases, fleet, admission
        self.counters = counters

    def lease(
        self, worker_id: str, version: int, max_prompts: int, *, current: int, finished: bool, latest: int | None = None
    ) -> LeaseResponse:
        """Prompts for a worker generating with `version` while the learner is at `current`. `latest`: the newest
        version announced, which the learner may still be writing `current` behind (default: `current`)."""
        latest = current if latest is None else latest

        def answer(status: Status, detail: str = "") -> LeaseResponse:
            return LeaseResponse(status=status, latest_version=latest, detail=detail)

        if version > current:
            self.fleet.saw(worker_id)
            return answer(
                "update", f"version {version} was never published (the learner is at {current}): load {current}"
            )
        self.fleet.saw(worker_id, version)
        self.expire()
        worker, lag = self.fleet.workers[worker_id], current - version
        if finished:
            return answer("finished")
        if worker.standby:
            return answer("standby", "on standby: the active workers already keep the learner busy")
        if lag > self.leases.S:
            return answer("update", f"version {version} is more than S={self.leases.S} behind {current}")
        cap = self.leases.cap(lag, rate(worker.generated), worker.warm)
        if cap == 0:
            return answer("wait", "too slow for S: one group would be stale before it came back")
        n = min(max_prompts, self.leases.room(lag, self.in_flight()), cap - self.leases.held_by(worker_id))
        if n <= 0:
            return answer("wait")
        lease = self._grant(worker_id, worker, version, n)
        if lease is None:
            return answer("wait", f"no queued prompt fits this worker's context of {worker.max_model_len} tokens")
        return LeaseResponse(status="ok", lease=lease, latest_version=latest)

    def _grant(self, worker_id: str, worker: WorkerRecord, version: int, n: int) -> Lease | None:
        """Up to n prompts that fit the worker's context, oldest queued first; None if none fits."""
        done = self.admission.done
        ids = [i for i in (self.prompts.next(worker.max_model_len, done) for _ in range(n)) if i is not None]
        if not ids:
            return None
        self.admission.ledger["leased"] += len(ids)
        worker.leases += 1
        lease_id = self.leases.grant(worker_id, version, ids)
        items = [
            PromptItem(
                prompt_id=i,
                prompt_token_ids=self.prompts.token_ids[i],
                episode=None if self.prompts.hidden else self.prompts.problems[i].meta.get("episode"),
            )
            for i in ids
        ]
        return Lease(lease_id=lease_id, version=version, prompts=items, deadline_s=self.leases.timeout_s)

    def in_flight(self) -> int:
        """Prompts leased, waiting, or in the step being trained."""
        return self.leases.outstanding_count() + len(self.admission.ready) + len(self.admission.training)

    def expire(self) -> None:
        for lease_id in self.leases.expired():
            self.counters["leases_expired"] += 1
            self.requeue_lease(lease_id, "expired")

    def requeue_lease(self, lease_id: str, outcome: Literal["expired", "returned"]) -> int:
        """Its unfinished prompts go back to the queue; returns how many."""
        lease = self.leases.pop(lease_id)
        self.admission.ledger[outcome] += len(lease.outstanding)
        back = [i for i in lease.outstanding if i not in self.admission.done]
        self.prompts.requeue(back)
        return len(back)

    def hand_back(self, worker_id: str) -> int:
        """The worker left: every lease it holds is returned."""
        return sum(self.requeue_lease(lease_id, "returned") for lease_id in self.leases.of_worker(worker_id))

    def unservable(self, worker_id: str, lease: LeaseRecord | None, prompt_ids: list[int]) -> None:
        """Prompts the worker's engine could not take (too long for it): queued again for another worker, and
        this worker's context lowered below them so it is not given them again."""
        if lease is None:
            return
        worker = self.fleet.workers[worker_id]
        back = sorted({i for i in prompt_ids if i in lease.outstanding})
        for prompt_id in back:
            lease.outstanding.discard(prompt_id)
            longest = self.prompts.longest(prompt_id) - 1
            worker.max_model_len = min(worker.max_model_len or longest, longest)
        self.prompts.requeue(back)
        self.admission.ledger["returned"] += len(back)
        self.counters["unservable_prompts"] += len(back)
