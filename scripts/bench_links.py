"""One version over real-world fleets: `echo2 bench broadcast --links` for each file in examples/links/, one table.

    .venv/bin/python scripts/bench_links.py [--out runs/bench-links] [--plot docs/bench_links.png]
    .venv/bin/python scripts/bench_links.py --rows A.json B.json ... [--plot F.png]   # tables/plots saved rows

Fleets (examples/links/): `mixed` (8 workers at 10-1000 Mbit/s, a 50 MB payload: the 10 Mbit/s workers alone
take 40 s), `half-nat` (8 at 100 Mbit/s, every other one behind NAT), `all-nat` (8 behind NAT: no two can
connect, so the learner sends each a copy; swarm only) and `firewalled` (4, two of which can reach only the
learner's HTTP port and get the version from its web seed). Each runs star and swarm in the same run (star is
the baseline; T* the lower bound of `echo2 bench broadcast`). Needs root and iptables (network namespaces and
NAT). Writes OUT/<fleet>.json (`--json` rows of the bench) and prints T_bcast / T*, the learner's upload and
what its web seed sent, as multiples of the version.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from echo2cli.bench.broadcast import Row, parse_links, run_bench

ROOT = Path(__file__).resolve().parents[1]
FLEETS = {  # name -> (payload MB, None = the default model; methods)
    "mixed": (50.0, ("star", "swarm")),
    "half-nat": (None, ("star", "swarm")),
    "all-nat": (None, ("swarm",)),
    "firewalled": (None, ("star", "swarm")),
}


def run(out: Path) -> dict[str, list[Row]]:
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, (size_mb, methods) in FLEETS.items():
        path = ROOT / "examples" / "links" / f"{name}.txt"
        links = parse_links(path.read_text(), str(path))
        rows = run_bench([len(links)], up_mbps=100, links=links, links_name=path.name, size_mb=size_mb, methods=methods)
        (out / f"{name}.json").write_text(json.dumps([r.__dict__ for r in rows], indent=2))
        results[name] = rows
    return results


def load(paths: list[Path]) -> dict[str, list[Row]]:
    results: dict[str, list[Row]] = {}
    for path in paths:
        rows = [Row(**r) for r in json.loads(path.read_text())]
        results[rows[0].links.removesuffix(".txt")] = rows
    return results


def table(results: dict[str, list[Row]]) -> Table:
    t = Table(title="one version over each fleet, learner uplink 100 Mbit/s (netns)")
    for col in (
        "fleet",
        "N",
        "behind",
        "MB",
        "method",
        "T_bcast s",
        "T* s",
        "T_bcast/T*",
        "learner up / M",
        "web seed / M",
    ):
        t.add_column(col, justify="right")
    for name, rows in results.items():
        for r in rows:
            t.add_row(
                name,
                str(r.n),
                str(r.behind),
                f"{r.size_bytes / 1e6:.0f}",
                r.method,
                f"{r.t_bcast_s:.1f}",
                f"{r.lower_bound_s:.1f}",
                f"{r.ratio:.2f}",
                f"{r.learner_upload_over_size:.2f}",
                f"{r.web_seed_over_size:.2f}",
            )
    return t


def plot(results: dict[str, list[Row]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(results)
    for offset, method in ((-0.2, "star"), (0.2, "swarm")):
        pts = [(i, r) for i, n in enumerate(names) for r in results[n] if r.method == method]
        xs = [i + offset for i, _ in pts]
        ax1.bar(xs, [r.ratio for _, r in pts], width=0.4, label=method)
        ax2.bar(xs, [r.learner_upload_over_size for _, r in pts], width=0.4, label=method)
    for ax, label in ((ax1, "T_bcast / T*"), (ax2, "learner upload / version")):
        ax.set_xticks(range(len(names)), [f"{n}\nN={results[n][0].n}" for n in names])
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    ax1.axhline(1.0, color="k", linestyle="--", linewidth=1)
    fig.suptitle("one version, 100 Mbit/s learner uplink, network namespaces")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench-links"))
    p.add_argument("--rows", type=Path, nargs="*", help="table and plot rows saved by an earlier run instead")
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    results = load(args.rows) if args.rows else run(args.out)
    Console().print(table(results))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
