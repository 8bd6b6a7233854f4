"""A minimal private HTTP tracker (BEP 3 announce, BEP 23 compact peers), pure and in-memory.

The learner serves it at `/announce`, so a deployment needs no other infrastructure. Peers are kept per
info-hash with the time of their last announce and forgotten after `ttl_s`; `event=stopped` removes a
peer at once. Versions are v1 torrents; a hybrid v1/v2 torrent would be announced under its v1 hash and
its truncated v2 hash: they are just two keys here. Only IPv4 peers are returned (compact form), which
covers loopback and LANs.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable
from urllib.parse import parse_qs

ANNOUNCE_INTERVAL_S = 10  # short: versions live for seconds to minutes, and PEX fills in between


def bencode(value: object) -> bytes:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return b"i%de" % value
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, bytes):
        return b"%d:%s" % (len(value), value)
    if isinstance(value, list):
        return b"l" + b"".join(bencode(v) for v in value) + b"e"
    if isinstance(value, dict):
        items = sorted((k.encode() if isinstance(k, str) else k, v) for k, v in value.items())
        return b"d" + b"".join(bencode(k) + bencode(v) for k, v in items) + b"e"
    raise TypeError(f"cannot bencode {type(value).__name__}")


def parse_announce(raw_query: bytes) -> dict[str, bytes]:
    """Query string → first value of each key, as raw bytes (info_hash and peer_id are binary)."""
    parsed = parse_qs(raw_query.decode("latin-1"), encoding="latin-1", keep_blank_values=True)
    return {k: v[0].encode("latin-1") for k, v in parsed.items()}


class Tracker:
    def __init__(self, ttl_s: float = 3 * ANNOUNCE_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        # info_hash -> peer_id -> (ip, port, last_seen, left)
        self.swarms: dict[bytes, dict[bytes, tuple[str, int, float, int]]] = {}

    def announce(self, query: dict[str, bytes], remote_ip: str) -> bytes:
        try:
            info_hash, peer_id = query["info_hash"], query["peer_id"]
            port = int(query["port"])
        except (KeyError, ValueError):
            return bencode({"failure reason": "announce needs info_hash, peer_id and port"})
        if len(info_hash) != 20 or not 0 < port < 65536:
            return bencode({"failure reason": "malformed info_hash or port"})
        now = self.clock()
        swarm = self.swarms.setdefault(info_hash, {})
        for pid in [p for p, (*_, seen, _) in swarm.items() if now - seen > self.ttl_s]:
            del swarm[pid]
        if query.get("event") == b"stopped":
            swarm.pop(peer_id, None)
            return bencode({"interval": ANNOUNCE_INTERVAL_S, "peers": b""})
        left, numwant = _count(query.get("left"), 0), _count(query.get("numwant"), 50)
        if left is None or numwant is None:
            return bencode({"failure reason": "left and numwant must be non-negative integers"})
        numwant = min(numwant, 200)
        swarm[peer_id] = (remote_ip, port, now, left)
        peers = b"".join(_compact(ip, p) for pid, (ip, p, _, _) in swarm.items() if pid != peer_id and _is_v4(ip))[
            : 6 * numwant
        ]
        complete = sum(1 for (_, _, _, lft) in swarm.values() if lft == 0)
        return bencode(
            {
                "interval": ANNOUNCE_INTERVAL_S,
                "min interval": 1,
                "complete": complete,
                "incomplete": len(swarm) - complete,
                "peers": peers,
            }
        )


def _count(raw: bytes | None, default: int) -> int | None:
    """A non-negative integer query value (absent or empty: `default`); None if it is anything else."""
    if not raw:
        return default
    return int(raw) if raw.isdigit() and len(raw) <= 20 else None


def _is_v4(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).version == 4
    except ValueError:
        return False


def _compact(ip: str, port: int) -> bytes:
    return ipaddress.IPv4Address(ip).packed + port.to_bytes(2, "big")
