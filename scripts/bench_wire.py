"""fp16 against bf16 versions (`--wire-dtype`, `echo2cli/learner/rounding.py`): the same synchronous runs of
`echo2 bench staleness`, one OUT per dtype, compared seed by seed.

    .venv/bin/python scripts/bench_wire.py --seeds 0-7 [--out runs/bench-wire] [--steps 20] [--report-only] [--json]

For each seed, one run publishing bf16 (the baseline, measured in the same session) and one publishing fp16, the
two back to back so that a slow stretch of the box falls on both. Each run: one learner and one worker, S = 0,
the default lr, evaluated greedily on the whole held-out split after its last step. Reported for each dtype and
seed: held-out accuracy on the split and on the training mix, each level's, the mean delta as a share of a full
version, the behaviour KL at staleness 0 and the wall time; then fp16 - bf16 paired by seed, with bootstrap 95 %
intervals (`echo2cli/bench/paired.py`). Resumable: a run already in its OUT's rows.jsonl is not run again.

fp16 versions need a learner computing in fp32, so both arms run with `ECHO2_CPU_BF16=0`: learner, engine and
evaluation compute in fp32 as on a CPU without bf16, also where this CPU has it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from echo2cli.bench.paired import describe, paired_difference, seed_mean  # noqa: E402

WIRES = ("bf16", "fp16")  # the baseline first


def parse_seeds(spec: str) -> list[int]:
    """'0-7' or '0,2,5' -> the seeds."""
    if "-" in spec:
        first, last = spec.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in spec.split(",")]


def run(out: Path, wire: str, seed: int, steps: int) -> None:
    """One `echo2 bench staleness` run (it skips a run its OUT already has)."""
    cmd = [sys.executable, "-m", "echo2cli", "bench", "staleness", "--staleness", "0", "--seed", str(seed)]
    cmd += ["--seeds", "1", "--steps", str(steps), "--eval-k", "0", "--eval-limit", "500", "--eval-every", "0"]
    cmd += ["--wire-dtype", wire, "--out", str(out / wire)]
    subprocess.run(cmd, check=True, env={**os.environ, "ECHO2_CPU_BF16": "0"})


def run_measures(run_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    """What one run's row, final evaluation and metrics say."""
    evals = sorted((run_dir / "eval").glob("*.json"))
    levels = json.loads(evals[-1].read_text()).get("by_level", {}) if evals else {}
    deltas, kls = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m.get("bcast/version", 0) > 0 and "bcast/delta_ratio" in m:
            deltas.append(m["bcast/delta_ratio"])
        kl = m.get("offpolicy/by_staleness", {}).get("0", {}).get("kl_behaviour")
        if kl is not None:
            kls.append(kl)
    return {
        "split": row["eval_greedy_accuracy"],
        "train_mix": row.get("eval_greedy_accuracy_train_mix"),
        "levels": {name: lv["greedy_accuracy"] for name, lv in levels.items()},
        "delta_ratio": statistics.fmean(deltas) if deltas else None,
        "kl_behaviour": statistics.fmean(kls) if kls else None,
        "wall_s": row["wall_s"],
    }


def collect(out: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """wire -> seed -> measures, for every run finished so far."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for wire in WIRES:
        rows = out / wire / "rows.jsonl"
        lines = rows.read_text().splitlines() if rows.exists() else []
        found[wire] = {}
        for line in lines:
            row = json.loads(line)
            found[wire][row["seed"]] = run_measures(out / wire / row["name"], row)
    return found


def report(found: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """fp16 - bf16 by seed for each accuracy, fp16 / bf16 for the delta and the wall time."""

    def of(wire: str, key: str) -> dict[int, float]:
        return {s: m[key] for s, m in found[wire].items() if m.get(key) is not None}

    def level(wire: str, name: str) -> dict[int, float]:
        return {s: m["levels"][name] for s, m in found[wire].items() if name in m["levels"]}

    names = sorted({n for m in found["bf16"].values() for n in m["levels"]})
    diffs = {key: paired_difference(of("fp16", key), of("bf16", key)) for key in ("split", "train_mix")}
    diffs |= {f"level {n}": paired_difference(level("fp16", n), level("bf16", n)) for n in names}
    ratios = {}
    for key in ("delta_ratio", "wall_s"):
        a, b = of("fp16", key), of("bf16", key)
        ratios[key] = seed_mean({s: a[s] / b[s] for s in sorted(set(a) & set(b)) if b[s]})
    return {"runs": found, "fp16_minus_bf16": diffs, "fp16_over_bf16": ratios}


def print_report(result: dict[str, Any]) -> None:
    for wire, seeds in result["runs"].items():
        for seed, m in sorted(seeds.items()):
            levels = " ".join(f"{n}: {v:.3f}" for n, v in sorted(m["levels"].items()))
            delta = f"{m['delta_ratio']:.4f}" if m["delta_ratio"] is not None else "-"
            kl = f"{m['kl_behaviour']:.5f}" if m["kl_behaviour"] is not None else "-"
            mix = f"{m['train_mix']:.3f}" if m["train_mix"] is not None else "-"
            print(
                f"{wire} seed {seed}: split {m['split']:.3f}  training mix {mix}  ({levels})  "
                f"delta {delta} of a version  KL(behaviour) {kl}  wall {m['wall_s']:.0f} s"
            )
    for key, d in result["fp16_minus_bf16"].items():
        print(f"fp16 - bf16, held-out {key}: {describe(d)}")
    for key, d in result["fp16_over_bf16"].items():
        print(f"fp16 / bf16, {key}: {describe(d).replace('+', '')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-7", help="seeds, '0-7' or '0,2,5' (default: 0-7)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default: 20)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-wire"), help="OUT/bf16 and OUT/fp16 hold the runs")
    ap.add_argument("--report-only", action="store_true", help="report the runs in OUT, run nothing")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    if not args.report_only:
        for seed in parse_seeds(args.seeds):
            for wire in WIRES:
                run(args.out, wire, seed, args.steps)
    result = report(collect(args.out))
    print(json.dumps(result, indent=1)) if args.json else print_report(result)


if __name__ == "__main__":
    main()
