"""One pydantic config class per command. Precedence: defaults < TOML file < ECHO2_* env < CLI flags.

Unknown keys fail (`extra="forbid"`), so a typo in a TOML file or an env name is an error, not a silent
default. Units are in the names. The resolved learner config is written next to every checkpoint.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo2cli.broadcast.webseed import STREAMS_PER_ADDRESS
from echo2cli.errors import ConfigError
from echo2cli.hardware import parse_cpus
from echo2cli.learner.connections import PER_ADDRESS as CONNECTIONS_PER_ADDRESS
from echo2cli.learner.divergence import Thresholds, default_ess_min
from echo2cli.learner.fleet import WORKERS_PER_ADDRESS
from echo2cli.learner.schedule import LrScheduleName
from echo2cli.lora import DEFAULT_TARGETS
from echo2cli.plan.model import kappa_problem
from echo2cli.protocol import MAX_COMPLETION_TOKENS, MAX_PROMPT_TOKENS


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: Path) -> str:
    """The secret in a token file; ValueError if it cannot be read or is empty."""
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="after")
    def _token_from_file(self) -> _Config:
        path = getattr(self, "token_file", None)
        if path is not None and getattr(self, "token", None) is None:
            object.__setattr__(self, "token", read_token_file(path))
        return self


def split_devices(devices: str) -> list[str]:
    """A CUDA_VISIBLE_DEVICES list's entries ("0,1" -> ["0", "1"])."""
    return [d.strip() for d in devices.split(",") if d.strip()]


def trainer_devices(ranks: int) -> list[str]:
    """The GPUs a learner's ranks train on: local rank i takes the i-th visible GPU."""
    visible = split_devices(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    return visible[:ranks] if visible else [str(i) for i in range(ranks)]


LR_SCHEDULE_HELP = (
    "the learning rate after the warmup: constant, or linear or cosine decay from --lr towards --lr * "
    "--lr-min-ratio at --steps (a resume that raises --steps stretches the decay)"
)
LR_WARMUP_HELP = "steps of linear warmup to --lr (step i of them takes --lr * (i + 1) / N)"
LR_MIN_RATIO_HELP = "where linear and cosine decay head: this fraction of --lr"
MASTER_DITHER_HELP = (
    "start each fp32 master weight at a random point of its rounding interval in the wire dtype (version 0 is "
    "unchanged): a step smaller than half an ulp then reaches the published policy on average, instead of being "
    "lost until the master has moved half an ulp"
)
SKIP_FLAT_HELP = "no pass over a group whose rewards are all equal: advantage 0, no gradient (without --kl-coef)"

WireDtype = Literal["bf16", "fp16"]
WIRE_DTYPE_HELP = (
    "what versions are published in, 2 bytes a weight either way: fp16 keeps 3 more bits of each weight (a step "
    "moves the sampled policy in finer steps, deltas are larger) and needs a learner computing in fp32 (no CUDA; "
    "on a CPU with bf16, ECHO2_CPU_BF16=0)"
)


LEARNER_PANELS = {  # `echo2 learner --help`'s headings: field names
    "Run": "model revision task out_dir steps seed checkpoint_every keep_versions_every report_to torch_threads "
    "train_cpus",
    "GRPO": "prompts_per_step group_size max_new_tokens max_prompt_tokens temperature staleness kappa lr "
    "lr_schedule lr_warmup_steps lr_min_ratio clip_eps is_cap kl_coef max_grad_norm micro_batch minibatches "
    "skip_flat_groups reward_timeout_s master_dither wire_dtype",
    "Off-policy correction and divergence guard": "off_policy geo_low geo_high adaptive_staleness guard_ess_min "
    "guard_kl_max guard_clip_max",
    "Network and security": "host port public_url bt_listen uplink_mbps token token_file insecure_no_token "
    "tls_cert tls_key max_connections_per_address max_workers_per_address web_seed_streams_per_address "
    "lease_timeout_s heartbeat_s linger_s",
    "Cost-aware activation": "activation gamma plan_every plan_rule learner_usd_per_hour",
    "Evaluation": "eval_every eval_limit eval_k eval_devices",
    "Scale": "nproc_per_node max_tokens_per_micro_batch activation_checkpointing share_prompts compile",
    "LoRA": "lora_rank lora_alpha lora_targets",
}


class _PerAddressLimits(_Config):
    """What one address may hold of the learner (`learner/connections.py`, the fleet, the web seed): a stranger's
    share, with no token, and one token holder's, however many times it joins."""

    max_connections_per_address: int = Field(
        CONNECTIONS_PER_ADDRESS,
        ge=1,
        description="open HTTP connections one address may hold (one more is closed as it opens); the default fits "
        "64 workers behind one NAT address. Behind a reverse proxy, every worker has the proxy's address: raise it",
    )
    max_workers_per_address: int = Field(
        WORKERS_PER_ADDRESS,
        ge=1,
        description="workers joined at once from one address (of 4,096 in all): one token holder cannot fill the "
        "fleet; 64 workers behind one NAT address, each rejoining once, fit",
    )
    web_seed_streams_per_address: int = Field(
        STREAMS_PER_ADDRESS,
        ge=1,
        description="web seed streams open at once from one address (of 64 in all, 4 a worker): one token holder's "
        "many joins cannot take them all",
    )


class LearnerConfig(_PerAddressLimits):
    """`echo2 learner`."""

    HELP_PANELS: ClassVar[dict[str, str]] = LEARNER_PANELS

    model: str = Field(
        "default",
        description="'default' (SmolLM2-135M-Instruct, offline), a Hugging Face Hub id (ORG/NAME, e.g. Qwen/Qwen3-4B; "
        "fetched into the Hub cache, HF_HUB_OFFLINE=1 reads only the cache) or a local HF directory",
    )
    revision: str | None = Field(None, description="with a Hub id: its branch, tag or commit hash (pin it)")
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
    eval_devices: str | None = Field(
        None,
        description="GPUs for the periodic evaluation's vLLM engine, as CUDA_VISIBLE_DEVICES (e.g. '1'); a CUDA "
        "learner with --eval-every needs GPUs its trainer does not use",
    )
    out_dir: Path = Field(Path("runs/latest"), description="run directory: metrics, policy versions, checkpoints")
    steps: int = Field(20, ge=1, description="optimizer steps to run")
    prompts_per_step: int = Field(8, ge=1, description="prompts per learner step; B = prompts_per_step * G")
    group_size: int = Field(8, ge=2, description="G: samples per prompt for the group baseline")
    max_new_tokens: int = Field(16, ge=1, le=MAX_COMPLETION_TOKENS, description="completion length cap")
    max_prompt_tokens: int = Field(
        512,
        ge=8,
        le=MAX_PROMPT_TOKENS,
        description="longer prompts are skipped (and counted); workers size their engine's context to "
        "max_prompt_tokens + max_new_tokens",
    )
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature on the workers")
    staleness: int = Field(2, ge=0, description="S: step t may train on rollouts of version x iff t - x <= S")
    kappa: int = Field(1, ge=1, description="publish a version every kappa steps (kappa <= max(1, S - 1))")
    lr: float = Field(2e-5, gt=0.0, description="AdamW learning rate (the peak, with a schedule)")
    lr_schedule: LrScheduleName = Field("constant", description=LR_SCHEDULE_HELP)
    lr_warmup_steps: int = Field(0, ge=0, description=LR_WARMUP_HELP)
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0, description=LR_MIN_RATIO_HELP)
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="PPO ratio clip")
    master_dither: bool = Field(True, description=MASTER_DITHER_HELP)
    wire_dtype: WireDtype = Field("bf16", description=WIRE_DTYPE_HELP)
    is_cap: float = Field(
        3.0, gt=1.0, description="C: importance-weight truncation (dual clip), or the mask bound of seq_mask/decoupled"
    )
    off_policy: Literal["token_tis", "seq_mask", "geo_mask", "decoupled", "none", "ppo"] = Field(
        "token_tis",
        description="how stale tokens are corrected: token_tis (PPO + dual clip at C), seq_mask (TRL: sequence "
        "weight, dropped past C), geo_mask (SkyRL: drop sequences whose mean ratio leaves [geo_low, geo_high]), "
        "decoupled (AReaL: proximal PPO, behaviour weight masked past C), controls none (no correction) "
        "and ppo (naive PPO: no dual clip)",
    )
    geo_low: float = Field(0.99, gt=0.0, lt=1.0, description="geo_mask: lowest geometric-mean ratio kept")
    geo_high: float = Field(1.01, gt=1.0, description="geo_mask: highest geometric-mean ratio kept")
    adaptive_staleness: bool = Field(
        False,
        description="when the guard flags a step, halve the S that sizes new leases and bounds admission (or the "
        "lag the step reached, where lower; 0 for good with --off-policy none); raise it by one after 3 healthy "
        "verdicts, doubled with each flag, never back to a flagged lag",
    )
    guard_ess_min: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="guard: flag when the importance-weight ESS (0..1, median of 3 measured steps) is below",
        json_schema_extra={"shown_default": "0.9 with --off-policy none, else 0.8"},
    )
    guard_kl_max: float = Field(
        1.0, gt=0.0, description="guard: flag when the behaviour KL (median of 3 measured steps) exceeds"
    )
    guard_clip_max: float = Field(  # over the trained tokens; S = 4 runs reach 0.21 (divergence.py)
        0.25, gt=0.0, le=1.0, description="guard: flag when the clip fraction (median of 3 measured steps) exceeds"
    )
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to the initial policy (0 = off, no ref model)")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping by global norm")
    micro_batch: int = Field(16, ge=1, description="sequences per forward/backward pass")
    minibatches: int = Field(
        1,
        ge=1,
        description="optimizer steps per batch, each on a share of its prompts' groups (AReaL's ppo_n_minibatches; at "
        "most --prompts-per-step). Above 1, seq_mask, geo_mask, decoupled and none take PPO's ratio against the policy "
        "at the batch's start, so its clip bounds how far a batch moves the policy",
    )
    skip_flat_groups: bool = Field(True, description=SKIP_FLAT_HELP)
    max_tokens_per_micro_batch: int = Field(
        0, ge=0, description="padded tokens per forward/backward pass, for long completions (0 = no token budget)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each layer's activations in the backward pass: less memory, more compute"
    )
    compile: bool = Field(
        False,
        description="compile each decoder layer with torch.compile (fused norms, rotary and activations; the first "
        "step takes longer while it compiles). For GPU learners; on CPU it needs a C++ compiler",
    )
    share_prompts: bool = Field(
        True,
        description="run a prompt shared by a group's G samples once per micro-batch, not G times (same result; "
        "one process only, and not with activation checkpointing)",
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        le=64,
        description="learner processes sharing the model with FSDP2 (launched with torchrun; one per GPU on CUDA)",
    )
    lora_rank: int = Field(
        0,
        ge=0,
        le=512,
        description="train LoRA adapters of this rank on the frozen model; each version is the adapters, a few MB "
        "(0 = full fine-tuning). One process only; LoRA usually wants a larger --lr",
    )
    lora_alpha: int = Field(
        0,
        ge=0,
        description="LoRA scale: the update is (alpha / rank) B A",
        json_schema_extra={"shown_default": "2 x rank"},
    )
    lora_targets: str = Field(
        DEFAULT_TARGETS, description="comma-separated names of the linear layers that get adapters"
    )
    seed: int = Field(0, description="seed of the prompt stream, of torch and of the master dither")
    host: str = Field("127.0.0.1", description="address the HTTP API and tracker bind to")
    port: int = Field(8700, ge=0, le=65535, description="port of the API and tracker (0 = any free port)")
    public_url: str | None = Field(
        None,
        description="URL workers use to reach this learner",
        json_schema_extra={"shown_default": "http(s)://HOST:PORT as bound"},
    )
    bt_listen: str = Field("0.0.0.0:0", description="libtorrent listen interface, host:port")
    uplink_mbps: float = Field(0.0, ge=0.0, description="cap on the learner's torrent upload, Mbit/s (0 = none)")
    token: str | None = Field(
        None,
        exclude=True,
        repr=False,
        description="join token workers must present (or ECHO2_TOKEN; never written to disk or logs)",
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
    lease_timeout_s: float | None = Field(
        None,
        gt=0.0,
        description="unfinished prompts are leased again after this; long enough for a lease of long completions",
        json_schema_extra={"shown_default": "max(120, max_new_tokens / 20) s"},
    )
    heartbeat_s: float = Field(2.0, gt=0.0, description="worker heartbeat period; 3 missed = inactive")
    checkpoint_every: int = Field(10, ge=0, description="steps between checkpoints (0 = final only)")
    keep_versions_every: int = Field(
        0,
        ge=0,
        description="keep every N-th published version's file (RUN/versions/vN, bf16 weights only) once it is no "
        "longer seeded, to evaluate later with `echo2 eval --run RUN --version N,...` (0 = only the newest S+1)",
    )
    linger_s: float = Field(5.0, ge=0.0, description="keep serving after the last step so workers see 'finished'")
    report_to: str = Field(
        "jsonl",
        description="where step metrics go, comma-separated: jsonl (always), tensorboard (<out>/tensorboard), "
        "wandb (offline in <out>/wandb unless WANDB_MODE=online), trackio (local)",
    )
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads (0 = torch default)")
    train_cpus: str | None = Field(
        None,
        description="pin the training loop to these CPUs (e.g. 0 or 0-3); publishing, the API and seeding stay "
        "unpinned and so run on the CPUs training leaves idle, as they do beside a GPU. Default: no pinning",
    )
    activation: Literal["cost", "all"] = Field(
        "cost",
        description="cost: the cheapest workers that reach gamma*mu_min generate, the rest stand by; "
        "all: every worker generates",
    )
    gamma: float = Field(1.1, ge=1.0, description="provision gamma * mu_min rollouts/s")
    plan_every: int = Field(2, ge=1, description="steps between re-plans (joins and deaths re-plan at once)")
    plan_rule: Literal["echo2", "paper"] = Field("echo2", description="which mu_min activation targets")
    learner_usd_per_hour: float = Field(0.0, ge=0.0, description="price of the learner box, for cost per step")

    def lease_timeout(self) -> float:
        """`lease_timeout_s`, or 120 s or 1/20 s per completion token, whichever is longer: a worker generating
        at 20 tokens/s per sequence still returns a lease of capped completions in time."""
        return self.lease_timeout_s or max(120.0, self.max_new_tokens / 20)

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
    def _loggers_known(self) -> LearnerConfig:
        from echo2cli.loggers import parse_report_to

        try:
            parse_report_to(self.report_to)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _train_cpus_parse(self) -> LearnerConfig:
        if self.train_cpus is not None:
            parse_cpus(self.train_cpus)  # its ValueError names the bad list
        return self

    @model_validator(mode="after")
    def _lora_one_process(self) -> LearnerConfig:
        if self.lora_rank and self.nproc_per_node > 1:
            raise ValueError("--lora-rank trains in one process: drop --nproc-per-node, or train the full model")
        if self.lora_rank and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise ValueError("--lora-targets names no layer: give e.g. q_proj,k_proj,v_proj,o_proj")
        return self

    @model_validator(mode="after")
    def _eval_off_the_trainers_gpus(self) -> LearnerConfig:
        shared = set(split_devices(self.eval_devices or "")) & set(trainer_devices(self.nproc_per_node))
        if shared:
            raise ValueError(
                f"--eval-devices {self.eval_devices} shares GPU {','.join(sorted(shared))} with the trainer's "
                f"{self.nproc_per_node} rank(s): name a GPU past them"
            )
        return self

    def guard_thresholds(self) -> Thresholds:
        assert self.guard_ess_min is not None  # filled in from the correction when the config is made
        return Thresholds(ess_min=self.guard_ess_min, kl_max=self.guard_kl_max, clip_max=self.guard_clip_max)

    @model_validator(mode="after")
    def _guard_ess_min_of_the_correction(self) -> LearnerConfig:
        """The bound not given is the correction's (the run's config.json records the one used)."""
        if self.guard_ess_min is None:
            object.__setattr__(self, "guard_ess_min", default_ess_min(self.off_policy))
        return self

    @model_validator(mode="after")
    def _steps_fit(self) -> LearnerConfig:
        if problem := kappa_problem(self.kappa, self.staleness):
            raise ValueError(problem)
        if self.lr_warmup_steps >= self.steps:
            raise ValueError(f"--lr-warmup-steps {self.lr_warmup_steps} must be less than --steps {self.steps}")
        if self.minibatches > self.prompts_per_step:
            raise ValueError(f"--minibatches {self.minibatches}: at most one per prompt (--prompts-per-step)")
        return self


class WorkerConfig(_Config):
    """`echo2 worker`."""

    HELP_PANELS: ClassVar[dict[str, str]] = {
        "Learner": "join token token_file ca_cert request_timeout_s unreachable_s learner_restart_s",
        "Engine": "prompts_per_lease kv_cache_gib max_model_len dtype seed max_rollouts_per_s lora_load env_task",
        "GPU host": "gpu_memory_utilization tensor_parallel_size max_num_seqs",
        "Swarm": "bt_listen uplink_mbps downlink_mbps web_seed verify_between_leases",
        "This worker": "name work_dir usd_per_hour",
    }

    join: str = Field(description="learner URL, e.g. http://10.0.0.5:8700")
    token: str | None = Field(
        None, exclude=True, repr=False, description="the learner's join token (or ECHO2_TOKEN, or --token-file)"
    )
    token_file: Path | None = Field(None, description="read the join token from this file instead")
    ca_cert: Path | None = Field(
        None,
        description="trust this certificate (a private CA, or the learner's "
        "self-signed one) for an https:// learner, besides the system CAs",
    )
    name: str = Field(
        default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}",
        description="worker name, as the learner lists it",
        json_schema_extra={"shown_default": "HOST-PID"},
    )
    work_dir: Path | None = Field(
        None,
        description="where versions are stored",
        json_schema_extra={"shown_default": "~/.cache/echo2/workers/NAME"},
    )
    prompts_per_lease: int = Field(4, ge=1, le=256, description="prompts asked for per lease")
    kv_cache_gib: float = Field(1.0, gt=0.0, description="vLLM KV cache size on CPU, GiB")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="GPU host: fraction of GPU memory vLLM may take (weights + KV cache)"
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPU host: GPUs one engine spreads its layers over")
    max_num_seqs: int = Field(0, ge=0, description="GPU host: sequences generated at once (0 = vLLM's default)")
    max_model_len: int = Field(
        0,
        ge=0,
        description="the engine's context, prompt + completion tokens (0 = the run's: its max_prompt_tokens + "
        "max_new_tokens)",
    )
    dtype: str = Field("auto", description="engine compute dtype: auto | bfloat16 | float32")
    bt_listen: str = Field("0.0.0.0:0", description="libtorrent listen interface, host:port")
    uplink_mbps: float = Field(0.0, ge=0.0, description="cap on this worker's torrent upload, Mbit/s (0 = none)")
    downlink_mbps: float = Field(
        0.0,
        ge=0.0,
        description="cap on this worker's torrent download, Mbit/s, e.g. to "
        "emulate a slow link or leave bandwidth to others (0 = none)",
    )
    web_seed: Literal["fallback", "always", "off"] = Field(
        "fallback",
        description="fetch from the learner over HTTP as well (its web seed, counted in its upload): when a "
        "download gets no byte from peers for 8 s (fallback; a worker no peer can reach), from the start (always) "
        "or never (off)",
    )
    verify_between_leases: bool = Field(
        False,
        description="verify each downloaded version (its digest; a delta rebuilt) between leases, while the engine "
        "waits, instead of on a thread of its own while it generates (which makes a swap only the reload): for a "
        "CPU host whose engine needs every core",
    )
    lora_load: Literal["auto", "adapter", "merge"] = Field(
        "auto",
        description="how a LoRA run's versions reach the engine: as vLLM LoRA adapters (a swap takes ms; vLLM's CPU "
        "LoRA path generates ~5x slower), or merged into the base on the prepare thread and reloaded like full "
        "weights (merge); auto = adapter on CUDA, merge on CPU",
    )
    env_task: str | None = Field(
        None,
        description="a multi-turn run whose task is not built in: the 'package.module:Class' whose environment "
        "this worker runs (its code runs here, so a learner alone cannot choose it)",
        json_schema_extra={"shown_default": "the learner's task, if built in"},
    )
    usd_per_hour: float = Field(
        0.0, ge=0.0, description="price of this worker in $/h: the learner activates the cheapest per rollout first"
    )
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
    seed: int = Field(0, description="the engine's sampling seed")


class DemoConfig(_Config):
    """`echo2 demo`: a learner and local workers on the default model and the arithmetic task."""

    steps: int = Field(20, ge=1, description="optimizer steps")
    workers: int = Field(2, ge=1, le=16, description="local workers, each a process with its own vLLM engine")
    out_dir: Path = Field(Path("runs/demo"), description="run directory (replaced)")
    prompts_per_step: int = Field(4, ge=1, description="prompts per learner step; B = prompts_per_step * G")
    group_size: int = Field(8, ge=2, description="G: samples per prompt")
    staleness: int = Field(2, ge=0, description="S: max policy lag of a trained rollout")
    lr: float = Field(2e-5, gt=0.0, description="AdamW learning rate")
    seed: int = Field(0, description="the learner's seed (prompt order, torch); worker i samples with seed + i")
    lora_rank: int = Field(0, ge=0, le=512, description="train LoRA adapters of this rank (0 = the full model)")
    report_to: str = Field("jsonl", description="the learner's loggers: jsonl, tensorboard, wandb, trackio")
    keep_versions_every: int = Field(
        0,
        ge=0,
        description="keep every N-th version (OUT/versions/vN) to score later with `echo2 eval --run OUT --version "
        "N,...` (0 = only the newest S+1)",
    )
    port: int = Field(0, ge=0, le=65535, description="the learner's port (0 = any free port)")
    learner_threads: int = Field(
        0,
        ge=0,
        description="the learner's torch threads (0 = the cores left after one per worker, at least 1: "
        "more threads than free cores spin at every barrier while engines hold their cores)",
    )


class EvalConfig(_Config):
    """`echo2 eval`."""

    task: str | None = Field(
        None,
        description="arithmetic | math | poker | package.module:Class",
        json_schema_extra={"shown_default": "the run's task with --run, else arithmetic"},
    )
    model: str | None = Field(
        None,
        description="'default', a Hugging Face Hub id (ORG/NAME) or an HF model directory (a checkpoint is one)",
        json_schema_extra={"shown_default": "the run's newest checkpoint with --run, else default"},
    )
    revision: str | None = Field(None, description="with a Hub id: its branch, tag or commit hash")
    run: Path | None = Field(
        None, description="a learner run directory: its newest checkpoint, task, task options and completion length"
    )
    version: str | None = Field(
        None,
        description="with --run: a published version (RUN/versions/vN; the learner keeps the newest S+1, and every "
        "N-th with --keep-versions-every N), or several, comma-separated, evaluated in one engine",
    )
    limit: int = Field(200, ge=1, description="held-out problems (the first N distinct ones of the eval split)")
    k: int = Field(4, ge=0, description="samples per problem at temperature 1 for pass@k (0 = greedy only)")
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="completion length cap",
        json_schema_extra={"shown_default": "the run's, or the task's suggestion, or 16"},
    )
    option: list[str] = Field(
        default_factory=list,
        description="task option KEY=VALUE (repeatable; VALUE as JSON if it parses, else text), e.g. "
        "--option path=gsm8k.jsonl",
    )
    seed: int = Field(0, description="seed of the eval split's problems and of the engine's sampling")
    kv_cache_gib: float = Field(4.0, gt=0.0, description="vLLM KV cache on CPU, GiB: room for many problems at once")
    out: Path | None = Field(
        None,
        description="write the result as JSON here",
        json_schema_extra={"shown_default": "RUN/eval/TASK-step_N.json with --run"},
    )


class PlanConfig(_Config):
    """`echo2 plan`: numbers given here override those of --from-run."""

    batch: float | None = Field(None, description="B: rollouts per learner step (prompts x G)")
    t_train_s: float | None = Field(None, description="T_train: learner busy seconds per step")
    t_bcast_s: float | None = Field(None, description="T_bcast: publish -> fleet generating with it, s")
    staleness: int | None = Field(None, description="S: max policy lag of a trained rollout")
    kappa: int | None = Field(None, description="publish every kappa steps", json_schema_extra={"shown_default": 1})
    gamma: float | None = Field(None, description="provision gamma * mu_min", json_schema_extra={"shown_default": 1.1})
    workers: Path | None = Field(
        None, description="pool TOML: [[workers]] name, usd_per_hour, rollouts_per_s (see examples/pool-8.toml)"
    )
    mu: str | None = Field(None, description="a pool of free workers instead: rollouts/s, comma-separated")
    from_run: Path | None = Field(
        None, description="learner run directory: measured T_train, T_bcast, B, S, kappa and per-worker throughput"
    )
    rule: Literal["echo2", "paper"] = Field(
        "echo2",
        description="threshold activation targets: echo2 (derived, simulator-checked) or paper "
        "(kappa*B/(kappa*T_train - T_bcast))",
    )
    lease_rollouts: float = Field(32.0, description="q: rollouts per lease (prompts per lease x G)")
    group_size: int | None = Field(
        None,
        ge=1,
        description="G: rollouts per prompt; a worker that cannot return G within S+1 steps gets no lease",
        json_schema_extra={"shown_default": 8},
    )
    learner_usd_per_hour: float | None = Field(None, description="learner price, counted in every cost")
    learner_rollouts_per_s: float | None = Field(
        None, description="learner's own generation rate (centralized baseline)"
    )
    seed: int = Field(0, description="seed of the random-activation baseline")
    fleet: Path | None = Field(
        None,
        description="fleet file: a line per worker or per COUNT alike, `[COUNTx] UP_MBPS DOWN_MBPS [nat|firewall]` "
        "(examples/fleet-mixed-1024.txt); predicts T_bcast with the swarm model, used unless --t-bcast is given",
    )
    learner_up_mbps: float = Field(10000.0, gt=0, description="with --fleet: the learner's uplink, Mbit/s")
    version_mb: float | None = Field(
        None, gt=0, description="with --fleet: a full version's size, MB (bf16: 2 bytes a parameter)"
    )
    delta_ratio: float = Field(
        0.04,
        gt=0,
        le=1,
        description="with --fleet: a delta's size over a full version's (0.035-0.054 measured on the default model)",
    )


class MemoryConfig(_Config):
    """`echo2 plan-memory`."""

    model: str = Field(
        "default",
        description="'default', a Hugging Face Hub id (ORG/NAME: only its config.json is fetched) or a model "
        "directory; only the config.json is read, for the shape",
    )
    revision: str | None = Field(None, description="with a Hub id: its branch, tag or commit hash")
    config_json: Path | None = Field(None, description="a config.json file to take the shape from instead of --model")
    ranks: int = Field(1, ge=1, le=4096, description="learner ranks sharing the model (--nproc-per-node x nodes)")
    device_gib: float = Field(80.0, gt=0, description="memory of one learner device (GPU, or the host on CPU), GiB")
    micro_batch_tokens: int = Field(
        8192, ge=1, description="padded tokens per forward/backward pass (the learner's --max-tokens-per-micro-batch)"
    )
    completion_tokens: int | None = Field(
        None,
        ge=0,
        description="of those, completion tokens (where the head runs)",
        json_schema_extra={"shown_default": "micro_batch_tokens"},
    )
    activation_checkpointing: bool = Field(False, description="the learner recomputes activations in backward")
    compile: bool = Field(False, description="the learner compiles its layers (--compile): fewer saved activations")
    rollout_gib: float = Field(80.0, gt=0, description="memory of one rollout GPU, GiB")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="the worker's --gpu-memory-utilization")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="the worker's --tensor-parallel-size")
    context: int = Field(4096, ge=1, description="prompt + completion tokens per sequence on a rollout host")


class BenchBroadcastConfig(_Config):
    """`echo2 bench broadcast`."""

    workers: str | None = Field(
        None,
        description="worker counts N to try, comma-separated",
        json_schema_extra={"shown_default": "1,2,4,8; with --links, every worker it lists"},
    )
    links: Path | None = Field(
        None,
        description="a file with one line per worker, `UP_MBPS DOWN_MBPS [nat|firewall]` (a fleet of N takes the "
        "first N lines): heterogeneous links, workers behind NAT (outbound connections only) or a firewall (only the "
        "learner's HTTP port); see examples/links/",
        json_schema_extra={"shown_default": "every worker at --worker-up-mbps/--worker-down-mbps, reachable"},
    )
    uplink_mbps: float = Field(100.0, gt=0, description="learner uplink cap U, Mbit/s")
    worker_up_mbps: float | None = Field(
        None, gt=0, description="each worker's uplink cap, Mbit/s", json_schema_extra={"shown_default": "U"}
    )
    worker_down_mbps: float | None = Field(
        None, gt=0, description="each worker's downlink cap, Mbit/s", json_schema_extra={"shown_default": "U"}
    )
    size_mb: float | None = Field(
        None,
        gt=0,
        description="synthetic payload of this many MB",
        json_schema_extra={"shown_default": "the default model in bf16, 269 MB"},
    )
    method: str = Field(
        "star,swarm",
        description="methods to run, comma-separated: star (HTTP from the learner), swarm (slot shares by uplink, as "
        "the learner hands them out), swarm-equal (equal shares)",
    )
    mode: Literal["auto", "netns", "loopback"] = Field(
        "auto", description="netns: namespaces + tc tbf, needs root; loopback: libtorrent and HTTP rate limits"
    )


class BenchStalenessConfig(_Config):
    """`echo2 bench staleness`."""

    staleness: str = Field("0,1,2,4,8", description="staleness bounds S to run, comma-separated (0 = synchronous)")
    seeds: int = Field(2, ge=1, le=1000, description="runs per setting, seeds --seed .. --seed + N - 1")
    seed: int = Field(
        0,
        ge=0,
        description="the first seed: a run of seed s seeds its learner with s and its worker i with s + i, so "
        "settings compare seed by seed; more seeds later are --seed N --seeds M on the same --out",
    )
    steps: int = Field(20, ge=1, description="optimizer steps per run")
    workers: int = Field(1, ge=1, le=16, description="local workers per run")
    off_policy: str = Field(
        "token_tis",
        description="off-policy corrections to run, comma-separated (see `echo2 learner --help`); S = 0 runs under "
        "the first only, as at lag 0 every correction takes the same step, and each is compared with it",
    )
    adaptive_staleness: bool = Field(False, description="run the learners with --adaptive-staleness")
    guard_ess_min: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="the learners' --guard-ess-min (not given: the learner's default for each correction); each "
        "row records it and the guard's replay uses it. Runs of another bound belong in another OUT",
    )
    prompts_per_step: int = Field(4, ge=1, description="prompts per learner step; B = prompts_per_step * G")
    group_size: int = Field(8, ge=2, description="G: samples per prompt")
    max_new_tokens: int = Field(16, ge=1, description="completion length cap")
    lr: float = Field(2e-5, gt=0.0, description="AdamW learning rate")
    lr_schedule: LrScheduleName = Field(
        "constant", description="the learners' --lr-schedule; a run's name says its schedule when not constant"
    )
    lr_warmup_steps: int = Field(0, ge=0, description="the learners' --lr-warmup-steps")
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0, description="the learners' --lr-min-ratio")
    minibatches: int = Field(
        1,
        ge=1,
        description="the learners' --minibatches (optimizer steps per batch); at most --prompts-per-step. Runs of "
        "another count belong in another OUT",
    )
    lora_rank: str = Field(
        "0", description="LoRA ranks to run, comma-separated (0 = full fine-tuning; `echo2 learner --lora-rank`)"
    )
    lora_lr: float = Field(
        0.0, ge=0.0, description="learning rate of the LoRA runs", json_schema_extra={"shown_default": "10 x --lr"}
    )
    kl_coef: float = Field(0.0, ge=0.0, description="the learners' KL penalty to the initial policy (0 = off)")
    wire_dtype: WireDtype = Field(
        "bf16",
        description="the learners' --wire-dtype (what versions are published in). Runs of another dtype belong in "
        "another OUT (scripts/bench_wire.py compares two)",
    )
    eval_limit: int = Field(
        500,
        ge=1,
        description="held-out problems in each run's evaluations (at most the split's size: 340 for arithmetic)",
    )
    eval_every: int = Field(
        10,
        ge=0,
        description="also evaluate every N-th version after each run (greedy, one engine for all; the learner keeps "
        "them with --keep-versions-every N): held-out accuracy against wall time, and the time to accuracy (0 = off)",
    )
    eval_from: int = Field(
        0,
        ge=0,
        description="the curve's first version (0: --eval-every itself): with --steps 20 --eval-every 2 "
        "--eval-from 12, versions 12, 14, .., 20",
    )
    score_versions: int = Field(
        1,
        ge=1,
        description="score each run by its mean held-out greedy accuracy over its last N evaluated versions (1: the "
        "final version alone); averaging the curve's last points damps a run's version-to-version swings",
    )
    score_mix: Literal["split", "train"] = Field(
        "split",
        description="the accuracy a run is scored by: split, the held-out split's own; train, its levels weighted as "
        "training draws them (a task whose problems name levels: arithmetic's split is 83 % two-digit sums, "
        "training 25 %)",
    )
    target_version: int = Field(
        20,
        ge=1,
        description="time to accuracy: the wall time each run takes to reach what S = 0 (same seed and "
        "correction) reached by this version",
    )
    eval_k: int = Field(4, ge=0, description="samples per problem for pass@k in the final evaluation")
    pin_learner: Literal["train", "process"] = Field(
        "train",
        description="train: only the learner's training loop has core 0 (publishing and seeding run where cores "
        "are idle, as beside a GPU); process: the whole learner on core 0 (a one-core learner host)",
    )
    out_dir: Path = Field(Path("runs/bench-staleness"), description="one run directory per setting and seed here")


C = TypeVar("C", bound=_Config)


def resume_base(saved: dict[str, Any]) -> dict[str, Any]:
    """A resumed run's saved config as the base of its new one. The saved ESS bound is the one the run used; where
    that is its correction's default it is left out, so a resume that changes --off-policy gets the new
    correction's default (0.9 for `none`), not the old one's. A bound given again still wins."""
    base = dict(saved)
    if "off_policy" in base and base.get("guard_ess_min") == default_ess_min(base["off_policy"]):
        del base["guard_ess_min"]
    return base


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
