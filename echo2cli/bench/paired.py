"""Settings compared seed by seed, with bootstrap intervals (`echo2 bench staleness`, `scripts/bench_vs_trl.py`).

Runs with the same seed share the task's prompt stream (`Task.prompts(seed)`: the same problems in the same
order), and every run is scored on the same held-out problems. So two settings are compared on each seed they
share, and what one seed's draw of problems did cancels out of the difference; S = 0's own seeds once ended 0.21
apart in held-out accuracy, far more than the 0.05 the staleness question asks about.

`paired_difference` gives the mean of those per-seed differences with a percentile-bootstrap interval (the seeds
resampled with replacement). With few seeds a percentile interval is too narrow (it does not know how little
it has seen), so the Student-t interval of the same differences is given beside it (`t_interval`: wider at small
n, the same as n grows), the half-width is reported with the number of pairs, and `seeds_needed` says how many
pairs an interval of a wanted half-width takes at the spread seen so far.
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


def t_quantile(p: float, df: int) -> float:
    """The `p` quantile (0.5 <= p < 1) of Student's t with `df` degrees of freedom: the density integrated from 0
    by Simpson's rule (4,000 panels) and the upper limit found by bisection; within 1e-6 of the tables."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def above_half(x: float) -> float:  # P(0 <= T <= x)
        t = np.linspace(0.0, x, 4001)
        f = np.exp(log_norm - (df + 1) / 2 * np.log1p(t * t / df))
        return float((f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()) * x / 12000)

    low, high = 0.0, 1.0
    while above_half(high) < p - 0.5:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if above_half(mid) < p - 0.5 else (low, mid)
    return (low + high) / 2


def t_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """The Student-t `level` interval of the mean of `values`: mean +- t(n-1) * sd / sqrt(n) (None for fewer
    than 2 values). It assumes the values are near normal, where the bootstrap assumes nothing but is too narrow
    for a handful of seeds; the two agree as n grows."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return None
    half = t_quantile((1 + level) / 2, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return float(x.mean()) - half, float(x.mean()) + half


def paired_difference(
    a: Mapping[int, float], b: Mapping[int, float], level: float = LEVEL, resamples: int = RESAMPLES
) -> dict[str, Any]:
    """`a` - `b` on the seeds both have (seed -> value): the mean difference, its bootstrap interval and
    half-width and its t interval (None with fewer than 2 pairs), the seeds used and each one's difference."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    interval = bootstrap_interval(diffs, level, resamples)
    t = t_interval(diffs, level)
    return {
        "pairs": len(seeds),
        "seeds": seeds,
        "diffs": diffs,
        "mean": float(np.mean(diffs)) if diffs else None,
        "low": None if interval is None else interval[0],
        "high": None if interval is None else interval[1],
        "half_width": None if interval is None else (interval[1] - interval[0]) / 2,
        "t_low": None if t is None else t[0],
        "t_high": None if t is None else t[1],
    }


def seed_mean(values: Mapping[int, float], level: float = LEVEL) -> dict[str, Any]:
    """The mean over seeds of one per-seed measure (seed -> value, e.g. a ratio of two settings' times) with its
    bootstrap interval, in `paired_difference`'s form."""
    return paired_difference(values, dict.fromkeys(values, 0.0), level)


def seeds_needed(diffs: Sequence[float], half_width: float, level: float = LEVEL) -> int | None:
    """Pairs a t interval of `half_width` needs at the spread of `diffs`: the fewest n with
    t(n-1) * sd / sqrt(n) <= half_width (None with fewer than 2 differences to measure a spread from)."""
    if len(diffs) < 2:
        return None
    sd = float(np.std(diffs, ddof=1))
    z = statistics.NormalDist().inv_cdf((1 + level) / 2)
    n = max(2, math.ceil((z * sd / half_width) ** 2))  # the normal approximation, which t only raises
    while t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n) > half_width:
        n += 1
    return n


def auc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """How well `scores` pick out the `positive` cases: the chance that a positive case scores above a negative
    one, ties counting half (Mann-Whitney U / (positives * negatives), from ranks with ties averaged). 0.5 when
    the score says nothing about which cases are positive, 1 (or 0) when it orders them all; None without a case
    of each kind."""
    x = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    n1, n0 = int(pos.sum()), int((~pos).sum())
    if not n1 or not n0:
        return None
    values, inverse = np.unique(x, return_inverse=True)
    counts = np.bincount(inverse, minlength=values.size)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    ranks = (first + (counts - 1) / 2 + 1)[inverse]  # 1-based, a tie's ranks averaged
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def sign_test(wins: int, losses: int) -> float:
    """The two-sided exact binomial p of `wins` against `losses` if either were equally likely: McNemar's exact
    test on the discordant pairs (seeds where only one of two settings ended below a bar)."""
    n, k = wins + losses, min(wins, losses)
    if not n:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def time_to(curve: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """The `time_s` of the first point of a held-out curve (points in training order, each with `time_s` and
    `greedy_accuracy`) at or above `target`; None if the run never reached it."""
    return next((float(c["time_s"]) for c in curve if c["greedy_accuracy"] >= target), None)


def censored_median(
    values: Mapping[int, float | None], level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
) -> dict[str, Any]:
    """The median over seeds of a per-seed time (seed -> value; None where the run never got there, e.g. never
    reached the target accuracy) with its percentile-bootstrap interval, the seeds resampled with replacement. A
    miss counts as later than any time, so it is never dropped: the median, or an end of the interval, is None
    ("never") where half or more of the seeds, or of a resample's, missed. A mean over the seeds that reached it
    leaves the misses out and so looks better the more seeds miss; this does not."""
    seeds = sorted(values)
    x = np.array([np.inf if values[s] is None else values[s] for s in seeds], dtype=np.float64)

    def finite(v: float) -> float | None:
        return float(v) if math.isfinite(v) else None

    low = high = None
    if x.size >= 2:
        picks = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))
        medians = np.median(x[picks], axis=1)  # inf where the upper middle value is a miss
        tail = (1 - level) / 2
        low, high = (finite(float(np.quantile(medians, q, method="inverted_cdf"))) for q in (tail, 1 - tail))
    return {
        "pairs": len(seeds),
        "seeds": seeds,
        "reached": int(np.isfinite(x).sum()),
        "median": finite(float(np.median(x))) if x.size else None,
        "low": low,
        "high": high,
    }


def describe_median(d: Mapping[str, Any]) -> str:
    """'0.320 [0.220, 0.440] (7/9 reached)', 'never' for a median or an end past every seed's time, '-' without
    seeds."""
    if not d["pairs"]:
        return "-"

    def show(v: float | None) -> str:
        return "never" if v is None else f"{v:.3f}"

    interval = "" if d["pairs"] < 2 else f" [{show(d['low'])}, {show(d['high'])}]"
    return f"{show(d['median'])}{interval} ({d['reached']}/{d['pairs']} reached)"


def describe(d: Mapping[str, Any], t: bool = False) -> str:
    """'+0.031 [-0.012, +0.070] (n=8)', or '+0.031 (n=1)' without an interval, or '-' without pairs; with `t`,
    the t interval follows the bootstrap's: '+0.031 [-0.012, +0.070] t [-0.020, +0.082] (n=8)'."""
    if d["mean"] is None:
        return "-"
    if d["low"] is None:
        return f"{d['mean']:+.3f} (n={d['pairs']})"
    t_part = f" t [{d['t_low']:+.3f}, {d['t_high']:+.3f}]" if t and d.get("t_low") is not None else ""
    return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]{t_part} (n={d['pairs']})"
