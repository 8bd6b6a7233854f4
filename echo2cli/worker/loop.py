"""`echo2 worker --join URL`: join, fetch each policy version from the swarm, generate, submit.

    join → fetch config/tokenizer (HTTP, once) → fetch the latest version (torrent) → start vLLM
    loop:  swap in a finished download (verified) → lease prompts → generate G samples each → submit
    a newer version announced (lease reply or heartbeat)? start fetching it at once, in the background
    (libtorrent threads), so it downloads while the current lease generates; a download in progress is
    finished first, from the first fetch on, while the engine is not even started (versions.py)
    a download complete? the prepare thread hashes it (a delta: rebuilds it) while the engine still
    generates, so the swap between leases is only the engine's reload
    Ctrl-C / SIGTERM / learner finished: hand back leases, leave, stop.
    learner gone: retry with backoff for up to learner_restart_s; when it is back (resumed from a
    checkpoint, same run id) join again and go on with the engine and versions held. If it resumed at a
    version older than ours (it crashed after its last checkpoint), load its version before generating.

A version is loaded only after libtorrent verified every piece and the file's digest matches the
learner's. While the next version downloads, the worker keeps generating with the one it has (that
is what staleness S allows); the learner answers `update` once the worker is more than S behind.
Every load is appended to `<work_dir>/events.jsonl` (tests and benchmarks read it).

The learner client, the torrent session and the engine are passed in (`create_worker` builds the real ones),
so swap, rejoin and late-join logic run in unit tests without sockets or vLLM.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from rich.console import Console

from echo2cli.broadcast import kernels
from echo2cli.broadcast.node import TorrentNode
from echo2cli.config import WorkerConfig
from echo2cli.errors import BroadcastError, LeaseLost, ProtocolError, SessionLost
from echo2cli.hardware import has_cuda
from echo2cli.layout import VERSIONS_DIR, WEIGHTS_FILE
from echo2cli.metrics import MetricsWriter
from echo2cli.protocol import (
    Heartbeat,
    HeartbeatReply,
    JoinRequest,
    JoinResponse,
    Lease,
    LeaseRequest,
    LoraSpec,
    PolicyInfo,
    RolloutBatch,
    Sample,
)
from echo2cli.tasks.episodes import Transcript
from echo2cli.textsafe import DETAIL_LEN, shown
from echo2cli.tls import trust_for_torrents
from echo2cli.units import mbps_to_bytes_per_s
from echo2cli.worker.client import LearnerClient
from echo2cli.worker.engine import Completion
from echo2cli.worker.multiturn import EpisodePlayer
from echo2cli.worker.trust import safe_model_file
from echo2cli.worker.versions import VersionStore

PREPARE_POLL_S = 0.1  # how often the prepare thread looks for a complete download
DEFAULT_CONTEXT_LEN = 1024  # the engine's context when neither --max-model-len nor the learner says


class EngineLike(Protocol):
    def generate(
        self, prompts: list[list[int]], *, n: int, temperature: float, max_new_tokens: int
    ) -> list[list[Completion]]: ...

    def reload(self, weights_dir: Path) -> float: ...

    def load_adapter(self, version: int, adapter_dir: Path) -> float: ...

    def close(self) -> None: ...


@dataclass
class Stats:
    """What a worker did, printed when it stops."""

    rollouts: int = 0
    accepted: int = 0
    stale: int = 0
    leases: int = 0
    standby_s: float = 0.0
    rejoins: int = 0


def rollout_batch(worker_id: str, lease: Lease, groups: Sequence[Sequence[Completion | Transcript]]) -> RolloutBatch:
    """The engine's completions for a lease, as the batch returned to the learner. A prompt the engine could not
    take (longer than its context) has no completions: it is handed back, and the learner leases it elsewhere."""
    samples = [
        Sample(
            prompt_id=p.prompt_id,
            sample_idx=i,
            completion_token_ids=c.token_ids,
            logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            policy_mask=c.policy_mask if isinstance(c, Transcript) else None,
        )
        for p, group in zip(lease.prompts, groups, strict=True)
        for i, c in enumerate(group)
    ]
    unservable = [p.prompt_id for p, group in zip(lease.prompts, groups, strict=True) if not group]
    return RolloutBatch(
        worker_id=worker_id, lease_id=lease.lease_id, version=lease.version, samples=samples, unservable=unservable
    )


def generate_lease(
    engine: EngineLike,
    episodes: EpisodePlayer | None,
    lease: Lease,
    info: JoinResponse,
    context_len: int,
    client: LearnerClient | None = None,
    worker_id: str = "",
) -> Sequence[Sequence[Completion | Transcript]]:
    """G completions of each leased prompt, or G played episodes of a multi-turn task (`client`, `worker_id`: for
    the episodes the learner steps)."""
    if episodes is not None:
        return episodes.play(engine, lease, context_len, client, worker_id)
    prompts = [p.prompt_token_ids for p in lease.prompts]
    return engine.generate(prompts, n=info.group_size, temperature=info.temperature, max_new_tokens=info.max_new_tokens)


class Worker:
    join_info: JoinResponse  # the run's settings, from the last join

    def __init__(
        self,
        cfg: WorkerConfig,
        *,
        client: LearnerClient,
        make_node: Callable[[str], TorrentNode],
        make_engine: Callable[[Path, int, LoraSpec | None], EngineLike],
        console: Console | None = None,
    ) -> None:
        """`make_node(tracker_key)`: the torrent session, once joined; `make_engine(engine_dir, context_len, lora)`:
        the engine, once the first version is here (`lora`: the run's adapters, None for full weights)."""
        self.cfg, self.client, self.make_node, self.make_engine = cfg, client, make_node, make_engine
        self.console = console or Console(stderr=True, quiet=True)
        # absolute: the engine directory links to version files, and a relative link target would break
        work_dir = cfg.work_dir or Path.home() / ".cache" / "echo2" / "workers" / cfg.name
        self.work_dir = work_dir.expanduser().resolve()
        self.node: TorrentNode | None = None
        self.store: VersionStore | None = None
        self.engine: EngineLike | None = None
        self.context_len = 0  # the engine's: --max-model-len, else the run's (join answer); 0 until it starts
        self.episodes: EpisodePlayer | None = None  # a multi-turn task's environment
        self.worker_id = ""
        self.swap_s = 0.0  # the last swap's stall: the reload (plus hash check or rebuild: verify_between_leases)
        self.tokens_per_s = 0.0
        self.stop = threading.Event()
        self.standby = False
        self._closing = contextlib.ExitStack()

    # -- the run -------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Join, start on the newest version, then lease and generate until the learner finishes or we are
        stopped; returns what was done (`Stats`)."""
        stats = Stats()
        with self._closing:
            self._closing.callback(self.client.close)
            info = self._join()
            self._open(info)
            self._closing.callback(self._leave)
            try:
                self._start(info)
                while not self.stop.is_set() and self._work_once(stats):
                    pass
            except KeyboardInterrupt:
                self.console.log("interrupted: handing leases back")
        return asdict(stats)

    def _join(self) -> JoinResponse:
        cfg = self.cfg
        info = self.client.join(self._join_request())
        self.client.unreachable_s = cfg.learner_restart_s  # from now on, an absent learner may be restarting
        self.join_info, self.worker_id = info, info.worker_id
        self.console.log(f"joined {shown(cfg.join, DETAIL_LEN)} as {shown(self.worker_id)} (run {shown(info.run_id)})")
        return info

    def _join_request(self) -> JoinRequest:
        """Our engine's context once it is fixed (by --max-model-len, or the engine running); before that None:
        the engine will take the run's own context, which fits every prompt the learner leases."""
        context = self.cfg.max_model_len or self.context_len or None
        return JoinRequest(name=self.cfg.name, usd_per_hour=self.cfg.usd_per_hour, max_model_len=context)

    def _open(self, info: JoinResponse) -> None:
        """The work dir, events log, torrent session and version store; all closed when the run ends."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        events = self._closing.enter_context(contextlib.closing(MetricsWriter(self.work_dir / "events.jsonl")))
        trust_for_torrents(self.cfg.ca_cert, self.work_dir)  # before the torrent session: https tracker
        self.node = self._closing.enter_context(contextlib.closing(self.make_node(info.tracker_key)))
        self.store = VersionStore(
            self.node,
            self.work_dir / VERSIONS_DIR,
            events,
            self.console.log,
            chain_limit=info.staleness + 1,
            lora=info.lora,
            merge_adapters=merges_adapters(self.cfg.lora_load),
        )

    def _leave(self) -> None:
        """Stop beating, hand our leases back (quick: a gone learner's lease timeout covers us), stop the engine."""
        self.stop.set()
        with contextlib.suppress(Exception):
            self.client.leave(self.worker_id)
        if self.engine is not None:
            self.engine.close()

    def _start(self, info: JoinResponse) -> None:
        """Fetch the newest version and start the engine on it. The heartbeat runs from the first fetch on, so a
        late joiner on a slow link follows the newest version (versions.py) while its first download runs."""
        assert self.store is not None
        policy = info.policy
        if policy.adapter:  # a LoRA run: the engine starts on the base, version 0; the newest adapters follow
            policy = self.client.policy(self.worker_id, 0)
            if policy.adapter or info.lora is None:
                raise BroadcastError("the learner announces LoRA versions without a full base to apply them to")
        self.store.start(policy)
        engine_dir = self._prepare_engine_dir(info)
        threading.Thread(target=self._heartbeat_loop, daemon=True, name="heartbeat").start()
        self._wait_download()
        first = self.store.take()
        link_weights(engine_dir, self.store.weights(first.policy.version))
        self.context_len = self.cfg.max_model_len or info.context_len or DEFAULT_CONTEXT_LEN
        self.engine = self.make_engine(engine_dir, self.context_len, None if self.store.merge_adapters else info.lora)
        self.episodes = EpisodePlayer(info, self.cfg.env_task, engine_dir) if info.max_turns else None
        self.store.record_load(self.worker_id, first, 0.0, t_swap=0.0)
        self._send_heartbeat()
        self.console.log(f"engine up with version {first.policy.version}")
        if info.policy.version > first.policy.version:
            self._follow(info.policy.version)
        if not self.cfg.verify_between_leases:
            threading.Thread(target=self._prepare_loop, daemon=True, name="prepare").start()

    def _prepare_engine_dir(self, info: JoinResponse) -> Path:
        engine_dir = self.work_dir / "engine"
        engine_dir.mkdir(parents=True, exist_ok=True)
        for name in info.model_files:  # protocol.JoinResponse allows only MODEL_FILES; checked again here
            safe_model_file(engine_dir, name).write_bytes(self.client.model_file(name))
        return engine_dir

    # -- versions ------------------------------------------------------------------------------------

    def _wait_download(self) -> None:
        assert self.store is not None
        while not self.store.ready():
            if self.stop.is_set():
                raise KeyboardInterrupt
            self.store.prepare()  # returns at once while the prepare thread is at it
            if not self.store.ready():
                time.sleep(0.05)

    def _prepare_loop(self) -> None:
        """Verify each complete download (hash it, or rebuild a delta) while the engine generates with the
        version it runs, so the swap between leases is only the reload."""
        assert self.store is not None
        while not self.stop.wait(PREPARE_POLL_S):
            self.store.prepare()

    def _follow(self, latest: int, block: bool = True) -> None:
        assert self.store is not None
        self.store.follow(
            latest,
            lambda: self.client.policy(self.worker_id),
            block=block,
            policy_of=lambda version: self.client.policy(self.worker_id, version),
        )

    def _swap_if_ready(self) -> None:
        """Between leases: load a verified download into the engine, in place."""
        assert self.store is not None and self.engine is not None
        with self.store.lock:  # no fetch starts halfway through a swap
            t0 = time.perf_counter()
            if self.cfg.verify_between_leases:
                self.store.prepare()
            if self.store.pending is None or not self.store.ready():
                return
            policy = self.store.pending.policy
            version = policy.version
            t_reload = load_version(self.engine, self.store, policy)
            pending = self.store.take()  # after the reload: a heartbeat meanwhile still reports the old version
            if not policy.adapter:  # the engine directory's weights stay the base in a LoRA run
                link_weights(self.work_dir / "engine", self.store.weights(version))
            self.swap_s = time.perf_counter() - t0
            self.store.record_load(self.worker_id, pending, t_reload, t_stall=self.swap_s)
            self.console.log(f"loaded version {version} (reload {t_reload:.2f} s)")
            self._send_heartbeat()
            self.store.prune(self.join_info.staleness, keep_base=self.join_info.lora is not None)

    # -- heartbeats ----------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self.stop.wait(self.join_info.heartbeat_s):
            try:
                reply = self._send_heartbeat()
                if reply.finished:
                    self.stop.set()
                else:  # from the first fetch on: a late joiner follows the newest
                    self._follow(reply.latest_version, block=False)
            except SessionLost:
                pass  # the learner restarted: the main loop joins again
            except Exception as exc:  # the main loop reports persistent failures; keep beating
                self.console.log(f"heartbeat failed: {shown(exc, DETAIL_LEN)}")

    def _send_heartbeat(self) -> HeartbeatReply:
        assert self.store is not None
        return self.client.heartbeat(
            Heartbeat(
                worker_id=self.worker_id,
                version_loaded=self.store.loaded if self.engine is not None else -1,
                swap_s=self.swap_s,
                tokens_per_s=self.tokens_per_s,
                **self.store.heartbeat_fields(),
            )
        )

    # -- leases --------------------------------------------------------------------------------------

    def _work_once(self, stats: Stats) -> bool:
        """One lease: ask, generate, submit (or wait, fetch, stand by). False once the learner finished."""
        assert self.store is not None
        try:
            self._swap_if_ready()
            ask = LeaseRequest(
                worker_id=self.worker_id, version=self.store.loaded, max_prompts=self.cfg.prompts_per_lease
            )
            resp = self.client.lease(ask)
            if resp.status == "finished":
                return False
            self._follow(resp.latest_version)
            if resp.status == "ok" and resp.lease is not None:
                batch = self._generate(resp.lease)
                result = self.client.submit(batch)
                stats.leases, stats.rollouts = stats.leases + 1, stats.rollouts + len(batch.samples)
                stats.accepted, stats.stale = stats.accepted + result.accepted, stats.stale + result.stale
            elif resp.status == "update" and self.store.pending is not None:
                self._wait_download()
            elif resp.status == "standby":
                if not self.standby:
                    self.console.log(f"standby: {shown(resp.detail, DETAIL_LEN)}")
                stats.standby_s += 0.5
                time.sleep(0.5)  # keep fetching and seeding versions; ask again
            else:
                time.sleep(0.1)
            if self.standby and resp.status != "standby":
                self.console.log("active again")
            self.standby = resp.status == "standby"
        except SessionLost as exc:
            self._rejoin(exc)
            stats.rejoins += 1
        except LeaseLost as exc:  # the learner leases its prompts again
            self.console.log(f"lease dropped: {shown(exc, DETAIL_LEN)}")
        return True

    def _generate(self, lease: Lease) -> RolloutBatch:
        assert self.engine is not None
        info = self.join_info
        t0 = time.perf_counter()
        groups = generate_lease(self.engine, self.episodes, lease, info, self.context_len, self.client, self.worker_id)
        gen_s = time.perf_counter() - t0
        batch = rollout_batch(self.worker_id, lease, groups)
        if n := len(batch.unservable):
            self.console.log(f"{n} prompt(s) too long for the engine's context of {self.context_len}: handed back")
        self.tokens_per_s = sum(len(s.completion_token_ids) for s in batch.samples) / max(gen_s, 1e-9)
        if self.cfg.max_rollouts_per_s:  # emulate a slower GPU: the lease takes len/rate at least
            self.stop.wait(max(0.0, len(batch.samples) / self.cfg.max_rollouts_per_s - gen_s))
        return batch

    def _rejoin(self, why: Exception) -> None:
        """The learner restarted and forgot us: join again, keeping the engine and the versions we hold.
        A lease in progress was lost with the old session; the resumed learner leases its prompts again."""
        assert self.store is not None and self.node is not None
        self.console.log(f"{shown(why, DETAIL_LEN)}: joining again")
        cfg = self.cfg
        info = self.client.join(self._join_request())
        if info.run_id != self.join_info.run_id:
            raise ProtocolError(
                f"learner at {cfg.join} now runs another run ({info.run_id}, not {self.join_info.run_id}): start the "
                "worker again to join it"
            )
        with self.store.lock:
            self.join_info, self.worker_id = info, info.worker_id
            self.node.set_tracker_key(info.tracker_key)
            behind = self.store.ahead_of(info.policy.version)
            if behind:  # versions after the learner's checkpoint no longer exist: go back to its latest
                self.store.go_back(info.policy)
        self.console.log(f"joined again as {shown(self.worker_id)}; the learner is at version {info.policy.version}")
        if behind:
            self._wait_download()
            self._swap_if_ready()


def load_version(engine: EngineLike, store: VersionStore, policy: PolicyInfo) -> float:
    """A verified version into the engine, in place; returns the engine's seconds. Full weights are reloaded. A LoRA
    run's adapters (checked, and merged if so asked, by `VersionStore.prepare`) are loaded as vLLM adapters, or
    their merge with the base is reloaded and then removed: the engine has it."""
    version_dir = store.weights(policy.version).parent
    if not policy.adapter:
        return engine.reload(version_dir)
    if not store.merge_adapters:
        return engine.load_adapter(policy.version, version_dir)
    try:
        return engine.reload(store.merged(policy.version))
    finally:
        shutil.rmtree(store.merged(policy.version), ignore_errors=True)


def merges_adapters(lora_load: str) -> bool:
    """A LoRA run's versions are merged into the base and reloaded (`--lora-load`; auto: on CPU, where vLLM's LoRA path
    generated ~5x slower than the base alone, docs/BENCHMARKS.md), not loaded as vLLM adapters."""
    return lora_load == "merge" or (lora_load == "auto" and not has_cuda())


def link_weights(engine_dir: Path, weights: Path) -> None:
    """The engine directory's weights are the version loaded (replaced atomically): vLLM reads them at start, and a
    version the worker pruned must not leave a dangling link."""
    link = engine_dir / WEIGHTS_FILE
    tmp = link.with_name(WEIGHTS_FILE + ".link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(weights)
    tmp.replace(link)


def create_worker(cfg: WorkerConfig, console: Console | None = None) -> Worker:
    """A worker with the real learner client, libtorrent session and vLLM engine."""
    client = LearnerClient(
        cfg.join,
        cfg.token,
        request_timeout_s=cfg.request_timeout_s,
        unreachable_s=cfg.unreachable_s,
        ca_cert=cfg.ca_cert,
    )

    def make_node(tracker_key: str) -> TorrentNode:
        return TorrentNode(
            cfg.bt_listen,
            upload_limit_bytes_s=mbps_to_bytes_per_s(cfg.uplink_mbps),
            download_limit_bytes_s=mbps_to_bytes_per_s(cfg.downlink_mbps),
            tracker_key=tracker_key,
            web_seed=cfg.join,
            web_seed_mode=cfg.web_seed,
            learner_ip=learner_ip(cfg.join),
        )

    def make_engine(engine_dir: Path, context_len: int, lora: LoraSpec | None) -> EngineLike:
        from echo2cli.worker.engine import Engine, GpuSettings

        return Engine(
            engine_dir,
            kv_cache_gib=cfg.kv_cache_gib,
            max_model_len=context_len,
            gpu=GpuSettings(cfg.gpu_memory_utilization, cfg.tensor_parallel_size, cfg.max_num_seqs),
            seed=cfg.seed,
            dtype=cfg.dtype,
            lora=lora,
            adapters_kept=worker.join_info.staleness + 2,  # every admissible version, and the one arriving
            wire=worker.join_info.wire_dtype,
            in_process=True,  # on CPU: no engine processes of its own to start (engine.py)
        )

    worker = Worker(cfg, client=client, make_node=make_node, make_engine=make_engine, console=console)
    threading.Thread(target=kernels.warm_up, name="warm-up", daemon=True).start()  # before the first delta
    return worker


def learner_ip(url: str) -> str:
    """The learner's IPv4 address, to tell its BitTorrent connection apart (`TorrentNode._spare_learner`); "" if
    its name does not resolve (then it is never spared)."""
    try:
        return socket.gethostbyname(urlsplit(url).hostname or "")
    except (OSError, UnicodeError):
        return ""


def install_sigterm_as_interrupt() -> None:
    """SIGTERM (what a supervisor or the demo sends) takes the same clean path as Ctrl-C."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
