"""Where a stale setting's cost on the held-out split comes from: the runs that end low, and whether anything a
run logs while it trains says which ones will.

    .venv/bin/python scripts/staleness_tail.py [--rows docs/bench_staleness_pairs/rows.jsonl] [--staleness 4]
        [--below 0.5] [--score-mix split]

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
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from echo2cli.bench.paired import auc, censored_median, describe, paired_difference, sign_test
from echo2cli.bench.staleness import replayed_flags, run_score, score_key


def comparable(row: dict[str, Any], staleness: int) -> bool:
    """A run of the pairs series at `staleness`."""
    return (
        row["staleness"] == staleness
        and row["off_policy"] == "token_tis"
        and not row["adaptive"]
        and not row.get("lora_rank", 0)
        and row["steps"] == 20
        and row.get("eval_problems") == 340
    )


def worst(values: list[float | None], pick: Any) -> float:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=Path, default=Path("docs/bench_staleness_pairs/rows.jsonl"))
    ap.add_argument("--staleness", type=int, default=4, help="the stale setting, paired with S = 0 (default 4)")
    ap.add_argument("--below", type=float, default=0.5, help="the bar a run that ends low is under (default 0.5)")
    ap.add_argument("--score-mix", choices=["split", "train"], default="split", help="the score (default split)")
    a = ap.parse_args()
    if a.staleness < 1:
        ap.error(f"--staleness {a.staleness}: give the stale setting (>= 1); it is paired with S = 0")

    rows = [json.loads(line) for line in a.rows.read_text().splitlines() if line.strip()]
    key = score_key(a.score_mix)
    sync = {r["seed"]: r for r in rows if comparable(r, 0)}
    stale = {r["seed"]: r for r in rows if comparable(r, a.staleness) and r["seed"] in sync}
    if len(stale) < 2:
        raise SystemExit(f"{a.rows}: {len(stale)} seed(s) with both S = 0 and S = {a.staleness}; need 2 or more")
    seeds = sorted(stale)
    score = {
        0: {s: run_score(sync[s], 1, key) for s in seeds},
        a.staleness: {s: run_score(stale[s], 1, key) for s in seeds},
    }
    low = {st: {s for s in seeds if v[s] < a.below} for st, v in score.items()}
    only_stale, only_sync = low[a.staleness] - low[0], low[0] - low[a.staleness]
    print(f"{len(seeds)} seeds ({seeds[0]}-{seeds[-1]}), S = {a.staleness} against S = 0, scored on {a.score_mix}")
    print(
        f"below {a.below}: S = {a.staleness} {len(low[a.staleness])}, S = 0 {len(low[0])}; only S = {a.staleness} "
        f"{len(only_stale)}, only S = 0 {len(only_sync)}, both {len(low[0] & low[a.staleness])}; "
        f"McNemar exact p = {sign_test(len(only_stale), len(only_sync)):.2g}"
    )

    everyone = paired_difference(score[a.staleness], score[0])
    above = [s for s in seeds if s not in low[0] | low[a.staleness]]
    kept = paired_difference({s: score[a.staleness][s] for s in above}, {s: score[0][s] for s in above})
    median = censored_median(dict(zip(seeds, everyone["diffs"], strict=True)))
    print(
        f"S = {a.staleness} - S = 0, all seeds: mean {describe(everyone, t=True)}; "
        f"median {median['median']:+.3f} [{median['low']:+.3f}, {median['high']:+.3f}]"
    )
    print(f"  over the {len(above)} seeds where both end at or above {a.below}: {describe(kept, t=True)}")

    print(f"how well each signal picks out the {len(low[a.staleness])} S = {a.staleness} runs that end low (AUC):")
    table = {s: signals(stale[s]) for s in seeds}
    is_low = [s in low[a.staleness] for s in seeds]
    for name in table[seeds[0]]:
        value = auc([table[s][name] for s in seeds], is_low)
        print(f"  {name:40s} {'-' if value is None else f'{value:.3f}'}")


if __name__ == "__main__":
    main()
