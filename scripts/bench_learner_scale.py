"""The sharded learner at world size 1 and 2 (torchrun, FSDP2; gloo on CPU, NCCL on CUDA) on a randomly initialised
Qwen3-architecture model: step time, peak RSS (CPU) or peak CUDA memory per rank, what building the trainer added
to that peak (start-up: each rank loads only its shards), and the bytes of parameters,
gradients and AdamW state each rank holds, against world size 1 in the same run. Also checks the bf16 version both
export after the same steps, element by element.

    .venv/bin/python scripts/bench_learner_scale.py [--hidden 1024 --layers 16 --intermediate 3072]
        [--ranks 1,2] [--prompts 4 --group-size 4 --prompt-tokens 64 --completion-tokens 64] [--steps 3]
        [--micro-batch-tokens 1024] [--activation-checkpointing] [--kl-coef 0.05]

On CPU the cores are split evenly: world size 1 gets all of them, each of N ranks 1/N (OMP_NUM_THREADS).
The first step is a warm-up; step time is the median of the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()


def build_model(out: Path, a: argparse.Namespace) -> int:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.hidden // a.heads,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def groups(a: argparse.Namespace, step: int) -> list:
    from echo2cli.learner.types import Group
    from echo2cli.protocol import Sample

    g = torch.Generator().manual_seed(step)
    out = []
    for p in range(a.prompts):
        prompt = torch.randint(1, a.vocab, (a.prompt_tokens,), generator=g).tolist()
        samples = [
            Sample(
                prompt_id=p,
                sample_idx=i,
                completion_token_ids=torch.randint(1, a.vocab, (a.completion_tokens,), generator=g).tolist(),
                logprobs=(-10.0 + torch.rand(a.completion_tokens, generator=g)).tolist(),
            )
            for i in range(a.group_size)
        ]
        out.append(Group(p, step, prompt, samples, [float(i % 2) for i in range(a.group_size)], "bench"))
    return out


def held_bytes(trainer) -> int:
    """Parameters, gradients and optimizer state this rank holds (its shards under FSDP)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in trainer.model.parameters():
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for state in trainer.opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += local(v).numel() * local(v).element_size()
    return total


def peak_bytes() -> int:
    import resource

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_main(a: argparse.Namespace) -> None:
    """One rank under torchrun: rank 0 drives the steps, the others follow; each writes its figures."""
    from echo2cli.learner.sharded import ShardedTrainer, leave

    before = peak_bytes()
    trainer = ShardedTrainer(
        a.model,
        lr=1e-5,
        clip_eps=0.2,
        is_cap=3.0,
        kl_coef=a.kl_coef,
        max_grad_norm=1.0,
        micro_batch=64,
        max_tokens_per_micro_batch=a.micro_batch_tokens,
        activation_checkpointing=a.activation_checkpointing,
    )
    startup = peak_bytes() - before  # what building the trainer (policy, KL reference, shards) added at its peak
    times: list[float] = []
    if trainer.rank == 0:
        for step in range(a.steps):
            t0 = time.perf_counter()
            metrics = trainer.step(groups(a, step))
            times.append(time.perf_counter() - t0)
        trainer.export_weights(a.out / "version.safetensors")
        trainer.close()
        tokens = metrics["train/tokens"]
    else:
        trainer.follow()
        tokens = 0.0
    figures = {"rank": trainer.rank, "held_bytes": held_bytes(trainer), "peak_bytes": peak_bytes(), "times": times}
    figures["tokens"], figures["startup_bytes"] = tokens, startup
    (a.out / f"rank{trainer.rank}.json").write_text(json.dumps(figures))
    leave(0)  # not interpreter finalization, where gloo's threads can abort a finished rank (`leave`)


def run_world(a: argparse.Namespace, model: Path, ranks: int, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    cores = os.cpu_count() or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // ranks))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(HERE)]
    cmd += ["--rank-main", "--model", str(model), "--out", str(out)]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in PASSED and v is not None]
    cmd += ["--activation-checkpointing"] if a.activation_checkpointing else []
    subprocess.run(cmd, check=True, env=env)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


PASSED = (
    "kl_coef",
    "vocab",
    "prompts",
    "group_size",
    "prompt_tokens",
    "completion_tokens",
    "steps",
    "micro_batch_tokens",
)


def compare_versions(a: Path, b: Path) -> tuple[int, int, float]:
    """(elements that differ, elements, largest difference) between two bf16 version files."""
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    differ = sum(int((x[k] != y[k]).sum()) for k in x)
    largest = max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
    return differ, sum(v.numel() for v in x.values()), largest


def main(a: argparse.Namespace) -> None:
    gib = 1 << 30
    with tempfile.TemporaryDirectory(prefix="echo2-scale-") as tmp:
        model = Path(tmp) / "model"
        n_params = build_model(model, a)
        print(
            f"Qwen3-architecture model, random init: {n_params / 1e6:.1f} M parameters; device "
            f"{'cuda' if torch.cuda.is_available() else 'cpu'}, {os.cpu_count()} cores"
        )
        results = {}
        for ranks in [int(r) for r in a.ranks.split(",")]:
            results[ranks] = run_world(a, model, ranks, Path(tmp) / f"w{ranks}")
        base = results[min(results)]
        base_held = max(r["held_bytes"] for r in base)
        base_step = statistics.median(base[0]["times"][1:] or base[0]["times"])
        base_start = max(r["startup_bytes"] for r in base)
        print(
            f"{'ranks':>5} {'step s':>8} {'compl tok/s':>11} {'held/rank GiB':>14} {'vs 1':>6} {'peak/rank GiB':>14} "
            f"{'start-up/rank GiB':>18} {'vs 1':>6}"
        )
        for ranks, rs in results.items():
            step = statistics.median(rs[0]["times"][1:] or rs[0]["times"])
            held = max(r["held_bytes"] for r in rs)
            peak = max(r["peak_bytes"] for r in rs)
            start = max(r["startup_bytes"] for r in rs)
            print(
                f"{ranks:>5} {step:>8.2f} {rs[0]['tokens'] / step:>11.0f} {held / gib:>14.3f} "
                f"{held / base_held:>6.3f} {peak / gib:>14.3f} {start / gib:>18.3f} {start / max(base_start, 1):>6.3f}"
                f"   (step time vs 1: {step / base_step:.2f})"
            )
        for ranks in results:
            if ranks != min(results):
                one, many = (Path(tmp) / f"w{n}" / "version.safetensors" for n in (min(results), ranks))
                differ, total, largest = compare_versions(one, many)
                print(
                    f"bf16 version, {ranks} ranks vs {min(results)}: {differ} of {total} elements differ "
                    f"(largest difference {largest:.3g})"
                )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the frozen KL reference model")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--completion-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    rank_main(args) if args.rank_main else main(args)
