"""Paired comparisons by seed with bootstrap intervals (echo2cli/bench/paired.py): pure arithmetic."""

import numpy as np
import pytest

from echo2cli.bench.paired import (
    auc,
    bootstrap_interval,
    censored_median,
    describe,
    describe_median,
    paired_difference,
    seeds_needed,
    sign_test,
    t_interval,
    t_quantile,
    time_to,
)


def test_differences_are_taken_on_the_shared_seeds_only():
    a = {0: 0.50, 1: 0.60, 2: 0.70, 5: 0.9}
    b = {0: 0.40, 1: 0.65, 2: 0.60, 3: 0.1}
    d = paired_difference(a, b)
    assert d["seeds"] == [0, 1, 2] and d["pairs"] == 3
    assert d["diffs"] == pytest.approx([0.10, -0.05, 0.10])
    assert d["mean"] == pytest.approx(0.05)
    assert d["low"] <= d["mean"] <= d["high"] and d["half_width"] == pytest.approx((d["high"] - d["low"]) / 2)


def test_pairing_removes_what_the_seed_alone_did():
    """Seeds that move both settings alike (a hard or easy draw of problems) widen an unpaired comparison but
    not the paired one: here every seed's difference is the same 0.04, so the interval is that point."""
    seed_effect = {s: 0.3 * np.sin(s) for s in range(8)}
    a = {s: 0.5 + e + 0.04 for s, e in seed_effect.items()}
    b = {s: 0.5 + e for s, e in seed_effect.items()}
    d = paired_difference(a, b)
    assert d["low"] == pytest.approx(0.04) and d["high"] == pytest.approx(0.04)
    unpaired = bootstrap_interval(list(a.values()))
    assert unpaired is not None and unpaired[1] - unpaired[0] > 0.2


def test_the_interval_is_seeded_and_covers_a_known_mean():
    """The same rows give the same interval each time; for normal data its width is near the t-interval's
    (2 * 1.96 * sd / sqrt(n) for large n), and across many draws it holds the true mean about 95 % of the time."""
    rng = np.random.default_rng(1)
    x = rng.normal(0.1, 0.05, 400)
    first = bootstrap_interval(x)
    assert first == bootstrap_interval(x)
    assert first[1] - first[0] == pytest.approx(2 * 1.96 * 0.05 / 20, rel=0.1)
    held = 0
    for _ in range(200):
        low, high = bootstrap_interval(rng.normal(0.1, 0.05, 30), resamples=2000)
        held += low <= 0.1 <= high
    assert 0.88 <= held / 200 <= 0.99


@pytest.mark.parametrize(
    ("p", "df", "table"),
    [(0.975, 1, 12.7062), (0.975, 4, 2.7764), (0.975, 8, 2.3060), (0.975, 30, 2.0423), (0.995, 2, 9.9248)],
)
def test_t_quantiles_match_the_tables(p, df, table):
    assert t_quantile(p, df) == pytest.approx(table, abs=1e-4)


def test_t_quantile_refuses_what_it_cannot_give():
    with pytest.raises(ValueError, match="df >= 1"):
        t_quantile(0.975, 0)
    with pytest.raises(ValueError, match="0.5 <= p < 1"):
        t_quantile(0.4, 5)


def test_the_t_interval_is_wider_than_the_bootstrap_at_few_pairs_and_agrees_at_many():
    """Nine pairs (the staleness sweep's training-mix differences of seeds 0-8): the t interval by the formula,
    wider than the percentile bootstrap's; at 400 normal values the two are within a tenth of each other."""
    diffs = [0.063, 0.069, 0.014, 0.181, -0.112, 0.027, 0.195, 0.095, 0.045]
    low, high = t_interval(diffs)
    half = 2.3060 * np.std(diffs, ddof=1) / 3
    assert (low, high) == pytest.approx((np.mean(diffs) - half, np.mean(diffs) + half), abs=1e-4)
    boot = bootstrap_interval(diffs)
    assert high - low > boot[1] - boot[0]
    x = np.random.default_rng(3).normal(0.1, 0.05, 400)
    assert np.subtract(*t_interval(x)[::-1]) == pytest.approx(np.subtract(*bootstrap_interval(x)[::-1]), rel=0.1)
    assert t_interval([0.2]) is None


def test_a_paired_difference_carries_its_t_interval_and_describes_it_on_request():
    d = paired_difference({0: 0.5, 1: 0.7, 2: 0.6}, {0: 0.4, 1: 0.6, 2: 0.6})
    assert (d["t_low"], d["t_high"]) == pytest.approx(t_interval(d["diffs"]))
    assert " t [" not in describe(d)
    assert describe(d, t=True) == (
        f"+0.067 [{d['low']:+.3f}, {d['high']:+.3f}] t [{d['t_low']:+.3f}, {d['t_high']:+.3f}] (n=3)"
    )
    assert describe(paired_difference({0: 0.5}, {0: 0.4}), t=True) == "+0.100 (n=1)"


def test_too_few_pairs_give_no_interval_and_say_so():
    assert bootstrap_interval([0.3]) is None
    one = paired_difference({0: 0.5}, {0: 0.4, 1: 0.2})
    assert one["pairs"] == 1 and one["low"] is None and describe(one) == "+0.100 (n=1)"
    none = paired_difference({0: 0.5}, {1: 0.4})
    assert none["mean"] is None and describe(none) == "-"
    assert describe(paired_difference({0: 0.5, 1: 0.6}, {0: 0.5, 1: 0.5})).endswith("(n=2)")


def test_seeds_needed_grows_with_the_spread_and_the_wanted_precision():
    diffs = [0.1, -0.1, 0.2, -0.2, 0.0]  # sd 0.158
    n = seeds_needed(diffs, 0.03)
    sd = np.std(diffs, ddof=1)
    assert t_quantile(0.975, n - 1) * sd / np.sqrt(n) <= 0.03 < t_quantile(0.975, n - 2) * sd / np.sqrt(n - 1)
    assert n > (1.96 * sd / 0.03) ** 2  # above the normal approximation, which ignores that sd is estimated
    assert seeds_needed(diffs, 0.06) < n
    assert seeds_needed([0.05, 0.05], 0.03) == 2  # no spread: the fewest that can show one
    assert seeds_needed([0.1], 0.03) is None


def test_time_to_is_the_first_point_at_or_above_the_target():
    curve = [{"time_s": 50, "greedy_accuracy": 0.3}, {"time_s": 90, "greedy_accuracy": 0.5}]
    curve += [{"time_s": 130, "greedy_accuracy": 0.4}, {"time_s": 170, "greedy_accuracy": 0.6}]
    assert time_to(curve, 0.5) == 90.0  # reached exactly, and before a later dip
    assert time_to(curve, 0.55) == 170.0
    assert time_to(curve, 0.7) is None and time_to([], 0.1) is None


def test_a_censored_median_counts_a_miss_as_later_than_every_time():
    times = {0: 0.2, 1: None, 2: 0.4, 3: 0.3, 4: 0.1}  # sorted: 0.1, 0.2, 0.3, 0.4, never
    d = censored_median(times)
    assert d["median"] == 0.3 and d["reached"] == 4 and d["pairs"] == 5 and d["seeds"] == [0, 1, 2, 3, 4]
    # 3 or more of 5 draws the same value has p = 0.058, over the 2.5 % tails: the 0.1 seed at the low end, a miss
    # (never) at the high end
    assert describe_median(d) == "0.300 [0.100, never] (4/5 reached)"
    even = censored_median({0: 0.2, 1: 0.4, 2: None, 3: 0.3})  # two middle values 0.3 and 0.4
    assert even["median"] == pytest.approx(0.35)
    assert censored_median({0: 0.5, 1: None})["median"] is None  # half missed: the median is never
    sure = censored_median({s: 0.1 * (s + 1) for s in range(9)})  # no misses: an ordinary median and interval
    assert sure["median"] == pytest.approx(0.5) and sure["high"] is not None and sure["low"] < 0.5 < sure["high"]
    assert censored_median({})["median"] is None and describe_median(censored_median({})) == "-"
    assert describe_median(censored_median({0: 0.25})) == "0.250 (1/1 reached)"
    assert censored_median(times) == d  # seeded: the same report from the same rows


def load_bench_vs_trl():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "bench_vs_trl.py"
    spec = importlib.util.spec_from_file_location("bench_vs_trl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_trl_comparison_reports_each_learning_rate_paired_by_seed(tmp_path, capsys):
    bench = load_bench_vs_trl()
    rows = []
    runs = [  # echo2's accuracy, wall, curve of (time, accuracy); TRL's accuracy, wall
        (0.6, 200, [(60, 0.40), (100, 0.50), (200, 0.60)], 0.45, 400),  # TRL's 0.45 reached at 100 s: 0.25
        (0.65, 210, [(60, 0.30), (110, 0.40), (210, 0.65)], 0.47, 420),  # reached at the end, 210 s: 0.5
        (0.40, 200, [(60, 0.30), (100, 0.35), (200, 0.40)], 0.50, 400),  # never reached
    ]
    for seed, (acc, wall, curve, trl_acc, trl_wall) in enumerate(runs):
        common = {"steps": 20, "reward": [0.1] * 20, "pass_at_k": 0.7, "seed": seed}
        points = [{"time_s": t, "greedy_accuracy": a} for t, a in curve]
        rows.append(
            {"name": f"e{seed}", "side": "echo2", "lr": 5e-5, "wall_s": wall, "greedy_accuracy": acc, **common}
            | {"eval_curve": points, "time_s": [wall * (i + 1) / 20 for i in range(20)]}
        )
        rows.append(
            {"name": f"t{seed}", "side": "trl", "lr": 1e-5, "wall_s": trl_wall, "greedy_accuracy": trl_acc, **common}
            | {"step_s": [trl_wall / 20] * 20}
        )
    rows.append({**rows[-1], "name": "t9", "seed": 9})  # no echo2 run with seed 9: left out of the pairs
    rows.append({**rows[0], "name": "e0-lr2e-5", "lr": 2e-5, "greedy_accuracy": 0.5})  # a second echo2 rate, one seed
    rows.append({**rows[1], "name": "tb0", "side": "trl-bf16", "greedy_accuracy": 0.4})  # TRL with echo2's numerics
    bench.report(rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("| 5e-05 | 1e-05 (bf16 policy) | +0.200 (n=1) |")  # a row of its own, named
    assert lines[-4].startswith("| 2e-05 | 1e-05 | +0.050 (n=1) |")  # each echo2 rate has its row
    cells = [c.strip() for c in lines[-2].strip("|").split("|")]
    assert cells[:2] == ["5e-05", "1e-05"]
    assert cells[2].startswith("+0.077 [") and cells[2].endswith("(n=3)")  # 0.15, 0.18, -0.10
    assert cells[3] == "0.500 [0.500, 0.500] (n=3)"
    assert cells[4] == "2/3"
    assert cells[5] == "0.375 [0.250, 0.500] (n=2)"  # the mean over the two seeds that reached it
    assert cells[6].startswith("0.500 [0.250, never] (2/3 reached)")  # the median, seed 2's miss counted as never
    bench.plot(rows, tmp_path / "vs_trl.png")  # reward and held-out accuracy against wall time, seeds as bands
    assert (tmp_path / "vs_trl.png").stat().st_size > 0


def test_staleness_runs_join_the_trl_comparison_as_echo2_sides_named_by_s_and_dtype(tmp_path, capsys):
    import json

    bench = load_bench_vs_trl()
    with open(tmp_path / "rows.jsonl", "w") as rows:
        for seed, acc in enumerate([0.80, 0.70]):
            name = f"S0-token_tis-seed{seed}"
            (tmp_path / name).mkdir()
            config = {"staleness": 0, "wire_dtype": "fp16", "lr": 1e-5, "seed": seed}
            (tmp_path / name / "config.json").write_text(json.dumps(config))
            curve = [{"version": 10, "greedy_accuracy": acc - 0.1, "time_s": 100.0}]
            # seed 1's curve lacks its final version, as when --eval-every does not divide the steps
            curve += [{"version": 20, "greedy_accuracy": acc, "time_s": 200.0}] if seed == 0 else []
            row = {
                "name": name,
                "seed": seed,
                "steps": 20,
                "reward": [0.5] * 20,
                "time_s": [10.0 * i for i in range(20)],
            }
            row |= {"train_s": 200.0, "wall_s": 215.0, "eval_curve": curve}
            rows.write(json.dumps(row | {"eval_greedy_accuracy": acc, "eval_pass_at_k": acc}) + "\n")
    echo2 = bench.staleness_rows(tmp_path)
    assert [r["side"] for r in echo2] == ["echo2 S=0 fp16"] * 2 and echo2[0]["lr"] == 1e-5
    assert echo2[0]["wall_s"] == 200.0  # learner start to its last step, as the demo counts it
    for run in echo2:  # the final version ends each curve once, whether the bench scored it in the curve or not
        assert [c["version"] for c in run["eval_curve"]] == [10, 20] and run["eval_curve"][-1]["time_s"] == 200.0
    trl = [
        {"name": f"t{seed}", "side": "trl", "lr": 1e-5, "seed": seed, "steps": 20, "wall_s": 400.0}
        | {"greedy_accuracy": 0.75, "pass_at_k": 0.8, "reward": [0.5] * 20, "step_s": [20.0] * 20}
        for seed in (0, 1)
    ]
    bench.report(echo2 + trl)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    cells = [c.strip() for c in last.strip("|").split("|")]
    assert cells[:2] == ["1e-05, S=0, fp16", "1e-05"]
    assert cells[2].startswith("+0.000 [") and cells[4] == "1/2"  # +0.05 and -0.05; seed 1 never reached 0.75
    assert cells[5] == "0.500 (n=1)"  # seed 0 reached it at its last version, 200 s of TRL's 400
    assert cells[6] == "never [0.500, never] (1/2 reached)"  # half the seeds never reached it


def test_echo2_runs_without_rows_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    import sys

    import pytest

    bench = load_bench_vs_trl()
    argv = ["bench_vs_trl.py", "--echo2-runs", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stop:
        bench.main()
    assert stop.value.code == 2 and not (tmp_path / "out").exists()
    assert "--echo2-runs" in capsys.readouterr().err.strip().splitlines()[-1]


def test_trl_with_echo2s_numerics_samples_rounded_weights_and_steps_the_fp32_master():
    import torch

    bench = load_bench_vs_trl()
    model = torch.nn.Linear(4, 4)
    master = model.weight.data.clone()
    callback = bench.rounded_policy()
    callback.on_train_begin(None, None, None, model=model)
    assert torch.equal(model.weight.data, master.bfloat16().float())  # the policy: the weights as published
    assert not torch.equal(model.weight.data, master)
    callback.on_pre_optimizer_step(None, None, None, model=model)
    assert torch.equal(model.weight.data, master)  # the optimizer steps the fp32 master
    model.weight.data.add_(1e-5)
    callback.on_optimizer_step(None, None, None, model=model)
    assert torch.equal(model.weight.data, (master + 1e-5).bfloat16().float())
    callback.on_pre_optimizer_step(None, None, None, model=model)
    assert torch.equal(model.weight.data, master + 1e-5)  # a step below a bf16 ulp is kept in the master


def test_trl_takes_echo2s_scheduled_rate_at_each_optimizer_step():
    from types import SimpleNamespace

    import torch

    from echo2cli.learner.schedule import LrSchedule

    bench = load_bench_vs_trl()
    schedule = LrSchedule(2e-5, 10, "cosine", warmup_steps=2, min_ratio=0.1)
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=2e-5)
    applied: list[float] = []
    callback = bench.scheduled_rate(schedule, applied)
    for step in range(10):  # the trainer's global_step before its optimizer step: the 0-based step
        callback.on_pre_optimizer_step(None, SimpleNamespace(global_step=step), None, optimizer=optimizer)
        assert optimizer.param_groups[0]["lr"] == schedule.at(step)
        optimizer.param_groups[0]["lr"] = 2e-5  # as TRL's constant scheduler puts it back after the step
    assert applied == [schedule.at(step) for step in range(10)]
    assert applied[0] == 1e-5 and applied[1] == 2e-5 and applied[-1] < 0.2 * 2e-5


def test_scheduled_sides_are_named_after_their_schedule(tmp_path, monkeypatch, capsys):
    import json
    import sys

    import pytest

    bench = load_bench_vs_trl()
    (tmp_path / "S2-token_tis-cosine-m0.1-seed0").mkdir()
    config = {"staleness": 2, "wire_dtype": "bf16", "lr": 2e-5, "lr_schedule": "cosine", "lr_min_ratio": 0.1}
    (tmp_path / "S2-token_tis-cosine-m0.1-seed0" / "config.json").write_text(json.dumps(config))
    row = {"name": "S2-token_tis-cosine-m0.1-seed0", "seed": 0, "steps": 20, "reward": [0.5] * 20}
    row |= {"time_s": [10.0 * i for i in range(20)], "train_s": 200.0, "eval_curve": []}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row | {"eval_greedy_accuracy": 0.8, "eval_pass_at_k": 0.8}))
    echo2 = bench.staleness_rows(tmp_path)
    assert echo2[0]["side"] == "echo2 S=2 bf16 cosine-m0.1"
    trl = {"name": "t0", "side": "trl cosine-m0.1", "lr": 1e-5, "seed": 0, "steps": 20, "wall_s": 400.0}
    trl |= {"greedy_accuracy": 0.75, "pass_at_k": 0.8, "reward": [0.5] * 20, "step_s": [20.0] * 20}
    bench.report([*echo2, trl])
    cells = [c.strip() for c in capsys.readouterr().out.strip().splitlines()[-1].strip("|").split("|")]
    assert cells[:2] == ["2e-05, S=2, bf16, cosine-m0.1", "1e-05, cosine-m0.1"]
    argv = ["bench_vs_trl.py", "--trl-lr-schedule", "cosine", "--trl-lr-warmup-steps", "20", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stop:  # a warmup that never ends: one line before anything runs
        bench.main()
    assert stop.value.code == 2 and "--trl-lr-warmup-steps 20" in capsys.readouterr().err.strip().splitlines()[-1]


def test_report_seeds_limits_the_tables_to_the_seeds_named(tmp_path, monkeypatch, capsys):
    import json
    import sys

    bench = load_bench_vs_trl()
    rows = []
    for seed, (echo2_acc, trl_acc) in enumerate([(0.9, 0.5), (0.6, 0.8), (0.7, 0.7)]):
        curve = [{"version": 20, "greedy_accuracy": echo2_acc, "time_s": 100.0}]
        common = {"lr": 1e-5, "seed": seed, "steps": 20, "reward": [0.5] * 20, "pass_at_k": 0.0}
        rows.append(common | {"name": f"e{seed}", "side": "echo2 S=2 bf16", "wall_s": 100.0, "eval_curve": curve})
        rows[-1] |= {"greedy_accuracy": echo2_acc, "time_s": [5.0 * i for i in range(20)]}
        rows.append(common | {"name": f"trl-lr1e-05-seed{seed}", "side": "trl", "wall_s": 400.0})
        rows[-1] |= {"greedy_accuracy": trl_acc, "step_s": [20.0] * 20}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["bench_vs_trl.py", "--skip-echo2", "--seeds", "0,1,2", "--trl-lrs", "1e-5", "--out", str(tmp_path)]
    paired = {}
    for shown in ("", "0,2"):
        monkeypatch.setattr(sys, "argv", [*argv, "--report-seeds", shown])
        bench.main()  # every run is in OUT: nothing runs, the tables are printed
        lines = capsys.readouterr().out.strip().splitlines()
        paired[shown] = [c.strip() for c in lines[-2].strip("|").split("|")]
    assert paired[""][2].endswith("(n=3)") and paired[""][4] == "2/3"  # every seed in OUT
    assert paired["0,2"][2].startswith("+0.200") and paired["0,2"][2].endswith("(n=2)")  # seeds 0 and 2 alone
    assert paired["0,2"][4] == "2/2"


def test_auc_is_the_chance_a_positive_case_scores_above_a_negative_one():
    assert auc([1, 2, 3, 4], [False, False, True, True]) == 1.0
    assert auc([4, 3, 2, 1], [False, False, True, True]) == 0.0
    assert auc([7, 7, 7, 7], [True, False, True, False]) == 0.5  # a constant says nothing
    assert auc([1, 2, 2, 3], [False, True, False, True]) == 0.875  # (1 + 0.5 + 1 + 1) / 4: the tie counts half
    assert auc([1, 2], [True, True]) is None and auc([1, 2], [False, False]) is None
    rng = np.random.default_rng(3)
    x, pos = rng.integers(0, 6, 40).astype(float), rng.random(40) < 0.3  # ties aplenty
    brute = np.mean([1.0 if p > n else 0.5 if p == n else 0.0 for p in x[pos] for n in x[~pos]])
    assert auc(x, pos) == pytest.approx(brute)
    assert auc(np.exp(x), pos) == pytest.approx(brute)  # ranks only: any increasing transform gives the same


def test_sign_test_is_the_exact_two_sided_binomial_of_the_discordant_pairs():
    assert sign_test(0, 5) == pytest.approx(2 / 32) and sign_test(5, 0) == sign_test(0, 5)
    assert sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0
    from math import comb

    assert sign_test(27, 6) == pytest.approx(2 * sum(comb(33, i) for i in range(7)) / 2**33)
    assert sign_test(27, 6) < 0.001 < sign_test(7, 1) < 0.1


def test_the_tail_script_counts_the_low_runs_and_scores_each_signal(tmp_path, monkeypatch, capsys):
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "staleness_tail.py"
    spec = importlib.util.spec_from_file_location("staleness_tail", path)
    tail = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tail)

    def run(staleness, seed, acc, kl, steps=20):
        health = {
            "train/is_ess": [1.0, None] + [0.9] * (steps - 2),  # a step without stale tokens has no value
            "train/kl_behaviour": [0.0] * (steps - 1) + [kl],
            "train/clipfrac": [0.1] * steps,
            "train/is_truncated_frac": [0.0] * steps,
        }
        return {
            "staleness": staleness,
            "off_policy": "token_tis",
            "adaptive": False,
            "lora_rank": 0,
            "seed": seed,
            "steps": steps,
            "eval_problems": 340,
            "eval_greedy_accuracy": acc,
            "reward": [acc] * steps,
            "health": health,
            "guard": [],
            "steady_s": 100.0 + staleness,
        }

    s0 = [0.7, 0.7, 0.4, 0.7, 0.7]
    s4 = [0.3, 0.4, 0.4, 0.8, 0.6]  # seeds 0 and 1 low at S = 4 alone, seed 2 low in both
    rows = [run(0, seed, acc, 0.0) for seed, acc in enumerate(s0)]
    rows += [run(4, seed, acc, kl) for seed, (acc, kl) in enumerate(zip(s4, [0.5, 0.1, 0.3, 0.2, 0.4], strict=True))]
    rows.append(run(4, 9, 0.1, 0.0))  # no S = 0 run of seed 9: not paired
    rows.append(run(4, 3, 0.8, 0.0) | {"adaptive": True})  # another arm
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sys, "argv", ["staleness_tail.py", "--rows", str(tmp_path / "rows.jsonl")])
    tail.main()
    out = capsys.readouterr().out
    assert "5 seeds (0, 1, 2, 3, 4), S = 4 against S = 0 (20 steps)" in out
    assert "below 0.5: S = 4 3, S = 0 1; only S = 4 2, only S = 0 0, both 1; McNemar exact p = 0.5" in out
    assert "mean -0.140" in out and "over the 2 seeds where both end at or above 0.5: +0.000" in out
    # the highest KL of the low runs (0.5, 0.1, 0.3) against the others (0.2, 0.4): 3 of 6 pairs above
    assert "highest behaviour KL" in out and out.split("highest behaviour KL")[1].split()[0] == "0.500"
    assert out.split("training reward, last 5 steps (negated)")[1].split()[0] == "1.000"

    # the stale runs from another file and of another length, against the same S = 0 runs and their own 20-step ones
    longer = [run(4, seed, acc, 0.0, steps=27) for seed, acc in [(0, 0.6), (1, 0.3), (3, 0.8), (7, 0.2)]]
    (tmp_path / "longer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in longer))
    argv = ["staleness_tail.py", "--rows", str(tmp_path / "rows.jsonl"), "--stale-rows", str(tmp_path / "longer.jsonl")]
    monkeypatch.setattr(sys, "argv", [*argv, "--stale-steps", "27"])
    tail.main()
    out = capsys.readouterr().out
    assert "3 seeds (0, 1, 3), S = 4 (27 steps) against S = 0 (20 steps)" in out  # seed 7 has no S = 0 run
    assert "below 0.5: S = 4 (27 steps) 1, S = 0 0; only S = 4 (27 steps) 1, only S = 0 0, both 0" in out
    assert "below 0.5: S = 4 (27 steps) 1, S = 4 (20 steps) 2; only S = 4 (27 steps) 0, only S = 4 (20 steps) 1" in out
    assert "S = 0 100 s, S = 4 (27 steps) 104 s" in out
    monkeypatch.setattr(sys, "argv", argv)  # no 20-step S = 4 run in the longer file: a one-line stop
    with pytest.raises(SystemExit, match="0 seed\\(s\\) of S = 4 over 20 steps"):
        tail.main()
