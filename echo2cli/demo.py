"""`echo2 demo`: the whole system on one machine — a learner and K workers as separate processes.

They talk only over HTTP and BitTorrent on loopback, exactly as across the internet. Each worker's
vLLM engine is pinned to one core (`VLLM_CPU_OMP_THREADS_BIND`); the learner trains with the cores left
(`learner_threads`). Logs go to `<out>/logs/`, metrics to `<out>/metrics.jsonl`, the summary to
`<out>/demo_summary.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Column, Table

from echo2cli.config import DemoConfig
from echo2cli.errors import Echo2Error
from echo2cli.launch import flags, spawn, stop, wait_for_learner
from echo2cli.layout import CHECKPOINTS_DIR, LEARNER_FILE, VERSIONS_DIR
from echo2cli.metrics import read_metrics
from echo2cli.models import prepare_default_model
from echo2cli.status import fmt, render
from echo2cli.textsafe import DETAIL_LEN, shown
from echo2cli.worker.client import LearnerClient

RUN_FILES = ("metrics.jsonl", LEARNER_FILE, "summary.json", "demo_summary.json", "config.json")
RUN_DIRS = (VERSIONS_DIR, "workers", CHECKPOINTS_DIR, "logs")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean(out: Path) -> None:
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)
    (out / "logs").mkdir(parents=True)


def summarize(out: Path, wall_s: float, seed: int) -> dict[str, Any]:
    rows = read_metrics(out / "metrics.jsonl")
    if not rows:
        raise Echo2Error(f"the run wrote no metrics: see {out / 'logs'}")
    k = max(1, min(3, len(rows) // 3))
    bcast = [r["bcast/t_s"] for r in rows if r.get("bcast/t_s") is not None]
    ratios = [r["bcast/upload_ratio"] for r in rows if r.get("bcast/upload_ratio") is not None]
    return {
        "steps": len(rows),
        "seed": seed,
        "wall_s": wall_s,
        "reward_start": statistics.mean(r["rollout/reward_mean"] for r in rows[:k]),
        "reward_end": statistics.mean(r["rollout/reward_mean"] for r in rows[-k:]),
        "t_train_s_median": statistics.median(r["learner/t_train_s"] for r in rows),
        "t_bcast_s_median": statistics.median(bcast) if bcast else None,
        "bubble_ratio": rows[-1]["learner/bubble_ratio"],
        "upload_ratio_median": statistics.median(ratios) if ratios else None,
        "staleness_max": max(r["rollout/staleness_max"] for r in rows),
        "stale_dropped": rows[-1]["rollout/stale_dropped_total"],
        "activation": _last_decision(out),
        "metrics": str(out / "metrics.jsonl"),
    }


def _last_decision(out: Path) -> str:
    decisions = [d for d in read_metrics(out / "decisions.jsonl") if d.get("kind") != "staleness"]
    if not decisions:
        return "-"
    d = decisions[-1]
    mu = f"; mu_min_echo2 {d['mu_min_echo2']:.1f} rollouts/s" if d.get("mu_min_echo2") else ""
    return f"{', '.join(d['active'])} active, {', '.join(d['standby']) or 'none'} on standby{mu}"


def summary_table(s: dict[str, Any]) -> Table:
    table = Table("metric", Column("value", overflow="fold"), title="echo2 demo summary")
    table.add_row("steps", str(s["steps"]))
    table.add_row("seed", str(s["seed"]))
    table.add_row("wall time", f"{s['wall_s']:.0f} s")
    table.add_row("reward (first steps → last steps)", f"{s['reward_start']:.3f} → {s['reward_end']:.3f}")
    table.add_row("T_train (median)", f"{s['t_train_s_median']:.2f} s")
    table.add_row("T_bcast (median)", f"{fmt(s['t_bcast_s_median'])} s")
    table.add_row("learner bubble ratio", f"{s['bubble_ratio']:.3f}")
    table.add_row("learner upload ÷ model size (median)", fmt(s["upload_ratio_median"]))
    table.add_row("max staleness trained", str(s["staleness_max"]))
    table.add_row("cost-aware activation (last decision)", shown(s["activation"], DETAIL_LEN))  # workers' names
    table.add_row("metrics", s["metrics"])
    return table


def run_demo(cfg: DemoConfig, console: Console, worker_flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """The demo to its summary; `worker_flags` go to every worker (benchmarks compare worker settings)."""
    out = cfg.out_dir.resolve()
    _clean(out)
    with console.status("preparing the default model (first run only, ~40 s)"):
        prepare_default_model()
    t0 = time.time()
    procs: list[subprocess.Popen] = []
    try:
        url = _start(cfg, out, procs, console, worker_flags)
        _watch(procs, url, out, console)
    finally:
        stop(procs)
    summary = summarize(out, time.time() - t0, cfg.seed)
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    console.print(summary_table(summary))
    return summary


def learner_threads(cores: int, workers: int) -> int:
    """The cores left after one per worker's engine, at least one. On 2 cores with 2 workers the learner gets
    1 thread: with 2, each of its parallel regions waits for a thread whose core an engine holds, and spins
    (the learner burned 1.6x the CPU per step for a slower step; docs/BENCHMARKS.md "The one-box demo")."""
    return max(1, cores - workers)


def _start(
    cfg: DemoConfig, out: Path, procs: list[subprocess.Popen], console: Console, worker_flags: tuple[str, ...]
) -> str:
    """The learner, then the workers, each engine pinned to its own core; the learner's URL."""
    learner_args = flags(
        out=out,
        steps=cfg.steps,
        port=cfg.port or free_port(),
        host="127.0.0.1",
        bt_listen="127.0.0.1:0",
        prompts_per_step=cfg.prompts_per_step,
        group_size=cfg.group_size,
        staleness=cfg.staleness,
        lr=cfg.lr,
        seed=cfg.seed,
        lora_rank=cfg.lora_rank,
        report_to=cfg.report_to,
        keep_versions_every=cfg.keep_versions_every or None,
        quiet=True,
        torch_threads=cfg.learner_threads or learner_threads(os.cpu_count() or 1, cfg.workers),
    )
    procs.append(spawn(["learner", *learner_args], out / "logs" / "learner.log"))
    with console.status("starting the learner"):
        url = str(wait_for_learner(procs[0], out, out / "logs" / "learner.log")["url"])
    for i in range(cfg.workers):
        args = flags(
            join=url, name=f"w{i}", work_dir=out / "workers" / f"w{i}", bt_listen="127.0.0.1:0", seed=cfg.seed + i
        )
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
        procs.append(spawn(["worker", *args, *worker_flags], out / "logs" / f"worker{i}.log", env=env))
    return url


def _watch(procs: list[subprocess.Popen], url: str, out: Path, console: Console) -> None:
    """The live view until the learner exits; then the workers, which heard 'finished', get a minute to leave."""
    learner, workers = procs[0], procs[1:]
    client = LearnerClient(url, unreachable_s=5)
    with Live(render(None, "workers starting vLLM"), console=console, refresh_per_second=2) as live:
        while learner.poll() is None:
            try:
                live.update(render(client.status(), ""))
            except Echo2Error:
                pass  # the learner is between steps or shutting down
            for i, p in enumerate(workers):
                if p.poll() not in (None, 0):
                    raise Echo2Error(f"worker {i} exited with code {p.returncode}: see {out}/logs/worker{i}.log")
            time.sleep(1.0)
    if learner.returncode != 0:
        raise Echo2Error(f"learner exited with code {learner.returncode}: see {out}/logs/learner.log")
    for p in workers:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.terminate()
