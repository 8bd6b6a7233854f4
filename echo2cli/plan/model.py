"""The overlap capacity model and cost-aware activation. Pure functions: no I/O, no torch.

Symbols (ECHO-2, arXiv 2602.02192): B = rollouts per learner step (prompts x G), T = T_train
(learner compute per step, s), T_b = T_bcast (publish -> the fleet generates with it, s), S = staleness
bound, kappa = publish every kappa steps, mu_i = rollouts/s of worker i, mu = sum over active workers,
gamma = provisioning margin, q_i = rollouts in one lease of worker i (prompts_per_lease x G, at most B).

Two thresholds (derivation: docs/DESIGN-NOTES.md, "Capacity model"):

- The paper's rule. Per publication period the learner consumes kappa*B rollouts and one snapshot must
  spread first:  T_b + kappa*B/mu <= kappa*T  =>  mu_min = kappa*B / (kappa*T - T_b).
- echo2's rule, derived from what the coordinator admits. Step t may train on version t - S_e or newer,
  S_e = S - kappa + 1 (versions exist only every kappa steps). That version lands on workers T_b after
  step t - S_e - 1 ends, so the pool has a window of (S_e + 1)*P - T - T_b to produce step t's batch,
  where P is the step period. Producing a batch from a standing start takes t_gen: whole leases, each
  worker's lease taking L_i = q_i/mu_i; with S_e = 0 never less than the slowest L_i (whoever asks first
  gets part of the one batch in flight, so a slow worker is its straggler). With S_e >= 1 a worker holds
  only what it returns while its groups stay admissible (the coordinator's lease cap), so a slow worker's
  group lands in a later batch instead of holding this one up. The steady-state step period is

      P = max(T, B/mu, (T + T_b + t_gen) / (S_e + 1))        bubble ratio = 1 - T/P

  and P = T (no bubble) iff mu >= B/T and t_gen <= S_e*T - T_b. For n identical workers
  t_gen = X/mu with X = n*q*ceil(B/(n*q)), so  mu_min_echo2 = max(B/T, X / (S_e*T - T_b)).
  The simulator (`simulator.py`) puts the knee within 4 % of this over B, n, q, S and T_b/T sweeps
  (tests/test_plan.py); the paper's rule is off by up to a factor of 2 there. Mixed-speed pools are
  approximate (see the notes for the measured error).
- A worker that cannot return one group (G rollouts) within S + 1 steps of T gets no lease from the
  coordinator (`working`): it adds no throughput, takes no room, and is paid for if active.

Cost-aware activation: rho_i = p_i / (3600*mu_i) dollars per rollout; activate in increasing rho_i until
the active set's headroom mu / mu_min reaches gamma, passing over a worker that would lower it.
Cost per step = (learner price + active workers' prices) * P / 3600.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Literal

from echo2cli.errors import ConfigError

Rule = Literal["echo2", "paper"]
RANDOM_TRIALS = 4000  # Monte Carlo orders for the random-activation baseline (seeded: deterministic)


class PlanInputError(ConfigError):
    """An input no system can have (zero throughput, negative price, ...)."""


class InfeasibleError(ConfigError):
    """No amount of throughput keeps the learner busy under this S, kappa, T_train and T_bcast."""


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    usd_per_hour: float  # p_i
    rollouts_per_s: float  # mu_i, measured or declared
    lease_rollouts: float | None = None  # q_i; None = the plan's default
    up_mbps: float | None = None
    down_mbps: float | None = None

    @property
    def rho(self) -> float:
        """Dollars per rollout."""
        return self.usd_per_hour / (3600.0 * self.rollouts_per_s)


def kappa_problem(kappa: int, staleness: int) -> str | None:
    """Why a version published every kappa steps would not work under S, or None: kappa <= max(1, S - 1), since
    a version must stay admissible while the next one spreads (the learner config and the planner both check)."""
    if kappa <= max(1, staleness - 1):
        return None
    return (
        f"kappa={kappa} needs staleness S >= kappa + 1 (got S={staleness}): a version published every "
        "kappa steps must stay admissible while the next one spreads"
    )


@dataclass(frozen=True)
class PlanInputs:
    batch: float  # B, rollouts per learner step
    t_train_s: float  # T
    t_bcast_s: float  # T_b
    staleness: int  # S
    kappa: int = 1
    gamma: float = 1.1
    lease_rollouts: float = 32.0  # default q_i: 4 prompts per lease x G = 8
    learner_usd_per_hour: float = 0.0
    learner_rollouts_per_s: float | None = None  # the learner's own GPUs generating (centralized baseline)
    group_size: int = 8  # G: rollouts of one prompt, the smallest lease the coordinator grants

    def check(self) -> None:
        if self.batch <= 0 or self.t_train_s <= 0:
            raise PlanInputError(f"batch and t_train must be > 0 (got B={self.batch}, T_train={self.t_train_s})")
        if self.t_bcast_s < 0:
            raise PlanInputError(f"t_bcast must be >= 0 (got {self.t_bcast_s})")
        if self.staleness < 0 or self.kappa < 1:
            raise PlanInputError(f"need S >= 0 and kappa >= 1 (got S={self.staleness}, kappa={self.kappa})")
        if problem := kappa_problem(self.kappa, self.staleness):
            raise PlanInputError(problem)
        if self.gamma < 1:
            raise PlanInputError(f"gamma must be >= 1 (got {self.gamma})")
        if self.group_size < 1:
            raise PlanInputError(f"group_size must be >= 1 (got {self.group_size})")
        if self.lease_rollouts <= 0 or self.learner_usd_per_hour < 0:
            raise PlanInputError("lease_rollouts must be > 0 and the learner's price >= 0")
        if self.learner_rollouts_per_s is not None and self.learner_rollouts_per_s <= 0:
            raise PlanInputError("the learner's own throughput must be > 0 rollouts/s")

    @property
    def s_eff(self) -> int:
        """S_e: how many publications old a trained rollout may be, in units of steps."""
        return self.staleness - self.kappa + 1


def check_pool(pool: list[WorkerSpec]) -> None:
    names = [w.name for w in pool]
    if len(set(names)) != len(names):
        raise PlanInputError(f"worker names must be unique (got {names})")
    for w in pool:
        if not w.rollouts_per_s > 0 or not math.isfinite(w.rollouts_per_s):
            raise PlanInputError(f"worker {w.name}: throughput must be > 0 rollouts/s (got {w.rollouts_per_s})")
        if w.usd_per_hour < 0:
            raise PlanInputError(f"worker {w.name}: price must be >= 0 $/h (got {w.usd_per_hour})")
        if w.lease_rollouts is not None and w.lease_rollouts <= 0:
            raise PlanInputError(f"worker {w.name}: lease_rollouts must be > 0")


def mu_min_paper(inp: PlanInputs) -> float:
    """kappa*B / (kappa*T - T_b) rollouts/s. Example: B=64, T=10, T_b=1, kappa=1 -> 64/9 = 7.11."""
    slack = inp.kappa * inp.t_train_s - inp.t_bcast_s
    if slack <= 0:
        kappa_ok = math.floor(inp.t_bcast_s / inp.t_train_s) + 1
        raise InfeasibleError(
            f"paper's rule: kappa*T_train = {inp.kappa * inp.t_train_s:g} s <= T_bcast = {inp.t_bcast_s:g} s; "
            f"need T_bcast < {inp.kappa * inp.t_train_s:g} s, or kappa >= {kappa_ok} (S >= {kappa_ok + 1})"
        )
    return inp.kappa * inp.batch / slack


def working(inp: PlanInputs, pool: list[WorkerSpec]) -> list[WorkerSpec]:
    """The workers the coordinator leases to: one group (G rollouts) comes back while it is admissible, within
    S + 1 steps of T (`learner/leases.lease_cap`). A slower one gets no lease: it adds no throughput and takes
    no room. Example: G=8, S=2, T=10 s: a worker needs 8/30 = 0.27 rollouts/s.
    Not with S_e = 0: there the learner waits for whoever holds part of the one batch in flight, the measured
    step stretches to that worker's lease, and the cap (on the measured step) lets it in: every worker works."""
    if inp.s_eff == 0:
        return list(pool)
    return [w for w in pool if inp.group_size / w.rollouts_per_s <= (inp.staleness + 1) * inp.t_train_s]


def _lease(inp: PlanInputs, w: WorkerSpec) -> float:
    return min(w.lease_rollouts or inp.lease_rollouts, inp.batch)  # the coordinator never leases > B


def batch_time(inp: PlanInputs, pool: list[WorkerSpec]) -> float:
    """t_gen: seconds for the pool to return B rollouts in whole leases, all starting together.

    The smallest t with sum_i q_i * floor(t / L_i) >= B, L_i = q_i / mu_i. For n identical workers
    t_gen = L * ceil(B / (n*q)). Example: B=64, 4 workers of 2 rollouts/s, q=32: L = 16 s, t_gen = 16 s;
    with q=8: L = 4 s, 2 rounds of 4 leases, t_gen = 8 s.
    With S_e = 0 the batch is the first B prompts leased, so whoever asks first holds part of it: t_gen is at
    least max_i L_i. With S_e >= 1 the coordinator leases up to S_e + 1 batches ahead, and each worker holds
    only what it returns while its groups stay admissible (`learner/leases.lease_cap`): a slow worker's group
    goes into a later batch, and the batch does not wait for it.
    """
    if not pool:
        return math.inf
    leases = [(_lease(inp, w), _lease(inp, w) / w.rollouts_per_s) for w in pool]
    straggler = max(L for _, L in leases) if inp.s_eff == 0 else 0.0
    candidates = sorted({L * m for q, L in leases for m in range(1, math.ceil(inp.batch / q) + 1)})
    for t in candidates:
        if sum(q * math.floor(t / L + 1e-9) for q, L in leases) >= inp.batch - 1e-9:
            return max(t, straggler)
    return max(candidates[-1], straggler)


def step_time(inp: PlanInputs, pool: list[WorkerSpec]) -> float:
    """P = max(T, B/mu, (T + T_b + t_gen)/(S_e + 1)): steady-state seconds per learner step."""
    mu = sum(w.rollouts_per_s for w in pool)
    if mu <= 0:
        return math.inf
    return max(inp.t_train_s, inp.batch / mu, (inp.t_train_s + inp.t_bcast_s + batch_time(inp, pool)) / (inp.s_eff + 1))


def bubble_ratio(inp: PlanInputs, pool: list[WorkerSpec]) -> float:
    """1 - T/P: the share of wall time the learner waits for rollouts."""
    return 1.0 - inp.t_train_s / step_time(inp, pool) if pool else 1.0


def min_staleness(t_bcast_s: float, t_train_s: float, kappa: int = 1) -> int:
    """The smallest S at which the learner need not wait for versions to spread: S_e * T > T_b (`mu_min_echo2`)."""
    return kappa + math.floor(t_bcast_s / t_train_s)


def mu_min_echo2(inp: PlanInputs, pool: list[WorkerSpec]) -> float:
    """The throughput at which `pool`, sped up or slowed down as a whole, just stops the bubble:
    max(B/T, X/(S_e*T - T_b)) with X = t_gen * mu (independent of the speed-up).
    Example: B=64, T=10, T_b=1, S=2, 4 workers, q=32: X = 128, mu_min = max(6.4, 128/19) = 6.74."""
    window = inp.s_eff * inp.t_train_s - inp.t_bcast_s
    if window <= 0:
        s_ok = min_staleness(inp.t_bcast_s, inp.t_train_s, inp.kappa)
        raise InfeasibleError(
            f"S_e*T_train = {inp.s_eff}*{inp.t_train_s:g} s <= T_bcast = {inp.t_bcast_s:g} s: the learner waits "
            f"at any throughput; need S >= {s_ok} or T_bcast < {inp.s_eff * inp.t_train_s:g} s"
        )
    rate = inp.batch / inp.t_train_s
    if not pool:
        return max(rate, inp.batch / window)
    work = batch_time(inp, pool) * sum(w.rollouts_per_s for w in pool)  # X, rollouts
    return max(rate, work / window)


def headroom(inp: PlanInputs, pool: list[WorkerSpec], rule: Rule) -> float:
    """mu / mu_min for this set: >= 1 keeps the learner busy, >= gamma is the provisioning target."""
    if not pool:
        return 0.0
    mu = sum(w.rollouts_per_s for w in pool)
    return mu / (mu_min_paper(inp) if rule == "paper" else mu_min_echo2(inp, pool))


def activate(inp: PlanInputs, pool: list[WorkerSpec], order: list[WorkerSpec], rule: Rule) -> list[WorkerSpec]:
    """Take workers in `order` until the active set's headroom reaches gamma, passing over any worker that
    would lower it, and over any the coordinator would lease nothing to (`working`). Under echo2's rule with
    S_e = 0 a worker whose single lease takes longer than window/gamma (window = S_e*T - T_b) caps every set
    it joins below gamma — it would be the straggler of any batch — so it is considered only after the others."""
    window = inp.s_eff * inp.t_train_s - inp.t_bcast_s

    def fits(w: WorkerSpec) -> bool:
        return rule == "paper" or inp.s_eff > 0 or inp.gamma * _lease(inp, w) / w.rollouts_per_s <= window

    order = working(inp, order)
    active: list[WorkerSpec] = []
    for w in [w for w in order if fits(w)] + [w for w in order if not fits(w)]:
        if headroom(inp, active + [w], rule) > headroom(inp, active, rule):
            active.append(w)
        if headroom(inp, active, rule) >= inp.gamma * (1 - 1e-9):
            break
    return active


def cost_aware_order(pool: list[WorkerSpec]) -> list[WorkerSpec]:
    return sorted(pool, key=lambda w: (w.rho, -w.rollouts_per_s, w.name))


@dataclass
class Outcome:
    """One activation choice and what the model predicts for it."""

    active: list[str]
    mu_pool: float
    step_time_s: float
    bubble_ratio: float
    usd_per_step: float
    usd_per_1k_rollouts: float


@dataclass
class PlanResult:
    inputs: dict
    rule: Rule
    mu_min: float | None  # the paper's rule; None where it is infeasible
    mu_min_echo2: float  # for the recommended active set
    mu_rate_bound: float  # B/T
    batch_work_rollouts: float  # X for the recommended set
    target_mu: float  # gamma * the rule's mu_min
    paper_feasible: bool
    recommended: Outcome | None  # None with no pool: the thresholds alone
    standby: list[str]
    meets_target: bool | None
    baselines: dict[str, Outcome] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def outcome(inp: PlanInputs, active: list[WorkerSpec]) -> Outcome:
    """A worker too slow to get a lease (`working`) adds nothing to the step but is paid all the same."""
    leased = working(inp, active)
    p = step_time(inp, leased)
    usd = (inp.learner_usd_per_hour + sum(w.usd_per_hour for w in active)) * p / 3600.0
    return Outcome(
        [w.name for w in active],
        sum(w.rollouts_per_s for w in leased),
        p,
        1.0 - inp.t_train_s / p,
        usd,
        usd / inp.batch * 1000.0,
    )


def _expected(outcomes: list[Outcome], label: str) -> Outcome:
    n = len(outcomes)
    mean = lambda xs: sum(xs) / n  # noqa: E731
    return Outcome(
        [label],
        mean([o.mu_pool for o in outcomes]),
        mean([o.step_time_s for o in outcomes]),
        mean([o.bubble_ratio for o in outcomes]),
        mean([o.usd_per_step for o in outcomes]),
        mean([o.usd_per_1k_rollouts for o in outcomes]),
    )


def thresholds(inp: PlanInputs, rule: Rule, paper: float | None, bound: float) -> PlanResult:
    """The plan with no pool: mu_min by both rules and the rate bound. Without workers echo2's rule takes the
    batch work X = B (leases that fill the batch exactly), a lower bound on any real pool's mu_min_echo2."""
    notes = [
        "no pool given: mu_min_echo2 assumes leases that fill the batch exactly (X = B); "
        "give --workers or --mu for the cheapest active set"
    ]
    if paper is None:
        notes.append("the paper's rule is infeasible (kappa*T_train <= T_bcast); echo2's rule is not")
    return PlanResult(
        inputs=asdict(inp),
        rule=rule,
        mu_min=paper,
        mu_min_echo2=bound,
        mu_rate_bound=inp.batch / inp.t_train_s,
        batch_work_rollouts=float(inp.batch),
        target_mu=inp.gamma * (paper if rule == "paper" and paper is not None else bound),
        paper_feasible=paper is not None,
        recommended=None,
        standby=[],
        meets_target=None,
        notes=notes,
    )


def plan(inp: PlanInputs, pool: list[WorkerSpec], rule: Rule = "echo2", seed: int = 0) -> PlanResult:
    """Recommend the cheapest active set; compare with all-active, random and centralized baselines."""
    inp.check()
    check_pool(pool)
    try:
        paper: float | None = mu_min_paper(inp)
    except InfeasibleError:
        if rule == "paper":
            raise
        paper = None
    bound = mu_min_echo2(inp, [])  # raises InfeasibleError with the smallest S / largest T_bcast that work
    if not pool:
        return thresholds(inp, rule, paper, bound)
    chosen = activate(inp, pool, cost_aware_order(pool), rule)
    rng = random.Random(seed)
    randoms = [outcome(inp, activate(inp, pool, rng.sample(pool, len(pool)), rule)) for _ in range(RANDOM_TRIALS)]
    baselines = {"all_active": outcome(inp, pool), "random_activation": _expected(randoms, "random order")}
    notes = []
    if inp.learner_rollouts_per_s:
        p = inp.t_train_s + inp.batch / inp.learner_rollouts_per_s  # generate, then train: nothing overlaps
        usd = inp.learner_usd_per_hour * p / 3600.0
        baselines["centralized"] = Outcome(
            ["learner"], inp.learner_rollouts_per_s, p, 1.0 - inp.t_train_s / p, usd, usd / inp.batch * 1000.0
        )
    meets = headroom(inp, chosen, rule) >= inp.gamma * (1 - 1e-9)
    if not meets:
        notes.append("these workers do not reach gamma*mu_min: all that help are active and the learner will wait")
    if paper is None:
        notes.append("the paper's rule is infeasible (kappa*T_train <= T_bcast); echo2's rule is not")
    target = inp.gamma * (paper if rule == "paper" and paper is not None else mu_min_echo2(inp, chosen))
    return PlanResult(
        inputs=asdict(inp),
        rule=rule,
        mu_min=paper,
        mu_min_echo2=mu_min_echo2(inp, chosen),
        mu_rate_bound=inp.batch / inp.t_train_s,
        batch_work_rollouts=batch_time(inp, chosen) * sum(w.rollouts_per_s for w in chosen),
        target_mu=target,
        paper_feasible=paper is not None,
        recommended=outcome(inp, chosen),
        standby=[w.name for w in pool if w not in chosen],
        meets_target=meets,
        baselines=baselines,
        notes=notes,
    )
