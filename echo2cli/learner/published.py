"""Published versions, and how long each took to reach the fleet.

Per version v, with v's fleet:
    T_ready(v) = publish -> the last of them holding it verified (or generating with it), plus the slowest one's
                 swap stall (`ready_s`): T_bcast without the wait for a lease in progress to end. This is the
                 capacity model's T_bcast, since the model accounts for whole leases itself. It is measured as
                 soon as every worker holds v, so a worker partway through a long lease does not hold it up.
    T_bcast(v) = publish -> the last of them generating with it (`bcast_s`), measured once every one does.
v's fleet: the active workers that were already generating when v was published (all active workers if none
was), so a late joiner still fetching its first version does not hold every measurement up.
"""

from __future__ import annotations

from echo2cli.learner.fleet import WorkerRecord
from echo2cli.protocol import PolicyInfo


def _first_at_or_after(times: dict[int, float], version: int) -> float | None:
    """When a worker first reported `version` or newer in `times` (version -> first report), or None."""
    return min((t for x, t in times.items() if x >= version), default=None)


def _last_of_all(times: list[float | None]) -> float | None:
    """The latest of the fleet's times, or None while any worker's is missing."""
    known = [t for t in times if t is not None]
    return max(known) if len(known) == len(times) else None


class PublishedVersions:
    def __init__(self) -> None:
        self.policies: dict[int, PolicyInfo] = {}
        self.bcast_s: dict[int, float] = {}
        self.ready_s: dict[int, float] = {}

    def publish(self, policy: PolicyInfo) -> None:
        self.policies[policy.version] = policy

    def latest(self) -> PolicyInfo:
        return self.policies[max(self.policies)]

    def measure(self, live: list[WorkerRecord]) -> list[int]:
        """Measure T_ready of every version its fleet now holds, and T_bcast of every version its fleet now runs;
        returns the versions whose T_bcast was newly measured."""
        newly = []
        for v, policy in self.policies.items():
            if v in self.bcast_s:
                continue
            fleet = [w for w in live if w.first_seen_with and min(w.first_seen_with.values()) <= policy.published_at]
            fleet = fleet or live
            if not fleet:
                continue
            seen = [_first_at_or_after(w.first_seen_with, v) for w in fleet]
            held = [
                min((t for t in (_first_at_or_after(w.first_ready_with, v), first) if t is not None), default=None)
                for w, first in zip(fleet, seen, strict=True)
            ]
            held_by_all, seen_by_all = _last_of_all(held), _last_of_all(seen)
            if v not in self.ready_s and held_by_all is not None:
                swap = max(w.swap_s for w in fleet)
                self.ready_s[v] = max(0.0, held_by_all - policy.published_at) + swap
            if seen_by_all is not None:
                self.bcast_s[v] = max(0.0, seen_by_all - policy.published_at)
                self.ready_s[v] = min(self.ready_s[v], self.bcast_s[v])
                newly.append(v)
        return newly
