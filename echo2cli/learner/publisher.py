"""Publisher: version v → `versions/v<v>/model.safetensors` (bf16) → hybrid torrent → seeded here.

The learner is each version's first seed. Versions older than S + 1 behind the latest can no longer
produce admissible rollouts, so they are dropped from the session and from disk.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

from echo2cli.broadcast.node import TorrentNode
from echo2cli.broadcast.torrent import WEIGHTS_FILE, make_torrent, sha256_file
from echo2cli.errors import DiskFullError
from echo2cli.learner.coordinator import Coordinator
from echo2cli.learner.trainer import Trainer
from echo2cli.protocol import PolicyInfo


def version_dir_name(version: int) -> str:
    return f"v{version:06d}"


class Publisher:
    def __init__(
        self, trainer: Trainer, node: TorrentNode, coord: Coordinator, root: Path, tracker_url: str, keep: int
    ) -> None:
        self.trainer, self.node, self.coord = trainer, node, coord
        self.root, self.tracker_url, self.keep = root, tracker_url, keep
        self.sizes: dict[int, int] = {}

    def publish(self, version: int) -> PolicyInfo:
        vdir = self.root / version_dir_name(version)
        try:
            self.trainer.export_weights(vdir / WEIGHTS_FILE)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskFullError(f"disk full writing version {version} to {vdir}: free space or move --out") from exc
            raise
        torrent = make_torrent(vdir, self.tracker_url)
        self.node.seed(version, torrent.data, self.root)
        size = (vdir / WEIGHTS_FILE).stat().st_size
        self.sizes[version] = size
        info = PolicyInfo(
            version=version,
            info_hash=torrent.info_hash,
            torrent_b64=torrent.b64,
            sha256=sha256_file(vdir / WEIGHTS_FILE),
            size_bytes=size,
            published_at=time.time(),
        )
        self.coord.publish(info)
        self._prune(version)
        return info

    def _prune(self, latest: int) -> None:
        for version in [v for v in self.node.transfers if v < latest - self.keep]:
            self.node.remove(version, delete_dir=self.root / version_dir_name(version))
