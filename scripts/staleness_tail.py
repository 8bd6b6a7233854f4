"""Where a stale setting's cost on the held-out split comes from: the runs that end low, and whether anything a
run logs while it trains says which ones will.

    .venv/bin/python scripts/staleness_tail.py [--rows docs/bench_staleness_pairs/rows.jsonl] [--staleness 4]
        [--below 0.5] [--score-mix split] [--stale-rows ROWS --stale-steps N]

Each run at `--staleness` is paired with S = 0's of the same seed (both `token_tis`, without
--adaptive-staleness, full fine-tuning, 20 steps, scored on the 340-problem split), as `echo2 bench staleness`
pairs them. Printed:
- how many runs of each setting end below `--below`, the seeds where only one of the two does, and McNemar's
  exact p on those (`paired.sign_test`): does the stale setting end low more often than S = 0 on the same seed?
- the paired difference over all seeds, its median (bootstrap interval), and its mean over the seeds where both
  runs end at or above the bar: how much of the mean cost the low runs carry;
- for each health signal the divergence guard watches, at the run's worst step (lowest importance-weight ESS,
  highest behaviour KL, clip fraction and truncated fraction), for the steps the guard flags at its defaults
  and for the mean training reward of the last five steps: its AUC for the stale runs that end low (`paired.auc`:
  the chance that a low run's signal looks worse than a run's that ends at or above the bar; 0.5 says nothing).

With `--stale-rows` and `--stale-steps`, the stale runs come from another rows file and ran another number of steps
(e.g. as many as fit in S = 0's 20 steps' wall time), still paired with the 20-step S = 0 runs of `--rows`; the same
stale setting's 20-step runs of the same seeds, where `--rows` has them, are compared with them too (which runs that
ended low at 20 steps end at or above the bar later), and each side's wall time of steps 2 to the last is given.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from echo2cli.bench.paired import auc, censored_median, describe, paired_difference, sign_test
from echo2cli.bench.staleness import replayed_flags, run_score, score_key
from echo2cli.metrics import read_metrics


def comparable(row: dict[str, Any], staleness: int, steps: int = 20) -> bool:
    """A run of the pairs series at `staleness` and `steps`."""
    return (
        row["staleness"] == staleness
        and row["off_policy"] == "token_tis"
        and not row["adaptive"]
        and not row.get("lora_rank", 0)
        and row["steps"] == steps
        and row.get("eval_problems") == 340
    )


def worst(values: list[float | None], pick: Callable[[list[float]], float]) -> float:
    """The worst step of one health series (`pick`: min or max), steps without a value (no stale tokens) left out."""
    present = [v for v in values if v is not None]
    return float(pick(present)) if present else 0.0


def signals(row: dict[str, Any]) -> dict[str, float]:
    """What a run logs while it trains, each signed so that higher looks worse."""
    health = row["health"]
    return {
        "lowest ESS (negated)": -worst(health["train/is_ess"], min),
        "highest behaviour KL": worst(health["train/kl_behaviour"], max),
        "highest clip fraction": worst(health["train/clipfrac"], max),
        "highest truncated fraction": worst(health["train/is_truncated_frac"], max),
        "steps the guard flags": float(len(replayed_flags(row))),
        "training reward, last 5 steps (negated)": -statistics.mean(row["reward"][-5:]),
    }


def compare(runs: dict[str, dict[int, dict[str, Any]]], below: float, key: str) -> set[int]:
    """Two settings' runs on the seeds both have (label -> seed -> row; the first label is the one compared, the
    second its baseline): how many end below `below` on each side and on one side only, McNemar's exact p, and the
    paired difference (mean, median, and mean over the seeds where neither ends low). Returns the seeds where the
    first setting's run ends low."""
    (name, mine), (base_name, base) = runs.items()
    seeds = sorted(set(mine) & set(base))
    score = {label: {s: run_score(by_seed[s], 1, key) for s in seeds} for label, by_seed in runs.items()}
    low = {label: {s for s in seeds if v[s] < below} for label, v in score.items()}
    print(
        f"below {below}: {name} {len(low[name])}, {base_name} {len(low[base_name])}; only {name} "
        f"{len(low[name] - low[base_name])}, only {base_name} {len(low[base_name] - low[name])}, both "
        f"{len(low[name] & low[base_name])}; McNemar exact p = "
        f"{sign_test(len(low[name] - low[base_name]), len(low[base_name] - low[name])):.2g}"
    )
    everyone = paired_difference(score[name], score[base_name])
    above = [s for s in seeds if s not in low[name] | low[base_name]]
    kept = paired_difference({s: score[name][s] for s in above}, {s: score[base_name][s] for s in above})
    median = censored_median(dict(zip(seeds, everyone["diffs"], strict=True)))
    print(
        f"{name} - {base_name}, all seeds: mean {describe(everyone, t=True)}; "
        f"median {median['median']:+.3f} [{median['low']:+.3f}, {median['high']:+.3f}]"
    )
    print(f"  over the {len(above)} seeds where both end at or above {below}: {describe(kept, t=True)}")
    return low[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=Path, default=Path("docs/bench_staleness_pairs/rows.jsonl"))
    ap.add_argument("--staleness", type=int, default=4, help="the stale setting, paired with S = 0 (default 4)")
    ap.add_argument("--below", type=float, default=0.5, help="the bar a run that ends low is under (default 0.5)")
    ap.add_argument("--score-mix", choices=["split", "train"], default="split", help="the score (default split)")
    ap.add_argument("--stale-rows", type=Path, help="the stale runs' rows file (default: --rows)")
    ap.add_argument("--stale-steps", type=int, default=20, help="the steps the stale runs trained (default 20)")
    a = ap.parse_args()
    if a.staleness < 1:
        ap.error(f"--staleness {a.staleness}: give the stale setting (>= 1); it is paired with S = 0")

    rows = read_metrics(a.rows)
    key = score_key(a.score_mix)
    sync = {r["seed"]: r for r in rows if comparable(r, 0)}
    stale_rows = rows if a.stale_rows is None else read_metrics(a.stale_rows)
    stale = {r["seed"]: r for r in stale_rows if comparable(r, a.staleness, a.stale_steps) and r["seed"] in sync}
    if len(stale) < 2:
        raise SystemExit(
            f"{a.stale_rows or a.rows}: {len(stale)} seed(s) of S = {a.staleness} over {a.stale_steps} steps with an "
            f"S = 0 run in {a.rows}; need 2 or more"
        )
    seeds = sorted(stale)
    label = f"S = {a.staleness}" + ("" if a.stale_steps == 20 else f" ({a.stale_steps} steps)")
    shown = ", ".join(map(str, seeds)) if len(seeds) <= 50 else f"{seeds[0]}-{seeds[-1]}"
    print(f"{len(seeds)} seeds ({shown}), {label} against S = 0 (20 steps), scored on {a.score_mix}")
    low = compare({label: stale, "S = 0": sync}, a.below, key)

    if a.stale_steps != 20:
        twenty = {r["seed"]: r for r in rows if comparable(r, a.staleness) and r["seed"] in stale}
        if twenty:
            print(f"\n{label} against S = {a.staleness}'s 20-step runs of {len(twenty)} of these seeds:")
            compare({label: stale, f"S = {a.staleness} (20 steps)": twenty}, a.below, key)
        walls = {"S = 0": [sync[s]["steady_s"] for s in seeds], label: [stale[s]["steady_s"] for s in seeds]}
        print(
            "wall time of steps 2 to the last, mean over these seeds (walls from the sessions that ran them): "
            + ", ".join(f"{k} {statistics.mean(v):.0f} s" for k, v in walls.items())
        )

    print(f"\nhow well each signal picks out the {len(low)} {label} runs that end low (AUC):")
    table = {s: signals(stale[s]) for s in seeds}
    is_low = [s in low for s in seeds]
    for name in table[seeds[0]]:
        value = auc([table[s][name] for s in seeds], is_low)
        print(f"  {name:40s} {'-' if value is None else f'{value:.3f}'}")


if __name__ == "__main__":
    main()
