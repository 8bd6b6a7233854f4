"""What each learner step records: one line of metrics.jsonl (the batch's rollouts, timings, the bubble ratio,
T_bcast, cost) and one of mismatch.jsonl (the sampled tokens where trainer and engine disagree most).

Bubble ratio = time waiting for rollouts / wall time, counted from the end of the first wait: the first wait is
fleet start-up (engines loading), which a capacity model of steady state does not describe.
"""

from __future__ import annotations

import json
import math
from collections import Counter, deque
from pathlib import Path
from typing import Any

from echo2cli.learner.types import Group
from echo2cli.loggers import Reporters
from echo2cli.metrics import MetricsWriter, read_metrics
from echo2cli.protocol import Sample
from echo2cli.tasks.episodes import spans

# the metrics `/v1/status` shows (the demo's live view and `echo2 status` read them)
SCALARS_IN_STATUS = (
    "rollout/reward_mean",
    "learner/t_train_s",
    "learner/t_wait_s",
    "bcast/t_s",
    "bcast/version",
    "learner/bubble_ratio",
    "bcast/upload_ratio",
    "rollout/staleness_max",
    "train/loss",
    "time_s",
    "plan/mu_min",
    "plan/mu_min_echo2",
    "plan/active_workers",
    "plan/standby_workers",
    "cost/usd_per_step",
)


# each step's numbers `/v1/status` keeps for the last HISTORY steps (the status view's sparkline and trends)
HISTORY_KEYS = (
    "step",
    "rollout/reward_mean",
    "learner/t_train_s",
    "bcast/t_s",
    "learner/bubble_ratio_step",
    "cost/usd_per_step",
)
HISTORY = 120


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def batch_metrics(groups: list[Group], step: int, max_new_tokens: int) -> dict[str, Any]:
    """`rollout/*` and `reward/*` of the groups trained at `step`; staleness counts every trained sample.
    A completion (a transcript: its last turn) is truncated if it reached max_new_tokens (counted here, not taken
    from the worker's word)."""
    rewards = [r for g in groups for r in g.rewards]
    lengths = [len(s.completion_token_ids) for g in groups for s in g.samples]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    hist = Counter(step - g.version for g in groups for _ in g.samples)
    return {
        "rollout/reward_mean": mean,
        "rollout/reward_std": std,
        "rollout/samples": len(rewards),
        "rollout/staleness_hist": {str(k): v for k, v in sorted(hist.items())},
        "rollout/staleness_max": max(hist),
        "rollout/staleness_mean": sum(k * v for k, v in hist.items()) / len(rewards),
        "rollout/versions": sorted({g.version for g in groups}),
        "rollout/worker_versions": sorted({(g.worker_id, g.version) for g in groups}),
        "rollout/gen_tokens": sum(lengths),
        "rollout/completion_len_max": max(lengths),
        "rollout/truncated_frac": sum(last_turn(s) >= max_new_tokens for g in groups for s in g.samples) / len(lengths),
        "rollout/prompt_ids": [g.prompt_id for g in groups],
        **component_means(groups),
    }


def batch_histograms(groups: list[Group], step: int) -> dict[str, list[float]]:
    """What the loggers that have histograms show: the batch's rewards and each sample's staleness."""
    return {
        "rollout/rewards": [r for g in groups for r in g.rewards],
        "rollout/staleness": [float(step - g.version) for g in groups for _ in g.samples],
    }


def last_turn(sample: Sample) -> int:
    """Tokens of the sample's last policy turn: the whole completion, or a transcript's final policy span."""
    if sample.policy_mask is None:
        return len(sample.completion_token_ids)
    return next(end - start for start, end, policy in reversed(spans(sample.policy_mask)) if policy)


def component_means(groups: list[Group]) -> dict[str, float]:
    """`reward/<name>`: the mean of each reward component over the batch's samples (0 where one is absent)."""
    rows = [c for g in groups for c in g.components]
    names = sorted({k for c in rows for k in c})
    return {f"reward/{k}": sum(c.get(k, 0.0) for c in rows) / len(rows) for k in names}


class Bubble:
    """The learner's waiting for rollouts, over the steady state (after the first wait)."""

    def __init__(self) -> None:
        self.since: float | None = None  # the end of the first wait
        self.waited = 0.0

    def waited_for(self, seconds: float, now: float) -> None:
        if self.since is None:
            self.since = now
        else:
            self.waited += seconds

    def ratio(self, now: float) -> float:
        return self.waited / max(now - (self.since or now), 1e-9)


def bcast_metrics(bcast_s: dict[int, float], ready_s: dict[int, float], upload_ratio: dict[int, float]) -> dict:
    """`bcast/*` of the newest version whose T_bcast is measured."""
    if not bcast_s:
        return {}
    v = max(bcast_s)
    return {
        "bcast/version": v,
        "bcast/t_s": bcast_s[v],
        "bcast/t_ready_s": ready_s[v],
        "bcast/upload_ratio": upload_ratio.get(v),
    }


def delta_metrics(delta_stats: dict[int, dict[str, float]]) -> dict[str, float]:
    """`bcast/delta_*` of the newest version whose delta is written (the version a step publishes is still being
    encoded in the background when the step is recorded: the previous one is done)."""
    done = list(delta_stats)  # a copy: the publisher's thread adds to it
    if not done:
        return {}
    version = max(done)
    stats = delta_stats[version]
    return {
        "bcast/delta_version": version,
        "bcast/delta_ratio": stats["delta_bytes"] / stats["full_bytes"],
        "bcast/delta_encode_s": stats["encode_s"],
    }


def usd_per_hour(workers: list[dict[str, Any]], learner_usd_per_hour: float) -> float:
    """Learner plus every live worker not on standby: what the run pays for right now."""
    return learner_usd_per_hour + sum(w["usd_per_hour"] for w in workers if w["active"] and not w["standby"])


class StepLog:
    """metrics.jsonl and mismatch.jsonl, one line per step each, the newest line for `/v1/status`, and the same
    record to the other loggers (`echo2cli/loggers.py`).
    A resumed run rewrites the steps after its checkpoint: their old lines are dropped at open."""

    def __init__(self, out: Path, start_step: int, reporters: Reporters | None = None) -> None:
        path = out / "metrics.jsonl"
        kept = [row for row in read_metrics(path) if row.get("step", -1) < start_step]
        if path.exists():
            path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in kept))
        self.metrics = MetricsWriter(path)
        self.mismatch = MetricsWriter(out / "mismatch.jsonl")
        self.last: dict[str, Any] = {}
        self.history: deque[dict[str, float | None]] = deque(
            ({k: row.get(k) for k in HISTORY_KEYS} for row in kept),
            maxlen=HISTORY,  # a resumed run's earlier steps
        )
        self.reporters = reporters

    def write(self, record: dict[str, Any], outliers: list[dict[str, Any]], histograms: dict[str, list[float]]) -> None:
        """`outliers`: the trainer's tokens of largest |log w|, each with its version."""
        self.metrics.write(record)
        if self.reporters:
            self.reporters.log(record, histograms)
        tokens = [{**o, "staleness": record["step"] - o["version"]} for o in outliers]
        self.mismatch.write({"step": record["step"], "tokens": tokens})
        self.last = record
        self.history.append({k: record.get(k) for k in HISTORY_KEYS})

    def status(self) -> dict[str, Any]:
        """`Status.last_metrics` and `Status.history`; a number that is not finite (a diverged loss) is None, as
        JSON and the wire's bounds want it."""
        return {
            "last_metrics": {k: _finite(self.last[k]) for k in SCALARS_IN_STATUS if k in self.last},
            "history": [{k: _finite(v) for k, v in h.items()} for h in self.history],
        }

    def close(self) -> None:
        self.metrics.close()
        self.mismatch.close()
        if self.reporters:
            self.reporters.close()
