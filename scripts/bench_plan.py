"""The capacity model's thresholds against the discrete-event simulator, and cost-aware activation against
random activation on the example pool.

    .venv/bin/python scripts/bench_plan.py [--plot docs/plan_knee.png] [--json]

1. Knee sweep: S in {1, 2, 4, 6} x T_bcast/T_train in {0.1, 0.5, 2}, kappa = 1 and the paper's default
   kappa = S - 1, a pool of 4 identical workers (B = 64 rollouts = 8 prompts x G 8, leases of 4 prompts,
   T_train = 10 s). For each setting: the simulated knee (smallest pool throughput whose bubble ratio is
   within 0.01 of its floor), the paper's mu_min and echo2's, and knee / closed form for both.
2. Example pool (examples/pool-8.toml, B = 512, T_train = 20 s, T_bcast = 8 s, S = 2, leases of 16):
   cost per step of cost-aware activation vs the expected cost of random activation, by the model and by
   simulating each chosen set (all random orders' sets are simulated, 200 orders).
3. Mixed-speed pools: predicted minus simulated bubble ratio over 250 random settings and pools.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

from echo2cli.plan.io import load_pool
from echo2cli.plan.model import (
    InfeasibleError,
    PlanInputs,
    WorkerSpec,
    activate,
    bubble_ratio,
    cost_aware_order,
    mu_min_echo2,
    mu_min_paper,
)
from echo2cli.plan.simulator import SimWorker, simulate, simulated_knee

G, B_PROMPTS, LEASE_PROMPTS, N, T = 8, 8, 4, 4, 10.0
POOL = Path(__file__).parent.parent / "examples" / "pool-8.toml"


def finite_or_inf(fn, *args) -> float:
    try:
        return fn(*args)
    except InfeasibleError:
        return math.inf


def knee_rows() -> list[dict]:
    rows = []
    for S in (1, 2, 4, 6):
        for ratio in (0.1, 0.5, 2.0):
            for kappa in sorted({1, max(1, S - 1)}):
                inp = PlanInputs(
                    batch=B_PROMPTS * G,
                    t_train_s=T,
                    t_bcast_s=ratio * T,
                    staleness=S,
                    kappa=kappa,
                    lease_rollouts=LEASE_PROMPTS * G,
                )
                pool = [WorkerSpec(f"w{i}", 0.0, 1.0) for i in range(N)]
                row = {
                    "S": S,
                    "kappa": kappa,
                    "t_bcast_over_t_train": ratio,
                    "mu_min_paper": finite_or_inf(mu_min_paper, inp),
                    "mu_min_echo2": finite_or_inf(mu_min_echo2, inp, pool),
                }
                knee = simulated_knee(
                    batch_prompts=B_PROMPTS,
                    group_size=G,
                    t_train_s=T,
                    t_bcast_s=ratio * T,
                    staleness=S,
                    kappa=kappa,
                    n_workers=N,
                    lease_prompts=LEASE_PROMPTS,
                )
                fast = [SimWorker(1000 * inp.batch / T / N, LEASE_PROMPTS, ratio * T)] * N
                floor = simulate(
                    batch_prompts=B_PROMPTS, group_size=G, t_train_s=T, staleness=S, kappa=kappa, workers=fast
                ).bubble_ratio
                # where no finite throughput removes the bubble the knee is where the curve flattens
                row.update(
                    knee=knee,
                    floor_bubble=floor,
                    knee_over_echo2=knee / row["mu_min_echo2"] if math.isfinite(row["mu_min_echo2"]) else None,
                    knee_over_paper=knee / row["mu_min_paper"] if math.isfinite(row["mu_min_paper"]) else None,
                )
                rows.append(row)
    return rows


def sim_bubble(inp: PlanInputs, pool: list[WorkerSpec]) -> float:
    workers = [
        SimWorker(w.rollouts_per_s, int(min(w.lease_rollouts or inp.lease_rollouts, inp.batch)), inp.t_bcast_s)
        for w in pool
    ]
    return simulate(
        batch_prompts=int(inp.batch),
        group_size=1,
        t_train_s=inp.t_train_s,
        staleness=inp.staleness,
        kappa=inp.kappa,
        workers=workers,
        steps=60,
        warmup_steps=10,
    ).bubble_ratio


def pool_rows(orders: int = 200) -> dict:
    pool, learner = load_pool(POOL)
    inp = PlanInputs(
        batch=512,
        t_train_s=20.0,
        t_bcast_s=8.0,
        staleness=2,
        lease_rollouts=16,
        learner_usd_per_hour=learner.get("usd_per_hour", 0.0),
    )

    def cost(active: list[WorkerSpec], bubble: float) -> float:
        step = inp.t_train_s / (1 - bubble)
        return (inp.learner_usd_per_hour + sum(w.usd_per_hour for w in active)) * step / 3600

    ours = activate(inp, pool, cost_aware_order(pool), "echo2")
    rng = random.Random(0)
    randoms = [activate(inp, pool, rng.sample(pool, len(pool)), "echo2") for _ in range(orders)]
    out = {}
    for label, sets in (("cost_aware", [ours]), ("random", randoms)):
        model_b = [bubble_ratio(inp, s) for s in sets]
        sim_b = [sim_bubble(inp, s) for s in sets]
        out[label] = {
            "active_workers_mean": statistics.mean(len(s) for s in sets),
            "bubble_model_mean": statistics.mean(model_b),
            "bubble_sim_mean": statistics.mean(sim_b),
            "usd_per_step_model": statistics.mean(cost(s, b) for s, b in zip(sets, model_b, strict=True)),
            "usd_per_step_sim": statistics.mean(cost(s, b) for s, b in zip(sets, sim_b, strict=True)),
        }
    for key in ("model", "sim"):
        out[f"cost_aware_over_random_{key}"] = (
            out["cost_aware"][f"usd_per_step_{key}"] / out["random"][f"usd_per_step_{key}"]
        )
    return out


def mixed_pool_errors(trials: int = 250, seed: int = 2) -> dict:
    """Predicted minus simulated bubble over random mixed-speed pools (speeds 0.3-1.7x of a base)."""
    rng = random.Random(seed)
    errors = []
    for _ in range(trials):
        B = rng.choice([4, 8, 16])
        S = rng.choice([0, 1, 2, 4, 6])
        kappa = rng.choice(sorted({1, max(1, S - 1)}))
        tb = T * rng.choice([0.1, 0.5, 1.0, 2.0])
        n, k = rng.choice([2, 3, 5, 8]), rng.choice([1, 2, 4, 8])
        base = B * G / T * rng.choice([0.3, 0.6, 0.9, 1.1, 1.5, 3])
        speeds = [base / n * rng.uniform(0.3, 1.7) for _ in range(n)]
        sim = simulate(
            batch_prompts=B,
            group_size=G,
            t_train_s=T,
            staleness=S,
            kappa=kappa,
            workers=[SimWorker(m, k, tb) for m in speeds],
            steps=150,
            warmup_steps=20,
        ).bubble_ratio
        inp = PlanInputs(batch=B * G, t_train_s=T, t_bcast_s=tb, staleness=S, kappa=kappa, lease_rollouts=k * G)
        errors.append(bubble_ratio(inp, [WorkerSpec(str(i), 1.0, m) for i, m in enumerate(speeds)]) - sim)
    return {
        "trials": trials,
        "mean_abs": statistics.mean(abs(e) for e in errors),
        "max_over": max(errors),
        "max_under": -min(errors),
        "within_0.1": sum(abs(e) <= 0.1 for e in errors) / trials,
    }


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, (S, ratio) in zip(axes, [(1, 0.5), (2, 0.5), (4, 2.0)], strict=True):
        inp = PlanInputs(
            batch=B_PROMPTS * G, t_train_s=T, t_bcast_s=ratio * T, staleness=S, lease_rollouts=LEASE_PROMPTS * G
        )
        unit = [WorkerSpec(f"w{i}", 0.0, 1.0) for i in range(N)]
        echo2 = mu_min_echo2(inp, unit)
        xs = [echo2 * 2.5 * i / 50 for i in range(1, 51)]
        sims = [
            simulate(
                batch_prompts=B_PROMPTS,
                group_size=G,
                t_train_s=T,
                staleness=S,
                kappa=1,
                workers=[SimWorker(x / N, LEASE_PROMPTS, ratio * T)] * N,
            ).bubble_ratio
            for x in xs
        ]
        model = [bubble_ratio(inp, [WorkerSpec(f"w{i}", 0.0, x / N) for i in range(N)]) for x in xs]
        ax.plot(xs, model, color="tab:blue", label="closed form (echo2)")
        ax.plot(xs, sims, "o", ms=3, color="tab:orange", label="simulation")
        ax.axvline(echo2, ls="--", color="tab:blue", label=f"mu_min_echo2 {echo2:.1f}")
        try:
            paper = mu_min_paper(inp)
            ax.axvline(paper, ls=":", color="gray", label=f"mu_min paper {paper:.1f}")
        except InfeasibleError:
            ax.plot([], [], ls=":", color="gray", label="paper: infeasible")
        ax.set_title(f"S={S}, T_bcast/T_train={ratio}", fontsize=9)
        ax.set_xlabel("mu_pool (rollouts/s)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("learner bubble ratio")
    fig.suptitle(f"B={B_PROMPTS * G} rollouts, T_train={T:g} s, {N} workers, leases of {LEASE_PROMPTS * G}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", type=Path, help="PNG of simulated bubble vs mu_pool with both mu_min lines")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = knee_rows()
    print(
        f"{'S':>2} {'kappa':>5} {'Tb/T':>5} {'knee':>8} {'echo2':>8} {'paper':>8} {'knee/echo2':>10} "
        f"{'knee/paper':>10} {'floor':>6}"
    )
    fmt = lambda x: "   inf" if x is None or not math.isfinite(x) else f"{x:8.2f}"  # noqa: E731
    for r in rows:
        print(
            f"{r['S']:>2} {r['kappa']:>5} {r['t_bcast_over_t_train']:>5} {r['knee']:8.2f} {fmt(r['mu_min_echo2'])} "
            f"{fmt(r['mu_min_paper'])} {fmt(r['knee_over_echo2']):>10} {fmt(r['knee_over_paper']):>10} "
            f"{r['floor_bubble']:6.3f}"
        )
    finite = [r for r in rows if r["knee_over_echo2"] is not None]
    worst = max(abs(r["knee_over_echo2"] - 1) for r in finite)
    paper = [r for r in rows if r["knee_over_paper"] is not None and r["knee_over_echo2"] is not None]
    worst_paper = max(abs(r["knee_over_paper"] - 1) for r in paper)
    print(
        f"worst |knee/mu_min_echo2 - 1| = {worst:.3f} over {len(finite)} feasible settings; "
        f"paper's rule: {worst_paper:.3f} over the {len(paper)} where both are finite"
    )
    pool = pool_rows()
    print(
        f"example pool: cost-aware / random cost per step = {pool['cost_aware_over_random_model']:.3f} (model), "
        f"{pool['cost_aware_over_random_sim']:.3f} (simulated); bubbles model "
        f"{pool['cost_aware']['bubble_model_mean']:.3f} vs {pool['random']['bubble_model_mean']:.3f}, simulated "
        f"{pool['cost_aware']['bubble_sim_mean']:.3f} vs {pool['random']['bubble_sim_mean']:.3f}"
    )
    mixed = mixed_pool_errors()
    print(
        f"mixed-speed pools ({mixed['trials']}): predicted - simulated bubble: mean |error| "
        f"{mixed['mean_abs']:.3f}, over by up to {mixed['max_over']:.3f}, under by up to {mixed['max_under']:.3f}, "
        f"{100 * mixed['within_0.1']:.0f} % within 0.1"
    )
    if a.plot:
        plot(a.plot)
    if a.json:
        print(json.dumps({"knees": rows, "pool": pool, "mixed": mixed}, default=lambda x: None))


if __name__ == "__main__":
    main()
