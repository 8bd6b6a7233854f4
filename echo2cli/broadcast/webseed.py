"""The learner's HTTP web seed (BEP 19): the fallback that reaches a worker no peer can reach.

A worker behind a NAT or a firewall that lets only the learner's HTTP(S) port through cannot open a
BitTorrent connection to anyone. Its torrent client then also asks the learner over HTTP:

    GET /webseed/<tracker key>/v000007/model.safetensors     Range: bytes=a-b

libtorrent appends the torrent's name and file path to the URL it was given, and asks for byte ranges
(measured: a whole 5 MB file in one range). The tracker key in the path is the credential, as for
`/announce/<key>`: only joined workers get bytes. Only versions the learner is seeding right now are
served. The bytes need no more trust than a peer's: libtorrent checks every piece's SHA-1 against the
torrent from the authenticated API, and the worker checks the file's digest before loading it.

The bytes served count as the learner's upload for that version, so the planner's T_bcast and the
learner-upload figures include them. A worker adds the web seed only when its download has stalled
(`node.WEB_SEED_AFTER_S`), so an honest fleet that can reach peers leaves it idle.

The web seed runs in its own lane, apart from the API (join, lease, rollouts, heartbeat). A stream is slow by
design (the byte-rate cap) and may be slower still (the reader's link), so it must never hold one of the
API's handler threads: a synchronous body paced with `time.sleep` ran in the same 40-thread pool as every
sync handler, and 40 capped streams from one worker queued everyone's heartbeats until workers were marked
gone. Here a stream (`WebSeedStream`) is a coroutine on the event loop: the rate cap waits with a sleep that
holds no thread, and the only blocking work, opening and reading the file, runs on the web seed's own few
threads. What one stream may hold is bounded too:

    STREAMS_PER_WORKER / MAX_STREAMS   open streams per tracker key and in all; more answer 429 (`BusyError`)
    SEND_TIMEOUT_S                     a chunk the reader does not take within this ends the stream
                                       (its slot and file freed; the server then closes the connection)
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

CHUNK = 256 * 1024
STREAMS_PER_WORKER = 4  # libtorrent keeps one connection per web seed and torrent: a version and its delta, 2 spare
MAX_STREAMS = 64  # all workers: they share the uplink cap, so a 65th stream only slows the others (and holds an fd)
# one address (one token holder's 16 joins once held all 64); workers behind one NAT share it, and the web seed is
# their fallback only (BitTorrent reaches a NAT'd worker)
STREAMS_PER_ADDRESS = 32
SEND_TIMEOUT_S = 30.0  # one 256 KiB chunk in 30 s is < 70 kbit/s: a stalled (or hostile) reader, not a slow link
READ_THREADS = 4  # opens and reads of files the learner just wrote (page cache): a few threads keep up with any uplink
_RANGE = re.compile(r"bytes=(\d{1,19})-(\d{0,19})")

T = TypeVar("T")


class RangeError(ValueError):
    """A Range header this server does not satisfy (416)."""


class BusyError(Exception):
    """Too many web seed streams open, for this worker or in all (429): ask again once one has ended."""


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


# A stream books its next chunk this long before the cap frees (a sleep wakes a little late: booking back to back
# keeps the rate at the cap); a stream cancelled in that window loses the cap one chunk's time at most.
BOOK_AHEAD_S = 0.005


class TokenBucket:
    """Caps a byte rate shared by all streams (0 = no cap).

    `reserve(n)` books the next n bytes and says how long to wait before sending them; `take(n)` sleeps that long
    in the calling thread, for a server with a thread of its own per request (the broadcast bench's origin).
    `take_async(n)` waits with an async sleep, so a capped stream holds no thread, and books only once the cap is
    free: a stream cancelled while it waits (its client gone) has booked nothing. Booking before the wait let 63
    requests that closed after their headers hold the cap for 16 s of sending that never happened."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.lock = threading.Lock()  # streams may run on more than one event loop (a test client's, uvicorn's)
        self.next_free = time.monotonic()

    def reserve(self, n: int) -> float:
        if self.rate <= 0:
            return 0.0
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + n / self.rate
        return start - now

    def take(self, n: int) -> None:
        time.sleep(self.reserve(n))

    async def take_async(self, n: int) -> None:
        if self.rate <= 0:
            return
        while True:
            delay, booked = self._book_when_due(n)
            if delay > 0:
                await anyio.sleep(delay)
            if booked:
                return

    def refund(self, n: int) -> None:
        """Give back n bytes booked whose chunk never went out (its client left): the cap's next free moment moves
        n bytes' time earlier, never before now. A stream that booked after them may then send up to n bytes
        early, once."""
        if self.rate <= 0:
            return
        with self.lock:
            self.next_free = max(time.monotonic(), self.next_free - n / self.rate)

    def _book_when_due(self, n: int) -> tuple[float, bool]:
        """(seconds to wait, whether n bytes are booked): booked, back to back with the last booking, once the cap
        is free within BOOK_AHEAD_S; else nothing booked and the wait until it is."""
        with self.lock:
            now = time.monotonic()
            if self.next_free - now > BOOK_AHEAD_S:
                return self.next_free - now, False
            start = max(now, self.next_free)
            self.next_free = start + n / self.rate
        return start - now, True


class StreamSlots:
    """At most `per_key` open streams for one tracker key, `per_address` from one client address and `total` in
    all."""

    def __init__(self, per_key: int, total: int, per_address: int = STREAMS_PER_ADDRESS) -> None:
        self.per_key, self.total, self.per_address = per_key, total, per_address
        self._open: Counter[str] = Counter()
        self._from: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, who: str, address: str | None = None) -> None:
        """Takes a slot for `who` (at `address`, if known), or raises BusyError saying which limit is reached."""
        with self._lock:
            if self._open[who] >= self.per_key:
                raise BusyError(f"{self.per_key} web seed streams already open for this worker: ask again later")
            if address is not None and self._from[address] >= self.per_address:
                raise BusyError(f"{self.per_address} web seed streams already open from {address}: ask again later")
            if sum(self._open.values()) >= self.total:
                raise BusyError(f"{self.total} web seed streams already open: ask again later")
            self._open[who] += 1
            if address is not None:
                self._from[address] += 1

    def release(self, who: str, address: str | None = None) -> None:
        with self._lock:
            for counts, key in ((self._open, who), (self._from, address)):
                if key is not None:
                    counts[key] -= 1
                    if counts[key] <= 0:
                        del counts[key]

    def count(self) -> int:
        with self._lock:
            return sum(self._open.values())


@dataclass(frozen=True)
class Reply:
    status: int  # 200 or 206
    headers: dict[str, str]
    body: Iterator[bytes]


@dataclass(frozen=True)
class Opened:
    """A file opened for one range: `size` from the open file itself, so a prune after the open changes nothing."""

    key: Hashable
    file: BinaryIO
    start: int
    length: int
    size: int


class WebSeed:
    """Serves byte ranges of the files `resolve` names, and counts the bytes sent per torrent key.

    `resolve(dir_name, file_name)` → (key, path) for a file being seeded now, or None. `rate_bytes_s` caps
    what the web seed sends in all (the learner's `--uplink-mbps`; 0 = no cap). The limits default to the
    module's constants; tests pass small ones. `close()` stops the reader threads.

    The learner's ASGI app answers with `stream` (its own lane, limits, send timeout); `reply` is the same
    range as a plain iterator, paced in the caller's thread, for a thread-per-request server (the bench's).
    """

    def __init__(
        self,
        resolve: Callable[[str, str], tuple[Hashable, Path] | None],
        rate_bytes_s: float = 0,
        *,
        streams_per_worker: int = STREAMS_PER_WORKER,
        max_streams: int = MAX_STREAMS,
        streams_per_address: int = STREAMS_PER_ADDRESS,
        send_timeout_s: float = SEND_TIMEOUT_S,
        read_threads: int = READ_THREADS,
    ) -> None:
        self.resolve = resolve
        self.bucket = TokenBucket(rate_bytes_s)
        self.slots = StreamSlots(streams_per_worker, max_streams, streams_per_address)
        self.send_timeout_s = send_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="webseed")
        self._sent: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def sent(self, key: Hashable) -> int:
        with self._lock:
            return self._sent.get(key, 0)

    def total_sent(self) -> int:
        with self._lock:
            return sum(self._sent.values())

    def open_streams(self) -> int:
        return self.slots.count()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def in_lane(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the web seed's own threads, never on the pool the API's handlers run in."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def stream(
        self, worker: str, dir_name: str, file_name: str, range_header: str | None, address: str | None = None
    ) -> Response | None:
        """The response for one request of `worker` (its tracker key) from `address`: None if no such file is
        seeded; raises BusyError when its streams, its address's or all are at the limit, RangeError for a range it
        cannot serve."""
        self.slots.acquire(worker, address)
        try:
            with anyio.CancelScope(shield=True):  # an open in flight must reach the stream that closes it
                opened = await self.in_lane(self.open_range, dir_name, file_name, range_header)
        except BaseException:
            self.slots.release(worker, address)
            raise
        if opened is None:
            self.slots.release(worker, address)
            return None
        return WebSeedStream(self, worker, opened, range_header is not None, address)

    def reply(self, dir_name: str, file_name: str, range_header: str | None) -> Reply | None:
        """None if no such file is seeded; raises RangeError for a range it cannot serve."""
        opened = self.open_range(dir_name, file_name, range_header)
        if opened is None:
            return None
        ranged = range_header is not None
        return Reply(206 if ranged else 200, _headers(opened, ranged), self._body(opened))

    def _body(self, opened: Opened) -> Iterator[bytes]:
        with opened.file as f:
            offset, left = opened.start, opened.length
            while left > 0:
                block = os.pread(f.fileno(), min(CHUNK, left), offset)
                if not block:
                    return  # truncated under us: the client sees a short body and asks again
                offset, left = offset + len(block), left - len(block)
                self.bucket.take(len(block))
                self.add_sent(opened.key, len(block))
                yield block

    def open_range(self, dir_name: str, file_name: str, range_header: str | None) -> Opened | None:
        """None if no such file is seeded (or it was pruned before the open); raises RangeError."""
        found = self.resolve(dir_name, file_name)
        if found is None:
            return None
        key, path = found
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed by the stream)
        except FileNotFoundError:
            return None  # pruned between resolve and open
        try:
            size = os.fstat(f.fileno()).st_size  # not path.stat(): a prune right after the open made that a 500
            start, length = parse_range(range_header, size)
        except BaseException:
            f.close()
            raise
        return Opened(key, f, start, length, size)

    def add_sent(self, key: Hashable, n: int) -> None:
        with self._lock:
            self._sent[key] = self._sent.get(key, 0) + n


class WebSeedStream(Response):
    """One range of one file, sent to one worker from the event loop (see the module docstring).

    It ends when the range is sent, the file turns out shorter than it was (truncated under us: the client
    sees a short body and asks again), the client leaves, or a chunk waits SEND_TIMEOUT_S to be taken. In
    every case its file is closed and its slot given back. Ending early leaves the response incomplete, so
    uvicorn closes the connection (and logs one line saying so)."""

    def __init__(self, seed: WebSeed, worker: str, opened: Opened, ranged: bool, address: str | None = None) -> None:
        self.seed, self.worker, self.opened, self.address = seed, worker, opened, address
        self.status_code = 206 if ranged else 200
        self.background = None
        self.init_headers(_headers(opened, ranged))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_until_disconnect, receive, tasks.cancel_scope)
                await self._send_range(send)
                tasks.cancel_scope.cancel()
        finally:
            self.opened.file.close()
            self.seed.slots.release(self.worker, self.address)

    async def _send_range(self, send: Send) -> None:
        seed, opened = self.seed, self.opened
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        if not await _send_within(send, start, seed.send_timeout_s):
            return
        offset, left = opened.start, opened.length
        if left == 0:
            await _send_within(send, {"type": "http.response.body", "body": b""}, seed.send_timeout_s)
            return
        while left > 0:
            with anyio.CancelScope(shield=True):  # a read in flight ends before the file is closed
                block = await seed.in_lane(os.pread, opened.file.fileno(), min(CHUNK, left), offset)
            if not block:
                return  # truncated under us
            await seed.bucket.take_async(len(block))
            body = {"type": "http.response.body", "body": block, "more_body": left > len(block)}
            sent = False
            try:
                sent = await _send_within(send, body, seed.send_timeout_s)
            finally:  # the client left (a cancel) or took nothing: its chunk never used the cap
                if not sent:
                    seed.bucket.refund(len(block))
            if not sent:
                return
            seed.add_sent(opened.key, len(block))
            offset, left = offset + len(block), left - len(block)


def _headers(opened: Opened, ranged: bool) -> dict[str, str]:
    headers = {"Content-Length": str(opened.length), "Accept-Ranges": "bytes"}
    if ranged:
        headers["Content-Range"] = f"bytes {opened.start}-{opened.start + opened.length - 1}/{opened.size}"
    return headers


async def _send_within(send: Send, message: Message, timeout_s: float) -> bool:
    """False if the client did not take `message` within `timeout_s` (its socket's buffers stayed full)."""
    with anyio.move_on_after(timeout_s):
        await send(message)
        return True
    return False


async def _until_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
