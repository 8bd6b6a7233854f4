"""Every message between learner and workers, as pydantic models shared by server and client.

Paths are versioned under `/v1`. The learner is the only source of truth: workers pull leases, push
rollouts and report what they have loaded; rewards are recomputed by the learner, never taken from a
worker. Sizes are bounded here so a malformed or hostile body fails validation, not the trainer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

API = "/v1"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PolicyInfo(_Msg):
    """One immutable published policy version."""

    version: int = Field(ge=0, description="optimizer steps applied to the initial model")
    info_hash: str = Field(description="hex info-hash of the version's torrent (v1 hash of a hybrid torrent)")
    torrent_b64: str = Field(description="the .torrent file, base64; its tracker is the learner's /announce")
    sha256: str = Field(description="SHA-256 of model.safetensors, checked after the swarm download")
    size_bytes: int = Field(ge=0)
    published_at: float = Field(description="learner wall clock (s since epoch) when seeding began")
    delta_base: int | None = Field(default=None, description="version the delta applies to (None: no delta)")
    delta_info_hash: str | None = None
    delta_torrent_b64: str | None = Field(default=None, description="torrent of model.delta (see broadcast/delta)")
    delta_size_bytes: int = Field(default=0, ge=0)
    slot: int = Field(default=0, ge=0, description="this worker's share of the pieces to fetch first ...")
    slots: int = Field(default=1, ge=1, description="... out of this many shares (workers fetching now)")


class JoinRequest(_Msg):
    name: str = Field(max_length=128, description="human-readable worker name")
    usd_per_hour: float = Field(default=0.0, ge=0.0, description="price of this worker, for cost reports")
    echo2_version: str = Field(default="", max_length=32, description="the worker's echo2 version; "
                               "the learner refuses another major.minor (409)")


def compatible(a: str, b: str) -> bool:
    """Same major.minor: the wire protocol may change between minor versions while echo2 is 0.x."""
    return a.split(".")[:2] == b.split(".")[:2]


class JoinResponse(_Msg):
    worker_id: str
    session_token: str = Field(description="this worker's own Bearer token for every later call")
    tracker_key: str = Field(description="this worker's key for the tracker: announce to /announce/{key}")
    run_id: str
    task: str
    group_size: int = Field(description="G: samples per prompt")
    max_new_tokens: int
    temperature: float
    staleness: int = Field(description="S: a rollout of version x is usable by learner step t iff t - x <= S")
    heartbeat_s: float
    model_files: list[str] = Field(description="config/tokenizer files to fetch once from /v1/model/files/{name}")
    policy: PolicyInfo


class LeaseRequest(_Msg):
    worker_id: str
    version: int = Field(ge=0, description="policy version the worker will generate with")
    max_prompts: int = Field(default=8, ge=1, le=256)


class PromptItem(_Msg):
    prompt_id: int
    prompt_token_ids: list[int] = Field(description="chat-templated prompt, tokenized by the learner")


class Lease(_Msg):
    lease_id: str
    version: int
    prompts: list[PromptItem]
    deadline_s: float = Field(description="seconds from now after which the prompts are leased again")


class LeaseResponse(_Msg):
    status: Literal["ok", "wait", "update", "standby", "finished"]
    lease: Lease | None = None
    latest_version: int
    detail: str = ""


class Sample(_Msg):
    prompt_id: int
    sample_idx: int = Field(ge=0, description="index within the prompt's group of G")
    completion_token_ids: list[int] = Field(max_length=8192)
    logprobs: list[float] = Field(max_length=8192, description="behaviour log-prob of each completion token")
    finish_reason: str = ""


class RolloutBatch(_Msg):
    worker_id: str
    lease_id: str
    version: int = Field(ge=0, description="policy version that generated every sample in the batch")
    samples: list[Sample] = Field(max_length=65536)
    gen_s: float = Field(default=0.0, ge=0.0, description="wall time the engine spent generating the batch")


class SubmitResult(_Msg):
    """Samples admitted and rejected. `rejected` maps a reason to a sample count: stale (more than S
    versions old), duplicate (already admitted), late (the lease expired and the prompt was leased again),
    not_leased, version_mismatch, invalid_samples (schema-valid but wrong: lengths, token ids, log-probs)."""

    accepted: int = 0
    stale: int = 0
    duplicate: int = 0  # duplicate + late
    invalid: int = 0  # not_leased + version_mismatch + invalid_samples
    rejected: dict[str, int] = Field(default_factory=dict)
    detail: str = ""


class Heartbeat(_Msg):
    worker_id: str
    version_loaded: int = Field(ge=-1, description="-1 until the first version is loaded")
    downloading_version: int | None = None
    download_progress: float = Field(default=0.0, ge=0.0, le=1.0)
    tokens_per_s: float = Field(default=0.0, ge=0.0)
    upload_bytes: int = Field(default=0, ge=0, description="bytes this worker has uploaded to the swarm")
    ready_version: int = Field(default=-1, ge=-1, description="a version fully downloaded (pieces verified), "
                               "waiting for the lease in progress to end before it is loaded")
    swap_s: float = Field(default=0.0, ge=0.0, description="the last swap's work: hash check or delta rebuild, "
                          "plus the engine reload")


class HeartbeatReply(_Msg):
    latest_version: int
    finished: bool


class LeaveRequest(_Msg):
    worker_id: str


class WorkerView(_Msg):
    worker_id: str
    name: str
    version_loaded: int
    downloading_version: int | None
    download_progress: float
    tokens_per_s: float
    rollouts: int
    active: bool
    standby: bool = False
    leased_prompts: int = 0  # prompts of its leases not yet returned


class Status(_Msg):
    run_id: str
    step: int
    target_steps: int
    version: int
    finished: bool
    workers: list[WorkerView]
    last_metrics: dict[str, float | int | str | None] = Field(default_factory=dict)
