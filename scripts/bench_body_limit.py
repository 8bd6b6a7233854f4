"""A large unauthenticated body against the learner's API: time to the refusal and memory, guarded vs not.

    .venv/bin/python scripts/bench_body_limit.py [--mb 118]

The learner's app (real uvicorn on loopback, a real coordinator) gets a ~118 MB JSON rollout batch with no
token, twice: as echo2 serves it (`guard.RequestGuard` answers from the headers) and with the guard
removed (FastAPI reads and validates the whole body before its handler refuses it: the old behaviour).
Baseline in the same run: the same request with an empty body, the fastest any refusal can be.
Prints the seconds to the answer and the peak RSS growth of the serving process for each, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import threading
import time
from pathlib import Path

from echo2cli.learner.coordinator import Coordinator
from echo2cli.learner.server import bind_socket, build_app, serve_in_thread
from echo2cli.protocol import PolicyInfo
from echo2cli.tasks.arithmetic import ArithmeticTask


def app(guarded: bool):
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
    api = build_app(
        coord,
        run_id="r",
        join_info={},
        model_dir=Path("."),
        model_files=[],
        token="s3cret",
        status_extra=dict,
        target_steps=1,
    )
    if not guarded:
        api.user_middleware.clear()  # the stack is built on the first request: this is the app without the guard
    return api


def body_of(mb: float) -> bytes:
    sample = json.dumps(
        {"prompt_id": 0, "sample_idx": 0, "completion_token_ids": list(range(4096)), "logprobs": [-0.5] * 4096}
    ).encode()
    n = max(1, int(mb * 1e6) // (len(sample) + 1))
    return b'{"worker_id": "w", "lease_id": "l", "version": 0, "samples": [' + b",".join([sample] * n) + b"]}"


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def refuse_time(port: int, body: bytes) -> tuple[float, int]:
    """Seconds from the first byte sent to the status line received, and the status."""
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /v1/rollouts HTTP/1.1\r\nHost: learner\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    def send() -> None:
        try:
            sock.sendall(head)  # two sends: joining them would copy the body inside the timed span
            sock.sendall(body)
        except OSError:  # the server answered and closed early: that is the point
            pass

    t0 = time.perf_counter()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    status_line = sock.makefile("rb").readline()
    elapsed = time.perf_counter() - t0
    sock.close()
    sender.join(timeout=30)
    return elapsed, int(status_line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=118.0)
    args = parser.parse_args()
    body = body_of(args.mb)
    rows = {}
    for name, guarded, payload in [
        ("empty body (baseline)", True, b""),
        ("guarded", True, body),
        ("unguarded (old)", False, body),
    ]:
        sock = bind_socket("127.0.0.1", 0)
        server, thread = serve_in_thread(app(guarded), sock)
        before = rss_peak_mb()
        seconds, status = refuse_time(sock.getsockname()[1], payload)
        rows[name] = {"seconds": seconds, "status": status, "peak_rss_growth_mb": rss_peak_mb() - before}
        server.should_exit = True
        thread.join(timeout=10)
        print(
            f"{name:24s} HTTP {status}  {seconds:7.3f} s  peak RSS +{rows[name]['peak_rss_growth_mb']:.0f} MB",
            flush=True,
        )
    base, guarded, old = rows["empty body (baseline)"], rows["guarded"], rows["unguarded (old)"]
    print(
        f"body {len(body) / 1e6:.0f} MB; guarded / baseline time: {guarded['seconds'] / base['seconds']:.2f}x; "
        f"unguarded / guarded time: {old['seconds'] / guarded['seconds']:.0f}x"
    )
    print(json.dumps({"body_mb": len(body) / 1e6, **rows}))


if __name__ == "__main__":
    main()
