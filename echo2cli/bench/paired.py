"""Settings compared seed by seed, with bootstrap intervals (`echo2 bench staleness`, `scripts/bench_vs_trl.py`).

Runs with the same seed share the task's prompt stream (`Task.prompts(seed)`: the same problems in the same
order), and every run is scored on the same held-out problems. So two settings are compared on each seed they
share, and what one seed's draw of problems did cancels out of the difference; S = 0's own seeds once ended 0.21
apart in held-out accuracy, far more than the 0.05 the staleness question asks about.

`paired_difference` gives the mean of those per-seed differences with a percentile-bootstrap interval (the seeds
resampled with replacement). With few seeds a percentile interval is too narrow (it does not know how little
it has seen), so the half-width is reported with the number of pairs, and `seeds_needed` says how many pairs an
interval of a wanted half-width takes at the spread seen so far.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

LEVEL = 0.95
RESAMPLES = 10_000


def bootstrap_interval(
    values: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float] | None:
    """The percentile-bootstrap `level` interval of the mean of `values` (None for fewer than 2 values). The
    resampling is seeded, so a report is the same each time it is made from the same rows."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return None
    picks = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))
    means = x[picks].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def paired_difference(
    a: Mapping[int, float], b: Mapping[int, float], level: float = LEVEL, resamples: int = RESAMPLES
) -> dict[str, Any]:
    """`a` - `b` on the seeds both have (seed -> value): the mean difference, its bootstrap interval and
    half-width (None with fewer than 2 pairs), the seeds used and each one's difference."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    interval = bootstrap_interval(diffs, level, resamples)
    return {
        "pairs": len(seeds),
        "seeds": seeds,
        "diffs": diffs,
        "mean": float(np.mean(diffs)) if diffs else None,
        "low": None if interval is None else interval[0],
        "high": None if interval is None else interval[1],
        "half_width": None if interval is None else (interval[1] - interval[0]) / 2,
    }


def seed_mean(values: Mapping[int, float], level: float = LEVEL) -> dict[str, Any]:
    """The mean over seeds of one per-seed measure (seed -> value, e.g. a ratio of two settings' times) with its
    bootstrap interval, in `paired_difference`'s form."""
    return paired_difference(values, dict.fromkeys(values, 0.0), level)


def seeds_needed(diffs: Sequence[float], half_width: float, level: float = LEVEL) -> int | None:
    """Pairs an interval of `half_width` needs at the spread of `diffs` (normal approximation: z * sd / sqrt(n));
    None with fewer than 2 differences to measure a spread from."""
    if len(diffs) < 2:
        return None
    sd = float(np.std(diffs, ddof=1))
    z = statistics.NormalDist().inv_cdf((1 + level) / 2)
    return max(2, math.ceil((z * sd / half_width) ** 2))


def time_to(curve: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """The `time_s` of the first point of a held-out curve (points in training order, each with `time_s` and
    `greedy_accuracy`) at or above `target`; None if the run never reached it."""
    return next((float(c["time_s"]) for c in curve if c["greedy_accuracy"] >= target), None)


def describe(d: Mapping[str, Any]) -> str:
    """'+0.031 [-0.012, +0.070] (n=8)', or '+0.031 (n=1)' without an interval, or '-' without pairs."""
    if d["mean"] is None:
        return "-"
    if d["low"] is None:
        return f"{d['mean']:+.3f} (n={d['pairs']})"
    return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] (n={d['pairs']})"
