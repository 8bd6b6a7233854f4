"""How long a new version keeps a worker's engine from generating: the default demo, run twice in one go.

    .venv/bin/python scripts/bench_swap.py [--steps 20] [--out runs/bench-swap] [--json]

The baseline run passes `--verify-between-leases` to its workers: each complete download is hashed (a delta
rebuilt against the loaded version) in the worker's main loop, between leases, while the engine waits; then
the engine reloads. The second run is the default: a prepare thread does that work while the engine still
generates with the version it has, so the swap between leases is only the reload. Both read every "loaded"
event of the workers' events.jsonl (versions after the first, all of them deltas in the demo) and report
medians of

    t_verify   last piece in → verified (the hash or the rebuild; on the prepare thread, concurrent)
    t_stall    the swap as the engine sees it: the main loop's time from "ready?" to generating again
    t_swap     last piece in → generating with the version (includes the lease in progress). Between leases
               a complete download is noticed only when the main loop looks, so there it starts late; T_bcast
               is the end-to-end figure that compares fairly
    ready → generating   t_swap - t_verify: from verified to generating (the lease in progress, the reload)

and the demo's own summary (wall time, T_bcast). Prints a table with the ratios default / baseline and writes
OUT/bench_swap.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from echo2cli.config import DemoConfig
from echo2cli.demo import run_demo
from echo2cli.metrics import read_metrics

MODES = {"between leases (baseline)": ("--verify-between-leases",), "prepare thread (default)": ()}
FIELDS = ("t_verify_s", "t_rebuild_s", "t_reload_s", "t_stall_s", "t_swap_s")


def swaps(run: Path) -> list[dict[str, Any]]:
    """Every worker's "loaded" events after its first version (the first starts the engine, no swap)."""
    events = []
    for log in sorted(run.glob("workers/*/events.jsonl")):
        loaded = [e for e in read_metrics(log) if e.get("event") == "loaded"]
        events += loaded[1:]
    return events


def measure(name: str, flags: tuple[str, ...], steps: int, out: Path) -> dict[str, Any]:
    run = out / name.split()[0]
    summary = run_demo(DemoConfig(steps=steps, out_dir=run), Console(quiet=True), worker_flags=flags)
    events = swaps(run)
    row = {
        "mode": name,
        "worker_flags": list(flags),
        "swaps": len(events),
        "via_delta": sum(e["via"] == "delta" for e in events),
        **{f"{k}_median": statistics.median(e.get(k, 0.0) for e in events) if events else None for k in FIELDS},
        "t_ready_to_generating_s_median": statistics.median(e["t_swap_s"] - e["t_verify_s"] for e in events)
        if events
        else None,
        "t_stall_s_max": max((e.get("t_stall_s", 0.0) for e in events), default=None),
        "wall_s": summary["wall_s"],
        "t_bcast_s_median": summary["t_bcast_s_median"],
        "reward_end": summary["reward_end"],
    }
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # the figures are in the logs; checkpoints are big
    return row


def table(rows: list[dict[str, Any]]) -> Table:
    base, new = rows
    t = Table("median", base["mode"], new["mode"], "default ÷ baseline", title="swap latency, default demo")
    for key, label in [
        ("t_verify_s_median", "verify (hash / rebuild), s"),
        ("t_reload_s_median", "engine reload, s"),
        ("t_stall_s_median", "engine stalled by the swap, s"),
        ("t_stall_s_max", "engine stalled, worst swap, s"),
        ("t_swap_s_median", "last piece → generating, s"),
        ("t_ready_to_generating_s_median", "verified → generating, s"),
        ("t_bcast_s_median", "T_bcast (publish → every worker on it), s"),
        ("wall_s", "demo wall time, s"),
    ]:
        a, b = base[key], new[key]
        t.add_row(label, f"{a:.2f}", f"{b:.2f}", f"{b / a:.2f}x" if a else "-")
    t.add_row("swaps (via delta)", f"{base['swaps']} ({base['via_delta']})", f"{new['swaps']} ({new['via_delta']})", "")
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-swap"))
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = [measure(name, flags, args.steps, out) for name, flags in MODES.items()]
    (out / "bench_swap.json").write_text(json.dumps(rows, indent=2))
    Console().print(table(rows))
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
