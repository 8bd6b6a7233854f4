"""Every message between learner and workers, as pydantic models shared by server and client.

Paths are versioned under `/v1`. The learner is the only source of truth: workers pull leases, push
rollouts and report what they have loaded; rewards are recomputed by the learner, never taken from a
worker. Sizes are bounded here so a malformed or hostile body fails validation, not the trainer.

Bounds go both ways: a worker may have joined someone else's learner, or a plain-http link may be
tampered with, so what the learner sends (file names, sizes, counts, hashes) is bounded and checked
here too: a hostile JoinResponse cannot name a file outside the worker's engine directory.

Every number has a physical bound (the MAX_* below) and no float may be inf or NaN: a field with only `ge=0`
accepted 10**309, which overflowed the learner's rate arithmetic (a 500 for every worker's next call). The
bounds sit far above anything real and far below what breaks a float. The one exception is a sample's
log-probs, which admission checks itself so that a bad one rejects its group, not the whole batch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

API = "/v1"
# Config and tokenizer files a worker fetches once at join (weights travel by torrent): the only names a
# learner may ask a worker to write, each a plain file name inside the worker's engine directory.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
MAX_MODEL_FILE_BYTES = 64 << 20  # the largest tokenizer.json of common LLMs is ~11 MB
MAX_TORRENT_B64 = 16 << 20  # a .torrent of a 64 GB version with 4 MiB pieces is ~0.5 MB (v1 SHA-1 pieces)
MAX_VERSION_BYTES = 1 << 40
MAX_COMPLETION_TOKENS = 65536
MAX_PROMPT_TOKENS = 1 << 17
MAX_BYTES = 1 << 50  # 1 PiB: any byte counter of any run
MAX_VERSION = 1 << 31  # optimizer steps
MAX_PROMPT_ID = 1 << 62
MAX_COUNT = 1 << 62  # samples, rollouts, prompts counted over a run
MAX_TOKENS_PER_S = 1e9  # one worker's generation rate
MAX_SECONDS = 1e7  # about 116 days: any duration a message reports
MAX_EPOCH_S = 1e11  # a wall clock reading (s since 1970), until the year 5138
MAX_USD_PER_HOUR = 1e4
MAX_TEXT = 1024  # details and reasons
MAX_SHARES = 1 << 20  # first-copy shares of a version (the learner cuts about 64 plus one per worker)
Hex40 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{40}$")]
Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Token = Annotated[str, StringConstraints(max_length=256)]
Id = Annotated[str, StringConstraints(max_length=64)]  # worker and lease ids
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]  # admission checks the model's own vocabulary
PromptId = Annotated[int, Field(ge=0, le=MAX_PROMPT_ID)]
Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Reason = Annotated[str, StringConstraints(max_length=64)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class PolicyInfo(_Msg):
    """One immutable published policy version."""

    version: int = Field(ge=0, le=MAX_VERSION, description="optimizer steps applied to the initial model")
    info_hash: Hex40 = Field(description="hex v1 info-hash of the version's torrent")
    torrent_b64: str = Field(
        max_length=MAX_TORRENT_B64, description="the .torrent file, base64; its tracker is the learner's /announce"
    )
    digest: Hex64 = Field(description="BLAKE3 of model.safetensors (broadcast/digest.py), checked after the download")
    size_bytes: int = Field(ge=0, le=MAX_VERSION_BYTES)
    published_at: float = Field(
        ge=0.0, le=MAX_EPOCH_S, description="learner wall clock (s since epoch) when seeding began"
    )
    delta_base: int | None = Field(
        default=None, ge=0, le=MAX_VERSION, description="version the delta applies to (None: no delta)"
    )
    delta_info_hash: Hex40 | None = None
    delta_torrent_b64: str | None = Field(
        default=None, max_length=MAX_TORRENT_B64, description="torrent of model.delta (see broadcast/delta)"
    )
    delta_size_bytes: int = Field(default=0, ge=0, le=MAX_VERSION_BYTES)
    adapter: bool = Field(
        default=False,
        description="the file is a LoRA adapter (JoinResponse.lora) on version 0's full weights, the frozen base",
    )
    slot: int = Field(
        default=0, ge=0, le=MAX_SHARES, description="this worker's share of the pieces to fetch first ..."
    )
    slots: int = Field(default=1, ge=1, le=MAX_SHARES, description="... out of this many shares ...")
    slot_width: int = Field(default=1, ge=1, le=MAX_SHARES, description="... and the shares after it, this many in all")


class LoraSpec(_Msg):
    """The LoRA adapters a run trains (`echo2 learner --lora-rank`): what a worker needs to load a version's
    adapter file into vLLM. The worker writes the adapter's config itself from these checked fields."""

    rank: int = Field(ge=1, le=512, description="r: the adapters' rank")
    alpha: int = Field(ge=1, le=65536, description="the update is (alpha / r) B A")
    targets: list[Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]] = Field(
        min_length=1, max_length=32, description="names of the linear layers that carry an adapter (q_proj, ...)"
    )


class JoinRequest(_Msg):
    name: str = Field(max_length=128, description="human-readable worker name")
    usd_per_hour: float = Field(
        default=0.0, ge=0.0, le=MAX_USD_PER_HOUR, description="price of this worker, for cost reports"
    )
    echo2_version: str = Field(
        default="",
        max_length=32,
        description="the worker's echo2 version; the learner refuses another major.minor (409)",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        le=1 << 24,
        description="the worker's engine context (prompt + completion tokens): longer prompts are never leased to it",
    )


def compatible(a: str, b: str) -> bool:
    """Same major.minor: the wire protocol may change between minor versions while echo2 is 0.x."""
    return a.split(".")[:2] == b.split(".")[:2]


class JoinResponse(_Msg):
    worker_id: str = Field(max_length=64)
    session_token: Token = Field(description="this worker's own Bearer token for every later call")
    tracker_key: str = Field(
        pattern=r"^[0-9A-Za-z_-]{1,128}$", description="this worker's key for the tracker: announce to /announce/{key}"
    )
    run_id: str = Field(max_length=64)
    task: str = Field(max_length=256)
    group_size: int = Field(ge=1, le=1024, description="G: samples per prompt")
    max_new_tokens: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    context_len: int = Field(
        default=0,
        ge=0,
        le=MAX_PROMPT_TOKENS + MAX_COMPLETION_TOKENS,
        description="prompt + completion tokens the run's longest sequence may take: the engine context a worker "
        "needs (0 = not said)",
    )
    temperature: float = Field(gt=0.0, le=100.0)
    staleness: int = Field(
        ge=0, le=1000, description="S: a rollout of version x is usable by learner step t iff t - x <= S"
    )
    heartbeat_s: float = Field(gt=0.0, le=3600.0)
    model_files: list[str] = Field(
        max_length=len(MODEL_FILES), description="config/tokenizer files to fetch once from /v1/model/files/{name}"
    )
    policy: PolicyInfo
    lora: LoraSpec | None = Field(default=None, description="versions after 0 are LoRA adapters (None: full weights)")
    wire_dtype: Literal["bf16", "fp16"] = Field(
        default="bf16", description="the dtype of every version's weights: the engine computes to match it"
    )
    max_turns: int = Field(
        default=0, ge=0, le=256, description="a multi-turn task's policy turns per episode (0: one completion)"
    )
    transcript_tokens: int = Field(
        default=0, ge=0, le=MAX_COMPLETION_TOKENS, description="a multi-turn task's tokens after the prompt, at most"
    )
    hidden_state: bool = Field(
        default=False,
        description="the multi-turn task's environment hides state (a card deal): the learner steps every episode "
        "(/v1/episodes/step) and leases carry no episode spec",
    )

    @field_validator("model_files")
    @classmethod
    def _known_plain_names(cls, names: list[str]) -> list[str]:
        """Only names from MODEL_FILES: a learner must not make a worker write `../x` or `/home/u/.bashrc`."""
        for name in names:
            if name not in MODEL_FILES:
                raise ValueError(f"model file {name[:80]!r} is not one of {', '.join(MODEL_FILES)}")
        return names


class LeaseRequest(_Msg):
    worker_id: Id
    version: int = Field(ge=0, le=MAX_VERSION, description="policy version the worker will generate with")
    max_prompts: int = Field(default=8, ge=1, le=256)


class PromptItem(_Msg):
    prompt_id: PromptId
    prompt_token_ids: list[TokenId] = Field(
        max_length=MAX_PROMPT_TOKENS, description="chat-templated prompt, tokenized by the learner"
    )
    episode: str | None = Field(
        default=None, max_length=1024, description="a multi-turn task's episode spec: the worker builds the same one"
    )


class EpisodeAction(_Msg):
    """One policy turn of an episode the learner steps (a task with hidden state)."""

    prompt_id: PromptId
    sample_idx: int = Field(ge=0, le=1024)
    turn: int = Field(ge=0, le=256, description="the episode's policy turn this action is (0: the first)")
    token_ids: list[TokenId] = Field(max_length=MAX_COMPLETION_TOKENS, description="the turn as sampled")


class StepRequest(_Msg):
    worker_id: Id
    lease_id: Id
    actions: list[EpisodeAction] = Field(max_length=65536)


class EpisodeStep(_Msg):
    done: bool
    env_token_ids: list[TokenId] = Field(
        max_length=MAX_PROMPT_TOKENS, description="what hands the model the next observation ([] once done)"
    )


class StepReply(_Msg):
    steps: list[EpisodeStep] = Field(max_length=65536, description="one per action, in order")


class Lease(_Msg):
    lease_id: Id
    version: Version
    prompts: list[PromptItem] = Field(max_length=256)  # no more than a worker asks for (LeaseRequest.max_prompts)
    deadline_s: float = Field(
        ge=0.0, le=MAX_SECONDS, description="seconds from now after which the prompts are leased again"
    )


class LeaseResponse(_Msg):
    status: Literal["ok", "wait", "update", "standby", "finished"]
    lease: Lease | None = None
    latest_version: Version
    detail: str = Field(default="", max_length=MAX_TEXT)


class Sample(_Msg):
    prompt_id: PromptId
    sample_idx: int = Field(ge=0, le=1024, description="index within the prompt's group of G")
    # the run's own cap (max_new_tokens) is checked at admission; this bounds what any run may ask for
    completion_token_ids: list[TokenId] = Field(max_length=MAX_COMPLETION_TOKENS)
    logprobs: list[Annotated[float, Field(allow_inf_nan=True)]] = Field(
        max_length=MAX_COMPLETION_TOKENS,
        description="behaviour log-prob of each completion token (admission rejects a group with one not finite)",
    )
    finish_reason: str = Field(default="", max_length=64)
    policy_mask: list[Annotated[int, Field(ge=0, le=1)]] | None = Field(
        default=None,
        max_length=MAX_COMPLETION_TOKENS,
        description="multi-turn transcripts: 1 where the policy sampled the token, 0 for environment tokens",
    )


class RolloutBatch(_Msg):
    worker_id: Id
    lease_id: Id
    version: int = Field(ge=0, le=MAX_VERSION, description="policy version that generated every sample in the batch")
    samples: list[Sample] = Field(max_length=65536)
    unservable: list[PromptId] = Field(
        default_factory=list,
        max_length=256,
        description="leased prompts the worker's engine cannot take (longer than its "
        "context): leased again to another worker",
    )


class SubmitResult(_Msg):
    """Samples admitted and rejected. `rejected` maps a reason to a sample count: stale (more than S
    versions old), duplicate (already admitted), late (the lease expired and the prompt was leased again),
    not_leased, version_mismatch, invalid_samples (schema-valid but wrong: lengths, token ids, log-probs)."""

    accepted: Count = 0
    stale: Count = 0
    duplicate: Count = 0  # duplicate + late
    invalid: Count = 0  # not_leased + version_mismatch + invalid_samples
    rejected: dict[Reason, Count] = Field(default_factory=dict, max_length=64)
    detail: str = Field(default="", max_length=MAX_TEXT)


class Heartbeat(_Msg):
    worker_id: Id
    version_loaded: int = Field(ge=-1, le=MAX_VERSION, description="-1 until the first version is loaded")
    downloading_version: Version | None = None
    download_progress: float = Field(default=0.0, ge=0.0, le=1.0)
    tokens_per_s: float = Field(default=0.0, ge=0.0, le=MAX_TOKENS_PER_S)
    upload_bytes: int = Field(default=0, ge=0, le=MAX_BYTES, description="bytes this worker has uploaded to the swarm")
    ready_version: int = Field(
        default=-1,
        ge=-1,
        le=MAX_VERSION,
        description="a version downloaded and verified (its digest, a delta rebuilt), "
        "waiting for the lease in progress to end before it is loaded",
    )
    swap_s: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_SECONDS,
        description="the last swap's stall: the engine reload (plus the hash check or delta rebuild, for a "
        "worker that does them between leases)",
    )


class HeartbeatReply(_Msg):
    latest_version: Version
    finished: bool


class LeaveRequest(_Msg):
    worker_id: Id


class WorkerView(_Msg):
    worker_id: Id
    name: str = Field(max_length=128)  # the worker's own words: escaped wherever shown (textsafe)
    version_loaded: int = Field(ge=-1, le=MAX_VERSION)
    downloading_version: Version | None
    download_progress: float = Field(ge=0.0, le=1.0)
    tokens_per_s: float = Field(ge=0.0, le=MAX_TOKENS_PER_S)
    rollouts: Count
    active: bool
    standby: bool = False
    leased_prompts: Count = 0  # prompts of its leases not yet returned


MetricName = Annotated[str, StringConstraints(max_length=128)]


class Status(_Msg):
    run_id: str = Field(max_length=64)
    step: Version
    target_steps: Version
    version: Version
    finished: bool
    workers: list[WorkerView] = Field(max_length=1 << 16)
    last_metrics: dict[MetricName, float | int | Annotated[str, StringConstraints(max_length=MAX_TEXT)] | None] = Field(
        default_factory=dict, max_length=1024
    )
    # the newest steps (`learner/records.HISTORY_KEYS`), oldest first: trends for `echo2 status`
    history: list[dict[MetricName, float | None]] = Field(default_factory=list, max_length=1024)
    rejected: dict[Reason, Count] = Field(default_factory=dict, max_length=64)  # rejected samples so far, by reason
