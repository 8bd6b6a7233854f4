"""The learner's web seed (BEP 19): who may read it, what it serves, and real libtorrent fetches through it.

The fetch tests run a real uvicorn server with the learner's app and real libtorrent sessions on loopback.
The worker's node can reach no BitTorrent peer (the torrent's tracker is a closed port and nobody connects to
it), so every byte it gets comes from the web seed.
"""

import hashlib
import os
import time

import libtorrent as lt
import pytest
from conftest import make_coord
from fastapi.testclient import TestClient

from echo2cli import __version__
from echo2cli.broadcast import node as node_module
from echo2cli.broadcast.node import TorrentNode
from echo2cli.broadcast.torrent import make_torrent, sha256_file
from echo2cli.broadcast.webseed import RangeError, WebSeed, parse_range
from echo2cli.layout import VersionKey
from echo2cli.learner.server import bind_socket, build_app, serving
from echo2cli.protocol import PolicyInfo

SIZE = 6 << 20
JOIN_INFO = dict(task="arithmetic", group_size=2, max_new_tokens=8, temperature=1.0, staleness=1, heartbeat_s=2.0)
JOIN_INFO["model_files"] = []
DEADLINE_S = 60


def test_parse_range_takes_one_byte_range_and_refuses_the_rest():
    assert parse_range(None, 100) == (0, 100)
    assert parse_range("bytes=0-99", 100) == (0, 100)
    assert parse_range("bytes=10-19", 100) == (10, 10)
    assert parse_range("bytes=90-", 100) == (90, 10)
    assert parse_range("bytes=90-1000", 100) == (90, 10)  # clipped to the file, as HTTP says
    for bad in ("bytes=100-", "bytes=5-4", "bytes=0-1,5-6", "items=0-1", "bytes=-5", "bytes=" + "9" * 30 + "-"):
        with pytest.raises(RangeError):
            parse_range(bad, 100)


def test_version_key_from_relpath_accepts_only_the_layouts_own_names():
    assert VersionKey.from_relpath("v000007", "model.safetensors") == VersionKey(7)
    assert VersionKey.from_relpath("v000007.delta", "model.delta") == VersionKey(7, delta=True)
    for dir_name, file_name in [
        ("v000007", "model.delta"),
        ("v7", "model.safetensors"),
        ("..", "model.safetensors"),
        ("v000007", "../../etc/passwd"),
        ("v\uff10\uff10\uff10\uff10\uff10\uff17", "model.safetensors"),  # fullwidth digits
    ]:
        assert VersionKey.from_relpath(dir_name, file_name) is None


@pytest.fixture
def version(tmp_path):
    root = tmp_path / "learner"
    key = VersionKey(1)
    key.path(root).parent.mkdir(parents=True)
    key.path(root).write_bytes(os.urandom(SIZE))
    return root, key, make_torrent(key.dir(root), "http://127.0.0.1:9/announce")


def learner_app(clock, tmp_path, web_seed: WebSeed):
    coord = make_coord(clock)
    coord.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", sha256="cd" * 32, size_bytes=1, published_at=0)
    )
    app = build_app(
        coord,
        run_id="r",
        join_info=JOIN_INFO,
        model_dir=tmp_path,
        model_files=[],
        token="s3cret",
        status_extra=dict,
        target_steps=3,
        web_seed=web_seed,
    )
    return app, coord


def join(http) -> str:
    info = http.post(
        "/v1/join", json={"name": "w", "echo2_version": __version__}, headers={"Authorization": "Bearer s3cret"}
    ).json()
    return info["tracker_key"]


def serve_files(root, *seeded: VersionKey) -> WebSeed:
    def resolve(dir_name, file_name):
        key = VersionKey.from_relpath(dir_name, file_name)
        return (key, key.path(root)) if key in seeded else None

    return WebSeed(resolve)


def test_web_seed_serves_joined_workers_byte_ranges_of_seeded_versions_only(clock, tmp_path, version):
    root, key, _ = version
    web_seed = serve_files(root, key)
    app, _ = learner_app(clock, tmp_path, web_seed)
    http = TestClient(app)
    tracker_key = join(http)
    data = key.path(root).read_bytes()

    r = http.get(f"/webseed/{tracker_key}/v000001/model.safetensors", headers={"Range": "bytes=100-199"})
    assert r.status_code == 206 and r.content == data[100:200]
    assert r.headers["content-range"] == f"bytes 100-199/{SIZE}"
    assert http.get(f"/webseed/{tracker_key}/v000001/model.safetensors").content == data
    assert web_seed.sent(key) == 100 + SIZE

    assert http.get("/webseed/not-a-key/v000001/model.safetensors").status_code == 401
    assert http.get(f"/webseed/{tracker_key}/v000002/model.safetensors").status_code == 404  # not seeded
    assert http.get(f"/webseed/{tracker_key}/v000001/model.delta").status_code == 404
    assert http.get(f"/webseed/{tracker_key}/v000001/%2e%2e%2fconfig.json").status_code == 404
    r = http.get(f"/webseed/{tracker_key}/v000001/model.safetensors", headers={"Range": f"bytes={SIZE}-"})
    assert r.status_code == 416 and "outside" in r.json()["detail"]
    assert web_seed.sent(key) == 100 + SIZE  # refusals send nothing


@pytest.fixture
def learner_server(clock, tmp_path):
    """`start(web_seed)` serves the learner's app on a loopback port; returns (url, tracker key of a worker)."""
    with_server = []

    def start(web_seed: WebSeed) -> tuple[str, str]:
        app, _ = learner_app(clock, tmp_path, web_seed)
        sock = bind_socket("127.0.0.1", 0)
        ctx = serving(app, sock)
        ctx.__enter__()
        with_server.append(ctx)
        return f"http://127.0.0.1:{sock.getsockname()[1]}", join(TestClient(app))

    yield start
    for ctx in with_server:
        ctx.__exit__(None, None, None)


def wait_until(pred, *nodes: TorrentNode, deadline_s: float = DEADLINE_S) -> bool:
    end = time.time() + deadline_s
    while not pred():
        if time.time() > end:
            return False
        for n in nodes:
            n.poll()
        time.sleep(0.05)
    return True


def test_a_worker_no_peer_can_reach_gets_the_version_from_the_web_seed(version, tmp_path, learner_server, monkeypatch):
    monkeypatch.setattr(node_module, "WEB_SEED_AFTER_S", 0.5)
    root, key, torrent = version
    web_seed = serve_files(root, key)
    url, tracker_key = learner_server(web_seed)
    worker = TorrentNode("127.0.0.1:0", tracker_key=tracker_key, web_seed=url)
    try:
        transfer = worker.fetch(key, torrent.data, tmp_path / "worker", slot=(0, 2, 1))
        assert transfer.web_seed_at is None  # not before the download stalls
        assert wait_until(lambda: transfer.finished_at is not None, worker), "the web seed never delivered"
        assert transfer.web_seed_at is not None
        assert sha256_file(key.path(tmp_path / "worker")) == sha256_file(key.path(root))
        assert web_seed.sent(key) >= SIZE  # counted as the learner's upload
    finally:
        worker.close()


def test_web_seed_bytes_are_verified_like_any_piece(version, tmp_path, learner_server, monkeypatch):
    """A web seed (or a man in the middle of plain HTTP) sending a corrupt piece: libtorrent's SHA-1 check
    rejects it, the version is not complete, and a good seed then completes it intact."""
    monkeypatch.setattr(node_module, "WEB_SEED_AFTER_S", 0.2)
    root, key, torrent = version
    bad_root = tmp_path / "tampered"
    bad = bytearray(key.path(root).read_bytes())
    piece_len = lt.torrent_info(torrent.data).piece_length()
    bad[3 * piece_len + 17] ^= 0xFF  # one byte of piece 3
    key.path(bad_root).parent.mkdir(parents=True)
    key.path(bad_root).write_bytes(bytes(bad))
    url, tracker_key = learner_server(serve_files(bad_root, key))
    worker = TorrentNode("127.0.0.1:0", tracker_key=tracker_key, web_seed=url)
    seed = TorrentNode("127.0.0.1:0")
    try:
        transfer = worker.fetch(key, torrent.data, tmp_path / "worker")
        assert wait_until(lambda: transfer.hash_failures > 0, worker), "the corrupt piece was never checked"
        assert transfer.finished_at is None and not transfer.handle.status().pieces[3]
        seed.seed(key, torrent.data, root)
        transfer.handle.connect_peer(("127.0.0.1", seed.listen_port))
        assert wait_until(lambda: transfer.finished_at is not None, worker, seed)
        got = hashlib.sha256(key.path(tmp_path / "worker").read_bytes()).hexdigest()
        assert got == sha256_file(key.path(root))
    finally:
        worker.close()
        seed.close()


def test_web_seed_off_never_asks_and_always_asks_at_once(version, tmp_path, learner_server, monkeypatch):
    monkeypatch.setattr(node_module, "WEB_SEED_AFTER_S", 0.2)
    root, key, torrent = version
    url, tracker_key = learner_server(serve_files(root, key))
    off = TorrentNode("127.0.0.1:0", tracker_key=tracker_key, web_seed=url, web_seed_mode="off")
    always = TorrentNode("127.0.0.1:0", tracker_key=tracker_key, web_seed=url, web_seed_mode="always")
    try:
        t_off = off.fetch(key, torrent.data, tmp_path / "off")
        t_always = always.fetch(key, torrent.data, tmp_path / "always")
        assert t_always.web_seed_at is not None
        assert wait_until(lambda: t_always.finished_at is not None, always)
        assert not wait_until(lambda: t_off.finished_at is not None, off, deadline_s=2.0)
        assert t_off.web_seed_at is None and off.download_bytes(key) == 0
        with pytest.raises(ValueError, match="fallback, always or off"):
            TorrentNode("127.0.0.1:0", web_seed_mode="sometimes")
    finally:
        off.close()
        always.close()


def test_a_worker_that_joins_again_asks_the_web_seed_with_its_new_key(version, tmp_path, learner_server, monkeypatch):
    monkeypatch.setattr(node_module, "WEB_SEED_AFTER_S", 0.2)
    root, key, torrent = version
    url, tracker_key = learner_server(serve_files(root, key))
    worker = TorrentNode("127.0.0.1:0", tracker_key="stale-key", web_seed=url)
    try:
        transfer = worker.fetch(key, torrent.data, tmp_path / "worker")
        assert not wait_until(lambda: transfer.finished_at is not None, worker, deadline_s=2.0)  # 401s
        assert transfer.web_seed_at is not None
        worker.set_tracker_key(tracker_key)
        assert tracker_key in transfer.web_seed_url
        assert wait_until(lambda: transfer.finished_at is not None, worker)
    finally:
        worker.close()
