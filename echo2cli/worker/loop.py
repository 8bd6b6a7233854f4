"""`echo2 worker --join URL`: join, fetch each policy version from the swarm, generate, submit.

    join → fetch config/tokenizer (HTTP, once) → fetch the latest version (torrent) → start vLLM
    loop:  swap in a finished download (verified) → lease prompts → generate G samples each → submit
    a newer version announced (lease reply or heartbeat)? start fetching it at once, in the background
    (libtorrent threads), so it downloads while the current lease generates
    a download in progress is finished before the newest version is fetched (the learner keeps seeding a
    version while a joined worker fetches it), unless it stalls for FETCH_STALL_S: on a slow link a 3 GB
    version can take longer than several learner steps, and abandoning it for each newer one would never
    finish anything. This holds from the first fetch on, while the engine is not even started.
    Ctrl-C / SIGTERM / learner finished: hand back leases, leave, stop.
    learner gone: retry with backoff for up to learner_restart_s; when it is back (resumed from a
    checkpoint, same run id) join again and go on with the engine and versions held. If it resumed at a
    version older than ours (it crashed after its last checkpoint), load its version before generating.

A version is loaded only after libtorrent verified every piece and the file's SHA-256 matches the
learner's. While the next version downloads, the worker keeps generating with the one it has (that
is what staleness S allows); the learner answers `update` once the worker is more than S behind.
Every load is appended to `<work_dir>/events.jsonl` (tests and benchmarks read it).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from rich.console import Console

from echo2cli.broadcast.delta import apply_delta
from echo2cli.broadcast.node import TorrentNode
from echo2cli.broadcast.torrent import TorrentFile, sha256_file
from echo2cli.config import WorkerConfig
from echo2cli.errors import BroadcastError, ProtocolError, SessionLost
from echo2cli.layout import VERSIONS_DIR, WEIGHTS_FILE, VersionKey
from echo2cli.metrics import MetricsWriter
from echo2cli.protocol import Heartbeat, JoinRequest, JoinResponse, LeaseRequest, PolicyInfo, RolloutBatch, Sample
from echo2cli.tls import trust_for_torrents
from echo2cli.units import mbps_to_bytes_per_s
from echo2cli.worker.client import LearnerClient
from echo2cli.worker.trust import check_torrent, safe_model_file

FETCH_ATTEMPTS = 3
FETCH_STALL_S = 60.0  # a download without a byte for this long gives way to the newest version


class Worker:
    def __init__(self, cfg: WorkerConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True, quiet=True)
        # absolute: the engine directory links to version files, and a relative link target would break
        work_dir = cfg.work_dir or Path.home() / ".cache" / "echo2" / "workers" / cfg.name
        self.work_dir = work_dir.expanduser().resolve()
        self.versions_dir = self.work_dir / VERSIONS_DIR
        self.client = LearnerClient(
            cfg.join,
            cfg.token,
            request_timeout_s=cfg.request_timeout_s,
            unreachable_s=cfg.unreachable_s,
            ca_cert=cfg.ca_cert,
        )
        self.node: TorrentNode | None = None
        self.engine = None
        self.worker_id = ""
        self.loaded = -1
        self.downloading: PolicyInfo | None = None
        self._verified = -1  # version whose file SHA-256 has been checked
        self._rechecked = -1  # version whose pieces were re-checked after a SHA-256 mismatch
        self._via = "full"  # how the pending version travels: "full" torrent or "delta" + rebuild
        self._t_rebuild = 0.0
        self._swap_s = 0.0
        self.tokens_per_s = 0.0
        self.stop = threading.Event()
        # The main loop and the heartbeat thread both start fetches; this lock orders every change to
        # `downloading`, `loaded` and the torrent session's transfers.
        self._fetch_lock = threading.Lock()
        self._engine_up = False
        self._progress = (0, time.monotonic())  # bytes of the pending download, when they last grew
        self.events: MetricsWriter | None = None

    # -- versions ------------------------------------------------------------------------------------

    def _vdir(self, version: int) -> Path:
        return VersionKey(version).dir(self.versions_dir)

    def _start_fetch(self, policy: PolicyInfo) -> None:
        """Fetch the delta if we hold its base (verified and loaded), else the full version by slot."""
        assert self.node is not None
        torrent = TorrentFile.from_b64(policy.torrent_b64)
        check_torrent(policy, torrent.data)  # one file, at our path, of the announced size and info-hash
        self.downloading, self._via = policy, "full"
        self._progress = (0, time.monotonic())
        if policy.delta_torrent_b64 and policy.delta_base == self.loaded and self._verified >= self.loaded:
            delta = TorrentFile.from_b64(policy.delta_torrent_b64)
            check_torrent(policy, delta.data, delta=True)
            if delta.info_hash == policy.delta_info_hash:
                key = VersionKey(policy.version, delta=True)
                self.node.fetch(key, delta.data, self.versions_dir, slot=self._slot(policy))
                self._via = "delta"
                return
        self.node.fetch(VersionKey(policy.version), torrent.data, self.versions_dir, slot=self._slot(policy))

    @staticmethod
    def _slot(policy: PolicyInfo) -> tuple[int, int] | None:
        return (policy.slot, policy.slots) if policy.slot < policy.slots else None

    def _rebuild_from_delta(self, policy: PolicyInfo) -> bool:
        """Delta downloaded: rebuild the full file, check its SHA-256, then seed the full version too."""
        assert self.node is not None and policy.delta_base is not None
        t0 = time.perf_counter()
        try:
            apply_delta(
                self._vdir(policy.delta_base) / WEIGHTS_FILE,
                VersionKey(policy.version, delta=True).path(self.versions_dir),
                self._vdir(policy.version) / WEIGHTS_FILE,
                expected_sha256=policy.sha256,
                base_verified=True,
            )
        except BroadcastError as exc:
            self.console.log(f"delta for version {policy.version} unusable ({exc}); fetching the full version")
            delta_key = VersionKey(policy.version, delta=True)
            self.node.remove(delta_key, delete_dir=delta_key.dir(self.versions_dir))
            self._via = "full"
            torrent = TorrentFile.from_b64(policy.torrent_b64)
            self.node.fetch(VersionKey(policy.version), torrent.data, self.versions_dir)
            return False
        self._t_rebuild = time.perf_counter() - t0
        self.node.seed(VersionKey(policy.version), TorrentFile.from_b64(policy.torrent_b64).data, self.versions_dir)
        return True

    def _download_done(self) -> bool:
        """Poll the swarm; True once the pending version is complete and its SHA-256 verified."""
        assert self.node is not None
        self.node.poll()
        policy = self.downloading
        if policy is None:  # a stalled fetch was dropped and its successor not started yet
            return False
        if self._verified == policy.version:
            return True
        if self._via == "delta":
            key = VersionKey(policy.version, delta=True)
            self.node.check(key)
            if self.node.transfers[key].finished_at is None or not self._rebuild_from_delta(policy):
                return False
            self._verified = policy.version  # apply_delta checked the rebuilt file's SHA-256
            return True
        self.node.check(VersionKey(policy.version))
        if self.node.transfers[VersionKey(policy.version)].finished_at is None:
            return False
        if sha256_file(self._vdir(policy.version) / WEIGHTS_FILE) != policy.sha256:
            # libtorrent verified the pieces, so the file changed on disk: recheck repairs it. Verified again
            # and still wrong, the torrent itself does not describe the announced file: refuse the learner.
            if self._rechecked == policy.version:
                raise BroadcastError(
                    f"version {policy.version}: every piece verified, but the file's SHA-256 is "
                    "not the one the learner announced: its torrent and its hash disagree"
                )
            self._rechecked = policy.version
            self.node.recheck(VersionKey(policy.version))
            return False
        self._verified = policy.version  # hash 269 MB once, not again when the swap follows a wait
        return True

    def _wait_download(self) -> None:
        while True:
            with self._fetch_lock:
                if self._download_done():
                    return
            if self.stop.is_set():
                raise KeyboardInterrupt
            time.sleep(0.05)

    def _maybe_fetch(self, latest: int, block: bool = True) -> None:
        """Start fetching the newest version if it is newer than what we hold, and nothing is in progress
        (or what is in progress has stalled: then it is dropped)."""
        if not self._fetch_lock.acquire(blocking=block):
            return  # the main loop is swapping; the next heartbeat tries again
        try:
            pending = self.downloading
            if latest <= self.loaded or (pending is not None and (pending.version >= latest or not self._stalled())):
                return
            policy = self.client.policy(self.worker_id)
            if pending is not None:
                self.console.log(
                    f"version {pending.version} stalled for {FETCH_STALL_S:.0f} s: fetching {policy.version}"
                )
                for key in (VersionKey(pending.version), VersionKey(pending.version, delta=True)):
                    self.node.remove(key, delete_dir=key.dir(self.versions_dir))
                self.downloading = None
            self._start_fetch(policy)
        finally:
            self._fetch_lock.release()

    def _stalled(self) -> bool:
        """No byte of the pending download arrived for FETCH_STALL_S (a verified one waiting for its swap is
        not stalled)."""
        assert self.node is not None and self.downloading is not None
        key = VersionKey(self.downloading.version, delta=self._via == "delta")
        transfer = self.node.transfers.get(key)
        if transfer is None or transfer.finished_at is not None:
            return False
        got, since = self._progress
        now_bytes = self.node.download_bytes(key)
        if now_bytes != got:
            self._progress = (now_bytes, time.monotonic())
            return False
        return time.monotonic() - since > FETCH_STALL_S

    def _record_load(self, policy: PolicyInfo, via: str, t_reload: float, t_swap: float = 0.0) -> None:
        """t_swap: from the last piece verified to the engine generating with the new weights."""
        assert self.node is not None and self.events is not None
        key = VersionKey(policy.version, delta=via == "delta")
        transfer = self.node.transfers.get(key) or self.node.transfers[VersionKey(policy.version)]
        self.events.write(
            {
                "event": "loaded",
                "worker_id": self.worker_id,
                "version": policy.version,
                "info_hash": policy.info_hash,
                "sha256": policy.sha256,
                "sha256_verified": True,
                "via": via,
                "downloaded_bytes": self.node.download_bytes(key),
                "size_bytes": policy.size_bytes,
                "hash_failures": transfer.hash_failures,
                "t_download_s": (transfer.finished_at or time.time()) - transfer.started,
                "t_rebuild_s": self._t_rebuild if via == "delta" else 0.0,
                "t_reload_s": t_reload,
                "t_swap_s": t_swap,
                "time": time.time(),
            }
        )

    def _swap_if_ready(self) -> None:
        with self._fetch_lock:
            self._swap_locked()

    def _swap_locked(self) -> None:
        t0 = time.perf_counter()
        if self.downloading is None or not self._download_done():
            return
        policy = self.downloading
        key = VersionKey(policy.version, delta=self._via == "delta")
        verified_at = self.node.transfers[key].finished_at or time.time()
        t_reload = self.engine.reload(self._vdir(policy.version))
        self.loaded, self.downloading = policy.version, None
        self._link_weights(policy.version)
        self._swap_s = time.perf_counter() - t0  # hash check or rebuild, plus the reload
        self._record_load(policy, self._via, t_reload, t_swap=time.time() - verified_at)
        self.console.log(f"loaded version {policy.version} (reload {t_reload:.2f} s)")
        self._send_heartbeat()
        self._prune()

    def _prune(self) -> None:
        assert self.node is not None
        keep_after = self.loaded - (self.join_info.staleness + 1)
        for key in [k for k in self.node.transfers if k.version < keep_after]:
            self.node.remove(key, delete_dir=key.dir(self.versions_dir))

    # -- start-up ------------------------------------------------------------------------------------

    def _prepare_engine_dir(self, info: JoinResponse) -> Path:
        engine_dir = self.work_dir / "engine"
        engine_dir.mkdir(parents=True, exist_ok=True)
        for name in info.model_files:  # protocol.JoinResponse allows only MODEL_FILES; checked again here
            safe_model_file(engine_dir, name).write_bytes(self.client.model_file(name))
        return engine_dir

    def _link_weights(self, version: int) -> None:
        """The engine directory's weights are the version loaded (replaced atomically): vLLM reads them at
        start, and a version the worker pruned must not leave a dangling link."""
        link = self.work_dir / "engine" / WEIGHTS_FILE
        tmp = link.with_name(WEIGHTS_FILE + ".link")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self._vdir(version) / WEIGHTS_FILE)
        tmp.replace(link)

    def _heartbeat_loop(self) -> None:
        while not self.stop.wait(self.join_info.heartbeat_s):
            try:
                reply = self._send_heartbeat()
                if reply is not None and reply.finished:
                    self.stop.set()
                elif reply is not None:  # from the first fetch on: a late joiner follows the newest
                    self._maybe_fetch(reply.latest_version, block=False)
            except SessionLost:
                pass  # the learner restarted: the main loop joins again
            except Exception as exc:  # the main loop reports persistent failures; keep beating
                self.console.log(f"heartbeat failed: {exc}")

    def _send_heartbeat(self):
        node = self.node
        pending = self.downloading  # the main thread may replace it: read once
        progress = 0.0
        if node and pending:
            progress = node.progress(VersionKey(pending.version, delta=self._via == "delta"))
        return self.client.heartbeat(
            Heartbeat(
                worker_id=self.worker_id,
                version_loaded=self.loaded if self._engine_up else -1,
                downloading_version=pending.version if pending else None,
                download_progress=min(1.0, progress),
                ready_version=pending.version if progress >= 1.0 else -1,
                swap_s=self._swap_s,
                tokens_per_s=self.tokens_per_s,
                upload_bytes=node.upload_bytes() if node else 0,
            )
        )

    # -- main loop -----------------------------------------------------------------------------------

    def _generate(self, lease) -> RolloutBatch:
        info = self.join_info
        t0 = time.perf_counter()
        groups = self.engine.generate(
            [p.prompt_token_ids for p in lease.prompts],
            n=info.group_size,
            temperature=info.temperature,
            max_new_tokens=info.max_new_tokens,
        )
        gen_s = time.perf_counter() - t0
        samples = [
            Sample(
                prompt_id=p.prompt_id,
                sample_idx=i,
                completion_token_ids=c.token_ids,
                logprobs=c.logprobs,
                finish_reason=c.finish_reason,
            )
            for p, group in zip(lease.prompts, groups, strict=True)
            for i, c in enumerate(group)
        ]
        # the engine returns no completions for a prompt it cannot take: say so, the learner leases it elsewhere
        unservable = [p.prompt_id for p, group in zip(lease.prompts, groups, strict=True) if not group]
        if unservable:
            self.console.log(
                f"{len(unservable)} prompt(s) too long for max_model_len {self.cfg.max_model_len}: handed back"
            )
        n_tokens = sum(len(s.completion_token_ids) for s in samples)
        self.tokens_per_s = n_tokens / max(gen_s, 1e-9)
        if self.cfg.max_rollouts_per_s:  # emulate a slower GPU: the lease takes len/rate at least
            self.stop.wait(max(0.0, len(samples) / self.cfg.max_rollouts_per_s - gen_s))
        return RolloutBatch(
            worker_id=self.worker_id,
            lease_id=lease.lease_id,
            version=lease.version,
            samples=samples,
            gen_s=gen_s,
            unservable=unservable,
        )

    def _work_once(self, stats: dict) -> bool:
        """One lease: ask, generate, submit (or wait, fetch, stand by). False once the learner finished."""
        cfg = self.cfg
        self._swap_if_ready()
        resp = self.client.lease(
            LeaseRequest(worker_id=self.worker_id, version=self.loaded, max_prompts=cfg.prompts_per_lease)
        )
        if resp.status == "finished":
            return False
        self._maybe_fetch(resp.latest_version)
        if resp.status == "ok" and resp.lease is not None:
            batch = self._generate(resp.lease)
            result = self.client.submit(batch)
            stats["leases"] += 1
            stats["rollouts"] += len(batch.samples)
            stats["accepted"] += result.accepted
            stats["stale"] += result.stale
        elif resp.status == "update" and self.downloading is not None:
            self._wait_download()
        elif resp.status == "standby":
            if not self._standby:
                self.console.log(f"standby: {resp.detail}")
            stats["standby_s"] += 0.5
            time.sleep(0.5)  # keep fetching and seeding versions; ask again
        else:
            time.sleep(0.1)
        if self._standby and resp.status != "standby":
            self.console.log("active again")
        self._standby = resp.status == "standby"
        return True

    def _rejoin(self, why: Exception) -> None:
        """The learner restarted and forgot us: join again, keeping the engine and the versions we hold.
        A lease in progress was lost with the old session; the resumed learner leases its prompts again."""
        self.console.log(f"{why}: joining again")
        info = self.client.join(
            JoinRequest(name=self.cfg.name, usd_per_hour=self.cfg.usd_per_hour, max_model_len=self.cfg.max_model_len)
        )
        if info.run_id != self.join_info.run_id:
            raise ProtocolError(
                f"learner at {self.cfg.join} now runs another run ({info.run_id}, not "
                f"{self.join_info.run_id}): start the worker again to join it"
            )
        latest = info.policy.version
        with self._fetch_lock:
            self.join_info, self.worker_id = info, info.worker_id
            self.node.set_tracker_key(info.tracker_key)
            ahead = self.loaded > latest or (self.downloading is not None and self.downloading.version > latest)
            if ahead:  # versions after the learner's checkpoint no longer exist: go back to its latest
                for key in list(self.node.transfers):
                    if key.version >= latest:
                        gone = key.version > latest  # keep the file of `latest`: re-adding it re-checks it, fast
                        self.node.remove(key, delete_dir=key.dir(self.versions_dir) if gone else None)
                self.loaded, self._verified, self.downloading = -1, -1, None
                self._start_fetch(info.policy)
        self.console.log(f"joined again as {self.worker_id}; the learner is at version {latest}")
        if ahead:
            self._wait_download()
            self._swap_if_ready()

    def run(self) -> dict:
        from echo2cli.worker.engine import Engine

        cfg = self.cfg
        info = self.client.join(
            JoinRequest(name=cfg.name, usd_per_hour=cfg.usd_per_hour, max_model_len=cfg.max_model_len)
        )
        self.client.unreachable_s = cfg.learner_restart_s  # from now on, an absent learner may be restarting
        self.join_info, self.worker_id = info, info.worker_id
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.events = MetricsWriter(self.work_dir / "events.jsonl")
        self.console.log(f"joined {cfg.join} as {self.worker_id} (run {info.run_id})")
        trust_for_torrents(cfg.ca_cert, self.work_dir)  # before the torrent session: https tracker
        self.node = TorrentNode(
            cfg.bt_listen,
            upload_limit_bytes_s=mbps_to_bytes_per_s(cfg.uplink_mbps),
            download_limit_bytes_s=mbps_to_bytes_per_s(cfg.downlink_mbps),
            tracker_key=info.tracker_key,
        )
        stats = {"rollouts": 0, "accepted": 0, "stale": 0, "leases": 0, "standby_s": 0.0, "rejoins": 0}
        self._standby = False
        beat = threading.Thread(target=self._heartbeat_loop, daemon=True, name="heartbeat")
        try:
            self._start_fetch(info.policy)
            engine_dir = self._prepare_engine_dir(info)
            beat.start()
            self._wait_download()  # the heartbeat may move this fetch on to a newer version meanwhile
            with self._fetch_lock:
                first, via = self.downloading, self._via
                assert first is not None
                self.loaded, self.downloading = first.version, None
                self._link_weights(first.version)
            # the engine starts while the heartbeat already fetches anything newer
            self.engine = Engine(
                engine_dir,
                kv_cache_gib=cfg.kv_cache_gib,
                max_model_len=cfg.max_model_len,
                seed=cfg.seed,
                dtype=cfg.dtype,
            )
            self._engine_up = True
            self._record_load(first, via, 0.0)
            self._send_heartbeat()
            self.console.log(f"engine up with version {self.loaded}")
            while not self.stop.is_set():
                try:
                    if not self._work_once(stats):
                        break
                except SessionLost as exc:
                    self._rejoin(exc)
                    stats["rejoins"] += 1
        except KeyboardInterrupt:
            self.console.log("interrupted: handing leases back")
        finally:
            self.stop.set()
            try:
                self.client.leave(self.worker_id)
            except Exception:  # the learner may already be gone; its lease timeout covers us
                pass
            self.node.close()
            self.events.close()
            self.client.close()
            if self.engine is not None:
                self.engine.close()
        return stats


def install_sigterm_as_interrupt() -> None:
    """SIGTERM (what a supervisor or the demo sends) takes the same clean path as Ctrl-C."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
