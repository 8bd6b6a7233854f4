"""A stranger at the learner's port with no token: idle sockets and slow-header senders against a worker's calls.

    .venv/bin/python scripts/bench_front_door.py [--idle 4000] [--slow 200] [--seconds 10] [--json]

The learner's app runs on a real uvicorn on loopback with a real coordinator, as `echo2 learner` serves it. An
attacker on 127.0.0.1 opens `--idle` TCP connections that never send a byte and `--slow` that send a request
header one byte every 2 s, and holds them. Worker B, on 127.0.0.2, meanwhile calls /v1/heartbeat and /v1/lease
back to back for `--seconds`, each call timed; a call that fails (a 503, a refused or reset connection) or takes
longer than CALL_TIMEOUT_S counts as CALL_TIMEOUT_S. B's baseline is the same loop before the attack, in the same
run. Two servers, one after the other: "unguarded" (no per-address limit, no header deadline: uvicorn alone, as
the learner served before `learner/connections.py`) and "shipped" (the learner's defaults). Goal: B's p99 <= 1 s
with the shipped limits, 4,000 idle sockets and 200 slow-header senders.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_webseed_lane import CALL_TIMEOUT_S, join, learner, percentiles  # noqa: E402
from bench_webseed_lane import call_loop as lane_call_loop  # noqa: E402

from echo2cli.broadcast.webseed import WebSeed  # noqa: E402
from echo2cli.learner.connections import Admission  # noqa: E402
from echo2cli.learner.server import bind_socket, serving  # noqa: E402

WORKER_ADDRESS = "127.0.0.2"
TRICKLE_S = 2.0


def attack(port: int, idle: int, slow: int) -> tuple[list[socket.socket], list[socket.socket], int]:
    """Open the attacker's connections from 127.0.0.1: (idle ones, slow ones, connects that failed)."""
    opened: list[socket.socket] = []
    failed = 0
    for _ in range(idle + slow):
        sock = socket.socket()
        sock.settimeout(1.0)
        try:
            sock.connect(("127.0.0.1", port))
            opened.append(sock)
        except OSError:
            failed += 1
            sock.close()
    for sock in opened[idle:]:
        try:
            sock.sendall(b"GET /v1/status HTTP/1.1\r\n")
        except OSError:
            pass
    return opened[:idle], opened[idle:], failed


def trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """One more byte of a header line on every slow connection, every TRICKLE_S."""
    while not stop.wait(TRICKLE_S):
        for sock in socks:
            try:
                sock.send(b"X")
            except OSError:
                pass


def call_loop(url: str, worker: dict[str, Any], seconds: float) -> dict[str, Any]:
    """`bench_webseed_lane.call_loop` from WORKER_ADDRESS: latencies and the failed calls, per call."""
    transport = httpx.HTTPTransport(local_address=WORKER_ADDRESS)
    with httpx.Client(base_url=url, transport=transport, timeout=CALL_TIMEOUT_S) as api:
        latencies = lane_call_loop(api, worker, seconds)
    failures = {name: sum(x >= CALL_TIMEOUT_S for x in xs) for name, xs in latencies.items()}
    return {"latencies": latencies, "failures": failures}


def run_one(admission: Admission, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    web_seed = WebSeed(lambda d, f: None, 0.0)
    sock = bind_socket("0.0.0.0", 0)
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    idle: list[socket.socket] = []
    slow: list[socket.socket] = []
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        stack.callback(web_seed.close)
        stack.enter_context(serving(learner(tmp, web_seed), sock, admission=admission))
        stack.callback(lambda: [s.close() for s in idle + slow])  # after the trickler stops, before the server
        stack.callback(stop.set)
        transport = httpx.HTTPTransport(local_address=WORKER_ADDRESS)
        with httpx.Client(base_url=url, transport=transport, timeout=CALL_TIMEOUT_S) as api:
            b = join(api, "b")
        baseline = call_loop(url, b, args.seconds / 2)
        t0 = time.perf_counter()
        idle, slow, failed = attack(port, args.idle, args.slow)
        t_attack = time.perf_counter() - t0
        trickler = threading.Thread(target=trickle, args=(slow, stop), daemon=True)
        trickler.start()
        loaded = call_loop(url, b, args.seconds)
    result: dict[str, Any] = {
        "attacker_connects_failed": failed,
        "attack_open_s": t_attack,
        "refused_by_server": admission.refused,
        "header_timeouts": admission.timed_out,
    }
    for name in ("heartbeat", "lease"):
        base = percentiles(baseline["latencies"][name])
        load = percentiles(loaded["latencies"][name])
        result[name] = {
            "baseline": base,
            "loaded": load,
            "loaded_failures": loaded["failures"][name],
            "p99_ratio": load["p99_s"] / base["p99_s"],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="a worker's API latency while a stranger holds connections")
    parser.add_argument("--idle", type=int, default=4000, help="connections that never send a byte")
    parser.add_argument("--slow", type=int, default=200, help="connections that send a header a byte every 2 s")
    parser.add_argument("--seconds", type=float, default=10.0, help="the loaded phase (the baseline: half of it)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    modes = {"unguarded": Admission(per_address=1 << 30, header_deadline_s=1e9), "shipped": Admission()}
    results = {}
    for name, admission in modes.items():
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = run_one(admission, args, Path(tmp))
    if args.json:
        print(json.dumps({"idle": args.idle, "slow": args.slow, **results}))
        return
    print(f"attacker on 127.0.0.1: {args.idle} idle connections, {args.slow} slow-header senders; worker B elsewhere")
    print(
        f"{'server':10s} {'call':10s} {'baseline p99':>13s} {'loaded p50':>11s} {'p99':>8s} {'failed':>7s} "
        f"{'refused':>8s} {'timed out':>10s}"
    )
    for mode, result in results.items():
        for name in ("heartbeat", "lease"):
            row = result[name]
            print(
                f"{mode:10s} {name:10s} {row['baseline']['p99_s']:12.4f}s {row['loaded']['p50_s']:10.4f}s "
                f"{row['loaded']['p99_s']:7.3f}s {row['loaded_failures']:7d} {result['refused_by_server']:8d} "
                f"{result['header_timeouts']:10d}"
            )


if __name__ == "__main__":
    main()
