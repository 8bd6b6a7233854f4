"""The divergence guard: notices from each step's off-policy health that a run is going off the rails, and
with `--adaptive-staleness` lowers the staleness bound for new leases until it is healthy again.

Every step's verdict is on the median of the last `window` measured steps (3) of three measures, each against
its threshold (a step that trained nothing, every group flat, measures nothing and gives no verdict):

- `train/is_ess` below `ess_min`: the importance weights w = pi_theta / mu of the batch's trained tokens (a group
  whose rewards are all equal is not trained, `trainer.py`) have a normalised effective sample size
  (sum w)^2 / (n sum w^2) this low, i.e. a few tokens carry the gradient;
- `train/kl_behaviour` above `kl_max`: the mean per-token divergence between the policy that sampled and the
  one being trained (heavy-tailed: one token the trainer finds far less likely adds thousands);
- `train/clipfrac` above `clip_max`: the share of tokens whose objective the PPO clip or the dual clip cut.

A median of 3 ignores a one-step spike, which every staleness shows now and then. The defaults come from
`echo2 bench staleness` on the default setting (docs/BENCHMARKS.md): no run at S <= 4 crosses them; the first S = 8
runs did, from the step their staleness reached 6. The clip bound is 0.25, not the 0.15 it was calibrated at when
every token counted: over the trained tokens alone (flat groups have none) S = 4 runs measure more, up to
0.21 over 49 seeds, and 0.15 warned in 28 of them, none of which fell; every collapse on record was flagged by the
ESS or the KL first. Without a correction (`--off-policy none`) the ESS bound is 0.9, not 0.8: such runs fall at
lags where the ESS is still 0.85-0.9 (`default_ess_min`).

Each flagged step is a warning with its reasons. When adaptive, a flag also halves the effective S (the
bound new leases are sized with and admission checks: staler groups already admitted are dropped and their
prompts queued again) or, where it is lower, the lag the flagged step's batch reached, and starts the window
afresh: rollouts already in flight are as stale as before, so the next verdict waits for `window` new steps.

Without a correction (`--off-policy none`, `corrected=False`) a flag sets the effective S to 0 for good: such an
objective weighs a stale token as a fresh one, and at lag 0 the measures cannot say whether a lag would be safe
again. Lags of 1-3 pulled such runs under the base model after a flag, whether the bound had been raised back
(three of four) or stayed at 1 (docs/BENCHMARKS.md, "The collapse with flat groups skipped"); at lag 0 none of
five did, where S = 0 itself did in two ("Without a correction, a flag means lag 0 for good").

With a correction, raising it again is cautious. After `patience` healthy verdicts in a row the effective S rises
by one, but:

- never back to a lag that was flagged: each flag lowers the ceiling (at first the configured S) to one below
  the lag it halved;
- each flag doubles the healthy verdicts a raise waits for (3, 6, 12, ...).

Raising back straight to the failed lags let runs without a correction fall below the base model a few
versions after each raise (docs/BENCHMARKS.md, "The same collapse under `--adaptive-staleness`"); the cautious
raise did not stop every such fall either ("A cautious raise", same file): those came after a late first flag.
The guard's state goes into each checkpoint (`state_dict`), so a resumed learner keeps its bound. Every warning
and change is one line of `decisions.jsonl` (`"kind": "staleness"`). Pure logic: the learner feeds it each
step's metrics and applies what it returns.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from echo2cli.errors import ConfigError

MEASURES = ("train/is_ess", "train/kl_behaviour", "train/clipfrac")

# The ESS bound when none is given. An uncorrected objective (--off-policy none) gets a tighter one: at 0.8 it was
# crossed only once batches reached lag 8-9, and two of five such runs ended below the base model; at 0.9 the
# first flag came at lag 6 and none of five did (docs/BENCHMARKS.md, "The same with an ESS bound of 0.9").
ESS_MIN = 0.8
ESS_MIN_UNCORRECTED = 0.9


def default_ess_min(off_policy: str) -> float:
    return ESS_MIN_UNCORRECTED if off_policy == "none" else ESS_MIN


@dataclass(frozen=True)
class Thresholds:
    ess_min: float
    kl_max: float
    clip_max: float


class DivergenceGuard:
    def __init__(
        self,
        staleness: int,
        thresholds: Thresholds,
        *,
        adaptive: bool,
        corrected: bool = True,
        window: int = 3,
        patience: int = 3,
    ) -> None:
        self.S, self.limits, self.adaptive, self.patience = staleness, thresholds, adaptive, patience
        self.corrected = corrected  # False: a flag means lag 0 from then on
        self.effective = staleness
        self.ceiling = staleness  # the most a raise may reach: one below the lowest lag a flag halved
        self.healthy_steps = 0
        self.recent: deque[dict[str, float]] = deque(maxlen=window)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed learner's guard needs to go on deciding as this one would (saved in each checkpoint)."""
        return {
            "effective": self.effective,
            "ceiling": self.ceiling,
            "patience": self.patience,
            "healthy_steps": self.healthy_steps,
            "recent": list(self.recent),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """`state_dict`'s output, from a checkpoint; anything else is a ConfigError that says so."""
        try:
            effective, ceiling = int(state["effective"]), int(state["ceiling"])
            patience, healthy_steps = int(state["patience"]), int(state["healthy_steps"])
            recent = [{k: float(m[k]) for k in MEASURES if k in m} for m in state["recent"]]
            if not (0 <= effective <= ceiling <= self.S and patience >= 1 and healthy_steps >= 0):
                raise ValueError("out of range")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(
                f"the checkpoint's divergence guard state is malformed ({exc!r}): {state!r:.200}"
            ) from None
        self.effective, self.ceiling, self.patience, self.healthy_steps = effective, ceiling, patience, healthy_steps
        self.recent.clear()
        self.recent.extend(recent[-(self.recent.maxlen or 1) :])

    def reasons(self, m: dict[str, Any]) -> list[str]:
        """What about these (median) measures crosses a threshold (empty: healthy)."""
        out = []
        lim = self.limits
        if (ess := m.get("train/is_ess")) is not None and ess < lim.ess_min:
            out.append(f"importance-weight ESS {ess:.3f} < {lim.ess_min}")
        if (kl := m.get("train/kl_behaviour")) is not None and kl > lim.kl_max:
            out.append(f"behaviour KL {kl:.4f} > {lim.kl_max}")
        if (clip := m.get("train/clipfrac")) is not None and clip > lim.clip_max:
            out.append(f"clip fraction {clip:.3f} > {lim.clip_max}")
        return out

    def medians(self) -> dict[str, float]:
        return {
            k: statistics.median(vals)
            for k in MEASURES
            if (vals := [m[k] for m in self.recent if m.get(k) is not None])
        }

    def _ceiling(self, m: dict[str, Any]) -> int:
        """What a flag halves: the effective S, or the lag this step's batch actually reached where that is lower
        (a run flagged at lag 3 under S = 16 gets S = 1 at once, not 8 then 4 then 2 a window apart)."""
        lag = m.get("rollout/staleness_max")
        return self.effective if lag is None else min(self.effective, int(lag))

    def observe(self, step: int, m: dict[str, Any]) -> dict[str, Any] | None:
        """A decision for `decisions.jsonl` if this step warns or changes the effective S, else None.

        A step without the measures (every group flat, so nothing trained) gives no verdict, healthy or not, and
        stays out of the window: otherwise the window's median would be over fewer steps, and one spike beside
        two unmeasured steps would decide alone."""
        measured = {k: m[k] for k in MEASURES if m.get(k) is not None}
        if not measured:
            return None
        self.recent.append(measured)
        if len(self.recent) < (self.recent.maxlen or 1):
            return None
        medians = self.medians()
        reasons = self.reasons(medians)
        before = self.effective
        if reasons:
            self.healthy_steps = 0
            if self.adaptive and self.effective > 0:
                if self.corrected:
                    failed = self._ceiling(m)
                    self.effective = failed // 2
                    self.ceiling = min(self.ceiling, max(failed - 1, self.effective))
                else:
                    self.effective = self.ceiling = 0
                self.patience *= 2
                self.recent.clear()
            action = "lower" if self.effective < before else "warn"
        else:
            self.healthy_steps += 1
            if not (self.adaptive and self.effective < self.ceiling and self.healthy_steps >= self.patience):
                return None
            self.effective += 1
            self.healthy_steps = 0
            action, reasons = "raise", [f"{self.patience} healthy steps"]
        return {
            "kind": "staleness",
            "step": step,
            "action": action,
            "reasons": reasons,
            "medians": medians,
            "staleness": self.S,
            "effective_from": before,
            "effective_to": self.effective,
            "ceiling": self.ceiling,
            "patience": self.patience,
        }
