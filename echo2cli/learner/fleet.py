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

import math
import statistics
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from echo2cli.learner.types import RejectReason
from echo2cli.protocol import Heartbeat, PolicyInfo, WorkerView

MAX_WORKERS = 4096  # workers joined at once: past it a join is refused (429), so joins cannot grow the fleet forever
# workers joined at once from one address (`--max-workers-per-address`): one token holder cannot fill the fleet;
# 64 GPU workers behind one NAT address, each rejoining once, fit
WORKERS_PER_ADDRESS = 128
FORGET_AFTER_S = 600.0  # a worker silent this long has left (its next call hears "join again"; workers do)
DEPARTED_KEPT = 1024  # records of workers that left, kept for the status view and the run's totals
MU_WINDOW = 8  # a worker's mu_i is measured over its last 8 leases
MAX_BAD_BATCHES = 5  # batches in a row with invalid data before a worker is cut off
INACTIVE_AFTER_BEATS = 3  # heartbeat periods without a word before a worker counts as gone


class FleetFull(ValueError):
    """No room for another worker (MAX_WORKERS)."""


def rate(returns: deque[tuple[int, float]]) -> float | None:
    """Samples per second over (samples, seconds) pairs; None before the first."""
    seconds = sum(s for _, s in returns)
    return sum(n for n, _ in returns) / seconds if seconds > 0 else None


SHARE_UNITS = 64  # the first copy of a version is cut into this many shares (about), handed out by uplink
UPLINK_CAP = 2.0  # a worker's uplink, and then its share, counts for at most this many times the fleet's middle one
UPLINK_HALF_LIFE_S = 600.0  # a worker's measured uplink is its peak rate, halved every 10 minutes since


def middle(values: list[float]) -> float:
    """The median; of two values the lower one (their mean is half the larger, which one liar sets alone)."""
    return min(values) if len(values) == 2 else statistics.median(values)


def share_widths(uplinks: list[float]) -> list[int]:
    """How many of the first copy's shares each worker fetches first: in proportion to its uplink, at least one, so
    that a slow uplink, which would hold the others up while it passes its pieces on, holds few of them. Equal
    shares while any uplink is unmeasured (0): a worker's uplink is seen only once it has uploaded something.

    Uplinks are what workers report (their upload counters), so a liar must not buy much: an uplink counts for at
    most UPLINK_CAP times the fleet's `middle` one (at N = 2 the other worker's, so the cap binds there too), and a
    share, after rounding, for at most UPLINK_CAP times the middle share. A worker that claims a huge uplink and
    then sends nothing holds back at most about 2/(N + 1) of the first copy, which the others then fetch from the
    learner once their download stalls (`node.GATE_STALL_S`). Anything not finite counts as unmeasured. (With the
    lower median at every N the cap would also hold against liars who are half the fleet, but it cost the
    asymmetric fleet of docs/BENCHMARKS.md a fifth of its broadcast speed: 1.50-1.61 T* against 1.24-1.28.)"""
    if len(uplinks) < 2 or not all(math.isfinite(u) and u > 0 for u in uplinks):
        return [1] * len(uplinks)
    cap = UPLINK_CAP * middle(uplinks)
    counted = [min(u, cap) for u in uplinks]
    total = sum(counted)
    widths = [max(1, round(SHARE_UNITS * u / total)) for u in counted]
    most = max(1, int(UPLINK_CAP * middle([float(w) for w in widths])))
    return [min(w, most) for w in widths]


@dataclass
class WorkerRecord:
    name: str
    usd_per_hour: float
    last_seen: float
    max_model_len: int | None = None  # its engine's context: prompts that cannot fit are never leased to it
    address: str | None = None  # where it joined from (per-address limit)
    version_loaded: int = -1
    downloading_version: int | None = None
    download_progress: float = 0.0
    tokens_per_s: float = 0.0
    upload_bytes: int = 0  # its upload counter when `beat_at`
    uplink: float = 0.0  # its decaying peak upload rate, bytes/s (0: never seen; `Fleet.measure_uplink`)
    beat_at: float = 0.0  # when its upload counter was last read
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
    def __init__(
        self,
        heartbeat_s: float,
        clock: Callable[[], float],
        max_bad_batches: int = MAX_BAD_BATCHES,
        per_address: int = WORKERS_PER_ADDRESS,
    ) -> None:
        self.heartbeat_s, self.clock, self.max_bad_batches = heartbeat_s, clock, max_bad_batches
        self.per_address = per_address
        self.workers: dict[str, WorkerRecord] = {}

    def join(self, name: str, usd_per_hour: float, max_model_len: int | None, address: str | None = None) -> str:
        """A new worker's id; FleetFull if MAX_WORKERS have joined and not left, or `per_address` from `address`."""
        if sum(not w.left for w in self.workers.values()) >= MAX_WORKERS:
            raise FleetFull(f"the learner has {MAX_WORKERS} workers, its most: join again later")
        if address is not None and sum(not w.left and w.address == address for w in self.workers.values()) >= (
            self.per_address
        ):
            raise FleetFull(
                f"{self.per_address} workers from {address} have joined, the most one address may have: join again "
                "later, or ask the learner's owner for --max-workers-per-address"
            )
        departed = [wid for wid, w in self.workers.items() if w.left]
        for wid in departed[: max(0, len(departed) - DEPARTED_KEPT)]:  # the oldest first
            del self.workers[wid]
        worker_id = uuid.uuid4().hex[:12]
        self.workers[worker_id] = WorkerRecord(name, usd_per_hour, self.clock(), max_model_len, address)
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

    def heartbeat(self, hb: Heartbeat, latest: int) -> None:
        """A worker's report. Versions it claims beyond `latest` (the newest published) are not recorded: they
        would fake T_bcast measurements and grow its records without bound."""
        self.saw(hb.worker_id, hb.version_loaded if hb.version_loaded <= latest else -1)
        w = self.workers[hb.worker_id]
        downloading = hb.downloading_version
        w.downloading_version = downloading if downloading is None or downloading <= latest else None
        w.download_progress, w.tokens_per_s = hb.download_progress, hb.tokens_per_s
        self.measure_uplink(w, hb.upload_bytes)
        if 0 <= hb.ready_version <= latest:
            w.first_ready_with.setdefault(hb.ready_version, w.last_seen)
        w.swap_s = hb.swap_s or w.swap_s

    def measure_uplink(self, w: WorkerRecord, upload_bytes: int) -> None:
        """Its upload rate since the counter was last read, once at least half a heartbeat period has passed (a
        burst of heartbeats cannot make a rate out of a rounding error); the uplink is the peak of these rates,
        decaying with UPLINK_HALF_LIFE_S so that one fast moment long ago does not count forever."""
        now = w.last_seen
        if not w.beat_at or upload_bytes < w.upload_bytes:  # the first reading, or a restarted counter
            w.upload_bytes, w.beat_at = upload_bytes, now
            return
        elapsed = now - w.beat_at
        if elapsed < self.heartbeat_s / 2:
            return
        rate = (upload_bytes - w.upload_bytes) / elapsed
        w.uplink = max(rate, w.uplink * 0.5 ** (elapsed / UPLINK_HALF_LIFE_S))
        w.upload_bytes, w.beat_at = upload_bytes, now

    def silent(self) -> list[str]:
        """Workers that have not left and have said nothing for FORGET_AFTER_S: gone, without a word."""
        now = self.clock()
        return [wid for wid, w in self.workers.items() if not w.left and now - w.last_seen > FORGET_AFTER_S]

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
