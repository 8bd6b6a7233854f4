"""A discrete-event simulator of one learner, a worker pool and version dissemination.

It checks the closed forms in `plan.py` against the rules the real system runs by, not against the
closed forms' own assumptions. Pure Python, no I/O; `simulate` runs 100 steps of a 16-worker pool in
a few milliseconds.

What it models (each rule is the one in `learner/coordinator.py`, `learner/loop.py` or `worker/loop.py`):
- The learner takes the B oldest admissible groups (FIFO by completion), trains for T_train, then
  version t+1 exists; it is published when (t+1) % kappa == 0. Waiting for a full batch is the bubble.
- A published version reaches worker i after t_bcast_i (download + verify + reload). A worker swaps
  only between leases, so a lease in progress finishes with the version it started with.
- A worker pulls leases of at most `lease_prompts` prompts (and at most B); k prompts take k * G / mu_i s.
- Per-worker cap (`Coordinator._lease_cap`): B until the learner has measured a step; then what the worker
  returns while a group made now stays admissible, floor(mu_i * (S - lag + 1) * P / G) prompts (none if that
  is 0: the worker waits), with P the median wall time of the learner's last 5 steps (waiting included, as
  `set_step_time` gets it), or the time since the last step ended if that is longer. mu_i is the worker's
  true speed here; the coordinator measures it (valid rollouts returned / seconds its leases were out) and
  gives a worker measured only cold one prompt.
- Lease cap: a worker whose version lags the learner's by `lag` gets prompts only while fewer than
  B * (S - lag + 1) prompts are in flight (leased, waiting, or in the step being trained); a worker more
  than S behind waits for its download. Groups that are still inadmissible when their step comes are
  dropped and counted (the cap makes that rare).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SimWorker:
    rollouts_per_s: float  # mu_i
    lease_prompts: int = 4
    t_bcast_s: float = 0.0  # publish -> this worker can generate with the version


@dataclass
class SimResult:
    bubble_ratio: float  # waiting for rollouts / wall time, over the steps after warm-up
    step_time_s: float  # mean wall time per learner step after warm-up
    steps: int
    stale_dropped: int  # groups dropped as inadmissible
    staleness_hist: Counter[int] = field(default_factory=Counter)  # t - x over trained groups
    worker_busy: list[float] = field(default_factory=list)  # fraction of time each worker generated


def simulate(
    *,
    batch_prompts: int,
    group_size: int,
    t_train_s: float,
    staleness: int,
    kappa: int,
    workers: list[SimWorker],
    steps: int = 100,
    warmup_steps: int = 10,
) -> SimResult:
    """Run `steps` learner steps; report the bubble ratio over steps warmup_steps..steps-1."""
    B, G, S = batch_prompts, group_size, staleness
    n = len(workers)
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, worker)
    seq = 0

    def push(t: float, kind: str, w: int = -1) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, w))
        seq += 1

    version = 0  # learner: parameters after `version` steps
    arrived = [[0] for _ in range(n)]  # versions that have reached each worker (v0 at start)
    loaded = [0] * n
    busy = [False] * n
    poll_at = [-1.0] * n  # a worker too slow for the current step asks again when the step has lasted long enough
    busy_time = [0.0] * n
    outstanding = 0  # prompts leased and not yet returned
    ready: deque[int] = deque()  # versions of finished groups, in completion order
    training = 0
    step_starts: list[float] = []
    waits: list[float] = []
    idle_since = 0.0
    stale_dropped = 0
    hist: Counter[int] = Counter()

    def try_lease(i: int, now: float) -> None:
        nonlocal outstanding
        w = workers[i]
        loaded[i] = max(arrived[i])
        lag = version - loaded[i]
        if lag > S:
            return  # 'update': wait for the download
        room = B * (S - lag + 1) - (outstanding + len(ready) + training)
        most = cap(w, lag, now)
        k = min(w.lease_prompts, room, most)
        if most == 0 and poll_at[i] <= now:
            poll_at[i] = idle_since + G / (w.rollouts_per_s * (S - lag + 1)) * (1 + 1e-9)
            push(poll_at[i], "poll", i)
        if k <= 0:
            return  # 'wait'
        busy[i] = True
        outstanding += k
        dt = k * G / w.rollouts_per_s
        busy_time[i] += dt
        push(now + dt, f"done:{k}:{loaded[i]}", i)

    def cap(w: SimWorker, lag: int, now: float) -> int:
        if version == 0:
            return B  # no step measured yet; never more than one batch
        periods = [waits[j] + t_train_s for j in range(version)][-5:]  # the steps done: the coordinator's step_times
        step_s = max(statistics.median(periods), now - idle_since)  # idle_since: the last advance
        return min(B, math.floor(w.rollouts_per_s * (S - lag + 1) * step_s / G))

    def try_train(now: float) -> None:
        nonlocal training, stale_dropped, idle_since
        if training or len(step_starts) >= steps:
            return
        for x in [x for x in ready if version - x > S]:
            ready.remove(x)
            stale_dropped += 1
        if len(ready) < B:
            return
        for _ in range(B):
            hist[version - ready.popleft()] += 1
        training = B
        waits.append(now - idle_since)
        step_starts.append(now)
        push(now + t_train_s, "trained")

    push(0.0, "start")
    now = 0.0
    while events and not (len(step_starts) >= steps and not training):
        now, _, kind, i = heapq.heappop(events)
        if kind.startswith("done:"):
            _, k, x = kind.split(":")
            outstanding -= int(k)
            ready.extend([int(x)] * int(k))
            busy[i] = False
        elif kind == "trained":
            version += 1
            training = 0
            idle_since = now
            if version % kappa == 0:
                for j, w in enumerate(workers):
                    push(now + w.t_bcast_s, f"arrive:{version}", j)
        elif kind.startswith("arrive:"):
            arrived[i].append(int(kind.split(":")[1]))
        try_train(now)
        for j in range(n):
            if not busy[j]:
                try_lease(j, now)
        try_train(now)

    end = now
    w0 = min(warmup_steps, len(step_starts) - 1)
    span = end - step_starts[w0] + waits[w0]  # from the end of step w0-1
    waited = sum(waits[w0:])
    return SimResult(
        bubble_ratio=waited / span if span > 0 else 0.0,
        step_time_s=span / (len(step_starts) - w0),
        steps=len(step_starts),
        stale_dropped=stale_dropped,
        staleness_hist=hist,
        worker_busy=[b / end for b in busy_time] if end > 0 else [0.0] * n,
    )


def simulated_knee(
    *,
    batch_prompts: int,
    group_size: int,
    t_train_s: float,
    t_bcast_s: float,
    staleness: int,
    kappa: int,
    n_workers: int,
    lease_prompts: int = 4,
    tolerance: float = 0.01,
    steps: int = 120,
    lo: float = 1e-3,
    hi: float = 1e4,
) -> float:
    """Smallest pool throughput (rollouts/s, n identical workers) whose bubble ratio comes within
    `tolerance` of the bubble ratio at unbounded throughput: the knee of the bubble-vs-mu curve.

    Bisection on a log scale, which assumes the curve is non-increasing (a tested property).
    """

    def bubble(mu_pool: float) -> float:
        pool = [SimWorker(mu_pool / n_workers, lease_prompts, t_bcast_s)] * n_workers
        return simulate(
            batch_prompts=batch_prompts,
            group_size=group_size,
            t_train_s=t_train_s,
            staleness=staleness,
            kappa=kappa,
            workers=pool,
            steps=steps,
        ).bubble_ratio

    floor = bubble(hi)
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if bubble(mid) <= floor + tolerance:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1.001:
            break
    return hi
