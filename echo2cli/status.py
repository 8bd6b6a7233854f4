"""`echo2 status`: a learner's state from anywhere, and a finished run's from its directory.

    echo2 status http://learner:8700 --token T [--watch]   # GET /v1/status, once or live
    echo2 status runs/latest [--plot run.png]               # metrics.jsonl of a finished or stopped run

The live view (`render`) is the one `echo2 demo` shows: step and version, a reward sparkline over the recent
steps, T_train / T_bcast / bubble, cost per step, rejected samples by reason, and each worker's loaded version,
download, tokens/s and state.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from echo2cli.errors import ConfigError, Echo2Error
from echo2cli.metrics import read_metrics
from echo2cli.protocol import Status
from echo2cli.textsafe import DETAIL_LEN, shown

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None], width: int = 40) -> str:
    """The last `width` values as block characters scaled to their own range ('·' where one is missing)."""
    values = values[-width:]
    known = [v for v in values if v is not None]
    if not known:
        return ""
    lo, hi = min(known), max(known)
    span = hi - lo or 1.0
    return "".join("·" if v is None else BARS[round((v - lo) / span * (len(BARS) - 1))] for v in values)


def fmt(x: Any, spec: str = ".2f") -> str:
    """A number as `spec` says; '-' for None, and anything else (a learner's metric may be a string, or a float
    where an int was meant) as safe text."""
    if x is None:
        return "-"
    try:
        return format(x, spec) if isinstance(x, int | float) else shown(x)
    except ValueError:  # a spec for another type of number ('d' of a float)
        return shown(x)


def _rejected(rejected: dict[str, int]) -> str:
    """Rejected samples by reason; the reasons are the learner's words."""
    return ", ".join(f"{shown(reason)} {n}" for reason, n in sorted(rejected.items())) or "none"


def render(status: Status | None, phase: str = "") -> Group:
    """The live view of one `/v1/status` answer (`phase` alone while there is none yet)."""
    head = Table.grid(padding=(0, 2))
    if status is None:
        head.add_row(f"[bold]{phase}[/]")
        return Group(head)
    m = status.last_metrics
    rewards = [h.get("rollout/reward_mean") for h in status.history]
    state = "[green]finished[/]" if status.finished else phase
    head.add_row(
        f"step [bold]{status.step}/{status.target_steps}[/]",
        f"version {status.version}",
        f"reward {fmt(m.get('rollout/reward_mean'), '.3f')} {sparkline(rewards)}",
        state,
    )
    head.add_row(
        f"T_train {fmt(m.get('learner/t_train_s'), '.1f')} s",
        f"T_bcast {fmt(m.get('bcast/t_s'), '.1f')} s",
        f"bubble {fmt(m.get('learner/bubble_ratio'))}",
        f"$/step {fmt(m.get('cost/usd_per_step'), '.4f')}  upload/model {fmt(m.get('bcast/upload_ratio'))}  "
        f"max staleness {fmt(m.get('rollout/staleness_max'), 'd')}",
    )
    head.add_row(f"rejected samples: {_rejected(status.rejected)}")
    workers = Table("worker", "loaded", "downloading", "tok/s", "rollouts", "leased", "state", box=None)
    for w in status.workers:
        dl = "-" if w.downloading_version is None else f"v{w.downloading_version} {w.download_progress:.0%}"
        state = ("standby" if w.standby else "active") if w.active else "[red]gone[/]"
        workers.add_row(
            shown(w.name),
            f"v{w.version_loaded}",
            dl,
            f"{w.tokens_per_s:.0f}",
            str(w.rollouts),
            str(w.leased_prompts),
            state,
        )
    return Group(head, workers)


def watch(client: Any, console: Console, interval_s: float) -> Status | None:
    """The live view until the learner says it finished (or Ctrl-C); a learner that stops answering is shown,
    not fatal: it may be restarting."""
    last: Status | None = None
    with Live(render(None, "connecting"), console=console, refresh_per_second=2) as live:
        try:
            while last is None or not last.finished:
                try:
                    last = client.status()
                    live.update(render(last, "[dim]live[/]"))
                except Echo2Error as exc:
                    live.update(render(last, f"[yellow]unreachable, retrying: {shown(exc, DETAIL_LEN)}[/]"))
                time.sleep(interval_s)
        except KeyboardInterrupt:
            pass
    return last


# -- a run directory ------------------------------------------------------------------------------------------


def run_summary(run_dir: Path) -> dict[str, Any]:
    """A finished or stopped run from its metrics.jsonl: progress, reward trend, timings, cost and rejections."""
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    if not rows:
        raise ConfigError(f"{run_dir} has no metrics.jsonl with steps: give a learner's run directory (--out) or URL")
    last = rows[-1]

    def column(key: str) -> list[float]:
        return [r[key] for r in rows if isinstance(r.get(key), int | float)]

    def median(key: str) -> float | None:
        xs = column(key)
        return statistics.median(xs) if xs else None

    k = max(1, min(5, len(rows) // 4))
    rewards = column("rollout/reward_mean")
    return {
        "run_dir": str(run_dir),
        "steps": len(rows),
        "last_step": last["step"],
        "version": last.get("version"),
        "wall_s": last.get("time_s"),
        "reward_first": statistics.mean(rewards[:k]) if rewards else None,
        "reward_last": statistics.mean(rewards[-k:]) if rewards else None,
        "rewards": rewards,
        "t_train_s_median": median("learner/t_train_s"),
        "t_bcast_s_median": median("bcast/t_s"),
        "bubble_ratio": last.get("learner/bubble_ratio"),
        "usd_total": sum(column("cost/usd_per_step")),
        "staleness_max": max(column("rollout/staleness_max"), default=None),
        "rejected": {
            k.removeprefix("rollout/").removesuffix("_total"): last[k]
            for k in ("rollout/stale_dropped_total", "rollout/invalid_total", "rollout/duplicate_total")
            if last.get(k)
        },
        "eval": {k: v for k, v in last.items() if k.startswith("eval/") and isinstance(v, int | float)},
    }


def run_table(s: dict[str, Any]) -> Table:
    table = Table("measure", "value", title=f"run {shown(s['run_dir'], DETAIL_LEN)}")
    table.add_row("steps recorded", f"{s['steps']} (last step {s['last_step']}, version {s['version']})")
    table.add_row("wall time", f"{fmt(s['wall_s'], '.0f')} s")
    table.add_row(
        "reward (first → last steps)",
        f"{fmt(s['reward_first'], '.3f')} → {fmt(s['reward_last'], '.3f')}  {sparkline(s['rewards'], 60)}",
    )
    table.add_row("T_train (median)", f"{fmt(s['t_train_s_median'])} s")
    table.add_row("T_bcast (median)", f"{fmt(s['t_bcast_s_median'])} s")
    table.add_row("learner bubble ratio", fmt(s["bubble_ratio"], ".3f"))
    table.add_row("cost of the steps", f"$ {s['usd_total']:.4f}")
    table.add_row("max staleness trained", fmt(s["staleness_max"], "d"))
    table.add_row("samples not trained", _rejected(s["rejected"]))
    for key, value in s["eval"].items():
        table.add_row(shown(key), f"{value:.3f}")
    return table


def plot_run(run_dir: Path, path: Path) -> None:
    """Reward, T_train, T_bcast and the step's bubble ratio against the learner step, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    if not rows:
        raise ConfigError(f"{run_dir} has no metrics.jsonl with steps to plot")
    panels = (
        ("rollout/reward_mean", "reward (batch mean)"),
        ("learner/t_train_s", "T_train (s)"),
        ("bcast/t_s", "T_bcast (s)"),
        ("learner/bubble_ratio_step", "bubble ratio (step)"),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 8), sharex=True)
    for ax, (key, label) in zip(axes, panels, strict=True):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", ms=3)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("learner step")
    axes[0].set_title(str(run_dir), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
