"""The learner's step on long completions: time and peak memory of one GRPO step on the default model with
completions of 512 tokens (the baseline, measured in the same run) and of `--long` tokens, with and without
activation checkpointing, micro-batches sized by a token budget. Each setting runs in a fresh process, so its
peak RSS is its own.

    .venv/bin/python scripts/bench_long_completions.py [--long 7680] [--group-size 4] [--budget 8192] [--steps 2]

The default model has 8,192 positions: a 512-token prompt budget leaves 7,680 for the completion. The batch is
one prompt (64 tokens) x G samples of random token ids, all of the given completion length; the second step
is timed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()


def one_setting(a: argparse.Namespace) -> dict:
    from echo2cli.learner.trainer import Trainer
    from echo2cli.learner.types import Group
    from echo2cli.models import prepare_default_model
    from echo2cli.protocol import Sample

    trainer = Trainer(
        prepare_default_model(),
        lr=1e-6,
        clip_eps=0.2,
        is_cap=3.0,
        kl_coef=0.0,
        max_grad_norm=1.0,
        micro_batch=64,
        max_tokens_per_micro_batch=a.budget,
        activation_checkpointing=a.checkpointing,
    )
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (64,), generator=g).tolist()
    samples = [
        Sample(
            prompt_id=0,
            sample_idx=i,
            completion_token_ids=torch.randint(100, 40000, (a.length,), generator=g).tolist(),
            logprobs=(-10.0 + torch.rand(a.length, generator=g)).tolist(),
        )
        for i in range(a.group_size)
    ]
    group = Group(0, 0, prompt, samples, [float(i % 2) for i in range(a.group_size)], "bench")
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        trainer.step([group])
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": times[-1], "peak_rss": rss, "tokens": a.length * a.group_size}


def run(a: argparse.Namespace, length: int, checkpointing: bool) -> dict:
    cmd = [sys.executable, str(HERE), "--one", f"--length={length}", f"--group-size={a.group_size}"]
    cmd += [f"--budget={a.budget}", f"--steps={a.steps}"] + (["--checkpointing"] if checkpointing else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(a: argparse.Namespace) -> None:
    gib = 1 << 30
    rows = [(512, False), (512, True), (a.long, False), (a.long, True)]
    results = {row: run(a, *row) for row in rows}
    base = results[(512, False)]
    print(
        f"default model, 1 prompt x G = {a.group_size}, token budget {a.budget} per micro-batch, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'completion':>10} {'checkpointing':>13} {'step s':>8} {'vs 512':>7} {'tokens/s':>9} {'peak RSS GiB':>13} "
        f"{'vs 512':>7}"
    )
    for (length, ckpt), r in results.items():
        print(
            f"{length:>10} {'on' if ckpt else 'off':>13} {r['step_s']:>8.1f} {r['step_s'] / base['step_s']:>7.2f} "
            f"{r['tokens'] / r['step_s']:>9.0f} {r['peak_rss'] / gib:>13.2f} {r['peak_rss'] / base['peak_rss']:>7.2f}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long", type=int, default=7680)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_setting(args)))
    else:
        main(args)
