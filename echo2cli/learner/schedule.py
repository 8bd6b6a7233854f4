"""The learning rate at each step: a linear warmup, then constant, linear or cosine decay to the run's last step.

The rate is a function of the step alone (no scheduler state), so a resumed run continues the same curve, and a
sharded learner's ranks agree on it without a word. Step t (0-based) turns version t into t + 1:

    warmup   steps 0 .. w-1 take lr * (t + 1) / w: the w-th step is the first at the full rate
    decay    p = (t - w) / (steps - w) runs from 0 at step w to (steps - w - 1) / (steps - w) at the last step;
             linear: lr * (1 - p * (1 - m)); cosine: lr * (m + (1 - m) * (1 + cos(pi p)) / 2), with m the
             floor's ratio to lr (`--lr-min-ratio`); constant: lr

As in Hugging Face's schedulers (TRL's `lr_scheduler_type`, `warmup_steps`), the last step keeps a little of the
rate instead of taking a step of zero; unlike them, the first warmup step is not a step of zero either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

LrScheduleName = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class LrSchedule:
    lr: float
    steps: int
    name: LrScheduleName = "constant"
    warmup_steps: int = 0
    min_ratio: float = 0.0

    def at(self, step: int) -> float:
        """The rate of step `step` (0-based)."""
        w = self.warmup_steps
        if step < w:
            return self.lr * (step + 1) / w
        if self.name == "constant":
            return self.lr
        p = min(1.0, (step - w) / max(1, self.steps - w))
        m = self.min_ratio
        if self.name == "linear":
            return self.lr * (1.0 - p * (1.0 - m))
        return self.lr * (m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p)))
