"""The lease book: which prompts each worker holds, until when, and how many it may hold.

Two rules size every lease (the simulator in `plan/simulator.py` runs the same two functions):

- `room_left`: a group queued behind q others is trained about q // B steps from now, so one made with a
  version `lag` behind the learner's stays admissible only while q < B * (S - lag + 1). A worker gets work
  only while fewer prompts than that are in flight (leased, waiting, or in the step being trained). With
  S = 0 the fleet generates exactly one batch per version (synchronous GRPO); larger S lets fresh workers
  run ahead while stale ones do not produce groups that would be dropped.
- `lease_cap`: a worker holds at most what it returns while a group made now stays admissible — (S - lag + 1)
  learner steps of the measured step time at its measured speed, and never more than B — so one worker cannot
  take the fleet's work by asking again and again, and a slow one gets small leases, or none ('wait'),
  instead of holding prompts until their groups are stale. A step that has lasted longer than usual counts as
  long as it has lasted (groups stay admissible while the learner waits), so leases resume even when every
  worker was too slow for the usual step.

An expired lease (worker died, left or too slow) puts its unfinished prompts back in the queue. A lease closed
by invalid data is remembered as revoked, so a later copy of it is told so rather than "the lease expired".
"""

from __future__ import annotations

import math
import statistics
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

REVOKED_KEPT = 4096  # lease ids remembered as revoked
STEP_TIMES_KEPT = 5  # the learner's step time is the median of its last 5 steps


def room_left(*, batch_prompts: int, staleness: int, lag: int, in_flight: int) -> int:
    """Prompts that may still be leased to a worker whose version is `lag` behind: B * (S - lag + 1) - in flight."""
    return batch_prompts * (staleness - lag + 1) - in_flight


def lease_cap(
    *, batch_prompts: int, group_size: int, staleness: int, lag: int, rollouts_per_s: float, step_s: float
) -> int:
    """Prompts a worker of this speed returns while a group made now stays admissible, at most B:
    floor(mu_i * (S - lag + 1) * step_s / G)."""
    return min(batch_prompts, math.floor(rollouts_per_s * (staleness - lag + 1) * step_s / group_size))


def admissible_step_s(recent_steps: list[float], since_last_step: float) -> float:
    """How long a step lasts, for `lease_cap`: the median of the last steps, or this one if it is longer."""
    return max(statistics.median(recent_steps), since_last_step)


@dataclass
class LeaseRecord:
    worker_id: str
    version: int
    outstanding: set[int]  # prompt ids not yet returned
    deadline: float
    granted_at: float


class LeaseBook:
    def __init__(
        self, *, batch_prompts: int, group_size: int, staleness: int, timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self.B, self.G, self.S = batch_prompts, group_size, staleness
        self.timeout_s, self.clock = timeout_s, clock
        self.leases: dict[str, LeaseRecord] = {}
        self.revoked: dict[str, str] = {}  # lease id -> worker id, oldest first
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self.step_began = clock()  # the learner's last advance

    def cap(self, lag: int, rollouts_per_s: float | None, warm: bool) -> int:
        """`lease_cap` for one worker: B until its speed and a step are measured; a worker measured only cold
        (its first lease, engine warming up) still gets one prompt, to be measured warm."""
        if rollouts_per_s is None or not self.step_times:
            return self.B
        step_s = admissible_step_s(list(self.step_times), self.clock() - self.step_began)
        speed_cap = lease_cap(
            batch_prompts=self.B,
            group_size=self.G,
            staleness=self.S,
            lag=lag,
            rollouts_per_s=rollouts_per_s,
            step_s=step_s,
        )
        return max(int(not warm), speed_cap)

    def room(self, lag: int, in_flight: int) -> int:
        return room_left(batch_prompts=self.B, staleness=self.S, lag=lag, in_flight=in_flight)

    def grant(self, worker_id: str, version: int, prompt_ids: list[int]) -> str:
        lease_id = uuid.uuid4().hex[:16]
        now = self.clock()
        self.leases[lease_id] = LeaseRecord(worker_id, version, set(prompt_ids), now + self.timeout_s, now)
        return lease_id

    def live(self, lease_id: str, worker_id: str) -> LeaseRecord | None:
        """The lease if it is out and this worker's: nothing in another worker's lease can be returned by this one."""
        lease = self.leases.get(lease_id)
        return lease if lease is not None and lease.worker_id == worker_id else None

    def held_by(self, worker_id: str) -> int:
        return sum(len(ls.outstanding) for ls in self.leases.values() if ls.worker_id == worker_id)

    def of_worker(self, worker_id: str) -> list[str]:
        return [lease_id for lease_id, ls in self.leases.items() if ls.worker_id == worker_id]

    def outstanding(self) -> set[int]:
        return {i for ls in self.leases.values() for i in ls.outstanding}

    def outstanding_count(self) -> int:
        return sum(len(ls.outstanding) for ls in self.leases.values())

    def expired(self) -> list[str]:
        now = self.clock()
        return [lease_id for lease_id, ls in self.leases.items() if ls.deadline < now]

    def pop(self, lease_id: str) -> LeaseRecord:
        return self.leases.pop(lease_id)

    def close(self, lease_id: str, *, revoked: bool) -> None:
        """Every prompt of the lease came back; `revoked`: closed by invalid data."""
        lease = self.leases.pop(lease_id)
        if revoked:
            self.revoked[lease_id] = lease.worker_id
            while len(self.revoked) > REVOKED_KEPT:
                del self.revoked[next(iter(self.revoked))]

    def was_revoked(self, lease_id: str, worker_id: str) -> bool:
        return self.revoked.get(lease_id) == worker_id

    def advanced(self) -> None:
        """The learner moved to the next step."""
        self.step_began = self.clock()

    def record_step_time(self, seconds: float) -> None:
        """The learner's wall seconds per step, waiting included: how long a group stays admissible."""
        self.step_times.append(seconds)
