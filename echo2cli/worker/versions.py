"""A worker's version store: the policy versions it fetches, verifies, loads, seeds and prunes.

    start(policy)   check the .torrent against the announcement (trust.py) and bound an adapter version by the run's
                    LoRA spec (refusing adapter deltas), then fetch the delta if the version it applies to is the
                    one loaded and verified, else the full version (the fetch slot first)
    prepare()       once the download is complete, verify it: libtorrent checked every piece, then the whole file's
                    digest (a delta is rebuilt and checked against the version's digest, then seeded as the full
                    version; LoRA adapters are checked against the base, and merged into it with `merge_adapters`).
                    The worker runs it on its own thread, so the engine generates meanwhile.
    ready()         the pending version is verified: the swap is only the reload
    take()          the engine now runs it (record_load: a line of events.jsonl); prune(S) deletes versions older
                    than S + 1 behind it
    follow(latest)  a newer version was announced: fetch it once nothing is in progress, or once the download in
                    progress has stalled for FETCH_STALL_S. A download in progress is finished first, even
                    when newer versions appear: on a slow link a multi-GB version can take several learner
                    steps, and abandoning it for each newer one would never finish anything. A worker several
                    versions behind applies the chain of deltas, one version at a time, when that is cheaper
                    than the newest full file (`chain_link`).
    go_back(policy) the learner resumed from a checkpoint older than our versions: they no longer exist

Every method but `ready` and `heartbeat_fields` takes `lock`: the worker's main loop (swaps, leases), its heartbeat
thread (`follow`) and its prepare thread share the store. The worker holds it across a whole swap so no fetch
starts halfway; `prepare` lets go of it while it hashes or rebuilds.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from echo2cli.broadcast.delta import apply_delta
from echo2cli.broadcast.digest import file_digest
from echo2cli.broadcast.node import TorrentNode
from echo2cli.broadcast.torrent import TorrentFile
from echo2cli.errors import BroadcastError, Echo2Error
from echo2cli.layout import VersionKey
from echo2cli.lora import adapter_dir, check_adapter, max_adapter_bytes, tensor_shapes, write_merged
from echo2cli.metrics import MetricsWriter
from echo2cli.protocol import LoraSpec, PolicyInfo
from echo2cli.textsafe import DETAIL_LEN, shown
from echo2cli.worker.trust import check_torrent

FETCH_STALL_S = 60.0  # a download without a byte for this long gives way to the newest version


class Via(StrEnum):
    """How a version travels: its full file, or a delta against the version loaded, rebuilt locally."""

    FULL = "full"
    DELTA = "delta"


@dataclass
class Pending:
    """The version being fetched."""

    policy: PolicyInfo
    via: Via
    progress: tuple[int, float] = field(default_factory=lambda: (0, time.monotonic()))  # bytes, when they last grew

    @property
    def key(self) -> VersionKey:
        return VersionKey(self.policy.version, delta=self.via is Via.DELTA)


def chain_link(
    newest: PolicyInfo, loaded: int, limit: int, policy_of: Callable[[int], PolicyInfo], log: Callable[[str], None]
) -> PolicyInfo:
    """What to fetch on the way to `newest` from the `loaded` (verified) version: the version after it, by its
    delta, when the chain of deltas to `newest` is cheaper than `newest`'s full file; else `newest`.

    Each link is swapped in like any version (a reload, generating meanwhile if the lease rules let it), and the
    next `follow` fetches the link after it. A chain is at most `limit` long: the learner prunes older deltas.
    Its cost is guessed from the newest delta's size; a link the learner cannot hand out, or that is not a delta
    against the loaded version, ends the chain: the full file is fetched."""
    hops = newest.version - loaded
    if newest.delta_base == loaded or loaded < 0 or not 1 < hops <= limit or not newest.delta_size_bytes:
        return newest
    if hops * newest.delta_size_bytes >= newest.size_bytes:
        return newest
    try:
        link = policy_of(loaded + 1)
    except Echo2Error as exc:
        why = shown(exc, DETAIL_LEN)  # the learner's words
        log(f"no delta chain from version {loaded} to {newest.version} ({why}): fetching the full version")
        return newest
    return link if link.delta_base == loaded and link.version == loaded + 1 else newest


def bound_adapters(policy: PolicyInfo, base: Path, lora: LoraSpec | None) -> None:
    """BroadcastError unless an announced adapter version, before a byte of it is fetched, comes whole and no larger
    than the run's LoraSpec allows on the base (`lora.max_adapter_bytes`). Learners publish adapters whole
    (learner/publisher.py), so an adapter delta is refused outright rather than rebuilt from a hostile file."""
    v = policy.version
    if lora is None:
        raise BroadcastError(f"version {v} is LoRA adapters, and the learner gave no LoRA spec")
    if policy.delta_base is not None or policy.delta_torrent_b64 or policy.delta_size_bytes:
        raise BroadcastError(f"version {v} is LoRA adapters announced as a delta; learners send adapters whole")
    try:
        limit = max_adapter_bytes(tensor_shapes(base), lora)
    except ValueError as exc:
        raise BroadcastError(f"version {v} is LoRA adapters, and the base (version 0) is unreadable: {exc}") from exc
    if policy.size_bytes > limit:
        raise BroadcastError(
            f"version {v} is {policy.size_bytes} bytes of LoRA adapters; rank {lora.rank} on the base's "
            f"{', '.join(lora.targets)} layers is at most {limit}: refusing it"
        )


def prepare_adapters(version: int, weights: Path, base: Path, lora: LoraSpec | None, merged: Path | None) -> None:
    """A verified adapter version: check it against the base (vLLM would load adapters of the wrong shapes without
    a word), make its directory loadable as a PEFT adapter, and with a `merged` directory fold it into the base."""
    if lora is None:
        raise BroadcastError(f"version {version} is LoRA adapters, and the learner gave no LoRA spec")
    try:
        check_adapter(weights, base, lora)
    except ValueError as exc:
        raise BroadcastError(f"the adapters of version {version} do not fit the base model: {exc}") from exc
    adapters = adapter_dir(weights.parent, lora)
    if merged is not None:
        shutil.rmtree(merged, ignore_errors=True)
        merged.mkdir(parents=True)
        write_merged(merged, adapters, base)


class VersionStore:
    def __init__(
        self,
        node: TorrentNode,
        root: Path,
        events: MetricsWriter,
        log: Callable[[str], None],
        chain_limit: int = 0,
        lora: LoraSpec | None = None,
        merge_adapters: bool = False,
    ) -> None:
        """`chain_limit`: the longest chain of deltas to apply (the learner keeps S + 1 versions behind its newest).
        `lora`: the run's adapters, if it trains LoRA; `merge_adapters`: also fold each adapter version into the
        base, into `merged(version)`, for an engine that reloads full weights."""
        self.node, self.root, self.events, self.log = node, root, events, log
        self.chain_limit = chain_limit
        self.lora, self.merge_adapters = lora, merge_adapters
        for stale in root.glob("v*.merged"):  # a merge left by a worker killed before its swap
            shutil.rmtree(stale, ignore_errors=True)
        self.lock = threading.RLock()
        self.loaded = -1  # the version the engine runs (or starts with)
        self.pending: Pending | None = None
        self._verified = -1  # version whose file digest has been checked
        self._rechecked = -1  # version whose pieces were re-checked after a digest mismatch
        self._preparing = False  # a thread is hashing or rebuilding the pending version (without the lock)
        self._failure: BaseException | None = None  # what `prepare` could not recover from, raised by `ready`
        self._t_rebuild = 0.0
        self._verified_at = 0.0  # when `_verified` was last set

    def weights(self, version: int) -> Path:
        return VersionKey(version).path(self.root)

    def merged(self, version: int) -> Path:
        """The directory of an adapter version merged into the base (`merge_adapters`); removed once loaded."""
        return self.root / (VersionKey(version).dir_name + ".merged")

    # -- fetching ------------------------------------------------------------------------------------

    def start(self, policy: PolicyInfo) -> None:
        """Fetch `policy`'s version: its delta if we hold the base (loaded and verified), else the full file."""
        with self.lock:
            if policy.adapter:
                bound_adapters(policy, self.weights(0), self.lora)
            torrent = TorrentFile.from_b64(policy.torrent_b64)
            check_torrent(policy, torrent.data)  # one file, at our path, of the announced size and info-hash
            fits = policy.slot + policy.slot_width <= policy.slots
            slot = (policy.slot, policy.slots, policy.slot_width) if fits else None
            if policy.delta_torrent_b64 and policy.delta_base == self.loaded and self._verified >= self.loaded:
                delta = TorrentFile.from_b64(policy.delta_torrent_b64)
                check_torrent(policy, delta.data, delta=True)
                if delta.info_hash == policy.delta_info_hash:
                    self.pending = Pending(policy, Via.DELTA)
                    self.node.fetch(self.pending.key, delta.data, self.root, slot=slot)
                    return
            self.pending = Pending(policy, Via.FULL)
            self.node.fetch(self.pending.key, torrent.data, self.root, slot=slot)

    def follow(
        self,
        latest: int,
        newest: Callable[[], PolicyInfo],
        block: bool = True,
        policy_of: Callable[[int], PolicyInfo] | None = None,
    ) -> None:
        """`latest` was announced: fetch the newest version (`newest()` asks the learner) if it is newer than what
        we hold and nothing is in progress, or what is in progress has stalled (then it is dropped).
        `block=False`: give up at once if the lock is taken (the heartbeat thread; the next beat tries again)."""
        if not self.lock.acquire(blocking=block):
            return
        try:
            pending = self.pending
            if latest <= self.loaded or (
                pending is not None and (pending.policy.version >= latest or not self.stalled())
            ):
                return
            policy = newest()
            if policy.version <= self.loaded:  # told of a version not announced yet: nothing newer to fetch
                return
            if pending is not None:
                self.log(
                    f"version {pending.policy.version} stalled for {FETCH_STALL_S:.0f} s: fetching {policy.version}"
                )
                self._drop(pending.policy.version)
                self.pending = None
            if policy_of is not None and self._verified >= self.loaded:
                policy = chain_link(policy, self.loaded, self.chain_limit, policy_of, self.log)
            self.start(policy)
        finally:
            self.lock.release()

    def stalled(self) -> bool:
        """No byte of the pending download arrived for FETCH_STALL_S (a complete one waiting to be loaded is not
        stalled)."""
        with self.lock:
            if self.pending is None:
                return False
            transfer = self.node.transfers.get(self.pending.key)
            if transfer is None or transfer.finished_at is not None:
                return False
            got, since = self.pending.progress
            now_bytes = self.node.download_bytes(self.pending.key)
            if now_bytes != got:
                self.pending.progress = (now_bytes, time.monotonic())
                return False
            return time.monotonic() - since > FETCH_STALL_S

    def ready(self) -> bool:
        """The pending version is complete and verified: `prepare` did the work. Raises what `prepare` could not
        recover from (a file whose every piece verified but whose digest is wrong, a full disk)."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        pending = self.pending
        return pending is not None and self._verified == pending.policy.version

    def prepare(self) -> None:
        """Poll the swarm and, once the pending version is complete, verify it: rebuild a delta against the
        loaded version, or hash the full file. The hashing and rebuilding run without the lock, so the worker
        keeps generating (and its heartbeat keeps following) meanwhile; a caller finding another thread at it
        returns at once. `ready()` tells the outcome, and raises what went wrong here (the prepare thread has no
        one else to tell)."""
        try:
            self._prepare()
        except Exception as exc:
            self._failure = exc

    def _prepare(self) -> None:
        with self.lock:
            self.node.poll()
            pending = self.pending
            if pending is None or self._preparing or self._verified == pending.policy.version:
                return
            self.node.check(pending.key)
            if self.node.transfers[pending.key].finished_at is None:
                return
            self._preparing = True
        try:
            outcome: BaseException | float | bool = self._verify(pending)
        except Exception as exc:
            outcome = exc
        with self.lock:
            self._preparing = False
            if self.pending is pending:  # not dropped or replaced while we worked
                self._settle(pending, outcome)

    def _verify(self, pending: Pending) -> float | bool:
        """The complete file's check, lock-free (it touches files only): a delta's rebuild seconds (apply_delta
        checks the digest), or whether the full file's digest is the announced one; then, however the file came,
        an adapter version's check against the base (`prepare_adapters`, which raises)."""
        policy = pending.policy
        outcome: float | bool = True
        if pending.via is Via.FULL and file_digest(self.weights(policy.version)) != policy.digest:
            return False
        if pending.via is Via.DELTA:
            assert policy.delta_base is not None
            t0 = time.perf_counter()
            apply_delta(
                self.weights(policy.delta_base),
                VersionKey(policy.version, delta=True).path(self.root),
                self.weights(policy.version),
                expected_digest=policy.digest,
                base_verified=True,
            )
            outcome = time.perf_counter() - t0
        if policy.adapter:
            merged = self.merged(policy.version) if self.merge_adapters else None
            prepare_adapters(policy.version, self.weights(policy.version), self.weights(0), self.lora, merged)
        return outcome

    def _settle(self, pending: Pending, outcome: BaseException | float | bool) -> None:
        """Act on `_verify`'s outcome, under the lock (the torrent session is touched only under it)."""
        policy = pending.policy
        if isinstance(outcome, BroadcastError) and pending.via is Via.DELTA:
            why = shown(outcome, DETAIL_LEN)  # may quote the learner's torrent
            self.log(f"delta for version {policy.version} unusable ({why}); fetching the full version")
            delta = VersionKey(policy.version, delta=True)
            self.node.remove(delta, delete_dir=delta.dir(self.root))
            self.pending = Pending(policy, Via.FULL)
            self.node.fetch(VersionKey(policy.version), TorrentFile.from_b64(policy.torrent_b64).data, self.root)
        elif isinstance(outcome, BaseException):
            self._failure = outcome
        elif outcome is False:
            self._mismatch(policy)
        else:
            if pending.via is Via.DELTA:
                self._t_rebuild = float(outcome)
                self.node.seed(VersionKey(policy.version), TorrentFile.from_b64(policy.torrent_b64).data, self.root)
            self._verified = policy.version  # hash it once, not again when the swap follows a wait
            self._verified_at = time.time()

    def _mismatch(self, policy: PolicyInfo) -> None:
        """libtorrent verified the pieces, so the file changed on disk: a recheck repairs it. Verified again and
        still wrong, the torrent itself does not describe the announced file: refuse the learner."""
        if self._rechecked == policy.version:
            self._failure = BroadcastError(
                f"version {policy.version}: every piece verified, but the file's digest is not the one the learner "
                "announced: its torrent and its hash disagree"
            )
            return
        self._rechecked = policy.version
        self.node.recheck(VersionKey(policy.version))

    def _drop(self, version: int) -> None:
        for key in (VersionKey(version), VersionKey(version, delta=True)):
            self.node.remove(key, delete_dir=key.dir(self.root))
        shutil.rmtree(self.merged(version), ignore_errors=True)

    # -- loading -------------------------------------------------------------------------------------

    def take(self) -> Pending:
        """The pending version, ready, becomes the loaded one."""
        with self.lock:
            assert self.pending is not None
            pending, self.pending = self.pending, None
            self.loaded = pending.policy.version
            return pending

    def record_load(
        self, worker_id: str, pending: Pending, t_reload: float, t_swap: float | None = None, t_stall: float = 0.0
    ) -> None:
        """A line of events.jsonl. `t_swap`: from the last piece verified to the engine generating with the version
        (None: until now); `t_stall`: how long the swap kept the engine from generating."""
        transfer = self.node.transfers.get(pending.key) or self.node.transfers[VersionKey(pending.policy.version)]
        if t_swap is None:
            t_swap = time.time() - (transfer.finished_at or time.time())
        verify_s = max(0.0, self._verified_at - (transfer.finished_at or time.time()))  # last piece -> verified
        rebuild_s = self._t_rebuild if pending.via is Via.DELTA else 0.0
        downloaded = self.node.download_bytes(pending.key)
        event = load_event(worker_id, pending, transfer, downloaded, rebuild_s, verify_s, t_reload, t_swap)
        self.events.write(event | {"t_stall_s": t_stall})

    def prune(self, staleness: int, keep_base: bool = False) -> None:
        """Versions older than S + 1 behind the loaded one can make no admissible rollout: delete them (but version 0
        with `keep_base`: a LoRA run's base, which the engine runs under every adapter and late joiners fetch)."""
        with self.lock:
            keep_after = self.loaded - (staleness + 1)
            for key in [k for k in self._keys() if k.version < keep_after and not (keep_base and k.version == 0)]:
                self.node.remove(key, delete_dir=key.dir(self.root))

    def go_back(self, policy: PolicyInfo) -> None:
        """The learner resumed at `policy`, older than what we hold or fetch: versions after it no longer exist.
        Start again from it (its file, if we have it, is kept: re-adding it re-checks it, fast)."""
        with self.lock:
            for key in self._keys():
                if key.version >= policy.version:
                    gone = key.version > policy.version
                    self.node.remove(key, delete_dir=key.dir(self.root) if gone else None)
                    shutil.rmtree(self.merged(key.version), ignore_errors=True)
            self.loaded, self._verified, self.pending = -1, -1, None
            self.start(policy)

    def _keys(self) -> list[VersionKey]:
        return [key for key in self.node.transfers if isinstance(key, VersionKey)]

    def ahead_of(self, version: int) -> bool:
        """We hold or fetch a version the learner does not have."""
        with self.lock:
            return self.loaded > version or (self.pending is not None and self.pending.policy.version > version)

    def heartbeat_fields(self) -> dict[str, Any]:
        """What the learner is told about our downloads. Read without the lock (a heartbeat must not wait for a
        swap): `pending` is read once."""
        pending = self.pending
        progress = min(1.0, self.node.progress(pending.key)) if pending else 0.0
        return {
            "downloading_version": pending.policy.version if pending else None,
            "download_progress": progress,
            "ready_version": pending.policy.version if pending and self._verified == pending.policy.version else -1,
            "upload_bytes": self.node.upload_bytes(),
        }


def load_event(
    worker_id: str,
    pending: Pending,
    transfer: Any,
    downloaded: int,
    rebuild_s: float,
    verify_s: float,
    t_reload: float,
    t_swap: float,
) -> dict[str, Any]:
    """The `loaded` line of events.jsonl: what the version was, how it came, and what each stage took."""
    policy = pending.policy
    return {
        "event": "loaded",
        "worker_id": worker_id,
        "version": policy.version,
        "info_hash": policy.info_hash,
        "digest": policy.digest,
        "digest_verified": True,
        "via": str(pending.via),
        "adapter": policy.adapter,  # LoRA adapters on the base
        "downloaded_bytes": downloaded,
        "size_bytes": policy.size_bytes,
        "hash_failures": transfer.hash_failures,
        "web_seed": transfer.web_seed_at is not None,  # it asked the learner's web seed too
        "t_download_s": (transfer.finished_at or time.time()) - transfer.started,
        "t_rebuild_s": rebuild_s,
        "t_verify_s": verify_s,  # last piece -> verified: hash or rebuild (and for adapters, their check or merge)
        "t_reload_s": t_reload,
        "t_swap_s": t_swap,
        "time": time.time(),
    }
