"""The divergence guard: notices from each step's off-policy health that a run is going off the rails, and
with `--adaptive-staleness` lowers the staleness bound for new leases until it is healthy again.

A step is unhealthy when any of its whole-batch measures crosses its threshold:

- `train/is_ess` below `ess_min`: the importance weights w = pi_theta / mu of the batch's tokens have a
  normalised effective sample size (sum w)^2 / (n sum w^2) this low, i.e. a few tokens carry the gradient;
- `train/kl_behaviour` above `kl_max`: the mean per-token KL(mu || pi_theta) between the policy that sampled
  and the one being trained;
- `train/clipfrac` above `clip_max`: the share of tokens whose objective the PPO clip or the dual clip cut.

Each unhealthy step is a warning with its reasons. When adaptive, it also halves the effective S (the bound
the lease book sizes new leases with; groups already leased stay admissible under the configured S), and
after `patience` healthy steps in a row the effective S rises by one, up to the configured S. Every warning
and change is one line of `decisions.jsonl` (`"kind": "staleness"`). Pure logic: the learner feeds it each
step's metrics and applies what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Thresholds:
    ess_min: float
    kl_max: float
    clip_max: float


class DivergenceGuard:
    def __init__(self, staleness: int, thresholds: Thresholds, *, adaptive: bool, patience: int = 3) -> None:
        self.S, self.limits, self.adaptive, self.patience = staleness, thresholds, adaptive, patience
        self.effective = staleness
        self.healthy_steps = 0

    def reasons(self, m: dict[str, Any]) -> list[str]:
        """What about this step's metrics crosses a threshold (empty: healthy)."""
        out = []
        lim = self.limits
        if (ess := m.get("train/is_ess")) is not None and ess < lim.ess_min:
            out.append(f"importance-weight ESS {ess:.3f} < {lim.ess_min}")
        if (kl := m.get("train/kl_behaviour")) is not None and kl > lim.kl_max:
            out.append(f"behaviour KL {kl:.4f} > {lim.kl_max}")
        if (clip := m.get("train/clipfrac")) is not None and clip > lim.clip_max:
            out.append(f"clip fraction {clip:.3f} > {lim.clip_max}")
        return out

    def observe(self, step: int, m: dict[str, Any]) -> dict[str, Any] | None:
        """A decision for `decisions.jsonl` if this step warns or changes the effective S, else None."""
        reasons = self.reasons(m)
        before = self.effective
        if reasons:
            self.healthy_steps = 0
            if self.adaptive:
                self.effective //= 2
            action = "lower" if self.effective < before else "warn"
        else:
            self.healthy_steps += 1
            if not (self.adaptive and self.effective < self.S and self.healthy_steps >= self.patience):
                return None
            self.effective += 1
            self.healthy_steps = 0
            action, reasons = "raise", [f"{self.patience} healthy steps"]
        return {
            "kind": "staleness",
            "step": step,
            "action": action,
            "reasons": reasons,
            "staleness": self.S,
            "effective_from": before,
            "effective_to": self.effective,
        }
