"""Fakes of what a `Worker` is given — the learner client, the torrent session and the engine — for unit tests
of its swap, rejoin and late-join logic. Versions are real files with real .torrent files and SHA-256s (and
real deltas); only the transfer is faked: a fetch completes on the next poll by copying the learner's file,
unless the test holds that version back."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

from echo2cli.broadcast.delta import encode_delta
from echo2cli.broadcast.digest import file_digest
from echo2cli.broadcast.torrent import make_torrent
from echo2cli.errors import ProtocolError, SessionLost
from echo2cli.layout import VersionKey
from echo2cli.protocol import HeartbeatReply, JoinResponse, LeaseResponse, PolicyInfo, SubmitResult
from echo2cli.worker.engine import Completion

SIZE = 1 << 16


class Published:
    """The learner's side: versions as files, each with its torrent, and a delta against its predecessor."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.policies: dict[int, PolicyInfo] = {}

    def publish(
        self, version: int, *, delta: bool = True, adapter: bool = False, content: bytes | None = None
    ) -> PolicyInfo:
        """`adapter`: the version is marked as LoRA adapters; `content`: the file's bytes (default: the previous
        version's with a few changed, or random)."""
        full = VersionKey(version)
        full.path(self.root).parent.mkdir(parents=True)
        base = self.policies.get(version - 1)
        data = bytearray(os.urandom(SIZE) if base is None else VersionKey(version - 1).path(self.root).read_bytes())
        data[version * 64 : version * 64 + 64] = os.urandom(64)  # a step changes a few weights
        full.path(self.root).write_bytes(content if content is not None else bytes(data))
        torrent = make_torrent(full.dir(self.root), "http://127.0.0.1:9/announce")
        policy = PolicyInfo(
            version=version,
            info_hash=torrent.info_hash,
            torrent_b64=torrent.b64,
            digest=file_digest(full.path(self.root)),
            size_bytes=full.path(self.root).stat().st_size,
            published_at=time.time(),
            adapter=adapter,
        )
        if base is not None and delta:
            key = VersionKey(version, delta=True)
            header = encode_delta(VersionKey(version - 1).path(self.root), full.path(self.root), key.path(self.root))
            dt = make_torrent(key.dir(self.root), "http://127.0.0.1:9/announce")
            policy = policy.model_copy(
                update={
                    "delta_base": version - 1,
                    "delta_info_hash": dt.info_hash,
                    "delta_torrent_b64": dt.b64,
                    "delta_size_bytes": header["delta_bytes"],
                }
            )
        self.policies[version] = policy
        return policy


LORA_LAYERS = {"model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.v_proj.weight": (4, 8)}


def lora_base() -> bytes:
    """A base model's safetensors file for LoRA tests: two small layers."""
    import torch
    from safetensors.torch import save

    return save({k: torch.randn(shape).to(torch.bfloat16) for k, shape in LORA_LAYERS.items()})


def lora_adapter(rank: int, a_shape: tuple[int, int] | None = None) -> bytes:
    """Adapters of `rank` for every layer of `lora_base` (PEFT's names); `a_shape`: the first lora_A's shape
    instead of the right one."""
    import torch
    from safetensors.torch import save

    tensors = {}
    for name, (out, inp) in LORA_LAYERS.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{stem}.lora_A.weight"] = torch.randn(a_shape or (rank, inp)).to(torch.bfloat16)
        tensors[f"{stem}.lora_B.weight"] = torch.randn(out, rank).to(torch.bfloat16)
        a_shape = None
    return save(tensors)


class FakeNode:
    """A torrent session with no peers: what is fetched arrives on the next poll, unless its version is held."""

    def __init__(self, published: Path) -> None:
        self.published = published
        self.transfers: dict = {}
        self.fetched: list[int] = []  # versions, full or delta, in the order they were asked for
        self.removed: list[int] = []
        self.held: set[int] = set()
        self.tracker_key = ""
        self.bytes = 0

    def fetch(self, key, data, save_path, slot=None):
        self.fetched.append(key.version)
        self.transfers[key] = SimpleNamespace(
            finished_at=None, started=time.time(), hash_failures=0, web_seed_at=None, dir=save_path
        )
        return self.transfers[key]

    def seed(self, key, data, save_path):
        self.transfers[key] = SimpleNamespace(
            finished_at=time.time(), started=time.time(), hash_failures=0, web_seed_at=None
        )

    def poll(self) -> None:
        for key, t in self.transfers.items():
            if t.finished_at is None and key.version not in self.held:
                key.path(t.dir).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(key.path(self.published), key.path(t.dir))
                t.finished_at = time.time()

    def check(self, key) -> None:
        pass

    def recheck(self, key) -> None:
        self.transfers[key].finished_at = None

    def progress(self, key) -> float:
        t = self.transfers.get(key)
        return 1.0 if t is not None and t.finished_at is not None else 0.0

    def download_bytes(self, key) -> int:
        return self.bytes

    def upload_bytes(self, key=None) -> int:
        return 0

    def remove(self, key, delete_dir=None) -> None:
        if self.transfers.pop(key, None) is not None:
            self.removed.append(key.version)
        if delete_dir is not None:
            shutil.rmtree(delete_dir, ignore_errors=True)

    def set_tracker_key(self, key: str) -> None:
        self.tracker_key = key

    def close(self) -> None:
        pass


class FakeLearner:
    """The learner as a worker's client sees it. `lease_answers`: what /lease answers next (a LeaseResponse, or an
    exception to raise); then 'wait'."""

    def __init__(self, published: Published, run_id: str = "run1", staleness: int = 1) -> None:
        self.published, self.run_id, self.staleness = published, run_id, staleness
        self.latest = 0
        self.joins = 0
        self.join_requests: list = []
        self.context_len = 0  # what the join answer says the run's sequences need (0 = not said)
        self.lease_answers: list = []
        self.heartbeats: list = []
        self.unreachable_s = 1.0
        self.policy_asks: list[int | None] = []  # the version each /policy call asked for (None: the newest)
        self.lora = None  # the LoraSpec the join answer carries

    def join(self, req) -> JoinResponse:
        self.joins += 1
        self.join_requests.append(req)
        return JoinResponse(
            worker_id=f"w{self.joins}",
            session_token="s" * 32,
            tracker_key=f"key{self.joins}",
            run_id=self.run_id,
            task="arithmetic",
            group_size=2,
            max_new_tokens=4,
            context_len=self.context_len,
            temperature=1.0,
            staleness=self.staleness,
            heartbeat_s=3600.0,
            model_files=["config.json"],
            policy=self.published.policies[self.latest],
            lora=self.lora,
        )

    def model_file(self, name: str) -> bytes:
        return b"{}"

    def policy(self, worker_id: str = "", version: int | None = None) -> PolicyInfo:
        self.policy_asks.append(version)
        if version is not None and version not in self.published.policies:
            raise ProtocolError(f"version {version} was never published")
        return self.published.policies[self.latest if version is None else version]

    def heartbeat(self, hb) -> HeartbeatReply:
        self.heartbeats.append(hb)
        return HeartbeatReply(latest_version=self.latest, finished=False)

    def lease(self, req) -> LeaseResponse:
        answer = self.lease_answers.pop(0) if self.lease_answers else LeaseResponse(status="wait", latest_version=0)
        if isinstance(answer, Exception):
            raise answer
        return answer.model_copy(update={"latest_version": self.latest})

    def submit(self, batch) -> SubmitResult:
        return SubmitResult(accepted=len(batch.samples))

    def leave(self, worker_id: str) -> None:
        pass

    def close(self) -> None:
        pass

    def restart(self, at_version: int, run_id: str | None = None) -> None:
        """The learner resumed from a checkpoint at `at_version`: the next call as a worker finds no session."""
        self.latest = at_version
        self.run_id = run_id or self.run_id
        self.lease_answers.insert(0, SessionLost("the learner no longer knows this worker: join again"))


class FakeEngine:
    """Generates two tokens per sample; remembers the weights it started with and every reload."""

    def __init__(self, engine_dir: Path, context_len: int = 1024, lora=None) -> None:
        self.context_len, self.lora = context_len, lora
        self.started_with = (engine_dir / "model.safetensors").resolve()
        self.reloads: list[Path] = []
        self.adapters: list[tuple[int, Path]] = []
        self.reloaded: list[bytes] = []  # the weights file of each reload, read as the engine would
        self.closed = False

    def generate(self, prompts, *, n, temperature, max_new_tokens) -> list[list[Completion]]:
        return [[Completion([1, 2], [-0.1, -0.2], "length") for _ in range(n)] for _ in prompts]

    def reload(self, weights_dir: Path) -> float:
        self.reloads.append(weights_dir)
        self.reloaded.append((weights_dir / "model.safetensors").read_bytes())
        return 0.01

    def load_adapter(self, version: int, adapter_dir: Path) -> float:
        self.adapters.append((version, adapter_dir))
        return 0.01

    def close(self) -> None:
        self.closed = True
