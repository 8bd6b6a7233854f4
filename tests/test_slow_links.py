"""A late joiner on a slow link: it finishes the version it fetches (unless the download stalls), the learner
keeps seeding that version past S + 1 while it does, and it does not hold up T_bcast for the others.

Unit tests of the pure rules: a fake clock, a fake torrent node, real .torrent files (no peers, no sockets).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from conftest import make_coord

from echo2cli.broadcast.digest import file_digest
from echo2cli.broadcast.torrent import make_torrent
from echo2cli.learner.publisher import MAX_HELD_FOR_DOWNLOADS, Publisher
from echo2cli.protocol import Heartbeat, LoraSpec, PolicyInfo
from echo2cli.worker import versions
from echo2cli.worker.versions import VersionStore


def policy(version: int, at: float = 0.0) -> PolicyInfo:
    return PolicyInfo(
        version=version, info_hash="ab" * 20, torrent_b64="eA==", digest="cd" * 32, size_bytes=1, published_at=at
    )


def test_a_worker_handed_a_version_counts_as_fetching_it_until_its_heartbeat_says_otherwise(clock):
    coord = make_coord(clock)
    coord.publish(policy(0))
    late = coord.join("late", 0.0)
    coord.latest_policy(late)  # what /v1/join and /v1/policy hand out
    assert coord.versions_in_download() == {0}
    coord.heartbeat(Heartbeat(worker_id=late, version_loaded=0))
    assert coord.versions_in_download() == set()


def test_a_late_joiner_still_fetching_its_first_version_does_not_hold_up_t_bcast(clock):
    coord = make_coord(clock)
    coord.publish(policy(0, at=clock()))
    a = coord.join("a", 0.0)
    coord.heartbeat(Heartbeat(worker_id=a, version_loaded=0))
    clock(5)
    coord.publish(policy(1, at=clock()))
    late = coord.join("late", 0.0)
    coord.latest_policy(late)
    clock(3)
    coord.heartbeat(Heartbeat(worker_id=a, version_loaded=1))
    coord.heartbeat(Heartbeat(worker_id=late, version_loaded=-1, downloading_version=1, download_progress=0.2))
    assert 1 in coord.update_bcast()
    assert coord.published.bcast_s[1] == 3.0


class FakeNode:
    """What the publisher and the worker call on a TorrentNode, recorded."""

    def __init__(self) -> None:
        self.transfers: dict = {}
        self.removed: list = []
        self.deleted: list = []  # the keys whose directory went with them
        self.fetched: list = []
        self.bytes = 0

    def remove(self, key, delete_dir=None) -> None:
        self.transfers.pop(key, None)
        self.removed.append(key.version)  # the version, full or delta
        self.deleted.extend([key] if delete_dir is not None else [])

    def fetch(self, key, data, save_path, slot=None):
        self.fetched.append(key.version)
        self.transfers[key] = SimpleNamespace(finished_at=None)
        return self.transfers[key]

    def download_bytes(self, key) -> int:
        return self.bytes


FULL_WEIGHTS = SimpleNamespace(lora=None)  # what the publisher asks of a trainer when it prunes


def test_the_publisher_keeps_seeding_old_versions_that_workers_still_fetch(tmp_path):
    wanted: set[int] = {1}
    coord = SimpleNamespace(versions_in_download=lambda: wanted)
    pub = Publisher(FULL_WEIGHTS, FakeNode(), coord, tmp_path, "http://t/announce", keep=2)
    pub.sizes, pub.hashes = {v: 1 for v in range(8)}, {v: "x" for v in range(8)}
    pub._prune(7)
    assert sorted(pub.sizes) == [1, 5, 6, 7]
    wanted.clear()
    pub._prune(7)
    assert sorted(pub.sizes) == [5, 6, 7]


def test_versions_held_for_downloads_are_bounded(tmp_path):
    coord = SimpleNamespace(versions_in_download=lambda: set(range(20)))
    pub = Publisher(FULL_WEIGHTS, FakeNode(), coord, tmp_path, "http://t/announce", keep=2)
    pub.sizes, pub.hashes = {v: 1 for v in range(20)}, {v: "x" for v in range(20)}
    pub._prune(19)
    assert len([v for v in pub.sizes if v < 17]) == MAX_HELD_FOR_DOWNLOADS


def test_every_nth_full_version_stays_on_disk_when_it_is_no_longer_seeded(tmp_path):
    """--keep-versions-every 3: versions 0, 3 and 6 are dropped from the swarm but their files stay (for `echo2
    eval --run RUN --version 3,6`); their deltas, and the other versions, go."""
    node = FakeNode()
    pub = Publisher(FULL_WEIGHTS, node, SimpleNamespace(versions_in_download=set), tmp_path, "t", keep=2, keep_every=3)
    pub.sizes, pub.hashes = {v: 1 for v in range(10)}, {v: "x" for v in range(10)}
    pub._prune(9)
    assert sorted(pub.sizes) == [7, 8, 9] and sorted(set(node.removed)) == list(range(7))
    assert sorted((k.version, k.delta) for k in node.deleted) == [
        (v, delta) for v in range(7) for delta in (False, True) if delta or v % 3
    ]


def real_policy(tmp_path, version: int) -> PolicyInfo:
    vdir = tmp_path / "published" / f"v{version:06d}"
    vdir.mkdir(parents=True)
    (vdir / "model.safetensors").write_bytes(os.urandom(1 << 16))
    torrent = make_torrent(vdir, "http://127.0.0.1:9/announce")
    return PolicyInfo(
        version=version,
        info_hash=torrent.info_hash,
        torrent_b64=torrent.b64,
        digest=file_digest(vdir / "model.safetensors"),
        size_bytes=1 << 16,
        published_at=0.0,
    )


def fetching_store(tmp_path) -> VersionStore:
    return VersionStore(FakeNode(), tmp_path / "w" / "versions", events=None, log=lambda line: None)


def test_a_download_in_progress_is_finished_before_a_newer_version_is_fetched(tmp_path):
    store, newest = fetching_store(tmp_path), real_policy(tmp_path, 3)
    store.start(real_policy(tmp_path, 1))
    store.node.bytes = 1000
    store.follow(3, lambda: newest)  # a heartbeat announces version 3 while version 1 is a third done
    assert store.pending.policy.version == 1
    assert store.node.fetched == [1] and store.node.removed == []


def test_a_stalled_download_gives_way_to_the_newest_version(tmp_path):
    store, newest = fetching_store(tmp_path), real_policy(tmp_path, 3)
    store.start(real_policy(tmp_path, 1))
    store.pending.progress = (0, time.monotonic() - versions.FETCH_STALL_S - 1)  # no byte for longer than the limit
    store.follow(3, lambda: newest)
    assert store.pending.policy.version == 3
    assert store.node.fetched == [1, 3] and 1 in store.node.removed


def test_a_version_announced_ahead_of_the_newest_one_does_not_refetch_what_is_loaded(tmp_path):
    # The learner names the version it trains while the newest it can hand out is older (still being written,
    # or a learner that lies): the worker must not fetch and reload the version it already runs, over and over.
    store, current = fetching_store(tmp_path), real_policy(tmp_path, 2)
    store.loaded = 2
    store.follow(3, lambda: current)
    assert store.pending is None and store.node.fetched == []


def test_a_seed_announces_often_enough_to_stay_listed_on_the_tracker():
    """libtorrent's default re-announces every 300 s, but the tracker forgets a peer after 30 s: a version's
    seeds vanished for anyone who started fetching it later than that."""
    from echo2cli.broadcast.node import TorrentNode
    from echo2cli.broadcast.tracker import ANNOUNCE_INTERVAL_S, Tracker

    node = TorrentNode("127.0.0.1:0")
    try:
        assert node.session.get_settings()["min_announce_interval"] <= ANNOUNCE_INTERVAL_S < Tracker().ttl_s
    finally:
        node.close()


def test_a_lora_runs_base_is_never_pruned(tmp_path):
    coord = SimpleNamespace(versions_in_download=lambda: set())
    trainer = SimpleNamespace(lora=LoraSpec(rank=4, alpha=8, targets=["q_proj"]))
    pub = Publisher(trainer, FakeNode(), coord, tmp_path, "http://t/announce", keep=2)
    pub.sizes, pub.hashes = {v: 1 for v in range(8)}, {v: "x" for v in range(8)}
    pub._prune(7)
    assert sorted(pub.sizes) == [0, 5, 6, 7]  # version 0 is the base every adapter version applies to
