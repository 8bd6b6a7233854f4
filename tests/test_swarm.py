"""Real libtorrent sessions on loopback: slot gates, late joiners, a peer that serves corrupt data.

Peers are connected directly (`connect_peer`), so these tests need no tracker. The corrupting peer is a
minimal BEP 3 peer written here: it claims every piece and answers each request with garbage.
"""

import os
import socket
import struct
import threading
import time

import pytest

from echo2cli.broadcast.digest import file_digest
from echo2cli.broadcast.node import GATE_STALL_S, TorrentNode, slot_priorities
from echo2cli.broadcast.torrent import make_torrent
from echo2cli.layout import WEIGHTS_FILE

SIZE = 8 << 20  # 32 pieces of 256 KiB
DEADLINE_S = 60  # generous: a hung swarm fails the test instead of hanging CI


@pytest.fixture
def version(tmp_path):
    vdir = tmp_path / "learner" / "v000001"
    vdir.mkdir(parents=True)
    (vdir / WEIGHTS_FILE).write_bytes(os.urandom(SIZE))
    return vdir, make_torrent(vdir, "http://127.0.0.1:9/announce")


def connect(node: TorrentNode, key, *others: TorrentNode) -> None:
    for other in others:
        node.transfers[key].handle.connect_peer(("127.0.0.1", other.listen_port))


def wait_until(pred, *nodes: TorrentNode) -> None:
    end = time.time() + DEADLINE_S
    while not pred():
        assert time.time() < end, "swarm made no progress before the deadline"
        for n in nodes:
            n.poll()
        time.sleep(0.05)


def test_slot_priorities_own_share_first_and_nothing_else_until_seen():
    prios = slot_priorities(10, 1, 3)
    assert [i for i, p in enumerate(prios) if p == 7] == [4, 5, 6]  # i*3//10 == 1
    assert all(p == 0 for i, p in enumerate(prios) if i not in (4, 5, 6))
    assert sum(slot_priorities(10, k, 3).count(7) for k in range(3)) == 10  # the shares cover every piece
    with pytest.raises(ValueError):
        slot_priorities(10, 3, 3)
    wide = slot_priorities(10, 1, 4, width=2)  # shares 1 and 2 of 4: i*4//10 in {1, 2}
    assert [i for i, p in enumerate(wide) if p == 7] == [3, 4, 5, 6, 7]
    with pytest.raises(ValueError):
        slot_priorities(10, 3, 4, width=2)


def test_slotted_fetchers_complete_even_when_a_share_owner_never_comes(version, tmp_path):
    vdir, torrent = version
    learner = TorrentNode("127.0.0.1:0")
    learner.seed(1, torrent.data, vdir.parent)
    # Slots 0 and 1 of 3: nobody fetches share 2, so its pieces only open after the stall timeout.
    workers = [TorrentNode("127.0.0.1:0") for _ in range(2)]
    for k, w in enumerate(workers):
        w.fetch(1, torrent.data, tmp_path / f"w{k}", slot=(k, 3, 1))
    for k, w in enumerate(workers):
        connect(w, 1, learner, workers[1 - k])
    try:
        wait_until(lambda: all(w.transfers[1].finished_at for w in workers), learner, *workers)
        for k in range(2):
            assert file_digest(tmp_path / f"w{k}" / vdir.name / WEIGHTS_FILE) == file_digest(vdir / WEIGHTS_FILE)
    finally:
        for n in (learner, *workers):
            n.close()


def spread(nodes: list[TorrentNode], key, addrs: list[str], *seeds: tuple[TorrentNode, str]) -> None:
    """Connect every fetcher in `nodes` (bound to `addrs`) to the seeds and to each other."""
    for node in nodes:
        for other, addr in [*zip(nodes, addrs, strict=True), *seeds]:
            if other is not node:
                node.transfers[key].handle.connect_peer((addr, other.listen_port))


def test_workers_holding_their_share_spare_the_learner_and_take_the_rest_from_each_other(version, tmp_path):
    """Each worker on its own loopback address, so the learner's connection can be told apart: once a worker holds
    its own share it takes nothing more from the learner, which then sends about one copy in all."""
    vdir, torrent = version
    learner = TorrentNode("127.0.0.2:0", upload_limit_bytes_s=2 << 20)  # slow, so that workers trade
    learner.seed(1, torrent.data, vdir.parent)
    addrs = ["127.0.0.3", "127.0.0.4", "127.0.0.5"]
    workers = [TorrentNode(f"{a}:0", learner_ip="127.0.0.2") for a in addrs]
    for k, w in enumerate(workers):
        w.fetch(1, torrent.data, tmp_path / f"w{k}", slot=(k, 3, 1))
    spread(workers, 1, addrs, (learner, "127.0.0.2"))
    spared = set()

    def done() -> bool:
        spared.update(k for k, w in enumerate(workers) if not w.transfers[1].needs_learner)
        return all(w.transfers[1].finished_at for w in workers)

    try:
        wait_until(done, learner, *workers)
        for k in range(3):
            assert file_digest(tmp_path / f"w{k}" / vdir.name / WEIGHTS_FILE) == file_digest(vdir / WEIGHTS_FILE)
        # upload counters are folded in once a second: wait until they account for the three copies received
        wait_until(lambda: sum(n.upload_bytes(1) for n in (learner, *workers)) >= 3 * SIZE, learner, *workers)
        assert spared  # the worker whose share arrives last may finish with it
        assert learner.upload_bytes(1) < 1.2 * SIZE
    finally:
        for n in (learner, *workers):
            n.close()


def test_a_worker_sparing_the_learner_takes_from_it_again_when_a_share_owner_never_comes(version, tmp_path):
    """Worker a holds its share and spares the learner; the owner of the other share, b, gets (almost) nothing:
    a's download stalls, and a takes the rest from the learner after all."""
    vdir, torrent = version
    learner = TorrentNode("127.0.0.2:0")
    learner.seed(1, torrent.data, vdir.parent)
    a = TorrentNode("127.0.0.3:0", learner_ip="127.0.0.2")
    b = TorrentNode("127.0.0.4:0", learner_ip="127.0.0.2", download_limit_bytes_s=1)
    for k, w in enumerate((a, b)):
        w.fetch(1, torrent.data, tmp_path / f"w{k}", slot=(k, 2, 1))
    spread([a, b], 1, ["127.0.0.3", "127.0.0.4"], (learner, "127.0.0.2"))
    spared = []

    def done() -> bool:
        if not a.transfers[1].needs_learner and not spared:
            spared.append(time.time())
        return a.transfers[1].finished_at is not None

    try:
        wait_until(done, learner, a, b)
        assert spared and a.transfers[1].needs_learner  # spared, then released after the stall
        assert a.transfers[1].finished_at - spared[0] >= GATE_STALL_S
        assert file_digest(tmp_path / "w0" / vdir.name / WEIGHTS_FILE) == file_digest(vdir / WEIGHTS_FILE)
    finally:
        for n in (learner, a, b):
            n.close()


def test_late_joiner_takes_the_version_mostly_from_other_workers(version, tmp_path):
    vdir, torrent = version
    learner = TorrentNode("127.0.0.1:0", upload_limit_bytes_s=1 << 20)  # 1 MiB/s: a slow uplink
    learner.seed(1, torrent.data, vdir.parent)
    early = TorrentNode("127.0.0.1:0")  # a worker that already holds the version
    early.seed(1, torrent.data, vdir.parent)
    late = TorrentNode("127.0.0.1:0")
    late.fetch(1, torrent.data, tmp_path / "late")
    connect(late, 1, learner, early)
    try:
        wait_until(lambda: late.transfers[1].finished_at is not None, learner, early, late)
        assert file_digest(tmp_path / "late" / vdir.name / WEIGHTS_FILE) == file_digest(vdir / WEIGHTS_FILE)
        # upload counters are folded in once a second: wait until they account for the copy received
        wait_until(lambda: learner.upload_bytes(1) + early.upload_bytes(1) >= SIZE, learner, early, late)
        assert learner.upload_bytes(1) < 0.5 * SIZE < early.upload_bytes(1)
    finally:
        for n in (learner, early, late):
            n.close()


class CorruptPeer:
    """Speaks just enough BEP 3 to offer every piece, then serves random bytes for every request."""

    def __init__(self, num_pieces: int) -> None:
        self.num_pieces = num_pieces
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.blocks_sent = 0
        self.disconnected = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _recv(self, conn, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError
            buf += chunk
        return buf

    def _send(self, conn, msg_id: int, payload: bytes = b"") -> None:
        conn.sendall(struct.pack(">IB", 1 + len(payload), msg_id) + payload)

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        try:
            hello = self._recv(conn, 68)  # the leecher's handshake; answer for the info-hash it asked for
            conn.sendall(b"\x13BitTorrent protocol" + b"\0" * 8 + hello[28:48] + b"-XX0001-corruptpeer!")
            bits = bytearray((self.num_pieces + 7) // 8)
            for i in range(self.num_pieces):
                bits[i // 8] |= 0x80 >> (i % 8)
            self._send(conn, 5, bytes(bits))  # bitfield: every piece
            self._send(conn, 1)  # unchoke
            while True:
                (length,) = struct.unpack(">I", self._recv(conn, 4))
                if length == 0:
                    continue  # keep-alive
                msg = self._recv(conn, length)
                if msg[0] == 6:  # request: index, begin, length
                    index, begin, size = struct.unpack(">III", msg[1:13])
                    self._send(conn, 7, struct.pack(">II", index, begin) + os.urandom(size))
                    self.blocks_sent += 1
        except (ConnectionError, OSError):
            self.disconnected.set()


def test_a_peer_serving_corrupt_pieces_is_banned_and_the_version_still_arrives_intact(version, tmp_path):
    import libtorrent as lt

    vdir, torrent = version
    info = lt.torrent_info(torrent.data)
    bad = CorruptPeer(info.num_pieces())
    worker = TorrentNode("127.0.0.1:0")
    # The fake peer speaks plain BEP 3; libtorrent would first try an obfuscated (MSE) handshake.
    worker.session.apply_settings({"out_enc_policy": int(lt.enc_policy.disabled)})
    worker.fetch(1, torrent.data, tmp_path / "w")
    worker.transfers[1].handle.connect_peer(("127.0.0.1", bad.port))
    good = TorrentNode("127.0.0.1:0")
    try:
        wait_until(lambda: worker.transfers[1].hash_failures > 0 and bad.disconnected.is_set(), worker)
        assert worker.transfers[1].finished_at is None  # nothing from the bad peer was accepted
        assert worker.transfers[1].handle.status().num_pieces == 0
        good.seed(1, torrent.data, vdir.parent)
        connect(worker, 1, good)
        wait_until(lambda: worker.transfers[1].finished_at is not None, worker, good)
        assert file_digest(tmp_path / "w" / vdir.name / WEIGHTS_FILE) == file_digest(vdir / WEIGHTS_FILE)
    finally:
        worker.close()
        good.close()


def bdecode(data: bytes, i: int = 0):
    """A plain BEP 3 decoder, independent of libtorrent: (value, next index)."""
    c = data[i : i + 1]
    if c == b"i":
        end = data.index(b"e", i)
        return int(data[i + 1 : end]), end + 1
    if c in (b"l", b"d"):
        items, i = [], i + 1
        while data[i : i + 1] != b"e":
            value, i = bdecode(data, i)
            items.append(value)
        return (items if c == b"l" else dict(zip(items[::2], items[1::2], strict=True))), i + 1
    colon = data.index(b":", i)
    n = int(data[i:colon])
    return data[colon + 1 : colon + 1 + n], colon + 1 + n


def test_version_torrent_is_a_plain_bep3_torrent(version):
    """Any ordinary client can fetch a version: check the metainfo by the spec, not by libtorrent. v1 only:
    a hybrid (BEP 52) torrent made stock clients such as aria2c announce under another info-hash."""
    import hashlib

    from echo2cli.broadcast.tracker import bencode

    vdir, torrent = version
    meta, end = bdecode(torrent.data)
    assert end == len(torrent.data)
    assert meta[b"announce"] == b"http://127.0.0.1:9/announce"
    info = meta[b"info"]
    assert hashlib.sha1(bencode(info)).hexdigest() == torrent.info_hash  # BEP 3 info-hash
    assert info[b"private"] == 1 and b"meta version" not in info and b"file tree" not in info  # BEP 27, no v2
    assert [f[b"path"] for f in info[b"files"]] == [[WEIGHTS_FILE.encode()]]  # no padding files either
    piece_len, data = info[b"piece length"], (vdir / WEIGHTS_FILE).read_bytes()
    hashes = [hashlib.sha1(data[i : i + piece_len]).digest() for i in range(0, len(data), piece_len)]
    assert info[b"pieces"] == b"".join(hashes)  # BEP 3 v1 piece hashes over the file


def test_a_node_with_a_tracker_key_announces_to_its_own_url(version, tmp_path):
    vdir, torrent = version
    node = TorrentNode("127.0.0.1:0", tracker_key="k3y")
    try:
        transfer = node.seed(1, torrent.data, vdir.parent)
        assert [t["url"] for t in transfer.handle.trackers()] == ["http://127.0.0.1:9/announce/k3y"]
    finally:
        node.close()


@pytest.mark.parametrize("size", [339, 3 * (256 << 10) + 5])  # a small delta's size (one block); three pieces
def test_a_download_is_complete_only_once_libtorrent_has_written_every_byte(tmp_path, size):
    """Regression: libtorrent verifies pieces from its store buffer and reported a 339-byte delta seeding before
    its file existed; the worker's rebuild then read a missing file. `finished_at` now waits for the flush."""
    vdir = tmp_path / "learner" / "v000002.delta"
    vdir.mkdir(parents=True)
    data = os.urandom(size)
    (vdir / "model.delta").write_bytes(data)
    torrent = make_torrent(vdir, "http://127.0.0.1:9/announce")
    learner, worker = TorrentNode("127.0.0.1:0"), TorrentNode("127.0.0.1:0")
    try:
        learner.seed(2, torrent.data, vdir.parent)
        worker.fetch(2, torrent.data, tmp_path / "w")
        connect(worker, 2, learner)
        done = worker.transfers[2]

        def complete() -> bool:
            if done.finished_at is None:
                return False
            assert (tmp_path / "w" / vdir.name / "model.delta").read_bytes() == data  # at once, in full
            return True

        wait_until(complete, learner, worker)
        assert done.flushed  # libtorrent's word, not the fallback on file sizes
    finally:
        learner.close()
        worker.close()
