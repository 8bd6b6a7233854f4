"""A discrete-event simulator of one learner, a worker pool and version dissemination.

It checks the closed forms in `model.py` against the rules the real system runs by, not against the
closed forms' own assumptions. Pure Python, no I/O; `simulate` runs 100 steps of a 16-worker pool in
a few milliseconds.

What it models (each rule is the one in `learner/leases.py`, `learner/admission.py`, `learner/loop.py` or
`worker/loop.py`; the two lease rules are the lease book's own functions):
- The learner takes the B oldest admissible groups (FIFO by completion), trains for T_train, then
  version t+1 exists; it is published when (t+1) % kappa == 0. Waiting for a full batch is the bubble.
- A published version reaches worker i after t_bcast_i (download + verify + reload). A worker swaps
  only between leases, so a lease in progress finishes with the version it started with.
- A worker pulls leases of at most `lease_prompts` prompts (and at most B); k prompts take k * G / mu_i s.
- Per-worker cap (`leases.lease_cap`): B until the learner has measured a step; then what the worker
  returns while a group made now stays admissible, floor(mu_i * (S - lag + 1) * P / G) prompts (none if that
  is 0: the worker waits), with P the median wall time of the learner's last 5 steps (waiting included, as
  `set_step_time` gets it), or the time since the last step ended if that is longer. mu_i is the worker's
  true speed here; the coordinator measures it (valid rollouts returned / seconds its leases were out) and
  gives a worker measured only cold one prompt.
- Room (`leases.room_left`): a worker whose version lags the learner's by `lag` gets prompts only while fewer than
  B * (S - lag + 1) prompts are in flight (leased, waiting, or in the step being trained); a worker more
  than S behind waits for its download. Groups that are still inadmissible when their step comes are
  dropped and counted (the cap makes that rare).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

from echo2cli.learner.leases import STEP_TIMES_KEPT, admissible_step_s, lease_cap, room_left


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
    run = _Run(batch_prompts, group_size, t_train_s, staleness, kappa, workers, steps)
    return run.result(run.until_done(), warmup_steps)


class _Run:
    """The simulation's state, advanced event by event: (time, seq, kind, worker) on a heap, where kind is
    "done:k:x" (a lease of k prompts made with version x returned), "trained", "arrive:v" or "poll"."""

    def __init__(
        self, B: int, G: int, t_train_s: float, S: int, kappa: int, workers: list[SimWorker], steps: int
    ) -> None:
        self.B, self.G, self.S, self.kappa, self.t_train_s = B, G, S, kappa, t_train_s
        self.workers, self.steps = workers, steps
        n = len(workers)
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.version = 0  # the learner: parameters after `version` steps
        self.arrived = [[0] for _ in range(n)]  # versions that have reached each worker (v0 at start)
        self.busy = [False] * n
        self.poll_at = [-1.0] * n  # a worker too slow for this step asks again once the step has lasted long enough
        self.busy_time = [0.0] * n
        self.outstanding = 0  # prompts leased and not yet returned
        self.ready: deque[int] = deque()  # versions of finished groups, in completion order
        self.training = 0
        self.step_starts: list[float] = []
        self.waits: list[float] = []
        self.idle_since = 0.0  # the learner's last advance
        self.stale_dropped = 0
        self.hist: Counter[int] = Counter()

    def push(self, t: float, kind: str, w: int = -1) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, w))
        self.seq += 1

    def until_done(self) -> float:
        """Process events until `steps` steps are trained; returns the time of the last event."""
        self.push(0.0, "start")
        now = 0.0
        while self.events and not (len(self.step_starts) >= self.steps and not self.training):
            now, _, kind, i = heapq.heappop(self.events)
            self.handle(kind, i, now)
            self.try_train(now)
            for j in range(len(self.workers)):
                if not self.busy[j]:
                    self.try_lease(j, now)
            self.try_train(now)
        return now

    def handle(self, kind: str, i: int, now: float) -> None:
        if kind.startswith("done:"):
            _, k, x = kind.split(":")
            self.outstanding -= int(k)
            self.ready.extend([int(x)] * int(k))
            self.busy[i] = False
        elif kind == "trained":
            self.version += 1
            self.training = 0
            self.idle_since = now
            if self.version % self.kappa == 0:
                for j, w in enumerate(self.workers):
                    self.push(now + w.t_bcast_s, f"arrive:{self.version}", j)
        elif kind.startswith("arrive:"):
            self.arrived[i].append(int(kind.split(":")[1]))

    def try_lease(self, i: int, now: float) -> None:
        w = self.workers[i]
        loaded = max(self.arrived[i])
        lag = self.version - loaded
        if lag > self.S:
            return  # 'update': wait for the download
        in_flight = self.outstanding + len(self.ready) + self.training
        room = room_left(batch_prompts=self.B, staleness=self.S, lag=lag, in_flight=in_flight)
        most = self.cap(w, lag, now)
        k = min(w.lease_prompts, room, most)
        if most == 0 and self.poll_at[i] <= now:
            self.poll_at[i] = self.idle_since + self.G / (w.rollouts_per_s * (self.S - lag + 1)) * (1 + 1e-9)
            self.push(self.poll_at[i], "poll", i)
        if k <= 0:
            return  # 'wait'
        self.busy[i] = True
        self.outstanding += k
        dt = k * self.G / w.rollouts_per_s
        self.busy_time[i] += dt
        self.push(now + dt, f"done:{k}:{loaded}", i)

    def cap(self, w: SimWorker, lag: int, now: float) -> int:
        """The coordinator's per-worker cap, with the worker's true speed."""
        if self.version == 0:
            return self.B  # no step measured yet; never more than one batch
        periods = [self.waits[j] + self.t_train_s for j in range(self.version)][-STEP_TIMES_KEPT:]
        step_s = admissible_step_s(periods, now - self.idle_since)
        return lease_cap(
            batch_prompts=self.B,
            group_size=self.G,
            staleness=self.S,
            lag=lag,
            rollouts_per_s=w.rollouts_per_s,
            step_s=step_s,
        )

    def try_train(self, now: float) -> None:
        if self.training or len(self.step_starts) >= self.steps:
            return
        for x in [x for x in self.ready if self.version - x > self.S]:
            self.ready.remove(x)
            self.stale_dropped += 1
        if len(self.ready) < self.B:
            return
        for _ in range(self.B):
            self.hist[self.version - self.ready.popleft()] += 1
        self.training = self.B
        self.waits.append(now - self.idle_since)
        self.step_starts.append(now)
        self.push(now + self.t_train_s, "trained")

    def result(self, end: float, warmup_steps: int) -> SimResult:
        w0 = min(warmup_steps, len(self.step_starts) - 1)
        span = end - self.step_starts[w0] + self.waits[w0]  # from the end of step w0-1
        waited = sum(self.waits[w0:])
        return SimResult(
            bubble_ratio=waited / span if span > 0 else 0.0,
            step_time_s=span / (len(self.step_starts) - w0),
            steps=len(self.step_starts),
            stale_dropped=self.stale_dropped,
            staleness_hist=self.hist,
            worker_busy=[b / end for b in self.busy_time] if end > 0 else [0.0] * len(self.workers),
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
