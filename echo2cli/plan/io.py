"""The I/O side of `echo2 plan`: pool files, finished runs and the bubble-vs-throughput plot.

A pool file is TOML (example: examples/pool-8.toml):

    [learner]                     # optional
    usd_per_hour = 9.8            # the learner box; counted in every cost per step
    rollouts_per_s = 40.0         # its own GPUs generating, for the centralized baseline

    [[workers]]
    name = "a10g-spot"            # unique
    usd_per_hour = 0.45           # p_i
    rollouts_per_s = 5.0          # mu_i, measured (`echo2 plan --from-run`) or declared
    count = 2                     # optional: this many identical workers, named a10g-spot-1, -2
    lease_rollouts = 32           # optional: q_i, prompts per lease x G
    up_mbps = 500                 # optional, informational
    down_mbps = 1000

A finished run directory gives B, S, kappa (config.json), T_train = median learner busy time per step and
T_bcast = median per-version T_ready (publish -> every worker holds it, plus the swap work; without the
wait for a lease in progress, which the model counts itself), each worker's measured mu_i,
lease size and declared price (summary.json), and the measured bubble ratio to compare with the model's.
"""

from __future__ import annotations

import json
import statistics
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from echo2cli.config import PlanConfig
from echo2cli.errors import ConfigError
from echo2cli.metrics import read_metrics
from echo2cli.plan.model import InfeasibleError as _Infeasible
from echo2cli.plan.model import (
    PlanInputs,
    PlanResult,
    WorkerSpec,
    bubble_ratio,
    min_staleness,
    mu_min_echo2,
    mu_min_paper,
    plan,
)
from echo2cli.plan.swarm import parse_fleet, spread

WORKER_KEYS = {"name", "usd_per_hour", "rollouts_per_s", "count", "lease_rollouts", "up_mbps", "down_mbps"}
LEARNER_KEYS = {"usd_per_hour", "rollouts_per_s"}


@dataclass
class Planned:
    """`echo2 plan`'s answer: the inputs, the pool, the plan, and the plan as JSON (with a run's measured bubble)."""

    inputs: PlanInputs
    pool: list[WorkerSpec]
    result: PlanResult
    report: dict[str, Any]


def plan_from(cfg: PlanConfig) -> Planned:
    """Numbers from a finished run (`from_run`), a pool (`workers` or `mu`), and the flags over both."""
    base: dict[str, Any] = from_run(cfg.from_run) if cfg.from_run else {}
    pool: list[WorkerSpec] = base.pop("pool", [])
    measured = {k: base.pop(k) for k in ("measured_bubble", "steps") if k in base}
    t_publish = base.pop("t_publish_s", None)
    learner: dict[str, float] = {}
    if cfg.workers is not None:
        pool, learner = load_pool(cfg.workers)
    if cfg.mu is not None:
        pool = parse_mu(cfg.mu)
    given = {
        "batch": cfg.batch,
        "group_size": cfg.group_size,
        "t_train_s": cfg.t_train_s,
        "t_bcast_s": cfg.t_bcast_s,
        "staleness": cfg.staleness,
        "kappa": cfg.kappa,
        "gamma": cfg.gamma,
        "learner_usd_per_hour": learner.get("usd_per_hour")
        if cfg.learner_usd_per_hour is None
        else cfg.learner_usd_per_hour,
        "learner_rollouts_per_s": learner.get("rollouts_per_s")
        if cfg.learner_rollouts_per_s is None
        else cfg.learner_rollouts_per_s,
    }
    fleet = predict_fleet(cfg) if cfg.fleet is not None else None
    if fleet is not None:
        base["t_bcast_s"] = fleet["t_bcast_s"]
    base.update({k: v for k, v in given.items() if v is not None})
    needed = (
        ("--batch", "batch"),
        ("--t-train", "t_train_s"),
        ("--t-bcast", "t_bcast_s"),
        ("--staleness", "staleness"),
    )
    if missing := [flag for flag, key in needed if key not in base]:
        raise ConfigError(f"missing {', '.join(missing)} (or give --from-run RUN_DIR)")
    inputs = PlanInputs(lease_rollouts=cfg.lease_rollouts, **base)
    result = plan(inputs, pool, rule=cfg.rule, seed=cfg.seed)
    report = result.to_dict()
    if t_publish is not None and t_publish > inputs.kappa * inputs.t_train_s:
        report["notes"].append(
            f"publishing a version (weights copied to announced) takes {t_publish:.1f} s, more than the "
            f"{inputs.kappa * inputs.t_train_s:.1f} s between versions (kappa*T_train): the learner waits on its "
            "publisher (learner/t_publish_wait_s) and every version reaches workers later"
        )
    if fleet is not None:
        fleet["min_staleness"] = min_staleness(fleet["t_bcast_s"], inputs.t_train_s, inputs.kappa)
        report["fleet"] = fleet
    if measured and pool:
        predicted = bubble_ratio(inputs, pool)
        report["run"] = {**measured, "predicted_bubble": predicted, "workers": [w.name for w in pool]}
    return Planned(inputs, pool, result, report)


def predict_fleet(cfg: PlanConfig) -> dict[str, Any]:
    """T_bcast of a full version and of a delta over `cfg.fleet` (the swarm model), to 50 %, 95 % and all of the
    fleet. The plan's T_bcast is the delta's 95 % time: versions after the first are fetched as deltas, and a worker
    still fetching generates meanwhile with the version before, which S admits."""
    assert cfg.fleet is not None
    if cfg.version_mb is None:
        raise ConfigError("--fleet needs --version-mb: a full version's size in MB (bf16 weights: 2 bytes a parameter)")
    try:
        workers = parse_fleet(Path(cfg.fleet).read_text(), str(cfg.fleet))
    except OSError as exc:
        raise ConfigError(f"cannot read --fleet {cfg.fleet}: {exc.strerror}") from None
    learner_up = cfg.learner_up_mbps * 1e6 / 8
    full = spread(cfg.version_mb * 1e6, learner_up, workers)
    delta = spread(cfg.version_mb * 1e6 * cfg.delta_ratio, learner_up, workers)
    return {
        "workers": len(workers),
        "behind_nat": sum(w.behind == "nat" for w in workers),
        "firewalled": sum(w.behind == "firewall" for w in workers),
        "learner_up_mbps": cfg.learner_up_mbps,
        "full": asdict(full) | {"ratio": full.ratio, "size_mb": cfg.version_mb},
        "delta": asdict(delta) | {"ratio": delta.ratio, "size_mb": cfg.version_mb * cfg.delta_ratio},
        "t_bcast_s": delta.t95_s,
    }


def parse_mu(text: str) -> list[WorkerSpec]:
    """`--mu 4,4,2.5`: free workers of these rollouts/s."""
    try:
        return [WorkerSpec(f"w{i}", 0.0, float(x)) for i, x in enumerate(text.split(","))]
    except ValueError:
        raise ConfigError(f"--mu takes comma-separated rollouts/s, e.g. 4,4,2.5 (got {text!r})") from None


def load_pool(path: Path) -> tuple[list[WorkerSpec], dict[str, float]]:
    """Workers and the optional [learner] table of a pool file."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read pool file {path}: {exc}") from exc
    if unknown := set(doc) - {"learner", "workers"}:
        raise ConfigError(f"{path}: unknown table(s) {sorted(unknown)}; expected [learner] and [[workers]]")
    learner = doc.get("learner", {})
    if unknown := set(learner) - LEARNER_KEYS:
        raise ConfigError(f"{path}: [learner] has unknown key(s) {sorted(unknown)}")
    pool: list[WorkerSpec] = []
    for i, w in enumerate(doc.get("workers", [])):
        if unknown := set(w) - WORKER_KEYS:
            raise ConfigError(f"{path}: workers[{i}] has unknown key(s) {sorted(unknown)}")
        if missing := {"name", "usd_per_hour", "rollouts_per_s"} - set(w):
            raise ConfigError(f"{path}: workers[{i}] needs {sorted(missing)}")
        count = int(w.get("count", 1))
        fields = {k: w[k] for k in ("lease_rollouts", "up_mbps", "down_mbps") if k in w}
        for j in range(count):
            name = w["name"] if count == 1 else f"{w['name']}-{j + 1}"
            pool.append(WorkerSpec(name, float(w["usd_per_hour"]), float(w["rollouts_per_s"]), **fields))
    if not pool:
        raise ConfigError(f"{path}: no [[workers]] entries")
    return pool, {k: float(v) for k, v in learner.items()}


def from_run(run_dir: Path) -> dict[str, Any]:
    """Measured inputs of a finished (or running) learner run."""
    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{run_dir} is not a learner run directory (config.json: {exc})") from exc
    rows = read_metrics(run_dir / "metrics.jsonl")
    if len(rows) < 2:
        raise ConfigError(f"{run_dir}: need at least 2 steps in metrics.jsonl to measure T_train")
    busy = [r.get("learner/t_busy_s", r["learner/t_train_s"] + r.get("learner/t_publish_s", 0.0)) for r in rows]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    # v0's T_bcast includes the workers' engine start: steady state begins at v1
    # T_ready (publish -> downloaded + swap work) is the model's T_bcast; older runs only have bcast/t_s
    per_version = (
        summary.get("bcast_ready_s")
        or summary.get("bcast_s")
        or {
            r["bcast/version"]: r.get("bcast/t_ready_s", r["bcast/t_s"]) for r in rows if r.get("bcast/t_s") is not None
        }
    )
    bcast = [t for v, t in per_version.items() if int(v) > 0]
    if not bcast:
        raise ConfigError(f"{run_dir}: no version's T_bcast was measured")
    pool, seen = [], set()
    for w in summary.get("workers", []):
        if w.get("rollouts_per_s"):
            name = w["name"] if w["name"] not in seen else f"{w['name']}-{w['worker_id'][:4]}"
            seen.add(name)
            pool.append(WorkerSpec(name, w["usd_per_hour"], w["rollouts_per_s"], w.get("lease_rollouts")))
    announce = [r["bcast/t_announce_s"] for r in rows[1:] if r.get("bcast/t_announce_s") is not None]
    return {
        "t_publish_s": statistics.median(announce) if announce else None,
        "batch": config["prompts_per_step"] * config["group_size"],
        "group_size": config["group_size"],
        "t_train_s": statistics.median(busy[1:]),  # step 0 waits for the engines and warms up the trainer
        "t_bcast_s": statistics.median(bcast),
        "staleness": config["staleness"],
        "kappa": config["kappa"],
        "gamma": config.get("gamma", 1.1),
        "learner_usd_per_hour": config.get("learner_usd_per_hour", 0.0),
        "pool": pool,
        "measured_bubble": rows[-1]["learner/bubble_ratio"],
        "steps": len(rows),
    }


def bubble_curves(inp: PlanInputs, pool: list[WorkerSpec]) -> tuple[list[float], list[float], list[float]]:
    """(pool throughput, predicted bubble, simulated bubble) as the whole pool is sped up or slowed down, up to
    three times mu_min_echo2."""
    from echo2cli.plan.simulator import SimWorker, simulate

    mu0 = sum(w.rollouts_per_s for w in pool)
    try:
        top = 3 * max(mu_min_echo2(inp, pool), mu0 / 3)
    except _Infeasible:
        top = 3 * mu0
    xs, predicted, simulated = [], [], []
    for scale in [top / mu0 * (i / 60) for i in range(1, 61)]:
        scaled = [WorkerSpec(w.name, w.usd_per_hour, w.rollouts_per_s * scale, w.lease_rollouts) for w in pool]
        xs.append(mu0 * scale)
        predicted.append(bubble_ratio(inp, scaled))
        lease = [max(1, round(min(w.lease_rollouts or inp.lease_rollouts, inp.batch))) for w in scaled]
        sim_pool = [SimWorker(w.rollouts_per_s, q, inp.t_bcast_s) for w, q in zip(scaled, lease, strict=True)]
        sim = simulate(
            batch_prompts=max(1, round(inp.batch)),
            group_size=1,
            t_train_s=inp.t_train_s,
            staleness=inp.staleness,
            kappa=inp.kappa,
            workers=sim_pool,
        )
        simulated.append(sim.bubble_ratio)
    return xs, predicted, simulated


def plot(inp: PlanInputs, pool: list[WorkerSpec], result: PlanResult, path: Path) -> None:
    """Predicted and simulated bubble ratio against pool throughput (`bubble_curves`), with mu_min lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result.recommended is None:
        raise ConfigError("--plot needs a pool (--workers, --mu or --from-run): it varies the pool's throughput")
    xs, predicted, simulated = bubble_curves(inp, pool)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, predicted, label="closed form (echo2)", color="tab:blue")
    ax.plot(xs, simulated, "o", ms=3, label="discrete-event simulation", color="tab:orange")
    try:
        ax.axvline(mu_min_paper(inp), ls=":", color="gray", label=f"mu_min, paper's rule ({mu_min_paper(inp):.2f})")
    except _Infeasible:
        pass
    try:
        m = mu_min_echo2(inp, pool)
        ax.axvline(m, ls="--", color="tab:blue", label=f"mu_min_echo2 ({m:.2f})")
    except _Infeasible:
        pass
    chosen = result.recommended.mu_pool
    ax.axvline(chosen, color="tab:green", label=f"recommended set ({chosen:.2f})")
    ax.set_xlabel("pool throughput mu_pool (rollouts/s), pool shape fixed")
    ax.set_ylabel("learner bubble ratio")
    ax.set_title(
        f"B={inp.batch:g}, T_train={inp.t_train_s:g} s, T_bcast={inp.t_bcast_s:g} s, S={inp.staleness}, "
        f"kappa={inp.kappa}",
        fontsize=9,
    )
    ax.set_ylim(-0.02, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
