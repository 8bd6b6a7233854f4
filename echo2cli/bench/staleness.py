"""`echo2 bench staleness`: what the staleness bound S costs in quality and buys in time, measured on real runs.

One run per setting (S, off-policy correction, adaptive or not) and seed: a learner and W workers as
processes, exactly as `echo2 demo` starts them, then `echo2 eval --run` on the held-out split. S = 0 is the
synchronous baseline: the fleet generates one batch per version and the learner waits for it.

Cores are split as hosts would be: the learner's training loop has core 0 to itself with one torch thread (a
learner's GPU), and the workers the other cores (one engine per core, round robin). The learner's host work
(writing, hashing and delta-encoding versions, seeding, the API) is not pinned: it runs where a core is idle,
as it runs on the host's CPUs beside a GPU. `--pin-learner process` puts the whole learner on core 0 instead
(a learner host of one core, where publishing takes its cycles from training). Every part the demo lets
fight over both cores then has its own, so the wall-clock difference between S = 0 and S > 0 is the overlap
ECHO-2 is about (training one version while the fleet generates with older ones and the learner publishes
the last) and not a change in how the box is shared.

Each row (JSON) holds the reward against step and against wall time, the final held-out greedy accuracy (and,
for a task with levels, its training-mix weighting) and pass@k, and the off-policy health of every step:
behaviour KL, importance-weight ESS, clip and truncation fractions, overall and by staleness bucket, and the
divergence guard's decisions.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from echo2cli.bench.paired import paired_difference, seed_mean, seeds_needed, time_to
from echo2cli.config import BenchStalenessConfig
from echo2cli.errors import ConfigError, Echo2Error
from echo2cli.launch import flags, spawn, stop, wait_for_learner
from echo2cli.metrics import read_metrics
from echo2cli.models import prepare_default_model

TRAIN_MIX = "greedy_accuracy_train_mix"  # held-out accuracy with the levels weighted as training draws them
HEALTH = ("train/kl_behaviour", "train/is_ess", "train/clipfrac", "train/is_truncated_frac", "train/masked_frac")


def settings(cfg: BenchStalenessConfig) -> list[dict[str, Any]]:
    """Every (S, correction, LoRA rank, seed) the config asks for, in run order (seeds innermost). S = 0 runs
    under the first correction only: at lag 0 every correction is the same update (`sync_arm`)."""
    from echo2cli.learner.divergence import default_ess_min
    from echo2cli.learner.grpo import OFF_POLICY_MODES

    try:
        bounds = [int(s) for s in cfg.staleness.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--staleness takes comma-separated integers, got {cfg.staleness!r}") from exc
    modes = [m.strip() for m in cfg.off_policy.split(",")]
    if bad := [m for m in modes if m not in OFF_POLICY_MODES]:
        raise ConfigError(f"unknown --off-policy {bad[0]!r}: choose from {', '.join(OFF_POLICY_MODES)}")
    if any(s < 0 for s in bounds):
        raise ConfigError("--staleness values must be >= 0")
    try:
        ranks = [int(r) for r in cfg.lora_rank.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--lora-rank takes comma-separated integers, got {cfg.lora_rank!r}") from exc
    if any(not 0 <= r <= 512 for r in ranks):
        raise ConfigError("--lora-rank values must be 0 (the full model) to 512")

    if cfg.minibatches > cfg.prompts_per_step:
        raise ConfigError(f"--minibatches {cfg.minibatches}: at most one per prompt (--prompts-per-step)")
    if cfg.lr_warmup_steps >= cfg.steps:
        raise ConfigError(f"--lr-warmup-steps {cfg.lr_warmup_steps} must be less than --steps {cfg.steps}")
    versions = curve_versions(cfg)
    scored = len(versions) + (not versions or versions[-1] != cfg.steps)  # and the final checkpoint, if apart
    if cfg.score_versions > scored:
        raise ConfigError(
            f"--score-versions {cfg.score_versions} needs as many evaluated versions per run; --steps {cfg.steps} "
            f"--eval-every {cfg.eval_every} --eval-from {cfg.eval_from} evaluate {scored}"
        )

    def ess_min(mode: str) -> float:
        return default_ess_min(mode) if cfg.guard_ess_min is None else cfg.guard_ess_min

    return [
        {
            "staleness": s,
            "off_policy": m,
            "adaptive": cfg.adaptive_staleness,
            "lora_rank": r,
            "seed": seed,
            "guard_ess_min": ess_min(m),
            "minibatches": cfg.minibatches,
            "lr_schedule": schedule_spec(cfg.lr_schedule, cfg.lr_warmup_steps, cfg.lr_min_ratio),
        }
        for s in bounds
        for m in (modes[:1] if s == 0 else modes)
        for r in ranks
        for seed in range(cfg.seed, cfg.seed + cfg.seeds)
    ]


def schedule_spec(name: str, warmup_steps: int, min_ratio: float) -> str:
    """The learning rate schedule in a word: 'constant', else e.g. 'cosine-w2-m0.1' (warmup steps, floor ratio)."""
    warmup = f"-w{warmup_steps}" if warmup_steps else ""
    floor = f"-m{min_ratio:g}" if name != "constant" and min_ratio else ""
    return f"{name}{warmup}{floor}"


def run_name(setting: dict[str, Any]) -> str:
    adaptive = "-adaptive" if setting["adaptive"] else ""
    lora = f"-lora{setting['lora_rank']}" if setting.get("lora_rank") else ""
    minibatches = f"-mb{setting['minibatches']}" if setting.get("minibatches", 1) > 1 else ""
    schedule = setting.get("lr_schedule", "constant")
    lr = "" if schedule == "constant" else f"-{schedule}"
    return f"S{setting['staleness']}-{setting['off_policy']}{adaptive}{lora}{minibatches}{lr}-seed{setting['seed']}"


CORES = os.cpu_count() or 1


def _pin(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if CORES > 1 else []


def train(cfg: BenchStalenessConfig, setting: dict[str, Any], out: Path) -> float:
    """One learner and its workers until the learner finishes; the run's wall seconds."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    learner_args = flags(
        out=out,
        steps=cfg.steps,
        port=0,
        host="127.0.0.1",
        bt_listen="127.0.0.1:0",
        prompts_per_step=cfg.prompts_per_step,
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        staleness=setting["staleness"],
        kappa=1,
        lr=(cfg.lora_lr or 10 * cfg.lr) if setting["lora_rank"] else cfg.lr,
        lr_schedule=cfg.lr_schedule,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_min_ratio=cfg.lr_min_ratio,
        lora_rank=setting["lora_rank"] or None,
        kl_coef=cfg.kl_coef,
        wire_dtype=cfg.wire_dtype,
        seed=setting["seed"],
        off_policy=setting["off_policy"],
        minibatches=setting.get("minibatches", 1),
        adaptive_staleness=setting["adaptive"],
        guard_ess_min=setting["guard_ess_min"],
        torch_threads=1,
        train_cpus="0" if CORES > 1 and cfg.pin_learner == "train" else None,
        checkpoint_every=0,
        keep_versions_every=cfg.eval_every or None,
        quiet=True,
    )
    procs: list[subprocess.Popen] = []
    t0 = time.time()
    try:
        learner_pin = _pin(0) if cfg.pin_learner == "process" else []  # else the learner pins its training loop
        procs.append(spawn(["learner", *learner_args], out / "logs" / "learner.log", prefix=learner_pin))
        url = str(wait_for_learner(procs[0], out, out / "logs" / "learner.log")["url"])
        for i in range(cfg.workers):
            core = 1 + i % (CORES - 1) if CORES > 1 else 0
            args = flags(
                join=url,
                name=f"w{i}",
                work_dir=out / "workers" / f"w{i}",
                bt_listen="127.0.0.1:0",
                seed=setting["seed"] + i,
            )
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(core)}
            procs.append(spawn(["worker", *args], out / "logs" / f"worker{i}.log", env=env, prefix=_pin(core)))
        if procs[0].wait() != 0:
            raise Echo2Error(f"learner exited with code {procs[0].returncode}: see {out}/logs/learner.log")
        return time.time() - t0
    finally:
        stop(procs)


def evaluate_run(cfg: BenchStalenessConfig, out: Path) -> dict[str, Any]:
    """`echo2 eval --run OUT --json` on the final checkpoint, in its own process (its own vLLM engine); with
    --eval-every N, then every N-th version (greedy, one more engine for all of them) as `curve`. Greedy only
    (--eval-k 0) with the last step among those versions, one engine does both: the final checkpoint is the
    last version, and its evaluation the curve's last point."""
    keys = ("greedy_accuracy", "pass_at_k", "sampled_reward", "problems", TRAIN_MIX)
    versions = curve_versions(cfg)
    measures = {}
    if not (cfg.eval_k == 0 and versions and versions[-1] == cfg.steps):
        result = _eval(out, flags(run=out, limit=cfg.eval_limit, k=cfg.eval_k))
        measures = {k: result[k] for k in keys if k in result}
    if versions:
        first = _eval(out, flags(run=out, version=",".join(map(str, versions)), limit=cfg.eval_limit, k=0))
        each = [first, *first.get("then", [])]
        measures = measures or {k: each[-1].get(k, first[k]) for k in keys if k in first}
        measures["curve"] = [{k: r[k] for k in ("version", "greedy_accuracy", TRAIN_MIX) if k in r} for r in each]
    return measures


def curve_versions(cfg: BenchStalenessConfig) -> list[int]:
    """The versions `--eval-every N` evaluates: every N-th, from `--eval-from` (default N) to the last step."""
    if not cfg.eval_every:
        return []
    return [v for v in range(cfg.eval_every, cfg.steps + 1, cfg.eval_every) if v >= cfg.eval_from]


def base_accuracy(cfg: BenchStalenessConfig) -> float:
    """The initial model's held-out greedy accuracy on the sweep's problems and completion length: what a run
    has collapsed below. Measured once per OUT (OUT/base.json)."""
    return float(base_eval(cfg)["greedy_accuracy"])


def base_eval(cfg: BenchStalenessConfig) -> dict[str, Any]:
    """The initial model's `echo2 eval` result on the sweep's problems (OUT/base.json, measured once per OUT)."""
    path = cfg.out_dir / "base.json"
    if not path.is_file():
        result = _eval(cfg.out_dir, flags(limit=cfg.eval_limit, k=0, max_new_tokens=cfg.max_new_tokens))
        path.write_text(json.dumps(result))
    return dict(json.loads(path.read_text()))


def _eval(out: Path, args: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "echo2cli", "eval", *args, "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise Echo2Error(f"eval of {out} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row_of(setting: dict[str, Any], out: Path, wall_s: float, evaluation: dict[str, Any]) -> dict[str, Any]:
    """One run's JSON row, from its metrics.jsonl and decisions.jsonl."""
    steps = read_metrics(out / "metrics.jsonl")
    decisions = [d for d in read_metrics(out / "decisions.jsonl") if d.get("kind") == "staleness"]
    published = {s["step"] + 1: s["time_s"] for s in steps}  # version -> seconds into the run it was trained
    return {
        **setting,
        "name": run_name(setting),
        "steps": len(steps),
        "wall_s": wall_s,
        "train_s": steps[-1]["time_s"] if steps else None,
        # from the end of step 1 to the end of the last: the first step waits for engines to start, in every run
        "steady_s": steps[-1]["time_s"] - steps[0]["time_s"] if len(steps) > 1 else None,
        "reward": [s["rollout/reward_mean"] for s in steps],
        "time_s": [s["time_s"] for s in steps],
        "staleness_mean": [s["rollout/staleness_mean"] for s in steps],
        "health": {k: [s.get(k) for s in steps] for k in HEALTH},
        "health_by_staleness": bucket_means(steps),
        "guard": decisions,
        **{f"eval_{k}": v for k, v in evaluation.items() if k != "curve"},
        # held-out accuracy against wall time: version v is the weights trained by step v - 1 (steps count from 0)
        "eval_curve": [{**c, "time_s": published[c["version"]]} for c in evaluation.get("curve", [])],
    }


def bucket_means(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Token-weighted means over the run of each staleness bucket's health measures."""
    sums: dict[str, dict[str, float]] = {}
    for s in steps:
        for lag, m in (s.get("offpolicy/by_staleness") or {}).items():
            acc = sums.setdefault(lag, {})
            n = m["tokens"]
            acc["tokens"] = acc.get("tokens", 0.0) + n
            for k, v in m.items():
                if k != "tokens":
                    acc[k] = acc.get(k, 0.0) + v * n
    return {
        lag: {"tokens": acc["tokens"], **{k: v / acc["tokens"] for k, v in acc.items() if k != "tokens"}}
        for lag, acc in sorted(sums.items(), key=lambda kv: int(kv[0]))
    }


def run_bench(
    cfg: BenchStalenessConfig,
    on_row: Callable[[dict[str, Any]], None],
    on_start: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Every setting in turn; rows are appended to OUT/rows.jsonl as they finish (a rerun skips finished ones).
    `on_start(line)` says which run starts, `on_row(row)` what one gave."""
    prepare_default_model()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    base_accuracy(cfg)
    done = {r["name"]: r for r in read_metrics(cfg.out_dir / "rows.jsonl")}
    rows = []
    todo = settings(cfg)
    for i, setting in enumerate(todo, 1):
        name = run_name(setting)
        if name in done:
            rows.append(done[name])
            continue
        out = cfg.out_dir / name
        # an interrupted run's files (its learner.json, its guard decisions) are not this run's
        shutil.rmtree(out, ignore_errors=True)
        on_start(f"[{i}/{len(todo)}] {name}: training {cfg.steps} steps, then eval (logs in {out / 'logs'})")
        wall = train(cfg, setting, out)
        row = row_of(setting, out, wall, evaluate_run(cfg, out))
        with open(cfg.out_dir / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        prune(out)
        rows.append(row)
        on_row(row)
    return rows


def prune(out: Path) -> None:
    """Keep metrics, decisions and logs; the versions, worker copies and checkpoints are ~1 GB a run."""
    for name in ("versions", "workers", "checkpoints"):
        shutil.rmtree(out / name, ignore_errors=True)


def replayed_flags(row: dict[str, Any]) -> list[int]:
    """The steps the divergence guard, at the run's ESS bound (recorded in the row) and the learner's other
    default thresholds, flags in a run's recorded health (what a learner without --adaptive-staleness would warn
    about; it changes nothing in such a run)."""
    from echo2cli.config import LearnerConfig
    from echo2cli.learner.divergence import ESS_MIN, DivergenceGuard, Thresholds

    f = LearnerConfig.model_fields
    limits = Thresholds(
        ess_min=row.get("guard_ess_min", ESS_MIN),  # rows without it ran before the bound depended on the correction
        kl_max=f["guard_kl_max"].default,
        clip_max=f["guard_clip_max"].default,
    )
    guard = DivergenceGuard(row["staleness"], limits, adaptive=False)
    health = row["health"]
    return [i for i in range(row["steps"]) if guard.observe(i, {k: v[i] for k, v in health.items()})]


def score_key(mix: str) -> str:
    """The accuracy `--score-mix` scores runs by: the held-out split's own (`split`), or its levels weighted as
    training draws them (`train`: `evaluate.by_level`)."""
    return {"split": "greedy_accuracy", "train": TRAIN_MIX}[mix]


def evaluated(row: dict[str, Any], key: str = "greedy_accuracy") -> list[tuple[int, float]]:
    """A run's (version, held-out greedy accuracy `key`) in version order: its curve before the last step, then
    the final checkpoint's."""
    curve = [c for c in row.get("eval_curve") or [] if c["version"] < row["steps"]]
    points = [*curve, {"version": row["steps"], key: row.get(f"eval_{key}")}]
    if any(p.get(key) is None for p in points):
        raise ConfigError(
            f"{row['name']} has no {key} (an evaluation from before echo2 eval reported it, or a task without "
            "levels): score it with --score-mix split, or run it again in a new --out"
        )
    return [(p["version"], float(p[key])) for p in points]


def run_score(row: dict[str, Any], versions: int = 1, key: str = "greedy_accuracy") -> float:
    """A run's quality figure: its held-out greedy accuracy at the last step, or with `versions` > 1 the mean over
    its last `versions` evaluated versions (`evaluated`): a figure that does not hang on the one version a run
    stops at, where one version's accuracy can swing by 0.5 within ten. (On the arithmetic sweep of
    docs/BENCHMARKS.md it did not narrow the seeds' spread: the runs were still moving over those versions.)
    `key`: which accuracy (`score_key`)."""
    points = evaluated(row, key)
    if len(points) < versions:
        raise ConfigError(
            f"{row['name']} has {len(points)} evaluated version(s), fewer than --score-versions {versions}: "
            "score it over fewer, or evaluate more with --eval-every in a new --out"
        )
    return statistics.mean(acc for _, acc in points[-versions:])


def collapse(row: dict[str, Any], base: float) -> dict[str, Any]:
    """When a run's held-out greedy accuracy fell below the base model's, and the guard's lead on it, two ways:

    - `below_base_version`: the first evaluated version under base (the final one if only that is evaluated);
    - `lasting_below_version`: the first of the evaluations that stay under base to the end (None where the run
      ended at or above base): the fall it did not come back from. An early dip, on batches too fresh for any
      off-policy measure to move, can be the first without being the second.

    The lead: versions from the guard's first flag to the earliest the fall can have happened (the version
    after the last one evaluated above base; exact with --eval-every 1). The verdict on step f comes as version
    f + 1 is trained, so a flag at step f leads a fall at version v by v - (f + 1). None where the run never
    fell below, or never flagged."""
    curve = evaluated(row)
    below = [acc < base for _, acc in curve]
    fall = next((i for i, b in enumerate(below) if b), None)
    lasting = next((i for i in range(len(curve)) if all(below[i:])), None)
    flags = guard_flags(row)

    def lead(i: int | None) -> int | None:
        if i is None or not flags:
            return None
        earliest = curve[i - 1][0] + 1 if i else 1
        return earliest - (flags[0] + 1)

    return {
        "below_base_version": None if fall is None else curve[fall][0],
        "lasting_below_version": None if lasting is None else curve[lasting][0],
        "first_flag_step": flags[0] if flags else None,
        "flag_lead_versions": lead(fall),
        "lasting_lead_versions": lead(lasting),
    }


def summary(
    rows: list[dict[str, Any]],
    target_version: int = 20,
    base_model_acc: float | None = None,
    score_versions: int = 1,
    key: str = "greedy_accuracy",
) -> list[dict[str, Any]]:
    """Per setting: mean and spread over seeds of each run's score (`run_score`: the final accuracy, or the mean
    of the last `score_versions` evaluated versions), its difference to S = 0 of the same correction (`sync_arm`)
    seed by seed (`paired.py`: the mean, a bootstrap 95 % interval, and the seeds a half-width of 0.03 would
    take at the spread seen), and wall time against S = 0 of the same correction (speed-up = S = 0's mean
    steady time / this setting's: both from the end of the first step, which waits for the engines to start, to
    the end of the last); with accuracy curves (`--eval-every`), the time to S = 0's accuracy at
    `target_version` (`time_to_accuracy`); with the base model's accuracy, how many runs fell below it and how
    many of those the guard flagged at least 2 versions ahead (`collapse`). `key`: the accuracy scored
    (`score_key`); the time to accuracy and the falls below base use the split's own."""
    reach = time_to_accuracy(rows, target_version)
    keyed: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["staleness"], r["off_policy"], r["adaptive"], r.get("lora_rank", 0)), []).append(r)
    base = {(k[1], k[3]): statistics.mean(r["steady_s"] for r in v) for k, v in keyed.items() if k[0] == 0}
    base_acc = {(k[1], k[3]): _by_seed(v, score_versions, key) for k, v in keyed.items() if k[0] == 0 and not k[2]}
    out = []
    for (s, mode, adaptive, rank), runs in sorted(keyed.items()):
        acc = [run_score(r, score_versions, key) for r in runs]
        steady_s = statistics.mean(r["steady_s"] for r in runs)
        sync_acc, sync_s = sync_arm(base_acc, mode, rank), sync_arm(base, mode, rank)
        own = _by_seed(runs, score_versions, key)
        paired = None if s == 0 or sync_acc is None else paired_difference(own, sync_acc)
        out.append(
            {
                "staleness": s,
                "off_policy": mode,
                "adaptive": adaptive,
                "lora_rank": rank,
                "seeds": len(runs),
                "score_versions": score_versions,
                "score_key": key,
                "greedy_accuracy": statistics.mean(acc),
                "greedy_accuracy_min": min(acc),
                "greedy_accuracy_max": max(acc),
                "pass_at_k": statistics.mean(r["eval_pass_at_k"] for r in runs),
                "reward_last3": statistics.mean(statistics.mean(r["reward"][-3:]) for r in runs),
                "train_s": statistics.mean(r["train_s"] for r in runs),
                "steady_s": steady_s,
                "speedup_vs_sync": None if sync_s is None else sync_s / steady_s,
                "acc_vs_sync": paired,  # held-out accuracy minus S = 0's, seed by seed, with its interval
                "seeds_for_half_width_0.03": None if paired is None else seeds_needed(paired["diffs"], 0.03),
                **reach.get((s, mode, adaptive, rank), {}),
                "flagged_runs": sum(bool(guard_flags(r)) for r in runs),
                "first_flag_steps": [next(iter(guard_flags(r)), None) for r in runs],
                **({} if base_model_acc is None else _collapses(runs, base_model_acc)),
            }
        )
    return out


def sync_arm(arms: dict[tuple, Any], mode: str, *rest: int) -> Any:
    """S = 0's entry in `arms` (keyed by correction, then LoRA rank and maybe seed) for a setting of correction
    `mode`: its own correction's, else another's of the same rank (and seed). At lag 0 the batch was sampled by the
    policy being trained, so w = pi_theta / mu is 1 up to the engine's rounding, no clip or mask acts, and every
    correction takes the same policy-gradient step; a sweep of several corrections runs S = 0 once (`settings`).
    Of several others, the first in the learner's order (token_tis, its default, first)."""
    from echo2cli.learner.grpo import OFF_POLICY_MODES

    if (mode, *rest) in arms:
        return arms[(mode, *rest)]
    others = sorted((k for k in arms if k[1:] == rest), key=lambda k: OFF_POLICY_MODES.index(k[0]))
    return arms[others[0]] if others else None


def _collapses(runs: list[dict[str, Any]], base: float) -> dict[str, Any]:
    """How many runs fell below base (`collapse`) and how many of those the guard flagged at least 2 versions
    ahead: counting the first dip, and counting the fall the run ended in (`lasting_`)."""
    each = [collapse(r, base) for r in runs]
    falls = [c for c in each if c["below_base_version"] is not None]
    leads = [c["flag_lead_versions"] for c in falls]
    lasting = [c["lasting_lead_versions"] for c in each if c["lasting_below_version"] is not None]
    return {
        "below_base_runs": len(falls),
        "below_base_versions": [c["below_base_version"] for c in falls],
        "flag_leads": leads,
        "flagged_2_ahead": sum(lead is not None and lead >= 2 for lead in leads),
        "ended_below_base_runs": len(lasting),
        "lasting_flag_leads": lasting,
        "lasting_flagged_2_ahead": sum(lead is not None and lead >= 2 for lead in lasting),
    }


def time_to_accuracy(rows: list[dict[str, Any]], target_version: int) -> dict[tuple, dict[str, Any]]:
    """Per setting, from each run's accuracy curve: the wall seconds to first reach the held-out accuracy that
    S = 0 of the same correction (`sync_arm`), LoRA rank and seed had at `target_version` (its curve point at or
    before it), its mean over the seeds that reached it, and the ratio to S = 0's own time, seed by seed, with its
    interval."""

    def twin(r: dict[str, Any]) -> tuple[str, int, int]:  # what S = 0's run of the same arm and seed shares
        return r["off_policy"], r.get("lora_rank", 0), r["seed"]

    def sync(r: dict[str, Any]) -> bool:
        return r["staleness"] == 0 and not r["adaptive"]

    targets = {}
    for r in filter(sync, rows):
        if points := [c for c in r.get("eval_curve") or [] if c["version"] <= target_version]:
            targets[twin(r)] = max(points, key=lambda c: c["version"])["greedy_accuracy"]
    times: dict[tuple[int, str, bool, int], dict[int, float | None]] = {}
    own: dict[tuple[str, int, int], float | None] = {}  # S = 0's own time to its target
    for r in rows:
        if (target := sync_arm(targets, *twin(r))) is None or not r.get("eval_curve"):
            continue
        hit = time_to(r["eval_curve"], target)
        times.setdefault((r["staleness"], r["off_policy"], r["adaptive"], r.get("lora_rank", 0)), {})[r["seed"]] = hit
        if sync(r):
            own[twin(r)] = hit
    out: dict[tuple, dict[str, Any]] = {}
    for key, by_seed in times.items():
        reached = {seed: t for seed, t in by_seed.items() if t is not None}
        ratios = {seed: t / base for seed, t in reached.items() if (base := sync_arm(own, key[1], key[3], seed))}
        out[key] = {
            "target_reached": f"{len(reached)}/{len(by_seed)}",
            "time_to_target_s": statistics.mean(reached.values()) if reached else None,
            "time_to_target_vs_sync": seed_mean(ratios) if key[0] else None,
        }
    return out


def _by_seed(runs: list[dict[str, Any]], score_versions: int, key: str) -> dict[int, float]:
    return {r["seed"]: run_score(r, score_versions, key) for r in runs}


def plot(rows: list[dict[str, Any]], path: Path, key: str = "greedy_accuracy", base: float | None = None) -> None:
    """Reward against step, against the version that generated the batch (step - mean staleness: a batch
    trained at step t shows the policy of t - lag) and against wall time, and held-out greedy accuracy `key`
    against wall time (each evaluated version; the base model's `base` as a dashed line); one line per setting
    (mean of seeds), seeds as a band, each seed's final score as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.5))
    keyed: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        keyed.setdefault(r["name"].rsplit("-seed", 1)[0], []).append(r)
    for label, runs in sorted(keyed.items()):
        color = _reward_panels(axes[:3], runs, label)
        _accuracy_panel(axes[3], runs, color, key, base)
    if base is not None:
        axes[3].axhline(base, color="grey", linestyle="--", label=f"base model {base:.3f}")
        axes[3].legend(fontsize=8)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("version that generated the batch")
    for ax in axes[:3]:
        ax.set_ylabel("sampled reward (batch mean)")
    for ax in axes[2:]:
        ax.set_xlabel("wall time, s")
    axes[3].set_ylabel("held-out greedy accuracy" + (", training mix" if key == TRAIN_MIX else ""))
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _reward_panels(axes: Any, runs: list[dict[str, Any]], label: str) -> Any:
    """One setting's reward lines (mean of seeds, their range as a band) on the first three panels; its colour."""
    import numpy as np

    n = min(len(r["reward"]) for r in runs)
    reward = np.array([r["reward"][:n] for r in runs])
    time_s = np.array([r["time_s"][:n] for r in runs]).mean(axis=0)
    steps = np.arange(n)
    generated = steps - np.array([r["staleness_mean"][:n] for r in runs]).mean(axis=0)
    color = None
    for ax, x in ((axes[0], steps + 1), (axes[1], generated), (axes[2], time_s)):
        (line,) = ax.plot(x, reward.mean(axis=0), label=label, color=color)
        color = line.get_color()
        if len(runs) > 1:
            ax.fill_between(x, reward.min(axis=0), reward.max(axis=0), color=color, alpha=0.2)
    return color


def accuracy_over_time(row: dict[str, Any], key: str = "greedy_accuracy") -> list[tuple[float, float]]:
    """A run's (wall seconds, held-out greedy accuracy `key`) at each evaluated version: a curve point at the
    time its version was trained, the final checkpoint's at the last step's."""
    times = {c["version"]: c["time_s"] for c in row.get("eval_curve") or []} | {row["steps"]: row["train_s"]}
    return [(times[version], acc) for version, acc in evaluated(row, key)]


def _accuracy_panel(ax: Any, runs: list[dict[str, Any]], color: Any, key: str, base: float | None) -> None:
    """One setting's held-out accuracy at each evaluated version against the mean wall time it was trained at,
    as a line from the base model's at 0 s (the seeds' range as a band), or where only the final checkpoint was
    scored its mean with the range as a bar; each seed's final score as a dot at its own wall time."""
    import numpy as np

    points = [accuracy_over_time(r, key) for r in runs]
    n = min(len(p) for p in points)
    time_s = np.array([[t for t, _ in p[:n]] for p in points])
    acc = np.array([[a for _, a in p[:n]] for p in points])
    mean_s = time_s.mean(axis=0)
    start = ([0.0], [base]) if base is not None and n > 1 else ([], [])
    ax.plot([*start[0], *mean_s], [*start[1], *acc.mean(axis=0)], marker="o", color=color)
    ax.scatter(time_s[:, -1], acc[:, -1], color=color, s=12, alpha=0.5)
    if len(runs) > 1 and n > 1:
        ax.fill_between(mean_s, acc.min(axis=0), acc.max(axis=0), color=color, alpha=0.2)
    elif len(runs) > 1:
        ax.vlines(mean_s[-1], acc[:, -1].min(), acc[:, -1].max(), color=color, alpha=0.5)


def guard_flags(row: dict[str, Any]) -> list[int]:
    """Steps the guard flagged: as it ran with --adaptive-staleness (its warnings and lowerings, not the raises
    after healthy steps), else replayed at today's thresholds."""
    if not row["adaptive"]:
        return replayed_flags(row)
    return [d["step"] for d in row["guard"] if d["action"] != "raise"]
