"""The divergence guard's decisions on made-up metric streams, and the per-staleness health totals."""

import json
from pathlib import Path

import pytest

from echo2cli.errors import ConfigError
from echo2cli.learner.divergence import DivergenceGuard, Thresholds
from echo2cli.learner.trainer import LAG_PREFIX, split_by_lag

LIMITS = Thresholds(ess_min=0.5, kl_max=0.1, clip_max=0.3)
HEALTHY = {"train/is_ess": 0.9, "train/kl_behaviour": 0.01, "train/clipfrac": 0.05}
COLLAPSED = {**HEALTHY, "train/is_ess": 0.2}
DOCS = Path(__file__).resolve().parents[1] / "docs"  # rows recorded by `echo2 bench staleness`
S2_PAIRS = 118  # S = 2 rows in docs/bench_staleness_pairs: seeds 5-122


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
    guard = DivergenceGuard(4, LIMITS, adaptive=False)
    assert run(guard, [{}] * 4) == [None] * 4


def test_verdicts_are_on_the_median_of_three_steps_so_one_spike_is_ignored():
    guard = DivergenceGuard(8, LIMITS, adaptive=False)
    assert run(guard, [HEALTHY, COLLAPSED, HEALTHY, HEALTHY, COLLAPSED, HEALTHY]) == [None] * 6


def test_a_step_that_trained_nothing_gives_no_verdict_and_stays_out_of_the_window():
    # A step of flat groups only has no health measures. Were it a member of the window, a spike beside two such
    # steps would be the whole median (a learner lowered S on one step so), and unmeasured steps would count as
    # healthy ones towards a raise.
    guard = DivergenceGuard(8, LIMITS, adaptive=False)
    assert run(guard, [HEALTHY, HEALTHY, {}, {}, COLLAPSED, {}]) == [None] * 6  # window (H, H, C): healthy
    guard = DivergenceGuard(8, LIMITS, adaptive=True, window=3, patience=3)
    decisions = run(guard, [COLLAPSED] * 3 + [{}] * 20)
    assert [(d["step"], d["action"]) for d in decisions if d] == [(2, "lower")]
    assert guard.effective == 4 and guard.healthy_steps == 0 and len(guard.recent) == 0


def test_without_adaptive_staleness_it_warns_and_keeps_s():
    guard = DivergenceGuard(8, LIMITS, adaptive=False)
    decisions = run(guard, [HEALTHY, COLLAPSED, COLLAPSED, COLLAPSED, HEALTHY, HEALTHY, HEALTHY])
    flagged = [d for d in decisions if d]
    assert [d["step"] for d in flagged] == [2, 3, 4]  # windows (H,C,C), (C,C,C), (C,C,H)
    assert all(d["action"] == "warn" and d["effective_to"] == 8 for d in flagged)
    assert flagged[0]["medians"]["train/is_ess"] == 0.2
    assert guard.effective == 8


def test_adaptive_staleness_halves_s_per_flag_and_climbs_back_slower_and_never_to_a_flagged_lag():
    guard = DivergenceGuard(8, LIMITS, adaptive=True, window=3, patience=3)
    decisions = run(guard, [COLLAPSED] * 6 + [HEALTHY] * 40)
    changes = [(d["step"], d["action"], d["effective_from"], d["effective_to"]) for d in decisions if d]
    assert changes == [
        (2, "lower", 8, 4),  # the first full window: the ceiling is now 7, the patience 6
        (5, "lower", 4, 2),  # three fresh steps later (rollouts in flight were as stale): ceiling 3, patience 12
        (19, "raise", 2, 3),  # 12 healthy verdicts, at steps 8-19
        # and no further: 4 was flagged
    ]
    assert guard.effective == guard.ceiling == 3 and guard.patience == 12
    assert all(d["kind"] == "staleness" and d["staleness"] == 8 for d in decisions if d)
    assert [d["ceiling"] for d in decisions if d] == [7, 3, 3] and decisions[19]["reasons"] == ["12 healthy steps"]


def test_a_single_flag_lets_s_climb_back_to_one_below_the_flagged_lag():
    guard = DivergenceGuard(16, LIMITS, adaptive=True, window=3, patience=3)
    decisions = run(guard, [{**COLLAPSED, "rollout/staleness_max": 6}] * 3 + [HEALTHY] * 40)
    changes = [(d["step"], d["action"], d["effective_from"], d["effective_to"]) for d in decisions if d]
    # lag 6 flagged: S = 3, ceiling 5, patience 6; verdicts from step 5, raises every 6 healthy ones
    assert changes == [(2, "lower", 16, 3), (10, "raise", 3, 4), (16, "raise", 4, 5)]
    assert guard.effective == 5


def test_without_a_correction_a_flag_sets_s_to_zero_for_good():
    # an uncorrected objective: lag 3 flagged goes to lag 0, not 1, and no run of healthy verdicts raises it again
    guard = DivergenceGuard(16, LIMITS, adaptive=True, corrected=False)
    decisions = run(guard, [{**COLLAPSED, "rollout/staleness_max": 3}] * 3 + [HEALTHY] * 60)
    changes = [(d["step"], d["action"], d["effective_from"], d["effective_to"]) for d in decisions if d]
    assert changes == [(2, "lower", 16, 0)]
    assert guard.effective == guard.ceiling == 0 and decisions[2]["ceiling"] == 0
    from echo2cli.config import LearnerConfig
    from echo2cli.learner.loop import divergence_guard

    assert not divergence_guard(LearnerConfig(off_policy="none", adaptive_staleness=True)).corrected
    assert all(divergence_guard(LearnerConfig(off_policy=mode)).corrected for mode in ("token_tis", "ppo", "decoupled"))
    corrected = DivergenceGuard(16, LIMITS, adaptive=True)  # the same stream with a correction halves and climbs
    assert [
        d["effective_to"] for d in run(corrected, [{**COLLAPSED, "rollout/staleness_max": 3}] * 3 + [HEALTHY] * 60) if d
    ] == [1, 2]


def test_at_s_zero_a_flag_is_a_warning_only():
    guard = DivergenceGuard(0, LIMITS, adaptive=True)
    decisions = run(guard, [COLLAPSED] * 3)
    assert decisions[2]["action"] == "warn" and guard.effective == 0


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


def test_adaptive_staleness_halves_the_lag_reached_where_it_is_below_s():
    # S = 16, but the batches only reached lag 3: the flag sets S = 1 at once, not 8
    guard = DivergenceGuard(16, LIMITS, adaptive=True)
    decisions = run(guard, [{**COLLAPSED, "rollout/staleness_max": 3}] * 3)
    assert (decisions[2]["effective_from"], decisions[2]["effective_to"]) == (16, 1)
    guard = DivergenceGuard(4, LIMITS, adaptive=True)  # a lag above the effective S halves the effective S
    assert run(guard, [{**COLLAPSED, "rollout/staleness_max": 9}] * 3)[2]["effective_to"] == 2


def test_a_guard_restored_from_its_state_decides_as_the_uninterrupted_one():
    stream = [{**COLLAPSED, "rollout/staleness_max": 6}] * 3 + [HEALTHY] * 4 + [COLLAPSED] * 4 + [HEALTHY] * 30
    whole = run(DivergenceGuard(16, LIMITS, adaptive=True), stream)
    for cut in (5, 9, 12):  # mid-window, mid-patience, after the second flag
        first = DivergenceGuard(16, LIMITS, adaptive=True)
        before = [first.observe(step, m) for step, m in enumerate(stream[:cut])]
        resumed = DivergenceGuard(16, LIMITS, adaptive=True)  # a new learner's guard, from the JSON checkpoint
        resumed.load_state(json.loads(json.dumps(first.state_dict())))
        after = [resumed.observe(step, m) for step, m in enumerate(stream) if step >= cut]
        assert before + after == whole
    assert resumed.ceiling < 16 and resumed.patience > 3  # the cautious state carried over, not a fresh guard


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"effective": "x", "ceiling": 3, "patience": 3, "healthy_steps": 0, "recent": []},
        {"effective": 9, "ceiling": 9, "patience": 3, "healthy_steps": 0, "recent": []},  # above the configured S
        {"effective": 3, "ceiling": 2, "patience": 3, "healthy_steps": 0, "recent": []},  # above its own ceiling
        {"effective": 2, "ceiling": 3, "patience": 0, "healthy_steps": 0, "recent": []},
        {"effective": 2, "ceiling": 3, "patience": 3, "healthy_steps": 0, "recent": [1, 2]},
    ],
)
def test_a_malformed_guard_state_in_a_checkpoint_is_a_one_line_error(state):
    guard = DivergenceGuard(8, LIMITS, adaptive=True)
    with pytest.raises(ConfigError, match="divergence guard state is malformed") as info:
        guard.load_state(state)
    assert "\n" not in str(info.value) and guard.effective == 8  # and the guard is as it was


def test_the_ess_bound_not_given_is_the_corrections_and_the_config_records_it():
    """Without a correction the bound is tighter (0.9): at 0.8 two of five uncorrected runs at S = 16 were flagged
    only at lag 8-9 and ended below the base model (docs/BENCHMARKS.md)."""
    from echo2cli.config import LearnerConfig

    assert LearnerConfig(off_policy="none").guard_ess_min == 0.9
    assert LearnerConfig().guard_ess_min == 0.8 and LearnerConfig(off_policy="decoupled").guard_ess_min == 0.8
    assert LearnerConfig(off_policy="none", guard_ess_min=0.7).guard_ess_min == 0.7  # a given bound stands
    assert json.loads(LearnerConfig(off_policy="none").model_dump_json())["guard_ess_min"] == 0.9


def test_a_resume_that_changes_the_correction_gets_the_new_corrections_bound():
    """The saved config records the bound the run used (0.8 under token_tis); resuming with --off-policy none
    kept it, a bound that let two of five uncorrected runs fall (docs/BENCHMARKS.md). A bound given stands."""
    from echo2cli.config import LearnerConfig, load_config, resume_base

    def resumed(saved: LearnerConfig, flags: dict) -> float:
        base = resume_base(json.loads(saved.model_dump_json()))
        return load_config(LearnerConfig, None, flags, "learner", base=base).guard_ess_min

    assert resumed(LearnerConfig(), {"off_policy": "none"}) == 0.9
    assert resumed(LearnerConfig(), {}) == 0.8
    assert resumed(LearnerConfig(off_policy="none"), {"off_policy": "token_tis"}) == 0.8
    assert resumed(LearnerConfig(guard_ess_min=0.7), {"off_policy": "none"}) == 0.7  # chosen, not defaulted
    assert resumed(LearnerConfig(), {"off_policy": "none", "guard_ess_min": 0.85}) == 0.85


def test_the_default_bounds_replayed_over_recorded_runs_pass_s4_and_flag_every_collapse_early():
    """The learner's default thresholds against health recorded by `echo2 bench staleness` (docs/): no S = 2 or S = 4
    run with token_tis is flagged, though 64 of 122 at S = 4 crossed the clip bound of 0.15 once only trained tokens
    counted, and each of the five uncorrected S = 16 runs that collapsed is flagged by step 4."""
    from echo2cli.bench.staleness import replayed_flags
    from echo2cli.metrics import read_metrics

    rows = read_metrics(DOCS / "bench_staleness_pairs" / "rows.jsonl")
    s4, s2 = ([r for r in rows if r["staleness"] == s] for s in (4, 2))
    assert len(s4) >= 122 and max(c for r in s4 for c in r["health"]["train/clipfrac"] if c is not None) > 0.15
    assert len(s2) >= S2_PAIRS
    assert {r["name"]: replayed_flags(r) for r in s4 + s2} == {r["name"]: [] for r in s4 + s2}
    collapsed = read_metrics(DOCS / "bench_collapse_skipflat" / "warn" / "rows.jsonl")
    assert len(collapsed) == 5 and all(replayed_flags(r)[0] <= 4 for r in collapsed)


def test_the_replay_over_a_recorded_run_gives_the_verdicts_its_learner_logged():
    """The guard as `echo2 bench staleness` replays it over a row's recorded health flags the steps the live learner
    warned at (docs/bench_areal_skipflat: token_tis and ppo at S = 8 and 16, one run warned by the behaviour KL),
    so the replayed columns of the tables are the guard's own verdicts."""
    from echo2cli.bench.staleness import replayed_flags
    from echo2cli.metrics import read_metrics

    rows = read_metrics(DOCS / "bench_areal_skipflat" / "rows.jsonl")
    assert len(rows) >= 15 and any(r["guard"] for r in rows)
    assert {r["name"]: replayed_flags(r) for r in rows} == {r["name"]: [g["step"] for g in r["guard"]] for r in rows}
