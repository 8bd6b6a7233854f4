"""`echo2 bench broadcast`: star vs swarm dissemination of one policy version to N workers.

For each N and each method, a fresh origin (the learner's side: libtorrent seed + tracker + HTTP file
server) and N fetchers run as separate processes, each in its own network namespace behind `tc tbf`
caps (`netem.Fleet`), or on loopback with application-level caps where namespaces are not permitted.
All fetchers start on one "go"; T_bcast is the time from "go" until the last fetcher holds the whole,
verified file (libtorrent checks every piece's SHA-1; the star's HTTP body is complete).

    star:  every worker downloads the whole file from the learner over HTTP
    swarm: echo2's path: a private torrent seeded by the learner, workers trade pieces, and each fetcher
           asks for its own share of the pieces first (`node.slot_priorities`), sized by its uplink as the
           learner sizes it (`fleet.share_widths`; equal links: 1/N each)
    swarm-equal: the same with equal shares whatever the uplinks (the baseline of the share sizing)

Lower bound: T* = max(M/U, M/min d_i, N·M/(U + Σ u_i)) with M bytes, learner uplink U,
worker downlinks d_i and uplinks u_i. Each row reports T_bcast/T* and learner upload ÷ M.

ECHO2_BENCH_DEBUG=1 also prints each trial's per-worker reports to stderr (bytes from the learner and from
peers, finish time, when it added the web seed): the trace behind docs/BENCHMARKS.md's tail analysis.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from echo2cli.bench.netem import Fleet, Link, NetemError, namespaces_available, nat_available
from echo2cli.broadcast.torrent import make_torrent
from echo2cli.config import BenchBroadcastConfig
from echo2cli.errors import BroadcastError, ConfigError
from echo2cli.launch import flags
from echo2cli.layout import weights_path
from echo2cli.learner.fleet import share_widths
from echo2cli.units import mbps_to_bytes_per_s

BT_PORT, HTTP_PORT = 6881, 8700
NODE = [sys.executable, "-m", "echo2cli.bench.broadcast_node"]  # one process per node


@dataclass
class Row:
    method: str
    n: int
    t_bcast_s: float
    lower_bound_s: float
    ratio: float
    learner_upload_over_size: float  # peers and web seed together
    size_bytes: int
    mode: str
    links: str = "equal"  # "equal", or the --links file's name
    behind: int = 0  # workers behind NAT or a firewall
    web_seed_over_size: float = 0.0  # of the learner's upload, what its web seed sent
    web_seed_workers: int = 0  # workers that fell back to the web seed
    worker_t_s: list[float] = field(default_factory=list)  # each worker's time to the whole file, sorted
    learner_up_mbps: float = 0.0  # the learner's uplink (0 in rows recorded before it was)
    worker_links: list[list] = field(default_factory=list)  # [up_mbps, down_mbps, behind] per worker


def parse_links(text: str, source: str = "--links") -> list[Link]:
    """One worker per line: `UP_MBPS DOWN_MBPS [nat|firewall]`; `#` starts a comment."""
    links = []
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            if len(fields) not in (2, 3):
                raise ValueError
            up, down = float(fields[0]), float(fields[1])
            if up <= 0 or down <= 0:
                raise ValueError
            links.append(Link(up, down, behind=fields[2] if len(fields) == 3 else ""))
        except (ValueError, NetemError):
            raise ConfigError(
                f"{source} line {number}: {raw.strip()!r} is not `UP_MBPS DOWN_MBPS [nat|firewall]` with positive rates"
            ) from None
    if not links:
        raise ConfigError(f"{source} lists no worker: one line per worker, `UP_MBPS DOWN_MBPS [nat|firewall]`")
    return links


def lower_bound_s(size: float, n: int, up: float, downs: list[float], ups: list[float]) -> float:
    """T* in seconds; rates in bytes/s."""
    return max(size / up, size / min(downs), n * size / (up + sum(ups)))


def make_payload(directory: Path, size_mb: float | None) -> Path:
    """`directory/v000001/model.safetensors`: the default model in bf16, or `size_mb` random MB."""
    target = weights_path(directory, 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    if size_mb is not None:
        if size_mb <= 0:
            raise ConfigError("--size-mb must be positive")
        with open(target, "wb") as f:
            left = int(size_mb * 1e6)
            while left > 0:
                f.write(os.urandom(min(left, 16 << 20)))
                left -= 16 << 20
        return target
    import torch
    from safetensors.torch import load_file, save_file

    from echo2cli.models import resolve_model

    state = load_file(str(resolve_model("default") / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(target), metadata={"format": "pt"})
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def read(self) -> dict:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise BroadcastError(f"bench process exited early (code {self.p.wait()}): see its stderr above")
        return json.loads(line)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.send("quit")
                self.p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


def run_trial(
    method: str,
    payload: Path,
    work: Path,
    *,
    up_mbps: float,
    worker_links: list[Link],
    use_netns: bool,
) -> Row:
    """One distribution of `payload` to the fetchers behind `worker_links`, started fresh; returns its row."""
    n = len(worker_links)
    links = {"learner": Link(up_mbps, max(up_mbps, *(w.up_mbps for w in worker_links)) * 4)}
    links |= {f"w{i}": link for i, link in enumerate(worker_links)}
    trial_dir = work / f"{method}-{n}"
    shutil.rmtree(trial_dir, ignore_errors=True)
    trial_dir.mkdir(parents=True)
    procs: list[_Proc] = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, trial_dir, ignore_errors=True)
        http_port = HTTP_PORT if use_netns else _free_port()
        fleet = stack.enter_context(Fleet(links, open_to=("learner", http_port))) if use_netns else None
        stack.callback(_close_all, procs)
        _start_nodes(procs, method, links, payload, trial_dir, fleet, http_port)
        worker_times, stats, done = _distribute(procs[0], procs[1:])
    t_bcast = max(worker_times)
    size = payload.stat().st_size
    bound = lower_bound_s(
        size,
        n,
        mbps_to_bytes_per_s(up_mbps),
        [mbps_to_bytes_per_s(w.down_mbps) for w in worker_links],
        [mbps_to_bytes_per_s(w.up_mbps) for w in worker_links],
    )
    if os.environ.get("ECHO2_BENCH_DEBUG"):
        print(json.dumps(done), file=sys.stderr)
    web_seed = stats["web_seed_upload"] if method != "star" else 0
    uploaded = stats["bt_upload"] + web_seed if method != "star" else stats["http_upload"]
    return Row(
        method,
        n,
        t_bcast,
        bound,
        t_bcast / bound,
        uploaded / size,
        size,
        "netns" if fleet else "loopback",
        behind=sum(1 for w in worker_links if w.behind),
        web_seed_over_size=web_seed / size,
        web_seed_workers=sum(1 for d in done if d.get("web_seed_at")),
        worker_t_s=sorted(round(t, 2) for t in worker_times),
        learner_up_mbps=up_mbps,
        worker_links=[[w.up_mbps, w.down_mbps, w.behind] for w in worker_links],
    )


def _start_nodes(
    procs: list[_Proc],
    method: str,
    links: dict[str, Link],
    payload: Path,
    trial_dir: Path,
    fleet: Fleet | None,
    http_port: int,
) -> None:
    """The origin, then a fetcher per worker link, appended to `procs` as they start. In namespaces the links are
    capped by the kernel; on loopback the nodes cap themselves (libtorrent peer classes, a token bucket)."""
    prefix = fleet.argv if fleet else (lambda name: [])
    host = fleet.addr("learner") if fleet else "127.0.0.1"
    torrent = trial_dir / "version.torrent"
    torrent.write_bytes(make_torrent(payload.parent, f"http://{host}:{http_port}/announce").data)
    caps = links if fleet is None else {}  # the kernel caps the links in namespaces
    bt_port = BT_PORT if fleet else 0
    up = caps["learner"].up_mbps if caps else None
    options = flags(file=payload, torrent=torrent, bind=host, port=http_port, bt_port=bt_port, up_mbps=up)
    procs.append(_Proc(prefix("learner") + [*NODE, "origin", *options]))
    procs[0].read()
    workers = [name for name in links if name != "learner"]
    # the learner sizes each worker's share by the uplink it has seen (`Fleet.hand`); here the links are known
    widths = share_widths([links[w].up_mbps for w in workers]) if method == "swarm" else [1] * len(workers)
    for i, name in enumerate(workers):
        options = flags(
            method="star" if method == "star" else "swarm",
            torrent=torrent,
            out=trial_dir / name,
            bind=fleet.addr(name) if fleet else "127.0.0.1",
            slot=f"{sum(widths[:i])}/{sum(widths)}/{widths[i]}",
            url=f"http://{host}:{http_port}/file",
            web_seed=f"http://{host}:{http_port}",
            up_mbps=caps[name].up_mbps if caps else None,
            down_mbps=caps[name].down_mbps if caps else None,
        )
        procs.append(_Proc(prefix(name) + [*NODE, "fetch", *options]))


def _close_all(procs: list[_Proc]) -> None:
    for p in reversed(procs):
        p.close()


def _distribute(origin: _Proc, fetchers: list[_Proc]) -> tuple[list[float], dict, list[dict]]:
    """Every fetcher ready, then "go" to all: seconds until each holds the whole file, the origin's upload
    counters and each fetcher's report."""
    for f in fetchers:
        f.read()
    go = time.time()
    for f in fetchers:
        f.send("go")
    done = [f.read() for f in fetchers]
    time.sleep(1.5)  # libtorrent folds transfer counters into all_time_upload once a second
    origin.send("stats")
    return [d["t_done"] - go for d in done], origin.read(), done


def run_bench(
    workers: list[int],
    *,
    up_mbps: float,
    worker_up_mbps: float | None = None,
    worker_down_mbps: float | None = None,
    size_mb: float | None = None,
    methods: tuple[str, ...] = ("star", "swarm"),
    mode: str = "auto",
    links: list[Link] | None = None,
    links_name: str = "equal",
    work_dir: Path | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """`links`: one per worker (a fleet of N takes the first N); default: every worker at the worker caps."""
    if up_mbps <= 0 or not workers or min(workers) < 1:
        raise ConfigError("--uplink-mbps must be positive and --workers a list of counts ≥ 1, e.g. 1,2,4,8")
    if mode not in ("auto", "netns", "loopback"):
        raise ConfigError("--mode is one of auto, netns, loopback")
    if links is not None and max(workers) > len(links):
        raise ConfigError(f"--workers asks for {max(workers)} workers but --links lists {len(links)}")
    have_ns = namespaces_available()
    if mode == "netns" and not have_ns:
        raise ConfigError("--mode netns needs root (ip netns, tc): run as root or use --mode loopback")
    use_netns = have_ns if mode == "auto" else mode == "netns"
    if links is not None and any(link.behind for link in links) and not (use_netns and nat_available()):
        raise ConfigError("workers behind nat or firewall need namespaces and iptables: run as root with iptables")
    equal = Link(worker_up_mbps or up_mbps, worker_down_mbps or up_mbps)
    work = Path(tempfile.mkdtemp(prefix="echo2-bench-", dir=work_dir))
    # Inside a namespace, other processes must read the payload: keep it world-readable.
    os.chmod(work, 0o755)
    rows = []
    try:
        payload = make_payload(work / "origin", size_mb)
        for n in workers:
            for method in methods:
                row = run_trial(
                    method,
                    payload,
                    work,
                    up_mbps=up_mbps,
                    worker_links=links[:n] if links is not None else [equal] * n,
                    use_netns=use_netns,
                )
                row.links = links_name
                rows.append(row)
                if on_row:
                    on_row(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def run_bench_config(cfg: BenchBroadcastConfig, on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """`echo2 bench broadcast`: its comma-separated counts and methods, then `run_bench`."""
    try:
        counts = [int(x) for x in (cfg.workers or "1,2,4,8").split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--workers takes comma-separated counts, e.g. 1,2,4,8 (got {cfg.workers!r})") from None
    methods = tuple(m.strip() for m in cfg.method.split(",") if m.strip())
    if not methods or set(methods) - {"star", "swarm", "swarm-equal"}:
        raise ConfigError("--method takes star, swarm and swarm-equal, comma-separated (e.g. star,swarm)")
    links = None
    if cfg.links is not None:
        try:
            links = parse_links(cfg.links.read_text(), str(cfg.links))
        except OSError as exc:
            raise ConfigError(f"cannot read --links {cfg.links}: {exc.strerror}") from None
        if cfg.workers is None:
            counts = [len(links)]
    return run_bench(
        counts,
        links=links,
        links_name=cfg.links.name if cfg.links else "equal",
        up_mbps=cfg.uplink_mbps,
        worker_up_mbps=cfg.worker_up_mbps,
        worker_down_mbps=cfg.worker_down_mbps,
        size_mb=cfg.size_mb,
        methods=methods,
        mode=cfg.mode,
        on_row=on_row,
    )


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, style in (("star", "o-"), ("swarm", "s-"), ("swarm-equal", "^--")):
        pts = sorted((r.n, r.t_bcast_s) for r in rows if r.method == method)
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=method)
    bound = sorted({(r.n, r.lower_bound_s) for r in rows})
    ax.plot(*zip(*bound, strict=True), "k--", label="lower bound T*")
    size_mb = rows[0].size_bytes / 1e6
    ax.set(xlabel="workers N", ylabel="T_bcast (s)", title=f"one version, {size_mb:.0f} MB ({rows[0].mode})")
    ax.set_xticks(sorted({r.n for r in rows}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def rows_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)
