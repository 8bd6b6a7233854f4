from urllib.parse import quote_from_bytes

from echo2cli.broadcast.tracker import Tracker, bencode, parse_announce


def q(info_hash: bytes, peer: bytes, port: int, **extra: str) -> dict[str, bytes]:
    raw = f"info_hash={quote_from_bytes(info_hash)}&peer_id={quote_from_bytes(peer)}&port={port}"
    raw += "".join(f"&{k}={v}" for k, v in extra.items())
    return parse_announce(raw.encode())


def test_bencode_sorts_keys_and_encodes_nested_values():
    assert bencode({"b": 1, "a": [b"x", "yz"]}) == b"d1:al1:x2:yze1:bi1ee"


def test_binary_info_hash_survives_query_parsing():
    ih = bytes(range(236, 256))
    assert q(ih, b"p" * 20, 6881)["info_hash"] == ih


def test_announce_returns_other_peers_compact_and_forgets_stopped_ones():
    tr = Tracker()
    ih = b"\x01" * 20
    tr.announce(q(ih, b"a" * 20, 7001), "127.0.0.1")
    body = tr.announce(q(ih, b"b" * 20, 7002), "127.0.0.2")
    assert b"5:peers6:\x7f\x00\x00\x01\x1bY" in body  # 127.0.0.1:7001 only, never the asker
    tr.announce(q(ih, b"a" * 20, 7001, event="stopped"), "127.0.0.1")
    assert b"5:peers0:" in tr.announce(q(ih, b"b" * 20, 7002), "127.0.0.2")


def test_peers_expire_after_ttl():
    now = [0.0]
    tr = Tracker(ttl_s=10, clock=lambda: now[0])
    ih = b"\x02" * 20
    tr.announce(q(ih, b"a" * 20, 7001), "127.0.0.1")
    now[0] = 11
    assert b"5:peers0:" in tr.announce(q(ih, b"b" * 20, 7002), "127.0.0.1")


def test_malformed_announce_gets_a_failure_reason():
    assert b"failure reason" in Tracker().announce(parse_announce(b"port=1"), "127.0.0.1")


def test_non_numeric_left_or_numwant_gets_a_failure_reason_not_an_error():
    tracker = Tracker()
    for bad in (
        {"left": b"lots"},
        {"numwant": b"-1"},
        {"numwant": b"1e9"},
        {"left": "\u00e9".encode()},
        {"left": b"9" * 5000},
    ):
        query = {"info_hash": b"a" * 20, "peer_id": b"p" * 20, "port": b"6881", **bad}
        assert b"failure reason" in tracker.announce(query, "127.0.0.1")
