"""The fleet: every worker that joined, what it runs and fetches, and how fast it works.

A worker is active while its heartbeats (or any call it makes) arrive: three missed heartbeat periods and
it is not. Its throughput mu_i is measured here, over its last MU_WINDOW leases: samples admitted / wall time
its leases were out (generation plus the round trips) — admitted only, so a worker that returns junk cannot
look fast and cheap. Its speed, which sizes its leases, counts every valid sample it returned, admitted or not
(a stale group was still generated). The first lease runs on a cold engine: it counts only until a second
returns. Workers on standby (cost-aware activation) get no leases; they keep fetching and seeding versions.
A worker that sends invalid data MAX_BAD_BATCHES batches in a row is cut off.
"""

from __future__ import annotations

import statistics
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from echo2cli.learner.types import RejectReason
from echo2cli.protocol import Heartbeat, PolicyInfo, WorkerView

MU_WINDOW = 8  # a worker's mu_i is measured over its last 8 leases
MAX_BAD_BATCHES = 5  # batches in a row with invalid data before a worker is cut off
INACTIVE_AFTER_BEATS = 3  # heartbeat periods without a word before a worker counts as gone


def rate(returns: deque[tuple[int, float]]) -> float | None:
    """Samples per second over (samples, seconds) pairs; None before the first."""
    seconds = sum(s for _, s in returns)
    return sum(n for n, _ in returns) / seconds if seconds > 0 else None


SHARE_UNITS = 64  # the first copy of a version is cut into this many shares (about), handed out by uplink
UPLINK_CAP = 4.0  # an uplink counts for at most this many times the median one


def share_widths(uplinks: list[float]) -> list[int]:
    """How many of the first copy's shares each worker fetches first: in proportion to its uplink, at least one, so
    that a slow uplink, which would hold the others up while it passes its pieces on, holds few of them. Equal
    shares while any uplink is unmeasured (0): a worker's uplink is seen only once it has uploaded something.

    Uplinks are what workers report (their upload counters), so one counts for at most UPLINK_CAP times the median:
    a worker that claims a huge uplink and then sends nothing holds back a bounded part of the first copy, which the
    others then fetch from the learner once their download stalls (`node.GATE_STALL_S`)."""
    if len(uplinks) < 2 or min(uplinks) <= 0:
        return [1] * len(uplinks)
    cap = UPLINK_CAP * statistics.median(uplinks)
    counted = [min(u, cap) for u in uplinks]
    total = sum(counted)
    return [max(1, round(SHARE_UNITS * u / total)) for u in counted]


@dataclass
class WorkerRecord:
    name: str
    usd_per_hour: float
    last_seen: float
    max_model_len: int | None = None  # its engine's context: prompts that cannot fit are never leased to it
    version_loaded: int = -1
    downloading_version: int | None = None
    download_progress: float = 0.0
    tokens_per_s: float = 0.0
    upload_bytes: int = 0
    uplink: float = 0.0  # the fastest it was seen to upload, bytes/s over a heartbeat interval (0: never seen)
    beat_at: float = 0.0  # when its last heartbeat came
    swap_s: float = 0.0
    left: bool = False
    standby: bool = False
    cut_off: bool = False
    bad_streak: int = 0
    leases: int = 0  # granted
    returned: int = 0  # leases returned
    rollouts: int = 0  # samples admitted
    rejected: Counter[RejectReason] = field(default_factory=Counter)  # samples, by reason
    admitted: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MU_WINDOW))  # (samples, s)
    generated: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MU_WINDOW))  # valid ones
    first_seen_with: dict[int, float] = field(default_factory=dict)  # version -> coordinator clock
    first_ready_with: dict[int, float] = field(default_factory=dict)  # verified, not yet loaded

    @property
    def warm(self) -> bool:
        """Its speed was measured past the first lease (which ran on a cold engine)."""
        return self.returned >= 2


class Fleet:
    def __init__(self, heartbeat_s: float, clock: Callable[[], float], max_bad_batches: int = MAX_BAD_BATCHES) -> None:
        self.heartbeat_s, self.clock, self.max_bad_batches = heartbeat_s, clock, max_bad_batches
        self.workers: dict[str, WorkerRecord] = {}

    def join(self, name: str, usd_per_hour: float, max_model_len: int | None) -> str:
        worker_id = uuid.uuid4().hex[:12]
        self.workers[worker_id] = WorkerRecord(name, usd_per_hour, self.clock(), max_model_len)
        return worker_id

    def known(self, worker_id: str) -> bool:
        return worker_id in self.workers and not self.workers[worker_id].left

    def cut_off(self, worker_id: str) -> bool:
        return worker_id in self.workers and self.workers[worker_id].cut_off

    def saw(self, worker_id: str, version: int = -1) -> None:
        """Any call is a sign of life; `version` >= 0: the version it generates with."""
        w = self.workers[worker_id]
        w.last_seen = self.clock()
        if version >= 0:
            w.version_loaded = version
            w.first_seen_with.setdefault(version, w.last_seen)

    def heartbeat(self, hb: Heartbeat) -> None:
        self.saw(hb.worker_id, hb.version_loaded)
        w = self.workers[hb.worker_id]
        w.downloading_version, w.download_progress = hb.downloading_version, hb.download_progress
        if w.beat_at and hb.upload_bytes > w.upload_bytes and w.last_seen > w.beat_at:
            w.uplink = max(w.uplink, (hb.upload_bytes - w.upload_bytes) / (w.last_seen - w.beat_at))
        w.tokens_per_s, w.upload_bytes, w.beat_at = hb.tokens_per_s, hb.upload_bytes, w.last_seen
        if hb.ready_version >= 0:
            w.first_ready_with.setdefault(hb.ready_version, w.last_seen)
        w.swap_s = hb.swap_s or w.swap_s

    def active(self) -> list[str]:
        now = self.clock()
        return [
            wid
            for wid, w in self.workers.items()
            if not w.left and now - w.last_seen < INACTIVE_AFTER_BEATS * self.heartbeat_s
        ]

    def hand(self, policy: PolicyInfo, worker_id: str | None) -> PolicyInfo:
        """`policy` as a worker gets it: with its fetch slot among the active workers (join order), as wide as its
        uplink's part of theirs (`share_widths`). A worker that asks is about to fetch it: until its heartbeat says
        otherwise, it is downloading it."""
        active = self.active()
        self.handed(worker_id, policy.version)
        if worker_id in active:
            widths = share_widths([self.workers[w].uplink for w in active])
            i = active.index(worker_id)
            policy = policy.model_copy(update={"slot": sum(widths[:i]), "slots": sum(widths), "slot_width": widths[i]})
        return policy

    def handed(self, worker_id: str | None, version: int) -> None:
        """The worker was told of `version`: until its heartbeat says otherwise, it is fetching it."""
        w = self.workers.get(worker_id or "")
        if w is not None and not w.left and version > w.version_loaded:
            w.downloading_version = version

    def versions_in_download(self) -> set[int]:
        return {v for wid in self.active() if (v := self.workers[wid].downloading_version) is not None}

    def returned(self, worker_id: str, *, admitted: int, valid: int, held_s: float) -> None:
        """A lease came back after `held_s`: `admitted` samples of `valid` ones (every sample not untrusted)."""
        w = self.workers[worker_id]
        w.returned += 1
        if w.returned == 2:  # the first lease ran on a cold engine: keep it only until a second
            w.admitted.clear()
            w.generated.clear()
        w.admitted.append((admitted, held_s))
        w.generated.append((valid, held_s))

    def judge(self, worker_id: str, *, bad: bool) -> bool:
        """Count a batch with invalid data (or reset the streak); True if this one cuts the worker off."""
        w = self.workers[worker_id]
        w.bad_streak = w.bad_streak + 1 if bad else 0
        if w.bad_streak >= self.max_bad_batches and not w.cut_off:
            w.cut_off = True
            return True
        return False

    def set_standby(self, standby: set[str]) -> None:
        for wid, w in self.workers.items():
            w.standby = wid in standby

    def measured(self) -> list[dict[str, Any]]:
        """Each joined worker's price, measured mu_i (None before its first lease returns) and lease size."""
        active = set(self.active())
        return [
            {
                "worker_id": wid,
                "name": w.name,
                "usd_per_hour": w.usd_per_hour,
                "active": wid in active,
                "standby": w.standby,
                "leases": w.leases,
                "rollouts": w.rollouts,
                "rollouts_per_s": rate(w.admitted),
                "lease_rollouts": sum(n for n, _ in w.admitted) / len(w.admitted) if w.admitted else None,
            }
            for wid, w in self.workers.items()
        ]

    def views(self, leased_prompts: Callable[[str], int]) -> list[WorkerView]:
        active = set(self.active())
        return [
            WorkerView(
                worker_id=wid,
                name=w.name,
                version_loaded=w.version_loaded,
                downloading_version=w.downloading_version,
                download_progress=w.download_progress,
                tokens_per_s=w.tokens_per_s,
                rollouts=w.rollouts,
                active=wid in active,
                standby=w.standby,
                leased_prompts=leased_prompts(wid),
            )
            for wid, w in self.workers.items()
        ]
