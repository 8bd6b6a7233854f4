"""The capacity model against real runs: a learner with 1, 2, 3 ... workers throttled to a known rate.

    .venv/bin/python scripts/validate_plan.py [--workers 1,2,3] [--rate 1.2] [--steps 14] [--out runs/validate]
        [--activation all] [--prices 0.1,0.2,0.3]

Each run is the real system (learner, vLLM workers, torrents on loopback) with every worker throttled to
`--rate` rollouts/s (`echo2 worker --max-rollouts-per-s`), so the pool's throughput is set while T_train and
T_bcast are whatever this machine measures. Afterwards the model is fed the run's own measurements
(`echo2 plan --from-run`) and its predicted bubble ratio is printed beside the measured one, with the
difference in percentage points and whether the pool reached gamma*mu_min_echo2.
With `--activation cost` the learner's closed loop chooses the active set from `--prices`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from echo2cli.demo import free_port
from echo2cli.launch import spawn, wait_for_learner
from echo2cli.plan.io import from_run
from echo2cli.plan.model import PlanInputs, bubble_ratio, mu_min_echo2


def one_run(out: Path, n: int, a: argparse.Namespace) -> dict:
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    learner = spawn(
        [
            "learner",
            "--out",
            str(out),
            "--steps",
            str(a.steps),
            "--prompts-per-step",
            str(a.prompts),
            "-G",
            str(a.group_size),
            "--max-new-tokens",
            "16",
            "-S",
            str(a.staleness),
            "--port",
            str(port),
            "--bt-listen",
            "127.0.0.1:0",
            "--checkpoint-every",
            "0",
            "--activation",
            a.activation,
            "--quiet",
        ],
        out / "learner.log",
    )
    wait_for_learner(learner, out, out / "learner.log")
    prices = [float(p) for p in a.prices.split(",")] if a.prices else [0.0] * n
    workers = [
        spawn(
            [
                "worker",
                "--join",
                f"http://127.0.0.1:{port}",
                "--name",
                f"w{i}",
                "--work-dir",
                str(out / f"w{i}"),
                "--bt-listen",
                "127.0.0.1:0",
                "--prompts-per-lease",
                str(a.lease_prompts),
                "--max-rollouts-per-s",
                str(a.rate),
                "--usd-per-hour",
                str(prices[i % len(prices)]),
            ],
            out / f"w{i}.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))},
        )
        for i in range(n)
    ]
    try:
        learner.wait(timeout=3600)
    finally:
        for p in workers:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    run = from_run(out)
    pool = run["pool"]
    if a.activation == "cost":  # the set that generated at the end: the closed loop's last choice
        decisions = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
        decisions = [d for d in decisions if d.get("kind") != "staleness"]  # the divergence guard's lines
        active = set(decisions[-1]["active"])
        pool = [w for w in pool if w.name in active]
    inp = PlanInputs(
        batch=run["batch"],
        t_train_s=run["t_train_s"],
        t_bcast_s=run["t_bcast_s"],
        staleness=run["staleness"],
        kappa=run["kappa"],
        lease_rollouts=a.lease_prompts * a.group_size,
    )
    mu = sum(w.rollouts_per_s for w in pool)
    need = mu_min_echo2(inp, pool)
    return {
        "workers": n,
        "active": len(pool),
        "mu_pool": mu,
        "mu_min_echo2": need,
        "gamma_reached": mu >= 1.1 * need,
        "t_train_s": run["t_train_s"],
        "t_bcast_s": run["t_bcast_s"],
        "measured_bubble": run["measured_bubble"],
        "predicted_bubble": bubble_ratio(inp, pool),
        "steps": run["steps"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,3", help="worker counts, one run each")
    ap.add_argument("--rate", type=float, default=1.2, help="each worker's throttle, rollouts/s")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lease-prompts", type=int, default=2)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--activation", default="all", choices=["all", "cost"])
    ap.add_argument("--prices", default="", help="worker prices $/h, comma-separated (cycled)")
    ap.add_argument("--out", type=Path, default=Path("runs/validate"))
    a = ap.parse_args()
    rows = []
    for n in [int(x) for x in a.workers.split(",")]:
        out = a.out / f"{a.activation}-n{n}"
        if out.exists():
            import shutil

            shutil.rmtree(out)
        t0 = time.time()
        row = one_run(out, n, a)
        row["wall_s"] = time.time() - t0
        rows.append(row)
        diff_pp = 100 * (row["predicted_bubble"] - row["measured_bubble"])
        print(
            f"N={n} (active {row['active']}): mu_pool {row['mu_pool']:.2f} vs mu_min_echo2 {row['mu_min_echo2']:.2f} "
            f"(gamma reached: {row['gamma_reached']}), T_train {row['t_train_s']:.1f} s, T_bcast "
            f"{row['t_bcast_s']:.1f} s; bubble measured {row['measured_bubble']:.3f} predicted "
            f"{row['predicted_bubble']:.3f} (diff {diff_pp:+.1f} pp)",
            flush=True,
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
