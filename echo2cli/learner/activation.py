"""Cost-aware activation inside the learner: the closed loop around `plan.py`.

Every `plan_every` steps, and at once when a worker joins or dies or the first T_bcast is measured, the
learner rebuilds the plan from what it measured — T_train (median of the last steps), T_bcast (median T_ready
of the last versions) and each worker's mu_i (rollouts / wall time its leases were out) with the price it
declared at join — and activates the cheapest set that reaches gamma*mu_min. The rest go on standby: no
leases, but they keep fetching and seeding every version, so one can be activated without a download.

A worker whose mu_i is not measured yet stays active until its first lease returns. Before T_train and
T_bcast have a measurement every worker is active. When no throughput keeps the learner busy (infeasible S
or T_bcast) every worker is active, and the decision says why. Each evaluation is one line of
`decisions.jsonl` in the run directory, with its reason, inputs and outcome.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from echo2cli.config import LearnerConfig
from echo2cli.learner.coordinator import Coordinator
from echo2cli.metrics import MetricsWriter
from echo2cli.plan.model import InfeasibleError, PlanInputs, WorkerSpec, plan

T_TRAIN_WINDOW = 5  # steps in the T_train median
T_BCAST_WINDOW = 5  # versions in the T_bcast median


class Activation:
    def __init__(self, cfg: LearnerConfig, coord: Coordinator, log_path: Path) -> None:
        self.cfg, self.coord = cfg, coord
        self.t_train: deque[float] = deque(maxlen=T_TRAIN_WINDOW)
        self.members: frozenset[str] = frozenset()
        self.measured_ids: frozenset[str] = frozenset()
        self.bcast_measured = False
        self.last_step = -(10**9)
        self.log = MetricsWriter(log_path)
        self.metrics: dict[str, Any] = {}
        self.standby: frozenset[str] = frozenset()

    def observe_step(self, t_train_s: float) -> None:
        self.t_train.append(t_train_s)

    def _reason(self, step: int, workers: list[dict], bcast_measured: bool) -> str | None:
        members = frozenset(w["worker_id"] for w in workers if w["active"])
        measured = frozenset(w["worker_id"] for w in workers if w["rollouts_per_s"] is not None)
        names = {w["worker_id"]: w["name"] for w in workers}
        reason = None
        if members != self.members:
            joined = sorted(names[w] for w in members - self.members)
            gone = sorted(names[w] for w in self.members - members)
            reason = "; ".join(
                filter(
                    None, [f"joined: {', '.join(joined)}" if joined else "", f"gone: {', '.join(gone)}" if gone else ""]
                )
            )
        elif measured != self.measured_ids:
            reason = f"first throughput of: {', '.join(sorted(names[w] for w in measured - self.measured_ids))}"
        elif bcast_measured and not self.bcast_measured:
            reason = "first T_bcast"
        elif step - self.last_step >= self.cfg.plan_every:
            reason = f"every {self.cfg.plan_every} steps"
        self.members, self.measured_ids, self.bcast_measured = members, measured, bcast_measured
        return reason

    def update(self, step: int) -> dict[str, Any] | None:
        """Re-plan if it is time or the fleet changed; returns the decision record when one was made."""
        if self.cfg.activation != "cost":
            return None
        workers = self.coord.measured()  # one snapshot: this runs every poll of the learner's wait loop
        # once measured, always measured: the copy of every version's times is made only until then
        bcast_measured = self.bcast_measured or any(v > 0 for v in self.coord.bcast_times()[1])
        reason = self._reason(step, workers, bcast_measured)
        if reason is None:
            return None
        self.last_step = step
        live = [w for w in workers if w["active"]]
        record: dict[str, Any] = {"step": step, "time": time.time(), "reason": reason, "workers": live}
        standby = self._decide(live, record)
        self.coord.set_standby(standby)
        names = {w["worker_id"]: w["name"] for w in live}
        record["leases_after"] = {w["name"]: w["leases"] for w in self.coord.measured()}  # standby holds these
        record["active"] = sorted(names[w] for w in names if w not in standby)
        record["standby"] = sorted(names[w] for w in standby)
        record["changed"] = frozenset(standby) != self.standby
        self.standby = frozenset(standby)
        self.metrics.update({"plan/active_workers": len(record["active"]), "plan/standby_workers": len(standby)})
        self.log.write(record)
        return record

    def _decide(self, live: list[dict[str, Any]], record: dict[str, Any]) -> set[str]:
        """Plan on what is measured; the workers to put on standby. The decision and its inputs go in `record`."""
        pool = [
            WorkerSpec(w["worker_id"], w["usd_per_hour"], w["rollouts_per_s"], w["lease_rollouts"])
            for w in live
            if w["rollouts_per_s"]
        ]
        # T_ready: T_bcast without waiting for a lease in progress (the model counts whole leases itself).
        # v0's includes the workers' engine start: steady state begins at v1.
        _, ready_s = self.coord.bcast_times()
        bcast = [ready_s[v] for v in sorted(ready_s) if v > 0][-T_BCAST_WINDOW:]
        if not self.t_train or not bcast or not pool:
            record["decision"] = "all active: waiting for measurements of T_train, T_bcast and mu_i"
            return set()
        cfg = self.cfg
        inp = PlanInputs(
            batch=cfg.prompts_per_step * cfg.group_size,
            t_train_s=statistics.median(self.t_train),
            t_bcast_s=statistics.median(bcast),
            staleness=cfg.staleness,
            kappa=cfg.kappa,
            gamma=cfg.gamma,
            lease_rollouts=cfg.group_size * 4,
            group_size=cfg.group_size,
            learner_usd_per_hour=cfg.learner_usd_per_hour,
        )
        record["inputs"] = inp.__dict__
        try:
            result = plan(inp, pool, rule=cfg.plan_rule)
        except InfeasibleError as exc:
            record["decision"] = f"all active: {exc}"
            return set()
        assert result.recommended is not None  # a pool was given
        meets = "cheapest set reaching gamma*mu_min"
        short = "short of gamma*mu_min: every worker that helps is active"
        record.update(
            decision=meets if result.meets_target else short,
            mu_min=result.mu_min,
            mu_min_echo2=result.mu_min_echo2,
            target_mu=result.target_mu,
            predicted_bubble=result.recommended.bubble_ratio,
            predicted_usd_per_step=result.recommended.usd_per_step,
        )
        self.metrics = {
            "plan/mu_min": result.mu_min,
            "plan/mu_min_echo2": result.mu_min_echo2,
            "plan/target_mu": result.target_mu,
            "plan/mu_active": result.recommended.mu_pool,
            "plan/predicted_bubble": result.recommended.bubble_ratio,
        }
        return set(result.standby)

    def close(self) -> None:
        self.log.close()
