"""One pydantic config class per command. Precedence: defaults < TOML file < ECHO2_* env < CLI flags.

Unknown keys fail (`extra="forbid"`), so a typo in a TOML file or an env name is an error, not a silent
default. Units are in the names. The resolved learner config is written next to every checkpoint.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo2cli.errors import ConfigError
from echo2cli.plan.model import kappa_problem


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="after")
    def _token_from_file(self) -> _Config:
        path = getattr(self, "token_file", None)
        if path is not None and getattr(self, "token", None) is None:
            try:
                token = Path(path).expanduser().read_text().strip()
            except OSError as exc:
                raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
            if not token:
                raise ValueError(f"the token file {path} is empty")
            object.__setattr__(self, "token", token)
        return self


class LearnerConfig(_Config):
    model: str = Field("default", description="'default' (SmolLM2-135M-Instruct, offline) or a local HF dir")
    task: str = Field("arithmetic", description="task adapter: arithmetic | math | poker | 'package.module:Class'")
    task_options: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the task (TOML table [learner.task_options], e.g. path = 'gsm8k.jsonl')",
    )
    reward_timeout_s: float = Field(5.0, gt=0.0, description="a completion whose reward takes longer scores 0")
    eval_every: int = Field(
        0,
        ge=0,
        description="evaluate every N-th version on the eval split beside training "
        "(a subprocess with its own vLLM engine; 0 = never)",
    )
    eval_limit: int = Field(100, ge=1, description="held-out problems per periodic evaluation")
    eval_k: int = Field(4, ge=0, description="samples per problem for pass@k in periodic evaluations")
    out_dir: Path = Field(Path("runs/latest"), description="metrics, policy versions and checkpoints")
    steps: int = Field(20, ge=1, description="optimizer steps to run")
    prompts_per_step: int = Field(8, ge=1, description="prompts per learner step; B = prompts_per_step * G")
    group_size: int = Field(8, ge=2, description="G: samples per prompt for the group baseline")
    max_new_tokens: int = Field(16, ge=1, le=4096, description="completion length cap")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature on the workers")
    staleness: int = Field(2, ge=0, description="S: step t may train on rollouts of version x iff t - x <= S")
    kappa: int = Field(1, ge=1, description="publish a version every kappa steps (kappa <= max(1, S - 1))")
    lr: float = Field(5e-5, gt=0.0, description="AdamW learning rate")
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="PPO ratio clip")
    is_cap: float = Field(3.0, gt=1.0, description="C: importance-weight truncation (dual clip)")
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to the initial policy (0 = off, no ref model)")
    max_grad_norm: float = Field(1.0, gt=0.0)
    micro_batch: int = Field(16, ge=1, description="sequences per forward/backward pass")
    seed: int = 0
    host: str = Field("127.0.0.1", description="address the HTTP API and tracker bind to")
    port: int = Field(8700, ge=0, le=65535, description="0 = any free port")
    public_url: str | None = Field(None, description="URL workers use to reach this learner (default: bound)")
    bt_listen: str = Field("0.0.0.0:0", description="libtorrent listen interface, host:port")
    uplink_mbps: float = Field(0.0, ge=0.0, description="cap on the learner's torrent upload (0 = none)")
    token: str | None = Field(
        None, exclude=True, repr=False, description="join token workers must present (never written to disk or logs)"
    )
    token_file: Path | None = Field(None, description="read the join token from this file instead")
    insecure_no_token: bool = Field(
        False,
        exclude=True,  # never inherited by a resumed run: say it again
        description="serve without a join token on a non-loopback address, or resume "
        "a run that had one without it: anyone who reaches the port can join",
    )
    tls_cert: Path | None = Field(None, description="PEM certificate (chain): serve the API and tracker over HTTPS")
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")
    lease_timeout_s: float = Field(120.0, gt=0.0, description="unfinished prompts are leased again after this")
    heartbeat_s: float = Field(2.0, gt=0.0, description="worker heartbeat period; 3 missed = inactive")
    checkpoint_every: int = Field(10, ge=0, description="steps between checkpoints (0 = final only)")
    linger_s: float = Field(5.0, ge=0.0, description="keep serving after the last step so workers see 'finished'")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads (0 = torch default)")
    activation: Literal["cost", "all"] = Field(
        "cost",
        description="cost: the cheapest workers that reach gamma*mu_min generate, the rest stand by; "
        "all: every worker generates",
    )
    gamma: float = Field(1.1, ge=1.0, description="provision gamma * mu_min rollouts/s")
    plan_every: int = Field(2, ge=1, description="steps between re-plans (joins and deaths re-plan at once)")
    plan_rule: Literal["echo2", "paper"] = Field("echo2", description="which mu_min activation targets")
    learner_usd_per_hour: float = Field(0.0, ge=0.0, description="price of the learner box, for cost per step")

    @model_validator(mode="after")
    def _tls_pair(self) -> LearnerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        return self

    @model_validator(mode="after")
    def _token_off_loopback(self) -> LearnerConfig:
        if self.token is None and not self.insecure_no_token and not is_loopback(self.host):
            raise ValueError(
                f"listening on {self.host} without a join token would let anyone who reaches it join "
                "and send rollouts: pass --token (or --token-file), or --insecure-no-token if you mean it"
            )
        return self

    @model_validator(mode="after")
    def _kappa_fits_staleness(self) -> LearnerConfig:
        if problem := kappa_problem(self.kappa, self.staleness):
            raise ValueError(problem)
        return self


class WorkerConfig(_Config):
    join: str = Field(description="learner URL, e.g. http://10.0.0.5:8700")
    token: str | None = Field(None, exclude=True, repr=False, description="the learner's join token")
    token_file: Path | None = Field(None, description="read the join token from this file instead")
    ca_cert: Path | None = Field(
        None,
        description="trust this certificate (a private CA, or the learner's "
        "self-signed one) for an https:// learner, besides the system CAs",
    )
    name: str = Field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}")
    work_dir: Path | None = Field(None, description="where versions are stored (default: ~/.cache/echo2/workers/NAME)")
    prompts_per_lease: int = Field(4, ge=1, le=256, description="prompts asked for per lease")
    kv_cache_gib: float = Field(1.0, gt=0.0, description="vLLM KV cache size on CPU")
    max_model_len: int = Field(1024, ge=64)
    dtype: str = Field("auto", description="engine compute dtype: auto | bfloat16 | float32")
    bt_listen: str = Field("0.0.0.0:0", description="libtorrent listen interface, host:port")
    uplink_mbps: float = Field(0.0, ge=0.0, description="cap on this worker's torrent upload (0 = none)")
    downlink_mbps: float = Field(
        0.0,
        ge=0.0,
        description="cap on this worker's torrent download, e.g. to "
        "emulate a slow link or leave bandwidth to others (0 = none)",
    )
    usd_per_hour: float = Field(0.0, ge=0.0, description="price of this worker, for cost-aware activation")
    max_rollouts_per_s: float = Field(
        0.0, ge=0.0, description="throttle generation to this rate, emulating a slower GPU (0 = no throttle)"
    )
    request_timeout_s: float = Field(30.0, gt=0.0, description="HTTP timeout for one call to the learner")
    unreachable_s: float = Field(60.0, gt=0.0, description="give up joining a learner unreachable this long")
    learner_restart_s: float = Field(
        600.0,
        gt=0.0,
        description="once joined, keep retrying a learner that went "
        "away this long (a restart resuming from its checkpoint) before giving up",
    )
    seed: int = 0


class DemoConfig(_Config):
    steps: int = Field(20, ge=1)
    workers: int = Field(2, ge=1, le=16)
    out_dir: Path = Path("runs/demo")
    prompts_per_step: int = Field(4, ge=1)
    group_size: int = Field(8, ge=2)
    staleness: int = Field(2, ge=0)
    lr: float = Field(5e-5, gt=0.0)
    port: int = Field(0, ge=0, le=65535)


C = TypeVar("C", bound=_Config)


def load_config(
    cls: type[C], toml_path: Path | None, flags: dict[str, Any], section: str, base: dict[str, Any] | None = None
) -> C:
    """Merge defaults < `base` (a resumed run's saved config) < TOML `[section]` < ECHO2_<FIELD> env < flags
    (None = not given)."""
    data: dict[str, Any] = dict(base or {})
    if toml_path is not None:
        try:
            doc = tomllib.loads(Path(toml_path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {toml_path}: {exc}") from exc
        data.update(doc.get(section, doc))
    for name in cls.model_fields:
        env = os.environ.get(f"ECHO2_{name.upper()}")
        if env is not None:
            data[name] = env
    data.update({k: v for k, v in flags.items() if v is not None})
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or section
        raise ConfigError(f"bad {section} config: {where}: {err['msg']}") from exc
