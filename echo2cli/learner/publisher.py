"""Publisher: version v → `versions/v<v>/model.safetensors` (bf16) → v1 torrent → seeded here.

Each version after the first is also published as a delta against the previous one
(`versions/v<v>.delta/model.delta`, its own torrent; see broadcast/delta.py): a worker that holds
the previous version fetches a few percent of the bytes and rebuilds the file. The full torrent stays
for workers without the base (late joiners, laggards).

The learner is each version's first seed. Versions older than S + 1 behind the latest can no longer
produce admissible rollouts, so they are dropped from the session and from disk — unless a joined worker is
still fetching one (its first version, on a slow link): that one is seeded until the worker has it.
"""

from __future__ import annotations

import time
from pathlib import Path

from echo2cli.broadcast.delta import encode_delta
from echo2cli.broadcast.node import TorrentNode
from echo2cli.broadcast.torrent import make_torrent, sha256_file
from echo2cli.errors import disk_full_is_one_line
from echo2cli.layout import VersionKey
from echo2cli.learner.coordinator import Coordinator
from echo2cli.learner.trainer import Trainer
from echo2cli.protocol import PolicyInfo

MAX_HELD_FOR_DOWNLOADS = 4  # old versions kept past S + 1 for workers still fetching them (bounds disk use)


class Publisher:
    def __init__(
        self, trainer: Trainer, node: TorrentNode, coord: Coordinator, root: Path, tracker_url: str, keep: int
    ) -> None:
        self.trainer, self.node, self.coord = trainer, node, coord
        self.root, self.tracker_url, self.keep = root, tracker_url, keep
        self.sizes: dict[int, int] = {}
        self.hashes: dict[int, str] = {}
        self.delta_stats: dict[int, dict] = {}  # version -> delta_bytes, full_bytes, encode_s

    def publish(self, version: int) -> PolicyInfo:
        full = VersionKey(version)
        with disk_full_is_one_line(f"version {version} to {full.dir(self.root)}"):
            self.trainer.export_weights(full.path(self.root))
            torrent = make_torrent(full.dir(self.root), self.tracker_url)
        self.node.seed(full, torrent.data, self.root)
        size = full.path(self.root).stat().st_size
        self.sizes[version] = size
        self.hashes[version] = sha256_file(full.path(self.root))
        info = PolicyInfo(
            version=version,
            info_hash=torrent.info_hash,
            torrent_b64=torrent.b64,
            sha256=self.hashes[version],
            size_bytes=size,
            published_at=time.time(),
        )
        base = max((v for v in self.sizes if v < version), default=None)
        if base is not None and self.sizes[base] == size:
            delta = VersionKey(version, delta=True)
            with disk_full_is_one_line(f"the delta of version {version} to {delta.dir(self.root)}"):
                info = info.model_copy(update=self._publish_delta(base, version))
        self.coord.publish(info)
        self._prune(version)
        return info

    def _publish_delta(self, base: int, version: int) -> dict:
        t0 = time.perf_counter()
        delta = VersionKey(version, delta=True)
        header = encode_delta(
            VersionKey(base).path(self.root),
            VersionKey(version).path(self.root),
            delta.path(self.root),
            base_sha256=self.hashes[base],
            target_sha256=self.hashes[version],
        )
        torrent = make_torrent(delta.dir(self.root), self.tracker_url)
        self.node.seed(delta, torrent.data, self.root)
        self.delta_stats[version] = {
            "delta_bytes": header["delta_bytes"],
            "full_bytes": header["full_bytes"],
            "encode_s": time.perf_counter() - t0,
        }
        return {
            "delta_base": base,
            "delta_info_hash": torrent.info_hash,
            "delta_torrent_b64": torrent.b64,
            "delta_size_bytes": header["delta_bytes"],
        }

    def weights_path(self, version: int) -> Path:
        return VersionKey(version).path(self.root)

    def upload_bytes(self, version: int) -> int:
        """Learner bytes sent for a version: its full torrent plus its delta."""
        return self.node.upload_bytes(VersionKey(version)) + self.node.upload_bytes(VersionKey(version, delta=True))

    def _prune(self, latest: int) -> None:
        """Drop versions more than `keep` behind, except those a live worker is still fetching (a late joiner
        on a slow link), up to MAX_HELD_FOR_DOWNLOADS of them: nobody else seeds a version once it is pruned."""
        old = sorted(v for v in self.sizes if v < latest - self.keep)
        wanted = self.coord.versions_in_download()
        held = [v for v in old if v in wanted][-MAX_HELD_FOR_DOWNLOADS:]
        for version in [v for v in old if v not in held]:
            for key in (VersionKey(version), VersionKey(version, delta=True)):
                self.node.remove(key, delete_dir=key.dir(self.root))
            del self.sizes[version], self.hashes[version]
