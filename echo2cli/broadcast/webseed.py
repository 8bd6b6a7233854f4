"""The learner's HTTP web seed (BEP 19): the fallback that reaches a worker no peer can reach.

A worker behind a NAT or a firewall that lets only the learner's HTTP(S) port through cannot open a
BitTorrent connection to anyone. Its torrent client then also asks the learner over HTTP:

    GET /webseed/<tracker key>/v000007/model.safetensors     Range: bytes=a-b

libtorrent appends the torrent's name and file path to the URL it was given, and asks for byte ranges
(measured: a whole 5 MB file in one range). The tracker key in the path is the credential, as for
`/announce/<key>`: only joined workers get bytes. Only versions the learner is seeding right now are
served. The bytes need no more trust than a peer's: libtorrent checks every piece's SHA-1 against the
torrent from the authenticated API, and the worker checks the file's SHA-256 before loading it.

The bytes served count as the learner's upload for that version, so the planner's T_bcast and the
learner-upload figures include them. A worker adds the web seed only when its download has stalled
(`node.WEB_SEED_AFTER_S`), so an honest fleet that can reach peers leaves it idle.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CHUNK = 256 * 1024
_RANGE = re.compile(r"bytes=(\d{1,19})-(\d{0,19})")


class RangeError(ValueError):
    """A Range header this server does not satisfy (416)."""


def parse_range(header: str | None, size: int) -> tuple[int, int]:
    """`bytes=a-b` or `bytes=a-` → (start, length); no header → the whole file. One range only."""
    if header is None:
        return 0, size
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        raise RangeError(f"unsupported Range {header[:80]!r}: one range, bytes=a-b")
    start = int(match.group(1))
    end = int(match.group(2)) if match.group(2) else size - 1
    if start >= size or end < start:
        raise RangeError(f"Range {header[:80]!r} is outside the file's {size} bytes")
    return start, min(end, size - 1) - start + 1


class TokenBucket:
    """Caps a byte rate shared by threads (0 = no cap)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + n / self.rate
        time.sleep(max(0.0, start - now))


@dataclass(frozen=True)
class Reply:
    status: int  # 200 or 206
    headers: dict[str, str]
    body: Iterator[bytes]


class WebSeed:
    """Serves byte ranges of the files `resolve` names, and counts the bytes sent per torrent key.

    `resolve(dir_name, file_name)` → (key, path) for a file being seeded now, or None. `rate_bytes_s` caps
    what the web seed sends in all (the learner's `--uplink-mbps`; 0 = no cap).
    """

    def __init__(self, resolve: Callable[[str, str], tuple[Hashable, Path] | None], rate_bytes_s: float = 0) -> None:
        self.resolve = resolve
        self.bucket = TokenBucket(rate_bytes_s)
        self._sent: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def sent(self, key: Hashable) -> int:
        with self._lock:
            return self._sent.get(key, 0)

    def total_sent(self) -> int:
        with self._lock:
            return sum(self._sent.values())

    def reply(self, dir_name: str, file_name: str, range_header: str | None) -> Reply | None:
        """None if no such file is seeded; raises RangeError for a range it cannot serve."""
        found = self.resolve(dir_name, file_name)
        if found is None:
            return None
        key, path = found
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed by the body's generator)
        except FileNotFoundError:
            return None  # pruned between resolve and open
        size = path.stat().st_size
        try:
            start, length = parse_range(range_header, size)
        except RangeError:
            f.close()
            raise
        headers = {"Content-Length": str(length), "Accept-Ranges": "bytes"}
        if range_header is not None:
            headers["Content-Range"] = f"bytes {start}-{start + length - 1}/{size}"
        return Reply(206 if range_header is not None else 200, headers, self._body(f, key, start, length))

    def _body(self, f: BinaryIO, key: Hashable, start: int, length: int) -> Iterator[bytes]:
        with f:
            f.seek(start)
            while length > 0:
                block = f.read(min(CHUNK, length))
                if not block:
                    return  # truncated under us: the client sees a short body and asks again
                length -= len(block)
                self.bucket.take(len(block))
                with self._lock:
                    self._sent[key] = self._sent.get(key, 0) + len(block)
                yield block
