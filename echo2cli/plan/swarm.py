"""How long a version takes to reach a fleet: a fluid model of echo2's broadcast plane (`broadcast/node.py`).

The fleet is grouped into classes of identical workers (links, NAT, share of the first copy); every worker of a
class is alike, so a fleet of 4,096 costs what its handful of classes cost. Time advances in small steps, and in
each step:

- **The learner's uplink** U is split evenly (TCP's fair share), up to each taker's downlink, among the workers
  that take from it. A worker whose own share of the first copy (`fleet.share_widths`: by uplink) is incomplete
  takes that share. Once it holds it, it spares the learner if it has a peer to trade with
  (`TorrentNode._spare_learner`); with none (every worker NAT'd: no two can connect) it takes the rest of the
  version from the learner too. A spared worker whose download stalls for GATE_STALL_S takes from the learner
  again, for good (a firewalled worker's share is then fetched from the learner by the others). A firewalled
  worker reaches no peer: after WEB_SEED_AFTER_S without a byte it takes the whole version from the learner's
  web seed.
- **Each worker's uplink** serves the workers it can connect to (two NAT'd workers cannot; a firewalled one
  reaches nobody), split in proportion to what they ask for. A worker asks for at most its downlink's rest and
  only for content that exists among the peers it reaches: the union of what the learner has sent to reachable
  workers (a NAT'd worker sees what reachable workers hold, including what they copied from NAT'd ones).
- **Upload slots.** libtorrent unchokes at most UNCHOKE_SLOTS peers at a time (its `unchoke_slots_limit`, 8, which
  echo2 leaves as it is), so the learner serves at most 8 takers at once and the rest wait their turn: its
  uplink is time-shared, and to workers with downlinks below U/8 it cannot be filled.
- **Efficiency.** Every rate is its link's times eta / (1 + beta (k - 1)), k = min(N, UNCHOKE_SLOTS) the
  connections a node keeps busy at once (as fitted: 95 % of the link rate at N = 2, 85 % from N = 8 on), and
  nothing moves before **start_s** (tracker announce, connections, the first request round trip). eta, beta and
  start_s are fitted on real runs (`fit`).

What it leaves out, on purpose: piece granularity (a piece is passed on only once whole: with ~512 pieces a
version's pipeline delay is a few pieces' time), end-game, connection limits (libtorrent keeps up to 200 peers a
torrent; the fluid exchange assumes any reachable pair trades) and hole punching.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from echo2cli.broadcast.node import GATE_STALL_S, WEB_SEED_AFTER_S
from echo2cli.errors import ConfigError
from echo2cli.learner.fleet import MAX_WORKERS, share_widths

OPEN, NAT, FIREWALL = "", "nat", "firewall"
MAX_CLASSES = 32  # more distinct links than this are binned (`_classes`)
# Time steps per lower bound T* (within 0.3 % of 6,000 steps on the fleets of the docs); past T*, a step is this
# share of the time so far, so a broadcast far slower than T* (NAT'd workers that only one open worker reaches, a
# firewalled one waiting out the web seed's delay on a tiny version) takes STEPS * (1 + ln(t / T*)) steps, not t / T*
# times STEPS.
STEPS = 600


@dataclass(frozen=True)
class Worker:
    up: float  # bytes/s
    down: float  # bytes/s
    behind: str = OPEN  # "", "nat" or "firewall"


Policy = Literal["fair", "behind_first"]
UNCHOKE_SLOTS = 8  # libtorrent's unchoke_slots_limit (default), which echo2 does not change


@dataclass(frozen=True)
class Constants:
    # fitted on 6 runs of `echo2 bench broadcast` at N = 2, 4, 8 (scripts/bench_swarm_model.py, docs/BENCHMARKS.md)
    eta: float = 0.97  # the fraction of a link's rate one connection gets
    beta: float = 0.02  # the loss per further busy connection
    start_s: float = 0.25  # "go" -> the first byte moves

    def efficiency(self, connections: int) -> float:
        return self.eta / (1.0 + self.beta * (min(connections, UNCHOKE_SLOTS) - 1))


@dataclass
class Spread:
    """One version reaching a fleet."""

    t50_s: float  # half the workers hold it
    t95_s: float
    t100_s: float
    lower_bound_s: float  # T*, as `bench broadcast` defines it
    learner_upload_over_size: float  # web seed included
    web_seed_over_size: float
    classes: int

    @property
    def ratio(self) -> float:
        return self.t100_s / self.lower_bound_s


def lower_bound_s(size: float, learner_up: float, workers: Sequence[Worker]) -> float:
    """T* of `echo2 bench broadcast` (`bench.broadcast.lower_bound_s`): no broadcast of M bytes over these links is
    faster."""
    from echo2cli.bench.broadcast import lower_bound_s as bound

    return bound(size, len(workers), learner_up, [w.down for w in workers], [w.up for w in workers])


def _classes(workers: Sequence[Worker]) -> tuple[list[Worker], list[int], list[float]]:
    """Workers with the same links merged into a class: (kind, count, share of the first copy per worker). Past
    MAX_CLASSES distinct links, each kind's workers are sorted by downlink (then uplink) and cut into runs of equal
    size, a class each, with the run's mean rates: the fleet's capacity is kept, its spread within a run is not. The
    slowest worker of each kind stays a class of its own, so that the last one's time stays its own."""
    widths = share_widths([w.up for w in workers])
    total = sum(widths)
    members: dict[Worker, list[int]] = {}
    if len(set(workers)) <= MAX_CLASSES:
        for i, w in enumerate(workers):
            members.setdefault(w, []).append(i)
    else:
        for kind in (OPEN, NAT, FIREWALL):
            ids = sorted(
                (i for i, w in enumerate(workers) if w.behind == kind), key=lambda i: (workers[i].down, workers[i].up)
            )
            if not ids:
                continue
            runs = max(1, round(MAX_CLASSES * len(ids) / len(workers)))
            cuts = [0, 1] + [1 + r * (len(ids) - 1) // runs for r in range(1, runs + 1)]  # the slowest alone
            for a, b in zip(cuts, cuts[1:], strict=False):
                chunk = ids[a:b]
                if not chunk:
                    continue
                up = sum(workers[i].up for i in chunk) / len(chunk)
                down = sum(workers[i].down for i in chunk) / len(chunk)
                members.setdefault(Worker(up, down, kind), []).extend(chunk)
    groups = list(members.values())
    return list(members), [len(g) for g in groups], [sum(widths[i] for i in g) / len(g) / total for g in groups]


def spread(
    size: float,
    learner_up: float,
    workers: Sequence[Worker],
    constants: Constants = Constants(),
    policy: Policy = "fair",
) -> Spread:
    """Simulate one version of `size` bytes from a learner with uplink `learner_up` (bytes/s) to `workers`.

    `policy`: how a worker's uplink is split among the peers asking it. "fair": in proportion to what they ask,
    as TCP shares an uplink among libtorrent's unchoked connections (echo2 today). "behind_first": the peers
    that need the longest at their own downlink to finish are served first (a proposal: docs/BENCHMARKS.md)."""
    if size <= 0 or learner_up <= 0 or not workers:
        raise ConfigError("a broadcast needs a positive size, a positive learner uplink and at least one worker")
    if any(w.up <= 0 or w.down <= 0 or w.behind not in (OPEN, NAT, FIREWALL) for w in workers):
        raise ConfigError("every worker needs positive up- and downlinks and is behind nothing, nat or firewall")
    bound = lower_bound_s(size, learner_up, workers)
    swarm = _Swarm(size, learner_up, workers, constants.efficiency(len(workers)), dt=bound / STEPS)
    while not swarm.done():
        # T* counts uplinks that NAT-to-NAT and firewalled pairs never use: a fleet may take any multiple of it
        swarm.dt = max(bound, swarm.t) / STEPS
        swarm.step(policy)
    times = sorted((d + constants.start_s, n) for d, n in zip(swarm.done_at, swarm.count, strict=True) if d is not None)
    return Spread(
        t50_s=_quantile(times, 0.5),
        t95_s=_quantile(times, 0.95),
        t100_s=times[-1][0],
        lower_bound_s=bound,
        learner_upload_over_size=swarm.sent / size,
        web_seed_over_size=swarm.web / size,
        classes=len(swarm.kinds),
    )


class _Swarm:
    """The state of a broadcast in progress: per class, per worker, in fractions of the version."""

    def __init__(self, size: float, learner_up: float, workers: Sequence[Worker], eta: float, dt: float) -> None:
        self.size, self.learner_up, self.eta, self.dt = size, learner_up, eta, dt
        self.kinds, self.count, self.share = _classes(workers)
        self.reach = _reach(self.kinds, self.count)
        c = len(self.kinds)
        self.have = [0.0] * c
        self.own = [0.0] * c  # of its own share
        self.for_good = [False] * c  # takes from the learner again, for good
        self.idle_since = [0.0] * c
        self.web_seed = [False] * c
        self.done_at: list[float | None] = [None] * c
        self.from_learner = [0.0] * c  # what the learner sent each worker of the class
        self.sent = self.web = self.t = 0.0  # the learner's upload and its web seed's, bytes; seconds
        n_open = sum(n for k, n in zip(self.kinds, self.count, strict=True) if k.behind == OPEN)
        n_trading = sum(n for k, n in zip(self.kinds, self.count, strict=True) if k.behind != FIREWALL)
        self.peers = [{OPEN: n_trading - 1, NAT: n_open, FIREWALL: 0}[k.behind] for k in self.kinds]

    def done(self) -> bool:
        return all(d is not None for d in self.done_at)

    def step(self, policy: Policy) -> None:
        c, dt, size = len(self.kinds), self.dt, self.size
        from_learner = self._learner()
        rest = [self.eta * self.kinds[i].down * dt - from_learner[i] for i in range(c)]
        union = self._union()
        ask = [
            0.0
            if self.done_at[i] is not None or self.kinds[i].behind == FIREWALL
            else max(0.0, min(rest[i], (union[self.kinds[i].behind] - self.have[i]) * size))
            for i in range(c)
        ]
        up = [self.eta * k.up * dt for k in self.kinds]
        if policy == "behind_first":
            behind = sorted(range(c), key=lambda i: -(1.0 - self.have[i]) / self.kinds[i].down)
            from_peers = _serve_in_order(self.reach, self.count, self.have, ask, up, behind)
        else:
            from_peers = _exchange(self.reach, self.count, self.have, ask, up)
        self._advance(from_learner, from_peers)

    def _union(self) -> dict[str, float]:
        """The content that exists among the peers a worker reaches, by the kind of worker: what the learner sent
        reachable workers, plus what it sent NAT'd ones as far as reachable ones copied it (independently:
        1 - prod (1 - have)^n over the reachable)."""
        c, kinds, count = len(self.kinds), self.kinds, self.count
        from_open = min(1.0, sum(self.from_learner[i] * count[i] for i in range(c) if kinds[i].behind == OPEN))
        from_nat = sum(self.from_learner[i] * count[i] for i in range(c) if kinds[i].behind == NAT)
        from_nat = min(1.0 - from_open, from_nat)
        copied = 1.0 - math.prod((1.0 - self.have[i]) ** count[i] for i in range(c) if kinds[i].behind == OPEN)
        return {OPEN: from_open + from_nat, NAT: from_open + from_nat * copied, FIREWALL: 0.0}

    def _learner(self) -> list[float]:
        """Bytes the learner sends each worker of each class in this step: an equal share among its takers, each up
        to its downlink (while it is unchoked: UNCHOKE_SLOTS at a time) and what it still wants from the learner."""
        want = [0.0] * len(self.kinds)
        for i, k in enumerate(self.kinds):
            if self.done_at[i] is not None:
                continue
            if k.behind == FIREWALL:
                want[i] = 1.0 - self.have[i] if self.web_seed[i] else 0.0
            elif self.own[i] < self.share[i]:
                want[i] = self.share[i] - self.own[i]
            elif self.for_good[i] or self.peers[i] == 0:
                want[i] = 1.0 - self.have[i]
        takers = sum(n for w, n in zip(want, self.count, strict=True) if w > 0)
        turn = min(1.0, UNCHOKE_SLOTS / takers) if takers else 0.0  # the share of the time a taker is unchoked
        cap = [min(turn * self.eta * k.down * self.dt, w * self.size) for k, w in zip(self.kinds, want, strict=True)]
        return _water_fill(self.eta * self.learner_up * self.dt, cap, self.count)

    def _advance(self, from_learner: list[float], from_peers: list[float]) -> None:
        """Take this step's bytes in; start the web seed, or take from the learner again, where a download stalled."""
        t = self.t + self.dt
        for i, kind in enumerate(self.kinds):
            if self.done_at[i] is not None:
                continue
            got = (from_learner[i] + from_peers[i]) / self.size
            if kind.behind != FIREWALL and self.own[i] < self.share[i]:
                own = self.own[i] + from_learner[i] / self.size
                self.own[i] = self.share[i] if own >= self.share[i] * (1 - 1e-9) else own  # no sliver from rounding
            self.from_learner[i] += from_learner[i] / self.size
            self.have[i] = min(1.0, self.have[i] + got)
            if got > 1e-12:
                self.idle_since[i] = t
            stalled = t - self.idle_since[i]
            if kind.behind == FIREWALL and stalled >= WEB_SEED_AFTER_S:
                self.web_seed[i] = True
            elif kind.behind != FIREWALL and self.own[i] >= self.share[i] and stalled >= GATE_STALL_S:
                self.for_good[i] = True
            if self.have[i] >= 1.0 - 1e-9:
                self.done_at[i] = t
        self.sent += sum(g * n for g, n in zip(from_learner, self.count, strict=True))
        walled = zip(from_learner, self.count, self.kinds, strict=True)
        self.web += sum(g * n for g, n, k in walled if k.behind == FIREWALL)
        self.t = t


def parse_fleet(text: str, source: str = "--fleet") -> list[Worker]:
    """One line per worker, or per COUNT identical workers: `[COUNTx] UP_MBPS DOWN_MBPS [nat|firewall]`, `#` starts a
    comment. `350x 1000 1000` is 350 workers on symmetric 1 Gbit/s links; `150x 1000 1000 nat` 150 more behind NAT.
    (The links files of `echo2 bench broadcast --links` are fleet files.)"""
    workers: list[Worker] = []
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        count = 1
        if match := re.fullmatch(r"(\d+)x", fields[0]):
            count, fields = int(match.group(1)), fields[1:]
        try:
            if len(fields) not in (2, 3) or count < 1:
                raise ValueError
            up, down = float(fields[0]), float(fields[1])
            behind = fields[2] if len(fields) == 3 else OPEN
            if not (up > 0 and down > 0 and math.isfinite(up + down)) or behind not in (NAT, FIREWALL, OPEN):
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"{source} line {number}: {raw.strip()!r} is not `[COUNTx] UP_MBPS DOWN_MBPS [nat|firewall]` with "
                "positive rates"
            ) from None
        if len(workers) + count > MAX_WORKERS:  # checked before the list is built: `10**11x` is a MemoryError
            raise ConfigError(f"{source}: more than {MAX_WORKERS} workers (the learner admits at most that many)")
        workers += [Worker(up * 1e6 / 8, down * 1e6 / 8, behind)] * count
    if not workers:
        raise ConfigError(f"{source} lists no worker: one line per worker or class, `[COUNTx] UP_MBPS DOWN_MBPS [nat]`")
    return workers


def _water_fill(capacity: float, caps: list[float], count: list[int]) -> list[float]:
    """Split `capacity` evenly among count[i] takers of each class, none above its cap: per taker of each class."""
    got = [0.0] * len(caps)
    open_ = [i for i, cap in enumerate(caps) if cap > 0]
    while open_ and capacity > 1e-12:
        each = capacity / sum(count[i] for i in open_)
        full = [i for i in open_ if caps[i] - got[i] <= each]
        if not full:
            for i in open_:
                got[i] += each
            break
        for i in full:
            capacity -= (caps[i] - got[i]) * count[i]
            got[i] = caps[i]
        open_ = [i for i in open_ if i not in full]
    return got


def _reach(kinds: list[Worker], count: list[int]) -> list[list[int]]:
    """For each sending class, the classes its workers can connect to: not two NAT'd ones, never a firewalled one,
    and its own class only if it has another worker."""
    c = len(kinds)
    return [
        [
            i
            for i in range(c)
            if FIREWALL not in (kinds[j].behind, kinds[i].behind)
            and not kinds[j].behind == kinds[i].behind == NAT
            and (i != j or count[j] > 1)
        ]
        for j in range(c)
    ]


def _serve_in_order(
    reach: list[list[int]], count: list[int], have: list[float], ask: list[float], up: list[float], order: list[int]
) -> list[float]:
    """Like `_exchange`, but the classes in `order` are served one after the other, each as much as it asks of
    the uploads that reach it (taken from each uploader in proportion to what it has left)."""
    c = len(count)
    supply = [up[j] * count[j] if have[j] > 0 else 0.0 for j in range(c)]
    got = [0.0] * c
    for i in order:
        senders = [j for j in range(c) if i in reach[j] and supply[j] > 0]
        available = sum(supply[j] for j in senders)
        take = min(ask[i] * count[i], available)
        if take <= 0:
            continue
        for j in senders:
            supply[j] -= take * supply[j] / available
        got[i] = take
    return [g / n for g, n in zip(got, count, strict=True)]


def _exchange(
    reach: list[list[int]], count: list[int], have: list[float], ask: list[float], up: list[float]
) -> list[float]:
    """Per worker of each class, what its peers send it in one step. Each class's uploads (count x uplink) are
    split among the classes it reaches in proportion to what they ask; a class offered more than it asks takes
    what it asks, and what is left on either side is matched again (three rounds). A class holding nothing sends
    nothing."""
    c = len(count)
    supply = [up[j] * count[j] if have[j] > 0 else 0.0 for j in range(c)]
    demand = [ask[i] * count[i] for i in range(c)]
    got = [0.0] * c
    for _ in range(3):
        offered = [0.0] * c
        offers: list[tuple[int, int, float]] = []
        for j in range(c):
            if supply[j] <= 0:
                continue
            asked = sum(demand[i] for i in reach[j])
            if asked <= 0:
                continue
            for i in reach[j]:
                if demand[i] > 0:
                    amount = supply[j] * demand[i] / asked
                    offers.append((j, i, amount))
                    offered[i] += amount
        if not offers:
            break
        scale = [min(1.0, demand[i] / offered[i]) if offered[i] > 0 else 0.0 for i in range(c)]
        for j, i, amount in offers:
            supply[j] -= amount * scale[i]
        for i in range(c):
            got[i] += offered[i] * scale[i]
            demand[i] -= offered[i] * scale[i]
        if sum(demand) <= 1e-9 * max(1.0, sum(got)) or sum(supply) <= 0:
            break
    return [g / n for g, n in zip(got, count, strict=True)]


def _quantile(times: list[tuple[float, int]], q: float) -> float:
    """The time by which a fraction q of the workers hold the version (times weighted by their class counts)."""
    n = sum(k for _, k in times)
    target = math.ceil(q * n - 1e-9)
    seen = 0
    for t, k in times:
        seen += k
        if seen >= target:
            return t
    return times[-1][0]


@dataclass(frozen=True)
class Run:
    """A measured broadcast (`echo2 bench broadcast` row): what the model is fitted on and checked against."""

    size: float  # bytes
    learner_up: float  # bytes/s
    workers: tuple[Worker, ...]
    t_bcast_s: float  # measured: the last worker holds the version


def fit(runs: Sequence[Run]) -> Constants:
    """The constants that make the model's T_bcast closest to the measured ones (least squares on the log of the
    ratio): eta and beta on a coarse grid, then a fine one around the best; start_s (additive) by a search of its
    own for each pair."""
    if not runs:
        raise ConfigError("fitting the swarm model needs at least one measured run")

    def best_start(eta: float, beta: float) -> tuple[float, Constants]:
        modelled = [spread(r.size, r.learner_up, r.workers, Constants(eta, beta, 0.0)).t100_s for r in runs]
        losses = []
        for start in [0.05 * i for i in range(61)]:
            loss = sum(math.log((m + start) / r.t_bcast_s) ** 2 for m, r in zip(modelled, runs, strict=True))
            losses.append((loss, Constants(round(eta, 2), round(beta, 2), round(start, 2))))
        return min(losses, key=lambda x: x[0])

    coarse = min((best_start(0.60 + 0.05 * i, 0.04 * j) for i in range(9) for j in range(5)), key=lambda x: x[0])
    eta, beta = coarse[1].eta, coarse[1].beta
    fine = [
        best_start(eta + 0.01 * i, beta + 0.01 * j)
        for i in range(-4, 5)
        for j in range(-3, 4)
        if 0 < eta + 0.01 * i <= 1.0 and beta + 0.01 * j >= 0
    ]
    return min([coarse, *fine], key=lambda x: x[0])[1]
