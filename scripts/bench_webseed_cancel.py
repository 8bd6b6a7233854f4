"""Web seed requests dropped mid-wait against an honest range: does the learner's upload cap stay free?

    .venv/bin/python scripts/bench_webseed_cancel.py [--cancelled 200] [--uplink-mbps 100] [--range-kb 256] [--json]

The learner's app runs on a real uvicorn on loopback with a real coordinator and a web seed serving one 64 MB
version at the learner's uplink cap (`--uplink-mbps`). Worker B fetches one `--range-kb` range alone: the
baseline. Worker A then sends `--cancelled` ranged GETs one after another, each closed as soon as its headers are
read (a client that gives up, or one that wants to tie the uplink up). Worker B then fetches the same range again.
Prints both times and their ratio. Goal: the ratio <= 2 with 200 dropped requests (when each dropped request
booked its next chunk of the cap before it slept, 63 of them made the honest range 84x slower).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_webseed_lane import CALL_TIMEOUT_S, join, learner  # noqa: E402

from echo2cli.broadcast.webseed import WebSeed  # noqa: E402
from echo2cli.layout import VersionKey  # noqa: E402
from echo2cli.learner.server import bind_socket, serving  # noqa: E402
from echo2cli.units import mbps_to_bytes_per_s  # noqa: E402

FILE_MB = 64


def drop_after_headers(port: int, path: str, length: int) -> str:
    """One ranged GET, closed once its status line and headers are in: the status code."""
    with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: learner\r\nRange: bytes=0-{length - 1}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            got = sock.recv(4096)
            if not got:
                break
            head += got
    line = head.split(b"\r\n", 1)[0].split()
    return line[1].decode() if len(line) > 1 else "closed"


def honest_range(api: httpx.Client, path: str, length: int) -> float:
    t0 = time.perf_counter()
    r = api.get(path, headers={"Range": f"bytes=0-{length - 1}"})
    r.raise_for_status()
    assert len(r.content) == length, len(r.content)
    return time.perf_counter() - t0


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    key = VersionKey(1)
    key.path(tmp).parent.mkdir(parents=True)
    key.path(tmp).write_bytes(os.urandom(FILE_MB << 20))
    web_seed = WebSeed(
        lambda d, f: (key, key.path(tmp)) if VersionKey.from_relpath(d, f) == key else None,
        mbps_to_bytes_per_s(args.uplink_mbps),
    )
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    length = args.range_kb << 10
    try:
        with (
            serving(learner(tmp, web_seed), sock),
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=CALL_TIMEOUT_S) as api,
        ):
            a, b = join(api, "a"), join(api, "b")
            path_a = f"/webseed/{a['tracker_key']}/v000001/model.safetensors"
            path_b = f"/webseed/{b['tracker_key']}/v000001/model.safetensors"
            alone = honest_range(api, path_b, length)
            time.sleep(1.0)  # the cap is free again
            codes: dict[str, int] = {}
            t0 = time.perf_counter()
            for _ in range(args.cancelled):
                code = drop_after_headers(port, path_a, 4 * length)
                codes[code] = codes.get(code, 0) + 1
            t_cancelled = time.perf_counter() - t0
            after = honest_range(api, path_b, length)
    finally:
        web_seed.close()
    return {
        "cancelled": args.cancelled,
        "cancelled_answers": codes,
        "cancelled_s": t_cancelled,
        "uplink_mbps": args.uplink_mbps,
        "range_bytes": length,
        "alone_s": alone,
        "after_s": after,
        "ratio": after / alone,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="an honest web seed range after many dropped requests")
    parser.add_argument("--cancelled", type=int, default=200, help="ranged GETs closed once their headers are read")
    parser.add_argument("--uplink-mbps", type=float, default=100.0, help="the web seed's byte-rate cap")
    parser.add_argument("--range-kb", type=int, default=256, help="the honest range's size")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the lines")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.cancelled} requests dropped after their headers in {result['cancelled_s']:.1f} s; answered:")
    print(f"  {result['cancelled_answers']}")
    print(f"honest {args.range_kb} KiB range alone:      {result['alone_s']:.3f} s")
    print(f"honest {args.range_kb} KiB range after them: {result['after_s']:.3f} s ({result['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
