"""Carriers shared by the coordinator's parts, the training loop and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from echo2cli.protocol import Sample


class RejectReason(StrEnum):
    """Why a returned group was not admitted (the keys of `SubmitResult.rejected`)."""

    DUPLICATE = "duplicate"
    LATE = "late"
    REVOKED = "revoked"
    NOT_LEASED = "not_leased"
    VERSION_MISMATCH = "version_mismatch"
    INVALID_SAMPLES = "invalid_samples"
    STALE = "stale"
    FORGED_ENV = "forged_env"
    REPLAY_FAILED = "replay_failed"

    @property
    def detail(self) -> str:
        """What the worker is told."""
        return _DETAIL[self]

    @property
    def untrusted(self) -> bool:
        """An honest worker never causes this one: it counts towards cutting a worker off."""
        return self in (
            RejectReason.NOT_LEASED,
            RejectReason.VERSION_MISMATCH,
            RejectReason.INVALID_SAMPLES,
            RejectReason.REVOKED,
            RejectReason.FORGED_ENV,
            RejectReason.REPLAY_FAILED,
        )


_DETAIL = {
    RejectReason.DUPLICATE: "the prompt was already admitted",
    RejectReason.LATE: "the lease expired; the prompt was leased again",
    RejectReason.REVOKED: "the lease was revoked after invalid samples; its prompts were leased again",
    RejectReason.NOT_LEASED: "prompt was not leased to this worker",
    RejectReason.VERSION_MISMATCH: "version does not match the lease",
    RejectReason.INVALID_SAMPLES: "",  # the validation failure itself is the detail
    RejectReason.STALE: "more than S versions behind the learner",
    RejectReason.FORGED_ENV: "a transcript's environment tokens are not what the environment produces on replay",
    RejectReason.REPLAY_FAILED: "replaying a transcript failed (the environment raised or timed out on its actions), "
    "so it could not be checked",
}


@dataclass
class Group:
    """G samples of one prompt, all generated with one policy version, with learner-computed rewards."""

    prompt_id: int
    version: int
    prompt_token_ids: list[int]
    samples: list[Sample]
    rewards: list[float]
    worker_id: str
    components: list[dict[str, float]] = field(default_factory=list)  # per sample: format, correct, ...
