"""Memory plan: what the learner needs per rank and what a rollout host has left for KV cache. Pure Python.

Learner, per rank of N (FSDP2, fp32 master weights, bf16 layer compute; `learner/sharded.py`):
    states       16 P / N          fp32 parameters, gradients and AdamW's two moments, each 1/N
                 + 4 root / N      the root's fp32 master, put aside while the step computes with it rounded to
                                   bf16 as published (`learner/rounding.py`; the layers' bf16 cast needs none)
    gathered     4 (root + 2 layer) the root unit (embeddings, head, final norm) stays whole through the step,
                 + 4 root (its grad) and FSDP holds the layer being computed and the next one (prefetch)
    activations  per token of the micro-batch: every layer's saved tensors, or with activation checkpointing
                 only each layer's input plus one layer's tensors while it is recomputed
    logits       20 bytes x vocabulary per completion token, for at most LOGIT_CHUNK tokens at a time (the
                 head's fp32 output, its scaled copy and log-softmax, and their gradients): the head
                 runs only on completion positions, in chunks past LOGIT_CHUNK (`trainer.TokenLogp`)
Saved tensors per token and layer, bf16 unless said: norm inputs and residuals in fp32 (3 x 4h), norm outputs
(2 x 2h), q/k/v and the attention output (2(n_q + 2 n_kv)d + 2 n_q d), o_proj input (2 n_q d), gate, up,
activation and product (4 x 2I): `Shape.act_bytes`. That is what the compiled layers save (`--compile`); the eager
layers save 8 bytes x (h + n_q d + 2 n_kv d) more per token and layer (`Shape.eager_extra_bytes`: the q/k norms'
fp32 tensors, keys and values repeated to the query heads for the varlen kernel and gathered per row). Measured on
an H200 (2026-11-27, `scripts/bench_learner_gpu.py`): Qwen3-1.7B shape, 16,384-token micro-batches, one process:
peak 72.9 GiB compiled and 94.6 eager against 73.4 and 94.4 here; Qwen3-4B shape compiled, 8,192 tokens: 103.5
against 106.2; with checkpointing, 32,768 tokens: 78.8 against 81.5 (all before the root's master copy, which adds
1.45 GiB to the Qwen3-4B figures here). `scripts/bench_learner_scale.py` measures the sharded learner on CPU against
this.

`largest_micro_batch` inverts it: the most tokens per micro-batch that fit a device, with and without checkpointing,
which `memory_plan` turns into a suggested setting (the best measured: no checkpointing while at least
`NO_CHECKPOINTING_FROM` tokens fit, since recomputing every layer costs a quarter of the step).

Rollout host (vLLM, bf16 weights, tensor parallel over TP GPUs), per GPU:
    weights   2 P / TP;   KV cache per token   2 (K and V) x layers x n_kv x d x 2 bytes / TP
    room      memory x gpu_memory_utilization - weights, an upper bound (vLLM also keeps activation
              workspace); sequences at full context = room / (KV per token x context)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from echo2cli.config import MemoryConfig
from echo2cli.errors import ConfigError

LOGIT_CHUNK = 2048  # as learner/trainer.py (not imported: that imports torch)
RESERVE = 0.85  # of a device's memory for allocated tensors: the caching allocator reserved 1.04-1.17x what was
# allocated at the peaks measured on the H200 (1.17x eager, 1.11x for Qwen3-4B compiled)
NO_CHECKPOINTING_FROM = 8192  # tokens per micro-batch: Qwen3-4B on an H200, compiled: 8,192 without checkpointing
# ran at 38.6 % MFU, 32,768 with it at 32.6 % (docs/BENCHMARKS.md, "The learner on an H200")

GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape, as in its HF config.json."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict) -> Shape:
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                vocab=int(config["vocab_size"]),
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                tied=bool(config.get("tie_word_embeddings", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"config.json lacks a decoder shape field: {exc}") from exc

    @classmethod
    def from_config_file(cls, path: Path) -> Shape:
        try:
            return cls.from_config(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc

    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * self.heads * d * 2 + h * self.kv_heads * d * 2  # q and o; k and v
        return attention + 3 * h * self.intermediate + 2 * h + 2 * d  # SwiGLU MLP, two norms, q/k norms

    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def act_bytes(self, compiled: bool = True) -> int:
        """Saved bytes per token and layer without checkpointing (module docstring)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return 12 * h + 4 * h + 2 * (q + 2 * kv) + 2 * q + 2 * q + 8 * i + (0 if compiled else self.eager_extra_bytes())

    def eager_extra_bytes(self) -> int:
        """What the eager layers save beyond the compiled ones, per token and layer (module docstring)."""
        return 8 * (self.hidden + self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim)


@dataclass(frozen=True)
class LearnerMemory:
    states: float
    gathered: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations + self.logits


def learner_memory(
    shape: Shape,
    ranks: int,
    micro_batch_tokens: int,
    completion_tokens: int,
    checkpointing: bool,
    compiled: bool = False,
) -> LearnerMemory:
    """Bytes per rank for one micro-batch of `micro_batch_tokens` tokens (packed: no padding; `trainer.py`),
    `completion_tokens` of them completions (the head's positions), the layers compiled or eager."""
    p = shape.params()
    act_layer = shape.act_bytes(compiled) * micro_batch_tokens
    if checkpointing:
        activations = shape.layers * 4 * shape.hidden * micro_batch_tokens + act_layer
    else:
        activations = shape.layers * act_layer
    return LearnerMemory(
        states=(16 * p + 4 * shape.root_params()) / ranks,
        gathered=(8 * shape.root_params() + 8 * shape.layer_params()) if ranks > 1 else 0,
        activations=activations,
        logits=20 * shape.vocab * min(completion_tokens, LOGIT_CHUNK),
    )


def largest_micro_batch(shape: Shape, ranks: int, device_bytes: float, checkpointing: bool, compiled: bool) -> int:
    """The most tokens per micro-batch (a multiple of 1,024; 0 if none) whose `learner_memory` fits RESERVE of
    `device_bytes`, the head's chunk full (completions of LOGIT_CHUNK tokens or more)."""
    base = learner_memory(shape, ranks, 0, LOGIT_CHUNK, checkpointing, compiled)
    per_token = learner_memory(shape, ranks, 1, LOGIT_CHUNK, checkpointing, compiled).total - base.total
    return max(0, int((RESERVE * device_bytes - base.total) // per_token) // 1024 * 1024)


@dataclass(frozen=True)
class RolloutMemory:
    weights: float
    kv_per_token: float
    room: float
    sequences: int  # at full context


def rollout_memory(
    shape: Shape, gpu_gib: float, utilization: float, tensor_parallel: int, context: int
) -> RolloutMemory:
    weights = 2 * shape.params() / tensor_parallel
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 / tensor_parallel
    room = gpu_gib * GiB * utilization - weights
    return RolloutMemory(weights, kv, room, max(0, int(room // (kv * context))))


def memory_plan(
    shape: Shape,
    *,
    ranks: int,
    device_gib: float,
    micro_batch_tokens: int,
    completion_tokens: int,
    checkpointing: bool,
    rollout_gib: float,
    utilization: float,
    tensor_parallel: int,
    context: int,
    compiled: bool = False,
) -> dict:
    """Both sides, with and without checkpointing, and what fits (`fitting`); a ConfigError naming a side that can't."""
    both = {c: learner_memory(shape, ranks, micro_batch_tokens, completion_tokens, c, compiled) for c in (False, True)}
    chosen = both[checkpointing]
    fits = fitting(shape, ranks, device_gib, compiled)
    rollout = rollout_memory(shape, rollout_gib, utilization, tensor_parallel, context)
    report = {
        "params": shape.params(),
        "learner": {
            "ranks": ranks,
            "device_gib": device_gib,
            "micro_batch_tokens": micro_batch_tokens,
            "checkpointing": checkpointing,
            "per_rank_gib": {k: v / GiB for k, v in asdict(chosen).items()} | {"total": chosen.total / GiB},
            "total_gib_without_checkpointing": both[False].total / GiB,
            "total_gib_with_checkpointing": both[True].total / GiB,
            **fits,
        },
        "rollout": {
            "gpu_gib": rollout_gib,
            "utilization": utilization,
            "tensor_parallel": tensor_parallel,
            "context": context,
            "weights_gib": rollout.weights / GiB,
            "kv_cache_gib": max(rollout.room, 0) / GiB,
            "kv_mib_per_sequence": rollout.kv_per_token * context / (1 << 20),
            "sequences_at_full_context": rollout.sequences,
        },
    }
    if chosen.total > device_gib * GiB:
        flags = fits["suggested"]  # the learner flags that fit, or "nothing fits one device: ..."
        hint = f"try {flags}, or more ranks" if flags.startswith("--") else flags
        raise ConfigError(
            f"the learner needs {chosen.total / GiB:.1f} GiB per rank of {ranks} and a device has {device_gib:g} GiB: "
            f"{hint}"
        )
    if rollout.sequences < 1:
        raise ConfigError(
            f"a rollout GPU of {rollout_gib:g} GiB at utilization {utilization:g} has {rollout.room / GiB:.1f} GiB "
            f"after the weights, less than one {context}-token sequence's KV cache "
            f"({rollout.kv_per_token * context / GiB:.2f} GiB): more tensor parallelism or a larger GPU"
        )
    return report


def fitting(shape: Shape, ranks: int, device_gib: float, compiled: bool) -> dict:
    """The largest micro-batch on the device with and without checkpointing, and the suggested learner flags."""
    largest = {c: largest_micro_batch(shape, ranks, device_gib * GiB, c, compiled) for c in (False, True)}
    return {
        "compiled": compiled,
        "largest_micro_batch_tokens": {"without_checkpointing": largest[False], "with_checkpointing": largest[True]},
        "suggested": suggested(largest, compiled),
    }


def suggested(largest: dict[bool, int], compiled: bool) -> str:
    """The learner flags for this device: no checkpointing while NO_CHECKPOINTING_FROM tokens fit without it, else
    the largest micro-batch with it; compiling where it is off (it lets more tokens fit)."""
    checkpointing = largest[False] < NO_CHECKPOINTING_FROM
    tokens = largest[checkpointing]
    if tokens == 0:
        return "nothing fits one device: more ranks (--nproc-per-node)"
    flags = f"--max-tokens-per-micro-batch {tokens}" + (" --activation-checkpointing" if checkpointing else "")
    return flags + ("" if compiled else " (with --compile more fits)")


def memory_plan_from(cfg: MemoryConfig) -> dict:
    from echo2cli.models import resolve_model_config

    shape = Shape.from_config_file(cfg.config_json or resolve_model_config(cfg.model, cfg.revision))
    return memory_plan(
        shape,
        ranks=cfg.ranks,
        device_gib=cfg.device_gib,
        micro_batch_tokens=cfg.micro_batch_tokens,
        completion_tokens=cfg.micro_batch_tokens if cfg.completion_tokens is None else cfg.completion_tokens,
        checkpointing=cfg.activation_checkpointing,
        rollout_gib=cfg.rollout_gib,
        utilization=cfg.gpu_memory_utilization,
        tensor_parallel=cfg.tensor_parallel_size,
        context=cfg.context,
        compiled=cfg.compile,
    )
