"""`echo2 bench staleness`: the settings it runs, and how rows become the summary (pure parts)."""

import json

import pytest

from echo2cli.bench.staleness import bucket_means, run_name, settings, summary
from echo2cli.config import BenchStalenessConfig
from echo2cli.errors import ConfigError


def test_settings_cross_bounds_corrections_and_seeds_in_run_order():
    cfg = BenchStalenessConfig(staleness="0,4", off_policy="token_tis,decoupled", seeds=2)
    got = [run_name(s) for s in settings(cfg)]
    assert got == [
        "S0-token_tis-seed0",  # S = 0 under the first correction only: at lag 0 they all take the same step
        "S0-token_tis-seed1",
        "S4-token_tis-seed0",
        "S4-token_tis-seed1",
        "S4-decoupled-seed0",
        "S4-decoupled-seed1",
    ]
    assert run_name(settings(BenchStalenessConfig(staleness="8", adaptive_staleness=True, seeds=1))[0]) == (
        "S8-token_tis-adaptive-seed0"
    )
    lora = [run_name(s) for s in settings(BenchStalenessConfig(staleness="2", lora_rank="0,16", seeds=1))]
    assert lora == ["S2-token_tis-seed0", "S2-token_tis-lora16-seed0"]  # rank 0 keeps the old runs' names
    mb = settings(BenchStalenessConfig(staleness="1", minibatches=4, seeds=1))
    assert [run_name(s) for s in mb] == ["S1-token_tis-mb4-seed0"] and mb[0]["minibatches"] == 4
    more = [run_name(s) for s in settings(BenchStalenessConfig(staleness="0", seed=3, seeds=2))]
    assert more == ["S0-token_tis-seed3", "S0-token_tis-seed4"]  # more seeds on the same --out, later
    assert len(settings(BenchStalenessConfig(staleness="0,4", seed=5, seeds=112))) == 224  # the pairs' tables
    cosine = settings(BenchStalenessConfig(staleness="2", lr_schedule="cosine", lr_warmup_steps=2, lr_min_ratio=0.1))
    assert [run_name(s) for s in cosine] == ["S2-token_tis-cosine-w2-m0.1-seed0", "S2-token_tis-cosine-w2-m0.1-seed1"]
    assert run_name(settings(BenchStalenessConfig(staleness="0", seeds=1, lr_warmup_steps=3))[0]) == (
        "S0-token_tis-constant-w3-seed0"
    )


def test_a_guard_bound_given_to_the_bench_goes_to_each_setting_and_its_replay():
    from echo2cli.bench.staleness import replayed_flags

    (given,) = settings(BenchStalenessConfig(staleness="16", seeds=1, guard_ess_min=0.9))
    assert given["guard_ess_min"] == 0.9 and run_name(given) == "S16-token_tis-seed0"
    by_mode = settings(BenchStalenessConfig(staleness="16", seeds=1, off_policy="token_tis,none"))
    assert [s["guard_ess_min"] for s in by_mode] == [0.8, 0.9]  # not given: the learner's default for each correction
    recorded = row(16, 0, 0.5, 50, ess=0.85)  # between the default bound (0.8) and the given one
    assert replayed_flags(recorded | {"guard_ess_min": 0.8}) == [] and replayed_flags(
        recorded | {"guard_ess_min": 0.9}
    ) == [2, 3]
    assert replayed_flags(recorded) == []  # a row from before the bound was recorded ran at 0.8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"staleness": "0,two"}, "comma-separated integers"),
        ({"staleness": "0,-1"}, ">= 0"),
        ({"off_policy": "token_tis,vtrace"}, "unknown --off-policy 'vtrace'"),
        ({"lora_rank": "16,x"}, "comma-separated integers"),
        ({"lora_rank": "1024"}, "0 \\(the full model\\) to 512"),
        ({"minibatches": 5, "prompts_per_step": 4}, "--minibatches 5: at most one per prompt"),
        ({"lr_warmup_steps": 20, "steps": 20}, "--lr-warmup-steps 20 must be less than --steps 20"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        settings(BenchStalenessConfig(**kwargs))


def row(s, seed, acc, steady, mode="token_tis", ess=0.95, lora_rank=0):
    return {
        "lora_rank": lora_rank,
        "steps": 4,
        "health": {"train/is_ess": [ess] * 4, "train/kl_behaviour": [0.01] * 4, "train/clipfrac": [0.05] * 4},
        "guard": [],
        "staleness": s,
        "off_policy": mode,
        "adaptive": False,
        "seed": seed,
        "eval_greedy_accuracy": acc,
        "eval_pass_at_k": acc,
        "reward": [0.1, 0.2, 0.3, 0.4],
        "train_s": steady + 20,
        "steady_s": steady,
    }


def test_summary_averages_seeds_and_compares_wall_time_with_s0_of_the_same_correction():
    rows = [row(0, 0, 0.6, 100), row(0, 1, 0.7, 120), row(4, 0, 0.5, 50, ess=0.3), row(4, 1, 0.7, 60)]
    s0, s4 = summary(rows)
    assert s0["greedy_accuracy"] == pytest.approx(0.65) and s0["speedup_vs_sync"] == pytest.approx(1.0)
    assert (s4["greedy_accuracy_min"], s4["greedy_accuracy_max"]) == (0.5, 0.7)
    assert s4["speedup_vs_sync"] == pytest.approx(110 / 55)
    assert s4["flagged_runs"] == 1 and s4["first_flag_steps"] == [2, None]  # replayed: ESS 0.3 from the first window
    assert s4["reward_last3"] == pytest.approx(0.3)
    (alone,) = summary([row(8, 0, 0.5, 50, mode="geo_mask")])
    assert alone["speedup_vs_sync"] is None  # no S = 0 run of geo_mask to compare with
    full, lora = summary([row(0, 0, 0.6, 100), row(0, 0, 0.5, 80, lora_rank=16), row(2, 0, 0.4, 40, lora_rank=16)])[:2]
    assert (full["lora_rank"], lora["lora_rank"]) == (0, 16) and lora["speedup_vs_sync"] == pytest.approx(1.0)


def test_each_correction_pairs_with_its_own_s0_runs_else_with_another_corrections_s0_of_the_same_rank():
    from echo2cli.bench.staleness import time_to_accuracy

    rows = [row(0, seed, acc, 100) for seed, acc in enumerate([0.30, 0.50])]  # the sweep's one S = 0 arm
    rows += [row(4, seed, acc, 50, mode="ppo") for seed, acc in enumerate([0.40, 0.40])]
    rows += [row(0, seed, 0.60, 80, mode="decoupled") for seed in (0, 1)]  # an older OUT: decoupled's own S = 0
    rows += [row(4, seed, 0.70, 40, mode="decoupled") for seed in (0, 1)]
    rows += [row(4, 0, 0.5, 50, mode="none", lora_rank=16)]  # no S = 0 at rank 16: not paired
    by = {(r["off_policy"], r["staleness"], r["lora_rank"]): r for r in summary(rows)}
    ppo, dec, lora = by["ppo", 4, 0], by["decoupled", 4, 0], by["none", 4, 16]
    assert ppo["acc_vs_sync"]["diffs"] == pytest.approx([0.10, -0.10]) and ppo["speedup_vs_sync"] == 2.0
    assert dec["acc_vs_sync"]["diffs"] == pytest.approx([0.10, 0.10]) and dec["speedup_vs_sync"] == 2.0
    assert lora["acc_vs_sync"] is None and lora["speedup_vs_sync"] is None
    curves = [
        row(0, 0, 0.5, 100) | {"eval_curve": curve([(10, 80, 0.40), (20, 160, 0.50)])},
        row(4, 0, 0.5, 50, mode="ppo") | {"eval_curve": curve([(10, 40, 0.50), (20, 80, 0.55)])},
    ]
    got = time_to_accuracy(curves, target_version=20)[4, "ppo", False, 0]
    assert got["target_reached"] == "1/1" and got["time_to_target_vs_sync"]["mean"] == 40 / 160


def test_bucket_means_weigh_each_step_by_its_tokens():
    steps = [
        {"offpolicy/by_staleness": {"0": {"tokens": 100, "is_ess": 1.0}, "2": {"tokens": 100, "is_ess": 0.8}}},
        {"offpolicy/by_staleness": {"2": {"tokens": 300, "is_ess": 0.4}}},
        {},  # a step line without the measure
    ]
    out = bucket_means(steps)
    assert list(out) == ["0", "2"]
    assert out["2"]["tokens"] == 400 and out["2"]["is_ess"] == pytest.approx((80 + 120) / 400)


def test_the_summary_compares_each_setting_with_s0_seed_by_seed():
    rows = [row(0, seed, acc, 100) for seed, acc in enumerate([0.30, 0.50, 0.40])]
    rows += [row(4, seed, acc, 50) for seed, acc in enumerate([0.35, 0.56, 0.44])]  # +0.05, +0.06, +0.04
    rows += [row(4, 3, 0.9, 50)]  # a seed S = 0 has not run: not paired
    by_s = {r["staleness"]: r for r in summary(rows)}
    assert by_s[0]["acc_vs_sync"] is None
    paired = by_s[4]["acc_vs_sync"]
    assert paired["seeds"] == [0, 1, 2] and paired["mean"] == pytest.approx(0.05)
    assert 0.04 - 1e-9 <= paired["low"] <= 0.05 <= paired["high"] <= 0.06 + 1e-9
    assert by_s[4]["seeds_for_half_width_0.03"] == 3  # sd 0.01: t(2) * 0.01 / sqrt(3) = 0.025; t(1) at n = 2: 0.090


def test_a_run_scored_over_its_last_versions_is_the_mean_of_their_accuracies():
    """--score-versions 3: v16, v18 and the final v20 (the curve stops short of it, so the final eval counts)."""
    from echo2cli.bench.staleness import run_score

    r = {**row(0, 0, 0.80, 100), "name": "S0-token_tis-seed0", "steps": 20}
    r["eval_curve"] = curve([(v, v, a) for v, a in [(12, 0.2), (14, 0.3), (16, 0.5), (18, 0.7)]])
    assert run_score(r) == 0.80
    assert run_score(r, 3) == pytest.approx((0.5 + 0.7 + 0.8) / 3)
    assert run_score(r, 5) == pytest.approx((0.2 + 0.3 + 0.5 + 0.7 + 0.8) / 5)
    with pytest.raises(ConfigError, match="S0-token_tis-seed0 has 5 evaluated version"):
        run_score(r, 6)


def test_the_summary_pairs_seeds_on_the_score_it_is_given():
    """A seed whose last version swung down is paired on its mean over the last two when asked."""
    rows = []
    for s, last, before in [(0, 0.3, 0.7), (2, 0.6, 0.6)]:
        r = {**row(s, 0, last, 100), "eval_curve": curve([(2, 2, before), (4, 4, last)])}
        rows.append(r)
    rows.append({**row(0, 1, 0.5, 100), "eval_curve": curve([(2, 2, 0.5), (4, 4, 0.5)])})
    rows.append({**row(2, 1, 0.6, 100), "eval_curve": curve([(2, 2, 0.4), (4, 4, 0.6)])})
    final = {r["staleness"]: r for r in summary(rows)}[2]
    assert final["acc_vs_sync"]["diffs"] == pytest.approx([0.3, 0.1])
    mean2 = {r["staleness"]: r for r in summary(rows, score_versions=2)}[2]
    assert mean2["acc_vs_sync"]["diffs"] == pytest.approx([0.6 - 0.5, 0.5 - 0.5])
    assert mean2["score_versions"] == 2 and mean2["greedy_accuracy"] == pytest.approx((0.6 + 0.5) / 2)


def test_runs_scored_on_the_training_mix_pair_on_it_and_a_row_without_it_is_a_one_line_error():
    """--score-mix train: the score is `greedy_accuracy_train_mix`, at the final version and along the curve."""
    from echo2cli.bench.staleness import TRAIN_MIX, run_score, score_key

    assert (score_key("split"), score_key("train")) == ("greedy_accuracy", TRAIN_MIX)
    rows = []
    for s, seed, split, mix in [(0, 0, 0.30, 0.70), (0, 1, 0.80, 0.90), (2, 0, 0.70, 0.80), (2, 1, 0.75, 0.85)]:
        r = {**row(s, seed, split, 100), "name": f"S{s}-seed{seed}", f"eval_{TRAIN_MIX}": mix}
        r["eval_curve"] = [{"version": 2, "time_s": 2, "greedy_accuracy": split, TRAIN_MIX: mix - 0.1}]
        rows.append(r)
    assert run_score(rows[0], key=TRAIN_MIX) == 0.70 and run_score(rows[0], 2, TRAIN_MIX) == pytest.approx(0.65)
    split = {r["staleness"]: r for r in summary(rows)}[2]
    assert split["acc_vs_sync"]["diffs"] == pytest.approx([0.40, -0.05])
    mix = {r["staleness"]: r for r in summary(rows, key=TRAIN_MIX)}[2]
    assert mix["acc_vs_sync"]["diffs"] == pytest.approx([0.10, -0.05]) and mix["score_key"] == TRAIN_MIX
    old = row(0, 0, 0.5, 100) | {"name": "S0-token_tis-seed0"}  # evaluated before levels were reported
    with pytest.raises(ConfigError, match="S0-token_tis-seed0 has no greedy_accuracy_train_mix"):
        run_score(old, key=TRAIN_MIX)


@pytest.mark.parametrize(
    ("eval_every", "eval_from", "versions"),
    [(10, 0, [10, 20]), (2, 12, [12, 14, 16, 18, 20]), (3, 10, [12, 15, 18]), (0, 12, [])],
)
def test_the_curve_starts_at_eval_from(eval_every, eval_from, versions):
    from echo2cli.bench.staleness import curve_versions

    assert curve_versions(BenchStalenessConfig(steps=20, eval_every=eval_every, eval_from=eval_from)) == versions


def test_scoring_over_more_versions_than_a_run_evaluates_is_refused_before_any_run():
    settings(BenchStalenessConfig(steps=20, eval_every=2, eval_from=12, score_versions=5))
    settings(BenchStalenessConfig(steps=20, eval_every=3, eval_from=10, score_versions=4))  # 12, 15, 18 and final
    with pytest.raises(ConfigError, match="--score-versions 6 needs as many evaluated versions per run"):
        settings(BenchStalenessConfig(steps=20, eval_every=2, eval_from=12, score_versions=6))


def curve(points):
    """An accuracy curve: (version, seconds into the run, held-out greedy accuracy) per point."""
    return [{"version": v, "time_s": t, "greedy_accuracy": a} for v, t, a in points]


def test_time_to_accuracy_is_the_first_curve_point_at_s0s_accuracy_at_the_target_version_seed_by_seed():
    from echo2cli.bench.staleness import time_to_accuracy

    rows = [
        row(0, 0, 0.5, 100) | {"eval_curve": curve([(10, 80, 0.40), (20, 160, 0.50), (30, 240, 0.55)])},
        row(0, 1, 0.6, 100) | {"eval_curve": curve([(10, 80, 0.60), (20, 160, 0.55), (30, 240, 0.58)])},
        row(2, 0, 0.6, 60) | {"eval_curve": curve([(10, 50, 0.45), (20, 100, 0.52), (30, 150, 0.6)])},
        row(2, 1, 0.6, 60) | {"eval_curve": curve([(10, 50, 0.50), (20, 100, 0.54), (30, 150, 0.54)])},
        row(4, 0, 0.3, 60) | {"eval_curve": curve([(10, 50, 0.2), (20, 100, 0.3)])},  # never gets there
    ]
    got = time_to_accuracy(rows, target_version=25)  # S = 0's point at or before 25: version 20's
    s0, s2, s4 = (got[s, "token_tis", False, 0] for s in (0, 2, 4))
    # S = 0 reaches its own v20 accuracy at v20 (seed 0, 160 s), or earlier (seed 1: 0.60 at v10 >= 0.55, 80 s)
    assert s0["target_reached"] == "2/2" and s0["time_to_target_s"] == 120 and s0["time_to_target_vs_sync"] is None
    # S = 2: seed 0 reaches 0.50 at v20 (100 s); seed 1 needs 0.55 and never gets it
    assert s2["target_reached"] == "1/2" and s2["time_to_target_s"] == 100
    assert s2["time_to_target_vs_sync"]["seeds"] == [0] and s2["time_to_target_vs_sync"]["mean"] == 100 / 160
    assert s4["target_reached"] == "0/1" and s4["time_to_target_s"] is None
    assert s4["time_to_target_vs_sync"]["mean"] is None
    by_s = {r["staleness"]: r for r in summary(rows, target_version=25)}
    assert by_s[2]["time_to_target_s"] == 100 and "target_reached" in by_s[4]
    assert "target_reached" not in summary([row(1, 0, 0.5, 10)])[0]  # no curves: no time to accuracy


def test_a_runs_curve_gets_each_versions_time_from_the_step_that_trained_it(tmp_path):
    import json

    from echo2cli.bench.staleness import row_of

    steps = [{"step": t, "time_s": 10.0 * (t + 1), "rollout/reward_mean": 0.1, "rollout/staleness_mean": 0.0}
             for t in range(4)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "decisions.jsonl").write_text("")
    setting = {"staleness": 1, "off_policy": "token_tis", "adaptive": False, "lora_rank": 0, "seed": 0}
    evaluation = {"greedy_accuracy": 0.5, "curve": [{"version": 2, "greedy_accuracy": 0.4}]}
    r = row_of(setting, tmp_path, 50.0, evaluation)
    assert r["eval_curve"] == [{"version": 2, "greedy_accuracy": 0.4, "time_s": 20.0}]  # version 2: after step 1
    assert r["eval_greedy_accuracy"] == 0.5 and "eval_curve" in r and "eval_curve" not in evaluation


def test_a_runs_accuracy_over_time_is_its_curve_then_its_final_checkpoint_at_the_last_step():
    from echo2cli.bench.staleness import TRAIN_MIX, accuracy_over_time

    r = row(2, 0, 0.5, 100) | {"eval_curve": curve([(2, 20, 0.4), (4, 40, 0.45)])}
    assert accuracy_over_time(r) == [(20, 0.4), (120, 0.5)]  # version 4 is the final checkpoint, at train_s
    final_only = row(2, 0, 0.5, 100) | {f"eval_{TRAIN_MIX}": 0.6}
    assert accuracy_over_time(final_only, TRAIN_MIX) == [(120, 0.6)]


def test_the_plot_draws_held_out_accuracy_with_curves_and_with_final_scores_only(tmp_path):
    from echo2cli.bench.staleness import TRAIN_MIX, plot

    rows = [
        row(s, seed, 0.5, 100)
        | {"name": f"S{s}-token_tis-seed{seed}", "time_s": [10, 20, 30, 40], "staleness_mean": [0, 0, 1, 1]}
        | {"eval_curve": curve([(2, 20 + seed, 0.4), (4, 40 + seed, 0.5)]), f"eval_{TRAIN_MIX}": 0.6 + seed / 10}
        for s in (0, 2)
        for seed in (0, 1)
    ]
    plot(rows, tmp_path / "curves.png")
    plot([r | {"eval_curve": []} for r in rows], tmp_path / "finals.png", TRAIN_MIX, base=0.3)
    plot(rows[:1], tmp_path / "one.png")
    pngs = ("curves.png", "finals.png", "one.png")
    widths = {int.from_bytes((tmp_path / f).read_bytes()[16:20], "big") for f in pngs}
    assert len(widths) == 1  # four panels each (the PNG header's width)


def test_collapse_finds_the_first_version_below_base_and_the_guards_lead_on_it():
    from echo2cli.bench.staleness import collapse

    flagged = {"train/is_ess": [0.95, 0.3, 0.3, 0.3], "train/kl_behaviour": [0.01] * 4, "train/clipfrac": [0.05] * 4}
    # replayed, the guard's first verdict (on steps 0-2) flags at step 2, as version 3 is trained
    falls = row(16, 0, 0.1, 50) | {"steps": 8, "health": {k: v * 2 for k, v in flagged.items()}}
    every2 = falls | {"eval_curve": curve([(2, 20, 0.5), (4, 40, 0.45), (6, 60, 0.2), (8, 80, 0.1)])}
    # below 0.3 first at v6; the fall can have come as early as v5 (v4 was above): a lead of 5 - 3 = 2 versions
    assert collapse(every2, base=0.3) == {
        "below_base_version": 6,
        "lasting_below_version": 6,  # and it never came back
        "first_flag_step": 2,
        "flag_lead_versions": 2,
        "lasting_lead_versions": 2,
    }
    every1 = falls | {"eval_curve": curve([(v, 10 * v, 0.5 if v < 4 else 0.1) for v in range(1, 9)])}
    assert collapse(every1, base=0.3)["flag_lead_versions"] == 1  # below at v4, one version after the flag
    # no curve: only the final version is known, and the fall can have come at any version
    assert collapse(falls, base=0.3) == {
        "below_base_version": 8,
        "lasting_below_version": 8,
        "first_flag_step": 2,
        "flag_lead_versions": -2,
        "lasting_lead_versions": -2,
    }
    # an early dip on fresh batches, back above base, then the fall it ended in
    dips = falls | {"eval_curve": curve([(2, 20, 0.2), (4, 40, 0.5), (6, 60, 0.2), (8, 80, 0.1)])}
    assert collapse(dips, base=0.3) == {
        "below_base_version": 2,
        "lasting_below_version": 6,
        "first_flag_step": 2,
        "flag_lead_versions": -2,  # v1 - v3: the dip came before the flag
        "lasting_lead_versions": 2,  # v5 - v3
    }
    recovers = dips | {"steps": 4, "eval_curve": curve([(2, 20, 0.2), (4, 40, 0.5)]), "eval_greedy_accuracy": 0.5}
    assert collapse(recovers, base=0.3)["below_base_version"] == 2
    assert collapse(recovers, base=0.3)["lasting_below_version"] is None
    healthy = row(2, 0, 0.6, 50) | {"eval_curve": curve([(2, 20, 0.5), (4, 40, 0.55)])}
    assert collapse(healthy, base=0.3) == {
        "below_base_version": None,
        "lasting_below_version": None,
        "first_flag_step": None,
        "flag_lead_versions": None,
        "lasting_lead_versions": None,
    }
    unflagged = row(2, 0, 0.1, 50)
    assert collapse(unflagged, base=0.3) == {
        "below_base_version": 4,
        "lasting_below_version": 4,
        "first_flag_step": None,
        "flag_lead_versions": None,
        "lasting_lead_versions": None,
    }
    (s16,) = summary([every2, every1 | {"seed": 1}, healthy | {"staleness": 16, "seed": 2}], base_model_acc=0.3)
    assert s16["below_base_runs"] == 2 and s16["below_base_versions"] == [6, 4] and s16["flag_leads"] == [2, 1]
    assert s16["flagged_2_ahead"] == 1
    (s16,) = summary([every2, dips | {"seed": 1}, recovers | {"seed": 2}], base_model_acc=0.3)
    assert (s16["below_base_runs"], s16["flag_leads"], s16["flagged_2_ahead"]) == (3, [2, -2, -2], 1)
    assert (s16["ended_below_base_runs"], s16["lasting_flag_leads"], s16["lasting_flagged_2_ahead"]) == (2, [2, 2], 2)
    assert "below_base_runs" not in summary([healthy])[0]  # no base measured: no collapse columns
    guard = [{"step": 2, "action": "lower"}, {"step": 5, "action": "raise"}, {"step": 6, "action": "lower"}]
    adaptive = row(16, 0, 0.5, 50) | {"adaptive": True, "guard": guard}
    assert summary([adaptive])[0]["first_flag_steps"] == [2] and summary([adaptive])[0]["flagged_runs"] == 1
    assert collapse(adaptive | {"guard": guard[1:2]}, base=0.3)["first_flag_step"] is None  # a raise is no flag


def test_a_rerun_skips_finished_settings_and_starts_an_interrupted_one_afresh(tmp_path, monkeypatch):
    from echo2cli.bench import staleness

    cfg = BenchStalenessConfig(staleness="0,4", seeds=1, out_dir=tmp_path)
    done, interrupted = (run_name(s) for s in settings(cfg))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"name": done}) + "\n")
    (tmp_path / interrupted).mkdir()
    (tmp_path / interrupted / "learner.json").write_text("{}")  # the killed run's, naming a dead port
    (tmp_path / interrupted / "decisions.jsonl").write_text("{}\n")
    trained = []

    def train(cfg, setting, out):
        trained.append((run_name(setting), sorted(p.name for p in out.iterdir()) if out.exists() else []))
        return 1.0

    monkeypatch.setattr(staleness, "prepare_default_model", lambda: None)
    monkeypatch.setattr(staleness, "base_accuracy", lambda cfg: 0.5)
    monkeypatch.setattr(staleness, "train", train)
    monkeypatch.setattr(staleness, "evaluate_run", lambda cfg, out: {})
    monkeypatch.setattr(staleness, "row_of", lambda setting, out, wall, ev: {"name": run_name(setting)})
    rows = staleness.run_bench(cfg, on_row=lambda row: None)
    assert [r["name"] for r in rows] == [done, interrupted]
    assert trained == [(interrupted, [])]  # nothing of the interrupted run is left for the new one to read


@pytest.mark.parametrize(
    ("eval_k", "eval_every", "calls"),
    [
        (0, 10, [["10", "20"]]),
        (4, 10, [None, ["10", "20"]]),
        (0, 0, [None]),
        (0, 3, [None, ["3", "6", "9", "12", "15", "18"]]),
    ],
)
def test_a_greedy_only_evaluation_of_the_last_version_is_the_final_one(
    monkeypatch, tmp_path, eval_k, eval_every, calls
):
    """One engine, not two, when the final checkpoint is the curve's last point and no samples are asked for."""
    from echo2cli.bench import staleness

    seen: list[list[str] | None] = []

    def fake_eval(out, args):
        versions = args[args.index("--version") + 1].split(",") if "--version" in args else None
        seen.append(versions)
        points = [{"version": int(v), "greedy_accuracy": int(v) / 100, "pass_at_k": int(v) / 100,
                   "sampled_reward": int(v) / 100} for v in versions or []]  # fmt: skip
        head = points[0] if points else {"greedy_accuracy": 0.5, "pass_at_k": 0.6, "sampled_reward": 0.4}
        return {**head, "problems": 340, "then": points[1:]}

    monkeypatch.setattr(staleness, "_eval", fake_eval)
    cfg = BenchStalenessConfig(steps=20, eval_k=eval_k, eval_every=eval_every)
    measures = staleness.evaluate_run(cfg, tmp_path)
    assert seen == calls
    assert measures["problems"] == 340
    if calls == [["10", "20"]]:
        assert measures["greedy_accuracy"] == 0.2 and [c["version"] for c in measures["curve"]] == [10, 20]
    else:
        assert measures["greedy_accuracy"] == 0.5


def test_a_sweeps_table_redirected_to_a_file_keeps_its_columns(tmp_path, monkeypatch):
    """A finished OUT reprints its tables (nothing runs); a pipe, as in `echo2 bench staleness ... > log`, gets
    the whole table with the paired difference and both intervals, not rich's 80 columns cut to '0.…'."""
    from typer.testing import CliRunner

    from echo2cli.bench import staleness
    from echo2cli.cli import app

    rows = [row(0, seed, acc, 100) for seed, acc in enumerate([0.30, 0.50, 0.40])]
    rows += [row(2, seed, acc, 50) for seed, acc in enumerate([0.35, 0.56, 0.44])]
    (tmp_path / "rows.jsonl").write_text(
        "".join(json.dumps(r | {"name": f"S{r['staleness']}-token_tis-seed{r['seed']}"}) + "\n" for r in rows)
    )
    (tmp_path / "base.json").write_text(json.dumps({"greedy_accuracy": 0.2}))
    monkeypatch.setattr(staleness, "prepare_default_model", lambda: None)
    result = CliRunner().invoke(
        app, ["bench", "staleness", "--staleness", "0,2", "--seeds", "3", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "acc - S=0 [bootstrap 95%] t [95%]" in result.output and "…" not in result.output
    d = summary(rows)[1]["acc_vs_sync"]
    assert (
        f"+0.050 [{d['low']:+.3f}, {d['high']:+.3f}] t [{d['t_low']:+.3f}, {d['t_high']:+.3f}] (n=3)" in result.output
    )
