"""Rates: links are given in Mbit/s (decimal, as link speeds are sold), libtorrent and the benches count bytes/s."""

from __future__ import annotations

BYTES_PER_MBIT = 125_000  # 10^6 bits / 8


def mbps_to_bytes_per_s(mbps: float) -> int:
    """0 stays 0: no cap."""
    return int(mbps * BYTES_PER_MBIT)
