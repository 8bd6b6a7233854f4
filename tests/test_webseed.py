"""The learner's web seed (BEP 19): who may read it, what it serves, and real libtorrent fetches through it.

The fetch tests run a real uvicorn server with the learner's app and real libtorrent sessions on loopback.
The worker's node can reach no BitTorrent peer (the torrent's tracker is a closed port and nobody connects to
it), so every byte it gets comes from the web seed.

The lane tests (webseed.py's "own lane": stream limits, a reader that stops reading, the API beside 60 capped
streams) use raw sockets against a real uvicorn where a stream must really be held open; they assert no timings.
"""

import builtins
import os
import socket
import time

import httpx
import libtorrent as lt
import pytest
from conftest import make_coord
from fastapi.testclient import TestClient

from echo2cli import __version__
from echo2cli.broadcast import node as node_module
from echo2cli.broadcast import webseed as webseed_module
from echo2cli.broadcast.digest import file_digest
from echo2cli.broadcast.node import TorrentNode
from echo2cli.broadcast.torrent import make_torrent
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


def test_streams_cancelled_while_they_wait_for_the_upload_cap_have_booked_none_of_it():
    """63 requests that close once they have their headers once booked 63 chunks of the capped uplink before their
    sleeps were cancelled, and the next honest range waited out all of them (16.7 s instead of 0.20 s). The cap
    here sends one chunk in 100 s: whatever the box's speed, the waiters are cancelled long before their turn."""
    import anyio

    bucket = webseed_module.TokenBucket(webseed_module.CHUNK / 100)

    async def main() -> float:
        await bucket.take_async(webseed_module.CHUNK)  # a stream sending: the cap is busy for 100 s
        async with anyio.create_task_group() as tasks:
            for _ in range(63):
                tasks.start_soon(bucket.take_async, webseed_module.CHUNK)
            await anyio.sleep(0.05)
            tasks.cancel_scope.cancel()  # the clients are gone
        return bucket.next_free - time.monotonic()

    assert anyio.run(main) <= 100  # the sending stream's chunk alone, not 64 of them


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


def learner_app(clock, tmp_path, web_seed: WebSeed | None):
    coord = make_coord(clock)
    coord.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=0)
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


def join_worker(http, name: str = "w") -> dict:
    """The JoinResponse of a new worker (its id, session token and tracker key)."""
    r = http.post(
        "/v1/join", json={"name": name, "echo2_version": __version__}, headers={"Authorization": "Bearer s3cret"}
    )
    return r.json()


def join(http) -> str:
    return join_worker(http)["tracker_key"]


def serve_files(root, *seeded: VersionKey, **limits) -> WebSeed:
    """A web seed of `seeded` under `root`; `limits`: WebSeed's keywords (rate, stream limits, send timeout)."""

    def resolve(dir_name, file_name):
        key = VersionKey.from_relpath(dir_name, file_name)
        return (key, key.path(root)) if key in seeded else None

    return WebSeed(resolve, **limits)


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
    web_seed.close()


@pytest.fixture
def learner_server(clock, tmp_path):
    """`start(web_seed)` serves the learner's app on a loopback port; returns (url, tracker key of a worker)."""
    with_server = []

    def start(web_seed: WebSeed) -> tuple[str, str]:
        app, _ = learner_app(clock, tmp_path, web_seed)
        sock = bind_socket("127.0.0.1", 0)
        ctx = serving(app, sock)
        ctx.__enter__()
        with_server.append((ctx, web_seed))
        return f"http://127.0.0.1:{sock.getsockname()[1]}", join(TestClient(app))

    yield start
    for ctx, web_seed in with_server:
        ctx.__exit__(None, None, None)
        web_seed.close()


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
        assert file_digest(key.path(tmp_path / "worker")) == file_digest(key.path(root))
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
        assert file_digest(key.path(tmp_path / "worker")) == file_digest(key.path(root))
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


def test_past_its_stream_limit_a_worker_gets_429_and_past_the_total_everyone_does(clock, tmp_path, version):
    root, key, _ = version
    web_seed = serve_files(root, key, streams_per_worker=2, max_streams=3)
    app, _ = learner_app(clock, tmp_path, web_seed)
    http = TestClient(app)
    a, b = join(http), join(http)
    url = "/webseed/{}/v000001/model.safetensors"
    try:
        web_seed.slots.acquire(a)  # two of a's streams in flight
        web_seed.slots.acquire(a)
        r = http.get(url.format(a), headers={"Range": "bytes=0-9"})
        assert r.status_code == 429 and r.json()["detail"] == (
            "2 web seed streams already open for this worker: ask again later"
        )
        assert http.get(url.format(b), headers={"Range": "bytes=0-9"}).status_code == 206  # b has room
        web_seed.slots.acquire(b)  # 3 in all
        r = http.get(url.format(b), headers={"Range": "bytes=0-9"})
        assert r.status_code == 429 and r.json()["detail"] == "3 web seed streams already open: ask again later"
        for who in (a, a, b):
            web_seed.slots.release(who)
        assert http.get(url.format(a), headers={"Range": "bytes=0-9"}).status_code == 206
        assert web_seed.open_streams() == 0  # a finished stream gives its slot back
        assert web_seed.sent(key) == 20  # refusals send nothing
    finally:
        web_seed.close()


def test_one_address_holds_at_most_its_share_of_the_web_seeds_streams_whatever_its_joins(clock, tmp_path, version):
    """One token holder joined 16 times (4 streams each) and held all 64 streams: every honest stream got 429."""
    root, key, _ = version
    web_seed = serve_files(root, key, streams_per_worker=2, max_streams=10, streams_per_address=3)
    app, _ = learner_app(clock, tmp_path, web_seed)
    http, elsewhere = TestClient(app), TestClient(app, client=("10.0.0.2", 50000))
    a, b, c = join(http), join(http), join(elsewhere)
    url = "/webseed/{}/v000001/model.safetensors"
    try:
        for who in (a, a, b):  # three streams in flight from the one address, two joins
            web_seed.slots.acquire(who, "testclient")
        r = http.get(url.format(b), headers={"Range": "bytes=0-9"})
        assert r.status_code == 429 and r.json()["detail"] == (
            "3 web seed streams already open from testclient: ask again later"
        )
        assert elsewhere.get(url.format(c), headers={"Range": "bytes=0-9"}).status_code == 206
        for who in (a, a, b):
            web_seed.slots.release(who, "testclient")
        assert http.get(url.format(b), headers={"Range": "bytes=0-9"}).status_code == 206
        assert web_seed.open_streams() == 0
    finally:
        web_seed.close()


def test_a_file_pruned_right_after_it_was_opened_is_still_served_and_closed(clock, tmp_path, version, monkeypatch):
    """The learner prunes old versions while a stream may be opening one: the size comes from the open file."""
    root, key, _ = version
    data = key.path(root).read_bytes()
    opened = []

    def open_then_prune(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        opened.append(f)
        os.unlink(path)
        return f

    monkeypatch.setattr(webseed_module, "open", open_then_prune, raising=False)
    web_seed = serve_files(root, key)
    app, _ = learner_app(clock, tmp_path, web_seed)
    http = TestClient(app, raise_server_exceptions=False)
    try:
        r = http.get(f"/webseed/{join(http)}/v000001/model.safetensors", headers={"Range": "bytes=10-"})
        assert r.status_code == 206 and r.content == data[10:]
        assert len(opened) == 1 and opened[0].closed
        r = http.get(f"/webseed/{join(http)}/v000001/model.safetensors")
        assert r.status_code == 404  # gone before the open: not seeded now
        assert web_seed.open_streams() == 0
    finally:
        web_seed.close()


def raw_get(port: int, path: str) -> socket.socket:
    """A client that sends one GET and then reads nothing: its receive buffer kept as small as the kernel allows."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: learner\r\n\r\n".encode())
    return sock


def status_line(sock: socket.socket, deadline: float) -> bytes:
    """The response's status line, or b"" if none came before `deadline` (time.monotonic())."""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        return sock.recv(64).split(b"\r\n", 1)[0]
    except TimeoutError:
        return b""


def test_a_reader_that_stops_reading_is_cut_after_the_send_timeout(clock, tmp_path, learner_server, monkeypatch):
    root, key = tmp_path / "big", VersionKey(1)
    key.path(root).parent.mkdir(parents=True)
    size = 32 << 20  # far more than loopback's socket buffers hold
    key.path(root).write_bytes(os.urandom(size))
    opened = []

    def recording_open(path, mode="r", *args, **kwargs):
        opened.append(builtins.open(path, mode, *args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(webseed_module, "open", recording_open, raising=False)
    web_seed = serve_files(root, key, send_timeout_s=0.5)
    url, tracker_key = learner_server(web_seed)
    port = int(url.rsplit(":", 1)[1])
    reader = raw_get(port, f"/webseed/{tracker_key}/v000001/model.safetensors")
    try:
        assert wait_until(lambda: web_seed.open_streams() == 1), "the stream never opened"
        assert wait_until(lambda: web_seed.open_streams() == 0), "the stalled stream was never cut"
        assert len(opened) == 1 and opened[0].closed
        received, reader_deadline = 0, time.monotonic() + DEADLINE_S
        reader.settimeout(DEADLINE_S)
        while chunk := reader.recv(1 << 20):  # what was buffered, then the end: the server closed it
            received += len(chunk)
            assert time.monotonic() < reader_deadline
        assert 0 < received < size
    finally:
        reader.close()


def test_heartbeats_and_leases_go_through_while_60_capped_web_seed_streams_are_open(clock, tmp_path, version):
    """The web seed is paced by its byte-rate cap. Paced in the API's handler threads (40), 60 open streams
    left no thread for a heartbeat; in its own lane they take none."""
    root, key, _ = version
    # 1 KiB/s: every stream waits its turn for hours; all of them from loopback, so no per-address cap here
    web_seed = serve_files(root, key, rate_bytes_s=1024, streams_per_address=64)
    app, _ = learner_app(clock, tmp_path, web_seed)
    http = TestClient(app)
    streaming = [join_worker(http, f"s{i}")["tracker_key"] for i in range(15)]  # 4 streams each
    other = join_worker(http, "other")
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    readers: list[socket.socket] = []
    try:
        with serving(app, sock), httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S / 4) as api:
            readers = [
                raw_get(port, f"/webseed/{tracker_key}/v000001/model.safetensors")
                for tracker_key in streaming
                for _ in range(4)
            ]
            deadline = time.monotonic() + DEADLINE_S / 4
            answers = [status_line(r, deadline) for r in readers]

            auth = {"Authorization": f"Bearer {other['session_token']}"}
            hb = api.post("/v1/heartbeat", json={"worker_id": other["worker_id"], "version_loaded": 0}, headers=auth)
            assert hb.status_code == 200
            lease = api.post("/v1/lease", json={"worker_id": other["worker_id"], "version": 0}, headers=auth)
            assert lease.status_code == 200

            assert answers == [b"HTTP/1.1 200 OK"] * 60
            assert web_seed.open_streams() == 60
            fifth = api.get(f"/webseed/{streaming[0]}/v000001/model.safetensors")
            assert fifth.status_code == 429
            for r in readers:
                r.close()
            assert wait_until(lambda: web_seed.open_streams() == 0), "streams outlived their clients"
    finally:
        for r in readers:
            r.close()
        web_seed.close()
