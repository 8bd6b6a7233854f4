"""The swarm model (`echo2cli/plan/swarm.py`) against real broadcasts, then projected to fleets of 64-4,096.

    .venv/bin/python scripts/bench_swarm_model.py --record runs/swarm-model/rows.jsonl   # the real runs (~15 min, root)
    .venv/bin/python scripts/bench_swarm_model.py --rows runs/swarm-model/rows.jsonl [--plot docs/bench_swarm_model.png]

`--record` runs `echo2 bench broadcast` (swarm only, network namespaces and tc) for each trial below that the
file does not hold yet, appending one row per trial, so a stopped recording resumes: equal 100 Mbit/s links at
N = 2, 4, 8 (twice each: the calibration set), N = 12 and 16 (100 MB: 17 processes on this box), and the fleets
of examples/links/ (held out). `--rows` fits the model's constants on the calibration rows only, predicts every
other row without refitting and prints each prediction's error (T_bcast, the last worker; and the median
worker's time where the row has per-worker times), then times the model at N = 4,096 and prints T_bcast / T*
for the named fleets below at N = 64 ... 4,096, full versions and deltas, with the learner's upload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from echo2cli.plan.swarm import NAT, Constants, Run, Worker, fit, spread

ROOT = Path(__file__).resolve().parents[1]
MBPS = 1e6 / 8
TRIALS = [  # (name, --workers, --size-mb (None: the default model, 269 MB), --links file or None)
    ("equal-2a", 2, None, None),
    ("equal-4a", 4, None, None),
    ("equal-8a", 8, None, None),
    ("equal-2b", 2, None, None),
    ("equal-4b", 4, None, None),
    ("equal-8b", 8, None, None),
    ("equal-12", 12, 100.0, None),
    ("equal-16", 16, 100.0, None),
    ("mixed", 8, 50.0, "mixed.txt"),
    ("half-nat", 8, None, "half-nat.txt"),
    ("asymmetric", 8, 50.0, "asymmetric.txt"),
    ("firewalled", 4, None, "firewalled.txt"),
    ("all-nat", 8, None, "all-nat.txt"),
]
CALIBRATION = {"equal-2a", "equal-4a", "equal-8a", "equal-2b", "equal-4b", "equal-8b"}
# Named fleets for the projections: a learner on 10 Gbit/s; (fraction of the fleet, up Mbit/s, down Mbit/s, behind)
FLEETS = {
    "cloud 10 Gbit/s": [(1.0, 10000, 10000, "")],
    "mixed consumer": [(0.2, 1000, 1000, ""), (0.4, 100, 500, ""), (0.4, 20, 200, "")],
    "30 % NAT, 1 Gbit/s": [(0.7, 1000, 1000, ""), (0.3, 1000, 1000, NAT)],
}
SIZES = (("8 GB full", 8e9), ("delta (4 %)", 8e9 * 0.04))


def record(path: Path) -> None:
    from echo2cli.bench.broadcast import parse_links, run_bench

    done = {json.loads(line)["trial"] for line in path.read_text().splitlines()} if path.exists() else set()
    path.parent.mkdir(parents=True, exist_ok=True)
    for name, n, size_mb, links_file in TRIALS:
        if name in done:
            continue
        links = parse_links((ROOT / "examples" / "links" / links_file).read_text()) if links_file else None
        (row,) = run_bench(
            [n], up_mbps=100, links=links, links_name=links_file or "equal", size_mb=size_mb, methods=("swarm",)
        )
        with path.open("a") as f:
            f.write(json.dumps({"trial": name, **row.__dict__}) + "\n")
        print(f"{name}: T_bcast {row.t_bcast_s:.1f} s, T* {row.lower_bound_s:.1f} s, ratio {row.ratio:.2f}", flush=True)


def as_run(row: dict) -> Run:
    workers = tuple(Worker(up * MBPS, down * MBPS, behind) for up, down, behind in row["worker_links"])
    return Run(row["size_bytes"], row["learner_up_mbps"] * MBPS, workers, row["t_bcast_s"])


def fleet_of(spec: list[tuple[float, float, float, str]], n: int) -> list[Worker]:
    workers: list[Worker] = []
    for i, (fraction, up, down, behind) in enumerate(spec):
        k = n - len(workers) if i == len(spec) - 1 else round(fraction * n)
        workers += [Worker(up * MBPS, down * MBPS, behind)] * k
    return workers


def validate(rows: list[dict], constants: Constants, con: Console) -> list[float]:
    table = Table(
        "trial", "N", "MB", "measured s", "model s", "error", "median worker: measured", "model", title="held out"
    )
    errors = []
    for row in rows:
        if row["trial"] in CALIBRATION:
            continue
        run = as_run(row)
        got = spread(run.size, run.learner_up, run.workers, constants)
        error = got.t100_s / run.t_bcast_s - 1
        errors.append(abs(error))
        median = statistics.median(row["worker_t_s"]) if row.get("worker_t_s") else None
        table.add_row(
            row["trial"],
            str(row["n"]),
            f"{row['size_bytes'] / 1e6:.0f}",
            f"{run.t_bcast_s:.1f}",
            f"{got.t100_s:.1f}",
            f"{error:+.1%}",
            f"{median:.1f}" if median else "-",
            f"{got.t50_s:.1f}",
            f"{row['learner_upload_over_size']:.2f} / {got.learner_upload_over_size:.2f}",
        )
    con.print(table)
    if errors:
        con.print(
            f"|error| median {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(errors)} held-out runs"
        )
    return errors


def project(constants: Constants, con: Console) -> dict:
    learner_up = 10000 * MBPS
    t0 = time.perf_counter()
    spread(8e9, learner_up, fleet_of(FLEETS["mixed consumer"], 4096), constants)
    con.print(f"the model at N = 4,096 (mixed consumer, 3 classes): {time.perf_counter() - t0:.2f} s")
    table = Table("fleet", "version", "N", "T50 s", "T95 s", "T_bcast s", "T* s", "T_bcast / T*", "learner upload / M")
    out: dict = {}
    for fleet, spec in FLEETS.items():
        for label, size in SIZES:
            for n in (64, 256, 1024, 4096):
                got = spread(size, learner_up, fleet_of(spec, n), constants)
                out[(fleet, label, n)] = got
                table.add_row(
                    fleet,
                    label,
                    str(n),
                    f"{got.t50_s:.1f}",
                    f"{got.t95_s:.1f}",
                    f"{got.t100_s:.1f}",
                    f"{got.lower_bound_s:.1f}",
                    f"{got.ratio:.2f}",
                    f"{got.learner_upload_over_size:.2f}",
                )
    con.print(table)
    proposal = Table("fleet", "version", "N", "T95 s, fair", "behind first", "T_bcast / T*, fair", "behind first")
    for fleet, spec in FLEETS.items():
        for label, size in SIZES:
            workers = fleet_of(spec, 1024)
            fair = out[(fleet, label, 1024)]
            behind = spread(size, learner_up, workers, constants, policy="behind_first")
            row = (f"{fair.t95_s:.1f}", f"{behind.t95_s:.1f}", f"{fair.ratio:.2f}", f"{behind.ratio:.2f}")
            proposal.add_row(fleet, label, "1024", *row)
    for name in ("mixed.txt", "half-nat.txt"):
        workers = [Worker(up * MBPS, down * MBPS, behind) for up, down, behind in _links(name)]
        size = 50e6 if name == "mixed.txt" else 269e6
        fair, behind = (spread(size, 100 * MBPS, workers, constants, policy=p) for p in ("fair", "behind_first"))
        row = (f"{fair.t95_s:.1f}", f"{behind.t95_s:.1f}", f"{fair.ratio:.2f}", f"{behind.ratio:.2f}")
        proposal.add_row(f"examples/links/{name}", f"{size / 1e6:.0f} MB", str(len(workers)), *row)
    con.print(proposal)
    return out


def _links(name: str) -> list[tuple[float, float, str]]:
    from echo2cli.bench.broadcast import parse_links

    return [(w.up_mbps, w.down_mbps, w.behind) for w in parse_links((ROOT / "examples" / "links" / name).read_text())]


def plot(projected: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (fleet, label), style in zip(
        [(f, s) for f in FLEETS for s, _ in SIZES], ["o-", "o--", "s-", "s--", "^-", "^--"], strict=True
    ):
        pts = sorted((n, got.ratio) for (f, s, n), got in projected.items() if (f, s) == (fleet, label))
        ax.plot(*zip(*pts, strict=True), style, label=f"{fleet}, {label}")
    ax.set(xscale="log", xlabel="workers N", ylabel="T_bcast / T*", title="projected: learner on 10 Gbit/s")
    ax.set_ylim(bottom=1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", type=Path, help="run the real broadcasts, appending rows to this file")
    ap.add_argument("--rows", type=Path, help="fit, validate and project from these rows")
    ap.add_argument("--plot", type=Path, help="PNG of the projected T_bcast / T* against N")
    args = ap.parse_args()
    if args.record:
        record(args.record)
    if args.rows:
        con = Console()
        rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
        calibration = [as_run(r) for r in rows if r["trial"] in CALIBRATION]
        constants = fit(calibration)
        con.print(f"fitted on {len(calibration)} runs: {constants}")
        for r in calibration:
            model = spread(r.size, r.learner_up, r.workers, constants).t100_s
            con.print(f"  N = {len(r.workers)}: measured {r.t_bcast_s:.1f} s, model {model:.1f} s")
        validate(rows, constants, con)
        projected = project(constants, con)
        if args.plot:
            plot(projected, args.plot)


if __name__ == "__main__":
    main()
