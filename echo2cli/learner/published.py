"""Published versions, and how long each took to reach the fleet.

Per version v, once every worker of v's fleet generates with v or newer:
    T_bcast(v) = publish -> the last of them generating with it (`bcast_s`);
    T_ready(v) = publish -> the last of them holding it verified, plus the slowest one's swap stall
                 (`ready_s`): T_bcast without the wait for a lease in progress to end. This is the capacity
                 model's T_bcast, since the model accounts for whole leases itself.
v's fleet: the active workers that were already generating when v was published (all active workers if none
was), so a late joiner still fetching its first version does not hold every measurement up.
"""

from __future__ import annotations

from echo2cli.learner.fleet import WorkerRecord
from echo2cli.protocol import PolicyInfo


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
        """Measure every version whose fleet now runs it (or newer); returns the versions newly measured."""
        newly = []
        for v, policy in self.policies.items():
            fleet = [w for w in live if w.first_seen_with and min(w.first_seen_with.values()) <= policy.published_at]
            fleet = fleet or live
            if v in self.bcast_s or not fleet:
                continue
            firsts = [min((t for x, t in w.first_seen_with.items() if x >= v), default=None) for w in fleet]
            if any(t is None for t in firsts):
                continue
            seen = [t for t in firsts if t is not None]
            self.bcast_s[v] = max(0.0, max(seen) - policy.published_at)
            ready = [
                min([t for x, t in w.first_ready_with.items() if x >= v] + [first])
                for w, first in zip(fleet, seen, strict=True)
            ]
            swap = max(w.swap_s for w in fleet)
            self.ready_s[v] = min(self.bcast_s[v], max(0.0, max(ready) - policy.published_at) + swap)
            newly.append(v)
        return newly
