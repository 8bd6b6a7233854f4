"""Slow web seed streams against the learner's API: another worker's heartbeat and lease latency, with and without.

    .venv/bin/python scripts/bench_webseed_lane.py [--streams 200] [--seconds 10] [--file-mb 64] [--uplink-mbps 100]
                                                   [--streams-per-worker N --max-streams N] [--json]

The learner's app runs on a real uvicorn on loopback with a real coordinator and a web seed serving one
64 MB version at the learner's uplink cap. Worker A opens `--streams` web seed streams (raw sockets, each
receive buffer as small as the kernel allows) and never reads them. Worker B meanwhile calls /v1/heartbeat
and /v1/lease back to back for `--seconds`, each call timed; a call that takes longer than CALL_TIMEOUT_S
counts as that long. The baseline is the same loop in the same run before any stream is opened.

Prints p50/p99 of B's heartbeat and lease calls, loaded and baseline, their ratio, and how A's streams
were answered (200, 429, or nothing yet). `--streams-per-worker`/`--max-streams` lift the web seed's
limits (webseed.STREAMS_PER_WORKER, MAX_STREAMS, and STREAMS_PER_ADDRESS with them), so that all the streams
are served at once and only the lane keeps the API free. Goal: B's p99 <= 1 s with 200 streams from A.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from echo2cli import __version__
from echo2cli.broadcast.webseed import WebSeed
from echo2cli.layout import VersionKey
from echo2cli.learner.coordinator import Coordinator
from echo2cli.learner.server import bind_socket, build_app, serve_in_thread
from echo2cli.protocol import PolicyInfo
from echo2cli.tasks.arithmetic import ArithmeticTask
from echo2cli.units import mbps_to_bytes_per_s

TOKEN = "s3cret"
CALL_TIMEOUT_S = 30.0  # a worker's own request timeout (worker/client.py); a call this slow has failed
ANSWER_WAIT_S = 2.0  # how long to wait for the streams' status lines after the loaded phase


def learner(root: Path, web_seed: WebSeed) -> Any:
    coord = Coordinator(
        ArithmeticTask(),
        encode_prompt=lambda m: [1, 2, 3],
        decode=lambda ids: "0",
        group_size=8,
        staleness=2,
        prompts_per_step=8,
        max_new_tokens=16,
        vocab_size=50000,
        lease_timeout_s=60,
        heartbeat_s=2,
        seed=0,
    )
    coord.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=0)
    )
    return build_app(
        coord,
        run_id="r",
        join_info=dict(
            task="arithmetic",
            group_size=8,
            max_new_tokens=16,
            temperature=1.0,
            staleness=2,
            heartbeat_s=2.0,
            model_files=[],
        ),
        model_dir=root,
        model_files=[],
        token=TOKEN,
        status_extra=dict,
        target_steps=1,
        web_seed=web_seed,
    )


def join(api: httpx.Client, name: str) -> dict[str, Any]:
    r = api.post(
        "/v1/join", json={"name": name, "echo2_version": __version__}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    r.raise_for_status()
    return dict(r.json())


def open_stalled(port: int, path: str) -> socket.socket:
    """One GET whose answer is never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: learner\r\n\r\n".encode())
    return sock


def answers(socks: list[socket.socket]) -> dict[str, int]:
    """How the streams were answered so far: by status code, or "none"."""
    counts: dict[str, int] = {}
    deadline = time.monotonic() + ANSWER_WAIT_S
    for sock in socks:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            line = sock.recv(32).split(b"\r\n", 1)[0].split()
            code = line[1].decode() if len(line) > 1 else "closed"
        except TimeoutError:
            code = "none"
        except OSError:
            code = "closed"
        counts[code] = counts.get(code, 0) + 1
    return counts


def call_loop(api: httpx.Client, worker: dict[str, Any], seconds: float) -> dict[str, list[float]]:
    """Heartbeat, lease, heartbeat, ... for `seconds`: each call's latency (CALL_TIMEOUT_S if it failed: timed
    out, refused, reset or answered with an error, after which the loop waits 0.1 s, as a worker backs off)."""
    auth = {"Authorization": f"Bearer {worker['session_token']}"}
    calls = {
        "heartbeat": ("/v1/heartbeat", {"worker_id": worker["worker_id"], "version_loaded": 0}),
        "lease": ("/v1/lease", {"worker_id": worker["worker_id"], "version": 0, "max_prompts": 1}),
    }
    latencies: dict[str, list[float]] = {name: [] for name in calls}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for name, (path, body) in calls.items():
            t0 = time.perf_counter()
            try:
                api.post(path, json=body, headers=auth).raise_for_status()
                latencies[name].append(time.perf_counter() - t0)
            except httpx.HTTPError:
                latencies[name].append(CALL_TIMEOUT_S)
                time.sleep(0.1)
    return latencies


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "p50_s": xs[len(xs) // 2], "p99_s": xs[min(len(xs) - 1, int(len(xs) * 0.99))]}


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    key = VersionKey(1)
    key.path(tmp).parent.mkdir(parents=True)
    key.path(tmp).write_bytes(os.urandom(args.file_mb << 20))
    limits = {}
    if args.streams_per_worker is not None:
        limits["streams_per_worker"] = args.streams_per_worker
    if args.max_streams is not None:
        limits["max_streams"] = args.max_streams
    if limits:  # worker A's streams all come from loopback: lift the per-address cap with the others
        limits["streams_per_address"] = 1 << 20
    web_seed = WebSeed(
        lambda d, f: (key, key.path(tmp)) if VersionKey.from_relpath(d, f) == key else None,
        mbps_to_bytes_per_s(args.uplink_mbps),
        **limits,
    )
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server, thread = serve_in_thread(learner(tmp, web_seed), sock)
    streams: list[socket.socket] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=CALL_TIMEOUT_S) as api:
            a, b = join(api, "a"), join(api, "b")
            baseline = call_loop(api, b, args.seconds)
            path = f"/webseed/{a['tracker_key']}/v000001/model.safetensors"
            streams = [open_stalled(port, path) for _ in range(args.streams)]
            loaded = call_loop(api, b, args.seconds)
            answered = answers(streams)
    finally:
        for s in streams:
            s.close()
        server.should_exit = True
        thread.join(timeout=10)
        if hasattr(web_seed, "close"):  # the code before the lane had no reader threads to stop
            web_seed.close()
    result: dict[str, Any] = {"streams": args.streams, "stream_answers": answered, "uplink_mbps": args.uplink_mbps}
    for name in ("heartbeat", "lease"):
        base, load = percentiles(baseline[name]), percentiles(loaded[name])
        result[name] = {"baseline": base, "loaded": load, "p99_ratio": load["p99_s"] / base["p99_s"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="another worker's API latency while one worker holds web seed streams")
    parser.add_argument("--streams", type=int, default=200, help="web seed streams worker A opens and never reads")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase (baseline, loaded)")
    parser.add_argument("--file-mb", type=int, default=64, help="size of the version the web seed serves")
    parser.add_argument("--uplink-mbps", type=float, default=100.0, help="the web seed's byte-rate cap")
    parser.add_argument("--streams-per-worker", type=int, default=None, help="lift webseed.STREAMS_PER_WORKER")
    parser.add_argument("--max-streams", type=int, default=None, help="lift webseed.MAX_STREAMS")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.streams} stalled web seed streams from worker A; answered: {result['stream_answers']}")
    print(
        f"{'call of worker B':18s} {'baseline p50':>13s} {'p99':>8s} {'loaded p50':>11s} {'p99':>8s} {'p99 ratio':>10s}"
    )
    for name in ("heartbeat", "lease"):
        row = result[name]
        base, load = row["baseline"], row["loaded"]
        print(
            f"{name:18s} {base['p50_s']:12.4f}s {base['p99_s']:7.4f}s {load['p50_s']:10.4f}s {load['p99_s']:7.4f}s"
            f" {row['p99_ratio']:9.1f}x"
        )


if __name__ == "__main__":
    main()
