"""Publisher: version v → `versions/v<v>/model.safetensors` (the wire dtype) → v1 torrent → seeded here.

Each version after the first is also published as a delta against the previous one
(`versions/v<v>.delta/model.delta`, its own torrent; see broadcast/delta.py): a worker that holds
the previous version fetches a few percent of the bytes and rebuilds the file. The full torrent stays
for workers without the base (late joiners, laggards).

Publishing is off the training path: `publish(v)` copies the weights, cast to the wire dtype (bf16 or fp16), into
the bytes of the version's file in host memory (`image.VersionImage`: pinned, asynchronous copies on CUDA; on the
CPU, into the memory of the last announced version, already mapped), and a background thread writes, hashes,
delta-encodes, seeds and announces it while the next step trains. The file is written on one thread (O_DIRECT) while the
piece hashes, the version's digest (BLAKE3, a tree) and the delta's chunks are computed from the same memory on
a thread per core (`image.py`, `digest.py`, `delta.py`; scripts/bench_publish.py times each stage).
One version is in flight at a time: `publish(v + 1)` first waits for v (its delta needs v's file), and so do
`wait()` and `close()`. Whatever failed in the background (a full disk) is raised by the next of these, so
the learner stops one step later with the same one-line error. Workers see v once it is announced; until
then they keep generating with v - 1, which the staleness bound admits (S = 0 waits for it).

The learner is each version's first seed, and serves the files it seeds over HTTP as well (`web_seed`, BEP 19)
for workers that cannot reach any peer. Versions older than S + 1 behind the latest can no longer
produce admissible rollouts, so they are dropped from the session and from disk — unless a joined worker is
still fetching one (its first version, on a slow link): that one is seeded until the worker has it.

With LoRA (`echo2cli/lora.py`) version 0 is the frozen base's full weights, published before any other and
seeded for the whole run, and each later version is the adapters alone, with its `adapter_config.json` beside
it (outside its torrent). Adapters change everywhere at every step, so they are published without deltas.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from echo2cli.broadcast import kernels
from echo2cli.broadcast.delta import encode_delta
from echo2cli.broadcast.image import VersionImage
from echo2cli.broadcast.node import TorrentNode
from echo2cli.broadcast.torrent import make_torrent, piece_size_for, spare_cores
from echo2cli.broadcast.webseed import STREAMS_PER_ADDRESS, WebSeed
from echo2cli.errors import disk_full_is_one_line
from echo2cli.layout import VersionKey
from echo2cli.learner.coordinator import Coordinator
from echo2cli.learner.trainer import Trainer
from echo2cli.lora import adapter_dir
from echo2cli.protocol import PolicyInfo

MAX_HELD_FOR_DOWNLOADS = 4  # old versions kept past S + 1 for workers still fetching them (bounds disk use)


class Publisher:
    def __init__(
        self,
        trainer: Trainer,
        node: TorrentNode,
        coord: Coordinator,
        root: Path,
        tracker_url: str,
        keep: int,
        background: bool = True,
        web_seed_rate: float = 0,
        keep_every: int = 0,
        web_seed_streams_per_address: int = STREAMS_PER_ADDRESS,
    ) -> None:
        """`background=False`: `publish` does all the work before it returns. `web_seed_rate`: bytes/s the web
        seed may send (0 = no cap). `keep_every`: every N-th version's file stays on disk when it is pruned."""
        self.trainer, self.node, self.coord = trainer, node, coord
        self.web_seed = WebSeed(self._served, web_seed_rate, streams_per_address=web_seed_streams_per_address)
        self.root, self.tracker_url, self.keep, self.keep_every = root, tracker_url, keep, keep_every
        self.sizes: dict[int, int] = {}
        self.hashes: dict[int, str] = {}
        self.delta_stats: dict[int, dict] = {}  # version -> delta_bytes, full_bytes, encode_s
        self.announce_s: float | None = None  # the newest announced version's seconds from the copy to announced
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish") if background else None
        if self._pool is not None:  # before the first version, not waited on: the delta coder's compiled loops
            self._pool.submit(kernels.warm_up)
        self._pending: Future | None = None
        self._spare: VersionImage | None = None  # the last announced version's image: the next snapshot's memory

    def publish(self, version: int) -> float:
        """Copy the weights now; write and announce them in the background (see the module docstring). Returns
        the seconds it first waited for the previous version to be announced: the training path's time lost to
        a publisher slower than a step (`learner/t_publish_wait_s`)."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        if self.trainer.lora is not None and 0 not in self.sizes:  # the base, once, before the first adapters
            base = VersionImage(self.trainer.published_base_weights(), dtype=self.trainer.wire_dtype)
            self._write_and_announce(0, base, time.perf_counter())
            if version == 0:
                return waited
        image = self.trainer.weights_image(reuse=self._spare)  # the last version is announced: its memory is free
        self._spare = None
        if image is None:
            return waited
        if self._pool is None:
            self._write_and_announce(version, image, time.perf_counter())
        else:
            self._pending = self._pool.submit(self._write_and_announce, version, image, time.perf_counter())
        return waited

    def wait(self) -> None:
        """Until the version in flight is announced; raises what went wrong with it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish the version in flight (its error is dropped: the run is ending anyway) and stop the thread."""
        try:
            self.wait()
        except Exception:  # already ending, on another error or at the end of a run
            pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.web_seed.close()

    def _write_and_announce(self, version: int, image: VersionImage, t0: float) -> PolicyInfo:
        full = VersionKey(version)
        lora = self.trainer.lora if version > 0 else None
        size, workers, fields = image.nbytes, spare_cores(), {}
        base = max((v for v in self.sizes if v < version), default=None)
        with ThreadPoolExecutor(1, thread_name_prefix="write") as writer:
            written = writer.submit(self._write, version, image)
            hashes = image.piece_hashes(piece_size_for(size), workers)
            self.hashes[version] = image.digest(workers)
            if base is not None and self.sizes[base] == size and lora is None:
                delta = VersionKey(version, delta=True)
                with disk_full_is_one_line(f"the delta of version {version} to {delta.dir(self.root)}"):
                    fields = self._publish_delta(base, version, image)
            written.result()
        self._spare = image
        with disk_full_is_one_line(f"version {version} to {full.dir(self.root)}"):
            torrent = make_torrent(full.dir(self.root), self.tracker_url, hashes=hashes)
            if lora is not None:  # after the torrent: for `echo2 eval`, not for the workers (they write their own)
                adapter_dir(full.dir(self.root), lora)
        self.node.seed(full, torrent.data, self.root)
        self.sizes[version] = size
        info = PolicyInfo(
            version=version,
            info_hash=torrent.info_hash,
            torrent_b64=torrent.b64,
            digest=self.hashes[version],
            size_bytes=size,
            published_at=time.time(),  # T_bcast counts from here: workers can see it from now on
            adapter=lora is not None,
            **fields,
        )
        self.coord.publish(info)
        self.announce_s = time.perf_counter() - t0  # one attribute: read by the training thread as it is
        self._prune(version)
        return info

    def _write(self, version: int, image: VersionImage) -> None:
        full = VersionKey(version)
        with disk_full_is_one_line(f"version {version} to {full.dir(self.root)}"):
            image.write(full.path(self.root))

    def _publish_delta(self, base: int, version: int, image: VersionImage) -> dict:
        t0 = time.perf_counter()
        delta = VersionKey(version, delta=True)
        header = encode_delta(
            VersionKey(base).path(self.root),
            image.words,
            delta.path(self.root),
            base_digest=self.hashes[base],
            target_digest=self.hashes[version],
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
        """Learner bytes sent for a version: its full torrent plus its delta, to peers and from the web seed."""
        keys = (VersionKey(version), VersionKey(version, delta=True))
        return sum(self.node.upload_bytes(key) + self.web_seed.sent(key) for key in keys)

    def _served(self, dir_name: str, file_name: str) -> tuple[VersionKey, Path] | None:
        """The web seed serves the files of the versions seeded now, nothing else."""
        key = VersionKey.from_relpath(dir_name, file_name)
        if key is None or not self.node.seeding(key):
            return None
        return key, key.path(self.root)

    def _prune(self, latest: int) -> None:
        """Drop versions more than `keep` behind, except those a live worker is still fetching (a late joiner
        on a slow link), up to MAX_HELD_FOR_DOWNLOADS of them: nobody else seeds a version once it is pruned."""
        base = 0 if self.trainer.lora is not None else None  # a LoRA run's base is seeded for the whole run
        old = sorted(v for v in self.sizes if v < latest - self.keep and v != base)
        wanted = self.coord.versions_in_download()
        held = [v for v in old if v in wanted][-MAX_HELD_FOR_DOWNLOADS:]
        for version in [v for v in old if v not in held]:
            for key in (VersionKey(version), VersionKey(version, delta=True)):
                kept = not key.delta and self.keep_every and version % self.keep_every == 0
                self.node.remove(key, delete_dir=None if kept else key.dir(self.root))
            del self.sizes[version], self.hashes[version]
