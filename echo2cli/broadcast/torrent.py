"""Publishing a policy version: safetensors (bf16 or fp16) → a v1 private torrent.

v1, not v2 or hybrid, so that any ordinary client can fetch a version: Debian's aria2c 1.36, given a
hybrid torrent made by libtorrent 2.1.1, announced under an info-hash that is not the torrent's and found
no peer (0 bytes in 120 s; `tests/integration/test_e2e.py` fetches a v1 version with it). Every
piece is still verified (SHA-1 per piece: a corrupt piece is detected, its sender banned and the piece
fetched elsewhere), and a worker loads a version only after the whole file's digest (BLAKE3, `digest.py`), which
comes from the authenticated API, matches. The piece size targets ~512 pieces (clamped to 256 KiB–4 MiB): a worker
can pass a piece on only once it holds the whole piece, so smaller pieces start the trading among workers sooner
while the learner is still sending each its share. Measured on the default model (269 MB, 8 workers on 100 Mbit/s
links, `echo2 bench broadcast`): T_bcast/T* 1.37 with 2 MiB pieces, 1.22 with 1 MiB, 1.29 with 512 KiB.
"""

from __future__ import annotations

import base64
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2cli.errors import BroadcastError

MIN_PIECE, MAX_PIECE, TARGET_PIECES = 256 << 10, 4 << 20, 512


@dataclass(frozen=True)
class TorrentFile:
    data: bytes  # bencoded .torrent
    info_hash: str  # hex v1 info-hash

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
    while size < MAX_PIECE and nbytes / size > TARGET_PIECES:
        size *= 2
    return size


def spare_cores() -> int:
    """Threads for hashing and delta coding: every core this process may run on (the learner's steps run on
    its GPUs; on a CPU learner they share the cores with training, which the OS schedules)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def piece_hashes(ct: Any, root: Path, workers: int) -> list[bytes]:
    """SHA-1 of each piece of `ct`'s files (under `root`, as `lt.set_piece_hashes` takes it), `workers` pieces
    at a time: hashlib releases the GIL, so the pieces hash on as many cores. The same digests as libtorrent's
    own hasher, which runs on one thread (tests/test_torrent_hashing.py)."""
    fs = ct.files()
    spans = [  # (absolute offset, size, path or None for a pad file)
        (fs.file_offset(i), fs.file_size(i), None if fs.file_flags(i) & fs.flag_pad_file else root / fs.file_path(i))
        for i in range(fs.num_files())
    ]
    fds = {path: os.open(path, os.O_RDONLY) for _, _, path in spans if path is not None}
    try:

        def one(piece: int) -> bytes:
            start, size = piece * ct.piece_length(), ct.piece_size(piece)
            h = hashlib.sha1()
            for offset, length, path in spans:
                lo, hi = max(start, offset), min(start + size, offset + length)
                if lo >= hi:
                    continue
                data = bytes(hi - lo) if path is None else os.pread(fds[path], hi - lo, lo - offset)
                if len(data) != hi - lo:
                    raise BroadcastError(f"{path} changed while its torrent was made")
                h.update(data)
            return h.digest()

        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="hash") as pool:
            return list(pool.map(one, range(ct.num_pieces())))
    finally:
        for fd in fds.values():
            os.close(fd)


def make_torrent(
    version_dir: Path, tracker_url: str, workers: int | None = None, hashes: list[bytes] | None = None
) -> TorrentFile:
    """Torrent over `version_dir` (one directory, so the torrent's name is the directory's name); its pieces
    hashed on `workers` threads (default: `spare_cores()`), or given as `hashes` (a one-file directory's pieces
    of `piece_size_for` its size, hashed from memory: `image.VersionImage.piece_hashes`)."""
    import libtorrent as lt

    files = lt.list_files(str(version_dir))
    total = sum(f.size for f in files)
    ct = lt.create_torrent(files, piece_size_for(total), lt.create_torrent.v1_only)
    ct.add_tracker(tracker_url)
    ct.set_priv(True)  # no DHT/PEX-from-outside: the learner's tracker is the only rendezvous
    ct.set_creator("echo2")
    if hashes is not None and (len(files) != 1 or len(hashes) != ct.num_pieces()):
        raise BroadcastError(f"{version_dir}: the given piece hashes are not this directory's one file's")
    for piece, digest in enumerate(hashes or piece_hashes(ct, version_dir.parent, workers or spare_cores())):
        ct.set_hash(piece, digest)
    data = lt.bencode(ct.generate())  # generate_buf() is broken in libtorrent 2.1.1
    return TorrentFile(data, str(lt.torrent_info(data).info_hashes().v1))
