"""The learner's training step at real model sizes: step time, tokens/s, MFU and peak memory against `plan-memory`,
on a randomly initialised Qwen3-shaped model built from its config on the device (no download, no weights on disk).

    python scripts/bench_learner_gpu.py --shape 1.7b [--groups 8 --group-size 8 --prompt-tokens 256]
        [--completion-tokens 1024] [--variable] [--micro-batch-tokens 16384] [--activation-checkpointing]
        [--steps 3] [--lora] [--compile] [--export] [--checkpoint DIR] [--profile FILE] [--json FILE]
    torchrun --nproc-per-node N scripts/bench_learner_gpu.py ...      # the sharded trainer (FSDP2, NCCL on CUDA)

MFU = 6 N x tokens/s / peak, with N the parameters (a tied head counted once), tokens/s the median of the steps'
own rates (tokens = every completion token plus each group's prompt once: a packed micro-batch runs a shared prompt
once), and peak the device's dense bf16 rate (989 TFLOP/s for an H100/H200 by the datasheet; `--peak-tflops`).
`--variable` draws completion lengths uniformly from [completion/8, 2 x completion - completion/8] (the same mean):
packing should keep tokens/s.
The first step is a warm-up; step time is the median of the rest. Runs on CPU too (`--shape tiny`), for a dry run.
`--profile FILE` runs one more step under torch.profiler: the kernels' device time by kind (matmuls, attention,
fused/elementwise, optimizer, copies), the device's busy share of the step, and the top kernels into FILE.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: a baseline tree can go first

SHAPES = {  # Qwen3 configs (config.json of Qwen/Qwen3-*), vocabulary 151,936, tied heads as released
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=4096, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip


def build(shape: str, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, pad_token_id=0)
    with torch.device(device):
        return Qwen3ForCausalLM(cfg)


def batch(a: argparse.Namespace, step: int, vocab: int) -> list:
    from echo2cli.learner.types import Group
    from echo2cli.protocol import Sample

    g = torch.Generator().manual_seed(step)
    low = max(1, a.completion_tokens // 8)
    groups = []
    for p in range(a.groups):
        prompt = torch.randint(1, vocab, (a.prompt_tokens,), generator=g).tolist()
        samples = []
        for i in range(a.group_size):
            n = int(torch.randint(low, 2 * a.completion_tokens - low + 1, (1,), generator=g)) if a.variable else None
            n = n or a.completion_tokens
            ids = torch.randint(1, vocab, (n,), generator=g).tolist()
            samples.append(Sample(prompt_id=p, sample_idx=i, completion_token_ids=ids, logprobs=[-11.0] * n))
        groups.append(Group(p, step, prompt, samples, [float(i % 2) for i in range(a.group_size)], "bench"))
    return groups


def make_trainer(a: argparse.Namespace, model: torch.nn.Module, sharded: bool):
    from echo2cli.learner.trainer import Trainer
    from echo2cli.protocol import LoraSpec

    kwargs: dict = dict(lr=1e-6, clip_eps=0.2, is_cap=3.0, kl_coef=0.0, max_grad_norm=1.0, micro_batch=4096,
                        max_tokens_per_micro_batch=a.micro_batch_tokens,
                        activation_checkpointing=a.activation_checkpointing)  # fmt: skip
    if a.compile:
        kwargs["compile"] = True
    if a.lora:
        kwargs["lora"] = LoraSpec(rank=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    if "model" in inspect.signature(Trainer.__init__).parameters:
        if sharded:
            from echo2cli.learner.sharded import ShardedTrainer

            return ShardedTrainer(None, model=model, **kwargs)
        return Trainer(None, model=model, **kwargs)
    # an older trainer (the baseline) loads only from a directory
    directory = Path(tempfile.mkdtemp(prefix="bench-gpu-model-"))
    model.to(torch.bfloat16).save_pretrained(directory)
    del model
    try:
        return Trainer(directory, **kwargs)
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


def planned_gib(a: argparse.Namespace, ranks: int) -> float:
    from echo2cli.plan.memory import GiB, Shape, learner_memory

    shape = Shape.from_config(SHAPES[a.shape])
    head = min(a.micro_batch_tokens or 10**9, a.group_size * a.groups * a.completion_tokens)
    m = learner_memory(shape, ranks, a.micro_batch_tokens, head, a.activation_checkpointing, a.compile)
    return m.total / GiB


def logp_error(trainer, groups: list) -> dict:
    """The trainer's log-probs (bf16 layers, fp32 head) against the same model all in fp32 (TF32 off), over the
    completion tokens of two groups: what bf16 compute costs in accuracy."""
    rows = [(g.prompt_token_ids, s.completion_token_ids, s.logprobs) for g in groups[:2] for s in g.samples]
    pack = trainer._pack(rows)
    with torch.no_grad():
        fast = trainer._token_logp(trainer.policy, pack)
        autocast, tf32, head = trainer.autocast, torch.backends.cuda.matmul.allow_tf32, trainer.policy.bf16_head
        trainer.autocast, torch.backends.cuda.matmul.allow_tf32, trainer.policy.bf16_head = False, False, False
        exact = trainer._token_logp(trainer.policy, pack)
        trainer.autocast, torch.backends.cuda.matmul.allow_tf32, trainer.policy.bf16_head = autocast, tf32, head
    err = (fast - exact).abs()[pack.mask > 0]
    out = {"logp_err_max": round(float(err.max()), 4), "logp_err_mean": round(float(err.mean()), 5)}
    with torch.no_grad():  # the other head: what its operands' bf16 rounding adds
        trainer.policy.bf16_head = not trainer.policy.bf16_head
        other = (trainer._token_logp(trainer.policy, pack) - exact).abs()[pack.mask > 0]
        trainer.policy.bf16_head = not trainer.policy.bf16_head
    name = "tf32" if trainer.policy.bf16_head else "bf16"
    return out | {f"logp_err_{name}_head_max": round(float(other.max()), 4),
                  f"logp_err_{name}_head_mean": round(float(other.mean()), 5)}  # fmt: skip


KINDS = (  # kernel name fragments → kind, first match wins
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("nccl", ("nccl",)),
    ("optimizer", ("multi_tensor", "adam", "fused_adam")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sm90_", "sm80_")),
    ("copy", ("memcpy", "memset", "copy_", "cat", "index", "gather", "scatter")),
    ("compiled", ("triton",)),
)


def profiled_step(trainer, groups: list, path: str, device: torch.device | None) -> dict:
    """One step under torch.profiler: device time per kernel kind, the device's busy share of the step's wall
    time, and a table of the top kernels written to `path`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device is not None else [])
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        trainer.step(groups)
        if device is not None:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    for e in kernels:
        name = e.key.lower()
        kind = next((k for k, parts in KINDS if any(p in name for p in parts)), "elementwise")
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e6
    busy = sum(by_kind.values())
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]
    lines = [f"profiled step: {wall:.3f} s wall, {busy:.3f} s of kernels"]
    lines += [f"{e.self_device_time_total / 1e3:10.1f} ms {e.count:6d}x  {e.key[:140]}" for e in top]
    lines += ["", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)]
    Path(path).write_text("\n".join(lines) + "\n")
    return {
        "profile_wall_s": round(wall, 3),
        "profile_busy": round(busy / wall, 3),
        "profile_s": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
    }


def attention_kernel(device: torch.device | None) -> str:
    try:
        from echo2cli.learner.packing import kernel
    except ImportError:
        return "padded (baseline trainer)"
    return kernel(device or "cpu")


def export_times(trainer) -> dict[str, float]:
    """The version's snapshot as the publisher takes it (`weights_image`: pinned, asynchronous copies; the first
    one allocates and pins the buffer, the second reuses it from torch's pinned-memory cache), against the
    per-tensor pageable copy it replaced (`published_weights`), and the write of the file from the image."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-export-") as tmp:
        for attempt in ("first", "second"):
            t = time.perf_counter()
            image = trainer.weights_image()
            out[f"snapshot_{attempt}_s"] = round(time.perf_counter() - t, 2)
            if attempt == "first":
                t = time.perf_counter()
                image.write(Path(tmp) / "model.safetensors")
                out["write_s"] = round(time.perf_counter() - t, 2)
            del image
        t = time.perf_counter()
        trainer.published_weights()
        out["snapshot_pageable_s"] = round(time.perf_counter() - t, 2)
    out["export_s"] = out["snapshot_first_s"] + out["write_s"]
    return out


def report(out: dict, path: str | None) -> None:
    """One result as a JSON line on stdout and, with `path`, appended to that file."""
    line = json.dumps(out)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def main(a: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharded = "LOCAL_RANK" in os.environ
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    if device is not None:
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    model = build(a.shape, device or torch.device("cpu"))
    params = sum(p.numel() for p in model.parameters())
    trainer = make_trainer(a, model, sharded)
    if a.fp32_head:
        trainer.policy.bf16_head = False
    t_start = time.perf_counter() - t0
    vocab = SHAPES[a.shape]["vocab_size"]
    if sharded and trainer.rank != 0:
        trainer.follow()
        from echo2cli.learner.sharded import leave

        leave(0)
    from echo2cli.learner.trainer import Trainer

    times, tokens = [], []
    for step in range(a.steps):
        groups = batch(a, step, vocab)
        if device is not None:
            torch.cuda.synchronize()
        t = time.perf_counter()
        metrics = trainer.step(groups)
        if device is not None:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        tokens.append(
            sum(len(g.prompt_token_ids) + sum(len(s.completion_token_ids) for s in g.samples) for g in groups)
        )  # noqa: E501
        print(f"step {step}: {times[-1]:.2f} s, loss {metrics['train/loss']:.4f}", flush=True)
    step_s = statistics.median(times[1:] or times)
    rates = [n / t for n, t in zip(tokens, times, strict=True)]  # each step's own: --variable steps differ in tokens
    rate = statistics.median(rates[1:] or rates)
    out = {
        "shape": a.shape, "params": params, "ranks": world, "sharded": sharded, "lora": a.lora,
        "variable": a.variable, "micro_batch_tokens": a.micro_batch_tokens,
        "activation_checkpointing": a.activation_checkpointing,
        "sequences": a.groups * a.group_size, "prompt_tokens": a.prompt_tokens,
        "completion_tokens": a.completion_tokens, "start_s": round(t_start, 2),
        "step_s": round(step_s, 3), "steps_s": [round(t, 3) for t in times],
        "tokens_per_s": round(rate), "mfu": round(6 * params * rate / (a.peak_tflops * 1e12), 4),
        "device": torch.cuda.get_device_name(device) if device is not None else "cpu",
        "torch": torch.__version__, "baseline_trainer": ".baseline" in Path(inspect.getfile(Trainer)).parts,
        "attention": attention_kernel(device), "compile": a.compile,
        "bf16_head": getattr(getattr(trainer, "policy", None), "bf16_head", False),
    }  # fmt: skip
    if device is not None:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        out["plan_gib"] = round(planned_gib(a, world), 2)
    if a.logp_error:
        out |= logp_error(trainer, batch(a, 0, vocab))
    if a.export:
        out |= export_times(trainer)
    if a.checkpoint:
        import shutil

        target = Path(a.checkpoint) / f"ckpt-{a.shape}"
        target.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        trainer.save_checkpoint(target)
        out["checkpoint_s"] = round(time.perf_counter() - t, 2)
        out["checkpoint_gib"] = round(sum(f.stat().st_size for f in target.rglob("*") if f.is_file()) / 2**30, 2)
        shutil.rmtree(target, ignore_errors=True)
    report(out, a.json)
    if a.profile:  # last, and reported apart: a profile that outlasts the run's time limit loses nothing else
        report({"shape": a.shape, "profile": profiled_step(trainer, batch(a, a.steps, vocab), a.profile, device)}, None)
    trainer.close()
    if sharded:
        from echo2cli.learner.sharded import leave

        leave(0)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion-tokens", type=int, default=1024)
    p.add_argument("--variable", action="store_true", help="completion lengths drawn around the same mean")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--lora", action="store_true", help="train rank-16 adapters on the attention projections")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (the trainer's --compile)")
    p.add_argument("--fp32-head", action="store_true", help="the head's operands in fp32 (TF32), not bf16")
    p.add_argument("--profile", help="profile one more step; top kernels into this file")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--logp-error", action="store_true", help="log-prob error of bf16 compute against fp32")
    p.add_argument("--export", action="store_true", help="time the bf16 version's export after the steps")
    p.add_argument("--checkpoint", help="time a checkpoint written under this directory (removed after)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--json", help="append the result line to this file")
    main(p.parse_args())
