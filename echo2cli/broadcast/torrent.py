"""Publishing a policy version: bf16 safetensors → hybrid (v1+v2) private torrent.

v2 (or hybrid) torrents verify every piece with SHA-256 Merkle hashes, so a corrupt piece is detected,
its sender banned and the piece fetched elsewhere. The piece size targets ~128 pieces (clamped to
1–4 MiB): enough pieces for workers to trade among themselves while the learner is still seeding.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
MIN_PIECE, MAX_PIECE = 1 << 20, 4 << 20


def version_dir_name(version: int) -> str:
    """`versions/v000007/model.safetensors`: a version's directory, so its torrent's name."""
    return f"v{version:06d}"


@dataclass(frozen=True)
class TorrentFile:
    data: bytes  # bencoded .torrent
    info_hash: str  # hex v1 hash (hybrid torrents also have a v2 hash)

    @property
    def b64(self) -> str:
        return base64.b64encode(self.data).decode()

    @classmethod
    def from_b64(cls, text: str) -> TorrentFile:
        import libtorrent as lt

        data = base64.b64decode(text)
        return cls(data, str(lt.torrent_info(data).info_hashes().v1))


def piece_size_for(nbytes: int) -> int:
    size = MIN_PIECE
    while size < MAX_PIECE and nbytes / size > 128:
        size *= 2
    return size


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def make_torrent(version_dir: Path, tracker_url: str) -> TorrentFile:
    """Torrent over `version_dir` (one directory, so the torrent's name is the directory's name)."""
    import libtorrent as lt

    files = lt.list_files(str(version_dir))
    total = sum(f.size for f in files)
    ct = lt.create_torrent(files, piece_size_for(total))
    ct.add_tracker(tracker_url)
    ct.set_priv(True)  # no DHT/PEX-from-outside: the learner's tracker is the only rendezvous
    ct.set_creator("echo2")
    lt.set_piece_hashes(ct, str(version_dir.parent))
    data = lt.bencode(ct.generate())  # generate_buf() is broken in libtorrent 2.1.1
    return TorrentFile(data, str(lt.torrent_info(data).info_hashes().v1))
