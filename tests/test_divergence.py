"""The divergence guard's decisions on made-up metric streams, and the per-staleness health totals."""

import pytest

from echo2cli.learner.divergence import DivergenceGuard, Thresholds
from echo2cli.learner.trainer import LAG_PREFIX, split_by_lag

LIMITS = Thresholds(ess_min=0.5, kl_max=0.1, clip_max=0.3)
HEALTHY = {"train/is_ess": 0.9, "train/kl_behaviour": 0.01, "train/clipfrac": 0.05}
COLLAPSED = {**HEALTHY, "train/is_ess": 0.2}


def run(guard, stream):
    return [guard.observe(step, m) for step, m in enumerate(stream)]


def test_a_healthy_run_decides_nothing():
    guard = DivergenceGuard(8, LIMITS, adaptive=True)
    assert run(guard, [HEALTHY] * 10) == [None] * 10 and guard.effective == 8


def test_each_crossed_threshold_is_a_reason():
    guard = DivergenceGuard(4, LIMITS, adaptive=False)
    bad = {"train/is_ess": 0.3, "train/kl_behaviour": 0.5, "train/clipfrac": 0.4}
    assert guard.reasons(bad) == [
        "importance-weight ESS 0.300 < 0.5",
        "behaviour KL 0.5000 > 0.1",
        "clip fraction 0.400 > 0.3",
    ]
    assert guard.reasons({}) == []  # a step without the measures (e.g. an old metrics line) is not flagged


def test_without_adaptive_staleness_it_warns_and_keeps_s():
    guard = DivergenceGuard(8, LIMITS, adaptive=False)
    decisions = run(guard, [HEALTHY, COLLAPSED, COLLAPSED, HEALTHY, HEALTHY, HEALTHY, HEALTHY])
    flagged = [d for d in decisions if d]
    assert [d["step"] for d in flagged] == [1, 2]
    assert all(d["action"] == "warn" and d["effective_to"] == 8 for d in flagged)
    assert guard.effective == 8


def test_adaptive_staleness_halves_s_on_each_flag_and_climbs_back_one_per_three_healthy_steps():
    guard = DivergenceGuard(8, LIMITS, adaptive=True, patience=3)
    stream = [COLLAPSED, COLLAPSED] + [HEALTHY] * 7 + [COLLAPSED] + [HEALTHY] * 30
    decisions = run(guard, stream)
    changes = [(d["step"], d["action"], d["effective_from"], d["effective_to"]) for d in decisions if d]
    assert changes[:5] == [
        (0, "lower", 8, 4),
        (1, "lower", 4, 2),
        (4, "raise", 2, 3),  # three healthy steps: 2, 3, 4
        (7, "raise", 3, 4),
        (9, "lower", 4, 2),
    ]
    assert changes[-1][3] == 8 and guard.effective == 8  # back to the configured S and no further
    assert all(d["kind"] == "staleness" and d["staleness"] == 8 for d in decisions if d)


def test_at_s_zero_a_flag_is_a_warning_only():
    guard = DivergenceGuard(0, LIMITS, adaptive=True)
    (d,) = run(guard, [COLLAPSED])
    assert d["action"] == "warn" and guard.effective == 0


def test_health_by_staleness_from_the_summed_rows():
    raw = {"train/loss": 1.0, "train/is_weight_mean": 1.5, "train/is_weight_sq_mean": 3.0}
    names = ("tokens", "kl_behaviour", "w", "w_sq", "clipped", "truncated", "dropped")
    for lag, sums in {0: (4, 0.0, 4.0, 4.0, 0, 0, 0), 3: (2, 0.8, 4.0, 10.0, 1, 1, 0)}.items():
        for name, v in zip(names, sums, strict=True):
            raw[f"{LAG_PREFIX}{lag}/{name}"] = float(v)
    out = split_by_lag(raw)
    assert not any(k.startswith(LAG_PREFIX) for k in out)
    assert out["train/is_ess"] == pytest.approx(1.5**2 / 3.0)
    fresh, stale = out["offpolicy/by_staleness"]["0"], out["offpolicy/by_staleness"]["3"]
    assert fresh["is_ess"] == pytest.approx(1.0) and fresh["kl_behaviour"] == 0.0
    assert stale["is_ess"] == pytest.approx(16 / (2 * 10)) and stale["kl_behaviour"] == pytest.approx(0.4)
    assert stale["clipfrac"] == 0.5 and stale["truncated_frac"] == 0.5 and stale["masked_frac"] == 0.0
