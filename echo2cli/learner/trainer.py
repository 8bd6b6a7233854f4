"""The GRPO trainer: one optimizer step per batch of groups, and bf16 export of the weights.

Scoring is at the workers' sampling temperature T: log softmax(z / T) of each sampled token, the
distribution it was drawn from (the engine returns the same, `worker/engine.py`). Parameters and AdamW state
stay in fp32; the forward/backward pass runs under bf16 autocast where the
hardware has bf16 (CUDA, or a CPU with AVX512-BF16/AMX), in fp32 elsewhere, and on the weights rounded to bf16 as
they are published (`rounding.py`). Sequences are
prompt + completion exactly as the worker's engine produced them (no re-tokenization), right-padded, in
micro-batches whose losses are weighted by their share of completion tokens so the step equals one
token-level mean over the whole batch.

A flat group (all G rewards equal) has advantage 0 on every token, so without a KL term its tokens add exactly
nothing to the gradient: with `skip_flat_groups` (the default) it gets no forward or backward pass at all. Its tokens
still count in the token mean's denominator, so the gradient, and the step AdamW takes on it, are the same as with
the pass. The health metrics (and so the divergence guard) are over the trained tokens, the ones that carry the
gradient; `train/trained_frac` is their share of the batch's.

With a LoraSpec the base stays frozen and only PEFT's adapters train (`echo2cli/lora.py`): a version is the
adapter tensors, the KL reference is the same model with its adapters switched off, and a checkpoint holds the
adapters and their optimizer state.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from echo2cli.broadcast.image import VersionImage, wire_name
from echo2cli.errors import ConfigError
from echo2cli.hardware import cpu_has_bf16
from echo2cli.layout import WEIGHTS_FILE
from echo2cli.learner.batching import micro_batches, mini_batches
from echo2cli.learner.grpo import PROXIMAL_MODES, compute_advantages, flat_groups, grpo_loss, worst_tokens
from echo2cli.learner.packing import Pack, use_packed_attention, varlen_mode
from echo2cli.learner.rounding import as_published, dither_master, read_at_fp32
from echo2cli.learner.schedule import LrSchedule
from echo2cli.learner.types import Group
from echo2cli.lora import adapter_state, attach_adapters, base_state_published, load_adapters, save_adapters
from echo2cli.protocol import LoraSpec, Sample


def _autocast_ok(device: torch.device) -> bool:
    return device.type == "cuda" or cpu_has_bf16()


def _training_device(device: torch.device | None) -> torch.device:
    """`device`, or CUDA where there is one. On CUDA, fp32 matmuls (the vocabulary head's, `TokenLogp`) run on TF32
    tensor cores."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return device


def _checked_wire(wire: torch.dtype, bf16_compute: bool) -> torch.dtype:
    """`wire` if the trainer can compute with the weights as published in it: fp16 only without bf16 compute,
    whose layers would take the weights rounded to bf16 again."""
    if wire != torch.bfloat16 and bf16_compute:
        raise ConfigError(
            f"--wire-dtype {wire_name(wire)} needs a learner computing in fp32, and this one computes in bf16 "
            "(CUDA, or a CPU with bf16): use --wire-dtype bf16, or on a CPU ECHO2_CPU_BF16=0"
        )
    return wire


def _load(model_dir: Path, device: torch.device) -> torch.nn.Module:
    """The causal LM in `model_dir`, in fp32 on `device`; a ModelError naming the cause if it does not load."""
    from transformers import AutoModelForCausalLM

    from echo2cli.learner.shard_load import does_not_load

    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    except Exception as exc:  # transformers, safetensors and torch each raise their own kinds
        raise does_not_load(model_dir, exc) from exc


def compile_layers(*models: torch.nn.Module | None, backend: str = "inductor") -> None:
    """Each decoder layer of each model compiled in place (`nn.Module.compile`), before any FSDP2 wrapping, as
    torchtitan does: the layers share their code, so dynamo makes one graph for all of them (parameters are its
    inputs), with dynamic shapes from the start so that micro-batches of any length run it. The packed attention
    stays outside the graph (`packing.packed_attention`), so the graph depends on no micro-batch's layout and is
    never recompiled for one; activation checkpointing (transformers') recomputes through the same graph."""
    for model in models:
        for layer in model.get_decoder().layers if model is not None else ():
            layer.compile(dynamic=True, backend=backend)


def _loss_tokens(row: tuple) -> int:
    """A row's tokens with a loss: its completion, less a transcript's environment tokens (policy mask 0)."""
    policy = row[3] if len(row) > 3 else None
    return len(row[1]) if policy is None else sum(policy)


def _outlier(g: Group, s: Sample, pos: int, log_w: float) -> dict[str, Any]:
    """One sampled token where trainer and engine disagree: where it is, both log-probs, who made it."""
    return {
        "log_w": log_w,
        "behaviour_logp": s.logprobs[pos],
        "trainer_logp": s.logprobs[pos] + log_w,
        "token": s.completion_token_ids[pos],
        "position": pos,
        "length": len(s.completion_token_ids),
        "finish_reason": s.finish_reason,
        "version": g.version,
        "worker_id": g.worker_id,
        "prompt_id": g.prompt_id,
        "sample_idx": s.sample_idx,
    }


LAG_PREFIX = "offpolicy_sum/"  # raw per-staleness sums inside a step's metrics until `split_by_lag`


def add_by_lag(sums: dict[str, float], rows: dict[str, list[float]], lags: list[int]) -> None:
    """Add per-row sums (`grpo_loss`, read back) into `sums` under LAG_PREFIX<lag>/<name>."""
    for name, values in rows.items():
        for lag, v in zip(lags, values, strict=True):
            key = f"{LAG_PREFIX}{lag}/{name}"
            sums[key] = sums.get(key, 0.0) + v


def split_by_lag(sums: dict[str, float]) -> dict[str, Any]:
    """The raw per-staleness sums turned into `offpolicy/by_staleness` ({lag: means over its tokens}) and
    `train/is_ess`, the normalised effective sample size of the batch's importance weights,
    (sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2): 1 when every weight is equal, 1/n when one token has all."""
    raw: dict[str, dict[str, float]] = {}
    out: dict[str, Any] = {}
    for key, v in sums.items():
        if key.startswith(LAG_PREFIX):
            lag, name = key[len(LAG_PREFIX) :].split("/")
            raw.setdefault(lag, {})[name] = v
        else:
            out[key] = v
    by_lag = {}
    for lag, r in sorted(raw.items(), key=lambda kv: int(kv[0])):
        n = max(r["tokens"], 1.0)
        by_lag[lag] = {
            "tokens": r["tokens"],
            "kl_behaviour": r["kl_behaviour"] / n,
            "is_ess": r["w"] ** 2 / max(r["tokens"] * r["w_sq"], 1e-30),
            "clipfrac": r["clipped"] / n,
            "truncated_frac": r["truncated"] / n,
            "masked_frac": r["dropped"] / n,
        }
    out["offpolicy/by_staleness"] = by_lag
    if "train/is_weight_sq_mean" in out:
        out["train/is_ess"] = out["train/is_weight_mean"] ** 2 / max(out["train/is_weight_sq_mean"], 1e-30)
    return out


def batch_rows(
    groups: list[Group], version: int | None
) -> tuple[list[tuple], list[tuple[Group, Sample]], list[int], list[int]]:
    """A batch's samples as trainer rows (prompt ids, completion ids, behaviour log-probs, policy mask), each with
    its (group, sample), its staleness (bucket 0 without a `version`) and its group's index."""
    rows = [(g.prompt_token_ids, s.completion_token_ids, s.logprobs, s.policy_mask) for g in groups for s in g.samples]
    origin = [(g, s) for g in groups for s in g.samples]
    lags = [0 if version is None else version - g.version for g in groups for _ in g.samples]
    return rows, origin, lags, [k for k, g in enumerate(groups) for _ in g.samples]


def step_report(
    sums: dict[str, float], tokens: tuple[int, int], norms: list[float], outliers: list, adv: torch.Tensor, t0: float
) -> dict[str, Any]:
    """A step's metrics from its read-back sums; `tokens`: the batch's completion tokens and those trained."""
    total, trained = tokens
    out = split_by_lag(sums)
    # the batch's objective: a flat group's tokens add 0 to its sum and 1 each to its count (0 with none trained)
    out["train/loss"] = out.get("train/loss", 0.0) * trained / max(total, 1)
    t_train = time.perf_counter() - t0
    return {
        **out,
        "train/grad_norm": sum(norms) / len(norms),
        "train/tokens": float(total),
        "train/trained_frac": trained / max(total, 1),
        "train/abs_log_ratio_max": max((abs(o["log_w"]) for o in outliers), default=0.0),
        "train/advantage_nonzero_frac": float((adv.abs() > 1e-6).float().mean()),
        "learner/t_train_s": t_train,
        "perf/train_tokens_per_s": total / t_train,
    }


def zero_gradient(model: torch.nn.Module) -> None:
    """The gradient a backward pass of advantage-0 tokens makes: zeros, so AdamW steps on its moments as then."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


LOGIT_CHUNK = 2048  # completion positions whose vocabulary logits exist at once (long completions)


class TokenLogp(torch.nn.Module):
    """A causal LM scoring its completion tokens: the log-prob of each policy token at temperature T.

    The micro-batch comes packed (`packing.Pack`): no pad tokens, each distinct prompt run once for all the
    samples that share it (with `share_prompts`; otherwise once per sample), gradients flowing back into it from
    every completion. The vocabulary projection (49k x 576 for the default model, ~20 % of a token's FLOPs) runs
    only on the positions that predict a policy token, with fp32 logits: bf16 logits would be rounded by up to
    0.06 at a logit of 16, a log-prob error of the size the off-policy weights are meant to see. Its operands are
    fp32 (TF32 on CUDA), or with `bf16_head` bf16 with fp32 accumulation (`Bf16Logits`, the trainer's choice
    where the layers compute in bf16 on CUDA: twice the matmul rate, and on an H200 the same log-prob error
    against an all-fp32 model as TF32's, 0.026 mean, since the bf16 layers' error dominates). Past
    LOGIT_CHUNK positions it runs a chunk at a time and again in the backward pass (activation checkpointing of
    the head alone): the fp32 logits of a 16k-token completion over a 150k vocabulary would otherwise take
    ~10 GB per copy. One module with one forward, so that a sharded trainer can wrap it whole (`sharded.py`)."""

    def __init__(self, model: torch.nn.Module, share_prompts: bool = True, bf16_head: bool = False) -> None:
        super().__init__()
        self.model = model
        self.share_prompts = share_prompts
        self.bf16_head = bf16_head  # the head's matmuls on bf16 operands, fp32 accumulation and logits (`Bf16Logits`)

    def forward(self, pack: Pack, temperature: float) -> torch.Tensor:
        """[N, C] log-probs, completion-aligned (column j = completion token j); 0 where the policy mask is 0."""
        if pack.input_ids.is_cuda:  # decided here, once, not inside a layer that activation checkpointing reruns
            cfg = self.model.config
            dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
            heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
            pack.varlen = varlen_mode(pack.input_ids.device, dtype, heads, kv_heads)
        hidden = self.model.get_decoder()(
            input_ids=pack.input_ids, position_ids=pack.position_ids, use_cache=False, echo2_pack=pack
        ).last_hidden_state[0]
        picked = hidden.index_select(0, pack.pick)
        targets = pack.targets
        if len(targets) <= LOGIT_CHUNK:
            logp = self._logp(picked, targets, temperature)
        else:
            from torch.utils.checkpoint import checkpoint

            parts = [
                checkpoint(
                    self._logp,
                    picked[i : i + LOGIT_CHUNK],
                    targets[i : i + LOGIT_CHUNK],
                    temperature,
                    use_reentrant=False,
                )
                for i in range(0, len(targets), LOGIT_CHUNK)
            ]
            logp = torch.cat(parts)
        out = torch.zeros(pack.shape, dtype=torch.float32, device=logp.device)
        return out.index_put((pack.slot // pack.shape[1], pack.slot % pack.shape[1]), logp)  # not a view: FSDP2

    def _logp(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        with torch.autocast(hidden.device.type, enabled=False):
            if type(head) is torch.nn.Linear:  # z / T as (W h / T) + b / T: the scale on [M, H], not [M, V]
                scaled = hidden if temperature == 1.0 else hidden / temperature
                bias = None if head.bias is None else head.bias.float() / temperature
                if self.bf16_head:
                    logits = Bf16Logits.apply(scaled, head.weight)
                    logits = logits if bias is None else logits + bias
                else:
                    logits = F.linear(scaled.float(), head.weight.float(), bias)
            else:  # a head with adapters of its own (LoRA) computes in its weights' dtype
                logits = head(hidden.to(head.weight.dtype)).float() / temperature
            return -F.cross_entropy(logits, targets, reduction="none")


class Bf16Logits(torch.autograd.Function):
    """hidden [M, H] @ weight [V, H]^T on bf16 operands with fp32 accumulation and fp32 logits, and the same for
    both gradients: twice TF32's matmul rate on Hopper, and no rounding of the logits themselves (bf16 logits
    would be off by up to 0.06 at 16). On the CPU the same numbers come from fp32 matmuls on the rounded operands."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h, w = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(h, w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return _mm_fp32(h, w.t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        h, w = ctx.saved_tensors
        g = grad.to(torch.bfloat16)
        grad_h = _mm_fp32(g, w).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        grad_w = _mm_fp32(g.t(), h).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 matrices into fp32 (cuBLAS's bf16 GEMM with an fp32 output where torch has it)."""
    if a.is_cuda:
        with contextlib.suppress(TypeError, RuntimeError, NotImplementedError):  # an older torch: no out_dtype
            return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def read_back(
    parts: list[tuple[list[int], dict[str, Any]]], lags: list[int], origin: list[tuple[Group, Sample]]
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The micro-batches' device metrics in one read: token-weighted means (maxima for the `_max` metrics),
    the per-staleness sums (`add_by_lag`) and the worst tokens (`_outlier`)."""
    if not parts:
        return {}, []
    names = list(parts[0][1]["metrics"])
    row_names = list(parts[0][1]["rows"])
    metrics = torch.stack([torch.stack([p["metrics"][k].float() for k in names]) for _, p in parts]).tolist()
    per_row = torch.cat([torch.stack([p["rows"][k].float() for k in row_names]) for _, p in parts], 1).tolist()
    worst = [[t.tolist() for t in p["worst"]] for _, p in parts]
    sums: dict[str, float] = {}
    for (_, part), values in zip(parts, metrics, strict=True):
        for k, v in zip(names, values, strict=True):
            sums[k] = max(sums.get(k, v), v) if k.endswith("_max") else sums.get(k, 0.0) + v * part["share"]
    row_lags = [lags[i] for chunk, _ in parts for i in chunk]
    add_by_lag(sums, dict(zip(row_names, per_row, strict=True)), row_lags)
    outliers = []
    for (chunk, _), (log_w, where_rows, cols, valid) in zip(parts, worst, strict=True):
        for lw, row, pos, ok in zip(log_w, where_rows, cols, valid, strict=True):
            if ok:
                group, sample = origin[chunk[row]]
                outliers.append(_outlier(group, sample, pos, lw))
    return sums, outliers


def scheduled_lr(opt: torch.optim.Optimizer, schedule: LrSchedule | None, version: int | None) -> float:
    """The rate of the step that trains `version`, set on `opt` (alike on every rank: `step` is told `version`)."""
    if schedule is not None and version is not None:
        for group in opt.param_groups:
            group["lr"] = schedule.at(version)
    return float(opt.param_groups[0]["lr"])


def adamw(
    model: torch.nn.Module, lr: float, fused: bool, dither_seed: int | None, wire: torch.dtype = torch.bfloat16
) -> torch.optim.AdamW:
    """AdamW on the trainable parameters, whose fp32 master is first dithered inside its rounding intervals in the
    wire dtype with `dither_seed` unless it is None (`rounding.dither_master`: small steps then reach the
    published policy)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if dither_seed is not None:
        dither_master(trainable, dither_seed, wire)
    return torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.99), weight_decay=0.0, fused=fused or None)


class Trainer:
    def __init__(
        self,
        model_dir: Path,
        *,
        lr: float,
        clip_eps: float,
        is_cap: float,
        kl_coef: float,
        max_grad_norm: float,
        micro_batch: int,
        temperature: float = 1.0,
        max_tokens_per_micro_batch: int = 0,
        activation_checkpointing: bool = False,
        off_policy: str = "token_tis",
        geo_low: float = 0.99,
        geo_high: float = 1.01,
        share_prompts: bool = True,
        lora: LoraSpec | None = None,
        device: torch.device | None = None,
        model: torch.nn.Module | None = None,
        bf16: bool | None = None,
        compile: bool = False,
        dither_seed: int | None = None,
        wire_dtype: torch.dtype = torch.bfloat16,
        minibatches: int = 1,
        skip_flat_groups: bool = True,
        lr_schedule: LrSchedule | None = None,  # each step's rate, by its version (`schedule.py`); None: `lr`
    ) -> None:
        """`temperature`: the workers' sampling T. Tokens were drawn from softmax(z / T), so the policy whose ratio to
        the behaviour policy is taken, and which the gradient moves, is softmax(z / T) too. A micro-batch holds at most
        `micro_batch` sequences and, if `max_tokens_per_micro_batch` > 0, at most that many padded tokens.
        `activation_checkpointing` recomputes each layer's activations in the backward pass: less memory, more compute.
        `off_policy`, `geo_low`, `geo_high`: the off-policy correction and its bounds (`grpo.py`). `share_prompts`: run
        a prompt shared by sequences of a micro-batch once (`TokenLogp`). `lora`: train adapters of that spec on the
        frozen model. `model`: a causal LM to train instead of `model_dir`'s. `bf16`: compute in bf16 (autocast in one
        process, bf16 layers under FSDP2); None = where the hardware has bf16 (CUDA, or a CPU with AVX512-BF16/AMX).
        `compile`: each decoder layer through `torch.compile` at the first step (`compile_layers`). `dither_seed`:
        `adamw`. `wire_dtype`: `_checked_wire`. `minibatches`: optimizer steps a batch. `skip_flat_groups`: see top."""
        self.device = _training_device(device)
        self.model = self._policy_model(model_dir, model).train()
        self.autocast = _autocast_ok(self.device) if bf16 is None else bf16
        self.wire_dtype = _checked_wire(wire_dtype, self.autocast)
        self.lora, self.peft = lora, attach_adapters(self.model, lora) if lora is not None else None  # rest frozen
        if activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ref = self._reference_model(model_dir) if kl_coef > 0 and self.peft is None else None
        use_packed_attention(self.model, ref)
        if compile:
            compile_layers(self.model, ref)
        bf16_head = self.autocast and self.device.type == "cuda"  # see TokenLogp
        self.policy = self._placed(TokenLogp(self.model, share_prompts, bf16_head), model_dir)
        self.ref = None if ref is None else self._placed(TokenLogp(ref, share_prompts, bf16_head), model_dir)
        self.rounded = read_at_fp32(self.model, self.autocast)  # computed with as published (`rounding.py`)
        self.opt = adamw(self.model, lr, self.device.type == "cuda", dither_seed, wire_dtype)
        self.clip_eps, self.is_cap, self.kl_coef, self.lr_schedule = clip_eps, is_cap, kl_coef, lr_schedule
        self.off_policy, self.geo_low, self.geo_high = off_policy, geo_low, geo_high
        self.max_grad_norm, self.micro_batch, self.minibatches = max_grad_norm, micro_batch, minibatches
        self.max_tokens_per_micro_batch, self.temperature = max_tokens_per_micro_batch, temperature
        self.skip_flat = skip_flat_groups and not kl_coef  # a KL term gives a flat group a gradient
        self.outliers: list[dict] = []

    # -- where the models live: one process holds them whole; `ShardedTrainer` overrides these three ----------

    def _policy_model(self, model_dir: Path, model: torch.nn.Module | None) -> torch.nn.Module:
        return model.to(self.device, torch.float32) if model is not None else _load(model_dir, self.device)

    def _reference_model(self, model_dir: Path) -> torch.nn.Module:
        """The frozen KL reference: a copy of the policy, in bf16 where the forward runs in bf16 anyway."""
        ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        return ref.to(torch.bfloat16) if self.autocast else ref

    def _placed(self, scorer: TokenLogp, model_dir: Path) -> TokenLogp:
        return scorer

    def _token_logp(self, model: torch.nn.Module, pack: Pack) -> torch.Tensor:
        """Log-prob of each completion token, [N, C] completion-aligned; 0 where the policy mask is 0."""
        policy = model if isinstance(model, TokenLogp) else TokenLogp(model)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return policy(pack, self.temperature)

    def _pack(self, rows: Sequence[tuple]) -> Pack:
        """rows of (prompt ids, completion ids, behaviour logprobs[, policy mask]) → one packed micro-batch
        (`packing.py`). A multi-turn transcript's environment tokens (policy mask 0) are inputs only: no loss."""
        return Pack(rows, self.device, share_prompts=self.policy.share_prompts)

    def step(self, groups: list[Group], version: int | None = None) -> dict[str, Any]:
        """One batch: `minibatches` optimizer steps, each a token-mean over a run of whole groups (`mini_batches`;
        one step on the whole batch by default). `version`: the policy version being trained, so the off-policy
        health can be told per staleness bucket (version - group version); without it all is bucket 0. Metrics
        stay on the device through the micro-batches and are read back once, at the end. Flat groups: module
        docstring."""
        t0 = time.perf_counter()
        lr = scheduled_lr(self.opt, self.lr_schedule, version)
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        advantages = compute_advantages(rewards).flatten()
        flat = flat_groups(rewards).tolist() if self.skip_flat else [False] * len(groups)
        rows, origin, lags, group_of = batch_rows(groups, version)
        runs = [set(run) for run in mini_batches(len(groups), self.minibatches)]
        plans = [self._plan(rows, [i for i, k in enumerate(group_of) if k in run], group_of, flat) for run in runs]
        prox = self._proximal_logp(plans, rows) if len(plans) > 1 and self.off_policy in PROXIMAL_MODES else {}
        parts, norms = [], []
        total_tokens, trained_tokens = sum(plan[0] for plan in plans), sum(plan[1] for plan in plans)
        for k, (total, _, chunks) in enumerate(plans):
            self.opt.zero_grad(set_to_none=True)
            with as_published(self.rounded, self.wire_dtype):
                for j, chunk in enumerate(chunks):
                    part = self._accumulate(chunk or [0], rows, advantages, total, float(bool(chunk)), prox.get((k, j)))
                    if chunk:  # the metrics are the trained tokens': a part's share of them, not of its mini-batch
                        parts.append((chunk, {**part, "share": part["share"] * total / max(trained_tokens, 1)}))
            if not chunks:  # flat groups only, on every rank: the zero gradient their passes would have made
                zero_gradient(self.model)
            norms.append(self._clip_grad_norm())
            self.opt.step()
        sums, outliers = read_back(parts, lags, origin)
        self.outliers = sorted(self._gather(outliers), key=lambda o: -abs(o["log_w"]))[:5]
        tokens = (total_tokens, trained_tokens)
        return {**step_report(self._reduce_metrics(sums), tokens, norms, self.outliers, advantages, t0), "train/lr": lr}

    def _plan(self, rows: list, selected: list[int], group_of: list[int], flat: list[bool]) -> tuple[int, int, list]:
        """A mini-batch (`selected` rows): its completion tokens over every rank, those of its rows to train (not
        in a `flat` group), and this rank's micro-batches of those, padded with empty ones to the most any rank
        has (each rank makes as many passes)."""
        lengths = [len(p) + len(c) for p, c, _, _ in rows]
        trained = [i for i in selected if not flat[group_of[i]]]
        mine = [trained[i] for i in self._my_rows([lengths[j] for j in trained])]
        groups = group_of if self.policy.share_prompts else None
        budget, most = self.max_tokens_per_micro_batch, self.micro_batch
        chunks = micro_batches(mine, lengths, budget, most, groups, True, [len(p) for p, _, _, _ in rows])
        padded = chunks + [[]] * (self._micro_batch_count(len(chunks)) - len(chunks))
        return sum(_loss_tokens(rows[i]) for i in selected), sum(_loss_tokens(rows[i]) for i in trained), padded

    @torch.no_grad()
    def _proximal_logp(self, plans: list[tuple[int, int, list[list[int]]]], rows: list) -> dict[tuple[int, int], Any]:
        """pi_prox's log-probs for the micro-batches of every mini-batch after the first, scored before the batch's
        first optimizer step, by (mini-batch, micro-batch); the first mini-batch's pi_prox is sg(pi_theta)."""
        out = {}
        with as_published(self.rounded, self.wire_dtype):
            for k, (_, _, chunks) in enumerate(plans[1:], 1):
                for j, chunk in enumerate(chunks):
                    logp = self._token_logp(self.policy, self._pack([rows[i] for i in chunk or [0]]))
                    if chunk:
                        out[(k, j)] = logp
        return out

    def _accumulate(
        self, chunk: list[int], rows: list, adv: torch.Tensor, total: int, weight: float, prox: torch.Tensor | None
    ) -> dict[str, Any]:
        """Forward and backward over one micro-batch, its loss weighted by its share of the mini-batch's completion
        tokens (times `weight`: 0 for a pass a rank makes only to keep step with the others). `prox`: pi_prox's
        log-probs of its tokens (`_proximal_logp`; None: sg of this pass's). Nothing is read back from the device
        here: the metrics, per-row sums and worst tokens come back as device tensors."""
        pack = self._pack([rows[i] for i in chunk])
        logp = self._token_logp(self.policy, pack)
        ref_logp = None
        if self.kl_coef > 0:
            with torch.no_grad(), self._reference():
                ref_logp = self._token_logp(self.ref or self.policy, pack)
        loss, metrics, per_row = grpo_loss(
            logp,
            pack.behaviour,
            adv[chunk].to(self.device, non_blocking=True),
            pack.mask,
            clip_eps=self.clip_eps,
            is_cap=self.is_cap,
            ref_logp=ref_logp,
            kl_coef=self.kl_coef,
            off_policy=self.off_policy,
            geo_low=self.geo_low,
            geo_high=self.geo_high,
            prox_logp=prox,
        )
        share = sum(_loss_tokens(rows[i]) for i in chunk) / max(total, 1)
        (loss * (share * weight * self._loss_scale())).backward()
        worst = worst_tokens(logp, pack.behaviour, pack.mask)
        return {"share": share, "metrics": metrics, "worst": worst, "rows": per_row}

    def _reference(self) -> contextlib.AbstractContextManager:
        """The KL reference is `self.ref`, or with LoRA the policy with its adapters off."""
        return self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext()

    # -- what a sharded trainer does differently (sharded.py); one process does it all ---------------

    def _my_rows(self, lengths: list[int]) -> list[int]:
        return list(range(len(lengths)))

    def _micro_batch_count(self, mine: int) -> int:
        return mine

    def _loss_scale(self) -> float:
        return 1.0

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return sums

    def _gather(self, outliers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return outliers

    def _clip_grad_norm(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))

    def _full_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights in the wire dtype on the CPU (None on a rank that does not write); with LoRA, the
        adapters' alone, named as PEFT saves them."""
        state = adapter_state(self.peft) if self.peft is not None else self.model.state_dict()
        return {k: v.detach().to("cpu", self.wire_dtype).contiguous() for k, v in state.items()}

    def published_base_weights(self) -> dict[str, torch.Tensor]:
        """With LoRA: the frozen base's weights in the wire dtype (version 0), named as without adapters."""
        return base_state_published(self.model, self.wire_dtype)

    def close(self) -> None:
        """Nothing to release in one process (a sharded trainer releases its other ranks)."""

    def published_weights(self) -> dict[str, torch.Tensor] | None:
        """A copy of the weights in the wire dtype on the CPU to publish (None on a rank that does not write); a tied
        lm_head is left out as HF does. The copy is the version: training may go on while it is written."""
        tensors = self._full_state()
        if tensors is not None and getattr(self.model.config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)
        return tensors

    def weights_image(self, reuse: VersionImage | None = None) -> VersionImage | None:
        """The version to publish as its file's bytes in host memory (None on a rank that does not write): each
        tensor cast and copied straight to its place, through pinned memory on CUDA (broadcast/image.py), with no
        bf16 copy of each tensor on the way. Training may go on while it is written. `reuse`: a published
        version's image whose memory this one may take over (`VersionImage`)."""
        state = adapter_state(self.peft) if self.peft is not None else self.model.state_dict()
        if self.peft is None and getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return VersionImage(state, reuse, self.wire_dtype)

    def export_weights(self, path: Path) -> None:
        """Write model.safetensors in the wire dtype."""
        tensors = self.published_weights()
        if tensors is not None:
            write_weights(tensors, path)

    def save_checkpoint(self, directory: Path) -> None:
        """Weights (fp32 safetensors + config), AdamW state and RNG states into `directory`."""
        self._save(directory)

    def load_checkpoint(self, directory: Path) -> None:
        """Weights, optimizer and RNG states from `save_checkpoint` (the KL reference stays the base model)."""
        self._load(directory)

    def _save(self, directory: Path) -> None:
        if self.peft is not None:  # the adapters (fp32) and the model's config; the base is version 0's file
            save_adapters(self.peft, directory)
        else:
            self.model.save_pretrained(directory)
        torch.save(self.opt.state_dict(), directory / "optimizer.pt")
        save_rng(directory / "rng.pt")

    def _load(self, directory: Path) -> None:
        if self.peft is not None:
            load_adapters(self.peft, directory, self.device)
        else:
            load_whole_weights(self.model, directory / WEIGHTS_FILE, self.device)
        if not (directory / "optimizer.pt").exists() and (directory / "dcp").is_dir():
            raise ValueError("it was written by a sharded learner: resume it with --nproc-per-node 2 or more")
        self.opt.load_state_dict(load_plain(directory / "optimizer.pt", self.device))
        restore_rng(directory / "rng.pt")


def load_plain(path: Path, device: torch.device | None = None) -> Any:
    """A torch.save file of tensors, numbers and containers only (weights_only). A checkpoint directory is data;
    with pickle's defaults a crafted optimizer.pt or rng.pt would run code when loaded."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{path} is a pickle that is not plain tensors and numbers: not loading it "
            f"({str(exc).splitlines()[0][:120]})"
        ) from exc


def save_rng(path: Path, cuda: bool = True) -> None:
    """torch's and Python's RNG states, so that a resumed run draws what this one would have, and with `cuda` those
    of every visible GPU (a sharded learner's rank 0 leaves them out: reading them opens a context on each GPU)."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if cuda and torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, path)


def restore_rng(path: Path) -> None:
    rng = load_plain(path)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def load_whole_weights(model: torch.nn.Module, path: Path, device: torch.device) -> None:
    """A checkpoint's safetensors into `model`, which must take every tensor (a tied lm_head is not saved)."""
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(str(path), device=str(device)), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"checkpoint weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def write_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`tensors` as a safetensors file at `path`, whole or not at all (a full disk leaves no half file)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.rename(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
