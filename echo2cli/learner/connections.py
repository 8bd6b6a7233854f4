"""Connections before any request: what a stranger who can reach the learner's port may hold.

uvicorn counts a connection against its cap (`limit_concurrency`, past which every request is a 503) from the
moment it opens, and times a connection out only after a response (`timeout_keep_alive`). About 2,100 idle
TCP connections that never sent a byte, or a few hundred that sent a header one byte every few seconds, turned
every worker's heartbeat, lease and upload into a 503 for as long as they stayed open, with no token needed.

So the learner's HTTP server runs uvicorn's own protocol with two rules added here, before any byte reaches the
app:

- at most `per_address` connections from one address at once (`--max-connections-per-address`); one past it is
  closed as it opens. The default fits 64 GPU workers behind one NAT address, each with its API connections, its
  web seed streams and its tracker announces;
- a request's header arrives whole within HEADER_DEADLINE_S of the connection opening, and of the first byte of
  each later request on it (an honest client sends a header in one write); otherwise the connection is closed.

Both act in the server's own event loop, on the transport, so they cost nothing per request. Keeping the two
apart from the app (the request guard in `guard.py` checks tokens and body sizes) keeps this the one place where
connections are refused. A learner reached through a reverse proxy sees the proxy's address: give it a per-address
limit as large as `limit_concurrency`, and let the proxy do this job.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

HEADER_DEADLINE_S = 10.0
PER_ADDRESS = 512  # 64 workers x (2 API connections, 4 web seed streams, tracker announces)


class Admission:
    """The connections open per address, shared by every connection of one server (its event loop's thread)."""

    def __init__(self, per_address: int = PER_ADDRESS, header_deadline_s: float = HEADER_DEADLINE_S) -> None:
        self.per_address, self.header_deadline_s = per_address, header_deadline_s
        self.open: Counter[str] = Counter()
        self.refused = 0  # connections closed as they opened, past the per-address limit
        self.timed_out = 0  # connections closed for a request header that did not arrive whole in time

    def admit(self, address: str | None) -> bool:
        """Count a new connection from `address` (None: unknown, always admitted), or refuse it."""
        if address is not None and self.open[address] >= self.per_address:
            self.refused += 1
            return False
        if address is not None:
            self.open[address] += 1
        return True

    def release(self, address: str | None) -> None:
        if address is not None:
            self.open[address] -= 1
            if self.open[address] <= 0:
                del self.open[address]


def guarded_protocol(base: type, admission: Admission) -> type:
    """uvicorn's HTTP protocol class `base` (h11's or httptools'), with `admission`'s rules."""

    class Guarded(base):
        _address: str | None = None
        _refused = False
        _deadline: asyncio.TimerHandle | None = None
        _cycle_at_arming: Any = None

        def connection_made(self, transport: Any) -> None:
            peer = transport.get_extra_info("peername")
            self._address = peer[0] if isinstance(peer, tuple) and peer else None
            if not admission.admit(self._address):
                self._refused = True
                transport.abort()
                return
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._disarm()
            admission.release(self._address)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not self._cycle_at_arming and not cycle.response_complete:
                # a new request's header is in: the app and uvicorn's own timeouts take it from here
                self._disarm()
                self._cycle_at_arming = cycle
            elif self._deadline is None and (cycle is None or cycle.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection

        def _arm(self) -> None:
            self._cycle_at_arming = self.cycle
            self._deadline = self.loop.call_later(admission.header_deadline_s, self._header_late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _header_late(self) -> None:
            self._deadline = None
            if self.cycle is self._cycle_at_arming and not self.transport.is_closing():
                admission.timed_out += 1
                self.transport.abort()

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded


def http_protocol(admission: Admission) -> type:
    """The protocol class for `uvicorn.Config(http=...)`: the one uvicorn would pick itself ("auto"), guarded."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return guarded_protocol(AutoHTTPProtocol, admission)
