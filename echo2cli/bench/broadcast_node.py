"""One process of `echo2 bench broadcast`: the origin (learner side) or a fetcher (worker side).

    python -m echo2cli.bench.broadcast_node origin  --dir D --torrent T --bind IP --port P [--up-mbps U]
    python -m echo2cli.bench.broadcast_node fetch   --method swarm|star --torrent T --out D --bind IP
                                                   [--url URL] [--slot k/n[/w]] [--up-mbps u] [--down-mbps d]
                                                   [--web-seed URL]

Each runs inside its own network namespace (or on loopback) and talks to the orchestrator over
stdin/stdout, one JSON object per line:

    origin:  prints {"ready"} · answers "stats" with {"bt_upload", "http_upload", "web_seed_upload"} · exits on "quit"
    fetch:   prints {"ready"} · starts on "go" · prints {"done", "t_done", "bytes", "web_seed_at"} · keeps seeding
             (swarm) until "quit", then prints {"upload"}

The origin is what the learner runs: a libtorrent seed with the same session settings, the tracker at
`/announce`, its web seed at `/webseed/<any key>/` (broadcast/webseed.py, the fallback of a worker no peer
can reach), plus `/file` for the star baseline (a plain HTTP download of the whole file). On loopback,
where links cannot be capped by the kernel, the `--*-mbps` flags cap libtorrent's peer class and a
token bucket caps HTTP, so both methods see the same limits.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from echo2cli.broadcast.node import TorrentNode
from echo2cli.broadcast.tracker import Tracker, parse_announce
from echo2cli.broadcast.webseed import RangeError, TokenBucket, WebSeed
from echo2cli.layout import VersionKey
from echo2cli.units import mbps_to_bytes_per_s

CHUNK = 256 * 1024


def say(**obj: object) -> None:
    print(json.dumps(obj), flush=True)


def serve_web_seed(handler: BaseHTTPRequestHandler, web_seed: WebSeed, dir_name: str, file_name: str) -> None:
    """`/webseed/<any key>/<dir>/<file>`: the learner's web seed, without its key check."""
    try:
        reply = web_seed.reply(dir_name, file_name, handler.headers.get("Range"))
    except RangeError:
        handler.send_error(416)
        return
    if reply is None:
        handler.send_error(404)
        return
    handler.send_response(reply.status)
    for name, value in reply.headers.items():
        handler.send_header(name, value)
    handler.end_headers()
    for block in reply.body:
        handler.wfile.write(block)


def run_origin(args: argparse.Namespace) -> None:
    tracker, payload = Tracker(), Path(args.file)
    bucket = TokenBucket(mbps_to_bytes_per_s(args.up_mbps))
    sent = [0]
    key = VersionKey(1)  # the payload is `<dir>/v000001/model.safetensors`, as the learner lays a version out
    web_seed = WebSeed(
        lambda d, f: (key, payload) if VersionKey.from_relpath(d, f) == key else None, mbps_to_bytes_per_s(args.up_mbps)
    )

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            parts = urlsplit(self.path)
            if parts.path == "/announce":
                body = tracker.announce(parse_announce(parts.query.encode("latin-1")), self.client_address[0])
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif parts.path.startswith("/webseed/") and parts.path.count("/") == 4:
                serve_web_seed(self, web_seed, *parts.path.split("/")[3:])
            elif parts.path == "/file":
                self.send_response(200)
                self.send_header("Content-Length", str(payload.stat().st_size))
                self.end_headers()
                with open(payload, "rb") as f:
                    while block := f.read(CHUNK):
                        bucket.take(len(block))
                        self.wfile.write(block)
                        sent[0] += len(block)
            else:
                self.send_error(404)

    server = ThreadingHTTPServer((args.bind, args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    node = TorrentNode(f"{args.bind}:{args.bt_port}", upload_limit_bytes_s=mbps_to_bytes_per_s(args.up_mbps))
    node.seed(0, Path(args.torrent).read_bytes(), payload.parent.parent)
    say(ready=True, bt_port=node.listen_port)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stats":
            say(bt_upload=node.upload_bytes(), http_upload=sent[0], web_seed_upload=web_seed.total_sent())
        elif cmd == "quit":
            break
    server.shutdown()
    node.close()


def run_fetch(args: argparse.Namespace) -> None:
    origin = urlsplit(args.web_seed).hostname or "" if args.web_seed else ""  # the learner's address
    out = Path(args.out)
    node = None
    if args.method == "swarm":
        node = TorrentNode(
            f"{args.bind}:0",
            upload_limit_bytes_s=mbps_to_bytes_per_s(args.up_mbps),
            download_limit_bytes_s=mbps_to_bytes_per_s(args.down_mbps),
            web_seed=args.web_seed or "",
            web_seed_mode="fallback" if args.web_seed else "off",
            learner_ip=origin,
        )
    say(ready=True)
    if sys.stdin.readline().strip() != "go":
        return
    if node is not None:
        k, n, width = (int(x) for x in (args.slot + "/1").split("/")[:3]) if args.slot else (0, 0, 1)
        node.fetch(0, Path(args.torrent).read_bytes(), out, slot=(k, n, width) if n > width else None)
        while True:
            node.poll()
            node.check(0)
            transfer = node.transfers[0]
            if transfer.finished_at is not None:
                break
            time.sleep(0.02)
        peers = transfer.handle.get_peer_info()
        say(
            from_origin=sum(p.total_download for p in peers if p.ip[0] == origin),
            from_peers=sum(p.total_download for p in peers if p.ip[0] != origin),
            done=True,
            t_done=transfer.finished_at,
            bytes=node.download_bytes(0),
            hash_failures=transfer.hash_failures,
            web_seed_at=transfer.web_seed_at,
        )
    else:
        import httpx

        bucket, got = TokenBucket(mbps_to_bytes_per_s(args.down_mbps)), 0
        out.mkdir(parents=True, exist_ok=True)
        with httpx.stream("GET", args.url, timeout=600) as resp, open(out / "payload", "wb") as f:
            resp.raise_for_status()
            for block in resp.iter_bytes(CHUNK):
                bucket.take(len(block))
                f.write(block)
                got += len(block)
        say(done=True, t_done=time.time(), bytes=got, hash_failures=0)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    say(upload=node.upload_bytes() if node else 0)
    if node is not None:
        node.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="broadcast_node")
    p.add_argument("role", choices=["origin", "fetch"])
    p.add_argument("--file", help="origin: the payload file")
    p.add_argument("--torrent", required=True)
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="origin: HTTP port (tracker + star)")
    p.add_argument("--bt-port", type=int, default=0, help="origin: libtorrent port")
    p.add_argument("--method", choices=["swarm", "star"], default="swarm")
    p.add_argument("--out")
    p.add_argument("--url")
    p.add_argument("--web-seed", default="", help="fetch: the origin's URL, whose /webseed/ is the fallback")
    p.add_argument("--slot", default="")
    p.add_argument("--up-mbps", type=float, default=0.0, help="application-level cap (loopback only)")
    p.add_argument("--down-mbps", type=float, default=0.0, help="application-level cap (loopback only)")
    args = p.parse_args(argv)
    run_origin(args) if args.role == "origin" else run_fetch(args)


if __name__ == "__main__":
    main()
